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
