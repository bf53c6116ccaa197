"""Our side of the dense accumulator: sharing across objects, definitions, private
accumulators, retries counted once, takers that time out or crash, key hygiene."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis
from _helpers import PROMPT, Taker, redis_snapshot, take_script, waiting_takers

import accumulator
from accumulator import _direct, _model, _scripts
from accumulator._keys import Keys

SMALL = (3, 2)
LARGE = (64, 1024)  # 256 KiB of float32: goes through its own key, not through Lua


def make(target, shared_name="w", shape=SMALL, dtype=np.float32, **kw):
    return accumulator.ConditionalAccumulator(
        dtype, shape=shape, shared_name=shared_name, client=target.client(), **kw
    )


def keys_of(target, acc) -> list[bytes]:
    r = target.redis()
    return sorted(r.scan_iter(match=Keys(acc.container, acc.shared_name or "").pattern))


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "blob"])
def test_two_objects_share_one_accumulator(target, shape):
    worker, chief = make(target, shape=shape), make(target, shape=shape)
    g = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    assert worker.apply_grad(g, local_step=0) is True
    assert worker.apply_grad(3 * g, local_step=0) is True
    assert chief.num_accumulated() == 2
    np.testing.assert_array_equal(chief.take_grad(2), 2 * g)
    assert worker.global_step() == 1
    assert worker.apply_grad(g, local_step=0) is False  # stale now, for every host
    assert chief.num_accumulated() == 0


def test_opening_with_another_definition_names_both(target):
    make(target, shape=(3, 2))
    with pytest.raises(accumulator.InvalidArgumentError) as err:
        make(target, shape=(3, 3))
    assert "dense float32 [3,2] MEAN" in str(err.value)
    assert "dense float32 [3,3] MEAN" in str(err.value)
    with pytest.raises(accumulator.InvalidArgumentError, match="float64"):
        make(target, dtype=np.float64)
    with pytest.raises(accumulator.InvalidArgumentError, match="SUM"):
        make(target, reduction_type="SUM")
    # the same definition spelled differently opens fine
    assert make(target, shape=[3, 2], dtype="float32").num_accumulated() == 0


def test_containers_and_names_are_namespaces(target):
    a = make(target, shared_name="q", container="c1")
    b = make(target, shared_name="q", container="c2")
    c = make(target, shared_name="q", name="other-label", container="c1")
    a.apply_grad(np.ones(SMALL))
    assert (a.num_accumulated(), b.num_accumulated(), c.num_accumulated()) == (1, 0, 1)


def test_names_with_braces_keep_one_hash_tag(target):
    acc = make(target, shared_name="we{ird}:na/me%", container="c{:}")
    acc.apply_grad(np.ones(SMALL))
    names = keys_of(target, acc)
    assert names, "the accumulator wrote no keys"
    for key in names:
        # a Redis Cluster hashes the text between the first '{' and the next '}'
        text = key.decode()
        tag = text[text.index("{") + 1 : text.index("}")]
        assert tag == acc.accumulator_ref.split("{", 1)[1].split("}", 1)[0]


def test_private_accumulators_are_unreachable_and_cleaned_up(target):
    a = accumulator.ConditionalAccumulator(np.float32, shape=SMALL, client=target.client())
    b = accumulator.ConditionalAccumulator(np.float32, shape=SMALL, client=target.client())
    a.apply_grad(np.ones(SMALL))
    assert (a.num_accumulated(), b.num_accumulated()) == (1, 0)
    assert a.shared_name is None
    r = target.redis()
    state = a.accumulator_ref + ":s"
    assert 0 < r.pttl(state) <= _model.PRIVATE_TTL_MS  # safety net while the process lives
    a.close()
    assert not r.exists(state)
    with pytest.raises(accumulator.CancelledError):
        a.num_accumulated()


@pytest.mark.parametrize("private", [False, True], ids=["named", "private"])
def test_pickling_an_accumulator_says_how_to_reach_it_from_another_process(target, private):
    """Passed to a process started by spawn: "cannot pickle '_thread.lock' object" (review)."""
    import pickle

    acc = accumulator.ConditionalAccumulator(np.float32, shape=SMALL, client=target.client(),
                                             shared_name=None if private else "pk")  # fmt: skip
    hint = "forked from its process only" if private else "shared_name='pk', client="
    with pytest.raises(TypeError, match=f"cannot pickle ConditionalAccumulator.*{hint}"):
        pickle.dumps(acc)
    acc.close()


def test_closing_a_private_accumulator_deletes_every_key_without_a_scan(target):
    """close() finds a private accumulator's keys by what names them (a SCAN walks the
    whole keyspace: seconds on a Redis shared with millions of keys): a finished take's
    record (kept for a retried finish), a round of large payloads (parts; spread over slots on
    a cluster; a running sum with the module) claimed by a taker that is gone, a pending
    round, retry records; nothing is left."""
    acc = accumulator.ConditionalAccumulator(np.float32, shape=(3, 1 << 18), client=target.client())
    g = np.ones((3, 1 << 18), np.float32)  # 3 MiB: three parts
    assert acc.apply_grad(g) and acc.apply_grad(g)
    acc.take_grad(2)  # recorded two minutes (a retried finish is answered)
    assert acc.apply_grad(g, local_step=1) and acc.apply_grad(2 * g, local_step=1)
    assert int(take_script(acc, "12345-abcdef", 2, 60_000)[0]) == 1  # claimed, never read
    assert acc.apply_grad(g, local_step=2) and acc.apply_grad(g, local_step=2)
    r = target.redis()
    pattern = acc._keys.family_pattern
    assert len(list(r.scan_iter(match=pattern))) > 10
    real = target.kind in ("real", "module")
    if real:
        r.config_resetstat()
    acc.close()
    if real:
        assert "cmdstat_scan" not in r.info("commandstats")
    assert not list(r.scan_iter(match=pattern))


def test_deleted_accumulator_is_a_clear_error(target):
    acc = make(target)
    other = accumulator.ConditionalAccumulator(
        np.float32, shape=SMALL, shared_name="x y", container="team", client=target.client()
    )
    for a in (acc, other):
        target.redis().delete(a.accumulator_ref + ":s")
    # the error names the accumulator (a job may drive dozens)
    with pytest.raises(accumulator.NotFoundError, match=f"accumulator {acc.shared_name!r} does"):
        acc.apply_grad(np.ones(SMALL))
    with pytest.raises(accumulator.NotFoundError, match=f"{acc.shared_name!r} does not exist"):
        acc.take_grad(1, timeout=1)
    with pytest.raises(accumulator.NotFoundError, match=f"{acc.shared_name!r} does not exist"):
        acc.num_accumulated()
    with pytest.raises(accumulator.NotFoundError,
                       match=r"accumulator 'x y' \(container 'team'\) does not"):  # fmt: skip
        other.apply_grad(np.ones(SMALL))


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "blob"])
def test_an_object_of_an_accumulator_deleted_and_created_again_applies_nothing(target, shape):
    """As TF's handle of a deleted resource: an object opened before its accumulator was
    deleted and created again under the same name does not apply into the new one (its
    gradient belongs to the old one: a sync job's worker still on the old run)."""
    old = accumulator.ConditionalAccumulator(np.float32, shape=shape, shared_name="again",
                                             client=target.client())  # fmt: skip
    assert old.apply_grad(np.ones(shape), local_step=0)
    r = target.redis()
    accumulator._admin.delete(r, "again")
    new = accumulator.ConditionalAccumulator(np.float32, shape=shape, shared_name="again",
                                             client=target.client())  # fmt: skip
    with pytest.raises(accumulator.NotFoundError, match="deleted and created again since this "
                                                        "object opened it: nothing of the new"):
        old.apply_grad(np.full(shape, 7.0), local_step=0)
    assert new.num_accumulated() == 0
    state = r.hgetall(new.accumulator_ref + ":s")
    assert int(state[b"n_applied"]) == int(state[b"n_rejected"]) == 0
    # its payload gone (on a cluster, where parts are spread over slots, the apply is refused
    # when it registers them, before any is written: nothing for a sweep either)
    assert list(r.scan_iter()) == [(new.accumulator_ref + ":s").encode()]
    assert new.apply_grad(np.ones(shape), local_step=0)  # (the new object applies)
    np.testing.assert_array_equal(new.take_grad(1), np.ones(shape))
    # one without an instance id was created again by an older client (or by hand): refused
    # too; an object that opens it gives it its own (as if created now), and applies
    state = new.accumulator_ref + ":s"
    r.hdel(state, "inst")
    with pytest.raises(accumulator.NotFoundError, match="deleted and created again since"):
        new.apply_grad(np.ones(shape), local_step=1)
    third = accumulator.ConditionalAccumulator(np.float32, shape=shape, shared_name="again",
                                               client=target.client())  # fmt: skip
    assert r.hget(state, "inst") == third._instance.encode()
    assert third.apply_grad(np.ones(shape), local_step=1)
    # a hand-made script call without an id is not checked
    assert _scripts.call(r, "set_step", [state], [third._schema, 1]) == b"1"
    for closing in (old, new, third):
        closing.close()


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["sent", "read"])
def test_a_take_whose_accumulator_is_created_again_while_it_reads_raises_not_found(
    target, shape
):
    """Deleted and created again between the take's claim and its finish: NotFoundError
    (not "another taker took the round over"), and the new accumulator untouched. ``sent``:
    the payloads came with the claim (the finish finds its claim gone); ``read``: they are
    read after it (gone by then)."""
    r = target.redis()
    old = accumulator.ConditionalAccumulator(np.float32, shape=shape, shared_name="again",
                                             client=target.client())  # fmt: skip
    assert old.apply_grad(np.ones(shape), local_step=0)
    made = []
    reduce = old._reduce_claim

    def recreate_then_reduce(claim, out=None):
        accumulator._admin.delete(r, "again")
        new = accumulator.ConditionalAccumulator(np.float32, shape=shape, shared_name="again",
                                                 client=target.client())  # fmt: skip
        assert new.apply_grad(np.full(shape, 5.0), local_step=0)
        made.append(new)
        return (yield from reduce(claim, out))

    old._reduce_claim = recreate_then_reduce
    with pytest.raises(accumulator.NotFoundError, match="deleted and created again while this "
                                                        "take read its round"):  # fmt: skip
        old.take_grad(1, timeout=5)
    new = made[0]
    assert new.num_accumulated() == 1 and new.global_step() == 0
    np.testing.assert_array_equal(new.take_grad(1, timeout=5), np.full(shape, 5.0))
    old.close()
    new.close()


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_an_object_of_an_accumulator_deleted_and_created_again_takes_and_steps_nothing(
    target, kind
):
    """Nor does such an object take, count, read or set the new one's step: its take
    quarantined the new accumulator's gradients as "resized" (the old object's dtype and
    shape were another), and its set_global_step moved the new one's step."""
    r = target.redis()
    if kind == "dense":
        old = accumulator.ConditionalAccumulator(np.float32, (4,), shared_name="again",
                                                 client=target.client())  # fmt: skip
        accumulator._admin.delete(r, "again")
        new = accumulator.ConditionalAccumulator(np.float64, (2,), shared_name="again",
                                                 client=target.client())  # fmt: skip
        for value in (1.0, 3.0):
            assert new.apply_grad(np.full(2, value), local_step=0)
    else:
        old = accumulator.SparseConditionalAccumulator(np.float32, (5, 4), shared_name="again",
                                                       client=target.client())  # fmt: skip
        accumulator._admin.delete(r, "again")
        new = accumulator.SparseConditionalAccumulator(np.float64, (5, 2), shared_name="again",
                                                       client=target.client())  # fmt: skip
        for value in (1.0, 3.0):
            assert new.apply_indexed_slices_grad(
                accumulator.IndexedSlices(np.full((1, 2), value), np.array([1])), local_step=0
            )
    before = redis_snapshot(r)
    gone = pytest.raises(accumulator.NotFoundError, match="deleted and created again since")
    with gone:
        old.take_grad(1, timeout=1)
    with gone:
        old.set_global_step(9)
    with gone:
        old.num_accumulated()
    with gone:
        old.global_step()
    assert redis_snapshot(r) == before
    assert new.num_accumulated() == 2 and new.global_step() == 0
    taken = new.take_grad(2, timeout=5)
    got = taken if kind == "dense" else taken.values
    np.testing.assert_array_equal(got, np.full((2,) if kind == "dense" else (1, 2), 2.0))
    old.close()
    new.close()


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "blob"])
def test_a_resent_apply_is_counted_once(target, shape):
    """What redis-py's retry does after a lost reply: the same (client, seq) arrives again."""
    acc = make(target, shape=shape)
    g = np.ones(shape, np.float32)
    assert acc.apply_grad(g) is True
    acc._identities._free[-1].seq -= 1  # the next apply re-sends the previous one
    assert acc.apply_grad(g) is True  # answered like the original
    assert acc.num_accumulated() == 1
    acc.apply_grad(2 * g)
    np.testing.assert_array_equal(acc.take_grad(2), 1.5 * g)
    # a re-sent stale apply stays dropped and leaves no payload behind
    assert acc.apply_grad(g, local_step=0) is False
    acc._identities._free[-1].seq -= 1
    assert acc.apply_grad(g, local_step=0) is False
    assert acc.num_accumulated() == 0
    r = target.redis()
    # the taken round's payloads wait (expiring) for the next take to free them; the stale
    # apply's payload is gone
    assert all(r.pttl(k) > 0 for k in keys_of(target, acc) if b":b:" in k)
    assert len([k for k in keys_of(target, acc) if b":b:" in k]) <= 2


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "blob"])
def test_a_resent_take_returns_the_same_round(target, shape):
    acc = make(target, shape=shape)
    acc.apply_grad(np.ones(shape))
    first = take_script(acc, "1-abc", 1, 10_000)
    acc.apply_grad(np.ones(shape), local_step=1)
    again = take_script(acc, "1-abc", 1, 10_000)
    assert first == again  # not a second round
    assert acc.global_step() == 1 and acc.num_accumulated() == 1


