"""TensorFlow's SparseConditionalAccumulator test cases, ported to our API.

The cases follow ``tensorflow/python/kernel_tests/data_structures/
sparse_conditional_accumulator_test.py`` (one test here per TF test, named after it) plus the
spec's section 6/7 additions: per-row MEAN, empty gradients, every validation case with TF's
exact text and its order, stale-before-validate, the returned-shape rule, coalescing of
unsorted/duplicate indices, negative indices, the extended dtypes, IndexedSlices in and out,
and dense/sparse never aliasing. Every test takes ``target``: it runs on fakeredis and on a
real redis-server.

Where TF runs ops in a session we call methods directly; where TF starts threads against one
session we start threads against one accumulator object or against several objects opened on
the same ``shared_name`` (another host). Expected results are computed by a small reference
merge written here, independently of the library.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest
from _helpers import (
    Taker,
    expected_mean,
    nan_bits,
    rejected,
    start_taker,
    state,
    wait_until,
    waiting_takers,
)

import accumulator
from accumulator import (
    CancelledError,
    ConditionalAccumulator,
    DeadlineExceededError,
    IndexedSlices,
    InvalidArgumentError,
    SparseConditionalAccumulator,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
TF_FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
INTS = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                              np.uint8, np.uint16, np.uint32, np.uint64)]  # fmt: skip
#: Upper bound for anything that should happen "promptly" in a blocking test.
PROMPT = 5.0


# -- helpers ---------------------------------------------------------------------------------


def make(target: Any, dtype: Any = np.float32, shape: Any = None, shared_name: str | None = "Q",
         **kwargs: Any) -> SparseConditionalAccumulator:  # fmt: skip
    """A sparse accumulator on the test's backend; a second call with the same
    ``shared_name`` opens the same accumulator through a fresh client (another host)."""
    return SparseConditionalAccumulator(dtype, shape=shape, shared_name=shared_name,
                                        client=target.client(), **kwargs)  # fmt: skip


def slices_of(dense: Any) -> tuple[list[int], np.ndarray, tuple[int, ...]]:
    """(indices, values, dense_shape) of the rows of ``dense`` that are not all zero."""
    dense = np.asarray(dense)
    nonzero = dense.reshape(dense.shape[0], -1).any(axis=1)
    indices = np.flatnonzero(nonzero)
    return indices.tolist(), dense[indices], dense.shape


def expected_merge(grads: list[tuple[Any, Any]], dtype: Any,
                   reduction: str = "MEAN") -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The spec's sparse arithmetic, row by row in plain Python: within a gradient duplicate
    indices are summed and count once; across gradients a row's first contribution is copied
    and later ones added in apply order (rounded to ``dtype``); MEAN divides each row by its
    own contribution count. Returns sorted indices and the rows."""
    dtype = np.dtype(dtype)
    rows: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    inner: tuple[int, ...] = ()
    for idx, vals in grads:
        vals = np.array(vals, dtype=dtype)
        inner = vals.shape[1:]
        local: dict[int, np.ndarray] = {}
        for i, v in zip(np.asarray(idx, dtype=np.int64).tolist(), vals, strict=True):
            v = np.array(v, dtype=dtype).reshape((1, *inner))  # arrays: integer sums wrap
            local[i] = v if i not in local else (local[i] + v).astype(dtype)
        for i, v in local.items():
            if i in rows:
                rows[i] = (rows[i] + v).astype(dtype)
                counts[i] += 1
            else:
                rows[i] = v
                counts[i] = 1
    keys = sorted(rows)
    if not keys:
        return np.empty((0,), np.int64), np.empty((0, *inner), dtype)
    out = []
    for i in keys:
        row = rows[i]
        out.append(expected_mean(row, counts[i], dtype) if reduction == "MEAN" else row)
    return np.array(keys, dtype=np.int64), np.concatenate(out).astype(dtype)


def assert_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.tobytes() == expected.tobytes(), (actual, expected)


def assert_taken(result: Any, indices: Any, values: Any, shape: Any,
                 dtype: Any = np.float32) -> None:  # fmt: skip
    """A take's (indices, values, shape): int64 indices, values bit-equal in ``dtype``."""
    if isinstance(result, IndexedSlices):
        result = (result.indices, result.values, result.dense_shape)
    got_indices, got_values, got_shape = result
    assert_bits(got_indices, np.asarray(indices, dtype=np.int64).reshape(-1))
    assert_bits(got_values, np.asarray(values).astype(dtype))
    assert_bits(got_shape, np.asarray(shape, dtype=np.int64))


# -- construction ----------------------------------------------------------------------------


def test_constructor(target):
    # TF: testConstructor
    acc = SparseConditionalAccumulator(np.float32, name="Q", client=target.client())
    assert acc.dtype == np.dtype(np.float32)
    assert acc.shape is None  # unknown rank
    assert acc.name == "Q"
    assert acc.shared_name is None and acc.container == ""
    assert acc.reduction_type == "MEAN"
    assert isinstance(acc.accumulator_ref, str)
    default = make(target, shared_name="D")
    assert default.name == "sparse_conditional_accumulator"
    assert default.shared_name == "D"
    assert isinstance(acc, accumulator.AccumulatorBase)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((1, 5, 2, 8), (1, 5, 2, 8)),
        ([2, None], (2, None)),
        ([-1, 2], (None, 2)),
        ((), ()),
        (None, None),
        (7, (7,)),
    ],
)
def test_constructor_with_shape(target, shape, expected):
    # TF: testConstructorWithShape
    assert make(target, shape=shape).shape == expected


def test_constructor_with_invalid_arg(target):
    # TF: testConstructorWithInvalidArg, testAccumulatorTakeGradInvalidReductionType
    with pytest.raises(ValueError, match="Invalid"):
        make(target, reduction_type="Invalid")
    with pytest.raises(InvalidArgumentError):
        make(target, reduction_type="mean")  # exactly TF's spellings
    with pytest.raises(InvalidArgumentError, match="dtype"):
        make(target, dtype=np.bool_)
    with pytest.raises(InvalidArgumentError):
        make(target, shape=(2, -3))


def test_reopen_with_another_definition_is_refused(target):
    make(target, shape=[None, 2], shared_name="S")
    with pytest.raises(InvalidArgumentError) as err:
        make(target, shape=[None, 3], shared_name="S")
    assert "sparse float32 [?,2] MEAN" in str(err.value)
    assert "sparse float32 [?,3] MEAN" in str(err.value)
    with pytest.raises(InvalidArgumentError, match="float64"):
        make(target, dtype=np.float64, shape=[None, 2], shared_name="S")
    with pytest.raises(InvalidArgumentError, match="SUM"):
        make(target, shape=[None, 2], shared_name="S", reduction_type="SUM")
    # the same definition spelled differently opens fine
    assert make(target, dtype="float32", shape=(-1, 2), shared_name="S").num_accumulated() == 0


