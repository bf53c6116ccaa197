"""redis.asyncio connections of the asyncio accumulators: like the synchronous ones
(``accumulator._connection``), a pool for commands and one for blocking waits, shared by every
accumulator opened from one client object or URL string, with explicit timeouts and retries."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import AbstractConnection as AsyncAbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import ResponseError

from .. import _forks, _scripts
from .._cluster_client import node_settings, require_cluster_client, tls_settings
from .._connection import blocking_timeout, cluster_timeouts, retry_extras, sentinel_pool_like
from .._direct import as_pipeline_reply, direct, direct_pool
from .._packer import pack
from .._routing import raise_first_error
from .._shares import release
from .._urls import (
    CONNECT_TIMEOUT,
    LOGIN_REFUSED,
    NOT_RETRIED_BY_REDIS_PY,
    RETRIED_BY_REDIS_PY,
    SOCKET_TIMEOUT,
    Unretried,
    check_url,
    cluster_url,
    default_url,
    pool_guard,
    sentinel_parts,
    url_options,
)
from ._receive import close_reader


@dataclass
class AsyncConnections:
    """The two clients of one asyncio accumulator (a share of them: see :func:`connect`)."""

    commands: aioredis.Redis
    blocking: aioredis.Redis  # BLPOP waits and subscriptions only: never capped
    _key: object = None
    _released: bool = False

    def let_go(self) -> None:
        """Release this share (once) without closing anything: from another event loop than
        the clients', which can be neither used nor closed there (they go with their loop)."""
        release(self, _SHARED, _LOCK)

    async def close(self) -> None:
        """Release this share (once); the pools close with the last share."""
        if not release(self, _SHARED, _LOCK):
            return
        for client in (self.blocking, self.commands):
            for node in getattr(client, "_accumulator_nodes", {}).values():
                await node.aclose()
            close_reader(client)
            await client.aclose()
            pool = getattr(client, "connection_pool", None)  # a cluster client has none
            if pool is not None:
                await pool.disconnect()


@dataclass
class _Entry:
    commands: aioredis.Redis
    blocking: aioredis.Redis
    users: int
    origin: object
    loop: asyncio.AbstractEventLoop


#: Shared clients, keyed like the synchronous ones, per event loop (a redis.asyncio
#: connection belongs to the loop that opened it).
_SHARED: dict[object, _Entry] = {}
_LOCK = threading.Lock()
_forks.renew_lock_after_fork(globals(), "_LOCK")


_RETRY_EXTRA = retry_extras(Retry)  # (redis.asyncio's Retry)


class _Retry(Retry):
    """As the synchronous clients' (``accumulator._connection._Retry``): connection faults
    retried, timeouts not, but still given to redis-py's failure handler, which drops the
    connection (a late reply left in it would be read by the next command)."""

    async def call_with_retry(self, do: Callable[[], Awaitable[Any]],
                              fail: Callable[..., Any],
                              is_retryable: Callable[[Exception], bool] | None = None,
                              with_failure_count: bool = False) -> Any:  # fmt: skip
        async def once() -> Any:
            try:
                return await do()
            except (*NOT_RETRIED_BY_REDIS_PY, *LOGIN_REFUSED) as error:
                if with_failure_count:
                    await fail(error, self._retries + 1)  # a last failure: nothing retried
                else:
                    await fail(error)
                if isinstance(error, LOGIN_REFUSED):
                    raise Unretried(error) from None
                raise

        extra: tuple[Any, ...] = (is_retryable, with_failure_count)[:_RETRY_EXTRA]
        try:
            return await super().call_with_retry(once, fail, *extra)
        except Unretried as refused:
            raise refused.error from None


def _retry() -> Retry:
    return _Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3,
                  supported_errors=RETRIED_BY_REDIS_PY)  # fmt: skip


def _check_client(client: object) -> None:
    if isinstance(client, redis.Redis) or hasattr(client, "nodes_manager"):
        raise TypeError(
            f"{type(client).__module__}.{type(client).__name__} is a synchronous client; "
            "accumulator.aio's classes take a redis.asyncio.Redis, a "
            "redis.asyncio.cluster.RedisCluster or a URL (accumulator.ConditionalAccumulator "
            "takes a redis.Redis)"
        )
    raise TypeError(
        f"client must be a redis.asyncio.Redis, a URL or None, not {type(client).__name__}"
    )


def _derive(pool: Any, *, limit: bool, socket_timeout: float) -> aioredis.Redis:
    """A client like the one given (same server, credentials, connection class and, with
    ``limit``, pool class and size), replying bytes, with our timeouts and retries (the
    client's own retried timeouts, ten times: see the synchronous ``_retry_settings``)."""
    kwargs = dict(pool.connection_kwargs)
    kwargs.pop("retry_on_timeout", None)
    kwargs.update(decode_responses=False, socket_timeout=socket_timeout, retry=_retry(),
                  retry_on_error=list(RETRIED_BY_REDIS_PY),
                  **pool_guard(aioredis.ConnectionPool))  # fmt: skip
    size: dict[str, Any] = {}
    if limit:
        most = getattr(pool, "max_connections", None)
        if isinstance(most, int) and most < 2**31:
            size["max_connections"] = most
        if isinstance(pool, aioredis.BlockingConnectionPool):
            size["timeout"] = pool.timeout
    if isinstance(pool, AsyncSentinelPool):
        new_pool: aioredis.ConnectionPool = sentinel_pool_like(
            AsyncSentinelPool, pool, {**size, **kwargs}
        )
    else:
        pool_class = type(pool) if limit else aioredis.ConnectionPool
        new_pool = pool_class(connection_class=pool.connection_class, **size, **kwargs)
    return aioredis.Redis(connection_pool=new_pool)


