"""Zero-copy reads: GET replies received straight into the caller's buffers.

redis-py turns every bulk reply into a new ``bytes`` (and its parser grows a buffer for it):
reading 16 MiB in 1 MiB parts took ~21 ms that way, ~6 ms received with ``recv_into`` into
the final buffer (measured on this project's machines). :func:`get_into` sends a pipeline of
GETs on a pooled connection and parses the replies itself: for each one, the header line
(``$<n>``), then the payload straight into its buffer, then ``\\r\\n``.

Only plain bulk replies are taken: a missing key (``$-1``/``_``) or a length other than the
buffer's is reported per key, an error reply raises :class:`redis.ResponseError`, anything
else (a RESP3 push, a client without a socket such as fakeredis) makes :func:`get_into`
return None so that the caller reads the ordinary way. A connection whose replies were not
all consumed cleanly is disconnected, never given back half-read.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from ._direct import pooled, send_pieces
from ._routing import by_node, is_cluster, is_redirect

_RECV = 65536

_T = TypeVar("_T")


class _Unsupported(Exception):
    """A reply this reader does not parse: read the ordinary way instead."""


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(_RECV)
        if not chunk:
            raise redis.ConnectionError("connection closed while reading a reply")
        self.buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[: end + 2]
                return line
            if len(self.buf) > 1024:
                raise _Unsupported("reply header too long")
            self._fill()

    def _skip(self, n: int) -> None:
        while n > 0:
            if not self.buf:
                self._fill()
            drop = min(n, len(self.buf))
            del self.buf[:drop]
            n -= drop

    def _header(self) -> int | None:
        """The next reply's bulk length; None for a nil reply (missing key)."""
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            n = int(line[1:])
            return None if n < 0 else n
        if kind == b"_":
            return None
        if kind == b"-":
            raise _error(line[1:].decode(errors="replace"))
        raise _Unsupported(f"reply of type {kind!r}")

    def _payload_into(self, out: memoryview) -> None:
        """The ``out.nbytes`` bytes of the bulk whose header was read, then its ``\\r\\n``."""
        n = out.nbytes
        have = min(n, len(self.buf))
        out[:have] = self.buf[:have]
        del self.buf[:have]
        pos = have
        while pos < n:
            got = self.sock.recv_into(out[pos:], n - pos)
            if not got:
                raise redis.ConnectionError("connection closed while reading a reply")
            pos += got
        self._skip(2)

    def bulk_into(self, out: memoryview) -> bool:
        """The next reply into ``out``: True if it was a bulk string of exactly its length."""
        n = self._header()
        if n is None:
            return False
        if n != out.nbytes:
            self._skip(n + 2)
            return False
        self._payload_into(out)
        return True

    def bulk_at(self, into: memoryview, pos: int) -> int:
        """The next reply into ``into`` from ``pos`` on: its length, -1 for a nil reply, -2
        (skipped) when it is longer than what is left."""
        n = self._header()
        if n is None:
            return -1
        if pos + n > into.nbytes:
            self._skip(n + 2)
            return -2
        self._payload_into(into[pos : pos + n])
        return n

    def _bytes(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        value = bytes(self.buf[:n])
        del self.buf[:n]
        return value

    def bulks(self) -> list[bytes | None]:
        """The next reply, an array of bulk strings or nulls (HMGET's), as a list."""
        line = self._line()
        if line[:1] == b"-":
            raise _error(line[1:].decode(errors="replace"))
        if line[:1] != b"*" or int(line[1:]) < 0:
            raise _Unsupported(f"reply {line[:20]!r} is not an array")
        out: list[bytes | None] = []
        for _ in range(int(line[1:])):
            item = self._line()
            if item == b"_" or item == b"$-1":
                out.append(None)
            elif item[:1] == b"$" and int(item[1:]) >= 0:
                out.append(self._bytes(int(item[1:]) + 2)[:-2])
            else:
                raise _Unsupported(f"array item {item[:20]!r} is not a bulk string")
        return out


def _error(text: str) -> redis.RedisError:
    """An error reply as redis-py's own parser raises it (``LOADING`` a transient
    ``BusyLoadingError``, ``MOVED`` a ``MovedError``, ...), else a ``ResponseError``."""
    try:
        from redis._parsers.base import BaseParser
    except ImportError:  # another redis-py layout: the text still says what it is
        return redis.ResponseError(text)
    error: redis.RedisError = BaseParser.parse_error(text)
    return error


def get_into(
    client: Any, keys: Sequence[str | bytes], outs: Sequence[memoryview]
) -> list[bool] | None:
    """GET every key into its buffer (flat, writable byte views of the expected lengths), in
    one pipeline; per key whether it was there at that length. None: this client cannot be
    read this way (the caller uses redis-py)."""
    if is_cluster(client):
        return _cluster_get_into(client, keys, outs)
    sent = _send_gets(client, keys)
    got = None if sent is None else _receive(*sent, _gets_into(outs))
    return None if got is None else got[1]


def get_all_into(client: Any, keys: Sequence[str | bytes], into: memoryview) -> list[int] | None:
    """GET every key into ``into``, each value right behind the one before, in one pipeline:
    per key its length, -1 when it is missing, -2 when it did not fit in what was left (then
    nothing after it is placed either: -2 for the rest). None: this client cannot be read this
    way (the caller uses redis-py)."""
    if is_cluster(client):
        return None
    sent = _send_gets(client, keys)
    if sent is None:
        return None

    def read(reader: _Reader) -> list[int]:
        lengths: list[int] = []
        pos = 0
        for _ in keys:
            n = reader.bulk_at(into, pos)
            if n == -2:
                pos = into.nbytes  # out of room: whatever follows does not fit either
            elif n > 0:
                pos += n
            lengths.append(n)
        return lengths

    got = _receive(*sent, read)
    return None if got is None else got


def hmget_get_into(
    client: Any, name: str | bytes, fields: Sequence[str], keys: Sequence[str | bytes],
    outs: Sequence[memoryview],
) -> tuple[list[bytes | None], list[bool]] | None:  # fmt: skip
    """``HMGET name fields`` and, in the same pipeline, GET every key into its buffer (as
    :func:`get_into`): (the hash's values, per key whether it was there at that length).
    None: this client cannot be read this way (a cluster client, fakeredis...)."""
    if is_cluster(client):
        return None
    sent = _send_gets(client, keys, ("HMGET", name, *fields))
    got = None if sent is None else _receive(*sent, _gets_into(outs, lead=True))
    return None if got is None or got[0] is None else (got[0], got[1])


def _send_gets(
    client: Any, keys: Sequence[str | bytes], lead: Sequence[Any] | None = None
) -> tuple[Any, Any] | None:
    """Send one pipeline of GETs (behind ``lead``, a command whose reply is an array of bulk
    strings, when given) on a pooled connection of ``client``: (pool, connection) to read the
    replies from (:func:`_receive`), or None when this client cannot be read in place."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or not keys:
        return None
    conn = pooled(pool, "GET")
    if not isinstance(conn, redis.connection.AbstractConnection):
        pool.release(conn)
        return None
    commands = [("GET", key) for key in keys]
    try:
        send_pieces(conn, conn.pack_commands([lead, *commands] if lead else commands))
    except BaseException:
        conn.disconnect()
        pool.release(conn)
        raise
    return pool, conn


def _drop(pending: tuple[Any, Any]) -> None:
    """Give back a connection of :func:`_send_gets` whose replies will not be read."""
    pool, conn = pending
    conn.disconnect()
    pool.release(conn)


def _receive(pool: Any, conn: Any, read: Callable[[_Reader], _T]) -> _T | None:
    """``read`` the replies of :func:`_send_gets` (from a reader of the connection's socket),
    or None when a reply is not one this reader parses. The connection goes back to its pool
    (disconnected unless every reply was consumed cleanly)."""
    clean = False
    try:
        sock = getattr(conn, "_sock", None)
        if not isinstance(sock, socket.socket):
            return None  # sent but not readable here: drop the connection
        reader = _Reader(sock)
        result = read(reader)
        clean = not reader.buf  # nothing beyond the replies (else: out of step)
        return result
    except _Unsupported:
        return None
    except OSError as exc:  # socket.timeout included
        raise redis.ConnectionError(f"reading payloads: {exc}") from exc
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


def _gets_into(outs: Sequence[memoryview], lead: bool = False) -> Callable[
    [_Reader], tuple[list[bytes | None] | None, list[bool]]
]:  # fmt: skip
    """The reading of :func:`_send_gets`' replies into ``outs``: (``lead``: the lead
    command's reply, else None; per buffer whether its GET reply was received into it)."""

    def read(reader: _Reader) -> tuple[list[bytes | None] | None, list[bool]]:
        head = reader.bulks() if lead else None
        return head, [reader.bulk_into(out) for out in outs]

    return read


def _cluster_get_into(
    client: Any, keys: Sequence[str | bytes], outs: Sequence[memoryview]
) -> list[bool] | None:
    """:func:`get_into` on a cluster: one pipeline per primary holding some of the keys, on
    that node's own client, all sent before any is read (the nodes work at once). None (the
    caller reads through redis-py's cluster client, which follows redirects and failovers)
    when a slot is moving or a node is unreachable."""
    try:
        groups = list(by_node(client, keys).values())
    except (redis.RedisError, KeyError, IndexError):
        return None
    sent: list[tuple[list[int], tuple[Any, Any] | None]] = []
    found: list[bool] = [False] * len(keys)
    failed: BaseException | None = None
    unsupported = False
    done = 0  # the sent pipelines handed back to their pools so far
    try:
        try:
            for node, indices in groups:
                node_client = client.get_redis_connection(node)
                sent.append((indices, _send_gets(node_client, [keys[i] for i in indices])))
        except (redis.ConnectionError, redis.TimeoutError):
            unsupported = True  # a node is gone: redis-py's client finds where the keys went
        for indices, pending in sent:
            done += 1
            if pending is None:
                unsupported = True
                continue
            if failed or unsupported:  # not to be read: never reuse it half-read
                _drop(pending)
                continue
            try:
                # _receive gives the connection back
                got = _receive(*pending, _gets_into([outs[i] for i in indices]))
            except redis.ResponseError as exc:
                failed = None if is_redirect(exc) else exc
                unsupported = True
                continue
            except redis.ConnectionError:
                unsupported = True
                continue
            if got is None:
                unsupported = True
                continue
            for i, ok in zip(indices, got[1], strict=True):
                found[i] = ok
    finally:
        # anything else raised (Ctrl-C, an error of the send loop): the pipelines not read
        # are dropped, not left checked out of their pools with their replies pending
        for _, pending in sent[done:]:
            if pending is not None:
                _drop(pending)
    if failed is not None:
        raise failed
    return None if unsupported else found
