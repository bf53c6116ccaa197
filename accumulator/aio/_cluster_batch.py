"""The asyncio twins of ``accumulator._cluster_batch``: a batch of an accumulator's commands
sent per node of a Redis Cluster (or on one node), redirects and lost nodes said as
transient errors (the batch is sent again, whole)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis

from .. import _scripts
from .._requests import Batch
from .._routing import is_cluster, join_by_node, moved_error, raise_first_error, split_by_node
from ._connection import node_client


async def per_node(client: Any, request: Batch) -> list[Any]:
    """The asyncio twin of ``_cluster_batch.per_node``: one pipeline per node (concurrently), each
    ending with the batch's ``tail``; the replies in order, then the tails' replies."""
    assert request.tail is not None
    if not is_cluster(client):
        pipe = client.pipeline(transaction=False)
        for command in (*request.commands, request.tail):
            pipe.execute_command(*command)
        whole = list(range(len(request.commands)))
        return join_by_node(request, [(whole, list(await pipe.execute(raise_on_error=False)))])
    await client.initialize()
    parts = split_by_node(client, request)
    done = await asyncio.gather(*(on_node(client, sub, node) for node, _, sub in parts))
    pairs = zip(parts, done, strict=True)
    return join_by_node(request, [(indices, replies) for (_, indices, _), replies in pairs])


async def on_node(client: Any, request: Batch, node: Any = None) -> list[Any]:
    """The asyncio twin of ``_cluster_batch.on_node``: a batch on one connection to the node serving
    its ``node_key`` (or ``node``); a redirect or a lost node refreshes the slot map and
    raises a transient error (the batch is sent again, whole)."""
    await client.initialize()
    if node is None:
        node = client.get_node_from_key(request.node_key)
    pipe = node_client(client, node).pipeline(transaction=False)
    for command in request.commands:
        pipe.execute_command(*command)
    try:
        replies = list(await pipe.execute(raise_on_error=False))
    except (redis.ConnectionError, redis.TimeoutError):
        with contextlib.suppress(redis.RedisError, OSError):  # the node may be gone for now
            await client.nodes_manager.initialize()
        raise
    moved = moved_error(request.what, replies)
    if moved is not None:
        await client.nodes_manager.initialize()
        raise moved
    return raise_first_error(replies) if request.raise_on_error else replies


async def each(client: Any, command: tuple[Any, ...], raise_on_error: bool) -> Any:
    """One command of a batch that a cluster pipeline cannot route (SCRIPT LOAD: every
    primary); its error as the reply unless ``raise_on_error``."""
    try:
        return await _scripts.execute_async(client, command)
    except redis.ResponseError as exc:
        if raise_on_error:
            raise
        return exc
