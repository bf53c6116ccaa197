"""The chief's parameter arithmetic, in numpy (no Redis): the specs of the initial
parameters, the update rule of :meth:`ParameterServer.step` (plain SGD, per-parameter
learning rates, or a function) with the check of what a function returns, and the zero
gradient of a step whose round was lost."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._codec import can_cast, resolve_dtype
from .._errors import InvalidArgumentError
from .._sparse import SparseGradient
from .._tensors import to_numpy
from ._published import ParamSpec

#: What :meth:`ParameterServer.step` applies: a learning rate for every parameter, one per
#: parameter, or ``fn(params, grads, step) -> new params | None`` (None: updated in place).
Update = (
    float
    | Mapping[str, float]
    | Callable[[dict[str, np.ndarray], dict[str, Any], int], Mapping[str, Any] | None]
)


def _as_array(value: Any, what: str) -> np.ndarray:
    """A private numpy copy of a parameter (numpy, lists, torch, jax, ...); ``what`` names it
    in the error when numpy cannot read it."""
    try:
        return np.array(to_numpy(value))  # (torch: detached, on the CPU, bfloat16 kept)
    except Exception as exc:  # noqa: BLE001 - whatever the object raised, the input is bad
        raise InvalidArgumentError(f"cannot read {what} as an array: {exc}") from exc


def specs_for(
    params: Mapping[str, Any], sparse: frozenset[str]
) -> tuple[list[ParamSpec], dict[str, np.ndarray]]:
    """The specs of the initial parameters (those named in ``sparse`` are sparse) and the
    parameters as contiguous arrays of their dtypes."""
    unknown = sparse - set(params)
    if unknown:
        raise InvalidArgumentError(f"sparse names parameters that do not exist: {sorted(unknown)}")
    specs, arrays = [], {}
    for name, value in params.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"parameter names must be non-empty strings, got {name!r}")
        arr = _as_array(value, f"parameter {name!r}")
        kind = "sparse" if name in sparse else "dense"
        if kind == "sparse" and arr.ndim < 1:
            raise InvalidArgumentError(f"sparse parameter {name!r} needs at least one dimension")
        spec = ParamSpec(name, kind, resolve_dtype(arr.dtype), tuple(arr.shape))
        specs.append(spec)
        arrays[name] = np.asarray(arr, dtype=spec.dtype, order="C")  # keeps a 0-d one 0-d
    if not specs:
        raise InvalidArgumentError("no parameters")
    return specs, arrays


def apply_update(
    update: Update,
    specs: list[ParamSpec],
    params: dict[str, np.ndarray],
    grads: dict[str, Any],
    step: int,
    done: set[str] | None = None,
) -> dict[str, np.ndarray]:
    """The parameters after ``update`` with ``grads`` at ``step``: ``params`` itself, updated
    in place, for learning rates (dense float gradients are scaled in place too: they are
    the chief's taken ones, seen by no one else); what a function returned (checked), or
    ``params`` it updated in place, for a function.

    ``done``: the names of the parameters updated so far, for learning rates: those in it
    are skipped, and each is added once updated. An update interrupted part-way (Ctrl-C, or
    what a signal handler raised) is then completed by the next call, never made twice on a
    parameter (interrupt review: the next ``step()`` updated the first ones again, with
    gradients already scaled). Each parameter's change and its mark are in-place operators
    and a ``set.add``, between which the interpreter runs no signal handler."""
    rates = learning_rates(update, specs)
    if rates is None:
        assert callable(update)
        out = update(params, grads, step)
        return checked_params(specs, params if out is None else out)
    done = set() if done is None else done
    for spec in specs:
        if spec.name in done:
            continue
        p, g, lr = params[spec.name], grads[spec.name], rates[spec.name]
        if spec.kind == "sparse":
            # indices come back unique, so fancy-index assignment adds each row once
            p[g.indices] -= np.asarray(lr * g.values, dtype=p.dtype)
        elif _scalable_in_place(g, p):
            # the taken gradient is the chief's own: scaled where it lies, no temporary
            # array as large as the parameter (the same products as ``lr * g``); an operator,
            # not np.multiply(out=g): a signal handler may run after a call, before the mark
            g *= lr
            p -= g
        else:
            p -= np.asarray(lr * g, dtype=p.dtype)
        done.add(spec.name)
    return params


def learning_rates(update: Update, specs: list[ParamSpec]) -> dict[str, float] | None:
    """Each parameter's learning rate in ``update``, or None for an update function; raises
    ``InvalidArgumentError`` (a ValueError: a parameter without one, not a number) before
    anything is changed: :meth:`ParameterServer.step` checks it before it takes a gradient."""
    if callable(update):
        return None
    if isinstance(update, Mapping):
        missing = [s.name for s in specs if s.name not in update]
        if missing:
            raise InvalidArgumentError(f"no learning rate for parameters {missing}")
        items = [(s.name, update[s.name]) for s in specs]
    else:
        items = [(s.name, update) for s in specs]
    rates = {}
    for name, lr in items:
        try:
            rates[name] = float(lr)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"the learning rate of {name!r} must be a number (or update a function), "
                f"got {lr!r}"
            ) from None
    return rates


def _scalable_in_place(g: Any, p: np.ndarray) -> bool:
    """Whether ``g * lr`` can be computed into ``g`` itself with the result ``lr * g``
    gives in ``p``'s dtype: a writable float or complex array of that dtype and shape."""
    return (
        isinstance(g, np.ndarray) and g.dtype == p.dtype and g.shape == p.shape
        and g.dtype.kind in "fc" and g.flags.writeable
    )  # fmt: skip


def checked_params(specs: list[ParamSpec], params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """What an update function returned, as the parameters: the same names, shapes and
    (castable) dtypes; contiguous copies in the parameters' dtypes."""
    names = {s.name for s in specs}
    if set(params) != names:
        raise InvalidArgumentError(f"update returned parameters {sorted(params)}, expected "
                                   f"{sorted(names)}")  # fmt: skip
    out = {}
    for spec in specs:
        arr = _as_array(params[spec.name], f"the update's {spec.name!r}")
        if arr.shape != spec.shape:
            raise InvalidArgumentError(f"update changed the shape of {spec.name!r}: "
                                       f"{arr.shape} != {spec.shape}")  # fmt: skip
        if not can_cast(arr.dtype, spec.dtype):  # (ml_dtypes' own rule lets complex into bfloat16)
            raise InvalidArgumentError(f"update returned {arr.dtype} for {spec.name!r} "
                                       f"({spec.dtype} expected)")  # fmt: skip
        out[spec.name] = np.asarray(arr, dtype=spec.dtype, order="C")
    return out


def zero_grad(spec: ParamSpec) -> Any:
    """A gradient that changes nothing: zeros (dense) or no rows (sparse)."""
    if spec.kind == "sparse":
        return SparseGradient(
            np.empty(0, np.int64), np.zeros((0, *spec.shape[1:]), spec.dtype),
            np.array(spec.shape, np.int64),
        )  # fmt: skip
    return np.zeros(spec.shape, spec.dtype)
