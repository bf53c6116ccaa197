"""Inspecting and deleting sync jobs (:mod:`accumulator.sync`) for ``accumulator job NAME``:
the published step, the chief lease, each worker's push counters and each parameter's
accumulator, with warnings where they disagree. Also the key of the chief lease
(:func:`chief_lease_key`) and the parsing of the workers' counters, which the sync helper
uses itself."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple, cast

import msgpack
import redis

from . import _fusion, _scripts
from ._admin_info import _int, _server_ms, live_takers, queue_time
from ._admin_ops import delete_many
from ._codec import reply_text, resolve_dtype
from ._errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from ._keys import (
    DEFAULT_PREFIX,
    SYNC_PREFIX,
    Keys,
    SyncKeys,
    is_done_mark,
    parse_state_key,
    state_pattern,
)

logger = logging.getLogger("accumulator")


def chief_lease_key(keys: SyncKeys) -> str:
    """The key of a sync job's chief lease: ``accsync:{tag}:chief`` (a hash: ``id``,
    ``host``, ``pid``, ``since_ms``, ``renewed_ms``, ``expires_ms``)."""
    return keys.base + ":chief"


@dataclass(frozen=True)
class JobWorker:
    """One worker's push counters in a sync job (as ``Worker.push`` counts them)."""

    worker_id: str
    pushes: int
    partial: int  # some tensors accepted, some dropped as stale
    stale: int  # every tensor dropped as stale
    last_seen_ms: int | None  # server time of its last push (None: counted by an old version)

    @property
    def accepted(self) -> int:
        return self.pushes - self.partial - self.stale


def parse_worker_counters(counters: Mapping[bytes, bytes]) -> list[JobWorker]:
    """The per-worker entries (``w:<id>:pushes|partial|stale|seen_ms``) of a sync job's stats
    hash, sorted by worker id."""
    workers: dict[str, dict[str, int]] = {}
    for key, value in counters.items():
        parts = reply_text(key).split(":")
        if parts[0] != "w" or len(parts) < 3:
            continue
        what = parts[-1]
        if what not in ("pushes", "partial", "stale", "seen_ms"):
            continue  # e.g. "push": the id of its last push (retry dedup)
        number = _int(value, None)
        if number is not None:
            workers.setdefault(":".join(parts[1:-1]), {})[what] = number
    return [
        JobWorker(wid, c.get("pushes", 0), c.get("partial", 0), c.get("stale", 0),
                  c.get("seen_ms"))  # fmt: skip
        for wid, c in sorted(workers.items())
    ]


@dataclass(frozen=True)
class ChiefLease:
    """The chief lease of a sync job (times in ms, server clock)."""

    chief_id: str
    #: the token of the chief's acquire (a restarted chief with the same id has a new one);
    #: '' from a chief of an older version
    tenure: str
    host: str
    pid: int | None
    since_ms: int | None
    renewed_ms: int | None
    expires_ms: int | None
    remaining_ms: int | None  # negative: ran out (the chief is gone); None: no server time

    @property
    def live(self) -> bool:
        return self.remaining_ms is not None and self.remaining_ms > 0


@dataclass(frozen=True)
class JobParam:
    """One parameter of a sync job and its accumulator."""

    name: str
    shared_name: str
    kind: str
    dtype: str
    shape: tuple[int, ...] | None
    step: int | None  # the accumulator's global step; None: the accumulator is missing
    pending: int  # gradients in its pending round
    takers_waiting: int
    claimed: int  # rounds claimed by a take and not read yet (a dead taker's: handed over)


@dataclass(frozen=True)
class JobInfo:
    """A snapshot of a sync job: what ``accumulator job NAME`` shows."""

    container: str
    job: str
    published: bool  # the chief published parameters (False: counters only)
    run: str | None
    step: int | None  # the published step
    done: bool
    replicas: int | None
    reduction: str | None
    pushes: int
    partial: int
    stale: int
    workers: tuple[JobWorker, ...]
    params: tuple[JobParam, ...]
    chief: ChiefLease | None
    now_ms: int | None
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    meta_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = asdict(self)
        out["workers"] = [{**asdict(w), "accepted": w.accepted} for w in self.workers]
        out["params"] = [{**asdict(p), "shape": None if p.shape is None else list(p.shape)}
                         for p in self.params]  # fmt: skip
        if self.chief is not None:
            out["chief"] = {**asdict(self.chief), "live": self.chief.live}
        out["warnings"], out["notes"] = list(self.warnings), list(self.notes)
        return out


