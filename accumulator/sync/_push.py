"""A worker's push, checked before anything is applied: every tensor as its accumulator's
``apply_grad`` will check it (dtype, shape, sparse indices and values, size); the
parameters fused into a bucket packed into its one gradient."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from .._codec import check_payload_size, format_shape, to_wire, wire_nbytes
from .._core import AccumulatorBase
from .._dense import ConditionalAccumulator
from .._errors import InvalidArgumentError
from .._fusion import MemberError, Unit, pack
from .._model import MAX_PAYLOAD_BYTES
from .._sparse import SparseConditionalAccumulator, slices_rows


def _sparse_parts(grad: Any) -> tuple[Any, Any]:
    """(indices, values) of a sparse gradient: IndexedSlices-like, SparseGradient, a torch
    sparse COO tensor or a pair."""
    if isinstance(grad, (tuple, list)) and len(grad) == 2:
        return grad[0], grad[1]
    try:
        indices, values, _ = slices_rows(grad)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            "a sparse parameter's gradient must be (indices, values), an IndexedSlices or a "
            f"torch sparse COO tensor, not {type(grad).__name__}"
        ) from None
    return indices, values


def validated_push(
    job: str,
    units: list[Unit],
    accs: Mapping[str, AccumulatorBase],
    grads: Mapping[str, Any],
) -> dict[str, tuple[Any, ...]]:
    """Every tensor checked as its accumulator's ``apply_grad`` will (dtype castable, shape,
    sparse indices and values, size), before any is applied: unit name -> the arguments of
    its apply (a fused bucket's: its parameters' gradients packed into one). Raises
    :class:`~accumulator.InvalidArgumentError` naming the parameter."""
    out: dict[str, tuple[Any, ...]] = {}
    for unit in units:
        name = unit.name
        try:
            if unit.fused:
                out[name] = (pack(unit, grads),)
            elif unit.kind == "sparse":
                indices, values = _sparse_parts(grads[name])
                acc = cast(SparseConditionalAccumulator, accs[name])
                # the sparse accumulator's own checks (TF's 1-5 and the declared dims)
                indices, vals = acc._validate(indices, values, None)  # (indices: int64 now)
                first = acc._first_error(vals)
                if first:
                    raise InvalidArgumentError(first)
                check_payload_size(indices.size * 8 + wire_nbytes(vals, unit.dtype),
                                   MAX_PAYLOAD_BYTES)  # fmt: skip
                # converted here (range checked: no value may become inf), so the apply
                # below cannot fail on it after another tensor went in
                out[name] = (indices, to_wire(vals, unit.dtype, "gradient values"))
            else:  # the dense accumulator's own checks and conversion
                out[name] = (cast(ConditionalAccumulator, accs[name])._checked(grads[name]),)
        except InvalidArgumentError as exc:
            param = exc.param if isinstance(exc, MemberError) else name
            shape = next(m.shape for m in unit.members if m.name == param)
            raise InvalidArgumentError(
                f"push to sync job {job!r}: the gradient of {param!r} "
                f"({unit.kind} {unit.dtype.name} {format_shape(shape)}) is invalid, "
                f"nothing was applied: {exc}"
            ) from exc
    return out
