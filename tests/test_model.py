"""Model-based tests: random sequences of operations against an in-memory reference of the
spec (``semantics.md`` sections 2-4 and 6), on fakeredis and on a real server.

A hypothesis ``RuleBasedStateMachine`` drives one accumulator with apply_grad (local steps
stale, current and future, shapes that fit and that do not), take_grad (``num_required <=
count``, which must not block, or more than ``count`` with a tiny timeout, which must raise
DeadlineExceededError and leave Redis as it was), set_global_step (up, down, and to the int64
limits), num_accumulated and ``_admin.reset``. The reference keeps the step, the counter, the
round shape and the gradients in apply order and computes what a take must return: the sum in
the accumulator dtype in apply order, MEAN = ``sum / dtype(count)`` (``expected_mean``), per
row with its own count for the sparse kind. float64 data are multiples of 1/4 (sums exact
whatever the order) and int64 data reach the int64 limits (sums wrap); so results are compared
exactly.

Every example opens a fresh accumulator (a unique shared_name) and deletes it at the end.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import redis
from _helpers import PROMPT, expected_mean, redis_snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import accumulator
from accumulator import _admin
from accumulator._codec import format_shape

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    database=None,  # nothing written into the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DTYPES = [np.dtype(np.float64), np.dtype(np.int64)]


def elements(dtype: np.dtype) -> st.SearchStrategy[Any]:
    if dtype.kind == "f":  # multiples of 1/4: every sum and difference is exact in float64
        return st.integers(-4000, 4000).map(lambda k: k / 4)
    # mostly small, sometimes at the int64 limits (the sum wraps like C)
    return st.one_of(
        st.integers(-10, 10),
        st.integers(INT64_MIN, INT64_MAX),
        st.sampled_from([INT64_MIN, INT64_MAX]),
    )


def step_like(value: int, data: st.DataObject) -> Any:
    """The step as an int or as a numpy integer scalar (both are fine)."""
    if data.draw(st.booleans(), label="numpy step"):
        return np.int64(value)
    return value


def new_step(current: int) -> st.SearchStrategy[int]:
    near = st.integers(-3, 3).map(lambda d: min(max(current + d, INT64_MIN), INT64_MAX))
    limits = st.sampled_from([INT64_MAX, INT64_MAX - 1, INT64_MIN, 2**53, 2**53 + 1, 0])
    return st.integers(0, 9).flatmap(lambda k: limits if k == 0 else near)


def _sum(acc: np.ndarray | None, g: np.ndarray) -> np.ndarray:
    """The spec's in-order sum: the first gradient copied, the next ones added in dtype."""
    if acc is None:
        return g.copy()
    with np.errstate(over="ignore"):
        return np.asarray(np.add(acc, g, dtype=g.dtype))


