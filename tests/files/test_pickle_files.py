"""Byte files pickle as the way to reopen them (``chemio_py.files.pickling``).

The other process is real: a ``spawn`` worker of a process pool that lives for the module.
Contents are compared with bytes models; the conftest fails a test that leaves files in
the scratch root or in /dev/shm.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.errors import ArgumentError, NotSharedError, StorageError
from chemio_py.files import exclusive, shared


@pytest.fixture(scope="module")
def other():
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as ex:
        assert ex.submit(os.getpid).result(120) != os.getpid()
        yield ex


# ---------------------------------------------------------------- run in the other process

def _read_copy(blob: bytes, n: int, tries: tuple = ("write",)) -> tuple:
    """Read a byte file's copy; try each of ``tries`` (``write``, ``delete``), recording the
    errors; close it."""
    f = pickle.loads(blob)
    got = f.read_bytes(0, n)
    errors = []
    acts = {"write": lambda: f.write(0, b"x"), "delete": lambda: f.delete()}
    for act in tries:
        try:
            acts[act]()
        except Exception as e:      # noqa: BLE001 - reported to the test
            errors.append((type(e).__name__, str(e)))
    mode = f.mode
    f.close()
    return got, mode, errors


def _sf_there(blob: bytes, at: int, data: bytes, past: int) -> tuple:
    """Write into a SharedFile copy; a write past its hard limit; destroy the copy."""
    f = pickle.loads(blob)
    f.write(at, data)
    try:
        f.write(past, b"0123456789")
        limit = ""
    except Exception as e:          # noqa: BLE001
        limit = type(e).__name__
    head = f.read_bytes(0, 5)
    mode, ranks = f.mode, f.comm.size
    f.destroy()                      # a copy: closes it, removes nothing
    return head, limit, mode, ranks


def _records_there(blob: bytes) -> tuple:
    log = pickle.loads(blob)
    recs = [(a.tolist(), b.tolist()) for a, b in log.replay()]
    mode = log.mode
    log.close()
    return recs, mode


def _error_there(blob: bytes) -> tuple[str, str]:
    try:
        f = pickle.loads(blob)
        f.close()
    except Exception as e:          # noqa: BLE001
        return type(e).__name__, str(e)
    return "", ""


# ---------------------------------------------------------------- tests

def test_in_this_process_a_pickled_file_is_the_file_itself():
    with cio.ExclusiveFile("e1", "w+") as f, cio.RecordFile("r1", "w+") as log:
        sf = cio.SharedFile("s1")
        try:
            for obj in (f, log, sf):
                blob = pickle.dumps(obj)
                assert b"mmap" not in blob and len(blob) < 2000
                assert pickle.loads(blob) is obj
        finally:
            sf.destroy()


def test_exclusive_file_copy_is_read_only_and_does_not_own_it(other, scratch_root, store):
    data = np.arange(100, dtype="u1").tobytes()
    f = cio.ExclusiveFile("eaf", "w+", backend=store)
    try:
        f.write(0, data)
        f.flush()
        got, mode, errors = other.submit(_read_copy, pickle.dumps(f), len(data),
                                          ("write", "delete")).result(60)
        assert got == data and mode == "r"
        assert [k for k, _ in errors] == ["ModeError", "ModeError"]
        assert "alone removes it" in errors[1][1]
        # still here, still ours, still writable
        f.write(100, b"more")
        assert f.read_bytes(0, 104) == data + b"more"
    finally:
        f.delete()


def test_a_copy_of_a_file_that_is_gone_says_so(other):
    f = cio.ExclusiveFile("gone", "w+")
    blob = pickle.dumps(f)
    f.delete()
    kind, msg = other.submit(_error_there, blob).result(60)
    assert kind == "StorageError" and "not there any more" in msg and "ENOENT" in msg
    with pytest.raises(StorageError, match="not there any more"):
        pickle.loads(blob)


def test_shared_file_copy_writes_but_never_destroys(other, store):
    if store == "mpiio":
        pytest.skip("mpiio copies are read-only (test below)")
    sf = cio.SharedFile("sf", hard_limit=4096, backend=store)
    try:
        sf.write(0, b"hello")
        head, limit, mode, ranks = other.submit(_sf_there, pickle.dumps(sf), 100, b"world",
                                                4090).result(60)
        assert head == b"hello" and limit == "LimitExceededError"
        assert mode == "r+" and ranks == 1
        assert sf.read_bytes(100, 5) == b"world"          # written there, seen here
        assert os.path.exists(sf.path) or store in ("shm", "auto")
        sf.write(200, b"still ours")
        assert sf.read_bytes(200, 10) == b"still ours"
    finally:
        sf.destroy()


def test_mpiio_shared_file_copy_is_read_only(other):
    import chemio_py.backends as backends
    if not backends.availability().get("mpiio", (False,))[0]:
        pytest.skip("mpiio is not usable here")
    sf = cio.SharedFile("sfm", backend="mpiio")
    try:
        sf.write(0, b"hello")
        sf.sync()
        f = pickle.loads(pickle.dumps(sf))
        assert f is sf
        got, mode, errors = other.submit(_read_copy, pickle.dumps(sf), 5).result(60)
        assert got == b"hello" and mode == "r" and errors[0][0] == "ModeError"
    finally:
        sf.destroy()


def test_record_file_copy_replays_the_last_commit(other):
    with cio.RecordFile("log", "w+") as log:
        log.append(np.arange(3, dtype=np.int32), np.array([0.5, 0.25]))
        log.flush()
        log.append(np.arange(2, dtype=np.int32), np.zeros(1))     # not committed yet
        recs, mode = other.submit(_records_there, pickle.dumps(log)).result(60)
        assert mode == "r" and recs == [([0, 1, 2], [0.5, 0.25])]
        log.flush()
        recs, _ = other.submit(_records_there, pickle.dumps(log)).result(60)
        assert len(recs) == 2
        log.delete()


def test_private_and_ram_files_are_refused_on_another_node():
    f = cio.ExclusiveFile("node", "w+")
    sf = cio.SharedFile("node", backend="shm")
    try:
        for obj, mod, what in ((f, exclusive, "is private to the process"),
                               (sf, shared, "lives in the memory of host 'elsewhere'")):
            state = dict(obj.__reduce__()[1][0])
            state["origin"] = dict(state["origin"], host="elsewhere", pid=1)
            with pytest.raises(NotSharedError, match=what):
                mod.reopen(state)
    finally:
        f.delete()
        sf.destroy()


def test_bad_state_is_refused():
    with pytest.raises(ArgumentError, match="not a pickled ExclusiveFile"):
        exclusive.reopen({"kind": "DiskArray"})
    with pytest.raises(ArgumentError, match="format"):
        shared.reopen({"kind": "SharedFile", "format": 0})
