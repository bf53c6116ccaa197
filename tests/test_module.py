"""Our Redis module (accumulator/module/accsum.c): ACC.ADD against the client's reduction, bad
input refused without a change (fuzzed), the choice of path, and a sanitizer build."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from _helpers import entry_key_names
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import accumulator
from accumulator import _acl, _apply, _chunks, _module, _reduce, _scripts
from accumulator._keys import SCHEMA_VERSION, Keys
from accumulator.testing import RedisServer, find_server_binary

MiB = 1 << 20
DTYPES = ["float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
          "uint64"]  # fmt: skip


@pytest.fixture
def mod(module_url: str) -> redis.Redis:
    r = redis.Redis.from_url(module_url)
    r.flushdb()
    return r


def make(url, name="m", shape=(4 * MiB // 4,), dtype=np.float32, **kw):
    return accumulator.ConditionalAccumulator(dtype, shape=shape, shared_name=name, client=url,
                                              **kw)  # fmt: skip


# -- the command --------------------------------------------------------------------------------


FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURE_OK)
@given(st.sampled_from(DTYPES), st.integers(0, 600), st.data())
def test_acc_add_is_the_clients_sum_bit_for_bit(mod, dtype, n, data):
    """Every bit pattern (subnormals, infinities, NaNs, wrapping integers): the module's
    in-place add is the client's sequential in-dtype add with TF's flush-to-zero."""
    dtype = np.dtype(dtype)
    raw = data.draw(st.binary(min_size=2 * n * dtype.itemsize, max_size=2 * n * dtype.itemsize))
    cut = n * dtype.itemsize
    a, b = np.frombuffer(raw[:cut], dtype), np.frombuffer(raw[cut:], dtype)
    mod.set("a", a.tobytes())
    mod.set("b", b.tobytes())
    assert mod.execute_command("ACC.ADD", "a", "b", _module.module_dtype(dtype)) == n
    want = np.empty(n, dtype)
    with np.errstate(all="ignore"):
        _reduce.reduce_into(want, [a, b], "SUM")
    assert mod.get("a") == want.tobytes()
    assert mod.get("b") == b.tobytes()


BAD = [
    (("ACC.ADD", "a", "b"), "wrong number"),
    (("ACC.ADD", "a", "b", "f32", "x"), "wrong number"),
    (("ACC.ADD", "a", "b", "f16"), "unknown dtype"),
    (("ACC.ADD", "a", "b", ""), "unknown dtype"),
    (("ACC.ADD", "a", "a", "f32"), "same key"),
    (("ACC.ADD", "a", "missing", "f32"), "src does not exist"),
    (("ACC.ADD", "missing", "a", "f32"), "dst does not exist"),
    (("ACC.ADD", "a", "list", "f32"), "src is not a string"),
    (("ACC.ADD", "hash", "a", "f32"), "dst is not a string"),
    (("ACC.ADD", "a", "short", "f32"), "lengths differ"),
    (("ACC.ADD", "odd", "odd2", "f32"), "whole elements"),
    (("ACC.ADD", "a", "c", "f64"), "whole elements"),
    (("ACC.PING", "x"), "wrong number"),
]


@pytest.mark.parametrize("command,message", BAD, ids=[" ".join(c[1:]) for c, _ in BAD])
def test_bad_input_is_refused_and_changes_nothing(mod, command, message):
    mod.set("a", np.arange(3, dtype=np.float32).tobytes())
    mod.set("c", np.ones(3, np.float32).tobytes())
    mod.set("short", b"\0\0\0\0")
    mod.set("odd", b"\0" * 7)
    mod.set("odd2", b"\0" * 7)
    mod.rpush("list", b"x" * 12)
    mod.hset("hash", "f", b"x" * 12)
    before = {k: mod.dump(k) for k in mod.scan_iter()}
    with pytest.raises(redis.ResponseError, match=message):
        mod.execute_command(*command)
    assert {k: mod.dump(k) for k in mod.scan_iter()} == before
    assert mod.ping()


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(st.lists(st.one_of(st.sampled_from([b"a", b"b", b"f32", b"f64", b"i8", b"u64"]),
                          st.binary(max_size=12)), max_size=6),
       st.binary(max_size=64), st.binary(max_size=64))  # fmt: skip
def test_fuzzed_commands_never_hurt_the_server(mod, args, a, b):
    mod.set("a", a)
    mod.set("b", b)
    try:
        reply = mod.execute_command("ACC.ADD", *args)
    except redis.ResponseError:
        assert (mod.get("a"), mod.get("b")) == (a, b)  # refused: nothing changed
    else:
        assert isinstance(reply, int) and (len(mod.get("a")), len(mod.get("b"))) == (len(a), len(b))
    assert mod.ping()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())  # fmt: skip
    except OSError:
        return set()


def test_ping_names_the_module_and_its_kernels(mod):
    reply = mod.execute_command("ACC.PING").decode()
    assert reply.startswith("accsum 1 kernels=")
    assert _module.server_has_module(mod)
    kernels = reply.split("=", 1)[1]
    host = mod.connection_pool.connection_kwargs.get("host")
    if host in ("127.0.0.1", "localhost") and platform.machine() == "x86_64" and (
            "avx2" in _cpu_flags()):  # fmt: skip
        # a server on this host, its module built with gcc or clang on x86-64: the CPU's
        # best instances are in use
        assert kernels == ("avx512f" if "avx512f" in _cpu_flags() else "avx2")
    else:
        assert kernels in ("base", "avx2", "avx512f")


@pytest.fixture(scope="module")
def base_kernels() -> Iterator[redis.Redis]:
    """A server running the module with its plain (SSE2) float kernels, whatever the CPU."""
    so = _module.build()
    if find_server_binary() is None or so is None:
        pytest.skip("needs redis-server and a C compiler")
    with RedisServer(module=False, args=["--loadmodule", str(so), "kernels", "base"]) as server:
        client = redis.Redis.from_url(server.url)
        assert client.execute_command("ACC.PING") == b"accsum 1 kernels=base"
        yield client


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(st.sampled_from(["float32", "float64"]), st.integers(0, 300), st.data())
def test_the_base_kernels_give_the_same_bits(mod, base_kernels, dtype, n, data):
    """Every bit pattern, added by the CPU's best kernels and by the plain ones: the same
    bytes, and the client's reduction's (as above)."""
    dtype = np.dtype(dtype)
    raw = data.draw(st.binary(min_size=2 * n * dtype.itemsize, max_size=2 * n * dtype.itemsize))
    cut = n * dtype.itemsize
    out = []
    for server in (mod, base_kernels):
        server.set("a", raw[:cut])
        server.set("b", raw[cut:])
        assert server.execute_command("ACC.ADD", "a", "b", _module.module_dtype(dtype)) == n
        out.append(server.get("a"))
    want = np.empty(n, dtype)
    with np.errstate(all="ignore"):
        _reduce.reduce_into(want, [np.frombuffer(raw[:cut], dtype),
                                   np.frombuffer(raw[cut:], dtype)], "SUM")  # fmt: skip
    assert out[0] == out[1] == want.tobytes()


@pytest.mark.parametrize("args", [["kernels"], ["kernels", "fast"], ["x", "base"], ["base"]])
def test_a_load_argument_it_does_not_know_fails_the_load(args):
    so = _module.build()
    binary = find_server_binary()
    if binary is None or so is None:
        pytest.skip("needs redis-server and a C compiler")
    from accumulator._testing_groups import _free_port

    done = subprocess.run([binary, "--port", str(_free_port()), "--save", "", "--loadmodule",
                           str(so), *args], capture_output=True, text=True, timeout=30,
                          check=False)  # fmt: skip
    assert done.returncode != 0
    assert "accsum" in done.stdout + done.stderr


# -- the path an accumulator takes --------------------------------------------------------------


def test_the_sum_stays_in_redis_one_gradient_whatever_the_workers(module_url, mod):
    acc = make(module_url, reduction_type="SUM")
    assert acc.sums_in_redis
    grads = [np.full(MiB, float(i), np.float32) for i in range(1, 6)]
    for g in grads:
        assert acc.apply_grad(g, local_step=0)
    (entry,) = mod.lrange(acc._keys.grads, 0, -1)
    parts = entry_key_names(entry)
    n = _chunks.n_parts(4 * MiB)
    assert entry.startswith(b"s5 %d " % n) and sum(mod.strlen(k) for k in parts) == 4 * MiB
    blobs = [k for k in mod.scan_iter(match=acc._keys.pattern) if b":b:" in k]
    assert sorted(blobs) == sorted(parts)  # the applied gradients' own parts are freed
    assert int(mod.hget(acc._keys.state, "bytes")) == 4 * MiB
    np.testing.assert_array_equal(acc.take_grad(5), np.full(MiB, 15.0, np.float32))


FOLD_SIZE = (_chunks.FOLD_PARTS * 2 + 3) * _chunks.CHUNK_BYTES // 4 + 5  # float32: 20 parts


def _grads(k: int) -> list[np.ndarray]:
    # integer-valued floats: every order of the additions gives the same sums exactly
    rng = np.random.default_rng(k)
    return [rng.integers(-50, 50, FOLD_SIZE).astype(np.float32) for _ in range(k)]


def _entries(mod, acc) -> list[bytes]:
    return [e.split(b" ", 1)[0] for e in mod.lrange(acc._keys.grads, 0, -1)]


def test_a_large_apply_is_added_a_few_parts_per_script(module_url, mod, monkeypatch):
    """No script adds more than FOLD_PARTS parts into the sum (one adding a 64 MiB gradient
    blocked Redis ~25 ms): the apply adds the first ones, fold calls the rest."""
    acc = make(module_url, shape=(FOLD_SIZE,), reduction_type="SUM")
    calls: list[str] = []
    real_call = _scripts.call
    monkeypatch.setattr(_scripts, "call", lambda c, name, *a: (calls.append(name),
                                                              real_call(c, name, *a))[1])
    grads = _grads(4)
    for g in grads:
        assert acc.apply_grad(g, local_step=0)
    n = _chunks.n_parts(FOLD_SIZE * 4)
    assert calls.count("fold") == 3 * -(-(n - _chunks.FOLD_PARTS) // _chunks.FOLD_PARTS)
    assert _entries(mod, acc) == [b"s4"]  # folded in: one sum, nothing held apart
    parts = entry_key_names(mod.lindex(acc._keys.grads, 0))
    assert sorted(k for k in mod.scan_iter(match=acc._keys.pattern) if b":b:" in k) == sorted(parts)
    assert int(mod.hget(acc._keys.state, "bytes")) == FOLD_SIZE * 4
    np.testing.assert_array_equal(acc.take_grad(4), np.sum(grads, axis=0))


def test_the_pending_bytes_limit_counts_what_the_round_holds_before_the_apply(module_url, mod):
    """On the module path a round holds the sum, one gradient: a limit of 1.5 gradients takes
    any number of applies made one after another, also of gradients folded in a few parts
    per script (it counted the sum and the gradient being folded, two: the second apply of a
    large gradient was refused). Only a gradient larger than the limit is refused."""
    nbytes = FOLD_SIZE * 4
    acc = make(module_url, shape=(FOLD_SIZE,), reduction_type="SUM",
               max_pending_bytes=nbytes * 3 // 2)  # fmt: skip
    grads = _grads(4)
    for g in grads:
        assert acc.apply_grad(g, local_step=0)
    assert _entries(mod, acc) == [b"s4"]
    assert int(mod.hget(acc._keys.state, "bytes")) == nbytes
    np.testing.assert_array_equal(acc.take_grad(4), np.sum(grads, axis=0))
    small = make(module_url, name="small", shape=(FOLD_SIZE,), max_pending_bytes=nbytes - 1)
    with pytest.raises(accumulator.ResourceExhaustedError, match="max_pending_bytes"):
        small.apply_grad(grads[0], local_step=0)
    assert not [k for k in mod.scan_iter(match=small._keys.pattern) if b":b:" in k]


def test_gradients_whose_folds_stopped_count_against_the_limit(module_url, mod, monkeypatch):
    """What gradients hold apart until their folds end counts (workers killed between their
    apply and their folds, or many large applies at once): the round stays bounded (a
    review: six such gradients under a limit of 1.5)."""
    nbytes = FOLD_SIZE * 4
    acc = make(module_url, shape=(FOLD_SIZE,), reduction_type="SUM",
               max_pending_bytes=nbytes * 5 // 2)  # fmt: skip
    grads = _grads(4)
    assert acc.apply_grad(grads[0], local_step=0)  # the sum
    monkeypatch.setattr(_apply, "fold", lambda acc, blob: iter(()))  # their clients stop
    for g in grads[1:3]:  # held 1, then 2 gradients before each: within 2.5
        assert acc.apply_grad(g, local_step=0)
    assert _entries(mod, acc) == [b"s1", b"f%d" % _chunks.FOLD_PARTS, b"f%d" % _chunks.FOLD_PARTS]
    assert int(mod.hget(acc._keys.state, "bytes")) == 3 * nbytes
    with pytest.raises(accumulator.ResourceExhaustedError, match="max_pending_bytes"):
        acc.apply_grad(grads[3], local_step=0)  # held 3
    np.testing.assert_array_equal(acc.take_grad(3), np.sum(grads[:3], axis=0))


@pytest.mark.parametrize("folds", [0, 1, 2])
def test_a_round_taken_before_its_folds_ended_is_read_whole(module_url, mod, monkeypatch, folds):
    """A worker that dies between its apply and its folds (or half-way through them) leaves
    'f<k>' entries: the take reads the sum plus the parts not folded yet."""
    acc = make(module_url, shape=(FOLD_SIZE,), reduction_type="MEAN")
    grads = _grads(3)
    stopped: list[str] = []
    # the applying client stops before its folds: it records the gradient's key instead
    monkeypatch.setattr(_apply, "fold", lambda acc, blob: iter(stopped.append(blob) or ()))
    for g in grads:
        assert acc.apply_grad(g, local_step=0)
    for _ in range(folds):  # the last one's fold folds the first one's parts first
        left = _scripts.call(acc.redis, "fold", [acc._keys.state, acc._keys.grads],
                             [SCHEMA_VERSION, stopped[-1], 3])  # fmt: skip
        assert left == _chunks.n_parts(FOLD_SIZE * 4) - _chunks.FOLD_PARTS
    k = _chunks.FOLD_PARTS + 3 * folds
    assert _entries(mod, acc) == [b"s1", b"f%d" % k, b"f%d" % _chunks.FOLD_PARTS]
    want = np.empty(FOLD_SIZE, np.float32)
    _reduce.reduce_into(want, grads, "MEAN")
    np.testing.assert_array_equal(acc.take_grad(3), want)
    assert int(mod.hget(acc._keys.state, "n_quarantined") or 0) == 0
    assert not [k for k in mod.scan_iter(match=acc._keys.pattern) if b":b:" in k]
    # a fold of a gradient whose round was taken meanwhile does nothing
    assert _scripts.call(acc.redis, "fold", [acc._keys.state, acc._keys.grads],
                         [SCHEMA_VERSION, stopped[0], 1]) == 0  # fmt: skip


def _cancelling(size: int) -> list[np.ndarray]:
    # float32: (1e8 + 1) - 1e8 is 0 in this order, (1e8 - 1e8) + 1 is 1 in another
    return [np.full(size, v, np.float32) for v in (1e8, 1.0, -1e8)]


@pytest.mark.parametrize("dead", [False, True])
def test_folds_go_in_apply_order(module_url, mod, monkeypatch, dead):
    """A later gradient's fold never overtakes an earlier one's: it folds the earlier one's
    parts first, also those of a worker that died before its folds. The sum is then the
    in-order sum bit for bit (floats do not associate)."""
    acc = make(module_url, shape=(FOLD_SIZE,), reduction_type="SUM")
    grads = _cancelling(FOLD_SIZE)
    real_fold, stopped = _apply.fold, []
    monkeypatch.setattr(_apply, "fold", lambda acc, blob: iter(stopped.append(blob) or ()))
    assert acc.apply_grad(grads[0], local_step=0)  # the sum
    assert acc.apply_grad(grads[1], local_step=0)  # stopped before its folds (dead, or slow)
    if dead:  # the third applies and folds: its fold folds the second one's parts first
        monkeypatch.setattr(_apply, "fold", real_fold)
        assert acc.apply_grad(grads[2], local_step=0)
    else:  # the third folds before the second gets to
        assert acc.apply_grad(grads[2], local_step=0)
        assert _entries(mod, acc) == [b"s1", b"f8", b"f8"]
        while _scripts.call(acc.redis, "fold", [acc._keys.state, acc._keys.grads],
                            [SCHEMA_VERSION, stopped[-1], 3]):  # fmt: skip
            pass
        assert _scripts.call(acc.redis, "fold", [acc._keys.state, acc._keys.grads],
                             [SCHEMA_VERSION, stopped[0], 3]) == 0  # fmt: skip
    assert _entries(mod, acc) == [b"s3"]
    want = np.empty(FOLD_SIZE, np.float32)
    _reduce.reduce_into(want, grads, "SUM")
    assert not want.any()
    np.testing.assert_array_equal(acc.take_grad(3), want)


def test_a_fold_that_cannot_go_on_stops_and_folds_nothing_after_it(module_url, mod, monkeypatch):
    """A part of an earlier gradient being folded is gone (evicted): the folds stop there
    (a later one would overtake it) and say so with 0, so the caller's loop ends."""
    acc = make(module_url, shape=(FOLD_SIZE,), reduction_type="SUM")
    stopped: list[str] = []
    monkeypatch.setattr(_apply, "fold", lambda acc, blob: iter(stopped.append(blob) or ()))
    for g in _grads(3):
        assert acc.apply_grad(g, local_step=0)
    mod.delete(entry_key_names(mod.lindex(acc._keys.grads, 1))[0])  # the next part to fold
    before = mod.lrange(acc._keys.grads, 0, -1)
    assert _scripts.call(acc.redis, "fold", [acc._keys.state, acc._keys.grads],
                         [SCHEMA_VERSION, stopped[-1], 3]) == 0  # fmt: skip
    assert mod.lrange(acc._keys.grads, 0, -1) == before


