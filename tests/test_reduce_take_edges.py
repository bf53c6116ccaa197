"""Edge cases of the numerics (accumulator._reduce) and of the take/finish scripts that the
rest of the suite left open (found by a mutation pass): each test pins one rule whose
breaking no other test noticed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np
import pytest
import redis
from _helpers import aclient, entry_key_names, nan_bits
from test_hardening import snapshot

import accumulator
from accumulator import _scripts, _take, aio
from accumulator._reduce import dense_reduce, reduce_into, sparse_merge
from accumulator._requests import Call

FTZ = [np.dtype(np.float32), np.dtype(np.float64)]
FTZ_IDS = [str(d) for d in FTZ]


def _sub_tiny(dt: np.dtype) -> tuple[float, float]:
    info = np.finfo(dt)
    return info.smallest_subnormal, info.tiny


@pytest.mark.parametrize("dtype", FTZ, ids=FTZ_IDS)
def test_a_dense_sum_that_cancels_to_a_subnormal_is_flushed(dtype):
    """Two normal inputs whose sum is subnormal: flush-to-zero on the result gives +0 (the
    sparse path has its own test; here the last addition of a dense SUM, which no division
    follows)."""
    dt = np.dtype(dtype)
    _, tiny = _sub_tiny(dt)
    out = dense_reduce([np.array([1.5 * tiny], dt), np.array([-tiny], dt)], dt, "SUM")
    assert out.tobytes() == np.zeros(1, dt).tobytes()


@pytest.mark.parametrize("dtype", FTZ, ids=FTZ_IDS)
def test_inputs_just_above_the_subnormal_ulp_still_take_the_flush_path(dtype):
    """Inputs in [tiny * 2**(nmant - 1), tiny * 2**nmant) are normal but their ulp is
    subnormal: their difference can be subnormal and must still flush (the bound below which
    an input counts as small must not be lowered)."""
    dt = np.dtype(dtype)
    _, tiny = _sub_tiny(dt)
    big = dt.type(tiny * 2.0 ** (np.finfo(dt).nmant - 1))  # its ulp: tiny / 2
    a = np.array([big + dt.type(tiny / 2)], dt)
    assert a[0] - big == tiny / 2  # exact: the plain sum would be subnormal
    out = dense_reduce([a, np.array([-big], dt)], dt, "SUM")
    assert out.tobytes() == np.zeros(1, dt).tobytes()


@pytest.mark.parametrize("dtype", FTZ, ids=FTZ_IDS)
def test_a_mean_over_more_gradients_than_inputs_flushes_its_result(dtype):
    """``reduce_into`` with a count larger than the number of inputs (inputs that are running
    sums): two large inputs cancelling to 2 * tiny, divided by 3, give a subnormal that TF
    flushes, even though no input is small."""
    dt = np.dtype(dtype)
    _, tiny = _sub_tiny(dt)
    big = dt.type(tiny * 2.0 ** (np.finfo(dt).nmant + 1))  # its ulp: 2 * tiny
    a = np.array([big + dt.type(2 * tiny)], dt)
    assert a[0] - big == 2 * tiny
    out = np.empty(1, dt)
    reduce_into(out, [a, np.array([-big], dt)], "MEAN", count=3)
    assert out.tobytes() == np.zeros(1, dt).tobytes()
    reduce_into(out, [a, np.array([-big], dt)], "MEAN", count=2)
    assert out.tobytes() == np.array([tiny], dt).tobytes()  # normal: kept


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint16])
def test_an_integer_mean_divides_by_the_count_given(dtype):
    """Integer MEAN in ``reduce_into`` divides by ``count`` (the gradients the inputs hold),
    not by the number of inputs, truncating toward zero."""
    dt = np.dtype(dtype)
    signed = np.issubdtype(dt, np.signedinteger)
    a = np.array([30, -7 if signed else 7], dt)
    out = np.empty(2, dt)
    reduce_into(out, [a, a], "MEAN", count=4)
    assert out.tolist() == [15, -3 if signed else 3]  # 60 / 4, -14 / 4 truncated


def test_reduce_into_rejects_a_gradient_that_would_broadcast():
    out = np.empty(4, np.float32)
    with pytest.raises(ValueError, match="gradient 1"):
        reduce_into(out, [np.ones(4, np.float32), np.ones(1, np.float32)], "SUM")
    iout = np.empty(4, np.int32)
    with pytest.raises(ValueError, match="gradient 1"):
        reduce_into(iout, [np.ones(4, np.int32), np.ones(1, np.int32)], "SUM")


@pytest.mark.parametrize("dtype", FTZ, ids=FTZ_IDS)
def test_sparse_row_subnormal_copied_first_counts_as_zero_in_the_next_add(dtype):
    """A row's first contribution is copied as is (subnormal kept); when a later gradient adds
    to it, denormals-are-zero reads it as 0: tiny + sub gives tiny, not tiny + sub."""
    dt = np.dtype(dtype)
    sub, tiny = _sub_tiny(dt)
    _, vals = sparse_merge(
        [(np.array([0]), np.array([[sub]], dt)), (np.array([0]), np.array([[tiny]], dt))],
        (1,), dt, "SUM",
    )  # fmt: skip
    assert vals.tobytes() == np.array([[tiny]], dt).tobytes()


@pytest.mark.parametrize("dtype", FTZ, ids=FTZ_IDS)
def test_sparse_two_nans_on_a_row_the_later_gradients_comes_out(dtype):
    """TF's sparse accumulator adds ``grad + accum``: of two NaNs on a row the later
    gradient's (sign and payload) survives (the dense one keeps the earlier's)."""
    dt = np.dtype(dtype)
    first, later = np.array([nan_bits(dt, 0, 1)]), np.array([nan_bits(dt, 1, 2)])
    _, vals = sparse_merge(
        [(np.array([3]), first.reshape(1, 1)), (np.array([3]), later.reshape(1, 1))],
        (1,), dt, "SUM",
    )  # fmt: skip
    assert vals.tobytes() == later.tobytes()
    dense = dense_reduce([first, later], dt, "SUM")
    assert dense.tobytes() == first.tobytes()


def test_sparse_duplicates_are_summed_in_the_accumulator_dtype():
    """float64 values with a duplicate index into a float32 accumulator: each value is
    rounded to float32 first and then added (TF adds T values), not summed in float64 and
    rounded once (1 + 2**-24 + 2**-50 would round up to 1 + 2**-23)."""
    dt = np.dtype(np.float32)
    vals = np.array([[1.0], [2.0**-24 + 2.0**-50]], np.float64)
    idx, out = sparse_merge([(np.array([5, 5]), vals)], (1,), dt, "SUM")
    assert idx.tolist() == [5]
    assert out.tobytes() == np.array([[1.0]], dt).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_dense_reduce_refuses_gradients_of_another_shape(dtype):
    """Same number of elements in another shape, or a one-element gradient: never summed
    by position or broadcast (an accumulator never reshapes)."""
    a = np.ones((2, 3), dtype)
    for other in (np.ones((3, 2), dtype), np.ones((1,), dtype)):
        with pytest.raises(ValueError, match="gradient 1 has shape"):
            dense_reduce([a, other], np.dtype(dtype), "SUM")


def test_sparse_merge_refuses_values_that_would_broadcast_over_a_row():
    with pytest.raises(ValueError, match="gradient 0: values shape"):
        sparse_merge([(np.array([0, 1]), np.ones((2, 1), np.float32))], (3,), np.float32, "SUM")


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_gradients_given_as_strided_views_are_summed(dtype):
    """A gradient that is a view with strides (every other element of a larger array) is
    summed as any other, its real and imaginary parts each on their own."""
    base = (np.arange(12) + 1j * np.arange(12, 24)).astype(dtype)
    strided = base[::2]
    assert not strided.flags.c_contiguous
    first = np.full(6, 1 - 1j, dtype)
    out = dense_reduce([first, strided], np.dtype(dtype), "SUM")
    np.testing.assert_array_equal(out, first + strided.copy())
    dense = strided.copy()
    out = dense_reduce([first, strided, strided], np.dtype(dtype), "MEAN")
    want = dense_reduce([first, dense, dense], np.dtype(dtype), "MEAN")
    assert out.tobytes() == want.tobytes()


# --------------------------------------------------------------------------- take script


@pytest.mark.parametrize("num_required", ["0", "-1"])
def test_the_take_script_refuses_a_num_required_below_one_before_any_write(target, num_required):
    """A take requiring no gradient would claim any round (even an empty one): the script
    refuses it, as it refuses every malformed argument, before anything is written."""
    acc = accumulator.ConditionalAccumulator(
        np.float32, shape=(3,), shared_name="h", client=target.client()
    )
    acc.apply_grad(np.ones(3))
    keys, args = _take.take_script_args(acc, "1-ab", 1, 10_000)
    args[2] = num_required  # ARGV[3]
    r = target.redis()
    before = snapshot(r)
    with pytest.raises(accumulator.InvalidArgumentError, match="BADARG"):
        _scripts.call(acc.redis, "take", keys, args)
    assert snapshot(r) == before
    assert (acc.num_accumulated(), acc.global_step()) == (1, 0)
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(3))


# --------------------------------------------------------------------------- asyncio driver


@pytest.mark.skipif(not hasattr(asyncio, "timeout"), reason="asyncio.timeout: Python 3.11+")
def test_a_timeout_held_back_by_a_commit_still_ends_its_scope_as_a_timeout(target):
    """A timeout scope expiring while the take's finish is in flight: the take returns its
    round, and the held-back cancel lands at the next await inside the scope counted once, so
    the scope turns it into TimeoutError (counted twice, the scope would let a bare
    CancelledError escape and cancel the caller's task)."""

    async def main() -> None:
        acc = aio.ConditionalAccumulator(
            np.float32, (3,), shared_name="aio", client=aclient(target)
        )
        async with acc:
            await acc.apply_grad(np.full(3, 4.0))
            loop = asyncio.get_running_loop()
            do = acc._do
            got: list[np.ndarray] = []

            def do_and_expire(conns: Any, request: Any) -> Any:
                if not (isinstance(request, Call) and request.name == "finish"):
                    return do(conns, request)

                async def expire_midway() -> Any:
                    work = asyncio.ensure_future(do(conns, request))
                    await asyncio.sleep(0)  # the finish is on its way
                    scope.reschedule(loop.time())
                    return await work

                return expire_midway()

            acc._do = do_and_expire
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(None) as scope:
                    got.append(await acc.take_grad(1))
                    await asyncio.sleep(5)  # the held-back cancel lands here
            del acc._do
            np.testing.assert_array_equal(got[0], np.full(3, 4.0))
            assert current_task_cancelling() == 0
            assert (await acc.num_accumulated(), await acc.global_step()) == (0, 1)

    asyncio.run(main())


def current_task_cancelling() -> int:
    task = asyncio.current_task()
    assert task is not None
    return task.cancelling()


def test_the_take_statistics_count_the_gradients_handed_out(target):
    """``grads_taken`` (``accumulator show``: "takes N (M gradients)") adds every gradient a
    take hands out, which is the round's count, not the num_required it asked for."""
    acc = accumulator.ConditionalAccumulator(
        np.float32, shape=(3,), shared_name="h", client=target.client()
    )
    for value in (1.0, 2.0, 6.0):
        acc.apply_grad(np.full(3, value))
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(3, 3.0))
    info = accumulator._admin.describe(target.redis(), "h")
    assert (info.n_taken, info.grads_taken) == (1, 3)


