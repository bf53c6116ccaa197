"""What the chief and the workers of a sync job share: connections, keys, the accumulators of
the parameters, reading the published state, and the job's statistics."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import redis

from .. import _admin, _chunks, _fusion, _retry
from .._codec import wire_dtype
from .._connection import Client, connect, drop_idle, interrupted
from .._dense import ConditionalAccumulator
from .._errors import InvalidArgumentError
from .._keys import Keys, SyncKeys
from .._sparse import SparseConditionalAccumulator
from .._stream import fill, read_views_into
from .._wire import hmget_get_into
from ._published import (
    ParamSpec,
    Published,
    decode_published,
    nbytes_of,
    unit_nbytes,
    unit_params,
)


@dataclass(frozen=True)
class Version:
    """One published version of a job's parameters: (run, step), the specs they have, the
    job's fusion bytes (its layout: one published buffer per unit) and the tenure of the
    chief that published it (its keys carry it)."""

    run: str
    step: int
    specs: tuple[ParamSpec, ...]
    fusion: int = 0
    tenure: str = ""

    @classmethod
    def of(cls, published: Published) -> Version:
        """The version ``published`` names."""
        return cls(published.run, published.step, tuple(published.specs), published.fusion,
                   published.tenure)  # fmt: skip

    @property
    def nbytes(self) -> int:
        """The parameters' bytes in all."""
        return sum(nbytes_of(spec) for spec in self.specs)

    @property
    def units(self) -> tuple[_fusion.Unit, ...]:
        """The layout: what each published buffer ``j`` holds."""
        return _layout(self.specs, self.fusion)


@functools.lru_cache(maxsize=16)
def _layout(specs: tuple[ParamSpec, ...], fusion: int) -> tuple[_fusion.Unit, ...]:
    # (a worker's every pull plans the version it expects next: the same one each time)
    return tuple(_fusion.plan(specs, fusion))


def _params_of(wires: list[tuple[_fusion.Unit, np.ndarray]]) -> dict[str, np.ndarray]:
    """The parameters, read into each unit's wire array: native arrays (views of it where
    the wire's byte order is native; a fused bucket's parameters are views of its array)."""
    params: dict[str, np.ndarray] = {}
    for unit, wire in wires:
        params.update(unit_params(unit, wire))
    return _fusion.in_order([unit for unit, _ in wires], params)


class TrainingFinished(Exception):
    """The job is finished: raised by :meth:`Worker.pull` with ``after=``, by
    :meth:`Worker.push` at or after the final step (nothing applied) and by
    :meth:`ParameterServer.step` on a finished job."""


def accumulator_name(job: str, name: str) -> str:
    """The shared name of the job's accumulator ``name`` (what the CLI shows and watches): a
    parameter's own, ``<job>/<param>``, or a bucket of fused ones, ``<job>/#fused/<i>-<layout>``.
    Which parameter is in which: :attr:`ParameterServer.accumulator_names` (also a worker's)."""
    return f"{job}/{name}"


@dataclass(frozen=True)
class ParamStats:
    """One parameter's accumulator, as its scripts count (every host's activity); the
    parameters fused into one bucket share it (``shared_name`` is the bucket's)."""

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
        """Pushes of this worker whose every tensor was accepted."""
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
    params: dict[str, ParamStats]  # per parameter

    @property
    def accepted(self) -> int:
        """Pushes whose every tensor was accepted."""
        return self.pushes - self.partial - self.stale

    @property
    def stale_tensors(self) -> int:
        """Gradient tensors dropped as stale, summed over the parameters."""
        return sum(p.stale for p in self.params.values())


