"""accumulator.aio: the asyncio twins, on every backend (fakeredis's asyncio client, a real
server, the server with our module). Same accumulators as the synchronous classes, exact
cancellation, hundreds of tasks on one loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from _helpers import aclient, aconnect

import accumulator
from accumulator import aio
from accumulator._requests import Batch, Call, Receive, ReceiveAll
from accumulator.aio import _connection as aio_connection

LARGE = (300_000,)  # 1.2 MB of float32: parts, and folds on the module path


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro_fn())  # type: ignore[arg-type]


def dense(target: Any, shape: Any = (3,), **kw: Any) -> aio.ConditionalAccumulator:
    kw.setdefault("shared_name", "aio")
    return aio.ConditionalAccumulator(np.float32, shape, client=aclient(target), **kw)


@pytest.mark.parametrize("shape", [(3,), LARGE], ids=["inline", "parts"])
def test_apply_and_take_give_what_the_sync_class_gives(target, shape):
    grads = [np.random.default_rng(i).standard_normal(shape).astype(np.float32) for i in range(4)]

    async def main() -> np.ndarray:
        async with dense(target, shape) as acc:
            assert await acc.apply_grad(grads[0]) is True
            await asyncio.gather(*(acc.apply_grad(g) for g in grads[1:]))
            assert await acc.num_accumulated() == 4
            out = await acc.take_grad(4, timeout=10)
            assert await acc.global_step() == 1
            assert await acc.apply_grad(grads[0], local_step=0) is False  # stale
            return out

    got = run(main)
    with accumulator.ConditionalAccumulator(np.float32, shape, shared_name="sync-twin",
                                            client=target.client()) as ref:  # fmt: skip
        for g in grads:
            ref.apply_grad(g)
        expected = ref.take_grad(4)
    # the same sum, up to the order the concurrent applies arrived in
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_sync_and_an_async_object_share_one_accumulator(target):
    async def main() -> None:
        async with dense(target) as acc:
            await acc.apply_grad([1.0, 2.0, 3.0])
            with accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="aio",
                                                    client=target.client()) as sync:  # fmt: skip
                sync.apply_grad([3.0, 2.0, 1.0])
                assert await acc.num_accumulated() == 2
                np.testing.assert_array_equal(sync.take_grad(2), [2.0, 2.0, 2.0])
            assert await acc.global_step() == 1

    run(main)


def test_the_sparse_twin(target):
    async def main() -> None:
        acc = aio.SparseConditionalAccumulator(
            np.float32, (10, 2), shared_name="sp", reduction_type="SUM", client=aclient(target)
        )
        try:
            assert await acc.apply_grad([1, 3], np.ones((2, 2)))
            await acc.apply_indexed_slices_grad(
                accumulator.IndexedSlices(values=np.ones((1, 2)), indices=[3])
            )
            with pytest.raises(accumulator.InvalidArgumentError, match="index of slice 0"):
                await acc.apply_grad([10], np.ones((1, 2)))
            taken = await acc.take_indexed_slices_grad(2)
            np.testing.assert_array_equal(taken.indices, [1, 3])
            np.testing.assert_array_equal(taken.values, [[1, 1], [2, 2]])
            assert await acc.apply_grad([1], np.ones((1, 2)), local_step=0) is False
        finally:
            await acc.aclose()

    run(main)


def test_bad_input_gets_the_sync_error_and_changes_nothing(target):
    async def main() -> None:
        async with dense(target) as acc:
            with pytest.raises(accumulator.InvalidArgumentError, match="Shape mismatch"):
                await acc.apply_grad(np.ones(4))
            with pytest.raises(accumulator.InvalidArgumentError, match="num_required"):
                await acc.take_grad(0)
            assert await acc.num_accumulated() == 0
            with pytest.raises(accumulator.InvalidArgumentError, match="already exists"):
                await aio.ConditionalAccumulator(np.float64, (3,), shared_name="aio",
                                                 client=aclient(target))  # fmt: skip

    run(main)


def test_a_timeout_consumes_nothing(target):
    async def main() -> None:
        async with dense(target) as acc:
            await acc.apply_grad(np.ones(3))
            with pytest.raises(accumulator.DeadlineExceededError, match="1 of 2 gradients"):
                await acc.take_grad(2, timeout=0.2)
            assert await acc.num_accumulated() == 1
            r = acc.redis
            assert await r.zcard(acc._keys.takers) == 0

    run(main)


def test_a_cancelled_waiting_take_withdraws_and_the_next_take_gets_the_round(target):
    async def main() -> None:
        async with dense(target) as acc:
            acc.wait_slice = 0.2
            waiting = asyncio.create_task(acc.take_grad(2))
            await asyncio.sleep(0.3)
            assert await acc.redis.zcard(acc._keys.takers) == 1  # it is queued
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert await acc.redis.zcard(acc._keys.takers) == 0
            await acc.apply_grad(np.ones(3))
            await acc.apply_grad(np.ones(3))
            assert await acc.num_accumulated() == 2  # the cancelled take consumed nothing
            np.testing.assert_array_equal(await acc.take_grad(2, timeout=5), np.ones(3))

    run(main)


def test_a_take_cancelled_in_its_blpop_drops_that_connection(real):
    """A wait cancelled while its BLPOP is on the server: that connection is closed, not put
    back in the pool with the BLPOP still pending on it (the pop would take the wake token
    of a later take, and the connection's next user would read this one's reply). redis-py
    8.1's read drops a connection whose read was cut too, so this guards the two together.
    (On a cluster the waits are short slices of redis-py's own blpop: not this path.)"""
    if real.kind == "cluster":
        pytest.skip("a cluster's waits are redis-py's blpop in short slices")
    probe = redis.Redis.from_url(real.url)
    others = {c["id"] for c in probe.client_list() if c.get("cmd") == "blpop"}  # (other tests')

    def blocked() -> list[dict[str, Any]]:
        return [c for c in probe.client_list()
                if c.get("cmd") == "blpop" and c["id"] not in others]  # fmt: skip

    async def main() -> None:
        async with dense(real) as acc:
            acc.wait_slice = 60.0  # left pending, the BLPOP would stay for a minute
            waiting = asyncio.create_task(acc.take_grad(1))
            for _ in range(500):
                if blocked():
                    break
                await asyncio.sleep(0.01)
            assert blocked(), "the take never reached its BLPOP"
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            for _ in range(500):  # the server sees the close within milliseconds
                if not blocked():
                    break
                await asyncio.sleep(0.01)
            assert not blocked(), "the cancelled BLPOP is still pending on its connection"
            await acc.apply_grad(np.ones(3))
            np.testing.assert_array_equal(await acc.take_grad(1, timeout=10), np.ones(3))

    run(main)


def test_a_woken_take_claims_in_the_round_trip_of_its_wait(real, monkeypatch):
    """As the sync driver's: the take script rides behind the BLPOP (first check, wait with
    the re-check, finish); the applies come from a sync object on another thread, whose
    sends are not the asyncio connections'. A cluster re-checks apart: one more."""
    import redis.asyncio.connection as aconnection

    sends: list[int] = []
    original = aconnection.AbstractConnection.send_packed_command
    ours, inside = aio_connection.send, []

    async def send(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not inside:
            sends.append(1)
        return await original(self, *args, **kwargs)

    async def our_send(conn: Any, pieces: Any) -> None:  # (may send through the above)
        sends.append(1)
        inside.append(1)
        try:
            await ours(conn, pieces)
        finally:
            inside.pop()

    monkeypatch.setattr(aconnection.AbstractConnection, "send_packed_command", send)
    monkeypatch.setattr(aio_connection, "send", our_send)
    other = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="aio",
                                               client=real.client())  # fmt: skip

    async def main() -> None:
        async with dense(real) as acc:
            for step in range(2):  # the first round opens the taker's connections
                sends.clear()
                waiting = asyncio.create_task(acc.take_grad(1, timeout=10))
                await asyncio.sleep(0.3)
                await asyncio.to_thread(other.apply_grad, np.full(3, step), step)
                np.testing.assert_array_equal(await waiting, np.full(3, step, np.float32))
            assert len(sends) == (4 if real.kind == "cluster" else 3)

    run(main)
    other.close()


def _reading(request: Any) -> bool:
    """A request reading a claimed round: in place (a real server) or as a batch."""
    return isinstance(request, (Batch, Receive, ReceiveAll)) and "reading" in request.what


def _cancel_at(acc: Any, match: Callable[[Any], bool], *, started: bool = False,
               cancel: Callable[[asyncio.Task[Any]], Any] | None = None) -> None:  # fmt: skip
    """Cancel the task running ``acc``'s protocol at a matching request: before it is sent,
    or (``started``) once it is on its way; ``cancel(task)`` instead of ``task.cancel()``
    (a timeout scope expiring)."""
    do = acc._do

    def do_and_cancel(conns: Any, request: Any) -> Any:
        caller = asyncio.current_task()  # the caller's: the request is not started yet
        assert caller is not None
        if not match(request):
            return do(conns, request)
        stop = cancel or (lambda task: task.cancel())
        if not started:
            stop(caller)  # lands at the request's first await
            return do(conns, request)

        async def cancel_midway() -> Any:
            work = asyncio.ensure_future(do(conns, request))
            await asyncio.sleep(0)  # the request is being sent
            stop(caller)
            return await work

        return cancel_midway()

    acc._do = do_and_cancel


async def _cancelled_take_gave_its_round_back(acc: Any) -> None:
    """A take of the round of 1.0 and 3.0 (LARGE) raises CancelledError, the round stays
    whole, and the next take (the object's ``_do`` as it was) gets it."""
    with pytest.raises(asyncio.CancelledError):
        await acc.take_grad(2)
    del acc._do
    assert (await acc.num_accumulated(), await acc.global_step()) == (2, 0)
    np.testing.assert_array_equal(await acc.take_grad(2, timeout=5), np.full(LARGE, 2))


def test_a_take_cancelled_while_reading_its_round_gives_it_back(target):
    async def main() -> None:
        async with dense(target, LARGE) as acc:
            for v in (1.0, 3.0):
                await acc.apply_grad(np.full(LARGE, v, np.float32))
            _cancel_at(acc, _reading)
            await _cancelled_take_gave_its_round_back(acc)

    run(main)


def test_a_second_cancel_while_a_take_gives_its_round_back_waits_for_it(target, monkeypatch):
    """A cancel landing after the first, as the take gives its round back (a second
    ``cancel()``, Ctrl-C's): the giving back runs to its end. (It skipped the leave: the
    round stayed claimed until its lease ran out; found by a review.)"""

    from accumulator.aio import _core as aio_core

    advance = aio_core.advance

    def cancel_as_it_gives_back(ops: Any, reply: Any, error: Any) -> Any:
        done, request = advance(ops, reply, error)
        if not done and isinstance(request, Call) and request.name == "leave":
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # the second: as the protocol hands over its leave
        return done, request

    async def main() -> None:
        async with dense(target, LARGE) as acc:
            for v in (1.0, 3.0):
                await acc.apply_grad(np.full(LARGE, v, np.float32))
            _cancel_at(acc, _reading)
            monkeypatch.setattr(aio_core, "advance", cancel_as_it_gives_back)
            with pytest.raises(asyncio.CancelledError):
                await acc.take_grad(2)
            monkeypatch.undo()
            del acc._do
            assert (await acc.num_accumulated(), await acc.global_step()) == (2, 0)
            np.testing.assert_array_equal(await acc.take_grad(2, timeout=1), np.full(LARGE, 2))

    run(main)


def test_a_cancel_during_the_adds_of_a_large_apply_lets_it_return(target):
    """On the module path a gradient of more than 8 parts is added into the sum by calls
    after its apply was counted: a cancel then lets the apply return (it raised
    CancelledError, and a retry counted the gradient twice; found by a review)."""
    shape = (3_000_000,)  # 12 parts

    async def main() -> None:
        async with dense(target, shape) as acc:
            if not acc.sums_in_redis:
                pytest.skip("the sum is kept in Redis on the module path only")
            await acc.apply_grad(np.full(shape, 1.0, np.float32))  # the round's sum
            folding = asyncio.Event()
            do = acc._do

            async def slow_fold(conns: Any, request: Any) -> Any:
                if isinstance(request, Call) and request.name == "fold":
                    folding.set()
                    await asyncio.sleep(0.2)  # (a slow link) the cancel comes now
                return await do(conns, request)

            acc._do = slow_fold
            applied = []

            async def apply() -> None:
                applied.append(await acc.apply_grad(np.full(shape, 2.0, np.float32)))
                await asyncio.sleep(1)  # the cancel lands at the next await

            task = asyncio.create_task(apply())
            await folding.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert applied == [True]
            del acc._do
            assert await acc.num_accumulated() == 2
            np.testing.assert_array_equal(await acc.take_grad(2, timeout=5), np.full(shape, 1.5))

    run(main)


def test_aclose_while_another_task_opens_leaves_no_connection(real):
    """``aclose()`` while the first operation of another task opens the accumulator: that
    operation raises CancelledError and the connections it made are closed (they were kept,
    and the shared pools' registration, by an object already closed)."""
    from accumulator.aio import _connection as aio_connection

    async def main() -> None:
        acc = aio.ConditionalAccumulator(np.float32, (3,), shared_name="c", client=str(real.url))
        task = asyncio.create_task(acc.apply_grad(np.ones(3)))
        await asyncio.sleep(0.001)  # opening
        await acc.aclose()
        with pytest.raises(accumulator.CancelledError):
            await task
        assert acc._conns is None
        assert not [e for e in aio_connection._SHARED.values() if e.users]

    run(main)


def test_a_take_cancelled_while_it_subscribes_keeps_no_subscription(target):
    """A queued take (behind another) cancelled while its SUBSCRIBE is on its way: nothing of
    it is kept (each such cancel left a PubSub object in the accumulator's waits)."""
    from accumulator._requests import Subscribe

    async def main() -> None:
        async with dense(target) as acc:
            acc.wait_slice = 0.2
            head = asyncio.create_task(acc.take_grad(1))  # waits at the head of the queue
            await asyncio.sleep(0.3)
            held = len(acc._waits)
            for _ in range(5):
                _cancel_at(acc, lambda r: isinstance(r, Subscribe), started=True)
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.create_task(acc.take_grad(1))
                del acc._do
            assert len(acc._waits) == held
            head.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await head

    run(main)


def test_a_cancel_during_the_final_commit_lets_the_take_complete(target):
    async def main() -> None:
        async with dense(target) as acc:
            await acc.apply_grad(np.full(3, 4.0))
            _cancel_at(acc, lambda r: isinstance(r, Call) and r.name == "finish", started=True)
            got = None

            async def take() -> None:
                nonlocal got
                got = await acc.take_grad(1)  # the round was read: the take keeps it
                await asyncio.sleep(1)  # the cancel lands at the next await

            task = asyncio.create_task(take())
            with pytest.raises(asyncio.CancelledError):
                await task
            np.testing.assert_array_equal(got, np.full(3, 4.0))
            del acc._do
            assert (await acc.num_accumulated(), await acc.global_step()) == (0, 1)

    run(main)


def test_a_cancel_while_a_lost_finish_is_asked_again_lets_the_take_return_its_round(target):
    """The finish ran, its reply was lost past the retry window, and a cancel came while the
    take asked again: the cancel was thrown into the asking, and the round, finished in
    Redis, was lost (asyncio review). The cancel is held, the take returns its round."""
    async def main() -> None:
        async with dense(target) as acc:
            await acc.apply_grad(np.ones(3))
            await acc.apply_grad(np.full(3, 3.0))
            do, finishes = acc._do, []

            async def lost_then_cancelled(conns: Any, request: Any) -> Any:
                if isinstance(request, Call) and request.name == "finish":
                    finishes.append(request)
                    if len(finishes) == 1:
                        await do(conns, request)  # it ran; the reply is lost, and a cancel
                        caller.cancel()  # comes while the take will ask again
                        raise accumulator.UnavailableError("Redis unreachable (simulated)")
                return await do(conns, request)

            acc._do = lost_then_cancelled
            got = None

            async def take() -> None:
                nonlocal got
                got = await acc.take_grad(2)
                await asyncio.sleep(1)  # the cancel lands here

            caller = asyncio.create_task(take())
            with pytest.raises(asyncio.CancelledError):
                await caller
            np.testing.assert_array_equal(got, np.full(3, 2.0))
            assert len(finishes) == 2
            del acc._do
            assert (await acc.num_accumulated(), await acc.global_step()) == (0, 1)

    run(main)


def test_a_cancel_during_an_apply_whose_commit_fails_holds_it_for_the_same_apply_again(target,
                                                                                      caplog):
    """A cancel while a large apply's commit was retried through an outage: it was thrown
    into the apply's cleanup, which skipped it (parts left for an hour), and the apply, of
    unknown outcome, was forgotten (asyncio review). Its apply id is kept now (an apply that
    raised UnavailableError needs no cleanup): the same apply again counts once."""
    from test_unknown_applies import is_apply

    async def main() -> None:
        async with dense(target, LARGE) as acc:
            do, unsent = acc._do, []

            async def unreachable_then_cancelled(conns: Any, request: Any) -> Any:
                if is_apply(request) and not unsent:
                    unsent.append(request)
                    caller.cancel()
                    await asyncio.sleep(0)
                    raise accumulator.UnavailableError("Redis unreachable (simulated)")
                return await do(conns, request)

            acc._do = unreachable_then_cancelled
            caller = asyncio.create_task(acc.apply_grad(np.ones(LARGE)))
            with pytest.raises(asyncio.CancelledError) as caught:
                await caller
            assert isinstance(caught.value.__cause__, accumulator.UnavailableError)
            assert "cancelled while it ended failed: " in caplog.text  # (not only the cause)
            assert await acc.apply_grad(np.ones(LARGE)) is True  # the same again
            late = await do(acc._conns, unsent.pop())  # Redis runs the copy it had
            assert late[-1][3] == 1 and await acc.num_accumulated() == 1

    run(main)


def test_a_task_that_only_takes_returns_the_round_when_cancelled_during_the_commit(target):
    """The take is the task's whole coroutine: the cancel held back by its final commit must
    not reach the task before it has returned (a task that returns with a cancel pending
    throws its result away: the round, finished in Redis, would be lost)."""

    async def main() -> None:
        async with dense(target) as acc:
            await acc.apply_grad(np.full(3, 4.0))
            _cancel_at(acc, lambda r: isinstance(r, Call) and r.name == "finish", started=True)
            got = await asyncio.create_task(acc.take_grad(1))
            np.testing.assert_array_equal(got, np.full(3, 4.0))
            _cancel_at(acc, lambda r: isinstance(r, Batch) and r.what == "apply_grad",
                       started=True)  # fmt: skip
            assert await asyncio.create_task(acc.apply_grad(np.ones(3), local_step=1)) is True
            del acc._do
            assert (await acc.num_accumulated(), await acc.global_step()) == (1, 1)

    run(main)


@pytest.mark.skipif(not hasattr(asyncio, "timeout"), reason="asyncio.timeout: Python 3.11+")
def test_a_timeout_scope_that_expires_during_the_commit_gets_the_round_and_no_stray_cancel(
    target,
):
    """An ``asyncio.timeout`` (and ``wait_for`` on 3.12+) scope that expires while the take's
    final commit is in flight: the take returns the round inside the scope, the scope exits
    without an error, and no cancel is left to hit the caller's next await."""

    async def main() -> None:
        async with dense(target) as acc:
            await acc.apply_grad(np.full(3, 4.0))
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(None) as scope:

                def expire(_: Any) -> None:
                    scope.reschedule(loop.time())

                _cancel_at(acc, lambda r: isinstance(r, Call) and r.name == "finish",
                           started=True, cancel=expire)  # fmt: skip
                got = await acc.take_grad(1)
            assert scope.expired()
            np.testing.assert_array_equal(got, np.full(3, 4.0))
            del acc._do
            await asyncio.sleep(0.05)  # a stray cancel would land here
            assert await acc.apply_grad(np.ones(3), local_step=1) is True
            assert (await acc.num_accumulated(), await acc.global_step()) == (1, 1)

    run(main)


def test_a_cancel_while_an_apply_is_sent_lets_it_count_once(target):
    async def main() -> None:
        async with dense(target, LARGE) as acc:
            _cancel_at(acc, lambda r: isinstance(r, Batch) and r.what == "apply_grad", started=True)
            applied = []

            async def apply() -> None:
                applied.append(await acc.apply_grad(np.ones(LARGE)))
                await asyncio.sleep(1)  # the cancel lands at the next await

            with pytest.raises(asyncio.CancelledError):
                await asyncio.create_task(apply())
            assert applied == [True]
            del acc._do
            assert await acc.num_accumulated() == 1
            np.testing.assert_array_equal(await acc.take_grad(1, timeout=5), np.ones(LARGE))

    run(main)


def test_hundreds_of_tasks_apply_and_take_with_exact_accounting(target):
    """300 worker tasks and 6 takers on one loop, takers cancelled at random while they wait
    or read. Each worker applies a one-hot gradient: the SUM of everything taken, plus what
    is still pending, holds each accepted gradient exactly once and nothing else."""
    workers = 300
    rng = random.Random(7)

    async def main() -> None:
        async with aio.ConditionalAccumulator(np.int64, (workers,), shared_name="many",
                                              reduction_type="SUM",
                                              client=aclient(target)) as acc:  # fmt: skip
            acc.wait_slice = 0.2
            taken = np.zeros(workers, np.int64)
            accepted = np.zeros(workers, np.int64)

            async def worker(i: int) -> None:
                await asyncio.sleep(rng.random() * 0.5)
                step = await acc.global_step()
                if await acc.apply_grad(np.eye(1, workers, i, np.int64)[0], local_step=step):
                    accepted[i] += 1

            async def taker() -> None:
                while True:
                    with contextlib.suppress(accumulator.DeadlineExceededError):
                        taken[:] += await acc.take_grad(rng.randint(5, 20), timeout=1)

            takers = [asyncio.create_task(taker()) for _ in range(6)]
            started = list(takers)
            applying = asyncio.gather(*(worker(i) for i in range(workers)))
            while not applying.done():
                await asyncio.sleep(0.03)
                victim = rng.randrange(len(takers))
                takers[victim].cancel()  # at whatever point it is
                takers[victim] = asyncio.create_task(taker())
                started.append(takers[victim])
            await applying
            for t in takers:
                t.cancel()
            # every taker ever started has ended (a cancelled one first gives back its round)
            ends = await asyncio.gather(*started, return_exceptions=True)
            assert all(isinstance(e, asyncio.CancelledError) for e in ends), ends
            pending = await acc.num_accumulated()
            if pending:
                taken[:] += await acc.take_grad(pending, timeout=5)
            # enough were current for the accounting to mean something (how many are stale
            # depends on how fast the takers advance the step: 145 of 300 on a loaded CI)
            assert accepted.sum() > workers // 4
            np.testing.assert_array_equal(taken, accepted)
            assert await acc.redis.zcard(acc._keys.takers) == 0

    run(main)


def test_aclose_breaks_a_take_waiting_in_another_task(target, caplog):
    """The cut take withdraws from the queue of takers before the connections close: no
    warning, and the next take (another object) does not wait behind its lease."""

    async def main() -> None:
        acc = dense(target)
        await acc.open()
        waiting = asyncio.create_task(acc.take_grad(1))
        await asyncio.sleep(0.2)
        assert await acc.redis.zcard(acc._keys.takers) == 1
        await acc.aclose()
        with pytest.raises(accumulator.CancelledError):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(accumulator.CancelledError):
            await acc.num_accumulated()
        async with dense(target) as again:
            assert await again.redis.zcard(again._keys.takers) == 0
            await again.apply_grad(np.ones(3))
            np.testing.assert_array_equal(await again.take_grad(1, timeout=5), np.ones(3))

    with caplog.at_level(logging.INFO, logger="accumulator"):
        run(main)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_private_accumulator_is_deleted_by_aclose(target):
    async def main() -> None:
        async with aio.ConditionalAccumulator(np.float32, (2, 1 << 18),
                                              client=aclient(target)) as acc:  # fmt: skip
            await acc.apply_grad(np.ones((2, 1 << 18)))  # 2 MiB: parts (spread on a cluster)
            await acc.apply_grad(np.ones((2, 1 << 18)))
            pattern = acc._keys.family_pattern
            r = acc.redis
            assert [k async for k in r.scan_iter(match=pattern)]
        assert not [k async for k in r.scan_iter(match=pattern)]

    run(main)


def test_accumulators_of_one_client_share_its_pools(target):
    async def main() -> None:
        client = aclient(target)
        a, b = dense(target), aio.ConditionalAccumulator(np.float32, (3,), shared_name="aio",
                                                         client=client)  # fmt: skip
        c = aio.ConditionalAccumulator(np.float32, (3,), shared_name="aio", client=client)
        async with a, b, c:
            assert b.redis is c.redis
            assert a.redis is not b.redis or isinstance(client, str)

    run(main)


def test_clients_of_the_wrong_kind_are_refused_naming_the_right_class():
    with pytest.raises(TypeError, match="redis.asyncio.Redis"):
        aio.ConditionalAccumulator(np.float32, client=redis.Redis())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="accumulator.aio"):
        accumulator.ConditionalAccumulator(np.float32, client=aioredis.Redis())  # type: ignore[arg-type]


