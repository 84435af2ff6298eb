"""Re-creating an array keeps a reader of the old one whole (issue 27, item 3).

A reader process opens an array ``r``; a writer process then creates it again (a scratch
array of the same name, or a persistent one with ``overwrite=True``) and fills it with other
bytes. The reader's next reads give the old data exactly (shape, dtype and values) where
the new array is a new file or segment and the reader's handle keeps the old one (local,
shm, auto, mpiio), or a clear error naming the path (zarr), never the new bytes under the
old shape. Afterwards neither process leaves anything in the scratch root or the shm
directory.

The RAM budget of ``shm`` counts an old segment that a reader keeps alive (it still uses
RAM) and stops counting it when the last reader closes, or when its creator cleans up.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

import numpy as np
import pytest

import chemio_py.backends as backends
from chemio_py.runtime import config
from chemio_py.scratch import jobs
from chemio_py.backends.shm import budget as budget_mod

from conftest import SCRATCH_ROOT, SHM_DIR

MiB = 1 << 20
# What a reader of the old array gets after the re-create: the old data ("old": a new file
# or segment replaced it, the reader's descriptor keeps the old one), or a clear error naming
# the path ("error": zarr, whose old objects go with their directory), never the new bytes.
KEEPS = {"local": "old", "shm": "old", "auto": "old", "mpiio": "old", "zarr": "error"}
BACKENDS = sorted(KEEPS)
OLD = ((64, 48), "f8")                       # what the reader opened
OLD_READ = {"shape": [64, 48], "dtype": "float64", "same": True}     # ... and reads after
NEW = {"same_nbytes": ((64, 48), "i8", (16, 16)),   # same size and chunks: nothing tells
       "other_shape": ((16, 8), "f8", (8, 8))}       # smaller: a shrunk segment under it

WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import chemio_py as cio

    role, backend, kind, where = sys.argv[1:5]
    old_shape, old_dtype = (64, 48), "f8"
    old = np.arange(64 * 48, dtype=old_dtype).reshape(old_shape) + 0.5

    def say(**kw):
        print(json.dumps(kw), flush=True)

    def wait():
        line = sys.stdin.readline()
        assert line, "the test went away"
        return line.strip()

    if role == "writer":
        new_shape, new_dtype, new_chunks = json.loads(sys.argv[5])
        kw = dict(backend=backend, chunks=(16, 16))
        if kind == "persistent":
            kw.update(path=where, persistent=True)
        d = cio.DiskArray.create("recreated", old_shape, old_dtype, **kw)
        d[...] = old
        d.flush()
        say(path=d.path)
        wait()                                           # the reader has the old one open
        if kind == "persistent":
            kw["overwrite"] = True
        kw["chunks"] = tuple(new_chunks)
        d2 = cio.DiskArray.create("recreated", tuple(new_shape), new_dtype, **kw)
        n = int(np.prod(new_shape))
        new = (-np.arange(n) - 7).astype(new_dtype).reshape(new_shape)
        d2[...] = new
        d2.flush()
        assert np.array_equal(d2[...], new)
        say(recreated=True)
        wait()                                           # the reader has read
        d2.delete() if kind == "persistent" else d2.close()
        say(closed=True)
    else:
        d = cio.DiskArray.open(where, "r")
        assert d.shape == old_shape and d.dtype == np.dtype(old_dtype)
        assert np.array_equal(d[...], old)
        say(opened=True)
        while True:
            cmd = wait()
            if cmd == "close":
                break
            try:
                x = d[...]
                say(shape=list(x.shape), dtype=str(x.dtype), same=bool(np.array_equal(x, old)))
            except cio.ChemIOError as e:
                say(error=type(e).__name__, message=str(e))
        d.close()
        say(closed=True)
""")


def _usable(name: str) -> bool:
    ok, _why = backends.availability().get(name, (False, ""))
    return ok


class _Worker:
    """A worker process driven line by line: JSON answers on stdout, commands on stdin."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise AssertionError(f"worker {self.proc.args[3]} ended ({self.proc.returncode}): "
                                 f"{self.proc.stderr.read()}")
        return json.loads(line)

    def tell(self, cmd: str = "go") -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(60) == 0, self.proc.stderr.read()

    def stop(self) -> None:
        """End a worker still running after a failure: its stdin closes, so it raises and
        cleans its scratch at exit; killed only if that does not end it."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)


def _left_by(pids: list[int]) -> list[str]:
    """Job directories of these processes still in the scratch root or the shm directory."""
    found = []
    for root in (SCRATCH_ROOT, SHM_DIR):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        found += [os.path.join(root, n) for n in names
                  if n.startswith(jobs.JOB_PREFIX) and any(n.endswith(f"-{p}") for p in pids)]
    return found


