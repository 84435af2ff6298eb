"""The backend contract as the user layer sees it: capabilities found once at open, clear
errors for what a backend cannot hold, and scratch objects removed by their backend."""
import os
import shutil
import warnings

import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.scratch import jobs
from chemio_py.errors import BackendUnavailableError


class _Places:
    """Where files go and how they go away: the local backend's."""

    def __init__(self):
        self._local = backends.resolve("local")

    def root(self, scope, rank=0):
        return self._local.root(scope, rank)

    def stat(self, path):
        return self._local.stat(path)

    def exists(self, path):
        return self._local.exists(path)

    def remove(self, path):
        return self._local.remove(path)


class _ArraysOnly(_Places):
    def open_array(self, path, mode, **kw):
        return self._local.open_array(path, mode, **kw)


class _BytesOnly(_Places):
    def open_bytes(self, path, mode, **kw):
        return self._local.open_bytes(path, mode, **kw)


@pytest.fixture
def registered():
    names = []

    def add(name, factory):
        backends.register(name, factory)
        names.append(name)
    yield add
    for n in names:
        backends.unregister(n)


def test_a_backend_without_byte_files_is_a_clear_error(registered):
    registered("arraysonly", _ArraysOnly)
    for make in (lambda: cio.ExclusiveFile("x", "w+", backend="arraysonly"),
                 lambda: cio.SharedFile("x", backend="arraysonly")):
        with pytest.raises(BackendUnavailableError, match="cannot hold byte files") as ei:
            make()
        assert "local" in str(ei.value)                # names backends that can
    with cio.DiskArray.create("ok", (4,), "f8", backend="arraysonly") as d:
        d[:] = 1.0
        assert d[:].sum() == 4.0


def test_a_backend_without_arrays_is_a_clear_error(registered):
    registered("bytesonly", _BytesOnly)
    with pytest.raises(BackendUnavailableError, match="cannot hold DiskArrays"):
        cio.DiskArray.create("x", (4,), "f8", backend="bytesonly")
    with cio.ExclusiveFile("ok", "w+", backend="bytesonly") as f:
        f.write(0, b"abc")
        assert f.read_bytes(0, 3) == b"abc"
        f.delete()


def test_capabilities_are_found_once_at_open():
    with cio.ExclusiveFile("caps", "w+") as f:
        caps = backends.capabilities(f.store)
        assert caps.native_read is not None and caps.read_nowait is not None
        f.delete()
    with cio.DiskArray.create("caps", (8, 8), "f8") as d:
        caps = d._caps
        assert caps.byte_addressable and caps.read_cached is not None
        assert caps.write_streams == 2 and not caps.collective
    with cio.DiskArray.create("caps", (8, 8), "f8", backend="shm") as d:
        assert d._caps.read_cached is None and not d._caps.collective


def test_cleanup_removes_directories_through_the_backend_and_goes_on_after_a_failure():
    jd = jobs.job_dir(jobs.private_root(0))
    tree = os.path.join(jd, "store.zarr")
    os.makedirs(os.path.join(tree, "c", "0"))
    with open(os.path.join(tree, "c", "0", "0"), "wb") as fh:
        fh.write(b"chunk")
    jobs.own(tree, backends.resolve("local").remove)
    bad = os.path.join(jd, "stubborn")
    open(bad, "wb").close()

    def refuse(path):
        raise PermissionError(13, "refused", path)
    jobs.own(bad, refuse)
    plain = os.path.join(jd, "plain")
    open(plain, "wb").close()
    jobs.own(plain)
    with pytest.warns(RuntimeWarning, match="could not remove 1 scratch object"):
        jobs.cleanup()
    assert not os.path.exists(tree) and not os.path.exists(plain)
    assert os.path.exists(bad)
    shutil.rmtree(jd)                                    # what `chemio clean` would do
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jobs.cleanup()


def test_formats_belong_to_the_store(tmp_path, registered):
    import json
    d = cio.DiskArray.create("fmt", (8, 8), "f8", path=tmp_path)
    d[:] = 2.0
    d.close()
    doc = json.loads(open(d.meta_path).read())
    assert doc["layout"] == "grid"                       # the raw grid keeps its name
    doc["layout"] = "zarr3"
    open(d.meta_path, "w").write(json.dumps(doc))
    with pytest.raises(cio.MetadataError, match="format 'zarr3'.*backend 'local' cannot read"):
        cio.DiskArray.open(d.path)

    class _Zarrish(_ArraysOnly):
        array_formats = ("zarr3", "grid")
    registered("zarrish", _Zarrish)
    with pytest.raises(cio.MetadataError, match="one of \\['zarrish'\\]"):
        cio.DiskArray.open(d.path)
    e = cio.DiskArray.open(d.path, backend="zarrish")    # a backend that reads it opens it
    assert e[:].sum() == 2.0 * 64
    e.close()
    doc["layout"] = "../../etc"
    open(d.meta_path, "w").write(json.dumps(doc))
    with pytest.raises(cio.MetadataError, match="not a format name"):
        cio.DiskArray.open(d.path)
    os.unlink(d.meta_path)
    os.unlink(d.path)
