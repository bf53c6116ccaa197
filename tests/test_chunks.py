"""Large gradients in chunks: parts of one chunk each on the way in, streamed reduction on the
way out, no Redis value (and no command) larger than a chunk, the taker's memory bounded by
one result plus a window of parts, whatever the number of gradients."""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import redis
from _helpers import entry_key_names
from hypothesis import given, settings
from hypothesis import strategies as st

import accumulator
from accumulator import _chunks, _reduce
from accumulator._keys import MAX_PARTS, Keys

CHUNK = _chunks.CHUNK_BYTES
LUA = Path(__file__).resolve().parents[1] / "lua" / "_common.lua"


def make(target, shared_name="big", shape=(1,), dtype=np.float32, **kw):
    return accumulator.ConditionalAccumulator(
        dtype, shape=shape, shared_name=shared_name, client=target.client(), **kw
    )


def payload_sizes(r, acc) -> dict[bytes, int]:
    keys = Keys(acc.container, acc.shared_name or "")
    found = [*r.scan_iter(match=keys.pattern), *r.scan_iter(match=keys.spread_pattern)]
    return {k: r.strlen(k) for k in found if b":b:" in k}


# -- the plan (pure) ----------------------------------------------------------------------------


def test_the_scripts_and_the_client_agree_on_the_chunk():
    text = LUA.read_text()
    assert int(re.search(r"^local CHUNK = (\d+)(?:  --.*)?$", text, re.M).group(1)) == CHUNK
    assert int(re.search(r"^local MAX_PARTS = (\d+)$", text, re.M).group(1)) == MAX_PARTS
    assert int(re.search(r"^local FOLD = (\d+)$", text, re.M).group(1)) == _chunks.FOLD_PARTS
    assert int(re.search(r"^local SOLE = (\d+)$", text, re.M).group(1)) == _chunks.SOLE_PART_BYTES


def test_a_chunk_holds_whole_elements_of_every_dtype():
    assert CHUNK % 16 == 0  # complex128, the widest item


def test_a_part_takes_no_more_server_memory_than_its_size_class(real):
    """A 1 MiB part took 1.25 MiB (jemalloc rounds a 1 MiB + header allocation up): parts
    are sized to fit in 1 MiB with Redis's string header."""
    r = real.redis()
    r.set("acc:{probe}:part", b"\x01" * CHUNK)
    try:
        usage = r.memory_usage("acc:{probe}:part")
    finally:
        r.delete("acc:{probe}:part")
    if usage is None:
        pytest.skip("MEMORY USAGE not available")
    assert usage <= (1 << 20) + 1024, usage


