"""The benchmark scripts still run: nothing here is timed (performance is read off a run of
``scripts/bench.py``, never asserted), but a benchmark that crashes or checks nothing would
only be found by the next person measuring."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

pytestmark = pytest.mark.slow


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=SCRIPTS.parent)  # fmt: skip


def test_bench_measures_every_case_and_checks_its_results(real_url):
    """``--quick --no-steps --json -``: every case has a baseline and a figure; the take
    rows carry the read+ack context. Exit 0 (all targets met) or 1 (some missed), nothing
    else: every take is checked against the exact mean inside the script (a wrong result
    raises, exit 1 with a traceback, which this test refuses too)."""
    proc = run([str(SCRIPTS / "bench.py"), "--quick", "--no-steps", "--repeat", "1",
                "--url", real_url, "--json", "-"], timeout=600)  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    rows = out["rows"]
    cost = out["meta"]["server_cost_us"]  # Redis CPU per operation: all measured
    assert cost["set_us"] > 0 and cost["apply_us"] > 0 and cost["take_us"] > 0, cost
    cases = {(r["case"], r["size"]) for r in rows}
    for size in ("1 Ki", "256 Ki", "4 Mi"):
        assert ("apply", size) in cases and ("take(4)", size) in cases
    for r in rows:
        assert r["baseline_ms"] > 0 and r["ours_ms"] > 0, r
        assert r["result"] == ("PASS" if r["ratio"] <= r["target"] else "MISS")
        if r["case"].startswith(("take", "sparse take")):
            assert r["floor_ratio"] is not None and r["floor_ratio"] > 0, r


def test_step_bench_runs_both_paths(real_url):
    """The synchronous step (``_step_bench.py``) on its own servers, smallest case: a table
    row per path and size (it checks each step's mean itself)."""
    proc = run([str(SCRIPTS / "_step_bench.py"), "--sizes", "4 KiB", "--workers", "2",
                "--runs", "1", "-q"], timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 4 KiB | 2 |" in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    assert "| ratio | Redis held after |" in proc.stdout, proc.stdout
    # the sync helper's step on each path, and a model of many tensors on the default one
    for start in ("| 4 KiB | 2 | plain |", "| 16 × 4 KiB | 2 |"):
        sync = [line for line in lines if line.startswith(start)]
        assert sync and sync[0].endswith("× |"), (start, proc.stdout)


def test_apply_layers_measures_each_way_and_leaves_nothing_behind(real_url):
    """``_apply_layers.py``: the five figures, each a positive median, and the accumulator it
    made deleted."""
    import redis

    proc = run([str(SCRIPTS / "_apply_layers.py"), "--url", real_url, "--elements", "256"],
               timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = dict(line.split() for line in proc.stdout.splitlines()[1:6])
    assert set(figures) == {"raw", "pooled", "apply_grad", "set", "python"}, proc.stdout
    assert all(float(v) > 0 for v in figures.values()), proc.stdout
    left = redis.Redis.from_url(real_url).scan_iter(match="*bench*layers*")
    assert not list(left)
