"""Growth of DiskArrays (``maxshape``, ``resize``, ``append``) on every array backend,
against a NumPy model: values kept inside both shapes, zeros where an array grew back,
reopen, bad input that changes nothing, zarr-python reading a resized array, and the
collective forms under ``mpiexec -n 3`` reopened with another rank count."""
import json
import os

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends import grid
from chemio_py.errors import ArgumentError, MetadataError, ModeError, SectionError


def _resize_model(ref: np.ndarray, new: tuple) -> np.ndarray:
    out = np.zeros(new, ref.dtype)
    keep = tuple(slice(0, min(a, b)) for a, b in zip(ref.shape, new))
    out[keep] = ref[keep]
    return out


def _maxshape(be: str) -> tuple:
    return (None, 13) if be != "zarr" else (None, None)


def test_resize_keeps_values_and_regrowth_reads_zero(arr_store):
    rng = np.random.default_rng(1)
    d = cio.DiskArray.create("g", (5, 7), "f8", maxshape=_maxshape(arr_store), chunks=(2, 3),
                             backend=arr_store)
    try:
        assert d.maxshape == _maxshape(arr_store)
        ref = rng.random((5, 7))
        d[:] = ref
        for new in [(9, 10), (3, 4), (3, 4), (8, 12), (0, 12), (6, 13), (7, 1), (11, 13)]:
            d.resize(new)
            ref = _resize_model(ref, new)
            assert d.shape == new and len(d) == new[0]
            assert np.array_equal(d[...], ref), (arr_store, new)
            if d.size:
                block = rng.random(new)
                d[...] = block
                ref = block
        d.resize(4, axis=0)                      # h5py's form
        ref = _resize_model(ref, (4, 13))
        assert np.array_equal(d[...], ref)
    finally:
        d.close()


def test_append_grows_and_writes(arr_store):
    d = cio.DiskArray.create("a", (0, 6), "i8", maxshape=(None, 6), chunks=(4, 6),
                             backend=arr_store)
    try:
        rows = []
        for k in range(7):
            v = np.arange(6) + 10 * k
            assert d.append(v) == (k + 1, 6)            # one slice (ndim - 1)
            rows.append(v)
        assert d.append(np.ones((3, 6), "i4")) == (10, 6)   # a block, cast same-kind
        ref = np.vstack(rows + [np.ones((3, 6), "i8")])
        assert np.array_equal(d[...], ref)
    finally:
        d.close()


def test_append_along_axis_1_with_finite_maxshape(arr_store):
    d = cio.DiskArray.create("b", (3, 2), "f4", maxshape=(3, 9), chunks=(2, 2),
                             backend=arr_store)
    try:
        d[...] = 1
        d.append(np.full((3, 4), 2.0), axis=1)
        ref = np.hstack([np.ones((3, 2)), np.full((3, 4), 2.0)]).astype("f4")
        assert d.shape == (3, 6) and np.array_equal(d[...], ref)
        with pytest.raises(ArgumentError, match="beyond its maxshape"):
            d.append(np.zeros((3, 4)), axis=1)
        assert d.shape == (3, 6) and np.array_equal(d[...], ref)
    finally:
        d.close()


def test_persistent_resize_survives_reopen(arr_store, tmp_path):
    d = cio.DiskArray.create("p", (4, 5), "f8", maxshape=(None, 5), chunks=(3, 2),
                             backend=arr_store, path=str(tmp_path))
    path = d.path
    d[...] = np.arange(20.0).reshape(4, 5)
    d.resize((10, 5))
    d[8:10] = 7.0
    d.close()
    ref = np.zeros((10, 5))
    ref[:4] = np.arange(20.0).reshape(4, 5)
    ref[8:] = 7.0
    with cio.DiskArray.open(path, "r+") as e:
        assert e.shape == (10, 5) and e.maxshape == (None, 5)
        assert np.array_equal(e[...], ref)
        e.resize((2, 5))
    with cio.DiskArray.open(path) as e:
        assert np.array_equal(e[...], ref[:2])
        with pytest.raises(ModeError):
            e.resize((3, 5))
        with pytest.raises(ModeError):
            e.append(np.zeros(5))
        assert e.shape == (2, 5)


