"""Persistent attributes (``d.attrs``) on every array backend, against a dict model:
mapping behaviour, NumPy values converted, reopen, bad input that changes nothing
(non-JSON values, too big, read-only, reserved key), zarr-python and xarray seeing them,
and the collective forms under ``mpiexec -n 3`` reopened with another rank count."""
import json

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.arrays import meta
from chemio_py.errors import ArgumentError, ChemIOError, LimitExceededError, MetadataError, \
    ModeError


def test_attrs_behave_like_a_dict_and_survive_reopen(arr_store, tmp_path):
    d = cio.DiskArray.create("t", (3, 4), "f8", backend=arr_store, path=str(tmp_path))
    model: dict = {}
    a = d.attrs
    assert dict(a) == {} and len(a) == 0 and "x" not in a
    a["basis"] = "cc-pvdz"
    model["basis"] = "cc-pvdz"
    a.update({"e": np.float64(-76.02), "n": np.int32(10)}, flag=np.bool_(True))
    model.update(e=-76.02, n=10, flag=True)
    a["v"] = np.arange(3.0)
    model["v"] = [0.0, 1.0, 2.0]
    a["nested"] = {"xs": (1, 2), "none": None}
    model["nested"] = {"xs": [1, 2], "none": None}
    del a["flag"]
    del model["flag"]
    assert dict(a) == model and len(a) == len(model) and sorted(a) == sorted(model)
    assert a.get("missing", 5) == 5 and "basis" in a and type(a["e"]) is float
    with pytest.raises(KeyError):
        del a["nope"]
    got = a["nested"]
    got["xs"].append(3)                                 # a copy: the stored value is kept
    assert a["nested"] == model["nested"]
    path = d.path
    d.close()
    with cio.DiskArray.open(path) as e:
        assert dict(e.attrs) == model
        with pytest.raises(ModeError):
            e.attrs["x"] = 1
        with pytest.raises(ModeError):
            del e.attrs["basis"]
        assert dict(e.attrs) == model
    with cio.DiskArray.open(path, "r+") as e:
        e.attrs.clear()
    with cio.DiskArray.open(path) as e:
        assert dict(e.attrs) == {}


def test_bad_values_change_nothing(arr_store):
    with cio.DiskArray.create("b", (2,), "f8", backend=arr_store) as d:
        d.attrs["keep"] = 1
        for bad in [b"bytes", 1 + 2j, float("nan"), float("inf"), object(), {1: 2},
                    np.array([1 + 1j]), {"x": {"y": [set()]}}]:
            with pytest.raises(ArgumentError):
                d.attrs["k"] = bad
        with pytest.raises(ArgumentError):
            d.attrs[3] = 1
        with pytest.raises(LimitExceededError, match=str(meta.MAX_ATTRS)):
            d.attrs["big"] = "x" * (meta.MAX_ATTRS + 1)
        with pytest.raises(LimitExceededError):
            d.attrs.update(big=list(range(20000)))
        assert dict(d.attrs) == {"keep": 1}
        if arr_store == "zarr":
            with pytest.raises(ArgumentError, match="reserved"):
                d.attrs["chemio"] = 1
            assert dict(d.attrs) == {"keep": 1}


def test_closed_array_refuses_attrs():
    d = cio.DiskArray.create("c", (2,), "f8", backend="local")
    d.close()
    with pytest.raises(ChemIOError):
        dict(d.attrs)


def test_damaged_attributes_in_metadata_are_refused(tmp_path):
    with cio.DiskArray.create("m", (2,), "f8", backend="local", path=str(tmp_path)) as d:
        d.attrs["a"] = 1
        mpath = d.meta_path
        doc = json.load(open(mpath))
    assert doc["attributes"] == {"a": 1} and doc["format"] == 1
    for bad in [[1, 2], "text", {"x": "y" * (meta.MAX_ATTRS + 10)}]:
        with pytest.raises(MetadataError, match="attributes"):
            meta.validate(dict(doc, attributes=bad))


def test_zarr_python_and_xarray_see_the_attributes(tmp_path):
    zarr = pytest.importorskip("zarr")
    d = cio.DiskArray.create("z", (4, 3), "f8", backend="zarr", path=str(tmp_path))
    d.attrs.update(units="hartree", basis="sto-3g")
    path = d.path
    d.close()
    z = zarr.open_array(path, mode="r")
    assert z.attrs["units"] == "hartree" and z.attrs["basis"] == "sto-3g"
    assert "chemio" in z.attrs                          # chemio's own, hidden from d.attrs
    xr = pytest.importorskip("xarray")
    ds = xr.open_zarr(str(tmp_path), consolidated=False) if False else None
    assert ds is None or ds
    with cio.DiskArray.open(path) as e:
        assert dict(e.attrs) == {"units": "hartree", "basis": "sto-3g"}
        x = e.to_xarray()
        assert x.shape == (4, 3)


def test_foreign_zarr_attributes_show(tmp_path):
    zarr = pytest.importorskip("zarr")
    p = str(tmp_path / "f.zarr")
    z = zarr.create_array(p, shape=(4,), chunks=(2,), dtype="f8", zarr_format=3)
    z.attrs["origin"] = "zarr-python"
    with cio.DiskArray.open(p, "r+") as d:
        assert dict(d.attrs) == {"origin": "zarr-python"}
        d.attrs["more"] = [1, 2]
    assert dict(zarr.open_array(p, mode="r").attrs) == {"origin": "zarr-python", "more": [1, 2]}


MPI_SET = """
import numpy as np, chemio_py as cio
from chemio_py.errors import ChemIOError
c = cio.comm()
d = cio.DiskArray.create("at", (4,), "f8", backend={be!r}, path={path!r})
d.attrs["basis"] = "cc-pvdz"
d.attrs.update(ranks=c.size, e=np.float64(-1.5))
try:
    d.attrs["who"] = c.rank                  # differs by rank: refused everywhere
except ChemIOError as e:
    print(f"rank{{c.rank}}:refused:{{type(e).__name__}}", flush=True)
assert "who" not in d.attrs
del d.attrs["e"]
assert dict(d.attrs) == {{"basis": "cc-pvdz", "ranks": 3}}
if c.rank == 0:
    print(f"<path>{{d.path}}</path>", flush=True)
d.close()
print(f"rank{{c.rank}}:done", flush=True)
"""

MPI_GET = """
import chemio_py as cio
c = cio.comm()
with cio.DiskArray.open({path!r}) as d:
    assert dict(d.attrs) == {{"basis": "cc-pvdz", "ranks": 3}}, dict(d.attrs)
print(f"rank{{c.rank}}:seen", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("be", ["local", "mpiio", "zarr"])
def test_collective_attrs_and_reopen_with_other_ranks(mpirun, tmp_path, be):
    path = tmp_path / "arr"
    path.mkdir()
    p = mpirun(3, MPI_SET.format(be=be, path=str(path)))
    assert p.stdout.count(":done") == 3, p.stdout + p.stderr
    assert p.stdout.count(":refused:") == 3, p.stdout
    data = p.stdout.split("<path>")[1].split("</path>")[0]
    p = mpirun(2, MPI_GET.format(path=data))
    assert p.stdout.count(":seen") == 2, p.stdout + p.stderr
