"""Interrupts that land after Redis ran a request, before its reply reached the caller: Ctrl-C,
``SystemExit`` from a SIGTERM handler, or an exception a signal handler raises (a SIGALRM
timeout). Nothing accepted is lost or counted twice, and the same call made again after the
interrupt is counted once (interrupt review of 2026-11-30: six ways each lost a round or
counted a gradient twice).

The reply is "lost" by a wrapper of the synchronous driver's ``_do``: it makes the request,
then raises as a signal handler would while the thread waits for the reply.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _helpers import sync_job

import accumulator
from accumulator import _core, _scripts, _together
from accumulator._requests import Batch, Call


class Alarm(Exception):
    """What a SIGALRM handler of a timeout helper raises."""


class Interrupt(BaseException):
    """Ctrl-C for the tests where a regression would let it escape: a real KeyboardInterrupt
    stops the whole pytest session; this fails the test alone."""


INTERRUPTS = [KeyboardInterrupt, SystemExit, Alarm]
SIZES = {"inline": (4, 3), "parts": (3 * (1 << 20) // 4,)}  # 48 bytes; 3 MiB: 2 parts
APPLY_SHA = _scripts.sha("apply")


def _runs(request: Any, script: str) -> bool:
    """Whether ``request`` runs the script named ``script``."""
    if isinstance(request, Call):
        return request.name == script
    if isinstance(request, Batch):
        sha = _scripts.sha(script)
        return any(c[0] == "EVALSHA" and c[1] == sha for c in request.commands)
    return False


def lose_reply(monkeypatch: pytest.MonkeyPatch, acc: Any, script: str, exc: BaseException,
               *, ran: bool = True) -> dict[str, bool]:  # fmt: skip
    """The next request of ``acc`` that runs ``script`` is made (``ran``; else not sent at
    all), then ``exc`` raised instead of its reply. Returns {"fired": ...}."""
    real = acc._do
    state = {"fired": False}

    def do(request: Any) -> Any:
        if not state["fired"] and _runs(request, script):
            state["fired"] = True
            if ran:
                real(request)
            raise exc
        return real(request)

    monkeypatch.setattr(acc, "_do", do)
    return state


def dense(target: Any, shape: tuple[int, ...], name: str = "intr") -> Any:
    return accumulator.ConditionalAccumulator(np.float32, shape, shared_name=name,
                                              client=target.client())  # fmt: skip


@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("size", list(SIZES))
def test_an_apply_counted_then_interrupted_is_counted_once_when_made_again(
    target, monkeypatch, size, interrupt
):
    acc = dense(target, SIZES[size])
    grad = np.full(SIZES[size], 1.5, np.float32)
    state = lose_reply(monkeypatch, acc, "apply", interrupt("reply lost"))
    with pytest.raises(interrupt):
        acc.apply_grad(grad, 0)
    assert state["fired"]
    monkeypatch.undo()
    assert acc.num_accumulated() == 1
    assert acc.apply_grad(grad, 0) is True  # the caller's retry: answered, not sent again
    assert acc.num_accumulated() == 1
    acc.apply_grad(np.ones(SIZES[size], np.float32), 0)  # another gradient counts as usual
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), (grad + 1) / 2)
    acc.close()


@pytest.mark.parametrize("size", list(SIZES))
def test_an_apply_interrupted_before_redis_ran_it_is_sent_when_made_again(target, monkeypatch,
                                                                          size):
    acc = dense(target, SIZES[size])
    grad = np.full(SIZES[size], 2.0, np.float32)
    lose_reply(monkeypatch, acc, "apply", KeyboardInterrupt(), ran=False)
    with pytest.raises(KeyboardInterrupt):
        acc.apply_grad(grad, 0)
    monkeypatch.undo()
    assert acc.num_accumulated() == 0
    assert acc.apply_grad(grad, 0) is True
    assert acc.num_accumulated() == 1
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), grad)
    acc.close()


def test_an_apply_interrupted_while_its_parts_are_added_in_redis_counts_once(target,
                                                                             monkeypatch):
    """Module path: the parts of a large gradient past the first few are added into the sum
    by calls after the apply was counted; Ctrl-C there raised, and the retry counted it
    again."""
    shape = (3_000_000,)  # 12 parts
    acc = dense(target, shape, "folds")
    if not acc.sums_in_redis:
        pytest.skip("the sum is kept in Redis on the module path only")
    acc.apply_grad(np.ones(shape, np.float32), 0)  # the round's sum exists: the next folds
    grad = np.full(shape, 3.0, np.float32)
    state = lose_reply(monkeypatch, acc, "fold", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        acc.apply_grad(grad, 0)
    assert state["fired"]
    monkeypatch.undo()
    assert acc.num_accumulated() == 2
    assert acc.apply_grad(grad, 0) is True
    assert acc.num_accumulated() == 2
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), np.full(shape, 2.0, np.float32))
    acc.close()


@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: e.__name__)
def test_a_take_whose_finish_ran_returns_its_round_and_the_next_call_raises(target, monkeypatch,
                                                                            interrupt):
    """Only Ctrl-C was held: SystemExit or a signal handler's exception went on to give the
    round back, found none claimed (the finish had run), and the round was lost."""
    acc = dense(target, SIZES["parts"])
    grad = np.full(SIZES["parts"], 4.0, np.float32)
    acc.apply_grad(grad, 0)
    state = lose_reply(monkeypatch, acc, "finish", interrupt("reply lost"))
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), grad)
    assert state["fired"]
    monkeypatch.undo()
    with pytest.raises(interrupt):
        acc.num_accumulated()  # the interrupt, held for the next call
    assert (acc.global_step(), acc.num_accumulated()) == (1, 0)
    acc.close()


def test_an_interrupt_between_the_finish_and_the_driver_returns_the_round(target, monkeypatch):
    """Ctrl-C in the driver's own code, after the finish's reply came back and before the
    take was handed it: the take was abandoned (its round lost, the finish having run)."""
    acc = dense(target, SIZES["inline"])
    grad = np.full(SIZES["inline"], 5.0, np.float32)
    acc.apply_grad(grad, 0)
    real_advance = _core.advance
    last: list[Any] = [None]
    fired: list[bool] = []

    def advance(ops: Any, reply: Any, error: Any) -> Any:
        if _runs(last[0], "finish") and not fired:
            fired.append(True)
            raise Interrupt  # lands before the reply is handed to the take
        done, request = real_advance(ops, reply, error)
        last[0] = request
        return done, request

    monkeypatch.setattr(_core, "advance", advance)
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), grad)
    assert fired
    monkeypatch.undo()
    with pytest.raises(Interrupt):
        acc.global_step()
    assert (acc.global_step(), acc.num_accumulated()) == (1, 0)
    acc.close()


def _interrupt_pipeline(monkeypatch: pytest.MonkeyPatch, script: str) -> dict[str, bool]:
    """The next pipeline of script calls that runs ``script`` (``run_together``'s) is made,
    then Ctrl-C lands before its replies are handed out."""
    real: Callable[..., Any] = _together._pipelined
    state = {"fired": False}

    def pipelined(acc: Any, calls: list[Call]) -> Any:
        replies = real(acc, calls)
        if not state["fired"] and any(c.name == script for c in calls):
            state["fired"] = True
            raise Interrupt
        return replies

    monkeypatch.setattr(_together, "_pipelined", pipelined)
    return state


def test_takes_run_together_keep_the_rounds_whose_finish_ran(target, monkeypatch):
    accs = [dense(target, SIZES["inline"], f"t{i}") for i in range(2)]
    for i, acc in enumerate(accs):
        acc.apply_grad(np.full(SIZES["inline"], i + 1.0, np.float32), 0)
    state = _interrupt_pipeline(monkeypatch, "finish")
    ended: dict[int, Any] = {}
    with pytest.raises(Interrupt):
        _together.run_together([(acc, acc._take_grad_ops(1, 5, None)) for acc in accs],
                               lambda i, outcome: ended.update({i: outcome}))  # fmt: skip
    assert state["fired"]
    monkeypatch.undo()
    assert sorted(ended) == [0, 1]
    for i, acc in enumerate(accs):
        assert ended[i][0]
        np.testing.assert_array_equal(ended[i][1], np.full(SIZES["inline"], i + 1.0))
        # raised once, by run_together: not again by the accumulator's next call
        assert (acc.global_step(), acc.num_accumulated()) == (1, 0)
        acc.close()


PARAMS = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}
LR = 0.5


def test_a_sync_chief_interrupted_while_its_takes_finish_keeps_the_rounds(target, monkeypatch):
    ps, worker, step = sync_job(target, PARAMS)
    grads = {"w": np.ones((4, 3), np.float32), "b": np.full(3, 2.0, np.float32)}
    assert worker.push(step, grads) == {"w": True, "b": True}
    state = _interrupt_pipeline(monkeypatch, "finish")
    with pytest.raises(Interrupt):
        ps.step(LR, timeout=5)
    assert state["fired"]
    monkeypatch.undo()
    ps.step(LR, timeout=5)  # the rounds taken before the interrupt: no wait, no interrupt
    for name, grad in grads.items():
        np.testing.assert_array_equal(ps.params[name], -LR * grad)
    assert worker.push(step + 1, grads) == {"w": True, "b": True}  # the job goes on
    ps.step(LR, timeout=5)
    np.testing.assert_array_equal(ps.params["b"], -2 * LR * grads["b"])
    worker.close()
    ps.close()


def test_a_sync_push_interrupted_after_its_applies_landed_is_counted_once(target, monkeypatch):
    ps, worker, step = sync_job(target, PARAMS)
    grads = {"w": np.ones((4, 3), np.float32), "b": np.full(3, 2.0, np.float32)}
    state = _interrupt_pipeline(monkeypatch, "apply")
    with pytest.raises(Interrupt):
        worker.push(step, grads)
    assert state["fired"]
    monkeypatch.undo()
    assert worker.push(step, grads) == {"w": True, "b": True}
    _counted_once(ps, worker, grads)


def test_a_sync_push_interrupted_in_its_count_applies_nothing_again(target, monkeypatch):
    """A push with a tensor of several parts is counted after its applies, in a round trip
    of its own: Ctrl-C there forgot that every tensor was in, and the push again applied them
    all a second time."""
    params = {"big": np.zeros(1 << 19, np.float32), "b": np.zeros(3, np.float32)}  # 2 MiB
    ps, worker, step = sync_job(target, params)
    grads = {"big": np.ones(1 << 19, np.float32), "b": np.full(3, 2.0, np.float32)}
    real = worker._count_now
    fired: list[bool] = []

    def count_now(push_id: str, what: str) -> None:
        real(push_id, what)
        if not fired:
            fired.append(True)
            raise Interrupt

    monkeypatch.setattr(worker, "_count_now", count_now)
    with pytest.raises(Interrupt):
        worker.push(step, grads)
    assert worker.push(step, grads) == {"big": True, "b": True}
    monkeypatch.undo()
    _counted_once(ps, worker, grads)


def _counted_once(ps: Any, worker: Any, grads: dict[str, Any]) -> None:
    """The worker's one push (made again after an interrupt) is in once: one gradient in each
    accumulator (twice would not show in the MEAN of identical gradients), one push counted,
    and the step moves each parameter by it once. Closes both."""
    assert [acc.num_accumulated() for acc in ps._accs.values()] == [1] * len(ps._accs)
    stats = ps.stats()
    assert stats.pushes == stats.accepted == 1 and worker.pushes == 1
    ps.step(LR, timeout=5)
    for name, grad in grads.items():
        np.testing.assert_array_equal(ps.params[name], -LR * grad)
    worker.close()
    ps.close()


def test_a_chief_update_interrupted_part_way_is_completed_by_the_next_step(target, monkeypatch):
    """The learning-rate update, interrupted between two parameters: the next step() updates
    only the ones left (it updated the first again, with its gradient already scaled)."""
    from accumulator.sync import _params

    params = {"a": np.zeros(1000, np.float32), "b": np.zeros(1000, np.float32)}
    ps, worker, step = sync_job(target, params, fusion_bytes=0)
    grads = {"a": np.full(1000, 1.0, np.float32), "b": np.full(1000, 2.0, np.float32)}
    assert worker.push(step, grads) == {"a": True, "b": True}
    real = _params._scalable_in_place
    calls: list[int] = []

    def interrupted(g: Any, p: Any) -> bool:
        calls.append(1)
        if len(calls) == 2:  # the second parameter's turn: the first is updated
            raise Interrupt
        return real(g, p)

    monkeypatch.setattr(_params, "_scalable_in_place", interrupted)
    with pytest.raises(Interrupt):
        ps.step(LR, timeout=5)
    monkeypatch.undo()
    assert ps.step(LR, timeout=5) == step + 1  # no new take: the update is completed
    for name, grad in grads.items():
        np.testing.assert_array_equal(ps.params[name], -LR * grad)
    worker.close()
    ps.close()


def test_a_delete_cut_short_after_its_transaction_leaves_no_payload_for_good(target,
                                                                             monkeypatch):
    """Interrupted after the state went, before the round's payloads were unlinked: they
    stayed in Redis with no expiry, named by nothing (invisible to `accumulator ls`)."""
    from accumulator import _admin_ops

    acc = dense(target, SIZES["parts"], "doomed")
    if acc.spreads_parts:
        pytest.skip("spread parts are swept apart (their records have an expiry)")
    for _ in range(2):
        acc.apply_grad(np.ones(SIZES["parts"], np.float32), 0)
    r = target.redis()
    payloads = [k for k in r.scan_iter(match=f"{acc._keys.base}:b:*")]
    assert payloads and all(r.pttl(k) == -1 for k in payloads)  # the round holds them

    def cut(*args: Any) -> int:
        raise Interrupt

    monkeypatch.setattr(_admin_ops, "_unlink", cut)
    with pytest.raises(Interrupt):
        accumulator.delete_accumulator("doomed", client=target.client())
    monkeypatch.undo()
    assert not r.exists(acc._keys.state)
    ttls = [r.pttl(k) for k in payloads]
    assert all(0 < t <= _admin_ops.DELETED_TTL_MS for t in ttls), ttls
    acc.close()


def test_a_resume_cut_short_while_it_aligns_an_accumulator_behind_drops_its_gradients(
    target, monkeypatch
):
    """A restarted chief aligns an accumulator found behind the published step: its step set
    and its pending gradients (pushed at older steps) dropped. Cut short between the two, the
    next initialize() must still drop them (it set the step first: the accumulator no longer
    looked behind, and the next step took the stale gradients)."""
    from accumulator.sync import ParameterServer

    ps = ParameterServer("behind", replicas_to_aggregate=1, client=target.client())
    ps.initialize(PARAMS, step=3)
    (name,) = ps._accs  # (both parameters fused into one accumulator)
    ps._accs[name].set_global_step(2)
    (size,) = ps._accs[name].shape
    ps._accs[name].apply_grad(np.ones(size, np.float32), local_step=2)  # an older step's
    ps.close()
    chief = ParameterServer("behind", replicas_to_aggregate=1, client=target.client())
    real_reset, real_set = type(chief)._reset, accumulator.ConditionalAccumulator.set_global_step
    calls: list[str] = []

    def second_raises(what: str, real: Any) -> Any:
        def call(self: Any, *args: Any) -> Any:
            calls.append(what)
            if len(calls) == 2:
                raise Interrupt  # between the two changes of the accumulator
            return real(self, *args)
        return call

    monkeypatch.setattr(type(chief), "_reset", second_raises("reset", real_reset))
    monkeypatch.setattr(accumulator.ConditionalAccumulator, "set_global_step",
                        second_raises("set", real_set))  # fmt: skip
    with pytest.raises(Interrupt):
        chief.initialize(PARAMS)
    monkeypatch.undo()
    assert chief.initialize(PARAMS) == 3
    acc = chief._accs[name]
    assert (acc.global_step(), acc.num_accumulated()) == (3, 0)
    chief.close()


def test_a_held_interrupt_is_raised_in_the_thread_it_came_to(target, monkeypatch):
    """The interrupt a take held (its finish in flight) is for the thread that was taking:
    another thread sharing the object (a worker applying) does not get it."""
    import threading

    acc = dense(target, SIZES["inline"])
    acc.apply_grad(np.ones(SIZES["inline"], np.float32), 0)
    lose_reply(monkeypatch, acc, "finish", Alarm("reply lost"))
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(SIZES["inline"]))
    monkeypatch.undo()
    seen: list[Any] = []

    def worker() -> None:
        try:
            seen.append(acc.apply_grad(np.ones(SIZES["inline"], np.float32), 1))
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            seen.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert seen == [True]
    with pytest.raises(Alarm):
        acc.num_accumulated()  # the taking thread's next call
    assert acc.num_accumulated() == 1
    acc.close()


def test_a_command_interrupted_between_its_send_and_its_read_leaves_no_reply_behind(
    target, monkeypatch
):
    """Ctrl-C after redis-py sent a command and before it read the reply: the connection
    went back to its pool with the reply unread, and redis-py 8 (maintenance notifications
    "auto") no longer checks for that, so the next command read it as its own: an apply
    took an HMGET's reply for its script's."""
    import time

    import redis.client

    if target.kind in ("fake", "cluster"):
        pytest.skip("a plain server's pooled connections (fakeredis reads no socket)")
    acc = dense(target, SIZES["inline"], "unread")
    acc.apply_grad(np.ones(SIZES["inline"], np.float32), 0)
    real = redis.client.Redis._send_command_parse_response
    fired: list[bool] = []

    def send_then_interrupt(self: Any, conn: Any, command_name: str, *args: Any,
                            **options: Any) -> Any:  # fmt: skip
        if command_name == "HMGET" and not fired:
            fired.append(True)
            conn.send_command(*args, **options)
            time.sleep(0.05)  # the reply arrives meanwhile (redis-py's check would see it)
            raise Interrupt  # unread
        return real(self, conn, command_name, *args, **options)

    monkeypatch.setattr(redis.client.Redis, "_send_command_parse_response", send_then_interrupt)
    with pytest.raises(Interrupt):
        acc.num_accumulated()
    assert fired
    monkeypatch.undo()
    assert acc.apply_grad(np.full(SIZES["inline"], 3.0, np.float32), 0) is True
    assert acc.num_accumulated() == 2
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), np.full(SIZES["inline"], 2.0))
    acc.close()


def test_the_packer_hands_hiredis_no_number(monkeypatch):
    """hiredis converts numbers with a call that runs signal handlers, and crashed the
    process (SIGSEGV) when one raised: numbers reach it as bytes, the same bytes."""
    from accumulator import _packer

    if _packer._PACKER._hiredis is None:
        pytest.skip("no hiredis with pack_command")
    real = _packer._PACKER._hiredis
    seen: list[tuple[Any, ...]] = []

    def spy(args: tuple[Any, ...]) -> bytes:
        seen.append(args)
        return bytes(real(args))

    monkeypatch.setattr(_packer._PACKER, "_hiredis", spy)
    command = ("EVALSHA", "ab" * 20, 2, "k1", b"k2", 5, -3, 1.5, 2**70)
    packed = _packer.pack(*command)
    assert seen and not any(type(a) in (int, float) for a in seen[0])
    assert packed == [real(command)]


_PACK_UNDER_SIGNALS = r"""
import signal, sys, time
from accumulator import _packer

def handler(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGALRM, handler)
args = ("EVALSHA", "0" * 40, 1, "k", *range(1_000_000))
started = time.perf_counter()
_packer.pack(*args)
took = time.perf_counter() - started
for fraction in (0.2, 0.4, 0.6, 0.8):
    signal.setitimer(signal.ITIMER_REAL, took * fraction)
    try:
        _packer.pack(*args)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        pass
print("alive")
"""


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_a_signal_while_a_command_is_packed_raises_and_does_not_crash():
    import subprocess
    import sys

    from accumulator import _packer

    if _packer._PACKER._hiredis is None:
        pytest.skip("no hiredis with pack_command")
    proc = subprocess.run([sys.executable, "-c", _PACK_UNDER_SIGNALS], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "alive" in proc.stdout, (proc.returncode, proc.stderr[-500:])