def test_timeout_consumes_nothing_and_leaves_no_taker(target):
    acc = make(target)
    acc.apply_grad(np.ones(SMALL))
    t0 = time.monotonic()
    with pytest.raises(accumulator.DeadlineExceededError, match="Timed out waiting"):
        acc.take_grad(2, timeout=0.3)
    assert time.monotonic() - t0 < 3
    with pytest.raises(TimeoutError):  # also a TimeoutError
        acc.take_grad(2, timeout=0)
    assert acc.num_accumulated() == 1 and acc.global_step() == 0
    r = target.redis()
    assert r.zcard(acc._keys.takers) == 0 and r.hlen(acc._keys.taker_info) == 0
    # a later take(1) is not blocked by the departed take(2)
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(SMALL))


def test_interrupted_take_leaves_no_trace(target):
    acc = make(target)
    acc.wait_slice = 0.05
    calls = {"n": 0}
    original = acc._blpop

    def interrupted(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args, **kw)

    acc._blpop = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        acc.take_grad(1)
    r = target.redis()
    assert r.zcard(acc._keys.takers) == 0
    assert acc.global_step() == 0
    acc.apply_grad(np.ones(SMALL))
    assert acc.num_accumulated() == 1


def test_head_of_line_blocking_and_fifo(target):
    acc = make(target)
    order: list[str] = []

    def take(n, label):
        acc2 = make(target)
        acc2.take_grad(n, timeout=20)
        order.append(label)

    big = threading.Thread(target=take, args=(3, "take3"))
    big.start()
    deadline = time.monotonic() + 5
    while target.redis().zcard(acc._keys.takers) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    small = threading.Thread(target=take, args=(1, "take1"))
    small.start()
    while target.redis().zcard(acc._keys.takers) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    acc.apply_grad(np.ones(SMALL))
    time.sleep(0.3)
    assert order == []  # take(1) waits behind take(3) although one gradient is there
    acc.apply_grad(np.ones(SMALL))
    acc.apply_grad(np.ones(SMALL))
    big.join(10)
    assert order == ["take3"]
    acc.apply_grad(np.ones(SMALL), local_step=1)
    small.join(10)
    assert order == ["take3", "take1"]
    assert acc.global_step() == 2