def test_a_lost_sum_takes_the_gradients_being_folded_into_it_along(module_url, mod, monkeypatch,
                                                                   caplog):  # fmt: skip
    """The round's running sum loses a part (evicted): the take quarantines it, and with it
    every gradient being folded into it (their first parts were in it only). The others
    are taken; the accumulator is not stuck."""
    acc = make(module_url, shape=(FOLD_SIZE,), reduction_type="SUM")
    monkeypatch.setattr(_apply, "fold", lambda acc, blob: iter(()))
    grads = _grads(2)
    for g in grads:
        assert acc.apply_grad(g, local_step=0)
    mod.delete(entry_key_names(mod.lindex(acc._keys.grads, 0))[3])
    with (caplog.at_level(logging.WARNING, logger="accumulator"),
          pytest.raises(accumulator.DeadlineExceededError)):
        acc.take_grad(1, timeout=0.2)
    assert "quarantined 2 corrupt" in caplog.text
    assert acc.num_accumulated() == 0 and mod.llen(acc._keys.quarantine) == 2
    assert b"in the lost sum" in mod.lindex(acc._keys.quarantine, 1)
    assert not [k for k in mod.scan_iter(match=acc._keys.pattern) if b":b:" in k]
    assert acc.apply_grad(grads[0], local_step=1)
    np.testing.assert_array_equal(acc.take_grad(1), grads[0])


