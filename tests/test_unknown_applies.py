"""An apply whose outcome is unknown: it raised UnavailableError, and Redis may still run the
copy it received. Made again by the same object it counts once; any other apply settles it
first (counted, it stays counted; not, it never will be); and a Redis that stops answering
is given up within the retry window plus the socket timeouts, not redis-py's retries of
them."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from _helpers import aclient
from redis import exceptions as redis_exceptions

import accumulator
from accumulator import _scripts, aio
from accumulator._requests import Batch, Call

SMALL = (3, 2)
LARGE = (64, 1024)  # 256 KiB: written as a part of its own (spread over slots on a cluster)


def make(target: Any, shape: Any = SMALL, **kw: Any) -> accumulator.ConditionalAccumulator:
    return accumulator.ConditionalAccumulator(np.float32, shape=shape, shared_name="u",
                                              client=target.client(), **kw)  # fmt: skip


def is_apply(request: Any) -> bool:
    """The request that carries the apply script (alone, or last in its pipeline)."""
    if isinstance(request, Call):
        return request.name == "apply"
    return (isinstance(request, Batch) and request.what == "apply_grad"
            and request.commands[-1][:2] == ("EVALSHA", _scripts.sha("apply")))  # fmt: skip


class LostApplies:
    """Patches an object's driver: the next ``n`` apply requests raise UnavailableError,
    after running (``ran``: the reply lost) or without being sent (kept in ``unsent``, for a
    late copy to be run later with :meth:`late_copy`)."""

    def __init__(self, acc: Any, ran: bool, n: int = 1) -> None:
        self.do, self.ran, self.left = acc._do, ran, n
        self.unsent: list[Any] = []
        acc._do = self

    def __call__(self, request: Any) -> Any:
        if self.left and is_apply(request):
            self.left -= 1
            if self.ran:
                self.do(request)
            else:
                self.unsent.append(request)
            raise accumulator.UnavailableError("Redis unreachable (simulated)")
        return self.do(request)

    def late_copy(self) -> Any:
        """Redis runs the copy it received before the outage, now: the script's reply."""
        request = self.unsent.pop(0)
        reply = self.do(request)
        return reply[-1] if isinstance(request, Batch) else reply


class AsyncLostApplies:
    """:class:`LostApplies` for an ``accumulator.aio`` object (its driver is awaited, and
    given the connections)."""

    def __init__(self, acc: Any, ran: bool, n: int = 1) -> None:
        self.do, self.ran, self.left = acc._do, ran, n
        self.unsent: list[tuple[Any, Any]] = []
        acc._do = self

    async def __call__(self, conns: Any, request: Any) -> Any:
        if self.left and is_apply(request):
            self.left -= 1
            if self.ran:
                await self.do(conns, request)
            else:
                self.unsent.append((conns, request))
            raise accumulator.UnavailableError("Redis unreachable (simulated)")
        return await self.do(conns, request)

    async def late_copy(self) -> Any:
        """Redis runs the copy it received before the outage, now: the script's reply."""
        conns, request = self.unsent.pop(0)
        reply = await self.do(conns, request)
        return reply[-1] if isinstance(request, Batch) else reply


def lost_apply(target: Any, shape: Any, ran: bool, caplog: Any) -> tuple[Any, LostApplies]:
    """An accumulator whose first apply (of 2.0s) raised UnavailableError, after running
    (``ran``) or unsent; INFO logs captured from then on."""
    acc = make(target, shape)
    lost = LostApplies(acc, ran)
    with pytest.raises(accumulator.UnavailableError):
        acc.apply_grad(np.full(shape, 2.0))
    caplog.set_level(logging.INFO, logger="accumulator")
    return acc, lost


@pytest.mark.parametrize("ran", [True, False], ids=["ran", "not-sent"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "part"])
def test_an_apply_made_again_after_unavailable_counts_once(target, shape, ran, caplog):
    acc, lost = lost_apply(target, shape, ran, caplog)
    assert acc.apply_grad(np.full(shape, 2.0)) is True
    assert ("it was counted, and is not sent again" if ran
            else "it was not counted; sending it now") in caplog.text  # fmt: skip
    if not ran:
        assert lost.late_copy()[3] == 1  # the copy sent before: answered as a retry
    assert acc.num_accumulated() == 1
    acc.apply_grad(np.full(shape, 4.0))
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), np.full(shape, 3.0))


