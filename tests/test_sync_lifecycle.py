"""accumulator.sync, the job's life: a finished job stays finished, one chief per job (the
chief lease), pushes checked before anything is applied, errors that name the parameter, and
a chief that dies during a step (between its takes and its publish) recovered exactly: the
round it had claimed is handed to the restarted chief, a round it had read is accounted as
lost, and the published step and the accumulators' steps agree again."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from _helpers import take_script

import accumulator
from accumulator import _scripts
from accumulator._keys import Keys, SyncKeys
from accumulator._requests import Command
from accumulator.sync import (
    ChiefConflictError,
    TrainingFinished,
    Worker,
    _worker,
    accumulator_name,
    chief_key,
)

LR = 0.5


class ParameterServer(accumulator.sync.ParameterServer):
    """These tests look into each parameter's own accumulator (``ps._accs["w"]``, a round of
    "w" claimed, "emb" read): one per parameter, no fusion (test_sync_fusion.py has the
    same recoveries with fused parameters)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("fusion_bytes", 0)
        super().__init__(*args, **kwargs)


def _params(big: bool = False) -> dict[str, np.ndarray]:
    """w dense, emb sparse, b dense (in this order: the specs' order). ``big``: w is 80 KB,
    so its gradients travel as payload keys (above the 32 KiB inline limit)."""
    w = np.linspace(-1.0, 1.0, 100 * 100 if big else 6).reshape((100, 100) if big else (2, 3))
    return {"w": w, "emb": np.arange(12, dtype=np.float64).reshape(6, 2) / 10,
            "b": np.array([0.5, -0.5])}  # fmt: skip


def _grad(params: dict[str, np.ndarray], step: int, k: int) -> dict:
    """Worker ``k``'s gradient at ``step``: a function of the parameters, so a gradient that
    is lost, doubled, or computed on the wrong parameters shows in the result."""
    rows = np.array(sorted({(k + step) % 6, (2 * k + 1) % 6}))
    return {
        "w": params["w"] * 0.1 * (k + 1) + 0.01 * step + k,
        "emb": (rows, params["emb"][rows] * 0.5 + (k + 1)),
        "b": params["b"] + k + step,
    }


def _update(params: dict[str, np.ndarray], grads: list[dict], skip: set[str] = frozenset()):
    """One SGD step averaging ``grads`` (MEAN; sparse rows over their own contributions);
    parameters in ``skip`` get no update (their gradients were lost)."""
    out = {k: v.copy() for k, v in params.items()}
    if "w" not in skip:
        out["w"] -= LR * np.mean([g["w"] for g in grads], axis=0)
    if "b" not in skip:
        out["b"] -= LR * np.mean([g["b"] for g in grads], axis=0)
    if "emb" not in skip:
        sums, counts = np.zeros_like(out["emb"]), np.zeros(len(out["emb"]))
        for g in grads:
            rows, values = g["emb"]
            sums[rows] += values
            counts[rows] += 1
        used = counts > 0
        out["emb"][used] -= LR * sums[used] / counts[used, None]
    return out


def _assert_params(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, err_msg=name)


def _never(*args, **kwargs):
    raise AssertionError("not to be called")


def _steps(target, job: str) -> dict[str, int]:
    return {
        name: int(target.redis().hget(Keys("", accumulator_name(job, name)).state, "step"))
        for name in ("w", "emb", "b")
    }


# -- a finished job stays finished --------------------------------------------------------------


