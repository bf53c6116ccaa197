"""The take protocol, written once for every driver (sans-I/O: generators of ``_requests``;
see that module).

The take script either claims a round or places the taker in the FIFO, which then waits
(BLPOP at the head, a subscription behind it) in bounded slices; the claimed round is read and
decoded, and the finish script keeps it. Anything that fails after the claim gives the round
back (the leave script).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from numbers import Real
from typing import Any, Protocol, TypeVar

import numpy as np

from . import _chunks, _model, _scripts
from ._apply import committed, definite, discard, sweep
from ._claim import Claim, claim_lease_ms, parse_header, read_claim
from ._codec import scalar_int
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
from ._model import AccumulatorModel
from ._requests import Batch, Call, Command, Listen, Ops, Pop, Subscribe, Unsubscribe

logger = logging.getLogger("accumulator")

#: Seconds between two looks at a take's ``cancel`` event while it waits.
CANCEL_SLICE = 0.1

_T = TypeVar("_T")


class Cancel(Protocol):
    """What a take's ``cancel`` is: a ``threading.Event``, or anything with its ``is_set``."""

    def is_set(self) -> bool:
        """Whether the take must stop."""
        ...


def leave_call(keys: Keys, taker: str, schema: int = SCHEMA_VERSION,
               window: float | None = None) -> Call:  # fmt: skip
    """The ``lua/leave.lua`` call for one taker: withdraw it from the FIFO and give back a
    round it claimed. Its reply: 0 (it held no claim), 1 (given back) or -1 (the accumulator
    moved on: the round is handed to the next take instead). ``window``: as :class:`Call`'s."""
    return Call(
        "leave", "leave",
        [keys.state, keys.takers, keys.taker_info, keys.wake, keys.queue_wake,
         keys.claim(taker), keys.grads, keys.claims],
        [taker, schema], commit=True, window=window,
    )  # fmt: skip



def check_take_args(num_required: Any, timeout: Any) -> tuple[int, float | None]:
    """``num_required`` and ``timeout`` checked as TF (and our documentation) say."""
    n = scalar_int(num_required, "num_required", bits=32)  # (TF's is an int32)
    if n < 1:
        raise InvalidArgumentError(f"Argument num_required must be positive, but was {n}")
    if timeout is None:
        return n, None
    if (
        isinstance(timeout, (bool, np.bool_))
        or not isinstance(timeout, Real)
        or (isinstance(timeout, np.generic) and timeout.dtype.kind not in "iuf")
    ):
        raise InvalidArgumentError(f"timeout must be a number of seconds or None, got {timeout!r}")
    seconds = float(timeout)
    if not 0 <= seconds < math.inf:
        raise InvalidArgumentError(
            f"timeout must be a finite number >= 0 or None, got {timeout!r}"
        )
    return n, seconds


