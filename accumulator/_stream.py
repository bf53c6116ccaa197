"""Reading a claimed round's payloads in chunks (the I/O edge of the take).

A round entry is an inline payload or names payload keys (``Keys.entry_keys``). Dense takes
stream: part ``j`` of every gradient arrives together, gets reduced into the result, and is
dropped, so a take holds one result plus a window of parts whatever the number of gradients.
Sparse takes need whole payloads (rows of different gradients do not line up by offset) and
read them part by part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias, cast

import redis

from . import _chunks
from ._errors import AccumulatorError
from ._wire import get_into

#: A gradient's payload as a claim names it: the bytes (inline) or its part keys in order,
#: ``None`` for a part it no longer holds (folded into the round's running sum, which holds it).
Source: TypeAlias = bytes | list[bytes | None]


class ClaimReader:
    """Reads the payloads of one claimed round; ``io(what, fn)`` runs ``fn`` with the
    accumulator's retries (reads are idempotent)."""

    def __init__(
        self,
        commands: redis.Redis,
        io: Callable[[str, Callable[[], Any]], Any],
        sources: Sequence[Source],
        claim_key: str,
    ) -> None:
        self._commands = commands
        self._io = io
        self.sources = list(sources)
        self._claim_key = claim_key

    @property
    def keys(self) -> list[bytes]:
        """Every payload key the round names (freed once the take is finished)."""
        return [key for s in self.sources if isinstance(s, list) for key in s if key is not None]

    def _fetch(self, requests: list[tuple[bytes, int, int, bool]]) -> list[bytes]:
        """GET (whole part) or GETRANGE of each ``(key, start, stop, whole)``, in one pipeline;
        every value must be there at the expected length."""

        def run() -> list[Any]:
            pipe = self._commands.pipeline(transaction=False)
            for key, start, stop, whole in requests:
                if whole:
                    pipe.get(key)
                else:
                    pipe.getrange(key, start, stop - 1)
            return pipe.execute()

        values = self._io("take_grad (reading)", run)
        for (key, start, stop, _), value in zip(requests, values, strict=True):
            if value is None or len(value) != stop - start:
                raise AccumulatorError(
                    f"gradient payload {key[-60:]!r} of a claimed round is missing or has the "
                    f"wrong length (claim {self._claim_key})"
                )
        return list(values)

    def _fetch_whole(self, keys: list[bytes]) -> list[bytes]:
        def run() -> list[Any]:
            pipe = self._commands.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return pipe.execute()

        values = self._io("take_grad (reading)", run)
        for key, value in zip(keys, values, strict=True):
            if value is None:
                raise AccumulatorError(
                    f"gradient payload {key[-60:]!r} of a claimed round is missing "
                    f"(claim {self._claim_key})"
                )
        return list(values)

    def _fetch_into(
        self, requests: list[tuple[bytes, int, int, bool]], window: memoryview
    ) -> list[Any]:
        """:meth:`_fetch`, received straight into ``window`` (zero-copy, see ``_wire``) when
        every request is a whole part and the client allows; the values are then views of
        ``window``, valid until the next call."""
        if any(not whole for *_, whole in requests):
            return self._fetch(requests)
        outs, pos = [], 0
        for _, start, stop, _ in requests:
            outs.append(window[pos : pos + stop - start])
            pos += stop - start
        keys = [key for key, *_ in requests]
        found = self._io("take_grad (reading)", lambda: get_into(self._commands, keys, outs))
        if found is None:
            return self._fetch(requests)
        for key, ok in zip(keys, found, strict=True):
            if not ok:
                raise AccumulatorError(
                    f"gradient payload {key[-60:]!r} of a claimed round is missing or has the "
                    f"wrong length (claim {self._claim_key})"
                )
        return outs

    def chunks(self, nbytes: int) -> Iterator[tuple[int, int, list[Any]]]:
        """``(start, stop, parts)`` for every chunk of payloads of ``nbytes`` each: ``parts``
        holds bytes ``[start, stop)`` of every gradient, in apply order (bytes-like, valid
        until the next chunk: they may be views of one reused receive buffer)."""
        ranges = _chunks.part_ranges(nbytes)
        remote = sum(1 for s in self.sources if not isinstance(s, bytes))
        windows = list(_chunks.windows(len(ranges), max(1, remote)))
        longest = max(stop - start for start, stop in ranges)
        most = max(len(w) for w in windows) * remote * longest
        buffer = memoryview(bytearray(most)) if remote else memoryview(b"")

        def key_of(s: list[bytes | None], j: int) -> bytes | None:
            # one key for a whole multi-part payload: a range of it; None: in the running sum
            return s[0] if len(s) == 1 else s[j]

        for window in windows:
            requests: list[tuple[bytes, int, int, bool]] = []
            for j in window:
                start, stop = ranges[j]
                for s in self.sources:
                    if isinstance(s, bytes):
                        continue
                    key = key_of(s, j)
                    if key is None:
                        continue
                    if len(s) == 1 and len(ranges) > 1:
                        requests.append((key, start, stop, False))
                    else:
                        requests.append((key, 0, stop - start, True))
            fetched = iter(self._fetch_into(requests, buffer)) if requests else iter(())
            for j in window:
                start, stop = ranges[j]
                parts = [
                    memoryview(s)[start:stop] if isinstance(s, bytes) else next(fetched)
                    for s in self.sources
                    if isinstance(s, bytes) or key_of(s, j) is not None
                ]
                yield start, stop, parts

    def payloads(self) -> list[bytes]:
        """Every gradient's whole payload, in apply order: the parts of all of them read a
        window at a time (one round trip for a round of small gradients, not one each)."""
        wanted: list[tuple[int, bytes]] = []  # (source, part key) in order
        for i, s in enumerate(self.sources):
            if isinstance(s, bytes):
                continue
            if any(key is None for key in s):  # never on the sparse path it serves
                raise AccumulatorError(f"claim {self._claim_key} holds a folded gradient")
            wanted += [(i, cast(bytes, key)) for key in s]
        pieces: list[list[bytes]] = [[] for _ in self.sources]
        # the lengths are the take script's to check: parts of a sparse payload
        for window in _chunks.windows(len(wanted), 1):
            batch = [wanted[j] for j in window]
            for (i, _), value in zip(batch, self._fetch_whole([k for _, k in batch]),
                                     strict=True):  # fmt: skip
                pieces[i].append(value)
        return [
            s if isinstance(s, bytes) else (got[0] if len(got) == 1 else b"".join(got))
            for s, got in zip(self.sources, pieces, strict=True)
        ]


