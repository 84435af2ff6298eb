"""Running out of space is an expected event: a clear OutOfSpaceError, earlier data intact."""
import errno
import os

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends.local import backend as local


@pytest.fixture
def enospc_after(monkeypatch):
    """Fault injection at the syscall: os.pwrite fails with ENOSPC past a byte budget."""
    def install(budget):
        real = os.pwrite
        state = {"left": budget}

        def pwrite(fd, data, offset):
            n = memoryview(data).nbytes
            if n > state["left"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            state["left"] -= n
            return real(fd, data, offset)
        monkeypatch.setattr(local.os, "pwrite", pwrite)
    return install


def _fill_until_full(fh, rec):
    written = 0
    with pytest.raises(cio.OutOfSpaceError) as ei:
        for k in range(10_000):
            fh.write(k * rec.nbytes, rec + k)
            written += 1
    return written, ei.value


def test_enospc_becomes_out_of_space_error(small_fs, enospc_after, tmp_path):
    if small_fs is None:                   # cannot mount here: inject ENOSPC at the syscall
        enospc_after(300_000)
        where = str(tmp_path)
    else:
        where = small_fs
    rec = np.arange(8192, dtype=np.float64)      # 64 KiB records
    fh = cio.ExclusiveFile("fill", "w+", dir=where)
    written, err = _fill_until_full(fh, rec)
    assert written >= 1
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert err.filename == fh.path
    assert err.needed is not None and err.needed > 0
    assert err.free is not None and err.free < rec.nbytes
    assert "needs" in str(err) and "free" in str(err) and fh.path in str(err)
    out = np.empty(8192)
    for k in range(written):                      # what was written before stays readable
        fh.read(k * rec.nbytes, out)
        np.testing.assert_array_equal(out, rec + k)
    fh.delete()


def test_size_hint_beyond_free_space_fails_up_front(small_fs, tmp_path):
    where = small_fs or str(tmp_path)
    free = cio.stat(where).free
    with pytest.raises(cio.OutOfSpaceError) as ei:
        cio.ExclusiveFile("huge", "w+", dir=where, size_hint=free + (1 << 30))
    assert ei.value.needed == free + (1 << 30)
    assert not os.path.exists(os.path.join(where, f"huge.{cio.comm().rank}"))


def test_storage_error_carries_errno_path_offset(tmp_path, monkeypatch):
    real = os.preadv

    def broken(fd, buffers, offset, *a):
        if offset == 4096:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *a)
    monkeypatch.setattr(local.os, "preadv", broken)     # before open: the fast path binds it
    with cio.ExclusiveFile("eio", "w+") as fh:
        fh.write(0, bytes(8192))
        with pytest.raises(cio.errors.StorageError) as ei:
            fh.read(4096, bytearray(16))
        assert ei.value.errno == errno.EIO and ei.value.offset == 4096
        assert ei.value.size == 16 and ei.value.filename == fh.path
        req = fh.aread(4096, bytearray(16))     # the original error object at wait()
        with pytest.raises(cio.errors.StorageError):
            req.wait()
        monkeypatch.undo()
        fh.delete()


def test_out_of_space_error_is_catchable_as_oserror():
    e = cio.OutOfSpaceError("/x", 10, 5)
    assert isinstance(e, OSError) and isinstance(e, cio.ChemIOError)
    assert e.errno == errno.ENOSPC and e.filename == "/x"


def test_storage_error_without_errno_has_a_message():
    """An OSError raised without an errno (some libraries do) still becomes a readable
    StorageError instead of a TypeError while its message is built."""
    e = cio.errors.StorageError(None, "/scratch/x", 0, 8, "read")
    assert e.errno is None and "/scratch/x" in str(e) and "read" in str(e)
