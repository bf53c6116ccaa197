"""The ``accumulator`` commands, one decorated function each (registered in
:data:`~accumulator._cli_context.COMMANDS` on import, in ``--help`` order): ``ls``, ``show``,
``watch``, ``set-step``, ``reset``, ``delete``, ``reset-container``, ``job`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from . import _admin, _admin_job, _admin_ops
from ._admin_read import list_found
from ._admin_scan import StateScan
from ._cli_context import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    UNREACHABLE,
    CliError,
    Context,
    arg,
    command,
    esc,
)
from ._cli_render import (
    _unreadable,
    _where,
    fmt_bytes,
    fmt_ms,
    plural,
    render_job,
    render_ls,
    render_show,
)
from ._cli_watch import Rates, render_overview
from ._errors import InvalidArgumentError, NotFoundError
from ._redact import redact_url, scrub, url_secrets


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
        ctx.write("\n".join(render_ls(infos, server, _with_container(ctx, infos))))
    return EXIT_OK


def _with_container(ctx: Context, infos: list[_admin.Info]) -> bool:
    """Whether a listing needs a CONTAINER column: all containers listed, and some other
    than the default."""
    return ctx.container is None and any(i.container for i in infos)


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
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
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
    "live view of one accumulator, or without NAME of all, with applies/s, takes/s and a "
    "sparkline of recent applies (Ctrl-C to quit)",
    arg("name", nargs="?", default=None, help="its shared_name (none: every accumulator)"),
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
    ctx.json_lines = True  # (its error too: one JSON document per line)
    r = ctx.connect()
    tty = ctx.out.isatty() and not ctx.json
    prev: _admin.Info | None = None
    rates = Rates()
    scan = StateScan(r, ctx.container)
    shown = 0
    lost: str | None = None  # when the server stopped answering (watch goes on)
    try:
        if tty:
            ctx.out.write("\x1b[2J")
        while True:
            header = (
                f"every {args.interval:g}s · {ctx.shown_url} · "
                f"{time.strftime('%H:%M:%S')}" + ("  (Ctrl-C to quit)" if tty else "")
            )
            try:
                if args.name is None:
                    # a tenth of each interval scans on (a whole SCAN a frame would keep a
                    # server of many keys busy): see _admin_scan
                    found = scan.keys(max(0.02, args.interval / 10))
                    infos = list_found(r, found, ctx.container)
                    rows = rates.update(infos, int(time.time() * 1000))
                    document: Any = {"accumulators": rows}
                    lines = [header, "", *render_overview(rows, _with_container(ctx, infos))]
                else:
                    # (no SCAN: one each frame would keep a server of many keys busy)
                    info = _admin.describe(r, args.name, ctx.scope, scan=False)
                    document = info.to_dict()
                    lines = [header, "", *render_show(info, prev)]
                    prev = info
                lost = None
            except UNREACHABLE as exc:
                # a restart or a failover: keep watching (the client reconnects)
                lost = lost or time.strftime("%H:%M:%S")
                reason = scrub(str(exc).strip() or type(exc).__name__, url_secrets(ctx.url))
                document = {"unreachable_since": lost, "error": reason}
                lines = [header, "", f"unreachable since {lost}: {esc(reason)}"]
            if ctx.json:  # one JSON document per line
                ctx.write(json.dumps(document))
            else:
                if tty:  # home, overwrite each line, clear what the last frame left below
                    ctx.out.write("\x1b[H" + "".join(x + "\x1b[K\n" for x in lines) + "\x1b[J")
                    ctx.out.flush()
                else:
                    ctx.write("\n".join(lines) + "\n")
            shown += 1
            if args.count is not None and shown >= args.count:
                return EXIT_OK
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_OK


def _taker_state(info: _admin.Info, taker: str) -> str:
    """'live, lease 4.2s left, waiting' / 'gone, lease ran out 3s ago, holding a claimed
    round of 2 gradients' ..., from ``describe``."""
    for t in info.takers:
        if t.taker_id == taker:
            return _lease_state(t.lease_remaining_ms) + ", waiting in the queue"
    for c in info.claims:
        if c.taker_id == taker:
            return (f"{_lease_state(c.lease_remaining_ms)}, holding a claimed round of "
                    f"{plural(c.count, 'gradient')}")  # fmt: skip
    return "gone"


