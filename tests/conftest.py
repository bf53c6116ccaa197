"""One suite, four backends: every test taking ``target`` runs on fakeredis (in-process), on a
real redis-server started for the session on a free loopback port (or on ``REDIS_URL`` when
given: that server is FLUSHDB'ed between tests, so point it at a scratch database), on one
running our module, and on a local Redis Cluster of 3 primaries and 3 replicas (or on
``REDIS_CLUSTER_URL``, a ``redis+cluster://`` URL of a scratch cluster)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from _helpers import connect

from accumulator import _connection, _direct, _module
from accumulator.testing import LocalCluster, RedisServer, find_server_binary


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=os.environ.get("ACCUMULATOR_SLOW") == "1",
        help="also run the tests marked slow (fault drills, multi-process runs); "
        "ACCUMULATOR_SLOW=1 does the same (.ci/run sets it)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow or ACCUMULATOR_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@dataclass
class Target:
    """Where a test's accumulators live. ``client()`` gives a fresh handle to the same data."""

    kind: str  # "fake" | "real" | "module" (a real server running our Redis module) | "cluster"
    url: str | None = None
    server: RedisServer | None = None  # only when the session started it (fault tests)
    _fake_server: Any = field(default=None, repr=False)

    def client(self) -> redis.Redis | str:
        if self.kind == "fake":
            import fakeredis

            return fakeredis.FakeRedis(server=self._fake_server)
        assert self.url is not None
        return self.url

    def redis(self) -> Any:
        """A plain client for assertions about keys (a ``RedisCluster`` on the cluster: one
        per session, a new one fetches the command table and the slot map, ~35 ms)."""
        client = self.client()
        if not isinstance(client, str):
            return client
        if self.kind == "cluster":
            if client not in _CLUSTER_CLIENTS:
                shared = connect(client)
                shared.close = lambda: None  # a test's close() must not end it for the others
                _CLUSTER_CLIENTS[client] = shared
            return _CLUSTER_CLIENTS[client]
        return connect(client)


_CLUSTER_CLIENTS: dict[str, Any] = {}


@pytest.fixture(scope="session")
def real_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with RedisServer(module=False) as server:  # a plain server, as managed Redis is
        yield server.url


@pytest.fixture(scope="session")
def module_url() -> Iterator[str]:
    """A server running our Redis module (accumulator/module/accsum.c, built on demand):
    dense accumulators of the dtypes it adds keep their sums in Redis there."""
    url = os.environ.get("REDIS_MODULE_URL")
    if url:
        yield url
        return
    if os.environ.get("REDIS_URL"):
        pytest.skip("REDIS_URL given without REDIS_MODULE_URL: no server with the module")
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    if _module.find_compiler() is None:
        pytest.skip("no C compiler: the accsum module cannot be built")
    with RedisServer(module=True) as server:
        yield server.url


@pytest.fixture(scope="session")
def cluster_url() -> Iterator[str]:
    """A ``redis+cluster://`` URL of a local cluster (3 primaries, 3 replicas)."""
    url = os.environ.get("REDIS_CLUSTER_URL")
    if url:
        yield url
        return
    if os.environ.get("REDIS_URL"):
        pytest.skip("REDIS_URL given without REDIS_CLUSTER_URL: no cluster")
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with LocalCluster(primaries=3, replicas_each=1) as cluster:
        # One share of the URL's clients held for the session: every accumulator a test opens
        # on it reuses them (a new cluster client fetches COMMAND and loads the scripts on every
        # primary: ~50 ms, per test without this).
        share = _connection.connect(cluster.cluster_url)
        try:
            yield cluster.cluster_url
        finally:
            share.close()


def _fresh_real(url: str, kind: str = "real") -> Target:
    target = Target(kind, url=url)
    if kind == "cluster":
        target.redis().flushall()  # every primary (replicas follow)
    else:
        redis.Redis.from_url(url).flushdb()
    return target


@pytest.fixture(params=["fake", "real", "module", "cluster"])
def target(request: pytest.FixtureRequest) -> Target:
    """Every backend: fakeredis, a plain server (the taker sums), a server with our module
    (sums kept in Redis), and a Redis Cluster (the taker sums)."""
    if request.param == "fake":
        import fakeredis

        return Target("fake", _fake_server=fakeredis.FakeServer())
    if request.param == "module":
        return _fresh_real(request.getfixturevalue("module_url"), "module")
    if request.param == "cluster":
        return _fresh_real(request.getfixturevalue("cluster_url"), "cluster")
    return _fresh_real(request.getfixturevalue("real_url"))


@pytest.fixture(params=["real", "module", "cluster"])
def real(request: pytest.FixtureRequest) -> Target:
    """Real servers only (plain, with our module, and a cluster): multi-process behaviour,
    INFO, and similar."""
    if request.param == "module":
        return _fresh_real(request.getfixturevalue("module_url"), "module")
    if request.param == "cluster":
        return _fresh_real(request.getfixturevalue("cluster_url"), "cluster")
    return _fresh_real(request.getfixturevalue("real_url"))


@pytest.fixture
def own_server() -> Iterator[Target]:
    """A real server of this test's own, for faults (kill, restart) that would hurt others."""
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with RedisServer() as server:
        yield Target("real", url=server.url, server=server)


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times any redis-py connection sent commands, in ``sends[0]`` (a pipeline is
    sent at once: one round trip). Real servers only (fakeredis sends no bytes)."""
    count = [0]
    original = redis.connection.AbstractConnection.send_packed_command

    def send(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
    gathered = _direct._gathered

    def gather(sock: Any, views: Any) -> None:  # our own sends of several pieces (sendmsg)
        count[0] += 1
        gathered(sock, views)

    monkeypatch.setattr(_direct, "_gathered", gather)
    return count
