"""Recovery drills of issue 12 ("Tests that prove it"): real redis-servers, real processes,
exact accounting.

Gradients are float32 one-hot vectors of a SUM accumulator: gradient number ``u`` has a 1.0
at position ``u`` and zeros elsewhere, and every ``apply_grad`` call of a drill has a
position of its own (worker ``i`` uses ``i * block``, ``i * block + 1``, ...). A take's
result therefore says exactly which gradients it holds: a 1.0 at ``u`` is gradient ``u``
once, anything else at a position (2.0, ...) is a gradient counted twice. Sums of 0.0/1.0 are
exact in float32.

Every process logs each outcome durably (one ``os.write`` per record, see ``_drill._Log``)
before it can be killed:

- worker: ``S <u> <step>`` before ``apply_grad``, ``R <u> <1|0> <seconds>`` after it
  returned (accepted / stale), ``E <ExcType> <message>`` when anything raised (the process
  then dies: nothing is retried at this level, the library's retry window is on trial);
- chief: ``P <pid> <monotonic>`` at start, ``T <json>`` for every take that returned
  (``ids``, ``odd`` positions whose value is not 1.0, ``t`` = monotonic time it returned),
  ``K <mode> <phase> <seconds in phase> <takes made> <monotonic>`` just before it SIGKILLs
  itself, ``E ...``;
  ``D`` when it stopped as asked.

Drills (all ``slow``; ``ACCUMULATOR_DRILL_SEED`` repeats a run):

1. ``test_chief_killed_mid_take_16mib``: the chief SIGKILLs itself 10 times at a random moment
   inside ``take_grad`` (16 MiB gradients, 3 workers applying once per step at the current
   ``global_step()``, with 0-0.2 s of "compute" between applies: each take reads 48 MiB),
   each kill aimed at one of ``KILL_MODES`` (each at least twice): anywhere inside the call
   (which mostly means holding a claim), holding a claimed round (reading or reducing it),
   waiting in the FIFO, and just after its claiming take script was sent; the parent
   restarts it every time. Every accepted gradient is in exactly one recorded take (a dead
   chief's claimed round comes back whole, in one take), nothing is doubled, nothing but
   the accumulator's state (and expiring retry records) is left in Redis, and every
   restarted chief takes within ``RESTART_LIMIT`` seconds of being started (library
   defaults: taker lease 6 s, claim lease 5 s + 50 ms/MiB, wait slice 2 s). The summary
   also gives, per kill, what the dead chief left (a claim and its lease, or a FIFO place)
   and how long after the kill its round was taken.

   Blind spot, made as small as it can be: the library delivers a round at most once (the
   take's last call, the ``finish`` script, frees it), so a chief killed after that call
   was sent and before the caller recorded the result loses the round for the caller, not
   for the library (README, "A crashed taker loses nothing"). The chief's kill thread holds
   a lock while it decides and kills; the chief takes the same lock before it sends the
   ``finish`` script (observed by wrapping ``accumulator._scripts.call`` in the chief
   process) and again to clear its "inside take_grad" flag after the call returned. So no
   kill lands from the moment ``finish`` is sent until the record is written: every kill is
   inside ``take_grad`` at a point where the round must survive, and the accounting is exact
   (no loss is excused). Kills during the ``finish`` round trip itself are not drilled.

2. ``test_raw_job_survives_redis_restarts``: 1 chief + 3 workers on the raw API (a sync-style
   job without ``accumulator.sync``), Redis with AOF ``appendfsync always``: ``SHUTDOWN``,
   5 s down, start; then ``kill -9``, 5 s down, start. Every process must be alive at the end
   (none died of a ``ConnectionError``/``UnavailableError``), the job must progress after each
   restart, and the accounting must be exact.

3. ``test_sync_job_survives_redis_restarts``: the same faults for an ``accumulator.sync`` job
   (``ParameterServer`` + 3 ``Worker``), SUM reduction, ``update`` = ``params + grads``: the
   final published parameters are themselves the count of every gradient.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from _drill import _describe, _Log
from _helpers import entry_payload

import accumulator
from accumulator._keys import Keys
from accumulator.testing import RedisServer, find_server_binary

DTYPE = np.float32
#: 4 Mi float32 elements: 16 MiB per gradient, 48 MiB per take of 3.
BIG_WIDTH = 4 * 1024 * 1024
#: 64 KiB per gradient: above the 32 KiB inline limit (payload keys, the harder path).
SMALL_WIDTH = 16 * 1024
WORKERS = 3
KILLS = 10
#: A restarted chief must make its first take within this many seconds of being started.
RESTART_LIMIT = 15.0
#: Redis is down this long at each fault of drills 2 and 3.
DOWN_SECONDS = 5.0
#: Takes the job must make after each Redis restart before the next fault.
PROGRESS_TAKES = 10
#: Mean seconds a drill-1 worker "computes" between applies: the chief sometimes waits.
WORKER_THINK = 0.1
SEED = int(os.environ.get("ACCUMULATOR_DRILL_SEED", str(random.randrange(10**6))))

pytestmark = pytest.mark.skipif(
    find_server_binary() is None, reason="no redis-server binary (scripts/test.sh installs one)"
)


# -- processes -------------------------------------------------------------------------------


def _block(width: int) -> int:
    """Ids per worker: worker ``i`` owns positions ``[i * block, (i + 1) * block)``."""
    return min(100_000, width // WORKERS)


def _take_record(total: np.ndarray, returned: float, seconds: float) -> dict[str, Any]:
    ids = np.flatnonzero(total)
    odd = {int(i): float(total[i]) for i in ids[total[ids] != 1]}
    return {"ids": ids.tolist(), "odd": odd, "t": round(returned, 4), "s": round(seconds, 4)}


def worker_main(
    url: str, name: str, width: int, index: int, log_path: str, stop_path: str, think: float
) -> None:
    """Apply one gradient per global step, at the accumulator's current step, until stopped;
    ``think``: mean seconds of "computing" between two applies (uniform in 0..2x)."""
    log = _Log(log_path)
    rng = random.Random(os.getpid())
    log(f"P {os.getpid()} {time.monotonic():.4f}")
    try:
        acc = accumulator.ConditionalAccumulator(
            DTYPE, shape=(width,), shared_name=name, reduction_type="SUM", client=url
        )
        grad = np.zeros(width, DTYPE)
        u, end = index * _block(width), (index + 1) * _block(width)
        last = None
        while not os.path.exists(stop_path) and u < end:
            step = acc.global_step()
            if step == last:  # one gradient per step, as a synchronous replica
                time.sleep(0.01)
                continue
            grad[u] = 1
            log(f"S {u} {step}")
            started = time.monotonic()
            ok = acc.apply_grad(grad, local_step=step)
            log(f"R {u} {int(ok)} {time.monotonic() - started:.4f}")
            grad[u] = 0
            u += 1
            last = step
            if think:
                time.sleep(rng.uniform(0, 2 * think))
    except BaseException as exc:
        log(f"E {_describe(exc)}")
        raise
    log("D")


#: Where in a take the chief kills itself (cycled through, see ``chief_main``).
KILL_MODES = ("anywhere", "claim", "waiting", "take-script")
#: A kill aimed at a phase the chief does not reach within this many seconds lands anywhere
#: inside take_grad instead (recorded as ``<mode>-fallback``).
AIM_SECONDS = 10.0


def chief_main(
    url: str, name: str, width: int, log_path: str, stop_path: str, kill_mode: str | None,
    kill_after: int, seed: int,
) -> None:  # fmt: skip
    """Take rounds of 3 and record each; with ``kill_mode``, SIGKILL itself inside a take
    once it has made ``kill_after`` takes:

    - ``"anywhere"``: after a random delay (0-1 s), the first moment it is inside
      ``take_grad``;
    - ``"claim"``: holding a claimed round, a random moment (0-100 ms) into reading and
      reducing it;
    - ``"waiting"``: waiting in the FIFO for gradients, a random moment (0-50 ms) into it;
    - ``"take-script"``: 0-1 ms after its take script (the one that claims) was sent.

    Never from the moment the take's ``finish`` script is sent until the take is recorded
    (see the module docstring). The phase is observed by wrapping ``_scripts.call``."""
    log = _Log(log_path)
    log(f"P {os.getpid()} {time.monotonic():.4f}")
    lock = threading.Lock()
    rng = random.Random(seed)
    st: dict[str, Any] = {
        "inside": False, "phase": "-", "since": time.monotonic(), "takes": 0, "armed": False,
        "mode": kill_mode,
    }  # fmt: skip

    def set_phase(phase: str) -> None:
        st["phase"], st["since"] = phase, time.monotonic()

    def kill_now() -> None:  # called with the lock held
        log(f"K {st['mode']} {st['phase']} {time.monotonic() - st['since']:.4f} {st['takes']} "
            f"{time.monotonic():.4f}")  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    def kill_if_inside() -> None:
        with lock:
            if st["inside"] and st["phase"] not in ("finishing", "finished"):
                kill_now()

    from accumulator import _scripts

    original = _scripts.call

    def call(client: Any, script: str, *args: Any, **kwargs: Any) -> Any:
        if script == "finish":
            with lock:  # from here on the round may be delivered: no kill
                set_phase("finishing")
        elif script in ("take", "leave"):
            set_phase(f"{script}-script")
            if script == "take" and st["armed"]:
                threading.Timer(rng.uniform(0, 0.001), kill_if_inside).start()
        reply = original(client, script, *args, **kwargs)
        if script == "take":
            set_phase("holding-claim" if int(reply[0]) == 1 else "waiting")
        elif script == "finish":
            set_phase("finished")
        elif script == "leave":
            set_phase("left")
        return reply

    _scripts.call = call  # type: ignore[assignment]

    def killer() -> None:
        while st["takes"] < kill_after:
            time.sleep(0.002)
        armed = time.monotonic()
        if kill_mode == "anywhere":
            time.sleep(rng.uniform(0, 1.0))
        elif kill_mode == "take-script":
            st["armed"] = True
        target = {"claim": "holding-claim", "waiting": "waiting"}.get(str(kill_mode))
        hold = rng.uniform(0, 0.1 if kill_mode == "claim" else 0.05)
        while True:
            if kill_mode == "anywhere" or time.monotonic() - armed > AIM_SECONDS:
                if kill_mode != "anywhere":
                    st["mode"], st["armed"] = f"{kill_mode}-fallback", False
                kill_if_inside()
                time.sleep(0.0005)
            elif target is None or st["phase"] != target:
                time.sleep(0.0005)
            else:
                time.sleep(max(0.0, hold - (time.monotonic() - st["since"])))
                with lock:
                    if st["inside"] and st["phase"] == target:
                        kill_now()
                hold /= 2  # the phase ended too soon: aim earlier into the next one

    try:
        acc = accumulator.ConditionalAccumulator(
            DTYPE, shape=(width,), shared_name=name, reduction_type="SUM", client=url
        )
        if kill_mode:
            threading.Thread(target=killer, daemon=True).start()
        while not os.path.exists(stop_path):
            set_phase("-")
            st["inside"] = True
            started = time.monotonic()
            try:
                total = acc.take_grad(3, timeout=3.0)
            except accumulator.DeadlineExceededError:
                with lock:
                    st["inside"] = False
                continue
            except BaseException:
                with lock:
                    st["inside"] = False
                raise
            with lock:
                st["inside"] = False
            now = time.monotonic()
            log("T " + json.dumps(_take_record(total, now, now - started)))
            st["takes"] += 1
    except BaseException as exc:
        log(f"E {_describe(exc)}")
        raise
    log("D")


def sync_chief_main(url: str, job: str, width: int, log_path: str, stop_path: str) -> None:
    """An ``accumulator.sync`` chief: SUM of 3 gradients per step, ``params += grads`` (so
    the published parameters count every gradient), each step's gradient recorded."""
    from accumulator.sync import ParameterServer

    log = _Log(log_path)
    log(f"P {os.getpid()} {time.monotonic():.4f}")
    try:
        ps = ParameterServer(job, replicas_to_aggregate=WORKERS, reduction_type="SUM", client=url)
        ps.initialize({"w": np.zeros(width, DTYPE)})

        def update(params: dict[str, np.ndarray], grads: dict[str, Any], step: int) -> Any:
            now = time.monotonic()
            log("T " + json.dumps(_take_record(grads["w"], now, 0.0) | {"step": step}))
            return {"w": params["w"] + grads["w"]}

        while not os.path.exists(stop_path):
            try:
                ps.step(update, timeout=3.0)
            except accumulator.DeadlineExceededError:
                continue
        ps.finish()
        final = ps.params["w"]
        log("F " + json.dumps(_take_record(final, time.monotonic(), 0.0)))
        ps.close()
    except BaseException as exc:
        log(f"E {_describe(exc)}")
        raise
    log("D")


