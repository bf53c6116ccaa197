"""The public API type-checks in a user's file (py.typed ships): mypy over a snippet that uses
the context managers, and a wrong call that mypy must catch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

USER_CODE = '''
import numpy as np
import accumulator
from accumulator.sync import ParameterServer, Worker


def train(url: str) -> float:
    with accumulator.ConditionalAccumulator(np.float32, (2,), shared_name="g", client=url) as acc:
        acc.apply_grad(np.ones(2, np.float32), local_step=acc.global_step())
        total: np.ndarray = acc.take_grad(1)
    with accumulator.SparseConditionalAccumulator(np.float32, (4, 2), shared_name="s",
                                                  client=url) as sparse:
        slices = sparse.take_indexed_slices_grad(1)
        rows: np.ndarray = slices.indices
    with ParameterServer("job", replicas_to_aggregate=1, client=url) as ps:
        ps.initialize({"w": np.zeros(2, np.float32)})
    with Worker("job", worker_id="w0", client=url) as w:
        step, params = w.pull()
    return float(total.sum() + rows.sum() + step + sum(p.sum() for p in params.values()))
'''


def _mypy(folder: Path, code: str) -> subprocess.CompletedProcess[str]:
    (folder / "user.py").write_text(code)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--follow-imports=silent",
         "user.py"],
        cwd=folder, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_a_users_code_type_checks_strictly(tmp_path: Path) -> None:
    done = _mypy(tmp_path, USER_CODE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_catches_a_misuse(tmp_path: Path) -> None:
    done = _mypy(tmp_path, USER_CODE + "\n\ntrain(3)\n")
    assert done.returncode == 1 and 'incompatible type "int"' in done.stdout, done.stdout


AIO_CODE = '''
import numpy as np
from accumulator import aio


async def train(url: str) -> float:
    acc = await aio.ConditionalAccumulator(np.float32, (2,), shared_name="g", client=url)
    async with acc:
        await acc.apply_grad(np.ones(2, np.float32), local_step=await acc.global_step())
        total: np.ndarray = await acc.take_grad(1)
    return float(total.sum())
'''


def test_asyncio_code_type_checks_and_an_awaited_accumulator_keeps_its_type(
    tmp_path: Path,
) -> None:
    """``await aio.ConditionalAccumulator(...)`` (the README's way to open one) is typed as
    the accumulator, not Any: a misuse after it is caught."""
    done = _mypy(tmp_path, AIO_CODE)
    assert done.returncode == 0, done.stdout + done.stderr
    misuse = AIO_CODE.replace("await acc.take_grad(1)", "await acc.take_grad(1, bogus=3)")
    done = _mypy(tmp_path, misuse)
    assert done.returncode == 1 and '"bogus"' in done.stdout, done.stdout
