"""accumulator.sync with tensor fusion (the default): small dense parameters share bucket
accumulators; the gradients, the update, staleness, checks and a chief's recovery are those
of one accumulator per parameter (test_sync_lifecycle.py has these with no fusion)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_sync_lifecycle import (
    LR,
    _abandoned_claim,
    _assert_params,
    _grad,
    _params,
    _two_pushes,
    _update,
)

import accumulator
from accumulator import _admin
from accumulator._keys import Keys
from accumulator.sync import ParameterServer, Worker, accumulator_name


def _model() -> dict[str, np.ndarray]:
    """w, b (fused together), emb (sparse), and a float32 pair (a bucket of its own dtype)."""
    out = _params()
    out["g"] = np.linspace(0, 1, 5).astype(np.float32)
    out["h"] = np.float32(2.0) * np.ones((2, 2), np.float32)
    return out


def _grads(params: dict[str, np.ndarray], step: int, k: int) -> dict:
    g = _grad(params, step, k)
    g["g"] = params["g"] * (k + 1) + step
    g["h"] = params["h"] - k
    return g


def test_fused_parameters_get_the_same_update_as_one_accumulator_each(target):
    ps = ParameterServer("fz", replicas_to_aggregate=2, sparse={"emb"}, client=target.client())
    plain = ParameterServer("fz0", replicas_to_aggregate=2, sparse={"emb"}, fusion_bytes=0,
                            client=target.client())  # fmt: skip
    ps.initialize(_model())
    plain.initialize(_model())
    names = ps.accumulator_names
    assert names["emb"] == "fz/emb" and names["w"] == names["b"] != names["g"] == names["h"]
    assert re.fullmatch(r"fz/#fused/0-[0-9a-f]{6}", names["w"])
    assert re.fullmatch(r"fz/#fused/1-[0-9a-f]{6}", names["g"])
    assert set(plain.accumulator_names.values()) == {f"fz0/{n}" for n in _model()}
    workers = {job: [Worker(job, client=target.client(), worker_id=f"w{k}") for k in range(3)]
               for job in ("fz", "fz0")}  # fmt: skip
    for step in range(3):
        for job, chief in (("fz", ps), ("fz0", plain)):
            pulled = [w.pull(after=step - 1 if step else None, timeout=5) for w in workers[job]]
            for k, w in enumerate(workers[job]):
                s, params = pulled[k]
                assert s == step
                accepted = w.push(s, _grads(params, s, k))
                # the third worker is a backup: late, its push is dropped (all of it)
                assert set(accepted.values()) == {k < 2}, (job, k, accepted)
                if k == 1:
                    assert chief.step(LR, timeout=5) == step + 1
    for name in _model():
        np.testing.assert_array_equal(ps.params[name], plain.params[name], err_msg=name)
    stats = ps.stats()
    assert stats.params["w"] is stats.params["b"]  # one bucket, counted once per push
    assert stats.params["w"].shared_name == names["w"]
    assert (stats.params["w"].applied, stats.params["w"].stale) == (6, 3)
    assert stats.stale_tensors == plain.stats().stale_tensors == 3 * 5
    for job in workers:
        for w in workers[job]:
            w.close()
    ps.close()
    plain.close()


def _one_worker(target, job: str) -> tuple[ParameterServer, Worker, int, dict]:
    """A job of _model() (one replica) and a worker that pulled it: (chief, worker, step,
    gradients of that worker at that step)."""
    ps = ParameterServer(job, replicas_to_aggregate=1, sparse={"emb"}, client=target.client())
    ps.initialize(_model())
    worker = Worker(job, client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    return ps, worker, step, _grads(params, step, 0)


def test_a_bad_tensor_in_a_bucket_is_named_and_nothing_is_applied(target):
    ps, worker, step, grads = _one_worker(target, "fb")
    grads["h"] = np.zeros((2, 3), np.float32)
    with pytest.raises(accumulator.InvalidArgumentError,
                       match=r"gradient of 'h' \(dense float32 \[2,2\]\) is invalid, nothing "
                             r"was applied: Shape mismatch") as info:  # fmt: skip
        worker.push(step, grads)
    assert "fb" in str(info.value)
    assert all(acc.num_accumulated() == 0 for acc in ps._accs.values())
    grads["h"] = np.full((2, 2), 1e300)  # float32 would make it inf
    with pytest.raises(accumulator.InvalidArgumentError, match="'h'.*out of its range"):
        worker.push(step, grads)
    assert all(acc.num_accumulated() == 0 for acc in ps._accs.values())
    worker.close()
    ps.close()


@pytest.mark.parametrize("died", ["after-claiming-fused", "after-reading-fused-claiming-emb"])
def test_a_chief_killed_between_take_and_publish_is_recovered_exactly(target, died):
    """As test_sync_lifecycle's, with w and b in one bucket: a claimed bucket is handed to
    the restarted chief; a read one is lost for both its parameters (a zero gradient)."""
    job = f"fh-{died}"
    ps = ParameterServer(job, replicas_to_aggregate=2, sparse={"emb"}, client=target.client())
    ps.initialize(_params())
    fused = ps.accumulator_names["w"].split("/", 1)[1]
    assert fused.startswith("#fused/0-") and ps.accumulator_names["b"] == f"{job}/{fused}"
    workers, grads = _two_pushes(target, job)
    if died == "after-claiming-fused":
        _abandoned_claim(ps._accs[fused], 2)
        lost: set[str] = set()
    else:
        ps._accs[fused].take_grad(2, timeout=5)  # read: w's and b's gradients die with it
        _abandoned_claim(ps._accs["emb"], 2)
        lost = {"w", "b"}
    ps.close()
    chief = ParameterServer(job, replicas_to_aggregate=2, sparse={"emb"}, fusion_bytes=0,
                            client=target.client())  # fmt: skip
    assert chief.initialize(_params()) == 0
    assert chief.accumulator_names["w"] == f"{job}/{fused}"  # the job's layout, not fusion=0
    for acc in chief._accs.values():
        acc.wait_slice = 0.1
    assert chief.step(LR, timeout=20) == 1
    expected = _update(_params(), grads, skip=lost)
    _assert_params(chief.params, expected)
    r = target.redis()
    for name in (fused, "emb"):
        assert int(r.hget(Keys("", accumulator_name(job, name)).state, "step")) == 1
        info = _admin.describe(r, accumulator_name(job, name))
        assert info.count == 0 and info.claims == () and info.takers_waiting == 0
    chief.delete()
    assert list(r.scan_iter()) == []
    for w in workers:
        w.close()
    chief.close()


def test_the_cli_shows_each_parameter_with_its_bucket_and_deletes_the_buckets(target):
    ps, worker, step, grads = _one_worker(target, "fc")
    worker.push(step, grads)
    r = target.redis()
    info = _admin.describe_job(r, "fc")
    shown = {p.name: (p.shared_name, p.pending, p.step) for p in info.params}
    assert shown == {name: (acc, 1, 0) for name, acc in ps.accumulator_names.items()}
    assert list(shown) == list(_model())  # the parameters in the model's order
    assert info.warnings == ()
    ps.close()
    worker.close()
    assert _admin.delete_job(r, "fc", force=True) > 0
    assert list(r.scan_iter()) == []


def test_a_model_of_many_small_tensors_is_published_one_buffer_per_bucket(target):
    """40 tensors of 1 KiB (40 KiB: read, not announced) and one of 2 MiB (its own): the
    small ones are published as one buffer, and the workers' pulls give every tensor back."""
    small = {f"p{i:02d}": np.full(256, float(i), np.float32) for i in range(40)}
    model = {**small, "big": np.zeros(1 << 19, np.float32)}
    ps = ParameterServer("fm", replicas_to_aggregate=2, client=target.client())
    ps.initialize(model)
    assert len(ps._accs) == 2 and ps.accumulator_names["big"] == "fm/big"
    r = target.redis()
    published = sorted(k.decode().rsplit(":", 2)[1] for k in r.scan_iter(
        match=ps.keys.versions_pattern))  # the unit index of each part key  # fmt: skip
    assert published == ["0", "1", "1", "1"]  # the 40 tensors in one; the big one in 3 parts
    workers = [Worker("fm", client=target.client(), worker_id=f"w{k}") for k in range(2)]
    expected = {name: value.copy() for name, value in model.items()}
    for step in range(2):
        pulled = [w.pull(after=step - 1 if step else None, timeout=5) for w in workers]
        grads = []
        for k, (s, params) in enumerate(pulled):
            assert s == step
            for name in model:
                np.testing.assert_array_equal(params[name], expected[name], err_msg=name)
            grads.append({name: params[name] * 0 + (k + 1) * (step + 1) for name in model})
            assert all(workers[k].push(s, grads[k]).values())
        assert ps.step(LR, timeout=5) == step + 1
        for name in model:
            expected[name] = expected[name] - LR * np.mean([g[name] for g in grads], axis=0)
    for name in model:
        np.testing.assert_allclose(ps.params[name], expected[name], rtol=1e-6, err_msg=name)
    for w in workers:
        assert w.pull(after=1, timeout=5)[0] == 2
        w.close()
    ps.close()


