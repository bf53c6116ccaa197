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
    while not ps.finished:  # a finished job stays finished: a re-run chief does nothing
        # plain SGD (or {"w": 0.1, ...}, or fn(params, grads, step)); final: the last update,
        # then workers' pull(after=...) raise TrainingFinished
        ps.step(0.1, timeout=60, final=ps.global_step == 999)
    print(ps.stats())  # pushes accepted / dropped as stale, per worker and per accumulator

Each worker (any number, on any host; only the job name is needed)::

    from accumulator.sync import TrainingFinished, Worker

    worker = Worker("mnist", client=url)
    step, params = worker.pull(timeout=60)  # the current step: late joiners catch up
    while not worker.finished:  # joined a job that is already over: nothing to do
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
  show how many; pushes are counted per job and per worker in Redis (with the time each
  worker was last seen), so every host's count is visible to all (``accumulator job NAME``).
- A push checks every tensor (dtype, shape, sparse indices) before it applies any: a bad one
  raises :class:`~accumulator.InvalidArgumentError` naming the parameter and nothing is
  applied. A push that fails later (Redis unreachable past the retry window, a full round)
  may have applied some tensors; pushing again at the same step applies only the others.
- The parameters travel through Redis: one hash holding the step, a run id, a ``done`` flag,
  msgpack metadata and each parameter's raw little-endian bytes (never pickle). A publish is
  one HSET (atomic: a reader never sees the parameters of one step with another's step
  number) followed by a PUBLISH; waiting workers sleep on that pub/sub channel and re-check
  the hash at least every ``POLL_SLICE`` seconds, so a lost message only costs latency.
- Redis faults are ridden out: every command of the chief and the workers (publish, reads,
  counters, pub/sub waits, and the accumulators' own) is retried for ``retry_window`` seconds
  (30 by default: a restart or failover), and a waiting worker subscribes again after its
  connection dropped; a longer outage raises :class:`~accumulator.UnavailableError`.
- One chief per job: the chief holds a lease (``accsync:{tag}:chief``, ``chief_lease``
  seconds, renewed in the background and at every step). A second chief gets
  :class:`ChiefConflictError` naming the holder; it may take over once the holder's lease
  has run out (a crashed chief), at once if it has the holder's ``chief_id``.
- A finished job stays finished: ``initialize()`` on it loads the final parameters and
  returns (:attr:`ParameterServer.finished` is True; ``resume=False`` starts a new job). A
  push at or after the final step raises :class:`TrainingFinished` and applies nothing.
- A worker that joins late or restarts simply pulls: it gets the current step and
  parameters. A worker that dies mid-push leaves at most a partial gradient (counted).
- A chief that restarts calls :meth:`ParameterServer.initialize` again and resumes the
  published job. If it died during a step (some accumulators one step ahead of the published
  step), the step is completed: rounds it had claimed but not read are handed to the new
  chief's takes (the accumulators' claim hand-over), and for a parameter whose round it had
  already read (those gradients died with it) the step uses a zero gradient (dense) or no
  rows (sparse). If it had read every parameter's round, the step is skipped: the
  parameters are republished unchanged at the next step. Either way the published step and
  the accumulators' steps agree again, and no gradient is applied twice.
- The step counts chief updates, as TF's ``global_step``; a restarted worker that pushes
  again at a step it already pushed at is counted twice (as in TF).