@pytest.mark.parametrize("new", [(9, 5), (2, 5)], ids=["grow", "shrink"])
def test_failed_metadata_write_leaves_the_array_as_it_was(arr_store, tmp_path, new):
    """A metadata write that fails (here: a directory stands where the metadata file is
    replaced) leaves shape, values and the stored object as they were: a growth is taken
    back from the store, a shrink never reaches it."""
    if arr_store == "zarr":
        pytest.skip("zarr keeps its shape in its own zarr.json, written by the store")
    d = cio.DiskArray.create("m", (4, 5), "f8", maxshape=(None, 5), chunks=(3, 2),
                             backend=arr_store, path=str(tmp_path))
    ref = np.arange(20.0).reshape(4, 5)
    d[...] = ref
    d.flush()
    saved = open(d.meta_path, "rb").read()
    size = os.path.getsize(d.path) if os.path.isfile(d.path) else None
    os.unlink(d.meta_path)
    os.mkdir(d.meta_path)
    open(os.path.join(d.meta_path, "x"), "w").close()   # os.replace cannot replace it
    with pytest.raises(OSError):
        d.resize(new)
    assert d.shape == (4, 5)
    assert np.array_equal(d[...], ref)
    if size is not None:
        assert os.path.getsize(d.path) == size
    os.unlink(os.path.join(d.meta_path, "x"))
    os.rmdir(d.meta_path)
    with open(d.meta_path, "wb") as f:
        f.write(saved)
    d.resize((6, 5))                        # the array still grows once the path is sane
    path = d.path
    d.close()
    with cio.DiskArray.open(path) as e:
        assert e.shape == (6, 5)
        assert np.array_equal(e[...], _resize_model(ref, (6, 5)))


def test_fixed_arrays_refuse_and_bad_input_changes_nothing(arr_store):
    with cio.DiskArray.create("f", (4, 4), "f8", backend=arr_store) as d:
        assert d.maxshape == (4, 4)
        d.resize((4, 4))                                 # the same shape: nothing to do
        with pytest.raises(ArgumentError, match="fixed shape"):
            d.resize((5, 4))
    with cio.DiskArray.create("h", (4, 4), "f8", maxshape=(8, 6), backend=arr_store) as d:
        d[...] = 3.0
        for bad, err in [((9, 4), "beyond its maxshape"), ((4, 7), "beyond its maxshape"),
                         ((-1, 4), "negative"), ((4,), "axes"), ((4, 4, 1), "axes"),
                         ((4.5, 4), "not an int")]:
            with pytest.raises(ArgumentError, match=err):
                d.resize(bad)
        with pytest.raises(ArgumentError):
            d.resize(-2, axis=0)
        with pytest.raises(ArgumentError, match="out of range"):
            d.resize(3, axis=2)
        with pytest.raises(SectionError, match="differs on axis 1"):
            d.append(np.zeros((1, 3)))
        with pytest.raises(SectionError, match="axes"):
            d.append(np.zeros((1, 4, 1)))
        with pytest.raises(ArgumentError, match="dtype"):
            d.append(np.zeros((1, 4), complex))
        assert d.shape == (4, 4) and np.array_equal(d[...], np.full((4, 4), 3.0))


def test_create_refuses_bad_maxshape(arr_store):
    for bad, err in [((3, 4), "smaller than shape"), ((None,), "entries"),
                     (("x", 4), "neither an int"), ((True, 4), "bool")]:
        with pytest.raises(ArgumentError, match=err):
            cio.DiskArray.create("m", (4, 4), "f8", maxshape=bad, backend=arr_store)
    if arr_store != "zarr":
        with pytest.raises(ArgumentError, match="only axis 0"):
            cio.DiskArray.create("m", (4, 4), "f8", maxshape=(4, None), backend=arr_store)
    else:
        with cio.DiskArray.create("m", (4, 4), "f8", maxshape=(4, None), chunks=(2, 2),
                                  backend=arr_store) as d:
            d.resize((4, 9))
            d[:, 8] = 1.0
            assert d[:, :].sum() == 4.0


def test_checksum_and_maxshape_are_refused_together():
    with pytest.raises(ArgumentError, match="checksum"):
        cio.DiskArray.create("c", (4,), "f8", maxshape=(None,), checksum=True, backend="local")


def test_grid_layout_never_moves_chunks():
    """Growing axis 0 or a finite other axis keeps every chunk's offset."""
    chunks, ms = (3, 4), (None, 10)
    for old, new in [((5, 6), (11, 6)), ((5, 6), (5, 10)), ((1, 1), (30, 7))]:
        a = grid.Layout(grid.capacity(old, chunks, ms), chunks, 8)
        b = grid.Layout(grid.capacity(new, chunks, ms), chunks, 8)
        for i in range(grid.ceil_div(old[0], 3)):
            for j in range(grid.ceil_div(old[1], 4)):
                assert a.chunk_offset((i, j)) == b.chunk_offset((i, j))


def test_growable_grid_metadata_is_format_3(tmp_path):
    with cio.DiskArray.create("v", (2, 3), "f8", maxshape=(None, 3), backend="local",
                              path=str(tmp_path)) as d:
        doc = json.load(open(d.meta_path))
    assert doc["format"] == 3 and doc["maxshape"] == [None, 3]
    from chemio_py.arrays import meta
    bad = dict(doc, maxshape=[None, None])
    with pytest.raises(MetadataError, match="unlimited"):
        meta.validate(bad)
    with pytest.raises(MetadataError, match="needs 'maxshape'"):
        meta.validate({k: v for k, v in doc.items() if k != "maxshape"})
    with pytest.raises(MetadataError, match="format 3"):
        meta.validate(dict(doc, format=1))


