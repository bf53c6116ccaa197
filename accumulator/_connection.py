"""Redis connections: explicit timeouts and retries, a packer that does not copy big values,
and a separate pool for blocking waits. (URLs and their settings: ``_urls``; the packer:
``_packer``; shared clients: ``_shares``; cluster clients: ``_cluster_client``; routing on a
cluster: ``_routing``.)"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeAlias

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.connection import AbstractConnection
from redis.exceptions import AskError, NoPermissionError, OutOfMemoryError
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from . import _retry as retrying
from . import _shares
from ._cluster_client import cluster_client
from ._errors import AccumulatorError, PermissionDeniedError
from ._packer import _PACKER
from ._retry import RETRY_WINDOW
from ._routing import raise_slot_moving
from ._shares import _SHARED, Connections, _Entry, _release_deferred
from ._urls import (
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
    pop_socket_timeout,
    sentinel_parts,
    url_options,
)

logger = logging.getLogger("accumulator")

#: Seconds one blocking wait (BLPOP) lasts before the taker re-checks and renews its lease.
WAIT_SLICE = 2.0
#: Socket timeout of the connections of blocking waits: a slice plus the take script that rides
#: behind the BLPOP (its reply holds at most 128 KiB of payloads). Not the commands' timeout
#: (30 s): a wait on a node that stopped answering (frozen, partitioned: the failover case)
#: would outlast the take's own deadline by that much.
BLOCKING_TIMEOUT = WAIT_SLICE + 5.0
#: Seconds one blocking wait lasts on a Redis Cluster: a wait on a node the slot has left (a
#: failover, a migration) ends soon.
CLUSTER_WAIT_SLICE = 0.5
#: Seconds ``close()`` gives operations in flight in other threads (tasks) to end before it
#: closes their connections: a take whose wait it cut withdraws from the queue of takers, an
#: apply or take between its script's request and its reply gets that reply.
CLOSE_GRACE = 5.0


def blocking_timeout(socket_timeout: float, wait_slice: float = WAIT_SLICE) -> float:
    """The blocking waits' socket timeout beside commands' of ``socket_timeout``: a slice plus
    at most that (a server that froze under a waiting take is noticed a socket timeout after
    the slice, as a command would notice it; a review measured 7 s with a 1 s timeout)."""
    return wait_slice + min(BLOCKING_TIMEOUT - WAIT_SLICE, max(0.5, socket_timeout))


def cluster_timeouts(source: Any) -> tuple[Any, float, float]:
    """What our two cluster clients are built from (the given cluster client, synchronous or
    asyncio, or a plain URL, without its ``socket_timeout``) and their socket timeouts,
    commands' and waits': the URL's ``?socket_timeout=``, else the given client's own, else
    ours, as for a single server."""
    if isinstance(source, str):
        source, seconds = pop_socket_timeout(source)
    else:  # (the asyncio cluster client keeps its nodes' settings itself)
        given = getattr(source, "nodes_manager", source).connection_kwargs
        seconds = given.get("socket_timeout")
        # redis-py's asyncio cluster client sets 5 s when given none: that is not the user's
        default = inspect.signature(type(source).__init__).parameters.get("socket_timeout")
        if default is not None and seconds == default.default:
            seconds = None
    timeout = seconds or SOCKET_TIMEOUT
    return source, timeout, blocking_timeout(timeout, CLUSTER_WAIT_SLICE)

def retry_extras(retry_class: Any) -> int:
    """How many of (is_retryable, with_failure_count) ``retry_class.call_with_retry`` takes
    (redis-py's synchronous one: none before 7.0, is_retryable from 7.0, both from 8.0; its
    asyncio one: none before 8.0): our subclasses pass on only those."""
    return len(inspect.signature(retry_class.call_with_retry).parameters) - 3


_RETRY_EXTRA = retry_extras(Retry)


class _Retry(Retry):
    """redis-py's ``Retry`` retrying connection faults only (a few quick retries ride out a
    reconnect; the scripts make a re-sent apply or take count once). A timeout is not retried:
    the attempt goes back to the retry window (``_retry.py``), which decides; redis-py
    retrying timeouts too made a frozen server (SIGSTOP, a partition dropping packets) hold an
    apply for 16 socket timeouts whatever the window. It still goes to redis-py's failure
    handler, which drops the connection: some connections (Sentinel-managed ones) do not drop
    themselves at a read timeout, and one put back in the pool handed the late reply to the
    next command (a take read an apply's reply: the failover drill)."""

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> Any:  # fmt: skip
        def once() -> Any:
            try:
                return do()
            except (*NOT_RETRIED_BY_REDIS_PY, *LOGIN_REFUSED) as error:
                if with_failure_count:
                    fail(error, self._retries + 1)  # a last failure: nothing retried
                else:
                    fail(error)
                if isinstance(error, LOGIN_REFUSED):
                    raise Unretried(error) from None
                raise

        extra: tuple[Any, ...] = (is_retryable, with_failure_count)[:_RETRY_EXTRA]
        try:
            return super().call_with_retry(once, fail, *extra)
        except Unretried as refused:
            raise refused.error from None


def _retry() -> Retry:
    return _Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3,
                  supported_errors=RETRIED_BY_REDIS_PY)  # fmt: skip


