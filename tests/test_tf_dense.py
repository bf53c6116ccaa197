"""TensorFlow's own dense ConditionalAccumulator test cases, ported to our API.

The cases follow ``tensorflow/python/kernel_tests/data_structures/conditional_accumulator_test.py``
(one test here per TF test, named after it, plus the spec's additions: partial/scalar shapes,
the extended dtypes, exact error texts, state left unchanged by rejected calls, FIFO takers).
Every test takes ``target``, so it runs on fakeredis and on a real redis-server.

Where TF's test runs ops in a session, we call the methods directly; where TF starts threads
against one session, we start threads against one accumulator object or against several
objects opened on the same ``shared_name`` (another host). Blocking tests use short sleeps and
timeouts so that a hang fails fast instead of stalling the suite.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from typing import Any

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
    InvalidArgumentError,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
TF_FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
INTS = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                              np.uint8, np.uint16, np.uint32, np.uint64)]  # fmt: skip
STEP_WARNING = (
    "Attempt to set current_global_step_ to smaller value: "
    "current_global_step_ = {old} >= {new} = new_global_step."
)
#: Upper bound for anything that should happen "promptly" in a blocking test.
PROMPT = 5.0
#: A waiting take's own deadline in tests: several rounds may pass before it is served, and on
#: fakeredis a change of head taker is sometimes noticed only after one wait slice (2 s).
TAKE_DEADLINE = 20.0


# -- helpers ---------------------------------------------------------------------------------


def make(target: Any, dtype: Any = np.float32, shape: Any = (1,), shared_name: str = "Q",
         **kwargs: Any) -> ConditionalAccumulator:  # fmt: skip
    """An accumulator on the test's backend; a second call with the same ``shared_name``
    opens the same accumulator through a fresh client (like another host would)."""
    return ConditionalAccumulator(dtype, shape=shape, shared_name=shared_name,
                                  client=target.client(), **kwargs)  # fmt: skip


def expected_reduce(grads: list[Any], dtype: np.dtype, reduction: str = "MEAN") -> np.ndarray:
    """The spec's arithmetic, written independently of the library: ``acc = g1``, then
    ``acc = acc + g`` rounded to ``dtype`` in apply order, then ``acc / dtype(n)`` (C integer
    division for integers, component-wise for complex)."""
    arrays = [np.asarray(g).astype(dtype) for g in grads]
    acc = arrays[0].copy()
    for g in arrays[1:]:
        acc = (acc + g).astype(dtype)
    if reduction == "SUM":
        return acc
    return expected_mean(acc, len(arrays), dtype)


def assert_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.tobytes() == expected.tobytes(), (actual, expected)


# -- construction ----------------------------------------------------------------------------


def test_constructor_with_invalid_arg(target):
    # TF: testConstructorWithInvalidArg, testAccumulatorTakeGradInvalidReductionType
    with pytest.raises(ValueError, match="Invalid"):
        make(target, reduction_type="Invalid")
    with pytest.raises(InvalidArgumentError):
        make(target, reduction_type="mean")  # TF accepts exactly "MEAN" and "SUM"
    assert target.redis().keys("*") == []  # nothing was created


def test_construction_properties(target):
    acc = make(target, np.float32, shape=[3, 2], shared_name="layer1/w", name="Q")
    assert acc.dtype == np.dtype(np.float32)
    assert isinstance(acc.dtype, np.dtype)
    assert acc.shape == (3, 2)
    assert acc.name == "Q"
    assert acc.shared_name == "layer1/w"
    assert acc.reduction_type == "MEAN"
    assert isinstance(acc.accumulator_ref, str) and acc.accumulator_ref
    default = make(target, np.float64, shape=None, shared_name="other", reduction_type="SUM")
    assert default.name == "conditional_accumulator"
    assert default.shape is None
    assert default.reduction_type == "SUM"
    assert default.accumulator_ref != acc.accumulator_ref
    # the same shared_name from another host is the same accumulator
    again = make(target, np.float32, shape=(3, 2), shared_name="layer1/w")
    assert again.accumulator_ref == acc.accumulator_ref


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((1,), (1,)), ([3, 2], (3, 2)), ([None, 2], (None, 2)), ((-1, 2), (None, 2)),
     (None, None), ((), ())],
)  # fmt: skip
def test_construction_shapes(target, shape, expected):
    assert make(target, shape=shape).shape == expected


def test_construction_dtype_spellings(target):
    class FakeTFDType:  # anything with .as_numpy_dtype, like a tf.DType
        name = "float64"
        as_numpy_dtype = np.float64

    spellings = [np.float64, np.dtype("float64"), "float64", FakeTFDType()]
    for i, spelling in enumerate(spellings):
        acc = make(target, spelling, shared_name=f"d{i}")
        assert acc.dtype == np.dtype(np.float64)
        acc.apply_grad(np.array([0.1]))
        assert_bits(acc.take_grad(1), np.array([0.1]))
    assert make(target, "bfloat16", shared_name="bf").dtype == BF16
    with pytest.raises(InvalidArgumentError):
        make(target, np.bool_, shared_name="b")
    with pytest.raises(InvalidArgumentError):
        make(target, "string", shared_name="s")


def test_reopen_with_another_definition_is_refused(target):
    acc = make(target, np.float32, shape=(3, 2))
    acc.apply_grad(np.ones((3, 2)))
    for kwargs in ({"dtype": np.float64}, {"shape": (2, 3)}, {"reduction_type": "SUM"}):
        opts: dict[str, Any] = {"dtype": np.float32, "shape": (3, 2), **kwargs}
        with pytest.raises(InvalidArgumentError) as info:
            make(target, **opts)
        message = str(info.value)
        assert "float32 [3,2] MEAN" in message  # names both definitions
        assert "float64" in message or "[2,3]" in message or "SUM" in message
    assert state(acc) == (1, 0)


# -- sizes -----------------------------------------------------------------------------------


def test_accumulator_size_empty(target):
    # TF: testAccumulatorSizeEmpty
    acc = make(target, shape=None)
    assert acc.num_accumulated() == 0
    assert acc.global_step() == 0


def test_accumulator_set_global_step(target):
    # TF: testAccumulatorSetGlobalStep
    acc = make(target)
    assert acc.set_global_step(1) is None
    assert acc.global_step() == 1
    assert make(target).global_step() == 1  # visible from another host


def test_accumulator_apply_grad_float32(target):
    # TF: testAccumulatorApplyGradFloat32
    acc = make(target)
    assert acc.apply_grad((10.0,)) is True
    assert acc.num_accumulated() == 1


def test_accumulator_size_after_apply_grad(target):
    # TF: testAccumulatorSizeAfterApplyGrad
    acc = make(target)
    assert acc.num_accumulated() == 0
    acc.apply_grad((10.0,))
    assert acc.num_accumulated() == 1
    acc.apply_grad((10.0,))
    assert acc.num_accumulated() == 2
    assert make(target).num_accumulated() == 2


def test_accumulator_size_after_apply_grad_and_take_grad(target):
    # TF: testAccumulatorSizeAfterApplyGradAndTakeGrad
    acc = make(target)
    assert acc.num_accumulated() == 0
    acc.apply_grad((10.0,))
    assert acc.num_accumulated() == 1
    acc.apply_grad((10.0,))
    assert acc.num_accumulated() == 2
    acc.take_grad(2)
    assert acc.num_accumulated() == 0
    for _ in range(4):
        assert acc.apply_grad((10.0,), local_step=1)
    assert acc.num_accumulated() == 4
    assert_bits(acc.take_grad(2), np.array([10.0], np.float32))
    assert acc.num_accumulated() == 0
    assert acc.global_step() == 2


def test_accumulator_multiple_accumulators(target):
    # TF: testAccumulatorMultipleAccumulators: same *name*, independent accumulators
    accs = [
        ConditionalAccumulator(dtype, shape=(1,), name="Q", client=target.client())
        for dtype in (np.float16, np.float16, np.float32, np.float32)
    ]
    for i, acc in enumerate(accs):
        acc.apply_grad((i + 10.0,))
    for i, acc in enumerate(accs):
        assert acc.num_accumulated() == 1
        assert acc.name == "Q" and acc.shared_name is None
        assert_bits(acc.take_grad(1), np.array([i + 10.0], acc.dtype))
    named = [make(target, shared_name=f"S{i}", name="Q") for i in range(2)]
    named[0].apply_grad((1.0,))
    assert [a.num_accumulated() for a in named] == [1, 0]


# -- shapes ----------------------------------------------------------------------------------

ELEMS = [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]]]
ELEMS_MEAN = np.array([[5.5, 11.0], [16.5, 22.0], [27.5, 33.0]], np.float32)


def test_accumulator_apply_and_take_grad_with_shape(target):
    # TF: testAccumulatorApplyAndTakeGradWithShape
    acc = make(target, shape=(3, 2))
    for x in ELEMS:
        assert acc.apply_grad(x)
    assert_bits(acc.take_grad(1), ELEMS_MEAN)


def test_accumulator_apply_grad_with_wrong_shape(target):
    # TF: testAccumulatorApplyGradWithWrongShape
    acc = make(target, shape=(3, 2))
    acc.apply_grad(np.full((3, 2), 7.0))
    err = rejected(acc, lambda: acc.apply_grad([[1.0, 2.0], [3.0, 4.0]]))
    assert str(err) == "Shape mismatch: expected [3,2], got [2,2]"
    err = rejected(acc, lambda: acc.apply_grad([[1.0], [2.0], [3.0]]))
    assert str(err) == "Shape mismatch: expected [3,2], got [3,1]"
    assert_bits(acc.take_grad(1), np.full((3, 2), 7.0, np.float32))


def test_accumulator_dynamic_shape(target):
    # TF: testAccumulatorDynamicShape
    acc = make(target, shape=None)
    for x in ELEMS:
        assert acc.apply_grad(x)
    assert_bits(acc.take_grad(1), ELEMS_MEAN)


def test_accumulator_wrong_dynamic_shape(target):
    # TF: testAccumulatorWrongDynamicShape: the first accepted gradient fixes the round shape
    acc = make(target, shape=None)
    acc.apply_grad(np.array(ELEMS[0]))
    err = rejected(acc, lambda: acc.apply_grad([[1.0, 2.0], [3.0, 4.0]]))
    assert str(err) == "Shape mismatch: expected [3,2], got [2,2]"
    err = rejected(acc, lambda: acc.apply_grad([[1.0], [2.0], [3.0]]))
    assert str(err) == "Shape mismatch: expected [3,2], got [3,1]"
    # another host sees the same round shape
    other = make(target, shape=None)
    err = rejected(other, lambda: other.apply_grad(np.zeros((2, 3, 1))))
    assert str(err) == "Shape mismatch: expected [3,2], got [2,3,1]"
    assert_bits(acc.take_grad(1), np.array(ELEMS[0], np.float32))
    # a take forgets the round shape: any shape may start the next round
    assert acc.apply_grad([[1.0, 2.0], [3.0, 4.0]], local_step=1)
    assert acc.apply_grad([[3.0, 4.0], [5.0, 6.0]], local_step=1)
    assert_bits(acc.take_grad(2), np.array([[2.0, 3.0], [4.0, 5.0]], np.float32))


def test_partial_shape(target):
    acc = make(target, shape=[None, 2], reduction_type="SUM")
    assert acc.apply_grad(np.ones((3, 2)))
    err = rejected(acc, lambda: acc.apply_grad(np.ones((3, 3))))
    assert str(err) == "Shape mismatch: expected [?,2], got [3,3]"
    err = rejected(acc, lambda: acc.apply_grad(np.ones((4, 2))))
    assert str(err) == "Shape mismatch: expected [3,2], got [4,2]"
    err = rejected(acc, lambda: acc.apply_grad(np.ones(2)))
    assert str(err) == "Shape mismatch: expected [?,2], got [2]"
    assert acc.apply_grad(np.full((3, 2), 2.0))
    assert_bits(acc.take_grad(2), np.full((3, 2), 3.0, np.float32))
    # next round: another first dim
    assert acc.apply_grad(np.ones((1, 2)), local_step=1)
    err = rejected(acc, lambda: acc.apply_grad(np.ones((3, 2)), local_step=1))
    assert str(err) == "Shape mismatch: expected [1,2], got [3,2]"
    assert_bits(acc.take_grad(1), np.ones((1, 2), np.float32))


def test_scalar_shape(target):
    acc = make(target, shape=())
    assert acc.apply_grad(2.0)
    assert acc.apply_grad(np.float32(3.0))
    err = rejected(acc, lambda: acc.apply_grad([1.0]))
    assert str(err) == "Shape mismatch: expected [], got [1]"
    err = rejected(acc, lambda: acc.apply_grad(np.ones((1, 1))))
    assert str(err) == "Shape mismatch: expected [], got [1,1]"
    out = acc.take_grad(2)
    assert_bits(out, np.array(2.5, np.float32))
    assert out.shape == ()


def test_scalar_gradients_keep_rank_0(target):
    acc = make(target, shape=None)
    assert acc.apply_grad(np.float32(4.0))
    err = rejected(acc, lambda: acc.apply_grad([4.0]))
    assert str(err) == "Shape mismatch: expected [], got [1]"
    assert acc.apply_grad(5)
    assert_bits(acc.take_grad(1), np.array(4.5, np.float32))


def test_scalar_shape_mismatch_message(target):
    acc = make(target, shape=(3, 2))
    err = rejected(acc, lambda: acc.apply_grad(1.0))
    assert str(err) == "Shape mismatch: expected [3,2], got []"


def test_unknown_shape_accepts_any_rank(target):
    acc = make(target, shape=None, reduction_type="SUM")
    for step, shape in enumerate([(), (4,), (2, 0), (1, 2, 3), (1,)]):
        grad = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        assert acc.apply_grad(grad, local_step=step)
        assert acc.apply_grad(grad, local_step=step)
        assert_bits(acc.take_grad(2), grad + grad)  # (numpy < 2: a 0-d grad * 2 is float64)


# -- dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TF_FLOATS, ids=lambda d: d.name)
def test_dtypes(target, dtype):
    # TF: testDtypes: ten single-element gradients, one take, their mean
    acc = make(target, dtype)
    elems = np.arange(10).astype(dtype)
    for e in elems:
        assert acc.apply_grad((e,))
    out = acc.take_grad(1)
    assert_bits(out, np.array([4.5], dtype))
    assert_bits(out, expected_reduce([[e] for e in elems], dtype))


def _random_grads(rng: np.random.Generator, dtype: np.dtype, n: int,
                  shape: tuple[int, ...]) -> list[np.ndarray]:  # fmt: skip
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return [rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
                for _ in range(n)]  # fmt: skip

    def real() -> np.ndarray:
        # mixed magnitudes, so that the rounding of every addition matters
        return rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)

    if dtype.kind == "c":
        return [(real() + 1j * real()).astype(dtype) for _ in range(n)]
    return [real().astype(dtype) for _ in range(n)]


ALL_DTYPES = [*TF_FLOATS, BF16, np.dtype(np.complex64), np.dtype(np.complex128), *INTS]


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_dtypes_bit_exact(target, dtype, reduction):
    rng = np.random.default_rng(zlib.crc32(f"{dtype.name}/{reduction}".encode()))
    acc = make(target, dtype, shape=(4, 5), reduction_type=reduction)
    other = make(target, dtype, shape=(4, 5), reduction_type=reduction)  # another host
    for round_ in range(2):
        grads = _random_grads(rng, dtype, 7, (4, 5))
        for i, g in enumerate(grads):
            assert (acc if i % 2 else other).apply_grad(g, local_step=round_)
        out = acc.take_grad(7)
        assert_bits(out, expected_reduce(grads, dtype, reduction))


def test_apply_order_matters_bitwise(target):
    # float16 sums are order dependent; the result must follow apply order exactly
    dtype = np.dtype(np.float16)
    grads = [np.array([2048.0], dtype), np.array([1.0], dtype), np.array([1.0], dtype)]
    forward, backward = expected_reduce(grads, dtype, "SUM"), expected_reduce(
        grads[::-1], dtype, "SUM")  # fmt: skip
    assert forward.tobytes() != backward.tobytes()  # 2048 vs 2050
    acc = make(target, dtype, reduction_type="SUM")
    for g in grads:
        acc.apply_grad(g)
    assert_bits(acc.take_grad(3), forward)
    for g in grads[::-1]:
        acc.apply_grad(g, local_step=1)
    assert_bits(acc.take_grad(3), backward)


@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [1, 17, 1001, 40001])
@pytest.mark.parametrize("dtype", TF_FLOATS, ids=lambda d: d.name)
def test_of_two_nans_the_earlier_gradients_comes_out(target, dtype, n, reduction):
    """TF's dense accumulator adds ``accum + grad``: of two NaNs the sum's (the earlier
    gradient's) comes out, sign and payload, in every element (TF 2.21, checked side by side:
    float32 0x7fc00005 from 0x7fc00005, 0xffc00006, 1). numpy kept its first operand's in its
    SIMD body and the second's in its scalar tail, and the module's -O3 build the later
    one's everywhere for float64 (40001 elements: a payload in parts, summed in Redis)."""
    acc = make(target, dtype, shape=(n,), reduction_type=reduction)
    first, later = (np.full(n, nan_bits(dtype, sign, payload), dtype)
                    for sign, payload in ((0, 5), (1, 6)))  # fmt: skip
    for g in (first, later, np.ones(n, dtype)):
        assert acc.apply_grad(g)
    assert_bits(acc.take_grad(3), first)


