"""RecordFile replay: the page checksum against no check at all (issue 28 item 5).

Every page of a RecordFile carries a checksum that the replay checks on the I/O pool
beside the read-ahead. This benchmark replays the same hot (page-cached) records, as
semi-direct SCF does every cycle, in three ways, interleaved round by round:

* the file's own check with ``crc32c`` (google-crc32c, the default when its C wheel is
  there), and with ``crc32`` (zlib, the fallback; files written before the choice);
* the same replay with the check taken out (``records.decode_page`` is handed pages whose
  checksum is "unknown": -1), the ceiling.

Rows: replay rate with each checksum against the ceiling in the same round, median and
range over the rounds. Target: crc32c >= 0.9x the replay without a check.

Alone: ``python benchmarks/bench_records.py [--full]`` (quick by default: 48 MiB, 5 rounds;
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


def _replay(name: str, where: str) -> tuple[float, float, int]:
    """Wall and CPU seconds (all threads) of one replay, and the stream bytes."""
    import chemio_py as cio
    with cio.RecordFile(name, "r", dir=where) as log:
        n = log.raw_nbytes
        t, c = time.perf_counter(), time.process_time()
        s = 0.0
        for _hdr, vals in log.replay(depth=2):
            s += vals[0]                       # the consumer touches each record
        return time.perf_counter() - t, time.process_time() - c, n


def _case(where: str, nbytes: int, rounds: int, compressor: Any) -> list[dict]:
    tag = "raw" if compressor is None else compressor
    names = {c: f"rec-{c}-{tag}" for c in ("crc32c", "crc32")}
    for c, name in names.items():
        _write(name, where, nbytes, c, compressor)
        _replay(name, where)                   # into the page cache
    t: dict[str, list[float]] = {"crc32c": [], "crc32": [], "none": []}
    cpu: dict[str, list[float]] = {"crc32c": [], "crc32": [], "none": []}
    n = 0
    for r in range(rounds):
        order = ["crc32c", "none", "crc32"] if r % 2 == 0 else ["crc32", "none", "crc32c"]
        for k in order:
            if k == "none":
                with _no_check():
                    dt, dc, n = _replay(names["crc32c"], where)
            else:
                dt, dc, n = _replay(names[k], where)
            t[k].append(dt)
            cpu[k].append(dc)
    import chemio_py as cio
    for name in names.values():
        cio.RecordFile.remove(name, dir=where)
    rows = []
    for k in ("crc32c", "crc32"):
        ratios = [b / a for a, b in zip(t[k], t["none"])]
        med = statistics.median(t[k])
        base = statistics.median(t["none"])
        rows.append(row(
            f"RecordFile replay {n / MiB:.0f} MiB hot, {tag} pages: {k} check", "MiB/s",
            n / MiB / med, "same replay, no check", n / MiB / base,
            target=0.9 if k == "crc32c" else None,
            note=f"per-round ratio {min(ratios):.2f}-{max(ratios):.2f} over {rounds} "
                 f"interleaved rounds (median times); CPU seconds (all threads) "
                 f"{statistics.median(cpu['none']) / statistics.median(cpu[k]):.2f}x the "
                 f"unchecked replay's; load {os.getloadavg()[0]:.1f}"))
    return rows


def run(quick: bool, workdir: str) -> list[dict]:
    nbytes = 48 * MiB if quick else 172_000_000
    rounds = 5 if quick else 7
    rows = _case(workdir, nbytes, rounds, None)
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
            print(f"{r['case']:62s} {r['value']:8.0f} {r['metric']}{ratio}  [{r['note']}]")