def test_a_worker_of_the_jobs_old_layout_is_refused_not_mixed_in(target):
    """A job created again (``resume=False``) with its parameters in another order: the
    bucket has the same dtype and size, but another layout, so another name; a worker still
    on the old run gets NotFoundError for its push instead of its values landing in other
    parameters (a review found them mixed)."""
    first = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}
    ps = ParameterServer("fo", replicas_to_aggregate=1, client=target.client())
    ps.initialize(first)
    old = Worker("fo", client=target.client(), worker_id="old")
    step, _ = old.pull(timeout=5)
    ps.initialize({"b": first["b"], "a": first["a"]}, resume=False)
    grads = {"a": np.ones(4, np.float32), "b": np.full(3, 100, np.float32)}
    with pytest.raises(accumulator.NotFoundError):
        old.push(step, grads)
    assert all(acc.num_accumulated() == 0 for acc in ps._accs.values())
    old.close()
    ps.close()


def test_pulls_and_updates_see_the_parameters_in_the_models_order(target):
    model = {"w1": np.zeros(1 << 18, np.float32), "b1": np.zeros(3, np.float32),
             "w2": np.zeros(4, np.float16), "b2": np.zeros(2, np.float32)}  # fmt: skip
    seen = []

    def update(params, grads, step):
        seen.append((list(params), list(grads)))
        for name in params:
            params[name] -= grads[name]

    ps = ParameterServer("fr", replicas_to_aggregate=1, client=target.client())
    ps.initialize(model)
    worker = Worker("fr", client=target.client(), worker_id="w0")
    step, params = worker.pull(timeout=5)
    assert list(params) == list(model)  # (b1 and b2 share a bucket that sits before w2)
    worker.push(step, {name: np.ones_like(value) for name, value in model.items()})
    ps.step(update, timeout=5)
    assert seen == [(list(model), list(model))]
    assert list(worker.pull(after=step, timeout=5)[1]) == list(model) == list(ps.params)
    worker.close()
    ps.close()