def test_negative_zero_survives(target):
    acc = make(target, np.float32, shape=(2,), reduction_type="SUM")
    acc.apply_grad(np.array([-0.0, -0.0], np.float32))
    assert_bits(acc.take_grad(1), np.array([-0.0, -0.0], np.float32))
    acc.apply_grad(np.array([-0.0, 1.0], np.float32), local_step=1)
    acc.apply_grad(np.array([-0.0, 1.0], np.float32), local_step=1)
    assert_bits(acc.take_grad(2), np.array([-0.0, 2.0], np.float32))


@pytest.mark.parametrize(
    ("dtype", "grads", "reduction", "expected"),
    [
        (np.int8, [[-7], [0]], "MEAN", [-3]),  # truncation toward zero, not floor (-4)
        (np.int32, [[7], [0]], "MEAN", [3]),
        (np.int64, [[-5], [-5], [0]], "MEAN", [-3]),
        (np.int8, [[100], [100]], "SUM", [-56]),  # wraps like C
        (np.int8, [[100], [100]], "MEAN", [-28]),  # wrapped sum, then divided
        (np.uint8, [[200], [100]], "SUM", [44]),
        (np.uint64, [[2**64 - 1], [2]], "SUM", [1]),
        (np.uint64, [[2**64 - 1], [2**64 - 1]], "MEAN", [2**63 - 1]),
        (np.int64, [[-(2**63)], [-1]], "SUM", [2**63 - 1]),
        (np.int16, [[-1], [-1], [-1], [2]], "MEAN", [0]),
    ],
)
def test_integer_dtypes(target, dtype, grads, reduction, expected):
    acc = make(target, dtype, reduction_type=reduction)
    for g in grads:
        assert acc.apply_grad(np.array(g, dtype))
    assert_bits(acc.take_grad(len(grads)), np.array(expected, dtype))