def test_module_functions(real):
    async def main() -> None:
        async with aio.ConditionalAccumulator(np.float32, (1,), shared_name="f", container="c",
                                              client=real.url) as acc:  # fmt: skip
            await acc.apply_grad([1.0])
        client = aconnect(real.url)
        names = [info.shared_name for info in await aio.list_accumulators("c", client=client)]
        assert names == ["f"]
        info = await aio.describe_accumulator("f", container="c", client=client)
        assert (info.shared_name, info.count) == ("f", 1)
        async with aio.ConditionalAccumulator(np.float32, (1,), shared_name="g",
                                              client=real.url):  # fmt: skip
            assert await aio.delete_accumulator("g", client=client) > 0
        assert await aio.reset_container("c", client=real.url) == 1
        assert await aio.list_accumulators(client=real.url) == []
        await client.aclose()
        # a synchronous client: refused as the classes refuse it (it was taken quietly)
        with pytest.raises(TypeError, match="synchronous client"):
            await aio.list_accumulators(client=redis.Redis())

    run(main)


def test_a_wait_rides_out_killed_connections(real):
    async def main() -> None:
        async with aio.ConditionalAccumulator(np.float32, (1,), shared_name="k",
                                              client=real.url) as acc:  # fmt: skip
            acc.wait_slice = 0.3
            waiting = asyncio.create_task(acc.take_grad(1))
            await asyncio.sleep(0.3)
            real.redis().client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.2)
            await acc.apply_grad([5.0])
            np.testing.assert_array_equal(await asyncio.wait_for(waiting, 10), [5.0])

    run(main)


