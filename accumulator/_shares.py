"""The registry of shared clients: every accumulator opened from one client object or URL
string holds a share of the same two clients (see ``_connection.connect``); the last share
released closes them. A finalizer may release a share from wherever the garbage collector
runs: it never waits for the registry's lock (:meth:`Connections.close_collected`)."""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass
from typing import Any

import redis

from . import _forks


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
        _release_deferred()
        self._close()

    def close_collected(self) -> None:
        """:meth:`close` for a finalizer, which runs wherever the garbage collector does:
        inside :func:`connect` on the thread holding its lock, say (waiting for the lock
        there was a deadlock, seen on Python 3.13). When the lock is held, the share is
        released by the next connect() or close() instead, or at exit."""
        if not _LOCK.acquire(blocking=False):
            _DEFERRED.append(self)  # (list.append: safe in a finalizer)
            return
        _LOCK.release()
        self._close()

    def _close(self) -> None:
        if not release(self, _SHARED, _LOCK):
            return
        for client in (self.blocking, self.commands):
            pool = getattr(client, "connection_pool", None)  # a cluster client has none
            if not_ours(pool):
                continue  # (see not_ours)
            client.close()  # a client given its pool leaves the pool open: close that too
            if pool is not None:
                pool.disconnect()


def not_ours(pool: Any) -> bool:
    """Whether ``pool`` is a copy a forked child inherited: the parent's connections, which
    the child leaves alone. redis-py resets such a pool at its first use, and its reset waits
    for the pool's lock, which a thread of the parent may have held at the fork: the child's
    close() hung for ever (seen in the suite, 2026-11-30; redis-py 8.1)."""
    pid = getattr(pool, "pid", None)
    return isinstance(pid, int) and pid != os.getpid()


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
_forks.renew_lock_after_fork(globals(), "_LOCK")
#: Shares let go of by a finalizer while the lock was held (see Connections.close_collected)
_DEFERRED: list[Connections] = []


def _release_deferred() -> None:
    """Release the shares whose finalizer found the lock held (never called holding it)."""
    while _DEFERRED:
        try:
            share = _DEFERRED.pop()
        except IndexError:  # another thread took the last one
            return
        share._close()


atexit.register(_release_deferred)
