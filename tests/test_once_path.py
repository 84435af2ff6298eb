"""The one-syscall fast path of blocking byte-file calls (``OnceIO``): a short count is
completed through the store's full path, an error is retried and mapped there, and the
bytes land where a model says, for byte and non-byte buffers alike."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import chemio_py as cio
import chemio_py.backends.local as local
from chemio_py.errors import EndOfFileError, StorageError


class _Short:
    """``os`` with reads and writes that move at most ``cap`` bytes per call (as a signal
    or a file-system limit may), and an optional errno on the first call."""

    def __init__(self, cap: int, fail: int | None = None):
        self.cap, self.fail, self.calls = cap, fail, 0

    def __getattr__(self, name):
        return getattr(os, name)

    def _maybe_fail(self):
        self.calls += 1
        if self.fail is not None and self.calls == 1:
            raise OSError(self.fail, os.strerror(self.fail))

    def preadv(self, fd, bufs, offset, *a):
        self._maybe_fail()
        mv = memoryview(bufs[0]).cast("B")[: self.cap]
        return os.preadv(fd, [mv], offset, *a)

    def pwrite(self, fd, data, offset, *a):
        self._maybe_fail()
        return os.pwrite(fd, memoryview(data).cast("B")[: self.cap], offset, *a)


def test_short_counts_are_completed(monkeypatch):
    f = cio.ExclusiveFile("once", "w+")
    assert f._read_once is not None and f._write_once is not None
    model = np.arange(1000, dtype="f8")
    monkeypatch.setattr(local, "os", _Short(cap=1000))
    f.write(8, model)                              # a float buffer: bytes, not items
    out = np.zeros(1000)
    f.read(8, out)
    monkeypatch.undo()
    np.testing.assert_array_equal(out, model)
    assert f.size == 8 + 8000
    with pytest.raises(EndOfFileError):
        monkeypatch.setattr(local, "os", _Short(cap=1000))
        f.read(4000, np.zeros(1000))               # passes the end: short, then EOF
    monkeypatch.undo()
    f.delete()


@pytest.mark.parametrize("code", [errno.EINTR, errno.EIO])
def test_errors_are_retried_then_mapped(monkeypatch, code):
    f = cio.ExclusiveFile("once_err", "w+")
    f.write(0, np.ones(16))
    fake = _Short(cap=1 << 30, fail=code)
    monkeypatch.setattr(local, "os", fake)
    out = np.zeros(16)
    f.read(0, out)                                 # the full path read it again
    assert fake.calls == 2 and (out == 1).all()
    fake.calls = 0
    f.write(0, np.full(16, 2.0))
    assert fake.calls == 2
    monkeypatch.undo()
    np.testing.assert_array_equal(f.read(0, np.zeros(16)), 2.0)

    class _Broken(_Short):
        def _maybe_fail(self):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(local, "os", _Broken(cap=1 << 30))
    with pytest.raises(StorageError) as ei:
        f.read(0, np.zeros(16))
    assert ei.value.errno == errno.EIO
    monkeypatch.undo()
    f.delete()


def test_read_only_and_strided_buffers_take_the_checked_path():
    f = cio.ExclusiveFile("once_ro", "w+")
    f.write(0, np.ones(8))
    with pytest.raises((TypeError, cio.errors.ChemIOError)):
        f.read(0, bytes(64))                       # read-only: refused, as before
    out = np.zeros(16)[::2]                        # strided: refused, as before
    with pytest.raises((TypeError, ValueError, cio.errors.ChemIOError)):
        f.read(0, out)
    f.delete()
