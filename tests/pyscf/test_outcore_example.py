"""``examples/pyscf_outcore.py`` and ``notebooks/03_pyscf_plugin.ipynb``, run as a user runs
them: PySCF's CCSD (out-of-core ERIs), DF-MP2 (out-of-core ovL) and FCI Davidson (subspace
on disk) through ``chemio_py.pyscf.patch`` give PySCF's own energies on h5py to 1e-10 Eh,
on local, shm and auto; chemio carried the scratch (files made, bytes moved, Davidson
subspaces); nothing is left in the scratch root or in the test's own shm directory.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, SHM_DIR

pytest.importorskip("pyscf")

EXAMPLE = Path(REPO) / "examples" / "pyscf_outcore.py"
NOTEBOOK = "03_pyscf_plugin.ipynb"


@pytest.fixture
def shm_dir():
    """A shm directory of this test's own (other tests' segments come and go in the common
    one while this runs); it must be empty at the end."""
    d = tempfile.mkdtemp(prefix="cio-outcore-test-", dir=SHM_DIR)
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _env(tmp_path: Path, shm: Path) -> tuple[dict, Path]:
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update({"CHEMIO_SCRATCH": str(scratch), "CHEMIO_SHM_DIR": str(shm),
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1"})
    return env, scratch


def _no_leftovers(scratch: Path, shm: Path, what: str) -> None:
    left = [str(p) for p in scratch.rglob("*")]
    assert not left, f"{what} left scratch behind: {left[:5]}"
    left = [str(p) for p in shm.rglob("*")]
    assert not left, f"{what} left shm segments behind: {left[:5]}"


def _run(args: list[str], tmp_path: Path,
         shm: Path) -> tuple[subprocess.CompletedProcess, Path]:
    env, scratch = _env(tmp_path, shm)
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=str(tmp_path))
    _no_leftovers(scratch, shm, "the example")
    return proc, scratch


# the script on local; the notebook (test_notebook_pyscf_plugin) runs the same three
# methods through the plug-in on shm and auto
@pytest.mark.parametrize("backend", ["local"])
def test_example_quick_matches_pyscf_on_h5py(backend, tmp_path, shm_dir):
    proc, _ = _run(["--quick", "--backend", backend], tmp_path, shm_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["example"] == "pyscf_outcore" and r["backend"] == backend
    parts = r["parts"]
    assert set(parts) == {"ccsd", "dfmp2", "davidson"}
    for name, p in parts.items():
        assert abs(p["energy"] - p["reference"]) <= 1e-10, (name, p)
        assert p["abs_error"] <= 1e-10 and p["seconds"] > 0 and p["reference_seconds"] > 0
        assert p["bytes_written"] > 0 and p["bytes_read"] > 0, (name, p)  # chemio carried it
    assert parts["ccsd"]["h5tmpfiles"] > 0 and parts["ccsd"]["background_calls"] > 0
    assert parts["dfmp2"]["h5tmpfiles"] >= 2                   # ovL and Lov0
    assert parts["davidson"]["xlists"] >= 2                    # xs and ax on chemio
    # the energies are printed, each pair with its difference, then chemio's I/O report
    for p in parts.values():
        assert f"{p['reference']:19.12f}" in out and f"{p['energy']:19.12f}" in out
    assert "largest difference" in out and "within 1e-10" in out
    assert "MiB written" in out and ".dra" in out
    assert r["io"]["bytes_written"] == sum(p["bytes_written"] for p in parts.values())


def test_example_refuses_bad_input(tmp_path, shm_dir):
    proc, _ = _run(["--quick", "--parts", "ccsd,mp3", "--quiet"], tmp_path, shm_dir)
    assert proc.returncode == 2 and "unknown ['mp3']" in proc.stderr
    proc, _ = _run(["--quick", "--max-memory", "-1", "--quiet"], tmp_path, shm_dir)
    assert proc.returncode == 2 and "give megabytes > 0" in proc.stderr


def test_example_refuses_a_budget_that_keeps_pyscf_in_core():
    """A budget that lets PySCF keep the data in memory is an error, not a silent in-core
    run that compares nothing."""
    from pyscf import gto, scf
    spec = importlib.util.spec_from_file_location("pyscf_outcore_example", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    mol = gto.M(atom="O 0 0 0; H 0 -0.757 0.587; H 0 0.757 0.587", basis="sto-3g",
                verbose=0)
    mf = scf.RHF(mol).run()
    with pytest.raises(ex.NotOutOfCore, match="kept its ERIs in memory"):
        ex.run_ccsd(mf, 5000)
    with pytest.raises(ex.NotOutOfCore, match="subspace in memory"):
        ex.run_davidson(mf, 5000, 4)
    assert ex.run_davidson(mf, 0.001, 4) == pytest.approx(
        mcscf_energy(mf, 4), abs=1e-9)


def mcscf_energy(mf, ncas: int) -> float:
    from pyscf import mcscf
    m = mcscf.CASCI(mf, ncas, ncas)
    m.fcisolver.conv_tol = 1e-13
    return float(m.kernel()[0])


def test_notebook_pyscf_plugin(tmp_path, shm_dir):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebooks = Path(REPO) / "notebooks"
    nb = nbformat.read(notebooks / NOTEBOOK, as_version=4)
    env, scratch = _env(tmp_path, shm_dir)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(notebooks)}})
    client.execute(env=env)
    _no_leftovers(scratch, shm_dir, "the notebook")
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")
    errors = [o for c in nb.cells for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    for needle in ("CCSD", "DF-MP2", "Davidson", "shm", "auto", "scratch cleaned"):
        assert needle in text, f"{needle!r} missing from the notebook output:\n{text}"
    assert "largest difference" in text and "OUTSIDE" not in text
    html = [o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
            if o.get("output_type") == "execute_result" and "text/html" in o.get("data", {})]
    assert any("MiB written" in h for h in html), "no I/O report table in the notebook"
