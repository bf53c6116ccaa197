"""The chief lease: one chief per sync job (``accsync:{tag}:chief``, a hash renewed in the
background; the script is ``lua/sync_lease.lua``)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import redis

from .. import _admin, _retry, _scripts
from .._codec import reply_text
from .._errors import AccumulatorError
from .._keys import SyncKeys

logger = logging.getLogger("accumulator.sync")

#: Default length of the chief lease (renewed every third of it while the chief lives): a
#: crashed chief is taken over by another within this long.
CHIEF_LEASE_SECONDS = 10.0

#: A chief's takes give their rounds back once this share of the lease has passed since it was
#: last renewed (renewed every third: never while the chief runs; a paused or starved chief's
#: lease may have run out, and another chief taken over).
_GUARD_SHARE = 0.8

#: How long the record of a lease that ran out stays (``accumulator job`` shows the dead chief).
_LEASE_RECORD_MS = 3600 * 1000


class ChiefConflictError(AccumulatorError):
    """Another chief holds the job's lease (one chief per job). ``holder`` is its
    ``chief_id``, ``expires_in`` the seconds its lease has left: a chief that crashed is taken
    over once that has run out."""

    def __init__(
        self, message: str, *, job: str, holder: str = "", expires_in: float | None = None
    ) -> None:
        super().__init__(message)
        self.job = job
        self.holder = holder
        self.expires_in = expires_in


def chief_key(keys: SyncKeys) -> str:
    """The key of a job's chief lease (a hash: ``id``, ``host``, ``pid``, ``since_ms``,
    ``renewed_ms``, ``expires_ms``)."""
    return _admin.chief_lease_key(keys)


class _ChiefLease:
    """A chief's hold on its job: acquired by ``initialize()``, renewed by a daemon thread
    every third of its length and before every publish, released by ``close()``.

    Holds no reference to the :class:`ParameterServer` (a garbage-collected chief releases
    its lease through a finalizer)."""

    def __init__(
        self, client: redis.Redis, key: str, job: str, chief_id: str, seconds: float,
        window: float,
    ) -> None:  # fmt: skip
        self._client = client
        self.key = key
        self.job = job
        self.chief_id = chief_id
        self.seconds = seconds
        self.window = window
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False
        #: This chief's tenure: a token of its acquire (the lease names it, and the keys of the
        #: parameter versions it publishes carry it): a chief that lost its lease writes none of
        #: the keys of the chief after it, not even one restarted under the same ``chief_id``.
        self.tenure = ""
        #: Set (to the reason) when another chief took the lease over: this chief must stop.
        self.lost: str | None = None
        #: Asked after each renewal in the background: whether the job's published step is
        #: behind the chief's (Redis lost its last publish: a failover to a replica behind).
        #: Then :attr:`republish` is set, and with it the guard: the chief's takes give their
        #: rounds back, and the chief publishes again (no worker pushes for its step before).
        self.behind: Callable[[], bool] | None = None
        self.republish = False
        #: monotonic time a renewal that succeeded was sent (the lease holds a lease from then)
        self._renewed = 0.0
        #: The ``cancel`` of this chief's takes (:class:`_LeaseGuard`).
        self.guard = _LeaseGuard(self)

    def _args(self, mode: str) -> list[Any]:
        args = [mode, self.chief_id, max(1, int(self.seconds * 1000)), self._host, self._pid,
                _LEASE_RECORD_MS]  # fmt: skip
        # (a publish names its tenure in the published hash's fields: see publish_call)
        return args if mode == "publish" else [*args, self.tenure]

    def _call(self, mode: str) -> list[Any]:
        return list(_scripts.call(self._client, "sync_lease", [self.key], self._args(mode)))

    def publish_call(
        self, published: str, new_keys: list[str], old_keys: list[str], stale_keys: list[str],
        channel: str, message: str | bytes, old_expire_ms: int, fields: Mapping[Any, Any],
    ) -> tuple[list[str], list[Any]]:  # fmt: skip
        """KEYS and ARGV of the lease script's ``publish``: the lease renewed and, only if
        this chief holds it, the published hash switched to the new version (``new_keys``),
        the previous version's ``old_keys`` set to expire and the ``stale_keys`` of the one
        before deleted, in one atomic step (see ``lua/sync_lease.lua``); its reply goes to
        :meth:`settle`."""
        keys = [self.key, published, *new_keys, *old_keys, *stale_keys]
        args = [*self._args("publish"), len(new_keys), channel, message, old_expire_ms,
                len(stale_keys)]  # fmt: skip
        for name, value in fields.items():
            args += [name, value]
        return keys, args

    def _conflict(self, reply: list[Any]) -> ChiefConflictError:
        holder, host, pid = reply_text(reply[1]), reply_text(reply[2]), reply_text(reply[3])
        left, age = int(reply[4]) / 1000, int(reply[5]) / 1000
        if holder == self.chief_id:  # another tenure of this very id
            message = (
                f"sync job {self.job!r}: a chief started later with this chief's id "
                f"{holder!r} (host {host!r}, pid {pid or '?'}) holds the lease now: this one "
                "is replaced (a restarted chief given the crashed one's id takes over at once; "
                "never give two live chiefs one id)"
            )
        else:
            message = (
                f"sync job {self.job!r} already has a chief: {holder!r} (host {host!r}, pid "
                f"{pid or '?'}), lease renewed {age:.1f}s ago, expires in {left:.1f}s. One "
                "chief per job: stop the other chief; if it crashed, this one may take over "
                "once its lease has run out (initialize(wait_for_chief=SECONDS) waits for that)"
            )
        return ChiefConflictError(message, job=self.job, holder=holder, expires_in=left)

    def acquire(self, wait: float = 0.0) -> None:
        """Take (or renew) the lease; waits up to ``wait`` seconds for another chief's to run
        out, then raises :class:`ChiefConflictError`."""
        deadline = time.monotonic() + max(0.0, wait)
        if not self.held:
            self.tenure = uuid.uuid4().hex[:8]
        while True:
            sent = time.monotonic()
            reply = _retry.call(
                lambda: self._call("acquire"), f"sync job {self.job!r}: chief lease",
                window=self.window,
            )  # fmt: skip
            if int(reply[0]) == 1:
                self._renewed = sent
                break
            conflict = self._conflict(reply)
            left = deadline - time.monotonic()
            if left <= 0:
                raise conflict
            time.sleep(min(left, 1.0, max(0.05, conflict.expires_in or 0.0)))
        previous = reply_text(reply[1])
        if previous == self.chief_id:  # its id: at once, whether or not the lease ran out
            logger.warning(
                "sync job %r: chief %r takes over from the chief of the same id before it (a "
                "restart, or two chiefs given one id?)", self.job, self.chief_id,
            )  # fmt: skip
        elif previous:
            logger.warning(
                "sync job %r: chief %r takes over from chief %r, whose lease ran out (gone?)",
                self.job, self.chief_id, previous,
            )  # fmt: skip
        self.held, self.lost = True, None
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._beat, name=f"accumulator-chief-lease-{self.job}", daemon=True
            )
            self._thread.start()

    def check(self, *, renew: bool) -> None:
        """Raise :class:`ChiefConflictError` if another chief took the lease over; with
        ``renew``, renew it now (one round trip)."""
        if self.lost is not None:
            raise ChiefConflictError(self.lost, job=self.job)
        if not renew:
            return
        sent = time.monotonic()
        self.settle(_retry.call(
            lambda: self._call("renew"), f"sync job {self.job!r}: chief lease",
            window=self.window,
        ))  # fmt: skip
        self._renewed = sent

    def settle(self, reply: list[Any]) -> None:
        """Raise :class:`ChiefConflictError` (and stop renewing) when the reply of a
        ``renew`` or a ``publish`` says the lease is no longer this chief's."""
        if int(reply[0]) != 1:
            self.lost = self._lost(reply)
            self.held = False  # (a later acquire starts a new tenure)
            self._stop.set()
            holder = reply_text(reply[1])
            left = int(reply[4]) / 1000 if holder else None
            raise ChiefConflictError(self.lost, job=self.job, holder=holder, expires_in=left)

    def _lost(self, reply: list[Any]) -> str:
        """Why a renewal or publish was refused: another chief's lease, or none at all."""
        if reply_text(reply[1]):
            return f"this chief lost its lease: {self._conflict(reply)}"
        return (
            f"this chief's lease of sync job {self.job!r} is gone (the job was deleted, or "
            "Redis lost its data)"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            sent = time.monotonic()
            try:
                reply = self._call("renew")
            except Exception as exc:  # noqa: BLE001 - Redis away: the next beat tries again
                logger.debug("sync job %r: renewing the chief lease failed: %s", self.job, exc)
                continue
            if int(reply[0]) != 1:
                self.lost = self._lost(reply)
                self.held = False
                logger.error("sync job %r: %s", self.job, self.lost)
                return
            self._renewed = max(self._renewed, sent)
            behind = self.behind
            try:
                if behind is not None and behind():
                    self.republish = True
            except Exception as exc:  # noqa: BLE001 - Redis away: the next beat looks again
                logger.debug("sync job %r: reading the published step failed: %s", self.job, exc)

    def since_renewed(self) -> float:
        """Seconds since the last renewal that succeeded was sent."""
        return time.monotonic() - self._renewed

    def may_have_run_out(self) -> bool:
        """Whether this chief may no longer hold its lease: lost, or not renewed within
        :data:`_GUARD_SHARE` of its length (no round trip)."""
        return self.lost is not None or self.since_renewed() > self.seconds * _GUARD_SHARE

    def release(self) -> None:
        """Stop renewing and give the lease up (best effort: it runs out by itself)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        if not self.held:
            return
        self.held = False
        try:
            self._call("release")
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            logger.debug("sync job %r: releasing the chief lease failed: %s", self.job, exc)


class _LeaseGuard:
    """The ``cancel`` a chief gives its takes (it quacks like a ``threading.Event``): set
    while the chief may have lost its lease. A take that sees it set before it claims, or
    before it keeps what it claimed, gives the round back: a deposed chief (paused, starved,
    cut off) never consumes a round that the chief who took over waits for."""

    def __init__(self, lease: _ChiefLease) -> None:
        self._lease = lease

    def is_set(self) -> bool:
        """Whether the takes must stop (:meth:`_ChiefLease.may_have_run_out`, or the job's
        published step is behind the chief's: :attr:`_ChiefLease.republish`)."""
        return self._lease.may_have_run_out() or self._lease.republish
