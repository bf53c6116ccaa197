"""Secrets are never shown: one redaction (``accumulator._redact``) for every URL the package
prints or logs, no sync object keeping a URL (or its password) in an attribute, and a CLI that
takes the password from ``$REDISCLI_AUTH`` instead of argv (plus ``--user``, ``--tls`` and
``--tls-ca-cert``), against real password-protected (and TLS) servers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

import accumulator
from accumulator import _cli
from accumulator._redact import redact_url, scrub, url_secrets
from accumulator.sync import ParameterServer, Worker
from accumulator.testing import RedisServer, find_server_binary

#: The test password: a string that appears nowhere else.
PW = "Sup3r-S3cret-pw"
WRONG = "Wr0ng-S3cret-pw"
AUTH_ENV = "REDISCLI_AUTH"  # redis-cli's variable for the password


# -- redact_url ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown", "dropped"),
    [
        ("redis://localhost:6379/0", "redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://:pw@h:1/0", "redis://:***@h:1/0", "redis://h:1/0"),
        ("rediss://alice:pw@h:1/0?ssl_cert_reqs=none", "rediss://alice:***@h:1/0?ssl_cert_reqs=none",
         "rediss://alice@h:1/0?ssl_cert_reqs=none"),
        ("redis://alice@h/0", "redis://alice@h/0", "redis://alice@h/0"),
        ("redis://h:1/0?password=pw&db=2", "redis://h:1/0?password=***&db=2", "redis://h:1/0?db=2"),
        ("redis://h/0?db=2&password=pw", "redis://h/0?db=2&password=***", "redis://h/0?db=2"),
        ("redis://h/0?password=pw", "redis://h/0?password=***", "redis://h/0"),
        ("redis://h/0?PassWord=a&ssl_password=b&auth=c&token=d&client_name=n",
         "redis://h/0?PassWord=***&ssl_password=***&auth=***&token=***&client_name=n",
         "redis://h/0?client_name=n"),
        ("redis://h/0?pass%77ord=pw", "redis://h/0?pass%77ord=***", "redis://h/0"),
        ("redis://h/0?password=a&b&db=1", "redis://h/0?password=***&db=1", "redis://h/0?db=1"),
        ("redis://h/0?password=a;b&db=1", "redis://h/0?password=***&db=1", "redis://h/0?db=1"),
        ("unix:///tmp/r.sock?db=1&password=pw", "unix:///tmp/r.sock?db=1&password=***",
         "unix:///tmp/r.sock?db=1"),
        # passwords with unencoded "@", "/", "?", "#" (invalid for redis-py, still masked)
        ("redis://:p@ss@h:1/0", "redis://:***@h:1/0", "redis://h:1/0"),
        ("redis://:p/ss@h:1/0", "redis://:***@h:1/0", "redis://h:1/0"),
        ("redis://:p?s#s@h:1/0", "redis://:***@h:1/0", "redis://h:1/0"),
        ("redis://:Ab@c/Def9@h:1/0", "redis://:***@h:1/0", "redis://h:1/0"),  # "@" and "/"
        ("redis://:Ab@c?x@h:1/0", "redis://:***@h:1/0", "redis://h:1/0"),
        ("redis://u:p@h/0?client_name=a@b", "redis://u:***@h/0?client_name=a@b",
         "redis://u@h/0?client_name=a@b"),
        # an "@" inside a query value is not a password
        ("redis://h:1/0?client_name=a@b", "redis://h:1/0?client_name=a@b",
         "redis://h:1/0?client_name=a@b"),
        ("redis://[::1]:1/0?client_name=a@b", "redis://[::1]:1/0?client_name=a@b",
         "redis://[::1]:1/0?client_name=a@b"),
        ("u:pw@h:1", "u:***@h:1", "u@h:1"),  # no scheme: still masked
        ("", "", ""),
        ("redis://[::1", "redis://[::1", "redis://[::1"),
    ],
)  # fmt: skip
def test_redact_url(url: str, shown: str, dropped: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(url, drop=True) == dropped


def test_redact_url_odd_input() -> None:
    assert redact_url(None) == ""
    assert redact_url(b"redis://:pw@h/0") == "redis://:***@h/0"
    assert redact_url(3) == "<int>"


@given(st.text())
def test_redaction_never_raises(text: str) -> None:
    assert isinstance(redact_url(text), str)
    assert isinstance(redact_url(text, drop=True), str)
    assert isinstance(scrub(text, url_secrets(text)), str)


@given(st.text(min_size=1))
def test_any_encoded_password_is_masked(password: str) -> None:
    enc = quote(password, safe="")
    url = f"redis://alice:{enc}@host:6379/0?password={enc}&db=2"
    assert redact_url(url) == "redis://alice:***@host:6379/0?password=***&db=2"
    assert redact_url(url, drop=True) == "redis://alice@host:6379/0?db=2"
    assert password in url_secrets(url)


@given(st.text(alphabet="ab1:/?#@&;=%[]. ", max_size=12))
def test_unencoded_password_never_shown(tail: str) -> None:
    # whatever redis-py would make of it, it is not shown; before a host:port no part of it
    # (what follows an unencoded "@", "/", ... in it neither). Elsewhere its end may be
    # ambiguous: "u:S3CR3T@a?a=K3Y@host/0" reads as host "a" with a query value "K3Y@host/0",
    # "?password=S3CR3T&a=K3Y" as a parameter a (documented).
    password = "S3CR3T" + tail + "K3Y"
    for url in (f"redis://:{password}@host:6379/0", f"redis://u:{password}@host/0?db=1",
                f"redis://host/0?password={password}"):  # fmt: skip
        for shown in (redact_url(url), redact_url(url, drop=True)):
            assert "S3CR3T" not in shown
            assert "K3Y" not in shown or "host:6379" not in url


def test_scrub() -> None:
    url = "redis://:p/ss@host:6379/0"  # redis-py: "Port could not be cast ... as 'p'"
    with pytest.raises(ValueError) as info:
        redis.Redis.from_url(url)
    assert "'p'" in str(info.value)
    assert "'p'" not in scrub(str(info.value), url_secrets(url))
    assert scrub(f"auth {PW} failed", [PW, None]) == "auth *** failed"
    assert scrub("nothing", []) == "nothing"


# -- sync objects keep no password --------------------------------------------------------------


def _leaks(obj: Any, secret: str, path: str = "obj", seen: set[int] | None = None) -> list[str]:
    """Where ``secret`` shows up in ``obj``: its repr/str, and recursively its plain attributes
    (objects of this package), dataclass fields and containers; redis-py objects only through
    their repr and str (their connection_kwargs are redis-py's business)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, bytes):
        obj = obj.decode("utf-8", "replace")
    if isinstance(obj, str):
        return [path] if secret in obj else []
    if obj is None or isinstance(obj, (bool, int, float, np.ndarray, np.generic, np.dtype)):
        return []
    found = [f"{path} ({how})" for how, text in (("repr", repr(obj)), ("str", str(obj)))
             if secret in text]  # fmt: skip
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            found += _leaks(key, secret, f"{path} key", seen)
            found += _leaks(value, secret, f"{path}[{key!r}]", seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            found += _leaks(value, secret, f"{path}[{i}]", seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            found += _leaks(getattr(obj, f.name), secret, f"{path}.{f.name}", seen)
    elif type(obj).__module__.startswith("accumulator") and hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            found += _leaks(value, secret, f"{path}.{name}", seen)
    return found


@pytest.fixture(scope="module")
def _locked_server() -> Iterator[RedisServer]:
    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with RedisServer(args=["--requirepass", PW]) as server:
        yield server


@pytest.fixture
def locked(_locked_server: RedisServer) -> RedisServer:
    """A real server that requires the password PW, emptied for each test."""
    with redis.Redis(host="127.0.0.1", port=_locked_server.port, password=PW) as admin:
        admin.flushall()
    return _locked_server


def _with_password(url: str) -> str:
    return url.replace("redis://", f"redis://:{PW}@")


def _open_and_close(twin: str, url: str) -> None:
    """Open (and close) a dense accumulator of ``url`` with the sync or the asyncio class."""
    import asyncio

    from accumulator import aio

    if twin == "sync":
        accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="x", client=url).close()
        return

    async def main() -> None:
        async with aio.ConditionalAccumulator(np.float32, (3,), shared_name="x", client=url):
            pass

    asyncio.run(main())


@pytest.mark.parametrize("twin", ["sync", "asyncio"])
@pytest.mark.parametrize("password", [None, "wrong"])
def test_a_refused_login_is_said_at_once_not_retried(locked: RedisServer, twin: str,
                                                     password: str | None) -> None:  # fmt: skip
    """A missing or wrong password: PermissionDeniedError saying what to give, raised at once
    (redis-py counts a refused login as a ConnectionError: its retries and ours made a
    missing password take ~2 s, and it came as redis-py's AuthenticationError)."""
    import time

    url = locked.url if password is None else locked.url.replace("redis://",
                                                                 f"redis://:{password}@")
    t0 = time.monotonic()
    with pytest.raises(accumulator.PermissionDeniedError, match="refused the login") as caught:
        _open_and_close(twin, url)
    assert time.monotonic() - t0 < 1.0  # (one login: milliseconds; ~2 s retried)
    assert "PASSWORD@" in str(caught.value)
    assert isinstance(caught.value.__cause__, redis.AuthenticationError)


@pytest.mark.parametrize("twin", ["sync", "asyncio"])
def test_a_refused_login_to_a_cluster_is_said_at_once(twin: str) -> None:
    """redis-py's cluster client wraps the refusal in a RedisClusterException ("cannot be
    connected"), which read as no node reachable: retried for the whole window (code
    review). A one-node cluster whose node wants a password, opened without one."""
    import time

    from accumulator._testing_cluster import LocalCluster

    if find_server_binary() is None:
        pytest.skip("no redis-server binary (scripts/test.sh installs one)")
    with LocalCluster(primaries=1, replicas_each=0) as nodes:
        for server in nodes.servers:
            with server.client() as client:
                client.config_set("requirepass", PW)
        t0 = time.monotonic()
        with pytest.raises(accumulator.PermissionDeniedError, match="refused the login"):
            _open_and_close(twin, nodes.cluster_url)
        assert time.monotonic() - t0 < 3.0  # (the default window: 30 s)


@pytest.mark.parametrize("twin", ["sync", "asyncio"])
def test_a_database_the_server_lacks_is_an_invalid_argument(locked: RedisServer,
                                                            twin: str) -> None:  # fmt: skip
    url = _with_password(locked.url).rsplit("/", 1)[0] + "/99"
    with pytest.raises(accumulator.InvalidArgumentError, match="database number"):
        _open_and_close(twin, url)


@pytest.mark.parametrize("form", ["userinfo", "query", "client"])
def test_sync_objects_keep_no_password(locked: RedisServer, form: str) -> None:
    client: Any = {
        "userinfo": _with_password(locked.url),
        "query": f"{locked.url}?password={PW}",
        "client": redis.Redis(host="127.0.0.1", port=locked.port, password=PW),
    }[form]
    params = {"w": np.zeros((2, 3)), "emb": np.zeros((4, 2))}
    with ParameterServer("secret", replicas_to_aggregate=1, sparse={"emb"}, client=client) as ps:
        ps.initialize(params, resume=False)
        with Worker("secret", client=client, worker_id="w0") as worker:
            step, _ = worker.pull(timeout=10)
            worker.push(step, {"w": np.ones((2, 3)), "emb": ([1], [[1.0, 1.0]])})
            assert ps.step(0.1, timeout=10) == 1
            assert worker.pull(after=step, timeout=10)[0] == 1
            for obj in (ps, worker):
                assert _leaks(obj, PW) == []
                assert repr(obj).startswith(type(obj).__name__ + "(job='secret'")
                assert PW not in str(obj)
            # the accumulators were opened on the same server with the same credentials
            assert ps.stats().params["w"].taken == 1


def test_the_leak_finder_finds_leaks() -> None:
    class Holder:
        pass

    Holder.__module__ = "accumulator.fake"
    holder = Holder()
    holder.nested = {"k": [dataclasses.make_dataclass("D", ["u"])(f"redis://:{PW}@h")]}  # type: ignore[attr-defined]
    assert _leaks(holder, PW)


# -- the CLI ------------------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m accumulator ARGS`` without the URL and password variables of this shell."""
    drop = ("ACCUMULATOR_REDIS_URL", "REDIS_URL", AUTH_ENV)
    clean = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(
        [sys.executable, "-m", "accumulator", *args],
        env={**clean, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def shown(proc: subprocess.CompletedProcess[str], code: int) -> str:
    """stdout + stderr of a run that exited with ``code``; neither holds a test password."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}\n{text}"
    assert "Traceback" not in text
    for secret in (PW, WRONG, quote(PW), quote(WRONG)):
        assert secret not in text
    return text


def test_cli_masks_query_string_passwords(locked: RedisServer) -> None:
    url = f"{locked.url}?password={PW}"
    with accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="w", client=url) as acc:
        acc.apply_grad(np.ones(2), local_step=0)
        out = shown(cli("watch", "w", "-n", "1", "--url", url), 0)
        assert f"{locked.url}?password=***" in out.splitlines()[0]  # the header
        data = json.loads(shown(cli("ls", "--json", "--url", url), 0))
        assert data["url"] == f"{locked.url}?password=***"
        assert [a["shared_name"] for a in data["accumulators"]] == ["w"]
        shown(cli("show", "w", "--url", url), 0)


@pytest.mark.parametrize(
    "url_of",
    [lambda u: f"{u}?password={WRONG}", lambda u: u.replace("redis://", f"redis://:{WRONG}@")],
    ids=["query", "userinfo"],
)
def test_cli_errors_show_no_password(locked: RedisServer, url_of: Any) -> None:
    url = url_of(locked.url)
    err = shown(cli("ls", "--url", url), 3)
    assert "wrong password" in err and "***" in err
    data = json.loads(cli("ls", "--json", "--url", url).stdout)
    assert data["error"]["kind"] == "auth" and WRONG not in json.dumps(data)
    # an invalid URL: redis-py's message quotes a piece of the password; not ours
    bad = locked.url.replace("redis://", f"redis://:{WRONG}/x@")
    err = shown(cli("ls", "--url", bad), 2)
    assert "invalid --url" in err and "Wr0ng" not in err


def test_cli_password_from_rediscli_auth(locked: RedisServer) -> None:
    auth = {AUTH_ENV: PW}
    assert shown(cli("ls", "--url", locked.url, env=auth), 0).strip() == "no accumulators"
    err = shown(cli("ls", "--url", locked.url, env={AUTH_ENV: WRONG}), 3)
    assert "wrong password" in err
    # the URL's password wins over $REDISCLI_AUTH (as with redis-cli)
    shown(cli("ls", "--url", _with_password(locked.url), env={AUTH_ENV: WRONG}), 0)
    err = shown(cli("ls", "--url", locked.url), 3)
    assert "requires a password" in err and AUTH_ENV in err


def test_cli_user_flag(locked: RedisServer) -> None:
    admin = redis.Redis(host="127.0.0.1", port=locked.port, password=PW)
    admin.acl_setuser("viewer", enabled=True, passwords=[f"+{WRONG}"], keys=["*"],
                      commands=["+@all"])  # fmt: skip
    try:
        as_viewer = {AUTH_ENV: WRONG}  # the viewer's password (secret all the same)
        assert shown(cli("ls", "--user", "viewer", "--url", locked.url, env=as_viewer), 0)
        assert "wrong password" in shown(cli("ls", "--url", locked.url, env=as_viewer), 3)
        # --user overrides the URL's user name
        url = locked.url.replace("redis://", "redis://nobody@")
        shown(cli("ls", "--user", "viewer", "--url", url, env=as_viewer), 0)
    finally:
        admin.acl_deluser("viewer")
        admin.close()


def test_cli_context_repr_has_no_password() -> None:
    ctx = _cli.Context(url=f"redis://:{PW}@h/0", container=None, json=False, password=WRONG)
    assert PW not in repr(ctx) and WRONG not in repr(ctx)
    assert ctx.shown_url == "redis://:***@h/0"


def test_cli_help_documents_the_connection_options() -> None:
    text = shown(cli("--help"), 0)
    for option in ("--user", "--tls", "--tls-ca-cert", "REDISCLI_AUTH"):
        assert option in text
    assert "--tls-ca-cert" in shown(cli("ls", "--help"), 0)
    for option in ("--user", "--tls", "--tls-ca-cert", "REDISCLI_AUTH"):
        assert option in (_cli.__doc__ or "")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """(TLS port, CA certificate) of a real server with TLS and the password PW."""
    if find_server_binary() is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    d = tmp_path_factory.mktemp("tls")
    # the extensions Python 3.13's strict verification (VERIFY_X509_STRICT) asks of a CA and
    # of the certificates it signs
    (d / "ext").write_text(
        "subjectAltName=IP:127.0.0.1\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    for cmd in (
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=test-ca "
        "-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign",
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1",
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem "
        "-days 1 -extfile ext",
    ):
        subprocess.run(["openssl", *cmd.split()], cwd=d, check=True, capture_output=True)
    port = _free_port()
    args = ["--tls-port", str(port), "--tls-cert-file", str(d / "server.pem"),
            "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.pem"),
            "--tls-auth-clients", "no", "--requirepass", PW]  # fmt: skip
    try:
        server = RedisServer(args=args)
        server.start()
    except RuntimeError as exc:
        pytest.skip(f"redis-server without TLS support? {exc}")
    try:
        yield port, d / "ca.pem"
    finally:
        server.stop()


def test_cli_tls(tls_server: tuple[int, Path]) -> None:
    port, ca = tls_server
    auth = {AUTH_ENV: PW}
    url = f"redis://127.0.0.1:{port}/0"
    out = shown(cli("ls", "--tls", "--tls-ca-cert", str(ca), "--url", url, env=auth), 0)
    assert out.strip() == "no accumulators"
    # --tls-ca-cert implies TLS; a rediss:// URL is TLS too
    shown(cli("ls", "--tls-ca-cert", str(ca), "--url", url, env=auth), 0)
    shown(cli("ls", "--tls-ca-cert", str(ca), "--url", f"rediss://127.0.0.1:{port}/0", env=auth), 0)
    shown(cli("ls", "--url", url, env=auth), 3)  # plain text to a TLS port
    shown(cli("ls", "--tls", "--url", url, env=auth), 3)  # self-signed: not verified
    err = shown(cli("ls", "--tls-ca-cert", "/nonexistent/ca.pem", "--url", url, env=auth), 2)
    assert "no such file" in err
    assert "unix://" in shown(cli("ls", "--tls", "--url", "unix:///tmp/nothing.sock"), 2)


def test_a_library_client_of_a_tls_url_speaks_tls(tls_server: tuple[int, Path]) -> None:
    import numpy as np

    port, ca = tls_server
    url = f"rediss://:{PW}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    with accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="tls", client=url) as acc:
        assert acc.apply_grad(np.ones(2, np.float32), local_step=0)
        assert acc.take_grad(1).tolist() == [1.0, 1.0]


def test_a_tls_handshake_nobody_answers_ends_at_the_connect_timeout() -> None:
    """A TLS client of a plain server (which never answers the handshake) gives up after the
    connect timeout; redis-py's own class waits the command timeout (here: forever)."""
    import socket
    import threading

    import redis

    from accumulator._connection import TLSConnection

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    outcome: list[BaseException] = []

    def connect() -> None:
        conn = TLSConnection(host="127.0.0.1", port=silent.getsockname()[1],
                             socket_connect_timeout=0.3, socket_timeout=None)  # fmt: skip
        try:
            conn.connect()
        except BaseException as exc:  # noqa: BLE001 - the outcome is checked below
            outcome.append(exc)

    try:
        worker = threading.Thread(target=connect, daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the handshake was not bounded by the connect timeout"
        assert outcome and isinstance(outcome[0], (redis.TimeoutError, redis.ConnectionError))
    finally:
        silent.close()


def test_redis_server_logs_no_password(caplog):
    import logging

    from accumulator.testing import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server binary")
    caplog.set_level(logging.DEBUG, logger="accumulator")
    with RedisServer(args=["--requirepass", "s3cret-pw"]) as server:
        assert server.running
    assert "s3cret-pw" not in caplog.text
    assert "--requirepass" in caplog.text
