"""Dtypes, shapes and payload bytes: how arrays become Redis values and back.

Payloads are raw little-endian bytes in the accumulator dtype (never pickle); metadata is
msgpack. Shapes are printed the way TensorFlow prints them in its errors: ``[3,2]``,
``[?,2]``, ``[]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import ml_dtypes
import msgpack
import numpy as np

from ._errors import InvalidArgumentError
from ._tensors import to_numpy, torch_dtype_name

Shape = tuple[int | None, ...] | None

_SUPPORTED = {
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
}  # fmt: skip
_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}
# TF's quantized types have no arithmetic of their own: accumulate their storage type.
_TF_ALIASES = {
    "qint8": "int8", "quint8": "uint8", "qint16": "int16", "quint16": "uint16", "qint32": "int32",
    "half": "float16", "float": "float32", "double": "float64",
}  # fmt: skip

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def resolve_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a numpy dtype/type, a name, or anything with ``.as_numpy_dtype``.

    Only dtype-like objects are accepted: ``np.dtype(None)`` (float64) and ``np.dtype`` of an
    array or a scalar (its dtype) are numpy conveniences that would hide a mistake here.
    """
    dtype = torch_dtype_name(dtype) or dtype  # torch.float32 -> "float32"
    if hasattr(dtype, "as_numpy_dtype"):  # tf.DType
        name = getattr(dtype, "name", None)
        dtype = _TF_ALIASES.get(name, name) if name in _TF_ALIASES else dtype.as_numpy_dtype
    if isinstance(dtype, str):
        dtype = _TF_ALIASES.get(dtype, dtype)
    elif dtype is float:  # TF's meaning (tf.as_dtype(float)), not numpy's float64
        dtype = "float32"
    if not isinstance(dtype, (np.dtype, type, str)):
        raise InvalidArgumentError(f"Unsupported accumulator dtype: {dtype!r}")
    try:
        resolved = np.dtype(dtype)
    except Exception as exc:  # noqa: BLE001 - numpy raises TypeError or ValueError here
        raise InvalidArgumentError(f"Unsupported accumulator dtype: {dtype!r}") from exc
    if resolved.fields and len(resolved.fields) == 1:  # tf.qint8.as_numpy_dtype and friends
        resolved = next(iter(resolved.fields.values()))[0]
    if resolved.name not in _SUPPORTED:
        raise InvalidArgumentError(
            f"Unsupported accumulator dtype: {resolved.name} "
            f"(supported: {', '.join(sorted(_SUPPORTED))})"
        )
    return cast("np.dtype[Any]", resolved.newbyteorder("="))


def wire_dtype(dtype: np.dtype) -> np.dtype:
    """The little-endian dtype used on the wire (a no-op on x86 and ARM)."""
    return dtype if dtype.itemsize == 1 else dtype.newbyteorder("<")


def _kind(dtype: np.dtype) -> str:
    return "f" if dtype == _BFLOAT16 else dtype.kind


def can_cast(src: np.dtype, dst: np.dtype) -> bool:
    """numpy's ``same_kind`` rule; ml_dtypes' bfloat16 casts are too permissive, so rank kinds."""
    if src == _BFLOAT16 or dst == _BFLOAT16:
        return _KIND_RANK.get(_kind(src), 99) <= _KIND_RANK[_kind(dst)]
    return bool(np.can_cast(src, dst, casting="same_kind"))


def as_array(value: Any, dtype: np.dtype, what: str = "gradient") -> np.ndarray:
    """``value`` as an array *without copying or casting it* (a broadcast view stays a view),
    after checking that its dtype can be cast to ``dtype``.

    Callers check the shape on this array's metadata first and only then call
    :func:`to_wire`: a wrong-shaped ``np.broadcast_to(1.0, (2**31, 4))`` is refused without
    allocating the 32 GiB a cast would.
    """
    if isinstance(value, np.ma.MaskedArray):  # np.asarray would apply its masked values
        raise InvalidArgumentError(
            f"the {what} is a masked array, whose masked values would be applied: fill them "
            "first (.filled(0))"
        )
    try:
        arr = np.asarray(to_numpy(value))  # (torch tensors, DLPack objects first)
    except Exception as exc:  # noqa: BLE001 - whatever the object raised, the input is bad
        raise InvalidArgumentError(f"Cannot convert the {what} to an array: {exc}") from exc
    if arr.dtype.kind not in "biufc" and arr.dtype != _BFLOAT16:
        raise InvalidArgumentError(
            f"Cannot convert a {what} of dtype {arr.dtype} to the accumulator dtype {dtype.name}"
        )
    if not can_cast(arr.dtype, dtype):
        raise InvalidArgumentError(
            f"Cannot convert a {what} of dtype {arr.dtype.name} to the accumulator dtype "
            f"{dtype.name} (only same-kind casts are allowed)"
        )
    return arr