def sync_worker_main(
    url: str, job: str, width: int, index: int, log_path: str, stop_path: str, think: float
) -> None:
    """An ``accumulator.sync`` worker: pull, push a one-hot gradient at the pulled step, pull
    the next step, until the job is finished."""
    from accumulator.sync import TrainingFinished, Worker

    log = _Log(log_path)
    log(f"P {os.getpid()} {time.monotonic():.4f}")
    try:
        worker = Worker(job, client=url)
        step, _ = worker.pull(timeout=60)
        grad = np.zeros(width, DTYPE)
        u, end = index * _block(width), (index + 1) * _block(width)
        while not worker.finished and u < end:
            grad[u] = 1
            log(f"S {u} {step}")
            started = time.monotonic()
            try:
                ok = worker.push(step, {"w": grad})["w"]
            except TrainingFinished:  # finished between the pull and the push: not applied
                log(f"R {u} 0 {time.monotonic() - started:.4f}")
                break
            log(f"R {u} {int(ok)} {time.monotonic() - started:.4f}")
            grad[u] = 0
            u += 1
            if think:
                time.sleep(think)
            try:
                step, _ = worker.pull(after=step, timeout=60)
            except TrainingFinished:
                break
        worker.close()
    except BaseException as exc:
        log(f"E {_describe(exc)}")
        raise
    log("D")