@pytest.mark.parametrize("ran", [True, False], ids=["ran", "not-sent"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "part"])
def test_another_apply_settles_the_unknown_one_first(target, shape, ran, caplog):
    """Counted, it stays counted; not sent, a copy Redis runs later is not counted."""
    acc, lost = lost_apply(target, shape, ran, caplog)
    assert acc.apply_grad(np.full(shape, 4.0)) is True  # another gradient
    if ran:
        assert "was counted" in caplog.text
    else:
        assert "was not counted, and now never will be" in caplog.text
        reply = lost.late_copy()
        assert reply[0] == 0 and reply[3] == 1  # answered as a retry of a dropped apply
    assert acc.num_accumulated() == (2 if ran else 1)
    expected = 3.0 if ran else 4.0
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(shape, expected))
    # and nothing of the unsent one is left behind (its part: withdrawn or dropped)
    r = target.redis()
    assert not [k for k in r.scan_iter(match=acc._keys.pattern) if b":b:" in k]


@pytest.mark.parametrize("refused", [False, True], ids=["judged", "refused"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "part"])
def test_a_late_copy_of_an_older_apply_is_not_counted(target, shape, refused):
    """An apply ridden through a partition (its retry counted it), then the next apply of the
    object, then the first copy, delayed in the network: Redis kept only the last apply's
    record per client, and counted the copy (review). A large one's copy dropped its payload,
    the parts the accepted apply is held by (the sum of the round, with the module), though:
    the take lost it (a review's fuzzer). So did a copy refused before it was judged (a
    foreign value under one of its keys: refusals drop the refused apply's payload)."""
    acc = make(target, shape)
    do, copies = acc._do, []

    def sent_twice(request: Any) -> Any:
        if is_apply(request) and not copies:
            copies.append(request)  # (a copy stays in the network)
        return do(request)

    acc._do = sent_twice
    assert acc.apply_grad(np.full(shape, 2.0)) is True
    assert acc.apply_grad(np.full(shape, 4.0)) is True  # the next apply, same client id
    if refused:
        if shape == SMALL:
            pytest.skip("an inline payload has no key to drop")
        r = target.redis()
        r.set(acc._keys.taker_info, b"foreign")  # (a value of another type: a refused probe)
        with pytest.raises((accumulator.AccumulatorError, redis_exceptions.ResponseError),
                           match="BADTYPE"):  # fmt: skip
            late = do(copies.pop())
            raise late[-1] if isinstance(late[-1], Exception) else AssertionError(late)
        r.delete(acc._keys.taker_info)
        np.testing.assert_array_equal(acc.take_grad(2, timeout=5), np.full(shape, 3.0))
        return
    late = do(copies.pop())
    late = late[-1] if isinstance(late, list) and isinstance(late[-1], list) else late
    assert late[0] == 0 and late[3] == 1  # answered as an old retry, not counted
    assert acc.num_accumulated() == 2
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), np.full(shape, 3.0))


def test_a_settle_whose_reply_is_lost_still_lets_the_same_apply_count_once(target):
    """The fence ran but its reply was lost: the same apply made again was answered from the
    fence, 'dropped', and never counted (review). It is settled again first now."""
    acc = make(target)
    lost = LostApplies(acc, ran=False)
    with pytest.raises(accumulator.UnavailableError):
        acc.apply_grad(np.ones(SMALL))
    do, settles = lost.do, []

    def fence_reply_lost_once(request: Any) -> Any:
        if isinstance(request, Call) and request.name == "withdraw":
            settles.append(request)
            if len(settles) == 1:
                do(request)
                raise accumulator.UnavailableError("reply lost (simulated)")
        return do(request)

    acc._do = fence_reply_lost_once
    with pytest.raises(accumulator.UnavailableError, match="reply lost"):
        acc.apply_grad(np.full(SMALL, 4.0))  # another apply: nothing of it sent
    assert acc.apply_grad(np.ones(SMALL)) is True  # the first, made again
    assert acc.num_accumulated() == 1 and len(settles) == 2
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(SMALL))