def test_rerun_finished_chief_keeps_the_job_finished(target, caplog):
    ps = ParameterServer("fin", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker("fin", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    for s in range(2):
        worker.push(step, _grad(params, step, 0))
        ps.step(LR, timeout=5, final=s == 1)
        step, params = worker.pull(timeout=5)
    assert ps.finished and step == 2 and worker.finished
    final = ps.params
    ps.close()

    again = ParameterServer("fin", replicas_to_aggregate=1, sparse={"emb"},
                            client=target.client())  # fmt: skip
    with caplog.at_level("INFO", logger="accumulator.sync"):
        assert again.initialize(_params()) == 2  # returns: nothing reset
    assert "is finished" in caplog.text
    assert again.finished and again.global_step == 2
    _assert_params(again.params, final)
    with pytest.raises(TrainingFinished, match="finished"):
        again.step(LR, timeout=1)
    again.finish()  # a no-op
    stats = again.stats()
    assert stats.done and stats.step == 2 and stats.pushes == 2
    # a worker waiting for the next step is told at once (it used to hang for its timeout)
    t0 = time.monotonic()
    with pytest.raises(TrainingFinished):
        worker.pull(after=1, timeout=30)
    assert time.monotonic() - t0 < 5
    # the README's worker loop: a worker joining the finished job pushes nothing
    late = Worker("fin", client=target.client(), worker_id="late")
    step, params = late.pull(timeout=5)
    pushed = 0
    while not late.finished:
        late.push(step, _grad(params, step, 1))
        pushed += 1
    assert pushed == 0
    # resume=False is the explicit new job
    assert again.initialize(_params(), resume=False) == 0
    assert not again.finished and again.stats().pushes == 0
    late.close()
    worker.close()
    again.close()


def test_push_into_a_finished_job_is_refused(target):
    ps = ParameterServer("pf", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker("pf", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    worker.push(step, _grad(params, step, 0))
    assert ps.step(LR, timeout=5, final=True) == 1
    step, params = worker.pull(timeout=5)
    assert worker.finished and step == 1
    with pytest.raises(TrainingFinished, match="nothing was applied"):
        worker.push(step, _grad(params, step, 0))
    with pytest.raises(TrainingFinished):
        worker.push(step + 5, _grad(params, step, 0))
    r = target.redis()
    for name in ("w", "emb", "b"):
        assert int(r.hget(Keys("", accumulator_name("pf", name)).state, "count")) == 0
    # a late push for an earlier step is dropped as stale, as any late push
    assert worker.push(0, _grad(params, 0, 0)) == {"w": False, "emb": False, "b": False}
    stats = ps.stats()
    assert (stats.pushes, stats.stale) == (2, 1)
    assert stats.workers["w0"].last_seen_ms is not None
    worker.close()
    ps.close()


@pytest.mark.parametrize("how", ["final step", "finish"])
def test_a_push_after_the_end_from_a_worker_that_has_not_pulled_applies_nothing(
    target, how, monkeypatch
):
    """The worker pulled before the job finished: its push makes no look at the job first,
    the sealed accumulators refuse it (TrainingFinished, nothing applied, not counted); a
    push for an earlier step is still dropped as stale."""
    ps = ParameterServer("pe", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    late = Worker("pe", client=target.client(), worker_id="late")
    other = Worker("pe", client=target.client(), worker_id="other")
    step, params = late.pull(timeout=5)
    other.pull(timeout=5)
    if how == "final step":
        other.push(step, _grad(params, step, 1))
        assert ps.step(LR, timeout=5, final=True) == 1
    else:
        ps.finish()
    final = ps.global_step
    before = ps.stats()
    with pytest.raises(TrainingFinished, match="nothing was applied"):
        late.push(final, _grad(params, final, 0))
    r = target.redis()
    for name in ("w", "emb", "b"):
        state = Keys("", accumulator_name("pe", name)).state
        assert int(r.hget(state, "count")) == 0 and int(r.hget(state, "sealed")) == final
    after = ps.stats()
    assert (after.pushes, after.stale) == (before.pushes, before.stale)
    assert "late" not in after.workers or after.workers["late"].pushes == 0
    assert late.finished  # the push told it
    if final > 0:
        assert late.push(0, _grad(params, 0, 0)) == {"w": False, "emb": False, "b": False}
    with pytest.raises(TrainingFinished):
        late.pull(after=step, timeout=5)
    assert late.finished and late.step == step  # still the parameters it pulled
    # the worker that was told by its pull: finished, and a push at the final step is refused
    # without a look at Redis; an earlier one is dropped as stale, as any late push
    with pytest.raises(TrainingFinished):
        other.pull(after=step, timeout=5)
    assert other.finished and other.step == step
    with monkeypatch.context() as m:
        m.setattr(_worker, "validated_push", _never)
        with pytest.raises(TrainingFinished, match="nothing was applied"):
            other.push(final, _grad(params, final, 1))
    if final > 0:
        assert other.push(0, _grad(params, 0, 1)) == {"w": False, "emb": False, "b": False}
    for w in (late, other):
        w.close()
    ps.close()


def test_a_chief_started_on_a_finished_job_seals_what_the_dead_one_did_not(target):
    """The chief died between its final publish and the seal: pushes went in unrefused until
    a chief is started on the job again, whose initialize() seals the accumulators."""
    ps = ParameterServer("reseal", replicas_to_aggregate=1, sparse={"emb"},
                         client=target.client())  # fmt: skip
    ps.initialize(_params())
    ps.finish()
    ps.close()
    r = target.redis()
    states = [Keys("", accumulator_name("reseal", n)).state for n in ("w", "emb", "b")]
    for state in states:
        r.hdel(state, "sealed")
    again = ParameterServer("reseal", replicas_to_aggregate=1, sparse={"emb"},
                            client=target.client())  # fmt: skip
    assert again.initialize(_params()) == 0 and again.finished
    assert [r.hget(state, "sealed") for state in states] == [b"0"] * 3
    worker = Worker("reseal", client=target.client())
    worker.pull(timeout=5)
    worker._finished = False  # as a worker that pulled before the end
    with pytest.raises(TrainingFinished, match="nothing was applied"):
        worker.push(0, _grad(_params(), 0, 0))
    worker.close()
    again.close()
    # a deleted accumulator is not made again by the seal
    from accumulator import _admin

    _admin.delete(r, accumulator_name("reseal", "b"), "")
    third = ParameterServer("reseal", replicas_to_aggregate=1, sparse={"emb"},
                            client=target.client())  # fmt: skip
    assert third.initialize(_params()) == 0 and third.finished
    assert not r.exists(states[2])
    third.close()


def test_a_sealed_accumulator_refuses_raw_applies_but_drops_stale_ones(target):
    """``apply_grad`` on an accumulator of a finished sync job: FailedPreconditionError,
    nothing written; a stale one is dropped as stale, as always."""
    ps = ParameterServer("raw", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.zeros(3)}, step=4)
    ps.finish()
    acc = accumulator.ConditionalAccumulator(np.float64, (3,), shared_name=accumulator_name(
        "raw", "w"), client=target.client())  # fmt: skip
    r = target.redis()
    before = r.hgetall(acc._keys.state)
    with pytest.raises(accumulator.FailedPreconditionError, match="sealed") as info:
        acc.apply_grad(np.ones(3), local_step=4)
    assert info.value.final_step == 4
    assert r.hgetall(acc._keys.state) == before
    assert acc.apply_grad(np.ones(3), local_step=3) is False
    assert acc.num_accumulated() == 0
    acc.close()
    ps.close()


# -- one chief per job --------------------------------------------------------------------------


def test_a_second_chief_gets_a_clear_error(target):
    first = ParameterServer("two", replicas_to_aggregate=1, client=target.client(),
                            chief_id="chief-a")  # fmt: skip
    first.initialize({"w": np.zeros(3)})
    second = ParameterServer("two", replicas_to_aggregate=1, client=target.client(),
                             chief_id="chief-b")  # fmt: skip
    with pytest.raises(ChiefConflictError) as info:
        second.initialize({"w": np.zeros(3)})
    assert isinstance(info.value, accumulator.AccumulatorError)
    assert info.value.job == "two" and info.value.holder == "chief-a"
    assert "'two'" in str(info.value) and "'chief-a'" in str(info.value)
    assert 0 < info.value.expires_in <= 10
    with pytest.raises(ChiefConflictError):
        second.initialize({"w": np.zeros(3)}, resume=False)  # nor may it wipe the job
    with pytest.raises(ChiefConflictError):
        second.delete()
    t0 = time.monotonic()
    with pytest.raises(ChiefConflictError):
        second.initialize({"w": np.zeros(3)}, wait_for_chief=0.5)  # the first one lives on
    assert time.monotonic() - t0 >= 0.5
    assert first.global_step == 0
    # a chief that stops cleanly hands the job over at once
    first.close()
    assert second.initialize({"w": np.zeros(3)}) == 0
    second.close()


def test_a_chief_that_lost_its_lease_never_publishes(target):
    ps = ParameterServer("lost", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.zeros(3)})
    worker = Worker("lost", client=target.client())
    step, _ = worker.pull(timeout=5)
    worker.push(step, {"w": np.ones(3)})
    # another chief took the job over (as after this one stalled past its lease)
    key = chief_key(SyncKeys("", "lost"))
    far = int(time.time() * 1000) + 60_000
    target.redis().hset(key, mapping={"id": "usurper", "host": "h", "pid": "1",
                                      "renewed_ms": far - 60_000, "expires_ms": far})  # fmt: skip
    with pytest.raises(ChiefConflictError, match="usurper"):
        ps.step(LR, timeout=5)
    assert worker.pull(timeout=5)[0] == 0  # nothing was published
    with pytest.raises(ChiefConflictError):
        ps.step(LR, timeout=5)
    worker.close()
    ps.close()
    assert target.redis().hget(key, "id") == b"usurper"  # close() released nothing of theirs


def _a_round_in(target, job: str, big: bool, **kw):
    """A job at step 0 with one worker's round in: (its initial parameters, the chief, the
    worker, the parameters it pulled). ``big``: w of 1.28 MB, in parts written before the
    switch (else in the switch's MULTI)."""
    params = _params()
    if big:
        params["w"] = np.linspace(-1.0, 1.0, 400 * 400).reshape(400, 400)
    ps = ParameterServer(job, replicas_to_aggregate=1, sparse={"emb"}, client=target.client(),
                         **kw)  # fmt: skip
    ps.initialize({name: value.copy() for name, value in params.items()})
    worker = Worker(job, client=target.client())
    step, pulled = worker.pull(timeout=5)
    worker.push(step, _grad(params, step, 0))
    return params, ps, worker, pulled


@pytest.mark.parametrize("big", [False, True], ids=["small", "parts-first"])
def test_a_lease_taken_over_during_the_update_fences_the_publish(target, big):
    """The lease is checked by the publish itself, atomically: a takeover after the step's
    takes (here: while the update runs) leaves the published step, its parameters and no
    part of the refused version behind. ``parts-first``: over a chunk of parameters, so
    the new version's parts are written before the switch, not in its MULTI."""
    _, ps, worker, before = _a_round_in(target, "fence", big)
    key = chief_key(SyncKeys("", "fence"))
    r = target.redis()
    versions = sorted(r.scan_iter(match=SyncKeys("", "fence").versions_pattern))

    def usurp(params: dict, grads: dict, step: int) -> None:
        far = int(time.time() * 1000) + 60_000
        r.hset(key, mapping={"id": "usurper", "host": "h", "pid": "1",
                             "renewed_ms": far - 60_000, "expires_ms": far})  # fmt: skip

    with pytest.raises(ChiefConflictError, match="usurper"):
        ps.step(usurp, timeout=5)
    got_step, got = worker.pull(timeout=5)
    assert got_step == 0  # nothing was published
    for name in before:
        np.testing.assert_array_equal(got[name], before[name])
    assert sorted(r.scan_iter(match=SyncKeys("", "fence").versions_pattern)) == versions
    assert r.hget(key, "id") == b"usurper"
    worker.close()
    ps.close()


@pytest.mark.parametrize("big", [False, True], ids=["in-the-switch", "parts-first"])
def test_a_deposed_chief_writes_nothing_of_its_successors_version(target, big):
    """A chief paused past its lease (here: in its update) while another took over and
    published the same step: its late publish is refused and leaves the successor's
    parameters as they were. Its parts went under the successor's very key names (the
    version's names were (run, step)), so readers got the deposed chief's values, or, over
    a chunk, a mix of both within one tensor."""
    initial, ps, worker, before = _a_round_in(target, "depose", big, chief_id="first")
    key = chief_key(SyncKeys("", "depose"))
    r = target.redis()
    successor = ParameterServer("depose", replicas_to_aggregate=1, sparse={"emb"},
                                client=target.client(), chief_id="second")  # fmt: skip

    def paused_meanwhile(params: dict, grads: dict, step: int) -> None:
        r.hset(key, "expires_ms", 0)  # the first chief's lease ran out while it was paused
        # the second takes over: the first had read the round, so it republishes the
        # parameters unchanged at the next step (a reader sees them)
        assert successor.initialize(initial) == 1
        for name in params:
            params[name] = np.full_like(params[name], -7.0)

    with pytest.raises(ChiefConflictError, match="second"):
        ps.step(paused_meanwhile, timeout=5)
    got_step, got = worker.pull(timeout=5)
    assert got_step == 1
    for name in before:
        np.testing.assert_array_equal(got[name], before[name])
    tenure = successor._lease.tenure
    versions = {k.decode() for k in r.scan_iter(match=SyncKeys("", "depose").versions_pattern)}
    assert {k for k in versions if f".{tenure}:" not in k} <= set(ps._version_keys(ps._run, 0,
                                                                                  ps._lease.tenure))
    worker.close()
    successor.close()
    ps.close()


@pytest.mark.parametrize("successor_then", ["closed", "deleted the job", "finished"])
def test_a_deposed_chief_does_not_publish_once_the_lease_record_is_gone(target, successor_then):
    """The successor released the lease (close), deleted the job or finished it: no lease
    record is left. The deposed chief's publish found none and took the lease (its stale
    parameters published, a finished job unfinished, a deleted one brought back); it is
    refused, and writes nothing."""
    ps = ParameterServer("gone", replicas_to_aggregate=1, client=target.client(),
                         chief_id="first")  # fmt: skip
    ps.initialize({"w": np.zeros(3)})
    worker = Worker("gone", client=target.client())
    step, _ = worker.pull(timeout=5)
    worker.push(step, {"w": np.ones(3)})
    key = chief_key(SyncKeys("", "gone"))
    r = target.redis()

    def paused_meanwhile(params: dict, grads: dict, step: int) -> None:
        r.hset(key, "expires_ms", 0)
        successor = ParameterServer("gone", replicas_to_aggregate=1, client=target.client(),
                                    chief_id="second")  # fmt: skip
        successor.initialize({"w": np.zeros(3)})
        if successor_then == "deleted the job":
            successor.delete()
        elif successor_then == "finished":
            successor.finish()
        successor.close()
        params["w"] = np.full(3, -7.0)

    before = {k: r.dump(k) for k in r.scan_iter()} if successor_then != "closed" else None
    with pytest.raises(ChiefConflictError, match="gone"):
        ps.step(paused_meanwhile, timeout=5)
    published = r.hgetall(SyncKeys("", "gone").params)
    if successor_then == "deleted the job":
        assert list(r.scan_iter(match="accsync:*")) == []
    else:
        assert published[b"ten"] != ps._lease.tenure.encode()
        assert (published[b"done"] == b"1") == (successor_then == "finished")
        got_step, got = Worker("gone", client=target.client()).pull(timeout=5)
        np.testing.assert_array_equal(got["w"], np.zeros(3))
    assert not r.exists(key)  # not taken
    del before
    worker.close()
    ps.close()


def test_a_publish_whose_reply_was_lost_is_not_written_again(target, monkeypatch):
    """The switch landed, its reply was lost: the retry finds the hash naming its version
    and is done (it wrote every part again, which took away the expiry a successor's publish
    may have given them since, for good)."""
    from accumulator.sync import _publishing

    ps = ParameterServer("lost", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.linspace(0, 1, 400 * 400)})  # parts, written before the switch
    writes: list[int] = []
    real_write = _publishing.write_parts

    def counted(pipe, keys, data):
        writes.append(len(keys))
        return real_write(pipe, keys, data)

    real_switch = _scripts.evalsha_args
    lost: list[bool] = []

    def reply_lost(name, keys, args):
        command = real_switch(name, keys, args)
        if name == "sync_lease" and not lost:
            lost.append(True)
            target.redis().execute_command(*command)  # it lands; the reply does not
            raise redis.ConnectionError("reply lost")
        return command

    monkeypatch.setattr(_publishing, "write_parts", counted)
    monkeypatch.setattr(_scripts, "evalsha_args", reply_lost)
    worker = Worker("lost", client=target.client())
    step, _ = worker.pull(timeout=5)
    worker.push(step, {"w": np.ones(400 * 400)})
    assert ps.step(1.0, timeout=5) == 1
    assert lost == [True] and writes == [len(ps._version_keys(ps._run, 1, ps._lease.tenure))]
    got_step, got = worker.pull(after=0, timeout=5)
    np.testing.assert_array_equal(got["w"], np.linspace(0, 1, 400 * 400) - 1)
    worker.close()
    ps.close()


def test_a_take_cancelled_by_the_guard_renews_and_takes_again(target, monkeypatch):
    """The guard read "may have run out" when the take looked, and clear again (the lease
    thread renewed meanwhile) when step() looked: step() raised the take's internal
    CancelledError instead of renewing and taking again (seen once in a fault drill)."""
    from accumulator.sync import _lease

    ps = ParameterServer("guard", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.zeros(4)})
    worker = Worker("guard", client=target.client())
    step, _ = worker.pull(timeout=5)
    worker.push(step, {"w": np.ones(4)})
    looks = iter([True])
    monkeypatch.setattr(_lease._LeaseGuard, "is_set", lambda self: next(looks, False))
    assert ps.step(1.0, timeout=5) == 1
    np.testing.assert_array_equal(ps.params["w"], -np.ones(4))
    worker.close()
    ps.close()


def test_a_deposed_chief_does_not_take_the_lease_back_from_a_dead_successor(target):
    """Its renewal finds another chief's lease, run out: that chief may have published
    since, so this one has lost it (it took the lease back, and went on publishing its own
    older parameters over the successor's steps)."""
    ps = ParameterServer("back", replicas_to_aggregate=1, client=target.client(),
                         chief_id="first")  # fmt: skip
    ps.initialize({"w": np.zeros(3)})
    key = chief_key(SyncKeys("", "back"))
    r = target.redis()
    r.hset(key, mapping={"id": "second", "tenure": "t2", "expires_ms": 0})  # came, went
    with pytest.raises(ChiefConflictError, match="second"):
        ps._lease.check(renew=True)
    assert r.hget(key, "id") == b"second"
    # the same id restarted (a new tenure) fences the process it replaces, too
    old = ParameterServer("back", replicas_to_aggregate=1, client=target.client(),
                          chief_id="same")  # fmt: skip
    r.delete(key)
    old.initialize({"w": np.zeros(3)})
    new = ParameterServer("back", replicas_to_aggregate=1, client=target.client(),
                          chief_id="same")  # fmt: skip
    r.hset(key, "expires_ms", 0)
    new.initialize({"w": np.zeros(3)})
    with pytest.raises(ChiefConflictError, match="started later with this chief's id 'same'"):
        old._lease.check(renew=True)
    old._lease.release()  # refused: the lease stays the new process's
    assert r.hget(key, "tenure") == new._lease.tenure.encode()
    new.close()
    ps.close()


def test_a_job_published_before_tenures_is_read_and_resumed(target):
    """A job an earlier version published: no ``ten`` in the hash, its parts under
    ``v:<run>:<step>:...``, metadata version 2. Its parameters are read as they are; a
    chief resuming it publishes under its tenure, with the metadata (version 4: a reader of
    2 only would look for the parts under the old names)."""
    import msgpack

    ps = ParameterServer("old", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.arange(6.0).reshape(2, 3)})
    ps.close()
    r, keys = target.redis(), SyncKeys("", "old")
    run, tenure = r.hget(keys.params, "run").decode(), r.hget(keys.params, "ten").decode()
    for key in list(r.scan_iter(match=keys.versions_pattern)):
        r.rename(key, key.decode().replace(f"{run}.{tenure}:", f"{run}:"))
    meta = msgpack.unpackb(r.hget(keys.params, "meta"), raw=False)
    r.hset(keys.params, "meta", msgpack.packb({**meta, "v": 2}, use_bin_type=True))
    r.hdel(keys.params, "ten")
    worker = Worker("old", client=target.client())
    step, got = worker.pull(timeout=5)
    assert step == 0
    np.testing.assert_array_equal(got["w"], np.arange(6.0).reshape(2, 3))
    chief = ParameterServer("old", replicas_to_aggregate=1, client=target.client())
    assert chief.initialize({"w": np.zeros((2, 3))}) == 0  # resumed
    worker.push(0, {"w": np.ones((2, 3))})
    chief.step(1.0, timeout=5)
    step, got = worker.pull(after=0, timeout=5)
    assert step == 1
    np.testing.assert_array_equal(got["w"], np.arange(6.0).reshape(2, 3) - 1)
    assert r.hget(keys.params, "ten") == chief._lease.tenure.encode()
    assert msgpack.unpackb(r.hget(keys.params, "meta"), raw=False)["v"] == 4
    worker.close()
    chief.close()


