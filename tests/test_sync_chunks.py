"""The sync helper's parameter broadcast in chunks: parts of one chunk under versioned keys,
switched in one MULTI, the previous version kept readable for a minute at most (until the
next publish)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from accumulator import _chunks
from accumulator._keys import SyncKeys
from accumulator._stream import fill
from accumulator.sync import ParameterServer, Worker, chief_key

CHUNK = _chunks.CHUNK_BYTES


def _params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"big": rng.standard_normal(3 * CHUNK // 8 + 11),  # float64: 4 parts, the last short
            "small": np.arange(6, dtype=np.float32).reshape(2, 3)}  # fmt: skip


def _job(target, name: str):
    """A published job: the client, its chief and its keys."""
    ps = ParameterServer(name, replicas_to_aggregate=1, client=target.client())
    ps.initialize(_params())
    return target.redis(), ps, SyncKeys("", name)


def _values(r, keys: SyncKeys) -> dict[bytes, int]:
    return {k: r.strlen(k) for k in r.scan_iter(match=keys.versions_pattern)}


def test_large_parameters_travel_in_parts_and_old_versions_expire(target):
    r, ps, keys = _job(target, "big")
    first = _values(r, keys)
    assert len(first) == 4 + 1 and max(first.values()) == CHUNK  # no value over a chunk
    assert all(r.pttl(k) == -1 for k in first)
    assert r.hget(keys.params, "v:big") is None  # the hash is small: no parameter bytes
    worker = Worker("big", client=target.client())
    step, params = worker.pull(timeout=5)
    for name, value in _params().items():
        np.testing.assert_array_equal(params[name], value)
        assert params[name].dtype == value.dtype and params[name].flags.writeable
    grad = {"big": np.ones_like(_params()["big"]), "small": np.ones((2, 3), np.float32)}
    worker.push(step, grad)
    assert ps.step(0.5, timeout=5) == 1
    now = _values(r, keys)
    old, new = set(first), set(now) - set(first)
    assert len(new) == 5
    assert all(0 < r.pttl(k) <= 60_000 for k in old)  # readable for a minute more
    assert all(r.pttl(k) == -1 for k in new)
    step, params = worker.pull(after=0, timeout=5)
    np.testing.assert_array_equal(params["big"], _params()["big"] - 0.5)
    worker.close()
    ps.close()


def test_redis_holds_two_parameter_versions_however_fast_the_steps(target):
    """The previous version stays readable (a reader may be in the middle of it); the next
    publish deletes it, so Redis holds two versions of the parameters at most, not every
    version of the last minute (that was 30 at 16 MiB with steps of a second or two)."""
    r, ps, keys = _job(target, "fast")
    worker = Worker("fast", client=target.client())
    step, _ = worker.pull(timeout=5)
    grad = {"big": np.ones_like(_params()["big"]), "small": np.ones((2, 3), np.float32)}
    for _ in range(4):
        worker.push(step, grad)
        ps.step(0.5, timeout=5)
        step, _ = worker.pull(after=step, timeout=5)
    assert step == 4
    tenure = ps._lease.tenure
    current = ps._version_keys(ps._run, 4, tenure)
    previous = ps._version_keys(ps._run, 3, tenure)
    assert {k.decode() for k in _values(r, keys)} == {*current, *previous}
    assert all(r.pttl(k) == -1 for k in current)
    assert all(0 < r.pttl(k) <= 60_000 for k in previous)
    worker.close()
    ps.close()


def test_a_resumed_job_expires_the_versions_of_earlier_chiefs(target):
    """A chief killed between writing a version's parts and its switch left them without
    expiry, under its tenure (no later publish writes them again): the chief that resumes
    the job lets every version but the published one expire within a minute."""
    r, ps, keys = _job(target, "left")
    current = set(ps._version_keys(ps._run, 0, ps._lease.tenure))
    dead = ps._version_keys(ps._run, 1, "deadbeef")  # never switched to
    for key in dead:
        r.set(key, b"x")
    ps._lease._stop.set()
    r.hset(chief_key(keys), "expires_ms", 0)  # the chief died
    again = ParameterServer("left", replicas_to_aggregate=1, client=target.client())
    assert again.initialize(_params()) == 0
    assert all(0 < r.pttl(k) <= 60_000 for k in dead)
    assert all(r.pttl(k) == -1 for k in current)  # the published version stays
    again.close()
    ps.close()


def test_a_reader_whose_version_vanished_reads_the_newer_one(target):
    r, ps, keys = _job(target, "v")
    worker = Worker("v", client=target.client())
    original = worker._read_params
    calls = []

    def read_params(published):
        calls.append(published.step)
        if len(calls) == 1:  # the chief publishes twice while this reader is slow
            w2 = Worker("v", client=target.client())
            w2.pull(timeout=5)
            w2.push(0, {"big": np.ones(_params()["big"].shape), "small": np.ones((2, 3))})
            ps.step(1.0, timeout=5)
            w2.close()
            for k in r.scan_iter(match=keys.versions_pattern):
                if r.pttl(k) > 0:
                    r.delete(k)  # its minute is over
        return original(published)

    worker._read_params = read_params
    step, params = worker.pull(timeout=5)
    assert calls == [0, 1] and step == 1
    np.testing.assert_array_equal(params["big"], _params()["big"] - 1.0)
    worker.close()
    ps.close()


def test_parameters_deleted_from_redis_are_a_clear_error(target):
    r, ps, keys = _job(target, "gone")
    for k in r.scan_iter(match=keys.versions_pattern):
        r.delete(k)
    worker = Worker("gone", client=target.client())
    with pytest.raises(RuntimeError, match="missing from Redis"):
        worker.pull(timeout=5)
    worker.close()
    ps.close()


def test_a_new_run_and_a_job_delete_leave_no_version_behind(target):
    from accumulator import _admin

    r, ps, keys = _job(target, "n")
    ps.initialize(_params(), resume=False)  # a new run: the old run's versions go
    assert len(_values(r, keys)) == 5
    ps.finish()
    _admin.delete_job(r, "n")
    assert _values(r, keys) == {}
    ps.close()


def _small_model() -> dict[str, np.ndarray]:
    return {f"layer{i}": np.full((8, 4), i, np.float32) for i in range(6)}


@pytest.mark.parametrize("rows", [8, 512])
def test_a_small_model_is_published_and_pulled_in_one_round_trip(real, sends, rows):
    """Six small parameters: the chief's publish is one MULTI (parts and hash together), a
    steady worker's pull one pipeline (the hash and the version it expects next); a tiny
    model (6 x 128 bytes, not 6 x 8 KiB) comes in the publish's announcement: no read at
    all."""
    model = {name: np.repeat(value, rows // 8, axis=0) for name, value in _small_model().items()}
    ps = ParameterServer("small", replicas_to_aggregate=1, client=real.client())
    ps.initialize(model)
    worker = Worker("small", client=real.client())
    step, _ = worker.pull(timeout=5)
    worker.push(step, {name: np.ones((rows, 4), np.float32) for name in model})
    ps.step(0.5, timeout=5)
    sends[0] = 0
    step, params = worker.pull(after=step, timeout=5)
    assert step == 1 and sends[0] == (0 if rows == 8 else 1)
    for name, value in model.items():
        np.testing.assert_array_equal(params[name], value - 0.5)
        params[name] += 1  # the caller's own arrays
    sends[0] = 0
    ps._publish()  # the same version again (what a retry sends)
    assert sends[0] == (2 if real.kind == "cluster" else 1)  # a cluster publishes after EXEC
    worker.close()
    ps.close()


@pytest.mark.parametrize(("elements", "round_trips"), [(262144, 1), (262145, 2)])
def test_parameters_of_one_part_are_published_in_one_round_trip(
    real, sends, elements, round_trips, monkeypatch
):
    """Up to one part in all (1 MiB, as an apply's payload), the parameters travel in the
    MULTI of the switch, and a steady worker reads them with the hash; above that, their
    parts are written first, then the switch, and read after the hash. Either way they are
    received straight into the arrays returned."""
    from accumulator.sync import _job

    copies = []
    monkeypatch.setattr(_job, "fill", lambda view, value: copies.append(1) or fill(view, value))
    ps = ParameterServer("onepart", replicas_to_aggregate=1, client=real.client())
    ps.initialize({"w": np.arange(elements, dtype=np.float32)})
    sends[0] = 0
    ps._publish()  # the same version again (what a retry sends)
    assert sends[0] == round_trips + (1 if real.kind == "cluster" else 0)
    worker = Worker("onepart", client=real.client())
    step, _ = worker.pull(timeout=5)
    worker.push(step, {"w": np.ones(elements, np.float32)})
    ps.step(0.5, timeout=5)
    sends[0] = 0
    copies.clear()
    step, params = worker.pull(after=step, timeout=5)
    assert step == 1 and sends[0] == round_trips
    # (a cluster client copies the one part it reads with the hash)
    assert len(copies) == (1 if real.kind == "cluster" and round_trips == 1 else 0)
    np.testing.assert_array_equal(params["w"], np.arange(elements, dtype=np.float32) - 0.5)
    worker.close()
    ps.close()


def _two_steps_behind(target, job):
    """A job two steps on, and a worker ``slow`` that pulled step 0 and nothing since."""
    ps = ParameterServer(job, replicas_to_aggregate=1, client=target.client())
    ps.initialize(_small_model())
    slow = Worker(job, client=target.client())
    fast = Worker(job, client=target.client())
    assert slow.pull(timeout=5)[0] == 0
    for step in range(2):
        fast.pull(timeout=5)
        fast.push(step, {name: np.ones((8, 4), np.float32) for name in _small_model()})
        ps.step(1.0, timeout=5)
    return ps, slow, fast


def _close(*objects):
    for obj in objects:
        obj.close()


def test_a_worker_steps_behind_pulls_the_newest_parameters(target):
    """The pull reads the version it expects next along with the hash; when the chief is
    further ahead, it reads the version the hash names instead (a worker whose pub/sub
    connection was lost meanwhile: it looks)."""
    ps, slow, fast = _two_steps_behind(target, "behind")
    slow._drop_pubsub()  # (its connection lost: the announcements in it with it)
    step, params = slow.pull(after=0, timeout=5)
    assert step == 2
    for name, value in _small_model().items():
        np.testing.assert_array_equal(params[name], value - 2.0)
    _close(slow, fast, ps)


def test_a_worker_with_announcements_in_hand_returns_the_newest(target, monkeypatch):
    """A worker subscribed since its last pull reads no hash: of the announcements in hand
    it returns the newest. In-process (fakeredis) both are in hand when the chief's step
    returns; a server may write a PUBLISH's reply to the chief before the announcement to a
    subscriber (CI failed on that, on a cluster): the worker may have step 1 alone in hand,
    and gets step 2 from the next announcement, still without a look."""
    ps, slow, fast = _two_steps_behind(target, "inhand")
    monkeypatch.setattr(slow, "_read_published", lambda *a, **k: pytest.fail("a look"))
    step, params = slow.pull(after=0, timeout=5)
    if target.kind != "fake" and step == 1:
        step, params = slow.pull(after=1, timeout=5)
    assert step == 2
    for name, value in _small_model().items():
        np.testing.assert_array_equal(params[name], value - 2.0)
    _close(slow, fast, ps)


def test_announcements_that_do_not_fit_are_read_instead(target):
    """A worker trusts an announcement's parameters only when it names the worker's run and
    carries every parameter at its size; anything else on the channel (a step alone, another
    run, garbage, a version not newer) makes it read the published state, which wins."""
    from accumulator.sync._published import encode_announcement

    ps = ParameterServer("noise", replicas_to_aggregate=1, client=target.client())
    ps.initialize(_small_model())
    worker = Worker("noise", client=target.client())
    step, _ = worker.pull(timeout=5)
    worker.push(step, {name: np.ones((8, 4), np.float32) for name in _small_model()})
    ps.step(1.0, timeout=5)
    r = target.redis()
    channel = worker.keys.channel
    wrong = [np.full(32, 7, np.float32).data for _ in _small_model()]
    for noise in (b"garbage", b"\x95\xa2p1", b"1",
                  encode_announcement("another run", 1, False, wrong),
                  encode_announcement(ps._run, 1, False, wrong[:-1]),
                  encode_announcement(ps._run, 1, False, [w[:64] for w in wrong]),
                  encode_announcement(ps._run, 0, False, wrong)):  # fmt: skip
        r.publish(channel, noise)  # after the chief's own: the newest in hand
        step, params = worker.pull(after=0, timeout=5)
        assert step == 1
        for name, value in _small_model().items():
            np.testing.assert_array_equal(params[name], value - 1.0)
        worker._watched = worker._pubsub  # as after a look: wait for announcements again
    worker.close()
    ps.close()


def test_an_announcement_decodes_to_fresh_native_arrays():
    from accumulator._fusion import plan
    from accumulator.sync._published import (
        ParamSpec,
        decode_announcement,
        encode_announcement,
        unit_bytes,
    )

    specs = plan([ParamSpec("a", "dense", np.dtype(">f8"), (2, 3)),
                  ParamSpec("b", "dense", np.dtype("float16"), (4,))], 0)  # fmt: skip
    a, b = np.arange(6, dtype=">f8").reshape(2, 3), np.arange(4, dtype=np.float16)
    wire = [np.ascontiguousarray(a, "<f8").reshape(-1).view(np.uint8).data,
            b.view(np.uint8).data]  # fmt: skip
    message = encode_announcement("r", 5, True, wire)
    step, done, params = decode_announcement(message, "r", specs)
    assert (step, done) == (5, True)
    np.testing.assert_array_equal(params["a"], a)
    assert params["a"].dtype == np.dtype(">f8") and params["b"].dtype == np.float16
    assert all(p.flags.writeable and p.flags.owndata for p in params.values())
    assert decode_announcement(message, "other", specs) is None
    assert decode_announcement(message, None, specs) is None
    assert decode_announcement(message, "r", specs[:1]) is None
    assert decode_announcement(encode_announcement("r", 5, False, None), "r", specs) is None
    assert decode_announcement(message[:-3], "r", specs) is None
    # a fused bucket travels as one buffer; its parameters come back as views of a fresh one
    fused = plan([ParamSpec("c", "dense", np.dtype("float16"), (2, 2)),
                  ParamSpec("d", "dense", np.dtype("float16"), ())], 1024)  # fmt: skip
    values = {"c": np.arange(4, dtype=np.float16).reshape(2, 2), "d": np.float16(7)}
    message = encode_announcement("r", 6, False, [unit_bytes(fused[0], values)])
    step, done, params = decode_announcement(message, "r", fused)
    assert (step, done) == (6, False) and set(params) == {"c", "d"}
    np.testing.assert_array_equal(params["c"], values["c"])
    assert params["d"].shape == () and params["d"] == 7
    assert all(p.flags.writeable for p in params.values())
    assert decode_announcement(message, "r", specs) is None  # another layout


def test_a_pull_without_time_to_wait_still_sees_a_new_step(target):
    """``pull(after=..., timeout=0)``: the new step if it is there (from the announcement in
    hand), else DeadlineExceededError after a look."""
    import accumulator

    ps = ParameterServer("now", replicas_to_aggregate=1, client=target.client())
    ps.initialize(_small_model())
    worker = Worker("now", client=target.client())
    step, _ = worker.pull(timeout=5)
    with pytest.raises(accumulator.DeadlineExceededError):
        worker.pull(after=step, timeout=0)
    worker.push(step, {name: np.ones((8, 4), np.float32) for name in _small_model()})
    ps.step(1.0, timeout=5)
    time.sleep(0.1)  # the announcement has arrived
    assert worker.pull(after=step, timeout=0)[0] == 1
    with pytest.raises(accumulator.DeadlineExceededError):
        worker.pull(after=1, timeout=0)
    worker.close()
    ps.close()
