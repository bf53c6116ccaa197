"""Payloads spread over slots (``spread_parts=True``, key schema 3): each part of a large
gradient under its own hash tag, written and checked by the client (no script can see
another slot), recorded by the apply script only while registered in the orphans zset, checked
(STRLEN) by the taker before the take script may claim, and deleted by whoever drops, takes or
sweeps them. On every backend: one server holds every slot the same way, so the protocol is
the same; the cluster backend spreads them over its primaries for real."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _helpers import aclient, entry_key_names

import accumulator
from accumulator import _admin, _model, _scripts
from accumulator._keys import SCHEMA_VERSION, SPREAD_SCHEMA

CHUNK = 1044480
SHAPE = (3 * CHUNK // 16 + 123, 4)  # float32: 4 parts, the last one short


def make(target, name="spread", shape=SHAPE, **kw):
    kw.setdefault("spread_parts", True)
    return accumulator.ConditionalAccumulator(np.float32, shape, shared_name=name,
                                              client=target.client(), **kw)  # fmt: skip


def spread_keys(r, acc) -> list[bytes]:
    return sorted(r.scan_iter(match=acc._keys.spread_pattern))


def orphans(r, acc) -> list[bytes]:
    return r.zrange(acc._keys.orphans, 0, -1)


def test_parts_have_their_own_slots_and_a_take_frees_them(target):
    acc = make(target, reduction_type="SUM")
    assert acc.spreads_parts and acc._schema == SPREAD_SCHEMA
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
    for g in grads:
        assert acc.apply_grad(g)
    r = target.redis()
    entries = r.lrange(acc._keys.grads, 0, -1)
    assert [e.split(b" ")[0] for e in entries] == [b"d4"] * 3
    parts = spread_keys(r, acc)
    assert len(parts) == 12 and max(r.strlen(k) for k in parts) == CHUNK
    from redis.cluster import key_slot

    slots = {key_slot(k) for k in entry_key_names(entries[0])}
    assert len(slots) == 4 and key_slot(acc._keys.state.encode()) not in slots
    assert orphans(r, acc) == []  # recorded: no sweeper may touch them
    got = acc.take_grad(3)
    assert got.tobytes() == (grads[0] + grads[1] + grads[2]).tobytes()
    assert spread_keys(r, acc) == [] and orphans(r, acc) == []


def test_a_sparse_accumulator_spreads_too(target):
    acc = accumulator.SparseConditionalAccumulator(
        np.float32, (400_000, 2), shared_name="sp", client=target.client(), spread_parts=True
    )
    idx = np.arange(0, 400_000, 2, dtype=np.int64)
    acc.apply_grad(idx, np.ones((idx.size, 2)))
    acc.apply_grad(idx[:10], np.full((10, 2), 2.0))
    assert len(spread_keys(target.redis(), acc)) >= 2
    taken = acc.take_grad(2)
    assert taken.indices.tolist() == idx.tolist()
    assert taken.values[:10].tolist() == [[1.5, 1.5]] * 10 and taken.values[10:].max() == 1.0
    assert spread_keys(target.redis(), acc) == []


@pytest.mark.parametrize("how", ["stale", "refused"])
def test_a_dropped_apply_leaves_nothing(target, how):
    acc = make(target)
    acc.apply_grad(np.ones(SHAPE))
    acc.take_grad(1)
    r = target.redis()
    if how == "stale":
        assert acc.apply_grad(np.ones(SHAPE), local_step=0) is False
    else:
        acc.apply_grad(np.ones(SHAPE), local_step=1)
        with pytest.raises(accumulator.InvalidArgumentError):
            other = accumulator.ConditionalAccumulator(np.float32, None, shared_name="spread",
                                                       client=target.client())  # fmt: skip
            other.apply_grad(np.ones((SHAPE[0] - 1, 4)), local_step=1)  # another round shape
    assert spread_keys(r, acc) == entry_key_names_of_round(r, acc)
    assert orphans(r, acc) == []


def entry_key_names_of_round(r, acc) -> list[bytes]:
    return sorted(k for e in r.lrange(acc._keys.grads, 0, -1) for k in entry_key_names(e))


def _on_apply_script(acc, monkeypatch, what):
    """Run ``what(run)`` instead of the batch that carries the apply script (``run()`` sends
    it); returns how many such batches were sent."""
    original = acc._batch
    sha = _scripts.sha("apply")
    calls = {"n": 0}

    def batch(request):
        if any(c[:2] == ("EVALSHA", sha) for c in request.commands):
            calls["n"] += 1
            return what(lambda: original(request), calls["n"])
        return original(request)

    monkeypatch.setattr(acc, "_batch", batch)
    return calls


def test_a_retried_apply_is_counted_once(target, monkeypatch):
    """The apply script's reply is lost once: the retry finds the apply counted."""
    import redis

    acc = make(target)

    def lose_first_reply(run, n):
        replies = run()
        if n == 1:
            raise redis.ConnectionError("reply lost")
        return replies

    calls = _on_apply_script(acc, monkeypatch, lose_first_reply)
    assert acc.apply_grad(np.ones(SHAPE))
    assert calls["n"] == 2 and acc.num_accumulated() == 1
    assert orphans(target.redis(), acc) == []
    np.testing.assert_array_equal(acc.take_grad(1), np.ones(SHAPE))


