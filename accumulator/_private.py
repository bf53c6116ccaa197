"""What closing a private accumulator deletes, found by what its keys name, not by SCAN.

A SCAN walks the whole keyspace: on a Redis shared with three million other keys it made every
``close()`` of a private accumulator take ~3 s (and as much of the server's time). Everything a
private accumulator holds is named by its fixed keys instead: the round's payloads by the
entries of ``:g``, the claimed rounds by the claim registry and the takers' records (FIFO and
leases), their payloads by the claims' entries, spread parts by ``:o``, retry records by the
client ids of the object that closes it. What none of them names (a payload whose apply was
cut short before its script ran; the retry records of another object given the
accumulator's ref by hand) carries an expiry and goes with it (an hour, ten minutes at most).

:func:`delete_ops` is the plan (sans-I/O: a generator of :class:`Batch` requests); the sync
and asyncio ``close()`` run it with :func:`run` and its awaited twin in ``aio/_core.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import redis

from ._keys import Keys
from ._requests import Batch, Ops, advance

#: A taker id as the library makes them (``<pid>-<hex>``); anything else read back from
#: Redis is untrusted and names no claim.
_TAKER_ID = re.compile(rb"[0-9]+-[0-9a-f]+\Z")
_UNLINK_BATCH = 500


def delete_ops(keys: Keys, client_ids: Iterable[str]) -> Ops[int]:
    """Delete a private accumulator's keys; returns how many existed. Three round trips: read
    what names the others, read the claimed rounds, unlink (a few hundred keys a command)."""
    what = "close"
    entries, orphans, claims, info, waiting = yield Batch(what, [
        ("LRANGE", keys.grads, 0, -1), ("ZRANGE", keys.orphans, 0, -1),
        ("HGETALL", keys.claims), ("HGETALL", keys.taker_info), ("ZRANGE", keys.takers, 0, -1),
    ])  # fmt: skip
    # (a finished take's claim is gone: lua/finish.lua unlinks it)
    claim_keys = named_claims(keys, claims or {}, info or {}, waiting)
    claimed: list[Any] = []
    if claim_keys:
        for round_ in (yield Batch(what, [("LRANGE", c, 1, -1) for c in claim_keys])):
            claimed += round_
    named = [e for e in [*entries, *claimed] if isinstance(e, bytes)]
    registered = [m for m in orphans if isinstance(m, bytes)]
    doomed: list[str | bytes] = [*keys.fixed, *claim_keys]
    doomed += [keys.dedup(cid) for cid in client_ids]
    doomed += [*keys.payload_keys(named), *keys.orphan_parts(registered)]
    removed = 0
    for i in range(0, len(doomed), _UNLINK_BATCH):
        # one key a command: on a cluster, spread parts are in other slots
        replies = yield Batch(what, [("UNLINK", k) for k in doomed[i : i + _UNLINK_BATCH]])
        removed += sum(int(n) for n in replies)
    return removed


def named_claims(keys: Keys, *taker_lists: Iterable[Any]) -> list[str]:
    """The claim keys of the takers the registries name (the claim registry's and the
    takers' records' fields, the FIFO's members), sorted; read back from Redis, anything
    that is not a taker id as the library makes them names nothing."""
    takers = {t for ids in taker_lists for t in ids if isinstance(t, bytes) and _TAKER_ID.match(t)}
    return [keys.claim(t.decode()) for t in sorted(takers)]


def run(client: redis.Redis, ops: Ops[int]) -> int:
    """Run :func:`delete_ops` on a synchronous client (no retries: closing is best effort,
    what is left expires)."""
    reply: Any = None
    while True:
        done, request = advance(ops, reply, None)
        if done:
            return int(request)
        pipe = client.pipeline(transaction=False)
        for command in request.commands:
            pipe.execute_command(*command)
        reply = pipe.execute()
