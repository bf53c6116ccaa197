"""``accumulator.raw_ops``: TF's raw accumulator ops by name and argument name (spec section 8).

Every creation op takes ``client=``; the other ops work on the handle it returns. Where TF
crashes or half-applies (a dtype that does not match the handle, non-scalar step arguments),
ours raise InvalidArgumentError and change nothing. Runs on fakeredis and a real server.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import numpy as np
import pytest

import accumulator
from accumulator import InvalidArgumentError, NotFoundError, raw_ops

OPS = [
    "AccumulatorApplyGradient",
    "AccumulatorNumAccumulated",
    "AccumulatorSetGlobalStep",
    "AccumulatorTakeGradient",
    "ConditionalAccumulator",
    "ResourceAccumulatorApplyGradient",
    "ResourceAccumulatorNumAccumulated",
    "ResourceAccumulatorSetGlobalStep",
    "ResourceAccumulatorTakeGradient",
    "ResourceConditionalAccumulator",
    "SparseAccumulatorApplyGradient",
    "SparseAccumulatorTakeGradient",
    "SparseConditionalAccumulator",
]

#: TF's argument names, in TF's order (``name`` last), per op.
SIGNATURES = {
    "ConditionalAccumulator": ["dtype", "shape", "container", "shared_name", "reduction_type",
                               "name"],
    "SparseConditionalAccumulator": ["dtype", "shape", "container", "shared_name",
                                     "reduction_type", "name"],
    "AccumulatorApplyGradient": ["handle", "local_step", "gradient", "name"],
    "SparseAccumulatorApplyGradient": ["handle", "local_step", "gradient_indices",
                                       "gradient_values", "gradient_shape", "has_known_shape",
                                       "name"],
    "AccumulatorNumAccumulated": ["handle", "name"],
    "AccumulatorSetGlobalStep": ["handle", "new_global_step", "name"],
    "AccumulatorTakeGradient": ["handle", "num_required", "dtype", "name"],
    "SparseAccumulatorTakeGradient": ["handle", "num_required", "dtype", "name"],
}  # fmt: skip

#: Each dense op and its Resource* twin.
DENSE_FAMILIES = {
    "classic": (
        raw_ops.ConditionalAccumulator,
        raw_ops.AccumulatorApplyGradient,
        raw_ops.AccumulatorNumAccumulated,
        raw_ops.AccumulatorSetGlobalStep,
        raw_ops.AccumulatorTakeGradient,
    ),
    "resource": (
        raw_ops.ResourceConditionalAccumulator,
        raw_ops.ResourceAccumulatorApplyGradient,
        raw_ops.ResourceAccumulatorNumAccumulated,
        raw_ops.ResourceAccumulatorSetGlobalStep,
        raw_ops.ResourceAccumulatorTakeGradient,
    ),
}


def dense(target: Any, shared_name: str = "q", shape: Any = (2,), dtype: Any = np.float32,
          **kw: Any) -> Any:  # fmt: skip
    return raw_ops.ConditionalAccumulator(dtype, shape, shared_name=shared_name,
                                          client=target.client(), **kw)  # fmt: skip


def sparse(target: Any, shared_name: str = "s", shape: Any = (4, 2), dtype: Any = np.float32,
           **kw: Any) -> Any:  # fmt: skip
    return raw_ops.SparseConditionalAccumulator(dtype, shape, shared_name=shared_name,
                                                client=target.client(), **kw)  # fmt: skip


def snapshot(handle: Any) -> tuple[int, int]:
    return raw_ops.AccumulatorNumAccumulated(handle), handle.global_step()


def unchanged(handle: Any, call: Any) -> InvalidArgumentError:
    """``call`` raises InvalidArgumentError and leaves count, step and the FIFO as they were."""
    before = snapshot(handle)
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert snapshot(handle) == before
    assert handle.redis.zcard(handle.accumulator_ref + ":t") == 0  # no taker left behind
    return info.value


def assert_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.tobytes() == expected.tobytes(), (actual, expected)


# -- names and signatures --------------------------------------------------------------------


def test_every_op_is_exported():
    assert sorted(raw_ops.__all__) == sorted(OPS)
    for op in OPS:
        assert callable(getattr(raw_ops, op))
    assert accumulator.raw_ops is raw_ops


@pytest.mark.parametrize("op", sorted(SIGNATURES))
def test_argument_names_are_tfs(op):
    params = inspect.signature(getattr(raw_ops, op)).parameters
    positional = [p for p in params.values() if p.kind is not p.KEYWORD_ONLY]
    assert [p.name for p in positional] == SIGNATURES[op]
    if "ConditionalAccumulator" in op:
        assert params["client"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["container"].default == ""
        assert params["shared_name"].default == ""
        assert params["reduction_type"].default == "MEAN"
    assert params["name"].default is None


@pytest.mark.parametrize(
    ("resource", "classic"),
    [
        ("ResourceConditionalAccumulator", "ConditionalAccumulator"),
        ("ResourceAccumulatorApplyGradient", "AccumulatorApplyGradient"),
        ("ResourceAccumulatorNumAccumulated", "AccumulatorNumAccumulated"),
        ("ResourceAccumulatorSetGlobalStep", "AccumulatorSetGlobalStep"),
        ("ResourceAccumulatorTakeGradient", "AccumulatorTakeGradient"),
    ],
)
def test_resource_ops_take_the_same_arguments(resource, classic):
    a = inspect.signature(getattr(raw_ops, resource)).parameters
    b = inspect.signature(getattr(raw_ops, classic)).parameters
    assert list(a) == list(b)


# -- dense ops -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(DENSE_FAMILIES))
def test_dense_ops_end_to_end(target, family):
    create, apply, num, set_step, take = DENSE_FAMILIES[family]
    handle = create(dtype=np.float32, shape=[2], container="", shared_name="d",
                    reduction_type="MEAN", name="acc", client=target.client())  # fmt: skip
    assert isinstance(handle, accumulator.ConditionalAccumulator)
    assert handle.name == "acc" and handle.shared_name == "d"
    assert num(handle=handle) == 0
    assert apply(handle=handle, local_step=0, gradient=np.array([1.0, 2.0], np.float32)) is True
    assert apply(handle, 0, [3.0, 6.0]) is True
    assert num(handle) == 2
    assert_bits(take(handle=handle, num_required=2, dtype=np.float32),
                np.array([2.0, 4.0], np.float32))  # fmt: skip
    assert apply(handle, 0, [1.0, 1.0]) is False  # stale after the take
    assert set_step(handle=handle, new_global_step=5) is None
    assert handle.global_step() == 5
    assert apply(handle, np.int64(4), [1.0, 1.0]) is False
    assert apply(handle, np.array(5), [1.0, 1.0]) is True
    assert_bits(take(handle, np.array(1), "float32"), np.array([1.0, 1.0], np.float32))
    assert handle.global_step() == 6


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
def test_dense_reduction_type(target, reduction):
    handle = dense(target, reduction_type=reduction)
    raw_ops.AccumulatorApplyGradient(handle, 0, [1.0, 2.0])
    raw_ops.AccumulatorApplyGradient(handle, 0, [2.0, 2.0])
    expected = [1.5, 2.0] if reduction == "MEAN" else [3.0, 4.0]
    assert_bits(raw_ops.AccumulatorTakeGradient(handle, 2, np.float32),
                np.array(expected, np.float32))  # fmt: skip


def test_take_timeout(target):
    handle = dense(target)
    raw_ops.AccumulatorApplyGradient(handle, 0, [1.0, 2.0])
    with pytest.raises(accumulator.DeadlineExceededError):
        raw_ops.AccumulatorTakeGradient(handle, 2, np.float32, timeout=0.2)
    assert snapshot(handle) == (1, 0)
    s = sparse(target)
    with pytest.raises(TimeoutError):
        raw_ops.SparseAccumulatorTakeGradient(s, 1, np.float32, timeout=0.2)


def test_blocking_take_through_raw_ops(target):
    handle = dense(target)
    result: list[Any] = []
    taker = threading.Thread(
        target=lambda: result.append(
            raw_ops.AccumulatorTakeGradient(dense(target), 2, np.float32, timeout=5)
        )  # fmt: skip
    )
    taker.start()
    time.sleep(0.1)
    raw_ops.ResourceAccumulatorApplyGradient(handle, 0, [2.0, 0.0])
    raw_ops.ResourceAccumulatorApplyGradient(handle, 0, [4.0, 2.0])
    taker.join(6)
    assert not taker.is_alive()
    assert_bits(result[0], np.array([3.0, 1.0], np.float32))


# -- sparse ops ------------------------------------------------------------------------------


def test_sparse_ops_end_to_end(target):
    handle = raw_ops.SparseConditionalAccumulator(
        dtype=np.float32, shape=[4, 2], container="", shared_name="sp", reduction_type="SUM",
        name="S", client=target.client(),
    )  # fmt: skip
    assert isinstance(handle, accumulator.SparseConditionalAccumulator)
    assert handle.name == "S"
    assert raw_ops.SparseAccumulatorApplyGradient(
        handle=handle, local_step=0, gradient_indices=np.array([0, 3], np.int64),
        gradient_values=np.array([[1, 2], [3, 4]], np.float32),
        gradient_shape=np.array([4, 2], np.int64), has_known_shape=True,
    ) is True  # fmt: skip
    assert raw_ops.SparseAccumulatorApplyGradient(handle, 0, [3], [[1.0, 1.0]], [4, 2], True)
    assert raw_ops.AccumulatorNumAccumulated(handle) == 2
    assert raw_ops.ResourceAccumulatorNumAccumulated(handle) == 2
    indices, values, shape = raw_ops.SparseAccumulatorTakeGradient(
        handle=handle, num_required=2, dtype=np.float32
    )
    assert_bits(indices, np.array([0, 3], np.int64))
    assert_bits(values, np.array([[1, 2], [4, 5]], np.float32))
    assert_bits(shape, np.array([4, 2], np.int64))
    assert raw_ops.SparseAccumulatorApplyGradient(handle, 0, [1], [[1.0, 1.0]], [4, 2],
                                                  True) is False  # fmt: skip
    raw_ops.AccumulatorSetGlobalStep(handle, 0)
    raw_ops.ResourceAccumulatorSetGlobalStep(handle, 3)
    assert handle.global_step() == 3


@pytest.mark.parametrize("known", [False, np.bool_(False), np.array(False)],
                         ids=["bool", "np.bool_", "0-d array"])  # fmt: skip
def test_has_known_shape_false_ignores_gradient_shape(target, known):
    handle = sparse(target, shape=(4, 2))
    # a gradient_shape that would fail every check, ignored
    for bogus in ([], [9, 9], [0], np.zeros((2, 2), np.int64)):
        assert raw_ops.SparseAccumulatorApplyGradient(handle, 0, [1], [[1.0, 2.0]], bogus, known)
    assert raw_ops.AccumulatorNumAccumulated(handle) == 4
    # the declared shape itself still applies (index limit, values dims)
    err = unchanged(handle, lambda: raw_ops.SparseAccumulatorApplyGradient(
        handle, 0, [4], [[1.0, 2.0]], [], known))  # fmt: skip
    assert str(err) == (
        "Shape mismatch: index of slice 0 exceeded limits of shape; index is 4 exceeded 4"
    )
    _, _, shape = raw_ops.SparseAccumulatorTakeGradient(handle, 4, np.float32)
    assert shape.tolist() == [4, 2]  # never from gradient_shape


def test_has_known_shape_true_checks_gradient_shape(target):
    handle = sparse(target, shape=(4, 2))
    err = unchanged(handle, lambda: raw_ops.SparseAccumulatorApplyGradient(
        handle, 0, [1], [[1.0, 2.0]], [9, 2], True))  # fmt: skip
    assert str(err) == "Shape mismatch: expected shape dim 0 to be 4, got 9"
    err = unchanged(handle, lambda: raw_ops.SparseAccumulatorApplyGradient(
        handle, 0, [1], [[1.0, 2.0]], [4], np.bool_(True)))  # fmt: skip
    assert str(err) == "Shape mismatch: expected shape rank at least 2, got 1"
    assert raw_ops.SparseAccumulatorApplyGradient(handle, 0, [1], [[1.0, 2.0]], [4, 2, 3], True)


def test_sparse_validation_through_raw_op(target):
    handle = sparse(target, shape=(3, 3))
    err = unchanged(handle, lambda: raw_ops.SparseAccumulatorApplyGradient(
        handle, 0, [[0, 1], [1, 0]], [1.0, 2.0], [], False))  # fmt: skip
    assert str(err) == "Input indices should be vector but received shape: [2,2]"
    err = unchanged(handle, lambda: raw_ops.SparseAccumulatorApplyGradient(
        handle, 0, [0, 1], [[0.0, 1.0, 1.0]], [], False))  # fmt: skip
    assert str(err) == "Expected 2 non-empty input values, got 1"
    # stale: dropped before validation
    raw_ops.AccumulatorSetGlobalStep(handle, 1)
    assert raw_ops.SparseAccumulatorApplyGradient(handle, 0, [[0]], 1.0, [7], True) is False


# -- dtype mismatch: "Signature mismatch" ----------------------------------------------------


@pytest.mark.parametrize(("wrong", "tf_name"), [
    (np.float64, "double"), ("float16", "half"), (np.int32, "int32"), ("bfloat16", "bfloat16"),
])  # fmt: skip
def test_take_with_another_dtype_is_a_signature_mismatch(target, wrong, tf_name):
    """TF's text (TF 2.21): "have" is the op's dtype, "expected" the accumulator's."""
    d = dense(target)
    raw_ops.AccumulatorApplyGradient(d, 0, [1.0, 2.0])
    err = unchanged(d, lambda: raw_ops.AccumulatorTakeGradient(d, 1, wrong))
    assert str(err) == (f"Signature mismatch, have: string_ref, int32->{tf_name} "
                        "expected: string_ref, int32->float")  # fmt: skip
    err = unchanged(d, lambda: raw_ops.ResourceAccumulatorTakeGradient(d, 1, wrong))
    assert str(err) == (f"Signature mismatch, have: resource, int32->{tf_name} "
                        "expected: resource, int32->float")  # fmt: skip
    s = sparse(target)
    raw_ops.SparseAccumulatorApplyGradient(s, 0, [1], [[1.0, 2.0]], [4, 2], True)
    err = unchanged(s, lambda: raw_ops.SparseAccumulatorTakeGradient(s, 1, wrong))
    assert str(err) == (f"Signature mismatch, have: string_ref, int32->int64, {tf_name}, int64 "
                        "expected: string_ref, int32->int64, float, int64")  # fmt: skip
    # nothing consumed: the right dtype still takes the gradient
    assert_bits(raw_ops.AccumulatorTakeGradient(d, 1, np.float32),
                np.array([1.0, 2.0], np.float32))  # fmt: skip
    assert raw_ops.SparseAccumulatorTakeGradient(s, 1, np.float32).indices.tolist() == [1]


