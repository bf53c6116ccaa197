"""Bad input to every public entry point: a clear error, and Redis exactly as it was.

Each case snapshots every ``acc:`` key (type-aware: strings, hashes, lists, zsets; expiries
and the ``n_rejected``/``tseq`` bookkeeping counters left out, see ``_helpers.redis_snapshot``)
before the call and compares after it. Hand-written cases pin the message; hypothesis cases
throw arbitrary Python and numpy objects at the same arguments and require that every call
either works or is refused that way.

The error rule (one for the whole API):

* ``TypeError`` when a *name* (``shared_name``, ``container``, ``name``) is not a ``str`` at
  all, as TF's ops do for string attributes ("Expected string for argument ...").
* ``accumulator.InvalidArgumentError`` (also a ``ValueError``) for everything else that is
  refused, whatever the Python type: gradients, indices, values, grad_shape, steps,
  num_required, timeout, dtype, shape, reduction_type, has_known_shape, handles, and names
  that are strings but not valid Unicode (a lone surrogate). Data arguments are converted
  the way TF converts them to tensors, so a wrong type and a wrong value are the same failure.
  Integer scalars may be Python ints, numpy integer scalars or 0-d integer arrays; bools and
  floats (even integral ones) are refused. ``timeout`` is any real number >= 0 (numpy
  scalars too) or None; bools, NaN, infinities and negatives are refused.

Stale input is the one exception to "bad input raises": a sparse gradient whose local_step is
behind the global step is dropped (``False``) before any validation, as in TF.
"""

from __future__ import annotations

import math
import numbers
import re
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
from _helpers import redis_snapshot
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import accumulator
from accumulator import InvalidArgumentError, raw_ops

FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,  # nothing written into the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SHAPE = (3, 2)
SPARSE_SHAPE = (10, 2)
STEP = 2  # the fixtures' global step
HUGE = np.broadcast_to(np.float64(1), (2**31, 4))  # a 32 GiB view of one element


def refused(
    target: Any,
    call: Callable[[], Any],
    match: str | None = None,
    exc: type[BaseException] = InvalidArgumentError,
) -> BaseException:
    """``call`` raises ``exc`` with a non-empty message (matching ``match``) and leaves every
    accumulator key in Redis as it was."""
    r = target.redis()
    before = redis_snapshot(r)
    with pytest.raises(exc, match=match) as info:
        call()
    assert str(info.value).strip(), "an error without a message"
    if exc is InvalidArgumentError:
        assert isinstance(info.value, ValueError)
    assert redis_snapshot(r) == before
    return info.value


def _id(value: Any) -> str:
    """A test id without memory addresses."""
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text[:40]


def fresh_name() -> str:
    return f"fuzz/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def dense(target):
    """A float32 [3,2] accumulator at step 2 with one pending gradient."""
    acc = accumulator.ConditionalAccumulator(
        np.float32, SHAPE, "fuzz/dense", client=target.client()
    )
    acc.set_global_step(STEP)
    assert acc.apply_grad(np.ones(SHAPE), local_step=STEP)
    yield acc
    acc.close()


@pytest.fixture
def unknown(target):
    """A float32 accumulator of unknown shape, its round fixed to [3] by one gradient."""
    acc = accumulator.ConditionalAccumulator(
        np.float32, None, "fuzz/unknown", client=target.client()
    )
    acc.set_global_step(STEP)
    assert acc.apply_grad(np.ones(3), local_step=STEP)
    yield acc
    acc.close()


@pytest.fixture
def sparse(target):
    """A float32 [10,2] sparse accumulator at step 2 with one pending gradient."""
    acc = accumulator.SparseConditionalAccumulator(
        np.float32, SPARSE_SHAPE, "fuzz/sparse", client=target.client()
    )
    acc.set_global_step(STEP)
    assert acc.apply_grad([1, 3], np.ones((2, 2)), local_step=STEP)
    yield acc
    acc.close()


# -- constructors -----------------------------------------------------------------------------

KINDS = {
    "dense": accumulator.ConditionalAccumulator,
    "sparse": accumulator.SparseConditionalAccumulator,
    "raw dense": raw_ops.ConditionalAccumulator,
    "raw resource": raw_ops.ResourceConditionalAccumulator,
    "raw sparse": raw_ops.SparseConditionalAccumulator,
}

