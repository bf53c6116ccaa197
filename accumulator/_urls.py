"""Redis URLs: the schemes we take, their checks, and the client settings they give (the
synchronous and the asyncio connections are both built from these). No I/O."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import re
import socket
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.exceptions import AuthenticationError, AuthorizationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._errors import InvalidArgumentError
from ._redact import redact_url

#: The URL clients use when none is given (and no variable names one).
DEFAULT_URL = "redis://localhost:6379/0"
#: Socket timeout for ordinary commands. Large gradients must be *sent* within it
#: (``sendall`` is covered by the timeout as a whole): 64 MiB takes ~0.2 s on loopback.
SOCKET_TIMEOUT = 30.0
#: Seconds to connect (TCP and, on rediss://, the TLS handshake).
CONNECT_TIMEOUT = 5.0
#: The faults redis-py retries itself (a few times, at once: a killed connection, a reconnect).
#: Not its timeouts: a command that waited out the socket timeout goes back to our retry
#: window (``_retry.py``), or a frozen server would cost (1 + retries) socket timeouts per try.
RETRIED_BY_REDIS_PY: tuple[type[RedisError], ...] = (RedisConnectionError,)
#: The faults it does not retry, but whose connection it must still drop (``_connection._Retry``).
NOT_RETRIED_BY_REDIS_PY: tuple[type[Exception], ...] = (RedisTimeoutError, socket.timeout)
#: A login the server refused: ConnectionErrors to redis-py, but no retry fixes them (a
#: missing password was tried 16 times, ~2 s, before its error came).
LOGIN_REFUSED: tuple[type[Exception], ...] = (AuthenticationError, AuthorizationError)


class Unretried(Exception):
    """Carries a refused login through redis-py's ``Retry``, which would retry it (it is a
    ``ConnectionError``); unwrapped by our ``Retry`` subclasses."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def default_url() -> str:
    """``ACCUMULATOR_REDIS_URL``, then ``REDIS_URL``, then ``redis://localhost:6379/0``."""
    return os.environ.get("ACCUMULATOR_REDIS_URL") or os.environ.get("REDIS_URL") or DEFAULT_URL


def url_options(url: str) -> dict[str, Any]:
    """The client settings of a URL's connections (the sync and asyncio clients add their
    own ``retry`` and :func:`pool_guard`): timeouts, keepalive on TCP, retries on connection
    faults, health checks."""
    tcp = not url.startswith("unix:")
    return dict(
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=CONNECT_TIMEOUT,
        # keepalive is a TCP option (a unix socket connection refuses the argument)
        **({"socket_keepalive": True} if tcp else {}),
        retry_on_error=list(RETRIED_BY_REDIS_PY),
        health_check_interval=30,
    )


def pool_guard(pool_class: Any) -> dict[str, Any]:
    """Settings of a pool of ``pool_class`` that keep redis-py's check of a connection it
    hands out: one with a reply nobody read (a command interrupted between its send and its
    read: Ctrl-C, a signal handler's exception) is connected again. redis-py 8 skips the
    check while maintenance notifications may be on, its default ("auto"), and the next
    command read that reply as its own (interrupt review: an apply read an HMGET's reply).
    Ours are off: they need RESP3, which our clients do not speak. Empty for a pool class
    without them (older redis-py)."""
    if not _takes_maint_settings(pool_class):
        return {}
    from redis.maint_notifications import MaintNotificationsConfig

    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


@functools.cache
def _takes_maint_settings(pool_class: Any) -> bool:
    """Whether ``pool_class`` takes ``maint_notifications_config`` (asked once per class)."""
    try:
        takes = "maint_notifications_config" in inspect.signature(pool_class).parameters
    except (TypeError, ValueError):
        return False
    return takes and importlib.util.find_spec("redis.maint_notifications") is not None


#: The URL schemes ``client=`` (and the CLI's ``--url``) take.
URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://",
               "redis+sentinel://")  # fmt: skip


def scheme_problem(url: str) -> str | None:
    """What is wrong with a URL's scheme (redis-py's own error lists only its three), or with
    the database of a ``redis://``/``rediss://`` URL (redis-py takes ``/abc`` for db 0); None
    when nothing is."""
    if not url.startswith(URL_SCHEMES):
        return f"it must start with one of {', '.join(URL_SCHEMES)}"
    if url.startswith(("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")):
        try:
            urlsplit(url).port  # noqa: B018 - (raises on a port that is no number)
        except ValueError as exc:
            return f"its port must be a number ({exc})"
    if url.startswith(("redis://", "rediss://")):
        path = urlsplit(url).path
        if path.strip("/") and not re.fullmatch(r"[0-9]+", path.strip("/")):
            return f"its path must be a database number (/0, /1, ...), not {path!r}"
    if url.startswith(("redis+cluster://", "rediss+cluster://")):
        path = urlsplit(url).path.strip("/")
        if path not in ("", "0"):  # (a cluster has database 0 only)
            return f"a cluster has database 0 only: its path must be empty or /0, not {path!r}"
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


def pop_socket_timeout(url: str) -> tuple[str, float | None]:
    """``url`` without its ``socket_timeout`` query option, and that option's seconds (None:
    not given). redis-py's URL options win over a client's arguments: taken out, the waits'
    connections of a cluster get a timeout of their own, longer than a wait slice."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = [value for name, value in query if name == "socket_timeout"]
    if not given:
        return url, None
    try:
        seconds = float(given[-1])
    except ValueError:
        raise InvalidArgumentError(
            f"socket_timeout in the URL {redact_url(url)!r} must be seconds, not {given[-1]!r}"
        ) from None
    rest = urlencode([(name, value) for name, value in query if name != "socket_timeout"])
    return urlunsplit(parts._replace(query=rest)), seconds


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