def test_dtype_spellings_that_match_are_fine(target):
    d = dense(target, dtype=np.float64)
    for spelling in (np.float64, "float64", np.dtype("float64"), "double"):
        raw_ops.AccumulatorApplyGradient(d, d.global_step(), [1.0, 2.0])
        raw_ops.AccumulatorTakeGradient(d, 1, spelling)
    f = dense(target, "f")  # (Python's float is TF's float32: tf.as_dtype(float))
    for spelling in (np.float32, "float32", "float", float):
        raw_ops.AccumulatorApplyGradient(f, f.global_step(), [1.0, 2.0])
        raw_ops.AccumulatorTakeGradient(f, 1, spelling)
    with pytest.raises(InvalidArgumentError, match="^Signature mismatch"):
        raw_ops.AccumulatorTakeGradient(d, 1, float)


def test_dtype_mismatch_with_a_blocked_taker_waiting(target):
    """A refused take never joins the FIFO, so it cannot block (or be served to) anyone."""
    d = dense(target)
    with pytest.raises(InvalidArgumentError, match="^Signature mismatch"):
        raw_ops.AccumulatorTakeGradient(d, 1, np.float64)
    raw_ops.AccumulatorApplyGradient(d, 0, [5.0, 5.0])
    assert_bits(raw_ops.AccumulatorTakeGradient(d, 1, np.float32, timeout=2),
                np.array([5.0, 5.0], np.float32))  # fmt: skip


