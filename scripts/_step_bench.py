"""The synchronous-step benchmark behind ``scripts/bench.py --steps`` (and on its own:
``python scripts/_step_bench.py``).

One step: W worker processes each apply one float32 gradient (all released at once), the
chief's ``take_grad(W)`` returns their mean; timed from the release to the take's return.
Measured on both paths, in the same run: a plain server (the taker sums, as on managed
Redis) and a server running our accsum module (the running sum stays in Redis), for W=1 and
W=4, at 4 KiB, 1 MiB, 16 MiB and 64 MiB (``--large``: 256 MiB and 2 GiB too).

Besides the step's median it reports, per size and path: Redis ``used_memory`` once the W
applies of a round are in (over the empty server, as a multiple of one gradient), the peak
``used_memory`` sampled during the steps, and a PING probe (its own process and connection,
every 5 ms) during the steps: p99 and max, i.e. how long Redis stalls other clients.

The sync helper's step (``accumulator.sync``: every worker pushes, the chief takes, updates
and publishes, every worker pulls) is measured on both paths too, alternating with the
accumulator step of the same size on the same server (the ratio issue 9 bounds), W=4; and,
on the default path, models of many small tensors (``--tensors``).

``--tf-python PATH`` measures TensorFlow's parameter server the same way in the same run
(``scripts/_tf_step.py`` under that Python) and prints our steps as ratios to it; the
figures recorded in issue 9 on this kind of machine are printed beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import redis

import accumulator
from accumulator import _module
from accumulator.testing import RedisServer

MiB = 1 << 20
SIZES = {"4 KiB": 4 << 10, "1 MiB": MiB, "16 MiB": 16 * MiB, "64 MiB": 64 * MiB}
LARGE = {"256 MiB": 256 * MiB, "2 GiB": 2048 * MiB}
#: TF 2.21 ConditionalAccumulator on a parameter-server task, W=4 step medians (ms), same kind
#: of machine (issue 9's table).
TF_W4_MS = {"4 KiB": 4.25, "1 MiB": 6.78, "16 MiB": 44.6, "64 MiB": 152.0}


def _worker(url: str, name: str, nbytes: int, index: int, conn: Any) -> None:
    acc = accumulator.ConditionalAccumulator(
        np.float32, shape=(nbytes // 4,), shared_name=name, client=url,
        max_pending_bytes=1 << 40,
    )  # fmt: skip
    grad = np.full(nbytes // 4, float(index + 1), np.float32)
    conn.send("ready")
    while True:
        step = conn.recv()
        if step is None:
            break
        acc.apply_grad(grad, local_step=step)
        conn.send("applied")
    acc.close()


def _sync_worker(url: str, job: str, nbytes: int, index: int, tensors: int, conn: Any) -> None:
    from accumulator.sync import Worker

    worker = Worker(job, client=url, worker_id=f"w{index}")
    step, _ = worker.pull(timeout=60)
    grad = {f"p{k}": np.full(nbytes // 4, float(index + 1), np.float32) for k in range(tensors)}
    conn.send("ready")
    while True:
        if conn.recv() is None:
            break
        worker.push(step, grad)
        step, _ = worker.pull(after=step, timeout=600)
        conn.send("pulled")
    worker.close()


def _start(target: Any, args: list[tuple[Any, ...]]) -> tuple[list[Any], list[Any]]:
    """One process per argument tuple, each given its end of a pipe (the last argument);
    returns our ends and the processes once every one said "ready"."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for a in args:
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*a, theirs), daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    for c in pipes:
        assert c.recv() == "ready"
    return pipes, procs


def _stop(pipes: list[Any], procs: list[Any]) -> None:
    for c in pipes:
        c.send(None)
    for proc in procs:
        proc.join(30)


#: path, size, W, sync step ms, accumulator step ms, Redis used_memory after the steps / the
#: model
SyncRow = tuple[str, str, int, float, float | None, float]