BAD_DTYPES = [
    None, 5, 1.5, "foo", "bool", "U3", "S2", "O", "M8[s]", "f4,f4", object, object(),
    [("a", "f4"), ("b", "f4")], np.float64(1.0), np.zeros(2), b"float32",
]  # fmt: skip

BAD_SHAPES = [
    "ab", 3.0, (2.5,), (-2,), (True, 2), True, (2**70,), (2**63,), [[3, 2]], np.zeros((2, 2)),
    (None, "x"), object(), {3: 2},
]  # fmt: skip

BAD_REDUCTIONS = [
    "mean", "", None, ["MEAN"], 1, "MEAN ", b"MEAN", np.array(["MEAN"]),
    np.array(["MEAN", "SUM"]),
]  # fmt: skip


def make(kind: str, target: Any, **kw: Any) -> Any:
    args = {"dtype": np.float32, "shape": SHAPE, "shared_name": fresh_name(), **kw}
    return KINDS[kind](client=target.client(), **args)


def refused_by_every_constructor(target: Any, match: str, **kw: Any) -> None:
    for kind in KINDS:
        refused(target, lambda kind=kind: make(kind, target, **kw), match)


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=_id)
def test_constructor_bad_dtype(target, dtype):
    refused_by_every_constructor(target, "Unsupported accumulator dtype", dtype=dtype)


@pytest.mark.parametrize("shape", BAD_SHAPES, ids=_id)
def test_constructor_bad_shape(target, shape):
    refused_by_every_constructor(target, "Invalid shape", shape=shape)


@pytest.mark.parametrize("reduction", BAD_REDUCTIONS, ids=_id)
def test_constructor_bad_reduction_type(target, reduction):
    refused_by_every_constructor(target, "reduction type", reduction_type=reduction)


@pytest.mark.parametrize("arg", ["shared_name", "container"])
@pytest.mark.parametrize("text", ["\ud800", "a\udfffb", "x\ud83d"], ids=_id)
def test_constructor_name_that_is_not_unicode(target, arg, text):
    """A lone surrogate cannot be sent to Redis (not UTF-8): refused up front, not a
    UnicodeEncodeError from deep inside redis-py."""
    refused_by_every_constructor(target, arg, **{arg: text})


@pytest.mark.parametrize("arg", ["shared_name", "container", "name"])
def test_constructor_name_that_is_not_a_str(target, arg):
    for kind in KINDS:
        for value in (5, b"x", ["a"], 1.5, object()):
            refused(target, lambda kind=kind, value=value: make(kind, target, **{arg: value}),
                    arg, exc=TypeError)  # fmt: skip


def test_constructor_refusal_creates_no_keys(target):
    r = target.redis()
    with pytest.raises(InvalidArgumentError):
        accumulator.ConditionalAccumulator("foo", shared_name="never", client=target.client())
    with pytest.raises(InvalidArgumentError):
        accumulator.SparseConditionalAccumulator(
            np.float32, (2.5,), shared_name="never", client=target.client()
        )
    assert list(r.scan_iter(match="acc:*never*")) == []


# -- dense apply_grad -------------------------------------------------------------------------

BAD_STEPS = [
    float("nan"), 1.0, 2.5, np.float64(3), np.float32(3), True, False, np.True_, "3", b"3",
    None, [3], (3,), np.array([3]), np.array([[3]]), [[1], [1, 2]], 2**63, -(2**63) - 1, 2**64,
    np.uint64(2**63), np.array(3.0), complex(3), object(), {3: 3}, np.timedelta64(3, "s"),
    np.datetime64(3, "s"), np.array(3, dtype="m8[s]"),
]  # fmt: skip

GOOD_STEPS = [
    STEP, np.int64(STEP), np.int32(STEP), np.uint8(STEP), np.uint64(STEP), np.array(STEP),
    np.array(STEP, dtype=np.int16),
]  # fmt: skip

