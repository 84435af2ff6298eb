"""Zarr v3 benchmark (issue 14): chemio's ``zarr`` backend against zarr-python 3, TensorStore
and the codec + file-I/O ceiling, on the same arrays in the same run.

An 8000 x 8000 float64 array (quick mode: 4000 x 4000); a 4000 x 4000 section (quick:
2000 x 2000, 32 MB) is written and read back cold, once aligned (it is made of whole storage
objects) and once non-aligned (it starts half an object further on both axes, so every
object along its border is cut). Layouts (the storage object is a zarr chunk, or a shard):

* ``small``: 80 x 100 objects (64,000 B, the ~64 KiB shape that tiles a 4000 x 4000 section),
  no sharding — per-object cost dominates;
* ``large``: 500 x 500 objects (2,000,000 B), no sharding — the codec dominates;
* ``large-sharded`` (full size only): 500 x 500 shards of 250 x 250 inner chunks
  (``sharding_indexed``, index at the end with crc32c).

Each layout runs uncompressed and with zstd level 3 (no checksum). The data are standard
normal values rounded to float32 (zstd keeps about 57 %), the same for every method.

Methods, interleaved in rotating order within each repetition:

* ``chemio`` — ``cio.DiskArray.create(..., backend="zarr", chunks=<object>,
  inner_chunks=<inner or False>, compressor="none" | {"id": "zstd", "level": 3})``,
  ``write(section, x)`` / ``read(section, out)``;
* ``zarr-python`` — ``zarr.create_array`` with the same chunks/shards and codecs, default
  configuration (its asynchronous ``LocalStore``), ``z[section] = x`` / ``z[section]``;
* ``TensorStore`` — the ``zarr3`` driver on the ``file`` kvstore, the same metadata,
  ``a[section].write(x)`` / ``a[section].read()``; its context sets ``file_io_sync: false``
  (its default fsyncs every object; nobody else syncs inside the timed write);
* ``ceiling`` — what the work needs and no more: numcodecs encode/decode of exactly the
  objects (inner chunks when sharded) the section touches, fanned out over a thread pool of
  2 x ``os.cpu_count()`` threads (numcodecs releases the GIL), plus plain ``os.write`` /
  ``os.preadv`` of the encoded bytes, one file per object (cut objects are read, decoded,
  patched and re-encoded; a shard keeps an offset/size index at its end).

Fairness: the same chunks, shards, codecs and level for all (checked from each store's
``zarr.json`` before timing); one untimed warm-up write of both sections per method, after
which zarr-python reads every method's store (the ceiling's through its own reader) and the
result is compared with NumPy; every method's first timed read is compared with the section
written. Writes end when the library call returns (data in the page cache; no method
fsyncs); each write starts, and each cold read starts, after every file of that store was
evicted from the page cache (fsync + ``POSIX_FADV_DONTNEED``, as ``common.evict``); after a
write its files are written back untimed, so the next method does not pay for them. Arrays
are opened (untimed) after the eviction and closed after each phase, so no handle caches a
shard index or metadata between phases. Values are medians (5 repetitions; quick: 1); the
note gives every method's range and the best-of ratio (least disturbed by other load).

Targets (issue 14): small objects, chemio write and cold read >= 2x zarr-python and >= 1x
TensorStore; large objects, chemio >= 0.8x the ceiling and >= 1x zarr-python (TensorStore
informational). Ratio = chemio MiB/s / theirs = their time / chemio's time.

4-rank collective write: ``mpiexec -n 4`` (the mpich wheel's launcher next to Python). A
non-aligned section (small objects, zstd) is cut in 4 column strips at mid-object, one per
rank, so each object along a cut is shared by two ranks that reach it at about the same
time, row after row (the worst case for a read-modify-write race). chemio: one
``write_all``; zarr-python: every process assigns its block at the same time (after a
barrier). Time = barrier to barrier; afterwards zarr-python reads the array and the elements
that differ from the expected array (the blocks, zeros around) are counted as lost.
Target: chemio loses nothing (a ``lost elements`` row and a PASS/FAIL ``no loss`` row).

Size (issue 28 item 6): an array of 64 MiB storage objects (1024 x 8192 float64 row
blocks; ``SIZE_GIB`` in all, quick: ``SIZE_GIB_QUICK``; ``--size-gib N`` or
``CHEMIO_BENCH_ZARR_GIB`` sets it: the issue's case is 32 GiB, larger than RAM), written block
by block and made durable, then read back cold block by block into one reused buffer. Methods,
interleaved in rotating order in every round, each method written, evicted, read back and
removed before the next (so only one method's files are on disk: 32 GiB needs 32 GiB free,
plus the zstd ones): ``raw`` — one file, ``os.pwritev`` of each block at its offset
then ``fsync``; reads ``os.preadv`` into the buffer (the baseline); chemio persistent
``DiskArray`` on ``zarr`` ``write`` of each block then ``flush()`` / ``read(block, out=)``,
uncompressed unsharded (``inner_chunks=False``), uncompressed sharded (default inner chunks)
and zstd level 3 sharded (default inner chunks); ``ceiling`` — numcodecs zstd of the same
inner chunks over a pool of 2 x CPUs plus ``os.pwritev`` of the encoded chunks (one file per
block) and ``fsync``, reads ``os.preadv`` of each file and decoding over the pool. Cold: every
write and read starts after the method's files were evicted (fsync + ``POSIX_FADV_DONTNEED``).
The data are standard normals rounded to float32 (one block, with the block number in its
first element). Targets: uncompressed chemio >= 0.9x raw on write and read; zstd >= 0.9x the
ceiling. Ranges over ``SIZE_ROUNDS`` rounds; the note says ``uptime``'s load.

Run alone: ``python benchmarks/bench_zarr.py [--full] [--size-only | --small-only]
[--size-gib N] [--size-rounds N] [--notes]`` (``--small-only``: the small-object rows
against TensorStore and zarr-python alone, the quick check for issue 28 item 4).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import evict, mib_s, row  # noqa: E402

FULL = dict(n=8000, s=4000, reps=5, layouts=("small", "large", "large-sharded"),
            mpi_trials=3)
QUICK = dict(n=4000, s=2000, reps=1, layouts=("small", "large"), mpi_trials=1)
LAYOUTS = {                       # name: (object shape, inner chunk shape or None)
    "small": ((80, 100), None),
    "large": ((500, 500), None),
    "large-sharded": ((500, 500), (250, 250)),
}
CODECS = ("none", "zstd")
ZSTD_LEVEL = 3
MPI_PROCS = 4
MPI_LAYOUT, MPI_CODEC = "small", "zstd"
MPI_TIMEOUT = 900
CEILING_THREADS = 2 * (os.cpu_count() or 1)     # all cores busy while others wait for I/O


# ---------------------------------------------------------------- helpers

def _files_under(path: str) -> list[str]:
    out = []
    for d, _, names in os.walk(path):
        out += [os.path.join(d, n) for n in names]
    return out


def _zarr_codecs(codec: str, inner: tuple | None) -> list[dict]:
    """The zarr.json ``codecs`` of a layout, as zarr-python writes them."""
    chain: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if codec == "zstd":
        chain.append({"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": False}})
    if inner is None:
        return chain
    return [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": list(inner), "codecs": chain,
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                         {"name": "crc32c"}],
        "index_location": "end"}}]


def _layout_of(zarr_json: str) -> tuple:
    """(object shape, inner chunk shape or None, compressor, level) from a zarr.json: what
    has to be the same in every method's store for the comparison to be fair."""
    with open(zarr_json) as fh:
        meta = json.load(fh)
    obj = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    codecs, inner = meta["codecs"], None
    if len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed":
        cfg = codecs[0]["configuration"]
        inner, codecs = tuple(cfg["chunk_shape"]), cfg["codecs"]
    comp = [c for c in codecs if c["name"] not in ("bytes",)]
    if not comp:
        return obj, inner, None, None
    if len(comp) > 1:
        return obj, inner, tuple(c["name"] for c in comp), None
    c = comp[0]
    return obj, inner, c["name"], (c.get("configuration") or {}).get("level")