#: What ``client=`` accepts: an asyncio client, an asyncio cluster client, a URL, or None.
AsyncClient: TypeAlias = "aioredis.Redis | AsyncRedisCluster | str | None"


async def pooled(pool: Any, command_name: str) -> Any:
    """A connection of ``pool`` (redis-py before 5.3 wants the command's name)."""
    try:
        return await pool.get_connection()
    except TypeError:
        return await pool.get_connection(command_name)


async def execute(client: Any, command: Sequence[Any]) -> Any:
    """The asyncio twin of :func:`accumulator._direct.execute` (script calls on a plain
    client's pooled connection, directly); anything else through
    :func:`accumulator._scripts.execute_async`. A cancelled call drops its connection (its
    reply may still come)."""
    pool = direct_pool(client)
    if pool is None:
        return await _scripts.execute_async(client, command)
    conn = await pooled(pool, command[0])
    if not isinstance(conn, AsyncAbstractConnection):
        await pool.release(conn)
        return await _scripts.execute_async(client, command)
    try:
        await send(conn, pack(*command))
        return await conn.read_response()
    except ResponseError:
        raise
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)


async def send(conn: Any, pieces: list[Any]) -> None:
    """Send a packed command (or batch) on ``conn``.

    A command packed into one piece (every small one) is written to the connection's stream
    straight away: redis.asyncio's ``send_packed_command`` runs each write in a task of its own
    (``asyncio.wait_for``, for the socket timeout), which with its Python packing was a fifth
    of a small apply's time. The socket timeout still bounds a write the kernel cannot take at
    once (the transport holds the rest: then we wait for it to drain, bounded). A connection
    not connected yet, one with health checks, or one already closing is sent to as
    redis.asyncio sends; so are several pieces (see :func:`_send_pieces`)."""
    writer = getattr(conn, "_writer", None)
    if (len(pieces) != 1 or not isinstance(writer, asyncio.StreamWriter)
            or writer.transport.is_closing() or conn.health_check_interval):  # fmt: skip
        await _send_pieces(conn, pieces)
        return
    writer.write(pieces[0])
    if writer.transport.get_write_buffer_size():  # (0: all of it in the kernel's buffer)
        await _drained(writer, conn.socket_timeout)


async def _drained(writer: asyncio.StreamWriter, timeout: float | None) -> None:
    """``writer.drain()`` within the socket timeout; its failures as redis-py's errors."""
    try:
        await asyncio.wait_for(writer.drain(), timeout)
    except TimeoutError:
        raise redis.TimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        raise redis.ConnectionError(f"writing to socket: {exc}") from exc


async def _send_pieces(conn: Any, pieces: list[Any]) -> None:
    """Send a packed batch. Before Python 3.12 asyncio's ``writelines`` joins its pieces into
    one ``bytes`` (a copy of every payload part, 16 MiB for a 16 MiB apply): a batch of several
    pieces is written piece by piece (the transport sends what the socket takes from the
    caller's buffer, and copies only the rest), draining after each."""
    writer = getattr(conn, "_writer", None)
    if len(pieces) == 1 or sys.version_info >= (3, 12) or not isinstance(
            writer, asyncio.StreamWriter):  # fmt: skip
        await conn.send_packed_command(pieces)
        return
    await conn.send_packed_command(pieces[:1])  # connects, checks health, as always
    for piece in pieces[1:]:
        writer.write(piece)
        await _drained(writer, conn.socket_timeout)


def _packed(commands: Sequence[Sequence[Any]]) -> list[Any]:
    """The pieces of a batch, as :func:`accumulator._packer.pack` packs each command; the
    small commands' packed bytes joined (one piece when none has a big value)."""
    pieces: list[Any] = []
    small: list[bytes] = []
    for command in commands:
        packed = pack(*command)
        if len(packed) == 1:
            small.append(packed[0])  # type: ignore[arg-type]
            continue
        if small:
            pieces.append(b"".join(small))
            small = []
        pieces.extend(packed)
    if small:
        pieces.append(b"".join(small))
    return pieces