def take(
    acc: AccumulatorModel,
    num_required: Any,
    timeout: Any,
    decode: Callable[[Claim], Ops[_T]],
    cancel: Cancel | None = None,
) -> Ops[_T]:
    """Wait for and claim a round, then read it and ``decode`` it. If anything fails
    after the claim (reading, decoding, reducing, an interrupt, ``cancel`` set), the round
    is given back: a take that raises leaves the step as it was."""
    acc._check_open()
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise InvalidArgumentError(
            f"cancel must be a threading.Event (or None), not {type(cancel).__name__}"
        )
    n, seconds = check_take_args(num_required, timeout)
    k = acc._keys
    while acc._unwithdrawn:  # (this object's takes whose withdraw failed)
        try:
            earlier = acc._unwithdrawn.pop()  # (atomic: another take may withdraw it first)
        except IndexError:
            break
        yield from _leave(acc, earlier, k.claim(earlier), once=True)
    taker = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    claim_key = k.claim(taker)
    lease_ms = int(acc.taker_lease * 1000)
    take_call = Call("take_grad", "take", *take_script_args(acc, taker, n, lease_ms))
    checked: dict[bytes, bytes] = {}  # spread entries' lengths (or why unusable), as found
    deadline = None if seconds is None else time.monotonic() + seconds
    queue: Any = None  # a subscription, while queued behind another taker
    reply: Any = None  # the take script's, when the driver made it right after a wait
    full = ""  # Redis refused the take script at maxmemory (what it said), while waiting
    try:
        while True:
            # (a round claimed right after a wait is given back by the cleanup below)
            if acc._closed:  # closed by another thread: never claim after close()
                raise CancelledError("the accumulator was closed while waiting")
            if cancel is not None and cancel.is_set():
                raise CancelledError("take_grad was cancelled (its cancel event is set)")
            if reply is None:
                try:
                    reply = yield take_call
                except ResourceExhaustedError as exc:
                    # Redis at maxmemory (briefly, often: a large apply's parts refused): a
                    # take waits it out, as it waits for gradients; nothing was changed
                    full = full or _at_maxmemory(acc, exc)
                    wait = _wait_slice(acc, cancel, deadline)
                    if wait <= 0:
                        raise (yield from _timed_out(acc, n, seconds, full)) from exc
                    # a wait on a list nobody pushes (not the head's wake list: a taker
                    # behind it would take its wake-up)
                    yield Pop(k.idle, max(wait, 0.001), until=deadline)
                    continue
            if int(reply[0]) == 2:  # spread entries to check before the script may claim
                checked.update((yield from _check_spread(acc, reply[1])))
                take_call = Call("take_grad", "take",
                                 *take_script_args(acc, taker, n, lease_ms, checked))  # fmt: skip
                reply = None
                continue
            if len(reply) > 2 and int(reply[2] or 0):
                logger.warning(
                    "take_grad on %r quarantined %d corrupt gradient entries (foreign key "
                    "names, missing, resized or lost payloads); see `accumulator show`",
                    acc._shared_name, int(reply[2]),
                )  # fmt: skip
                if acc.spreads_parts:  # their parts are garbage now
                    yield from sweep(acc)
            if int(reply[0]) == 1:
                entries = reply[1]
                if len(reply) > 3 and int(reply[3] or 0):
                    step, count, _, _ = parse_header(entries[0])
                    logger.warning(
                        "take_grad on %r took over a round claimed by a taker that is "
                        "gone (its claim lease ran out): step %d, %d gradients",
                        acc._shared_name, step, count,
                    )  # fmt: skip
                break
            wait = _wait_slice(acc, cancel, deadline)
            if wait <= 0:
                raise (yield from _timed_out(acc, n, seconds, full))
            # Wake-ups are hints: the take script re-checks after every one.
            at_head, reply = int(reply[1]) == 1, None
            if at_head:
                # At the head: one persistent token on a list, pushed by the apply that
                # makes the round big enough (only the head consumes it). The re-check may
                # ride behind the wait: one round trip from the wake-up to the claim.
                if queue is not None:
                    yield Unsubscribe(queue)
                    queue = None
                try:
                    reply = yield Pop(k.wake, max(wait, 0.001), then=take_call, until=deadline)
                except ResourceExhaustedError as exc:
                    full = full or _at_maxmemory(acc, exc)  # (the call again, at the top)
            elif queue is None:
                # Queued: a head change is broadcast. Subscribe, then re-check at once,
                # so that a change between the check and the subscription is not missed.
                queue = yield Subscribe(k.queue_wake)
            elif not (yield Listen(queue, max(wait, 0.001), until=deadline)):
                yield Unsubscribe(queue)
                queue = None
        claim = read_claim(acc, entries, taker, reply[4] if len(reply) > 4 else None)
        acc._claimed_step = claim.step
        try:
            result = yield from decode(claim)  # reads the payloads as it goes
        except AccumulatorError as exc:
            if (yield Command("take_grad", ("EXISTS", claim_key))):
                raise
            raise (yield from _claim_lost(acc, claim.step)) from exc
        if cancel is not None and cancel.is_set():  # the last moment to give it back
            raise CancelledError("take_grad was cancelled (its cancel event is set)")
        yield from _settled_finish(acc, taker, claim_key, claim.reader.keys, claim.step)
    except BaseException as exc:
        # Not claimed: withdraw from the FIFO. Claimed (or unsure: a lost reply), the
        # script gives the round back as it was. After Redis was unreachable for the whole
        # retry window: one try, not another window (the lease runs out on its own), so
        # that the take's error comes when the window says.
        yield from _leave(acc, taker, claim_key, once=isinstance(exc, UnavailableError))
        raise
    finally:
        if queue is not None:
            yield Unsubscribe(queue)
    return result


