"""Inspecting and operating accumulators: the functions behind the ``accumulator`` CLI.

Pure functions over a ``redis.Redis`` that returns bytes (the default). Every key name comes
from :mod:`accumulator._keys`; keys are found with SCAN (never KEYS). Reads are snapshots:
accumulators may change while they are inspected.

Sync jobs (:mod:`accumulator.sync`) have their own functions at the end: :func:`describe_job`,
:func:`delete_job`, and the chief lease's key (:func:`chief_lease_key`).

Nothing here needs INFO or MEMORY USAGE: where a server lacks them (fakeredis, a restricted
ACL, a managed service) the corresponding values are ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import msgpack
import redis
from redis.exceptions import ResponseError

from . import _scripts
from ._codec import Definition, format_shape, parse_shape_token
from ._core import TAKER_LEASE_SECONDS
from ._errors import InvalidArgumentError, NotFoundError
from ._keys import (
    DEFAULT_PREFIX,
    SCHEMA_VERSION,
    SYNC_PREFIX,
    Keys,
    SyncKeys,
    parse_state_key,
    state_pattern,
)

__all__ = [
    "ChiefLease",
    "Info",
    "JobInfo",
    "JobParam",
    "JobWorker",
    "LeftClaim",
    "Taker",
    "chief_lease_key",
    "containers_of",
    "delete",
    "delete_job",
    "describe",
    "describe_job",
    "list_accumulators",
    "parse_worker_counters",
    "reset",
    "reset_container",
    "server_info",
    "set_step",
]

logger = logging.getLogger(__name__)

_SCAN_COUNT = 1000
_LEASE_MS = int(TAKER_LEASE_SECONDS * 1000)
_STATS = (
    "n_applied",
    "n_stale",
    "stale_steps",
    "max_stale",
    "n_rejected",
    "n_quarantined",
    "n_taken",
    "grads_taken",
)


@dataclass(frozen=True)
class Taker:
    """One take waiting in the FIFO (times in ms, server clock)."""

    taker_id: str
    position: int  # 1 = head of the FIFO: the next take to be served
    num_required: int | None  # None when its info entry is missing (it is just leaving)
    joined_ms: int | None
    lease_expiry_ms: int | None
    waited_ms: int | None  # since it joined
    lease_remaining_ms: int | None  # negative: the lease ran out (crashed taker, pruned soon)
    lease_age_ms: int | None  # since its last renewal, assuming the library's lease length


@dataclass(frozen=True)
class LeftClaim:
    """A claimed round kept without expiry: its taker was interrupted or crashed before it
    read the round (also, for an instant, a take in progress that is reading it)."""

    key: str
    taker_id: str
    step: int | None  # the global step that take advanced to
    count: int  # gradients in the claimed round
    bytes: int  # payload bytes still held (inline entries plus blob keys that exist)
    missing_blobs: int  # payload keys referenced by the claim that no longer exist


@dataclass(frozen=True)
class Info:
    """A snapshot of one accumulator. :func:`describe` fills the fields after ``detailed``."""

    container: str
    shared_name: str
    kind: str  # "dense", "sparse", or whatever a newer library wrote
    dtype: str
    shape: tuple[int | None, ...] | None  # declared shape; None = unknown rank
    reduction: str
    schema: str  # key schema version written in Redis
    step: int  # global step
    count: int  # gradients accepted in the pending round
    round_shape: tuple[int, ...] | None  # shape of the pending round (None: no round)
    bytes: int  # payload bytes of the pending round
    gen: int  # takes plus resets so far
    takers_waiting: int
    private: bool  # an unnamed accumulator (expires when unused)
    created_ms: int | None
    now_ms: int | None  # server time of this snapshot
    n_applied: int = 0  # applies accepted, lifetime
    n_stale: int = 0  # applies dropped as stale
    stale_steps: int = 0  # sum over stale drops of how many steps behind they were
    max_stale: int = 0
    n_rejected: int = 0  # applies refused by the scripts (round shape, pending-bytes limit)
    n_quarantined: int = 0  # round entries a take refused as corrupt (moved to quarantine)
    n_taken: int = 0  # successful takes
    grads_taken: int = 0  # gradients handed out by those takes
    last_take_ms: int | None = None
    last_take_wait_ms: int | None = None  # how long the last successful take waited
    detailed: bool = False
    takers: tuple[Taker, ...] = ()
    claims: tuple[LeftClaim, ...] = ()  # rounds left behind
    retry_buffers: int = 0  # finished takes' rounds kept briefly for a retried take (expire)
    keys: int | None = None  # keys of this accumulator found by SCAN
    stray_keys: int = 0  # keys nothing refers to (e.g. payloads of applies that never landed)
    memory_bytes: int | None = None  # MEMORY USAGE summed over keys; None when unavailable
    definition_error: str | None = field(default=None)
    max_pending_bytes: int | None = None  # the pending-bytes limit (None: set by no opener)
    quarantined: int = 0  # entries in the quarantine list now (``describe`` only)

    @property
    def name(self) -> str:
        return self.shared_name

    @property
    def shape_text(self) -> str:
        return format_shape(self.shape)

    @property
    def mean_stale(self) -> float | None:
        """Mean number of steps behind of the stale drops."""
        return self.stale_steps / self.n_stale if self.n_stale else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples become lists, plus a few derived values."""
        out = asdict(self)
        out["shape"] = None if self.shape is None else list(self.shape)
        out["round_shape"] = None if self.round_shape is None else list(self.round_shape)
        out["takers"] = [asdict(t) for t in self.takers]
        out["claims"] = [asdict(c) for c in self.claims]
        out["shape_text"] = self.shape_text
        out["mean_stale"] = self.mean_stale
        return out


