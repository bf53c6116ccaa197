"""The optional Redis module (``accumulator/module/accsum.c``): where its source is, building
it with the C compiler at hand (cached by content), and asking a server whether it runs it.

With the module loaded, a dense accumulator of a dtype it covers keeps each round's running
sum inside Redis (one gradient of memory however many applies, the taker reads one gradient):
see ``lua/apply.lua``. Without it (managed Redis cannot load modules), the taker sums.

    python -m accumulator module build     # prints the path of the built .so
    redis-server --loadmodule "$(python -m accumulator module build)"
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("accumulator")

#: The module's name in ``MODULE LIST`` and its probe command.
MODULE_NAME = "accsum"
PING_COMMAND = "ACC.PING"

#: numpy dtype -> the module's dtype name. Others (float16, bfloat16, complex, bool) are summed
#: by the taker.
_DTYPES = {
    "float32": "f32", "float64": "f64", "int8": "i8", "uint8": "u8", "int16": "i16",
    "uint16": "u16", "int32": "i32", "uint32": "u32", "int64": "i64", "uint64": "u64",
}  # fmt: skip

#: The build's flags. Not -Werror: a warning a newer compiler finds must not turn the
#: module off for its users (the tests' sanitizer build adds it, and so finds them).
_FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-Wall", "-Wextra"]
_SANITIZE = ["-Werror", "-fsanitize=address,undefined", "-g", "-fno-omit-frame-pointer"]


def module_dtype(dtype: np.dtype) -> str | None:
    """The module's name for ``dtype``, or None when the module does not add it."""
    if sys.byteorder != "little":
        return None
    return _DTYPES.get(np.dtype(dtype).name)


def source() -> bytes:
    """The module's C source."""
    return (resources.files("accumulator") / "module" / "accsum.c").read_bytes()


def cache_dir() -> Path:
    """Where builds are kept: ``$XDG_CACHE_HOME/redis-accumulator`` (``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "redis-accumulator"


def _private_temp_dir() -> tuple[Path, str | None]:
    """A build directory of this user's under the temporary directory, for when the cache
    directory cannot be written (a read-only or missing home: containers, ``nobody``), and
    why it cannot be used (None: it can): it cannot be made, or is not this user's alone (on
    a shared /tmp, a directory another user made or can write could hand Redis their shared
    object to load)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    path = Path(tempfile.gettempdir()) / f"redis-accumulator-{uid if uid is not None else 'user'}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        return path, str(exc)
    if (not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o022
            or (uid is not None and info.st_uid != uid)):  # fmt: skip
        return path, "not a directory of this user's alone: others could write into it"
    return path, None


def find_compiler() -> list[str] | None:
    """A C compiler's command: ``$CC`` (which may hold arguments: ``ccache gcc``), else cc,
    gcc or clang on the PATH."""
    for command in (os.environ.get("CC"), "cc", "gcc", "clang"):
        words = shlex.split(command) if command else []
        if words and shutil.which(words[0]):
            return words
    return None


@functools.cache
def _compiler_identity(command: tuple[str, ...]) -> str:
    """What a build is cached by besides source and flags: the compiler's resolved path and
    its ``--version`` (another compiler, or the same one upgraded, builds anew)."""
    path = os.path.realpath(shutil.which(command[0]) or command[0])
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True,
                                 timeout=60, check=False).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        version = ""
    return " ".join([path, *command[1:], version])


#: Builds that failed in this process (no compiler, or the compiler refused), and why: not
#: tried, nor logged, again (each server start of a test session logged the same line:
#: new-user review).
_failed: dict[tuple[str, ...], str] = {}


class BuildFailed(Exception):
    """Why :func:`build` built nothing (raised inside, logged by :func:`build`)."""


def build(*, sanitize: bool = False, out_dir: Path | None = None) -> Path | None:
    """Build the module (once per source, compiler flags and ``sanitize``) and return the
    path of the shared object; None, with one log line per process, when no C compiler is
    present or it fails. ``sanitize`` adds ``-fsanitize=address,undefined`` (for the
    tests)."""
    key = _build_key(sanitize, out_dir)
    if key in _failed:
        return None
    try:
        return _build(sanitize=sanitize, out_dir=out_dir)
    except BuildFailed as exc:
        _failed[key] = str(exc)
        logger.warning("%s: takes sum on the client instead", exc)
        return None


