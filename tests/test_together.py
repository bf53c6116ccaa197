"""Several accumulators' steps side by side (``accumulator._together``, what a sync job's
push and its chief's step use): their script calls share round trips, each step keeps its
own outcome, and a wait never holds another step's claimed round."""

from __future__ import annotations

import numpy as np
import pytest

import accumulator
from accumulator._together import run_together


def _accs(target, n: int, name: str = "t"):
    return [
        accumulator.ConditionalAccumulator(
            np.float32, (256,), shared_name=f"{name}{i}", client=target.client()
        )
        for i in range(n)
    ]


def _applies(accs, step: int = 0, scale: float = 1.0):
    return [(acc, acc._apply_grad_ops(np.full(256, scale * (i + 1), np.float32), step))
            for i, acc in enumerate(accs)]  # fmt: skip


def _takes(accs, n: int = 1, timeout: float | None = 5):
    return [(acc, acc._take_grad_ops(n, timeout, None)) for acc in accs]


def test_small_applies_and_takes_share_their_round_trips(real, sends):
    accs = _accs(real, 6)
    for acc in accs:  # a round first: scripts loaded on every node
        acc.apply_grad(np.zeros(256, np.float32), 0)
        acc.take_grad(1, timeout=5)
    sends[0] = 0
    assert run_together(_applies(accs, step=1)) == [(True, True)] * 6
    applies = sends[0]
    sends[0] = 0
    outcomes = run_together(_takes(accs))
    takes = sends[0]
    for i, (ok, value) in enumerate(outcomes):
        assert ok and np.array_equal(value, np.full(256, i + 1, np.float32))
    if real.kind == "cluster":  # one pipeline per node the six accumulators live on
        assert applies <= 3 and takes <= 6
    else:  # one pipeline of applies; one of claims, one of finishes
        assert (applies, takes) == (1, 2)
    assert [acc.global_step() for acc in accs] == [2] * 6
    for acc in accs:
        acc.close()


def test_each_step_keeps_its_own_outcome(target):
    accs = _accs(target, 3)
    sparse = accumulator.SparseConditionalAccumulator(np.float32, (10, 2), shared_name="sp",
                                                      client=target.client())  # fmt: skip
    accs[1].set_global_step(5)
    steps = _applies(accs, step=1)
    steps[2] = (accs[2], accs[2]._apply_grad_ops(np.ones(7, np.float32), 1))  # wrong shape
    steps.append((sparse, sparse._apply_grad_ops([3], [[1.0, 2.0]], None, 1)))
    outcomes = run_together(steps)
    assert outcomes[0] == (True, True)
    assert outcomes[1] == (True, False)  # stale: dropped
    assert not outcomes[2][0] and isinstance(outcomes[2][1], accumulator.InvalidArgumentError)
    assert "Shape mismatch" in str(outcomes[2][1])
    assert outcomes[3] == (True, True)
    assert [a.num_accumulated() for a in accs] == [1, 0, 0] and sparse.num_accumulated() == 1
    taken = run_together([(accs[0], accs[0]._take_grad_ops(1, 5, None)),
                          (sparse, sparse._take_grad_ops(1, 5))])  # fmt: skip
    assert np.array_equal(taken[0][1], np.full(256, 1, np.float32))
    indices, values, _ = taken[1][1]
    assert indices.tolist() == [3] and values.tolist() == [[1.0, 2.0]]
    for acc in [*accs, sparse]:
        acc.close()


def test_a_waiting_take_does_not_hold_a_claimed_round(target):
    ready, empty = _accs(target, 2, "w")
    ready.apply_grad(np.ones(256, np.float32), 0)
    outcomes = run_together(_takes([empty, ready], timeout=0.5))
    assert not outcomes[0][0] and isinstance(outcomes[0][1], accumulator.DeadlineExceededError)
    assert outcomes[1][0] and np.array_equal(outcomes[1][1], np.ones(256, np.float32))
    assert (ready.global_step(), ready.num_accumulated()) == (1, 0)
    assert (empty.global_step(), empty.num_accumulated()) == (0, 0)
    for acc in (ready, empty):
        acc.close()


def test_an_interrupt_while_waiting_keeps_what_ended_and_consumes_nothing_else(target,
                                                                               monkeypatch):
    ready, waiting = _accs(target, 2, "i")
    ready.apply_grad(np.ones(256, np.float32), 0)
    waiting.apply_grad(np.ones(256, np.float32), 0)  # 1 of the 2 it takes
    real_do = waiting._do

    def interrupted(request):
        if type(request).__name__ in ("Pop", "Listen"):
            raise KeyboardInterrupt
        return real_do(request)

    monkeypatch.setattr(waiting, "_do", interrupted)
    ended = {}
    with pytest.raises(KeyboardInterrupt):
        run_together([(ready, ready._take_grad_ops(1, 5, None)),
                      (waiting, waiting._take_grad_ops(2, 5, None))],
                     lambda i, outcome: ended.update({i: outcome}))  # fmt: skip
    assert list(ended) == [0] and np.array_equal(ended[0][1], np.ones(256, np.float32))
    assert (ready.global_step(), waiting.global_step(), waiting.num_accumulated()) == (1, 0, 1)
    monkeypatch.undo()
    waiting.apply_grad(np.ones(256, np.float32), 0)
    assert np.array_equal(waiting.take_grad(2, timeout=5), np.ones(256, np.float32))
    for acc in (ready, waiting):
        acc.close()
