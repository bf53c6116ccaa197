"""The chief of a sync job: :class:`ParameterServer` owns the parameters, takes the
gradients, updates and publishes; a restarted chief resumes the published job."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import numpy as np

from .. import _fusion, _retry
from .._codec import reply_text, scalar_int
from .._connection import Client, require_transactions
from .._errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from .._together import run_together
from ._job import TrainingFinished
from ._lease import CHIEF_LEASE_SECONDS, _ChiefLease, chief_key
from ._params import Update, apply_update, learning_rates, specs_for
from ._resuming import _Resumer

logger = logging.getLogger("accumulator.sync")


def _weak_call(method: Callable[[], bool]) -> Callable[[], bool]:
    """``method`` (a bound method) without a strong reference to its object: the lease
    thread that calls it must not keep a chief alive (its finalizer releases the lease)."""
    ref = weakref.WeakMethod(method)

    def call() -> bool:
        bound = ref()
        return bool(bound()) if bound is not None else False

    return call


class ParameterServer(_Resumer):
    """The chief: owns the parameters, takes the gradients, updates and publishes.

    ``sparse`` names the parameters whose gradients are sparse rows (dim 0 indexed); all
    others are dense. ``replicas_to_aggregate`` gradients of every parameter make one step.

    One chief per job: :meth:`initialize` takes the job's chief lease (``chief_lease``
    seconds, renewed in the background while this object lives, released by :meth:`close`);
    while another chief holds it, :class:`ChiefConflictError`. ``chief_id`` names this chief
    in the lease (default ``<hostname>-<pid>-<random>``): a restarted chief given the same
    id as the one that crashed takes over at once instead of waiting for its lease to run
    out (never give two live chiefs one id). ``retry_window``: seconds of Redis outage every
    operation rides through.

    ``fusion_bytes``: dense parameters smaller than this share accumulators, in buckets of up
    to this many bytes (Horovod's tensor fusion, PyTorch DDP's buckets): a model of many
    small tensors then costs a few accumulators per step instead of one per tensor; the
    gradients and the update are the same. 0: one accumulator per parameter. It is part of
    the job: set when the job is created, and kept by a chief that resumes it.
    """

    def __init__(
        self,
        job: str,
        *,
        replicas_to_aggregate: int,
        sparse: Iterable[str] = (),
        reduction_type: str = "MEAN",
        client: Client = None,
        container: str = "",
        chief_id: str | None = None,
        chief_lease: float = CHIEF_LEASE_SECONDS,
        retry_window: float = _retry.RETRY_WINDOW,
        fusion_bytes: int = _fusion.DEFAULT_FUSION_BYTES,
    ) -> None:
        replicas = scalar_int(replicas_to_aggregate, "replicas_to_aggregate")
        fusion = scalar_int(fusion_bytes, "fusion_bytes")
        if fusion < 0:
            raise InvalidArgumentError(f"fusion_bytes must be >= 0, got {fusion}")
        if replicas < 1:
            raise InvalidArgumentError(f"replicas_to_aggregate must be >= 1, got {replicas}")
        if reduction_type not in ("MEAN", "SUM"):
            raise InvalidArgumentError(
                f"reduction_type must be 'MEAN' or 'SUM', got {reduction_type!r}"
            )
        if not chief_lease > 0:
            raise InvalidArgumentError(f"chief_lease must be > 0 seconds, got {chief_lease!r}")
        if chief_id is not None and (not isinstance(chief_id, str) or not chief_id):
            raise InvalidArgumentError(f"chief_id must be a non-empty string, got {chief_id!r}")
        super().__init__(job, client=client, container=container, retry_window=retry_window)
        self.replicas_to_aggregate = replicas
        self.sparse = frozenset(sparse)
        self.reduction_type = reduction_type
        #: What a job this chief creates fuses (a resumed job keeps its own: ``_fusion``).
        self.fusion_bytes = fusion
        self._fusion = fusion
        #: This chief's name in the job's chief lease.
        self.chief_id = chief_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lease = _ChiefLease(self._redis, chief_key(self.keys), job, self.chief_id,
                                  float(chief_lease), self.retry_window)  # fmt: skip
        self._lease_finalizer = weakref.finalize(self, self._lease.release)
        self._params: dict[str, np.ndarray] = {}
        self._step: int | None = None
        self._run = ""
        self._done = False
        #: (run, step, tenure) of the parameters this chief last published or resumed from:
        #: its parts are set to expire once a newer version is published
        self._published_version: tuple[str, int, str] | None = None
        #: the version published before that one: deleted when a newer one is published
        #: (Redis holds two versions, however fast the steps; plus, for a minute after a
        #: restart, those of the chiefs before: _expire_other_versions)
        self._older_version: tuple[str, int, str] | None = None
        # Gradients already taken for the current step when a step() timed out part-way:
        # the next step() continues from there instead of taking those parameters twice.
        # After a restart it also holds the zero gradients of parameters whose round the
        # previous chief had read before it died.
        self._taken: dict[str, Any] = {}
        #: (the taken gradients, the parameters updated with them so far): an update
        #: interrupted part-way is completed by the next step(), not made again
        self._updating: tuple[dict[str, Any], set[str]] | None = None
        #: after an update whose publish failed: whether it was to be the final step (the
        #: next :meth:`step` publishes it); None otherwise
        self._unpublished: bool | None = None
        #: while :meth:`step` waits for gradients (the lease thread then compares the
        #: published step with this chief's: :meth:`_published_behind`)
        self._waiting = False
        self._lease.behind = _weak_call(self._published_behind)

    @property
    def global_step(self) -> int:
        """The published step (gradients for it are being collected)."""
        if self._step is None:
            raise RuntimeError("call initialize() first")
        return self._step

    @property
    def finished(self) -> bool:
        """Whether the job is finished (``step(final=True)``, :meth:`finish`, or a finished
        job found by :meth:`initialize`): :meth:`step` raises :class:`TrainingFinished`."""
        return self._done

    @property
    def params(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters."""
        return {name: arr.copy() for name, arr in self._params.items()}

    def initialize(
        self,
        params: Mapping[str, Any],
        *,
        resume: bool = True,
        step: int = 0,
        wait_for_chief: float = 0.0,
    ) -> int:
        """Create the accumulators and publish ``params`` at ``step``; returns the step.

        With ``resume`` (the default) a job that is already published with the same
        parameter names, kinds, dtypes and shapes is resumed instead: its published values
        and step win over ``params`` (a restarted chief continues where it stopped; see the
        module docstring for a chief that died during a step). A *finished* job is not
        restarted: its final parameters and step are loaded, nothing is written (but the
        seal of its accumulators, see :meth:`finish`), and
        :attr:`finished` is True (``step()`` then raises :class:`TrainingFinished`). With
        ``resume=False`` everything of an earlier job of this name is deleted first, finished
        or not: its parameters, counters, and its accumulators with their pending gradients
        and stats; a new job starts.

        Takes the job's chief lease first (not for a finished job, which is only read):
        :class:`ChiefConflictError` while another chief holds it, after waiting up to
        ``wait_for_chief`` seconds for it to run out.
        """
        specs, arrays = specs_for(params, self.sparse)
        step = scalar_int(step, "step")  # checked before anything is read or deleted
        if resume:
            published = self._read_published()
            if published is not None:
                self._check_resumable(published, specs)
                if published.done:
                    return self._load_finished(published)
        held = self._lease.held
        self._lease.acquire(wait_for_chief)
        try:
            # publishing is a transaction: a user without MULTI would publish half of one
            self._io("check permissions", lambda: require_transactions(self.redis,
                                                                       self.keys.params))
            # read again under the lease: another chief may have moved on meanwhile
            published = self._read_published() if resume else None
            if published is not None:
                self._check_resumable(published, specs)
                if published.done:
                    return self._load_finished(published)
                return self._resume(published)
            self._wipe(specs, self.fusion_bytes)  # (a new job's names checked first)
            self._fusion = self.fusion_bytes
            self._open_accumulators(specs, self.reduction_type, self._fusion)
            if step:
                for acc in self._accs.values():
                    acc.set_global_step(step)
            self._params, self._step, self._run = arrays, step, uuid.uuid4().hex
            self._taken, self._done, self._unpublished = {}, False, None
            self._publish(meta=True)
        except BaseException:
            if not held:
                self._lease.release()
            raise
        logger.info("sync job %r initialized at step %d: %s", self.job, self._step,
                    ", ".join(s.describe() for s in specs))  # fmt: skip
        return self._step

    def step(self, update: Update, timeout: float | None = None, *, final: bool = False) -> int:
        """Take ``replicas_to_aggregate`` gradients of every parameter, apply ``update``,
        publish the parameters with the next step; returns that step.

        ``update``: a learning rate (plain SGD, ``p -= lr * g``; sparse rows only where the
        gradient has rows), a mapping of per-parameter learning rates, or a callable
        ``fn(params, grads, step)`` that returns the new parameters or updates ``params`` in
        place and returns None. Sparse gradients arrive as
        :class:`~accumulator.SparseGradient` ``(indices, values, shape)``.

        ``timeout`` (seconds) raises :class:`~accumulator.DeadlineExceededError` naming the
        parameter waited on; what was taken is kept and the next call continues from there.
        So does any step that raises: an update that raised is made again, with the same
        gradients, by the next call (a function that changed the parameters or the gradients
        in place before it raised must undo that itself); parameters updated but not
        published (Redis refused or failed the write) are published by the next call, which
        then returns (it is that step's completion, not a new step). A learning rate missing
        from a mapping is refused before anything is taken.

        ``final`` publishes the new parameters as the job's last (as :meth:`finish`, in the
        same write: no worker computes a gradient for a step that will never be taken).

        Raises :class:`TrainingFinished` on a finished job and :class:`ChiefConflictError`
        when another chief took the job's lease over (this chief must stop).
        """
        if self._step is None:
            raise RuntimeError("call initialize() first")
        if self._done:
            raise TrainingFinished(
                f"sync job {self.job!r} is finished (at step {self._step}); "
                "initialize(resume=False) starts it anew"
            )
        self._lease.check(renew=False)
        if self._unpublished is not None:  # the last call updated, but could not publish
            return self._finish_step(self._unpublished or final)
        learning_rates(update, self._specs)  # refused before anything is taken
        # every parameter's take at once: their script calls share round trips
        todo: list[Any] = []  # the parameters this round of takes is for (set below)

        def taken(i: int, outcome: tuple[bool, Any]) -> None:  # kept even if interrupted
            if outcome[0]:
                self._taken[todo[i].name] = outcome[1]

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            todo = [unit for unit in self._units if unit.name not in self._taken]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # the takes stop (giving back what they claimed) while the lease may have run out,
            # or once the published step is found behind this chief's
            self._waiting = True
            try:
                outcomes = run_together([
                    (acc, acc._take_grad_ops(self.replicas_to_aggregate, left, None,
                                       cancel=self._lease.guard))
                    for acc in (self._accs[unit.name] for unit in todo)
                ], taken)  # fmt: skip
            finally:
                self._waiting = False
            failures = [(unit, value) for unit, (ok, value) in zip(todo, outcomes, strict=True)
                        if not ok]  # fmt: skip
            # (the guard may read clear again by now: the lease thread renewed meanwhile)
            if not any(isinstance(exc, CancelledError) for _, exc in failures) or any(
                acc._closed for acc in self._accs.values()  # closed: that CancelledError stands
            ):
                break
            if self._lease.republish and not self._lease.may_have_run_out():
                self._publish_again()
                continue
            # Not renewed for most of its length (this process was paused, or starved): the
            # lease is renewed now, or ChiefConflictError says another chief has the job (the
            # rounds given back are its). Renewed, the takes start again.
            logger.warning(
                "sync job %r: the chief lease was not renewed for %.1fs (paused?); its takes "
                "gave their rounds back; renewing it", self.job, self._lease.since_renewed(),
            )  # fmt: skip
            self._lease.check(renew=True)
        late = [(unit, exc) for unit, exc in failures if isinstance(exc, DeadlineExceededError)]
        if late:
            kept = sorted(self._taken)
            names = ", ".join(unit.describe() for unit, _ in late)
            raise DeadlineExceededError(
                f"sync job {self.job!r}, step {self._step}: parameter{'s' * (len(late) > 1)} "
                f"{names} did not get {self.replicas_to_aggregate} gradients within "
                f"{timeout:g}s; taken and kept for the next step(): "
                f"{', '.join(repr(n) for n in kept) or 'none'} ({late[0][1]})"
            ) from late[0][1]
        if failures:
            raise failures[0][1]
        self._catch_up()
        self._lease.check(renew=False)  # the publish renews it and is fenced by it
        # the gradients stay taken until the update is made (a raising update gets them again)
        grads = _fusion.split(self._units, self._taken)  # a bucket's: views of its array
        if self._updating is None or self._updating[0] is not self._taken:
            self._updating = (self._taken, set())  # (the parameters updated with these)
        self._params = apply_update(update, self._specs, self._params, grads, self._step,
                                    self._updating[1])  # fmt: skip
        self._taken, self._updating = {}, None
        self._step += 1
        return self._finish_step(final)

    def _published_behind(self) -> bool:
        """Whether the job's published step is behind this chief's while it waits for
        gradients: Redis lost its last publish (a failover to a replica that had not got it;
        the accumulators, in other slots, may have kept their steps). No worker would ever
        push for this chief's step: it must publish again (:meth:`_publish_again`)."""
        mine = self._step
        if not self._waiting or mine is None:
            return False
        run, step = (reply_text(v) for v in self.redis.hmget(self.keys.params, ["run", "step"]))
        # (the chief may have taken, published and started waiting for its next step while
        # this read was on its way: the step read is then its last, not one lost)
        return (self._waiting and self._step == mine and run == self._run and step.isdigit()
                and int(step) < mine)  # fmt: skip

    def _publish_again(self) -> None:
        """Publish this chief's parameters at its step once more (see
        :meth:`_published_behind`); the takes then start again."""
        logger.warning(
            "sync job %r: the published step is behind this chief's step %d (Redis lost the "
            "last publish: a failover to a replica behind?); publishing it again",
            self.job, self._step,
        )  # fmt: skip
        self._lease.republish = False
        self._publish()

    def _catch_up(self) -> None:
        """Accumulators whose rounds came from an earlier step than this chief's: Redis went
        back (restarted from an older snapshot, failed over to a replica behind), and the
        workers that saw it pushed for that step (``Worker.pull``). The gradients are applied
        to this chief's parameters, the newest there are, and those accumulators are set to
        the step it publishes next, so that stale pushes are dropped again (left behind, they
        would accept any push of a step between theirs and the chief's)."""
        step = cast(int, self._step)
        behind = [(unit, after) for unit in self._units
                  if (after := self._accs[unit.name]._claimed_step) is not None
                  and after <= step]  # fmt: skip
        if not behind:
            return
        unit, after = behind[0]
        logger.warning(
            "sync job %r: the round of %s came from step %d, this chief is at step %d (Redis "
            "lost writes: restarted from an older snapshot, or failed over to a replica "
            "behind); applied to this chief's parameters, and the accumulators set to step %d",
            self.job, unit.describe(), after - 1, step, step + 1,
        )  # fmt: skip
        for unit, _ in behind:
            self._accs[unit.name].set_global_step(step + 1)

    def _finish_step(self, final: bool) -> int:
        """Publish the updated parameters (kept as unpublished while that fails: the next
        :meth:`step` publishes them), then seal a final step's accumulators."""
        self._unpublished = bool(final)
        try:
            self._publish(done=final)
        except ResourceExhaustedError as exc:  # (its own message says nothing was changed)
            raise ResourceExhaustedError(
                f"sync job {self.job!r}: the gradients of the step to {self._step} are taken "
                "and the chief's parameters updated, but Redis refused their publish "
                "(maxmemory): the next step() publishes them, and takes nothing before; free "
                f"memory or raise maxmemory ({exc})"
            ) from exc
        self._unpublished = None
        self._done = bool(final)
        if final:
            self._seal()
        return cast(int, self._step)

    def finish(self) -> None:
        """Mark the job finished: workers waiting in ``pull(after=...)`` get
        :class:`TrainingFinished` once they have seen the last step, and the job's
        accumulators are sealed: a push at or after the final step (from a worker that has
        not pulled since) raises :class:`TrainingFinished` and applies nothing. On a finished
        job it only seals again (in case the call that finished it could not)."""
        if self._step is None:
            raise RuntimeError("call initialize() first")
        if not self._done:
            self._lease.check(renew=False)
            self._publish(done=True)  # (with an unpublished step's parameters too)
            self._done, self._unpublished = True, None
        self._seal()  # (again: a seal the last call could not finish)

    def delete(self) -> None:
        """Remove every key of this job: parameters, counters, the chief lease and the
        accumulators. Takes the chief lease first (:class:`ChiefConflictError` while another
        chief runs the job)."""
        self._lease.acquire()
        self._close_accumulators()
        self._wipe(self._specs, self._fusion)
        self._lease.release()
        self._specs, self._params, self._step, self._done = [], {}, None, False
        self._units = []

    def close(self) -> None:
        """Release the chief lease (another chief may start at once), the accumulators and
        the connections."""
        self._lease_finalizer()
        super().close()