class _Spec(NamedTuple):
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...] | None


def _job_specs(meta: bytes | None) -> tuple[list[_Spec], int | None, str | None, str | None,
                                            dict[str, str]]:  # fmt: skip
    """(params, replicas, reduction, error, parameter name -> the name of its accumulator in
    the job: its own, or its fused bucket's) from the msgpack metadata a chief publishes;
    tolerant of what it cannot read."""
    if meta is None:
        return [], None, None, None, {}
    try:
        raw = msgpack.unpackb(meta, raw=False)
        specs = []
        for name, kind, dtype, shape in raw["params"]:
            dims = None if shape is None else tuple(int(d) for d in shape)
            specs.append(_Spec(str(name), str(kind), str(dtype), dims))
        units = {s.name: s.name for s in specs}
        fusion = _int(raw.get("fusion"), 0) or 0
        if fusion:
            typed = [SimpleNamespace(**{**s._asdict(), "dtype": resolve_dtype(s.dtype)})
                     for s in specs]  # fmt: skip
            units = {m: u.name for m, u in _fusion.unit_of(_fusion.plan(typed, fusion)).items()}
        return specs, _int(raw.get("replicas"), None), str(raw.get("reduction")), None, units
    except Exception as exc:  # noqa: BLE001 - show what can be shown, keep the reason
        return [], None, None, f"unreadable job metadata: {exc}", {}


def _chief(raw: Mapping[bytes, bytes], now: int | None) -> ChiefLease | None:
    if not raw or raw.get(b"id") is None:
        return None
    expires = _int(raw.get(b"expires_ms"), None)
    return ChiefLease(
        chief_id=reply_text(raw.get(b"id")), tenure=reply_text(raw.get(b"tenure")),
        host=reply_text(raw.get(b"host")),
        pid=_int(raw.get(b"pid"), None), since_ms=_int(raw.get(b"since_ms"), None),
        renewed_ms=_int(raw.get(b"renewed_ms"), None), expires_ms=expires,
        remaining_ms=None if now is None or expires is None else expires - now,
    )  # fmt: skip


def describe_job(
    r: redis.Redis,
    job: str,
    container: str = "",
    *,
    prefix: str = DEFAULT_PREFIX,
    sync_prefix: str = SYNC_PREFIX,
) -> JobInfo:
    """Everything about one sync job (``accumulator.sync``): the published step and done
    flag, the chief lease, each worker's counters and each parameter's accumulator, plus
    warnings when they disagree. Two pipelined round trips; raises :class:`NotFoundError`
    when the job has no keys."""
    keys = SyncKeys(container, job, sync_prefix)
    pipe = r.pipeline(transaction=False)
    clock = queue_time(r, pipe)
    pipe.hmget(keys.params, ["run", "step", "done", "meta"])
    pipe.hgetall(keys.stats)
    pipe.hgetall(chief_lease_key(keys))
    now_reply, (run, step, done, meta), counters, lease = clock(pipe.execute())
    if run is None and step is None and not counters and not lease:
        where = f" in container {container!r}" if container else ""
        raise NotFoundError(f"no sync job named {job!r}{where}")
    now = _server_ms(now_reply)
    specs, replicas, reduction, meta_error, unit_of = _job_specs(meta)
    accs = list(dict.fromkeys(unit_of[s.name] for s in specs))  # each accumulator once
    pipe = r.pipeline(transaction=False)
    for name in accs:
        acc = Keys(container, f"{job}/{name}", prefix)
        pipe.hmget(acc.state, ["schema", "step", "count"])
        pipe.zrange(acc.takers, 0, -1)
        pipe.hgetall(acc.taker_info)
        pipe.hgetall(acc.claims)
    replies = pipe.execute() if specs else []
    params = []
    at = {name: i for i, name in enumerate(accs)}
    for name, kind, dtype, shape in specs:
        i = at[unit_of[name]]
        (schema, acc_step, count), queued, leases, registry = replies[4 * i : 4 * i + 4]
        waiting = live_takers(queued, leases, now)
        claimed = sum(1 for v in registry.values() if not is_done_mark(v))
        params.append(JobParam(
            name=name, shared_name=f"{job}/{unit_of[name]}", kind=kind, dtype=dtype, shape=shape,
            step=None if schema is None else _int(acc_step) or 0, pending=_int(count) or 0,
            takers_waiting=int(waiting or 0), claimed=claimed,
        ))  # fmt: skip
    chief = _chief(lease, now)
    published = _int(step, None)
    info = JobInfo(
        container=container, job=job, published=meta is not None, run=reply_text(run) or None,
        step=published, done=done == b"1", replicas=replicas, reduction=reduction,
        pushes=_int(counters.get(b"pushes")) or 0, partial=_int(counters.get(b"partial")) or 0,
        stale=_int(counters.get(b"stale")) or 0,
        workers=tuple(parse_worker_counters(counters)), params=tuple(params), chief=chief,
        now_ms=now, meta_error=meta_error,
    )  # fmt: skip
    warnings, notes = _job_findings(info)
    return JobInfo(**{**info.__dict__, "warnings": tuple(warnings), "notes": tuple(notes)})


