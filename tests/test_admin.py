"""accumulator._admin on both backends: listing, describing, resetting, deleting."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import pytest
import redis
from _helpers import entry_key_names

import accumulator
from accumulator import _admin, _admin_ops, _scripts
from accumulator._admin_ops import schema_of
from accumulator._core import leave
from accumulator._keys import SCHEMA_VERSION, Keys

if TYPE_CHECKING:
    from conftest import Target

SHAPE = (3, 2)
BIG = (100, 100)  # 40 kB of float32: above the inline limit, the payload gets its own key


@pytest.fixture
def make(target: Target) -> Iterator[Callable[..., accumulator.ConditionalAccumulator]]:
    """Open accumulators on the target; all are closed at the end."""
    opened: list[accumulator.ConditionalAccumulator] = []

    def factory(name: str, shape: tuple[int, ...] = SHAPE, **kwargs: Any):
        acc = accumulator.ConditionalAccumulator(
            np.float32, shape=shape, shared_name=name, client=target.client(), **kwargs
        )
        opened.append(acc)
        return acc

    yield factory
    for acc in opened:
        acc.close()


@pytest.fixture
def r(target: Target) -> redis.Redis:
    return target.redis()


def _keys_of(r: redis.Redis, keys: Keys) -> list[bytes]:
    """Every key of an accumulator: its slot's, and the parts of its spread payloads."""
    return sorted([*r.scan_iter(match=keys.pattern), *r.scan_iter(match=keys.spread_pattern)])


def _wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _claim_round(
    r: redis.Redis, name: str, taker: str, num_required: int, claim_lease_ms: int = 30_000,
    container: str = "",
) -> Any:
    """Claim the pending round the way a take does, then 'crash' before reading it."""
    k = Keys(container, name)
    checked: list[bytes] = []
    while True:
        reply = _claim_once(r, k, taker, num_required, checked, claim_lease_ms)
        if int(reply[0]) != 2:
            return reply
        for entry in reply[1]:  # spread payloads: checked as a take checks them
            checked += [entry, b"%d" % sum(r.strlen(key) for key in entry_key_names(entry))]


def _claim_once(
    r: redis.Redis, k: Keys, taker: str, num_required: int, checked: list, claim_lease_ms: int
) -> Any:
    return _scripts.call(
        r,
        "take",
        [
            k.state,
            k.grads,
            k.takers,
            k.taker_info,
            k.claim(taker),
            k.wake,
            k.queue_wake,
            k.quarantine,
            k.claims,
            k.orphans,
        ],  # no earlier take's retry buffer to delete
        [schema_of(r, k), taker, num_required, 15_000, "d", 4, claim_lease_ms, 0, "",
         len(checked) // 2,
         *checked],
    )


def _leave(r: redis.Redis, name: str, taker: str) -> int:
    """The cleanup of an interrupted take (see lua/leave.lua)."""
    return leave(r, Keys("", name), taker, schema_of(r, Keys("", name)))


# -- list ---------------------------------------------------------------------------------------


def test_list_empty(r: redis.Redis) -> None:
    assert _admin.list_accumulators(r) == []


def test_list_every_container_sorted(make: Callable[..., Any], r: redis.Redis) -> None:
    b = make("beta")
    make("alpha", shape=(4,), reduction_type="SUM")
    make("gamma", container="job:7")  # a ':' in the container is escaped by the key schema
    b.apply_grad(np.ones(SHAPE), local_step=0)
    b.apply_grad(np.ones(SHAPE), local_step=0)

    infos = _admin.list_accumulators(r)
    assert [(i.container, i.shared_name) for i in infos] == [
        ("", "alpha"),
        ("", "beta"),
        ("job:7", "gamma"),
    ]
    alpha, beta, gamma = infos
    assert (alpha.kind, alpha.dtype, alpha.shape, alpha.reduction) == (
        "dense",
        "float32",
        (4,),
        "SUM",
    )
    assert alpha.shape_text == "[4]"
    assert (beta.count, beta.bytes, beta.round_shape, beta.step) == (2, 48, SHAPE, 0)
    assert beta.n_applied == 2 and beta.takers_waiting == 0 and not beta.private
    assert beta.created_ms is not None and beta.now_ms is not None
    assert beta.now_ms >= beta.created_ms
    assert not beta.detailed and beta.takers == () and beta.memory_bytes is None
    assert gamma.container == "job:7"