def _crashing_chief(url: str, job: str, chief_id: str, ready: str) -> None:
    ps = ParameterServer(job, replicas_to_aggregate=1, client=url, chief_id=chief_id,
                         chief_lease=1.5)  # fmt: skip
    ps.initialize({"w": np.zeros(3)})
    Path(ready).write_text("")
    time.sleep(600)


def _start_and_kill_a_chief(url: str, job: str, chief_id: str, tmp_path: Path) -> None:
    ready = tmp_path / f"{chief_id}.ready"
    proc = mp.get_context("spawn").Process(
        target=_crashing_chief, args=(url, job, chief_id, str(ready)), daemon=True
    )
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and proc.is_alive(), "the chief did not start"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def test_a_crashed_chief_is_taken_over_once_its_lease_ran_out(real, tmp_path, caplog):
    _start_and_kill_a_chief(real.url, "crash", "dead-chief", tmp_path)
    ps = ParameterServer("crash", replicas_to_aggregate=1, client=real.url)
    with pytest.raises(ChiefConflictError, match="dead-chief"):
        ps.initialize({"w": np.zeros(3)})
    t0 = time.monotonic()
    assert ps.initialize({"w": np.zeros(3)}, wait_for_chief=10) == 0
    assert "from chief 'dead-chief', whose lease ran out" in caplog.text
    assert time.monotonic() - t0 < 5  # its 1.5 s lease ran out
    assert real.redis().hget(chief_key(SyncKeys("", "crash")), "id") == ps.chief_id.encode()
    ps.close()
    # a restarted chief with the crashed one's chief_id takes over at once
    _start_and_kill_a_chief(real.url, "crash2", "pod-0", tmp_path)
    again = ParameterServer("crash2", replicas_to_aggregate=1, client=real.url, chief_id="pod-0")
    caplog.clear()
    assert again.initialize({"w": np.zeros(3)}) == 0
    # (its lease had not run out: the log said it had, review)
    assert "from the chief of the same id before it" in caplog.text
    assert "lease ran out" not in caplog.text
    again.close()