BAD_GRADIENTS = {
    # wrong kind
    "complex": (np.ones(SHAPE, dtype=np.complex64), "Cannot convert"),
    "strings": ([["a", "b"]] * 3, "Cannot convert"),
    "object": (np.array([[object()] * 2] * 3), "Cannot convert"),
    "datetime": (np.zeros(SHAPE, dtype="M8[s]"), "Cannot convert"),
    "None": (None, "Cannot convert"),
    "dict": ({"a": 1}, "Cannot convert"),
    "text": ("abc", "Cannot convert"),
    "huge ints": ([[2**70] * 2] * 3, "Cannot convert"),
    # ragged
    "ragged": ([[1, 2], [3]], "Cannot convert"),
    "ragged deep": ([[1, 2], [3, 4], [5, [6]]], "Cannot convert"),
    # wrong shape
    "transposed": (np.ones((2, 3)), r"^Shape mismatch: expected \[3,2\], got \[2,3\]$"),
    "flat": (np.ones(6), r"^Shape mismatch: expected \[3,2\], got \[6\]$"),
    "scalar": (1.0, r"^Shape mismatch: expected \[3,2\], got \[\]$"),
    "empty": ([], r"^Shape mismatch: expected \[3,2\], got \[0\]$"),
    "huge view": (HUGE, r"^Shape mismatch: expected \[3,2\], got \[2147483648,4\]$"),
    "huge view f32": (
        np.broadcast_to(np.float32(1), (2**31, 4)),
        r"^Shape mismatch: expected \[3,2\], got \[2147483648,4\]$",
    ),
}


def _dense_applies(acc: Any) -> dict[str, Callable[[Any, Any], Any]]:
    return {
        "apply_grad": lambda g, step: acc.apply_grad(g, local_step=step),
        "raw": lambda g, step: raw_ops.AccumulatorApplyGradient(acc, step, g),
        "raw resource": lambda g, step: raw_ops.ResourceAccumulatorApplyGradient(acc, step, g),
    }


@pytest.mark.parametrize("case", BAD_GRADIENTS)
@pytest.mark.parametrize("step", [STEP, STEP - 1], ids=["current", "stale"])
def test_dense_apply_bad_gradient(target, dense, case, step):
    """Refused on the client, before anything is sent: stale or not (TF's Python layer)."""
    grad, match = BAD_GRADIENTS[case]
    for apply in _dense_applies(dense).values():
        refused(target, lambda apply=apply: apply(grad, step), match)


@pytest.mark.parametrize("grad", [HUGE, np.broadcast_to(np.int8(1), (2**35,))], ids=["f64", "i8"])
def test_dense_apply_huge_view_to_unknown_shape(target, unknown, grad):
    """A broadcast view that fits the declared shape but is larger than a payload may be
    (16 GiB): refused from its metadata, without building the 32 GiB payload."""
    refused(target, lambda: unknown.apply_grad(grad, local_step=STEP), "exceeds")


def test_dense_apply_round_shape_mismatch(target, unknown):
    refused(
        target,
        lambda: unknown.apply_grad(np.ones(2), local_step=STEP),
        r"^Shape mismatch: expected \[3\], got \[2\]$",
    )


@pytest.mark.parametrize("step", BAD_STEPS, ids=_id)
def test_dense_apply_bad_local_step(target, dense, step):
    for apply in _dense_applies(dense).values():
        refused(target, lambda apply=apply: apply(np.ones(SHAPE), step), "local_step")


@pytest.mark.parametrize("step", GOOD_STEPS, ids=_id)
def test_dense_apply_numpy_steps_are_fine(dense, step):
    assert dense.apply_grad(np.ones(SHAPE), local_step=step) is True
    assert dense.num_accumulated() == 2


def test_dense_apply_steps_at_the_int64_limits(dense):
    assert dense.apply_grad(np.ones(SHAPE), local_step=2**63 - 1) is True
    assert dense.apply_grad(np.ones(SHAPE), local_step=-(2**63)) is False
    dense.set_global_step(2**63 - 1)
    assert dense.apply_grad(np.ones(SHAPE), local_step=2**63 - 2) is False  # exact, no double
    assert dense.apply_grad(np.ones(SHAPE), local_step=np.int64(2**63 - 1)) is True
    dense.set_global_step(2**53 + 1)
    assert dense.apply_grad(np.ones(SHAPE), local_step=2**53) is False
    assert dense.num_accumulated() == 3


