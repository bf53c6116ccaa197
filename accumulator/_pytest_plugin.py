"""pytest fixtures for testing code that uses redis-accumulator (registered through the
``pytest11`` entry point when the package is installed; ``-p no:accumulator`` turns them off).

- ``redis_server``: a throwaway ``redis-server`` for the whole test session
  (:class:`accumulator.testing.RedisServer`: a free loopback port, the accsum module when a C
  compiler is present, stopped at the end).
- ``redis_url``: its URL, with the server emptied (``FLUSHALL``) before each test, so that
  every test starts from no accumulators.
- ``fake_redis``: an in-process fakeredis client (no server, no binary) on data of the test's
  own; ``fake_async_redis``: its asyncio twin on the same data (for ``accumulator.aio``).
  They need fakeredis (``pip install 'redis-accumulator[testing]'``); without it the tests
  that ask for them are skipped, saying so.

A test of a training loop is then ``def test_loop(redis_url): ...``. A ``redis-server`` (or
``valkey-server``) binary must be on ``PATH``, or its path in ``ACCUMULATOR_REDIS_SERVER``;
without one, the tests that ask for these fixtures are skipped with a message saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import redis

    from .testing import RedisServer

# redis-py, numpy and the package are imported by the fixtures, when a test asks for one:
# pytest loads this plugin in every run of an environment that has the package installed.


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A throwaway ``redis-server`` shared by the test session."""
    from .testing import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("redis-accumulator's redis_server fixture needs a redis-server binary")
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, emptied before the test (started again first if a test
    killed it: one crash test that failed before its restart broke every later one)."""
    import redis

    if not redis_server.running:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def _accumulator_fake_server() -> Any:
    """The fakeredis server behind one test's ``fake_redis`` and ``fake_async_redis``."""
    fakeredis = pytest.importorskip(
        "fakeredis", reason="redis-accumulator's fake_redis fixtures need fakeredis: "
        "pip install 'redis-accumulator[testing]'",
    )  # fmt: skip
    return fakeredis.FakeServer()


@pytest.fixture
def fake_redis(_accumulator_fake_server: Any) -> Iterator[redis.Redis]:
    """An in-process fakeredis client, its data the test's own (Lua scripts included)."""
    import fakeredis

    client = fakeredis.FakeRedis(server=_accumulator_fake_server)
    yield client
    client.close()


@pytest.fixture
def fake_async_redis(_accumulator_fake_server: Any) -> Any:
    """``fake_redis``'s asyncio twin, on the same data (``accumulator.aio`` classes take
    it as ``client=``)."""
    import fakeredis

    return fakeredis.FakeAsyncRedis(server=_accumulator_fake_server)
