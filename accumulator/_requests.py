"""The I/O vocabulary of the accumulator protocol (sans-I/O, in the manner of h11).

The apply, take, fold and open protocols are written once, as generators that ``yield`` one
of these requests and get its reply back (``reply = yield Call(...)``); they decide, the
drivers do the I/O. The synchronous driver is :class:`accumulator.AccumulatorBase`, the
asyncio one ``accumulator.aio``. A driver throws a failed request's exception into the
generator, so the protocol's own ``try``/``except`` (give a claimed round back, ...) runs on
either. ``Call``, ``Command`` and ``Batch`` are retried by the driver through transient
Redis faults for the accumulator's retry window (``what`` names the operation in the error);
each is idempotent by construction, so a re-sent one counts once.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar


@dataclass(frozen=True)
class Call:
    """Run a script of ``lua/`` (``_scripts.call``: NOSCRIPT handled, ``ACCERR`` replies
    raised as our errors). ``commit``: the script commits a take or an apply; an asyncio
    task cancelled while it runs lets it finish (its outcome must not be lost). ``window``:
    seconds of retrying through Redis faults for this call (None: the accumulator's
    ``retry_window``; 0: one try)."""

    what: str
    name: str
    keys: Sequence[str | bytes]
    args: Sequence[Any]
    commit: bool = False
    window: float | None = None


@dataclass(frozen=True)
class Command:
    """One Redis command (``args`` as for ``execute_command``); its raw reply."""

    what: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Batch:
    """Commands in one pipeline (no transaction), retried as a whole; the list of replies.
    ``raise_on_error=False``: error replies come back as exception objects in the list. A
    script the server does not know (NOSCRIPT, after a restart) is loaded and the batch sent
    again, so a batch may re-send only idempotent commands."""

    what: str
    commands: Sequence[tuple[Any, ...]]
    raise_on_error: bool = True
    commit: bool = False
    #: On a cluster, send every command on one connection to the node serving this key (a
    #: durability WAIT must follow the writes it confirms on their connection).
    node_key: str | bytes | None = None
    #: A command (a durability WAIT) to follow the commands on every connection they went
    #: through: on a cluster each command goes to the node serving its key (``args[1]``), one
    #: pipeline per node, each ending with ``tail``. The reply then has one more element, the
    #: list of the tails' replies (one per node).
    tail: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class Receive:
    """GET ``keys`` straight into the writable views ``outs`` (no copy). The reply: a flag per
    key (found at exactly its view's length), or ``None`` when the driver cannot receive in
    place (the protocol then sends a :class:`Batch`)."""

    what: str
    keys: Sequence[str | bytes]
    outs: Sequence[memoryview]


@dataclass(frozen=True)
class ReceiveAll:
    """GET ``keys`` straight into ``into`` (a writable byte view), each value right behind
    the one before, whatever their lengths (no copy). The reply: each value's length, ``-1``
    for a missing key and ``-2`` for a value that did not fit in what was left; or ``None``
    when the driver cannot receive in place (the protocol then sends a :class:`Batch`)."""

    what: str
    keys: Sequence[str | bytes]
    into: memoryview


@dataclass(frozen=True)
class Pop:
    """Wait up to ``timeout`` seconds on a wake list (BLPOP). ``True``, or ``False`` when the
    wait's connection failed (the protocol re-checks; the driver paused briefly first). The
    driver raises ``CancelledError`` when the accumulator was closed meanwhile.

    ``then``: a script call to make as soon as the wait ends, whatever ended it. A driver may
    send it behind the BLPOP in the same round trip (Redis runs it the moment the wait ends);
    the reply is then that call's reply, or ``None`` when the driver did not make it (the
    protocol makes it itself), so ``then`` must be safe to send twice."""

    key: str
    timeout: float
    then: Call | None = None
    #: the caller's deadline (``time.monotonic()``): see :func:`wait_seconds`
    until: float | None = None

    def seconds(self) -> float:
        """How long to wait now: see :func:`wait_seconds`."""
        return wait_seconds(self.timeout, self.until)


@dataclass(frozen=True)
class Subscribe:
    """Subscribe to a channel: a handle for :class:`Listen`, or ``None`` when it failed."""

    channel: str


@dataclass(frozen=True)
class Listen:
    """Wait up to ``timeout`` seconds for a message on a subscription: ``False`` when its
    connection failed (the subscription is then dropped by the protocol)."""

    handle: Any
    timeout: float
    #: the caller's deadline (``time.monotonic()``): see :func:`wait_seconds`
    until: float | None = None

    def seconds(self) -> float:
        """How long to wait now: see :func:`wait_seconds`."""
        return wait_seconds(self.timeout, self.until)


def wait_seconds(timeout: float, until: float | None) -> float:
    """A wait's ``timeout``, cut to what is left before ``until`` when it is served later than
    it was asked for (several takes' waits are served one after the other: each must still
    end by its own deadline), at least 1 ms."""
    if until is None:
        return timeout
    return max(0.001, min(timeout, until - time.monotonic()))


@dataclass(frozen=True)
class Unsubscribe:
    """Close a subscription (never fails)."""

    handle: Any


Request: TypeAlias = (
    Call | Command | Batch | Receive | ReceiveAll | Pop | Subscribe | Listen | Unsubscribe
)
_R = TypeVar("_R")
#: A protocol step: a generator of requests that returns an ``_R``.
Ops: TypeAlias = Generator[Request, Any, _R]


def advance(
    ops: Generator[Any, Any, Any], reply: Any, error: BaseException | None
) -> tuple[bool, Any]:
    """Hand a step its last request's reply (or throw that request's exception into it):
    ``(True, result)`` when the step ended, else ``(False, next request)``. An exception the
    step raises propagates."""
    try:
        return False, (ops.send(reply) if error is None else ops.throw(error))
    except StopIteration as stop:
        return True, stop.value
