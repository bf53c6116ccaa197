"""What the ``accumulator`` CLI shows of an accumulator: the snapshot types (:class:`Info`, its
takers and left-behind claims) and how they are read from an accumulator's state hash and
takers zset. Tolerant of what a newer library (or another program) wrote: what cannot be
read shows as ``"?"`` or ``None``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from ._codec import Definition, format_shape, parse_shape_token, reply_text
from ._model import TAKER_LEASE_SECONDS

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
    #: ms until its claim lease runs out (negative: ran out, the next take at the head gets
    #: the round); None: no lease (a claim kept by an older version)
    lease_remaining_ms: int | None = None


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
    takers_waiting: int  # queued takers whose lease has not run out
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
    keys: int | None = None  # keys of this accumulator found by SCAN (None: not scanned)
    #: keys nothing refers to (e.g. payloads of applies that never landed); None: not scanned
    stray_keys: int | None = 0
    stray_bytes: int | None = None  # their MEMORY USAGE (``describe`` with memory; else None)
    stray_expire_ms: int | None = None  # ms until the last of them expires (-1: one never does;
    # None: none, or not known)
    #: parts of payloads spread over a cluster's slots (no expiry of their own) that the orphans
    #: record names: applies being sent, or never finished (their worker killed half-way);
    #: None: not scanned
    spread_stray_keys: int | None = 0
    spread_stray_bytes: int | None = None  # their MEMORY USAGE (``describe`` with memory)
    #: ms until the last of their records runs out; after that the accumulator's next apply,
    #: take, reset or delete deletes them (0: due now; None: none)
    spread_stray_due_ms: int | None = None
    memory_bytes: int | None = None  # MEMORY USAGE summed over keys; None when unavailable
    definition_error: str | None = field(default=None)
    max_pending_bytes: int | None = None  # the pending-bytes limit (None: set by no opener)
    quarantined: int = 0  # entries in the quarantine list now (``describe`` only)
    #: the final step of the finished sync job it belongs to (applies that are not stale are
    #: refused); None: not sealed
    sealed: int | None = None
    #: rounds claimed by takers that are gone (claim lease run out: the next take takes them
    #: over, as they were), and the gradients they hold
    stranded_claims: int = 0
    stranded_grads: int = 0
    #: the module's dtype name (``f32``...) when each round's sum is kept in Redis (the accsum
    #: module: decided at creation); None: the taker sums
    sum_in_redis: str | None = None

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
        # (not read by a listing: null, not an empty list that says "none")
        out["takers"] = [asdict(t) for t in self.takers] if self.detailed else None
        out["claims"] = [asdict(c) for c in self.claims] if self.detailed else None
        out["shape_text"] = self.shape_text
        out["mean_stale"] = self.mean_stale
        return out


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
    stats: dict[str, Any] = {s: _int(state.get(s.encode())) or 0 for s in _STATS}
    rshape = state.get(b"rshape")
    try:
        round_shape = parse_shape_token(rshape) if rshape is not None else None
    except (ValueError, TypeError):  # written by something else than our scripts
        round_shape = None
        def_error = def_error or f"unreadable round shape {rshape!r}"
    for stat in (b"step", b"count"):  # shown as 0 they read as a fresh round
        if _int(state.get(stat), None) is None and not def_error:
            def_error = f"unreadable {stat.decode()} {state.get(stat)!r}"
    return Info(
        container=container,
        shared_name=name,
        kind=kind,
        dtype=dtype,
        shape=shape,
        reduction=reduction,
        schema=reply_text(state.get(b"schema")),
        step=_int(state.get(b"step")) or 0,
        count=_int(state.get(b"count")) or 0,
        round_shape=round_shape,
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
        sealed=_int(state.get(b"sealed"), None),
        sum_in_redis=reply_text(state[b"sum"]) if state.get(b"sum") else None,
        **stats,
        **extra,
    )


@dataclass(frozen=True)
class Unreadable(Info):
    """An entry :func:`list_accumulators` found but could not read: one of its keys has the
    wrong type (e.g. a string that another program wrote where the state hash belongs). Its
    definition fields are ``"?"``, its numbers 0; ``error`` says which key holds what (also in
    ``to_dict()``)."""

    error: str = ""


def _takers(
    ranked: list[tuple[bytes, float]], info: Mapping[bytes, bytes], now: int | None
) -> tuple[Taker, ...]:
    out: list[Taker] = []
    for position, (member, _score) in enumerate(ranked, start=1):
        parts = reply_text(info.get(member)).split()
        n = expiry = joined = None
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            n, expiry, joined = (int(p) for p in parts)
        out.append(
            Taker(
                taker_id=reply_text(member),
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


def live_takers(queued: list[bytes], leases: Mapping[bytes, bytes], now: int | None) -> int:
    """How many of the queued takers (the takers zset's members) still wait: those whose
    lease has not run out (a taker killed while it waited stays queued until the next take
    prunes it). Without the server's time, or with a lease this library did not write, a
    queued one counts."""
    if now is None:
        return len(queued)
    live = 0
    for member in queued:
        parts = reply_text(leases.get(member)).split()
        live += not (len(parts) == 3 and parts[1].isdigit() and int(parts[1]) <= now)
    return live


def queue_time(r: Any, pipe: Any) -> Callable[[list[Any]], list[Any]]:
    """Queue the server's TIME first on ``pipe``; returns what to apply to the pipeline's
    replies. A cluster pipeline cannot carry TIME (it has no key): there it is asked apart,
    and put first in the replies all the same."""
    if getattr(r, "nodes_manager", None) is None:
        pipe.time()
        return lambda replies: list(replies)
    return lambda replies: [r.time(), *replies]
