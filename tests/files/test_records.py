"""RecordFile: append + replay against an in-memory model of the records, on every backend."""
from __future__ import annotations

import errno
import functools
import os
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime import pool
from chemio_py.errors import LimitExceededError, MetadataError, ModeError, StorageError

from conftest import process_threads, store_backends

MiB = 1 << 20
COMPRESSORS = [None, "zstd", "blosc"]


def _records(n: int, seed: int = 0) -> list[tuple]:
    """``n`` mixed records: (int32 index, float64 value) pairs of 0..39 elements, and every
    so often extra arrays of other dtypes and shapes (0-d, 2-d, bool, complex, strings)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, n)
    offs = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    idx = rng.integers(-2**31, 2**31 - 1, offs[-1], dtype=np.int64).astype(np.int32)
    val = rng.random(offs[-1])
    extra = [np.float32(rng.random()).reshape(()),
             (rng.random((3, 5)) + 1j * rng.random((3, 5))).astype(np.complex64),
             rng.random((2, 3, 4)) > 0.5,
             np.array([b"ab", b"cde"]),
             np.arange(6, dtype=">i8").reshape(2, 3),
             np.zeros((0, 4), np.uint16)]
    out = []
    for i in range(n):
        rec = (idx[offs[i]:offs[i + 1]], val[offs[i]:offs[i + 1]])
        if i % 97 == 0:
            rec = rec + (extra[(i // 97) % len(extra)],)
        if i % 1009 == 5:
            rec = ()
        out.append(rec)
    return out


@functools.lru_cache(maxsize=1)
def _model(n: int) -> tuple[list, list, bytes]:
    recs = _records(n, seed=1)
    return (recs,) + _flatten(recs)


def _flatten(records) -> tuple[list, bytes]:
    """(dtype, shape) of every array of every record, and all their bytes in order."""
    meta, chunks = [], []
    for rec in records:
        meta.append(tuple((a.dtype.str, a.shape) for a in rec))
        chunks.extend(a.tobytes() for a in rec)
    return meta, b"".join(chunks)


def _check_replay(replay, model_meta, model_bytes) -> None:
    meta, chunks = [], []
    for rec in replay:
        assert isinstance(rec, tuple)
        meta.append(tuple((a.dtype.str, a.shape) for a in rec))
        chunks.extend(a.tobytes() for a in rec)
    assert meta == model_meta
    assert b"".join(chunks) == model_bytes


def _size(name: str, store: str) -> int:
    """Size of this rank's file ``name`` as the backend sees it (auto may hold it in RAM)."""
    with cio.ExclusiveFile(name, "r", backend=store) as f:
        return f.size


def _other_threads() -> set[int]:
    return process_threads()


def _pool_idle() -> bool:
    """No task waits in the I/O pool's queue."""
    return pool.queued() == 0


# RecordFile compresses pages above its ExclusiveFile, so a store sees only bytes either way:
# uncompressed on every store and compressed on one prove what the full cross did
# (test_reopen_replay_and_append still runs every compressor on every store). 100k records
# compressed (its size bound needs them); the others take 25k, which still fill several
# pages and index blocks.
@pytest.mark.parametrize("store,compressor", [(s, None) for s in store_backends()]
                         + [(store_backends()[0], "zstd")])
def test_100k_mixed_records_round_trip_twice(store, compressor):
    recs, meta, data = _model(100_000 if compressor is not None else 25_000)
    with cio.RecordFile("scf.ints", "w+", compressor=compressor, page_size=MiB,
                        backend=store) as log:
        for r in recs:
            log.append(*r)
        assert len(log) == len(recs)
        assert log.pages > 3
        _check_replay(log.replay(depth=2), meta, data)
        _check_replay(log.replay(depth=0), meta, data)          # twice, same data
        nbytes = log.nbytes
    assert _size("scf.ints", store) == nbytes
    if compressor is not None:
        assert nbytes < len(data) + 16 * len(recs)         # indices/values compress somewhat


@pytest.mark.parametrize("compressor,depth", [(None, 0), ("zstd", 1), ("blosc", 2), (None, 8),
                                               ("blosc", 8)])
