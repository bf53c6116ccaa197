"""Edges of the large-gradient path a third mutation-testing pass found unguarded: sums that
come out subnormal or infinite where the accsum module adds, an older client's one-key large
payload read in ranges, a resized parameter part, a sanitizer build on a host without a
compiler, a gradient of exactly the parts one apply adds, a private accumulator's sum
expiring with its round."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import entry_key_names

import accumulator
from accumulator import _chunks, _scripts

ELEMENTS = 16 * 1024  # 64 KiB of float32: a payload key of its own (and the module's path)


def make(target, shape, dtype=np.float32, reduction_type="SUM", **kw):
    return accumulator.ConditionalAccumulator(dtype, shape=shape, shared_name="edges",
                                              reduction_type=reduction_type,
                                              client=target.client(), **kw)  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_sum_that_comes_out_subnormal_is_flushed_on_every_path(target, dtype):
    """TF's CPU kernels flush a subnormal result to a signed zero. A large gradient added by
    the accsum module (the sum kept in Redis, which the taker copies as it is) must come out
    as the taker's own sum does: 1.5 tiny - tiny is 0.5 tiny, flushed."""
    dt = np.dtype(dtype)
    tiny = np.finfo(dt).tiny
    n = 64 * 1024 // dt.itemsize
    acc = make(target, (n,), dt)
    g1, g2 = np.zeros(n, dt), np.zeros(n, dt)
    g1[0], g2[0] = 1.5 * tiny, -tiny
    g1[1], g2[1] = -1.5 * tiny, tiny
    g1[2], g2[2] = 2.0, 3.0
    assert acc.apply_grad(g1) and acc.apply_grad(g2)
    got = acc.take_grad(2, timeout=10)
    want = np.zeros(n, dt)
    want[1], want[2] = -0.0, 5.0
    assert got.tobytes() == want.tobytes()


def test_an_older_clients_one_key_large_gradient_is_read_in_ranges(target):
    """An older client stored a large payload under one key ('k' entry; the apply script
    still takes it): the taker reads it a chunk at a time with GETRANGE, each range exactly
    its part (an inclusive end one byte too far read every range one byte long)."""
    n = 3 * (1 << 20) // 4 + 5  # 3 MiB and a bit: four ranges, the last a short one
    acc = make(target, (n,))
    k = acc._keys
    old = np.arange(n, dtype=np.float32)
    r = target.redis()
    r.set(k.blob("ab", 1), old.astype("<f4").tobytes(), px=3_600_000)
    keys = [k.state, k.grads, k.dedup("ab"), k.takers, k.taker_info, k.wake, k.blob("ab", 1),
            k.orphans]  # fmt: skip
    args = [acc._schema, 1, 0, str(n), "k", b"", old.nbytes, 60000, ""]
    assert int(_scripts.call(acc.redis, "apply", keys, args)[0]) == 1
    new = np.full(n, 0.5, np.float32)
    assert acc.apply_grad(new)
    np.testing.assert_array_equal(acc.take_grad(2, timeout=10), old + new)
    assert not [key for key in r.scan_iter(match=k.pattern) if b":b:" in key]


