"""Every public name has a docstring (help() is how users read the API), and help() of the
accumulators explains what is shared across hosts and how to reach the server."""

from __future__ import annotations

import inspect

import pytest

import accumulator
import accumulator.raw_ops
import accumulator.sync
import accumulator.testing

MODULES = [accumulator, accumulator.sync, accumulator.testing, accumulator.raw_ops]


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
            if inspect.isclass(obj) and obj.__module__.startswith("accumulator"):
                for attr, value in vars(obj).items():
                    if attr.startswith("_"):
                        continue
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
