"""Reading accumulators for the CLI: listing them, describing one (takers, claims left behind,
stray keys, memory), the server's INFO. Pure functions over a ``redis.Redis`` that returns
bytes; keys are found with SCAN (never KEYS); reads are snapshots."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from ._admin_info import (
    Info,
    LeftClaim,
    Unreadable,
    _info,
    _int,
    _server_ms,
    _takers,
    live_takers,
    queue_time,
)
from ._codec import reply_text
from ._connection import atomically
from ._errors import NotFoundError
from ._keys import DEFAULT_PREFIX, Keys, parse_state_key, state_pattern
from ._private import named_claims

logger = logging.getLogger("accumulator._admin")

_SCAN_COUNT = 1000


def _scan(r: redis.Redis, pattern: str) -> set[bytes]:
    return set(r.scan_iter(match=pattern, count=_SCAN_COUNT))


def _key_bytes(key: str) -> bytes:
    return key.encode("utf-8")


def _not_found(shared_name: str, container: str) -> NotFoundError:
    where = f" in container {container!r}" if container else ""
    return NotFoundError(f"no accumulator named {shared_name!r}{where}")


#: What list_accumulators reads from each key, for the message when a key holds another type.
_LISTED_TYPES = {"state": "hash", "takers": "sorted set", "taker_info": "hash"}
_TYPE_NAMES = {"zset": "sorted set", "none": "nothing (removed meanwhile)"}


def _wrong_type(reply: Any) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def _unreadable(
    r: redis.Redis, container: str, name: str, wrong: list[tuple[str, str]], now: int | None
) -> Unreadable:
    notes = []
    for key, wanted in wrong:
        try:
            held = reply_text(r.type(key))
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

    One SCAN over the state keys, then one pipelined round trip: HGETALL of each state, the
    members of its takers zset and their leases (the taker info hash), to count the takers
    that still wait. Lifetime statistics are included; takers and claims are not.

    A foreign key under the prefix does not make the listing fail: an entry whose state,
    takers or taker info key has the wrong type (WRONGTYPE) is listed as an
    :class:`Unreadable` (an :class:`Info` whose ``error`` says why), in its sorted place.
    Other errors raise.
    """
    return list_found(r, _scan(r, state_pattern(container, prefix)), container, prefix=prefix)


def list_found(
    r: redis.Redis, state_keys: Iterable[bytes], container: str | None = None, *,
    prefix: str = DEFAULT_PREFIX,
) -> list[Info]:  # fmt: skip
    """:func:`list_accumulators` of the state keys given (found by a SCAN: ``watch`` spreads
    one over its frames, :class:`._admin_scan.StateScan`)."""
    found: list[tuple[str, str, Keys]] = []
    for raw in state_keys:
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
    clock = queue_time(r, pipe)
    for _, _, keys in found:
        pipe.hgetall(keys.state)
        pipe.zrange(keys.takers, 0, -1)
        pipe.hgetall(keys.taker_info)
        pipe.hgetall(keys.claims)
    replies = clock(pipe.execute(raise_on_error=False))
    for reply in replies:
        if isinstance(reply, Exception) and not _wrong_type(reply):
            raise reply
    now = _server_ms(replies[0])
    stranded = _stranded(r, found, replies[1:], now)
    out: list[Info] = []
    for i, (cont, name, keys) in enumerate(found):
        state, queued, leases, _ = replies[1 + 4 * i : 5 + 4 * i]
        wrong = [
            (key, _LISTED_TYPES[what])
            for what, key, reply in (("state", keys.state, state), ("takers", keys.takers, queued),
                                     ("taker_info", keys.taker_info, leases))
            if _wrong_type(reply)
        ]  # fmt: skip
        if wrong:
            out.append(_unreadable(r, cont, name, wrong, now))
            continue
        if not state:  # deleted between SCAN and HGETALL
            continue
        rounds, grads = stranded.get(i, (0, 0))
        out.append(_info(cont, name, state, live_takers(queued or [], leases or {}, now), now,
                         stranded_claims=rounds, stranded_grads=grads))  # fmt: skip
    return out


def _gone(claim: LeftClaim) -> bool:
    """Whether a claim's taker is gone (its lease ran out)."""
    return claim.lease_remaining_ms is not None and claim.lease_remaining_ms <= 0


