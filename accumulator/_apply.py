"""The apply protocol, written once for every driver (sans-I/O: generators of ``_requests``;
see that module).

The payload's parts (SET NX, from the caller's buffer) and the apply script go in one
pipeline; on the module path the rest of a large gradient is then folded into the round's sum
a few parts per script. Also the commit batch (with its durability wait) and the sweep of
stranded payloads, which the take uses too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
from redis.exceptions import ResponseError

from . import _chunks, _identities, _model, _scripts
from ._codec import to_payload
from ._durability import Durability
from ._errors import (
    AccumulatorError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotDurableError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SchemaVersionError,
    UnavailableError,
)
from ._identities import DEDUP_TTL_MS
from ._model import AccumulatorModel
from ._requests import Batch, Call, Command, Ops

logger = logging.getLogger("accumulator")


def apply(
    acc: AccumulatorModel, arr: np.ndarray, shape_token: str, local_step: int,
    first_error: str = "",
) -> Ops[tuple[int, Any]]:  # fmt: skip
    """Send one payload; returns (code, detail): 1 accepted, 0 stale, -1 round-shape
    mismatch (detail = the round's shape token), -2 ``first_error`` applied because the
    gradient would have opened the round."""
    acc._check_open()
    payload = to_payload(arr)
    nbytes = payload.nbytes
    if nbytes > _model.MAX_PAYLOAD_BYTES:
        raise InvalidArgumentError(
            f"gradient of {nbytes} bytes exceeds the {_model.MAX_PAYLOAD_BYTES} byte limit of "
            "one payload; split the parameter into several accumulators"
        )
    key = _identities.ApplyKey(local_step, shape_token, first_error, nbytes)
    if acc._identities.holding:  # an earlier apply of unknown outcome: settled first
        yield from settle_held(acc)  # (raises, nothing sent, while Redis is unreachable)
        counted = acc._identities.outcome(key, lambda: _identities.apply_fingerprint(key, payload))
        if counted is not None:  # this is that apply, made again
            logger.info("apply_grad on %r: the apply of unknown outcome (UnavailableError, or "
                        "interrupted), made again: "
                        "%s", acc._shared_name, "it was counted, and is not sent again"
                        if counted else "it was not counted; sending it now")  # fmt: skip
            if counted:
                return 1, None
    ident = acc._identities.acquire()
    held = False
    spread = nbytes > _model.INLINE_MAX_BYTES and acc.spreads_parts
    try:
        try:
            sent = yield from _send(acc, payload, shape_token, local_step, first_error,
                                    ident.client_id, ident.seq)  # fmt: skip
        except ResourceExhaustedError as exc:
            if not (spread and exc.reason == "NOBLOB"):
                raise
            # The record of its parts is gone (a failover lost it, between it and the apply
            # script): once more, record, parts (NX: those there stay) and script, under the
            # same apply id (counted once).
            logger.info("apply_grad on %r: the record of the gradient's parts was lost; "
                        "sending it again", acc._shared_name)  # fmt: skip
            sent = yield from _send(acc, payload, shape_token, local_step, first_error,
                                    ident.client_id, ident.seq)  # fmt: skip
    except BaseException as exc:
        if isinstance(exc, UnavailableError):
            # Redis may still run the copy it received: the outcome is unknown. The identity
            # is held (see _identities.Identities): the object's next apply settles it first, and
            # the same apply made again is then counted once.
            held = True
            acc._identities.hold(ident, _identities.apply_fingerprint(key, payload), key)
        elif not definite(exc):
            # Interrupted (Ctrl-C, SystemExit from a SIGTERM handler, what a signal handler
            # raised) while the apply was in flight, or in the retry wait of a lost reply:
            # Redis may have counted it. Held and settled at once (parts deleted if not
            # counted; fenced: a copy Redis has yet to run is never counted), so that the
            # same apply made again is counted once (interrupt review: a retry counted it
            # twice). Closed mid-flight (GeneratorExit), no I/O: the next apply settles it.
            held = True
            acc._identities.hold(ident, _identities.apply_fingerprint(key, payload), key)
            if not isinstance(exc, GeneratorExit):
                yield from _settle_now(acc)
        elif nbytes > _model.INLINE_MAX_BYTES and not acc.spreads_parts:
            yield from _withdraw(acc, ident.client_id, ident.seq, nbytes)
        elif spread and isinstance(exc, _REFUSED):
            # refused by the apply script (or before it): nothing holds its parts, and
            # nothing would ever sweep them once their record is gone (no expiry of their own)
            yield from _drop_spread(acc, ident.client_id, ident.seq, nbytes)
        raise
    finally:
        if not held:
            acc._identities.release(ident)
    code = int(sent[0][0])
    try:
        return (yield from _complete(acc, nbytes, local_step, sent, code))
    except BaseException as exc:
        if code == 1 and not definite(exc):
            # counted, then interrupted (in the folds, say): the same apply made again is
            # answered as counted, not sent again
            acc._identities.remember(_identities.apply_fingerprint(key, payload), True, key)
        raise


def definite(exc: BaseException) -> bool:
    """Whether an exception raised where an apply's request was in flight says for sure what
    became of it: ours (refusals; :class:`UnavailableError` aside, whose outcome is unknown)
    and Redis's error replies. Anything else (an interrupt, what a signal handler raised, the
    step closed) came while Redis may have run the request. An asyncio cancel is thrown into a
    step only before its commit is sent (the asyncio driver never cuts one in flight)."""
    if isinstance(exc, UnavailableError):
        return False
    return isinstance(exc, AccumulatorError | ResponseError | asyncio.CancelledError)


def _settle_now(acc: AccumulatorModel) -> Ops[None]:
    """Settle the applies held, in one try (an interrupted caller is not kept waiting for a
    Redis that does not answer: they stay held, for the next apply to settle)."""
    try:
        yield from settle_held(acc, window=0.0)
    except Exception:  # noqa: BLE001 - the interrupt is what the caller gets
        logger.debug("apply_grad on %r: settling the interrupted apply failed; the next apply "
                     "settles it", acc._shared_name, exc_info=True)  # fmt: skip


def _complete(
    acc: AccumulatorModel, nbytes: int, local_step: int, sent: tuple[Any, ...], code: int
) -> Ops[tuple[int, Any]]:
    """What an apply does once its script answered: clean-up, the folds, the durability
    check; its (code, detail)."""
    reply, blob, inline, acked, garbage, rewritten = sent
    if garbage or (acc.spreads_parts and not inline and code != 1):
        # dropped (stale, refused: the script leased its parts to us) and what was swept
        mine = [] if code == 1 else [b"x" + acc._keys.spread_entry(blob, nbytes)]
        yield from discard(acc, [*mine, *garbage])
    if rewritten:
        yield from _unlink_rewritten(acc, rewritten)
    # parts left to fold into the sum in Redis; a retry's answer does not say: look
    if code == 1 and not inline and acc._sum_dtype and (
        len(reply) > 4 and int(reply[4]) or int(reply[3])
    ):
        yield from fold(acc, blob)
    durability = acc._durability()
    missing = None
    if durability and code == 1:
        missing = next(filter(None, (durability.shortfall(a) for a in acked)), None)
    if missing:
        raise NotDurableError(
            f"apply_grad on {acc._shared_name!r}: the gradient is applied on the primary, "
            f"but {missing} did not come within {acc.durability_timeout:g}s "
            "(a failover now could lose it). Do not apply it again: it is counted"
        )
    if code == -3:
        raise ResourceExhaustedError(
            f"accumulator {acc._shared_name!r}: a gradient of {nbytes} bytes would take "
            f"the pending round past its max_pending_bytes={int(reply[4])}; nothing was "
            "applied (take the round, or open the accumulator with a larger limit)"
        )
    if code == -4:
        final = int(reply[4])
        raise FailedPreconditionError(
            f"accumulator {acc._shared_name!r} is sealed: its sync job finished at step "
            f"{final}, and no round of it will be taken again; nothing was applied",
            final,
        )
    if code < 0:
        return code, reply[4]
    if code == 0:
        logger.debug(
            "dropped stale gradient for %r: local_step %d < global_step %d",
            acc._shared_name, local_step, int(reply[1]),
        )  # fmt: skip
    return code, None


def _send(
    acc: AccumulatorModel, payload: memoryview, shape_token: str, local_step: int,
    first_error: str, cid: str, seq: int,
) -> Ops[tuple[Any, str, bool, list[Any], list[bytes], list[bytes]]]:  # fmt: skip
    """The apply's pipeline: (script reply, payload key, inline, the durability waits'
    replies, spread garbage this apply is to sweep, parts a retry wrote again that nothing
    holds). Every attempt sends the same (client id, seq): the script answers a retry of an
    apply it already counted without counting it again."""
    nbytes = payload.nbytes
    k = acc._keys
    blob = k.blob(cid, seq)
    keys = [k.state, k.grads, k.dedup(cid), k.takers, k.taker_info, k.wake, blob, k.orphans]
    inline = nbytes <= _model.INLINE_MAX_BYTES
    spread = not inline and acc.spreads_parts
    args = [acc._schema, seq, local_step, shape_token, "i" if inline else "d" if spread else "p",
            b"i" + payload if inline else b"", nbytes, DEDUP_TTL_MS,
            first_error, acc._instance]  # fmt: skip
    durability = acc._durability()
    if inline and durability is None:
        reply = yield Call("apply_grad", "apply", keys, args, commit=True)
        return reply, blob, True, [], [], []
    acked: list[Any] = []
    garbage: list[bytes] = []
    commands: list[tuple[Any, ...]] = []
    if spread:
        acked, garbage = yield from _send_spread(acc, payload, blob)
    elif not inline:
        # The parts, each one chunk, straight from the caller's buffer (memoryview slices:
        # no copy). NX: a retry must not re-arm the orphan expiry of a payload accepted.
        commands = [
            ("SET", k.part(blob, i), payload[start:stop], "NX", "PX", _model.ORPHAN_TTL_MS)
            for i, (start, stop) in enumerate(_chunks.part_ranges(nbytes))
        ]  # fmt: skip
    commands.append(tuple(_scripts.evalsha_args("apply", keys, args)))
    # the script's answer decides: a part refused by a retried batch (maxmemory) whose
    # script answers that the apply was counted is no failure
    replies = yield from committed("apply_grad", commands, durability, k.state, by_last=True)
    if durability is not None:
        acked.append(replies.acked)
    reply = replies[-1]
    rewritten: list[bytes] = []
    if not isinstance(reply, Exception) and int(reply[0]) == 1 and len(reply) > 3 and int(reply[3]):
        # A retry of an apply that was counted: a part its SET NX wrote (none was there) is one
        # the round no longer holds (added into the sum in Redis, or the round taken since):
        # nothing references it, and it would stay for the orphan expiry (an hour)
        rewritten = [c[1] for c, r in zip(commands[:-1], replies[:-1], strict=True)
                     if r is not None and not isinstance(r, Exception)]  # fmt: skip
    return reply, blob, inline, acked, garbage, rewritten


#: Errors that say an apply was refused, not counted: no retry of it counted it before (the
#: script answers a retry of a counted apply from its retry record, before any refusal).
_REFUSED = (NotFoundError, SchemaVersionError, ResourceExhaustedError, InvalidArgumentError,
            PermissionDeniedError)  # fmt: skip


def _drop_spread(acc: AccumulatorModel, cid: str, seq: int, nbytes: int) -> Ops[None]:
    """Delete the parts of a spread payload whose apply was refused. Best effort."""
    k = acc._keys
    blob = k.blob(cid, seq)
    parts = [k.spread_part(blob, i) for i, _ in enumerate(_chunks.part_ranges(nbytes))]
    try:
        for i in range(0, len(parts), 512):
            yield Batch("apply_grad (cleaning up)", [("UNLINK", key) for key in parts[i : i + 512]])
        yield Command("apply_grad (cleaning up)",
                      ("ZREM", k.orphans, k.spread_entry(blob, nbytes)))  # fmt: skip
    except Exception:  # noqa: BLE001 - the apply's own error is the one to raise
        logger.warning("apply_grad on %r: could not delete the parts of a refused gradient",
                       acc._shared_name, exc_info=True)  # fmt: skip


def _unlink_rewritten(acc: AccumulatorModel, parts: list[bytes]) -> Ops[None]:
    """Delete the parts a retry of a counted apply wrote again (see :func:`_send`). Best
    effort: they expire on their own."""
    try:
        yield Command("apply_grad (cleaning up)", ("UNLINK", *parts))
    except Exception:  # noqa: BLE001 - the apply is counted: its answer stands
        logger.debug("deleting the parts a retried apply of %r wrote again failed",
                     acc._shared_name, exc_info=True)  # fmt: skip


def settle_held(acc: AccumulatorModel, window: float | None = None) -> Ops[None]:
    """Settle the applies of unknown outcome this object holds, before it makes another:
    ``lua/withdraw.lua`` with a fence. Counted, they stay counted; not, they never will be (a
    copy Redis runs later is answered as a retry). Idempotent: another thread or task settling
    the same one meanwhile learns the same outcome. Raises when Redis cannot be reached (they
    stay held); another failure gives one up (logged: its outcome stays unknown)."""
    k = acc._keys
    for ident in acc._identities.held():
        cid, seq = ident.client_id, ident.seq
        try:
            judged = int((yield Call("apply_grad (settling an earlier apply)", "withdraw",
                                     [k.state, k.dedup(cid), k.blob(cid, seq)],
                                     [seq, ident.key.nbytes, DEDUP_TTL_MS],
                                     window=window)))  # fmt: skip
        except ConnectionError:  # (UnavailableError too: Redis unreachable) still held
            raise
        except Exception:  # noqa: BLE001 - the new apply is what the caller asked for
            logger.warning("apply_grad on %r: could not settle the earlier apply of unknown "
                           "outcome; it may still be counted", acc._shared_name,
                           exc_info=True)  # fmt: skip
            judged = -3
        if judged == -3:
            logger.warning("apply_grad on %r: the outcome of the earlier apply (it raised "
                           "UnavailableError, or was interrupted) stays unknown",
                           acc._shared_name)  # fmt: skip
        else:
            logger.info("apply_grad on %r: the earlier apply of unknown outcome %s",
                        acc._shared_name, "was counted" if judged == -1 else
                        "was not counted, and now never will be")  # fmt: skip
        acc._identities.settled(ident, None if judged == -3 else judged == -1)


def _withdraw(acc: AccumulatorModel, cid: str, seq: int, nbytes: int) -> Ops[None]:
    """After an apply of parts failed or was interrupted: delete the parts it may have left
    (``lua/withdraw.lua``: not if it was counted). Best effort: they expire on their own."""
    k = acc._keys
    try:
        deleted = yield Call("apply_grad (withdrawing)", "withdraw",
                             [k.state, k.dedup(cid), k.blob(cid, seq)], [seq, nbytes])  # fmt: skip
    except Exception:  # noqa: BLE001 - the apply's own error is the one to raise
        logger.debug("withdrawing the parts of a failed apply of %r failed",
                     acc._shared_name, exc_info=True)  # fmt: skip
        return
    if int(deleted) > 0:
        logger.debug("apply_grad on %r: deleted %d parts of the abandoned apply",
                     acc._shared_name, int(deleted))  # fmt: skip


def _send_spread(
    acc: AccumulatorModel, payload: memoryview, blob: str
) -> Ops[tuple[list[Any], list[bytes]]]:
    """Write a payload spread over slots: register it (lua/orphans.lua, which also hands out
    garbage for this apply to sweep), then its parts, one pipeline per node, every reply
    checked (the apply script cannot see them). Returns (the durability waits' replies, one
    per node, the garbage)."""
    k = acc._keys
    entry = k.spread_entry(blob, payload.nbytes)
    keys = [k.state, k.orphans]
    args = [acc._schema, entry, _model.ORPHAN_TTL_MS, _model.SWEEP_COUNT, _model.SWEEP_LEASE_MS,
            acc._instance]  # fmt: skip
    durability = acc._durability()
    registered: list[Any] = []
    if durability is None:
        garbage = yield Call("apply_grad", "orphans", keys, args, commit=True)
    else:
        # a registration a failover lost would make the apply script refuse the gradient
        register = tuple(_scripts.evalsha_args("orphans", keys, args))
        done = yield from committed("apply_grad", [register], durability, k.state)
        garbage, registered = done[0], [done.acked]
    # NX: a retried batch leaves a part already written alone (the same bytes)
    commands = [
        ("SET", k.spread_part(blob, i), payload[start:stop], "NX")
        for i, (start, stop) in enumerate(_chunks.part_ranges(payload.nbytes))
    ]  # fmt: skip
    tail = durability.command() if durability is not None else None
    replies = yield Batch("apply_grad", commands, raise_on_error=False, commit=True, tail=tail)
    replies = list(replies)
    acked = replies.pop() if tail is not None else []
    if durability is not None:  # a wait that failed confirmed nothing
        acked = [durability.unconfirmed() if isinstance(a, Exception) else a for a in acked]
        acked += registered
    failed = first_error(replies)
    if failed is not None:
        # refused (maxmemory, ACL): what was written goes, and the registration with it
        yield from discard(acc, [entry])
        raise failed
    return acked, [g for g in garbage if isinstance(g, bytes)]


def sweep(acc: AccumulatorModel) -> Ops[None]:
    """Delete the parts of spread payloads that are garbage and due (lua/orphans.lua)."""
    k = acc._keys
    try:
        args = [acc._schema, "", 0, _model.SWEEP_COUNT, _model.SWEEP_LEASE_MS]
        garbage = yield Call("sweep", "orphans", [k.state, k.orphans], args)
    except Exception:  # noqa: BLE001 - the next sweeper does it
        logger.debug("sweeping %s failed", k.base, exc_info=True)
        return
    yield from discard(acc, list(garbage))


def discard(acc: AccumulatorModel, members: list[bytes]) -> Ops[None]:
    """Delete the parts of spread payloads that are garbage (``x<entry>`` members of the
    orphans zset, leased to this client; or this client's own registration of a payload it
    failed to write), then the members. Best effort: a failure is logged,
    and another sweeper deletes them once the lease ran out."""
    k = acc._keys
    parts = k.orphan_parts(members)
    try:
        for i in range(0, len(parts), 512):
            yield Batch("sweep", [("UNLINK", key) for key in parts[i : i + 512]])
        if members:
            yield Command("sweep", ("ZREM", k.orphans, *members))
    except Exception:  # noqa: BLE001 - the lease runs out; the next sweeper finishes
        logger.warning(
            "could not delete the parts of %d dropped gradients of %r (the next apply sweeps "
            "them)", len(members), acc._shared_name, exc_info=True,
        )  # fmt: skip


class Replies(list[Any]):
    """A batch's replies, and the reply of the durability wait after them (or None)."""

    acked: Any = None


