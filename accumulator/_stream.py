"""Reading a claimed round's payloads in chunks, and a parameter's parts.

A round entry is an inline payload or names payload keys (``Keys.entry_keys``). Dense takes
stream: part ``j`` of every gradient arrives together, gets reduced into the result, and is
dropped, so a take holds one result plus a window of parts whatever the number of gradients.
Sparse takes need whole payloads (rows of different gradients do not line up by offset) and
read them part by part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import redis

from . import _chunks
from ._errors import AccumulatorError
from ._requests import Batch, Call, Ops, Receive, ReceiveAll
from ._wire import get_into

#: A gradient's payload as a claim names it: the bytes (inline) or its part keys in order,
#: ``None`` for a part it no longer holds (folded into the round's running sum, which holds it).
Source: TypeAlias = bytes | list[bytes | None]


WHAT = "take_grad (reading)"


class Renewal:
    """The renewal of a claim's lease while its round is read (``lua/renew.lua``): made
    between two windows of the read once ``every`` seconds have passed since the claim or
    the last renewal, so a reader that keeps making progress keeps its round however slow
    its link, and a fast one never pays for it."""

    def __init__(self, call: Call, every: float) -> None:
        self.call = call
        self.every = every
        self._since = time.monotonic()

    def __call__(self, claim_key: str) -> Ops[None]:
        """Renew if due; raises when the claim is no longer this taker's."""
        now = time.monotonic()
        if now - self._since < self.every:
            return
        if not int((yield self.call)):
            raise AccumulatorError(f"claim {claim_key} is no longer this taker's")
        self._since = now