# -- take_grad --------------------------------------------------------------------------------

BAD_NUM_REQUIRED = [
    (0, r"^Argument num_required must be positive, but was 0$"),
    (-1, r"^Argument num_required must be positive, but was -1$"),
    (np.int64(0), r"^Argument num_required must be positive, but was 0$"),
    (-(2**31), "must be positive"),
    (-(2**63), "num_required must fit in int32"),  # (TF's type)
    (True, "num_required"),
    (np.True_, "num_required"),
    (1.0, "num_required"),
    (np.float64(1), "num_required"),
    (float("nan"), "num_required"),
    ("1", "num_required"),
    (None, "num_required"),
    ([1], "num_required"),
    (np.array([1]), "num_required"),
    (2**63, "num_required must fit in int32"),
    (-(2**63) - 1, "num_required must fit in int32"),
]

BAD_TIMEOUTS = [
    True, False, np.True_, -1, -0.5, -1e-9, float("nan"), float("inf"), -float("inf"),
    np.float64("nan"), np.float64("inf"), np.int64(-1), "1", b"1", [1], np.array([0.1]),
    complex(1), object(), np.timedelta64(1, "s"), np.timedelta64(10, "ms"), np.datetime64(1, "s"),
    np.array(0.01), Decimal("0.01"),
]  # fmt: skip

GOOD_TIMEOUTS = [0, 0.0, 0.01, np.float64(0.01), np.float32(0.01), np.int64(0), np.int32(0)]


