"""The Lua scripts: read once from ``lua/``, registered per client, called by EVALSHA.

redis-py's ``Script`` objects send a ``SCRIPT EXISTS`` before every pipeline ``execute()``
(a second round trip per apply), so scripts are called with plain EVALSHA and loaded only
when the server answers NOSCRIPT (first use, restart, failover).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Generator, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import redis
from redis.exceptions import NoPermissionError, NoScriptError, OutOfMemoryError, ResponseError

from ._direct import execute
from ._errors import (
    AccumulatorError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SchemaVersionError,
    UnavailableError,
    permission_denied,
)
from ._keys import SCHEMAS, parse_state_key
from ._requests import Call, advance

logger = logging.getLogger("accumulator")

#: The accumulators' scripts, registered (:func:`load_commands`) when an accumulator opens. The
#: sync helper's own (``sync_lease``, ``sync_count``: keys of ``accumulator.sync``, not an
#: accumulator's) are called by name too and loaded on first use (NOSCRIPT).
NAMES = ("open", "apply", "withdraw", "fold", "take", "finish", "leave", "set_step", "reset",
         "orphans", "seal", "renew")
ERROR_PREFIX = "ACCERR "


def _lua_dir() -> Path:
    packaged = resources.files("accumulator") / "lua"
    if packaged.is_dir():  # installed wheel
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "lua"  # source checkout / editable install


@cache
def source(name: str) -> bytes:
    """A script's text with the part of the shared prelude it uses in front."""
    folder = _lua_dir()
    body = (folder / f"{name}.lua").read_text()
    return (prelude_for(body, (folder / "_common.lua").read_text()) + "\n" + body).encode()


_LUA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LUA_DEFINES = re.compile(r"local\s+(?:function\s+([A-Za-z_]\w*)|([A-Za-z_][\w\s,]*?)\s*=)")


def prelude_for(body: str, prelude: str) -> str:
    """The definitions of ``prelude`` that ``body`` uses, directly or through one another, in
    the prelude's order (each with the comment above it).

    Redis runs a script's whole text at every call: each ``local function`` of the prelude is
    a closure made (and collected) per call, ~700 instructions of Redis's thread with its
    upvalues (callgrind). The apply script uses nearly all of them; the small scripts
    (``set_step``, ``seal``, ``withdraw``) a third. A definition is a top-level ``local``
    statement; a name is used when it appears as a word in the text (in a comment too:
    keeping one more than needed is harmless).
    """
    lines = prelude.splitlines(keepends=True)
    starts: list[tuple[int, set[str]]] = []  # (first line, names defined) of each definition
    for i, line in enumerate(lines):
        head = _LUA_DEFINES.match(line)
        if head:
            first = i
            while first > 0 and lines[first - 1].startswith("--"):
                first -= 1  # the comment right above goes with it
            names = head.group(1) or head.group(2)
            starts.append((first, {n.strip() for n in names.split(",")}))
    if not starts:
        return prelude
    ends = [first for first, _ in starts[1:]] + [len(lines)]
    head_text = "".join(lines[: starts[0][0]])
    blocks = [(defined, "".join(lines[first:stop]))
              for (first, defined), stop in zip(starts, ends, strict=True)]  # fmt: skip
    needed: set[str] = set()
    words = set(_LUA_NAME.findall(body))
    while True:
        more = set()
        for defined, text in blocks:
            if defined & words and not defined <= needed:
                more |= defined
                words |= set(_LUA_NAME.findall(text))
        if not more:
            break
        needed |= more
    return head_text + "".join(text for defined, text in blocks if defined & needed)


@cache
def sha(name: str) -> str:
    return hashlib.sha1(source(name)).hexdigest()


def evalsha_args(name: str, keys: Sequence[str | bytes], args: Sequence[Any]) -> list[Any]:
    """The EVALSHA command, for use in a pipeline (``pipe.execute_command(*...)``)."""
    return ["EVALSHA", sha(name), len(keys), *keys, *args]


def behind_wait(
    key: str, timeout: float, then: Call | None
) -> tuple[list[Sequence[Any]], Generator[list[Any], Any, Any] | None]:
    """A wait's commands, sent at once (see :class:`~accumulator._requests.Pop`): the BLPOP
    and, behind it, the EVALSHA of ``then``, which Redis runs the moment the wait ends. Also
    ``then``'s :func:`steps` (its first command taken), for :func:`reply_behind`: a script
    call behind a wait is handled as every other one."""
    commands: list[Sequence[Any]] = [("BLPOP", key, timeout)]
    run = None
    if then is not None:
        run = steps(then.name, then.keys, then.args)
        commands.append(next(run))
    return commands, run


