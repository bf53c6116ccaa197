"""Tensor fusion for sync jobs (:mod:`accumulator.sync`), as Horovod's tensor fusion and
PyTorch DDP's gradient buckets: dense parameters smaller than the job's ``fusion_bytes``
share one accumulator per bucket, so a model of many small tensors costs a few accumulators
per step, not one per tensor.

Pure functions, no Redis: the layout is a function of the parameters' specs (in their order)
and the threshold the job was created with, so the chief, every worker and the CLI derive
the same one from the published metadata.

The plan: dense parameters of one dtype, each smaller than ``fusion_bytes``, go into a
bucket in the order given, until the next one would take the bucket over ``fusion_bytes``;
then a new bucket of that dtype starts. A bucket of two or more parameters is one flat
accumulator named ``#fused/<i>-<layout>`` (i counts buckets in the order they were started;
the layout is six hex digits of its dtype and its parameters' names and shapes); a
parameter alone in its bucket, a larger one and every sparse one keep an accumulator of their
own, named after the parameter. Elementwise, a bucket's MEAN or SUM is each parameter's: the
result is the same as with one accumulator per parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._codec import wire_dtype
from ._dense import checked_dense
from ._errors import InvalidArgumentError

#: The start of a bucket's accumulator name in its job (``#fused/<i>-<layout>``). Parameter
#: names starting with it are refused in a job that fuses.
FUSED_PREFIX = "#fused/"
#: What :class:`~accumulator.sync.ParameterServer` fuses by default: parameters under 1 MiB,
#: into buckets of up to 1 MiB (one value in Redis, as a gradient of up to a chunk is).
DEFAULT_FUSION_BYTES = 1 << 20


@dataclass(frozen=True)
class Member:
    """One parameter in a bucket: its elements ``[offset, offset + size)`` of the bucket;
    ``index``: its place among the job's parameters."""

    name: str
    offset: int
    size: int
    shape: tuple[int, ...]
    index: int


@dataclass(frozen=True)
class Unit:
    """One accumulator of a job: ``name`` (a parameter's, or ``#fused/<i>-<layout>``), its
    kind, dtype and shape, and the parameters it holds (one, unless fused)."""

    name: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]
    members: tuple[Member, ...]

    @property
    def fused(self) -> bool:
        """Whether this is a bucket of several parameters."""
        return self.name.startswith(FUSED_PREFIX)

    def describe(self) -> str:
        """For messages: ``'w' (dense)``, or the bucket and the parameters in it."""
        if self.fused:
            return f"{self.name!r} (fused: {', '.join(repr(m.name) for m in self.members)})"
        return f"{self.name!r} ({self.kind})"


