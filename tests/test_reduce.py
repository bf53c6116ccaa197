"""Bitwise tests of accumulator._reduce against slow, independent reference implementations.

The references loop in plain Python over gradients and rows and do each elementary operation
along an independent route: floats through float64 (one exact-or-harmless extra rounding, see
``_ref_add``), integers through Python ints with explicit wrapping. Nothing here uses numpy
reductions, whose pairwise summation is exactly what the real code must avoid.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import ml_dtypes
import numpy as np
import pytest

from accumulator import _reduce
from accumulator._reduce import (
    coalesce,
    dense_reduce,
    dense_sum,
    divide,
    reduce_into,
    sparse_merge,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BF16]
COMPLEX = [np.dtype(np.complex64), np.dtype(np.complex128)]
SIGNED = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64)]
UNSIGNED = [np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64)]
ALL_DTYPES = FLOATS + COMPLEX + SIGNED + UNSIGNED
IDS = [str(d) for d in ALL_DTYPES]


# --------------------------------------------------------------------------- helpers


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if _bits(got) != _bits(want):
        diff = np.flatnonzero(
            np.ascontiguousarray(got).view(np.uint8) != np.ascontiguousarray(want).view(np.uint8)
        )
        raise AssertionError(f"bit mismatch at byte offsets {diff[:10]}: {got!r} != {want!r}")


def _is_int(dt: np.dtype) -> bool:
    return bool(np.issubdtype(dt, np.integer))


def _is_complex(dt: np.dtype) -> bool:
    return bool(np.issubdtype(dt, np.complexfloating))


def _wrap(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Python-int object array -> dt with C two's-complement wrapping."""
    info = np.iinfo(dt)
    span = 1 << (8 * dt.itemsize)
    x = np.asarray(x, dtype=object)  # 0-d object arithmetic yields a bare Python int
    flat = [((int(v) - info.min) % span) + info.min for v in x.ravel()]
    return np.array(flat, dtype=dt).reshape(x.shape)


def _ref_add(a: np.ndarray, b: np.ndarray, dt: np.dtype) -> np.ndarray:
    """One IEEE addition in dt (round to nearest even), computed independently of numpy's dt loop.

    float16: the float64 sum of two halves is exact, so one rounding to half follows.
    float32: float64 has >= 2*24+2 bits, so rounding the float64 sum again to float32 is the
    correctly rounded float32 sum (double rounding is innocuous for +, -, *, /).
    bfloat16: same argument with float32 (24 >= 2*8+2).
    """
    a = np.asarray(a, dtype=dt)
    b = np.asarray(b, dtype=dt)
    if _is_int(dt):
        return _wrap(a.astype(object) + b.astype(object), dt)
    if _is_complex(dt):
        part = a.real.dtype
        out = np.empty(a.shape, dtype=dt)
        out.real = _ref_add(a.real, b.real, part)
        out.imag = _ref_add(a.imag, b.imag, part)
        return out
    if dt == BF16:
        return (a.astype(np.float32) + b.astype(np.float32)).astype(BF16)
    if dt == np.float64:
        flat = [float(x) + float(y) for x, y in zip(a.ravel(), b.ravel(), strict=True)]
        return np.array(flat, dtype=dt).reshape(a.shape)
    return (a.astype(np.float64) + b.astype(np.float64)).astype(dt)


def _ref_div(a: np.ndarray, count: int, dt: np.dtype) -> np.ndarray:
    """a / dt(count): C++ truncating division for ints, one IEEE division for floats."""
    a = np.asarray(a, dtype=dt)
    if _is_int(dt):
        flat = []
        for v in a.ravel():
            q = abs(int(v)) // count
            flat.append(-q if int(v) < 0 else q)
        return np.array(flat, dtype=dt).reshape(a.shape)
    if _is_complex(dt):
        part = a.real.dtype
        out = np.empty(a.shape, dtype=dt)
        out.real = _ref_div(a.real, count, part)
        out.imag = _ref_div(a.imag, count, part)
        return out
    if dt == BF16:
        c32 = np.float32(ml_dtypes.bfloat16(count))
        return (a.astype(np.float32) / c32).astype(BF16)
    c = float(dt.type(count))  # TF's static_cast<T>(counter): the count is rounded to dt first
    if dt == np.float64:
        return np.array([float(x) / c for x in a.ravel()], dtype=dt).reshape(a.shape)
    return (a.astype(np.float64) / c).astype(dt)


def ref_dense(grads: Sequence[np.ndarray], dt: np.dtype, reduction: str) -> np.ndarray:
    acc = np.array(grads[0], dtype=dt, copy=True)
    for g in grads[1:]:
        acc = _ref_add(acc, g, dt)
    return _ref_div(acc, len(grads), dt) if reduction == "MEAN" else acc