# -- non-scalar arguments --------------------------------------------------------------------

NON_SCALARS = [[0], np.zeros((1,), np.int64), np.zeros((1, 1), np.int64), [], [1, 2]]
NON_SCALAR_IDS = ["list", "vector", "matrix", "empty", "pair"]


@pytest.mark.parametrize("step", NON_SCALARS, ids=NON_SCALAR_IDS)
def test_non_scalar_local_step(target, step):
    d = dense(target)
    raw_ops.AccumulatorApplyGradient(d, 0, [1.0, 1.0])
    unchanged(d, lambda: raw_ops.AccumulatorApplyGradient(d, step, [1.0, 2.0]))
    unchanged(d, lambda: raw_ops.ResourceAccumulatorApplyGradient(d, step, [1.0, 2.0]))
    s = sparse(target)
    unchanged(s, lambda: raw_ops.SparseAccumulatorApplyGradient(s, step, [0], [[1.0, 2.0]],
                                                                [4, 2], True))  # fmt: skip
    assert snapshot(s) == (0, 0)
    assert_bits(raw_ops.AccumulatorTakeGradient(d, 1, np.float32), np.ones(2, np.float32))


@pytest.mark.parametrize("n", NON_SCALARS, ids=NON_SCALAR_IDS)
def test_non_scalar_num_required(target, n):
    d = dense(target)
    raw_ops.AccumulatorApplyGradient(d, 0, [1.0, 1.0])
    err = unchanged(d, lambda: raw_ops.AccumulatorTakeGradient(d, n, np.float32))
    shape = "[" + ",".join(str(x) for x in np.shape(n)) + "]"
    assert str(err) == f"Argument num_required must be scalar, but had bad shape {shape}"  # TF's
    unchanged(d, lambda: raw_ops.ResourceAccumulatorTakeGradient(d, n, np.float32))
    s = sparse(target)
    raw_ops.SparseAccumulatorApplyGradient(s, 0, [0], [[1.0, 2.0]], [4, 2], True)
    unchanged(s, lambda: raw_ops.SparseAccumulatorTakeGradient(s, n, np.float32))
    assert snapshot(d) == (1, 0) and snapshot(s) == (1, 0)