Redis keys (besides each parameter's accumulator, shared name ``<job>/<param>``) are built by
:class:`SyncKeys`, plus the chief lease ``accsync:{tag}:chief`` (:func:`chief_key`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np
import redis
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from . import _admin, _retry, _scripts
from ._codec import (
    as_array,
    check_payload_size,
    format_shape,
    resolve_dtype,
    scalar_int,
    shape_compatible,
    wire_dtype,
    wire_nbytes,
)
from ._connection import connect
from ._core import MAX_PAYLOAD_BYTES, AccumulatorBase
from ._dense import ConditionalAccumulator
from ._errors import AccumulatorError, DeadlineExceededError, InvalidArgumentError, NotFoundError
from ._keys import Keys, SyncKeys
from ._sparse import SparseConditionalAccumulator, SparseGradient

__all__ = [
    "CHIEF_LEASE_SECONDS",
    "ChiefConflictError",
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
    "chief_key",
]

logger = logging.getLogger("accumulator.sync")

#: Longest sleep of a waiting worker between two looks at the published step.
POLL_SLICE = 1.0
#: Default length of the chief lease (renewed every third of it while the chief lives): a
#: crashed chief is taken over by another within this long.
CHIEF_LEASE_SECONDS = 10.0
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
    """The job is finished: raised by :meth:`Worker.pull` with ``after=``, by
    :meth:`Worker.push` at or after the final step (nothing applied) and by
    :meth:`ParameterServer.step` on a finished job."""


class ChiefConflictError(AccumulatorError):
    """Another chief holds the job's lease (one chief per job). ``holder`` is its
    ``chief_id``, ``expires_in`` the seconds its lease has left: a chief that crashed is taken
    over once that has run out."""

    def __init__(
        self, message: str, *, job: str, holder: str = "", expires_in: float | None = None
    ) -> None:
        super().__init__(message)
        self.job = job
        self.holder = holder
        self.expires_in = expires_in


def accumulator_name(job: str, param: str) -> str:
    """The shared name of a parameter's accumulator (what the CLI shows and watches)."""
    return f"{job}/{param}"


def chief_key(keys: SyncKeys) -> str:
    """The key of a job's chief lease (a hash: ``id``, ``host``, ``pid``, ``since_ms``,
    ``renewed_ms``, ``expires_ms``)."""
    return _admin.chief_lease_key(keys)


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
    last_seen_ms: int | None = None  # server time (ms since the epoch) of its last push

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


# -- small Lua scripts of the sync helper's own (its keys are not an accumulator's) ---------------

#: The chief lease. KEYS[1] lease hash. ARGV[1] 'acquire' (also renews) | 'release'
#: ARGV[2] chief id  ARGV[3] lease ms  ARGV[4] host  ARGV[5] pid  ARGV[6] ms the record of an
#: expired lease is kept (for `accumulator job`). acquire: {1, id of an expired holder taken
#: over or ''} or, when another chief's lease runs, {0, id, host, pid, ms left, ms since its
#: last renewal}. release: {1} when the lease was this chief's (deleted), else {0}.
_LEASE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'id', 'expires_ms', 'host', 'pid', 'renewed_ms')
local holder = cur[1]
if ARGV[1] == 'release' then
  if holder == ARGV[2] then
    redis.call('DEL', KEYS[1])
    return {1}
  end
  return {0}
end
local expires = tonumber(cur[2] or '') or 0
if holder and holder ~= ARGV[2] and expires > now then
  local renewed = tonumber(cur[5] or '') or now
  return {0, holder, cur[3] or '', cur[4] or '', string.format('%.0f', expires - now),
          string.format('%.0f', now - renewed)}
end
local previous = ''
if holder ~= ARGV[2] then
  previous = holder or ''
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'id', ARGV[2], 'host', ARGV[4], 'pid', ARGV[5],
             'since_ms', string.format('%.0f', now))
end
redis.call('HSET', KEYS[1], 'renewed_ms', string.format('%.0f', now),
           'expires_ms', string.format('%.0f', now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[6]))
