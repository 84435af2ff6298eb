"""DiskArrays pickle as the way to reopen them (``chemio_py.arrays.pickling``).

Another process is a real one: a ``spawn`` worker of a process pool that lives for the
module (it imports chemio once), so what it does with the scratch is what a dask worker
process does. Every array is compared with a NumPy model; the suite's conftest fails a
test that leaves anything in the scratch root or in /dev/shm.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.arrays import pickling
from chemio_py.errors import MetadataError, ModeError, NotSharedError, StorageError
from conftest import usable_backends
import chemio_py.backends as backends

ARRAY_BACKENDS = [b for b in usable_backends(backends.ArrayBackend) if b != "mpiio"]


@pytest.fixture(scope="module")
def other():
    """A process of its own (spawned, as dask's are) for the whole module."""
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as ex:
        assert ex.submit(os.getpid).result(120) != os.getpid()
        yield ex


# ---------------------------------------------------------------- run in the other process

def _read_all(blob: bytes) -> tuple:
    """Unpickle there and read everything: (pid, mode, data, owner-less?)."""
    d = pickle.loads(blob)
    out = d[...] if d.ndim else d.read(())
    return os.getpid(), d.mode, out


def _write(blob: bytes, key: tuple, value: np.ndarray) -> str:
    d = pickle.loads(blob)
    d[key] = value
    return d.mode


def _try(blob: bytes, action: str = "read") -> tuple[str, str]:
    """(exception class, message) of unpickling then ``action``; ('', '') if none."""
    try:
        d = pickle.loads(blob)
        if action == "write":
            d[(0,) * d.ndim] = 1
        elif action == "close":
            d.close()
        else:
            d.read(())
    except Exception as e:          # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return "", ""


def _same_copy(blob: bytes) -> bool:
    """Two unpicklings in one process share one open handle while it is alive; closing
    one copy lets go of it without closing the other."""
    a, b = pickle.loads(blob), pickle.loads(blob)
    shared = a.store is b.store and a.store is not None
    a.close()
    return shared and a.closed and not b.closed and b[0, 0] is not None


def _read_view(blob: bytes) -> np.ndarray:
    box = pickle.loads(blob)
    return box["view"][...]


def _scratch_files(root: str) -> list:
    return [os.path.join(p, n) for p, ds, fs in os.walk(root) for n in fs + ds]


# ---------------------------------------------------------------- this process

def _model(shape, dtype="f8", seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("be", ARRAY_BACKENDS)
def test_in_this_process_a_pickled_array_is_the_array_itself(be):
    with cio.DiskArray.create("p", (6, 5), "f8", backend=be) as d:
        blob = pickle.dumps(d)
        assert b"mmap" not in blob and len(blob) < 2000
        assert pickle.loads(blob) is d
        import copy
        assert copy.deepcopy(d) is d and copy.copy(d) is d
    # closed: a scratch array is gone with its handle; a copy says so when it is used
    gone = pickle.loads(blob)
    assert isinstance(gone, cio.DiskArray) and gone.shape == (6, 5) and not gone.closed
    with pytest.raises(StorageError, match="scratch array lives as long as its creator"):
        gone[0, 0]


def test_a_persistent_array_reopens_after_its_handle_closed(tmp_path):
    model = _model((7, 3))
    d = cio.DiskArray.create("keep", model.shape, "f8", path=tmp_path)
    d[...] = model
    blob_rw = pickle.dumps(d)
    d.close()
    e = pickle.loads(blob_rw)
    assert e is not d and e.mode == "r+" and (e[...] == model).all()
    e[0, 0] = 42.0
    e.close()
    r = cio.DiskArray.open(d.path)
    blob_r = pickle.dumps(r)
    r.close()
    f = pickle.loads(blob_r)
    assert f.mode == "r" and f[0, 0] == 42.0
    with pytest.raises(ModeError):
        f[0, 0] = 1.0
    f.delete()


@pytest.mark.parametrize("be", ARRAY_BACKENDS)
def test_another_process_reads_and_writes_a_scratch_array(other, scratch_root, be):
    model = _model((40, 9))
    d = cio.DiskArray.create("s", model.shape, "f8", chunks=(8, 9), backend=be)
    try:
        d[...] = model
        blob = pickle.dumps(d)
        pid, mode, got = other.submit(_read_all, blob).result(60)
        assert pid != os.getpid() and mode == "r+"
        np.testing.assert_array_equal(got, model)
        # a write of part of a chunk from there lands here, the rest of the chunk kept
        block = np.full((3, 4), -1.0)
        assert other.submit(_write, blob, np.s_[5:8, 2:6], block).result(60) == "r+"
        model[5:8, 2:6] = block
        np.testing.assert_array_equal(d[...], model)
        assert other.submit(_same_copy, blob).result(60)
        # the copy there closed: the array is still here, still ours
        assert other.submit(_try, blob, "close").result(60) == ("", "")
        np.testing.assert_array_equal(d[...], model)
    finally:
        d.close()
    # the owner's close removed it as ever; there, unpickling now says why it fails
    if be != "shm":
        assert not any("s.dra" in p for p in _scratch_files(scratch_root))
    kind, msg = other.submit(_try, blob).result(60)
    assert kind == "StorageError" and "scratch array" in msg and "ENOENT" in msg


def test_a_read_only_handle_gives_read_only_copies(other, tmp_path):
    model = _model((10, 10))
    with cio.DiskArray.create("ro", model.shape, "f8", path=tmp_path) as d:
        d[...] = model
    r = cio.DiskArray.open(tmp_path / "ro.dra")
    try:
        blob = pickle.dumps(r)
        _, mode, got = other.submit(_read_all, blob).result(60)
        assert mode == "r"
        np.testing.assert_array_equal(got, model)
        kind, msg = other.submit(_try, blob, "write").result(60)
        assert kind == "ModeError" and "read-only" in msg
    finally:
        r.delete()


def test_an_array_created_again_under_the_same_name_is_refused(other, tmp_path):
    d = cio.DiskArray.create("again", (4, 4), "f8", path=tmp_path)
    blob = pickle.dumps(d)
    d.close()
    e = cio.DiskArray.create("again", (4, 4), "f8", path=tmp_path, overwrite=True)
    try:
        kind, msg = other.submit(_try, blob).result(60)
        assert kind == "MetadataError" and "another uuid" in msg
        with pytest.raises(MetadataError, match="created again"):
            pickle.loads(blob)[0, 0]
    finally:
        e.delete()


def test_an_array_inside_another_object_pickles_with_it(other):
    """What views do: (array, key) inside another object; one array pickled once."""
    model = _model((12, 6))
    with cio.DiskArray.create("inner", model.shape, "f8", chunks=(4, 6)) as d:
        d[...] = model
        box = {"a": d, "b": [d, d], "view": d.view[3:9, ::2] if hasattr(d, "view") else d}
        blob = pickle.dumps(box)
        assert blob.count(b"DiskArray") == 1            # the memo: one state for one array
        back = pickle.loads(blob)
        assert back["a"] is d and back["b"][1] is d
        got = other.submit(_read_view, blob).result(60)
        want = model[3:9, ::2] if hasattr(d, "view") else model
        np.testing.assert_array_equal(got, want)


def test_checksummed_array_written_from_another_process_verifies(other):
    model = _model((16, 8))
    with cio.DiskArray.create("crc", model.shape, "f8", chunks=(4, 8), checksum=True) as d:
        d[...] = model
        blob = pickle.dumps(d)
        other.submit(_write, blob, np.s_[1:3, 2:5], np.ones((2, 3))).result(60)
        model[1:3, 2:5] = 1.0
        np.testing.assert_array_equal(d[...], model)      # every chunk's CRC checked


def test_shm_array_on_another_node_is_refused_clearly():
    with cio.DiskArray.create("node", (4,), "f8", backend="shm") as d:
        state = dict(pickling.reduce_array(d, d.uuid)[1][0])
        state["origin"] = dict(state["origin"], host="elsewhere", pid=1)
        copy = pickling.reopen_array(state)             # nothing opened yet: no error
        assert copy.shape == (4,) and copy.backend == "shm"
        with pytest.raises(NotSharedError, match="lives in the memory of host 'elsewhere'"):
            copy[0]
        state["origin"]["host"] = os.uname().nodename
        state["origin"]["boot"] = "another-boot"
        with pytest.raises(NotSharedError, match="rebooted"):
            pickling.reopen_array(state).read(())


def test_mpiio_array_is_read_through_local_read_only(other, tmp_path):
    if "mpiio" not in usable_backends(backends.ArrayBackend):
        pytest.skip("mpiio is not usable here")
    model = _model((8, 8))
    with cio.DiskArray.create("mp", model.shape, "f8", backend="mpiio", path=tmp_path) as d:
        d.write_all((), model)
        d.flush()
        blob = pickle.dumps(d)
        _, mode, got = other.submit(_read_all, blob).result(60)
        assert mode == "r"
        np.testing.assert_array_equal(got, model)
        kind, msg = other.submit(_try, blob, "write").result(60)
        assert kind == "ModeError" and "'mpiio'" in msg and "data sieving" in msg
        d.delete()


def test_bad_state_is_refused():
    from chemio_py.errors import ArgumentError
    with pytest.raises(ArgumentError, match="not a pickled DiskArray"):
        pickling.reopen_array({"kind": "SharedFile"})
    with pytest.raises(ArgumentError, match="format"):
        pickling.reopen_array({"kind": "DiskArray", "format": 99})
