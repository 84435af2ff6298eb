"""The ``zarr`` backend's paths for large objects (issue 28): shards written from their
parts with ``pwritev`` into preallocated temporary files, raw inner chunks read straight
into the caller's array, inner chunks encoded and decoded over the I/O pool, and the
durability contract (persistent arrays synced once at ``flush``/``close``, scratch arrays
never). Every result is compared with a NumPy model."""
from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.backends import posix
from chemio_py.backends.zarr import backend as zb, format as zf
from chemio_py.errors import OutOfSpaceError

pytest.importorskip("zarr")


def _open(path, mode="w+", shape=(600, 2048), chunks=(256, 2048), **kw):
    return backends.resolve("zarr").open_array(str(path), mode, shape=shape,
                                               dtype=np.dtype("f8"), chunks=chunks, **kw)


def _files(path) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, fs in os.walk(path) for n in fs
                  if n != zf.META_NAME)


# inner chunks: contiguous rows of the object (read straight into the caller's array),
# columns (gathered / scattered), the default, and none
LAYOUTS = [(64, 2048), (256, 128), None, False]


@pytest.mark.parametrize("compressor", ["none", "zstd"])
@pytest.mark.parametrize("inner", LAYOUTS)
def test_large_objects_against_a_model(tmp_path, compressor, inner):
    """4 MiB objects (edge objects cut by the shape): whole-object, partial and
    unaligned writes and reads, shards over the pool, zarr-python reads the same."""
    import zarr
    p = tmp_path / "a.zarr"
    st = _open(p, compressor=compressor, inner_chunks=inner)
    model = np.zeros((600, 2048))
    rng = np.random.default_rng(3)
    try:
        x = rng.standard_normal((600, 2048)).astype(np.float32).astype(np.float64)
        st.write((slice(0, 600), slice(0, 2048)), x)
        model[...] = x
        for region in [(slice(256, 512), slice(0, 2048)), (slice(100, 300), slice(5, 2000)),
                       (slice(590, 600), slice(0, 7)), (slice(0, 1), slice(0, 2048))]:
            data = rng.standard_normal(tuple(s.stop - s.start for s in region))
            st.write(region, data)
            model[region] = data
        for region in [(slice(0, 600), slice(0, 2048)), (slice(256, 512), slice(0, 2048)),
                       (slice(37, 555), slice(100, 1999)), (slice(599, 600), slice(0, 2048))]:
            out = np.full(tuple(s.stop - s.start for s in region), -7.0)
            st.read(region, out)
            assert np.array_equal(out, model[region]), region
        strided = np.full((600, 4096), -7.0)[:, ::2]          # a destination with gaps
        st.read((slice(0, 600), slice(0, 2048)), strided)
        assert np.array_equal(strided, model)
        assert not [f for f in _files(p) if f.endswith(".tmp")]
    finally:
        st.close()
    assert np.array_equal(zarr.open_array(str(p), mode="r")[...], model)


def test_a_shard_of_more_parts_than_one_pwritev_takes(tmp_path):
    """2048 inner chunks (more than IOV_MAX buffers) plus the index: written whole."""
    st = _open(tmp_path / "b.zarr", shape=(64, 64), chunks=(64, 64), inner_chunks=(1, 2),
               compressor="none")
    try:
        x = np.arange(64 * 64, dtype="f8").reshape(64, 64) + 1
        st.write((slice(0, 64), slice(0, 64)), x)
        out = np.empty((64, 64))
        st.read((slice(0, 64), slice(0, 64)), out)
        assert np.array_equal(out, x)
        assert st.verify_object((0, 0)) == 64 * 64 * 8 + 2048 * 16 + 4
    finally:
        st.close()


def test_pwrite_parts_continues_short_writes(tmp_path, monkeypatch):
    """A ``pwritev`` that writes less than asked (here: at most 1000 bytes a call, cutting
    buffers in the middle) is continued where it stopped."""
    real = os.pwritev
    parts = [os.urandom(n) for n in (10, 3000, 0, 999, 1, 2500)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: real(
            fd, [memoryview(b"".join(bytes(b) for b in bufs))[:1000]], off))
        n = zf.pwrite_parts(fd, [memoryview(p) for p in parts], 0)
    finally:
        os.close(fd)
    assert n == sum(map(len, parts))
    assert (tmp_path / "f").read_bytes() == b"".join(parts)


