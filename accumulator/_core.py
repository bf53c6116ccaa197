"""The machinery shared by the dense and sparse accumulators: opening, the apply and take
protocols against the Lua scripts, blocking in bounded slices, and cleanup.

Kind-specific code (validation, payload layout, reduction) lives in ``_dense``/``_sparse``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import Any, TypeVar, cast

import numpy as np
import redis
from redis.client import PubSub
from redis.exceptions import NoScriptError, ResponseError

from . import _chunks, _module, _retry, _scripts
from ._codec import (
    Definition,
    format_shape,
    normalize_shape,
    parse_shape_token,
    resolve_dtype,
    scalar_int,
    to_payload,
)
from ._connection import WAIT_SLICE, Connections, connect
from ._errors import (
    AccumulatorError,
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from ._keys import SCHEMA_VERSION, Keys
from ._stream import ClaimReader, Source, write_parts

logger = logging.getLogger("accumulator")

#: Seconds between two looks at a take's ``cancel`` event while it waits.
CANCEL_SLICE = 0.1

_A = TypeVar("_A", bound="AccumulatorBase")
_T = TypeVar("_T")

#: Payloads up to this size travel inside the apply script call (one round trip); larger ones
#: are written in parts of one chunk each (``_chunks``), with plain SETs in the same pipeline
#: (no copy through Lua).
INLINE_MAX_BYTES = 32 * 1024
#: How long a waiting taker's place in the FIFO survives without renewal (a crashed taker
#: blocks the takers behind it at most this long). Renewed every WAIT_SLICE.
TAKER_LEASE_SECONDS = 6.0
#: A payload written by an apply that never reached its script expires after this.
ORPHAN_TTL_MS = 3600 * 1000
#: How long Redis remembers a client's last apply, to answer a retried one again.
DEDUP_TTL_MS = 600 * 1000
#: A claim is leased to its taker for this long, plus CLAIM_LEASE_MS_PER_MIB
#: per MiB of payload, while it reads and reduces the round; past that the taker is taken for
#: gone and the next take hands its round over (nothing is lost with a crashed chief).
CLAIM_LEASE_MS = 5 * 1000
CLAIM_LEASE_MS_PER_MIB = 50  # 20 MiB/s: far below loopback or LAN speed
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
_policy_checked: set[tuple[Any, ...]] = set()

_REDUCTIONS = ("MEAN", "SUM")


@dataclass(frozen=True)
class Claim:
    """A round a take claimed: the new global step, the round shape, the payload bytes it
    holds, and a reader of its payloads (in apply order)."""

    step: int
    count: int
    round_shape: tuple[int, ...] | None
    nbytes: int
    reader: ClaimReader

    @property
    def payloads(self) -> list[bytes]:
        """Every gradient's whole payload (read now)."""
        return self.reader.payloads()


def _parse_header(raw: bytes) -> tuple[int, int, int, tuple[int, ...] | None]:
    """(step, count, bytes, round shape) of a claim header ``"<step> <count> <bytes> <gen>
    <0|1> <shape>"``."""
    parts = raw.decode().split(" ", 5)
    if len(parts) != 6:
        raise AccumulatorError(f"unreadable claim header {raw[:100]!r}")
    shape = parse_shape_token(parts[5]) if parts[4] == "1" else None
    return int(parts[0]), int(parts[1]), int(parts[2]), shape


def leave(client: redis.Redis, keys: Keys, taker: str) -> int:
    """Run ``lua/leave.lua`` for one taker: withdraw it from the FIFO and give back a round it
    claimed. Returns 0 (it held no claim), 1 (given back) or -1 (the accumulator moved on:
    the round is handed to the next take instead)."""
    return int(
        _scripts.call(
            client, "leave",
            [keys.state, keys.takers, keys.taker_info, keys.wake, keys.queue_wake,
             keys.claim(taker), keys.grads, keys.claims],
            [taker, SCHEMA_VERSION],
        )
    )  # fmt: skip


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