def test_a_round_given_back_mid_fold_is_taken_whole_again(module_url, mod, monkeypatch):
    acc = make(module_url, shape=(FOLD_SIZE,), reduction_type="SUM")
    grads = _grads(2)
    monkeypatch.setattr(_apply, "fold", lambda acc, blob: iter(()))
    for g in grads:
        assert acc.apply_grad(g, local_step=0)
    monkeypatch.setattr(_reduce, "reduce_into", _raise_memory_error)
    with pytest.raises(MemoryError):
        acc.take_grad(2)
    monkeypatch.undo()
    assert _entries(mod, acc) == [b"s1", b"f%d" % _chunks.FOLD_PARTS]
    np.testing.assert_array_equal(acc.take_grad(2), np.sum(grads, axis=0))


def _raise_memory_error(*args, **kwargs):
    raise MemoryError


def test_keys_read_fold_entries_as_the_scripts_do():
    keys = Keys("", "n")
    blob = keys.blob("ab", 3).encode()
    assert keys.entry_keys(b"f2 4 " + blob) == [keys.part(blob, 2), keys.part(blob, 3)]
    assert keys.entry_first_part(b"f2 4 " + blob) == 2 and keys.entry_weight(b"f2 4 " + blob) == 1
    for bad in (b"f4 4 ", b"f0 4 ", b"f5 4 ", b"f2 4 other:b:ab:3", b"f 4 "):
        assert keys.entry_keys(bad + (blob if bad.endswith(b" ") else b"")) is None, bad