def test_a_chief_whose_lease_ran_out_takes_nothing(target):
    """A chief that was paused past its lease (here: its renewals stopped), while another
    chief took the job over, takes no round: its takes give back what they claim, and the
    step raises ChiefConflictError. The round is the new chief's, intact."""
    ps = ParameterServer("paused", replicas_to_aggregate=1, client=target.client(),
                         chief_lease=1.0)  # fmt: skip
    ps.initialize({"w": np.zeros(3)})
    worker = Worker("paused", client=target.client())
    assert worker.pull(timeout=5)[0] == 0
    ps._lease._stop.set()  # paused: no renewal from here on
    time.sleep(1.3)
    other = ParameterServer("paused", replicas_to_aggregate=1, client=target.client())
    other.initialize({"w": np.zeros(3)})
    worker.push(0, {"w": np.ones(3)})
    with pytest.raises(ChiefConflictError):
        ps.step(LR, timeout=5)
    assert _steps_of(target, "paused") == 0
    assert other.step(LR, timeout=5) == 1
    step, params = worker.pull(after=0, timeout=5)
    assert step == 1
    np.testing.assert_array_equal(params["w"], np.full(3, -LR))
    worker.close()
    other.close()
    ps.close()


def test_a_chief_whose_lease_is_taken_while_it_waits_stops_waiting(target):
    """The lease taken over while the chief's takes wait (found by its renewal): the takes
    stop at once, and the gradient that arrives then stays for the chief that has the job
    (the step raised ChiefConflictError, not DeadlineExceededError after its timeout)."""
    ps = ParameterServer("usurped", replicas_to_aggregate=1, client=target.client(),
                         chief_lease=1.0)  # fmt: skip
    ps.initialize({"w": np.zeros(3)})
    key = chief_key(SyncKeys("", "usurped"))
    far = int(time.time() * 1000) + 60_000
    usurp = threading.Timer(0.3, lambda: target.redis().hset(key, mapping={
        "id": "usurper", "host": "h", "pid": "1", "renewed_ms": far - 60_000,
        "expires_ms": far}))  # fmt: skip
    usurp.start()
    started = time.monotonic()
    with pytest.raises(ChiefConflictError, match="usurper"):
        ps.step(LR, timeout=30)
    assert time.monotonic() - started < 10
    usurp.join()
    worker = Worker("usurped", client=target.client())
    worker.pull(timeout=5)
    worker.push(0, {"w": np.ones(3)})
    assert _steps_of(target, "usurped") == 0
    acc = Keys("", accumulator_name("usurped", "w")).state
    assert int(target.redis().hget(acc, "count")) == 1
    worker.close()
    ps.close()