def test_an_object_used_in_a_second_event_loop_says_so(target):
    """Its connections belong to the loop it was opened in: a second ``asyncio.run`` got
    redis-py's "Event loop is closed" (or a hang); now an error that says what to do."""
    acc = dense(target, shared_name="two-loops")

    async def apply() -> bool:
        return await acc.apply_grad([1.0, 2.0, 3.0])

    assert run(apply) is True
    with pytest.raises(accumulator.AccumulatorError, match="another event loop"):
        run(apply)
    with accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="two-loops",
                                            client=target.client()) as sync:  # fmt: skip
        assert sync.num_accumulated() == 1  # the second apply sent nothing


def test_a_private_object_closed_in_a_second_event_loop_deletes_its_keys(target, caplog):
    """``asyncio.run(acc.aclose())`` after the loop that used it ended: it returned, having
    deleted nothing (the error logged at DEBUG only) and closed nothing (concurrency
    review). Its keys are deleted through this loop's connections now, and it says so."""
    acc = aio.ConditionalAccumulator(np.float32, (3,), client=aclient(target))

    async def apply() -> str:
        await acc.apply_grad([1.0, 2.0, 3.0])
        return acc._keys.base

    base = run(apply)
    assert list(target.redis().scan_iter(match=f"{base}*"))
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        run(acc.aclose)
    assert "another event loop" in caplog.text
    assert not list(target.redis().scan_iter(match=f"{base}*"))
    run(acc.aclose)  # (again: nothing left to do)