def _check_read(backend: str, got: dict, path: str) -> None:
    if KEEPS[backend] == "old":
        assert got == OLD_READ, got
    else:
        assert got.get("error") in ("SupersededError", "StorageError"), got
        assert path in got["message"], got


@pytest.mark.parametrize("variant", sorted(NEW))
@pytest.mark.parametrize("kind", ["scratch", "persistent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reader_keeps_the_old_array_when_another_process_recreates_it(backend, kind, variant):
    """The reader opened ``r`` before the re-create and reads the old data exactly after
    it, before and after the writer is gone; nothing is left behind by either process."""
    if not _usable(backend):
        pytest.skip(f"backend {backend!r} is not usable here")
    # persistent arrays of shm live where the user puts them: in RAM, under the shm dir
    base = SHM_DIR if backend == "shm" and kind == "persistent" else None
    where = tempfile.mkdtemp(prefix="cio-recreate-", dir=base)
    writer = _Worker("writer", backend, kind, where, json.dumps(NEW[variant]))
    reader = None
    try:
        path = writer.answer()["path"]
        reader = _Worker("reader", backend, kind, path)
        assert reader.answer() == {"opened": True}
        writer.tell()
        assert writer.answer() == {"recreated": True}
        reader.tell("read")
        _check_read(backend, reader.answer(), path)
        writer.tell()
        if variant == "same_nbytes":            # the reader closes first ...
            reader.tell("close")
            assert reader.answer() == {"closed": True}
            reader.finish()
            assert writer.answer() == {"closed": True}
            writer.finish()
        else:                                   # ... or the writer is gone first
            assert writer.answer() == {"closed": True}
            writer.finish()
            reader.tell("read")
            _check_read(backend, reader.answer(), path)
            reader.tell("close")
            assert reader.answer() == {"closed": True}
            reader.finish()
        pids = [writer.proc.pid, reader.proc.pid]
        assert _left_by(pids) == []
        assert os.listdir(where) == []
    finally:
        for w in (reader, writer):
            if w is not None:
                w.stop()
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("backend", ["local", "shm", "auto", "mpiio"])
def test_reader_thread_sees_only_old_data_while_the_name_is_recreated(backend):
    """A thread reads the old array without pause while this process re-creates its name
    again and again: every read gives the old data; at the end no old segment is left."""
    if not _usable(backend):
        pytest.skip(f"backend {backend!r} is not usable here")
    import chemio_py as cio
    old = np.arange(64 * 48, dtype="f8").reshape(64, 48) + 0.5
    d = cio.DiskArray.create("threaded", (64, 48), "f8", backend=backend, chunks=(16, 16))
    d[...] = old
    d.flush()
    reader = cio.DiskArray.open(d.path, "r")
    stop, reads, bad = threading.Event(), [0], []

    def read_old() -> None:
        while not stop.is_set():
            try:
                x = reader[...]
            except Exception as e:  # noqa: BLE001 - reported by the test
                bad.append(e)
                return
            reads[0] += 1
            if not np.array_equal(x, old):
                bad.append(x)
                return

    t = threading.Thread(target=read_old)
    t.start()
    try:
        for k in range(20):
            d = cio.DiskArray.create("threaded", (64, 48), "i8", backend=backend,
                                     chunks=(16, 16))
            d[...] = k + 1
    finally:
        stop.set()
        t.join()
    assert not bad and reads[0] > 0, bad[:1]
    assert np.array_equal(reader[...], old)
    assert (d[...] == 20).all()
    reader.close()
    where = os.path.dirname(d.path)
    d.close()
    assert [n for n in os.listdir(where) if "threaded" in n] == []


def test_mpi_recreate_on_shm_leaves_no_old_segment(mpirun):
    """Two ranks re-create a scratch array on shm: rank 0 retires the old segment that rank
    1 still maps, rank 1's superseded handle frees it; nothing old is left."""
    if not _usable("shm"):
        pytest.skip("backend 'shm' is not usable here")
    mpirun(2, """
        import os
        import numpy as np
        import chemio_py as cio
        c = cio.comm()
        d = cio.DiskArray.create("mpi_re", (64, 64), "f8", backend="shm")
        sec = cio.block_section(d.shape)
        d.write_all(sec, np.full(d[sec].shape, c.rank + 1.0))
        d2 = cio.DiskArray.create("mpi_re", (32, 32), "i8", backend="shm")
        c.barrier()
        names = os.listdir(os.path.dirname(d2.path))
        assert not [n for n in names if ".retired-" in n], names
        assert (d2[...] == 0).all()
        d2.close()
    """)


# ------------------------------------------------------------------ the RAM budget of shm

@pytest.fixture
def private_shm_dir():
    """A shm directory of this test alone, so the budget counts only its segments."""
    d = tempfile.mkdtemp(prefix="cio-recreate-budget-", dir=SHM_DIR)
    config.configure(shm_dir=d)
    try:
        yield d
    finally:
        jobs.cleanup()
        config.configure(shm_dir=None)
        shutil.rmtree(d, ignore_errors=True)


def _used() -> int:
    return budget_mod.ram_budget().used


def _array(be, path, mode, rows):
    return be.open_array(path, mode, shape=(rows, MiB // 8), dtype="f8", chunks=(1, MiB // 8))


def test_budget_counts_an_old_segment_while_a_reader_keeps_it(private_shm_dir):
    """Re-created under a reader: old and new both count; the reader's close frees the old."""
    be = backends.resolve("shm")
    path = os.path.join(jobs.job_dir(be.root("shared")), "acct.dra")
    a = _array(be, path, "w+", 8)
    jobs.own(path, be.remove)
    a.write((slice(0, 8), slice(0, MiB // 8)), np.full((8, MiB // 8), 3.0))
    reader = _array(be, path, "r", 8)
    assert _used() == 8 * MiB
    a.close()
    b = _array(be, path, "w+", 4)
    try:
        assert os.stat(path).st_ino != os.fstat(reader.fd).st_ino     # a new segment
        assert _used() == 12 * MiB                  # the old one is still in RAM
        out = np.empty((8, MiB // 8))
        reader.read((slice(0, 8), slice(0, MiB // 8)), out)
        assert (out == 3.0).all()
        reader.close()
        assert _used() == 4 * MiB                   # its last reader freed it
        assert sorted(os.listdir(os.path.dirname(path))) == sorted(
            [jobs.MARKER_NAME, jobs._lease_name(), "acct.dra"])
    finally:
        reader.close()
        b.close()
        be.remove(path)
    assert _used() == 0


def test_budget_forgets_an_old_segment_whose_reader_was_killed(private_shm_dir):
    """A reader killed with the old segment open: the creator's next re-create, or its
    cleanup, removes the old segment; the budget never goes below zero."""
    be = backends.resolve("shm")
    path = os.path.join(jobs.job_dir(be.root("shared")), "killed.dra")
    a = _array(be, path, "w+", 4)
    jobs.own(path, be.remove)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            import chemio_py as cio
            import chemio_py.backends as b
            cio.configure(shm_dir={private_shm_dir!r})
            s = b.resolve("shm").open_array({path!r}, "r", shape=(4, {MiB // 8}), dtype="f8",
                                            chunks=(1, {MiB // 8}))
            print("OPEN", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "OPEN", child.stderr.read()
        a.close()
        b = _array(be, path, "w+", 2)
        assert _used() == 6 * MiB
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert _used() == 6 * MiB                   # the old segment's name still holds it
        b.close()
        c = _array(be, path, "w+", 1)               # the next re-create sweeps it away
        assert _used() == 1 * MiB
        c.close()
        b = _array(be, path, "r", 1)                # a reader in this process ...
        c = _array(be, path, "w+", 2)
        assert _used() == 3 * MiB
        b.close()                                   # ... frees the old one as it closes
        assert _used() == 2 * MiB
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    c.close()
    jobs.cleanup()                               # the creator's cleanup removes the rest
    assert not os.path.lexists(os.path.dirname(path))
    assert _used() == 0


def test_auto_recreate_made_on_disk_leaves_the_reader_its_ram_segment():
    """auto: the new array does not fit the RAM budget and is made on disk; the reader of
    the old one (in RAM) keeps its data, and a new open finds the new array on disk."""
    if not _usable("auto"):
        pytest.skip("backend 'auto' is not usable here")
    import chemio_py as cio
    from chemio_py.errors import SpillWarning
    old = np.arange(64 * 128, dtype="f8").reshape(64, 128)
    d = cio.DiskArray.create("spilled", (64, 128), "f8", backend="auto")
    d[...] = old
    reader = cio.DiskArray.open(d.path, "r")
    config.configure(shm_limit=str(MiB))            # 8 MiB will not fit in RAM now
    try:
        with pytest.warns(SpillWarning):
            d2 = cio.DiskArray.create("spilled", (1024, 1024), "f8", backend="auto")
        assert np.array_equal(reader[...], old)
        d2[0, :] = 1.0
        d2.flush()
        with cio.DiskArray.open(d.path, "r") as again:
            assert again.shape == (1024, 1024) and again[0].sum() == 1024
        reader.close()
        assert [n for n in os.listdir(os.path.dirname(d.path)) if "spilled" in n] == \
            ["spilled.dra.json"]                    # the RAM segment went with its reader
        d2.close()
    finally:
        reader.close()
        config.configure(shm_limit=None)
