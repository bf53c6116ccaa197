"""A private accumulator collected without close(): its keys are deleted by the reaper
thread, never on the thread the garbage collector happens to run on; and at exit, whatever
was handed to that thread is done before the interpreter goes."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import redis

import accumulator
from accumulator import _private, _reaper


def test_a_collected_private_accumulator_is_deleted_off_the_collecting_thread(
    target, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: list[int] = []
    real_run = _private.run

    def run(client, ops):  # type: ignore[no-untyped-def]
        where.append(threading.get_ident())
        return real_run(client, ops)

    monkeypatch.setattr(_private, "run", run)
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), client=target.client())
    acc.apply_grad(np.ones(3, np.float32))
    base = acc._keys.base
    assert list(target.redis().scan_iter(match=f"{base}*"))
    del acc
    gc.collect()
    assert _reaper.wait_idle(10)
    assert where and threading.get_ident() not in where
    assert not list(target.redis().scan_iter(match=f"{base}*"))


def test_a_reaper_job_that_fails_is_logged_and_the_next_one_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    done = threading.Event()

    def fails() -> None:
        raise OSError("unreachable")

    with caplog.at_level("DEBUG", logger="accumulator"):
        _reaper.submit(fails)
        _reaper.submit(done.set)
        assert _reaper.wait_idle(10) and done.is_set()
    assert any("clean-up of a collected accumulator failed" in r.message for r in caplog.records)


_AT_EXIT = """
import sys, time
import numpy as np
import accumulator
from accumulator import _reaper

url = sys.argv[1]
kept = accumulator.ConditionalAccumulator(np.float32, (3,), client=url)  # alive at exit
dropped = accumulator.ConditionalAccumulator(np.float32, (3,), client=url)
for acc in (kept, dropped):
    acc.apply_grad(np.ones(3, np.float32))
print(kept._keys.base, dropped._keys.base, flush=True)
_reaper.submit(time.sleep, 1.0)  # the reaper thread busy: the drop's job waits in the queue
del dropped
"""


@pytest.mark.real
def test_private_accumulators_are_deleted_at_exit(real_url: str) -> None:
    """One dropped just before the exit (its job still queued, behind a busy reaper thread),
    one alive at exit (weakref.finalize's exit hook collects it): both are gone once the
    process has ended."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_AT_EXIT), real_url],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    bases = proc.stdout.split()
    assert len(bases) == 2
    r = redis.Redis.from_url(real_url)
    for base in bases:
        assert not list(r.scan_iter(match=f"{base}*")), base


_FROZEN_AT_EXIT = """
import sys
import numpy as np
import accumulator

accs = [accumulator.ConditionalAccumulator(np.float32, (3,), client=sys.argv[1])
        for _ in range(int(sys.argv[2]))]  # private, alive at exit
for acc in accs:
    acc.apply_grad(np.ones(3, np.float32))
print("ready", flush=True)
sys.stdin.readline()  # the test freezes Redis, then lets the process end
"""


@pytest.mark.slow
@pytest.mark.real
def test_the_exit_waits_a_bounded_time_for_a_redis_that_does_not_answer() -> None:
    """Four private accumulators alive at exit, Redis frozen (a paused VM, a partition that
    drops packets): each deletion waited out the 30 s socket timeout, one after another
    (concurrency review: 60 s for four). The exit waits EXIT_WAIT in all; the keys are left
    to expire."""
    import os
    import signal
    import time

    from accumulator.testing import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server binary")
    with RedisServer(module=False) as server:
        command = [sys.executable, "-c", textwrap.dedent(_FROZEN_AT_EXIT), server.url, "4"]
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            started = time.monotonic()
            proc.communicate("go\n", timeout=60)
            took = time.monotonic() - started
        finally:
            if server.pid is not None:
                os.kill(server.pid, signal.SIGCONT)
            proc.kill()
        assert proc.returncode == 0
        assert took < _reaper.EXIT_WAIT + 10, f"the exit took {took:.1f}s"


def test_when_no_thread_can_start_the_work_is_done_on_the_submitting_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python 3.12+ refuses new threads once the interpreter is shutting down (a finalizer
    run by the exit hook, with no reaper thread started yet): the job runs inline, at once.
    (Run by hand on 3.12.1 and 3.13.0 on 2026-11-30: a private accumulator alive at exit, and
    one dropped behind a busy reaper, both deleted.)"""
    assert _reaper.wait_idle(10)

    def refuse() -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(_reaper, "_ensure_thread", refuse)
    where: list[int] = []
    _reaper.submit(lambda: where.append(threading.get_ident()))
    assert where == [threading.get_ident()]


_FINALIZE_BEFORE_IMPORT = """
import sys, weakref

class Thing:
    pass

thing = Thing()
weakref.finalize(thing, print)  # weakref's exit hook registered before the reaper's
import numpy as np
import accumulator

kept = accumulator.ConditionalAccumulator(np.float32, (3,), client=sys.argv[1])  # alive at exit
kept.apply_grad(np.ones(3, np.float32))
print(kept._keys.base, flush=True)
"""


@pytest.mark.real
def test_a_private_accumulator_alive_at_exit_is_deleted_whichever_exit_hook_runs_first(
    real_url: str,
) -> None:
    """Any weakref.finalize made before ``import accumulator`` (tempfile.TemporaryDirectory,
    many libraries) registers weakref's exit hook first: it then runs after the reaper's, and
    the finalizer's job is submitted while exiting. It must be waited for, not queued for a
    daemon thread the interpreter is about to stop."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FINALIZE_BEFORE_IMPORT),
                           real_url], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    base = proc.stdout.split()[0]
    assert not list(redis.Redis.from_url(real_url).scan_iter(match=f"{base}*")), base