def test_complex_mean_divides_each_part(target):
    acc = make(target, np.complex64, shape=(2,))
    acc.apply_grad(np.array([1 + 3j, complex(-0.0, -7.0)], np.complex64))
    acc.apply_grad(np.array([2 - 1j, complex(-0.0, 0.0)], np.complex64))
    out = acc.take_grad(2)
    assert_bits(out, np.array([1.5 + 1j, complex(-0.0, -3.5)], np.complex64))
    assert np.signbit(out.real[1])


def test_input_conversion(target):
    acc = make(target, np.float32, shape=(2,), reduction_type="SUM")

    class ArrayLike:
        def __array__(self, dtype=None, copy=None):
            return np.array([0.25, 0.5])

    assert acc.apply_grad([1, 2])  # ints into float: same kind is fine
    assert acc.apply_grad(np.array([0.1, 0.2], np.float64))  # float64 into float32: fine
    assert acc.apply_grad(ArrayLike())
    expected = expected_reduce([[1, 2], np.array([0.1, 0.2]), [0.25, 0.5]], acc.dtype, "SUM")
    assert_bits(acc.take_grad(3), expected)


# -- mean, sum, repeated takes ---------------------------------------------------------------


@pytest.mark.parametrize(("reduction", "value"), [("MEAN", 15.0), ("SUM", 30.0)])
def test_accumulator_take_grad(target, reduction, value):
    # TF: testAccumulatorTakeGradMean, testAccumulatorTakeGradSum: take(1) with 2 gradients
    # returns the mean over the 2 actually accumulated (not over num_required)
    acc = make(target, reduction_type=reduction)
    for x in (10.0, 20.0):
        acc.apply_grad((x,), local_step=0)
    assert_bits(acc.take_grad(1), np.array([value], np.float32))
    for x in (10.0, 20.0):
        acc.apply_grad((x,), local_step=1)
    # num_required given as a 0-d array (TF: constant_op.constant(1))
    assert_bits(acc.take_grad(np.array(1, np.int32)), np.array([value], np.float32))
    assert state(acc) == (0, 2)