def _stranded(
    r: redis.Redis, found: list[tuple[str, str, Keys]], replies: list[Any], now: int | None
) -> dict[int, tuple[int, int]]:
    """Index in ``found`` -> (rounds claimed by takers that are gone, their gradients), from
    each claim registry (``replies[4 * i + 3]``) and one more round trip for the claims'
    headers, when there are such claims."""
    if now is None:
        return {}
    claims: list[tuple[int, str]] = []
    for i, (_, _, keys) in enumerate(found):
        registry = replies[4 * i + 3]
        if not isinstance(registry, dict):
            continue
        for taker, mark in registry.items():
            expiry = _int(mark, None)
            if expiry is not None and expiry <= now:
                claims.append((i, keys.claim(reply_text(taker))))
    if not claims:
        return {}
    pipe = r.pipeline(transaction=False)
    for _, key in claims:
        pipe.lindex(key, 0)
    out: dict[int, tuple[int, int]] = {}
    for (i, _), header in zip(claims, pipe.execute(raise_on_error=False), strict=True):
        if not isinstance(header, bytes):  # given back meanwhile, or not a list of ours
            continue
        fields = header.split()
        count = _int(fields[1], None) if len(fields) > 1 else None
        rounds, grads = out.get(i, (0, 0))
        out[i] = (rounds + 1, grads + (count or 0))
    return out


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


def _listed(reply: Any) -> list[Any]:
    """A list or zset read's items; none when the key holds a value of another type (a
    foreign write where ours belongs names nothing); any other error is raised."""
    if isinstance(reply, Exception):
        if "WRONGTYPE" not in str(reply):
            raise reply
        return []
    return list(reply)


def _last_expiry(r: redis.Redis, keys: list[bytes]) -> int | None:
    """Milliseconds until the last of ``keys`` expires; -1 when one never does (left by a
    command cut short); None when the server refuses PTTL."""
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    try:
        ttls = pipe.execute(raise_on_error=False)
    except ResponseError:
        return None
    if any(isinstance(t, Exception) for t in ttls):
        return None
    if any(t == -1 for t in ttls):
        return -1
    return max(max(int(t), 0) for t in ttls)


def _spread_strays(
    r: redis.Redis, keys: Keys, orphans: list[Any], now: int | None
) -> tuple[list[bytes], int | None]:
    """The parts in Redis of the spread payloads the orphans zset records (applies being
    sent, or never finished; garbage not yet swept): they live in other slots, with no
    expiry of their own, where no SCAN of the accumulator's pattern finds them. And the ms
    until the last record runs out (0: due now; None: none, or the server's clock unknown)."""
    members = [(m, s) for m, s in orphans if isinstance(m, bytes)]
    parts = keys.orphan_parts([m for m, _ in members])
    if not parts:
        return [], None
    pipe = r.pipeline(transaction=False)
    for part in parts:
        pipe.exists(part)
    there = [p for p, n in zip(parts, pipe.execute(raise_on_error=False), strict=True) if n == 1]
    if not there or now is None:
        return there, None
    return there, max(max(int(score) - now, 0) for _, score in members)


