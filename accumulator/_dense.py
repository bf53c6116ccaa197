"""``ConditionalAccumulator``: TF's dense accumulator, state in Redis."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from . import _reduce
from ._apply import apply
from ._claim import Claim
from ._codec import (
    Shape,
    as_array,
    check_payload_size,
    format_shape,
    parse_shape_token,
    scalar_int,
    shape_compatible,
    shape_token,
    to_wire,
    wire_dtype,
    wire_nbytes,
)
from ._connection import Client
from ._core import AccumulatorBase
from ._errors import InvalidArgumentError
from ._model import MAX_PAYLOAD_BYTES, AccumulatorModel
from ._requests import Ops
from ._take import Cancel, take


def checked_dense(grad: Any, dtype: np.dtype, shape: Shape) -> np.ndarray:
    """``grad`` as the wire array of a dense accumulator of ``dtype`` and ``shape``, after
    every check that does not need Redis (castable dtype, shape, size, range): no copy when
    it already is one. The checks run on the metadata first: the cast copies, and a
    wrong-shaped broadcast view (np.broadcast_to(1.0, (2**31, 4))) must not be
    materialized."""
    return _to_wire(_declared(grad, dtype, shape), dtype)


def _declared(grad: Any, dtype: np.dtype, shape: Shape) -> np.ndarray:
    """``grad`` as an array, checked against the declared dtype (castable) and shape: what
    TF's Python layer checks, stale or not."""
    arr = as_array(grad, dtype)
    if not shape_compatible(shape, arr.shape):
        raise InvalidArgumentError(
            f"Shape mismatch: expected {format_shape(shape)}, got {format_shape(arr.shape)}"
        )
    return arr


