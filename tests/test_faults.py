"""Fault drills with exact accounting, on a real server with AOF (``appendfsync always``).

Several worker processes apply one-hot int8 gradients (each position belongs to exactly one
apply call of the run, see ``tests/_drill.py``) to a SUM accumulator, a taker process takes
rounds of 1-4, and meanwhile the drill injects, at random, one fault every 0.6-1.8 s:

- ``kill -9`` of a worker (a replacement starts with fresh ids); every other one caught inside
  ``apply_grad`` (frozen with SIGSTOP between its "applying" and "applied" records);
- ``kill -9`` of the taker (a replacement starts at once); every other one caught inside
  ``take_grad`` holding a round its take script claimed and it has not returned;
- ``kill -9`` of redis-server and a start on the same port and data directory (down 0.2-1.5 s,
  plus the AOF load);
- ``CLIENT KILL TYPE normal`` (every client connection), ``CLIENT PAUSE 500 ALL`` and
  ``CLIENT PAUSE 500 WRITE``.

Every outcome is logged durably by the process that saw it before it can be killed. At the
end the parent takes what is left (also the rounds of killed takers, which the library hands
to the next taker once their claim lease ran out: the drill's takers use a 5 s lease) and
checks, gradient by gradient:

- every accepted gradient (``apply_grad`` returned True) is in exactly one take: none lost
  (also none lost with a killed taker, counted apart as ``lost_in_killed_taker``), none
  doubled; a gradient that returned False is in none; nothing never applied shows up;
- an apply interrupted by a kill of its worker, or that raised, is *unknown*: it may be in a
  take, at most once;
- no client operation raised: the library's retry window absorbs faults of a few seconds;
- no process crashed or hung; the server's own count of accepted applies agrees.

A summary line is printed (``-s`` shows it) and the full report is written as JSON under the
test's tmp dir (its path is printed too). Longer drills: ``ACCUMULATOR_DRILL_SECONDS``
(default 35 per payload size), ``ACCUMULATOR_DRILL_WORKERS`` (default 4),
``ACCUMULATOR_DRILL_SEED``; ``ACCUMULATOR_DRILL_REPORT_DIR`` keeps a copy of each report
(pytest prunes its old tmp dirs).

The drill never kills a taker between ``take_grad`` returning and its record being written
(it would lose the drill's record of a delivered round); should it happen anyway, such
gradients are counted apart (``unrecorded_by_killed_taker``) and are not a failure.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _drill import (
    DTYPE,
    Drill,
    DrillConfig,
    claim_lease_supported,
    claim_then_hang_main,
    summary_line,
)

import accumulator
from accumulator._keys import Keys
from accumulator.testing import RedisServer, find_server_binary

SECONDS = float(os.environ.get("ACCUMULATOR_DRILL_SECONDS", "35"))
WORKERS = int(os.environ.get("ACCUMULATOR_DRILL_WORKERS", "4"))
SEED = int(os.environ.get("ACCUMULATOR_DRILL_SEED", str(random.randrange(10**6))))

#: int8 one-hot payloads: 30 000 B travel inside the apply script call (<= 32 KiB), 60 000 B
#: through their own keys.
WIDTHS = {"inline": 30_000, "blob": 60_000}

#: What a loss in a killed taker means (the library hands such a round over since b89cf52 for
#: claims with payload keys, and for inline-only claims after it).
KILLED_TAKER = (
    "a taker SIGKILLed between its take script claiming a round and take_grad returning it "
    "must not lose that round: once the claim's lease runs out, the next taker at the head of "
    "the FIFO is handed the round as it was"
)


@pytest.fixture
def aof_server() -> Iterator[RedisServer]:
    """A server of this test's own with AOF, fsync always, kept across kill -9 + start."""
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with RedisServer(persistent=True, startup_timeout=60) as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("payload", sorted(WIDTHS))
def test_drill_every_accepted_gradient_taken_exactly_once(aof_server, tmp_path, payload):
    # one id per apply: a long drill paces its workers so as not to run out of ids
    pace = max(0.02, SECONDS * WORKERS / (0.8 * WIDTHS[payload]))
    config = DrillConfig(
        name=f"drill-{payload}", width=WIDTHS[payload], seconds=SECONDS, workers=WORKERS,
        pace=pace, seed=SEED,
    )  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    report = Drill(config, aof_server, run_dir).run()
    path = tmp_path / f"drill-{payload}.json"
    text = json.dumps(report, indent=1)
    path.write_text(text)
    print()
    print(summary_line(report))
    print(f"drill report: {path}")
    if os.environ.get("ACCUMULATOR_DRILL_REPORT_DIR"):  # pytest prunes old tmp dirs
        keep = Path(os.environ["ACCUMULATOR_DRILL_REPORT_DIR"])
        keep.mkdir(parents=True, exist_ok=True)
        copy = keep / f"drill-{payload}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        copy.write_text(text)
        print(f"drill report copy: {copy}")

    assert report["inline"] == (payload == "inline")
    problems = []
    for what in ("lost", "doubled", "stale_taken", "phantom"):
        if report[what]:
            problems.append(f"{what}: {report[what]} (e.g. ids {report['examples'][what]})")
    if report["errors"]:
        problems.append(f"client operations raised (not absorbed): {report['errors']}")
    if report["crashes"] or report["hangs"]:
        problems.append(f"processes: {report['crashes'] + report['hangs']}")
    if report["torn_records"]:
        problems.append(f"{report['torn_records']} unreadable log records")
    missing = set(config.faults) - set(report["faults"])
    if missing:
        problems.append(f"faults never injected (drill too short?): {sorted(missing)}")
    if report["faults"].get("kill_worker", 0) >= 2 and not report["caught_in_apply"]:
        problems.append("no worker was caught inside apply_grad: the drill's targeting is broken")
    # the server's own count of accepted applies: every accepted one, plus unknown ones
    low, high = report["accepted"], report["accepted"] + report["unknown"]
    if not low <= report["server_n_applied"] <= high:
        problems.append(f"server n_applied {report['server_n_applied']} not in [{low}, {high}]")
    if report["lost_in_killed_taker"]:
        problems.append(
            f"lost in killed takers' claims: {report['lost_in_killed_taker']} (e.g. ids "
            f"{report['examples']['lost_in_killed_taker']}; claims left "
            f"{report['leftover_claims']}): {KILLED_TAKER}"
        )
    if report["left_pending"]:
        problems.append(f"{report['left_pending']} gradients still pending after the drain")
    if report["accepted"] < 200 or report["takes"] < 20:
        problems.append("too little traffic to mean much")
    assert not problems, f"{summary_line(report)}\n" + "\n".join(problems) + f"\nreport: {path}"