def _retry_settings() -> dict[str, Any]:
    """Our retries for a pool built from a client's settings: the client's own ``retry`` and
    ``retry_on_error`` replaced (redis-py's default Retry retries timeouts too, ten times: a
    frozen server held a call for 15 socket timeouts whatever the retry window)."""
    return {"retry": _retry(), "retry_on_error": list(RETRIED_BY_REDIS_PY)}


def _pool_kwargs(pool: Any) -> dict[str, Any]:
    """The size limits of a pool, for a pool of ours derived from it."""
    out: dict[str, Any] = {}
    limit = getattr(pool, "max_connections", None)
    if isinstance(limit, int) and limit < 2**31:
        out["max_connections"] = limit
    if _is_blocking(pool):
        out["timeout"] = pool.timeout
    return out


def _is_blocking(pool: Any) -> bool:
    """A pool that waits for a free connection (redis-py's, or valkey-py's twin of it)."""
    return isinstance(pool, redis.BlockingConnectionPool) or (
        type(pool).__name__ == "BlockingConnectionPool"
    )


def sentinel_pool_like(pool_class: Any, pool: Any, kwargs: dict[str, Any],
                       connection_class: Any = None) -> Any:  # fmt: skip
    """A new ``pool_class`` (redis-py's synchronous or asyncio Sentinel-managed pool: both
    take the same arguments) for the service of ``pool``, with the connection settings
    ``kwargs`` (and ``connection_class``, else ``pool``'s). Such a pool finds the current
    primary itself, and again after a failover."""
    settings = {k: v for k, v in kwargs.items() if k != "connection_pool"}  # a proxy to pool
    return pool_class(
        pool.service_name, pool.sentinel_manager, is_master=pool.is_master,
        check_connection=pool.check_connection,
        connection_class=connection_class or pool.connection_class, **settings,
    )  # fmt: skip


_DROPPING: dict[Any, Any] = {}


def _dropping(cls: Any) -> Any:
    """``cls`` (a Sentinel-managed connection class, or a user's subclass of one) whose reads
    drop the connection at any error by default, as a plain connection's do. redis-py's
    Sentinel-managed connection keeps it instead: a read cut by Ctrl-C (or by a timeout, or a
    handshake cut short) put it back in the pool with the reply unread, and the next command
    read the previous one's reply. (Pub/sub reads ask to keep it, and still do.)"""
    made = _DROPPING.get(cls)
    if made is None:

        def read_response(self: Any, *args: Any, disconnect_on_error: bool = True,
                          **kwargs: Any) -> Any:  # fmt: skip
            return cls.read_response(self, *args, disconnect_on_error=disconnect_on_error,
                                     **kwargs)  # fmt: skip

        made = type(cls.__name__, (cls,), {"read_response": read_response,
                                           "__module__": __name__})  # fmt: skip
        _DROPPING[cls] = made
    return made


