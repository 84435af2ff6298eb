"""The ``zarr`` backend against writers it cannot see, swapped links, hostile objects and
damaged metadata (issue 27: items 4, 5, the zarr part of 6, the zarr minor items).

Real processes (spawned, and a dask ``LocalCluster``), real files and real hostile
objects; nothing of the store is mocked. Each test failed on the code before the fix.
"""
from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import shutil
import struct
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.tools import check as _check
from chemio_py.errors import ArgumentError, ChemIOError, MetadataError, StorageError

zarr = pytest.importorskip("zarr")
numcodecs = pytest.importorskip("numcodecs")

ADVICE = ("overwrite", "remove it", "recreate")     # advice that destroys data


def _be():
    return backends.resolve("zarr")


def _model(shape):
    return np.arange(1, int(np.prod(shape)) + 1, dtype="i8").reshape(shape)


# ---------------------------------------------------------------- writers it cannot see

SHAPE, CHUNKS = (130, 120), (16, 24)
ARRAYS = {"plain": {"compressor": "zstd", "inner_chunks": False},
          "sharded": {"compressor": "zstd", "inner_chunks": (8, 12)}}


def _interleaved_pieces(shape):
    """Unaligned pieces (3 rows, the columns cut at 50) dealt round robin."""
    return [(slice(r, min(r + 3, shape[0])), slice(0, 50) if c == 0 else slice(50, shape[1]))
            for r in range(0, shape[0], 3) for c in (0, 1)]


def _independent_writer(paths, k, nproc, start):
    """One spawned process: opens every array ``r+`` (no MPI) and writes its pieces."""
    import chemio_py as cio
    handles = [cio.DiskArray.open(p, "r+") for p in paths]
    model = _model(SHAPE)
    start.wait()
    for j, sec in enumerate(_interleaved_pieces(SHAPE)):
        if j % nproc == k:
            for d in handles:
                d[sec] = model[sec]
    for d in handles:
        d.close()


def test_independent_processes_writing_parts_of_shared_objects_lose_nothing(tmp_path):
    """4 processes without MPI write interleaved unaligned pieces that share storage
    objects (the default lock=None takes the per-object lock for such writes): every
    element arrives. Before the fix 500-1600 of 15,600 were lost per run."""
    paths = []
    for name, opts in ARRAYS.items():
        d = cio.DiskArray.create(name, SHAPE, "i8", chunks=CHUNKS, backend="zarr",
                                 path=tmp_path, **opts)
        paths.append(d.path)
        d.close()
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(4)
    procs = [ctx.Process(target=_independent_writer, args=(paths, k, 4, start))
             for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    model = _model(SHAPE)
    for p in paths:
        got = zarr.open_array(p, mode="r")[:]          # a reader without chemio
        assert int((got != model).sum()) == 0, f"{p}: elements lost"


class _BlockWriter:
    """A ``dask.array.store`` target that dask pickles to its workers: each block is an
    independent write through its own ``DiskArray.open(path, "r+")``."""

    def __init__(self, path):
        self.path = path

    def __setitem__(self, key, value):
        import chemio_py as cio
        d = cio.DiskArray.open(self.path, "r+", backend="zarr")
        try:
            d[key] = value
        finally:
            d.close()


def test_dask_workers_writing_unaligned_blocks_lose_nothing(tmp_path):
    """A ``distributed.LocalCluster`` of 2 worker processes stores a dask array whose
    blocks (26 x 34) cut the storage objects (16 x 24) of a zarr DiskArray."""
    distributed = pytest.importorskip("distributed")
    da = pytest.importorskip("dask.array")
    model = _model((130, 120))
    d = cio.DiskArray.create("dk", model.shape, "i8", chunks=(16, 24), backend="zarr",
                             path=tmp_path, compressor="zstd", inner_chunks=(8, 12))
    path = d.path
    d.close()
    x = da.from_array(model, chunks=(26, 34))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster):
        da.store(x, _BlockWriter(path), lock=False)
    with cio.DiskArray.open(path) as e:
        got = e[:, :]
    assert int((got != model).sum()) == 0