def reply_behind(
    run: Generator[list[Any], Any, Any], reply: Any, error: BaseException | None
) -> tuple[bool, Any]:
    """``(True, the script's reply)`` for the reply (or error reply) of the call sent behind
    a wait; ``ACCERR`` and ACL errors raised as ours. ``(False, None)`` when the script needs
    another command (NOSCRIPT: the caller makes the call the ordinary way)."""
    done, value = advance(run, reply, error)
    if done:
        return True, value
    run.close()
    return False, None


def steps(name: str, keys: Sequence[str | bytes], args: Sequence[Any]) -> Generator[
    list[Any], Any, Any
]:
    """Run a script, as commands for a driver to send (``reply = yield command``, its error
    thrown back in): EVALSHA; on NOSCRIPT, SCRIPT LOAD (or, where that is not allowed, EVAL
    with the source); ``ACCERR`` and ACL replies raised as our exceptions."""
    try:
        try:
            return (yield evalsha_args(name, keys, args))
        except NoScriptError:
            try:
                yield ["SCRIPT", "LOAD", source(name)]
            except NoPermissionError:
                return (yield ["EVAL", source(name), len(keys), *keys, *args])
            return (yield evalsha_args(name, keys, args))
    except ResponseError as exc:
        raise_translated(exc, keys[0] if keys else None)


def call(client: redis.Redis, name: str, keys: Sequence[str | bytes], args: Sequence[Any]) -> Any:
    """Run a script on a synchronous client (see :func:`steps`)."""
    run = steps(name, keys, args)
    reply: Any = None
    error: BaseException | None = None
    while True:
        done, command = advance(run, reply, error)
        if done:
            return command
        reply, error = None, None
        try:
            reply = execute(client, *command)
        except ResponseError as exc:
            error = exc


async def acall(
    client: Any, name: str, keys: Sequence[str | bytes], args: Sequence[Any],
    execute: Callable[[Any, Sequence[Any]], Awaitable[Any]] | None = None,
) -> Any:  # fmt: skip
    """Run a script on a ``redis.asyncio`` client (see :func:`steps`)."""
    run = steps(name, keys, args)
    reply: Any = None
    error: BaseException | None = None
    while True:
        done, command = advance(run, reply, error)
        if done:
            return command
        reply, error = None, None
        try:
            reply = await (execute or execute_async)(client, command)
        except ResponseError as exc:
            error = exc


async def execute_async(client: Any, command: Sequence[Any]) -> Any:
    """``await client.execute_command(*command)``; SCRIPT LOAD through ``script_load``, which
    an asyncio cluster client sends to every primary (its ``execute_command`` cannot route
    it)."""
    if tuple(command[:2]) == ("SCRIPT", "LOAD"):
        return await client.script_load(command[2])
    return await client.execute_command(*command)


def load_commands() -> list[tuple[Any, ...]]:
    """The commands that register every accumulator script (see :func:`check_loaded`)."""
    return [("SCRIPT", "LOAD", source(n)) for n in NAMES]


def check_loaded(replies: Sequence[Any]) -> None:
    """Check the replies to :func:`load_commands`. A user not allowed ``SCRIPT LOAD`` is fine
    while the scripts are loaded already (or when it may ``EVAL``): script calls cope with
    NOSCRIPT themselves."""
    for reply in replies:
        if is_no_permission(reply):
            logger.debug("SCRIPT LOAD not allowed (%s); relying on EVALSHA/EVAL", reply)
            return
        if isinstance(reply, Exception):
            raise reply


def is_no_permission(reply: Any) -> bool:
    """Whether a reply is the server's refusal of a command to this user (ACL), as redis-py
    raises it or as ours (the retry loop translates it)."""
    return isinstance(reply, (NoPermissionError, PermissionDeniedError))


#: The texts of a script's command refused by the ACL (Redis 7; they do not name the
#: command): one the user may not run, and one on a key the user may not touch.
_SCRIPT_NOPERM = ("The user executing the script can't run this command",
                  "The user executing the script can't access at least one of the keys")


def raise_translated(exc: Exception, state_key: str | bytes | None = None) -> NoReturn:
    """Raise :func:`translate`'s error for ``exc``, chained to it; ``exc`` itself (as it is)
    when it is not one of ours."""
    error = translate(exc, state_key)
    if error is exc:
        raise exc
    raise error from exc


