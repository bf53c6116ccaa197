"""Chunk plans for large payloads (pure functions, no I/O).

A payload larger than :data:`accumulator._core.INLINE_MAX_BYTES` is stored in parts of
:data:`CHUNK_BYTES` (the last one shorter) under its own keys, and read back the same way:
no single Redis command moves more than one chunk. Measured on this project's machines
(``shared/notes/redis-facts.md``): 1-2 MiB values are the sweet spot; smaller ones pay
per-command overhead, and from 8 MiB up every value costs the server far more.

The scripts know the same number (``CHUNK`` in ``lua/_common.lua``); a test checks they agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

#: Bytes per part of a large payload (a multiple of every dtype's item size): 1 MiB less
#: 4 KiB. Redis stores a value received as a big argument in an allocation of its length plus
#: ~12 bytes (string header, CRLF); jemalloc's size classes around 1 MiB are 1, 1.25, 1.5 MiB,
#: so an exact 1 MiB part took 1.25 MiB of server memory, and a 1 MiB - 4 KiB part takes 1 MiB
#: (``MEMORY USAGE`` of a part tells; measured on redis 7.0 with its jemalloc 5.3).
CHUNK_BYTES = (1 << 20) - (4 << 10)

#: Parts of a large gradient the accsum module path adds into the round's sum per script (the
#: apply, then ``fold`` calls): ~8 MiB of adds, a few ms of Redis's thread each, so other
#: clients are served in between (``FOLD`` in ``lua/_common.lua``; a test checks they agree).
FOLD_PARTS = 8

#: Bytes a streaming reader asks for per round trip (all gradients of a few parts).
WINDOW_BYTES = 8 << 20


#: A payload of up to this many bytes is stored as one part of its length: a gradient of
#: exactly 1 MiB (a common size) stays one value rather than a chunk and a 4 KiB tail (that
#: cost its apply ~40% more); ``SOLE`` in ``lua/_common.lua``.
SOLE_PART_BYTES = 1 << 20


def n_parts(nbytes: int, chunk: int = CHUNK_BYTES) -> int:
    """How many parts a payload of ``nbytes`` is stored in (at least one)."""
    if nbytes <= max(chunk, SOLE_PART_BYTES):
        return 1
    return -(-nbytes // chunk)


def part_ranges(nbytes: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """``(start, stop)`` byte offsets of every part of a payload of ``nbytes``: parts of
    ``chunk`` bytes, the last one shorter (or one part of up to 1 MiB)."""
    n = n_parts(nbytes, chunk)
    if n == 1:
        return [(0, nbytes)]
    return [(i * chunk, min((i + 1) * chunk, nbytes)) for i in range(n)]


def windows(parts: int, sources: int, window: int = WINDOW_BYTES,
            chunk: int = CHUNK_BYTES) -> Iterator[range]:  # fmt: skip
    """Part indices to fetch per round trip when ``sources`` payloads of ``parts`` parts
    each are read side by side: about ``window`` bytes at a time, at least one part."""
    step = max(1, window // max(1, sources * chunk))
    for first in range(0, parts, step):
        yield range(first, min(first + step, parts))


def byte_windows(sizes: Sequence[int], window: int = WINDOW_BYTES) -> list[range]:
    """Consecutive index ranges of items of ``sizes`` bytes to fetch per round trip: about
    ``window`` bytes each (at least one item), in order."""
    out: list[range] = []
    first, total = 0, 0
    for j, size in enumerate(sizes):
        if j > first and total + size > window:
            out.append(range(first, j))
            first, total = j, 0
        total += size
    if first < len(sizes):
        out.append(range(first, len(sizes)))
    return out