def test_zarr_python_reads_the_resized_array(tmp_path):
    zarr = pytest.importorskip("zarr")
    d = cio.DiskArray.create("z", (3, 4), "f8", maxshape=(None, 8), chunks=(2, 2),
                             backend="zarr", path=str(tmp_path))
    d[...] = np.arange(12.0).reshape(3, 4)
    d.resize((5, 8))
    d[4, :] = 9.0
    d.resize((5, 6))
    d.attrs["units"] = "hartree"
    path = d.path
    d.close()
    ref = np.zeros((5, 6))
    ref[:3, :4] = np.arange(12.0).reshape(3, 4)
    ref[4] = 9.0
    z = zarr.open_array(path, mode="r")
    assert z.shape == (5, 6)
    assert np.array_equal(z[...], ref)
    assert dict(z.attrs) == {"units": "hartree"} | {"chemio": z.attrs["chemio"]}
    assert not any(n.startswith("3") for n in os.listdir(os.path.join(path, "c", "0")))


MPI_GROW = """
import numpy as np, chemio_py as cio
from chemio_py.errors import ChemIOError
c = cio.comm()
d = cio.DiskArray.create("grow", (0, 5), "f8", maxshape=(None, 5), chunks=(2, 5),
                         backend={be!r}, path={path!r})
for k in range(7):
    d.append(np.full(5, float(k)))
assert d.shape == (7, 5), d.shape
d.resize((10, 5))
sec = cio.block_section(d.shape)
d.write_all((slice(7, 10), slice(0, 5)) if c.rank == 0 else (slice(0, 0), slice(0, 5)),
            np.full((3, 5), 99.0) if c.rank == 0 else np.zeros((0, 5)))
try:
    d.resize((12 + c.rank, 5))
except ChemIOError as e:
    print(f"rank{{c.rank}}:mismatch:{{type(e).__name__}}", flush=True)
assert d.shape == (10, 5)
try:
    d.append(np.full(5, float(c.rank)))
except ChemIOError as e:
    print(f"rank{{c.rank}}:datamismatch:{{type(e).__name__}}", flush=True)
assert d.shape == (10, 5)
d.attrs["basis"] = "cc-pvdz"
d.attrs.update(n=c.size)
if c.rank == 0:
    print(f"<path>{{d.path}}</path>", flush=True)
d.close()
print(f"rank{{c.rank}}:done", flush=True)
"""

MPI_CHECK = """
import numpy as np, chemio_py as cio
c = cio.comm()
d = cio.DiskArray.open({path!r}, "r+")
ref = np.vstack([np.full((1, 5), float(k)) for k in range(7)] + [np.full((3, 5), 99.0)])
assert d.shape == (10, 5) and np.array_equal(d.read_all(()), ref)
assert dict(d.attrs) == {{"basis": "cc-pvdz", "n": 3}}, dict(d.attrs)
d.resize((4, 5))
d.append(np.arange(5.0))
assert np.array_equal(d.read_all(()), np.vstack([ref[:4], np.arange(5.0)[None]]))
del d.attrs["n"]
assert dict(d.attrs) == {{"basis": "cc-pvdz"}}
d.close()
print(f"rank{{c.rank}}:checked", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("be", ["local", "shm", "mpiio", "zarr"])
def test_collective_resize_append_and_reopen_with_other_ranks(mpirun, tmp_path, be):
    if be == "shm":
        pytest.skip("an shm array does not outlive its job; its collective forms run "
                    "in test_collective_scratch_shm")
    path = str(tmp_path / "arr")
    os.makedirs(path)
    p = mpirun(3, MPI_GROW.format(be=be, path=path))
    out = p.stdout
    assert out.count(":done") == 3, out + p.stderr
    assert out.count(":mismatch:") == 3 and out.count(":datamismatch:") == 3, out
    data = out.split("<path>")[1].split("</path>")[0]
    p = mpirun(2, MPI_CHECK.format(path=data))
    assert p.stdout.count(":checked") == 2, p.stdout + p.stderr


MPI_SHM = """
import numpy as np, chemio_py as cio
c = cio.comm()
d = cio.DiskArray.create("gs", (2, 3), "i8", maxshape=(None, 4), chunks=(2, 2), backend="shm")
d.append(np.arange(3))
d.resize((5, 4))
d.attrs["k"] = 1
ref = np.zeros((5, 4), "i8"); ref[2, :3] = np.arange(3)
assert np.array_equal(d.read_all(()), ref) and dict(d.attrs) == {{"k": 1}}
d.resize((1, 2))
d.resize((6, 4))
assert np.array_equal(d.read_all(()), np.zeros((6, 4), "i8"))
d.close()
print(f"rank{{c.rank}}:ok", flush=True)
"""


@pytest.mark.mpi
def test_collective_scratch_shm(mpirun):
    p = mpirun(3, MPI_SHM.format())
    assert p.stdout.count(":ok") == 3, p.stdout + p.stderr