def test_a_later_opener_follows_the_stored_path(module_url, mod, caplog):
    first = make(module_url, sum_in_redis=False)
    assert not first.sums_in_redis and not make(module_url).sums_in_redis
    other = make(module_url, "other")
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        assert make(module_url, "other", sum_in_redis=False).sums_in_redis
        assert not make(module_url, sum_in_redis=True).sums_in_redis
    # either way round, the opener that asked otherwise is told
    said = [r.getMessage() for r in caplog.records if "applies only when" in r.getMessage()]
    assert len(said) == 2 and "sums in Redis" in said[0] and "on the taker" in said[1]
    assert other.sums_in_redis


def test_types_the_module_does_not_add_stay_on_the_plain_path(module_url):
    assert not make(module_url, "h", dtype=np.float16).sums_in_redis
    assert not make(module_url, "c", dtype=np.complex64).sums_in_redis
    with pytest.raises(accumulator.InvalidArgumentError, match="float16"):
        make(module_url, "h2", dtype=np.float16, sum_in_redis=True)
    sparse = accumulator.SparseConditionalAccumulator(np.float32, (10, 2), "s", client=module_url)
    assert not sparse.sums_in_redis


def test_sum_in_redis_needs_the_module(real_url):
    redis.Redis.from_url(real_url).flushdb()
    with pytest.raises(accumulator.InvalidArgumentError, match="accsum") as refused:
        make(real_url, sum_in_redis=True)
    assert not isinstance(refused.value, ConnectionError)  # not transient: nothing retries it
    assert not make(real_url).sums_in_redis
    with pytest.raises(accumulator.InvalidArgumentError, match="sum_in_redis"):
        make(real_url, "x", sum_in_redis="yes")


