"""Machinery of the fault drills (``tests/test_faults.py``): worker and taker processes that
log every outcome durably before they can be killed, a fault injector, and exact accounting.

Payloads: a SUM accumulator of int8 in which gradient number ``u`` is the one-hot vector with
a 1 at position ``u``. Ids are handed out in blocks, one block per worker process (a
replacement gets a fresh block), so every position belongs to exactly one ``apply_grad`` call
of the whole run, and a take's result says exactly which gradients it holds: a 1 at ``u`` =
gradient ``u`` once, anything else at a position = counted twice (or corrupt).

Logs: one file per process, appended with one ``os.write`` per record (a SIGKILL leaves whole
records; the parser skips a torn one and counts it):

- worker: ``S <u>`` just before ``apply_grad`` of gradient ``u``; ``R <u> <1|0> <seconds>``
  after it returned (accepted / stale; seconds of ``global_step()`` + ``apply_grad``);
  ``E <u> apply <ExcType> <message>`` when it raised. An ``S`` without ``R`` (killed during
  the call) or with ``E`` is *unknown*: it may be counted, at most once. ``X step <ExcType>
  <message>`` when reading the step raised (nothing was applied; the same id is used again).
- taker: ``C <claim>`` as soon as its take script claimed a round (the reply read), ``F`` just
  before it sends the finish script (from then on the round may be freed in Redis), ``Q`` as
  soon as a take returned, then ``T <json>``: ``{"n": num_required, "ids": [...], "odd":
  {position: value}, "s": seconds}``; ``E - take <ExcType> <message>``. ``C`` and ``F`` come
  from a hook on ``accumulator._scripts.steps`` (the function the take protocol sends its
  scripts through); a take returning without them logs ``E - hook`` and fails the drill.
- both: ``E - open <ExcType> <message>`` when constructing the accumulator raised.
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
from _helpers import entry_payload
from redis.sentinel import Sentinel

import accumulator
from accumulator._keys import Keys
from accumulator._model import INLINE_MAX_BYTES

DTYPE = np.int8
FAULTS = ("kill_worker", "kill_taker", "kill_redis", "client_kill", "pause_all", "pause_write")


# -- processes -------------------------------------------------------------------------------


class _Log:
    """Append-only record file: one ``os.write`` per line, no buffering to lose at a kill."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, line: str) -> None:
        os.write(self.fd, (line.replace("\n", " ") + "\n").encode())


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__} {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def client_of(spec: Any) -> Any:
    """What a drill process passes as ``client``: a URL as it is; ``("sentinel", ports,
    service)`` becomes a Sentinel-managed client (it follows the primary across failovers)."""
    if isinstance(spec, str):
        return spec
    _, ports, service = spec
    sentinel = Sentinel([("127.0.0.1", port) for port in ports], socket_timeout=1.0)
    return sentinel.master_for(service, socket_timeout=5.0)


def _open(url: Any, name: str, width: int, log: _Log) -> accumulator.ConditionalAccumulator:
    """Open the accumulator, riding out a fault the library did not absorb (logged).
    ``url``: a client spec (:func:`client_of`), and the durability as ``(spec,
    min_replicas)``."""
    spec, min_replicas = url if isinstance(url, tuple) and len(url) == 2 else (url, 0)
    while True:
        try:
            return accumulator.ConditionalAccumulator(
                DTYPE, shape=(width,), shared_name=name, reduction_type="SUM",
                client=client_of(spec), min_replicas=min_replicas,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - recorded, then retried
            log(f"E - open {_describe(exc)}")
            time.sleep(0.2)


def worker_main(
    url: str, name: str, width: int, first: int, count: int, log_path: str, stop_path: str,
    seed: int, pace: float,
) -> None:  # fmt: skip
    log = _Log(log_path)
    log(f"P {os.getpid()} {first} {count}")
    acc = _open(url, name, width, log)
    rng = random.Random(seed)
    grad = np.zeros(width, DTYPE)
    u = first
    while u < first + count and not os.path.exists(stop_path):
        started = time.monotonic()
        try:
            # mostly the current step, sometimes one behind (stale), sometimes ahead
            step = acc.global_step() + rng.choice([0, 0, 0, -1, 1])
        except Exception as exc:  # noqa: BLE001 - recorded; nothing was applied
            log(f"X step {_describe(exc)}")
            time.sleep(0.05)
            continue
        grad[u] = 1
        log(f"S {u}")
        try:
            ok = acc.apply_grad(grad, local_step=step)
        except Exception as exc:  # noqa: BLE001 - unknown outcome; never retried at this level
            log(f"E {u} apply {_describe(exc)}")
        else:
            log(f"R {u} {int(ok)} {time.monotonic() - started:.4f}")
        grad[u] = 0
        u += 1
        time.sleep(rng.uniform(0, 2 * pace))
    log("D")


def taker_main(
    url: str, name: str, width: int, log_path: str, stop_path: str, seed: int, take_max: int,
    lease: float, wait_slice: float, claim_lease: float,
) -> None:  # fmt: skip
    log = _Log(log_path)
    log(f"P {os.getpid()}")
    acc = _open(url, name, width, log)
    # A killed taker holds the head of the FIFO for its lease, and a round it claimed for its
    # claim lease: keep them short.
    acc.taker_lease = lease
    acc.wait_slice = wait_slice
    set_claim_lease(acc, claim_lease)
    marks = _hook_take_protocol(log)
    rng = random.Random(seed)
    while True:
        n = rng.randint(1, take_max)
        started = time.monotonic()
        marks.clear()
        try:
            total = acc.take_grad(n, timeout=1.0)
        except accumulator.DeadlineExceededError:
            if os.path.exists(stop_path):
                break
            continue
        except Exception as exc:  # noqa: BLE001 - recorded, then the same object takes again
            log(f"E - take {_describe(exc)}")
            continue
        log("Q")  # returned: a kill from here on loses the record, not the library's round
        if marks[:1] != ["C"] or set(marks) != {"C", "F"}:  # a retried finish logs F twice
            log(f"E - hook the take returned after {marks} (C = claimed, F = finishing)")
        log("T " + json.dumps(_take_record(total, n, time.monotonic() - started)))
    log("D")


def _hook_take_protocol(log: _Log) -> list[str]:
    """Log ``C <claim>`` when a take script's reply says it claimed, and ``F`` right before a
    finish script is sent. Returns the list of marks of the current take (the caller clears
    it before each take)."""
    from accumulator import _scripts

    original = _scripts.steps
    marks: list[str] = []

    def steps(script: str, keys: Any, args: Any) -> Any:  # every script call, sent however
        if script == "finish":
            marks.append("F")
            log("F")
        reply = yield from original(script, keys, args)
        if script == "take" and int(reply[0]) == 1:
            marks.append("C")
            claim = keys[4]
            log(f"C {claim.decode() if isinstance(claim, bytes) else claim}")
        return reply

    _scripts.steps = steps  # type: ignore[assignment]
    # with a durability setting, the finish script goes in a pipeline with its WAIT
    from accumulator import _core

    if hasattr(_core.AccumulatorBase, "_batch"):
        original_batch = _core.AccumulatorBase._batch
        finish = _scripts.sha("finish")

        def batch(self: Any, request: Any) -> Any:
            if any(tuple(c[:2]) == ("EVALSHA", finish) for c in request.commands):
                marks.append("F")
                log("F")
            return original_batch(self, request)

        _core.AccumulatorBase._batch = batch  # type: ignore[method-assign]
    return marks


def claim_lease_supported() -> bool:
    """Whether the library leases a claimed round to its taker (and hands the round of a
    taker whose lease ran out to the next one)."""
    from accumulator import _core

    return hasattr(_core.AccumulatorBase, "claim_lease") or hasattr(_core, "CLAIM_LEASE_MS")


def set_claim_lease(acc: Any, seconds: float) -> bool:
    """Shorten the lease under which ``acc``'s takes hold a claimed round, where the library
    has one (False if not). Only for the drill's own processes: without a per-object knob it
    patches the module constant."""
    from accumulator import _core

    if hasattr(type(acc), "claim_lease"):
        acc.claim_lease = seconds
        return True
    if hasattr(_core, "CLAIM_LEASE_MS"):
        _core.CLAIM_LEASE_MS = int(seconds * 1000)  # type: ignore[attr-defined]
        return True
    return False


def _take_record(total: np.ndarray, n: int, seconds: float) -> dict[str, Any]:
    ids = np.flatnonzero(total)
    odd = {int(i): int(total[i]) for i in ids[total[ids] != 1]}
    return {"n": n, "ids": ids.tolist(), "odd": odd, "s": round(seconds, 4)}


def claim_then_hang_main(url: str, name: str, width: int, marker: str, claim_lease: float) -> None:
    """A taker that stops for good right after its take script claimed a round (before the
    reply is read and the result returned), so that the parent can SIGKILL it there.

    The hook wraps ``accumulator._scripts.steps``, which every script call goes through
    (alone, in a batch, or behind a wait); if the library stops using it, the marker never
    appears and the test says so."""
    from accumulator import _scripts

    original = _scripts.steps

    def steps(script: str, keys: Any, args: Any) -> Any:
        reply = yield from original(script, keys, args)
        if script == "take" and int(reply[0]) == 1:
            Path(marker).write_text(f"{os.getpid()}\n")
            time.sleep(3600)
        return reply

    _scripts.steps = steps  # type: ignore[assignment]
    acc = accumulator.ConditionalAccumulator(
        DTYPE, shape=(width,), shared_name=name, reduction_type="SUM", client=url
    )
    set_claim_lease(acc, claim_lease)
    Path(marker + ".ready").write_text("")
    acc.take_grad(3, timeout=60)


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


# -- the drill -------------------------------------------------------------------------------


@dataclass
class DrillConfig:
    name: str
    width: int  # one-hot positions: the capacity in gradient ids (and the payload in bytes)
    seconds: float  # how long faults are injected while workers and the taker run
    workers: int = 4
    block: int = 600  # ids per worker process
    pace: float = 0.02  # mean seconds between one worker's applies
    take_max: int = 4  # each take asks for 1..take_max gradients
    fault_gap: tuple[float, float] = (0.6, 1.8)
    faults: tuple[str, ...] = FAULTS
    redis_down: tuple[float, float] = (0.2, 1.5)  # seconds between kill -9 and start
    pause_ms: int = 500
    taker_lease: float = 3.0
    claim_lease: float = 5.0  # where the library has one (see set_claim_lease)
    wait_slice: float = 0.5
    seed: int = 0
    min_replicas: int = 0  # the processes' durability setting
    # the first kind in ``faults`` happens at least this often: injecting goes on past
    # ``seconds`` (up to twice as long) until it has (a slow machine's failovers are long)
    min_faults: int = 2


@dataclass
class _Proc:
    kind: str  # "worker" | "taker"
    proc: Any
    log: Path
    killed: bool = False  # by the drill (SIGKILL): a nonzero exit code is expected
    reaped: bool = False


@dataclass
class Drill:
    """Runs one drill against ``server`` (a persistent ``RedisServer``); ``run()`` returns the
    report (a JSON-able dict)."""

    config: DrillConfig
    server: Any
    run_dir: Path
    ctx: Any = field(default_factory=lambda: mp.get_context("spawn"))

    def __post_init__(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.procs: list[_Proc] = []
        self.next_id = 0
        self.spawned = collections.Counter[str]()
        self.faults = collections.Counter[str]()
        self.fault_log: list[tuple[float, str, str]] = []
        self.crashes: list[str] = []
        self.hangs: list[str] = []
        self.redis_down_max = 0.0
        self.stop_path = self.run_dir / "STOP"
        # a SentinelGroup is reached through its Sentinels (its primary changes), a
        # LocalCluster through a cluster client
        sentinels = getattr(self.server, "sentinel_ports", None)
        self.spec: Any = ("sentinel", list(sentinels), "mymaster") if sentinels else self.server.url
        if hasattr(self.server, "migrate_slot"):
            self.spec = self.server.cluster_url
            self.admin = self.server.client(socket_timeout=10)
        elif sentinels:
            self.admin = client_of(self.spec)
        else:
            self.admin = redis.Redis.from_url(self.server.url, socket_timeout=10)
        self.failovers: list[float] = []
        self._bag: list[str] = []

    # -- processes ---------------------------------------------------------------------------

    def _spawn_worker(self) -> bool:
        c = self.config
        if self.next_id + c.block > c.width:
            return False
        first, self.next_id = self.next_id, self.next_id + c.block
        index = self.spawned["worker"]
        path = self.run_dir / f"worker-{index:04d}.log"
        proc = self.ctx.Process(
            target=worker_main, daemon=True,
            args=((self.spec, c.min_replicas), c.name, c.width, first, c.block, str(path),
                  str(self.stop_path), c.seed * 100_003 + index, c.pace),
        )  # fmt: skip
        proc.start()
        self.procs.append(_Proc("worker", proc, path))
        self.spawned["worker"] += 1
        return True

    def _spawn_taker(self) -> None:
        c = self.config
        index = self.spawned["taker"]
        path = self.run_dir / f"taker-{index:03d}.log"
        proc = self.ctx.Process(
            target=taker_main, daemon=True,
            args=((self.spec, c.min_replicas), c.name, c.width, str(path), str(self.stop_path),
                  c.seed * 7919 + index, c.take_max, c.taker_lease, c.wait_slice,
                  c.claim_lease),
        )  # fmt: skip
        proc.start()
        self.procs.append(_Proc("taker", proc, path))
        self.spawned["taker"] += 1

    def _alive(self, kind: str) -> list[_Proc]:
        return [p for p in self.procs if p.kind == kind and p.proc.is_alive()]

    def _reap(self, running: bool) -> None:
        """Notice exited processes; replace them while the drill runs."""
        for p in self.procs:
            if p.reaped or p.proc.is_alive():
                continue
            p.proc.join()
            p.reaped = True
            if not p.killed and p.proc.exitcode != 0:
                self.crashes.append(f"{p.kind} {p.log.name} exit code {p.proc.exitcode}")
        if not running:
            return
        while len(self._alive("worker")) < self.config.workers and self._spawn_worker():
            pass
        if not self._alive("taker"):
            self._spawn_taker()

    def _kill(self, kind: str, targeted: bool = False) -> str:
        """SIGKILL a random live process of ``kind``, frozen first (SIGSTOP) and inspected.

        ``targeted``: caught inside the call that matters: a worker between ``S <u>`` and the
        outcome of that apply (inside ``apply_grad``), a taker between ``C`` and ``F``:
        holding a round its take script claimed, which it has neither read nor finished
        (inside ``take_grad``); after 200 tries, wherever it is. Never a taker between ``F``
        and its take's record ``T``: from the finish script on, the round is delivered (freed
        in Redis); a kill there loses only the drill's record of it, as if the process died
        right after take_grad returned. What is left of that blind spot is the microseconds
        between a retried finish and its second ``F``."""
        alive = self._alive(kind)
        if not alive:
            return "none alive"
        victim = self.rng.choice(alive)
        pid, where = victim.proc.pid, "anywhere"
        for attempt in range(2000):
            os.kill(pid, signal.SIGSTOP)
            last = _last_line(victim.log)
            if kind == "worker":
                if not targeted or attempt >= 199:
                    break
                if last.startswith("S "):
                    where = f"inside apply_grad of gradient {last[2:]}"
                    break
            elif last not in ("F", "Q"):
                if not targeted or attempt >= 199:
                    break
                if last.startswith("C "):
                    where = f"inside take_grad holding claim {last[2:]}"
                    break
            os.kill(pid, signal.SIGCONT)
            time.sleep(self.rng.uniform(0, 0.004))
        else:
            where = "at last, between finishing a take and recording it"
        victim.killed = True
        os.kill(pid, signal.SIGKILL)
        victim.proc.join(10)
        return f"{victim.log.name} pid {pid} {where}"

    # -- faults ------------------------------------------------------------------------------

    def _admin(self, *command: Any) -> Any:
        deadline = time.monotonic() + 10
        while True:
            try:
                return self.admin.execute_command(*command)
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def inject(self, kind: str) -> str:
        c = self.config
        if kind == "kill_worker":
            detail = self._kill("worker", targeted=self.faults[kind] % 2 == 0)  # every other
        elif kind == "kill_taker":
            detail = self._kill("taker", targeted=self.faults[kind] % 2 == 0)
            self._spawn_taker()
        elif kind == "kill_redis":
            started = time.monotonic()
            self.server.kill()
            time.sleep(self.rng.uniform(*c.redis_down))
            self.server.start()
            down = time.monotonic() - started
            self.redis_down_max = max(self.redis_down_max, down)
            detail = f"down {down:.2f}s"
        elif kind == "failover":
            started = time.monotonic()
            # every other one with lagging replicas (what asynchronous replication loses)
            lag = 0.5 if self.faults[kind] % 2 else 0.0
            port = self.server.failover(down=self.rng.uniform(*c.redis_down), lag=lag)
            self.failovers.append(round(time.monotonic() - started, 2))
            detail = f"primary now on port {port} after {self.failovers[-1]}s"
        elif kind == "migrate":
            # the accumulator's slot to another primary, live (clients see ASK, then MOVED);
            # with spread parts, every other time the slot of one of its parts' indices
            slots = self._slots()
            slot = slots[self.faults[kind] % len(slots)]
            started = time.monotonic()
            port = self.server.migrate_slot(slot)
            took = time.monotonic() - started
            what = "state" if slot == slots[0] else "parts"
            detail = f"slot {slot} ({what}) now on port {port} after {took:.2f}s"
        elif kind == "cluster_failover":
            started = time.monotonic()
            # every other one with a lagging replica (what asynchronous replication loses)
            lag = 0.5 if self.faults[kind] % 2 else 0.0
            # with spread parts: the primary of the state's slot, or of a part's, in turn
            slots = self._slots()
            slot = slots[self.faults[kind] % len(slots)]
            port = self.server.failover(slot, down=self.rng.uniform(*c.redis_down), lag=lag)
            self.failovers.append(round(time.monotonic() - started, 2))
            detail = f"slot {slot} now on port {port} after {self.failovers[-1]}s"
        elif kind == "client_kill":
            detail = f"{self._admin('CLIENT', 'KILL', 'TYPE', 'normal')} connections"
        elif kind == "pause_all":
            self._admin("CLIENT", "PAUSE", c.pause_ms, "ALL")
            detail = f"{c.pause_ms}ms"
        elif kind == "pause_write":
            self._admin("CLIENT", "PAUSE", c.pause_ms, "WRITE")
            detail = f"{c.pause_ms}ms"
        else:
            raise ValueError(kind)
        self.faults[kind] += 1
        return detail

    def _next_fault(self) -> str:
        if not self._bag:  # every kind once per bag, in random order
            self._bag = list(self.config.faults)
            self.rng.shuffle(self._bag)
        return self._bag.pop()

    def _slots(self) -> list[int]:
        """The state's slot, then the slots of spread parts 0 and 1, in turn (a gradient of
        two parts, spread: its parts' slots depend on the accumulator and the index only)."""
        from redis.cluster import key_slot

        keys = Keys("", self.config.name)
        parts = [key_slot(keys.spread_part(keys.blob("0", 0), i)) for i in (0, 1)]
        if self.config.width * np.dtype(DTYPE).itemsize <= INLINE_MAX_BYTES:
            return [self._slot()]
        return [self._slot(), parts[0], self._slot(), parts[1]]

    def _slot(self) -> int:
        """The cluster slot of the drill's accumulator (its hash tag)."""
        from redis.cluster import key_slot

        return int(key_slot(Keys("", self.config.name).state.encode()))

    # -- run ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        c = self.config
        acc = accumulator.ConditionalAccumulator(
            DTYPE, shape=(c.width,), shared_name=c.name, reduction_type="SUM",
            client=client_of(self.spec),
        )  # fmt: skip
        acc.wait_slice = c.wait_slice
        started = time.monotonic()
        try:
            self._reap(running=True)
            end, last = started + c.seconds, started + 2 * c.seconds
            main = c.faults[0]
            next_fault = started + 2.0  # let the first processes come up
            while time.monotonic() < end or (
                self.faults[main] < c.min_faults and time.monotonic() < last
            ):
                self._reap(running=True)
                if not self._alive("worker"):
                    break  # every id handed out and used
                if time.monotonic() >= next_fault:
                    kind = main if time.monotonic() >= end else self._next_fault()
                    detail = self.inject(kind)
                    self.fault_log.append((round(time.monotonic() - started, 2), kind, detail))
                    next_fault = time.monotonic() + self.rng.uniform(*c.fault_gap)
                time.sleep(0.05)
            faulting = time.monotonic() - started
            if not getattr(self.server, "running", True):
                self.server.start()
            self.stop_path.write_text("stop\n")
            for kind, limit in (("worker", 60.0), ("taker", 30.0)):
                deadline = time.monotonic() + limit
                for p in self.procs:
                    if p.kind == kind:
                        p.proc.join(max(0.1, deadline - time.monotonic()))
                        if p.proc.is_alive():
                            self.hangs.append(f"{kind} {p.log.name} did not stop in {limit:g}s")
                            p.killed = True
                            os.kill(p.proc.pid, signal.SIGKILL)
                            p.proc.join(10)
            self._reap(running=False)
            logs = self._read_logs()
            self._drain(acc, logs)
            report = self._account(logs, acc)
        finally:
            for p in self.procs:
                if p.proc.is_alive():
                    os.kill(p.proc.pid, signal.SIGKILL)
                    p.proc.join(10)
            acc.close()
            self.admin.close()
        report["failovers"] = self.failovers
        report["faulting_seconds"] = round(faulting, 1)
        report["seconds"] = round(time.monotonic() - started, 1)
        return report

    def _drain(self, acc: accumulator.ConditionalAccumulator, logs: _Logs) -> None:
        """Take what is left: the last round (fewer than the taker asked for), and any round
        a killed taker claimed and never returned (the library hands such a round to the next
        taker once the claim's lease ran out; until it does, such rounds are lost). A take may
        come back with such a round instead of the pending one (a claim whose lease ran out is
        handed over first): then it goes on until nothing is pending and no claim is left."""
        c = self.config
        wait = (c.claim_lease if claim_lease_supported() else 0) + c.taker_lease + 10
        taken = {u for take in logs.takes for u in take["ids"]}
        for _ in range(50):
            left = acc.num_accumulated()
            claims = self._leftover_claims()
            orphaned = [u for u, (_, pid) in claims.items()
                        if pid in logs.killed_takers and u not in taken]  # fmt: skip
            if not left and not orphaned:
                return
            try:
                # a killed taker may still hold the head of the FIFO until its lease runs out
                total = acc.take_grad(left or 1, timeout=c.taker_lease + 30 if left else wait)
            except accumulator.DeadlineExceededError:
                return
            logs.takes.append(_take_record(total, left or 1, 0.0) | {"by": "drain"})
            taken |= set(logs.takes[-1]["ids"])

    # -- accounting --------------------------------------------------------------------------

    def _read_logs(self) -> _Logs:
        logs = _Logs()
        for p in self.procs:
            text = p.log.read_text() if p.log.exists() else ""
            lines = text.splitlines()
            if p.kind == "taker" and p.killed:
                logs.killed_takers.add(p.proc.pid)
                if lines and lines[-1] in ("F", "Q"):
                    logs.returned_unrecorded.add(p.proc.pid)
            for line in lines:
                tag, _, rest = line.partition(" ")
                try:
                    if tag == "S":
                        logs.attempted.add(int(rest))
                    elif tag == "R":
                        u, ok, secs = rest.split()
                        logs.outcome[int(u)] = int(ok)
                        logs.latencies.append(float(secs))
                    elif tag == "E":
                        u, op, exc = rest.split(" ", 3)[:3]
                        logs.errors[f"{op}:{exc}"] += 1
                        if op == "apply":
                            logs.raised.add(int(u))
                    elif tag == "X":
                        op, exc = rest.split(" ", 2)[:2]
                        logs.errors[f"{op}:{exc}"] += 1
                    elif tag == "T":
                        logs.takes.append(json.loads(rest))
                except (ValueError, json.JSONDecodeError):
                    logs.torn += 1
        return logs

    def _leftover_claims(self) -> dict[int, tuple[str, int]]:
        """Gradient id -> (claim key, owner pid) of every claimed round still in Redis: rounds
        a taker claimed and has not freed (the retry buffer of a take that returned, which the
        taker's next take frees, or a round a killed taker never returned). Also fills
        ``self.claim_info``: claim key -> {"pid", "pttl_ms", "entries"}."""
        keys = Keys("", self.config.name)
        r = self.admin
        out: dict[int, tuple[str, int]] = {}
        self.claim_info = {}
        for key in r.scan_iter(match=keys.pattern[: -len(":*")] + ":c:*", count=1000):
            taker = key.decode().rsplit(":c:", 1)[1]
            pid = int(taker.split("-", 1)[0]) if taker.split("-", 1)[0].isdigit() else -1
            entries = r.lrange(key, 1, -1)
            self.claim_info[key.decode()] = {
                "pid": pid, "pttl_ms": r.pttl(key), "entries": len(entries)
            }  # fmt: skip
            for entry in entries:
                payload = entry_payload(r, entry)
                if payload is None:
                    continue
                for u in np.flatnonzero(np.frombuffer(payload, DTYPE)).tolist():
                    out[u] = (key.decode(), pid)
        return out

    def _account(self, logs: _Logs, acc: accumulator.ConditionalAccumulator) -> dict[str, Any]:
        taken = collections.Counter[int]()
        for take in logs.takes:
            odd = {int(k): v for k, v in take["odd"].items()}
            for u in take["ids"]:
                taken[u] += odd.get(u, 1)
        attempted = logs.attempted
        accepted = {u for u, ok in logs.outcome.items() if ok == 1}
        stale = {u for u, ok in logs.outcome.items() if ok == 0}
        unknown = attempted - logs.outcome.keys()
        claims = self._leftover_claims()
        lost = accepted - taken.keys()
        # Lost with a killed taker: in a round it claimed and never returned (a library
        # loss), or in one take_grad did return but the taker was killed before recording it
        # (the drill's own blind spot, a few microseconds wide).
        unrecorded = {
            u for u in lost if u in claims and claims[u][1] in logs.returned_unrecorded
        }  # fmt: skip
        in_killed = {
            u for u in lost - unrecorded if u in claims and claims[u][1] in logs.killed_takers
        }  # fmt: skip
        state = self.admin.hgetall(Keys("", self.config.name).state)
        c = self.config
        latencies = sorted(logs.latencies)
        return {
            "drill": c.name,
            "seed": c.seed,
            "payload_bytes": c.width * np.dtype(DTYPE).itemsize,
            "inline": c.width * np.dtype(DTYPE).itemsize <= INLINE_MAX_BYTES,
            "workers": c.workers,
            "claim_lease_s": c.claim_lease if claim_lease_supported() else None,
            "applies": len(attempted),
            "accepted": len(accepted),
            "stale": len(stale),
            "unknown": len(unknown),
            "unknown_raised": len(logs.raised),
            "unknown_taken": len(unknown & taken.keys()),
            "takes": len(logs.takes),
            "drain_takes": sum(1 for t in logs.takes if t.get("by") == "drain"),
            "gradients_taken": sum(taken.values()),
            "faults": dict(sorted(self.faults.items())),
            "redis_down_max_s": round(self.redis_down_max, 2),
            "lost": len(lost - in_killed - unrecorded),
            "lost_in_killed_taker": len(in_killed),
            "unrecorded_by_killed_taker": len(unrecorded),
            "doubled": sum(1 for n in taken.values() if n > 1),
            "stale_taken": len(stale & taken.keys()),
            "phantom": len(taken.keys() - attempted),
            "errors": dict(sorted(logs.errors.items())),
            "crashes": self.crashes,
            "hangs": self.hangs,
            "torn_records": logs.torn,
            "processes": dict(self.spawned),
            "op_seconds_p50": latencies[len(latencies) // 2] if latencies else None,
            "op_seconds_max": latencies[-1] if latencies else None,
            "server_n_applied": int(state.get(b"n_applied", -1)),
            "server_n_stale": int(state.get(b"n_stale", -1)),
            "server_n_adopted": int(state.get(b"n_adopted", 0)),
            "server_n_quarantined": int(state.get(b"n_quarantined", 0)),
            "caught_in_apply": sum(1 for f in self.fault_log if "inside apply_grad" in f[2]),
            "caught_in_take": sum(1 for f in self.fault_log if "inside take_grad" in f[2]),
            "left_pending": acc.num_accumulated(),
            "leftover_claims": self.claim_info,
            # details for a failure message (ids are positions in the one-hot vector)
            "examples": {
                "lost": sorted(lost - in_killed - unrecorded)[:20],
                "lost_in_killed_taker": sorted(in_killed)[:20],
                "doubled": sorted(u for u, n in taken.items() if n > 1)[:20],
                "stale_taken": sorted(stale & taken.keys())[:20],
                "phantom": sorted(taken.keys() - attempted)[:20],
            },
            "fault_log": self.fault_log,
        }


@dataclass
class _Logs:
    """What the processes' logs say, plus the drain's takes."""

    attempted: set[int] = field(default_factory=set)
    outcome: dict[int, int] = field(default_factory=dict)
    raised: set[int] = field(default_factory=set)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    takes: list[dict[str, Any]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    killed_takers: set[int] = field(default_factory=set)
    returned_unrecorded: set[int] = field(default_factory=set)  # killed after a take returned
    torn: int = 0


def summary_line(report: dict[str, Any]) -> str:
    faults = " ".join(f"{k}={v}" for k, v in report["faults"].items())
    errors = " ".join(f"{k}={v}" for k, v in report["errors"].items()) or "none"
    return (
        f"DRILL {report['drill']} ({report['payload_bytes']} B payloads, "
        f"{'inline' if report['inline'] else 'blob'}): {report['applies']} applies, "
        f"{report['accepted']} accepted, {report['stale']} stale, {report['unknown']} unknown "
        f"({report['unknown_raised']} raised, {report['unknown_taken']} of them taken), "
        f"{report['takes']} takes; faults {faults} (caught inside apply_grad "
        f"{report['caught_in_apply']}, inside take_grad holding a claim "
        f"{report['caught_in_take']}); lost {report['lost']}, "
        f"lost in a killed taker {report['lost_in_killed_taker']} (+"
        f"{report['unrecorded_by_killed_taker']} returned, unrecorded), "
        f"doubled {report['doubled']}, "
        f"stale taken {report['stale_taken']}, phantom {report['phantom']}; errors {errors}; "
        f"slowest step+apply {report['op_seconds_max']}s; {report['seconds']}s"
    )
