"""Large values received in place for the asyncio accumulators, as the synchronous driver
receives them (``accumulator._wire``): on a synchronous twin of the commands client, in a
worker thread.

redis.asyncio reads a reply through a stream buffer, then into a new ``bytes``, then the
protocol copies it into the result: a 16 MiB take of four applies took ~3x the synchronous
take (38 ms against 13 ms here). The twin (same server, credentials, TLS and timeouts; see
:func:`accumulator._connection.twin_client`) reads each value straight into its buffer,
``recv_into``; the event loop waits on the thread. Clients without a twin (fakeredis,
Sentinel-managed ones) read the ordinary way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from .. import _forks
from .._cluster_client import twin_cluster
from .._connection import twin_client
from .._requests import Receive, ReceiveAll
from .._wire import get_all_into, get_into

logger = logging.getLogger("accumulator")

_ATTR = "_accumulator_reader"
_NONE = object()  # kept on a client that has no twin
_CLOSED = object()  # kept on a closed client: no twin is made for it any more
_LOCK = threading.Lock()  # guards the attribute only: nothing is sent while it is held
_forks.renew_lock_after_fork(globals(), "_LOCK")


def _twin(client: Any) -> Any:
    """A synchronous twin of ``client``, or ``_NONE``: (fakeredis, a Sentinel-managed pool,
    credentials from a provider, which the twin would not have) never."""
    if isinstance(client, AsyncRedisCluster):
        return twin_cluster(client)
    settings = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if settings.get("credential_provider") is not None:
        return _NONE
    return twin_client(client)


def _reader(client: Any) -> Any:
    """The synchronous twin of the asyncio ``client`` (made on first use, kept on it), or
    None. Called in the worker thread: a cluster twin loads its slot map when made."""
    state = client.__dict__.get(_ATTR)
    if state is None:
        try:
            made = _twin(client)
        except TypeError:
            made = _NONE
        except redis.RedisError as exc:  # (a cluster unreachable now): not this time
            logger.debug("no synchronous reader for the asyncio client yet: %s", exc)
            return None
        with _LOCK:
            state = client.__dict__.setdefault(_ATTR, made)
        if state is not made:  # another thread's was first, or the client closed meanwhile
            _close(made)
    return None if state is _NONE or state is _CLOSED else state


def _close(reader: Any) -> None:
    if reader is None or reader is _NONE or reader is _CLOSED:
        return
    reader.close()
    pool = getattr(reader, "connection_pool", None)
    if pool is not None:
        pool.disconnect()


def close_reader(client: Any) -> None:
    """Close ``client``'s twin, if it has one, for good (with the client)."""
    with _LOCK:
        reader = client.__dict__.get(_ATTR)
        client.__dict__[_ATTR] = _CLOSED
    _close(reader)


def _not_for_twin(client: Any) -> None:
    """The twin cannot log in as the client does: read the ordinary way from now on."""
    with _LOCK:
        reader = client.__dict__.get(_ATTR)
        if reader is _NONE or reader is _CLOSED:
            return
        client.__dict__[_ATTR] = _NONE
    _close(reader)


def _receive(client: Any, request: Receive | ReceiveAll) -> Any:
    reader = _reader(client)
    if reader is None:
        return None
    try:
        if isinstance(request, Receive):
            return get_into(reader, request.keys, request.outs)
        return get_all_into(reader, request.keys, request.into)
    except redis.AuthenticationError as exc:
        logger.info("asyncio reads of large values: the synchronous reader could not log in "
                    "(%s); reading the ordinary way", type(exc).__name__)  # fmt: skip
        _not_for_twin(client)
        return None


async def receive(client: Any, request: Receive | ReceiveAll) -> Any:
    """The reply to ``request`` (see :class:`Receive`, :class:`ReceiveAll`), received in a
    worker thread; None when ``client`` cannot be read this way.

    Cancelled, it still waits for the thread to end its read (bounded by the socket timeout):
    the thread writes into the request's buffers until then, and a buffer the caller reuses
    (the sparse take's) must not be written after the caller has moved on."""
    state = client.__dict__.get(_ATTR)
    if state is _NONE or state is _CLOSED:
        return None  # known to have no twin: no thread for that
    future = asyncio.get_running_loop().run_in_executor(None, _receive, client, request)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                continue
        if not future.cancelled():
            future.exception()  # retrieved: the read's own failure goes with the cancel
        raise
