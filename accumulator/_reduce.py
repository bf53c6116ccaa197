"""Pure numeric reductions behind the accumulators (no Redis, no I/O).

Everything here is about reproducing TensorFlow's accumulator arithmetic bit for bit
(float16/float32/float64) and extending it sanely to bfloat16, complex and integer dtypes:

* dense: ``acc = g1; acc = acc + g2; ...`` strictly in apply order, every step rounded to the
  accumulator dtype, then ``acc / dtype(count)`` for MEAN (complex: each part divided by the
  real count; integers: truncating; see :func:`divide`);
* sparse: per row, the first contribution is copied and later ones are added in apply order;
  MEAN divides each row by its own contribution count.

Numpy reductions (``np.sum``, ``np.add.reduce``, ``np.add.reduceat``) must not be used for
sums: they sum pairwise / in unrolled SIMD order (float32 sums of 1000 values differ from the
sequential ones in the last bits), and for float16 they even accumulate in float32 and round
once at the end (2048 + twenty 1s gives 2068, where TF's per-step float16 rounding gives 2048).
Only elementwise ``np.add`` (and the unbuffered ``np.add.at``) round at every step like TF.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any, cast

import ml_dtypes
import numpy as np

__all__ = ["coalesce", "dense_reduce", "dense_sum", "divide", "reduce_into", "sparse_merge"]

_REDUCTIONS = ("SUM", "MEAN")


def _check_reduction(reduction: str) -> None:
    # TF accepts exactly these two spellings; anything else is a programming error upstream.
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'SUM' or 'MEAN', got {reduction!r}")


def _is_float_like(dtype: np.dtype) -> bool:
    """numpy floats plus ml_dtypes' extension floats (bfloat16 has kind 'V' in numpy)."""
    if np.issubdtype(dtype, np.floating):
        return True
    if dtype.kind != "V":
        return False
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


def _check_dtype(dtype: np.dtype) -> np.dtype:
    return _checked_dtype(np.dtype(dtype))


@cache
def _checked_dtype(dtype: np.dtype) -> np.dtype:
    # cached: numpy's issubdtype costs ~2 µs a call, as much as a small take's sum
    if (
        np.issubdtype(dtype, np.integer)
        or np.issubdtype(dtype, np.complexfloating)
        or _is_float_like(dtype)
    ):
        return dtype
    raise TypeError(f"unsupported accumulator dtype: {dtype}")


# TF's CPU kernels run with the FPU in flush-to-zero / denormals-are-zero mode: a subnormal
# float32/float64 input counts as zero and a subnormal result becomes (signed) zero. numpy
# keeps IEEE subnormals, so for these two dtypes we emulate the mode. float16 is computed
# through float32 in both TF and numpy, so its subnormals survive in both.
_UInt = np.unsignedinteger[Any]
_FTZ_DTYPES: dict[np.dtype, type[_UInt]] = {
    np.dtype(np.float32): np.uint32,
    np.dtype(np.float64): np.uint64,
}


def _ftz(dtype: np.dtype) -> bool:
    return dtype in _FTZ_DTYPES


# Bit tests, not float comparisons: under denormals-are-zero (which a library like TF may
# have switched on in this very thread) a subnormal compares equal to zero.
@cache
def _ftz_consts(dtype: np.dtype) -> tuple[type[_UInt], _UInt, _UInt, _UInt]:
    """(unsigned view type, magnitude mask, bits of tiny, bits of the 'small' bound).

    If no input has a nonzero magnitude below tiny * 2**(nmant + 1), every partial sum is a
    multiple of 2 * tiny (the smallest ulp among the inputs), hence zero or normal: the sum
    cannot produce a subnormal and needs no flushing.
    """
    utype = _FTZ_DTYPES[dtype]
    info = np.finfo(dtype)
    mask = ~(utype(1) << utype(8 * dtype.itemsize - 1))
    # 0-d indexing gives numpy scalars (typed as arrays by numpy's stubs)
    tiny = cast(_UInt, np.array(info.tiny, dtype).view(utype)[()])
    small = cast(_UInt, np.array(info.tiny * 2.0 ** (info.nmant + 1), dtype).view(utype)[()])
    return utype, mask, tiny, small


