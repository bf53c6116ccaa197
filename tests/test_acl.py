"""The three roles of the README's "Security" section, as real ACL users on a real server:
each runs what it is for with exactly those rights, and a missing right fails before the
first write, naming the command."""

from __future__ import annotations

import io
import re
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pytest
import redis
from _helpers import connect, take_script

import accumulator
from accumulator import _acl, _cli
from accumulator.sync import ParameterServer, Worker

README = Path(__file__).resolve().parent.parent / "README.md"
SHAPE = (3, 2)


def user_url(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))


@pytest.fixture
def acl(real):
    """make(role, rules=None) -> URL of a fresh user with that role's rules (or the given)."""
    admin = real.redis()
    made: list[str] = []
    # on a cluster: every node has the user, with what a cluster client also needs
    every: dict = {"target_nodes": "all"} if real.kind == "cluster" else {}
    extra = f" {_acl.CLUSTER_RULES}" if real.kind == "cluster" else ""

    def make(role: str, rules: str | None = None) -> str:
        name = f"test-{role}-{len(made)}"
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw",
                              *((rules or _acl.ROLES[role]) + extra).split(), **every)  # fmt: skip
        made.append(name)
        return user_url(real.url, name, "pw")

    yield make
    for name in made:
        admin.execute_command("ACL", "DELUSER", name, **every)


def test_readme_shows_the_exact_rules():
    text = README.read_text()
    for role in _acl.ROLES:
        assert _acl.setuser_command(role) in text, role


def test_worker_role_runs_dense_sparse_and_private_accumulators(acl):
    url = acl("worker")
    w = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="w", client=url)
    chief = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="w", client=url)
    chief.wait_slice = 0.2
    big = accumulator.ConditionalAccumulator(np.float32, (64, 1024), shared_name="big",
                                             client=url)  # fmt: skip
    result: list[np.ndarray] = []
    taker = threading.Thread(target=lambda: result.append(chief.take_grad(2, timeout=10)))
    taker.start()
    assert w.apply_grad(np.ones(SHAPE)) and w.apply_grad(np.full(SHAPE, 3.0))
    taker.join(10)
    np.testing.assert_array_equal(result[0], np.full(SHAPE, 2.0))
    assert w.apply_grad(np.ones(SHAPE), local_step=0) is False
    w.set_global_step(5)
    big.apply_grad(np.ones((64, 1024)))
    assert big.take_grad(1).sum() == 64 * 1024
    s = accumulator.SparseConditionalAccumulator(np.float32, (10, 2), shared_name="s", client=url)
    s.apply_grad([1, 2], np.ones((2, 2)))
    assert s.take_grad(1).indices.tolist() == [1, 2]
    private = accumulator.ConditionalAccumulator(np.float32, SHAPE, client=url)
    private.apply_grad(np.ones(SHAPE))
    private.close()  # deletes its keys (found by what names them: no SCAN)


def test_a_role_scoped_to_a_container_keeps_teams_apart(acl, real):
    """One server, two teams: each role narrowed to its team's container (the README's
    rule for it) runs there, and is refused on the other team's accumulators before any
    write (security review: the README pointed at a key prefix no class takes)."""
    url = acl("worker", _acl.scoped_rules("worker", "team:A"))
    mine = {"client": url, "container": "team:A"}
    acc = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="w", **mine)
    big = accumulator.ConditionalAccumulator(np.float32, (64, 1024), shared_name="b", **mine)
    sparse = accumulator.SparseConditionalAccumulator(np.float32, (10, 2), shared_name="s",
                                                      **mine)  # fmt: skip
    private = accumulator.ConditionalAccumulator(np.float32, SHAPE, **mine)
    for one, grad in ((acc, np.ones(SHAPE)), (big, np.ones((64, 1024))),
                      (private, np.ones(SHAPE))):  # fmt: skip
        assert one.apply_grad(grad)
        np.testing.assert_array_equal(one.take_grad(1, timeout=5), grad)
    sparse.apply_grad([1, 2], np.ones((2, 2)))
    assert sparse.take_grad(1, timeout=5).indices.tolist() == [1, 2]
    private.close()
    admin = real.redis()
    theirs = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="w",
                                                client=real.url, container="team:B")  # fmt: skip
    theirs.apply_grad(np.ones(SHAPE))
    before = sorted(admin.scan_iter(match="acc:{team%3AB:*"))
    with pytest.raises(accumulator.PermissionDeniedError):
        accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="w", client=url,
                                           container="team:B")  # fmt: skip
    with pytest.raises(accumulator.PermissionDeniedError):
        accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="new", client=url,
                                           container="team:B")  # fmt: skip
    with pytest.raises(accumulator.PermissionDeniedError):  # (a container that begins alike)
        accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="w", client=url,
                                           container="team:AB")  # fmt: skip
    assert sorted(admin.scan_iter(match="acc:{team%3AB:*")) == before
    assert theirs.num_accumulated() == 1
    # the viewer, scoped, lists its own container
    viewer = acl("viewer", _acl.scoped_rules("viewer", "team:A"))
    out = io.StringIO()
    assert _cli.main(["ls", "--container", "team:A", "--url", viewer], stdout=out) == 0
    assert sorted(line.split()[0] for line in out.getvalue().splitlines()[1:4]) == ["b", "s", "w"]
    for one in (acc, big, sparse, theirs):
        one.close()


