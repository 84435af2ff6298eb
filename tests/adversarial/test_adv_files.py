"""Issue 11, items 2, 7, 8, 9, 10 (data files) and the clear-error class: one handle per
created file, no pointer buffers, no SIGBUS, no hang on hostile files, clear errors."""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.errors import ArgumentError, MetadataError, SectionError, SupersededError


def _run(code: str, *args: str, timeout: float = 120, env: dict | None = None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


# ---------------------------------------------------------------- item 2

def test_create_twice_supersedes_the_old_diskarray(store):
    d1 = cio.DiskArray.create("tmp", (1000,), "f8", backend=store)
    d1[:] = 1
    d2 = cio.DiskArray.create("tmp", (500, 2), "f8", backend=store)   # a cell run again
    assert d2[:].sum() == 0                            # a new, zeroed array
    with pytest.raises(SupersededError, match="replaced it"):
        d1[0:10]
    with pytest.raises(SupersededError):
        d1[0:10] = 5.0
    assert d1.closed
    d1.close()                                         # harmless, removes nothing
    d2[:] = 2.0
    assert d2[:].sum() == 2000.0                       # d1 never touched d2's file
    d2.close()


def test_create_twice_with_requests_in_flight():
    d1 = cio.DiskArray.create("tmpq", (1 << 20,), "f8")
    reqs = [d1.awrite(np.s_[i << 16:(i + 1) << 16], np.full(1 << 16, float(i))) for i in range(16)]
    d2 = cio.DiskArray.create("tmpq", (1 << 20,), "f8")
    assert all(r.done() for r in reqs)                 # the old handle waited, then closed
    assert d2[:].sum() == 0
    d2.close()


@pytest.mark.parametrize("kind", ["exclusive", "shared", "records"])
def test_byte_files_created_twice(store, kind):
    if kind == "exclusive":
        make = lambda: cio.ExclusiveFile("twice", "w+", backend=store)   # noqa: E731
    elif kind == "shared":
        make = lambda: cio.SharedFile("twice", backend=store)             # noqa: E731
    else:
        make = lambda: cio.RecordFile("twice", "w+", backend=store)       # noqa: E731
    a = make()
    if kind == "records":
        a.append(np.arange(3))
        a.flush()
    else:
        a.write(0, b"first")
    b = make()
    if kind == "records":
        assert len(b) == 0
        b.append(np.arange(5))
        b.flush()
        assert [x[0].tolist() for x in b.replay()] == [list(range(5))]
        with pytest.raises(cio.ChemIOError):
            a.append(np.arange(3))
            a.flush()
    else:
        assert b.size == 0
        with pytest.raises(SupersededError, match="replaced it"):
            a.read_bytes(0, 5)
        b.write(0, b"second")
        assert b.read_bytes(0, 6) == b"second"
    for h in (a, b):
        try:
            h.close()
        except cio.ChemIOError:
            pass
    if kind == "shared":
        a.destroy()
        assert os.path.exists(b.path)                  # the old handle removes nothing
        b.destroy()
    elif kind == "records":
        b.delete()
    else:
        b.delete()


def test_opening_for_reading_does_not_supersede(store):
    with cio.ExclusiveFile("rd", "w+", backend=store) as w:
        w.write(0, b"abc")
        w.flush()
        with cio.ExclusiveFile("rd", "r", backend=store) as r:
            assert r.read_bytes(0, 3) == b"abc"
        w.write(3, b"d")                               # the creator is still usable
        w.delete()


# ---------------------------------------------------------------- item 7

def _object_buffers():
    yield np.array([1, "x", None], dtype=object)
    yield np.zeros(4, dtype=[("a", "f8"), ("b", "O")])
    yield memoryview(np.array([object()] * 2, dtype=object))


@pytest.mark.parametrize("buf", list(_object_buffers()), ids=["object", "struct", "memoryview"])
def test_pointer_buffers_are_refused_everywhere(store, buf):
    with cio.ExclusiveFile("objs", "w+", backend=store) as f:
        f.write(0, bytes(256))
        for call in (lambda: f.read(0, buf), lambda: f.aread(0, buf).wait(),
                     lambda: f.aread_many([0], [buf]).wait(), lambda: f.write(0, buf),
                     lambda: f.awrite(0, buf).wait(), lambda: f.awrite_many([0], [buf]).wait()):
            with pytest.raises(ArgumentError, match="pointers"):
                call()
        assert f.read_bytes(0, 256) == bytes(256)      # nothing was written
        f.delete()
    with cio.SharedFile("objs", backend=store) as sf:
        sf.write(0, bytes(64))
        with pytest.raises(ArgumentError, match="pointers"):
            sf.read(0, buf)
        sf.destroy()


def test_pointer_array_rows_are_refused():
    with cio.ExclusiveFile("objrows", "w+") as f:
        f.write(0, bytes(64))
        with pytest.raises(ArgumentError, match="pointers"):
            f.aread_many([0, 16], np.empty((2, 2), dtype=object)).wait()
        f.delete()


def test_diskarray_refuses_object_data():
    with cio.DiskArray.create("objd", (4,), "f8") as d:
        with pytest.raises(ArgumentError):
            d[:] = np.array([1.0, None, "x", 2], dtype=object)
        with pytest.raises(ArgumentError):
            d.read((), out=np.empty(4, dtype=object))
        assert d[:].sum() == 0


# ---------------------------------------------------------------- item 8

READER = """
import sys, time, numpy as np, chemio_py as cio
path, seconds = sys.argv[1], float(sys.argv[2])
for attempt in range(200):             # it may be between a re-create's two files right now
    try:
        d = cio.DiskArray.open(path, "r")
        break
    except cio.ChemIOError:
        time.sleep(0.01)
# (after open)
n = errors = 0
t_end = time.time() + seconds
while time.time() < t_end:
    try:
        x = d[10:300, 10:300]
        assert x.shape == (290, 290)
        n += 1
    except cio.ChemIOError as e:
        errors += 1
print("READS", n, errors, flush=True)
d.close()
"""


def test_reader_survives_recreate_with_overwrite(tmp_path):
    """A reader mapping a local array keeps reading while the array is created anew."""
    a = cio.DiskArray.create("race", (512, 512), "f8", chunks=(64, 64), path=tmp_path,
                             persistent=True)
    a[:] = 1.0
    path = a.path
    a.close()
    reader = subprocess.Popen([sys.executable, "-c", READER, path, "3"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        import time
        t_end = time.time() + 3
        k = 0
        while time.time() < t_end:
            b = cio.DiskArray.create("race", (512, 512), "f8", chunks=(64, 64), path=tmp_path,
                                     persistent=True, overwrite=True)
            b[:] = float(k)
            b.close()
            k += 1
        out, err = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, (reader.returncode, err[-2000:])   # -7 was SIGBUS
    assert int(out.split()[1]) > 0
    cio.DiskArray.open(path, "r+").delete()


def test_reader_of_a_file_truncated_behind_its_back_gets_an_error(tmp_path):
    a = cio.DiskArray.create("trunc", (512, 512), "f8", chunks=(64, 64), path=tmp_path,
                             persistent=True)
    a[:] = 1.0
    a.flush()
    path = a.path
    a.close()
    code = READER.replace("# (after open)", textwrap.dedent('''
        d[10:300, 10:300]                           # the pages are cached: the mapped path
        import os
        size = os.path.getsize(path)
        os.truncate(path, 0)
        os.truncate(path, size // 2)'''))
    p = _run(code, path, "0.5")
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    n, errors = map(int, p.stdout.split()[1:3])
    assert errors > 0 and n == 0                       # every read said so, none crashed


# ---------------------------------------------------------------- item 9

SPARSE = """
import os, sys, numpy as np, chemio_py as cio
where = sys.argv[1]
d = cio.DiskArray.create("sp", (256, 256), "f8", backend="shm", path=where, persistent=True)
d[:] = 1.0
p = d.path
d.close()
os.truncate(p, 0)
os.truncate(p, 256 * 256 * 8)                      # a sparse segment
fd = os.open(os.path.join(where, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
try:
    while True:
        os.write(fd, b"x" * 4096)                  # the tmpfs is full
except OSError:
    pass
os.close(fd)
e = cio.DiskArray.open(p, "r")
print("SUM", e[:].sum(), e[3:100, 7:9].sum(), flush=True)
e.close()
"""


def test_readonly_shm_array_on_sparse_segment_of_a_full_tmpfs(small_fs):
    if small_fs is None:
        pytest.skip("needs a real tmpfs mount (root)")
    p = _run(SPARSE, small_fs)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])     # -7 was SIGBUS
    assert p.stdout.split()[:3] == ["SUM", "0.0", "0.0"]


# ---------------------------------------------------------------- item 10 (data files)

def test_fifo_where_a_data_file_should_be(tmp_path):
    fifo = tmp_path / "x.0"
    os.mkfifo(fifo)
    code = """
import sys, chemio_py as cio
for mode in ("r", "r+", "w+"):
    try:
        cio.ExclusiveFile("x", mode, dir=sys.argv[1])
        print("OPENED", mode)
    except cio.ChemIOError as e:
        print("ERR", mode, type(e).__name__)
    except OSError as e:
        print("OSERR", mode, type(e).__name__)
"""
    p = _run(code, str(tmp_path), timeout=30)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 3 and all(ln.startswith(("ERR", "OSERR")) for ln in lines), lines


def test_fifo_as_array_data_or_metadata(tmp_path):
    a = cio.DiskArray.create("fa", (8,), "f8", path=tmp_path, persistent=True)
    data, meta = a.path, a.meta_path
    a.close()
    os.unlink(data)
    os.mkfifo(data)
    code = """
import sys, chemio_py as cio
try:
    cio.DiskArray.open(sys.argv[1], "r")
except cio.ChemIOError as e:
    print("ERR", type(e).__name__)
"""
    p = _run(code, data, timeout=30)
    assert p.returncode == 0 and p.stdout.startswith("ERR"), (p.stdout, p.stderr)
    os.unlink(data)
    os.unlink(meta)
    os.mkfifo(meta)
    open(data, "wb").close()
    p = _run(code, meta, timeout=30)
    assert p.returncode == 0 and "MetadataError" in p.stdout, (p.stdout, p.stderr)
    os.unlink(meta)
    os.symlink("/dev/zero", meta)
    p = _run(code, meta, timeout=30)
    assert p.returncode == 0 and "MetadataError" in p.stdout, (p.stdout, p.stderr)


# ---------------------------------------------------------------- clear errors

@pytest.mark.parametrize("offset", [2 ** 63, 2 ** 64 + 5, 10 ** 30])
def test_offsets_past_the_largest_file_offset(offset):
    with cio.ExclusiveFile("big", "w+") as f:
        for call in (lambda: f.write(offset, b"x"), lambda: f.read(offset, bytearray(1)),
                     lambda: f.awrite(offset, b"x"), lambda: f.aread(offset, bytearray(1)),
                     lambda: f.awrite_many([offset], [b"x"]), lambda: f.truncate(offset)):
            with pytest.raises(ArgumentError, match="largest file offset|integer offsets"):
                call()
        assert f.size == 0
        f.delete()


@pytest.mark.parametrize("key", [np.array([True, False, True, False]), [0, 2],
                                 (np.array([0, 2]),), (slice(None), np.array([1]))])
def test_fancy_and_boolean_indexing_is_numpys(key):
    model = np.arange(16.0).reshape(4, 4)
    with cio.DiskArray.create("fancy", (4, 4), "f8") as d:
        d[...] = model
        assert np.array_equal(d[key], model[key])
        d[key] = -1.0
        model[key] = -1.0
        assert np.array_equal(d[...], model)


@pytest.mark.parametrize("key", [np.bool_(True), ([0, 1], [1, 2]), np.ones((4, 4), bool),
                                 [[0, 1]], np.array([0.5])])
def test_indexing_numpy_means_otherwise_is_a_section_error(key):
    with cio.DiskArray.create("fancy", (4, 4), "f8") as d:
        with pytest.raises(SectionError, match="index"):
            d[key]
        with pytest.raises(SectionError):
            d[key] = 1.0
        assert d[:].sum() == 0


def test_missing_dir_says_so(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(OSError, match="does not exist") as ei:
        cio.ExclusiveFile("x", "w+", dir=str(missing))
    assert "mode" not in str(ei.value)
    assert not missing.exists()


@pytest.mark.parametrize("value", [300, -129, [1, 300], 2 ** 70])
def test_python_values_that_do_not_fit_are_errors(value):
    with cio.DiskArray.create("small", (4,), "i1") as d:
        d[:] = 7
        with pytest.raises(ArgumentError):
            d[0:2] = value
        assert d[:].tolist() == [7, 7, 7, 7]            # nothing was written
        d[0] = 127                                      # NumPy's rule: what fits is fine
        assert d[0] == 127


def test_killed_create_leaves_a_recoverable_state(tmp_path):
    """A create killed after the data file and before the metadata: the messages name the
    state and the recovery they suggest works."""
    code = """
import os, sys, chemio_py as cio
import chemio_py.arrays.meta as meta
meta.write_atomic = lambda *a, **k: os.kill(os.getpid(), 9)
cio.DiskArray.create("k", (64, 64), "f8", path=sys.argv[1], persistent=True)
"""
    p = _run(code, str(tmp_path))
    assert p.returncode == -signal.SIGKILL
    data = str(tmp_path / "k.dra")
    assert os.path.exists(data) and not os.path.exists(data + ".json")
    with pytest.raises(MetadataError, match="interrupted"):
        cio.DiskArray.open(data)
    with pytest.raises(ArgumentError, match="without metadata") as ei:
        cio.DiskArray.create("k", (64, 64), "f8", path=tmp_path, persistent=True)
    assert "overwrite=True" in str(ei.value)
    d = cio.DiskArray.create("k", (64, 64), "f8", path=tmp_path, persistent=True,
                             overwrite=True)
    d[:] = 3.0
    d.close()
    e = cio.DiskArray.open(data)
    assert e[:].sum() == 3.0 * 64 * 64
    e.close()
    cio.DiskArray.open(data, "r+").delete()
