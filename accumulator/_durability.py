"""Durability a user chooses: an apply (and a take's finish) confirmed by ``WAIT`` (that many
replicas have it) or ``WAITAOF`` (the primary's AOF, and that many replicas', have it fsynced)
before it returns. No I/O here: the protocol sends the command in the same pipeline as the
write it confirms (``WAIT`` counts the writes of its own connection)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ._errors import InvalidArgumentError


@dataclass(frozen=True)
class Durability:
    """What an accumulator object waits for after each of its commits."""

    replicas: int  # replicas that must acknowledge (WAIT), or have fsynced (WAITAOF)
    aof: bool  # also the primary's own AOF fsync (WAITAOF 1 ...)
    timeout: float  # seconds to wait for them

    def command(self) -> tuple[Any, ...]:
        """The command that waits for them (after the write, on the same connection)."""
        ms = max(1, int(self.timeout * 1000))
        if self.aof:
            return ("WAITAOF", 1, self.replicas, ms)
        return ("WAIT", self.replicas, ms)

    def unconfirmed(self) -> Any:
        """The reply of a wait that confirmed nothing."""
        return [0, 0] if self.aof else 0

    def shortfall(self, reply: Any) -> str | None:
        """None when the reply confirms the write; else what it lacked, in words."""
        if self.aof:
            local, replicas = (int(x) for x in reply)
            missing = []
            if local < 1:
                missing.append("the primary's AOF fsync")
            if replicas < self.replicas:
                missing.append(_more(self.replicas, replicas, "the AOF fsync"))
            return " and ".join(missing) or None
        acked = int(reply)
        if acked >= self.replicas:
            return None
        return _more(self.replicas, acked, "the acknowledgement")

    def describe(self) -> str:
        """The setting, in the words of the constructor."""
        return f"min_replicas={self.replicas}" + (", wait_aof=True" if self.aof else "")


def _more(wanted: int, got: int, what: str) -> str:
    """What ``wanted - got`` replicas still owe, in words: "the acknowledgement of 1 more
    replica (0 of 1 so far; is any replica connected?)"."""
    more = wanted - got
    hint = "; is any replica connected?" if got == 0 else ""
    return (f"{what} of {more} more replica{'s' if more > 1 else ''} ({got} of {wanted} "
            f"so far{hint})")  # fmt: skip


def durability_of(min_replicas: Any, wait_aof: Any, timeout: float) -> Durability | None:
    """The checked setting (None: do not wait, Redis's default)."""
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 0:
        raise InvalidArgumentError(
            f"min_replicas must be a non-negative integer, got {min_replicas!r}"
        )
    if not isinstance(wait_aof, bool):
        raise InvalidArgumentError(f"wait_aof must be True or False, got {wait_aof!r}")
    if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
        raise InvalidArgumentError(f"durability_timeout must be positive seconds, got {timeout!r}")
    if not min_replicas and not wait_aof:
        return None
    return Durability(min_replicas, wait_aof, float(timeout))
