"""NumPy-style selections (issue 23): chemio's ``d[::2, :]`` and orthogonal row lists
against h5py and zarr-python doing the same selection on the same data, in the same run.

An 8000 x 2000 float64 array (quick: 4000 x 1000), chunks of 500 x 2000 (quick: 250 x 1000)
for every store: chemio ``local`` (raw chunk grid), chemio ``zarr`` (uncompressed), an h5py
chunked dataset (no filter), a zarr-python array (no compressor, the same chunks). The files
are in the page cache (each selection is read once untimed first): what is compared is what
each library does around the copy.

Selections:

* ``step``: every second row, ``x[::2, :]`` (h5py: a strided hyperslab; zarr-python:
  ``z[::2, :]`` as its basic indexing takes steps);
* ``rows10``: 10 % of the rows, sorted, chosen at random (h5py: ``ds[list, :]``; zarr-python:
  ``z.oindex[list, :]``; chemio: ``d[list]``, the same as ``d.oindex[list, :]``);
* ``slice``: a plain block of rows ``x[a:b, :]``, and chemio's exact-section call
  ``d.read(section)`` on the same rows: ``d[...]`` must keep the section path's speed.

Methods run interleaved in rotating order, 5 repetitions (quick: 3); the figure is the median.
Every result is compared with NumPy on the same array before timing.

Rows: time in ms; ratio = chemio / reference (lower is better); the issue's target is at most
1.2 x h5py and zarr-python for ``step`` and ``rows10``, and ~1.0 x ``d.read`` for ``slice``.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import row  # noqa: E402


def _setup(workdir: str, shape: tuple, chunks: tuple, data: np.ndarray) -> dict:
    import h5py
    import zarr

    import chemio_py as cio
    stores: dict = {}
    stores["chemio-local"] = cio.DiskArray.create(
        "ix.local", shape, "f8", chunks=chunks, backend="local",
        path=os.path.join(workdir, "ix.dra"))
    stores["chemio-zarr"] = cio.DiskArray.create(
        "ix.zarr", shape, "f8", chunks=chunks, backend="zarr",
        path=os.path.join(workdir, "ix-chemio.zarr"), compressor="none")
    for d in (stores["chemio-local"], stores["chemio-zarr"]):
        d.write((), data)
        d.flush()
    h5 = h5py.File(os.path.join(workdir, "ix.h5"), "w")
    stores["_h5file"] = h5
    stores["h5py"] = h5.create_dataset("x", data=data, chunks=chunks)
    z = zarr.create_array(os.path.join(workdir, "ix-python.zarr"), shape=shape, chunks=chunks,
                          dtype="f8", compressors=None, filters=None)
    z[...] = data
    stores["zarr-python"] = z
    return stores


def _selections(n: int, rng: np.random.Generator) -> dict:
    rows = np.sort(rng.choice(n, n // 10, replace=False))
    return {"step": (np.s_[::2, :], None),
            "rows10": (np.s_[rows, :], rows),
            "slice": (np.s_[n // 8:n // 8 + n // 4, :], None)}


def _reader(method: str, store, key, rows) -> callable:
    if method == "zarr-python" and rows is not None:
        return lambda: store.oindex[key]
    if method == "h5py" and rows is not None:
        return lambda: store[list(rows), :]
    return lambda: store[key]


def run(quick: bool, workdir: str) -> list[dict]:
    import chemio_py as cio
    shape = (4000, 1000) if quick else (8000, 2000)
    chunks = (250, 1000) if quick else (500, 2000)
    reps = 3 if quick else 5
    rng = np.random.default_rng(23)
    data = rng.standard_normal(shape)
    stores = _setup(workdir, shape, chunks, data)
    methods = ["chemio-local", "chemio-zarr", "h5py", "zarr-python"]
    rows_out = []
    try:
        for name, (key, rws) in _selections(shape[0], rng).items():
            want = data[key]
            fns = {m: _reader(m, stores[m], key, rws) for m in methods}
            if name == "slice":
                sec = key
                fns["chemio-local read()"] = lambda s=sec: stores["chemio-local"].read(s)
            for m, fn in fns.items():                      # untimed: check, warm the cache
                got = np.asarray(fn())
                if not np.array_equal(got, want):
                    raise AssertionError(f"{m} {name}: result differs from NumPy")
            times: dict[str, list[float]] = {m: [] for m in fns}
            order = list(fns)
            for r in range(reps):
                for m in order[r % len(order):] + order[:r % len(order)]:
                    t0 = time.perf_counter()
                    fns[m]()
                    times[m].append(time.perf_counter() - t0)
            med = {m: float(np.median(t)) * 1e3 for m, t in times.items()}
            mb = want.nbytes / 2**20
            for m in fns:
                rows_out.append(row(f"{name} {shape} ({mb:.0f} MiB result) {m}", "ms", med[m],
                                    note=f"range {min(times[m]) * 1e3:.1f}-"
                                         f"{max(times[m]) * 1e3:.1f} ms", lower_is_better=True))
            tgt = None if name == "slice" else 1.2
            for m, ref in (("chemio-local", "h5py"), ("chemio-local", "zarr-python"),
                           ("chemio-zarr", "zarr-python"), ("chemio-zarr", "h5py")):
                rows_out.append(row(f"{name} {m} vs {ref}", "ms", med[m], ref, med[ref],
                                    target=tgt, lower_is_better=True))
            if name == "slice":
                rows_out.append(row("slice chemio-local d[a:b] vs d.read(section)", "ms",
                                    med["chemio-local"], "d.read(section)",
                                    med["chemio-local read()"], target=1.1,
                                    lower_is_better=True))
    finally:
        stores["_h5file"].close()
        for m in ("chemio-local", "chemio-zarr"):
            stores[m].delete()
        cio.cleanup()
    return rows_out


if __name__ == "__main__":
    import tempfile
    quick = "--full" not in sys.argv
    with tempfile.TemporaryDirectory(prefix="bench-indexing-") as wd:
        for r in run(quick, wd):
            ratio = "" if r["ratio"] is None else f"  {r['ratio']:.2f}x {r['baseline_name']}"
            print(f"{r['case']:64s} {r['value']:9.2f} {r['metric']}{ratio}  {r['note']}")
