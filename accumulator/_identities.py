"""Apply identities: how Redis tells a retried apply from a new one, and how an object lends
one identity to each apply in flight and settles an apply whose outcome was unknown (see
:class:`Identities`). No I/O: the apply protocol (``_apply``) uses them."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

#: How long Redis remembers a client's last apply, to answer a retried one again.
DEDUP_TTL_MS = 600 * 1000


class ApplyKey(NamedTuple):
    """What tells an apply from another without reading its payload."""

    local_step: int
    shape_token: str
    first_error: str
    nbytes: int


@dataclass
class Identity:
    """An apply identity: Redis recognises a retried apply by (client id, sequence number),
    and remembers only each client id's last apply, so one identity serves one apply at a
    time."""

    client_id: str
    seq: int = 0
    #: The fingerprint (:func:`apply_fingerprint`) of the apply this identity last sent when
    #: its outcome is unknown (it raised :class:`UnavailableError`); None otherwise.
    unsettled: bytes | None = None
    #: That apply's key (a fingerprint is computed only when one matches).
    key: ApplyKey = ApplyKey(0, "", "", 0)


def apply_fingerprint(key: ApplyKey, payload: memoryview) -> bytes:
    """What tells an apply from another: its key and payload bytes (a digest)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(tuple(key)).encode())
    digest.update(payload)
    return digest.digest()


class Identities:
    """Apply identities of one accumulator object, lent to one apply each: concurrent applies
    (threads, asyncio tasks) never share one, and a sequential caller reuses the same.

    An apply that raised :class:`UnavailableError` may still be counted (Redis may run the copy
    it received when it comes back): its identity is held, never lent again, until its outcome
    is settled (:func:`._apply.settle_held`, before the object's next apply: counted, it stays
    so; not, it never will be). The outcome is kept by fingerprint for as long as Redis keeps
    retry records, so that the same apply made again is counted once: not sent again when
    the first was counted, sent anew when it was not. Settling is idempotent: threads or tasks
    that find the same held identity may all settle it, and all learn the same outcome.

    A forked child gets identities of its own (the parent's would make Redis answer the
    child's applies as retries of the parent's, and the other way round)."""

    def __init__(self) -> None:
        self._free: list[Identity] = []
        self._held: list[Identity] = []
        #: every client id lent so far (closing a private accumulator deletes their retry
        #: records)
        self.client_ids: list[str] = []
        #: fingerprint -> (counted, monotonic time settled, its key): settled applies of
        #: unknown outcome
        self._outcomes: dict[bytes, tuple[bool, float, ApplyKey]] = {}
        self._lock = threading.Lock()
        _ALL_IDENTITIES.add(self)

    @property
    def holding(self) -> bool:
        """Whether an apply of unknown outcome is held or was settled recently (cheap: the
        common path asks this only)."""
        return bool(self._held or self._outcomes)

    def acquire(self) -> Identity:
        """An identity no apply in flight uses, its sequence number advanced."""
        with self._lock:
            if self._free:
                ident = self._free.pop()
            else:
                ident = Identity(uuid.uuid4().hex[:16])
                self.client_ids.append(ident.client_id)
        ident.seq += 1
        return ident

    def release(self, ident: Identity) -> None:
        """Give an identity back once its apply returned (or failed for good)."""
        ident.unsettled = None
        with self._lock:
            self._free.append(ident)

    def hold(self, ident: Identity, fingerprint: bytes, key: ApplyKey) -> None:
        """Keep aside the identity of an apply whose outcome is unknown."""
        ident.unsettled, ident.key = fingerprint, key
        with self._lock:
            self._held.append(ident)

    def held(self) -> list[Identity]:
        """The identities held now (they stay held until :meth:`settled`)."""
        with self._lock:
            return list(self._held)

    def settled(self, ident: Identity, counted: bool | None) -> None:
        """The outcome of a held apply is known (None: it cannot be learnt): remember it by
        fingerprint, lend the identity again (its next apply moves Redis's retry record past
        the settled one)."""
        with self._lock:
            if ident not in self._held:
                return  # (settled by another thread or task meanwhile)
            self._held.remove(ident)
            if ident.unsettled is not None and counted is not None:
                self._outcomes[ident.unsettled] = (counted, time.monotonic(), ident.key)
        self.release(ident)

    def remember(self, fingerprint: bytes, counted: bool, key: ApplyKey) -> None:
        """Keep the outcome of an apply the caller did not learn (it was interrupted after
        Redis answered), so that the same apply made again is answered from it."""
        with self._lock:
            self._outcomes[fingerprint] = (counted, time.monotonic(), key)

    def outcome(self, key: ApplyKey, fingerprint: Callable[[], bytes]) -> bool | None:
        """Whether a settled apply like this one (its key, then its
        ``fingerprint()``, computed only when the key matches one) was counted (taken from the
        record: answered once), or None (none settled, or settled longer ago than Redis keeps
        retry records)."""
        now = time.monotonic()
        with self._lock:
            for fp, (_, when, _key) in list(self._outcomes.items()):
                if now - when > DEDUP_TTL_MS / 1000:
                    del self._outcomes[fp]
            if not any(k == key for _, _, k in self._outcomes.values()):
                return None
        found = fingerprint()
        with self._lock:
            counted = self._outcomes.pop(found, None)
        return None if counted is None else counted[0]

    def _forked(self) -> None:
        self._free, self._held, self._outcomes, self.client_ids = [], [], {}, []
        self._lock = threading.Lock()


#: Every object's identities, reset in a forked child (os.register_at_fork, below).
_ALL_IDENTITIES: weakref.WeakSet[Identities] = weakref.WeakSet()


def _reset_identities_after_fork() -> None:
    for identities in list(_ALL_IDENTITIES):
        identities._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_identities_after_fork)
