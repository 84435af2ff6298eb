"""A backend is one file plus one registration: the example of docs/architecture.md
(``tests/example_backend.py``), registered with ``chemio_py.backends.register``, runs
ExclusiveFile, SharedFile, RecordFile and DiskArray end to end against NumPy and bytearray
models, and leaves nothing behind at cleanup. The document shows that very file."""
from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.scratch import jobs
from chemio_py.errors import (BackendUnavailableError, EndOfFileError, LimitExceededError,
                              ModeError, StorageError)

from chemio_py.testing import BackendTests
from example_backend import PlainArrayStore, PlainBackend, PlainByteStore
from conftest import REPO

ROOT = Path(REPO)
NAME = "plain"


@pytest.fixture
def plain():
    """The example backend, registered as users register theirs, and forgotten after."""
    backends.register(NAME, PlainBackend)
    try:
        yield NAME
    finally:
        backends.unregister(NAME)


def _model_ops(rng, n_ops: int, span: int):
    for _ in range(n_ops):
        off = int(rng.integers(0, span))
        yield off, rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8)


# ---------------------------------------------------------------- the document

def test_the_document_shows_this_very_backend():
    """docs/architecture.md's example is tests/example_backend.py, byte for byte."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    source = (ROOT / "tests" / "example_backend.py").read_text()
    assert source in blocks, "docs/architecture.md must show tests/example_backend.py in full"


def test_the_documents_usage_snippet_runs():
    """The "Registering and using it" block of docs/architecture.md, run as written."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S)
                 if "backends.register(\"plain\", PlainBackend)" in b)
    try:
        exec(compile(block, "docs/architecture.md", "exec"), {})
    finally:
        backends.unregister(NAME)


def test_registration_makes_it_a_backend(plain):
    be = backends.resolve(plain)
    assert isinstance(be, PlainBackend) and plain in backends.names()
    assert backends.availability()[plain] == (True, PlainBackend.description)
    assert isinstance(be, backends.Backend)
    with pytest.raises(ValueError, match="already registered"):
        backends.register(plain, PlainBackend)


def test_an_unknown_backend_is_unavailable_not_an_attribute_error():
    with pytest.raises(BackendUnavailableError, match="no backend of that name"):
        cio.ExclusiveFile("x", "w+", backend="plain-not-registered")


class TestPlainConformance(BackendTests):
    """The conformance suite of ``chemio_py.testing``, as a third party runs it."""

    backend = NAME
    # The registration lives in this process: an ``mpiexec`` child does not have it.
    test_shared_file_under_mpiexec = None
    test_diskarray_write_all_under_mpiexec = None

    @pytest.fixture(autouse=True)
    def _registered(self, plain):
        yield


# ---------------------------------------------------------------- ExclusiveFile

def test_exclusive_file_against_a_bytearray_model(plain):
    rng = np.random.default_rng(1)
    model = bytearray()

    def put(off: int, data: np.ndarray) -> None:
        end = off + data.nbytes
        if end > len(model):
            model.extend(bytes(end - len(model)))
        model[off:end] = data.tobytes()

    with cio.ExclusiveFile("eaf", "w+", backend=plain, size_hint=1 << 16) as f:
        assert f.backend == plain and isinstance(f.store, PlainByteStore)
        assert os.path.dirname(f.path).startswith(jobs.private_root(0))
        assert f.path.endswith("eaf.0") and oct(os.stat(f.path).st_mode & 0o777) == "0o600"
        reqs, pending = [], []
        for i, (off, data) in enumerate(_model_ops(rng, 200, 50_000)):
            if any(off < hi and lo < off + data.nbytes for lo, hi in pending):
                cio.waitall(reqs)                      # one writer per range at a time
                reqs, pending = [], []
            if i % 2:
                f.write(off, data)
            else:
                reqs.append(f.awrite(off, data))        # runs on the I/O pool
                pending.append((off, off + data.nbytes))
            put(off, data)
        cio.waitall(reqs)
        assert f.size == len(model)
        for off, data in _model_ops(rng, 100, len(model)):
            n = min(data.nbytes, len(model) - off)
            assert f.read_bytes(off, n) == bytes(model[off:off + n])
            out = bytearray(n)
            assert f.aread(off, out).wait() is out and out == model[off:off + n]
        # many at once: the per-request pool path (the store has no native_*_many)
        offs = [0, 4096, 123, len(model) - 8]
        bufs = [bytearray(8) for _ in offs]
        f.aread_many(offs, bufs).wait()
        assert [bytes(b) for b in bufs] == [bytes(model[o:o + 8]) for o in offs]
        with pytest.raises(EndOfFileError):
            f.read(len(model) - 4, bytearray(8))
        with pytest.raises(EndOfFileError):
            f.aread(len(model) + 100, bytearray(1)).wait()
        f.write(len(model) + 1000, b"tail")            # a hole reads as zeros
        assert f.read_bytes(len(model), 1004) == bytes(1000) + b"tail"
        f.truncate(10)
        assert f.size == 10 and f.read_bytes(0, 10) == bytes(model[:10])
        f.flush()
        path = f.path
    with cio.ExclusiveFile("eaf", "r", backend=plain) as g:
        assert g.read_bytes(0, 10) == bytes(model[:10])
        with pytest.raises(ModeError):
            g.write(0, b"x")
    assert cio.ExclusiveFile.remove("eaf", backend=plain) and not os.path.exists(path)
    assert not cio.ExclusiveFile.remove("eaf", backend=plain)
    with pytest.raises(FileNotFoundError):
        cio.ExclusiveFile("eaf", "r", backend=plain)