def _derive(pool: redis.ConnectionPool, *, limit: bool, **overrides: Any) -> redis.Redis:
    """A client like the one given (same server, credentials, class of connection and, with
    ``limit``, the same pool class and size), with our packer and timeouts."""
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(overrides)
    kwargs.update(pool_guard(redis.ConnectionPool))  # (every pool class passes it on)
    if isinstance(pool, SentinelConnectionPool):
        new_pool: redis.ConnectionPool = sentinel_pool_like(
            SentinelConnectionPool, pool, kwargs, _dropping(pool.connection_class)
        )
    elif limit:
        new_pool = pool.__class__(
            connection_class=pool.connection_class, **_pool_kwargs(pool), **kwargs
        )
    else:
        # blocking waits hold a connection each for a wait slice: never capped by the
        # commands' limit (a full pool would fail a take instead of letting it wait)
        new_pool = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=new_pool)


def _check_client(client: object) -> None:
    module = type(client).__module__
    if hasattr(client, "connection_pool") and (
        ".asyncio" in module or callable(getattr(client, "__aenter__", None))
    ):
        raise TypeError(
            f"{type(client).__module__}.{type(client).__name__} is an asyncio client; "
            "accumulator's classes are synchronous: use accumulator.aio's twins with it, or pass "
            "a redis.Redis or valkey.Valkey client or a URL"
        )
    if "cluster" in module.lower() or hasattr(client, "nodes_manager"):
        raise TypeError(
            f"{type(client).__module__}.{type(client).__name__}: of cluster clients, "
            "redis.cluster.RedisCluster is supported (or a redis+cluster:// URL)"
        )
    raise TypeError(
        f"client must be a redis.Redis (plain or Sentinel-managed), a valkey.Valkey, a URL "
        f"or None, not {type(client).__name__}"
    )


_VALKEY_CONNECTIONS: dict[str, Any] = {
    "Connection": redis.Connection,
    "SSLConnection": redis.SSLConnection,
    "UnixDomainSocketConnection": redis.UnixDomainSocketConnection,
}


def twin_client(client: Any) -> redis.Redis:
    """A redis-py client to the server that a ``valkey.Valkey`` or a ``redis.asyncio.Redis``
    client talks to, with its settings (valkey-py is a fork of redis-py, and redis.asyncio
    its asyncio twin: the same connection arguments, other classes)."""
    pool = client.connection_pool
    cls = _VALKEY_CONNECTIONS.get(pool.connection_class.__name__)
    if cls is None:
        raise TypeError(
            f"{type(client).__name__} client with {pool.connection_class.__name__} "
            "connections is not supported; pass a URL or a redis.Redis client"
        )
    accepted: set[str] = set()
    for kind in (cls, redis.Connection, AbstractConnection):  # each passes the rest on
        accepted |= set(inspect.signature(kind).parameters)
    kwargs = {k: v for k, v in pool.connection_kwargs.items()
              if k in accepted and k not in ("retry", "connection_pool", "credential_provider",
                                             "redis_connect_func", "self", "kwargs")}  # fmt: skip
    kwargs.update(_retry_settings())
    pool_class = redis.BlockingConnectionPool if _is_blocking(pool) else redis.ConnectionPool
    kwargs.update(pool_guard(redis.ConnectionPool))
    new_pool = pool_class(connection_class=cls, **_pool_kwargs(pool), **kwargs)
    return redis.Redis(connection_pool=new_pool)


def _is_valkey(client: object) -> bool:
    kind = type(client)
    return kind.__module__.split(".")[0] == "valkey" and kind.__name__ in ("Valkey", "StrictValkey")