def _hold(path, byte):
    """Hold the object lock of ``byte`` the way another process would (an OFD lock on
    zarr.json); returns the descriptor (closing it releases the lock)."""
    fd = os.open(os.path.join(path, "zarr.json"), os.O_RDWR)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", fcntl.F_WRLCK, 0, byte, 1, 0))
    return fd


def _finishes(fn, seconds):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), t


@pytest.mark.skipif(not hasattr(fcntl, "F_OFD_SETLK"), reason="needs OFD locks (Linux)")
def test_partial_writes_wait_for_the_object_lock_whole_objects_do_not(tmp_path):
    st = _be().open_array(str(tmp_path / "l.zarr"), "w+", shape=(32, 32),
                          dtype=np.dtype("i8"), chunks=(16, 16), compressor="zstd")
    try:
        fd = _hold(st.path, 1)                 # object (0, 1), C order
        whole, _ = _finishes(lambda: st.write((slice(0, 16), slice(16, 32)),
                                              np.ones((16, 16), "i8")), 5)
        assert whole, "a whole-object write waited for a lock"
        part, t = _finishes(lambda: st.write((slice(0, 3), slice(16, 20)),
                                             np.full((3, 4), 7, "i8")), 0.5)
        assert not part, "a partial write did not wait for the object lock"
        os.close(fd)
        t.join(10)
        assert not t.is_alive()
        got = np.empty((16, 16), "i8")
        st.read((slice(0, 16), slice(16, 32)), got)
        assert (got[:3, :4] == 7).all() and got.sum() == 256 - 12 + 7 * 12
    finally:
        st.close()
    # lock=False: the caller promises one writer per object, nothing waits
    st = _be().open_array(str(tmp_path / "l.zarr"), "r+", shape=(32, 32),
                          dtype=np.dtype("i8"), chunks=(16, 16), lock=False)
    try:
        fd = _hold(st.path, 1)
        done, _ = _finishes(lambda: st.write((slice(0, 3), slice(16, 20)),
                                             np.zeros((3, 4), "i8")), 5)
        os.close(fd)
        assert done
    finally:
        st.close()
    with pytest.raises(ArgumentError, match="lock"):
        _be().open_array(str(tmp_path / "l.zarr"), "r+", shape=(32, 32),
                         dtype=np.dtype("i8"), chunks=(16, 16), lock="yes")
    assert sorted(os.listdir(tmp_path / "l.zarr")) == ["c", "zarr.json"]   # nothing added


@pytest.mark.skipif(not hasattr(fcntl, "F_OFD_SETLK"), reason="needs OFD locks (Linux)")
def test_a_stuck_lock_holder_ends_in_a_clear_error_not_a_hang(tmp_path, monkeypatch):
    """A holder that never lets go (a stopped process) held partial writers for ever; now
    they wait ``LOCK_WAIT`` at most, fail clearly, write nothing, and the store still works."""
    from chemio_py.backends.zarr import backend as zb
    monkeypatch.setattr(zb, "LOCK_WAIT", 0.3)
    st = _be().open_array(str(tmp_path / "s.zarr"), "w+", shape=(32, 32),
                          dtype=np.dtype("i8"), chunks=(16, 16), compressor="zstd")
    try:
        st.write((slice(0, 16), slice(16, 32)), np.ones((16, 16), "i8"))
        fd = _hold(st.path, 1)                 # object (0, 1), C order
        try:
            with pytest.raises(StorageError, match="held the lock of object") as ei:
                st.write((slice(0, 3), slice(16, 20)), np.full((3, 4), 7, "i8"))
            assert "not written" in str(ei.value)
        finally:
            os.close(fd)
        got = np.empty((16, 16), "i8")
        st.read((slice(0, 16), slice(16, 32)), got)
        assert (got == 1).all()                                  # nothing changed
        st.write((slice(0, 3), slice(16, 20)), np.full((3, 4), 7, "i8"))   # free again
        st.read((slice(0, 16), slice(16, 32)), got)
        assert (got[:3, :4] == 7).all() and got.sum() == 256 - 12 + 7 * 12
    finally:
        st.close()


# ---------------------------------------------------------------- links swapped after use

