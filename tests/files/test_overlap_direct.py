"""``iter_blocks(direct=True)``: cold blocks of a DiskArray read through O_DIRECT and Linux
AIO straight into the ring buffers (``LocalArrayStore.native_read_region``), checked
against NumPy; shapes whose byte runs are not 4 KiB-aligned, cached blocks and stores
without the capability fall back to the ordinary path with the same results.
"""
from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends.local import linux_aio
from chemio_py.errors import StorageError
from chemio_py.prefetch import iter_blocks

pytestmark = pytest.mark.skipif(linux_aio.engine() is None, reason="no Linux AIO here")


def _array(name, model, tmp_path, **kw):
    d = cio.DiskArray.create(name, model.shape, model.dtype, backend="local", **kw)
    d[...] = model
    d.flush()
    return d


def _direct_ok(d) -> bool:
    try:
        os.close(os.open(d.path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def _count_native(monkeypatch) -> list:
    """Record what local stores' native region read returned (a request or None); call it
    before the array opens (a store's capabilities are taken at open)."""
    from chemio_py.backends.local import LocalArrayStore
    calls: list = []
    orig = LocalArrayStore.native_read_region

    def spy(self, *a, **k):
        r = orig(self, *a, **k)
        calls.append(r is not None)
        return r
    monkeypatch.setattr(LocalArrayStore, "native_read_region", spy)
    return calls


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("out_dtype", [None, np.float32])
def test_direct_blocks_match_numpy(tmp_path, monkeypatch, depth, out_dtype):
    model = np.random.default_rng(1).random((300, 1024))        # 8 KiB rows, chunks of rows
    calls = _count_native(monkeypatch)
    d = _array("odir", model, tmp_path, chunks=(64, 1024))
    try:
        if not _direct_ok(d):
            pytest.skip("no O_DIRECT on the scratch file system")
        d.evict()
        seen = []
        with iter_blocks(d, size=40, depth=depth, direct=True, out_dtype=out_dtype) as pipe:
            for section, block in pipe:
                want = model[section].astype(block.dtype)
                assert np.array_equal(block, want)
                time.sleep(0.0005)                  # reads in flight land elsewhere
                assert np.array_equal(block, want)
                seen.append(section[0])
        assert seen == [slice(k, min(k + 40, 300)) for k in range(0, 300, 40)]
        assert calls and all(calls), calls          # rows of 8 KiB: every block native
        assert d.outstanding == 0
    finally:
        d.delete()


@pytest.mark.parametrize("direct", [True, False])
def test_whole_blocks_are_the_ring_buffers(tmp_path, direct):
    # a step hands out a ring buffer as it is (no view made per step); the last, shorter
    # block is a view of one; the buffers are 4 KiB-aligned (O_DIRECT's rule)
    model = np.random.default_rng(8).random((300, 1024))
    d = _array("oring", model, tmp_path, chunks=(64, 1024))
    try:
        d.evict()
        with iter_blocks(d, size=64, depth=2, direct=direct) as pipe:
            for section, block in pipe:
                assert np.array_equal(block, model[section])
                ring = pipe.buffers()
                assert len(ring) <= 3 and all(b.shape == (64, 1024) for b in ring)
                assert all(b.ctypes.data % 4096 == 0 and b.flags.c_contiguous for b in ring)
                whole = section[0].stop - section[0].start == 64
                assert any(block is b for b in ring) == whole
                assert sum(np.shares_memory(block, b) for b in ring) == 1
    finally:
        d.delete()


def test_direct_default_follows_setting(tmp_path, monkeypatch):
    model = np.random.default_rng(2).random((64, 512))          # 4 KiB rows
    calls = _count_native(monkeypatch)
    d = _array("oset", model, tmp_path, chunks=(16, 512))
    try:
        if not _direct_ok(d):
            pytest.skip("no O_DIRECT on the scratch file system")
        d.evict()
        assert np.array_equal(np.concatenate([b.copy() for _, b in iter_blocks(d, size=16)]),
                              model)
        assert calls == []                          # off by default
        cio.configure(direct=True)
        try:
            d.evict()
            got = np.concatenate([b.copy() for _, b in d.iter_blocks(size=16)])
        finally:
            cio.configure(direct=None)
        assert np.array_equal(got, model) and calls and all(calls)
        with pytest.raises(ValueError):
            iter_blocks(d, direct="yes")
    finally:
        d.delete()


@pytest.mark.parametrize("shape,chunks,size", [
    ((50, 1000), (10, 1000), 7),        # 8000-byte rows: runs not 4 KiB-aligned
    ((40, 3, 512), (8, 3, 256), 8),     # chunks split the trailing axes: 2 KiB runs
    ((33, 2048), (8, 2048), 5),         # aligned, but blocks cut chunks: still one run each
])
def test_unaligned_shapes_fall_back(tmp_path, monkeypatch, shape, chunks, size):
    model = np.random.default_rng(3).random(shape)
    calls = _count_native(monkeypatch)
    d = _array("ofb", model, tmp_path, chunks=chunks)
    try:
        d.evict()
        for axis in range(len(shape)):
            for section, block in iter_blocks(d, axis=axis, size=size, depth=2, direct=True):
                assert np.array_equal(block, model[section])
        aligned = shape[1:] == chunks[1:] and (8 * int(np.prod(shape[1:]))) % 4096 == 0
        if not aligned:
            # no byte run of these blocks is aligned: none went native
            assert not any(calls[:-(-shape[0] // size)])
    finally:
        d.delete()


@pytest.mark.parametrize("depth", [1, 3])
def test_direct_blocks_of_many_runs_match_numpy(tmp_path, monkeypatch, depth):
    # chunks of one 4 KiB row of the middle axis: a block is 16 aligned runs, read with one
    # grouped submission; a block of whole rows is one run (a single control block)
    model = np.random.default_rng(7).random((44, 2, 512))
    calls = _count_native(monkeypatch)
    d = _array("oruns", model, tmp_path, chunks=(8, 1, 512))
    try:
        if not _direct_ok(d):
            pytest.skip("no O_DIRECT on the scratch file system")
        store = d.store
        buf = cio.aligned_empty((8, 2, 512), np.float64)
        assert len(store._direct_runs((slice(8, 16), slice(0, 2), slice(0, 512)), buf)[0]) == 16
        d.evict()
        seen = 0
        with iter_blocks(d, size=8, depth=depth, direct=True) as pipe:
            for section, block in pipe:
                assert np.array_equal(block, model[section])
                time.sleep(0.0005)                  # reads in flight land elsewhere
                assert np.array_equal(block, model[section])
                seen += 1
        assert seen == 6 and calls == [True] * 6    # the last block: 4 rows, 8 runs
        assert d.outstanding == 0 and linux_aio.engine().in_flight == 0
    finally:
        d.delete()


def test_cached_blocks_use_page_cache(tmp_path):
    model = np.random.default_rng(4).random((64, 1024))
    d = _array("ocached", model, tmp_path, chunks=(16, 1024))
    try:
        if not _direct_ok(d):
            pytest.skip("no O_DIRECT on the scratch file system")
        store = d.store
        region = (slice(16, 32), slice(0, 1024))
        out = cio.aligned_empty((16, 1024), np.float64)
        d[16:32]                                            # in the page cache now
        assert store.native_read_region(region, out, lambda *a: a) is None
        req = store.native_read_region(region, out, lambda n, t0, t1: n, cached=True)
        assert req is not None and req.wait() == out.nbytes
        assert np.array_equal(out, model[16:32])
        bad = np.empty((16, 1024))[::1]                     # not 4 KiB-aligned (maybe)
        if bad.ctypes.data % 4096:
            assert store.native_read_region(region, bad, lambda *a: a, cached=True) is None
        with pytest.raises(ValueError):
            store.native_read_region(region, np.empty((15, 1024)), lambda *a: a)
    finally:
        d.delete()


def test_direct_read_of_truncated_file_raises(tmp_path):
    model = np.random.default_rng(5).random((64, 1024))
    d = _array("otrunc", model, tmp_path, chunks=(16, 1024))
    try:
        if not _direct_ok(d):
            pytest.skip("no O_DIRECT on the scratch file system")
        d.evict()
        os.truncate(d.path, model.nbytes // 2)              # behind chemio's back
        got = []
        with pytest.raises(StorageError) as ei:
            for s, b in iter_blocks(d, size=16, depth=2, direct=True):
                assert np.array_equal(b, model[s])
                got.append(s)
        assert ei.value.errno == errno.EIO and len(got) == 2
        assert d.outstanding == 0
    finally:
        d.delete()


def test_early_break_leaves_nothing_in_flight(tmp_path):
    model = np.random.default_rng(6).random((256, 1024))
    d = _array("obrk", model, tmp_path, chunks=(16, 1024))
    try:
        d.evict()
        pipe = iter_blocks(d, size=16, depth=4, direct=True)
        for i, (s, b) in enumerate(pipe):
            assert np.array_equal(b, model[s])
            if i == 2:
                break
        pipe.close()
        assert pipe.in_flight == 0 and d.outstanding == 0
        assert linux_aio.engine().in_flight == 0
    finally:
        d.delete()