# -- reading ----------------------------------------------------------------------------------


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _int(value: bytes | str | int | None, default: int | None = 0) -> int | None:
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _server_ms(reply: Any) -> int | None:
    try:
        sec, usec = reply
        return int(sec) * 1000 + int(usec) // 1000
    except (TypeError, ValueError):
        return None


def _definition(
    raw: bytes | None,
) -> tuple[str, str, tuple[int | None, ...] | None, str, str | None]:
    """(kind, dtype, shape, reduction, error) from the msgpack ``def`` field, tolerant of
    kinds and dtypes this version does not know."""
    if raw is None:
        return "?", "?", None, "?", "no definition stored"
    try:
        d = Definition.unpack(raw)
        return d.kind, d.dtype.name, d.shape, d.reduction_type, None
    except Exception as exc:  # noqa: BLE001 - show what can be shown, keep the reason
        try:
            fields = msgpack.unpackb(raw, raw=False)
            shape = fields.get("shape")
            dims = None if shape is None else tuple(None if d == -1 else d for d in shape)
            return (
                str(fields.get("kind", "?")),
                str(fields.get("dtype", "?")),
                dims,
                str(fields.get("reduction", "?")),
                str(exc),
            )
        except Exception:  # noqa: BLE001
            return "?", "?", None, "?", f"unreadable definition: {exc}"


def _info(
    container: str,
    name: str,
    state: Mapping[bytes, bytes],
    takers_waiting: int,
    now_ms: int | None,
    **extra: Any,
) -> Info:
    kind, dtype, shape, reduction, def_error = _definition(state.get(b"def"))
    rshape = state.get(b"rshape")
    return Info(
        container=container,
        shared_name=name,
        kind=kind,
        dtype=dtype,
        shape=shape,
        reduction=reduction,
        schema=_text(state.get(b"schema")),
        step=_int(state.get(b"step")) or 0,
        count=_int(state.get(b"count")) or 0,
        round_shape=parse_shape_token(rshape) if rshape is not None else None,
        bytes=_int(state.get(b"bytes")) or 0,
        gen=_int(state.get(b"gen")) or 0,
        takers_waiting=takers_waiting,
        private=(_int(state.get(b"ttl")) or 0) > 0,
        created_ms=_int(state.get(b"created_ms"), None),
        now_ms=now_ms,
        last_take_ms=_int(state.get(b"last_take_ms"), None),
        last_take_wait_ms=_int(state.get(b"last_take_wait_ms"), None),
        definition_error=def_error,
        max_pending_bytes=_int(state.get(b"maxbytes"), None),
        **{s: _int(state.get(s.encode())) or 0 for s in _STATS},
        **extra,
    )


def _scan(r: redis.Redis, pattern: str) -> set[bytes]:
    return set(r.scan_iter(match=pattern, count=_SCAN_COUNT))


def _key_bytes(key: str) -> bytes:
    return key.encode("utf-8")


def _not_found(shared_name: str, container: str) -> NotFoundError:
    where = f" in container {container!r}" if container else ""
    return NotFoundError(f"no accumulator named {shared_name!r}{where}")