@pytest.mark.parametrize("new", NON_SCALARS, ids=NON_SCALAR_IDS)
def test_non_scalar_new_global_step(target, new):
    d = dense(target)
    raw_ops.AccumulatorSetGlobalStep(d, 3)
    unchanged(d, lambda: raw_ops.AccumulatorSetGlobalStep(d, new))
    unchanged(d, lambda: raw_ops.ResourceAccumulatorSetGlobalStep(d, new))
    s = sparse(target)
    unchanged(s, lambda: raw_ops.AccumulatorSetGlobalStep(s, new))
    assert d.global_step() == 3 and s.global_step() == 0


def test_other_bad_scalars(target):
    d = dense(target)
    raw_ops.AccumulatorApplyGradient(d, 0, [1.0, 1.0])
    for bad in (1.5, "1", True, None):
        unchanged(d, lambda bad=bad: raw_ops.AccumulatorTakeGradient(d, bad, np.float32))
        unchanged(d, lambda bad=bad: raw_ops.AccumulatorSetGlobalStep(d, bad))
        unchanged(d, lambda bad=bad: raw_ops.AccumulatorApplyGradient(d, bad, [1.0, 1.0]))
    err = unchanged(d, lambda: raw_ops.AccumulatorTakeGradient(d, 0, np.float32))
    assert str(err) == "Argument num_required must be positive, but was 0"
    assert snapshot(d) == (1, 0)