def test_a_retried_take_script_hands_out_the_same_claim(target):
    """The take's reply lost, the client calls the script again with the same taker id: it
    gets the round it claimed, again; gradients applied since stay for the next round (a
    second claim under the same name would drop the first round's gradients)."""
    acc = accumulator.ConditionalAccumulator(
        np.float32, shape=(3,), shared_name="h", client=target.client()
    )
    acc.apply_grad(np.full(3, 2.0))
    keys, args = _take.take_script_args(acc, "1-ab", 1, 10_000)
    first = _scripts.call(acc.redis, "take", keys, args)
    assert int(first[0]) == 1
    acc.apply_grad(np.full(3, 7.0), local_step=1)
    again = _scripts.call(acc.redis, "take", keys, args)
    assert again[:2] == first[:2]
    assert (acc.num_accumulated(), acc.global_step()) == (1, 1)
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(3, 7.0))


def test_a_take_about_to_wait_when_its_accumulator_is_closed_stops_at_once(target):
    """``aclose()`` from another task while a take's script call is in flight: no wait of the
    take is running to be cut, so the wait the take begins next must not start at all (it
    would block a whole wait slice, with ``aclose()`` waiting for it)."""

    async def main() -> None:
        acc = aio.ConditionalAccumulator(
            np.float32, (3,), shared_name="aio", client=aclient(target)
        )
        await acc.open()
        acc.wait_slice = 5.0
        do = acc._do
        closing: list[asyncio.Future[None]] = []

        def do_then_close(conns: Any, request: Any) -> Any:
            if not (isinstance(request, Call) and request.name == "take") or closing:
                return do(conns, request)

            async def take_then_close() -> Any:
                reply = await do(conns, request)
                closing.append(asyncio.ensure_future(acc.aclose()))
                await asyncio.sleep(0)  # aclose() marks the accumulator closed
                return reply

            return take_then_close()

        acc._do = do_then_close
        started = time.monotonic()
        with pytest.raises(accumulator.CancelledError):
            await acc.take_grad(1)
        await closing[0]
        assert time.monotonic() - started < 4.0  # (not the 5 s wait slice)

    asyncio.run(main())


