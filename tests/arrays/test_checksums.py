"""Per-chunk checksums of DiskArrays (``create(..., checksum=True)``, issue 27): round trips
on every backend that keeps them, partial writes (read back and recomputed), damage found
by reads and by ``chemio check --read``, old arrays, bad input, refusals, ``write_all``
under MPI with ranks sharing chunks, and no file left behind."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.arrays import meta as _meta
from chemio_py.arrays.checksums import crc_path
from chemio_py.backends import grid

SHAPE = (37, 23)
CHUNKS = (5, 7)              # edge chunks trimmed on both axes


def model(shape=SHAPE):
    i, j = np.indices(shape)
    return 1000.0 * i + j + 0.25


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _check(path, *args):
    return subprocess.run([sys.executable, "-m", "chemio_py.cli", "check", *args, str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("backend", ["local", "shm", "auto"])
def test_round_trip_partial_writes_and_no_leftovers(backend):
    d = cio.DiskArray.create("cks", SHAPE, "f8", chunks=CHUNKS, backend=backend,
                             checksum=True)
    data, meta, crc = d.path, d.meta_path, crc_path(d.path)
    try:
        assert d.checksum and os.path.getsize(crc) == 4 * 8 * 4
        assert _meta.load(meta).checksum == "crc32"
        assert np.array_equal(d[...], np.zeros(SHAPE))         # never written: zeros verify
        ref = np.zeros(SHAPE)
        m = model()
        d[...] = m
        ref[...] = m
        d[3:11, 2:19] = -1.0                                  # parts of many chunks
        ref[3:11, 2:19] = -1.0
        d.awrite(np.s_[5:10, 7:14], np.full((5, 7), 7.0)).wait()   # one whole chunk
        ref[5:10, 7:14] = 7.0
        d.write(np.s_[36, :], np.arange(23.0))                 # a row of the edge chunks
        ref[36, :] = np.arange(23.0)
        assert np.array_equal(d[...], ref)
        assert np.array_equal(d[4:33, 1:22], ref[4:33, 1:22])  # partial chunks: read whole
        assert np.array_equal(d.aread(np.s_[2:9, 3]).wait(), ref[2:9, 3])
        assert np.array_equal(d.read(np.s_[1:6, 2:9], transpose=True), ref[1:6, 2:9].T)
        assert np.array_equal(d.read_all(()), ref)
    finally:
        d.close()
    for p in (data, meta, crc):
        assert not os.path.lexists(p), p


def test_damage_found_by_read_and_by_check(tmp_path):
    d = cio.DiskArray.create("dmg", SHAPE, "f8", chunks=CHUNKS, path=tmp_path,
                             checksum=True)
    d[...] = model()
    lay = d._layout
    offset = lay.chunk_offset((2, 1)) + 17                     # chunk number 2*4+1 = 9
    d.close()
    ok = _check(d.path, "--read")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "all 32 chunks match" in ok.stdout
    _flip(d.path, offset)
    d = cio.DiskArray.open(d.path)
    try:
        assert np.array_equal(d[0:10, 0:7], model()[0:10, 0:7])     # other chunks fine
        for section in (np.s_[...], np.s_[12, 10], np.s_[10:15, 7:14]):
            with pytest.raises(cio.ChecksumError) as e:
                d[section]
            err = e.value
            assert err.chunk == (2, 1) and err.number == 9
            assert err.offset == lay.chunk_offset((2, 1)) and err.expected != err.found
            assert d.path in str(err) and "chunk [2, 1]" in str(err)
        with pytest.raises(cio.ChecksumError):
            d.aread(np.s_[11:13, 8:10]).wait()
    finally:
        d.close()
    bad = _check(d.path, "--read")
    assert bad.returncode == 1
    assert "checksum mismatch: chunk [2, 1] (number 9" in bad.stdout
    rep = json.loads(_check(d.path, "--read", "--json").stdout)
    assert rep["facts"]["checksum_mismatches"] == 1 and rep["facts"]["chunks_verified"] == 32
    assert _check(d.path).returncode == 0                      # metadata checks only
    d = cio.DiskArray.open(d.path, "r+")                        # rewriting heals it
    d[10:15, 7:14] = model()[10:15, 7:14]
    assert np.array_equal(d[...], model())
    d.delete()
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("backend", ["local", "shm"])
def test_checks_on_the_pool_match_a_serial_pass(tmp_path, monkeypatch, backend):
    """Sections of many chunks are checked (and written) by pool threads, part by part:
    the same data comes back, and of two damaged chunks the one first in the file is
    reported, as a serial pass would (also from a pool thread: ``aread``)."""
    from chemio_py.arrays import checksums
    monkeypatch.setattr(checksums, "_cpus", lambda: 4)      # several parts on any machine
    shape, chunks = (700, 600), (100, 150)                  # 120 kB chunks, 3.4 MB in all
    d = cio.DiskArray.create("pool", shape, "f8", chunks=chunks, backend=backend,
                             path=tmp_path, checksum=True)
    try:
        m = model(shape)
        d[...] = m
        d[50:650, 70:530] = -m[50:650, 70:530]              # parts of the edge chunks
        m[50:650, 70:530] *= -1
        assert np.array_equal(d[...], m)
        assert np.array_equal(d[30:690, 20:580], m[30:690, 20:580])
        assert np.array_equal(d.aread(np.s_[30:690, 20:580]).wait(), m[30:690, 20:580])
        lay = grid.Layout(shape, chunks, 8)
        for index in ((5, 1), (1, 3)):                      # numbers 21 and 7
            _flip(d.path, lay.chunk_offset(index) + 811)
        for read in (lambda: d[...], lambda: d[30:690, 20:580],
                     lambda: d.aread(np.s_[...]).wait()):
            with pytest.raises(cio.ChecksumError) as e:
                read()
            assert e.value.chunk == (1, 3) and e.value.number == 7
            assert e.value.offset == lay.chunk_offset((1, 3))
    finally:
        d.close()


def test_lost_checksum_file(tmp_path):
    d = cio.DiskArray.create("lost", (4, 4), "i4", path=tmp_path, checksum=True)
    d.close()
    os.unlink(crc_path(d.path))
    with pytest.raises(cio.MetadataError, match="checksum file .* is missing"):
        cio.DiskArray.open(d.path)
    r = _check(d.path)
    assert r.returncode == 1 and "is missing" in r.stdout
    os.unlink(d.path)
    os.unlink(d.meta_path)


def test_old_array_without_checksums(tmp_path):
    d = cio.DiskArray.create("old", SHAPE, "f8", chunks=CHUNKS, path=tmp_path)
    d[...] = model()
    d.close()
    doc = json.loads(open(d.meta_path).read())
    assert doc["format"] == 1 and "checksum" not in doc          # what chemio always wrote
    assert not os.path.lexists(crc_path(d.path))
    d = cio.DiskArray.open(d.path, "r+")
    assert not d.checksum
    assert np.array_equal(d[...], model())
    d.close()
    r = _check(d.path, "--read")
    assert r.returncode == 0 and "has no checksums" in r.stdout


def test_overwrite_replaces_and_removes_the_sidecar(tmp_path):
    d = cio.DiskArray.create("ow", (8, 8), "f4", path=tmp_path, checksum=True)
    d[...] = 1.0
    d.close()
    d = cio.DiskArray.create("ow", (8, 8), "f4", path=tmp_path, overwrite=True)
    assert not os.path.lexists(crc_path(d.path)) and not d.checksum
    d.close()
    d = cio.DiskArray.create("ow", (8, 8), "f4", path=tmp_path, overwrite=True,
                             checksum=True)
    assert np.array_equal(d[...], np.zeros((8, 8)))            # a fresh sidecar
    d.delete()
    assert os.listdir(tmp_path) == []


def test_metadata_validation():
    good = {"format": 2, "checksum": "crc32", "shape": [4], "dtype": "<f8", "chunks": [4],
            "name": "a", "data": "a.dra", "backend": "local", "byte_order": "little"}
    assert _meta.validate(good).checksum == "crc32"
    with pytest.raises(cio.MetadataError, match="checksum"):
        _meta.validate(dict(good, checksum="md5"))
    with pytest.raises(cio.MetadataError, match="checksum"):
        _meta.validate(dict(good, format=1))
    with pytest.raises(cio.MetadataError, match="checksum"):
        _meta.validate(dict(good, format=3))          # resizable arrays have no checksums
    with pytest.raises(cio.MetadataError, match="newer chemio_py"):
        _meta.validate(dict(good, format=max(_meta.FORMATS) + 1))


@pytest.mark.parametrize("bad", ["yes", 1, None, np.bool_(True)])
def test_bad_checksum_argument(bad):
    with pytest.raises(cio.errors.ArgumentError, match="checksum must be True"):
        cio.DiskArray.create("bad", (4,), "f8", checksum=bad)


@pytest.mark.parametrize("backend", ["zarr", "mpiio"])
def test_backends_without_checksums_refuse(backend):
    from chemio_py import backends
    try:
        backends.resolve(backend).check_available()
    except cio.ChemIOError:
        pytest.skip(f"backend {backend} unavailable here")
    with pytest.raises(cio.errors.ArgumentError, match="backend='local'"):
        cio.DiskArray.create("refused", (4, 4), "f8", backend=backend, checksum=True)


def test_checksummed_array_refuses_mpiio_open(tmp_path):
    from chemio_py import backends
    try:
        backends.resolve("mpiio").check_available()
    except cio.ChemIOError:
        pytest.skip("backend mpiio unavailable here")
    d = cio.DiskArray.create("viaio", (4, 4), "f8", path=tmp_path, checksum=True)
    d.close()
    with pytest.raises(cio.errors.ArgumentError, match="which has checksums"):
        cio.DiskArray.open(d.path, backend="mpiio")
    d.delete()


MPI_BODY = """
import numpy as np, chemio_py as cio
c = cio.comm()
d = cio.DiskArray.create("shared", {shape}, "f8", chunks={chunks}, path={path!r},
                         checksum=True)
