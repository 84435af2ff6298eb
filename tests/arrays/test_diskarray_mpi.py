"""DiskArray under a real ``mpiexec``: collective creation, write_all of block sections,
reopening with another number of ranks, to_dask, scratch arrays, and failure agreement.

The model is the array ``m[i, j] = 1000 * i + j + 0.25`` (float64), computed by NumPy.
"""
import numpy as np
import pytest

import chemio_py as cio

pytestmark = pytest.mark.mpi

SHAPE = (37, 23)
CHUNKS = (5, 7)          # block sections cut through chunks: ranks share chunks


def model():
    i, j = np.indices(SHAPE)
    return 1000.0 * i + j + 0.25


WRITE = """
import numpy as np, chemio_py as cio
c = cio.comm()
assert c.size == {n}
d = cio.DiskArray.create("dist", {shape}, "f8", chunks={chunks}, path={path!r})
sec = cio.block_section(d.shape, axis={axis})
i, j = np.indices(d.shape)
m = 1000.0 * i + j + 0.25
d.write_all(sec, m[sec])
got = d.read_all(())
assert np.array_equal(got, m), "read_all after write_all"
d.close()
print(f"rank{{c.rank}}:wrote:{{sec}}", flush=True)
"""

REOPEN = """
import numpy as np, chemio_py as cio
c = cio.comm()
d = cio.DiskArray.open({path!r})
i, j = np.indices(d.shape)
m = 1000.0 * i + j + 0.25
sec = cio.block_section(d.shape)
mine = d.read_all(sec)
assert np.array_equal(mine, m[sec])
assert np.array_equal(d[...], m)
s = float(d.to_dask().sum().compute())
assert abs(s - m.sum()) <= 1e-9 * abs(m.sum()), (s, m.sum())
d.close()
print(f"rank{{c.rank}}:reopen-ok", flush=True)
"""


@pytest.mark.parametrize("n,axis", [(3, 0), (4, 1)])
def test_write_all_then_reopen_with_other_rank_counts(mpirun, tmp_path, n, axis):
    path = str(tmp_path / "dist.dra")
    p = mpirun(n, WRITE.format(n=n, shape=SHAPE, chunks=CHUNKS, path=path, axis=axis))
    assert p.stdout.count(":wrote:") == n, p.stdout
    p = mpirun(2, REOPEN.format(path=path))
    assert p.stdout.count(":reopen-ok") == 2
    d = cio.DiskArray.open(path)                   # serially, in this process
    assert d.shape == SHAPE and d.chunks == CHUNKS
    m = model()
    np.testing.assert_array_equal(d[...], m)
    assert float(d.to_dask().sum().compute()) == pytest.approx(m.sum(), rel=1e-12)
    d.delete()
    assert not (tmp_path / "dist.dra").exists() and not (tmp_path / "dist.dra.json").exists()


SCRATCH = """
import os, numpy as np, chemio_py as cio
from chemio_py.errors import CollectiveError, SectionError
from chemio_py.backends.grid import block_bounds
c = cio.comm()
d = cio.DiskArray.create("shared_scr", (11, 6), "i8", chunks=(4, 6))
paths = c.allgather(d.path)
assert len(set(paths)) == 1, paths
sec = cio.block_section(d.shape, chunks=d.chunks)
d.write_all(sec, np.full((sec[0].stop - sec[0].start, 6), c.rank + 1))
full = d.read_all(())
want = np.zeros((11, 6), "i8")
for r in range(c.size):
    lo, hi = block_bounds(11, c.size, r, 4)
    want[lo:hi] = r + 1
assert np.array_equal(full, want), full
# a bad section on one rank: every rank raises, nothing is written
before = d.read_all(())
bad = np.s_[0:99] if c.rank == 1 else sec
try:
    d.write_all(bad, np.zeros((1,)) if c.rank == 1 else np.zeros(d[sec].shape, "i8"))
except SectionError:
    assert c.rank == 1
    print(f"rank{c.rank}:own-error", flush=True)
except CollectiveError as e:
    assert c.rank != 1 and 1 in e.failures
    print(f"rank{c.rank}:collective-error", flush=True)
else:
    raise AssertionError("no error")
assert np.array_equal(d.read_all(()), before)
d.close()
assert not os.path.exists(paths[0])
print(f"rank{c.rank}:scratch-ok", flush=True)
"""


def test_scratch_array_is_shared_and_failures_raise_everywhere(mpirun):
    p = mpirun(3, SCRATCH)
    assert p.stdout.count(":scratch-ok") == 3
    assert p.stdout.count(":own-error") == 1 and p.stdout.count(":collective-error") == 2
