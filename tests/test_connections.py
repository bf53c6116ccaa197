"""Connections the way redis-py users expect them: unix sockets, one pool per client or URL
shared by every accumulator opened from it, the client's pool class and ``max_connections``
kept, valkey-py clients."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from _helpers import Taker, fork_while_held

import accumulator
from accumulator import _cluster_client, _reaper, _routing, _shares, _urls
from accumulator.sync import Worker
from accumulator.testing import RedisServer, find_server_binary

pytestmark = pytest.mark.real


def _round(acc: accumulator.ConditionalAccumulator, value: float = 1.0) -> None:
    step = acc.global_step()
    assert acc.apply_grad(np.full(3, value, np.float32), local_step=step)
    np.testing.assert_array_equal(acc.take_grad(1, timeout=10), np.full(3, value, np.float32))


@pytest.fixture(scope="module")
def unix_server(tmp_path_factory: pytest.TempPathFactory):
    if find_server_binary() is None:
        pytest.skip("no redis-server binary")
    sock = tmp_path_factory.mktemp("sock") / "redis.sock"
    with RedisServer(args=["--unixsocket", str(sock), "--unixsocketperm", "700"],
                     module=False) as server:  # fmt: skip
        yield server, sock


def test_a_unix_socket_url_works(unix_server: tuple[RedisServer, Path]) -> None:
    _, sock = unix_server
    url = f"unix://{sock}?db=0"
    with accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="u", client=url) as acc:
        _round(acc)
    r = redis.Redis(unix_socket_path=str(sock))  # a unix-socket client object too
    with accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="u", client=r) as acc:
        _round(acc, 2.0)
    assert accumulator.list_accumulators(client=url)[0].shared_name == "u"


def test_accumulators_of_one_client_or_url_share_one_pool(real_url: str) -> None:
    client = redis.Redis.from_url(real_url)
    a = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="a", client=client)
    b = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="b", client=client)
    c = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="c", client=real_url)
    d = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="d", client=real_url)
    other = accumulator.ConditionalAccumulator(
        np.float32, (3,), shared_name="e", client=redis.Redis.from_url(real_url)
    )
    try:
        assert a._conns.commands is b._conns.commands and c._conns.blocking is d._conns.blocking
        assert len({id(x._conns.commands) for x in (a, c, other)}) == 3
        a.close()
        _round(b)  # closing one leaves the shared pools open for the others
        pool = b._conns.commands.connection_pool
        b.close()
        assert a._conns._key not in _shares._SHARED  # the last one closed them
        assert all(c._sock is None for c in pool._available_connections)  # type: ignore[attr-defined]
        _round(d)
    finally:
        for acc in (a, b, c, d, other):
            acc.close()


@pytest.mark.parametrize("private", [False, True], ids=["named", "private"])
def test_an_accumulator_collected_while_its_thread_holds_the_shares_lock(
    target, private: bool
) -> None:
    """The garbage collector runs a finalizer wherever it runs: inside connect(), on the
    thread holding the lock of the shared clients (seen on Python 3.13: the suite hung,
    the finalizer waiting for the lock its own thread held). Its share is released by the
    next connect() instead; a private accumulator's keys are deleted by the reaper thread,
    which then releases its share."""
    import gc

    url = target.client()
    keep = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="keep", client=url)
    name = None if private else "gone"
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name=name, client=url)
    acc.apply_grad(np.ones(3, np.float32))
    key, base = keep._conns._key, acc._keys.base
    entry = _shares._SHARED[key]
    users = entry.users
    ended = threading.Event()

    def collect_holding_the_lock() -> None:
        nonlocal acc
        with _shares._LOCK:
            del acc
            gc.collect()
        ended.set()

    threading.Thread(target=collect_holding_the_lock, daemon=True).start()
    assert ended.wait(10), "the finalizer deadlocked on the lock its own thread held"
    if private:  # its keys deleted, and its share released, by the reaper thread
        assert _reaper.wait_idle(10)
        assert not list(target.redis().scan_iter(match=f"{base}*"))
        assert entry.users == users - 1 and _shares._DEFERRED == []
    else:
        assert entry.users == users and len(_shares._DEFERRED) == 1  # deferred
    other = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="o", client=url)
    assert _shares._DEFERRED == [] and entry.users == users  # released, "o" added
    for a in (other, keep):
        a.close()
    assert entry.users == users - 2  # (another object of the session may hold a share)


def test_max_connections_and_the_pool_class_are_kept(real_url: str) -> None:
    """50 accumulators from a client capped at 8 connections, used by 16 threads at once:
    the server sees about 8 connections for their commands, plus the ones blocking waits hold."""
    pool = redis.BlockingConnectionPool.from_url(real_url, max_connections=8, timeout=20)
    client = redis.Redis(connection_pool=pool)
    probe = redis.Redis.from_url(real_url, client_name="probe")
    probing = threading.Lock()  # one probe connection, whatever thread asks

    def ours() -> int:
        with probing:
            return sum(1 for c in probe.client_list() if c.get("name") != "probe")

    before = ours()
    accs = [accumulator.ConditionalAccumulator(np.float32, (3,), shared_name=f"m{i}",
                                               client=client) for i in range(50)]  # fmt: skip
    derived = accs[0]._conns.commands.connection_pool
    assert isinstance(derived, redis.BlockingConnectionPool) and derived.max_connections == 8
    errors: list[BaseException] = []
    peak = [0]

    def work(k: int) -> None:
        try:
            for acc in accs[k::16]:
                for _ in range(3):
                    _round(acc)
                peak[0] = max(peak[0], ours() - before)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors[:3]
        # takes here find their round at once: no blocking waits, so the cap is the bound
        assert 1 <= peak[0] <= 8, peak[0]
        assert ours() - before <= 8
    finally:
        for acc in accs:
            acc.close()


def test_a_valkey_client_works_like_a_redis_client(real_url: str) -> None:
    valkey = pytest.importorskip("valkey")
    client = valkey.Valkey.from_url(real_url, max_connections=5)
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="v", client=client)
    with acc:
        _round(acc)
        assert acc._conns.commands.connection_pool.max_connections == 5
    sparse = accumulator.SparseConditionalAccumulator(np.float32, (4, 2), shared_name="vs",
                                                      client=client)  # fmt: skip
    with sparse:
        assert sparse.apply_grad([3], [[1.0, 2.0]], local_step=0)
        assert sparse.take_indexed_slices_grad(1).indices.tolist() == [3]


@pytest.mark.parametrize("queued", [False, True], ids=["head", "queued"])
def test_close_breaks_a_wait_on_shared_pools_at_once(real_url: str, queued: bool) -> None:
    """The pools outlive one accumulator now (others share them): close() must still break
    its own waiting take (on BLPOP at the head of the FIFO, or on pub/sub when queued)."""
    client = redis.Redis.from_url(real_url)
    name = f"w-{queued}"  # the session's server is not flushed between tests
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name=name, client=client)
    other = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name=name, client=client)
    acc.wait_slice = other.wait_slice = 30.0  # a slice would not end it in time
    ahead = None
    if queued:  # another taker at the head: acc waits on the queue's pub/sub channel
        ahead = threading.Thread(target=lambda: other.take_grad(2, timeout=20))
        ahead.start()
        time.sleep(0.3)

    waiter = Taker(acc, 1, timeout=20)
    waiter.start()
    time.sleep(0.3)
    started = time.monotonic()
    acc.close()
    waiter.join(5)
    assert isinstance(waiter.error, accumulator.CancelledError), waiter.error
    assert time.monotonic() - started < 2.0
    for _ in range(2):  # the shared pools still serve the other accumulator
        assert other.apply_grad(np.ones(3, np.float32))
    if ahead is not None:
        ahead.join(10)
    else:
        np.testing.assert_array_equal(other.take_grad(2, timeout=5), np.ones(3, np.float32))
    assert other.global_step() == 1
    other.close()


def test_a_command_is_routed_by_its_first_key_a_script_call_by_its_first_keys_entry():
    assert _routing.command_key(("SET", "acc:{a}:b", b"x")) == "acc:{a}:b"
    assert _routing.command_key(["EVALSHA", "f" * 40, 2, "acc:{a}:s", "acc:{a}:g", 7]) == (
        "acc:{a}:s"
    )
    assert _routing.command_key(["EVALSHA", "f" * 40, 0, "arg"]) is None
    assert _routing.command_key(("PING",)) is None
    assert _routing.routing_keys([("GET", "k1"), ("EVAL", "return 1", 1, "k2")]) == [
        "k1", "k2",
    ]  # fmt: skip
    assert _routing.routing_keys([("GET", "k1"), ("PING",)]) is None


def test_a_database_that_is_no_number_is_refused() -> None:
    """redis-py reads ``redis://host/abc`` as database 0: a typo would share db 0 with
    whatever lives there."""
    import io

    from accumulator import _cli

    for url in ("redis://:secret@127.0.0.1:1/abc", "rediss://127.0.0.1:1/-1"):
        with pytest.raises(accumulator.InvalidArgumentError, match="database number") as info:
            accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="u", client=url)
        assert "secret" not in str(info.value)
        err = io.StringIO()
        assert _cli.main(["ls", "--url", url], stdout=io.StringIO(), stderr=err) == 2
        assert "database number" in err.getvalue()
    for url in ("redis://h", "redis://h/", "redis://h/3", "redis://h/3/", "redis://h/12?x=1",
                "unix:///tmp/s.sock?db=2"):  # fmt: skip
        assert _urls.scheme_problem(url) is None, url


def test_a_port_that_is_no_number_is_refused_as_ours() -> None:
    """redis-py's ValueError before (new-user review)."""
    for url in ("redis://:secret@localhost:abc/0", "redis+cluster://h:6x79"):
        with pytest.raises(accumulator.InvalidArgumentError, match="port must be a number") as info:
            accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="u", client=url)
        assert "secret" not in str(info.value)


