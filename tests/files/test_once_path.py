"""The one-syscall fast path of blocking byte-file calls (``OnceIO``): a short count is
completed through the store's full path, an error is retried and mapped there, and the
bytes land where a model says, for byte and non-byte buffers alike."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends.local import backend as local
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

    def pwritev(self, fd, bufs, offset, *a):
        return self.pwrite(fd, bufs[0], offset, *a)


def _open_with(monkeypatch, name: str, fake: _Short):
    """An ExclusiveFile opened while ``fake`` stands in for ``os`` in the local backend (its
    one-call functions are bound at open), and a check that the fast path is on."""
    monkeypatch.setattr(local, "os", fake)
    f = cio.ExclusiveFile(name, "w+")
    assert f._read_once is not None and f._write_once is not None
    return f


def test_short_counts_are_completed(monkeypatch):
    fake = _Short(cap=1000)
    f = _open_with(monkeypatch, "once", fake)
    model = np.arange(1000, dtype="f8")
    f.write(8, model)                              # a float buffer: bytes, not items
    assert fake.calls == 8                         # 8000 bytes, 1000 a call
    out = np.zeros(1000)
    fake.calls = 0
    f.read(8, out)
    assert fake.calls == 8
    np.testing.assert_array_equal(out, model)
    assert f.size == 8 + 8000
    with pytest.raises(EndOfFileError):
        f.read(4000, np.zeros(1000))               # passes the end: short, then EOF
    monkeypatch.undo()
    f.delete()


@pytest.mark.parametrize("code", [errno.EINTR, errno.EIO])
def test_errors_are_retried_then_mapped(monkeypatch, code):
    fake = _Short(cap=1 << 30, fail=code)
    f = _open_with(monkeypatch, "once_err", fake)
    f.write(0, np.ones(16))                        # first call fails, the full path writes
    assert fake.calls == 2
    out = np.zeros(16)
    fake.calls = 0
    f.read(0, out)                                 # the full path read it again
    assert fake.calls == 2 and (out == 1).all()
    fake.calls = 0
    f.write(0, np.full(16, 2.0))
    assert fake.calls == 2
    fake.fail = None
    np.testing.assert_array_equal(f.read(0, np.zeros(16)), 2.0)

    def broken():
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    fake._maybe_fail = broken
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


def test_every_buffer_kind_lands_where_the_model_says(tmp_path):
    """The blocking calls take plain bytes/bytearray/ndarray by type alone; everything else
    (subclasses, memoryviews, F-order and strided arrays, read-only targets) goes through the
    checked path. Each write is compared with a bytearray model; nothing else may change."""
    model = bytearray(4096)
    mm = np.memmap(tmp_path / "mm", dtype="u1", mode="w+", shape=(64,))
    mm[:] = 5
    ro = np.full(32, 9, dtype="u1")
    ro.flags.writeable = False
    f2 = np.asfortranarray(np.arange(12, dtype="u2").reshape(3, 4))
    writes = [(0, b"abc"), (100, bytearray(b"xyz" * 10)), (200, np.arange(50, dtype="i4")),
              (500, f2), (700, np.arange(40, dtype="f8")[::3]), (1100, mm), (1200, ro),
              (1300, memoryview(b"memory")), (4000, np.zeros(0))]
    with cio.ExclusiveFile("kinds", "w+") as f:
        for off, data in writes:
            plain = isinstance(data, (bytes, memoryview))
            raw = bytes(data) if plain else np.ascontiguousarray(data).tobytes()
            assert f.write(off, data) == len(raw)
            model[off:off + len(raw)] = raw
        assert f.size == 1306
        del model[1306:]
        assert f.read_bytes(0, f.size) == bytes(model)
        for out in (bytearray(100), np.zeros(25, dtype="f4"), np.memmap(
                tmp_path / "mm2", dtype="u1", mode="w+", shape=(100,))):
            f.read(150, out)
            assert bytes(memoryview(out).cast("B")) == bytes(model[150:250])
        for bad in (ro, np.zeros((4, 4), order="F")[:, :3], np.zeros(8)[::2]):
            with pytest.raises((TypeError, ValueError, cio.errors.ChemIOError)):
                f.read(0, bad)
        assert f.read_bytes(0, f.size) == bytes(model)
        f.delete()
    del mm