def _accumulator_of(state_key: str | bytes | None) -> str:
    """``accumulator 'name'`` (and its container) for an accumulator's state key."""
    key = state_key.decode(errors="replace") if isinstance(state_key, bytes) else state_key
    found = parse_state_key(key) if key else None
    if found is None:
        return "the accumulator"
    container, name = found
    return f"accumulator {name!r}" + (f" (container {container!r})" if container else "")


def recreated(state_key: str | bytes | None) -> NotFoundError:
    """The error of a call of an object whose accumulator was deleted and created again since
    it opened it (the instance check: ``check_inst`` in ``lua/_common.lua``)."""
    return NotFoundError(
        f"{_accumulator_of(state_key)} was deleted and created again since this object "
        "opened it: nothing of the new one was read or changed (open it again to use it)"
    )


def translate(exc: Exception, state_key: str | bytes | None = None) -> Exception:
    """Our error for an ``ACCERR``, ACL (NOPERM) or out-of-memory (OOM) reply; any other error
    is returned unchanged. ``state_key``: the script's first key, the state hash of the
    accumulator it ran for (named in the error when it is missing)."""
    text = str(exc)
    idx = text.find(ERROR_PREFIX.strip())
    if idx < 0:
        if (isinstance(exc, NoPermissionError) or text.startswith("NOPERM")
                or any(refusal in text for refusal in _SCRIPT_NOPERM)):  # fmt: skip
            # (a script's read made before its permission checks, refused by the ACL: nothing
            # was written yet)
            return permission_denied(text.split(" script: ")[0])
        if isinstance(exc, OutOfMemoryError) or text.startswith("OOM"):
            full = ResourceExhaustedError(
                f"Redis is out of memory (maxmemory): {text.split(' script: ')[0]} Nothing was "
                "changed: free memory or raise maxmemory (at the limit every write fails, "
                "opening an accumulator included; a waiting take waits on)"
            )
            full.reason = "OOM"  # (a take waits it out: _take.take)
            return full
        return exc
    words = text[idx + len(ERROR_PREFIX) :].split()
    what = words[0] if words else ""
    if what == "NOTFOUND":
        return NotFoundError(f"{_accumulator_of(state_key)} does not exist (deleted, reset, "
                             "expired, or lost with Redis's data)")  # fmt: skip
    if what == "RECREATED":
        return recreated(state_key)
    if what == "SCHEMA":
        have = words[1] if len(words) > 1 else "?"
        return SchemaVersionError(
            f"the accumulator was written with key schema version {have}; this library "
            f"speaks versions {' and '.join(map(str, SCHEMAS))}"
        )
    if what == "NOPERM":
        command = words[1] if len(words) > 1 else "?"
        target = words[2] if len(words) > 2 else "?"
        return PermissionDeniedError(
            f"the Redis user may not run {command} on {target!r}; nothing was changed (see the "
            "README's Security section for what each role needs)"
        )
    if what == "NOBLOB":
        missing = ResourceExhaustedError(
            "the gradient's payload was not stored (Redis at maxmemory, or the key was evicted "
            "or changed; or, spread over slots, its record was lost: swept after an hour, or "
            "by a failover); nothing was applied"
        )
        missing.reason = "NOBLOB"  # (the apply retries a spread payload once: _apply.apply)
        return missing
    if what == "NOMODULE":
        return UnavailableError(
            "this accumulator keeps its sums in Redis, but the server does not run the accsum "
            "module (restarted without it?); nothing was applied. Load it (see the README's "
            "'Large gradients and the Redis module') or delete the accumulator and open it again"
        )
    if what == "STEPMAX":
        return InvalidArgumentError(
            "the global step is at the int64 maximum: a take cannot advance it (set_global_step "
            "lower first)"
        )
    if what == "BADTYPE":
        key, want = (words[1:3] + ["?", "?"])[:2]
        return AccumulatorError(
            f"the accumulator's key {key!r} holds a value of another type than the {want} it "
            "keeps there (a foreign write in its namespace); nothing was changed. Delete that "
            "key, or the accumulator (`accumulator delete`)"
        )
    if what == "BADSTATE":
        return AccumulatorError(
            f"{' '.join(words[1:])} (a foreign write in the accumulator's namespace); nothing was "
            "changed"
        )
    if what in ("BADARG", "BADKEY"):
        return InvalidArgumentError(f"the accumulator script refused its input ({text[idx:]})")
    return AccumulatorError(text[idx:])
