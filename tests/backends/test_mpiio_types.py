"""MPI-IO file types chemio builds, checked in a child process (a ROMIO assertion aborts).

MPICH's ROMIO (5.0.2) aborts in ``ADIOI_Flatten_datatype`` (``actual == num_iovs``) on a
vector of a struct whose blocks touch; chemio's type builder must never hand it one. The
smallest case seen: a (2, 7) float32 array of (1, 3) chunks, region [0:2, 2:6].
"""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")

SCRIPT = r"""
import numpy as np, chemio_py as cio
rng = np.random.default_rng(5)
cases = [((2, 7), (1, 3), np.s_[0:2, 2:6])]
for _ in range(60):
    shape = tuple(int(n) for n in rng.integers(1, 9, 2))
    chunks = tuple(int(rng.integers(1, n + 1)) for n in shape)
    lo = [int(rng.integers(0, n)) for n in shape]
    hi = [int(rng.integers(l + 1, n + 1)) for l, n in zip(lo, shape)]
    cases.append((shape, chunks, tuple(slice(a, b) for a, b in zip(lo, hi))))
for shape, chunks, sec in cases:
    model = np.arange(np.prod(shape), dtype="f4").reshape(shape)
    with cio.DiskArray.create("t", shape, "f4", chunks=chunks, backend="mpiio") as d:
        d.write((), model)
        assert np.array_equal(d.read(sec), model[sec]), (shape, chunks, sec)
        d.write(sec, -model[sec])
        model[sec] *= -1
        assert np.array_equal(d.read(()), model), (shape, chunks, sec)
print("ok", len(cases))
"""


def test_touching_blocks_do_not_abort_romio(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=240, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]
