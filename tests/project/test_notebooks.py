"""The notebooks run end to end in a fresh Jupyter kernel (nbclient), as a reader runs them.

The kernel is the ``python3`` kernelspec, which jupyter_client starts with this very
interpreter (``sys.executable``). It gets its own scratch root, which must be empty when
the notebook ends (its last cell calls ``cio.cleanup()``), and no chemio segment may be
left in the shm directory.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import SHM_DIR
from conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("pyscf")

NOTEBOOKS = Path(REPO) / "notebooks"


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if "chemio" in n}
    except OSError:
        return set()


def execute(name: str, tmp_path: Path) -> "nbformat.NotebookNode":
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ)
    env.update({"CHEMIO_SCRATCH": str(scratch), "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg"})
    # put this interpreter first: the kernelspec's "python" then resolves to it
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    shm_before = _shm_entries()
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute(env=env)
    left = [str(p) for p in scratch.rglob("*")]
    assert not left, f"{name} left scratch behind: {left[:5]}"
    assert not (_shm_entries() - shm_before), f"{name} left shm segments behind"
    assert not list(NOTEBOOKS.glob("*.json")), "a notebook wrote a file next to itself"
    return nb


def _text(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o["text"])
            elif o.get("output_type") == "error":
                out.append(f"{o['ename']}: {o['evalue']}")
    return "".join(out)


def _images(nb) -> int:
    return sum(1 for cell in nb.cells for o in cell.get("outputs", [])
               if o.get("output_type") == "display_data" and "image/png" in o.get("data", {}))


def _html(nb) -> list[str]:
    return [o["data"]["text/html"] for cell in nb.cells for o in cell.get("outputs", [])
            if o.get("output_type") == "execute_result" and "text/html" in o.get("data", {})]


def test_notebook_tour(tmp_path):
    nb = execute("01_tour.ipynb", tmp_path)
    text = _text(nb)
    assert "EndOfFileError" in text and "LimitExceededError" in text
    assert "same as NumPy: True" in text and "same as in memory: True" in text
    assert "-> local" in text
    assert "scratch cleaned" in text
    assert _images(nb) == 1                               # the I/O timeline
    tables = _html(nb)                                    # the DiskArray and cio.report()
    assert len(tables) >= 2, tables
    assert "DiskArray &#x27;tour.dra&#x27;" in tables[0] and ">(2000, 300)<" in tables[0]
    assert ">on disk<" in tables[0] and ">local (format grid)<" in tables[0]
    assert ">MiB written<" in tables[1] and "tour.dra" in tables[1]
    assert "waited" in text and "overlap" in text         # the trace summary
    assert "tour.dra" in text and "DiskArray" in text     # cio.ls() shows the array


def test_notebook_ri_mp2_out_of_core(tmp_path):
    nb = execute("02_ri_mp2_out_of_core.ipynb", tmp_path)
    text = _text(nb)
    assert "passes over B" in text and "dask:" in text     # the asserts inside held
    assert "scratch cleaned" in text
    assert _images(nb) == 1                               # I/O vs compute per block