@given(st.integers(1, 10 * CHUNK))
def test_parts_cover_a_payload_exactly(nbytes):
    ranges = _chunks.part_ranges(nbytes)
    assert len(ranges) == _chunks.n_parts(nbytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == nbytes
    assert all(b - a == CHUNK for a, b in ranges[:-1])
    last = ranges[-1][1] - ranges[-1][0]
    assert 0 < last <= (_chunks.SOLE_PART_BYTES if len(ranges) == 1 else CHUNK)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    assert (len(ranges) == 1) == (nbytes <= _chunks.SOLE_PART_BYTES)


def test_a_gradient_of_exactly_1_mib_is_one_part():
    """Powers of two are common sizes: 1 MiB stays one value (a chunk and a 4 KiB tail cost
    its apply ~40% more); from just over 1 MiB on, parts of a chunk."""
    assert _chunks.part_ranges(1 << 20) == [(0, 1 << 20)]
    assert _chunks.part_ranges((1 << 20) + 1) == [(0, CHUNK), (CHUNK, (1 << 20) + 1)]


@given(st.integers(1, 3000), st.integers(1, 64))
def test_windows_visit_every_part_once(parts, sources):
    seen = [j for w in _chunks.windows(parts, sources) for j in w]
    assert seen == list(range(parts))
    assert all(len(w) * sources * CHUNK <= max(_chunks.WINDOW_BYTES, sources * CHUNK)
               for w in _chunks.windows(parts, sources))  # fmt: skip


@given(st.lists(st.integers(0, 3 * CHUNK), max_size=60), st.integers(1, 8 * CHUNK))
def test_byte_windows_visit_every_item_once_about_a_window_each(sizes, window):
    ranges = _chunks.byte_windows(sizes, window)
    assert [j for w in ranges for j in w] == list(range(len(sizes)))
    for w in ranges:
        total = sum(sizes[j] for j in w)
        assert len(w) >= 1 and (len(w) == 1 or total <= window)
    # a window ends only where the next item would overflow it
    for a, b in zip(ranges, ranges[1:], strict=False):
        assert sum(sizes[j] for j in a) + sizes[b[0]] > window


def test_small_parameters_share_one_window():
    assert _chunks.byte_windows([4096] * 50) == [range(50)]
    assert _chunks.byte_windows([CHUNK] * 9) == [range(8), range(8, 9)]
    assert _chunks.byte_windows([]) == []


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32,
          np.uint16, np.complex64]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(DTYPES), st.integers(1, 5), st.integers(1, 3000), st.data(),
    st.sampled_from(["SUM", "MEAN"]),
)  # fmt: skip
def test_reducing_chunk_by_chunk_is_the_whole_reduction_bit_for_bit(dtype, w, n, data, reduction):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, size=(w, n * dtype.itemsize), dtype=np.uint8)
    grads = [row.view(dtype) for row in raw]  # every bit pattern: subnormals, inf, nan
    with np.errstate(all="ignore"):
        whole = _reduce.dense_reduce(grads, dtype, reduction)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=6))) | {0, n})
    out = np.empty(n, dtype)
    with np.errstate(all="ignore"):
        for a, b in zip(cuts, cuts[1:], strict=False):
            _reduce.reduce_into(out[a:b], [g[a:b] for g in grads], reduction)
    assert out.tobytes() == whole.tobytes()
    # the first gradient received straight into the result (ClaimReader.read_chunks)
    inplace = grads[0].copy()
    with np.errstate(all="ignore"):
        for a, b in zip(cuts, cuts[1:], strict=False):
            _reduce.reduce_into(inplace[a:b], [inplace[a:b], *(g[a:b] for g in grads[1:])],
                                reduction)  # fmt: skip
    assert inplace.tobytes() == whole.tobytes()


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([np.float32, np.float64]), st.binary(min_size=8, max_size=800),
       st.sampled_from([1, 2, 3, 4, 7, 1000, 2**23, 2**23 + 1, 2**24, 2**24 + 1,
                        2**53 + 1]))  # fmt: skip
