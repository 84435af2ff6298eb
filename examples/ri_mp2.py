"""Out-of-core RI-MP2: B[i,a,P] in a DiskArray, the energy from blocks read ahead.

1. RHF by PySCF (rank 0, broadcast); the auxiliary basis is the ``mp2fit`` basis that
   ``pyscf.mp.dfmp2.DFMP2`` uses by default (``df.make_auxbasis(mol, mp2fit=True)``).
2. Three-index integrals (mu nu|P) by PySCF, one block of auxiliary shells at a time, are
   transformed to (ia|P) and written to a ``cio.DiskArray`` B of shape (nocc, nvir, naux):
   each rank ``write_all``s its ``cio.block_section`` of the occupied rows. A second pass
   over each rank's rows applies the fitting metric, B = (ia|Q) L^-T with J = L L^T.
3. The energy loop takes i-blocks (dealt out by ``cio.sync.Counter``, read ahead with
   ``cio.prefetch``) and, for each, reads the j-blocks j >= i with ``iter_blocks``
   read-ahead:  E = sum_ijab (ia|jb) [2 (ia|jb) - (ib|ja)] / (e_i + e_j - e_a - e_b).
   The block size comes from ``--max-memory`` so that B need not fit in memory; the
   script reports how many passes over B that took. ``--dask`` computes the same energy
   again through ``B.to_dask()``.

    python examples/ri_mp2.py --basis cc-pvdz --max-memory 0.2 --dask

Reference: ``pyscf.mp.dfmp2.DFMP2(mf).run().e_corr``; the run passes when |dE| < 1e-9 Eh.
``main(argv)`` is also what ``chemio demo`` runs.
"""
from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import chemio_py as cio  # noqa: E402

TOLERANCE = 1e-9
# What ``chemio demo`` runs: water, cc-pVTZ, B out of core (blocks of one occupied row
# under a 0.5 MB cap: five passes), two blocks read ahead, then the I/O report.
DEMO_ARGV = ["--atom", _common.WATER, "--basis", "cc-pvtz", "--max-memory", "0.5",
             "--depth", "2", "--report"]


def _api():
    """(DiskArray, block_section, iter_blocks) from chemio_py."""
    from chemio_py.diskarray import DiskArray, block_section
    from chemio_py.prefetch import iter_blocks
    return (getattr(cio, "DiskArray", DiskArray), getattr(cio, "block_section", block_section),
            getattr(cio, "iter_blocks", iter_blocks))


class Rows:
    """Rows ``lo:hi`` (axis 0) of a DiskArray, as an array ``iter_blocks`` can read."""

    def __init__(self, d, lo: int, hi: int):
        self.d, self.lo = d, lo
        self.shape = (hi - lo,) + tuple(d.shape[1:])
        self.dtype, self.chunks, self.name = d.dtype, d.chunks, d.name

    def aread(self, section, out):
        first, *rest = section
        return self.d.aread((slice(first.start + self.lo, first.stop + self.lo), *rest), out)


def block_rows(nocc: int, nvir: int, naux: int, max_memory_mb: float | None, depth: int) -> int:
    """Occupied rows per block so that the energy loop's buffers fit in ``max_memory``.

    Buffers: (depth + 1) i-blocks and (depth + 1) j-blocks of b*nvir*naux doubles, and
    two b*nvir*b*nvir products. Without a budget: all rows in one block.
    """
    if max_memory_mb is None:
        return nocc
    budget = max_memory_mb * 1e6
    for b in range(nocc, 0, -1):
        need = 8 * (2 * (depth + 1) * b * nvir * naux + 2 * (b * nvir) ** 2)
        if need <= budget:
            return b
    return 1


