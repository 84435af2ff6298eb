"""Semi-direct Hartree-Fock inside PySCF: NWChem's integral cache, on chemio.

PySCF runs its own SCF (``scf.RHF``/``UHF``/``ROHF``: DIIS, convergence, incremental Fock
builds); ``chemio_py.pyscf.semi_direct(mf)`` replaces its ``get_jk``: the first cycle
computes the two-electron integrals in Schwarz-screened batches and keeps them in a
``cio.RecordFile`` (one per rank), later cycles replay them with read-ahead and recompute
only the batches that did not fit the cache budget (``--max-disk``) — never failing for
lack of space. The library picks the batch size from timed integral calls and
``--max-memory``.

Under ``mpiexec -n N`` the shell rows are split over the ranks, each rank caches its own
batches and J/K are summed over the ranks.

    python examples/semi_direct_scf.py --basis cc-pvdz [--method uhf --spin 2] [--max-disk MB]

Reference: PySCF's own SCF of the same kind, in core (the ERI tensor in memory) and direct
(integrals recomputed every cycle), timed beside this run; the run passes when
|dE| < 1e-8 Eh. The JSON line has both energies and times (``scf_seconds``,
``pyscf_incore_seconds``, ``pyscf_direct_seconds``).
"""
from __future__ import annotations

import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import chemio_py.pyscf  # noqa: E402

TOLERANCE = 1e-8


class _LogLines(logging.Handler):
    """chemio_py.pyscf's messages as the example's progress lines."""

    def __init__(self, run: _common.Run):
        super().__init__(logging.INFO)
        self.run = run

    def emit(self, record: logging.LogRecord) -> None:
        self.run.log(record.getMessage(), all_ranks=record.levelno >= logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--method", choices=("rhf", "uhf", "rohf"), default=None,
                   help="SCF kind (default: rhf for closed shells, uhf otherwise)")
    p.add_argument("--spin", type=int, default=0, help="2S, PySCF's spin")
    p.add_argument("--conv", type=float, default=1e-9, help="energy convergence (Eh)")
    p.add_argument("--max-cycle", type=int, default=60)
    p.add_argument("--max-disk", type=float, default=None, metavar="MB",
                   help="cache budget per rank (default: half the free space where it lives); "
                        "batches that do not fit are recomputed every cycle")
    p.add_argument("--compress", default=None, help="cache codec: zstd, blosc (default none)")
    for old in ("--stored-fraction", "--group-ao", "--schwarz", "--depth"):
        p.add_argument(old, default=None, help="ignored: the library chooses the batches "
                                               "and what to keep from measured costs")
    args = p.parse_args(argv)
    run = _common.Run("semi_direct_scf", args)
    comm = run.comm
    mol = _common.make_mol(args, spin=args.spin)
    method = args.method or ("rhf" if mol.spin == 0 else "uhf")
    if method == "rhf" and mol.spin:
        p.error(f"--method rhf needs a closed shell, got spin {mol.spin}; use uhf or rohf")

    from pyscf import scf
    kind = {"rhf": scf.RHF, "uhf": scf.UHF, "rohf": scf.ROHF}[method]
    lines = _LogLines(run)
    logger = logging.getLogger("chemio_py.pyscf")
    logger.addHandler(lines)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    mf = kind(mol)
    mf.conv_tol = args.conv
    mf.max_cycle = args.max_cycle
    kw = {} if args.max_memory is None else {"max_memory": args.max_memory}
    chemio_py.pyscf.semi_direct(mf, max_disk=args.max_disk, compress=args.compress, **kw)
    run.log(f"{mol.natm} atoms, {mol.nao_nr()} basis functions ({args.basis}), "
            f"{method.upper()}, ranks: {comm.size}")
    bar = iter(run.progress(range(args.max_cycle + 1), "SCF cycles", unit="cycle"))
    e_last = [None]

    def callback(env: dict) -> None:
        next(bar, None)
        e = float(env["e_tot"])
        de = float("inf") if e_last[0] is None else e - e_last[0]
        e_last[0] = e
        run.log(f"cycle {env['cycle'] + 1:2d}  E = {e:.12f}  dE = {de:+.2e}  "
                f"|g| = {float(env['norm_gorb']):.2e}")

    mf.callback = callback
    t_scf = time.perf_counter()
    try:
        energy = float(mf.kernel())
    finally:
        close = getattr(bar, "close", None)
        if close is not None:
            close()
    t_scf = time.perf_counter() - t_scf
    eng = mf.semi_direct
    st = dict(eng.stats)
    converged = bool(comm.bcast(bool(mf.converged)))
    eng.close()
    logger.removeHandler(lines)
    logger.setLevel(old_level)
    n_direct = int(comm.allreduce(st.get("direct_batches", 0), "sum"))
    batches = int(comm.allreduce(st.get("batches", 0), "sum"))
    stored = int(comm.allreduce(st.get("stored_batches", 0), "sum"))
    stored_bytes = int(comm.allreduce(st.get("stored_bytes", 0), "sum"))
    screened = int(comm.allreduce(st.get("screened", 0), "sum"))
    if not converged:
        run.log(f"not converged in {args.max_cycle} cycles")

    pyscf_runs: dict = {}

    def pyscf_scf(direct: bool) -> float:
        ref = kind(mol)
        ref.conv_tol = 1e-11
        if direct:                 # never keep the ERI tensor: J and K from integrals
            ref._is_mem_enough = lambda: False
        t = time.perf_counter()
        e = float(ref.kernel())
        key = "direct" if direct else "incore"
        pyscf_runs[key] = (e, time.perf_counter() - t, int(ref.cycles), bool(ref.converged))
        return e

    def reference() -> float:
        e = pyscf_scf(direct=False)                     # the reference energy
        pyscf_scf(direct=True)
        return e

    ref = _common.energy_reference(run, reference)
    pyscf_runs = comm.bcast(pyscf_runs if run.root else None)
    (e_in, t_in, c_in, _), (e_dir, t_dir, c_dir, _) = pyscf_runs["incore"], pyscf_runs["direct"]
    cycles = int(mf.cycles)
    run.log(f"E(semi-direct {method.upper()}) = {energy:.12f}   E(PySCF) = {ref:.12f}   "
            f"diff = {energy - ref:+.2e}")
    run.log(f"time: semi-direct {t_scf:.2f} s ({cycles} cycles); PySCF in core {t_in:.2f} s "
            f"({c_in} cycles), direct {t_dir:.2f} s ({c_dir} cycles, E = {e_dir:.12f})")
    return run.finish(energy, ref, TOLERANCE if converged else 0.0, iterations=cycles,
                      converged=converged, method=method, batches=batches,
                      stored_batches=stored, screened_batches=screened,
                      stored_bytes=stored_bytes, overflow_batches=n_direct,
                      granularity=st.get("granularity"), nao=mol.nao_nr(),
                      scf_seconds=round(t_scf, 3),
                      pyscf_incore_energy=e_in, pyscf_incore_seconds=round(t_in, 3),
                      pyscf_incore_cycles=c_in, pyscf_direct_energy=e_dir,
                      pyscf_direct_seconds=round(t_dir, 3), pyscf_direct_cycles=c_dir)


if __name__ == "__main__":
    _common.cli(main)