@pytest.mark.parametrize("how", ["renamed away", "removed"])
def test_key_directory_swapped_for_a_link_after_first_use(tmp_path, how):
    """``c/1`` becomes a link to an outside directory after the handle used it: the same
    handle neither writes nor reads outside (before the fix it did both)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    p = str(tmp_path / "a.zarr")
    st = _be().open_array(p, "w+", shape=(32, 30), dtype=np.dtype("f8"), chunks=(16, 10),
                          compressor="none", inner_chunks=False)
    try:
        model = np.arange(32 * 30, dtype="f8").reshape(32, 30) + 1
        st.write((slice(0, 32), slice(0, 30)), model)           # c/0/*, c/1/* used
        got = np.empty((32, 30))
        st.read((slice(0, 32), slice(0, 30)), got)
        assert (got == model).all()
        key_dir = os.path.join(p, "c", "1")
        if how == "renamed away":
            os.rename(key_dir, tmp_path / "moved")
        else:
            shutil.rmtree(key_dir)
        os.symlink(outside, key_dir)
        try:
            st.write((slice(16, 32), slice(0, 30)), model[16:] * 2)   # whole objects
            st.write((slice(20, 22), slice(3, 7)), np.full((2, 4), -1.0))   # a part
        except MetadataError as e:
            assert "symbolic link" in str(e)
        out = np.empty((16, 30))
        try:
            st.read((slice(16, 32), slice(0, 30)), out)
        except (MetadataError, StorageError) as e:
            assert "symbolic link" in str(e) or "removed" in str(e)
        else:
            want = model[16:] * 2
            want[4:6, 3:7] = -1.0
            assert (out == want).all()            # the directory it holds: the array's data
        assert os.listdir(outside) == [], "an object was written outside the array"
    finally:
        st.close()
    # a new handle refuses the link
    st = _be().open_array(p, "r", shape=(32, 30), dtype=np.dtype("f8"), chunks=(16, 10))
    with pytest.raises(MetadataError, match="symbolic link"):
        st.read((slice(16, 32), slice(0, 30)), np.empty((16, 30)))
    st.close()
    assert os.listdir(outside) == []


def test_reader_of_a_recreated_array_is_told_not_given_zeros(tmp_path):
    p = str(tmp_path / "r.zarr")
    kw = dict(shape=(16, 16), dtype=np.dtype("f8"), chunks=(8, 8))
    w = _be().open_array(p, "w+", **kw)
    w.write((slice(0, 16), slice(0, 16)), np.ones((16, 16)))
    w.close()
    old = _be().open_array(p, "r", **kw)
    try:
        first = np.empty((8, 8))
        old.read((slice(0, 8), slice(0, 8)), first)
        assert (first == 1).all()
        _be().open_array(p, "w+", **kw).close()       # another handle re-creates it
        with pytest.raises(StorageError, match="re-created"):
            old.read((slice(8, 16), slice(8, 16)), np.empty((8, 8)))
    finally:
        old.close()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".r.zarr")]


# ---------------------------------------------------------------- decompression bombs

def _zstd_without_size(data: bytes) -> bytes:
    """A valid zstd frame of ``data`` whose header states no content size (as streaming
    compressors write them)."""
    frame = bytes(numcodecs.Zstd(level=1).encode(np.frombuffer(data, np.uint8)))
    fhd = frame[4]
    single, fcs_flag, dict_flag = (fhd >> 5) & 1, fhd >> 6, fhd & 3
    head = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag] + \
        (1 if single else 0, 2, 4, 8)[fcs_flag]
    log = max(10, (len(data) - 1).bit_length())
    out = frame[:4] + bytes([fhd & 0x07, (log - 10) << 3]) + frame[head:]
    assert len(numcodecs.Zstd().decode(out)) == len(data)
    return out


def _zstd_rle_frame(blocks: int) -> bytes:
    """A zstd frame without content size of ``blocks`` RLE blocks of 128 KiB of zeros."""
    out = bytearray(b"\x28\xb5\x2f\xfd\x00\x38")
    for i in range(blocks):
        out += (int(i == blocks - 1) | (1 << 1) | ((1 << 17) << 3)).to_bytes(3, "little")
        out += b"\0"
    return bytes(out)


def _gzip_of_zeros(nbytes: int) -> bytes:
    """A valid gzip member of ``nbytes`` zeros, built from one repeated deflate block."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    zero = bytes(1 << 20)
    for _ in range(nbytes >> 20):
        crc = zlib.crc32(zero, crc)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + block * (nbytes >> 20) + b"\x03\x00"
            + struct.pack("<II", crc, nbytes & 0xFFFFFFFF))