class _Machine(RuleBasedStateMachine):
    """What the dense and sparse machines share: the accumulator's life, step, takes, reset."""

    target: Any = None
    kind = ""

    def __init__(self) -> None:
        super().__init__()
        self.acc: Any = None
        self.r: redis.Redis | None = None
        self.step = 0
        self.count = 0

    # -- to be provided by the kind ------------------------------------------------------------

    def _open(self, dtype: np.dtype, shape: Any, reduction: str, name: str) -> Any:
        raise NotImplementedError

    def _forget_round(self) -> None:
        raise NotImplementedError

    def _check_result(self, result: Any) -> None:
        raise NotImplementedError

    # -- lifecycle ----------------------------------------------------------------------------

    def _start(self, dtype: np.dtype, shape: Any, reduction: str) -> None:
        self.dtype, self.declared, self.reduction = dtype, shape, reduction
        self.name = f"model/{self.kind}/{uuid.uuid4().hex}"
        self.acc = self._open(dtype, shape, reduction, self.name)
        self.r = self.target.redis()

    def teardown(self) -> None:
        if self.acc is not None:
            try:
                _admin.delete(self.r, self.name)
            finally:
                self.acc.close()
                if self.target.kind != "fake":
                    self.r.close()

    # -- invariants and rules shared by both kinds ---------------------------------------------

    @invariant()
    def counter_and_step_match(self) -> None:
        if self.acc is not None:
            assert self.acc.num_accumulated() == self.count
            assert self.acc.global_step() == self.step

    def _unchanged(self, before: dict[bytes, Any]) -> None:
        assert redis_snapshot(self.r) == before

    @precondition(lambda self: self.acc is not None and self.count >= 1)
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        self._take(data.draw(st.integers(1, self.count), label="num_required"))

    @precondition(lambda self: self.acc is not None and self.count >= 2)
    @rule()
    def take_all(self) -> None:
        self._take(self.count)

    def _take(self, n: int) -> None:
        if self.step == INT64_MAX:  # the step cannot advance: a clear error, nothing consumed
            before = redis_snapshot(self.r)
            with pytest.raises(accumulator.AccumulatorError):
                self.acc.take_grad(n, timeout=PROMPT)
            self._unchanged(before)
            return
        # timeout only as a safety net: the round is complete, the take must not wait
        result = self.acc.take_grad(n, timeout=PROMPT)
        self._check_result(result)
        self.step += 1
        self.count = 0
        self._forget_round()

    @precondition(lambda self: self.acc is not None)
    @rule(data=st.data())
    def take_times_out(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(self.count + 1, self.count + 3), label="num_required")
        # mostly zero (no wait); a real server's blocking timeouts have ~0.1 s resolution
        zero = st.sampled_from([0, 0.0, np.int64(0), np.float64(0), np.int32(0)])
        short = st.sampled_from([0.01, np.float64(0.01), np.float32(0.005)])
        timeout = data.draw(
            st.integers(0, 5).flatmap(lambda k: short if k == 0 else zero), "timeout"
        )
        before = redis_snapshot(self.r)
        # at the int64 maximum a take can never succeed: refused at once, or it times out
        expected = (
            accumulator.AccumulatorError
            if self.step == INT64_MAX
            else accumulator.DeadlineExceededError
        )
        with pytest.raises(expected):
            self.acc.take_grad(n, timeout=timeout)
        self._unchanged(before)

    @precondition(lambda self: self.acc is not None)
    @rule(data=st.data())
    def set_global_step(self, data: st.DataObject) -> None:
        new = data.draw(new_step(self.step), label="new_global_step")
        self.acc.set_global_step(step_like(new, data))
        self.step = new  # never touches the counter or the round

    @precondition(lambda self: self.acc is not None)
    @rule()
    def num_accumulated(self) -> None:
        assert self.acc.num_accumulated() == self.count

    @precondition(lambda self: self.acc is not None)
    @rule()
    def reset(self) -> None:
        assert _admin.reset(self.r, self.name) == self.count
        self.count = 0  # the step stays
        self._forget_round()

    def _apply_step(self, data: st.DataObject, fresh: bool) -> tuple[Any, int]:
        """A local step for an apply (current or future when ``fresh``), and its int value."""
        deltas = st.integers(0, 2) if fresh else st.integers(-3, 3)
        value = self.step + data.draw(deltas, label="local step - global step")
        if not INT64_MIN <= value <= INT64_MAX:
            return value, value
        return step_like(value, data), value


# -- dense ------------------------------------------------------------------------------------

DENSE_CONFIGS = {
    # declared shape -> gradient shapes to try (some fit, some do not)
    (2, 3): [(2, 3), (2, 3), (2, 3), (3, 2), (6,)],
    None: [(), (2,), (3,), (2, 2)],
    (None, 2): [(1, 2), (3, 2), (3, 2), (2, 3), (2,)],
}


def _fits(declared: tuple[int | None, ...] | None, shape: tuple[int, ...]) -> bool:
    if declared is None:
        return True
    return len(declared) == len(shape) and all(
        d is None or d == s for d, s in zip(declared, shape, strict=True)
    )


