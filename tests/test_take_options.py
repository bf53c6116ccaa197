"""take_grad's ``out=`` (a reused result buffer) and ``cancel=`` (a threading.Event that
withdraws a take running in another thread, consuming nothing)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from _helpers import Taker

import accumulator
from accumulator import _reduce

SMALL = (3, 2)
LARGE = (300_000,)  # 1.2 MiB of float32: parts, and a sum in Redis on the module path


def make(target, shape=SMALL, **kw):
    return accumulator.ConditionalAccumulator(np.float32, shape=shape, shared_name="t",
                                              client=target.client(), **kw)  # fmt: skip


def state(acc) -> tuple[int, int]:
    return acc.global_step(), acc.num_accumulated()


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "parts"])
def test_take_into_a_callers_buffer(target, shape):
    acc = make(target, shape=shape)
    out = np.full(shape, -1.0, np.float32)
    for step in range(2):
        grads = [np.full(shape, float(step + i), np.float32) for i in range(3)]
        for g in grads:
            assert acc.apply_grad(g, local_step=step)
        got = acc.take_grad(3, out=out)
        assert got is out
        np.testing.assert_array_equal(out, _reduce.dense_reduce(grads, out.dtype, "MEAN"))


def test_a_wrong_buffer_is_refused_before_anything_is_consumed(target):
    acc = make(target, shape=(None, 2))
    acc.apply_grad(np.ones((3, 2)))
    for bad, why in [
        (np.zeros((3, 2), np.float64), "dtype float64"),
        (np.zeros((2, 3), np.float32).T, "C-contiguous"),
        (np.zeros((3, 3), np.float32), "shape"),
        ([0.0] * 6, "numpy array"),
    ]:
        with pytest.raises(accumulator.InvalidArgumentError, match=why):
            acc.take_grad(1, out=bad)
    readonly = np.zeros((3, 2), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(accumulator.InvalidArgumentError, match="writable"):
        acc.take_grad(1, out=readonly)
    # compatible with the declared (None, 2), not with the round's (3, 2): given back
    with pytest.raises(accumulator.InvalidArgumentError, match=r"round's gradients"):
        acc.take_grad(1, out=np.zeros((4, 2), np.float32))
    assert state(acc) == (0, 1)
    np.testing.assert_array_equal(acc.take_grad(1), np.ones((3, 2), np.float32))


def test_a_set_cancel_event_withdraws_a_waiting_take(target):
    acc = make(target)
    acc.wait_slice = 30.0  # only the event can end the wait in time
    cancel = threading.Event()
    waiter = Taker(acc, 2, timeout=None, cancel=cancel)
    waiter.start()
    time.sleep(0.3)
    acc.apply_grad(np.ones(SMALL))
    cancel.set()
    waiter.join(5)
    assert isinstance(waiter.error, accumulator.CancelledError), waiter.error
    assert state(acc) == (0, 1)  # nothing consumed
    acc.apply_grad(np.ones(SMALL))
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), np.ones(SMALL, np.float32))


def test_a_cancel_while_reading_gives_the_round_back(target, monkeypatch):
    acc = make(target)
    acc.apply_grad(np.ones(SMALL))
    cancel = threading.Event()
    real_reduce = _reduce.reduce_into

    def reduce_then_cancel(*args, **kwargs):
        real_reduce(*args, **kwargs)
        cancel.set()  # the caller gave up while the round was being read

    monkeypatch.setattr(_reduce, "reduce_into", reduce_then_cancel)
    with pytest.raises(accumulator.CancelledError):
        acc.take_grad(1, cancel=cancel)
    monkeypatch.undo()
    assert state(acc) == (0, 1)
    with pytest.raises(accumulator.CancelledError):  # already set: not even a claim
        acc.take_grad(1, cancel=cancel)
    assert state(acc) == (0, 1)
    np.testing.assert_array_equal(acc.take_grad(1), np.ones(SMALL, np.float32))


def test_cancel_must_be_an_event(target):
    acc = make(target)
    with pytest.raises(accumulator.InvalidArgumentError, match="threading.Event"):
        acc.take_grad(1, cancel=True)  # type: ignore[arg-type]


def test_the_sparse_take_takes_a_cancel_event(target):
    acc = accumulator.SparseConditionalAccumulator(np.float32, (4, 2), shared_name="sp",
                                                   client=target.client())  # fmt: skip
    cancel = threading.Event()
    cancel.set()
    acc.apply_grad([1], [[1.0, 2.0]])
    with pytest.raises(accumulator.CancelledError):
        acc.take_indexed_slices_grad(1, cancel=cancel)
    assert acc.take_indexed_slices_grad(1).indices.tolist() == [1]


def test_a_take_whose_withdraw_failed_is_withdrawn_by_the_objects_next_take(target, caplog):
    """A take that gave up while Redis was unreachable could not withdraw from the queue of
    takers: the next take waited behind it until its lease ran out (a wait queued during the
    outage even renewed it; new-user review). The object's next take withdraws it first."""
    from accumulator._requests import Call

    acc = accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="uw",
                                             client=target.client())  # fmt: skip
    acc.taker_lease = 60.0  # (a lease the second take would wait out)
    do, failed = acc._do, []

    def withdraw_fails_once(request):
        if isinstance(request, Call) and request.name == "leave" and not failed:
            failed.append(request)
            raise accumulator.UnavailableError("Redis unreachable (simulated)")
        return do(request)

    acc._do = withdraw_fails_once
    with pytest.raises(accumulator.DeadlineExceededError):
        acc.take_grad(1, timeout=0.2)
    assert failed and "next take withdraws it" in caplog.text
    acc.apply_grad(np.ones(2))
    t0 = time.monotonic()
    np.testing.assert_array_equal(acc.take_grad(1, timeout=20), np.ones(2))
    assert time.monotonic() - t0 < 10  # not the earlier take's 60 s lease
    assert acc._unwithdrawn == []


