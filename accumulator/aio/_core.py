"""The asyncio driver: runs the same protocol as the synchronous classes (``_model``,
``_apply``, ``_take``: generators of ``_requests``) over ``redis.asyncio``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.exceptions import NoScriptError, ResponseError

from .. import _private, _retry, _scripts
from .._connection import CLOSE_GRACE, CLUSTER_WAIT_SLICE
from .._errors import AccumulatorError, CancelledError
from .._model import AccumulatorModel, server_of
from .._requests import (
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
from ._cluster_batch import each, on_node, per_node
from ._connection import (
    AsyncClient,
    AsyncConnections,
    connect,
    execute,
    execute_batch,
    is_cluster,
    pooled,
)
from ._receive import receive

logger = logging.getLogger("accumulator")

_A = TypeVar("_A", bound="AccumulatorBase")
_T = TypeVar("_T")


async def _complete(work: Awaitable[_T]) -> tuple[asyncio.Future[_T], bool]:
    """``await work``, which a cancellation of the calling task does not interrupt: a commit
    (an apply, a take's finish) in flight completes, and its outcome is kept. Returns the
    ended work (its ``result()`` is the reply, or raises what the work raised) and whether a
    cancel arrived meanwhile, which the caller delivers later, also when the work failed (a
    take asks again for a finish whose reply was lost: a cancel thrown into that lost the
    round)."""
    task = asyncio.ensure_future(work)
    absorbed = False
    while True:
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the work itself was cancelled (the loop is closing)
                raise
            absorbed = True
            if not task.done():
                logger.debug("a cancel arrived while a commit was in flight: it completes first")
                continue
        except BaseException:  # noqa: BLE001 - the work's own error: its result() raises it
            if not task.done():
                raise
        return task, absorbed


def _rearm(task: asyncio.Task[Any] | None) -> None:
    """Deliver a cancel that a commit held back, once the operation has returned: at the
    caller's next ``await``. Not at once: a task whose coroutine returns while a cancel is
    pending discards the return value (a take's round, already finished in Redis, would be
    lost), so the cancel is re-armed from the loop, after the return (:func:`_redeliver`)."""
    if task is not None:
        task.get_loop().call_soon(_redeliver, task)


def _redeliver(task: asyncio.Task[Any]) -> None:
    """The held-back cancel, if it is still wanted: not when the task has ended (the
    operation was all it ran: its result stands), nor when the cancel was withdrawn (an
    ``asyncio.timeout`` scope that the operation finished in took it back on exit); counted
    once (for timeout scopes and task groups)."""
    if task.done() or task.cancelling() == 0:
        return
    task.uncancel()
    task.cancel()


def _cancelling(task: asyncio.Task[Any] | None) -> int:
    """How many cancels of ``task`` are pending or were delivered (0 without a task)."""
    return 0 if task is None else task.cancelling()


class AccumulatorBase(AccumulatorModel):
    """Common state and operations of ``accumulator.aio``'s accumulators (for ``isinstance``);
    not instantiated directly."""

    def __init__(
        self,
        dtype: Any,
        shape: Any,
        shared_name: str | None,
        name: str | None,
        reduction_type: str,
        *,
        client: AsyncClient = None,
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
        if not (client is None or isinstance(client, (str, aioredis.Redis, AsyncRedisCluster))):
            from ._connection import _check_client

            _check_client(client)
        self._client = client
        self._conns: AsyncConnections | None = None
        self._opening: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it was opened in
        self._waits: set[Any] = set()
        # protocol steps running (_drive): aclose() lets them end (a cut take withdraws from
        # the FIFO) before it closes the connections
        self._drives = 0

    @property
    def redis(self) -> aioredis.Redis:
        """The client this accumulator sends its commands through (once opened)."""
        if self._conns is None:
            raise CancelledError("the accumulator is not open: await it or use `async with`")
        return self._conns.commands

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self: _A) -> _A:
        """Connect, and create the accumulator in Redis or check the stored one (done by the
        first operation otherwise); returns the accumulator."""
        self._check_open()
        if self._conns is not None:
            if asyncio.get_running_loop() is not self._loop:
                raise AccumulatorError(
                    f"the asyncio accumulator {self._shared_name!r} was opened in another event "
                    "loop (asyncio.run() called again?): its connections belong to that loop. "
                    "Create one object per event loop"
                )
            return self
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._conns is None:
                conns = connect(self._client)
                try:
                    await self._drive(conns, self._open_ops(server_of(conns.commands),
                                                            is_cluster(conns.commands)))
                    self._check_open()  # (aclose() from another task meanwhile)
                except BaseException:
                    await conns.close()
                    raise
                self._conns, self._loop = conns, asyncio.get_running_loop()
        return self

    def __await__(self: _A) -> Generator[Any, None, _A]:
        """``await acc``: :meth:`open`, which returns the accumulator."""
        return self.open().__await__()

    async def aclose(self) -> None:
        """Release connections; a private accumulator's keys are deleted. A take waiting in
        another task raises :class:`CancelledError`. Operations in flight in other tasks are
        given up to :data:`CLOSE_GRACE` seconds to end first (a cut take withdraws from the
        queue of takers, so that the next take does not wait for its lease to run out)."""
        self._closed = True
        conns, self._conns = self._conns, None
        if conns is None:
            return
        if asyncio.get_running_loop() is not self._loop:
            await self._aclose_elsewhere(conns)
            return
        for wait in list(self._waits):
            try:
                if isinstance(wait, aioredis.client.PubSub):
                    await wait.aclose()
                else:
                    await wait.disconnect()
            except Exception:  # noqa: BLE001 - best effort: the waiter sees the closed flag
                logger.debug("could not cut a wait of %s", self._keys.base, exc_info=True)
        deadline = time.monotonic() + CLOSE_GRACE
        while self._drives and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # (polled: no Event, which binds to one event loop)
        if self._drives:
            logger.warning("closing %r with an operation still running after %gs",
                           self._shared_name, CLOSE_GRACE)  # fmt: skip
        await self._delete_private_keys(conns)

    async def _delete_private_keys(self, conns: AsyncConnections) -> None:
        """A private accumulator's keys deleted through ``conns`` (best effort: what is left
        expires), then ``conns`` closed."""
        try:
            if self._owns_private_keys():
                ops = _private.delete_ops(self._keys, list(self._identities.client_ids))
                await _run_plain(conns.commands, ops)
        except Exception:  # noqa: BLE001 - best effort at close time (the keys expire)
            logger.debug("could not delete private accumulator %s", self._keys.base,
                         exc_info=True)  # fmt: skip
        finally:
            await conns.close()

    async def _aclose_elsewhere(self, conns: AsyncConnections) -> None:
        """:meth:`aclose` in another event loop than the one that opened the accumulator
        (``asyncio.run()`` called again): that loop's connections can be neither used nor
        closed here. The share of them is let go (they go with their loop), and a private
        accumulator's keys are deleted through connections of this loop (concurrency
        review: nothing was deleted, and the failure was logged at DEBUG only)."""
        logger.warning("closing the asyncio accumulator %r in another event loop than the "
                       "one that opened it (asyncio.run() called again?)", self._shared_name)
        conns.let_go()
        if self._owns_private_keys():
            await self._delete_private_keys(connect(self._client))

    async def close(self) -> None:
        """The same as :meth:`aclose` (a coroutine, as every method here: ``await
        acc.close()``; a bare ``acc.close()`` does nothing)."""
        await self.aclose()

    async def __aenter__(self: _A) -> _A:
        return await self.open()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- simple state -------------------------------------------------------------------------

    async def num_accumulated(self, name: str | None = None) -> int:
        """Number of gradients accepted since the last successful take."""
        return await self._run(self._count_ops())

    async def global_step(self) -> int:
        """The accumulator's current global step (TF has no way to read it)."""
        return await self._run(self._step_ops())

    async def set_global_step(self, new_global_step: Any, name: str | None = None) -> None:
        """Set the global step, also downwards (with a warning); never clears the round."""
        await self._run(self._set_step_ops(new_global_step))

    # -- the driver ---------------------------------------------------------------------------

    async def _run(self, ops: Ops[_T]) -> _T:
        """Open if needed, then run a protocol step to its end."""
        self._check_open()
        await self.open()
        assert self._conns is not None
        return await self._drive(self._conns, ops)

    async def _drive(self, conns: AsyncConnections, ops: Ops[_T]) -> _T:
        """Run a protocol step: each request is done here and its reply (or its exception)
        handed back.

        A cancel of the calling task is thrown into the protocol (which gives back what it
        holds) at the latest before its next request, also one that library code swallowed
        (redis-py's pipelines can). A commit in flight is never cut: a cancel arriving then
        lets the operation complete; it then returns its result and the cancel lands at the
        caller's next await, if there is one (see :func:`_rearm`; if the operation failed, it
        raises CancelledError)."""
        self._drives += 1
        try:
            return await self._drive_steps(conns, ops)
        finally:
            self._drives -= 1

    async def _drive_steps(self, conns: AsyncConnections, ops: Ops[_T]) -> _T:
        task = asyncio.current_task()
        # a cancel pending from before (one held back by a commit of the caller's previous
        # operation) lands here, before anything is sent; then count what was delivered
        await asyncio.sleep(0)
        seen = _cancelling(task)
        held = False  # a cancel held back by a commit, to deliver at the end
        # After a commit went through the operation only completes (an apply's folds, a take's
        # sweep), and after a cancel was thrown into it, it only gives back what it holds (a
        # take's leave, an apply's withdraw): from then on every request runs to its end as a
        # commit does, and a later cancel is held back, not thrown in (a second one, or Ctrl-C
        # landing there, skipped the leave: the round stayed claimed until its lease ran out;
        # one during the folds raised after the apply was counted: a retry counted it twice).
        ending = False
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                done, request = advance(ops, reply, error)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if held or _cancelling(task) > seen:
                    if isinstance(exc, Exception):  # (its text would only be the cause)
                        logger.warning("an operation cancelled while it ended failed: %s", exc)
                    raise asyncio.CancelledError("cancelled while the operation ended") from exc
                raise
            if done:
                if held or _cancelling(task) > seen:
                    _rearm(task)
                return request  # type: ignore[no-any-return]
            reply, error = None, None
            try:
                commit = getattr(request, "commit", False)
                if commit and not ending:
                    await asyncio.sleep(0)  # a cancel already requested lands here
                if _cancelling(task) > seen and not held and not ending:
                    raise asyncio.CancelledError("cancelled during the previous request")
                if commit or ending:
                    # (ending first: a take that asks again for a finish whose reply was lost
                    # holds a cancel that came meanwhile, as the sync class holds Ctrl-C)
                    ending = True
                    ended, absorbed = await _complete(self._do(conns, request))
                    held = held or absorbed
                    reply = ended.result()
                else:
                    reply = await self._do(conns, request)
            except BaseException as exc:  # noqa: BLE001 - the protocol decides what to do
                if isinstance(exc, asyncio.CancelledError):
                    seen = _cancelling(task)
                    ending = True
                error = exc

    async def _do(self, conns: AsyncConnections, request: Request) -> Any:
        commands = conns.commands
        if isinstance(request, Call):
            name, keys, args = request.name, request.keys, request.args
            return await self._io(
                request.what, lambda: _scripts.acall(commands, name, keys, args, execute),
                request.window,
            )
        if isinstance(request, Command):
            return await self._io(request.what, lambda: commands.execute_command(*request.args))
        if isinstance(request, Batch):
            return await self._io(request.what, lambda: self._batch(commands, request))
        if isinstance(request, (Receive, ReceiveAll)):
            # in place, on a synchronous twin in a worker thread (None: the ordinary way)
            return await self._io(request.what, lambda: receive(commands, request))
        if isinstance(request, Pop):
            then: list[Any] = []  # the reply of request.then, when made here
            if is_cluster(conns.blocking):  # routed by key; short slices keep it closable
                blocking, key = conns.blocking, request.key
                seconds = min(request.seconds(), CLUSTER_WAIT_SLICE)
                waited = await self._wait(lambda: blocking.blpop([key], seconds))
            else:
                waited = await self._wait(lambda: self._blpop(
                    conns.blocking, request.key, request.seconds(), request.then,
                    then))  # fmt: skip
            return waited if request.then is None else (then[0] if then else None)
        if isinstance(request, Subscribe):
            blocking = conns.blocking
            # a cluster's pub/sub routes by the slot map without loading it first (redis-py
            # 8.1: a KeyError when no other command has used this client yet)
            if is_cluster(blocking) and not await self._wait(blocking.initialize):
                return None
            queue = blocking.pubsub(ignore_subscribe_messages=True)
            self._waits.add(queue)
            try:
                subscribed = await self._wait(lambda: queue.subscribe(request.channel))
            except BaseException:  # (cancelled: the take never gets the handle to drop)
                await self._drop_queue(queue)
                raise
            if not subscribed:
                await self._drop_queue(queue)
                return None
            return queue
        if isinstance(request, Listen):
            handle, seconds = request.handle, request.seconds()
            return await self._wait(
                lambda: handle.get_message(ignore_subscribe_messages=True, timeout=seconds)
            )
        if isinstance(request, Unsubscribe):
            return await self._drop_queue(request.handle)
        raise TypeError(f"unknown request {request!r}")

    async def _batch(self, commands: aioredis.Redis, request: Batch) -> list[Any]:
        async def send() -> list[Any]:
            if is_cluster(commands) and all(c[0] == "SCRIPT" for c in request.commands):
                return [await each(commands, c, request.raise_on_error)
                        for c in request.commands]  # fmt: skip
            if request.tail is not None:
                return await per_node(commands, request)
            if is_cluster(commands) and request.node_key is not None:
                return await on_node(commands, request)
            if not is_cluster(commands):
                direct = await execute_batch(commands, request.commands, request.raise_on_error)
                if direct is not None:
                    return direct
            pipe = commands.pipeline(transaction=False)
            for command in request.commands:
                pipe.execute_command(*command)
            return list(await pipe.execute(raise_on_error=request.raise_on_error))

        try:
            replies = await send()
        except NoScriptError:
            replies = [NoScriptError()]
        if any(isinstance(r, NoScriptError) for r in replies):
            load = Batch(request.what, _scripts.load_commands(), raise_on_error=False)
            _scripts.check_loaded(await self._batch(commands, load))
            replies = await send()
        _retry.raise_transient(replies)
        return replies

    async def _io(
        self, what: str, fn: Callable[[], Awaitable[_T]], window: float | None = None
    ) -> _T:
        """``await fn()`` retried through transient Redis faults for ``window`` seconds
        (None: :attr:`retry_window`)."""
        return await _retry.acall(
            fn, f"{what} {self._shared_name!r}",
            window=self.retry_window if window is None else window,
            give_up=lambda: self._closed,
        )  # fmt: skip

    async def _drop_queue(self, queue: Any) -> None:
        self._waits.discard(queue)
        try:
            await queue.aclose()
        except Exception:  # noqa: BLE001 - its connection may be gone already
            logger.debug("closing a subscription of %s failed", self._keys.base, exc_info=True)

    async def _blpop(
        self, blocking: aioredis.Redis, key: str, timeout: float, then: Call | None,
        out: list[Any],
    ) -> None:  # fmt: skip
        """BLPOP on a connection this accumulator holds for the wait, so that ``aclose()``
        from another task can break it. ``then``, a script call, goes in the same round trip,
        behind the BLPOP (the sync driver's twin: ``accumulator._core``); its reply is
        appended to ``out``, unless the script was not loaded."""
        pool = blocking.connection_pool
        conn = await pooled(pool, "BLPOP")
        if type(conn).__module__.startswith("fakeredis"):
            # the in-process double blocks in a helper task that a cut connection strands:
            # poll instead (a wake token is popped the same way)
            popped = None
            try:
                await conn.send_command("LPOP", key)
                popped = [await conn.read_response()]
            finally:
                if popped is None:  # cut short: its reply may still come
                    await conn.disconnect()
                await pool.release(conn)
            if popped[0] is None:
                await asyncio.sleep(min(timeout, 0.05))
            return
        self._waits.add(conn)
        done = False
        try:
            commands, run = _scripts.behind_wait(key, timeout, then)
            await conn.send_packed_command(conn.pack_commands(commands))
            try:
                await conn.read_response()
            except ResponseError as exc:
                _scripts.raise_translated(exc)  # (BLPOP refused by the ACL: ours)
            if run is not None:
                try:
                    reply, error = await conn.read_response(), None
                except ResponseError as exc:
                    reply, error = None, exc
                done = True  # both replies are read: the connection is clean
                made, reply = _scripts.reply_behind(run, reply, error)
                if made:
                    out.append(reply)
            done = True
        finally:
            self._waits.discard(conn)
            if not done:  # a reply may still be on its way: never reuse the connection
                await conn.disconnect()
            await pool.release(conn)

    async def _wait(self, block: Callable[[], Awaitable[Any]]) -> bool:
        """One bounded wait; False when its connection failed (the caller re-checks).
        ``aclose()`` from another task breaks it (CancelledError)."""
        if self._closed:  # closed before this wait began: nothing to cut it
            raise CancelledError("the accumulator was closed while waiting")
        try:
            await block()
            return True
        except Exception as exc:
            if self._closed:
                raise CancelledError("the accumulator was closed while waiting") from None
            if not _retry.breaks_wait(exc):
                raise
            logger.debug("wait on %s interrupted: %s", self._keys.base, exc)
            await asyncio.sleep(0.05)  # a refused reconnect fails at once: do not spin
            blocking = None if self._conns is None else self._conns.blocking
            if blocking is not None and is_cluster(blocking):
                # the node may be gone for good (failed over): a fresh slot map for the waits
                try:
                    await cast(Any, blocking).nodes_manager.initialize()
                except Exception as again:  # noqa: BLE001 - the caller re-checks anyway
                    logger.debug("refreshing the slot map failed: %s", again)
            return False


async def _run_plain(client: aioredis.Redis, ops: Ops[Any]) -> Any:
    """Run a plan of plain batches (no retries, no scripts): the twin of ``_private.run``."""
    reply: Any = None
    while True:
        done, request = advance(ops, reply, None)
        if done:
            return request
        pipe = client.pipeline(transaction=False)
        for command in request.commands:
            pipe.execute_command(*command)
        reply = list(await pipe.execute())
