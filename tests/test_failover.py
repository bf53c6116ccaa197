"""Failover drills: a primary with replicas and three Sentinels (``accumulator.testing.
SentinelGroup``); worker and taker processes apply and take one-hot gradients with exact
accounting (``tests/_drill.py``) while the drill SIGKILLs the primary again and again (the
Sentinels promote a replica; the crashed server comes back as a replica) and kills workers
and takers. Acknowledged applies lost and gradients counted twice are counted:

- one replica, Redis's default (asynchronous replication): reported, not asserted;
- one replica, ``min_replicas=1``: every replica confirms every acknowledged write, so any
  promoted one has it: nothing may be lost or counted twice (asserted);
- two replicas, ``min_replicas=1``: only one of them must have a write; the Sentinels promote
  the replica with the largest replication offset they last saw, which is best effort (their
  view can be a second old): reported, not asserted (the README's table).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from _drill import Drill, DrillConfig, summary_line

import accumulator
from accumulator.testing import SentinelGroup, find_server_binary

SECONDS = float(os.environ.get("ACCUMULATOR_FAILOVER_SECONDS", "40"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("replicas", "min_replicas"), [(1, 0), (1, 1), (2, 1)],
    ids=["1-replica-default", "1-replica-min_replicas=1", "2-replicas-min_replicas=1"],
)  # fmt: skip
def test_failover_drill(tmp_path, replicas, min_replicas):
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    label = f"{replicas}-replicas-min_replicas={min_replicas}"
    config = DrillConfig(
        name=f"failover-{replicas}-{min_replicas}", width=6000, seconds=SECONDS, workers=3,
        block=500, pace=0.02, faults=("failover", "failover", "kill_worker", "kill_taker"),
        fault_gap=(2.0, 4.0), redis_down=(0.0, 1.0), min_replicas=min_replicas,
        seed=11 + min_replicas + 10 * replicas,
    )  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with SentinelGroup(replicas=replicas, down_after=1.0, module=False) as group:
        report = Drill(config, group, run_dir).run()
    # every replica confirmed: any promoted one has it all
    _check(report, tmp_path, f"failover-{label}", "failover", exact=min_replicas >= replicas)


@pytest.mark.slow
def test_the_readme_failover_example():
    """README, 'Testing your own code': an apply confirmed by a replica survives a failover;
    the same accumulator object rides it out."""
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with SentinelGroup(replicas=2) as group:
        acc = accumulator.ConditionalAccumulator(np.float32, (4,), shared_name="w",
                                                 client=group.client(), min_replicas=1)  # fmt: skip
        acc.apply_grad(np.ones(4))
        old = group.current_primary_port()
        assert group.failover() != old
        assert acc.take_grad(1).tolist() == [1, 1, 1, 1]
        acc.close()


@pytest.mark.slow
def test_a_sentinel_url_reaches_the_primary_from_the_library_the_cli_and_the_demo(capsys):
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    import subprocess
    import sys

    from accumulator._cli import main as cli_main

    with SentinelGroup(replicas=1) as group:
        hosts = ",".join(f"127.0.0.1:{port}" for port in group.sentinel_ports)
        url = f"redis+sentinel://{hosts}/mymaster"
        with accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="s",
                                                client=url) as acc:  # fmt: skip
            acc.apply_grad([1.0, 2.0])
        assert group.client().exists(acc._keys.state)  # on the primary the Sentinels name
        assert cli_main(["--url", url, "--json", "ls"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [a["shared_name"] for a in listed["accumulators"]] == ["s"]
        # the connection is what is tested here (how well 20 steps train under a loaded CI
        # is the demo's own tests' business): any accuracy a trained model reaches will do
        command = [sys.executable, "-m", "accumulator", "demo", "--url", url, "--steps", "20",
                   "--min-accuracy", "0.5"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    with pytest.raises(ValueError, match="redis\\+sentinel://host:port"):
        accumulator.ConditionalAccumulator(np.float32, client="redis+sentinel://h:1")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "width", "min_replicas"),
    [("migrate", 6000, 0), ("migrate", 1_500_000, 1), ("cluster_failover", 6000, 0),
     ("cluster_failover", 6000, 1), ("cluster_failover", 1_500_000, 1)],
    ids=["migrate", "migrate-parts-min_replicas=1", "cluster_failover-default",
         "cluster_failover-min_replicas=1", "cluster_failover-parts-min_replicas=1"],
)  # fmt: skip
def test_cluster_drill(tmp_path, fault, width, min_replicas):
    """A Redis Cluster of 3 primaries and 3 replicas (``accumulator.testing.LocalCluster``):
    the drill's processes apply and take through a cluster client while the drill moves the
    accumulator's slot between primaries, live (``migrate``: ASK redirects during the move,
    MOVED after: nothing may be lost or counted twice, asserted), or SIGKILLs the primary
    serving it so that its replica takes over (``cluster_failover``: asynchronous
    replication: with the default, lost and doubled are reported, not asserted; with
    ``min_replicas=1``, the primary's one replica has every acknowledged write, so nothing
    may be lost or doubled, asserted). ``-parts``: gradients of 1.5 MB, in two parts spread
    over slots of their own (the cluster default): the drill moves, or fails over, the
    state's slot and the parts' slots in turn."""
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    from accumulator.testing import LocalCluster

    config = DrillConfig(
        name=f"cluster-{fault}-{width}-{min_replicas}", width=width, seconds=SECONDS,
        workers=3, block=500,
        # parts: slower workers (1.5 MB each), but enough traffic between failovers
        pace=0.02 if width < 100_000 else 0.1 if fault == "migrate" else 0.04,
        faults=(fault, fault, "kill_worker", "kill_taker"), fault_gap=(1.0, 3.0),
        redis_down=(0.0, 1.0), seed=31 + len(fault), min_replicas=min_replicas,
    )  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with LocalCluster(primaries=3, replicas_each=1) as cluster:
        report = Drill(config, cluster, run_dir).run()
    label = f"cluster-{fault}-{width}-min_replicas={min_replicas}"
    _check(report, tmp_path, label, fault, exact=fault == "migrate" or min_replicas > 0)


def _check(report: dict, tmp_path: Path, label: str, fault: str, exact: bool) -> None:
    """Keep the report (``ACCUMULATOR_DRILL_REPORT_DIR``), print its line, and fail on what
    every drill must not show; with ``exact``, also on anything lost or counted twice."""
    text = json.dumps(report, indent=1)
    path = tmp_path / f"{label}.json"
    path.write_text(text)
    print()
    print(f"{label}: {summary_line(report)} failovers {report['failovers']}")
    if os.environ.get("ACCUMULATOR_DRILL_REPORT_DIR"):
        keep = Path(os.environ["ACCUMULATOR_DRILL_REPORT_DIR"])
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(text)
    problems = []
    if report["faults"].get(fault, 0) < 2:
        problems.append(f"too few {fault} faults: {report['faults']}")
    if report["accepted"] < 200 or report["takes"] < 20:
        problems.append("too little traffic to mean much")
    if report["crashes"] or report["hangs"]:
        problems.append(f"processes: {report['crashes'] + report['hangs']}")
    if report["phantom"]:
        problems.append(f"phantom: {report['phantom']} (e.g. {report['examples']['phantom']})")
    print(f"lost {report['lost']}, doubled {report['doubled']} ({label})")
    if exact:
        for what in ("lost", "doubled"):
            if report[what]:
                problems.append(f"{what}: {report[what]} (e.g. {report['examples'][what]})")
    assert not problems, f"{summary_line(report)}\n" + "\n".join(problems) + f"\nreport: {path}"
