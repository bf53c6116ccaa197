"""accumulator.sync at its edges: a chief resumed next to accumulators a step behind or two
ahead, or with another ``replicas_to_aggregate``; pushes that failed or were interrupted
part-way, then made again at the next step, in a new run, or at the same step; a worker that
pulled the final step of a job never sealed; a lease lost and acquired again; a round one
step back; a worker's own counts; the update's casts; the metadata version of fused jobs;
the fusion plan's boundary; an accumulator an older client made.

Each test came from a second mutation-testing pass (2026-11-29: 93 hand-made bugs in the sync
helper, the fusion plan, the retry layer and the scripts behind them; 33 went unnoticed by
the files run for each): each fails on such a plausible bug."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from test_fusion import layout, spec
from test_sync_lifecycle import (
    LR,
    ParameterServer,
    _assert_params,
    _grad,
    _params,
    _steps,
    _update,
)

import accumulator
from accumulator import _admin, _fusion
from accumulator._keys import Keys, SyncKeys
from accumulator._requests import Command
from accumulator.sync import ChiefConflictError, Worker, accumulator_name


def _unavailable(*args, **kwargs):  # an apply's protocol step, failing at once
    raise accumulator.UnavailableError("Redis unreachable for 30s (simulated)")
    yield


def _accumulated(ps) -> list[int]:
    return [ps._accs[n].num_accumulated() for n in ("w", "emb", "b")]


def _resumed(target, job: str, caplog, step: int, warned: str) -> ParameterServer:
    """A chief started again on ``job``: it resumes at ``step``, every accumulator there,
    with a warning saying ``warned``."""
    chief = ParameterServer(job, replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    with caplog.at_level("WARNING", logger="accumulator.sync"):
        assert chief.initialize(_params()) == step
    assert warned in caplog.text
    assert _steps(target, job) == {"w": step, "emb": step, "b": step}
    return chief


def test_an_accumulator_one_step_behind_the_published_step_is_aligned_on_resume(target, caplog):
    """C07: an accumulator exactly one step behind the published step (a server restart lost
    its take's step advance, or set by hand) is set to the published step and what it holds
    (pushed at an older step) is dropped. Left as it was, it would take stale pushes of that
    step into the chief's next round."""
    ps = ParameterServer("behind1", replicas_to_aggregate=1, sparse={"emb"},
                         client=target.client())  # fmt: skip
    ps.initialize(_params(), step=3)
    ps._accs["w"].set_global_step(2)
    ps._accs["w"].apply_grad(np.ones((2, 3)), local_step=2)  # pushed at the older step
    ps.close()
    chief = _resumed(target, "behind1", caplog, 3, "behind the published step 3")
    assert chief._accs["w"].num_accumulated() == 0
    chief.close()


def test_accumulators_two_steps_ahead_are_skipped_to_on_resume(target, caplog):
    """C08: accumulators more than one step ahead of the published step (two chiefs, set by
    hand) are all aligned to the highest step and the parameters republished there; at two
    steps ahead too (the resumed chief waited for ever: every push was stale there)."""
    ps = ParameterServer("ahead2", replicas_to_aggregate=1, sparse={"emb"},
                         client=target.client())  # fmt: skip
    ps.initialize(_params())
    ps._accs["w"].set_global_step(2)
    ps.close()
    chief = _resumed(target, "ahead2", caplog, 2, "the rounds in between are skipped")
    worker = Worker("ahead2", client=target.client())
    step, params = worker.pull(timeout=5)
    assert step == 2
    grads = _grad(params, step, 0)
    assert worker.push(step, grads) == {"w": True, "emb": True, "b": True}
    assert chief.step(LR, timeout=5) == 3
    _assert_params(chief.params, _update(_params(), [grads]))
    worker.close()
    chief.close()


def test_a_resumed_chief_takes_its_own_replicas_to_aggregate_and_publishes_it(target):
    """C09 and C01: a chief resumed with another ``replicas_to_aggregate`` publishes it (the
    job's description shows it) and waits for that many gradients of every parameter."""
    ps = ParameterServer("reps", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.zeros(3)})
    ps.close()
    chief = ParameterServer("reps", replicas_to_aggregate=2, client=target.client())
    assert chief.initialize({"w": np.zeros(3)}) == 0
    assert _admin.describe_job(target.redis(), "reps").replicas == 2
    workers = [Worker("reps", client=target.client(), worker_id=f"w{i}") for i in range(2)]
    for w in workers:
        w.pull(timeout=5)
    assert workers[0].push(0, {"w": np.full(3, 1.0)}) == {"w": True}
    with pytest.raises(accumulator.DeadlineExceededError):
        chief.step(LR, timeout=0.3)  # one gradient of two: no step
    assert chief.global_step == 0
    assert workers[1].push(0, {"w": np.full(3, 3.0)}) == {"w": True}
    assert chief.step(LR, timeout=5) == 1
    np.testing.assert_allclose(chief.params["w"], np.full(3, -LR * 2.0))  # MEAN of 1 and 3
    for w in workers:
        w.close()
    chief.close()


