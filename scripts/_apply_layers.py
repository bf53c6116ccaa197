"""Where a small apply's client time goes: the apply's own script call sent three ways,
interleaved, and the Python of ``apply_grad`` alone.

- ``raw``: the command's bytes on a raw socket (no redis-py, no accumulator);
- ``pooled``: the same command on a pooled redis-py connection (``_direct.execute``: the
  pool's checkout and release, the send, the reply read);
- ``apply_grad``: the whole call, a new apply each time;
- ``set``: redis-py's ``SET`` of the gradient's bytes (the benchmark's baseline);
- ``python``: ``apply_grad`` with its script call answered from memory (no I/O at all).

The replayed command carries one apply identity, so Redis answers it as a retry (its
script's cheapest path): ``raw`` and ``pooled`` differ by redis-py's share only. Pin the
client to one CPU for steadier figures (``taskset -c 1``)::

    python scripts/_apply_layers.py --url redis://localhost:6379 [--elements 1024]
"""

from __future__ import annotations

import argparse
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import numpy as np
import redis

import accumulator
from accumulator import _direct, _scripts

ROUNDS = 30
CALLS = 200


def _median_us(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] * 1e6


def measure(url: str, elements: int) -> dict[str, float]:
    """Median microseconds per call of each way (see the module docstring)."""
    name = f"bench/layers/{uuid.uuid4().hex[:8]}"
    acc = accumulator.ConditionalAccumulator(np.float32, (elements,), shared_name=name,
                                             client=url)  # fmt: skip
    grad = np.ones(elements, np.float32)
    step = 10**6  # never stale
    sent: list[tuple[Any, ...]] = []
    real = _scripts.execute

    def spy(client: Any, *command: Any) -> Any:
        sent.append(command)
        return real(client, *command)

    _scripts.execute = spy  # type: ignore[assignment]
    try:
        acc.apply_grad(grad, local_step=step)
    finally:
        _scripts.execute = real
    command = sent[-1]
    client = acc._conns.commands
    conn = client.connection_pool.get_connection()
    packed = b"".join(bytes(p) for p in conn.pack_command(*command))
    client.connection_pool.release(conn)
    where = urlparse(url)
    sock = socket.create_connection((where.hostname or "localhost", where.port or 6379))

    def raw() -> None:
        sock.sendall(packed)
        sock.recv(1 << 16)

    def pooled() -> None:
        _direct.execute(client, *command)

    def apply() -> None:
        acc.apply_grad(grad, local_step=step)

    plain = redis.Redis.from_url(url)
    key = f"bench:layers:{uuid.uuid4().hex[:8]}"
    payload = grad.tobytes()

    def set_() -> None:
        plain.set(key, payload)

    ways: dict[str, Callable[[], None]] = {"raw": raw, "pooled": pooled, "apply_grad": apply,
                                           "set": set_}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(ROUNDS):
        for key, call in ways.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                call()
            times[key].append((time.perf_counter() - start) / CALLS)
        acc.take_grad(acc.num_accumulated())  # (the round stays small)
    out = {key: _median_us(v) for key, v in times.items()}

    reply = real(client, *command)
    _scripts.execute = lambda client, *command: reply  # type: ignore[assignment]
    try:
        samples = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(CALLS):
                apply()
            samples.append((time.perf_counter() - start) / CALLS)
        out["python"] = _median_us(samples)
    finally:
        _scripts.execute = real
    sock.close()
    plain.delete(key)
    plain.close()
    accumulator.delete_accumulator(name, client=url)
    acc.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="redis://localhost:6379")
    parser.add_argument("--elements", type=int, default=1024, help="float32 elements")
    args = parser.parse_args()
    got = measure(args.url, args.elements)
    print(f"apply of {args.elements * 4} bytes, median us per call:")
    for key, us in got.items():
        print(f"  {key:10s} {us:8.1f}")
    print(f"  redis-py's share (pooled - raw): {got['pooled'] - got['raw']:.1f} us; "
          f"our Python: {got['python']:.1f} us; apply_grad / set: "
          f"{got['apply_grad'] / got['set']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
