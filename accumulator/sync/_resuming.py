"""How a chief starts: a new job created (an earlier one of that name wiped), a published job
resumed where its last chief stopped (rounds it claimed handed over, accumulators behind or
ahead aligned), or a finished one loaded as it ended."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from .. import _admin, _fusion
from .._codec import reply_text
from .._errors import InvalidArgumentError, NotFoundError
from .._keys import Keys, is_done_mark
from ._job import accumulator_name
from ._params import zero_grad
from ._published import (
    ParamSpec,
    Published,
    unit_spec,
)
from ._publishing import _Publisher

logger = logging.getLogger("accumulator.sync")



class _Resumer(_Publisher):
    """A chief's start-up and resumption (the state it sets is ``ParameterServer``'s)."""

    fusion_bytes: int
    _taken: dict[str, Any]
    _done: bool
    _unpublished: bool | None

    def _check_resumable(self, published: Published, specs: list[ParamSpec]) -> None:
        if published.specs != specs:
            raise InvalidArgumentError(
                f"sync job {self.job!r} is published with different parameters "
                f"({'; '.join(s.describe() for s in published.specs)}) than given "
                f"({'; '.join(s.describe() for s in specs)}); use resume=False to replace it"
            )
        if published.reduction != self.reduction_type:
            raise InvalidArgumentError(
                f"sync job {self.job!r} is published with reduction_type "
                f"{published.reduction!r}, not {self.reduction_type!r}; use resume=False "
                "to replace it"
            )

    def _load_finished(self, published: Published) -> int:
        """A finished job stays finished: load its final state, write nothing but the seal of
        its accumulators (a chief that died between its final publish and the seal left
        them open to pushes)."""
        self._close_accumulators()
        self._specs, self._fusion = list(published.specs), published.fusion
        self._units = _fusion.plan(published.specs, published.fusion)
        self._params, self._run, self._step = published.params, published.run, published.step
        self._taken, self._done, self._unpublished = {}, True, None
        self._seal_stored(self._units, published.step)
        logger.info(
            "sync job %r is finished (at step %d): not restarted; its final parameters are "
            "loaded (initialize(resume=False) starts the job anew)", self.job, published.step,
        )  # fmt: skip
        return published.step

    def _resume(self, published: Published) -> int:
        if published.fusion != self.fusion_bytes:
            logger.info("sync job %r was created with fusion_bytes=%d: resumed with it (not "
                        "%d)", self.job, published.fusion, self.fusion_bytes)  # fmt: skip
        self._fusion = published.fusion
        self._open_accumulators(published.specs, published.reduction, published.fusion)
        self._params, self._run = published.params, published.run
        self._published_version = (published.run, published.step, published.tenure)
        self._older_version = None
        self._expire_other_versions()
        self._taken, self._done, self._unpublished = {}, False, None
        at = published.step
        steps = {name: acc.global_step() for name, acc in self._accs.items()}
        if any(s > at + 1 for s in steps.values()):
            return self._skip_to(published, steps)
        for name, s in steps.items():
            if s < at:
                # behind the published step (lost by a server restart, set by hand): align it;
                # what it holds was pushed at older steps
                logger.warning(
                    "sync job %r: accumulator %r at step %d, behind the published step %d; "
                    "set to %d, its pending gradients dropped", self.job,
                    accumulator_name(self.job, name), s, at, at,
                )  # fmt: skip
                # dropped first: cut short in between (Ctrl-C), the next initialize() still
                # finds it behind and does both (set first, the old gradients stayed, and
                # the next step took them; interrupt review)
                self._reset(name)
                self._accs[name].set_global_step(at)
        ahead = [name for name, s in steps.items() if s == at + 1]
        handed = [name for name in ahead if self._unfinished_claims(name)]
        lost = [name for name in ahead if name not in handed]
        if ahead and len(lost) == len(steps):
            # The previous chief read every parameter's round of this step and died before
            # publishing: those gradients are gone. Skip the step: republish the parameters
            # unchanged at the accumulators' step (waiting workers wake up and push again).
            logger.warning(
                "sync job %r: the previous chief died after taking step %d's gradients and "
                "before publishing; they are lost: the step is skipped, parameters "
                "republished unchanged at step %d", self.job, at, at + 1,
            )  # fmt: skip
            self._step = at + 1
            self._publish(meta=True)
            logger.info("sync job %r resumed at step %d", self.job, self._step)
            return self._step
        if ahead:
            # Died during the step: finish it. A claimed round the previous chief never read
            # is handed to this chief's take (the accumulator's step is not advanced again);
            # a round it had read is lost: that parameter gets a zero gradient this step.
            for name in lost:
                self._taken[name] = self._zero_grad(name)
            logger.warning(
                "sync job %r: the previous chief died during step %d, after taking %s; "
                "rounds handed over to this chief: %s; lost (a zero gradient this step): %s",
                self.job, at, sorted(ahead), sorted(handed) or "none", sorted(lost) or "none",
            )  # fmt: skip
        self._step = at
        if published.replicas != self.replicas_to_aggregate:
            self._publish(meta=True)
        logger.info("sync job %r resumed at step %d", self.job, at)
        return at

    def _zero_grad(self, unit_name: str) -> Any:
        """A gradient of the accumulator ``unit_name`` that changes nothing."""
        return zero_grad(unit_spec(next(u for u in self._units if u.name == unit_name)))

    def _skip_to(self, published: Published, steps: dict[str, int]) -> int:
        """Accumulators more than one step ahead (set by hand, two chiefs): align them all
        to the highest step, drop what is pending, republish there."""
        target = max([published.step, *steps.values()])
        logger.warning(
            "sync job %r: accumulators at steps %s but step %d published; the rounds in "
            "between are skipped, parameters republished at step %d",
            self.job, steps, published.step, target,
        )  # fmt: skip
        for name, acc in self._accs.items():
            if steps[name] != target:
                acc.set_global_step(target)
            self._reset(name)
        self._step = target
        self._publish(meta=True)
        return target

    def _reset(self, name: str) -> None:
        self._io("dropping pending gradients",
                 lambda: _admin.reset(self.redis, accumulator_name(self.job, name),
                                      self.container))  # fmt: skip

    def _unfinished_claims(self, name: str) -> int:
        """Claimed rounds of a parameter's accumulator that no taker has read yet (a taker
        that died after claiming): the accumulator hands them to its next take."""
        keys = Keys(self.container, accumulator_name(self.job, name))

        def read() -> int:
            registry = self.redis.hgetall(keys.claims)
            takers = [t for t, v in registry.items() if not is_done_mark(v)]
            if not takers:
                return 0
            pipe = self.redis.pipeline(transaction=False)
            for taker in takers:
                pipe.exists(keys.claim(reply_text(taker)))
            return sum(int(x) for x in pipe.execute())

        return self._io("reading claimed rounds", read)

    def _wipe(self, specs: list[ParamSpec], fusion: int) -> None:
        """Delete the job: its parameters, counters, and the accumulators of ``specs``
        (fused with ``fusion`` bytes) and of the job as published."""
        units = _fusion.plan(specs, fusion)  # (refused before anything is deleted)
        old = self._read_published(with_params=False)
        if old is not None:
            units += _fusion.plan(old.specs, old.fusion)
        names = {u.name for u in units} | {s.name for s in specs}
        for name in sorted(names):
            shared = accumulator_name(self.job, name)
            with contextlib.suppress(NotFoundError):
                self._io("deleting an accumulator",
                         lambda: _admin.delete(self.redis, shared, self.container))  # fmt: skip  # noqa: B023
        self._io("deleting the job", lambda: self.redis.delete(self.keys.params, self.keys.stats))
        self._io("deleting the job", lambda: _admin.delete_param_versions(self.redis, self.keys))