def test_list_one_container(make: Callable[..., Any], r: redis.Redis) -> None:
    make("a")
    make("b", container="c1")
    make("c", container="c10")  # a prefix of another container's name must not match
    assert [i.shared_name for i in _admin.list_accumulators(r, "c1")] == ["b"]
    assert [i.shared_name for i in _admin.list_accumulators(r, "")] == ["a"]
    assert _admin.list_accumulators(r, "nothing-here") == []


def test_private_accumulators_are_listed_as_private(target: Target, r: redis.Redis) -> None:
    acc = accumulator.ConditionalAccumulator(np.float32, shape=SHAPE, client=target.client())
    try:
        (info,) = _admin.list_accumulators(r)
        assert info.private
    finally:
        acc.close()


def test_definition_of_another_kind_is_shown_generically(r: redis.Redis) -> None:
    # What a newer library (e.g. the sparse kind, a dtype this version lacks) may write.
    keys = Keys("", "future")
    definition = msgpack.packb(
        {"kind": "sparse", "dtype": "float8_e4m3", "shape": [-1, 64], "reduction": "MEAN"}
    )
    r.hset(
        keys.state,
        mapping={
            "schema": SCHEMA_VERSION,
            "def": definition,
            "step": 3,
            "count": 0,
            "gen": 0,
            "bytes": 0,
            "ttl": 0,
        },
    )
    (info,) = _admin.list_accumulators(r)
    assert (info.kind, info.dtype, info.shape, info.shape_text) == (
        "sparse",
        "float8_e4m3",
        (None, 64),
        "[?,64]",
    )
    assert info.definition_error  # the reason it could not be fully decoded
    assert info.n_applied == 0 and info.created_ms is None
    detailed = _admin.describe(r, "future")
    assert detailed.step == 3 and detailed.kind == "sparse"


def test_info_to_dict_is_json(make: Callable[..., Any], r: redis.Redis) -> None:
    make("x").apply_grad(np.ones(SHAPE), local_step=0)
    data = json.loads(json.dumps(_admin.describe(r, "x").to_dict()))
    assert data["shape"] == [3, 2] and data["round_shape"] == [3, 2]
    assert data["shape_text"] == "[3,2]" and data["count"] == 1
    assert data["takers"] == [] and data["claims"] == [] and data["mean_stale"] is None
    listed = json.loads(json.dumps([i.to_dict() for i in _admin.list_accumulators(r)]))
    assert listed[0]["shared_name"] == "x"


# -- describe -----------------------------------------------------------------------------------


def test_describe_unknown_name(r: redis.Redis) -> None:
    with pytest.raises(accumulator.NotFoundError, match="nope"):
        _admin.describe(r, "nope")
    with pytest.raises(accumulator.NotFoundError, match="c1"):
        _admin.describe(r, "nope", "c1")


def test_describe_lifetime_statistics(make: Callable[..., Any], r: redis.Redis) -> None:
    acc = make("stats")
    g = np.ones(SHAPE)
    acc.apply_grad(g, local_step=0)
    acc.apply_grad(g, local_step=0)
    acc.take_grad(2)  # step 1
    assert not acc.apply_grad(g, local_step=0)  # 1 behind
    acc.set_global_step(5)
    assert not acc.apply_grad(g, local_step=1)  # 4 behind
    assert acc.apply_grad(g, local_step=5)
    with pytest.raises(accumulator.InvalidArgumentError):
        acc.apply_grad(np.ones((3, 2, 1)), local_step=5)  # refused before any script ran

    info = _admin.describe(r, "stats")
    assert (info.n_applied, info.n_stale, info.stale_steps, info.max_stale) == (3, 2, 5, 4)
    assert info.mean_stale == 2.5
    assert (info.n_taken, info.grads_taken, info.step, info.count, info.gen) == (1, 2, 5, 1, 1)
    assert info.last_take_ms is not None and info.last_take_wait_ms is not None
    assert info.last_take_ms >= info.created_ms
    assert info.detailed and info.keys is not None and info.keys >= 2
    assert info.claims == () and info.takers == () and info.stray_keys == 0
    assert info.retry_buffers == 0  # the take freed its claim when it returned