def to_wire(arr: np.ndarray, dtype: np.dtype, what: str = "gradient") -> np.ndarray:
    """The C-ordered little-endian array in ``dtype`` (no copy when ``arr`` already is one).

    A cast that would turn finite values into infinities (``1e40`` into float32, ``70000``
    into float16) is an :class:`InvalidArgumentError`, not a silent ``inf`` in the sum.
    """
    # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(wire_dtype(dtype), order="C", copy=False)
    if out is not arr and _kind(dtype) == "f" and _may_overflow(arr.dtype, dtype):
        lost = ~np.isfinite(out)
        if lost.any():
            lost &= np.isfinite(arr)
            if lost.any():
                _out_of_range(arr, lost, dtype, what, "become inf")
    elif out is not arr and _kind(dtype) in "iu" and _may_wrap(arr.dtype, dtype) and arr.size:
        # (an int64 300 into int8 would wrap to 44: refused as an overflowing float is)
        info = np.iinfo(dtype)
        low, high = arr.min(), arr.max()
        if low < info.min or high > info.max:
            _out_of_range(arr, (arr < info.min) | (arr > info.max), dtype, what, "wrap around")
    return out


def _out_of_range(arr: np.ndarray, lost: np.ndarray, dtype: np.dtype, what: str,
                  becomes: str) -> NoReturn:  # fmt: skip
    i = int(np.argmax(lost.reshape(-1)))
    raise InvalidArgumentError(
        f"Cannot convert the {what} to {dtype.name}: value {arr.reshape(-1)[i].item()!r} (element "
        f"{i}) is out of its range (it would {becomes})"
    )


def _may_wrap(src: np.dtype, dst: np.dtype) -> bool:
    """Whether casting the integer (or bool) dtype src to the integer dtype dst can wrap."""
    if src.kind == "b":
        return False
    if src.kind not in "iu":
        return False  # (floats into integers: not a same-kind cast, refused before)
    a, b = np.iinfo(src), np.iinfo(dst)
    return bool(a.min < b.min or a.max > b.max)


def _may_overflow(src: np.dtype, dst: np.dtype) -> bool:
    """Whether casting src to the float dtype dst can overflow (a narrower float, or any
    integer into float16/bfloat16)."""
    if _kind(src) in "iu":
        return dst.itemsize <= 2
    return _kind(src) == "f" and ml_dtypes.finfo(src).max > ml_dtypes.finfo(dst).max


def to_array(value: Any, dtype: np.dtype, what: str = "gradient") -> np.ndarray:
    """Convert a gradient (numpy, list, anything with ``__array__``) to a C-ordered wire array.

    Copies (casts) before any shape check: prefer :func:`as_array`, check, then :func:`to_wire`.
    """
    return to_wire(as_array(value, dtype, what), dtype, what)


def wire_nbytes(arr: np.ndarray, dtype: np.dtype) -> int:
    """Bytes ``arr`` will take on the wire in ``dtype``, from its metadata (nothing allocated)."""
    return int(arr.size) * dtype.itemsize


def check_payload_size(nbytes: int, limit: int) -> None:
    """Refuse a gradient larger than one payload may be, before anything is built."""
    if nbytes > limit:
        raise InvalidArgumentError(
            f"gradient of {nbytes} bytes exceeds the {limit} byte limit of one payload; "
            "split the parameter into several accumulators"
        )


def to_payload(arr: np.ndarray) -> memoryview:
    """Zero-copy bytes of a C-contiguous array, as a flat ``B`` memoryview.

    The cast to bytes matters: redis-py's Python packer sends ``len(view)``, which is the
    element count for a typed view (a silently truncated value).
    """
    return arr.reshape(-1).view(np.uint8).data


