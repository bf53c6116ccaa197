"""The published state of a sync job: one small hash (``accsync:{tag}:p``) holding ``run``,
``step``, ``done`` and ``meta`` (msgpack: the parameter specs, replicas, reduction), and each
parameter's raw little-endian bytes (never pickle) in parts of one chunk under keys of their
version, ``accsync:{tag}:v:<run>:<step>:<j>:<i>`` (no command moves more than a chunk).

The chief writes a version's parts first, then switches the hash to it in one MULTI, and
lets the previous version expire a minute later: a reader reads the hash, then the parts of
the version it names; if that version is gone (two publishes meanwhile), it reads again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from .._codec import format_shape, resolve_dtype, wire_dtype

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

META_VERSION = 2  # 2: parameters in parts under versioned keys


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


def encode_published(
    run: str,
    step: int,
    done: bool,
    specs: list[ParamSpec],
    meta: tuple[int, str] | None = None,
) -> dict[FieldT, EncodableT]:
    """The hash fields of one publish: run, step, done flag and, with ``meta`` (replicas,
    reduction), the metadata (the specs). The parameters go to their parts
    (:func:`param_bytes`)."""
    mapping: dict[FieldT, EncodableT] = {"run": run, "step": step, "done": int(done)}
    if meta is not None:
        replicas, reduction = meta
        mapping["meta"] = msgpack.packb(
            {"v": META_VERSION, "params": [s.pack() for s in specs],
             "replicas": replicas, "reduction": reduction},
            use_bin_type=True,
        )  # fmt: skip
    return mapping


def param_bytes(spec: ParamSpec, value: np.ndarray) -> memoryview:
    """A parameter's wire bytes, as a flat byte view (no copy when already in wire form)."""
    arr = np.ascontiguousarray(value, dtype=wire_dtype(spec.dtype))
    return arr.reshape(-1).view(np.uint8).data


def nbytes_of(spec: ParamSpec) -> int:
    return int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype.itemsize


def decode_published(job: str, raw: Mapping[bytes, Any]) -> Published | None:
    """The published state from the hash's fields (None: nothing published), without the
    parameters (read from their parts)."""
    if raw.get(b"meta") is None or raw.get(b"step") is None:
        return None
    meta = msgpack.unpackb(raw[b"meta"], raw=False)
    if meta.get("v") != META_VERSION:
        raise RuntimeError(
            f"sync job {job!r} was published by an incompatible version "
            f"(metadata version {meta.get('v')!r}, this library reads {META_VERSION})"
        )
    specs = [ParamSpec.unpack(p) for p in meta["params"]]
    params: dict[str, np.ndarray] = {}
    return Published(
        run=raw[b"run"].decode(), step=int(raw[b"step"]), done=raw.get(b"done") == b"1",
        specs=specs, replicas=int(meta["replicas"]), reduction=meta["reduction"],
        params=params,
    )  # fmt: skip
