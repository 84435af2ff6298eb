"""MRCI-style Davidson: the lowest root of a CAS Hamiltonian with its subspace on disk.

The pattern of the MRCI code in the ChemIO paper. The Davidson trial vectors c_k and their
products sigma_k = H c_k live in one growing ``cio.DiskArray`` of shape (k + 1, 2, ndet)
(``append`` a vector per iteration, ``resize`` back to one row when the subspace
collapses), each vector in ``--segments`` chunks (compressed on the ``zarr`` backend with
``--compress zstd``). H c is PySCF's
``fci.direct_spin1.contract_2e``, split into ``--tasks`` tasks over blocks of rows of the
(1e-absorbed) two-electron integrals -- the contraction is linear in them. Ranks take
tasks from a ``cio.sync.Counter``; each task's partial sigma is added into the shared
sigma under a ``cio.sync.Mutex``, segment by segment (read, add, write back), with the
next segment read ahead and the previous one written behind. Rank 0 runs the subspace
algebra, streaming the vectors segment by segment from the array.

    mpiexec -n 3 python -m mpi4py examples/mrci_davidson.py --ncas 6 --nelecas 6

Reference: PySCF's CASCI energy of the same active space (its FCI solver); the run passes
when |dE| < 1e-8 Eh.
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

TOLERANCE = 1e-8
class Subspace:
    """The Davidson subspace in one growing ``cio.DiskArray``: row ``j`` holds the trial
    vector c_j (``[j, 0]``) and its sigma_j = H c_j (``[j, 1]``), shape ``(k + 1, 2, n)``.

    A new trial vector is one ``append`` (its sigma row starts as zeros); a collapse to the
    Ritz vector rewrites row 0 and shrinks the array to one row (``resize``). Each vector
    is stored in ``nseg`` segments, one chunk each, read ahead and written behind segment
    by segment. ``--compress zstd`` keeps the array on the ``zarr`` backend with zstd.
    """

    def __init__(self, name: str, n: int, nseg: int, compress: str, comm, depth: int):
        self.n, self.depth, self.comm = n, depth, comm
        self.nseg = max(1, min(nseg, n))
        self.seglen = math.ceil(n / self.nseg)
        self.nseg = math.ceil(n / self.seglen)
        kw = {} if compress == "none" else {"backend": "zarr", "compressor": compress}
        self.d = cio.DiskArray.create(name, (0, 2, n), "f8", maxshape=(None, 2, n),
                                      chunks=(1, 1, self.seglen), comm=comm, **kw)

    def bounds(self, s: int) -> tuple[int, int]:
        lo = s * self.seglen
        return lo, min(lo + self.seglen, self.n)

    def _section(self, key: tuple) -> tuple:
        j, which, s = key
        lo, hi = self.bounds(s)
        return (j, which, slice(lo, hi))

    # ---------------------------------------------------------------- segments
    def awrite(self, key: tuple, data: np.ndarray) -> cio.Request:
        """Start writing segment ``key`` = (row, 0 or 1, segment); ``data`` stays as is."""
        return self.d.awrite(self._section(key), data)

    def segments(self, keys, depth: int | None = None):
        """``(key, segment)`` for ``keys`` = [(row, 0 or 1, segment), ...], read ahead."""
        depth = self.depth if depth is None else depth

        def read_into(key, buf):
            lo, hi = self.bounds(key[2])
            return self.d.aread(self._section(key), buf[:hi - lo])
        return cio.prefetch(read_into, keys, lambda: np.empty(self.seglen), depth=depth)

    # ---------------------------------------------------------------- whole vectors
    def read(self, j: int, which: int) -> np.ndarray:
        return self.d[j, which, :]

    def append(self, c: np.ndarray) -> int:
        """Collective: add trial vector ``c`` (the same on every rank) with a zero sigma."""
        return self.d.append(np.stack([c, np.zeros_like(c)]))[0] - 1

    def collapse(self) -> None:
        """Collective: keep row 0 only."""
        self.d.resize(1, axis=0)

    def accumulate(self, j: int, partial: np.ndarray, mutex) -> None:
        """sigma_j += partial, segment by segment under ``mutex`` (read, add, write back)."""
        ring = [np.empty(self.seglen) for _ in range(self.depth + 1)]
        with mutex:
            with cio.WriteBehind(depth=self.depth) as wb:
                keys = [(j, 1, s) for s in range(self.nseg)]
                for k, (key, seg) in enumerate(self.segments(keys)):
                    lo, hi = self.bounds(key[2])
                    out = ring[k % len(ring)][:hi - lo]   # free: its write completed
                    np.add(seg, partial[lo:hi], out=out)
                    wb.submit(self.awrite, key, out)
            # leaving the WriteBehind waited for every write: safe to release the mutex

    def combine(self, coeffs: dict[tuple, float], s: int, cache: dict) -> np.ndarray:
        lo, hi = self.bounds(s)
        out = np.zeros(hi - lo)
        for v, a in coeffs.items():
            out += a * cache[v]
        return out

    def stored_bytes(self) -> int:
        """Bytes the array's files take (compressed ones for ``zarr``)."""
        total = 0
        for root, _dirs, files in os.walk(self.d.path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total if os.path.isdir(self.d.path) else os.path.getsize(self.d.path)


def cas_problem(run, args):
    """(h1, h2 with h1 absorbed, ecore, norb, nelec, hdiag, reference) on every rank."""
    from pyscf import scf, mcscf, ao2mo
    from pyscf.fci import direct_spin1
    payload = None
    with run.comm.agree("the CAS integrals"):
        if run.root:
            mol = _common.make_mol(args)
            mf = scf.RHF(mol)
            mf.conv_tol = 1e-11
            mf.kernel()
            mc = mcscf.CASCI(mf, args.ncas, args.nelecas)
            h1, ecore = mc.get_h1eff()
            eri = ao2mo.restore(4, mc.get_h2eff(), args.ncas)
            nelec = mc.nelecas
            h2 = ao2mo.restore(4, direct_spin1.absorb_h1e(h1, eri, args.ncas, nelec, 0.5),
                               args.ncas)
            hdiag = direct_spin1.make_hdiag(h1, eri, args.ncas, nelec)
            mc.fcisolver.conv_tol = 1e-13
            ref = mc.kernel()[0]
            payload = (h2, float(ecore), tuple(int(x) for x in nelec), hdiag, float(ref),
                       mol.nao_nr(), mf.e_tot)
    return run.comm.bcast(payload)


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--ncas", type=int, default=6, help="active orbitals")
    p.add_argument("--nelecas", type=int, default=6, help="active electrons")
    p.add_argument("--segments", type=int, default=4,
                   help="segments per vector (more if --max-memory asks for smaller ones)")
    p.add_argument("--tasks", type=int, default=8,
                   help="tasks per H.c (blocks of rows of the two-electron integrals)")
    p.add_argument("--max-space", type=int, default=12, help="Davidson subspace size")
    p.add_argument("--conv", type=float, default=1e-10, help="energy convergence (Eh)")
    p.add_argument("--max-cycle", type=int, default=100)
    p.add_argument("--compress", choices=["none", "zstd"], default="none",
                   help="keep the subspace compressed (zarr backend, zstd)")
    p.add_argument("--depth", type=int, default=1, help="segments read ahead / written behind")
    args = p.parse_args(argv)
    run = _common.Run("mrci_davidson", args)
    comm = run.comm
    from pyscf import fci
    from pyscf.fci import direct_spin1

    h2, ecore, nelec, hdiag, ref, nao, e_hf = cas_problem(run, args)
    norb = args.ncas
    na = fci.cistring.num_strings(norb, nelec[0])
    nb = fci.cistring.num_strings(norb, nelec[1])
    ndet = na * nb
    nseg = args.segments
    if args.max_memory is not None:       # the streamed subspace steps hold a few segments
        seglen = max(1, int(args.max_memory * 1e6 / (8 * 3 * (args.depth + 1))))
        nseg = max(nseg, math.ceil(ndet / seglen))
    space = max(3, min(args.max_space, ndet))
    vecs = Subspace("davidson.subspace", ndet, nseg, args.compress, comm, args.depth)
    C = lambda k: (k, 0)       # noqa: E731  trial vector k: row k, plane 0
    S = lambda k: (k, 1)       # noqa: E731  its sigma vector: plane 1
    npair = h2.shape[0]
    ntasks = max(1, min(args.tasks, npair))
    rows = np.linspace(0, npair, ntasks + 1).round().astype(int)
    run.log(f"CAS({sum(nelec)}e,{norb}o) of {nao} basis functions: {ndet} determinants in "
            f"{vecs.nseg} segments of {vecs.seglen}; subspace of up to {space} vector pairs "
            f"in one growing DiskArray ({2 * space * ndet * 8 / 2**20:.2f} MiB at most, "
            f"backend {vecs.d.backend}), compress={args.compress}; "
            f"{ntasks} tasks per H.c over {comm.size} rank(s)")

    loop = _common.SharedLoop(comm)
    mutex = cio.sync.Mutex(comm=comm)
    link = (fci.cistring.gen_linkstr_index_trilidx(range(norb), nelec[0]),
            fci.cistring.gen_linkstr_index_trilidx(range(norb), nelec[1]))

    def sigma(k: int) -> int:
        """sigma_k += H c_k, tasks shared by all ranks (sigma_k was zeroed); collective."""
        c = vecs.read(*C(k)).reshape(na, nb)
        done = 0
        for t in loop.tasks(ntasks):
            block = np.zeros_like(h2)
            block[rows[t]:rows[t + 1]] = h2[rows[t]:rows[t + 1]]
            part = direct_spin1.contract_2e(block, c, norb, nelec, link_index=link)
            vecs.accumulate(k, part.ravel(), mutex)
            done += 1
        comm.barrier()                          # every partial sigma is in the array
        return done

    x0 = np.zeros(ndet)
    x0[int(np.argmin(hdiag))] = 1.0
    k = vecs.append(x0)                         # every rank: the same first vector
    status = None
    heff = np.zeros((space, space))
    theta_old, theta, it, converged = None, None, 0, False
    for it in run.progress(range(1, args.max_cycle + 1), "Davidson iterations", unit="iter"):
        t_it = time.perf_counter()
        mine = sigma(k)
        collapsed, new = False, None
        if run.root:
            # subspace matrix column k, streamed segment by segment
            keys = [(*v, s) for s in range(vecs.nseg)
                    for v in [S(k)] + [C(j) for j in range(k + 1)]]
            col = np.zeros(k + 1)
            cur = None
            for (j, which, _s), seg in vecs.segments(keys):
                if which == 1:
                    cur = seg.copy()
                else:
                    col[j] += seg @ cur
            heff[:k + 1, k] = heff[k, :k + 1] = col
            w, u = np.linalg.eigh(heff[:k + 1, :k + 1])
            theta, alpha = float(w[0]), u[:, 0]
            # residual r = sum_j alpha_j (sigma_j - theta c_j); Ritz vector parts as needed
            r = np.empty(ndet)
            for (j, which, s), seg in vecs.segments([(*v, s) for s in range(vecs.nseg)
                                                     for i in range(k + 1)
                                                     for v in (C(i), S(i))]):
                lo, hi = vecs.bounds(s)
                if (j, which) == C(0):
                    r[lo:hi] = 0.0
                r[lo:hi] += alpha[j] * (seg if which == 1 else -theta * seg)
            rnorm = float(np.linalg.norm(r))
            de = float("inf") if theta_old is None else theta - theta_old
            converged = abs(de) < args.conv and rnorm < 1e-5
            run.log(f"iter {it:3d}  E = {theta + ecore:.12f}  dE = {de:+.2e}  |r| = "
                    f"{rnorm:.2e}  subspace {k + 1}  tasks here {mine} "
                    f"({time.perf_counter() - t_it:.2f} s)")
            theta_old = theta
            if not converged:
                if k + 1 == space:
                    # collapse to the Ritz vector: x = sum a_j c_j, sigma_x = sum a_j sigma_j,
                    # written into row 0; the array then shrinks to that row (all ranks)
                    alive = {j: float(alpha[j]) for j in range(k + 1)}
                    with cio.WriteBehind(depth=args.depth) as wb:
                        for s in range(vecs.nseg):
                            cache = {(j, which): seg.copy() for (j, which, _), seg in
                                     vecs.segments([(*C(j), s) for j in alive]
                                                   + [(*S(j), s) for j in alive])}
                            x = vecs.combine({C(j): a for j, a in alive.items()}, s, cache)
                            sx = vecs.combine({S(j): a for j, a in alive.items()}, s, cache)
                            wb.submit(vecs.awrite, (*C(0), s), x)
                            wb.submit(vecs.awrite, (*S(0), s), sx)
                            wb.flush()                 # x and sx are rebuilt next segment
                    heff[:] = 0.0
                    heff[0, 0] = theta
                    k = 0
                    collapsed = True
                    run.log("subspace collapsed to the Ritz vector")
                # Davidson correction, then orthogonalise to the subspace (twice)
                denom = theta - hdiag
                denom[np.abs(denom) < 1e-8] = 1e-8
                t = r / denom
                for _ in range(2):
                    dots = np.zeros(k + 1)
                    for (j, _w, s), seg in vecs.segments([(*C(j), s) for s in range(vecs.nseg)
                                                          for j in range(k + 1)]):
                        lo, hi = vecs.bounds(s)
                        dots[j] += seg @ t[lo:hi]
                    for (j, _w, s), seg in vecs.segments([(*C(j), s) for s in range(vecs.nseg)
                                                          for j in range(k + 1)]):
                        lo, hi = vecs.bounds(s)
                        t[lo:hi] -= dots[j] * seg
                tn = float(np.linalg.norm(t))
                if tn < 1e-14:
                    converged = True
                else:
                    new = t / tn
            status = ("done" if converged else "go", theta, collapsed, new)
        status = comm.bcast(status)
        theta, collapsed, new = status[1], status[2], status[3]
        if collapsed:
            vecs.collapse()                     # collective: rows beyond the Ritz vector go
            k = 0
        if status[0] == "done":
            converged = True
            break
        k = vecs.append(new)                    # collective: one vector more
    energy = float(theta + ecore)
    stored = vecs.stored_bytes() if args.compress != "none" else None
    vecs.d.close()
    mutex.free()
    loop.free()
    run.log(f"E(Davidson) = {energy:.12f}   E(PySCF CASCI) = {ref:.12f}   "
            f"diff = {energy - ref:+.2e}")
    return run.finish(energy, ref, TOLERANCE if converged else 0.0, iterations=it,
                      converged=converged, determinants=ndet, segments=vecs.nseg,
                      tasks_per_sigma=ntasks, compress=args.compress,
                      compressed_bytes_written=stored, hf_energy=e_hf)


if __name__ == "__main__":
    _common.cli(main)