@pytest.mark.parametrize("first", ["dense", "sparse"])
def test_dense_and_sparse_do_not_alias(target, first):
    dense = lambda: ConditionalAccumulator(  # noqa: E731
        np.float32, shape=(2,), shared_name="X", client=target.client()
    )
    sparse = lambda: make(target, shape=(2,), shared_name="X")  # noqa: E731
    opener, other = (dense, sparse) if first == "dense" else (sparse, dense)
    acc = opener()
    with pytest.raises(InvalidArgumentError) as err:
        other()
    assert "dense float32 [2] MEAN" in str(err.value)
    assert "sparse float32 [2] MEAN" in str(err.value)
    assert state(acc) == (0, 0)  # the existing one is untouched and still works
    if first == "dense":
        assert acc.apply_grad(np.ones(2, np.float32))
        assert_bits(acc.take_grad(1), np.ones(2, np.float32))
    else:
        assert acc.apply_grad([1], [3.0])
        assert_taken(acc.take_grad(1), [1], [3.0], [2])
    # another container is another namespace: the other kind is fine there
    if first == "dense":
        SparseConditionalAccumulator(np.float32, shape=(2,), shared_name="X",
                                     client=target.client(), container="c")  # fmt: skip
    else:
        ConditionalAccumulator(np.float32, shape=(2,), shared_name="X",
                               client=target.client(), container="c")  # fmt: skip


def test_accumulator_size_empty(target):
    # TF: testAccumulatorSizeEmpty
    assert make(target).num_accumulated() == 0


def test_accumulator_set_global_step(target):
    # TF: testAccumulatorSetGlobalStep
    acc = make(target, shape=(1,))
    acc.set_global_step(1)
    assert state(acc) == (0, 1)


def test_accumulator_apply_grad_float32(target):
    # TF: testAccumulatorApplyGradFloat32
    acc = make(target, shape=(3, 3))
    grad = IndexedSlices(indices=[0, 2], values=np.array([[0, 0, 1], [3, 0, 4]], np.float32))
    assert acc.apply_indexed_slices_grad(grad) is True
    assert acc.num_accumulated() == 1


# -- dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TF_FLOATS, ids=str)
def test_dtypes(target, dtype):
    # TF: testDtypes
    i = TF_FLOATS.index(dtype)
    acc = make(target, dtype, shape=(3, 3, 3))
    total = np.zeros((3, 3, 3), dtype)
    for e in range(2):
        grad = np.zeros((3, 3, 3), dtype)
        grad[i, i, i] = e + 1
        total += grad
        indices, values, dense_shape = slices_of(grad)
        assert acc.apply_indexed_slices_grad(IndexedSlices(values, indices, dense_shape))
    indices, values, _ = slices_of(total / dtype.type(2))
    assert_taken(acc.take_grad(1), indices, values, [3, 3, 3], dtype)


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
@pytest.mark.parametrize("dtype", TF_FLOATS, ids=str)
def test_dtypes_bit_exact(target, dtype, reduction):
    """Random overlapping sorted-unique gradients: rounding of every addition and of the
    per-row division must be the dtype's, in apply order."""
    rng = np.random.default_rng(zlib.crc32(f"{dtype.name}-{reduction}".encode()))
    acc = make(target, dtype, shape=(40, 3), reduction_type=reduction)
    for round_ in range(2):
        grads = []
        for _ in range(7):
            indices = np.sort(rng.choice(40, size=rng.integers(0, 15), replace=False))
            values = rng.standard_normal((len(indices), 3)) * 10.0 ** rng.integers(-3, 4)
            values = values.astype(dtype)
            if len(indices):
                values[0, 0] = -0.0
            grads.append((indices, values))
            assert acc.apply_grad(indices, values, local_step=round_)
        expected_indices, expected_values = expected_merge(grads, dtype, reduction)
        assert_taken(acc.take_grad(len(grads)), expected_indices, expected_values, [40, 3],
                     dtype)  # fmt: skip


def test_negative_zero_survives(target):
    """A row's first contribution is copied, not added to zeros."""
    acc = make(target, np.float32, shape=(4,), reduction_type="SUM")
    acc.apply_grad([0], np.array([-0.0], np.float32))
    acc.apply_grad([1], np.array([-0.0], np.float32))  # first seen in a later gradient
    indices, values, _ = acc.take_grad(2)
    assert indices.tolist() == [0, 1]
    assert np.signbit(values).all()


def test_extended_dtypes_bfloat16_and_complex(target):
    grads = [([0, 1], [[1.0, 2.0], [1.5, 0.0]]), ([0], [[2.0, 3.0]])]
    bf = make(target, BF16, shape=(2, 2), shared_name="bf")
    for idx, vals in grads:
        assert bf.apply_grad(idx, np.array(vals, dtype=BF16))
    indices, values = expected_merge(grads, BF16)
    assert_taken(bf.take_grad(2), indices, values, [2, 2], BF16)
    assert values.astype(np.float32).tolist() == [[1.5, 2.5], [1.5, 0.0]]

    for ctype in (np.complex64, np.complex128):
        acc = make(target, ctype, shape=(3,), shared_name=f"c-{np.dtype(ctype).name}")
        acc.apply_grad([0, 2], np.array([1 + 2j, 5j], ctype))
        acc.apply_grad([0], np.array([3 - 4j], ctype))
        assert_taken(acc.take_grad(2), [0, 2], np.array([2 - 1j, 5j], ctype), [3], ctype)


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_integer_dtypes(target, dtype, reduction):
    info = np.iinfo(dtype)
    big = info.max - 1  # sums wrap like C
    grads = [([0, 3], [[7, big], [5, 1]]), ([0], [[2, big]]), ([], np.zeros((0, 2), dtype))]
    if info.min < 0:
        grads.append(([1], [[-7, info.min]]))
        grads.append(([1], [[0, -1]]))
    acc = make(target, dtype, shape=(4, 2), reduction_type=reduction)
    for idx, vals in grads:
        assert acc.apply_grad(idx, np.array(vals, dtype=dtype))
    indices, values = expected_merge(grads, dtype, reduction)
    assert_taken(acc.take_grad(len(grads)), indices, values, [4, 2], dtype)
    if reduction == "MEAN":
        assert values[0, 0] == 4  # (7 + 2) / 2 truncated, row 0 in 2 of the gradients
        assert values[-1, 0] == 5  # row 3 in 1 gradient: unchanged
        if info.min < 0:
            assert values[1, 0] == -3  # C division: -7 / 2 == -3


