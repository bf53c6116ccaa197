"""Riding out Redis faults: a time window of retries around each operation.

redis-py's own ``Retry`` counts attempts; a restart or failover is a matter of seconds, so
the library retries whole operations until a *time* window has passed (default
:data:`RETRY_WINDOW`), with capped exponential backoff and jitter. Every operation it wraps
is idempotent by construction (applies carry a client id and sequence number, takes a taker
id), so a re-sent one is counted once. Past the window the caller gets one documented
exception, :class:`UnavailableError`.

The policy (:class:`Backoff`) is plain state with no I/O, so the sync driver here and any
other driver share it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterError,
    NoPermissionError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

from ._errors import (
    AccumulatorError,
    InvalidArgumentError,
    UnavailableError,
    bad_database,
    login_refused,
    permission_denied,
)

logger = logging.getLogger("accumulator")

T = TypeVar("T")

#: Seconds of unreachable Redis an operation rides through before raising UnavailableError.
RETRY_WINDOW = 30.0
_FIRST_DELAY = 0.05
_MAX_DELAY = 1.0
#: Seconds of failures after which the retrying is logged as a warning (a blip stays at INFO;
#: a restart, a failover or a wrong port shows without any logging set up).
WARN_AFTER = 2.0

#: Transport faults, and a cluster between states (a failover in progress, a slot without a
#: primary for now, a slot half-way through a migration: redis-py's cluster client gives up
#: TRYAGAIN replies after a few tries as ``ClusterError: TTL exhausted``): worth retrying.
#: Wrong credentials are not (they are ConnectionErrors in redis-py, but waiting does not fix
#: them).
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, ClusterError, TryAgainError,
             SlotNotCoveredError)  # fmt: skip
_PERMANENT = (AuthenticationError, AuthorizationError)
#: What the retry loops catch: the transient faults, and redis-py's RedisClusterException
#: (neither a RedisError nor a ConnectionError), which :func:`cluster_error` sorts out.
_CAUGHT = (*TRANSIENT, RedisClusterException)


def cluster_error(exc: RedisClusterException) -> Exception:
    """Ours for redis-py's ``RedisClusterException``, raised when a cluster client cannot
    learn its nodes: none reachable (or the slots not all served yet) is a
    ``redis.ConnectionError``, transient; a server that is no cluster node (a
    ``redis+cluster://`` URL of a plain server) an :class:`InvalidArgumentError`; a login
    the nodes refused a :class:`PermissionDeniedError`; anything else stays as it is. The
    original is the new one's ``__cause__``."""
    text = str(exc)
    ours: Exception
    if isinstance(exc.__cause__, _PERMANENT):  # no node took the login: not a fault to wait out
        return login_refused(str(exc.__cause__))
    if "Cluster mode is not enabled" in text:  # (also found behind "cannot be connected")
        ours = InvalidArgumentError(
            "a redis+cluster:// URL (or cluster client) names a server that is no cluster "
            "node (cluster mode is not enabled): use a redis:// URL for it"
        )
    elif "cannot be connected" in text or "not covered" in text:
        ours = redis.ConnectionError(f"Redis Cluster unreachable: {text}")
    else:
        return exc
    ours.__cause__ = exc
    return ours


def checked_window(seconds: object) -> float:
    """A retry window as given by a user: a positive number of seconds."""
    try:
        window = float(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        window = float("nan")
    if not 0 < window < float("inf"):
        raise InvalidArgumentError(f"retry_window must be a positive number of seconds, got "
                                   f"{seconds!r}")  # fmt: skip
    return window


def is_transient(exc: BaseException) -> bool:
    """A fault the retry window absorbs (connection refused or reset, timeouts, LOADING)."""
    return isinstance(exc, TRANSIENT) and not isinstance(exc, _PERMANENT)


def is_unreachable(exc: BaseException) -> bool:
    """Redis could not be reached: a transient fault, or the :class:`UnavailableError` a
    retry window raised after them (not an answer of the server's)."""
    return isinstance(exc, UnavailableError) or is_transient(exc)


def raise_transient(replies: list[Any]) -> None:
    """Raise the first transient fault among a batch's replies (redis-py's cluster pipeline
    returns a node's connection error, or CLUSTERDOWN, as the reply of each of its commands):
    the batch fails whole, as on a single server, and the retry window sends it again (every
    batch of ours may be sent again: SET NX parts, idempotent scripts). Without this, an
    apply took such a reply for a refusal (a review's cluster drill)."""
    fault = next((r for r in replies if isinstance(r, Exception) and is_transient(r)), None)
    if fault is not None:
        raise fault


def breaks_wait(exc: BaseException) -> bool:
    """Whether a blocking wait that raised ``exc`` met a fault of its connection, or was
    ended by the server (an ``UNBLOCKED`` reply), so that the taker re-checks (the take
    script rides it out) rather than an error to raise. Our errors never are one:
    PermissionDeniedError is an OSError, as Python's PermissionError."""
    if isinstance(exc, AccumulatorError):
        return False
    if isinstance(exc, ResponseError) and str(exc).startswith("UNBLOCKED"):
        # ended by the server: its role changed (a failover demoted it; on a cluster, the
        # slot is served elsewhere now), or CLIENT UNBLOCK ... ERROR: re-check
        return True
    return is_transient(exc) or isinstance(exc, OSError)


@dataclass
class Backoff:
    """When to try again, and when to give up: the decisions, without the sleeping."""

    window: float = RETRY_WINDOW
    started: float | None = None  # monotonic time of the first failure
    delay: float = _FIRST_DELAY
    failures: int = field(default=0)
    warned: bool = False

    def elapsed(self, now: float) -> float:
        """Seconds since the first failure."""
        return 0.0 if self.started is None else now - self.started

    def warn_now(self, now: float) -> bool:
        """True once, at the first retry :data:`WARN_AFTER` seconds into the failures."""
        if self.warned or self.elapsed(now) < WARN_AFTER:
            return False
        self.warned = True
        return True

    def next_delay(self, now: float, began: float | None = None) -> float | None:
        """Seconds to wait before the next attempt, or None: the window is over. ``began``:
        when the attempt that failed began, if its whole time counts as unreachable (it
        failed to connect: a connect timeout, retried by redis-py, takes many seconds)."""
        if self.started is None:
            self.started = now if began is None else min(began, now)
        self.failures += 1
        left = self.started + self.window - now
        if left <= 0:
            return None
        wait = min(self.delay * random.uniform(0.5, 1.0), left)
        self.delay = min(self.delay * 2, _MAX_DELAY)
        return wait


def call(
    fn: Callable[[], T],
    what: str,
    *,
    window: float = RETRY_WINDOW,
    give_up: Callable[[], bool] = lambda: False,
) -> T:
    """``fn()``, retried on transient faults for up to ``window`` seconds.

    ``give_up()`` is asked before each retry (e.g. the accumulator was closed). Raises
    :class:`UnavailableError` (with the last fault as ``__cause__``) after the window.
    """
    backoff = Backoff(window)
    while True:
        began = time.monotonic()
        try:
            return fn()
        except _CAUGHT as exc:
            time.sleep(_next_wait(backoff, exc, what, give_up, began))
        except NoPermissionError as exc:  # redis-py's, of a plain command or pipeline
            raise permission_denied(str(exc)) from exc
        except AskError as exc:  # (cluster clients follow redirects: this one is plain)
            raise _not_the_cluster(what, exc) from exc
        except ResponseError as exc:
            ours = _at_connect(exc)
            if ours is exc:
                raise
            raise ours from exc


async def acall(
    fn: Callable[[], Awaitable[T]],
    what: str,
    *,
    window: float = RETRY_WINDOW,
    give_up: Callable[[], bool] = lambda: False,
) -> T:
    """:func:`call` for asyncio: ``await fn()``, retried the same way."""
    backoff = Backoff(window)
    while True:
        began = time.monotonic()
        try:
            return await fn()
        except _CAUGHT as exc:
            await asyncio.sleep(_next_wait(backoff, exc, what, give_up, began))
        except NoPermissionError as exc:
            raise permission_denied(str(exc)) from exc
        except AskError as exc:
            raise _not_the_cluster(what, exc) from exc
        except ResponseError as exc:
            ours = _at_connect(exc)
            if ours is exc:
                raise
            raise ours from exc


def _not_the_cluster(what: str, exc: BaseException) -> InvalidArgumentError:
    """A plain client of one node of a Redis Cluster was redirected (MOVED/ASK)."""
    return InvalidArgumentError(
        f"{what}: the server is a node of a Redis Cluster that does not serve this key's slot "
        f"({exc}): connect with a redis+cluster:// URL (or a redis.cluster.RedisCluster "
        "client), not a plain URL of one node"
    )


def failed_to_connect(exc: BaseException) -> bool:
    """Whether redis-py failed to open a connection (its "Timeout connecting to server",
    "Error 111 connecting to host:port"), as opposed to losing one in use."""
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and (
        "connecting to" in str(exc)
    )


def _at_connect(exc: ResponseError) -> Exception:
    """Ours for an error reply to what a connection sends first (``SELECT`` of a database the
    server does not have); any other error reply as it is."""
    if "DB index is out of range" in str(exc):
        return bad_database(str(exc))
    return exc


def _next_wait(
    backoff: Backoff, exc: BaseException, what: str, give_up: Callable[[], bool],
    began: float | None = None,
) -> float:  # fmt: skip
    """Seconds to pause before retrying after ``exc``; raises it (or UnavailableError once the
    window is over, or ``give_up()``) when it is not to be retried. ``began``: when the
    failed attempt began; the window counts from there when it failed to connect (a long
    transfer cut off at its end still gets the whole window)."""
    if isinstance(exc, RedisClusterException):
        exc = cluster_error(exc)
    if isinstance(exc, _PERMANENT):
        if backoff.failures:
            # an earlier try failed midway (its outcome unknown: an apply may have counted):
            # as unreachable, not a refusal, which would drop what that try sent
            raise UnavailableError(f"{what}: Redis refused the login when retried after "
                                   f"{backoff.failures} failure(s) ({exc})") from exc
        raise login_refused(str(exc)) from exc
    if not is_transient(exc):
        raise exc
    now = time.monotonic()
    wait = backoff.next_delay(now, began if failed_to_connect(exc) else None)
    if wait is None or give_up():
        stopped = "" if wait is None else "; given up: closed"
        raise UnavailableError(
            f"{what}: Redis unreachable for {backoff.elapsed(now):.1f}s ({backoff.failures} "
            f"attempt{'' if backoff.failures == 1 else 's'}{stopped}; last: "
            f"{type(exc).__name__}: {exc})"
        ) from exc
    if backoff.failures == 1:
        logger.info("%s: %s; retrying for up to %gs", what, exc, backoff.window)
    elif backoff.warn_now(now):
        logger.warning("%s: Redis unreachable for %.0fs (%s: %s); retrying until %gs",
                       what, backoff.elapsed(now), type(exc).__name__, exc,
                       backoff.window)  # fmt: skip
    return wait
