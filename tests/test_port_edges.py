"""Inputs a port of TF1 code passes, found by a differential review against TensorFlow:
strided sparse indices (a column of an id matrix), ``dtype=float``, integers that do not
fit the accumulator's integer dtype."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _helpers import aclient, fake_only, sync_job

import accumulator
from accumulator import _codec, aio

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
    params = {"a": np.zeros(2, np.float32), "emb": np.zeros((10, 2), np.float32)}
    ps, worker, step = sync_job(target, params, {"emb"}, fusion_bytes=0)
    grads = {"a": np.ones(2, np.float32), "emb": (_IDS[:, 0], np.ones((2, 2), np.float32))}
    assert worker.push(step, grads) == {"a": True, "emb": True}
    ps.step(1.0, timeout=5)
    assert ps.params["emb"][[1, 3]].tolist() == [[-1, -1], [-1, -1]]
    worker.close()
    ps.close()


@fake_only
def test_dtype_float_is_tfs_float32(target):
    """``tf.as_dtype(float)`` is float32; numpy's float64 made accumulators of twice the
    memory and sums not bit-identical to TF's (numpy's meaning is ``np.float64``)."""
    acc = accumulator.ConditionalAccumulator(float, (1,), shared_name="f", client=target.client())
    assert acc.dtype == np.float32
    acc.apply_grad([0.1])
    assert acc.take_grad(1).tobytes() == np.float32(0.1).tobytes()
    acc.close()
    wide = accumulator.ConditionalAccumulator(np.float64, (1,), shared_name="d",
                                              client=target.client())  # fmt: skip
    assert wide.dtype == np.float64
    wide.close()


@fake_only
@pytest.mark.parametrize(("dtype", "grad", "bad"), [
    (np.int8, np.array([300, -1, 2]), "300"),
    (np.int8, np.array([1, -129, 2]), "-129"),
    (np.int8, np.array([200, 1, 1], np.uint8), "200"),
    (np.uint8, np.array([1, 256, 2], np.uint16), "256"),
    (np.int32, np.array([1, 2**40, 2]), str(2**40)),
    (np.int64, np.array([1, 2**63, 2], np.uint64), str(2**63)),
])  # fmt: skip
def test_integers_that_do_not_fit_are_refused_not_wrapped(target, dtype, grad, bad):
    """An int64 300 into int8 was stored as 44, where a float that overflows its dtype is
    refused; values that fit are taken, and a stale gradient is dropped as TF drops one."""
    acc = accumulator.ConditionalAccumulator(dtype, (3,), shared_name="i", client=target.client())
    with pytest.raises(accumulator.InvalidArgumentError, match=f"value {bad} .*it would wrap"):
        acc.apply_grad(grad)
    assert acc.num_accumulated() == 0
    assert acc.apply_grad(np.array([1, 2, 3], grad.dtype))
    assert acc.take_grad(1).tolist() == [1, 2, 3]
    assert acc.apply_grad(grad, local_step=0) is False  # stale (the step is 1 now)
    sparse = accumulator.SparseConditionalAccumulator(dtype, (4, 3), shared_name="si",
                                                      client=target.client())  # fmt: skip
    with pytest.raises(accumulator.InvalidArgumentError, match="it would wrap"):
        sparse.apply_grad([0], grad[None, :])
    assert sparse.num_accumulated() == 0
    acc.close()
    sparse.close()


@fake_only
@pytest.mark.parametrize(("dtype", "src"), [
    (np.int8, np.int64), (np.uint8, np.uint16), (np.int64, np.uint64), (np.uint32, np.uint64),
])  # fmt: skip
def test_integers_at_the_edges_of_the_dtype_are_taken(target, dtype, src):  # type: ignore[no-untyped-def]
    info = np.iinfo(dtype)
    acc = accumulator.ConditionalAccumulator(dtype, (2,), shared_name="e", client=target.client(),
                                             reduction_type="SUM")  # fmt: skip
    edges = [max(int(info.min), int(np.iinfo(src).min)), int(info.max)]
    assert acc.apply_grad(np.array(edges, src))
    assert acc.take_grad(1).tolist() == edges
    acc.close()


@fake_only
def test_an_empty_integer_gradient_is_taken(target):  # type: ignore[no-untyped-def]
    acc = accumulator.ConditionalAccumulator(np.int8, (0,), shared_name="z", client=target.client())
    assert acc.apply_grad(np.zeros(0, np.int64))
    acc.close()


@pytest.mark.parametrize(("spelling", "dtype"), [
    ("qint8", np.int8), ("quint8", np.uint8), ("qint16", np.int16), ("quint16", np.uint16),
    ("qint32", np.int32), (np.dtype([("qint8", "i1")]), np.int8),
    (np.dtype([("quint8", "u1")]), np.uint8), (">f4", np.float32), (">i8", np.int64),
])  # fmt: skip
def test_quantized_and_byte_ordered_spellings_resolve(spelling, dtype):  # type: ignore[no-untyped-def]
    got = _codec.resolve_dtype(spelling)
    assert got == np.dtype(dtype) and got.byteorder in "=|"