def test_a_crashed_head_taker_blocks_the_fifo_only_until_its_lease_ends(target):
    acc = make(target)
    k = acc._keys
    from accumulator import _scripts

    # a taker that joined and then vanished (process killed): lease of 0.3 s
    reply = _scripts.call(acc.redis, "take", *acc._take_script_args("1-0", 5, 300))
    assert reply[0] == 0
    acc.apply_grad(np.ones(SMALL))
    acc.wait_slice = 0.1
    t0 = time.monotonic()
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(SMALL))
    assert time.monotonic() - t0 < 3
    assert target.redis().zcard(k.takers) == 0


def test_take_wakes_promptly_on_apply(target):
    acc = make(target)
    result: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: result.append(acc.take_grad(1, timeout=10)))
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    make(target).apply_grad(np.ones(SMALL))
    waiter.join(10)
    # woken by the signal, not by the end of a wait slice
    assert result and time.monotonic() - t0 < acc.wait_slice
    np.testing.assert_array_equal(result[0], np.ones(SMALL))



def test_a_woken_take_claims_in_the_round_trip_of_its_wait(real, monkeypatch):
    """The take script rides behind the BLPOP: a take that waits costs its first check, the
    wait (with the re-check the wake-up starts), and the finish. Counted on the taker's
    thread only, without the handshake of a connection the pool opens meanwhile (when the
    other thread's apply holds the idle one at that moment)."""
    acc, other = make(real), make(real)
    original = redis.connection.AbstractConnection.send_packed_command
    sends: list[bytes] = []
    handshake = {b"HELLO", b"PING", b"CLIENT", b"AUTH", b"SELECT"}

    def send(self, command, *args, **kwargs):
        if threading.get_ident() == taker_thread[0]:
            first = bytes(command if isinstance(command, (bytes, bytearray)) else command[0])
            name = first.split(b"\r\n")[2].upper()  # *<n>, $<len>, the command's name
            if name not in handshake:
                sends.append(name)
        return original(self, command, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
    taker_thread = [0]
    for step in range(2):  # the first round opens the taker's connections
        result: list[np.ndarray] = []

        def take(result: list[np.ndarray] = result) -> None:
            taker_thread[0] = threading.get_ident()
            result.append(acc.take_grad(1, timeout=10))

        sends.clear()
        waiter = threading.Thread(target=take)
        waiter.start()
        time.sleep(0.3)  # queued and waiting (a wait slice lasts seconds)
        other.apply_grad(np.full(SMALL, step, np.float32), local_step=step)
        waiter.join(10)
        np.testing.assert_array_equal(result[0], np.full(SMALL, step, np.float32))
    assert sends == [b"EVALSHA", b"BLPOP", b"EVALSHA"]

@pytest.mark.parametrize(("grads", "kib"), [(3, 40), (4, 40), (4, 320)],
                         ids=["3x40KiB", "4x40KiB", "4x320KiB"])  # fmt: skip
def test_a_claim_brings_small_payloads_along(real, sends, grads, kib):
    """Payloads in one key each, 128 KiB of them at most, come in the take script's reply:
    such a take makes 2 round trips (claim, finish), not 3. 3 x 40 KiB gradients come along,
    4 x 40 KiB do not, unless the module holds their sum (40 KiB); 4 x 320 KiB never (its
    sum neither). Their keys are freed all the same."""
    elements = kib << 8
    acc = make(real, "along", shape=(elements,))
    for step in range(2):  # the first round loads the scripts
        for k in range(grads):
            acc.apply_grad(np.full(elements, k + 1, np.float32), local_step=step)
        sends[0] = 0
        mean = np.float32(sum(range(1, grads + 1)) / grads)
        np.testing.assert_array_equal(acc.take_grad(grads), np.full(elements, mean))
    if real.kind != "cluster":  # (a cluster spreads large payloads over slots)
        along = kib == 40 and (grads == 3 or acc.sums_in_redis)
        assert sends[0] == (2 if along else 3)
    assert [k for k in keys_of(real, acc) if b":b:" in k] == []
    acc.close()


def test_a_woken_take_whose_script_was_flushed_meanwhile_still_claims(real, monkeypatch):
    """The take script behind the wait meets NOSCRIPT (a restarted or flushed server): the
    take makes the call again the ordinary way, which loads it."""
    from accumulator import _scripts

    behind: list[bool] = []
    original = _scripts.reply_behind

    def reply_behind(run, reply, error):
        made, value = original(run, reply, error)
        behind.append(made)
        return made, value

    monkeypatch.setattr(_scripts, "reply_behind", reply_behind)
    acc, other = make(real), make(real)  # (opening one loads every script)
    result: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: result.append(acc.take_grad(1, timeout=10)))
    waiter.start()
    time.sleep(0.3)  # waiting, with the take script queued behind its BLPOP
    real.redis().script_flush()
    other.apply_grad(np.full(SMALL, 7.0))  # loads the apply script only
    waiter.join(10)
    np.testing.assert_array_equal(result[0], np.full(SMALL, 7.0, np.float32))
    assert acc.global_step() == 1
    assert behind[-1] is False  # the script behind the wait was not there


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "blob"])
def test_nothing_left_behind_after_takes(target, shape):
    acc = make(target, shape=shape)
    for step in range(3):
        for _ in range(3):
            acc.apply_grad(np.ones(shape), local_step=step)
        acc.apply_grad(np.ones(shape), local_step=step - 1)  # stale
        acc.take_grad(3)
    left = [k for k in keys_of(target, acc) if b":b:" in k or b":c:" in k or k.endswith(b":g")]
    r = target.redis()
    # at most what the last take left for the next one to free (its retry buffer, and the
    # payloads of a small round), all expiring
    assert all((b":c:" in k or b":b:" in k) and r.pttl(k) > 0 for k in left), left
    assert len([k for k in left if b":c:" in k]) <= 1
    assert len([k for k in left if b":b:" in k]) <= 3