def test_the_withdraw_never_fences_over_a_later_apply(target):
    acc = make(target)
    k, r = acc._keys, target.redis()
    r.set(k.dedup("ab"), "7", px=60_000)
    judged = _scripts.call(r, "withdraw", [k.state, k.dedup("ab"), k.blob("ab", 5)],
                           ["5", 24, 60_000])  # fmt: skip
    assert int(judged) == -3 and r.get(k.dedup("ab")) == b"7"


FORKED = """
import os, sys
import numpy as np
import accumulator

acc = accumulator.ConditionalAccumulator(np.float32, (3, 2), shared_name="u", client=sys.argv[1])
acc.apply_grad(np.zeros((3, 2)))
pid = os.fork()
if pid == 0:
    acc.apply_grad(np.full((3, 2), 3.0))
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
assert acc.apply_grad(np.full((3, 2), 6.0)) is True
print(acc.num_accumulated(), acc.take_grad(3, timeout=5)[0, 0])
"""


def test_a_forked_child_applies_under_identities_of_its_own(real):
    """A child forked after the object's first apply shared its (client id, seq): the
    parent's next apply was answered as a retry of the child's, True and not counted. (In a
    process of its own: this one may run threads, which fork does not copy.)"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FORKED, real.url], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "3.0"]


FORKED_PRIVATE = """
import os, sys
import numpy as np
import accumulator

acc = accumulator.ConditionalAccumulator(np.float32, (2,), client=sys.argv[1])  # private
acc.apply_grad(np.ones(2))
for ending in ("close", "with", "exit"):
    pid = os.fork()
    if pid == 0:
        if ending == "close":
            acc.close()
            os._exit(0)
        if ending == "with":
            with acc:
                pass
            os._exit(0)
        sys.exit(0)  # (exit hooks run: the finalizers among them)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
print(acc.apply_grad(np.ones(2)), acc.take_grad(2, timeout=5)[0])
acc.close()
print(len(list(acc.redis.scan_iter(match="acc:*"))))
"""


def test_a_forked_childs_copy_of_a_private_accumulator_leaves_its_keys_to_the_parent(real):
    """A child forked from the process that made a private accumulator (a copy of the object)
    deleted its keys when it closed the copy or exited: the parent's next call raised
    NotFoundError. The creator's close still deletes them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FORKED_PRIVATE, real.url],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1.0", "0"]


def test_the_same_gradient_at_another_step_is_another_apply(target):
    acc = make(target)
    LostApplies(acc, ran=False)
    with pytest.raises(accumulator.UnavailableError):
        acc.apply_grad(np.ones(SMALL), local_step=0)
    acc.set_global_step(3)
    assert acc.apply_grad(np.ones(SMALL), local_step=3) is True
    assert acc.num_accumulated() == 1


def test_a_settle_that_finds_redis_unreachable_keeps_it_held_and_sends_nothing(target):
    acc = make(target)
    lost = LostApplies(acc, ran=False)
    with pytest.raises(accumulator.UnavailableError):
        acc.apply_grad(np.ones(SMALL))
    do = lost.do
    settles = []

    def unreachable_once(request: Any) -> Any:
        if isinstance(request, Call) and request.name == "withdraw":
            settles.append(request)
            if len(settles) == 1:
                raise accumulator.UnavailableError("still unreachable (simulated)")
        elif is_apply(request) and len(settles) == 1:
            raise AssertionError("the new apply was sent although the settle failed")
        return do(request)

    acc._do = unreachable_once
    with pytest.raises(accumulator.UnavailableError, match="still unreachable"):
        acc.apply_grad(np.full(SMALL, 4.0))
    assert acc._identities.held() and acc.num_accumulated() == 0
    assert acc.apply_grad(np.full(SMALL, 4.0)) is True  # settled now, then sent
    assert len(settles) == 2 and not acc._identities.held()
    lost.do(lost.unsent.pop())  # a late copy of the first: not counted
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(SMALL, 4.0))