def why_not_built(*, sanitize: bool = False, out_dir: Path | None = None) -> str | None:
    """Why the last :func:`build` with these arguments built nothing (None: it did, or was
    not tried)."""
    return _failed.get(_build_key(sanitize, out_dir))


def _build_key(sanitize: bool, out_dir: Path | None) -> tuple[str, ...]:
    return (str(out_dir or cache_dir()), str(sanitize), os.environ.get("CC", ""),
            os.environ.get("PATH", ""))  # fmt: skip


def _build(*, sanitize: bool, out_dir: Path | None) -> Path:
    where = out_dir or cache_dir()
    try:
        return _build_in(where, sanitize)
    except _Unwritable as exc:
        failed = f"the accumulator's Redis module could not be built in {where} ({exc})"
        if out_dir is not None:  # (a directory the caller chose: no other)
            raise BuildFailed(failed) from None
        fallback, unusable = _private_temp_dir()
        if unusable is None:
            logger.info("cannot write %s (%s): building the module in %s", where, exc, fallback)
            try:
                return _build_in(fallback, sanitize)
            except _Unwritable as again:
                unusable = str(again)
        raise BuildFailed(f"{failed}, nor in {fallback} ({unusable})") from None


class _Unwritable(Exception):
    """The build directory cannot be made or written."""


def _build_in(where: Path, sanitize: bool) -> Path:
    src = source()
    suffix = "-asan" if sanitize else ""
    # named by the source, then by source, compiler and flags: a host without a compiler
    # still finds a build of this very source (made before, or in another image stage)
    head = f"accsum-{hashlib.sha256(src).hexdigest()[:12]}-"
    cc = find_compiler()
    if cc is None:
        built_before = sorted((p for p in where.glob(f"{head}{'?' * 12}{suffix}.so")
                               if _nonempty(p)), key=lambda p: p.stat().st_mtime)  # fmt: skip
        if built_before:
            logger.info("no C compiler; the module built before: %s", built_before[-1])
            return built_before[-1]
        raise BuildFailed("no C compiler found (cc, gcc, clang or $CC): the accumulator's "
                          "Redis module is not built")  # fmt: skip
    flags = _FLAGS + (_SANITIZE if sanitize else [])
    identity = " ".join([_compiler_identity(tuple(cc)), *flags])
    digest = hashlib.sha256(src + identity.encode()).hexdigest()[:12]
    target = where / f"{head}{digest}{suffix}.so"
    if _nonempty(target):
        with contextlib.suppress(OSError):  # (in use: kept by the pruning below)
            os.utime(target)
        return target
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=where) as tmp:
            c_file = Path(tmp) / "accsum.c"
            c_file.write_bytes(src)
            built = Path(tmp) / target.name
            proc = subprocess.run([*cc, *flags, "-o", str(built), str(c_file)],
                                  capture_output=True, text=True, check=False)  # fmt: skip
            if proc.returncode != 0:
                raise BuildFailed(f"building the accumulator's Redis module failed "
                                  f"({' '.join(cc)}): {proc.stderr.strip()[-2000:]}")  # fmt: skip
            os.replace(built, target)  # atomic: a concurrent build of the same source is fine
    except OSError as exc:  # a cache directory we may not write (read-only, not a directory)
        raise _Unwritable(str(exc)) from None
    logger.info("built the accumulator's Redis module: %s", target)
    _prune(where, keep=target)
    return target


#: A build not used for this long is deleted when another is made (each source, compiler
#: and flags makes its own: upgrades would pile them up).
PRUNE_AFTER_S = 30 * 24 * 3600


def _prune(where: Path, keep: Path) -> None:
    """Delete the builds in ``where`` not used for :data:`PRUNE_AFTER_S` (a server that
    loaded one keeps its copy: an unlinked shared object stays mapped)."""
    cutoff = time.time() - PRUNE_AFTER_S
    for old in where.glob("accsum-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
                logger.info("deleted an unused build of the module: %s", old)
        except OSError:
            continue


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def server_has_module(client: Any) -> bool:
    """Whether the server runs our module (its probe command answers). Any error (unknown
    command, no permission, fakeredis) means no."""
    try:
        reply = client.execute_command(PING_COMMAND)
    except Exception:  # noqa: BLE001 - unknown command, ACL, a double without modules
        return False
    return is_probe_reply(reply)


def is_probe_reply(reply: Any) -> bool:
    """Whether a reply to :data:`PING_COMMAND` comes from our module."""
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return text.startswith(MODULE_NAME + " ")
