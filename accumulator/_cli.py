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

This module parses the command line and maps errors to exit codes; the rest is in one-job
modules: ``_cli_context`` (exit codes, the command table, :class:`Context`, :func:`esc`),
``_cli_render`` (formatting, the views of ``ls``/``show``/``job``) and ``_cli_commands``
(the commands). Adding a command is one decorated function there::

    @command("demo", "run the demo job", arg("--workers", type=int, default=4))
    def _demo(ctx: Context, args: argparse.Namespace) -> int:
        client = ctx.connect()  # only if it needs the server; connecting is lazy
        ...
        return EXIT_OK
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

import redis
from redis.exceptions import AuthenticationError
from redis.sentinel import MasterNotFoundError

from . import (
    _admin,
    _cli_commands,  # noqa: F401 - registers the commands in COMMANDS
    _scripts,
)
from ._cli_context import (
    AUTH_ENV,
    COMMAND_TIMEOUT,
    COMMANDS,
    CONNECT_TIMEOUT,
    EXIT_CONNECT,
    EXIT_ERROR,
    EXIT_INTERNAL,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    UNREACHABLE,
    CliError,
    Command,
    Context,
    arg,
    command,
    esc,
)
from ._errors import (
    AccumulatorError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    SchemaVersionError,
)
from ._redact import scrub, url_secrets
from ._urls import default_url

logger = logging.getLogger("accumulator")

__all__ = [
    "AUTH_ENV",
    "COMMANDS",
    "COMMAND_TIMEOUT",
    "CONNECT_TIMEOUT",
    "EXIT_CONNECT",
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "CliError",
    "Command",
    "Context",
    "arg",
    "build_parser",
    "command",
    "esc",
    "main",
]

_PROG = "accumulator"


def _add_global_options(
    parser: argparse.ArgumentParser, *, top: bool, offline: bool = False
) -> None:
    # Below the command the defaults are SUPPRESS so that an option given before the command
    # is not overwritten by the subparser's default. A command that does not connect takes
    # only --json.
    group = parser.add_argument_group("global options")
    if offline:
        group.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                           help="machine-readable output")  # fmt: skip
        return
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


class _UsageError(Exception):
    """A usage error found by the parser (argparse would print it and exit 2)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised (:class:`_UsageError`) for :func:`main` to
    report, as JSON too under ``--json``; its subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog=_PROG,
        description="Inspect and operate the accumulators kept in a Redis server.",
        epilog=f"password: ${AUTH_ENV} (as for redis-cli), used when the URL has none; "
        "passwords are never printed. "
        "`accumulator demo [--help]` runs the distributed training demo (it takes its own "
        "options). "
        "exit codes: 0 ok, 1 not found, 2 usage error or refused, 3 cannot connect "
        "(unreachable, wrong password), 4 other server error, 70 internal error (a bug)",
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
        _add_global_options(sub, top=False, offline=cmd.offline)
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


def _usage_failure(exc: _UsageError, argv: list[str], err: TextIO, out: TextIO) -> int:
    """Report a usage error as argparse does (usage line, ``PROG: error: ...``) and, under
    ``--json``, as the other errors are on stdout too. An argument it repeats is scrubbed of
    passwords like every message."""
    exc.parser.print_usage(err)
    secrets = [secret for arg in argv for secret in url_secrets(arg)]
    if os.environ.get(AUTH_ENV):
        secrets.append(os.environ[AUTH_ENV])
    message = esc(scrub(f"{exc.parser.prog}: error: {exc}", secrets))
    err.write(message + "\n")
    err.flush()
    if "--json" in argv:
        with contextlib.suppress(Exception):
            out.write(json.dumps({"error": {"code": EXIT_USAGE, "kind": "usage",
                                            "message": message}}, indent=2) + "\n")  # fmt: skip
    return EXIT_USAGE


#: The commands that name one accumulator (a name not found gets a container hint).
_ONE_ACCUMULATOR = ("show", "watch", "set-step", "reset", "delete", "evict")


def _no_such_accumulator(exc: Exception) -> bool:
    """Whether ``exc`` says the accumulator named does not exist (not: no such taker)."""
    text = str(exc)
    return isinstance(exc, NotFoundError) and (
        text.startswith("no accumulator named") or "does not exist" in text
    )


def _container_hint(ctx: Context, name: str) -> str:
    """When ``name`` exists in other containers: where, and how to reach it ("" if not).
    Ctrl-C during its SCAN skips it (the command failed already)."""
    try:
        others = [c for c in _admin.containers_of(ctx.connect(), name) if c != ctx.scope]
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - only a hint
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
    if isinstance(exc, MasterNotFoundError):
        # redis-py appends its client's whole repr: the primary's name is enough
        head = str(exc).split(" : ", 1)[0].strip()
        reason = f"{head} (no Sentinel answered, or none knows that primary)"
        return CliError(EXIT_CONNECT, f"cannot connect to {where}: {reason}", "connect")
    if isinstance(exc, UNREACHABLE):
        reason = str(exc).strip() or type(exc).__name__
        if ctx.tls and not ctx.url.startswith("rediss://"):
            reason += " (with TLS, as --tls asks: does the server speak TLS?)"
        return CliError(EXIT_CONNECT, f"cannot connect to {where}: {reason}", "connect")
    if isinstance(exc, redis.ResponseError) and "DB index is out of range" in str(exc):
        reason = f"the server has no database of the URL's number ({exc})"
        return CliError(EXIT_CONNECT, f"cannot connect to {where}: {reason}", "connect")
    if isinstance(exc, NotFoundError):
        return CliError(EXIT_NOT_FOUND, str(exc), "not_found")
    if isinstance(exc, InvalidArgumentError):
        return CliError(EXIT_USAGE, str(exc), "usage")
    if isinstance(exc, SchemaVersionError):
        return CliError(EXIT_ERROR, str(exc), "schema")
    if isinstance(exc, redis.exceptions.NoPermissionError):
        # redis-py's text names the pipeline position; say it the library's way
        exc = _scripts.translate(exc)
    if isinstance(exc, PermissionDeniedError):
        return CliError(EXIT_ERROR, str(exc), "permission")
    if isinstance(exc, (AccumulatorError, redis.RedisError)):
        return CliError(EXIT_ERROR, f"{type(exc).__name__}: {exc}", "server")
    # anything else is a bug of ours (or of what we read): one line, its own exit code, the
    # traceback in the debug log
    logger.debug("unexpected error", exc_info=exc)
    text = scrub(f"{type(exc).__name__}: {exc}", url_secrets(ctx.url))
    return CliError(EXIT_INTERNAL, f"internal error: {text} (please report it)", "internal")


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
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except _UsageError as exc:
        return _usage_failure(exc, argv, err, stdout or sys.stdout)
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
        if _no_such_accumulator(exc) and args.command in _ONE_ACCUMULATOR:
            error.message += _container_hint(ctx, args.name)
        return _fail(ctx, error)
    finally:
        ctx.close()
