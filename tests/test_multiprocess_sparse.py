"""Many real processes on one real server, sparse: every accepted gradient's rows are taken
exactly once.

Worker ``w``'s ``j``-th gradient touches two rows unique to ``(w, j)`` (value 1) and the
shared row 0 twice (value 0.5 each, in an unsorted index list: coalesced into one 1.0
contribution). With SUM, each unique row shows up in exactly one take, and row 0's value in a
take is the number of gradients in it. Two taker processes compete for the rounds; all
processes start together (a barrier) and workers pace their applies, so that rounds are
usually taken while gradients keep arriving; how many takes that gives depends on scheduling,
so nothing is asserted about it: the checks are exact accounting, take by take.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest

import accumulator
from accumulator._keys import Keys

WORKERS = 8
PER_WORKER = 30
TAKERS = 2
ROWS = 1 + 2 * WORKERS * PER_WORKER


def _open(url: str, name: str, inner: int) -> accumulator.SparseConditionalAccumulator:
    return accumulator.SparseConditionalAccumulator(
        np.float64, shape=(ROWS, inner), shared_name=name, reduction_type="SUM", client=url
    )


def _rows(worker: int, j: int) -> tuple[int, int]:
    gid = worker * PER_WORKER + j
    return 1 + 2 * gid, 2 + 2 * gid


def _worker(url: str, name: str, inner: int, worker: int, start: Any, out: mp.Queue) -> None:
    acc = _open(url, name, inner)
    start.wait()  # every process is up: workers do not finish before the takers begin
    rng = np.random.default_rng(worker)
    accepted = []
    for j in range(PER_WORKER):
        a, b = _rows(worker, j)
        indices = np.array([b, 0, a, 0])  # unsorted, shared row twice
        values = np.empty((4, inner))
        values[[0, 2]] = 1.0
        values[[1, 3]] = 0.5
        # mostly the current step, sometimes one behind (stale), sometimes ahead
        step = acc.global_step() + int(rng.choice([0, 0, 0, -1, 1]))
        if acc.apply_grad(indices, values, grad_shape=(ROWS, inner), local_step=step):
            accepted.append(j)
        time.sleep(rng.uniform(0, 0.02))  # spread the applies over several rounds
    out.put(("worker", worker, accepted))


def _taker(url: str, name: str, inner: int, start: Any, stop: Any, out: mp.Queue) -> None:
    acc = _open(url, name, inner)
    start.wait()
    taken: list[tuple[list[int], float]] = []  # per take: unique rows, row 0's value
    consistent = True
    while True:
        try:
            indices, values, shape = acc.take_grad(3, timeout=0.5)
        except accumulator.DeadlineExceededError:
            if stop.is_set():
                break
            continue
        consistent &= shape.tolist() == [ROWS, inner]
        consistent &= bool((np.diff(indices) > 0).all())  # sorted, unique
        consistent &= bool((values == values[:, :1]).all())  # every column alike
        shared = 0.0
        if len(indices) and indices[0] == 0:
            shared = float(values[0, 0])
            indices, values = indices[1:], values[1:]
        consistent &= bool((values == 1.0).all())
        taken.append((indices.tolist(), shared))
    out.put(("taker", taken, consistent))


@pytest.mark.slow
@pytest.mark.parametrize("inner", [4, 2048], ids=["inline", "blob"])
def test_concurrent_sparse_workers_and_takers_lose_nothing(real, inner):
    # blob: 4 rows x 2048 float64 = 64 KiB per gradient, through its own key
    name = f"mps-{inner}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stop = ctx.Event()
    start = ctx.Barrier(TAKERS + WORKERS + 1, timeout=60)
    acc = _open(real.url, name, inner)
    takers = [ctx.Process(target=_taker, args=(real.url, name, inner, start, stop, out))
              for _ in range(TAKERS)]  # fmt: skip
    workers = [ctx.Process(target=_worker, args=(real.url, name, inner, w, start, out))
               for w in range(WORKERS)]  # fmt: skip
    started = time.monotonic()
    for p in takers + workers:
        p.start()
    start.wait()
    accepted: dict[int, list[int]] = {}
    taker_reports = []
    while len(accepted) < WORKERS:
        msg = out.get(timeout=60)
        assert msg[0] == "worker", msg
        accepted[msg[1]] = msg[2]
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    stop.set()
    for _ in takers:
        taker_reports.append(out.get(timeout=60))
    for t in takers:
        t.join(30)
        assert t.exitcode == 0
    assert time.monotonic() - started < 60

    takes = [take for report in taker_reports for take in report[1]]
    assert all(report[2] for report in taker_reports), "a take returned malformed rows"
    # every take of the takers holds at least the 3 gradients it asked for, each counted once
    # in row 0 (two unique rows per gradient)
    assert takes, "the takers took nothing"
    assert all(shared >= 3 and shared == len(rows) / 2 for rows, shared in takes), [
        (len(rows), shared) for rows, shared in takes
    ]
    # what the last (incomplete) round holds is taken here
    leftover = acc.num_accumulated()
    if leftover:
        indices, values, _ = acc.take_grad(leftover)
        assert indices[0] == 0
        takes.append((indices[1:].tolist(), float(values[0, 0])))

    expected = sorted(r for w, js in accepted.items() for j in js for r in _rows(w, j))
    n_accepted = sum(len(js) for js in accepted.values())
    assert n_accepted > WORKERS * PER_WORKER // 2, "too few gradients accepted to mean much"
    taken = sorted(r for rows, _ in takes for r in rows)
    # every accepted gradient's rows exactly once; no dropped gradient's rows; nothing else
    assert taken == expected
    assert sum(shared for _, shared in takes) == float(n_accepted)
    r = real.redis()
    keys = Keys("", name)
    stats = r.hgetall(keys.state)
    assert int(stats[b"n_applied"]) == n_accepted
    assert int(stats[b"n_applied"]) + int(stats[b"n_stale"]) == WORKERS * PER_WORKER
    assert acc.num_accumulated() == 0
    assert r.zcard(keys.takers) == 0
    # what is left must be expiring: payloads a take read and left to the next one to free
    leftovers = [
        k for k in r.scan_iter(match=keys.pattern)
        if (b":b:" in k or b":c:" in k) and r.pttl(k) < 0
    ]  # fmt: skip
    assert leftovers == []
