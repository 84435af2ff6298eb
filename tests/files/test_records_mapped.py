"""RecordFile replays of hot uncompressed pages through a read-only mapping (no copy):
the same records as the copying path, the checksum still checked, the mapping alive while
a view of it is, droppable, and a file truncated under a reader an error, not a SIGBUS."""
from __future__ import annotations

import os

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends.local import mappings
from chemio_py.errors import MetadataError, StorageError
from chemio_py.files import records

MiB = 1 << 20


def _recs(n: int = 40, seed: int = 0) -> list[tuple]:
    """Records of an id and 40 KiB of float64 (several per 1 MiB page, some spanning two)."""
    rng = np.random.default_rng(seed)
    return [(np.array([i], np.int64), rng.random(5000 + 37 * i)) for i in range(n)]


def _mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is a view of a replay mapping."""
    b: object = a
    while isinstance(b, np.ndarray) and b.base is not None:
        b = b.base
    return isinstance(b, records._Mapped)


def _write(name: str, store: str, recs: list, **kw) -> str:
    with cio.RecordFile(name, "w+", page_size=MiB, backend=store, **kw) as log:
        for r in recs:
            log.append(*r)
        return log.path


@pytest.mark.parametrize("store", ["local", "shm"])
def test_hot_pages_are_views_equal_to_the_copying_replay(store, monkeypatch):
    recs = _recs()
    _write("mapped", store, recs)
    with cio.RecordFile("mapped", "r", backend=store) as log:
        got = [(i.copy(), v.copy(), _mapped(v)) for i, v in log.replay()]
        assert log._map is not None and id(log._map) in mappings.live_maps
        assert sum(m for *_, m in got) >= len(recs) // 2     # records inside one page
        for (i, v, _), (ri, rv) in zip(got, recs, strict=True):
            assert i.tolist() == ri.tolist() and np.array_equal(v, rv)
        monkeypatch.setattr(records, "MAP_REPLAY", False)
        log._drop_map()
        plain = [(i.copy(), v.copy()) for i, v in log.replay()]
        assert not any(_mapped(v) for _, v in log.replay())
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(got, plain, strict=True))
    cio.RecordFile.remove("mapped", backend=store)


def test_a_view_outlives_the_file_and_the_mapping_is_dropped():
    recs = _recs(8)
    _write("keep", "local", recs)
    log = cio.RecordFile("keep", "r", backend="local")
    rep = log.replay()
    _, first = next(rep)
    assert _mapped(first) and not first.flags.writeable
    with pytest.raises(ValueError):
        first[0] = 1.0
    pm = log._map
    assert pm is not None
    mappings.drop_mappings()                       # memory wanted back: forgotten at once
    assert log._map is None and id(pm) not in mappings.live_maps
    rest = [v.copy() for _, v in rep]              # the running replay keeps its views
    assert np.array_equal(rest[-1], recs[-1][1])
    next(iter(log.replay()))                       # a new replay maps again
    assert log._map is not None
    log.close()                                    # closing drops it too
    assert log._map is None and not any(isinstance(m, records._PageMap)
                                        for m in mappings.live_maps.values())
    cio.RecordFile.remove("keep", backend="local")
    assert np.array_equal(first, recs[0][1])       # still mapped: the view keeps it


def test_append_after_a_replay_maps_the_grown_file_again():
    recs = _recs(30)
    more = _recs(10, seed=5)
    _write("grow", "local", recs)
    with cio.RecordFile("grow", "r+", backend="local") as log:
        assert len([1 for _ in log.replay()]) == 30
        old = log._map
        assert old is not None
        for r in more:
            log.append(*r)
        assert log._map is None and id(old) not in mappings.live_maps
        got = [v.copy() for _, v in log.replay()]
    want = [r[1] for r in recs + more]
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    cio.RecordFile.remove("grow", backend="local")


@pytest.mark.parametrize("checksum", ["crc32c", "crc32"])
def test_a_damaged_hot_page_fails_its_checksum_on_the_mapped_path(monkeypatch, checksum):
    path = _write("dmg", "local", _recs(), checksum=checksum)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x00\x01" * 32, 4096 + 3 * 4096)     # inside the first page: cached
    finally:
        os.close(fd)
    calls = []
    page = records._PageMap.page

    def spy(self, off, n):
        v = page(self, off, n)
        calls.append(v is not None)
        return v
    monkeypatch.setattr(records._PageMap, "page", spy)
    with cio.RecordFile("dmg", "r", backend="local") as log:
        with pytest.raises(MetadataError, match=f"page 0 of .* fails its {checksum} checksum"):
            for _ in log.replay():
                pass
    assert calls and calls[0]                      # page 0 was checked on the mapping
    cio.RecordFile.remove("dmg", backend="local")


def test_a_file_truncated_under_a_mapped_replay_raises_not_sigbus():
    recs = _recs(60)
    path = _write("cut", "local", recs)
    caught = cio.backends.posix.sigbus_caught()
    with cio.RecordFile("cut", "r", backend="local") as log:
        rep = log.replay(depth=1)
        _, held = next(rep)
        assert _mapped(held)
        os.truncate(path, 4096)                    # what another process could do
        assert not held.any()                      # zeros now, no SIGBUS
        with pytest.raises(StorageError, match="shrank under the replay"):
            for _ in rep:
                pass
    assert cio.backends.posix.sigbus_caught() > caught
    cio.RecordFile.remove("cut", backend="local")


def test_compressed_and_cold_pages_are_read_as_before(monkeypatch):
    recs = _recs(20)
    _write("zs", "local", recs, compressor="zstd")
    with cio.RecordFile("zs", "r", backend="local") as log:
        got = [(v.copy(), _mapped(v)) for _, v in log.replay()]
    assert all(np.array_equal(a, r[1]) for (a, _), r in zip(got, recs, strict=True))
    monkeypatch.setattr(cio.backends.posix, "resident", lambda *a: False)   # nothing cached
    _write("cold", "local", recs)
    with cio.RecordFile("cold", "r", backend="local") as log:
        got = [(v.copy(), _mapped(v)) for _, v in log.replay()]
    assert not any(m for _, m in got)
    assert all(np.array_equal(a, r[1]) for (a, _), r in zip(got, recs, strict=True))
    cio.RecordFile.remove("zs", backend="local")
    cio.RecordFile.remove("cold", backend="local")


def test_records_spanning_adjacent_mapped_pages_are_views_else_gathered(monkeypatch):
    """Records of 2.5 MiB over 1 MiB pages: views of the mapping where their pages lie side
    by side in it; where one of their pages had to be read (not cached), gathered."""
    rng = np.random.default_rng(9)
    recs = [(np.array([i], np.int64), rng.random(327_680 + 100 * i)) for i in range(5)]
    _write("span", "local", recs)
    with cio.RecordFile("span", "r", backend="local") as log:
        got = [(v.copy(), _mapped(v)) for _, v in log.replay()]
        assert all(m for _, m in got)
        resident = cio.backends.posix.resident
        cold_page = [4096 + 3 * MiB]                # the file offset of page 3

        def some_cold(addr, ranges, pages):
            first = ranges[0][0] * 4096
            return False if first == cold_page[0] else resident(addr, ranges, pages)
        monkeypatch.setattr(cio.backends.posix, "resident", some_cold)
        mixed = [(v.copy(), _mapped(v)) for _, v in log.replay()]
    for (a, _), (b, _m), r in zip(got, mixed, recs, strict=True):
        assert np.array_equal(a, r[1]) and np.array_equal(b, r[1])
    assert not all(m for _, m in mixed) and any(m for _, m in mixed)
    cio.RecordFile.remove("span", backend="local")
