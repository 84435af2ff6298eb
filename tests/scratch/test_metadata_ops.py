"""Issue 21: metadata operations a parallel file system pays per rank.

* ``zarr`` arrays are removed by all ranks together, each a share of the key tree
  (``removal_share``), then rank 0 removes the rest: every share is right, the end state
  is empty, nothing outside the array is touched (links planted inside are removed, their
  targets stay), and a part that cannot be removed does not stop the rest.
* The registry's availability check of ``zarr`` does not import zarr-python, nor does an
  array's life on the zarr backend.
* An ``mpiio`` array used only collectively opens no ``COMM_SELF`` handle, and only rank 0
  opens an ``os`` descriptor (checked through ``/proc/self/fd``).
* A ``local`` array learns its file system from one ``fstatfs`` of its descriptor: no
  mount-table scan, no ``realpath`` (checked with strace when it is installed).
"""
from __future__ import annotations

import errno
import math
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

import chemio_py.backends as backends
from chemio_py.scratch import fs
from chemio_py.backends import posix
from chemio_py.errors import StorageError

ZARR = "zarr" in backends.names() and backends.availability().get("zarr", (False,))[0]
needs_zarr = pytest.mark.skipif(not ZARR, reason="the zarr backend is not usable here")


def _zarr_array(path: str, shape=(60, 40), chunks=(5, 10)) -> str:
    """A Zarr array at ``path`` with every object stored (no zero objects are skipped)."""
    be = backends.resolve("zarr")
    st = be.open_array(path, "w+", shape=shape, dtype=np.dtype("f8"), chunks=chunks,
                       inner_chunks=False)
    st.write(tuple(slice(0, n) for n in shape), np.arange(math.prod(shape), dtype="f8")
             .reshape(shape) + 1)
    st.close()
    return path


def _tree(path: str) -> set[str]:
    out = set()
    for d, dirs, files in os.walk(path):
        out |= {os.path.relpath(os.path.join(d, n), path) for n in dirs + files}
    return out


# ---------------------------------------------------------------- zarr: who removes what

@pytest.mark.parametrize("grid", [(1,), (5,), (32, 32), (12, 4), (2, 5000, 3), (3, 1, 7),
                                  (0, 4), (7, 1, 1), (10**30, 3)])
def test_removal_shares_are_contiguous_disjoint_and_cover_every_unit(grid):
    from chemio_py.backends.zarr.backend import removal_share
    for size in (1, 2, 3, 4, 8, 13, 64):
        shares = [removal_share(grid, r, size) for r in range(size)]
        levels = {s[0] for s in shares}
        assert len(levels) == 1
        level = levels.pop()
        units = math.prod(grid[:level + 1])
        shallower = math.prod(grid[:level])
        # the shallowest level with at least one unit per rank (else the objects)
        assert units >= size or level == len(grid) - 1
        assert level == 0 or shallower < size
        ends = [0] + [e for _, _, e in shares]
        assert [f for _, f, _ in shares] == ends[:-1] and ends[-1] == units


@needs_zarr
def test_each_rank_removes_exactly_its_share(tmp_path):
    """``_remove_share`` of rank r of 3 takes away its directories ``c/<i>`` and nothing
    else: what every rank does inside ``remove_all`` before rank 0 removes the rest."""
    from chemio_py.backends.zarr.backend import _remove_share, removal_share
    grid = (12, 4)
    for rank in range(3):
        path = _zarr_array(str(tmp_path / f"a{rank}.zarr"))
        before = _tree(path)
        failures: list = []
        _remove_share(path, grid, rank, 3, failures)
        assert failures == []
        level, first, end = removal_share(grid, rank, 3)
        assert level == 0 and end - first == 4
        mine = {f"c/{i}" for i in range(first, end)}
        assert before - _tree(path) == {p for p in before if "/".join(p.split("/")[:2]) in mine}
        assert mine <= before


@needs_zarr
def test_a_share_of_objects_inside_shared_directories(tmp_path):
    """More ranks than directories: shares are objects (one unlinkat each), directories
    stay for rank 0."""
    from chemio_py.backends.zarr.backend import _remove_share
    path = _zarr_array(str(tmp_path / "o.zarr"), shape=(10, 40), chunks=(5, 10))  # grid 2x4
    failures: list = []
    _remove_share(path, (2, 4), 1, 3, failures)     # units 8: rank 1 has objects 2..4
    assert failures == []
    left = _tree(path)
    assert {"c/0/2", "c/0/3", "c/1/0"}.isdisjoint(left)
    assert {"c/0", "c/1", "c/0/0", "c/0/1", "c/1/1", "zarr.json"} <= left