return {1, previous}
"""

#: One push, counted once (a retry after a lost reply is recognised by its push id).
#: KEYS[1] stats hash. ARGV[1] worker id  ARGV[2] push id  ARGV[3] '' | 'stale' | 'partial'
_COUNT_LUA = """
local p = 'w:' .. ARGV[1] .. ':'
if redis.call('HGET', KEYS[1], p .. 'push') == ARGV[2] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], p .. 'push', ARGV[2], p .. 'seen_ms', string.format('%.0f', now))
redis.call('HINCRBY', KEYS[1], 'pushes', 1)
redis.call('HINCRBY', KEYS[1], p .. 'pushes', 1)
if ARGV[3] ~= '' then
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[1], p .. ARGV[3], 1)
end
return 1
"""

#: How long the record of a lease that ran out stays (``accumulator job`` shows the dead chief).
_LEASE_RECORD_MS = 3600 * 1000


class _Lua:
    """A script sent by EVALSHA (loaded on NOSCRIPT; EVAL where SCRIPT LOAD is not allowed)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            try:
                return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            except NoScriptError:
                try:
                    client.script_load(self.source)
                except NoPermissionError:
                    return client.execute_command("EVAL", self.source, len(keys), *keys, *args)
                return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            raise _scripts.translate(exc) from None


_LEASE = _Lua(_LEASE_LUA)
_COUNT = _Lua(_COUNT_LUA)


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _ChiefLease:
    """A chief's hold on its job: acquired by ``initialize()``, renewed by a daemon thread
    every third of its length and before every publish, released by ``close()``.

    Holds no reference to the :class:`ParameterServer` (a garbage-collected chief releases
    its lease through a finalizer)."""

    def __init__(
        self, client: redis.Redis, key: str, job: str, chief_id: str, seconds: float,
        window: float,
    ) -> None:  # fmt: skip
        self._client = client
        self.key = key
        self.job = job
        self.chief_id = chief_id
        self.seconds = seconds
        self.window = window
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False
        #: Set (to the reason) when another chief took the lease over: this chief must stop.
        self.lost: str | None = None

    def _call(self, mode: str) -> list[Any]:
        args = [mode, self.chief_id, max(1, int(self.seconds * 1000)), self._host, self._pid,
                _LEASE_RECORD_MS]  # fmt: skip
        return list(_LEASE(self._client, [self.key], args))

    def _conflict(self, reply: list[Any]) -> ChiefConflictError:
        holder, host, pid = _text(reply[1]), _text(reply[2]), _text(reply[3])
        left, age = int(reply[4]) / 1000, int(reply[5]) / 1000
        return ChiefConflictError(
            f"sync job {self.job!r} already has a chief: {holder!r} (host {host!r}, pid "
            f"{pid or '?'}), lease renewed {age:.1f}s ago, expires in {left:.1f}s. One chief "
            "per job: stop the other chief; if it crashed, this one may take over once its "
            "lease has run out (initialize(wait_for_chief=SECONDS) waits for that)",
            job=self.job, holder=holder, expires_in=left,
        )  # fmt: skip

    def acquire(self, wait: float = 0.0) -> None:
        """Take (or renew) the lease; waits up to ``wait`` seconds for another chief's to run
        out, then raises :class:`ChiefConflictError`."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            reply = _retry.call(
                lambda: self._call("acquire"), f"sync job {self.job!r}: chief lease",
                window=self.window,
            )  # fmt: skip
            if int(reply[0]) == 1:
                break
            conflict = self._conflict(reply)
            left = deadline - time.monotonic()
            if left <= 0:
                raise conflict
            time.sleep(min(left, 1.0, max(0.05, conflict.expires_in or 0.0)))
        previous = _text(reply[1])
        if previous:
            logger.warning(
                "sync job %r: chief %r takes over from chief %r, whose lease ran out (gone?)",
                self.job, self.chief_id, previous,
            )  # fmt: skip
        self.held, self.lost = True, None
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._beat, name=f"accumulator-chief-lease-{self.job}", daemon=True
            )
            self._thread.start()

    def check(self, *, renew: bool) -> None:
        """Raise :class:`ChiefConflictError` if another chief took the lease over; with
        ``renew``, renew it now (one round trip)."""
        if self.lost is not None:
            raise ChiefConflictError(self.lost, job=self.job)
        if not renew:
            return
        reply = _retry.call(
            lambda: self._call("acquire"), f"sync job {self.job!r}: chief lease",
            window=self.window,
        )  # fmt: skip
        if int(reply[0]) != 1:
            conflict = self._conflict(reply)
            self.lost = f"this chief lost its lease: {conflict}"
            self._stop.set()
            raise ChiefConflictError(self.lost, job=self.job, holder=conflict.holder,
                                     expires_in=conflict.expires_in)  # fmt: skip

    def _beat(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                reply = self._call("acquire")
            except Exception as exc:  # noqa: BLE001 - Redis away: the next beat tries again
                logger.debug("sync job %r: renewing the chief lease failed: %s", self.job, exc)
                continue
            if int(reply[0]) != 1:
                conflict = self._conflict(reply)
                self.lost = f"this chief lost its lease: {conflict}"
                logger.error("sync job %r: %s", self.job, self.lost)
                return

    def release(self) -> None:
        """Stop renewing and give the lease up (best effort: it runs out by itself)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        if not self.held:
            return
        self.held = False
        try:
            self._call("release")
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            logger.debug("sync job %r: releasing the chief lease failed: %s", self.job, exc)