# -- logs and accounting ---------------------------------------------------------------------


@dataclass
class _Proc:
    role: str  # "chief" | "worker"
    proc: Any
    log: Path
    started: float  # monotonic, just before start()


@dataclass
class _Parsed:
    """What the processes' logs (and the parent's own takes) say."""

    attempted: set[int] = field(default_factory=set)
    outcome: dict[int, int] = field(default_factory=dict)
    takes: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    finals: list[dict[str, Any]] = field(default_factory=list)
    apply_seconds: list[float] = field(default_factory=list)
    torn: int = 0


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def _takes_of(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in _lines(path):
        if line.startswith("T "):
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line[2:]))
    return out


def _parse(procs: list[_Proc]) -> _Parsed:
    parsed = _Parsed()
    for p in procs:
        for line in _lines(p.log):
            tag, _, rest = line.partition(" ")
            try:
                if tag == "S":
                    parsed.attempted.add(int(rest.split()[0]))
                elif tag == "R":
                    u, ok, secs = rest.split()
                    parsed.outcome[int(u)] = int(ok)
                    parsed.apply_seconds.append(float(secs))
                elif tag == "T":
                    parsed.takes.append(json.loads(rest) | {"by": p.log.name})
                elif tag == "F":
                    parsed.finals.append(json.loads(rest))
                elif tag == "E":
                    parsed.errors.append(f"{p.log.name}: {rest}")
            except (ValueError, json.JSONDecodeError):
                parsed.torn += 1
    return parsed


