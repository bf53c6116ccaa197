"""Synchronous data-parallel training through Redis, the way TF1's ``SyncReplicasOptimizer``
did it: one accumulator per parameter, workers apply gradients at their local step, a chief
takes ``replicas_to_aggregate`` of them, updates the parameters and publishes them with the
next step. Framework-agnostic: numpy in, numpy out (torch/jax tensors are accepted through
``__array__``).

The chief::

    from accumulator.sync import ParameterServer

    ps = ParameterServer("mnist", replicas_to_aggregate=3, sparse={"emb"}, client=url)
    ps.initialize({"w": w0, "b": b0, "emb": emb0})  # or resumes a job already published
    print(ps.accumulator_names)  # {"w": "mnist/w", ...}: `python -m accumulator watch mnist/w`
    while ps.global_step < 1000:
        # plain SGD (or {"w": 0.1, ...}, or fn(params, grads, step)); final: the last update,
        # then workers' pull(after=...) raise TrainingFinished
        ps.step(0.1, timeout=60, final=ps.global_step == 999)
    print(ps.stats())  # pushes accepted / dropped as stale, per worker and per accumulator

Each worker (any number, on any host; only the job name is needed)::

    from accumulator.sync import TrainingFinished, Worker

    worker = Worker("mnist", client=url)
    step, params = worker.pull(timeout=60)  # the current step: late joiners catch up
    while True:
        grads = compute(params)  # {"w": array, "b": array, "emb": (indices, values)}
        accepted = worker.push(step, grads)  # {"w": True, ...}; False = dropped as stale
        try:
            step, params = worker.pull(after=step, timeout=60)
        except TrainingFinished:
            break

Semantics:

- Parameters named in ``sparse`` go through a :class:`SparseConditionalAccumulator`: workers
  push ``(indices, values)`` (or an ``IndexedSlices``) holding only the rows they touched;
  MEAN divides each row by the number of gradients that contained it.
- With ``replicas_to_aggregate`` smaller than the number of workers the slowest workers are
  backups: a gradient pushed after the chief's take of that step is dropped as stale (the
  accumulator's global step moved on). :meth:`ParameterServer.stats` and the ``push`` results
  show how many; pushes are counted per job and per worker in Redis, so every host's count
  is visible to all.
- The parameters travel through Redis: one hash holding the step, a run id, a ``done`` flag,
  msgpack metadata and each parameter's raw little-endian bytes (never pickle). A publish is
  one HSET (atomic: a reader never sees the parameters of one step with another's step
  number) followed by a PUBLISH; waiting workers sleep on that pub/sub channel and re-check
  the hash at least every ``POLL_SLICE`` seconds, so a lost message only costs latency.
- A worker that joins late or restarts simply pulls: it gets the current step and
  parameters. A worker that dies mid-push leaves at most a partial gradient (counted).
- A chief that restarts calls :meth:`ParameterServer.initialize` again and resumes the
  published job. If it died between its takes and its publish, that round's gradients are
  lost: the accumulators are ahead of the published step, so the last parameters are
  republished at the accumulators' step (waiting workers wake up and push again).
- The step counts chief updates, as TF's ``global_step``; a restarted worker that pushes
  again at a step it already pushed at is counted twice (as in TF).

Redis keys (besides each parameter's accumulator, shared name ``<job>/<param>``) are built by
:class:`SyncKeys`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np
import redis

from . import _admin
from ._codec import format_shape, resolve_dtype, wire_dtype
from ._connection import connect
from ._core import AccumulatorBase
from ._dense import ConditionalAccumulator
from ._errors import DeadlineExceededError, NotFoundError
from ._keys import Keys, SyncKeys
from ._sparse import SparseConditionalAccumulator

__all__ = [
    "ParamSpec",
    "ParamStats",
    "ParameterServer",
    "SyncKeys",
    "SyncStats",
    "TrainingFinished",
    "Update",
    "Worker",
    "WorkerStats",
    "accumulator_name",
]

logger = logging.getLogger("accumulator.sync")

#: Longest sleep of a waiting worker between two looks at the published step.
POLL_SLICE = 1.0
_META_VERSION = 1
_KINDS = ("dense", "sparse")

#: What :meth:`ParameterServer.step` applies: a learning rate for every parameter, one per
#: parameter, or ``fn(params, grads, step) -> new params | None`` (None: updated in place).
Update = (
    float
    | Mapping[str, float]
    | Callable[[dict[str, np.ndarray], dict[str, Any], int], Mapping[str, Any] | None]
)


class TrainingFinished(Exception):
    """Raised by :meth:`Worker.pull` with ``after=`` once the chief called ``finish()``."""


def accumulator_name(job: str, param: str) -> str:
    """The shared name of a parameter's accumulator (what the CLI shows and watches)."""
    return f"{job}/{param}"


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, accumulator kind, dtype and (fully known) shape."""

    name: str
    kind: str  # "dense" | "sparse"
    dtype: np.dtype
    shape: tuple[int, ...]

    def pack(self) -> list[Any]:
        return [self.name, self.kind, self.dtype.name, list(self.shape)]

    @classmethod
    def unpack(cls, raw: list[Any]) -> ParamSpec:
        name, kind, dtype, shape = raw
        return cls(name, kind, resolve_dtype(dtype), tuple(int(d) for d in shape))

    def describe(self) -> str:
        return f"{self.name}: {self.kind} {self.dtype.name} {format_shape(self.shape)}"


@dataclass(frozen=True)
class ParamStats:
    """One parameter's accumulator, as its scripts count (every host's activity)."""

    shared_name: str
    kind: str
    global_step: int
    pending: int  # gradients accepted for the current step so far
    applied: int  # accepted, lifetime
    stale: int  # dropped as stale, lifetime
    max_stale: int  # the most steps behind a dropped gradient was
    taken: int  # takes (chief updates)


@dataclass(frozen=True)
class WorkerStats:
    """Pushes of one worker: a push is one gradient per parameter, at one step."""

    pushes: int
    partial: int  # some tensors accepted, some dropped (the chief took in between)
    stale: int  # every tensor dropped

    @property
    def accepted(self) -> int:
        return self.pushes - self.partial - self.stale


@dataclass(frozen=True)
class SyncStats:
    """A snapshot of a job: the published step, pushes per worker, each accumulator."""

    step: int | None  # None: not initialized
    done: bool
    pushes: int
    partial: int
    stale: int
    workers: dict[str, WorkerStats]
    params: dict[str, ParamStats]

    @property
    def accepted(self) -> int:
        """Pushes whose every tensor was accepted."""
        return self.pushes - self.partial - self.stale

    @property
    def stale_tensors(self) -> int:
        """Gradient tensors dropped as stale, summed over the parameters."""
        return sum(p.stale for p in self.params.values())


@dataclass(frozen=True)
class _Published:
    run: str
    step: int
    done: bool
    specs: list[ParamSpec]
    replicas: int
    reduction: str
    params: dict[str, np.ndarray]


def _int(value: bytes | None, default: int = 0) -> int:
    return default if value is None else int(value)


def _as_array(value: Any) -> np.ndarray:
    """A private numpy copy of a parameter (numpy, lists, torch, jax, ...)."""
    if hasattr(value, "detach") and hasattr(value, "requires_grad"):  # torch: drop autograd
        value = value.detach().cpu()
    return np.array(value)


def _sparse_parts(grad: Any, name: str) -> tuple[Any, Any]:
    """(indices, values) of a sparse gradient: IndexedSlices-like, SparseGradient or a pair."""
    if hasattr(grad, "indices") and hasattr(grad, "values"):
        return grad.indices, grad.values
    if isinstance(grad, (tuple, list)) and len(grad) == 2:
        return grad[0], grad[1]
    raise TypeError(
        f"the gradient of sparse parameter {name!r} must be (indices, values) or an "
        f"IndexedSlices, not {type(grad).__name__}"
    )


_J = TypeVar("_J", bound="_Job")


class _Job:
    """What the chief and the workers share: connections, keys, reading state and stats.

    A URL given as ``client`` is read once, here, into clients: no attribute keeps it (nor
    the password in it); the accumulators are opened on the commands client.
    """

    def __init__(self, job: str, *, client: redis.Redis | str | None, container: str) -> None:
        if not job:
            raise ValueError("a sync job needs a non-empty name")
        self.job = job
        self.container = container or ""
        self.keys = SyncKeys(self.container, job)
        conns = connect(client)
        self._redis: redis.Redis = conns.commands  # also what the accumulators derive from
        self._blocking: redis.Redis = conns.blocking  # pub/sub waits only
        self._specs: list[ParamSpec] = []
        self._accs: dict[str, AccumulatorBase] = {}

    def __repr__(self) -> str:
        step = getattr(self, "_step", None)
        return f"{type(self).__name__}(job={self.job!r}, container={self.container!r}, step={step})"

    @property
    def redis(self) -> redis.Redis:
        """The client for ordinary commands (replies are bytes)."""
        return self._redis

    @property
    def specs(self) -> list[ParamSpec]:
        """The parameters (empty until initialized/pulled)."""
        return list(self._specs)

    @property
    def accumulator_names(self) -> dict[str, str]:
        """Parameter name -> shared name of its accumulator."""
        return {s.name: accumulator_name(self.job, s.name) for s in self._specs}

    def _open_accumulators(self, specs: list[ParamSpec], reduction: str) -> None:
        self._close_accumulators()
        for spec in specs:
            cls = ConditionalAccumulator if spec.kind == "dense" else SparseConditionalAccumulator
            self._accs[spec.name] = cls(
                spec.dtype, spec.shape, shared_name=accumulator_name(self.job, spec.name),
                name=spec.name, reduction_type=reduction, client=self._redis,
                container=self.container,
            )  # fmt: skip
        self._specs = list(specs)

    def _close_accumulators(self) -> None:
        for acc in self._accs.values():
            acc.close()
        self._accs = {}

    def _read_published(self, with_params: bool = True) -> _Published | None:
        """The published state, read in one HGETALL (a consistent snapshot)."""
        if with_params:
            raw = self.redis.hgetall(self.keys.params)
        else:
            fields = ("run", "step", "done", "meta")
            raw = dict(zip([f.encode() for f in fields],
                           self.redis.hmget(self.keys.params, fields), strict=True))  # fmt: skip
        if raw.get(b"meta") is None or raw.get(b"step") is None:
            return None
        meta = msgpack.unpackb(raw[b"meta"], raw=False)
        if meta.get("v") != _META_VERSION:
            raise RuntimeError(
                f"sync job {self.job!r} was published by an incompatible version "
                f"(metadata version {meta.get('v')!r}, this library reads {_META_VERSION})"
            )
        specs = [ParamSpec.unpack(p) for p in meta["params"]]
        params: dict[str, np.ndarray] = {}
        if with_params:
            for spec in specs:
                data = raw.get(b"v:" + spec.name.encode())
                if data is None:
                    raise RuntimeError(f"sync job {self.job!r}: parameter {spec.name!r} missing")
                arr = np.frombuffer(data, dtype=wire_dtype(spec.dtype)).reshape(spec.shape)
                params[spec.name] = arr.astype(spec.dtype)  # a writable copy in native order
        return _Published(
            run=raw[b"run"].decode(), step=int(raw[b"step"]), done=raw.get(b"done") == b"1",
            specs=specs, replicas=int(meta["replicas"]), reduction=meta["reduction"],
            params=params,
        )  # fmt: skip

    def stats(self) -> SyncStats:
        """Published step, push counters and every accumulator's statistics (one round trip
        after the parameters are known)."""
        specs = self._specs
        if not specs:
            published = self._read_published(with_params=False)
            specs = published.specs if published else []
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(self.keys.params, ["step", "done"])
        pipe.hgetall(self.keys.stats)
        fields = ["step", "count", "n_applied", "n_stale", "max_stale", "n_taken"]
        for spec in specs:
            state = Keys(self.container, accumulator_name(self.job, spec.name)).state
            pipe.hmget(state, fields)
        replies = pipe.execute()
        (step, done), counters = replies[0], replies[1]
        workers: dict[str, dict[str, int]] = {}
        for key, value in counters.items():
            parts = key.decode().split(":")
            if parts[0] == "w" and len(parts) >= 3:
                wid, what = ":".join(parts[1:-1]), parts[-1]
                workers.setdefault(wid, {})[what] = int(value)
        params = {}
        for spec, values in zip(specs, replies[2:], strict=True):
            st, count, applied, stale, max_stale, taken = (_int(v) for v in values)
            params[spec.name] = ParamStats(accumulator_name(self.job, spec.name), spec.kind, st,
                                           count, applied, stale, max_stale, taken)  # fmt: skip
        return SyncStats(
            step=None if step is None else int(step), done=done == b"1",
            pushes=_int(counters.get(b"pushes")), partial=_int(counters.get(b"partial")),
            stale=_int(counters.get(b"stale")),
            workers={w: WorkerStats(c.get("pushes", 0), c.get("partial", 0), c.get("stale", 0))
                     for w, c in sorted(workers.items())},
            params=params,
        )  # fmt: skip

    def close(self) -> None:
        """Close the accumulators and the connections."""
        self._close_accumulators()
        self._blocking.close()
        self._redis.close()

    def __enter__(self: _J) -> _J:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ParameterServer(_Job):
    """The chief: owns the parameters, takes the gradients, updates and publishes.

    ``sparse`` names the parameters whose gradients are sparse rows (dim 0 indexed); all
    others are dense. ``replicas_to_aggregate`` gradients of every parameter make one step.
    There should be one chief per job at a time.
    """

    def __init__(
        self,
        job: str,
        *,
        replicas_to_aggregate: int,
        sparse: Iterable[str] = (),
        reduction_type: str = "MEAN",
        client: redis.Redis | str | None = None,
        container: str = "",
    ) -> None:
        if int(replicas_to_aggregate) < 1:
            raise ValueError(f"replicas_to_aggregate must be >= 1, got {replicas_to_aggregate}")
        if reduction_type not in ("MEAN", "SUM"):
            raise ValueError(f"reduction_type must be 'MEAN' or 'SUM', got {reduction_type!r}")
        super().__init__(job, client=client, container=container)
        self.replicas_to_aggregate = int(replicas_to_aggregate)
        self.sparse = frozenset(sparse)
        self.reduction_type = reduction_type
        self._params: dict[str, np.ndarray] = {}
        self._step: int | None = None
        self._run = ""
        # Gradients already taken for the current step when a step() timed out part-way:
        # the next step() continues from there instead of taking those parameters twice.
        self._taken: dict[str, Any] = {}

    @property
    def global_step(self) -> int:
        """The published step (gradients for it are being collected)."""
        if self._step is None:
            raise RuntimeError("call initialize() first")
        return self._step

    @property
    def params(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters."""
        return {name: arr.copy() for name, arr in self._params.items()}

    def _specs_for(self, params: Mapping[str, Any]) -> tuple[list[ParamSpec], dict]:
        unknown = self.sparse - set(params)
        if unknown:
            raise ValueError(f"sparse names parameters that do not exist: {sorted(unknown)}")
        specs, arrays = [], {}
        for name, value in params.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"parameter names must be non-empty strings, got {name!r}")
            arr = _as_array(value)
            kind = "sparse" if name in self.sparse else "dense"
            if kind == "sparse" and arr.ndim < 1:
                raise ValueError(f"sparse parameter {name!r} needs at least one dimension")
            spec = ParamSpec(name, kind, resolve_dtype(arr.dtype), tuple(arr.shape))
            specs.append(spec)
            arrays[name] = np.ascontiguousarray(arr, dtype=spec.dtype)
        if not specs:
            raise ValueError("no parameters")
        return specs, arrays

    def initialize(self, params: Mapping[str, Any], *, resume: bool = True, step: int = 0) -> int:
        """Create the accumulators and publish ``params`` at ``step``; returns the step.

        With ``resume`` (the default) a job that is already published with the same
        parameter names, kinds, dtypes and shapes is resumed instead: its published values
        and step win over ``params`` (a restarted chief continues where it stopped). With
        ``resume=False`` everything of an earlier job of this name is deleted first: its
        parameters, counters, and its accumulators with their pending gradients and stats.
        """
        specs, arrays = self._specs_for(params)
        published = self._read_published() if resume else None
        if published is not None:
            if published.specs != specs:
                raise ValueError(
                    f"sync job {self.job!r} is published with different parameters "
                    f"({'; '.join(s.describe() for s in published.specs)}) than given "
                    f"({'; '.join(s.describe() for s in specs)}); use resume=False to replace it"
                )
            if published.reduction != self.reduction_type:
                raise ValueError(
                    f"sync job {self.job!r} is published with reduction_type "
                    f"{published.reduction!r}, not {self.reduction_type!r}; use resume=False "
                    "to replace it"
                )
            return self._resume(published)
        self._wipe(specs)
        self._open_accumulators(specs, self.reduction_type)
        if step:
            for acc in self._accs.values():
                acc.set_global_step(step)
        self._params, self._step, self._run = arrays, int(step), uuid.uuid4().hex
        self._taken = {}
        self._publish(meta=True)
        logger.info("sync job %r initialized at step %d: %s", self.job, self._step,
                    ", ".join(s.describe() for s in specs))  # fmt: skip
        return self._step

    def _resume(self, published: _Published) -> int:
        self._open_accumulators(published.specs, published.reduction)
        self._params, self._run = published.params, published.run
        self._taken = {}
        steps = {name: acc.global_step() for name, acc in self._accs.items()}
        target = max([published.step, *steps.values()])
        if target != published.step or any(s != target for s in steps.values()):
            # A chief died between its takes and its publish: those gradients are gone.
            # Skip that round: drop what is pending, align every accumulator, republish.
            logger.warning(
                "sync job %r: accumulators at steps %s but step %d published; the lost round "
                "is skipped, parameters republished at step %d",
                self.job, steps, published.step, target,
            )  # fmt: skip
            for name, acc in self._accs.items():
                if steps[name] != target:
                    acc.set_global_step(target)
                _admin.reset(self.redis, accumulator_name(self.job, name), self.container)
        self._step = target
        self._publish(meta=published.replicas != self.replicas_to_aggregate)
        logger.info("sync job %r resumed at step %d", self.job, target)
        return target

    def _wipe(self, specs: list[ParamSpec]) -> None:
        old = self._read_published(with_params=False)
        names = {s.name for s in specs} | {s.name for s in (old.specs if old else [])}
        for name in sorted(names):
            with contextlib.suppress(NotFoundError):
                _admin.delete(self.redis, accumulator_name(self.job, name), self.container)
        self.redis.delete(self.keys.params, self.keys.stats)

    def _publish(self, *, meta: bool = False, done: bool = False) -> None:
        mapping: dict[str, Any] = {"run": self._run, "step": self._step, "done": int(done)}
        if meta:
            mapping["meta"] = msgpack.packb(
                {"v": _META_VERSION, "params": [s.pack() for s in self._specs],
                 "replicas": self.replicas_to_aggregate, "reduction": self.reduction_type},
                use_bin_type=True,
            )  # fmt: skip
        for spec in self._specs:
            arr = np.ascontiguousarray(self._params[spec.name], dtype=wire_dtype(spec.dtype))
            mapping["v:" + spec.name] = arr.tobytes()
        # One HSET: readers (HGETALL) see either the old step and parameters or the new ones.
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.params, mapping=mapping)
        pipe.publish(self.keys.channel, str(self._step))
        pipe.execute()

    def step(self, update: Update, timeout: float | None = None, *, final: bool = False) -> int:
        """Take ``replicas_to_aggregate`` gradients of every parameter, apply ``update``,
        publish the parameters with the next step; returns that step.

        ``update``: a learning rate (plain SGD, ``p -= lr * g``; sparse rows only where the
        gradient has rows), a mapping of per-parameter learning rates, or a callable
        ``fn(params, grads, step)`` that returns the new parameters or updates ``params`` in
        place and returns None. Sparse gradients arrive as
        :class:`~accumulator.SparseGradient` ``(indices, values, shape)``.

        ``timeout`` (seconds) raises :class:`~accumulator.DeadlineExceededError`; what was
        taken is kept and the next call continues from there.

        ``final`` publishes the new parameters as the job's last (as :meth:`finish`, in the
        same write: no worker computes a gradient for a step that will never be taken).
        """
        if self._step is None:
            raise RuntimeError("call initialize() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        for spec in self._specs:
            if spec.name in self._taken:
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            acc = self._accs[spec.name]
            self._taken[spec.name] = acc.take_grad(  # type: ignore[attr-defined]
                self.replicas_to_aggregate, timeout=remaining
            )
        grads, self._taken = self._taken, {}
        self._apply_update(update, grads, self._step)
        self._step += 1
        self._publish(done=final)
        return self._step

    def _apply_update(self, update: Update, grads: dict[str, Any], step: int) -> None:
        if callable(update):
            out = update(self._params, grads, step)
            self._params = self._checked(self._params if out is None else out)
            return
        if isinstance(update, Mapping):
            missing = [s.name for s in self._specs if s.name not in update]
            if missing:
                raise ValueError(f"no learning rate for parameters {missing}")
            rates = {name: float(lr) for name, lr in update.items()}
        else:
            rates = {s.name: float(update) for s in self._specs}
        for spec in self._specs:
            p, g, lr = self._params[spec.name], grads[spec.name], rates[spec.name]
            if spec.kind == "sparse":
                # indices come back unique, so fancy-index assignment adds each row once
                p[g.indices] -= np.asarray(lr * g.values, dtype=p.dtype)
            else:
                p -= np.asarray(lr * g, dtype=p.dtype)

    def _checked(self, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
        names = {s.name for s in self._specs}
        if set(params) != names:
            raise ValueError(f"update returned parameters {sorted(params)}, expected "
                             f"{sorted(names)}")  # fmt: skip
        out = {}
        for spec in self._specs:
            arr = _as_array(params[spec.name])
            if arr.shape != spec.shape:
                raise ValueError(f"update changed the shape of {spec.name!r}: "
                                 f"{arr.shape} != {spec.shape}")  # fmt: skip
            if not np.can_cast(arr.dtype, spec.dtype, casting="same_kind"):
                raise ValueError(f"update returned {arr.dtype} for {spec.name!r} "
                                 f"({spec.dtype} expected)")  # fmt: skip
            out[spec.name] = np.ascontiguousarray(arr, dtype=spec.dtype)
        return out

    def finish(self) -> None:
        """Mark the job finished: workers waiting in ``pull(after=...)`` get
        :class:`TrainingFinished` once they have seen the last step."""
        if self._step is None:
            raise RuntimeError("call initialize() first")
        self._publish(done=True)

    def delete(self) -> None:
        """Remove every key of this job: parameters, counters and the accumulators."""
        self._close_accumulators()
        self._wipe(self._specs)
        self._specs, self._params, self._step = [], {}, None


class Worker(_Job):
    """A replica: pulls the published parameters, pushes gradients at their step.

    ``worker_id`` labels this worker's push counters (default ``<hostname>-<pid>``); a worker
    that restarts under the same id keeps adding to the same counters.
    """

    def __init__(
        self,
        job: str,
        *,
        client: redis.Redis | str | None = None,
        container: str = "",
        worker_id: str | None = None,
    ) -> None:
        super().__init__(job, client=client, container=container)
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._pubsub: Any = None
        self._run: str | None = None
        self._step: int | None = None
        self._finished = False
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
        """Whether the last pull returned the final parameters of a finished job."""
        return self._finished

    def pull(
        self, timeout: float | None = None, *, after: int | None = None
    ) -> tuple[int, dict[str, np.ndarray]]:
        """Wait for the parameters, then return ``(step, params)``.

        Without ``after``: the current step as soon as the job is initialized (a late or
        restarted worker catches up here; a finished job's final parameters too, and
        :attr:`finished` says so). With ``after``: wait for a step newer than it (or for a
        re-initialized job); :class:`TrainingFinished` once the job is finished.
        ``timeout`` (seconds) raises :class:`~accumulator.DeadlineExceededError`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._pubsub is None:
            # Subscribe before the first look: a publish after that look is then never missed.
            self._pubsub = self._blocking.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(self.keys.channel)
        while True:
            run, step, done = self.redis.hmget(self.keys.params, ["run", "step", "done"])
            if run is not None and step is not None:
                restarted = self._run is not None and run.decode() != self._run
                if after is not None and not restarted and done == b"1":
                    # no gradient is wanted any more: a push would never be taken
                    raise TrainingFinished(f"sync job {self.job!r} finished at step {int(step)}")
                if after is None or restarted or int(step) > after:
                    published = self._read_published()
                    if published is not None:
                        return self._adopt(published)
            wait = POLL_SLICE
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise DeadlineExceededError(
                        f"no parameters of sync job {self.job!r} newer than step {after} "
                        f"within {timeout}s" if after is not None else
                        f"sync job {self.job!r} was not initialized within {timeout}s"
                    )  # fmt: skip
            self._pubsub.get_message(timeout=max(wait, 0.001))

    def _adopt(self, published: _Published) -> tuple[int, dict[str, np.ndarray]]:
        if published.run != self._run or published.specs != self._specs:
            self._open_accumulators(published.specs, published.reduction)
            self._run = published.run
        self._step = published.step
        self._finished = published.done
        return published.step, published.params

    def push(self, step: int, grads: Mapping[str, Any]) -> dict[str, bool]:
        """Apply one gradient per parameter at ``step`` (normally the pulled step); returns
        which were accepted (False: dropped as stale, the chief already took that step).

        Dense gradients are arrays of the parameter's shape; sparse ones ``(indices,
        values)`` or an ``IndexedSlices`` with rows of the parameter.
        """
        if not self._accs:
            raise RuntimeError("pull() first: the worker learns the parameters from the job")
        names = [s.name for s in self._specs]
        if set(grads) != set(names):
            raise ValueError(f"push needs gradients for exactly {sorted(names)}, "
                             f"got {sorted(grads)}")  # fmt: skip
        result: dict[str, bool] = {}
        for spec in self._specs:
            acc, grad = self._accs[spec.name], grads[spec.name]
            if spec.kind == "sparse":
                indices, values = _sparse_parts(grad, spec.name)
                ok = acc.apply_grad(indices, values, local_step=step)  # type: ignore[attr-defined]
            else:
                ok = acc.apply_grad(grad, local_step=step)  # type: ignore[attr-defined]
            result[spec.name] = bool(ok)
        n_ok = sum(result.values())
        self.pushes += 1
        self.accepted += n_ok
        self.dropped += len(result) - n_ok
        self._count(n_ok, len(result))
        return result

    def _count(self, n_ok: int, n: int) -> None:
        prefix = f"w:{self.worker_id}:"
        what = None if n_ok == n else "stale" if n_ok == 0 else "partial"
        pipe = self.redis.pipeline(transaction=False)
        pipe.hincrby(self.keys.stats, "pushes", 1)
        pipe.hincrby(self.keys.stats, prefix + "pushes", 1)
        if what:
            pipe.hincrby(self.keys.stats, what, 1)
            pipe.hincrby(self.keys.stats, prefix + what, 1)
        pipe.execute()

    def close(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except Exception:  # noqa: BLE001 - closing a broken connection is best effort
                logger.debug("closing the pub/sub connection failed", exc_info=True)
            self._pubsub = None
        super().close()
