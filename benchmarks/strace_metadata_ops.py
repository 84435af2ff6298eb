"""Metadata system calls per rank (issue 21), counted with strace under ``mpiexec -n P``.

Not a ``bench_*`` module (the runner does not pick it up): it needs ``strace``. Each rank
runs under its own ``strace -f`` (threads included) and marks the phases of its workload
with ``access("/chemio-mark/<phase>")`` calls, so the trace splits by phase:

* ``import``: ``import chemio_py`` (then ``cio.comm()``, MPI's start, is not counted);
* for a first and then a second array (the first pays one-time imports, the second shows
  what every array costs): ``create`` (backend resolution included), ``write_all`` of
  this rank's block of rows, ``read_all`` of it, ``close`` (a scratch array is removed);
* ``delete`` (``zarr`` only): a persistent array of ``DELETE_OBJECTS`` objects, written,
  closed and reopened untraced, then ``delete()``.

Counted: opens (open/openat), stats (stat/lstat/fstat/newfstatat/statx), statfs/fstatfs,
unlinks (unlink/unlinkat/rmdir), getdents64, and all calls of strace's ``%file``,
``%fstat``, ``%fstatfs`` classes plus getdents64 (``all``). Reads and writes of data are
not traced.

Usage::

    python benchmarks/strace_metadata_ops.py run --out before.json [--pythonpath DIR]
        [--procs 1,2,4,8] [--backends local,mpiio,zarr]     # DIR: another checkout
    python benchmarks/strace_metadata_ops.py report before.json after.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

MARK = "/chemio-mark/"
SHAPE = (512, 512)              # 2 MiB of f8 ...
CHUNKS = (64, 64)               # ... in 64 objects of 32 KiB
DELETE_SHAPE = (1024, 1024)     # 1024 objects of 8 KiB in 32 directories c/<i>
DELETE_CHUNKS = (32, 32)
DELETE_OBJECTS = 1024
PHASES = ("import", "create", "write_all", "read_all", "close",
          "create2", "write_all2", "read_all2", "close2")

CATEGORIES = {
    "open": {"open", "openat", "openat2", "creat"},
    "stat": {"stat", "lstat", "fstat", "newfstatat", "statx", "fstatat64"},
    "statfs": {"statfs", "fstatfs"},
    "unlink": {"unlink", "unlinkat", "rmdir"},
    "getdents": {"getdents", "getdents64"},
}
_LINE = re.compile(r"^(\d+)\s+([a-z0-9_]+)\((.*)$")

WORKER = r'''
import os, sys
def mark(name):
    try:
        os.access("/chemio-mark/" + name, os.F_OK)
    except OSError:
        pass
backend, deleting = sys.argv[1], sys.argv[2] == "1"
shape, chunks = eval(sys.argv[3]), eval(sys.argv[4])
import numpy as np
mark("import")
import chemio_py as cio
mark("comm")
c = cio.comm()
c.barrier()

def one(suffix, keep):
    mark("create" + suffix)
    d = cio.DiskArray.create("m" + suffix, shape, "f8", chunks=chunks, backend=backend,
                             persistent=keep, path=sys.argv[5] if keep else None)
    sec = cio.block_section(shape, comm=c, axis=0)
    block = np.full(tuple(s.stop - s.start for s in sec), 1.0 + c.rank)
    mark("write_all" + suffix)
    d.write_all(sec, block)
    mark("read_all" + suffix)
    out = np.empty_like(block)
    d.read_all(sec, out)
    assert (out == block).all()
    mark("close" + suffix)
    d.close()
    return d.path

if deleting:
    path = one("-setup", True)
    d = cio.DiskArray.open(path, "r+")
    c.barrier()
    mark("delete")
    d.delete()
    mark("end")
    assert not os.path.exists(path)
else:
    one("", False)
    one("2", False)
mark("end")
'''


def count(trace: str) -> dict[str, dict[str, int]]:
    """Per phase: the counts of the categories (and ``all``: every traced call)."""
    phases: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    phase = "startup"
    with open(trace) as fh:
        for line in fh:
            m = _LINE.match(line)
            if m is None:
                continue
            name, args = m.group(2), m.group(3)
            if MARK in args:
                phase = args.split(MARK, 1)[1].split('"', 1)[0]
                continue
            c = phases[phase]
            c["all"] += 1
            for cat, names in CATEGORIES.items():
                if name in names:
                    c[cat] += 1
    return {p: dict(c) for p, c in phases.items()}


def run(procs: int, backend: str, deleting: bool, pythonpath: str | None) -> list[dict]:
    """Run the workload on ``procs`` ranks under strace; per rank, the counts by phase."""
    work = tempfile.mkdtemp(prefix="cio-metaops-")
    try:
        scratch_dir = os.path.join(work, "scratch")
        os.mkdir(scratch_dir)
        script = os.path.join(work, "worker.py")
        with open(script, "w") as fh:
            fh.write(WORKER)
        shape, chunks = (DELETE_SHAPE, DELETE_CHUNKS) if deleting else (SHAPE, CHUNKS)
        env = dict(os.environ, CHEMIO_SCRATCH=scratch_dir, OPENBLAS_NUM_THREADS="1")
        env.pop("CHEMIO_SHARED_SCRATCH", None)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        trace = os.path.join(work, "r")
        cmd = [mpiexec, "-n", str(procs), "sh", "-c",
               f'exec strace -f -qq -e trace=%file,%fstat,%fstatfs,getdents64 '
               f'-o {trace}$PMI_RANK "$@"', "sh", sys.executable, "-m", "mpi4py", script,
               backend, "1" if deleting else "0", repr(shape), repr(chunks),
               os.path.join(work, "keep.zarr")]
        subprocess.run(cmd, check=True, env=env, cwd=work, timeout=900)
        return [count(trace + str(r)) for r in range(procs)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(a: argparse.Namespace) -> None:
    out: dict = {"label": a.label, "pythonpath": a.pythonpath, "runs": {}}
    for be in a.backends.split(","):
        for p in (int(x) for x in a.procs.split(",")):
            out["runs"][f"{be}/{p}"] = run(p, be, False, a.pythonpath)
            if be == "zarr":
                out["runs"][f"zarr-delete/{p}"] = run(p, be, True, a.pythonpath)
            print(f"{be} P={p} done", file=sys.stderr, flush=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)


def _cell(ranks: list[dict], phase: str, cat: str) -> str:
    """``rank 0/the most of any other rank`` (one figure when they are equal or P = 1)."""
    vals = [r.get(phase, {}).get(cat, 0) for r in ranks]
    rest = max(vals[1:], default=vals[0])
    return str(vals[0]) if rest == vals[0] else f"{vals[0]}/{rest}"


def report(a: argparse.Namespace) -> None:
    with open(a.before) as fh:
        before = json.load(fh)
    with open(a.after) as fh:
        after = json.load(fh)
    keys = list(before["runs"])
    procs = sorted({int(k.split("/")[1]) for k in keys})
    backends = list(dict.fromkeys(k.split("/")[0] for k in keys))
    print("All traced calls per rank, before -> after (cells: rank 0/the most of any "
          "other rank)\n")
    print("| backend | phase | " + " | ".join(f"P = {p}" for p in procs) + " |")
    print("|---|---|" + "---|" * len(procs))
    for be in backends:
        phases = ("delete",) if be == "zarr-delete" else PHASES
        for ph in phases:
            cells = []
            for p in procs:
                b, n = before["runs"][f"{be}/{p}"], after["runs"][f"{be}/{p}"]
                cells.append(f"{_cell(b, ph, 'all')} -> {_cell(n, ph, 'all')}")
            print(f"| {be} | {ph} | " + " | ".join(cells) + " |")
    cats = list(CATEGORIES)
    for p in (procs[-1],):
        print(f"\nBy kind at P = {p}, before -> after\n")
        print("| backend | phase | " + " | ".join(cats) + " |")
        print("|---|---|" + "---|" * len(cats))
        for be in backends:
            phases = ("delete",) if be == "zarr-delete" else PHASES
            for ph in phases:
                b, n = before["runs"][f"{be}/{p}"], after["runs"][f"{be}/{p}"]
                print(f"| {be} | {ph} | " + " | ".join(
                    f"{_cell(b, ph, c)} -> {_cell(n, ph, c)}" for c in cats) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--procs", default="1,2,4,8")
    r.add_argument("--backends", default="local,mpiio,zarr")
    r.add_argument("--pythonpath", default=None)
    r.add_argument("--label", default="")
    r.set_defaults(fn=measure)
    t = sub.add_parser("report")
    t.add_argument("before")
    t.add_argument("after")
    t.set_defaults(fn=report)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
