"""Network clean-up asked for by finalizers, done on a thread of its own.

A private accumulator that was never closed deletes its keys when it is collected. The
garbage collector runs a finalizer wherever it happens to run: in the middle of any
allocation of any thread, an event loop's included, or inside redis-py's pool on the thread
that holds its lock. Three round trips there (up to a socket timeout when Redis does not
answer; a blocking pool whose connections that thread holds waits out its whole timeout)
would stall that thread. A finalizer hands the work to this module instead; one daemon
thread does it, in order.

At exit, the work queued (and that of the finalizers ``weakref.finalize`` runs at exit) is
waited for, :data:`EXIT_WAIT` seconds in all: a daemon thread is stopped mid-work when the
interpreter ends, and a Redis that does not answer would otherwise hold the exit a socket
timeout per private accumulator (what is left expires). A forked child starts with an empty
queue: the parent's work is the parent's.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("accumulator")

_Job = tuple[Callable[..., Any], tuple[Any, ...]]

#: How long the exit waits for the reaper's work, in all, in seconds.
EXIT_WAIT = 5.0

_QUEUE: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # (put(): safe in a finalizer)
_STATE: dict[str, Any] = {"thread": None, "exiting": False, "deadline": 0.0}
_START = threading.Lock()


def submit(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on the reaper thread, soon; at exit, at once. Takes no lock another
    thread may hold (safe from a finalizer); errors are logged, never raised."""
    if _STATE["exiting"]:
        _wait_before_exit(fn, args)
        return
    _QUEUE.put((fn, args))
    try:
        _ensure_thread()
    except RuntimeError:  # no new thread (the interpreter is shutting down): done here
        _drain()


def wait_idle(timeout: float | None = None) -> bool:
    """Wait until the work submitted before this call is done; False if ``timeout`` passed
    first (for tests, and for callers that must see a collected accumulator's keys gone)."""
    done = threading.Event()
    submit(done.set)
    return done.wait(timeout)


def _ensure_thread() -> None:
    thread = _STATE["thread"]
    if thread is not None and thread.is_alive():
        return
    # (held by this very thread, a finalizer run inside _ensure_thread: the thread that
    # call starts takes this job too)
    if not _START.acquire(blocking=False):
        return
    try:
        thread = _STATE["thread"]
        if thread is None or not thread.is_alive():
            thread = threading.Thread(target=_work, name="accumulator-reaper", daemon=True)
            _STATE["thread"] = thread
            thread.start()
    finally:
        _START.release()


def _work() -> None:
    while True:
        job = _QUEUE.get()
        if job is None:
            return
        _run(*job)


def _run(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - clean-up is best effort (what it leaves expires)
        logger.debug("clean-up of a collected accumulator failed", exc_info=True)


def _at_exit() -> None:
    """Wait for the queued work, until the exit's deadline (:data:`EXIT_WAIT` from now);
    work submitted from now on is waited for until the same deadline."""
    _STATE["deadline"] = time.monotonic() + EXIT_WAIT
    _STATE["exiting"] = True
    _wait_before_exit(lambda: None, ())


def _wait_before_exit(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Queue ``fn(*args)`` behind the work queued, and wait for it until the deadline."""
    done = threading.Event()

    def job() -> None:
        try:
            _run(fn, args)
        finally:
            done.set()

    _QUEUE.put((job, ()))
    try:
        _ensure_thread()
    except RuntimeError:  # no new thread at this stage of the shutdown: done here
        _drain()
        return
    done.wait(max(0.0, _STATE["deadline"] - time.monotonic()))


def _drain() -> None:
    """Run the queued jobs on this thread."""
    while True:
        try:
            job = _QUEUE.get_nowait()
        except queue.Empty:
            return
        if job is not None:
            _run(*job)


def _after_fork_in_child() -> None:
    global _QUEUE, _START
    _QUEUE, _START = queue.SimpleQueue(), threading.Lock()
    _STATE["thread"] = None


# (registered before or after weakref.finalize's own exit hook, which runs the finalizers left
# at exit: before, they queue their work and this hook, run after, does it; after, this hook
# runs first and they do theirs at once)
atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
