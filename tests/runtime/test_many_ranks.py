"""Eight ranks on two cores (oversubscribed), every collective backend, against NumPy models.

Each rank computes the same model; the test counts every element or byte that differs
from it (0 lost), and Counter/Mutex results are checked exactly.
"""
from __future__ import annotations

import pytest

RANKS = 8

BODY = """
import os, numpy as np, chemio_py as cio
c = cio.comm()
P, me = c.size, c.rank
backend = {backend!r}
bad = {{}}

# DiskArray: unaligned 2-D boxes that cut chunks apart (neighbours share chunks), written
# collectively, then read back by a different decomposition.
shape, chunks = (61, 37), (5, 7)
model = (np.arange(61 * 37, dtype="f8").reshape(shape) * 1.5 + 7)
rows = np.linspace(0, 61, 5).astype(int)          # 4 x 2 process grid
cols = np.array([0, 20, 37])
r, k = divmod(me, 2)
box = np.s_[rows[r]:rows[r + 1], cols[k]:cols[k + 1]]
d = cio.DiskArray.create("many", shape, "f8", chunks=chunks, backend=backend)
d.write_all(box, model[box])
lo, hi = me * 61 // P, (me + 1) * 61 // P
mine = d.read_all(np.s_[lo:hi, :])
bad["dra elements"] = int((mine != model[lo:hi]).sum())
again = d.read_all(np.s_[:, :] if me == 0 else np.s_[0:0, :])
if me == 0:
    bad["dra whole"] = int((again != model).sum())
d.close()

if backend != "zarr":
    # SharedFile: round-robin 4 KiB records from every rank, read back by another rank.
    rec, per = 512, 6                              # float64 items per record, records per rank
    sf = cio.SharedFile("many_sf", backend=backend)
    for j in range(per):
        slot = j * P + me
        sf.write(slot * rec * 8, np.full(rec, slot, dtype="f8"))
    sf.sync()
    other = (me + 3) % P
    got = 0
    for j in range(per):
        slot = j * P + other
        got += int((sf.read(slot * rec * 8, np.empty(rec)) != slot).sum())
    bad["sf items"] = got

    # Mutex: read-modify-write of one shared counter under the lock.
    mutex = cio.sync.Mutex()
    cell = np.zeros(1, dtype="i8")
    for _ in range(5):
        with mutex:
            sf.read(1 << 20, cell) if sf.size > (1 << 20) else cell.fill(0)
            cell += 1
            sf.write(1 << 20, cell)
    sf.sync()
    total = sf.read(1 << 20, np.empty(1, dtype="i8"))[0]
    mutex.free()
    bad["mutex"] = int(total != 5 * P)
    sf.destroy()

    # Counter: every value handed out exactly once.
    with cio.sync.Counter() as ctr:
        vals = [ctr.next() for _ in range(7)]
    allv = sorted(v for vs in c.allgather(vals) for v in vs)
    bad["counter"] = int(allv != list(range(7 * P)))

worst = c.allreduce(sum(bad.values()), op="sum")
if me == 0:
    print("BAD", worst, bad, flush=True)
"""


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "shm", "mpiio", "zarr"])
def test_eight_ranks_lose_nothing(mpirun, backend):
    proc = mpirun(RANKS, BODY.format(backend=backend), timeout=240,
                  env={"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("BAD")]
    assert line and line[0].split()[1] == "0", proc.stdout + proc.stderr
