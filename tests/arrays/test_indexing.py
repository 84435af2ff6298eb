"""NumPy's indexing on DiskArray and its views, against NumPy, on every array backend.

Property tests draw shapes, chunkings and index expressions (steps of both signs, clipped
bounds, ints, ``...``, ``None``, lists, masks, orthogonal arrays) and compare reads and
writes with the same operation on a NumPy array; views are composed of views.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import chemio_py as cio
from chemio_py.arrays import indexing
from chemio_py.errors import ArgumentError, ModeError, SectionError

SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@st.composite
def arrays_and_chunks(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    chunks = tuple(draw(st.integers(1, max(1, n))) for n in shape)
    return shape, chunks


def _axis_index(draw, n, *, lists=True):
    kind = draw(st.sampled_from(["slice", "int", "list", "mask"] if lists and n
                                else ["slice", "int"] if n else ["slice"]))
    if kind == "slice":
        bound = st.one_of(st.none(), st.integers(-n - 3, n + 3))
        step = draw(st.one_of(st.none(), st.integers(-4, 4).filter(lambda s: s != 0)))
        return slice(draw(bound), draw(bound), step)
    if kind == "int":
        return draw(st.integers(-n, n - 1))
    if kind == "list":
        return draw(st.lists(st.integers(-n, n - 1), min_size=0, max_size=6))
    return np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)


@st.composite
def basic_keys(draw, shape):
    """Keys of d[...]: at most one list/mask, maybe None and '...'."""
    k = draw(st.integers(0, len(shape)))
    back = k < len(shape) and draw(st.booleans())      # '...' then the last k axes
    axes = shape[len(shape) - k:] if back else shape[:k]
    items: list = []
    used_list = False
    for n in axes:
        ki = _axis_index(draw, n, lists=not used_list)
        used_list |= not isinstance(ki, (slice, int))
        items.append(ki)
    if back:
        items.insert(0, Ellipsis)
    if draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), None)
    return tuple(items)


@st.composite
def orth_keys(draw, shape):
    return tuple(_axis_index(draw, n) for n in shape)


def _ix(key, shape):
    """NumPy's equivalent of an orthogonal key."""
    out = []
    for k, n in zip(key, shape):
        if isinstance(k, slice):
            out.append(np.arange(n)[k])
        elif isinstance(k, int):
            out.append(np.array([k]))
        else:
            out.append(np.arange(n)[k])
    res_shape = tuple(len(o) for k, o in zip(key, out) if not isinstance(k, int))
    return np.ix_(*out), res_shape


def _same(got, want):
    assert np.shape(got) == np.shape(want), (np.shape(got), np.shape(want))
    assert np.array_equal(got, want)
    assert type(got) is type(want) or (isinstance(got, np.ndarray)
                                       and isinstance(want, np.ndarray))


@SETTINGS
@given(data=st.data())
def test_reads_and_writes_match_numpy(arr_store, data):
    shape, chunks = data.draw(arrays_and_chunks())
    model = np.arange(np.prod(shape), dtype="f8").reshape(shape)
    with cio.DiskArray.create("ix", shape, "f8", chunks=chunks, backend=arr_store) as d:
        d[...] = model
        for _ in range(4):
            key = data.draw(basic_keys(shape))
            _same(d[key], model[key])
            sel = model[key]
            value = -np.arange(np.size(sel), dtype="f8").reshape(np.shape(sel)) - 1
            try:
                d[key] = value
            except SectionError as e:         # a repeated index: writes refuse it
                assert "repeats" in str(e)
                _same(d[...], model)
                continue
            model[key] = value
            _same(d[...], model)
        key = data.draw(orth_keys(shape))
        ix, rshape = _ix(key, shape)
        _same(d.oindex[key], model[ix].reshape(rshape)[()])


@SETTINGS
@given(data=st.data())
def test_views_of_views_match_numpy(arr_store, data):
    shape, chunks = data.draw(arrays_and_chunks())
    model = np.arange(np.prod(shape), dtype="i8").reshape(shape)
    with cio.DiskArray.create("vv", shape, "i8", chunks=chunks, backend=arr_store) as d:
        d[...] = model
        v, m = d, model
        for _ in range(data.draw(st.integers(1, 3))):
            if not m.ndim:
                break
            key = tuple(k for k in data.draw(orth_keys(m.shape)))
            ix, rshape = _ix(key, m.shape)
            v = v.view[key]
            m = m[ix].reshape(rshape)
            assert v.shape == m.shape
            if not m.ndim:
                break
            _same(np.asarray(v), m)
        if m.ndim:
            key = data.draw(basic_keys(m.shape))
            _same(v[key], m[key])
            aliased = any(indexing.repeats(p) for p in v._picks())   # elements seen twice
            if m.size and not aliased and not any(isinstance(k, list) for k in key):
                try:
                    v[key] = 7
                except SectionError as e:       # the view repeats an index of the array
                    assert "repeats" in str(e)
                    _same(d[...], model)
                    return
                m = m.copy()
                m[key] = 7
                _same(np.asarray(v), m)


@pytest.fixture
def arr(arr_store):
    model = np.arange(6 * 5 * 4, dtype="f8").reshape(6, 5, 4)
    with cio.DiskArray.create("fix", model.shape, "f8", chunks=(4, 2, 3),
                              backend=arr_store) as d:
        d[...] = model
        yield d, model