#: A finish interrupted more often than this raises the first interrupt (the round's fate
#: unknown, as when Redis does not answer): what keeps coming is a fault, not a user.
MAX_FINISH_INTERRUPTS = 16

#: At most this many takers whose withdraw failed an object keeps, to withdraw at its next take.
MAX_UNWITHDRAWN = 16


def _wait_slice(acc: AccumulatorModel, cancel: Cancel | None, deadline: float | None) -> float:
    """Seconds a take waits before it looks again: a slice (short with a ``cancel`` to look
    at), no further than its deadline (0 or less: the deadline passed)."""
    wait = acc.wait_slice if cancel is None else min(acc.wait_slice, CANCEL_SLICE)
    return wait if deadline is None else min(wait, deadline - time.monotonic())


def _timed_out(
    acc: AccumulatorModel, n: int, seconds: float | None, full: str
) -> Ops[DeadlineExceededError]:
    """The error of a take whose deadline passed (``full``: Redis was at maxmemory)."""
    message = yield from _timeout_message(acc, n, seconds or 0.0)
    return DeadlineExceededError(f"{message}; {full}" if full else message)


def _at_maxmemory(acc: AccumulatorModel, exc: ResourceExhaustedError) -> str:
    """Log that a take waits for Redis to be under maxmemory again; what to add to its
    timeout's message. ``exc`` is raised again unless it is Redis's OOM refusal."""
    if exc.reason != "OOM":
        raise exc
    logger.warning("take_grad on %r: Redis is out of memory (maxmemory): the take cannot "
                   "join the queue of takers; it waits on (%s)", acc._shared_name, exc)  # fmt: skip
    return "Redis was out of memory (maxmemory) meanwhile"


def _check_spread(acc: AccumulatorModel, entries: list[bytes]) -> Ops[dict[bytes, bytes]]:
    """Each spread entry's payload length, found by STRLEN of its parts (one pipeline per
    node), or why it cannot be read: ``missing``, ``part <i> length <n>``, ``part <i> not a
    string`` (the twin of ``entry_length`` in lua/_common.lua), ``foreign``."""
    found: dict[bytes, bytes] = {}
    wanted: list[tuple[bytes, list[bytes]]] = []
    for entry in entries:
        keys = acc._keys.entry_keys(entry) if Keys.is_spread(entry) else None
        if keys is None:
            found[entry] = b"foreign"
        else:
            wanted.append((entry, keys))
    commands = [("STRLEN", key) for _, keys in wanted for key in keys]
    batch = Batch("take_grad (checking)", commands, raise_on_error=False)
    lengths = iter((yield batch) if commands else ())
    for entry, keys in wanted:
        total, why = 0, b""
        for i in range(len(keys)):
            n = next(lengths)
            longest = _chunks.CHUNK_BYTES if len(keys) > 1 else _chunks.SOLE_PART_BYTES
            if isinstance(n, Exception):
                if "WRONGTYPE" not in str(n):
                    raise n  # (refused by the ACL, ...: nothing is quarantined for that)
                why, n = why or b"part %d not a string" % i, 0  # a value of another type
            elif n == 0:
                why = why or b"missing"
            elif n > longest or (i < len(keys) - 1 and n != _chunks.CHUNK_BYTES):
                why = why or b"part %d length %d" % (i, n)
            total += n
        found[entry] = why or b"%d" % total
    return found