def ref_coalesce(idx: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows: dict[int, np.ndarray] = {}
    for i, row in zip(idx.tolist(), vals, strict=True):
        rows[i] = row.copy() if i not in rows else _ref_add(rows[i], row, vals.dtype)
    keys = sorted(rows)
    out = np.empty((len(keys), *vals.shape[1:]), dtype=vals.dtype)
    for k, key in enumerate(keys):
        out[k] = rows[key]
    return np.array(keys, dtype=np.int64), out


def ref_sparse(
    grads: Sequence[tuple[np.ndarray, np.ndarray]],
    inner: tuple[int, ...],
    dt: np.dtype,
    reduction: str,
) -> tuple[np.ndarray, np.ndarray]:
    """TF's semantics row by row: first contribution copied, later ones added in apply order."""
    rows: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for idx, vals in grads:
        for i, row in zip(np.asarray(idx).tolist(), np.asarray(vals, dtype=dt), strict=True):
            if i in rows:
                rows[i] = _ref_add(rows[i], row, dt)
                counts[i] += 1
            else:
                rows[i] = row.copy()
                counts[i] = 1
    keys = sorted(rows)
    out = np.empty((len(keys), *inner), dtype=dt)
    for k, key in enumerate(keys):
        out[k] = _ref_div(rows[key], counts[key], dt) if reduction == "MEAN" else rows[key]
    return np.array(keys, dtype=np.int64), out


def rand_values(rng: np.random.Generator, shape: tuple[int, ...], dt: np.dtype) -> np.ndarray:
    """Values that exercise rounding (mixed magnitudes, signs, exact zeros) and wrapping."""
    if _is_int(dt):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if _is_complex(dt):
        part = np.dtype(np.float32) if dt == np.complex64 else np.dtype(np.float64)
        out = np.empty(shape, dtype=dt)
        out.real = rand_values(rng, shape, part)
        out.imag = rand_values(rng, shape, part)
        return out
    # Magnitudes 2**-8 .. 2**8 keep float16 finite for a handful of additions while making
    # most sums inexact; a few signed zeros check the sign handling.
    x = np.asarray(rng.standard_normal(shape) * np.exp2(rng.integers(-8, 9, size=shape)))
    x[rng.random(shape) < 0.02] = -0.0
    return x.astype(dt)


def rand_sparse(
    rng: np.random.Generator, n: int, universe: int, inner: tuple[int, ...], dt: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    idx = np.sort(rng.choice(universe, size=n, replace=False)).astype(np.int64)
    return idx, rand_values(rng, (n, *inner), dt)


@pytest.fixture(autouse=True)
def _no_warnings() -> Iterator[None]:
    # Integer wrap and float16 rounding must be silent: a RuntimeWarning means numpy took a
    # scalar path (or something overflowed) that the real code should not hit.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# --------------------------------------------------------------------------- dense


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 2)])
@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
def test_dense_matches_reference(dt: np.dtype, shape: tuple[int, ...], reduction: str) -> None:
    rng = np.random.default_rng(1000 + ALL_DTYPES.index(dt))
    for n in (1, 2, 3, 6):
        grads = [rand_values(rng, shape, dt) for _ in range(n)]
        before = [g.copy() for g in grads]
        got = dense_reduce(grads, dt, reduction)
        assert_bitwise(got, ref_dense(grads, dt, reduction))
        for g, b in zip(grads, before, strict=True):
            assert_bitwise(g, b)  # inputs untouched


@pytest.mark.parametrize("dt", FLOATS, ids=[str(d) for d in FLOATS])
def test_dense_large_random_sequential(dt: np.dtype) -> None:
    rng = np.random.default_rng(7)
    grads = [rand_values(rng, (4096,), dt) for _ in range(9)]
    for reduction in ("SUM", "MEAN"):
        assert_bitwise(dense_reduce(grads, dt, reduction), ref_dense(grads, dt, reduction))


def test_dense_sum_is_sequential_not_pairwise() -> None:
    f16 = np.float16
    # 2048 + 1 rounds back to 2048 (tie to even) at every step; pairwise would give 2050.
    got = dense_sum([np.array([2048], f16)] + [np.array([1], f16)] * 4, np.dtype(f16))
    assert got.tolist() == [2048.0]
    # ... and the apply order matters: 1 + 1 + 1 + 1 = 4 first, then 2052.
    got = dense_sum([np.array([1], f16)] * 4 + [np.array([2048], f16)], np.dtype(f16))
    assert got.tolist() == [2052.0]


def test_dense_sum_returns_copy_of_single_grad() -> None:
    g = np.array([1.0, 2.0], np.float32)
    out = dense_sum([g], np.dtype(np.float32))
    out[0] = 99.0
    assert g[0] == 1.0


def test_dense_sum_casts_gradients_to_dtype() -> None:
    # float64 gradients into a float16 accumulator: each is rounded to float16 before adding
    # (1.0004 -> 1.0, 2048 + 1 ties to 2048); adding in float64 first would give 2050.
    grads = [np.array([2048.0]), np.array([1.0004])]
    assert dense_sum(grads, np.dtype(np.float16)).tolist() == [2048.0]
    assert dense_sum(grads, np.dtype(np.float16)).dtype == np.float16


