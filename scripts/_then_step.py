"""How fast this machine runs issue 9's starting code today: the recorded figures, rescaled.

Issue 9's targets compare our W=4 step with TensorFlow's parameter server. Its table was
measured on another day: our code of then took 0.91 / 4.98 / 130 / 538 ms at 4 KiB / 1 MiB
/ 16 MiB / 64 MiB, TF 4.25 / 6.78 / 44.6 / 152 ms. This machine's speed varies by day (and
within minutes), so those figures cannot be set beside today's. This script measures the
code of then (``git archive`` of the commit the issue was filed against, ``--rev``) and
today's, alternately, on one server, in the same W=4 step as ``scripts/_step_bench.py``
(W worker processes apply one float32 gradient each, the chief's ``take_grad(W)``, medians),
and prints

* the speed factor: today's step of the code of then over its recorded step;
* TF's recorded step times that factor: what TF would have taken today, if it slowed down
  as our code of then did;
* today's code (module path and plain path) over that rescaled TF.

    python scripts/_then_step.py                      # starts (and stops) its own servers
    python scripts/_then_step.py --sizes "16 MiB" "64 MiB" --rounds 3

It needs the git history (a clone, not an archive) and a C compiler for the module path
(without one, only the plain path is measured). Nothing of it is timed by a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SIZES = {"4 KiB": 4 << 10, "1 MiB": MiB, "16 MiB": 16 * MiB, "64 MiB": 64 * MiB}
#: The commit issue 9 was filed against (the last before its chunked path, 2b51c86).
REV = "9ef0407"
#: Issue 9's table: W=4 step medians (ms) of our code of then, and of TF's parameter server.
OURS_THEN_MS = {"4 KiB": 0.91, "1 MiB": 4.98, "16 MiB": 130.0, "64 MiB": 538.0}
TF_THEN_MS = {"4 KiB": 4.25, "1 MiB": 6.78, "16 MiB": 44.6, "64 MiB": 152.0}


# -- child: one W=4 step series of whatever `accumulator` PYTHONPATH gives ---------------------


def _open(url: str, name: str, nbytes: int, plain: bool) -> Any:
    import accumulator  # the one PYTHONPATH names: then or now

    extra: dict[str, Any] = {"sum_in_redis": False} if plain else {}
    return accumulator.ConditionalAccumulator(
        np.float32, shape=(nbytes // 4,), shared_name=name, client=url,
        max_pending_bytes=1 << 40, **extra,
    )  # fmt: skip


def _worker(url: str, name: str, nbytes: int, plain: bool, index: int, conn: Any) -> None:
    acc = _open(url, name, nbytes, plain)
    grad = np.full(nbytes // 4, float(index + 1), np.float32)
    conn.send("ready")
    while (step := conn.recv()) is not None:
        acc.apply_grad(grad, local_step=step)
        conn.send("applied")


def _child(url: str, tag: str, nbytes: int, workers: int, runs: int, plain: bool) -> float:
    name = f"then/{tag}/{nbytes}/{time.time_ns()}"
    chief = _open(url, name, nbytes, plain)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for i in range(workers):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(url, name, nbytes, plain, i, theirs),
                           daemon=True)  # fmt: skip
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    for c in pipes:
        assert c.recv() == "ready"
    times = []
    for step in range(runs + 1):  # the first warms up
        t = time.perf_counter()
        for c in pipes:
            c.send(step)
        for c in pipes:
            assert c.recv() == "applied"
        chief.take_grad(workers)
        if step:
            times.append(time.perf_counter() - t)
    for c in pipes:
        c.send(None)
    for proc in procs:
        proc.join(30)
    return 1000 * statistics.median(times)


# -- parent ------------------------------------------------------------------------------------


def _run(pythonpath: Path, url: str, tag: str, nbytes: int, runs: int, plain: bool) -> float:
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    cmd = [sys.executable, __file__, "--child", url, tag, str(nbytes), str(runs)]
    proc = subprocess.run(cmd + (["--plain"] if plain else []), env=env, check=True,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def _then_tree(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "accumulator", "lua"],
                             check=True, capture_output=True)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=REV, help=f"the code of then (default {REV})")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternations of then/now per size (default 2)")  # fmt: skip
    parser.add_argument("--child", nargs=4, metavar=("URL", "TAG", "NBYTES", "RUNS"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        url, tag, nbytes, runs = args.child
        print(json.dumps(_child(url, tag, int(nbytes), 4, int(runs), args.plain)))
        return 0

    sys.path.insert(0, str(ROOT))
    from accumulator import _module
    from accumulator.testing import RedisServer

    module = _module.find_compiler() is not None
    series: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(module=module, args=["--maxmemory", "0"]) as server:  # fmt: skip
        then = _then_tree(args.rev, Path(tmp))
        kinds = [("then", then, False), ("now, plain", ROOT, True)]
        if module:
            kinds.append(("now, module", ROOT, False))
        for label in args.sizes:
            nbytes = SIZES[label]
            runs = 9 if nbytes <= MiB else 5
            got = series.setdefault(label, {k: [] for k, _, _ in kinds})
            for r in range(args.rounds):
                for kind, path, plain in kinds:
                    ms = _run(path, server.url, f"{kind}{r}", nbytes, runs, plain)
                    got[kind].append(ms)
                    print(f"  {label} {kind}: {ms:.2f} ms", file=sys.stderr, flush=True)
                server.client().flushall()

    print(f"W=4 step medians (ms), code of {args.rev} and of today alternately, one server; "
          "the median over rounds:")  # fmt: skip
    print()
    print("| gradient | then, recorded | then, today | factor | TF recorded | TF × factor | "
          "now, module | now, plain | module / TF × factor | plain / TF × factor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, got in series.items():
        then_ms = statistics.median(got["then"])
        factor = then_ms / OURS_THEN_MS[label]
        tf = TF_THEN_MS[label] * factor
        mod = statistics.median(got["now, module"]) if got.get("now, module") else None
        plain_ms = statistics.median(got["now, plain"])
        mod_s = f"{mod:.2f}" if mod else "—"
        mod_r = f"{mod / tf:.2f}" if mod else "—"
        print(f"| {label} | {OURS_THEN_MS[label]:.2f} | {then_ms:.2f} | {factor:.2f} | "
              f"{TF_THEN_MS[label]:.2f} | {tf:.2f} | {mod_s} | {plain_ms:.2f} | {mod_r} | "
              f"{plain_ms / tf:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