def test_a_chief_paused_past_its_lease_that_nobody_took_over_carries_on(target, caplog):
    """The same pause, but no other chief came: the step renews the lease and takes."""
    ps = ParameterServer("pause2", replicas_to_aggregate=1, client=target.client(),
                         chief_lease=1.0)  # fmt: skip
    ps.initialize({"w": np.zeros(3)})
    worker = Worker("pause2", client=target.client())
    assert worker.pull(timeout=5)[0] == 0
    ps._lease._stop.set()
    time.sleep(1.3)
    worker.push(0, {"w": np.ones(3)})
    assert ps.step(LR, timeout=5) == 1
    assert "was not renewed" in caplog.text
    np.testing.assert_array_equal(worker.pull(after=0, timeout=5)[1]["w"], np.full(3, -LR))
    worker.close()
    ps.close()


def _steps_of(target, job: str) -> int:
    return int(target.redis().hget(Keys("", accumulator_name(job, "w")).state, "step"))


def test_the_lease_is_renewed_while_the_chief_waits(target):
    ps = ParameterServer("renew", replicas_to_aggregate=1, client=target.client(),
                         chief_lease=0.6)  # fmt: skip
    ps.initialize({"w": np.zeros(3)})
    with pytest.raises(accumulator.DeadlineExceededError):
        ps.step(LR, timeout=1.5)  # blocked in a take for longer than the lease
    other = ParameterServer("renew", replicas_to_aggregate=1, client=target.client())
    with pytest.raises(ChiefConflictError):
        other.initialize({"w": np.zeros(3)})
    other.close()
    ps.close()


