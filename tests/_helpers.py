"""Helpers shared by the TF-case test files (dense and sparse): state checks and takers
running in threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from accumulator import AccumulatorBase, InvalidArgumentError
from accumulator._urls import cluster_url

#: How long something that should happen promptly may take (generous: 2 shared cores).
PROMPT = 5.0

#: Checks made on the client before anything is sent: one backend shows them.
fake_only = pytest.mark.parametrize("target", ["fake"], indirect=True)


def sync_job(target: Any, params: dict[str, Any], sparse: Any = (), **kw: Any) -> Any:
    """A one-worker sync job on ``params`` (``sparse``: the sparse ones; ``kw``: more
    ``ParameterServer`` options): (chief, worker, the step the worker pulled)."""
    from accumulator.sync import ParameterServer, Worker

    ps = ParameterServer("job", replicas_to_aggregate=1, sparse=set(sparse),
                         client=target.client(), **kw)  # fmt: skip
    ps.initialize(params)
    worker = Worker("job", worker_id="w0", client=target.client())
    step, _ = worker.pull(timeout=5)
    return ps, worker, step


def connect(url: str, **kwargs: Any) -> Any:
    """A plain client of a test server's URL: a ``RedisCluster`` for a ``redis+cluster://``
    one (commands for every node take ``target_nodes="all"``)."""
    import redis
    from redis.cluster import RedisCluster

    plain = cluster_url(url)
    if plain:
        return RedisCluster.from_url(plain, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def aconnect(url: str, **kwargs: Any) -> Any:
    """:func:`connect`'s asyncio twin."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    plain = cluster_url(url)
    if plain:
        return RedisCluster.from_url(plain, **kwargs)
    return aioredis.Redis.from_url(url, **kwargs)


