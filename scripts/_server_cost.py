"""What an apply and a take cost Redis's own thread, against a raw SET: the CPU time of the
server process (INFO cpu, user + system) over a run of operations, per operation.

Latency hides this (a client waits on its round trip either way); capacity does not: one
Redis serves everyone's applies on one thread, so the CPU an apply takes there bounds how
many applies per second a shared server absorbs, whatever the number of workers.

Run by ``scripts/bench.py`` on its server (``measure``), or alone::

    python scripts/_server_cost.py [--url URL] [--n 2000]
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

import accumulator

ELEMENTS = 1024  # float32: 4 KiB, an inline payload
W = 4


@dataclass
class Cost:
    """Server CPU per operation, in microseconds."""

    set_us: float
    apply_us: float
    take_us: float  # a take(W) of W inline gradients, its claim and its finish
    n: int

    def lines(self) -> list[str]:
        per_s = 1e6 / self.apply_us
        return [
            f"Redis CPU per operation ({ELEMENTS * 4 // 1024} KiB float32, INFO cpu user+sys over "
            f"{self.n} each): SET {self.set_us:.1f} us; apply {self.apply_us:.1f} us "
            f"({self.apply_us / self.set_us:.1f}x SET); take({W}) {self.take_us:.1f} us",
            f"  one Redis thread absorbs at most ~{per_s:,.0f} applies/s of this size "
            "(all clients together)",
        ]


def _cpu_s(r: redis.Redis) -> float:
    info: Any = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure(url: str, n: int = 2000) -> Cost:
    """Run n SETs, n applies and n / W rounds (W applies, one take) on the server at url."""
    r = redis.Redis.from_url(url)
    name = f"bench/cost/{uuid.uuid4().hex[:8]}"
    acc = accumulator.ConditionalAccumulator(np.float32, (ELEMENTS,), shared_name=name, client=url)
    grad = np.random.default_rng(0).standard_normal(ELEMENTS).astype(np.float32)
    key = f"bench:cost:{uuid.uuid4().hex[:8]}"
    try:
        for _ in range(50):  # warm: scripts loaded, connections open
            r.set(key, grad.data)
            acc.apply_grad(grad, local_step=acc.global_step())
        acc.take_grad(1)

        before = _cpu_s(r)
        for _ in range(n):
            r.set(key, grad.data)
        set_us = (_cpu_s(r) - before) / n * 1e6

        step = acc.global_step()
        before = _cpu_s(r)
        for _ in range(n):
            acc.apply_grad(grad, local_step=step)
        apply_us = (_cpu_s(r) - before) / n * 1e6
        acc.take_grad(1)  # (untimed: frees the round)

        rounds = max(1, n // W)
        before = _cpu_s(r)
        for _ in range(rounds):
            step = acc.global_step()
            for _ in range(W):
                acc.apply_grad(grad, local_step=step)
            acc.take_grad(W)
        round_us = (_cpu_s(r) - before) / rounds * 1e6
        return Cost(set_us, apply_us, max(0.0, round_us - W * apply_us), n)
    finally:
        r.unlink(key)
        accumulator.delete_accumulator(name, client=url)
        acc.close()
        r.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="this server (default: a throwaway one)")
    parser.add_argument("--n", type=int, default=2000, help="operations of each kind")
    args = parser.parse_args(argv)
    if args.url:
        cost = measure(args.url, args.n)
    else:
        from accumulator.testing import RedisServer

        with RedisServer() as server:
            cost = measure(server.url, args.n)
    print("\n".join(cost.lines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
