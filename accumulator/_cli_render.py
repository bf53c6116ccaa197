"""How the ``accumulator`` commands print: durations, sizes, aligned tables, and the views of
``ls``, ``show``/``watch`` and ``job``. Every name and other text read from Redis goes through
:func:`~accumulator._cli_context.esc` before it is printed."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from typing import Any

from . import _admin
from ._cli_context import esc
from ._codec import format_shape
from ._keys import SCHEMAS


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable


def fmt_ms(ms: int | float | None) -> str:
    """A duration: 850ms, 12.3s, 4m05s, 2h03m, 3d04h."""
    if ms is None:
        return "n/a"
    ms = float(ms)
    sign = "-" if ms < 0 else ""
    ms = abs(ms)
    if ms < 1000:
        return f"{sign}{ms:.0f}ms"
    s = ms / 1000
    if s < 60:
        return f"{sign}{s:.1f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{sign}{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{sign}{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{sign}{d}d{h:02d}h"


def fmt_time(ms: int | None, now_ms: int | None) -> str:
    if ms is None:
        return "never"
    stamp = _dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")
    return stamp if now_ms is None else f"{stamp} ({fmt_ms(now_ms - ms)} ago)"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> list[str]:
    """Aligned columns, two spaces apart; columns in ``right`` are right-aligned. Cells are
    escaped (:func:`esc`): they may hold names and other text read from Redis."""
    rows = [[esc(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in (headers, *rows):
        cells = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _pairs(pairs: Sequence[tuple[str, str]], indent: str = "  ") -> list[str]:
    width = max(len(k) for k, _ in pairs)
    return [f"{indent}{k.ljust(width)}  {esc(v)}" for k, v in pairs]


def _where(name: str, container: str) -> str:
    """How a sentence names an accumulator: ``'name' (container 'c')``, escaped."""
    where = esc(name, quote=True)
    return where + f" (container {esc(container, quote=True)})" if container else where


def _unreadable(info: _admin.Info) -> str | None:
    """Why ``ls`` could not read this entry (None: it could)."""
    return info.error if isinstance(info, _admin.Unreadable) else None


def stranded_text(info: _admin.Info) -> str:
    """What the rounds claimed by takers that are gone hold, and what becomes of them."""
    return (f"{plural(info.stranded_grads, 'gradient')} in "
            f"{plural(info.stranded_claims, 'round')} claimed by a taker that is gone (not in "
            "COUNT; the next take requiring no more gradients takes it over; `reset` drops "
            "it)")  # fmt: skip


def render_ls(
    infos: Sequence[_admin.Info], server: dict[str, Any] | None, with_container: bool
) -> list[str]:
    headers = ["NAME", "KIND", "DTYPE", "SHAPE", "REDUCTION", "STEP", "COUNT", "TAKERS", "BYTES"]
    rows = [
        [i.shared_name, "?", "", "", "", "", "", "", ""]
        if _unreadable(i) is not None
        else [
            i.shared_name,
            i.kind,
            i.dtype,
            i.shape_text,
            i.reduction,
            str(i.step),
            str(i.count),
            str(i.takers_waiting),
            fmt_bytes(i.bytes),
        ]
        for i in infos
    ]
    right = [5, 6, 7, 8]
    if with_container:
        headers.insert(0, "CONTAINER")
        for row, info in zip(rows, infos, strict=True):
            row.insert(0, info.container or '""')
        right = [c + 1 for c in right]
    lines = table(headers, rows, right) if infos else ["no accumulators"]
    warnings = [
        f"warning: {_where(i.shared_name, i.container)}: {esc(error)}"
        for i in infos
        if (error := _unreadable(i)) is not None
    ]
    read_badly = [
        f"warning: {_where(i.shared_name, i.container)}: {esc(i.definition_error)}"
        for i in infos
        if i.definition_error and _unreadable(i) is None
    ]
    notes = [
        f"note: {_where(i.shared_name, i.container)}: {stranded_text(i)}"
        for i in infos
        if i.stranded_claims and _unreadable(i) is None
    ]
    if warnings or read_badly or notes:
        lines += ["", *warnings, *read_badly, *notes]
    footer = plural(len(infos) - len(warnings), "accumulator")
    if warnings:
        footer += f" (and {len(warnings)} unreadable, listed with KIND ?)"
    if server is not None:
        footer += f" · {esc(server['server'])} {esc(server['version'])}"
        if isinstance(server.get("used_memory"), int):
            footer += f" · server memory {fmt_bytes(server['used_memory'])}"
            if server.get("primaries"):
                footer += f" over {plural(server['primaries'], 'primary', 'primaries')}"
                if isinstance(server.get("fullest_node_share"), float):
                    footer += f" (fullest at {server['fullest_node_share']:.0%} of its maxmemory)"
            elif isinstance(server.get("maxmemory"), int) and server["maxmemory"] > 0:
                footer += f" of {fmt_bytes(server['maxmemory'])} maxmemory"
    return [*lines, "", footer] if infos else [*lines]


def render_show(info: _admin.Info, prev: _admin.Info | None = None) -> list[str]:
    now = info.now_ms
    title = f"accumulator {esc(info.shared_name, quote=True)}"
    if info.container:
        title += f" in container {esc(info.container, quote=True)}"
    if info.private:
        title += " (private)"
    definition = f"{info.kind} {info.dtype} {info.shape_text} {info.reduction}"
    if info.definition_error:
        definition += f"  ({info.definition_error})"
    pending = plural(info.count, "gradient")
    if info.round_shape is not None:
        # a sparse round records the inner dims of its values (rows vary per gradient)
        what = ", rows of shape" if info.kind == "sparse" else " of shape"
        pending += f"{what} [{','.join(str(d) for d in info.round_shape)}]"
    pending += f", {fmt_bytes(info.bytes)}"
    if info.stranded_claims:
        pending += f"; and {stranded_text(info)}"
    # (watch does not count them: a SCAN walks the whole keyspace)
    storage = plural(info.keys, "key") if info.keys is not None else "keys not counted"
    storage += (
        f", {fmt_bytes(info.memory_bytes)} (MEMORY USAGE)"
        if info.memory_bytes is not None
        else ", memory n/a (MEMORY USAGE not available)"
    )
    limit = (
        fmt_bytes(info.max_pending_bytes)
        if info.max_pending_bytes is not None
        else "default (set by no opener)"
    )
    summed = (f"in Redis (accsum module, {info.sum_in_redis})" if info.sum_in_redis
              else "by the taker")  # fmt: skip
    head = [
        ("definition", definition),
        ("summed", summed),
        ("global step", str(info.step)),
        ("pending round", pending),
        ("max pending", limit),
        ("waiting takers", str(info.takers_waiting)),
        ("created", fmt_time(info.created_ms, now)),
    ]
    if info.detailed:
        head.append(("stored", storage))
    if info.sealed is not None:
        head.append(("sealed", f"its sync job finished at step {info.sealed}: applies that "
                               "are not stale are refused"))  # fmt: skip
    if info.schema not in map(str, SCHEMAS):
        speaks = " and ".join(map(str, SCHEMAS))
        head.append(("key schema", f"{info.schema} (this library speaks {speaks})"))
    lines = [title, *_pairs(head)]

    stale = str(info.n_stale)
    if info.n_stale:
        stale += f" (on average {info.mean_stale:.1f} steps behind, at most {info.max_stale})"
    quarantined = str(info.n_quarantined)
    if info.detailed:
        quarantined += f" ({plural(info.quarantined, 'entry', 'entries')} in quarantine now)"
    last_take = "never"
    if info.last_take_ms is not None:
        last_take = f"{fmt_ms(now - info.last_take_ms)} ago" if now is not None else "?"
        last_take += f", after waiting {fmt_ms(info.last_take_wait_ms)}"
    lines += [
        "",
        "lifetime",
        *_pairs(
            [
                ("applies accepted", str(info.n_applied)),
                ("stale dropped", stale),
                ("rejected", str(info.n_rejected)),
                ("quarantined", quarantined),
                ("takes", f"{info.n_taken} ({plural(info.grads_taken, 'gradient')})"),
                ("last take", last_take),
            ]
        ),
    ]
    if prev is not None and prev.now_ms is not None and now is not None and now > prev.now_ms:
        secs = (now - prev.now_ms) / 1000
        applied, stale_d = info.n_applied - prev.n_applied, info.n_stale - prev.n_stale
        taken = info.n_taken - prev.n_taken
        lines.append(
            f"  last {secs:.1f}s: +{applied} applied ({applied / secs:.1f}/s), "
            f"+{stale_d} stale, +{taken} takes ({taken / secs:.2f}/s)"
        )

    if info.detailed:
        lines += ["", f"waiting takers ({len(info.takers)})"]
        if info.takers:
            rows = []
            for t in info.takers:
                if t.lease_remaining_ms is None:
                    lease = "n/a"
                elif t.lease_remaining_ms < 0:
                    lease = f"expired {fmt_ms(-t.lease_remaining_ms)} ago (taker gone?)"
                else:
                    lease = (
                        f"renewed {fmt_ms(t.lease_age_ms)} ago, {fmt_ms(t.lease_remaining_ms)} left"
                    )
                needs = "?" if t.num_required is None else str(t.num_required)
                rows.append([str(t.position), t.taker_id, needs, fmt_ms(t.waited_ms), lease])
            lines += [
                "  " + x
                for x in table(["#", "TAKER", "NEEDS", "WAITED", "LEASE"], rows, right=[0, 2, 3])
            ]
        else:
            lines.append("  none")
        lines += ["", "claimed rounds (taken, not finished yet)"]
        if info.claims:
            rows = []
            for c in info.claims:
                held = fmt_bytes(c.bytes)
                if c.missing_blobs:
                    held += f" ({c.missing_blobs} payloads missing)"
                step = "?" if c.step is None else str(c.step)
                if c.lease_remaining_ms is None:
                    lease = "none: in no registry (`evict --drop` deletes it)"
                elif c.lease_remaining_ms < 0:
                    lease = (f"ran out {fmt_ms(-c.lease_remaining_ms)} ago: the next take "
                             f"of {c.count} or fewer gets it")
                else:
                    lease = f"{fmt_ms(c.lease_remaining_ms)} left (being read)"
                rows.append([c.taker_id, step, str(c.count), held, lease, c.key])
            headers = ["TAKER", "TO STEP", "GRADIENTS", "BYTES", "LEASE", "KEY"]
            lines += ["  " + x for x in table(headers, rows, right=[1, 2])]
        else:
            lines.append("  none")
        if info.retry_buffers:
            lines.append(
                f"  (and {plural(info.retry_buffers, 'finished take')} kept briefly so that a "
                "retried take gets the same round; they expire on their own)"
            )
        if info.stray_keys:
            size = "" if info.stray_bytes is None else f", {fmt_bytes(info.stray_bytes)}"
            if info.stray_expire_ms is None:
                when = "they expire on their own"
            elif info.stray_expire_ms < 0:  # a reset or delete cut short left them
                when = "some never expire"
            else:
                when = f"they expire within {fmt_ms(info.stray_expire_ms)}"
            lines.append(
                f"  {plural(info.stray_keys, 'stray key')}{size} (payloads of applies that "
                f"never completed: a worker killed while it sent one, or of a command cut "
                f"short); {when} (`reset` keeps them: an apply may be on its way; `delete` "
                "removes them)"
            )
        if info.spread_stray_keys:
            size = ("" if info.spread_stray_bytes is None
                    else f", {fmt_bytes(info.spread_stray_bytes)}")  # fmt: skip
            due = info.spread_stray_due_ms
            after = "" if not due else f" after {fmt_ms(due)}"
            lines.append(
                f"  {plural(info.spread_stray_keys, 'stray part')}{size} of gradients spread "
                "over the cluster's slots (applies being sent, or never completed: a worker "
                "killed while it sent one); they have no expiry of their own: the "
                f"accumulator's next apply, take, reset or delete{after} deletes them"
            )
    return lines


def _lease_text(chief: _admin.ChiefLease | None, now: int | None) -> str:
    if chief is None:
        return "none (no chief holds the lease)"
    tenure = f", tenure {chief.tenure}" if chief.tenure else ""
    who = f"{chief.chief_id} (host {chief.host or '?'}, pid {chief.pid or '?'}{tenure})"
    if chief.remaining_ms is None:
        return f"{who}, lease n/a"
    if chief.live:
        renewed = "" if now is None or chief.renewed_ms is None else (
            f"renewed {fmt_ms(now - chief.renewed_ms)} ago, "
        )  # fmt: skip
        return f"{who}, lease {renewed}{fmt_ms(chief.remaining_ms)} left"
    return f"{who}, lease ran out {fmt_ms(-chief.remaining_ms)} ago (the chief is gone?)"


def render_job(info: _admin.JobInfo) -> list[str]:
    """``accumulator job NAME``: the published state, the chief, workers, parameters."""
    now = info.now_ms
    title = f"sync job {esc(info.job, quote=True)}"
    if info.container:
        title += f" in container {esc(info.container, quote=True)}"
    if info.step is None:
        state = "none (not initialized, or deleted)"
    else:
        state = f"{info.step} ({'finished' if info.done else 'running'})"
    head = [("published step", state)]
    if info.replicas is not None:
        head.append(
            ("aggregation", f"{plural(info.replicas, 'gradient')} per parameter per step, "
                            f"{info.reduction}")
        )
    head.append(("chief", _lease_text(info.chief, now)))
    accepted = info.pushes - info.partial - info.stale
    head.append(
        (
            "pushes",
            f"{info.pushes} ({accepted} accepted, {info.stale} stale, "
            f"{info.partial} partly stale)",
        )
    )
    lines = [title, *_pairs(head), "", f"workers ({len(info.workers)})"]
    if info.workers:
        rows = [
            [
                w.worker_id,
                str(w.pushes),
                str(w.accepted),
                str(w.stale),
                str(w.partial),
                "n/a"
                if w.last_seen_ms is None or now is None
                else f"{fmt_ms(now - w.last_seen_ms)} ago",
            ]
            for w in info.workers
        ]
        headers = ["WORKER", "PUSHES", "ACCEPTED", "STALE", "PARTIAL", "LAST SEEN"]
        lines += ["  " + x for x in table(headers, rows, right=[1, 2, 3, 4, 5])]
    else:
        lines.append("  none")
    lines += ["", f"parameters ({len(info.params)})"]
    if info.params:
        # the figures are the accumulator's: parameters fused into one say them once (on
        # its first row; '"' below), not once per parameter, which read as double counts
        seen: set[str] = set()
        rows = []
        for p in info.params:
            figures = [
                "missing" if p.step is None else str(p.step),
                str(p.pending),
                str(p.takers_waiting),
                str(p.claimed),
            ]
            if p.shared_name in seen:
                figures = ['"'] * len(figures)
            seen.add(p.shared_name)
            rows.append([p.name, p.shared_name, p.kind, p.dtype, format_shape(p.shape), *figures])
        headers = ["PARAM", "ACCUMULATOR", "KIND", "DTYPE", "SHAPE", "STEP", "PENDING", "TAKERS",
                   "CLAIMED"]  # fmt: skip
        lines += ["  " + x for x in table(headers, rows, right=[5, 6, 7, 8])]
    else:
        lines.append("  none")
    if info.warnings or info.notes:
        lines.append("")
        lines += [f"warning: {esc(w)}" for w in info.warnings]
        lines += [f"note: {esc(n)}" for n in info.notes]
    return lines