def test_record_larger_than_page(store, compressor, depth):
    rng = np.random.default_rng(2)
    big_random = rng.random(3 * MiB // 8 + 5)                 # ~3 MiB: spans 4 pages
    big_zeros = np.zeros((700, 1000), np.float64)              # ~5.3 MiB, compressible
    recs = [(np.arange(3),), (big_random, np.arange(7, dtype=np.int16)), (np.ones(2),),
            (big_zeros,), (np.arange(5.0),)]
    meta, data = _flatten(recs)
    with cio.RecordFile("big", "w+", compressor=compressor, page_size=MiB, depth=depth,
                        backend=store) as log:
        for r in recs:
            log.append(*r)
        _check_replay(log.replay(depth=depth), meta, data)
        _check_replay(log.replay(depth=depth), meta, data)


@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_reopen_replay_and_append(store, compressor):
    recs = _records(3000, seed=3) + [(np.random.default_rng(4).random(200_000),)]
    more = _records(500, seed=5)
    with cio.RecordFile("reopen", "w+", compressor=compressor, page_size=MiB,
                        backend=store) as log:
        for r in recs:
            log.append(*r)
    meta, data = _flatten(recs)
    with cio.RecordFile("reopen", "r", backend=store) as log:
        assert len(log) == len(recs) and log.compressor == compressor
        assert log.raw_nbytes == sum(cio.RecordFile.record_nbytes(*r) for r in recs)
        _check_replay(log.replay(), meta, data)
        with pytest.raises(ModeError):
            log.append(np.arange(3))
    with cio.RecordFile("reopen", "r+", backend=store) as log:     # continue the last page
        for r in more:
            log.append(*r)
    meta, data = _flatten(recs + more)
    with cio.RecordFile("reopen", "r", backend=store) as log:
        assert len(log) == len(recs) + len(more)
        _check_replay(log.replay(depth=3), meta, data)
        size = log.nbytes
    assert _size("reopen", store) == size
    cio.RecordFile.remove("reopen", backend=store)


@pytest.mark.parametrize("compressor", [None, "zstd"])
def test_crc32_file_reads_back_where_crc32c_is_available(store, compressor):
    """A file written where google-crc32c is missing (``checksum="crc32"``, what the
    default falls back to there) replays, takes appends in its own algorithm and pickles
    to a copy where the default is crc32c; the default is crc32c with the C wheel."""
    import pickle
    from chemio_py.files import recordformat
    assert recordformat.default_checksum() == "crc32c"     # google-crc32c is installed
    recs = _records(3000, seed=11) + [(np.random.default_rng(12).random(300_000),)]
    more = _records(400, seed=13)
    with cio.RecordFile("zlibcrc", "w+", compressor=compressor, page_size=MiB,
                        backend=store, checksum="crc32") as log:
        for r in recs:
            log.append(*r)
    with cio.RecordFile("zlibcrc", "r+", backend=store) as log:
        assert log.checksum == "crc32"
        for r in more:
            log.append(*r)
        with pytest.raises(cio.errors.ArgumentError, match="crc32, not crc32c"):
            cio.RecordFile("zlibcrc", "r", backend=store, checksum="crc32c")
    meta, data = _flatten(recs + more)
    with cio.RecordFile("zlibcrc", "r", backend=store) as log:
        assert log.checksum == "crc32"
        _check_replay(log.replay(depth=2), meta, data)
        copy = pickle.loads(pickle.dumps(log))
        _check_replay(copy.replay(), meta, data)
    with cio.RecordFile("fast", "w+", compressor=compressor, page_size=MiB,
                        backend=store) as log:
        assert log.checksum == "crc32c"
        for r in recs:
            log.append(*r)
        meta, data = _flatten(recs)
        _check_replay(log.replay(depth=2), meta, data)
    cio.RecordFile.remove("zlibcrc", backend=store)
    cio.RecordFile.remove("fast", backend=store)


def test_crc32c_implementations_agree(monkeypatch):
    """The ``crc32c`` wheel and google-crc32c give the same values (so files stay
    ``"crc32c"`` whichever wrote them), google-crc32c is the fallback when the wheel is
    missing (the wheel's GIL release is measured by benchmarks/bench_records.py)."""
    import sys
    import google_crc32c
    from chemio_py.files import recordformat
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 3 * MiB + 5, dtype=np.uint8)
    fast = recordformat._icrar_crc32c()
    assert fast is not None
    for n in (0, 1, 7, 4096, 32768 + 3, MiB, len(data)):
        want = int(google_crc32c.extend(0, data[:n].tobytes()))
        assert fast(data[:n]) == want == fast(memoryview(data[:n]).toreadonly())
    assert fast(data[::3]) == int(google_crc32c.extend(0, data[::3].tobytes()))
    monkeypatch.setitem(sys.modules, "crc32c", None)       # the wheel is not installed
    assert recordformat._icrar_crc32c() is None
    assert recordformat.default_checksum() == "crc32c"     # google-crc32c's C extension
    assert recordformat._crc32c_fn()(data) == fast(data)


