"""redis-accumulator: TensorFlow's ConditionalAccumulator semantics, shared through Redis.

Any number of processes on any number of hosts that open the same ``shared_name`` share one
accumulator. ``AccumulatorBase`` is the common base class of both kinds (for ``isinstance``).
``accumulator.sync`` holds the synchronous-training helper, ``accumulator.testing`` a
throwaway redis-server for tests, ``accumulator.raw_ops`` TF's raw ops.
"""

from . import raw_ops
from ._core import AccumulatorBase
from ._dense import ConditionalAccumulator
from ._errors import (
    AccumulatorError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotDurableError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SchemaVersionError,
    UnavailableError,
)
from ._functions import (
    delete_accumulator,
    describe_accumulator,
    list_accumulators,
    reset_container,
)
from ._sparse import IndexedSlices, SparseConditionalAccumulator, SparseGradient

__version__ = "0.1.0"

__all__ = [
    "AccumulatorBase",
    "AccumulatorError",
    "CancelledError",
    "ConditionalAccumulator",
    "IndexedSlices",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "NotDurableError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SchemaVersionError",
    "SparseConditionalAccumulator",
    "SparseGradient",
    "UnavailableError",
    "__version__",
    "delete_accumulator",
    "describe_accumulator",
    "list_accumulators",
    "raw_ops",
    "reset_container",
]