def test_integer_accumulator_refuses_floats_and_float_refuses_complex(target):
    ints = make(target, np.int32, shape=(2,), shared_name="i")
    rejected(ints, lambda: ints.apply_grad([0], np.array([1.5])))
    assert ints.apply_grad([0], np.array([3], np.int64))  # int64 into int32: same kind
    floats = make(target, np.float32, shape=(2,), shared_name="f")
    rejected(floats, lambda: floats.apply_grad([0], np.array([1 + 1j])))
    assert floats.apply_grad([1], np.array([0.1], np.float64))  # float64 into float32
    assert_taken(floats.take_grad(1), [1], [np.float32(0.1)], [2])


def test_accumulator_multiple_accumulators(target):
    # TF: testAccumulatorMultipleAccumulators: four private accumulators all named "Q"
    accs = [
        SparseConditionalAccumulator(dtype, shape=(2, 2), name="Q", client=target.client())
        for dtype in (np.float16, np.float16, np.float32, np.float32)
    ]
    elems = [[[1, 0], [0, 0]], [[0, 1], [0, 0]], [[0, 0], [1, 0]], [[0, 0], [0, 1]]]
    for acc, elem in zip(accs, elems, strict=True):
        indices, values, dense_shape = slices_of(np.array(elem, acc.dtype))
        assert acc.apply_grad(indices, values, dense_shape)
    for acc, elem in zip(accs, elems, strict=True):
        indices, values, _ = slices_of(np.array(elem, acc.dtype))
        assert_taken(acc.take_grad(1), indices, values, [2, 2], acc.dtype)


# -- take: MEAN, SUM, per-row counts, empty gradients -----------------------------------------


@pytest.mark.parametrize(
    ("reduction", "values"),
    [("MEAN", [[0.5, 0.5], [0, 2], [3, 0]]), ("SUM", [[1, 1], [0, 2], [3, 0]])],
)
def test_accumulator_take_grad(target, reduction, values):
    # TF: testAccumulatorTakeGradMean, testAccumulatorTakeGradSum
    acc = make(target, shape=(), reduction_type=reduction)
    grad = IndexedSlices(indices=[0, 1], values=np.array([[1, 0], [0, 2]], np.float32))
    assert acc.apply_indexed_slices_grad(grad)
    assert acc.apply_grad([0, 2], np.array([[0, 1], [3, 0]], np.float32), [3, 2])
    result = acc.take_indexed_slices_grad(1)
    assert isinstance(result, IndexedSlices)
    assert_taken((result.indices, result.values, result.dense_shape), [0, 1, 2], values,
                 [-1, 2])  # fmt: skip


def test_mean_divides_each_row_by_its_own_count(target):
    acc = make(target, shape=(5, 2))
    assert acc.apply_grad([0, 1], [[3.0, 6.0], [1.0, 1.0]])
    assert acc.apply_grad([1, 4], [[2.0, 4.0], [9.0, 9.0]])
    assert acc.apply_grad([1], [[3.0, 1.0]])
    # row 0 and row 4 are in 1 of 3 gradients: unchanged; row 1 in 3: divided by 3
    assert_taken(acc.take_grad(3), [0, 1, 4], [[3, 6], [2, 2], [9, 9]], [5, 2])


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
def test_empty_gradients_count_but_do_not_dilute(target, reduction):
    acc = make(target, shape=(4, 2), reduction_type=reduction)
    assert acc.apply_grad([], np.zeros((0, 2), np.float32))
    assert acc.apply_grad([1], [[2.0, 4.0]])
    assert acc.apply_indexed_slices_grad(IndexedSlices(np.zeros((0, 2)), np.zeros(0, np.int64)))
    assert acc.num_accumulated() == 3
    taker = start_taker(target, make(target, shape=(4, 2), reduction_type=reduction), 4)
    time.sleep(0.1)
    assert taker.is_alive()  # three gradients, empty ones included, are not four
    assert acc.apply_grad([], np.zeros((0, 2)))
    assert_taken(taker.finish(), [1], [[2.0, 4.0]], [4, 2])
    # a round of empty gradients only
    assert acc.apply_grad([], np.zeros((0, 2)), local_step=1)
    assert acc.apply_grad(np.array([], np.int32), np.zeros((0, 2)), local_step=1)
    assert_taken(acc.take_grad(2), np.zeros(0), np.zeros((0, 2)), [4, 2])


def test_empty_gradient_with_unknown_shape(target):
    acc = make(target, shape=None)
    assert acc.apply_grad([], np.zeros((0, 3)))
    assert_taken(acc.take_grad(1), np.zeros(0), np.zeros((0, 3)), [-1, 3])


@pytest.mark.parametrize(
    ("reduction", "first", "second"),
    [("MEAN", [[0.5, 0.5], [0, 2], [3, 0]], [[5, 5], [0, 20], [30, 0]]),
     ("SUM", [[1, 1], [0, 2], [3, 0]], [[10, 10], [0, 20], [30, 0]])],
)  # fmt: skip
def test_accumulator_repeated_take_grad(target, reduction, first, second):
    # TF: testAccumulatorRepeatedTakeGrad(Mean|Sum)
    acc = make(target, shape=(), reduction_type=reduction)
    acc.apply_indexed_slices_grad(IndexedSlices(np.array([[1, 0], [0, 2]], np.float32), [0, 1]),
                                  local_step=0)  # fmt: skip
    acc.apply_grad([0, 2], np.array([[0, 1], [3, 0]], np.float32), [3, 2], local_step=0)
    assert_taken(acc.take_indexed_slices_grad(1), [0, 1, 2], first, [-1, 2])
    assert state(acc) == (0, 1)
    acc.apply_indexed_slices_grad(
        IndexedSlices(np.array([[10, 0], [0, 20]], np.float32), [0, 1]), local_step=1
    )
    acc.apply_grad([0, 2], np.array([[0, 10], [30, 0]], np.float32), [3, 2], local_step=1)
    assert_taken(acc.take_indexed_slices_grad(1), [0, 1, 2], second, [-1, 2])
    assert state(acc) == (0, 2)


