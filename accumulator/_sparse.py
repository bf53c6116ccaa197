"""``SparseConditionalAccumulator`` and ``IndexedSlices``: TF's sparse accumulator in Redis.

A sparse gradient is stored as one payload: its int64 indices, then its values, both raw
little-endian. The values' inner dims are the round shape the scripts compare, so the
number of rows follows from the payload length.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import _reduce
from ._apply import apply
from ._claim import Claim
from ._codec import (
    as_array,
    check_payload_size,
    format_shape,
    parse_shape_token,
    scalar_int,
    shape_token,
    to_wire,
    wire_dtype,
    wire_nbytes,
)
from ._connection import Client
from ._core import AccumulatorBase
from ._errors import InvalidArgumentError
from ._model import MAX_PAYLOAD_BYTES, AccumulatorModel
from ._requests import Ops
from ._take import Cancel, take
from ._tensors import to_numpy, torch_sparse_rows

_INDEX_DTYPE = np.dtype("<i8")

#: int64's largest value as a uint64 (numpy < 2 compares a uint64 with a Python int as
#: float64, where 2**63 - 1 and 2**63 are the same number)
_INT64_MAX_U64 = np.uint64(np.iinfo(np.int64).max)


def slices_rows(grad: Any) -> tuple[Any, Any, Any]:
    """(indices, values, dense shape) of an ``IndexedSlices`` (ours or TF's) or a torch
    sparse COO tensor (its rows along the first dimension). A dense torch tensor has
    ``indices`` and ``values`` too, as methods: it is none of these."""
    rows = torch_sparse_rows(grad)
    if rows is not None:
        return rows
    indices, values = getattr(grad, "indices", None), getattr(grad, "values", None)
    if indices is None or values is None or callable(indices) or callable(values):
        raise InvalidArgumentError(
            "expected an IndexedSlices (with .indices, .values and .dense_shape) or a torch "
            f"sparse COO tensor, got {type(grad).__name__}"
        )
    return indices, values, getattr(grad, "dense_shape", None)


@dataclass(frozen=True, eq=False)
class IndexedSlices:
    """A sparse gradient: rows ``values[i]`` of a tensor at row ``indices[i]``. Compared and
    hashed by identity, as TF's (its fields are arrays, which have no single truth value)."""

    values: Any
    indices: Any
    dense_shape: Any = None


class SparseGradient(NamedTuple):
    """What :meth:`SparseConditionalAccumulator.take_grad` returns."""

    indices: np.ndarray  # int64, sorted ascending, unique
    values: np.ndarray  # accumulator dtype, shape (len(indices), *inner)
    shape: np.ndarray  # int64: [declared dim 0 or -1, *inner dims]


class SparseOps(AccumulatorModel):
    """The sparse accumulator's checks, apply and take steps, shared by the sync class and
    ``accumulator.aio``'s."""

    _kind = "sparse"

    # -- apply --------------------------------------------------------------------------------

    def _payload(self, indices: np.ndarray, values: np.ndarray, first_error: str) -> np.ndarray:
        """The wire payload of a validated gradient: its coalesced indices, then its values."""
        if first_error:
            # Values that do not fit the declared dims can never join a round: the first
            # gradient of a round is refused with first_error, and any later one differs from
            # the round's values shape (which fits the declared dims). The script still
            # decides atomically between stale and refused, so it gets the shape alone: the
            # values are never copied.
            return np.empty(0, dtype=np.uint8)
        check_payload_size(
            indices.size * _INDEX_DTYPE.itemsize + wire_nbytes(values, self.dtype),
            MAX_PAYLOAD_BYTES,
        )
        wire = to_wire(values, self.dtype, "gradient values")
        indices, values = _reduce.coalesce(indices, wire)
        payload = np.empty(indices.nbytes + values.nbytes, dtype=np.uint8)
        # (a strided view of sorted, unique indices comes back from coalesce as it is: a
        # column of an id matrix, x[::2]; view() needs them contiguous)
        payload[: indices.nbytes] = np.ascontiguousarray(indices, _INDEX_DTYPE).view(np.uint8)
        payload[indices.nbytes :] = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        return payload

    def _apply_grad_ops(
        self, grad_indices: Any, grad_values: Any, grad_shape: Any, local_step: Any
    ) -> Ops[bool]:
        step = scalar_int(local_step, "local_step")
        try:
            indices, values = self._validate(grad_indices, grad_values, grad_shape)
            inner = values.shape[1:]
            first_error = self._first_error(values)
            payload = self._payload(indices, values, first_error)
        except InvalidArgumentError:
            # stale input is dropped before any validation (ours too: size, values' range)
            if step < (yield from self._step_ops()):
                return False
            raise
        code, detail = yield from apply(self, payload, shape_token(inner), step, first_error)
        if code == -1:
            raise InvalidArgumentError(_round_mismatch(parse_shape_token(detail), values))
        if code == -2:
            raise InvalidArgumentError(detail.decode() if isinstance(detail, bytes) else detail)
        if code == 1 and first_error:  # cannot happen (see above); never pass it silently
            raise AssertionError("a gradient refused by its values shape was accepted")
        return code == 1

    def _validate(
        self, grad_indices: Any, grad_values: Any, grad_shape: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """TF's checks 1-5 (those that do not depend on the round), in TF's order, on the
        arrays' metadata: the values come back uncast (possibly a view), the indices int64."""
        try:
            indices = np.asarray(to_numpy(grad_indices))  # (a torch tensor's: from its device)
        except Exception as exc:  # noqa: BLE001 - ragged lists, objects whose __array__ fails
            raise InvalidArgumentError(f"Cannot convert the indices to an array: {exc}") from exc
        if indices.dtype.kind not in "iu" and indices.size:
            raise InvalidArgumentError(f"Indices must be integers, got dtype {indices.dtype}")
        if indices.ndim != 1:
            raise InvalidArgumentError(
                "Input indices should be vector but received shape: "
                f"{format_shape(indices.shape)}"
            )
        values = as_array(grad_values, self.dtype, "gradient values")
        if values.ndim == 0:
            raise InvalidArgumentError("Values cannot be 0-dimensional.")
        if values.shape[0] != indices.shape[0]:
            raise InvalidArgumentError(
                f"Expected {indices.shape[0]} non-empty input values, got {values.shape[0]}"
            )
        declared = self.shape
        if grad_shape is not None and declared is not None:
            given = _grad_shape(grad_shape)
            if len(given) < len(declared):
                raise InvalidArgumentError(
                    f"Shape mismatch: expected shape rank at least {len(declared)}, "
                    f"got {len(given)}"
                )
            for i, dim in enumerate(declared):
                if dim is not None and dim != given[i]:
                    raise InvalidArgumentError(
                        f"Shape mismatch: expected shape dim {i} to be {dim}, got {given[i]}"
                    )
        # the checks below allocate per index: refuse an impossible gradient before them
        check_payload_size(indices.size * _INDEX_DTYPE.itemsize, MAX_PAYLOAD_BYTES)
        if indices.dtype == np.uint64 and indices.size and indices.max() > _INT64_MAX_U64:
            i = int(np.argmax(indices > _INT64_MAX_U64))
            raise InvalidArgumentError(
                f"Shape mismatch: index of slice {i} is outside the int64 range: {indices[i]}"
            )
        indices = indices.astype(np.int64, copy=False)
        limit = declared[0] if declared else None
        bad = indices < 0 if limit is None else (indices < 0) | (indices >= limit)
        if bad.any():
            i = int(np.argmax(bad))
            if indices[i] < 0:
                raise InvalidArgumentError(
                    f"Shape mismatch: index of slice {i} is negative: {indices[i]}"
                )
            raise InvalidArgumentError(
                f"Shape mismatch: index of slice {i} exceeded limits of shape; "
                f"index is {indices[i]} exceeded {limit}"
            )
        return indices, values

    def _first_error(self, values: np.ndarray) -> str:
        """TF's check 6 for a round's first gradient: values against declared dims 1.."""
        declared = self.shape
        if not declared:
            return ""
        if values.ndim < len(declared):
            return (
                f"Shape mismatch: expected values rank at least {len(declared)}, "
                f"got {values.ndim}"
            )
        for i in range(1, len(declared)):
            if declared[i] is not None and declared[i] != values.shape[i]:
                return (
                    f"Shape mismatch: expected values dim {i} to be {declared[i]}, "
                    f"got {values.shape[i]}"
                )
        return ""

    # -- take ---------------------------------------------------------------------------------

    def _take_grad_ops(
        self,
        num_required: Any,
        timeout: Any,
        out: None = None,
        cancel: Cancel | None = None,
    ) -> Ops[SparseGradient]:
        """The take as a protocol step (``out`` is the dense accumulator's; none here)."""
        return (yield from take(self, num_required, timeout, self._merge_claim, cancel))

    def _merge_claim(self, claim: Claim) -> Ops[SparseGradient]:
        # runs before the take returns: if it fails (MemoryError...), the round goes back
        inner = claim.round_shape or ()
        dtype = wire_dtype(self.dtype)
        row_bytes = _INDEX_DTYPE.itemsize + int(np.prod(inner, dtype=np.int64)) * dtype.itemsize
        # received into a buffer kept between takes; the merge copies out of it (its result
        # never shares memory with the payloads)
        buf = self._receive_buffers.borrow(claim.nbytes)
        grads = []
        for payload in (yield from claim.reader.payloads(memoryview(buf))):
            rows = len(payload) // row_bytes
            cut = rows * _INDEX_DTYPE.itemsize
            idx = np.frombuffer(payload, dtype=_INDEX_DTYPE, count=rows)
            vals = np.frombuffer(payload, dtype=dtype, offset=cut).reshape((rows, *inner))
            grads.append((idx, vals))
        indices, values = _reduce.sparse_merge(grads, inner, self.dtype, self.reduction_type)
        del grads
        self._receive_buffers.give_back(buf)
        declared = self.shape
        dim0 = declared[0] if declared else None
        shape = np.array([-1 if dim0 is None else dim0, *inner], dtype=np.int64)
        return SparseGradient(indices.astype(np.int64, copy=False), values, shape)


class SparseConditionalAccumulator(AccumulatorBase, SparseOps):
    """A sparse gradient accumulator shared by every process that opens its ``shared_name``.

    Rows are summed per index; each row keeps its own contribution count, and MEAN divides
    each row by it. Unsorted or duplicate indices are coalesced first (TF returns
    order-dependent duplicates there).

    What is shared across hosts (every process opening the same ``shared_name`` in the same
    ``container`` on the same server), and the arguments (``client``...): as for
    :class:`ConditionalAccumulator`, and so are ``min_replicas``, ``wait_aof``,
    ``spread_parts`` and ``retry_window``. Sparse
    rounds are always summed by the taker.
    """

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "sparse_conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        client: Client = None,
        container: str = "",
        max_pending_bytes: int | None = None,
        min_replicas: int = 0,
        wait_aof: bool = False,
        spread_parts: bool | None = None,
        retry_window: float | None = None,
    ) -> None:
        super().__init__(dtype, shape, shared_name, name, reduction_type, client=client,
                         container=container, max_pending_bytes=max_pending_bytes,
                         min_replicas=min_replicas, wait_aof=wait_aof,
                         spread_parts=spread_parts, retry_window=retry_window)  # fmt: skip

    def apply_grad(
        self,
        grad_indices: Any,
        grad_values: Any,
        grad_shape: Any = None,
        local_step: Any = 0,
        name: str | None = None,
    ) -> bool:
        """Add a sparse gradient to the current round; ``False`` if dropped as stale.

        Invalid input raises :class:`InvalidArgumentError` with TF's message (nothing
        changes) unless the gradient is stale: TF checks staleness first.
        """
        return self._run(self._apply_grad_ops(grad_indices, grad_values, grad_shape, local_step))

    def apply_indexed_slices_grad(
        self, grad: Any, local_step: Any = 0, name: str | None = None
    ) -> bool:
        """:meth:`apply_grad` for an ``IndexedSlices`` (ours or TF's), or a torch sparse COO
        tensor (its rows along the first dimension)."""
        return self.apply_grad(*slices_rows(grad), local_step)

    def take_grad(
        self,
        num_required: Any,
        name: str | None = None,
        *,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> SparseGradient:
        """Block until ``num_required`` gradients arrived, then return the merged rows
        ``(indices, values, shape)`` and advance the global step. ``timeout`` and
        ``cancel`` as for the dense accumulator's ``take_grad``."""
        return self._run(self._take_grad_ops(num_required, timeout, None, cancel))

    def take_indexed_slices_grad(
        self,
        num_required: Any,
        name: str | None = None,
        *,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> IndexedSlices:
        """:meth:`take_grad` as an ``IndexedSlices``."""
        indices, values, shape = self.take_grad(num_required, name, timeout=timeout,
                                                cancel=cancel)  # fmt: skip
        return IndexedSlices(values=values, indices=indices, dense_shape=shape)


def _grad_shape(grad_shape: Any) -> tuple[int, ...]:
    """The given dense shape as a tuple (``-1`` for an unknown dim); TensorShape too.

    As TF, its values are read flat and not judged themselves: only the declared dims are
    compared with them (``[-5, 2]`` fits a declared ``[None, 2]``, extra dims are ignored)."""
    if hasattr(grad_shape, "rank") and hasattr(grad_shape, "as_list"):  # tf.TensorShape
        if grad_shape.rank is None:
            raise InvalidArgumentError("grad_shape must have a known rank")
        grad_shape = [-1 if d is None else d for d in grad_shape.as_list()]
    try:
        arr = np.asarray(grad_shape)
    except Exception as exc:  # noqa: BLE001 - ragged lists, objects whose __array__ fails
        raise InvalidArgumentError(f"Invalid grad_shape: {exc}") from exc
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"grad_shape must hold integers, got {format_shape(arr.shape)} {arr.dtype} values"
        )
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidArgumentError("grad_shape must hold int64 values")
    return tuple(int(d) for d in arr.reshape(-1).astype(np.int64))


def _round_mismatch(round_inner: tuple[int, ...], values: np.ndarray) -> str:
    """TF's text for values that differ from the round's first gradient."""
    rank = len(round_inner) + 1
    if values.ndim != rank:
        return f"Shape mismatch: expected values rank {rank}, got {values.ndim}"
    for i in range(1, rank):
        if round_inner[i - 1] != values.shape[i]:
            return (
                f"Shape mismatch: expected values dim {i} to be {round_inner[i - 1]}, "
                f"got {values.shape[i]}"
            )
    return "Shape mismatch"  # unreachable: the round shape differed
