"""Inputs a port of TF1 code passes, found by a differential review against TensorFlow:
strided sparse indices (a column of an id matrix), ``dtype=float``, integers that do not
fit the accumulator's integer dtype."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _helpers import aclient

import accumulator
from accumulator import aio
from accumulator.sync import ParameterServer, Worker

#: Checks made on the client before anything is sent: one backend shows them.
fake_only = pytest.mark.parametrize("target", ["fake"], indirect=True)

_IDS = np.array([[1, 7], [3, 8]])  # int64; its column 0, [1, 3], is sorted, unique, strided


@pytest.mark.parametrize("rows", [_IDS[:, 0], np.arange(8)[1:4:2]], ids=["column", "step"])
def test_sparse_indices_given_as_a_strided_view(target, rows):
    """Sorted, unique int64 rows not contiguous in memory raised numpy's ValueError
    ("the last axis must be contiguous") where TF accepts them."""
    assert rows.tolist() == [1, 3] and rows.dtype == np.int64 and rows.strides == (16,)
    acc = accumulator.SparseConditionalAccumulator(np.float32, (10, 2), shared_name="s",
                                                   client=target.client())  # fmt: skip
    assert acc.apply_grad(rows, np.ones((2, 2), np.float32))
    indices, values, _ = acc.take_grad(1)
    assert indices.tolist() == [1, 3] and values.tolist() == [[1, 1], [1, 1]]
    acc.close()

    async def main() -> list[int]:
        async with aio.SparseConditionalAccumulator(np.float32, (10, 2), shared_name="a",
                                                    client=aclient(target)) as a:  # fmt: skip
            assert await a.apply_grad(rows, np.ones((2, 2), np.float32))
            got, _, _ = await a.take_grad(1)
            return list(got)

    assert asyncio.run(main()) == [1, 3]


def test_a_sync_push_with_strided_sparse_rows_applies_every_parameter(target):
    """It applied the dense parameters, then failed on the sparse one: a half-applied push."""
    ps = ParameterServer("job", replicas_to_aggregate=1, sparse={"emb"}, fusion_bytes=0,
                         client=target.client())  # fmt: skip
    ps.initialize({"a": np.zeros(2, np.float32), "emb": np.zeros((10, 2), np.float32)})
    worker = Worker("job", worker_id="w0", client=target.client())
    step, _ = worker.pull(timeout=5)
    grads = {"a": np.ones(2, np.float32), "emb": (_IDS[:, 0], np.ones((2, 2), np.float32))}
    assert worker.push(step, grads) == {"a": True, "emb": True}
    ps.step(1.0, timeout=5)
    assert ps.params["emb"][[1, 3]].tolist() == [[-1, -1], [-1, -1]]
    worker.close()
    ps.close()