def test_sparse_applies_are_settled_too(target):
    acc = accumulator.SparseConditionalAccumulator(np.float32, shape=(10, 2), shared_name="us",
                                                   client=target.client())  # fmt: skip
    lost = LostApplies(acc, ran=False)
    with pytest.raises(accumulator.UnavailableError):
        acc.apply_indexed_slices_grad(
            accumulator.IndexedSlices(np.ones((1, 2), np.float32), np.array([3]), [10, 2]))
    assert acc.apply_grad([3], np.ones((1, 2)), [10, 2]) is True  # the same, again
    assert lost.late_copy()[3] == 1 and acc.num_accumulated() == 1


# -- a real server that stops answering ------------------------------------------------------


def _frozen(own_server: Any) -> Any:
    os.kill(own_server.server.pid, signal.SIGSTOP)
    return own_server.server


@pytest.mark.parametrize("kind", ["url", "client"])
def test_a_frozen_server_is_given_up_after_the_window_not_redis_pys_retries(own_server, kind):
    """SIGSTOP (as a partition that drops packets): each try waits a socket timeout. redis-py
    retried those timeouts itself, three times per command and per handshake: an apply with
    retry_window=1 and a 2 s socket timeout raised after ~10 s (with the default 30 s, after
    8 minutes); of a redis.Redis client's, ten times (~30 s)."""
    import redis

    client: Any = own_server.url + "?socket_timeout=2"
    if kind == "client":
        from urllib.parse import urlsplit

        where = urlsplit(own_server.url)
        client = redis.Redis(host=where.hostname, port=where.port, socket_timeout=2)
    acc = accumulator.ConditionalAccumulator(np.float32, SMALL, shared_name="f", client=client,
                                             retry_window=1)  # fmt: skip
    server = _frozen(own_server)
    try:
        t0 = time.monotonic()
        with pytest.raises(accumulator.UnavailableError, match="Timeout"):
            acc.apply_grad(np.ones(SMALL))
        took = time.monotonic() - t0
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert took < 7, took  # two tries of a 2 s timeout (+ slack); ~10 s before


@pytest.mark.parametrize("twin", ["sync", "asyncio"])
def test_a_take_cut_off_by_a_frozen_server_raises_when_the_window_says(own_server, twin):
    """A waiting take whose server froze raises within what the README says: its wait slice
    and a socket timeout to notice, the retry window, its last try's socket timeout, and one
    more for giving its place back, tried once (the taker's lease runs out on its own). A
    review measured 18.3 s with retry_window=4 and a 2 s socket timeout: the blocking waits'
    socket timeout was 7 s whatever the commands', and the withdrawal had a window of its
    own (12.3 s here before, 8.3 s now)."""
    url = own_server.url + "?socket_timeout=1"
    window = 3.0

    def freeze_soon() -> Any:
        import threading

        timer = threading.Timer(0.5, _frozen, args=(own_server,))
        timer.start()
        return timer

    if twin == "sync":
        acc = accumulator.ConditionalAccumulator(np.float32, SMALL, shared_name="t", client=url,
                                                 retry_window=window)  # fmt: skip
        acc.num_accumulated()  # connected
        timer = freeze_soon()
        t0 = time.monotonic()
        try:
            with pytest.raises(accumulator.UnavailableError):
                acc.take_grad(1)
            took = time.monotonic() - t0
        finally:
            timer.join()
            os.kill(own_server.server.pid, signal.SIGCONT)
        acc.close()
    else:

        async def main() -> float:
            async with aio.ConditionalAccumulator(np.float32, SMALL, shared_name="t",
                                                  client=url, retry_window=window) as acc:
                await acc.num_accumulated()
                timer = freeze_soon()
                t0 = time.monotonic()
                try:
                    with pytest.raises(accumulator.UnavailableError):
                        await acc.take_grad(1)
                    return time.monotonic() - t0
                finally:
                    timer.join()
                    os.kill(own_server.server.pid, signal.SIGCONT)

        took = asyncio.run(main())
    # a 2 s slice + 1 s to notice, the window, two more 1 s timeouts (+ 1 s slack)
    assert took < 2 + 1 + window + 2 * 1 + 1.0, took


