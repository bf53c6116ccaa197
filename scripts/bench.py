#!/usr/bin/env python
"""Benchmark of redis-accumulator against raw redis-py, in one run against one server.

For float32 gradients of 1 Ki, 256 Ki and 4 Mi elements it measures

* ``apply_grad`` against a raw ``SET`` of the same bytes to a fresh key. The baseline is the
  faster of redis-py's two command packers (the default hiredis packer and the pure-Python
  ``PythonRespSerializer``), chosen per size; both are reported.
* ``take_grad(4)`` right after 4 accepted applies (only the take is timed) against a raw
  ``MGET`` of those 4 blobs from their own keys plus a sequential numpy sum
  (``np.add(out, g, out=out)``). Ours uses the default reduction (MEAN), so it also pays the
  final division; the baseline only sums. For context (not judged) the same read followed by
  an ``UNLINK`` of what it read is timed too ("read+ack"): one more round trip, the least a
  take costs that frees its round only once the reader has it, as ours must so that a taker
  killed mid-take loses nothing.

Every measurement uses a fresh ``shared_name``; one untimed round on that accumulator comes
first (``--cold`` skips it), so its connection is as warm as the baseline's long-lived one.
Baseline and measured runs are interleaved in a shuffled order after a warm-up, and each
figure is the median of all its runs. Small sizes
are cheap and noisy, so they get more runs (x10 at 1 Ki, x3 at 256 Ki). The plain ``PING``
round trip is sampled throughout the run for context. Every take is checked to have found 4
gradients and to return exactly the mean of what was applied.

A sparse case (10,000 x 64 float32 table, 4 gradients of 512 random rows, take against a raw
read plus a numpy merge) runs when ``accumulator.SparseConditionalAccumulator`` exists.

    python scripts/bench.py                # starts (and stops) its own redis-server
    python scripts/bench.py --quick        # fewer runs, well under a minute
    python scripts/bench.py --url redis://host:6379/0 --repeat 25 --json results.json

Exit status: 0 when every case meets its target, 1 otherwise.
With ``--url`` only keys this run created are deleted (``acc:{:bench/<run>/...}`` and
``bench:{<run>}:...``); the server is not flushed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import redis
from redis.connection import PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE

import accumulator

SIZES: list[tuple[str, int]] = [("1 Ki", 1 << 10), ("256 Ki", 256 << 10), ("4 Mi", 4 << 20)]
#: Runs per size = repeat x this factor (small sizes are cheap and noisier).
RUN_FACTOR = {1 << 10: 10, 256 << 10: 3, 4 << 20: 1}
NUM_GRADS = 4
APPLY_TARGET = 1.3
TAKE_TARGET = 1.3
SPARSE_TARGET = 1.5
#: accumulator.aio's round against the synchronous one's: our own bar (no issue sets one)
AIO_TARGET = 1.5
SPARSE_ROWS, SPARSE_COLS, SPARSE_GRAD_ROWS = 10_000, 64, 512
DTYPE = np.float32
TAKE_TIMEOUT = 60.0


# -- results ----------------------------------------------------------------------------------


@dataclass
class Stat:
    """Summary of one series of timings, in milliseconds."""

    median: float
    p25: float
    p75: float
    n: int

    @classmethod
    def of(cls, seconds: list[float]) -> Stat:
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        p25, med, p75 = np.percentile(ms, [25, 50, 75])
        return cls(float(med), float(p25), float(p75), len(ms))


@dataclass
class Row:
    case: str
    size: str
    nbytes: int
    baseline: str  # what the baseline did
    baseline_ms: float
    ours_ms: float
    target: float
    stats: dict[str, Stat] = field(default_factory=dict)
    #: context, not judged: the same baseline with the least a take that frees its round only
    #: once the reader has it pays on top (one more round trip: see ``Bench.raw_take``)
    floor_ms: float | None = None

    @property
    def ratio(self) -> float:
        return self.ours_ms / self.baseline_ms

    @property
    def floor_ratio(self) -> float | None:
        return None if self.floor_ms is None else self.ours_ms / self.floor_ms

    @property
    def passed(self) -> bool:
        return self.ratio <= self.target


# -- helpers ----------------------------------------------------------------------------------


def fmt_bytes(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def as_bytes_view(arr: np.ndarray) -> memoryview:
    """A flat unsigned-byte view (a typed view would make the Python packer send a wrong
    length, see the facts note)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def sequential_sum(arrays: list[np.ndarray]) -> np.ndarray:
    out = arrays[0].copy()
    for g in arrays[1:]:
        np.add(out, g, out=out)
    return out


