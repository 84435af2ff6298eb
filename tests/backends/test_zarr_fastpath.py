"""The ``zarr`` backend's fast paths for many small objects: reads that open and queue a
batch of objects before reading them, temporary names without a random-number syscall,
the all-fill check. Same results as the plain path, no descriptor or file left behind."""
from __future__ import annotations

import os

import numpy as np
import pytest

import chemio_py.backends as backends
from chemio_py.errors import MetadataError

pytest.importorskip("zarr")


def _open(path, mode="w+", shape=(50, 64), chunks=(8, 8), **kw):
    return backends.resolve("zarr").open_array(str(path), mode, shape=shape,
                                               dtype=np.dtype("f8"), chunks=chunks, **kw)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("compressor", ["none", "zstd"])
def test_batched_read_mixes_absent_present_and_cut_objects(tmp_path, compressor):
    st = _open(tmp_path / "a.zarr", compressor=compressor)
    try:
        x = np.arange(50 * 64, dtype="f8").reshape(50, 64) + 1
        x[8:16, :] = 0                                    # a row of all-zero objects: absent
        st.write((slice(0, 50), slice(0, 64)), x)
        assert not os.path.exists(tmp_path / "a.zarr" / "c" / "1" / "0")
        before = _fds()
        for region in [(slice(0, 50), slice(0, 64)), (slice(3, 47), slice(5, 61)),
                       (slice(7, 17), slice(0, 64))]:
            out = np.full(tuple(s.stop - s.start for s in region), -1.0)
            st.read(region, out)
            assert np.array_equal(out, x[region])
        assert _fds() == before
    finally:
        st.close()


def test_corrupt_object_in_a_batch_raises_and_closes_every_descriptor(tmp_path):
    st = _open(tmp_path / "b.zarr", compressor="zstd")
    try:
        x = np.random.default_rng(1).standard_normal((50, 64))
        st.write((slice(0, 50), slice(0, 64)), x)
        bad = tmp_path / "b.zarr" / "c" / "2" / "3"
        bad.write_bytes(b"\x28\xb5\x2f\xfd" + b"garbage" * 10)
        before = _fds()
        with pytest.raises(MetadataError, match="does not decode"):
            st.read((slice(0, 50), slice(0, 64)), np.empty((50, 64)))
        assert _fds() == before
        out = np.empty((8, 64))                          # the row above is still fine
        st.read((slice(8, 16), slice(0, 64)), out)
        assert np.array_equal(out, x[8:16])
    finally:
        st.close()


def test_many_rewrites_leave_no_temporary_files(tmp_path):
    st = _open(tmp_path / "c.zarr", shape=(16, 16), chunks=(4, 4))
    try:
        for k in range(20):
            st.write((slice(0, 16), slice(0, 16)), np.full((16, 16), float(k + 1)))
        names = [n for _, _, fs in os.walk(tmp_path / "c.zarr") for n in fs]
        assert not [n for n in names if n.endswith(".tmp")]
        out = np.empty((16, 16))
        st.read((slice(0, 16), slice(0, 16)), out)
        assert (out == 20.0).all()
    finally:
        st.close()


def test_all_fill_check_sees_a_single_nonzero_anywhere(tmp_path):
    st = _open(tmp_path / "d.zarr", shape=(8, 8), chunks=(8, 8))
    try:
        for pos in [(0, 0), (7, 7), (3, 4)]:
            x = np.zeros((8, 8))
            x[pos] = -0.0 if pos == (3, 4) else 1e-300      # -0.0 is not the fill's bytes
            st.write((slice(0, 8), slice(0, 8)), x)
            assert os.path.exists(tmp_path / "d.zarr" / "c" / "0" / "0"), pos
            out = np.empty((8, 8))
            st.read((slice(0, 8), slice(0, 8)), out)
            assert np.array_equal(out, x) and np.signbit(out).sum() == np.signbit(x).sum()
        st.write((slice(0, 8), slice(0, 8)), np.zeros((8, 8)))
        assert not os.path.exists(tmp_path / "d.zarr" / "c" / "0" / "0")
    finally:
        st.close()
