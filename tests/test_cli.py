"""The ``accumulator`` CLI end to end: ``python -m accumulator ...`` against a real server."""

from __future__ import annotations

import argparse
import io
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis
from _helpers import take_script

import accumulator
from accumulator import _admin, _cli, _scripts
from accumulator._admin_ops import schema_of
from accumulator._keys import Keys
from accumulator.testing import RedisServer

if TYPE_CHECKING:
    from conftest import Target

SHAPE = (3, 2)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m accumulator ARGS`` with no terminal on stdin."""
    clean = {k: v for k, v in os.environ.items() if k not in ("ACCUMULATOR_REDIS_URL", "REDIS_URL")}
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(
        [sys.executable, "-m", "accumulator", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def failed(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc.stderr


@pytest.fixture
def make(real: Target) -> Iterator[Callable[..., accumulator.ConditionalAccumulator]]:
    opened: list[accumulator.ConditionalAccumulator] = []

    def factory(name: str, shape: tuple[int, ...] = SHAPE, **kwargs: Any):
        acc = accumulator.ConditionalAccumulator(
            np.float32, shape=shape, shared_name=name, client=real.url, **kwargs
        )
        opened.append(acc)
        return acc

    yield factory
    for acc in opened:
        acc.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# -- ls -----------------------------------------------------------------------------------------


def test_ls_two_accumulators(real: Target, make: Callable[..., Any]) -> None:
    alpha = make("alpha")
    make("beta", shape=(4,), reduction_type="SUM")
    alpha.apply_grad(np.ones(SHAPE), local_step=0)
    alpha.apply_grad(np.ones(SHAPE), local_step=0)

    lines = ok(cli("ls", "--url", real.url)).splitlines()
    table, footer = lines[:3], lines[-1]
    assert table[0].split() == [
        "NAME",
        "KIND",
        "DTYPE",
        "SHAPE",
        "REDUCTION",
        "STEP",
        "COUNT",
        "TAKERS",
        "BYTES",
    ]
    assert table[1].split() == [
        "alpha",
        "dense",
        "float32",
        "[3,2]",
        "MEAN",
        "0",
        "2",
        "0",
        "48",
        "B",
    ]
    assert table[2].split() == ["beta", "dense", "float32", "[4]", "SUM", "0", "0", "0", "0", "B"]
    assert len({len(line) for line in table}) == 1  # aligned: the last column is right-aligned
    for header in ("SHAPE", "REDUCTION"):  # left-aligned columns start at the header
        col = table[0].index(header)
        assert all(line[col - 2 : col] == "  " and line[col] != " " for line in table)
    assert footer.startswith("2 accumulators")


def test_ls_empty_and_containers(real: Target, make: Callable[..., Any]) -> None:
    assert ok(cli("ls", "--url", real.url)).strip() == "no accumulators"
    make("a")
    make("b", container="job")
    lines = ok(cli("ls", "--url", real.url)).splitlines()
    assert lines[0].split()[:2] == ["CONTAINER", "NAME"]
    assert [line.split()[:2] for line in lines[1:3]] == [['""', "a"], ["job", "b"]]
    lines = ok(cli("--container", "job", "ls", "--url", real.url)).splitlines()
    assert lines[0].split()[0] == "NAME" and lines[1].split()[0] == "b" and len(lines) == 4


def test_ls_json(real: Target, make: Callable[..., Any]) -> None:
    make("alpha").apply_grad(np.ones(SHAPE), local_step=0)
    make("beta", container="job")
    data = json.loads(ok(cli("ls", "--json", "--url", real.url)))
    assert [(a["container"], a["shared_name"]) for a in data["accumulators"]] == [
        ("", "alpha"),
        ("job", "beta"),
    ]
    alpha = data["accumulators"][0]
    assert (alpha["kind"], alpha["dtype"], alpha["shape"], alpha["count"]) == (
        "dense",
        "float32",
        [3, 2],
        1,
    )
    assert alpha["bytes"] == 24 and alpha["step"] == 0 and alpha["takers_waiting"] == 0
    assert data["server"]["version"]  # a real server answers INFO


# -- show ---------------------------------------------------------------------------------------


def test_show_waiting_taker_and_stale_drops(real: Target, make: Callable[..., Any]) -> None:
    acc = make("grads")
    g = np.ones(SHAPE)
    acc.apply_grad(g, local_step=0)
    acc.take_grad(1)  # global step 1
    assert not acc.apply_grad(g, local_step=0)
    assert not acc.apply_grad(g, local_step=0)
    assert acc.apply_grad(g, local_step=1)
    results: list[Any] = []
    taker = threading.Thread(target=lambda: results.append(acc.take_grad(3, timeout=60)))
    taker.start()
    r = real.redis()
    try:
        _wait_for(lambda: _admin.describe(r, "grads").takers_waiting == 1)
        (waiting,) = _admin.describe(r, "grads").takers

        text = ok(cli("show", "grads", "--url", real.url))
        assert text.startswith("accumulator 'grads'\n")
        assert re.search(r"definition\s+dense float32 \[3,2\] MEAN", text)
        assert re.search(r"global step\s+1\n", text)
        assert re.search(r"pending round\s+1 gradient of shape \[3,2\], 24 B", text)
        assert re.search(r"applies accepted\s+2\n", text)
        assert re.search(r"stale dropped\s+2 \(on average 1\.0 steps behind, at most 1\)", text)
        assert re.search(r"takes\s+1 \(1 gradient\)", text)
        assert re.search(r"last take\s+\S+ ago, after waiting", text)
        section = text.split("waiting takers (1)\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert section[0].split() == ["#", "TAKER", "NEEDS", "WAITED", "LEASE"]
        row = section[1].split()
        assert row[:3] == ["1", waiting.taker_id, "3"] and "renewed" in section[1]
        assert re.search(r"claimed rounds \(taken, not finished yet\)\n  none", text)
        assert re.search(r"stored\s+\d+ keys, .* \(MEMORY USAGE\)", text)

        data = json.loads(ok(cli("show", "grads", "--json", "--url", real.url)))
        assert (data["n_stale"], data["stale_steps"], data["max_stale"]) == (2, 2, 1)
        assert data["takers_waiting"] == 1 and data["claims"] == []
        (t,) = data["takers"]
        assert t["num_required"] == 3 and t["taker_id"] == waiting.taker_id
        assert t["lease_remaining_ms"] > 0 and t["waited_ms"] >= 0
    finally:
        acc.apply_grad(g, local_step=1)
        acc.apply_grad(g, local_step=1)
        taker.join(timeout=60)
    assert len(results) == 1


def test_global_options_before_or_after_the_command(real: Target, make: Callable[..., Any]) -> None:
    make("x", container="c")
    before = json.loads(ok(cli("--json", "--url", real.url, "--container", "c", "show", "x")))
    after = json.loads(ok(cli("show", "x", "--container", "c", "--url", real.url, "--json")))
    assert before["shared_name"] == after["shared_name"] == "x"
    assert before["container"] == after["container"] == "c"
    # the default URL is the library's: $ACCUMULATOR_REDIS_URL, then $REDIS_URL
    assert "'x'" in ok(
        cli("show", "x", "--container", "c", env={"ACCUMULATOR_REDIS_URL": real.url})
    )
    assert "'x'" in ok(cli("show", "x", "--container", "c", env={"REDIS_URL": real.url}))


# -- watch --------------------------------------------------------------------------------------


def test_watch_prints_snapshots_without_a_tty(real: Target, make: Callable[..., Any]) -> None:
    make("w").apply_grad(np.ones(SHAPE), local_step=0)
    out = ok(cli("watch", "w", "--interval", "0.1", "--count", "2", "--url", real.url))
    assert out.count("accumulator 'w'\n") == 2 and "\x1b" not in out
    # the second snapshot reports the activity since the first
    assert re.search(r"last \d+\.\ds: \+0 applied", out)
    lines = ok(cli("watch", "w", "-i", "0.05", "-n", "3", "--json", "--url", real.url))
    snapshots = [json.loads(line) for line in lines.splitlines()]
    assert len(snapshots) == 3 and all(s["count"] == 1 for s in snapshots)


def test_watch_without_a_name_shows_every_accumulator_with_its_rates(
    real: Target, make: Callable[..., Any]
) -> None:
    busy, idle = make("busy"), make("idle")
    idle.apply_grad(np.ones(SHAPE), local_step=0)
    stop = threading.Event()

    def work() -> None:  # applies and takes all along the watch
        while not stop.is_set():
            busy.apply_grad(np.ones(SHAPE), local_step=busy.global_step())
            busy.take_grad(1, timeout=5)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        lines = ok(cli("watch", "-i", "0.3", "-n", "4", "--json", "--url", real.url))
        text = ok(cli("watch", "-i", "0.3", "-n", "2", "--url", real.url))
    finally:
        stop.set()
        worker.join(10)
    snapshots = [json.loads(line)["accumulators"] for line in lines.splitlines()]
    assert len(snapshots) == 4
    first = {row["shared_name"]: row for row in snapshots[0]}
    assert first["busy"]["applies_per_s"] is None  # no rate before a second look
    last = {row["shared_name"]: row for row in snapshots[-1]}
    assert last["busy"]["applies_per_s"] > 0 and last["busy"]["takes_per_s"] > 0
    assert last["idle"]["applies_per_s"] == 0 and last["idle"]["pending"] == 1
    assert len(last["busy"]["recent_applies_per_s"]) == 3
    assert "APPLIES/S" in text and "RECENT" in text and "\x1b" not in text


def test_watch_without_a_name_tells_containers_apart(
    real: Target, make: Callable[..., Any]
) -> None:
    """``c/x`` read as container c, name x, and as name c/x in the default container: a
    CONTAINER column, as ``ls`` has."""
    make("job7/x")
    make("x", container="job7")
    lines = ok(cli("watch", "-n", "1", "--url", real.url)).splitlines()
    table = lines[lines.index("") + 1:]
    assert table[0].split()[:2] == ["CONTAINER", "NAME"]
    assert sorted(line.split()[:2] for line in table[1:3]) == [['""', "job7/x"], ["job7", "x"]]
    lines = ok(cli("--container", "job7", "watch", "-n", "1", "--url", real.url)).splitlines()
    table = lines[lines.index("") + 1:]
    assert table[0].split()[0] == "NAME" and table[1].split()[0] == "x"


def test_sparklines_scale_to_the_largest_value() -> None:
    from accumulator._cli_watch import sparkline

    assert sparkline([0, 0]) == "▁▁" and sparkline([]) == ""
    assert sparkline([1, 2, 4, 8]) == "▂▃▅█"


def test_watch_refreshes_in_place_on_a_tty(real: Target, make: Callable[..., Any]) -> None:
    make("w")
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "accumulator",
            "watch",
            "w",
            "-i",
            "0.05",
            "-n",
            "3",
            "--url",
            real.url,
        ],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
    )
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 30)
            assert ready, "no output from watch"
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        assert proc.wait(timeout=30) == 0
    text = out.decode()
    assert text.count("\x1b[H") == 3  # each frame starts at the top left
    assert "\x1b[2J" in text and "Ctrl-C to quit" in text


def test_watch_ctrl_c_exits_0(real: Target, make: Callable[..., Any]) -> None:
    make("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "accumulator", "watch", "w", "-i", "0.1", "--url", real.url],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal, also when the tests run where SIGINT is ignored (a job
        # started in the background by a non-interactive shell): ignored, it would stay so
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("every 0.1s")  # it is running
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err


# -- changes ------------------------------------------------------------------------------------


def test_set_step(real: Target, make: Callable[..., Any]) -> None:
    acc = make("s")
    assert ok(cli("set-step", "s", "7", "--url", real.url)).strip() == "global step of 's': 0 -> 7"
    assert acc.global_step() == 7
    data = json.loads(ok(cli("set-step", "s", "2", "--json", "--url", real.url)))
    assert data == {"container": "", "shared_name": "s", "name": "s", "previous_step": 7, "step": 2}
    assert acc.global_step() == 2


def test_set_step_on_a_live_accumulator_asks_first(real: Target, make: Callable[..., Any]) -> None:
    acc = make("live")
    acc.apply_grad(np.ones(SHAPE), local_step=0)  # a pending gradient: someone is using it
    err = failed(cli("set-step", "live", "7", "--url", real.url), 2)
    assert "--yes" in err and "live accumulator 'live'" in err
    assert acc.global_step() == 0 and acc.num_accumulated() == 1
    out = ok(cli("set-step", "live", "7", "--yes", "--url", real.url))
    assert out.strip() == "global step of 'live': 0 -> 7"
    assert acc.global_step() == 7 and acc.num_accumulated() == 1
    # on a terminal: the question says what is live
    out, err_ = io.StringIO(), io.StringIO()
    code = _cli.main(
        ["set-step", "live", "3", "--url", real.url], stdout=out, stderr=err_,
        stdin=_Terminal("n\n"),
    )  # fmt: skip
    assert code == 2 and "1 pending gradient at step 7" in err_.getvalue()
    assert acc.global_step() == 7
    # a waiting taker makes it live too
    acc.take_grad(1)
    taker = threading.Thread(target=lambda: acc.take_grad(1, timeout=30))
    taker.start()
    try:
        _wait_for(lambda: _admin.describe(real.redis(), "live").takers_waiting == 1)
        assert "1 waiting taker" in failed(cli("set-step", "live", "9", "--url", real.url), 2)
    finally:
        acc.apply_grad(np.ones(SHAPE), local_step=8)
        taker.join(30)


def test_reset(real: Target, make: Callable[..., Any]) -> None:
    acc = make("r")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    err = failed(cli("reset", "r", "--url", real.url), 2)
    assert "--yes" in err and "not a terminal" in err
    assert acc.num_accumulated() == 2
    out = ok(cli("reset", "r", "--yes", "--url", real.url))
    assert out.strip() == "reset 'r': dropped 2 pending gradients"
    assert acc.num_accumulated() == 0 and acc.global_step() == 0
    data = json.loads(ok(cli("reset", "r", "-y", "--json", "--url", real.url)))
    assert data == {"container": "", "shared_name": "r", "name": "r", "dropped": 0,
                    "dropped_from_claims": 0}  # fmt: skip


def test_reset_and_set_step_name_the_rounds_of_takers_that_are_gone(
    real: Target, make: Callable[..., Any]
) -> None:
    acc = make("gone")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    take_script(acc, "7-dead", 2, 15_000, claim_ms=0)  # claimed; its taker died at once
    # ls, show and watch say where those gradients are (COUNT 0 read as "consumed")
    text = ok(cli("ls", "--url", real.url))
    assert ("note: 'gone': 2 gradients in 1 round claimed by a taker that is gone (not in "
            "COUNT; the next take requiring no more gradients takes it over; `reset` drops "
            "it)") in text  # fmt: skip
    data = json.loads(ok(cli("ls", "--json", "--url", real.url)))
    (entry,) = [e for e in data["accumulators"] if e["shared_name"] == "gone"]
    assert (entry["count"], entry["stranded_claims"], entry["stranded_grads"]) == (0, 1, 2)
    assert entry["claims"] is None and entry["takers"] is None  # not read by a listing
    assert "and 2 gradients in 1 round claimed by a taker that is gone" in ok(
        cli("show", "gone", "--url", real.url)
    )
    assert "2 gradients (not in PENDING) in 1 round claimed by a taker that is gone" in ok(
        cli("watch", "--count", "1", "--url", real.url)
    )
    # set-step asks: the next take would hand that round over as it was
    err = failed(cli("set-step", "gone", "9", "--url", real.url), 2)
    assert "2 gradients in 1 claimed round of takers that are gone" in err
    acc.apply_grad(np.full(SHAPE, 5.0), local_step=1)
    out = ok(cli("reset", "gone", "--yes", "--url", real.url))
    assert out.strip() == ("reset 'gone': dropped 3 pending gradients (2 of them in claimed "
                           "rounds of takers that are gone)")  # fmt: skip
    acc.apply_grad(np.full(SHAPE, 2.0), local_step=1)
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), np.full(SHAPE, 2.0))


def test_delete(real: Target, make: Callable[..., Any]) -> None:
    make("d").apply_grad(np.ones(SHAPE), local_step=0)
    make("keep")
    failed(cli("delete", "d", "--url", real.url), 2)
    assert json.loads(ok(cli("show", "d", "--json", "--url", real.url)))["count"] == 1
    out = ok(cli("delete", "d", "--yes", "--url", real.url))
    assert re.fullmatch(r"deleted 'd' \(\d+ keys\)\n", out)
    failed(cli("show", "d", "--url", real.url), 1)
    assert ok(cli("ls", "--url", real.url)).splitlines()[1].split()[0] == "keep"


def test_reset_container(real: Target, make: Callable[..., Any]) -> None:
    make("a", container="job")
    make("b", container="job")
    make("a")
    err = failed(cli("reset-container", "--container", "job", "--url", real.url), 2)
    assert "--yes" in err
    assert "needs --container" in failed(cli("reset-container", "-y", "--url", real.url), 2)
    assert len(_admin.list_accumulators(real.redis())) == 3
    out = ok(cli("reset-container", "--container", "job", "--yes", "--url", real.url))
    assert out.strip() == "deleted 2 accumulators of container 'job'"
    assert [(i.container, i.shared_name) for i in _admin.list_accumulators(real.redis())] == [
        ("", "a")
    ]
    data = json.loads(ok(cli("reset-container", "--container", "job", "--json", "--url", real.url)))
    assert data == {"container": "job", "deleted": 0, "jobs_deleted": 0}  # nothing to confirm


def test_reset_container_deletes_its_sync_jobs(real: Target) -> None:
    # (their published state, counters and parameter versions stayed, and `job` showed them)
    from accumulator.sync import ParameterServer

    ps = ParameterServer("jj", replicas_to_aggregate=1, client=real.url, container="jc")
    ps.initialize({"w": np.zeros(4, np.float32)})
    ps.finish()
    ps.close()
    r = real.redis()
    assert list(r.scan_iter("accsync:*"))
    err = failed(cli("reset-container", "--container", "jc", "--url", real.url), 2)
    assert "--yes" in err
    accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="own", container="jc",
                                       client=real.url).close()  # fmt: skip

    def scans() -> int:
        stats = r.info("commandstats", **({"target_nodes": "all"} if real.kind == "cluster"
                                          else {}))  # fmt: skip
        if real.kind == "cluster":  # (one dict per node)
            return sum(v.get("cmdstat_scan", {}).get("calls", 0) for v in stats.values())
        return int(stats.get("cmdstat_scan", {}).get("calls", 0))

    before = scans()
    out = ok(cli("reset-container", "--container", "jc", "--yes", "--url", real.url))
    # a walk of the keyspace each: the accumulators and the jobs listed, the job's keys and
    # versions, the container's keys (it walked it 8 times: CLI review)
    nodes = len(r.get_primaries()) if real.kind == "cluster" else 1
    assert scans() - before == 5 * nodes
    assert out.strip() == "deleted 2 accumulators and 1 sync job of container 'jc'"
    assert list(r.scan_iter("accsync:*")) == [] and list(r.scan_iter("acc:*")) == []
    failed(cli("job", "jj", "--container", "jc", "--url", real.url), 1)


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["show", "nope"],
        ["watch", "nope", "-n", "1"],
        ["set-step", "nope", "3"],
        ["reset", "nope", "--yes"],
        ["delete", "nope", "--yes"],
        ["reset", "nope"],
    ],
)
def test_unknown_name_exits_1(real: Target, args: list[str]) -> None:
    err = failed(cli(*args, "--url", real.url), 1)
    assert "'nope'" in err


def test_errors_as_json(real: Target) -> None:
    proc = cli("show", "nope", "--json", "--url", real.url)
    failed(proc, 1)
    assert json.loads(proc.stdout)["error"]["code"] == 1


def test_usage_errors_as_json_and_scrubbed() -> None:
    """A script reading --json output gets JSON for a usage error too; an argument the error
    repeats is scrubbed of its password like every message."""
    proc = cli("show", "--json")  # no name
    err = failed(proc, 2)
    assert "usage: accumulator show" in err and "required: name" in err
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == 2 and error["kind"] == "usage" and "name" in error["message"]
    proc = cli("ls", "redis://:hunter2@example.com", "--json")
    err = failed(proc, 2)
    assert "unrecognized arguments" in err and "hunter2" not in err + proc.stdout
    assert "***" in json.loads(proc.stdout)["error"]["message"]
    assert failed(cli("show"), 2) and cli("show").stdout == ""  # no --json: stderr only


def test_unreachable_server_exits_3() -> None:
    url = f"redis://127.0.0.1:{_free_port()}/0"
    for args in (["ls"], ["show", "x"], ["delete", "x", "--yes"]):
        err = failed(cli(*args, "--url", url), 3)
        assert err.startswith("accumulator: cannot connect to " + url)
        assert len(err.splitlines()) == 1


def test_connection_errors_say_what_is_wrong_in_one_line(real: Target) -> None:
    """No Sentinel (redis-py's text carries its client's whole repr: 1.5 KB), a database
    the server does not have (was ``ResponseError`` and exit 4), ``--tls`` against a server
    that does not speak it (the shown URL says redis://)."""
    if real.kind != "real":
        pytest.skip("one plain server is enough (a TLS handshake waits for its timeout)")
    nobody = _free_port()
    err = failed(cli("ls", "--url", f"redis+sentinel://:pw@127.0.0.1:{nobody}/mymaster"), 3)
    assert "No master found for 'mymaster' (no Sentinel answered" in err
    assert len(err.splitlines()) == 1 and "ConnectionPool" not in err and "pw" not in err
    db = real.url.rsplit("/", 1)[0] + "/99"
    err = failed(cli("ls", "--url", db), 3)
    assert "cannot connect to" in err and "no database of the URL's number" in err
    err = failed(cli("ls", "--url", real.url, "--tls", timeout=120), 3)
    assert "does the server speak TLS?" in err and len(err.splitlines()) == 1


def test_password_errors_exit_3(real: Target) -> None:
    with RedisServer(args=["--requirepass", "pw"]) as server:
        with_password = server.url.replace("redis://", "redis://:pw@")
        wrong = server.url.replace("redis://", "redis://:s3cret-wrong@")
        err = failed(cli("ls", "--url", wrong), 3)
        assert "wrong password" in err and "s3cret-wrong" not in err and ":***@" in err
        err = failed(cli("ls", "--url", server.url), 3)
        assert "requires a password" in err
        assert ok(cli("ls", "--url", with_password)).strip() == "no accumulators"


def test_usage_errors_exit_2(real: Target) -> None:
    failed(cli(), 2)
    failed(cli("frobnicate"), 2)
    assert "must be a finite number > 0" in failed(cli("watch", "x", "--interval", "0",
                                                     "--url", real.url), 2)
    failed(cli("set-step", "x", "not-a-number", "--url", real.url), 2)
    assert "invalid --url" in failed(cli("ls", "--url", "http://example.com"), 2)
    # (tracebacks and exit 1 before; a cluster's db: exit 3, "cannot connect")
    for url in ("redis://[::1/0", "redis+sentinel://x", "redis+cluster://127.0.0.1:1/1"):
        assert "invalid --url" in failed(cli("ls", "--url", url), 2)
    help_text = ok(cli("--help"))
    for name in ("ls", "show", "watch", "set-step", "reset", "delete", "reset-container", "job",
                 "demo"):  # fmt: skip
        assert re.search(rf"^    {name} ", help_text, re.MULTILINE), name  # a subcommand row


def test_what_the_cli_cannot_read_is_no_traceback(
    real: Target, make: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    make("fine").apply_grad(np.ones(SHAPE), local_step=0)
    make("odd")
    real.redis().hset(Keys("", "odd").state, "rshape", "x,y")  # not ours
    for command in (["ls"], ["show", "odd"], ["watch", "--count", "1"]):
        out = ok(cli(*command, "--url", real.url))  # one bad entry takes nothing down
        assert "odd" in out
    assert "fine" in ok(cli("ls", "--url", real.url))
    assert "warning: 'odd': unreadable round shape b'x,y'" in ok(cli("ls", "--url", real.url))
    # a step that is not a number was shown as step 0, as if fresh (CLI review)
    real.redis().hset(Keys("", "fine").state, "step", "seven")
    assert "warning: 'fine': unreadable step b'seven'" in ok(cli("ls", "--url", real.url))
    assert "unreadable step b'seven'" in ok(cli("show", "fine", "--url", real.url))
    # set-step repairs it (it wrote the step, then failed reading the old one: review)
    out = ok(cli("set-step", "fine", "3", "--yes", "--url", real.url))
    assert out == "global step of 'fine': ? -> 3\n"
    assert "warning" not in ok(cli("ls", "--url", real.url)).split("'odd'")[1]
    # a URL asking for str replies: ours read bytes all the same
    if real.kind != "cluster":  # (redis+cluster:// passes no such option on)
        ok(cli("ls", "--url", real.url + "?decode_responses=true"))

    # anything unforeseen: one line, exit 70, not a traceback and "not found"'s 1
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("surprise")

    monkeypatch.setattr(_admin, "list_accumulators", broken)
    err, out = io.StringIO(), io.StringIO()
    assert _cli.main(["ls", "--url", real.url], stdout=out, stderr=err) == 70
    want = "accumulator: internal error: KeyError: 'surprise' (please report it)\n"
    assert err.getvalue() == want


# -- in-process: confirmation on a terminal, the command table ----------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_confirmation_on_a_terminal(real: Target, make: Callable[..., Any]) -> None:
    acc = make("c")
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    out, err = io.StringIO(), io.StringIO()
    code = _cli.main(
        ["reset", "c", "--url", real.url], stdout=out, stderr=err, stdin=_Terminal("n\n")
    )
    assert code == 2 and "[y/N]" in err.getvalue() and "aborted" in err.getvalue()
    assert acc.num_accumulated() == 1
    code = _cli.main(
        ["reset", "c", "--url", real.url], stdout=out, stderr=err, stdin=_Terminal("y\n")
    )
    assert code == 0 and acc.num_accumulated() == 0
    assert "dropped 1 pending gradient" in out.getvalue()


def test_the_question_shows_on_stdout_when_only_stdout_is_a_terminal(
    real: Target, make: Callable[..., Any]
) -> None:
    """``accumulator reset x 2>log`` on a terminal: the question went to the log and the
    command waited for an answer to a question nobody saw (CLI review)."""
    make("c").apply_grad(np.ones(SHAPE), local_step=0)
    out, err = _Terminal(), io.StringIO()
    code = _cli.main(["reset", "c", "--url", real.url], stdout=out, stderr=err,
                     stdin=_Terminal("n\n"))  # fmt: skip
    assert code == 2 and "[y/N]" in out.getvalue() and "[y/N]" not in err.getvalue()


def test_adding_a_command_is_one_function() -> None:
    @_cli.command("hello", "say hello", _cli.arg("--who", default="world"))
    def _hello(ctx: _cli.Context, args: argparse.Namespace) -> int:
        ctx.write(f"hello {args.who} (json={ctx.json})")
        return 0

    try:
        out = io.StringIO()
        assert _cli.main(["hello", "--who", "you", "--json"], stdout=out) == 0
        assert out.getvalue() == "hello you (json=True)\n"
    finally:
        del _cli.COMMANDS["hello"]


def test_restricted_server_degrades(real: Target, make: Callable[..., Any]) -> None:
    """A user without INFO and MEMORY (ACLs, managed services) still gets ls and show."""
    make("x", shape=(100, 100)).apply_grad(np.ones((100, 100)), local_step=0)
    r = real.redis()
    user = f"limited-{os.getpid()}"
    every: dict[str, Any] = {"target_nodes": "all"} if real.kind == "cluster" else {}
    r.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                  commands=["+@all", "-info", "-memory"], **every)  # fmt: skip
    try:
        url = str(real.url).replace("://", f"://{user}:pw@", 1)
        lines = ok(cli("ls", "--url", url)).splitlines()
        assert lines[1].split()[0] == "x" and lines[-1] == "1 accumulator"  # no server line
        assert json.loads(ok(cli("ls", "--json", "--url", url)))["server"] is None
        text = ok(cli("show", "x", "--url", url))
        assert "memory n/a (MEMORY USAGE not available)" in text
        assert json.loads(ok(cli("show", "x", "--json", "--url", url)))["memory_bytes"] is None
    finally:
        r.acl_deluser(user, **every)


def test_demo_subcommand_forwards_to_the_demo() -> None:
    out = ok(cli("demo", "--help"))
    assert "--replicas-to-aggregate" in out and "--role" in out
    assert "accumulator demo" in ok(cli("--help"))
    # listed among the subcommands, and reached after --url/--container too
    assert re.search(r"^    demo  +run the distributed training demo", ok(cli("--help")), re.M)
    assert "--replicas-to-aggregate" in ok(cli("--url", "redis://127.0.0.1:1/0", "demo", "--help"))
    assert "takes its own options" in failed(cli("--json", "demo", "--help"), 2)
    # the in-process entry point forwards the same way
    out_, err_ = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as info:  # the demo's own argparse: --help exits 0
        _cli.main(["demo", "--help"], stdout=out_, stderr=err_)
    assert info.value.code == 0


# -- untrusted names and foreign keys (both backends, in-process) -------------------------------


def _run(target: Target, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """``accumulator ARGS`` in this process against ``target`` (fakeredis too):
    (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    argv = list(args)
    if target.kind == "fake":
        client = target.client()
        monkeypatch.setattr(_cli.Context, "connect", lambda self: client)
    else:
        assert target.url is not None
        argv += ["--url", target.url]
    code = _cli.main(argv, stdout=out, stderr=err, stdin=io.StringIO())
    return code, out.getvalue(), err.getvalue()


EVIL_NAME = "x\x1b[2J\x07"  # clears the terminal and rings its bell when printed raw
EVIL_CONTAINER = "c\x1b]0;pwned\x07"  # sets the terminal's title


def test_names_are_escaped_in_every_command(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = [
        accumulator.ConditionalAccumulator(
            np.float32, shape=SHAPE, shared_name=name, container=EVIL_CONTAINER,
            client=target.client(),
        )
        for name in (EVIL_NAME, "other\n")
    ]  # fmt: skip
    opened[0].apply_grad(np.ones(SHAPE), local_step=0)
    # a taker id is untrusted too (anyone who can write the keys can add one)
    target.redis().zadd(opened[0].accumulator_ref + ":t", {"t\x1b[31m": 1})
    c = ["--container", EVIL_CONTAINER]
    try:
        name, container = "x\\x1b[2J\\x07", "c\\x1b]0;pwned\\x07"  # as printed
        for args, want_code, shown in (
            (["ls"], 0, name),
            (["ls", *c], 0, name),
            (["show", EVIL_NAME, *c], 0, "t\\x1b[31m"),  # and the taker id
            (["watch", EVIL_NAME, "-n", "1", *c], 0, name),
            (["watch", "-n", "1"], 0, container),  # every container's: a CONTAINER column
            (["set-step", EVIL_NAME, "3", "--yes", *c], 0, container),  # live: --yes
            (["job", EVIL_NAME, *c], 1, name),  # no such job: the error
            (["reset", EVIL_NAME, "--yes", *c], 0, name),
            (["delete", "other\n", "--yes", *c], 0, "other\\n"),
            (["show", "nope\x1b[2J", *c], 1, "nope\\x1b[2J"),  # not found: the error
            (["reset-container", "--yes", *c], 0, container),
        ):
            code, out, err = _run(target, monkeypatch, *args)
            assert code == want_code, (args, out, err)
            for control in ("\x1b", "\x07", "other\n"):  # raw, not escaped
                assert control not in out + err, (args, out, err)
            assert shown in out + err, (args, out, err)
        code, out, err = _run(target, monkeypatch, "ls")
        assert out.strip() == "no accumulators"
    finally:
        for acc in opened:
            acc.close()


def test_escaped_cells_keep_the_table_aligned(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    with accumulator.ConditionalAccumulator(
        np.float32, shape=SHAPE, shared_name=EVIL_NAME, client=target.client()
    ):
        code, out, _ = _run(target, monkeypatch, "ls")
    header, row = out.splitlines()[:2]
    assert code == 0 and row.startswith("x\\x1b[2J\\x07  dense")
    assert header.index("KIND") == row.index("dense")


def test_ls_lists_a_foreign_key_as_a_warning_row(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key of the wrong type under the prefix (another program's) does not break ls."""
    r = target.redis()
    good = accumulator.ConditionalAccumulator(
        np.float32, shape=SHAPE, shared_name="good", client=target.client()
    )
    takers = accumulator.ConditionalAccumulator(
        np.float32, shape=SHAPE, shared_name="t", client=target.client()
    )
    try:
        r.set("acc:{x:y}:s", "hello")  # a string where a state hash belongs
        r.set(takers.accumulator_ref + ":t", "junk")  # a string where the takers zset belongs
        code, out, err = _run(target, monkeypatch, "ls")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split()[:3] == ["CONTAINER", "NAME", "KIND"]
        assert [line.split()[:3] for line in lines[1:4]] == [
            ['""', "good", "dense"],
            ['""', "t", "?"],
            ["x", "y", "?"],
        ]
        warnings = [line for line in lines if line.startswith("warning: ")]
        assert warnings == [
            "warning: 't': acc:{:t}:t holds a string where a sorted set belongs "
            "(a key written by another program?)",
            "warning: 'y' (container 'x'): acc:{x:y}:s holds a string where a hash belongs "
            "(a key written by another program?)",
        ]
        assert lines[-1].startswith("1 accumulator (and 2 unreadable, listed with KIND ?)")

        code, out, _ = _run(target, monkeypatch, "ls", "--json")
        entries = {e["shared_name"]: e for e in json.loads(out)["accumulators"]}
        assert code == 0 and entries["good"]["error"] is None
        assert entries["y"]["kind"] == "?" and entries["y"]["container"] == "x"
        assert "acc:{x:y}:s holds a string where a hash belongs" in entries["y"]["error"]
        assert "sorted set" in entries["t"]["error"]

        code, out, _ = _run(target, monkeypatch, "ls", "--container", "x")
        assert code == 0 and out.splitlines()[1].split() == ["y", "?"]
        # watch marks them too (it showed them as healthy rows of zeros)
        code, out, _ = _run(target, monkeypatch, "watch", "--count", "1")
        rows = {line.split()[1]: line for line in out.splitlines() if line.startswith(('""', "x"))}
        assert code == 0 and "unreadable (see ls)" in rows["y"] and "unreadable" in rows["t"]
        assert "unreadable" not in rows["good"]
        code, out, _ = _run(target, monkeypatch, "watch", "--count", "1", "--json")
        rows = {r["shared_name"]: r for r in json.loads(out)["accumulators"]}
        assert rows["good"]["error"] is None and "sorted set" in rows["t"]["error"]
        # the library call behind it returns the same entries instead of raising
        listed = accumulator.list_accumulators(client=target.client())
        assert [(i.shared_name, getattr(i, "error", None) is not None) for i in listed] == [
            ("good", False),
            ("t", True),
            ("y", True),
        ]
    finally:
        good.close()
        takers.close()


# -- show: more state; a name in another container ---------------------------------------------


def test_show_of_a_sparse_round_names_its_rows(real: Target) -> None:
    acc = accumulator.SparseConditionalAccumulator(np.float32, (100, 4), shared_name="emb",
                                                   client=real.url)  # fmt: skip
    try:
        acc.apply_grad(np.array([1, 5]), np.ones((2, 4)), local_step=0)
        text = ok(cli("show", "emb", "--url", real.url))
        assert re.search(r"definition\s+sparse float32 \[100,4\] MEAN", text)
        assert re.search(r"pending round\s+1 gradient, rows of shape \[4\], ", text)
    finally:
        acc.close()


def test_show_says_where_the_sum_is_kept(real: Target) -> None:
    """Decided at creation, and what decides Redis's memory per round (review)."""
    acc = accumulator.ConditionalAccumulator(np.float32, (4,), shared_name="where",
                                             client=real.url)  # fmt: skip
    try:
        text = ok(cli("show", "where", "--url", real.url))
        shown = json.loads(ok(cli("show", "where", "--url", real.url, "--json")))
    finally:
        acc.close()
    if acc.sums_in_redis:
        assert re.search(r"summed\s+in Redis \(accsum module, f32\)", text)
        assert shown["sum_in_redis"] == "f32"
    else:
        assert re.search(r"summed\s+by the taker", text)
        assert shown["sum_in_redis"] is None
    assert (real.kind == "module") == acc.sums_in_redis


def test_show_says_what_stray_payloads_hold_and_when_they_go(real: Target) -> None:
    """The parts of an apply whose worker was killed before its script ran: nothing refers
    to them; `show` gives their bytes and when the last one expires."""
    from accumulator import _model

    acc = accumulator.ConditionalAccumulator(np.float32, (1000,), shared_name="strays",
                                             client=real.url)  # fmt: skip
    r = real.redis()
    for seq in (1, 2):  # as an apply writes them, before its script
        r.set(acc._keys.blob("0badc0de", seq), b"\0" * 40_000, px=_model.ORPHAN_TTL_MS)
    info = _admin.describe(r, "strays")
    assert info.stray_keys == 2 and info.stray_bytes is not None and info.stray_bytes >= 80_000
    assert _model.ORPHAN_TTL_MS - 60_000 < info.stray_expire_ms <= _model.ORPHAN_TTL_MS
    text = ok(cli("show", "strays", "--url", real.url))
    assert re.search(r"2 stray keys, \d+\.\d KiB \(payloads of applies that never completed: "
                     r"a worker killed while it sent one, or of a command cut short\); they "
                     r"expire within (59|60)m\d\ds", text)
    r.persist(acc._keys.blob("0badc0de", 2))  # as a reset cut short left them, before 1.4
    assert _admin.describe(r, "strays").stray_expire_ms == -1
    assert "some never expire" in ok(cli("show", "strays", "--url", real.url))
    acc.close()


def test_show_quarantine_and_pending_limit(real: Target, make: Callable[..., Any]) -> None:
    acc = make("q", max_pending_bytes=1000)
    acc.apply_grad(np.ones(SHAPE), local_step=0)
    r = real.redis()
    r.rpush(acc.accumulator_ref + ":g", b"kother:secret")  # a foreign entry, as a tenant could
    r.hincrby(acc.accumulator_ref + ":s", "count", 1)
    acc.take_grad(1)  # quarantines the foreign entry, takes the valid one
    text = ok(cli("show", "q", "--url", real.url))
    assert re.search(r"max pending\s+1000 B\n", text)
    assert re.search(r"quarantined\s+1 \(1 entry in quarantine now\)", text)
    data = json.loads(ok(cli("show", "q", "--json", "--url", real.url)))
    assert (data["n_quarantined"], data["quarantined"], data["max_pending_bytes"]) == (1, 1, 1000)
    make("fresh")
    assert re.search(r"quarantined\s+0 \(0 entries in quarantine now\)",
                     ok(cli("show", "fresh", "--url", real.url)))  # fmt: skip


def test_a_name_in_another_container_is_hinted(real: Target, make: Callable[..., Any]) -> None:
    make("x", container="job7")
    for args in (["show", "x"], ["watch", "x", "-n", "1"], ["reset", "x", "--yes"],
                 ["evict", "x", "12345-0a1b2c3d4e5f", "--yes"]):  # fmt: skip
        err = failed(cli(*args, "--url", real.url), 1)
        assert "no accumulator named 'x'" in err
        assert "it exists in container 'job7' (pass --container 'job7')" in err
    make("y")
    err = failed(cli("show", "y", "--container", "job7", "--url", real.url), 1)
    assert "it exists in container '' (pass --container '')" in err
    assert "exists in" not in failed(cli("show", "nowhere", "--url", real.url), 1)
    # a taker not found in an accumulator that exists: no hint (nor its SCAN)
    make("x")
    err = failed(cli("evict", "x", "12345-0a1b2c3d4e5f", "--yes", "--url", real.url), 1)
    assert "no taker '12345-0a1b2c3d4e5f'" in err and "exists in" not in err


def test_watch_json_reports_an_error_on_one_line_and_refuses_an_endless_interval(
    real: Target,
) -> None:
    proc = cli("watch", "nowhere", "--json", "-n", "1", "--url", real.url)
    failed(proc, 1)
    (line,) = proc.stdout.splitlines()  # one document per line, the error's too
    assert json.loads(line)["error"]["kind"] == "not_found"
    err = failed(cli("watch", "-i", "inf", "-n", "1", "--url", real.url), 2)
    assert "must be a finite number > 0" in err


# -- job: a sync job at a glance -----------------------------------------------------------------


def _sync_job(url: str, name: str = "j1"):
    from accumulator.sync import ParameterServer, Worker

    ps = ParameterServer(name, replicas_to_aggregate=2, sparse={"emb"}, client=url,
                         chief_id="chief-1")  # fmt: skip
    ps.initialize({"w": np.zeros((2, 3)), "emb": np.zeros((6, 2))})
    workers = [Worker(name, client=url, worker_id=f"w{k}") for k in range(3)]
    for w in workers:
        w.pull(timeout=5)
    grads = {"w": np.ones((2, 3)), "emb": ([1], np.ones((1, 2)))}
    workers[0].push(0, grads)
    workers[1].push(0, grads)
    ps.step(0.1, timeout=5)
    assert not any(workers[2].push(0, grads).values())  # a backup, late: stale
    workers[0].push(1, grads)  # one of the two gradients of step 1
    return ps, workers, grads


def test_job_says_a_fused_accumulators_figures_once(real: Target) -> None:
    # (each parameter's row repeated its fused accumulator's PENDING: read as double counts)
    from accumulator.sync import ParameterServer, Worker

    ps = ParameterServer("jf", replicas_to_aggregate=2, client=real.url)
    ps.initialize({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)})
    worker = Worker("jf", client=real.url)
    worker.pull(timeout=5)
    worker.push(0, {"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)})
    try:
        text = ok(cli("job", "jf", "--url", real.url))
        rows = text.split("parameters (2)\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
        (first, second) = [r.split() for r in rows]
        assert first[1] == second[1] and "#fused" in first[1]  # one accumulator
        assert first[-4:] == ["0", "1", "0", "0"] and second[-4:] == ['"'] * 4
    finally:
        worker.close()
        ps.close()


def test_job_shows_step_chief_workers_and_parameters(real: Target) -> None:
    ps, workers, grads = _sync_job(real.url)
    try:
        text = ok(cli("job", "j1", "--url", real.url))
        assert text.startswith("sync job 'j1'\n")
        assert re.search(r"published step\s+1 \(running\)", text)
        assert re.search(r"aggregation\s+2 gradients per parameter per step, MEAN", text)
        assert re.search(
            r"chief\s+chief-1 \(host .*, pid \d+, tenure [0-9a-f]{8}\), lease renewed .* left", text
        )
        assert re.search(r"pushes\s+4 \(3 accepted, 1 stale, 0 partly stale\)", text)
        rows = text.split("workers (3)\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert rows[0].split() == [
            "WORKER", "PUSHES", "ACCEPTED", "STALE", "PARTIAL", "LAST", "SEEN",
        ]  # fmt: skip
        assert [r.split()[:5] for r in rows[1:]] == [
            ["w0", "2", "2", "0", "0"], ["w1", "1", "1", "0", "0"], ["w2", "1", "0", "1", "0"],
        ]  # fmt: skip
        assert all(r.endswith(" ago") for r in rows[1:])
        rows = text.split("parameters (2)\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert [r.split() for r in rows[1:]] == [
            ["w", "j1/w", "dense", "float64", "[2,3]", "1", "1", "0", "0"],
            ["emb", "j1/emb", "sparse", "float64", "[6,2]", "1", "1", "0", "0"],
        ]
        assert "warning:" not in text

        data = json.loads(ok(cli("job", "j1", "--json", "--url", real.url)))
        assert (data["job"], data["step"], data["done"], data["replicas"]) == ("j1", 1, False, 2)
        assert data["chief"]["chief_id"] == "chief-1" and data["chief"]["live"]
        assert data["chief"]["tenure"] == ps._lease.tenure
        seen = [(w["worker_id"], w["pushes"], w["stale"], w["accepted"]) for w in data["workers"]]
        assert seen == [("w0", 2, 0, 2), ("w1", 1, 0, 1), ("w2", 1, 1, 0)]
        assert all(w["last_seen_ms"] > 0 for w in data["workers"])
        assert [(p["name"], p["step"], p["pending"]) for p in data["params"]] == [
            ("w", 1, 1), ("emb", 1, 1),
        ]  # fmt: skip
        assert data["warnings"] == []

        # the chief takes w's round, then... its step is in progress: a note, no warning
        workers[1].push(1, grads)
        ps._accs["w"].take_grad(2, timeout=5)
        data = json.loads(ok(cli("job", "j1", "--json", "--url", real.url)))
        assert data["warnings"] == []
        assert any("in the middle of a step" in n for n in data["notes"])
        # ...and dies before its publish: the accumulator is ahead, no chief renews its lease
        ps.close()
        text = ok(cli("job", "j1", "--url", real.url))
        assert "warning: accumulator 'j1/w' at step 2, ahead of the published step 1: a chief " \
               "crashed between its take and its publish" in text  # fmt: skip
        assert re.search(r"chief\s+none", text)
        assert failed(cli("job", "nope", "--url", real.url), 1).strip().endswith(
            "no sync job named 'nope'"
        )
    finally:
        for w in workers:
            w.close()
        ps.close()


def test_job_delete(real: Target) -> None:
    ps, workers, grads = _sync_job(real.url)
    for w in workers:
        w.close()
    r = real.redis()
    try:
        err = failed(cli("job", "j1", "--delete", "--yes", "--url", real.url), 2)
        assert "not finished (published step 1; its chief 'chief-1' is live)" in err
        assert "--force" in err
        assert "--yes" in failed(cli("job", "j1", "--delete", "--force", "--url", real.url), 2)
        err = failed(cli("job", "j1", "--force", "--url", real.url), 2)
        assert "--force goes with --delete" in err
        assert r.exists("accsync:{:j1}:p") and len(_admin.list_accumulators(r)) == 2
        ps.finish()
        # started again while the question waits: refused in the CLI's words (it said "pass
        # force", the library's; CLI review)
        class StartedAgain(_Terminal):
            def readline(self, *args: Any) -> str:
                r.hset("accsync:{:j1}:p", "done", "0")
                return "y\n"

        out_, err_ = io.StringIO(), io.StringIO()
        code = _cli.main(["job", "j1", "--delete", "--url", real.url], stdout=out_,
                         stderr=err_, stdin=StartedAgain())  # fmt: skip
        assert code == 2 and "'j1' was started again while you were asked; nothing was " \
            "deleted (pass --force to delete it anyway)" in err_.getvalue()  # fmt: skip
        assert len(_admin.list_accumulators(r)) == 2
        r.hset("accsync:{:j1}:p", "done", "1")
        out = ok(cli("job", "j1", "--delete", "--yes", "--url", real.url))
        assert re.fullmatch(r"deleted sync job 'j1' \(\d+ keys\)\n", out)
        assert list(r.scan_iter()) == []
        failed(cli("job", "j1", "--url", real.url), 1)
        # --force: a job that is not finished, and its live chief's lease with it
        ps2, workers2, _ = _sync_job(real.url, "j2")
        data = json.loads(ok(cli("job", "j2", "--delete", "--force", "--yes", "--json",
                                 "--url", real.url)))  # fmt: skip
        assert data["job"] == "j2" and data["keys_deleted"] > 0
        assert list(r.scan_iter()) == []
        for w in workers2:
            w.close()
        ps2.close()
    finally:
        ps.close()


def test_job_as_the_sync_role(real: Target) -> None:
    """``job`` and ``job --delete`` need no more than the README's ``acc-sync`` rights."""
    from accumulator import _acl

    ps, workers, _ = _sync_job(real.url)
    r = real.redis()
    user = f"sync-{os.getpid()}"
    r.execute_command("ACL", "SETUSER", user, "on", ">pw", *_acl.ROLES["sync"].split())
    try:
        url = real.url.replace("redis://", f"redis://{user}:pw@")
        data = json.loads(ok(cli("job", "j1", "--json", "--url", url)))
        assert data["step"] == 1 and len(data["workers"]) == 3
        ps.finish()
        ok(cli("job", "j1", "--delete", "--yes", "--url", url))
        assert list(r.scan_iter()) == []
    finally:
        r.acl_deluser(user)
        for w in workers:
            w.close()
        ps.close()


def test_show_says_an_accumulator_is_sealed(real):
    """A finished sync job's accumulators are sealed: ``show`` says so (and its JSON)."""
    from accumulator.sync import ParameterServer, accumulator_name

    ps = ParameterServer("shown", replicas_to_aggregate=1, client=real.client())
    ps.initialize({"w": np.zeros(SHAPE, np.float32)}, step=3)
    name = accumulator_name("shown", "w")
    assert "sealed" not in ok(cli("show", name, "--url", real.url))
    ps.finish()
    text = ok(cli("show", name, "--url", real.url))
    assert re.search(r"sealed\s+its sync job finished at step 3: applies that are not stale", text)
    assert json.loads(ok(cli("show", name, "--json", "--url", real.url)))["sealed"] == 3
    ps.close()


def test_cluster_urls_that_cannot_serve_exit_with_a_message(real: Target) -> None:
    err = failed(cli("ls", "--url", f"redis+cluster://127.0.0.1:{_free_port()}/0"), 3)
    assert "cannot connect" in err and "Redis Cluster unreachable" in err
    if real.kind != "cluster":  # a server that is no cluster node
        err = failed(cli("ls", "--url", "redis+cluster://" + real.url.split("://", 1)[1]), 2)
        assert "no cluster node" in err


def test_a_frozen_server_is_unreachable_after_the_connect_timeout_not_the_command_one(
    own_server: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that accepts connections and never answers (SIGSTOP: frozen, or a partition)
    is "cannot connect" (exit 3) once the first PING waited CONNECT_TIMEOUT (twice: one
    retry), not COMMAND_TIMEOUT (30 s, twice: a minute, before)."""
    from accumulator import _cli_context

    monkeypatch.setattr(_cli_context, "CONNECT_TIMEOUT", 0.5)
    assert own_server.server is not None and own_server.url is not None
    os.kill(own_server.server.pid, signal.SIGSTOP)
    try:
        out, err = io.StringIO(), io.StringIO()
        started = time.monotonic()
        code = _cli.main(["ls", "--url", own_server.url], stdout=out, stderr=err)
        elapsed = time.monotonic() - started
    finally:
        os.kill(own_server.server.pid, signal.SIGCONT)
    assert code == 3 and "cannot connect" in err.getvalue()
    assert elapsed < 10  # (a minute without the probe)
    # once it answers again, so does the CLI
    assert _cli.main(["ls", "--url", own_server.url], stdout=io.StringIO(), stderr=err) == 0


def test_watch_rides_out_a_server_restart(own_server: Target) -> None:
    # (it ended at the first connection error: a failover at 3 a.m. killed the view)
    server = own_server.server
    assert server is not None and own_server.url is not None
    accumulator.ConditionalAccumulator(np.float32, SHAPE, shared_name="w",
                                       client=own_server.url).close()  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if k not in ("ACCUMULATOR_REDIS_URL", "REDIS_URL")}
    watch = subprocess.Popen(
        [sys.executable, "-m", "accumulator", "--url", own_server.url, "--json", "watch",
         "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, text=True, env=clean,
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        assert "accumulators" in json.loads(watch.stdout.readline())
        server.kill()
        frame = json.loads(watch.stdout.readline())
        while "accumulators" in frame:  # (frames read before the kill)
            frame = json.loads(watch.stdout.readline())
        assert frame["unreachable_since"] and frame["error"]
        server.start()  # (empty: no persistence)
        while "accumulators" not in frame:
            frame = json.loads(watch.stdout.readline())
        assert frame["accumulators"] == [] and watch.poll() is None
    finally:
        watch.kill()
        watch.communicate(timeout=30)


def test_the_tools_that_free_memory_work_at_maxmemory(own_server: Target) -> None:
    """At maxmemory Redis refuses every command queued in a transaction (reads and deletes
    too): show, watch, reset and delete must still work there, in the CLI and the library;
    a write that needs memory (set-step) is refused our way."""
    url = own_server.url
    shape = (3 * (1 << 20) // 4,)
    for name in ("full", "other", "claimed"):
        acc = accumulator.ConditionalAccumulator(np.float32, shape, shared_name=name, client=url)
        for _ in range(3):
            acc.apply_grad(np.ones(shape, np.float32))
        acc.close()
    r = own_server.redis()
    k = Keys("", "claimed")  # its round claimed by a taker that then died
    reply = _scripts.call(r, "take", [k.state, k.grads, k.takers, k.taker_info, k.claim("1-dead"),
                                      k.wake, k.queue_wake, k.quarantine, k.claims, k.orphans],
                          [schema_of(r, k), "1-dead", 3, 15_000, "d", 4, 30_000, 0, "",
                           0])  # fmt: skip
    assert int(reply[0]) == 1 and r.exists(k.claim("1-dead"))
    r.config_set("maxmemory", 1 << 20)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        r.set("probe", "x")  # (the server is at its limit)
    assert "full" in ok(cli("--url", url, "show", "full"))
    footer = ok(cli("--url", url, "ls"))
    assert re.search(r"server memory [0-9.]+ MiB of 1\.0 MiB maxmemory", footer)
    assert json.loads(ok(cli("--url", url, "--json", "show", "full")))["count"] == 3
    ok(cli("--url", url, "watch", "full", "-n", "1"))
    assert accumulator.describe_accumulator("full", client=url).count == 3
    failed(cli("--url", url, "set-step", "full", "5", "--yes"), 4)
    ok(cli("--url", url, "reset", "full", "--yes"))
    assert accumulator.describe_accumulator("full", client=url).count == 0
    ok(cli("--url", url, "delete", "full", "--yes"))
    assert accumulator.delete_accumulator("other", client=url) > 0
    assert "dropped" in ok(cli("--url", url, "evict", "claimed", "1-dead", "--drop", "--yes",
                               "--force"))  # (its lease runs)
    # (the retry records of the applies stay, until they expire)
    left = [key for key in r.scan_iter(f"{k.base}*") if key != k.state.encode()]
    assert [key for key in left if not key.startswith(k.dedup("").encode())] == []
    assert accumulator.delete_accumulator("claimed", client=url) > 0
    assert r.keys("acc:*") == []
    r.config_set("maxmemory", 0)
