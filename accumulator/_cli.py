"""The ``accumulator`` command line: inspect and operate the accumulators kept in a Redis server.

Global options (accepted before or after the command): ``--url`` (default: the library's,
``ACCUMULATOR_REDIS_URL``, then ``REDIS_URL``, then ``redis://localhost:6379/0``),
``--container``, ``--json``, and for the connection ``--user NAME`` (ACL user name; overrides
the URL's), ``--tls`` (TLS, as a ``rediss://`` URL) and ``--tls-ca-cert FILE`` (CA
certificates to verify the server with; implies ``--tls``).

Passwords stay out of the command line (where ``ps`` shows them to every user): like
``redis-cli``, the password is taken from ``$REDISCLI_AUTH`` when the URL has none. A password
given in the URL anyway (``redis://:PASSWORD@host``, ``?password=...``) is never printed:
every URL shown, in output and in error messages, is masked (``accumulator._redact``).

Names and other text read from Redis are untrusted: every name, container, taker id, key and
definition field printed is escaped (control characters as ``\\x1b``, ``\\n``, ...; see
:func:`esc`), so a name cannot drive the terminal. ``ls`` survives foreign keys under the
accumulators' prefix: a state key of the wrong type (e.g. a string written by another
program) is listed as a warning row (``KIND`` ``?``, the reason below the table), and in
``ls --json`` as an entry with ``"kind": "?"`` and an ``"error"`` string (``"error": null``
on every readable entry).

Commands: ``ls``, ``show``, ``watch`` (read-only), ``set-step`` (asks first when the
accumulator is live: pending gradients or waiting takers), ``reset``, ``delete``,
``reset-container`` (destructive: they ask on a terminal, refuse without one unless
``--yes``), ``job NAME`` (a sync job of :mod:`accumulator.sync`: published step, chief lease,
workers, parameters, with a warning when they disagree; ``--delete`` removes a finished
job's keys, an unfinished one only with ``--force``) and ``demo`` (its own options, handed
over unparsed). A single-accumulator command whose name is not found, but exists in other
containers, says where.

Exit codes: 0 ok; 1 no such accumulator; 2 usage error, or a destructive command refused
(no ``--yes`` and no terminal to ask on, or answered no); 3 cannot connect (server unreachable,
password wrong or missing); 4 any other error reported by the server (e.g. a key schema this
version does not speak, an ACL refusing a command).

Adding a command is one decorated function::

    @command("demo", "run the demo job", arg("--workers", type=int, default=4))
    def _demo(ctx: Context, args: argparse.Namespace) -> int:
        client = ctx.connect()  # only if it needs the server; connecting is lazy
        ...
        return EXIT_OK
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import redis
from redis.backoff import NoBackoff
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import _admin
from ._codec import format_shape
from ._connection import default_url
from ._errors import AccumulatorError, InvalidArgumentError, NotFoundError, SchemaVersionError
from ._keys import SCHEMA_VERSION
from ._redact import redact_url, scrub, url_secrets

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_CONNECT = 3
EXIT_ERROR = 4

CONNECT_TIMEOUT = 5.0
COMMAND_TIMEOUT = 30.0

_PROG = "accumulator"
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


COMMANDS: dict[str, Command] = {}


def command(
    name: str,
    help: str,
    *arguments: ArgSpec,
    destructive: bool = False,
    passthrough: bool = False,
) -> Callable[[Runner], Runner]:
    """Register a subcommand: ``@command("name", "one-line help", arg(...), ...)``."""

    def register(func: Runner) -> Runner:
        COMMANDS[name] = Command(name, help, func, tuple(arguments), destructive, passthrough)
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
        try:
            in_url = parse_url(self.url).get("password") is not None
        except ValueError:
            in_url = False
        return in_url or bool(self.password)

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
            options["connection_class"] = SSLConnection
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
        }

    def connect(self) -> redis.Redis:
        """A checked connection (PING answered); raises :class:`CliError` when impossible."""
        if self._client is not None:
            return self._client
        pool = redis.ConnectionPool(**self.connection_options())
        try:  # a connection object checks the options without connecting
            pool.connection_class(**pool.connection_kwargs)
        except (TypeError, ValueError) as exc:  # e.g. an unknown ?option in the URL
            raise CliError(
                EXIT_USAGE, f"invalid --url {esc(redact_url(self.url), quote=True)}: {exc}", "usage"
            ) from exc
        client = redis.Redis(connection_pool=pool)
        client.auto_close_connection_pool = True  # close() ends the pool's connections too
        client.ping()  # errors are mapped by main()
        self._client = client
        return client

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None

    def write(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def dump(self, data: Any) -> None:
        self.write(json.dumps(data, indent=2, sort_keys=False))

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
        self.err.write(f"{question} [y/N] ")
        self.err.flush()
        answer = self.stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            raise CliError(EXIT_USAGE, "aborted, nothing changed", "refused")


# -- formatting -------------------------------------------------------------------------------


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable


def fmt_ms(ms: int | float | None) -> str:
    """A duration: 850ms, 12.3s, 4m05s, 2h03m, 3d04h."""
    if ms is None:
        return "n/a"
    ms = float(ms)
    sign = "-" if ms < 0 else ""
    ms = abs(ms)
    if ms < 1000:
        return f"{sign}{ms:.0f}ms"
    s = ms / 1000
    if s < 60:
        return f"{sign}{s:.1f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{sign}{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{sign}{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{sign}{d}d{h:02d}h"


def fmt_time(ms: int | None, now_ms: int | None) -> str:
    if ms is None:
        return "never"
    stamp = _dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")
    return stamp if now_ms is None else f"{stamp} ({fmt_ms(now_ms - ms)} ago)"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    """Aligned columns, two spaces apart; columns in ``right`` are right-aligned. Cells are
    escaped (:func:`esc`): they may hold names and other text read from Redis."""
    rows = [[esc(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in (headers, *rows):
        cells = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _pairs(pairs: Sequence[tuple[str, str]], indent: str = "  ") -> list[str]:
    width = max(len(k) for k, _ in pairs)
    return [f"{indent}{k.ljust(width)}  {esc(v)}" for k, v in pairs]


def _where(name: str, container: str) -> str:
    """How a sentence names an accumulator: ``'name' (container 'c')``, escaped."""
    where = esc(name, quote=True)
    return where + f" (container {esc(container, quote=True)})" if container else where


def _unreadable(info: _admin.Info) -> str | None:
    """Why ``ls`` could not read this entry (None: it could)."""
    return info.error if isinstance(info, _admin.Unreadable) else None


def render_ls(
    infos: Sequence[_admin.Info], server: dict[str, Any] | None, with_container: bool
) -> list[str]:
    headers = ["NAME", "KIND", "DTYPE", "SHAPE", "REDUCTION", "STEP", "COUNT", "TAKERS", "BYTES"]
    rows = [
        [i.shared_name, "?", "", "", "", "", "", "", ""]
        if _unreadable(i) is not None
        else [
            i.shared_name,
            i.kind,
            i.dtype,
            i.shape_text,
            i.reduction,
            str(i.step),
            str(i.count),
            str(i.takers_waiting),
            fmt_bytes(i.bytes),
        ]
        for i in infos
    ]
    right = [5, 6, 7, 8]
    if with_container:
        headers.insert(0, "CONTAINER")
        for row, info in zip(rows, infos, strict=True):
            row.insert(0, info.container or '""')
        right = [c + 1 for c in right]
    lines = table(headers, rows, right) if infos else ["no accumulators"]
    warnings = [
        f"warning: {_where(i.shared_name, i.container)}: {esc(error)}"
        for i in infos
        if (error := _unreadable(i)) is not None
    ]
    if warnings:
        lines += ["", *warnings]
    footer = plural(len(infos) - len(warnings), "accumulator")
    if warnings:
        footer += f" (and {len(warnings)} unreadable, listed with KIND ?)"
    if server is not None:
        footer += f" · {esc(server['server'])} {esc(server['version'])}"
        if server.get("used_memory_human"):
            footer += f" · server memory {esc(server['used_memory_human'])}"
    return [*lines, "", footer] if infos else [*lines]


def render_show(info: _admin.Info, prev: _admin.Info | None = None) -> list[str]:
    now = info.now_ms
    title = f"accumulator {esc(info.shared_name, quote=True)}"
    if info.container:
        title += f" in container {esc(info.container, quote=True)}"
    if info.private:
        title += " (private)"
    definition = f"{info.kind} {info.dtype} {info.shape_text} {info.reduction}"
    if info.definition_error:
        definition += f"  ({info.definition_error})"
    pending = plural(info.count, "gradient")
    if info.round_shape is not None:
        pending += f" of shape [{','.join(str(d) for d in info.round_shape)}]"
    pending += f", {fmt_bytes(info.bytes)}"
    storage = plural(info.keys, "key") if info.keys is not None else "n/a"
    storage += (
        f", {fmt_bytes(info.memory_bytes)} (MEMORY USAGE)"
        if info.memory_bytes is not None
        else ", memory n/a (MEMORY USAGE not available)"
    )
    limit = (
        fmt_bytes(info.max_pending_bytes)
        if info.max_pending_bytes is not None
        else "default (set by no opener)"
    )
    head = [
        ("definition", definition),
        ("global step", str(info.step)),
        ("pending round", pending),
        ("max pending", limit),
        ("waiting takers", str(info.takers_waiting)),
        ("created", fmt_time(info.created_ms, now)),
    ]
    if info.detailed:
        head.append(("stored", storage))
    if info.schema != str(SCHEMA_VERSION):
        head.append(("key schema", f"{info.schema} (this library speaks {SCHEMA_VERSION})"))
    lines = [title, *_pairs(head)]

    stale = str(info.n_stale)
    if info.n_stale:
        stale += f" (on average {info.mean_stale:.1f} steps behind, at most {info.max_stale})"
    quarantined = str(info.n_quarantined)
    if info.detailed:
        quarantined += f" ({plural(info.quarantined, 'entry', 'entries')} in quarantine now)"
    last_take = "never"
    if info.last_take_ms is not None:
        last_take = f"{fmt_ms(now - info.last_take_ms)} ago" if now is not None else "?"
        last_take += f", after waiting {fmt_ms(info.last_take_wait_ms)}"
    lines += [
        "",
        "lifetime",
        *_pairs(
            [
                ("applies accepted", str(info.n_applied)),
                ("stale dropped", stale),
                ("rejected", str(info.n_rejected)),
                ("quarantined", quarantined),
                ("takes", f"{info.n_taken} ({plural(info.grads_taken, 'gradient')})"),
                ("last take", last_take),
            ]
        ),
    ]
    if prev is not None and prev.now_ms is not None and now is not None and now > prev.now_ms:
        secs = (now - prev.now_ms) / 1000
        applied, stale_d = info.n_applied - prev.n_applied, info.n_stale - prev.n_stale
        taken = info.n_taken - prev.n_taken
        lines.append(
            f"  last {secs:.1f}s: +{applied} applied ({applied / secs:.1f}/s), "
            f"+{stale_d} stale, +{taken} takes ({taken / secs:.2f}/s)"
        )

    if info.detailed:
        lines += ["", f"waiting takers ({len(info.takers)})"]
        if info.takers:
            rows = []
            for t in info.takers:
                if t.lease_remaining_ms is None:
                    lease = "n/a"
                elif t.lease_remaining_ms < 0:
                    lease = f"expired {fmt_ms(-t.lease_remaining_ms)} ago (taker gone?)"
                else:
                    lease = (
                        f"renewed {fmt_ms(t.lease_age_ms)} ago, {fmt_ms(t.lease_remaining_ms)} left"
                    )
                needs = "?" if t.num_required is None else str(t.num_required)
                rows.append([str(t.position), t.taker_id, needs, fmt_ms(t.waited_ms), lease])
            lines += [
                "  " + x
                for x in table(["#", "TAKER", "NEEDS", "WAITED", "LEASE"], rows, right=[0, 2, 3])
            ]
        else:
            lines.append("  none")
        lines += ["", "left behind (claimed, never finished)"]
        if info.claims:
            rows = []
            for c in info.claims:
                held = fmt_bytes(c.bytes)
                if c.missing_blobs:
                    held += f" ({c.missing_blobs} payloads missing)"
                step = "?" if c.step is None else str(c.step)
                rows.append([c.taker_id, step, str(c.count), held, c.key])
            headers = ["TAKER", "STEP", "GRADIENTS", "BYTES", "KEY"]
            lines += ["  " + x for x in table(headers, rows, right=[1, 2])]
        else:
            lines.append("  none")
        if info.retry_buffers:
            lines.append(
                f"  (and {plural(info.retry_buffers, 'finished take')} kept briefly so that a "
                "retried take gets the same round; they expire on their own)"
            )
        if info.stray_keys:
            lines.append(
                f"  {plural(info.stray_keys, 'stray key')} (payloads of applies that "
                "never completed; they expire on their own)"
            )
    return lines


# -- commands ---------------------------------------------------------------------------------


@command("ls", "list accumulators (all containers unless --container is given)")
def _ls(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    infos = _admin.list_accumulators(r, ctx.container)
    server = _admin.server_info(r)
    if ctx.json:
        ctx.dump(
            {
                "url": redact_url(ctx.url),
                "container": ctx.container,
                "server": server,
                "accumulators": [{**i.to_dict(), "error": _unreadable(i)} for i in infos],
            }
        )
    else:
        with_container = ctx.container is None and any(i.container for i in infos)
        ctx.write("\n".join(render_ls(infos, server, with_container)))
    return EXIT_OK


@command("show", "everything about one accumulator", arg("name", help="its shared_name"))
def _show(ctx: Context, args: argparse.Namespace) -> int:
    info = _admin.describe(ctx.connect(), args.name, ctx.scope)
    if ctx.json:
        ctx.dump(info.to_dict())
    else:
        ctx.write("\n".join(render_show(info)))
    return EXIT_OK


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


@command(
    "watch",
    "live view of one accumulator (Ctrl-C to quit)",
    arg("name", help="its shared_name"),
    arg(
        "-i",
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1)",
    ),
    arg(
        "-n",
        "--count",
        type=_positive_int,
        default=None,
        metavar="N",
        help="stop after N refreshes (default: until Ctrl-C)",
    ),
)
def _watch(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    tty = ctx.out.isatty() and not ctx.json
    prev: _admin.Info | None = None
    shown = 0
    try:
        if tty:
            ctx.out.write("\x1b[2J")
        while True:
            info = _admin.describe(r, args.name, ctx.scope)
            if ctx.json:  # one JSON document per line
                ctx.write(json.dumps(info.to_dict()))
            else:
                header = (
                    f"every {args.interval:g}s · {ctx.shown_url} · "
                    f"{time.strftime('%H:%M:%S')}" + ("  (Ctrl-C to quit)" if tty else "")
                )
                lines = [header, "", *render_show(info, prev)]
                if tty:  # home, overwrite each line, clear what the last frame left below
                    ctx.out.write("\x1b[H" + "".join(x + "\x1b[K\n" for x in lines) + "\x1b[J")
                    ctx.out.flush()
                else:
                    ctx.write("\n".join(lines) + "\n")
            prev = info
            shown += 1
            if args.count is not None and shown >= args.count:
                return EXIT_OK
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_OK


@command(
    "set-step",
    "set the global step (also downwards); the pending round is kept; asks first when the "
    "accumulator is live (pending gradients or waiting takers)",
    arg("name", help="its shared_name"),
    arg("step", type=int, metavar="N", help="the new global step"),
    destructive=True,
)
def _set_step(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    info = _admin.describe(r, args.name, ctx.scope, memory=False)
    if info.count or info.takers_waiting:
        live = (
            f"{plural(info.count, 'pending gradient')} at step {info.step}, "
            f"{plural(info.takers_waiting, 'waiting taker')}"
        )
        ctx.confirm(
            f"{_where(args.name, ctx.scope)} is live: {live}. Set its global step "
            f"{info.step} -> {args.step}? (a chief and its workers disagree on the step then)",
            args.yes,
            f"set the step of live accumulator {esc(args.name, quote=True)} ({live})",
        )
    old = _admin.set_step(r, args.name, args.step, ctx.scope)
    if ctx.json:
        ctx.dump(
            {"container": ctx.scope, "name": args.name, "previous_step": old, "step": args.step}
        )
    else:
        ctx.write(f"global step of {_where(args.name, ctx.scope)}: {old} -> {args.step}")
    return EXIT_OK


@command(
    "reset",
    "drop the pending gradients (the step is kept)",
    arg("name", help="its shared_name"),
    destructive=True,
)
def _reset(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    info = _admin.describe(r, args.name, ctx.scope, memory=False)
    ctx.confirm(
        f"Drop the {plural(info.count, 'pending gradient')} "
        f"({fmt_bytes(info.bytes)}) of {_where(args.name, ctx.scope)}?",
        args.yes,
        f"reset {esc(args.name, quote=True)}",
    )
    dropped = _admin.reset(r, args.name, ctx.scope)
    if ctx.json:
        ctx.dump({"container": ctx.scope, "name": args.name, "dropped": dropped})
    else:
        ctx.write(
            f"reset {_where(args.name, ctx.scope)}: dropped {plural(dropped, 'pending gradient')}"
        )
    return EXIT_OK


@command(
    "delete",
    "delete an accumulator and every key it has",
    arg("name", help="its shared_name"),
    destructive=True,
)
def _delete(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    try:
        info = _admin.describe(r, args.name, ctx.scope, memory=False)
        detail = (
            f" (step {info.step}, {plural(info.count, 'pending gradient')}, "
            f"{plural(info.takers_waiting, 'waiting taker')})"
        )
    except NotFoundError:
        detail = " (its state is gone; leftover keys only)"  # delete() says if there are none
    ctx.confirm(
        f"Delete accumulator {_where(args.name, ctx.scope)}{detail}?",
        args.yes,
        f"delete {esc(args.name, quote=True)}",
    )
    removed = _admin.delete(r, args.name, ctx.scope)
    if ctx.json:
        ctx.dump({"container": ctx.scope, "name": args.name, "keys_deleted": removed})
    else:
        ctx.write(f"deleted {_where(args.name, ctx.scope)} ({plural(removed, 'key')})")
    return EXIT_OK


@command("reset-container", "delete every accumulator of --container", destructive=True)
def _reset_container(ctx: Context, args: argparse.Namespace) -> int:
    if ctx.container is None:
        raise CliError(
            EXIT_USAGE,
            "reset-container needs --container (--container '' for the default container)",
            "usage",
        )
    r = ctx.connect()
    names = [i.shared_name for i in _admin.list_accumulators(r, ctx.container)]
    if names:
        shown = ", ".join(esc(n, quote=True) for n in names[:5]) + (
            ", ..." if len(names) > 5 else ""
        )
        where = esc(ctx.container, quote=True)
        ctx.confirm(
            f"Delete all {plural(len(names), 'accumulator')} of container {where} ({shown})?",
            args.yes,
            f"reset container {where}",
        )
        deleted = _admin.reset_container(r, ctx.container)
    else:
        deleted = 0
    if ctx.json:
        ctx.dump({"container": ctx.container, "deleted": deleted})
    else:
        where = esc(ctx.container, quote=True)
        ctx.write(f"deleted {plural(deleted, 'accumulator')} of container {where}")
    return EXIT_OK


def _lease_text(chief: _admin.ChiefLease | None, now: int | None) -> str:
    if chief is None:
        return "none (no chief holds the lease)"
    who = f"{chief.chief_id} (host {chief.host or '?'}, pid {chief.pid or '?'})"
    if chief.remaining_ms is None:
        return f"{who}, lease n/a"
    if chief.live:
        renewed = "" if now is None or chief.renewed_ms is None else (
            f"renewed {fmt_ms(now - chief.renewed_ms)} ago, "
        )  # fmt: skip
        return f"{who}, lease {renewed}{fmt_ms(chief.remaining_ms)} left"
    return f"{who}, lease ran out {fmt_ms(-chief.remaining_ms)} ago (the chief is gone?)"


def render_job(info: _admin.JobInfo) -> list[str]:
    """``accumulator job NAME``: the published state, the chief, workers, parameters."""
    now = info.now_ms
    title = f"sync job {esc(info.job, quote=True)}"
    if info.container:
        title += f" in container {esc(info.container, quote=True)}"
    if info.step is None:
        state = "none (not initialized, or deleted)"
    else:
        state = f"{info.step} ({'finished' if info.done else 'running'})"
    head = [("published step", state)]
    if info.replicas is not None:
        head.append(
            ("aggregation", f"{info.replicas} gradients per parameter per step, {info.reduction}")
        )
    head.append(("chief", _lease_text(info.chief, now)))
    accepted = info.pushes - info.partial - info.stale
    head.append(
        (
            "pushes",
            f"{info.pushes} ({accepted} accepted, {info.stale} stale, "
            f"{info.partial} partly stale)",
        )
    )
    lines = [title, *_pairs(head), "", f"workers ({len(info.workers)})"]
    if info.workers:
        rows = [
            [
                w.worker_id,
                str(w.pushes),
                str(w.accepted),
                str(w.stale),
                str(w.partial),
                "n/a"
                if w.last_seen_ms is None or now is None
                else f"{fmt_ms(now - w.last_seen_ms)} ago",
            ]
            for w in info.workers
        ]
        headers = ["WORKER", "PUSHES", "ACCEPTED", "STALE", "PARTIAL", "LAST SEEN"]
        lines += ["  " + x for x in table(headers, rows, right=[1, 2, 3, 4, 5])]
    else:
        lines.append("  none")
    lines += ["", f"parameters ({len(info.params)})"]
    if info.params:
        rows = [
            [
                p.name,
                p.shared_name,
                p.kind,
                p.dtype,
                format_shape(p.shape),
                "missing" if p.step is None else str(p.step),
                str(p.pending),
                str(p.takers_waiting),
                str(p.claimed),
            ]
            for p in info.params
        ]
        headers = ["PARAM", "ACCUMULATOR", "KIND", "DTYPE", "SHAPE", "STEP", "PENDING", "TAKERS",
                   "CLAIMED"]  # fmt: skip
        lines += ["  " + x for x in table(headers, rows, right=[5, 6, 7, 8])]
    else:
        lines.append("  none")
    if info.warnings or info.notes:
        lines.append("")
        lines += [f"warning: {esc(w)}" for w in info.warnings]
        lines += [f"note: {esc(n)}" for n in info.notes]
    return lines


@command(
    "job",
    "a sync job (accumulator.sync): published step and done flag, chief, workers, parameters",
    arg("name", help="the job name (as given to ParameterServer and Worker)"),
    arg(
        "--delete",
        action="store_true",
        help="delete the job's keys (parameters, counters, chief lease, and the accumulators "
        "of its parameters); a job that is not finished only with --force",
    ),
    arg("--force", action="store_true", help="with --delete: also a job that is not finished"),
    destructive=True,
)
def _job(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    info = _admin.describe_job(r, args.name, ctx.scope)
    where = esc(args.name, quote=True) + (
        f" (container {esc(ctx.scope, quote=True)})" if ctx.scope else ""
    )
    if not args.delete:
        if args.force:
            raise CliError(EXIT_USAGE, "--force goes with --delete", "usage")
        if ctx.json:
            ctx.dump(info.to_dict())
        else:
            ctx.write("\n".join(render_job(info)))
        return EXIT_OK
    live = info.chief is not None and info.chief.live
    if info.step is not None and not info.done and not args.force:
        chief = f"; its chief {esc(info.chief.chief_id, quote=True)} is live" if live else ""  # type: ignore[union-attr]
        raise CliError(
            EXIT_USAGE,
            f"sync job {where} is not finished (published step {info.step}{chief}); "
            "pass --force to delete it anyway",
            "refused",
        )
    detail = f"{plural(len(info.params), 'parameter')}, {plural(info.pushes, 'push', 'pushes')}"
    if info.step is not None:
        detail = f"step {info.step}, " + ("finished, " if info.done else "NOT finished, ") + detail
    if live:
        detail += f"; its chief {esc(info.chief.chief_id, quote=True)} is still live"  # type: ignore[union-attr]
    ctx.confirm(
        f"Delete sync job {where} ({detail}) and the accumulators of its parameters?",
        args.yes,
        f"delete sync job {esc(args.name, quote=True)}",
    )
    removed = _admin.delete_job(r, args.name, ctx.scope, force=True)
    if ctx.json:
        ctx.dump({"container": ctx.scope, "job": args.name, "keys_deleted": removed})
    else:
        ctx.write(f"deleted sync job {where} ({plural(removed, 'key')})")
    return EXIT_OK


@command(
    "demo",
    "run the distributed training demo (its own options: accumulator demo --help)",
    arg("demo_args", nargs=argparse.REMAINDER, metavar="...", help="the demo's options"),
    passthrough=True,
)
def _demo(ctx: Context, args: argparse.Namespace) -> int:
    from ._demo import main as demo_main

    return int(demo_main(list(args.demo_args)) or 0)


# -- parser and main --------------------------------------------------------------------------


def _add_global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # Below the command the defaults are SUPPRESS so that an option given before the command
    # is not overwritten by the subparser's default.
    group = parser.add_argument_group("global options")
    group.add_argument(
        "--url",
        default=None if top else argparse.SUPPRESS,
        help="Redis URL, e.g. redis://host:6379/0 or rediss://host:6380/0 (default: "
        f"$ACCUMULATOR_REDIS_URL, $REDIS_URL, redis://localhost:6379/0); put the password in "
        f"${AUTH_ENV} rather than in the URL, where ps shows it to every user",
    )
    group.add_argument(
        "--user",
        metavar="NAME",
        default=None if top else argparse.SUPPRESS,
        help=f"ACL user name (overrides the URL's); its password comes from the URL or ${AUTH_ENV}",
    )
    group.add_argument(
        "--tls",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="connect with TLS (as a rediss:// URL)",
    )
    group.add_argument(
        "--tls-ca-cert",
        metavar="FILE",
        default=None if top else argparse.SUPPRESS,
        help="CA certificate(s) (PEM) to verify the server with; implies --tls",
    )
    group.add_argument(
        "--container",
        default=None if top else argparse.SUPPRESS,
        help="the accumulators' container (default: the default container; "
        "ls lists all containers)",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="machine-readable output",
    )


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Inspect and operate the accumulators kept in a Redis server.",
        epilog=f"password: ${AUTH_ENV} (as for redis-cli), used when the URL has none; "
        "passwords are never printed. "
        "`accumulator demo [--help]` runs the distributed training demo (it takes its own "
        "options). "
        "exit codes: 0 ok, 1 not found, 2 usage error or refused, 3 cannot connect "
        "(unreachable, wrong password), 4 other server error",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_global_options(parser, top=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS.values():
        if cmd.passthrough:  # listed; its arguments are its own (main() hands them over)
            sub = subparsers.add_parser(
                cmd.name, help=cmd.help, description=cmd.help, add_help=False
            )
            for flags, kwargs in cmd.arguments:
                sub.add_argument(*flags, **kwargs)
            continue
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        for flags, kwargs in cmd.arguments:
            sub.add_argument(*flags, **kwargs)
        if cmd.destructive:
            sub.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
        _add_global_options(sub, top=False)
    return parser


#: Global options that take a value, and those that do not (see _add_global_options).
_GLOBAL_VALUED = ("--url", "--user", "--tls-ca-cert", "--container")
_GLOBAL_FLAGS = ("--tls", "--json")


def _passthrough(argv: list[str]) -> tuple[Command, list[str] | str] | None:
    """A passthrough command (``demo``) and its arguments, when it is the command of
    ``argv``; ``--url``/``--container`` given before it are handed over too (the demo takes
    both), other global options are a usage error (the message instead of the arguments)."""
    given: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in _GLOBAL_VALUED:
            step = 1 if "=" in token else 2
            given += argv[i : i + step]
            i += step
        elif name in _GLOBAL_FLAGS:
            given.append(token)
            i += 1
        else:
            break
    head = COMMANDS.get(argv[i]) if i < len(argv) else None
    if head is None or not head.passthrough:
        return None
    names = [t.split("=", 1)[0] for t in given if t.startswith("--")]
    refused = [n for n in names if n not in ("--url", "--container")]
    if refused:
        return head, (
            f"{head.name} takes its own options ({_PROG} {head.name} --help), not "
            f"{', '.join(refused)}"
        )
    return head, [*given, *argv[i + 1 :]]


def _fail(ctx: Context, error: CliError) -> int:
    # the last line of defence: no secret and no control character reaches the terminal
    message = esc(scrub(error.message, ctx.secrets))
    ctx.err.write(f"{_PROG}: {message}\n")
    ctx.err.flush()
    if ctx.json:
        with contextlib.suppress(Exception):
            ctx.dump({"error": {"code": error.code, "kind": error.kind, "message": message}})
    return error.code


#: The commands that name one accumulator (a name not found gets a container hint).
_ONE_ACCUMULATOR = ("show", "watch", "set-step", "reset", "delete")


def _container_hint(ctx: Context, name: str) -> str:
    """When ``name`` exists in other containers: where, and how to reach it ("" if not)."""
    try:
        others = [c for c in _admin.containers_of(ctx.connect(), name) if c != ctx.scope]
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    if not others:
        return ""
    shown = ", ".join(esc(c, quote=True) for c in others[:5]) + (", ..." if len(others) > 5 else "")
    first = others[0]
    option = "--container ''" if first == "" else f"--container {esc(first, quote=True)}"
    return (
        f"; it exists in {'container' if len(others) == 1 else 'containers'} {shown} "
        f"(pass {option})"
    )


def _translate(ctx: Context, exc: BaseException) -> CliError:
    where = ctx.shown_url
    if isinstance(exc, AuthenticationError):  # before ConnectionError: it is a subclass
        text = str(exc)
        if "without any password configured" in text or "no password is set" in text:
            reason = "a password was given but the server has none configured"
        elif ctx.has_password():
            reason = f"wrong password (or user name): {text}"
        else:
            reason = (
                f"the server requires a password (set ${AUTH_ENV}, or give it in the URL: "
                "redis://:PASSWORD@...)"
            )
        return CliError(EXIT_CONNECT, f"cannot connect to {where}: {reason}", "auth")
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        reason = str(exc).strip() or type(exc).__name__
        return CliError(EXIT_CONNECT, f"cannot connect to {where}: {reason}", "connect")
    if isinstance(exc, NotFoundError):
        return CliError(EXIT_NOT_FOUND, str(exc), "not_found")
    if isinstance(exc, InvalidArgumentError):
        return CliError(EXIT_USAGE, str(exc), "usage")
    if isinstance(exc, SchemaVersionError):
        return CliError(EXIT_ERROR, str(exc), "schema")
    if isinstance(exc, (AccumulatorError, redis.RedisError)):
        return CliError(EXIT_ERROR, f"{type(exc).__name__}: {exc}", "server")
    raise exc


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    stdin: TextIO | None = None,
) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    err = stderr or sys.stderr
    passthrough = _passthrough(argv)
    if passthrough is not None:
        # its options are its own: nothing here parses them (not even --help)
        head, forwarded = passthrough
        if isinstance(forwarded, str):
            err.write(f"{_PROG}: {forwarded}\n")
            return EXIT_USAGE
        return head.run(
            Context(url=default_url(), container=None, json=False),
            argparse.Namespace(command=head.name, demo_args=forwarded),
        )
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors (code 2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not args.command:
        parser.print_help(err)
        return EXIT_USAGE
    ctx = Context(
        url=args.url or default_url(),
        container=args.container,
        json=args.json,
        out=stdout or sys.stdout,
        err=err,
        stdin=stdin or sys.stdin,
        user=args.user,
        tls=args.tls,
        tls_ca_cert=args.tls_ca_cert,
        password=os.environ.get(AUTH_ENV) or None,
    )
    try:
        return COMMANDS[args.command].run(ctx, args)
    except CliError as exc:
        return _fail(ctx, exc)
    except KeyboardInterrupt:
        ctx.err.write("\n")
        return 130
    except BrokenPipeError:  # e.g. `accumulator ls | head -1`
        with contextlib.suppress(Exception):
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - mapped to a message and an exit code
        error = _translate(ctx, exc)
        if isinstance(exc, NotFoundError) and args.command in _ONE_ACCUMULATOR:
            error.message += _container_hint(ctx, args.name)
        return _fail(ctx, error)
    finally:
        ctx.close()
