"""The rounds' bookkeeping at its edges: a round of exactly ``max_pending_bytes``, a round
given back (``lua/leave.lua``) next to gradients applied meanwhile, a reset or another
shape, payload lengths checked part by part, leases that grow with a round, a refused
retry or an expired record next to a claimed round.

Each test here came from a mutation-testing pass (2026-11-29: 68 hand-made bugs in the
scripts, the take and apply protocols, the reductions and the module; 16 went unnoticed by
the suite): each fails on such a plausible bug that the rest of the suite let through."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_hardening import SMALL, _parts_call, make, snapshot

import accumulator
from accumulator import _reduce, _scripts


def _failing_reduce(before_failing):
    """A reduction that runs ``before_failing`` (another client's work while the round is
    read), then fails: the take gives its claimed round back."""

    def fail(*args, **kwargs):
        before_failing()
        raise MemoryError

    return fail


# lua/apply.lua: `total > maxbytes` (catches: >=)


def test_a_round_of_exactly_max_pending_bytes_is_accepted(target):
    acc = make(target, max_pending_bytes=96)  # 24 bytes a gradient: 4 fit exactly
    for _ in range(4):
        assert acc.apply_grad(np.ones(SMALL))
    with pytest.raises(accumulator.ResourceExhaustedError, match="max_pending_bytes=96"):
        acc.apply_grad(np.ones(SMALL))
    assert acc.num_accumulated() == 4


# lua/leave.lua: count = count + hcount (catches: count = hcount)


def test_a_round_given_back_keeps_the_gradients_applied_while_it_was_read(target, monkeypatch):
    acc, other = make(target), make(target)
    acc.apply_grad(np.ones(SMALL))
    acc.apply_grad(np.full(SMALL, 3.0))

    def apply_to_the_next_round():
        assert other.apply_grad(np.full(SMALL, 8.0), local_step=1)  # the step after the claim

    monkeypatch.setattr(_reduce, "reduce_into", _failing_reduce(apply_to_the_next_round))
    with pytest.raises(MemoryError):
        acc.take_grad(2)
    monkeypatch.undo()
    # given back in front of the one applied since: three pending, counted
    assert acc.global_step() == 0 and acc.num_accumulated() == 3
    np.testing.assert_array_equal(acc.take_grad(3, timeout=5), np.full(SMALL, 4.0))


# lua/leave.lua: the gen check (catches: dropped)


def test_a_round_claimed_before_a_reset_is_kept_for_the_next_take_not_given_back(
    target, monkeypatch
):
    acc = make(target)
    acc.apply_grad(np.ones(SMALL))
    acc.apply_grad(np.full(SMALL, 3.0))
    r = target.redis()
    # a reset while the round is read: its claim's lease runs, so the reset leaves it alone
    monkeypatch.setattr(
        _reduce, "reduce_into", _failing_reduce(lambda: accumulator._admin.reset(r, "h"))
    )
    with pytest.raises(MemoryError):
        acc.take_grad(2)
    monkeypatch.undo()
    # the accumulator moved on (the reset): the claim is kept, not put back under step 0
    assert acc.global_step() == 1 and acc.num_accumulated() == 0
    assert len(accumulator._admin.describe(r, "h").claims) == 1
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), np.full(SMALL, 2.0))  # taken over
    assert acc.global_step() == 1


# lua/leave.lua: the round-shape check (catches: dropped)


def test_a_round_is_not_given_back_into_a_round_of_another_shape(target, monkeypatch):
    acc, other = make(target, shape=(None, 2)), make(target, shape=(None, 2))
    acc.apply_grad(np.ones((3, 2)))
    acc.apply_grad(np.full((3, 2), 3.0))

    def apply_another_shape():
        assert other.apply_grad(np.full((4, 2), 5.0), local_step=1)

    monkeypatch.setattr(_reduce, "reduce_into", _failing_reduce(apply_another_shape))
    with pytest.raises(MemoryError):
        acc.take_grad(2)
    monkeypatch.undo()
    assert acc.global_step() == 1 and acc.num_accumulated() == 1
    # the kept round goes to the next take, then the (4, 2) one: nothing lost or mixed
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full((3, 2), 2.0))
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full((4, 2), 5.0))
    assert acc.global_step() == 2


# lua/apply.lua: `len ~= nbytes` (catches: only a missing part refused), and
# lua/_common.lua entry_length: `(i < #keys and len ~= CHUNK)` (catches: dropped)


@pytest.mark.parametrize(
    "shifts",
    [{-1: -4}, {0: -4, -1: 4}],
    ids=["last part short", "middle part short, total right"],
)
def test_a_payload_whose_parts_have_the_wrong_lengths_is_refused(target, shifts):
    """Every part there, but the last one short, or the first one short and the last one
    long by as much (the total right): refused, its parts deleted, nothing else changed."""
    shape = (3 * (1 << 20) // 4,)
    acc = make(target, shape=shape)
    r = target.redis()
    before = snapshot(r, acc._keys.pattern)
    nbytes = 3 << 20
    keys, args, parts = _parts_call(acc, nbytes)
    chunk = accumulator._chunks.CHUNK_BYTES
    for i, key in enumerate(parts):
        shift = shifts.get(i, shifts.get(i - len(parts), 0))
        r.set(key, b"\0" * (min(chunk, nbytes - i * chunk) + shift), px=3600_000)
    with pytest.raises(accumulator.ResourceExhaustedError, match="not stored"):
        _scripts.call(acc.redis, "apply", keys, args)
    assert snapshot(r, acc._keys.pattern) == before


# lua/renew.lua: EXISTS claim (catches: dropped)


def test_a_renew_of_a_claim_whose_list_is_gone_answers_that_it_is_not_held(target):
    acc = make(target)
    k = acc._keys
    r = target.redis()
    r.hset(k.claims, "1-ab", str(int(time.time() * 1000) + 60_000))  # leased, list gone
    call = [k.state, k.claim("1-ab"), k.claims], ["1-ab", 1000, 10, 0, 0]
    assert int(_scripts.call(acc.redis, "renew", *call)) == 0


# lua/_common.lua record_reached: `int_cmp(seq, pseq) <= 0` (catches: < 0)


def test_a_refused_retry_of_a_counted_apply_keeps_the_payload_its_round_holds(target):
    shape = (3 * (1 << 20) // 4,)
    acc = make(target, shape=shape)
    r = target.redis()
    nbytes = 3 << 20
    keys, args, parts = _parts_call(acc, nbytes)
    payload = np.full(shape, 2.0, np.float32).tobytes()
    for key, (start, stop) in zip(parts, accumulator._chunks.part_ranges(nbytes), strict=True):
        r.set(key, payload[start:stop], px=3600_000)
    assert int(_scripts.call(acc.redis, "apply", keys, args)[0]) == 1  # counted
    # its reply lost, it is sent again, and refused this time (a foreign value, or the ACL
    # changed): the refusal drops no payload of an apply that was counted
    r.set(acc._keys.takers, b"foreign")
    with pytest.raises(accumulator.AccumulatorError, match="another type"):
        _scripts.call(acc.redis, "apply", keys, args)
    r.delete(acc._keys.takers)
    assert acc.num_accumulated() == 1
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(shape, 2.0))


# lua/_common.lua round_holds: the claims' lists (catches: the pending round only)


def test_a_withdraw_whose_record_expired_keeps_a_payload_a_claimed_round_holds(target):
    if target.kind == "cluster":
        pytest.skip("payloads spread over slots there: no parts in the accumulator's slot")
    large = (64, 1024)
    acc = make(target, shape=large)
    acc.apply_grad(np.ones(large))
    acc.apply_grad(np.full(large, 3.0))
    k, r = acc._keys, target.redis()
    # a taker claimed the round and is reading it
    assert int(_scripts.call(acc.redis, "take", *acc._take_script_args("1-ab", 2, 60_000))[0]) == 1
    cid = acc._identities.client_ids[0]
    r.delete(k.dedup(cid))  # (its ttl ran out)
    before = snapshot(r)
    counted = _scripts.call(r, "withdraw", [k.state, k.dedup(cid), k.blob(cid, 1)],
                            ["1", 4 * 64 * 1024, 60_000])  # fmt: skip
    assert int(counted) == -1  # counted: the claimed round holds it
    assert snapshot(r) == before


# lua/take.lua: `'bytes', '0'` at the claim (catches: dropped)


def test_a_take_empties_the_rounds_pending_bytes(target):
    acc = make(target, max_pending_bytes=48)  # two gradients of 24 bytes
    for _ in range(3):
        assert acc.apply_grad(np.ones(SMALL), local_step=acc.global_step())
        assert acc.apply_grad(np.ones(SMALL), local_step=acc.global_step())
        np.testing.assert_array_equal(acc.take_grad(2, timeout=5), np.ones(SMALL))