_J = TypeVar("_J", bound="_Job")
_T = TypeVar("_T")


class _Job:
    """What the chief and the workers share: connections, keys, reading state and stats.

    A URL given as ``client`` is read once, here, into clients: no attribute keeps it (nor
    the password in it); the accumulators are opened on the commands client.
    """

    def __init__(
        self,
        job: str,
        *,
        client: redis.Redis | str | None,
        container: str,
        retry_window: float = _retry.RETRY_WINDOW,
    ) -> None:
        if not job:
            raise ValueError("a sync job needs a non-empty name")
        if not retry_window > 0:
            raise ValueError(f"retry_window must be > 0 seconds, got {retry_window!r}")
        self.job = job
        self.container = container or ""
        self.keys = SyncKeys(self.container, job)
        #: Seconds every Redis operation rides through an unreachable server (a restart, a
        #: failover) before raising :class:`~accumulator.UnavailableError`; also given to the
        #: accumulators.
        self.retry_window = float(retry_window)
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

    def _io(self, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` retried through transient Redis faults for :attr:`retry_window` seconds."""
        return _retry.call(fn, f"sync job {self.job!r}: {what}", window=self.retry_window)

    def _open_accumulators(self, specs: list[ParamSpec], reduction: str) -> None:
        self._close_accumulators()
        for spec in specs:
            cls = ConditionalAccumulator if spec.kind == "dense" else SparseConditionalAccumulator
            acc = cls(
                spec.dtype, spec.shape, shared_name=accumulator_name(self.job, spec.name),
                name=spec.name, reduction_type=reduction, client=self._redis,
                container=self.container,
            )  # fmt: skip
            acc.retry_window = self.retry_window
            self._accs[spec.name] = acc
        self._specs = list(specs)

    def _close_accumulators(self) -> None:
        for acc in self._accs.values():
            acc.close()
        self._accs = {}

    def _read_published(self, with_params: bool = True) -> _Published | None:
        """The published state, read in one HGETALL (a consistent snapshot); retried through
        Redis faults."""
        fields = ("run", "step", "done", "meta")
        raw: dict[Any, Any]
        if with_params:
            raw = self._io("reading the parameters", lambda: self.redis.hgetall(self.keys.params))
        else:
            values: list[Any] = self._io(
                "reading the published step", lambda: self.redis.hmget(self.keys.params, fields)
            )
            raw = {f.encode(): v for f, v in zip(fields, values, strict=True) if v is not None}
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
        fields = ["step", "count", "n_applied", "n_stale", "max_stale", "n_taken"]

        def read() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(self.keys.params, ["step", "done"])
            pipe.hgetall(self.keys.stats)
            for spec in specs:
                state = Keys(self.container, accumulator_name(self.job, spec.name)).state
                pipe.hmget(state, fields)
            return pipe.execute()

        replies = self._io("reading the statistics", read)
        (step, done), counters = replies[0], replies[1]
        workers = _admin.parse_worker_counters(counters)
        params = {}
        for spec, values in zip(specs, replies[2:], strict=True):
            st, count, applied, stale, max_stale, taken = (_int(v) for v in values)
            params[spec.name] = ParamStats(accumulator_name(self.job, spec.name), spec.kind, st,
                                           count, applied, stale, max_stale, taken)  # fmt: skip
        return SyncStats(
            step=None if step is None else int(step), done=done == b"1",
            pushes=_int(counters.get(b"pushes")), partial=_int(counters.get(b"partial")),
            stale=_int(counters.get(b"stale")),
            workers={w.worker_id: WorkerStats(w.pushes, w.partial, w.stale, w.last_seen_ms)
                     for w in workers},
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

    One chief per job: :meth:`initialize` takes the job's chief lease (``chief_lease``
    seconds, renewed in the background while this object lives, released by :meth:`close`);
    while another chief holds it, :class:`ChiefConflictError`. ``chief_id`` names this chief
    in the lease (default ``<hostname>-<pid>-<random>``): a restarted chief given the same
    id as the one that crashed takes over at once instead of waiting for its lease to run
    out (never give two live chiefs one id). ``retry_window``: seconds of Redis outage every
    operation rides through.
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
        chief_id: str | None = None,
        chief_lease: float = CHIEF_LEASE_SECONDS,
        retry_window: float = _retry.RETRY_WINDOW,
    ) -> None:
        if int(replicas_to_aggregate) < 1:
            raise ValueError(f"replicas_to_aggregate must be >= 1, got {replicas_to_aggregate}")
        if reduction_type not in ("MEAN", "SUM"):
            raise ValueError(f"reduction_type must be 'MEAN' or 'SUM', got {reduction_type!r}")
        if not chief_lease > 0:
            raise ValueError(f"chief_lease must be > 0 seconds, got {chief_lease!r}")
        if chief_id is not None and (not isinstance(chief_id, str) or not chief_id):
            raise ValueError(f"chief_id must be a non-empty string, got {chief_id!r}")
        super().__init__(job, client=client, container=container, retry_window=retry_window)
        self.replicas_to_aggregate = int(replicas_to_aggregate)
        self.sparse = frozenset(sparse)
        self.reduction_type = reduction_type
        #: This chief's name in the job's chief lease.
        self.chief_id = chief_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lease = _ChiefLease(self._redis, chief_key(self.keys), job, self.chief_id,
                                  float(chief_lease), self.retry_window)  # fmt: skip
        self._lease_finalizer = weakref.finalize(self, self._lease.release)
        self._params: dict[str, np.ndarray] = {}
        self._step: int | None = None
        self._run = ""
        self._done = False
        # Gradients already taken for the current step when a step() timed out part-way:
        # the next step() continues from there instead of taking those parameters twice.
        # After a restart it also holds the zero gradients of parameters whose round the
        # previous chief had read before it died.
        self._taken: dict[str, Any] = {}

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

    def _check_resumable(self, published: _Published, specs: list[ParamSpec]) -> None:
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
        restarted: its final parameters and step are loaded, nothing is written, and
        :attr:`finished` is True (``step()`` then raises :class:`TrainingFinished`). With
        ``resume=False`` everything of an earlier job of this name is deleted first, finished
        or not: its parameters, counters, and its accumulators with their pending gradients
        and stats; a new job starts.

        Takes the job's chief lease first (not for a finished job, which is only read):
        :class:`ChiefConflictError` while another chief holds it, after waiting up to
        ``wait_for_chief`` seconds for it to run out.
        """
        specs, arrays = self._specs_for(params)
        if resume:
            published = self._read_published()
            if published is not None:
                self._check_resumable(published, specs)
                if published.done:
                    return self._load_finished(published)
        held = self._lease.held
        self._lease.acquire(wait_for_chief)
        try:
            # read again under the lease: another chief may have moved on meanwhile
            published = self._read_published() if resume else None
            if published is not None:
                self._check_resumable(published, specs)
                if published.done:
                    return self._load_finished(published)
                return self._resume(published)
            self._wipe(specs)
            self._open_accumulators(specs, self.reduction_type)
            if step:
                for acc in self._accs.values():
                    acc.set_global_step(step)
            self._params, self._step, self._run = arrays, int(step), uuid.uuid4().hex
            self._taken, self._done = {}, False
            self._publish(meta=True)
        except BaseException:
            if not held:
                self._lease.release()
            raise
        logger.info("sync job %r initialized at step %d: %s", self.job, self._step,
                    ", ".join(s.describe() for s in specs))  # fmt: skip
        return self._step

    def _load_finished(self, published: _Published) -> int:
        """A finished job stays finished: load its final state, write nothing."""
        self._close_accumulators()
        self._specs = list(published.specs)
        self._params, self._run, self._step = published.params, published.run, published.step
        self._taken, self._done = {}, True
        logger.info(
            "sync job %r is finished (at step %d): not restarted; its final parameters are "
            "loaded (initialize(resume=False) starts the job anew)", self.job, published.step,
        )  # fmt: skip
        return published.step

    def _resume(self, published: _Published) -> int:
        self._open_accumulators(published.specs, published.reduction)
        self._params, self._run = published.params, published.run
        self._taken, self._done = {}, False
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
                self._accs[name].set_global_step(at)
                self._reset(name)
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

    def _skip_to(self, published: _Published, steps: dict[str, int]) -> int:
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
            takers = [t for t, v in registry.items() if v != b"done"]
            if not takers:
                return 0
            pipe = self.redis.pipeline(transaction=False)
            for taker in takers:
                pipe.exists(keys.claim(_text(taker)))
            return sum(int(x) for x in pipe.execute())

        return self._io("reading claimed rounds", read)

    def _zero_grad(self, name: str) -> Any:
        spec = next(s for s in self._specs if s.name == name)
        if spec.kind == "sparse":
            return SparseGradient(
                np.empty(0, np.int64), np.zeros((0, *spec.shape[1:]), spec.dtype),
                np.array(spec.shape, np.int64),
            )  # fmt: skip
        return np.zeros(spec.shape, spec.dtype)

    def _wipe(self, specs: list[ParamSpec]) -> None:
        old = self._read_published(with_params=False)
        names = {s.name for s in specs} | {s.name for s in (old.specs if old else [])}
        for name in sorted(names):
            shared = accumulator_name(self.job, name)
            with contextlib.suppress(NotFoundError):
                self._io("deleting an accumulator",
                         lambda: _admin.delete(self.redis, shared, self.container))  # fmt: skip  # noqa: B023
        self._io("deleting the job", lambda: self.redis.delete(self.keys.params, self.keys.stats))

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

        def publish() -> None:
            # One HSET: readers (HGETALL) see either the old step and parameters or the new
            # ones. Sent again after a fault, it writes the same values.
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self.keys.params, mapping=mapping)
            pipe.publish(self.keys.channel, str(self._step))
            pipe.execute()

        self._io("publishing", publish)

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
        deadline = None if timeout is None else time.monotonic() + timeout
        for spec in self._specs:
            if spec.name in self._taken:
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            acc = self._accs[spec.name]
            try:
                self._taken[spec.name] = acc.take_grad(  # type: ignore[attr-defined]
                    self.replicas_to_aggregate, timeout=remaining
                )
            except DeadlineExceededError as exc:
                kept = sorted(self._taken)
                raise DeadlineExceededError(
                    f"sync job {self.job!r}, step {self._step}: parameter {spec.name!r} "
                    f"({spec.kind}) did not get {self.replicas_to_aggregate} gradients within "
                    f"{timeout:g}s; taken and kept for the next step(): "
                    f"{', '.join(repr(n) for n in kept) or 'none'} ({exc})"
                ) from exc
        self._lease.check(renew=True)  # never publish over another chief
        grads, self._taken = self._taken, {}
        self._apply_update(update, grads, self._step)
        self._step += 1
        self._publish(done=final)
        self._done = bool(final)
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
        :class:`TrainingFinished` once they have seen the last step. No-op on a finished
        job."""
        if self._step is None:
            raise RuntimeError("call initialize() first")
        if self._done:
            return
        self._lease.check(renew=True)
        self._publish(done=True)
        self._done = True

    def delete(self) -> None:
        """Remove every key of this job: parameters, counters, the chief lease and the
        accumulators. Takes the chief lease first (:class:`ChiefConflictError` while another
        chief runs the job)."""
        self._lease.acquire()
        self._close_accumulators()
        self._wipe(self._specs)
        self._lease.release()
        self._specs, self._params, self._step, self._done = [], {}, None, False

    def close(self) -> None:
        """Release the chief lease (another chief may start at once), the accumulators and
        the connections."""
        self._lease_finalizer()
        super().close()


class Worker(_Job):
    """A replica: pulls the published parameters, pushes gradients at their step.

    ``worker_id`` labels this worker's push counters (default ``<hostname>-<pid>``); a worker
    that restarts under the same id keeps adding to the same counters. ``retry_window``:
    seconds of Redis outage every operation rides through (a waiting ``pull`` subscribes
    again after its connection dropped).
    """

    def __init__(
        self,
        job: str,
        *,
        client: redis.Redis | str | None = None,
        container: str = "",
        worker_id: str | None = None,
        retry_window: float = _retry.RETRY_WINDOW,
    ) -> None:
        super().__init__(job, client=client, container=container, retry_window=retry_window)
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._pubsub: Any = None
        self._run: str | None = None
        self._step: int | None = None
        self._finished = False
        # (step, {param: accepted}) of a push that failed part-way: pushing again at that
        # step applies only the other tensors.
        self._partial: tuple[int, dict[str, bool]] | None = None
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

    def _subscribe(self) -> None:
        def subscribe() -> Any:
            pubsub = self._blocking.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.keys.channel)
            except BaseException:
                with contextlib.suppress(Exception):
                    pubsub.close()
                raise
            return pubsub

        self._pubsub = self._io("subscribing", subscribe)

    def _drop_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
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
        re-initialized job); :class:`TrainingFinished` once the job is finished.
        ``timeout`` (seconds) raises :class:`~accumulator.DeadlineExceededError`. Redis
        faults are ridden out for :attr:`retry_window` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._pubsub is None:
                # Subscribe before the look: a publish after that look is then never missed.
                self._subscribe()
            run, step, done = self._io(
                "reading the published step",
                lambda: self.redis.hmget(self.keys.params, ["run", "step", "done"]),
            )
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
            try:
                self._pubsub.get_message(timeout=max(wait, 0.001))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                # Redis restarting, or the connection killed: subscribe again (retried for
                # the retry window) and look again; a publish meanwhile is then seen.
                logger.info("sync job %r: pub/sub connection lost (%s); subscribing again",
                            self.job, exc)  # fmt: skip
                self._drop_pubsub()
                time.sleep(0.05)

    def _adopt(self, published: _Published) -> tuple[int, dict[str, np.ndarray]]:
        if published.run != self._run or published.specs != self._specs:
            self._open_accumulators(published.specs, published.reduction)
            self._run = published.run
            self._partial = None
        self._step = published.step
        self._finished = published.done
        return published.step, published.params

    def _validated(self, grads: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
        """Every tensor checked as its accumulator's ``apply_grad`` will (dtype castable,
        shape, sparse indices and values, size), before any is applied: name -> the
        arguments of its apply. Raises :class:`~accumulator.InvalidArgumentError` naming the
        parameter."""
        out: dict[str, tuple[Any, ...]] = {}
        for spec in self._specs:
            grad = grads[spec.name]
            try:
                if spec.kind == "sparse":
                    indices, values = _sparse_parts(grad, spec.name)
                    acc = self._accs[spec.name]
                    # the sparse accumulator's own checks (TF's 1-5 and the declared dims)
                    _, vals = acc._validate(indices, values, None)  # type: ignore[attr-defined]
                    first = acc._first_error(vals)  # type: ignore[attr-defined]
                    if first:
                        raise InvalidArgumentError(first)
                    check_payload_size(np.size(indices) * 8 + wire_nbytes(vals, spec.dtype),
                                       MAX_PAYLOAD_BYTES)  # fmt: skip
                    out[spec.name] = (indices, values)
                else:
                    arr = as_array(grad, spec.dtype)
                    if not shape_compatible(spec.shape, arr.shape):
                        raise InvalidArgumentError(
                            f"Shape mismatch: expected {format_shape(spec.shape)}, "
                            f"got {format_shape(arr.shape)}"
                        )
                    check_payload_size(wire_nbytes(arr, spec.dtype), MAX_PAYLOAD_BYTES)
                    out[spec.name] = (grad,)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    f"push to sync job {self.job!r}: the gradient of {spec.name!r} "
                    f"({spec.kind} {spec.dtype.name} {format_shape(spec.shape)}) is invalid, "
                    f"nothing was applied: {exc}"
                ) from exc
        return out

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
            raise ValueError(f"push needs gradients for exactly {sorted(names)}, "
                             f"got {sorted(grads)}")  # fmt: skip
        step = scalar_int(step, "step")
        _, published, done = self._io(
            "reading the published step",
            lambda: self.redis.hmget(self.keys.params, ["run", "step", "done"]),
        )
        if done == b"1" and published is not None and step >= int(published):
            raise TrainingFinished(
                f"sync job {self.job!r} finished at step {int(published)}: a push at step "
                f"{step} would never be taken; nothing was applied"
            )
        prepared = self._validated(grads)
        result: dict[str, bool] = {}
        if self._partial is not None and self._partial[0] == step and self._partial[1]:
            result = dict(self._partial[1])
            logger.info(
                "sync job %r: this push at step %d completes one that failed part-way (%s "
                "already applied)", self.job, step, ", ".join(sorted(result)),
            )  # fmt: skip
        for spec in self._specs:
            if spec.name in result:
                continue
            acc = self._accs[spec.name]
            try:
                ok = acc.apply_grad(*prepared[spec.name], local_step=step)  # type: ignore[attr-defined]
            except BaseException:
                self._partial = (step, dict(result))
                if result:
                    logger.error(
                        "sync job %r: push at step %d failed after applying %s; pushing again "
                        "at step %d applies only the others", self.job, step,
                        ", ".join(sorted(result)), step,
                    )  # fmt: skip
                raise
            result[spec.name] = bool(ok)
        self._partial = None
        result = {name: result[name] for name in names}
        n_ok = sum(result.values())
        self.pushes += 1
        self.accepted += n_ok
        self.dropped += len(result) - n_ok
        self._count(n_ok, len(result))
        return result

    def _count(self, n_ok: int, n: int) -> None:
        what = "" if n_ok == n else "stale" if n_ok == 0 else "partial"
        push_id = uuid.uuid4().hex[:16]  # a retried count is recognised and counted once
        args = [self.worker_id, push_id, what]
        self._io("counting the push", lambda: _COUNT(self.redis, [self.keys.stats], args))

    def close(self) -> None:
        self._drop_pubsub()
        super().close()
