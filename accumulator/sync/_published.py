"""The published state of a sync job: one small hash (``accsync:{tag}:p``) holding ``run``,
``step``, ``done`` and ``meta`` (msgpack: the parameter specs, replicas, reduction, fusion
bytes), and each parameter's raw little-endian bytes (never pickle) in parts of one chunk
under keys of their version, ``accsync:{tag}:v:<run>:<step>:<j>:<i>`` (no command moves more
than a chunk), ``j`` counting the units of the job's layout (accumulator/_fusion.py): a
parameter, or a fused bucket of small ones, its parameters side by side.

The chief writes a version's parts first, then switches the hash to it in one MULTI, and
lets the previous version expire a minute later, or deletes it at the next publish, whichever
comes first (Redis holds two versions; a restarted chief lets its predecessors' expire
within a minute): a reader reads the hash, then the parts of
the version it names; if that version is gone (two publishes meanwhile), it reads again."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from .._codec import format_shape, resolve_dtype, wire_dtype
from .._fusion import Unit, in_order, pack, views

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

#: 2: parameters in parts under versioned keys; 4: whose names hold the publishing chief's
#: tenure (``ten`` in the hash; a reader of 2 would look for them under the old names).
META_VERSION = 4
#: A job whose small parameters share accumulators (``fusion`` in its metadata): a reader of
#: version 2 only would open one accumulator per parameter, that no chief takes, and wait
#: forever; it is refused instead. 5: with tenures, as 4.
META_VERSION_FUSED = 5
#: Every version this library reads (2 and 3: published by an earlier version, no tenure).
_READS = (2, 3, META_VERSION, META_VERSION_FUSED)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, accumulator kind, dtype and (fully known) shape."""

    name: str
    kind: str  # "dense" | "sparse"
    dtype: np.dtype
    shape: tuple[int, ...]

    def pack(self) -> list[Any]:
        """The spec as msgpack-able values (stored in the job's published metadata)."""
        return [self.name, self.kind, self.dtype.name, list(self.shape)]

    @classmethod
    def unpack(cls, raw: list[Any]) -> ParamSpec:
        """The spec :meth:`pack` stored."""
        name, kind, dtype, shape = raw
        return cls(name, kind, resolve_dtype(dtype), tuple(int(d) for d in shape))

    def describe(self) -> str:
        """One line for messages: name, kind, dtype, shape."""
        return f"{self.name}: {self.kind} {self.dtype.name} {format_shape(self.shape)}"


@dataclass(frozen=True)
class Published:
    """What :func:`decode_published` read: the job as its chief last published it."""

    run: str
    step: int
    done: bool
    specs: list[ParamSpec]
    replicas: int
    reduction: str
    params: dict[str, np.ndarray]
    fusion: int = 0  # the job's fusion_bytes (accumulator/_fusion.py); 0: none
    tenure: str = ""  # of the chief that published it ('': an earlier version's chief)


def encode_published(
    run: str,
    step: int,
    done: bool,
    specs: list[ParamSpec],
    meta: tuple[int, str, int] | None = None,
    tenure: str = "",
) -> dict[FieldT, EncodableT]:
    """The hash fields of one publish: run, step, the publishing chief's tenure, done flag
    and, with ``meta`` (replicas, reduction, fusion bytes), the metadata (the specs). The
    parameters go to their parts (:func:`param_bytes`)."""
    mapping: dict[FieldT, EncodableT] = {"run": run, "step": step, "ten": tenure,
                                         "done": int(done)}  # fmt: skip
    if meta is not None:
        replicas, reduction, fusion = meta
        fields: dict[str, Any] = {"v": META_VERSION, "params": [s.pack() for s in specs],
                                  "replicas": replicas, "reduction": reduction}  # fmt: skip
        if fusion:
            fields.update(v=META_VERSION_FUSED, fusion=fusion)
        mapping["meta"] = msgpack.packb(fields, use_bin_type=True)
    return mapping


def param_bytes(spec: ParamSpec, value: np.ndarray) -> memoryview:
    """A parameter's wire bytes, as a flat byte view (no copy when already in wire form)."""
    arr = np.ascontiguousarray(value, dtype=wire_dtype(spec.dtype))
    return arr.reshape(-1).view(np.uint8).data


def unit_spec(unit: Unit) -> ParamSpec:
    """One unit of the job's layout as the spec of its accumulator (a fused bucket's: dense,
    flat)."""
    return ParamSpec(unit.name, unit.kind, unit.dtype, unit.shape)