def _to_wire(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The wire array of a gradient checked by :func:`_declared`: refused when too large for
    one payload, or when its values do not fit the dtype (our checks: a stale gradient is
    dropped instead, as TF drops it before any check of its own)."""
    check_payload_size(wire_nbytes(arr, dtype), MAX_PAYLOAD_BYTES)
    return to_wire(arr, dtype)


class DenseOps(AccumulatorModel):
    """The dense accumulator's checks, apply and take steps, shared by the sync class and
    ``accumulator.aio``'s."""

    _kind = "dense"

    def _apply_grad_ops(self, grad: Any, local_step: Any) -> Ops[bool]:
        step = scalar_int(local_step, "local_step")
        arr = _declared(grad, self.dtype, self.shape)
        try:
            arr = _to_wire(arr, self.dtype)
        except InvalidArgumentError:
            if step < (yield from self._step_ops()):  # stale: dropped, whatever its values
                return False
            raise
        return (yield from self._apply_wire_ops(arr, step))

    def _apply_wire_ops(self, arr: np.ndarray, step: int) -> Ops[bool]:
        """The apply of a gradient :meth:`_checked` already (the wire array)."""
        code, round_shape = yield from apply(self, arr, shape_token(arr.shape), step)
        if code == -1:
            raise InvalidArgumentError(
                f"Shape mismatch: expected {format_shape(parse_shape_token(round_shape))}, "
                f"got {format_shape(arr.shape)}"
            )
        return code == 1

    def _checked(self, grad: Any) -> np.ndarray:
        """The gradient as the wire array, after every check that does not need Redis
        (:func:`checked_dense` against the declared dtype and shape)."""
        return checked_dense(grad, self.dtype, self.shape)

    def _take_grad_ops(
        self,
        num_required: Any,
        timeout: Any,
        out: np.ndarray | None,
        cancel: Cancel | None = None,
    ) -> Ops[np.ndarray]:
        if out is not None:
            self._check_out(out)
        return (yield from take(self, num_required, timeout,
                                lambda claim: self._reduce_claim(claim, out), cancel))  # fmt: skip

    def _check_out(self, out: Any) -> None:
        if not isinstance(out, np.ndarray):
            raise InvalidArgumentError(f"out must be a numpy array, not {type(out).__name__}")
        if out.dtype != self.dtype:
            raise InvalidArgumentError(f"out has dtype {out.dtype}, expected {self.dtype}")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise InvalidArgumentError("out must be C-contiguous and writable")
        if not shape_compatible(self.shape, out.shape):
            raise InvalidArgumentError(
                f"out has shape {format_shape(out.shape)}, expected {format_shape(self.shape)}"
            )

    def _reduce_claim(self, claim: Claim, out: np.ndarray | None = None) -> Ops[np.ndarray]:
        """Stream the round in chunks into one preallocated result: part ``j`` of every
        gradient is reduced as it arrives (elements are independent, so chunk by chunk is
        bit for bit the sequential sum), whatever the number of gradients. Runs before the
        take returns: if it fails (MemoryError...), the round goes back."""
        shape = claim.round_shape if claim.round_shape is not None else ()
        if out is None:
            out = np.empty(shape, self.dtype)
        elif out.shape != tuple(shape):
            raise InvalidArgumentError(
                f"out has shape {format_shape(out.shape)}, but the round's gradients have "
                f"shape {format_shape(tuple(shape))}"
            )
        flat = out.reshape(-1).view(np.uint8)
        if flat.nbytes == 0:
            return out
        wire = wire_dtype(self.dtype)

        def consume(start: int, stop: int, parts: list[Any]) -> None:
            grads = [np.frombuffer(part, wire) for part in parts]
            _reduce.reduce_into(
                flat[start:stop].view(self.dtype), grads, self.reduction_type, count=claim.count
            )

        yield from claim.reader.read_chunks(flat.nbytes, consume, into=flat.data)
        return out

class ConditionalAccumulator(AccumulatorBase, DenseOps):
    """A dense gradient accumulator shared by every process that opens its ``shared_name``.

    Workers call :meth:`apply_grad`; a chief calls :meth:`take_grad`, which blocks until
    ``num_required`` gradients of the current step arrived and returns their mean (or sum).

    What is shared: the accumulator lives in Redis, not in this object. Every process, on any
    host, that opens the same ``shared_name`` in the same ``container`` on the same server
    shares one accumulator: its global step, its pending round and its queue of takers. The
    first opener creates it with ``dtype``, ``shape`` and ``reduction_type`` (stored); a
    later opener must agree, or gets :class:`InvalidArgumentError`.

    ``dtype``, ``shape``, ``reduction_type``: as TF's (``shape=None``: any shape; ``None``
    inside it: an unknown dimension). ``shared_name``: the name to share it by; ``None``
    makes a private accumulator, deleted when this object is closed. ``name``: TF's op name,
    a label only. ``client``: the Redis server, as a URL (``redis://``, ``rediss://``,
    ``unix://``), a ``redis.Redis`` or ``valkey.Valkey`` client (its settings are kept, and
    every accumulator opened from it shares one connection pool), a Sentinel-managed client,
    or ``None`` (``ACCUMULATOR_REDIS_URL``, then ``REDIS_URL``, then ``redis://localhost``).
    ``container``: TF's container, a namespace of shared names (``reset_container`` deletes
    every accumulator of one). ``max_pending_bytes``: the bytes one pending round may hold
    (default 4 GiB; an apply past it raises :class:`ResourceExhaustedError`).

    ``sum_in_redis``: whether a new accumulator keeps each round's running sum inside Redis
    (the accsum module adds each large gradient in place: Redis holds one gradient per round
    and the taker reads one, whatever the number of workers). ``None`` (default) decides from
    the server: yes when it runs the module and the dtype is float32/64 or an integer. Decided
    at creation and stored; every later opener follows it (:attr:`sums_in_redis`). ``True``
    on a server without the module (or a Redis Cluster) raises :class:`InvalidArgumentError`.

    ``spread_parts``: whether a new accumulator stores each large gradient's parts under
    hash tags of their own (one per part index), so that a Redis Cluster spreads one
    accumulator's bytes over every primary, written and read one pipeline per node. ``None``
    (default): yes when ``client`` is a cluster client and the accumulator is named and does
    not sum in Redis. Decided at creation and stored (:attr:`spreads_parts`); clients older
    than this option refuse such an accumulator rather than misread it.

    ``min_replicas``, ``wait_aof``: durability this object waits for (Redis replicates
    asynchronously: by default an acknowledged apply can vanish if the primary dies before a
    replica has it). Each apply returns only after ``WAIT`` confirms ``min_replicas``
    replicas have it (``wait_aof=True``: after ``WAITAOF`` confirms the primary's AOF, and
    ``min_replicas`` replicas' AOFs, have it fsynced; Redis 7.2+), within
    :attr:`durability_timeout` seconds (default 5), else it raises
    :class:`NotDurableError` (the gradient is counted: do not apply it again). A take
    waits the same way for its finish, and logs a shortfall (the round is already the
    caller's).
    A server that cannot confirm writes that way (no ``WAIT``; ``WAITAOF`` before Redis 7.2
    or without ``appendonly``) is refused at open with :class:`InvalidArgumentError`.

    ``retry_window``: seconds every operation, opening included, rides through an
    unreachable Redis before raising :class:`UnavailableError` (default 30; also the
    attribute of that name). After 2 s of failures the retrying is logged as a warning.
    """

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        client: Client = None,
        container: str = "",
        max_pending_bytes: int | None = None,
        min_replicas: int = 0,
        wait_aof: bool = False,
        sum_in_redis: bool | None = None,
        spread_parts: bool | None = None,
        retry_window: float | None = None,
    ) -> None:
        super().__init__(dtype, shape, shared_name, name, reduction_type, client=client,
                         container=container, max_pending_bytes=max_pending_bytes,
                         sum_in_redis=sum_in_redis, min_replicas=min_replicas,
                         wait_aof=wait_aof, spread_parts=spread_parts,
                         retry_window=retry_window)  # fmt: skip

    def apply_grad(self, grad: Any, local_step: Any = 0, name: str | None = None) -> bool:
        """Add ``grad`` to the current round; ``False`` if dropped as stale.

        Raises :class:`InvalidArgumentError` (nothing changed) when the gradient cannot be
        cast to the dtype, does not fit the declared shape, or differs from this round's shape.
        """
        return self._run(self._apply_grad_ops(grad, local_step))

    def take_grad(
        self,
        num_required: Any,
        name: str | None = None,
        *,
        timeout: float | None = None,
        out: np.ndarray | None = None,
        cancel: threading.Event | None = None,
    ) -> np.ndarray:
        """Block until ``num_required`` gradients arrived (and earlier takers are served),
        then return their mean or sum and advance the global step.

        ``timeout`` (seconds) raises :class:`DeadlineExceededError`, consuming nothing.
        ``out``: a C-contiguous, writable array of the accumulator's dtype and the round's
        shape to write the result into (and return), so that a loop reuses one buffer; a
        round of another shape raises :class:`InvalidArgumentError`, consuming nothing.
        ``cancel``: a ``threading.Event``; once set (from any thread), the take raises
        :class:`CancelledError` and consumes nothing: it is looked at every 0.1 s while
        waiting, and once more after the round is read, before the take keeps it (a take
        run in a thread, e.g. by ``asyncio.to_thread``, can so be withdrawn).
        """
        return self._run(self._take_grad_ops(num_required, timeout, out, cancel))
