"""Groups of throwaway servers for failover tests (re-exported by ``accumulator.testing``):
a primary with replicas, and the same watched by three Sentinels that promote a replica when
the primary dies."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.sentinel import Sentinel

from .testing import RedisServer, _death_signal, find_server_binary

log = logging.getLogger("accumulator.testing")

_HOST = "127.0.0.1"
#: The name the Sentinels of a :class:`SentinelGroup` know the primary by.
SERVICE = "mymaster"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _wait(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout:g}s")
        time.sleep(0.05)


class ReplicaSet:
    """A primary and ``replicas`` replicas (``replicaof`` it), throwaway, on free ports.

    ``args`` and ``module`` go to every server (see :class:`RedisServer`). Use as a context
    manager, or ``start()``/``stop()``. :attr:`primary` and :attr:`replicas` are
    :class:`RedisServer` objects (``kill()`` one to simulate a crash)::

        with ReplicaSet(replicas=1) as group:
            acc = ConditionalAccumulator(np.float32, (4,), shared_name="w",
                                         client=group.url, min_replicas=1)
    """

    def __init__(
        self, replicas: int = 1, *, args: Sequence[str] = (), module: bool | None = None
    ) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, not {replicas}")
        self._n = replicas
        self._args = list(args)
        self._module = module
        self.primary = RedisServer(args=self._args, module=module)
        self.replicas: list[RedisServer] = []

    @property
    def url(self) -> str:
        """The primary's URL (as it was started: after a failover, ask the Sentinels)."""
        return self.primary.url

    def start(self) -> ReplicaSet:
        """Start the primary, then the replicas, and wait until every replica is in sync."""
        self.primary.start()
        try:
            for _ in range(self._n):
                replica = RedisServer(
                    args=[*self._args, "--replicaof", _HOST, str(self.primary.port)],
                    module=self._module,
                )
                self.replicas.append(replica.start())
            for replica in self.replicas:
                client = replica.client()
                _wait(f"replica on port {replica.port} in sync",
                      lambda c=client: c.info("replication").get("master_link_status") == "up",
                      30)  # fmt: skip
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every server (their data is gone)."""
        for server in [*self.replicas, self.primary]:
            server.stop()
        self.replicas.clear()

    def __enter__(self) -> ReplicaSet:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class SentinelGroup(ReplicaSet):
    """A :class:`ReplicaSet` watched by ``sentinels`` Sentinels (quorum: a majority) under the
    service name ``"mymaster"``: when the primary stops answering for ``down_after`` seconds,
    they promote a replica. :meth:`client` is a Sentinel-managed ``redis.Redis`` that follows
    the current primary (what an accumulator takes as ``client``)."""

    def __init__(
        self,
        replicas: int = 1,
        *,
        sentinels: int = 3,
        down_after: float = 1.0,
        args: Sequence[str] = (),
        module: bool | None = None,
    ) -> None:
        super().__init__(replicas, args=args, module=module)
        self._n_sentinels = sentinels
        self._down_after_ms = max(100, int(down_after * 1000))
        self._procs: list[subprocess.Popen[bytes]] = []
        self._dirs: list[Path] = []
        self.sentinel_ports: list[int] = []

    def start(self) -> SentinelGroup:
        """Start the servers, then the Sentinels, and wait until they all see the primary."""
        super().start()
        try:
            binary = find_server_binary()
            assert binary is not None  # the servers started
            quorum = self._n_sentinels // 2 + 1
            for _ in range(self._n_sentinels):
                port = _free_port()
                folder = Path(tempfile.mkdtemp(prefix=f"accumulator-sentinel-{port}-"))
                conf = folder / "sentinel.conf"
                conf.write_text(
                    f"port {port}\nbind {_HOST}\nprotected-mode no\ndir {folder}\n"
                    f"sentinel monitor {SERVICE} {_HOST} {self.primary.port} {quorum}\n"
                    f"sentinel down-after-milliseconds {SERVICE} {self._down_after_ms}\n"
                    f"sentinel failover-timeout {SERVICE} 10000\n"
                    f"sentinel parallel-syncs {SERVICE} 1\n"
                )
                self._dirs.append(folder)
                with open(folder / "stdout.log", "wb") as out:
                    self._procs.append(subprocess.Popen(
                        [*_death_signal(), binary, str(conf), "--sentinel"],
                        stdin=subprocess.DEVNULL,
                        stdout=out, stderr=subprocess.STDOUT,
                    ))  # fmt: skip
                self.sentinel_ports.append(port)
            sentinel = self.sentinel()
            for port in self.sentinel_ports:
                one = redis.Redis(host=_HOST, port=port, socket_timeout=1)
                _wait(f"sentinel on port {port} seeing the primary and its replicas",
                      lambda one=one: _sees_all(one, len(self.replicas), self._n_sentinels),
                      30)  # fmt: skip
                one.close()
            port = self.primary.port
            _wait("the Sentinels naming the primary",
                  lambda: sentinel.discover_master(SERVICE)[1] == port, 30)  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def sentinel(self, **kwargs: Any) -> Sentinel:
        """A ``redis.sentinel.Sentinel`` over this group's Sentinels."""
        kwargs.setdefault("socket_timeout", 1.0)
        return Sentinel([(_HOST, port) for port in self.sentinel_ports], **kwargs)

    def client(self, **kwargs: Any) -> redis.Redis:
        """A Sentinel-managed client of the current primary (kwargs go to its connections)."""
        kwargs.setdefault("socket_timeout", 5.0)
        client: redis.Redis = self.sentinel().master_for(SERVICE, **kwargs)
        return client

    def current_primary_port(self) -> int:
        """The port of the server the Sentinels name primary now."""
        return int(self.sentinel().discover_master(SERVICE)[1])

    def wait_for_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until every Sentinel names one primary other than ``old_port``, and it
        accepts writes; returns its port. (Every Sentinel: a client asking one that has not
        heard of the failover yet would be sent to the old address, where the crashed server
        may come back empty.)"""
        agreed: list[int | None] = [None]

        def moved() -> bool:
            agreed[0] = self._agreed_primary()
            return agreed[0] not in (None, old_port)

        _wait("a failover", moved, timeout)
        port = agreed[0]
        assert port is not None
        primary = redis.Redis(host=_HOST, port=port, socket_timeout=1)
        _wait("the promoted replica taking writes",
              lambda: primary.info("replication").get("role") == "master", timeout)  # fmt: skip
        primary.close()
        return port

    def _agreed_primary(self) -> int | None:
        """The primary's port if every Sentinel names the same one, else None."""
        ports = set()
        for port in self.sentinel_ports:
            one = redis.Redis(host=_HOST, port=port, socket_timeout=1)
            try:
                address: Any = one.sentinel_get_master_addr_by_name(SERVICE)
                ports.add(int(address[1]))
            except (redis.RedisError, TypeError, IndexError):
                return None
            finally:
                one.close()
        return ports.pop() if len(ports) == 1 else None

    def server_on(self, port: int) -> RedisServer:
        """The group's server listening on ``port``."""
        for server in [self.primary, *self.replicas]:
            if server.port == port:
                return server
        raise LookupError(f"no server of this group on port {port}")

    def failover(self, down: float = 0.0, timeout: float = 30.0, lag: float = 0.0) -> int:
        """Crash the current primary (SIGKILL), wait until the Sentinels promote a replica,
        start the crashed server again ``down`` seconds later (empty: the Sentinels make it a
        replica of the new primary), and return the new primary's port.

        ``lag``: first cut the replicas off for that many seconds (stopped, their replication
        links killed), so that the primary acknowledges writes no replica has when it dies:
        what asynchronous replication loses in a real failover with lagging replicas."""
        old = self.current_primary_port()
        crashed = self.server_on(old)
        stopped = [r for r in [self.primary, *self.replicas] if r is not crashed and r.pid]
        if lag > 0:
            for replica in stopped:
                os.kill(replica.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            try:
                crashed.client().client_kill_filter(_type="replica")
                time.sleep(lag)
            finally:
                crashed.kill()
                for replica in stopped:
                    os.kill(replica.pid, signal.SIGCONT)  # type: ignore[arg-type]
        crashed.kill()
        try:
            new = self.wait_for_failover(old, timeout)
        finally:
            time.sleep(down)
            crashed.start()
        # the restarted (empty) server rejoins as a replica of the new primary (what the
        # Sentinels would tell it, only sooner); wait until it has synced, so that the next
        # failover never promotes it empty
        client = crashed.client(socket_timeout=1)
        client.replicaof(_HOST, new)
        asked = [time.monotonic(), new]

        def synced() -> bool:
            # follow the primary the Sentinels name now (they may have moved on), asking the
            # server again every 5 s (a REPLICAOF can be lost to a Sentinel's reconfiguring)
            current = self.current_primary_port()
            if current != asked[1] or time.monotonic() - asked[0] > 5:
                client.replicaof(_HOST, current)
                asked[:] = [time.monotonic(), current]
            return _synced_to(client.info("replication"), current)

        _wait(f"server on port {crashed.port} synced as a replica", synced, 2 * timeout)
        client.close()
        return self.current_primary_port()

    def stop(self) -> None:
        """Stop the Sentinels and the servers."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        for folder in self._dirs:
            shutil.rmtree(folder, ignore_errors=True)
        self._dirs.clear()
        self.sentinel_ports.clear()
        super().stop()

    def __enter__(self) -> SentinelGroup:
        return self.start()


def _sees_all(sentinel: redis.Redis, replicas: int, sentinels: int) -> bool:
    """Whether a Sentinel knows every replica and every other Sentinel of the group."""
    master = sentinel.sentinel_master(SERVICE)
    if not isinstance(master, dict):
        return False
    return bool(
        int(master.get("num-slaves", 0)) >= replicas
        and int(master.get("num-other-sentinels", 0)) >= sentinels - 1
    )


def _synced_to(replication: dict[str, Any], port: int) -> bool:
    """Whether INFO replication says: a replica of ``port``, its link up, in sync."""
    return bool(
        replication.get("role") == "slave"
        and int(replication.get("master_port", 0)) == port
        and replication.get("master_link_status") == "up"
        and not int(replication.get("master_sync_in_progress", 0))
    )
