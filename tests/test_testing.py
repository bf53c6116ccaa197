"""Tests for accumulator.testing: the throwaway redis-server and the fake client."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from accumulator import testing
from accumulator.testing import ENV_BINARY, RedisServer, fake_client, find_server_binary

# A zombie (exited, not yet reaped by a container's PID 1) counts as gone.
_pid_alive = testing._alive


def _port_answers(port: int) -> bool:
    return testing._probe(port, timeout=0.5) is not None


def _no_retry() -> Retry:
    # redis-py >= 6 retries with backoff by default, which makes "is it down?" checks slow.
    return Retry(NoBackoff(), 0)


@pytest.fixture
def binary() -> str:
    found = find_server_binary()
    if found is None:
        pytest.skip(f"no redis-server/valkey-server on PATH and {ENV_BINARY} unset")
    return found


@pytest.fixture
def server(binary: str) -> Iterator[RedisServer]:
    with RedisServer(binary) as srv:
        yield srv


# -- real server -------------------------------------------------------------------------


@pytest.mark.real
def test_start_and_url_answers_ping(server: RedisServer) -> None:
    assert server.running
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    r = redis.Redis.from_url(server.url)
    assert r.ping() is True
    r.close()


@pytest.mark.real
def test_a_password_given_in_args_is_in_url_and_client(binary: str) -> None:
    """``--requirepass`` in ``args``: ``client()`` and ``url_with_password()`` log in with
    it (there was no way but to build a URL by hand: every use failed with NOAUTH; new-user
    review); ``url`` stays without it (it is printed and logged)."""
    with RedisServer(binary, args=["--requirepass", "s3c:r/et"]) as srv:
        assert srv.password == "s3c:r/et"
        assert srv.url == f"redis://127.0.0.1:{srv.port}/0"
        assert srv.url_with_password() == f"redis://:s3c%3Ar%2Fet@127.0.0.1:{srv.port}/0"
        for r in (redis.Redis.from_url(srv.url_with_password()), srv.client()):
            assert r.ping() is True
            r.close()
        with pytest.raises(redis.AuthenticationError):
            srv.client(password=None).ping()


@pytest.mark.real
def test_client_kwargs_and_no_persistence(server: RedisServer) -> None:
    r = server.client(decode_responses=True)
    r.set("k", "v")
    assert r.get("k") == "v"
    assert r.config_get("save") == {"save": ""}
    assert r.config_get("appendonly") == {"appendonly": "no"}
    assert r.config_get("bind")["bind"].split() == ["127.0.0.1"]
    assert Path(r.config_get("dir")["dir"]).resolve() == server.workdir.resolve()
    r.close()


@pytest.mark.real
def test_restart_keeps_port_and_drops_data(server: RedisServer) -> None:
    port, old_pid = server.port, server.pid
    server.client().set("k", "v")
    server.restart()
    assert server.port == port
    assert server.pid != old_pid
    r = server.client()
    assert r.ping() is True
    assert r.get("k") is None  # no persistence: a restart loses everything
    r.close()


@pytest.mark.real
def test_kill_then_start_again(server: RedisServer) -> None:
    pid, port = server.pid, server.port
    assert pid is not None
    r = server.client(retry=_no_retry())
    r.ping()
    server.kill()
    assert not server.running
    assert not _pid_alive(pid)
    with pytest.raises(redis.exceptions.ConnectionError):
        r.ping()
    server.start()  # same port, like restart()
    assert server.port == port
    assert r.ping() is True  # redis-py reconnects
    r.close()


@pytest.mark.real
def test_persistent_keeps_acknowledged_writes_across_kill_and_restart(binary: str) -> None:
    srv = RedisServer(binary, persistent=True).start()
    try:
        assert srv.persistent
        port, workdir = srv.port, srv.workdir
        assert workdir is not None
        r = srv.client(retry=_no_retry())
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("appendfsync") == {"appendfsync": "always"}
        r.set("k", "v")
        r.rpush("l", *range(100))
        r.hset("h", mapping={"a": 1, "b": "x" * 100_000})  # bigger than one write buffer
        old_pid = srv.pid
        srv.kill()  # SIGKILL: no shutdown, only what is on disk survives
        assert not srv.running and workdir.exists()
        srv.start()
        assert (srv.port, srv.workdir) == (port, workdir)
        assert srv.pid != old_pid
        assert r.get("k") == b"v"  # acknowledged before the crash: fsynced (appendfsync always)
        assert r.lrange("l", 0, -1) == [str(i).encode() for i in range(100)]
        assert r.hget("h", "b") == b"x" * 100_000
        r.incr("n")
        srv.restart()  # SIGTERM and start: the data stays too
        assert r.get("n") == b"1" and r.get("k") == b"v"
        r.close()
    finally:
        srv.stop()
    assert not workdir.exists()  # stop() removes even a persistent server's data


@pytest.mark.real
def test_persistent_args_override_the_defaults(binary: str) -> None:
    with RedisServer(binary, persistent=True, args=["--appendfsync", "everysec"]) as srv:
        r = srv.client()
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
        r.close()


@pytest.mark.real
def test_kill_then_start_without_persistence_loses_data(server: RedisServer) -> None:
    assert not server.persistent
    server.client().set("k", "v")
    server.kill()
    server.start()
    assert server.client().get("k") is None


@pytest.mark.real
def test_stop_cleans_up(binary: str) -> None:
    srv = RedisServer(binary).start()
    pid, port, workdir = srv.pid, srv.port, srv.workdir
    assert pid is not None and workdir is not None and workdir.is_dir()
    assert srv.log_path is not None and srv.log_path.is_file()
    srv.stop()
    assert not srv.running
    assert srv.workdir is None
    assert not workdir.exists()
    assert not _pid_alive(pid)
    assert not _port_answers(port)
    srv.stop()  # idempotent


@pytest.mark.real
def test_stop_after_kill_cleans_dir(binary: str) -> None:
    srv = RedisServer(binary).start()
    workdir = srv.workdir
    assert workdir is not None
    srv.kill()
    assert workdir.exists()  # the log is kept for inspection after a crash
    srv.stop()
    assert not workdir.exists()


@pytest.mark.real
def test_two_servers_get_distinct_ports(binary: str) -> None:
    with RedisServer(binary) as a, RedisServer(binary) as b:
        assert a.port != b.port
        a.client().set("k", "a")
        assert b.client().get("k") is None


@pytest.mark.real
def test_explicit_port(binary: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with RedisServer(binary, port=port) as srv:
        assert srv.port == port
        assert _port_answers(port)


@pytest.mark.real
def test_start_twice_is_an_error(server: RedisServer) -> None:
    with pytest.raises(RuntimeError, match="already running"):
        server.start()


@pytest.mark.real
def test_taken_port_is_retried(binary: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate the race: the first port we pick is taken before the server binds it.
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        picks = iter([taken])
        real_pick = testing._pick_free_port
        monkeypatch.setattr(testing, "_pick_free_port", lambda: next(picks, None) or real_pick())
        with RedisServer(binary) as srv:
            assert srv.port != taken
            assert srv.client().ping() is True


@pytest.mark.real
def test_taken_explicit_port_fails_with_log(binary: str) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        srv = RedisServer(binary, port=port)
        with pytest.raises(RuntimeError, match="(?i)address already in use"):
            srv.start()
        assert not srv.running
        assert srv.workdir is None  # nothing left behind


@pytest.mark.real
def test_bad_argument_error_includes_log_tail(binary: str) -> None:
    srv = RedisServer(binary, args=["--no-such-directive", "1"])
    with pytest.raises(RuntimeError, match="no-such-directive"):
        srv.start()
    assert not srv.running


@pytest.mark.real
def test_extra_args_are_applied(binary: str) -> None:
    with RedisServer(binary, args=["--maxmemory", "10mb"]) as srv:
        assert srv.client().config_get("maxmemory") == {"maxmemory": str(10 * 1024 * 1024)}


def _jemalloc_option(srv: RedisServer, name: str) -> str | None:
    """An option as the server's jemalloc reports it (None: not jemalloc, or not shown)."""
    text = srv.client().execute_command("MEMORY", "MALLOC-STATS")
    text = text.decode() if isinstance(text, bytes) else str(text)
    for line in text.splitlines():
        if line.strip().startswith(f"opt.{name}:"):
            return line.split(":", 1)[1].split()[0]
    return None