def test_take_returns_fresh_writable_arrays(target):
    acc = make(target, shape=(3, 2), reduction_type="SUM")
    acc.apply_grad([1], [[1.0, 2.0]])
    indices, values, shape = acc.take_grad(1)
    for arr in (indices, values, shape):
        assert arr.flags.writeable
    values[0, 0] = 99.0
    acc.apply_grad([1], [[1.0, 2.0]], local_step=1)
    assert_taken(acc.take_grad(1), [1], [[1.0, 2.0]], [3, 2])


def test_take_grad_result_type(target):
    acc = make(target, np.float64, shape=(3, 2))
    acc.apply_grad(np.array([2], np.uint8), [[1.0, 2.0]])
    result = acc.take_grad(1)
    assert isinstance(result, accumulator.SparseGradient) and isinstance(result, tuple)
    assert result.indices.dtype == np.int64 and result.shape.dtype == np.int64
    assert result.values.dtype == np.float64
    assert (result.indices.tolist(), result.shape.tolist()) == ([2], [3, 2])


def test_accumulator_invalid_take_grad(target):
    acc = make(target, shape=(2,))
    acc.apply_grad([0], [1.0])
    err = rejected(acc, lambda: acc.take_grad(0))
    assert str(err) == "Argument num_required must be positive, but was 0"
    err = rejected(acc, lambda: acc.take_indexed_slices_grad(-1))
    assert str(err) == "Argument num_required must be positive, but was -1"
    rejected(acc, lambda: acc.take_grad([1]))
    assert waiting_takers(target, acc) == 0
    assert_taken(acc.take_grad(1), [0], [1.0], [2])


# -- steps -----------------------------------------------------------------------------------


def test_accumulator_set_global_step_prevents_accumulation(target, caplog):
    acc = make(target, shape=(2,))
    acc.set_global_step(2)
    assert acc.apply_grad([0], [1.0], local_step=1) is False  # stale: dropped silently
    assert acc.apply_grad([1], [5.0], local_step=2) is True
    assert acc.apply_grad([1], [7.0], local_step=9) is True  # future steps are accepted
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        acc.set_global_step(1)  # downwards: warns, never clears
    assert len([r for r in caplog.records if r.name == "accumulator"]) == 1
    assert state(acc) == (2, 1)
    assert_taken(acc.take_grad(2), [1], [6.0], [2])
    assert acc.global_step() == 2


@pytest.mark.parametrize("size", ["inline", "blob"])
def test_two_hosts_share_one_accumulator(target, size):
    rows = 4 if size == "inline" else 600  # 600 x 32 float32 = 75 KiB: its own key
    worker, chief = make(target, shape=(1000, 32)), make(target, shape=(1000, 32))
    rng = np.random.default_rng(0)
    grads = []
    for _ in range(3):
        indices = np.sort(rng.choice(1000, size=rows, replace=False))
        values = rng.standard_normal((rows, 32)).astype(np.float32)
        grads.append((indices, values))
        assert worker.apply_grad(indices, values, [1000, 32])
    assert chief.num_accumulated() == 3
    indices, values = expected_merge(grads, np.float32)
    assert_taken(chief.take_grad(3), indices, values, [1000, 32])
    assert worker.global_step() == 1
    assert worker.apply_grad(*grads[0], local_step=0) is False  # stale for every host now
    assert chief.num_accumulated() == 0


def test_private_accumulators_are_unreachable(target):
    a = SparseConditionalAccumulator(np.float32, shape=(2,), client=target.client())
    b = SparseConditionalAccumulator(np.float32, shape=(2,), client=target.client())
    a.apply_grad([0], [1.0])
    assert (a.num_accumulated(), b.num_accumulated()) == (1, 0)
    a.close()
    with pytest.raises(CancelledError):
        a.num_accumulated()


# -- parallel apply / take, blocking take -----------------------------------------------------


@pytest.mark.parametrize("hosts", ["one object", "object per thread"])
@pytest.mark.parametrize(("reduction", "expected"), [("MEAN", 55.0), ("SUM", 550.0)])
def test_parallel_apply_grad(target, hosts, reduction, expected):
    # TF: testParallelApplyGradMean, testParallelApplyGradSum
    acc = make(target, shape=(2, 2), reduction_type=reduction)
    elems = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
    objects = [
        acc if hosts == "one object" else make(target, shape=(2, 2), reduction_type=reduction)
        for _ in elems
    ]
    results: list[bool] = []
    barrier = threading.Barrier(len(elems))

    def apply(obj: SparseConditionalAccumulator, x: float) -> None:
        barrier.wait(PROMPT)
        indices, values, dense_shape = slices_of(np.array([[x, 0], [0, x]], np.float32))
        results.append(obj.apply_indexed_slices_grad(IndexedSlices(values, indices, dense_shape)))

    threads = [threading.Thread(target=apply, args=(o, x))
               for o, x in zip(objects, elems, strict=True)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROMPT)
    assert results == [True] * len(elems)
    assert acc.num_accumulated() == len(elems)
    assert_taken(acc.take_grad(1), [0, 1], [[expected, 0], [0, expected]], [2, 2])


@pytest.mark.parametrize("hosts", ["one object", "object per thread"])
def test_parallel_take_grad(target, hosts):
    # TF: testParallelTakeGrad: ten takers, gradient e applied at local_step e - 1
    acc = make(target, shape=(2, 2))
    elems = [e + 1 for e in range(10)]
    objects = [acc if hosts == "one object" else make(target, shape=(2, 2)) for _ in elems]
    takers = [Taker(obj, 1, timeout=30) for obj in objects]
    for t in takers:
        t.start()

    def apply() -> None:
        for e in elems:
            wait_until(lambda e=e: acc.global_step() == e - 1)
            indices, values, _ = slices_of(np.array([[0, 0], [e, 0]], np.float32))
            assert acc.apply_grad(indices, values, local_step=e - 1)

    applier = threading.Thread(target=apply)
    applier.start()
    results = [t.finish() for t in takers]
    applier.join(PROMPT)
    for indices, _, shape in results:
        assert indices.tolist() == [1] and shape.tolist() == [2, 2]
    assert sorted(r.values[0].tolist() for r in results) == [[e, 0] for e in elems]
    assert state(acc) == (0, 10)
    assert waiting_takers(target, acc) == 0


def test_parallel_take_grad_is_fifo(target):
    acc = make(target, shape=(2,))
    takers = [start_taker(target, make(target, shape=(2,)), 1) for _ in range(3)]
    for e in range(3):
        assert acc.apply_grad([1], [float(e)], local_step=e)
        wait_until(lambda e=e: acc.global_step() == e + 1)
    assert [t.finish().values.tolist() for t in takers] == [[0.0], [1.0], [2.0]]


