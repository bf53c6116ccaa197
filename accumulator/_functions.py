"""Module-level operations on accumulators by name (the library side of the CLI)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from redis.exceptions import NoPermissionError

from . import _admin
from ._connection import Client, connect
from ._errors import permission_denied

_T = TypeVar("_T")


def _with(client: Client, op: Callable[[Any], _T]) -> _T:
    """``op(commands)`` on a connection made for it; a refusal by the ACL raised as ours."""
    conns = connect(client)
    try:
        return op(conns.commands)
    except NoPermissionError as exc:
        raise permission_denied(str(exc)) from exc
    finally:
        conns.close()


def reset_container(container: str, *, client: Client = None) -> int:
    """Delete every accumulator of ``container`` (TF's container reset); returns how many
    accumulators were deleted.

    Objects still open on those accumulators get :class:`NotFoundError` on their next call.
    """
    return _with(client, lambda r: _admin.reset_container(r, container))


def list_accumulators(
    container: str | None = None, *, client: Client = None
) -> list[_admin.Info]:
    """Every accumulator (of one container, or of all); what ``accumulator ls`` shows."""
    return _with(client, lambda r: _admin.list_accumulators(r, container))


def describe_accumulator(
    shared_name: str, *, container: str = "", client: Client = None
) -> _admin.Info:
    """Everything about one accumulator: definition, step, pending round, statistics, waiting
    takers, claims left behind, keys and memory; what ``accumulator show`` shows. Raises
    :class:`NotFoundError` when it does not exist."""
    return _with(client, lambda r: _admin.describe(r, shared_name, container))


def delete_accumulator(shared_name: str, *, container: str = "", client: Client = None) -> int:
    """Delete one accumulator, every key of it (``accumulator delete``); returns the number of
    keys deleted. Objects still open on it get :class:`NotFoundError` on their next call.
    Raises :class:`NotFoundError` when it does not exist."""
    return _with(client, lambda r: _admin.delete(r, shared_name, container))
