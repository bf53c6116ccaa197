"""A Sentinel-managed client works: the accumulator derives its connections from it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
from redis.sentinel import Sentinel

import accumulator
from accumulator.testing import RedisServer, find_server_binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stall(host: str, port: int, seconds: int) -> threading.Thread:
    """The server busy for ``seconds`` (between seconds - 1 and seconds: a Lua loop on
    ``TIME``'s whole seconds), from a thread of its own, started; join it to wait it out."""
    busy = f"local t = redis.call('TIME') repeat until redis.call('TIME')[1] - t[1] >= {seconds}"
    stalled = threading.Thread(target=redis.Redis(host=host, port=port).eval, args=(busy, 0))
    stalled.start()
    return stalled


@pytest.fixture
def sentinel_master():
    yield from _sentinel_of()


def _sentinel_of(password: str | None = None):
    """A primary (with that password) and one Sentinel monitoring it as 'mymaster'."""
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server binary")
    args = ["--requirepass", password] if password else []
    with RedisServer(args=args) as master:
        folder = Path(tempfile.mkdtemp())
        port = _free_port()
        conf = folder / "sentinel.conf"
        auth = f"sentinel auth-pass mymaster {password}\n" if password else ""
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor mymaster 127.0.0.1 {master.port} 1\n{auth}"
        )
        proc = subprocess.Popen([binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            sentinel = Sentinel([("127.0.0.1", port)], socket_timeout=1)
            deadline = time.monotonic() + 10
            while True:
                try:
                    sentinel.discover_master("mymaster")
                    break
                except (redis.exceptions.RedisError, OSError):
                    if time.monotonic() > deadline:
                        pytest.skip("sentinel did not come up")
                    time.sleep(0.1)
            yield sentinel
        finally:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(folder, ignore_errors=True)


def test_sentinel_managed_client(sentinel_master):
    client = sentinel_master.master_for("mymaster", socket_timeout=5)
    acc = accumulator.ConditionalAccumulator(np.float32, shape=(2,), shared_name="s",
                                             client=client)  # fmt: skip
    assert type(acc.redis.connection_pool).__name__ == "SentinelConnectionPool"
    second = sentinel_master.master_for("mymaster")
    other = accumulator.ConditionalAccumulator(np.float32, shape=(2,), shared_name="s",
                                               client=second)  # fmt: skip
    assert other.apply_grad([1.0, 3.0]) is True
    np.testing.assert_array_equal(acc.take_grad(1, timeout=5), [1.0, 3.0])
    assert other.global_step() == 1


def test_unsupported_clients_are_refused_naming_what_to_pass():
    with pytest.raises(TypeError, match="redis.Redis .*not object"):
        accumulator.ConditionalAccumulator(np.float32, client=object())  # type: ignore[arg-type]
    # the asyncio cluster client: the synchronous cluster client is the supported one
    cluster = redis.asyncio.cluster.RedisCluster.__new__(redis.asyncio.cluster.RedisCluster)
    with pytest.raises(TypeError, match="redis.cluster.RedisCluster is supported"):
        accumulator.ConditionalAccumulator(np.float32, client=cluster)  # type: ignore[arg-type]
    aio = redis.asyncio.Redis()  # connects lazily: nothing is sent
    with pytest.raises(TypeError, match="redis.asyncio.client.Redis is an asyncio client"):
        accumulator.ConditionalAccumulator(np.float32, client=aio)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["url", "client"])
def test_the_asyncio_twins_reach_the_primary_through_sentinel(sentinel_master, given):
    """``accumulator.aio`` takes a ``redis+sentinel://`` URL (redis-py's asyncio ``from_url``
    does not) and a ``redis.asyncio`` Sentinel-managed client, as the synchronous classes do,
    and its connections stay Sentinel-managed (they follow a failover)."""
    import asyncio

    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    from accumulator import aio

    port = sentinel_master.sentinels[0].connection_pool.connection_kwargs["port"]

    async def main() -> None:
        client: object = f"redis+sentinel://127.0.0.1:{port}/mymaster"
        if given == "client":
            client = AsyncSentinel([("127.0.0.1", port)], socket_timeout=1).master_for("mymaster")
        async with aio.ConditionalAccumulator(np.float32, shape=(2,), shared_name="as",
                                              client=client) as acc:  # fmt: skip
            for c in (acc._conns.commands, acc._conns.blocking):
                assert type(c.connection_pool).__name__ == "SentinelConnectionPool"
            assert await acc.apply_grad([1.0, 3.0]) is True
            np.testing.assert_array_equal(await acc.take_grad(1, timeout=5), [1.0, 3.0])
            assert await acc.global_step() == 1

    asyncio.run(main())
    primary = sentinel_master.master_for("mymaster")
    sync = accumulator.ConditionalAccumulator(np.float32, shape=(2,), shared_name="as",
                                              client=primary)  # fmt: skip
    assert sync.global_step() == 1  # the same accumulator, on the primary
    sync.close()


def test_the_cli_gives_its_password_to_the_primary_sentinel_names() -> None:
    # (REDISCLI_AUTH, --user and --tls were ignored for redis+sentinel:// URLs: only a
    # password in the URL, which the README says to keep off the command line, worked)
    import os
    import sys

    for sentinel in _sentinel_of(password="sentpw"):
        port = sentinel.sentinels[0].connection_pool.connection_kwargs["port"]
        url = f"redis+sentinel://127.0.0.1:{port}/mymaster"
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDISCLI_AUTH")}
        run = [sys.executable, "-m", "accumulator", "--url", url, "ls"]
        done = subprocess.run(run, env={**env, "REDISCLI_AUTH": "sentpw"}, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        refused = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 3 and "password" in refused.stderr


def test_a_timed_out_command_leaves_no_reply_behind_on_a_sentinel_connection(sentinel_master):
    """A Sentinel-managed connection does not drop itself at a read timeout (redis-py leaves
    that to its retry handler), and redis-py no longer retries timeouts for us: the connection
    went back to the pool with the late reply unread, and the next command read it (found by
    the failover drill: a take read an apply's reply, then a script's SHA)."""
    client = sentinel_master.master_for("mymaster", socket_timeout=0.5)
    acc = accumulator.ConditionalAccumulator(np.float32, shape=(2,), shared_name="t",
                                             client=client, retry_window=0.1)  # fmt: skip
    assert acc.apply_grad([1.0, 1.0]) is True
    blocked = _stall(*sentinel_master.discover_master("mymaster"), 3)  # busy 2-3 s
    time.sleep(0.2)
    with pytest.raises(accumulator.UnavailableError, match="Timeout"):
        acc.num_accumulated()
    blocked.join()
    # every later call reads its own reply
    assert acc.global_step() == 0
    assert acc.apply_grad([2.0, 2.0]) is True
    assert acc.num_accumulated() == 2
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), [1.5, 1.5])  # the mean
    assert acc.global_step() == 1


