"""``accumulator.testing.LocalCluster``: a throwaway Redis Cluster on free loopback ports, with
the faults a cluster drill needs (a slot migrated between primaries, a primary crashed so
that its replica takes over)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import redis

from ._testing_groups import _HOST, _wait
from .testing import RedisServer

#: The hash slots of a Redis Cluster.
SLOTS = 16384


class LocalCluster:
    """A throwaway Redis Cluster on free loopback ports: ``primaries`` primaries with
    ``replicas_each`` replicas each (3 and 1 by default), slots split evenly, ready when
    :meth:`start` returns. :meth:`client` is a ``redis.cluster.RedisCluster`` and
    :attr:`cluster_url` a ``redis+cluster://`` URL (what ``client=`` and the CLI take);
    :attr:`url` is a plain URL of one primary (that node alone: accumulators of slots it
    does not serve answer MOVED); :attr:`servers` are :class:`RedisServer` objects
    (``kill()`` one to make its replica take over)::

        with LocalCluster() as cluster:
            acc = ConditionalAccumulator(np.float32, (4,), shared_name="w",
                                         client=cluster.client())
    """

    def __init__(
        self,
        primaries: int = 3,
        replicas_each: int = 1,
        *,
        node_timeout: float = 2.0,
        args: Sequence[str] = (),
        module: bool | None = False,
    ) -> None:
        if primaries < 1 or replicas_each < 0:
            raise ValueError("a cluster needs at least one primary, and replicas_each >= 0")
        self._n_primaries = primaries
        self._replicas_each = replicas_each
        self._args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                      "--cluster-node-timeout", str(int(node_timeout * 1000)), *args]  # fmt: skip
        self._module = module
        self.servers: list[RedisServer] = []

    @property
    def url(self) -> str:
        """A plain ``redis://`` URL of the first primary (as started): that one node, not
        the cluster (for the cluster: :attr:`cluster_url`)."""
        return self.servers[0].url

    def _start_node(self) -> RedisServer:
        """One node on a free port pair; another pair if that one was taken meanwhile (by
        another process between the check and the bind): three tries."""
        for _ in range(2):
            with contextlib.suppress(RuntimeError):
                return RedisServer(port=_cluster_port(), args=self._args,
                                   module=self._module).start()  # fmt: skip
        return RedisServer(port=_cluster_port(), args=self._args, module=self._module).start()

    def start(self) -> LocalCluster:
        """Start the nodes, join them, split the slots, attach the replicas; wait until every
        node says the cluster is ``ok``."""
        total = self._n_primaries * (1 + self._replicas_each)
        try:
            for _ in range(total):
                self.servers.append(self._start_node())
            clients = [s.client(socket_timeout=5) for s in self.servers]
            first = self.servers[0]
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", _HOST, first.port)
            step = SLOTS // self._n_primaries
            for i, client in enumerate(clients[: self._n_primaries]):
                low = i * step
                high = SLOTS - 1 if i == self._n_primaries - 1 else (i + 1) * step - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
            _wait("every node knowing every other",
                  lambda: all(len(_nodes(c)) == total for c in clients), 30)  # fmt: skip
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            for j, client in enumerate(clients[self._n_primaries :]):
                client.execute_command("CLUSTER", "REPLICATE", ids[j % self._n_primaries])
            _wait("the cluster state ok on every node",
                  lambda: all(c.cluster("info").get("cluster_state") == "ok" for c in clients)
                  and all(_replicas_in_sync(c) for c in clients[self._n_primaries :]),
                  60)  # fmt: skip
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, **kwargs: Any) -> Any:
        """A ``redis.cluster.RedisCluster`` of this cluster (kwargs go to it)."""
        from redis.cluster import ClusterNode, RedisCluster

        kwargs.setdefault("socket_timeout", 5.0)
        nodes = [ClusterNode(_HOST, s.port) for s in self.servers if s.running]
        return RedisCluster(startup_nodes=nodes, **kwargs)

    @property
    def cluster_url(self) -> str:
        """A ``redis+cluster://`` URL of this cluster (for ``client=``, the CLI, the demo)."""
        port = next(s.port for s in self.servers if s.running)
        return f"redis+cluster://{_HOST}:{port}"

    def owner(self, slot: int) -> RedisServer:
        """The primary that serves ``slot`` now (as the running nodes agree)."""
        for server in self.servers:
            if not server.running:
                continue
            with server.client(socket_timeout=2) as client:
                for line in _nodes(client):
                    fields = line.split()
                    if "master" in fields[2] and "fail" not in fields[2] and _serves(fields, slot):
                        return self._server_at(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        raise LookupError(f"no primary serves slot {slot}")

    def migrate_slot(self, slot: int, to: RedisServer | None = None) -> int:
        """Move ``slot`` and its keys to another primary (``to``, else the next one), live,
        the way ``redis-cli --cluster reshard`` does: the slot is marked importing and
        migrating (clients are redirected with ASK meanwhile), its keys are MIGRATEd in
        batches, then every primary learns the new owner. Returns the new owner's port."""
        source = self.owner(slot)
        primaries = [s for s in self._primaries() if s is not source]
        target = to if to is not None else primaries[slot % len(primaries)]
        with source.client(socket_timeout=10) as src, target.client(socket_timeout=10) as dst:
            src_id, dst_id = _myid(src), _myid(dst)
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while True:
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
                if not keys:
                    break
                src.execute_command("MIGRATE", _HOST, target.port, "", 0, 10_000, "REPLACE",
                                    "KEYS", *keys)  # fmt: skip
            dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        for server in self._primaries():
            if server not in (source, target):
                with server.client(socket_timeout=10) as other:
                    other.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return target.port

    def failover(
        self, slot: int, down: float = 0.0, timeout: float = 30.0, lag: float = 0.0
    ) -> int:
        """Crash (SIGKILL) the primary serving ``slot``, wait until the cluster has promoted
        its replica, start the crashed node again ``down`` seconds later (empty, a new
        node: the others forget the old one) as a replica of the new primary, wait until it
        has synced, and return the new primary's port.

        ``lag``: first cut its replicas off for that many seconds (stopped, their replication
        links killed), so that the primary dies holding writes no replica has: what
        asynchronous replication loses when a replica lags."""
        crashed = self.owner(slot)
        with crashed.client(socket_timeout=5) as client:
            old_id = _myid(client)
            replicas = [self._server_at(int(line.split()[1].split("@")[0].rsplit(":", 1)[1]))
                        for line in _text(client.execute_command("CLUSTER", "REPLICAS", old_id))
                        if "fail" not in line.split()[2]]  # fmt: skip
            if lag > 0:
                for replica in replicas:
                    os.kill(replica.pid, signal.SIGSTOP)  # type: ignore[arg-type]
                try:
                    client.client_kill_filter(_type="replica")
                    time.sleep(lag)
                finally:
                    crashed.kill()
                    for replica in replicas:
                        os.kill(replica.pid, signal.SIGCONT)  # type: ignore[arg-type]
        crashed.kill()
        def promoted() -> bool:
            try:
                return self.owner(slot) is not crashed and self._state_ok()
            except LookupError:  # nobody serves it until the replica is promoted
                return False

        _wait(f"a replica promoted for slot {slot}", promoted, timeout)
        new = self.owner(slot)
        time.sleep(down)
        crashed.start()
        with crashed.client(socket_timeout=5) as node, new.client(socket_timeout=5) as primary:
            node.execute_command("CLUSTER", "MEET", _HOST, new.port)
            new_id = _myid(primary)
            for server in self.servers:
                if server.running and server is not crashed:
                    with server.client(socket_timeout=5) as other, contextlib.suppress(
                        redis.ResponseError  # it had already
                    ):
                        other.execute_command("CLUSTER", "FORGET", old_id)
            _wait(f"node on port {crashed.port} meeting the cluster",
                  lambda: any(new_id in line for line in _nodes(node)), timeout)  # fmt: skip
            node.execute_command("CLUSTER", "REPLICATE", new_id)
            _wait(f"node on port {crashed.port} synced as a replica",
                  lambda: _replicas_in_sync(node) and self._state_ok(), 2 * timeout)  # fmt: skip
        return new.port

    def _primaries(self) -> list[RedisServer]:
        out = []
        for server in self.servers:
            if server.running:
                with server.client(socket_timeout=2) as client:
                    if client.info("replication").get("role") == "master":
                        out.append(server)
        return out

    def _server_at(self, port: int) -> RedisServer:
        for server in self.servers:
            if server.port == port:
                return server
        raise LookupError(f"no node of this cluster on port {port}")

    def _state_ok(self) -> bool:
        for server in self.servers:
            if server.running:
                with server.client(socket_timeout=2) as client:
                    if client.cluster("info").get("cluster_state") != "ok":
                        return False
        return True

    def stop(self) -> None:
        """Stop every node (their data is gone)."""
        for server in self.servers:
            server.stop()
        self.servers.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((_HOST, port))
        except OSError:
            return False
    return True


#: Its own source of ports: the caller's seeded ``random`` is left alone, and two processes
#: seeded alike (pytest-xdist with pytest-randomly) do not pick the same ports (new-user review).
_PORTS = random.SystemRandom()


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too: at most 55535."""
    for _ in range(1000):
        port = _PORTS.randint(20000, 55535)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _nodes(client: redis.Redis) -> list[str]:
    text = client.execute_command("CLUSTER", "NODES")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return [line for line in text.splitlines() if line.strip()]


def _replicas_in_sync(client: redis.Redis) -> bool:
    info = client.info("replication")
    return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")


def _text(reply: Any) -> list[str]:
    """The lines of a CLUSTER NODES-style reply (a string, or a list of lines)."""
    if isinstance(reply, (list, tuple)):
        return [x.decode() if isinstance(x, bytes) else str(x) for x in reply]
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return [line for line in text.splitlines() if line.strip()]


def _myid(client: redis.Redis) -> str:
    node_id = client.execute_command("CLUSTER", "MYID")
    return node_id.decode() if isinstance(node_id, bytes) else str(node_id)


def _serves(fields: list[str], slot: int) -> bool:
    """Whether a CLUSTER NODES line's slot ranges (fields 8 on) hold ``slot``."""
    for spec in fields[8:]:
        if spec.startswith("["):
            continue  # a slot being imported or migrated
        low, _, high = spec.partition("-")
        if int(low) <= slot <= int(high or low):
            return True
    return False
