"""What every ``accumulator`` command is built on: the exit codes and :class:`CliError`, the
command table (:func:`command`, :func:`arg`, :data:`COMMANDS`), :func:`esc` (text from Redis
made safe to print) and the :class:`Context` a command gets (global options, streams, a
lazy connection, confirmation)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ._cluster_client import new_cluster
from ._connection import TLSConnection, sentinel_client
from ._redact import redact_url, scrub, url_secrets
from ._urls import cluster_url, scheme_problem

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_CONNECT = 3
EXIT_ERROR = 4
#: A failure of ours (sysexits' EX_SOFTWARE), not of the server or the input.
EXIT_INTERNAL = 70

#: The errors that say the server cannot be reached (exit 3; ``watch`` rides them out).
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, RedisClusterException)

CONNECT_TIMEOUT = 5.0
COMMAND_TIMEOUT = 30.0

#: The environment variable holding the password (redis-cli's): used when the URL has none.
AUTH_ENV = "REDISCLI_AUTH"


class CliError(Exception):
    """Ends a command with a message on stderr and an exit code."""

    def __init__(self, code: int, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind


# -- the command table ------------------------------------------------------------------------

Runner = Callable[["Context", argparse.Namespace], int]
ArgSpec = tuple[tuple[str, ...], dict[str, Any]]


def arg(*flags: str, **kwargs: Any) -> ArgSpec:
    """One ``add_argument`` call of a command, recorded for :func:`command`."""
    return flags, kwargs


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Runner
    arguments: tuple[ArgSpec, ...] = ()
    destructive: bool = False  # adds -y/--yes; the command asks first (see Context.confirm)
    #: Takes its own options (all arguments after the name go to ``run`` as ``args.args``,
    #: unparsed): listed in ``--help`` like the others.
    passthrough: bool = False
    #: Does not talk to Redis: of the global options only ``--json`` (``module``).
    offline: bool = False


COMMANDS: dict[str, Command] = {}


def command(
    name: str,
    help: str,
    *arguments: ArgSpec,
    destructive: bool = False,
    passthrough: bool = False,
    offline: bool = False,
) -> Callable[[Runner], Runner]:
    """Register a subcommand: ``@command("name", "one-line help", arg(...), ...)``."""

    def register(func: Runner) -> Runner:
        COMMANDS[name] = Command(name, help, func, tuple(arguments), destructive, passthrough,
                                 offline)  # fmt: skip
        return func

    return register


# -- context: connection, output, confirmation ------------------------------------------------


def esc(text: object, *, quote: bool = False) -> str:
    """``text`` safe to print on a terminal: control and other non-printable characters
    escaped as in ``repr`` (``\\x1b``, ``\\n``, ``\\u202e``). ``quote=True``: its ``repr``,
    quotes included (how sentences name things: ``'dense/w'``). Every name, container and
    other text read from Redis goes through here before it is printed."""
    value = text if isinstance(text, str) else str(text)
    if quote:
        return repr(value)
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in value)


@dataclass
class Context:
    """What every command gets: the global options, the streams, a lazy connection.

    ``url`` and ``password`` are secrets (not in ``repr``); show :attr:`shown_url`."""

    url: str = field(repr=False)
    container: str | None  # None: not given (ls lists every container; others use "")
    json: bool
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    stdin: TextIO = field(default_factory=lambda: sys.stdin)
    user: str | None = None  # --user: the ACL user name (overrides the URL's)
    tls: bool = False  # --tls
    tls_ca_cert: str | None = None  # --tls-ca-cert FILE (implies TLS)
    password: str | None = field(default=None, repr=False)  # $REDISCLI_AUTH
    json_lines: bool = False  # --json writes one document per line (watch), not indented
    _client: redis.Redis | None = field(default=None, repr=False)

    @property
    def scope(self) -> str:
        """The container a single-accumulator command works in."""
        return self.container or ""

    @property
    def shown_url(self) -> str:
        """The URL as it may be shown: passwords masked, control characters escaped."""
        return esc(redact_url(self.url))

    @property
    def secrets(self) -> list[str]:
        """What must never be printed: the URL's password(s) and ``$REDISCLI_AUTH``."""
        return [*url_secrets(self.url), *([self.password] if self.password else [])]

    def has_password(self) -> bool:
        """Whether a password will be sent: one in the URL, else ``$REDISCLI_AUTH``."""
        # (any scheme: redis-py's parse_url refuses cluster and sentinel URLs)
        return bool(url_secrets(self.url)) or bool(self.password)

    def connection_options(self) -> dict[str, Any]:
        """Keyword arguments of the connection pool: the URL's (as ``redis.from_url`` reads
        it), with ``--user``, ``--tls``, ``--tls-ca-cert`` and ``$REDISCLI_AUTH`` applied.
        Raises :class:`CliError` (usage) for an invalid URL or TLS on a unix socket."""
        try:
            options: dict[str, Any] = parse_url(self.url)
        except ValueError as exc:
            raise CliError(
                EXIT_USAGE, f"invalid --url {esc(redact_url(self.url), quote=True)}: {exc}", "usage"
            ) from exc
        if self.tls or self.tls_ca_cert:
            if options.get("connection_class") is UnixDomainSocketConnection:
                raise CliError(EXIT_USAGE, "--tls needs a TCP URL, not a unix:// socket", "usage")
            options["connection_class"] = TLSConnection
        if options.get("connection_class") is SSLConnection:  # a rediss:// URL
            options["connection_class"] = TLSConnection
        if self.tls_ca_cert:
            if not os.path.isfile(self.tls_ca_cert):
                raise CliError(
                    EXIT_USAGE,
                    f"--tls-ca-cert: no such file {esc(self.tls_ca_cert, quote=True)}",
                    "usage",
                )
            options["ssl_ca_certs"] = self.tls_ca_cert
        if self.user:
            options["username"] = self.user
        if options.get("password") is None and self.password:
            options["password"] = self.password
        return {
            "socket_connect_timeout": CONNECT_TIMEOUT,
            "socket_timeout": COMMAND_TIMEOUT,
            "retry": Retry(NoBackoff(), 1),
            **options,  # the URL's own settings win, as with redis.from_url
            "decode_responses": False,  # (but this one: every reader here expects bytes)
        }

    def _sentinel_options(self) -> dict[str, Any]:
        """``--user``, ``$REDISCLI_AUTH``, ``--tls`` and ``--tls-ca-cert`` for the primary a
        ``redis+sentinel://`` URL names (the URL's own user and password win)."""
        extra: dict[str, Any] = {"retry": Retry(NoBackoff(), 1)}  # (as a plain URL's)
        if self.user:
            extra["username"] = self.user
        if self.password:
            extra["password"] = self.password
        if self.tls or self.tls_ca_cert:
            extra["ssl"] = True
        if self.tls_ca_cert:
            extra["ssl_ca_certs"] = self.tls_ca_cert
        return extra

    def connect(self) -> redis.Redis:
        """A checked connection (PING answered); raises :class:`CliError` when impossible."""
        if self._client is not None:
            return self._client
        try:
            return self._connect()
        except (ValueError, TypeError) as exc:  # a URL redis-py cannot read ('redis://[::1/0')
            raise CliError(
                EXIT_USAGE, f"invalid --url {esc(redact_url(self.url), quote=True)}: "
                f"{scrub(str(exc), url_secrets(self.url))}", "usage",
            ) from exc  # fmt: skip

    def _connect(self) -> redis.Redis:
        problem = scheme_problem(self.url)
        if problem is not None:
            raise CliError(
                EXIT_USAGE, f"invalid --url {esc(redact_url(self.url), quote=True)}: {problem}",
                "usage",
            )  # fmt: skip
        plain = cluster_url(self.url)
        if plain is not None:  # redis+cluster://: a cluster client, which finds every node
            extra: dict[str, Any] = {"username": self.user} if self.user else {}
            if self.password and "@" not in plain:
                extra["password"] = self.password
            if self.tls_ca_cert:
                extra["ssl_ca_certs"] = self.tls_ca_cert
            if (self.tls or self.tls_ca_cert) and plain.startswith("redis://"):
                plain = "rediss://" + plain[len("redis://") :]
            url = plain
            cluster = new_cluster(lambda: RedisCluster.from_url(
                url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=COMMAND_TIMEOUT,
                **extra,
            ))  # fmt: skip
            cluster.ping()
            # the admin functions use only what both clients serve (keys route by slot)
            self._client = cast(redis.Redis, cluster)
            return self._client
        managed = sentinel_client(self.url, **self._sentinel_options())
        if managed is not None:  # redis+sentinel://: the primary the Sentinels name
            self._probe_managed(managed)
            self._client = managed
            return managed
        pool = redis.ConnectionPool(**self.connection_options())
        try:  # a connection object checks the options without connecting
            pool.connection_class(**pool.connection_kwargs)
        except (TypeError, ValueError) as exc:  # e.g. an unknown ?option in the URL
            raise CliError(
                EXIT_USAGE, f"invalid --url {esc(redact_url(self.url), quote=True)}: {exc}", "usage"
            ) from exc
        client = redis.Redis(connection_pool=pool)
        client.auto_close_connection_pool = True  # close() ends the pool's connections too
        if not self._probe(pool):
            client.ping()  # errors are mapped by main()
        self._client = client
        self._note_cluster_node(client)
        return client

    def _probe(self, pool: redis.ConnectionPool) -> bool:
        """PING on a connection of its own that waits :data:`CONNECT_TIMEOUT` for the reply,
        not the :data:`COMMAND_TIMEOUT` a command gets (a frozen server, or one that accepts
        connections and never answers, is "cannot connect" within seconds, not a minute).
        Returns whether it pinged: a URL that sets ``socket_timeout`` keeps it, and the
        caller pings with it. Errors are mapped by ``main()``."""
        if "socket_timeout" in parse_url(self.url):
            return False
        kwargs = {**pool.connection_kwargs, "socket_timeout": CONNECT_TIMEOUT}
        probe = redis.Redis(connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class, **kwargs
        ))  # fmt: skip
        try:
            probe.ping()
        finally:
            probe.close()
            probe.connection_pool.disconnect()
        return True

    def _probe_managed(self, client: redis.Redis) -> None:
        """The first PING of a Sentinel-managed client, as :meth:`_probe`'s: its connection
        waits :data:`CONNECT_TIMEOUT` for the reply (and is dropped), the ones after it as
        long as a command's (a frozen primary took a minute to be "cannot connect")."""
        kwargs = client.connection_pool.connection_kwargs
        after = kwargs.get("socket_timeout") or COMMAND_TIMEOUT
        kwargs["socket_timeout"] = CONNECT_TIMEOUT
        try:
            client.ping()
        finally:
            kwargs["socket_timeout"] = after
            client.connection_pool.disconnect()

    def _note_cluster_node(self, client: redis.Redis) -> None:
        """A plain URL of a cluster node reaches that node alone: say so once (its commands
        would list, or find, only what that node's slots hold)."""
        try:
            enabled = client.info("cluster").get("cluster_enabled")
        except Exception:  # noqa: BLE001 - no INFO for this user, a double without it
            return
        if enabled == 1:
            self.err.write(
                f"accumulator: note: {self.shown_url} is a node of a Redis Cluster: a plain URL "
                "reaches that node alone (its own slots' accumulators); use redis+cluster:// "
                "for the cluster\n"
            )

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None

    def write(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def dump(self, data: Any) -> None:
        self.write(json.dumps(data, indent=None if self.json_lines else 2, sort_keys=False))

    def confirm(self, question: str, yes: bool, what: str) -> None:
        """Ask on a terminal; without one (and without --yes) refuse. Raises CliError(2)."""
        if yes:
            return
        if not self.stdin.isatty():
            raise CliError(
                EXIT_USAGE,
                f"refusing to {what} without confirmation: stdin is not a terminal; pass --yes",
                "refused",
            )
        # on stderr, unless only stdout shows on the terminal (``2>log``: the question would
        # be invisible while the command waits for an answer)
        ask = self.out if self.out.isatty() and not self.err.isatty() else self.err
        ask.write(f"{question} [y/N] ")
        ask.flush()
        answer = self.stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            raise CliError(EXIT_USAGE, "aborted, nothing changed", "refused")
