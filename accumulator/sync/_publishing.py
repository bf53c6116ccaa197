"""What a chief publishes: each step's parameter version (its parts, then the switch, fenced
by the chief lease), the versions of earlier chiefs expired, and the seal of a finished job's
accumulators. :class:`~accumulator.sync.ParameterServer` is one (through ``_Resumer``)."""

from __future__ import annotations

import functools
from typing import Any, cast

import numpy as np
from redis.exceptions import AskError, NoScriptError, ResponseError

from .. import _chunks, _fusion, _scripts
from .._codec import reply_text
from .._keys import Keys
from .._requests import Call
from .._routing import is_cluster, raise_slot_moving
from .._stream import write_parts
from .._together import call_step, run_together
from ._job import _Job, accumulator_name
from ._lease import _ChiefLease
from ._published import (
    ANNOUNCE_BYTES,
    encode_announcement,
    encode_published,
    unit_bytes,
    unit_nbytes,
)

#: How long the parts of the previous parameter version stay readable at most (a reader
#: may be in the middle of them; the next publish deletes them sooner); after that it reads
#: the newer version.
_OLD_VERSION_MS = 60 * 1000


class _Publisher(_Job):
    """A chief's publishing: the state it reads is set by ``ParameterServer.__init__``."""

    replicas_to_aggregate: int
    reduction_type: str
    _lease: _ChiefLease
    _params: dict[str, np.ndarray]
    _step: int | None
    _run: str
    #: (run, step, tenure) of the parameters this chief last published or resumed from
    _published_version: tuple[str, int, str] | None
    #: the version published before that one (deleted when a newer one is published)
    _older_version: tuple[str, int, str] | None

    def _expire_other_versions(self) -> None:
        """Every parameter version but the published one expires within a minute (a reader
        may be in one): those of chiefs before this one, which no publish of this chief
        names. A chief killed between writing a version's parts and its switch left them
        without expiry (under its tenure: nobody writes them again), and a crash-looping
        chief's versions would pile up (each restart kept its predecessor's previous one)."""
        assert self._published_version is not None
        current = set(self._version_keys(*self._published_version))

        def expire() -> None:
            found = [key for key in self.redis.scan_iter(match=self.keys.versions_pattern,
                                                         count=1000)
                     if reply_text(key) not in current]  # fmt: skip
            for i in range(0, len(found), 500):
                batch = found[i : i + 500]
                pipe = self.redis.pipeline(transaction=False)
                for key in batch:
                    pipe.pttl(key)
                lasting = [key for key, ttl in zip(batch, pipe.execute(), strict=True)
                           if ttl == -1]  # (the others expire already)  # fmt: skip
                pipe = self.redis.pipeline(transaction=False)
                for key in lasting:
                    pipe.pexpire(key, _OLD_VERSION_MS)
                pipe.execute()

        self._io("expiring the versions of earlier chiefs", expire)

    def _publish(self, *, meta: bool = False, done: bool = False) -> None:
        # The version's keys carry this chief's tenure: a chief that lost its lease (paused,
        # cut off) and writes its parts late writes none of the next chief's, even at the
        # same (run, step); its switch is refused and deletes them. The first publish of a
        # tenure writes the metadata too (a job resumed from an earlier version's names its
        # parts without tenure: its readers must know the new names).
        run, step, tenure = self._run, cast(int, self._step), self._lease.tenure
        meta = meta or self._published_version is None or self._published_version[2] != tenure
        mapping = encode_published(
            run, step, done, self._specs,
            (self.replicas_to_aggregate, self.reduction_type, self._fusion) if meta else None,
            tenure,
        )  # fmt: skip
        parts = []  # one buffer per unit of the job's layout (a fused bucket's packed)
        for j, unit in enumerate(self._units):
            data = unit_bytes(unit, self._params)
            parts.append((self.keys.param_parts(run, step, j, data.nbytes, tenure), data))
        version = (run, step, tenure)
        previous, older = self._published_version, self._older_version
        old_keys = [] if previous in (None, version) else self._version_keys(*previous)
        # the version before the previous one: a reader still in it reads the newest again
        stale = older if old_keys and older not in (None, version, previous) else None
        stale_keys = [] if stale is None else self._version_keys(*stale)

        # The switch is the lease script's ``publish``: the lease renewed and, only while this
        # chief holds it, the hash switched to the new version, in one atomic step (no chief
        # ever publishes over another, not even one that took over a moment ago).
        cluster = is_cluster(self.redis)
        new_keys = [key for keys, _ in parts for key in keys]
        nbytes = sum(data.nbytes for _, data in parts)
        # tiny models travel in the announcement too: a waiting worker needs no read
        announcement = encode_announcement(
            run, step, done, [data for _, data in parts] if nbytes <= ANNOUNCE_BYTES else None
        )
        lease_keys, lease_args = self._lease.publish_call(
            self.keys.params, new_keys, old_keys, stale_keys,
            "" if cluster else self.keys.channel, announcement, _OLD_VERSION_MS, mapping,
        )  # fmt: skip
        # Small parameters (one part in all: up to 1 MiB, as an apply's payload) go in the
        # MULTI of the switch: one round trip, and a part refused (maxmemory) aborts the
        # whole publish.
        small = nbytes <= _chunks.SOLE_PART_BYTES

        def switch(script: list[Any]) -> list[Any]:
            pipe = self.redis.pipeline(transaction=True)
            if small:
                for keys, data in parts:
                    write_parts(pipe, keys, data)
            pipe.execute_command(*script)
            try:
                return list(pipe.execute()[-1])
            except AskError as exc:  # (a cluster's transaction, its slot being migrated)
                raise_slot_moving(self.redis, exc)
            except ResponseError as exc:  # NOSCRIPT comes through as it is
                _scripts.raise_translated(exc)

        sent: list[bool] = []  # whether an attempt was made (its switch may have landed)

        def publish() -> list[Any]:
            # The new version's parts first (one chunk per command), then the switch: readers
            # see either the old step and parameters or the new ones. The previous version
            # stays readable until the next publish, a minute at most (a reader may be in
            # the middle of it); the one before it is deleted in the switch. Sent again
            # after a fault, it writes the same values, unless the switch of an attempt
            # whose reply was lost is in: then it is done (writing the parts again would
            # take away the expiry a successor's publish gave them since, for good).
            if sent:
                named = self.redis.hmget(self.keys.params, ["run", "step", "ten"])
                if [reply_text(v) for v in named] == [run, str(step), tenure]:
                    return [1, ""]
            sent.append(True)
            if not small:
                pipe = self.redis.pipeline(transaction=False)
                for keys, data in parts:
                    write_parts(pipe, keys, data)
                try:
                    pipe.execute()
                except ResponseError as exc:  # maxmemory, ACL: ours, as every other refusal
                    _scripts.raise_translated(exc)
            try:
                reply = switch(_scripts.evalsha_args("sync_lease", lease_keys, lease_args))
            except NoScriptError:  # not loaded (a restarted server): the source itself
                reply = switch(["EVAL", _scripts.source("sync_lease"), len(lease_keys),
                                *lease_keys, *lease_args])  # fmt: skip
            if cluster and int(reply[0]) == 1:
                # a cluster transaction carries no PUBLISH: the hint follows it
                self.redis.publish(self.keys.channel, announcement)
            return reply

        self._lease.settle(self._io("publishing", publish))
        if old_keys:
            self._older_version = previous
        self._published_version = version

    def _version_keys(self, run: str, step: int, tenure: str) -> list[str]:
        """Every part key of the parameters as published at (run, step) by ``tenure``."""
        return [key for j, unit in enumerate(self._units)
                for key in self.keys.param_parts(run, step, j, unit_nbytes(unit),
                                                 tenure)]  # fmt: skip

    def _seal(self) -> None:
        """Seal every accumulator of the finished job (``lua/seal.lua``, in one round trip):
        from now on an apply that is not stale is refused, so a worker that pushes before
        it has seen the end gets :class:`TrainingFinished` and applies nothing."""
        calls = [(acc, call_step(Call("sealing the finished job's accumulators", "seal",
                                      [acc._keys.state], [acc._schema, self._step, acc._instance])))
                 for acc in self._accs.values()]  # fmt: skip
        failed = next((value for ok, value in run_together(calls) if not ok), None)
        if failed is not None:
            raise failed

    def _seal_stored(self, units: list[_fusion.Unit], step: int) -> None:
        """Seal the job's accumulators that exist, without opening them (that would create a
        deleted one again): their schemas in one pipeline, then ``lua/seal.lua`` each."""
        states = [Keys(self.container, accumulator_name(self.job, u.name)).state for u in units]

        def schemas() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for state in states:
                pipe.hget(state, "schema")
            return pipe.execute()

        for state, schema in zip(states, self._io("reading the accumulators", schemas),
                                 strict=True):  # fmt: skip
            if schema is not None:
                seal = functools.partial(_scripts.call, self.redis, "seal", [state], [schema, step])
                self._io("sealing the finished job's accumulators", seal)