def test_a_url_of_another_scheme_is_refused_naming_every_scheme_we_take() -> None:
    """redis-py's own error lists only redis://, rediss:// and unix://; ours lists the cluster
    and Sentinel schemes too, is an InvalidArgumentError (also in the CLI: usage, exit 2),
    and shows no password."""
    import asyncio
    import io

    from accumulator import _cli, aio

    url = "http://user:secret@localhost:6379/0"
    with pytest.raises(accumulator.InvalidArgumentError, match="redis\\+sentinel://") as info:
        accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="u", client=url)
    assert "secret" not in str(info.value) and "redis+cluster://" in str(info.value)

    async def opened() -> None:
        await aio.ConditionalAccumulator(np.float32, (2,), shared_name="u", client=url).open()

    with pytest.raises(accumulator.InvalidArgumentError, match="rediss\\+cluster://"):
        asyncio.run(opened())
    out, err = io.StringIO(), io.StringIO()
    assert _cli.main(["ls", "--url", url], stdout=out, stderr=err) == 2
    assert "redis+sentinel://" in err.getvalue() and "secret" not in err.getvalue()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # a port nobody listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_retry_window_is_a_constructor_argument_and_a_long_outage_warns(caplog) -> None:
    """A wrong port: the constructor's own open rides out ``retry_window`` (not the default
    30 s), and past 2 s of failures the retrying is a warning (visible without logging set
    up), the first failure only INFO."""
    import logging

    url = f"redis://127.0.0.1:{_closed_port()}/0"
    for bad in (0, -1, "x", float("inf")):
        with pytest.raises(accumulator.InvalidArgumentError, match="retry_window"):
            accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="r", client=url,
                                               retry_window=bad)  # fmt: skip
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="accumulator"):
        with pytest.raises(accumulator.UnavailableError, match="unreachable for"):
            accumulator.SparseConditionalAccumulator(np.float32, (2, 2), shared_name="r",
                                                     client=url, retry_window=0.5)  # fmt: skip
        assert time.monotonic() - started < 5
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        with pytest.raises(accumulator.UnavailableError):
            accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="r", client=url,
                                               retry_window=5)  # fmt: skip
    # Once, at the first failure 2 s or more into them, before the window ends (retries are
    # at most 1 s apart: attempts near 2.55 and 3.55 s; a window of 3 s left none after 2 s
    # on a loaded machine, where the attempt meant for 2.55 s failed past 3 s).
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    found = re.search(r"unreachable for (\d+)s", warnings[0].getMessage())
    assert found and 2 <= int(found.group(1)) < 5, warnings[0].getMessage()