def test_a_missing_part_is_quarantined_not_claimed_and_swept(target, caplog):
    acc = make(target, reduction_type="SUM")
    acc.apply_grad(np.ones(SHAPE))
    r = target.redis()
    (first,) = r.lrange(acc._keys.grads, 0, -1)
    r.delete(entry_key_names(first)[2])
    acc.apply_grad(np.full(SHAPE, 2.0))
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(SHAPE, 2.0))
    (why,) = r.lrange(acc._keys.quarantine, 0, -1)
    assert why.startswith(b"missing d4 ")
    assert "quarantined 1" in caplog.text
    assert spread_keys(r, acc) == [] and orphans(r, acc) == []  # its parts swept by the take


@pytest.mark.parametrize("damage", ["short", "long"])
def test_a_resized_part_is_quarantined(target, damage):
    acc = make(target)
    acc.apply_grad(np.ones(SHAPE))
    r = target.redis()
    (first,) = r.lrange(acc._keys.grads, 0, -1)
    key = entry_key_names(first)[1]
    r.set(key, r.get(key)[:-4] if damage == "short" else r.get(key) + b"\0\0\0\0")
    with pytest.raises(accumulator.DeadlineExceededError):
        acc.take_grad(1, timeout=0.5)
    (why,) = r.lrange(acc._keys.quarantine, 0, -1)
    assert why.startswith(b"part 1 length ")
    assert acc.num_accumulated() == 0 and acc.global_step() == 0


def test_a_registration_that_ran_out_is_refused(target, monkeypatch):
    """An apply that took longer than ORPHAN_TTL_MS between writing its parts and recording
    them: a sweeper may be deleting the parts, so the script refuses it; nothing counted."""
    acc = make(target)
    monkeypatch.setattr(_model, "ORPHAN_TTL_MS", 0)
    with pytest.raises(accumulator.ResourceExhaustedError, match="swept"):
        acc.apply_grad(np.ones(SHAPE))
    assert acc.num_accumulated() == 0
    r = target.redis()
    assert [m[:1] for m in orphans(r, acc)] == [b"x"]  # garbage now, a sweeper's


def test_an_apply_that_died_before_its_script_is_swept(target, monkeypatch):
    """Registered and written, never recorded (the worker was killed): once the registration
    ran out, the next apply deletes its parts."""
    acc = make(target)
    monkeypatch.setattr(_model, "ORPHAN_TTL_MS", 1)

    def killed(run, n):
        raise KeyboardInterrupt  # the process dies here

    _on_apply_script(acc, monkeypatch, killed)
    with pytest.raises(KeyboardInterrupt):
        acc.apply_grad(np.ones(SHAPE))
    monkeypatch.undo()
    r = target.redis()
    assert len(spread_keys(r, acc)) == 4 and len(orphans(r, acc)) == 1
    assert acc.apply_grad(np.full(SHAPE, 2.0))  # sweeps the dead one's parts
    assert spread_keys(r, acc) == entry_key_names_of_round(r, acc)
    assert orphans(r, acc) == []
    np.testing.assert_array_equal(acc.take_grad(1), np.full(SHAPE, 2.0))


