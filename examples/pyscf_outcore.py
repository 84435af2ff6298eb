"""PySCF's own out-of-core methods on chemio scratch, through the plug-in ``chemio_py.pyscf``.

Three of PySCF's methods run unchanged, with ``max_memory`` forced small so that PySCF
takes its out-of-core branch, twice each: on PySCF's own h5py scratch (``lib.H5TmpFile``
in ``TMPDIR``: the reference) and inside ``chemio_py.pyscf.patch(backend=...)``, which
puts that scratch on chemio (``local`` files, ``shm`` RAM, ``auto`` RAM with spill):

* ``ccsd``: ``cc.CCSD`` with out-of-core ERIs (``ccsd._make_eris_outcore``: the MO
  integrals in H5TmpFiles, read back block by block every iteration, with PySCF's
  ``lib.call_in_background`` double buffers);
* ``dfmp2``: ``mp.dfmp2.DFMP2`` with the (ia|P) tensor out of core (``force_outcore``:
  ``ovL`` and the half-transformed ``Lov0`` in H5TmpFiles, the energy loop reading
  blocks of occupied rows);
* ``davidson``: PySCF's FCI Davidson (``fci.direct_spin1``, ``davidson_only``) on the
  CAS(n, n) Hamiltonian of a ``mcscf.CASCI``, with the subspace on disk (PySCF's
  ``lib.linalg_helper._Xlist``, taken when the vectors do not fit ``max_memory``).

``--max-memory MB`` is the headroom PySCF gets over what the process already holds
(PySCF's ``max_memory`` counts the whole process; the Davidson gets it as its own
``max_memory``): the default 0.05 MB leaves every block at PySCF's minimum, the most I/O
calls per flop. Each part prints both energies, their difference and both times; the run
fails (exit 1) when a difference exceeds 1e-10 Eh or a part did not take its out-of-core
branch. Then chemio's I/O report (``cio.report()``). PySCF's reference of each part runs
first and pays the part's first-call costs: the times are for information
(``benchmarks/bench_pyscf.py`` compares them with warm-up and rotated order).

    python examples/pyscf_outcore.py --backend shm [--quick] [--parts ccsd,dfmp2]

``--quick``: water in 6-31G and CAS(6,6) (seconds); otherwise water in cc-pVDZ and
CAS(8,8). The JSON line has per part ``energy``, ``reference``, ``abs_error``,
``seconds`` (chemio), ``reference_seconds`` (h5py) and the chemio bytes moved.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import chemio_py as cio  # noqa: E402
import chemio_py.pyscf  # noqa: E402
from chemio_py.runtime import stats  # noqa: E402

TOLERANCE = 1e-10
PARTS = ("ccsd", "dfmp2", "davidson")
TITLES = {"ccsd": "CCSD, out-of-core ERIs", "dfmp2": "DF-MP2, out-of-core ovL",
          "davidson": "FCI Davidson, subspace on disk"}


class NotOutOfCore(RuntimeError):
    """PySCF took its in-core branch: the comparison would not exercise the scratch."""


def _budget(headroom: float) -> float:
    """PySCF's ``max_memory`` (MB) that leaves ``headroom`` MB over the process's size."""
    from pyscf import lib
    return lib.current_memory()[0] + headroom


def run_ccsd(mf, headroom: float) -> float:
    """CCSD correlation energy with PySCF's out-of-core ERIs."""
    from pyscf import cc
    m = cc.CCSD(mf)
    m.max_memory = _budget(headroom)
    m.conv_tol = 1e-11
    m.conv_tol_normt = 1e-8
    eris = m.ao2mo()
    if isinstance(eris.ovov, np.ndarray):
        raise NotOutOfCore(f"CCSD kept its ERIs in memory with max_memory={m.max_memory:.1f}"
                           f" MB; give a smaller --max-memory")
    m.kernel(eris=eris)
    e = float(m.e_corr)
    eris = m = None
    return e


def run_dfmp2(mf, headroom: float) -> float:
    """DF-MP2 correlation energy with the (ia|P) tensor out of core."""
    from pyscf import mp
    m = mp.dfmp2.DFMP2(mf)
    m.force_outcore = True                 # PySCF's switch: ovL in an H5TmpFile
    m.max_memory = _budget(headroom)
    eris = m.ao2mo()                       # (ia|P) built in blocks, written out of core
    if isinstance(eris.ovL, np.ndarray):
        raise NotOutOfCore("DF-MP2 kept ovL in memory")
    # PySCF's energy loop stops (MemoryError) when the process has grown past max_memory
    # since: measure again, with 0.5 MB to spare
    m.max_memory = _budget(headroom + 0.5)
    m.kernel(eris=eris, with_t2=False)
    eris = None
    e = float(m.e_corr)
    m = None
    return e


def run_davidson(mf, headroom: float, ncas: int) -> float:
    """CAS(ncas, ncas) FCI total energy from PySCF's Davidson (``davidson_only``) with
    ``max_memory=headroom``: the subspace does not fit and goes to ``_Xlist``."""
    from pyscf import fci, lib, mcscf
    from pyscf.lib import linalg_helper
    cas = mcscf.CASCI(mf, ncas, min(ncas, mf.mol.nelectron))
    h1, ecore = cas.get_h1eff()
    h2 = cas.get_h2eff()
    solver = fci.direct_spin1.FCI(mf.mol)
    solver.conv_tol = 1e-13
    made = []
    xlist = linalg_helper._Xlist

    class Counted(xlist):                  # count the on-disk subspaces PySCF makes
        def __init__(self) -> None:
            super().__init__()
            made.append(1)
    linalg_helper._Xlist = Counted
    try:
        with lib.with_omp_threads(1):      # one summation order for both runs
            e = float(solver.kernel(h1, h2, ncas, cas.nelecas, ecore=ecore,
                                    davidson_only=True, max_memory=headroom)[0])
    finally:
        linalg_helper._Xlist = xlist
    if not made:
        raise NotOutOfCore(f"the Davidson kept its subspace in memory with max_memory="
                           f"{headroom} MB; give a smaller --max-memory or a larger --cas")
    return e


