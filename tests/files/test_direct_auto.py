"""``iter_blocks(direct="auto")``, the default: read-ahead picks O_DIRECT + Linux AIO for
cold, 4 KiB-aligned blocks of at least ``DIRECT_MIN_BLOCK`` bytes on a store that can
(``local``) on a file system that keeps data on a device, and the page cache otherwise
(hot data, small blocks, tmpfs, other backends); ``direct=True/False`` and
``CHEMIO_DIRECT`` force a path; the choice is in the pipeline's stats, in ``cio.report()``
and on the ``chemio_py`` logger; every path gives the NumPy model's data.

Cold means evicted for real: fsync, then ``posix_fadvise(POSIX_FADV_DONTNEED)`` of the data
file (``DiskArray.evict``; checked here with mincore).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import tempfile

import numpy as np
import pytest

import chemio_py as cio
from chemio_py import prefetch
from chemio_py.backends.local import LocalArrayStore, linux_aio
from chemio_py.errors import ArgumentError, ConfigError
from chemio_py.prefetch import DIRECT_MIN_BLOCK, direct_fs_verdict, iter_blocks
from chemio_py.runtime import config

from conftest import SHM_DIR

ROWS, COLS = 1536, 1024                 # 8 KiB rows of float64: 12 MiB
BIG = DIRECT_MIN_BLOCK // (8 * COLS)    # rows of a block at the threshold (256)

needs_aio = pytest.mark.skipif(linux_aio.engine() is None, reason="no Linux AIO here")


@pytest.fixture(scope="module")
def model() -> np.ndarray:
    return np.random.default_rng(28).random((ROWS, COLS))


def _array(model, name="auto", **kw):
    d = cio.DiskArray.create(name, model.shape, model.dtype, **kw)
    d[...] = model
    d.flush()
    return d


def _direct_ok(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def _resident(path: str) -> float:
    """Share of the file's pages in the page cache (mincore of a fresh mapping)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mm:
        vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        view = np.frombuffer(mm, np.uint8)             # read-only: its address only
        try:
            assert libc.mincore(view.ctypes.data, size, vec.ctypes.data) == 0
        finally:
            del view
    return float((vec & 1).mean())


def _evict(d) -> None:
    d.evict()                           # fsync + POSIX_FADV_DONTNEED of the data file
    assert _resident(d.path) < 0.05


@pytest.fixture
def native_calls(monkeypatch) -> list:
    """What local stores' native region read returned for each block offered to it (True:
    read through O_DIRECT); set before the array opens."""
    calls: list = []
    orig = LocalArrayStore.native_read_region

    def spy(self, *a, **k):
        r = orig(self, *a, **k)
        calls.append(r is not None)
        return r
    monkeypatch.setattr(LocalArrayStore, "native_read_region", spy)
    return calls


def _read(d, **kw) -> tuple[np.ndarray, str]:
    with iter_blocks(d, **kw) as pipe:
        parts = [(s, b.copy()) for s, b in pipe]
    return np.concatenate([b for _, b in parts], axis=kw.get("axis", 0)), pipe.stats.read_path


# ---------------------------------------------------------------- the default picks

@needs_aio
@pytest.mark.parametrize("direct", [None, "auto"])
def test_auto_reads_cold_aligned_big_blocks_direct(model, native_calls, direct, caplog):
    d = _array(model, backend="local", chunks=(BIG, COLS))
    try:
        if not _direct_ok(d.path):
            pytest.skip("no O_DIRECT on the scratch file system")
        assert config.get("direct") == "auto"           # the default setting
        _evict(d)
        with caplog.at_level(logging.DEBUG, logger="chemio_py"):
            got, path = _read(d, size=2 * BIG, direct=direct)
        np.testing.assert_array_equal(got, model)
        assert native_calls == [True] * 3               # 4 MiB blocks, every one direct
        assert path == "direct: auto \u2192 O_DIRECT (cold, 4.0 MiB aligned blocks)"
        logged = [r.getMessage() for r in caplog.records if r.name.startswith("chemio_py")
                  and r.levelno == logging.DEBUG and "iter_blocks" in r.getMessage()]
        assert logged and path in logged[-1]
    finally:
        d.delete()


@needs_aio
def test_auto_reads_hot_data_through_the_page_cache(model, native_calls):
    d = _array(model, backend="local", chunks=(BIG, COLS))
    try:
        _evict(d)
        np.testing.assert_array_equal(d[...], model)     # in the page cache now
        assert _resident(d.path) > 0.95
        got, path = _read(d, size=2 * BIG)
        np.testing.assert_array_equal(got, model)
        assert native_calls == [False] * 3              # offered, refused: cached
        assert path == "direct: auto \u2192 page cache (4.0 MiB blocks: cached)"
    finally:
        d.delete()


