"""A replica of a sync job: :class:`Worker` pulls the published parameters and pushes
gradients at their step."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import redis

from .. import _chunks, _retry, _scripts
from .._codec import scalar_int
from .._connection import Client
from .._dense import ConditionalAccumulator
from .._errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from .._requests import Call, Ops
from .._sparse import SparseConditionalAccumulator
from .._together import call_step, run_together
from ._job import TrainingFinished, Version, _Job
from ._published import Published, decode_announcement
from ._push import validated_push

logger = logging.getLogger("accumulator.sync")

#: Longest sleep of a waiting worker between two looks at the published step.
POLL_SLICE = 1.0


def _payload_bytes(prepared: tuple[Any, ...]) -> int:
    """The payload bytes of one tensor's apply (``prepared``: from :func:`validated_push`)."""
    if len(prepared) == 2:  # sparse: (indices, values); the indices travel as int64
        return int(np.size(prepared[0])) * 8 + int(prepared[1].nbytes)
    return int(prepared[0].nbytes)


def _apply_ops(
    acc: ConditionalAccumulator | SparseConditionalAccumulator, prepared: tuple[Any, ...],
    step: int,
) -> Ops[bool]:  # fmt: skip
    """One tensor's apply as a protocol step (``prepared``: from :func:`validated_push`)."""
    if isinstance(acc, SparseConditionalAccumulator):
        indices, values = prepared
        return acc._apply_grad_ops(indices, values, None, step)
    return acc._apply_wire_ops(prepared[0], step)  # checked and converted already


