"""Runtime: light import, settings and their sources, communicators, stats and trace."""
import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime import config, pool, stats
from chemio_py.runtime.config import ConfigError


def test_light_import():
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import chemio_py"],
                       capture_output=True, text=True, check=True)
    modules = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines()
               if line.startswith("import time:")}
    for heavy in ("mpi4py", "zarr", "dask", "h5py", "numcodecs", "pyscf"):
        assert heavy not in modules, f"import chemio_py imported {heavy}"
    assert "numpy" in modules


def test_settings_precedence_and_sources(tmp_path, monkeypatch):
    toml = tmp_path / "chemio.toml"
    toml.write_text('io_threads = 5\nbackend = "local"\nshm_limit = "1G"\n'
                    '[files."*.aoints"]\nbackend = "shm"\n')
    monkeypatch.setenv("CHEMIO_CONFIG", str(toml))
    s = cio.settings()
    assert (s["io_threads"].value, s["io_threads"].source) == (5, f"file:{toml}")
    assert s["keep"].source == "default" and s["keep"].value is False
    monkeypatch.setenv("CHEMIO_IO_THREADS", "7")
    assert cio.settings()["io_threads"].value == 7
    assert cio.settings()["io_threads"].source == "env:CHEMIO_IO_THREADS"
    cio.configure(io_threads=9)
    io_threads = cio.settings()["io_threads"]
    assert (io_threads.value, io_threads.source) == (9, "explicit")
    cio.configure(io_threads=None)
    assert cio.settings()["io_threads"].value == 7
    # per-name rules beat the global backend; an explicit argument beats both
    assert config.backend_for("x.aoints").value == "shm"
    assert "files" in config.backend_for("x.aoints").source
    assert config.backend_for("x.mo").value == "local"
    assert config.backend_for("x.aoints", "local").source == "argument"


def test_bad_settings_are_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("CHEMIO_IO_THREADS", "many")
    with pytest.raises(ConfigError, match="CHEMIO_IO_THREADS"):
        cio.settings()
    monkeypatch.delenv("CHEMIO_IO_THREADS")
    with pytest.raises(ConfigError, match="unknown settings"):
        cio.configure(scrach="/tmp")
    with pytest.raises(ConfigError, match="positive"):
        cio.configure(io_threads=0)
    bad = tmp_path / "bad.toml"
    bad.write_text("colour = 'blue'\n")
    monkeypatch.setenv("CHEMIO_CONFIG", str(bad))
    with pytest.raises(ConfigError, match="unknown keys"):
        cio.settings()
    monkeypatch.setenv("CHEMIO_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="does not exist"):
        cio.settings()


def test_limit_parsing():
    assert config.parse_limit("512M", 0) == 512 << 20
    assert config.parse_limit("4GiB", 0) == 4 << 30
    assert config.parse_limit("50%", 1000) == 500
    assert config.parse_limit("1000", 0) == 1000
    for bad in ("", "-5", "150%", "lots", "nan"):
        with pytest.raises(ValueError):
            config.parse_limit(bad, 100)


def test_serial_comm():
    c = cio.comm()
    assert (c.rank, c.size, c.mpi) == (0, 1, None)
    assert c.bcast("x") == "x" and c.allgather(3) == [3] and c.allreduce(4) == 4
    a = np.arange(3.0)
    assert c.allreduce(a, op="max") is a
    with pytest.raises(ValueError, match="not one of"):
        c.allreduce(1, op="avg")
    with pytest.raises(KeyError):
        with c.agree("work"):
            raise KeyError("mine")


def test_mpi_comm_collectives_and_agreement(mpirun):
    p = mpirun(3, """
        import numpy as np, chemio_py as cio
        from chemio_py.errors import CollectiveError
        c = cio.comm()
        assert c.size == 3 and c.mpi is not None
        assert c.bcast(c.rank * 10, root=2) == 20
        assert c.allgather(c.rank) == [0, 1, 2]
        a = np.full(4, c.rank + 1.0)
        assert c.allreduce(a) is a and a[0] == 6.0
        assert c.allreduce(c.rank, op="max") == 2
        try:
            with c.agree("step"):
                if c.rank == 1:
                    raise ValueError("disk on fire")
        except CollectiveError as e:
            assert c.rank != 1 and e.failures == {1: "ValueError: disk on fire"}, e
            print(f"collective error seen on {c.rank}", flush=True)
        except ValueError:
            assert c.rank == 1
            print(f"own error on {c.rank}", flush=True)
        c.barrier()
    """)
    assert p.stdout.count("collective error seen") == 2 and "own error on 1" in p.stdout


def test_mpi_exclusive_files_are_private_and_cleaned(mpirun, scratch_root):
    p = mpirun(3, """
        import os, numpy as np, chemio_py as cio
        c = cio.comm()
        f = cio.ExclusiveFile("same", "w+")
        f.write(0, np.full(1000, c.rank, dtype=np.int32))
        c.barrier()
        assert (f.read(0, np.empty(1000, np.int32)) == c.rank).all()
        paths = c.allgather(f.path)
        assert len(set(paths)) == 3 and f.path.endswith(f"same.{c.rank}"), paths
        assert oct(os.stat(f.path).st_mode & 0o777) == "0o600"
        assert oct(os.stat(os.path.dirname(f.path)).st_mode & 0o777) == "0o700"
        f.close()
        print(f"ok {c.rank}", flush=True)
    """)
    assert p.stdout.count("ok") == 3
    assert os.listdir(scratch_root) == []


def test_stats_count_ops_bytes_and_waits():
    """Waits are the caller's blocked time: an awrite queued behind a known 0.3 s task on
    the only I/O thread is waited for at least that long, and that queue time is wait,
    not I/O time."""
    stats.reset()
    sleep = 0.3
    cio.configure(io_threads=1)
    try:
        t_start = time.perf_counter()
        with cio.ExclusiveFile("counted", "w+") as fh:
            fh.write(0, bytes(1000))
            t0 = time.perf_counter()
            blocker = pool.submit(time.sleep, sleep)     # holds the only pool thread
            fh.awrite(1000, bytes(500)).wait()
            queued = time.perf_counter() - t0
            blocker.wait()
            fh.read(0, bytearray(1500))
            st = fh.stats.as_dict()
            fh.delete()
        wall = time.perf_counter() - t_start
    finally:
        cio.configure(io_threads=None)
    assert (st["reads"], st["writes"], st["bytes_read"], st["bytes_written"]) == (1, 2, 1500, 1500)
    assert queued >= sleep                           # the write waited behind the sleep
    assert sleep * 0.5 <= st["wait_seconds"] <= wall
    assert 0 < st["io_seconds"] < st["wait_seconds"]    # time in the queue is not I/O time
    text = cio.report(print_it=False)
    assert "counted.0" in text and "total" in text


def test_trace_file_is_chrome_json(tmp_path):
    trace = tmp_path / "io.json"
    code = ("import chemio_py as cio\n"
            "with cio.ExclusiveFile('traced', 'w+') as f:\n"
            "    f.awrite(0, b'x' * 100).wait(); f.aread(0, bytearray(100)).wait(); f.delete()\n")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "CHEMIO_TRACE": str(trace)})
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events} == {"read", "write"}
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
    assert any(e["tid"].startswith("chemio-io") for e in events)


