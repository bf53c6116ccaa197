"""Zero-copy GETs (accumulator/_wire.py): replies received straight into the caller's
buffers, every odd reply handled, and the connection never given back out of step."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from accumulator._wire import get_all_into, get_into, hmget_get_into


def _bufs(*sizes: int) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


def test_replies_land_in_the_buffers(real):
    r = real.redis()
    data = [np.random.default_rng(i).bytes(n) for i, n in enumerate((0, 5, 70_000, 1 << 20))]
    for i, d in enumerate(data):
        r.set(f"k{i}", d)
    outs = _bufs(*(len(d) for d in data))
    assert get_into(r, [f"k{i}" for i in range(4)], outs) == [True] * 4
    assert [bytes(o) for o in outs] == data
    assert r.get("k1") == data[1]  # the pooled connection is in step afterwards


def test_missing_and_wrong_length_are_reported_per_key(real):
    r = real.redis()
    r.set("a", b"abc")
    r.set("b", b"x" * 100_000)
    outs = _bufs(3, 3, 99_999, 4)
    assert get_into(r, ["a", "nope", "b", "a"], outs) == [True, False, False, False]
    assert bytes(outs[0]) == b"abc" and r.get("a") == b"abc"


def test_values_of_any_length_land_back_to_back(real):
    r = real.redis()
    if real.kind == "cluster":  # the caller reads through redis-py's cluster client
        assert get_all_into(r, ["a"], memoryview(bytearray(3))) is None
        return
    data = [np.random.default_rng(i).bytes(n) for i, n in enumerate((5, 0, 70_000, 1 << 20))]
    for i, d in enumerate(data):
        r.set(f"k{i}", d)
    total = sum(len(d) for d in data)
    into = memoryview(bytearray(total + 7))
    lengths = get_all_into(r, [f"k{i}" for i in range(4)], into)
    assert lengths == [len(d) for d in data]
    assert bytes(into[:total]) == b"".join(data) and bytes(into[total:]) == bytes(7)
    assert r.get("k0") == data[0]  # the pooled connection is in step afterwards


def test_a_missing_value_and_one_that_does_not_fit_are_reported(real):
    if real.kind == "cluster":
        pytest.skip("a cluster client is read through redis-py")
    r = real.redis()
    r.set("a", b"abc")
    r.set("b", b"x" * 100_000)
    into = memoryview(bytearray(50_000))
    # nothing is placed once a value did not fit: what follows is reported as not fitting
    assert get_all_into(r, ["a", "nope", "b", "a"], into) == [3, -1, -2, -2]
    assert bytes(into[:3]) == b"abc" and not any(into[3:])
    assert r.get("a") == b"abc"


def test_an_error_reply_raises_and_drops_the_connection(real):
    r = real.redis()
    r.rpush("list", b"x")
    r.set("a", b"abc")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        get_into(r, ["list", "a"], _bufs(1, 3))
    assert r.get("a") == b"abc" and r.ping()  # a fresh connection, in step


def test_a_client_without_a_socket_reads_the_ordinary_way(target):
    if target.kind != "fake":
        pytest.skip("fakeredis only")
    r = target.redis()
    r.set("a", b"abc")
    assert get_into(r, ["a"], _bufs(3)) is None
    assert get_all_into(r, ["a"], memoryview(bytearray(3))) is None


def test_error_replies_are_raised_as_redis_py_raises_them():
    """A server still loading its dataset after a restart answers ``LOADING``: a transient
    ``BusyLoadingError`` (retried), not a ``ResponseError`` a take would raise to its caller."""
    import socket

    from accumulator import _retry
    from accumulator._wire import _Reader

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"-LOADING Redis is loading the dataset in memory\r\n-ERR other\r\n")
        reader = _Reader(ours)
        with pytest.raises(redis.BusyLoadingError) as loading:
            reader.bulk_into(memoryview(bytearray(3)))
        assert _retry.is_transient(loading.value)
        with pytest.raises(redis.ResponseError, match="other") as other:
            reader.bulk_into(memoryview(bytearray(3)))
        assert not _retry.is_transient(other.value)


def test_a_hash_read_leads_the_gets_in_one_pipeline(real):
    r = real.redis()
    r.hset("h", mapping={"run": b"r1", "step": b"7", "empty": b""})
    r.set("p0", b"x" * 70_000)
    r.set("p1", b"yz")
    outs = _bufs(70_000, 2, 5)
    got = hmget_get_into(r, "h", ["run", "nope", "step", "empty"], ["p0", "p1", "gone"], outs)
    if real.kind == "cluster":  # the caller reads through redis-py's cluster client
        assert got is None
        return
    assert got == ([b"r1", None, b"7", b""], [True, True, False])
    assert bytes(outs[0]) == b"x" * 70_000 and bytes(outs[1]) == b"yz"
    assert hmget_get_into(r, "no-hash", ["a"], ["p1"], _bufs(2)) == ([None], [True])
    assert r.get("p1") == b"yz"  # the pooled connection is in step afterwards


def test_a_hash_read_on_resp3_reads_its_nulls(real):
    if real.kind == "cluster":
        pytest.skip("a cluster client is read through redis-py")
    r = real.redis()
    r.hset("h", "a", b"1")
    r.set("p", b"abc")
    r3 = redis.Redis(connection_pool=redis.ConnectionPool(
        **{**r.connection_pool.connection_kwargs, "protocol": 3}))  # fmt: skip
    try:
        assert hmget_get_into(r3, "h", ["a", "b"], ["p"], _bufs(3)) == ([b"1", None], [True])
    finally:
        r3.close()


def test_a_hash_read_of_a_wrong_type_raises_and_drops_the_connection(real):
    if real.kind == "cluster":
        pytest.skip("a cluster client is read through redis-py")
    r = real.redis()
    r.rpush("list", b"x")
    r.set("p", b"abc")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        hmget_get_into(r, "list", ["a"], ["p"], _bufs(3))
    assert r.get("p") == b"abc" and r.ping()


def test_bulk_arrays_are_parsed_in_both_protocols_and_across_reads():
    import socket

    from accumulator._wire import _Reader, _Unsupported

    big = b"\r\n" * 50_000  # a value holding the delimiter, longer than one recv
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"*3\r\n$3\r\nabc\r\n$-1\r\n$0\r\n\r\n"  # RESP2
                       b"*2\r\n_\r\n$100000\r\n" + big + b"\r\n"  # RESP3 null, a large value
                       b"*-1\r\n:1\r\n*1\r\n:5\r\n")  # fmt: skip
        reader = _Reader(ours)
        assert reader.bulks() == [b"abc", None, b""]
        assert reader.bulks() == [None, big]
        for _ in range(3):  # a null array, an integer, an array of integers: not ours to read
            with pytest.raises(_Unsupported):
                reader.bulks()


@pytest.mark.parametrize("where", ["send-timeout", "send-interrupt", "receive-interrupt"])
def test_a_cluster_read_cut_short_leaves_no_connection_checked_out(real, monkeypatch, where):
    """One pipeline per node is sent before any is read: an error other than a connection
    fault (a timeout sending, Ctrl-C) left the other nodes' connections checked out of their
    pools with their replies pending (review). A timeout sending now reads the ordinary way
    (None), as a connection fault does."""
    if real.kind != "cluster":
        pytest.skip("one pipeline per node: a cluster's")
    from accumulator import _wire

    r = real.redis()
    keys = [f"{{n{i}}}k" for i in range(12)]  # hash tags spread over the 3 primaries
    for key in keys:
        r.set(key, b"abc")
    step, kind = where.split("-")
    exc: BaseException = redis.TimeoutError("t") if kind == "timeout" else KeyboardInterrupt()
    name = "_send_gets" if step == "send" else "_receive"
    original = getattr(_wire, name)
    calls = [0]

    def second_fails(*args):
        calls[0] += 1
        if calls[0] == 2:
            if step == "receive":  # as _receive does when it raises
                args[1].disconnect()
                args[0].release(args[1])
            raise exc
        return original(*args)

    monkeypatch.setattr(_wire, name, second_fails)
    if kind == "timeout":
        assert get_into(r, keys, _bufs(*[3] * len(keys))) is None
    else:
        with pytest.raises(KeyboardInterrupt):
            get_into(r, keys, _bufs(*[3] * len(keys)))
    assert calls[0] == 2
    for node in r.get_primaries():
        pool = r.get_redis_connection(node).connection_pool
        assert not pool._in_use_connections, node
    monkeypatch.undo()
    outs = _bufs(*[3] * len(keys))
    assert get_into(r, keys, outs) == [True] * len(keys)