def _all_abs_at_least(x: np.ndarray, bound: np.generic) -> bool:
    """``all(|x| >= bound)`` in small blocks: a temporary the size of ``x`` would come from a
    fresh mmap (page faults cost more than the test itself). Under DAZ a subnormal compares
    as zero, so any doubt answers False."""
    flat = x.reshape(-1)
    for start in range(0, flat.size, 32768):
        # minimum returns any NaN, and "not NaN >= bound" is a doubt (the exact bit test
        # follows). Not fmin: with a signaling NaN in the block it can skip both the NaN and
        # a subnormal (numpy 2.4 on x86: fmin.reduce of |[2**-133, sNaN, 4e-31]| gives 4e-31)
        if not np.minimum.reduce(np.abs(flat[start : start + 32768])) >= bound:
            return False
    return True


def _has_small(x: np.ndarray, dtype: np.dtype) -> bool:
    """Whether ``x`` holds a nonzero value small enough to make flushing matter."""
    if x.size == 0:
        return False
    x = np.asarray(x, dtype)
    utype, mask, _, small_bits = _ftz_consts(dtype)
    if _all_abs_at_least(x, small_bits.view(dtype)):
        return False  # common case; any doubt (zeros, DAZ) takes the exact bit test
    mag = np.bitwise_and(x.view(utype), mask)
    small = mag < small_bits
    # two stages: the common case (no small value at all) costs two passes
    return bool(small.any() and mag[small].any())


#: Up to this many elements in all, the inputs of a block are checked in one pass over their
#: concatenation (:func:`_any_small`): below it numpy's cost per call, not per element, rules.
_TOGETHER = 16 * 1024


def _any_small(xs: Sequence[np.ndarray], dtype: np.dtype) -> bool:
    """``any(_has_small(x, dtype) for x in xs)``: whether some value of some input makes
    flushing matter. Small inputs are looked at together (a 4 x 1 Ki-element take: ~25 µs
    less than one look per input); the answer is the same, as it is about single elements."""
    if len(xs) > 1 and sum(x.size for x in xs) <= _TOGETHER:
        return _has_small(np.concatenate([np.asarray(x, dtype).reshape(-1) for x in xs]), dtype)
    return any(_has_small(x, dtype) for x in xs)


def _flush(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Subnormals to signed zero, in place when ``x`` is writable, else on a copy."""
    utype, mask, tiny_bits, _ = _ftz_consts(dtype)
    if x.size == 0 or _all_abs_at_least(x, tiny_bits.view(dtype)):
        return x  # common case; any doubt (zeros, DAZ) takes the exact bit test
    mag = np.bitwise_and(x.view(utype), mask)
    sub = mag < tiny_bits
    if not sub.any():
        return x
    sub &= mag != 0
    if not sub.any():
        return x
    if not x.flags.writeable:
        x = x.copy()
    bits = x.view(utype)
    bits[sub] &= ~mask  # keep only the sign: a signed zero
    return x


def _quiet() -> np.errstate:
    """numpy's floating-point warnings off: a sum past the dtype's range is inf, a NaN or an
    inf - inf is NaN, as TF's, silently (numpy warns of "overflow" and "invalid value")."""
    return np.errstate(over="ignore", invalid="ignore")


def _floats(x: np.ndarray) -> np.ndarray:
    """A complex array as its real and imaginary parts side by side (a view): complex
    addition is theirs, each on its own."""
    if x.dtype.kind != "c":
        return x
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)  # (an input: ``out`` always is)
    return x.reshape(x.shape or (1,)).view(x.real.dtype)  # (a 0-d array: one element)