def unit_bytes(unit: Unit, params: Mapping[str, np.ndarray]) -> memoryview:
    """What is published for one unit of the job's layout (:func:`accumulator._fusion.plan`):
    a parameter's wire bytes (no copy when already in wire form), or a fused bucket's
    parameters side by side in one buffer (a copy: they are small)."""
    if not unit.fused:
        return param_bytes(unit_spec(unit), params[unit.name])
    return pack(unit, params).view(np.uint8).data


def unit_nbytes(unit: Unit) -> int:
    """The bytes one unit of the layout is published in."""
    return math.prod(unit.shape) * unit.dtype.itemsize


def unit_params(unit: Unit, wire: np.ndarray) -> dict[str, np.ndarray]:
    """The parameters of one unit from its published wire array (of the unit's shape):
    views, in their shapes and native dtype where that is the wire's (else copies)."""
    return views(unit, wire.astype(unit.dtype, copy=False))


def nbytes_of(spec: ParamSpec) -> int:
    """A parameter's bytes."""
    return math.prod(spec.shape) * spec.dtype.itemsize


def decode_published(job: str, raw: Mapping[bytes, Any]) -> Published | None:
    """The published state from the hash's fields (None: nothing published), without the
    parameters (read from their parts)."""
    if raw.get(b"meta") is None or raw.get(b"step") is None:
        return None
    version, specs, replicas, reduction, fusion = _decode_meta(bytes(raw[b"meta"]))
    if version not in _READS:
        raise RuntimeError(
            f"sync job {job!r} was published by an incompatible version (metadata version "
            f"{version!r}, this library reads {', '.join(map(str, _READS))})"
        )
    params: dict[str, np.ndarray] = {}
    return Published(
        run=raw[b"run"].decode(), step=int(raw[b"step"]), done=raw.get(b"done") == b"1",
        specs=list(specs), replicas=replicas, reduction=reduction, params=params,
        fusion=fusion, tenure=bytes(raw.get(b"ten") or b"").decode(),
    )  # fmt: skip


@functools.lru_cache(maxsize=16)
def _decode_meta(meta: bytes) -> tuple[Any, tuple[ParamSpec, ...], int, str, int]:
    """(version, specs, replicas, reduction, fusion bytes) of the metadata a chief
    published; kept for the next look (every pull reads it, and it changes only with the
    job's definition)."""
    raw = msgpack.unpackb(meta, raw=False)
    if raw.get("v") not in _READS:
        return raw.get("v"), (), 0, "", 0
    specs = tuple(ParamSpec.unpack(p) for p in raw["params"])
    return raw["v"], specs, int(raw["replicas"]), raw["reduction"], int(raw.get("fusion", 0))


#: Parameters of at most this many bytes in all travel in the publish's announcement on the
#: job's channel: a waiting worker then has them without a read. Larger models announce the
#: step only. Every subscriber holds its unread announcements (Redis's pub/sub output buffer:
#: 32 MiB at most by default), so this stays small.
ANNOUNCE_BYTES = 16384
_ANNOUNCE_TAG = "p1"


def encode_announcement(run: str, step: int, done: bool, data: list[memoryview] | None) -> bytes:
    """What the chief announces on the job's channel after a publish: ``data`` (every
    parameter's wire bytes, in the specs' order; None when they are too large to travel
    along) with its version, else the step alone (``b"<step>"``)."""
    if data is None:
        return str(step).encode()
    packed: bytes = msgpack.packb(
        [_ANNOUNCE_TAG, run, step, int(done), [bytes(d) for d in data]], use_bin_type=True
    )
    return packed


def decode_announcement(
    message: Any, run: str | None, units: list[Unit]
) -> tuple[int, bool, dict[str, np.ndarray]] | None:
    """``(step, done, parameters)`` of an announcement that carries the parameters of run
    ``run`` in exactly this layout (one buffer per unit: fresh native arrays); None for
    anything else (a step alone, another run, a malformed message): the worker reads the
    published state then."""
    if not isinstance(message, bytes) or message[:1] != b"\x95" or run is None:
        return None
    try:
        tag, their_run, step, done, data = msgpack.unpackb(message, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if (tag != _ANNOUNCE_TAG or their_run != run or not isinstance(step, int)
            or not isinstance(data, list) or len(data) != len(units)):  # fmt: skip
        return None
    params = {}
    for unit, raw in zip(units, data, strict=True):
        if not isinstance(raw, bytes) or len(raw) != unit_nbytes(unit):
            return None
        wire = np.frombuffer(raw, wire_dtype(unit.dtype)).reshape(unit.shape)
        params.update(unit_params(unit, wire.copy()))  # (frombuffer's array is read-only)
    return step, bool(done), in_order(units, params)
