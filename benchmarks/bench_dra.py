"""DRA benchmark after the ChemIO DRA microbenchmark, scaled to this machine.

An 8000 x 8000 float64 disk array (512 MB; quick mode 2000 x 2000, 32 MB) with the default
layout (chunks 500 x 1000 = 4 MB). A 4000 x 4000 section (quick: 1000 x 1000) is written and
read back, once aligned (it starts at (0, 0), on chunk boundaries) and once not aligned
(it starts at (250, 750)). Each write starts with the file out of the page cache (the
state of an out-of-core array that was written long ago) and is made durable (data sync)
inside its timing; each cold read follows an eviction of the files from the page cache
(fsync + fadvise DONTNEED);
the hot read repeats it with the pages cached (the first read after the cold one: for
``numpy.memmap`` the cold read mapped the pages already), "hot read again" once more.
Reads land in one preallocated array.

Methods, on the same data in the same run, interleaved in rotating order:

* ``DRA`` — ``cio.DiskArray`` (local backend), ``write`` + ``flush`` / ``read(sec, out)``;
  also ``DRA hinted``, created with ``request_shape`` = the section shape (informational: an
  aligned section is then one contiguous range; with the default 4 MB chunks a section
  covers half of each chunk row, so its reads skip every other 16 MB of the file);
* ``DRA checksum`` — the same ``DRA`` created with ``checksum=True`` (a CRC-32 per chunk,
  issue 27): every write recomputes the CRCs of the chunks it touches (a chunk written in
  part is read back whole), every read checks them (a chunk read in part is read whole).
  Reported as its ratio to ``DRA`` in the same run: the cost of opting in (informational);
* ``raw`` — sequential ``os.pwritev`` of the same number of bytes into a preallocated file
  (4 MiB calls) + ``fdatasync``, and sequential ``os.preadv`` of them into the same
  destination array: the device limit as this process sees it;
* ``raw stretches`` — sequential ``os.preadv`` (4 MiB calls) of the stretches of the DRA
  file the section occupies, gaps skipped (reads only; needs ``DRA``): the device's speed
  for this layout. With the default chunks an aligned section is every other 16 MB of
  the file, which the device serves at about half its contiguous speed here (fio psync
  reading 16 MB and skipping 16 MB: 0.47x its contiguous figure), so the DRA's cold reads
  are compared with it as well as with ``raw``;
* ``numpy.memmap`` of the array as a plain C-ordered file (``flush`` + fsync after writes);
* ``memory copy`` — the same strided copy of the section from an in-memory array (hot rows
  only: the machine's copy bandwidth, the ceiling of a hot read; issue 28 asks >= 0.9x
  ``numpy.memmap`` hot, and figures move with the machine, so the ceiling is beside them);
* ``memory copy 4k`` — the same copy from an in-memory array on 4 KiB pages (no transparent
  huge pages, which NumPy asks for on large arrays): the ceiling of a copy out of the page
  cache, which a mapping of a file on disk sees through 4 KiB page-table entries;
* ``h5py`` — a chunked dataset with the same chunk shape, no compression (file fsync'ed);
* ``zarr`` — v3 array with the same chunks, no compression (every chunk file fsync'ed).

Targets (from the issues): DRA cold aligned read >= 0.8x raw, cold non-aligned >= 0.6x;
aligned writes >= 0.8x raw; DRA faster than each of memmap, h5py and zarr in every case
(>= 1x; for non-aligned writes, which must read the partial pages at the section edges
first, that is the target: raw is informational); with ``request_shape`` = the section,
cold aligned reads >= 1x h5py (whose file, filled in write order, holds the aligned
section's chunks one after another, while the DRA grid keeps every other 16 MB of the
file between the section's rows of chunks).
fio's O_DIRECT sequential read (1 MiB, QD16) of the same bytes is reported when installed.
``python benchmarks/bench_dra.py [--full] [--methods=DRA,DRA checksum]`` runs the named
methods alone (those two: the cost of checksums), rows of the others left out.
``--methods=DRA,DRA nofill,raw`` adds ``DRA nofill`` (only when named): the same reads with
the page-table fill after cold reads off (``posix.page_tables``), to see what the fill
costs a cold read beside what it saves the next hot one.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MiB, evict, fio_available, mib_s, run_fio  # noqa: E402
from common import row as _row  # noqa: E402

FULL = dict(n=8000, s=4000, reps=7)
QUICK = dict(n=2000, s=1000, reps=3)
OFFSET = (250, 750)
RAW_CALL = 4 * MiB


def _fsync(*paths: str) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for d, _, names in os.walk(path):
        out += [os.path.join(d, n) for n in names]
    return out


class _Method:
    name = "?"

    def files(self) -> list[str]:
        raise NotImplementedError

    def write(self, sec: tuple, x: np.ndarray) -> None:
        raise NotImplementedError

    def evict(self) -> None:
        evict(*self.files())

    def open_for_read(self) -> None:
        pass

    def read(self, sec: tuple, out: np.ndarray) -> None:
        raise NotImplementedError

    def close_after_read(self) -> None:
        pass

    def close(self) -> None:
        pass


class _DRA(_Method):
    name = "DRA"

    def __init__(self, workdir: str, n: int, request_shape: tuple | None = None,
                 checksum: bool = False, fill: bool = True):
        import chemio_py as cio
        self.fill = fill
        if request_shape is not None:
            self.name = "DRA hinted"
        if checksum:
            self.name = "DRA checksum"
        if not fill:
            self.name = "DRA nofill"
        self.d = cio.DiskArray.create("bench", (n, n), "f8", request_shape=request_shape,
                                      path=os.path.join(workdir, f"{self.name[4:] or 'a'}.dra"),
                                      checksum=checksum)

    def files(self) -> list[str]:
        if self.d.checksum:
            from chemio_py.arrays.checksums import crc_path
            return [self.d.path, crc_path(self.d.path)]
        return [self.d.path]

    def evict(self) -> None:
        # The store keeps a read-only mapping of its file for hot reads; mapped pages
        # escape fadvise(DONTNEED) until it is dropped (as a user's memmap must be closed).
        self.d.evict()
        evict(*self.files())

    def write(self, sec: tuple, x: np.ndarray) -> None:
        self.d.write(sec, x)
        self.d.flush()

    def read(self, sec: tuple, out: np.ndarray) -> None:
        if self.fill:
            self.d.read(sec, out)
            return
        from chemio_py.backends import posix
        ok, posix.page_tables.ok = posix.page_tables.ok, False
        try:
            self.d.read(sec, out)
        finally:
            posix.page_tables.ok = ok

    def close(self) -> None:
        self.d.delete()


class _Raw(_Method):
    name = "raw"

    def __init__(self, workdir: str, nbytes: int):
        self.path = os.path.join(workdir, "raw.bin")
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)

    def files(self) -> list[str]:
        return [self.path]

    def write(self, sec: tuple, x: np.ndarray) -> None:
        mv = memoryview(x.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for off in range(0, self.nbytes, RAW_CALL):
                part = mv[off:off + RAW_CALL]
                while len(part):
                    k = os.pwritev(fd, [part], off)
                    part, off = part[k:], off + k
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def read(self, sec: tuple, out: np.ndarray) -> None:
        mv = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for off in range(0, self.nbytes, RAW_CALL):
                part = mv[off:off + RAW_CALL]
                while len(part):
                    k = os.preadv(fd, [part], off)
                    if k == 0:
                        raise EOFError(self.path)
                    part, off = part[k:], off + k
        finally:
            os.close(fd)


class _RawStretches(_Method):
    """Sequential ``os.preadv`` (4 MiB calls) of the stretches of the DRA file that the
    section occupies (``Layout.extents``), into a scratch buffer: the device's speed for
    the bytes of that layout, gaps between the stretches included (with the default
    chunks an aligned section is every other 16 MB of the file). Reads only."""
    name = "raw stretches"
    checks = False

    def __init__(self, dra: "_DRA"):
        self.dra = dra
        self.buf: np.ndarray | None = None

    def files(self) -> list[str]:
        return [self.dra.d.path]

    def evict(self) -> None:
        self.dra.evict()

    def write(self, sec: tuple, x: np.ndarray) -> None:
        pass                            # the DRA method writes the file

    def read(self, sec: tuple, out: np.ndarray) -> None:
        from chemio_py.backends.grid import Layout
        d = self.dra.d
        lay = Layout(d.shape, d.chunks, d.dtype.itemsize)
        firsts, ends = lay.extents(sec)
        total = int((ends - firsts).sum())
        if self.buf is None or self.buf.nbytes < total:
            self.buf = np.empty(total, np.uint8)
        mv = memoryview(self.buf)
        fd = os.open(d.path, os.O_RDONLY)
        try:
            at = 0
            for a, b in zip(firsts.tolist(), ends.tolist()):
                for off in range(a, b, RAW_CALL):
                    n = min(RAW_CALL, b - off)
                    os.preadv(fd, [mv[at:at + n]], off)
                    at += n
        finally:
            os.close(fd)


class _Memmap(_Method):
    name = "numpy.memmap"

    def __init__(self, workdir: str, n: int):
        self.path = os.path.join(workdir, "memmap.bin")
        self.shape = (n, n)
        np.memmap(self.path, dtype="f8", mode="w+", shape=self.shape).flush()
        self.mm = None

    def files(self) -> list[str]:
        return [self.path]

    def write(self, sec: tuple, x: np.ndarray) -> None:
        mm = np.memmap(self.path, dtype="f8", mode="r+", shape=self.shape)
        mm[sec] = x
        mm.flush()
        del mm
        _fsync(self.path)

    def open_for_read(self) -> None:
        self.mm = np.memmap(self.path, dtype="f8", mode="r", shape=self.shape)

    def read(self, sec: tuple, out: np.ndarray) -> None:
        np.copyto(out, self.mm[sec])

    def close_after_read(self) -> None:
        self.mm = None


class _RamCopy(_Method):
    """The same strided copy from an in-memory array (the ceiling of a hot read on this
    machine: its memory-copy bandwidth)."""
    name = "memory copy"

    def __init__(self, n: int):
        self.a = np.zeros((n, n))

    def files(self) -> list[str]:
        return []

    def evict(self) -> None:
        pass

    def write(self, sec: tuple, x: np.ndarray) -> None:
        self.a[sec] = x

    def read(self, sec: tuple, out: np.ndarray) -> None:
        np.copyto(out, self.a[sec])


class _RamCopy4k(_RamCopy):
    """``_RamCopy`` from memory on 4 KiB pages (``MADV_NOHUGEPAGE``): the TLB cost a mapped
    file's pages carry, without the file."""
    name = "memory copy 4k"

    def __init__(self, n: int):
        import mmap
        self._mm = mmap.mmap(-1, n * n * 8)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._mm.madvise(mmap.MADV_NOHUGEPAGE)
        self.a = np.frombuffer(self._mm, np.float64).reshape(n, n)
        self.a[...] = 0