@pytest.mark.parametrize(("reduction", "values"), [("MEAN", [15.0, 25.0]), ("SUM", [30.0, 50.0])])
def test_accumulator_repeated_take_grad(target, reduction, values):
    # TF: testAccumulatorRepeatedTakeGradMean, testAccumulatorRepeatedTakeGradSum
    acc = make(target, reduction_type=reduction)
    taker = make(target, reduction_type=reduction)  # the chief may be another host
    for step, elems in enumerate([(10.0, 20.0), (20.0, 30.0)]):
        for x in elems:
            assert acc.apply_grad((x,), local_step=step)
        assert_bits(taker.take_grad(1), np.array([values[step]], np.float32))
        assert state(acc) == (0, step + 1)


def test_take_returns_a_fresh_writable_array(target):
    acc = make(target, shape=(2,))
    acc.apply_grad(np.array([1.0, 2.0]))
    out = acc.take_grad(1)
    out += 1  # must not raise (read-only buffer) nor affect anything else
    acc.apply_grad(np.array([1.0, 2.0]), local_step=1)
    assert_bits(acc.take_grad(1), np.array([1.0, 2.0], np.float32))


# -- global step -----------------------------------------------------------------------------


def test_accumulator_increment_global_step(target, caplog):
    # TF: testAccumulatorIncrementGlobalStep
    acc = make(target)
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        for step in range(1, 4):
            acc.set_global_step(step)
            assert acc.global_step() == step
        acc.set_global_step(3)  # equal: no warning either
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_accumulator_set_global_step_prevents_accumulation(target, caplog):
    # TF: testAccumulatorSetGlobalStepPreventsAccumulation
    acc = make(target)
    local_steps = range(1000, 1005)
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        for ls in local_steps:
            acc.set_global_step(ls)
            accepted = [acc.apply_grad((0.0 + x,), local_step=x) for x in local_steps]
            assert accepted == [x >= ls for x in local_steps]
            assert acc.num_accumulated() == sum(accepted)
            kept = [x for x in local_steps if x >= ls]
            assert_bits(acc.take_grad(1), expected_reduce([[x] for x in kept], acc.dtype))
            assert acc.global_step() == ls + 1
    assert caplog.records == []


