"""The backend conformance suite: what every chemio_py backend must do, as pytest tests.

A backend proves itself by subclassing the suite in its own test module (as
``zarr.testing.StoreTests`` is used for zarr stores)::

    from chemio_py.testing import BackendTests

    class TestMyBackend(BackendTests):
        backend = "mine"            # a registered backend name

``BackendTests`` runs the byte contract (``ByteStoreTests``: positioned reads and writes,
short counts at the end, holes, truncate, reserve, modes, hostile paths, disjoint writers
from several threads) and the array contract (``ArrayStoreTests``: regions against a NumPy
model, partial chunks, zero fill, reopen, size checks), then the user API end to end on
the backend (ExclusiveFile, SharedFile, DiskArray, RecordFile) and the removal of what the
backend made, files or directories. A backend that holds only byte files or only arrays
subclasses the one suite it serves. Each optional capability of ``backends.Capabilities``
has a ``test_capability_*`` case, run when ``backends.capabilities(store)`` says the store
offers it and skipped otherwise. ``mpi_ranks`` > 1 also runs a SharedFile and a
DiskArray ``write_all`` under a real ``mpiexec`` (mpi4py and an MPI launcher needed).

Every test works in pytest's ``tmp_path`` (and the job scratch, cleaned by the API) and
leaves nothing behind. Requires pytest; importing it pulls in nothing else.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.errors import ChemIOError, EndOfFileError

__all__ = ["ByteStoreTests", "ArrayStoreTests", "BackendTests"]


class _Base:
    backend: str = ""
    """The registered name of the backend under test (set by the subclass)."""

    def be(self):
        if not self.backend:
            pytest.fail(f"{type(self).__name__} must set backend = '<registered name>'")
        return backends.resolve(self.backend)


class ByteStoreTests(_Base):
    """The ByteStore contract (``backends.ByteStore``) and the byte files on top of it."""

    def open_bytes(self, path, mode):
        return backends.require(self.be(), self.backend, backends.ByteBackend).open_bytes(
            str(path), mode)

    def test_is_a_byte_backend(self):
        assert isinstance(self.be(), backends.ByteBackend)

    def test_positioned_io_against_a_model(self, tmp_path):
        rng = np.random.default_rng(7)
        model = bytearray()
        st = self.open_bytes(tmp_path / "b", "w+")
        try:
            for _ in range(60):
                off = int(rng.integers(0, 1 << 17))
                data = rng.integers(0, 256, int(rng.integers(0, 9000)), dtype=np.uint8)
                assert st.pwrite(off, data) == data.size
                if data.size:
                    if off > len(model):
                        model.extend(bytes(off - len(model)))      # a hole reads as zero
                    model[off:off + data.size] = data.tobytes()
                assert st.size() == len(model)
            out = bytearray(len(model))
            assert st.pread(0, out) == len(model) and out == model
            tail = bytearray(100)
            assert st.pread(max(0, len(model) - 10), tail) == min(10, len(model))  # short
            assert st.pread(len(model) + 5, bytearray(8)) == 0                   # past end
        finally:
            st.close()
            st.close()                                   # idempotent

    def test_truncate_reserve_flush(self, tmp_path):
        st = self.open_bytes(tmp_path / "t", "w+")
        try:
            st.pwrite(0, b"x" * 5000)
            st.truncate(100)
            assert st.size() == 100
            st.truncate(300)
            back = bytearray(300)
            assert st.pread(0, back) == 300 and back == b"x" * 100 + bytes(200)
            st.reserve(1 << 20)
            assert st.size() == 300                      # reserve never changes the size
            st.flush()
        finally:
            st.close()

    def test_modes(self, tmp_path):
        p = tmp_path / "m"
        with pytest.raises(OSError):
            self.open_bytes(p, "r")  # r and r+ need the file
        self.open_bytes(p, "x+").close()
        with pytest.raises(OSError):
            self.open_bytes(p, "x+")  # x+ must not exist
        st = self.open_bytes(p, "w+")
        st.pwrite(0, b"abc")
        st.close()
        st = self.open_bytes(p, "w+")  # w+ replaces
        assert st.size() == 0
        st.close()
        st = self.open_bytes(p, "r")
        with pytest.raises((OSError, ChemIOError)):
            st.pwrite(0, b"no")
        st.close()

    def test_hostile_paths_are_refused_without_hanging(self, tmp_path):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        link = tmp_path / "link"
        os.symlink("/dev/zero", link)
        for p in (fifo, link):
            for mode in ("r", "r+", "w+"):
                try:
                    st = self.open_bytes(p, mode)
                except (OSError, ChemIOError):
                    continue
                st.close()                               # replaced by a regular file: fine
                assert not os.path.islink(p) and not os.path.exists("/dev/zero.x")

    def test_disjoint_writers_in_threads(self, tmp_path):
        st = self.open_bytes(tmp_path / "thr", "w+")
        blk = 64 * 1024
        try:
            def work(k):
                for i in range(8):
                    st.pwrite((i * 8 + k) * blk, np.full(blk, k, np.uint8))
            threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out = np.empty(64 * blk, np.uint8)
            assert st.pread(0, out) == out.size
            assert (out.reshape(64, blk) == (np.arange(64) % 8)[:, None]).all()
        finally:
            st.close()

    def test_exclusive_and_record_files_end_to_end(self):
        model = np.arange(50_000, dtype=np.float64)
        with cio.ExclusiveFile("conf.eaf", "w+", backend=self.backend) as f:
            f.write(8 * 1000, model)
            r = f.aread(8 * 1000, np.empty_like(model))
            assert np.array_equal(r.wait(), model)
            assert f.read_bytes(0, 8) == bytes(8)        # the hole
            with pytest.raises(EndOfFileError):
                f.read(f.size - 4, np.empty(2))
            path = f.path
            f.delete()
        assert not os.path.exists(path)
        with cio.RecordFile("conf.rec", "w+", backend=self.backend) as log:
            for k in range(20):
                log.append(np.arange(k, dtype=np.int32), np.full(k, float(k)))
            got = [(i.tolist(), v.tolist()) for i, v in log.replay()]
            assert got == [(list(range(k)), [float(k)] * k) for k in range(20)]
            log.delete()

    def test_shared_file_serially(self):
        with cio.SharedFile("conf.sf", backend=self.backend, hard_limit=1 << 20) as sf:
            sf.write(4096, b"shared")
            assert sf.read_bytes(4096, 6) == b"shared"
            with pytest.raises(ChemIOError):
                sf.write((1 << 20) - 2, b"past the limit")
            sf.destroy()

    def test_remove_files_and_directories(self, tmp_path):
        be = self.be()
        p = tmp_path / "gone"
        self.open_bytes(p, "w+").close()
        assert be.remove(str(p)) is True and not os.path.lexists(p)
        assert be.remove(str(p)) is False
        tree = tmp_path / "tree"
        (tree / "a" / "b").mkdir(parents=True)
        (tree / "a" / "b" / "c").write_bytes(b"x")
        outside = tmp_path / "outside"
        outside.write_bytes(b"keep")
        os.symlink(outside, tree / "a" / "link")
        assert be.remove(str(tree)) is True and not os.path.lexists(tree)
        assert outside.read_bytes() == b"keep"           # links inside are not followed

    mpi_ranks = 0
    """Ranks for the MPI cases (0: skip them)."""

    def test_shared_file_under_mpiexec(self, tmp_path):
        if self.mpi_ranks < 2:
            pytest.skip("set mpi_ranks >= 2 to run the MPI cases")
        _mpirun(self.mpi_ranks, f"""
            import numpy as np, chemio_py as cio
            c = cio.comm()
            with cio.SharedFile("conf.mpi", backend={self.backend!r}) as sf:
                sf.write(c.rank * 4096, np.full(512, float(c.rank)))
                c.barrier()
                for r in range(c.size):
                    assert (sf.read(r * 4096, np.empty(512)) == r).all()
                c.barrier()
                sf.destroy()
            print("ok", flush=True)
        """, tmp_path, self.mpi_ranks)


    def test_shared_file_lifecycle_under_mpiexec(self, tmp_path):
        """sync() makes every rank's writes visible to all; close() is collective; a
        handle left open at exit on one rank alone is released locally (no hang)."""
        if self.mpi_ranks < 2:
            pytest.skip("set mpi_ranks >= 2 to run the MPI cases")
        _mpirun(self.mpi_ranks, f"""
            import numpy as np, chemio_py as cio
            c = cio.comm()
            sf = cio.SharedFile("conf.life", backend={self.backend!r})
            sf.write(c.rank * 8, np.array([c.rank + 0.5]))
            sf.sync()
            assert list(sf.read(0, np.empty(c.size))) == [r + 0.5 for r in range(c.size)]
            sf.close()
            sf.destroy()
            left = cio.SharedFile("conf.left", backend={self.backend!r})
            left.write(c.rank * 8, np.array([1.0]))
            if c.rank == c.size - 1:
                cio.cleanup()                    # exit on one rank while others hold it
            print("ok", flush=True)
        """, tmp_path, self.mpi_ranks)


    # ---------------------------------------------------- optional capabilities (gated)
    def caps_of_bytes(self, tmp_path, data: bytes):
        """A store holding ``data`` and its ``backends.capabilities``."""
        st = self.open_bytes(tmp_path / "cap", "w+")
        st.pwrite(0, data)
        return st, backends.capabilities(st)

    def test_capability_native_async(self, tmp_path):
        data = bytes(range(256)) * 32
        st, caps = self.caps_of_bytes(tmp_path, data)
        try:
            _offers(caps, "native_read", "native_write")
            req = caps.native_write(0, np.frombuffer(data, np.uint8), lambda n, t0, t1: n)
            if req is not None:
                assert req.wait(60) == len(data)
            buf = _aligned(len(data))
            req = caps.native_read(0, buf, lambda n, t0, t1: n)
            if req is None:
                pytest.skip("native_read: this call is not eligible (the pool would run it)")
            assert not req.cancel()                 # under way from the start
            assert req.wait(60) == len(data) and bytes(buf) == data
        finally:
            st.close()

    def test_capability_native_async_many(self, tmp_path):
        st, caps = self.caps_of_bytes(tmp_path, bytes(4096))
        try:
            _offers(caps, "native_read_many", "native_write_many")
        finally:
            st.close()

    def test_capability_read_nowait(self, tmp_path):
        data = b"nowait" * 1000
        st, caps = self.caps_of_bytes(tmp_path, data)
        try:
            _offers(caps, "read_nowait")
            out = bytearray(len(data))
            n = caps.read_nowait(0, out)
            assert 0 <= n <= len(data) and out[:n] == data[:n]
        finally:
            st.close()

    def test_capability_once_io(self, tmp_path):
        st, caps = self.caps_of_bytes(tmp_path, b"once" * 1000)
        try:
            _offers(caps, "pread_once", "pwrite_once")
            if caps.pwrite_once((memoryview(b"ONCE"),), 4) != 4:
                st.pwrite(4, b"ONCE")               # a short count: the caller completes it
            out = bytearray(8)
            if caps.pread_once((out,), 0) != 8:
                st.pread(0, out)
            assert bytes(out) == b"onceONCE"
        finally:
            st.close()

    def test_capability_sync_all_and_close_local(self, tmp_path):
        st, caps = self.caps_of_bytes(tmp_path, b"x" * 100)
        try:
            _offers(caps, "sync_all", "close_local", any_of=True)
            if caps.sync_all is not None:
                caps.sync_all()                     # opened without comm: this process alone
            out = bytearray(100)
            assert st.pread(0, out) == 100 and out == b"x" * 100
            if caps.close_local is not None:
                caps.close_local()                  # never collective; close() after is fine
        finally:
            st.close()


class ArrayStoreTests(_Base):
    """The ArrayStore contract (``backends.ArrayStore``) and DiskArrays on top of it."""

    def open_array(self, path, mode, shape, dtype, chunks):
        be = backends.require(self.be(), self.backend, backends.ArrayBackend)
        return be.open_array(str(path), mode, shape=shape, dtype=np.dtype(dtype), chunks=chunks)

    def test_is_an_array_backend(self):
        assert isinstance(self.be(), backends.ArrayBackend)

    @pytest.mark.parametrize("dtype", ["f8", "i4", "c16", "u1"])
    def test_regions_against_a_model(self, tmp_path, dtype):
        shape, chunks = (37, 23, 5), (8, 10, 5)
        rng = np.random.default_rng(3)
        model = np.zeros(shape, dtype)
        st = self.open_array(tmp_path / "a", "w+", shape, dtype, chunks)
        try:
            for _ in range(40):
                lo = [int(rng.integers(0, n)) for n in shape]
                hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, shape)]
                region = tuple(slice(a, b) for a, b in zip(lo, hi))
                data = (rng.random([b - a for a, b in zip(lo, hi)]) * 100).astype(dtype)
                st.write(region, data)
                model[region] = data
                out = np.empty(data.shape, dtype)
                st.read(region, out)
                assert np.array_equal(out, data)
            whole = np.empty(shape, dtype)
            st.read(tuple(slice(0, n) for n in shape), whole)
            assert np.array_equal(whole, model)          # unwritten elements are zero
            st.flush()
        finally:
            st.close()
            st.close()
        st = self.open_array(tmp_path / "a", "r", shape, dtype, chunks)
        try:
            again = np.empty(shape, dtype)
            st.read(tuple(slice(0, n) for n in shape), again)
            assert np.array_equal(again, model)          # it persists across a reopen
        finally:
            st.close()

    def test_strided_buffers(self, tmp_path):
        st = self.open_array(tmp_path / "s", "w+", (16, 16), "f8", (4, 16))
        try:
            big = np.arange(32 * 16, dtype="f8").reshape(32, 16)
            st.write((slice(0, 16), slice(0, 16)), big[::2])     # rows 2 apart
            out = np.zeros((16, 32))
            st.read((slice(0, 16), slice(0, 16)), out[:, :16])
            assert np.array_equal(out[:, :16], big[::2]) and not out[:, 16:].any()
        finally:
            st.close()

    def test_diskarray_end_to_end(self, tmp_path):
        model = np.arange(60 * 40, dtype="f8").reshape(60, 40)
        with cio.DiskArray.create("conf", (60, 40), "f8", chunks=(16, 16),
                                  backend=self.backend) as d:
            d[3:50, 7:33] = model[3:50, 7:33]
            assert np.array_equal(d.aread(np.s_[:, :]).wait()[3:50, 7:33], model[3:50, 7:33])
            assert d[0:3].sum() == 0
        d = cio.DiskArray.create("keep", (60, 40), "f8", chunks=(16, 16), path=tmp_path,
                                 backend=self.backend)
        d.write_all((), model)
        d.close()
        e = cio.DiskArray.open(d.path, "r+", backend=self.backend)
        assert np.array_equal(e[:, :], model)
        e.delete()
        assert not os.path.lexists(d.path) and not os.path.lexists(d.meta_path)

    def test_diskarray_write_all_under_mpiexec(self, tmp_path):
        ranks = getattr(self, "mpi_ranks", 0)
        if ranks < 2:
            pytest.skip("set mpi_ranks >= 2 to run the MPI cases")
        _mpirun(ranks, f"""
            import numpy as np, chemio_py as cio
            c = cio.comm()
            with cio.DiskArray.create("confmpi", (97, 13), "i8", chunks=(10, 13),
                                      backend={self.backend!r}) as d:
                sec = cio.block_section(d.shape, chunks=d.chunks)
                d.write_all(sec, np.full(d[sec].shape, c.rank + 1))
                full = d.read_all(())
                assert (full > 0).all() and full.max() == c.size
            print("ok", flush=True)
        """, tmp_path, ranks)


    def test_diskarray_lifecycle_under_mpiexec(self, tmp_path):
        """Create, write_all, close and reopen together; overlapping sections raise on
        every rank; an array left open at exit on one rank alone is released locally."""
        ranks = getattr(self, "mpi_ranks", 0)
        if ranks < 2:
            pytest.skip("set mpi_ranks >= 2 to run the MPI cases")
        _mpirun(ranks, f"""
            import numpy as np, chemio_py as cio
            from chemio_py.errors import SectionError
            c = cio.comm()
            d = cio.DiskArray.create("life", (41, 7), "c16", chunks=(6, 4),
                                     backend={self.backend!r}, path={str(tmp_path)!r})
            sec = cio.block_section(d.shape)
            d.write_all(sec, np.full(d[sec].shape, c.rank + 1j))
            try:
                d.write_all((), np.zeros(d.shape, "c16"))      # every rank: the whole array
                raise SystemExit("overlapping sections were accepted")
            except SectionError:
                pass
            d.close()
            e = cio.DiskArray.open(d.path, "r", backend={self.backend!r})
            full = e.read_all(())
            for r, (lo, hi) in enumerate(c.allgather((sec[0].start, sec[0].stop))):
                assert (full[lo:hi] == r + 1j).all(), (r, full[lo:hi])
            e.close()
            kept = cio.DiskArray.open(d.path, "r", backend={self.backend!r})
            if c.rank == c.size - 1:
                cio.cleanup()                    # exit on one rank while others hold it
            print("ok", flush=True)
        """, tmp_path, ranks)


    # ---------------------------------------------------- optional capabilities (gated)
    def caps_of_array(self, tmp_path, model):
        """A store holding ``model`` (chunks 8 x 16) and its ``backends.capabilities``."""
        st = self.open_array(tmp_path / "cap", "w+", model.shape, model.dtype, (8, 16))
        st.write(tuple(slice(0, n) for n in model.shape), model)
        return st, backends.capabilities(st)

    def test_capability_cached_and_part_reads(self, tmp_path):
        model = np.arange(32 * 48, dtype="f8").reshape(32, 48)
        st, caps = self.caps_of_array(tmp_path, model)
        try:
            _offers(caps, "read_cached", "read_part", any_of=True)
            region, out = (slice(3, 29), slice(5, 40)), np.zeros((26, 35))
            if caps.read_cached is not None and caps.read_cached(region, out):
                assert np.array_equal(out, model[region])
            if caps.read_part is not None:
                out[...] = 0
                caps.read_part(region, out, (slice(0, 32), slice(0, 48)))
                assert np.array_equal(out, model[region])
        finally:
            st.close()

    def test_capability_check_write_and_evict(self, tmp_path):
        model = np.ones((32, 48))
        st, caps = self.caps_of_array(tmp_path, model)
        try:
            _offers(caps, "check_write", "evict", any_of=True)
            if caps.check_write is not None:
                caps.check_write((slice(0, 32), slice(0, 48)))   # one writer, whole array
            if caps.evict is not None:
                caps.evict()
                out = np.zeros((32, 48))
                st.read((slice(0, 32), slice(0, 48)), out)
                assert np.array_equal(out, model)
        finally:
            st.close()

    def test_capability_streams_and_compression(self, tmp_path):
        st, caps = self.caps_of_array(tmp_path, np.zeros((32, 48)))
        try:
            _offers(caps, "write_streams", "read_streams", "compression", any_of=True)
            for n in (caps.write_streams, caps.read_streams):
                assert n is None or (isinstance(n, int) and n > 0)
            assert caps.compression is None or isinstance(caps.compression, str)
        finally:
            st.close()

    def test_capability_collective_io_alone(self, tmp_path):
        model = np.arange(32 * 48, dtype="f8").reshape(32, 48)
        st, caps = self.caps_of_array(tmp_path, np.zeros((32, 48)))
        try:
            _offers(caps, "collective")
            whole = (slice(0, 32), slice(0, 48))
            st.write_all(whole, model, None)        # comm None: this process alone
            out = np.zeros((32, 48))
            st.read_all(whole, out, None)
            assert np.array_equal(out, model)
        finally:
            st.close()

    def test_capability_byte_addressable(self, tmp_path):
        st, caps = self.caps_of_array(tmp_path, np.zeros((32, 48)))
        try:
            _offers(caps, "byte_addressable")
            # writers of disjoint rows of one chunk, at once, lose nothing
            rows = [threading.Thread(target=st.write, args=((slice(k, k + 1), slice(0, 16)),
                                                            np.full((1, 16), k + 1.0)))
                    for k in range(8)]
            for t in rows:
                t.start()
            for t in rows:
                t.join()
            out = np.zeros((8, 16))
            st.read((slice(0, 8), slice(0, 16)), out)
            assert np.array_equal(out[:, 0], np.arange(1.0, 9.0))
        finally:
            st.close()

    def test_capability_native_region_dask_close_local(self, tmp_path):
        model = np.arange(32 * 48, dtype="f8").reshape(32, 48)
        st, caps = self.caps_of_array(tmp_path, model)
        try:
            _offers(caps, "native_read_region", "as_dask", "close_local", any_of=True)
            if caps.native_read_region is not None:
                out = _aligned(model.nbytes).view("f8").reshape(model.shape)
                req = caps.native_read_region((slice(0, 32), slice(0, 48)), out,
                                              lambda n, t0, t1: out)
                if req is not None:
                    assert np.array_equal(req.wait(60), model)
            if caps.as_dask is not None:
                pytest.importorskip("dask")
                st.flush()
                assert np.array_equal(np.asarray(caps.as_dask()), model)
            if caps.close_local is not None:
                caps.close_local()
        finally:
            st.close()


class BackendTests(ByteStoreTests, ArrayStoreTests):
    """Both contracts: for a backend that holds byte files and DiskArrays."""


def _mpirun(n: int, body: str, tmp_path, ranks: int) -> None:
    launcher = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(launcher):
        launcher = shutil.which("mpiexec") or ""
    if not launcher:
        pytest.skip("no mpiexec here (pip install mpich mpi4py)")
    script = tmp_path / "conformance_mpi.py"
    script.write_text(textwrap.dedent(body))
    p = subprocess.run([launcher, "-n", str(n), sys.executable, "-m", "mpi4py", str(script)],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0 and p.stdout.count("ok") == ranks, (p.stdout, p.stderr[-3000:])


def _offers(caps: backends.Capabilities, *names: str, any_of: bool = False) -> None:
    """Skip the calling case unless the store offers the capabilities ``names`` (all of
    them, or with ``any_of`` at least one)."""
    have = [n for n in names if getattr(caps, n) not in (None, False)]
    if not have or (not any_of and len(have) < len(names)):
        missing = ", ".join(n for n in names if n not in have)
        pytest.skip(f"the store does not offer {missing} (backends.capabilities)")


def _aligned(n: int, align: int = 4096) -> np.ndarray:
    """``n`` zero bytes at an address that is a multiple of ``align`` (O_DIRECT's rule)."""
    raw = np.zeros(n + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n]