def _takes(acc: Any) -> dict[str, Callable[..., Any]]:
    dtype = acc.dtype
    if isinstance(acc, accumulator.SparseConditionalAccumulator):
        raw = raw_ops.SparseAccumulatorTakeGradient
        return {
            "take_grad": acc.take_grad,
            "take_indexed_slices_grad": acc.take_indexed_slices_grad,
            "raw": lambda n, **kw: raw(acc, n, dtype, **kw),
        }
    return {
        "take_grad": acc.take_grad,
        "raw": lambda n, **kw: raw_ops.AccumulatorTakeGradient(acc, n, dtype, **kw),
        "raw resource": lambda n, **kw: raw_ops.ResourceAccumulatorTakeGradient(
            acc, n, dtype, **kw
        ),
    }


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("n, match", BAD_NUM_REQUIRED, ids=_id)
def test_take_bad_num_required(target, request, kind, n, match):
    acc = request.getfixturevalue(kind)
    for take in _takes(acc).values():
        # timeout=0: a wrongly accepted num_required must not block the test
        refused(target, lambda take=take: take(n, timeout=0), match)


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=_id)
def test_take_bad_timeout(target, request, kind, timeout):
    acc = request.getfixturevalue(kind)
    for take in _takes(acc).values():
        refused(target, lambda take=take: take(2, timeout=timeout), "timeout")


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("timeout", GOOD_TIMEOUTS, ids=_id)
def test_take_numpy_timeouts_time_out_normally(target, request, kind, timeout):
    """Any real number of seconds: numpy scalars too. The take times out, consuming nothing."""
    acc = request.getfixturevalue(kind)
    for take in _takes(acc).values():
        refused(
            target,
            lambda take=take: take(2, timeout=timeout),
            "^Timed out waiting for notification",
            exc=accumulator.DeadlineExceededError,
        )
    # and a satisfiable take with the same timeout works
    assert _takes(acc)["take_grad"](1, timeout=timeout) is not None
    assert acc.global_step() == STEP + 1


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_take_at_the_int64_maximum_step(target, request, kind):
    """The step cannot advance past int64: a clear error, the round kept (not a raw
    redis.ResponseError from a script that failed half-way)."""
    acc = request.getfixturevalue(kind)
    acc.set_global_step(2**63 - 1)
    refused(target, lambda: acc.take_grad(1, timeout=0), exc=accumulator.AccumulatorError)
    assert acc.num_accumulated() == 1


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_take_a_huge_num_required_times_out(target, request, kind):
    """A num_required within int64 that can never be met: it waits (and times out) or is
    refused as out of range; either way nothing is consumed and the error is ours."""
    acc = request.getfixturevalue(kind)
    for n in (2**31 - 1, 2**31, 2**62, 2**63 - 1):
        refused(
            target,
            lambda n=n: acc.take_grad(n, timeout=0.01),
            exc=(accumulator.DeadlineExceededError, InvalidArgumentError),  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("n", [2**31, 2**40, 2**63, 2**70])
def test_num_required_beyond_int32_says_int32(dense, n):
    """TF's num_required is an int32: past int64 the message said int64 (review)."""
    with pytest.raises(InvalidArgumentError, match="num_required must fit in int32"):
        dense.take_grad(n, timeout=0.01)


# -- set_global_step --------------------------------------------------------------------------


def _set_steps(acc: Any) -> dict[str, Callable[[Any], Any]]:
    return {
        "method": acc.set_global_step,
        "raw": lambda s: raw_ops.AccumulatorSetGlobalStep(acc, s),
        "raw resource": lambda s: raw_ops.ResourceAccumulatorSetGlobalStep(acc, s),
    }


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("step", BAD_STEPS, ids=_id)
def test_set_global_step_bad_step(target, request, kind, step):
    acc = request.getfixturevalue(kind)
    for set_step in _set_steps(acc).values():
        refused(target, lambda set_step=set_step: set_step(step), "new_global_step")


@pytest.mark.parametrize("step", GOOD_STEPS + [2**63 - 1, -(2**63)], ids=_id)
def test_set_global_step_good_steps(dense, step):
    dense.set_global_step(step)
    assert dense.global_step() == int(step)
    assert dense.num_accumulated() == 1


# -- sparse apply_grad ------------------------------------------------------------------------

V2 = np.ones((2, 2))
BAD_SPARSE = {
    # name: (indices, values, grad_shape, match)
    "ragged indices": ([[0, 1], [2]], V2, None, "indices"),
    "ragged indices deep": ([0, [1, 2]], V2, None, "indices"),
    "float indices": ([0.5, 1.0], V2, None, "^Indices must be integers"),
    "integral float indices": ([0.0, 1.0], V2, None, "^Indices must be integers"),
    "string indices": (["a", "b"], V2, None, "^Indices must be integers"),
    "bool indices": ([True, False], V2, None, "^Indices must be integers"),
    "None indices": ([None, None], V2, None, "^Indices must be integers"),
    "object indices": ([2**70, 1], V2, None, "^Indices must be integers"),
    "matrix indices": (
        [[0], [1]], V2, None, r"^Input indices should be vector but received shape: \[2,1\]$",
    ),
    "scalar indices": (0, V2, None, r"^Input indices should be vector but received shape: \[\]$"),
    "scalar values": ([0], 1.0, None, r"^Values cannot be 0-dimensional\.$"),
    "more values": ([0, 1], np.ones((3, 2)), None, "^Expected 2 non-empty input values, got 3$"),
    "fewer values": ([0, 1, 2], V2, None, "^Expected 3 non-empty input values, got 2$"),
    "negative index": ([0, -1], V2, None, "^Shape mismatch: index of slice 1 is negative: -1$"),
    "index at dim 0": (
        [10, 0], V2, None,
        "^Shape mismatch: index of slice 0 exceeded limits of shape; index is 10 exceeded 10$",
    ),
    "uint64 index": (
        np.array([0, 2**64 - 1], dtype=np.uint64), V2, None, "outside the int64 range",
    ),
    "complex values": ([0, 1], V2.astype(np.complex64), None, "Cannot convert"),
    "string values": ([0, 1], [["a", "b"], ["c", "d"]], None, "Cannot convert"),
    "ragged values": ([0, 1], [[1, 2], [3]], None, "Cannot convert"),
    "values dim": (
        [0, 1], np.ones((2, 3)), None, "^Shape mismatch: expected values dim 1 to be 2, got 3$",
    ),
    "values rank": (  # the fixture's round is open: compared with its first gradient
        [0, 1], np.ones(2), None, "^Shape mismatch: expected values rank 2, got 1$",
    ),
    "huge values view": (
        [0, 1], np.broadcast_to(np.float64(1), (2, 2**30)), None,
        "^Shape mismatch: expected values dim 1 to be 2, got 1073741824$",
    ),
    "grad_shape dim": (
        [0, 1], V2, [5, 2], "^Shape mismatch: expected shape dim 0 to be 10, got 5$",
    ),
    "grad_shape rank": (
        [0, 1], V2, [10], "^Shape mismatch: expected shape rank at least 2, got 1$",
    ),
    "grad_shape ragged": ([0, 1], V2, [[10], [2, 3]], "grad_shape"),
    "grad_shape floats": ([0, 1], V2, [10.0, 2.0], "grad_shape"),
    "grad_shape text": ([0, 1], V2, "ab", "grad_shape"),
}  # fmt: skip


def _sparse_applies(acc: Any) -> dict[str, Callable[..., Any]]:
    def slices(i: Any, v: Any, s: Any, step: Any) -> Any:
        grad = accumulator.IndexedSlices(values=v, indices=i, dense_shape=s)
        return acc.apply_indexed_slices_grad(grad, local_step=step)

    return {
        "apply_grad": lambda i, v, s, step: acc.apply_grad(i, v, s, local_step=step),
        "indexed slices": slices,
        "raw": lambda i, v, s, step: raw_ops.SparseAccumulatorApplyGradient(
            acc, step, i, v, s if s is not None else [], s is not None
        ),
    }


@pytest.mark.parametrize("case", BAD_SPARSE)
def test_sparse_apply_bad_input(target, sparse, case):
    indices, values, grad_shape, match = BAD_SPARSE[case]
    for apply in _sparse_applies(sparse).values():
        refused(target, lambda apply=apply: apply(indices, values, grad_shape, STEP), match)


@pytest.mark.parametrize("case", ["ragged indices", "float indices", "values dim", "more values"])
def test_sparse_apply_bad_but_stale_is_dropped(sparse, case):
    """TF checks staleness first: a stale gradient is dropped (False) whatever it holds."""
    indices, values, grad_shape, _ = BAD_SPARSE[case]
    for apply in _sparse_applies(sparse).values():
        assert apply(indices, values, grad_shape, STEP - 1) is False
    assert sparse.num_accumulated() == 1


def test_sparse_apply_round_mismatch(target):
    acc = accumulator.SparseConditionalAccumulator(
        np.float32, None, "fuzz/s2", client=target.client()
    )
    assert acc.apply_grad([0], np.ones((1, 2)))
    refused(
        target,
        lambda: acc.apply_grad([1], np.ones((1, 3))),
        "^Shape mismatch: expected values dim 1 to be 2, got 3$",
    )
    refused(
        target,
        lambda: acc.apply_grad([1], np.ones((1, 2, 1))),
        "^Shape mismatch: expected values rank 2, got 3$",
    )


def test_sparse_apply_huge_views_to_unknown_shape(target):
    acc = accumulator.SparseConditionalAccumulator(
        np.float32, None, "fuzz/s3", client=target.client()
    )
    refused(
        target,
        lambda: acc.apply_grad([0, 1], np.broadcast_to(np.float64(1), (2, 2**32))),
        "exceeds",
    )
    n = 2**33  # 64 GiB of int64 indices, zero-width values
    refused(
        target,
        lambda: acc.apply_grad(np.broadcast_to(np.int64(0), (n,)), np.empty((n, 0))),
        "exceeds",
    )


@pytest.mark.parametrize("step", BAD_STEPS, ids=_id)
def test_sparse_apply_bad_local_step(target, sparse, step):
    for apply in _sparse_applies(sparse).values():
        refused(target, lambda apply=apply: apply([0], np.ones((1, 2)), None, step), "local_step")


@pytest.mark.parametrize("grad", [(np.array([0]), np.ones((1, 2))), None, 5, "x"], ids=_id)
def test_apply_indexed_slices_needs_indexed_slices(target, sparse, grad):
    refused(
        target, lambda: sparse.apply_indexed_slices_grad(grad, local_step=STEP), "IndexedSlices"
    )


# -- raw ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize("handle", [None, "acc:{:x}", 5, object()], ids=_id)
def test_raw_ops_bad_handle(target, handle):
    for call in (
        lambda: raw_ops.AccumulatorApplyGradient(handle, 0, np.ones(SHAPE)),
        lambda: raw_ops.ResourceAccumulatorApplyGradient(handle, 0, np.ones(SHAPE)),
        lambda: raw_ops.SparseAccumulatorApplyGradient(handle, 0, [0], V2[:1], [], False),
        lambda: raw_ops.AccumulatorNumAccumulated(handle),
        lambda: raw_ops.ResourceAccumulatorNumAccumulated(handle),
        lambda: raw_ops.AccumulatorSetGlobalStep(handle, 3),
        lambda: raw_ops.AccumulatorTakeGradient(handle, 1, np.float32, timeout=0),
        lambda: raw_ops.SparseAccumulatorTakeGradient(handle, 1, np.float32, timeout=0),
    ):
        refused(target, call, "handle")


def test_raw_ops_wrong_kind_of_handle(target, dense, sparse):
    refused(target, lambda: raw_ops.AccumulatorApplyGradient(sparse, STEP, V2), "handle")
    refused(target, lambda: raw_ops.AccumulatorTakeGradient(sparse, 1, np.float32, timeout=0))
    refused(
        target, lambda: raw_ops.SparseAccumulatorApplyGradient(dense, STEP, [0], V2[:1], [], False)
    )
    refused(target, lambda: raw_ops.SparseAccumulatorTakeGradient(dense, 1, np.float32, timeout=0))


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize(
    "dtype, match",
    [(np.float64, "TF's"), ("foo", "Unsupported accumulator dtype"),
     (None, "Unsupported accumulator dtype")],
    ids=_id,
)  # fmt: skip
def test_raw_take_dtype_mismatch(target, request, kind, dtype, match):
    if match == "TF's":  # (TF 2.21's text: the op's dtype is "have", the accumulator's expected)
        outputs = "int64, {}, int64" if kind == "sparse" else "{}"
        match = re.escape(f"Signature mismatch, have: string_ref, int32->{outputs.format('double')}"
                          f" expected: string_ref, int32->{outputs.format('float')}")  # fmt: skip
    acc = request.getfixturevalue(kind)
    take = (
        raw_ops.SparseAccumulatorTakeGradient
        if kind == "sparse"
        else raw_ops.AccumulatorTakeGradient
    )
    refused(target, lambda: take(acc, 1, dtype, timeout=0), match)


@pytest.mark.parametrize("step", [[1, 2], np.array([[STEP]]), 1.5, True], ids=_id)
def test_raw_apply_non_scalar_local_step(target, dense, sparse, step):
    refused(target, lambda: raw_ops.AccumulatorApplyGradient(dense, step, np.ones(SHAPE)))
    refused(
        target, lambda: raw_ops.SparseAccumulatorApplyGradient(sparse, step, [0], V2[:1], [], False)
    )


@pytest.mark.parametrize("flag", ["yes", [True], 2.0, None, [[True], [True, False]]], ids=_id)
def test_raw_sparse_apply_bad_has_known_shape(target, sparse, flag):
    refused(
        target,
        lambda: raw_ops.SparseAccumulatorApplyGradient(sparse, STEP, [0], V2[:1], [10, 2], flag),
        "has_known_shape",
    )


def test_raw_sparse_apply_ignores_grad_shape_when_not_known(sparse):
    assert raw_ops.SparseAccumulatorApplyGradient(sparse, STEP, [0], V2[:1], "junk", False)


# -- hypothesis: arbitrary objects ------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**64), 2**64),
    st.floats(),
    st.complex_numbers(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.sampled_from(
        [
            object(),
            Ellipsis,
            np.nan,
            np.inf,
            np.True_,
            np.float64(1.5),
            np.int64(3),
            np.uint64(2**64 - 1),
            np.datetime64("2020-01-01"),
            np.timedelta64(1, "s"),
            slice(1),
        ]
    ),  # fmt: skip
)
_ARRAYS = hnp.arrays(
    dtype=st.one_of(
        hnp.scalar_dtypes(), hnp.unicode_string_dtypes(max_len=2), hnp.byte_string_dtypes(max_len=2)
    ),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
)
GARBAGE = st.recursive(
    st.one_of(_SCALARS, _ARRAYS),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=2), children, max_size=2),
    ),
    max_leaves=6,
)