def test_a_push_that_failed_part_way_is_forgotten_at_the_next_step(target, monkeypatch):
    """W05: what a push that failed part-way applied is remembered for a push again *at that
    step* only. The worker moved on (another worker's push completed the step): its push at
    the next step applies every tensor (none is taken for already applied and lost)."""
    ps = ParameterServer("moved", replicas_to_aggregate=1, sparse={"emb"},
                         client=target.client())  # fmt: skip
    ps.initialize(_params())
    worker = Worker("moved", client=target.client(), worker_id="w0")
    other = Worker("moved", client=target.client(), worker_id="w1")
    step, params = worker.pull(timeout=5)
    other.pull(timeout=5)
    monkeypatch.setattr(worker._accs["emb"], "_apply_grad_ops", _unavailable)
    with pytest.raises(accumulator.UnavailableError):
        worker.push(step, _grad(params, step, 0))  # w and b went in, emb did not
    monkeypatch.undo()
    other.push(step, _grad(params, step, 1))
    assert ps.step(LR, timeout=5) == 1
    step, params = worker.pull(after=step, timeout=5)
    grads = _grad(params, step, 0)
    assert worker.push(step, grads) == {"w": True, "emb": True, "b": True}
    assert _accumulated(ps) == [1, 1, 1]
    assert ps.step(LR, timeout=5) == 2
    _assert_params(ps.params, _update(params, [grads]))
    worker.close()
    other.close()
    ps.close()


