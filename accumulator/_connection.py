"""Redis connections: explicit timeouts and retries, a packer that does not copy big values,
and a separate pool for blocking waits."""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.connection import AbstractConnection, PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from . import _retry as retrying
from ._errors import InvalidArgumentError, PermissionDeniedError
from ._redact import redact_url
from ._retry import RETRY_WINDOW

DEFAULT_URL = "redis://localhost:6379/0"

#: Seconds one blocking wait (BLPOP) lasts before the taker re-checks and renews its lease.
WAIT_SLICE = 2.0
#: Socket timeout for ordinary commands. Large gradients must be *sent* within it
#: (``sendall`` is covered by the timeout as a whole): 64 MiB takes ~0.2 s on loopback.
SOCKET_TIMEOUT = 30.0
CONNECT_TIMEOUT = 5.0
#: Above this size an argument is sent as its own buffer (no copy into one command buffer).
_BIG_ARG = 64 * 1024


def default_url() -> str:
    """``ACCUMULATOR_REDIS_URL``, then ``REDIS_URL``, then ``redis://localhost:6379/0``."""
    return os.environ.get("ACCUMULATOR_REDIS_URL") or os.environ.get("REDIS_URL") or DEFAULT_URL


def _retry() -> Retry:
    # A few quick retries ride out a reconnect; applies and takes are made idempotent by the
    # scripts, so a re-sent command is counted once.
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3)


def _encode(value: Any) -> bytes | memoryview:
    if isinstance(value, (bytes, memoryview)):
        return value
    if isinstance(value, bytearray):
        return memoryview(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)):
        return repr(value).encode()
    raise redis.DataError(f"cannot send {type(value).__name__} to Redis")


class _Packer:
    """hiredis's packer for small commands, redis-py's pure-Python one for big values.

    hiredis copies every argument into one buffer (3-5x slower than a plain socket send from
    1 MiB up); the Python packer sends big arguments as separate buffers.
    """

    def __init__(self) -> None:
        self._python = PythonRespSerializer(_BIG_ARG, _encode)
        self._hiredis: Any = None
        try:
            import hiredis
            from redis.connection import HiredisRespSerializer

            self._small: Any = HiredisRespSerializer()
            self._hiredis = hiredis.pack_command
        except ImportError:
            self._small = self._python

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        for arg in args:
            if isinstance(arg, (bytes, bytearray, memoryview)) and len(arg) > _BIG_ARG:
                if isinstance(arg, memoryview) and arg.format != "B":
                    raise redis.DataError("memoryviews must be cast to bytes ('B')")
                return cast("list[bytes | memoryview]", self._python.pack(*args))
        head = args[0]
        if self._hiredis is not None and type(head) is str and " " not in head:
            # hiredis packs str, bytes, int, float and memoryviews itself: redis-py's wrapper
            # (a copy of every argument into a new tuple) costs as much as the packing
            try:
                return [self._hiredis(args)]
            except TypeError:
                pass  # a bytearray, say: redis-py's wrapper converts it (or says why not)
        return cast("list[bytes | memoryview]", self._small.pack(*args))


_PACKER = _Packer()


@dataclass
class Connections:
    """The two clients one accumulator object uses: shared with every accumulator opened from
    the same client object or URL string (see :func:`connect`), each holding a share. No URL is
    kept in them (it may hold a password); the pools' own settings are redis-py's business."""

    commands: redis.Redis  # scripts, payload writes and reads
    blocking: redis.Redis  # BLPOP waits only; its socket timeout outlasts one wait slice
    _key: object = None  # its entry in the registry of shared clients (None: not shared)
    _released: bool = False

    def close(self) -> None:
        """Release this share (once); the pools close with the last share."""
        if not release(self, _SHARED, _LOCK):
            return
        for client in (self.blocking, self.commands):
            client.close()  # a client given its pool leaves the pool open: close that too
            pool = getattr(client, "connection_pool", None)  # a cluster client has none
            if pool is not None:
                pool.disconnect()


def release(share: Any, registry: dict[object, Any], lock: threading.Lock) -> bool:
    """Release one share (``_key``, ``commands``, ``_released``) of the shared clients in
    ``registry`` (once): True when it was the last, and the clients are to be closed."""
    with lock:
        if share._released:
            return False
        share._released = True
        entry = registry.get(share._key) if share._key is not None else None
        if entry is not None and entry.commands is share.commands:
            entry.users -= 1
            if entry.users > 0:
                return False
            del registry[share._key]
    return True


@dataclass
class _Entry:
    commands: redis.Redis
    blocking: redis.Redis
    users: int
    origin: object  # the user's pool (kept alive: its id is part of the key); None for a URL


#: Shared clients: ("pool", id of a user's pool) or ("url", SHA-256 of the URL) -> entry. An
#: accumulator is one user; closing it releases its share.
_SHARED: dict[object, _Entry] = {}
_LOCK = threading.Lock()


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


