"""The key schema: the one place that names every Redis key of an accumulator.

All keys of one accumulator share one hash tag, ``{<container>:<shared_name>}``, so that a
Redis Cluster keeps them in one slot and a script may touch them together. Every script gets
all the keys it touches in KEYS and checks :data:`SCHEMA_VERSION` against the state hash.

=====================  ======  ==============================================================
key                    type    contents
=====================  ======  ==============================================================
``P{tag}:s``           hash    state: ``schema`` (2; 3: parts spread over slots), ``def``
                               (msgpack definition), ``step``, ``count``, ``rshape``
                               (round shape, absent = none), ``gen`` (number of
                               takes/resets), ``tseq`` (taker join counter),
                               ``sum`` (the accsum module's dtype when sums are kept in
                               Redis, set at creation; absent: the taker sums),
                               ``bytes`` (payload bytes held), ``ttl`` (ms, private only),
                               ``sealed`` (the final step of the ``accumulator.sync`` job
                               it belongs to, once that finished: ``lua/seal.lua``),
                               statistics ``n_applied``, ``n_stale``, ``stale_steps``,
                               ``max_stale``, ``n_rejected``, ``n_taken``, ``last_take_ms``,
                               ``last_take_wait_ms``, ``created_ms``
``P{tag}:g``           list    the current round's gradients in apply order; each entry is
                               ``b"i" + payload`` (small, inline), ``b"p<parts> " + blob``
                               (large: in parts, see below), ``b"s<w> <parts> " + blob``
                               (the running sum of ``w`` gradients, kept by the accsum
                               module: parts as for ``p``), ``b"f<k> <parts> " + blob`` (a
                               gradient being folded into that sum: parts ``0..k-1`` are in
                               it, the others still its own), ``b"d<parts> " + blob``
                               (large, in parts spread over slots: schema 3) or
                               ``b"k" + blob key`` (one key, written by schema 1 clients;
                               still read)
``P{tag}:b:<cid>:<n>:<i>`` string  part ``i`` of a large gradient payload (raw little-endian
                               bytes): every part but the last is exactly
                               :data:`accumulator._chunks.CHUNK_BYTES` long
``P{tag%p<i>}:b:<cid>:<n>:<i>``
                       string  part ``i`` of a payload *spread over slots* (entry
                               ``b"d<parts> " + blob``, schema 3, see :meth:`Keys.spread_part`):
                               its own hash tag per part index, so a Redis Cluster keeps one
                               accumulator's parts on every primary; no script touches them
``P{tag}:o``           zset    spread payloads whose parts may have to be deleted: ``<entry>``
                               registered by an apply before it writes the parts (scored by
                               when the registration runs out, an hour on), and ``x<entry>``
                               garbage (dropped, taken, quarantined: scored by when a sweeper
                               may delete its parts; a sweeper leases it for a minute)
``P{tag}:d:<cid>``     string  last apply of client ``cid`` (retry dedup): ``"<seq>"`` if
                               accepted, ``"<seq> 0"`` if dropped as stale
``P{tag}:t``           zset    waiting takers, scored by join order (the FIFO)
``P{tag}:ti``          hash    taker id -> ``"<num_required> <lease expiry ms> <joined ms>"``
``P{tag}:w``           list    wake-up token (at most one) for the head taker
``P{tag}:q``           channel pub/sub: the head of the FIFO changed (queued takers
                               re-check); a channel name, never a stored key
``P{tag}:c:<taker>``   list    a claimed round: a header, then the entries of ``:g``; kept
                               until the taker has read it (a retried take returns it again;
                               a take that fails gives it back)
``P{tag}:cl``          hash    claim registry: taker id -> lease expiry ms of its claim, for
                               the claims in flight; a lease that ran out marks a taker that
                               is gone: the next take hands its round over (earlier clients
                               also kept ``done <ms>`` marks here; takes prune them)
``P{tag}:cd``          zset    finished takes: taker id scored by finish time ms, kept 2 min
                               (the key expires 2 min after the last finish) to answer a
                               retried finish
``P{tag}:x``           list    quarantine: entries a take refused to claim (a foreign key name,
                               a missing or resized payload), each ``"<reason> <entry>"``
=====================  ======  ==============================================================

Only the library's own key names are ever read or deleted: an entry of ``:g`` (or of a claim)
that names anything but a blob key of this very accumulator (``P{tag}:b:<hex>:<digits>``) is
quarantined by the take script and ignored by ``reset``/``delete``, never followed. A tenant
allowed to write ``acc:*`` can corrupt an accumulator, but cannot make a chief or an admin
read or delete a key outside it.

``P`` is the prefix (default ``acc``). The sync helper's keys (``accsync:{tag}:*``) are at the
end of this file (:class:`SyncKeys`). Payload formats: dense = the array's bytes in the
accumulator dtype, C order, little-endian; sparse = int64 indices then values, same rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

#: 2: large payloads in parts (``p`` entries), which schema 1 clients cannot read.
SCHEMA_VERSION = 2
#: 3: an accumulator whose large payloads are spread over slots (``d`` entries, decided at
#: creation): clients that speak only 2 refuse it rather than quarantine what they cannot
#: read. This library speaks both.
SPREAD_SCHEMA = 3
SCHEMAS = (SCHEMA_VERSION, SPREAD_SCHEMA)
DEFAULT_PREFIX = "acc"
MAX_PARTS = 1 << 20  # parts of one payload (~1 TiB): the scripts' bound too

_ESCAPES_NAME = {"%": "%25", "{": "%7B", "}": "%7D"}
_ESCAPES_CONTAINER = {**_ESCAPES_NAME, ":": "%3A"}


def _escape(text: str, table: dict[str, str]) -> str:
    return "".join(table.get(ch, ch) for ch in text)


def _unescape(text: str) -> str:
    from urllib.parse import unquote

    return unquote(text)


def hash_tag(container: str, shared_name: str) -> str:
    """``{container:shared_name}`` with braces escaped, so any name keeps exactly one tag."""
    inner = _escape(container, _ESCAPES_CONTAINER) + ":" + _escape(shared_name, _ESCAPES_NAME)
    return "{" + inner + "}"


def parse_state_key(key: str, prefix: str = DEFAULT_PREFIX) -> tuple[str, str] | None:
    """Inverse of :meth:`Keys.state` for SCAN results: ``(container, shared_name)`` or None."""
    head = prefix + ":{"
    if not (key.startswith(head) and key.endswith("}:s")):
        return None
    inner = key[len(head) : -len("}:s")]
    container, sep, name = inner.partition(":")
    if not sep:
        return None
    return _unescape(container), _unescape(name)


def state_pattern(container: str | None = None, prefix: str = DEFAULT_PREFIX) -> str:
    """SCAN MATCH pattern for the state keys of every accumulator (of one container)."""
    if container is None:
        return prefix + ":{*}:s"
    glob_safe = _escape(container, _ESCAPES_CONTAINER)
    for ch in "\\*?[]":  # backslash first, or its own escapes get doubled
        glob_safe = glob_safe.replace(ch, "\\" + ch)
    return prefix + ":{" + glob_safe + ":*}:s"


@dataclass(frozen=True)
class Keys:
    """Key names of one accumulator (computed once: they are on every hot path)."""

    container: str
    shared_name: str
    prefix: str = DEFAULT_PREFIX

    @cached_property
    def base(self) -> str:
        return self.prefix + ":" + hash_tag(self.container, self.shared_name)

    @cached_property
    def state(self) -> str:
        return self.base + ":s"

    @cached_property
    def grads(self) -> str:
        return self.base + ":g"

    @cached_property
    def takers(self) -> str:
        return self.base + ":t"

    @cached_property
    def taker_info(self) -> str:
        return self.base + ":ti"

    @cached_property
    def wake(self) -> str:
        return self.base + ":w"

    @cached_property
    def queue_wake(self) -> str:
        return self.base + ":q"

    @cached_property
    def idle(self) -> str:
        """A list nobody writes: a take waiting out maxmemory blocks on it (BLPOP)."""
        return self.base + ":z"

    @cached_property
    def quarantine(self) -> str:
        return self.base + ":x"

    @cached_property
    def claims(self) -> str:
        return self.base + ":cl"

    @cached_property
    def finished(self) -> str:
        return self.base + ":cd"

    @cached_property
    def orphans(self) -> str:
        return self.base + ":o"

    @cached_property
    def fixed(self) -> tuple[str, ...]:
        """The keys with fixed names (and the wake-up channel's name), the state first: a
        delete that unlinks it first has every script answer NOTFOUND from then on."""
        return (self.state, self.grads, self.takers, self.taker_info, self.wake,
                self.queue_wake, self.quarantine, self.claims, self.finished, self.orphans)

    @cached_property
    def spread_head(self) -> bytes:
        """How every spread part's key begins: the tag's inner text, then ``%p`` (escaped
        names never hold ``%`` before a non-hex digit, so no accumulator's own tag can equal
        a spread part's)."""
        return self.base[:-1].encode() + b"%p"

    @cached_property
    def spread_pattern(self) -> str:
        """SCAN MATCH pattern for every spread part of this accumulator (scan every node)."""
        return glob_escape(self.spread_head.decode()) + "*"

    @cached_property
    def family_pattern(self) -> str:
        """SCAN MATCH pattern for every key of this accumulator and its spread parts, in one
        scan (it also matches names that begin with this one: filter with :meth:`owns`)."""
        return glob_escape(self.base[:-1]) + "*"

    def owns(self, key: bytes) -> bool:
        """Whether a key found by :attr:`family_pattern` is this accumulator's (a key of its
        slot or a spread part), not one of a longer name's."""
        return key.startswith(self._own_head) or key.startswith(self.spread_head)

    @cached_property
    def _own_head(self) -> bytes:
        return self.base.encode() + b":"

    def spread_part(self, blob: str | bytes, index: int) -> bytes:
        """Key of part ``index`` of the spread payload ``blob`` (a blob key of this
        accumulator): ``P{tag%p<index>}:b:<cid>:<seq>:<index>``, hashed apart from the
        accumulator's other keys."""
        raw = blob.encode() if isinstance(blob, str) else blob
        tail = raw[len(self.base) :]  # b":b:<cid>:<seq>"
        return self.spread_head + b"%d}" % index + tail + b":%d" % index

    def blob(self, client_id: str, seq: int) -> str:
        return f"{self.base}:b:{client_id}:{seq}"

    @cached_property
    def _blob_re(self) -> re.Pattern[bytes]:
        return re.compile(re.escape(self.base.encode()) + rb":b:[0-9a-fA-F]+:[0-9]+\Z")

    @cached_property
    def _part_re(self) -> re.Pattern[bytes]:
        return re.compile(re.escape(self.base.encode()) + rb":b:[0-9a-fA-F]+:[0-9]+:[0-9]+\Z")

    @staticmethod
    def is_spread(entry: bytes) -> bool:
        """Whether a round entry is a payload spread over slots (``b"d<parts> <blob>"``)."""
        return entry[:1] == b"d"

    def orphan_parts(self, members: list[bytes]) -> list[bytes]:
        """The part keys of the spread payloads that members of the orphans zset name
        (``x<entry>`` garbage or ``<entry>`` registrations); anything else is untrusted input
        and names nothing."""
        entries = [m[1:] if m[:1] == b"x" else m for m in members]
        return [key for e in entries if self.is_spread(e) for key in self.entry_keys(e) or ()]

    def spread_entry(self, blob: str, nbytes: int) -> bytes:
        """The round entry of a spread payload of ``nbytes`` written under ``blob``."""
        from ._chunks import n_parts

        return b"d%d " % n_parts(nbytes) + blob.encode()

    def is_blob(self, key: bytes | str) -> bool:
        """True for a payload key (or payload part) of this accumulator, in exactly the form
        the library writes (the Python twin of the scripts' check): round entries are
        untrusted input."""
        raw = key.encode() if isinstance(key, str) else key
        return self._blob_re.match(raw) is not None or self._part_re.match(raw) is not None

    def part(self, blob: str | bytes, index: int) -> bytes:
        """Key of part ``index`` of the large payload ``blob``."""
        raw = blob.encode() if isinstance(blob, str) else blob
        return raw + b":%d" % index

    @staticmethod
    def entry_weight(entry: bytes) -> int:
        """How many gradients a round entry holds (a running sum holds several)."""
        if entry[:1] != b"s":
            return 1
        head = entry[1:].partition(b" ")[0]
        return int(head) if head.isdigit() else 1

    def payload_keys(self, entries: list[bytes]) -> list[bytes]:
        """Every payload key the given round entries name; entries naming anything but this
        accumulator's own payload keys are skipped (untrusted input, never followed)."""
        return [key for e in entries for key in (self.entry_keys(e) or ())]

    def entry_keys(self, entry: bytes) -> list[bytes] | None:
        """The payload keys a round entry names, in order (``[]`` for an inline payload), or
        None when it names anything but this accumulator's own payload keys (the twin of
        ``entry_keys`` in ``lua/_common.lua``, which gives ``[]`` for a spread entry: no
        script touches other slots)."""
        kind = entry[:1]
        if kind == b"i":
            return []
        if kind == b"d":  # b"d<parts> <blob>": spread over slots
            head, _, blob = entry[1:].partition(b" ")
            if not (head.isdigit() and head[:1] != b"0" and len(head) <= 7):
                return None
            if int(head) > MAX_PARTS or not self._blob_re.match(blob):
                return None
            return [self.spread_part(blob, i) for i in range(int(head))]
        if kind == b"k":
            return [entry[1:]] if self._blob_re.match(entry[1:]) else None
        first = 0
        if kind in (b"s", b"f"):  # b"s<weight> <parts> <blob>", b"f<first> <parts> <blob>"
            lead, _, entry = entry[1:].partition(b" ")
            longest = 9 if kind == b"s" else 7
            if not (lead.isdigit() and lead[:1] != b"0" and len(lead) <= longest):
                return None
            first = int(lead) if kind == b"f" else 0
            kind = b"p"
            entry = b"p" + entry
        if kind == b"p":
            head, _, blob = entry[1:].partition(b" ")
            if not (head.isdigit() and head[:1] != b"0" and len(head) <= 7):
                return None
            n = int(head)
            if n > MAX_PARTS or first >= n or not self._blob_re.match(blob):
                return None
            return [self.part(blob, i) for i in range(first, n)]
        return None

    @staticmethod
    def entry_first_part(entry: bytes) -> int:
        """The first part a round entry still holds itself: ``k`` of a gradient being folded
        into the round's sum (``b"f<k> <parts> <blob>"``, parts ``0..k-1`` are in the sum),
        0 for every other entry."""
        if entry[:1] != b"f":
            return 0
        head = entry[1:].partition(b" ")[0]
        return int(head) if head.isdigit() else 0

    def dedup(self, client_id: str) -> str:
        return f"{self.base}:d:{client_id}"

    def claim(self, taker_id: str) -> str:
        return f"{self.base}:c:{taker_id}"

    @cached_property
    def pattern(self) -> str:
        """SCAN MATCH pattern for every key of this accumulator (for delete and inspection)."""
        return glob_escape(self.base) + ":*"


def glob_escape(text: str) -> str:
    """``text`` as a literal inside a SCAN MATCH pattern."""
    for ch in "\\*?[]":  # backslash first, or its own escapes get doubled
        text = text.replace(ch, "\\" + ch)
    return text


def is_done_mark(value: bytes | str) -> bool:
    """A claim registry value (``P{tag}:cl``) that marks a finished take, not a live lease."""
    return (value.encode() if isinstance(value, str) else value).startswith(b"done")


#: Key prefix of the sync helper's own keys (``accumulator.sync``): not ``acc``, so nothing
#: that scans or deletes accumulators (the CLI, ``reset_container``) mistakes them for an
#: accumulator's keys. ``reset_container`` leaves them alone; ``ParameterServer.delete()``
#: removes a job's.
SYNC_PREFIX = "accsync"


@dataclass(frozen=True)
class SyncKeys:
    """Key names of one sync job. Every key carries the job's hash tag (a Redis Cluster keeps
    them in one slot, so a MULTI may touch them together).

    =========================  =======  ======================================================
    key                        type     contents
    =========================  =======  ======================================================
    ``accsync:{tag}:p``         hash     the published state: ``run`` (id of this job's
                                        initialization), ``step``, ``ten`` (the publishing
                                        chief's tenure, see below), ``done`` (0/1) and
                                        ``meta`` (msgpack: parameter specs, reduction,
                                        replicas)
    ``accsync:{tag}:v:<run>.<ten>:<step>:<j>:<i>``
                                string   part ``i`` of parameter ``j`` (in the specs' order)
                                        as published at (run, step) by the chief of tenure
                                        ``ten`` (a job published by an earlier version:
                                        ``v:<run>:<step>:...``): raw little-endian bytes,
                                        C order, in parts of one chunk; the previous version
                                        expires a minute after a newer one is published
    ``accsync:{tag}:st``        hash     push counters: ``pushes``, ``partial``, ``stale``
                                        and per worker ``w:<id>:pushes|partial|stale``,
                                        ``w:<id>:seen_ms`` (server time of its last push) and
                                        ``w:<id>:push`` and ``w:<id>:push_as`` (id of its
                                        last counted push and the outcome it is counted as:
                                        a retried count is counted once, an amended one
                                        moves); written by ``lua/sync_count.lua``
    ``accsync:{tag}:ch``        channel  pub/sub: an announcement after every publish:
                                        ``"<step>"``, or for parameters of 16 KiB at most
                                        (``sync._published.ANNOUNCE_BYTES``) msgpack
                                        ``["p1", run, step, done, [bytes per parameter]]``
    ``accsync:{tag}:chief``     hash     the chief lease (one chief per job): ``id``,
                                        ``tenure`` (a token of its acquire), ``host``,
                                        ``pid``, ``since_ms``, ``renewed_ms``,
                                        ``expires_ms`` (server time); kept an hour past its
                                        expiry (``accumulator job`` shows a dead chief);
                                        written by ``lua/sync_lease.lua``; the name is
                                        :func:`accumulator.sync.chief_key`
    =========================  =======  ======================================================
    """

    container: str
    job: str
    prefix: str = SYNC_PREFIX

    @cached_property
    def base(self) -> str:
        """The common prefix of the job's keys (its hash tag included)."""
        return self.prefix + ":" + hash_tag(self.container, self.job)

    @property
    def params(self) -> str:
        """The hash of the published parameters' metadata (run, step, done flag, specs)."""
        return self.base + ":p"

    @property
    def stats(self) -> str:
        """The hash of the job's push counts per worker."""
        return self.base + ":st"

    @property
    def channel(self) -> str:
        """The pub/sub channel a publish announces itself on."""
        return self.base + ":ch"

    @property
    def versions_pattern(self) -> str:
        """SCAN MATCH pattern for the parts of every published parameter version."""
        return glob_escape(self.base) + ":v:*"

    def param_parts(
        self, run: str, step: int, index: int, nbytes: int, tenure: str = ""
    ) -> list[str]:
        """The keys of parameter ``index`` (of ``nbytes``) as published at (run, step) by the
        chief of ``tenure`` (none: a job published before tenures)."""
        from ._chunks import n_parts

        head = f"{self.base}:v:{run}{'.' + tenure if tenure else ''}:{step}:{index}:"
        return [head + str(i) for i in range(n_parts(nbytes))]