class TLSConnection(redis.SSLConnection):
    """redis-py's TLS connection, its handshake bounded by the connect timeout: redis-py runs
    it under the command timeout (30 s here), which a TLS client of a plain server (one that
    never answers the handshake) waited out on every try."""

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:  # redis-py >= 5.1 calls it
        sock.settimeout(self.socket_connect_timeout)
        wrapped = super()._wrap_socket_with_ssl(sock)  # type: ignore[no-untyped-call]
        wrapped.settimeout(self.socket_timeout)
        return wrapped


def require_transactions(r: Any, key: str | bytes) -> None:
    """:class:`PermissionDeniedError` unless the user may run MULTI/EXEC, probed with a
    transaction that only reads ``key``. redis-py sends MULTI, the commands and EXEC in one
    go: when the ACL refuses MULTI, Redis runs the commands one by one, outside any
    transaction, and only EXEC fails (a delete would be half done)."""
    pipe = r.pipeline(transaction=True)
    pipe.exists(key)
    try:
        pipe.execute()
    except OutOfMemoryError:  # MULTI passed the ACL (checked first); see atomically()
        return
    except NoPermissionError as exc:
        raise PermissionDeniedError(
            f"the Redis user may not run transactions (MULTI/EXEC), which this needs; nothing "
            f"was changed (see the README's Security section for what each role needs): {exc}"
        ) from exc