def test_flush_then_append_more(store):
    recs = _records(4000, seed=6)
    with cio.RecordFile("inc", "w+", compressor="zstd", backend=store) as log:
        for i, r in enumerate(recs):
            log.append(*r)
            if i in (10, 1500, 1501):
                log.flush()
                meta, data = _flatten(recs[:i + 1])
                _check_replay(log.replay(), meta, data)
        meta, data = _flatten(recs)
        _check_replay(log.replay(), meta, data)


def test_empty_file_and_bad_input_changes_nothing(store):
    with cio.RecordFile("empty", "w+", backend=store) as log:
        assert list(log.replay()) == [] and len(log) == 0
    with cio.RecordFile("empty", "r", backend=store) as log:
        assert list(log.replay()) == []
    with cio.RecordFile("bad", "w+", backend=store, max_bytes=4096) as log:
        log.append(np.arange(10))
        before = (len(log), log.raw_nbytes)
        with pytest.raises(ValueError, match="dtype"):
            log.append(np.arange(3), np.array([object(), 1], dtype=object))
        with pytest.raises(LimitExceededError, match="max_bytes"):
            log.append(np.zeros(1000))
        assert (len(log), log.raw_nbytes) == before
        _check_replay(log.replay(), *_flatten([(np.arange(10),)]))
    for kw in ({"page_size": 4096}, {"page_size": MiB + 1}, {"compressor": "nope"},
               {"depth": -1}):
        with pytest.raises(ValueError):
            cio.RecordFile("bad", "w+", backend=store, **kw)
    with pytest.raises(ValueError, match="scratch name"):
        cio.RecordFile("../escape", "w+", backend=store)
    with pytest.raises(ModeError):
        cio.RecordFile("bad", "a", backend=store)


@pytest.mark.parametrize("damage", ["trailer", "index", "truncate", "page"])
def test_damaged_file_raises_metadata_error(store, damage):
    with cio.RecordFile("dmg", "w+", compressor="zstd" if damage == "page" else None,
                        backend=store) as log:
        for r in _records(2000, seed=7):
            log.append(*r)
        size = log.nbytes
    with cio.ExclusiveFile("dmg", "r+", backend=store) as f:
        if damage == "trailer":
            f.write(size - 32, b"NOTAREC!")
        elif damage == "index":
            f.write(size - 40, b"\xff")
        elif damage == "truncate":
            f.truncate(size - 7)
        else:
            f.write(4096 + 100, b"\x00" * 64)    # inside the first page (after the header)
    if damage == "page":
        with cio.RecordFile("dmg", "r", backend=store) as log, pytest.raises(MetadataError):
            for _ in log.replay():
                pass
    else:
        with pytest.raises(MetadataError):
            cio.RecordFile("dmg", "r", backend=store)
    cio.RecordFile.remove("dmg", backend=store)


@pytest.mark.parametrize("compressor", [None, "zstd"])
@pytest.mark.parametrize("how", ["break", "exception", "close"])
def test_replay_leaving_early_leaves_nothing(warm_store, compressor, how):
    store = warm_store
    recs = _records(20_000, seed=8)
    threads = _other_threads()
    fds = len(os.listdir("/proc/self/fd"))
    log = cio.RecordFile("early", "w+", compressor=compressor, page_size=MiB, backend=store)
    for r in recs:
        log.append(*r)
    rep = log.replay(depth=8)
    if how == "break":
        for i, _rec in enumerate(rep):
            if i == 10:
                break
    elif how == "exception":
        with pytest.raises(RuntimeError):
            for i, _rec in enumerate(rep):
                if i == 10:
                    raise RuntimeError("consumer failed")
    else:
        next(rep)
        assert rep.in_flight > 0
    rep.close()
    assert rep.in_flight == 0 and _pool_idle() and _other_threads() == threads
    log.append(np.arange(3))                        # no replay open any more
    log.delete()
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("compressor", [None, "zstd"])
def test_closing_the_file_ends_an_open_replay(store, compressor):
    threads = _other_threads()
    log = cio.RecordFile("openrep", "w+", compressor=compressor, page_size=MiB, backend=store)
    for r in _records(20_000, seed=10):
        log.append(*r)
    rep = log.replay(depth=4)
    next(rep)
    log.close()
    assert rep.in_flight == 0 and list(rep) == []
    assert _pool_idle() and _other_threads() == threads
    log.delete()


