"""The raw grid layout: chunk shapes from hints, chunk offsets, and byte runs.

The model is brute force: a file image built element by element from the format's
definition (chunks in C order of their grid index, each chunk C-ordered over its trimmed
extent), and byte runs applied to it with plain slicing.
"""
import itertools
import math

import numpy as np
import pytest

from chemio_py.arrays import chunks
from chemio_py.backends import grid


def model_offsets(shape, chunks, itemsize):
    """Byte offset of every element, straight from the format's definition."""
    grid = [-(-n // c) for n, c in zip(shape, chunks)]
    offs = np.zeros(shape, dtype=np.int64)
    pos = 0
    for idx in itertools.product(*(range(g) for g in grid)):
        sl = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunks, shape))
        ext = tuple(s.stop - s.start for s in sl)
        offs[sl] = pos + np.arange(math.prod(ext), dtype=np.int64).reshape(ext) * itemsize
        pos += math.prod(ext) * itemsize
    return offs


def apply_runs(lay, region, out, image, sieve=0):
    """Execute ``lay.runs`` against a bytes image, as a preadv loop would; the runs."""
    flat = out.reshape(-1).view(np.uint8) if out.flags.c_contiguous else None
    base = np.lib.stride_tricks.as_strided(
        out, shape=(sum((n - 1) * s for n, s in zip(out.shape, out.strides)) // out.itemsize + 1,),
        strides=(out.itemsize,)).view(np.uint8) if flat is None else flat
    runs = lay.runs(region, out.strides, sieve=sieve)
    for off, moffs, lens in runs:
        assert len(moffs) <= grid.IOV_MAX
        pos = off
        for m, n in zip(moffs, lens):
            if m >= 0:
                base[m:m + n] = image[pos:pos + n]
            pos += n
    return runs


CASES = [((37, 23), (5, 7)), ((9, 10, 11), (2, 3, 4)), ((50,), (7,)), ((20, 30), (20, 30)),
         ((20, 30), (3, 30)), ((4, 1, 6), (3, 1, 6)), ((6, 5, 4, 3), (4, 2, 3, 2))]


@pytest.mark.parametrize("shape,chunks", CASES)
def test_chunk_offsets_match_the_format(shape, chunks):
    lay = grid.Layout(shape, chunks, 8)
    offs = model_offsets(shape, chunks, 8)
    for p in lay.pieces(grid.full_region(shape)):
        assert lay.chunk_offset(p.index) == offs[p.start]
        assert p.extent == lay.chunk_extent(p.index)
    assert lay.nbytes == 8 * math.prod(shape)


@pytest.mark.parametrize("shape,chunks", CASES)
@pytest.mark.parametrize("sieve", [0, grid.SIEVE_HOLE])
def test_runs_move_exactly_the_region(shape, chunks, sieve):
    rng = np.random.default_rng(1)
    isz = 8
    offs = model_offsets(shape, chunks, isz)
    values = rng.standard_normal(shape)
    image = np.zeros(math.prod(shape) * isz, np.uint8)
    for idx in np.ndindex(*shape):
        image[offs[idx]:offs[idx] + isz] = np.frombuffer(values[idx].tobytes(), np.uint8)
    lay = grid.Layout(shape, chunks, isz)
    for _ in range(40):
        region = []
        for n in shape:
            a, b = sorted(rng.integers(0, n + 1, 2))
            region.append(slice(int(a), int(b)))
        region = tuple(region)
        want = values[region]
        # into a C-ordered buffer and into a strided view of a larger one
        out = np.full(want.shape, np.nan)
        apply_runs(lay, region, out, image, sieve)
        np.testing.assert_array_equal(out, want)
        big = np.full(tuple(n + 3 for n in want.shape), np.nan)
        view = big[tuple(slice(1, 1 + n) for n in want.shape)]
        apply_runs(lay, region, view, image, sieve)
        np.testing.assert_array_equal(view, want)
        assert np.isnan(big[0]).all()            # nothing outside the view was touched


def test_runs_are_merged_and_sieved():
    lay = grid.Layout((4000, 4000), (500, 1000), 8)
    out = np.empty((1000, 4000))
    # whole rows of four chunks that follow each other on disk: one contiguous range
    runs = lay.runs((slice(0, 500), slice(0, 4000)), out[:500].strides)
    assert len({r[0] for r in runs}) == len(runs)
    covered = sum(sum(r[2]) for r in runs)
    assert covered == 500 * 4000 * 8
    starts = [r[0] for r in runs]
    ends = [r[0] + sum(r[2]) for r in runs]
    assert starts[0] == 0 and all(e == s for e, s in zip(ends[:-1], starts[1:]))
    # a non-aligned section: sieving needs far fewer calls than one per row piece
    region = (slice(250, 2250), slice(750, 3750))
    out = np.empty((2000, 3000))
    plain = lay.runs(region, out.strides)
    sieved = lay.runs(region, out.strides, sieve=grid.SIEVE_HOLE)
    assert len(sieved) * 50 < len(plain)
    assert all(n <= grid.SIEVE_HOLE for r in sieved for m, n in zip(r[1], r[2]) if m < 0)


def test_default_chunks_are_one_to_four_mib():
    for shape, isz in [((8000, 8000), 8), ((100000, 10), 8), ((300, 300, 300), 16),
                       ((7, 1 << 22), 1), ((123457,), 4)]:
        ch = chunks.default_chunks(shape, isz)
        nb = math.prod(ch) * isz
        assert nb <= chunks.CHUNK_MAX
        assert nb >= chunks.CHUNK_MIN or nb == math.prod(shape) * isz
    assert chunks.default_chunks((8000, 8000), 8) == (500, 1000)
    assert chunks.default_chunks((10, 10), 8) == (10, 10)


@pytest.mark.parametrize("shape,req", [((1000, 800), (1, None)), ((1000, 800), (None, 1)),
                                       ((1000, 800), (100, 80)), ((1000, 800), (5000, 5000)),
                                       ((60, 70, 80), (2, 70, 80)), ((60, 70, 80), (60, 7, 1))])
def test_hinted_chunks_make_the_request_contiguous(shape, req):
    isz = 8
    ch = chunks.hinted_chunks(shape, isz, req)
    lay = grid.Layout(shape, ch, isz)
    rshape = tuple(min(n if r is None else r, n) for r, n in zip(req, shape))
    region = tuple(slice(0, r) for r in rshape)
    out = np.empty(rshape)
    runs = lay.runs(region, out.strides)
    assert len(runs) == 1 or len({r[0] for r in runs}) == len(runs) and all(
        a[0] + sum(a[2]) == b[0] for a, b in zip(runs[:-1], runs[1:]))
    if math.prod(shape) * isz >= chunks.CHUNK_MIN:
        assert math.prod(ch) * isz >= min(chunks.CHUNK_MIN, math.prod(rshape) * isz)


def test_split_covers_the_region_once():
    lay = grid.Layout((1000, 900), (128, 100), 8)
    region = (slice(3, 997), slice(50, 890))
    for within in (True, False):
        for task in (1 << 16, 1 << 20, 1 << 30):
            seen = np.zeros((1000, 900), np.int8)
            subs = lay.split(region, task, within)
            for s in subs:
                seen[s] += 1
            assert (seen[region] == 1).all() and seen.sum() == 994 * 840
    # one huge chunk: cut inside it only when the store is byte-addressable
    lay = grid.Layout((4000, 4000), (4000, 4000), 8)
    whole = grid.full_region((4000, 4000))
    assert len(lay.split(whole, 4 << 20, True)) >= 16
    assert len(lay.split(whole, 4 << 20, False)) == 1


def test_block_bounds_share_everything():
    for n, parts, unit in [(10, 3, 1), (10, 4, 3), (2, 4, 1), (0, 3, 1), (100, 7, 16)]:
        got = [grid.block_bounds(n, parts, i, unit) for i in range(parts)]
        assert got[0][0] == 0 and got[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(got[:-1], got[1:]))
        assert all(lo % unit == 0 or lo == n for lo, _ in got)