def test_a_server_that_lost_the_module_refuses_and_changes_nothing():
    if find_server_binary() is None or _module.find_compiler() is None:
        pytest.skip("needs redis-server and a C compiler")
    with RedisServer(module=True, args=["--enable-module-command", "yes"]) as server:
        acc = make(server.url)
        acc.apply_grad(np.ones(MiB, np.float32), local_step=0)
        r = redis.Redis.from_url(server.url)
        assert r.execute_command("MODULE", "UNLOAD", "accsum") == b"OK"
        before = {k: r.dump(k) for k in r.scan_iter(match=acc._keys.pattern)}
        with pytest.raises(accumulator.UnavailableError, match="accsum module"):
            acc.apply_grad(np.ones(MiB, np.float32), local_step=0)
        after = {k: r.dump(k) for k in r.scan_iter(match=acc._keys.pattern)}
        assert after.keys() - before.keys() == set() and acc.num_accumulated() == 1
        # the round taken so far is still readable without the module
        np.testing.assert_array_equal(acc.take_grad(1), np.ones(MiB, np.float32))


def test_replicas_and_the_aof_need_no_module(tmp_path):
    """The adds travel to replicas and the AOF as their effect (``SETRANGE`` of the sum's
    bytes), not as ``ACC.ADD``: a replica without the module had the script's whole
    transaction refused (EXECABORT: the round's count and sum lost there) while ``WAIT``
    counted it, and an AOF needed the module to load."""
    if find_server_binary() is None or _module.find_compiler() is None:
        pytest.skip("needs redis-server and a C compiler")
    n = 3 * MiB // 4 + 5  # three parts: summed in Redis
    with RedisServer(module=True, persistent=True) as primary, \
            RedisServer(module=False) as replica:  # fmt: skip
        replica.client().replicaof("127.0.0.1", primary.port)
        deadline = time.monotonic() + 30  # in sync first: a loaded machine took over 5 s
        while replica.client().info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.05)
        acc = make(primary.url, shape=(n,), reduction_type="SUM", min_replicas=1)
        assert acc.sums_in_redis
        for value in (1.0, 2.0, 4.0):
            assert acc.apply_grad(np.full(n, value, np.float32), local_step=0)
        p, r = primary.client(), replica.client()
        keys = sorted(p.scan_iter(match=acc._keys.pattern))
        assert sorted(r.scan_iter(match=acc._keys.pattern)) == keys
        assert all(r.dump(k) == p.dump(k) for k in keys)
        r.replicaof("no", "one")  # a failover to it: the round is whole there
        on_replica = make(replica.url, shape=(n,), reduction_type="SUM")
        np.testing.assert_array_equal(on_replica.take_grad(3), np.full(n, 7.0, np.float32))
        # the primary restarted from its AOF without the module: loaded, the round readable
        primary.kill()
        primary._module, primary._module_path = False, None
        primary.start()
        after = make(primary.url, shape=(n,), reduction_type="SUM")
        np.testing.assert_array_equal(after.take_grad(3), np.full(n, 7.0, np.float32))