def test_the_asyncio_twin_leaves_no_reply_behind_either(sentinel_master):
    import asyncio

    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    from accumulator import aio

    port = sentinel_master.sentinels[0].connection_pool.connection_kwargs["port"]

    async def main() -> None:
        client = AsyncSentinel([("127.0.0.1", port)], socket_timeout=1).master_for(
            "mymaster", socket_timeout=0.5)  # fmt: skip
        async with aio.ConditionalAccumulator(np.float32, shape=(2,), shared_name="at",
                                              client=client, retry_window=0.1) as acc:  # fmt: skip
            assert await acc.apply_grad([1.0, 1.0]) is True
            blocked = _stall(*sentinel_master.discover_master("mymaster"), 3)  # busy 2-3 s
            await asyncio.sleep(0.2)
            with pytest.raises(accumulator.UnavailableError, match="Timeout"):
                await acc.num_accumulated()
            await asyncio.to_thread(blocked.join)
            assert await acc.global_step() == 0
            assert await acc.apply_grad([2.0, 2.0]) is True
            assert await acc.num_accumulated() == 2
            np.testing.assert_array_equal(await acc.take_grad(2, timeout=5), [1.5, 1.5])

    asyncio.run(main())


def test_a_call_cut_by_ctrl_c_leaves_no_reply_behind_on_a_sentinel_connection(sentinel_master):
    """redis-py's Sentinel-managed connection keeps itself at a read error (a plain one drops
    itself): a read cut by Ctrl-C went back to the pool with its reply unread, and every
    later reply came one call late (an apply answered False, a take raised TypeError)."""
    import signal

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    client = sentinel_master.master_for("mymaster", socket_timeout=10)
    acc = accumulator.ConditionalAccumulator(np.float32, shape=(2,), shared_name="k",
                                             client=client)  # fmt: skip
    acc.set_global_step(7)
    assert acc.apply_grad([1.0, 1.0], local_step=7) is True
    blocked = _stall(*sentinel_master.discover_master("mymaster"), 2)  # busy 1-2 s
    time.sleep(0.2)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # "Ctrl-C" while the call waits its reply
        with pytest.raises(KeyboardInterrupt):
            acc.num_accumulated()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    blocked.join()
    assert acc.global_step() == 7
    assert acc.apply_grad([3.0, 3.0], local_step=7) is True
    assert acc.num_accumulated() == 2
    np.testing.assert_array_equal(acc.take_grad(2, timeout=5), [2.0, 2.0])
    assert acc.global_step() == 8


def test_the_cli_finds_a_stalled_primary_unreachable_after_the_connect_timeout(
    sentinel_master, monkeypatch
):
    """The CLI's first PING waits CONNECT_TIMEOUT through a Sentinel URL too (it waited for
    as long as the primary did not answer: CLI review)."""
    import io

    from accumulator import _cli, _cli_context

    monkeypatch.setattr(_cli_context, "CONNECT_TIMEOUT", 0.5)
    host, port = sentinel_master.discover_master("mymaster")
    sentinel_port = sentinel_master.sentinels[0].connection_pool.connection_kwargs["port"]
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster"
    stalled = _stall(host, port, 4)
    try:
        time.sleep(0.3)  # (the stall under way)
        err = io.StringIO()
        started = time.monotonic()
        code = _cli.main(["--url", url, "ls"], stdout=io.StringIO(), stderr=err)
        elapsed = time.monotonic() - started
    finally:
        stalled.join()
    assert code == 3 and "cannot connect" in err.getvalue(), (elapsed, err.getvalue())
    assert elapsed < 2.5  # (until the stall ended, before)
    assert _cli.main(["--url", url, "ls"], stdout=io.StringIO(), stderr=err) == 0