def _int(value: bytes | None, default: int = 0) -> int:
    return default if value is None else int(value)


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
        client: Client,
        container: str,
        retry_window: float = _retry.RETRY_WINDOW,
    ) -> None:
        if not job:
            raise InvalidArgumentError("a sync job needs a non-empty name")
        window = _retry.checked_window(retry_window)
        self.job = job
        self.container = container or ""
        self.keys = SyncKeys(self.container, job)
        #: Seconds every Redis operation rides through an unreachable server (a restart, a
        #: failover) before raising :class:`~accumulator.UnavailableError`; also given to the
        #: accumulators.
        self.retry_window = window
        self._conns = connect(client, window)  # a share of the pools of this client or URL
        self._redis: redis.Redis = self._conns.commands  # what the accumulators derive from
        self._blocking: redis.Redis = self._conns.blocking  # pub/sub waits only
        self._specs: list[ParamSpec] = []
        #: the job's accumulators (a parameter's own, or a bucket of fused ones), in order
        self._units: list[_fusion.Unit] = []
        #: the job's fusion bytes (its layout), as published
        self._fusion = 0
        #: unit name -> its accumulator
        self._accs: dict[str, ConditionalAccumulator | SparseConditionalAccumulator] = {}

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
        """Parameter name -> shared name of its accumulator (``<job>/<parameter>``, or
        ``<job>/#fused/<i>-<layout>`` for a parameter fused with others: see
        ``fusion_bytes``)."""
        return {m.name: accumulator_name(self.job, u.name)
                for u in self._units for m in u.members}  # fmt: skip

    def _io(self, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` retried through transient Redis faults for :attr:`retry_window` seconds."""
        try:
            return _retry.call(fn, f"sync job {self.job!r}: {what}", window=self.retry_window)
        except BaseException as exc:
            if interrupted(exc):
                drop_idle(self.redis)  # (a reply redis-py may have left unread)
            raise

    def _open_accumulators(self, specs: list[ParamSpec], reduction: str, fusion: int) -> None:
        """Open the job's accumulators: one per unit of the parameters ``specs`` fused with
        ``fusion`` bytes (:func:`accumulator._fusion.plan`)."""
        units = _fusion.plan(specs, fusion)
        self._close_accumulators()
        for unit in units:
            cls = ConditionalAccumulator if unit.kind == "dense" else SparseConditionalAccumulator
            acc = cls(
                unit.dtype, unit.shape, shared_name=accumulator_name(self.job, unit.name),
                name=unit.name, reduction_type=reduction, client=self._redis,
                container=self.container, retry_window=self.retry_window,
            )  # fmt: skip
            self._accs[unit.name] = acc
        self._specs, self._units, self._fusion = list(specs), units, fusion

    def _close_accumulators(self) -> None:
        for acc in self._accs.values():
            acc.close()
        self._accs = {}

    def _read_published(
        self,
        with_params: bool = True,
        *,
        wanted: Callable[[Published], bool] | None = None,
        guess: Version | None = None,
    ) -> Published | None:
        """The published state (one HMGET, a consistent snapshot) and, ``with_params``, the
        parameters of the version it names, read in chunks into fresh arrays; retried
        through Redis faults. A version that expired under the reader (the chief published
        twice meanwhile) is read again, at the newer version.

        ``wanted``: the parameters are read only for a version it accepts (else the state
        comes without them). ``guess``: the version the caller expects next; when its
        parameters are small (one part in all, up to 1 MiB), they are read in the same round
        trip as the hash and kept if the hash names that version (a worker's pull of a small
        model is then one round trip)."""
        fields = ("run", "step", "done", "meta", "ten")
        missing: Version | None = None
        while True:
            early = None
            if guess is not None and guess.nbytes <= _chunks.SOLE_PART_BYTES:
                early = self._param_buffers(guess)
            head, views = ([], []) if early is None else early[:2]

            def look(head: list[str] = head, views: list[memoryview] = views) -> Any:
                """The hash's values, and whether every early part came whole into its
                buffer (received in place where the client allows it, else copied)."""
                if head:
                    got = hmget_get_into(self.redis, self.keys.params, fields, head, views)
                    if got is not None:
                        return got[0], all(got[1])
                pipe = self.redis.pipeline(transaction=False)
                pipe.hmget(self.keys.params, fields)
                for key in head:
                    pipe.get(key)
                replies = pipe.execute()
                return replies[0], all(map(fill, views, replies[1:]))

            values, whole = self._io("reading the published step", look)
            raw = {f.encode(): v for f, v in zip(fields, values, strict=True) if v is not None}
            published = decode_published(self.job, raw)
            if published is None or not with_params or (wanted and not wanted(published)):
                return published
            params = None
            if early is not None and whole and guess == Version.of(published):
                params = _params_of(early[2])
            if params is None:
                params = self._read_params(published)
            if params is not None:
                return dataclasses.replace(published, params=params)
            version = Version.of(published)
            if version == missing:  # still the published version: its parts are gone
                raise RuntimeError(
                    f"sync job {self.job!r}: the parameters published at step "
                    f"{published.step} are missing from Redis (deleted or evicted)"
                )
            missing = version

    def _param_buffers(
        self, version: Version
    ) -> tuple[list[str], list[memoryview], list[tuple[_fusion.Unit, np.ndarray]]]:
        """Every part key of the parameters of ``version``, the buffer each part is read
        into, and the (wire-dtype) array of each unit of the layout those buffers are views
        of (one per parameter, or per fused bucket)."""
        keys: list[str] = []
        views: list[memoryview] = []
        wires = []
        for j, unit in enumerate(version.units):
            nbytes = unit_nbytes(unit)
            wire = np.empty(unit.shape, wire_dtype(unit.dtype))
            flat = wire.reshape(-1).view(np.uint8).data
            keys += self.keys.param_parts(version.run, version.step, j, nbytes, version.tenure)
            views += [flat[a:b] for a, b in _chunks.part_ranges(nbytes)]
            wires.append((unit, wire))
        return keys, views, wires

    def _read_params(self, published: Published) -> dict[str, np.ndarray] | None:
        """Every parameter of the published version, or None when a part of it is gone. The
        parts of all parameters share round trips (a window of bytes each)."""
        keys, views, wires = self._param_buffers(Version.of(published))
        if not read_views_into(self.redis, self._io, keys, views, "reading the parameters"):
            return None
        return _params_of(wires)

    def stats(self) -> SyncStats:
        """Published step, push counters and every accumulator's statistics (one round trip
        after the parameters are known)."""
        units = self._units
        if not units:
            published = self._read_published(with_params=False)
            units = _fusion.plan(published.specs, published.fusion) if published else []
        fields = ["step", "count", "n_applied", "n_stale", "max_stale", "n_taken"]

        def read() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(self.keys.params, ["step", "done"])
            pipe.hgetall(self.keys.stats)
            for unit in units:
                state = Keys(self.container, accumulator_name(self.job, unit.name)).state
                pipe.hmget(state, fields)
            return pipe.execute()

        replies = self._io("reading the statistics", read)
        (step, done), counters = replies[0], replies[1]
        workers = _admin.parse_worker_counters(counters)
        params = {}
        for unit, values in zip(units, replies[2:], strict=True):
            st, count, applied, stale, max_stale, taken = (_int(v) for v in values)
            one = ParamStats(accumulator_name(self.job, unit.name), unit.kind, st, count,
                             applied, stale, max_stale, taken)  # fmt: skip
            for m in unit.members:  # fused parameters: their bucket's (each was in each push)
                params[m.name] = one
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
        self._conns.close()

    def __enter__(self: _J) -> _J:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
