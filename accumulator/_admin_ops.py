"""Changing accumulators from the CLI: set the step, drop the pending round, delete one or a
whole container. Every key name comes from :mod:`accumulator._keys`; round entries read back
from Redis are untrusted (only an accumulator's own payload keys are deleted)."""

from __future__ import annotations

import redis

from . import _scripts
from ._admin_read import _not_found, _scan, list_accumulators
from ._errors import InvalidArgumentError, NotFoundError
from ._keys import DEFAULT_PREFIX, SCHEMA_VERSION, Keys


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