def test_describe_waiting_taker(make: Callable[..., Any], r: redis.Redis) -> None:
    acc = make("waiting")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(acc.take_grad(3, timeout=20)))
    thread.start()
    try:
        _wait_for(lambda: _admin.describe(r, "waiting").takers_waiting == 1)
        time.sleep(0.05)
        info = _admin.describe(r, "waiting")
        (taker,) = info.takers
        assert taker.position == 1 and taker.num_required == 3
        assert taker.waited_ms is not None and taker.waited_ms >= 0
        assert taker.lease_remaining_ms is not None and taker.lease_remaining_ms > 0
        assert taker.lease_age_ms is not None and taker.lease_age_ms >= 0
        assert taker.joined_ms is not None and taker.lease_expiry_ms > taker.joined_ms
        assert [i.takers_waiting for i in _admin.list_accumulators(r)] == [1]
    finally:
        acc.apply_grad(np.ones(SHAPE), local_step=0)
        acc.apply_grad(np.ones(SHAPE), local_step=0)
        thread.join(timeout=20)
    assert len(results) == 1
    assert _admin.describe(r, "waiting").takers == ()


def test_a_taker_whose_lease_ran_out_is_not_counted_as_waiting(
    make: Callable[..., Any], r: redis.Redis
) -> None:
    """A taker killed while it waited stays queued until the next take prunes it: listed
    (its lease shown run out), but neither ``ls`` nor ``show`` counts it as waiting."""
    acc = make("deadtaker")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    k = acc._keys
    now = int(r.time()[0]) * 1000
    r.zadd(k.takers, {b"1-dead": 1, b"2-live": 2})
    r.hset(k.taker_info, mapping={b"1-dead": f"3 {now - 1000} {now - 9000}",
                                  b"2-live": f"3 {now + 60_000} {now - 500}"})  # fmt: skip
    info = _admin.describe(r, "deadtaker")
    assert [(t.taker_id, t.lease_remaining_ms > 0) for t in info.takers] == [
        ("1-dead", False), ("2-live", True)]  # fmt: skip
    assert info.takers_waiting == 1
    assert [i.takers_waiting for i in _admin.list_accumulators(r)] == [1]
    r.hset(k.taker_info, b"2-live", f"3 {now - 1} {now - 500}")
    assert _admin.describe(r, "deadtaker").takers_waiting == 0
    assert [i.takers_waiting for i in _admin.list_accumulators(r)] == [0]
    # the next take prunes both and takes the round
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(SHAPE))
    assert _admin.describe(r, "deadtaker").takers == ()


def test_describe_claims_left_behind(make: Callable[..., Any], r: redis.Redis) -> None:
    big = make("crashy", shape=BIG)
    big.apply_grad(np.ones(BIG), local_step=0)
    big.apply_grad(np.ones(BIG), local_step=0)
    reply = _claim_round(r, "crashy", "1-dead", 2)
    assert int(reply[0]) == 1

    info = _admin.describe(r, "crashy")
    (claim,) = info.claims
    assert claim.taker_id == "1-dead"
    held = 40_000 if big.sums_in_redis else 80_000  # a sum in Redis holds one gradient
    assert (claim.step, claim.count, claim.bytes, claim.missing_blobs) == (1, 2, held, 0)
    assert claim.key == Keys("", "crashy").claim("1-dead")
    assert info.count == 0 and info.step == 1
    assert info.stray_keys == 0  # the claim's payload keys are accounted for
    assert info.retry_buffers == 0
    # without a SCAN (watch, the changing commands): the claim registry names it
    quick = _admin.describe(r, "crashy", scan=False)
    (named,) = quick.claims
    assert (named.key, named.count, named.bytes) == (claim.key, claim.count, claim.bytes)
    assert quick.keys is None and quick.stray_keys is None
    r.unlink(entry_key_names(r.lrange(claim.key, 1, -1)[0])[0])
    assert _admin.describe(r, "crashy").claims[0].missing_blobs == 1


