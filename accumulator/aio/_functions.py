"""``accumulator.aio``'s module-level operations: the synchronous ones (``_functions``), run in
a worker thread so that the event loop keeps turning (they are administrative, not on the
training path)."""

from __future__ import annotations

import asyncio

from .. import _admin, _functions
from .._cluster_client import twin_cluster
from .._connection import Client, twin_client
from ._connection import AsyncClient, _check_client


def _sync_client(client: AsyncClient) -> Client:
    """The synchronous twin of an asyncio client (a URL as it is); anything else is refused
    as ``accumulator.aio``'s classes refuse it (a synchronous client too)."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    if client is None or isinstance(client, str):
        return client
    if isinstance(client, RedisCluster):
        return twin_cluster(client)
    if isinstance(client, aioredis.Redis):
        return twin_client(client)
    _check_client(client)
    raise AssertionError  # _check_client raised


async def reset_container(container: str, *, client: AsyncClient = None) -> int:
    """Delete every accumulator of ``container``; returns how many were deleted (see
    :func:`accumulator.reset_container`)."""
    sync = _sync_client(client)
    return await asyncio.to_thread(_functions.reset_container, container, client=sync)


async def list_accumulators(
    container: str | None = None, *, client: AsyncClient = None
) -> list[_admin.Info]:
    """Every accumulator (of one container, or of all): see
    :func:`accumulator.list_accumulators`."""
    sync = _sync_client(client)
    return await asyncio.to_thread(_functions.list_accumulators, container, client=sync)


async def describe_accumulator(
    shared_name: str, *, container: str = "", client: AsyncClient = None
) -> _admin.Info:
    """Everything about one accumulator: see :func:`accumulator.describe_accumulator`."""
    sync = _sync_client(client)
    return await asyncio.to_thread(_functions.describe_accumulator, shared_name,
                                   container=container, client=sync)  # fmt: skip


async def delete_accumulator(
    shared_name: str, *, container: str = "", client: AsyncClient = None
) -> int:
    """Delete one accumulator; the number of keys deleted (see
    :func:`accumulator.delete_accumulator`)."""
    sync = _sync_client(client)
    return await asyncio.to_thread(_functions.delete_accumulator, shared_name,
                                   container=container, client=sync)  # fmt: skip
