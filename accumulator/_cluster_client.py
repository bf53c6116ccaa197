"""Our Redis Cluster clients: built like the one given (its nodes, credentials and TLS),
with our packer, timeouts and no retries of their own (our retry window decides), and the
redis-py version check. The asyncio driver's are in ``aio/_connection``."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from . import _retry as retrying
from ._errors import FailedPreconditionError
from ._packer import _PACKER
from ._urls import CONNECT_TIMEOUT


def cluster_retry() -> Retry:
    """A cluster client's own retries: none. It refreshes its slot map at a fault and
    follows MOVED/ASK itself, then the fault goes to our retry window (``_retry.py``), the
    one policy. Its default retried every fault, timeouts too, three times with a slot-map
    refresh each: a frozen primary held an apply ~11 socket timeouts per try of the window
    (22 s with a 1 s socket timeout and ``retry_window=1``; ~11 minutes with the default)."""
    return Retry(NoBackoff(), retries=0)


def twin_cluster(client: Any) -> RedisCluster:
    """A redis-py cluster client of the cluster that a ``redis.asyncio.cluster.RedisCluster``
    talks to: its nodes (those it knows, else its start-up nodes) and credentials."""
    from redis.cluster import ClusterNode

    nodes = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
    kwargs = node_settings(client.connection_kwargs)
    return RedisCluster(startup_nodes=[ClusterNode(n.host, n.port) for n in nodes], **kwargs)


def tls_settings(connection_kwargs: dict[str, Any], target: Any) -> dict[str, Any]:
    """The TLS settings among a client's connection settings that ``target`` (a client class)
    takes: every ``ssl_*`` one it has a parameter for (CA, certificate, host name check,
    minimum version, ...), and ``ssl=True`` when they name a TLS connection class (how
    redis-py's asyncio clients record ``ssl=True``)."""
    params = inspect.signature(target).parameters
    out = {k: v for k, v in connection_kwargs.items() if k.startswith("ssl") and k in params}
    if "SSL" in getattr(connection_kwargs.get("connection_class"), "__name__", ""):
        out["ssl"] = True
    if "ssl" not in params:
        out.pop("ssl", None)
    return out


def node_settings(connection_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a client of one node needs from an asyncio cluster client's connection settings:
    credentials, timeouts, name, protocol, and TLS (all of it)."""
    from redis.asyncio import Redis as AsyncRedis

    kwargs = {k: v for k, v in connection_kwargs.items()
              if k in ("username", "password", "client_name", "protocol", "socket_timeout",
                       "socket_connect_timeout")}  # fmt: skip
    return {**kwargs, **tls_settings(connection_kwargs, AsyncRedis)}


def new_cluster(make: Callable[[], RedisCluster]) -> RedisCluster:
    """``make()``, a cluster client's constructor (which connects, to learn the nodes), its
    failure said our way (:func:`~accumulator._retry.cluster_error`: no node reachable is a
    ``redis.ConnectionError``, retried as any other)."""
    try:
        return make()
    except RedisClusterException as exc:
        ours = retrying.cluster_error(exc)
        if ours is exc:
            raise
        raise ours from exc


#: The oldest redis-py whose cluster client does what ours needs: transactions on one slot
#: (MULTI/EXEC through its pipeline) with their replies parsed, and pub/sub.
CLUSTER_REDIS_PY = (8, 0)


def require_cluster_client() -> None:
    """:class:`FailedPreconditionError` when this redis-py is too old for a Redis Cluster
    (5.x's cluster pipeline refuses transactions, 6.0's cluster client has no pub/sub for the
    sync helper, and up to 7.x a cluster transaction's replies come back unparsed): said at
    the connection, not as a confusing failure in the middle of a take."""
    version = tuple(int(x) for x in re.findall(r"\d+", redis.__version__)[:2])
    if version < CLUSTER_REDIS_PY:
        raise FailedPreconditionError(
            f"Redis Cluster needs redis-py >= {'.'.join(map(str, CLUSTER_REDIS_PY))} (this "
            f"is {redis.__version__}); plain servers and Sentinel work from 5.3: "
            f"pip install -U 'redis>={'.'.join(map(str, CLUSTER_REDIS_PY))}'"
        )


def cluster_client(client: RedisCluster | str, socket_timeout: float) -> Any:
    """A cluster client like the one given (its nodes, credentials and TLS; a URL's), that
    replies bytes, with our timeouts and retries."""
    require_cluster_client()
    settings: dict[str, Any] = dict(decode_responses=False, socket_timeout=socket_timeout,
                                    socket_connect_timeout=CONNECT_TIMEOUT,
                                    retry=cluster_retry())  # fmt: skip
    if isinstance(client, str):
        url = client
        return _zero_copy_nodes(new_cluster(lambda: RedisCluster.from_url(url, **settings)))
    from redis.cluster import ClusterNode

    given = client.nodes_manager.connection_kwargs
    kwargs: dict[str, Any] = {k: v for k, v in given.items()
              if k in ("username", "password", "client_name", "protocol",
                       "max_connections")}  # fmt: skip
    kwargs.update(tls_settings(given, redis.Redis))  # (what RedisCluster passes on to nodes)
    nodes = [ClusterNode(n.host, n.port) for n in client.get_nodes()]
    return _zero_copy_nodes(
        new_cluster(lambda: RedisCluster(startup_nodes=nodes, **kwargs, **settings))
    )


def _zero_copy_nodes(client: RedisCluster) -> RedisCluster:
    """Our packer (big values sent from the caller's buffer, uncopied) on the connections of
    every node of our own cluster client, those it knows and those it meets later. redis-py's
    cluster client has no option for it: its node factory is wrapped (a redis-py without one
    keeps its own packer, which copies)."""
    manager = client.nodes_manager
    create = getattr(manager, "create_redis_node", None)
    if create is None:
        return client

    def create_with_packer(*args: Any, **kwargs: Any) -> redis.Redis:
        node: redis.Redis = create(*args, **kwargs)
        node.connection_pool.connection_kwargs["command_packer"] = _PACKER  # no connection yet
        return node

    manager.create_redis_node = create_with_packer  # type: ignore[method-assign]
    for node in client.get_nodes():
        if node.redis_connection is not None:
            pool = node.redis_connection.connection_pool
            pool.connection_kwargs["command_packer"] = _PACKER
            # connections made from here on use it: the ones it has (the slot map's first
            # query) are closed and dropped, not kept with redis-py's packer
            pool.disconnect()
            pool.reset()
    return client