def test_the_mean_of_a_sum_kept_in_redis_is_tfs_element_by_element(dtype, raw, count):
    """One input (a sum of ``count`` gradients kept in Redis) divided by ``count``, against a
    scalar reference of TF's CPU arithmetic: subnormal operand and result flushed."""
    dtype = np.dtype(dtype)
    x = np.frombuffer(raw[: len(raw) // dtype.itemsize * dtype.itemsize], dtype)
    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        _reduce.reduce_into(out, [x], "MEAN", count=count)
        tiny, n = np.finfo(dtype).tiny, dtype.type(count)

        def flush(v):
            return dtype.type(np.copysign(0.0, v)) if v != 0 and abs(v) < tiny else v

        want = np.array([flush(flush(v) / n) for v in x], dtype)
    assert out.tobytes() == want.tobytes()


def _drive(steps, respond):
    """Run a protocol step (a generator of requests) against ``respond``; its result."""
    reply = None
    try:
        while True:
            reply = respond(steps.send(reply))
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("receives", [0, 1, 2])
def test_payloads_are_received_back_to_back_or_read_the_ordinary_way(receives):
    """A round's payloads land one after the other in the buffer given, as views of it; a
    driver that cannot (asyncio, a cluster), or stops half-way, gets them read by GETs."""
    from accumulator._requests import Batch, ReceiveAll
    from accumulator._stream import ClaimReader

    rng = np.random.default_rng(receives)
    values = {f"k{i}".encode(): rng.bytes(int(rng.integers(0, 300))) for i in range(12)}
    # one payload of ten parts (over two windows of 8), one inline, one of two parts
    sources = [[f"k{i}".encode() for i in range(10)], b"inline!", [b"k10", b"k11"]]
    want = [b"".join(values[f"k{i}".encode()] for i in range(10)), b"inline!",
            values[b"k10"] + values[b"k11"]]  # fmt: skip
    buf = bytearray(sum(map(len, values.values())))
    into = memoryview(buf)
    seen = []

    def respond(request):
        seen.append(type(request).__name__)
        if isinstance(request, ReceiveAll):
            if seen.count("ReceiveAll") > receives:
                return None
            pos, lengths = 0, []
            for key in request.keys:
                v = values[key]
                request.into[pos : pos + len(v)] = v
                pos += len(v)
                lengths.append(len(v))
            return lengths
        assert isinstance(request, Batch)
        return [values[cmd[1]] for cmd in request.commands]

    got = _drive(ClaimReader(sources, "c").payloads(into), respond)
    assert [bytes(g) for g in got] == want
    if receives == 2:  # every part received in place: payloads are views of the buffer
        assert seen == ["ReceiveAll", "ReceiveAll"]
        assert all(isinstance(g, memoryview) and g.obj is buf for g in (got[0], got[2]))
    else:  # the driver said no: GETs from there on (never ReceiveAll again)
        assert seen.count("ReceiveAll") == receives + 1 and seen[-1] == "Batch"
    assert _drive(ClaimReader(sources, "c").payloads(None), respond) == want


def test_a_payload_missing_or_too_long_for_the_round_is_refused():
    from accumulator import AccumulatorError
    from accumulator._stream import ClaimReader

    for reply in ([3, -1], [3, -2]):
        with pytest.raises(AccumulatorError, match="missing or has the wrong length"):
            _drive(ClaimReader([[b"a"], [b"b"]], "c").payloads(memoryview(bytearray(9))),
                   lambda request, reply=reply: reply)  # fmt: skip


def test_receive_buffers_are_lent_to_one_reader_at_a_time_and_one_is_kept():
    from accumulator._stream import ReceiveBuffers

    pool = ReceiveBuffers(keep=1000)
    a, b = pool.borrow(10), pool.borrow(10)
    assert a is not b and len(a) == len(b) == 10
    pool.give_back(a)
    pool.give_back(b)  # one is kept
    assert pool.borrow(5) is a and pool.borrow(5) is not b
    pool.give_back(a)
    assert len(pool.borrow(20)) == 20  # too small: a new one
    big = pool.borrow(2000)
    pool.give_back(big)
    assert pool.borrow(2000) is not big  # over keep: not kept


# -- through Redis ------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
def test_a_gradient_of_several_parts_round_trips_exactly(target, reduction):
    shape = (3 * CHUNK // 16 + 123, 4)  # 3 MiB + 1968 bytes of float32: 4 parts, the last short
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    acc = make(target, shape=shape, reduction_type=reduction)
    for g in grads:
        assert acc.apply_grad(g, local_step=0)
    r = target.redis()
    sizes = payload_sizes(r, acc)
    assert max(sizes.values()) == CHUNK  # no value over a chunk
    entries = r.lrange(acc._keys.grads, 0, -1)
    if acc.sums_in_redis:  # one running sum of the three, in 4 parts
        assert len(sizes) == 4 and [e.split(b" ")[:2] for e in entries] == [[b"s3", b"4"]]
    else:
        kind = b"d4" if acc.spreads_parts else b"p4"
        assert len(sizes) == 3 * 4 and [e.split(b" ", 1)[0] for e in entries] == [kind] * 3
    got = acc.take_grad(3)
    want = _reduce.dense_reduce(grads, np.dtype(np.float32), reduction)
    assert got.tobytes() == want.tobytes()
    assert payload_sizes(r, acc) == {}  # freed when the take returned


def test_a_1_mib_gradient_is_stored_as_one_value(target):
    shape = ((1 << 20) // 4,)
    acc = make(target, shape=shape, reduction_type="SUM")
    grads = [np.full(shape, float(i), np.float32) for i in (1, 2)]
    for g in grads:
        assert acc.apply_grad(g, local_step=0)
    r = target.redis()
    sizes = payload_sizes(r, acc)
    assert sorted(sizes.values()) == [1 << 20] * (1 if acc.sums_in_redis else 2)
    np.testing.assert_array_equal(acc.take_grad(2), np.full(shape, 3.0, np.float32))


def _lose_first_batch_reply(monkeypatch, acc, meanwhile=None) -> dict[str, int]:
    """The reply of ``acc``'s next batch is lost (after ``meanwhile()``, if given): the fault
    at the batch driver, whatever carries the batch (a pipeline, a direct one). Returns the
    count of batches sent."""
    original = type(acc)._batch
    calls = {"n": 0}

    def lose_first_reply(self, request):
        result = original(self, request)
        calls["n"] += 1
        if calls["n"] == 1:
            if meanwhile is not None:
                meanwhile()
            raise redis.ConnectionError("reply lost")
        return result

    monkeypatch.setattr(type(acc), "_batch", lose_first_reply)
    return calls


def test_a_retried_apply_of_parts_is_counted_once(real, monkeypatch):
    """The reply of the apply pipeline is lost once: the retry re-sends the parts (SET NX)
    and the script recognises the apply."""
    shape = (CHUNK // 2,)  # 2 parts
    acc = make(real, shape=shape)
    calls = _lose_first_batch_reply(monkeypatch, acc)
    assert acc.apply_grad(np.ones(shape), local_step=0)
    monkeypatch.undo()
    assert calls["n"] >= 2 and acc.num_accumulated() == 1
    np.testing.assert_array_equal(acc.take_grad(1), np.ones(shape))


@pytest.mark.parametrize("taken_between", [False, True])
def test_a_retried_apply_leaves_no_part_nothing_holds(real, monkeypatch, taken_between):
    """The reply of a counted apply of parts is lost: the retry's SET NX writes again the parts
    that are gone since (added into the sum kept in Redis, or taken with the round): the
    apply deletes them (they stayed an hour, up to 8 MiB each)."""
    shape = (CHUNK // 2,)  # 2 parts
    acc, chief = make(real, shape=shape), make(real, shape=shape)
    if acc.spreads_parts:
        pytest.skip("parts spread over slots are written before the script, which alone is "
                    "retried")
    assert acc.apply_grad(np.full(shape, 2.0), local_step=0)  # the sum, on the module path

    def take() -> None:
        np.testing.assert_array_equal(chief.take_grad(2), np.full(shape, 1.5))

    calls = _lose_first_batch_reply(monkeypatch, acc, take if taken_between else None)
    assert acc.apply_grad(np.ones(shape), local_step=0)
    monkeypatch.undo()
    r = real.redis()
    held = {k for e in r.lrange(acc._keys.grads, 0, -1) for k in entry_key_names(e)}
    assert calls["n"] >= 2 and set(payload_sizes(r, acc)) == held
    assert acc.num_accumulated() == (0 if taken_between else 2)


@pytest.mark.parametrize("damage", ["missing", "short", "long"])
def test_a_damaged_part_quarantines_its_gradient(target, damage, caplog):
    shape = (CHUNK // 2,)  # 2 parts of float32
    acc = make(target, shape=shape, reduction_type="SUM")
    acc.apply_grad(np.ones(shape), local_step=0)
    r = target.redis()
    first = r.lrange(acc._keys.grads, 0, -1)[0]
    part0, part1 = entry_key_names(first)
    if damage == "missing":
        r.delete(part1)
    elif damage == "short":
        r.set(part0, r.get(part0)[:-4])
    else:
        r.append(part1, b"\0\0\0\0")
    # a sum kept in Redis that is damaged is not added to: the next gradient starts its own
    acc.apply_grad(np.full(shape, 2.0), local_step=0)
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(shape, 2.0))
    (why,) = r.lrange(acc._keys.quarantine, 0, -1)
    assert why.split(b" ")[0] in (b"missing", b"part", b"length")
    assert not r.exists(part0, part1)  # our own parts of a bad entry are freed


def test_a_forged_parts_entry_is_never_followed(target):
    acc = make(target, shape=(CHUNK // 2,))
    r = target.redis()
    r.set("prod:secret:0", b"x")
    for forged in (b"p1 prod:secret", b"p0 " + acc._keys.blob("ab", 1).encode(),
                   b"p2 " + acc._keys.blob("ab", 1).encode() + b":0"):  # fmt: skip
        r.rpush(acc._keys.grads, forged)
    r.hset(acc._keys.state, "count", 3)
    acc.apply_grad(np.ones(CHUNK // 2), local_step=0)
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(CHUNK // 2))
    assert r.get("prod:secret:0") == b"x"
    assert [q.split(b" ")[0] for q in r.lrange(acc._keys.quarantine, 0, -1)] == [b"foreign"] * 3


def test_sparse_takes_receive_into_one_kept_buffer_and_return_arrays_of_their_own(
    target, monkeypatch
):
    """A steady sparse taker receives every round into the same buffer (no fresh memory per
    take), and what a take returned is never overwritten by the next one."""
    from accumulator import _core

    received = []
    real_get_all_into = _core.get_all_into

    def counting(*args):
        got = real_get_all_into(*args)
        received.append(got is not None)
        return got

    monkeypatch.setattr(_core, "get_all_into", counting)
    cols = 64
    acc = accumulator.SparseConditionalAccumulator(
        np.float32, (100_000, cols), shared_name="sp", client=target.client()
    )
    rng = np.random.default_rng(7)
    taken, kept = [], set()
    for step in range(3):
        # rows of each gradient are disjoint: the MEAN is the values themselves
        rows = rng.permutation(100_000)[: 600 + 600 + 5000]
        grads = [(np.sort(part), rng.standard_normal((len(part), cols)).astype(np.float32))
                 for part in (rows[:600], rows[600:1200], rows[1200:])]  # fmt: skip
        for idx, vals in grads:  # ~160 KiB (a payload key) twice, ~1.3 MiB (two parts)
            assert acc.apply_grad(idx, vals, local_step=step)
        got = acc.take_grad(3, timeout=10)
        order = np.argsort(np.concatenate([idx for idx, _ in grads]))
        want_idx = np.concatenate([idx for idx, _ in grads])[order]
        want_vals = np.concatenate([vals for _, vals in grads])[order]
        taken.append((got, want_idx, want_vals))
        kept.add(id(acc._receive_buffers._spare[0]))
    for got, want_idx, want_vals in taken:  # the later takes left them as they were
        np.testing.assert_array_equal(got.indices, want_idx)
        np.testing.assert_array_equal(got.values, want_vals)
    assert len(kept) == 1
    # in place where the driver can: a plain connection's socket (not fakeredis, a cluster)
    assert any(received) == (target.kind in ("real", "module"))


def test_a_sparse_read_cut_off_half_way_is_read_again(real, monkeypatch):
    """The connection dies in the middle of receiving a round's payloads into the buffer:
    the read is retried (on a fresh connection) and the take returns the round intact."""
    from accumulator import _wire

    if real.kind == "cluster":
        pytest.skip("a cluster client is read through redis-py")
    acc = accumulator.SparseConditionalAccumulator(
        np.float32, (10_000, 64), shared_name="cut", client=real.client()
    )
    rng = np.random.default_rng(3)
    rows = rng.permutation(10_000)[:1200]
    grads = [(np.sort(rows[:600]), rng.standard_normal((600, 64)).astype(np.float32)),
             (np.sort(rows[600:]), rng.standard_normal((600, 64)).astype(np.float32))]  # fmt: skip
    for idx, vals in grads:
        assert acc.apply_grad(idx, vals, local_step=0)
    real_bulk_at = _wire._Reader.bulk_at
    cuts = []

    def cut_second(self, into, pos):
        if pos > 0 and not cuts:  # the first value is in: the connection dies now
            cuts.append(pos)
            self.sock.close()
            raise OSError("connection reset (injected)")
        return real_bulk_at(self, into, pos)

    monkeypatch.setattr(_wire._Reader, "bulk_at", cut_second)
    got = acc.take_grad(2, timeout=10)
    assert cuts, "the fault was not injected"
    order = np.argsort(np.concatenate([idx for idx, _ in grads]))
    np.testing.assert_array_equal(got.indices, np.concatenate([i for i, _ in grads])[order])
    np.testing.assert_array_equal(got.values, np.concatenate([v for _, v in grads])[order])
    assert acc.num_accumulated() == 0 and acc.global_step() == 1


def test_the_apply_sends_the_callers_buffer_without_copying_it(real):
    shape = (16 * CHUNK // 4,)  # 16 MiB
    grad = np.ones(shape, np.float32)
    acc = make(real, shape=shape)
    tracemalloc.start()
    try:
        acc.apply_grad(grad, local_step=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * CHUNK, peak  # a copy of the gradient would be 16 chunks


def traced_take(acc, n):
    """take_grad(n) and the peak of Python's traced memory during it."""
    tracemalloc.start()
    try:
        total = acc.take_grad(n)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return total, peak


@pytest.mark.parametrize("workers", [2, 8])
def test_a_take_holds_one_result_plus_a_window_whatever_the_workers(real, workers):
    shape = (4 * CHUNK,)  # 16 MiB of float32 per gradient
    acc = make(real, shape=shape, reduction_type="SUM")
    g = np.ones(shape, np.float32)
    for _ in range(workers):
        acc.apply_grad(g, local_step=0)
    del g
    total, peak = traced_take(acc, workers)
    assert total[0] == workers and total[-1] == workers
    result = total.nbytes
    assert peak < result + 2 * _chunks.WINDOW_BYTES + 2 * CHUNK, (peak, result)


@pytest.mark.parametrize("grads", [1, 2])
def test_the_rounds_first_gradient_is_received_straight_into_the_result(real, grads):
    """The first gradient of a round (the running sum, when it is kept in Redis) lands in
    the result's own memory: the take's receive buffer holds the other gradients only, and
    there is none at all for a single source (no buffer's fresh pages to fault in, no copy)."""
    shape = (4 * CHUNK,)  # 16 MiB of float32: 17 parts
    acc = make(real, shape=shape, reduction_type="SUM")
    for _ in range(grads):
        acc.apply_grad(np.ones(shape, np.float32), local_step=0)
    sources = 1 if acc.sums_in_redis else grads
    per_window = max(1, _chunks.WINDOW_BYTES // (sources * CHUNK))
    others = per_window * (sources - 1) * CHUNK  # a whole window of them: 8 MiB
    total, peak = traced_take(acc, grads)
    assert total[0] == grads and total[-1] == grads
    assert peak < total.nbytes + others + CHUNK // 2, (peak, total.nbytes, others)


@pytest.mark.slow
def test_a_gradient_over_600_mib(real):
    """Larger than Redis's 512 MiB value limit: two workers' gradients, the sum exact."""
    n = (600 << 20) // 4 + 3  # float32: 600 MiB + 12 bytes, a short last part
    acc = make(real, "huge", shape=(n,), reduction_type="SUM", max_pending_bytes=2 << 30)
    g = np.arange(n, dtype=np.float32) % 1024
    assert acc.apply_grad(g, local_step=0)
    g[::7] = -1.5
    assert acc.apply_grad(g, local_step=0)
    r = real.redis()
    assert max(payload_sizes(r, acc).values()) == CHUNK
    total = acc.take_grad(2)
    want = np.arange(n, dtype=np.float32) % 1024
    want += g
    assert total.tobytes() == want.tobytes()
    assert acc.global_step() == 1 and payload_sizes(r, acc) == {}
