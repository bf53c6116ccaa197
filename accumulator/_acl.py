"""The Redis ACL rules of the three roles the README's "Security" section documents.

Each is exactly what the library needs, no more: the commands its scripts and clients send,
on its own keys and channels only. The tests create real users with these rules and run the
dense and sparse accumulators, the sync helper and the CLI with them; the README shows them
verbatim (a test checks that too).

- ``worker``: apply gradients and take them (a chief using the raw API); private
  accumulators included.
- ``viewer``: the read-only CLI commands ``ls``, ``show`` and ``watch``.
- ``sync``: a job of ``accumulator.sync`` (chief and workers): a worker's rights plus the
  job's own keys (``accsync:*``) and the admin calls the chief makes on its accumulators.
"""

from __future__ import annotations

from ._keys import DEFAULT_PREFIX, SYNC_PREFIX, Keys

_CONNECTION = "+ping +hello +select"  # redis-py tolerates a refused CLIENT SETINFO
# What the scripts (lua/) call, and what the client sends around them.
_WORKER = (
    "+evalsha +eval +script|load +time "
    "+get +set +mget +del +unlink +exists +strlen +pexpire +persist +rename "
    "+hget +hmget +hgetall +hset +hsetnx +hdel +hincrby "
    "+rpush +lpush +lpop +lrange +lpos +lindex +lset +lrem +ltrim +blpop "
    "+zadd +zrem +zremrangebyscore +zrange +zrangebyscore +zscore +zcard "
    "+publish +subscribe +unsubscribe"
)
_VIEWER = (
    "+scan +type +hgetall +hmget +zrange +zcard +lrange +llen +pttl +exists +strlen +time "
    "+multi +exec +memory|usage +info"
)


def _rules(keys: str, channels: str, commands: str) -> str:
    parts = ["resetkeys", keys, "resetchannels", channels, "-@all", _CONNECTION, commands]
    return " ".join(p for p in parts if p)


#: role -> the ACL rules after ``ACL SETUSER <name> on ><password>``.
ROLES: dict[str, str] = {
    "worker": _rules(f"~{DEFAULT_PREFIX}:*", f"&{DEFAULT_PREFIX}:*", _WORKER),
    "viewer": _rules(f"%R~{DEFAULT_PREFIX}:*", "", _VIEWER),
    "sync": _rules(
        f"~{DEFAULT_PREFIX}:* ~{SYNC_PREFIX}:*",
        f"&{DEFAULT_PREFIX}:* &{SYNC_PREFIX}:*",
        _WORKER + " +multi +exec +scan",
    ),
}


#: What the worker and sync roles also need on a server running the accsum module (an ACL
#: rule naming a command the server does not know is refused, so these are apart).
MODULE_RULES = "+acc.add +acc.ping"


#: What every role also needs on a Redis Cluster: redis-py's cluster client reads the slot
#: map (CLUSTER SLOTS, on start and after a MOVED) and the commands' key positions (COMMAND),
#: and follows a slot migration's ASK redirects (ASKING). Set the user on every node.
CLUSTER_RULES = "+cluster|slots +cluster|shards +command +asking"


def scoped_rules(role: str, container: str) -> str:
    """A role's rules with its keys and channels narrowed to one container's: a team given
    its own container (every accumulator, private ones and sync jobs included, opened with
    ``container=``) cannot read or change another's. Raises ValueError for a container
    holding whitespace (it would split the rule)."""
    if any(ch.isspace() for ch in container):
        raise ValueError(f"a container scoped by an ACL rule holds no whitespace: {container!r}")
    rules = ROLES[role]
    for prefix in (DEFAULT_PREFIX, SYNC_PREFIX):
        # (the pattern of every key of the container's, spread parts included)
        scope = Keys(container, "", prefix).family_pattern
        for sigil in ("~", "%R~", "&"):
            rules = rules.replace(f" {sigil}{prefix}:* ", f" {sigil}{scope} ")
    return rules


def setuser_command(
    role: str, user: str = "", password: str = "PASSWORD", *, module: bool = False,
    cluster: bool = False, container: str | None = None,
) -> str:  # fmt: skip
    """The ``ACL SETUSER`` line for a role, as the README prints it; ``module`` adds what a
    server running the accsum module needs (worker and sync roles), ``cluster`` what a Redis
    Cluster's clients need, ``container`` narrows it to one container (:func:`scoped_rules`)."""
    rules = ROLES[role] if container is None else scoped_rules(role, container)
    rules += f" {MODULE_RULES}" if module and role != "viewer" else ""
    rules += f" {CLUSTER_RULES}" if cluster else ""
    return f"ACL SETUSER {user or 'acc-' + role} on >{password} {rules}"