@pytest.mark.parametrize("dt", FLOATS + COMPLEX, ids=[str(d) for d in FLOATS + COMPLEX])
def test_negative_zero_survives_dense(dt: np.dtype) -> None:
    nz = np.array([-0.0], dtype=dt)
    for reduction in ("SUM", "MEAN"):
        for n in (1, 2, 3):
            out = dense_reduce([nz] * n, dt, reduction)
            assert _bits(out) == _bits(nz), (reduction, n, out)
    # -0 + +0 is +0 in round-to-nearest; the result must not just copy the first gradient.
    out = dense_sum([nz, np.array([0.0], dtype=dt)], dt)
    assert _bits(out) == _bits(np.array([0.0], dtype=dt))


def test_negative_zero_survives_complex_mean() -> None:
    acc = np.array([complex(-0.0, 3.0), complex(5.0, -0.0)], np.complex64)
    out = divide(acc, 2, np.dtype(np.complex64))
    assert np.signbit(out.real[0]) and out.imag[0] == 1.5
    assert out.real[1] == 2.5 and np.signbit(out.imag[1])


def test_complex_division_is_componentwise_and_correctly_rounded() -> None:
    # numpy's complex/complex division multiplies by a reciprocal and can be 1 ulp off; a
    # real division of each component cannot.
    rng = np.random.default_rng(3)
    acc = rand_values(rng, (2000,), np.dtype(np.complex128))
    for c in (3, 7, 10, 11):
        assert_bitwise(divide(acc, c, np.dtype(np.complex128)), _ref_div(acc, c, acc.dtype))


@pytest.mark.parametrize(
    ("dt", "a", "b", "want"),
    [
        (np.int8, 127, 1, -128),
        (np.int8, -128, -1, 127),
        (np.uint8, 255, 1, 0),
        (np.int16, 32767, 32767, -2),
        (np.uint32, 2**32 - 1, 2**32 - 1, 2**32 - 2),
        (np.int64, 2**63 - 1, 1, -(2**63)),
        (np.uint64, 2**64 - 1, 2, 1),
    ],
)
def test_integer_sum_wraps_like_c(dt: type, a: int, b: int, want: int) -> None:
    for shape in ((), (2,)):
        g1, g2 = np.full(shape, a, dtype=dt), np.full(shape, b, dtype=dt)
        out = dense_sum([g1, g2], np.dtype(dt))
        assert out.dtype == dt and out.shape == shape
        assert np.all(out == np.full(shape, want, dtype=dt))


@pytest.mark.parametrize("dt", SIGNED, ids=[str(d) for d in SIGNED])
def test_integer_mean_truncates_toward_zero(dt: np.dtype) -> None:
    acc = np.array([-7, 7, -8, -1, 1, 0, -5], dtype=dt)
    assert divide(acc, 2, dt).tolist() == [-3, 3, -4, 0, 0, 0, -2]
    assert divide(acc, 3, dt).tolist() == [-2, 2, -2, 0, 0, 0, -1]
    # dense MEAN of [-7] and [0]: sum -7, two gradients -> -3 (floor division would give -4)
    out = dense_reduce([np.array([-7], dt), np.array([0], dt)], dt, "MEAN")
    assert out.tolist() == [-3] and out.dtype == dt


