"""The chemistry examples, run as a user runs them, checked against PySCF.

Each example runs in a subprocess (serially, and under a real ``mpiexec``) on water and
must end with its JSON line: ``abs_error`` is the distance to PySCF's own value of the
same quantity. Every run gets its own scratch root, which must be empty afterwards (the
scripts clean up at exit). The checkpoint example is killed with SIGKILL and resumed on a
different number of ranks; ``chemio demo``'s entry point (``ri_mp2.main``) is called in
process.
"""
from __future__ import annotations

import importlib.util
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from conftest import SHM_DIR, mpiexec_path, run_on_tty
from conftest import REPO

EXAMPLES = Path(REPO) / "examples"
WATER = "O 0 0 0; H 0 0.757 0.587; H 0 -0.757 0.587"

pytest.importorskip("pyscf")


def _env(tmp_path: Path, extra: dict | None = None) -> tuple[dict, Path]:
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update({"CHEMIO_SCRATCH": str(scratch), "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    env.update(extra or {})
    return env, scratch


def _command(name: str, args: list[str], n: int | None) -> list[str]:
    script = [str(EXAMPLES / f"{name}.py"), *args]
    if n is None:
        return [sys.executable, *script]
    return [mpiexec_path(), "-n", str(n), sys.executable, "-m", "mpi4py", *script]


def _leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*")]


def run_example(name: str, args: list[str], tmp_path: Path, *, n: int | None = None,
                timeout: float = 180, expect_ok: bool = True) -> dict:
    """Run an example; return its final JSON line (checking exit status and cleanup)."""
    env, scratch = _env(tmp_path)
    proc = subprocess.run(_command(name, args, n), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(tmp_path))
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{name} {' '.join(args)} (n={n}) exited {proc.returncode}\n--- stdout\n"
                    f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{name} printed nothing on stdout; stderr:\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["example"] == name
    assert set(result) >= {"example", "energy", "reference", "abs_error", "io"}
    assert result["abs_error"] == pytest.approx(abs(result["energy"] - result["reference"]),
                                                abs=1e-15)
    assert not _leftovers(scratch), f"{name} left scratch behind: {_leftovers(scratch)[:5]}"
    return result


# ---------------------------------------------------------------------- semi-direct SCF

def test_semi_direct_scf_serial(store, tmp_path):
    r = run_example("semi_direct_scf", ["--atom", WATER, "--basis", "cc-pvdz",
                                        "--backend", store, "--quiet"], tmp_path)
    assert r["abs_error"] < 1e-8
    assert r["converged"] and r["backend"] == store and r["method"] == "rhf"
    assert r["stored_batches"] == r["batches"] > 0 and r["overflow_batches"] == 0
    # the cache was written once and replayed every later iteration
    assert r["io"]["bytes_written"] >= r["stored_bytes"]
    assert r["io"]["bytes_read"] >= (r["iterations"] - 1) * r["stored_bytes"]
    # PySCF's in-core and direct RHF on the same molecule, timed beside this one
    for how in ("incore", "direct"):
        assert abs(r[f"pyscf_{how}_energy"] - r["energy"]) < 1e-8
        assert r[f"pyscf_{how}_seconds"] > 0 and r[f"pyscf_{how}_cycles"] > 0
    assert 0 < r["scf_seconds"] <= r["seconds"]


def test_semi_direct_scf_screening_and_overflow(tmp_path):
    """Two far-apart H2 and a tiny memory budget: Schwarz drops batches; a tiny cache budget
    sends batches back to direct recomputation. The energy is unchanged."""
    atom = "H 0 0 0; H 0 0 0.74; H 0 0 12; H 0 0 12.74"
    r = run_example("semi_direct_scf", ["--atom", atom, "--basis", "sto-3g", "--max-memory",
                                        "0.001", "--max-disk", "0.0001", "--quiet"], tmp_path)
    assert r["abs_error"] < 1e-8
    assert r["screened_batches"] > 0
    assert 0 < r["overflow_batches"] and r["stored_batches"] + r["overflow_batches"] == \
        r["batches"]


def test_semi_direct_scf_uhf(tmp_path):
    r = run_example("semi_direct_scf", ["--atom", "O 0 0 0; H 0 0 0.97", "--basis", "6-31g",
                                        "--spin", "1", "--method", "uhf", "--quiet"], tmp_path)
    assert r["abs_error"] < 1e-8 and r["method"] == "uhf"


@pytest.mark.mpi
def test_semi_direct_scf_mpi(tmp_path):
    r = run_example("semi_direct_scf", ["--basis", "cc-pvdz", "--quiet"], tmp_path, n=2)
    assert r["ranks"] == 2 and r["io"]["ranks"] == 2
    assert r["abs_error"] < 1e-8
    assert r["io"]["files"] == 2                       # one cache (EAF) per rank


# ---------------------------------------------------------------------- RI-MP2

# the whole example on a disk store and a RAM store; every store's byte semantics are the
# conformance suite's (tests/backends), so the example need not run on each of them
@pytest.mark.parametrize("store", ["local", "shm"])
def test_ri_mp2_out_of_core_with_dask(store, tmp_path):
    r = run_example("ri_mp2", ["--basis", "cc-pvdz", "--max-memory", "0.1", "--dask",
                               "--backend", store, "--quiet"], tmp_path)
    assert r["abs_error"] < 1e-9
    assert abs(r["dask_energy"] - r["reference"]) < 1e-9
    # the cap forced blocks smaller than the tensor: several passes over B
    assert r["block_rows"] < r["nocc"] and r["passes"] == r["iblocks"] > 1
    assert r["tensor_reads"] > 1.0
    assert r["io"]["pipelines"]["ri_mp2 j-blocks"]["ops"] > r["iblocks"]


def test_ri_mp2_density_fitted_scf(tmp_path):
    """``--scf df``: the reference is a DF-RHF (JK-fit basis); the MP2 still uses the
    mp2fit basis, and PySCF's DFMP2 on that same SCF agrees. PySCF first, then ours."""
    r = run_example("ri_mp2", ["--basis", "cc-pvdz", "--scf", "df", "--max-memory", "0.05",
                               "--reference-first", "--quiet"], tmp_path)
    assert r["scf"] == "df" and r["abs_error"] < 1e-9
    conventional = -76.026765673  # RHF/cc-pVDZ water; the DF-RHF differs by the JK fit
    assert 1e-7 < abs(r["e_hf"] - conventional) < 1e-3
    assert r["block_rows"] < r["nocc"] and r["aux_blocks"] > 1
    assert r["ooc_seconds"] == pytest.approx(r["build_seconds"] + r["energy_seconds"],
                                             abs=2e-3)
    assert r["reference_seconds"] > 0
    # B went to disk once; the energy loop read it block by block, several passes
    assert r["io"]["pipelines"]["ri_mp2 fit write"]["bytes"] == r["tensor_bytes"]
    assert r["tensor_reads"] > 1.0


def test_ri_mp2_scf_auxbasis_needs_df(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "ri_mp2.py"), "--scf-auxbasis",
                        "cc-pvdz-jkfit", "--quiet"], capture_output=True, text=True,
                       timeout=60, env=_env(tmp_path)[0], cwd=str(tmp_path))
    assert r.returncode == 2 and "--scf-auxbasis needs --scf df" in r.stderr
    assert not _leftovers(tmp_path / "scratch")


