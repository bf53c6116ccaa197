"""Inspecting and operating accumulators: the functions behind the ``accumulator`` CLI.

Pure functions over a ``redis.Redis`` that returns bytes (the default). Every key name comes
from :mod:`accumulator._keys`; keys are found with SCAN (never KEYS). Reads are snapshots:
accumulators may change while they are inspected.

This module only gathers them; each job lives in its own module: :mod:`._admin_info` the
snapshot types (:class:`Info`) and how a state hash reads, :mod:`._admin_read` listing and
describing (:func:`list_accumulators`, :func:`describe`, :func:`server_info`),
:mod:`._admin_ops` changing (:func:`set_step`, :func:`reset`, :func:`delete`,
:func:`reset_container`), and :mod:`._admin_job` the sync jobs of :mod:`accumulator.sync`
(:func:`describe_job`, :func:`delete_job`, the chief lease's key :func:`chief_lease_key`).

Nothing here needs INFO or MEMORY USAGE: where a server lacks them (fakeredis, a restricted
ACL, a managed service) the corresponding values are ``None``.
"""

from __future__ import annotations

from ._admin_info import Info, LeftClaim, Taker, Unreadable
from ._admin_job import (
    ChiefLease,
    JobInfo,
    JobParam,
    JobWorker,
    chief_lease_key,
    delete_job,
    delete_param_versions,
    describe_job,
    parse_worker_counters,
)
from ._admin_ops import check_taker, delete, evict, reset, reset_container, set_step
from ._admin_read import containers_of, describe, list_accumulators, server_info

__all__ = [
    "ChiefLease",
    "Info",
    "JobInfo",
    "JobParam",
    "JobWorker",
    "LeftClaim",
    "Taker",
    "Unreadable",
    "check_taker",
    "chief_lease_key",
    "containers_of",
    "delete",
    "evict",
    "delete_job",
    "delete_param_versions",
    "describe",
    "describe_job",
    "list_accumulators",
    "parse_worker_counters",
    "reset",
    "reset_container",
    "server_info",
    "set_step",
]