def test_numpy_conventions(arr):
    d, m = arr
    assert isinstance(d[1, 2, 3], np.float64) and d[1, 2, 3] == m[1, 2, 3]
    _same(d[1:100], m[1:100])
    _same(d[-100:2], m[-100:2])
    _same(d[::-1, ::-2], m[::-1, ::-2])
    _same(d[0, :, [1, 3]], m[0, :, [1, 3]])            # NumPy moves the list's axis first
    _same(d[[4, 1, 1]], m[[4, 1, 1]])                  # unsorted and repeated on reads
    _same(d[None, ..., None], m[None, ..., None])
    assert [np.array_equal(r, m[i]) for i, r in enumerate(d)] == [True] * 6
    assert list(iter(d.view[0, 0])) == list(m[0, 0])
    assert 17.0 in d and 1e9 not in d and -1 not in d
    with pytest.raises(ValueError, match="copy"):
        np.array(d, copy=False)
    _same(np.asarray(d), m)
    with pytest.raises(IndexError):
        d[6]
    with pytest.raises(SectionError, match="oindex"):
        d[[0, 1], [0, 1]]
    with pytest.raises(SectionError, match="boolean mask"):
        d[np.ones((6, 5), bool)]
    with pytest.raises(SectionError, match="True"):
        d[True]
    with pytest.raises(SectionError, match="step 0"):
        d[::0]
    with pytest.raises(SectionError, match="not a slice"):
        d[0.5]


def test_bad_writes_write_nothing(arr):
    d, m = arr
    for key, value in [(np.s_[[1, 1]], 0.0),                   # repeated index
                       (np.s_[::2], np.zeros((2, 5, 4))),      # wrong shape (3 rows)
                       (np.s_[[0, 9]], 0.0),                   # out of bounds
                       (np.s_[::2, 0], np.zeros(3, complex))]:  # loses the imaginary part
        with pytest.raises((SectionError, ArgumentError)):
            d[key] = value
        _same(d[...], m)
    with pytest.raises(SectionError, match="oindex"):
        d[[0, 1], [0, 1]] = 1.0
    _same(d[...], m)


def test_read_only_refuses_every_write_form(tmp_path, arr_store):
    p = tmp_path / "ro.dra"
    with cio.DiskArray.create("ro", (4, 4), "f8", path=p, backend=arr_store) as d:
        d[...] = 1.0
    with cio.DiskArray.open(p, backend=arr_store) as r:
        for write in (lambda: r.__setitem__(np.s_[::2], 0.0),
                      lambda: r.oindex.__setitem__(np.s_[[0], [1]], 0.0),
                      lambda: r.view[1:3].__setitem__(0, 0.0)):
            with pytest.raises(ModeError):
                write()
        assert r[...].sum() == 16.0
    cio.DiskArray.open(p, "r+", backend=arr_store).delete()


def test_views_are_windows_without_copies(arr):
    d, m = arr
    v = d.view[1:5, ::2]
    assert v.shape == (4, 3, 4) and v.base is d and not v.window
    w = d.view[2:5, 1]
    assert w.window and w.shape == (3, 4)
    _same(w.read(np.s_[1:3]), m[2:5, 1][1:3])
    out = np.empty((2, 4))
    assert w.aread(np.s_[0:2], out).wait() is out
    _same(out, m[2:4, 1])
    w.write(np.s_[0], np.full(4, -1.0))
    m[2, 1] = -1.0
    _same(d[...], m)
    v.awrite(np.s_[0:1, 0:1], np.full((1, 1, 4), -2.0)).wait()
    m[1, 0] = -2.0
    _same(d[...], m)
    got = np.concatenate([b.copy() for _, b in v.iter_blocks(size=3)])
    _same(got, m[1:5, ::2])
    _same(v.to_dask().compute(), m[1:5, ::2])
    _same(pickle.loads(pickle.dumps(indexing.parse(np.s_[::2, [1, 2]], d.shape))).shape,
          (3, 2, 4))


def test_iter_blocks_start_stop(arr):
    d, m = arr
    secs = [(s, b.copy()) for s, b in d.iter_blocks(size=2, start=1, stop=-1)]
    assert [s[0] for s, _ in secs] == [slice(1, 3), slice(3, 5)]
    _same(np.concatenate([b for _, b in secs]), m[1:5])
    assert list(d.iter_blocks(start=4, stop=2)) == []
    secs = [s for s, _ in d.iter_blocks(axis=1, size=4, start=-3)]
    assert [s[1] for s in secs] == [slice(2, 5)]
    with pytest.raises(ArgumentError, match="start"):
        d.iter_blocks(start=1.5)


def test_stepped_reads_move_only_the_chunks_they_need(tmp_path):
    """A read of one row in 100 of a byte-addressable array moves those rows (not the
    array); on zarr only the chunks holding them."""
    for be in ("local", "zarr"):
        with cio.DiskArray.create("big", (4000, 256), "f8", chunks=(100, 256),
                                  backend=be) as d:
            d[...] = 1.0
            before = d.stats.bytes_read
            got = d[::1000]
            assert got.shape == (4, 256) and np.all(got == 1.0)
            moved = d.stats.bytes_read - before
            limit = 4 * 256 * 8 if be == "local" else 4 * 100 * 256 * 8
            assert moved <= limit, (be, moved)


def test_a_view_outgrown_by_a_shrink_says_so(arr_store):
    with cio.DiskArray.create("shrink", (6, 3), "f8", maxshape=(None, 3),
                              backend=arr_store) as d:
        d[...] = np.arange(18.0).reshape(6, 3)
        head, tail = d.view[:2], d.view[4:]
        d.resize((3, 3))
        assert np.array_equal(head[...], np.arange(6.0).reshape(2, 3))
        with pytest.raises(SectionError, match="take the view again"):
            tail[...]
        d.resize((6, 3))
        assert not tail[...].any()                 # grown back: zeros, as h5py/zarr
