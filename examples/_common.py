"""What every example in ``examples/`` shares: the command line, the molecule, progress
messages, I/O totals over all ranks and the one final JSON line.

Every example runs serially or under ``mpiexec -n N`` unchanged::

    python examples/NAME.py --atom "O 0 0 0; H 0 0.757 0.587; H 0 -0.757 0.587" \\
        --basis cc-pvdz [--backend local|shm] [--max-memory MB] [--quiet]

Without ``--quiet``, rank 0 shows progress lines and, on a terminal, ``tqdm`` bars over
the long loops on stderr; with ``--quiet`` the run prints nothing but the final JSON
line. It ends with exactly one JSON line on stdout (rank 0 only)::

    {"example": ..., "energy": ..., "reference": ..., "abs_error": ..., "io": {...}, ...}

``reference`` is PySCF's own value of the same quantity. The exit status is 0 when
``abs_error`` is within the example's tolerance, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Iterable, Iterator, Sequence, TypeVar

import numpy as np

import chemio_py as cio
from chemio_py.runtime import progress as _progress, stats

T = TypeVar("T")

WATER = "O 0 0 0; H 0 0.757 0.587; H 0 -0.757 0.587"


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options common to every example."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("common options")
    g.add_argument("--atom", default=WATER,
                   help="geometry in PySCF syntax ('O 0 0 0; H 0 0.757 0.587; ...', Angstrom) "
                        "or the path of an .xyz file")
    g.add_argument("--basis", default="cc-pvdz", help="orbital basis set")
    g.add_argument("--charge", type=int, default=0)
    g.add_argument("--backend", default=None,
                   help="chemio_py storage backend for the scratch data (local, shm, ...); "
                        "default: the chemio_py setting (CHEMIO_BACKEND, chemio.toml, local)")
    g.add_argument("--max-memory", type=float, default=None, metavar="MB",
                   help="memory budget of the out-of-core parts, in MB (fractions allowed)")
    g.add_argument("--quiet", action="store_true",
                   help="print nothing but the final JSON line (no progress lines or bars)")
    return p


def read_atom(text: str) -> str:
    """A PySCF geometry string from ``text`` or from the .xyz file it names."""
    if os.path.isfile(text):
        with open(text) as fh:
            lines = [ln.strip() for ln in fh.read().splitlines()]
        # XYZ: atom count, comment, then "El x y z" lines
        if lines and lines[0].isdigit():
            n = int(lines[0])
            body = lines[2:2 + n]
        else:
            body = [ln for ln in lines if ln and not ln.startswith("#")]
        atoms = []
        for ln in body:
            parts = ln.split()
            if len(parts) < 4:
                raise SystemExit(f"error: {text}: cannot read atom line {ln!r} "
                                 f"(expected 'Element x y z' in Angstrom)")
            atoms.append(" ".join(parts[:4]))
        if not atoms:
            raise SystemExit(f"error: {text}: no atoms found")
        return "; ".join(atoms)
    return text


def make_mol(args: argparse.Namespace, **kw: Any):
    """The PySCF molecule of the command line (quiet, Angstrom)."""
    from pyscf import gto
    return gto.M(atom=read_atom(args.atom), basis=args.basis, charge=args.charge,
                 verbose=0, **kw)


class Run:
    """The run of one example: communicator, settings, progress and the final JSON line."""

    def __init__(self, example: str, args: argparse.Namespace):
        self.example = example
        self.args = args
        self._restore_backend = None
        if args.backend:           # restored by finish(): main() may run inside a process
            prev = cio.settings()["backend"]
            self._restore_backend = (prev.value if prev.source == "explicit" else None,)
            cio.configure(backend=args.backend)
        self.comm = cio.comm()
        self.t0 = time.perf_counter()
        stats.reset()
        _share_cores(self.comm)

    @property
    def root(self) -> bool:
        return self.comm.rank == 0

    def log(self, msg: str, all_ranks: bool = False) -> None:
        """A progress line on stderr (rank 0 only unless ``all_ranks``), unless --quiet."""
        if self.args.quiet or not (self.root or all_ranks):
            return
        who = f"[{self.example} {time.perf_counter() - self.t0:7.2f}s"
        who += f" r{self.comm.rank}]" if self.comm.size > 1 else "]"
        _progress.write(f"{who} {msg}", file=sys.stderr)

    def progress(self, iterable: Iterable[T], desc: str, total: int | None = None,
                 unit: str = "it") -> Iterator[T]:
        """``iterable`` with a ``tqdm`` bar on rank 0's stderr when it is a terminal (or a
        notebook); a plain loop with --quiet and on the other ranks."""
        how = _progress.AUTO if self.root and not self.args.quiet else False
        return _progress.track(iterable, how, f"{self.example}: {desc}", total=total,
                               unit=unit)

    def io_totals(self) -> dict:
        """This job's I/O counters summed over all ranks (collective): the file totals,
        and per read-ahead / write-behind pipeline its ops, bytes, seconds and overlap
        efficiency ``1 - waited/io``."""
        mine = stats.snapshot()
        per_rank = self.comm.allgather(mine["total"])
        total = {k: sum(r[k] for r in per_rank) for k in per_rank[0]}
        total["files"] = sum(self.comm.allgather(len(mine["files"])))
        total["ranks"] = self.comm.size
        pipes: dict[str, dict] = {}
        pipelines = getattr(stats, "pipelines", lambda: [])
        for rank_pipes in self.comm.allgather(pipelines()):
            for pp in rank_pipes:
                agg = pipes.setdefault(pp["pipeline"], {"kind": pp["kind"], "ops": 0, "bytes": 0,
                                                        "io_seconds": 0.0, "wait_seconds": 0.0,
                                                        "compute_seconds": 0.0})
                for k in ("ops", "bytes", "io_seconds", "wait_seconds", "compute_seconds"):
                    agg[k] += pp[k]
        for agg in pipes.values():
            io = agg["io_seconds"]
            agg["efficiency"] = (None if io <= 0
                                 else min(1.0, max(0.0, 1 - agg["wait_seconds"] / io)))
        total["pipelines"] = pipes
        return total

    def finish(self, energy: float, reference: float, tolerance: float, *,
               extra_errors: Sequence[float] = (), **extra: Any) -> int:
        """Print the JSON line (rank 0) and return the exit status. Collective.

        The status is 0 when ``|energy - reference|`` and every ``extra_errors`` entry are
        within ``tolerance``.
        """
        io = self.io_totals()
        err = abs(energy - reference)
        out = {"example": self.example, "energy": energy, "reference": reference,
               "abs_error": err, "tolerance": tolerance, "ranks": self.comm.size,
               "backend": self.args.backend or cio.settings()["backend"].value,
               "seconds": round(time.perf_counter() - self.t0, 3), "io": io}
        out.update(extra)
        worst = max([err, *extra_errors])
        ok = bool(worst <= tolerance and math.isfinite(energy))
        if self.root:
            if not ok:
                print(f"[{self.example}] error {worst:.3e} exceeds the tolerance "
                      f"{tolerance:.0e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            print(json.dumps(out, default=_jsonable), flush=True)
        if self._restore_backend is not None:
            cio.configure(backend=self._restore_backend[0])
        return 0 if ok else 1


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"cannot write {type(x).__name__} as JSON")


def _share_cores(comm: Any) -> None:
    """Under MPI, give each rank its share of the node's cores for PySCF's OpenMP loops."""
    if comm.size <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    try:
        from pyscf import lib
        lib.num_threads(max(1, (os.cpu_count() or 1) // comm.size))
    except Exception:
        pass


def energy_reference(run: Run, compute) -> float:
    """``compute()`` on rank 0 only (PySCF's reference), broadcast to every rank."""
    value = None
    with run.comm.agree("the PySCF reference calculation"):
        if run.root:
            value = float(compute())
    return float(run.comm.bcast(value))


def cli(main) -> None:
    """Run ``main(argv)`` as a script and exit with its status."""
    sys.exit(main(sys.argv[1:]))


def seq(x: Sequence[int]) -> str:
    return ",".join(str(int(v)) for v in x)


class SharedLoop:
    """Rounds of tasks dealt out dynamically over the ranks with one ``cio.sync.Counter``.

    ``for t in loop.tasks(n):`` yields this rank's share of ``0 .. n-1``; every rank must
    call ``tasks`` with the same ``n`` in the same order (one call is one round). The
    counter is never reset: round ``r`` owns the tickets ``base_r .. base_r + n - 1``, and
    the one ticket a rank draws past the end of a round is kept for the round it
    belongs to, so no collective is needed between rounds.
    """

    def __init__(self, comm: Any):
        import chemio_py.sync as sync
        self.comm = comm
        self.counter = sync.Counter(0, comm=comm)
        self.base = 0
        self._ticket: int | None = None
        self.taken = 0

    def tasks(self, n: int):
        lo, hi = self.base, self.base + n
        self.base = hi
        while True:
            t = self._ticket if self._ticket is not None else self.counter.next()
            self._ticket = None
            if t >= hi:
                self._ticket = t          # belongs to a later round
                return
            self.taken += 1
            yield t - lo

    def free(self) -> None:
        self.counter.free()



def record_file(name: str, mode: str = "w+", **kw: Any):
    """``cio.RecordFile(name, mode, **kw)`` (from its module while it is not exported)."""
    cls = getattr(cio, "RecordFile", None)
    if cls is None:
        from chemio_py.files.records import RecordFile as cls
    return cls(name, mode, **kw)