def expected_mean(acc: np.ndarray, n: int, dtype: np.dtype) -> np.ndarray:
    """The spec's MEAN, written independently of the library: ``acc / dtype(n)``, C integer
    division (toward zero) for integers, component-wise for complex."""
    if dtype.kind in "iu":
        # truncation toward zero, computed on Python ints (exact for 64-bit values)
        flat = [int(v) for v in acc.reshape(-1)]
        q = [abs(v) // n * (1 if v >= 0 else -1) for v in flat]
        return np.array(q, dtype=dtype).reshape(acc.shape)
    if dtype.kind == "c":
        part = acc.real.dtype.type
        out = np.empty_like(acc)
        out.real = acc.real / part(n)
        out.imag = acc.imag / part(n)
        return out
    return (acc / np.array(n).astype(dtype)).astype(dtype)


def nan_bits(dtype: Any, sign: int, payload: int) -> np.generic:
    """A quiet NaN of a float dtype with this sign and payload (told apart by its bits)."""
    dtype = np.dtype(dtype)
    bits = 8 * dtype.itemsize
    mant = {16: 10, 32: 23, 64: 52}[bits] if dtype.kind == "f" else 7  # bfloat16: 7
    exp_quiet = ((1 << (bits - 1 - mant)) - 1) << mant | 1 << (mant - 1)
    raw = np.array(sign << (bits - 1) | exp_quiet | payload, f"u{dtype.itemsize}")
    return raw.view(dtype)[()]


def state(acc: AccumulatorBase) -> tuple[int, int]:
    return acc.num_accumulated(), acc.global_step()


def rejected(acc: AccumulatorBase, call: Callable[[], Any]) -> InvalidArgumentError:
    """``call`` raises InvalidArgumentError (also a ValueError) and changes nothing."""
    before = state(acc)
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert state(acc) == before
    return info.value


def waiting_takers(target: Any, acc: AccumulatorBase) -> int:
    """Number of takers in the FIFO (the ``:t`` zset of the key schema in _keys.py)."""
    return int(target.redis().zcard(acc.accumulator_ref + ":t"))


def wait_until(predicate: Callable[[], bool], timeout: float = PROMPT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


class Taker(threading.Thread):
    """A thread running one ``take_grad``; keeps the result or the exception."""

    def __init__(
        self, acc: Any, num_required: int, timeout: float | None = PROMPT, **take: Any
    ) -> None:
        super().__init__(daemon=True)
        self.acc, self.num_required, self.timeout, self.take = acc, num_required, timeout, take
        self.result: Any = None
        self.error: BaseException | None = None
        self.done_at: float | None = None

    def run(self) -> None:
        try:
            self.result = self.acc.take_grad(self.num_required, timeout=self.timeout, **self.take)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        self.done_at = time.monotonic()

    def finish(self) -> Any:
        self.join(max(PROMPT, self.timeout or 0) + 2)
        assert not self.is_alive(), "take_grad did not return"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def start_taker(target: Any, acc: Any, num_required: int, **kwargs: Any) -> Taker:
    """Start a taker and wait until it has joined the FIFO (so join order is deterministic)."""
    before = waiting_takers(target, acc)
    taker = Taker(acc, num_required, **kwargs)
    taker.start()
    wait_until(lambda: waiting_takers(target, acc) > before or not taker.is_alive())
    return taker


#: State-hash fields that a refused or timed-out call may change by design: the statistic of
#: refused applies, and the taker join counter (a timed-out take joined the FIFO, then left).
BOOKKEEPING_FIELDS = frozenset({b"n_rejected", b"tseq"})


def redis_snapshot(r: Any, prefix: str = "acc:") -> dict[bytes, Any]:
    """Every key under ``prefix`` with its type and value, read type by type (fakeredis's DUMP
    is not the server's format): strings by GET, hashes by HGETALL (minus
    :data:`BOOKKEEPING_FIELDS`), lists by LRANGE, sets by SMEMBERS, zsets with their scores.
    Expiries are not compared (PTTL moves with the clock).

    Left out: what a *completed* take leaves for the next take to free (its claim ``:c:``,
    kept for a retried take, its entry in the finished takes ``:cd``, and payload
    keys ``:b:`` no longer in a round): any take script, also one that times out, may free
    them. Payload keys of the pending round (``:g``) and claims not yet read stay.
    """
    keys = sorted(set(r.scan_iter(match=prefix + "*", count=1000)))
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
    kinds = [k.decode() if isinstance(k, bytes) else k for k in pipe.execute()]
    readers = {
        "string": lambda p, k: p.get(k),
        "hash": lambda p, k: p.hgetall(k),
        "list": lambda p, k: p.lrange(k, 0, -1),
        "set": lambda p, k: p.smembers(k),
        "zset": lambda p, k: p.zrange(k, 0, -1, withscores=True),
    }
    pipe = r.pipeline(transaction=False)
    read = [(key, kind) for key, kind in zip(keys, kinds, strict=True) if kind in readers]
    for key, kind in read:
        readers[kind](pipe, key)
    out: dict[bytes, Any] = {}
    for (key, kind), value in zip(read, pipe.execute(), strict=True):
        if value is None or (kind != "string" and not value):
            continue  # expired or deleted between SCAN and the read (Redis has no empty ones)
        if kind == "hash":
            value = {f: v for f, v in value.items() if f not in BOOKKEEPING_FIELDS}
        elif kind == "set":
            value = sorted(value)
        out[key] = (kind, value)
    for key, kind in zip(keys, kinds, strict=True):
        if kind not in readers and kind != "none":  # a type this library never writes
            out[key] = (kind, None)
    in_rounds = {
        part
        for key, (kind, value) in out.items()
        if kind == "list" and key.endswith(b":g")
        for entry in value
        for part in entry_key_names(entry)
    }
    kept: dict[bytes, Any] = {}
    for key, (kind, value) in out.items():
        if b"}:c:" in key or (b"}:b:" in key and key not in in_rounds):
            continue
        if key.endswith(b":cd"):  # finished takes, remembered for a retried finish
            continue
        if kind == "hash" and key.endswith(b":cl"):
            value = {f: v for f, v in value.items() if not v.startswith(b"done")}
            if not value:
                continue
        kept[key] = (kind, value)
    return kept


def entry_key_names(entry: bytes) -> list[bytes]:
    """The payload keys a round entry names, whatever accumulator it is of (a test's view;
    the library's own check is ``Keys.entry_keys``)."""
    if entry[:1] == b"k":
        return [entry[1:]]
    if entry[:1] == b"d":  # spread over slots: b"d<parts> <blob>", blob = <base>:b:<cid>:<seq>
        n, _, blob = entry[1:].partition(b" ")
        base, _, tail = blob.rpartition(b":b:")
        return [base[:-1] + b"%%p%d}:b:" % i + tail + b":%d" % i for i in range(int(n))]
    first = 0
    if entry[:1] in (b"s", b"f"):  # a running sum kept in Redis: b"s<weight> <parts> <blob>",
        # a gradient being folded into it: b"f<first part it holds> <parts> <blob>"
        lead, _, rest = entry[1:].partition(b" ")
        first = int(lead) if entry[:1] == b"f" else 0
        entry = b"p" + rest
    if entry[:1] == b"p":
        n, _, blob = entry[1:].partition(b" ")
        return [blob + b":%d" % i for i in range(first, int(n))]
    return []


def entry_payload(r: Any, entry: bytes) -> bytes | None:
    """The whole payload of a round entry (None if a part of it is missing)."""
    if entry[:1] == b"i":
        return entry[1:]
    parts = [r.get(key) for key in entry_key_names(entry)]
    return None if any(p is None for p in parts) else b"".join(parts)


def assert_not_imported_by_numpy_use(module: str) -> None:
    """In a fresh interpreter, using an accumulator with numpy arrays only does not import
    ``module`` (an optional framework: torch, jax)."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, fakeredis, accumulator\n"
        "acc = accumulator.ConditionalAccumulator(np.float32, (2,), shared_name='x',"
        " client=fakeredis.FakeRedis())\n"
        "acc.apply_grad(np.ones(2)); acc.take_grad(1)\n"
        f"assert {module!r} not in sys.modules, '{module} was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr


def take_script(acc: Any, taker: str, n: int, lease_ms: int, claim_ms: int | None = None) -> Any:
    """Run the take script the way a take does, once (a taker that then 'crashes'): a round
    of spread payloads is first checked (the script's ``{2, entries}`` reply) as the
    protocol checks it. ``claim_ms``: the claim's lease (the accumulator's otherwise)."""
    from accumulator import _scripts, _take

    checked: dict[bytes, bytes] = {}
    while True:
        keys, args = _take.take_script_args(acc, taker, n, lease_ms, checked)
        if claim_ms is not None:
            args[6] = claim_ms
        reply = _scripts.call(acc.redis, "take", keys, args)
        if int(reply[0]) != 2:
            return reply
        checked.update(acc._run(_take._check_spread(acc, reply[1])))


def aclient(target: Any) -> Any:
    """An asyncio handle on the target's data: fakeredis's twin, or the server's URL."""
    if target.kind == "fake":
        import fakeredis

        return fakeredis.FakeAsyncRedis(server=target._fake_server)
    return str(target.url)


def drain_socket(sock: Any, out: bytearray) -> None:
    """Read ``sock`` into ``out`` until its peer closes (a thread's target, for send tests)."""
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return
        out += data


#: The faults :func:`failing_once` injects.
FAULT_MODES = ("request lost", "reply lost")


def failing_once(fn: Callable[[], Any], mode: str, fired: Callable[[], None],
                 asynchronous: bool = False) -> Callable[[], Any]:  # fmt: skip
    """``fn`` (a request, as the retry layer calls it; a coroutine function with
    ``asynchronous``) failing once with a ConnectionError: before it runs ("request lost") or
    after ("reply lost"); ``fired()`` is called then. The calls after that run ``fn``."""
    import redis

    failed: list[bool] = []

    def once() -> Any:
        if not failed:
            failed.append(True)
            fired()
            if mode == "reply lost":
                fn()
            raise redis.ConnectionError(f"{mode} (injected)")
        return fn()

    async def once_async() -> Any:
        if not failed:
            failed.append(True)
            fired()
            if mode == "reply lost":
                await fn()
            raise redis.ConnectionError(f"{mode} (injected)")
        return await fn()

    return once_async if asynchronous else once


def fork_while_held(lock: Any, in_child: Any) -> None:
    """Fork while a thread of this process holds ``lock``; the child runs ``in_child()`` and
    must exit 0 within 10 s (hung: killed by SIGALRM, which the parent sees as a failure)."""
    import os
    import signal
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(10)
            in_child()
            code = 0
        finally:
            os._exit(code)
    release.set()
    holder.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