def test_finished_takes_are_not_left_behind(make: Callable[..., Any], r: redis.Redis) -> None:
    acc = make("fine")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    acc.take_grad(1)  # its claim is freed when the take returns
    info = _admin.describe(r, "fine")
    assert info.claims == () and info.retry_buffers == 0 and info.stray_keys == 0


def test_a_claims_lease_grows_with_its_entries(make: Callable[..., Any], r: redis.Redis) -> None:
    """Merging costs per gradient: a sparse round of 300,000 one-row gradients (7 MB) took
    7-8 s, past a lease sized by bytes, and two takers took it from each other forever
    (sparse review). 0.2 ms per entry now."""
    acc = make("many")
    pipe = r.pipeline(transaction=False)
    pipe.rpush(acc._keys.grads, *[b"i" + np.ones(SHAPE, np.float32).tobytes()] * 2000)
    pipe.hset(acc._keys.state, mapping={"count": 2000, "bytes": 2000 * 24,
                                        "rshape": ",".join(map(str, SHAPE))})  # fmt: skip
    pipe.execute()
    before = _scripts_now_ms(r)
    _claim_round(r, "many", "2-5f0", 2000, claim_lease_ms=0)
    after = _scripts_now_ms(r)
    lease = int(r.hget(acc._keys.claims, "2-5f0"))
    # 2,000 x 0.2 ms from the script's clock, read between `before` and `after` (a fixed
    # bound on the time since was flaky on a slow fakeredis)
    assert lease - before >= 400 and lease - after <= 400


def _scripts_now_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_interrupted_take_gives_its_claim_back(
    make: Callable[..., Any], r: redis.Redis
) -> None:
    acc = make("interrupted")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    _claim_round(r, "interrupted", "2-dead", 1)
    assert acc.global_step() == 1 and acc.num_accumulated() == 0
    acc.apply_grad(np.full(SHAPE, 2.0), local_step=1)  # applied meanwhile, at the new step
    # the taker's cleanup gives the round back: step and count as before its take, the
    # claimed gradient first
    assert _leave(r, "interrupted", "2-dead") == 1
    info = _admin.describe(r, "interrupted")
    assert info.claims == () and info.step == 0 and info.count == 2 and info.n_taken == 0
    assert info.last_take_ms is None  # (`show` said "takes 0", then "last take 3s ago")
    np.testing.assert_array_equal(acc.take_grad(2), np.full(SHAPE, 1.5))
    assert acc.global_step() == 1


def test_interrupted_take_keeps_a_claim_that_cannot_go_back(
    make: Callable[..., Any], r: redis.Redis
) -> None:
    acc = make("interrupted")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    _claim_round(r, "interrupted", "2-dead", 1)
    acc.set_global_step(7)  # the accumulator moved on: the round cannot go back
    assert _leave(r, "interrupted", "2-dead") == -1
    (claim,) = _admin.describe(r, "interrupted").claims
    assert (claim.taker_id, claim.count, claim.bytes) == ("2-dead", 1, 24)
    assert acc.global_step() == 7 and acc.num_accumulated() == 0


def test_describe_memory_usage_degrades(
    make: Callable[..., Any], target: Target, r: redis.Redis
) -> None:
    make("mem", shape=BIG).apply_grad(np.ones(BIG), local_step=0)
    info = _admin.describe(r, "mem")
    assert info.bytes == 40_000
    if target.kind == "fake":  # fakeredis has no MEMORY command
        assert info.memory_bytes is None
    else:
        assert info.memory_bytes is not None and info.memory_bytes >= 40_000
    assert _admin.describe(r, "mem", memory=False).memory_bytes is None


