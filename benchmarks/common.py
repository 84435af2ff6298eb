"""Shared helpers for ``benchmarks/bench_*.py`` modules.

Import with ``from common import ...``: the runner puts this directory first on ``sys.path``
before it loads a benchmark module (a module run on its own can do the same with
``sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))``).

Stable API:

* ``KiB``, ``MiB``, ``GiB``; ``mib_s(nbytes, seconds)``.
* ``measure(fn, repeat=5, setup=None, warmup=0) -> Timing`` — wall time of ``fn()`` per
  repetition; ``setup()`` runs untimed before each one (e.g. ``evict``). ``Timing`` has
  ``times``, ``median``, ``best``, ``mean``. ``Stopwatch`` is a ``with`` block timer.
* ``evict(*paths)`` — fsync + ``posix_fadvise(DONTNEED)``: the next read comes from the device;
  ``resident_fraction(path)`` — share of the file in the page cache (mincore), to check it.
* ``fio_available()``, ``fio_version()``, ``run_fio(**job) -> dict | None``.
* ``row(case, metric, value, baseline_name=None, baseline=None, target=None, note="",
  lower_is_better=False) -> dict`` and ``verdict(row) -> True | False | None``.
* ``raw_write_seq(path, nbytes, chunk, fsync=True)`` / ``raw_read_seq(path, nbytes, chunk)`` —
  plain sequential ``os.pwritev`` / ``os.preadv`` loops (seconds), the "physical limit"
  reference in Python.
* ``scratch_base()``, ``workdir(prefix)`` (context manager, removed afterwards),
  ``fresh_dir(parent, name)``.
* ``payload(nbytes, seed)``, ``slot_permutation(nslots, seed)``, ``fs_type(path)``,
  ``machine_info(path)``.
* ``peak_mib(fn)`` — peak memory (MiB, tracemalloc) that ``fn()`` allocates above what was
  allocated before it.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Any, Callable, Iterator

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def mib_s(nbytes: int | float, seconds: float) -> float:
    """Bandwidth in MiB/s (``inf`` when ``seconds`` is 0)."""
    return float(nbytes) / MiB / seconds if seconds > 0 else float("inf")


# ------------------------------------------------------------------ timing

class Timing:
    """Wall times of repeated runs; report ``median`` (robust) or ``best`` (least noise)."""

    def __init__(self, times: list[float]):
        self.times = list(times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    def __repr__(self) -> str:
        return f"Timing(median={self.median:.6f}s, best={self.best:.6f}s, n={len(self.times)})"


def peak_mib(fn: Callable[[], Any]) -> float:
    """Peak memory ``fn()`` allocates above what was allocated before it (MiB)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return (tracemalloc.get_traced_memory()[1] - before) / MiB
    finally:
        tracemalloc.stop()


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.seconds``."""

    seconds: float = 0.0

    def __enter__(self) -> "Stopwatch":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self._t0


def measure(fn: Callable[[], Any], repeat: int = 5, setup: Callable[[], Any] | None = None,
            warmup: int = 0) -> Timing:
    """Time ``fn()`` ``repeat`` times; ``setup()`` (untimed) runs before every call,
    including the ``warmup`` calls whose times are dropped."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    times = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return Timing(times)


# ------------------------------------------------------------------ page cache