def test_integer_division_extremes() -> None:
    i64, u64, i8 = np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.int8)
    lo, hi = np.iinfo(i64).min, np.iinfo(i64).max
    assert divide(np.array([lo, hi], i64), 1, i64).tolist() == [lo, hi]
    assert divide(np.array([lo, hi], i64), 3, i64).tolist() == [-(-lo // 3), hi // 3]
    assert divide(np.array([2**64 - 1], u64), 2, u64).tolist() == [2**63 - 1]
    assert divide(np.array([2**64 - 1], u64), 2, u64).dtype == u64
    assert divide(np.array([-128, 127], i8), 3, i8).tolist() == [-42, 42]
    # A count that int8 cannot hold is used by its true value, not wrapped (256 -> 0 would be
    # a division by zero, 200 -> -56 would flip the sign).
    assert divide(np.array([-128, 127, 100], i8), 256, i8).tolist() == [0, 0, 0]
    assert divide(np.array([-128, 127, 100], i8), 200, i8).tolist() == [0, 0, 0]
    assert divide(np.array([250], np.uint8), 300, np.dtype(np.uint8)).tolist() == [0]


@pytest.mark.parametrize("dt", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
def test_exhaustive_half_division(dt: np.dtype) -> None:
    # Every finite 16-bit value divided by small counts, against the float64/float32 route.
    raw = np.arange(2**16, dtype=np.uint16).view(dt)
    raw = raw[np.isfinite(raw.astype(np.float32))]
    for c in (1, 2, 3, 5, 6, 7, 10, 11, 13):
        assert_bitwise(divide(raw, c, dt), _ref_div(raw, c, dt))


def test_float16_count_is_rounded_to_dtype_like_tf() -> None:
    # TF divides by static_cast<half>(counter): 2049 is not a half and becomes 2048.
    f16 = np.dtype(np.float16)
    assert divide(np.array([4096.0], f16), 2049, f16).tolist() == [2.0]
    assert divide(np.array([4096.0], f16), 2049, np.dtype(np.float32)).tolist() != [2.0]


def test_divide_per_row_counts_broadcast_over_trailing_dims() -> None:
    f32 = np.dtype(np.float32)
    acc = np.arange(9, dtype=f32).reshape(3, 3) + 1
    out = divide(acc, np.array([1, 2, 4]), f32)
    assert out.tolist() == [[1, 2, 3], [2, 2.5, 3], [1.75, 2, 2.25]]
    acc3 = np.ones((2, 2, 3), f32)
    assert divide(acc3, np.array([1, 4]), f32)[:, 0, 0].tolist() == [1.0, 0.25]
    # a scalar count and a 0-d result
    assert divide(np.array(3.0, f32), 2, f32).shape == ()
    assert isinstance(divide(np.array(3.0, f32), 2, f32), np.ndarray)
    # the int path broadcasts the same way
    iacc = np.array([[-7, 7], [-7, 7]], np.int32)
    assert divide(iacc, np.array([2, 7]), np.dtype(np.int32)).tolist() == [[-3, 3], [-1, 1]]


def test_divide_does_not_modify_input() -> None:
    acc = np.array([3.0, 5.0], np.float64)
    divide(acc, 2, np.dtype(np.float64))
    assert acc.tolist() == [3.0, 5.0]


def test_divide_rejects_nonpositive_count() -> None:
    with pytest.raises(ValueError):
        divide(np.array([1.0]), 0, np.dtype(np.float64))
    with pytest.raises(ValueError):
        divide(np.array([[1.0], [2.0]]), np.array([1, 0]), np.dtype(np.float64))


def test_dense_errors() -> None:
    f32 = np.dtype(np.float32)
    with pytest.raises(ValueError):
        dense_sum([], f32)
    with pytest.raises(ValueError):
        dense_reduce([np.zeros(2, f32)], f32, "mean")
    with pytest.raises(ValueError):
        dense_sum([np.zeros((3, 2), f32), np.zeros((2,), f32)], f32)  # no silent broadcast
    with pytest.raises(TypeError):
        dense_sum([np.zeros(2, bool)], np.dtype(bool))


def test_dense_mean_divides_by_number_of_grads() -> None:
    f64 = np.dtype(np.float64)
    grads = [np.array([1.0]), np.array([2.0]), np.array([6.0])]
    assert dense_reduce(grads, f64, "MEAN").tolist() == [3.0]
    assert dense_reduce(grads, f64, "SUM").tolist() == [9.0]


# --------------------------------------------------------------------------- coalesce


def test_coalesce_fast_path_returns_inputs() -> None:
    idx = np.array([1, 4, 9], np.int64)
    vals = np.ones((3, 2), np.float32)
    out_idx, out_vals = coalesce(idx, vals)
    assert out_idx is idx and out_vals is vals
    e_idx, e_vals = np.zeros(0, np.int64), np.zeros((0, 2), np.float32)
    assert coalesce(e_idx, e_vals)[0] is e_idx


def test_coalesce_unsorted_without_duplicates_permutes() -> None:
    idx = np.array([5, 1, 3], np.int64)
    vals = np.array([[5.0, -0.0], [1.0, 1.5], [3.0, 3.5]], np.float32)
    out_idx, out_vals = coalesce(idx, vals)
    assert out_idx.tolist() == [1, 3, 5] and out_idx.dtype == np.int64
    assert_bitwise(out_vals, vals[[1, 2, 0]])
    assert idx.tolist() == [5, 1, 3]  # input untouched


def test_coalesce_duplicates_summed_in_order_of_appearance() -> None:
    f16 = np.float16
    idx = np.array([7, 2, 7, 7, 2, 7, 7], np.int64)
    vals = np.array([2048, 1, 1, 1, -0.0, 1, 1], f16)
    out_idx, out_vals = coalesce(idx, vals)
    assert out_idx.tolist() == [2, 7]
    # row 7: 2048 first, then each +1 rounds back to 2048; row 2: 1 + -0.0 = 1.
    assert out_vals.tolist() == [1.0, 2048.0]
    # reversed appearance order: 1+1+1+1 = 4, then 4 + 2048 = 2052
    out_idx, out_vals = coalesce(idx[::-1].copy(), vals[::-1].copy())
    assert out_vals.tolist() == [1.0, 2052.0]


def test_coalesce_many_duplicates_round_every_step() -> None:
    # np.add.reduceat / np.sum on float16 accumulate in float32 and would give 2068 here.
    idx = np.zeros(21, np.int64)
    vals = np.array([2048] + [1] * 20, np.float16)
    _, out = coalesce(idx, vals)
    assert out.tolist() == [2048.0]
    assert np.add.reduceat(vals, [0]).tolist() == [2068.0]  # the pitfall being avoided


def test_coalesce_duplicate_negative_zero() -> None:
    idx = np.array([3, 3, 1], np.int64)
    vals = np.array([-0.0, -0.0, -0.0], np.float32)
    _, out = coalesce(idx, vals)
    assert np.signbit(out).all()


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=IDS)
def test_coalesce_matches_reference(dt: np.dtype) -> None:
    rng = np.random.default_rng(50 + ALL_DTYPES.index(dt))
    for n, universe in ((1, 3), (12, 4), (40, 25), (300, 60)):
        idx = rng.integers(0, universe, size=n).astype(np.int64)
        vals = rand_values(rng, (n, 3), dt)
        got_idx, got_vals = coalesce(idx, vals)
        want_idx, want_vals = ref_coalesce(idx, vals)
        assert_bitwise(got_idx, want_idx)
        assert_bitwise(got_vals, want_vals)


def test_coalesce_large_random_float16() -> None:
    rng = np.random.default_rng(11)
    dt = np.dtype(np.float16)
    idx = rng.integers(0, 500, size=5000).astype(np.int64)
    vals = rand_values(rng, (5000, 4), dt)
    got = coalesce(idx, vals)
    want = ref_coalesce(idx, vals)
    assert_bitwise(got[0], want[0])
    assert_bitwise(got[1], want[1])


def test_coalesce_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        coalesce(np.zeros((1, 1), np.int64), np.zeros((1, 2)))
    with pytest.raises(ValueError):
        coalesce(np.zeros(2, np.int64), np.zeros((3, 2)))
    with pytest.raises(ValueError):
        coalesce(np.zeros(2, np.int64), np.zeros(()))


# --------------------------------------------------------------------------- sparse_merge


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=IDS)
@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
def test_sparse_matches_reference(dt: np.dtype, reduction: str) -> None:
    rng = np.random.default_rng(200 + ALL_DTYPES.index(dt))
    inner = (2, 3)
    for sizes in ((5,), (4, 6), (10, 0, 7, 10), (3, 3, 3, 3, 3)):
        grads = [rand_sparse(rng, n, 14, inner, dt) for n in sizes]
        got_idx, got_vals = sparse_merge(grads, inner, dt, reduction)
        want_idx, want_vals = ref_sparse(grads, inner, dt, reduction)
        assert_bitwise(got_idx, want_idx)
        assert_bitwise(got_vals, want_vals)


@pytest.mark.parametrize(
    "dt", [np.dtype(np.float16), np.dtype(np.float32), BF16], ids=["float16", "float32", "bf16"]
)
@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
def test_sparse_large_random(dt: np.dtype, reduction: str) -> None:
    # 4 gradients x 512 rows of 64 values, rows drawn from 10000: plenty of partial overlap.
    rng = np.random.default_rng(99)
    shared = rng.choice(10000, size=64, replace=False)  # rows in every gradient: count 4
    grads = []
    for _ in range(4):
        idx = np.union1d(rng.choice(10000, size=448, replace=False), shared).astype(np.int64)
        grads.append((idx, rand_values(rng, (idx.size, 64), dt)))
    got_idx, got_vals = sparse_merge(grads, (64,), dt, reduction)
    want_idx, want_vals = ref_sparse(grads, (64,), dt, reduction)
    assert_bitwise(got_idx, want_idx)
    assert_bitwise(got_vals, want_vals)
    counts = np.zeros(10000, int)
    for idx, _ in grads:
        counts[idx] += 1
    assert counts.max() == 4 and (counts == 1).any()


def test_sparse_per_row_mean() -> None:
    f32 = np.dtype(np.float32)
    g1 = (np.array([0, 1], np.int64), np.array([[1.0, 2.0], [3.0, 4.0]], f32))
    g2 = (np.array([1, 5], np.int64), np.array([[5.0, 6.0], [7.0, 8.0]], f32))
    g3 = (np.array([1], np.int64), np.array([[9.0, 10.0]], f32))
    idx, vals = sparse_merge([g1, g2, g3], (2,), f32, "MEAN")
    assert idx.tolist() == [0, 1, 5] and idx.dtype == np.int64
    # row 0 and 5 present once: unchanged; row 1 present three times: divided by 3
    third = [float(np.float32(17) / np.float32(3)), float(np.float32(20) / np.float32(3))]
    assert vals.tolist() == [[1.0, 2.0], third, [7.0, 8.0]]
    assert vals.dtype == f32
    idx, vals = sparse_merge([g1, g2, g3], (2,), f32, "SUM")
    assert vals.tolist() == [[1.0, 2.0], [17.0, 20.0], [7.0, 8.0]]


def test_sparse_empty_gradients() -> None:
    f16 = np.dtype(np.float16)
    empty = (np.zeros(0, np.int64), np.zeros((0, 3), f16))
    for grads in ([], [empty], [empty, empty]):
        idx, vals = sparse_merge(grads, (3,), f16, "MEAN")
        assert idx.shape == (0,) and idx.dtype == np.int64
        assert vals.shape == (0, 3) and vals.dtype == f16
    # An empty gradient dilutes nothing: MEAN of one real row + an empty gradient = the row.
    g = (np.array([4], np.int64), np.array([[1.0, 3.0, -0.0]], f16))
    idx, vals = sparse_merge([empty, g, empty], (3,), f16, "MEAN")
    assert idx.tolist() == [4]
    assert_bitwise(vals, g[1])
    # an empty gradient whose values have a careless shape is still fine
    idx, _ = sparse_merge([(np.zeros(0, np.int64), np.zeros((0,), f16)), g], (3,), f16, "SUM")
    assert idx.tolist() == [4]


def test_sparse_negative_zero_first_contribution_is_copied() -> None:
    f32 = np.dtype(np.float32)
    g1 = (np.array([0, 2], np.int64), np.array([[-0.0], [-0.0]], f32))
    g2 = (np.array([2, 3], np.int64), np.array([[-0.0], [-0.0]], f32))
    for reduction in ("SUM", "MEAN"):
        idx, vals = sparse_merge([g1, g2], (1,), f32, reduction)
        assert idx.tolist() == [0, 2, 3]
        assert np.signbit(vals).all(), vals  # adding to a zero-initialised row would give +0.0
    g3 = (np.array([0], np.int64), np.array([[0.0]], f32))
    _, vals = sparse_merge([g1, g3], (1,), f32, "SUM")
    assert not np.signbit(vals[0, 0])  # -0 + +0 = +0: row 0 really was added to


def test_sparse_order_matters_sequentially() -> None:
    f16 = np.dtype(np.float16)

    def g(v: float) -> tuple[np.ndarray, np.ndarray]:
        return np.array([3], np.int64), np.array([v], f16)

    _, vals = sparse_merge([g(2048), g(1), g(1), g(1)], (), f16, "SUM")
    assert vals.tolist() == [2048.0]
    _, vals = sparse_merge([g(1), g(1), g(1), g(2048)], (), f16, "SUM")
    assert vals.tolist() == [2052.0]  # 3 + 2048 = 2051, a tie: rounds to even 2052


def test_sparse_coalesces_unsorted_and_duplicate_input() -> None:
    f32 = np.dtype(np.float32)
    g1 = (np.array([5, 1, 5], np.int64), np.array([1.0, 2.0, 4.0], f32))
    g2 = (np.array([1], np.int64), np.array([8.0], f32))
    idx, vals = sparse_merge([g1, g2], (), f32, "MEAN")
    assert idx.tolist() == [1, 5]
    # duplicates inside g1 count as one contribution to row 5; row 1 has two contributions
    assert vals.tolist() == [5.0, 5.0]


def test_sparse_does_not_alias_inputs() -> None:
    f32 = np.dtype(np.float32)
    vals_in = np.array([[1.0, 2.0]], f32)
    _, vals = sparse_merge([(np.array([0], np.int64), vals_in)], (2,), f32, "SUM")
    vals[0, 0] = 42.0
    assert vals_in[0, 0] == 1.0


def test_sparse_integer_wrap_and_mean() -> None:
    i8 = np.dtype(np.int8)
    g1 = (np.array([0, 1], np.int64), np.array([100, -7], i8))
    g2 = (np.array([0, 2], np.int64), np.array([100, -7], i8))
    _, vals = sparse_merge([g1, g2], (), i8, "SUM")
    assert vals.tolist() == [-56, -7, -7]  # 200 wraps to -56
    _, vals = sparse_merge([g1, g2], (), i8, "MEAN")
    assert vals.tolist() == [-28, -7, -7]


def test_sparse_casts_values_to_dtype() -> None:
    g = (np.array([0, 0], np.int64), np.array([2048.0, 1.0], np.float64))
    _, vals = sparse_merge([g], (), np.dtype(np.float16), "SUM")
    # duplicates are summed in the accumulator dtype, not in float64
    assert vals.dtype == np.float16 and vals.tolist() == [2048.0]


def test_sparse_errors() -> None:
    f32 = np.dtype(np.float32)
    with pytest.raises(ValueError):
        sparse_merge([(np.array([0]), np.zeros((1, 3), f32))], (2,), f32, "SUM")
    with pytest.raises(ValueError):
        sparse_merge([(np.array([[0]]), np.zeros((1, 2), f32))], (2,), f32, "SUM")
    with pytest.raises(ValueError):
        sparse_merge([], (2,), f32, "AVG")


def test_sparse_many_duplicates_and_rows_scale() -> None:
    # One gradient with 200k entries over 1000 rows and 20 gradients of 20k rows: the code must
    # not loop over rows in Python (this would take minutes if it did).
    rng = np.random.default_rng(5)
    f32 = np.dtype(np.float32)
    idx = rng.integers(0, 1000, size=200_000).astype(np.int64)
    vals = np.ones((200_000, 4), f32)
    u, v = sparse_merge([(idx, vals)], (4,), f32, "MEAN")
    assert u.tolist() == np.unique(idx).tolist()
    assert np.array_equal(v[:, 0], np.bincount(idx, minlength=1000)[u].astype(f32))
    grads = [rand_sparse(rng, 20_000, 100_000, (8,), f32) for _ in range(20)]
    u, v = sparse_merge(grads, (8,), f32, "SUM")
    assert u.shape[0] == v.shape[0] == np.unique(np.concatenate([g[0] for g in grads])).size


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_subnormals_flushed_like_tf_cpu_kernels(dtype):
    """TF's CPU kernels run with flush-to-zero and denormals-are-zero (checked against TF
    2.21 in tests/test_parity.py); float32/float64 sums and means do the same."""
    dt = np.dtype(dtype)
    sub, tiny = np.finfo(dt).smallest_subnormal, np.finfo(dt).tiny
    g1 = np.array([3 * sub, tiny, sub, -sub, 1.0], dt)
    g2 = np.array([sub, tiny / 2, 0, 0, 1.0], dt)
    total = dense_reduce([g1, g2], dt, "SUM")
    assert total.tobytes() == np.array([0, tiny, 0, 0.0, 2.0], dt).tobytes()  # -0 + 0 = +0
    mean = dense_reduce([g1, g1], dt, "MEAN")  # tiny / 2 is subnormal: flushed
    assert mean.tobytes() == np.array([0, tiny, 0, -0.0, 1.0], dt).tobytes()
    idx, vals = sparse_merge(
        [(np.array([0]), np.array([[1.5 * tiny]], dt)), (np.array([0]), np.array([[-tiny]], dt))],
        (1,), dt, "SUM",
    )  # fmt: skip
    assert vals.tobytes() == np.array([[0.0]], dt).tobytes()  # 0.5 tiny flushed
    # no arithmetic, no flush: a lone gradient taken as SUM is a copy (as in TF)
    assert dense_reduce([g1], dt, "SUM").tobytes() == g1.tobytes()
    # float16 keeps its subnormals, as TF does (it computes them through float32)
    h = np.array([np.finfo(np.float16).smallest_subnormal], np.float16)
    assert dense_reduce([h, h], np.dtype(np.float16), "SUM")[0] == 2 * h[0]


@pytest.mark.parametrize(
    "elements", [8, _reduce._TOGETHER], ids=["looked-at-together", "one-by-one"]
)
def test_a_subnormal_in_the_last_gradient_alone_still_flushes(elements):
    """Whether a block needs flushing is decided from all its inputs: small inputs in one
    look at their concatenation, larger ones one by one. A single subnormal in the last
    gradient counts either way (it is read as zero: 1 + sub gives 1, then 1 - 1 gives +0, not
    the subnormal)."""
    dt = np.dtype(np.float32)
    sub = np.finfo(dt).smallest_subnormal
    grads = [np.zeros(elements, dt) for _ in range(4)]
    grads[0][-1], grads[1][-1] = 1.0, -1.0
    grads[3][-1] = sub
    out = np.empty(elements, dt)
    reduce_into(out, grads, "SUM")
    assert out[-1] == 0 and not np.signbit(out[-1])
    grads[3][-1] = 0  # without it nothing is small: the plain sum
    reduce_into(out, grads, "SUM")
    assert out[-1] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_signaling_nan_does_not_hide_a_small_value(dtype):
    """The quick look for small values skips NaNs; a *signaling* NaN (a quiet one's bits with
    the quiet bit clear) can come back from it instead, and hid the value that needed
    flushing (found by hypothesis: a sum kept in Redis of [.., 2**-125, sNaN] / 3 kept the
    subnormal quotient)."""
    dt = np.dtype(dtype)
    utype = np.uint32 if dt.itemsize == 4 else np.uint64
    snan = np.array([0x7F810000 if dt.itemsize == 4 else 0x7FF0100000000000], utype).view(dt)
    tiny = np.finfo(dt).tiny
    sub = np.finfo(dt).smallest_subnormal
    with np.errstate(all="ignore"):
        # a normal value whose third is subnormal: the mean of a sum of 3 kept in Redis
        x = np.array([0.0, 2 * tiny, snan[0]], dt)
        out = np.empty_like(x)
        reduce_into(out, [x], "MEAN", count=3)
        assert out[1] == 0 and np.isnan(out[2])
        # a subnormal input is read as zero (DAZ) in a sum: tiny + sub gives tiny
        a = np.array([sub, snan[0]], dt)
        b = np.array([tiny, 0.0], dt)
        got = dense_reduce([a, b], dt, "SUM")
        assert got[0] == tiny and np.isnan(got[1])
        assert _reduce._has_small(np.array([sub, snan[0]], dt), dt)
        # ... also where fmin.reduce skipped both (CI's hypothesis example: the subnormal
        # first, the sNaN and a larger normal value later in the block)
        sub_bits = 0x10000 if dt.itemsize == 4 else 0x1000000000000
        a = np.zeros(24, dt)
        a[0] = np.array([sub_bits], utype).view(dt)[0]
        b = np.zeros(24, dt)
        b[22], b[23] = snan[0], np.array([0x0D000000 if dt.itemsize == 4 else 0x0D00000000000000],
                                         utype).view(dt)[0]  # fmt: skip
        got = dense_reduce([a, b], dt, "SUM")
        assert got[0] == 0 and np.isnan(got[22]) and got[23] == b[23]
        assert _reduce._has_small(np.concatenate([a, b]), dt)


@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
def test_a_sum_past_the_range_is_inf_as_tfs_without_a_numpy_warning(reduction):
    big = np.array([60000.0, -60000.0, 1.0], np.float16)
    out = np.empty(3, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in add" would raise
        _reduce.reduce_into(out, [big, big], reduction)
    assert np.isposinf(out[0]) and np.isneginf(out[1])
    assert out[2] == (2.0 if reduction == "SUM" else 1.0)


# --------------------------------------------------------------------------- NaN + NaN


def _nan_rule_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element by element, as x86's add of (a, b): a NaN in ``a`` comes out, else one in
    ``b``, as an add with one NaN operand gives it (quieted; ml_dtypes' bfloat16 returns its
    NaN of that sign), else the sum as numpy rounds it."""
    fa, fb = (x.view(x.real.dtype) if x.dtype.kind == "c" else x for x in (a, b))
    out = np.empty_like(fa)
    zero = np.zeros(1, fa.dtype)
    for i in range(fa.size):
        x, y = fa[i : i + 1], fb[i : i + 1]
        if np.isnan(x[0]):
            out[i : i + 1] = np.add(x, zero)
        elif np.isnan(y[0]):
            out[i : i + 1] = np.add(zero, y)
        else:
            with np.errstate(over="ignore"):
                out[i : i + 1] = np.add(x, y)
    return out.view(a.dtype)


def _nan_mix(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    """Values with NaNs of random sign, payload and quietness at random places."""
    real = dtype if dtype.kind != "c" else np.dtype(f"f{dtype.itemsize // 2}")
    parts = rng.standard_normal(n * (2 if dtype.kind == "c" else 1)).astype(real)
    utype = np.dtype(f"u{real.itemsize}")
    info = ml_dtypes.finfo(real) if real.kind == "V" else np.finfo(real)
    mant = int(info.nmant)
    exp_bits = ((1 << (8 * real.itemsize - 1 - mant)) - 1) << mant
    for i in np.flatnonzero(rng.random(parts.size) < 0.4):
        payload = int(rng.integers(1, 1 << (mant - 1)))
        quiet = int(rng.integers(0, 2)) << (mant - 1)
        sign = int(rng.integers(0, 2)) << (8 * real.itemsize - 1)
        parts[i : i + 1] = np.array(sign | exp_bits | quiet | payload, utype).view(real)
    return parts.view(dtype)


@pytest.mark.parametrize("n", [*range(1, 40), 1001])
@pytest.mark.parametrize("dtype", FLOATS + COMPLEX, ids=str)
def test_of_two_nans_the_first_operands_comes_out_quieted(dtype, n):
    """``_add`` gives x86's first-operand rule in every position, for every float dtype and
    both complex parts; numpy gave the first operand's NaN in its SIMD body and the second's
    in its scalar tail (float32/64), the second's everywhere for float16."""
    rng = np.random.default_rng(n * 1000 + dtype.num)
    a, b = _nan_mix(rng, dtype, n), _nan_mix(rng, dtype, n)
    with np.errstate(invalid="ignore"):  # (signaling NaNs; reduce_into's callers silence it)
        want = _nan_rule_ref(a, b)
        assert _bits(_reduce._add(a, b, out=np.empty_like(a))) == _bits(want)
        inplace = a.copy()
        _reduce._add(inplace, b, out=inplace)
        assert _bits(inplace) == _bits(want)
        assert _bits(_reduce._add(b, a, out=np.empty_like(a))) == _bits(_nan_rule_ref(b, a))
    # the whole reduction, silently (TF warns of no NaN): the earlier gradients' NaNs first
    out = np.empty_like(a)
    reduce_into(out, [a, b, np.ones_like(a)], "SUM")
    with np.errstate(invalid="ignore", over="ignore"):
        rest = _nan_rule_ref(_nan_rule_ref(a, b), np.ones_like(a))
    if dtype.kind == "f" and dtype.itemsize >= 4:  # flushed as TF's (no subnormals drawn)
        assert _bits(out) == _bits(rest)


# accumulator/_reduce.py _float_into: `divisor > _NMANT_POW[dtype]` (mutant: dropped) -----------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_mean_of_a_sum_over_more_than_2_to_the_nmant_gradients_flushes_its_result(dtype):
    # one input (a running sum kept in Redis holds many gradients) with no small value, and
    # a count past 2**nmant: the quotient can still be subnormal, and is flushed as TF's
    nmant = np.finfo(dtype).nmant
    x = np.array([np.finfo(dtype).tiny * 2.0 ** (nmant + 1)], dtype)  # the least not-small
    out = np.empty(1, dtype)
    _reduce.reduce_into(out, [x], "MEAN", count=2 ** (nmant + 1) + 2)
    assert out.view(np.uint32 if dtype == np.float32 else np.uint64)[0] == 0  # +0.0


# accumulator/_reduce.py sparse_merge: the flush after MEAN's division (mutant: dropped) --------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_sparse_mean_flushes_a_quotient_that_is_subnormal(dtype):
    tiny = np.finfo(dtype).tiny
    grads = [
        (np.array([0]), np.array([[1.5 * tiny]], dtype)),
        (np.array([0]), np.array([[0.25 * tiny]], dtype)),
    ]  # subnormal: counts as zero
    _, values = _reduce.sparse_merge(grads, (1,), np.dtype(dtype), "MEAN")
    # (1.5 tiny + 0) / 2 is subnormal: TF's flush-to-zero makes it +0
    assert values.view(np.uint32 if dtype == np.float32 else np.uint64)[0, 0] == 0
