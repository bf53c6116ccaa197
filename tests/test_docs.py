"""Every public name has a docstring (help() is how users read the API), and help() of the
accumulators explains what is shared across hosts and how to reach the server."""

from __future__ import annotations

import inspect
from pathlib import Path

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


def _readme_blocks() -> list[tuple[int, str]]:
    """The README's ```python blocks: (line, text)."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    blocks, start = [], None
    for i, line in enumerate(lines):
        if line.strip() == "```python":
            start = i + 1
        elif line.strip() == "```" and start is not None:
            blocks.append((start + 1, "\n".join(lines[start:i])))
            start = None
    return blocks


#: Names the README's examples use without defining them (a fragment's context), as typed
#: here; any other free name is Any.
_CONTEXT = {"url": "str", "acc": "accumulator.ConditionalAccumulator", "step": "int"}


def test_the_readme_examples_type_check_against_the_api(tmp_path: Path) -> None:
    """Each of the README's Python examples, as a function with its free names declared, is
    checked by mypy against the package's annotations: a renamed or removed argument, method
    or class in the API fails here, not in a user's hands."""
    import ast
    import builtins
    import textwrap

    api = pytest.importorskip("mypy.api", reason="mypy is not installed (the test extra has it)")
    blocks = _readme_blocks()
    assert len(blocks) >= 8
    for line, text in blocks:
        body = textwrap.indent(text, "    ")
        tree = ast.parse("async def _f():\n" + body)
        stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Store)}  # fmt: skip
        stored |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arg) for a in [n]}
        stored |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                                   ast.AsyncFunctionDef))}
        stored |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                   if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}  # fmt: skip
        loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Load)}  # fmt: skip
        known = {"np", "accumulator", "asyncio", "threading"}
        free = sorted(loaded - stored - known - set(dir(builtins)))
        head = ["from typing import Any", "import asyncio, threading", "import numpy as np",
                "import accumulator", ""]  # fmt: skip
        head += [f"{name}: {_CONTEXT.get(name, 'Any')}" for name in free]
        source = "\n".join(head) + "\n\n\nasync def _example() -> None:\n" + body + "\n"
        (tmp_path / f"readme_line_{line}.py").write_text(source)
    out, err, status = api.run([str(tmp_path), "--no-error-summary", "--ignore-missing-imports",
                                "--cache-dir", str(tmp_path / ".cache"),
                                "--disable-error-code", "no-untyped-def"])  # fmt: skip
    assert status == 0, out + err