def evict(*paths: str) -> None:
    """Write back and drop ``paths`` (files) from the page cache: fsync, then
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` over the whole file. Missing paths are skipped.

    ``/proc/sys/vm/drop_caches`` is usually not writable for us; this works per file as long
    as no mapping of the file is alive (delete ``numpy.memmap`` objects first)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_after_write(path: str) -> None:
    """Alias of ``evict`` for a phase that wrote ``path`` (reads the intent better)."""
    evict(path)


def resident_fraction(path: str) -> float | None:
    """Share of ``path``'s pages now in the page cache (mincore), or None when unknown.

    Use it to check that ``evict`` worked before a cold phase."""
    import ctypes
    import mmap
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            npages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(npages)
            if libc.mincore(addr, size, vec) != 0:
                return None
            return float(np.frombuffer(vec.raw, np.uint8)[:npages].__and__(1).mean())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ fio

def fio_available() -> bool:
    """True when an ``fio`` executable is on PATH."""
    return shutil.which("fio") is not None


def fio_version() -> str | None:
    """``fio --version`` (e.g. ``fio-3.33``) or None when fio is absent."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _fio_side(jobs: list[dict], side: str) -> dict:
    bw = sum(j[side].get("bw_bytes", j[side].get("bw", 0) * 1024) for j in jobs)
    iops = sum(j[side].get("iops", 0.0) for j in jobs)
    lat = [j[side].get("lat_ns", {}).get("mean", 0.0) for j in jobs if j[side].get("io_bytes")]
    return {"mib_s": bw / MiB, "iops": float(iops),
            "lat_mean_us": (statistics.fmean(lat) / 1000.0) if lat else None,
            "io_bytes": sum(j[side].get("io_bytes", 0) for j in jobs)}