def test_the_worker_role_with_the_module_rules(module_url, mod):
    mod.execute_command(*_acl.setuser_command("worker", "w1", "pw", module=True).split())
    mod.execute_command(*_acl.setuser_command("worker", "w2", "pw").split())
    try:
        url1 = module_url.replace("redis://", "redis://w1:pw@")
        url2 = module_url.replace("redis://", "redis://w2:pw@")
        acc = make(url1, reduction_type="SUM")
        assert acc.sums_in_redis
        acc.apply_grad(np.ones(MiB, np.float32), local_step=0)
        with pytest.raises(accumulator.PermissionDeniedError, match="ACC.PING"):
            make(url2, reduction_type="SUM").apply_grad(np.ones(MiB, np.float32), local_step=0)
        acc.apply_grad(np.ones(MiB, np.float32), local_step=0)
        np.testing.assert_array_equal(acc.take_grad(2), np.full(MiB, 2.0, np.float32))
    finally:
        mod.execute_command("ACL", "DELUSER", "w1", "w2")


# -- a sanitizer build --------------------------------------------------------------------------


def _asan_runtime() -> str | None:
    cc = _module.find_compiler()
    if cc is None:
        return None
    out = subprocess.run([*cc, "-print-file-name=libasan.so"], capture_output=True, text=True,
                         check=False).stdout.strip()  # fmt: skip
    return out if out and os.path.isabs(out) and os.path.exists(out) else None