@pytest.mark.real
def test_freed_memory_stays_mapped_unless_the_environment_says_otherwise(
    binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("MALLOC_CONF", "JE_MALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    with RedisServer(binary) as srv:
        got = _jemalloc_option(srv, "muzzy_decay_ms")
        if got is None:
            pytest.skip("this redis-server does not report jemalloc's options")
        assert got == "-1"
    monkeypatch.setenv("MALLOC_CONF", "muzzy_decay_ms:5000")
    monkeypatch.setenv("JE_MALLOC_CONF", "muzzy_decay_ms:5000")
    with RedisServer(binary) as srv:
        assert _jemalloc_option(srv, "muzzy_decay_ms") == "5000"


@pytest.mark.real
def test_atexit_stops_forgotten_server(binary: str, tmp_path: Path) -> None:
    # A child interpreter starts a server and exits without stopping it.
    code = textwrap.dedent(
        f"""
        from accumulator.testing import RedisServer
        srv = RedisServer({binary!r}).start()
        print(srv.pid, srv.port, srv.workdir, flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    pid, port, workdir = int(out[0]), int(out[1]), Path(out[2])
    deadline = time.monotonic() + 5
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(pid)
    assert not _port_answers(port)
    assert not workdir.exists()


@pytest.mark.real
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_server_stops_when_its_process_is_killed(binary: str) -> None:
    # SIGTERM at its default action: the interpreter dies without running its exit hooks
    # (a CI job's timeout, `kill <pytest pid>`); the server must not outlive it, nor its
    # directory the next process that starts a server.
    code = textwrap.dedent(
        f"""
        import os, signal
        from accumulator.testing import RedisServer
        srv = RedisServer({binary!r}).start()
        print(srv.pid, srv.port, srv.workdir, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == -signal.SIGTERM
    out = proc.stdout.split()
    pid, port, workdir = int(out[0]), int(out[1]), Path(out[2])
    try:
        deadline = time.monotonic() + 5
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(pid)
        assert not _port_answers(port)
        # nobody ran stop(): its directory stays, until the next process starts a server
        assert workdir.is_dir()
        starts = ("from accumulator.testing import RedisServer\n"
                  f"RedisServer({binary!r}).start().stop()")  # fmt: skip
        subprocess.run([sys.executable, "-c", starts], timeout=60, check=True)
        assert not workdir.exists()
    finally:
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)


def test_only_dead_owners_directories_are_swept(tmp_path: Path, monkeypatch) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid nobody has (for the moment)
    dirs = {name: tmp_path / f"accumulator-redis-1-{name}" for name in
            ("dead", "owner_alive", "server_alive", "no_owner_file", "garbage", "other")}
    for path in dirs.values():
        path.mkdir()
    (dirs["dead"] / "owner.pid").write_text(f"{gone.pid} {gone.pid}\n")
    (dirs["owner_alive"] / "owner.pid").write_text(f"{os.getpid()} {gone.pid}\n")
    (dirs["server_alive"] / "owner.pid").write_text(f"{gone.pid} {os.getpid()}\n")
    (dirs["garbage"] / "owner.pid").write_text("not a pid\n")
    other = tmp_path / "something-else"
    other.mkdir()
    (other / "owner.pid").write_text(f"{gone.pid} {gone.pid}\n")
    monkeypatch.setattr(testing.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(testing, "_swept", False)
    testing._sweep_dead_dirs()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [other.name] + [p.name for name, p in dirs.items() if name != "dead"]
    )
    (dirs["owner_alive"] / "owner.pid").write_text(f"{gone.pid} {gone.pid}\n")
    testing._sweep_dead_dirs()  # once per process
    assert dirs["owner_alive"].exists()


def test_only_the_main_thread_starts_servers_with_a_death_signal() -> None:
    # the kernel signals when the starting *thread* ends: a worker thread's server would die
    # with that thread
    got: list[list[str]] = []
    worker = threading.Thread(target=lambda: got.append(testing._death_signal()))
    worker.start()
    worker.join()
    assert got == [[]]
    main = testing._death_signal()
    assert main == ([] if shutil.which("setpriv") is None
                    else [shutil.which("setpriv"), "--pdeathsig", "TERM"])  # fmt: skip


@pytest.mark.real
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
# JAX (imported by test_jax) warns about forking its threads; the child only calls _exit
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_forked_child_exit_leaves_parent_server_alone(server: RedisServer) -> None:
    workdir = server.workdir
    child = os.fork()
    if child == 0:  # the child runs what its atexit hook would, then leaves without cleanup
        try:
            testing._live_servers.stop_all()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert server.running
    assert workdir is not None and workdir.exists()
    assert server.client().ping() is True


# -- binary discovery --------------------------------------------------------------------


def test_missing_binary_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: nothing to find
    assert find_server_binary() is None
    srv = RedisServer()
    with pytest.raises(RuntimeError, match="apt-get install redis-server") as info:
        srv.start()
    assert ENV_BINARY in str(info.value)
    assert not srv.running


def test_explicit_missing_binary_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not found or not executable"):
        RedisServer(binary=str(tmp_path / "nope")).start()


def test_env_binary_wrong_is_loud(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match=ENV_BINARY):
        find_server_binary()


def _fake_exe(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 1\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_discovery_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setenv("PATH", str(bindir))
    valkey = _fake_exe(bindir / "valkey-server")
    assert find_server_binary() == str(valkey)
    redis_bin = _fake_exe(bindir / "redis-server")
    assert find_server_binary() == str(redis_bin)  # redis-server wins over valkey-server
    custom = _fake_exe(tmp_path / "custom-server")
    monkeypatch.setenv(ENV_BINARY, str(custom))
    assert find_server_binary() == str(custom)  # the env var wins over PATH
    monkeypatch.setenv(ENV_BINARY, "valkey-server")  # a bare name is looked up on PATH
    assert find_server_binary() == str(valkey)


def test_port_before_start_is_an_error() -> None:
    srv = RedisServer(binary="/does/not/matter")
    with pytest.raises(RuntimeError, match="start"):
        _ = srv.url
    srv.stop()  # stopping a never-started server is harmless


def test_args_must_not_be_a_string() -> None:
    with pytest.raises(TypeError):
        RedisServer(args="--maxmemory 10mb")  # type: ignore[arg-type]


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_bad_port(port: int) -> None:
    with pytest.raises(ValueError, match="port"):
        RedisServer(port=port)


# -- fake client -------------------------------------------------------------------------


def test_fake_client_is_fresh_each_call() -> None:
    pytest.importorskip("fakeredis")
    a, b = fake_client(), fake_client()
    assert isinstance(a, redis.Redis)
    a.set("k", "v")
    assert a.get("k") == b"v"
    assert b.get("k") is None


def test_fake_client_kwargs() -> None:
    pytest.importorskip("fakeredis")
    r = fake_client(decode_responses=True)
    r.set("k", "v")
    assert r.get("k") == "v"


def test_fake_client_missing_fakeredis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fakeredis", None)  # makes `import fakeredis` fail
    with pytest.raises(ImportError, match=r"redis-accumulator\[testing\]"):
        fake_client()
