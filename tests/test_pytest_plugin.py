"""The pytest plugin users get with the package: ``redis_server`` and ``redis_url`` in their
own tests, nothing else to install (run here as a user would: pytest in a fresh directory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from accumulator.testing import find_server_binary

USER_TESTS = '''
import numpy as np
import accumulator


def test_training_loop(redis_url):
    acc = accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="loop",
                                             client=redis_url)
    assert acc.apply_grad(np.ones(2, np.float32))
    assert acc.apply_grad(np.zeros(2, np.float32))
    assert acc.take_grad(2).tolist() == [0.5, 0.5]
    acc.apply_grad(np.ones(2, np.float32), local_step=1)  # left pending


def test_each_test_starts_empty(redis_url, redis_server):
    assert redis_url == redis_server.url
    assert accumulator.list_accumulators(client=redis_url) == []


def test_a_crash_test_that_fails_before_its_restart(redis_url, redis_server):
    redis_server.kill()
    assert False, "failed before redis_server.start()"


def test_the_next_test_gets_a_running_server(redis_url):
    assert accumulator.list_accumulators(client=redis_url) == []
'''


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(folder)],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.real
def test_a_users_tests_get_a_throwaway_server_from_the_plugin(tmp_path: Path) -> None:
    if find_server_binary() is None:
        pytest.skip("no redis-server binary")
    (tmp_path / "test_loop.py").write_text(USER_TESTS)
    done = _pytest(tmp_path)
    # (one crash test that failed before its restart broke every later one: new-user review)
    assert "1 failed, 3 passed" in done.stdout, done.stdout + done.stderr


def test_a_local_clusters_ports_leave_the_callers_random_alone() -> None:
    """Seeded alike (pytest-xdist with pytest-randomly), two processes picked the same
    ports, and the caller's stream moved (new-user review)."""
    import random

    from accumulator._testing_cluster import _cluster_port

    random.seed(7)
    expected = random.random()
    random.seed(7)
    picked = {_cluster_port() for _ in range(5)}
    assert random.random() == expected and len(picked) > 1


FAKE_TESTS = '''
import asyncio

import numpy as np
import accumulator
from accumulator import aio


def test_a_fake_redis(fake_redis):
    acc = accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="w",
                                             client=fake_redis)
    assert acc.apply_grad(np.ones(2, np.float32))
    acc.apply_grad(np.ones(2, np.float32), local_step=1)  # left pending


def test_each_fake_starts_empty_and_the_async_twin_shares_it(fake_redis, fake_async_redis):
    assert accumulator.list_accumulators(client=fake_redis) == []
    sync = accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="w",
                                              client=fake_redis)
    sync.apply_grad(np.full(2, 3.0, np.float32))

    async def main():
        async with aio.ConditionalAccumulator(np.float32, (2,), shared_name="w",
                                              client=fake_async_redis) as acc:
            return (await acc.take_grad(1)).tolist()

    assert asyncio.run(main()) == [3.0, 3.0]
'''


def test_a_users_tests_get_fake_clients_from_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "test_fake.py").write_text(FAKE_TESTS)
    done = _pytest(tmp_path)
    assert "2 passed" in done.stdout, done.stdout + done.stderr


def test_the_plugin_can_be_turned_off(tmp_path: Path) -> None:
    (tmp_path / "test_loop.py").write_text(USER_TESTS)
    done = _pytest(tmp_path, "-p", "no:accumulator")
    assert done.returncode != 0
    assert "fixture 'redis_url' not found" in done.stdout


def test_loading_the_plugin_imports_neither_redis_nor_numpy() -> None:
    """pytest loads the plugin in every run where the package is installed: it must cost a
    run that uses none of its fixtures nothing (the package's names load on first use)."""
    code = (
        "import sys, accumulator._pytest_plugin\n"
        "loaded = sorted(m for m in ('redis', 'numpy', 'msgpack', 'accumulator._core')"
        " if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "import accumulator\n"
        "assert accumulator.ConditionalAccumulator.__module__ == 'accumulator._dense'\n"
        "assert 'numpy' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_every_public_name_loads_from_where_the_package_says() -> None:
    import accumulator

    where = accumulator._WHERE
    errors = accumulator._errors.__all__
    assert sorted([*where, *errors, "__version__"]) == sorted(accumulator.__all__)
    for name in accumulator.__all__:
        assert getattr(accumulator, name) is not None
    assert set(accumulator.__all__) <= set(dir(accumulator))
    with pytest.raises(AttributeError, match="has no attribute 'ConditonalAccumulator'"):
        accumulator.ConditonalAccumulator  # type: ignore[attr-defined]  # noqa: B018