def test_a_closed_object_given_bad_input_says_it_is_closed_in_both_twins(target):
    """The sync class checked the input first (InvalidArgumentError), the asyncio twin the
    closed object (asyncio review): both say closed now."""
    sync = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="closed",
                                              client=target.client())  # fmt: skip
    sync.close()
    with pytest.raises(accumulator.CancelledError, match="closed"):
        sync.apply_grad(np.ones(4))

    async def main() -> None:
        acc = dense(target, shared_name="closed")
        await acc.aclose()
        with pytest.raises(accumulator.CancelledError, match="closed"):
            await acc.apply_grad(np.ones(4))

    run(main)


async def _large_round(acc: Any) -> None:
    """Two large gradients applied (1 and 3), and their mean taken exactly."""
    for v in (1.0, 3.0):
        await acc.apply_grad(np.full(LARGE, v, np.float32))
    np.testing.assert_array_equal(await acc.take_grad(2, timeout=5), np.full(LARGE, 2))


def test_a_large_take_is_received_in_place_off_the_event_loop(target, monkeypatch):
    """A real server's payloads are read straight into the result by a synchronous twin in a
    worker thread (redis.asyncio's reads copied each value three times); fakeredis has no
    twin and reads the ordinary way. Either way the take is exact."""
    from accumulator.aio import _receive

    replies: list[Any] = []
    threads: list[str] = []
    inner = _receive._receive

    def counted(client: Any, request: Any) -> Any:
        threads.append(threading.current_thread().name)
        reply = inner(client, request)
        replies.append(reply)
        return reply

    monkeypatch.setattr(_receive, "_receive", counted)

    async def main() -> None:
        async with dense(target, LARGE) as acc:
            await _large_round(acc)

    run(main)
    assert replies and threading.main_thread().name not in threads
    if target.kind == "fake":
        assert all(r is None for r in replies)
    else:
        assert all(r is not None for r in replies)


