"""RecordFile replay: the page checksum against no check at all (issue 28 item 5).

Every page of a RecordFile carries a checksum that the replay checks on the I/O pool
beside the read-ahead. This benchmark replays the same hot (page-cached) records, as
semi-direct SCF does every cycle, in three ways, interleaved round by round:

* the file's own check with ``crc32c`` (the ``crc32c`` wheel, which releases the GIL, so
  the check of page k on the I/O pool overlaps the consumer of page k-1), the same file
  checked with google-crc32c (the fallback: it holds the GIL on arrays), and ``crc32``
  (zlib; files written before the choice);
* the same replay with the check taken out (``records.decode_page`` is handed pages whose
  checksum is "unknown": -1), the baseline.

Rows: replay rate with each checksum against the unchecked replay in the same round,
median and range over the rounds, all on the copying path (pages read into buffers).
Target: crc32c >= 0.9x the replay without a check. Then the default replay of hot raw
pages, views of a read-only mapping checked with crc32c, against the copying replay with
crc32c, and against the same mapped replay without a check (target >= 0.9x: the
replay a user gets). The files stay open from round to round, as semi-direct SCF keeps its cache.
Beside it the ceiling of any library: a bare loop reading the same number of 4 MiB pages
with ``os.preadv`` on two threads, two pages ahead, with and without the wheel's CRC on the
reading thread.

Alone: ``python benchmarks/bench_records.py [--full]`` (quick by default: 48 MiB, 9 rounds;
full: 172 MB, the benzene cc-pVDZ semi-direct cache, 7 rounds).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MiB, row  # noqa: E402


@contextmanager
def _no_check() -> Iterator[None]:
    """Replays inside skip the page checksum (and only that)."""
    from chemio_py.files import records
    orig = records.decode_page

    def unchecked(codec: Any, entry: list, *args: Any) -> np.ndarray:
        return orig(codec, list(entry[:4]) + [-1], *args)

    records.decode_page = unchecked
    try:
        yield
    finally:
        records.decode_page = orig


def _google_crc32c() -> Any:
    """google-crc32c's function as ``recordformat`` uses it when the wheel is missing."""
    from chemio_py.files import recordformat
    saved = sys.modules.get("crc32c")
    sys.modules["crc32c"] = None  # type: ignore[assignment]
    try:
        return recordformat._crc32c_fn()
    finally:
        if saved is None:
            del sys.modules["crc32c"]
        else:
            sys.modules["crc32c"] = saved


@contextmanager
def _google() -> Iterator[None]:
    """Replays inside check crc32c pages with google-crc32c."""
    from chemio_py.files import recordformat
    recordformat.checksum_function("crc32c")
    orig = recordformat._crc_fns["crc32c"]
    recordformat._crc_fns["crc32c"] = _google_crc32c()
    try:
        yield
    finally:
        recordformat._crc_fns["crc32c"] = orig