def _add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = a + b`` elementwise in ``out``'s dtype (``out`` may be ``a``), where of two
    NaNs ``a``'s comes out (quieted): what x86's add does with its first operand, and so what
    TF's kernels give (checked against TF 2.21: the dense accumulator's ``accum + grad``
    keeps the earlier gradients' NaN, the sparse one's ``grad + accum`` the later one's).
    numpy keeps one or the other by dtype, and for float32/float64 by position (its SIMD
    body keeps the first operand's, its scalar tail the second's). A NaN in ``b`` is rare:
    one ``minimum`` pass over it decides, and only then are ``a``'s NaNs looked for.
    Callers run it under :func:`_quiet` (TF warns of no NaN, inf or overflow)."""
    kind = out.dtype.kind
    if kind in "iub" or b.size == 0:
        np.add(a, b, out=out)
        return out
    fa, fb, fo = (_floats(a), _floats(b), _floats(out)) if kind == "c" else (a, b, out)
    least = np.minimum.reduce(fb, axis=None)  # NaN when b holds one
    if least == least:
        np.add(fa, fb, out=fo)
        return out
    nan = np.isnan(fa)
    kept = fa[nan]  # a copy: out may be a
    np.add(fa, fb, out=fo)
    if kept.size:
        # a's NaN as an add with no other NaN gives it: quieted (bfloat16: ml_dtypes' NaN of
        # a's sign), as where b holds none
        fo[nan] = np.add(kept, np.zeros_like(kept))
    return out


#: 2**nmant per flush-to-zero dtype (see _float_into).
_NMANT_POW = {dt: 2.0 ** np.finfo(dt).nmant for dt in _FTZ_DTYPES}

#: Elements per block of the dense float path: the flush checks then run on cache-hot data.
_BLOCK = 128 * 1024


def _dense_float(grads: Sequence[np.ndarray], dtype: np.dtype, mean: bool) -> np.ndarray:
    """Fast path for float16/32/64: in-dtype sequential adds (and one division), with TF's
    flush-to-zero emulated only when some input is small enough to need it (see
    :func:`_float_into`)."""
    first = np.asarray(grads[0])
    flat = []
    for i, g in enumerate(grads):
        g = np.asarray(g)
        if g.shape != first.shape:
            raise ValueError(f"gradient {i} has shape {g.shape}, expected {first.shape}")
        flat.append(np.ravel(g.astype(dtype, copy=False)))
    out = np.empty(first.shape, dtype=dtype)
    _float_into(out.reshape(-1), flat, dtype, mean)
    return out


def _same_data(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (a gradient received
    straight into the result, see ``ClaimReader.read_chunks``)."""
    # may_share_memory (bounds only) first: cheap, and False for the usual separate arrays
    return (np.may_share_memory(a, b) and a.dtype == b.dtype and a.shape == b.shape
            and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])  # fmt: skip


def _float_into(
    out: np.ndarray, flat: Sequence[np.ndarray], dtype: np.dtype, mean: bool,
    count: int | None = None,
) -> None:  # fmt: skip
    """``out`` (1-D) = the sequential sum (or mean) of ``flat`` (1-D, ``dtype``, same length).
    As on the FPU, only arithmetic flushes: a lone gradient taken as SUM is a copy and keeps
    subnormals. ``count`` is the MEAN's divisor (default ``len(flat)``).

    Elements are independent, so the work goes block by block (cache-sized): whether a block
    needs flushing is decided from that block's inputs alone. The same holds for any split of
    the elements, so a caller may feed a large gradient chunk by chunk.
    """
    divisor = dtype.type(len(flat) if count is None else count)
    ftz = _ftz(dtype)
    with _quiet():
        for start in range(0, max(out.size, 1), _BLOCK):
            part = slice(start, start + _BLOCK)
            acc, first = out[part], flat[0][part]
            if not _same_data(acc, first):  # received in place: nothing to copy
                acc[...] = first
            flush = ftz and _any_small([g[part] for g in flat], dtype)
            for g in flat[1:]:
                if flush:  # denormals-are-zero on both operands, flush-to-zero on the result
                    _add(_flush(acc, dtype), _flush(g[part], dtype), out=acc)
                    _flush(acc, dtype)
                else:
                    _add(acc, g[part], out=acc)
            if mean:
                np.true_divide(_flush(acc, dtype) if flush else acc, divisor, out=acc)
                # One input with no small value (|x| >= tiny * 2**(nmant+1) or 0) divided by at
                # most 2**nmant stays normal or zero: nothing to flush. (A sum of several can
                # cancel to a tiny value, so they are always checked.)
                if ftz and (flush or len(flat) > 1 or divisor > _NMANT_POW[dtype]):
                    _flush(acc, dtype)