# -- handles ---------------------------------------------------------------------------------


def test_ops_refuse_the_wrong_kind_of_handle(target):
    d, s = dense(target), sparse(target)
    unchanged(s, lambda: raw_ops.AccumulatorApplyGradient(s, 0, [1.0, 2.0]))
    unchanged(s, lambda: raw_ops.AccumulatorTakeGradient(s, 1, np.float32))
    unchanged(d, lambda: raw_ops.SparseAccumulatorApplyGradient(d, 0, [0], [1.0], [2], True))
    unchanged(d, lambda: raw_ops.SparseAccumulatorTakeGradient(d, 1, np.float32))
    for not_a_handle in ("q", None, b"ref", 3):
        with pytest.raises(InvalidArgumentError):
            raw_ops.AccumulatorNumAccumulated(not_a_handle)
        with pytest.raises(InvalidArgumentError):
            raw_ops.AccumulatorSetGlobalStep(not_a_handle, 1)
        with pytest.raises(InvalidArgumentError):
            raw_ops.AccumulatorApplyGradient(not_a_handle, 0, [1.0, 2.0])


def test_raw_handles_and_classes_share_state(target):
    handle = dense(target, shared_name="both")
    obj = accumulator.ConditionalAccumulator(np.float32, shape=(2,), shared_name="both",
                                             client=target.client())  # fmt: skip
    raw_ops.AccumulatorApplyGradient(handle, 0, [2.0, 4.0])
    assert obj.num_accumulated() == 1
    obj.apply_grad([4.0, 8.0])
    assert_bits(raw_ops.AccumulatorTakeGradient(handle, 2, np.float32),
                np.array([3.0, 6.0], np.float32))  # fmt: skip
    assert obj.global_step() == 1
    sh = sparse(target, shared_name="sboth")
    sobj = accumulator.SparseConditionalAccumulator(
        np.float32, shape=(4, 2), shared_name="sboth", client=target.client()
    )
    sobj.apply_grad([2], [[1.0, 1.0]])
    assert raw_ops.SparseAccumulatorTakeGradient(sh, 1, np.float32).indices.tolist() == [2]