def test_a_take_cancelled_while_its_thread_reads_returns_once_the_read_ended(
    target, monkeypatch
):
    """The worker thread writes into the take's buffers until its read ends: a cancelled
    take waits for that (a second cancel too) before it gives its round back and returns."""
    from accumulator.aio import _receive

    ended: list[float] = []
    inner = _receive._receive

    def slow(client: Any, request: Any) -> Any:
        time.sleep(0.3)
        try:
            return inner(client, request)
        finally:
            ended.append(time.monotonic())

    monkeypatch.setattr(_receive, "_receive", slow)

    async def main() -> None:
        async with dense(target, LARGE) as acc:
            for v in (1.0, 3.0):
                await acc.apply_grad(np.full(LARGE, v, np.float32))

            def cancel_twice(task: asyncio.Task[Any]) -> None:
                task.cancel()
                asyncio.get_running_loop().call_later(0.05, task.cancel)

            _cancel_at(acc, lambda r: isinstance(r, (Receive, ReceiveAll)), started=True,
                       cancel=cancel_twice)  # fmt: skip
            with pytest.raises(asyncio.CancelledError):
                await acc.take_grad(2)
            assert ended  # the read had ended when the cancellation came through
            del acc._do
            monkeypatch.undo()
            assert (await acc.num_accumulated(), await acc.global_step()) == (2, 0)
            np.testing.assert_array_equal(await acc.take_grad(2, timeout=5), np.full(LARGE, 2))

    run(main)