def sentinel_pool_like(pool_class: Any, pool: Any, kwargs: dict[str, Any]) -> Any:
    """A new ``pool_class`` (redis-py's synchronous or asyncio Sentinel-managed pool: both
    take the same arguments) for the service of ``pool``, with the connection settings
    ``kwargs``. Such a pool finds the current primary itself, and again after a failover."""
    settings = {k: v for k, v in kwargs.items() if k != "connection_pool"}  # a proxy to pool
    return pool_class(
        pool.service_name, pool.sentinel_manager, is_master=pool.is_master,
        check_connection=pool.check_connection, connection_class=pool.connection_class,
        **settings,
    )  # fmt: skip


def _derive(pool: redis.ConnectionPool, *, limit: bool, **overrides: Any) -> redis.Redis:
    """A client like the one given (same server, credentials, class of connection and, with
    ``limit``, the same pool class and size), with our packer and timeouts."""
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(overrides)
    if isinstance(pool, SentinelConnectionPool):
        new_pool: redis.ConnectionPool = sentinel_pool_like(SentinelConnectionPool, pool, kwargs)
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
    kwargs.update(retry=_retry(), retry_on_error=[RedisConnectionError, RedisTimeoutError])
    pool_class = redis.BlockingConnectionPool if _is_blocking(pool) else redis.ConnectionPool
    new_pool = pool_class(connection_class=cls, **_pool_kwargs(pool), **kwargs)
    return redis.Redis(connection_pool=new_pool)


def twin_cluster(client: Any) -> RedisCluster:
    """A redis-py cluster client of the cluster that a ``redis.asyncio.cluster.RedisCluster``
    talks to: its nodes (those it knows, else its start-up nodes) and credentials."""
    from redis.cluster import ClusterNode

    nodes = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
    kwargs = node_settings(client.connection_kwargs)
    return RedisCluster(startup_nodes=[ClusterNode(n.host, n.port) for n in nodes], **kwargs)


def node_settings(connection_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a client of one node needs from an asyncio cluster client's connection settings:
    credentials, timeouts, name, protocol, and TLS."""
    kwargs = {k: v for k, v in connection_kwargs.items()
              if k in ("username", "password", "client_name", "protocol", "socket_timeout",
                       "socket_connect_timeout")}  # fmt: skip
    if "SSL" in getattr(connection_kwargs.get("connection_class"), "__name__", ""):
        kwargs["ssl"] = True
    return kwargs


def _is_valkey(client: object) -> bool:
    kind = type(client)
    return kind.__module__.split(".")[0] == "valkey" and kind.__name__ in ("Valkey", "StrictValkey")


def url_options(url: str) -> dict[str, Any]:
    """The client settings of a URL's connections (the sync and asyncio clients add their
    own ``retry``): timeouts, keepalive on TCP, retries on connection faults, health checks."""
    tcp = not url.startswith("unix:")
    return dict(
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=CONNECT_TIMEOUT,
        # keepalive is a TCP option (a unix socket connection refuses the argument)
        **({"socket_keepalive": True} if tcp else {}),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
    )


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
    except NoPermissionError as exc:
        raise PermissionDeniedError(
            f"the Redis user may not run transactions (MULTI/EXEC), which this needs; nothing "
            f"was changed (see the README's Security section for what each role needs): {exc}"
        ) from exc


def _url_client(url: str) -> redis.Redis:
    tls = {"connection_class": TLSConnection} if url.startswith("rediss://") else {}
    return redis.Redis.from_url(url, retry=_retry(), **url_options(url), **tls)


def connect(client: Client, retry_window: float = RETRY_WINDOW) -> Connections:
    """The clients for a URL, for an existing ``redis.Redis`` or ``valkey.Valkey`` (its
    settings are kept: server, credentials, TLS, pool class and ``max_connections``), or for
    the default URL. Replies are always bytes; the command packer is ours.

    Every accumulator opened from one client object (or one URL string) shares one pool for
    commands, capped like the client's own, and one for blocking waits (a taker waiting holds
    one connection of it); each holds a share until it is closed.
    """
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
    with _LOCK:
        entry = _SHARED.get(key)
        if entry is not None and entry.origin is origin:
            entry.users += 1
            return Connections(entry.commands, entry.blocking, key)
    # connects nothing yet (pools connect on first use), except a cluster client, which
    # learns its nodes now: that is retried as every command is
    commands, blocking = retrying.call(lambda: _new(client), "connecting to Redis",
                                     window=retry_window)  # fmt: skip
    with _LOCK:
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


def is_cluster(client: Any) -> bool:
    """Whether a client talks to a Redis Cluster (``redis.cluster.RedisCluster``)."""
    return isinstance(client, RedisCluster)


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


#: The URL schemes ``client=`` (and the CLI's ``--url``) take.
URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://",
               "redis+sentinel://")  # fmt: skip


def scheme_problem(url: str) -> str | None:
    """What is wrong with a URL's scheme (redis-py's own error lists only its three), or with
    the database of a ``redis://``/``rediss://`` URL (redis-py takes ``/abc`` for db 0); None
    when nothing is."""
    if not url.startswith(URL_SCHEMES):
        return f"it must start with one of {', '.join(URL_SCHEMES)}"
    if url.startswith(("redis://", "rediss://")):
        path = urlsplit(url).path
        if path.strip("/") and not re.fullmatch(r"[0-9]+", path.strip("/")):
            return f"its path must be a database number (/0, /1, ...), not {path!r}"
    return None


def check_url(url: str) -> None:
    """:class:`InvalidArgumentError` for a URL of a scheme we do not connect to."""
    problem = scheme_problem(url)
    if problem is not None:
        raise InvalidArgumentError(f"unsupported Redis URL {redact_url(url)!r}: {problem}")


def cluster_url(url: str) -> str | None:
    """The plain URL of a ``redis+cluster://`` (``rediss+cluster://``) one, else None."""
    for scheme in ("redis+cluster://", "rediss+cluster://"):
        if url.startswith(scheme):
            return scheme.replace("+cluster", "") + url[len(scheme) :]
    return None


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