def test_numpy_views_and_non_contiguous_input(target):
    acc = make(target, shape=(3, 2), dtype=np.float64)
    base = np.arange(12, dtype=np.float32).reshape(6, 2)
    acc.apply_grad(base[::2])  # a strided float32 view, cast to float64
    acc.apply_grad(base[::2].T.T)
    np.testing.assert_array_equal(acc.take_grad(2), base[::2].astype(np.float64))


def test_big_endian_input_is_converted(target):
    acc = make(target, shape=(4,), dtype=np.float32)
    acc.apply_grad(np.arange(4, dtype=">f4"))
    np.testing.assert_array_equal(acc.take_grad(1), np.arange(4, dtype=np.float32))


def test_tf_dtype_objects_and_names(target):
    class FakeTFDType:  # what tf.float16 looks like to us
        name = "half"
        as_numpy_dtype = np.float16

    acc = make(target, dtype=FakeTFDType(), shared_name="h")
    assert acc.dtype == np.float16
    with pytest.raises(accumulator.InvalidArgumentError, match="Unsupported"):
        make(target, dtype="object", shared_name="o")
    with pytest.raises(accumulator.InvalidArgumentError, match="reduction"):
        make(target, reduction_type="MAX", shared_name="m")


def test_connection_reset_mid_take_recovers(real):
    """All client connections killed while a take waits and appliers run: nothing lost."""
    acc = make(real)
    acc.wait_slice = 0.2
    out: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: out.append(acc.take_grad(3, timeout=15)))
    waiter.start()
    time.sleep(0.3)
    admin = real.redis()
    every = {"target_nodes": "all"} if real.kind == "cluster" else {}
    worker = make(real)
    worker.apply_grad(np.ones(SMALL))
    admin.client_kill_filter(_type="normal", skipme=True, **every)
    worker.apply_grad(np.ones(SMALL))
    admin.client_kill_filter(_type="normal", skipme=True, **every)
    worker.apply_grad(np.ones(SMALL))
    waiter.join(20)
    assert out, "the take did not survive the connection resets"
    np.testing.assert_array_equal(out[0], np.ones(SMALL))
    assert acc.global_step() == 1 and acc.num_accumulated() == 0