def _direct_fds(path: str) -> list[int]:
    """This process's descriptors open on ``path`` with O_DIRECT (from /proc/self/fdinfo)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != path:
                continue
            with open(f"/proc/self/fdinfo/{fd}") as fh:
                flags = next(int(line.split()[1], 8) for line in fh if line.startswith("flags:"))
        except (OSError, StopIteration):
            continue                                   # closed meanwhile (or the listing's own)
        if flags & os.O_DIRECT:
            found.append(int(fd))
    return found


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache now: mincore on a fresh, untouched mapping."""
    import ctypes
    import mmap
    size = os.path.getsize(path)
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        addr = np.frombuffer(mm, np.uint8).ctypes.data
        vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        if libc.mincore(ctypes.c_void_p(addr), size, vec.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return int((vec & 1).sum())
    finally:
        mm.close()


def _o_direct_refused(d: str) -> str | None:
    """Why the file system of ``d`` cannot show whether I/O bypassed the page cache, or None."""
    probe = os.path.join(d, "o_direct_probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as e:
        return f"the file system of {d} refuses O_DIRECT ({os.strerror(e.errno)})"
    os.close(fd)
    os.unlink(probe)
    fstype = cio.stat(d).fstype
    if fstype in ("tmpfs", "ramfs"):
        return f"{d} is on {fstype}: its data lives in the page cache, O_DIRECT or not"
    return None


def test_direct_io_matches_buffered(tmp_path):
    """Aligned requests go through an O_DIRECT descriptor: they leave the file's pages out
    of the page cache (mincore), where the same I/O without ``direct`` puts them in; an
    unaligned one goes through the cache; the bytes agree either way."""
    why = _o_direct_refused(str(tmp_path))
    if why:
        pytest.skip(why)
    n = 1 << 16
    buf = cio.aligned_empty(n, np.uint8)
    buf[:] = np.arange(n) % 251
    out = cio.aligned_empty(n, np.uint8)
    # the control: buffered I/O leaves the pages cached, so the observable below can tell
    with cio.ExclusiveFile("buffered", "w+", dir=str(tmp_path), direct=False) as fh:
        fh.write(0, buf)
        assert _direct_fds(fh.path) == []
        assert _resident_pages(fh.path) == n // 4096
        fh.delete()
    with cio.ExclusiveFile("direct", "w+", dir=str(tmp_path), direct=True) as fh:
        assert len(_direct_fds(fh.path)) == 1      # the store holds an O_DIRECT descriptor
        fh.write(0, buf)                           # aligned: straight to the device
        assert _resident_pages(fh.path) == 0
        fh.read(0, out)                            # aligned: straight from the device
        assert _resident_pages(fh.path) == 0
        np.testing.assert_array_equal(out, buf)
        fh.write(100, b"unaligned")                # falls back to the page cache ...
        assert _resident_pages(fh.path) >= 1
        out[:] = 0
        fh.read(0, out)                            # ... and a direct read still sees it
        expect = buf.copy()
        expect[100:109] = np.frombuffer(b"unaligned", np.uint8)
        np.testing.assert_array_equal(out, expect)
        fh.delete()


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not line.startswith("VmFlags"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("shape, dtype, align", [
    ((3, 1 << 20), np.uint8, 4096),         # 3 MiB: huge-page memory
    ((1 << 18,), np.float64, 4096),         # exactly 2 MiB
    ((2, 3, 1 << 17), np.complex128, 64),   # 12 MiB, a small alignment asked
    ((1024,), np.float32, 4096),            # one page: page-aligned
    ((5, 7), np.float64, 512),              # under a page
    ((3, 1 << 20), np.uint8, 4 << 20),      # an alignment past a huge page
])
def test_aligned_empty_gives_aligned_private_memory_on_huge_pages_from_2_mib(
        shape, dtype, align):
    """The buffer for O_DIRECT: C-ordered, writable, of the shape and dtype asked, on the
    alignment asked. From 2 MiB on it starts on a 2 MiB boundary in a mapping marked for
    transparent huge pages (smaps ``hg``: O_DIRECT transfers then reach the device in
    larger requests). Its memory is private: a forked child's writes stay in the child."""
    a = cio.aligned_empty(shape, dtype, align=align)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % align == 0
    huge = a.nbytes >= 2 << 20 and align <= 2 << 20
    if huge:
        assert a.ctypes.data % (2 << 20) == 0
        if hasattr(mmap, "MADV_HUGEPAGE"):
            assert "hg" in _vm_flags(a.ctypes.data)
    flat = a.reshape(-1).view(np.uint8)
    flat[:] = 7
    pid = os.fork()
    if pid == 0:                            # the child writes its copy and leaves
        flat[:] = 9
        os._exit(0 if int(flat.sum()) == 9 * flat.size else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert int(np.count_nonzero(flat != 7)) == 0    # the parent's memory is untouched


@pytest.mark.parametrize("args, says", [
    (((-1,),), "negative dimension"),
    (((2, -3), "f8"), "negative dimension"),
    ((("a",),), "sequence of ints"),
    ((2.5,), "sequence of ints"),
    (((4,), "f8", 3), "power of two"),
    (((4,), "f8", 0), "power of two"),
    (((4,), "f8", True), "power of two"),
    (((4,), object), "Python objects"),
    (((4,), "nope"), "not a NumPy dtype"),
])
def test_aligned_empty_refuses_bad_arguments_with_what_was_asked(args, says):
    """A negative dimension, a shape that is not ints, an alignment that is not a power of
    two, a dtype of Python objects or no dtype at all: ``ArgumentError`` (a ValueError)
    naming the argument, as NumPy refuses ``np.empty((-1,))``, not a wrong array."""
    with pytest.raises(cio.errors.ArgumentError, match=says) as info:
        cio.aligned_empty(*args)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("shape", [np.array([2, 3]), range(2, 4), [2, 3], np.int64(6)])
def test_aligned_empty_takes_the_shapes_numpy_takes(shape):
    """A 1-d integer array, a range, a list or a NumPy integer as the shape, as
    ``np.empty`` takes them."""
    a = cio.aligned_empty(shape, np.float64)
    assert a.shape == np.empty(shape).shape and a.ctypes.data % 4096 == 0


def test_huge_page_buffers_round_trip_through_o_direct(tmp_path):
    """A 6 MiB ``aligned_empty`` buffer written and read back through the O_DIRECT path,
    whole and as rows of ``awrite_many``/``aread_many``, matches NumPy's copy."""
    why = _o_direct_refused(str(tmp_path))
    if why:
        pytest.skip(why)
    rows, width = 6, 1 << 20
    buf = cio.aligned_empty((rows, width), np.uint8)
    buf[...] = (np.arange(rows * width) % 253).reshape(rows, width)
    model = np.array(buf)
    out = cio.aligned_empty((rows, width), np.uint8)
    with cio.ExclusiveFile("huge", "w+", dir=str(tmp_path), direct=True) as fh:
        fh.write(0, buf)
        fh.read(0, out)
        np.testing.assert_array_equal(out, model)
        offsets = np.arange(rows, dtype=np.int64)[::-1] * width + rows * width
        fh.awrite_many(offsets, buf).wait()
        out[...] = 0
        fh.aread_many(offsets, out).wait()
        np.testing.assert_array_equal(out, model)
        fh.delete()


def _exit_run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


def test_exit_runs_the_queued_pool_work(tmp_path):
    """Work queued on the I/O pool when the interpreter exits still runs (writes behind
    land), one item after the other on a single thread."""
    out = tmp_path / "log"
    r = _exit_run(
        "import time, chemio_py as cio\n"
        "from chemio_py.runtime import pool\n"
        "cio.configure(io_threads=1)\n"
        f"def slow(i):\n    time.sleep(0.05)\n    open({str(out)!r}, 'a').write(f'{{i}}\\n')\n"
        "for i in range(6):\n    pool.submit(slow, i)\n")
    assert r.returncode == 0, r.stderr
    assert out.read_text().split() == [str(i) for i in range(6)]
    assert "finished nothing" not in r.stderr


def test_exit_leaves_a_stuck_pool_with_a_message():
    """A pool item that never ends no longer holds the exit for ever: after EXIT_STALL
    seconds without progress the process leaves and says what it left."""
    t0 = time.monotonic()
    r = _exit_run(
        "import threading\n"
        "from chemio_py.runtime import pool\n"
        "pool.EXIT_STALL = 0.5\n"
        "pool.submit(threading.Event().wait)\n")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 30
    assert "finished nothing for 0.5 s" in r.stderr and "was not done" in r.stderr


def _finalizer_during_start(module, monkeypatch, finalizer, name):
    """Make every thread named ``name...`` that ``module`` starts first run ``finalizer``
    on another thread and wait for it up to 2 s: what happens when a new thread runs the
    garbage collector before it signals that it has started and a finalizer there (a
    dropped array's close) takes a library lock. Returns the list of how each such
    finalizer ended. (Other threads started meanwhile, such as the finalizers' closer,
    start as usual.)"""
    import threading
    ended: list = []
    real = threading.Thread

    class Thread(real):
        def start(self):
            if not self.name.startswith(name):
                return super().start()
            t = real(target=lambda: ended.append(finalizer()), daemon=True)
            t.start()
            t.join(2)
            if t.is_alive():
                ended.append("blocked")
            super().start()
    monkeypatch.setattr(module.threading, "Thread", Thread)
    return ended


def test_the_pool_starts_its_threads_with_no_lock_held(monkeypatch):
    """A finalizer on a starting pool thread that needs the pool gets it (it waited for
    the pool's lock, held by the thread starting it: a deadlock)."""
    pool.reset_pool()
    try:
        ended = _finalizer_during_start(pool, monkeypatch, lambda: pool.submit(int, 7),
                                       "chemio-io")
        assert pool.submit(int, 3).wait() == 3
        assert ended and "blocked" not in ended, ended
        assert [r.wait() for r in ended] == [7] * len(ended)    # and their work ran
    finally:
        monkeypatch.undo()
        pool.reset_pool()


def test_the_zarr_reaper_starts_its_thread_with_no_lock_held(monkeypatch, tmp_path):
    """The same for the zarr reaper's thread, started by a rewrite (the hang CI met: a
    dask worker's write stuck in ``Thread.start`` while the new thread's finalizer waited
    for the reaper's condition)."""
    from chemio_py.backends.zarr import backend as zb
    zb._REAPER.settle()
    zb._REAPER._thread = None        # the next rewrite starts a new reaper thread
    d = cio.DiskArray.create("r", (8, 8), "f8", chunks=(4, 4), backend="zarr", path=tmp_path)
    d[...] = 1.0
    other = cio.DiskArray.create("o", (4, 4), "f8", backend="zarr", path=tmp_path)
    ended = _finalizer_during_start(zb, monkeypatch, lambda: zb._REAPER.settle(other.store),
                                   "chemio-zarr-reaper")
    d[...] = 2.0                     # rewrites: the old objects go to the reaper
    assert ended == [None], ended
    np.testing.assert_array_equal(d[...], 2.0)
    d.delete()
    other.delete()