class _LateWaiter:
    """A taker's blocking connection that enters every wait late: only once the first round
    was taken, and then after a pause (a descheduled thread, a slow network)."""

    def __init__(self, inner: Any, ready: Callable[[], bool]) -> None:
        self._inner, self._ready, self._late = inner, ready, False

    def _arrive(self) -> None:
        if not self._late:
            wait_until(self._ready)
            time.sleep(0.2)
            self._late = True

    def blpop(self, *args: Any, **kwargs: Any) -> Any:
        self._arrive()
        return self._inner.blpop(*args, **kwargs)

    @property
    def connection_pool(self) -> Any:  # the take's BLPOP takes a connection of it
        self._arrive()
        return self._inner.connection_pool

    def pubsub(self, *args: Any, **kwargs: Any) -> Any:
        self._arrive()
        return self._inner.pubsub(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_new_head_is_woken_by_the_apply(target):
    """Regression (a lost wake-up, fixed in 0d12f50): takers A, B, C in FIFO order; A's take
    makes B the head while B is still on its way into its wait (and C, already waiting,
    reacts to the head change at once). The apply that satisfies B must wake B promptly,
    not after a whole wait slice."""
    acc = make(target, shape=(2,))
    a_obj, b_obj, c_obj = (make(target, shape=(2,)) for _ in range(3))
    for obj in (a_obj, b_obj, c_obj):
        obj.wait_slice = 1.5
    b_obj._conns.blocking = _LateWaiter(b_obj._conns.blocking, lambda: acc.global_step() >= 1)
    a = start_taker(target, a_obj, 1)
    b = start_taker(target, b_obj, 1)
    c = start_taker(target, c_obj, 1)
    time.sleep(0.1)  # C is waiting
    assert acc.apply_grad([0], [1.0])
    assert_taken(a.finish(), [0], [1.0], [2])
    time.sleep(0.4)  # B is in its wait now, as head of the FIFO
    applied_at = time.monotonic()
    assert acc.apply_grad([1], [2.0], local_step=1)
    assert_taken(b.finish(), [1], [2.0], [2])
    assert b.done_at is not None
    late = b.done_at - applied_at
    assert acc.apply_grad([1], [3.0], local_step=2)
    assert_taken(c.finish(), [1], [3.0], [2])
    assert late < 1.0, f"the new head was woken {late:.2f} s after the apply"


def test_accumulator_apply_and_blocking_take(target):
    # TF: testAccumulatorApplyAndBlockingTake
    acc = make(target, shape=(2, 2))
    taker = start_taker(target, make(target, shape=(2, 2)), 3)
    elems = [10.0, 20.0, 30.0]
    for x in elems[:2]:
        indices, values, _ = slices_of(np.array([[0, x], [0, 0]], np.float32))
        assert acc.apply_grad(indices, values, local_step=0)
    time.sleep(0.2)
    assert taker.is_alive()  # 2 < 3: still waiting
    assert acc.num_accumulated() == 2  # a waiting take does not change the count
    indices, values, _ = slices_of(np.array([[0, elems[2]], [0, 0]], np.float32))
    last_apply = time.monotonic()
    assert acc.apply_grad(indices, values, local_step=0)
    assert_taken(taker.finish(), [0], [[0, 20.0]], [2, 2])
    assert taker.done_at is not None and taker.done_at - last_apply < 1.5
    assert state(acc) == (0, 1)


def test_blocking_take_timeout_consumes_nothing(target):
    acc = make(target, shape=(2,))
    acc.apply_grad([1], [4.0])
    with pytest.raises(DeadlineExceededError, match="Timed out waiting for notification"):
        acc.take_grad(2, timeout=0.3)
    with pytest.raises(TimeoutError):
        acc.take_indexed_slices_grad(2, timeout=0)
    assert state(acc) == (1, 0)
    assert waiting_takers(target, acc) == 0
    assert_taken(acc.take_grad(1, timeout=1.0), [1], [4.0], [2])


def test_accumulator_cancel(target):
    # TF: testAccumulatorCancel: closing (TF: the session) cancels a blocked take
    acc = make(target, shape=(1, 2, 3))
    acc.wait_slice = 0.2  # how soon a waiting take notices the close
    taker = start_taker(target, acc, 1, timeout=None)
    acc.close()
    taker.join(PROMPT)
    assert not taker.is_alive()
    assert isinstance(taker.error, CancelledError)
    other = make(target, shape=(1, 2, 3))
    assert state(other) == (0, 0)
    assert waiting_takers(target, other) == 0


# -- validation ------------------------------------------------------------------------------


def f32(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(1, int(np.prod(shape)) + 1, dtype=np.float32).reshape(shape)


class Bad(NamedTuple):
    shape: Any  # declared shape
    indices: Any
    values: Any
    grad_shape: Any
    message: str  # exact text (a regex when ``exact`` is False)
    first: tuple[Any, Any] | None = None  # a gradient that opens the round first
    exact: bool = True


VECTOR = "Input indices should be vector but received shape: "
BAD = {
    # 1. indices must be a vector
    "indices-matrix": Bad((3, 3), [[0, 1], [1, 0]], f32((2,)), None, VECTOR + "[2,2]"),
    "indices-1x1": Bad((3, 3), [[0]], f32((1, 3)), None, VECTOR + "[1,1]"),
    "indices-scalar": Bad((), 0, [1.0], [], VECTOR + "[]"),
    "indices-scalar-no-shape": Bad((), 0, [1.0], None, VECTOR + "[]"),
    # 2. values rank >= 1
    "values-0d": Bad((3, 3), [0], np.float32(1), None, "Values cannot be 0-dimensional."),
    "values-0d-scalar-shape": Bad((), [0], 1.0, [], "Values cannot be 0-dimensional."),
    # 3. as many values as indices
    "fewer-values": Bad((3, 3), [0, 1], f32((1, 3)), None,
                        "Expected 2 non-empty input values, got 1"),
    "more-values": Bad((3, 3), [0], f32((2, 3)), None, "Expected 1 non-empty input values, got 2"),
    "no-values": Bad((3, 3), [0], np.zeros((0, 3)), None,
                     "Expected 1 non-empty input values, got 0"),
    # 4. grad_shape: the declared dims are a prefix of it
    "grad-shape-rank": Bad([2, 2, None], [0], f32((1, 2)), [2, 2],
                           "Shape mismatch: expected shape rank at least 3, got 2"),
    "grad-shape-empty": Bad([2, 2, None], [0], f32((1, 2, 2)), [],
                            "Shape mismatch: expected shape rank at least 3, got 0"),
    "grad-shape-dim1": Bad([2, 2, None], [0], f32((1, 3, 2)), [2, 3, 2],
                           "Shape mismatch: expected shape dim 1 to be 2, got 3"),
    "grad-shape-dim0": Bad([2, 2, None], [0], f32((1, 2, 2)), [3, 2, 2, 9],
                           "Shape mismatch: expected shape dim 0 to be 2, got 3"),
    # 5. index limits (and, ours, no negative index even when dim 0 is unknown)
    "index-limit": Bad([2, 2, None], [3], f32((1, 2, 2)), None,
                       "Shape mismatch: index of slice 0 exceeded limits of shape; "
                       "index is 3 exceeded 2"),
    "index-limit-slice-1": Bad([2, 2, None], [0, 2], f32((2, 2, 2)), None,
                               "Shape mismatch: index of slice 1 exceeded limits of shape; "
                               "index is 2 exceeded 2"),
    "negative": Bad([2, 2, None], [-1], f32((1, 2, 2)), None,
                    "Shape mismatch: index of slice 0 is negative: -1"),
    "negative-unknown-shape": Bad(None, [0, -3], f32((2, 2)), None,
                                  "Shape mismatch: index of slice 1 is negative: -3"),
    "negative-unknown-dim0": Bad([None, 2], [5, -1], f32((2, 2)), None,
                                 "Shape mismatch: index of slice 1 is negative: -1"),
    # 6. values against the declared dims (a round's first gradient)
    "values-rank-declared": Bad([2, 2, None], [0, 1], f32((2, 2)), None,
                                "Shape mismatch: expected values rank at least 3, got 2"),
    "values-dim-declared": Bad([2, 2, None], [0], f32((1, 3, 2)), None,
                               "Shape mismatch: expected values dim 1 to be 2, got 3"),
    "empty-values-rank": Bad([4, 2], [], np.zeros((0,)), None,
                             "Shape mismatch: expected values rank at least 2, got 1"),
    # 6. values against the round's first gradient
    "round-rank": Bad([2, 2, None], [0], f32((1, 2, 2)), None,
                      "Shape mismatch: expected values rank 4, got 3",
                      first=([1], f32((1, 2, 2, 2)))),
    "round-dim": Bad([2, 2, None], [0], f32((1, 2, 2, 3)), None,
                     "Shape mismatch: expected values dim 3 to be 2, got 3",
                     first=([1], f32((1, 2, 2, 2)))),
    "round-rank-unknown-shape": Bad(None, [0], f32((1,)), None,
                                    "Shape mismatch: expected values rank 2, got 1",
                                    first=([1], f32((1, 3)))),
    "round-dim-unknown-shape": Bad(None, [0], f32((1, 4)), None,
                                   "Shape mismatch: expected values dim 1 to be 3, got 4",
                                   first=([1], f32((1, 3)))),
    "round-set-by-empty-gradient": Bad(None, [0], f32((1, 2)), None,
                                       "Shape mismatch: expected values dim 1 to be 3, got 2",
                                       first=([], np.zeros((0, 3)))),
    # the order of the checks: the first failing one is reported
    "order-indices-before-values": Bad((3, 3), [[0]], np.float32(1), None, VECTOR + "[1,1]"),
    "order-0d-before-length": Bad((3, 3), [0, 1], np.float32(1),
                                  None, "Values cannot be 0-dimensional."),
    "order-length-before-grad-shape": Bad([2, 2, None], [0, 1], f32((1, 2, 2)), [1],
                                          "Expected 2 non-empty input values, got 1"),
    "order-grad-shape-before-index": Bad([2, 2, None], [5], f32((1, 2, 2)), [2, 3],
                                         "Shape mismatch: expected shape rank at least 3, got 2"),
    "order-index-before-values": Bad([2, 2, None], [5], f32((1, 3)), None,
                                     "Shape mismatch: index of slice 0 exceeded limits of "
                                     "shape; index is 5 exceeded 2"),
    "order-index-before-round": Bad([2, 2, None], [7], f32((1, 2, 2)), None,
                                    "Shape mismatch: index of slice 0 exceeded limits of "
                                    "shape; index is 7 exceeded 2",
                                    first=([1], f32((1, 2, 2, 2)))),
    # ours: bad input types
    "float-indices": Bad((3,), [0.5], [1.0], None, "ndices", exact=False),
    "complex-values": Bad((3,), [0], np.array([1 + 1j]), None, "complex", exact=False),
    "string-values": Bad((3,), [0], np.array(["a"]), None, ".", exact=False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_invalid_apply(target, case):
    """Every validation case: TF's exact text, nothing changed; the same gradient when stale
    is dropped silently (staleness is checked before any validation)."""
    acc = make(target, shape=case.shape)
    acc.set_global_step(1)
    if case.first is not None:
        assert acc.apply_grad(*case.first, local_step=1)
    before = state(acc)
    assert acc.apply_grad(case.indices, case.values, case.grad_shape, local_step=0) is False
    assert state(acc) == before
    for step in (1, 5):  # current and future steps are validated
        err = rejected(acc, lambda step=step: acc.apply_grad(case.indices, case.values,
                                                             case.grad_shape, step))  # fmt: skip
        if case.exact:
            assert str(err) == case.message
        else:
            assert re.search(case.message, str(err))
    # the same through an IndexedSlices
    grad = IndexedSlices(case.values, case.indices, case.grad_shape)
    assert acc.apply_indexed_slices_grad(grad, local_step=0) is False
    rejected(acc, lambda: acc.apply_indexed_slices_grad(grad, local_step=1))
    # the round is intact: the next take holds exactly the first gradient
    if case.first is not None:
        indices, values = expected_merge([case.first], np.float32)
        result = acc.take_grad(1, timeout=PROMPT)
        assert_bits(result.indices, indices)
        assert_bits(result.values, values)
    else:
        assert acc.num_accumulated() == 0


def test_validate_shape(target):
    # TF: testValidateShape, as one sequence: the round's first gradient adds constraints
    acc = make(target, shape=[2, 2, None])
    msg = lambda call: str(rejected(acc, call))  # noqa: E731
    assert msg(lambda: acc.apply_grad([0], f32((1, 2)), [2, 2])) == (
        "Shape mismatch: expected shape rank at least 3, got 2")  # fmt: skip
    assert msg(lambda: acc.apply_grad([0], f32((1, 3, 2)), [2, 3, 2])) == (
        "Shape mismatch: expected shape dim 1 to be 2, got 3")  # fmt: skip
    assert msg(lambda: acc.apply_grad([3], f32((1, 2, 2)))) == (
        "Shape mismatch: index of slice 0 exceeded limits of shape; index is 3 exceeded 2"
    )
    assert msg(lambda: acc.apply_grad([0, 1], f32((2, 2)))) == (
        "Shape mismatch: expected values rank at least 3, got 2")  # fmt: skip
    assert msg(lambda: acc.apply_grad([0], f32((1, 3, 2)))) == (
        "Shape mismatch: expected values dim 1 to be 2, got 3")  # fmt: skip
    # the first accepted gradient constrains the round to values [?,2,2,2]
    assert acc.apply_grad([0], f32((1, 2, 2, 2)))
    assert msg(lambda: acc.apply_grad([0], f32((1, 2, 2)))) == (
        "Shape mismatch: expected values rank 4, got 3")  # fmt: skip
    assert msg(lambda: acc.apply_grad([0], f32((1, 2, 2, 3)))) == (
        "Shape mismatch: expected values dim 3 to be 2, got 3")  # fmt: skip
    assert acc.apply_grad([1], f32((1, 2, 2, 2)) * 2)  # a matching one is fine
    acc.take_grad(1)
    # a take forgets the round's constraints; the next first gradient sets new ones
    assert acc.apply_grad([0], f32((1, 2, 2, 3)), local_step=1)
    assert msg(lambda: acc.apply_grad([0], f32((1, 2, 2, 2)), local_step=1)) == (
        "Shape mismatch: expected values dim 3 to be 3, got 2")  # fmt: skip


def test_grad_shape_extra_trailing_dims_and_unknown_dims_are_ignored(target):
    acc = make(target, shape=[2, 2, None], reduction_type="SUM")
    assert acc.apply_grad([0], f32((1, 2, 2)), [2, 2, 99])  # unknown declared dim: anything
    assert acc.apply_grad([1], f32((1, 2, 2)), [2, 2, 2, 5, 7])  # extra trailing dims
    assert acc.apply_grad([1], f32((1, 2, 2)), np.array([2, 2, 2], np.int32))
    assert acc.apply_grad([0], f32((1, 2, 2)), None)  # no grad_shape: nothing to check
    indices, values, shape = acc.take_grad(4)
    assert indices.tolist() == [0, 1] and shape.tolist() == [2, 2, 2]
    # no declared shape: any grad_shape is fine
    free = make(target, shape=None, shared_name="free")
    assert free.apply_grad([0], [1.0], [])
    assert free.apply_grad([3], [1.0], [1])  # grad_shape is not checked against the indices


def test_empty_shape_apply(target):
    # TF: testEmptyShapeApply
    acc = make(target, shape=())
    assert str(rejected(acc, lambda: acc.apply_grad(0, [1.0], []))).startswith(VECTOR)
    assert str(rejected(acc, lambda: acc.apply_grad(0, [1.0]))).startswith(VECTOR)
    assert str(rejected(acc, lambda: acc.apply_grad([0], 1.0, []))) == (
        "Values cannot be 0-dimensional.")  # fmt: skip
    assert str(rejected(acc, lambda: acc.apply_grad([0], 1.0))) == (
        "Values cannot be 0-dimensional.")  # fmt: skip
    # the right way to apply a scalar
    assert acc.apply_grad([0], [1.0], [])
    assert acc.apply_grad([0], [1.0])
    assert_taken(acc.take_grad(2), [0], [1.0], [-1])


def test_dynamic_wrong_inputs(target):
    # TF: testNonVectorIndices, testZeroDimensionValues, testWrongNonEmptyInputValues and
    # their Dynamic* variants (fed at run time: for us there is no difference)
    acc = make(target, shape=(3, 3))
    assert str(rejected(acc, lambda: acc.apply_grad([[0, 1], [1, 0]], [1.0, 2.0]))).startswith(
        VECTOR)  # fmt: skip
    assert "Values cannot be 0-dimensional." in str(rejected(acc, lambda: acc.apply_grad([0], 1)))
    assert " non-empty input values, got " in str(
        rejected(acc, lambda: acc.apply_grad([0, 1], [[0, 1, 1]])))  # fmt: skip


def test_stale_round_mismatch_is_dropped_silently(target):
    """A stale gradient that differs from the round's shape, or that would break the declared
    shape as a first gradient, returns False: the stale check comes first, also in Redis."""
    acc = make(target, shape=[4, 2])
    acc.set_global_step(3)
    assert acc.apply_grad([0], f32((1, 5)), local_step=2) is False  # count 0: declared check
    assert acc.apply_grad([0], f32((1, 2)), local_step=3)
    assert acc.apply_grad([1], f32((1, 2, 2)), local_step=0) is False  # round mismatch
    assert state(acc) == (1, 3)
    other = make(target, shape=[4, 2])  # another host with a stale view of nothing
    assert other.apply_grad([9], f32((1, 2)), local_step=1) is False  # index beyond dim 0
    assert_taken(acc.take_grad(1), [0], f32((1, 2)), [4, 2])


def test_stale_values_out_of_range_are_dropped_not_refused(target):
    """Our own checks (a value a cast would make inf, the payload limit) come after the stale
    check too: TF drops a stale gradient whatever it holds."""
    acc = make(target, shape=[4, 2])
    acc.set_global_step(3)
    huge = np.full((1, 2), 1e40)
    assert acc.apply_grad([0], huge, local_step=0) is False
    assert state(acc) == (0, 3)
    err = rejected(acc, lambda: acc.apply_grad([0], huge, local_step=3))
    assert "would become inf" in str(err)


@pytest.mark.parametrize(("declared", "grad_shape"), [
    ([None, 2], [-5, 2]),  # an unknown declared dim is not compared
    ([4, 2], [4, 2, -3]),  # extra dims are ignored, whatever they hold
    ([], [-7]),
    ([4, 2], [[4, 2]]),  # read flat, as TF reads a tensor
])  # fmt: skip
def test_grad_shape_is_compared_where_declared_only(target, declared, grad_shape):
    acc = make(target, shape=declared)
    values = f32((1, 2)) if declared else f32((1,))
    assert acc.apply_grad([0], values, grad_shape=grad_shape)
    assert acc.num_accumulated() == 1


@pytest.mark.parametrize("width", [1, 17, 1001])
@pytest.mark.parametrize("dtype", TF_FLOATS)
def test_of_two_nans_in_a_row_the_later_gradients_comes_out(target, dtype, width):
    """TF adds a gradient to the row (grad + accum): of two NaNs, the later one's sign and
    payload come out in every column, as TF 2.21 gives them (checked side by side: float32
    0xffc00006 from 0x7fc00005 then 0xffc00006). numpy's add keeps its first operand's NaN
    in its SIMD body and the second's in its scalar tail: rows of 17 and 1001 had both."""
    acc = make(target, dtype=dtype, shape=[4, width], reduction_type="SUM")
    first, later = (np.full((1, width), nan_bits(dtype, sign, payload), dtype)
                    for sign, payload in ((0, 5), (1, 6)))  # fmt: skip
    acc.apply_grad([1], first)
    acc.apply_grad([1], later)
    assert acc.take_grad(2).values.tobytes() == later.tobytes()


# -- returned shape ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("declared", "values_shape", "grad_shape", "expected"),
    [
        (None, (1, 3), None, [-1, 3]),
        (None, (1, 3), [100, 3], [-1, 3]),
        ((), (1,), [], [-1]),
        ((), (1, 2), [3, 2], [-1, 2]),
        ([2, None], (1, 2, 2, 2), None, [2, 2, 2, 2]),
        ([None, 2], (1, 2, 2, 3), None, [-1, 2, 2, 3]),
        ([5], (1,), None, [5]),
        ([5], (1, 4), [5, 9], [5, 4]),
        ([5, 3], (1, 3), [5, 3, 7, 7], [5, 3]),
        ([5, None], (1, 6), [5, 1], [5, 6]),
    ],
)
def test_return_shape(target, declared, values_shape, grad_shape, expected):
    # TF: testReturnShape, plus: grad_shape never influences the returned shape
    acc = make(target, shape=declared)
    assert acc.apply_grad([0], f32(values_shape), grad_shape)
    result = acc.take_indexed_slices_grad(1)
    assert_bits(result.dense_shape, np.array(expected, np.int64))
    assert result.values.shape == values_shape


def test_apply_grad_int32_indices_and_shape(target):
    # TF: testApplyGradtInt32IndicesAndShape
    acc = make(target, shape=(3, 3))
    values = np.array([[0, 0, 1], [3, 0, 4]], np.float32)
    assert acc.apply_grad(np.array([0, 2], np.int32), values, np.array([3, 3], np.int32))
    assert acc.apply_indexed_slices_grad(
        IndexedSlices(values, np.array([0, 2], np.int32), np.array([3, 3], np.int32))
    )
    assert acc.num_accumulated() == 2
    assert_taken(acc.take_indexed_slices_grad(1), [0, 2], values, [3, 3])


# -- coalescing (ours) -------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
def test_unsorted_and_duplicate_indices_are_coalesced(target, reduction):
    acc = make(target, shape=(10, 2), reduction_type=reduction)
    # duplicates within one gradient are summed and count as one contribution to the row
    assert acc.apply_grad([3, 1, 3], [[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]])
    assert acc.apply_grad([3], [[1.0, 1.0]])
    assert acc.apply_grad([9, 0, 5], [[9.0, 9.0], [7.0, 0.0], [5.0, 5.0]])  # unsorted
    row3 = [3.0, 3.0] if reduction == "MEAN" else [6.0, 6.0]
    expected = [[7.0, 0.0], [2.0, 2.0], row3, [5.0, 5.0], [9.0, 9.0]]
    result = acc.take_grad(3)
    assert_taken(result, [0, 1, 3, 5, 9], expected, [10, 2])
    assert (np.diff(result.indices) > 0).all()


def test_coalescing_matches_the_reference(target):
    rng = np.random.default_rng(7)
    acc = make(target, np.float64, shape=(30, 2))
    grads = []
    for _ in range(6):
        n = int(rng.integers(0, 25))
        indices = rng.integers(0, 30, size=n)  # unsorted, with duplicates
        values = rng.standard_normal((n, 2))
        grads.append((indices, values))
        assert acc.apply_grad(indices, values)
    expected_indices, expected_values = expected_merge(grads, np.float64)
    assert_taken(acc.take_grad(6), expected_indices, expected_values, [30, 2], np.float64)


def test_callers_arrays_are_not_modified(target):
    acc = make(target, shape=(5, 1))
    indices = np.array([4, 0, 4])
    values = np.array([[1.0], [2.0], [3.0]], np.float32)
    acc.apply_grad(indices, values)
    assert indices.tolist() == [4, 0, 4] and values.tolist() == [[1.0], [2.0], [3.0]]


# -- IndexedSlices in and out ------------------------------------------------------------------


def test_indexed_slices_type():
    s = IndexedSlices(np.ones((1, 2)), [0])
    assert s.dense_shape is None
    # by identity, as TF's (a field-wise == of arrays raised on Python 3.13)
    assert s == s and s != IndexedSlices(values=s.values, indices=[0], dense_shape=None)
    assert {s: 1}[s] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.indices = [1]  # type: ignore[misc]


def test_apply_indexed_slices_grad_duck_typed(target):
    class TFLike:  # what TF's IndexedSlices (or anything alike) offers
        def __init__(self, values, indices, dense_shape):
            self.values, self.indices, self.dense_shape = values, indices, dense_shape

    class AsArray:  # values that only offer __array__ (torch, jax)
        def __init__(self, arr):
            self.arr = arr

        def __array__(self, dtype=None, copy=None):
            return self.arr if dtype is None else self.arr.astype(dtype)

    acc = make(target, shape=(4, 2), reduction_type="SUM")
    assert acc.apply_indexed_slices_grad(TFLike([[1.0, 2.0]], [3], [4, 2]))
    assert acc.apply_indexed_slices_grad(TFLike(AsArray(np.array([[1.0, 1.0]])), [3], None))
    err = rejected(acc, lambda: acc.apply_indexed_slices_grad(TFLike([[1.0, 2.0]], [0], [5, 2])))
    assert str(err) == "Shape mismatch: expected shape dim 0 to be 4, got 5"
    assert_taken(acc.take_indexed_slices_grad(2), [3], [[2.0, 3.0]], [4, 2])


def test_take_indexed_slices_grad_roundtrip(target):
    acc = make(target, shape=(6, 2))
    assert acc.apply_grad([1, 4], [[1.0, 2.0], [3.0, 4.0]])
    out = acc.take_indexed_slices_grad(1)
    assert isinstance(out, IndexedSlices)
    assert out.indices.dtype == np.int64 and out.dense_shape.dtype == np.int64
    # what a take returns can be applied again as it is
    assert acc.apply_indexed_slices_grad(out, local_step=1)
    assert_taken(acc.take_grad(1), [1, 4], [[1.0, 2.0], [3.0, 4.0]], [6, 2])