def test_a_full_file_system_is_an_out_of_space_error(plain, small_fs):
    """A real 1 MiB tmpfs: the write that does not fit raises ``OutOfSpaceError`` (an
    ``OSError`` with ENOSPC and the path); a size hint that cannot fit fails up front."""
    if small_fs is None:
        pytest.skip("cannot mount a tmpfs here (not root)")
    with pytest.raises(cio.OutOfSpaceError):
        cio.ExclusiveFile("hint", "w+", backend=plain, dir=small_fs, size_hint=4 << 20)
    assert os.listdir(small_fs) == []                    # nothing was created
    with cio.ExclusiveFile("full", "w+", backend=plain, dir=small_fs) as f:
        with pytest.raises(cio.OutOfSpaceError) as ei:
            f.write(0, np.ones(2 << 20, np.uint8))
        assert ei.value.errno == errno.ENOSPC and ei.value.filename == f.path
        f.delete()


def test_a_fifo_in_the_way_is_refused_not_blocked_on(plain, tmp_path):
    os.mkfifo(tmp_path / "fifo.0")
    with pytest.raises(StorageError, match="not a regular file"):
        cio.ExclusiveFile("fifo", "r+", backend=plain, dir=str(tmp_path))


# ---------------------------------------------------------------- SharedFile (serial)

def test_shared_file_against_a_bytearray_model(plain):
    rng = np.random.default_rng(2)
    model = bytearray(20_000)
    with cio.SharedFile("sf", hard_limit=20_000, soft_limit=8192, backend=plain) as sf:
        assert sf.backend == plain and sf.path.endswith("sf.sf") and sf.size == 0
        assert sf.reserved >= 8192
        top = 0
        for off, data in _model_ops(rng, 150, 17_000):
            sf.awrite(off, data).wait()
            model[off:off + data.nbytes] = data.tobytes()
            top = max(top, off + data.nbytes)
        assert sf.size == top
        assert sf.read_bytes(0, top) == bytes(model[:top])
        with pytest.raises(LimitExceededError):
            sf.write(19_999, b"xy")
        assert sf.size == top                            # nothing was written
        path = sf.path
    assert not os.path.exists(path)                      # the with block destroyed it


# ---------------------------------------------------------------- RecordFile

def test_record_file_on_the_example_backend(plain):
    rng = np.random.default_rng(3)
    recs = [(np.arange(i % 37, dtype=np.int32), rng.random(i % 11)) for i in range(3000)]
    with cio.RecordFile("log", "w+", backend=plain, page_size=1 << 20) as log:
        for r in recs:
            log.append(*r)
        log.flush()
        got = list(log.replay(depth=2))
        assert len(got) == len(recs)
        for (a, b), (x, y) in zip(got, recs):
            np.testing.assert_array_equal(a, x)
            np.testing.assert_array_equal(b, y)
        log.delete()


# ---------------------------------------------------------------- DiskArray

DTYPES = ["float64", "complex64", "int16", "bool"]


def _rand(rng, shape, dtype):
    dt = np.dtype(dtype)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    return (rng.standard_normal(shape) * 100).astype(dt)