def from_payload(data: bytes | memoryview, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    arr = np.frombuffer(data, dtype=wire_dtype(dtype))
    return arr.reshape(tuple(shape))


def _is_int(value: Any) -> bool:
    """A Python or numpy integer; not a bool (``True`` is an int to Python, not to us), nor a
    ``np.timedelta64`` (a ``np.signedinteger`` subclass that ``int()`` cannot convert)."""
    if isinstance(value, np.generic):
        return value.dtype.kind in "iu"
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_shape(shape: Any) -> Shape:
    """None (unknown rank) or a tuple of ints and None; accepts TensorShape, lists, -1 dims."""
    if shape is None:
        return None
    if hasattr(shape, "rank") and hasattr(shape, "as_list"):  # tf.TensorShape
        if shape.rank is None:
            return None
        shape = shape.as_list()
    if _is_int(shape):
        shape = (int(shape),)
    elif not isinstance(shape, (tuple, list, np.ndarray)) and (
        hasattr(shape, "__array__") or hasattr(shape, "__dlpack__")
    ):  # a torch or jax vector of dims, as numpy's
        try:
            shape = np.asarray(to_numpy(shape))
        except Exception as exc:  # noqa: BLE001 - whatever the object raised, it is no shape
            raise InvalidArgumentError(f"Invalid shape: {shape!r}") from exc
    if isinstance(shape, (str, bytes, bool, np.bool_, dict)) or (
        isinstance(shape, np.ndarray) and shape.ndim != 1
    ):
        raise InvalidArgumentError(f"Invalid shape: {shape!r}")
    try:
        dims = tuple(shape)
    except TypeError as exc:
        raise InvalidArgumentError(f"Invalid shape: {shape!r}") from exc
    out: list[int | None] = []
    for dim in dims:
        if hasattr(dim, "value"):  # tf.compat.v1.Dimension
            dim = dim.value
        if dim is None or (_is_int(dim) and int(dim) == -1):
            out.append(None)
        elif _is_int(dim) and 0 <= int(dim) < 2**63:
            out.append(int(dim))
        else:
            raise InvalidArgumentError(f"Invalid shape: {shape!r}")
    return tuple(out)


def format_shape(shape: Shape | Sequence[int | None]) -> str:
    """TF's debug string: ``[3,2]``, ``[?,2]``, ``[]``; ``<unknown>`` for unknown rank."""
    if shape is None:
        return "<unknown>"
    return "[" + ",".join("?" if d is None else str(d) for d in shape) + "]"


def shape_compatible(declared: Shape, actual: Sequence[int]) -> bool:
    if declared is None:
        return True
    return len(declared) == len(actual) and all(
        d is None or d == a for d, a in zip(declared, actual, strict=True)
    )


def shape_token(shape: Sequence[int]) -> str:
    """The round shape as the scripts compare it: ``"3,2"``; ``""`` is a scalar."""
    return ",".join(str(int(d)) for d in shape)


def parse_shape_token(token: str | bytes) -> tuple[int, ...]:
    if isinstance(token, bytes):
        token = token.decode()
    return tuple(int(d) for d in token.split(",")) if token else ()


def scalar_int(value: Any, what: str, bits: int = 64) -> int:
    """An int64 scalar argument (local_step, num_required, ...): a Python or numpy integer or
    a 0-d integer array. bools, floats (also integral ones), strings and anything of another
    shape are refused, as are values outside int64 (``bits``: another signed width's range,
    int32 for TF's num_required)."""
    if _is_int(value):
        out = int(value)
    else:
        if isinstance(value, (bool, np.bool_)):
            raise InvalidArgumentError(f"{what} must be an integer scalar, got {value!r}")
        try:
            arr = np.asarray(to_numpy(value))  # (a tensor on a GPU: copied, as gradients are)
        except Exception:  # noqa: BLE001 - ragged lists and objects whose __array__ fails
            raise InvalidArgumentError(
                f"{what} must be an integer scalar, got {_short(value)}"
            ) from None
        if arr.ndim != 0:
            raise InvalidArgumentError(
                f"Argument {what} must be scalar, but had bad shape {format_shape(arr.shape)}"
            )
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{what} must be an integer, got {_short(value)}")
        out = int(arr)
    if not -(2 ** (bits - 1)) <= out < 2 ** (bits - 1):  # TF's steps are int64
        raise InvalidArgumentError(f"{what} must fit in int{bits}, got {_short(out)}")
    return out


def reply_text(value: Any) -> str:
    """A Redis reply (or a field of one) as text: ``""`` for None, bytes decoded as UTF-8
    (bytes that are not, from a foreign writer, replaced), anything else ``str()``."""
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Definition:
    """What fixes an accumulator at creation; compared when another process opens it."""

    kind: str  # "dense" | "sparse"
    dtype: np.dtype
    shape: Shape
    reduction_type: str

    def pack(self) -> bytes:
        shape = None if self.shape is None else [-1 if d is None else d for d in self.shape]
        packed = msgpack.packb(
            {"kind": self.kind, "dtype": self.dtype.name, "shape": shape,
             "reduction": self.reduction_type},
            use_bin_type=True,
        )  # fmt: skip
        return cast(bytes, packed)

    @classmethod
    def unpack(cls, data: bytes) -> Definition:
        raw = msgpack.unpackb(data, raw=False)
        return cls(raw["kind"], resolve_dtype(raw["dtype"]), normalize_shape(raw["shape"]),
                   raw["reduction"])  # fmt: skip

    def describe(self) -> str:
        return f"{self.kind} {self.dtype.name} {format_shape(self.shape)} {self.reduction_type}"