def _section(off: tuple, s: int) -> tuple:
    return tuple(slice(o, o + s) for o in off)


# ---------------------------------------------------------------- methods

class _Method:
    name = "?"
    path = ""

    def files(self) -> list[str]:
        return _files_under(self.path)

    def open(self, mode: str) -> None:
        pass

    def write(self, sec: tuple, x: np.ndarray) -> None:
        raise NotImplementedError

    def read(self, sec: tuple, out: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Chemio(_Method):
    name = "chemio"

    def __init__(self, root: str, n: int, obj: tuple, inner: tuple | None, codec: str):
        import chemio_py as cio
        self.cio = cio
        self.path = os.path.join(root, "chemio.zarr")
        self.d = None
        d = cio.DiskArray.create("bench", (n, n), "f8", chunks=obj, backend="zarr",
                                 path=self.path, persistent=True, **_chemio_options(codec, inner))
        d.close()

    def open(self, mode: str) -> None:
        self.d = self.cio.DiskArray.open(self.path, "r" if mode == "r" else "r+",
                                         backend="zarr")

    def write(self, sec: tuple, x: np.ndarray) -> None:
        self.d.write(sec, x)

    def read(self, sec: tuple, out: np.ndarray) -> np.ndarray:
        self.d.read(sec, out)
        return out

    def close(self) -> None:
        if self.d is not None:
            self.d.close()
            self.d = None


def _chemio_options(codec: str, inner: tuple | None) -> dict:
    return {"compressor": "none" if codec == "none" else {"id": "zstd", "level": ZSTD_LEVEL},
            "inner_chunks": False if inner is None else inner}


class _ZarrPython(_Method):
    name = "zarr-python"

    def __init__(self, root: str, n: int, obj: tuple, inner: tuple | None, codec: str):
        import zarr
        from zarr.codecs import ZstdCodec
        self.zarr = zarr
        self.path = os.path.join(root, "zarr-python.zarr")
        self.z = None
        zarr.create_array(store=self.path, shape=(n, n), dtype="f8",
                          chunks=inner or obj, shards=obj if inner else None,
                          compressors=ZstdCodec(level=ZSTD_LEVEL) if codec == "zstd" else None,
                          fill_value=0.0)

    def open(self, mode: str) -> None:
        self.z = self.zarr.open_array(self.path, mode=mode)

    def write(self, sec: tuple, x: np.ndarray) -> None:
        self.z[sec] = x

    def read(self, sec: tuple, out: np.ndarray) -> np.ndarray:
        return self.z[sec]

    def close(self) -> None:
        self.z = None


class _TensorStore(_Method):
    name = "TensorStore"

    def __init__(self, root: str, n: int, obj: tuple, inner: tuple | None, codec: str):
        import tensorstore as ts
        self.ts = ts
        self.path = os.path.join(root, "tensorstore.zarr")
        self.a = None
        meta = {"shape": [n, n], "data_type": "float64",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(obj)}},
                "chunk_key_encoding": {"name": "default"}, "fill_value": 0.0,
                "codecs": _zarr_codecs(codec, inner)}
        ts.open(self._spec(meta), create=True, delete_existing=True,
                context=self._context()).result()

    def _spec(self, meta: dict | None = None) -> dict:
        spec: dict = {"driver": "zarr3", "kvstore": {"driver": "file", "path": self.path}}
        if meta is not None:
            spec["metadata"] = meta
        return spec

    def _context(self) -> Any:
        return self.ts.Context({"file_io_sync": False})

    def open(self, mode: str) -> None:
        self.a = self.ts.open(self._spec(), read=True, write=mode != "r",
                              context=self._context()).result()

    def write(self, sec: tuple, x: np.ndarray) -> None:
        self.a[sec].write(x).result()

    def read(self, sec: tuple, out: np.ndarray) -> np.ndarray:
        return self.a[sec].read().result()

    def close(self) -> None:
        self.a = None


