"""The overview of ``accumulator watch`` (no NAME): every accumulator with its rates.

Pure pieces (rates from two snapshots, a sparkline, the table); the command in
``_cli_commands`` does the I/O. Rates are lifetime counters (``n_applied``, ``n_taken``)
differenced between refreshes over the server's clock, so every client's work counts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from . import _admin
from ._cli_context import esc
from ._cli_render import fmt_bytes, plural, table

#: Refreshes a sparkline remembers.
HISTORY = 24
_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Any) -> str:
    """One character per value, scaled to the largest (all zeros: the lowest bar)."""
    values = list(values)
    top = max(values, default=0.0)
    if top <= 0:
        return _BARS[0] * len(values)
    return "".join(_BARS[min(len(_BARS) - 1, int(v / top * (len(_BARS) - 1) + 0.5))]
                   for v in values)  # fmt: skip


@dataclass
class _Track:
    applied: int
    taken: int
    at_ms: int
    applies: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))


@dataclass
class Rates:
    """Applies and takes per second of every accumulator, from one snapshot to the next."""

    tracks: dict[tuple[str, str], _Track] = field(default_factory=dict)

    def update(self, infos: list[_admin.Info], now_ms: int) -> list[dict[str, Any]]:
        """Rows for this snapshot: each accumulator's figures, its rates since the previous
        snapshot (None the first time it is seen) and its recent applies/s. ``now_ms``: the
        snapshot's time where an accumulator's own server time is missing."""
        rows: list[dict[str, Any]] = []
        seen = set()
        for info in infos:
            key = (info.container, info.shared_name)
            seen.add(key)
            now = info.now_ms or now_ms
            old = self.tracks.get(key)
            applies = takes = None
            if old is not None and now > old.at_ms:
                seconds = (now - old.at_ms) / 1000
                applies = max(0, info.n_applied - old.applied) / seconds
                takes = max(0, info.n_taken - old.taken) / seconds
                old.applies.append(applies)
            track = old or _Track(info.n_applied, info.n_taken, now)
            track.applied, track.taken, track.at_ms = info.n_applied, info.n_taken, now
            self.tracks[key] = track
            rows.append({
                "container": info.container, "shared_name": info.shared_name,
                "step": info.step, "pending": info.count, "pending_bytes": info.bytes,
                "takers_waiting": info.takers_waiting, "applies_per_s": applies,
                "takes_per_s": takes, "recent_applies_per_s": list(track.applies),
                "stranded_claims": info.stranded_claims, "stranded_grads": info.stranded_grads,
                # why it could not be read (a foreign key: its figures mean nothing), or None
                "error": info.error if isinstance(info, _admin.Unreadable) else None,
            })  # fmt: skip
        for key in set(self.tracks) - seen:  # deleted meanwhile
            del self.tracks[key]
        return rows


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render_overview(rows: list[dict[str, Any]], with_container: bool) -> list[str]:
    """The table of :meth:`Rates.update`'s rows (names escaped), with a CONTAINER column
    as ``ls`` has (a name may hold ``/`` itself: ``c/n`` would be ambiguous)."""
    if not rows:
        return ["no accumulators"]
    headers = ["NAME", "STEP", "PENDING", "BYTES", "TAKERS", "APPLIES/S", "TAKES/S", "RECENT"]
    right = [1, 2, 3, 4, 5, 6]
    if with_container:
        headers.insert(0, "CONTAINER")
        right = [c + 1 for c in right]
    body = [
        [
            *([r["container"] or '""'] if with_container else []),
            r["shared_name"],
            str(r["step"]), str(r["pending"]), fmt_bytes(r["pending_bytes"]),
            str(r["takers_waiting"]), _rate(r["applies_per_s"]), _rate(r["takes_per_s"]),
            sparkline(r["recent_applies_per_s"]),
        ]
        if not r.get("error")
        else [*([r["container"] or '""'] if with_container else []), r["shared_name"],
              "?", "", "", "", "", "", "unreadable (see ls)"]
        for r in rows
    ]  # fmt: skip
    notes = [
        f"note: {esc(r['shared_name'], quote=True)}: "
        f"{plural(r['stranded_grads'], 'gradient')} (not in PENDING) in "
        f"{plural(r['stranded_claims'], 'round')} claimed by a taker that is gone"
        for r in rows
        if r.get("stranded_claims")
    ]
    return [*table(headers, body, right), *([""] + notes if notes else []), "",
            plural(len(rows), "accumulator")]  # fmt: skip
