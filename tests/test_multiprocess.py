"""Many real processes on one real server: every accepted gradient lands in exactly one take.

Each worker's j-th gradient is a one-hot vector at a position unique to (worker, j), so each
take's sum shows, position by position, which gradients it holds and how often. The checks
are exact and independent of scheduling: how many takes happen, and how big each one is,
depends on how the processes get the CPU (all of them start together at a barrier so that
takes usually run while gradients arrive, but nothing is asserted about it). The fault drills
(kills, restarts, lost connections) are in test_faults.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
import pytest

import accumulator
from accumulator._keys import Keys

WORKERS = 8
PER_WORKER = 40


def _worker(url: str, name: str, width: int, index: int, start: Any, out: mp.Queue) -> None:
    acc = accumulator.ConditionalAccumulator(
        np.float64, shape=(width,), shared_name=name, reduction_type="SUM", client=url
    )
    start.wait()
    rng = np.random.default_rng(index)
    accepted = []
    for j in range(PER_WORKER):
        g = np.zeros(width)
        g[index * PER_WORKER + j] = 1.0
        # mostly the current step, sometimes one behind (stale), sometimes ahead
        step = acc.global_step() + int(rng.choice([0, 0, 0, -1, 1]))
        if acc.apply_grad(g, local_step=step):
            accepted.append(index * PER_WORKER + j)
    out.put((index, accepted))


def _taker(url: str, name: str, width: int, start: Any, stop: Any, out: mp.Queue) -> None:
    acc = accumulator.ConditionalAccumulator(
        np.float64, shape=(width,), shared_name=name, reduction_type="SUM", client=url
    )
    start.wait()
    takes: list[dict[int, float]] = []  # per take: position -> value (1.0 = taken once)
    while True:
        try:
            total = acc.take_grad(3, timeout=0.5)
        except accumulator.DeadlineExceededError:
            if stop.is_set():
                break
            continue
        takes.append({int(i): float(total[i]) for i in np.flatnonzero(total)})
    # whatever the last round holds (fewer than 3) is taken by the test afterwards
    out.put(("taker", takes))


@pytest.mark.slow
@pytest.mark.parametrize("pad", [0, 16384], ids=["inline", "blob"])
def test_concurrent_workers_and_taker_lose_nothing(real, pad):
    width = WORKERS * PER_WORKER + pad  # pad: 128 KiB gradients go through their own keys
    name = f"mp-{pad}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stop = ctx.Event()
    start = ctx.Barrier(WORKERS + 2, timeout=60)
    taker = ctx.Process(target=_taker, args=(real.url, name, width, start, stop, out))
    workers = [
        ctx.Process(target=_worker, args=(real.url, name, width, i, start, out))
        for i in range(WORKERS)
    ]
    acc = accumulator.ConditionalAccumulator(
        np.float64, shape=(width,), shared_name=name, reduction_type="SUM", client=real.url
    )
    taker.start()
    for w in workers:
        w.start()
    start.wait()
    results = {}
    for _ in workers:
        index, accepted = out.get(timeout=120)
        results[index] = accepted
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    stop.set()
    label, takes = out.get(timeout=60)
    taker.join(30)
    assert label == "taker" and taker.exitcode == 0
    leftover = acc.num_accumulated()
    if leftover:
        total = acc.take_grad(leftover)
        takes.append({int(i): float(total[i]) for i in np.flatnonzero(total)})
    expected = sorted(i for accepted in results.values() for i in accepted)
    accepted_count = len(expected)
    assert accepted_count > WORKERS * PER_WORKER // 2, "too few gradients accepted to mean much"
    # every take holds whole gradients, each at most once, and (but the test's own last one)
    # at least the 3 it asked for
    assert all(set(take.values()) == {1.0} for take in takes), "a gradient doubled in a take"
    taker_takes = takes[:-1] if leftover else takes
    assert taker_takes, "the taker took nothing"
    assert all(len(take) >= 3 for take in taker_takes), [len(t) for t in taker_takes]
    # every accepted gradient exactly once, no dropped one taken, nothing else
    taken = sorted(i for take in takes for i in take)
    assert taken == expected
    r = real.redis()
    keys = Keys("", name)
    state = r.hgetall(keys.state)
    assert int(state[b"n_applied"]) == accepted_count
    assert int(state[b"n_applied"]) + int(state[b"n_stale"]) == WORKERS * PER_WORKER
    assert acc.num_accumulated() == 0
    # what is left must be expiring: payloads a take read and left to the next one to free
    leftovers = [
        k for k in r.scan_iter(match=keys.pattern)
        if (b":b:" in k or b":c:" in k) and r.pttl(k) < 0
    ]  # fmt: skip
    assert leftovers == []
    assert r.zcard(keys.takers) == 0


@pytest.mark.slow
def test_killed_taker_process_does_not_block_the_fifo(real):
    """A taker process SIGKILLed while waiting: the next taker is served after its lease."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_doomed_taker, args=(real.url, ready))
    proc.start()
    assert ready.wait(30)
    acc = accumulator.ConditionalAccumulator(np.float32, shape=(2,), shared_name="kt",
                                             client=real.url)  # fmt: skip
    deadline = time.monotonic() + 10
    while real.redis().zcard(acc._keys.takers) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, 9)
    proc.join(10)
    acc.apply_grad([1.0, 2.0])
    acc.wait_slice = 0.2
    np.testing.assert_array_equal(acc.take_grad(1, timeout=10), [1.0, 2.0])


def _doomed_taker(url: str, ready: mp.Event) -> None:
    acc = accumulator.ConditionalAccumulator(np.float32, shape=(2,), shared_name="kt",
                                             client=url)  # fmt: skip
    acc.taker_lease = 1.0
    acc.wait_slice = 0.3
    ready.set()
    acc.take_grad(5)
