"""Every public name has a docstring (help() is how users read the API), and help() of the
accumulators explains what is shared across hosts and how to reach the server."""

from __future__ import annotations

import inspect

import pytest

import accumulator
import accumulator.aio
import accumulator.raw_ops
import accumulator.sync
import accumulator.testing

MODULES = [accumulator, accumulator.aio, accumulator.sync, accumulator.testing,
           accumulator.raw_ops]  # fmt: skip


def _public_members() -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for module in MODULES:
        names = getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")])
        for name in names:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            where = f"{module.__name__}.{name}"
            if inspect.isclass(obj) or inspect.isfunction(obj):
                out.append((where, obj))
            if not (inspect.isclass(obj) and obj.__module__.startswith("accumulator")):
                continue
            seen: set[str] = set()
            # what the class defines and what it inherits from our own (private) bases
            own = [c for c in obj.__mro__ if c.__module__.startswith("accumulator")]
            for attr, value in (item for c in own for item in vars(c).items()):
                if attr.startswith("_") or attr in seen:
                    continue
                seen.add(attr)
                if isinstance(value, property):
                    out.append((f"{where}.{attr}", value.fget))
                elif isinstance(value, (staticmethod, classmethod)):
                    out.append((f"{where}.{attr}", value.__func__))
                elif inspect.isfunction(value):
                    out.append((f"{where}.{attr}", value))
    return out


def test_every_public_name_has_a_docstring() -> None:
    members = _public_members()
    assert len(members) > 100  # the walk found the API
    missing = [where for where, obj in members if not (getattr(obj, "__doc__", None) or "").strip()]
    assert not missing, missing


@pytest.mark.parametrize("cls", [accumulator.ConditionalAccumulator,
                                 accumulator.SparseConditionalAccumulator])  # fmt: skip
def test_help_explains_what_is_shared_and_the_client(cls: type) -> None:
    text = inspect.getdoc(cls) or ""
    for word in ("shared_name", "container", "client", "host"):
        assert word in text, word