def test_a_payload_grown_past_its_length_is_quarantined_not_claimed(target):
    """A payload key that grew (a foreign APPEND or SET in the namespace): its length is
    checked for equality, not as a lower bound; the take never claims what it cannot read."""
    r = target.redis()
    acc = accumulator.ConditionalAccumulator(
        np.float32, shape=(64, 1024), shared_name="h", client=target.client(), sum_in_redis=False
    )
    for value in (1.0, 2.0):
        acc.apply_grad(np.full((64, 1024), value))
    grown = entry_key_names(r.lrange(acc._keys.grads, 0, -1)[0])[-1]
    r.append(grown, b"\0" * 4)
    with pytest.raises(accumulator.DeadlineExceededError):
        acc.take_grad(2, timeout=0.2)
    assert (acc.global_step(), acc.num_accumulated()) == (0, 1)
    (record,) = r.lrange(acc._keys.quarantine, 0, -1)
    assert record.startswith(b"length ")
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full((64, 1024), 2.0))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_sparse_round_of_rows_whose_values_are_not_a_multiple_of_8_bytes(target, rows):
    """A sparse payload is whole records of an int64 index and a row of values: its length
    is checked against 8 + the row's bytes (a row of 3 float32 is 12 bytes: 20 a record),
    whatever the number of rows; a payload grown by a part of a record is quarantined."""
    r = target.redis()
    acc = accumulator.SparseConditionalAccumulator(
        np.float32, (5000, 3), shared_name="sp", reduction_type="SUM", client=target.client()
    )
    values = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    acc.apply_grad(np.arange(rows), values)
    got = acc.take_grad(1, timeout=5)
    np.testing.assert_array_equal(got[0], np.arange(rows))
    np.testing.assert_array_equal(got[1], values)
    big = np.ones((4096, 3), np.float32)  # 80 KiB: its own payload key
    acc.apply_grad(np.arange(4096), big, local_step=1)
    (entry,) = r.lrange(acc._keys.grads, 0, -1)
    r.append(entry_key_names(entry)[-1], b"\0" * 12)  # 12 = a row's values, not a record
    with pytest.raises(accumulator.DeadlineExceededError):
        acc.take_grad(1, timeout=0.2)
    (record,) = r.lrange(acc._keys.quarantine, 0, -1)
    assert record.startswith(b"length ")


