"""The parts of one sync-helper step in one process (a worker's push, the chief's step, the
worker's pull), for models of 1 and of 16 tensors: median milliseconds and round trips of
each (sends counted on redis-py's connections). Run it on two trees to compare them, e.g.
``PYTHONPATH=/path/to/other/tree python scripts/_sync_parts.py`` from outside the checkout.

Usage: ``python scripts/_sync_parts.py [--tensors 1 16] [--elements 1024] [--steps 100]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import redis

from accumulator.sync import ParameterServer, Worker
from accumulator.testing import RedisServer

_SENDS = [0]


def _count_sends() -> None:
    original = redis.connection.AbstractConnection.send_packed_command

    def send(self: Any, *args: Any, **kwargs: Any) -> Any:
        _SENDS[0] += 1
        return original(self, *args, **kwargs)

    redis.connection.AbstractConnection.send_packed_command = send  # type: ignore[method-assign]


def measure(url: str, tensors: int, elements: int, steps: int) -> dict[str, tuple[float, int]]:
    """Per part: (median ms, round trips of the last step)."""
    job = f"parts/{tensors}"
    ps = ParameterServer(job, replicas_to_aggregate=1, client=url)
    ps.initialize({f"p{k}": np.zeros(elements, np.float32) for k in range(tensors)})
    worker = Worker(job, client=url)
    step, _ = worker.pull(timeout=10)
    grads = {f"p{k}": np.ones(elements, np.float32) for k in range(tensors)}
    times: dict[str, list[float]] = {"push": [], "chief step": [], "pull": []}
    sends: dict[str, int] = {}

    def timed(part: str, fn: Any, keep: bool) -> Any:
        _SENDS[0] = 0
        t = time.perf_counter()
        out = fn()
        if keep:
            times[part].append(time.perf_counter() - t)
        sends[part] = _SENDS[0]
        return out

    for i in range(steps + 5):  # 5 untimed steps first
        keep = i >= 5
        timed("push", lambda s=step: worker.push(s, grads), keep)
        timed("chief step", lambda: ps.step(0.001, timeout=10), keep)
        step = timed("pull", lambda s=step: worker.pull(after=s, timeout=10), keep)[0]
    worker.close()
    ps.delete()
    ps.close()
    return {part: (1000 * statistics.median(times[part]), sends[part]) for part in times}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--elements", type=int, default=1024, help="float32 per tensor")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    _count_sends()
    print("| tensors | push | chief's step | pull |")
    print("|---:|---:|---:|---:|")
    with RedisServer() as server:
        for n in args.tensors:
            got = measure(server.url, n, args.elements, args.steps)
            cells = [f"{ms:.2f} ms, {rt} round trips" for ms, rt in got.values()]
            print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
