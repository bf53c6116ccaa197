"""asyncio twins of redis-accumulator's classes, over ``redis.asyncio``.

The same accumulators (a synchronous and an asyncio object of one ``shared_name`` share one
accumulator in Redis), the same checks and protocol; the methods are coroutines::

    from accumulator import aio

    async with aio.ConditionalAccumulator(np.float32, (4,), shared_name="w",
                                          client="redis://localhost") as acc:
        await acc.apply_grad(np.ones(4), local_step=0)
        mean = await acc.take_grad(1)

Cancelling a task waiting in ``take_grad`` withdraws it and consumes nothing.
``accumulator.sync`` (the training-loop helper) stays synchronous.
"""

from __future__ import annotations

from ._accumulators import ConditionalAccumulator, SparseConditionalAccumulator
from ._core import AccumulatorBase
from ._functions import (
    delete_accumulator,
    describe_accumulator,
    list_accumulators,
    reset_container,
)

__all__ = [
    "AccumulatorBase",
    "ConditionalAccumulator",
    "SparseConditionalAccumulator",
    "delete_accumulator",
    "describe_accumulator",
    "list_accumulators",
    "reset_container",
]