def _put_inner(path, raw_chunk, n_inner):
    """Write a shard ``c/0/0`` holding ``raw_chunk`` as its only inner chunk."""
    from chemio_py.backends.zarr.format import crc32c
    index = np.full((n_inner, 2), (1 << 64) - 1, "<u8")
    index[0] = (0, len(raw_chunk))
    body = index.tobytes()
    with open(os.path.join(path, "c", "0", "0"), "wb") as f:
        f.write(raw_chunk + body + struct.pack("<I", crc32c(body)))


def _hostile_arrays(root):
    """{name: (path, shape, chunks, object)} of real arrays holding a hostile object."""
    made = {}

    def chemio_array(name, shape, chunks, **kw):
        p = os.path.join(root, name + ".zarr")
        st = _be().open_array(p, "w+", shape=shape, dtype=np.dtype("f8"), chunks=chunks, **kw)
        st.write(tuple(slice(0, n) for n in shape), np.ones(shape))
        st.close()
        return p
    # 64 KiB objects, zstd: a frame without content size that inflates past 8 MiB
    p = chemio_array("zstd_nosize", (64, 128), (64, 128), compressor="zstd", inner_chunks=False)
    with open(os.path.join(p, "c", "0", "0"), "wb") as f:
        f.write(_zstd_without_size(bytes(8 << 20)))
    made["zstd frame without size"] = p
    # ... 300 RLE blocks (37.5 MiB) stated by its blocks only
    p = chemio_array("zstd_rle", (64, 128), (64, 128), compressor="zstd", inner_chunks=False)
    with open(os.path.join(p, "c", "0", "0"), "wb") as f:
        f.write(_zstd_rle_frame(300))
    made["zstd RLE blocks"] = p
    # an 8 KiB chunk stored as a 32 KB frame of 1 GiB (the case)
    p = chemio_array("zstd_8k", (32, 32), (32, 32), compressor="zstd", inner_chunks=False)
    with open(os.path.join(p, "c", "0", "0"), "wb") as f:
        f.write(_zstd_rle_frame(8000))
    made["8 KiB chunk, 32 KB frame"] = p
    # a shard whose 64 KiB inner chunk is a frame without size of 8 MiB
    p = chemio_array("shard_zstd", (128, 128), (128, 128), compressor="zstd",
                     inner_chunks=(64, 128))
    _put_inner(p, _zstd_without_size(bytes(8 << 20)), 2)
    made["shard inner zstd"] = p
    # blosc: a header that claims 1 GiB
    p = chemio_array("blosc_claim", (64, 128), (64, 128), compressor="blosc",
                     inner_chunks=False)
    f = os.path.join(p, "c", "0", "0")
    raw = bytearray(open(f, "rb").read())
    raw[4:8] = struct.pack("<I", 1 << 30)
    open(f, "wb").write(raw)
    made["blosc header claims 1 GiB"] = p
    # gzip (an array zarr-python made): a 0.5 MB member inflating to 512 MiB, 1 MiB chunks
    p = os.path.join(root, "gzip.zarr")
    z = zarr.create_array(p, shape=(128, 1024), chunks=(128, 1024), dtype="f8",
                          compressors=zarr.codecs.GzipCodec(level=5), fill_value=0)
    z[:] = 1.0
    with open(os.path.join(p, "c", "0", "0"), "wb") as f:
        f.write(_gzip_of_zeros(512 << 20))
    made["gzip 0.5 MB to 512 MiB"] = p
    return made


