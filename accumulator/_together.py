"""Several accumulators' protocol steps run side by side by the synchronous driver: the
script calls they make at the same moment go in one pipeline, so a sync job's push (one apply
per parameter) and its chief's step (one take per parameter) cost the round trips of one
parameter, not of all of them.

Each step is still driven as on its own (``AccumulatorBase._run``): the same requests, the
same retries through transient faults (a pipeline of script calls is sent again as a whole:
every call is idempotent by construction), NOSCRIPT reloads, and errors thrown back into the
step that made the request. What is shared is only the round trip. Requests that wait (a take
waiting for gradients) are served one at a time, and only when no step has anything else to
send: a step holding a claimed round never waits behind another's wait.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from . import _retry, _scripts
from ._requests import Batch, Call, Listen, Ops, Pop, Request, advance

if TYPE_CHECKING:
    from ._core import AccumulatorBase

#: One step's outcome: (True, its result) or (False, the exception it raised).
Outcome = tuple[bool, Any]


def run_together(
    steps: Sequence[tuple[AccumulatorBase, Ops[Any]]],
    on_outcome: Callable[[int, Outcome], None] | None = None,
) -> list[Outcome]:
    """Run every ``(accumulator, step)`` to its end; their outcomes in order. A step that
    raises does not stop the others, except for an interrupt (``KeyboardInterrupt``...,
    anything not an ``Exception``): it is thrown into every unfinished step, which cleans up
    as it would alone (a claimed round goes back), and then raised. ``on_outcome(i,
    outcome)`` is called as each step ends: what ended before an interrupt, or while it was
    thrown in (a take whose finish had run returns its round), is not lost (a round taken is
    the caller's)."""
    with contextlib.ExitStack() as driving:  # (each accumulator's close() waits for them)
        for acc in {id(acc): acc for acc, _ in steps}.values():
            driving.enter_context(acc._driving())
        return _run_steps(steps, on_outcome)


def _run_steps(
    steps: Sequence[tuple[AccumulatorBase, Ops[Any]]],
    on_outcome: Callable[[int, Outcome], None] | None,
) -> list[Outcome]:
    outcomes: list[Outcome | None] = [None] * len(steps)
    feed: dict[int, tuple[Any, BaseException | None]] = {i: (None, None) for i in range(len(steps))}
    pending: dict[int, Request] = {}
    while feed or pending:
        try:
            for i, (reply, error) in sorted(feed.items()):
                del feed[i]
                try:
                    done, request = advance(steps[i][1], reply, error)
                except Exception as exc:  # noqa: BLE001 - the step's outcome
                    _ended(outcomes, i, (False, exc), on_outcome)
                    continue
                if done:
                    _ended(outcomes, i, (True, request), on_outcome)
                else:
                    pending[i] = request
            if pending:
                feed = _serve(steps, pending)
        except BaseException as exc:
            _interrupt(steps, outcomes, exc, on_outcome)
            raise
    return [o for o in outcomes if o is not None]


def call_step(call: Call) -> Ops[Any]:
    """One script call as a protocol step, to run alongside others (a push's count)."""
    return (yield call)


def _ended(
    outcomes: list[Outcome | None], i: int, outcome: Outcome,
    on_outcome: Callable[[int, Outcome], None] | None,
) -> None:  # fmt: skip
    outcomes[i] = outcome
    if on_outcome is not None:
        on_outcome(i, outcome)


def _serve(
    steps: Sequence[tuple[AccumulatorBase, Ops[Any]]], pending: dict[int, Request]
) -> dict[int, tuple[Any, BaseException | None]]:
    """Do some of the pending requests (removed from ``pending``); their replies by step."""
    calls = {i: request for i, request in pending.items() if isinstance(request, Call)}
    if calls:
        for i in calls:
            del pending[i]
        return _calls(steps, calls)
    ready = [i for i, request in pending.items() if not isinstance(request, Pop | Listen)]
    replies: dict[int, tuple[Any, BaseException | None]] = {}
    for i in ready or [min(pending)]:  # waits: one at a time, when nothing else is left
        request = pending.pop(i)
        try:
            replies[i] = (steps[i][0]._do(request), None)
        except Exception as exc:  # noqa: BLE001 - thrown into the step
            replies[i] = (None, exc)
    return replies


def _calls(
    steps: Sequence[tuple[AccumulatorBase, Ops[Any]]], calls: dict[int, Call]
) -> dict[int, tuple[Any, BaseException | None]]:
    """Script calls, one pipeline per client the accumulators share (and per retry window:
    a call of one try, a taker's withdrawal after an outage, is not retried with the others)."""
    groups: dict[tuple[int, float | None], list[int]] = {}
    for i in calls:
        groups.setdefault((id(steps[i][0]._conns.commands), calls[i].window), []).append(i)
    replies: dict[int, tuple[Any, BaseException | None]] = {}
    for members in groups.values():
        acc = steps[members[0]][0]
        group = [calls[i] for i in members]
        what = group[0].what if len({c.what for c in group}) == 1 else "script calls"

        def send(
            acc: AccumulatorBase = acc, group: list[Call] = group
        ) -> list[tuple[Any, BaseException | None]]:
            return _pipelined(acc, group)

        try:
            results = acc._io(what, send, group[0].window)
        except Exception as exc:  # noqa: BLE001 - every call of the pipeline failed
            results = [(None, exc)] * len(members)
        replies.update(zip(members, results, strict=True))
    return replies


def _pipelined(acc: AccumulatorBase, calls: list[Call]) -> list[tuple[Any, BaseException | None]]:
    """EVALSHA of every call in one batch (the driver's: one pipeline, per node on a cluster;
    scripts the server lost are loaded and the batch sent again), each reply then handled as
    ``_scripts.call`` would (``ACCERR``: our exception)."""
    runs = [_scripts.steps(c.name, c.keys, c.args) for c in calls]
    batch = Batch(calls[0].what, [tuple(next(run)) for run in runs], raise_on_error=False)
    client = acc._conns.commands
    out: list[tuple[Any, BaseException | None]] = []
    for run, reply in zip(runs, acc._batch(batch), strict=True):
        error = reply if isinstance(reply, ResponseError) else None
        try:
            done, command = advance(run, None if error else reply, error)
            while not done:  # not expected (the batch loads missing scripts): as on its own
                try:
                    reply, error = client.execute_command(*command), None
                except ResponseError as exc:
                    reply, error = None, exc
                done, command = advance(run, reply, error)
            out.append((command, None))
        except Exception as exc:
            if _retry.is_transient(exc):
                raise  # a connection fault, a failover: the whole batch is sent again
            out.append((None, exc))  # the step's to handle, as on its own
    return out


def _interrupt(
    steps: Sequence[tuple[AccumulatorBase, Ops[Any]]], outcomes: list[Outcome | None],
    exc: BaseException, on_outcome: Callable[[int, Outcome], None] | None,
) -> None:  # fmt: skip
    """Throw an interrupt into every unfinished step and let each clean up on its own. A step
    that ends anyway (a take whose finish was in flight completes, and returns its round) is
    an outcome like any other (interrupt review: a sync chief dropped those rounds), and the
    interrupt it held for its accumulator's next call is dropped: it is raised now."""
    for i, outcome in enumerate(outcomes):
        if outcome is not None:
            continue
        acc, ops = steps[i]
        try:
            result = acc._run(ops, error=exc)
        except BaseException:  # noqa: BLE001 - it raised the interrupt (or its cleanup's error)
            continue
        if acc._held_interrupts.get(threading.get_ident()) is exc:
            del acc._held_interrupts[threading.get_ident()]
        _ended(outcomes, i, (True, result), on_outcome)