def _swallow_a_cancel_at_the_next_request(acc: Any, fail: BaseException | None) -> None:
    """The next request of ``acc`` gets its task cancelled and swallows the cancel (library
    code can: redis-py's pipelines), then gives its reply, or raises ``fail``."""
    do = acc._do

    async def swallowing(conns: Any, request: Any) -> Any:
        acc._do = do
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed
            await asyncio.sleep(0)
        if fail is not None:
            raise fail
        return await do(conns, request)

    acc._do = swallowing


@pytest.mark.parametrize("fails", [False, True], ids=["replied", "failed"])
def test_a_cancel_swallowed_by_library_code_is_still_delivered(target, fails):
    """A cancel that library code swallowed during an operation's last request: the
    operation's result stands and the cancel lands at the caller's next await; when the
    request failed instead, the operation raises CancelledError, not the request's error."""

    async def main() -> None:
        acc = aio.ConditionalAccumulator(
            np.float32, (3,), shared_name="aio", client=aclient(target)
        )
        async with acc:
            await acc.apply_grad(np.ones(3))
            got: list[int] = []

            async def count() -> None:
                _swallow_a_cancel_at_the_next_request(
                    acc, redis.ConnectionError("cut") if fails else None
                )
                got.append(await acc.num_accumulated())
                await asyncio.sleep(5)  # the cancel lands here

            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.create_task(count()), 10)
            assert got == ([] if fails else [1])
            assert await acc.num_accumulated() == 1

    asyncio.run(main())