def _job_findings(info: JobInfo) -> tuple[list[str], list[str]]:
    """Where the published step and the accumulators disagree, and what that means."""
    warnings: list[str] = []
    notes: list[str] = []
    live = info.chief is not None and info.chief.live
    if info.meta_error:
        warnings.append(info.meta_error)
    if not info.published:
        notes.append("no parameters published (counters only: a job deleted or not initialized)")
    seen: set[str] = set()
    for p in info.params:
        if p.shared_name in seen:  # (parameters fused into one accumulator: said once)
            continue
        seen.add(p.shared_name)
        what = f"accumulator {p.shared_name!r}"
        if p.step is None:
            warnings.append(f"{what} is missing (deleted, or lost by a server restart without "
                            "persistence)")  # fmt: skip
            continue
        if info.step is None:
            continue
        handed = (f"; {p.claimed} claimed round(s) not read yet: the next take gets them"
                  if p.claimed else "")  # fmt: skip
        if p.step > info.step:
            if live and p.step == info.step + 1 and not info.done:
                notes.append(f"{what} at step {p.step}, published step {info.step}: the chief "
                             f"is in the middle of a step{handed}")  # fmt: skip
            else:
                warnings.append(
                    f"{what} at step {p.step}, ahead of the published step {info.step}: a chief "
                    f"crashed between its take and its publish{handed}; a restarted chief "
                    "(initialize()) completes the step"
                )
        elif p.step < info.step:
            warnings.append(
                f"{what} at step {p.step}, behind the published step {info.step}: every push "
                "is accepted for an old round (set by hand? lost by a restart?); a restarted "
                "chief realigns it"
            )
        if info.done and p.pending:
            notes.append(f"{what}: {p.pending} gradient(s) pending in a finished job")
    if info.published and not info.done:
        if info.chief is None:
            notes.append("no chief lease: no chief is running (or one of an older version)")
        elif not live:
            warnings.append(f"the chief {info.chief.chief_id!r} stopped renewing its lease "
                            "(crashed?); a new chief may take over")  # fmt: skip
    return warnings, notes