class Bench:
    """One benchmark run against one server: clients, key names, samples."""

    def __init__(
        self, url: str, repeat: int, warmup: int, seed: int, verbose: bool, warm_acc: bool
    ) -> None:
        self.url = url
        self.warm_acc = warm_acc
        self.repeat = repeat
        self.warmup = warmup
        self.verbose = verbose
        self.run_id = uuid.uuid4().hex[:10]
        self.rng = np.random.default_rng(seed)
        self.order_rng = random.Random(seed)
        self.serial = 0
        # Default client: hiredis packer when hiredis is installed (its reply parser is used
        # by every client here, including the accumulator's).
        self.r_default = redis.Redis.from_url(url)
        encoder = self.r_default.connection_pool.get_encoder()
        self.r_python = redis.Redis.from_url(
            url, command_packer=PythonRespSerializer(6000, encoder.encode)
        )
        self.packers: dict[str, redis.Redis] = {"python": self.r_python}
        if HIREDIS_AVAILABLE:
            self.packers["hiredis"] = self.r_default
        self.ping_samples: list[float] = []

    # names ------------------------------------------------------------------------------------

    def shared_name(self, tag: str) -> str:
        self.serial += 1
        return f"bench/{self.run_id}/{tag}/{self.serial}"

    def raw_key(self, tag: str) -> str:
        self.serial += 1
        return f"bench:{{{self.run_id}}}:{tag}:{self.serial}"

    def cleanup(self) -> None:
        """Delete every key this run created (and only those)."""
        for pattern in (f"acc:{{:bench/{self.run_id}/*", f"bench:{{{self.run_id}}}:*"):
            batch: list[bytes] = []
            for key in self.r_default.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    self.r_default.unlink(*batch)
                    batch = []
            if batch:
                self.r_default.unlink(*batch)

    def close(self) -> None:
        self.r_python.close()
        self.r_default.close()

    # context ----------------------------------------------------------------------------------

    def measure(
        self, job_sets: list[dict[str, Callable[[], float]]], warm: int, runs: int,
        ping: bool = False,
    ) -> dict[str, Stat]:
        """Interleave the jobs of each set in a shuffled order (noise hits all alike), gc off
        while timing; the first ``warm`` rounds are not kept."""
        samples: dict[str, list[float]] = {name: [] for jobs in job_sets for name in jobs}
        for i in range(warm + runs):
            gc.collect()
            gc.disable()
            try:
                for jobs in job_sets:
                    names = list(jobs)
                    self.order_rng.shuffle(names)
                    for name in names:
                        dt = jobs[name]()
                        if i >= warm:
                            samples[name].append(dt)
                if ping and i >= warm:
                    self.ping()
            finally:
                gc.enable()
        return {name: Stat.of(s) for name, s in samples.items()}

    def ping(self) -> None:
        dt, _ = timed(self.r_default.ping)
        self.ping_samples.append(dt)

    def server_info(self) -> dict[str, Any]:
        info = self.r_default.info("server")
        out = {k: info.get(k) for k in ("redis_version", "os", "arch_bits", "process_id")}
        out["jemalloc"] = self.jemalloc_options()
        return out

    def jemalloc_options(self) -> str | None:
        """The server's jemalloc decay settings (``dirty_decay_ms=... muzzy_decay_ms=...``;
        they decide whether freed memory is faulted in again: README, "Performance"), or None
        where the server does not say (another allocator, MEMORY not allowed)."""
        try:
            text = self.r_default.execute_command("MEMORY", "MALLOC-STATS")
        except redis.RedisError:
            return None
        text = text.decode() if isinstance(text, bytes) else str(text)
        found = []
        for line in text.splitlines():
            name, _, value = line.strip().partition(":")
            if name in ("opt.dirty_decay_ms", "opt.muzzy_decay_ms") and value.split():
                found.append(f"{name[4:]}={value.split()[0]}")
        return " ".join(found) or None

    def log(self, msg: str) -> None:
        if self.verbose:
            print(msg, file=sys.stderr, flush=True)

    def runs_for(self, elements: int) -> int:
        return max(1, self.repeat * RUN_FACTOR.get(elements, 1))

    # dense ------------------------------------------------------------------------------------

    def open_dense(self, elements: int, tag: str) -> accumulator.ConditionalAccumulator:
        return accumulator.ConditionalAccumulator(
            DTYPE, shape=(elements,), shared_name=self.shared_name(tag), client=self.url
        )

    def raw_set(self, packer: str, view: memoryview) -> float:
        client = self.packers[packer]
        key = self.raw_key("set")
        dt, ok = timed(lambda: client.set(key, view))
        stored = client.strlen(key)
        client.unlink(key)
        if not ok or stored != len(view):
            raise RuntimeError(f"raw SET ({packer}) stored {stored} of {len(view)} bytes")
        return dt

    def ours_apply(self, elements: int, grad: np.ndarray) -> float:
        acc = self.open_dense(elements, "apply")
        try:
            step = 0
            if self.warm_acc:
                # untimed round on the fresh accumulator: its connection is warm, as in use
                self.checked_round(acc, [grad], step, expected=grad)
                step += 1
            dt, accepted = timed(lambda: acc.apply_grad(grad, local_step=step))
            if not accepted:
                raise RuntimeError("apply_grad was not accepted")
            # untimed: check and clean up (the take removes the payload key)
            back = acc.take_grad(1, timeout=TAKE_TIMEOUT)
            if not np.array_equal(back, grad):
                raise RuntimeError("apply_grad stored something else than the gradient")
        finally:
            acc.close()
        return dt

    @staticmethod
    def apply_all(acc: Any, grads: list[np.ndarray], step: int) -> None:
        for g in grads:
            if not acc.apply_grad(g, local_step=step):
                raise RuntimeError(f"apply_grad(local_step={step}) was not accepted")
        have = acc.num_accumulated()
        if have != len(grads):
            raise RuntimeError(f"expected {len(grads)} gradients before take, found {have}")

    def checked_round(
        self, acc: Any, grads: list[np.ndarray], step: int, expected: np.ndarray
    ) -> float:
        """Apply ``grads`` at ``step`` (untimed), then take them all: the take's time."""
        self.apply_all(acc, grads, step)
        dt, out = timed(lambda: acc.take_grad(len(grads), timeout=TAKE_TIMEOUT))
        if not np.array_equal(out, expected):
            raise RuntimeError("take_grad returned a wrong mean")
        left = acc.num_accumulated()
        if left != 0:
            raise RuntimeError(f"{left} gradients left after take_grad({len(grads)})")
        return dt

    def raw_take(
        self, views: list[memoryview], expected_sum: np.ndarray, acked: bool = False
    ) -> float:
        """``MGET`` of the blobs plus a sequential sum. ``acked``: then an ``UNLINK`` of
        the blobs, timed too: the least a take costs that frees what it read only once the
        reader has it. Our take does that (claim, then finish) so that a taker killed in
        between loses nothing (README, "What survives what"); one round trip cannot."""
        keys = [self.raw_key("blob") for _ in views]
        pipe = self.r_python.pipeline(transaction=False)
        for key, view in zip(keys, views, strict=True):
            pipe.set(key, view)
        pipe.execute()

        def read_and_sum() -> np.ndarray:
            values = self.r_default.mget(keys)
            out = np.frombuffer(values[0], dtype=DTYPE).copy()
            for v in values[1:]:
                np.add(out, np.frombuffer(v, dtype=DTYPE), out=out)
            if acked and self.r_default.unlink(*keys) != len(keys):
                raise RuntimeError("raw take: the acknowledging UNLINK missed a key")
            return out

        dt, out = timed(read_and_sum)
        if not acked:
            self.r_default.unlink(*keys)
        if not np.array_equal(out, expected_sum):
            raise RuntimeError("raw MGET + sum gave a wrong result")
        return dt

    def ours_take(self, elements: int, grads: list[np.ndarray], expected_mean: np.ndarray) -> float:
        acc = self.open_dense(elements, "take")
        try:
            step = 0
            if self.warm_acc:
                # untimed round of one full-size gradient: warms the connection both ways
                self.checked_round(acc, grads[:1], step, grads[0])
                step += 1
            return self.checked_round(acc, grads, step, expected_mean)
        finally:
            acc.close()

    def bench_dense(self, label: str, elements: int) -> list[Row]:
        grads = [self.rng.standard_normal(elements).astype(DTYPE) for _ in range(NUM_GRADS)]
        views = [as_bytes_view(g) for g in grads]
        expected_sum = sequential_sum(grads)
        expected_mean = (expected_sum / DTYPE(len(grads))).astype(DTYPE)
        nbytes = grads[0].nbytes

        apply_jobs: dict[str, Callable[[], float]] = {
            **{f"set_{p}": (lambda p=p: self.raw_set(p, views[0])) for p in self.packers},
            "apply": lambda: self.ours_apply(elements, grads[0]),
        }
        take_jobs: dict[str, Callable[[], float]] = {
            "raw_take": lambda: self.raw_take(views, expected_sum),
            "raw_take_acked": lambda: self.raw_take(views, expected_sum, acked=True),
            "take": lambda: self.ours_take(elements, grads, expected_mean),
        }
        runs = self.runs_for(elements)
        warm = max(1, self.warmup * RUN_FACTOR.get(elements, 1) // 2)
        self.log(f"bench: {label}: {warm} warm-up + {runs} measured runs")
        stats = self.measure([apply_jobs, take_jobs], warm, runs, ping=True)
        best = min(self.packers, key=lambda p: stats[f"set_{p}"].median)
        set_stat = stats[f"set_{best}"]
        return [
            Row("apply", label, nbytes, f"SET ({best} packer)", set_stat.median,
                stats["apply"].median, APPLY_TARGET,
                {k: v for k, v in stats.items() if k.startswith("set_") or k == "apply"}),
            Row(f"take({NUM_GRADS})", label, nbytes, f"MGET {NUM_GRADS} + np.add",
                stats["raw_take"].median, stats["take"].median, TAKE_TARGET,
                {k: stats[k] for k in ("raw_take", "raw_take_acked", "take")},
                floor_ms=stats["raw_take_acked"].median),
        ]  # fmt: skip

    # asyncio ----------------------------------------------------------------------------------

    def bench_aio(self) -> list[Row]:
        """accumulator.aio's round (4 applies, take(4)) against the synchronous classes'."""
        from _aio_bench import measure

        self.log("bench: asyncio twins against the synchronous classes")
        rows = []
        for label, nbytes, sync, asy in measure(self.url, SIZES, self.runs_for, self.rng):
            stats = {"sync_round": Stat.of(sync), "aio_round": Stat.of(asy)}
            rows.append(Row(f"aio round({NUM_GRADS})", label, nbytes, "the same, sync class",
                            stats["sync_round"].median, stats["aio_round"].median, AIO_TARGET,
                            stats))  # fmt: skip
        return rows

    # sparse (hook) ----------------------------------------------------------------------------

    def bench_sparse(self) -> list[Row]:
        """Sparse case: take of 4 gradients of 512 random rows of a 10,000 x 64 float32 table,
        against a raw MGET of the 4 payloads (int64 indices then values, one key each) plus a
        numpy merge (sorted union, per-gradient scatter-add). Target <= 1.5x.

        Runs only when ``accumulator.SparseConditionalAccumulator`` exists; API assumed:
        ``SparseConditionalAccumulator(dtype, shape, shared_name=..., client=url)``,
        ``apply_grad(indices, values, grad_shape=None, local_step=0)``,
        ``take_grad(n) -> (indices, values, shape)`` with per-row MEAN by default.
        """
        cls = getattr(accumulator, "SparseConditionalAccumulator", None)
        if cls is None:
            return []
        shape = (SPARSE_ROWS, SPARSE_COLS)
        grads: list[tuple[np.ndarray, np.ndarray]] = []
        for _ in range(NUM_GRADS):
            idx = np.sort(self.rng.choice(SPARSE_ROWS, SPARSE_GRAD_ROWS, replace=False))
            vals = self.rng.standard_normal((SPARSE_GRAD_ROWS, SPARSE_COLS)).astype(DTYPE)
            grads.append((idx.astype(np.int64), vals))
        payloads = [idx.tobytes() + vals.tobytes() for idx, vals in grads]
        nbytes = len(payloads[0])

        def merge(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
            # sorted union by sort + dedupe (np.unique hashes first in numpy >= 2.3: slower)
            union = np.sort(np.concatenate([idx for idx, _ in parts]))
            keep = np.empty(union.shape[0], dtype=bool)
            keep[0] = True
            np.not_equal(union[1:], union[:-1], out=keep[1:])
            union = union[keep]
            out = np.zeros((union.shape[0], SPARSE_COLS), dtype=DTYPE)
            for idx, vals in parts:
                pos = np.searchsorted(union, idx)
                out[pos] += vals  # rows are unique within one gradient
            return union, out

        exp_idx, exp_sum = merge(grads)
        counts = np.zeros(exp_idx.shape[0], dtype=np.int64)
        for idx, _ in grads:
            counts[np.searchsorted(exp_idx, idx)] += 1
        exp_mean = exp_sum / counts.astype(DTYPE)[:, None]

        def raw_take(acked: bool = False) -> float:
            keys = [self.raw_key("sparse") for _ in payloads]
            pipe = self.r_python.pipeline(transaction=False)
            for key, payload in zip(keys, payloads, strict=True):
                pipe.set(key, payload)
            pipe.execute()

            def read_and_merge() -> tuple[np.ndarray, np.ndarray]:
                parts = []
                for v in self.r_default.mget(keys):
                    idx = np.frombuffer(v, dtype=np.int64, count=SPARSE_GRAD_ROWS)
                    vals = np.frombuffer(v, dtype=DTYPE, offset=idx.nbytes)
                    parts.append((idx, vals.reshape(SPARSE_GRAD_ROWS, SPARSE_COLS)))
                merged = merge(parts)
                if acked and self.r_default.unlink(*keys) != len(keys):  # as the dense one
                    raise RuntimeError("raw sparse take: the acknowledging UNLINK missed a key")
                return merged

            dt, (idx, vals) = timed(read_and_merge)
            if not acked:
                self.r_default.unlink(*keys)
            if not (np.array_equal(idx, exp_idx) and np.allclose(vals, exp_sum)):
                raise RuntimeError("raw sparse read + merge gave a wrong result")
            return dt

        def sparse_round(acc: Any, step: int) -> float:
            for idx, vals in grads:
                if not acc.apply_grad(idx, vals, grad_shape=shape, local_step=step):
                    raise RuntimeError("sparse apply_grad was not accepted")
            have = acc.num_accumulated()
            if have != NUM_GRADS:
                raise RuntimeError(f"expected {NUM_GRADS} sparse gradients, found {have}")
            dt, result = timed(lambda: acc.take_grad(NUM_GRADS, timeout=TAKE_TIMEOUT))
            idx, vals, _ = result
            if not (np.array_equal(idx, exp_idx) and np.allclose(vals, exp_mean)):
                raise RuntimeError("sparse take_grad returned a wrong result")
            return dt

        def ours_take() -> float:
            acc = cls(DTYPE, shape, shared_name=self.shared_name("sparse"), client=self.url)
            try:
                step = 0
                if self.warm_acc:  # untimed round first, as for the dense case
                    sparse_round(acc, step)
                    step += 1
                return sparse_round(acc, step)
            finally:
                close = getattr(acc, "close", None)
                if close is not None:
                    close()

        jobs: dict[str, Callable[[], float]] = {
            "raw_take": raw_take, "raw_take_acked": lambda: raw_take(acked=True),
            "take": ours_take,
        }  # fmt: skip
        runs = self.repeat * 3
        warm = max(1, self.warmup)
        self.log(f"bench: sparse: {warm} warm-up + {runs} measured runs")
        stats = self.measure([jobs], warm, runs)
        label = f"{SPARSE_ROWS}x{SPARSE_COLS}, {NUM_GRADS}x{SPARSE_GRAD_ROWS} rows"
        return [
            Row(f"sparse take({NUM_GRADS})", label, nbytes, "MGET + numpy merge",
                stats["raw_take"].median, stats["take"].median, SPARSE_TARGET, stats,
                floor_ms=stats["raw_take_acked"].median)
        ]  # fmt: skip


# -- report -----------------------------------------------------------------------------------


def render(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        f"redis-accumulator {meta['accumulator']} benchmark:"
        f" redis {meta['server']['redis_version']} at {meta['url']}, redis-py {meta['redis_py']}"
        f" (hiredis {meta['hiredis'] or 'absent'}), numpy {meta['numpy']},"
        f" python {meta['python']}; jemalloc {meta['server'].get('jemalloc') or 'unknown'}",
        f"PING round trip: {meta['ping_ms']['median']:.3f} ms median "
        f"(p25 {meta['ping_ms']['p25']:.3f}, p75 {meta['ping_ms']['p75']:.3f}, "
        f"n={meta['ping_ms']['n']})",
        "",
    ]
    header = ("case", "size", "bytes", "baseline", "baseline ms", "ours ms", "ratio", "target",
              "result", "vs read+ack")  # fmt: skip
    table = [header]
    for r in rows:
        table.append((
            r.case, r.size, fmt_bytes(r.nbytes), r.baseline, f"{r.baseline_ms:.3f}",
            f"{r.ours_ms:.3f}", f"{r.ratio:.2f}x", f"<={r.target:.1f}x",
            "PASS" if r.passed else "MISS",
            "" if r.floor_ratio is None else f"{r.floor_ratio:.2f}x",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    left = {0, 1, 3}
    for n, row in enumerate(table):
        cells = [c.ljust(w) if i in left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += ["", "details (median [p25-p75] ms, n runs):"]
    for r in rows:
        parts = [f"{name} {s.median:.3f} [{s.p25:.3f}-{s.p75:.3f}] n={s.n}"
                 for name, s in r.stats.items()]  # fmt: skip
        lines.append(f"  {r.case:<10} {r.size:<8} " + "; ".join(parts))
    if not meta["sparse"]:
        lines.append("  sparse case skipped: accumulator.SparseConditionalAccumulator not present")
    if any(r.floor_ms is not None for r in rows):
        lines.append(
            "  vs read+ack: ours over the same raw read followed by an UNLINK of what it read"
            " (one more round trip: the least a take costs that frees its round only once the"
            " reader has it); context, not judged"
        )
    lines += ["", *meta["server_cost"]]
    misses = sum(not r.passed for r in rows)
    lines += ["", f"{len(rows) - misses} PASS, {misses} MISS ({meta['elapsed_s']:.0f} s)"]
    return "\n".join(lines)


def to_json(rows: list[Row], meta: dict[str, Any]) -> str:
    out = []
    for r in rows:
        d = asdict(r)
        d["ratio"] = r.ratio
        d["floor_ratio"] = r.floor_ratio
        d["result"] = "PASS" if r.passed else "MISS"
        out.append(d)
    return json.dumps({"meta": meta, "rows": out}, indent=2)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="apply_grad/take_grad of redis-accumulator against raw redis-py "
        "SET / MGET+sum, float32 gradients of 1 Ki, 256 Ki and 4 Mi elements.",
    )
    parser.add_argument("--url", help="use this Redis server (default: start a throwaway "
                        "redis-server with accumulator.testing.RedisServer)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=None, metavar="N",
                        help="measured runs per case at 4 Mi (x3 at 256 Ki, x10 at 1 Ki); "
                        "default 20, 5 with --quick")  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="fewer runs (~10 s on a quiet machine)"
    )
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write results as JSON to PATH, or to stdout instead of the "
                        "table when no PATH is given")  # fmt: skip
    parser.add_argument("--cold", action="store_true",
                        help="time the first apply/take of each fresh accumulator (default: "
                        "one untimed round on it first, so its connection is warm)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1234, help="random seed (data and order)")
    parser.add_argument("--no-steps", dest="steps", action="store_false",
                        help="skip the synchronous-step benchmark (scripts/_step_bench.py: W=1/4 "
                        "workers, 4 KiB-64 MiB, with and without the Redis module)")  # fmt: skip
    parser.add_argument("--large", action="store_true",
                        help="steps at 256 MiB and 2 GiB too (several GB of memory)")  # fmt: skip
    parser.add_argument("--tf-python", metavar="PATH",
                        help="a Python with tensorflow: TF's parameter server step measured in "
                        "the same run, printed as ratios")  # fmt: skip
    parser.add_argument("--cluster", action="store_true",
                        help="also: aggregate applies/s over 64 accumulators on 1 vs 3 primaries "
                        "(scripts/_cluster_bench.py)")
    parser.add_argument("--then", action="store_true",
                        help="also: issue 9's starting code and today's, alternately, W=4 steps; "
                        "its recorded TF figures rescaled by how much slower that code runs "
                        "today (scripts/_then_step.py; needs the git history)")  # fmt: skip
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    if args.repeat is None:
        args.repeat = 5 if args.quick else 20
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - only for the report
        return None


def run(args: argparse.Namespace, url: str) -> tuple[list[Row], dict[str, Any]]:
    started = time.perf_counter()
    bench = Bench(url, args.repeat, warmup=1 if args.quick else 2, seed=args.seed,
                  verbose=not args.quiet, warm_acc=not args.cold)  # fmt: skip
    try:
        for _ in range(20):  # warms the connection; also the first PING samples
            bench.ping()
        server = bench.server_info()
        rows: list[Row] = []
        for label, elements in SIZES:
            rows += bench.bench_dense(label, elements)
        sparse_rows = bench.bench_sparse()
        rows += sparse_rows
        rows += bench.bench_aio()
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _server_cost import measure as server_cost

        bench.log("bench: Redis CPU per operation")
        cost = server_cost(url, 500 if args.quick else 2000)
    finally:
        bench.cleanup()
        bench.close()
    meta = {
        "url": url,
        "server": server,
        "accumulator": accumulator.__version__,
        "redis_py": redis.__version__,
        "hiredis": _version("hiredis") if HIREDIS_AVAILABLE else None,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "repeat": args.repeat,
        "quick": args.quick,
        "cold": args.cold,
        "ping_ms": asdict(Stat.of(bench.ping_samples)),
        "sparse": bool(sparse_rows),
        "elapsed_s": time.perf_counter() - started,
        "server_cost_us": asdict(cost),
        "server_cost": cost.lines(),
    }
    return rows, meta


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        rows, meta = run(args, args.url)
    else:
        from accumulator.testing import RedisServer

        with RedisServer() as server:
            rows, meta = run(args, server.url)
    if args.json == "-":
        print(to_json(rows, meta))
    else:
        print(render(rows, meta))
        if args.json:
            with open(args.json, "w") as f:
                f.write(to_json(rows, meta) + "\n")
    if args.steps and not args.url:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _step_bench import main as steps_main

        print()
        steps_main(["--runs", "3" if args.quick else "7", *(["--large"] if args.large else []),
                    *(["--tf-python", args.tf_python] if args.tf_python else []),
                    *(["-q"] if args.quiet else [])])  # fmt: skip
    if args.cluster and not args.url:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _cluster_bench import main as cluster_main

        print()
        cluster_main(["--seconds", "3" if args.quick else "5"])
    if args.then and not args.url:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _then_step import main as then_main

        print()
        then_main(["--rounds", "1" if args.quick else "2"])
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