def test_definition_mismatch_through_raw_ops(target):
    dense(target, shared_name="x")
    with pytest.raises(InvalidArgumentError, match="dense float32 \\[2\\] MEAN"):
        sparse(target, shared_name="x", shape=(2,))
    with pytest.raises(InvalidArgumentError, match="float64"):
        dense(target, shared_name="x", dtype=np.float64)
    with pytest.raises(InvalidArgumentError, match="SUM"):
        dense(target, shared_name="x", reduction_type="SUM")
    with pytest.raises(InvalidArgumentError):
        raw_ops.ConditionalAccumulator(np.float32, [2], reduction_type="Invalid",
                                       client=target.client())  # fmt: skip


def test_has_known_shape_false_works_on_unknown_shape(target):
    handle = sparse(target, shape=None)
    assert raw_ops.SparseAccumulatorApplyGradient(handle, 0, [5], [[1.0, 2.0, 3.0]], [], False)
    indices, values, shape = raw_ops.SparseAccumulatorTakeGradient(handle, 1, "float32")
    assert indices.tolist() == [5] and shape.tolist() == [-1, 3]


# -- shared_name, name, container ------------------------------------------------------------


def test_empty_shared_name_is_private(target):
    a = raw_ops.ConditionalAccumulator(np.float32, [2], client=target.client())
    b = raw_ops.ConditionalAccumulator(np.float32, [2], shared_name="", client=target.client())
    raw_ops.AccumulatorApplyGradient(a, 0, [1.0, 1.0])
    assert raw_ops.AccumulatorNumAccumulated(a) == 1
    assert raw_ops.AccumulatorNumAccumulated(b) == 0
    assert a.shared_name is None and b.shared_name is None
    s1 = raw_ops.SparseConditionalAccumulator(np.float32, [2], client=target.client())
    s2 = raw_ops.SparseConditionalAccumulator(np.float32, [2], client=target.client())
    raw_ops.SparseAccumulatorApplyGradient(s1, 0, [0], [1.0], [2], True)
    assert (raw_ops.AccumulatorNumAccumulated(s1), raw_ops.AccumulatorNumAccumulated(s2)) == (1, 0)