def test_auto_reads_small_blocks_through_the_page_cache(model, native_calls):
    d = _array(model, backend="local", chunks=(64, COLS))
    try:
        _evict(d)
        got, path = _read(d, size=BIG // 2)             # 1 MiB blocks, under the threshold
        np.testing.assert_array_equal(got, model)
        assert native_calls == []                       # never offered
        assert "page cache (1.0 MiB blocks, under the 2.0 MiB threshold" in path
    finally:
        d.delete()


def test_auto_on_tmpfs_reads_through_the_page_cache(model, native_calls):
    where = tempfile.mkdtemp(prefix="cio-auto-", dir=SHM_DIR)
    try:
        assert direct_fs_verdict(where).startswith("tmpfs")
        d = _array(model, backend="local", path=where, chunks=(BIG, COLS))
        try:
            d.evict()                                   # (tmpfs keeps its pages)
            got, path = _read(d, size=2 * BIG)
            np.testing.assert_array_equal(got, model)
            assert native_calls == []
            assert path == "direct: auto \u2192 page cache (tmpfs: the data is in RAM already)"
            # forced: offered to O_DIRECT even there (tmpfs takes it), same data
            got, path = _read(d, size=2 * BIG, direct=True)
            np.testing.assert_array_equal(got, model)
            assert len(native_calls) == 3 and path.startswith("direct: True \u2192 ")
        finally:
            d.delete()
    finally:
        shutil.rmtree(where)


def test_auto_on_a_backend_without_native_reads(model):
    d = _array(model, backend="shm", chunks=(BIG, COLS))
    try:
        d.evict()
        for direct in (None, True, False):
            got, path = _read(d, size=2 * BIG, direct=direct)
            np.testing.assert_array_equal(got, model)
        got, path = _read(d, size=2 * BIG)
        assert path == "direct: auto \u2192 page cache (backend 'shm' reads its own way)"
    finally:
        d.delete()


def test_file_system_verdicts(tmp_path):
    kind = cio.stat(str(tmp_path)).fstype
    if kind in ("tmpfs", "ramfs"):
        pytest.skip("the scratch root is in RAM")
    probe = tmp_path / "probe"
    probe.write_bytes(b"\0" * 4096)
    want = None if _direct_ok(str(probe)) else f"{kind} refuses O_DIRECT"
    got = direct_fs_verdict(str(probe))
    assert got == want or (want and got.startswith(want))
    assert direct_fs_verdict(str(tmp_path)) == got          # remembered per file system
    assert direct_fs_verdict(SHM_DIR) == "tmpfs: the data is in RAM already"
    assert direct_fs_verdict(str(tmp_path / "missing")).startswith("cannot stat")


# ---------------------------------------------------------------- forcing

@needs_aio
def test_forcing_by_argument(model, native_calls):
    d = _array(model, backend="local", chunks=(64, COLS))
    try:
        if not _direct_ok(d.path):
            pytest.skip("no O_DIRECT on the scratch file system")
        _evict(d)
        got, path = _read(d, size=64, direct=True)         # 512 KiB: auto would not
        np.testing.assert_array_equal(got, model)
        assert native_calls == [True] * (ROWS // 64)
        assert path == "direct: True \u2192 O_DIRECT (cold, 512.0 KiB aligned blocks)"
        native_calls.clear()
        _evict(d)
        got, path = _read(d, size=2 * BIG, direct=False)   # 4 MiB, cold: auto would
        np.testing.assert_array_equal(got, model)
        assert native_calls == [] and path == "direct: False \u2192 page cache (forced)"
    finally:
        d.delete()


@needs_aio
@pytest.mark.parametrize("how", ["env", "configure"])
@pytest.mark.parametrize("value,want", [("0", False), ("off", False), ("1", True),
                                        ("AUTO", "auto"), ("auto", "auto")])
def test_forcing_by_setting(model, native_calls, monkeypatch, how, value, want):
    if how == "env":
        monkeypatch.setenv("CHEMIO_DIRECT", value)
    else:
        cio.configure(direct=value)
    assert config.get("direct") == want
    d = _array(model, backend="local", chunks=(64, COLS))
    try:
        if not _direct_ok(d.path):
            pytest.skip("no O_DIRECT on the scratch file system")
        for size, big in ((64, False), (2 * BIG, True)):
            native_calls.clear()
            _evict(d)
            got, path = _read(d, size=size)
            np.testing.assert_array_equal(got, model)
            assert path.startswith(f"direct: {want} \u2192 ")
            direct = want is True or (want == "auto" and big)
            assert native_calls == ([True] * -(-ROWS // size) if direct else [])
        # an explicit argument beats the setting
        native_calls.clear()
        _evict(d)
        _read(d, size=2 * BIG, direct=want is not True)
        assert bool(native_calls) == (want is not True)
    finally:
        d.delete()


def test_setting_values_and_errors(monkeypatch):
    assert cio.settings()["direct"].value == "auto"
    assert cio.settings()["direct"].source == "default"
    for good, want in (("auto", "auto"), (" Auto ", "auto"), (True, True), (0, False),
                       ("yes", True), ("no", False)):
        cio.configure(direct=good)
        assert config.get("direct") == want
    for bad in ("maybe", "autos", 2, 1.0, ["auto"]):
        with pytest.raises(ConfigError) as ei:
            cio.configure(direct=bad)
        msg = str(ei.value)
        assert "'direct'" in msg and "auto" in msg and "true" in msg, msg
    assert config.get("direct") == False  # noqa: E712 - the last good value stands
    cio.configure(direct=None)
    monkeypatch.setenv("CHEMIO_DIRECT", "sometimes")
    with pytest.raises(ConfigError, match="CHEMIO_DIRECT.*auto"):
        config.get("direct")


def test_bad_direct_argument_changes_nothing(model):
    d = _array(model, backend="local")
    try:
        for bad in ("yes", 1, "AUTO", 0.0):
            with pytest.raises(ArgumentError, match="direct must be None.*'auto', True or False"):
                iter_blocks(d, direct=bad)
        assert d.outstanding == 0
        np.testing.assert_array_equal(d[...], model)
    finally:
        d.delete()


def test_byte_files_keep_their_buffered_path_under_auto(tmp_path):
    # the "auto" default concerns array read-ahead; byte files open O_DIRECT only when asked
    assert config.get("direct") == "auto"
    data = np.arange(4096.0)
    with cio.ExclusiveFile("auto-bytes", "w+", dir=str(tmp_path)) as f:
        f.write(0, data)
        assert f.store.pread_once() is not None         # no O_DIRECT descriptor
        np.testing.assert_array_equal(f.read(0, np.empty_like(data)), data)


# ---------------------------------------------------------------- visible, and right everywhere

@needs_aio
def test_report_shows_the_choice(model):
    d = _array(model, backend="local", chunks=(BIG, COLS))
    try:
        if not _direct_ok(d.path):
            pytest.skip("no O_DIRECT on the scratch file system")
        _evict(d)
        _read(d, size=2 * BIG, name="auto-cold")
        _read(d, size=BIG // 4, name="auto-small")
        text = cio.report(print_it=False)
        assert "read paths:" in text
        assert "auto-cold: direct: auto \u2192 O_DIRECT (cold, 4.0 MiB aligned blocks)" in text
        assert "auto-small: direct: auto \u2192 page cache (512.0 KiB blocks" in text
        rows = {p["pipeline"]: p for p in cio.stats.pipelines()}
        assert rows["auto-cold"]["read_path"].endswith("O_DIRECT (cold, 4.0 MiB aligned blocks)")
        assert text.html and "read paths:" in text.html
    finally:
        d.delete()


@pytest.mark.parametrize("direct", [None, "auto", True, False])
@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("shape,chunks,axis,size,out_dtype", [
    ((ROWS, COLS), (BIG, COLS), 0, 2 * BIG, None),          # aligned, big: direct when cold
    ((ROWS, COLS), (BIG, COLS), 0, BIG + 3, np.float32),    # runs cut at odd rows
    ((ROWS, COLS), (BIG, COLS), 0, 1000, None),             # a short last block
    ((1000, 1000), (512, 1000), 0, 600, None),              # 8000-byte rows: unaligned
    ((96, 4, 2048), (32, 2, 2048), 1, 2, None),             # along axis 1, many runs
    ((ROWS, COLS), (BIG, 512), 0, 2 * BIG, np.complex128),  # chunks split the rows
])
def test_every_mode_matches_numpy(direct, warm, shape, chunks, axis, size, out_dtype):
    model = np.random.default_rng(sum(shape) + size).random(shape)
    d = _array(model, backend="local", chunks=chunks)
    try:
        d.evict()
        if warm:
            d[...]
        kw = {"direct": direct, "axis": axis, "size": size, "depth": 2}
        if out_dtype is not None:
            kw["out_dtype"] = out_dtype
        got, path = _read(d, **kw)
        want = model if out_dtype is None else model.astype(out_dtype)
        np.testing.assert_array_equal(got, want)
        assert path.startswith("direct: ")
        assert d.outstanding == 0 and (linux_aio.engine() is None
                                       or linux_aio.engine().in_flight == 0)
    finally:
        d.delete()


def test_module_constant_is_documented():
    assert DIRECT_MIN_BLOCK >= 4096 and DIRECT_MIN_BLOCK % 4096 == 0
    assert "DIRECT_MIN_BLOCK" in (prefetch.iter_blocks.__doc__ or "")