@dataclass(frozen=True)
class Unreadable(Info):
    """An entry :func:`list_accumulators` found but could not read: one of its keys has the
    wrong type (e.g. a string that another program wrote where the state hash belongs). Its
    definition fields are ``"?"``, its numbers 0; ``error`` says which key holds what (also in
    ``to_dict()``)."""

    error: str = ""


#: What list_accumulators reads from each key, for the message when a key holds another type.
_LISTED_TYPES = {"state": "hash", "takers": "sorted set"}
_TYPE_NAMES = {"zset": "sorted set", "none": "nothing (removed meanwhile)"}


def _wrong_type(reply: Any) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def _unreadable(
    r: redis.Redis, container: str, name: str, wrong: list[tuple[str, str]], now: int | None
) -> Unreadable:
    notes = []
    for key, wanted in wrong:
        try:
            held = _text(r.type(key))
        except redis.RedisError:
            held = "?"
        notes.append(f"{key} holds a {_TYPE_NAMES.get(held, held)} where a {wanted} belongs")
    error = "; ".join(notes) + " (a key written by another program?)"
    logger.info("list_accumulators: %s", error)
    return Unreadable(
        container=container, shared_name=name, kind="?", dtype="?", shape=None, reduction="?",
        schema="", step=0, count=0, round_shape=None, bytes=0, gen=0, takers_waiting=0,
        private=False, created_ms=None, now_ms=now, error=error,
    )  # fmt: skip


def list_accumulators(
    r: redis.Redis, container: str | None = None, *, prefix: str = DEFAULT_PREFIX
) -> list[Info]:
    """Every accumulator (of one container, if given), sorted by container and name.

    One SCAN over the state keys, then one pipelined round trip: HGETALL of each state and
    ZCARD of each takers zset. Lifetime statistics are included; takers and claims are not.

    A foreign key under the prefix does not make the listing fail: an entry whose state or
    takers key has the wrong type (WRONGTYPE) is listed as an :class:`Unreadable` (an
    :class:`Info` whose ``error`` says why), in its sorted place. Other errors raise.
    """
    found: list[tuple[str, str, Keys]] = []
    for raw in _scan(r, state_pattern(container, prefix)):
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            logger.debug("skipping a state key that is not UTF-8: %r", raw)
            continue
        parsed = parse_state_key(key, prefix)
        if parsed is None or (container is not None and parsed[0] != container):
            continue
        keys = Keys(parsed[0], parsed[1], prefix)
        if keys.state != key:  # an escaping this version would not produce
            logger.debug("skipping %r: not a key this library names", key)
            continue
        found.append((parsed[0], parsed[1], keys))
    found.sort(key=lambda item: (item[0], item[1]))
    if not found:
        return []
    pipe = r.pipeline(transaction=False)
    pipe.time()
    for _, _, keys in found:
        pipe.hgetall(keys.state)
        pipe.zcard(keys.takers)
    replies = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception) and not _wrong_type(reply):
            raise reply
    now = _server_ms(replies[0])
    out: list[Info] = []
    for i, (cont, name, keys) in enumerate(found):
        state, waiting = replies[1 + 2 * i], replies[2 + 2 * i]
        wrong = [
            (key, _LISTED_TYPES[what])
            for what, key, reply in (("state", keys.state, state), ("takers", keys.takers, waiting))
            if _wrong_type(reply)
        ]
        if wrong:
            out.append(_unreadable(r, cont, name, wrong, now))
            continue
        if not state:  # deleted between SCAN and HGETALL
            continue
        out.append(_info(cont, name, state, int(waiting or 0), now))
    return out


def _takers(
    ranked: list[tuple[bytes, float]], info: Mapping[bytes, bytes], now: int | None
) -> tuple[Taker, ...]:
    out: list[Taker] = []
    for position, (member, _score) in enumerate(ranked, start=1):
        parts = _text(info.get(member)).split()
        n = expiry = joined = None
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            n, expiry, joined = (int(p) for p in parts)
        out.append(
            Taker(
                taker_id=_text(member),
                position=position,
                num_required=n,
                joined_ms=joined,
                lease_expiry_ms=expiry,
                waited_ms=None if now is None or joined is None else max(0, now - joined),
                lease_remaining_ms=None if now is None or expiry is None else expiry - now,
                lease_age_ms=(
                    None if now is None or expiry is None else max(0, now - (expiry - _LEASE_MS))
                ),
            )
        )
    return tuple(out)