def delete_job(
    r: redis.Redis,
    job: str,
    container: str = "",
    *,
    force: bool = False,
    prefix: str = DEFAULT_PREFIX,
    sync_prefix: str = SYNC_PREFIX,
) -> int:
    """Delete every key of a sync job: its parameters, counters, chief lease and the
    accumulators of its parameters. Refuses (:class:`InvalidArgumentError`) a job that is
    not finished unless ``force``. Returns the number of keys deleted; raises
    :class:`NotFoundError` when there was none.

    Unless a chief still holds it (a finished job's, or ``force``), the delete holds the job's
    chief lease while it runs (under an id of its own): a chief that starts meanwhile gets
    ``ChiefConflictError`` instead of a new run being deleted under it (the check that the
    job is finished is made while the lease is held)."""
    keys = SyncKeys(container, job, sync_prefix)
    lease = _AdminLease(r, chief_lease_key(keys))
    holder = lease.acquire()
    try:
        step, done, meta = cast("list[Any]", r.hmget(keys.params, ["step", "done", "meta"]))
        if not force and step is not None and done != b"1":
            chief = f"; its chief {holder} is live" if holder is not None else ""
            raise InvalidArgumentError(
                f"sync job {job!r} is not finished (published step {_int(step)}{chief}); pass "
                "force to delete it anyway"
            )
        specs, *_, unit_of = _job_specs(meta)
        named = [Keys(container, f"{job}/{name}", prefix)
                 for name in dict.fromkeys(unit_of[s.name] for s in specs)]  # fmt: skip
        # (a model of many accumulators takes a while: the lease is renewed as it goes)
        removed = sum(delete_many(r, named, within=Keys(container, f"{job}/", prefix),
                                  progress=lease.renew))  # fmt: skip
        # the versions before the record naming them: cut short, the job is still found
        removed += delete_param_versions(r, keys)
        removed += int(r.unlink(keys.params, keys.stats))
    finally:
        lease.release()
    # the record of a lease of the job's (the live one, forced; or one that ran out)
    removed += int(r.unlink(chief_lease_key(keys))) if holder is not None else lease.previous
    if removed == 0:
        where = f" in container {container!r}" if container else ""
        raise NotFoundError(f"no sync job named {job!r}{where}")
    return removed


class _AdminLease:
    """The job's chief lease held by a delete (``lua/sync_lease.lua`` with an id of its own):
    a chief cannot start while it is held. ``previous``: 1 when a record of an expired lease
    was there (it counts as a key of the job deleted)."""

    SECONDS = 60.0

    def __init__(self, r: redis.Redis, key: str) -> None:
        self._r = r
        self._key = key
        self._id = f"admin-delete-{uuid.uuid4().hex[:12]}"
        self._args = [self._id, int(self.SECONDS * 1000), socket.gethostname(), os.getpid(), 0]
        self.held = False
        self.previous = 0
        self._since = 0.0  # when it was taken or last renewed (monotonic)

    def acquire(self) -> str | None:
        """Take or renew the lease; None, or who holds it (a live chief: not taken)."""
        reply = _scripts.call(self._r, "sync_lease", [self._key], ["acquire", *self._args])
        if int(reply[0]) != 1:
            return (f"{reply_text(reply[1])!r} on host {reply_text(reply[2]) or '?'}, "
                    f"pid {_int(reply[3]) or '?'}")
        if not self.held and len(reply) > 1 and reply[1]:
            self.previous = 1
        self.held = True
        self._since = time.monotonic()
        return None

    def renew(self) -> None:
        """Renew the lease when a third of it has passed. A renewal refused (Redis at
        maxmemory, where the deletes still run and free memory) is logged: the delete goes on,
        under the lease as long as it lasts, rather than stopping half-way."""
        if time.monotonic() - self._since < self.SECONDS / 3:
            return
        try:
            self.acquire()
        except ResourceExhaustedError as exc:
            logger.warning("deleting a sync job: could not renew its lease (%s)", exc)

    def release(self) -> None:
        if self.held:
            _scripts.call(self._r, "sync_lease", [self._key], ["release", *self._args])
            self.held = False


def list_jobs(
    r: redis.Redis, container: str, *, sync_prefix: str = SYNC_PREFIX
) -> list[str]:
    """The sync jobs of one container (their published state or counters exist), sorted."""
    pattern = state_pattern(container, sync_prefix)[: -len(":s")]  # accsync:{C:*}
    names: set[str] = set()
    # one SCAN for both suffixes (a SCAN walks the whole keyspace whatever it matches)
    for raw in r.scan_iter(match=pattern + ":[ps]*", count=1000):
        key = raw.decode("utf-8", "replace")
        suffix = next((s for s in (":p", ":st") if key.endswith(s)), None)
        if suffix is None:
            continue
        parsed = parse_state_key(key[: -len(suffix)] + ":s", sync_prefix)
        if parsed is not None and parsed[0] == container:
            names.add(parsed[1])
    return sorted(names)


def delete_param_versions(r: redis.Redis, keys: SyncKeys) -> int:
    """Delete the parts of every published parameter version of a job; returns how many."""
    found = list(r.scan_iter(match=keys.versions_pattern, count=1000))
    return sum(int(r.unlink(*found[i : i + 500])) for i in range(0, len(found), 500))