def run_fio(timeout: float = 600, **job: Any) -> dict | None:
    """Run one fio job and return its figures, or None when fio is absent.

    Keyword arguments are fio options: ``run_fio(name="rr", filename=p, rw="randread",
    bs="4k", size="64m", iodepth=16, ioengine="libaio", direct=1)``. ``True`` becomes a bare
    flag (``group_reporting=True``), ``None``/``False`` are left out. ``name`` defaults to
    ``"bench"``. Returns ``{"read_mib_s", "read_iops", "read_lat_us", "write_mib_s",
    "write_iops", "write_lat_us", "read": {...}, "write": {...}, "raw": <fio JSON>}`` with the
    numbers summed over fio's jobs. A failing fio raises ``RuntimeError`` with its stderr."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    job.setdefault("name", "bench")
    cmd = [exe, "--output-format=json"]
    for key, val in job.items():
        if val is None or val is False:
            continue
        cmd.append(f"--{key}" if val is True else f"--{key}={val}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stderr.strip()}")
    text = proc.stdout
    raw = json.loads(text[text.index("{"):])   # fio may print notes before the JSON
    jobs = raw.get("jobs", [])
    out: dict[str, Any] = {"raw": raw}
    for side in ("read", "write"):
        figs = _fio_side(jobs, side)
        out[side] = figs
        out[f"{side}_mib_s"] = figs["mib_s"]
        out[f"{side}_iops"] = figs["iops"]
        out[f"{side}_lat_us"] = figs["lat_mean_us"]
    return out


# ------------------------------------------------------------------ result rows

# Set by ``runner.py --smoke``: the least work that still makes every row (a harness check).
SMOKE = False
ROW_KEYS = ("case", "metric", "value", "baseline_name", "baseline", "ratio", "target", "note")


def row(case: str, metric: str, value: float, baseline_name: str | None = None,
        baseline: float | None = None, target: float | None = None, note: str = "",
        lower_is_better: bool = False) -> dict:
    """A result row; ``ratio = value / baseline`` (None without a baseline).

    ``target`` is the issue's ratio target: met when ``ratio >= target``, or
    ``ratio <= target`` with ``lower_is_better=True`` (the row then carries
    ``"better": "lower"``)."""
    value = float(value)
    base = None if baseline is None else float(baseline)
    ratio = None if base in (None, 0.0) else value / base
    r = {"case": str(case), "metric": str(metric), "value": value,
         "baseline_name": baseline_name, "baseline": base, "ratio": ratio,
         "target": None if target is None else float(target), "note": str(note)}
    if lower_is_better:
        r["better"] = "lower"
    return r


def verdict(r: dict) -> bool | None:
    """True/False when the row has a target and a ratio, else None."""
    if r.get("target") is None or r.get("ratio") is None:
        return None
    if r.get("better") == "lower":
        return r["ratio"] <= r["target"]
    return r["ratio"] >= r["target"]


# ------------------------------------------------------------------ raw references

def payload(nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` random bytes as a uint8 array (incompressible, reproducible)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def slot_permutation(nslots: int, seed: int = 0) -> np.ndarray:
    """A random permutation of ``range(nslots)`` (record slots in random order)."""
    return np.random.default_rng(seed).permutation(nslots)


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.pwritev(fd, [mv], offset)
        mv, offset = mv[n:], offset + n


def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n == 0:
            raise EOFError(f"short file: nothing at offset {offset}")
        mv, offset = mv[n:], offset + n


def raw_write_seq(path: str, nbytes: int, chunk: int = MiB, fsync: bool = True,
                  buf: Any = None) -> float:
    """Seconds to write ``nbytes`` sequentially to ``path`` (created/truncated) with
    ``os.pwritev`` in ``chunk``-byte pieces from ``buf`` (default: random bytes),
    including the fsync when ``fsync``."""
    mv = memoryview(payload(chunk) if buf is None else buf).cast("B")[:chunk]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < nbytes:
            n = min(chunk, nbytes - off)
            _pwrite_all(fd, mv[:n], off)
            off += n
        if fsync:
            os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def raw_read_seq(path: str, nbytes: int | None = None, chunk: int = MiB,
                 buf: Any = None) -> float:
    """Seconds to read ``nbytes`` (default: the whole file) sequentially with
    ``os.preadv`` into one ``chunk``-byte buffer. Evict first for a cold read."""
    mv = memoryview(np.empty(chunk, np.uint8) if buf is None else buf).cast("B")[:chunk]
    fd = os.open(path, os.O_RDONLY)
    try:
        total = os.fstat(fd).st_size if nbytes is None else nbytes
        t0 = time.perf_counter()
        off = 0
        while off < total:
            n = min(chunk, total - off)
            _pread_all(fd, mv[:n], off)
            off += n
        return time.perf_counter() - t0
    finally:
        os.close(fd)


# ------------------------------------------------------------------ work directories

def scratch_base() -> str:
    """Where benchmark files go: the first plain directory of ``CHEMIO_SCRATCH`` that
    exists, else the system temp directory (``/tmp``)."""
    for tok in os.environ.get("CHEMIO_SCRATCH", "").split(","):
        tok = tok.strip()
        if ":" in tok and not tok.startswith("/"):
            tok = tok.split(":", 1)[1]
        tok = os.path.expanduser(tok)
        if tok and os.path.isdir(tok):
            return tok
    return tempfile.gettempdir()


@contextlib.contextmanager
def workdir(prefix: str = "chemio-bench-", base: str | None = None,
            keep: bool = False) -> Iterator[str]:
    """A fresh private directory under ``base`` (default ``scratch_base()``), removed
    with everything in it on exit unless ``keep``."""
    path = tempfile.mkdtemp(prefix=prefix, dir=base or scratch_base())
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def fresh_dir(parent: str, name: str) -> str:
    """``parent/name`` emptied and (re)created: one benchmark's own corner of the workdir."""
    path = os.path.join(parent, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, mode=0o700)
    return path


# ------------------------------------------------------------------ machine info

def fs_type(path: str) -> str:
    """File-system type holding ``path`` from the mount table (``unknown`` if not found)."""
    from chemio_py.scratch.fs import fstype
    return fstype(path)


def _meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * KiB
    except OSError:
        pass
    return out


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info(path: str | None = None) -> dict:
    """What the numbers were measured on: CPUs, memory, file system of ``path``, versions."""
    mem = _meminfo()
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "mem_total_bytes": mem.get("MemTotal"),
        "mem_available_bytes": mem.get("MemAvailable"),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "fio": fio_version(),
    }
    try:
        import chemio_py
        info["chemio_py"] = getattr(chemio_py, "__version__", None)
    except Exception as exc:  # noqa: BLE001 - informational only
        info["chemio_py"] = f"unavailable: {exc}"
    if path is not None:
        info["workdir"] = os.path.abspath(path)
        info["workdir_fs"] = fs_type(path)
        try:
            st = os.statvfs(path)
            info["workdir_free_bytes"] = st.f_bavail * st.f_frsize
        except OSError:
            pass
    return info