def _warn_if_evicting(client: redis.Redis) -> None:
    """Log a warning (once per server and process) when Redis may evict our keys."""
    kwargs = client.connection_pool.connection_kwargs
    where = (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"), kwargs.get("db"))
    if where in _policy_checked:
        return
    _policy_checked.add(where)
    try:
        policy = str(client.info("memory").get("maxmemory_policy", ""))
    except Exception:  # noqa: BLE001 - no INFO (ACL, fakeredis, managed service): cannot tell
        return
    if policy not in _SAFE_POLICIES:
        logger.warning(
            "Redis maxmemory-policy is %r: at the memory limit Redis may evict accumulator "
            "keys (pending gradients, retry records), losing gradients or counting a retried "
            "apply twice; use 'noeviction' (see the README, 'Memory and eviction')",
            policy,
        )


class _ClientState(threading.local):
    """Per-thread apply identity: retries are recognised by (client id, sequence number)."""

    def __init__(self) -> None:
        self.client_id = uuid.uuid4().hex[:16]
        self.seq = 0


def _delete_keys(conns: Connections, keys: Keys) -> None:
    try:
        names = list(conns.commands.scan_iter(match=keys.pattern, count=1000))
        if names:
            conns.commands.unlink(*names)
    except Exception:  # noqa: BLE001 - best effort at close/finalize time
        logger.debug("could not delete private accumulator %s", keys.base, exc_info=True)
    finally:
        conns.close()


class AccumulatorBase:
    """Common state and operations; not instantiated directly."""

    _kind = ""
    #: Tuning knobs, per object so that tests (and unusual deployments) can shorten them.
    wait_slice: float = WAIT_SLICE
    taker_lease: float = TAKER_LEASE_SECONDS
    #: Seconds (plus CLAIM_LEASE_MS_PER_MIB per MiB) a claimed round stays this taker's while
    #: it reads and reduces it; past that, if another taker comes, the round is handed over.
    claim_lease: float | None = None  # None: CLAIM_LEASE_MS
    #: Seconds an operation rides through an unreachable Redis (a restart, a failover, killed
    #: connections) before raising :class:`UnavailableError`; retried applies count once.
    retry_window: float = _retry.RETRY_WINDOW

    def __init__(
        self,
        dtype: Any,
        shape: Any,
        shared_name: str | None,
        name: str | None,
        reduction_type: str,
        *,
        client: redis.Redis | str | None = None,
        container: str = "",
        max_pending_bytes: int | None = None,
        sum_in_redis: bool | None = None,
    ) -> None:
        container = _check_name("" if container is None else container, "container")
        if sum_in_redis not in (None, True, False):
            raise InvalidArgumentError(
                f"sum_in_redis must be True, False or None (decide from the server), got "
                f"{sum_in_redis!r}"
            )
        self._want_sum = sum_in_redis
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
            or max_pending_bytes < 1
        ):
            raise InvalidArgumentError(
                f"max_pending_bytes must be a positive integer or None, got {max_pending_bytes!r}"
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
        self._shared_name = shared_name or f"__private__/{uuid.uuid4().hex}"
        self._container = container
        self._keys = Keys(self._container, self._shared_name)
        self._conns = connect(client)
        self._local = _ClientState()
        self._closed = False
        # connections of waits in progress: close() from another thread breaks them (the
        # pools are shared with other accumulators and stay open)
        self._waits: set[Any] = set()
        self._waits_lock = threading.Lock()
        try:
            self._open()
        except BaseException:
            self._conns.close()  # its share of the pools
            raise
        self._finalizer = (
            weakref.finalize(self, _delete_keys, self._conns, self._keys)
            if self._private
            else weakref.finalize(self, self._conns.close)
        )

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
    def redis(self) -> redis.Redis:
        """The client this accumulator sends its commands through."""
        return self._conns.commands

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self._shared_name!r} {self.dtype.name} "
            f"{format_shape(self.shape)} {self.reduction_type}>"
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def _io(self, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` retried through transient Redis faults for :attr:`retry_window` seconds."""
        return _retry.call(
            fn, f"{what} {self._shared_name!r}", window=self.retry_window,
            give_up=lambda: self._closed,
        )  # fmt: skip

    def _open(self) -> None:
        ttl = PRIVATE_TTL_MS if self._private else 0
        commands = self._conns.commands
        limit = self._max_pending or DEFAULT_MAX_PENDING_BYTES
        explicit = 0 if self._max_pending is None else 1

        def open_() -> Any:
            _scripts.load_all(commands)
            return _scripts.call(
                commands, "open", [self._keys.state],
                [SCHEMA_VERSION, self._definition.pack(), ttl, int(limit), explicit,
                 self._sum_dtype_for_new()],
            )  # fmt: skip

        created, existing, summed = self._io("open", open_)
        #: the accsum module's dtype when this accumulator keeps its sums in Redis
        self._sum_dtype = summed.decode() if isinstance(summed, bytes) else (summed or "")
        if self._want_sum and not self._sum_dtype:
            logger.warning(
                "accumulator %r exists and sums on the taker: sum_in_redis=True applies only "
                "when an accumulator is created", self._shared_name,
            )  # fmt: skip
        _warn_if_evicting(commands)
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

    def _sum_dtype_for_new(self) -> str:
        """The accsum module's dtype when a new accumulator is to keep its sums in Redis: a
        dense one of a dtype the module adds, on a server that runs the module (or as
        ``sum_in_redis`` says); else ''."""
        if self._want_sum is False or self._kind != "dense":
            return ""
        name = _module.module_dtype(self.dtype)
        if self._want_sum is None:  # the server decides
            if name is None or not _module.server_has_module(self._conns.commands):
                return ""
            return name
        if name is None:
            raise InvalidArgumentError(
                f"sum_in_redis=True: the accsum module does not add {self.dtype.name} "
                "(float32/64 and integer dtypes only)"
            )
        if not _module.server_has_module(self._conns.commands):
            raise UnavailableError(
                "sum_in_redis=True, but the Redis server does not run the accsum module (see "
                "the README's 'Redis module' section)"
            )
        return name

    @property
    def sums_in_redis(self) -> bool:
        """Whether this accumulator keeps each round's running sum inside Redis (the accsum
        module; decided when the accumulator was created), rather than its taker summing."""
        return bool(self._sum_dtype)

    def close(self) -> None:
        """Release connections; a private accumulator's keys are deleted. A take waiting in
        another thread raises :class:`CancelledError`."""
        self._closed = True
        with self._waits_lock:
            waits = list(self._waits)
        for wait in waits:
            conn = wait.connection if isinstance(wait, PubSub) else wait
            try:
                if conn is not None:
                    conn.disconnect()
            except Exception:  # noqa: BLE001 - fakeredis's socket refuses a second thread
                logger.debug("could not cut a wait of %s", self._keys.base, exc_info=True)
        self._finalizer()

    def __enter__(self: _A) -> _A:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CancelledError("the accumulator was closed")

    # -- simple state -------------------------------------------------------------------------

    def _read_state(self, *fields: str) -> list[bytes | None]:
        self._check_open()
        values = cast(
            "list[bytes | None]",
            self._io(
                "read", lambda: self._conns.commands.hmget(self._keys.state, ["schema", *fields])
            ),
        )
        if values[0] is None:
            raise NotFoundError(f"accumulator {self._shared_name!r} does not exist")
        return values[1:]

    def num_accumulated(self, name: str | None = None) -> int:
        """Number of gradients accepted since the last successful take."""
        return int(self._read_state("count")[0] or 0)

    def global_step(self) -> int:
        """The accumulator's current global step (TF has no way to read it)."""
        return int(self._read_state("step")[0] or 0)

    def set_global_step(self, new_global_step: Any, name: str | None = None) -> None:
        """Set the global step, also downwards (with a warning); never clears the round."""
        self._check_open()
        new = scalar_int(new_global_step, "new_global_step")
        old = int(
            self._io("set_global_step", lambda: _scripts.call(
                self._conns.commands, "set_step", [self._keys.state], [SCHEMA_VERSION, new]))
        )  # fmt: skip
        if new < old:
            logger.warning(
                "Attempt to set current_global_step_ to smaller value: "
                "current_global_step_ = %d >= %d = new_global_step.",
                old, new,
            )  # fmt: skip

    # -- apply --------------------------------------------------------------------------------

    def _apply(
        self, arr: np.ndarray, shape_token: str, local_step: int, first_error: str = ""
    ) -> tuple[int, Any]:
        """Send one payload; returns (code, detail): 1 accepted, 0 stale, -1 round-shape
        mismatch (detail = the round's shape token), -2 ``first_error`` applied because the
        gradient would have opened the round."""
        self._check_open()
        payload = to_payload(arr)
        nbytes = payload.nbytes
        if nbytes > MAX_PAYLOAD_BYTES:
            raise InvalidArgumentError(
                f"gradient of {nbytes} bytes exceeds the {MAX_PAYLOAD_BYTES} byte limit of one "
                "payload; split the parameter into several accumulators"
            )
        state = self._local
        state.seq += 1
        cid, seq = state.client_id, state.seq
        k = self._keys
        blob = k.blob(cid, seq)
        keys = [k.state, k.grads, k.dedup(cid), k.takers, k.taker_info, k.wake, blob]
        inline = nbytes <= INLINE_MAX_BYTES
        args = [SCHEMA_VERSION, seq, local_step, shape_token, "i" if inline else "p",
                b"i" + payload if inline else b"", nbytes, DEDUP_TTL_MS, first_error]  # fmt: skip
        commands = self._conns.commands

        def send() -> Any:
            # Every attempt sends the same (client id, seq): the script answers a retry of an
            # apply it already counted without counting it again.
            if inline:
                return _scripts.call(commands, "apply", keys, args)
            pipe = commands.pipeline(transaction=False)
            # The parts, each one chunk, straight from the caller's buffer (memoryview
            # slices: no copy). NX: a retry must not re-arm the orphan expiry of a payload
            # already accepted.
            parts = [k.part(blob, i) for i in range(_chunks.n_parts(nbytes))]
            write_parts(pipe, parts, payload, nx=True, px=ORPHAN_TTL_MS)
            pipe.execute_command(*_scripts.evalsha_args("apply", keys, args))
            *stored, reply = pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError):
                reply = _scripts.call(commands, "apply", keys, args)
            for result in (*stored, reply):  # a part's refusal (OOM, ACL) explains best
                if isinstance(result, ResponseError):
                    raise _scripts.translate(result)
                if isinstance(result, Exception):
                    raise result
            return reply

        reply = self._io("apply_grad", send)
        code = int(reply[0])
        # parts left to fold into the sum in Redis; a retry's answer does not say: look
        if code == 1 and not inline and self._sum_dtype and (
            len(reply) > 4 and int(reply[4]) or int(reply[3])
        ):
            self._fold(blob)
        if code == -3:
            raise ResourceExhaustedError(
                f"accumulator {self._shared_name!r}: a gradient of {nbytes} bytes would take "
                f"the pending round past its max_pending_bytes={int(reply[4])}; nothing was "
                "applied (take the round, or open the accumulator with a larger limit)"
            )
        if code < 0:
            return code, reply[4]
        if code == 0:
            logger.debug(
                "dropped stale gradient for %r: local_step %d < global_step %d",
                self._shared_name, local_step, int(reply[1]),
            )  # fmt: skip
        return code, None

    def _fold(self, blob: str) -> None:
        """Add the rest of an accepted gradient into the round's sum in Redis, a few parts per
        script (lua/fold.lua), so that other clients are served in between. The apply is
        already counted: a failure here is logged, not raised (the taker reads the parts
        not folded in yet), and a retried call folds nothing twice."""
        keys = [self._keys.state, self._keys.grads]
        args = [SCHEMA_VERSION, blob, _chunks.FOLD_PARTS]
        commands = self._conns.commands
        try:
            while int(self._io("apply_grad (folding)",
                               lambda: _scripts.call(commands, "fold", keys, args))):  # fmt: skip
                pass
        except Exception:  # noqa: BLE001 - the gradient is applied; folding only saves memory
            logger.warning(
                "apply_grad on %r: the gradient is applied, but adding it into the sum kept in "
                "Redis stopped; the taker reads the rest of it as it is",
                self._shared_name, exc_info=True,
            )  # fmt: skip

    # -- take ---------------------------------------------------------------------------------

    def _take(
        self,
        num_required: Any,
        timeout: Any,
        decode: Callable[[Claim], _T],
        cancel: threading.Event | None = None,
    ) -> _T:
        """Wait for and claim a round, then read it and ``decode`` it. If anything fails
        after the claim (reading, decoding, reducing, an interrupt, ``cancel`` set), the round
        is given back: a take that raises leaves the step as it was."""
        self._check_open()
        if cancel is not None and not callable(getattr(cancel, "is_set", None)):
            raise InvalidArgumentError(
                f"cancel must be a threading.Event (or None), not {type(cancel).__name__}"
            )
        n = scalar_int(num_required, "num_required")
        if n < 1:
            raise InvalidArgumentError(f"Argument num_required must be positive, but was {n}")
        if n > 2**31 - 1:  # TF's num_required is an int32
            raise InvalidArgumentError(f"num_required must fit in int32, got {n}")
        if timeout is not None:
            if (
                isinstance(timeout, (bool, np.bool_))
                or not isinstance(timeout, Real)
                or (isinstance(timeout, np.generic) and timeout.dtype.kind not in "iuf")
            ):
                raise InvalidArgumentError(
                    f"timeout must be a number of seconds or None, got {timeout!r}"
                )
            timeout = float(timeout)
            if not 0 <= timeout < math.inf:
                raise InvalidArgumentError(
                    f"timeout must be a finite number >= 0 or None, got {timeout!r}"
                )
        k = self._keys
        taker = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        claim_key = k.claim(taker)
        take_keys, take_args = self._take_script_args(taker, n, int(self.taker_lease * 1000))
        deadline = None if timeout is None else time.monotonic() + timeout
        commands, blocking = self._conns.commands, self._conns.blocking
        queue: redis.client.PubSub | None = None  # while queued behind another taker
        try:
            while True:
                if self._closed:  # closed by another thread: never claim after close()
                    raise CancelledError("the accumulator was closed while waiting")
                if cancel is not None and cancel.is_set():
                    raise CancelledError("take_grad was cancelled (its cancel event is set)")
                reply = self._io(
                    "take_grad", lambda: _scripts.call(commands, "take", take_keys, take_args)
                )
                if len(reply) > 2 and int(reply[2] or 0):
                    logger.warning(
                        "take_grad on %r quarantined %d corrupt gradient entries (foreign key "
                        "names, missing or resized payloads); see `accumulator show`",
                        self._shared_name, int(reply[2]),
                    )  # fmt: skip
                if int(reply[0]) == 1:
                    entries = reply[1]
                    if len(reply) > 3 and int(reply[3] or 0):
                        step, count, _, _ = _parse_header(entries[0])
                        logger.warning(
                            "take_grad on %r took over a round claimed by a taker that is "
                            "gone (its claim lease ran out): step %d, %d gradients",
                            self._shared_name, step, count,
                        )  # fmt: skip
                    break
                wait = self.wait_slice if cancel is None else min(self.wait_slice, CANCEL_SLICE)
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise DeadlineExceededError(self._timeout_message(n, timeout))
                # Wake-ups are hints: the take script re-checks after every one.
                if int(reply[1]) == 1:
                    # At the head: one persistent token on a list, pushed by the apply that
                    # makes the round big enough (only the head consumes it).
                    if queue is not None:
                        self._drop_queue(queue)
                        queue = None
                    self._wait(self._blpop, blocking, k.wake, max(wait, 0.001))
                elif queue is None:
                    # Queued: a head change is broadcast. Subscribe, then re-check at once,
                    # so that a change between the check and the subscription is not missed.
                    queue = blocking.pubsub(ignore_subscribe_messages=True)
                    with self._waits_lock:
                        self._waits.add(queue)
                    if not self._wait(queue.subscribe, k.queue_wake):
                        self._drop_queue(queue)
                        queue = None
                elif not self._wait(queue.get_message, timeout=max(wait, 0.001)):
                    self._drop_queue(queue)
                    queue = None
            claim, blob_keys = self._read_claim(entries, claim_key)
            try:
                result = decode(claim)  # reads the payloads as it goes
            except AccumulatorError as exc:
                if self._io("take_grad", lambda: commands.exists(claim_key)):
                    raise
                raise AccumulatorError(self._taken_over_message()) from exc
            if cancel is not None and cancel.is_set():  # the last moment to give it back
                raise CancelledError("take_grad was cancelled (its cancel event is set)")
            self._finish(taker, claim_key, blob_keys)
        except BaseException:
            # Not claimed: withdraw from the FIFO. Claimed (or unsure: a lost reply), the
            # script gives the round back as it was.
            self._leave(taker, claim_key)
            raise
        finally:
            if queue is not None:
                self._drop_queue(queue)
        return result

    def _drop_queue(self, queue: PubSub) -> None:
        with self._waits_lock:
            self._waits.discard(queue)
        queue.close()

    def _blpop(self, blocking: Any, key: str, timeout: float) -> None:
        """BLPOP on a connection this accumulator holds for the wait, so that close() from
        another thread can break it."""
        pool = blocking.connection_pool
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py before 5.3 wants the command name
            conn = pool.get_connection("BLPOP")
        if type(conn).__module__.startswith("fakeredis"):
            # in-process: its connection cannot be cut from another thread; short slices
            # let close() end the wait instead
            timeout = min(timeout, 0.1)
        with self._waits_lock:
            self._waits.add(conn)
        done = False
        try:
            conn.send_command("BLPOP", key, timeout)
            conn.read_response()
            done = True
        finally:
            with self._waits_lock:
                self._waits.discard(conn)
            if not done:  # a reply may still be on its way: never reuse the connection
                conn.disconnect()
            pool.release(conn)

    def _finish(self, taker: str, claim_key: str, blob_keys: list[bytes]) -> None:
        """The round is read and reduced: release its lease and free its keys. Raises when
        the lease had run out and another taker took the round over (the caller must not
        return it then: it would be counted twice)."""
        k = self._keys
        keys: list[str | bytes] = [k.state, claim_key, k.claims, k.finished, *blob_keys]
        ours = self._io("take_grad (finishing)", lambda: _scripts.call(
            self._conns.commands, "finish", keys, [taker]))  # fmt: skip
        if not int(ours):
            raise AccumulatorError(self._taken_over_message())

    def _taken_over_message(self) -> str:
        return (
            f"take_grad on {self._shared_name!r} read its round after its claim lease ran "
            "out, and another taker took the round over; this take returns nothing"
        )

    def _timeout_message(self, n: int, timeout: float) -> str:
        """TF's text, then what was there: which accumulator, how many of how many, when."""
        where = repr(self._shared_name)
        if self._container:
            where += f" in container {self._container!r}"
        try:
            count, step = self._conns.commands.hmget(self._keys.state, ["count", "step"])
            have = f"{int(count or 0)} of {n} gradients at global step {int(step or 0)}"
        except Exception:  # noqa: BLE001 - the message must not fail
            have = f"fewer than {n} gradients"
        return (
            f"Timed out waiting for notification: take_grad({n}) on accumulator {where} had "
            f"{have} after {timeout:g}s"
        )

    def _take_script_args(self, taker: str, n: int, lease_ms: int) -> tuple[list[Any], list[Any]]:
        """KEYS and ARGV of the take script (see lua/take.lua)."""
        k = self._keys
        keys = [k.state, k.grads, k.takers, k.taker_info, k.claim(taker), k.wake, k.queue_wake,
                k.quarantine, k.claims]  # fmt: skip
        args = [SCHEMA_VERSION, taker, n, lease_ms,
                "s" if self._kind == "sparse" else "d", self.dtype.itemsize,
                CLAIM_LEASE_MS if self.claim_lease is None else int(self.claim_lease * 1000),
                CLAIM_LEASE_MS_PER_MIB]  # fmt: skip
        return keys, args

    def _wait(self, block: Any, *args: Any, **kwargs: Any) -> bool:
        """One bounded wait; False when its connection failed (the caller re-checks: the take
        script rides out the fault). close() from another thread breaks it (CancelledError)."""
        try:
            block(*args, **kwargs)
            return True
        except Exception as exc:
            if self._closed:  # its connection was cut under it (whatever redis-py raises then)
                raise CancelledError("the accumulator was closed while waiting") from None
            if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
                raise
            logger.debug("wait on %s interrupted: %s", self._keys.base, exc)
            time.sleep(0.05)  # a refused reconnect fails at once: do not spin
            return False

    def _leave(self, taker: str, claim_key: str) -> None:
        k = self._keys
        try:
            outcome = self._io("leave", lambda: leave(self._conns.commands, k, taker))
        except Exception:  # noqa: BLE001 - the lease expires on its own if Redis is unreachable
            logger.warning("could not withdraw taker %s from %s", taker, k.base, exc_info=True)
            return
        if outcome == 1:
            logger.info("an interrupted take of %r gave its claimed round back", self._shared_name)
        elif outcome < 0:
            logger.error(
                "an interrupted take of %r had claimed a round that cannot be given back (the "
                "accumulator changed since); its gradients are kept in Redis under %s",
                self._shared_name, claim_key,
            )  # fmt: skip

    def _read_claim(self, entries: list[bytes], claim_key: str) -> tuple[Claim, list[bytes]]:
        """The claimed round (its payloads are read on demand, in chunks), and the payload keys
        it names (to free once used)."""
        step, count, nbytes, round_shape = _parse_header(entries[0])
        sources: list[Source] = []
        for entry in entries[1:]:
            keys = self._keys.entry_keys(entry)
            if keys is None:  # the take script checked every entry: this is not ours to follow
                raise AccumulatorError(f"corrupt entry in claim {claim_key}: {entry[:100]!r}")
            if entry[:1] == b"i":
                sources.append(entry[1:])
            else:  # a gradient being folded into the sum holds its parts from k on
                sources.append([None] * self._keys.entry_first_part(entry) + list(keys))
        # count (the header's) is the number of gradients: a sum kept in Redis holds several
        reader = ClaimReader(self._conns.commands, self._io, sources, claim_key)
        return Claim(step, count, round_shape, nbytes, reader), reader.keys