class DenseMachine(_Machine):
    kind = "dense"

    def __init__(self) -> None:
        super().__init__()
        self.total: np.ndarray | None = None  # running sum of the round, in apply order
        self.round_shape: tuple[int, ...] | None = None

    def _open(self, dtype: np.dtype, shape: Any, reduction: str, name: str) -> Any:
        return accumulator.ConditionalAccumulator(
            dtype, shape, name, reduction_type=reduction, client=self.target.client()
        )

    @initialize(
        dtype=st.sampled_from(DTYPES),
        shape=st.sampled_from(list(DENSE_CONFIGS)),
        reduction=st.sampled_from(["MEAN", "SUM"]),
    )
    def start(self, dtype: np.dtype, shape: Any, reduction: str) -> None:
        self._start(dtype, shape, reduction)

    def _forget_round(self) -> None:
        self.total, self.round_shape = None, None

    @precondition(lambda self: self.acc is not None)
    @rule(data=st.data())
    def apply_fresh(self, data: st.DataObject) -> None:
        """Most likely accepted: a current or future step, a shape that fits if one does."""
        self._apply(data, fresh=True)

    @precondition(lambda self: self.acc is not None)
    @rule(data=st.data())
    def apply_any(self, data: st.DataObject) -> None:
        self._apply(data, fresh=False)

    configs = DENSE_CONFIGS

    def _draw_grad(self, data: st.DataObject, shape: tuple[int, ...]) -> np.ndarray:
        return data.draw(hnp.arrays(self.dtype, shape, elements=elements(self.dtype)), label="g")

    def _apply(self, data: st.DataObject, fresh: bool) -> None:
        shapes = self.configs[self.declared]
        if fresh and self.round_shape is not None:
            shapes = [self.round_shape]
        elif fresh:
            shapes = [s for s in shapes if _fits(self.declared, s)]
        shape = data.draw(st.sampled_from(shapes), label="shape")
        grad = self._draw_grad(data, shape)
        sent: Any = grad.tolist() if data.draw(st.booleans(), label="as list") else grad
        step, value = self._apply_step(data, fresh)
        before = redis_snapshot(self.r)
        if not INT64_MIN <= value <= INT64_MAX:
            with pytest.raises(accumulator.InvalidArgumentError, match="int64"):
                self.acc.apply_grad(sent, local_step=step)
            self._unchanged(before)
            return
        if not _fits(self.declared, shape):
            # checked on the client against the declared shape, stale or not (spec 2.2)
            with pytest.raises(
                accumulator.InvalidArgumentError,
                match=rf"^Shape mismatch: expected {_re(format_shape(self.declared))}, "
                rf"got {_re(format_shape(shape))}$",
            ):
                self.acc.apply_grad(sent, local_step=step)
            self._unchanged(before)
            return
        if value < self.step:  # stale first: dropped before any check against the round
            assert self.acc.apply_grad(sent, local_step=step) is False
            return
        if self.count > 0 and shape != self.round_shape:
            with pytest.raises(
                accumulator.InvalidArgumentError,
                match=rf"^Shape mismatch: expected {_re(format_shape(self.round_shape))}, "
                rf"got {_re(format_shape(shape))}$",
            ):
                self.acc.apply_grad(sent, local_step=step)
            self._unchanged(before)
            return
        assert self.acc.apply_grad(sent, local_step=step) is True
        self.total = _sum(self.total, grad)
        self.round_shape = shape
        self.count += 1

    def _check_result(self, result: Any) -> None:
        assert self.total is not None
        expected = self.total
        if self.reduction == "MEAN":
            expected = expected_mean(np.asarray(self.total), self.count, self.dtype)
        assert isinstance(result, np.ndarray)
        assert result.dtype == self.dtype
        assert result.shape == self.round_shape
        np.testing.assert_array_equal(result, expected, strict=True)


#: Large payloads (over the inline limit): parts, spread over slots.
SPREAD_CONFIGS = {
    (4100, 2): [(4100, 2), (4100, 2), (2, 4100)],
    None: [(8200,), (8201,), (8200,)],
}


