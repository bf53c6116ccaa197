"""Commands sent on a pooled connection directly: a script call, or a batch of script calls
and SETs, written and its replies read, without redis-py's per-command layer (see
:func:`execute`). The asyncio twins are in ``accumulator/aio/_connection.py``."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from redis.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._routing import raise_first_error


def pooled(pool: Any, command_name: str) -> Any:
    """A connection of ``pool`` (redis-py before 5.3 wants the command's name)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection(command_name)


def direct_pool(client: Any) -> Any:
    """The pool whose connections a command of ``client`` may be sent on directly (by
    :func:`execute`, :func:`execute_batch` and their asyncio twins), or None: a cluster client
    (no pool of its own) or a single-connection client (its one connection)."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or getattr(client, "connection", None) is not None:
        return None
    return pool


def execute(client: Any, *command: Any) -> Any:
    """``client.execute_command(*command)``, sent on a pooled connection of a plain client
    directly: the command sent, its reply read, nothing else.

    redis-py's per-command machinery (its retry wrapper, event and metrics hooks, argument
    copies) costs ~30 µs of Python per call, as much as a small script's own work; the
    callers retry through :mod:`._retry` themselves (scripts are idempotent), and a
    connection that failed mid-command is dropped. An error reply leaves the connection
    clean. Cluster clients, single-connection clients and connections of other libraries
    go through ``execute_command``; so does any command whose reply redis-py post-processes
    (only script calls come here: their replies are returned as read)."""
    pool = direct_pool(client)
    if pool is None:
        return client.execute_command(*command)
    conn = pooled(pool, command[0])
    if not isinstance(conn, AbstractConnection):
        pool.release(conn)
        return client.execute_command(*command)
    try:
        send_pieces(conn, conn.pack_command(*command))
        return conn.read_response()
    except ResponseError:
        raise
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


#: The most buffers one ``sendmsg`` is given (Linux refuses more than ``IOV_MAX``, 1024).
_IOV = 512


def send_pieces(conn: Any, pieces: Sequence[bytes | memoryview]) -> None:
    """``conn.send_packed_command(pieces)``, with the pieces handed to the kernel together
    (``sendmsg``, a gathered write) instead of one ``sendall`` each.

    A command with a large value is packed as its header, the caller's buffer (not copied) and
    what follows; one ``sendall`` each (redis-py's way) cost a 1 MiB apply ~50 µs of its
    ~0.65 ms on loopback, and a 1 MiB SET with a PING behind it ~200 µs of ~0.57 ms.
    The socket takes what fits; the rest follows where it stopped. TLS sockets and other
    connections than a plain socket's are sent as redis-py sends them."""
    if len(pieces) == 1 or getattr(conn, "_sock", None) is None:
        conn.send_packed_command(pieces)  # (connects first)
        return
    conn.check_health()
    sock = conn._sock
    if type(sock) is not socket.socket or not hasattr(sock, "sendmsg"):
        conn.send_packed_command(pieces, check_health=False)
        return
    try:
        _gathered(sock, [memoryview(p).cast("B") for p in pieces])
    except TimeoutError:  # (socket.timeout)
        conn.disconnect()
        raise RedisTimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc
    except BaseException:
        conn.disconnect()  # cut short mid-command: the connection is out of step
        raise


def _gathered(sock: socket.socket, views: list[memoryview]) -> None:
    """Write ``views`` to ``sock`` in order, as many per ``sendmsg`` as it takes."""
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV])
        while i < len(views) and sent >= views[i].nbytes:
            sent -= views[i].nbytes
            i += 1
        if sent:
            views[i] = views[i][sent:]


def execute_batch(client: Any, commands: Sequence[Sequence[Any]],
                  raise_on_error: bool) -> list[Any] | None:  # fmt: skip
    """A pipeline of script calls and SETs (without GET) sent on a pooled connection of a
    plain client directly (as :func:`execute`): the replies as redis-py's pipeline gives them (error
    replies as exception objects in the list, or the first one raised after all were read).
    None when these commands or this client are not for it: the caller uses a pipeline."""
    pool = direct_pool(client)
    if pool is None or not direct(commands):
        return None
    conn = pooled(pool, "EVALSHA")
    if not isinstance(conn, AbstractConnection):
        pool.release(conn)
        return None
    replies: list[Any] = []
    try:
        send_pieces(conn, conn.pack_commands(commands))
        for command in commands:
            try:
                replies.append(as_pipeline_reply(command, conn.read_response()))
            except ResponseError as exc:
                replies.append(exc)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
    return raise_first_error(replies) if raise_on_error else replies


def direct(commands: Sequence[Sequence[Any]]) -> bool:
    """Whether a batch may go on a connection directly (:func:`execute_batch`, and the asyncio
    twin's): script calls and SETs without GET, whose replies :func:`as_pipeline_reply` gives
    as redis-py's pipeline would."""
    return all(c[0] == "EVALSHA" or (c[0] == "SET" and "GET" not in c[3:]) for c in commands)


def as_pipeline_reply(command: Sequence[Any], reply: Any) -> Any:
    """A reply as read from the connection, as redis-py's pipeline returns it: SET's OK is
    True (None stays None: NX refused); every other reply as read."""
    if command[0] == "SET" and reply is not None:
        return reply == b"OK" or reply == "OK"
    return reply
