"""accumulator.sync: the chief/worker protocol in one process on both backends, then with real
worker processes on a real server (a normal run against a reference, a worker SIGKILLed
mid-step, a restarted worker)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

import accumulator
from accumulator._keys import Keys, SyncKeys
from accumulator.sync import (
    ParameterServer,
    TrainingFinished,
    Worker,
    accumulator_name,
)
from accumulator.testing import RedisServer, find_server_binary

LR = 0.1


def _params() -> dict[str, np.ndarray]:
    return {
        "w": np.linspace(-1.0, 1.0, 6).reshape(2, 3),
        "emb": np.arange(12, dtype=np.float64).reshape(6, 2) / 10,
    }


# -- the update rule, without Redis ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64", "int32"])
@pytest.mark.parametrize("writeable", [True, False])
def test_the_learning_rate_update_is_p_minus_lr_times_g_exactly(dtype, writeable):
    """Plain SGD scales a dense float gradient in place (the chief's own taken array: no
    temporary as large as the parameter); the result is ``p - lr * g`` bit for bit either
    way, and a read-only or integer gradient is left as it was."""
    from accumulator.sync._params import apply_update, specs_for

    rng = np.random.default_rng(3)
    p0 = (rng.standard_normal(1000) * 100).astype(dtype)
    g0 = (rng.standard_normal(1000) * 1e3).astype(dtype)
    specs, params = specs_for({"p": p0.copy()}, frozenset())
    g = g0.copy()
    g.flags.writeable = writeable
    out = apply_update(0.37, specs, params, {"p": g}, 0)
    expected = p0 - np.asarray(0.37 * g0, dtype=dtype)
    assert out["p"].dtype == np.dtype(dtype)
    assert out["p"].tobytes() == expected.tobytes()
    if not writeable or dtype == "int32":
        np.testing.assert_array_equal(g, g0)


# -- in one process -----------------------------------------------------------------------------


def test_push_take_publish(target):
    ps = ParameterServer("job", replicas_to_aggregate=2, sparse={"emb"}, client=target.client())
    assert ps.initialize(_params()) == 0
    workers = [Worker("job", client=target.client(), worker_id=f"w{i}") for i in range(3)]
    for w in workers:
        step, params = w.pull(timeout=5)
        assert step == 0
        np.testing.assert_array_equal(params["emb"], _params()["emb"])
    gw = [np.ones((2, 3)), 3 * np.ones((2, 3))]
    assert workers[0].push(0, {"w": gw[0], "emb": ([0, 4], [[1.0, 1.0], [2.0, 2.0]])}) == {
        "w": True,
        "emb": True,
    }
    workers[1].push(0, {"w": gw[1], "emb": accumulator.IndexedSlices([[4.0, 4.0]], [4])})
    assert ps.step(LR, timeout=5) == 1
    # the third (backup) worker is late: dropped as stale, and counted
    assert workers[2].push(0, {"w": gw[0], "emb": ([1], [[1.0, 1.0]])}) == {
        "w": False,
        "emb": False,
    }
    step, params = workers[2].pull(after=0, timeout=5)
    assert step == 1
    expected = _params()
    expected["w"] -= LR * 2.0
    expected["emb"][0] -= LR * 1.0  # a row in one gradient of two comes back unchanged
    expected["emb"][4] -= LR * 3.0  # rows are averaged over their own contributions
    for name in expected:
        np.testing.assert_allclose(params[name], expected[name])
        np.testing.assert_array_equal(params[name], ps.params[name])
    stats = ps.stats()
    assert (stats.step, stats.pushes, stats.accepted, stats.stale, stats.partial) == (1, 3, 2, 1, 0)
    assert stats.workers["w2"].stale == 1 and stats.workers["w0"].accepted == 1
    assert stats.params["w"].applied == 2 and stats.params["emb"].stale == 1
    assert stats.stale_tensors == 2
    assert ps.accumulator_names == {"w": "job/w", "emb": "job/emb"}
    for w in workers:
        w.close()
    ps.close()


def test_a_scalar_parameter_stays_a_scalar(target):
    """A 0-d parameter (a bias, a temperature) keeps shape () on the chief, in the update
    function, after a step and in the workers' pulls (it became (1,) on the chief once)."""
    ps = ParameterServer("scalar", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"b": np.float32(2.0), "w": np.zeros(3, np.float32)}, resume=False)
    assert ps.params["b"].shape == ()
    worker = Worker("scalar", client=target.client())
    step, params = worker.pull(timeout=5)
    assert params["b"].shape == ()
    worker.push(step, {"b": np.float32(1.0), "w": np.ones(3, np.float32)})
    seen = {}

    def update(params, grads, step):
        seen["shapes"] = (params["b"].shape, np.shape(grads["b"]))
        params["b"] -= 0.5 * grads["b"]
        params["w"] -= 0.5 * grads["w"]

    assert ps.step(update, timeout=5) == 1
    assert seen["shapes"] == ((), ())
    assert ps.params["b"].shape == () and ps.params["b"] == np.float32(1.5)
    step, params = worker.pull(after=0, timeout=5)
    assert params["b"].shape == () and params["b"] == np.float32(1.5)
    worker.close()
    ps.close()