def test_a_parameter_part_of_another_length_is_the_clear_missing_error(target):
    """A published parameter's part overwritten with a value of another length (a foreign
    write, a key of another layout) counts as gone, on every client: the worker's pull
    raises the sync helper's clear error, not a buffer assignment's ValueError."""
    from accumulator._keys import SyncKeys
    from accumulator.sync import ParameterServer, Worker

    params = {"big": np.arange(3 * (1 << 20) // 8 + 11, dtype=np.float64),
              "small": np.arange(6, dtype=np.float32)}  # fmt: skip
    ps = ParameterServer("resized", replicas_to_aggregate=1, client=target.client())
    ps.initialize(params)
    r = target.redis()
    parts = sorted(r.scan_iter(match=SyncKeys("", "resized").versions_pattern))
    assert parts
    for key in parts:
        r.set(key, r.get(key)[:-8])  # one element short
    worker = Worker("resized", client=target.client())
    try:
        with pytest.raises(RuntimeError, match="missing from Redis"):
            worker.pull(timeout=5)
    finally:
        worker.close()
        ps.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_infinite_sum_stays_infinite_on_every_path(target, dtype):
    """An earlier gradient's infinity plus a finite value is that infinity (not a NaN: the
    module's rule for a NaN in the sum must not take an infinity for one); inf - inf is
    NaN."""
    dt = np.dtype(dtype)
    n = 64 * 1024 // dt.itemsize
    acc = make(target, (n,), dt)
    g1, g2 = np.zeros(n, dt), np.zeros(n, dt)
    g1[:4] = [np.inf, -np.inf, np.inf, 1.0]
    g2[:4] = [1.0, -2.0, -np.inf, np.inf]
    with np.errstate(invalid="ignore"):
        want = g1 + g2
    assert acc.apply_grad(g1) and acc.apply_grad(g2)
    got = acc.take_grad(2, timeout=10)
    assert list(got[:4]) == [np.inf, -np.inf, pytest.approx(np.nan, nan_ok=True), np.inf]
    assert np.isnan(got[2]) and got[4:].tobytes() == want[4:].tobytes()


def test_without_a_compiler_a_sanitizer_build_is_never_taken_for_the_plain_one(
    tmp_path, monkeypatch
):
    """A host without a compiler uses a build of this very source made before; the tests'
    sanitizer build beside it (``-asan``) cannot be loaded by a plain redis-server and must
    not be picked in its stead, whatever its digest."""
    import hashlib

    from accumulator import _module

    monkeypatch.setattr(_module, "find_compiler", lambda: None)
    head = f"accsum-{hashlib.sha256(_module.source()).hexdigest()[:12]}-"
    asan = tmp_path / f"{head}0123456789ab-asan.so"
    asan.write_bytes(b"\x7fELF")
    assert _module.build(out_dir=tmp_path) is None
    assert _module.build(out_dir=tmp_path, sanitize=True) == asan
    both = tmp_path / "both"  # (another directory: a failed lookup is not tried again)
    both.mkdir()
    (both / asan.name).write_bytes(b"\x7fELF")
    plain = both / f"{head}ba9876543210.so"
    plain.write_bytes(b"\x7fELF")
    assert _module.build(out_dir=both) == plain


@pytest.mark.parametrize("parts", [_chunks.FOLD_PARTS, _chunks.FOLD_PARTS + 1])
def test_a_gradient_of_exactly_the_parts_one_script_adds_is_summed_whole(target, parts):
    """With the module, an apply adds up to FOLD parts into the round's sum itself and the
    client folds the rest in: a gradient of exactly FOLD parts is added whole by its apply
    (no entry left "being folded" with nothing left to fold, which the take would
    quarantine as foreign), one of FOLD + 1 in two scripts."""
    n = parts * _chunks.CHUNK_BYTES // 4
    assert _chunks.n_parts(4 * n) == parts
    acc = make(target, (n,))
    g1 = np.arange(n, dtype=np.float32) % 1000
    g2 = np.full(n, 0.25, np.float32)
    assert acc.apply_grad(g1) and acc.apply_grad(g2)
    if target.kind == "module":
        (entry,) = target.redis().lrange(acc._keys.grads, 0, -1)
        assert entry.startswith(b"s2 ")
    np.testing.assert_array_equal(acc.take_grad(2, timeout=10), g1 + g2)


def test_a_private_accumulators_running_sum_lives_as_long_as_its_round(target):
    """A private accumulator's keys expire (a day after their last use): the parts of the
    running sum that the module adds into get the round's expiry again at every apply, not
    only the expiry they got as the first gradient's parts (then the sum would expire while
    its round lives on)."""
    if target.kind != "module":
        pytest.skip("the sum is kept in Redis on the module path only")
    n = 3 * _chunks.CHUNK_BYTES // 4
    acc = accumulator.ConditionalAccumulator(np.float32, (n,), reduction_type="SUM",
                                             client=target.client())  # fmt: skip
    assert acc.sums_in_redis and acc.shared_name is None
    r = target.redis()
    assert acc.apply_grad(np.ones(n, np.float32))
    (entry,) = r.lrange(acc._keys.grads, 0, -1)
    parts = entry_key_names(entry)
    for key in parts:  # as if the first apply were long ago
        assert r.pexpire(key, 100_000)
    assert acc.apply_grad(np.full(n, 2.0, np.float32))
    (entry,) = r.lrange(acc._keys.grads, 0, -1)
    assert entry.startswith(b"s2 ") and entry_key_names(entry) == parts
    state_ttl = r.pttl(acc._keys.state)
    assert state_ttl > 3_600_000
    assert all(r.pttl(key) > state_ttl - 60_000 for key in parts)
    np.testing.assert_array_equal(acc.take_grad(2, timeout=10), np.full(n, 3.0, np.float32))
    acc.close()