def test_the_window_counts_a_failed_connect_from_its_start() -> None:
    """A connect that failed after many seconds (redis-py retries a connect timeout itself:
    4 x 5 s against a server that never answers) used up that much of the window; a
    connection lost after a long transfer did not (the window starts at the failure)."""
    import redis

    from accumulator import _retry

    timed_out = redis.TimeoutError("Timeout connecting to server")
    refused = redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    lost = redis.ConnectionError("Connection closed by server.")
    assert _retry.failed_to_connect(timed_out) and _retry.failed_to_connect(refused)
    assert not _retry.failed_to_connect(lost)
    long_ago = time.monotonic() - 12
    once = r"unreachable for 1\d\.\ds \(1 attempt;"
    for exc in (timed_out, refused):
        with pytest.raises(accumulator.UnavailableError, match=once):
            _retry._next_wait(_retry.Backoff(window=10), exc, "open", lambda: False, long_ago)
    assert _retry._next_wait(_retry.Backoff(window=10), lost, "x", lambda: False, long_ago) > 0


def test_an_unreachable_cluster_url_is_retried_then_unavailable() -> None:
    """redis-py's cluster client connects when made (to learn the nodes) and raises its own
    ``RedisClusterException``: opening rides it out as any unreachable server, then raises
    UnavailableError (a ConnectionError)."""
    url = f"redis+cluster://127.0.0.1:{_closed_port()}/0"
    for open_ in (
        lambda: accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="c",
                                                   client=url, retry_window=0.5),
        lambda: Worker("job", client=url, retry_window=0.5),
        lambda: asyncio.run(_aio_open(url)),  # redis-py's asyncio cluster connects later
    ):  # fmt: skip
        started = time.monotonic()
        with pytest.raises(accumulator.UnavailableError, match="Redis Cluster unreachable") as info:
            open_()
        assert isinstance(info.value, ConnectionError)
        assert time.monotonic() - started >= 0.4  # retried, not given up at once


