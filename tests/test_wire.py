"""Zero-copy GETs (accumulator/_wire.py): replies received straight into the caller's
buffers, every odd reply handled, and the connection never given back out of step."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from accumulator._wire import get_into


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
