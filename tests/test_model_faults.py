"""The model-based tests of ``test_model.py`` with faults injected, for the synchronous and the
asyncio classes (whose driver is its own code): any apply or take may
have one of its Redis requests lost on the way there (never run) or its reply lost on the
way back (run, then the connection fails), the first, second, third or fourth request of
the operation. The library retries through such a fault (its retry window), and the model
is unchanged: what a caller sees is the same as without the fault, every accepted gradient
is counted once and taken once, nothing is lost (each take's result is compared exactly
with the reference's, each counter and step after every rule).

The faults are injected under the retry layer (``_io``), on every backend: a script call
(the apply; the take's claim and finish), a batch (a large gradient's parts and its
script; the module's folds), a read of a round's payloads.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _helpers import FAULT_MODES, aclient, failing_once
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_model import INT64_MAX, DenseMachine, DenseSpreadMachine, SparseMachine, _run

from accumulator import aio

MODES = FAULT_MODES
#: (what, mode) of every fault injected in this process: the tests check that faults hit
#: the operations they are about
FIRED: list[tuple[str, str]] = []


class Faults:
    """Stands in for an accumulator's ``_io`` (the retry layer): the ``index``-th request of
    the next operation fails once, before it runs or after, with a ConnectionError; the
    retry layer then sends it again."""

    def __init__(self, acc: Any) -> None:
        self.real = acc._io
        acc._io = self
        self.plan: tuple[int, str] | None = None
        self.seen = 0

    def arm(self, index: int, mode: str) -> None:
        self.plan, self.seen = (index, mode), 0

    def disarm(self) -> None:
        self.plan = None

    def __call__(self, what: str, fn: Callable[[], Any], window: float | None = None) -> Any:
        if self.plan is not None:
            index, mode = self.plan
            if self.seen == index:
                self.plan = None
                fn = failing_once(fn, mode, lambda: FIRED.append((what, mode)),
                                  inspect.iscoroutinefunction(self.real))  # fmt: skip
            self.seen += 1
        return self.real(what, fn, window)


class _WithFaults:
    """Rules of the machines, with a fault armed first."""

    faults: Faults

    def _faulty(self) -> Faults:
        acc = getattr(self.acc, "inner", self.acc)  # (an asyncio one: behind its facade)
        faults = getattr(self, "faults", None)
        if faults is None or faults.real.__self__ is not acc:  # (a new accumulator)
            self.faults = faults = Faults(acc)
        return faults

    def _through_a_fault(self, data: st.DataObject, limit: int, run: Callable[[], None]) -> None:
        faults = self._faulty()
        index = data.draw(st.integers(0, limit), label="fault at request")
        faults.arm(index, data.draw(st.sampled_from(MODES), label="fault"))
        try:
            run()
        finally:
            faults.disarm()

    @precondition(lambda self: self.acc is not None)
    @rule(data=st.data())
    def apply_through_a_fault(self, data: st.DataObject) -> None:
        self._through_a_fault(data, 2, lambda: self._apply(data, fresh=True))

    @precondition(lambda self: self.acc is not None and self.count >= 1 and self.step < INT64_MAX)
    @rule(data=st.data())
    def take_through_a_fault(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(1, self.count), label="num_required")
        self._through_a_fault(data, 3, lambda: self._take(n))


class DenseFaultMachine(_WithFaults, DenseMachine):
    pass


class DenseSpreadFaultMachine(_WithFaults, DenseSpreadMachine):
    pass


class SparseFaultMachine(_WithFaults, SparseMachine):
    pass


# -- the asyncio classes: the same machines, through a synchronous facade ----------------------


class Blocking:
    """An asyncio accumulator driven from the machine's synchronous rules: each coroutine
    method run to its end on the machine's own event loop."""

    def __init__(self, inner: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.inner, self.loop = inner, loop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        return lambda *args, **kwargs: self.loop.run_until_complete(attr(*args, **kwargs))

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.inner.aclose())
        finally:
            self.loop.close()


class _Asyncio:
    """Opens the machine's accumulator as the asyncio twin of its class (``twin``)."""

    twin: Any

    def _open(self, dtype: np.dtype, shape: Any, reduction: str, name: str) -> Any:
        loop = asyncio.new_event_loop()
        acc = self.twin(dtype, shape, name, reduction_type=reduction,
                        client=aclient(self.target), **self.open_options)  # fmt: skip
        return Blocking(loop.run_until_complete(acc.open()), loop)

    open_options: dict[str, Any] = {}