class ClaimReader:
    """Reads the payloads of one claimed round (sans-I/O: its methods are protocol steps,
    generators of ``_requests``; reads are idempotent, so the drivers retry them).
    ``renewal``: renews the claim's lease between windows (None: never)."""

    def __init__(
        self, sources: Sequence[Source], claim_key: str, sent_keys: Sequence[bytes] = (),
        renewal: Renewal | None = None,
    ) -> None:  # fmt: skip
        self.sources = list(sources)
        self._claim_key = claim_key
        self._sent_keys = list(sent_keys)  # of payloads that came with the claim (as bytes)
        self._renewal = renewal

    def _renew(self) -> Ops[None]:
        if self._renewal is not None:
            yield from self._renewal(self._claim_key)

    @property
    def keys(self) -> list[bytes]:
        """Every payload key the round names (freed once the take is finished)."""
        held = [key for s in self.sources if isinstance(s, list) for key in s if key is not None]
        return self._sent_keys + held

    def _missing(self, key: bytes) -> AccumulatorError:
        return AccumulatorError(
            f"gradient payload {key[-60:]!r} of a claimed round is missing or has the wrong "
            f"length (claim {self._claim_key})"
        )

    def _fetch(
        self, requests: list[tuple[bytes, int, int, bool]], outs: list[memoryview] | None = None
    ) -> Ops[list[Any]]:
        """GET (whole part) or GETRANGE of each ``(key, start, stop, whole)``; every value
        must be there at the expected length. With ``outs`` (a writable byte view per request,
        of its length) and only whole parts, the values are received straight into them where
        the driver can (zero-copy, see ``_wire``): they are then returned as those views."""
        if outs is not None and all(whole for *_, whole in requests):
            keys = [key for key, *_ in requests]
            found = yield Receive(WHAT, keys, outs)
            if found is not None:
                for key, ok in zip(keys, found, strict=True):
                    if not ok:
                        raise self._missing(key)
                return outs
        commands = [
            ("GET", key) if whole else ("GETRANGE", key, start, stop - 1)
            for key, start, stop, whole in requests
        ]
        values = yield Batch(WHAT, commands)
        for (key, start, stop, _), value in zip(requests, values, strict=True):
            if value is None or len(value) != stop - start:
                raise self._missing(key)
        return list(values)

    def read_chunks(
        self, nbytes: int, consume: Callable[[int, int, list[Any]], None],
        into: memoryview | None = None,
    ) -> Ops[None]:  # fmt: skip
        """``consume(start, stop, parts)`` for every chunk of payloads of ``nbytes`` each:
        ``parts`` holds bytes ``[start, stop)`` of every gradient, in apply order (bytes-like,
        valid during the call only: they may be views of one reused receive buffer).

        ``into``: the result's own bytes (``nbytes``, writable). The first gradient of the
        round (the running sum on the accsum path), when it is read whole part by part, is
        then received straight into it: its part is ``into[start:stop]`` itself, and the
        receive buffer holds the other gradients only (none when the sum is in Redis: no
        buffer at all, no copy)."""
        ranges = _chunks.part_ranges(nbytes)
        remote = sum(1 for s in self.sources if not isinstance(s, bytes))
        first = self.sources[0] if self.sources else b""
        direct = (into is not None and not isinstance(first, bytes)
                  and len(first) == len(ranges) and None not in first)  # fmt: skip
        windows = list(_chunks.windows(len(ranges), max(1, remote)))
        longest = max(stop - start for start, stop in ranges)
        most = max(len(w) for w in windows) * (remote - direct) * longest
        buffer = memoryview(bytearray(most)) if most else memoryview(b"")

        def key_of(s: list[bytes | None], j: int) -> bytes | None:
            # one key for a whole multi-part payload: a range of it; None: in the running sum
            return s[0] if len(s) == 1 else s[j]

        for window in windows:
            requests: list[tuple[bytes, int, int, bool]] = []
            outs: list[memoryview] = []
            pos = 0
            for j in window:
                start, stop = ranges[j]
                for i, s in enumerate(self.sources):
                    if isinstance(s, bytes):
                        continue
                    key = key_of(s, j)
                    if key is None:
                        continue
                    if len(s) == 1 and len(ranges) > 1:
                        requests.append((key, start, stop, False))
                    else:
                        requests.append((key, 0, stop - start, True))
                    if direct and i == 0:
                        outs.append(cast(memoryview, into)[start:stop])
                    else:
                        outs.append(buffer[pos : pos + stop - start])
                        pos += stop - start
            yield from self._renew()
            fetched = iter((yield from self._fetch(requests, outs)) if requests else ())
            for j in window:
                start, stop = ranges[j]
                parts = [
                    memoryview(s)[start:stop] if isinstance(s, bytes) else next(fetched)
                    for s in self.sources
                    if isinstance(s, bytes) or key_of(s, j) is not None
                ]
                if not parts:  # only gradients being folded, whose sum is gone: never claimed
                    raise AccumulatorError(
                        f"claim {self._claim_key} holds no gradient for bytes {start}-{stop}"
                    )
                consume(start, stop, parts)

    def payloads(self, into: memoryview | None = None) -> Ops[list[Any]]:
        """Every gradient's whole payload, in apply order: the parts of all of them read a
        window at a time (one round trip for a round of small gradients, not one each).

        ``into``: a writable byte view of at least the round's payload bytes. Where the
        driver can, the values are received into it back to back, and the payloads read are
        views of it (valid until it is reused); else they are new ``bytes``."""
        wanted: list[tuple[int, bytes]] = []  # (source, part key) in order
        for i, s in enumerate(self.sources):
            if isinstance(s, bytes):
                continue
            if any(key is None for key in s):  # never on the sparse path it serves
                raise AccumulatorError(f"claim {self._claim_key} holds a folded gradient")
            wanted += [(i, cast(bytes, key)) for key in s]
        # per source its pieces: bytes, or (start, stop) of into
        pieces: list[list[bytes | tuple[int, int]]] = [[] for _ in self.sources]
        pos, direct = 0, into is not None
        # the lengths are the take script's to check: parts of a sparse payload
        for window in _chunks.windows(len(wanted), 1):
            yield from self._renew()
            batch = [wanted[j] for j in window]
            keys = [key for _, key in batch]
            lengths = None
            if into is not None and direct:
                lengths = yield ReceiveAll(WHAT, keys, into[pos:])
            if lengths is None:
                direct = False  # the driver cannot: the ordinary way from here on
                values = yield Batch(WHAT, [("GET", key) for key in keys])
                for (i, key), value in zip(batch, values, strict=True):
                    if value is None:
                        raise self._missing(key)
                    pieces[i].append(value)
                continue
            for (i, key), n in zip(batch, lengths, strict=True):
                if n < 0:  # missing, or longer than the round's bytes: not what was claimed
                    raise self._missing(key)
                pieces[i].append((pos, pos + n))
                pos += n
        return [s if isinstance(s, bytes) else _joined(got, into)
                for s, got in zip(self.sources, pieces, strict=True)]  # fmt: skip