def write_parts(
    pipe: Any, keys: Sequence[str | bytes], data: memoryview, **set_kwargs: Any
) -> None:
    """Queue one SET per part of ``data`` (a flat byte view: memoryview slices, no copy) on
    ``pipe``; ``keys`` has one key per part (``_chunks.part_ranges``)."""
    ranges = _chunks.part_ranges(data.nbytes)
    if len(keys) != len(ranges):
        raise ValueError(f"{len(keys)} keys for {len(ranges)} parts")
    for key, (start, stop) in zip(keys, ranges, strict=True):
        pipe.set(key, data[start:stop], **set_kwargs)


def read_parts_into(
    commands: redis.Redis, io: Callable[[str, Callable[[], Any]], Any], keys: Sequence[str],
    out: memoryview, what: str,
) -> bool:  # fmt: skip
    """Fill ``out`` (a flat writable byte view) from its parts, a window of them per round
    trip; False when a part is missing or of the wrong length (nothing is trusted)."""
    ranges = _chunks.part_ranges(out.nbytes)
    if len(keys) != len(ranges):
        raise ValueError(f"{len(keys)} keys for {len(ranges)} parts")
    for window in _chunks.windows(len(ranges), 1):
        outs = [out[ranges[j][0] : ranges[j][1]] for j in window]
        names = [keys[j] for j in window]

        def receive(names: list[str] = names, outs: list[memoryview] = outs) -> Any:
            return get_into(commands, names, outs)

        found = io(what, receive)
        if found is not None:  # received in place
            if not all(found):
                return False
            continue

        def run(window: range = window) -> list[Any]:
            pipe = commands.pipeline(transaction=False)
            for j in window:
                pipe.get(keys[j])
            return pipe.execute()

        for j, value in zip(window, io(what, run), strict=True):
            start, stop = ranges[j]
            if value is None or len(value) != stop - start:
                return False
            out[start:stop] = value
    return True
