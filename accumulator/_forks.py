"""What a forked child must not inherit as it is: the locks of module state (a thread of the
parent may have held one at the fork; the child has no such thread, and would wait for it
forever) and, for objects made before the fork, their record of the parent's threads.

:data:`COUNT` counts the forks this process descends from; an object compares it with the
count it saw last (``AccumulatorBase._after_fork``): no system call on the hot path.
"""

from __future__ import annotations

import os
import threading
from typing import Any

#: Forks this process descends from (a child counts one more than its parent did).
COUNT = [0]


def _count() -> None:
    COUNT[0] += 1


def renew_lock_after_fork(namespace: dict[str, Any], name: str) -> None:
    """Bind ``namespace[name]`` (a module's globals) to a new lock in every forked child."""

    def renew() -> None:
        namespace[name] = threading.Lock()

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=renew)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count)
