"""The collective lifecycle (issue 12 item 2) and the user layer's other new duties:

* a ``CollectiveOpen`` backend's stores open on every rank together, with ``comm``, and
  close together in ``close()``/``destroy()``; ``__del__`` and interpreter exit only ever
  call ``close_local()`` (a collective there would hang);
* backend options go to the backend, unknown ones are an error that creates nothing;
* a ``write_all`` whose sections overlap raises on every rank and writes nothing;
* ``SharedFile.close()`` and ``sync()`` are collective.
"""
from __future__ import annotations

import os

import pytest

import chemio_py as cio
from chemio_py.errors import ArgumentError
from conftest import TESTS

TESTS = TESTS

REGISTER = f"""
import sys; sys.path.insert(0, {TESTS!r})
import chemio_py.backends as backends
from collective_backend import CollectiveBackend
backends.register("together", CollectiveBackend)
"""


def _calls(directory: str) -> dict[str, list[str]]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if ".calls." in name:
            out[name] = open(os.path.join(directory, name)).read().split()
    return out


def test_collective_store_opens_and_closes_on_every_rank(mpirun, tmp_path):
    """close() calls every rank's store close (a barrier here); the log shows who did."""
    out = tmp_path / "arr"
    out.mkdir()
    mpirun(3, REGISTER + f"""
import numpy as np, chemio_py as cio
c = cio.comm()
d = cio.DiskArray.create("t", (30, 4), "i8", chunks=(10, 4), backend="together",
                         path={str(out)!r})
d.write_all(cio.block_section(d.shape), np.full((10, 4), c.rank + 1))
d.close()
e = cio.DiskArray.open(d.path, "r", backend="together")
assert (e.read_all(())[:, 0] == np.repeat([1, 2, 3], 10)).all()
e.close()
sf = cio.SharedFile("s", backend="together")
sf.write(8 * c.rank, np.array([c.rank], "f8"))
sf.sync()
assert list(sf.read(0, np.empty(c.size))) == [0.0, 1.0, 2.0]
sf.destroy()
print("ok", flush=True)
""", timeout=120)
    calls = _calls(str(out))
    assert sorted(calls) == [f"t.dra.calls.{r}" for r in range(3)]
    for r in range(3):                  # create and open: collective open, collective close
        assert calls[f"t.dra.calls.{r}"] == ["open", "w+", "close", "open", "r", "close"]


def test_exit_and_del_never_call_a_collective_close(mpirun, tmp_path):
    """Objects left open at exit, or dropped, close locally: rank 1 exits while rank 0
    still holds everything; no rank waits for the other (a collective close would hang)."""
    out = tmp_path / "arr"
    out.mkdir()
    proc = mpirun(2, REGISTER + f"""
import gc, numpy as np, chemio_py as cio
c = cio.comm()
kept = cio.DiskArray.create("kept", (8,), "f8", backend="together", path={str(out)!r})
dropped = cio.DiskArray.create("dropped", (8,), "f8", backend="together",
                               path={str(out)!r})
sf = cio.SharedFile("left", backend="together")
del dropped
gc.collect()
if c.rank == 1:
    cio.cleanup()               # what happens at exit, on one rank only
print("ok", flush=True)
""", timeout=60)
    assert proc.stdout.count("ok") == 2
    calls = _calls(str(out))
    for r in range(2):
        assert calls[f"dropped.dra.calls.{r}"] == ["open", "w+", "close_local"]
        assert calls[f"kept.dra.calls.{r}"] == ["open", "w+", "close_local"]


def test_collective_open_failing_on_one_rank_raises_everywhere(mpirun, tmp_path):
    """Rank 1's store cannot open: rank 1 raises its error, rank 0 a CollectiveError
    naming it, and nobody is left inside the backend's collective steps."""
    proc = mpirun(2, REGISTER + f"""
import chemio_py as cio
from chemio_py.errors import CollectiveError, StorageError
c = cio.comm()
d = cio.DiskArray.create("f", (6,), "f8", backend="together", path={str(tmp_path)!r})
d.close()
if c.rank == 1:
    import example_backend
    def refuse(path, mode, perms=0o600):
        raise StorageError(13, path, None, None, "open", "refused on rank 1")
    example_backend._open = refuse
try:
    cio.DiskArray.open(d.path, "r+", backend="together")
    raise SystemExit("the open did not fail")
except (StorageError, CollectiveError) as e:
    assert isinstance(e, StorageError if c.rank == 1 else CollectiveError), repr(e)
    print("raised", flush=True)
""", timeout=60)
    assert proc.stdout.count("raised") == 2


def test_unknown_backend_options_are_refused_and_create_nothing(tmp_path):
    with pytest.raises(ArgumentError, match=r"backend 'local' has no option compressor .*"
                                            r"takes none"):
        cio.DiskArray.create("o", (4, 4), "f8", backend="local", path=tmp_path,
                             compressor="zstd")
    assert os.listdir(tmp_path) == []
    d = cio.DiskArray.create("o", (4, 4), "f8", backend="local", path=tmp_path)
    d.close()
    with pytest.raises(ArgumentError, match="has no option lock"):
        cio.DiskArray.open(d.path, backend="local", lock=True)
    cio.DiskArray.open(d.path, "r+").delete()


@pytest.mark.parametrize("backend", ["local", "shm"])
def test_overlapping_write_all_raises_on_every_rank_and_writes_nothing(mpirun, backend):
    proc = mpirun(3, f"""
import numpy as np, chemio_py as cio
from chemio_py.errors import SectionError
c = cio.comm()
with cio.DiskArray.create("ov", (12, 5), "f8", chunks=(4, 5), backend={backend!r}) as d:
    sec = [np.s_[0:5, :], np.s_[4:8, :], np.s_[8:12, :]][c.rank]   # rows 4 of 0 and 1 meet
    try:
        d.write_all(sec, np.ones(d[sec].shape))
    except SectionError as e:
        assert "rank 0 [0:5, 0:5] and rank 1 [4:8, 0:5] overlap" in str(e), e
        print("refused", flush=True)
    assert not d.read_all(()).any()                               # nothing was written
    empty = np.s_[0:0, :] if c.rank else np.s_[0:12, :]            # empty sections never meet
    d.write_all(empty, np.ones(d[empty].shape))
    assert d.read_all(()).all()
""", timeout=120)
    assert proc.stdout.count("refused") == 3


@pytest.mark.parametrize("backend", ["local", "shm"])
def test_shared_file_close_and_sync_are_collective(mpirun, backend):
    proc = mpirun(2, f"""
import os, numpy as np, chemio_py as cio
c = cio.comm()
sf = cio.SharedFile("cs", backend={backend!r})
sf.write(8 * c.rank, np.array([c.rank + 1.0]))
sf.sync()                                   # every rank's write visible to all after it
assert list(sf.read(0, np.empty(2))) == [1.0, 2.0]
sf.close()                                  # collective; the file stays until destroy()
assert sf.closed and os.path.exists(sf.path)
sf.close()                                  # idempotent, takes no part
sf.destroy()
assert not os.path.exists(sf.path)
print("ok", flush=True)
""", timeout=120)
    assert proc.stdout.count("ok") == 2
