"""What the synchronous and asyncio accumulators share: their state, their checks and the
simple protocol steps (open, read and set the step), with no I/O of their own.

The protocol steps are generators of requests (``_requests``); the drivers
(:class:`accumulator.AccumulatorBase`, ``accumulator.aio``) do the I/O. The apply and take
protocols are in ``_apply`` and ``_take``; kind-specific checks and reductions in ``_dense`` and
``_sparse`` (``DenseOps``, ``SparseOps``).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from numbers import Real
from typing import Any

import numpy as np

from . import _module, _retry, _scripts
from ._codec import (
    Definition,
    format_shape,
    normalize_shape,
    reply_text,
    resolve_dtype,
    scalar_int,
)
from ._connection import WAIT_SLICE
from ._durability import Durability, durability_of
from ._errors import (
    CancelledError,
    InvalidArgumentError,
    NotFoundError,
)
from ._identities import Identities
from ._keys import SCHEMA_VERSION, SPREAD_SCHEMA, Keys
from ._requests import Batch, Call, Command, Ops
from ._stream import ReceiveBuffers

logger = logging.getLogger("accumulator")

#: Payloads up to this size travel inside the apply script call (one round trip); larger ones
#: are written in parts of one chunk each (``_chunks``), with plain SETs in the same pipeline
#: (no copy through Lua).
INLINE_MAX_BYTES = 32 * 1024
#: How long a waiting taker's place in the FIFO survives without renewal (a crashed taker
#: blocks the takers behind it at most this long). Renewed every WAIT_SLICE.
TAKER_LEASE_SECONDS = 6.0
#: A payload written by an apply that never reached its script expires after this.
ORPHAN_TTL_MS = 3600 * 1000
#: A client deleting spread payloads' parts (dropped, taken, swept: ``lua/orphans.lua``) holds
#: them this long before another sweeper may (lua/_common.lua has the same number).
SWEEP_LEASE_MS = 60 * 1000
#: Spread payloads one apply sweeps, at most, when there is garbage.
SWEEP_COUNT = 16
#: A claim is leased to its taker for this long, plus CLAIM_LEASE_MS_PER_MIB
#: per MiB of payload, while it reads and reduces the round; past that the taker is taken for
#: gone and the next take hands its round over (nothing is lost with a crashed chief).
CLAIM_LEASE_MS = 5 * 1000
CLAIM_LEASE_MS_PER_MIB = 50  # 20 MiB/s: far below loopback or LAN speed
#: How long a take whose finish may have run (sent, its reply lost) keeps asking Redis, before
#: it gives up not knowing: a retried finish is answered for two minutes (lua/finish.lua).
FINISH_SETTLE_SECONDS = 90.0
#: The largest gradient payload: 16 GiB (stored in parts of one chunk each, so Redis itself
#: sets no limit). A guard against a mistaken broadcast view: the taker holds one result.
MAX_PAYLOAD_BYTES = 16 * 1024**3
#: Safety-net expiry of a private (unnamed) accumulator, renewed by every write.
PRIVATE_TTL_MS = 24 * 3600 * 1000
#: Default limit on the payload bytes one pending round may hold (``max_pending_bytes``):
#: past it applies get ResourceExhaustedError instead of exhausting Redis.
DEFAULT_MAX_PENDING_BYTES = 4 * 1024**3
#: Shared names starting with this are private accumulators' (unnamed ones): nobody opens them.
PRIVATE_PREFIX = "__private__/"
#: maxmemory policies that never evict our keys.
_SAFE_POLICIES = ("noeviction", "")
#: Servers (host, port, path, db) whose eviction policy was looked at by this process.
_policy_checked: set[tuple[Any, ...]] = set()

_REDUCTIONS = ("MEAN", "SUM")


def server_of(client: Any) -> tuple[Any, ...]:
    """(host, port, path, db) of a client's server (sync or asyncio): what a warning is given
    once for."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a cluster client: the node it was started from
        node = client.get_default_node() or next(iter(getattr(client, "startup_nodes", [])), None)
        return (getattr(node, "host", None), getattr(node, "port", None), None, 0)
    kwargs = pool.connection_kwargs
    return (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"), kwargs.get("db"))


def _check_name(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{what} {value!r} is not valid Unicode text (it cannot be encoded as UTF-8: {exc})"
        ) from None
    return value


class AccumulatorModel:
    """State, checks and I/O-free protocol steps shared by the sync and asyncio classes."""

    _kind = ""
    #: Tuning knobs, per object so that tests (and unusual deployments) can shorten them.
    wait_slice: float = WAIT_SLICE
    #: The global step the last round this object took left behind (its claim's); read by
    #: accumulator.sync's chief, which finds a job rolled back by Redis this way.
    _claimed_step: int | None = None
    taker_lease: float = TAKER_LEASE_SECONDS
    _claim_lease: float | None = None  # None: CLAIM_LEASE_MS
    #: Seconds an operation rides through an unreachable Redis (a restart, a failover, killed
    #: connections) before raising :class:`UnavailableError`; retried applies count once.
    retry_window: float = _retry.RETRY_WINDOW
    #: Seconds an apply (or a take's finish) waits for ``min_replicas``/``wait_aof``.
    durability_timeout: float = 5.0

    @property
    def claim_lease(self) -> float | None:
        """Seconds (plus 50 ms per MiB of the round) a round this object's take claimed stays
        its own while it reads and reduces it, renewed as it reads; past that, if another
        taker comes, the round is handed over. None: the default (5 s)."""
        return self._claim_lease

    @claim_lease.setter
    def claim_lease(self, seconds: float | None) -> None:
        if seconds is not None:
            if isinstance(seconds, (bool, np.bool_)) or not isinstance(seconds, Real):
                raise InvalidArgumentError(
                    f"claim_lease must be a number of seconds or None, got {seconds!r}"
                )
            if not 0 <= float(seconds) <= 86400:
                raise InvalidArgumentError(
                    f"claim_lease must be between 0 and 86400 seconds, got {seconds!r}"
                )
            seconds = float(seconds)
        self._claim_lease = seconds

    def _setup(
        self,
        dtype: Any,
        shape: Any,
        shared_name: str | None,
        name: str | None,
        reduction_type: str,
        container: str,
        max_pending_bytes: int | None,
        sum_in_redis: bool | None,
        min_replicas: int = 0,
        wait_aof: bool = False,
        spread_parts: bool | None = None,
        retry_window: float | None = None,
    ) -> None:
        """Check the constructor's arguments and set the state (no I/O)."""
        if retry_window is not None:
            self.retry_window = _retry.checked_window(retry_window)
        durability_of(min_replicas, wait_aof, self.durability_timeout)  # checks them
        self._min_replicas, self._wait_aof = min_replicas, wait_aof
        container = _check_name("" if container is None else container, "container")
        if sum_in_redis not in (None, True, False):
            raise InvalidArgumentError(
                f"sum_in_redis must be True, False or None (decide from the server), got "
                f"{sum_in_redis!r}"
            )
        self._want_sum = sum_in_redis
        if spread_parts not in (None, True, False):
            raise InvalidArgumentError(
                f"spread_parts must be True, False or None (decide from the client), got "
                f"{spread_parts!r}"
            )
        self._want_spread = spread_parts
        #: the key schema this accumulator was created with (3: spread over slots; set by open)
        self._schema = SCHEMA_VERSION
        self._instance = ""  # the instance id this object opened (see _open_ops)
        if shared_name is not None:
            shared_name = _check_name(shared_name, "shared_name")
            if shared_name.startswith(PRIVATE_PREFIX):
                raise InvalidArgumentError(
                    f"shared_name {shared_name!r}: names starting with {PRIVATE_PREFIX!r} belong "
                    "to private (unnamed) accumulators and cannot be opened by name"
                )
        if max_pending_bytes is not None and (
            isinstance(max_pending_bytes, bool)
            or not isinstance(max_pending_bytes, (int, np.integer))
            or not 1 <= max_pending_bytes < 10**18  # (what the scripts' counts hold)
        ):
            raise InvalidArgumentError(
                "max_pending_bytes must be a positive integer below 10**18, or None, got "
                f"{max_pending_bytes!r}"
            )
        self._max_pending = max_pending_bytes
        if not isinstance(reduction_type, str) or reduction_type not in _REDUCTIONS:
            raise InvalidArgumentError(
                f"Unsupported reduction type: {reduction_type!r} (expected 'MEAN' or 'SUM')"
            )
        self._definition = Definition(
            self._kind, resolve_dtype(dtype), normalize_shape(shape), reduction_type
        )
        self._name = None if name is None else _check_name(name, "name")
        self._private = not shared_name
        #: the process that made this object: a forked child's copy of a private accumulator
        #: closes its connections, never the keys of its creator (``_owns_private_keys``)
        self._pid = os.getpid()
        self._shared_name = shared_name or f"{PRIVATE_PREFIX}{uuid.uuid4().hex}"
        self._container = container
        self._keys = Keys(self._container, self._shared_name)
        self._identities = Identities()
        self._receive_buffers = ReceiveBuffers()
        #: the accsum module's dtype when this accumulator keeps its sums in Redis (set by open)
        self._sum_dtype = ""
        self._closed = False
        #: taker ids of this object's takes whose withdraw failed (_take.take retries them)
        self._unwithdrawn: list[str] = []
        #: thread id -> an interrupt (Ctrl-C...) that came while a take's finish was in flight
        #: in that thread: the take returned its round, and that thread's next call on this
        #: object raises it (_check_open; not another thread's: interrupt review, it killed
        #: a worker thread and the interrupted one went on)
        self._held_interrupts: dict[int, BaseException] = {}

    # -- properties ---------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of the gradients and of the result (stored with the accumulator)."""
        return self._definition.dtype

    @property
    def shape(self) -> tuple[int | None, ...] | None:
        """The declared shape (``None`` for an unknown dimension), or ``None`` for any shape."""
        return self._definition.shape

    @property
    def name(self) -> str | None:
        """TF's op name: a label of this Python object, not shared and not stored."""
        return self._name

    @property
    def shared_name(self) -> str | None:
        """The name every process opens to share this accumulator (``None``: private to this
        object, deleted when it is closed)."""
        return None if self._private else self._shared_name

    @property
    def container(self) -> str:
        """TF's container: a namespace of shared names (``reset_container`` deletes one)."""
        return self._container

    @property
    def reduction_type(self) -> str:
        """``"MEAN"`` or ``"SUM"``: what ``take_grad`` returns of a round."""
        return self._definition.reduction_type

    @property
    def accumulator_ref(self) -> str:
        """The handle naming this accumulator in Redis: the common prefix of its keys."""
        return self._keys.base

    @property
    def spreads_parts(self) -> bool:
        """Whether this accumulator stores large gradients' parts spread over slots (one hash
        tag per part index: every primary of a Redis Cluster holds some); decided when the
        accumulator was created."""
        return self._schema == SPREAD_SCHEMA

    @property
    def sums_in_redis(self) -> bool:
        """Whether this accumulator keeps each round's running sum inside Redis (the accsum
        module; decided when the accumulator was created), rather than its taker summing."""
        return bool(self._sum_dtype)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self._shared_name!r} {self.dtype.name} "
            f"{format_shape(self.shape)} {self.reduction_type}>"
        )

    def _durability(self) -> Durability | None:
        """What each commit waits for (None: nothing, Redis's default)."""
        return durability_of(self._min_replicas, self._wait_aof, self.durability_timeout)

    def __reduce__(self) -> Any:
        """Refused with a hint: the object holds connections and locks (pickled for a
        process started by ``spawn``/``forkserver``, a worker pool, ...)."""
        how = ("a private accumulator (no shared_name) is reached by this object and by the "
               "children forked from its process only" if self._private else
               f"open it there again by its name: {type(self).__name__}(dtype, shape, "
               f"shared_name={self._shared_name!r}, client=<its Redis URL>)")  # fmt: skip
        raise TypeError(f"cannot pickle {type(self).__name__} objects (they hold Redis "
                        f"connections); to use the accumulator in another process, {how}")

    def _owns_private_keys(self) -> bool:
        """Whether closing this object deletes its keys: a private accumulator's, in the
        process that created it (not in a forked child, whose copy shares them)."""
        return self._private and os.getpid() == self._pid

    def _check_open(self) -> None:
        if self._held_interrupts:
            held = self._held_interrupts.pop(threading.get_ident(), None)
            if held is not None:
                raise held
        if self._closed:
            raise CancelledError("the accumulator was closed")

    # -- open ---------------------------------------------------------------------------------

    def _open_ops(self, where: tuple[Any, ...], cluster: bool = False) -> Ops[None]:
        """Register the scripts, create the accumulator or check the stored definition, and
        warn once per server (``where``) about an evicting memory policy. ``cluster``: the
        client is a cluster client (a new named accumulator then spreads its parts)."""
        ttl = PRIVATE_TTL_MS if self._private else 0
        limit = self._max_pending or DEFAULT_MAX_PENDING_BYTES
        explicit = 0 if self._max_pending is None else 1
        yield from _load_scripts()
        yield from _check_durability(self._durability())
        summed = "" if self._want_spread else (yield from self._sum_dtype_for_new(cluster))
        spread = self._want_spread
        if spread is None:
            spread = cluster and not self._private and not summed
        if spread and (self._want_sum or self._private):
            raise InvalidArgumentError(
                "spread_parts=True: a private accumulator, or one that sums in Redis, keeps "
                "its parts in its own slot"
            )
        k = self._keys
        created, existing, summed, schema, *rest = yield Call(
            "open", "open",
            [k.state, k.grads, k.quarantine, k.orphans, k.claims, k.takers, k.taker_info],
            [SPREAD_SCHEMA if spread else SCHEMA_VERSION, self._definition.pack(), ttl,
             int(limit), explicit, summed, uuid.uuid4().hex],
        )  # fmt: skip
        self._schema = int(schema)
        # this accumulator, not one created again under its name after a delete: every call
        # of this object carries it (check_inst in lua/_common.lua; _recreated here)
        self._instance = reply_text(rest[0]) if rest else ""
        if len(rest) > 1 and int(rest[1]):
            logger.warning(
                "accumulator %r was created again over the remains of one whose state was "
                "lost (evicted under an allkeys-* maxmemory-policy, or deleted by hand): %d of "
                "its gradients were dropped, not taken into the new one's rounds",
                self._shared_name, int(rest[1]),
            )  # fmt: skip
        self._sum_dtype = reply_text(summed)
        if self._want_sum is not None and self._want_sum != bool(self._sum_dtype):
            logger.warning(
                "accumulator %r exists and sums %s: sum_in_redis=%s applies only when an "
                "accumulator is created (every client of one agrees)", self._shared_name,
                "in Redis" if self._sum_dtype else "on the taker", self._want_sum,
            )  # fmt: skip
        yield from _warn_if_evicting(where)
        if not created and existing != self._definition.pack():
            theirs = Definition.unpack(existing)
            mine = self._definition
            if mine.shape is None and (mine.kind, mine.dtype, mine.reduction_type) == (
                theirs.kind,
                theirs.dtype,
                theirs.reduction_type,
            ):
                # unknown shape is compatible with any (as in TF): adopt the stored one
                self._definition = theirs
            elif theirs != mine:
                raise InvalidArgumentError(
                    f"Accumulator {self._shared_name!r} already exists as "
                    f"{theirs.describe()}; cannot open it as {self._definition.describe()}"
                )

    def _sum_dtype_for_new(self, cluster: bool = False) -> Ops[str]:
        """The accsum module's dtype when a new accumulator is to keep its sums in Redis: a
        dense one of a dtype the module adds, on a server that runs the module (or as
        ``sum_in_redis`` says; never on a cluster); else ''."""
        if self._want_sum is False or self._kind != "dense":
            return ""
        if cluster:
            if self._want_sum:
                raise InvalidArgumentError(
                    "sum_in_redis=True: the accsum module is not used on a Redis Cluster (yet): "
                    "there the taker sums; open the accumulator without sum_in_redis"
                )
            return ""
        name = _module.module_dtype(self.dtype)
        if self._want_sum is None and name is None:
            return ""
        if name is None:
            raise InvalidArgumentError(
                f"sum_in_redis=True: the accsum module does not add {self.dtype.name} "
                "(float32/64 and integer dtypes only)"
            )
        if not (yield from _server_has_module()):
            if self._want_sum is None:  # the server decides
                return ""
            raise InvalidArgumentError(  # not transient: retrying would not help
                "sum_in_redis=True, but the Redis server does not run the accsum module (see "
                "the README's 'Large gradients and the Redis module')"
            )
        return name

    # -- simple state -------------------------------------------------------------------------

    def _read_state_ops(self, *fields: str) -> Ops[list[bytes | None]]:
        self._check_open()
        values = yield Command("read", ("HMGET", self._keys.state, "schema", "inst", *fields))
        if values[0] is None:
            raise NotFoundError(f"accumulator {self._shared_name!r} does not exist")
        if self._recreated(values[1]):
            raise _scripts.recreated(self._keys.state)
        return list(values[2:])

    def _recreated(self, stored: bytes | str | None) -> bool:
        """Whether ``stored``, the state's instance id, is not the one this object opened: the
        accumulator was deleted and created again since (the twin of ``check_inst`` in
        ``lua/_common.lua``; an object of an accumulator without an id checks nothing)."""
        return bool(self._instance) and reply_text(stored) != self._instance

    def _count_ops(self) -> Ops[int]:
        return int((yield from self._read_state_ops("count"))[0] or 0)

    def _step_ops(self) -> Ops[int]:
        return int((yield from self._read_state_ops("step"))[0] or 0)

    def _set_step_ops(self, new_global_step: Any) -> Ops[None]:
        self._check_open()
        new = scalar_int(new_global_step, "new_global_step")
        reply = yield Call("set_global_step", "set_step", [self._keys.state],
                           [self._schema, new, self._instance])  # fmt: skip
        old = old_step(reply, self._shared_name)
        if old is not None and new < old:
            logger.warning(
                "Attempt to set current_global_step_ to smaller value: "
                "current_global_step_ = %d >= %d = new_global_step.",
                old, new,
            )  # fmt: skip


