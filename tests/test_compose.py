"""docker-compose.yml and its app image stay hardened (issue 8). No Docker needed: the files
are read as text (no YAML parser: the project does not depend on one), and the two shell
scripts they run -- the `redis` service's start script and the app image's entrypoint -- are
run here with /bin/sh, against stand-ins and against a real redis-server."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from accumulator.testing import find_server_binary

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "scripts" / "Dockerfile"
REDIS_DOCKERFILE = ROOT / "scripts" / "redis.Dockerfile"
ENTRYPOINT = ROOT / "scripts" / "docker-entrypoint.sh"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERIGNORE = ROOT / ".dockerignore"

DEMO_SERVICES = ["chief", "worker-0", "worker-1", "worker-2", "worker-3"]
APP_SERVICES = [*DEMO_SERVICES, "cli"]
PASSWORD = "s3cret-Pass_word.~0123456789abcdef"

posix_only = pytest.mark.skipif(os.name != "posix", reason="runs the scripts with /bin/sh")


# ------------------------------------------------------------------ reading the YAML as text


def _uncomment(line: str) -> str:
    """The line without a trailing `# comment` (none of these files has '#' in a value)."""
    return re.sub(r"(^|\s)#.*$", "", line).rstrip()


def _lines() -> list[str]:
    return [_uncomment(line) for line in COMPOSE.read_text().splitlines()]


def _text() -> str:
    return "\n".join(_lines())


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _children(lines: list[str], parent: int) -> dict[str, list[str]]:
    """The keys one level under lines[parent] (a `key:` line), each with the lines of its
    value (its own line included)."""
    base = _indent(lines[parent])
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    level: int | None = None
    for line in lines[parent + 1 :]:
        if not line.strip():
            continue
        if _indent(line) <= base:
            break
        if level is None:
            level = _indent(line)
        if _indent(line) == level:
            m = re.match(r"\s*([^\s:][^:]*):(\s|$)", line)
            assert m, f"unexpected line under {lines[parent]!r}: {line!r}"
            current = out.setdefault(m.group(1).strip("'\""), [])
        assert current is not None
        current.append(line)
    return out


def _top() -> dict[str, list[str]]:
    lines = ["root:"] + ["  " + line for line in _lines()]
    return _children(lines, 0)


def _anchors() -> dict[str, list[str]]:
    """The top-level blocks that carry an anchor (``x-redis: &redis``), by anchor name."""
    out: dict[str, list[str]] = {}
    for block in _top().values():
        m = re.match(r"\s*[^:]+:\s*&(\S+)\s*$", block[0])
        if m:
            out[m.group(1)] = block
    return out


def _merged(block: list[str]) -> list[str]:
    """A block with its ``<<: *name`` merge key replaced by the keys of the anchored block
    that it does not set itself (YAML's merge, one level deep, recursively)."""
    kids = _children(block, 0)
    merge = kids.pop("<<", None)
    if merge is None:
        return block
    base = _children(_merged(_anchors()[merge[0].split("*", 1)[1].strip()]), 0)
    level = _indent(next(iter(kids.values()))[0]) if kids else _indent(merge[0])
    out = [block[0]]
    for key, lines in base.items():
        if key not in kids:
            shift = level - _indent(lines[0])
            out += [" " * shift + line if shift >= 0 else line[-shift:] for line in lines]
    for lines in kids.values():
        out += lines
    return out


def _services(merged: bool = True) -> dict[str, list[str]]:
    """The services' blocks (with the keys they merge from an anchor, unless not ``merged``)."""
    lines = _lines()
    services = _children(lines, lines.index("services:"))
    return {name: _merged(block) for name, block in services.items()} if merged else services


def _value(block: list[str], key: str) -> str | None:
    """The inline value of `key:` directly inside a block (its first level)."""
    level = _indent(block[1]) if len(block) > 1 else None
    for line in block[1:]:
        if _indent(line) == level and line.strip().startswith(f"{key}:"):
            return line.split(":", 1)[1].strip()
    return None


def _sub(block: list[str], key: str) -> list[str]:
    kids = _children(block, 0)
    return kids.get(key, [])


def _flow_list(value: str | None) -> list[str]:
    assert value and value.startswith("[") and value.endswith("]"), value
    return json.loads(value)


def _anchor(name: str) -> str:
    """The scalar value anchored as &name."""
    m = re.search(rf"&{re.escape(name)}\s+(.+)$", _text(), re.M)
    assert m, f"no anchor &{name}"
    return m.group(1).strip()


def _required_password(value: str | None) -> bool:
    """`${REDIS_PASSWORD:?...}` itself, or an alias of an anchor holding it."""
    if value is None:
        return False
    if value.startswith("*"):
        value = _anchor(value[1:])
    return re.fullmatch(r"\$\{REDIS_PASSWORD:\?[^}]+\}", value.strip("'\"")) is not None


# --------------------------------------------------------------------------- the services


SENTINEL_PROFILE = ["redis-replica", "sentinel-0", "sentinel-1", "sentinel-2", "demo-sentinel"]
CLUSTER_NODES = [f"redis-node-{i}" for i in range(6)]
CLUSTER_PROFILE = [*CLUSTER_NODES, "cluster-init", "demo-cluster"]


def test_the_services_are_kept() -> None:
    services = _services(merged=False)
    assert set(services) == {"redis", *APP_SERVICES, *SENTINEL_PROFILE, *CLUSTER_PROFILE}
    for name in APP_SERVICES:
        assert _value(services[name], "<<") == "*app", f"{name} must merge *app"
    assert _flow_list(_value(services["chief"], "command")) == ["demo", "--role", "chief"]
    for i in range(4):
        assert _flow_list(_value(services[f"worker-{i}"], "command")) == [
            "demo",
            "--role",
            "worker",
            "--worker-index",
            str(i),
        ]
    # 4 workers: the last one (worker-3) is the slow one (demo's --slow-worker-delay default)
    job = _anchor("job").strip("'\"").split()
    assert job[job.index("--workers") + 1] == "4"
    assert {"--job", "--seed", "--steps", "--timeout"} <= set(job)
    assert _value(_top()["x-app"], "environment") == ""
    assert "DEMO_ARGS: *job" in "\n".join(_top()["x-app"])
    cli = services["cli"]
    assert _flow_list(_value(cli, "profiles")) == ["tools"]
    assert _flow_list(_value(cli, "command")) == ["ls"]
    assert _value(cli, "entrypoint") is None  # the image's: `run --rm cli show X` just works


def test_one_app_image_built_from_scripts_dockerfile() -> None:
    app = _top()["x-app"]
    build = "\n".join(_sub(app, "build"))
    assert re.search(r"^\s+context:\s*\.\s*$", build, re.M)
    assert re.search(r"^\s+dockerfile:\s*scripts/Dockerfile\s*$", build, re.M)
    for name in [*APP_SERVICES, "demo-sentinel", "demo-cluster"]:
        block = _services(merged=False)[name]
        assert _value(block, "image") is None and _value(block, "build") is None, (
            f"{name}: the app image comes from x-app's build only"
        )
        assert _value(block, "<<") == "*app", name


# --------------------------------------------------------------------- network and password


def test_no_port_is_published_on_all_interfaces() -> None:
    text = _text()
    assert "0.0.0.0" not in text
    assert not re.search(r"^\s*network_mode:\s*['\"]?host", text, re.M)
    lines = _lines()
    found = 0
    for i, line in enumerate(lines):
        if re.match(r"\s*ports:\s*$", line):
            base = _indent(line)
            for item in lines[i + 1 :]:
                if not item.strip():
                    continue
                if _indent(item) <= base:
                    break
                m = re.match(r"\s*-\s*(.*)$", item)
                assert m, f"ports: use the short form '127.0.0.1:HOST:CONTAINER', not {item!r}"
                port = m.group(1).strip("'\"")
                assert re.fullmatch(
                    r"(127\.0\.0\.1|\[::1\]):\d+(-\d+)?:\d+(-\d+)?(/(tcp|udp))?", port
                ), f"port {port!r} would be published on every interface"
                found += 1
        assert not re.match(r"\s*ports:\s*\[", line), "ports: one '127.0.0.1:...' per line"
    assert found <= 1  # only redis, and only for this machine


def test_redis_requires_the_password_from_the_env() -> None:
    text = _text()
    uses = re.findall(r"\$\{REDIS_PASSWORD[^}]*\}", text)
    assert uses, "REDIS_PASSWORD is not used"
    for use in uses:
        assert use.startswith("${REDIS_PASSWORD:?"), f"{use}: a missing password must fail"
    assert "$REDIS_PASSWORD" not in text.replace("$$", "")  # no unchecked plain form
    redis_env = _sub(_services()["redis"], "environment")
    assert _required_password(_value(redis_env, "REDISCLI_AUTH"))
    app_env = _sub(_top()["x-app"], "environment")
    assert _required_password(_value(app_env, "REDISCLI_AUTH"))
    script = _redis_script()
    assert re.search(r"^requirepass \$REDISCLI_AUTH$", script, re.M)


def test_the_password_is_on_no_command_line() -> None:
    text = _text()
    assert "--requirepass" not in text
    assert "--url" not in text  # the entrypoint builds REDIS_URL: no URL (password) in argv
    assert "--pass" not in text and " -a " not in text  # redis-cli's
    assert "REDIS_URL" not in text  # nor a URL with the password in the container's config
    healthcheck = "\n".join(_sub(_services()["redis"], "healthcheck"))
    assert "redis-cli" in healthcheck  # authenticates through REDISCLI_AUTH
    assert "PONG" in healthcheck  # NOAUTH must fail the check, whatever redis-cli's exit code


def test_env_example_holds_no_password() -> None:
    text = ENV_EXAMPLE.read_text()
    assert re.search(r"^REDIS_PASSWORD=$", text, re.M), "the example leaves the password empty"
    assert "cp .env.example .env" in text
    assert ".env" in DOCKERIGNORE.read_text()


def test_dot_env_is_not_tracked() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--", ".env"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert tracked == "", ".env (the Redis password) is committed"


def test_header_tells_the_commands() -> None:
    header = COMPOSE.read_text().split("\n\n", 1)[0]
    for command in [
        "cp .env.example .env",
        "REDIS_PASSWORD",
        "docker compose up --build",
        "docker compose run --rm cli ls",
        "docker compose down",
    ]:
        assert command in header, command


# ------------------------------------------------------------------ images, users, startup


def _pinned(ref: str) -> bool:
    """name:MAJOR.MINOR[...]@sha256:DIGEST -- a version tag finer than a major, and a digest."""
    name, _, digest = ref.partition("@")
    tag = name.rsplit("/", 1)[-1].partition(":")[2]
    return bool(
        re.fullmatch(r"v?\d+\.\d+(\.\d+)*([-.][A-Za-z0-9.-]+)?", tag)
        and re.fullmatch(r"sha256:[0-9a-f]{64}", digest)
    )


def test_every_image_is_pinned() -> None:
    images = re.findall(r"^\s*image:\s*['\"]?([^'\"\s]+)", _text(), re.M)
    for image in images:
        assert _pinned(image), f"image {image} is not pinned to a version and a digest"
    for dockerfile in (DOCKERFILE, REDIS_DOCKERFILE):
        froms = re.findall(r"^FROM\s+(?:--\S+\s+)*(\S+)", dockerfile.read_text(), re.M)
        assert froms, dockerfile
        for base in froms:
            assert _pinned(base), f"FROM {base} is not pinned to a version and a digest"
    assert not _pinned("redis:7") and not _pinned("python:latest")
    assert not _pinned("python:3.12-slim")  # a digest is required too
    assert _pinned("python:3.12.15-slim-bookworm@sha256:" + "0" * 64)


def test_no_pip_at_container_start() -> None:
    text = _text()
    assert not re.search(r"\bpip3?\b", text), "pip in docker-compose.yml"
    assert "entrypoint:" not in text  # the image's entrypoint, nothing installing around it
    entrypoint = ENTRYPOINT.read_text()
    assert not re.search(r"\bpip3?\b", entrypoint)
    for line in DOCKERFILE.read_text().splitlines():
        if re.match(r"(ENTRYPOINT|CMD)\b", line):
            assert "pip" not in line
    # the image carries the project: no source tree mounted into the containers
    assert not re.search(r"^\s*-\s*['\"]?(\.{1,2}|~|/)[^:'\"]*:", text, re.M), "bind mount"


def test_dockerfile_installs_the_demo_extra_at_build_time() -> None:
    text = DOCKERFILE.read_text()
    runs = " ".join(re.findall(r"^RUN\s+(.*(?:\\\n.*)*)", text, re.M))
    assert re.search(r"pip install --no-cache-dir '\.\[demo\]'", runs)
    assert re.search(r'^ENTRYPOINT \["accumulator-entrypoint"\]', text, re.M)
    assert "COPY scripts/docker-entrypoint.sh /usr/local/bin/accumulator-entrypoint" in text
    # never run from the source tree: `python -m accumulator` would import ./accumulator
    workdirs = re.findall(r"^WORKDIR\s+(\S+)", text, re.M)
    assert workdirs and workdirs[-1] not in ("/tmp/build", "/src", "/app")


def test_dockerfile_runs_as_a_fixed_non_root_user() -> None:
    text = DOCKERFILE.read_text()
    instructions = [m.group(1) for m in re.finditer(r"^([A-Z]+)\s", text, re.M)]
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users, "no USER: the containers would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    last_user = len(instructions) - 1 - instructions[::-1].index("USER")
    assert "RUN" not in instructions[last_user:], "something runs as root after USER"
    uid = re.search(r"useradd\b[^\n]*?--uid (\d+)", text)
    assert uid and uid.group(1) == user and int(user) >= 1000


def test_compose_containers_run_unprivileged() -> None:
    text = _text()
    assert not re.search(r"^\s*user:\s*['\"]?(root|0)\b", text, re.M)
    assert "privileged" not in text and "cap_add" not in text
    redis_block = _services()["redis"]
    assert _value(redis_block, "user") not in (None, "root", "0")
    hardened = "\n".join(_top()["x-hardened"])
    assert re.search(r"^\s+read_only:\s*true$", hardened, re.M)
    assert re.search(r"^\s+cap_drop:\s*\[ALL\]$", hardened, re.M)
    assert "no-new-privileges:true" in hardened
    assert _value(_services(merged=False)["redis"], "<<") == "*redis"
    assert _value(_top()["x-redis"], "<<") == "*hardened"
    assert _value(_top()["x-app"], "<<") == "*hardened"
    for name, block in _services().items():  # every service, with what it merges
        assert _value(block, "read_only") == "true", name
        assert _value(block, "cap_drop") == "[ALL]", name
        if name not in (*APP_SERVICES, "demo-sentinel", "demo-cluster"):  # the app image's
            assert _value(block, "user") == "redis", name


def test_dockerignore_keeps_secrets_and_clutter_out() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "an allow-list: start by excluding everything"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for secret in (".env", ".git", ".venv", "tests"):
        assert secret not in allowed
    for excluded in ("**/.env", "**/.git", "**/.venv", "**/__pycache__"):
        assert excluded in patterns
    # everything the Dockerfiles copy is in the context
    for dockerfile in (DOCKERFILE, REDIS_DOCKERFILE):
        for source in re.findall(r"^COPY\s+(?!--from)(.+)\s+\S+$", dockerfile.read_text(), re.M):
            for path in source.split():
                assert any(path == a or path.startswith(a + "/") for a in allowed), (
                    f"COPY {path}: excluded by .dockerignore"
                )


def test_redis_is_the_pinned_image_plus_our_module() -> None:
    redis_block = _services()["redis"]
    assert _value(redis_block, "image") is None  # built: scripts/redis.Dockerfile
    build = "\n".join(_sub(redis_block, "build"))
    assert re.search(r"^\s+context:\s*\.\s*$", build, re.M)
    assert re.search(r"^\s+dockerfile:\s*scripts/redis\.Dockerfile\s*$", build, re.M)
    text = REDIS_DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) == 2 and froms[0] == froms[1] and froms[0].startswith("redis:")
    # the library's own flags (accumulator/_module.py), not a second opinion
    from accumulator import _module

    (cc,) = re.findall(r"^RUN cc (.+)$", text, re.M)
    assert cc.split()[: len(_module._FLAGS)] == _module._FLAGS
    assert "COPY accumulator/module/accsum.c /src/accsum.c" in text
    (installed,) = re.findall(r"^COPY --from=build /src/accsum\.so (\S+)$", text, re.M)
    env = "\n".join(_sub(redis_block, "environment"))
    assert re.search(rf"^\s+ACCSUM_MODULE:\s*{re.escape(installed)}(\s|$)", env, re.M)