def test_server_restart_without_persistence_is_a_clear_error(own_server):
    acc = make(own_server)
    acc.apply_grad(np.ones(SMALL))
    own_server.server.restart()  # no persistence: the accumulator is gone
    with pytest.raises(accumulator.NotFoundError):
        acc.apply_grad(np.ones(SMALL))
    # re-opening recreates it empty; scripts are re-registered after the restart
    again = make(own_server)
    assert again.apply_grad(np.ones(SMALL)) is True


def _parser_classes() -> list[type]:
    """redis-py's reply parsers (hiredis, RESP2, RESP3): whichever a connection uses."""
    import redis._parsers as parsers

    return [
        cls for cls in vars(parsers).values()
        if isinstance(cls, type) and "read_response" in vars(cls)
        and not cls.__name__.startswith("_Async")
    ]  # fmt: skip


@pytest.mark.parametrize("where", ["before-read", "in-read"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "blob"])
def test_an_interrupted_read_drops_its_connection(target, monkeypatch, shape, where):
    """Ctrl-C while an apply waits for its reply: the reply may still come, on a connection
    that must not serve the next command (which would read the old reply as its own).

    ``in-read``: the interrupt lands inside redis-py's read of the reply (where a Ctrl-C
    nearly always lands: waiting on the socket); ``before-read``: after the command was sent,
    before the read starts, which our direct path must cover itself."""
    if target.kind == "cluster" and where == "before-read":
        pytest.skip("redis-py's cluster client releases a connection interrupted between its "
                    "send and its read without dropping it (a window of a few bytecodes)")
    if target.kind == "fake" and where == "in-read":
        pytest.skip("fakeredis reads no socket: it has no reply parser to interrupt")
    acc = make(target, shape=shape)
    assert acc.apply_grad(np.ones(shape, np.float32), local_step=0)
    conn_cls = redis.Connection
    send = conn_cls.send_packed_command
    state = {"sent": False, "fired": False}

    def send_packed_command(self, command, *args, **kw):
        pieces = [command] if isinstance(command, (bytes, str)) else command
        state["sent"] = state["sent"] or any(
            isinstance(p, bytes) and b"EVALSHA" in p for p in pieces)  # fmt: skip
        return send(self, command, *args, **kw)

    def interrupting(read):
        def read_response(self, *args, **kw):
            if state["sent"] and not state["fired"]:  # the apply script's reply, unread
                state["fired"] = True
                raise KeyboardInterrupt
            return read(self, *args, **kw)

        return read_response

    monkeypatch.setattr(conn_cls, "send_packed_command", send_packed_command)
    gathered = _direct._gathered

    def gather(sock, views):  # a command of several pieces, sent by our sendmsg
        state["sent"] = state["sent"] or any(b"EVALSHA" in bytes(v) for v in views)
        return gathered(sock, views)

    monkeypatch.setattr(_direct, "_gathered", gather)
    if where == "before-read":
        classes = [acc.redis.connection_pool.connection_class]
    else:
        classes = _parser_classes()
    for cls in classes:
        monkeypatch.setattr(cls, "read_response", interrupting(cls.read_response))
    with pytest.raises(KeyboardInterrupt):
        acc.apply_grad(np.full(shape, 2, np.float32), local_step=0)
    monkeypatch.undo()
    assert state["fired"], "the fault was not injected"
    # the interrupted apply ran or not (a closed socket may lose the command); every later
    # call reads its own reply
    counted = int(target.redis().hget(acc._keys.state, "count"))
    assert counted in (1, 2)
    for _ in range(3):
        assert acc.num_accumulated() == counted
    expected = np.full(shape, 1.0 if counted == 1 else 1.5, np.float32)
    np.testing.assert_array_equal(acc.take_grad(counted), expected)
    assert acc.apply_grad(np.ones(shape, np.float32), local_step=0) is False  # stale now
    assert acc.apply_grad(np.ones(shape, np.float32), local_step=1) is True
    assert acc.num_accumulated() == 1


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "blob"])
def test_lost_reply_is_retried_and_counted_once(real, monkeypatch, shape):
    """The server executed the apply but the reply never arrived: redis-py's retry re-sends
    the whole command (pipeline), and the script recognises it."""
    acc = make(real, shape=shape)
    if real.kind == "cluster":  # the node clients' connections
        conn_cls = redis.Connection
    else:
        conn_cls = type(acc.redis.connection_pool.get_connection())
    original = conn_cls.read_response
    lost = {"armed": True}

    def read_response(self, *args, **kw):
        reply = original(self, *args, **kw)
        if lost["armed"] and isinstance(reply, list) and reply and reply[0] == 1:
            lost["armed"] = False
            raise redis.ConnectionError("reply lost (test)")
        return reply

    monkeypatch.setattr(conn_cls, "read_response", read_response)
    assert acc.apply_grad(np.ones(shape, np.float32)) is True
    assert not lost["armed"], "the fault was not injected"
    monkeypatch.undo()
    assert acc.num_accumulated() == 1
    np.testing.assert_array_equal(acc.take_grad(1), np.ones(shape))


