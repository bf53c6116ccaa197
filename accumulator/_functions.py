"""Module-level operations on accumulators by name (the library side of the CLI)."""

from __future__ import annotations

from . import _admin
from ._connection import Client, connect


def reset_container(container: str, *, client: Client = None) -> int:
    """Delete every accumulator of ``container`` (TF's container reset); returns how many
    accumulators were deleted.

    Objects still open on those accumulators get :class:`NotFoundError` on their next call.
    """
    conns = connect(client)
    try:
        return _admin.reset_container(conns.commands, container)
    finally:
        conns.close()


def list_accumulators(
    container: str | None = None, *, client: Client = None
) -> list[_admin.Info]:
    """Every accumulator (of one container, or of all); what ``accumulator ls`` shows."""
    conns = connect(client)
    try:
        return _admin.list_accumulators(conns.commands, container)
    finally:
        conns.close()


def describe_accumulator(
    shared_name: str, *, container: str = "", client: Client = None
) -> _admin.Info:
    """Everything about one accumulator: definition, step, pending round, statistics, waiting
    takers, claims left behind, keys and memory; what ``accumulator show`` shows. Raises
    :class:`NotFoundError` when it does not exist."""
    conns = connect(client)
    try:
        return _admin.describe(conns.commands, shared_name, container)
    finally:
        conns.close()


def delete_accumulator(shared_name: str, *, container: str = "", client: Client = None) -> int:
    """Delete one accumulator, every key of it (``accumulator delete``); returns the number of
    keys deleted. Objects still open on it get :class:`NotFoundError` on their next call.
    Raises :class:`NotFoundError` when it does not exist."""
    conns = connect(client)
    try:
        return _admin.delete(conns.commands, shared_name, container)
    finally:
        conns.close()