# ------------------------------------------------------------------------- the two scripts


def _redis_script(anchor: str = "x-redis: &redis") -> str:
    """The redis service's start script (x-redis: the `redis` service, the replica and the
    cluster nodes), as the container's shell gets it (`$$` -> `$`); or another block's."""
    raw = COMPOSE.read_text().splitlines()
    start = next(i for i, line in enumerate(raw) if line == anchor)
    cmd = next(i for i in range(start, len(raw)) if raw[i].strip() == "command:")
    block = next(i for i in range(cmd, len(raw)) if raw[i].strip() == "- |")
    base = _indent(raw[block])
    body = []
    for line in raw[block + 1 :]:
        if line.strip() and _indent(line) <= base:
            break
        body.append(line)
    assert [s.strip() for s in raw[cmd + 1 : block]] == ["- sh", "- -ec"]
    return textwrap.dedent("\n".join(body)).replace("$$", "$")


def _shells() -> list[list[str]]:
    shells = [["/bin/sh"]]
    if shutil.which("busybox"):  # the redis image (alpine) runs busybox's ash
        shells.append([shutil.which("busybox") or "busybox", "sh"])
    return shells


def _stub(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@posix_only
@pytest.mark.parametrize("shell", _shells(), ids=lambda s: Path(s[0]).name)
def test_redis_gets_its_config_on_stdin(tmp_path: Path, shell: list[str]) -> None:
    _stub(
        tmp_path, "redis-server", f'printf "%s\\n" "$@" > {tmp_path}/argv\ncat > {tmp_path}/stdin\n'
    )
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "REDISCLI_AUTH": PASSWORD}
    subprocess.run([*shell, "-ec", _redis_script()], env=env, check=True, timeout=30)
    assert (tmp_path / "argv").read_text() == "-\n"  # config from stdin; nothing else
    config = (tmp_path / "stdin").read_text().splitlines()
    assert f"requirepass {PASSWORD}" in config
    assert 'save ""' in config and "appendonly no" in config
    assert not any(line.startswith("loadmodule") for line in config)  # no ACCSUM_MODULE
    env["ACCSUM_MODULE"] = "/usr/local/lib/redis/accsum.so"
    subprocess.run([*shell, "-ec", _redis_script()], env=env, check=True, timeout=30)
    config = (tmp_path / "stdin").read_text().splitlines()
    assert "loadmodule /usr/local/lib/redis/accsum.so" in config
    env["ACCSUM_MODULE"] = "/x y/accsum.so"
    proc = subprocess.run([*shell, "-ec", _redis_script()], env=env, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2 and "ACCSUM_MODULE" in proc.stderr


@posix_only
@pytest.mark.parametrize("password", ["", "with space", 'a"quote', "at@sign", "new\nline"])
def test_redis_refuses_a_password_it_cannot_quote(tmp_path: Path, password: str) -> None:
    _stub(tmp_path, "redis-server", f"touch {tmp_path}/ran\n")
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "REDISCLI_AUTH": password}
    proc = subprocess.run(
        ["/bin/sh", "-ec", _redis_script()], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode != 0 and "REDIS_PASSWORD" in proc.stderr
    assert not (tmp_path / "ran").exists()


def _entrypoint(tmp_path: Path, args: list[str], **env: str) -> tuple[int, list[str], str]:
    """Runs scripts/docker-entrypoint.sh with a stand-in `accumulator`: its exit code, the
    arguments the stand-in got and the REDIS_URL it saw."""
    _stub(
        tmp_path,
        "accumulator",
        f'printf "%s\\n" "$@" > {tmp_path}/argv\nprintf "%s" "$REDIS_URL" > {tmp_path}/url\n',
    )
    full = {"PATH": f"{tmp_path}:/usr/bin:/bin", **env}
    proc = subprocess.run(
        ["/bin/sh", str(ENTRYPOINT), *args], env=full, capture_output=True, text=True, timeout=30
    )
    if not (tmp_path / "argv").exists():
        return proc.returncode, [], ""
    argv = (tmp_path / "argv").read_text().splitlines()
    return proc.returncode, argv, (tmp_path / "url").read_text()


@posix_only
def test_entrypoint_builds_the_url_inside_the_container(tmp_path: Path) -> None:
    rc, argv, url = _entrypoint(tmp_path, ["show", "compose/emb"], REDISCLI_AUTH=PASSWORD)
    assert rc == 0 and argv == ["show", "compose/emb"]
    assert url == f"redis://:{PASSWORD}@redis:6379/0"
    assert not any(PASSWORD in a for a in argv)
    rc, _, url = _entrypoint(
        tmp_path, ["ls"], REDISCLI_AUTH="pw", REDIS_HOST="h", REDIS_PORT="7000", REDIS_DB="3"
    )
    assert rc == 0 and url == "redis://:pw@h:7000/3"
    rc, _, url = _entrypoint(tmp_path, ["ls"], REDIS_URL="redis://other:6379/1")
    assert rc == 0 and url == "redis://other:6379/1"  # given: used as is, no password needed
    # the profiles' forms
    rc, _, url = _entrypoint(tmp_path, ["ls"], REDISCLI_AUTH="pw", REDIS_SCHEME="redis+sentinel",
                             REDIS_ADDRESS="s0:26379,s1:26379", REDIS_PATH="mymaster")  # fmt: skip
    assert rc == 0 and url == "redis+sentinel://:pw@s0:26379,s1:26379/mymaster"
    rc, _, url = _entrypoint(tmp_path, ["ls"], REDISCLI_AUTH="pw", REDIS_SCHEME="redis+cluster",
                             REDIS_ADDRESS="redis-node-0:6379")  # fmt: skip
    assert rc == 0 and url == "redis+cluster://:pw@redis-node-0:6379/0"
    for i, bad in enumerate(({"REDIS_SCHEME": "http"}, {"REDIS_ADDRESS": "h:1/x"},
                             {"REDIS_PATH": "a b"})):  # fmt: skip
        (tmp_path / str(i)).mkdir()
        rc, argv, _ = _entrypoint(tmp_path / str(i), ["ls"], REDISCLI_AUTH="pw", **bad)
        assert rc == 2 and argv == [], bad


@posix_only
@pytest.mark.parametrize("password", [None, "", "a b", "p@ss", "x/y", "$(id)"])
def test_entrypoint_refuses_a_missing_or_unquotable_password(
    tmp_path: Path, password: str | None
) -> None:
    env = {} if password is None else {"REDISCLI_AUTH": password}
    rc, argv, _ = _entrypoint(tmp_path, ["ls"], **env)
    assert rc == 2 and argv == []


@posix_only
def test_entrypoint_puts_the_job_flags_after_demo(tmp_path: Path) -> None:
    job = _anchor("job").strip("'\"")
    command = _flow_list(_value(_services()["worker-3"], "command"))
    rc, argv, _ = _entrypoint(tmp_path, command, REDISCLI_AUTH="pw", DEMO_ARGS=job)
    assert rc == 0
    assert argv == ["demo", *job.split(), "--role", "worker", "--worker-index", "3"]
    rc, argv, _ = _entrypoint(tmp_path, ["ls"], REDISCLI_AUTH="pw", DEMO_ARGS=job)
    assert argv == ["ls"]  # only the demo gets them
    rc, argv, _ = _entrypoint(tmp_path, ["demo"], REDISCLI_AUTH="pw", DEMO_ARGS="--job *")
    assert argv == ["demo", "--job", "*"]  # split, never globbed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@posix_only
def test_compose_redis_and_entrypoint_against_a_real_server(tmp_path: Path) -> None:
    """The redis service's script starts a real redis-server that demands the password, and
    the app entrypoint reaches it with the real CLI -- what `docker compose up` wires up."""
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    port = _free_port()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # the script's `redis-server -`, kept on this machine and out of the cwd
    _stub(
        bindir,
        "redis-server",
        f'exec {binary} "$@" --port {port} --bind 127.0.0.1 --dir {tmp_path}\n',
    )
    _stub(bindir, "accumulator", f'exec {sys.executable} -m accumulator "$@"\n')
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "REDISCLI_AUTH": PASSWORD}
    from accumulator import _module

    module = _module.build()  # what the image's first stage builds, if this machine can
    if module is not None:
        env["ACCSUM_MODULE"] = str(module)
    for key in ("REDIS_URL", "ACCUMULATOR_REDIS_URL"):
        env.pop(key, None)
    server = subprocess.Popen(
        ["/bin/sh", "-ec", _redis_script()],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, password=PASSWORD, socket_timeout=5)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, "redis-server exited"
                assert time.monotonic() < deadline, "redis-server did not come up"
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        assert client.config_get("save") == {"save": ""}
        if module is not None:  # the script loaded it
            assert client.execute_command("ACC.PING").startswith(b"accsum 1 kernels=")
        cmdline = Path(f"/proc/{server.pid}/cmdline")
        if cmdline.exists():  # `exec`: the shell became redis-server
            assert PASSWORD.encode() not in cmdline.read_bytes()

        app_env = {**env, "REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(port)}
        ok = subprocess.run(
            ["/bin/sh", str(ENTRYPOINT), "--json", "ls"],
            env=app_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ok.returncode == 0, ok.stderr
        json.loads(ok.stdout)
        app_env["REDISCLI_AUTH"] = "wrong-password"
        bad = subprocess.run(
            ["/bin/sh", str(ENTRYPOINT), "ls"],
            env=app_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 3, bad.stderr  # cannot connect: wrong password
        assert "wrong-password" not in bad.stdout + bad.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# ------------------------------------------------------- profiles `sentinel` and `cluster`


def _profile_env(block: list[str]) -> dict[str, str]:
    """A service's environment, with what it merges (``<<: *redis-environment``)."""
    env: dict[str, str] = {}
    for line in _sub(block, "environment")[1:]:
        key, _, value = line.strip().partition(":")
        if key == "<<":
            anchor = _text().split("environment: &" + value.strip()[1:], 1)[1]
            for inner in anchor.splitlines()[1:]:
                if not inner.startswith("    ") or ":" not in inner:
                    break
                k, _, v = inner.strip().partition(":")
                env.setdefault(k, v.strip().strip("'\""))
        else:
            env[key] = value.strip().strip("'\"")
    return env


def test_the_profiles_services() -> None:
    services = _services()
    raw = _services(merged=False)
    for name in SENTINEL_PROFILE:
        assert _flow_list(_value(services[name], "profiles")) == ["sentinel"], name
    for name in CLUSTER_PROFILE:
        assert _flow_list(_value(services[name], "profiles")) == ["cluster"], name
    assert _profile_env(raw["redis-replica"])["REDIS_ROLE"] == "replica"
    for name in CLUSTER_NODES:
        env = _profile_env(raw[name])
        assert env["REDIS_ROLE"] == "cluster" and env["REDIS_ANNOUNCE_HOST"] == name, name
        assert _required_password(env["REDISCLI_AUTH"])
        assert "ports" not in _children(services[name], 0), f"{name} publishes no port"
    sentinel = _profile_env(raw["demo-sentinel"])
    assert sentinel["REDIS_SCHEME"] == "redis+sentinel" and sentinel["REDIS_PATH"] == "mymaster"
    assert sentinel["REDIS_ADDRESS"] == ",".join(f"sentinel-{i}:26379" for i in range(3))
    cluster = _profile_env(raw["demo-cluster"])
    assert cluster["REDIS_SCHEME"] == "redis+cluster"
    assert "cluster-init:" in "\n".join(_sub(services["demo-cluster"], "depends_on"))
    assert "service_completed_successfully" in "\n".join(services["demo-cluster"])
    header = COMPOSE.read_text().split("\n\n", 1)[0]
    assert "docker compose --profile sentinel run --rm demo-sentinel" in header
    assert "docker compose --profile cluster run --rm demo-cluster" in header


@posix_only
def test_the_redis_script_makes_replicas_and_cluster_nodes(tmp_path: Path) -> None:
    _stub(tmp_path, "redis-server", f"cat > {tmp_path}/stdin\n")
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "REDISCLI_AUTH": PASSWORD}

    def config(**extra: str) -> list[str]:
        subprocess.run(["/bin/sh", "-ec", _redis_script()], env={**env, **extra}, check=True,
                       timeout=30)  # fmt: skip
        return (tmp_path / "stdin").read_text().splitlines()

    plain = config()
    assert f"masterauth {PASSWORD}" in plain and not any("cluster" in x for x in plain)
    assert "replicaof redis 6379" in config(REDIS_ROLE="replica")
    node = config(REDIS_ROLE="cluster", REDIS_ANNOUNCE_HOST="redis-node-4")
    assert "cluster-enabled yes" in node and "cluster-announce-hostname redis-node-4" in node
    assert "cluster-preferred-endpoint-type hostname" in node
    for bad in ({"REDIS_ROLE": "primary"}, {"REDIS_ROLE": "cluster"},
                {"REDIS_ROLE": "cluster", "REDIS_ANNOUNCE_HOST": "a b"}):  # fmt: skip
        proc = subprocess.run(["/bin/sh", "-ec", _redis_script()], env={**env, **bad},
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert proc.returncode == 2 and "redis:" in proc.stderr, bad


@posix_only
def test_a_real_server_takes_the_cluster_node_and_sentinel_configs(tmp_path: Path) -> None:
    """The config the scripts write starts a real cluster node and a real Sentinel (paths
    and the service name `redis` mapped to this machine)."""
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    from accumulator._testing_cluster import _cluster_port

    primary_port, node_port, sentinel_port = _free_port(), _cluster_port(), _free_port()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # redis-server reading its config from stdin or a file: /data and /tmp, the service name
    # `redis` and the fixed ports mapped to this test's
    _stub(bindir, "redis-server", textwrap.dedent(f"""\
        if [ "$1" = - ]; then src=/dev/stdin; else src="$1"; fi
        sed -e 's#/data/#{tmp_path}/#' -e 's#^port 26379#port {sentinel_port}#' \\
            -e 's#mymaster redis 6379#mymaster 127.0.0.1 {primary_port}#' "$src" \\
            > {tmp_path}/conf.$$
        shift
        exec {binary} {tmp_path}/conf.$$ "$@" --port "${{PORT}}" --bind 127.0.0.1 \\
            --dir {tmp_path}
    """))  # fmt: skip
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "REDISCLI_AUTH": PASSWORD}
    env.pop("ACCSUM_MODULE", None)
    procs = []
    try:
        def start(script: str, **extra: str) -> None:
            out = open(tmp_path / f"out.{len(procs)}", "wb")  # noqa: SIM115 - closed at exit
            procs.append(subprocess.Popen(["/bin/sh", "-ec", script], env={**env, **extra},
                                          stdout=out, stderr=subprocess.STDOUT))  # fmt: skip

        start(_redis_script(), PORT=str(primary_port))
        start(_redis_script(), PORT=str(node_port), REDIS_ROLE="cluster",
              REDIS_ANNOUNCE_HOST="redis-node-0")  # fmt: skip
        start(_redis_script("x-sentinel: &sentinel"), PORT=str(sentinel_port))
        node = redis.Redis(port=node_port, password=PASSWORD, socket_timeout=5)
        sentinel = redis.Redis(port=sentinel_port, socket_timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                info = node.info("cluster")
                master = sentinel.sentinel_master("mymaster")
                if info.get("cluster_enabled") == 1 and master.get("port") == primary_port:
                    break
            except (redis.ConnectionError, redis.ResponseError):
                pass
            assert all(p.poll() is None for p in procs), "a server exited: " + " | ".join(
                (tmp_path / f"out.{i}").read_text(errors="replace")[-500:] for i in range(3)
            )
            assert time.monotonic() < deadline, "the servers did not come up"
            time.sleep(0.1)
        node.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        shards = node.execute_command("CLUSTER", "SHARDS")
        assert b"redis-node-0" in repr(shards).encode()  # the name clients are told
        assert master["flags"] == {"master"} or "master" in str(master["flags"])
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        Path("/tmp/sentinel.conf").unlink(missing_ok=True)  # the Sentinel script's, in /tmp