def _memory_usage(r: redis.Redis, keys: Iterable[bytes]) -> int | None:
    """Sum of MEMORY USAGE over keys; None when the server refuses the command."""
    names = list(keys)
    if not names:
        return 0
    pipe = r.pipeline(transaction=False)
    for key in names:
        pipe.execute_command("MEMORY", "USAGE", key)
    try:
        replies = pipe.execute(raise_on_error=False)
    except ResponseError as exc:
        logger.debug("MEMORY USAGE unavailable: %s", exc)
        return None
    total = 0
    for reply in replies:
        if isinstance(reply, Exception):  # unknown command, NOPERM, ...
            logger.debug("MEMORY USAGE unavailable: %s", reply)
            return None
        total += int(reply or 0)  # None: the key vanished meanwhile
    return total


def _left_claims(
    r: redis.Redis, keys: Keys, claim_keys: list[bytes], claim_head: bytes
) -> tuple[list[LeftClaim], int, set[bytes]]:
    """The claims kept without expiry (left behind), the number of expiring ones (retry
    buffers of finished takes), and the payload keys the kept ones refer to."""
    if not claim_keys:
        return [], 0, set()
    pipe = r.pipeline(transaction=False)
    for key in claim_keys:
        pipe.pttl(key)
    ttls = [int(t) if t is not None else -2 for t in pipe.execute()]
    kept = [k for k, t in zip(claim_keys, ttls, strict=True) if t == -1]
    buffers = sum(1 for t in ttls if t >= 0)
    if not kept:
        return [], buffers, set()
    pipe = r.pipeline(transaction=False)
    for key in kept:
        pipe.lrange(key, 0, -1)
    contents = pipe.execute()
    # entries are untrusted: only this accumulator's own payload keys are looked at
    blob_refs = [[e[1:] for e in c[1:] if e[:1] == b"k" and keys.is_blob(e[1:])] for c in contents]
    all_blobs = [b for refs in blob_refs for b in refs]
    sizes: dict[bytes, int] = {}
    if all_blobs:
        pipe = r.pipeline(transaction=False)
        for blob in all_blobs:
            pipe.exists(blob)
            pipe.strlen(blob)
        flat = pipe.execute()
        sizes = {b: int(flat[2 * i + 1]) for i, b in enumerate(all_blobs) if flat[2 * i]}
    claims: list[LeftClaim] = []
    referenced: set[bytes] = set()
    for key, content, refs in zip(kept, contents, blob_refs, strict=True):
        if not content:  # read and deleted since the SCAN
            continue
        referenced.update(refs)
        header = _text(content[0]).split(" ")
        inline = sum(len(e) - 1 for e in content[1:] if e[:1] == b"i")
        claims.append(
            LeftClaim(
                key=_text(key),
                taker_id=_text(key[len(claim_head) :]),
                step=_int(header[0], None),
                count=len(content) - 1,
                bytes=inline + sum(sizes.get(b, 0) for b in refs),
                missing_blobs=sum(1 for b in refs if b not in sizes),
            )
        )
    return claims, buffers, referenced


def describe(
    r: redis.Redis,
    shared_name: str,
    container: str = "",
    *,
    memory: bool = True,
    prefix: str = DEFAULT_PREFIX,
) -> Info:
    """Everything about one accumulator: state, lifetime statistics, waiting takers, claims
    left behind, stray keys and (``memory=True``, where the server allows) MEMORY USAGE.

    Raises :class:`NotFoundError` when its state hash does not exist.
    """
    keys = Keys(container, shared_name, prefix)
    pipe = r.pipeline(transaction=True)  # one consistent snapshot of the fixed keys
    pipe.time()
    pipe.hgetall(keys.state)
    pipe.zrange(keys.takers, 0, -1, withscores=True)
    pipe.hgetall(keys.taker_info)
    pipe.lrange(keys.grads, 0, -1)
    pipe.llen(keys.quarantine)
    now_reply, state, ranked, taker_info, entries, quarantined = pipe.execute()
    if not state:
        raise _not_found(shared_name, container)
    now = _server_ms(now_reply)

    fixed = {
        _key_bytes(k)
        for k in (
            keys.state, keys.grads, keys.takers, keys.taker_info, keys.wake, keys.queue_wake,
            keys.quarantine, keys.claims,
        )
    }  # fmt: skip
    claim_head = _key_bytes(keys.claim(""))
    dedup_head = _key_bytes(keys.dedup(""))
    found = _scan(r, keys.pattern) | {_key_bytes(keys.state)}
    found |= {
        _key_bytes(k)
        for k, there in (
            (keys.grads, entries),
            (keys.takers, ranked),
            (keys.taker_info, taker_info),
            (keys.quarantine, quarantined),
        )
        if there
    }
    claim_keys = sorted(k for k in found if k.startswith(claim_head))
    referenced = {e[1:] for e in entries if e[:1] == b"k"}

    claims, retry_buffers, in_claims = _left_claims(r, keys, claim_keys, claim_head)
    referenced |= in_claims
    stray = [
        k
        for k in found
        if k not in fixed
        and k not in referenced
        and not k.startswith(claim_head)
        and not k.startswith(dedup_head)
    ]
    if stray:
        logger.debug("%d stray keys under %s", len(stray), keys.base)
    return _info(
        container,
        shared_name,
        state,
        len(ranked),
        now,
        detailed=True,
        takers=_takers(ranked, taker_info, now),
        claims=tuple(claims),
        retry_buffers=retry_buffers,
        keys=len(found),
        stray_keys=len(stray),
        quarantined=int(quarantined or 0),
        memory_bytes=_memory_usage(r, sorted(found)) if memory else None,
    )


