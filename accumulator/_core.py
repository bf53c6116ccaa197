"""The synchronous accumulator: :class:`AccumulatorBase`, the driver that runs the shared
protocol (``_model``, ``_take``: generators of ``_requests``) against redis-py, with
retries through transient faults, and blocking waits that ``close()`` can break from another
thread. Kind-specific code (validation, payload layout, reduction) lives in
``_dense``/``_sparse``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from inspect import GEN_CLOSED, getgeneratorstate
from typing import Any, TypeVar, cast

import redis
from redis.client import PubSub
from redis.exceptions import NoScriptError, ResponseError

from . import _forks, _private, _reaper, _retry, _scripts, _take
from ._cluster_batch import by_node_batch, each, is_script, on_node, per_node
from ._connection import CLOSE_GRACE, CLUSTER_WAIT_SLICE, Client, connect, drop_idle, interrupted
from ._direct import execute_batch, pooled
from ._errors import CancelledError
from ._identities import Identities
from ._keys import SCHEMA_VERSION, Keys
from ._model import AccumulatorModel, server_of
from ._requests import (
    Batch,
    Call,
    Command,
    Listen,
    Ops,
    Pop,
    Receive,
    ReceiveAll,
    Request,
    Subscribe,
    Unsubscribe,
    advance,
)
from ._routing import is_cluster, is_redirect, moved_error
from ._shares import Connections
from ._wire import get_all_into, get_into

logger = logging.getLogger("accumulator")

_A = TypeVar("_A", bound="AccumulatorBase")
_T = TypeVar("_T")


def leave(client: redis.Redis, keys: Keys, taker: str, schema: int = SCHEMA_VERSION) -> int:
    """Run ``lua/leave.lua`` for one taker (see ``_take.leave_call``): 0 (it held no
    claim), 1 (given back) or -1 (the accumulator moved on)."""
    call = _take.leave_call(keys, taker, schema)
    return int(_scripts.call(client, call.name, call.keys, call.args))


def _let_go(
    conns: Connections, private: tuple[Keys, Identities, int] | None, *, collected: bool = False
) -> None:
    """Release an accumulator's share of the connections, a private one's keys deleted
    first: at close(), or (``collected``) from its finalizer, wherever the garbage collector
    runs it."""
    try:
        if private is not None:
            keys, identities, pid = private
            if os.getpid() == pid:  # (a forked child's copy: its creator's keys stay)
                _private.run(conns.commands,
                             _private.delete_ops(keys, list(identities.client_ids)))  # fmt: skip
    except Exception:  # noqa: BLE001 - best effort at close/finalize time (the keys expire)
        base = private[0].base if private is not None else "?"
        logger.debug("could not delete private accumulator %s", base, exc_info=True)
    finally:
        if collected:
            conns.close_collected()
        else:
            conns.close()


def _collected(conns: Connections, private: tuple[Keys, Identities, int] | None) -> None:
    """An accumulator's finalizer: its share of the connections released where the
    collector runs (no I/O); a private one's keys deleted by the reaper thread, which then
    releases the share (network I/O in a finalizer would stall whatever thread collects)."""
    if private is None:
        _let_go(conns, None, collected=True)
    else:
        _reaper.submit(_let_go, conns, private)


class AccumulatorBase(AccumulatorModel):
    """Common state and operations of :class:`ConditionalAccumulator` and
    :class:`SparseConditionalAccumulator` (for ``isinstance``); not instantiated directly."""

    def __init__(
        self,
        dtype: Any,
        shape: Any,
        shared_name: str | None,
        name: str | None,
        reduction_type: str,
        *,
        client: Client = None,
        container: str = "",
        max_pending_bytes: int | None = None,
        min_replicas: int = 0,
        wait_aof: bool = False,
        sum_in_redis: bool | None = None,
        spread_parts: bool | None = None,
        retry_window: float | None = None,
    ) -> None:
        self._setup(dtype, shape, shared_name, name, reduction_type, container,
                    max_pending_bytes, sum_in_redis, min_replicas, wait_aof,
                    spread_parts, retry_window)  # fmt: skip
        self._conns = connect(client, self.retry_window)
        self._cluster = is_cluster(self._conns.commands)
        # connections of waits in progress: close() from another thread breaks them (the
        # pools are shared with other accumulators and stay open)
        self._waits: set[Any] = set()
        self._waits_lock = threading.Lock()
        self._forks_seen = _forks.COUNT[0]  # (see _after_fork)
        # operations in flight, by thread: close() gives the other threads' time to end
        self._drives: dict[int, int] = {}
        try:
            self._run(self._open_ops(server_of(self._conns.commands), self._cluster))
        except BaseException:
            self._conns.close()  # its share of the pools
            raise
        private = (self._keys, self._identities, self._pid) if self._private else None
        self._finalizer = weakref.finalize(self, _collected, self._conns, private)

    @property
    def redis(self) -> redis.Redis:
        """The client this accumulator sends its commands through."""
        return self._conns.commands

    def close(self) -> None:
        """Release connections; a private accumulator's keys are deleted. A take waiting in
        another thread raises :class:`CancelledError`. Operations in flight in other threads
        are given up to :data:`~accumulator._connection.CLOSE_GRACE` seconds to end first (a
        cut take withdraws from the queue of takers, so that the next take does not wait for
        its lease to run out; a script's reply on its way is received, not cut off)."""
        self._closed = True
        cut: set[int] = set()
        deadline = time.monotonic() + CLOSE_GRACE
        while True:
            # (cut again while waiting: a wait may have begun just as the flag was set)
            self._cut_waits(cut)
            if not self._others_driving() or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if self._others_driving():
            logger.warning("closing %r with an operation still running after %gs",
                           self._shared_name, CLOSE_GRACE)  # fmt: skip
        detached = self._finalizer.detach()
        if detached is not None:  # (not closed before)
            _let_go(*detached[2])

    def _after_fork(self) -> None:
        """In a child forked from the process that used this object, the parent's operations
        in flight (its threads, which the child does not have) and waits are not the
        child's: a close() there waited CLOSE_GRACE for them to end (concurrency review), and
        the lock may have been held by one of them at the fork. Starts them afresh."""
        if self._forks_seen != _forks.COUNT[0]:
            self._forks_seen = _forks.COUNT[0]
            self._waits_lock = threading.Lock()
            self._waits = set()
            self._drives = {}

    def _cut_waits(self, cut: set[int]) -> None:
        """Break the waits in progress not cut yet (their ids in ``cut``)."""
        self._after_fork()
        with self._waits_lock:
            waits = [wait for wait in self._waits if id(wait) not in cut]
        for wait in waits:
            cut.add(id(wait))
            conn = wait.connection if isinstance(wait, PubSub) else wait
            try:
                if conn is not None:
                    conn.disconnect()
            except Exception:  # noqa: BLE001 - fakeredis's socket refuses a second thread
                logger.debug("could not cut a wait of %s", self._keys.base, exc_info=True)

    def _drive_begins(self) -> int:
        """Counts an operation in flight in this thread (see :meth:`close`); its id."""
        me = threading.get_ident()
        self._after_fork()
        with self._waits_lock:
            self._drives[me] = self._drives.get(me, 0) + 1
        return me

    def _drive_ends(self, me: int) -> None:
        with self._waits_lock:
            if self._drives.get(me, 0) > 1:
                self._drives[me] -= 1
            else:
                self._drives.pop(me, None)  # (begun before a fork: not counted here)

    @contextlib.contextmanager
    def _driving(self) -> Iterator[None]:
        """An operation in flight in this thread while the block runs (see :meth:`close`)."""
        me = self._drive_begins()
        try:
            yield
        finally:
            self._drive_ends(me)

    def _others_driving(self) -> bool:
        """Whether an operation is in flight in another thread than this one (a close() in
        the middle of an operation of its own thread, a signal handler's, waits for none)."""
        me = threading.get_ident()
        self._after_fork()
        with self._waits_lock:
            return any(thread != me for thread in self._drives)

    def __enter__(self: _A) -> _A:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def num_accumulated(self, name: str | None = None) -> int:
        """Number of gradients accepted since the last successful take."""
        return self._run(self._count_ops())

    def global_step(self) -> int:
        """The accumulator's current global step (TF has no way to read it)."""
        return self._run(self._step_ops())

    def set_global_step(self, new_global_step: Any, name: str | None = None) -> None:
        """Set the global step, also downwards (with a warning); never clears the round."""
        self._run(self._set_step_ops(new_global_step))

    def _take_script_args(self, taker: str, n: int, lease_ms: int) -> tuple[list[Any], list[Any]]:
        """KEYS and ARGV of the take script (see lua/take.lua)."""
        return _take.take_script_args(self, taker, n, lease_ms)

    # -- the driver ---------------------------------------------------------------------------

    def _run(self, ops: Ops[_T], error: BaseException | None = None) -> _T:
        """Run a protocol step to its end: each request is done here and its reply (or its
        exception) handed back. ``error``: thrown into the step first (it was interrupted
        while another driver ran it, :mod:`._together`)."""
        if error is None:  # a closed object (or one holding an interrupt) says so first,
            self._check_open()  # before any check of the input, as the asyncio twin does
        reply: Any = None
        me = self._drive_begins()  # (not a context manager: ~1 us less per operation)
        try:
            while True:
                try:
                    done, request = advance(ops, reply, error)
                    if done:
                        return request  # type: ignore[no-any-return]
                    reply, error = None, None
                    reply = self._do(request)
                except BaseException as exc:  # noqa: BLE001 - the protocol decides what to do
                    if getgeneratorstate(ops) == GEN_CLOSED:  # raised by the step: it ended
                        raise
                    # a request's failure, or an interrupt between two requests (interrupt
                    # review: one landing there abandoned a take whose finish had run, and
                    # the round with it): thrown into the step
                    reply, error = None, exc
        finally:
            self._drive_ends(me)

    def _do(self, request: Request) -> Any:
        commands = self._conns.commands
        if isinstance(request, Call):
            name, keys, args = request.name, request.keys, request.args
            return self._io(request.what, lambda: _scripts.call(commands, name, keys, args),
                            request.window)  # fmt: skip
        if isinstance(request, Command):
            return self._io(request.what, lambda: commands.execute_command(*request.args))
        if isinstance(request, Batch):
            return self._io(request.what, lambda: self._batch(request))
        if isinstance(request, Receive):
            return self._io(request.what,
                            lambda: get_into(commands, request.keys, request.outs))  # fmt: skip
        if isinstance(request, ReceiveAll):
            return self._io(request.what,
                            lambda: get_all_into(commands, request.keys, request.into))  # fmt: skip
        if isinstance(request, Pop):
            timeout = request.seconds()
            if self._cluster:
                timeout = min(timeout, CLUSTER_WAIT_SLICE)
            then: list[Any] = []  # the reply of request.then, when made here
            waited = self._wait(self._blpop, self._conns.blocking, request.key, timeout,
                                request.then, then)  # fmt: skip
            return waited if request.then is None else (then[0] if then else None)
        if isinstance(request, Subscribe):
            queue = self._conns.blocking.pubsub(ignore_subscribe_messages=True)
            with self._waits_lock:
                self._waits.add(queue)
            if not self._wait(queue.subscribe, request.channel):
                self._drop_queue(queue)
                return None
            return queue
        if isinstance(request, Listen):
            return self._wait(request.handle.get_message, timeout=request.seconds())
        if isinstance(request, Unsubscribe):
            return self._drop_queue(request.handle)
        raise TypeError(f"unknown request {request!r}")

    def _batch(self, request: Batch) -> list[Any]:
        commands = self._conns.commands

        def send() -> list[Any]:
            if self._cluster and all(c[0] == "SCRIPT" for c in request.commands):
                return [each(commands, c, request.raise_on_error) for c in request.commands]
            if request.tail is not None:
                return per_node(commands, request, self._cluster)
            if self._cluster and request.node_key is not None:
                return on_node(commands, request)
            if self._cluster and any(is_script(c) for c in request.commands):
                return by_node_batch(commands, request)
            if not self._cluster:
                direct = execute_batch(commands, request.commands, request.raise_on_error)
                if direct is not None:
                    return direct
            pipe = commands.pipeline(transaction=False)
            for command in request.commands:
                pipe.execute_command(*command)
            return pipe.execute(raise_on_error=request.raise_on_error)

        try:
            replies = send()
        except NoScriptError:
            replies = [NoScriptError()]
        if any(isinstance(r, NoScriptError) for r in replies):
            # after a restart or a failover: load them all, then send the batch again
            load = Batch(request.what, _scripts.load_commands(), raise_on_error=False)
            _scripts.check_loaded(self._batch(load))
            replies = send()
        _retry.raise_transient(replies)
        return replies

    def _io(self, what: str, fn: Callable[[], _T], window: float | None = None) -> _T:
        """``fn()`` retried through transient Redis faults for ``window`` seconds (None:
        :attr:`retry_window`)."""
        try:
            return _retry.call(
                fn, f"{what} {self._shared_name!r}",
                window=self.retry_window if window is None else window,
                give_up=lambda: self._closed,
            )  # fmt: skip
        except BaseException as exc:
            if interrupted(exc) and self._conns is not None:
                drop_idle(self._conns.commands)  # (a reply redis-py may have left unread)
            raise

    def _drop_queue(self, queue: PubSub) -> None:
        with self._waits_lock:
            self._waits.discard(queue)
        queue.close()

    def _blpop(
        self, blocking: Any, key: str, timeout: float, then: Call | None, out: list[Any]
    ) -> None:
        """BLPOP on a connection this accumulator holds for the wait, so that close() from
        another thread can break it (on a cluster: a connection to the node serving the key).
        ``then``, a script call, goes in the same round trip, behind the BLPOP: Redis runs
        it as soon as the wait ends. Its reply is appended to ``out``; not when the script
        was not loaded (the caller makes the call again, which loads it)."""
        if self._cluster:
            pool = blocking.get_redis_connection(blocking.get_node_from_key(key)).connection_pool
        else:
            pool = blocking.connection_pool
        conn = pooled(pool, "BLPOP")
        if type(conn).__module__.startswith("fakeredis"):
            # in-process: its connection cannot be cut from another thread; short slices
            # let close() end the wait instead
            timeout = min(timeout, 0.1)
        with self._waits_lock:
            self._waits.add(conn)
        done = False
        try:
            commands, run = _scripts.behind_wait(key, timeout, then)
            conn.send_packed_command(conn.pack_commands(commands))
            try:
                conn.read_response()
            except ResponseError as exc:
                moved = moved_error("take_grad", [exc]) if self._cluster else None
                if moved is None:
                    _scripts.raise_translated(exc)  # (BLPOP refused by the ACL: ours)
                # the slot moved (or is moving): a fresh slot map, and the caller re-checks
                blocking.nodes_manager.initialize()
                raise moved from exc
            if run is not None:
                try:
                    reply, error = conn.read_response(), None
                except ResponseError as exc:
                    reply, error = None, exc
                done = True  # both replies are read: the connection is clean
                if error is not None and self._cluster and is_redirect(error):
                    blocking.nodes_manager.initialize()  # the caller re-checks
                else:
                    made, reply = _scripts.reply_behind(run, reply, error)
                    if made:
                        out.append(reply)
            done = True
        finally:
            with self._waits_lock:
                self._waits.discard(conn)
            if not done:  # a reply may still be on its way: never reuse the connection
                conn.disconnect()
            pool.release(conn)

    def _wait(self, block: Any, *args: Any, **kwargs: Any) -> bool:
        """One bounded wait; False when its connection failed (the caller re-checks: the take
        script rides out the fault). close() from another thread breaks it (CancelledError)."""
        if self._closed:  # closed before this wait began: nothing to cut it
            raise CancelledError("the accumulator was closed while waiting")
        try:
            block(*args, **kwargs)
            return True
        except Exception as exc:
            if self._closed:  # its connection was cut under it (whatever redis-py raises then)
                raise CancelledError("the accumulator was closed while waiting") from None
            if not _retry.breaks_wait(exc):
                raise
            logger.debug("wait on %s interrupted: %s", self._keys.base, exc)
            time.sleep(0.05)  # a refused reconnect fails at once: do not spin
            if self._cluster:
                # the node may be gone for good (failed over): waits route by the blocking
                # client's own slot map, which only a MOVED reply refreshed
                try:
                    cast(Any, self._conns.blocking).nodes_manager.initialize()
                except Exception as again:  # noqa: BLE001 - the caller re-checks anyway
                    logger.debug("refreshing the slot map failed: %s", again)
            return False