def _left_claims(
    r: redis.Redis, keys: Keys, claim_keys: list[bytes], claim_head: bytes, now: int | None
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
    pipe.hgetall(keys.claims)
    for key in kept:
        pipe.lrange(key, 0, -1)
    registry, *contents = pipe.execute(raise_on_error=False)
    if isinstance(registry, Exception):
        raise registry
    # a value of another type under a claim's name is no claim (a foreign write): skipped
    contents = [_listed(c) for c in contents]
    # entries are untrusted: only this accumulator's own payload keys are looked at
    blob_refs = [keys.payload_keys(c[1:]) for c in contents]
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
        header = reply_text(content[0]).split(" ")
        inline = sum(len(e) - 1 for e in content[1:] if e[:1] == b"i")
        taker = key[len(claim_head) :]
        expiry = _int(registry.get(taker), None)
        claims.append(
            LeftClaim(
                key=reply_text(key),
                taker_id=reply_text(taker),
                step=_int(header[0], None),
                count=sum(keys.entry_weight(e) for e in content[1:]),
                bytes=inline + sum(sizes.get(b, 0) for b in refs),
                missing_blobs=sum(1 for b in refs if b not in sizes),
                lease_remaining_ms=None if expiry is None or now is None else expiry - now,
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
    scan: bool = True,
) -> Info:
    """Everything about one accumulator: state, lifetime statistics, waiting takers, claims
    left behind, stray keys and (``memory=True``, where the server allows) MEMORY USAGE.

    Claims are found by the registries that name them. ``scan=True`` also SCANs for the
    accumulator's keys, to count them and find stray ones (and claims no registry names): a
    SCAN walks the whole keyspace, about a second per million keys, so ``watch`` and the
    changing commands pass ``scan=False`` (``keys`` and ``stray_keys`` are None then).

    Raises :class:`NotFoundError` when its state hash does not exist.
    """
    keys = Keys(container, shared_name, prefix)
    clocks = []

    def queue(pipe: Any) -> None:
        clocks.append(queue_time(r, pipe))
        pipe.hgetall(keys.state)
        pipe.zrange(keys.takers, 0, -1, withscores=True)
        pipe.hgetall(keys.taker_info)
        pipe.lrange(keys.grads, 0, -1)
        pipe.llen(keys.quarantine)
        pipe.hgetall(keys.claims)
        pipe.zrange(keys.orphans, 0, -1, withscores=True)

    replies = atomically(r, queue)  # one consistent snapshot of the fixed keys
    now_reply, state, ranked, taker_info, entries, quarantined, registry, orphans = clocks[-1](
        replies
    )
    if not state:
        raise _not_found(shared_name, container)
    now = _server_ms(now_reply)

    fixed = {_key_bytes(k) for k in keys.fixed}
    claim_head = _key_bytes(keys.claim(""))
    dedup_head = _key_bytes(keys.dedup(""))
    named = {_key_bytes(k) for k in named_claims(
        keys, registry or {}, taker_info or {}, [m for m, _ in ranked or []]
    )}  # fmt: skip
    found = (_scan(r, keys.pattern) if scan else set()) | {_key_bytes(keys.state)}
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
    claim_keys = sorted(named | {k for k in found if k.startswith(claim_head)})
    referenced = set(keys.payload_keys(entries))

    claims, retry_buffers, in_claims = _left_claims(r, keys, claim_keys, claim_head, now)
    referenced |= in_claims
    stray = [] if not scan else [
        k
        for k in found
        if k not in fixed
        and k not in referenced
        and not k.startswith(claim_head)
        and not k.startswith(dedup_head)
    ]
    stray_bytes, stray_expire = None, None
    if stray:
        logger.debug("%d stray keys under %s", len(stray), keys.base)
        stray_expire = _last_expiry(r, stray)
        stray_bytes = _memory_usage(r, stray) if memory else None
    spread, spread_due = _spread_strays(r, keys, _listed(orphans), now) if scan else ([], None)
    return _info(
        container,
        shared_name,
        state,
        live_takers([member for member, _ in ranked], taker_info, now),
        now,
        detailed=True,
        takers=_takers(ranked, taker_info, now),
        claims=tuple(claims),
        stranded_claims=len(gone := [c for c in claims if _gone(c)]),
        stranded_grads=sum(c.count for c in gone),
        retry_buffers=retry_buffers,
        keys=len(found) if scan else None,
        stray_keys=len(stray) if scan else None,
        stray_bytes=stray_bytes,
        stray_expire_ms=stray_expire,
        spread_stray_keys=len(spread) if scan else None,
        spread_stray_bytes=_memory_usage(r, spread) if memory and spread else None,
        spread_stray_due_ms=spread_due,
        quarantined=int(quarantined or 0),
        # with the parts of spread payloads (other slots, not under the pattern)
        memory_bytes=_memory_usage(r, sorted(found | referenced | set(claim_keys) | set(spread)))
        if memory else None,
    )


def server_info(r: redis.Redis) -> dict[str, Any] | None:
    """A few INFO fields (version, mode, memory), or None when INFO is not allowed."""
    nodes: list[dict[str, Any]] | None = None
    try:
        info = r.info("server")
        if isinstance(r, RedisCluster):  # every primary's (INFO goes to one node by default)
            per_node = r.info("memory", target_nodes=RedisCluster.PRIMARIES)
            # node -> its fields; from a cluster of one primary, that node's fields alone
            maps = all(isinstance(v, dict) for v in per_node.values())
            nodes = list(per_node.values()) if maps else [per_node]
            memory = {"used_memory": sum(int(n.get("used_memory") or 0) for n in nodes)}
        else:
            memory = r.info("memory")
    except ResponseError as exc:
        logger.debug("INFO unavailable: %s", exc)
        return None
    product = "valkey" if "valkey_version" in info else "redis"
    out = {
        "server": product,
        "version": str(info.get("valkey_version") or info.get("redis_version") or "?"),
        "mode": info.get("redis_mode"),
        "used_memory": memory.get("used_memory"),
        "used_memory_human": memory.get("used_memory_human"),
        "maxmemory": memory.get("maxmemory"),
    }
    if nodes is not None:
        # a cluster: the sum over its primaries; the limit is each node's own, so the
        # fullest node's share of its maxmemory says how close the cluster is to it
        shares = [int(n.get("used_memory") or 0) / int(n["maxmemory"])
                  for n in nodes if int(n.get("maxmemory") or 0) > 0]  # fmt: skip
        out.update(primaries=len(nodes), maxmemory=None,
                   fullest_node_share=max(shares) if shares else None)  # fmt: skip
    return out


def containers_of(r: redis.Redis, shared_name: str, *, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The containers holding an accumulator named ``shared_name`` (for a "did you mean
    --container ...?" hint), sorted."""
    infos = list_accumulators(r, None, prefix=prefix)
    return sorted({i.container for i in infos if i.shared_name == shared_name})