def _joined(pieces: list[bytes | tuple[int, int]], into: memoryview | None) -> Any:
    """One payload from its pieces: a view of ``into`` when they lie there one after the
    other (always, unless the driver stopped receiving in place half-way), else bytes."""
    if len(pieces) == 1 and isinstance(pieces[0], bytes):
        return pieces[0]
    spans = [p for p in pieces if isinstance(p, tuple)]
    joint = all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    if len(spans) == len(pieces) and into is not None and joint:
        return into[spans[0][0] : spans[-1][1]]
    view = cast(memoryview, into)  # pieces are spans only when it was given
    return b"".join(p if isinstance(p, bytes) else view[p[0] : p[1]] for p in pieces)


class ReceiveBuffers:
    """A receive buffer kept between reads, so that a steady taker does not fault in fresh
    memory for every round (a first touch costs more than the copy it receives). Concurrent
    reads (threads, tasks) each get their own: one is kept, up to ``keep`` bytes."""

    def __init__(self, keep: int = 4 << 20) -> None:
        self._keep = keep
        self._spare: list[bytearray] = []  # list.pop/append: atomic, no lock needed

    def borrow(self, nbytes: int) -> bytearray:
        """A buffer of at least ``nbytes`` bytes, this object's alone until given back."""
        try:
            buf = self._spare.pop()
        except IndexError:
            buf = None
        if buf is None or len(buf) < nbytes:
            buf = bytearray(nbytes)
        return buf

    def give_back(self, buf: bytearray) -> None:
        """Keep ``buf`` for the next read (nothing may still use it), if small enough."""
        if len(buf) <= self._keep and not self._spare:
            self._spare.append(buf)


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


def read_views_into(
    commands: redis.Redis, io: Callable[[str, Callable[[], Any]], Any], keys: Sequence[str],
    outs: Sequence[memoryview], what: str,
) -> bool:  # fmt: skip
    """GET ``keys[j]`` into ``outs[j]`` (flat writable byte views of the expected lengths,
    each at most a chunk), about a window of bytes per round trip, however many payloads the
    keys belong to (the parameters of a model: one round trip for all small ones); False
    when a value is missing or of the wrong length (nothing is trusted)."""
    if len(keys) != len(outs):
        raise ValueError(f"{len(keys)} keys for {len(outs)} buffers")
    for window in _chunks.byte_windows([o.nbytes for o in outs]):
        names = [keys[j] for j in window]
        views = [outs[j] for j in window]

        def receive(names: list[str] = names, views: list[memoryview] = views) -> Any:
            return get_into(commands, names, views)

        found = io(what, receive)
        if found is not None:  # received in place
            if not all(found):
                return False
            continue

        def run(names: list[str] = names) -> list[Any]:
            pipe = commands.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute()

        for view, value in zip(views, io(what, run), strict=True):
            if not fill(view, value):
                return False
    return True


def fill(view: memoryview, value: Any) -> bool:
    """Copy a GET reply into its buffer; False when it is missing or of another length."""
    if value is None or len(value) != view.nbytes:
        return False
    view[:] = value
    return True