def _cluster(client: RedisCluster | str, socket_timeout: float) -> Any:
    """A cluster client like the one given (its nodes, credentials and TLS; a URL's), that
    replies bytes, with our timeouts and retries."""
    settings: dict[str, Any] = dict(decode_responses=False, socket_timeout=socket_timeout,
                                    socket_connect_timeout=CONNECT_TIMEOUT)  # fmt: skip
    if isinstance(client, str):
        url = client
        return _zero_copy_nodes(new_cluster(lambda: RedisCluster.from_url(url, **settings)))
    from redis.cluster import ClusterNode

    kwargs: dict[str, Any] = {k: v for k, v in client.nodes_manager.connection_kwargs.items()
              if k in ("username", "password", "ssl", "ssl_ca_certs", "ssl_certfile",
                       "ssl_keyfile", "ssl_cert_reqs", "client_name", "protocol")}  # fmt: skip
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


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, dict[str, Any]] | None:
    """What a ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`` URL
    names: the Sentinels' addresses, the name they know the primary by, and the primary's
    client options (db, user and password, our timeouts); None for another URL. No I/O: the
    synchronous and the asyncio ``master_for`` are built from it."""
    scheme = "redis+sentinel://"
    if not url.startswith(scheme):
        return None
    from urllib.parse import unquote

    rest = url[len(scheme) :]
    auth, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    if not hosts or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("a Sentinel URL is redis+sentinel://host:port[,host:port...]/service[/db]")
    addresses = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"a Sentinel address must be host:port, not {host!r}")
        addresses.append((name, int(port)))
    user, _, password = auth.partition(":") if ":" in auth else ("", "", auth)
    options: dict[str, Any] = {"db": int(parts[1]) if len(parts) == 2 else 0,
                               "socket_timeout": SOCKET_TIMEOUT,
                               "socket_connect_timeout": CONNECT_TIMEOUT}  # fmt: skip
    if user:
        options["username"] = unquote(user)
    if password:
        options["password"] = unquote(password)
    return addresses, unquote(parts[0]), options


def sentinel_client(url: str) -> redis.Redis | None:
    """The Sentinel-managed client of a ``redis+sentinel://`` URL (:func:`sentinel_parts`),
    else None. No I/O."""
    parts = sentinel_parts(url)
    if parts is None:
        return None
    from redis.sentinel import Sentinel

    addresses, service, options = parts
    client: redis.Redis = Sentinel(addresses, socket_timeout=CONNECT_TIMEOUT).master_for(
        service, **options
    )
    return client


def _new(client: Any) -> tuple[redis.Redis, redis.Redis]:
    if isinstance(client, str):
        check_url(client)
    plain = cluster_url(client) if isinstance(client, str) else None
    if plain is not None or isinstance(client, RedisCluster):
        source = plain if plain is not None else client
        commands = _cluster(source, SOCKET_TIMEOUT)
        try:
            return commands, _cluster(source, WAIT_SLICE + max(5.0, SOCKET_TIMEOUT))
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
    commands = _derive(pool, limit=True, command_packer=_PACKER, decode_responses=False,
                       socket_timeout=timeout)  # fmt: skip
    blocking = _derive(pool, limit=False, command_packer=_PACKER, decode_responses=False,
                       socket_timeout=WAIT_SLICE + max(5.0, timeout))  # fmt: skip
    if owned:
        base.close()
    return commands, blocking