@needs_zarr
def test_removal_by_three_ranks_leaves_nothing_and_touches_nothing_outside(mpirun, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep me")
    path = str(tmp_path / "r.zarr")
    p = mpirun(3, f"""
        import os, numpy as np, chemio_py as cio
        from chemio_py.backends.zarr.backend import removal_share
        c = cio.comm()
        d = cio.DiskArray.create("r", (60, 40), "f8", chunks=(5, 10), backend="zarr",
                                 path={path!r}, persistent=True, inner_chunks=False)
        sec = cio.block_section(d.shape, axis=0)
        d.write_all(sec, np.full(tuple(s.stop - s.start for s in sec), 1.0 + c.rank))
        if c.rank == 0:             # links to the outside, where shares and rank 0 go
            os.symlink({str(outside)!r}, os.path.join({path!r}, "c", "5", "evil"))
            os.symlink({str(outside / "keep")!r}, os.path.join({path!r}, "c", "9", "0x"))
            os.symlink({str(outside)!r}, os.path.join({path!r}, "link"))
            os.symlink({str(outside)!r}, os.path.join({path!r}, "c", "99"))
        c.barrier()
        shares = c.allgather(removal_share((12, 4), c.rank, c.size))
        d.delete()
        gone = c.allgather(not os.path.lexists({path!r}))
        if c.rank == 0:             # one line, from one rank: mpiexec may mix others' lines
            print("SHARES", shares, "GONE", gone, flush=True)
    """)
    assert "SHARES [(0, 0, 4), (0, 4, 8), (0, 8, 12)] GONE [True, True, True]" in p.stdout
    assert not os.path.lexists(path)
    assert (outside / "keep").read_text() == "keep me" and os.listdir(outside) == ["keep"]


@needs_zarr
def test_remove_never_follows_links_and_keeps_the_neighbours(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_text("x")
    path = _zarr_array(str(tmp_path / "a.zarr"))
    (tmp_path / "a.zarr.json").write_text("{}")            # a neighbour with a near name
    os.unlink(os.path.join(path, "c", "0", "2"))
    os.symlink(outside, os.path.join(path, "c", "0", "2"))          # in place of an object
    shutil.rmtree(os.path.join(path, "c", "3"))
    os.symlink(outside / "sub", os.path.join(path, "c", "3"))       # in place of a directory
    os.symlink(outside, os.path.join(path, "top-link"))
    os.mkfifo(os.path.join(path, "c", "1", "fifo"))
    assert backends.resolve("zarr").remove(path) is True
    assert not os.path.lexists(path)
    assert (outside / "sub" / "f").read_text() == "x"
    assert (tmp_path / "a.zarr.json").exists()
    assert backends.resolve("zarr").remove(path) is False
    link = tmp_path / "to-array"                            # a link at the path: only it goes
    target = _zarr_array(str(tmp_path / "b.zarr"))
    os.symlink(target, link)
    assert backends.resolve("zarr").remove(str(link)) is True
    assert not os.path.lexists(link) and os.path.exists(os.path.join(target, "zarr.json"))


@needs_zarr
def test_a_part_that_cannot_be_removed_does_not_stop_the_rest(tmp_path):
    """A file system mounted on a directory of the array (rmdir: EBUSY) stays, with its
    ancestors; everything else goes, and the error names that path and its errno."""
    path = _zarr_array(str(tmp_path / "m.zarr"))
    busy = os.path.join(path, "c", "3")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", busy],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with open(os.path.join(busy, "inside"), "w") as fh:
            fh.write("inside the array: removed")
        with pytest.raises(StorageError) as e:
            backends.resolve("zarr").remove(path)
        assert e.value.errno == errno.EBUSY and e.value.filename == busy
        assert _tree(path) == {"c", "c/3"} and os.listdir(busy) == []
    finally:
        subprocess.run(["umount", "-l", busy], check=False)
    assert backends.resolve("zarr").remove(path) is True and not os.path.lexists(path)


# ---------------------------------------------------------------- zarr: light availability

@needs_zarr
def test_zarr_availability_and_an_array_do_not_import_zarr_python():
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import chemio_py as cio
        import chemio_py.backends as b
        assert b.availability()["zarr"][0]
        assert "zarr" not in sys.modules and "numcodecs" not in sys.modules
        d = cio.DiskArray.create("light", (40, 30), "f8", chunks=(10, 10), backend="zarr",
                                 compressor="none")
        d[:, :] = np.ones((40, 30))
        assert d[3:7, 2:9].sum() == 28
        d.delete()
        assert "zarr" not in sys.modules, "zarr-python was imported"
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------- mpiio: handles per rank

def _mpi_usable() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return backends.availability().get("mpiio", (False,))[0]


@pytest.mark.skipif(not _mpi_usable(), reason="mpi4py is not installed")
def test_mpiio_array_used_collectively_opens_no_comm_self_handle(mpirun, tmp_path):
    path = str(tmp_path / "h.dra")
    p = mpirun(3, f"""
        import os, numpy as np
        import chemio_py as cio, chemio_py.backends as backends
        c = cio.comm()

        def fds_on(p):
            n = 0
            for fd in os.listdir("/proc/self/fd"):
                try:
                    n += os.readlink(f"/proc/self/fd/{{fd}}") == p
                except OSError:
                    pass
            return n

        st = backends.resolve("mpiio").open_array({path!r}, "w+", shape=(30, 20),
                                                  dtype=np.dtype("f8"), chunks=(7, 6), comm=c)
        sec = cio.block_section((30, 20), comm=c)
        region = tuple(slice(s.start, s.stop) for s in sec)
        block = np.full(tuple(s.stop - s.start for s in sec), 1.0 + c.rank)
        st.write_all(region, block, c)
        out = np.empty_like(block)
        st.read_all(region, out, c)
        assert (out == block).all() and not st.independent_open
        # rank 0 keeps the descriptor it checked the file with; ROMIO's collective handle
        fds = c.allgather(fds_on({path!r}))
        st.flush()                          # a descriptor for fdatasync, on first use
        assert fds_on({path!r}) == 2
        st.read(region, out)                # the first independent call opens COMM_SELF
        assert st.independent_open and (out == block).all()
        st.close()
        closed = c.allgather(fds_on({path!r}))
        if c.rank == 0:
            print("FDS", fds, "CLOSED", closed, flush=True)
    """)
    assert "FDS [2, 1, 1] CLOSED [0, 0, 0]" in p.stdout, p.stdout


@pytest.mark.skipif(not _mpi_usable(), reason="mpi4py is not installed")
def test_mpiio_private_array_has_one_handle(tmp_path):
    st = backends.resolve("mpiio").open_array(str(tmp_path / "p.dra"), "w+", shape=(8, 8),
                                              dtype=np.dtype("i4"), chunks=(4, 4))
    try:
        data = np.arange(64, dtype="i4").reshape(8, 8)
        st.write((slice(0, 8), slice(0, 8)), data)
        assert not st.independent_open          # the private handle serves both kinds
        out = np.zeros_like(data)
        st.read_all((slice(0, 8), slice(0, 8)), out)
        assert (out == data).all()
    finally:
        st.close()
    assert st.closed


# ---------------------------------------------------------------- local: fstatfs per store

@pytest.mark.parametrize("where", ["tmp", "/dev/shm"])
def test_fs_type_of_a_descriptor_agrees_with_the_mount_table(tmp_path, where):
    d = str(tmp_path) if where == "tmp" else where
    if not os.path.isdir(d):
        pytest.skip(f"no {d}")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        kind = posix.fs_type(fd)
    finally:
        os.close(fd)
    if kind is None:
        pytest.skip("fstatfs is not available through ctypes here")
    mount = fs.fstype(d)
    assert kind == mount or (kind == "ext4" and mount in ("ext2", "ext3")) or \
        (kind == "fuse" and mount.startswith("fuse")) or (kind == "nfs" and mount == "nfs4")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_first_write_all_of_a_local_array_reads_no_mount_table(tmp_path):
    mark = f"/chemio-mark-{uuid.uuid4().hex}"
    code = textwrap.dedent(f"""
        import os, numpy as np, chemio_py as cio
        d = cio.DiskArray.create("w", (64, 64), "f8", chunks=(16, 16), backend="local",
                                 path={str(tmp_path / "w.dra")!r}, persistent=True)
        block = np.ones((32, 64))
        os.access({mark!r}, 0)
        d.write_all(np.s_[0:32, :], block)
        os.access({mark!r}, 0)
        d.delete()
    """)
    out = tmp_path / "trace"
    r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=%file,%fstat,%fstatfs", "-o",
                        str(out), sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    marks = [i for i, ln in enumerate(lines) if mark in ln]
    assert len(marks) == 2
    phase = lines[marks[0] + 1:marks[1]]
    assert not [ln for ln in phase if "mounts" in ln], phase
    assert sum("fstatfs(" in ln for ln in phase) == 1, phase
    # no path lookups of the array's directories (realpath); config files may be looked at
    assert not [ln for ln in phase if str(tmp_path) in ln], phase
