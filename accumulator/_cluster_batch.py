"""Batches on a Redis Cluster for the synchronous driver: one pipeline per node the commands'
keys go to (every node at once, on threads shared by the process), a durability ``WAIT``
ending each, and the redirects of a slot on the move turned into transient errors (the batch is
sent again, whole: its commands are idempotent). The asyncio twins are in ``aio/_core.py``."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import redis

from . import _forks
from ._requests import Batch
from ._routing import (
    by_node,
    join_by_node,
    moved_error,
    raise_first_error,
    routing_keys,
    split_by_node,
)


def per_node(client: Any, request: Batch, cluster: bool) -> list[Any]:
    """A batch with a ``tail``: on a cluster, one pipeline per node its commands' keys
    go to, each ending with the tail; the replies in order, then the tails' replies."""
    assert request.tail is not None
    if not cluster:
        pipe = client.pipeline(transaction=False)
        for command in (*request.commands, request.tail):
            pipe.execute_command(*command)
        whole = list(range(len(request.commands)))
        return join_by_node(request, [(whole, list(pipe.execute(raise_on_error=False)))])
    # every node at once (each waits for its own replicas)
    return join_by_node(request, on_nodes(client, split_by_node(client, request)))


def on_nodes(
    client: Any, parts: list[tuple[Any, list[int], Batch]]
) -> list[tuple[list[int], list[Any]]]:
    """Each ``(node, indices, batch)`` sent on its node (:func:`on_node`), every node at once
    (one of them on this thread); ``(indices, replies)`` per node."""
    if len(parts) == 1:
        node, indices, sub = parts[0]
        return [(indices, on_node(client, sub, node))]
    futures = [(indices, node_threads().submit(on_node, client, sub, node))
               for node, indices, sub in parts]  # fmt: skip
    return [(indices, f.result()) for indices, f in futures]


_THREADS: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made them, them)
_THREADS_LOCK = threading.Lock()
_forks.renew_lock_after_fork(globals(), "_THREADS_LOCK")


def node_threads() -> ThreadPoolExecutor:
    """The threads that send one pipeline per cluster node at once (created when needed,
    shared by every accumulator of the process; a forked child makes its own: the parent's
    threads do not exist there)."""
    global _THREADS
    with _THREADS_LOCK:
        if _THREADS is None or _THREADS[0] != os.getpid():
            pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="accumulator-node")
            _THREADS = (os.getpid(), pool)
        return _THREADS[1]


def on_node(client: Any, request: Batch, node: Any = None) -> list[Any]:
    """A batch on one connection to the node serving its ``node_key`` (or ``node``): a
    cluster pipeline would send a keyless WAIT elsewhere. A slot on the move or a failover in
    progress (MOVED, ASK, TRYAGAIN, CLUSTERDOWN in a reply) refreshes the slot map and raises
    a transient error: the batch is sent again, whole (its commands are idempotent)."""
    if node is None:
        node = client.get_node_from_key(request.node_key)
    pipe = client.get_redis_connection(node).pipeline(transaction=False)
    for command in request.commands:
        pipe.execute_command(*command)
    try:
        replies: list[Any] = pipe.execute(raise_on_error=False)
    except (redis.ConnectionError, redis.TimeoutError):
        with contextlib.suppress(redis.RedisError, OSError):  # the node may be gone for now
            client.nodes_manager.initialize()
        raise
    moved = moved_error(request.what, replies)
    if moved is not None:
        client.nodes_manager.initialize()
        raise moved
    return raise_first_error(replies) if request.raise_on_error else replies


def is_script(command: tuple[Any, ...]) -> bool:
    return str(command[0]).upper() in ("EVALSHA", "EVAL")


def by_node_batch(client: Any, request: Batch) -> list[Any]:
    """A batch of script calls on a cluster: one pipeline per node its commands' keys go to
    (every node at once), the replies in order. Not redis-py's cluster pipeline: it asks a
    server for the keys of every EVALSHA in it (``COMMAND GETKEYS``: a round trip per script
    call, redis-py 8.1)."""
    keys = routing_keys(request.commands)
    if keys is None:  # a keyless command: redis-py routes it
        pipe = client.pipeline(transaction=False)
        for command in request.commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=request.raise_on_error))
    parts = [
        (node, indices, replace(request, commands=[request.commands[i] for i in indices],
                                raise_on_error=False, node_key=None))
        for node, indices in by_node(client, keys).values()
    ]  # fmt: skip
    out: list[Any] = [None] * len(request.commands)
    for indices, replies in on_nodes(client, parts):
        for i, reply in zip(indices, replies, strict=True):
            out[i] = reply
    return raise_first_error(out) if request.raise_on_error else out


def each(client: Any, command: tuple[Any, ...], raise_on_error: bool) -> Any:
    """One command of a batch that a cluster pipeline cannot route (SCRIPT LOAD: every
    primary); its error as the reply unless ``raise_on_error``."""
    try:
        return client.execute_command(*command)
    except redis.ResponseError as exc:
        if raise_on_error:
            raise
        return exc
