"""The published state of a sync job: one hash (``accsync:{tag}:p``) holding ``run``,
``step``, ``done``, ``meta`` (msgpack: the parameter specs, replicas, reduction) and each
parameter's raw little-endian bytes as ``v:<param>`` (never pickle). Written by the chief in
one HSET, read by everyone in one HGETALL."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from .._codec import format_shape, resolve_dtype, wire_dtype

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

META_VERSION = 1


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, accumulator kind, dtype and (fully known) shape."""

    name: str
    kind: str  # "dense" | "sparse"
    dtype: np.dtype
    shape: tuple[int, ...]

    def pack(self) -> list[Any]:
        return [self.name, self.kind, self.dtype.name, list(self.shape)]

    @classmethod
    def unpack(cls, raw: list[Any]) -> ParamSpec:
        name, kind, dtype, shape = raw
        return cls(name, kind, resolve_dtype(dtype), tuple(int(d) for d in shape))

    def describe(self) -> str:
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
    params: Mapping[str, np.ndarray],
    meta: tuple[int, str] | None = None,
) -> dict[FieldT, EncodableT]:
    """The fields of one publish: run, step, done flag, every parameter's bytes and, with
    ``meta`` (replicas, reduction), the metadata (the specs)."""
    mapping: dict[FieldT, EncodableT] = {"run": run, "step": step, "done": int(done)}
    if meta is not None:
        replicas, reduction = meta
        mapping["meta"] = msgpack.packb(
            {"v": META_VERSION, "params": [s.pack() for s in specs],
             "replicas": replicas, "reduction": reduction},
            use_bin_type=True,
        )  # fmt: skip
    for spec in specs:
        arr = np.ascontiguousarray(params[spec.name], dtype=wire_dtype(spec.dtype))
        mapping["v:" + spec.name] = arr.tobytes()
    return mapping


def decode_published(job: str, raw: Mapping[bytes, Any], with_params: bool) -> Published | None:
    """The published state from the hash's fields (None: nothing published); the parameters
    only ``with_params``."""
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
    if with_params:
        for spec in specs:
            data = raw.get(b"v:" + spec.name.encode())
            if data is None:
                raise RuntimeError(f"sync job {job!r}: parameter {spec.name!r} missing")
            arr = np.frombuffer(data, dtype=wire_dtype(spec.dtype)).reshape(spec.shape)
            params[spec.name] = arr.astype(spec.dtype)  # a writable copy in native order
    return Published(
        run=raw[b"run"].decode(), step=int(raw[b"step"]), done=raw.get(b"done") == b"1",
        specs=specs, replicas=int(meta["replicas"]), reduction=meta["reduction"],
        params=params,
    )  # fmt: skip