def test_describe_and_show_report_the_parts_of_an_apply_that_died(target, monkeypatch):
    """The parts of a spread payload whose worker died half-way have no expiry and sit under
    other slots' hash tags, where no SCAN of the accumulator's own pattern looks: ``describe``
    finds them by the orphans record, and ``show`` says when they go."""
    from accumulator._cli_render import render_show

    acc = make(target)
    _on_apply_script(acc, monkeypatch, lambda run, n: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        acc.apply_grad(np.ones(SHAPE))
    monkeypatch.undo()
    r = target.redis()
    info = _admin.describe(r, "spread")
    assert info.spread_stray_keys == 4 and info.stray_keys == 0
    assert info.spread_stray_bytes is None or info.spread_stray_bytes >= SHAPE[0] * 16
    assert 0 < info.spread_stray_due_ms <= _model.ORPHAN_TTL_MS
    text = "\n".join(render_show(info))
    assert "4 stray parts" in text and "after" in text
    # the record ran out: due, and the next apply deletes them
    (member,) = orphans(r, acc)
    r.zadd(acc._keys.orphans, {member: 0})
    info = _admin.describe(r, "spread")
    assert (info.spread_stray_keys, info.spread_stray_due_ms) == (4, 0)
    assert "next apply, take, reset or delete deletes them" in "\n".join(render_show(info))
    assert acc.apply_grad(np.full(SHAPE, 2.0))
    info = _admin.describe(r, "spread")
    assert info.spread_stray_keys == 0 and info.spread_stray_due_ms is None
    assert "stray part" not in "\n".join(render_show(info))
    acc.close()


def test_a_taker_that_died_after_its_finish_leaves_garbage_the_next_apply_sweeps(target):
    acc = make(target)
    acc.apply_grad(np.ones(SHAPE))
    from _helpers import take_script

    assert take_script(acc, "5-dead", 1, 10_000)[0] == 1
    k = acc._keys
    reply = _scripts.call(acc.redis, "finish",
                          [k.state, k.claim("5-dead"), k.claims, k.finished, k.orphans],
                          ["5-dead"])  # fmt: skip
    assert int(reply[0]) == 1 and [m[:2] for m in reply[1]] == [b"xd"]
    r = target.redis()
    assert len(spread_keys(r, acc)) == 4  # the taker died before deleting them
    r.zadd(k.orphans, {reply[1][0]: 0})  # its lease ran out
    acc.apply_grad(np.ones(SHAPE), local_step=1)
    assert spread_keys(r, acc) == entry_key_names_of_round(r, acc) and orphans(r, acc) == []


def test_reset_delete_and_evict_remove_spread_parts(target):
    acc = make(target)
    r = target.redis()
    acc.apply_grad(np.ones(SHAPE))
    assert _admin.reset(r, "spread") == 1
    assert spread_keys(r, acc) == [] and orphans(r, acc) == []
    acc.apply_grad(np.ones(SHAPE))
    from _helpers import take_script

    assert take_script(acc, "6-dead", 1, 10_000, claim_ms=60_000)[0] == 1
    assert _admin.evict(r, "spread", "6-dead", drop=True) == "dropped"
    assert spread_keys(r, acc) == [] and orphans(r, acc) == []
    acc.apply_grad(np.ones(SHAPE), local_step=1)
    acc.apply_grad(np.ones(SHAPE), local_step=1)
    assert take_script(acc, "7-dead", 1, 10_000, claim_ms=60_000)[0] == 1  # claims both
    acc.apply_grad(np.ones(SHAPE), local_step=2)
    assert len(spread_keys(r, acc)) == 12
    assert _admin.delete(r, "spread") > 12
    assert spread_keys(r, acc) == [] and list(r.scan_iter(match=acc._keys.pattern)) == []


def test_a_client_that_speaks_only_schema_2_is_refused(target):
    acc = make(target)
    with pytest.raises(accumulator.SchemaVersionError, match="version 3"):
        _scripts.call(acc.redis, "set_step", [acc._keys.state], [SCHEMA_VERSION, 5])
    assert acc.global_step() == 0


def test_the_choice_is_stored_and_followed(target):
    make(target, "chosen")
    later = make(target, "chosen", spread_parts=False)  # an opener follows the creator
    assert later.spreads_parts
    plain = make(target, "plain", spread_parts=False)
    assert not plain.spreads_parts and plain._schema == SCHEMA_VERSION
    assert make(target, "plain", spread_parts=None).spreads_parts is False
    with pytest.raises(accumulator.InvalidArgumentError, match="private"):
        accumulator.ConditionalAccumulator(np.float32, (3,), client=target.client(),
                                           spread_parts=True)  # fmt: skip
    with pytest.raises(accumulator.InvalidArgumentError, match="spread_parts"):
        make(target, "bad", spread_parts="yes")


def test_the_asyncio_twin(target):
    from accumulator import aio

    async def main() -> None:
        acc = await aio.ConditionalAccumulator(
            np.float32, SHAPE, shared_name="aio-spread", client=aclient(target),
            spread_parts=True,
        )  # fmt: skip
        assert acc.spreads_parts
        await acc.apply_grad(np.ones(SHAPE))
        await acc.apply_grad(np.full(SHAPE, 3.0))
        assert await acc.apply_grad(np.ones(SHAPE), local_step=-1) is False
        np.testing.assert_array_equal(await acc.take_grad(2), np.full(SHAPE, 2.0))
        await acc.aclose()

    asyncio.run(main())
    r = target.redis()
    keys = accumulator._keys.Keys("", "aio-spread")
    assert list(r.scan_iter(match=keys.spread_pattern)) == []