def test_stale_check_uses_greater_or_equal(target):
    acc = make(target, reduction_type="SUM")
    acc.set_global_step(3)
    assert acc.apply_grad((1.0,), local_step=3) is True  # equal: accepted
    assert acc.apply_grad((2.0,), local_step=2) is False  # behind: dropped
    assert acc.apply_grad((4.0,), local_step=100) is True  # future: accepted
    assert state(acc) == (2, 3)  # a future local_step does not move the global step
    assert_bits(acc.take_grad(2), np.array([5.0], np.float32))
    assert acc.global_step() == 4
    # applies still made at the old step after the take are now stale
    assert acc.apply_grad((8.0,), local_step=3) is False
    assert state(acc) == (0, 4)


def test_stale_dropped_before_validation(target):
    acc = make(target, shape=[None, 2])
    acc.apply_grad(np.ones((3, 2)), local_step=0)
    acc.set_global_step(5)
    # differs from the round shape [3,2], but stale: dropped silently, no error
    assert acc.apply_grad(np.ones((4, 2)), local_step=4) is False
    unknown = make(target, shape=None, shared_name="U")
    unknown.apply_grad(np.ones((3, 2)), local_step=0)
    unknown.set_global_step(1)
    assert unknown.apply_grad(np.ones((7,)), local_step=0) is False
    assert unknown.apply_grad(np.ones(()), local_step=0) is False
    assert state(unknown) == (1, 1)
    # not stale: validated
    err = rejected(unknown, lambda: unknown.apply_grad(np.ones((7,)), local_step=1))
    assert str(err) == "Shape mismatch: expected [3,2], got [7]"
    assert state(acc) == (1, 5)


