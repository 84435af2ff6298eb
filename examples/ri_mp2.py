"""Out-of-core RI-MP2: B[i,a,P] in a DiskArray, the energy from blocks read ahead.

1. RHF by PySCF (rank 0, broadcast): conventional (``--scf rhf``, the default) or
   density-fitted (``--scf df``: ``scf.RHF(mol).density_fit()``, as PySCF users run the
   reference of an RI-MP2 on larger molecules). The auxiliary basis of the MP2 is the
   ``mp2fit`` basis that ``pyscf.mp.dfmp2.DFMP2`` uses by default
   (``df.make_auxbasis(mol, mp2fit=True)``) in both cases.
2. Three-index integrals (mu nu|P) by PySCF (``aosym="s2ij"``), one block of auxiliary
   shells at a time, are transformed to (ia|P) (PySCF's ``nr_e2``, as in its DFMP2) and
   written to a scratch ``cio.DiskArray``
   L of shape (naux, nocc, nvir) (``request_shape`` = one auxiliary block: every write is
   contiguous): each rank ``write_all``s its ``cio.block_section`` of the occupied rows.
   A second pass reads each rank's rows of L (``iter_blocks`` read-ahead), applies the
   fitting metric, B = L^-1 (Q|ia) with J = L L^T, and writes B[i,a,P] (shape (nocc, nvir,
   naux), one chunk per block of the energy loop) behind the computation (``WriteBehind``).
3. The energy loop takes i-blocks (dealt out by ``cio.sync.Counter``) and, for each,
   the j-blocks j >= i, all as one ``cio.prefetch`` stream of block pairs (the read-ahead
   runs on from one pass into the next; a pass's first j-block is its i-block, kept):
   E = sum_ijab (ia|jb) [2 (ia|jb) - (ib|ja)] / (e_i + e_j - e_a - e_b),
   one BLAS product per pair of blocks. The block size comes from ``--max-memory`` so
   that B need not fit in memory; the script reports how many passes over B that took.
   ``--dask`` computes the same energy again through ``B.to_dask()``.

Both out-of-core steps run with the BLAS and OpenMP threads limited to the cores other
processes leave free, less the share the I/O threads keep busy
(``cio.blas_threads_beside_io``, measured from ``/proc/stat`` over the preceding step): on
a node where another process holds a core, threads that spin against it and against the
read-ahead cost far more than they bring (``--blas-threads`` sets the count, ``all`` keeps
the library's own). PySCF's reference runs with its own settings.

    python examples/ri_mp2.py --basis cc-pvdz --max-memory 0.2 --dask
    python examples/ri_mp2.py --atom molecule.xyz --scf df --max-memory 10

Reference: ``pyscf.mp.dfmp2.DFMP2`` (in core, ``with_t2=False``) on the same SCF with the
same auxiliary basis; the run passes when |dE| < 1e-9 Eh. The JSON line has the seconds of
the out-of-core part (``build_seconds`` + ``energy_seconds`` = ``ooc_seconds``) beside
PySCF's (``reference_seconds``). ``main(argv)`` is also what ``chemio demo`` runs.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import chemio_py as cio  # noqa: E402

TOLERANCE = 1e-9
IO_SHARE = 0.25      # cores the read-ahead/write-behind threads keep busy (page-cache copies)
# What ``chemio demo`` runs: water, cc-pVTZ, B out of core (blocks of one occupied row
# under a 0.5 MB cap: five passes), two blocks read ahead, then the I/O report.
DEMO_ARGV = ["--atom", _common.WATER, "--basis", "cc-pvtz", "--max-memory", "0.5",
             "--depth", "2", "--report"]


def _api():
    """(DiskArray, block_section) from chemio_py."""
    from chemio_py.arrays.diskarray import DiskArray, block_section
    return getattr(cio, "DiskArray", DiskArray), getattr(cio, "block_section", block_section)


def block_rows(nocc: int, nvir: int, naux: int, max_memory_mb: float | None, depth: int) -> int:
    """Occupied rows per block so that the energy loop's buffers fit in ``max_memory``.

    Buffers: one held i-block and (depth + 1) j-blocks read ahead, of b*nvir*naux
    doubles, the nvir*b*nvir product of one occupied row with a j-block and three nvir*nvir work
    arrays. Without a budget: all rows in one block. At least one row.
    """
    if max_memory_mb is None:
        return nocc
    budget = max_memory_mb * 1e6
    for b in range(nocc, 0, -1):
        need = 8 * ((depth + 2) * b * nvir * naux + b * nvir * nvir + 3 * nvir * nvir)
        if need <= budget:
            return b
    return 1


def pair_energy(bi: np.ndarray, bj: np.ndarray, eo_i: np.ndarray, eo_j: np.ndarray,
                ev: np.ndarray, diagonal: bool = False, work: list | None = None) -> float:
    """sum over i in bi, j in bj of (ia|jb)[2(ia|jb) - (ib|ja)] / (e_i + e_j - e_a - e_b).

    Per occupied row i, one BLAS product (ia|jb) = B[i] B[j0:]^T of shape (nvir, naux) x
    (naux, nj*nvir): the inner dimension is the auxiliary basis and the product holds one
    row's nvir*nj*nvir (not the block's (ni*nvir)^2, which falls out of cache as blocks
    grow), then every (i, j) pair on an nvir x nvir tile. ``diagonal``: bi and bj are the
    same block; only the pairs j >= i are formed (j > i counted twice, as (i,j) and (j,i)
    are equal).
    """
    ni, nv, naux = bi.shape
    nj = bj.shape[0]
    bjm = bj.reshape(nj * nv, naux)
    if work is None:
        work = [np.add.outer(ev, ev), np.empty((nv, nv)), np.empty((nv, nv))]
    evv, t, w = work
    e = 0.0
    for i in range(ni):
        j0 = i if diagonal else 0
        g = (bi[i] @ bjm[j0 * nv:].T).reshape(nv, nj - j0, nv)
        for j in range(j0, nj):
            gij = g[:, j - j0, :]
            np.subtract(eo_i[i] + eo_j[j], evv, out=t)     # the denominator
            np.divide(gij, t, out=t)                        # t = (ia|jb) / D
            np.multiply(gij, 2.0, out=w)
            np.subtract(w, gij.T, out=w)                    # 2 (ia|jb) - (ib|ja)
            e += (1.0 if diagonal and i == j else 2.0) * float(np.vdot(t, w))
    return e


def dask_energy(d, eo: np.ndarray, ev: np.ndarray, rows: int) -> float:
    """The same energy through ``d.to_dask()``: blocks of ``rows`` occupied orbitals."""
    import dask.array as da
    nocc, nvir, naux = d.shape
    b = d.to_dask().rechunk((rows, nvir, naux))
    ovov = da.einsum("iaP,jbP->iajb", b, b)
    e_o = da.from_array(eo, chunks=rows)
    e_v = da.from_array(ev, chunks=nvir)
    denom = (e_o[:, None, None, None] - e_v[None, :, None, None]
             + e_o[None, None, :, None] - e_v[None, None, None, :])
    return float((ovov / denom * (2.0 * ovov - ovov.transpose(0, 3, 2, 1))).sum()
                 .compute(scheduler="threads"))


def shell_blocks(auxmol, per_block: int) -> list[tuple[int, int]]:
    """Consecutive auxiliary shells ``(s0, s1)`` of at most ``per_block`` functions (one
    shell at least)."""
    aux_loc = auxmol.ao_loc_nr()
    out, s0 = [], 0
    for s in range(1, auxmol.nbas + 1):
        if s == auxmol.nbas or aux_loc[s + 1] - aux_loc[s0] > per_block:
            out.append((s0, s))
            s0 = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--scf", choices=("rhf", "df"), default="rhf",
                   help="the reference: conventional RHF, or density-fitted RHF "
                        "(scf.RHF(mol).density_fit(), much cheaper on larger molecules)")
    p.add_argument("--scf-auxbasis", default=None, metavar="BASIS",
                   help="auxiliary basis of --scf df (default: PySCF's, e.g. cc-pvdz-jkfit); "
                        "the MP2 always uses the mp2fit basis")
    p.add_argument("--depth", type=int, default=2, help="blocks read ahead")
    p.add_argument("--aux-block", type=int, default=None, metavar="N",
                   help="auxiliary functions per integral block (default: from --max-memory)")
    p.add_argument("--dask", action="store_true",
                   help="also compute the energy through DiskArray.to_dask()")
    p.add_argument("--reference-first", action="store_true",
                   help="run PySCF's reference before the out-of-core part (for A/B timing "
                        "in both orders)")
    p.add_argument("--blas-threads", default="auto", metavar="N|auto|all",
                   help="BLAS/OpenMP threads of the out-of-core part: auto (the free cores "
                        "less the I/O share, measured), a number, or all (not limited)")
    p.add_argument("--report", action="store_true",
                   help="print the chemio I/O report (cio.report()) before the JSON line")
    args = p.parse_args(argv)
    if args.scf_auxbasis is not None and args.scf != "df":
        p.error("--scf-auxbasis needs --scf df")
    if args.blas_threads not in ("auto", "all") and not (
            args.blas_threads.isdigit() and int(args.blas_threads) >= 1):
        p.error(f"--blas-threads must be auto, all or a number >= 1, got {args.blas_threads!r}")
    DiskArray, block_section = _api()
    from chemio_py.runtime.blas import CpuSample
    since_scf = CpuSample()              # the load of other processes, measured over the SCF
    run = _common.Run("ri_mp2", args)
    comm = run.comm
    mol = _common.make_mol(args)

    import scipy.linalg
    from pyscf import df, gto, scf
    from pyscf.ao2mo import _ao2mo
    from pyscf.df.incore import aux_e2, fill_2c2e

    def rhf():
        mf = scf.RHF(mol)
        if args.scf == "df":
            mf = mf.density_fit(auxbasis=args.scf_auxbasis)
        mf.conv_tol = 1e-11
        mf.kernel()
        return mf
    mf = None
    t0 = time.perf_counter()
    with comm.agree("the RHF reference"):
        if run.root:
            mf = rhf()
    e_hf, mo_coeff, mo_energy, mo_occ = comm.bcast(
        (mf.e_tot, mf.mo_coeff, mf.mo_energy, mf.mo_occ) if run.root else None)
    t_scf = time.perf_counter() - t0
    nocc = int(np.count_nonzero(mo_occ > 0))
    nvir = mo_coeff.shape[1] - nocc
    eo, ev = mo_energy[:nocc], mo_energy[nocc:]
    auxbasis = df.make_auxbasis(mol, mp2fit=True)
    auxmol = df.addons.make_auxmol(mol, auxbasis)
    naux = auxmol.nao_nr()
    nao = mol.nao_nr()
    rows = block_rows(nocc, nvir, naux, args.max_memory, args.depth)
    tensor = nocc * nvir * naux * 8
    scf_what = "RHF"
    if args.scf == "df":
        scf_what = f"DF-RHF ({mf.with_df.auxbasis})" if run.root else "DF-RHF"
    run.log(f"{scf_what} E = {e_hf:.10f} in {t_scf:.2f} s; {nao} basis functions, {nocc} "
            f"occupied, {nvir} virtual, {naux} auxiliary (mp2fit); B is "
            f"{tensor / 2**20:.2f} MiB; blocks of {rows} occupied rows "
            f"({rows * nvir * naux * 8 / 2**20:.3f} MiB) under --max-memory {args.max_memory}")

    t_ref = []

    def reference() -> float:
        """PySCF's DFMP2 in core on the same SCF, with the same (mp2fit) auxiliary basis."""
        from pyscf.mp import dfmp2
        mf_ref = rhf() if mf is None else mf
        t = time.perf_counter()
        mp = dfmp2.DFMP2(mf_ref)
        mp.with_df = df.DF(mol, auxbasis=auxbasis)      # not the SCF's fitting basis
        e = mp.kernel(with_t2=False)[0]
        t_ref.append(time.perf_counter() - t)
        return e
    if args.reference_first:
        ref = _common.energy_reference(run, reference)

    def threads_beside_io(since):
        """The thread limit of one out-of-core step (a no-op with --blas-threads all)."""
        if args.blas_threads == "all":
            return contextlib.nullcontext(None)
        fixed = None if args.blas_threads == "auto" else int(args.blas_threads)
        return cio.blas_threads_beside_io(IO_SHARE, threads=fixed, since=since)

    # ------------------------------------------------------------ 1. B[i,a,P] on disk
    since_build = CpuSample()
    with threads_beside_io(since_scf) as nthreads:
        t0 = time.perf_counter()
        # one chunk = one block of the energy loop: each block read is one contiguous request
        B = DiskArray.create("ri_mp2.B", (nocc, nvir, naux), "f8", chunks=(rows, nvir, naux))
        mine = block_section(B.shape, comm, axis=0, chunks=B.chunks)
        i0, i1 = mine[0].start, mine[0].stop
        ni = i1 - i0
        # the same on every rank (write_all is collective): size blocks for the largest share
        share = max(1, int(comm.allreduce(ni, "max")))
        npair = nao * (nao + 1) // 2
        if args.aux_block:
            aux_per_block = args.aux_block
        elif args.max_memory is not None:
            # per auxiliary function: (mu>=nu|P) and (P|ia)
            aux_per_block = int(args.max_memory * 1e6 / (8 * (npair + share * nvir)))
        else:
            aux_per_block = naux
        blocks = shell_blocks(auxmol, max(1, aux_per_block))
        widest = max(int(auxmol.ao_loc_nr()[k1] - auxmol.ao_loc_nr()[k0]) for k0, k1 in blocks)
        aux_loc = auxmol.ao_loc_nr()
        # (ia|P) unfitted, auxiliary index first: every auxiliary block is one contiguous write
        L = DiskArray.create("ri_mp2.L", (naux, nocc, nvir), "f8",
                             request_shape=(widest, None, None))
        mo = np.asarray(mo_coeff, order="F")
        # the shell-pair data of the integrals, once (aux_e2 would make it for every block)
        cintopt = gto.moleintor.make_cintopt(
            *gto.mole.conc_env(mol._atm, mol._bas, mol._env, auxmol._atm, auxmol._bas,
                               auxmol._env), mol._add_suffix("int3c2e"))
        for k0, k1 in run.progress(blocks, "3-index integrals", unit="block"):  # all ranks
            p0, p1 = int(aux_loc[k0]), int(aux_loc[k1])
            j3c = aux_e2(mol, auxmol, "int3c2e", aosym="s2ij",
                         shls_slice=(0, mol.nbas, 0, mol.nbas, k0, k1),      # (mu>=nu, P)
                         cintopt=cintopt)
            # PySCF's own transformation from the packed triangle (as its DFMP2 does)
            if ni:
                pia = _ao2mo.nr_e2(np.asarray(j3c.T, order="C"), mo,
                                   (i0, i1, nocc, nocc + nvir),
                                   aosym="s2").reshape(p1 - p0, ni, nvir)   # (P|ia)
            else:                                  # more ranks than occupied rows
                pia = np.empty((p1 - p0, 0, nvir))
            del j3c
            L.write_all((slice(p0, p1), slice(i0, i1), slice(0, nvir)), pia)
            del pia
        t_int = time.perf_counter() - t0
        j2c = fill_2c2e(mol, auxmol)
        try:
            low = scipy.linalg.cholesky(j2c, lower=True)
            fit = lambda x: scipy.linalg.solve_triangular(  # noqa: E731
                low, x, lower=True, check_finite=False)
        except scipy.linalg.LinAlgError:                    # as PySCF: drop the null space
            w, u = np.linalg.eigh(j2c)
            keep = w > 1e-7
            m2c = (u[:, keep] / np.sqrt(w[keep])) @ u[:, keep].T
            fit = lambda x: m2c @ x                          # noqa: E731
        nfit = 0
        with cio.WriteBehind(depth=args.depth, name="ri_mp2 fit write") as wb:
            for sec, blk in L.iter_blocks(axis=1, size=rows, start=i0, stop=i1,
                                          depth=args.depth, name="ri_mp2 fit read"):
                lo, hi = sec[1].start, sec[1].stop
                y = fit(blk.reshape(naux, -1))                            # (Q|ia), fitted
                out = np.ascontiguousarray(y.T).reshape(hi - lo, nvir, naux)  # new per block
                wb.submit(B.awrite, (slice(lo, hi), slice(0, nvir), slice(0, naux)), out)
                nfit += 1
        L.close()                                  # scratch: gone
        if comm.size > 1:                          # other ranks read these rows (MPI-IO: sync)
            B.flush()
        comm.barrier()                             # every rank's rows are written
        t_build = time.perf_counter() - t0
    run.log(f"B written in {t_build:.2f} s: {len(blocks)} auxiliary blocks, rows "
            f"{i0}:{i1} here, {nfit} fitting blocks", all_ranks=True)

    # ------------------------------------------------------------ 2. the energy loop
    with threads_beside_io(since_build) as nthreads_energy:
        t0 = time.perf_counter()
        read_before = B.stats.bytes_read
        nblk = math.ceil(nocc / rows)
        loop = _common.SharedLoop(comm)
        e_local = 0.0
        passes = 0
        work = [np.add.outer(ev, ev), np.empty((nvir, nvir)), np.empty((nvir, nvir))]

        def pairs():
            """(i-block, j-block) for j >= i over this rank's i-blocks: one stream, so the
            read-ahead runs on across passes; a pass's first j-block is its i-block."""
            for ib in loop.tasks(nblk):
                for jb in range(ib, nblk):
                    yield ib, jb

        def read_jblock(key, buf):
            lo, hi = key[1] * rows, min((key[1] + 1) * rows, nocc)
            return B.aread((slice(lo, hi), slice(0, nvir), slice(0, naux)), buf[:hi - lo])

        make = lambda: np.empty((rows, nvir, naux))  # noqa: E731
        bi = np.empty((rows, nvir, naux))          # the pass's i-block, held while j streams
        stream = cio.prefetch(read_jblock, pairs(), make, depth=args.depth,
                              name="ri_mp2 j-blocks")
        for (ib, jb), bj in run.progress(stream, "block pairs", unit="pair",
                                         total=nblk * (nblk + 1) // 2 if comm.size == 1
                                         else None):
            lo, hi = ib * rows, min((ib + 1) * rows, nocc)
            jlo, jhi = jb * rows, min((jb + 1) * rows, nocc)
            if jb == ib:
                passes += 1
                np.copyto(bi[:hi - lo], bj)
            e_local += pair_energy(bi[:hi - lo], bj, eo[lo:hi], eo[jlo:jhi], ev,
                                   diagonal=jb == ib, work=work)
        e_corr = float(comm.allreduce(e_local, "sum"))
        passes = int(comm.allreduce(passes, "sum"))
        loop.free()
        t_energy = time.perf_counter() - t0
    read_tensors = sum(comm.allgather(B.stats.bytes_read - read_before)) / max(tensor, 1)
    run.log(f"E(RI-MP2 corr) = {e_corr:.12f} from {nblk} i-block(s) of {rows} rows: "
            f"{passes} pass(es) over B ({read_tensors:.2f}x its size read) in {t_energy:.2f} s")

    # ------------------------------------------------------------ 3. optional: dask
    e_dask = None
    if args.dask:
        with comm.agree("the dask energy"):
            if run.root:
                e_dask = dask_energy(B, eo, ev, rows)
        e_dask = comm.bcast(e_dask)
        run.log(f"E(RI-MP2 corr) through dask = {e_dask:.12f} "
                f"(loop - dask = {e_corr - e_dask:+.1e})")
    B.close()

    if not args.reference_first:
        ref = _common.energy_reference(run, reference)
    t_ooc = t_build + t_energy
    t_pyscf = comm.bcast(t_ref[0] if run.root else None)
    if run.root and not args.quiet:
        print(f"RI-MP2 correlation energy  {e_corr: .12f} Eh  ({comm.size} rank(s), "
              f"{passes} pass(es) over B, blocks of {rows} of {nocc} occupied rows)")
        print(f"PySCF DFMP2 reference      {ref: .12f} Eh")
        print(f"difference                 {e_corr - ref: .2e} Eh "
              f"({'within' if abs(e_corr - ref) <= TOLERANCE else 'OUTSIDE'} {TOLERANCE:.0e})")
        if e_dask is not None:
            print(f"through dask               {e_dask: .12f} Eh")
        print(f"out of core (B + energy)   {t_ooc:.2f} s; PySCF DFMP2 in core {t_pyscf:.2f} s")
    if args.report and run.root:
        print()
        cio.report()
        print(flush=True)
    extra_err = [] if e_dask is None else [abs(e_dask - ref)]
    return run.finish(e_corr, ref, TOLERANCE, extra_errors=extra_err, e_hf=e_hf,
                      e_total=e_hf + e_corr, scf=args.scf, nao=nao, nocc=nocc, nvir=nvir,
                      naux=naux, block_rows=rows, iblocks=nblk, passes=passes,
                      aux_blocks=len(blocks), max_memory=args.max_memory,
                      tensor_bytes=tensor, tensor_reads=round(read_tensors, 3),
                      dask_energy=e_dask, scf_seconds=round(t_scf, 3),
                      build_seconds=round(t_build, 3), energy_seconds=round(t_energy, 3),
                      integral_seconds=round(t_int, 3), fit_seconds=round(t_build - t_int, 3),
                      blas_threads=[nthreads, nthreads_energy],
                      ooc_seconds=round(t_ooc, 3), reference_seconds=round(t_pyscf, 3))


if __name__ == "__main__":
    _common.cli(main)