def test_reset_container_removes_only_that_container(target):
    a = make(target, shared_name="q", container="job1")
    b = make(target, shared_name="q", container="job2")
    a.apply_grad(np.ones(SMALL))
    b.apply_grad(np.ones(SMALL))
    assert accumulator.reset_container("job1", client=target.client()) > 0
    with pytest.raises(accumulator.NotFoundError):
        a.num_accumulated()
    assert b.num_accumulated() == 1
    names = {(i.container, i.shared_name) for i in accumulator.list_accumulators(
        client=target.client())}  # fmt: skip
    assert names == {("job2", "q")}


def test_describe_and_delete_one_accumulator_by_name(target):
    a = make(target, shared_name="q", container="job1")
    b = make(target, shared_name="q", container="job2")
    a.apply_grad(np.ones(SMALL), local_step=0)
    info = accumulator.describe_accumulator("q", container="job1", client=target.client())
    assert (info.container, info.shared_name, info.kind, info.count) == ("job1", "q", "dense", 1)
    assert info.step == 0 and info.keys and info.keys > 0
    with pytest.raises(accumulator.NotFoundError, match="'q'"):
        accumulator.describe_accumulator("q", client=target.client())  # not in container ""
    assert accumulator.delete_accumulator("q", container="job1", client=target.client()) > 0
    assert not keys_of(target, a)
    with pytest.raises(accumulator.NotFoundError):
        a.apply_grad(np.ones(SMALL), local_step=0)
    with pytest.raises(accumulator.NotFoundError):
        accumulator.delete_accumulator("q", container="job1", client=target.client())
    assert b.num_accumulated() == 0  # the other container's is untouched