def test_stale_values_out_of_range_are_dropped_not_refused(target):
    acc = make(target, shape=[2])
    acc.set_global_step(3)
    huge = np.full(2, 1e40)
    assert acc.apply_grad(huge, local_step=0) is False
    assert state(acc) == (0, 3)
    err = rejected(acc, lambda: acc.apply_grad(huge, local_step=3))
    assert "would become inf" in str(err)
    # the declared shape is checked stale or not, as TF's Python layer checks it
    with pytest.raises(InvalidArgumentError, match="Shape mismatch"):
        acc.apply_grad(np.ones(3), local_step=0)


def test_set_global_step_downwards_warns_and_never_clears(target, caplog):
    acc = make(target, reduction_type="MEAN")
    acc.set_global_step(5)
    assert acc.apply_grad((1.0,), local_step=5)
    assert acc.apply_grad((2.0,), local_step=5)
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        acc.set_global_step(2)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == [STEP_WARNING.format(old=5, new=2)]
    assert warnings[0].levelno == logging.WARNING
    assert state(acc) == (2, 2)  # set downwards, nothing cleared
    assert acc.apply_grad((3.0,), local_step=2)  # accepted again at the lower step
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        acc.set_global_step(10)  # upwards: no warning, and still nothing cleared
    assert caplog.records == []
    assert state(acc) == (3, 10)
    # the kept gradients are in the next take although their local_steps are now stale
    assert_bits(acc.take_grad(3), np.array([2.0], np.float32))
    assert acc.global_step() == 11