def committed(
    what: str, commands: list[tuple[Any, ...]], durability: Durability | None, key: str,
    *, by_last: bool = False,
) -> Ops[Replies]:  # fmt: skip
    """Send a commit's commands in one batch, followed by the durability wait on the same
    connection (on a cluster: of the node serving ``key``, the accumulator's slot); error
    replies raise (a payload part's refusal, OOM or ACL, before the script's: it explains
    best). ``by_last``: the last command (the script) decides: when it succeeded, errors
    before it do not raise."""
    node_key = None
    if durability is not None:
        commands = [*commands, durability.command()]
        node_key = key
    batch = Batch(what, commands, raise_on_error=False, commit=True, node_key=node_key)
    replies = Replies((yield batch))
    if durability is not None:
        acked = replies.pop()
        # a wait that failed confirmed nothing
        replies.acked = durability.unconfirmed() if isinstance(acked, Exception) else acked
    decided = by_last and replies and not isinstance(replies[-1], Exception)
    failed = None if decided else first_error(replies)
    if failed is not None:
        raise failed
    return replies


def first_error(replies: list[Any]) -> Exception | None:
    """The first error among a batch's replies, as ours where it is ours (``ACCERR``,
    maxmemory, ACL), else None."""
    failed = next((r for r in replies if isinstance(r, Exception)), None)
    return _scripts.translate(failed) if isinstance(failed, ResponseError) else failed


def fold(acc: AccumulatorModel, blob: str) -> Ops[None]:
    """Add the rest of an accepted gradient into the round's sum in Redis, a few parts per
    script (lua/fold.lua), so that other clients are served in between. Folds go in apply
    order: the script folds an earlier gradient's parts first (also a dead worker's), so the
    sum stays the in-order sum. The apply is already counted: a failure here is logged, not
    raised (the taker reads the parts not folded in yet), and a retried call folds nothing
    twice."""
    call = Call("apply_grad (folding)", "fold", [acc._keys.state, acc._keys.grads],
                [acc._schema, blob, _chunks.FOLD_PARTS])  # fmt: skip
    try:
        while int((yield call)):
            pass
    except Exception:  # noqa: BLE001 - the gradient is applied; folding only saves memory
        logger.warning(
            "apply_grad on %r: the gradient is applied, but adding it into the sum kept in "
            "Redis stopped; the taker reads the rest of it as it is",
            acc._shared_name, exc_info=True,
        )  # fmt: skip


