"""Exception types, named and layered as TensorFlow's (``tf.errors``) where TF has one."""

from __future__ import annotations

__all__ = [
    "AccumulatorError",
    "CancelledError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "NotDurableError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SchemaVersionError",
    "UnavailableError",
]


class AccumulatorError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidArgumentError(AccumulatorError, ValueError):
    """Bad input (TF's ``InvalidArgumentError``); nothing was changed in Redis.

    Also a ``ValueError`` so that code catching TF's Python-layer ``ValueError`` keeps working.
    """


class DeadlineExceededError(AccumulatorError, TimeoutError):
    """A ``take_grad(..., timeout=)`` ran out of time; it consumed nothing."""

    def __init__(self, message: str = "Timed out waiting for notification") -> None:
        super().__init__(message)


class CancelledError(AccumulatorError):
    """The operation was cancelled (the accumulator was closed or deleted while waiting)."""


class FailedPreconditionError(AccumulatorError):
    """The accumulator is sealed: the ``accumulator.sync`` job it belongs to finished, and no
    round of it will be taken again. An apply that is not stale is refused; nothing was
    applied. (The sync worker raises ``TrainingFinished`` instead.)"""

    def __init__(self, message: str, final_step: int | None = None) -> None:
        super().__init__(message)
        #: The step the job finished at.
        self.final_step = final_step


class NotFoundError(AccumulatorError, LookupError):
    """The accumulator's keys are gone from Redis (deleted, reset container, or expired)."""


class SchemaVersionError(AccumulatorError):
    """The keys in Redis were written by an incompatible version of this library."""


class PermissionDeniedError(AccumulatorError, PermissionError):
    """The Redis user may not run a command the operation needs (an ACL). Raised before the
    operation's first write: step, count and round are unchanged. The message names the
    command; the README's "Security" section lists what each role needs."""


def permission_denied(text: str) -> PermissionDeniedError:
    """Ours for a refusal by the server's ACL whose text does not name what we need (redis-py's
    ``NoPermissionError``, a script's "can't run this command")."""
    return PermissionDeniedError(
        f"the Redis user lacks a permission: {text} (see the README's Security section for "
        "what each role needs)"
    )


def login_refused(text: str) -> PermissionDeniedError:
    """Ours for a login the server refused (redis-py's ``AuthenticationError``: no password
    given where one is required, a wrong one, a disabled user). Never retried."""
    return PermissionDeniedError(
        f"Redis refused the login: {text} (a server with a password needs it: in the URL, "
        "redis://:PASSWORD@host:6379/0 or redis://USER:PASSWORD@host:6379/0, or as the "
        "client's password=/username=)"
    )


def bad_database(text: str) -> InvalidArgumentError:
    """Ours for a database number the server does not have (``SELECT`` at connect)."""
    return InvalidArgumentError(
        f"Redis refused the database number: {text} (the URL's /N is beyond the server's "
        "'databases' setting, 16 by default; a Redis Cluster has only database 0)"
    )


class ResourceExhaustedError(AccumulatorError):
    """Redis is out of memory (``maxmemory`` reached under ``noeviction``), or the pending
    round would pass the accumulator's ``max_pending_bytes``. Nothing was applied."""

    #: what the server said, when it says more than "out of memory" ("NOBLOB": the apply
    #: script found the gradient's payload missing)
    reason: str | None = None


class UnavailableError(AccumulatorError, ConnectionError):
    """Redis could not be reached for longer than the retry window (``retry_window``,
    default 30 s). Faults shorter than that are retried transparently, and a retried apply is
    counted once. The underlying redis-py error is chained as ``__cause__``."""


class NotDurableError(AccumulatorError):
    """An apply was recorded on the primary, but the replicas (``min_replicas``) or the AOF
    fsync (``wait_aof``) did not confirm it within ``durability_timeout``: a failover now
    could lose it. It is counted: do not apply it again. Not an :class:`UnavailableError`
    (nor a ``ConnectionError``): a retry loop catching those would count it twice, and an
    identical gradient made next may be a new one, which the object cannot tell apart."""