def test_a_client_without_info_does_not_silence_the_eviction_warning(acl, real, caplog):
    """The worker role may not run INFO, so it cannot tell the server's eviction policy;
    it marked the server checked all the same, and no later client of the process was
    warned (security review)."""
    admin = real.redis()
    admin.config_set("maxmemory-policy", "allkeys-lru", **({"target_nodes": "all"}
                     if real.kind == "cluster" else {}))  # fmt: skip
    accumulator._model._policy_checked.clear()
    try:
        accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="e",
                                           client=acl("worker")).close()  # fmt: skip
        assert "maxmemory-policy" not in caplog.text  # (it cannot tell)
        accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="e",
                                           client=real.url).close()  # fmt: skip
        assert "maxmemory-policy is 'allkeys-lru'" in caplog.text
    finally:
        admin.config_set("maxmemory-policy", "noeviction", **({"target_nodes": "all"}
                         if real.kind == "cluster" else {}))  # fmt: skip
        accumulator._model._policy_checked.clear()


def test_readme_shows_a_container_scoped_role():
    assert _acl.setuser_command("worker", container="teamA") in README.read_text()


def test_viewer_role_runs_the_read_only_cli(acl, real):
    acc = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="v", client=real.url)
    acc.apply_grad(np.ones(SHAPE))
    url = acl("viewer")
    for argv in (["ls"], ["ls", "--json"], ["show", "v"], ["watch", "v", "-n", "1"]):
        out, err = io.StringIO(), io.StringIO()
        code = _cli.main(["--url", url, *argv], stdout=out, stderr=err)
        assert code == 0, (argv, err.getvalue())
        assert "v" in out.getvalue()
    # and nothing more: a write is refused
    out, err = io.StringIO(), io.StringIO()
    assert _cli.main(["--url", url, "reset", "v", "--yes"], stdout=out, stderr=err) != 0
    assert acc.num_accumulated() == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        connect(url).set("acc:{:v}:s", "x")


def test_sync_role_runs_a_job(acl):
    url = acl("sync")
    params = {"w": np.zeros(SHAPE), "emb": np.zeros((10, 2))}
    ps = ParameterServer("job", replicas_to_aggregate=1, sparse={"emb"}, client=url)
    ps.initialize(params)
    worker = Worker("job", client=url)
    step, _ = worker.pull(timeout=10)
    for i in range(3):
        assert all(worker.push(step, {"w": np.ones(SHAPE), "emb": ([1], np.ones((1, 2)))}).values())
        ps.step(0.5, timeout=10, final=i == 2)
        if i < 2:
            step, pulled = worker.pull(after=step, timeout=10)
    np.testing.assert_allclose(ps.params["w"], np.full(SHAPE, -1.5))
    assert ps.stats().step == 3
    worker.close()
    ps.delete()
    ps.close()


def _without(role: str, command: str) -> str:
    return re.sub(rf" \+{re.escape(command)}(?= |$)", "", _acl.ROLES[role]) + f" -{command}"


