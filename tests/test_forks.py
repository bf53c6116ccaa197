"""A child forked while a thread of the parent held one of the library's locks (a module's or an
object's) does not wait for it: the locks are made anew in the child (``_forks``;
mutation review of 2026-11-30: dropping any one renewal passed the suite)."""

from __future__ import annotations

import asyncio
import os
import types

import numpy as np
import pytest
from _helpers import fork_while_held

import accumulator
from accumulator import _reaper


def _take_lock_in_child(name: str) -> None:
    """What a child does that takes module lock ``name`` (no server needed)."""
    if name == "aio._connection":
        from accumulator.aio._connection import connect

        async def go() -> None:
            await connect("redis://127.0.0.1:1").close()  # (no I/O: pools connect on use)

        asyncio.run(go())
    elif name == "aio._receive":
        from accumulator.aio._receive import close_reader

        close_reader(types.SimpleNamespace())
    elif name == "_cluster_batch":
        from accumulator._cluster_batch import node_threads

        node_threads()
    elif name == "_reaper":
        assert _reaper.wait_idle(5)
    else:
        raise AssertionError(name)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
@pytest.mark.parametrize(("name", "attr"), [
    ("aio._connection", "_LOCK"), ("aio._receive", "_LOCK"),
    ("_cluster_batch", "_THREADS_LOCK"), ("_reaper", "_START"),
])  # fmt: skip
def test_a_child_forked_while_a_thread_held_a_module_lock_does_not_wait_for_it(
    name: str, attr: str
) -> None:
    import importlib

    module = importlib.import_module(f"accumulator.{name}")
    fork_while_held(getattr(module, attr), lambda: _take_lock_in_child(name))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_child_forked_while_a_thread_held_an_accumulators_lock_can_use_it(real_url: str) -> None:
    """The object's own lock, held by a parent thread at the fork (an operation beginning or
    ending), is made anew in the child: its first operation and close() do not hang."""
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="forklock",
                                             client=real_url)  # fmt: skip

    def in_child() -> None:
        acc.apply_grad(np.ones(3, np.float32))
        acc.close()

    fork_while_held(acc._waits_lock, in_child)
    assert acc.num_accumulated() == 1
    acc.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_child_closes_an_accumulator_while_a_parent_thread_held_its_pool(real_url: str) -> None:
    """The pool's own lock, held by a parent thread at the fork (in redis-py, taking or
    giving back a connection): the child's close() made redis-py reset the inherited pool,
    which waits for that lock, for ever. The child leaves the parent's pools alone."""
    acc = accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="forkpool",
                                             client=real_url)  # fmt: skip
    acc.apply_grad(np.ones(3, np.float32))
    fork_while_held(acc._conns.commands.connection_pool._lock, acc.close)
    assert acc.num_accumulated() == 1  # the parent's connections still work
    acc.close()
