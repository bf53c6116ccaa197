"""Redis connections: explicit timeouts and retries, a packer that does not copy big values,
and a separate pool for blocking waits."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

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
        try:
            import hiredis  # noqa: F401
            from redis.connection import HiredisRespSerializer

            self._small: Any = HiredisRespSerializer()
        except ImportError:
            self._small = self._python

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        for arg in args:
            if isinstance(arg, (bytes, bytearray, memoryview)) and len(arg) > _BIG_ARG:
                if isinstance(arg, memoryview) and arg.format != "B":
                    raise redis.DataError("memoryviews must be cast to bytes ('B')")
                return self._python.pack(*args)
        return self._small.pack(*args)


_PACKER = _Packer()


@dataclass
class Connections:
    """The two clients one accumulator object uses. No URL is kept (it may hold a password);
    the pools' own connection settings are redis-py's business."""

    commands: redis.Redis  # scripts, payload writes and reads
    blocking: redis.Redis  # BLPOP waits only; its socket timeout outlasts one wait slice

    def close(self) -> None:
        self.blocking.close()
        self.commands.close()


def _derive(pool: redis.ConnectionPool, **overrides: Any) -> redis.Redis:
    """A client like the one given (same server, credentials, class of connection), with our
    packer and timeouts."""
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(overrides)
    if isinstance(pool, SentinelConnectionPool):
        # a Sentinel-managed pool finds the current master itself (and again after failover)
        kwargs.pop("connection_pool", None)  # its proxy to the old pool
        new_pool: redis.ConnectionPool = SentinelConnectionPool(
            pool.service_name, pool.sentinel_manager, is_master=pool.is_master,
            check_connection=pool.check_connection, connection_class=pool.connection_class,
            **kwargs,
        )  # fmt: skip
    else:
        new_pool = pool.__class__(connection_class=pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=new_pool)


def connect(client: redis.Redis | str | None) -> Connections:
    """Clients for a URL, for an existing ``redis.Redis`` (its settings are kept), or for the
    default URL. Replies are always bytes; the command packer is ours."""
    if client is None:
        client = default_url()
    if isinstance(client, str):
        base = redis.Redis.from_url(
            client,
            socket_timeout=SOCKET_TIMEOUT,
            socket_connect_timeout=CONNECT_TIMEOUT,
            socket_keepalive=True,
            retry=_retry(),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=30,
        )
        owned = True
    elif isinstance(client, redis.Redis):
        base, owned = client, False
    else:
        raise TypeError(
            f"client must be a redis.Redis (plain or Sentinel-managed), a URL or None, not "
            f"{type(client).__name__} (RedisCluster clients are not supported yet)"
        )
    pool = base.connection_pool
    timeout = pool.connection_kwargs.get("socket_timeout") or SOCKET_TIMEOUT
    commands = _derive(pool, command_packer=_PACKER, decode_responses=False,
                       socket_timeout=timeout)  # fmt: skip
    blocking = _derive(pool, command_packer=_PACKER, decode_responses=False,
                       socket_timeout=WAIT_SLICE + max(5.0, timeout))  # fmt: skip
    if owned:
        base.close()
    return Connections(commands, blocking)