def test_a_blob_round_is_freed_when_its_take_returns(target):
    acc = make(target, shape=LARGE)
    for _ in range(2):
        acc.apply_grad(np.ones(LARGE))
    acc.take_grad(2)
    assert not [k for k in keys_of(target, acc) if b":b:" in k or b":c:" in k]


def test_an_inline_round_is_freed_when_its_take_returns(target):
    acc = make(target)
    acc.apply_grad(np.ones(SMALL))
    acc.take_grad(1)
    assert not [k for k in keys_of(target, acc) if b":c:" in k]
    r = target.redis()
    assert not r.exists(acc._keys.claims)  # the registry holds claims in flight only
    assert r.zcard(acc._keys.finished) == 1  # remembered for a retried finish ...
    assert 0 < r.pttl(acc._keys.finished) <= 120_000  # ... for two minutes


def test_the_claim_registry_stays_small_however_many_takes_finish(target):
    """Every take scans the registry for leases that ran out: finished takes must not pile
    up there (they did once: two minutes of takes made each take slower)."""
    acc = make(target)
    for step in range(30):
        acc.apply_grad(np.ones(SMALL), local_step=step)
        acc.take_grad(1)
    r = target.redis()
    assert not r.exists(acc._keys.claims)
    assert r.zcard(acc._keys.finished) == 30


def test_finish_forgets_takes_older_than_two_minutes(target):
    from accumulator import _scripts

    acc = make(target)
    r = target.redis()
    now_s, now_us = r.time()
    now_ms = now_s * 1000 + now_us // 1000
    r.zadd(acc._keys.finished, {"1-a01d": now_ms - 121_000, "2-b0b": now_ms - 60_000})
    acc.apply_grad(np.ones(SMALL))
    acc.take_grad(1)
    left = {m.decode() for m in r.zrange(acc._keys.finished, 0, -1)}
    assert "1-a01d" not in left and "2-b0b" in left and len(left) == 2
    k = acc._keys  # the forgotten take's retried finish no longer owns a round
    finish = [k.state, k.claim("1-a01d"), k.claims, k.finished, k.orphans], ["1-a01d"]
    assert _scripts.call(acc.redis, "finish", *finish) == 0


def test_a_take_prunes_done_marks_older_clients_left_in_the_registry(target):
    acc = make(target)
    r = target.redis()
    r.hset(acc._keys.claims, mapping={"1-abc": "done 5", "2-def": "done 6"})
    acc.apply_grad(np.ones(SMALL))
    acc.take_grad(1)
    assert not r.exists(acc._keys.claims)


def _crashed_take(acc, lease_ms: int) -> list:
    """Claim the round the way a take does, with a short claim lease, then 'crash'."""

    reply = take_script(acc, "9-dead", 1, 10_000, claim_ms=lease_ms)
    assert reply[0] == 1
    return reply


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["inline", "blob"])
def test_a_round_claimed_by_a_crashed_taker_is_handed_to_the_next(target, shape, caplog):
    LARGE = shape  # noqa: N806 - the same test for inline and blob rounds
    worker, chief = make(target, shape=LARGE), make(target, shape=LARGE)
    worker.apply_grad(np.ones(LARGE))
    worker.apply_grad(np.full(LARGE, 3.0))
    _crashed_take(worker, lease_ms=200)
    assert worker.global_step() == 1  # the crashed take advanced the step
    worker.apply_grad(np.full(LARGE, 7.0), local_step=1)  # the next round begins meanwhile
    time.sleep(0.3)
    # the restarted chief gets the crashed take's round, as it was (no second step advance)
    np.testing.assert_array_equal(chief.take_grad(1, timeout=5), np.full(LARGE, 2.0))
    assert "took over a round" in caplog.text
    assert worker.global_step() == 1 and worker.num_accumulated() == 1
    np.testing.assert_array_equal(chief.take_grad(1, timeout=5), np.full(LARGE, 7.0))
    assert worker.global_step() == 2
    leftovers = [k for k in keys_of(target, chief) if b":b:" in k or b":c:" in k]
    assert leftovers == []
    info = accumulator._admin.describe(target.redis(), "w")
    assert info.n_taken == 2 and info.claims == ()


def test_a_live_claim_is_not_taken_over(target):
    worker, chief = make(target, shape=LARGE), make(target, shape=LARGE)
    worker.apply_grad(np.ones(LARGE))
    _crashed_take(worker, lease_ms=60_000)  # still leased: maybe just slow
    worker.apply_grad(np.full(LARGE, 7.0), local_step=1)
    np.testing.assert_array_equal(chief.take_grad(1, timeout=5), np.full(LARGE, 7.0))
    assert worker.global_step() == 2


