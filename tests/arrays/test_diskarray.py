"""DiskArray against a NumPy model: round trips, random sections, hints, transpose, errors,
the out-of-core GEMM of the Global Arrays DRA test, and random op sequences (hypothesis).

Every test that touches storage runs on each backend of the ``store`` fixture that can hold
arrays (``open_array``); the others are skipped with the reason.
"""
import hashlib
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.errors import ArgumentError, ChemIOError, MetadataError, ModeError, SectionError

DTYPES = ["int32", "int64", "float64", "complex128"]


def rand(rng, shape, dtype):
    dt = np.dtype(dtype)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(max(info.min, -10**9), min(info.max, 10**9), shape, dtype=dt)


def random_section(rng, shape, block):
    """A random section up to 1.5 blocks big; a third of them touch an edge of the array."""
    sec = []
    for n, b in zip(shape, block):
        ln = int(rng.integers(1, min(n, b + b // 2) + 1))
        kind = rng.integers(0, 3)
        lo = 0 if kind == 0 else (n - ln if kind == 1 else int(rng.integers(0, n - ln + 1)))
        sec.append(slice(lo, lo + ln))
    return tuple(sec)


def sha(path):
    """A hash of the file at ``path``, or of every file under a directory (a zarr array)."""
    h = hashlib.sha256()
    files = [str(path)] if not os.path.isdir(path) else sorted(
        os.path.join(d, n) for d, _, names in os.walk(path) for n in names)
    for f in files:
        h.update(f.encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


def describes_itself(backend: str) -> bool:
    """True for a backend that keeps the metadata inside its objects (no ``.json``)."""
    return isinstance(backends.resolve(backend), backends.SelfDescribing)


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(45, 38), (13, 11, 9)])
def test_round_trip_persistent(arr_store, tmp_path, shape, dtype):
    rng = np.random.default_rng(7)
    model = rand(rng, shape, dtype)
    where = tmp_path / "rt.dra"
    d = cio.DiskArray.create("rt", shape, dtype, path=where, backend=arr_store,
                             chunks=tuple(max(1, n // 3) for n in shape))
    assert d.persistent and d.mode == "r+"
    half = shape[0] // 2
    reqs = [d.awrite(np.s_[:half], model[:half]), d.awrite(np.s_[half:], model[half:])]
    cio.waitall(reqs)
    d.close()
    assert os.path.exists(where) and os.path.exists(d.meta_path)
    assert d.meta_path == (str(where) if describes_itself(arr_store) else str(where) + ".json")

    e = cio.DiskArray.open(where, "r")
    assert (e.shape, e.dtype, e.name, e.path) == (shape, np.dtype(dtype), "rt", str(where))
    assert e.ndim == len(shape) and e.nbytes == model.nbytes and e.size == model.size
    assert e.chunks == tuple(max(1, n // 3) for n in shape)
    np.testing.assert_array_equal(e.read(), model)
    np.testing.assert_array_equal(e[...], model)
    e.delete()
    assert not os.path.exists(where) and not os.path.exists(str(where) + ".json")


def test_scratch_array_lives_in_job_dir_and_vanishes(arr_store, scratch_root):
    d = cio.DiskArray.create("scr", (30, 20), "f8", backend=arr_store)
    assert not d.persistent
    assert os.path.exists(d.path) and os.path.exists(d.meta_path)
    if arr_store == "local":
        assert os.path.dirname(os.path.dirname(d.path)) == os.path.abspath(scratch_root)
    d[3:5] = 1.5
    again = cio.DiskArray.open(d.path, "r")        # another handle; not the owner
    assert again[3, 7] == 1.5
    again.close()
    assert os.path.exists(d.path)
    d.close()
    assert not os.path.exists(d.path) and not os.path.exists(d.meta_path)
    d.close()                                      # idempotent


def test_scratch_array_vanishes_at_exit(arr_store):
    d = cio.DiskArray.create("atexit", (10, 10), "i8", backend=arr_store)
    path = d.path
    d[0, 0] = 3
    cio.cleanup()                                  # what happens at exit
    assert d.closed and not os.path.exists(path)


def test_context_manager_and_directory_path(arr_store, tmp_path):
    with cio.DiskArray.create("cm", (8, 9), "f4", path=tmp_path, backend=arr_store) as d:
        d[:, 3] = np.arange(8, dtype=np.float32)
        suffix = backends.resolve(arr_store).suffix if describes_itself(arr_store) else ".dra"
        assert d.path == str(tmp_path / ("cm" + suffix))
    assert d.closed
    with cio.DiskArray.open(d.meta_path) as e:                      # by the metadata too
        np.testing.assert_array_equal(e[:, 3], np.arange(8, dtype=np.float32))
        assert e[:, 2].sum() == 0
    with pytest.raises(ArgumentError, match="already exists"):
        cio.DiskArray.create("cm", (2, 2), "f4", path=tmp_path, backend=arr_store)
    with cio.DiskArray.create("cm", (2, 2), "f4", path=tmp_path, backend=arr_store,
                              overwrite=True) as d:
        assert d.shape == (2, 2) and d[...].sum() == 0


# ---------------------------------------------------------------- random sections

@pytest.mark.parametrize("factor", [2, 3, 7])
@pytest.mark.parametrize("dtype,block", [("float64", (6, 5)), ("int32", (3, 4, 5)),
                                         ("complex128", (4, 3, 2))])
def test_random_sections_against_numpy(arr_store, factor, dtype, block):
    rng = np.random.default_rng(factor * 100 + len(block))
    shape = tuple(factor * b + (1 if k == 0 else 0) for k, b in enumerate(block))
    model = np.zeros(shape, dtype)
    d = cio.DiskArray.create("rnd", shape, dtype, chunks=block, backend=arr_store)
    sections = [random_section(rng, shape, block) for _ in range(30)]
    for i, sec in enumerate(sections):
        data = rand(rng, model[sec].shape, dtype)
        if i % 3 == 0:
            d.awrite(sec, data).wait()
        else:
            d.write(sec, data)
        model[sec] = data
        other = sections[int(rng.integers(0, i + 1))]
        np.testing.assert_array_equal(d[other], model[other])
    for sec in sections:
        np.testing.assert_array_equal(d.read(sec), model[sec])
        out = np.empty(model[sec].shape, dtype)
        assert d.aread(sec, out).wait() is out
        np.testing.assert_array_equal(out, model[sec])
    np.testing.assert_array_equal(d[...], model)           # unwritten elements read 0
    assert (model == 0).any()
    d.close()


def test_partial_chunk_write_keeps_neighbours(arr_store):
    d = cio.DiskArray.create("part", (20, 30), "f8", chunks=(10, 10), backend=arr_store)
    d[...] = np.ones((20, 30))
    d[12:15, 3:7] = np.zeros((3, 4))               # inside chunk (1, 0)
    model = np.ones((20, 30))
    model[12:15, 3:7] = 0
    np.testing.assert_array_equal(d[...], model)
    d[9:11, 9:21] = 7.0                            # across four chunks, a corner of each
    model[9:11, 9:21] = 7.0
    np.testing.assert_array_equal(d[...], model)
    d.close()


def test_ints_ellipsis_and_negative_indices(arr_store):
    rng = np.random.default_rng(3)
    model = rand(rng, (7, 8, 9), "int64")
    d = cio.DiskArray.create("idx", model.shape, "int64", chunks=(3, 3, 4), backend=arr_store)
    d[...] = model
    for key in [np.s_[2], np.s_[-1], np.s_[1:3, 4], np.s_[..., 5], np.s_[2, ..., 3:7],
                np.s_[-3:, :-2, 0], np.s_[:, 2:2], np.s_[4, 5, 6]]:
        np.testing.assert_array_equal(d[key], model[key])
    d[1, 2:5] = np.full((3, 9), -4)
    model[1, 2:5] = -4
    d[:, :, 0] = 11                                # broadcast scalar
    model[:, :, 0] = 11
    d[0] = np.arange(9)                            # a row broadcast over axis 1
    model[0] = np.arange(9)
    np.testing.assert_array_equal(d[...], model)
    np.testing.assert_array_equal(np.asarray(d), model)
    d.close()


def test_reads_into_strided_views_and_safe_casts(arr_store):
    rng = np.random.default_rng(5)
    model = rand(rng, (40, 50), "float64")
    d = cio.DiskArray.create("views", model.shape, "float64", chunks=(7, 9), backend=arr_store)
    d.write((), model.astype(np.float32).astype(np.float64))
    d[0:10] = np.arange(500, dtype=np.int32).reshape(10, 50)       # int32 -> float64 is safe
    model = model.astype(np.float32).astype(np.float64)
    model[0:10] = np.arange(500).reshape(10, 50)
    big = np.full((60, 70), -1.0)
    d.read(np.s_[5:35, 10:45], big[3:33, 20:55])
    np.testing.assert_array_equal(big[3:33, 20:55], model[5:35, 10:45])
    assert (big[:3] == -1).all() and (big[:, :20] == -1).all()
    fort = np.asfortranarray(np.zeros((30, 35)))
    d.read(np.s_[5:35, 10:45], fort)
    np.testing.assert_array_equal(fort, model[5:35, 10:45])
    d.write(np.s_[1:11, 2:7], model[::-1][:10, ::2][:, :5] * 2)     # strided source
    model[1:11, 2:7] = model[::-1][:10, ::2][:, :5] * 2
    np.testing.assert_array_equal(d[...], model)
    d.close()


# ---------------------------------------------------------------- layout hints

def test_request_shape_hints_change_speed_not_results(arr_store):
    rng = np.random.default_rng(11)
    shape = (90, 70)
    model = rand(rng, shape, "float64")
    sections = [random_section(rng, shape, (30, 30)) for _ in range(20)]
    results = []
    for hint in [(1, None), (None, 1), None, (500, 500), (9, 7)]:
        d = cio.DiskArray.create("hint", shape, "float64", request_shape=hint, backend=arr_store)
        for k in range(0, 90, 20):
            d[k:min(k + 20, 90)] = model[k:k + 20]
        results.append([d[s] for s in sections] + [d[...]])
        if hint == (500, 500):
            assert d.chunks == shape
        d.close()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(results[0][-1], model)


# ---------------------------------------------------------------- transpose

@pytest.mark.parametrize("shape,chunks", [((23, 17), (5, 4)), ((7, 9, 11), (3, 4, 5))])
def test_transposed_round_trip(arr_store, shape, chunks):
    rng = np.random.default_rng(13)
    model = rand(rng, shape, "float64")
    d = cio.DiskArray.create("tr", shape, "float64", chunks=chunks, backend=arr_store)
    d.write((), model.T.copy(), transpose=True)
    np.testing.assert_array_equal(d[...], model)
    sec = tuple(slice(1, n - 2) for n in shape)
    block = rand(rng, model[sec].shape[::-1], "float64")
    d.awrite(sec, block, transpose=True).wait()
    model[sec] = block.T
    np.testing.assert_array_equal(d[...], model)
    np.testing.assert_array_equal(d.read(sec, transpose=True), model[sec].T)
    out = np.empty(model[sec].shape[::-1])
    assert d.aread(sec, out, transpose=True).wait() is out
    np.testing.assert_array_equal(out, model[sec].T)
    with pytest.raises(SectionError, match="transposed"):
        d.write(sec, block[:-1], transpose=True)
    d.close()


# ---------------------------------------------------------------- errors

def test_section_and_data_errors_write_nothing(arr_store, tmp_path):
    where = tmp_path / "err.dra"
    d = cio.DiskArray.create("err", (10, 12), "float64", path=where, chunks=(4, 5),
                             backend=arr_store)
    d[...] = np.arange(120.0).reshape(10, 12)
    d.flush()
    before = sha(where)
    bad_sections = [np.s_[0:11], np.s_[:, 5:13], np.s_[-11:], np.s_[10], np.s_[::2],
                    np.s_[:, 1:9:3], np.s_[5:3], np.s_[0, 0, 0], np.s_[None],
                    np.s_[0.5], np.s_[[1, 2]], np.s_[True], np.s_[..., ...],
                    [slice(0, 2)], np.s_["a":]]
    for sec in bad_sections:
        with pytest.raises(SectionError) as ei:
            d.write(sec, np.zeros((1,)))
        assert "section" in str(ei.value)
        with pytest.raises(SectionError):
            d.read(sec)
    with pytest.raises(SectionError, match=r"shape \(3, 4\)"):
        d.write(np.s_[0:4, 0:3], np.zeros((3, 4)))
    with pytest.raises(SectionError):
        d[0:2, 0:2] = np.zeros((3, 3))
    with pytest.raises(ArgumentError, match="complex128"):
        d.write(np.s_[0:2, 0:2], np.zeros((2, 2), complex))
    with pytest.raises(ArgumentError):
        d.write(np.s_[0:2, 0:2], np.array([["a", "b"], ["c", "d"]]))
    with pytest.raises(ArgumentError, match="dtype"):
        d.read(np.s_[0:2, 0:2], np.zeros((2, 2), np.float32))
    with pytest.raises(SectionError):
        d.read(np.s_[0:2, 0:2], np.zeros((2, 3)))
    with pytest.raises(ArgumentError, match="read-only"):
        ro = np.zeros((2, 2))
        ro.flags.writeable = False
        d.read(np.s_[0:2, 0:2], ro)
    assert isinstance(SectionError("x"), ValueError)
    d.close()
    assert sha(where) == before
    with pytest.raises(ChemIOError, match="closed"):
        d[0, 0]

    e = cio.DiskArray.open(where)                          # read-only by default
    with pytest.raises(ModeError, match="r\\+"):
        e[0, 0] = 1.0
    with pytest.raises(ModeError):
        e.awrite(np.s_[0:1, 0:1], np.zeros((1, 1)))
    e.close()
    assert sha(where) == before
    with pytest.raises(ModeError):
        cio.DiskArray.open(where, "w+")
    f = cio.DiskArray.open(where, "r+")
    np.testing.assert_array_equal(f[...], np.arange(120.0).reshape(10, 12))
    f.delete()


def test_create_errors_create_nothing(arr_store, tmp_path):
    for kw in [dict(shape=(-1, 3)), dict(shape=(2.5, 3)), dict(dtype="O"), dict(dtype="M8"),
               dict(dtype=[("a", "O")]), dict(chunks=(0, 3)), dict(chunks=(2,)),
               dict(request_shape=(1,)), dict(request_shape=(0, 3)), dict(name="a/b"),
               dict(name=".."), dict(persistent=True), dict(shape=(10**15, 10**15)),
               dict(shape=()), dict(path=tmp_path / "no" / "such" / "dir.dra")]:
        args = dict(name="bad", shape=(4, 3), dtype="f8", backend=arr_store)
        args.update(kw)
        with pytest.raises(ChemIOError) as ei:
            cio.DiskArray.create(args.pop("name"), args.pop("shape"), args.pop("dtype"), **args)
        assert isinstance(ei.value, ValueError), ei.value
    assert os.listdir(tmp_path) == []
    if describes_itself(arr_store):
        return          # a zarr array is sparse: absent objects read as zero, nothing reserved
    with pytest.raises(cio.OutOfSpaceError) as ei:
        cio.DiskArray.create("huge", (2**40, 2**16), "f8", path=tmp_path, backend=arr_store)
    assert ei.value.needed == 2**59 and os.listdir(tmp_path) == []


def test_open_missing_and_hostile_metadata(arr_store, tmp_path):
    with pytest.raises(MetadataError, match="does not exist"):
        cio.DiskArray.open(tmp_path / "missing.dra")
    if describes_itself(arr_store):
        pytest.skip("no .json beside the data: tests/adversarial/test_adv_zarr.py feeds "
                    "hostile zarr.json and shard indexes")
    where = tmp_path / "h.dra"
    d = cio.DiskArray.create("h", (6, 5), "int32", path=where, backend=arr_store)
    d[...] = np.arange(30).reshape(6, 5)
    d.close()
    mpath = str(where) + ".json"
    good = json.loads(open(mpath).read())
    data_before = sha(where)
    cases = [
        ("NaN", json.dumps(good).replace('"shape": [6', '"shape": [NaN')),
        ("negative", dict(good, shape=[-6, 5])),
        ("enormous", dict(good, shape=[2**62, 2**62], nbytes=1)),
        ("unknown dtype", dict(good, dtype="<q7")),
        ("object dtype", dict(good, dtype="|O")),
        ("truncated", json.dumps(good)[:40]),
        ("size mismatch", dict(good, shape=[7, 5], nbytes=140)),
        ("escaping data", dict(good, data="../h.dra")),
    ]
    for label, doc in cases:
        with open(mpath, "w") as fh:
            fh.write(doc if isinstance(doc, str) else json.dumps(doc))
        with pytest.raises(MetadataError) as ei:
            cio.DiskArray.open(where, "r+")
        assert mpath in str(ei.value) or str(where) in str(ei.value), (label, ei.value)
    assert sha(where) == data_before
    with open(mpath, "w") as fh:
        json.dump(good, fh)
    os.truncate(where, 60)
    with pytest.raises(MetadataError, match="truncated"):
        cio.DiskArray.open(where)
    os.unlink(where)
    with pytest.raises(MetadataError, match="missing"):
        cio.DiskArray.open(mpath)


# ---------------------------------------------------------------- out-of-core GEMM

def test_out_of_core_gemm(arr_store):
    """C = A.B with A(i,j) = i + j, B(i,j) = j (1-based), n = 500, in 100-wide panels;
    the next B panel is read by aread while the current one multiplies."""
    n, w = 500, 100
    i1 = np.arange(1, n + 1, dtype=np.float64)
    a = cio.DiskArray.create("gA", (n, n), "f8", request_shape=(w, n), backend=arr_store)
    b = cio.DiskArray.create("gB", (n, n), "f8", request_shape=(n, w), backend=arr_store)
    c = cio.DiskArray.create("gC", (n, n), "f8", request_shape=(w, w), backend=arr_store)
    for p in range(0, n, w):                                # fill by panels, never whole
        a[p:p + w, :] = i1[p:p + w, None] + i1[None, :]
        b[:, p:p + w] = np.broadcast_to(i1[p:p + w], (n, w))
    bufs = [np.empty((n, w)), np.empty((n, w))]
    apanel = np.empty((w, n))
    req = b.aread(np.s_[:, 0:w], bufs[0])
    writes = []
    for k, j in enumerate(range(0, n, w)):
        bpanel = req.wait()
        if j + w < n:
            req = b.aread(np.s_[:, j + w:j + 2 * w], bufs[(k + 1) % 2])
        for i in range(0, n, w):
            a.read(np.s_[i:i + w, :], apanel)
            cw = apanel @ bpanel
            writes.append(c.awrite(np.s_[i:i + w, j:j + w], cw))
        cio.waitall(writes)
        writes.clear()
    got = c[...]
    want = 0.5 * n * i1[None, :] * (n + 1 + 2 * i1[:, None])
    np.testing.assert_allclose(got, want, rtol=1e-8)
    assert b.stats.reads >= n // w and c.stats.writes >= (n // w) ** 2
    for x in (a, b, c):
        x.close()


# ---------------------------------------------------------------- hypothesis

@st.composite
def op_sequences(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, n)) for n in shape)
    dtype = draw(st.sampled_from(["int8", "uint16", "float32", "complex64", "bool"]))
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        sec = []
        for n in shape:
            a = draw(st.integers(0, n))
            b = draw(st.integers(a, n))
            sec.append(slice(a, b))
        ops.append((draw(st.sampled_from(["write", "awrite", "read", "aread", "tread",
                                          "twrite"])), tuple(sec), draw(st.integers(0, 2**31))))
    return shape, chunks, dtype, ops


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=op_sequences())
def test_hypothesis_op_sequences(arr_store, case):
    shape, chunks, dtype, ops = case
    model = np.zeros(shape, dtype)
    d = cio.DiskArray.create("hyp", shape, dtype, chunks=chunks, backend=arr_store)
    try:
        for op, sec, seed in ops:
            rng = np.random.default_rng(seed)
            if op in ("write", "awrite", "twrite"):
                data = rand(rng, model[sec].shape, dtype)
                if op == "write":
                    d.write(sec, data)
                elif op == "awrite":
                    d.awrite(sec, data).wait()
                else:
                    d.write(sec, data.T.copy(), transpose=True)
                model[sec] = data
            elif op == "read":
                np.testing.assert_array_equal(d.read(sec), model[sec])
            elif op == "aread":
                np.testing.assert_array_equal(d.aread(sec).wait(), model[sec])
            else:
                np.testing.assert_array_equal(d.read(sec, transpose=True), model[sec].T)
        np.testing.assert_array_equal(d[...], model)
    finally:
        d.close()


# ---------------------------------------------------------------- helpers

def test_block_section_serial_and_stats(arr_store):
    assert cio.block_section((10, 4)) == (slice(0, 10), slice(0, 4))
    assert cio.block_section((10, 4), axis=1) == (slice(0, 10), slice(0, 4))
    d = cio.DiskArray.create("st", (64, 64), "f8", chunks=(16, 64), backend=arr_store)
    s = d.stats                    # counters per path: they keep counting across reopenings
    w0, r0, nw0, nr0 = s.bytes_written, s.bytes_read, s.writes, s.reads
    d[...] = 1.0
    _ = d[0:32]
    assert s.bytes_written - w0 == 64 * 64 * 8 and s.bytes_read - r0 == 32 * 64 * 8
    assert s.writes > nw0 and s.reads > nr0
    assert os.path.basename(d.path) in cio.report(print_it=False)
    assert "st" in repr(d) and "scratch" in repr(d)
    d.close()


def test_iter_blocks_delegates_to_prefetch(arr_store):
    rng = np.random.default_rng(2)
    model = rand(rng, (50, 7), "float64")
    d = cio.DiskArray.create("ib", model.shape, "float64", chunks=(8, 7), backend=arr_store)
    d[...] = model
    seen = np.zeros(model.shape)
    for sec, block in d.iter_blocks(axis=0, size=12, depth=2):
        seen[sec] = block
    np.testing.assert_array_equal(seen, model)
    d.close()


def test_local_store_cached_and_uncached_paths_agree(tmp_path):
    """The local store copies through a mapping when every page is cached and runs are
    short, and uses preadv/pwritev otherwise: both ways must match the model, both ways.
    (Those two paths are the local array store's: this runs once, on ``local``.)"""
    rng = np.random.default_rng(17)
    shape, chunks = (61, 47, 5), (8, 10, 5)
    model = rand(rng, shape, "complex64")
    d = cio.DiskArray.create("paths", shape, "complex64", chunks=chunks, backend="local",
                             path=tmp_path)
    d[...] = model
    st = d.store
    used = {}
    real = st._copy_resident
    real_mapped = st._copy_mapped

    def spy(region, arr, write):
        ok = real(region, arr, write)
        key = ("write" if write else "read", "mapped" if ok else "syscalls")
        used[key] = used.get(key, 0) + 1
        return ok

    def spy_mapped(region, arr):                # the persistent read mapping
        ok = real_mapped(region, arr)
        if ok is not None:
            key = ("read", "mapped" if ok else "syscalls")
            used[key] = used.get(key, 0) + 1
        return ok

    st._copy_resident = spy
    st._copy_mapped = spy_mapped
    for i in range(60):
        sec = random_section(rng, shape, (20, 20, 5))
        if i % 3 == 0:
            st.evict()                          # pages leave the cache: the syscall path
        if i % 2:
            data = rand(rng, model[sec].shape, "complex64")
            d.write(sec, data)
            model[sec] = data
        else:
            np.testing.assert_array_equal(d[sec], model[sec])
            big = np.zeros(tuple(n + 2 for n in model[sec].shape), "complex64")
            view = big[tuple(slice(1, 1 + n) for n in model[sec].shape)]
            d.read(sec, view)
            np.testing.assert_array_equal(view, model[sec])
            assert (big[0] == 0).all()
    st._copy_resident = lambda region, arr, write: False
    st._copy_mapped = lambda region, arr: False
    np.testing.assert_array_equal(d[...], model)
    st.evict()
    np.testing.assert_array_equal(d[...], model)
    assert used.get(("read", "mapped")) and used.get(("read", "syscalls")), used
    if st._map_writes_safe():
        assert used.get(("write", "mapped")) and used.get(("write", "syscalls")), used
    d.delete()