sec = cio.block_section(d.shape, axis={axis})           # cuts through chunks
i, j = np.indices(d.shape)
m = 1000.0 * i + j + 0.25
d.write_all(sec, m[sec])
assert np.array_equal(d.read_all(()), m)
# independent writes, at the same time, of disjoint parts (row = rank) of the same chunk
for it in range(30):
    d.write((slice(c.rank, c.rank + 1), slice(7, 14)), np.full((1, 7), 100.0 * c.rank + it))
c.barrier()
for r in range(c.size):
    m[r, 7:14] = 100.0 * r + 29
assert np.array_equal(d[...], m)
d.close()
print(f"rank{{c.rank}}:ok", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n,axis", [(3, 0), (2, 1)])
def test_write_all_with_shared_chunks(mpirun, tmp_path, n, axis):
    path = str(tmp_path / "shared.dra")
    p = mpirun(n, MPI_BODY.format(shape=SHAPE, chunks=CHUNKS, path=path, axis=axis))
    assert p.stdout.count(":ok") == n, p.stdout + p.stderr
    r = _check(path, "--read")
    assert r.returncode == 0 and "all 32 chunks match" in r.stdout, r.stdout
    d = cio.DiskArray.open(path)
    m = model()
    for r in range(n):
        m[r, 7:14] = 100.0 * r + 29
    assert np.array_equal(d[...], m)
    d.delete()
