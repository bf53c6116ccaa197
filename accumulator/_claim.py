"""A claimed round as a take holds it: its header parsed, its payloads' sources and the
renewal of its lease, read on demand by :class:`._stream.ClaimReader` (sans-I/O, no Redis
here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _model
from ._codec import parse_shape_token
from ._errors import AccumulatorError
from ._model import AccumulatorModel
from ._requests import Call
from ._stream import ClaimReader, Renewal, Source


@dataclass(frozen=True)
class Claim:
    """A round a take claimed: the new global step, the round shape, the payload bytes it
    holds, and a reader of its payloads (in apply order)."""

    step: int
    count: int
    round_shape: tuple[int, ...] | None
    nbytes: int
    reader: ClaimReader


def parse_header(raw: bytes) -> tuple[int, int, int, tuple[int, ...] | None]:
    """(step, count, bytes, round shape) of a claim header ``"<step> <count> <bytes> <gen>
    <0|1> <shape>"``."""
    parts = raw.decode().split(" ", 5)
    if len(parts) != 6:
        raise AccumulatorError(f"unreadable claim header {raw[:100]!r}")
    shape = parse_shape_token(parts[5]) if parts[4] == "1" else None
    return int(parts[0]), int(parts[1]), int(parts[2]), shape


def claim_lease_ms(acc: AccumulatorModel) -> int:
    """The base of a claim's lease, in ms (``claim_lease``, or the default)."""
    return _model.CLAIM_LEASE_MS if acc.claim_lease is None else int(acc.claim_lease * 1000)


def _lease_renewal(acc: AccumulatorModel, taker: str, nbytes: int, entries: int) -> Renewal:
    """The renewal of a claim's lease (``lua/renew.lua``) while its round is read: due after
    half the lease's base, each renewal leasing the claim again as long as at its claim."""
    k = acc._keys
    claim_ms = claim_lease_ms(acc)
    call = Call("take_grad (renewing the claim)", "renew", [k.state, k.claim(taker), k.claims],
                [taker, claim_ms, _model.CLAIM_LEASE_MS_PER_MIB, nbytes, entries])
    return Renewal(call, claim_ms / 2000)


def read_claim(
    acc: AccumulatorModel, entries: list[bytes], taker: str, payloads: list[Any] | None = None
) -> Claim:
    """The round ``taker`` claimed (its payloads are read on demand, in chunks, the claim's
    lease renewed meanwhile). ``payloads``: those the take script sent along (``payloads[i]``
    is entry ``i``'s, or None): not read again."""
    claim_key = acc._keys.claim(taker)
    step, count, nbytes, round_shape = parse_header(entries[0])
    sources: list[Source] = []
    sent_keys: list[bytes] = []  # the keys of payloads that came with the claim
    for i, entry in enumerate(entries[1:]):
        keys = acc._keys.entry_keys(entry)
        if keys is None:  # the take script checked every entry: this is not ours to follow
            raise AccumulatorError(f"corrupt entry in claim {claim_key}: {entry[:100]!r}")
        sent = payloads[i] if payloads is not None and i < len(payloads) else None
        if entry[:1] == b"i":
            sources.append(entry[1:])
        elif sent is not None and len(keys) == 1:
            sources.append(sent)
            sent_keys += keys
        else:  # a gradient being folded into the sum holds its parts from k on
            sources.append([None] * acc._keys.entry_first_part(entry) + list(keys))
    # count (the header's) is the number of gradients: a sum kept in Redis holds several
    renewal = _lease_renewal(acc, taker, nbytes, len(entries) - 1)
    reader = ClaimReader(sources, claim_key, sent_keys, renewal)
    return Claim(step, count, round_shape, nbytes, reader)
