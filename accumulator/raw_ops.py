"""TF's raw accumulator ops (``tf.raw_ops.*``), by name and argument name, on handles.

A handle is the accumulator object itself: these functions are a thin layer over
:class:`ConditionalAccumulator` and :class:`SparseConditionalAccumulator`. Where TF crashes
or half-applies (a take dtype that does not match the handle, non-scalar step arguments),
these raise :class:`InvalidArgumentError` and change nothing. The apply ops are the classes'
``apply_grad`` (the gradient cast to the handle's dtype with numpy's ``same_kind`` rule),
and return ``True`` / ``False`` (accepted / dropped as stale) where TF returns nothing.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import redis

from ._codec import resolve_dtype, scalar_int
from ._core import AccumulatorBase
from ._dense import ConditionalAccumulator as _Dense
from ._errors import InvalidArgumentError
from ._sparse import SparseConditionalAccumulator as _Sparse
from ._sparse import SparseGradient

__all__ = [
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

Client = redis.Redis | str | None
_A = TypeVar("_A", bound=AccumulatorBase)


def _create(
    cls: type[_A], op: str, dtype: Any, shape: Any, container: str,
    shared_name: str, reduction_type: str, name: str | None, client: Client,
) -> _A:
    return cls(dtype, shape, shared_name or None, name or op, reduction_type,
               client=client, container=container)  # fmt: skip


def ConditionalAccumulator(  # noqa: N802 - TF's op name
    dtype: Any,
    shape: Any,
    container: str = "",
    shared_name: str = "",
    reduction_type: str = "MEAN",
    name: str | None = None,
    *,
    client: Client = None,
) -> _Dense:
    """A dense accumulator handle (``tf.raw_ops.ConditionalAccumulator``)."""
    return _create(_Dense, "ConditionalAccumulator", dtype, shape, container, shared_name,
                   reduction_type, name, client)  # fmt: skip


ResourceConditionalAccumulator = ConditionalAccumulator


def SparseConditionalAccumulator(  # noqa: N802 - TF's op name
    dtype: Any,
    shape: Any,
    container: str = "",
    shared_name: str = "",
    reduction_type: str = "MEAN",
    name: str | None = None,
    *,
    client: Client = None,
) -> _Sparse:
    """A sparse accumulator handle (``tf.raw_ops.SparseConditionalAccumulator``)."""
    return _create(_Sparse, "SparseConditionalAccumulator", dtype, shape, container,
                   shared_name, reduction_type, name, client)  # fmt: skip


def _any_handle(handle: Any) -> AccumulatorBase:
    if not isinstance(handle, AccumulatorBase):
        raise InvalidArgumentError(
            f"handle must be an accumulator created by raw_ops, got {type(handle).__name__}"
        )
    return handle


def _handle(handle: Any, kind: type[_A]) -> _A:
    handle = _any_handle(handle)
    if not isinstance(handle, kind):
        raise InvalidArgumentError(
            f"this op needs a {kind.__name__} handle, got {type(handle).__name__}"
        )
    return handle


#: TF's names of the dtypes whose numpy names differ (``DataTypeString``).
_TF_NAMES = {"float16": "half", "float32": "float", "float64": "double"}


def _check_dtype(handle: AccumulatorBase, dtype: Any, signature: str) -> None:
    """TF's check of a take op's ``dtype`` against the accumulator's, in its words: the op's
    signature ``signature`` (``{}`` for the dtype) as given ("have") and as the accumulator
    needs it ("expected")."""
    wanted = resolve_dtype(dtype)
    if wanted != handle.dtype:
        have, expected = (_TF_NAMES.get(d.name, d.name) for d in (wanted, handle.dtype))
        raise InvalidArgumentError(
            f"Signature mismatch, have: {signature.format(have)} expected: "
            f"{signature.format(expected)}"
        )


def AccumulatorApplyGradient(  # noqa: N802
    handle: Any, local_step: Any, gradient: Any, name: str | None = None
) -> bool:
    """TF's ``AccumulatorApplyGradient``: :meth:`ConditionalAccumulator.apply_grad` of the
    dense accumulator ``handle`` names; ``False`` when dropped as stale."""
    return _handle(handle, _Dense).apply_grad(gradient, local_step=local_step)


ResourceAccumulatorApplyGradient = AccumulatorApplyGradient


def SparseAccumulatorApplyGradient(  # noqa: N802
    handle: Any,
    local_step: Any,
    gradient_indices: Any,
    gradient_values: Any,
    gradient_shape: Any,
    has_known_shape: Any,
    name: str | None = None,
) -> bool:
    """TF's ``SparseAccumulatorApplyGradient``: :meth:`SparseConditionalAccumulator.apply_grad`
    of the sparse accumulator ``handle`` names. ``has_known_shape=False`` means
    ``gradient_shape`` is ignored (TF's doc inverts it)."""
    try:
        flag = np.asarray(has_known_shape)
    except Exception:  # noqa: BLE001 - ragged lists, objects whose __array__ fails
        flag = np.asarray(None)  # refused below
    if flag.ndim != 0 or flag.dtype.kind not in "biu":
        raise InvalidArgumentError(
            f"has_known_shape must be a boolean scalar, got {has_known_shape!r}"
        )
    known = bool(flag)
    return _handle(handle, _Sparse).apply_grad(
        gradient_indices, gradient_values, gradient_shape if known else None, local_step
    )


def AccumulatorNumAccumulated(handle: Any, name: str | None = None) -> int:  # noqa: N802
    """TF's ``AccumulatorNumAccumulated``: gradients accepted since the last take."""
    return _any_handle(handle).num_accumulated()


ResourceAccumulatorNumAccumulated = AccumulatorNumAccumulated


def AccumulatorSetGlobalStep(  # noqa: N802
    handle: Any, new_global_step: Any, name: str | None = None
) -> None:
    """TF's ``AccumulatorSetGlobalStep``: set the accumulator's global step."""
    _any_handle(handle).set_global_step(new_global_step)


ResourceAccumulatorSetGlobalStep = AccumulatorSetGlobalStep


def AccumulatorTakeGradient(  # noqa: N802
    handle: Any,
    num_required: Any,
    dtype: Any,
    name: str | None = None,
    *,
    timeout: float | None = None,
) -> np.ndarray:
    """TF's ``AccumulatorTakeGradient``: :meth:`ConditionalAccumulator.take_grad`, after
    checking ``dtype`` against the accumulator's (TF's "Signature mismatch" otherwise)."""
    return _take_dense(handle, num_required, dtype, timeout, "string_ref, int32->{}")


def ResourceAccumulatorTakeGradient(  # noqa: N802
    handle: Any,
    num_required: Any,
    dtype: Any,
    name: str | None = None,
    *,
    timeout: float | None = None,
) -> np.ndarray:
    """TF's ``ResourceAccumulatorTakeGradient``: :func:`AccumulatorTakeGradient` (TF's op
    of a resource handle; its "Signature mismatch" names a ``resource`` input)."""
    return _take_dense(handle, num_required, dtype, timeout, "resource, int32->{}")


def _take_dense(
    handle: Any, num_required: Any, dtype: Any, timeout: float | None, signature: str
) -> np.ndarray:
    acc = _handle(handle, _Dense)
    _check_dtype(acc, dtype, signature)
    return acc.take_grad(scalar_int(num_required, "num_required", bits=32), timeout=timeout)


def SparseAccumulatorTakeGradient(  # noqa: N802
    handle: Any,
    num_required: Any,
    dtype: Any,
    name: str | None = None,
    *,
    timeout: float | None = None,
) -> SparseGradient:
    """TF's ``SparseAccumulatorTakeGradient``: :meth:`SparseConditionalAccumulator.take_grad`
    (``(indices, values, shape)``), after checking ``dtype`` against the accumulator's."""
    acc = _handle(handle, _Sparse)
    _check_dtype(acc, dtype, "string_ref, int32->int64, {}, int64")
    return acc.take_grad(scalar_int(num_required, "num_required", bits=32), timeout=timeout)