def test_a_job_without_fusion_is_resumed_and_deleted_whatever_its_parameter_names(target):
    """A parameter named like a bucket is refused only in a job that fuses: a chief with the
    default fusion_bytes resumes, finishes and deletes a job made with fusion_bytes=0."""
    model = {"#fused/0": np.zeros(2), "b": np.zeros(2)}
    with pytest.raises(ValueError, match="reserved for fused buckets"):
        ParameterServer("fn", replicas_to_aggregate=1, client=target.client()).initialize(model)
    first = ParameterServer("fn", replicas_to_aggregate=1, fusion_bytes=0, client=target.client())
    first.initialize(model)
    first.close()
    chief = ParameterServer("fn", replicas_to_aggregate=1, client=target.client())
    assert chief.initialize(model) == 0
    assert chief.accumulator_names == {"#fused/0": "fn/#fused/0", "b": "fn/b"}
    chief.finish()
    chief.close()
    again = ParameterServer("fn", replicas_to_aggregate=1, client=target.client())
    assert again.initialize(model) == 0 and again.finished
    again.delete()
    assert list(target.redis().scan_iter()) == []
    again.close()


@pytest.mark.parametrize("fusion", [0, None], ids=["own", "fused"])
def test_a_worker_of_a_job_created_again_with_the_same_layout_applies_nothing(target, fusion):
    """The same parameters, the same layout, a new run (``resume=False``): the accumulators
    have the same names, but they are other ones; a worker still on the old run is refused
    (its gradient was computed on the old parameters) and told to pull, and its push is not
    counted in the new job. Older than fusion: such pushes, even of wrong shapes, landed in
    the new job."""
    kw = {} if fusion is None else {"fusion_bytes": fusion}
    ps = ParameterServer("fa", replicas_to_aggregate=1, client=target.client(), **kw)
    model = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}
    ps.initialize(model)
    old = Worker("fa", client=target.client(), worker_id="old")
    step, _ = old.pull(timeout=5)
    ps.initialize(model, resume=False)
    with pytest.raises(accumulator.NotFoundError, match=r"pull\(\) to join the job as it is"):
        old.push(step, {"a": np.ones(4), "b": np.ones(3)})
    assert all(acc.num_accumulated() == 0 for acc in ps._accs.values())
    stats = ps.stats()
    assert stats.pushes == 0 and getattr(stats.workers.get("old"), "pushes", 0) == 0
    assert old.pull(timeout=5)[0] == 0  # the new run
    assert all(old.push(0, {"a": np.ones(4), "b": np.ones(3)}).values())
    assert ps.step(LR, timeout=5) == 1
    np.testing.assert_allclose(ps.params["a"], -LR * np.ones(4))
    old.close()
    ps.close()