def test_a_taker_whose_lease_ran_out_does_not_return_the_round(target, monkeypatch):
    """A take too slow to finish within its claim lease loses the round to the next taker
    rather than both returning it."""
    slow, other = make(target, shape=LARGE), make(target, shape=LARGE)
    slow.apply_grad(np.ones(LARGE))
    monkeypatch.setattr(_model, "CLAIM_LEASE_MS", 0)
    monkeypatch.setattr(_model, "CLAIM_LEASE_MS_PER_MIB", 0)
    real_reduce = slow._reduce_claim
    results = []

    def reduce_slowly(claim, out=None):
        results.append(other.take_grad(1, timeout=5))  # meanwhile, another chief's take
        return real_reduce(claim, out)

    monkeypatch.setattr(slow, "_reduce_claim", reduce_slowly)
    with pytest.raises(accumulator.AccumulatorError, match="lease ran out"):
        slow.take_grad(1, timeout=5)
    np.testing.assert_array_equal(results[0], np.ones(LARGE))
    assert slow.global_step() == 1 and slow.num_accumulated() == 0


@pytest.mark.parametrize("step", [10**14, 2**53 - 2])
def test_large_global_steps_stay_exact(target, step):
    """Steps from a µs clock: Lua prints 1e14 as "1e+14"; the scripts must not."""
    acc = make(target)
    acc.set_global_step(step)
    assert acc.apply_grad(np.ones(SMALL), local_step=step) is True
    assert acc.apply_grad(np.ones(SMALL), local_step=step - 1) is False
    np.testing.assert_array_equal(acc.take_grad(1), np.ones(SMALL))
    assert acc.global_step() == step + 1
    state = target.redis().hgetall(acc.accumulator_ref + ":s")
    assert all(b"e+" not in v for k, v in state.items() if k != b"def"), state


def test_close_from_another_thread_cancels_a_waiting_take(target):
    acc = make(target)
    acc.wait_slice = 0.2
    other = make(target)
    outcome: list[object] = []

    def take():
        try:
            outcome.append(acc.take_grad(1, timeout=10))
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    waiter = threading.Thread(target=take)
    waiter.start()
    time.sleep(0.3)
    acc.close()
    time.sleep(0.1)
    other.apply_grad(np.ones(SMALL))
    waiter.join(5)
    assert outcome and isinstance(outcome[0], accumulator.CancelledError), outcome
    assert other.global_step() == 0 and other.num_accumulated() == 1  # nothing claimed


def test_close_lets_an_operation_in_flight_in_another_thread_end_first(target):
    """close() from another thread while a take holds its script's reply (between the
    round trip and its wait): it waits for that take to end, which sees the close, raises
    CancelledError and withdraws from the queue of takers before the connections close (a
    review's stress runs: the close cut the take's connection under it, which raised
    UnavailableError and left its entry to its lease, the next take waiting behind it)."""
    acc = make(target)
    replied, go = threading.Event(), threading.Event()
    real_do = acc._do

    def gated(request):
        reply = real_do(request)
        if getattr(request, "name", None) == "take" and not replied.is_set():
            replied.set()  # in the FIFO now, its wait not begun
            go.wait(PROMPT)
        return reply

    acc._do = gated
    taker = Taker(acc, 1, timeout=10)
    taker.start()
    assert replied.wait(PROMPT)
    assert waiting_takers(target, acc) == 1
    closer = threading.Thread(target=acc.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # waiting for the take in flight (it returned at once before)
    go.set()
    closer.join(PROMPT)
    assert not closer.is_alive()
    assert waiting_takers(target, acc) == 0  # withdrawn before the close ended
    with pytest.raises(accumulator.CancelledError):
        taker.finish()
    other = make(target)
    other.apply_grad(np.ones(SMALL))
    np.testing.assert_array_equal(other.take_grad(1, timeout=PROMPT), np.ones(SMALL))
    other.close()


def test_bad_timeouts_and_steps_are_refused(target):
    acc = make(target)
    for bad in (float("nan"), float("inf"), -1, "1"):
        with pytest.raises(accumulator.InvalidArgumentError, match="timeout"):
            acc.take_grad(1, timeout=bad)
    with pytest.raises(accumulator.InvalidArgumentError, match="int64"):
        acc.apply_grad(np.ones(SMALL), local_step=2**63)
    assert acc.num_accumulated() == 0


def test_a_retried_finish_still_owns_its_round(target):
    """finish's reply lost and re-sent after another take ran: still this taker's round."""
    from accumulator import _scripts

    acc, other = make(target), make(target)
    acc.apply_grad(np.ones(SMALL))
    _crashed_take(acc, lease_ms=60_000)
    k = acc._keys
    finish = [k.state, k.claim("9-dead"), k.claims, k.finished, k.orphans], ["9-dead"]
    assert _scripts.call(acc.redis, "finish", *finish) == 1
    acc.apply_grad(np.ones(SMALL), local_step=1)
    other.take_grad(1, timeout=5)  # runs the registry loop
    assert _scripts.call(acc.redis, "finish", *finish) == 1