_READ_BOMBS = """
import json, resource, sys, threading
import numpy as np
import chemio_py as cio
results = {}
for name, path in json.loads(sys.argv[1]).items():
    errors = []
    def read():
        try:
            with cio.DiskArray.open(path) as d:
                d[...]
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=read) for _ in range(4)]   # 4 reader threads
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results[name] = errors
# this process's own high-water mark (ru_maxrss may carry the parent's across exec)
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")]
results["peak_rss_mib"] = int(hwm[0].split()[1]) / 1024 if hwm else \
    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(results))
"""


def test_decompression_bombs_are_refused_before_they_inflate(tmp_path):
    """Hostile objects in real arrays, each read by 4 threads of a fresh process: a clear
    ``MetadataError`` naming the object, and the process stays under 200 MiB (before the
    fix: 1-2 GB per reader thread)."""
    made = _hostile_arrays(str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _READ_BOMBS, json.dumps(made)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout)
    peak = results.pop("peak_rss_mib")
    for name, errors in results.items():
        obj = os.path.join(made[name], "c", "0", "0")
        assert len(errors) == 4 and all(e is not None for e in errors), (name, errors)
        for e in errors:
            assert e.startswith("MetadataError") and obj in e, (name, e)
    assert peak < 200, f"peak RSS {peak:.0f} MiB reading hostile objects"


def test_every_codec_still_reads_what_it_wrote(tmp_path):
    """The bounded decoders read every legitimate object: chemio's own codecs, and
    zarr-python's gzip, crc32c, zstd with checksum and blosc chains."""
    rng = np.random.default_rng(5)
    model = rng.standard_normal((70, 50))
    model[:30] = 0.5                                    # compressible and not
    for comp in ("zstd", "zstd:19", "blosc", "blosc:lz4:5:bitshuffle", "none"):
        for inner in (False, (7, 25)):
            p = str(tmp_path / f"{comp.replace(':', '_')}_{bool(inner)}.zarr")
            st = _be().open_array(p, "w+", shape=model.shape, dtype=np.dtype("f8"),
                                  chunks=(35, 50), compressor=comp, inner_chunks=inner)
            st.write((slice(0, 70), slice(0, 50)), model)
            got = np.empty_like(model)
            st.read((slice(0, 70), slice(0, 50)), got)
            st.close()
            assert (got == model).all(), (comp, inner)
    codecs = [[zarr.codecs.GzipCodec(level=1)],
              [zarr.codecs.ZstdCodec(level=3, checksum=True), zarr.codecs.Crc32cCodec()],
              [zarr.codecs.BloscCodec(cname="zstd", clevel=3)]]
    for k, comps in enumerate(codecs):
        p = str(tmp_path / f"foreign{k}.zarr")
        z = zarr.create_array(p, shape=model.shape, chunks=(35, 50), dtype="f8",
                              compressors=comps, fill_value=0)
        z[:] = model
        with cio.DiskArray.open(p) as d:
            assert (d[:, :] == model).all(), comps


# ---------------------------------------------------------------- damaged metadata

def _good(tmp_path, name="a"):
    p = str(tmp_path / f"{name}.zarr")
    st = _be().open_array(p, "w+", shape=(16, 20), dtype=np.dtype("f8"), chunks=(8, 10),
                          compressor="zstd", inner_chunks=False)
    st.write((slice(0, 16), slice(0, 20)), np.ones((16, 20)))
    st.close()
    return p


@pytest.mark.parametrize("fill, dtype", [
    pytest.param(str(10 ** 400), "f8", id="10**400-f8"), ("1e400", "f8"),
    ('"0xZZZZZZZZZZZZZZZZ"', "f8"), ('"0x12"', "f8"),
    ("1e39", "f4"), (str(2 ** 64), "i8"), ("-1", "u1"), ("[1e39, 0]", "c8"),
    ('"Infinity"', "i4"), ("NaN", "f8")])
def test_fill_values_that_do_not_fit_are_metadata_errors(tmp_path, fill, dtype):
    """Before the fix: a raw OverflowError or ValueError."""
    p = _good(tmp_path)
    mp_ = os.path.join(p, "zarr.json")
    doc = json.load(open(mp_))
    doc["data_type"] = np.dtype(dtype).name
    open(mp_, "w").write(json.dumps(doc).replace('"fill_value": 0.0', f'"fill_value": {fill}'))
    with pytest.raises(MetadataError) as e:
        _be().describe(p)
    assert mp_ in str(e.value)


