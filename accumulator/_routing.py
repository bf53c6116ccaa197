"""Routing commands on a Redis Cluster: which node a command's key lives on, a batch split by
node and its replies joined back, redirects recognised. No I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn, cast

import redis
from redis.cluster import RedisCluster


def is_cluster(client: Any) -> bool:
    """Whether a client talks to a Redis Cluster (``redis.cluster.RedisCluster``)."""
    return isinstance(client, RedisCluster)


def raise_slot_moving(client: Any, exc: Exception) -> NoReturn:
    """Raise what a transaction (MULTI/EXEC) redirected with ASK means: on a cluster client,
    whose transactions redis-py does not follow through a slot's migration, a
    ``TryAgainError`` (retried within the window, until the slot has moved); on a plain
    client ``exc`` itself (a node of a cluster reached by a plain URL: the retry layer says
    so)."""
    if not is_cluster(client):
        raise exc
    raise redis.exceptions.TryAgainError(f"the slot is being migrated ({exc})") from exc


def is_redirect(reply: Exception) -> bool:
    """Whether an error reply means "not here, not now" on a cluster: MOVED, ASK, TRYAGAIN,
    CLUSTERDOWN (redis-py parses some into their own classes; the text covers the rest)."""
    if isinstance(reply, (redis.exceptions.MovedError, redis.exceptions.AskError,
                          redis.exceptions.TryAgainError,
                          redis.exceptions.ClusterDownError)):  # fmt: skip
        return True
    return str(reply).split(" ", 1)[0] in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")


def by_node(client: Any, keys: Sequence[str | bytes]) -> dict[str, tuple[Any, list[int]]]:
    """On a cluster client (sync or asyncio, slot map loaded): node name -> (the primary
    serving some of ``keys``, the indices of those keys), from the client's slot map."""
    nodes: dict[str, tuple[Any, list[int]]] = {}
    for i, key in enumerate(keys):
        node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
        nodes.setdefault(node.name, (node, []))[1].append(i)
    return nodes


def command_key(command: Sequence[Any]) -> str | bytes | None:
    """The key a command is routed by on a cluster: an EVALSHA's first key, another
    command's first argument; None for a script call without keys."""
    name = str(command[0]).upper()
    if name in ("EVALSHA", "EVAL"):
        return command[3] if int(command[2]) > 0 else None
    return command[1] if len(command) > 1 else None


def routing_keys(commands: Sequence[Sequence[Any]]) -> list[str | bytes] | None:
    """Each command's :func:`command_key`; None when one has none."""
    keys = [command_key(command) for command in commands]
    return None if any(key is None for key in keys) else cast("list[str | bytes]", keys)


def split_by_node(client: Any, request: Any) -> list[tuple[Any, list[int], Any]]:
    """A ``_requests.Batch`` with a ``tail``, for a cluster client: per node its commands'
    keys go to, (the node, the indices of its commands, a batch of those commands then the
    tail, replies unraised)."""
    from dataclasses import replace

    keys = routing_keys(request.commands)
    if keys is None:
        raise ValueError(f"{request.what}: a command without a key cannot be routed by node")
    groups = by_node(client, keys).values()
    return [
        (node, indices, replace(request, commands=[*(request.commands[i] for i in indices),
                                                   request.tail], raise_on_error=False, tail=None))
        for node, indices in groups
    ]  # fmt: skip


def join_by_node(request: Any, done: list[tuple[list[int], list[Any]]]) -> list[Any]:
    """The replies of a batch with a ``tail`` sent in parts (each: the indices of its
    commands, their replies then the tail's): the commands' replies in order (the first error
    raised, if the batch says so), then the list of the tails' replies."""
    out: list[Any] = [None] * len(request.commands)
    tails = []
    for indices, replies in done:
        tails.append(replies[-1])
        for i, reply in zip(indices, replies[:-1], strict=True):
            out[i] = reply
    return [*(raise_first_error(out) if request.raise_on_error else out), tails]


def moved_error(what: str, replies: list[Any]) -> redis.ConnectionError | None:
    """For a batch sent to one node of a cluster: the transient error to raise (after
    refreshing the slot map) when a reply is a redirect, else None."""
    for reply in replies:
        if isinstance(reply, redis.ResponseError) and is_redirect(reply):
            return redis.ConnectionError(f"{what}: the slot moved ({reply}); sending again")
    return None


def raise_first_error(replies: list[Any]) -> list[Any]:
    """The replies, or the first error among them raised."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies
