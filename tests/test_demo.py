"""The demo: its model's gradients, its command line, and a short run as a subprocess against
the session's real server, which must learn (held-out accuracy above a bar)."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("sklearn", reason="the demo needs scikit-learn: pip install '.[demo]'")

import accumulator  # noqa: E402
from accumulator import _demo  # noqa: E402 - after the skip: it loads sklearn lazily anyway


def test_gradients_match_finite_differences():
    train, _ = _demo.load_data(seed=0)
    batch = train.take(np.arange(16))
    rng = np.random.default_rng(1)
    params = {k: (rng.normal(size=v.shape) * 0.1).astype(np.float64)
              for k, v in _demo.init_params().items()}  # fmt: skip
    _, grads = _demo.loss_and_grads(params, batch)
    rows, values = grads["emb"]
    dense = {"W": grads["W"], "b": grads["b"], "emb": np.zeros_like(params["emb"])}
    dense["emb"][rows] = values
    assert len(rows) < len(params["emb"])  # a batch touches only some rows: sparse
    eps = 1e-6
    for name, index in [("W", (10, 3)), ("b", (7,)), ("emb", (int(rows[5]), 2))]:
        bumped = {k: v.copy() for k, v in params.items()}
        bumped[name][index] += eps
        lower = {k: v.copy() for k, v in params.items()}
        lower[name][index] -= eps
        numeric = (_demo.loss_and_grads(bumped, batch)[0]
                   - _demo.loss_and_grads(lower, batch)[0]) / (2 * eps)  # fmt: skip
        assert numeric == pytest.approx(dense[name][index], rel=1e-4, abs=1e-8)


def test_every_process_computes_the_same_split():
    a_train, a_test = _demo.load_data(seed=3)
    b_train, b_test = _demo.load_data(seed=3)
    np.testing.assert_array_equal(a_train.y, b_train.y)
    np.testing.assert_array_equal(a_test.rows, b_test.rows)
    assert len(a_train) + len(a_test) == 1797
    assert abs(len(a_test) - 0.2 * 1797) < 1


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        _demo.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--url", "--workers", "--steps", "--replicas-to-aggregate",
                   "--slow-worker-delay", "--seed", "--quiet", "--min-accuracy"):  # fmt: skip
        assert option in text
    with pytest.raises(SystemExit) as info:
        _demo.main(["--workers", "2", "--replicas-to-aggregate", "3"])
    assert info.value.code == 2
    # refused before anything starts (they ended in tracebacks, or after the training, or
    # with a misleading message: new-user review)
    for args, said in ((["--url", "foo"], "--url foo: it must start with"),
                       (["--url", "redis://h:notaport/0"], "notaport/0: its port must be"),
                       (["--timeout", "0"], "--timeout must be > 0"),
                       (["--json-summary", "/nonexistent/x.json"], "cannot write into")):
        with pytest.raises(SystemExit) as info:
            _demo.main(args)
        assert info.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("error", [accumulator.UnavailableError("Redis unreachable for 30.5s"),
                                   accumulator.PermissionDeniedError("no EVALSHA")])
def test_redis_errors_are_one_line_and_exit_3_or_2(monkeypatch, caplog, capsys, error):
    """UnavailableError (Python's ConnectionError, not redis-py's) gave three chained
    tracebacks and exit 1, the code of a low accuracy (new-user review)."""
    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(_demo, "run_chief", fails)
    unreachable = isinstance(error, ConnectionError)  # as the CLI: 3, else 2
    assert _demo.main(["--url", "redis://127.0.0.1:1/0", "--quiet"]) == (3 if unreachable else 2)
    assert "Traceback" not in capsys.readouterr().err
    assert f"Redis at redis://127.0.0.1:1/0: {error}" in caplog.text


@pytest.mark.parametrize("role", [[], ["--role", "worker"]])
def test_without_scikit_learn_it_says_so_and_exits_2_before_starting_a_server(
        monkeypatch, caplog, role):  # fmt: skip
    """It exited 1 (the code of a low accuracy) through SystemExit, after starting a
    redis-server for nothing (new-user review)."""
    import accumulator.testing

    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn: ImportError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)

    def no_server(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(accumulator.testing, "RedisServer", no_server)
    assert _demo.main(["--quiet", "--steps", "2", *role]) == 2
    assert "the demo needs scikit-learn: pip install 'redis-accumulator[demo]'" in caplog.text


@pytest.mark.slow
def test_sigterm_stops_the_demo_and_its_workers(real):
    """SIGTERM (timeout, a CI runner, docker stop) left the worker processes running; they
    printed tracebacks half a minute later (new-user review). Handled as Ctrl-C is."""
    import signal
    import time

    cmd = [sys.executable, "-m", "accumulator._demo", "--url", real.url, "--steps", "100000",
           "--workers", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        while "worker processes" not in proc.stdout.readline():  # they have started
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(2)  # (and are pushing)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split()  # fmt: skip
        assert len(children) >= 2
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 143 and "terminated" in out, err
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in children):
            assert time.monotonic() < deadline, "a worker outlived the demo"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


def test_progress_lines_without_a_terminal():
    import io

    out = io.StringIO()
    bar = _demo.Progress(50, out)
    for step in range(1, 51):
        if bar.due(step):
            bar.draw(step, 0.5, 0.9, 2, 10.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in out.getvalue()
    assert lines[-1].startswith("step 50/50") and "stale 2" in lines[-1]


@pytest.mark.slow
def test_short_demo_run_learns(real, tmp_path):
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "accumulator._demo", "--url", real.url, "--steps", "60",
           "--workers", "4", "--slow-worker-delay", "0.2", "--json-summary", str(summary_path),
           "--job", "demo-test"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # the accumulators' names are printed for `python -m accumulator watch NAME`
    assert "demo-test/emb" in out and "python -m accumulator watch" in out
    assert re.search(r"^step +60/60 ", out, re.M)
    accuracy = float(re.search(r"^accuracy=([0-9.]+)", out, re.M).group(1))
    assert accuracy >= 0.9
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] and summary["accuracy"] == pytest.approx(accuracy, abs=1e-4)
    assert summary["steps"] == 60 and summary["replicas_to_aggregate"] == 3
    # three fast workers are enough for every step; the slow one's gradients come too late
    assert summary["accepted"] >= 3 * 60
    slow = summary["per_worker"][summary["slow_worker"]]
    assert slow["pushes"] >= 1 and slow["stale"] + slow["partial"] >= 1
    assert summary["stale"] + summary["partial"] >= 1
    for acc in summary["accumulators"].values():
        assert acc["taken"] == 60


@pytest.mark.slow
def test_demo_fails_below_the_bar(real):
    cmd = [sys.executable, "-m", "accumulator._demo", "--url", real.url, "--steps", "2",
           "--workers", "1", "--min-accuracy", "0.99", "--quiet"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout and "step " not in proc.stdout  # --quiet: no progress bar


# -- secrets ------------------------------------------------------------------------------------

PW = "Sup3r-S3cret-pw"


def test_watch_hint_leaves_the_password_out(monkeypatch):
    monkeypatch.setattr(_demo, "python_command", lambda: "python")
    hint = _demo.watch_hint("digits/emb", f"redis://:{PW}@h:6379/0")
    assert hint == "REDISCLI_AUTH=... python -m accumulator watch digits/emb --url redis://h:6379/0"
    hint = _demo.watch_hint("j b/emb", f"redis://alice@h/0?password={PW}&db=1", "c")
    assert hint == ("REDISCLI_AUTH=... python -m accumulator watch 'j b/emb' "
                    "--url 'redis://alice@h/0?db=1' --container c")  # fmt: skip
    assert _demo.watch_hint("j/emb", "redis://h/0") == (
        "python -m accumulator watch j/emb --url redis://h/0"
    )
    assert PW not in repr(_demo.WorkerConfig(f"redis://:{PW}@h/0", "j", "", 0, 1, 0, 8, 0.0, 1.0))


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_demo_never_prints_the_password(form, caplog, capsys, monkeypatch):
    """A short run (chief and one worker thread, in this process) against a password-protected
    server: the password is in nothing the demo prints or logs, and the watch command it
    prints works once $REDISCLI_AUTH holds the password."""
    from accumulator.testing import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(_demo, "python_command", lambda: "python")
    with RedisServer(args=["--requirepass", PW]) as server:
        caplog.clear()  # the test helper's own record of the server's command line
        url = {"userinfo": server.url.replace("redis://", f"redis://:{PW}@"),
               "query": f"{server.url}?password={PW}"}[form]  # fmt: skip
        cfg = _demo.WorkerConfig(url, "hint", "", 0, 1, 0, 32, 0.0, 30.0)
        worker = threading.Thread(target=_demo.run_worker, args=(cfg,), daemon=True)
        worker.start()
        out = io.StringIO()
        code = _demo.main(["--role", "chief", "--url", url, "--steps", "2", "--workers", "1",
                           "--replicas-to-aggregate", "1", "--min-accuracy", "0",
                           "--job", "hint", "--json-summary", "-"], out=out)  # fmt: skip
        worker.join(30)
        text = out.getvalue()
        assert code == 0, text
        printed = capsys.readouterr()
        for shown in (text, caplog.text, printed.out, printed.err):
            assert PW not in shown
        assert json.loads(text[text.index("\n{") :])["url"].count("***") == 1
        (hint,) = re.findall(r"watch one live from another terminal:\s+(.*)", text)
        assert hint == f"REDISCLI_AUTH=... python -m accumulator watch hint/emb --url {server.url}"
        watch = hint.removeprefix("REDISCLI_AUTH=... ").split()[1:]  # without "python"
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDISCLI_AUTH")}
        run = subprocess.run([sys.executable, *watch, "-n", "1"], capture_output=True, text=True,
                             env={**env, "REDISCLI_AUTH": PW}, timeout=60)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert "accumulator 'hint/emb'" in run.stdout and PW not in run.stdout


def test_the_watch_hint_names_this_interpreter_unless_python_is_it(monkeypatch, tmp_path):
    """From a venv that is not activated, another terminal's ``python`` may lack the
    package: the hint then names this interpreter (packaging review)."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setattr(_demo.shutil, "which", lambda name: "/usr/bin/python")
    assert _demo.python_command() == sys.executable
    assert _demo.watch_hint("j/emb", "redis://h/0").startswith(f"{sys.executable} -m accumulator")
    monkeypatch.setattr(_demo.shutil, "which", lambda name: sys.executable)
    assert _demo.python_command() == "python"