def test_a_push_is_counted_in_the_round_trip_of_its_applies(real, sends):
    """A steady worker's push of a small model: one pipeline with every tensor's apply and
    the push's count (made as "all accepted" before the outcome is known), no look at the job
    first (a finished job's accumulators are sealed). A push with a stale tensor amends its
    count after."""
    ps = ParameterServer("rt", replicas_to_aggregate=1, sparse={"emb"}, client=real.client())
    ps.initialize(_params())
    worker = Worker("rt", client=real.client(), worker_id="w0")
    step, _ = worker.pull(timeout=5)
    grads = {"w": np.ones((2, 3)), "emb": ([1], [[1.0, 1.0]])}
    worker.push(step, grads)  # the first loads the count script
    ps.step(LR, timeout=5)
    step, _ = worker.pull(after=step, timeout=5)
    # one pipeline: on a cluster, one per node the keys live on
    r = real.redis()
    keys = [*(Keys("", accumulator_name("rt", name)).state for name in grads), worker.keys.stats]
    pipelines = len({r.get_node_from_key(k).name for k in keys}) if real.kind == "cluster" else 1
    sends[0] = 0
    assert worker.push(step, grads) == {"w": True, "emb": True}
    assert sends[0] == pipelines
    ps.step(LR, timeout=5)
    sends[0] = 0
    assert worker.push(step, grads) == {"w": False, "emb": False}  # stale: counted, amended
    assert sends[0] == 1 + pipelines
    stats = ps.stats()
    assert (stats.pushes, stats.stale, stats.partial) == (3, 1, 0)
    assert (stats.workers["w0"].pushes, stats.workers["w0"].stale) == (3, 1)
    worker.close()
    ps.close()


def test_a_push_count_amended_or_sent_again_counts_once(target):
    """``lua/sync_count.lua``: the same push id again with the same outcome is a retry (not
    counted); with another outcome it moves the push between the outcome counters."""
    from accumulator import _scripts

    r = target.redis()
    keys = SyncKeys("", "amend")
    stats_key = keys.stats
    r.hset(keys.params, "run", "r")  # (a job: the push of a deleted one counts nothing)

    def count(push: str, what: str) -> int:
        return int(_scripts.call(r, "sync_count", [stats_key, keys.params], ["w:1", push, what]))

    def counters() -> tuple[int, ...]:
        got = r.hgetall(stats_key)
        return tuple(int(got.get(f.encode(), 0)) for f in
                     ("pushes", "stale", "partial", "w:w:1:pushes", "w:w:1:stale",
                      "w:w:1:partial"))  # fmt: skip

    assert count("a1", "") == 1 and count("a1", "") == 0
    assert counters() == (1, 0, 0, 1, 0, 0)
    assert count("a1", "stale") == 2 and count("a1", "stale") == 0
    assert counters() == (1, 1, 0, 1, 1, 0)
    assert count("a1", "partial") == 2
    assert counters() == (1, 0, 1, 1, 0, 1)
    assert count("b2", "stale") == 1
    assert counters() == (2, 1, 1, 2, 1, 1)
    assert count("b2", "") == 2
    assert counters() == (2, 0, 1, 2, 0, 1)
    assert count("b2", "none") == 2 and count("b2", "none") == 0  # not a push after all
    assert counters() == (1, 0, 1, 1, 0, 1)
    assert count("c3", "none") == 1 and count("c3", "stale") == 2
    assert counters() == (2, 1, 1, 2, 1, 1)
    r.delete(keys.params, stats_key)  # the job deleted: a straggler's push brings nothing back
    assert count("d4", "") == -1 and not r.exists(stats_key)


