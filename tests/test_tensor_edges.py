"""Inputs of other frameworks at the edges (a review of the torch, jax and typing side):
torch tensors through ``accumulator.sync`` (sparse pairs, sparse COO gradients, bfloat16
parameters and updates), tensors numpy cannot read, a dense tensor given as sparse rows,
masked arrays, shapes given as tensors, and tensor subclasses defined outside torch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _helpers import fake_only, sync_job

import accumulator
from accumulator.sync import ParameterServer

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_a_sync_push_of_sparse_rows_as_a_pair_of_torch_tensors(target):
    # the README's (rows, values) pair, as torch tensors (np.size(tensor) was Tensor.size)
    ps, worker, step = sync_job(target, {"emb": np.zeros((10, 4), np.float32)}, {"emb"})
    assert worker.push(step, {"emb": (torch.tensor([1, 3]), torch.ones(2, 4))}) == {"emb": True}
    ps.step(1.0, timeout=5)
    want = np.zeros((10, 4), np.float32)
    want[[1, 3]] = -1.0
    np.testing.assert_array_equal(ps.params["emb"], want)
    worker.close()
    ps.close()


def test_a_sync_push_of_an_embeddings_sparse_gradient(target):
    # nn.Embedding(sparse=True)'s gradient: an uncoalesced COO tensor (row 1 twice), whose
    # .indices and .values are methods (they were taken for the rows and values)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 1, 3])).sum().backward()
    ps, worker, step = sync_job(target, {"emb": emb.weight}, {"emb"})
    before = ps.params["emb"]
    assert worker.push(step, {"emb": emb.weight.grad}) == {"emb": True}
    ps.step(1.0, timeout=5)
    changed = np.flatnonzero((ps.params["emb"] != before).any(axis=1))
    assert changed.tolist() == [1, 3]
    np.testing.assert_array_equal(ps.params["emb"][1], before[1] - 2.0)
    np.testing.assert_array_equal(ps.params["emb"][3], before[3] - 1.0)
    worker.close()
    ps.close()


@fake_only
def test_a_sync_job_of_torch_bfloat16_parameters_and_updates(target):
    ps, worker, step = sync_job(target, {"w": torch.zeros(4, dtype=torch.bfloat16,
                                                      requires_grad=True)})  # fmt: skip
    assert ps.params["w"].dtype == BF16
    worker.push(step, {"w": torch.ones(4, dtype=torch.bfloat16)})
    ps.step(lambda p, g, s: {"w": torch.full((4,), 3.0, dtype=torch.bfloat16)}, timeout=5)
    assert ps.params["w"].dtype == BF16 and ps.params["w"].tolist() == [3.0] * 4
    worker.close()
    ps.close()


@fake_only
def test_an_update_of_a_bfloat16_parameter_that_returns_complex_is_refused(target):
    # as for float32 parameters: ml_dtypes' own cast rule would drop the imaginary part
    ps, worker, step = sync_job(target, {"w": np.zeros(3, BF16)})
    worker.push(step, {"w": np.ones(3, BF16)})
    with pytest.raises(accumulator.InvalidArgumentError, match="complex"):
        ps.step(lambda p, g, s: {"w": p["w"].astype(np.float32) + 1j}, timeout=5)
    worker.close()
    ps.close()


@fake_only
def test_a_parameter_numpy_cannot_read_is_an_invalid_argument(target):
    ps = ParameterServer("job", replicas_to_aggregate=1, client=target.client())
    with pytest.raises(accumulator.InvalidArgumentError, match="parameter 'w'"):
        ps.initialize({"w": torch.ones(3, dtype=torch.complex32)})  # (torch warns: experimental)
    ps.close()


class _DLPack:
    """An object known to numpy by DLPack only."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, **kw):
        return self._tensor.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