def test_server_info_degrades(target: Target, r: redis.Redis) -> None:
    info = _admin.server_info(r)
    if target.kind == "fake":  # no INFO in fakeredis
        assert info is None
    else:
        assert info is not None and info["version"] and info["used_memory"] > 0


# -- changes ------------------------------------------------------------------------------------


def test_set_step(make: Callable[..., Any], r: redis.Redis) -> None:
    acc = make("steps")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    assert _admin.set_step(r, "steps", 10) == 0
    assert acc.global_step() == 10 and acc.num_accumulated() == 1
    assert _admin.set_step(r, "steps", 3) == 10  # downwards too
    assert acc.global_step() == 3
    with pytest.raises(accumulator.NotFoundError):
        _admin.set_step(r, "nope", 1)
    with pytest.raises(accumulator.InvalidArgumentError):
        _admin.set_step(r, "steps", True)  # type: ignore[arg-type]
    for outside in (2**63, -(2**63) - 1, 10**20):
        with pytest.raises(accumulator.InvalidArgumentError, match="fit in an int64"):
            _admin.set_step(r, "steps", outside)
    assert _admin.set_step(r, "steps", 2**63 - 1) == 3
    assert acc.global_step() == 2**63 - 1


def test_reset_drops_pending_gradients(make: Callable[..., Any], r: redis.Redis) -> None:
    acc = make("round", shape=BIG)
    acc.apply_grad(np.ones(BIG), local_step=0)
    acc.apply_grad(np.ones(BIG), local_step=0)
    acc.set_global_step(4)
    payload_keys = [k for e in r.lrange(Keys("", "round").grads, 0, -1) for k in entry_key_names(e)]
    held = 1 if acc.sums_in_redis else 2  # a sum in Redis: one gradient's parts
    assert len(payload_keys) == held and r.exists(*payload_keys) == held

    assert _admin.reset(r, "round") == 2
    assert r.exists(*payload_keys) == 0
    info = _admin.describe(r, "round")
    assert (info.count, info.bytes, info.round_shape, info.step, info.gen) == (0, 0, None, 4, 1)
    assert info.n_applied == 2  # lifetime statistics survive
    assert _admin.reset(r, "round") == 0  # nothing pending: still fine
    # a new round may have another shape (BIG is declared, so use a fresh round of it)
    acc.apply_grad(np.full(BIG, 2.0), local_step=4)
    np.testing.assert_array_equal(acc.take_grad(1), np.full(BIG, 2.0))
    with pytest.raises(accumulator.NotFoundError):
        _admin.reset(r, "nope")


def test_reset_drops_the_rounds_of_takers_that_are_gone(
    make: Callable[..., Any], r: redis.Redis
) -> None:
    # Left as it was, the next take would take such a round over: a reset brought it back.
    acc = make("stranded", shape=BIG)
    k = Keys("", "stranded")
    acc.apply_grad(np.full(BIG, 7.0), local_step=0)
    _claim_round(r, "stranded", "5-a11e", 1)  # a taker reading its round: not touched
    acc.apply_grad(np.ones(BIG), local_step=1)
    acc.apply_grad(np.ones(BIG), local_step=1)
    _claim_round(r, "stranded", "4-dead", 2, claim_lease_ms=0)  # its lease ran out at once
    gone = [key for e in r.lrange(k.claim("4-dead"), 1, -1) for key in entry_key_names(e)]
    assert gone and r.exists(*gone) == len(gone)
    acc.apply_grad(np.full(BIG, 3.0), local_step=2)

    assert _admin_ops.reset_counted(r, "stranded") == (3, 2)
    assert r.exists(k.claim("4-dead"), *gone) == 0
    assert r.hkeys(k.claims) == [b"5-a11e"] and r.exists(k.claim("5-a11e"))
    info = _admin.describe(r, "stranded")
    assert (info.count, info.step, [c.taker_id for c in info.claims]) == (0, 2, ["5-a11e"])
    acc.apply_grad(np.full(BIG, 2.0), local_step=2)
    np.testing.assert_array_equal(acc.take_grad(1), np.full(BIG, 2.0))  # not the old round
    assert _admin.reset(r, "stranded") == 0