def server_info(r: redis.Redis) -> dict[str, Any] | None:
    """A few INFO fields (version, mode, memory), or None when INFO is not allowed."""
    try:
        info = r.info("server")
        memory = r.info("memory")
    except ResponseError as exc:
        logger.debug("INFO unavailable: %s", exc)
        return None
    product = "valkey" if "valkey_version" in info else "redis"
    return {
        "server": product,
        "version": str(info.get("valkey_version") or info.get("redis_version") or "?"),
        "mode": info.get("redis_mode"),
        "used_memory": memory.get("used_memory"),
        "used_memory_human": memory.get("used_memory_human"),
        "maxmemory": memory.get("maxmemory"),
    }


# -- changing ---------------------------------------------------------------------------------


def set_step(
    r: redis.Redis, shared_name: str, n: int, container: str = "", *, prefix: str = DEFAULT_PREFIX
) -> int:
    """Set the global step (also downwards); the pending round is kept. Returns the old step."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgumentError(f"the global step must be an integer, got {n!r}")
    keys = Keys(container, shared_name, prefix)
    try:
        old = _scripts.call(r, "set_step", [keys.state], [SCHEMA_VERSION, n])
    except NotFoundError as exc:
        raise _not_found(shared_name, container) from exc
    return int(old)


def reset(
    r: redis.Redis, shared_name: str, container: str = "", *, prefix: str = DEFAULT_PREFIX
) -> int:
    """Drop the pending round (its gradients and payload keys); the step does not change.
    Waiting takers keep waiting. Returns the number of gradients dropped."""
    keys = Keys(container, shared_name, prefix)
    try:
        dropped, *blobs = _scripts.call(
            r, "reset", [keys.state, keys.grads, keys.quarantine], [SCHEMA_VERSION]
        )
    except NotFoundError as exc:
        raise _not_found(shared_name, container) from exc
    blobs = [b for b in blobs if keys.is_blob(b)]  # the script returns only ours; twice sure
    if blobs:
        r.unlink(*blobs)
    return int(dropped)


def delete(
    r: redis.Redis, shared_name: str, container: str = "", *, prefix: str = DEFAULT_PREFIX
) -> int:
    """Delete every key of one accumulator (state, round, payloads, takers, claims, retry
    records). Processes still using it get :class:`NotFoundError`. Returns the number of keys
    deleted; raises :class:`NotFoundError` when there was none."""
    keys = Keys(container, shared_name, prefix)
    fixed = [keys.state, keys.grads, keys.takers, keys.taker_info, keys.wake, keys.queue_wake,
             keys.quarantine, keys.claims]  # fmt: skip
    # The state first, atomically with reading the round: from here on every script answers
    # NOTFOUND, so nothing new is added while the rest is found and removed.
    pipe = r.pipeline(transaction=True)
    pipe.lrange(keys.grads, 0, -1)
    pipe.unlink(*fixed)
    entries, removed = pipe.execute()
    removed = int(removed)
    # round entries are untrusted: only this accumulator's own payload keys are deleted
    blobs = [e[1:] for e in entries if e[:1] == b"k" and keys.is_blob(e[1:])]
    if blobs:
        removed += int(r.unlink(*blobs))
    rest = sorted(_scan(r, keys.pattern))
    for i in range(0, len(rest), 500):
        removed += int(r.unlink(*rest[i : i + 500]))
    if removed == 0:
        raise _not_found(shared_name, container)
    return removed


def reset_container(r: redis.Redis, container: str, *, prefix: str = DEFAULT_PREFIX) -> int:
    """Delete every accumulator of one container (TF's container reset). Returns how many."""
    deleted = 0
    for info in list_accumulators(r, container, prefix=prefix):
        try:
            delete(r, info.shared_name, info.container, prefix=prefix)
        except NotFoundError:  # deleted by someone else meanwhile
            continue
        deleted += 1
    return deleted


def containers_of(r: redis.Redis, shared_name: str, *, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The containers holding an accumulator named ``shared_name`` (for a "did you mean
    --container ...?" hint), sorted."""
    infos = list_accumulators(r, None, prefix=prefix)
    return sorted({i.container for i in infos if i.shared_name == shared_name})


# -- sync jobs (accumulator.sync) ---------------------------------------------------------------


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
        parts = _text(key).split(":")
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


def _job_specs(meta: bytes | None) -> tuple[list[tuple[str, str, str, tuple[int, ...] | None]],
                                            int | None, str | None, str | None]:  # fmt: skip
    """(params [(name, kind, dtype, shape)], replicas, reduction, error) from the msgpack
    metadata a chief publishes; tolerant of what it cannot read."""
    if meta is None:
        return [], None, None, None
    try:
        raw = msgpack.unpackb(meta, raw=False)
        specs = []
        for name, kind, dtype, shape in raw["params"]:
            dims = None if shape is None else tuple(int(d) for d in shape)
            specs.append((str(name), str(kind), str(dtype), dims))
        return specs, _int(raw.get("replicas"), None), str(raw.get("reduction")), None
    except Exception as exc:  # noqa: BLE001 - show what can be shown, keep the reason
        return [], None, None, f"unreadable job metadata: {exc}"


def _chief(raw: Mapping[bytes, bytes], now: int | None) -> ChiefLease | None:
    if not raw or raw.get(b"id") is None:
        return None
    expires = _int(raw.get(b"expires_ms"), None)
    return ChiefLease(
        chief_id=_text(raw.get(b"id")), host=_text(raw.get(b"host")),
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
    pipe.time()
    pipe.hmget(keys.params, ["run", "step", "done", "meta"])
    pipe.hgetall(keys.stats)
    pipe.hgetall(chief_lease_key(keys))
    now_reply, (run, step, done, meta), counters, lease = pipe.execute()
    if run is None and step is None and not counters and not lease:
        where = f" in container {container!r}" if container else ""
        raise NotFoundError(f"no sync job named {job!r}{where}")
    now = _server_ms(now_reply)
    specs, replicas, reduction, meta_error = _job_specs(meta)
    pipe = r.pipeline(transaction=False)
    for name, *_ in specs:
        acc = Keys(container, f"{job}/{name}", prefix)
        pipe.hmget(acc.state, ["schema", "step", "count"])
        pipe.zcard(acc.takers)
        pipe.hgetall(acc.claims)
    replies = pipe.execute() if specs else []
    params = []
    for i, (name, kind, dtype, shape) in enumerate(specs):
        (schema, acc_step, count), waiting, registry = replies[3 * i : 3 * i + 3]
        claimed = sum(1 for v in registry.values() if v != b"done")
        params.append(JobParam(
            name=name, shared_name=f"{job}/{name}", kind=kind, dtype=dtype, shape=shape,
            step=None if schema is None else _int(acc_step) or 0, pending=_int(count) or 0,
            takers_waiting=int(waiting or 0), claimed=claimed,
        ))  # fmt: skip
    chief = _chief(lease, now)
    published = _int(step, None)
    info = JobInfo(
        container=container, job=job, published=meta is not None, run=_text(run) or None,
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
    for p in info.params:
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
    :class:`NotFoundError` when there was none."""
    keys = SyncKeys(container, job, sync_prefix)
    step, done, meta = cast("list[Any]", r.hmget(keys.params, ["step", "done", "meta"]))
    if not force and step is not None and done != b"1":
        raise InvalidArgumentError(
            f"sync job {job!r} is not finished (published step {_int(step)}); pass force to "
            "delete it anyway"
        )
    specs, *_ = _job_specs(meta)
    removed = 0
    for name, *_ in specs:
        try:
            removed += delete(r, f"{job}/{name}", container, prefix=prefix)
        except NotFoundError:
            continue
    removed += int(r.unlink(keys.params, keys.stats, chief_lease_key(keys)))
    if removed == 0:
        where = f" in container {container!r}" if container else ""
        raise NotFoundError(f"no sync job named {job!r}{where}")
    return removed