def _damage_cases():
    def write(text):
        return lambda mp_: open(mp_, "wb").write(text)

    def fifo(mp_):
        os.unlink(mp_)
        os.mkfifo(mp_)

    def directory(mp_):
        os.unlink(mp_)
        os.mkdir(mp_)

    def edit(fn):
        def do(mp_):
            doc = json.load(open(mp_))
            fn(doc)
            open(mp_, "w").write(json.dumps(doc))
        return do
    return {
        "empty": write(b""),
        "utf-16": lambda mp_: open(mp_, "wb").write(open(mp_, "rb").read().decode()
                                                    .encode("utf-16")),
        "2 MB": write(b" " * (2 << 20) + b"{}"),
        "deep": write(b"[" * 100_000 + b"]" * 100_000),
        "fifo": fifo,
        "a directory": directory,
        "format 2": edit(lambda d: d.update(zarr_format=2)),
        "a group": edit(lambda d: d.update(node_type="group")),
        "truncated": lambda mp_: open(mp_, "r+b").truncate(40),
        "NaN": write(b'{"zarr_format": 3, "node_type": "array", "shape": [NaN]}'),
        "huge number": write(b'{"zarr_format": 3, "shape": [' + b"9" * 5000 + b"]}"),
    }


@pytest.mark.parametrize("case", sorted(_damage_cases()))
def test_damaged_zarr_json_is_reported_as_damaged(tmp_path, case, capsys):
    """The backend and ``chemio check`` name the file and what is wrong and give no
    advice to overwrite or remove it (it may hold someone's array)."""
    p = _good(tmp_path)
    mp_ = os.path.join(p, "zarr.json")
    _damage_cases()[case](mp_)
    with pytest.raises(MetadataError) as e:
        _be().describe(p)
    msg = str(e.value)
    assert mp_ in msg and not any(a in msg for a in ADVICE), msg
    assert _check.main([p]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM" in out and mp_ in out and not any(a in out for a in ADVICE), out
    assert os.path.lexists(mp_) and sorted(os.listdir(os.path.join(p, "c")))  # untouched


def test_diskarray_open_of_damaged_zarr_json_names_the_damage(tmp_path):
    """DiskArray.open asks the self-describing backends what is wrong inside a directory
    none of them recognises, instead of advising to overwrite or remove it."""
    p = _good(tmp_path)
    open(os.path.join(p, "zarr.json"), "w").write("")
    with pytest.raises(MetadataError) as e:
        cio.DiskArray.open(p)
    assert not any(a in str(e.value) for a in ADVICE), str(e.value)


_RECREATE = """
import sys, numpy as np, chemio_py as cio
path, n = sys.argv[1], int(sys.argv[2])
for k in range(n):
    d = cio.DiskArray.create("race", (64, 64), "f8", chunks=(16, 16), backend="zarr",
                             path=path, overwrite=True, compressor="zstd")
    d[:, :] = np.full((64, 64), float(k))
    d.close()
print("done", flush=True)
"""


def test_open_racing_a_re_creation_never_advises_overwriting(tmp_path):
    """Another process re-creates the array 60 times while this one opens and reads it:
    every open finds the old or the new array (or says it is being re-created), never
    "recreate with overwrite=True or remove it" (before the fix: 25-80% of racing opens)."""
    d = cio.DiskArray.create("race", (64, 64), "f8", chunks=(16, 16), backend="zarr",
                             path=tmp_path, compressor="zstd")
    path = d.path
    d.close()
    proc = subprocess.Popen([sys.executable, "-c", _RECREATE, str(tmp_path), "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    opened, problems = 0, []
    try:
        while proc.poll() is None:
            try:
                with cio.DiskArray.open(path) as e:
                    block = e[0:16, 0:16]
                    assert len(np.unique(block)) == 1      # one re-create's values
                opened += 1
            except ChemIOError as err:
                msg = str(err)
                if any(a in msg for a in ADVICE) or "re-created" not in msg:
                    problems.append(msg)
    finally:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "done" in out, err[-2000:]
    assert opened > 5 and not problems, problems[:3]
    assert sorted(os.listdir(tmp_path)) == ["race.zarr"]     # no temporary directory left


def test_replacing_keeps_foreign_directories_and_groups(tmp_path):
    grp = tmp_path / "g.zarr"
    zarr.open_group(str(grp), mode="w")
    with pytest.raises(ArgumentError, match="not a Zarr array"):
        _be().open_array(str(grp), "w+", shape=(4,), dtype=np.dtype("f8"), chunks=(2,))
    assert json.load(open(grp / "zarr.json"))["node_type"] == "group"
    damaged = _good(tmp_path, "d")
    open(os.path.join(damaged, "zarr.json"), "w").write("{")
    st = _be().open_array(damaged, "w+", shape=(4,), dtype=np.dtype("f8"), chunks=(2,))
    st.close()                                     # a damaged array may be replaced
    assert _be().describe(damaged)["shape"] == (4,)


# ---------------------------------------------------------------- chemio check

def test_chemio_check_verifies_zarr_arrays(tmp_path, capsys):
    """Before the fix: "is a directory, not a chemio file", exit 2."""
    p = str(tmp_path / "s.zarr")
    st = _be().open_array(p, "w+", shape=(40, 30), dtype=np.dtype("f8"), chunks=(20, 30),
                          compressor="zstd", inner_chunks=(10, 15))
    st.write((slice(0, 40), slice(0, 30)), np.arange(1200.0).reshape(40, 30))
    st.close()
    assert _check.main([p]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out and "CRC32C" in out and "2 stored of 2" in out
    shard = os.path.join(p, "c", "1", "0")
    raw = bytearray(open(shard, "rb").read())
    raw[-10] ^= 0xFF                                   # the index
    open(shard, "wb").write(raw)
    assert _check.main([p, "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["problems"]) == 1 and shard in rep["problems"][0] \
        and "checksum" in rep["problems"][0]
    # a corrupt inner chunk, a link where a key directory belongs, an interrupted write
    raw[-10] ^= 0xFF
    raw[0:4] = b"\0\0\0\0"
    open(shard, "wb").write(raw)
    os.makedirs(os.path.join(p, "c", "1"), exist_ok=True)
    os.symlink(tmp_path, os.path.join(p, "c", "2"))     # row 2 is outside the grid: a note
    open(os.path.join(p, "c", "0", ".0.123.abcd.tmp"), "w").write("x")
    assert _check.main([p]) == 1
    out = capsys.readouterr().out
    assert f"{shard} (inner chunk 0)" in out and "temporary file" in out, out


def test_chemio_check_zarr_with_crc32c_codec_and_bombs(tmp_path, capsys):
    p = str(tmp_path / "f.zarr")
    z = zarr.create_array(p, shape=(20, 20), chunks=(10, 10), dtype="i4",
                          compressors=[zarr.codecs.ZstdCodec(), zarr.codecs.Crc32cCodec()],
                          fill_value=0)
    z[:] = np.arange(400).reshape(20, 20)
    assert _check.main([p]) == 0
    capsys.readouterr()
    obj = os.path.join(p, "c", "1", "1")
    raw = bytearray(open(obj, "rb").read())
    raw[-1] ^= 1                                       # the stored crc32c
    open(obj, "wb").write(raw)
    bomb = os.path.join(p, "c", "0", "1")
    open(bomb, "wb").write(_zstd_rle_frame(90) + struct.pack("<I", 0))
    link = os.path.join(p, "c", "0", "0")
    os.unlink(link)
    os.symlink("/etc/passwd", link)
    assert _check.main([p]) == 1
    out = capsys.readouterr().out
    assert "crc32c" in out and obj in out and bomb in out and link in out, out
    assert "PROBLEM" in out and out.count("PROBLEM") == 3


def test_chemio_check_of_a_directory_that_is_no_zarr_array(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    assert _check.main([str(tmp_path / "plain")]) == 2
    assert "is a directory" in capsys.readouterr().err