def test_preallocation_refused_falls_back_and_enospc_changes_nothing(tmp_path, monkeypatch):
    st = _open(tmp_path / "c.zarr", compressor="none", inner_chunks=False)
    try:
        x = np.ones((600, 2048))
        st.write((slice(0, 256), slice(0, 2048)), x[:256])
        obj = tmp_path / "c.zarr" / "c" / "0" / "0"
        before = obj.read_bytes()

        class Refuse:                       # a file system without fallocate
            def __call__(self, fd, mode, off, n):
                import ctypes
                ctypes.set_errno(errno.EOPNOTSUPP)
                return -1
        monkeypatch.setattr(zf, "_fallocate_fn", [(Refuse(), __import__("ctypes"))])
        st.write((slice(256, 512), slice(0, 2048)), 2 * x[:256])
        out = np.empty((512, 2048))
        st.read((slice(0, 512), slice(0, 2048)), out)
        assert (out[:256] == 1).all() and (out[256:] == 2).all()

        def full(fd, n):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(zf, "preallocate", full)
        with pytest.raises(OutOfSpaceError):
            st.write((slice(0, 256), slice(0, 2048)), 3 * x[:256])
        assert obj.read_bytes() == before                   # the old object, whole
        assert not [f for f in _files(tmp_path / "c.zarr") if f.endswith(".tmp")]
    finally:
        st.close()


# ---------------------------------------------------------------- durability

def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache after asking the kernel to drop them: clean
    pages go, dirty ones (not yet on the device) stay."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        try:
            view = np.frombuffer(m, np.uint8)
            pages = posix.mincore_pages(view.ctypes.data, size)
            del view
        finally:
            m.close()
    finally:
        os.close(fd)
    assert pages is not None
    return int(pages.sum())


def _drop_needs_a_disk(path) -> None:
    if not posix.mincore_ok():
        pytest.skip("no mincore here")
    if cio.stat(str(path)).fstype in ("tmpfs", "ramfs", None):
        pytest.skip("the page cache is the storage here: nothing to write back")


@pytest.mark.parametrize("how", ["flush", "close"])
def test_persistent_array_is_on_the_device_after_flush_or_close(tmp_path, how):
    _drop_needs_a_disk(tmp_path)
    d = cio.DiskArray.create("p", (600, 2048), "f8", chunks=(256, 2048), backend="zarr",
                             path=str(tmp_path), persistent=True, compressor="none")
    x = np.random.default_rng(0).standard_normal((600, 2048))
    d.write(np.s_[:, :], x)
    path = d.path
    if how == "flush":
        d.flush()
    d.close()
    files = _files(path)
    assert len(files) == 3
    assert [_resident_pages(f) for f in files] == [0, 0, 0]    # nothing left dirty
    e = cio.DiskArray.open(path)
    assert np.array_equal(e[:, :], x)
    e.delete()


def test_flush_syncs_each_object_once_and_a_scratch_array_never(tmp_path, monkeypatch):
    """Counted (no observable tells "not synced" from "written back by the kernel"): a
    persistent array's flush fsyncs every object written since the last flush once and
    each directory whose entries changed once; a scratch array's flush and close sync
    nothing."""
    synced: list = []
    real = os.fsync

    def counting(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    d = cio.DiskArray.create("q", (600, 2048), "f8", chunks=(256, 2048), backend="zarr",
                             path=str(tmp_path), persistent=True, compressor="zstd",
                             inner_chunks=(64, 2048))
    s = cio.DiskArray.create("s", (600, 2048), "f8", chunks=(256, 2048), backend="zarr",
                             compressor="zstd", inner_chunks=(64, 2048))
    x = np.random.default_rng(0).standard_normal((600, 2048))
    try:
        for a in (d, s):
            a.write(np.s_[:, :], x)
            a.write(np.s_[:10, :], x[:10])                  # object 0 written twice
        monkeypatch.setattr(os, "fsync", counting)
        s.flush()
        assert synced == []
        d.flush()
        objects = [f for f in synced if os.path.isfile(f)]
        assert sorted(objects) == _files(d.path)            # each object once
        dirs = sorted(f for f in synced if os.path.isdir(f))
        want = [os.path.join(d.path, k) for k in ("", "c", "c/0", "c/1", "c/2")]
        assert dirs == sorted(os.path.normpath(w) for w in want)  # each changed one once
        assert len(synced) == len(objects) + len(dirs)
        synced.clear()
        d.flush()                                           # nothing written since
        assert synced == []
        out = np.empty((600, 2048))
        s.read(np.s_[:, :], out=out)
        assert np.array_equal(out, x)
        s.close()
        assert synced == []
    finally:
        monkeypatch.setattr(os, "fsync", real)
        d.delete()
        s.close()


def test_durable_follows_chemios_persistent_flag(tmp_path):
    st = _open(tmp_path / "f.zarr", attributes={"persistent": False})   # chemio's entry
    try:
        assert not zb.durable_array(st.meta)
    finally:
        st.close()
    st = _open(tmp_path / "g.zarr")                          # anyone's array: durable
    try:
        assert zb.durable_array(st.meta)
    finally:
        st.close()