class DenseSpreadMachine(DenseMachine):
    """The same model, with gradients large enough to travel as parts, spread over slots."""

    configs = SPREAD_CONFIGS

    def _open(self, dtype: np.dtype, shape: Any, reduction: str, name: str) -> Any:
        return accumulator.ConditionalAccumulator(
            dtype, shape, name, reduction_type=reduction, client=self.target.client(),
            spread_parts=True,
        )  # fmt: skip

    def _draw_grad(self, data: st.DataObject, shape: tuple[int, ...]) -> np.ndarray:
        # a drawn pattern, repeated: every element still comes from it, in a few draws
        pattern = data.draw(hnp.arrays(self.dtype, (16,), elements=elements(self.dtype)), "g")
        return np.resize(pattern, shape)

    @initialize(
        dtype=st.sampled_from(DTYPES),
        shape=st.sampled_from(list(SPREAD_CONFIGS)),
        reduction=st.sampled_from(["MEAN", "SUM"]),
    )
    def start(self, dtype: np.dtype, shape: Any, reduction: str) -> None:
        self._start(dtype, shape, reduction)


def _re(text: str) -> str:
    import re

    return re.escape(text)


# -- sparse -----------------------------------------------------------------------------------

SPARSE_CONFIGS = {
    # declared shape -> values inner shapes to try
    (6, 2): [(2,), (2,), (2,), (3,), ()],
    None: [(2,), (3,), (), (2, 2)],
    (None, 2): [(2,), (2,), (3,), (2, 2)],
}