def test_a_one_try_call_is_tried_once_in_a_batch_of_takes_too(own_server):
    """``Call.window``: the chief's takes run together (``_together``), and a take's
    withdrawal after an outage took a whole retry window more there (code review)."""
    from accumulator import _together
    from accumulator._take import leave_call

    acc = accumulator.ConditionalAccumulator(np.float32, SMALL, shared_name="t",
                                             client=own_server.url, retry_window=3)  # fmt: skip
    acc.num_accumulated()
    own_server.server.kill()
    calls = {0: leave_call(acc._keys, "taker-x", acc._schema, 0),
             1: leave_call(acc._keys, "taker-y", acc._schema)}  # fmt: skip
    t0 = time.monotonic()
    replies = _together._calls([(acc, None), (acc, None)], {0: calls[0]})
    once = time.monotonic() - t0
    t0 = time.monotonic()
    again = _together._calls([(acc, None), (acc, None)], {1: calls[1]})
    windowed = time.monotonic() - t0
    acc.close()
    assert isinstance(replies[0][1], accumulator.UnavailableError)
    assert isinstance(again[1][1], accumulator.UnavailableError)
    assert once < 1.5 < windowed, (once, windowed)  # one try against the 3 s window


def test_an_error_reply_is_raised_as_it_came():
    """A ResponseError that is not a connection's database refusal goes through the retry
    layer untouched (it was raised from itself: its own ``__cause__``; code review)."""
    from accumulator import _retry

    def wrongtype() -> None:
        raise redis_exceptions.ResponseError("WRONGTYPE Operation against a key")

    with pytest.raises(redis_exceptions.ResponseError) as caught:
        _retry.call(wrongtype, "x")
    assert caught.value.__cause__ is None

    async def awrongtype() -> None:
        wrongtype()

    with pytest.raises(redis_exceptions.ResponseError) as caught:
        asyncio.run(_retry.acall(awrongtype, "x"))
    assert caught.value.__cause__ is None


def test_an_asyncio_clients_twin_retries_no_timeouts_itself(own_server):
    """The asyncio twin made from a user's redis.asyncio.Redis kept that client's retries,
    which retried timeouts (with retry_on_timeout=True; review): a frozen server cost each
    try of the window three socket timeouts, not one (measured 6.1 s here, now 4.0 s)."""
    import redis.asyncio as aioredis

    async def main() -> None:
        client = aioredis.Redis.from_url(own_server.url, socket_timeout=2, retry_on_timeout=True)
        async with aio.ConditionalAccumulator(np.float32, SMALL, shared_name="f", client=client,
                                              retry_window=1) as acc:  # fmt: skip
            for redis_client in (acc._conns.commands, acc._conns.blocking):
                retried = redis_client.connection_pool.make_connection().retry._supported_errors
                assert not any(issubclass(e, TimeoutError) or "Timeout" in e.__name__
                               for e in retried), retried  # fmt: skip
            await acc.num_accumulated()  # connected
            server = _frozen(own_server)
            try:
                with pytest.raises(accumulator.UnavailableError, match="Timeout"):
                    await acc.apply_grad(np.ones(SMALL))
            finally:
                os.kill(server.pid, signal.SIGCONT)

    asyncio.run(main())


def test_an_apply_lost_to_a_frozen_server_counts_once_when_made_again(own_server):
    """The end to end case: Redis runs the copies it received once it answers again; the
    worker, told UnavailableError, applies the same gradient again."""
    acc = accumulator.ConditionalAccumulator(np.float32, SMALL, shared_name="f",
                                             client=own_server.url + "?socket_timeout=1",
                                             retry_window=0.5)  # fmt: skip
    server = _frozen(own_server)
    try:
        with pytest.raises(accumulator.UnavailableError):
            acc.apply_grad(np.ones(SMALL))
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert acc.apply_grad(np.ones(SMALL)) is True
    assert acc.num_accumulated() == 1
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(SMALL))


def test_the_asyncio_twin_holds_and_settles_the_same_way(target):
    async def main() -> None:
        acc = aio.ConditionalAccumulator(np.float32, SMALL, shared_name="ua",
                                         client=aclient(target))  # fmt: skip
        lost = AsyncLostApplies(acc, ran=False)
        try:
            with pytest.raises(accumulator.UnavailableError):
                await acc.apply_grad(np.ones(SMALL))
            assert await acc.apply_grad(np.ones(SMALL)) is True  # the same again
            late = await lost.late_copy()  # the copy Redis received before
            assert late[3] == 1 and await acc.num_accumulated() == 1
        finally:
            await acc.aclose()

    asyncio.run(main())