# --------------------------------------------------------------------------- orphans script


def test_a_late_copy_of_a_registration_never_makes_a_counted_payload_garbage(target):
    """The registration of a spread payload arriving again after its apply was counted (its
    first reply lost, the copy delivered late): the round holds the payload, so nothing is
    registered, and no sweeper deletes the parts of a counted gradient."""
    shape = (3 * 1044480 // 16 + 123, 4)  # float32: 4 parts over other slots
    acc = accumulator.ConditionalAccumulator(
        np.float32, shape, shared_name="spread", client=target.client(), spread_parts=True
    )
    acc.apply_grad(np.full(shape, 3.0))
    r = target.redis()
    (entry,) = r.lrange(acc._keys.grads, 0, -1)
    assert entry[:1] == b"d"
    keys = [acc._keys.state, acc._keys.orphans]
    late = [acc._schema, entry, 0, 0, 60_000, acc._instance]  # its registration ran out at once
    assert _scripts.call(acc.redis, "orphans", keys, late) == []
    assert r.zrange(acc._keys.orphans, 0, -1) == []
    assert _scripts.call(acc.redis, "orphans", keys, [acc._schema, "", 0, 10, 60_000]) == []
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(shape, 3.0))


def test_a_claims_lease_grows_with_the_number_of_its_entries(target):
    """A claim's lease is the base plus time per MiB plus time per entry (merging many small
    gradients takes long: a lease sized by bytes alone ran out while the taker merged, and
    takers took the round from each other): 1000 entries add 200 ms with no base at all."""
    acc = accumulator.ConditionalAccumulator(
        np.float32, shape=(1,), shared_name="h", client=target.client()
    )
    for _ in range(1000):
        acc.apply_grad(np.ones(1))
    keys, args = _take.take_script_args(acc, "1-ab", 1000, 10_000)
    args[6], args[7] = "0", "0"  # ARGV[7], ARGV[8]: no base lease, nothing per MiB
    r = target.redis()
    seconds, micros = r.time()
    before_ms = seconds * 1000 + micros // 1000
    reply = _scripts.call(acc.redis, "take", keys, args)
    assert int(reply[0]) == 1 and len(reply[1]) == 1001
    expiry = int(r.hget(acc._keys.claims, "1-ab"))
    assert expiry - before_ms >= 200