def test_set_global_step_downwards_from_another_host(target, caplog):
    acc = make(target)
    acc.set_global_step(7)
    other = make(target)
    with caplog.at_level(logging.WARNING, logger="accumulator"):
        other.set_global_step(1)
    assert [r.getMessage() for r in caplog.records] == [STEP_WARNING.format(old=7, new=1)]
    assert acc.global_step() == 1


# -- invalid inputs --------------------------------------------------------------------------


def test_accumulator_invalid_take_grad(target):
    # TF: testAccumulatorInvalidTakeGrad
    acc = make(target)
    for x in (10.0, 20.0):
        acc.apply_grad((x,))
    err = rejected(acc, lambda: acc.take_grad(-1))
    assert str(err) == "Argument num_required must be positive, but was -1"
    err = rejected(acc, lambda: acc.take_grad(0))
    assert str(err) == "Argument num_required must be positive, but was 0"
    rejected(acc, lambda: acc.take_grad([1]))  # not a scalar
    rejected(acc, lambda: acc.take_grad(1.5))  # not an integer
    assert waiting_takers(target, acc) == 0
    assert_bits(acc.take_grad(2), np.array([15.0], np.float32))


def test_invalid_apply_leaves_state_unchanged(target):
    acc = make(target, np.float32, shape=(2,), reduction_type="SUM")
    acc.set_global_step(1)
    acc.apply_grad(np.array([1.0, 2.0]), local_step=1)
    rejected(acc, lambda: acc.apply_grad(np.array([1 + 1j, 2]), local_step=1))
    rejected(acc, lambda: acc.apply_grad(np.array([1 + 0j, 2 + 0j]), local_step=1))
    rejected(acc, lambda: acc.apply_grad(np.array(["a", "b"]), local_step=1))
    rejected(acc, lambda: acc.apply_grad(np.array([1.0, 2.0]), local_step=[1]))
    rejected(acc, lambda: acc.apply_grad(np.array([1.0, 2.0]), local_step=np.ones((1, 1), int)))
    rejected(acc, lambda: acc.apply_grad(np.array([1.0, 2.0]), local_step=1.5))
    err = rejected(acc, lambda: acc.apply_grad(np.ones(3), local_step=1))
    assert str(err) == "Shape mismatch: expected [2], got [3]"
    assert state(acc) == (1, 1)
    assert_bits(acc.take_grad(1), np.array([1.0, 2.0], np.float32))


def test_integer_accumulator_refuses_floats(target):
    acc = make(target, np.int32, shape=(1,), reduction_type="SUM")
    rejected(acc, lambda: acc.apply_grad(np.array([1.5])))
    assert acc.apply_grad(np.array([3], np.int64))  # int64 into int32: same kind
    assert_bits(acc.take_grad(1), np.array([3], np.int32))


# -- parallel apply / take -------------------------------------------------------------------


