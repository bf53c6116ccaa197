"""The command packer of our connections: hiredis's for small commands, redis-py's
pure-Python one for commands with a big value, which it sends from the caller's buffer
(no copy). The asyncio driver packs with it too."""

from __future__ import annotations

from typing import Any, cast

import redis
from redis.connection import PythonRespSerializer

#: Above this size an argument is sent as its own buffer (no copy into one command buffer).
_BIG_ARG = 64 * 1024


def _encode(value: Any) -> bytes | memoryview:
    if isinstance(value, (bytes, memoryview)):
        return value
    if isinstance(value, bytearray):
        return memoryview(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)):
        return repr(value).encode()
    raise redis.DataError(f"cannot send {type(value).__name__} to Redis")


class _Packer:
    """hiredis's packer for small commands, redis-py's pure-Python one for big values.

    hiredis copies every argument into one buffer (3-5x slower than a plain socket send from
    1 MiB up); the Python packer sends big arguments as separate buffers.
    """

    def __init__(self) -> None:
        self._python = PythonRespSerializer(_BIG_ARG, _encode)
        self._hiredis: Any = None
        self._small: Any = self._python
        try:
            import hiredis
            from redis.connection import HiredisRespSerializer
        except ImportError:
            return
        # (hiredis before 2.2 has no pack_command: the Python packer then, as redis-py does)
        pack = getattr(hiredis, "pack_command", None)
        if pack is not None:
            self._small, self._hiredis = HiredisRespSerializer(), pack

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        for arg in args:
            if isinstance(arg, (bytes, bytearray, memoryview)) and len(arg) > _BIG_ARG:
                if isinstance(arg, memoryview) and arg.format != "B":
                    raise redis.DataError("memoryviews must be cast to bytes ('B')")
                return cast("list[bytes | memoryview]", self._python.pack(*args))
        if self._hiredis is None:
            return cast("list[bytes | memoryview]", self._small.pack(*args))
        # Numbers are made bytes here, not by hiredis: its conversion runs the signal handlers
        # due, and one that raised (Ctrl-C, a SIGTERM handler's SystemExit) crashed the
        # process (hiredis-py uses the failed conversion unchecked: SIGSEGV; interrupt
        # review). Here a handler's exception is raised as any other.
        args = tuple(_number(a) if type(a) in _NUMBERS else a for a in args)
        head = args[0]
        if type(head) is str and " " not in head:
            # hiredis packs str, bytes and memoryviews itself: redis-py's wrapper (a copy of
            # every argument into a new tuple) costs as much as the packing
            try:
                return [self._hiredis(args)]
            except TypeError:
                pass  # a bytearray, say: redis-py's wrapper converts it (or says why not)
        return cast("list[bytes | memoryview]", self._small.pack(*args))


_NUMBERS = (int, float)


def _number(value: int | float) -> bytes:
    """A number as Redis is sent it (as redis-py's encoder writes it)."""
    return repr(value).encode()


_PACKER = _Packer()
#: A command packed as the synchronous connections pack it (hiredis for small commands, big
#: values as their own pieces): the asyncio driver's packer too (redis.asyncio packs in Python).
pack = _PACKER.pack