def test_reset_keeps_waiting_takers(make: Callable[..., Any], r: redis.Redis) -> None:
    acc = make("keep-takers")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(acc.take_grad(2, timeout=20)))
    thread.start()
    try:
        _wait_for(lambda: _admin.describe(r, "keep-takers").takers_waiting == 1)
        assert _admin.reset(r, "keep-takers") == 1
        assert _admin.describe(r, "keep-takers").takers_waiting == 1
    finally:
        acc.apply_grad(np.full(SHAPE, 3.0), local_step=0)
        acc.apply_grad(np.full(SHAPE, 5.0), local_step=0)
        thread.join(timeout=20)
    np.testing.assert_array_equal(results[0], np.full(SHAPE, 4.0))  # the dropped one is gone


def test_delete_removes_every_key(make: Callable[..., Any], r: redis.Redis) -> None:
    acc = make("doomed", shape=BIG)
    other = make("other")
    other.apply_grad(np.ones(SHAPE), local_step=0)
    acc.apply_grad(np.ones(BIG), local_step=0)
    acc.apply_grad(np.ones(BIG), local_step=0)
    _claim_round(r, "doomed", "3-dead", 2)
    acc.apply_grad(np.ones(BIG), local_step=1)
    keys = Keys("", "doomed")
    before = _keys_of(r, keys)
    assert len(before) >= 5  # state, round, payloads, claim, retry record

    assert _admin.delete(r, "doomed") == len(before)
    assert _keys_of(r, keys) == []
    with pytest.raises(accumulator.NotFoundError):
        acc.apply_grad(np.ones(BIG), local_step=1)
    # that apply's payload was written before its script found the accumulator gone: the
    # script deletes it, so nothing at all is left
    assert _keys_of(r, keys) == []
    with pytest.raises(accumulator.NotFoundError):
        _admin.delete(r, "doomed")
    assert [i.shared_name for i in _admin.list_accumulators(r)] == ["other"]
    assert _admin.describe(r, "other").count == 1


def test_delete_removes_spread_parts_that_nothing_names(
    make: Callable[..., Any], r: redis.Redis
) -> None:
    """Parts of a spread gradient whose registration was lost (a failover, or a client that
    died before that was fixed) have no expiry and were named by nothing, so no tool found
    them: `delete` now finds them by their key pattern. A longer name's are kept (cluster
    review, left alone in stop 35)."""
    acc = make("spread", shape=BIG, spread_parts=True)
    longer = make("spread2", shape=BIG, spread_parts=True)
    assert acc.apply_grad(np.ones(BIG), local_step=0)
    assert longer.apply_grad(np.ones(BIG), local_step=0)
    keys, other = Keys("", "spread"), Keys("", "spread2")
    stray = [keys.spread_part(keys.blob("0a1b", 7), i) for i in range(2)]
    for key in stray:
        r.set(key, b"x" * 16)
    kept, before = _keys_of(r, other), _keys_of(r, keys)
    assert set(stray) < set(before)
    assert _admin.delete(r, "spread") == len(before)
    assert _keys_of(r, keys) == []
    assert _keys_of(r, other) == kept
    np.testing.assert_array_equal(longer.take_grad(1), np.ones(BIG))