def _settled_finish(
    acc: AccumulatorModel, taker: str, claim_key: str, blob_keys: list[bytes], step: int
) -> Ops[None]:
    """:func:`_finish`, until its outcome is known. A finish sent whose reply is lost (Redis
    unreachable past the retry window, or Ctrl-C while it was in flight) may have run: the
    round is then this take's and nobody else's, and giving up (the cleanup finds no claim to
    give back) lost every gradient of it (sparse review). It is asked again (a retried finish
    is answered for two minutes) for :data:`FINISH_SETTLE_SECONDS`; an interrupt that came
    meanwhile (any exception that is not the finish's answer) is held: the take returns its
    round, and the next call of this thread on the object raises it."""
    started = time.monotonic()
    held: BaseException | None = None
    interrupts = 0
    while True:
        try:
            yield from _finish(acc, taker, claim_key, blob_keys, step)
            break
        except UnavailableError as exc:
            if time.monotonic() - started >= _model.FINISH_SETTLE_SECONDS:
                unknown = UnavailableError(
                    f"take_grad on {acc._shared_name!r} could not learn, for "
                    f"{_model.FINISH_SETTLE_SECONDS:g}s, whether its finish ran: if it did, "
                    "the round is taken and lost with this error; if not, the next take "
                    f"takes it over ({exc})"
                )
                if held is not None:  # the interrupt held meanwhile is not dropped
                    unknown.__cause__ = exc
                    logger.error("%s", unknown)
                    raise held from unknown
                raise unknown from exc
            logger.warning("take_grad on %r: its finish may have run, Redis does not answer; "
                           "asking again", acc._shared_name)  # fmt: skip
        except BaseException as exc:
            if isinstance(exc, GeneratorExit) or definite(exc):
                # the finish's answer (the lease had run out, say), the step closed, or an
                # asyncio cancel (thrown in only before the finish is sent: the round goes back)
                raise
            # An interrupt: Ctrl-C, SystemExit from a SIGTERM handler, what a signal handler
            # raised (interrupt review: all but Ctrl-C lost the round)
            interrupts += 1
            if held is not None and interrupts > MAX_FINISH_INTERRUPTS:
                raise held from exc  # (not an interrupt, then: a fault of its own)
            held = held or exc
            logger.warning("take_grad on %r: interrupted (%s) while its finish was in flight: "
                           "it completes first (the round is returned; this thread's next call "
                           "on the accumulator raises the interrupt)", acc._shared_name,
                           type(exc).__name__)  # fmt: skip
    if held is not None:
        acc._held_interrupts[threading.get_ident()] = held


def _finish(
    acc: AccumulatorModel, taker: str, claim_key: str, blob_keys: list[bytes], step: int
) -> Ops[None]:
    """The round, claimed at ``step``, is read and reduced: release its lease and free its
    keys. Raises when the lease had run out and another taker took the round over (the caller
    must not return it then: it would be counted twice)."""
    k = acc._keys
    # spread parts (other slots) are not the script's: it makes them garbage for us to sweep
    keys: list[str | bytes] = [k.state, claim_key, k.claims, k.finished, k.orphans,
                               *(key for key in blob_keys if k.is_blob(key))]  # fmt: skip
    durability = acc._durability()
    what = "take_grad (finishing)"
    acked = None
    args = [taker, "1" if acc.spreads_parts else "0"]
    if durability is None:
        ours = yield Call(what, "finish", keys, args, commit=True)
    else:
        finish = tuple(_scripts.evalsha_args("finish", keys, args))
        replies = yield from committed(what, [finish], durability, k.state)
        ours, acked = replies[0], replies.acked
    garbage: list[bytes] = []
    if isinstance(ours, list):  # (1, the spread payloads' garbage, leased to this taker)
        ours, garbage = ours
    if not int(ours):  # taken over, or gone with the accumulator
        raise (yield from _claim_lost(acc, step))
    missing = durability.shortfall(acked) if durability is not None else None
    if missing and durability is not None:
        # the round is this take's now: returning it is right; a failover before the
        # replicas have the finish could hand it to another take as well
        logger.warning(
            "take_grad on %r: the round is taken, but %s of its finish did not come "
            "within %gs (a failover now could let another take take it again)",
            acc._shared_name, missing, durability.timeout,
        )  # fmt: skip
    if garbage:
        yield from discard(acc, list(garbage))


def _leave(acc: AccumulatorModel, taker: str, claim_key: str, once: bool = False) -> Ops[None]:
    try:
        outcome = int((yield leave_call(acc._keys, taker, acc._schema, 0 if once else None)))
    except Exception as exc:  # noqa: BLE001 - the lease expires on its own if Redis is unreachable
        # (unreachable: one line, the take's own error says the rest; else the traceback).
        # This object's next take withdraws it first: a wait queued when Redis froze may
        # have renewed its lease since, and a take behind it would wait that lease out.
        if len(acc._unwithdrawn) < MAX_UNWITHDRAWN:
            acc._unwithdrawn.append(taker)
        unreachable = isinstance(exc, ConnectionError)
        logger.warning("could not withdraw taker %s from %s%s", taker, acc._keys.base,
                       f" ({exc}); its lease expires on its own, or this object's next take "
                       "withdraws it" if unreachable else "",
                       exc_info=not unreachable)  # fmt: skip
        return
    if outcome == 1:
        logger.info("an interrupted take of %r gave its claimed round back", acc._shared_name)
    elif outcome < 0:
        logger.error(
            "an interrupted take of %r had claimed a round that cannot be given back (the "
            "accumulator changed since); its gradients are kept in Redis under %s",
            acc._shared_name, claim_key,
        )  # fmt: skip