def reduce_into(
    out: np.ndarray, grads: Sequence[np.ndarray], reduction: str, count: int | None = None
) -> None:
    """``out[...]`` = SUM or MEAN of ``grads`` (in apply order), all 1-D arrays of ``out``'s
    dtype and length: :func:`dense_reduce` on a slice of the elements. The streaming take
    calls it once per chunk; the result is the same bit for bit as one call on everything.

    ``count``: the number of gradients the inputs hold, MEAN's divisor (default
    ``len(grads)``). An input may be a running sum of several gradients (kept in Redis by
    the accsum module, which adds with the same flush-to-zero rules as here).
    """
    _check_reduction(reduction)
    dtype = _check_dtype(out.dtype)
    if not grads:
        raise ValueError("reduce_into needs at least one gradient")
    for i, g in enumerate(grads):
        if g.shape != out.shape:
            raise ValueError(
                f"gradient {i} is {g.dtype}{list(g.shape)}, expected {dtype}{list(out.shape)}"
            )
    mean = reduction == "MEAN"
    if dtype.kind == "f":
        _float_into(out, grads, dtype, mean, count)
        return
    out[...] = grads[0]
    with _quiet():
        for g in grads[1:]:
            _add(out, g, out=out)
    if mean:
        divisor = len(grads) if count is None else count
        out[...] = _divide(out, _as_counts(out, divisor), dtype, inplace=True)


