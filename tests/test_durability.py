"""Durability users choose: ``min_replicas`` (WAIT) and ``wait_aof`` (WAITAOF), on a primary
with a replica started by ``accumulator.testing.ReplicaSet``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import accumulator
from accumulator import aio
from accumulator.testing import RedisServer, ReplicaSet, fake_client, find_server_binary

LARGE = (300_000,)  # in parts


@pytest.fixture(scope="module")
def group() -> Iterator[ReplicaSet]:
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with ReplicaSet(replicas=1, module=False) as servers:
        yield servers


@pytest.fixture
def servers(group: ReplicaSet) -> ReplicaSet:
    group.primary.client().flushall()
    return group


@contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """The server's process stopped (SIGSTOP): it acknowledges nothing until resumed."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def make(servers: ReplicaSet, shape=(3,), **kw) -> accumulator.ConditionalAccumulator:
    return accumulator.ConditionalAccumulator(np.float32, shape, shared_name="d",
                                              client=servers.url, **kw)  # fmt: skip


@pytest.mark.parametrize("shape", [(3,), LARGE], ids=["inline", "parts"])
def test_an_apply_returns_once_the_replica_has_it(servers, shape):
    acc = make(servers, shape, min_replicas=1)
    replica = servers.replicas[0].client()
    state = acc._keys.state
    for i in range(10):
        assert acc.apply_grad(np.ones(shape), local_step=0)
        assert int(replica.hget(state, "count")) == i + 1  # there already, not eventually
    np.testing.assert_array_equal(acc.take_grad(10), np.ones(shape))
    assert int(replica.hget(state, "step")) == 1 and int(replica.hget(state, "count")) == 0


@pytest.mark.parametrize("shape", [(3,), LARGE], ids=["inline", "parts"])
def test_an_apply_the_replica_does_not_confirm_raises_and_counts_once(servers, shape):
    acc = make(servers, shape, min_replicas=1)
    acc.durability_timeout = 0.3
    with paused(servers.replicas[0]), pytest.raises(
        accumulator.NotDurableError, match="applied on the primary.*Do not apply it again"
    ) as raised:
        acc.apply_grad(np.full(shape, 2.0), local_step=0)
    assert acc.num_accumulated() == 1  # it is counted
    # not a fault a retry loop catching UnavailableError (or ConnectionError) would retry:
    # made again, it counts twice (and an identical gradient made next may be a new one)
    assert not isinstance(raised.value, accumulator.UnavailableError | ConnectionError)
    assert acc.apply_grad(np.full(shape, 4.0), local_step=0)  # the next one is confirmed
    np.testing.assert_array_equal(acc.take_grad(2), np.full(shape, 3.0))


def test_more_replicas_than_the_server_has_time_out(servers):
    acc = make(servers, min_replicas=2)
    acc.durability_timeout = 0.2
    missing = r"acknowledgement of 1 more replica \(1 of 2 so far\)"
    with pytest.raises(accumulator.NotDurableError, match=missing):
        acc.apply_grad(np.ones(3))
    assert acc.apply_grad(np.ones(3), local_step=-1) is False  # stale: nothing to confirm


def test_a_take_whose_finish_is_not_confirmed_returns_its_round_and_warns(servers, caplog):
    acc = make(servers, min_replicas=1)
    acc.apply_grad(np.ones(3))
    acc.durability_timeout = 0.3
    with caplog.at_level(logging.WARNING, "accumulator"), paused(servers.replicas[0]):
        np.testing.assert_array_equal(acc.take_grad(1), np.ones(3))
    assert "a failover now could let another take take it again" in caplog.text
    assert acc.global_step() == 1


def test_the_asyncio_twin_waits_the_same_way(servers):
    async def main() -> None:
        twin = aio.ConditionalAccumulator(np.float32, (3,), shared_name="a", client=servers.url,
                                          min_replicas=1)  # fmt: skip
        async with twin as acc:
            replica = servers.replicas[0].client()
            assert await acc.apply_grad(np.ones(3))
            assert int(replica.hget(acc._keys.state, "count")) == 1
            acc.durability_timeout = 0.3
            with paused(servers.replicas[0]), pytest.raises(accumulator.NotDurableError):
                await acc.apply_grad(np.ones(3))
            assert await acc.num_accumulated() == 2

    asyncio.run(main())


def test_wait_aof_needs_a_server_that_can(servers):
    version = tuple(int(x) for x in servers.primary.client().info("server")["redis_version"]
                    .split(".")[:2])  # fmt: skip
    if version < (7, 2):
        with pytest.raises(accumulator.InvalidArgumentError, match="WAITAOF failed"):
            make(servers, wait_aof=True)
        return
    with pytest.raises(accumulator.InvalidArgumentError, match="appendonly") as refused:
        make(servers, wait_aof=True)  # the primary runs without an AOF
    assert not isinstance(refused.value, ConnectionError)  # not transient: nothing retries it
    with RedisServer(persistent=True, module=False) as server:
        acc = accumulator.ConditionalAccumulator(np.float32, (3,), client=server.url,
                                                 wait_aof=True)  # fmt: skip
        assert acc.apply_grad(np.ones(3))


def test_a_double_without_wait_is_refused_at_open_or_times_out():
    client = fake_client()
    try:
        acc = accumulator.ConditionalAccumulator(np.float32, (3,), client=client,
                                                 min_replicas=1)  # fmt: skip
    except accumulator.InvalidArgumentError as exc:
        assert "cannot confirm writes" in str(exc)
        return
    acc.durability_timeout = 0.1
    with pytest.raises(accumulator.NotDurableError):  # it has no replica
        acc.apply_grad(np.ones(3))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"min_replicas": -1}, "min_replicas must be a non-negative integer"),
    ({"min_replicas": True}, "min_replicas must be a non-negative integer"),
    ({"wait_aof": 1}, "wait_aof must be True or False"),
])  # fmt: skip
def test_bad_settings_are_refused_before_any_io(kwargs, match):
    with pytest.raises(accumulator.InvalidArgumentError, match=match):
        accumulator.ConditionalAccumulator(np.float32, client="redis://127.0.0.1:1", **kwargs)