@pytest.mark.mpi
def test_ri_mp2_mpi(tmp_path):
    r = run_example("ri_mp2", ["--basis", "cc-pvdz", "--max-memory", "0.1", "--quiet"],
                    tmp_path, n=2)
    assert r["ranks"] == 2 and r["abs_error"] < 1e-9
    assert r["passes"] == r["iblocks"]                  # every i-block taken exactly once


def test_chemio_demo_entry_point(tmp_path, monkeypatch):
    """``chemio demo`` loads examples/ri_mp2.py by path and calls ``main([...])``."""
    spec = importlib.util.spec_from_file_location("ri_mp2_demo", EXAMPLES / "ri_mp2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = io.StringIO()
    with redirect_stdout(out):
        status = mod.main(mod.DEMO_ARGV)
    text = out.getvalue()
    assert status == 0, text
    result = json.loads(text.strip().splitlines()[-1])
    assert result["abs_error"] < 1e-9 and result["passes"] > 1
    for needle in ("RI-MP2 correlation energy", "PySCF DFMP2 reference", "difference",
                   "overlap", "ri_mp2 j-blocks"):
        assert needle in text, f"{needle!r} missing from the demo output:\n{text}"


# ---------------------------------------------------------------------- Davidson

def test_mrci_davidson_serial_with_compression(store, tmp_path):
    r = run_example("mrci_davidson", ["--ncas", "6", "--nelecas", "6", "--compress", "zstd",
                                      "--max-space", "4", "--backend", store, "--quiet"],
                    tmp_path)
    assert r["abs_error"] < 1e-8 and r["converged"]
    assert r["compressed_bytes_written"] > 0


@pytest.mark.mpi
def test_mrci_davidson_three_ranks(tmp_path):
    r = run_example("mrci_davidson", ["--ncas", "6", "--nelecas", "6", "--tasks", "7",
                                      "--quiet"], tmp_path, n=3)
    assert r["ranks"] == 3 and r["abs_error"] < 1e-8


# ---------------------------------------------------------------------- checkpoint/restart

CKPT = ["--ncas", "6", "--nelecas", "6", "--steps", "18", "--every", "3"]


def _pointer(ckdir: Path) -> dict:
    return json.loads((ckdir / "latest.json").read_text())


def _same_run(a: dict, b: dict) -> None:
    assert a["steps"] == b["steps"]
    np.testing.assert_allclose(a["trajectory"], b["trajectory"], rtol=0, atol=1e-10)
    assert a["state_fingerprint"] == pytest.approx(b["state_fingerprint"], abs=1e-10)
    assert a["energy"] == pytest.approx(b["energy"], abs=1e-10)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt-ref")
    r = run_example("checkpoint_restart", CKPT + ["--checkpoint-dir", str(tmp / "ck"),
                                                  "--quiet"], tmp)
    assert r["resumed_from"] is None and r["abs_error"] < 1e-8
    assert not (tmp / "ck").exists()                 # removed after success
    return r


def _ranks_of(launcher: int, script: str) -> list[int]:
    """The processes below ``launcher`` (mpiexec) that run ``script``: its ranks."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    below, todo = set(), [launcher]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in below]
        below.update(kids)
        todo += kids
    ranks = []
    for pid in sorted(below):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if script.encode() in fh.read():
                    ranks.append(pid)
        except OSError:
            pass
    return ranks


def _mpich_segments() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}
    except OSError:
        return set()


@pytest.mark.mpi
def test_checkpoint_sigkill_mpi_then_resume_serial(tmp_path, uninterrupted):
    ckdir = tmp_path / "ck"
    env, scratch = _env(tmp_path)
    cmd = _command("checkpoint_restart", CKPT + ["--checkpoint-dir", str(ckdir),
                                                  "--step-delay", "0.15"], n=2)
    mpich_before = _mpich_segments()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(tmp_path), start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stderr], daemon=True).start()
    pids, killed_after = [], None
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            try:
                ln = lines.get(timeout=1)
            except queue.Empty:
                if proc.poll() is not None:
                    break
                continue
            if "checkpoint of step 6 complete" in ln:
                killed_after = 6
                pids = _ranks_of(proc.pid, "checkpoint_restart.py")
                for pid in pids:                        # the ranks, mid-run
                    os.kill(pid, signal.SIGKILL)
                break
    finally:
        if proc.poll() is None:
            try:
                proc.wait(timeout=30)                   # hydra ends the job after a kill
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert killed_after == 6 and len(pids) == 2, "the run did not reach its 2nd checkpoint"
    assert proc.returncode != 0
    first = _pointer(ckdir)
    assert 6 <= first["step"] < 18 and first["ranks"] == 2
    # The killed ranks could not clean their scratch: that is what `chemio clean` is for.
    clean = subprocess.run([sys.executable, "-m", "chemio_py.cli", "clean", "--root",
                            str(scratch)], capture_output=True, text=True, env=env, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert [n for n in os.listdir(scratch) if n.startswith("chemio-")] == []
    # Nor could MPICH unlink the shared-memory segments of the killed job.
    for name in _mpich_segments() - mpich_before:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass
    r = run_example("checkpoint_restart", CKPT + ["--checkpoint-dir", str(ckdir), "--quiet"],
                    tmp_path)
    assert r["ranks"] == 1 and r["resumed_from"] == first["step"]
    assert r["checkpoints_written"] == (18 - first["step"]) // 3
    assert r["abs_error"] < 1e-8
    _same_run(r, uninterrupted)
    assert not ckdir.exists()


@pytest.mark.mpi
def test_checkpoint_torn_write_serial_then_resume_on_two_ranks(tmp_path, uninterrupted):
    """Killed halfway through writing a checkpoint: the pointer still names the previous,
    complete generation and the resumed run (2 ranks) ends as the uninterrupted one."""
    ckdir = tmp_path / "ck"
    env, scratch = _env(tmp_path)
    proc = subprocess.run(_command("checkpoint_restart", CKPT + ["--checkpoint-dir", str(ckdir),
                                                                 "--die-in-checkpoint", "9"],
                                   None), capture_output=True, text=True, env=env,
                          timeout=120, cwd=str(tmp_path))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert _pointer(ckdir)["step"] == 6
    import shutil
    shutil.rmtree(scratch)
    r = run_example("checkpoint_restart", CKPT + ["--checkpoint-dir", str(ckdir), "--quiet"],
                    tmp_path, n=2)
    assert r["ranks"] == 2 and r["resumed_from"] == 6
    _same_run(r, uninterrupted)


def test_checkpoint_refuses_another_problem(tmp_path):
    ckdir = tmp_path / "ck"
    env, scratch = _env(tmp_path)
    base = ["--ncas", "4", "--nelecas", "4", "--steps", "4", "--every", "2",
            "--checkpoint-dir", str(ckdir), "--quiet"]
    run_example("checkpoint_restart", base + ["--keep-checkpoint"], tmp_path)
    before = (ckdir / "latest.json").read_bytes()
    proc = subprocess.run(_command("checkpoint_restart", base[:-3] + ["--checkpoint-dir",
                          str(ckdir), "--basis", "sto-3g"], None), capture_output=True,
                          text=True, env=env, timeout=120, cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "belongs to another problem" in proc.stderr
    assert (ckdir / "latest.json").read_bytes() == before          # nothing changed


def test_xyz_file_input(tmp_path):
    xyz = tmp_path / "water.xyz"
    xyz.write_text("3\nwater\nO 0 0 0\nH 0 0.757 0.587\nH 0 -0.757 0.587\n")
    r = run_example("ri_mp2", ["--atom", str(xyz), "--basis", "sto-3g", "--quiet"], tmp_path)
    from pyscf import gto, scf
    mf = scf.RHF(gto.M(atom=WATER, basis="sto-3g", verbose=0))
    mf.conv_tol = 1e-11
    assert r["e_hf"] == pytest.approx(mf.kernel(), abs=1e-9)      # the same molecule
    assert r["abs_error"] < 1e-9


def test_no_shm_left_behind():
    left = [n for n in os.listdir(SHM_DIR) if "ri_mp2" in n or "davidson" in n
            or "scf-batches" in n] if os.path.isdir(SHM_DIR) else []
    assert not left


# ---------------------------------------------------------------------- --quiet and progress

QUIET_RUNS = {
    "semi_direct_scf": ["--basis", "sto-3g"],
    "ri_mp2": ["--basis", "sto-3g"],
    "mrci_davidson": ["--basis", "sto-3g", "--ncas", "4", "--nelecas", "4"],
    "checkpoint_restart": ["--basis", "sto-3g", "--ncas", "4", "--nelecas", "4",
                           "--steps", "12", "--every", "4"],
}


def test_quiet_prints_nothing_but_the_json_line(tmp_path):
    for name, args in QUIET_RUNS.items():
        if name == "checkpoint_restart":
            args = args + ["--checkpoint-dir", str(tmp_path / "ck")]
        env, scratch = _env(tmp_path)
        proc = subprocess.run(_command(name, args + ["--quiet"], None), capture_output=True,
                              text=True, timeout=120, env=env, cwd=str(tmp_path))
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        assert proc.stderr == "", f"{name} --quiet wrote to stderr:\n{proc.stderr[-3000:]}"
        lines = proc.stdout.splitlines()
        assert len(lines) == 1, f"{name} --quiet printed {len(lines)} lines:\n{proc.stdout}"
        assert json.loads(lines[0])["example"] == name
        assert not _leftovers(scratch)


def test_progress_bar_on_a_terminal_and_none_with_quiet(tmp_path):
    """On a terminal (a pty) the SCF cycles get a tqdm bar between the log lines; with
    --quiet the same run writes nothing there."""
    env, scratch = _env(tmp_path)
    code = ("import runpy, sys, chemio_py.runtime.progress as P; P.AUTO_DELAY = 0.0; "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")

    def on_tty(extra: list[str]) -> tuple[int, str, str]:
        return run_on_tty([sys.executable, "-c", code, str(EXAMPLES / "semi_direct_scf.py"),
                           "--basis", "sto-3g", *extra], env=env, cwd=str(tmp_path))

    rc, out, tty = on_tty([])
    assert rc == 0, tty
    assert "semi_direct_scf: SCF cycles" in tty and "cycle/s" in tty
    assert "cycle  1  E =" in tty                      # the log lines are still there
    assert json.loads(out.splitlines()[-1])["converged"]
    rc, out, tty = on_tty(["--quiet"])
    assert rc == 0 and tty == "" and len(out.splitlines()) == 1
    assert not _leftovers(scratch)