@pytest.mark.slow
@pytest.mark.parametrize("payload", sorted(WIDTHS))
def test_taker_killed_after_claiming_loses_nothing(own_server, tmp_path, payload):
    """A taker SIGKILLed right after its take script claimed a round, before ``take_grad``
    returned: the gradients of that round must still reach a take (they were accepted)."""
    width, name, url = WIDTHS[payload], f"claimkill-{payload}", own_server.url
    acc = accumulator.ConditionalAccumulator(
        DTYPE, shape=(width,), shared_name=name, reduction_type="SUM", client=url
    )
    acc.wait_slice = 0.5
    marker = tmp_path / "claimed"
    claim_lease = 2.0  # the hanging taker's, where the library leases claims
    proc = mp.get_context("spawn").Process(
        target=claim_then_hang_main, args=(url, name, width, str(marker), claim_lease),
        daemon=True,
    )  # fmt: skip
    proc.start()
    try:
        _wait_for(Path(str(marker) + ".ready"), 60, "the taker process did not start")
        for u in range(3):
            grad = np.zeros(width, DTYPE)
            grad[u] = 1
            assert acc.apply_grad(grad, local_step=0)
        _wait_for(marker, 30, "the take script's claim was never seen (the hook on "
                  "accumulator._scripts.steps is stale: update tests/_drill.py)")  # fmt: skip
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    keys = Keys("", name)
    r = own_server.redis()
    claims = list(r.scan_iter(match=keys.pattern[: -len(":*")] + ":c:*"))
    where = {k.decode(): (r.llen(k) - 1, r.pttl(k)) for k in claims}
    try:  # a killed taker's claim is handed over when its lease runs out: wait for that
        got = acc.take_grad(3, timeout=(claim_lease if claim_lease_supported() else 0) + 10)
    except accumulator.DeadlineExceededError:
        got = None
    assert got is not None, (
        f"{KILLED_TAKER}; the round claimed by the killed taker (gradients 0, 1, 2) never "
        f"came back: global "
        f"step {acc.global_step()}, {acc.num_accumulated()} pending; claim keys "
        f"{{key: (entries, pttl ms)}} = {where}"
    )
    assert np.flatnonzero(got).tolist() == [0, 1, 2] and set(got[got != 0]) == {1}


def _wait_for(path: Path, seconds: float, message: str) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(message)
        time.sleep(0.02)