def works_or_refused(
    target: Any,
    call: Callable[[], Any],
    refusals: tuple[type[BaseException], ...] = (InvalidArgumentError,),
) -> Any:
    """Either ``call`` works, or it raises one of ``refusals`` and Redis is unchanged."""
    r = target.redis()
    before = redis_snapshot(r)
    try:
        return call()
    except refusals as exc:
        assert str(exc).strip()
        assert redis_snapshot(r) == before
        return exc


def test_fuzz_dense_apply(target, dense):
    @FUZZ
    @given(grad=GARBAGE, step=st.one_of(GARBAGE, st.integers(STEP - 1, STEP + 1)))
    def check(grad: Any, step: Any) -> None:
        outcome = works_or_refused(target, lambda: dense.apply_grad(grad, local_step=step))
        if isinstance(outcome, bool):  # accepted or stale: only a valid gradient gets here
            arr = np.asarray(grad)
            assert arr.shape == SHAPE and arr.dtype.kind in "biuf", (grad, step)

    check()


def test_fuzz_sparse_apply(target, sparse):
    @FUZZ
    @given(
        indices=st.one_of(GARBAGE, st.lists(st.integers(-2, 11), max_size=3)),
        values=st.one_of(GARBAGE, hnp.arrays(np.float64, st.sampled_from([(1, 2), (2, 2), (2,)]))),
        grad_shape=st.one_of(st.none(), GARBAGE, st.sampled_from([[10, 2], [10, 2, 3]])),
        step=st.one_of(GARBAGE, st.integers(STEP, STEP + 1)),
    )
    def check(indices: Any, values: Any, grad_shape: Any, step: Any) -> None:
        works_or_refused(target, lambda: sparse.apply_grad(indices, values, grad_shape, step))

    check()