class Worker(_Job):
    """A replica: pulls the published parameters, pushes gradients at their step.

    ``worker_id`` labels this worker's push counters (default ``<hostname>-<pid>``); a worker
    that restarts under the same id keeps adding to the same counters. The counters of every
    id stay in the job's stats hash until the job is deleted (~80 bytes per id and counter):
    a job whose workers restart often should give them stable ids (a pod name, a rank), or
    its stats and ``accumulator job NAME`` list every process that ever pushed. ``retry_window``:
    seconds of Redis outage every operation rides through (a waiting ``pull`` subscribes
    again after its connection dropped).
    """

    def __init__(
        self,
        job: str,
        *,
        client: Client = None,
        container: str = "",
        worker_id: str | None = None,
        retry_window: float = _retry.RETRY_WINDOW,
    ) -> None:
        super().__init__(job, client=client, container=container, retry_window=retry_window)
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._pubsub: Any = None
        self._watched: Any = None  # the subscription held since the last look at the job
        self._published: Published | None = None  # what the last pull adopted (no params)
        self._run: str | None = None
        self._step: int | None = None
        self._finished = False
        # the final step of a finished job that a pull(after=) raised TrainingFinished for
        # (the worker still holds the parameters of its last pull, not the final ones)
        self._ended_at: int | None = None
        # (step, {param: accepted}, push id) of a push that failed part-way: pushing again at
        # that step applies only the other tensors, and counts under the same push id.
        self._partial: tuple[int, dict[str, bool], str] | None = None
        # a push found this worker's accumulators deleted since it opened them: the next pull
        # opens them again, even in the same run (one deleted by hand, then created again)
        self._reopen = False
        #: This worker's lifetime counts: pushes, and tensors accepted / dropped as stale.
        self.pushes = 0
        self.accepted = 0
        self.dropped = 0

    @property
    def step(self) -> int | None:
        """The step of the last pull (None before the first)."""
        return self._step

    @property
    def finished(self) -> bool:
        """Whether this worker has seen its job finished: the last pull returned the final
        parameters of a finished job, or raised :class:`TrainingFinished`."""
        return self._finished or self._ended_at is not None

    def _subscribe(self) -> None:
        def subscribe() -> Any:
            pubsub = self._blocking.pubsub()
            try:
                pubsub.subscribe(self.keys.channel)
            except BaseException:
                with contextlib.suppress(Exception):
                    pubsub.close()
                raise
            return pubsub

        self._pubsub = self._io("subscribing", subscribe)

    def _drop_pubsub(self) -> None:
        pubsub, self._pubsub, self._watched = self._pubsub, None, None
        if pubsub is not None:
            try:
                pubsub.close()
            except Exception:  # noqa: BLE001 - closing a broken connection is best effort
                logger.debug("closing the pub/sub connection failed", exc_info=True)

    def pull(
        self, timeout: float | None = None, *, after: int | None = None
    ) -> tuple[int, dict[str, np.ndarray]]:
        """Wait for the parameters, then return ``(step, params)``.

        Without ``after``: the current step as soon as the job is initialized (a late or
        restarted worker catches up here; a finished job's final parameters too, and
        :attr:`finished` says so). With ``after``: wait for a step newer than it (or for a
        re-initialized job); :class:`TrainingFinished` once the job is finished. A job that
        went back to an earlier step (Redis lost writes: restarted from an older snapshot, a
        failover) is returned at that step, with a warning, so that its workers push for the
        step its chief now takes (waiting for a newer one would wait for ever).
        ``timeout`` (seconds) raises :class:`~accumulator.DeadlineExceededError`. Redis
        faults are ridden out for :attr:`retry_window` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def wanted(published: Published) -> bool:
            restarted = self._run is not None and published.run != self._run
            if after is not None and not restarted and published.done:
                return False  # finished: raised below, nothing to read
            return after is None or restarted or published.step > after or went_back(
                published.step)

        def went_back(step: int) -> bool:
            # a step of this run below one this worker has seen: the job went back (above)
            return self._step is not None and step < self._step

        def finished(step: int) -> TrainingFinished:
            # no gradient is wanted any more: a push would never be taken
            self._ended_at = step
            return TrainingFinished(f"sync job {self.job!r} finished at step {step}")

        # the version a steady worker pulls next: its parameters come with the first look
        guess = None
        if after is not None and self._run is not None and self._specs:
            tenure = self._published.tenure if self._published is not None else ""
            guess = Version(self._run, after + 1, tuple(self._specs), self._fusion, tenure)
        # Subscribed since the look that gave this worker its step, it has every announcement
        # made after that look in hand: waiting for the next one needs no look first.
        look = not (guess is not None and not self.finished and self._step is not None
                    and after is not None and after >= self._step
                    and self._pubsub is not None and self._watched is self._pubsub)  # fmt: skip
        looked = False  # a timeout is raised only after one look at least
        gone = False  # the last look found nothing published (the job deleted, or its data lost)
        while True:
            if self._pubsub is None:
                # Subscribe before the look: a publish after that look is then never missed.
                self._subscribe()
                look = True
            if look:
                published, looked = self._read_published(wanted=wanted, guess=guess), True
                gone = published is None
                self._watched = self._pubsub
                if published is not None:
                    restarted = self._run is not None and published.run != self._run
                    if after is not None and not restarted and published.done:
                        raise finished(published.step)
                    if wanted(published):
                        return self._adopt(published)
            wait = POLL_SLICE
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0 and looked:
                    lost = (
                        " (nothing of the job is published any more: it was deleted, or Redis "
                        "lost its data, restarted without persistence or failed over; a chief "
                        "that resumes it publishes again)" if gone else ""
                    )
                    raise DeadlineExceededError(
                        f"no parameters of sync job {self.job!r} newer than step {after} "
                        f"within {timeout}s{lost}" if after is not None else
                        f"sync job {self.job!r} was not initialized within {timeout}s"
                    )  # fmt: skip
            try:
                messages = self._messages(max(wait, 0.0))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                # Redis restarting, or the connection killed: subscribe again (retried for
                # the retry window) and look again; a publish meanwhile is then seen.
                logger.info("sync job %r: pub/sub connection lost (%s); subscribing again",
                            self.job, exc)  # fmt: skip
                self._drop_pubsub()
                time.sleep(0.05)
                continue
            # A small model's announcements carry its parameters: no read, unless one of
            # them does not (a step alone, another run, garbage) or none came.
            last = self._published
            announced = [decode_announcement(m, self._run, self._units) for m in messages]
            look = last is None or not announced or None in announced
            if not look and last is not None:
                step, done, params = max((a for a in announced if a), key=lambda a: a[:2])
                if after is not None and done:
                    raise finished(step)
                if after is None or step > after or went_back(step):
                    return self._adopt(dataclasses.replace(last, step=step, done=done,
                                                           params=params))  # fmt: skip

    def _messages(self, wait: float) -> list[Any]:
        """The announcements in hand, waiting up to ``wait`` seconds for the first."""
        end = time.monotonic() + wait
        out: list[Any] = []
        while True:  # (subscription replies come too: they are skipped)
            left = 0.0 if out else max(end - time.monotonic(), 0.0)
            message = self._pubsub.get_message(timeout=left)
            if message is None:
                return out
            if message.get("type") == "message":
                out.append(message["data"])

    def _adopt(self, published: Published) -> tuple[int, dict[str, np.ndarray]]:
        if self._reopen or published.run != self._run or published.specs != self._specs:
            if published.run != self._run or published.specs != self._specs:
                self._partial = None  # (applied into accumulators of another run)
            self._open_accumulators(published.specs, published.reduction, published.fusion)
            self._run = published.run
            self._reopen = False
        if (self._step is not None and published.step < self._step
                and published.run == self._run):  # fmt: skip
            logger.warning(
                "sync job %r went back from step %d to step %d (Redis lost writes: restarted "
                "from an older snapshot, or failed over to a replica behind); going on from "
                "there", self.job, self._step, published.step,
            )  # fmt: skip
        self._published = dataclasses.replace(published, params={})
        self._step = published.step
        self._finished = published.done
        self._ended_at = None
        return published.step, published.params

    def push(self, step: int, grads: Mapping[str, Any]) -> dict[str, bool]:
        """Apply one gradient per parameter at ``step`` (normally the pulled step); returns
        which were accepted (False: dropped as stale, the chief already took that step).

        Dense gradients are arrays of the parameter's shape; sparse ones ``(indices,
        values)`` or an ``IndexedSlices`` with rows of the parameter. Every tensor is checked
        before any is applied (:class:`~accumulator.InvalidArgumentError`, nothing applied).
        A push at or after the final step of a finished job raises :class:`TrainingFinished`
        and applies nothing (one at an earlier step is dropped as stale, like any late push).
        If applying fails part-way (Redis unreachable past the retry window, a full round),
        the error is raised and the tensors applied so far are remembered: a push again at
        the same step applies only the others.
        """
        if not self._accs:
            raise RuntimeError("pull() first: the worker learns the parameters from the job")
        names = [s.name for s in self._specs]
        if set(grads) != set(names):
            raise InvalidArgumentError(f"push needs gradients for exactly {sorted(names)}, "
                             f"got {sorted(grads)}")  # fmt: skip
        step = scalar_int(step, "step")
        # Finished since the last pull, the job's accumulators are sealed: the applies below
        # are refused (lua/seal.lua).
        final = self._step if self._finished else self._ended_at
        if final is not None and step >= final:
            raise TrainingFinished(
                f"sync job {self.job!r} finished at step {final}: a push at step "
                f"{step} would never be taken; nothing was applied"
            )
        prepared = validated_push(self.job, self._units, self._accs, grads)
        result: dict[str, bool] = {}
        push_id = uuid.uuid4().hex[:16]  # a retried count is recognised and counted once
        if self._partial is not None and self._partial[0] == step:
            _, done_before, push_id = self._partial
            result = dict(done_before)
            if result:
                logger.info(
                    "sync job %r: this push at step %d completes one that failed part-way "
                    "(%s already applied)", self.job, step, ", ".join(sorted(result)),
                )  # fmt: skip
        # every tensor's apply at once, and the push's count: their script calls share round
        # trips. The count is made before the outcome is known, as "all accepted" (the common
        # case); a push with a stale tensor amends it after. Only when each apply is one round
        # trip (every payload one part); a push with a larger tensor (its parts take several)
        # is counted after its applies, with their outcome: a worker killed in the middle of
        # such a push leaves no count of a push whose gradients never all arrived.
        # (result: unit name -> accepted; a fused bucket's parameters share its outcome)
        todo = [unit for unit in self._units if unit.name not in result]
        counted = len(todo)  # the count's index among the steps

        def applied(i: int, outcome: tuple[bool, Any]) -> None:
            if i < counted and outcome[0]:
                result[todo[i].name] = bool(outcome[1])

        together = all(_payload_bytes(prepared[u.name]) <= _chunks.SOLE_PART_BYTES for u in todo)
        steps: list[tuple[Any, Ops[Any]]] = [
            (acc, _apply_ops(acc, prepared[unit.name], step))
            for unit, acc in ((u, self._accs[u.name]) for u in todo)
        ]  # fmt: skip
        if together:
            steps.append((self._accs[self._units[0].name],
                          call_step(self._count_call(push_id, ""))))  # fmt: skip
        try:
            outcomes = run_together(steps, applied)
        except BaseException:  # interrupted: what is known to be applied is remembered
            self._partial = (step, dict(result), push_id)
            raise
        sealed = next((value for ok, value in outcomes
                       if not ok and isinstance(value, FailedPreconditionError)), None)  # fmt: skip
        if sealed is not None:
            raise self._finished_push(step, push_id, sealed, result)
        gone = next((value for ok, value in outcomes
                     if not ok and isinstance(value, NotFoundError)), None)  # fmt: skip
        if gone is not None:
            # Accumulators this worker pulled were deleted (and maybe created again) since:
            # the job started again (initialize(resume=False): every one of them is another
            # now, nothing of this push went in), or one was deleted by hand and created
            # again by a resumed chief: the tensors accepted into the others are in rounds
            # that will be taken, and remembered as a part-way push is (a push again at this
            # step after the pull applies only the rest; the pull forgets them if the run
            # changed).
            self._partial = (step, dict(result), push_id) if result else None
            self._reopen = True
            went_in = sorted(name for name, ok in result.items() if ok)
            with contextlib.suppress(Exception):  # (amended, or taken back)
                if went_in or together:
                    self._count_now(push_id, "partial" if went_in else "none")
            kept = (f"{', '.join(went_in)} went into the job's rounds and are kept (a push "
                    f"again at step {step} applies the others)" if went_in else
                    "nothing of this push was applied")  # fmt: skip
            raise NotFoundError(
                f"sync job {self.job!r}: accumulators this worker pulled (run {self._run}) "
                f"were deleted since, the job ended or started again; {kept}: pull() to join "
                f"the job as it is now ({gone})"
            ) from gone
        failed = next((value for ok, value in outcomes if not ok), None)
        if failed is not None:
            self._partial = (step, dict(result), push_id)
            if result:
                logger.error(
                    "sync job %r: push at step %d failed after applying %s; pushing again "
                    "at step %d applies only the others", self.job, step,
                    ", ".join(sorted(result)), step,
                )  # fmt: skip
            raise failed
        applied_units = dict(result)
        result = {m.name: result[u.name] for u in self._units for m in u.members}
        result = {name: result[name] for name in names}
        n_ok = sum(result.values())
        outcome = "" if n_ok == len(result) else "stale" if n_ok == 0 else "partial"
        if outcome or not together:  # amend the count made as "all accepted", or count now
            # every tensor is in: a count interrupted or failed is made again by the push
            # again, which applies nothing (interrupt review: Ctrl-C here applied it twice)
            self._partial = (step, applied_units, push_id)
            self._count_now(push_id, outcome)
        self._partial = None
        self.pushes += 1
        self.accepted += n_ok
        self.dropped += len(result) - n_ok
        return result

    def _finished_push(
        self, step: int, push_id: str, sealed: FailedPreconditionError, result: dict[str, bool]
    ) -> TrainingFinished:
        """The job finished since this worker's last pull: its accumulators are sealed. The
        push is not counted (its count, made before, is amended to 'none')."""
        self._partial = None
        if sealed.final_step is not None:
            self._ended_at = sealed.final_step
        try:
            self._count_now(push_id, "none")
        except Exception:  # noqa: BLE001 - a counter: the push's outcome is what matters
            logger.warning("sync job %r: could not take back the count of a push into the "
                           "finished job", self.job, exc_info=True)  # fmt: skip
        applied = sorted(name for name, ok in result.items() if ok)
        where = (f"{', '.join(applied)} went into rounds that will never be taken (the job "
                 "finished while they were applied)" if applied else "nothing was applied")
        error = TrainingFinished(
            f"sync job {self.job!r} finished at step {sealed.final_step}: a push at step "
            f"{step} would never be taken; {where}"
        )  # fmt: skip
        error.__cause__ = sealed
        return error

    def _count_call(self, push_id: str, what: str) -> Call:
        """The ``lua/sync_count.lua`` call counting this worker's push ``push_id`` with the
        outcome ``what`` ('' all accepted, ``stale``, ``partial``, or ``none``: not counted)."""
        return Call("counting the push", "sync_count", [self.keys.stats, self.keys.params],
                    [self.worker_id, push_id, what])  # fmt: skip

    def _count_now(self, push_id: str, what: str) -> None:
        """Count the push ``push_id`` as ``what``: a first count, or the amendment of one
        made before (one round trip)."""
        amend = self._count_call(push_id, what)
        self._io(amend.what, lambda: _scripts.call(self.redis, amend.name, amend.keys, amend.args))

    def close(self) -> None:
        """Stop listening for publishes and release the job's connections."""
        self._drop_pubsub()
        super().close()
