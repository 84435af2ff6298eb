"""Smoke test of the stress run (``benchmarks/bench_stress/``, issue 11).

A short real run at P = 2 under the mpich wheel's ``mpiexec``: every kind of operation on
``local``, ``shm`` and ``auto`` runs and nothing is lost, wrong or raised. Then the checker is
checked: a run with injected corruption must report lost/wrong bytes and fail, and a run
with an injected hang must end (the watchdog) with the stack of the stuck call, a failure
status and nothing left behind. The full-length run is ``chemio bench --only stress``.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_stress")     # a package run as a script
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_stress  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _ours() -> set[str]:
    """The stress run's own RAM directories and MPICH segments in /dev/shm (not the
    segment of this pytest process, which the mpiio tests initialise MPI in)."""
    mine = f"/dev/shm/mpich_shm_{os.getpid():x}_"
    return set(glob.glob("/dev/shm/cio-stress-*")) | {
        p for p in glob.glob(bench_stress.MPICH_SHM) if not p.startswith(mine)}


def _stress(tmp_path, *args: str, timeout: float = 240):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    out = tmp_path / "summary.json"
    before = _ours()
    proc = subprocess.run([sys.executable, SCRIPT, "--workdir", str(work), "--json", str(out),
                           *args], capture_output=True, text=True, timeout=timeout)
    assert out.exists(), proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert len(summary) == 1
    # nothing left behind, whatever happened: work dir, /dev/shm
    assert os.listdir(work) == [], os.listdir(work)
    assert _ours() - before == set()
    return proc, summary[0]


def test_short_run_at_p2_is_clean_and_covers_every_operation(tmp_path):
    proc, s = _stress(tmp_path, "--procs", "2", "--seconds", "8", "--seed", "20261122")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert s["procs"] == 2 and s["seed"] == 20261122 and s["clean"] is True
    assert s["lost_or_wrong_bytes"] == 0
    assert s["errors"] == 0, s["error_details"][:3]
    assert "lost or wrong bytes: 0" in proc.stdout and "seed=20261122" in proc.stdout
    assert s["missing_kinds"] == []
    for kind in bench_stress.REQUIRED_KINDS:
        assert s["ops"].get(kind, 0) > 0, kind
    for backend in ("local", "shm", "auto"):
        assert s["by_backend"].get(backend, 0) > 0, backend
    assert s["bytes_verified"] > 50 * 2**20
    assert s["expected_errors"].get("EndOfFileError", 0) > 0     # past-the-end reads checked
    assert s["rounds"] >= 4
    # bounded: the run ends shortly after --seconds (start-up of two ranks included)
    assert s["wall_seconds"] < 8 + 30


def test_injected_corruption_is_reported_as_lost_or_wrong_bytes(tmp_path):
    proc, s = _stress(tmp_path, "--procs", "1", "--seconds", "3", "--seed", "7",
                      "--inject", "corrupt")
    assert proc.returncode == 1
    assert s["clean"] is False and s["lost_or_wrong_bytes"] > 0
    assert "lost or wrong bytes: 0" not in proc.stdout
    first = next(e for e in s["error_details"] if "differ from the model" in e["message"])
    assert first["replay"] == "--seed 7 --procs 1" and first["op"] > 0 and first["doing"]


def test_injected_hang_ends_with_the_stack_and_cleans_up(tmp_path):
    proc, s = _stress(tmp_path, "--procs", "2", "--seconds", "60", "--seed", "3",
                      "--inject", "hang", "--hang-timeout", "3", timeout=120)
    assert proc.returncode == 1
    assert s["clean"] is False and s["wall_seconds"] < 40
    run_error = next(e for e in s["error_details"] if e["kind"] == "run")
    assert "did not finish" in run_error["message"]
    assert "in read" in run_error["traceback"] and "last operation" in run_error["traceback"]