def _maybe_valid_timeout(value: Any) -> bool:
    """What must not be passed to a take that would block: anything that might pass for a
    number of seconds (numbers, numpy scalars and 0-d arrays, timedeltas), nor None: a take
    without a timeout waits forever when num_required is valid but not reached."""
    if value is None:
        return True
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, np.ndarray):
        if value.ndim != 0:
            return False
        value = value[()]
    if isinstance(value, np.generic) and value.dtype.kind == "m":
        return True
    try:
        return isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0
    except (TypeError, ValueError, OverflowError):
        return True


def test_fuzz_take(target, dense):
    @FUZZ
    @given(n=GARBAGE, timeout=GARBAGE)
    def check(n: Any, timeout: Any) -> None:
        assume(not _maybe_valid_timeout(timeout))  # a valid one could block for that long
        works_or_refused(target, lambda: dense.take_grad(n, timeout=timeout))
        # a valid num_required may take the round, or time out once it is taken
        works_or_refused(
            target,
            lambda: dense.take_grad(n, timeout=0),
            (InvalidArgumentError, accumulator.DeadlineExceededError),
        )

    check()


def test_fuzz_set_global_step(target, dense):
    @FUZZ
    @given(step=GARBAGE)
    def check(step: Any) -> None:
        works_or_refused(target, lambda: dense.set_global_step(step))

    check()


def test_fuzz_constructors(target):
    r = target.redis()

    @FUZZ
    @given(
        kind=st.sampled_from(list(KINDS)),
        dtype=st.one_of(GARBAGE, st.sampled_from(["float32", "int8", np.float64])),
        shape=st.one_of(GARBAGE, st.sampled_from([None, (2,), [None, 3], ()])),
        reduction=st.one_of(GARBAGE, st.sampled_from(["MEAN", "SUM"])),
    )
    def check(kind: str, dtype: Any, shape: Any, reduction: Any) -> None:
        name = fresh_name()
        outcome = works_or_refused(
            target,
            lambda: KINDS[kind](
                dtype, shape, shared_name=name, reduction_type=reduction, client=target.client()
            ),
        )
        if isinstance(outcome, accumulator.AccumulatorBase):
            outcome.close()
            accumulator._admin.delete(r, name)
        else:
            assert list(r.scan_iter(match=f"acc:*{name}*")) == []

    check()