# -- pushes: checked before applied -------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"b": np.zeros(3)}, r"'b'.*Shape mismatch"),
        ({"b": np.array([1j, 2j])}, r"'b'.*Cannot convert"),
        ({"emb": ([0, 6], np.ones((2, 2)))}, r"'emb'.*exceeded limits"),
        ({"emb": ([-1], np.ones((1, 2)))}, r"'emb'.*negative"),
        ({"emb": ([0], np.ones((1, 3)))}, r"'emb'.*values dim 1"),
        ({"emb": ([0, 1], np.ones((1, 2)))}, r"'emb'.*non-empty input values"),
        ({"w": np.ones((3, 2))}, r"'w'.*Shape mismatch"),
        ({"emb": np.ones((6, 2))}, r"'emb'.*must be \(indices, values\).*not ndarray"),
    ],
    ids=["dense-shape", "dense-dtype", "sparse-range", "sparse-negative", "sparse-dims",
         "sparse-count", "first-dense", "sparse-given-dense"],  # fmt: skip
)
def test_a_push_with_one_bad_tensor_applies_nothing(target, bad, match):
    ps = ParameterServer("bad", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker("bad", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    grads = _grad(params, step, 0)
    with pytest.raises(accumulator.InvalidArgumentError, match=match) as info:
        worker.push(step, {**grads, **bad})
    assert "nothing was applied" in str(info.value)
    assert all(ps._accs[name].num_accumulated() == 0 for name in ("w", "emb", "b"))
    assert ps.stats().pushes == 0
    # the corrected push counts once: the step is exactly this one gradient
    assert worker.push(step, grads) == {"w": True, "emb": True, "b": True}
    assert ps.step(LR, timeout=5) == 1
    _assert_params(ps.params, _update(_params(), [grads]))
    worker.close()
    ps.close()


def test_a_push_that_fails_part_way_completes_on_retry(target, monkeypatch):
    ps = ParameterServer("half", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker("half", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    grads = _grad(params, step, 0)
    emb = worker._accs["emb"]
    real_apply = emb._apply_grad_ops

    def unavailable(*args, **kwargs):  # the apply's protocol step, failing at once
        raise accumulator.UnavailableError("Redis unreachable for 30s (simulated)")
        yield

    monkeypatch.setattr(emb, "_apply_grad_ops", unavailable)
    with pytest.raises(accumulator.UnavailableError):
        worker.push(step, grads)
    # the tensors are applied side by side: the others went in, and are remembered
    assert [ps._accs[n].num_accumulated() for n in ("w", "emb", "b")] == [1, 0, 1]
    monkeypatch.setattr(emb, "_apply_grad_ops", real_apply)
    assert worker.push(step, grads) == {"w": True, "emb": True, "b": True}
    assert [ps._accs[n].num_accumulated() for n in ("w", "emb", "b")] == [1, 1, 1]
    assert ps.stats().pushes == 1 and worker.pushes == 1
    ps.step(LR, timeout=5)
    _assert_params(ps.params, _update(_params(), [grads]))
    worker.close()
    ps.close()


def test_a_push_killed_in_the_middle_of_a_large_tensor_is_not_counted(target, monkeypatch):
    """A push with a tensor over one part (its parts take several round trips) is counted
    after its applies: a worker killed in the middle of one leaves no count (it was counted
    as accepted in its first round trip, its gradient never complete)."""
    ps = ParameterServer("cut", replicas_to_aggregate=1, client=target.client())
    big = np.zeros(1 << 19, np.float32)  # 2 MiB: two parts
    ps.initialize({"big": big, "b": np.zeros(2, np.float32)})
    worker = Worker("cut", client=target.client(), worker_id="w0")
    step, _ = worker.pull(timeout=5)
    grads = {"big": np.ones_like(big), "b": np.ones(2, np.float32)}

    def killed(*args, **kwargs):  # the apply's first round trip, then the process is gone
        yield Command("a large apply's first parts (simulated)", ("PING",))
        raise KeyboardInterrupt

    monkeypatch.setattr(worker._accs["big"], "_apply_wire_ops", killed)
    with pytest.raises(KeyboardInterrupt):
        worker.push(step, grads)
    stats = ps.stats()
    assert stats.pushes == 0 and stats.workers == {}
    assert ps._accs["big"].num_accumulated() == 0
    monkeypatch.undo()
    assert worker.push(step, grads) == {"big": True, "b": True}
    stats = ps.stats()
    assert stats.pushes == stats.accepted == 1 and stats.workers["w0"].pushes == 1
    ps.step(LR, timeout=5)
    np.testing.assert_array_equal(ps.params["big"], -LR * grads["big"])
    worker.close()
    ps.close()


# -- errors that say what is wrong ---------------------------------------------------------------


def test_a_step_timeout_names_the_parameter(target):
    ps = ParameterServer("slow", replicas_to_aggregate=2, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    dense = accumulator.ConditionalAccumulator(
        np.float64, (2, 3), shared_name=accumulator_name("slow", "w"), client=target.client()
    )
    dense.apply_grad(np.ones((2, 3)), local_step=0)
    dense.apply_grad(np.ones((2, 3)), local_step=0)
    with pytest.raises(accumulator.DeadlineExceededError) as info:
        ps.step(LR, timeout=0.3)
    text = str(info.value)
    # every parameter that waited in vain is named (their waits end by one deadline)
    assert "sync job 'slow', step 0: parameters 'emb' (sparse), 'b' (dense)" in text
    assert "did not get 2 gradients within 0.3s" in text and "kept for the next step(): 'w'" in text
    assert "accumulator 'slow/emb'" in text and "0 of 2 gradients at global step 0" in text
    dense.close()
    ps.close()


def test_a_step_timeout_bounds_the_whole_step_whatever_the_parameters(target):
    """The takes of a step wait one after the other: each wait ends by the step's deadline,
    so a step of many parameters raises after about ``timeout``, not ``timeout`` per
    parameter (8 x 0.5 s before)."""
    params = {f"p{k}": np.zeros(3) for k in range(8)}
    ps = ParameterServer("many", replicas_to_aggregate=1, client=target.client())
    ps.initialize(params)
    start = time.monotonic()
    with pytest.raises(accumulator.DeadlineExceededError, match="parameters 'p0' .*'p7'"):
        ps.step(LR, timeout=0.5)
    assert time.monotonic() - start < 2.0
    ps.close()


def _one_push(target, job: str) -> tuple[ParameterServer, Worker, dict]:
    """A job of _params() at step 0 with one worker's gradients pushed (one replica)."""
    ps = ParameterServer(job, replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker(job, client=target.client())
    step, params = worker.pull(timeout=5)
    grads = _grad(params, step, 0)
    worker.push(step, grads)
    return ps, worker, grads


@pytest.mark.parametrize("replicas", [1.9, True, "2", 0])
def test_replicas_to_aggregate_is_checked_as_num_required_is(replicas):
    with pytest.raises(accumulator.InvalidArgumentError, match="replicas_to_aggregate"):
        ParameterServer("args", replicas_to_aggregate=replicas, client="redis://unused:1")


def test_initialize_with_a_bad_step_deletes_nothing(target):
    ps = ParameterServer("keep", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params(), step=3)
    ps.close()
    again = ParameterServer("keep", replicas_to_aggregate=1, sparse={"emb"},
                            client=target.client())  # fmt: skip
    with pytest.raises(accumulator.InvalidArgumentError, match="step must be an integer"):
        again.initialize(_params(), resume=False, step=2.5)
    worker = Worker("keep", client=target.client())
    step, params = worker.pull(timeout=5)  # the published job is still there
    assert step == 3
    _assert_params(params, _params())
    worker.close()
    again.close()


def test_a_learning_rate_missing_from_the_mapping_is_refused_before_anything_is_taken(target):
    ps, worker, grads = _one_push(target, "rates")
    for bad, match in (({"w": LR, "emb": LR}, r"no learning rate for parameters \['b'\]"),
                       ({"w": LR, "emb": LR, "b": "fast"}, "learning rate of 'b' must be a")):
        with pytest.raises(accumulator.InvalidArgumentError, match=match):
            ps.step(bad, timeout=5)
        assert [ps._accs[n].num_accumulated() for n in ("w", "emb", "b")] == [1, 1, 1]
        assert _steps(target, "rates") == {"w": 0, "emb": 0, "b": 0}
    assert ps.step({"w": LR, "emb": LR, "b": LR}, timeout=5) == 1
    _assert_params(worker.pull(after=0, timeout=5)[1], _update(_params(), [grads]))
    worker.close()
    ps.close()


def test_an_update_that_raises_gets_the_same_gradients_from_the_next_step(target):
    ps, worker, grads = _one_push(target, "upd")
    calls = []

    def sgd(params, grads, step):
        calls.append(step)
        if len(calls) == 1:
            raise RuntimeError("update failed")
        params["w"] -= LR * grads["w"]
        params["b"] -= LR * grads["b"]
        params["emb"][grads["emb"].indices] -= LR * grads["emb"].values

    with pytest.raises(RuntimeError, match="update failed"):
        ps.step(sgd, timeout=5)
    assert ps.global_step == 0 and worker.pull(timeout=5)[0] == 0
    assert ps.step(sgd, timeout=1) == 1  # nothing more to wait for: the same gradients
    assert calls == [0, 0]
    _assert_params(worker.pull(after=0, timeout=5)[1], _update(_params(), [grads]))
    worker.close()
    ps.close()


def test_a_failed_publish_is_completed_by_the_next_step(target, monkeypatch):
    ps, worker, grads = _one_push(target, "pub")
    publish = ParameterServer._publish

    def refused(self, **kw):
        raise accumulator.ResourceExhaustedError("OOM while publishing (injected)")

    monkeypatch.setattr(ParameterServer, "_publish", refused)
    with pytest.raises(accumulator.ResourceExhaustedError):
        ps.step(LR, timeout=5)
    assert worker.pull(timeout=5)[0] == 0  # not published yet
    monkeypatch.setattr(ParameterServer, "_publish", publish)
    assert ps.step(LR, timeout=0.2) == 1  # the step completed: published, no new take
    step, params = worker.pull(after=0, timeout=5)
    assert step == 1
    want = _update(_params(), [grads])
    _assert_params(params, want)
    worker.push(step, _grad(params, step, 0))  # and the job goes on
    assert ps.step(LR, timeout=5) == 2
    _assert_params(worker.pull(after=1, timeout=5)[1], _update(want, [_grad(want, 1, 0)]))
    worker.close()
    ps.close()


def test_a_publish_refused_at_maxmemory_raises_resource_exhausted(own_server):
    """A model of several parts is written before the switch; Redis refusing one (maxmemory)
    is our ResourceExhaustedError, and the step completes once memory is there."""
    r = own_server.redis()
    ps = ParameterServer("oom", replicas_to_aggregate=1, sparse={"emb"}, client=own_server.url)
    ps.initialize({"emb": np.zeros(((6 << 20) // 8 // 16, 16))})  # 6 MiB of float64
    worker = Worker("oom", client=own_server.url)
    step, _ = worker.pull(timeout=5)
    worker.push(step, {"emb": (np.array([1]), np.ones((1, 16)))})
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + (1 << 20))
    try:
        # (not Redis's "nothing was changed": the rounds are taken, the step is half done)
        with pytest.raises(accumulator.ResourceExhaustedError,
                           match="gradients of the step to 1 are taken .* the next step"):
            ps.step(LR, timeout=5)
    finally:
        r.config_set("maxmemory", 0)
    assert ps.step(LR, timeout=0.2) == 1
    step, params = worker.pull(after=0, timeout=5)
    assert step == 1 and params["emb"][1, 0] == -LR and params["emb"][0, 0] == 0
    worker.close()
    ps.close()


# -- a chief that dies between its takes and its publish -----------------------------------------


def _two_pushes(target, job: str) -> tuple[list[Worker], list[dict]]:
    """Two workers of ``job`` (published at step 0), each of which pushed its gradients."""
    workers = [Worker(job, client=target.client(), worker_id=f"w{k}") for k in range(2)]
    step, params = workers[0].pull(timeout=5)
    workers[1].pull(timeout=5)
    grads = [_grad(params, step, k) for k in range(2)]
    for k, w in enumerate(workers):
        assert all(w.push(step, grads[k]).values())
    return workers, grads


def _abandoned_claim(acc, n: int) -> None:
    """What a chief SIGKILLed right after its take script claimed a round leaves behind:
    the claim, under a short lease, never read or finished."""
    acc.claim_lease = 0.3
    try:
        reply = take_script(acc, f"999999-{uuid.uuid4().hex[:12]}", n, 6000)
    finally:
        acc.claim_lease = None
    assert int(reply[0]) == 1, reply


@pytest.mark.parametrize("big", [False, True], ids=["inline", "payload-keys"])
@pytest.mark.parametrize(
    "died",
    [
        "after-claiming-w",  # w claimed (not read), emb and b untouched: nothing lost
        "after-reading-w-claiming-emb",  # w read (lost with the chief), emb claimed, b untouched
        "after-claiming-all",  # every round claimed, none read: nothing lost
    ],
)
def test_chief_killed_between_take_and_publish_exact_accounting(target, died, big):
    job = f"handover-{died}"
    client = target.client()
    ps = ParameterServer(job, replicas_to_aggregate=2, sparse={"emb"}, client=client)
    ps.initialize(_params(big))
    workers, grads = _two_pushes(target, job)
    # the dying chief: its takes, by hand, through the accumulators' own protocol
    taken = ps._accs
    if died == "after-claiming-w":
        _abandoned_claim(taken["w"], 2)
        lost: set[str] = set()
    elif died == "after-reading-w-claiming-emb":
        taken["w"].take_grad(2, timeout=5)  # read: these gradients die with the chief
        _abandoned_claim(taken["emb"], 2)
        lost = {"w"}
    else:
        for name in ("w", "emb", "b"):
            _abandoned_claim(taken[name], 2)
        lost = set()
    ps.close()  # (its chief lease is released here; a SIGKILLed chief's runs out: see below)

    chief = ParameterServer(job, replicas_to_aggregate=2, sparse={"emb"}, client=target.client())
    assert chief.initialize(_params(big)) == 0  # the step it died in is completed
    assert chief.global_step == 0
    for acc in chief._accs.values():
        acc.wait_slice = 0.1  # re-check soon after the dead claim's 0.3 s lease ran out
    # workers waiting for step 1 meanwhile; a backup's push at step 0 may still arrive
    assert chief.step(LR, timeout=20) == 1
    expected = _update(_params(big), grads, skip=lost)
    _assert_params(chief.params, expected)
    assert _steps(target, job) == {"w": 1, "emb": 1, "b": 1}  # agree with the published step
    # and the job goes on in lockstep: the next step takes fresh gradients at step 1
    for w in workers:
        assert w.pull(after=0, timeout=5)[0] == 1
    grads = [_grad(expected, 1, k) for k in range(2)]
    for k, w in enumerate(workers):
        assert all(w.push(1, grads[k]).values())
    assert chief.step(LR, timeout=20, final=True) == 2
    _assert_params(chief.params, _update(expected, grads))
    assert _steps(target, job) == {"w": 2, "emb": 2, "b": 2}
    for name in ("w", "emb", "b"):
        info = accumulator._admin.describe(target.redis(), accumulator_name(job, name))
        assert info.count == 0 and info.claims == () and info.takers_waiting == 0
    chief.delete()
    assert list(target.redis().scan_iter()) == []
    for w in workers:
        w.close()
    chief.close()


def test_chief_restart_after_every_round_was_read_skips_the_step(target):
    client = target.client()
    ps = ParameterServer("skip", replicas_to_aggregate=1, sparse={"emb"}, client=client)
    ps.initialize(_params())
    worker = Worker("skip", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    worker.push(step, _grad(params, step, 0))
    for acc in ps._accs.values():
        acc.take_grad(1, timeout=5)  # every round read; the chief dies before publishing
    ps.close()
    chief = ParameterServer("skip", replicas_to_aggregate=1, sparse={"emb"},
                            client=target.client())  # fmt: skip
    assert chief.initialize(_params()) == 1  # skipped: parameters republished unchanged
    _assert_params(chief.params, _params())
    assert _steps(target, "skip") == {"w": 1, "emb": 1, "b": 1}
    step, params = worker.pull(after=0, timeout=5)
    assert step == 1
    worker.push(step, _grad(params, step, 0))
    assert chief.step(LR, timeout=5) == 2
    _assert_params(chief.params, _update(_params(), [_grad(_params(), 1, 0)]))
    worker.close()
    chief.close()


# -- the same with a real chief process, SIGKILLed mid-take (slow) --------------------------------


def _chief_that_dies(url: str, job: str, script: str, kill_after: int, marker: str) -> None:
    """A chief process that stops for good right after the ``kill_after``-th reply of its
    ``script`` ("take": a claim, "finish"), so that the parent can SIGKILL it there. Its claim
    lease and chief lease are short, so that the restart is quick."""
    original = _scripts.steps
    seen = 0

    def steps(name, keys, args):  # every script call goes through it, alone or together
        nonlocal seen
        reply = yield from original(name, keys, args)
        if name == script and (script == "finish" or int(reply[0]) == 1):
            seen += 1
            if seen == kill_after:
                Path(marker).write_text(f"{os.getpid()}\n")
                time.sleep(3600)
        return reply

    _scripts.steps = steps
    ps = ParameterServer(job, replicas_to_aggregate=2, sparse={"emb"}, client=url,
                         chief_lease=1.0)  # fmt: skip
    ps.initialize(_params(big=True))
    for acc in ps._accs.values():
        acc.claim_lease = 0.5
    Path(marker + ".ready").write_text("")
    while True:
        ps.step(LR, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize(("script", "kill_after"),
                         [("take", 1), ("take", 5), ("finish", 1), ("finish", 6)])  # fmt: skip
def test_chief_process_sigkilled_mid_step_restarts_exactly(real, tmp_path, script, kill_after):
    """A chief SIGKILLed right after a claim (of step 0, of step 1) or a finish: a round it
    claimed and did not finish is handed to the restarted chief whole, one it finished is lost
    (that parameter gets no update in that step), and the job goes on exactly."""
    job = f"sigkill-{script}-{kill_after}"
    marker = str(tmp_path / "claimed")
    proc = mp.get_context("spawn").Process(
        target=_chief_that_dies, args=(real.url, job, script, kill_after, marker), daemon=True
    )
    proc.start()
    workers = []
    try:
        deadline = time.monotonic() + 60
        while not Path(marker + ".ready").exists():
            assert time.monotonic() < deadline and proc.is_alive(), "chief did not start"
            time.sleep(0.02)
        workers = [Worker(job, client=real.url, worker_id=f"w{k}") for k in range(2)]
        params = _params(big=True)
        expected = params
        step = 0
        while True:
            for w in workers:
                assert w.pull(timeout=30)[0] == step
            grads = [_grad(expected, step, k) for k in range(2)]
            for k, w in enumerate(workers):
                assert all(w.push(step, grads[k]).values())
            if Path(marker).exists() or (kill_after <= 3 * (step + 1)):
                break
            expected = _update(expected, grads)
            step += 1
            while workers[0].pull(timeout=30)[0] != step:
                pass
        deadline = time.monotonic() + 60
        while not Path(marker).exists():
            assert time.monotonic() < deadline, "the chief never claimed"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    # What the dead chief left: a round it claimed and did not finish is handed over whole (its
    # claim is still registered); a round it finished is lost; one it never took is taken.
    # Which is which depends on how its takes interleaved (a take that waited for gradients
    # claims, reads and finishes while the others wait), so it is read from Redis.
    r = real.redis()
    held = {n for n in ("w", "emb", "b")
            if r.hlen(Keys("", accumulator_name(job, n)).claims) > 0}  # fmt: skip
    taken = {n for n, s in _steps(real, job).items() if s == step + 1}
    lost_at = taken - held
    assert held <= taken
    assert held if script == "take" else lost_at  # the fatal claim is held, the finish done

    chief = ParameterServer(job, replicas_to_aggregate=2, sparse={"emb"}, client=real.url)
    t0 = time.monotonic()
    if lost_at == {"w", "emb", "b"}:  # every round of the step is gone: the step is skipped
        assert chief.initialize(_params(big=True), wait_for_chief=10) == step + 1
    else:
        assert chief.initialize(_params(big=True), wait_for_chief=10) == step
        assert chief.step(LR, timeout=30) == step + 1
    assert time.monotonic() - t0 < 10  # its chief lease (1 s) and claim lease (0.5 s) ran out
    expected = _update(expected, grads, skip=lost_at)
    _assert_params(chief.params, expected)
    assert _steps(real, job) == {"w": step + 1, "emb": step + 1, "b": step + 1}
    # two more steps in lockstep, then nothing is left behind
    for s in (step + 1, step + 2):
        grads = [_grad(expected, s, k) for k in range(2)]
        for k, w in enumerate(workers):
            assert w.pull(after=s - 1, timeout=30)[0] == s
            assert all(w.push(s, grads[k]).values())
        chief.step(LR, timeout=30, final=s == step + 2)
        expected = _update(expected, grads)
    _assert_params(chief.params, expected)
    stats = chief.stats()
    assert stats.stale == 0 and stats.pushes == 2 * (step + 3)
    chief.delete()
    assert list(real.redis().scan_iter()) == []
    for w in workers:
        w.close()
    chief.close()


def test_a_job_delete_holds_the_chief_lease_so_no_new_run_is_deleted(target, monkeypatch):
    """A chief starting a new run of a finished job while ``delete_job`` (no force) runs:
    it gets ChiefConflictError (the delete holds the job's chief lease); the run it would have
    started was deleted under it, accepted pushes and all (found by a review)."""
    from accumulator import _admin_job

    model = {"w": np.zeros(4, np.float32)}
    ps = ParameterServer("jd", replicas_to_aggregate=1, client=target.client())
    ps.initialize(model)
    ps.finish()
    ps.close()
    new = ParameterServer("jd", replicas_to_aggregate=1, client=target.client())
    refused = []
    job_specs = _admin_job._job_specs

    def a_chief_starts_meanwhile(meta):
        with pytest.raises(ChiefConflictError, match="admin-delete-") as info:
            new.initialize(model, resume=False)
        refused.append(info.value)
        return job_specs(meta)

    monkeypatch.setattr(_admin_job, "_job_specs", a_chief_starts_meanwhile)
    r = target.redis()
    assert accumulator._admin.delete_job(r, "jd") > 0
    assert refused and list(r.scan_iter()) == []
    monkeypatch.undo()
    assert new.initialize(model) == 0  # after the delete: a new job
    new.close()


def test_a_job_delete_goes_on_when_its_lease_cannot_be_renewed(target, monkeypatch):
    """At maxmemory the renewal of the delete's lease between accumulators was refused: the
    delete stopped half-way, saying nothing was changed (CLI review). Now a refused renewal is
    logged and the delete finishes (it frees memory)."""
    from accumulator import _admin_job

    ps = ParameterServer("jr", replicas_to_aggregate=1, fusion_bytes=0, client=target.client())
    ps.initialize({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32),
                   "c": np.zeros(4, np.float32)})  # fmt: skip
    ps.finish()
    ps.close()
    monkeypatch.setattr(_admin_job._AdminLease, "SECONDS", 0.0)  # renew at every accumulator
    acquire = _admin_job._AdminLease.acquire
    calls = []

    def refused_after_the_first(self):
        calls.append(1)
        if len(calls) > 1:
            raise accumulator.ResourceExhaustedError("Redis is out of memory (maxmemory)")
        return acquire(self)

    monkeypatch.setattr(_admin_job._AdminLease, "acquire", refused_after_the_first)
    r = target.redis()
    assert accumulator._admin.delete_job(r, "jr") > 0
    assert len(calls) >= 3 and list(r.scan_iter()) == []


def test_a_pull_whose_job_redis_lost_says_so_when_it_times_out(target):
    """Redis lost the job's data (restarted without persistence): a worker waiting for the
    next step times out saying that nothing of the job is published any more, not only that
    no newer step came (restart/maxmemory review)."""
    ps = ParameterServer("gone", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.zeros(3)})
    worker = Worker("gone", client=target.client())
    step, _ = worker.pull(timeout=5)
    with pytest.raises(accumulator.DeadlineExceededError) as alive:
        worker.pull(after=step, timeout=0.2)
    assert "published any more" not in str(alive.value)
    r = target.redis()
    for key in list(r.scan_iter(match="accsync:*")):
        r.delete(key)
    with pytest.raises(accumulator.DeadlineExceededError,
                       match="newer than step 0 within 0.2s .nothing of the job is published"):
        worker.pull(after=step, timeout=0.2)
    worker.close()
    ps.close()