def pair_energy(bi: np.ndarray, bj: np.ndarray, eo_i: np.ndarray, eo_j: np.ndarray,
                ev: np.ndarray) -> float:
    """sum over i in bi, j in bj of (ia|jb)[2(ia|jb) - (ib|ja)] / (e_i + e_j - e_a - e_b)."""
    ni, nv, naux = bi.shape
    nj = bj.shape[0]
    ovov = (bi.reshape(ni * nv, naux) @ bj.reshape(nj * nv, naux).T).reshape(ni, nv, nj, nv)
    denom = (eo_i[:, None, None, None] - ev[None, :, None, None]
             + eo_j[None, None, :, None] - ev[None, None, None, :])
    return float(np.einsum("iajb,iajb->", ovov / denom, 2.0 * ovov - ovov.transpose(0, 3, 2, 1)))


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


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=2, help="blocks read ahead")
    p.add_argument("--aux-block", type=int, default=None, metavar="N",
                   help="auxiliary functions per integral block (default: from --max-memory)")
    p.add_argument("--dask", action="store_true",
                   help="also compute the energy through DiskArray.to_dask()")
    p.add_argument("--report", action="store_true",
                   help="print the chemio I/O report (cio.report()) before the JSON line")
    args = p.parse_args(argv)
    DiskArray, block_section, iter_blocks = _api()
    run = _common.Run("ri_mp2", args)
    comm = run.comm
    mol = _common.make_mol(args)

    import scipy.linalg
    from pyscf import df, scf
    from pyscf.df.incore import aux_e2, fill_2c2e

    def rhf():
        mf = scf.RHF(mol)
        mf.conv_tol = 1e-11
        mf.kernel()
        return mf
    mf = None
    with comm.agree("the RHF reference"):
        if run.root:
            mf = rhf()
    e_hf, mo_coeff, mo_energy, mo_occ = comm.bcast(
        (mf.e_tot, mf.mo_coeff, mf.mo_energy, mf.mo_occ) if run.root else None)
    nocc = int(np.count_nonzero(mo_occ > 0))
    co, cv = mo_coeff[:, :nocc], mo_coeff[:, nocc:]
    eo, ev = mo_energy[:nocc], mo_energy[nocc:]
    nvir = cv.shape[1]
    auxmol = df.addons.make_auxmol(mol, df.make_auxbasis(mol, mp2fit=True))
    naux = auxmol.nao_nr()
    nao = mol.nao_nr()
    rows = block_rows(nocc, nvir, naux, args.max_memory, args.depth)
    tensor = nocc * nvir * naux * 8
    run.log(f"RHF E = {e_hf:.10f}; {nao} basis functions, {nocc} occupied, {nvir} virtual, "
            f"{naux} auxiliary (mp2fit); B is {tensor / 2**20:.2f} MiB; blocks of {rows} "
            f"occupied rows ({rows * nvir * naux * 8 / 2**20:.3f} MiB) under "
            f"--max-memory {args.max_memory}")

    # ------------------------------------------------------------ 1. B[i,a,P] on disk
    t0 = time.perf_counter()
    # one chunk = one block of the energy loop: each block read is one contiguous request
    B = DiskArray.create("ri_mp2.B", (nocc, nvir, naux), "f8", chunks=(rows, nvir, naux))
    mine = block_section(B.shape, comm, axis=0, chunks=B.chunks)
    i0, i1 = mine[0].start, mine[0].stop
    if args.aux_block:
        aux_per_block = args.aux_block
    elif args.max_memory is not None:          # (mu nu|P) block + its (i,a,P) transform
        # the same on every rank (write_all is collective): size it for the largest share
        share = max(1, int(comm.allreduce(i1 - i0, "max")))
        aux_per_block = int(args.max_memory * 1e6 / (8 * (nao * nao + 2 * share * nvir)))
    else:
        aux_per_block = naux
    aux_per_block = max(1, aux_per_block)
    aux_loc = auxmol.ao_loc_nr()
    shell_blocks, s0 = [], 0                   # shells of at most aux_per_block functions
    for s in range(1, auxmol.nbas + 1):
        if s == auxmol.nbas or aux_loc[s + 1] - aux_loc[s0] > aux_per_block:
            shell_blocks.append((s0, s))
            s0 = s
    for k0, k1 in run.progress(shell_blocks, "3-index integrals", unit="block"):  # all ranks
        j3c = aux_e2(mol, auxmol, "int3c2e", aosym="s1", shls_slice=(0, mol.nbas, 0, mol.nbas,
                                                                        k0, k1))
        p0, p1 = int(aux_loc[k0]), int(aux_loc[k1])
        half = np.tensordot(co[:, i0:i1], j3c, axes=([0], [0]))           # (i, nu, P)
        iap = np.einsum("nb,inP->ibP", cv, half, optimize=True)
        B.write_all((slice(i0, i1), slice(0, nvir), slice(p0, p1)), np.ascontiguousarray(iap))
    j2c = fill_2c2e(mol, auxmol)
    try:
        low = scipy.linalg.cholesky(j2c, lower=True)
        fit = lambda x: scipy.linalg.solve_triangular(low, x.T, lower=True).T  # noqa: E731
    except scipy.linalg.LinAlgError:                    # as PySCF: drop the null space
        w, u = np.linalg.eigh(j2c)
        keep = w > 1e-7
        m2c = (u[:, keep] / np.sqrt(w[keep])) @ u[:, keep].T
        fit = lambda x: x @ m2c                          # noqa: E731
    nfit = 0
    with cio.WriteBehind(depth=args.depth, name="ri_mp2 fit write") as wb:
        for sec, blk in iter_blocks(Rows(B, i0, i1), size=rows, depth=args.depth,
                                    name="ri_mp2 fit read"):
            lo, hi = sec[0].start + i0, sec[0].stop + i0
            out = fit(blk.reshape(-1, naux)).reshape(blk.shape)    # a new array per block
            wb.submit(B.awrite, (slice(lo, hi), slice(0, nvir), slice(0, naux)), out)
            nfit += 1
    B.flush()
    comm.barrier()                             # every rank's rows are on disk
    t_build = time.perf_counter() - t0
    run.log(f"B written in {t_build:.2f} s: {len(shell_blocks)} auxiliary blocks, rows "
            f"{i0}:{i1} here, {nfit} fitting blocks", all_ranks=True)

    # ------------------------------------------------------------ 2. the energy loop
    t0 = time.perf_counter()
    read_before = B.stats.bytes_read
    nblk = math.ceil(nocc / rows)
    loop = _common.SharedLoop(comm)
    e_local = 0.0
    passes = 0

    def read_iblock(ib, buf):
        lo, hi = ib * rows, min((ib + 1) * rows, nocc)
        return B.aread((slice(lo, hi), slice(0, nvir), slice(0, naux)),
                       buf[:hi - lo])

    make = lambda: np.empty((rows, nvir, naux))  # noqa: E731
    iblocks = cio.prefetch(read_iblock, loop.tasks(nblk), make, depth=args.depth,
                           name="ri_mp2 i-blocks")
    for ib, bi in run.progress(iblocks, "i-blocks", total=nblk if comm.size == 1 else None,
                               unit="block"):
        lo, hi = ib * rows, min((ib + 1) * rows, nocc)
        passes += 1
        for sec, bj in iter_blocks(Rows(B, lo, nocc), size=rows, depth=args.depth,
                                   name="ri_mp2 j-blocks"):
            jlo, jhi = sec[0].start + lo, sec[0].stop + lo
            factor = 1.0 if jlo == lo else 2.0              # (I,J) and (J,I) are equal
            e_local += factor * pair_energy(bi, bj, eo[lo:hi], eo[jlo:jhi], ev)
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

    def reference() -> float:
        from pyscf.mp import dfmp2
        mf_ref = rhf() if mf is None else mf
        return dfmp2.DFMP2(mf_ref).run().e_corr
    ref = _common.energy_reference(run, reference)
    if run.root and not args.quiet:
        print(f"RI-MP2 correlation energy  {e_corr: .12f} Eh  ({comm.size} rank(s), "
              f"{passes} pass(es) over B, blocks of {rows} of {nocc} occupied rows)")
        print(f"PySCF DFMP2 reference      {ref: .12f} Eh")
        print(f"difference                 {e_corr - ref: .2e} Eh "
              f"({'within' if abs(e_corr - ref) <= TOLERANCE else 'OUTSIDE'} {TOLERANCE:.0e})")
        if e_dask is not None:
            print(f"through dask               {e_dask: .12f} Eh")
    if args.report and run.root:
        print()
        cio.report()
        print(flush=True)
    extra_err = [] if e_dask is None else [abs(e_dask - ref)]
    return run.finish(e_corr, ref, TOLERANCE, extra_errors=extra_err, e_hf=e_hf,
                      e_total=e_hf + e_corr, nocc=nocc, nvir=nvir, naux=naux,
                      block_rows=rows, iblocks=nblk, passes=passes,
                      tensor_bytes=tensor, tensor_reads=round(read_tensors, 3),
                      dask_energy=e_dask, build_seconds=round(t_build, 3),
                      energy_seconds=round(t_energy, 3))


if __name__ == "__main__":
    _common.cli(main)
