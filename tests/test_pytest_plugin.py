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
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_the_plugin_can_be_turned_off(tmp_path: Path) -> None:
    (tmp_path / "test_loop.py").write_text(USER_TESTS)
    done = _pytest(tmp_path, "-p", "no:accumulator")
    assert done.returncode != 0
    assert "fixture 'redis_url' not found" in done.stdout