@pytest.mark.parametrize("command", ["publish", "rename", "mget", "unlink", "hdel"])
def test_a_take_missing_a_permission_fails_before_claiming(acl, real, command):
    acc = accumulator.ConditionalAccumulator(np.float32, (64, 1024), shared_name="p",
                                             client=real.url)  # fmt: skip
    acc.apply_grad(np.ones((64, 1024)))
    url = acl("worker", _without("worker", command))
    chief = accumulator.ConditionalAccumulator(np.float32, (64, 1024), shared_name="p", client=url)
    with pytest.raises(accumulator.PermissionDeniedError, match=command.upper()):
        chief.take_grad(1, timeout=5)
    assert (acc.global_step(), acc.num_accumulated()) == (0, 1)
    info = accumulator._admin.describe(real.redis(), "p")
    assert info.claims == () and info.takers_waiting == 0
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones((64, 1024)))


@pytest.mark.parametrize("shape", [SHAPE, (64, 1024)], ids=["inline", "payload key"])
@pytest.mark.parametrize("command", ["rpush", "hincrby", "persist", "ltrim", "strlen", "lrange",
                                     "zcard"])  # fmt: skip
def test_an_apply_missing_a_permission_fails_before_writing(acl, real, command, shape):
    """Refused before its first write, naming the command (also a read the script makes
    before its permission checks); a payload the apply had stored is deleted with it (a
    retrying worker would pile one up per try)."""
    acc = accumulator.ConditionalAccumulator(np.float32, shape, shared_name="p", client=real.url)
    worker = accumulator.ConditionalAccumulator(
        np.float32, shape, shared_name="p", client=acl("worker", _without("worker", command))
    )
    r = real.redis()
    if shape == SHAPE and command in ("persist", "strlen", "lrange", "zcard"):
        # a small gradient's apply runs none of these (payload keys, type probes): it goes on
        assert worker.apply_grad(np.ones(shape)) and acc.num_accumulated() == 1
        np.testing.assert_array_equal(acc.take_grad(1), np.ones(shape))
        return
    before = {k: r.type(k) for k in r.scan_iter("acc:*")}
    state = r.hgetall(acc._keys.state)
    with pytest.raises(accumulator.PermissionDeniedError, match=command.upper()):
        worker.apply_grad(np.ones(shape))
    after = {k: r.type(k) for k in r.scan_iter("acc:*")}
    if after != before:  # parts in other slots, written: garbage, due now
        garbage = r.zrange(acc._keys.orphans, 0, -1)
        assert acc.spreads_parts and garbage and all(m.startswith(b"x") for m in garbage)
    assert r.hgetall(acc._keys.state) == state
    # the same apply, retried once allowed, counts once: the refusal left no dedup record
    assert acc.apply_grad(np.ones(shape)) and acc.num_accumulated() == 1
    acc.take_grad(1)
    assert not [k for k in r.scan_iter("acc:*") if b":b:" in k]  # no payload left anywhere


@pytest.mark.parametrize("command", ["hget", "hmget"])
def test_opening_without_a_read_it_needs_names_it(acl, real, command):
    accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="o", client=real.url)
    url = acl("worker", _without("worker", command))
    with pytest.raises(accumulator.PermissionDeniedError, match=rf"may not run {command.upper()}"):
        accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="o", client=url)


def test_deleting_without_transactions_deletes_nothing(acl, real):
    """redis-py sends a transaction's MULTI and commands in one go: a user refused MULTI
    would have the deletes run one by one, outside it, and only EXEC fail."""
    r = real.redis()
    for name in ("a", "b"):
        acc = accumulator.ConditionalAccumulator(np.float32, (64, 1024), shared_name=name,
                                                 client=real.url)  # fmt: skip
        acc.apply_grad(np.ones((64, 1024)))
    before = sorted(r.scan_iter("acc:*"))
    worker = acl("worker")  # applies and takes: no MULTI
    for delete in (lambda: accumulator.reset_container("", client=worker),
                   lambda: accumulator.delete_accumulator("a", client=worker)):  # fmt: skip
        # (reset_container lists the container first: a worker may not SCAN either)
        with pytest.raises(accumulator.PermissionDeniedError, match="(?i)multi|scan"):
            delete()
        assert sorted(r.scan_iter("acc:*")) == before
    out, err = io.StringIO(), io.StringIO()
    assert _cli.main(["--url", worker, "delete", "a", "--yes"], stdout=out, stderr=err) == 4
    assert "multi" in err.getvalue().lower() and sorted(r.scan_iter("acc:*")) == before
    viewer = acl("viewer")  # transactions, but no deletes: refused as ours, not redis-py's
    with pytest.raises(accumulator.PermissionDeniedError, match="(?i)unlink|evalsha"):
        accumulator.delete_accumulator("a", client=viewer)
    assert sorted(r.scan_iter("acc:*")) == before
    # transactions and deletes, but no scripts: the purge script (run after the first
    # deletes) is refused before them (it deleted, then reported: CLI review)
    rules = re.sub(r" \+eval(?= |$)", "", _without("sync", "evalsha")) + " -eval"
    no_scripts = acl("sync", rules)
    for delete in (lambda: accumulator.reset_container("", client=no_scripts),
                   lambda: accumulator.delete_accumulator("a", client=no_scripts)):  # fmt: skip
        with pytest.raises(accumulator.PermissionDeniedError, match="(?i)eval"):
            delete()
        assert sorted(r.scan_iter("acc:*")) == before