def test_a_client_whose_twin_cannot_log_in_reads_the_ordinary_way(target, monkeypatch):
    """Credentials from a provider are not the twin's: such a client reads the ordinary way,
    as does one whose twin is refused at login (the take raised AuthenticationError)."""
    from redis.credentials import UsernamePasswordCredentialProvider

    from accumulator.aio import _receive

    provider = UsernamePasswordCredentialProvider("default", "pw")
    assert _receive._twin(aioredis.Redis(credential_provider=provider)) == _receive._NONE

    def refused(*args: Any) -> Any:
        raise redis.AuthenticationError("invalid username-password pair")

    monkeypatch.setattr(_receive, "get_into", refused)
    monkeypatch.setattr(_receive, "get_all_into", refused)

    async def main() -> None:
        async with dense(target, LARGE) as acc:
            await _large_round(acc)
            if target.kind != "fake":
                assert acc._conns.commands.__dict__[_receive._ATTR] == _receive._NONE

    run(main)


def test_no_twin_is_made_for_a_closed_client_and_a_second_one_made_is_closed(monkeypatch):
    """A read still running when its accumulator closed makes no twin that nothing would
    close; of two threads making one at once, the second closes its own."""
    from accumulator.aio import _receive

    class Twin:
        closed = 0

        def close(self) -> None:
            self.closed += 1

    class Client:
        pass

    made: list[Twin] = []

    def make(client: Any) -> Twin:
        made.append(Twin())
        return made[-1]

    monkeypatch.setattr(_receive, "_twin", make)
    closed = Client()
    _receive.close_reader(closed)
    assert _receive._reader(closed) is None and made == []  # closed before: none made

    def closing_meanwhile(client: Any) -> Twin:
        _receive.close_reader(client)
        return make(client)

    monkeypatch.setattr(_receive, "_twin", closing_meanwhile)
    assert _receive._reader(Client()) is None and made[0].closed == 1

    client = Client()
    first = Twin()

    def second(client: Any) -> Twin:
        client.__dict__.setdefault(_receive._ATTR, first)  # another thread's, just stored
        return make(client)

    monkeypatch.setattr(_receive, "_twin", second)
    assert _receive._reader(client) is first and made[1].closed == 1 and first.closed == 0
    _receive.close_reader(client)
    assert first.closed == 1 and _receive._reader(client) is None


