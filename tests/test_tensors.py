"""Tensors of other frameworks: torch dtypes and tensors (bfloat16 included, bit for bit),
torch sparse COO tensors as sparse gradients, DLPack objects; torch is never imported unless
the user passed one of its objects."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _helpers import assert_not_imported_by_numpy_use

import accumulator
from accumulator import _reduce
from accumulator._tensors import to_numpy

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)


def make(target, dtype, shape=(4, 3), **kw):
    return accumulator.ConditionalAccumulator(dtype, shape=shape, shared_name="t",
                                              client=target.client(), **kw)  # fmt: skip


@pytest.mark.parametrize(("torch_dtype", "numpy_dtype"), [
    ("float32", np.float32), ("float64", np.float64), ("float16", np.float16),
    ("bfloat16", BF16), ("int32", np.int32), ("complex64", np.complex64),
])  # fmt: skip
def test_a_torch_dtype_is_a_dtype(target, torch_dtype, numpy_dtype):
    acc = make(target, getattr(torch, torch_dtype))
    assert acc.dtype == np.dtype(numpy_dtype)


def test_bfloat16_tensors_round_trip_bit_for_bit(target):
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(4, 3, generator=gen).to(torch.bfloat16) for _ in range(3)]
    acc = make(target, torch.bfloat16)
    for g in grads:
        assert acc.apply_grad(g)
    got = acc.take_grad(3)
    assert got.dtype == BF16
    want = _reduce.dense_reduce([to_numpy(g) for g in grads], BF16, "MEAN")
    assert got.tobytes() == want.tobytes()
    # the same bits as torch's own tensors
    assert to_numpy(grads[0]).view(np.int16).tolist() == grads[0].view(torch.int16).tolist()


def test_float_tensors_with_autograd_strides_and_sparsity(target):
    acc = make(target, torch.float32)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    leaf = base.clone().requires_grad_(True)
    assert acc.apply_grad(base.T)  # not contiguous
    assert acc.apply_grad(leaf.T * 1)  # part of a graph
    assert acc.apply_grad(base.T.contiguous().to_sparse())  # a dense accumulator densifies
    np.testing.assert_array_equal(acc.take_grad(3), base.T.numpy())


def test_a_contiguous_cpu_tensor_is_read_without_a_copy():
    t = torch.ones(1000, dtype=torch.float32)
    assert np.shares_memory(to_numpy(t), t.numpy())


@pytest.mark.parametrize("sparse_dims", [1, 2])
def test_a_torch_sparse_coo_tensor_is_a_sparse_gradient(target, sparse_dims):
    dense = torch.zeros(6, 3)
    dense[1] = torch.tensor([1.0, 2.0, 3.0])
    dense[4, 2] = 5.0
    grad = dense.to_sparse(sparse_dims)
    acc = accumulator.SparseConditionalAccumulator(torch.float32, (6, 3), shared_name="sp",
                                                   client=target.client())  # fmt: skip
    assert acc.apply_indexed_slices_grad(grad)
    assert acc.apply_indexed_slices_grad(grad * 3)
    got = acc.take_indexed_slices_grad(2)
    assert got.indices.tolist() == [1, 4]
    np.testing.assert_array_equal(got.values, (dense * 2)[[1, 4]].numpy())
    assert list(got.dense_shape) == [6, 3]


class _DLPackOnly:
    """An array that speaks only DLPack (as some frameworks' arrays do)."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack__(self, **kwargs):
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_a_dlpack_object_is_read_without_a_copy(target):
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    assert np.shares_memory(to_numpy(_DLPackOnly(arr)), arr)
    acc = make(target, np.float32)
    assert acc.apply_grad(_DLPackOnly(arr))
    np.testing.assert_array_equal(acc.take_grad(1), arr)


def test_torch_is_not_imported_unless_the_user_passes_its_objects():
    assert_not_imported_by_numpy_use("torch")