class AsyncDenseFaultMachine(_Asyncio, DenseFaultMachine):
    twin = aio.ConditionalAccumulator


class AsyncDenseSpreadFaultMachine(_Asyncio, DenseSpreadFaultMachine):
    twin = aio.ConditionalAccumulator
    open_options = {"spread_parts": True}


class AsyncSparseFaultMachine(_Asyncio, SparseFaultMachine):
    twin = aio.SparseConditionalAccumulator


def _run_with_faults(machine: type, target: Any, examples: int) -> None:
    FIRED.clear()
    _run(machine, target, examples=examples)
    # faults were injected (which operations they hit is random: hypothesis may draw few
    # takes in a run; the tests below put one in each request of an apply and a take)
    assert FIRED, "no fault was injected"


@pytest.mark.parametrize(("machine", "examples"), [
    (DenseFaultMachine, 25), (DenseSpreadFaultMachine, 12), (SparseFaultMachine, 25),
    (AsyncDenseFaultMachine, 15), (AsyncDenseSpreadFaultMachine, 8),
    (AsyncSparseFaultMachine, 15),
], ids=["dense", "dense-spread", "sparse", "asyncio-dense", "asyncio-dense-spread",
        "asyncio-sparse"])  # fmt: skip
def test_an_accumulator_follows_the_model_through_lost_requests_and_replies(
    target, machine, examples
):
    _run_with_faults(machine, target, examples)


def test_a_take_whose_reply_was_lost_gets_its_round_even_at_the_last_step(target):
    """Found by the asyncio machine above: a take that advanced the step to the int64
    maximum and whose reply was lost is retried; the retry must hand out the round it
    claimed, not refuse it as a new take at the maximum (the round stayed claimed, and no
    take could ever advance past it)."""
    import accumulator

    acc = accumulator.ConditionalAccumulator(np.int64, (3,), shared_name="last",
                                             client=target.client())  # fmt: skip
    acc.set_global_step(INT64_MAX - 1)
    assert acc.apply_grad(np.array([1, 2, 3]), local_step=INT64_MAX - 1)
    faults = Faults(acc)
    faults.arm(0, "reply lost")
    FIRED.clear()
    assert acc.take_grad(1, timeout=5).tolist() == [1, 2, 3]
    assert FIRED and acc.global_step() == INT64_MAX and acc.num_accumulated() == 0
    acc.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("index", [0, 1], ids=["claim", "finish"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_take_through_a_fault_in_each_of_its_requests(target, kind, index, mode):
    """The claim's or the finish's request or reply lost: the take returns the round, once,
    without waiting."""
    import accumulator

    if kind == "dense":
        acc: Any = accumulator.ConditionalAccumulator(np.float64, (3,), shared_name="each",
                                                      client=target.client())  # fmt: skip
        acc.apply_grad(np.array([1.0, 2.0, 3.0]))
        acc.apply_grad(np.array([3.0, 2.0, 1.0]))
    else:
        acc = accumulator.SparseConditionalAccumulator(np.float64, (6, 2), shared_name="each",
                                                       client=target.client())  # fmt: skip
        acc.apply_grad([1, 4], np.array([[1.0, 1.0], [2.0, 2.0]]))
        acc.apply_grad([4], np.array([[4.0, 4.0]]))
    faults = Faults(acc)
    faults.arm(index, mode)
    FIRED.clear()
    # (the retried claim gets its round at once: not after its claim lease, 5 s, ran out, as
    # a round left by a taker that is gone would be)
    got = acc.take_grad(2, timeout=3)
    assert [op.split(" ", 1)[0] for op, _ in FIRED] == ["take_grad"], FIRED
    if kind == "dense":
        assert got.tolist() == [2.0, 2.0, 2.0]
    else:
        assert got.indices.tolist() == [1, 4] and got.values.tolist() == [[1.0, 1.0], [3.0, 3.0]]
    assert acc.global_step() == 1 and acc.num_accumulated() == 0
    faults.arm(0, mode)  # and an apply's
    FIRED.clear()
    if kind == "dense":
        assert acc.apply_grad(np.ones(3), local_step=1) is True
    else:
        assert acc.apply_grad([0], np.ones((1, 2)), local_step=1) is True
    assert FIRED and acc.num_accumulated() == 1
    acc.close()