def _load_scripts() -> Ops[None]:
    """Register every script with this server once, so the hot path never sees NOSCRIPT."""
    _scripts.check_loaded((yield Batch("open", _scripts.load_commands(), raise_on_error=False)))


def _check_durability(durability: Durability | None) -> Ops[None]:
    """Refuse at open a durability setting the server cannot give (no WAITAOF before Redis
    7.2, WAITAOF of the primary's AOF without appendonly, a double without WAIT)."""
    if durability is None:
        return
    probe = Durability(0, durability.aof, 0.001).command()
    try:
        yield Command("open", probe)
    except Exception as exc:  # noqa: BLE001 - whatever the server answers, it cannot do it
        if _retry.is_unreachable(exc):
            raise  # unreachable, not unable: the window's error as it is
        if "replica" in str(exc):
            # a replica refuses WAIT: a Sentinel-managed client reached the old primary in
            # a failover (the server can; the next write finds the new primary)
            return
        if _scripts.is_no_permission(exc):  # the user's ACL, not the server: say so
            _scripts.raise_translated(exc)  # (ours already, or redis-py's made ours)
        raise InvalidArgumentError(  # not transient: retrying would not help
            f"{durability.describe()}: the Redis server cannot confirm writes that way "
            f"({probe[0]} failed: {exc})"
        ) from exc