def steps_for(nbytes: int, runs: int) -> int:
    """Timed steps of one case: ``runs``, 5x that up to 1 MiB (cheap steps, and the noisiest:
    a median of 7 moved by 30% between runs), a fifth of it above 64 MiB. TF's harness
    (``_tf_step.py``) has the same rule."""
    if nbytes <= MiB:
        return 5 * runs
    return runs if nbytes <= 64 * MiB else max(2, runs // 5)


def run_sync(url: str, path: str, sizes: dict[str, int], workers: int, runs: int,
             verbose: bool, tensors: int = 1, fusion_bytes: int | None = None,
             ) -> list[SyncRow]:  # fmt: skip
    """The sync helper's step on ``path``'s server: every worker pushes, the chief steps
    (takes, updates, publishes), every worker pulls the new parameters; (path, size, W,
    median ms, the accumulator step's median ms, Redis's ``used_memory`` after the last step
    over the model's bytes: its parameter versions, two at most) per size. With one tensor, an
    accumulator step of the same size (W workers apply, the chief takes) alternates with the
    sync steps, on the same server, so that both medians see the same machine; with
    ``tensors``: a model of that many parameters of the size each (the label says so; no
    accumulator step). ``fusion_bytes``: the chief's (default: the library's; the label says
    when it is given)."""
    from accumulator.sync import ParameterServer

    out: list[SyncRow] = []
    r = redis.Redis.from_url(url)
    for label, nbytes in sizes.items():
        if tensors > 1:
            label = f"{tensors} × {label}"
        if fusion_bytes is not None:
            label += f" (fusion_bytes={fusion_bytes})"
        r.flushall()
        job = f"sync/{label}/{workers}"
        fusion = {} if fusion_bytes is None else {"fusion_bytes": fusion_bytes}
        ps = ParameterServer(job, replicas_to_aggregate=workers, client=url, **fusion)
        ps.initialize({f"p{k}": np.zeros(nbytes // 4, np.float32) for k in range(tensors)})
        pipes, procs = _start(_sync_worker,
                              [(url, job, nbytes, i, tensors) for i in range(workers)])  # fmt: skip
        chief = None
        if tensors == 1:
            name = f"syncbase/{label}/{workers}"
            chief = accumulator.ConditionalAccumulator(
                np.float32, shape=(nbytes // 4,), shared_name=name, client=url,
                max_pending_bytes=1 << 40,
            )  # fmt: skip
            acc_pipes, acc_procs = _start(_worker, [(url, name, nbytes, i) for i in range(workers)])
        times: list[float] = []
        base: list[float] = []
        n_runs = steps_for(nbytes, runs)
        for i in range(n_runs + 1):  # the first of each warms up
            if chief is not None:
                t = time.perf_counter()
                for c in acc_pipes:
                    c.send(i)
                chief.take_grad(workers, timeout=600)
                if i > 0:
                    base.append(time.perf_counter() - t)
                for c in acc_pipes:
                    assert c.recv() == "applied"
            t = time.perf_counter()
            for c in pipes:
                c.send("go")
            ps.step(0.001, timeout=600)
            for c in pipes:
                assert c.recv() == "pulled"
            if i > 0:
                times.append(time.perf_counter() - t)
        held = r.info("memory")["used_memory"] / (tensors * nbytes)
        _stop(pipes, procs)
        if chief is not None:
            _stop(acc_pipes, acc_procs)
            chief.close()
        ps.close()
        median = 1000 * statistics.median(times)
        out.append((path, label, workers, median,
                    1000 * statistics.median(base) if base else None, held))  # fmt: skip
        if verbose:
            print(f"  sync {path:6} W={workers} {label:>7}: {median:9.2f} ms  held "
                  f"{held:5.2f}x", file=sys.stderr)  # fmt: skip
    r.close()
    return out


def _probe(url: str, stop: Any, conn: Any) -> None:
    r = redis.Redis.from_url(url, socket_timeout=30)
    r.ping()
    conn.send("ready")
    pings: list[float] = []
    peak, n = 0, 0
    while not stop.wait(0.005):
        t = time.perf_counter()
        r.ping()
        pings.append(time.perf_counter() - t)
        n += 1
        if n % 4 == 0:
            peak = max(peak, int(r.info("memory")["used_memory"]))
    conn.send((pings, peak))


class _Probe:
    """PINGs Redis every 5 ms on its own connection, from its own process (a thread of the
    chief would wait for the chief's GIL: its latencies were the chief's, not Redis's), and
    samples ``used_memory``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pings: list[float] = []
        self.peak = 0
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_probe, args=(url, self._stop, theirs), daemon=True)

    def __enter__(self) -> _Probe:
        self._proc.start()
        assert self._conn.recv() == "ready"  # short steps would end before it started
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.pings, self.peak = self._conn.recv()
        self._proc.join(30)


@dataclass
class StepRow:
    path: str  # "module" | "plain"
    size: str
    nbytes: int
    workers: int
    runs: int
    step_ms: float
    step_p25_ms: float
    step_p75_ms: float
    held_x: float  # used_memory over the empty server once the round's applies are in / nbytes
    peak_x: float  # peak used_memory over the empty server during the steps / nbytes
    ping_p99_ms: float
    ping_max_ms: float


def run_path(url: str, path: str, sizes: dict[str, int], workers: int, runs: int,
             verbose: bool) -> list[StepRow]:  # fmt: skip
    rows = []
    ctx = mp.get_context("spawn")
    r = redis.Redis.from_url(url)
    for label, nbytes in sizes.items():
        r.flushall()
        base = int(r.info("memory")["used_memory"])
        name = f"step/{path}/{label}/{workers}"
        chief = accumulator.ConditionalAccumulator(
            np.float32, shape=(nbytes // 4,), shared_name=name, client=url,
            max_pending_bytes=1 << 40,
        )  # fmt: skip
        assert chief.sums_in_redis == (path == "module"), (path, chief.sums_in_redis)
        pipes, procs = [], []
        for i in range(workers):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(url, name, nbytes, i, theirs), daemon=True)
            p.start()
            pipes.append(mine)
            procs.append(p)
        for c in pipes:
            assert c.recv() == "ready"
        want = float(sum(range(1, workers + 1))) / workers
        times: list[float] = []
        held = 0
        n_runs = steps_for(nbytes, runs)
        with _Probe(url) as probe:
            for step in range(n_runs + 1):  # the first one warms up
                t = time.perf_counter()
                for c in pipes:
                    c.send(step)
                if step == 0:  # memory once every apply is in, before the take
                    for c in pipes:
                        assert c.recv() == "applied"
                    held = int(r.info("memory")["used_memory"]) - base
                total = chief.take_grad(workers, timeout=600)
                dt = time.perf_counter() - t
                if step > 0:
                    for c in pipes:
                        assert c.recv() == "applied"
                    times.append(dt)
                assert total[0] == want and total[-1] == want, (total[0], want)
                del total
        for c in pipes:
            c.send(None)
        for p in procs:
            p.join(30)
        chief.close()
        pings = sorted(probe.pings) or [0.0]
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        row = StepRow(
            path, label, nbytes, workers, len(times), 1000 * statistics.median(times),
            1000 * q[0], 1000 * q[2], held / nbytes, max(0, probe.peak - base) / nbytes,
            1000 * pings[min(len(pings) - 1, int(0.99 * len(pings)))], 1000 * pings[-1],
        )  # fmt: skip
        if verbose:
            print(f"  {path:6} W={workers} {label:>7}: {row.step_ms:9.2f} ms  held "
                  f"{row.held_x:5.2f}x  peak {row.peak_x:5.2f}x  PING p99/max "
                  f"{row.ping_p99_ms:.1f}/{row.ping_max_ms:.1f} ms", file=sys.stderr)  # fmt: skip
        rows.append(row)
    r.close()
    return rows


def render(rows: list[StepRow], tf_ms: dict[str, float] | None = None) -> str:
    """The table; ``tf_ms``: TF's W=4 step measured in this run (else the recorded one)."""
    tf_w4 = tf_ms or TF_W4_MS
    by = {(r.path, r.size, r.workers): r for r in rows}
    lines = [
        "synchronous step (W workers apply float32 gradients, the chief takes the mean), medians",
        "",
        "| gradient | W | module path | plain path | module / TF | plain / TF | "
        "Redis held after applies (module, plain) | PING p99 / max during steps (module) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    sizes = list(dict.fromkeys(r.size for r in rows))
    for size in sizes:
        for w in sorted({r.workers for r in rows}):
            m, p = by.get(("module", size, w)), by.get(("plain", size, w))
            tf = tf_w4.get(size) if w == 4 else None

            def ms(row: StepRow | None) -> str:
                return f"{row.step_ms:.2f} ms" if row else "—"

            def ratio(row: StepRow | None, tf: float | None = tf) -> str:
                return f"{row.step_ms / tf:.2f}" if row and tf else "—"

            held = " / ".join(f"{r.held_x:.2f}×" if r else "—" for r in (m, p))
            ping = f"{m.ping_p99_ms:.1f} / {m.ping_max_ms:.1f} ms" if m else "—"
            lines.append(f"| {size} | {w} | {ms(m)} | {ms(p)} | {ratio(m)} | {ratio(p)} | "
                         f"{held} | {ping} |")  # fmt: skip
    lines.append("")
    if tf_ms:
        measured = ", ".join(f"{k} {v:.2f} ms" for k, v in tf_ms.items())
        lines.append(f"TF: TensorFlow's parameter server measured in this run (W=4): {measured}.")
    else:
        lines.append("TF: TensorFlow's parameter server, W=4 medians recorded on this kind of "
                     "machine (issue 9; --tf-python measures it in the same run).")  # fmt: skip
    lines.append("held: Redis used_memory over one gradient once the applies are in.")
    return "\n".join(lines)


def measure_tf(python: str, sizes: dict[str, int], runs: int,
               verbose: bool) -> dict[str, float]:  # fmt: skip
    """TF's W=4 step per size, run by ``python`` (which has tensorflow)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).with_name("_tf_step.py")
    if verbose:
        print(f"  measuring TF's parameter server with {python} ...", file=sys.stderr)
    proc = subprocess.run(
        [python, str(script), "--workers", "4", "--runs", str(runs),
         "--sizes", *(str(n) for n in sizes.values())],
        capture_output=True, text=True, check=True, timeout=3600,
    )  # fmt: skip
    by_bytes = json.loads(proc.stdout.strip().splitlines()[-1])
    return {label: float(by_bytes[str(n)]) for label, n in sizes.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7,
                        help="timed steps per case (default 7; x5 up to 1 MiB, /5 above 64 MiB)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--large", action="store_true", help="also 256 MiB and 2 GiB")
    parser.add_argument("--sizes", nargs="+", help="only these sizes (e.g. '16 MiB')")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--tf-python", metavar="PATH",
                        help="a Python with tensorflow: measure TF's parameter server (W=4) in "
                        "the same run (scripts/_tf_step.py)")  # fmt: skip
    parser.add_argument("--tensors", type=int, nargs="+", default=[16],
                        help="also the sync helper's step with models of this many tensors, "
                        "each of the sizes up to 1 MiB (default 16; 1 for none)")  # fmt: skip
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    sizes = dict(SIZES, **(LARGE if args.large else {}))
    if args.sizes:
        sizes = {k: v for k, v in sizes.items() if k in args.sizes}
    paths = [("plain", False)]
    if _module.find_compiler() is not None:
        paths.insert(0, ("module", True))
    else:
        print("no C compiler: the module path is not measured", file=sys.stderr)
    rows: list[StepRow] = []
    sync: list[SyncRow] = []
    for path, module in paths:
        with RedisServer(module=module, args=["--maxmemory", "0"]) as server:
            for w in args.workers:
                rows += run_path(server.url, path, sizes, w, args.runs, not args.quiet)
            sync += run_sync(server.url, path, sizes, max(args.workers), args.runs,
                             not args.quiet)  # fmt: skip
            if path == paths[0][0]:  # models of many tensors: on the default server
                small = {k: v for k, v in sizes.items() if v <= MiB}
                for n in (t for t in args.tensors if t > 1):
                    # fused (the default) and, for comparison, one accumulator per tensor
                    for fusion in (None, 0):
                        sync += run_sync(server.url, path, small, max(args.workers),
                                         args.runs, not args.quiet, tensors=n,
                                         fusion_bytes=fusion)  # fmt: skip
    tf_ms = measure_tf(args.tf_python, sizes, args.runs, not args.quiet) if args.tf_python else None
    print(render(rows, tf_ms))
    if sync:
        print()
        print("sync helper step (push, chief step, pull), medians; the accumulator step of the "
              "same size and path alternates with it:")  # fmt: skip
        print()
        print("| gradient | W | path | sync step | accumulator step | ratio | Redis held after |")
        print("|---|---:|---|---:|---:|---:|---:|")
        for path, label, w, ms, base_ms, held in sync:
            ratio = f"{ms / base_ms:.2f}" if base_ms else "—"
            shown = f"{base_ms:.2f} ms" if base_ms else "—"
            print(f"| {label} | {w} | {path} | {ms:.2f} ms | {shown} | {ratio} | {held:.2f}× |")
        print()
        print("Redis held after: used_memory after the last step over the model's bytes (the "
              "current and the previous parameter version).")  # fmt: skip
    if args.json:
        with contextlib.suppress(OSError), open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