def test_aclose_in_another_event_loop_leaves_no_shared_clients_behind(target):  # type: ignore[no-untyped-def]
    """The first loop's share is let go (its clients and the loop itself were kept in the
    registry for good), and the connections made to delete the keys are closed."""
    from accumulator.aio import _connection

    before = set(_connection._SHARED)
    acc = aio.ConditionalAccumulator(np.float32, (3,), client=aclient(target))

    async def apply() -> None:
        await acc.apply_grad([1.0, 2.0, 3.0])

    asyncio.run(apply())
    assert set(_connection._SHARED) - before
    asyncio.run(acc.aclose())
    assert set(_connection._SHARED) - before == set()


def test_a_cancel_swallowed_before_the_finish_gives_the_round_back(target):
    """A cancel that library code swallowed during the read is raised by the driver before
    the finish is sent: the take gives its round back and raises it at once (it was held
    like an interrupt of a finish in flight: the take returned, and a later call raised)."""

    async def main() -> None:
        async with dense(target, LARGE) as acc:
            for v in (1.0, 3.0):
                await acc.apply_grad(np.full(LARGE, v, np.float32))
            do = acc._do

            async def swallowing(conns: Any, request: Any) -> Any:
                if not _reading(request):
                    return await do(conns, request)
                caller = asyncio.current_task()
                assert caller is not None
                work = asyncio.ensure_future(do(conns, request))
                caller.cancel()
                while True:
                    try:
                        return await asyncio.shield(work)
                    except asyncio.CancelledError:
                        continue  # swallowed (the task stays cancelling)

            acc._do = swallowing
            await _cancelled_take_gave_its_round_back(acc)

    run(main)
