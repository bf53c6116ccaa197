"""The retry layer and the running of steps side by side, at their edges: a login refused
on a retry, the backoff's cap, transient faults among a cluster pipeline's replies, the
errors that break a wait, slots a failover has not served yet, giving up when closed, calls
of another retry window, the transactions probe at maxmemory. From the second
mutation-testing pass (see test_sync_edges.py); no server needed."""

from __future__ import annotations

import time

import pytest
import redis

import accumulator


def test_a_login_refused_after_a_failure_midway_is_unavailable_not_refused():
    """T02: a login refused when an operation is retried after a transient fault is
    UnavailableError (the first try's outcome is unknown: an apply may have counted), not the
    PermissionDeniedError of a login refused at the first try (which would drop what that
    try sent)."""
    from accumulator import _retry

    tries = []

    def fn():
        tries.append(1)
        if len(tries) == 1:
            raise redis.ConnectionError("Connection reset by peer (simulated)")
        raise redis.AuthenticationError("WRONGPASS (simulated)")

    with pytest.raises(accumulator.UnavailableError, match="refused the login when retried"):
        _retry.call(fn, "an apply", window=5)
    assert len(tries) == 2

    def refused():
        raise redis.AuthenticationError("WRONGPASS (simulated)")

    with pytest.raises(accumulator.PermissionDeniedError):
        _retry.call(refused, "an apply", window=5)


def test_the_backoff_between_retries_is_capped():
    """T04: the pause between two tries doubles up to a second, never more: a server back
    after a restart is found within a second, however long it was away."""
    from accumulator import _retry

    backoff = _retry.Backoff(window=1000.0)
    waits = [backoff.next_delay(0.0) for _ in range(20)]
    assert all(w is not None and 0 < w <= _retry._MAX_DELAY for w in waits)
    assert max(waits) > _retry._MAX_DELAY / 2  # it did grow to the cap


@pytest.mark.parametrize(
    "fault",
    [
        redis.TimeoutError("Timeout reading from socket (simulated)"),
        redis.exceptions.ClusterDownError("CLUSTERDOWN (simulated)"),
        redis.exceptions.TryAgainError("TRYAGAIN (simulated)"),
    ],
    ids=["timeout", "clusterdown", "tryagain"],
)
def test_a_batch_with_any_transient_fault_among_its_replies_fails_whole(fault):
    """T05: redis-py's cluster pipeline hands a node's fault back as the reply of each of
    its commands; any transient one (a timeout, CLUSTERDOWN, TRYAGAIN, not only a lost
    connection) fails the batch whole, to be sent again; a refusal stays a reply."""
    from accumulator import _retry

    with pytest.raises(type(fault)):
        _retry.raise_transient([b"OK", redis.ResponseError("WRONGTYPE (simulated)"), fault])
    _retry.raise_transient([b"OK", redis.ResponseError("WRONGTYPE (simulated)")])


def test_our_errors_never_break_a_wait():
    """T06: a blocking wait that raised one of our errors (PermissionDeniedError is an
    OSError, as Python's PermissionError) raises it; a fault of its connection, or the
    server's UNBLOCKED, makes the taker re-check instead."""
    from accumulator import _retry

    assert not _retry.breaks_wait(accumulator.PermissionDeniedError("NOPERM (simulated)"))
    assert _retry.breaks_wait(redis.ConnectionError("Connection reset (simulated)"))
    assert _retry.breaks_wait(redis.ResponseError("UNBLOCKED the client was unblocked"))


def test_slots_not_all_served_yet_by_a_failover_are_retried():
    """T07: a cluster client that found the slots not all covered (a failover in progress)
    gets a transient ConnectionError, retried in the window (not redis-py's exception,
    raised at once)."""
    from redis.exceptions import RedisClusterException

    from accumulator import _retry

    exc = RedisClusterException("All slots are not covered after query all startup_nodes.")
    ours = _retry.cluster_error(exc)
    assert _retry.is_transient(ours) and ours.__cause__ is exc


def test_a_retry_window_gives_up_when_asked():
    """T08: ``give_up()`` (the accumulator was closed) ends the retrying at the next fault:
    UnavailableError at once, not after the whole window."""
    from accumulator import _retry

    def down():
        raise redis.ConnectionError("Connection refused (simulated)")

    started = time.monotonic()
    with pytest.raises(accumulator.UnavailableError, match="given up: closed"):
        _retry.call(down, "a take", window=30, give_up=lambda: True)
    assert time.monotonic() - started < 5


def test_calls_of_another_retry_window_go_in_a_pipeline_of_their_own(monkeypatch):
    """A01: script calls share a pipeline only with calls of the same retry window: a call
    of one try (a taker's withdrawal after an outage) is not retried with the others, and
    they are not cut to its one try."""
    from accumulator import _together
    from accumulator._requests import Call

    windows: list[float | None] = []

    class Conns:
        commands = object()

    class Acc:
        _conns = Conns()

        def _io(self, what, fn, window=None):
            windows.append(window)
            return fn()

    monkeypatch.setattr(_together, "_pipelined", lambda acc, calls: [(c.name, None) for c in calls])
    acc = Acc()
    calls = {0: Call("an apply", "apply", [], []), 1: Call("a withdrawal", "withdraw", [], [],
             window=0), 2: Call("an apply", "apply", [], [])}  # fmt: skip
    replies = _together._calls([(acc, None)] * 3, calls)
    assert replies == {0: ("apply", None), 1: ("withdraw", None), 2: ("apply", None)}
    assert sorted(windows, key=str) == [0, None]


def test_the_transactions_probe_passes_at_maxmemory():
    """N03: at maxmemory Redis refuses every command queued in a transaction, the probe's
    read too: MULTI passed the ACL (checked first), so the user may run transactions (a
    chief's initialize at maxmemory must not fail on the probe)."""
    from redis.exceptions import OutOfMemoryError

    from accumulator import _connection

    class Pipe:
        def exists(self, key):
            pass

        def execute(self):
            raise OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'")

    class Client:
        def pipeline(self, transaction):
            assert transaction
            return Pipe()

    _connection.require_transactions(Client(), "accsync:{job}:p")