def drop_idle(*clients: Any) -> None:
    """Disconnect the idle connections of the clients' pools (a cluster client's: of each
    node's pool). After an interrupt inside redis-py (Ctrl-C, a signal handler's exception,
    between a command's send and its read) the connection went back to its pool with the
    reply unread, and the next command would read it as its own: redis-py's check of the
    connections it hands out misses a reply still on its way. Best effort."""
    for client in clients:
        try:
            pools = [client.connection_pool] if hasattr(client, "connection_pool") else [
                node.redis_connection.connection_pool for node in client.get_nodes()
                if node.redis_connection is not None
            ]  # fmt: skip
            for pool in pools:
                if not _shares.not_ours(pool):
                    pool.disconnect(inuse_connections=False)
        except Exception:  # noqa: BLE001 - the interrupt is what the caller gets
            logger.debug("dropping idle connections failed", exc_info=True)


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc``, raised out of a Redis call, came from outside it (an interrupt: not
    redis-py's error, nor ours), so that a reply may be left unread (:func:`drop_idle`)."""
    return not isinstance(exc, redis.RedisError | AccumulatorError)


def atomically(r: Any, queue: Callable[[Any], None], raise_on_error: bool = True) -> list[Any]:
    """The replies of the commands ``queue(pipe)`` puts on a pipeline, run as one
    transaction. At maxmemory Redis refuses every command queued in a transaction, a read or
    a delete as well: there they run as a plain pipeline, one after another (the tools that
    free memory must work then; and Redis refuses most writes that could come in between).
    ``raise_on_error=False``: a command's error reply (WRONGTYPE) comes back in its place
    (the others ran: a transaction does not roll back)."""
    pipe = r.pipeline(transaction=True)
    queue(pipe)
    try:
        return list(pipe.execute(raise_on_error=raise_on_error))
    except OutOfMemoryError:
        logger.debug("at maxmemory: the transaction is sent as a plain pipeline")
    except AskError as exc:
        raise_slot_moving(r, exc)
    pipe = r.pipeline(transaction=False)
    queue(pipe)
    return list(pipe.execute(raise_on_error=raise_on_error))


def _url_client(url: str) -> redis.Redis:
    tls = {"connection_class": TLSConnection} if url.startswith("rediss://") else {}
    return redis.Redis.from_url(url, retry=_retry(), **url_options(url), **tls,
                                **pool_guard(redis.ConnectionPool))  # fmt: skip


def connect(client: Client, retry_window: float = RETRY_WINDOW) -> Connections:
    """The clients for a URL, for an existing ``redis.Redis`` or ``valkey.Valkey`` (its
    settings are kept: server, credentials, TLS, pool class and ``max_connections``), or for
    the default URL. Replies are always bytes; the command packer is ours.

    Every accumulator opened from one client object (or one URL string) shares one pool for
    commands, capped like the client's own, and one for blocking waits (a taker waiting holds
    one connection of it); each holds a share until it is closed.
    """
    _release_deferred()
    if client is None:
        client = default_url()
    if isinstance(client, str):
        # a digest, not the URL: it may hold a password, and objects keep this key
        key: object = ("url", hashlib.sha256(client.encode()).hexdigest())
    elif isinstance(client, RedisCluster):
        key = ("cluster", id(client))
    elif isinstance(client, redis.Redis) or _is_valkey(client):
        key = ("pool", id(client.connection_pool))
    else:
        _check_client(client)
        raise AssertionError  # _check_client raised
    origin: object = None if isinstance(client, str) else getattr(client, "connection_pool", client)
    with _shares._LOCK:
        entry = _SHARED.get(key)
        if entry is not None and entry.origin is origin:
            entry.users += 1
            return Connections(entry.commands, entry.blocking, key)
    # connects nothing yet (pools connect on first use), except a cluster client, which
    # learns its nodes now: that is retried as every command is
    commands, blocking = retrying.call(lambda: _new(client), "connecting to Redis",
                                     window=retry_window)  # fmt: skip
    with _shares._LOCK:
        entry = _SHARED.get(key)
        if entry is None or entry.origin is not origin:
            _SHARED[key] = _Entry(commands, blocking, 1, origin)
            return Connections(commands, blocking, key)
        entry.users += 1  # another thread was first
    blocking.close()
    commands.close()
    return Connections(entry.commands, entry.blocking, key)


#: What ``client=`` accepts: a client, a cluster client, a URL, or None (the default URL).
Client: TypeAlias = "redis.Redis | RedisCluster | str | None"


def sentinel_client(url: str, **extra: Any) -> redis.Redis | None:
    """The Sentinel-managed client of a ``redis+sentinel://`` URL (:func:`sentinel_parts`),
    else None. No I/O. ``extra``: more options of the primary's connections (the CLI's
    ``--user``, ``$REDISCLI_AUTH``, ``--tls``: ``ssl=True``, ``ssl_ca_certs``); the URL's own
    user and password win."""
    parts = sentinel_parts(url)
    if parts is None:
        return None
    from redis.sentinel import Sentinel

    addresses, service, options = parts
    client: redis.Redis = Sentinel(addresses, socket_timeout=CONNECT_TIMEOUT).master_for(
        service, **{**extra, **options}
    )
    return client


def _new(client: Any) -> tuple[redis.Redis, redis.Redis]:
    if isinstance(client, str):
        check_url(client)
    plain = cluster_url(client) if isinstance(client, str) else None
    if plain is not None or isinstance(client, RedisCluster):
        source, timeout, waits = cluster_timeouts(plain or client)
        commands = cluster_client(source, timeout)
        try:
            return commands, cluster_client(source, waits)
        except BaseException:
            commands.close()
            raise
    managed = sentinel_client(client) if isinstance(client, str) else None
    if managed is not None:
        base, owned = managed, True
    elif isinstance(client, str):
        base, owned = _url_client(client), True
    elif isinstance(client, redis.Redis):
        base, owned = client, False
    else:
        base, owned = twin_client(client), True
    pool = base.connection_pool
    timeout = pool.connection_kwargs.get("socket_timeout") or SOCKET_TIMEOUT
    ours = dict(command_packer=_PACKER, decode_responses=False)
    commands = _derive(pool, limit=True, socket_timeout=timeout, **ours, **_retry_settings())
    blocking = _derive(pool, limit=False, socket_timeout=blocking_timeout(timeout), **ours,
                       **_retry_settings())  # fmt: skip
    if owned:
        base.close()
    return commands, blocking