def test_the_sync_helper_without_its_keys_is_refused_as_ours(acl):
    url = acl("worker")  # no accsync:* keys
    with pytest.raises(accumulator.PermissionDeniedError, match="accsync"):
        ParameterServer("job", replicas_to_aggregate=1, client=url).initialize(
            {"w": np.zeros(2, np.float32)}
        )
    with pytest.raises(accumulator.PermissionDeniedError, match="accsync"):
        Worker("job", client=url).pull(timeout=1)


def test_script_load_refused_is_fine_while_the_scripts_are_loaded(acl, real):
    accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="l", client=real.url)
    rules = _without("worker", "script|load").replace(" +eval ", " ")
    url = acl("worker", rules)
    acc = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="l", client=url)
    assert acc.apply_grad(np.ones(SHAPE))
    real.redis().script_flush()
    with pytest.raises(accumulator.PermissionDeniedError):
        acc.apply_grad(np.ones(SHAPE))
    # with EVAL allowed, an empty script cache is no problem either
    acc2 = accumulator.ConditionalAccumulator(
        np.float32, SHAPE, shared_name="l", client=acl("worker", _without("worker", "script|load"))
    )
    real.redis().script_flush()
    assert acc2.apply_grad(np.ones(SHAPE)) and acc2.num_accumulated() == 2


def test_worker_role_takes_again_and_takes_over_a_dead_takers_round(acl):
    url = acl("worker")
    acc = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="again", client=url)
    for step in range(3):  # every take after the first reads the claim registry
        assert acc.apply_grad(np.full(SHAPE, float(step)), local_step=step)
        np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(SHAPE, float(step)))

    acc.apply_grad(np.ones(SHAPE), local_step=3)
    # a claim whose lease is over at once: its taker is gone
    assert take_script(acc, "7-dead", 1, 10_000, claim_ms=0)[0] == 1
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(SHAPE))
    assert acc.global_step() == 4


def test_cli_names_a_missing_permission(acl, real):
    acc = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="v", client=real.url)
    acc.apply_grad(np.ones(SHAPE))
    url = acl("viewer")
    out, err = io.StringIO(), io.StringIO()
    code = _cli.main(["--url", url, "evict", "v", "1-abc", "--yes"], stdout=out, stderr=err)
    assert code == 4
    assert "lacks a permission" in err.getvalue() and "Security" in err.getvalue()
    assert "pipeline" not in err.getvalue()


def test_min_replicas_needs_wait_and_says_so(acl, real):
    """The roles do not include WAIT: an accumulator asking for min_replicas with one of them
    is refused when it opens, naming the missing right (not "the server cannot")."""
    with pytest.raises(accumulator.PermissionDeniedError, match="wait"):
        accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="d",
                                           client=acl("worker"), min_replicas=1)  # fmt: skip
    durable = acl("worker", _acl.ROLES["worker"] + " +wait")
    acc = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="d", client=durable,
                                             min_replicas=0)  # fmt: skip
    acc.close()
    with_wait = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="d",
                                                   client=durable, min_replicas=1)  # fmt: skip
    with_wait.durability_timeout = 0.2
    if real.kind == "cluster":  # every primary has a replica there: confirmed
        assert with_wait.apply_grad(np.ones(SHAPE))
    else:
        with pytest.raises(accumulator.NotDurableError):  # no replica: opened, not confirmed
            with_wait.apply_grad(np.ones(SHAPE))
    with_wait.close()


