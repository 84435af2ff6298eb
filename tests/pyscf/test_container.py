"""``cio.H5TmpFile``/``cio.Group`` against h5py: the same operations on an ``h5py.File``
(the independent model) and on the chemio container give the same names, shapes, dtypes,
values and attributes, on ``local``, ``shm`` and ``auto``; persistent files reopen;
scratch files vanish on close and when dropped; under ``mpiexec`` each rank's file is its
own.
"""
from __future__ import annotations

import gc
import json
import os
import warnings

import h5py
import numpy as np
import pytest

import chemio_py as cio
from chemio_py.errors import ArgumentError, MetadataError, ModeError, NotFoundError

BACKENDS = ["local", "shm", "auto"]


def _same(a, b):
    """Values equal as h5py gives them (chemio keeps JSON: lists for arrays)."""
    return np.array_equal(np.asarray(a), np.asarray(b))


def _apply(f):
    """The operations, as PySCF and h5py users write them."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal((13, 9))
    f.create_dataset("plain", (13, 9), "f8", chunks=(4, 9))
    f["plain"][2:7] = base[2:7]
    f["plain"][:, 3] = np.arange(13.0)
    f["plain"][[0, 5, 12], 1] = -1.0
    f.create_dataset("eri/ovov", data=base, chunks=(5, 9), compression="gzip",
                     compression_opts=4, shuffle=True, fletcher32=True, track_times=False)
    f.create_dataset("ints", 10, "i4", fillvalue=7)
    f["ints"][3:5] = [1, 2]
    with warnings.catch_warnings():                    # h5py deprecates its default
        warnings.simplefilter("ignore")
        f.create_dataset("single", (4, 4))             # h5py's default dtype: f4
    f["direct"] = np.arange(24.0).reshape(4, 6)        # creates a dataset
    f.create_dataset("grow", data=np.ones((2, 5)), maxshape=(None, 5), chunks=(1, 5),
                     fillvalue=3.0)
    f["grow"].resize((5, 5))
    f["grow"][4] = 9.0
    g = f.create_group("a/b")
    g.create_dataset("c", data=np.arange(6, dtype="i8"), scaleoffset=None)
    f.require_group("a").require_group("z")
    f.require_dataset("a/b/c", (6,), "i8")
    f.require_dataset("a/new", (3, 2), "c16")
    f["a/new"][1] = [1 + 2j, 3 - 1j]
    f.attrs["basis"] = "sto-3g"
    f.attrs["energies"] = [-76.0, -75.5]
    f["a"].attrs["n"] = 3
    f["plain"].attrs["kind"] = "eri"
    del f["single"]
    out = np.zeros((6, 9))
    f["eri/ovov"].read_direct(out, np.s_[3:6], np.s_[1:4])
    f["eri/ovov"].read_direct(out, np.s_[7, :], np.s_[5])
    f["plain"].write_direct(np.full((3, 9), 5.0), np.s_[0:2], np.s_[10:12])
    return out


READS = [np.s_[...], np.s_[3], np.s_[1:11:3], np.s_[-4:], np.s_[[1, 4, 8], 2:7],
         np.s_[2, 1:8:2], np.s_[:, [0, 3]], np.s_[np.arange(13) % 3 == 0]]


def _tree(f) -> dict:
    """Everything readable: name -> (kind, shape, dtype, values, attrs)."""
    out = {}

    def walk(g):
        for k in g:
            v = g[k]
            if isinstance(v, (h5py.Group, cio.Group)):
                out[v.name] = ("group", {a: np.asarray(v.attrs[a]).tolist() for a in v.attrs})
                walk(v)
            else:
                out[v.name] = ("dataset", v.shape, np.dtype(v.dtype).str, np.asarray(v[...]),
                               v.ndim, v.size, len(v) if v.ndim else None,
                               {a: np.asarray(v.attrs[a]).tolist() for a in v.attrs})
    walk(f)
    out["/"] = ("group", {a: np.asarray(f.attrs[a]).tolist() for a in f.attrs})
    return out


def _compare(t1: dict, t2: dict):
    assert sorted(t1) == sorted(t2)
    for k in t1:
        a, b = t1[k], t2[k]
        assert a[0] == b[0], k
        if a[0] == "group":
            assert a[1] == b[1], k
        else:
            assert a[1:3] == b[1:3], k
            assert np.array_equal(a[3], b[3]), k
            assert a[4:] == b[4:], k


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_operations_as_h5py(tmp_path, backend):
    with h5py.File(tmp_path / "model.h5", "w") as model, \
            cio.H5TmpFile(backend=backend) as ftmp:
        out_m = _apply(model)
        out_c = _apply(ftmp)
        assert np.array_equal(out_m, out_c)
        _compare(_tree(model), _tree(ftmp))
        assert list(model) == list(ftmp) and list(model["a"]) == list(ftmp["a"])
        assert len(model) == len(ftmp)
        for name in ("plain", "eri/ovov"):
            for key in READS:
                assert np.array_equal(model[name][key], ftmp[name][key]), (name, key)
        for path in ("a", "a/b", "/a/b/c", "eri/ovov", "nothing", "a/nothing", "a/b/c/d"):
            assert (path in model) == (path in ftmp), path
        assert ftmp.name == model.name == "/"
        assert ftmp["a/b"].name == model["a/b"].name == "/a/b"
        assert ftmp["a"]["b/c"].name == "/a/b/c"
        assert ftmp["a/b"].parent.name == "/a" and ftmp["a/b/c"].parent.name == "/a/b"
        assert ftmp["a/b"].file is ftmp
        d = ftmp["plain"]
        assert isinstance(d, cio.DiskArray) and d.backend == backend
        assert d.chunks == (4, 9) and model["plain"].chunks == (4, 9)
        assert np.array_equal(np.asarray(d), model["plain"][()])
        assert ftmp["grow"].maxshape == model["grow"].maxshape == (None, 5)
        assert ftmp["grow"].fillvalue == model["grow"].fillvalue == 3.0
        assert ftmp["eri/ovov"].checksum == (backend in ("local", "shm", "auto"))
        assert ftmp.get("nothing") is None and model.get("nothing") is None
        assert ftmp.get("a/b/c").name == "/a/b/c"
        keys = list(ftmp.keys())
        assert [v.name for v in ftmp.values()] == [f"/{k}" for k in keys]
        assert [k for k, _ in ftmp.items()] == keys
        # the stats of DiskArrays count what went through
        assert d.stats.bytes_written > 0


def test_errors_as_h5py_and_nothing_changed():
    with cio.H5TmpFile(backend="shm") as ftmp:
        ftmp.create_dataset("x", (3,), "f8")
        with pytest.raises(KeyError):
            ftmp["nope"]
        with pytest.raises(NotFoundError, match="no object 'nope'"):
            ftmp["nope"]
        with pytest.raises(ValueError, match="already exists"):
            ftmp.create_dataset("x", (3,), "f8")
        with pytest.raises(ValueError, match="already exists"):
            ftmp.create_group("x")
        with pytest.raises(ArgumentError, match="neither h5py"):
            ftmp.create_dataset("y", (3,), "f8", bogus=1)
        with pytest.raises(ArgumentError, match="shape"):
            ftmp.require_dataset("x", (4,), "f8")
        with pytest.raises(ArgumentError, match="dtype"):
            ftmp.require_dataset("x", (3,), "i4", exact=True)
        with pytest.raises(ArgumentError, match="give shape"):
            ftmp.create_dataset("y")
        with pytest.raises(ArgumentError, match="links"):
            ftmp["z"] = ftmp["x"]
        with pytest.raises(ArgumentError, match=r"'\.\.'"):
            ftmp["a/../x"]
        with pytest.raises(KeyError):
            del ftmp["nope"]
        with pytest.raises(ArgumentError, match="is a dataset"):
            ftmp.create_dataset("x/y", (2,), "f8")
        assert list(ftmp) == ["x"]
    with pytest.raises(cio.ChemIOError, match="closed"):
        ftmp["x"]
    with pytest.raises(cio.ChemIOError, match="closed"):
        ftmp.attrs["a"] = 1


def test_names_that_are_not_file_names():
    from chemio_py.arrays.container import escape, unescape
    names = ["eri_mo", "0", "(0, 1)", "a.b", "..", "é+x", " ", "-", "x y/"[:3]]
    for n in names:
        e = escape(n)
        assert set(e) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-+")
        assert unescape(e) == n
    assert unescape("a.b") is None and unescape("+zz") is None and unescape("") is None


def test_scratch_goes_on_close_and_when_dropped(scratch_root):
    ftmp = cio.H5TmpFile(backend="local")
    d = ftmp.create_dataset("x", (100,), "f8")
    d[:] = 1.0
    path = d.path
    assert os.path.exists(path)
    ftmp.close()
    assert not os.path.exists(path) and d.closed
    ftmp.close()                                        # idempotent
    ftmp = cio.H5TmpFile(backend="shm")
    ftmp["a/b"] = np.ones(10)
    path = ftmp["a/b"].path
    assert os.path.exists(path)
    del ftmp
    gc.collect()
    assert not os.path.exists(path)                     # as lib.H5TmpFile deletes its file


def test_scratch_under_dir(tmp_path):
    with cio.H5TmpFile(backend="local", dir=tmp_path) as ftmp:
        d = ftmp.create_dataset("x", data=np.arange(5.0))
        assert d.path.startswith(str(tmp_path))
        assert np.array_equal(d[...], np.arange(5.0))
        path = d.path
    assert not os.path.exists(path)
    # only the job directory's own marker and lease stay (until this process's cleanup)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()
                and not p.name.startswith((".lease", ".chemio-job"))]


@pytest.mark.parametrize("backend", ["local", "zarr"])
def test_persistent_file_reopens(tmp_path, backend):
    if backend == "zarr":
        pytest.importorskip("zarr")
    where = tmp_path / "ints.h5d"
    with h5py.File(tmp_path / "model.h5", "w") as model, \
            cio.H5TmpFile(where, "w", backend=backend) as ftmp:
        _apply(model)
        _apply(ftmp)
        assert ftmp.filename == str(where) and ftmp.persistent
        expected = _tree(model)
    with cio.H5TmpFile(where, "r") as again:
        assert again.mode == "r"
        _compare(expected, _tree(again))
        with pytest.raises(ModeError):
            again.create_dataset("new", (2,), "f8")
        with pytest.raises(ModeError):
            again.attrs["x"] = 1
    with cio.H5TmpFile(where, "a") as again:
        again["more"] = np.arange(3)
        again["a"].attrs["m"] = 1
    with cio.H5TmpFile(where, "r+") as again:
        assert list(again["more"][...]) == [0, 1, 2] and again["a"].attrs["m"] == 1
        del again["a"]
    with cio.H5TmpFile(where, "r") as again:
        assert "a" not in again and "a/b/c" not in again
    with pytest.raises(ArgumentError, match="exists"):
        cio.H5TmpFile(where, "w-")
    with cio.H5TmpFile(where, "w") as again:              # replaced
        assert len(again) == 0
    with pytest.raises(NotFoundError):
        cio.H5TmpFile(tmp_path / "missing", "r")


def test_hostile_group_documents_are_refused(tmp_path):
    where = tmp_path / "f"
    with cio.H5TmpFile(where, "w") as ftmp:
        ftmp.create_group("g")
    doc = where / "g" / ".group.json"
    for bad in (b"[1,2]", b'{"format": "other", "version": 1}',
                b'{"format": "chemio-h5", "version": 1, "attributes": [1]}',
                b'{"format": "chemio-h5", "version": 1, "attributes": {"x": NaN}}',
                b"{" * 100000,
                json.dumps({"format": "chemio-h5", "version": 1,
                            "attributes": {"x": "y" * 200000}}).encode()):
        doc.write_bytes(bad)
        with cio.H5TmpFile(where, "r") as ftmp:
            with pytest.raises(MetadataError):
                ftmp["g"]
    other = tmp_path / "not-ours"
    other.mkdir()
    (other / "data.bin").write_bytes(b"x")
    with pytest.raises(ArgumentError, match="not a chemio H5TmpFile"):
        cio.H5TmpFile(other, "w")
    assert (other / "data.bin").exists()                # nothing changed


def test_attribute_limits_and_values():
    with cio.H5TmpFile(backend="shm") as ftmp:
        ftmp.attrs.update(a=1, b=np.float64(2.5), c=np.arange(3))
        assert dict(ftmp.attrs) == {"a": 1, "b": 2.5, "c": [0, 1, 2]}
        with pytest.raises(ArgumentError):
            ftmp.attrs["bad"] = object()
        with pytest.raises(cio.LimitExceededError):
            ftmp.attrs["big"] = "x" * (1 << 17)
        assert sorted(ftmp.attrs) == ["a", "b", "c"]
        del ftmp.attrs["a"]
        with pytest.raises(KeyError):
            ftmp.attrs["a"]


MPI_BODY = """
import numpy as np, chemio_py as cio
c = cio.comm()
assert c.size == 2
with cio.H5TmpFile(backend="{backend}") as ftmp:
    # a different number of datasets per rank: nothing here may be collective
    for k in range(3 + 4 * c.rank):
        ftmp.create_dataset(f"g/{{k}}", data=np.full((5, 3), 10.0 * c.rank + k))
    ftmp["g/0"].resize  # present, h5py-shaped
    got = [float(ftmp[f"g/{{k}}"][2, 1]) for k in range(len(ftmp["g"]))]
    assert got == [10.0 * c.rank + k for k in range(3 + 4 * c.rank)], got
    paths = [ftmp[f"g/{{k}}"].path for k in range(len(ftmp["g"]))]
print(f"rank{{c.rank}}:ok:{{len(paths)}}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["local", "shm"])
def test_each_rank_has_its_own_file_under_mpiexec(mpirun, backend):
    p = mpirun(2, MPI_BODY.format(backend=backend))
    assert "rank0:ok:3" in p.stdout and "rank1:ok:7" in p.stdout, p.stdout