@pytest.mark.parametrize("hosts", ["one object", "object per thread"])
def test_parallel_apply_grad(target, hosts):
    # TF: testParallelApplyGrad
    acc = make(target)
    elems = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
    objects = [acc if hosts == "one object" else make(target) for _ in elems]
    results: list[bool] = []
    barrier = threading.Barrier(len(elems))

    def apply(obj: ConditionalAccumulator, x: float) -> None:
        barrier.wait(PROMPT)
        results.append(obj.apply_grad((x,), local_step=0))

    threads = [
        threading.Thread(target=apply, args=(o, x)) for o, x in zip(objects, elems, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROMPT)
    assert results == [True] * len(elems)
    assert acc.num_accumulated() == len(elems)
    assert_bits(acc.take_grad(1), np.array([55.0], np.float32))


def test_parallel_take_grad(target):
    # TF: testParallelTakeGrad: ten takers, gradients applied one step at a time
    acc = make(target)
    elems = list(range(10))
    takers = [Taker(acc, 1, TAKE_DEADLINE) for _ in elems]
    for t in takers:
        t.start()

    def apply() -> None:
        for e in elems:
            wait_until(lambda e=e: acc.global_step() == e)
            assert acc.apply_grad((np.float32(e),), local_step=e)

    applier = threading.Thread(target=apply)
    applier.start()
    results = [float(t.finish()[0]) for t in takers]
    applier.join(TAKE_DEADLINE)
    assert sorted(results) == [float(e) for e in elems]
    assert state(acc) == (0, 10)
    assert waiting_takers(target, acc) == 0


def test_parallel_take_grad_is_fifo(target):
    acc = make(target)
    hosts = [make(target) for _ in range(4)]  # each taker on its own "host"
    takers = [start_taker(target, h, 1, timeout=TAKE_DEADLINE) for h in hosts]
    assert waiting_takers(target, acc) == 4
    for e in range(4):
        assert acc.apply_grad((float(e),), local_step=e)
        wait_until(lambda e=e: acc.global_step() == e + 1)
    assert [float(t.finish()[0]) for t in takers] == [0.0, 1.0, 2.0, 3.0]


def test_head_of_line_blocking(target):
    acc = make(target)
    first = start_taker(target, make(target), 3, timeout=TAKE_DEADLINE)
    second = start_taker(target, make(target), 1, timeout=TAKE_DEADLINE)
    assert acc.apply_grad((1.0,))
    time.sleep(0.3)
    # one gradient would satisfy take(1), but take(3) is ahead of it in the FIFO
    assert first.is_alive() and second.is_alive()
    assert state(acc) == (1, 0)
    assert acc.apply_grad((2.0,))
    assert acc.apply_grad((6.0,))
    assert_bits(first.finish(), np.array([3.0], np.float32))
    assert first.done_at is not None
    time.sleep(0.2)
    assert second.is_alive()  # the round went to the head taker; nothing left for take(1)
    assert state(acc) == (0, 1)
    assert acc.apply_grad((7.0,), local_step=1)
    assert_bits(second.finish(), np.array([7.0], np.float32))
    assert state(acc) == (0, 2)


# -- blocking take ---------------------------------------------------------------------------


def test_accumulator_apply_and_blocking_take(target):
    # TF: testAccumulatorApplyAndBlockingTake
    acc = make(target)
    taker = start_taker(target, make(target), 3, timeout=TAKE_DEADLINE)
    elems = [10.0, 20.0, 30.0]
    for x in elems[:2]:
        assert acc.apply_grad((x,), local_step=0)
    time.sleep(0.2)
    assert taker.is_alive()  # 2 < 3: still waiting
    assert acc.num_accumulated() == 2  # a waiting take does not change the count
    last_apply = time.monotonic()
    assert acc.apply_grad((elems[2],), local_step=0)
    assert_bits(taker.finish(), np.array([20.0], np.float32))
    assert taker.done_at is not None and taker.done_at >= last_apply
    assert taker.done_at - last_apply < 1.5  # woken by the apply, not by polling
    assert state(acc) == (0, 1)


def test_blocking_take_timeout_consumes_nothing(target):
    acc = make(target)
    acc.apply_grad((4.0,))
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError) as info:
        acc.take_grad(2, timeout=0.3)
    elapsed = time.monotonic() - started
    assert isinstance(info.value, TimeoutError)
    assert "Timed out waiting for notification" in str(info.value)
    assert 0.25 <= elapsed < 2.0
    assert state(acc) == (1, 0)
    assert waiting_takers(target, acc) == 0  # no trace in the FIFO
    # a later take is not blocked by the timed-out one
    assert_bits(acc.take_grad(1, timeout=1.0), np.array([4.0], np.float32))


def test_accumulator_cancel(target):
    # TF: testAccumulatorCancel: closing (TF: the session) cancels a blocked take
    acc = make(target)
    taker = start_taker(target, acc, 1, timeout=None)
    acc.close()
    taker.join(PROMPT)
    assert not taker.is_alive()
    assert isinstance(taker.error, CancelledError)
    with pytest.raises(CancelledError):
        acc.take_grad(1)
    with pytest.raises(CancelledError):
        acc.apply_grad((1.0,))
    other = make(target)
    assert state(other) == (0, 0)  # the cancelled take consumed nothing, advanced nothing
    assert waiting_takers(target, other) == 0
    other.apply_grad((2.0,))
    assert_bits(other.take_grad(1, timeout=1.0), np.array([2.0], np.float32))


def test_error_types_exported():
    assert issubclass(accumulator.InvalidArgumentError, ValueError)
    assert issubclass(accumulator.DeadlineExceededError, TimeoutError)
    for exc in (InvalidArgumentError, DeadlineExceededError, CancelledError):
        assert issubclass(exc, accumulator.AccumulatorError)