def _claim_lost(acc: AccumulatorModel, step: int) -> Ops[AccumulatorError]:
    """What to raise when a take's claim, which advanced the step to ``step``, is gone while
    it read the round: taken over by another taker, gone with the whole accumulator (also:
    created again since), or the step is behind the claim's: Redis went back to before it
    (a restart from an older snapshot), or the round was given back (``accumulator evict``).
    The last two look alike in Redis: the take raises, and the message says both."""
    schema, inst, now = yield Command(
        "take_grad", ("HMGET", acc._keys.state, "schema", "inst", "step")
    )
    if schema is None:
        return NotFoundError(
            f"take_grad on {acc._shared_name!r}: the accumulator is gone while this take read "
            "its round (deleted, or Redis lost its data: restarted without persistence, or "
            "failed over); this take returns nothing"
        )
    if acc._recreated(inst):
        return NotFoundError(
            f"take_grad on {acc._shared_name!r}: the accumulator was deleted and created again "
            "while this take read its round; this take returns nothing"
        )
    if now is not None and int(now) < step:
        return AccumulatorError(
            f"take_grad on {acc._shared_name!r} lost the round it was reading, and the global "
            f"step is back at {int(now)}, behind its claim's {step}: an operator evicted this "
            "taker (`accumulator evict` gives its round back), or Redis went back to before "
            "the claim (restarted from an older RDB snapshot or AOF, or failed over to a "
            "replica behind it), or set_global_step moved the step back after another taker "
            "took the round over; the round is pending again unless a take took it since. "
            "This take returns nothing"
        )
    return AccumulatorError(_taken_over_message(acc))


def _taken_over_message(acc: AccumulatorModel) -> str:
    return (
        f"take_grad on {acc._shared_name!r} lost the round it was reading: its claim lease "
        "ran out and another taker took the round over, or an operator evicted this taker "
        "(`accumulator evict`); this take returns nothing"
    )


def _timeout_message(acc: AccumulatorModel, n: int, timeout: float) -> Ops[str]:
    """TF's text, then what was there: which accumulator, how many of how many, when."""
    where = repr(acc._shared_name)
    if acc._container:
        where += f" in container {acc._container!r}"
    claimed = ""
    try:
        count, step = yield Command("take_grad", ("HMGET", acc._keys.state, "count", "step"))
        have = f"{int(count or 0)} of {n} gradients at global step {int(step or 0)}"
        leases = yield Command("take_grad", ("HGETALL", acc._keys.claims))
        if leases:  # rounds other takers claimed and have not finished
            claimed = (
                f"; {len(leases)} round(s) claimed by other takers are not finished (a "
                "round whose taker's lease runs out goes to the next take requiring no more "
                "gradients than it holds; see `accumulator show`)"
            )
    except Exception:  # noqa: BLE001 - the message must not fail
        have = f"fewer than {n} gradients"
    return (
        f"Timed out waiting for notification: take_grad({n}) on accumulator {where} had "
        f"{have} after {round(timeout, 3):g}s{claimed}"
    )


def take_script_args(
    acc: AccumulatorModel, taker: str, n: int, lease_ms: int,
    checked: dict[bytes, bytes] | None = None,
) -> tuple[list[Any], list[Any]]:  # fmt: skip
    """KEYS and ARGV of the take script (see lua/take.lua); ``checked``: spread entries'
    lengths as :func:`_check_spread` found them."""
    k = acc._keys
    keys = [k.state, k.grads, k.takers, k.taker_info, k.claim(taker), k.wake, k.queue_wake,
            k.quarantine, k.claims, k.orphans]  # fmt: skip
    claim_ms = claim_lease_ms(acc)
    args = [acc._schema, taker, n, lease_ms, "s" if acc._kind == "sparse" else "d",
            acc.dtype.itemsize, claim_ms, _model.CLAIM_LEASE_MS_PER_MIB, acc._instance,
            len(checked or ())]  # fmt: skip
    for entry, found in (checked or {}).items():
        args += [entry, found]
    return keys, args