def test_append_during_open_replay_is_refused(store):
    with cio.RecordFile("busy", "w+", backend=store) as log:
        log.append(np.arange(4))
        rep = log.replay()
        with pytest.raises(cio.ChemIOError, match="replay"):
            log.append(np.arange(4))
        assert [r[0].tolist() for r in rep] == [[0, 1, 2, 3]]
        rep.close()
        log.append(np.arange(2))
        assert len(log) == 2


# EIO is injected into ``os`` as the local backend module sees it: ``local``, and ``auto``
# with its file on disk (outside the shm directory), write through that module; ``shm``
# copies through a mapping and has no pwrite to fail.
@pytest.mark.parametrize("backend", [b for b in ("local", "auto") if b in store_backends()])
def test_write_eio_surfaces_and_sticks(backend, monkeypatch, tmp_path):
    from chemio_py.backends.local import backend as local
    calls = []

    class EIO:
        def __getattr__(self, name):
            return getattr(os, name)

        def _fail_at(self, offset):
            calls.append(offset)
            if offset == 4096 + MiB:                # the second page (after the header)
                raise OSError(errno.EIO, os.strerror(errno.EIO))

        def pwrite(self, fd, data, offset, *a):
            self._fail_at(offset)
            return os.pwrite(fd, data, offset, *a)

        def pwritev(self, fd, bufs, offset, *a):
            self._fail_at(offset)
            return os.pwritev(fd, bufs, offset, *a)

    where = {"dir": str(tmp_path)} if backend == "auto" else {}
    monkeypatch.setattr(local, "os", EIO())          # before open: the fast path binds it
    log = cio.RecordFile("wfail", "w+", page_size=MiB, depth=2, backend=backend, **where)
    chunk = np.zeros(MiB // 8 // 4)                  # four records per page
    with pytest.raises(StorageError) as ei:
        for _ in range(64):
            log.append(chunk)
    assert ei.value.errno == errno.EIO and 4096 + MiB in calls
    with pytest.raises(StorageError):
        log.append(chunk)
    with pytest.raises(StorageError):
        log.flush()
    monkeypatch.undo()
    assert _pool_idle()
    log.delete()


def test_accounting_of_replay_and_writes(store):
    recs = _records(30_000, seed=9)
    with cio.RecordFile("acct", "w+", page_size=MiB, backend=store) as log:
        for r in recs:
            log.append(*r)
        log.flush()
        t0 = time.perf_counter()
        rep = log.replay()
        for _ in rep:
            pass
        wall = time.perf_counter() - t0
        st = rep.stats
        assert st.ops == log.pages and st.bytes == log.raw_nbytes
        # the first page is always waited for; no wait is longer than its read or the loop
        assert 0 < st.wait_seconds <= st.io_seconds and st.wait_seconds <= wall
        wst = log._wb.stats
        assert wst.ops >= log.pages - 1 and wst.bytes >= log.raw_nbytes
        assert "replay:acct" in cio.report(print_it=False)


def test_one_record_file_per_rank(mpirun):
    p = mpirun(2, """
        import numpy as np, chemio_py as cio
        rank = cio.comm().rank
        recs = [(np.arange(i % 50) + rank, np.full(i % 7, float(rank))) for i in range(5000)]
        with cio.RecordFile("perrank", "w+", compressor="zstd") as log:
            for r in recs:
                log.append(*r)
            assert log.path.endswith(f"perrank.{rank}")
            got = [(a.copy(), b.copy()) for a, b in log.replay()]
        assert len(got) == len(recs)
        assert all(np.array_equal(a, c) and np.array_equal(b, d)
                   for (a, b), (c, d) in zip(got, recs))
        print(f"ok{rank}ok", flush=True)
    """)
    assert "ok0ok" in p.stdout and "ok1ok" in p.stdout