class _H5(_Method):
    name = "h5py"

    def __init__(self, workdir: str, n: int, chunks: tuple):
        import h5py
        self.h5py = h5py
        self.path = os.path.join(workdir, "a.h5")
        with h5py.File(self.path, "w") as f:
            f.create_dataset("a", shape=(n, n), dtype="f8", chunks=chunks)
        self.f = None

    def files(self) -> list[str]:
        return [self.path]

    def write(self, sec: tuple, x: np.ndarray) -> None:
        with self.h5py.File(self.path, "r+") as f:
            f["a"].write_direct(x, dest_sel=sec)
        _fsync(self.path)

    def open_for_read(self) -> None:
        self.f = self.h5py.File(self.path, "r")

    def read(self, sec: tuple, out: np.ndarray) -> None:
        self.f["a"].read_direct(out, source_sel=sec)

    def close_after_read(self) -> None:
        self.f.close()
        self.f = None


class _Zarr(_Method):
    name = "zarr"

    def __init__(self, workdir: str, n: int, chunks: tuple):
        import zarr
        self.zarr = zarr
        self.path = os.path.join(workdir, "a.zarr")
        zarr.create_array(store=self.path, shape=(n, n), chunks=chunks, dtype="f8",
                          compressors=None, fill_value=0.0)
        self.z = None

    def files(self) -> list[str]:
        return _files_under(self.path)

    def write(self, sec: tuple, x: np.ndarray) -> None:
        z = self.zarr.open_array(self.path, mode="r+")
        z[sec] = x
        _fsync(*self.files())

    def open_for_read(self) -> None:
        self.z = self.zarr.open_array(self.path, mode="r")

    def read(self, sec: tuple, out: np.ndarray) -> None:
        out[...] = self.z[sec]

    def close_after_read(self) -> None:
        self.z = None


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(quick: bool, workdir: str, methods: Sequence[str] | None = None) -> list[dict]:
    """The rows; ``methods`` limits the run to these method names (e.g. ``("DRA", "DRA
    checksum")`` for the cost of checksums alone), rows of the others left out."""
    cfg = QUICK if quick else FULL
    n, s, reps = cfg["n"], cfg["s"], cfg["reps"]
    nbytes = s * s * 8
    x = np.random.default_rng(0).standard_normal((s, s))
    out = np.zeros((s, s))
    cases = {"aligned": (slice(0, s), slice(0, s)),
             "non-aligned": (slice(OFFSET[0], OFFSET[0] + s), slice(OFFSET[1], OFFSET[1] + s))}

    names = ["DRA", "DRA hinted", "DRA checksum", "raw", "raw stretches", "numpy.memmap",
             "memory copy", "memory copy 4k", "h5py", "zarr"]
    optional = ["DRA nofill"]           # only when asked for by name (--methods=...)
    unknown = sorted(set(methods or ()) - set(names) - set(optional))
    if unknown:
        raise ValueError(f"bench_dra has no method {unknown}; choose from {names + optional}")
    wanted = set(names if methods is None else methods)
    chosen: list[_Method] = []
    notes = []
    dra = _DRA(workdir, n)
    chunks = dra.d.chunks
    chosen += [dra, _DRA(workdir, n, request_shape=(s, s))] if "DRA hinted" in wanted \
        else [dra]
    if "DRA checksum" in wanted:
        chosen.append(_DRA(workdir, n, checksum=True))
    if "DRA nofill" in wanted:
        chosen.append(_DRA(workdir, n, fill=False))
    if "raw" in wanted:
        chosen.append(_Raw(workdir, nbytes))
    if "raw stretches" in wanted and "DRA" in wanted:
        chosen.append(_RawStretches(dra))       # reads the DRA method's file
    if "numpy.memmap" in wanted:
        chosen.append(_Memmap(workdir, n))
    if "memory copy" in wanted:
        chosen.append(_RamCopy(n))
    if "memory copy 4k" in wanted:
        chosen.append(_RamCopy4k(n))
    for cls in (_H5, _Zarr):
        if cls.name not in wanted:
            continue
        try:
            chosen.append(cls(workdir, n, chunks))
        except ImportError as e:
            notes.append(f"{cls.name} skipped ({e})")
    if "DRA" not in wanted:
        chosen.remove(dra)
        dra.close()
    methods = chosen
    times: dict[tuple, list[float]] = {}
    try:
        for rep in range(reps):
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]
            for case, sec in cases.items():
                for m in order:
                    m.evict()              # every write starts from the same state
                    times.setdefault((m.name, "write", case), []).append(
                        _timed(lambda: m.write(sec, x)))  # noqa: B023 - called at once
                for m in order:
                    m.evict()
                    m.open_for_read()
                    out[...] = 0.0
                    t = _timed(lambda: m.read(sec, out))  # noqa: B023 - called at once
                    if rep == 0 and getattr(m, "checks", True) and not np.array_equal(out, x):
                        raise AssertionError(f"{m.name} read back other data ({case})")
                    times.setdefault((m.name, "cold read", case), []).append(t)
                    t = _timed(lambda: m.read(sec, out))  # noqa: B023 - called at once
                    times.setdefault((m.name, "hot read", case), []).append(t)
                    t = _timed(lambda: m.read(sec, out))  # noqa: B023 - called at once
                    times.setdefault((m.name, "hot read again", case), []).append(t)
                    m.close_after_read()
        fio_mib = None
        if fio_available() and "raw" in wanted:
            raw = next(m for m in methods if m.name == "raw")
            for engine in ("libaio", "psync"):
                try:
                    res = run_fio(name="seqread", filename=raw.path, rw="read", bs="1m",
                                  size=str(nbytes), direct=1, ioengine=engine,
                                  iodepth=16 if engine == "libaio" else 1)
                    fio_mib = res["read_mib_s"]
                    fio_engine = engine
                    break
                except RuntimeError:
                    continue
    finally:
        for m in methods:
            m.close()

    def bw(name: str, op: str, case: str) -> float | None:
        t = times.get((name, op, case))
        return None if not t else mib_s(nbytes, statistics.median(t))

    def row(case: str, metric: str, value: float | None, *args: Any, **kw: Any) -> dict:
        return _row(case, metric, value, *args, **kw) if value is not None else {}

    size = f"{s}x{s} of {n}x{n} f8, chunks {chunks[0]}x{chunks[1]}"
    rows = []
    targets = {("write", "aligned"): 0.8,
               ("cold read", "aligned"): 0.8, ("cold read", "non-aligned"): 0.6}
    for op in ("write", "cold read", "hot read", "hot read again"):
        for case in cases:
            mine = bw("DRA", op, case)
            base = "raw pwritev (preallocated, seq)" if op == "write" else "raw preadv (seq)"
            rows.append(row(f"DRA {op} {case}", "MiB/s", mine, base, bw("raw", op, case),
                            target=targets.get((op, case)),
                            note=f"{size}; median of {reps}"))
            rows.append(row(f"DRA (request_shape={s}x{s}) {op} {case}", "MiB/s",
                            bw("DRA hinted", op, case), base, bw("raw", op, case),
                            note=f"one {s}x{s} chunk per aligned section; median of {reps}"))
    for op in ("write", "cold read", "hot read", "hot read again"):
        for case in cases:
            rows.append(row(f"DRA checksum=True vs False: {op} {case}", "MiB/s",
                            bw("DRA checksum", op, case), "DRA (checksum=False)",
                            bw("DRA", op, case),
                            note=f"CRC-32 per chunk, checked on read; {size}; median of {reps}"))
    for case in cases:
        rows.append(row(f"DRA cold read {case} vs raw of the same stretches", "MiB/s",
                        bw("DRA", "cold read", case), "raw preadv of the DRA file's stretches",
                        bw("raw stretches", "cold read", case),
                        note="the device's speed for this layout: the section's stretches "
                             f"of the DRA file, gaps between them skipped; {size}"))
        rows.append(row(f"raw of the same stretches vs raw (contiguous) cold read {case}",
                        "MiB/s", bw("raw stretches", "cold read", case), "raw preadv (seq)",
                        bw("raw", "cold read", case),
                        note="what the layout's gaps cost the device alone (informational)"))
    if bw("h5py", "cold read", "aligned") is not None:
        rows.append(row(f"DRA (request_shape={s}x{s}) vs h5py: cold read aligned", "MiB/s",
                        bw("DRA hinted", "cold read", "aligned"), "h5py",
                        bw("h5py", "cold read", "aligned"), target=1.0,
                        note=f"h5py with the default DRA chunks; median of {reps}"))
    for op in ("write", "cold read", "hot read", "hot read again"):
        for case in cases:
            for other in ("numpy.memmap", "h5py", "zarr"):
                theirs = bw(other, op, case)
                if theirs is None:
                    continue
                rows.append(row(f"DRA vs {other}: {op} {case}", "MiB/s", bw("DRA", op, case),
                                other, theirs, target=1.0, note=f"{size}; median of {reps}"))
    for op in ("cold read", "hot read"):
        for case in cases:
            rows.append(row(f"DRA page-table fill off vs on: {op} {case}", "MiB/s",
                            bw("DRA nofill", op, case), "DRA (fill on)", bw("DRA", op, case),
                            note="informational: the fill (posix.page_tables) runs beside a "
                                 f"cold read's I/O and saves the next hot read its faults; {size}"))
    for op in ("hot read", "hot read again"):
        for case in cases:
            ram4k = bw("memory copy 4k", op, case)
            if ram4k is not None:
                rows.append(row(f"DRA vs memory copy on 4 KiB pages: {op} {case}", "MiB/s",
                                bw("DRA", op, case), "memory copy 4k", ram4k,
                                note="the ceiling through a file mapping's 4 KiB pages; "
                                     f"median of {reps}"))
            ram = bw("memory copy", op, case)
            if ram is None:
                continue
            rows.append(row(f"memory copy (same strided copy from RAM) {op} {case}", "MiB/s",
                            ram, None, None, note=f"the ceiling of a hot read here; {size}"))
            rows.append(row(f"DRA vs memory copy: {op} {case}", "MiB/s", bw("DRA", op, case),
                            "memory copy", ram, target=0.9,
                            note=f"fixed cost per call on top of the copy; median of {reps}"))
    if fio_mib is not None:
        rows.append(row("fio seq read (O_DIRECT, 1 MiB)", "MiB/s", fio_mib, None, None,
                        note=f"{nbytes // MiB} MiB, ioengine {fio_engine}: the device alone"))
        rows.append(row("DRA cold read aligned vs fio", "MiB/s", bw("DRA", "cold read", "aligned"),
                        "fio seq read", fio_mib, note="informational"))
    for note in notes:
        rows.append(row("skipped", "-", 0.0, note=note))
    return [r for r in rows if r]


if __name__ == "__main__":
    import tempfile
    quick = "--full" not in sys.argv
    only = [a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--methods=")]
    with tempfile.TemporaryDirectory(prefix="bench-dra-") as d:
        for r in run(quick, d, only[-1] if only else None):
            ratio = "" if r["ratio"] is None else f"  x{r['ratio']:.2f}"
            tgt = "" if r["target"] is None else f" (target {r['target']})"
            print(f"{r['case']:<42} {r['value']:9.1f} {r['metric']}{ratio}{tgt}")