class SparseMachine(_Machine):
    kind = "sparse"

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, tuple[np.ndarray, int]] = {}  # index -> (sum, contributions)
        self.round_inner: tuple[int, ...] | None = None

    def _open(self, dtype: np.dtype, shape: Any, reduction: str, name: str) -> Any:
        return accumulator.SparseConditionalAccumulator(
            dtype, shape, name, reduction_type=reduction, client=self.target.client()
        )

    @initialize(
        dtype=st.sampled_from(DTYPES),
        shape=st.sampled_from(list(SPARSE_CONFIGS)),
        reduction=st.sampled_from(["MEAN", "SUM"]),
    )
    def start(self, dtype: np.dtype, shape: Any, reduction: str) -> None:
        self._start(dtype, shape, reduction)

    def _forget_round(self) -> None:
        self.rows, self.round_inner = {}, None

    def _first_error(self, inner: tuple[int, ...]) -> str | None:
        """The spec's check 6 for a round's first gradient (declared dims 1..)."""
        declared = self.declared
        if not declared:
            return None
        if 1 + len(inner) < len(declared):
            return f"expected values rank at least {len(declared)}, got {1 + len(inner)}"
        for i in range(1, len(declared)):
            if declared[i] is not None and declared[i] != inner[i - 1]:
                return f"expected values dim {i} to be {declared[i]}, got {inner[i - 1]}"
        return None

    @precondition(lambda self: self.acc is not None)
    @rule(data=st.data())
    def apply_fresh(self, data: st.DataObject) -> None:
        """Most likely accepted: a current or future step, indices in range, the round's
        values shape."""
        self._apply(data, fresh=True)

    @precondition(lambda self: self.acc is not None)
    @rule(data=st.data())
    def apply_any(self, data: st.DataObject) -> None:
        self._apply(data, fresh=False)

    def _apply(self, data: st.DataObject, fresh: bool) -> None:
        inners = SPARSE_CONFIGS[self.declared]
        if fresh and self.round_inner is not None:
            inners = [self.round_inner]
        elif fresh:
            inners = [i for i in inners if self._first_error(i) is None]
        inner = data.draw(st.sampled_from(inners), label="inner")
        dim0 = self.declared[0] if self.declared else None
        in_range = st.integers(0, 5)
        index = in_range if fresh else st.one_of(in_range, in_range, st.sampled_from([-1, 6, 7]))
        indices = data.draw(st.lists(index, max_size=5), label="indices")  # dups, unsorted
        values = data.draw(
            hnp.arrays(self.dtype, (len(indices), *inner), elements=elements(self.dtype)),
            label="values",
        )
        grad_shape = None
        if self.declared is not None and data.draw(st.booleans(), label="grad_shape given"):
            shapes = [[6, 2], [6, 2, 9]] if fresh else [[6, 2], [6, 2, 9], [5, 2], [6]]
            grad_shape = data.draw(st.sampled_from(shapes), label="grad_shape")
        step, value = self._apply_step(data, fresh)
        before = redis_snapshot(self.r)

        def call() -> Any:
            return self.acc.apply_grad(indices, values, grad_shape, local_step=step)

        if not INT64_MIN <= value <= INT64_MAX:
            with pytest.raises(accumulator.InvalidArgumentError, match="int64"):
                call()
            self._unchanged(before)
            return
        if value < self.step:  # stale first: dropped before any validation (spec 6)
            assert call() is False
            return
        error = self._sparse_error(indices, inner, grad_shape, dim0)
        if error is not None:
            with pytest.raises(accumulator.InvalidArgumentError, match=error):
                call()
            self._unchanged(before)
            return
        assert call() is True
        self.count += 1
        self.round_inner = inner
        # coalesce: duplicates summed in order of appearance, one contribution per row
        merged: dict[int, np.ndarray] = {}
        for i, idx in enumerate(indices):
            merged[idx] = _sum(merged.get(idx), values[i])
        for idx, row in merged.items():
            old = self.rows.get(idx)
            self.rows[idx] = (row, 1) if old is None else (_sum(old[0], row), old[1] + 1)

    def _sparse_error(
        self, indices: list[int], inner: tuple[int, ...], grad_shape: Any, dim0: int | None
    ) -> str | None:
        """The regex of the error a non-stale gradient must raise, or None if accepted."""
        if grad_shape is not None and self.declared is not None:
            if len(grad_shape) < len(self.declared):
                return "^Shape mismatch: expected shape rank at least"
            for i, d in enumerate(self.declared):
                if d is not None and d != grad_shape[i]:
                    return f"^Shape mismatch: expected shape dim {i} to be {d}, got"
        for i, idx in enumerate(indices):
            if idx < 0:
                return f"^Shape mismatch: index of slice {i} is negative: {idx}$"
            if dim0 is not None and idx >= dim0:
                return (
                    f"^Shape mismatch: index of slice {i} exceeded limits of shape; "
                    f"index is {idx} exceeded {dim0}$"
                )
        if self.count == 0:
            first = self._first_error(inner)
            return None if first is None else f"^Shape mismatch: {first}$"
        if inner != self.round_inner:
            return "^Shape mismatch: expected values (rank|dim)"
        return None

    def _check_result(self, result: Any) -> None:
        indices, values, shape = result
        inner = self.round_inner
        assert inner is not None
        order = sorted(self.rows)
        want_values = np.empty((len(order), *inner), dtype=self.dtype)
        for i, idx in enumerate(order):
            total, n = self.rows[idx]
            want_values[i] = (
                expected_mean(np.asarray(total), n, self.dtype)
                if self.reduction == "MEAN"
                else total
            )
        np.testing.assert_array_equal(indices, np.array(order, dtype=np.int64), strict=True)
        np.testing.assert_array_equal(values, want_values, strict=True)
        dim0 = -1 if not self.declared or self.declared[0] is None else self.declared[0]
        np.testing.assert_array_equal(shape, np.array([dim0, *inner], dtype=np.int64), strict=True)


# -- the tests --------------------------------------------------------------------------------


def _run(machine: type[_Machine], target: Any, examples: int | None = None) -> None:
    bound = type(machine.__name__, (machine,), {"target": target})
    chosen = SETTINGS if examples is None else settings(SETTINGS, max_examples=examples)
    run_state_machine_as_test(bound, settings=chosen)


def test_dense_accumulator_follows_the_model(target):
    _run(DenseMachine, target)


def test_dense_spread_accumulator_follows_the_model(target):
    """Large gradients spread over slots: every step of the model, every refusal leaving
    Redis unchanged (the parts and the orphans zset included)."""
    _run(DenseSpreadMachine, target, examples=20)


def test_sparse_accumulator_follows_the_model(target):
    _run(SparseMachine, target)
