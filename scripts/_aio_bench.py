"""The asyncio twins against the synchronous classes (``scripts/bench.py``): one round, 4
applies then take(4), on the same server and sizes, interleaved run by run. A ratio, not a
target from an issue: what ``accumulator.aio`` costs over the synchronous driver (its
protocol is the same; the I/O is redis.asyncio's, large reads in place in a worker thread)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

import accumulator
from accumulator import aio

NUM_GRADS = 4


def _check(out: np.ndarray, expected: np.ndarray) -> None:
    if not np.array_equal(out, expected):
        raise RuntimeError("take_grad returned a wrong mean")


def _one_size(
    loop: asyncio.AbstractEventLoop, url: str, elements: int, runs: int, rng: Any
) -> tuple[int, list[float], list[float]]:
    grads = [rng.standard_normal(elements).astype(np.float32) for _ in range(NUM_GRADS)]
    total = grads[0].copy()
    for g in grads[1:]:
        np.add(total, g, out=total)
    expected = (total / np.float32(NUM_GRADS)).astype(np.float32)
    name = f"bench-aio/{uuid.uuid4().hex[:8]}"
    sync = accumulator.ConditionalAccumulator(np.float32, (elements,), shared_name=name + "/s",
                                              client=url)  # fmt: skip
    asy = aio.ConditionalAccumulator(np.float32, (elements,), shared_name=name + "/a",
                                     client=url)  # fmt: skip
    loop.run_until_complete(asy.open())

    def sync_round(step: int) -> float:
        t0 = time.perf_counter()
        for g in grads:
            sync.apply_grad(g, local_step=step)
        got = sync.take_grad(NUM_GRADS, timeout=60)
        dt = time.perf_counter() - t0
        _check(got, expected)
        return dt

    async def aio_round(step: int) -> float:
        t0 = time.perf_counter()
        for g in grads:
            await asy.apply_grad(g, local_step=step)
        got = await asy.take_grad(NUM_GRADS, timeout=60)
        dt = time.perf_counter() - t0
        _check(got, expected)
        return dt

    def asyncio_round(step: int) -> float:
        return loop.run_until_complete(aio_round(step))

    times: dict[str, list[float]] = {"s": [], "a": []}
    try:
        for step in range(runs + 1):  # the first round of each is untimed
            for which in ("s", "a") if step % 2 == 0 else ("a", "s"):  # alternate the order
                run = sync_round if which == "s" else asyncio_round
                dt = run(step)
                if step:
                    times[which].append(dt)
    finally:
        sync.close()
        loop.run_until_complete(asy.aclose())
    return grads[0].nbytes, times["s"], times["a"]


def measure(
    url: str, sizes: list[tuple[str, int]], runs_for: Callable[[int], int], rng: Any
) -> list[tuple[str, int, list[float], list[float]]]:
    """(label, bytes, sync seconds, aio seconds) per size: each a full round (4 applies and
    take(4)) of float32 gradients."""
    loop = asyncio.new_event_loop()
    try:
        return [(label, *_one_size(loop, url, elements, runs_for(elements), rng))
                for label, elements in sizes]  # fmt: skip
    finally:
        loop.close()
