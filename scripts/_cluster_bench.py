"""One server against a Redis Cluster (``scripts/bench.py --cluster``), same run: aggregate
applies/s of client processes spread over 64 accumulators, and the W=4 step of one
accumulator of 64 MiB gradients, on 1 primary and on 3 primaries (a ``LocalCluster`` without
replicas), and on 3 primaries with the accumulator's parts kept in its one slot
(``spread_parts=False``, what an accumulator was before parts were spread). Each
accumulator's bookkeeping lives in one slot, so many accumulators spread over the primaries;
one accumulator's parts are spread by part index.

On a machine with fewer cores than servers plus clients, the primaries share the cores:
the ratio then shows the cost of the cluster client, not the gain of more CPUs."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np

N_ACCUMULATORS = 64
GRAD_ELEMENTS = 1024  # 4 KiB of float32


def _client(spec: str) -> Any:
    return spec  # a URL: redis:// for the single server, redis+cluster:// for the cluster


def _worker(spec: str, seconds: float, seed: int, out: Any) -> None:
    import accumulator

    rng = np.random.default_rng(seed)
    accs = [accumulator.ConditionalAccumulator(np.float32, (GRAD_ELEMENTS,),
                                               shared_name=f"bench-{i}", client=_client(spec))
            for i in range(N_ACCUMULATORS)]  # fmt: skip
    grad = rng.standard_normal(GRAD_ELEMENTS).astype(np.float32)
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        acc = accs[int(rng.integers(N_ACCUMULATORS))]
        acc.apply_grad(grad, local_step=0)
        n += 1
        if n % 200 == 0:  # keep the rounds small: take what is there now and then
            pending = acc.num_accumulated()
            if pending:
                acc.take_grad(pending, timeout=5)
    out.put(n)


def applies_per_second(spec: str, processes: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(spec, seconds, i, out)) for i in range(processes)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join(30)
    return total / seconds


def step_ms(spec: str, nbytes: int, workers: int, runs: int, spread: bool | None = None) -> float:
    """Median W-worker synchronous step (every worker applies once, the chief takes W);
    ``spread``: the accumulator's ``spread_parts`` (the workers follow the chief's choice)."""
    import statistics

    from _step_bench import _worker

    import accumulator

    ctx = mp.get_context("spawn")
    name = f"cluster-step-{nbytes}-{time.monotonic_ns()}"
    chief = accumulator.ConditionalAccumulator(np.float32, (nbytes // 4,), shared_name=name,
                                               client=spec, max_pending_bytes=1 << 40,
                                               spread_parts=spread)  # fmt: skip
    pipes, procs = [], []
    for i in range(workers):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(spec, name, nbytes, i, theirs), daemon=True)
        p.start()
        pipes.append(mine)
        procs.append(p)
    for c in pipes:
        assert c.recv() == "ready"
    times = []
    for step in range(runs + 1):  # the first one warms up
        t = time.perf_counter()
        for c in pipes:
            c.send(step)
        chief.take_grad(workers, timeout=600)
        for c in pipes:
            assert c.recv() == "applied"
        if step:
            times.append(time.perf_counter() - t)
    for c in pipes:
        c.send(None)
    for p in procs:
        p.join(30)
    chief.close()
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--step-mib", type=int, default=64, help="gradient of the step rows")
    parser.add_argument("--step-runs", type=int, default=5)
    args = parser.parse_args(argv)
    from accumulator.testing import LocalCluster, RedisServer

    with RedisServer(module=False) as single, LocalCluster(3, 0) as cluster:
        specs = {"1 primary": single.url,
                 "3 primaries": cluster.cluster_url}  # fmt: skip
        rates: dict[str, list[float]] = {k: [] for k in specs}
        step_specs = {**{k: (v, None) for k, v in specs.items()},
                      "3 primaries, one slot": (cluster.cluster_url, False)}  # fmt: skip
        steps: dict[str, list[float]] = {k: [] for k in step_specs}
        for _ in range(2):  # alternate, twice: noise hits both alike
            for name, spec in specs.items():
                rates[name].append(applies_per_second(spec, args.processes, args.seconds))
            for name, (spec, spread) in step_specs.items():
                steps[name].append(step_ms(spec, args.step_mib << 20, 4, args.step_runs, spread))
    one, three = (max(rates[k]) for k in specs)
    step_one, step_three, step_slot = (min(steps[k]) for k in step_specs)
    print(f"cluster: aggregate applies/s over {N_ACCUMULATORS} accumulators, 4 KiB gradients, "
          f"{args.processes} client processes, {args.seconds:g} s (best of 2)")  # fmt: skip
    print(f"  1 primary:   {one:9.0f} applies/s")
    print(f"  3 primaries: {three:9.0f} applies/s   3 vs 1: {three / one:.2f}x (> 1: better)")
    print(f"cluster: W=4 step of one accumulator, {args.step_mib} MiB gradients, median of "
          f"{args.step_runs} (best of 2)")  # fmt: skip
    print(f"  1 primary:   {step_one:9.1f} ms")
    print(f"  3 primaries, parts in one slot (spread_parts=False): {step_slot:9.1f} ms   "
          f"3 vs 1: {step_one / step_slot:.2f}x")  # fmt: skip
    speedup = step_one / step_three
    print(f"  3 primaries, parts spread (default): {step_three:9.1f} ms   3 vs 1: {speedup:.2f}x "
          "(> 1: better)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