def test_name_is_only_a_label(target):
    a = raw_ops.ConditionalAccumulator(np.float32, [2], shared_name="n1", name="Q",
                                       client=target.client())  # fmt: skip
    b = raw_ops.ConditionalAccumulator(np.float32, [2], shared_name="n2", name="Q",
                                       client=target.client())  # fmt: skip
    c = raw_ops.ConditionalAccumulator(np.float32, [2], shared_name="n1", name="other",
                                       client=target.client())  # fmt: skip
    raw_ops.AccumulatorApplyGradient(a, 0, [1.0, 1.0])
    assert [raw_ops.AccumulatorNumAccumulated(h) for h in (a, b, c)] == [1, 0, 1]


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_containers_are_namespaces(target, kind):
    if kind == "dense":
        make = lambda container: dense(target, shared_name="q", container=container)  # noqa: E731
        apply = lambda h: raw_ops.AccumulatorApplyGradient(h, 0, [1.0, 1.0])  # noqa: E731
    else:
        make = lambda container: sparse(target, shared_name="q", container=container)  # noqa: E731
        apply = lambda h: raw_ops.SparseAccumulatorApplyGradient(  # noqa: E731
            h, 0, [1], [[1.0, 1.0]], [4, 2], True)  # fmt: skip
    a1, a2, b, default = make("a"), make("a"), make("b"), make("")
    assert a1.container == "a" and default.container == ""
    apply(a1)
    apply(b)
    apply(b)
    counts = [raw_ops.AccumulatorNumAccumulated(h) for h in (a1, a2, b, default)]
    assert counts == [1, 1, 2, 0]
    raw_ops.AccumulatorSetGlobalStep(b, 7)
    assert (a1.global_step(), b.global_step(), default.global_step()) == (0, 7, 0)


def test_resetting_a_container_removes_its_accumulators(target):
    from accumulator._admin import reset_container

    a_dense = dense(target, shared_name="q", container="a")
    a_sparse = sparse(target, shared_name="s", container="a")
    b_dense = dense(target, shared_name="q", container="b")
    top = dense(target, shared_name="q")
    for h in (a_dense, b_dense, top):
        raw_ops.AccumulatorApplyGradient(h, 0, [1.0, 1.0])
    raw_ops.SparseAccumulatorApplyGradient(a_sparse, 0, [1], [[1.0, 1.0]], [4, 2], True)
    assert reset_container(target.redis(), "a") == 2
    for gone in (a_dense, a_sparse):
        with pytest.raises(NotFoundError):
            raw_ops.AccumulatorNumAccumulated(gone)
    assert raw_ops.AccumulatorNumAccumulated(b_dense) == 1
    assert raw_ops.AccumulatorNumAccumulated(top) == 1
    # the name is free again in that container, even for another kind
    fresh = sparse(target, shared_name="q", container="a")
    assert raw_ops.AccumulatorNumAccumulated(fresh) == 0


def test_has_known_shape_must_be_a_boolean_scalar(target):
    h = raw_ops.SparseConditionalAccumulator(np.float32, shape=[4, 2], shared_name="hk",
                                             client=target.client())  # fmt: skip
    for bad in ([True, False], "False", 0.5):
        with pytest.raises(accumulator.InvalidArgumentError, match="has_known_shape"):
            raw_ops.SparseAccumulatorApplyGradient(h, 0, [1], [[1.0, 2.0]], [4, 2], bad)
    assert raw_ops.AccumulatorNumAccumulated(h) == 0


def test_uint64_index_beyond_int64_is_refused_clearly(target):
    acc = accumulator.SparseConditionalAccumulator(np.float32, shape=None, shared_name="u64",
                                                   client=target.client())  # fmt: skip
    with pytest.raises(accumulator.InvalidArgumentError, match="outside the int64 range"):
        acc.apply_grad(np.array([2**63], np.uint64), [[1.0]])
    assert acc.num_accumulated() == 0