def _server_has_module() -> Ops[bool]:
    """Whether the server runs our module (its probe command answers). An error of the
    command (unknown, no permission, fakeredis) means no; Redis unreachable raises."""
    try:
        reply = yield Command("open", (_module.PING_COMMAND,))
    except Exception as exc:  # noqa: BLE001 - unknown command, ACL, a double without modules
        if _retry.is_unreachable(exc):
            raise
        return False
    return _module.is_probe_reply(reply)


def _warn_if_evicting(where: tuple[Any, ...]) -> Ops[None]:
    """Log a warning (once per server and process) when Redis may evict our keys. A client
    that may not run INFO (the README's worker and sync roles) cannot tell: the server is
    not marked as checked then, so that another client of the process that may does check
    it (security review: the first one's refusal silenced every later one)."""
    if where in _policy_checked:
        return
    try:
        info = yield Command("open", ("INFO", "memory"))
    except Exception:  # noqa: BLE001 - no INFO (ACL, fakeredis, managed service): cannot tell
        return
    _policy_checked.add(where)
    policy = str(info.get("maxmemory_policy", "")) if isinstance(info, dict) else ""
    if policy not in _SAFE_POLICIES:
        logger.warning(
            "Redis maxmemory-policy is %r: at the memory limit Redis may evict accumulator "
            "keys (pending gradients, retry records), losing gradients or counting a retried "
            "apply twice; use 'noeviction' (see the README, 'Memory and eviction')",
            policy,
        )


def old_step(reply: Any, shared_name: str) -> int | None:
    """The previous step set_step.lua returned; None when it was not a number (written by
    another program: the set repairs it), logged."""
    try:
        return int(reply)
    except (TypeError, ValueError):
        logger.warning("the global step of %r was not a number (%r): it is set now",
                       shared_name, reply)  # fmt: skip
        return None