def compare(part: str, fn, backend: str | None) -> dict:
    """``fn()`` on PySCF's h5py scratch, then through the plug-in: energies, times, I/O."""
    t = time.perf_counter()
    ref = fn()
    t_ref = time.perf_counter() - t
    before, used0 = stats.snapshot()["total"], chemio_py.pyscf.usage()
    t = time.perf_counter()
    with chemio_py.pyscf.patch(backend=backend):
        got = fn()
    t_got = time.perf_counter() - t
    after, used1 = stats.snapshot()["total"], chemio_py.pyscf.usage()
    return {"energy": got, "reference": ref, "abs_error": abs(got - ref),
            "seconds": round(t_got, 3), "reference_seconds": round(t_ref, 3),
            "bytes_written": after["bytes_written"] - before["bytes_written"],
            "bytes_read": after["bytes_read"] - before["bytes_read"],
            "h5tmpfiles": used1["h5tmpfiles"] - used0["h5tmpfiles"],
            "xlists": used1["xlists"] - used0["xlists"],
            "background_calls": used1["background_calls"] - used0["background_calls"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _common.parser(__doc__.splitlines()[0])
    p.set_defaults(max_memory=0.05)
    p.add_argument("--quick", action="store_true",
                   help="water in 6-31G and CAS(6,6) unless --basis/--cas say otherwise")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--cas", type=int, default=None,
                   help="active orbitals (and electrons) of the CASCI (default 8; 6 quick)")
    args = p.parse_args(argv)
    if args.quick and not any(a == "--basis" or a.startswith("--basis=") for a in argv):
        args.basis = "6-31g"
    ncas = args.cas if args.cas is not None else (6 if args.quick else 8)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        p.error(f"--parts {args.parts!r}: unknown {unknown or 'empty'}; choose from "
                f"{', '.join(PARTS)}")
    if args.max_memory <= 0:
        p.error(f"--max-memory {args.max_memory}: give megabytes > 0")
    run = _common.Run("pyscf_outcore", args)
    from pyscf import scf
    mol = _common.make_mol(args)
    if ncas < 2 or ncas > mol.nao_nr():
        p.error(f"--cas {ncas}: the molecule has {mol.nao_nr()} orbitals; give 2..that")
    t = time.perf_counter()
    mf = scf.RHF(mol).run(conv_tol=1e-12)
    run.log(f"RHF {mf.e_tot:.10f} Eh, {mol.nao_nr()} basis functions ({args.basis}), "
            f"{time.perf_counter() - t:.2f} s; backend {args.backend or 'default'}, "
            f"headroom {args.max_memory} MB")
    backend = args.backend
    jobs = {"ccsd": lambda: run_ccsd(mf, args.max_memory),
            "dfmp2": lambda: run_dfmp2(mf, args.max_memory),
            "davidson": lambda: run_davidson(mf, args.max_memory, ncas)}
    results: dict[str, dict] = {}
    try:
        for part in parts:
            run.log(f"{TITLES[part]}: PySCF on h5py, then through chemio_py.pyscf")
            results[part] = r = compare(part, jobs[part], backend)
            run.log(f"{part}: dE = {r['energy'] - r['reference']:+.1e} Eh, "
                    f"{r['reference_seconds']:.2f} s on h5py, {r['seconds']:.2f} s on chemio")
    except NotOutOfCore as e:
        print(f"[pyscf_outcore] error: {e}", file=sys.stderr, flush=True)
        return 1
    name = backend or cio.settings()["backend"].value
    if run.root and not args.quiet:
        print(f"PySCF out-of-core methods, {mol.nao_nr()} basis functions ({args.basis}); "
              f"h5py = PySCF's scratch, chemio = chemio_py.pyscf.patch(backend={name!r})")
        print(f"{'part':34s} {'E on h5py (Eh)':>19s} {'E on chemio (Eh)':>19s} "
              f"{'difference':>11s} {'h5py s':>7s} {'chemio s':>8s}")
        for part, r in results.items():
            label = TITLES[part] + (f" CAS({ncas},{ncas})" if part == "davidson" else "")
            print(f"{label:34s} {r['reference']:19.12f} {r['energy']:19.12f} "
                  f"{r['energy'] - r['reference']:+11.1e} {r['reference_seconds']:7.2f} "
                  f"{r['seconds']:8.2f}")
        worst = max(r["abs_error"] for r in results.values())
        print(f"largest difference {worst:.1e} Eh "
              f"({'within' if worst <= TOLERANCE else 'OUTSIDE'} {TOLERANCE:.0e})")
        print()
        cio.report()
        print(flush=True)
    first = results[parts[0]]
    return run.finish(first["energy"], first["reference"], TOLERANCE,
                      extra_errors=[r["abs_error"] for r in results.values()],
                      parts=results, nao=mol.nao_nr(), basis=args.basis, cas=ncas,
                      headroom_mb=args.max_memory, e_hf=float(mf.e_tot))


if __name__ == "__main__":
    _common.cli(main)