def _size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def plan(specs: Sequence[Any], fusion_bytes: int) -> list[Unit]:
    """The accumulators of a job whose parameters are ``specs`` (objects with ``name``,
    ``kind``, ``dtype`` (numpy) and ``shape``, in their order) created with ``fusion_bytes``
    (0: one accumulator per parameter). Buckets come first in the order they were started at,
    each where its first parameter was."""
    if fusion_bytes < 0:
        raise InvalidArgumentError(f"fusion_bytes must be >= 0, got {fusion_bytes!r}")
    if fusion_bytes:
        reserved = [s.name for s in specs if s.name.startswith(FUSED_PREFIX)]
        if reserved:
            raise InvalidArgumentError(
                f"parameter names starting with {FUSED_PREFIX!r} are reserved for fused "
                f"buckets: {reserved} (or pass fusion_bytes=0)"
            )
    # slots: a parameter of its own, or a bucket (a list of specs), in order of appearance
    slots: list[Any] = []
    open_bucket: dict[np.dtype, tuple[list[Any], int]] = {}  # dtype -> (its specs, bytes)
    index = {spec.name: i for i, spec in enumerate(specs)}
    for spec in specs:
        nbytes = _size(spec.shape) * spec.dtype.itemsize
        if spec.kind != "dense" or nbytes >= fusion_bytes:
            slots.append(spec)
            continue
        bucket = open_bucket.get(spec.dtype)
        if bucket is None or bucket[1] + nbytes > fusion_bytes:
            members: list[Any] = []
            slots.append(members)
            bucket = (members, 0)
        bucket[0].append(spec)
        open_bucket[spec.dtype] = (bucket[0], bucket[1] + nbytes)
    units = []
    for slot in slots:
        if isinstance(slot, list) and len(slot) == 1:
            slot = slot[0]  # alone in its bucket: an accumulator of its own
        if not isinstance(slot, list):
            member = Member(slot.name, 0, _size(slot.shape), tuple(slot.shape), index[slot.name])
            units.append(Unit(slot.name, slot.kind, slot.dtype, tuple(slot.shape), (member,)))
            continue
        offset, members_ = 0, []
        for spec in slot:
            size = _size(spec.shape)
            members_.append(Member(spec.name, offset, size, tuple(spec.shape), index[spec.name]))
            offset += size
        name = (f"{FUSED_PREFIX}{sum(1 for u in units if u.fused)}-"
                f"{_fingerprint(slot[0].dtype, members_)}")  # fmt: skip
        units.append(Unit(name, "dense", slot[0].dtype, (offset,), tuple(members_)))
    return units


def _fingerprint(dtype: np.dtype, members: Sequence[Member]) -> str:
    """Six hex digits naming a bucket's layout (dtype, its parameters' names and shapes, in
    order): a job created again with another layout has other buckets, so a worker still on
    the old one gets NotFoundError for its push instead of having it packed the old way into
    a new bucket of the same size (its values would land in other parameters)."""
    text = dtype.str + "|" + "|".join(f"{m.name}{list(m.shape)}" for m in members)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=3).hexdigest()


def in_order(units: Sequence[Unit], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (parameter name -> value, for every parameter of ``units``) in the order of
    the job's parameters, whatever the units' order (a bucket sits where its first member
    was; its other members come from later in the model)."""
    members = sorted((m for u in units for m in u.members), key=lambda m: m.index)
    return {m.name: values[m.name] for m in members}


def unit_of(units: Sequence[Unit]) -> dict[str, Unit]:
    """Parameter name -> the unit holding it."""
    return {m.name: u for u in units for m in u.members}


class MemberError(InvalidArgumentError):
    """The gradient of parameter :attr:`param` of a bucket is invalid (:func:`pack`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def pack(unit: Unit, grads: Mapping[str, Any]) -> np.ndarray:
    """A bucket's gradient: its parameters' gradients, each checked as its own accumulator
    would (:func:`~accumulator._dense.checked_dense`), side by side in one flat wire array.
    Raises :class:`MemberError` naming the parameter."""
    out = np.empty(unit.shape, wire_dtype(unit.dtype))
    for m in unit.members:
        try:
            wire = checked_dense(grads[m.name], unit.dtype, m.shape)
        except InvalidArgumentError as exc:
            raise MemberError(str(exc), m.name) from exc
        out[m.offset : m.offset + m.size] = wire.reshape(-1)
    return out


def views(unit: Unit, value: Any) -> dict[str, Any]:
    """Parameter name -> its part of ``value``, one unit's array: a bucket's parameters get
    views of it, in their shapes (no copy); a parameter of its own, ``value`` itself."""
    if not unit.fused:
        return {unit.name: value}
    return {m.name: value[m.offset : m.offset + m.size].reshape(m.shape) for m in unit.members}


def split(units: Sequence[Unit], taken: Mapping[str, Any]) -> dict[str, Any]:
    """Parameter name -> its gradient, from ``taken`` (unit name -> what its take returned),
    in the model's order: a bucket's parameters get :func:`views` of its array."""
    out: dict[str, Any] = {}
    for u in units:
        out.update(views(u, taken[u.name]))
    return in_order(units, out)