def dense_sum(grads: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Sequential sum ``g1 + g2 + ...`` in ``dtype``, in the given (apply) order.

    The first gradient is copied, not added to zeros, so ``-0.0`` survives exactly as in TF
    (whose accumulator starts as a copy of the first gradient). Integer sums wrap like C.
    """
    dtype = _check_dtype(dtype)
    if len(grads) == 0:
        raise ValueError("dense_sum needs at least one gradient")
    # Always a fresh array: the caller may keep (or reuse) the gradients it passed in.
    acc = np.array(grads[0], dtype=dtype, copy=True)
    for i, g in enumerate(grads[1:], start=1):
        # Cast each gradient to the accumulator dtype *before* adding, so the addition is a
        # single rounding in dtype (TF adds two tensors that already have type T).
        g = np.asarray(g).astype(dtype, copy=False)
        if g.shape != acc.shape:
            # np.add would silently broadcast; an accumulator never does.
            raise ValueError(f"gradient {i} has shape {g.shape}, expected {acc.shape}")
        # out= keeps the result in dtype and avoids pairwise/reduction code paths; integer
        # array arithmetic wraps silently in numpy, which is the C behaviour we want.
        with _quiet():
            _add(acc, g, out=acc)
    return acc


def _as_counts(acc: np.ndarray, count: int | np.ndarray) -> np.ndarray:
    """Return ``count`` as an int64 array shaped to broadcast against ``acc``.

    A 1-D count whose length is ``acc.shape[0]`` means one count per leading row (the sparse
    per-row counts) and is broadcast over the trailing dims, not aligned with the last axis as
    numpy would do by default.
    """
    counts = np.asarray(count)
    if not (np.issubdtype(counts.dtype, np.integer) or counts.dtype == np.bool_):
        raise TypeError(f"count must be integral, got dtype {counts.dtype}")
    counts = counts.astype(np.int64, copy=False)
    if counts.size and counts.min() < 1:
        # A take always divides by at least one accepted gradient; 0 would mean a logic error
        # upstream (and an integer division by zero).
        raise ValueError("count must be >= 1")
    if counts.ndim == 1 and acc.ndim >= 1 and counts.shape[0] == acc.shape[0]:
        counts = counts.reshape(counts.shape + (1,) * (acc.ndim - 1))
    return counts


def _int_trunc_div(acc: np.ndarray, counts: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """C++ integer division (truncation toward zero) with a positive divisor.

    Computed in a 64-bit type of the same signedness: ``|acc / count| <= |acc|`` always fits
    back into ``dtype``, and a count larger than ``dtype`` can hold (e.g. 300 for int8) is
    still used as its true value instead of wrapping (which could even give a division by 0).
    """
    if np.issubdtype(dtype, np.unsignedinteger):
        # Keep both operands uint64: mixing uint64 with int64 would promote to float64.
        wide = acc.astype(np.uint64)
        q = np.floor_divide(wide, counts.astype(np.uint64))
    else:
        wide = acc.astype(np.int64)
        c = counts.astype(np.int64)
        # floor_divide rounds toward -inf; step back up by one where a negative dividend left
        # a remainder. No overflow: c > 0 excludes INT64_MIN // -1.
        q = np.floor_divide(wide, c)
        q = q + ((np.remainder(wide, c) != 0) & (wide < 0))
    return np.asarray(q).astype(dtype)


def divide(acc: np.ndarray, count: int | np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``acc / dtype(count)`` in the accumulator dtype; returns a new array.

    * floats (float16, bfloat16, float32, float64): true division of two ``dtype`` values.
      The count is rounded to ``dtype`` first, exactly like TF's ``static_cast<T>(counter)``
      (so a float16 count of 2049 becomes 2048, as in TF). numpy's float16/bfloat16 division
      goes through float32 and rounds once more; float32 has more than 2*11+2 significand
      bits, so that double rounding is harmless and equals a correctly rounded half division
      (which is also what Eigen's half does).
    * complex: real and imaginary parts are divided separately by the real count. numpy's
      complex-by-complex division multiplies by a reciprocal (not correctly rounded) and turns
      a ``-0.0`` real part into ``+0.0``; dividing by a real scalar has neither problem.
    * integers: C++ division, truncating toward zero (``[-7] / 2 == -3``).

    ``count`` is an int or an integer array; a 1-D array of length ``acc.shape[0]`` gives one
    count per leading row (sparse MEAN), otherwise normal numpy broadcasting applies.
    """
    dtype = _check_dtype(dtype)
    acc = np.asarray(acc).astype(dtype, copy=False)
    return _divide(acc, _as_counts(acc, count), dtype, inplace=False)


def _divide(acc: np.ndarray, counts: np.ndarray, dtype: np.dtype, *, inplace: bool) -> np.ndarray:
    """divide() after validation; ``inplace`` reuses ``acc`` (already ``dtype``) for floats.

    In place matters for large sparse results: a second array of the same size costs as much
    in fresh-page faults as the division itself.
    """
    if np.issubdtype(dtype, np.integer):
        return _int_trunc_div(acc, counts, dtype)

    shape = np.broadcast_shapes(acc.shape, counts.shape)
    out = acc if inplace and shape == acc.shape else np.empty(shape, dtype=dtype)
    if np.issubdtype(dtype, np.complexfloating):
        c = counts.astype(acc.real.dtype)
        np.true_divide(acc.real, c, out=out.real)
        np.true_divide(acc.imag, c, out=out.imag)
        return out
    np.true_divide(acc, counts.astype(dtype), out=out)
    return out


def dense_reduce(grads: Sequence[np.ndarray], dtype: np.dtype, reduction: str) -> np.ndarray:
    """SUM or MEAN of dense gradients given in apply order.

    MEAN divides by ``len(grads)``, the number actually accumulated (not num_required).
    """
    _check_reduction(reduction)
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and len(grads) > 0:
        return _dense_float(grads, dtype, reduction == "MEAN")
    acc = dense_sum(grads, dtype)
    if reduction == "MEAN":
        # acc is our own fresh array: divide it in place.
        return _divide(acc, _as_counts(acc, len(grads)), dtype, inplace=True)
    return acc


def coalesce(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort one sparse gradient by index and sum duplicate rows.

    Duplicates are summed sequentially in order of appearance, in ``values.dtype`` (first
    occurrence copied, later ones added), so a gradient without duplicates is unaffected
    bit for bit. Already strictly increasing indices are returned as they are (no copy), which
    is the common case and keeps TF's own input untouched.
    """
    indices = np.asarray(indices)
    values = np.asarray(values)
    if indices.ndim != 1:
        raise ValueError(f"indices must be a vector, got shape {indices.shape}")
    if values.ndim < 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(f"values must have shape ({indices.shape[0]}, ...), got {values.shape}")
    n = indices.shape[0]
    if n < 2 or bool(np.all(indices[1:] > indices[:-1])):
        return indices, values

    # Stable sort keeps equal indices in order of appearance, so within each run of equal
    # indices the first element is the first occurrence and the rest follow in order.
    order = np.argsort(indices, kind="stable")
    sorted_idx = indices[order]
    is_first = np.empty(n, dtype=bool)
    is_first[0] = True
    np.not_equal(sorted_idx[1:], sorted_idx[:-1], out=is_first[1:])

    uniq = sorted_idx[is_first].astype(np.int64, copy=False)
    out = values[order[is_first]]  # fancy indexing copies: the caller's values stay intact
    rest = ~is_first
    if rest.any():
        group = np.cumsum(is_first) - 1
        # ufunc.at is unbuffered and applies the additions one index at a time in the order
        # given, i.e. sequential per row with a rounding per step (reduceat would not be).
        np.add.at(out, group[rest], values[order[rest]])
    return uniq, out


def sparse_merge(
    grads: Sequence[tuple[np.ndarray, np.ndarray]],
    inner_shape: tuple[int, ...],
    dtype: np.dtype,
    reduction: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Merge sparse gradients (given in apply order) like TF's SparseConditionalAccumulator.

    Returns ``(indices, values)``: int64 indices sorted and unique, values of shape
    ``(R, *inner_shape)`` in ``dtype``. Per row the first contribution is copied (``-0.0``
    survives) and later ones are added in apply order; each row counts the gradients that
    contain it, and MEAN divides each row by its own count. Gradients with no indices
    contribute nothing here (the caller still counts them toward num_required).

    Inputs are expected coalesced (sorted unique indices); anything else is coalesced first,
    which is a no-op for coalesced input.
    """
    _check_reduction(reduction)
    dtype = _check_dtype(dtype)
    inner = tuple(int(d) for d in inner_shape)

    prepared: list[tuple[np.ndarray, np.ndarray]] = []
    for k, (idx, vals) in enumerate(grads):
        idx = np.asarray(idx)
        if idx.ndim != 1:
            raise ValueError(f"gradient {k}: indices must be a vector, got shape {idx.shape}")
        if idx.shape[0] == 0:
            continue
        vals = np.asarray(vals)
        if vals.shape != (idx.shape[0], *inner):
            raise ValueError(
                f"gradient {k}: values shape {vals.shape}, expected {(idx.shape[0], *inner)}"
            )
        # Cast before coalescing so duplicate rows are summed in the accumulator dtype.
        idx, vals = coalesce(idx.astype(np.int64, copy=False), vals.astype(dtype, copy=False))
        prepared.append((idx, vals))

    if not prepared:
        return np.empty((0,), dtype=np.int64), np.empty((0, *inner), dtype=dtype)
    # only rows that take part in an addition or division are flushed (see _dense_float)
    flush = _ftz(dtype) and any(_has_small(vals, dtype) for _, vals in prepared)

    # Union of all rows, sorted: O(R log R). Each gradient is then scattered into it.
    # (Sort + dedupe by hand: np.unique in numpy >= 2.3 hashes first and is ~10x slower.)
    union = np.sort(np.concatenate([idx for idx, _ in prepared]))
    if union.shape[0] > 1:
        keep = np.empty(union.shape[0], dtype=bool)
        keep[0] = True
        np.not_equal(union[1:], union[:-1], out=keep[1:])
        union = union[keep]
    out = np.empty((union.shape[0], *inner), dtype=dtype)
    counts = np.zeros(union.shape[0], dtype=np.int64)
    for idx, vals in prepared:
        pos = np.searchsorted(union, idx)  # exact hits: union contains every idx
        first = counts[pos] == 0
        if first.all():
            out[pos] = vals
        else:
            # Rows seen for the first time are copied (not 0 + x, which would turn -0.0 into
            # +0.0); the others get one in-dtype addition each, in apply order. pos is unique
            # within a coalesced gradient, so fancy-indexed assignment loses nothing.
            out[pos[first]] = vals[first]
            later = ~first
            lpos = pos[later]
            acc, new = out[lpos], vals[later]
            if flush:
                acc, new = _flush(acc, dtype), _flush(new, dtype)
            # TF adds the gradient to the row (grad + accum): of two NaNs the gradient's
            # comes out, sign and payload
            with _quiet():
                summed = _add(new, acc, out=np.empty_like(acc))
            out[lpos] = _flush(summed, dtype) if flush else summed
        counts[pos] += 1

    if reduction == "MEAN":
        if flush:
            out = _flush(out, dtype)
        out = _divide(out, _as_counts(out, counts), dtype, inplace=True)
        if _ftz(dtype):
            out = _flush(out, dtype)
    return union, out
