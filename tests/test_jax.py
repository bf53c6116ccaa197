"""JAX arrays in, numpy out (the README's example): float32 and bfloat16 gradients bit for
bit, jax dtypes as ``dtype``, sparse gradients from jax arrays, and jax never imported unless
the user passes one of its objects."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _helpers import assert_not_imported_by_numpy_use

import accumulator
from accumulator import _reduce

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(("jax_dtype", "numpy_dtype"), [
    ("float32", np.float32), ("bfloat16", BF16), ("float16", np.float16), ("int32", np.int32),
])  # fmt: skip
def test_jax_arrays_are_applied_bit_for_bit(target, jax_dtype, numpy_dtype):
    dtype = getattr(jnp, jax_dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    grads = [(jax.random.normal(k, (4, 3)) * 100).astype(dtype) for k in keys]
    acc = accumulator.ConditionalAccumulator(dtype, (4, 3), shared_name="j",
                                             client=target.client())  # fmt: skip
    assert acc.dtype == np.dtype(numpy_dtype)
    for g in grads:
        assert acc.apply_grad(g)
    want = np.empty((4, 3), numpy_dtype)
    _reduce.reduce_into(want, [np.asarray(g) for g in grads], "MEAN")
    got = acc.take_grad(3)
    assert got.dtype == np.dtype(numpy_dtype)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_the_readme_update_step(target):
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="w",
                                             client=target.client())  # fmt: skip
    params = {"w": jnp.ones(3)}
    for i in range(4):
        acc.apply_grad({"w": jnp.full(3, float(i))}["w"], local_step=0)
    params["w"] -= 0.5 * jnp.asarray(acc.take_grad(4))
    np.testing.assert_allclose(np.asarray(params["w"]), np.full(3, 1 - 0.5 * 1.5))


def test_a_sparse_gradient_from_jax_arrays(target):
    acc = accumulator.SparseConditionalAccumulator(jnp.float32, (10, 2), shared_name="s",
                                                   client=target.client())  # fmt: skip
    assert acc.apply_grad(jnp.array([4, 1]), jnp.ones((2, 2)), grad_shape=(10, 2))
    indices, values, shape = acc.take_grad(1)
    np.testing.assert_array_equal(indices, [1, 4])
    np.testing.assert_array_equal(values, np.ones((2, 2)))


def test_jax_is_not_imported_unless_the_user_passes_its_objects():
    assert_not_imported_by_numpy_use("jax")
