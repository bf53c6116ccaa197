"""``accumulator.aio``'s module-level operations: the synchronous ones (``_functions``), run in
a worker thread so that the event loop keeps turning (they are administrative, not on the
training path)."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from .. import _admin, _functions
from .._connection import twin_client


def _sync_client(client: aioredis.Redis | str | None) -> redis.Redis | str | None:
    return client if client is None or isinstance(client, str) else twin_client(client)


async def reset_container(container: str, *, client: aioredis.Redis | str | None = None) -> int:
    """Delete every accumulator of ``container``; returns how many were deleted (see
    :func:`accumulator.reset_container`)."""
    sync = _sync_client(client)
    return await asyncio.to_thread(_functions.reset_container, container, client=sync)


async def list_accumulators(
    container: str | None = None, *, client: aioredis.Redis | str | None = None
) -> list[_admin.Info]:
    """Every accumulator (of one container, or of all): see
    :func:`accumulator.list_accumulators`."""
    sync = _sync_client(client)
    return await asyncio.to_thread(_functions.list_accumulators, container, client=sync)
