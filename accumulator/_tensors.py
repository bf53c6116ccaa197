"""Arrays of other frameworks as numpy arrays, without importing any of them.

torch is recognised by its types' module: a tensor is detached, moved to the CPU and read
without a copy where its layout allows (``Tensor.numpy()`` shares memory); bfloat16, which
numpy cannot hold, is read through its int16 bit pattern and viewed as ``ml_dtypes``'s
bfloat16, bit for bit. A sparse COO tensor becomes rows (indices along its first dimension,
the row values, the dense shape). Anything else with ``__array__`` (jax, cupy on the CPU)
goes through numpy; an object that has only ``__dlpack__`` through ``np.from_dlpack``.
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np


def _is_torch(value: Any) -> bool:
    """A torch object: of torch's own classes, or a tensor of a subclass defined elsewhere."""
    if type(value).__module__.split(".")[0] == "torch":
        return True
    torch = sys.modules.get("torch")  # (not imported: no torch object can exist)
    return torch is not None and isinstance(value, torch.Tensor)


def torch_dtype_name(dtype: Any) -> str | None:
    """``"float32"`` for ``torch.float32`` (any ``torch.dtype``), else None."""
    if _is_torch(dtype) and type(dtype).__name__ == "dtype":
        return str(dtype).rsplit(".", 1)[-1]
    return None


def _is_tensor(value: Any) -> bool:
    return _is_torch(value) and hasattr(value, "detach") and hasattr(value, "layout")


def _cpu_tensor(value: Any) -> Any:
    tensor = value.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.resolve_conj().resolve_neg()


def _tensor_to_numpy(tensor: Any) -> np.ndarray:
    torch = sys.modules["torch"]  # imported: the user passed one of its tensors
    if tensor.dtype == torch.bfloat16:
        bits: np.ndarray = tensor.view(torch.int16).numpy()
        return bits.view(ml_dtypes.bfloat16)
    out: np.ndarray = tensor.numpy()
    return out


def to_numpy(value: Any) -> Any:
    """``value`` as a numpy array when it is another framework's array (no copy where the
    layout allows); anything else is returned as it is, for ``np.asarray``."""
    if _is_tensor(value):
        tensor = _cpu_tensor(value)
        if tensor.layout != sys.modules["torch"].strided:  # sparse: its dense equivalent
            tensor = tensor.to_dense()
        return _tensor_to_numpy(tensor)
    if (
        not isinstance(value, np.ndarray)
        and not hasattr(value, "__array__")
        and hasattr(value, "__dlpack__")
    ):
        return np.from_dlpack(value)
    return value


def torch_sparse_rows(value: Any) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]] | None:
    """``(indices, values, dense_shape)`` of a torch sparse COO tensor, as the sparse
    accumulator takes them (rows along the first dimension); None for anything else."""
    if not _is_tensor(value) or value.layout != sys.modules["torch"].sparse_coo:
        return None
    tensor = _cpu_tensor(value).coalesce()
    shape = tuple(int(d) for d in tensor.shape)
    indices = tensor.indices()
    if tensor.sparse_dim() == 1:  # rows and their values as they are
        return indices[0].numpy(), _tensor_to_numpy(tensor.values()), shape
    rows = indices[0].unique()  # sparse in more dimensions: the rows any entry falls in
    dense = tensor.index_select(0, rows).to_dense()
    return rows.numpy(), _tensor_to_numpy(dense), shape
