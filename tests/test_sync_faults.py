"""A sync job trained through faults: every Redis request of the chief, the workers and their
accumulators (pushes, takes, publishes, pulls, the lease) may be lost on its way there or
its reply on its way back, at random (seeded); the retry layer sends it again. The job must
train exactly as without faults: every push counted once, every step taking both workers'
gradients, the parameters equal to the exact reference after every step."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from _helpers import FAULT_MODES, failing_once

from accumulator import _core
from accumulator.sync import ParameterServer, Worker, _job

STEPS = 8
LR = 0.5  # every figure below is exact in float64
#: the chance that a request fails once
RATE = 0.25


class RandomFaults:
    """Stands in for the retry layer's entry (``_io``) of every accumulator and sync job:
    a request fails once, at random, before it runs or after (its reply lost)."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.fired: list[str] = []

    def _failing_once(self, what: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        with self.lock:
            if self.random.random() >= RATE:
                return fn
            mode = self.random.choice(FAULT_MODES)
        return failing_once(fn, mode, lambda: self.fired.append(f"{what}: {mode}"))

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        acc_io, job_io = _core.AccumulatorBase._io, _job._Job._io

        def acc_faulty(acc: Any, what: str, fn: Callable[[], Any], window: Any = None) -> Any:
            return acc_io(acc, what, self._failing_once(what, fn), window)

        def job_faulty(job: Any, what: str, fn: Callable[[], Any]) -> Any:
            return job_io(job, what, self._failing_once(what, fn))

        monkeypatch.setattr(_core.AccumulatorBase, "_io", acc_faulty)
        monkeypatch.setattr(_job._Job, "_io", job_faulty)


def _grads(worker: int, step: int) -> dict[str, Any]:
    """Worker ``worker``'s gradients at ``step``: known to the reference."""
    scale = float(worker + 1 + step)
    rows = [worker, 3 + (step % 2)]
    return {"w": np.full((2, 3), scale), "b": np.full(3, -scale),
            "emb": (rows, np.full((2, 2), scale))}  # fmt: skip


def _params() -> dict[str, np.ndarray]:
    return {"w": np.zeros((2, 3)), "b": np.ones(3), "emb": np.zeros((6, 2))}


def _reference(steps: int) -> Iterator[dict[str, np.ndarray]]:
    """The parameters after each step: MEAN of both workers' gradients (per row for the
    sparse one, over the gradients holding it), ``p -= LR * g``."""
    params = _params()
    for step in range(steps):
        grads = [_grads(i, step) for i in range(2)]
        params["w"] = params["w"] - LR * (grads[0]["w"] + grads[1]["w"]) / 2
        params["b"] = params["b"] - LR * (grads[0]["b"] + grads[1]["b"]) / 2
        rows: dict[int, list[np.ndarray]] = {}
        for g in grads:
            for row, values in zip(g["emb"][0], g["emb"][1], strict=True):
                rows.setdefault(row, []).append(values)
        emb = params["emb"].copy()
        for row, values in rows.items():
            emb[row] -= LR * sum(values) / len(values)
        params["emb"] = emb
        yield {k: v.copy() for k, v in params.items()}


def test_a_sync_job_trains_exactly_through_lost_requests_and_replies(target, monkeypatch):
    seed = random.randrange(10**6)
    faults = RandomFaults(seed)
    ps = ParameterServer("faulty", replicas_to_aggregate=2, sparse={"emb"}, fusion_bytes=0,
                         client=target.client())  # fmt: skip
    ps.initialize(_params())
    workers = [Worker("faulty", client=target.client(), worker_id=f"w{i}") for i in range(2)]
    faults.patch(monkeypatch)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            step, _ = workers[i].pull(timeout=30)
            while step < STEPS:
                assert workers[i].push(step, _grads(i, step)) == {"w": True, "b": True,
                                                                  "emb": True}  # fmt: skip
                step, _ = workers[i].pull(after=step, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for step, want in enumerate(_reference(STEPS), start=1):
        assert ps.step(LR, timeout=30) == step, f"seed {seed}"
        for name, value in want.items():
            np.testing.assert_array_equal(ps.params[name], value, err_msg=f"seed {seed}")
    for thread in threads:
        thread.join(30)
    monkeypatch.undo()
    assert not errors, (seed, errors)
    # faults hit pushes, takes, publishes and pulls (which of them varies with the seed)
    assert len(faults.fired) >= 5, faults.fired
    stats = ps.stats()
    assert (stats.step, stats.pushes, stats.accepted, stats.stale, stats.partial) == (
        STEPS, 2 * STEPS, 2 * STEPS, 0, 0), (seed, stats)  # fmt: skip
    assert all(p.applied == 2 * STEPS for p in stats.params.values()), (seed, stats)
    for worker in workers:
        worker.close()
    ps.close()