def test_delete_keeps_an_accumulator_created_again_while_it_deletes(
    make: Callable[..., Any], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Created again (a worker's open) after the delete removed the state and before it
    looked for the rest of the name's keys: the new accumulator's keys are kept, its round
    intact (they were deleted with the old one's: a review found it)."""
    old = make("again", shape=BIG)
    old.apply_grad(np.ones(BIG), local_step=0)
    _claim_round(r, "again", "3-dead", 1)  # a claim of the old one, found by the scan
    made: list[Any] = []
    scan = _admin_ops._scan

    def open_again_first(client: Any, pattern: Any) -> Any:
        if not made:
            made.append(make("again", shape=BIG))
            for value in (2.0, 4.0):
                assert made[0].apply_grad(np.full(BIG, value), local_step=0)
        return scan(client, pattern)

    monkeypatch.setattr(_admin_ops, "_scan", open_again_first)
    assert _admin.delete(r, "again") >= 2  # (the old state and round, at least)
    new = made[0]
    assert new.num_accumulated() == 2
    np.testing.assert_array_equal(new.take_grad(2, timeout=5), np.full(BIG, 3.0))
    assert r.llen(Keys("", "again").quarantine) == 0


def test_delete_odd_names(make: Callable[..., Any], r: redis.Redis) -> None:
    for name in ("a:b", "with {braces}", "per%cent", "ünï cødé"):
        make(name).apply_grad(np.ones(SHAPE), local_step=0)
    assert sorted(i.shared_name for i in _admin.list_accumulators(r)) == sorted(
        ["a:b", "with {braces}", "per%cent", "ünï cødé"]
    )
    for name in ("a:b", "with {braces}", "per%cent", "ünï cødé"):
        assert _admin.describe(r, name).count == 1
        assert _admin.delete(r, name) >= 2
    assert r.dbsize() == 0


def test_names_with_glob_characters(make: Callable[..., Any], r: redis.Redis) -> None:
    make("w*[x]?").apply_grad(np.ones(SHAPE), local_step=0)
    make("w-other").apply_grad(np.ones(SHAPE), local_step=0)
    make("n", container="c*").apply_grad(np.ones(SHAPE), local_step=0)
    assert [i.shared_name for i in _admin.list_accumulators(r, "c*")] == ["n"]
    assert _admin.describe(r, "w*[x]?").keys == 3  # state, round, retry record
    assert _admin.delete(r, "w*[x]?") == 3
    assert _admin.describe(r, "w-other").count == 1


def test_reset_container(make: Callable[..., Any], r: redis.Redis) -> None:
    for name in ("a", "b"):
        make(name, container="job").apply_grad(np.ones(SHAPE), local_step=0)
    make("a").apply_grad(np.ones(SHAPE), local_step=0)
    make("z", container="job2").apply_grad(np.ones(SHAPE), local_step=0)

    assert _admin.reset_container(r, "job") == 2
    assert [(i.container, i.shared_name) for i in _admin.list_accumulators(r)] == [
        ("", "a"),
        ("job2", "z"),
    ]
    assert _admin.reset_container(r, "job") == 0
    assert _admin.reset_container(r, "") == 1
    assert [i.container for i in _admin.list_accumulators(r)] == ["job2"]


def test_reset_container_scans_the_keyspace_once_and_leaves_nothing(
    make: Callable[..., Any], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One SCAN for every accumulator of the container, not one per accumulator (1,500
    accumulators took 3.5 s, quadratic: CLI review), and every key of each goes: claims,
    payloads, retry records, spread parts nothing names."""
    for n in range(6):
        acc = make(f"m{n}", shape=BIG, container="big", spread_parts=True)
        assert acc.apply_grad(np.ones(BIG), local_step=0)
    _claim_round(r, "m0", "3-dead", 1, container="big")
    keys = Keys("big", "m1")
    r.set(keys.spread_part(keys.blob("0a1b", 7), 0), b"x")  # a part that nothing names
    kept = make("m1", shape=BIG, container="big2")  # a container the pattern must not match
    assert kept.apply_grad(np.ones(BIG), local_step=0)
    others = sorted(r.scan_iter(match="acc:{big2:*"))
    scans: list[str] = []
    scan = _admin_ops._scan

    def counted(client: Any, pattern: str) -> Any:
        scans.append(pattern)
        return scan(client, pattern)

    monkeypatch.setattr(_admin_ops, "_scan", counted)
    assert _admin.reset_container(r, "big") == 6
    assert len(scans) == 1
    assert sorted(r.scan_iter(match="acc:{big*")) == others


def test_sparse_accumulators(target: Target, r: redis.Redis) -> None:
    sparse_cls = getattr(accumulator, "SparseConditionalAccumulator", None)
    if sparse_cls is None:
        pytest.skip("no sparse accumulator in this version")
    sacc = sparse_cls(np.float32, shape=(10, 4), shared_name="emb", client=target.client())
    try:
        sacc.apply_grad([1, 3], np.ones((2, 4)), grad_shape=(10, 4), local_step=0)
        (info,) = _admin.list_accumulators(r)
        assert (info.kind, info.dtype, info.shape, info.count) == ("sparse", "float32", (10, 4), 1)
        assert info.bytes == 2 * 8 + 2 * 4 * 4  # int64 indices, then the values
        assert _admin.reset(r, "emb") == 1
        sacc.apply_grad([2], np.ones((1, 4)), grad_shape=(10, 4), local_step=0)
        assert _admin.describe(r, "emb").count == 1
        assert _admin.delete(r, "emb") >= 2
    finally:
        sacc.close()


def test_scripts_missing_from_the_server_cache(make: Callable[..., Any], r: redis.Redis) -> None:
    """After a restart or SCRIPT FLUSH the scripts are loaded again (NOSCRIPT)."""
    acc = make("flushed")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    r.script_flush()
    assert _admin.reset(r, "flushed") == 1
    r.script_flush()
    assert _admin.set_step(r, "flushed", 4) == 0
    assert acc.global_step() == 4 and acc.num_accumulated() == 0


def test_watch_spreads_its_scan_over_frames(
    target: Target, make: Callable[..., Any], r: redis.Redis
) -> None:
    """``watch`` lists every accumulator at its first frame (a whole pass), then scans on a
    bounded time each frame: here none (budget 0: one SCAN call a frame), so a pass over
    ~6,000 other keys takes several frames; an accumulator created meanwhile is listed once
    the pass under way meets it, and one deleted drops out of the listing at once."""
    from accumulator._admin_read import list_found
    from accumulator._admin_scan import StateScan

    for name in ("a", "b"):
        make(name)
    pipe = r.pipeline(transaction=False)
    for i in range(6000):
        pipe.set(f"other:{i}", b"x")  # (other slots, on a cluster: every primary's)
    pipe.execute()
    scan = StateScan(r, "")
    listed = lambda found: [i.shared_name for i in list_found(r, found, "")]  # noqa: E731
    assert listed(scan.keys(0)) == ["a", "b"] and scan.passes == 1
    make("c")
    _admin.delete(r, "a")
    frames = 0
    while scan.passes == 1:
        found = scan.keys(0)
        frames += 1
        assert "a" not in listed(found)
    assert frames >= 3  # (a whole SCAN each frame would be one)
    assert listed(found) == ["b", "c"]
    pipe = r.pipeline(transaction=False)
    for i in range(6000):
        pipe.unlink(f"other:{i}")
    pipe.execute()


def test_watch_on_a_cluster_sees_every_slot_after_a_failover(
    target: Target, make: Callable[..., Any], r: redis.Redis
) -> None:
    """After a failover the client may take the promoted replica for a replica until a
    command of its slots is redirected: a pass over the primaries it knew missed that
    node's accumulators, and ``watch`` dropped them for frames (CLI review). A pass first
    makes the client's view new when a slot's node is not among its primaries."""
    from redis.cluster import REPLICA, RedisCluster

    from accumulator._admin_scan import StateScan

    if not isinstance(r, RedisCluster):
        pytest.skip("cluster topology")
    acc = make("f")
    node = r.get_node_from_key(acc._keys.state)
    node.server_type = REPLICA  # the client's stale view: its primary taken for a replica
    assert node.name not in {n.name for n in r.get_primaries()}
    assert acc._keys.state.encode() in StateScan(r, "").keys(10)