class _Ceiling(_Method):
    """numcodecs + plain file I/O over a thread pool: the least work the section needs.

    Per object: gather into a reused buffer, encode, one ``os.write`` loop into the object's
    file (cut objects: read, decode, patch first); reads: ``os.preadv`` into a reused buffer,
    decode into another, copy the wanted part out. Sharded objects keep an offset/size index
    at their end and only the inner chunks the section touches are decoded."""

    name = "ceiling"
    NONE = np.iinfo(np.uint64).max

    def __init__(self, root: str, n: int, obj: tuple, inner: tuple | None, codec: str,
                 pool: cf.ThreadPoolExecutor):
        import numcodecs
        self.path = os.path.join(root, "ceiling")
        os.makedirs(self.path)
        self.obj, self.inner, self.pool = obj, inner, pool
        self.codec = numcodecs.Zstd(level=ZSTD_LEVEL) if codec == "zstd" else None
        self.unit = inner or obj                  # the encoded unit
        self.per = (obj[0] // self.unit[0], obj[1] // self.unit[1]) if inner else (1, 1)
        self.nunits = self.per[0] * self.per[1]
        self.tail = 16 * self.nunits + 4
        self._local = threading.local()

    def _bufs(self) -> Any:
        t = self._local
        if not hasattr(t, "unit"):
            t.unit = np.empty(self.unit)
            t.raw = bytearray(t.unit.nbytes + (t.unit.nbytes >> 6) + 4096)
        return t

    def _raw(self, size: int) -> memoryview:
        t = self._bufs()
        if len(t.raw) < size:
            t.raw = bytearray(size)
        return memoryview(t.raw)[:size]

    # -- encoded units
    def _encode(self, a: np.ndarray) -> Any:
        if self.codec is None:                         # the gather copy is the encoding
            return memoryview(np.ascontiguousarray(a)).cast("B")
        if not a.flags.c_contiguous:
            buf = self._bufs().unit
            np.copyto(buf, a)
            a = buf
        return self.codec.encode(a)

    def _decode(self, b: Any) -> np.ndarray:
        """The unit in ``b``, in this thread's unit buffer (or a view of ``b``)."""
        if self.codec is None:
            return np.frombuffer(b, "f8").reshape(self.unit)
        unit = self._bufs().unit
        self.codec.decode(b, out=unit)
        return unit

    def _file(self, i: int, j: int) -> str:
        return os.path.join(self.path, f"{i}.{j}")

    @staticmethod
    def _pread(fd: int, mv: memoryview, off: int) -> None:
        while len(mv):
            k = os.preadv(fd, [mv], off)
            if k == 0:
                raise EOFError("short object file")
            mv, off = mv[k:], off + k

    def _objects(self, sec: tuple) -> list[tuple]:
        (r0, r1), (c0, c1) = [(s.start, s.stop) for s in sec]
        o0, o1 = self.obj
        return [(i, j) for i in range(r0 // o0, (r1 - 1) // o0 + 1)
                for j in range(c0 // o1, (c1 - 1) // o1 + 1)]

    @staticmethod
    def _cut(box0: tuple, shape: tuple, sec: tuple) -> tuple | None:
        """(slices in the box, slices in the section) of box ∩ section, or None."""
        inb, ins = [], []
        for b, n, s in zip(box0, shape, sec):
            lo, hi = max(b, s.start), min(b + n, s.stop)
            if lo >= hi:
                return None
            inb.append(slice(lo - b, hi - b))
            ins.append(slice(lo - s.start, hi - s.start))
        return tuple(inb), tuple(ins)

    def _units(self, i: int, j: int, sec: tuple) -> list[tuple]:
        """[(k, cut or None)] of the units of object (i, j)."""
        u0, u1 = self.unit
        b0, b1 = i * self.obj[0], j * self.obj[1]
        return [(k, self._cut((b0 + (k // self.per[1]) * u0, b1 + (k % self.per[1]) * u1),
                              self.unit, sec)) for k in range(self.nunits)]

    # -- one object
    def _write_one(self, ij: tuple, sec: tuple, x: np.ndarray) -> None:
        i, j = ij
        old = old_idx = None
        parts, index = [], np.full((self.nunits, 2), self.NONE, np.uint64)
        off = 0
        for k, cut in self._units(i, j, sec):
            whole = cut is not None and all(c.stop - c.start == n
                                            for c, n in zip(cut[0], self.unit))
            if whole:
                enc = self._encode(x[cut[1]])
            else:
                if old is None:                                # read the old object once
                    try:
                        with open(self._file(i, j), "rb", buffering=0) as fh:
                            old = fh.read()
                    except FileNotFoundError:
                        old = b""
                    if old and self.inner:
                        old_idx = np.frombuffer(old[-self.tail:-4], np.uint64).reshape(-1, 2)
                prev = old or None
                if self.inner:
                    prev = None
                    if old_idx is not None and old_idx[k, 0] != self.NONE:
                        o, nb = int(old_idx[k, 0]), int(old_idx[k, 1])
                        prev = memoryview(old)[o:o + nb]
                if cut is None:                                # untouched inner chunk
                    if prev is None:
                        continue
                    enc = prev
                else:
                    unit = np.zeros(self.unit) if prev is None else self._decode(prev).copy()
                    unit[cut[0]] = x[cut[1]]
                    enc = self._encode(unit)
            parts.append(enc)
            nb = len(memoryview(enc).cast("B"))
            index[k] = (off, nb)
            off += nb
        if self.inner:
            parts += [index, b"\0\0\0\0"]
        fd = os.open(self._file(i, j), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for p in parts:
                mv = memoryview(p).cast("B")
                while len(mv):
                    mv = mv[os.write(fd, mv):]
        finally:
            os.close(fd)

    def _read_one(self, ij: tuple, sec: tuple, out: np.ndarray) -> None:
        i, j = ij
        units = self._units(i, j, sec)
        try:
            fd = os.open(self._file(i, j), os.O_RDONLY)
        except FileNotFoundError:                              # never written: fill value
            for _, cut in units:
                if cut is not None:
                    out[cut[1]] = 0.0
            return
        try:
            size = os.fstat(fd).st_size
            if not self.inner:
                mv = self._raw(size)
                self._pread(fd, mv, 0)
                cut = units[0][1]
                out[cut[1]] = self._decode(mv)[cut[0]]
                return
            ib = bytearray(self.tail)
            self._pread(fd, memoryview(ib), size - self.tail)
            idx = np.frombuffer(ib, np.uint64, count=2 * self.nunits).reshape(-1, 2)
            for k, cut in units:
                if cut is None:
                    continue
                if idx[k, 0] == self.NONE:
                    out[cut[1]] = 0.0
                    continue
                mv = self._raw(int(idx[k, 1]))
                self._pread(fd, mv, int(idx[k, 0]))
                out[cut[1]] = self._decode(mv)[cut[0]]
        finally:
            os.close(fd)

    def write(self, sec: tuple, x: np.ndarray) -> None:
        list(self.pool.map(lambda ij: self._write_one(ij, sec, x), self._objects(sec)))

    def read(self, sec: tuple, out: np.ndarray) -> np.ndarray:
        list(self.pool.map(lambda ij: self._read_one(ij, sec, out), self._objects(sec)))
        return out


# ---------------------------------------------------------------- chemio availability

def _chemio_problem(workdir: str) -> str | None:
    """None when the chemio ``zarr`` backend works through DiskArray, else why not."""
    try:
        import chemio_py as cio
        import chemio_py.backends as b
        b.resolve("zarr")
        probe = os.path.join(workdir, "probe")
        os.makedirs(probe, exist_ok=True)
        try:
            for codec, inner in (("zstd", (2, 2)), ("none", None)):
                p = os.path.join(probe, f"p-{codec}.zarr")
                d = cio.DiskArray.create("probe", (8, 8), "f8", chunks=(4, 4), backend="zarr",
                                         path=p, persistent=True, **_chemio_options(codec, inner))
                try:
                    x = np.arange(36.0).reshape(6, 6)
                    d.write((slice(1, 7), slice(1, 7)), x)
                    if not np.array_equal(d.read((slice(1, 7), slice(1, 7))), x):
                        return "a probe array read back other data"
                finally:
                    d.close()
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


# ---------------------------------------------------------------- one layout x codec

def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def _bench_one(root: str, n: int, s: int, reps: int, layout: str, codec: str,
               x: np.ndarray, out: np.ndarray, with_chemio: bool,
               pool: cf.ThreadPoolExecutor) -> dict:
    """Times {(method, op, case): [seconds]} of one layout and codec."""
    import zarr
    obj, inner = LAYOUTS[layout]
    half = (obj[0] // 2, obj[1] // 2)
    cases = {"aligned": _section((0, 0), s), "non-aligned": _section(half, s)}
    ms: list[_Method] = []
    if with_chemio:
        ms.append(_Chemio(root, n, obj, inner, codec))
    ms += [_ZarrPython(root, n, obj, inner, codec), _TensorStore(root, n, obj, inner, codec),
           _Ceiling(root, n, obj, inner, codec, pool)]
    want = (obj, inner, None if codec == "none" else "zstd",
            None if codec == "none" else ZSTD_LEVEL)
    for m in ms:
        if isinstance(m, _Ceiling):
            continue
        got = _layout_of(os.path.join(m.path, "zarr.json"))
        if got != want:
            raise AssertionError(f"{m.name} made layout {got}, not {want}: unfair comparison")

    # untimed warm-up: both sections, then the whole written box checked against NumPy
    hi = half[0] + s, half[1] + s
    box = (slice(0, hi[0] + obj[0]), slice(0, hi[1] + obj[1]))
    expect = np.zeros((box[0].stop, box[1].stop))
    for sec in cases.values():
        expect[sec] = x
    for m in ms:
        m.open("r+")
        for sec in cases.values():
            m.write(sec, x)
        m.close()
        evict(*m.files())
        if isinstance(m, _Ceiling):
            got = np.zeros_like(expect)
            m.read(box, got)
        else:
            got = zarr.open_array(m.path, mode="r")[box]
        if not np.array_equal(got, expect):
            bad = int(np.count_nonzero(got != expect))
            raise AssertionError(f"{m.name} ({layout}, {codec}): {bad} elements differ from "
                                 f"NumPy after the warm-up writes (read by "
                                 f"{'its reader' if isinstance(m, _Ceiling) else 'zarr-python'})")
    del expect, got

    times: dict[tuple, list[float]] = {}
    for rep in range(reps):
        k = rep % len(ms)
        order = ms[k:] + ms[:k]
        for case, sec in cases.items():
            for m in order:
                evict(*m.files())
                m.open("r+")
                t, _ = _timed(lambda: m.write(sec, x))  # noqa: B023 - called here
                m.close()
                evict(*m.files())                  # write-back untimed, before the next one
                times.setdefault((m.name, "write", case), []).append(t)
            for m in order:
                evict(*m.files())
                m.open("r")
                out[...] = 0.0
                t, got = _timed(lambda: m.read(sec, out))  # noqa: B023 - called here
                m.close()
                if rep == 0 and not np.array_equal(got, x):
                    raise AssertionError(f"{m.name} ({layout}, {codec}, {case}) read back "
                                         f"other data than it wrote")
                del got
                times.setdefault((m.name, "cold read", case), []).append(t)
    for m in ms:
        shutil.rmtree(m.path, ignore_errors=True)
    return times


# ---------------------------------------------------------------- 4-rank collective write

def _mpiexec() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else (shutil.which("mpiexec") or "mpiexec")


def _mpi_blocks(n: int, s: int, obj: tuple) -> tuple[tuple, list[tuple]]:
    """(region, per-rank block sections): a non-aligned section cut in column strips at
    mid-object, so every object along a cut is written by two ranks, row after row at about
    the same moment (the worst case for a read-modify-write race)."""
    off = (obj[0] // 2, obj[1] // 2)
    w = s // MPI_PROCS
    if w % obj[1] != 0:
        raise ValueError(f"section width {s} / {MPI_PROCS} is not a whole number of objects")
    edges = [off[1] + k * w for k in range(MPI_PROCS)] + [off[1] + s]
    blocks = [(slice(off[0], off[0] + s), slice(edges[r], edges[r + 1]))
              for r in range(MPI_PROCS)]
    return _section(off, s), blocks


def _block_data(sec: tuple, trial: int, rank: int) -> np.ndarray:
    shape = tuple(x.stop - x.start for x in sec)
    return (np.random.default_rng([trial, rank]).standard_normal(shape)
            .astype(np.float32).astype(np.float64))


def _mpi_worker(cfg: dict) -> None:
    from mpi4py import MPI
    import zarr
    from zarr.codecs import ZstdCodec
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    lib, n, s, root = cfg["lib"], cfg["n"], cfg["s"], cfg["root"]
    obj, inner = LAYOUTS[cfg["layout"]]
    codec = cfg["codec"]
    region, blocks = _mpi_blocks(n, s, obj)
    mine = blocks[rank]
    results = []
    for trial in range(cfg["trials"]):
        path = os.path.join(root, f"{lib}-{trial}.zarr")
        data = _block_data(mine, trial, rank)
        if lib == "chemio":
            import chemio_py as cio
            d = cio.DiskArray.create("mpi", (n, n), "f8", chunks=obj, backend="zarr", path=path,
                                     persistent=True, **_chemio_options(codec, inner))
        else:
            if rank == 0:
                zarr.create_array(store=path, shape=(n, n), dtype="f8", chunks=inner or obj,
                                  shards=obj if inner else None, fill_value=0.0,
                                  compressors=ZstdCodec(level=ZSTD_LEVEL) if codec == "zstd"
                                  else None)
            comm.Barrier()
            z = zarr.open_array(path, mode="r+")
        comm.Barrier()
        t0 = MPI.Wtime()
        if lib == "chemio":
            d.write_all(mine, data)
        else:
            z[mine] = data
        comm.Barrier()
        t = MPI.Wtime() - t0
        if lib == "chemio":
            d.close()
        comm.Barrier()
        if rank == 0:
            box = tuple(slice(0, x.stop + o) for x, o in zip(region, obj))
            expect = np.zeros((box[0].stop, box[1].stop))
            for r, b in enumerate(blocks):
                expect[b] = _block_data(b, trial, r)
            got = zarr.open_array(path, mode="r")[box]
            lost = int(np.count_nonzero(got != expect))
            results.append({"seconds": t, "lost": lost})
            shutil.rmtree(path, ignore_errors=True)
        comm.Barrier()
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


def _run_mpi(lib: str, cfg: dict, workdir: str) -> list[dict]:
    root = os.path.join(workdir, f"mpi-{lib}")
    os.makedirs(root, exist_ok=True)
    scr = os.path.join(workdir, "mpi-scratch")
    os.makedirs(scr, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CHEMIO_", "PMI_", "PMIX_", "OMPI_", "MPIR_", "HYDRA_"))}
    env.update(CHEMIO_SCRATCH=scr, CHEMIO_SHARED_SCRATCH=scr)
    job = dict(cfg, lib=lib, root=root)
    cmd = [_mpiexec(), "-n", str(MPI_PROCS), sys.executable, "-m", "mpi4py",
           os.path.abspath(__file__), "--mpi-worker", json.dumps(job)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=MPI_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise RuntimeError(f"{MPI_PROCS}-rank {lib} write killed after {MPI_TIMEOUT} s:\n"
                           f"{stderr[-3000:]}") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{MPI_PROCS}-rank {lib} write failed (exit {proc.returncode}):\n"
                           f"{stdout[-2000:]}\n{stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------- size: 64 MiB objects

SIZE_GIB, SIZE_GIB_QUICK, SIZE_ROUNDS = 4.0, 0.5, 3
SIZE_BLOCK = (1024, 8192)                         # one 64 MiB float64 object


def _size_gib(quick: bool) -> float:
    env = os.environ.get("CHEMIO_BENCH_ZARR_GIB")
    return float(env) if env else (SIZE_GIB_QUICK if quick else SIZE_GIB)


class _SizeRaw:
    """One file, ``pwritev`` of each block at its offset, ``fsync``; ``preadv`` back."""

    name = "raw"

    def __init__(self, root: str, nblocks: int, inner: Any = None, codec: str = "none",
                 pool: Any = None):
        self.path = os.path.join(root, "raw.bin")
        self.nblocks = nblocks

    def files(self) -> list[str]:
        return [self.path]

    def fresh(self) -> None:
        self.remove()

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def write_all(self, block_of: Any) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for i in range(self.nblocks):
                mv = memoryview(block_of(i)).cast("B")
                off, done = i * len(mv), 0
                while done < len(mv):
                    done += os.pwritev(fd, [mv[done:]], off + done)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_all(self, out: np.ndarray, check: Any) -> None:
        mv = memoryview(out).cast("B")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in range(self.nblocks):
                off, done = i * len(mv), 0
                while done < len(mv):
                    k = os.preadv(fd, [mv[done:]], off + done)
                    if k == 0:
                        raise EOFError(self.path)
                    done += k
                check(i, out)
        finally:
            os.close(fd)


class _SizeChemio(_SizeRaw):
    """A persistent DiskArray on ``zarr``: ``write`` per block then ``flush``; ``read``."""

    def __init__(self, root: str, nblocks: int, inner: Any, codec: str, pool: Any = None):
        import chemio_py as cio
        self.cio = cio
        self.name = f"chemio {'sharded' if inner is None else 'unsharded'} {codec}"
        self.path = os.path.join(root, self.name.replace(" ", "-") + ".zarr")
        self.nblocks, self.inner, self.codec = nblocks, inner, codec

    def files(self) -> list[str]:
        return _files_under(self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def fresh(self) -> None:
        self.remove()
        shape = (self.nblocks * SIZE_BLOCK[0], SIZE_BLOCK[1])
        opts = _chemio_options(self.codec, None)
        if self.inner is not None:
            opts["inner_chunks"] = self.inner
        else:
            opts.pop("inner_chunks")
        d = self.cio.DiskArray.create("size", shape, "f8", chunks=SIZE_BLOCK, backend="zarr",
                                      path=self.path, persistent=True, **opts)
        d.close()

    def write_all(self, block_of: Any) -> None:
        d = self.cio.DiskArray.open(self.path, "r+", backend="zarr")
        try:
            r = SIZE_BLOCK[0]
            for i in range(self.nblocks):
                d.write(np.s_[i * r:(i + 1) * r, :], block_of(i))
            d.flush()
        finally:
            d.close()

    def read_all(self, out: np.ndarray, check: Any) -> None:
        d = self.cio.DiskArray.open(self.path, "r", backend="zarr")
        try:
            r = SIZE_BLOCK[0]
            for i in range(self.nblocks):
                d.read(np.s_[i * r:(i + 1) * r, :], out=out)
                check(i, out)
        finally:
            d.close()


class _SizeCeiling(_SizeRaw):
    """numcodecs zstd of the same inner chunks over a pool, ``pwritev`` of the encoded
    chunks (one file per block, offsets kept in memory), ``fsync``; read and decode."""

    name = "ceiling zstd"

    def __init__(self, root: str, nblocks: int, inner: tuple, codec: str, pool: Any):
        import numcodecs
        self.dir = os.path.join(root, "ceiling")
        self.nblocks, self.inner, self.pool = nblocks, inner, pool
        self.codec = numcodecs.Zstd(level=ZSTD_LEVEL)
        self.index: dict = {}
        self.cols = [slice(c, c + inner[1]) for c in range(0, SIZE_BLOCK[1], inner[1])]
        self.rows = [slice(r, r + inner[0]) for r in range(0, SIZE_BLOCK[0], inner[0])]

    def files(self) -> list[str]:
        return _files_under(self.dir)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def fresh(self) -> None:
        self.remove()
        os.makedirs(self.dir)

    def _tiles(self) -> list[tuple]:
        return [(r, c) for r in self.rows for c in self.cols]

    def write_all(self, block_of: Any) -> None:
        fds = []
        try:
            for i in range(self.nblocks):
                x = block_of(i)
                parts = list(self.pool.map(
                    lambda t, x=x: self.codec.encode(np.ascontiguousarray(x[t])), self._tiles()))
                fd = os.open(os.path.join(self.dir, str(i)), os.O_WRONLY | os.O_CREAT, 0o600)
                fds.append(fd)
                views = [memoryview(p).cast("B") for p in parts]
                lens = [len(v) for v in views]
                offs = list(np.cumsum([0] + lens[:-1]))
                self.index[i] = list(zip(offs, lens))
                pos, k = 0, 0
                while k < len(views):
                    n = os.pwritev(fd, views[k:k + 1024], pos)
                    pos += n
                    while k < len(views) and n >= len(views[k]):
                        n -= len(views[k])
                        k += 1
                    if n:
                        views[k] = views[k][n:]
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)

    def read_all(self, out: np.ndarray, check: Any) -> None:
        buf = bytearray(SIZE_BLOCK[0] * SIZE_BLOCK[1] * 8 + (1 << 20))
        for i in range(self.nblocks):
            fd = os.open(os.path.join(self.dir, str(i)), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                mv = memoryview(buf)[:size]
                done = 0
                while done < size:
                    done += os.preadv(fd, [mv[done:]], done)
            finally:
                os.close(fd)

            def dec(a: tuple, mv: memoryview = mv) -> None:
                (off, ln), (r, c) = a
                tile = self.codec.decode(mv[off:off + ln])
                out[r, c] = np.frombuffer(tile, "f8").reshape(self.inner)
            list(self.pool.map(dec, zip(self.index[i], self._tiles())))
            check(i, out)


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "?"


def size_case(quick: bool, workdir: str, gib: float | None = None,
              rounds: int = SIZE_ROUNDS) -> list[dict]:
    """The size rows (see the module docstring)."""
    from chemio_py.backends.zarr.backend import default_inner
    gib = _size_gib(quick) if gib is None else gib
    block_bytes = SIZE_BLOCK[0] * SIZE_BLOCK[1] * 8
    nblocks = max(2, int(gib * (1 << 30)) // block_bytes)
    total = nblocks * block_bytes
    inner = default_inner(SIZE_BLOCK, 8)
    root = os.path.join(workdir, "size")
    os.makedirs(root, exist_ok=True)
    x = (np.random.default_rng(0).standard_normal(SIZE_BLOCK).astype(np.float32)
         .astype(np.float64))

    def block_of(i: int) -> np.ndarray:
        x[0, 0] = i
        return x

    def check(i: int, got: np.ndarray) -> None:
        if got[0, 0] != i or not np.array_equal(got[1:], x[1:]) or \
                not np.array_equal(got[0, 1:], x[0, 1:]):
            raise AssertionError(f"block {i} read back other data than was written")
    out = np.empty(SIZE_BLOCK)
    pool = cf.ThreadPoolExecutor(CEILING_THREADS, thread_name_prefix="ceiling")
    ms: list = [_SizeRaw(root, nblocks), _SizeChemio(root, nblocks, False, "none"),
                _SizeChemio(root, nblocks, None, "none"), _SizeChemio(root, nblocks, None, "zstd"),
                _SizeCeiling(root, nblocks, inner, "zstd", pool)]
    times: dict = {}
    loads = [_uptime()]
    try:
        for rnd in range(rounds):
            order = ms[rnd % len(ms):] + ms[:rnd % len(ms)]
            for m in order:     # one method's files on disk at a time: 32 GiB fits 5 times
                m.fresh()
                t, _ = _timed(lambda: m.write_all(block_of))  # noqa: B023 - called here
                times.setdefault((m.name, "write"), []).append(t)
                evict(*m.files())
                t, _ = _timed(lambda: m.read_all(out, check))  # noqa: B023 - called here
                times.setdefault((m.name, "read"), []).append(t)
                m.remove()
            loads.append(_uptime())
    finally:
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    what = (f"{total / (1 << 30):.2f} GiB of 64 MiB objects ({SIZE_BLOCK[0]}x{SIZE_BLOCK[1]} "
            f"f8), sharded = inner chunks {inner}; {rounds} rounds; load {' / '.join(loads)}")
    for op, label in (("write", "write+flush"), ("read", "cold read")):
        for m in ms[1:]:
            base = "ceiling zstd" if "zstd" in m.name and m.name != "ceiling zstd" else "raw"
            if m.name == base:
                continue
            mine, theirs = times[(m.name, op)], times[(base, op)]
            ratios = [b / a for a, b in zip(mine, theirs)]      # same round, side by side
            rows.append(row(f"zarr size {m.name} {label} vs {base}", "MiB/s",
                            mib_s(total, statistics.median(mine)), base,
                            mib_s(total, statistics.median(theirs)),
                            target=None if m.name == "ceiling zstd" else 0.9,
                            note=f"{what}; per-round ratios {min(ratios):.2f}–"
                                 f"{max(ratios):.2f}; MiB/s {m.name} {_rng(mine, total)}, "
                                 f"{base} {_rng(theirs, total)}"))
    return rows


# ---------------------------------------------------------------- rows

def _rng(ts: list[float], nbytes: int) -> str:
    lo, hi = mib_s(nbytes, max(ts)), mib_s(nbytes, min(ts))
    return f"{lo:.0f}–{hi:.0f}"


def run(quick: bool, workdir: str, small_only: bool = False) -> list[dict]:
    """All rows; ``small_only``: the small-object rows alone (no MPI, no size case)."""
    cfg = QUICK if quick else FULL
    if small_only:
        cfg = dict(cfg, layouts=("small",))
    n, s, reps = cfg["n"], cfg["s"], cfg["reps"]
    nbytes = s * s * 8
    x = (np.random.default_rng(0).standard_normal((s, s)).astype(np.float32)
         .astype(np.float64))
    out = np.zeros((s, s))
    problem = _chemio_problem(workdir)
    rows: list[dict] = []
    if problem is not None:
        rows.append(row("chemio zarr backend unavailable", "-", 0.0,
                        note=f"chemio rows skipped: {problem}"))
    pool = cf.ThreadPoolExecutor(CEILING_THREADS, thread_name_prefix="ceiling")
    try:
        for layout in cfg["layouts"]:
            obj, inner = LAYOUTS[layout]
            for codec in CODECS:
                root = os.path.join(workdir, f"{layout}-{codec}")
                os.makedirs(root)
                try:
                    times = _bench_one(root, n, s, reps, layout, codec, x, out,
                                       problem is None, pool)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                rows += _rows(times, layout, codec, obj, inner, n, s, nbytes, reps,
                              problem is None)
    finally:
        pool.shutdown()
    del x, out
    if small_only:
        return rows
    rows += _mpi_rows(cfg, n, s, workdir, problem)
    if problem is None:
        rows += size_case(quick, workdir)
    return rows


def _rows(times: dict, layout: str, codec: str, obj: tuple, inner: tuple | None, n: int,
          s: int, nbytes: int, reps: int, with_chemio: bool) -> list[dict]:
    rows = []
    what = (f"{s}x{s} of {n}x{n} f8, objects {obj[0]}x{obj[1]}"
            + (f" sharded {inner[0]}x{inner[1]}" if inner else "") + f", {codec}")
    small = layout == "small"
    targets = ({"zarr-python": 2.0, "TensorStore": 1.0, "ceiling": None} if small else
               {"zarr-python": 1.0, "TensorStore": None, "ceiling": 0.8})
    for op in ("write", "cold read"):
        for case in ("aligned", "non-aligned"):
            def bw(name: str, op: str = op, case: str = case) -> float:
                return mib_s(nbytes, statistics.median(times[(name, op, case)]))
            others = "; ".join(f"{nm} {_rng(times[(nm, op, case)], nbytes)}"
                               for nm in ("chemio", "zarr-python", "TensorStore", "ceiling")
                               if (nm, op, case) in times)
            note = f"{what}; median of {reps}; MiB/s ranges: {others}"
            if with_chemio:
                for other in ("zarr-python", "TensorStore", "ceiling"):
                    best = min(times[(other, op, case)]) / min(times[("chemio", op, case)])
                    rows.append(row(f"zarr {layout} {codec} {op} {case}: chemio vs {other}",
                                    "MiB/s", bw("chemio"), other, bw(other),
                                    target=targets[other],
                                    note=f"{note}; best-of ratio {best:.2f}"))
            else:
                for other in ("zarr-python", "TensorStore"):
                    rows.append(row(f"zarr {layout} {codec} {op} {case}: {other} vs ceiling",
                                    "MiB/s", bw(other), "ceiling", bw("ceiling"), note=note))
    return rows


def _mpi_rows(cfg: dict, n: int, s: int, workdir: str, problem: str | None) -> list[dict]:
    job = dict(n=n, s=s, layout=MPI_LAYOUT, codec=MPI_CODEC, trials=cfg["mpi_trials"])
    obj, _ = LAYOUTS[MPI_LAYOUT]
    what = (f"{MPI_PROCS} ranks, {s}x{s} non-aligned section of {n}x{n} f8 in column strips "
            f"cut mid-object, objects {obj[0]}x{obj[1]} {MPI_CODEC}, {cfg['mpi_trials']} trial(s)")
    zp = _run_mpi("zarr", job, workdir)
    zp_t = statistics.median(r["seconds"] for r in zp)
    zp_lost = sum(r["lost"] for r in zp)
    nbytes = s * s * 8
    rows = [row(f"zarr {MPI_PROCS}-rank unaligned write: zarr-python lost elements", "elements",
                zp_lost, note=f"{what}; per trial: {[r['lost'] for r in zp]} of {s * s}; "
                              f"{mib_s(nbytes, zp_t):.0f} MiB/s")]
    if problem is not None:
        return rows
    ch = _run_mpi("chemio", job, workdir)
    ch_t = statistics.median(r["seconds"] for r in ch)
    ch_lost = sum(r["lost"] for r in ch)
    rows.append(row(f"zarr {MPI_PROCS}-rank unaligned write_all: chemio lost elements",
                    "elements", ch_lost, note=f"{what}; must be 0; per trial: "
                                              f"{[r['lost'] for r in ch]}"))
    rows.append(row(f"zarr {MPI_PROCS}-rank unaligned write_all: chemio no loss", "ok",
                    1.0 if ch_lost == 0 else 0.0, "required", 1.0, target=1.0,
                    note="1 when write_all lost no element in any trial"))
    rows.append(row(f"zarr {MPI_PROCS}-rank unaligned write_all: chemio vs zarr-python",
                    "MiB/s", mib_s(nbytes, ch_t), "zarr-python (loses data)",
                    mib_s(nbytes, zp_t),
                    note=f"{what}; barrier to barrier, median; chemio "
                         f"{min(r['seconds'] for r in ch):.2f}–"
                         f"{max(r['seconds'] for r in ch):.2f} s, zarr-python "
                         f"{min(r['seconds'] for r in zp):.2f}–"
                         f"{max(r['seconds'] for r in zp):.2f} s"))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--mpi-worker":
        _mpi_worker(json.loads(sys.argv[2]))
    else:
        import tempfile
        quick = "--full" not in sys.argv
        if "--size-gib" in sys.argv:
            os.environ["CHEMIO_BENCH_ZARR_GIB"] = sys.argv[sys.argv.index("--size-gib") + 1]
        n_rounds = (int(sys.argv[sys.argv.index("--size-rounds") + 1])
                    if "--size-rounds" in sys.argv else SIZE_ROUNDS)
        with tempfile.TemporaryDirectory(prefix="bench-zarr-") as d:
            rows = size_case(quick, d, rounds=n_rounds) if "--size-only" in sys.argv else \
                run(quick, d, "--small-only" in sys.argv)
            for r in rows:
                ratio = "" if r["ratio"] is None else f"  x{r['ratio']:.2f}"
                tgt = "" if r["target"] is None else f" (target {r['target']})"
                print(f"{r['case']:<62} {r['value']:9.1f} {r['metric']}{ratio}{tgt}")
                if "--notes" in sys.argv:
                    print(f"    {r['note']}")