@pytest.mark.slow
def test_the_module_under_address_sanitizer(tmp_path):
    """The module built with -fsanitize=address,undefined, loaded into a server that preloads
    the ASan runtime: every command of the fuzz above, and a whole accumulator round."""
    binary, runtime = find_server_binary(), _asan_runtime()
    if binary is None or runtime is None:
        pytest.skip("needs redis-server and a compiler with AddressSanitizer")
    so = _module.build(sanitize=True, out_dir=tmp_path)
    assert so is not None
    from accumulator._testing_groups import _free_port

    port = _free_port()  # free now (a fixed guess once met another server's cluster bus port)
    log = tmp_path / "asan.log"
    env = dict(os.environ, LD_PRELOAD=runtime, UBSAN_OPTIONS="print_stacktrace=1",
               ASAN_OPTIONS=f"detect_leaks=0:log_path={log}")  # fmt: skip
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no",
                             "--loadmodule", str(so)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        r = redis.Redis(port=port, socket_timeout=30)
        for _ in range(200):
            assert proc.poll() is None, "the ASan server exited at start"
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        else:
            pytest.fail("the ASan server did not answer within 20 s")
        rng = np.random.default_rng(3)
        for dtype in DTYPES:
            for n in (0, 1, 7, 4096):
                size = n * np.dtype(dtype).itemsize
                r.set("a", rng.bytes(size))
                r.set("b", rng.bytes(size))
                r.execute_command("ACC.ADD", "a", "b", _module.module_dtype(np.dtype(dtype)))
        for command, _ in BAD:
            r.set("a", b"\0" * 12)
            r.set("c", b"\0" * 12)
            with pytest.raises(redis.ResponseError):
                r.execute_command(*command)
        acc = make(f"redis://127.0.0.1:{port}/0", shape=(3 * MiB // 4 + 5,), reduction_type="SUM")
        for _ in range(3):
            acc.apply_grad(np.ones(3 * MiB // 4 + 5, np.float32), local_step=0)
        assert acc.take_grad(3)[-1] == 3.0
        assert r.ping()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    reports = [p.read_text() for p in tmp_path.glob("asan.log*")]
    assert not reports, reports
    assert b"runtime error" not in err, err.decode(errors="replace")[-3000:]


def test_the_build_is_cached_and_needs_only_a_compiler(tmp_path, monkeypatch):
    if _module.find_compiler() is None:
        pytest.skip("no C compiler")
    first = _module.build(out_dir=tmp_path)
    assert first is not None and first.exists()
    inode = first.stat().st_ino  # (a build again would replace the file: another inode)
    assert _module.build(out_dir=tmp_path) == first and first.stat().st_ino == inode
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    assert shutil.which("cc") is None
    assert _module.build(out_dir=tmp_path / "other") is None
    # without a compiler, a build of this very source made before is found (an image whose
    # build stage compiled it); not the sanitizer's, and not one of another source
    assert _module.build(out_dir=tmp_path) == first
    assert _module.build(out_dir=tmp_path, sanitize=True) is None
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "accsum-000000000000-111111111111.so").write_bytes(b"")
    assert _module.build(out_dir=stale) is None


def test_no_compiler_is_said_once_per_process(tmp_path, monkeypatch, caplog):
    """Every server start of a session (restarts, replica sets) logged the same warning
    (new-user review)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        assert [_module.build(out_dir=tmp_path) for _ in range(3)] == [None] * 3
    assert caplog.text.count("no C compiler found") == 1


def test_a_cache_that_cannot_be_written_means_no_module_not_an_error(tmp_path, caplog):
    """(A read-only or misconfigured cache made ``RedisServer(module=None)`` fail to start.)"""
    if _module.find_compiler() is None:
        pytest.skip("no C compiler")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        assert _module.build(out_dir=not_a_dir) is None
    assert "could not be built in" in caplog.text


def test_the_build_is_cached_by_the_compilers_identity(tmp_path, monkeypatch):
    """Another compiler (or the same upgraded: its --version), or ``$CC`` with arguments,
    builds anew; an empty file under the build's name is built again, not trusted."""
    if _module.find_compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.delenv("CC", raising=False)
    plain = _module.build(out_dir=tmp_path)
    assert plain is not None
    wrapper = tmp_path / "bin" / "mycc"
    wrapper.parent.mkdir()
    real = shutil.which(_module.find_compiler()[0])
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "mycc 99"; exit 0; }}\n'
                       f'exec {real} "$@"\n')  # fmt: skip
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    other = _module.build(out_dir=tmp_path)
    assert other is not None and other != plain
    monkeypatch.setenv("CC", f"{wrapper} -DACCSUM_TEST=1")  # arguments: honoured, not dropped
    with_args = _module.build(out_dir=tmp_path)
    assert with_args is not None and with_args not in (plain, other)
    with_args.write_bytes(b"")
    assert _module.build(out_dir=tmp_path) == with_args and with_args.stat().st_size > 0


def test_the_cli_builds_the_module_and_prints_its_path(capsys):
    if _module.find_compiler() is None:
        pytest.skip("no C compiler")
    from accumulator._cli import main

    assert main(["module", "build"]) == 0
    path = capsys.readouterr().out.strip()
    assert path.endswith(".so") and os.path.exists(path)