async def execute_batch(client: Any, commands: Sequence[Sequence[Any]],
                        raise_on_error: bool) -> list[Any] | None:  # fmt: skip
    """The asyncio twin of :func:`accumulator._direct.execute_batch`: None when these
    commands or this client are not for it."""
    pool = direct_pool(client)
    if pool is None or not direct(commands):
        return None
    conn = await pooled(pool, "EVALSHA")
    if not isinstance(conn, AsyncAbstractConnection):
        await pool.release(conn)
        return None
    replies: list[Any] = []
    try:
        await send(conn, _packed(commands))
        for command in commands:
            try:
                replies.append(as_pipeline_reply(command, await conn.read_response()))
            except ResponseError as exc:
                replies.append(exc)
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)
    return raise_first_error(replies) if raise_on_error else replies


def is_cluster(client: Any) -> bool:
    """Whether an asyncio client talks to a Redis Cluster."""
    return isinstance(client, AsyncRedisCluster)


def _cluster(client: Any, socket_timeout: float) -> Any:
    """An asyncio cluster client like the one given (its nodes and credentials; a URL's),
    replying bytes, with our timeouts."""
    require_cluster_client()
    # no retries of its own (as the synchronous cluster clients': _cluster_client.cluster_retry)
    settings: dict[str, Any] = dict(decode_responses=False, socket_timeout=socket_timeout,
                                    socket_connect_timeout=CONNECT_TIMEOUT,
                                    retry=Retry(NoBackoff(), retries=0))  # fmt: skip
    if isinstance(client, str):
        return AsyncRedisCluster.from_url(client, **settings)
    from redis.asyncio.cluster import ClusterNode

    given = client.connection_kwargs
    kwargs: dict[str, Any] = {k: v for k, v in given.items()
                              if k in ("username", "password", "client_name",
                                       "max_connections")}  # fmt: skip
    kwargs.update(tls_settings(given, AsyncRedisCluster))
    nodes = [ClusterNode(n.host, n.port) for n in client.get_nodes()] or [
        ClusterNode(n.host, n.port) for n in client.startup_nodes
    ]  # fmt: skip
    return AsyncRedisCluster(startup_nodes=nodes, **kwargs, **settings)


def node_client(cluster: Any, node: Any) -> aioredis.Redis:
    """A plain asyncio client of one node of our cluster client (kept on it, closed with
    it): a batch that must stay on one connection (a WAIT after its writes) goes there."""
    cache: dict[str, aioredis.Redis] = cluster.__dict__.setdefault("_accumulator_nodes", {})
    client = cache.get(node.name)
    if client is None:
        kwargs = node_settings(cluster.connection_kwargs)
        client = aioredis.Redis(host=node.host, port=node.port, retry=_retry(), **kwargs)
        cache[node.name] = client
    return client


def _url_client(url: str) -> aioredis.Redis:
    sentinel = sentinel_parts(url)
    if sentinel is not None:  # redis-py's from_url does not take this scheme
        addresses, service, options = sentinel
        client: aioredis.Redis = AsyncSentinel(
            addresses, socket_timeout=CONNECT_TIMEOUT
        ).master_for(service, retry=_retry(), **options)
        return client
    return aioredis.Redis.from_url(url, retry=_retry(), **url_options(url),
                                   **pool_guard(aioredis.ConnectionPool))  # fmt: skip


def connect(client: AsyncClient) -> AsyncConnections:
    """The clients for a URL, for a ``redis.asyncio.Redis`` (its settings are kept), or for
    the default URL (``ACCUMULATOR_REDIS_URL``, ``REDIS_URL``, ``redis://localhost``). No I/O:
    the pools connect on first use. Call from the event loop that will use them."""
    if client is None:
        client = default_url()
    if isinstance(client, str):
        key: object = ("url", hashlib.sha256(client.encode()).hexdigest())
    elif isinstance(client, aioredis.Redis):
        key = ("pool", id(client.connection_pool))
    elif isinstance(client, AsyncRedisCluster):
        key = ("cluster", id(client))
    else:
        _check_client(client)
        raise AssertionError  # _check_client raised
    loop = asyncio.get_running_loop()
    key = (key, id(loop))
    origin: object = None if isinstance(client, str) else getattr(client, "connection_pool",
                                                                 client)  # fmt: skip
    with _LOCK:
        entry = _SHARED.get(key)
        if entry is not None and entry.origin is origin and entry.loop is loop:
            entry.users += 1
            return AsyncConnections(entry.commands, entry.blocking, key)
        if isinstance(client, str):
            check_url(client)
        plain = cluster_url(client) if isinstance(client, str) else None
        if plain is not None or isinstance(client, AsyncRedisCluster):
            source, timeout, waits = cluster_timeouts(plain or client)
            commands = _cluster(source, timeout)
            blocking = _cluster(source, waits)
            _SHARED[key] = _Entry(commands, blocking, 1, origin, loop)
            return AsyncConnections(commands, blocking, key)
        base = _url_client(client) if isinstance(client, str) else client
        pool = base.connection_pool
        timeout = pool.connection_kwargs.get("socket_timeout") or SOCKET_TIMEOUT
        commands = _derive(pool, limit=True, socket_timeout=timeout)
        blocking = _derive(pool, limit=False, socket_timeout=blocking_timeout(timeout))
        _SHARED[key] = _Entry(commands, blocking, 1, origin, loop)
        return AsyncConnections(commands, blocking, key)
