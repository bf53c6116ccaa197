"""accumulator._direct.send_pieces: a command's pieces handed to the kernel together."""

from __future__ import annotations

import socket
import threading

import pytest
import redis
from _helpers import drain_socket

from accumulator._direct import _IOV, execute_batch, send_pieces


class _Conn:
    """What send_pieces uses of a redis-py connection, over one end of a socket pair."""

    def __init__(self, sock: object) -> None:
        self._sock = sock
        self.disconnected = 0
        self.packed: list[object] = []

    def check_health(self) -> None:
        pass

    def disconnect(self) -> None:
        self.disconnected += 1

    def send_packed_command(self, pieces: object, check_health: bool = True) -> None:
        self.packed.append(pieces)


def test_every_byte_arrives_in_order_through_partial_writes():
    # a small send buffer: the kernel takes a few KiB per call, splitting pieces anywhere;
    # more pieces than one sendmsg may carry
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(10)
    pieces: list[bytes | memoryview] = []
    for i in range(2 * _IOV + 7):
        size = (i * 37) % 301 + (50_000 if i % 97 == 0 else 0)
        pieces.append(memoryview(bytes([i % 251]) * size) if i % 2 else bytes([i % 7]) * size)
    got = bytearray()
    reader = threading.Thread(target=drain_socket, args=(b, got))
    reader.start()
    conn = _Conn(a)
    send_pieces(conn, pieces)
    a.close()
    reader.join(10)
    b.close()
    assert bytes(got) == b"".join(bytes(p) for p in pieces)
    assert conn.disconnected == 0 and conn.packed == []


@pytest.mark.parametrize(
    ("fault", "error", "match"),
    [("nobody reads", redis.TimeoutError, "Timeout writing to socket"),
     ("peer gone", redis.ConnectionError, "writing to socket")],
)  # fmt: skip
def test_a_failed_write_is_redis_py_s_error_and_drops_the_connection(fault, error, match):
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(0.05)  # nobody reads: the buffer fills, the write times out
    if fault == "peer gone":
        b.close()
    conn = _Conn(a)
    try:
        with pytest.raises(error, match=match):
            send_pieces(conn, [b"x" * 100, b"y" * (8 << 20)])
        assert conn.disconnected == 1
    finally:
        a.close()
        b.close()


def test_other_connections_are_sent_as_redis_py_sends_them():
    class Wrapped(socket.socket):  # a TLS socket, say: not a plain socket
        pass

    a, b = socket.socketpair()
    wrapped = Wrapped(fileno=a.detach())
    try:
        conn = _Conn(wrapped)
        send_pieces(conn, [b"a", b"b"])
        assert conn.packed == [[b"a", b"b"]]
        unconnected = _Conn(None)
        send_pieces(unconnected, [b"a", b"b"])  # redis-py connects it first
        assert unconnected.packed == [[b"a", b"b"]]
    finally:
        wrapped.close()
        b.close()


def test_large_values_round_trip_through_a_small_send_buffer(real):
    if real.kind == "cluster":
        pytest.skip("a cluster client sends through redis-py's cluster pipeline")
    client = redis.Redis.from_url(real.url)
    pool = client.connection_pool
    conn = pool.get_connection()
    conn.connect()
    conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    pool.release(conn)
    values = {f"direct:{i}": bytes([i]) * ((3 << 20) // (i + 1) + i) for i in range(5)}
    replies = execute_batch(client, [("SET", k, memoryview(v)) for k, v in values.items()],
                            raise_on_error=True)
    assert replies == [True] * len(values)
    assert client.mget(list(values)) == list(values.values())
    client.delete(*values)
    client.close()


@pytest.mark.parametrize("hiredis_kind", ["none", "old", "new"])
def test_the_packer_with_any_hiredis(monkeypatch: pytest.MonkeyPatch, hiredis_kind: str) -> None:
    """No hiredis, a hiredis before 2.2 (no pack_command: it broke ``import accumulator``),
    or a current one: the packer works, and packs what Redis reads."""
    import sys
    import types

    from accumulator import _packer

    if hiredis_kind == "none":
        monkeypatch.setitem(sys.modules, "hiredis", None)  # (import raises ImportError)
    elif hiredis_kind == "old":
        monkeypatch.setitem(sys.modules, "hiredis", types.ModuleType("hiredis"))
    else:
        pytest.importorskip("hiredis")
    packer = _packer._Packer()
    assert (packer._hiredis is not None) == (hiredis_kind == "new")
    wire = b"".join(bytes(p) for p in packer.pack("SET", "k", b"v" * 3, 7))
    assert wire == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nvvv\r\n$1\r\n7\r\n"
