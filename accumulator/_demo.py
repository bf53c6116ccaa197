"""The demo: synchronous data-parallel training of a digit classifier through Redis.

``python -m accumulator._demo`` (or ``bash scripts/demo.sh``) starts one chief and
``--workers`` worker processes (spawned, sharing nothing but Redis, as if on separate hosts).
The model is a softmax classifier on scikit-learn's bundled 8x8 digits (no download):

    logits = x @ W + b + sum over the 64 pixels of emb[pixel * 17 + intensity]

``W`` and ``b`` go through dense accumulators; ``emb`` is a table of 64 x 17 (pixel,
intensity) feature rows, and a batch's gradient touches only the rows its images use, so it
goes through a sparse accumulator. The chief aggregates ``--replicas-to-aggregate``
gradients per step (default: workers - 1); the last worker is deliberately slow, so its
gradients usually arrive after the chief's take and are dropped as stale.

Roles: ``--role all`` (default) runs the chief and spawns the workers here; ``--role chief``
and ``--role worker --worker-index I`` run one of them, for separate hosts or containers
(give every process the same ``--url``, ``--job``, ``--workers`` and ``--seed``).

Exit code: 0 when the held-out accuracy reaches ``--min-accuracy``, 1 when it does not,
2 on errors (no local server, workers gone, timeouts, refused by Redis), 3 when Redis cannot
be reached (as the CLI's), 130 on Ctrl-C.

The URL's password is never printed (``accumulator._redact``): the header and the JSON
summary show the URL masked, and the printed ``watch`` command leaves the password out of
``--url`` and takes it from ``$REDISCLI_AUTH`` instead (``REDISCLI_AUTH=... python -m
accumulator watch ...``: put the password there, not on a command line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from ._demo_model import (
    DemoError,
    Split,
    digits_loader,
    evaluate,
    init_params,
    load_data,
    loss_and_grads,
)
from ._redact import redact_url, scrub, url_secrets

logger = logging.getLogger("accumulator.demo")

DEFAULT_JOB = "digits"


# -- worker -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    url: str = field(repr=False)  # may hold a password
    job: str
    container: str
    index: int
    workers: int
    seed: int
    batch_size: int
    delay: float  # seconds of extra "compute" per step (the slow worker)
    timeout: float


def run_worker(cfg: WorkerConfig) -> int:
    """One replica: pull, compute a batch gradient on its shard, push, until finished."""
    from . import DeadlineExceededError
    from .sync import TrainingFinished, Worker

    train, _ = load_data(cfg.seed)
    shard = train.take(np.arange(cfg.index, len(train), cfg.workers))
    rng = np.random.default_rng([cfg.seed, cfg.index])
    batch_size = min(cfg.batch_size, len(shard))
    with Worker(cfg.job, client=cfg.url, container=cfg.container,
                worker_id=f"worker-{cfg.index}") as worker:  # fmt: skip
        try:
            step, params = worker.pull(timeout=cfg.timeout)
            deadline = time.monotonic() + cfg.timeout
            while worker.finished:  # a finished earlier run: wait for the chief's new one
                if time.monotonic() > deadline:
                    raise DeadlineExceededError(f"job {cfg.job!r} is finished; no new run")
                time.sleep(0.2)
                step, params = worker.pull(timeout=cfg.timeout)
            while True:
                batch = shard.take(rng.choice(len(shard), batch_size, replace=False))
                _, grads = loss_and_grads(params, batch)
                if cfg.delay:
                    time.sleep(cfg.delay)
                worker.push(step, grads)
                try:
                    step, params = worker.pull(after=step, timeout=cfg.timeout)
                except TrainingFinished:
                    break
        except DeadlineExceededError as exc:
            logger.error("worker %d: %s", cfg.index, exc)
            return 2
        logger.info("worker %d: %d pushes, %d tensors accepted, %d dropped as stale",
                    cfg.index, worker.pushes, worker.accepted, worker.dropped)  # fmt: skip
    return 0


def _worker_process(cfg: WorkerConfig, log_level: int) -> None:
    """Entry point of a spawned worker process."""
    logging.basicConfig(level=log_level, format="%(name)s: %(message)s")
    try:
        code = run_worker(cfg)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: leave quietly
        code = 130
    sys.exit(code)


# -- output -------------------------------------------------------------------------------------


class Progress:
    """A plain-text progress bar: redrawn in place on a terminal, a line per ``every`` steps
    otherwise (logs and CI keep a readable history)."""

    def __init__(self, total: int, out: TextIO, *, enabled: bool = True) -> None:
        self.total = total
        self.out = out
        self.enabled = enabled
        self.tty = out.isatty()
        self.every = max(1, total // 10)
        self._last_draw = 0.0
        self._last_step = -1
        self._width = 0

    def due(self, step: int) -> bool:
        if not self.enabled or step == self._last_step:
            return False
        if step >= self.total:
            return True
        if self.tty:
            return time.monotonic() - self._last_draw >= 0.1
        return step % self.every == 0

    def draw(self, step: int, loss: float, acc: float, stale: int, rate: float) -> None:
        self._last_draw, self._last_step = time.monotonic(), step
        width = 24
        filled = int(width * min(step, self.total) / max(self.total, 1))
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}"
            f"{'.' * (width - filled)}] loss {loss:.3f} acc {acc:.3f} "
            f"stale {stale} {rate:5.1f} steps/s"
        )
        if self.tty:
            end = "\n" if step >= self.total else ""
            # pad: a shorter line must cover the previous one completely
            self.out.write("\r" + line.ljust(self._width) + end)
            self._width = len(line)
        else:
            self.out.write(line + "\n")
        self.out.flush()


def _say(out: TextIO, text: str = "") -> None:
    out.write(text + "\n")
    out.flush()


def python_command() -> str:
    """``python`` when that is this interpreter (an activated venv, say), else this
    interpreter's path: another terminal's ``python`` may not have the package."""
    found = shutil.which("python")
    if found and os.path.abspath(found) == os.path.abspath(sys.executable):
        return "python"
    return sys.executable or "python"


def watch_hint(name: str, url: str, container: str = "") -> str:
    """The command that watches accumulator ``name`` from another terminal. The password
    is left out of ``--url`` (never printed); the command then gets it from
    ``$REDISCLI_AUTH``, shown as ``REDISCLI_AUTH=...`` for the user to fill in."""
    command = [python_command(), "-m", "accumulator", "watch", name, "--url",
               redact_url(url, drop=True)]  # fmt: skip
    if container:
        command += ["--container", container]
    text = " ".join(shlex.quote(part) for part in command)
    return f"REDISCLI_AUTH=... {text}" if url_secrets(url) else text


# -- chief --------------------------------------------------------------------------------------


def run_chief(args: argparse.Namespace, url: str, out: TextIO) -> int:
    from . import DeadlineExceededError
    from ._codec import format_shape
    from .sync import ParameterServer

    quiet = args.quiet
    train, test = load_data(args.seed)
    replicas = args.replicas_to_aggregate
    if not quiet:
        model = "softmax over pixels (dense W, b) + a (pixel, intensity) table (sparse emb)"
        _say(out, f"digits: {len(train)} training images, {len(test)} held out; model: {model}")
    ps = ParameterServer(args.job, replicas_to_aggregate=replicas, sparse={"emb"}, client=url,
                         container=args.container)  # fmt: skip
    procs: list[Any] = []
    try:
        ps.initialize(init_params(), resume=False)
        if not quiet:
            _say(out, f"job {args.job!r} on {redact_url(url)}: {args.workers} workers, chief "
                      f"takes {replicas} gradients per step; accumulators:")  # fmt: skip
            width = max(len(n) for n in ps.accumulator_names.values())
            for spec in ps.specs:
                shape = format_shape(spec.shape)
                _say(out, f"  {ps.accumulator_names[spec.name]:<{width}} {spec.name:<4} "
                          f"{spec.kind:<6} {spec.dtype.name} {shape}")  # fmt: skip
            watch = watch_hint(ps.accumulator_names["emb"], url, args.container)
            _say(out, f"watch one live from another terminal:  {watch}")
        slow = args.workers - 1 if args.slow_worker_delay > 0 and args.workers > 1 else None
        if args.role == "all":
            procs = _spawn_workers(args, url, slow)
            if not quiet:
                note = (f"; worker-{slow} is slow (+{args.slow_worker_delay:g}s per step)"
                        if slow is not None else "")  # fmt: skip
                _say(out, f"started {len(procs)} worker processes{note}")
        t0 = time.monotonic()
        progress = Progress(args.steps, out, enabled=not quiet)
        t_first: float | None = None
        last_progress = time.monotonic()
        step = ps.global_step
        while step < args.steps:
            try:
                final = step + 1 >= args.steps
                step = ps.step(args.learning_rate, timeout=0.5, final=final)
            except DeadlineExceededError:
                _check_alive(procs, replicas, args, last_progress)
                continue
            last_progress = time.monotonic()
            if t_first is None:
                t_first = last_progress
            if progress.due(step):
                loss, _ = evaluate(ps.params, train)
                _, acc = evaluate(ps.params, test)
                elapsed = last_progress - t_first
                rate = (step - 1) / elapsed if elapsed > 0 else 0.0
                progress.draw(step, loss, acc, ps.stats().stale, rate)
        t_end = time.monotonic()
        if not ps.stats().done:  # resumed at/after --steps: nothing was published as final
            ps.finish()
        _join_workers(procs, timeout=10.0)
        return _summary(args, ps, train, test, t0, t_first or t_end, t_end, slow, url, out)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
        ps.close()


def _spawn_workers(args: argparse.Namespace, url: str, slow: int | None) -> list[Any]:
    # spawn, not fork: each worker starts from nothing, as a process on another host would
    ctx = mp.get_context("spawn")
    level = logging.getLogger().getEffectiveLevel()
    procs = []
    for index in range(args.workers):
        cfg = WorkerConfig(url, args.job, args.container, index, args.workers, args.seed,
                           args.batch_size, args.slow_worker_delay if index == slow else 0.0,
                           args.timeout)  # fmt: skip
        proc = ctx.Process(target=_worker_process, args=(cfg, level), name=f"worker-{index}",
                           daemon=True)  # fmt: skip
        proc.start()
        procs.append(proc)
    return procs


def _check_alive(procs: list[Any], replicas: int, args: argparse.Namespace,
                 last_progress: float) -> None:  # fmt: skip
    if procs:
        alive = sum(p.is_alive() for p in procs)
        if alive < replicas:
            codes = {p.name: p.exitcode for p in procs if not p.is_alive()}
            raise DemoError(
                f"only {alive} of {len(procs)} worker processes are alive (exit codes {codes}); "
                f"replicas_to_aggregate={replicas} cannot be reached"
            )
    if time.monotonic() - last_progress > args.timeout:
        raise DemoError(
            f"no step completed in {args.timeout:g}s: fewer than {replicas} workers push "
            f"gradients (are the workers of job {args.job!r} running against this server?)"
        )


def _join_workers(procs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("%s did not stop after the job finished; terminating it", proc.name)
            proc.terminate()


def _summary(args: argparse.Namespace, ps: Any, train: Split, test: Split, t0: float,
             t_first: float, t_end: float, slow: int | None, url: str,
             out: TextIO) -> int:  # fmt: skip
    params = ps.params
    train_loss, train_acc = evaluate(params, train)
    test_loss, test_acc = evaluate(params, test)
    stats = ps.stats()
    steps = ps.global_step
    train_time = t_end - t_first
    rate = (steps - 1) / train_time if train_time > 0 and steps > 1 else 0.0
    ok = test_acc >= args.min_accuracy
    lines = [
        f"trained {steps} steps in {t_end - t0:.1f}s ({t_first - t0:.1f}s until the first "
        f"step: workers starting), {rate:.1f} steps/s after that",
        f"gradients: {stats.pushes} pushed, {stats.accepted} accepted, {stats.stale} dropped "
        f"as stale, {stats.partial} partly stale (replicas_to_aggregate={ps.replicas_to_aggregate},"
        f" {args.workers} workers)",
    ]
    for wid, w in stats.workers.items():
        mark = " (slow)" if slow is not None and wid == f"worker-{slow}" else ""
        lines.append(f"  {wid}{mark}: {w.pushes} pushed, {w.accepted} accepted, "
                     f"{w.stale} stale, {w.partial} partly stale")  # fmt: skip
    held: dict[str, list[str]] = {}  # accumulator -> its parameters (fused: several)
    for name, p in stats.params.items():
        held.setdefault(p.shared_name, []).append(name)
    for shared, names in held.items():
        p = stats.params[names[0]]
        what = f"{p.kind}, fused: {', '.join(names)}" if len(names) > 1 else p.kind
        lines.append(f"  {shared} ({what}): {p.applied} applied, {p.stale} stale "
                     f"(at most {p.max_stale} steps behind), {p.taken} takes")  # fmt: skip
    lines += [
        f"train: loss={train_loss:.4f} accuracy={train_acc:.4f}",
        f"held-out: loss={test_loss:.4f} accuracy={test_acc:.4f} ({len(test)} digits)",
        f"accuracy={test_acc:.4f} {'>=' if ok else '<'} {args.min_accuracy:g}: "
        f"{'ok' if ok else 'FAILED'}",
    ]
    for line in lines:
        _say(out, line)
    if args.json_summary:
        summary = {
            "ok": ok, "accuracy": test_acc, "loss": test_loss, "train_accuracy": train_acc,
            "train_loss": train_loss, "min_accuracy": args.min_accuracy, "steps": steps,
            "seconds": t_end - t0, "startup_seconds": t_first - t0, "steps_per_second": rate,
            "workers": args.workers, "replicas_to_aggregate": ps.replicas_to_aggregate,
            "slow_worker": None if slow is None else f"worker-{slow}",
            "pushes": stats.pushes, "accepted": stats.accepted, "stale": stats.stale,
            "partial": stats.partial, "url": redact_url(url), "job": args.job,
            "per_worker": {w: {"pushes": s.pushes, "accepted": s.accepted, "stale": s.stale,
                               "partial": s.partial} for w, s in stats.workers.items()},
            "accumulators": {p.shared_name: {"kind": p.kind, "applied": p.applied,
                                             "stale": p.stale, "taken": p.taken}
                             for p in stats.params.values()},
        }  # fmt: skip
        text = json.dumps(summary, indent=2, sort_keys=True)
        if args.json_summary == "-":
            _say(out, text)
        else:
            with open(args.json_summary, "w") as fh:
                fh.write(text + "\n")
    return 0 if ok else 1


# -- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accumulator demo",
        description="Synchronous data-parallel training of a digits classifier through Redis: "
        "one chief, several worker processes, one of them slow (its stale gradients are "
        "dropped), dense and sparse accumulators.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # "%(default).0s" prints nothing; it stops the formatter from adding "(default: None)"
    parser.add_argument("--url", default=None,
                        help="Redis URL (default: $ACCUMULATOR_REDIS_URL, then $REDIS_URL; if "
                             "neither is set, a local redis-server is started for the run and "
                             "stopped afterwards)%(default).0s")  # fmt: skip
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--steps", type=int, default=200, help="training steps (chief updates)")
    parser.add_argument("--replicas-to-aggregate", type=int, default=None,
                        help="gradients the chief takes per step "
                             "(default: workers-1)%(default).0s")  # fmt: skip
    parser.add_argument("--slow-worker-delay", type=float, default=0.1,
                        help="extra seconds per step of the last worker (0: none)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    parser.add_argument("--learning-rate", type=float, default=0.5, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="data split and batch sampling")
    parser.add_argument("--min-accuracy", type=float, default=0.9,
                        help="exit 1 when the held-out accuracy ends below this")  # fmt: skip
    parser.add_argument("--job", default=DEFAULT_JOB,
                        help="the sync job (its accumulators' names start with JOB/)")
    parser.add_argument("--container", default="", help="accumulator container (namespace)")
    parser.add_argument("--role", choices=("all", "chief", "worker"), default="all",
                        help="all: chief + spawned workers here; chief or worker: one process "
                             "of a job spread over hosts")  # fmt: skip
    parser.add_argument("--worker-index", type=int, default=0,
                        help="with --role worker: this worker's shard, 0..workers-1 (the last "
                             "one is the slow one)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="give up after this many seconds without progress")  # fmt: skip
    parser.add_argument("--json-summary", metavar="PATH", default=None,
                        help="also write the summary as JSON to PATH ('-': stdout)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true",
                        help="no header and no progress bar: only the summary")  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.replicas_to_aggregate is None:
        args.replicas_to_aggregate = max(1, args.workers - 1)
    if args.replicas_to_aggregate < 1:
        parser.error("--replicas-to-aggregate must be >= 1")
    if args.role == "all" and args.replicas_to_aggregate > args.workers:
        parser.error(f"--replicas-to-aggregate {args.replicas_to_aggregate} > --workers "
                     f"{args.workers}: the chief would wait forever")  # fmt: skip
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if args.slow_worker_delay < 0:
        parser.error("--slow-worker-delay must be >= 0")
    if not 0 <= args.worker_index < args.workers:
        parser.error("--worker-index must be in 0..workers-1")
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    if args.json_summary not in (None, "-"):
        folder = os.path.dirname(os.path.abspath(args.json_summary))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"--json-summary: cannot write into {folder!r}")
    url = args.url
    if url is not None:
        from urllib.parse import urlsplit

        from ._urls import scheme_problem

        problem = scheme_problem(url)
        # (one host: sentinel and cluster URLs may list several, "h1:p1,h2:p2")
        if problem is None and url.startswith(("redis://", "rediss://")):
            try:
                urlsplit(url).port  # noqa: B018 - a port that is no number raises here
            except ValueError as exc:
                problem = str(exc)
        if problem:
            parser.error(f"--url {redact_url(url)}: {problem}")


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, a CI runner, ``docker stop``): handled as Ctrl-C is, the workers
    and the server stopped, exit 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    out = out or sys.stdout
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(name)s: %(message)s")
    url = args.url or os.environ.get("ACCUMULATOR_REDIS_URL") or os.environ.get("REDIS_URL")
    try:
        digits_loader()  # before a server is started for it (review)
        with contextlib.ExitStack() as stack:
            if threading.current_thread() is threading.main_thread():
                previous = signal.signal(signal.SIGTERM, _on_sigterm)
                stack.callback(signal.signal, signal.SIGTERM, previous)
            if args.role == "worker":
                from ._urls import default_url

                slow = args.worker_index == args.workers - 1 and args.workers > 1
                delay = args.slow_worker_delay if slow else 0.0
                cfg = WorkerConfig(url or default_url(), args.job, args.container,
                                   args.worker_index, args.workers, args.seed, args.batch_size,
                                   delay, args.timeout)  # fmt: skip
                return run_worker(cfg)
            if not url:
                url = _start_server(stack, out, quiet=args.quiet)
            return run_chief(args, url, out)
    except DemoError as exc:
        _say(out, "")
        logger.error("%s", exc)
        return 2
    except Terminated:
        _say(out, "\nterminated")
        return 143
    except KeyboardInterrupt:
        _say(out, "\ninterrupted")
        return 130
    except Exception as exc:
        import redis

        from ._errors import AccumulatorError

        # (UnavailableError, Redis unreachable past the retry window, is a ConnectionError
        # of Python's, not redis-py's: it ended in tracebacks and the exit code of a low
        # accuracy; new-user review)
        reach = isinstance(exc, (redis.ConnectionError, ConnectionError))
        if reach or isinstance(exc, AccumulatorError):
            what = "cannot reach Redis at" if reach else "Redis at"
            logger.error("%s %s: %s", what, redact_url(url or "?"),
                         scrub(str(exc), url_secrets(url)))  # fmt: skip
            return 3 if reach else 2  # (the CLI's codes: EXIT_CONNECT, EXIT_USAGE)
        raise


def _start_server(stack: contextlib.ExitStack, out: TextIO, *, quiet: bool) -> str:
    from .testing import RedisServer

    try:
        server = stack.enter_context(RedisServer())
    except RuntimeError as exc:
        raise DemoError(f"no --url given and no local server could be started: {exc}") from exc
    if not quiet:
        _say(out, f"no --url/REDIS_URL: started {os.path.basename(server.binary)} on "
                  f"{server.url} (pid {server.pid}); it stops when the demo ends")  # fmt: skip
    return server.url


if __name__ == "__main__":
    sys.exit(main())
