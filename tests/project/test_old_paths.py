"""Module paths from before the folders keep working, as the same module objects, and the
checkout holds one copy of the package (issue 22)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

import chemio_py as cio
from chemio_py import _imports
from chemio_py.runtime import pool, trace
from conftest import REPO


@pytest.mark.parametrize("old", sorted(_imports.MOVED))
def test_an_old_path_imports_the_new_module(old):
    assert importlib.import_module(old) is importlib.import_module(_imports.MOVED[old])


def test_old_attributes_of_the_face_and_of_split_modules():
    assert cio.stats.plot_timeline is importlib.import_module(
        "chemio_py.runtime.stats").plot_timeline
    assert cio.requests.Request is cio.Request
    assert cio.stats.span is trace.span and cio.stats.trace_events is trace.trace_events
    assert cio.requests.submit is pool.submit and cio.requests.queued is pool.queued
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        cio.nonsense  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        cio.requests.nonsense  # noqa: B018


def test_packages_that_were_modules_keep_their_public_names():
    from chemio_py.backends.local import LocalBackend
    from chemio_py.backends.mpiio import MpiioBackend
    from chemio_py.backends.shm import ShmBackend
    from chemio_py.scratch import (FsInfo, cleanup, job_dir, job_id, remove_job_dir,
                                   scan_job_dirs, stat)
    assert LocalBackend.__module__ == "chemio_py.backends.local.backend"
    assert ShmBackend and MpiioBackend and FsInfo and cleanup and job_dir and job_id
    assert remove_job_dir and scan_job_dirs and stat is cio.stat


def _fresh(code: str, cwd: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_copy_of_the_package_from_the_checkout():
    """``import chemio_py.chemio_py`` fails (the checkout root is not on the package's
    path) and the backends are found as ``chemio_py.backends``, once."""
    got = _fresh(
        "import json, importlib.util, sys\n"
        "import chemio_py, chemio_py.backends as b\n"
        "second = importlib.util.find_spec('chemio_py.chemio_py') is not None\n"
        "print(json.dumps({'second': second, 'path': list(chemio_py.__path__),\n"
        "                  'backends': b.__name__,\n"
        "                  'copies': [m for m in sys.modules if m.count('chemio_py') > 1]}))\n",
        cwd=REPO)
    assert got == {"second": False, "path": [os.path.join(REPO, "chemio_py")],
                   "backends": "chemio_py.backends", "copies": []}