@pytest.mark.parametrize("twin", ["sync", "asyncio"])
def test_a_wait_the_server_ends_is_waited_again(real, twin):
    """A failover ends the waits of a demoted primary with an ``UNBLOCKED`` error reply (so
    does ``CLIENT UNBLOCK ... ERROR``): a waiting take raised redis-py's ResponseError (a
    review's cluster drill). It waits again: the gradient applied next is its round."""
    import asyncio

    from _helpers import aclient

    from accumulator import aio

    r = real.redis()
    nodes = [r.get_redis_connection(n) for n in r.get_primaries()] if real.kind == "cluster" \
        else [r]  # fmt: skip

    def unblock_the_wait() -> bool:
        for node in nodes:
            for client in node.client_list():
                if client["cmd"] == "blpop":
                    node.client_unblock(client["id"], error=True)
                    return True
        return False

    def unblock_then_apply() -> None:
        deadline = time.monotonic() + 10
        while not unblock_the_wait():
            assert time.monotonic() < deadline, "no take waited"
            time.sleep(0.05)
        time.sleep(0.3)
        make(real).apply_grad(np.ones(SMALL))

    helper = threading.Thread(target=unblock_then_apply)
    helper.start()
    if twin == "sync":
        got = make(real).take_grad(1, timeout=20)
    else:
        async def main() -> Any:
            async with aio.ConditionalAccumulator(np.float32, SMALL, shared_name="t",
                                                  client=aclient(real)) as acc:  # fmt: skip
                return await acc.take_grad(1, timeout=20)

        got = asyncio.run(main())
    helper.join()
    np.testing.assert_array_equal(got, np.ones(SMALL))


def test_concurrent_takes_withdraw_an_earlier_failed_take_once(target):
    """Two takes of one object at once (asyncio tasks; threads alike) each went through the
    takers whose withdraw failed: one raised ValueError (list.remove of one the other took;
    a review)."""
    import asyncio

    from _helpers import aclient

    from accumulator import aio

    async def main() -> list[Any]:
        async with aio.ConditionalAccumulator(np.float32, SMALL, shared_name="t2",
                                              client=aclient(target)) as acc:  # fmt: skip
            acc._unwithdrawn.extend(["1-0a", "1-0b"])  # (takers that hold nothing)
            return await asyncio.gather(acc.take_grad(1, timeout=0.3),
                                        acc.take_grad(1, timeout=0.3),
                                        return_exceptions=True)  # fmt: skip

    outcomes = asyncio.run(main())
    assert all(isinstance(o, accumulator.DeadlineExceededError) for o in outcomes), outcomes
