"""Tensor fusion's plan, pack and split (accumulator/_fusion.py): pure functions, no Redis."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accumulator import InvalidArgumentError, _fusion
from accumulator.sync._params import zero_grad
from accumulator.sync._published import ParamSpec, unit_spec

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


def spec(name: str, shape: tuple[int, ...], dtype: np.dtype = F32, kind: str = "dense"):
    return ParamSpec(name, kind, dtype, shape)


def layout(units: list[_fusion.Unit]) -> list[tuple[str, list[str]]]:
    """(name, its parameters) of each unit, a bucket's name without its layout's digits."""
    return [(u.name.rsplit("-", 1)[0] if u.fused else u.name, [m.name for m in u.members])
            for u in units]  # fmt: skip


def test_small_dense_parameters_of_one_dtype_share_a_bucket_in_their_order():
    specs = [spec("w1", (10,)), spec("emb", (5, 2), kind="sparse"), spec("b1", (2,)),
             spec("big", (1000,)), spec("d", (3,), F64), spec("b2", ()), spec("e", (4,), F64)]
    units = _fusion.plan(specs, 400)
    assert layout(units) == [("#fused/0", ["w1", "b1", "b2"]), ("emb", ["emb"]),
                             ("big", ["big"]), ("#fused/1", ["d", "e"])]  # fmt: skip
    fused = units[0]
    assert fused.fused and fused.kind == "dense" and fused.dtype == F32
    assert fused.shape == (13,)  # 10 + 2 + 1 (a 0-d parameter is one element)
    assert [(m.offset, m.size, m.shape) for m in fused.members] == [
        (0, 10, (10,)), (10, 2, (2,)), (12, 1, ())]  # fmt: skip
    assert units[3].dtype == F64 and units[3].shape == (7,)
    assert not units[1].fused and units[1].kind == "sparse" and units[1].shape == (5, 2)


def test_a_bucket_holds_at_most_fusion_bytes_and_a_parameter_of_that_size_is_alone():
    # 40-byte float32 tensors, buckets of 100 bytes: two per bucket; a 100-byte one alone
    specs = [spec(f"p{i}", (10,)) for i in range(5)] + [spec("exact", (25,)), spec("q", (1,))]
    units = _fusion.plan(specs, 100)
    assert layout(units) == [("#fused/0", ["p0", "p1"]), ("#fused/1", ["p2", "p3"]),
                             ("#fused/2", ["p4", "q"]), ("exact", ["exact"])]  # fmt: skip
    assert all(u.shape[0] * 4 <= 100 for u in units)


def test_a_parameter_alone_in_its_bucket_keeps_its_own_accumulator_and_zero_fuses_nothing():
    specs = [spec("w", (3,)), spec("d", (3,), F64)]
    assert layout(_fusion.plan(specs, 1 << 20)) == [("w", ["w"]), ("d", ["d"])]
    many = [spec(f"p{i}", (2,)) for i in range(4)]
    assert layout(_fusion.plan(many, 0)) == [(f"p{i}", [f"p{i}"]) for i in range(4)]


def test_reserved_names_and_a_negative_threshold_are_refused():
    with pytest.raises(InvalidArgumentError, match="reserved for fused buckets"):
        _fusion.plan([spec("#fused/0", (2,)), spec("b", (2,))], 100)
    assert layout(_fusion.plan([spec("#fused/0", (2,))], 0)) == [("#fused/0", ["#fused/0"])]
    with pytest.raises(InvalidArgumentError, match="fusion_bytes must be >= 0"):
        _fusion.plan([spec("w", (2,))], -1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=3), min_size=2, max_size=6),
       st.sampled_from(["float32", "float64", "float16"]))  # fmt: skip
def test_pack_then_split_gives_back_every_gradient(shapes, dtype):
    dtype = np.dtype(dtype)
    specs = [spec(f"p{i}", tuple(s), dtype) for i, s in enumerate(shapes)]
    units = _fusion.plan(specs, 1 << 20)
    rng = np.random.default_rng(len(shapes))
    grads = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in specs}
    taken = {}
    for u in units:
        if u.fused:
            packed = _fusion.pack(u, grads)
            assert packed.shape == u.shape and packed.dtype == dtype.newbyteorder("<")
            taken[u.name] = packed.astype(dtype)
        else:
            taken[u.name] = grads[u.name].astype(dtype)
    back = _fusion.split(units, taken)
    assert set(back) == set(grads)
    for name, g in grads.items():
        assert back[name].shape == g.shape
        np.testing.assert_array_equal(back[name], g.astype(dtype))


def test_split_gives_views_of_the_bucket_and_pack_names_the_bad_parameter():
    units = _fusion.plan([spec("a", (2, 2)), spec("b", (3,))], 1 << 20)
    (bucket,) = units
    flat = np.arange(7, dtype=np.float32)
    out = _fusion.split(units, {bucket.name: flat})
    assert np.shares_memory(out["a"], flat) and out["a"].shape == (2, 2)
    np.testing.assert_array_equal(out["b"], [4, 5, 6])
    mismatch = r"Shape mismatch: expected \[3\], got \[4\]"
    with pytest.raises(_fusion.MemberError, match=mismatch) as e:
        _fusion.pack(bucket, {"a": np.zeros((2, 2)), "b": np.zeros(4)})
    assert e.value.param == "b" and isinstance(e.value, InvalidArgumentError)
    with pytest.raises(_fusion.MemberError, match="out of its range") as e:
        _fusion.pack(bucket, {"a": np.full((2, 2), 1e300), "b": np.zeros(3)})
    assert e.value.param == "a"
    np.testing.assert_array_equal(zero_grad(unit_spec(bucket)), np.zeros(7, np.float32))


def test_a_bucket_is_named_after_its_layout_and_values_come_back_in_the_models_order():
    a, b, c = spec("a", (4,)), spec("b", (3,)), spec("c", (2,), F64)
    (one,) = _fusion.plan([a, b], 1024)
    assert re.fullmatch(r"#fused/0-[0-9a-f]{6}", one.name)
    assert _fusion.plan([a, b], 1024)[0].name == one.name  # the same layout: the same name
    # another order, other shapes of the same size, another dtype: another bucket
    others = [[b, a], [spec("a", (3,)), spec("b", (4,))],
              [spec("a", (4,), F64), spec("b", (3,), F64)]]
    assert {_fusion.plan(x, 1024)[0].name for x in others} & {one.name} == set()
    assert len({_fusion.plan(x, 1024)[0].name for x in others}) == 3
    # c sits between a and b in the model; the bucket of a and b comes first
    units = _fusion.plan([a, c, b], 1024)
    assert [u.name == one.name for u in units] == [True, False]
    taken = {units[0].name: np.arange(7, dtype=np.float32), "c": np.ones(2)}
    assert list(_fusion.split(units, taken)) == ["a", "c", "b"]
    assert list(_fusion.in_order(units, {"b": 1, "c": 2, "a": 3})) == ["a", "c", "b"]