def test_a_user_allowed_pexpire_on_some_keys_only_is_refused_before_any_write(acl, real):
    """An ACL selector may grant PEXPIRE on some of the accumulator's keys only: every script
    checks it on each key it renews (a private accumulator's expiry) before its first write.
    Before, a large apply was counted, then failed on the round list's expiry, and a take
    joined the queue, then failed (found by a review)."""
    if real.kind == "cluster":
        pytest.skip("(the selector's key patterns are written for one server)")
    rules = _without("worker", "pexpire") + " (+pexpire ~acc:*:s ~acc:*:d:* ~acc:*:c:* ~acc:*:b:*)"
    url = acl("worker", rules)
    r = real.redis()
    for shape in (SHAPE, (64, 1024)):
        acc = accumulator.ConditionalAccumulator(np.float32, shape, client=url)  # private
        before = {k: r.dump(k) for k in r.scan_iter(f"{acc._keys.base}*".replace("{", "[{]"))}
        with pytest.raises(accumulator.PermissionDeniedError, match="PEXPIRE"):
            acc.apply_grad(np.ones(shape))
        with pytest.raises(accumulator.PermissionDeniedError, match="PEXPIRE"):
            acc.take_grad(1, timeout=1)
        after = {k: r.dump(k) for k in r.scan_iter(f"{acc._keys.base}*".replace("{", "[{]"))}
        assert after.keys() == before.keys()
        assert r.hget(acc._keys.state, "count") == b"0" and not r.exists(acc._keys.takers)
        acc.close()


def test_a_reset_without_the_sweeps_permissions_resets_and_says_what_it_left(acl, real, caplog):
    """A reset whose follow-up sweep of spread payloads is refused (no TIME, no ZREM) has
    dropped the round all the same: it returns, with a warning, instead of raising "nothing
    was changed" (found by a review)."""
    acc = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="rz", client=real.url)
    acc.apply_grad(np.ones(SHAPE))
    acc.apply_grad(np.ones(SHAPE))
    url = acl("worker", re.sub(r" \+(time|zrem)(?= |$)", "", _acl.ROLES["worker"]) + " -time -zrem")
    r = connect(url)
    with caplog.at_level("WARNING", logger="accumulator"):
        assert accumulator._admin.reset(r, "rz") == 2
    assert "not swept" in caplog.text
    assert acc.num_accumulated() == 0 and real.redis().llen(acc._keys.grads) == 0


def test_a_taker_refused_blpop_gets_our_error(acl, real):
    acc = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="bl", client=real.url)
    url = acl("worker", _without("worker", "blpop"))
    chief = accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="bl", client=url)
    with pytest.raises(accumulator.PermissionDeniedError, match="BLPOP|blpop"):
        chief.take_grad(1, timeout=3)
    acc.apply_grad(np.ones(SHAPE))
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.ones(SHAPE))


def test_a_late_copy_under_the_worker_role_drops_what_no_round_holds(acl, real):
    """A late copy of an older apply whose round was taken since: its SET NX wrote the parts
    again, and the script drops them when no round holds them. It read the claims with HKEYS,
    which the worker role lacks: every copy was taken as held, its parts left behind (for an
    hour; spread parts for good; a review)."""
    from accumulator._requests import Batch

    acc = accumulator.ConditionalAccumulator(np.float32, (64, 1024), shared_name="lc",
                                             client=acl("worker"))  # fmt: skip
    if acc.spreads_parts:
        pytest.skip("spread over slots: the parts go apart from the apply's batch")
    do, copies = acc._do, []

    def sent_twice(request):
        if isinstance(request, Batch) and request.what == "apply_grad" and not copies:
            copies.append(request)
        return do(request)

    acc._do = sent_twice
    acc.apply_grad(np.ones((64, 1024)))
    acc.take_grad(1, timeout=5)  # (its round is taken: nothing holds those parts)
    acc.apply_grad(np.ones((64, 1024)), local_step=1)  # a later apply of the client
    late = do(copies.pop())[-1]
    assert late[0] == 0 and late[3] == 1  # an old retry, not counted
    blob = acc._keys.blob(acc._identities.client_ids[0], 1)
    assert real.redis().exists(acc._keys.part(blob, 0)) == 0  # dropped, not left an hour
    acc.close()