def _section(rng, shape):
    out = []
    for n in shape:
        lo = int(rng.integers(0, n))
        out.append(slice(lo, int(rng.integers(lo, n + 1))))
    return tuple(out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_disk_array_against_a_numpy_model(plain, dtype):
    rng = np.random.default_rng(4)
    shape = (37, 23, 5)
    model = np.zeros(shape, dtype)
    d = cio.DiskArray.create("dra", shape, dtype, chunks=(8, 8, 5), backend=plain)
    assert d.backend == plain and isinstance(d.store, PlainArrayStore)
    np.testing.assert_array_equal(d[...], model)         # every element starts at zero
    for i in range(60):
        sec = _section(rng, shape)
        data = _rand(rng, model[sec].shape, dtype)
        if i % 3 == 0:
            d.awrite(sec, data).wait()
        elif i % 3 == 1:
            d.write_all(sec, data)
        else:
            d[sec] = data
        model[sec] = data
        sec = _section(rng, shape)
        if i % 2:
            np.testing.assert_array_equal(d.aread(sec).wait(), model[sec])
        else:
            np.testing.assert_array_equal(d.read_all(sec), model[sec])
    np.testing.assert_array_equal(d[3, :, 2], model[3, :, 2])        # int indices
    np.testing.assert_array_equal(d.read(np.s_[1:9, 2:4], transpose=True),
                                  model[1:9, 2:4].T)
    d.write(np.s_[0:2, 0:3, 0:5], model[0:2, 0:3, 0:5].T.copy(), transpose=True)
    seen = np.zeros_like(model)
    for sec, block in d.iter_blocks(axis=0, size=6, depth=2):
        seen[sec] = block
    np.testing.assert_array_equal(seen, model)
    data, meta = d.path, d.meta_path
    assert os.path.exists(data) and os.path.exists(meta)
    d.close()                                            # a scratch array vanishes
    assert not os.path.exists(data) and not os.path.exists(meta)


def test_persistent_disk_array_reopens_on_the_example_backend(plain, tmp_path):
    model = np.arange(6 * 7, dtype=np.float64).reshape(6, 7)
    with cio.DiskArray.create("keep", model.shape, "f8", backend=plain, path=tmp_path) as d:
        d[...] = model
        path = d.path
    with cio.DiskArray.open(path) as d:                  # the metadata names the backend
        assert d.backend == plain
        np.testing.assert_array_equal(d[...], model)
    with cio.DiskArray.open(path, "r+") as d:
        d[2:4, 1] = -1.0
        model[2:4, 1] = -1.0
    d = cio.DiskArray.open(path)
    np.testing.assert_array_equal(d[...], model)
    d.delete()
    assert os.listdir(tmp_path) == []


def test_the_format_is_the_stores(plain, tmp_path):
    """The metadata names the example's own format; a backend that cannot read it (local
    reads the raw chunk grid) refuses it with a MetadataError naming the one that can."""
    with cio.DiskArray.create("fmt", (5, 3), "i4", backend=plain, path=tmp_path) as d:
        d[...] = np.arange(15).reshape(5, 3)
        path = d.path
    assert json.loads(Path(path + ".json").read_text())["layout"] == "c-order"
    assert np.fromfile(path, "i4").tolist() == list(range(15))      # plain C order on disk
    with pytest.raises(cio.MetadataError, match=r"format 'c-order'.*one of \['plain'\]"):
        cio.DiskArray.open(path, backend="local")
    cio.DiskArray.open(path, "r+").delete()


def test_a_truncated_data_file_is_a_metadata_error(plain, tmp_path):
    with cio.DiskArray.create("cut", (10, 10), "f8", backend=plain, path=tmp_path) as d:
        path = d.path
    os.truncate(path, 100)
    with pytest.raises(cio.MetadataError, match="needs 800"):
        cio.DiskArray.open(path)
    os.unlink(path)
    os.unlink(path + ".json")


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), shape=st.lists(st.integers(1, 9), min_size=1, max_size=3))
def test_disk_array_sections_property(plain, data, shape):
    shape = tuple(shape)
    model = np.zeros(shape, "int32")
    with cio.DiskArray.create("prop", shape, "int32", backend=plain) as d:
        for _ in range(4):
            sec = tuple(slice(lo, data.draw(st.integers(lo, n)))
                        for n in shape for lo in [data.draw(st.integers(0, n))])
            vals = np.arange(model[sec].size, dtype="int32").reshape(model[sec].shape) + 7
            d[sec] = vals
            model[sec] = vals
            np.testing.assert_array_equal(d[...], model)


# ---------------------------------------------------------------- cleanup

def test_cleanup_removes_what_the_example_backend_made(plain):
    f = cio.ExclusiveFile("left", "w+", backend=plain)
    f.write(0, b"data")
    d = cio.DiskArray.create("leftarr", (4, 4), "f8", backend=plain)
    d[...] = 1.0
    paths = [f.path, d.path, d.meta_path]
    assert all(os.path.exists(p) for p in paths)
    cio.cleanup()                                        # what exit does
    assert not any(os.path.exists(p) for p in paths)
    assert f.closed and d.closed