def _lease_state(remaining_ms: int | None) -> str:
    if remaining_ms is None:
        return "gone, no lease"
    if remaining_ms > 0:
        return f"live, lease {fmt_ms(remaining_ms)} left"
    return f"gone, lease ran out {fmt_ms(-remaining_ms)} ago"


def _named(ctx: Context, name: str) -> dict[str, str]:
    """The accumulator a changing command's JSON is about: ``shared_name`` as ``ls`` and
    ``show`` say it (``name``, the same, as earlier versions said it)."""
    return {"container": ctx.scope, "shared_name": name, "name": name}


def _in_claims(info: _admin.Info) -> str:
    """', N gradients in M claimed rounds of takers that are gone' when there are (the next
    take takes them over, as they were)."""
    if not info.stranded_claims:
        return ""
    return (f", {plural(info.stranded_grads, 'gradient')} in "
            f"{plural(info.stranded_claims, 'claimed round')} of takers that are gone")  # fmt: skip


def _some(names: list[str]) -> str:
    """The first five names, quoted, and '...' when there are more."""
    return ", ".join(esc(n, quote=True) for n in names[:5]) + (", ..." if len(names) > 5 else "")


@command(
    "set-step",
    "set the global step (also downwards); the pending round is kept; asks first when the "
    "accumulator is live (pending gradients, waiting takers, or rounds claimed by takers that are "
    "gone)",
    arg("name", help="its shared_name"),
    arg("step", type=int, metavar="N", help="the new global step"),
    destructive=True,
)
def _set_step(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    info = _admin.describe(r, args.name, ctx.scope, memory=False, scan=False)
    if info.count or info.takers_waiting or info.stranded_claims:
        live = (
            f"{plural(info.count, 'pending gradient')} at step {info.step}, "
            f"{plural(info.takers_waiting, 'waiting taker')}{_in_claims(info)}"
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
            {**_named(ctx, args.name), "previous_step": old, "step": args.step}
        )
    else:
        ctx.write(f"global step of {_where(args.name, ctx.scope)}: "
                  f"{'?' if old is None else old} -> {args.step}")  # fmt: skip
    return EXIT_OK


@command(
    "reset",
    "drop the pending gradients and the rounds claimed by takers that are gone (the step "
    "is kept)",
    arg("name", help="its shared_name"),
    destructive=True,
)
def _reset(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    info = _admin.describe(r, args.name, ctx.scope, memory=False, scan=False)
    ctx.confirm(
        f"Drop the {plural(info.count, 'pending gradient')} "
        f"({fmt_bytes(info.bytes)}){_in_claims(info)} of {_where(args.name, ctx.scope)}?",
        args.yes,
        f"reset {esc(args.name, quote=True)}",
    )
    dropped, in_claims = _admin_ops.reset_counted(r, args.name, ctx.scope)
    if ctx.json:
        ctx.dump({**_named(ctx, args.name), "dropped": dropped,
                  "dropped_from_claims": in_claims})  # fmt: skip
    else:
        gone = f" ({in_claims} of them in claimed rounds of takers that are gone)"
        ctx.write(f"reset {_where(args.name, ctx.scope)}: dropped "
                  f"{plural(dropped, 'pending gradient')}{gone if in_claims else ''}")  # fmt: skip
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
        info = _admin.describe(r, args.name, ctx.scope, memory=False, scan=False)
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
        ctx.dump({**_named(ctx, args.name), "keys_deleted": removed})
    else:
        ctx.write(f"deleted {_where(args.name, ctx.scope)} ({plural(removed, 'key')})")
    return EXIT_OK


@command(
    "evict",
    "remove a taker that is gone (see `show`): a waiting one leaves the queue, a claimed round "
    "goes back (or, with --drop, is deleted)",
    arg("name", help="its shared_name"),
    arg("taker", help="the taker id, as `show` lists it"),
    arg("--drop", action="store_true", help="delete the taker's claimed round instead"),
    arg("--force", action="store_true",
        help="evict a taker whose lease still runs (a live one: its take raises)"),
    destructive=True,
)
def _evict(ctx: Context, args: argparse.Namespace) -> int:
    r = ctx.connect()
    what = "and delete its claimed round" if args.drop else "(its claimed round, if any, goes back)"
    # (asking about none would mislead)
    _admin.check_taker(r, args.name, args.taker, ctx.scope, drop=args.drop)
    info = _admin.describe(r, args.name, ctx.scope, memory=False, scan=False)
    state = _taker_state(info, args.taker)
    if state.startswith("live") and not args.force:
        raise CliError(
            EXIT_USAGE,
            f"taker {esc(args.taker, quote=True)} of {_where(args.name, ctx.scope)} is {state}: "
            "evicting it makes its take fail (or lose its place in the queue); pass --force "
            "to evict it anyway",
            "refused",
        )
    ctx.confirm(
        f"Evict taker {esc(args.taker, quote=True)} ({state}) of "
        f"{_where(args.name, ctx.scope)} {what}?",
        args.yes,
        f"evict {esc(args.taker, quote=True)}",
    )
    outcome = _admin.evict(r, args.name, args.taker, ctx.scope, drop=args.drop)
    if ctx.json:
        ctx.dump({**_named(ctx, args.name), "taker": args.taker,
                  "outcome": outcome})  # fmt: skip
    else:
        ctx.write(f"evicted taker {esc(args.taker, quote=True)} of "
                  f"{_where(args.name, ctx.scope)}: {outcome}")  # fmt: skip
    return EXIT_OK


@command("reset-container", "delete every accumulator and every sync job (running or not) "
         "of --container", destructive=True)
def _reset_container(ctx: Context, args: argparse.Namespace) -> int:
    if ctx.container is None:
        raise CliError(
            EXIT_USAGE,
            "reset-container needs --container (--container '' for the default container)",
            "usage",
        )
    r = ctx.connect()
    names = [i.shared_name for i in _admin.list_accumulators(r, ctx.container)]
    jobs = _admin_job.list_jobs(r, ctx.container)
    deleted, jobs_deleted = 0, 0
    if names or jobs:
        where = esc(ctx.container, quote=True)
        with_jobs = (f" and its {plural(len(jobs), 'sync job')} ({_some(jobs)}; running or not)"
                     if jobs else "")  # fmt: skip
        ctx.confirm(
            f"Delete all {plural(len(names), 'accumulator')} of container {where} ({_some(names)})"
            f"{with_jobs}?",
            args.yes,
            f"reset container {where}",
        )
        gone: list[str] = []  # the jobs deleted: their parameters' accumulators with them
        for job in jobs:
            try:
                _admin.delete_job(r, job, ctx.container, force=True)
            except NotFoundError:  # deleted meanwhile
                continue
            gone.append(f"{job}/")
            jobs_deleted += 1
        # the accumulators as listed for the question (no SCAN again): those the job deletes
        # took are found gone, and counted
        removed = _admin_ops.delete_listed(r, ctx.container, names)
        deleted = sum(1 for name, n in zip(names, removed, strict=True)
                      if n or name.startswith(tuple(gone)))  # fmt: skip
    if ctx.json:
        ctx.dump({"container": ctx.container, "deleted": deleted, "jobs_deleted": jobs_deleted})
    else:
        where = esc(ctx.container, quote=True)
        jobs_text = f" and {plural(jobs_deleted, 'sync job')}" if jobs_deleted else ""
        ctx.write(f"deleted {plural(deleted, 'accumulator')}{jobs_text} of container {where}")
    return EXIT_OK


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
    # (checked again while the delete holds the job's chief lease: a job started again
    # during the question is refused, unless --force)
    try:
        removed = _admin.delete_job(r, args.name, ctx.scope, force=args.force)
    except InvalidArgumentError as exc:  # its one refusal: the job runs again
        raise CliError(
            EXIT_USAGE,
            f"sync job {where} was started again while you were asked; nothing was deleted "
            "(pass --force to delete it anyway)",
            "refused",
        ) from exc
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


@command(
    "module",
    "build the accsum Redis module (cached) and print its path: redis-server --loadmodule PATH",
    arg("action", choices=["build", "path"],
        help="build: build it if this source has no build yet, print its path; path: the "
             "same (a synonym)"),  # fmt: skip
    offline=True,
)
def _module_build(ctx: Context, args: argparse.Namespace) -> int:
    from . import _module

    built = _module.build()
    if built is None:
        why = _module.why_not_built() or "unknown reason"
        raise CliError(EXIT_ERROR, f"the module could not be built: {why}")
    if ctx.json:
        ctx.dump({"module": str(built), "name": _module.MODULE_NAME})
    else:
        ctx.write(str(built))
    return EXIT_OK