@fake_only
@pytest.mark.parametrize("make", [
    lambda: torch.ones(3).to(torch.float8_e4m3fn),
    lambda: torch.ones(3, dtype=torch.complex32),
    lambda: torch.ones(3, device="meta"),
    lambda: _DLPack(torch.ones(3, dtype=torch.bfloat16)),
    lambda: _DLPack(torch.ones(3, requires_grad=True)),
], ids=["float8", "complex32", "meta", "dlpack-bfloat16", "dlpack-requires-grad"])  # fmt: skip
def test_a_tensor_numpy_cannot_read_is_an_invalid_argument(target, make):
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="d",
                                             client=target.client())  # fmt: skip
    with pytest.raises(accumulator.InvalidArgumentError, match="Cannot convert"):
        acc.apply_grad(make())
    assert acc.num_accumulated() == 0
    acc.close()


@fake_only
@pytest.mark.parametrize("make", [lambda: torch.ones(6, 3),
                                  lambda: torch.ones(6, 3).to_sparse_csr()],
                         ids=["dense", "csr"])  # fmt: skip
def test_a_dense_or_csr_tensor_is_no_indexed_slices(target, make):
    # a torch tensor has .indices() and .values() methods: not the rows of IndexedSlices
    acc = accumulator.SparseConditionalAccumulator(np.float32, (6, 3), shared_name="s",
                                                   client=target.client())  # fmt: skip
    with pytest.raises(accumulator.InvalidArgumentError, match="expected an IndexedSlices"):
        acc.apply_indexed_slices_grad(make())
    assert acc.num_accumulated() == 0
    acc.close()


@fake_only
def test_a_masked_array_is_refused_not_applied_with_its_masked_values(target):
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="m",
                                             client=target.client())  # fmt: skip
    with pytest.raises(accumulator.InvalidArgumentError, match="masked"):
        acc.apply_grad(np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0]))
    assert acc.num_accumulated() == 0
    acc.close()


@fake_only
def test_a_shape_given_as_a_tensor_is_a_shape(target):
    for shape in (torch.tensor([3, 2]), torch.Size([3, 2]), np.array([3, 2])):
        acc = accumulator.ConditionalAccumulator(np.float32, shape, shared_name="sh",
                                                 client=target.client())  # fmt: skip
        assert acc.shape == (3, 2)
        acc.close()
    with pytest.raises(accumulator.InvalidArgumentError, match="Invalid shape"):
        accumulator.ConditionalAccumulator(np.float32, torch.tensor([3.5, 2.0]),
                                           shared_name="sh", client=target.client())  # fmt: skip


class _Tagged(torch.Tensor):
    """A tensor subclass of the user's own module (not torch's)."""


@fake_only
def test_a_tensor_subclass_defined_outside_torch_is_a_tensor(target):
    acc = accumulator.ConditionalAccumulator(torch.bfloat16, (3,), shared_name="sub",
                                             client=target.client())  # fmt: skip
    grad = torch.ones(3, dtype=torch.bfloat16, requires_grad=True).as_subclass(_Tagged)
    assert acc.apply_grad(grad * 2)
    assert acc.take_grad(1).tolist() == [2.0, 2.0, 2.0]
    acc.close()


class _OnDevice(torch.Tensor):
    """A tensor numpy cannot read through ``__array__``, as a CUDA tensor (no GPU here)."""

    def __array__(self, dtype=None, copy=None):  # type: ignore[no-untyped-def]
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu()")


@fake_only
def test_scalar_arguments_given_as_tensors_numpy_cannot_read(target):
    """local_step, num_required and a new global step given as 0-d tensors on a device are
    read as gradients are (copied to the CPU), not refused as "not an integer scalar"."""
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="dev",
                                             client=target.client())  # fmt: skip
    assert acc.apply_grad(np.ones(3, np.float32), local_step=torch.tensor(0).as_subclass(_OnDevice))
    assert acc.take_grad(torch.tensor(1).as_subclass(_OnDevice)).tolist() == [1.0, 1.0, 1.0]
    acc.set_global_step(torch.tensor(7).as_subclass(_OnDevice))
    assert acc.global_step() == 7
    with pytest.raises(accumulator.InvalidArgumentError, match="must be an integer"):
        acc.apply_grad(np.ones(3, np.float32), local_step=torch.tensor(7.0).as_subclass(_OnDevice))
    acc.close()