async def _aio_open(url: str) -> None:
    from accumulator import aio

    async with aio.ConditionalAccumulator(np.float32, (2,), shared_name="c", client=url,
                                          retry_window=0.5):  # fmt: skip
        pass


def test_a_cluster_url_of_a_plain_server_is_a_clear_error(real) -> None:
    if real.kind == "cluster":
        pytest.skip("needs a server that is no cluster node")
    url = "redis+cluster://" + real.url.split("://", 1)[1]
    with pytest.raises(accumulator.InvalidArgumentError, match="no cluster node"):
        accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="c", client=url,
                                           retry_window=5)  # fmt: skip
    with pytest.raises(accumulator.InvalidArgumentError, match="no cluster node"):
        asyncio.run(_aio_open(url))


def test_every_tls_setting_of_a_cluster_client_is_kept() -> None:
    # (a TLS cluster with a CA and no host name check was unreachable through ours: only ssl,
    # the CA and the key pair were copied; the asyncio client's ssl=True was lost entirely)
    from redis.asyncio import Redis as AsyncRedis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.asyncio.connection import SSLConnection

    given = {"host": "h", "ssl": True, "ssl_ca_certs": "ca.pem", "ssl_check_hostname": False,
             "ssl_ca_data": "PEM", "ssl_cert_reqs": "required", "ssl_unknown_to_redis_py": 1}
    assert _cluster_client.tls_settings(given, redis.Redis) == {
        "ssl": True, "ssl_ca_certs": "ca.pem", "ssl_check_hostname": False,
        "ssl_ca_data": "PEM", "ssl_cert_reqs": "required",
    }  # fmt: skip
    aio = {"connection_class": SSLConnection, "ssl_ca_certs": "ca.pem",
           "ssl_check_hostname": False, "password": "pw"}  # fmt: skip
    want = {"ssl": True, "ssl_ca_certs": "ca.pem", "ssl_check_hostname": False}
    assert _cluster_client.tls_settings(aio, AsyncRedisCluster) == want
    assert _cluster_client.node_settings(aio) == {**want, "password": "pw"}
    assert _cluster_client.tls_settings({"ssl_ca_certs": "x"}, AsyncRedis) == {"ssl_ca_certs": "x"}
    assert _cluster_client.tls_settings({"host": "h"}, redis.Redis) == {}


@pytest.mark.parametrize("path", ["/1", "/abc"])
def test_a_cluster_url_with_a_database_is_refused_our_way(path: str) -> None:
    with pytest.raises(accumulator.InvalidArgumentError, match="database 0 only"):
        accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="x",
                                           client=f"redis+cluster://127.0.0.1:1{path}")  # fmt: skip


def test_a_forked_childs_close_waits_for_none_of_the_parents_operations(real_url: str) -> None:
    """The child inherits the object's record of the parent's operations in flight (a take
    waiting in another thread): its close() waited the whole grace period for threads it
    does not have, and warned (concurrency review)."""
    import logging
    import os

    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="fork",
                                             client=real_url)  # fmt: skip
    waiting = threading.Thread(
        target=lambda: pytest.raises(accumulator.CancelledError, acc.take_grad, 1), daemon=True
    )
    waiting.start()
    deadline = time.monotonic() + 10
    while not acc._drives and time.monotonic() < deadline:
        time.sleep(0.01)
    assert acc._drives, "the take never began"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether close() warned, then leave at once
        try:
            seen: list[str] = []

            class Catch(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    seen.append(record.getMessage())

            logging.getLogger("accumulator").addHandler(Catch())
            acc.close()
            os.write(write, b"warned" if any("still running" in m for m in seen) else b"ok")
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            assert pipe.read() == b"ok"
        os.waitpid(pid, 0)
        assert waiting.is_alive()  # the parent's take still waits
    finally:
        acc.close()
        waiting.join(10)


def test_a_child_forked_while_a_thread_held_the_shared_clients_lock_can_connect(
    real_url: str,
) -> None:
    """A parent thread held the lock of the shared clients (opening or closing an
    accumulator) at the fork: the child's first connect() waited for a thread it does not
    have, forever (concurrency review: 12 of 30 amplified forks hung)."""

    def in_child() -> None:
        acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="forked",
                                                 client=real_url)  # fmt: skip
        acc.apply_grad(np.ones(3, np.float32))
        acc.close()

    fork_while_held(_shares._LOCK, in_child)
    probe = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="forked",
                                               client=real_url)  # fmt: skip
    assert probe.num_accumulated() == 1
    probe.close()