def test_a_push_interrupted_part_way_is_completed_once(target, monkeypatch):
    """W14: a push interrupted (Ctrl-C) after some of its tensors went in remembers them, as
    one that failed does: the push again applies only the others and is counted once.
    (test_a_push_killed_in_the_middle_of_a_large_tensor_is_not_counted does not see this: its
    re-applied tensor has the same gradient twice, whose MEAN is that gradient.)"""
    ps = ParameterServer("ctrlc", replicas_to_aggregate=1, sparse={"emb"},
                         client=target.client())  # fmt: skip
    ps.initialize(_params())
    worker = Worker("ctrlc", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    grads = _grad(params, step, 0)

    def interrupted(*args, **kwargs):  # emb's apply: one round trip, then Ctrl-C
        yield Command("an apply cut short (simulated)", ("PING",))
        raise KeyboardInterrupt

    monkeypatch.setattr(worker._accs["emb"], "_apply_grad_ops", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.push(step, grads)
    assert _accumulated(ps) == [1, 0, 1]
    monkeypatch.undo()
    assert worker.push(step, grads) == {"w": True, "emb": True, "b": True}
    assert _accumulated(ps) == [1, 1, 1]
    assert ps.stats().pushes == 1 and worker.pushes == 1
    ps.step(LR, timeout=5)
    _assert_params(ps.params, _update(_params(), [grads]))
    worker.close()
    ps.close()


def test_a_worker_that_pulled_the_final_step_applies_nothing_even_unsealed(target):
    """W08: a worker whose pull returned a finished job's final parameters refuses a push at
    the final step itself, without relying on the seal (a chief that died between its final
    publish and the seal left the accumulators open)."""
    ps = ParameterServer("unsealed", replicas_to_aggregate=1, sparse={"emb"},
                         client=target.client())  # fmt: skip
    ps.initialize(_params())
    ps.finish()
    r = target.redis()
    for name in ("w", "emb", "b"):
        r.hdel(Keys("", accumulator_name("unsealed", name)).state, "sealed")  # never sealed
    worker = Worker("unsealed", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    assert worker.finished
    with pytest.raises(accumulator.sync.TrainingFinished, match="nothing was applied"):
        worker.push(step, _grad(params, step, 0))
    assert _accumulated(ps) == [0, 0, 0]
    assert ps.stats().pushes == 0
    worker.close()
    ps.close()


def test_a_push_that_failed_part_way_is_forgotten_when_the_job_starts_again(target, monkeypatch):
    """W04: the job started again (initialize(resume=False): a new run) after a push failed
    part-way: what that push applied went into the old run's accumulators; the push at step
    0 of the new run applies every tensor."""
    ps = ParameterServer("anew", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker("anew", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    monkeypatch.setattr(worker._accs["emb"], "_apply_grad_ops", _unavailable)
    with pytest.raises(accumulator.UnavailableError):
        worker.push(step, _grad(params, step, 0))  # w and b went in, emb did not
    monkeypatch.undo()
    assert ps.initialize(_params(), resume=False) == 0
    step, params = worker.pull(after=step, timeout=5)  # the new run
    assert step == 0
    grads = _grad(params, step, 0)
    assert worker.push(step, grads) == {"w": True, "emb": True, "b": True}
    assert _accumulated(ps) == [1, 1, 1]
    assert ps.step(LR, timeout=5) == 1
    _assert_params(ps.params, _update(_params(), [grads]))
    worker.close()
    ps.close()


def test_a_chief_that_lost_its_lease_acquires_it_again_under_a_new_tenure(target):
    """L06: a chief that learnt it lost its lease (another took over) and is initialized
    again holds it under a new tenure: the versions it publishes then are not named as
    those of its tenure before (the fence tells a deposed chief's late writes by it)."""
    job = "tenure"
    a = ParameterServer(job, replicas_to_aggregate=1, client=target.client(), chief_lease=0.5)
    a.initialize({"w": np.zeros(3)})
    first = a._lease.tenure
    a._lease._stop.set()  # its lease thread stops (a paused chief): the lease runs out
    time.sleep(0.7)
    b = ParameterServer(job, replicas_to_aggregate=1, client=target.client())
    assert b.initialize({"w": np.zeros(3)}) == 0
    with pytest.raises(ChiefConflictError):
        a.step(LR, timeout=2)
    b.close()
    assert a.initialize({"w": np.zeros(3)}) == 0  # resumed, under a new tenure
    worker = Worker(job, client=target.client())
    step, _ = worker.pull(timeout=5)
    worker.push(step, {"w": np.ones(3)})
    assert a.step(LR, timeout=5) == 1
    tenure = target.redis().hget(SyncKeys("", job).params, "ten").decode()
    assert tenure not in ("", first)
    worker.close()
    a.close()


def test_a_round_pushed_one_step_back_moves_the_accumulator_past_the_chiefs_step(target, caplog):
    """C10, C11: Redis lost the step advance of an accumulator's last take (a failover: it is
    one step behind the chief) and a worker pushed for that step. The chief applies the round
    and sets the accumulator to the step it publishes next: a late push for the step just
    taken is dropped as stale (the rolled-back test goes back three steps, and checks a push
    two steps old only)."""
    ps = ParameterServer("oneback", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.zeros(3)})
    worker = Worker("oneback", client=target.client(), worker_id="w0")
    step, _ = worker.pull(timeout=5)
    worker.push(step, {"w": np.ones(3)})
    assert ps.step(1.0, timeout=5) == 1
    ps._accs["w"].set_global_step(0)  # the take's advance, lost
    assert worker.push(0, {"w": np.ones(3)}) == {"w": True}
    with caplog.at_level("WARNING", logger="accumulator.sync"):
        assert ps.step(1.0, timeout=5) == 2
    assert "came from step 0, this chief is at step 1" in caplog.text
    assert ps._accs["w"].global_step() == 2
    np.testing.assert_array_equal(ps.params["w"], np.full(3, -2.0))
    assert worker.push(1, {"w": np.ones(3)}) == {"w": False}  # step 1 is taken: stale
    assert worker.push(2, {"w": np.ones(3)}) == {"w": True}
    worker.close()
    ps.close()


def test_a_workers_own_counts_say_what_its_pushes_did(target):
    """W18: ``Worker.pushes``, ``accepted`` and ``dropped`` (tensors) count this worker's
    pushes: accepted tensors, and tensors dropped as stale."""
    ps = accumulator.sync.ParameterServer("counts", replicas_to_aggregate=1,
                                          client=target.client())  # fmt: skip
    ps.initialize({"a": np.zeros(2), "b": np.zeros(3)})
    worker = Worker("counts", client=target.client(), worker_id="w0")
    step, _ = worker.pull(timeout=5)
    grads = {"a": np.ones(2), "b": np.ones(3)}
    assert worker.push(step, grads) == {"a": True, "b": True}
    assert ps.step(LR, timeout=5) == 1
    assert worker.push(step, grads) == {"a": False, "b": False}  # late: stale
    assert (worker.pushes, worker.accepted, worker.dropped) == (2, 2, 2)
    worker.close()
    ps.close()


@pytest.mark.parametrize(("dtype", "returned"), [("float64", 1j), ("int32", 0.5)])
def test_an_update_function_returning_another_kind_of_number_is_refused(dtype, returned):
    """R03: what an update function returns must cast to the parameter's dtype within its
    kind (float64 to float32 is fine); a complex value for a float parameter, or a float for
    an integer one, is refused (it would be truncated silently)."""
    from accumulator.sync._params import apply_update, specs_for

    specs, params = specs_for({"p": np.zeros(3, dtype)}, frozenset())
    grads = {"p": np.ones(3, dtype)}
    with pytest.raises(accumulator.InvalidArgumentError, match="update returned"):
        apply_update(lambda p, g, s: {"p": p["p"] + returned}, specs, params, grads, 0)
    out = apply_update(lambda p, g, s: {"p": np.ones(3, np.float32)}, *specs_for(
        {"p": np.zeros(3)}, frozenset()), {"p": np.ones(3)}, 0)  # fmt: skip
    assert out["p"].dtype == np.float64


@pytest.mark.parametrize(("fusion", "version"), [(1 << 20, 5), (0, 4)])
def test_a_fused_job_is_published_with_the_metadata_version_of_fused_jobs(target, fusion, version):
    """U02: a job whose parameters share accumulators is published as metadata version 5
    (a reader of version 4 only refuses it instead of opening one accumulator per parameter,
    which no chief takes, and waiting for ever); one without fusion stays at version 4."""
    job = f"meta{fusion}"
    ps = accumulator.sync.ParameterServer(job, replicas_to_aggregate=1, client=target.client(),
                                          fusion_bytes=fusion)  # fmt: skip
    ps.initialize({"a": np.zeros(2), "b": np.zeros(3)})
    meta = msgpack.unpackb(target.redis().hget(SyncKeys("", job).params, "meta"), raw=False)
    assert meta["v"] == version and meta.get("fusion", 0) == fusion
    ps.close()


def test_a_bucket_filled_to_exactly_fusion_bytes_stays_one_bucket():
    """F05: a bucket takes parameters until the next would take it *over* fusion_bytes: one
    filled to exactly that many bytes is one bucket (the plan is the job's layout: every
    chief, worker and CLI of every version must derive the same one)."""
    specs = [spec("p0", (10,)), spec("p1", (15,)), spec("p2", (1,))]  # 40 + 60 bytes, then 4
    units = _fusion.plan(specs, 100)
    assert layout(units) == [("#fused/0", ["p0", "p1"]), ("p2", ["p2"])]
    assert units[0].shape == (25,)


def test_an_accumulator_an_older_client_made_gets_an_instance_id_at_its_next_open(target):
    """O02: an accumulator created by a client that stored no instance id gets the id of the
    next object that opens it: that object then tells it from one deleted and created again
    under its name (its apply is refused instead of going into the new one)."""
    r = target.redis()
    state = Keys("", "legacy").state

    def open_it():
        return accumulator.ConditionalAccumulator(np.float64, (2,), shared_name="legacy",
                                                  client=target.client())  # fmt: skip

    old = open_it()
    old.close()
    r.hdel(state, "inst")  # as an older client made it
    acc = open_it()
    assert r.hget(state, "inst") not in (None, b"")
    _admin.delete(r, "legacy", "")
    again = open_it()  # created again under the name
    with pytest.raises(accumulator.NotFoundError, match="created again"):
        acc.apply_grad(np.ones(2), local_step=0)
    assert again.num_accumulated() == 0
    acc.close()
    again.close()