def _unwritable_cache(tmp_path, monkeypatch) -> None:
    """The default cache directory cannot be made (a file where its parent should be); the
    temporary directory is tmp_path/tmp."""
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(_module.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def test_an_unwritable_cache_builds_in_a_directory_of_this_users_own(tmp_path, monkeypatch):
    """A read-only or missing home (containers, ``nobody``): built under the temporary
    directory instead, in a directory only this user can write (review: no module at all)."""
    if _module.find_compiler() is None:
        pytest.skip("no C compiler")
    _unwritable_cache(tmp_path, monkeypatch)
    built = _module.build()
    assert built is not None and built.parent.parent == tmp_path / "tmp"
    assert built.parent.stat().st_mode & 0o777 == 0o700
    assert _module.why_not_built() is None


def test_a_temporary_directory_others_can_write_is_not_built_in(tmp_path, monkeypatch, capsys):
    """Redis would load whatever shared object another user put there. The CLI says why the
    module was not built (it blamed a missing compiler for every failure)."""
    if _module.find_compiler() is None:
        pytest.skip("no C compiler")
    _unwritable_cache(tmp_path, monkeypatch)
    shared = tmp_path / "tmp" / f"redis-accumulator-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    from accumulator._cli import EXIT_ERROR, main

    assert main(["module", "build"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "could not be built in" in err and str(shared) in err and "compiler" not in err
    assert not list(shared.iterdir())


def test_the_cli_says_when_no_compiler_is_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from accumulator._cli import EXIT_ERROR, main

    assert main(["module", "build"]) == EXIT_ERROR
    assert "no C compiler found" in capsys.readouterr().err


def test_builds_unused_for_a_month_are_deleted_when_another_is_made(tmp_path, monkeypatch):
    """Each source, compiler and flags makes its own build: upgrades piled them up (21 in
    one cache, packaging review). A build in use is touched, and kept."""
    if _module.find_compiler() is None:
        pytest.skip("no C compiler")
    month = _module.PRUNE_AFTER_S
    old = tmp_path / "accsum-000000000000-111111111111.so"
    recent = tmp_path / "accsum-000000000000-222222222222.so"
    other = tmp_path / "notes.txt"
    for path in (old, recent, other):
        path.write_bytes(b"x")
    os.utime(old, (time.time() - month - 60,) * 2)
    os.utime(other, (time.time() - month - 60,) * 2)
    built = _module.build(out_dir=tmp_path)
    assert built is not None and built.exists()
    assert not old.exists() and recent.exists() and other.exists()
    os.utime(built, (time.time() - month - 60,) * 2)
    assert _module.build(out_dir=tmp_path) == built  # (a cache hit touches it)
    assert built.stat().st_mtime > time.time() - 60

def test_the_module_command_takes_no_connection_options(capsys):
    """It does not talk to Redis: its help lists only --json of the global options, and a
    connection option after it is a usage error, not silently ignored."""
    from accumulator._cli import EXIT_OK, EXIT_USAGE, main

    assert main(["module", "--help"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "--json" in text and "--url" not in text and "--tls" not in text
    assert main(["module", "path", "--url", "redis://elsewhere:6379"]) == EXIT_USAGE
    assert "--url" in capsys.readouterr().err


# -- the fallback build directory, checked (mutation review of 2026-11-30) --------------------


def _unwritable_cache(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(_module.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


needs_cc = pytest.mark.skipif(_module.find_compiler() is None, reason="no C compiler")


@needs_cc
@pytest.mark.parametrize("mode", [0o770, 0o730, 0o702])
def test_a_temporary_directory_its_group_or_others_can_write_is_not_built_in(
    tmp_path, monkeypatch, mode
):  # type: ignore[no-untyped-def]
    _unwritable_cache(tmp_path, monkeypatch)
    shared = tmp_path / "tmp" / f"redis-accumulator-{os.getuid()}"
    shared.mkdir()
    shared.chmod(mode)
    assert _module.build() is None
    assert "not a directory of this user's alone" in (_module.why_not_built() or "")
    assert not list(shared.iterdir())


@needs_cc
def test_a_temporary_directory_another_user_owns_is_not_built_in(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """0700, but not this user's: its owner could put a shared object there for Redis."""
    _unwritable_cache(tmp_path, monkeypatch)
    me = os.getuid() + 1  # (this process pretends to be another user; the directory is ours)
    theirs = tmp_path / "tmp" / f"redis-accumulator-{me}"
    theirs.mkdir(mode=0o700)
    monkeypatch.setattr(_module.os, "getuid", lambda: me)
    assert _module.build() is None
    monkeypatch.undo()
    assert not list(theirs.iterdir())


@needs_cc
def test_a_temporary_directory_that_is_a_symlink_is_not_built_in(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A symlink on a shared /tmp can be pointed elsewhere between the check and the build."""
    _unwritable_cache(tmp_path, monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "tmp" / f"redis-accumulator-{os.getuid()}").symlink_to(elsewhere)
    assert _module.build() is None
    assert not list(elsewhere.iterdir())


@needs_cc
def test_a_temporary_directory_that_cannot_be_made_is_not_built_in(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """TMPDIR names a directory that does not exist: the build must not make it (and ours)
    with the default mode on the way (mkdir(parents=True) in the build)."""
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    missing = tmp_path / "missing"
    monkeypatch.setattr(_module.tempfile, "gettempdir", lambda: str(missing))
    assert _module.build() is None
    assert "No such file" in (_module.why_not_built() or "")
    assert not missing.exists()


@needs_cc
def test_a_failed_sanitizer_build_leaves_the_plain_build_on(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    first = _module.build(out_dir=tmp_path)
    assert first is not None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    assert _module.build(out_dir=tmp_path, sanitize=True) is None
    assert _module.why_not_built(out_dir=tmp_path, sanitize=True)
    assert _module.why_not_built(out_dir=tmp_path) is None
    assert _module.build(out_dir=tmp_path) == first
