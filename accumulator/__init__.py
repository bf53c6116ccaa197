"""redis-accumulator: TensorFlow's ConditionalAccumulator semantics, shared through Redis.

Any number of processes on any number of hosts that open the same ``shared_name`` share one
accumulator. ``AccumulatorBase`` is the common base class of both kinds (for ``isinstance``).
``accumulator.sync`` holds the synchronous-training helper, ``accumulator.testing`` a
throwaway redis-server for tests, ``accumulator.raw_ops`` TF's raw ops.

The public names are loaded on first use (`SPEC 1`_ lazy loading): ``import accumulator``
alone imports neither redis-py nor numpy, so that the package's pytest plugin, which every
pytest run in an environment with the package installed loads, costs a test run nothing
until a test asks for its fixtures. An import error of a dependency therefore surfaces at
the first use of a name, e.g. ``accumulator.ConditionalAccumulator``.

.. _SPEC 1: https://scientific-python.org/specs/spec-0001/
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _errors
from ._errors import *  # noqa: F403 - the error classes: a module that imports nothing

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads them
    from . import raw_ops
    from ._core import AccumulatorBase
    from ._dense import ConditionalAccumulator
    from ._functions import (
        delete_accumulator,
        describe_accumulator,
        list_accumulators,
        reset_container,
    )
    from ._sparse import IndexedSlices, SparseConditionalAccumulator, SparseGradient

__version__ = "0.1.0"

# Each public name and the module that defines it (``raw_ops`` is itself a module).
_WHERE = {
    "AccumulatorBase": "._core",
    "ConditionalAccumulator": "._dense",
    "IndexedSlices": "._sparse",
    "SparseConditionalAccumulator": "._sparse",
    "SparseGradient": "._sparse",
    "delete_accumulator": "._functions",
    "describe_accumulator": "._functions",
    "list_accumulators": "._functions",
    "reset_container": "._functions",
    "raw_ops": ".raw_ops",
}

# a literal, for type checkers and linters (a test checks it against _WHERE), and the errors
__all__ = [
    "AccumulatorBase",
    "ConditionalAccumulator",
    "IndexedSlices",
    "SparseConditionalAccumulator",
    "SparseGradient",
    "__version__",
    "delete_accumulator",
    "describe_accumulator",
    "list_accumulators",
    "raw_ops",
    "reset_container",
]
__all__ += _errors.__all__

if not TYPE_CHECKING:  # hidden from type checkers: a misspelt name stays an error there

    def __getattr__(name: str) -> Any:
        """Load a public name on first use, and keep it (later uses are plain lookups)."""
        where = _WHERE.get(name)
        if where is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module = importlib.import_module(where, __name__)
        value = module if name == "raw_ops" else getattr(module, name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The module's names, the ones not loaded yet included (for ``dir()`` and completion)."""
    return sorted({*globals(), *__all__})