def _failed_step():
    raise RuntimeError("injected")
    yield  # a generator: the protocol step fails when it is run


def test_a_push_that_failed_part_way_is_counted_once(target, monkeypatch):
    """A push whose second tensor's apply failed: the first stays applied, pushing again at
    the step applies only the other, and the two attempts count as one push."""
    from accumulator.sync import _worker

    ps = ParameterServer("half", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker("half", client=target.client(), worker_id="w0")
    step, _ = worker.pull(timeout=5)
    real_apply = _worker._apply_ops
    calls = []

    def failing(acc, prepared, at):
        calls.append(acc.name)
        if acc.name == "emb" and len(calls) <= 2:
            return _failed_step()
        return real_apply(acc, prepared, at)

    monkeypatch.setattr(_worker, "_apply_ops", failing)
    grads = {"w": np.ones((2, 3)), "emb": ([1], [[1.0, 1.0]])}
    with pytest.raises(RuntimeError, match="injected"):
        worker.push(step, grads)
    assert worker.push(step, grads) == {"w": True, "emb": True}
    assert calls == ["w", "emb", "emb"]  # w was not applied again
    assert ps.step(LR, timeout=5) == 1
    np.testing.assert_allclose(ps.params["w"], _params()["w"] - LR)
    stats = ps.stats()
    assert (stats.pushes, stats.workers["w0"].pushes) == (1, 1)
    assert stats.params["w"].applied == 1 and stats.params["emb"].applied == 1
    worker.close()
    ps.close()


def test_update_forms_and_timeouts(target):
    ps = ParameterServer("u", replicas_to_aggregate=1, client=target.client())
    worker = Worker("u", client=target.client())
    with pytest.raises(accumulator.DeadlineExceededError):
        worker.pull(timeout=0.1)  # not initialized yet
    with pytest.raises(RuntimeError):
        ps.step(LR)
    ps.initialize({"a": np.zeros(2, np.float32), "b": np.ones(1)})
    step, _ = worker.pull(timeout=1)
    with pytest.raises(accumulator.DeadlineExceededError):
        worker.pull(after=step, timeout=0.1)
    with pytest.raises(accumulator.DeadlineExceededError):
        ps.step(LR, timeout=0.1)
    with pytest.raises(ValueError):
        worker.push(0, {"a": [1.0, 1.0]})  # every parameter needs a gradient

    class Tensor:  # anything with __array__ (torch, jax) is accepted
        def __array__(self, dtype=None, copy=None):
            return np.array([2.0, 4.0])

    worker.push(0, {"a": Tensor(), "b": [1.0]})
    assert ps.step({"a": 0.5, "b": 1.0}, timeout=5) == 1
    np.testing.assert_array_equal(ps.params["a"], [-1.0, -2.0])
    assert ps.params["a"].dtype == np.float32
    np.testing.assert_array_equal(ps.params["b"], [0.0])

    def adam_like(params, grads, step):
        assert step == 1
        return {"a": params["a"] * 0, "b": params["b"] + grads["b"]}

    worker.push(1, {"a": [1.0, 1.0], "b": [3.0]})
    ps.step(adam_like, timeout=5)
    np.testing.assert_array_equal(ps.params["b"], [3.0])

    def in_place(params, grads, step):
        params["a"] += 1

    worker.push(2, {"a": [1.0, 1.0], "b": [3.0]})
    assert ps.step(in_place, timeout=5, final=True) == 3
    step, params = worker.pull(timeout=1)
    assert step == 3 and worker.finished
    np.testing.assert_array_equal(params["a"], [1.0, 1.0])
    with pytest.raises(TrainingFinished):
        worker.pull(after=2, timeout=1)  # finished: no further gradient is wanted
    worker.close()
    ps.close()


def test_timed_out_step_keeps_what_it_took(target):
    ps = ParameterServer("p", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    dense = accumulator.ConditionalAccumulator(
        np.float64, (2, 3), shared_name=accumulator_name("p", "w"), client=target.client()
    )
    dense.apply_grad(np.ones((2, 3)), local_step=0)
    with pytest.raises(accumulator.DeadlineExceededError):
        ps.step(LR, timeout=0.2)  # w taken, emb has nothing yet
    assert dense.global_step() == 1 and ps.global_step == 0
    worker = Worker("p", client=target.client())
    worker.pull(timeout=1)
    # w's accumulator moved on: this push's w is stale, its emb completes the step
    assert worker.push(0, {"w": np.zeros((2, 3)), "emb": ([2], [[1.0, 1.0]])}) == {
        "w": False,
        "emb": True,
    }
    assert ps.step(LR, timeout=5) == 1
    np.testing.assert_allclose(ps.params["w"], _params()["w"] - LR)
    assert ps.stats().partial == 1
    dense.close()
    worker.close()
    ps.close()


def test_chief_restart_resumes_and_skips_a_lost_round(target):
    ps = ParameterServer("r", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker("r", client=target.client())
    worker.pull(timeout=1)
    worker.push(0, {"w": np.ones((2, 3)), "emb": ([0], [[1.0, 1.0]])})
    ps.step(LR, timeout=5)
    published = ps.params
    # the chief "dies" after taking step 1's gradients and before publishing step 2
    worker.pull(after=0, timeout=1)
    worker.push(1, {"w": np.ones((2, 3)), "emb": ([0], [[1.0, 1.0]])})
    for acc in ps._accs.values():
        acc.take_grad(1, timeout=5)
    ps.close()

    chief = ParameterServer("r", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    assert chief.initialize(_params()) == 2  # resumed: the published values win
    for name in published:
        np.testing.assert_array_equal(chief.params[name], published[name])
    step, _ = worker.pull(after=1, timeout=1)  # the waiting worker wakes up and goes on
    assert step == 2
    worker.push(2, {"w": np.ones((2, 3)), "emb": ([0], [[1.0, 1.0]])})
    assert chief.step(LR, timeout=5) == 3
    with pytest.raises(ValueError, match="different parameters"):
        ParameterServer("r", replicas_to_aggregate=1, client=target.client()).initialize(
            {"w": np.zeros(3)}
        )
    # a fresh start replaces everything, counters included
    assert chief.initialize(_params(), resume=False) == 0
    assert chief.stats().pushes == 0 and chief.stats().params["w"].applied == 0
    step, _ = worker.pull(after=3, timeout=1)  # a re-initialized job wakes waiters too
    assert step == 0
    chief.delete()
    assert list(target.redis().scan_iter()) == []
    worker.close()
    chief.close()


def test_a_stragglers_push_after_the_job_is_deleted_leaves_nothing(target):
    """A worker that pulled before the job was deleted pushes afterwards: NotFoundError, and
    not a key of the job brought back (its push count re-created the stats hash, without
    expiry)."""
    ps = ParameterServer("gone", replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    worker = Worker("gone", client=target.client())
    step, _ = worker.pull(timeout=1)
    ps.delete()
    assert list(target.redis().scan_iter()) == []
    with pytest.raises(accumulator.NotFoundError):
        worker.push(step, {"w": np.ones((2, 3)), "emb": ([0], [[1.0, 1.0]])})
    assert list(target.redis().scan_iter()) == []
    worker.close()
    ps.close()


def test_bad_arguments(target):
    with pytest.raises(ValueError):
        ParameterServer("x", replicas_to_aggregate=0, client=target.client())
    ps = ParameterServer("x", replicas_to_aggregate=1, sparse={"nope"}, client=target.client())
    with pytest.raises(ValueError, match="nope"):
        ps.initialize({"w": np.zeros(2)})
    ps.close()
    worker = Worker("x", client=target.client())
    with pytest.raises(RuntimeError, match="pull"):
        worker.push(0, {"w": np.zeros(2)})
    worker.close()
    ps = ParameterServer("names", replicas_to_aggregate=1, client=target.client())
    ps.initialize({"w": np.zeros(2)}, resume=False)
    worker = Worker("names", client=target.client())
    worker.pull(timeout=5)
    for wrong in ({"v": np.zeros(2)}, {}, {"w": np.zeros(2), "v": np.zeros(2)}):
        with pytest.raises(accumulator.InvalidArgumentError, match="exactly \\['w'\\]"):
            worker.push(0, wrong)
    assert ps.stats().pushes == 0
    worker.close()
    ps.close()


# -- real processes -----------------------------------------------------------------------------


def _grads(params: dict[str, np.ndarray], step: int, index: int, same: bool) -> dict:
    """Worker ``index``'s gradient at ``step``: a function of the parameters it pulled, so a
    worker computing on the wrong parameters shows. ``same``: every worker's is identical
    (then any subset averages to the same update)."""
    k = 0 if same else index
    w = params["w"] * 0.1 * (k + 1) + 0.01 * step + k
    rows = np.array(sorted({(k + step) % 6, (2 * k + 1) % 6}))
    values = params["emb"][rows] * 0.5 + (k + 1)
    return {"w": w, "emb": (rows, values)}


def _reference(steps: int, workers: int, same: bool = False) -> list[dict[str, np.ndarray]]:
    """Parameters at every step when each step averages the gradients of all ``workers``."""
    params = _params()
    history = [{k: v.copy() for k, v in params.items()}]
    for step in range(steps):
        grads = [_grads(params, step, i, same) for i in range(workers)]
        params["w"] = params["w"] - LR * np.mean([g["w"] for g in grads], axis=0)
        sums, counts = np.zeros_like(params["emb"]), np.zeros(len(params["emb"]))
        for g in grads:
            rows, values = g["emb"]
            sums[rows] += values
            counts[rows] += 1
        used = counts > 0
        params["emb"] = params["emb"].copy()
        params["emb"][used] -= LR * sums[used] / counts[used, None]
        history.append({k: v.copy() for k, v in params.items()})
    return history


def _worker(url: str, job: str, index: int, out: mp.Queue, same: bool = False,
            stop_at: int | None = None, partial_at: int | None = None) -> None:  # fmt: skip
    """A worker process. ``stop_at``: on reaching that step, report and hang (to be killed)
    without pushing. ``partial_at``: there, push only ``w`` (by hand), report and hang."""
    worker = Worker(job, client=url, worker_id=f"worker-{index}")
    step, params = worker.pull(timeout=30)
    out.put(("pulled", index, step, {k: v.tolist() for k, v in params.items()}))
    while True:
        if stop_at is not None and step >= stop_at:
            out.put(("hanging", index, step))
            time.sleep(600)
        grads = _grads(params, step, index, same)
        if partial_at is not None and step >= partial_at:
            acc = accumulator.ConditionalAccumulator(
                np.float64, (2, 3), shared_name=accumulator_name(job, "w"), client=url
            )
            acc.apply_grad(grads["w"], local_step=step)
            out.put(("hanging", index, step))
            time.sleep(600)
        worker.push(step, grads)
        try:
            step, params = worker.pull(after=step, timeout=30)
        except TrainingFinished:
            break
    out.put(("done", index, worker.pushes, worker.accepted, worker.dropped))
    worker.close()


def _start(ctx, url, job, index, out=None, **kwargs):
    """Start a worker process. A worker that is going to be SIGKILLed needs a queue of its
    own: killed while its feeder thread holds a shared queue's lock, it would block everyone
    else's puts forever (multiprocessing's documented hazard)."""
    out = out if out is not None else ctx.Queue()
    proc = ctx.Process(target=_worker, args=(url, job, index, out), kwargs=kwargs, daemon=True)
    proc.start()
    proc.out = out
    return proc


def _messages(out: mp.Queue, kind: str, n: int, timeout: float = 60) -> list[tuple]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n:
        msg = out.get(timeout=max(0.1, deadline - time.monotonic()))
        if msg[0] == kind:
            got.append(msg)
    return got


@pytest.mark.slow
def test_processes_train_like_the_reference(real):
    steps, n = 12, 3
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = ParameterServer("ref", replicas_to_aggregate=n, sparse={"emb"}, client=real.url)
    ps.initialize(_params())
    procs = [_start(ctx, real.url, "ref", i, out) for i in range(n)]
    try:
        for s in range(steps):
            ps.step(LR, timeout=60, final=s == steps - 1)
        done = _messages(out, "done", n)
    finally:
        for p in procs:
            p.join(30)
    assert [p.exitcode for p in procs] == [0] * n
    expected = _reference(steps, n)[steps]
    for name in expected:
        np.testing.assert_allclose(ps.params[name], expected[name], rtol=1e-12)
    # every worker stepped in lockstep: all its pushes accepted, none after the last step
    assert sorted((d[2], d[3], d[4]) for d in done) == [(steps, 2 * steps, 0)] * n
    stats = ps.stats()
    assert (stats.pushes, stats.stale, stats.step, stats.done) == (n * steps, 0, steps, True)
    ps.close()


@pytest.mark.slow
def test_worker_killed_mid_step_training_goes_on(real):
    steps, n, at = 20, 4, 3
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ps = ParameterServer("kill", replicas_to_aggregate=n - 1, sparse={"emb"}, client=real.url)
    ps.initialize(_params())
    procs = [_start(ctx, real.url, "kill", i, out, same=True) for i in range(n - 1)]
    doomed = _start(ctx, real.url, "kill", n - 1, same=True, partial_at=at)
    try:
        killed_at = None
        for s in range(steps):
            if s == at + 2:
                # the doomed worker applied w (not emb) for its step: kill it right there
                [(_, _, its_step)] = _messages(doomed.out, "hanging", 1)
                os.kill(doomed.pid, signal.SIGKILL)
                doomed.join(10)
                killed_at = ps.global_step
            ps.step(LR, timeout=30, final=s == steps - 1)
        _messages(out, "done", n - 1)
    finally:
        for p in procs:
            p.join(30)
    assert doomed.exitcode == -signal.SIGKILL
    assert [p.exitcode for p in procs] == [0] * (n - 1)
    assert killed_at is not None and steps - killed_at >= 10  # most steps came after the kill
    assert its_step >= at
    # every step averaged identical gradients, whichever workers delivered them
    expected = _reference(steps, 1, same=True)[steps]
    for name in expected:
        np.testing.assert_allclose(ps.params[name], expected[name], rtol=1e-9)
    stats = ps.stats()
    assert stats.step == steps
    w, emb = stats.params["w"], stats.params["emb"]
    # the half-pushed gradient reached w (accepted or dropped as stale), never emb
    assert w.applied + w.stale == emb.applied + emb.stale + 1
    ps.close()


@pytest.mark.slow
def test_restarted_worker_picks_up_step_and_parameters(real):
    steps, n, at = 12, 2, 5
    ctx = mp.get_context("spawn")
    ps = ParameterServer("restart", replicas_to_aggregate=n, sparse={"emb"}, client=real.url)
    ps.initialize(_params())
    errors: list[BaseException] = []

    def chief() -> None:
        try:
            for s in range(steps):
                ps.step(LR, timeout=60, final=s == steps - 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=chief, daemon=True)
    steady = _start(ctx, real.url, "restart", 0)
    flaky = _start(ctx, real.url, "restart", 1, stop_at=at)
    thread.start()
    [(_, _, hung_at)] = _messages(flaky.out, "hanging", 1)
    assert hung_at == at  # a step needs both workers: the chief waits for worker 1 at `at`
    os.kill(flaky.pid, signal.SIGKILL)
    flaky.join(10)
    again = _start(ctx, real.url, "restart", 1)
    [(_, _, step, params)] = _messages(again.out, "pulled", 1)
    reference = _reference(steps, n)
    assert step == at
    for name in params:
        np.testing.assert_allclose(np.array(params[name]), reference[at][name], rtol=1e-12)
    thread.join(60)
    assert not thread.is_alive() and not errors
    for p in (steady, again):
        p.join(30)
        assert p.exitcode == 0
    for name in reference[steps]:
        np.testing.assert_allclose(ps.params[name], reference[steps][name], rtol=1e-12)
    # the restarted worker counts on under the same id: one push per step in all
    assert ps.stats().workers["worker-1"].pushes == steps
    ps.close()


def test_repr_names_the_job_only(target):
    """Neither repr nor the attributes show the client given: a URL may hold a password
    (tests/test_secrets.py checks that with real passwords)."""
    with ParameterServer("job", replicas_to_aggregate=1, client=target.client()) as ps:
        assert repr(ps) == "ParameterServer(job='job', container='', step=None)"
        ps.initialize({"w": np.zeros(2)})
        assert repr(ps) == "ParameterServer(job='job', container='', step=0)"
        with Worker("job", client=target.client(), container="") as worker:
            assert repr(worker) == "Worker(job='job', container='', step=None)"
            assert not any(isinstance(v, str) and "://" in v for v in vars(worker).values())


# -- Redis restarts -----------------------------------------------------------------------------


@pytest.fixture
def aof_server():
    """A server of this test's own with AOF (fsync always): its data survives kill -9."""
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with RedisServer(persistent=True, startup_timeout=60) as server:
        yield server


def test_a_job_rolled_back_by_a_restart_from_an_older_snapshot_goes_on(caplog):
    """Redis restarted from an RDB snapshot taken steps ago (RDB-only persistence; a failover
    to a replica behind does the same): the job's published step went back. A worker waiting
    for a step newer than the one it had waited for ever (the chief waited for gradients of
    that step, which no worker would push: a review's drill hung); it now takes the step the
    job went back to, with a warning, pushes for it, and the job goes on: the chief applies
    that round to its own parameters (the newest) and sets the accumulator to its step."""
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    k = 2
    with RedisServer(persistent=True, module=False,
                     args=["--appendonly", "no", "--save", ""]) as server:  # fmt: skip
        url = server.url + "?socket_timeout=5"
        ps = ParameterServer("rolled", replicas_to_aggregate=1, client=url)
        ps.initialize({"w": np.zeros(3)})
        worker = Worker("rolled", client=url, worker_id="w0")
        step, params = worker.pull(timeout=10)
        for _ in range(k + 3):
            if step == k:
                server.client().save()  # the snapshot: the job at step k
            worker.push(step, {"w": np.ones(3)})
            assert ps.step(1.0, timeout=10) == step + 1
            step, params = worker.pull(after=step, timeout=10)
        assert step == k + 3
        server.kill()
        server.start()  # from the snapshot: published step k, its accumulator at step k
        with caplog.at_level("WARNING", logger="accumulator.sync"):
            back, params = worker.pull(after=step, timeout=15)
        assert back == k
        np.testing.assert_array_equal(params["w"], np.full(3, -float(k)))
        assert f"went back from step {k + 3} to step {k}" in caplog.text
        assert worker.push(back, {"w": np.ones(3)}) == {"w": True}
        with caplog.at_level("WARNING", logger="accumulator.sync"):
            # takes the round of step k: applied to the chief's parameters (the newest), and
            # the accumulator set to the step the chief publishes
            assert ps.step(1.0, timeout=15) == k + 4
        assert f"came from step {k}, this chief is at step {k + 3}" in caplog.text
        step, params = worker.pull(after=back, timeout=10)
        assert step == k + 4
        np.testing.assert_array_equal(params["w"], np.full(3, -float(k + 4)))
        # stale pushes are dropped again (an accumulator left at step k + 1 took them)
        assert worker.push(k + 1, {"w": np.ones(3)}) == {"w": False}
        assert worker.push(step, {"w": np.ones(3)}) == {"w": True}
        assert ps.step(1.0, timeout=15) == k + 5
        worker.close()
        ps.close()


def test_a_publish_lost_by_a_failover_is_published_again(target, caplog):
    """A failover to a replica that had not got the chief's last publish (the job's slot),
    while the accumulators (other slots, other primaries) kept the step the chief's takes
    advanced them to: the published step went back by one. Workers waited for the chief's
    step, whose gradients the chief waited for: both for ever (a review's cluster drill).
    The chief's lease thread sees the published step behind its own and the chief publishes
    again."""
    ps = ParameterServer("lostpub", replicas_to_aggregate=1, client=target.client(),
                         chief_lease=1.5)  # (renewed, and so looked at, every 0.5 s)
    ps.initialize({"w": np.zeros(3)})
    worker = Worker("lostpub", client=target.client(), worker_id="w0")
    step, _ = worker.pull(timeout=10)
    worker.push(step, {"w": np.ones(3)})
    assert ps.step(1.0, timeout=10) == step + 1
    worker.close()
    r, params = target.redis(), SyncKeys("", "lostpub").params
    r.hset(params, "step", step)  # the failover: the hash as it was before that publish
    done: list[int] = []
    chief = threading.Thread(target=lambda: done.append(ps.step(1.0, timeout=20)))
    with caplog.at_level("WARNING", logger="accumulator.sync"):
        chief.start()
        worker = Worker("lostpub", client=target.client(), worker_id="w0")  # (restarted)
        assert worker.pull(timeout=10)[0] == step  # what the job says after the failover
        assert worker.push(step, {"w": np.ones(3)}) == {"w": False}  # stale: step + 1 there
        seen, got = worker.pull(after=step, timeout=15)  # waited for ever before
        assert seen == step + 1
        np.testing.assert_array_equal(got["w"], np.full(3, -1.0))
        worker.push(seen, {"w": np.ones(3)})
        chief.join(20)
    assert done == [step + 2]
    assert "publishing it again" in caplog.text
    worker.close()
    ps.close()


def test_a_step_made_while_the_lease_thread_reads_is_not_taken_for_a_lost_publish():
    """The lease thread reads the published step while the chief waits; the chief may take,
    publish and wait again while that read is on its way. The step read is then the
    chief's last, published a moment ago, not one Redis lost: no publish again (a review
    found the race: a needless publish and a warning of a failover that did not happen)."""
    import fakeredis

    ps = ParameterServer("race", replicas_to_aggregate=1,
                         client=fakeredis.FakeRedis(server=fakeredis.FakeServer()))
    ps.initialize({"w": np.zeros(3)})
    read = ps.redis.hmget

    def slow_read(*args, **kwargs):
        values = read(*args, **kwargs)  # the step as published before...
        ps._step += 1  # ...the chief took, published and waits for the next one
        return values

    ps._waiting = True
    ps.redis.hmget = slow_read
    assert ps._published_behind() is False
    ps.redis.hmget = read
    assert ps._published_behind() is True  # (the published step is behind indeed now)
    ps._waiting = False
    ps.close()


@pytest.mark.parametrize(
    "how", ["kill", pytest.param("shutdown", marks=pytest.mark.slow)]
)
def test_chief_and_workers_ride_through_a_redis_restart(aof_server, how):
    """Redis SIGKILLed (or SHUTDOWN) mid-job and started again 2 s later on its AOF: the
    chief and the workers (threads, each with its own connections) keep going, blocked
    takes and waiting pulls included, and every step averages exactly both workers'
    gradients (none lost, none counted twice)."""
    steps, n, at = 12, 2, 3
    url = aof_server.url
    ps = ParameterServer("outage", replicas_to_aggregate=n, sparse={"emb"}, client=url)
    ps.initialize(_params())
    errors: list[tuple[str, BaseException]] = []
    done: list[tuple[int, int, int, int]] = []

    def outage() -> None:
        if how == "kill":
            aof_server.kill()
        else:
            aof_server.client().shutdown()
            while aof_server.running:
                time.sleep(0.01)
        time.sleep(2.0)
        aof_server.start()

    restart = threading.Thread(target=outage, daemon=True)

    def sgd(params, grads, step):
        # Redis goes down here, after the takes: the publish that follows meets the outage,
        # and so do the workers waiting for this step's parameters (their pub/sub waits)
        if step == at:
            restart.start()
            time.sleep(0.2)
        for spec in ps.specs:
            p, g = params[spec.name], grads[spec.name]
            if spec.kind == "sparse":
                p[g.indices] -= LR * g.values
            else:
                p -= LR * g

    def chief() -> None:
        try:
            for s in range(steps):
                ps.step(sgd, timeout=90, final=s == steps - 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(("chief", exc))

    def worker(k: int) -> None:
        try:
            with Worker("outage", client=url, worker_id=f"w{k}") as w:
                step, params = w.pull(timeout=30)
                while True:
                    w.push(step, _grads(params, step, k, same=False))
                    try:
                        step, params = w.pull(after=step, timeout=90)
                    except TrainingFinished:
                        break
                done.append((k, w.pushes, w.accepted, w.dropped))
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append((f"worker {k}", exc))

    threads = [threading.Thread(target=chief, daemon=True)]
    threads += [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    restart.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    expected = _reference(steps, n)[steps]
    for name in expected:
        np.testing.assert_allclose(ps.params[name], expected[name], rtol=1e-12)
    assert sorted(done) == [(k, steps, 2 * steps, 0) for k in range(n)]
    stats = ps.stats()
    assert (stats.step, stats.done, stats.pushes, stats.stale, stats.partial) == (
        steps, True, n * steps, 0, 0,
    )  # fmt: skip
    assert all(p.applied == n * steps and p.taken == steps for p in stats.params.values())
    ps.close()
