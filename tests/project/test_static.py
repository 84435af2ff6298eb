"""Static checks: mypy (strict on the public API, see [tool.mypy]) and ruff (see [tool.ruff]).

``chemio_py.backends`` lives in ``backends/`` (see [tool.setuptools.package-dir]), a mapping
mypy cannot follow, and an editable install reaches it through an import hook mypy does
not run either. So mypy checks a tree of symbolic links laid out as the installed package:
the modules and folders of ``chemio_py/`` plus ``chemio_py/backends -> backends/``. The
tree and mypy's cache live in ``.mypy_cache/`` (git-ignored), so a second run only
rechecks what changed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

ROOT = Path(REPO)
LINTED = ["chemio_py", "backends", "tests", "benchmarks", "examples"]


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{e.stdout}\n{e.stderr}")


def _installed_layout(cache: Path) -> Path:
    """A directory holding ``chemio_py`` as installed: the user layer's files and
    ``backends/`` as its subpackage (symbolic links into the checkout, rebuilt each run)."""
    tree = cache / "chemio_py-tree"
    pkg = tree / "chemio_py"
    shutil.rmtree(tree, ignore_errors=True)
    pkg.mkdir(parents=True)
    for src in sorted((ROOT / "chemio_py").iterdir()):
        if src.suffix in (".py", ".pyi") or src.name == "py.typed" \
                or (src.is_dir() and (src / "__init__.py").is_file()):
            os.symlink(src, pkg / src.name)
    os.symlink(ROOT / "backends", pkg / "backends")
    return tree


def test_mypy_passes_on_chemio_py_and_backends() -> None:
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    cache = ROOT / ".mypy_cache"
    tree = _installed_layout(cache)
    proc = _run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                 "--cache-dir", str(cache), "-p", "chemio_py"],
                cwd=tree, timeout=240)
    assert proc.returncode == 0, f"mypy found problems:\n{proc.stdout}\n{proc.stderr}"
    # every module was checked, the backends' too (the symbolic link was followed)
    modules = sum(len(list((ROOT / d).rglob("*.py"))) for d in ("chemio_py", "backends"))
    m = re.search(r"no issues found in (\d+) source files", proc.stdout)
    assert m and int(m.group(1)) == modules, proc.stdout


def test_ruff_passes() -> None:
    pytest.importorskip("ruff", reason="ruff is in the dev extra")
    proc = _run([sys.executable, "-m", "ruff", "check", "--no-fix", *LINTED], cwd=ROOT,
                timeout=120)
    assert proc.returncode == 0, f"ruff found problems:\n{proc.stdout}\n{proc.stderr}"


def test_py_typed_ships_with_both_packages() -> None:
    """PEP 561 marker in chemio_py and chemio_py.backends, installed as package data."""
    import tomllib

    for d in ("chemio_py", "backends"):
        assert (ROOT / d / "py.typed").is_file(), f"{d}/py.typed is missing"
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = cfg["package-data"]
    assert "py.typed" in data["chemio_py"] and "py.typed" in data["chemio_py.backends"]