def test_a_worker_whose_accumulator_was_created_again_in_the_same_run_pulls_and_goes_on(target):
    """An accumulator of a running job deleted by hand, then created again by a restarted
    chief (resume: the same run): a worker's objects still name the deleted one, so its push
    is refused and it is told to pull; the pull opens them again, and it goes on."""
    ps = ParameterServer("fs", replicas_to_aggregate=1, client=target.client())
    model = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}
    ps.initialize(model)
    worker = Worker("fs", client=target.client(), worker_id="w")
    step, _ = worker.pull(timeout=5)
    grads = {"a": np.ones(4), "b": np.ones(3)}
    assert all(worker.push(step, grads).values())
    assert ps.step(LR, timeout=5) == 1
    ps.close()
    _admin.delete(target.redis(), ps.accumulator_names["a"])
    chief = ParameterServer("fs", replicas_to_aggregate=1, client=target.client())
    assert chief.initialize(model) == 1  # resumed: the bucket created again, at the step
    step, _ = worker.pull(after=0, timeout=5)
    with pytest.raises(accumulator.NotFoundError, match=r"pull\(\)"):
        worker.push(step, grads)
    assert worker.pull(timeout=5)[0] == 1  # the same run and step: opened again all the same
    assert all(worker.push(step, grads).values())
    assert chief.step(LR, timeout=5) == 2
    np.testing.assert_allclose(chief.params["a"], -2 * LR * np.ones(4))
    worker.close()
    chief.close()


def test_a_push_refused_in_part_keeps_what_went_in_and_is_not_applied_twice(target):
    """Of a push (no fusion: an accumulator per parameter) whose "a" was deleted by hand and
    created again by a resumed chief, "b" is accepted into the run's live round: the push
    again after the pull must apply "a" only ("b" was in the round twice: a found by a
    review)."""
    model = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}
    ps = ParameterServer("fp", replicas_to_aggregate=2, client=target.client(), fusion_bytes=0)
    ps.initialize(model)
    w1 = Worker("fp", client=target.client(), worker_id="w1")
    step, _ = w1.pull(timeout=5)
    ps.close()
    _admin.delete(target.redis(), ps.accumulator_names["a"])
    chief = ParameterServer("fp", replicas_to_aggregate=2, client=target.client(),
                            fusion_bytes=0)  # fmt: skip
    assert chief.initialize(model) == 0  # resumed: "a" created again
    w2 = Worker("fp", client=target.client(), worker_id="w2")
    assert w2.pull(timeout=5)[0] == 0
    with pytest.raises(accumulator.NotFoundError, match=r"b went into the job's rounds and are "
                                                        r"kept .*pull\(\)"):  # fmt: skip
        w1.push(step, {"a": np.full(4, 1.0), "b": np.full(3, 1.0)})
    assert chief._accs["b"].num_accumulated() == 1
    assert w1.pull(timeout=5)[0] == 0
    assert w1.push(step, {"a": np.full(4, 1.0), "b": np.full(3, 1.0)}) == {"a": True, "b": True}
    assert chief._accs["b"].num_accumulated() == 1  # not twice
    assert all(w2.push(step, {"a": np.full(4, 3.0), "b": np.full(3, 3.0)}).values())
    assert chief.step(LR, timeout=5) == 1
    np.testing.assert_allclose(chief.params["a"], -2 * LR * np.ones(4))
    np.testing.assert_allclose(chief.params["b"], -2 * LR * np.ones(3))
    counts = chief.stats().workers["w1"]
    assert (counts.pushes, counts.partial, counts.stale) == (1, 0, 0)  # one push, completed
    for closing in (w1, w2, chief):
        closing.close()
