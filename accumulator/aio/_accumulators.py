"""``accumulator.aio``'s dense and sparse accumulators: the synchronous classes' checks and
protocol (``DenseOps``, ``SparseOps``), driven by the asyncio driver."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._dense import DenseOps
from .._sparse import IndexedSlices, SparseGradient, SparseOps, slices_rows
from .._take import take
from ._connection import AsyncClient
from ._core import AccumulatorBase


class ConditionalAccumulator(AccumulatorBase, DenseOps):
    """The asyncio twin of :class:`accumulator.ConditionalAccumulator`: the same constructor,
    the same accumulator in Redis (a sync and an async object of one ``shared_name`` share
    it), ``async`` methods.

    ``client``: a ``redis.asyncio.Redis`` (its settings are kept; every accumulator opened
    from it shares its pools), a URL, or ``None`` (``ACCUMULATOR_REDIS_URL``, ``REDIS_URL``,
    ``redis://localhost``). The constructor does no I/O: the accumulator is opened (created,
    or checked against the stored definition) by ``await acc``, ``async with acc`` or its
    first operation. Close it with ``await acc.aclose()`` (or ``async with``).

    Cancelling a task waiting in :meth:`take_grad` withdraws its taker and consumes nothing.
    An operation's commit is never cut in half: a cancel that arrives while an apply, or a
    take's final step (one round trip after its round was read), is in flight lets it finish
    and return its result.
    """

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        client: AsyncClient = None,
        container: str = "",
        max_pending_bytes: int | None = None,
        min_replicas: int = 0,
        wait_aof: bool = False,
        sum_in_redis: bool | None = None,
        spread_parts: bool | None = None,
        retry_window: float | None = None,
    ) -> None:
        super().__init__(dtype, shape, shared_name, name, reduction_type, client=client,
                         container=container, max_pending_bytes=max_pending_bytes,
                         sum_in_redis=sum_in_redis, min_replicas=min_replicas,
                         wait_aof=wait_aof, spread_parts=spread_parts,
                         retry_window=retry_window)  # fmt: skip

    async def apply_grad(self, grad: Any, local_step: Any = 0, name: str | None = None) -> bool:
        """Add ``grad`` to the current round; ``False`` if dropped as stale (see
        :meth:`accumulator.ConditionalAccumulator.apply_grad`)."""
        return await self._run(self._apply_grad_ops(grad, local_step))

    async def take_grad(
        self,
        num_required: Any,
        name: str | None = None,
        *,
        timeout: float | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Wait until ``num_required`` gradients arrived (and earlier takers are served),
        then return their mean or sum and advance the global step. ``timeout`` and ``out``
        as for :meth:`accumulator.ConditionalAccumulator.take_grad`; cancel the task to
        withdraw (nothing is consumed)."""
        return await self._run(self._take_grad_ops(num_required, timeout, out))


class SparseConditionalAccumulator(AccumulatorBase, SparseOps):
    """The asyncio twin of :class:`accumulator.SparseConditionalAccumulator` (opening,
    closing, ``client`` and cancellation as for :class:`ConditionalAccumulator`)."""

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "sparse_conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        client: AsyncClient = None,
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

    async def apply_grad(
        self,
        grad_indices: Any,
        grad_values: Any,
        grad_shape: Any = None,
        local_step: Any = 0,
        name: str | None = None,
    ) -> bool:
        """Add a sparse gradient to the current round; ``False`` if dropped as stale (see
        :meth:`accumulator.SparseConditionalAccumulator.apply_grad`)."""
        return await self._run(
            self._apply_grad_ops(grad_indices, grad_values, grad_shape, local_step)
        )

    async def apply_indexed_slices_grad(
        self, grad: Any, local_step: Any = 0, name: str | None = None
    ) -> bool:
        """:meth:`apply_grad` for an ``IndexedSlices`` (ours or TF's), or a torch sparse COO
        tensor."""
        return await self.apply_grad(*slices_rows(grad), local_step)

    async def take_grad(
        self, num_required: Any, name: str | None = None, *, timeout: float | None = None
    ) -> SparseGradient:
        """Wait until ``num_required`` gradients arrived, then return the merged rows
        ``(indices, values, shape)`` and advance the global step."""
        return await self._run(take(self, num_required, timeout, self._merge_claim))

    async def take_indexed_slices_grad(
        self, num_required: Any, name: str | None = None, *, timeout: float | None = None
    ) -> IndexedSlices:
        """:meth:`take_grad` as an ``IndexedSlices``."""
        indices, values, shape = await self.take_grad(num_required, timeout=timeout)
        return IndexedSlices(values=values, indices=indices, dense_shape=shape)