def test_the_same_apply_made_again_while_another_task_settles_it_counts_once(target):
    """The held apply's first copy ran; one task applies another gradient (settling it) while
    another makes the held one again: the second found nothing held (the first had taken
    it out to settle) and sent it under a new id: counted twice (review)."""
    async def main() -> None:
        acc = aio.ConditionalAccumulator(np.float32, SMALL, shared_name="ur",
                                         client=aclient(target))  # fmt: skip
        AsyncLostApplies(acc, ran=True)  # it runs; its reply is lost
        try:
            with pytest.raises(accumulator.UnavailableError):
                await acc.apply_grad(np.full(SMALL, 10.0))
            done = await asyncio.gather(acc.apply_grad(np.ones(SMALL)),
                                        acc.apply_grad(np.full(SMALL, 10.0)))  # fmt: skip
            assert done == [True, True]
            assert await acc.num_accumulated() == 2
            np.testing.assert_array_equal(await acc.take_grad(2), np.full(SMALL, 5.5))
        finally:
            await acc.aclose()

    asyncio.run(main())


def test_applies_after_a_settle_read_no_payload_unless_they_look_like_the_held_one(
    target, monkeypatch
):
    """The outcome is kept 10 minutes; hashing every later payload meanwhile (64 MiB: ~0.1 s)
    would slow the training loop down: only one of the same step, shapes and size is hashed."""
    from accumulator import _identities

    acc = make(target)
    LostApplies(acc, ran=True)
    with pytest.raises(accumulator.UnavailableError):
        acc.apply_grad(np.ones(SMALL), local_step=0)
    hashed = []
    real = _identities.apply_fingerprint
    monkeypatch.setattr(_identities, "apply_fingerprint", lambda *a: hashed.append(1) or real(*a))
    for step in (1, 2, 3):  # (later steps: nothing like the held one)
        assert acc.apply_grad(np.full(SMALL, 2.0), local_step=step) is True
    assert hashed == [] and acc._identities.holding
    assert acc.apply_grad(np.ones(SMALL), local_step=0) is True  # the held one: answered
    assert hashed == [1]


def test_a_batch_whose_replies_carry_a_connection_fault_is_sent_again(target, monkeypatch):
    """redis-py's cluster pipeline returns a node's connection error (or CLUSTERDOWN) as the
    reply of each of its commands: an apply took it for a refusal, dropped its parts and
    raised redis-py's ConnectionError, 4-5 s into a primary's failover (a review's cluster
    drill). Such a batch fails whole now, as on a single server, and is sent again."""
    from accumulator import _core

    faults: list[int] = []
    acc = make(target, LARGE)
    if target.kind == "cluster":
        client = acc._conns.commands
        real_pipeline = client.pipeline

        class Faulty:  # the parts' pipeline, whose node failed over
            def __init__(self, pipe: Any) -> None:
                self.pipe, self.n = pipe, 0

            def execute_command(self, *args: Any) -> Any:
                self.n += 1
                return self.pipe.execute_command(*args)

            def execute(self, raise_on_error: bool = True) -> Any:
                if not faults:
                    faults.append(self.n)
                    self.pipe.reset()
                    return [redis_exceptions.ConnectionError("simulated")] * self.n
                return self.pipe.execute(raise_on_error=raise_on_error)

        monkeypatch.setattr(client, "pipeline", lambda *a, **kw: Faulty(real_pipeline(*a, **kw)))
    else:
        real_batch = _core.execute_batch

        def execute_batch(client: Any, commands: Any, raise_on_error: bool) -> Any:
            if not faults:
                faults.append(len(commands))
                return [redis_exceptions.ConnectionError("simulated")] * len(commands)
            return real_batch(client, commands, raise_on_error)

        monkeypatch.setattr(_core, "execute_batch", execute_batch)
    assert acc.apply_grad(np.full(LARGE, 2.0)) is True
    assert faults
    assert acc.num_accumulated() == 1
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(LARGE, 2.0))