def _ceiling(where: str, nbytes: int, rounds: int) -> dict:
    """The library-free loop: 4 MiB pages read on two threads, two ahead, with and without
    a crc32c of each page on its reading thread; the consumer touches each page."""
    from concurrent.futures import ThreadPoolExecutor

    import crc32c
    ps = 4 * MiB
    n = max(1, nbytes // ps)
    path = os.path.join(where, "ceiling.bin")
    with open(path, "wb") as f:
        np.random.default_rng(1).integers(0, 256, n * ps, dtype=np.uint8).tofile(f)
        f.flush()
        os.fsync(f.fileno())                   # no writeback while it is read
    fd = os.open(path, os.O_RDONLY)
    bufs = [np.empty(ps, np.uint8) for _ in range(3)]
    ex = ThreadPoolExecutor(2)

    def job(i: int, crc: bool) -> np.ndarray:
        buf = bufs[i % 3]
        os.preadv(fd, [buf], i * ps)
        if crc:
            crc32c.crc32c(buf)
        return buf

    def loop(crc: bool) -> float:
        t = time.perf_counter()
        futs = [ex.submit(job, i, crc) for i in range(min(2, n))]
        s = 0
        for i in range(n):
            b = futs.pop(0).result()
            if i + 2 < n:
                futs.append(ex.submit(job, i + 2, crc))
            s += int(b[::65536].sum())
        return time.perf_counter() - t

    try:
        loop(False)
        loop(True)
        t: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for crc in ((True, False) if r % 2 == 0 else (False, True)):
                t[crc].append(loop(crc))
    finally:
        ex.shutdown()
        os.close(fd)
        os.unlink(path)
    ratios = [b / a for a, b in zip(t[True], t[False])]
    nb = n * ps
    return row(f"ceiling: bare loop reading {nb / MiB:.0f} MiB hot + crc32c on the thread",
               "MiB/s", nb / MiB / statistics.median(t[True]), "same loop, read only",
               nb / MiB / statistics.median(t[False]),
               note=f"per-round ratio {min(ratios):.2f}-{max(ratios):.2f} over {rounds} "
                    f"interleaved rounds; load {os.getloadavg()[0]:.1f}")


def _write(name: str, where: str, nbytes: int, checksum: str, compressor: Any) -> None:
    import chemio_py as cio
    rng = np.random.default_rng(7)
    # semi-direct-like records: a batch id and ~0.5 MiB of packed integrals (smooth values
    # compress a little, like real integrals)
    vals = np.cumsum(rng.standard_normal(64 * 1024)) * 1e-3
    with cio.RecordFile(name, "w+", dir=where, checksum=checksum,
                        compressor=compressor) as log:
        i = 0
        while log.raw_nbytes < nbytes:
            log.append(np.array([i], np.int64), vals + i)
            i += 1


def _replay(log: Any) -> tuple[float, float, int]:
    """Wall and CPU seconds (all threads) of one replay of the open ``log``, stream bytes."""
    n = log.raw_nbytes
    t, c = time.perf_counter(), time.process_time()
    s = 0.0
    for _hdr, vals in log.replay(depth=2):
        s += vals[0]                           # the consumer touches each record
    return time.perf_counter() - t, time.process_time() - c, n


@contextmanager
def _copying(log: Any) -> Iterator[None]:
    """Replays inside copy every page (the mapped replay of hot pages switched off)."""
    from chemio_py.files import records
    pm, log._map = log._map, None
    records.MAP_REPLAY = False
    try:
        yield
    finally:
        records.MAP_REPLAY = True
        log._map = pm


def _case(where: str, nbytes: int, rounds: int, compressor: Any) -> list[dict]:
    import chemio_py as cio
    tag = "raw" if compressor is None else compressor
    names = {c: f"rec-{c}-{tag}" for c in ("crc32c", "crc32")}
    for c, name in names.items():
        _write(name, where, nbytes, c, compressor)
    # open once, as semi-direct SCF keeps its cache open from cycle to cycle
    logs = {c: cio.RecordFile(name, "r", dir=where) for c, name in names.items()}
    kinds = ["crc32c", "google", "none", "crc32"] + (
        ["mapped", "mapped-none"] if compressor is None else [])
    t: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    n = 0
    try:
        for log in logs.values():
            _replay(log)                       # into the page cache (and mapped)
        for r in range(rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            for k in order:
                log = logs["crc32" if k == "crc32" else "crc32c"]
                if k == "mapped-none":
                    with _no_check():
                        dt, dc, n = _replay(log)
                    t[k].append(dt)
                    cpu[k].append(dc)
                    continue
                if k == "mapped":
                    dt, dc, n = _replay(log)
                    t[k].append(dt)
                    cpu[k].append(dc)
                    continue
                with _copying(log):
                    if k == "none":
                        with _no_check():
                            dt, dc, n = _replay(log)
                    elif k == "google":
                        with _google():
                            dt, dc, n = _replay(log)
                    else:
                        dt, dc, n = _replay(log)
                t[k].append(dt)
                cpu[k].append(dc)
    finally:
        for log in logs.values():
            log.close()
        for name in names.values():
            cio.RecordFile.remove(name, dir=where)
    rows = []
    labels = {"crc32c": "crc32c check", "google": "crc32c check by google-crc32c (GIL held)",
              "crc32": "crc32 check"}
    for k in ("crc32c", "google", "crc32"):
        ratios = [b / a for a, b in zip(t[k], t["none"])]
        med = statistics.median(t[k])
        base = statistics.median(t["none"])
        rows.append(row(
            f"RecordFile replay {n / MiB:.0f} MiB hot, {tag} pages copied: {labels[k]}",
            "MiB/s", n / MiB / med, "same replay, no check", n / MiB / base,
            target=0.9 if k == "crc32c" else None,
            note=f"per-round ratio {min(ratios):.2f}-{max(ratios):.2f} over {rounds} "
                 f"interleaved rounds (median times); CPU seconds (all threads) "
                 f"{statistics.median(cpu['none']) / statistics.median(cpu[k]):.2f}x the "
                 f"unchecked replay's; load {os.getloadavg()[0]:.1f}"))
    if "mapped" in t:
        ratios = [b / a for a, b in zip(t["mapped"], t["mapped-none"])]
        rows.append(row(
            f"RecordFile replay {n / MiB:.0f} MiB hot, raw pages mapped (the default): "
            "crc32c check", "MiB/s", n / MiB / statistics.median(t["mapped"]),
            "same mapped replay, no check", n / MiB / statistics.median(t["mapped-none"]),
            target=0.9,
            note=f"per-round ratio {min(ratios):.2f}-{max(ratios):.2f} over {rounds} "
                 f"interleaved rounds; CPU seconds (all threads) "
                 f"{statistics.median(cpu['mapped-none']) / statistics.median(cpu['mapped']):.2f}x "
                 f"the unchecked replay's; load {os.getloadavg()[0]:.1f}"))
        ratios = [b / a for a, b in zip(t["mapped"], t["crc32c"])]
        rows.append(row(
            f"RecordFile replay {n / MiB:.0f} MiB hot, raw pages mapped (views, crc32c check)",
            "MiB/s", n / MiB / statistics.median(t["mapped"]),
            "the copying replay with crc32c", n / MiB / statistics.median(t["crc32c"]),
            note=f"per-round ratio {min(ratios):.2f}-{max(ratios):.2f} over {rounds} "
                 f"interleaved rounds; CPU seconds (all threads) "
                 f"{statistics.median(cpu['crc32c']) / statistics.median(cpu['mapped']):.2f}x "
                 f"the copying replay's; load {os.getloadavg()[0]:.1f}"))
    return rows


def run(quick: bool, workdir: str) -> list[dict]:
    nbytes = 48 * MiB if quick else 172_000_000
    rounds = 9 if quick else 7             # quick replays take ~25 ms: more rounds
    rows = _case(workdir, nbytes, rounds, None) + [_ceiling(workdir, nbytes, rounds)]
    try:
        import numcodecs  # noqa: F401
    except ImportError:
        return rows
    return rows + _case(workdir, nbytes, rounds, "zstd")


if __name__ == "__main__":
    import tempfile
    quick = "--full" not in sys.argv
    with tempfile.TemporaryDirectory(prefix="bench-records-") as wd:
        for r in run(quick, wd):
            ratio = "" if r["ratio"] is None else f"  {r['ratio']:.2f}x {r['baseline_name']}"
            print(f"{r['case']:78s} {r['value']:8.0f} {r['metric']}{ratio}  [{r['note']}]")
