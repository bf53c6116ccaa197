"""A SCAN spread over the frames of ``accumulator watch``.

A SCAN walks the whole keyspace (about a second of the server's time per million keys), so
``watch`` repeating a whole one every frame would keep a Redis shared with millions of
other keys busy. :class:`StateScan` makes the first pass whole (the first frame lists
everything), then continues the scan for a bounded time each frame: what it lists is what
the last whole pass found plus what the pass under way found since. On a small keyspace a
pass ends every frame, as a whole SCAN would; on a big one a new accumulator appears within
a pass, and a deleted one drops out at once (its state reads empty).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

from redis.cluster import RedisCluster

from ._keys import DEFAULT_PREFIX, state_pattern

#: Keys a SCAN call looks at (as every other SCAN of the CLI).
SCAN_COUNT = 1000


class StateScan:
    """The state keys of one container's accumulators (every container's: None), found by
    a SCAN continued from frame to frame."""

    def __init__(self, r: Any, container: str | None, *, prefix: str = DEFAULT_PREFIX) -> None:
        self._r = r
        self._pattern = state_pattern(container, prefix)
        self._calls: Iterator[list[bytes]] | None = None  # the pass under way
        self._passed: set[bytes] | None = None  # what the last whole pass found
        self._seen: set[bytes] = set()  # what the pass under way found so far
        #: whole passes made
        self.passes = 0

    def keys(self, budget: float) -> set[bytes]:
        """Continue the scan for about ``budget`` seconds (the first pass: to its end) and
        return the state keys known now. A fault (Redis unreachable) propagates, and the
        next call starts a new pass."""
        deadline = time.monotonic() + budget
        if self._calls is None:
            self._calls, self._seen = self._pass(), set()
        try:
            for found in self._calls:
                self._seen.update(found)
                if self._passed is not None and time.monotonic() > deadline:
                    return self._passed | self._seen
        except BaseException:
            self._calls = None
            raise
        self._passed, self._calls = self._seen, None
        self.passes += 1
        return set(self._passed)

    def _pass(self) -> Iterator[list[bytes]]:
        """One whole pass, a SCAN call at a time (each primary of a cluster in turn)."""
        if isinstance(self._r, RedisCluster):
            for node in _primaries(self._r):
                cursor = 0
                while True:
                    # (a cluster client's SCAN answers a cursor per node it asked)
                    cursors, found = cast(tuple[dict[str, int], list[bytes]], self._r.scan(
                        cursor=cursor, match=self._pattern, count=SCAN_COUNT, target_nodes=node
                    ))  # fmt: skip
                    yield found
                    cursor = int(cursors[node.name])
                    if cursor == 0:
                        break
            return
        cursor = 0
        while True:
            cursor, found = self._r.scan(cursor=cursor, match=self._pattern, count=SCAN_COUNT)
            yield found
            if int(cursor) == 0:
                return


def _primaries(r: RedisCluster) -> list[Any]:
    """The cluster's primaries, as the client knows them; its view first made new when some
    slot's serving node is not among them (after a failover the client may still take the
    promoted replica for a replica until a command of that slot is redirected: a pass of
    the primaries it knows then missed that slot's accumulators, and watch dropped them)."""
    primaries = r.get_primaries()
    names = {node.name for node in primaries}
    slots = r.nodes_manager.slots_cache
    if len(slots) < 16384 or any(
        not held or held[0].name not in names for held in slots.values()
    ):
        r.nodes_manager.initialize()
        primaries = r.get_primaries()
    return list(primaries)
