"""accumulator.aio._connection.send: a packed command written to the connection's stream."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest
import redis
from _helpers import drain_socket

from accumulator.aio._connection import _packed, send


class _Conn:
    """What ``send`` uses of a redis.asyncio connection, over one end of a socket pair."""

    def __init__(self, writer: Any, socket_timeout: float = 5.0, health: int = 0) -> None:
        self._writer = writer
        self.socket_timeout = socket_timeout
        self.health_check_interval = health
        self.packed: list[Any] = []

    async def send_packed_command(self, pieces: Any, check_health: bool = True) -> None:
        self.packed.append(pieces)


async def _writer_over(sock: socket.socket) -> asyncio.StreamWriter:
    _, writer = await asyncio.open_connection(sock=sock)
    return writer


@pytest.mark.parametrize("size", [100, 8 << 20])
def test_one_piece_arrives_whole_without_redis_py(size):
    # 8 MiB: more than the socket takes at once; the rest drains from the transport's buffer
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    got = bytearray()
    reader = threading.Thread(target=drain_socket, args=(b, got))
    reader.start()
    piece = bytes(range(256)) * (size // 256) + b"!" * (size % 256)

    async def main() -> _Conn:
        writer = await _writer_over(a)
        conn = _Conn(writer)
        await send(conn, [piece])
        writer.close()
        await writer.wait_closed()
        return conn

    conn = asyncio.run(main())
    reader.join(10)
    b.close()
    assert bytes(got) == piece
    assert conn.packed == []


def test_a_write_nobody_takes_times_out_as_redis_py_s_error():
    a, b = socket.socketpair()  # b never reads
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    async def main() -> None:
        writer = await _writer_over(a)
        conn = _Conn(writer, socket_timeout=0.1)
        with pytest.raises(redis.TimeoutError, match="Timeout writing to socket"):
            await send(conn, [b"y" * (8 << 20)])
        writer.transport.abort()

    try:
        asyncio.run(main())
    finally:
        b.close()


@pytest.mark.parametrize("why", ["not connected", "health checks", "several pieces", "closing"])
def test_other_sends_go_through_redis_py(why):
    a, b = socket.socketpair()

    async def main() -> _Conn:
        writer = await _writer_over(a)
        conn = _Conn(None if why == "not connected" else writer,
                     health=30 if why == "health checks" else 0)  # fmt: skip
        if why == "closing":
            writer.close()
        pieces = [b"head", b"x" * 10] if why == "several pieces" else [b"x" * 10]
        await send(conn, pieces)
        writer.transport.abort()
        return conn

    try:
        conn = asyncio.run(main())
    finally:
        b.close()
    assert len(conn.packed) == 1


def test_a_batch_is_one_piece_unless_a_value_is_big():
    small = [("EVALSHA", "ab", 1, "k", b"v" * 10), ("SET", "k", b"w", "PX", 5)]
    assert len(_packed(small)) == 1
    assert _packed(small)[0].startswith(b"*5\r\n$7\r\nEVALSHA\r\n")
    big = memoryview(b"z" * (1 << 20))
    pieces = _packed([*small, ("SET", "k", big), small[0]])
    assert any(p is big or (isinstance(p, memoryview) and p.obj is big.obj) for p in pieces)
    assert b"".join(bytes(p) for p in pieces) == b"".join(
        bytes(p) for c in [*small, ("SET", "k", big), small[0]] for p in _packed([c]))
