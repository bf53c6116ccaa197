"""Synchronous data-parallel training through Redis, the way TF1's ``SyncReplicasOptimizer``
did it: an accumulator per parameter (small dense ones fused into buckets: ``fusion_bytes``
of :class:`ParameterServer`), workers apply gradients at their local step, a chief
takes ``replicas_to_aggregate`` of them, updates the parameters and publishes them with the
next step. Framework-agnostic: numpy in, numpy out (torch/jax tensors are accepted through
``__array__``).

The chief::

    from accumulator.sync import ParameterServer

    ps = ParameterServer("mnist", replicas_to_aggregate=3, sparse={"emb"}, client=url)
    ps.initialize({"w": w0, "b": b0, "emb": emb0})  # or resumes a job already published
    print(ps.accumulator_names)  # {"w": "mnist/w", ...} ("mnist/#fused/0-<layout>": small fused)
    while not ps.finished:  # a finished job stays finished: a re-run chief does nothing
        # plain SGD (or {"w": 0.1, ...}, or fn(params, grads, step)); final: the last update,
        # then workers' pull(after=...) raise TrainingFinished
        ps.step(0.1, timeout=60, final=ps.global_step == 999)
    print(ps.stats())  # pushes accepted / dropped as stale, per worker and per accumulator

Each worker (any number, on any host; only the job name is needed)::

    from accumulator.sync import TrainingFinished, Worker

    worker = Worker("mnist", client=url)
    step, params = worker.pull(timeout=60)  # the current step: late joiners catch up
    while not worker.finished:  # joined a job that is already over: nothing to do
        grads = compute(params)  # {"w": array, "b": array, "emb": (indices, values)}
        accepted = worker.push(step, grads)  # {"w": True, ...}; False = dropped as stale
        try:
            step, params = worker.pull(after=step, timeout=60)
        except TrainingFinished:
            break

Semantics:

- Parameters named in ``sparse`` go through a :class:`SparseConditionalAccumulator`: workers
  push ``(indices, values)`` (or an ``IndexedSlices``) holding only the rows they touched;
  MEAN divides each row by the number of gradients that contained it.
- With ``replicas_to_aggregate`` smaller than the number of workers the slowest workers are
  backups: a gradient pushed after the chief's take of that step is dropped as stale (the
  accumulator's global step moved on). :meth:`ParameterServer.stats` and the ``push`` results
  show how many; pushes are counted per job and per worker in Redis (with the time each
  worker was last seen), so every host's count is visible to all (``accumulator job NAME``).
- A push checks every tensor (dtype, shape, sparse indices) before it applies any: a bad one
  raises :class:`~accumulator.InvalidArgumentError` naming the parameter and nothing is
  applied. A push that fails later (Redis unreachable past the retry window, a full round)
  may have applied some tensors; pushing again at the same step applies only the others.
- The parameters travel through Redis: a small hash holding the step, a run id, a ``done``
  flag and msgpack metadata, and each parameter's raw little-endian bytes (never pickle) in
  parts of 1 MiB under keys of their version (run, step). A publish writes the new version's
  parts, then switches the hash to it in one MULTI with a PUBLISH (a reader never sees the
  parameters of one step with another's step number); the previous version stays readable
  until the next publish deletes it (a minute at most), so Redis holds two versions (a
  restarted chief lets its predecessors' expire within a minute: add two per chief restart
  in the last minute). Waiting workers sleep on that pub/sub channel and re-check the hash
  at least every ``POLL_SLICE`` seconds, so a lost message only costs latency.
- Redis faults are ridden out: every command of the chief and the workers (publish, reads,
  counters, pub/sub waits, and the accumulators' own) is retried for ``retry_window`` seconds
  (30 by default: a restart or failover), and a waiting worker subscribes again after its
  connection dropped; a longer outage raises :class:`~accumulator.UnavailableError`.
- One chief per job: the chief holds a lease (``accsync:{tag}:chief``, ``chief_lease``
  seconds, renewed in the background and at every step). A second chief gets
  :class:`ChiefConflictError` naming the holder; it may take over once the holder's lease
  has run out (a crashed chief), at once if it has the holder's ``chief_id``.
- A finished job stays finished: ``initialize()`` on it loads the final parameters and
  returns (:attr:`ParameterServer.finished` is True; ``resume=False`` starts a new job). A
  push at or after the final step raises :class:`TrainingFinished` and applies nothing.
- A worker that joins late or restarts simply pulls: it gets the current step and
  parameters. A worker that dies mid-push leaves at most a partial gradient (counted).
- A chief that restarts calls :meth:`ParameterServer.initialize` again and resumes the
  published job. If it died during a step (some accumulators one step ahead of the published
  step), the step is completed: rounds it had claimed but not read are handed to the new
  chief's takes (the accumulators' claim hand-over), and for a parameter whose round it had
  already read (those gradients died with it) the step uses a zero gradient (dense) or no
  rows (sparse). If it had read every parameter's round, the step is skipped: the
  parameters are republished unchanged at the next step. Either way the published step and
  the accumulators' steps agree again, and no gradient is applied twice.
- The step counts chief updates, as TF's ``global_step``; a restarted worker that pushes
  again at a step it already pushed at is counted twice (as in TF).

Redis keys (besides the accumulators, shared names ``<job>/<param>`` and, for buckets of
fused parameters, ``<job>/#fused/<i>``) are built by
:class:`SyncKeys`, plus the chief lease ``accsync:{tag}:chief`` (:func:`chief_key`).
"""

from __future__ import annotations

import logging

from .._keys import SyncKeys
from ._chief import ParameterServer
from ._job import ParamStats, SyncStats, TrainingFinished, WorkerStats, accumulator_name
from ._lease import CHIEF_LEASE_SECONDS, ChiefConflictError, chief_key
from ._params import Update
from ._published import ParamSpec
from ._worker import POLL_SLICE as POLL_SLICE  # read-only here: set it in ._worker
from ._worker import Worker

__all__ = [
    "CHIEF_LEASE_SECONDS",
    "ChiefConflictError",
    "ParamSpec",
    "ParamStats",
    "ParameterServer",
    "SyncKeys",
    "SyncStats",
    "TrainingFinished",
    "Update",
    "Worker",
    "WorkerStats",
    "accumulator_name",
    "chief_key",
]

logger = logging.getLogger("accumulator.sync")

# As before the split (reprs, tracebacks, pickles): the public classes and functions name
# this module as theirs.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith(__name__ + "."):
        _obj.__module__ = __name__
del _name, _obj