def _account(parsed: _Parsed) -> dict[str, Any]:
    taken = collections.Counter[int]()
    for take in parsed.takes:
        odd = {int(k): v for k, v in take["odd"].items()}
        for u in take["ids"]:
            taken[u] += int(round(odd.get(u, 1.0)))
    accepted = {u for u, ok in parsed.outcome.items() if ok == 1}
    stale = {u for u, ok in parsed.outcome.items() if ok == 0}
    unknown = parsed.attempted - parsed.outcome.keys()
    lost = accepted - taken.keys()
    doubled = {u for u, n in taken.items() if n > 1}
    return {
        "applies": len(parsed.attempted),
        "accepted": len(accepted),
        "stale": len(stale),
        "unknown": len(unknown),
        "takes": len(parsed.takes),
        "gradients_taken": sum(taken.values()),
        "lost": len(lost),
        "doubled": len(doubled),
        "stale_taken": len(stale & taken.keys()),
        "phantom": len(taken.keys() - parsed.attempted),
        "errors": parsed.errors,
        "torn": parsed.torn,
        "examples": {
            "lost": sorted(lost)[:20],
            "doubled": sorted(doubled)[:20],
            "unknown": sorted(unknown)[:20],
            "stale_taken": sorted(stale & taken.keys())[:20],
        },
        "taken": taken,
    }


def _exact_problems(acc: dict[str, Any]) -> list[str]:
    problems = []
    for what in ("lost", "doubled", "stale_taken", "phantom", "unknown"):
        if acc[what]:
            problems.append(f"{what}: {acc[what]} (e.g. ids {acc['examples'].get(what)})")
    if acc["errors"]:
        problems.append(f"client operations raised: {acc['errors']}")
    if acc["torn"]:
        problems.append(f"{acc['torn']} unreadable log records")
    return problems


def _leftover_keys(r: redis.Redis, name: str) -> tuple[dict[str, str], list[str]]:
    """Every key of accumulator ``name`` left in Redis, described, and what is wrong with
    them: allowed are the state hash ``:s``, a claim registry ``:cl`` holding only ``done``
    marks (written by earlier clients), the finished takes ``:cd`` (expiring) and retry
    records ``:d:<client>`` with an expiry (DEDUP_TTL: 10 minutes)."""
    keys = Keys("", name)
    listing: dict[str, str] = {}
    problems: list[str] = []
    for raw in sorted(r.scan_iter(match=keys.pattern, count=1000)):
        key = raw.decode()
        suffix = key[len(keys.base) + 1 :]
        kind = suffix.split(":", 1)[0]
        ktype = r.type(raw).decode()
        ttl = r.pttl(raw)
        size = r.memory_usage(raw) or 0
        expiry = "no expiry" if ttl < 0 else f"expires in {ttl / 1000:.0f}s"
        desc = f"{ktype}, {size} B, {expiry}"
        if kind == "cl":
            marks = r.hgetall(raw)
            desc += f", {len(marks)} entries {sorted({v.decode() for v in marks.values()})}"
            if any(not v.startswith(b"done") for v in marks.values()):
                problems.append(f"{key}: claim registry holds live leases: {marks}")
        elif kind == "cd":
            if ttl < 0 or ktype != "zset":
                problems.append(f"{key}: finished takes ({desc}) kept without expiry")
        elif kind == "d":
            if ttl < 0:
                problems.append(f"{key}: retry record without expiry")
        elif kind != "s":
            problems.append(f"{key} ({desc}) is left behind")
        listing[suffix] = desc
    return listing, problems


