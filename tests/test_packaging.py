"""What the sdist and the wheel carry, built from this checkout with the build backend
(hatchling, as ``pip install`` and ``python -m build`` would)."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

builders = pytest.importorskip("hatchling.builders.sdist")
wheels = pytest.importorskip("hatchling.builders.wheel")


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist, say)")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return [line for line in out.splitlines() if (ROOT / line).exists()]


def test_the_sdist_carries_every_file_of_the_repository(tmp_path: Path) -> None:
    """Its tests read .env.example, .dockerignore, the README and the scripts: a file left
    out fails them from an unpacked sdist (it left out those two)."""
    tracked = _tracked()
    archive = builders.SdistBuilder(str(ROOT)).build(directory=str(tmp_path))
    with tarfile.open(next(iter(archive))) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = sorted(set(tracked) - names)
    assert not missing, f"left out of the sdist: {missing[:20]}"


def test_the_wheel_carries_the_scripts_the_module_source_and_the_type_marker(
    tmp_path: Path,
) -> None:
    archive = wheels.WheelBuilder(str(ROOT)).build(directory=str(tmp_path),
                                                    versions=["standard"])  # fmt: skip
    with zipfile.ZipFile(next(iter(archive))) as wheel:
        names = set(wheel.namelist())
    lua = {f"accumulator/lua/{p.name}" for p in (ROOT / "lua").glob("*.lua")}
    assert lua and lua <= names, sorted(lua - names)
    assert {"accumulator/module/accsum.c", "accumulator/py.typed"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)  # (Apache-2.0 asks it)
    assert not any(n.startswith(("tests/", "scripts/")) or "__pycache__" in n for n in names)
