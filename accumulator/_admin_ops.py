"""Changing accumulators from the CLI: set the step, drop the pending round, delete one or a
whole container. Every key name comes from :mod:`accumulator._keys`; round entries read back
from Redis are untrusted (only an accumulator's own payload keys are deleted)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import OutOfMemoryError

from . import _scripts
from ._admin_read import _listed, _not_found, _scan, list_accumulators
from ._connection import atomically, require_transactions
from ._core import leave
from ._errors import (
    AccumulatorError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from ._keys import DEFAULT_PREFIX, SCHEMA_VERSION, SCHEMAS, Keys
from ._model import SWEEP_LEASE_MS, old_step
from ._routing import raise_slot_moving

logger = logging.getLogger("accumulator")


def schema_of(r: redis.Redis, keys: Keys) -> int:
    """The key schema an accumulator was created with (2, or 3: spread over slots), what
    its scripts are called with; ``SCHEMA_VERSION`` when it does not exist or is foreign
    (the script then says so)."""
    have = r.hget(keys.state, "schema")
    try:
        schema = int(have) if have is not None else SCHEMA_VERSION
    except ValueError:
        return SCHEMA_VERSION
    return schema if schema in SCHEMAS else SCHEMA_VERSION


def sweep(r: redis.Redis, keys: Keys) -> int:
    """Delete the parts of an accumulator's spread payloads that are garbage and due
    (``lua/orphans.lua``): dropped, taken or quarantined ones, and registrations that ran
    out. Returns how many payloads were swept."""
    swept = 0
    schema = schema_of(r, keys)
    while True:
        members = _scripts.call(r, "orphans", [keys.state, keys.orphans],
                                [schema, "", 0, 200, SWEEP_LEASE_MS])  # fmt: skip
        if not members:
            return swept
        _unlink(r, keys.orphan_parts(members))
        r.zrem(keys.orphans, *members)
        swept += len(members)


def _sweep_after(r: redis.Redis, keys: Keys, done: str) -> None:
    """:func:`sweep` after ``done`` (a reset, a dropped round) has happened: best effort. A
    failure (the ACL refuses the sweep's TIME or ZREM, Redis at maxmemory) is logged: the
    operation is done, and the next apply or reset sweeps the parts."""
    try:
        sweep(r, keys)
    except (AccumulatorError, redis.RedisError) as exc:
        logger.warning("%s %s, but the parts of its spread payloads were not swept (%s); the "
                       "next apply or reset sweeps them", keys.base, done, exc)  # fmt: skip


def set_step(
    r: redis.Redis, shared_name: str, n: int, container: str = "", *, prefix: str = DEFAULT_PREFIX
) -> int | None:
    """Set the global step (also downwards); the pending round is kept. Returns the old step
    (None when it was not a number: written by another program, repaired now)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgumentError(f"the global step must be an integer, got {n!r}")
    if not -(2**63) <= n < 2**63:
        raise InvalidArgumentError(f"the global step must fit in an int64, got {n}")
    keys = Keys(container, shared_name, prefix)
    try:
        old = _scripts.call(r, "set_step", [keys.state], [schema_of(r, keys), n])
    except NotFoundError as exc:
        raise _not_found(shared_name, container) from exc
    return old_step(old, shared_name)


def reset(
    r: redis.Redis, shared_name: str, container: str = "", *, prefix: str = DEFAULT_PREFIX
) -> int:
    """Drop the pending round (its gradients and payload keys) and the rounds claimed by
    takers that are gone (their claim lease ran out: the next take would take them over); the
    step does not change. Waiting takers keep waiting; a claim whose lease runs is left to its
    taker. Returns the number of gradients dropped, those of such claims included."""
    return reset_counted(r, shared_name, container, prefix=prefix)[0]


def reset_counted(
    r: redis.Redis, shared_name: str, container: str = "", *, prefix: str = DEFAULT_PREFIX
) -> tuple[int, int]:
    """:func:`reset`, returning (gradients dropped, how many of them were in claims)."""
    keys = Keys(container, shared_name, prefix)
    try:
        dropped, in_claims, *blobs = _scripts.call(
            r, "reset", [keys.state, keys.grads, keys.quarantine, keys.orphans, keys.claims],
            [schema_of(r, keys)],
        )  # fmt: skip
    except NotFoundError as exc:
        raise _not_found(shared_name, container) from exc
    blobs = [b for b in blobs if keys.is_blob(b)]  # the script returns only ours; twice sure
    _unlink(r, blobs)
    _sweep_after(r, keys, "was reset")  # the spread payloads it dropped
    return int(dropped), int(in_claims)


def delete(
    r: redis.Redis, shared_name: str, container: str = "", *, prefix: str = DEFAULT_PREFIX,
    checked: bool = False,
) -> int:  # fmt: skip
    """Delete every key of one accumulator (state, round, payloads, takers, claims, retry
    records). Processes still using it get :class:`NotFoundError`; one that opens the name
    while this runs creates a new accumulator, which is kept whole. Returns the number of keys
    deleted; raises :class:`NotFoundError` when there was none, and
    :class:`PermissionDeniedError` before deleting anything when the user may not run the
    transaction it starts with (``checked``: the caller found it may)."""
    keys = Keys(container, shared_name, prefix)
    (removed,) = delete_many(r, [keys], within=keys, checked=checked)
    if removed == 0:
        raise _not_found(shared_name, container)
    return removed


def delete_many(
    r: redis.Redis, accumulators: list[Keys], *, within: Keys, checked: bool = False,
    progress: Callable[[], None] = lambda: None,
) -> list[int]:  # fmt: skip
    """:func:`delete` of several accumulators with one SCAN for their keys: that of
    ``within.family_pattern``, which must match every key of them all (``Keys(container, "")``
    for a container's, ``Keys(container, "job/")`` for a sync job's). Returns the keys deleted
    of each (0: there was none). ``progress`` is called after each step of each accumulator
    (a caller holding a lease renews it)."""
    if accumulators and not checked:
        require_transactions(r, accumulators[0].state)
        # the purge script runs after the first deletes: the user must be allowed it before
        # (a call with no key to purge writes nothing)
        _scripts.call(r, "purge", [accumulators[0].state], [])
    removed = []
    for keys in accumulators:
        removed.append(_delete_named(r, keys))
        progress()
    # What is found under the names now may be another accumulator's: one created again
    # under a name since (a worker's open): :func:`_delete_found` keeps it.
    found = _group_by_owner(_scan(r, within.family_pattern), accumulators)
    for n, keys in enumerate(accumulators):
        removed[n] += _delete_found(r, keys, found.get(keys.base, []))
        progress()
    return removed


#: The expiry a delete gives the payloads of the round it deletes, in case it is cut short
#: before it unlinks them (lua/_common.lua's DROPPED_TTL_MS: reset's, for the same case).
DELETED_TTL_MS = 60_000


def _delete_named(r: redis.Redis, keys: Keys) -> int:
    """Delete what the state names: its fixed keys, the round's payloads, the spread
    payloads registered or dropped. The state goes first, atomically with reading the round:
    from then on every script answers NOTFOUND, so nothing new is added while the rest is
    found and removed. The round's payloads read just before are set to expire in the same
    transaction: a delete cut short after it (Ctrl-C, SIGKILL) left them in Redis for good,
    named by nothing (interrupt review); the few a gradient applied in between adds are
    deleted below."""
    own = (keys.base + ":").encode()  # (spread parts, in other slots, have their sweep)
    try:
        named = [key for key in keys.payload_keys(_listed(r.lrange(keys.grads, 0, -1)))
                 if key.startswith(own)]  # fmt: skip
    except redis.ResponseError:  # (another type there: it names nothing)
        named = []

    def queue(pipe: Any) -> None:
        pipe.lrange(keys.grads, 0, -1)
        pipe.zrange(keys.orphans, 0, -1)
        for key in named:
            pipe.pexpire(key, DELETED_TTL_MS)
        pipe.unlink(*keys.fixed)

    entries, orphans, *_, removed = atomically(r, queue, raise_on_error=False)
    # a key of another type where the round or the orphans belong (written by another
    # program) names nothing: it is deleted with the others (WRONGTYPE stopped delete)
    entries, orphans = (_listed(reply) for reply in (entries, orphans))
    if isinstance(removed, Exception):
        raise removed
    # spread payloads not in the round: registered, dropped, taken (their parts elsewhere)
    removed = int(removed) + _unlink(r, keys.orphan_parts(orphans))
    # round entries are untrusted: only this accumulator's own payload keys are deleted
    return removed + _unlink(r, keys.payload_keys(entries))


def _group_by_owner(found: set[bytes], accumulators: list[Keys]) -> dict[str, list[bytes]]:
    """The keys found, by the base of the accumulator (of those given) that owns them."""
    owners = {keys.base: keys for keys in accumulators}
    grouped: dict[str, list[bytes]] = {}
    for key in found:
        close = key.find(b"}")
        tag = key[: close + 1] if close >= 0 else b""
        if b"%p" in tag:  # a spread part: its tag is the accumulator's, "%p<i>" added
            tag = tag[: tag.index(b"%p")] + b"}"
        keys = owners.get(tag.decode("utf-8", "replace"))
        if keys is not None and keys.owns(key):
            grouped.setdefault(keys.base, []).append(key)
    return grouped


def _delete_found(r: redis.Redis, keys: Keys, found: list[bytes]) -> int:
    """Delete the keys found under a deleted accumulator's name (its claims, their payloads,
    the retry records, spread parts nothing names) unless the name was created again since:
    those go in batches through lua/purge.lua, which deletes nothing once the name exists
    again; so do the payloads the claims name (spread ones, in other slots, after the last
    batch)."""
    rest = sorted(key for key in found if not key.startswith(keys.spread_head))
    claimed: list[bytes] = []
    claims = [name for name in rest if name.startswith(keys.claim("").encode())]
    if claims:
        pipe = r.pipeline(transaction=False)
        for name in claims:
            pipe.lrange(name, 1, -1)
        # (a value of another type under a claim's name is no claim: deleted all the same)
        for reply in pipe.execute(raise_on_error=False):
            claimed += [e for e in _listed(reply) if isinstance(e, bytes)]
    own = (keys.base + ":").encode()
    payloads = keys.payload_keys(claimed)
    rest += [key for key in payloads if key.startswith(own)]
    removed = 0
    for i in range(0, len(rest), 500):
        purged = int(_scripts.call(r, "purge", [keys.state, *rest[i : i + 500]], []))
        if purged < 0:
            logger.info("accumulator %r was created again while it was deleted: the keys of the "
                        "new one are kept, and what was left of the old one (`delete` removes "
                        "it once the new one is gone)", keys.shared_name)  # fmt: skip
            return removed
        removed += purged
    removed += _unlink(r, [key for key in payloads if not key.startswith(own)])
    # spread parts that nothing names any more (registration lost in a failover, or by a
    # client that died before that was fixed), unless the name was created again meanwhile:
    # a new accumulator's apply whose parts went is refused as a missing payload and sent
    # again, never counted in part
    stray = sorted(key for key in found if key.startswith(keys.spread_head))
    if stray and not r.exists(keys.state):
        removed += _unlink(r, stray)
    return removed


def reset_container(r: redis.Redis, container: str, *, prefix: str = DEFAULT_PREFIX) -> int:
    """Delete every accumulator of one container (TF's container reset). Returns how many."""
    names = [info.shared_name for info in list_accumulators(r, container, prefix=prefix)]
    removed = delete_listed(r, container, names, prefix=prefix)
    return sum(1 for n in removed if n)  # (0: deleted by someone else meanwhile)


def delete_listed(
    r: redis.Redis, container: str, names: list[str], *, prefix: str = DEFAULT_PREFIX
) -> list[int]:
    """:func:`reset_container` of the accumulators ``names`` listed already (the CLI's
    question: one SCAN less): the keys deleted of each (0: none, deleted meanwhile)."""
    named = [Keys(container, name, prefix) for name in names]
    return delete_many(r, named, within=Keys(container, "", prefix))


def check_taker(
    r: redis.Redis, shared_name: str, taker_id: str, container: str = "", *,
    prefix: str = DEFAULT_PREFIX, drop: bool = False,
) -> bool:  # fmt: skip
    """Raise as :func:`evict` would before it changes anything: :class:`InvalidArgumentError`
    for a malformed taker id, or a claim to give back (not ``drop``) that no claim registry
    of the accumulator names (left by a `delete` cut short: its gradients may be of an
    accumulator deleted since); :class:`NotFoundError` when no such taker waits on or holds
    a round of the accumulator (or there is no accumulator). The CLI asks before it evicts.
    Returns whether the taker waits in the FIFO (else it holds a claim)."""
    keys = Keys(container, shared_name, prefix)
    if not re.fullmatch(r"[0-9]+-[0-9a-f]+", taker_id):
        raise InvalidArgumentError(f"not a taker id: {taker_id!r} (e.g. 12345-0a1b2c3d4e5f)")
    if not r.exists(keys.state):
        raise _not_found(shared_name, container)
    waiting = r.zscore(keys.takers, taker_id) is not None
    if not waiting and not r.exists(keys.claim(taker_id)):
        raise NotFoundError(f"no taker {taker_id!r} waits on or holds a round of {shared_name!r}")
    if not drop and not waiting and r.hget(keys.claims, taker_id) is None:
        raise InvalidArgumentError(
            f"the round claimed by {taker_id!r} under {shared_name!r} is in no claim registry of "
            "the accumulator (left by a `delete` cut short, or a registry lost): its gradients "
            "may be of an accumulator deleted since, and are not given back; evict --drop "
            "deletes them"
        )
    return waiting


def _drop_claim(
    r: redis.Redis, keys: Keys, claim: str, taker_id: str
) -> tuple[list[Any], list[bytes]]:
    """Delete a claimed round (its payload keys, the claim, the taker's registry, FIFO and
    lease entries) as one transaction watching the claim; returns (the claim's entries, the
    spread parts made garbage). At maxmemory Redis refuses a transaction's commands, deletes
    too: there the claim is read, then deleted by plain commands (the tools that free memory
    must work at the limit; the taker is gone, nothing else writes its claim)."""
    def plan(entries: list[Any]) -> tuple[list[bytes], list[bytes]]:
        # claim entries are untrusted: only this accumulator's own payload keys go
        own = [e for e in entries[1:] if isinstance(e, bytes)]
        blobs = keys.payload_keys([e for e in own if not Keys.is_spread(e)])
        return blobs, [b"x" + e for e in own if Keys.is_spread(e) and keys.entry_keys(e)]

    def queue(pipe: Any, blobs: list[bytes], spread: list[bytes]) -> None:
        for i in range(0, len(blobs), 500):
            pipe.unlink(*blobs[i : i + 500])
        if spread:  # other slots: garbage for the sweep (no transaction spans them)
            pipe.zadd(keys.orphans, dict.fromkeys(spread, 0))
        pipe.unlink(claim)
        pipe.hdel(keys.claims, taker_id)
        pipe.zrem(keys.takers, taker_id)
        pipe.hdel(keys.taker_info, taker_id)

    try:
        with r.pipeline(transaction=True) as pipe:
            pipe.watch(claim)
            entries = pipe.lrange(claim, 0, -1)
            blobs, spread = plan(entries)
            pipe.multi()
            queue(pipe, blobs, spread)
            pipe.execute()
        return entries, spread
    except redis.exceptions.AskError as exc:  # (a cluster's transaction, its slot moving)
        raise_slot_moving(r, exc)
    except redis.WatchError:
        raise NotFoundError(
            f"the round claimed by {taker_id!r} changed while it was being dropped (the taker "
            "is alive: it finished, or gave it back; or it was handed over): nothing was dropped"
        ) from None
    except OutOfMemoryError:
        logger.debug("at maxmemory: the claimed round is dropped by plain deletes")
    entries = r.lrange(claim, 0, -1)
    blobs, spread = plan(entries)
    if spread:  # registered for the sweep first (a ZADD needs memory): else nothing goes
        try:
            r.zadd(keys.orphans, dict.fromkeys(spread, 0))
        except OutOfMemoryError as exc:
            raise ResourceExhaustedError(
                f"the round claimed by {taker_id!r} has payload parts in other slots, which "
                "cannot be registered for deletion at maxmemory; nothing was dropped. Free "
                "some memory first (reset or delete another accumulator), then evict again"
            ) from exc
    with r.pipeline(transaction=False) as pipe:
        queue(pipe, blobs, [])
        pipe.execute()
    return entries, spread


def evict(
    r: redis.Redis,
    shared_name: str,
    taker_id: str,
    container: str = "",
    *,
    drop: bool = False,
    prefix: str = DEFAULT_PREFIX,
) -> str:
    """Remove a taker that is gone (a crashed chief) without waiting for its lease.

    A waiting taker leaves the FIFO (the takers behind it proceed at once). A taker holding a
    claimed round gives it back as ``leave`` would (or, if the accumulator moved on, hands it
    to the next take); ``drop=True`` deletes that round's gradients instead. Returns
    ``"left"``, ``"given back"``, ``"handed over"`` or ``"dropped"``; raises
    :class:`NotFoundError` when there is no such taker (or accumulator), also when a live
    taker's claim changes while it is dropped. Evicting a live taker never makes a round
    count twice: one that holds a claim finds it gone and its take raises; one that waits
    joins the queue again at its next slice.
    """
    keys = Keys(container, shared_name, prefix)
    claim = keys.claim(taker_id)
    waiting = check_taker(r, shared_name, taker_id, container, prefix=prefix, drop=drop)
    if drop:
        require_transactions(r, keys.state)
        entries, spread = _drop_claim(r, keys, claim, taker_id)
        if spread:
            _sweep_after(r, keys, "had a claimed round dropped")
        if entries:
            return "dropped"
        if waiting:
            _wake_queue(r, keys)
            return "left"
        raise NotFoundError(f"no taker {taker_id!r} waits on or holds a round of {shared_name!r}")
    try:
        outcome = leave(r, keys, taker_id, schema_of(r, keys))
    except NotFoundError as exc:
        raise _not_found(shared_name, container) from exc
    if outcome == 1:
        return "given back"
    if outcome == -1:
        return "handed over"
    if waiting:
        return "left"
    raise NotFoundError(f"no taker {taker_id!r} waits on or holds a round of {shared_name!r}")


def _wake_queue(r: redis.Redis, keys: Keys) -> None:
    """Tell the takers waiting behind an evicted one to look again (as ``leave`` does): the
    new head claims at once instead of at the end of its wait slice. Best effort: a user the
    ACL refuses PUBLISH (channels are refused by default) only costs them that slice."""
    try:
        r.publish(keys.queue_wake, "1")
    except redis.RedisError as exc:
        logger.debug("takers behind an evicted one not woken (%s): they look again within "
                     "their wait slice", type(exc).__name__)


def _unlink(r: redis.Redis, keys: list[bytes]) -> int:
    """UNLINK any number of keys, a few hundred per command; returns how many existed."""
    return sum(int(r.unlink(*keys[i : i + 500])) for i in range(0, len(keys), 500))