def _wait(predicate: Callable[[], bool], seconds: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > seconds:
            raise AssertionError(f"{what}: not within {seconds:g}s")
        time.sleep(0.05)
    return time.monotonic() - started


def _spawn(ctx: Any, role: str, target: Any, log: Path, *args: Any) -> _Proc:
    started = time.monotonic()
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return _Proc(role, proc, log, started)


def _stop_all(procs: list[_Proc], stop: Path, seconds: float) -> list[str]:
    """Ask every process to stop, wait for it; SIGKILL and report what hangs."""
    stop.write_text("stop\n")
    hangs = []
    deadline = time.monotonic() + seconds
    for p in procs:
        p.proc.join(max(0.1, deadline - time.monotonic()))
        if p.proc.is_alive():
            hangs.append(f"{p.log.name} did not stop within {seconds:g}s")
            os.kill(p.proc.pid, signal.SIGKILL)
            p.proc.join(10)
    return hangs


def _kill_all(procs: list[_Proc]) -> None:
    for p in procs:
        if p.proc.is_alive():
            os.kill(p.proc.pid, signal.SIGKILL)
            p.proc.join(10)


def _drain(acc: accumulator.ConditionalAccumulator, parsed: _Parsed, claim_wait: float) -> None:
    """The parent takes what is left after the processes stopped: the pending round, then any
    claimed round still in Redis (handed over once its lease ran out)."""
    left = acc.num_accumulated()
    if left:
        total = acc.take_grad(left, timeout=30)
        parsed.takes.append(_take_record(total, time.monotonic(), 0.0) | {"by": "drain"})
    pattern = Keys("", acc.shared_name or "").pattern[: -len(":*")] + ":c:*"
    while list(acc.redis.scan_iter(match=pattern, count=1000)):
        try:
            total = acc.take_grad(1, timeout=claim_wait)
        except accumulator.DeadlineExceededError:
            return
        parsed.takes.append(_take_record(total, time.monotonic(), 0.0) | {"by": "drain-claim"})


def _left_by(r: redis.Redis, name: str, pid: int) -> tuple[str, set[int]]:
    """What dead taker process ``pid`` left in Redis: a claim (its lease, and the gradient
    ids in it), a place in the FIFO (and its lease)."""
    keys = Keys("", name)
    now_s, now_us = r.time()
    now_ms = now_s * 1000 + now_us // 1000
    out, ids = [], set()
    for key in r.scan_iter(match=f"{keys.pattern[:-2]}:c:{pid}-*", count=1000):
        taker = key.decode().rsplit(":c:", 1)[1]
        mark = r.hget(keys.claims, taker)
        lease = (
            "no lease" if mark is None else "done" if mark.startswith(b"done")
            else f"lease {(int(mark) - now_ms) / 1000:.1f}s left"
        )  # fmt: skip
        entries = r.lrange(key, 1, -1)
        for entry in entries:
            payload = entry_payload(r, entry)
            if payload is not None:
                ids.update(np.flatnonzero(np.frombuffer(payload, DTYPE)).tolist())
        out.append(f"claim of {len(entries)} gradients ({lease})")
    for taker in r.zrange(keys.takers, 0, -1):
        if taker.startswith(f"{pid}-".encode()):
            info = r.hget(keys.taker_info, taker)
            left = (int(info.split()[1]) - now_ms) / 1000 if info else float("nan")
            out.append(f"FIFO place (lease {left:.1f}s left)")
    return "; ".join(out) or "nothing", ids


def _percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    v = sorted(values)
    return (
        f"min {v[0]:.2f}s, median {statistics.median(v):.2f}s, max {v[-1]:.2f}s "
        f"(all: {', '.join(f'{x:.2f}' for x in values)})"
    )


@pytest.fixture
def aof_server() -> Iterator[RedisServer]:
    """A server of this test's own with AOF, fsync always, kept across kill -9 + start."""
    with RedisServer(persistent=True, startup_timeout=60) as server:
        yield server


# -- drill 1: the chief killed mid-take, 16 MiB gradients ------------------------------------


@pytest.mark.slow
def test_chief_killed_mid_take_16mib(tmp_path):
    rng = random.Random(SEED)
    name = "recovery-chief-kill"
    stop = tmp_path / "STOP"
    ctx = mp.get_context("spawn")
    started = time.monotonic()
    with RedisServer(startup_timeout=60) as server:
        url = server.url
        admin = server.client(socket_timeout=30)
        acc = accumulator.ConditionalAccumulator(
            DTYPE, shape=(BIG_WIDTH,), shared_name=name, reduction_type="SUM", client=url
        )
        workers = [
            _spawn(ctx, "worker", worker_main, tmp_path / f"worker-{i}.log",
                   url, name, BIG_WIDTH, i, str(tmp_path / f"worker-{i}.log"), str(stop),
                   WORKER_THINK)
            for i in range(WORKERS)
        ]  # fmt: skip
        chiefs: list[_Proc] = []
        kills: list[dict[str, Any]] = []
        problems: list[str] = []
        modes = [*KILL_MODES, *KILL_MODES, *rng.sample(KILL_MODES, KILLS - 2 * len(KILL_MODES))]
        rng.shuffle(modes)
        try:
            for i in range(KILLS + 1):
                mode = modes[i] if i < KILLS else None
                log = tmp_path / f"chief-{i:02d}.log"
                chief = _spawn(ctx, "chief", chief_main, log, url, name, BIG_WIDTH, str(log),
                               str(stop), mode, rng.randint(1, 2),
                               rng.randrange(10**9))  # fmt: skip
                chiefs.append(chief)
                if mode is None:
                    break
                chief.proc.join(120)
                if chief.proc.is_alive():
                    problems.append(f"{log.name}: never killed itself within 120s")
                    os.kill(chief.proc.pid, signal.SIGKILL)
                    chief.proc.join(10)
                k = [x.split() for x in _lines(log) if x.startswith("K ")]
                left, ids = _left_by(admin, name, chief.proc.pid)
                kills.append({
                    "chief": log.name, "exit": chief.proc.exitcode, "aim": mode,
                    "mode": k[-1][1] if k else None, "phase": k[-1][2] if k else None,
                    "in_phase_s": float(k[-1][3]) if k else None,
                    "takes_before": int(k[-1][4]) if k else None,
                    "t": float(k[-1][5]) if k else None, "left": left, "claimed_ids": ids,
                })  # fmt: skip
                if chief.proc.exitcode != -signal.SIGKILL or not k:
                    problems.append(f"{log.name}: exit code {chief.proc.exitcode}, kill "
                                    f"record {k}; log tail {_lines(log)[-3:]}")  # fmt: skip
                dead = [w.log.name for w in workers if not w.proc.is_alive()]
                if dead:
                    problems.append(f"workers died: {dead}")
                    break
            last = chiefs[-1]
            claims = Keys("", name).pattern[: -len(":*")] + ":c:*"
            # the last chief runs until every dead chief's claim was handed over
            _wait(lambda: (len(_takes_of(last.log)) >= 2
                           and not list(admin.scan_iter(match=claims))) or not last.proc.is_alive(),
                  90, "the last chief did not take over every claim")  # fmt: skip
            problems += _stop_all([*workers, last], stop, 30)
        finally:
            _kill_all([*workers, *chiefs])
        for p in [*workers, chiefs[-1]]:
            if p.proc.exitcode != 0:
                problems.append(f"{p.log.name}: exit code {p.proc.exitcode}")
        procs = [*workers, *chiefs]
        parsed = _parse(procs)
        _drain(acc, parsed, claim_wait=30)
        result = _account(parsed)
        state = admin.hgetall(Keys("", name).state)
        leftover, key_problems = _leftover_keys(admin, name)
        acc.close()
    restart = []
    for chief in chiefs[1:]:
        first = _takes_of(chief.log)
        restart.append(first[0]["t"] - chief.started if first else float("inf"))
    # a dead chief's claimed round: in which take it came back, how long after the kill
    handover = []
    for k in kills:
        if not k["claimed_ids"]:
            k["handover"] = "-"
            continue
        back = [t for t in parsed.takes if k["claimed_ids"] <= set(t["ids"])]
        if back and k["t"] is not None:
            handover.append(back[0]["t"] - k["t"])
            by = back[0]["by"]
            k["handover"] = f"whole round taken {handover[-1]:.2f}s after the kill by {by}"
        else:
            k["handover"] = "NOT taken whole"
            problems.append(f"{k['chief']}: its claimed round {sorted(k['claimed_ids'])} never "
                            "came back whole in one take")  # fmt: skip
    first_start = _takes_of(chiefs[0].log)
    phases = collections.Counter(str(k["phase"]) for k in kills)
    lines = [
        f"DRILL chief-kill (seed {SEED}; 3 workers x 16 MiB float32, take_grad(3) = 48 MiB): "
        f"{len(kills)} kills, {result['takes']} takes "
        f"({sum(1 for t in parsed.takes if t['by'].startswith('drain'))} by the final drain), "
        f"{result['applies']} applies, {result['accepted']} accepted, {result['stale']} stale, "
        f"{result['unknown']} unknown; lost {result['lost']}, doubled {result['doubled']}, "
        f"stale taken {result['stale_taken']}, phantom {result['phantom']}; "
        f"rounds handed over (server n_adopted) {int(state.get(b'n_adopted', 0))}; "
        f"server n_applied {int(state.get(b'n_applied', -1))}; "
        f"{time.monotonic() - started:.1f}s",
        f"  kills by phase: {dict(phases)}",
        *(f"  {k['chief']}: aimed {k['aim']}, killed {k['mode']} in {k['phase']} "
          f"(+{k['in_phase_s']}s, after {k['takes_before']} takes), exit {k['exit']}; left: "
          f"{k['left']}; {k['handover']}" for k in kills),
        f"  first chief start -> first take: "
        f"{(first_start[0]['t'] - chiefs[0].started) if first_start else float('nan'):.2f}s",
        f"  restart -> first take ({len(restart)} restarts): {_percentiles(restart)}",
        f"  kill -> dead chief's claimed round taken ({len(handover)}): "
        f"{_percentiles(handover)}",
        f"  apply_grad 16 MiB: median {statistics.median(parsed.apply_seconds or [0]):.3f}s, "
        f"max {max(parsed.apply_seconds or [0]):.3f}s",
        f"  keys left: {leftover}",
    ]  # fmt: skip
    print("\n" + "\n".join(lines))
    problems += _exact_problems(result) + key_problems
    if len(kills) != KILLS:
        problems.append(f"{len(kills)} kills instead of {KILLS}")
    slow = [(c.log.name, round(s, 2)) for c, s in zip(chiefs[1:], restart, strict=True)
            if s >= RESTART_LIMIT]  # fmt: skip
    if slow:
        problems.append(f"restarted chiefs slower than {RESTART_LIMIT:g}s to their first take: "
                        f"{slow}")  # fmt: skip
    if int(state.get(b"n_applied", -1)) != result["accepted"]:
        problems.append(f"server n_applied {state.get(b'n_applied')} != accepted "
                        f"{result['accepted']}")  # fmt: skip
    if result["accepted"] < 30:
        problems.append("too little traffic to mean much")
    assert not problems, "\n".join(lines) + "\nPROBLEMS:\n" + "\n".join(problems)


# -- drills 2 and 3: a job through Redis SHUTDOWN and kill -9 --------------------------------


def _shutdown(server: RedisServer) -> bytes:
    """``SHUTDOWN`` (the AOF is fsynced, the server exits), sent on a plain socket: redis-py's
    ``shutdown()`` spends seconds retrying the connection the server closed. Returns the
    server's reply: nothing, or why it refused."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"SHUTDOWN\r\n")
        try:
            return sock.recv(1024)
        except OSError:
            return b""


def _redis_faults(
    server: RedisServer, chief_log: Path, procs: list[_Proc], step_of: Callable[[], int]
) -> tuple[list[dict[str, Any]], list[str]]:
    """SHUTDOWN, DOWN_SECONDS, start; kill -9, DOWN_SECONDS, start; after each restart wait for
    PROGRESS_TAKES more takes. Returns what happened and what went wrong."""
    problems: list[str] = []
    _wait(lambda: len(_takes_of(chief_log)) >= PROGRESS_TAKES, 90, "the job did not start")
    done = []
    for fault in ("SHUTDOWN", "kill -9"):
        step_before = step_of()
        t0 = time.monotonic()
        if fault == "SHUTDOWN":
            reply = _shutdown(server)
            _wait(lambda: not server.running, 30,
                  f"redis-server did not exit on SHUTDOWN (reply {reply!r})")  # fmt: skip
        else:
            server.kill()
        time.sleep(DOWN_SECONDS)
        server.start()
        back = time.monotonic()
        step_after = step_of()

        def progressed(back: float = back) -> bool:
            return sum(t["t"] > back for t in _takes_of(chief_log)) >= PROGRESS_TAKES

        try:
            _wait(progressed,
                  60, f"after {fault} + restart the job made fewer than {PROGRESS_TAKES} "
                  "takes")  # fmt: skip
        except AssertionError as exc:
            problems.append(str(exc))
        after = [t["t"] for t in _takes_of(chief_log) if t["t"] > back]
        dead = [f"{p.log.name} (exit {p.proc.exitcode}; {_lines(p.log)[-1:]})"
                for p in procs if not p.proc.is_alive()]  # fmt: skip
        done.append({
            "fault": fault, "down_s": round(back - t0, 2), "step_before": step_before,
            "step_after_restart": step_after,
            "first_take_after_restart_s": round(min(after) - back, 2) if after else None,
            "dead": dead,
        })  # fmt: skip
        if step_after < step_before:
            problems.append(f"{fault}: the step went back from {step_before} to {step_after} "
                            "(state lost with the restart)")  # fmt: skip
        if dead:
            problems.append(f"{fault}: processes died: {dead}")
            break
    return done, problems


def _outage_report(
    title: str, result: dict[str, Any], faults: list[dict[str, Any]], seconds: float,
    extra: str = "",
) -> list[str]:  # fmt: skip
    return [
        f"DRILL {title}: {result['takes']} takes, {result['applies']} applies, "
        f"{result['accepted']} accepted, {result['stale']} stale, {result['unknown']} unknown; "
        f"lost {result['lost']}, doubled {result['doubled']}, stale taken "
        f"{result['stale_taken']}, phantom {result['phantom']}; errors {result['errors'] or 0}"
        f"{extra}; {seconds:.1f}s",
        *(f"  {f['fault']}: down {f['down_s']}s, step {f['step_before']} -> "
          f"{f['step_after_restart']} after restart, first take "
          f"{f['first_take_after_restart_s']}s after restart; dead: {f['dead'] or 'none'}"
          for f in faults),
    ]  # fmt: skip


@pytest.mark.slow
def test_raw_job_survives_redis_restarts(aof_server, tmp_path):
    name = "recovery-raw-job"
    stop = tmp_path / "STOP"
    ctx = mp.get_context("spawn")
    url = aof_server.url
    started = time.monotonic()
    acc = accumulator.ConditionalAccumulator(
        DTYPE, shape=(SMALL_WIDTH,), shared_name=name, reduction_type="SUM", client=url
    )
    chief_log = tmp_path / "chief.log"
    procs = [
        _spawn(ctx, "chief", chief_main, chief_log, url, name, SMALL_WIDTH, str(chief_log),
               str(stop), None, 0, 0),
        *(_spawn(ctx, "worker", worker_main, tmp_path / f"worker-{i}.log", url, name,
                 SMALL_WIDTH, i, str(tmp_path / f"worker-{i}.log"), str(stop), 0.02)
          for i in range(WORKERS)),
    ]  # fmt: skip
    try:
        faults, problems = _redis_faults(aof_server, chief_log, procs, acc.global_step)
        problems += _stop_all(procs, stop, 30)
    finally:
        _kill_all(procs)
    problems += [f"{p.log.name}: exit code {p.proc.exitcode}" for p in procs if p.proc.exitcode]
    parsed = _parse(procs)
    _drain(acc, parsed, claim_wait=30)
    result = _account(parsed)
    n_applied = int(acc.redis.hget(Keys("", name).state, "n_applied") or -1)
    leftover, key_problems = _leftover_keys(acc.redis, name)
    acc.close()
    lines = _outage_report(
        "raw job through Redis SHUTDOWN and kill -9 (1 chief + 3 workers, 64 KiB float32, AOF "
        "always)", result, faults, time.monotonic() - started,
        extra=f"; server n_applied {n_applied}; keys left {leftover}",
    )  # fmt: skip
    print("\n" + "\n".join(lines))
    problems += _exact_problems(result) + key_problems
    if n_applied != result["accepted"]:
        problems.append(f"server n_applied {n_applied} != accepted {result['accepted']}")
    assert not problems, "\n".join(lines) + "\nPROBLEMS:\n" + "\n".join(problems)


@pytest.mark.slow
def test_sync_job_survives_redis_restarts(aof_server, tmp_path):
    sync = pytest.importorskip("accumulator.sync")
    job = "recovery-sync-job"
    stop = tmp_path / "STOP"
    ctx = mp.get_context("spawn")
    url = aof_server.url
    started = time.monotonic()
    chief_log = tmp_path / "chief.log"
    chief = _spawn(ctx, "chief", sync_chief_main, chief_log, url, job, SMALL_WIDTH,
                   str(chief_log), str(stop))  # fmt: skip
    admin = aof_server.client(socket_timeout=10)
    params_key = sync.SyncKeys("", job).params

    def step_of() -> int:
        for _ in range(200):
            try:
                return int(admin.hget(params_key, "step") or -1)
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.1)
        return -1

    procs = [chief]
    try:
        _wait(lambda: step_of() >= 0 or not chief.proc.is_alive(), 60,
              "the sync chief did not publish the job")  # fmt: skip
        procs += [
            _spawn(ctx, "worker", sync_worker_main, tmp_path / f"worker-{i}.log", url, job,
                   SMALL_WIDTH, i, str(tmp_path / f"worker-{i}.log"), str(stop), 0.02)
            for i in range(WORKERS)
        ]  # fmt: skip
        faults, problems = _redis_faults(aof_server, chief_log, procs, step_of)
        problems += _stop_all(procs, stop, 60)
    finally:
        _kill_all(procs)
    problems += [f"{p.log.name}: exit code {p.proc.exitcode}" for p in procs if p.proc.exitcode]
    parsed = _parse(procs)
    acc = accumulator.ConditionalAccumulator(
        DTYPE, shape=(SMALL_WIDTH,), shared_name=sync.accumulator_name(job, "w"),
        reduction_type="SUM", client=url,
    )  # fmt: skip
    # pushes of the last step, never taken by the finished job: taken here
    _drain(acc, parsed, claim_wait=30)
    result = _account(parsed)
    leftover, key_problems = _leftover_keys(acc.redis, sync.accumulator_name(job, "w"))
    acc.close()
    # the published parameters count every gradient the chief's steps took
    final = parsed.finals[-1] if parsed.finals else None
    chief_taken = collections.Counter[int]()
    for take in parsed.takes:
        if not take["by"].startswith("drain"):
            chief_taken.update(take["ids"])
    if final is None:
        problems.append("the chief wrote no final parameters")
    elif final["odd"] or set(final["ids"]) != set(chief_taken):
        problems.append(
            f"final parameters disagree with the steps' gradients: {len(final['ids'])} ids, "
            f"odd {dict(list(final['odd'].items())[:10])}, steps took {len(chief_taken)}"
        )
    lines = _outage_report(
        "accumulator.sync job through Redis SHUTDOWN and kill -9 (1 chief + 3 workers, 64 KiB "
        "float32, AOF always)", result, faults, time.monotonic() - started,
        extra=f"; final params hold {len(final['ids']) if final else '?'} gradients; keys "
        f"left {leftover}",
    )  # fmt: skip
    print("\n" + "\n".join(lines))
    problems += _exact_problems(result) + key_problems
    assert not problems, "\n".join(lines) + "\nPROBLEMS:\n" + "\n".join(problems)
