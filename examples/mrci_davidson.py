"""MRCI-style Davidson: the lowest root of a CAS Hamiltonian with vectors in a Shared File.

The pattern of the MRCI code in the ChemIO paper. The Davidson trial vectors c_k and their
products sigma_k = H c_k live in one ``cio.SharedFile``, each cut into ``--segments``
segments (optionally compressed with numcodecs, ``--compress zstd``). H c is PySCF's
``fci.direct_spin1.contract_2e``, split into ``--tasks`` tasks over blocks of rows of the
(1e-absorbed) two-electron integrals -- the contraction is linear in them. Ranks take
tasks from a ``cio.sync.Counter``; each task's partial sigma is added into the shared
sigma under a ``cio.sync.Mutex``, segment by segment (read, add, write back), with the
next segment read ahead and the previous one written behind. Rank 0 runs the subspace
algebra, streaming the vectors segment by segment from the shared file.

    mpiexec -n 3 python -m mpi4py examples/mrci_davidson.py --ncas 6 --nelecas 6

Reference: PySCF's CASCI energy of the same active space (its FCI solver); the run passes
when |dE| < 1e-8 Eh.
"""
from __future__ import annotations

import math
import os
import struct
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import chemio_py as cio  # noqa: E402

TOLERANCE = 1e-8
_HEADER = struct.Struct("<q")        # compressed slot: payload length, then payload


class SegmentedVectors:
    """``nvec`` vectors of length ``n`` in a SharedFile, each cut into ``nseg`` segments.

    Segment ``s`` of vector ``v`` sits in its own fixed-size slot. Uncompressed, a slot
    is the segment's bytes; compressed, an 8-byte length and the codec's output (a length
    of 0 means a segment of zeros).
    """

    def __init__(self, name: str, nvec: int, n: int, nseg: int, codec, comm, depth: int):
        self.n, self.nvec, self.codec, self.depth = n, nvec, codec, depth
        self.nseg = max(1, min(nseg, n))
        self.seglen = math.ceil(n / self.nseg)
        self.nseg = math.ceil(n / self.seglen)
        raw = self.seglen * 8
        # zstd's worst case is a little over the input: leave room for it
        self.slot = raw if codec is None else _HEADER.size + raw + raw // 64 + 256
        size = nvec * self.nseg * self.slot
        self.sf = cio.SharedFile(name, soft_limit=size, hard_limit=size, request_size=self.slot,
                                 comm=comm)
        if comm.rank == 0:
            self.sf.truncate(size)          # fixed slots: every slot reads (zeros if unwritten)
        comm.barrier()
        self.stored = 0                                  # compressed bytes written here

    def bounds(self, s: int) -> tuple[int, int]:
        lo = s * self.seglen
        return lo, min(lo + self.seglen, self.n)

    def _offset(self, v: int, s: int) -> int:
        return (v * self.nseg + s) * self.slot

    # ---------------------------------------------------------------- one segment
    def _encode(self, data: np.ndarray) -> bytes:
        if not np.any(data):
            return _HEADER.pack(0)
        enc = bytes(self.codec.encode(np.ascontiguousarray(data)))
        return _HEADER.pack(len(enc)) + enc

    def awrite(self, v: int, s: int, data: np.ndarray) -> cio.Request:
        """Start writing segment ``s`` of vector ``v``; ``data`` must stay unmodified."""
        if self.codec is None:
            return self.sf.awrite(self._offset(v, s), data)
        blob = self._encode(data)
        self.stored += len(blob)
        return self.sf.awrite(self._offset(v, s), blob)

    def _read_blocking(self, key: tuple, buf: np.ndarray) -> np.ndarray:
        v, s = key
        lo, hi = self.bounds(s)
        out = buf[:hi - lo]
        if self.codec is None:
            return self.sf.read(self._offset(v, s), out)
        raw = np.empty(self.slot, np.uint8)
        self.sf.read(self._offset(v, s), raw)
        (m,) = _HEADER.unpack_from(raw, 0)
        if m == 0:
            out[:] = 0.0
        else:
            self.codec.decode(raw[_HEADER.size:_HEADER.size + m], out=out)
        return out

    def segments(self, keys, depth: int | None = None):
        """``(key, segment)`` for ``keys`` = [(vector, segment), ...], read ahead."""
        depth = self.depth if depth is None else depth
        make = lambda: np.empty(self.seglen)  # noqa: E731
        if self.codec is None:
            def read_into(key, buf):
                lo, hi = self.bounds(key[1])
                return self.sf.aread(self._offset(*key), buf[:hi - lo])
            return cio.prefetch(read_into, keys, make, depth=depth)
        return cio.prefetch(self._read_blocking, keys, make, depth=depth, blocking=True)

    # ---------------------------------------------------------------- whole vectors
    def read(self, v: int) -> np.ndarray:
        x = np.empty(self.n)
        for (_, s), seg in self.segments([(v, s) for s in range(self.nseg)]):
            lo, hi = self.bounds(s)
            x[lo:hi] = seg
        return x

    def write(self, v: int, x: np.ndarray) -> None:
        with cio.WriteBehind(depth=self.depth) as wb:
            for s in range(self.nseg):
                lo, hi = self.bounds(s)
                wb.submit(self.awrite, v, s, x[lo:hi])

    def accumulate(self, v: int, partial: np.ndarray, mutex) -> None:
        """vector v += partial, segment by segment under ``mutex`` (read, add, write back)."""
        ring = [np.empty(self.seglen) for _ in range(self.depth + 1)]
        with mutex:
            with cio.WriteBehind(depth=self.depth) as wb:
                pairs = [(v, s) for s in range(self.nseg)]
                for k, ((_, s), seg) in enumerate(self.segments(pairs)):
                    lo, hi = self.bounds(s)
                    out = ring[k % len(ring)][:hi - lo]   # free: its write completed
                    np.add(seg, partial[lo:hi], out=out)
                    wb.submit(self.awrite, v, s, out)
            # leaving the WriteBehind waited for every write: safe to release the mutex

    def combine(self, coeffs: dict[int, float], s: int, cache: dict) -> np.ndarray:
        lo, hi = self.bounds(s)
        out = np.zeros(hi - lo)
        for v, a in coeffs.items():
            out += a * cache[v]
        return out


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
                   help="compress each segment with numcodecs")
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
    codec = None
    if args.compress == "zstd":
        import numcodecs
        codec = numcodecs.Zstd(level=1)
    nseg = args.segments
    if args.max_memory is not None:       # the streamed subspace steps hold a few segments
        seglen = max(1, int(args.max_memory * 1e6 / (8 * 3 * (args.depth + 1))))
        nseg = max(nseg, math.ceil(ndet / seglen))
    space = max(3, min(args.max_space, ndet))
    vecs = SegmentedVectors("davidson.vectors", 2 * space, ndet, nseg, codec, comm,
                            args.depth)
    C = lambda k: k            # noqa: E731  trial vector k
    S = lambda k: space + k    # noqa: E731  its sigma vector
    npair = h2.shape[0]
    ntasks = max(1, min(args.tasks, npair))
    rows = np.linspace(0, npair, ntasks + 1).round().astype(int)
    run.log(f"CAS({sum(nelec)}e,{norb}o) of {nao} basis functions: {ndet} determinants in "
            f"{vecs.nseg} segments of {vecs.seglen}; shared file of {2 * space} vectors "
            f"({vecs.sf.soft_limit / 2**20:.2f} MiB), compress={args.compress}; "
            f"{ntasks} tasks per H.c over {comm.size} rank(s)")

    loop = _common.SharedLoop(comm)
    mutex = cio.sync.Mutex(comm=comm)
    link = (fci.cistring.gen_linkstr_index_trilidx(range(norb), nelec[0]),
            fci.cistring.gen_linkstr_index_trilidx(range(norb), nelec[1]))

    def sigma(k: int) -> int:
        """sigma_k += H c_k, tasks shared by all ranks (sigma_k was zeroed); collective."""
        c = vecs.read(C(k)).reshape(na, nb)
        done = 0
        for t in loop.tasks(ntasks):
            block = np.zeros_like(h2)
            block[rows[t]:rows[t + 1]] = h2[rows[t]:rows[t + 1]]
            part = direct_spin1.contract_2e(block, c, norb, nelec, link_index=link)
            vecs.accumulate(S(k), part.ravel(), mutex)
            done += 1
        comm.barrier()                          # every partial sigma is in the file
        return done

    zeros = np.zeros(ndet)
    status = None
    if run.root:
        x0 = np.zeros(ndet)
        x0[int(np.argmin(hdiag))] = 1.0
        vecs.write(C(0), x0)
        vecs.write(S(0), zeros)
    comm.barrier()
    k = 0                       # newest trial vector
    heff = np.zeros((space, space))
    theta_old, theta, it, converged = None, None, 0, False
    for it in run.progress(range(1, args.max_cycle + 1), "Davidson iterations", unit="iter"):
        t_it = time.perf_counter()
        mine = sigma(k)
        if run.root:
            # subspace matrix column k, streamed segment by segment
            keys = [(v, s) for s in range(vecs.nseg) for v in [S(k)] + [C(j) for j in range(k + 1)]]
            col = np.zeros(k + 1)
            cur = None
            for (v, _s), seg in vecs.segments(keys):
                if v == S(k):
                    cur = seg.copy()
                else:
                    col[v] += seg @ cur
            heff[:k + 1, k] = heff[k, :k + 1] = col
            w, u = np.linalg.eigh(heff[:k + 1, :k + 1])
            theta, alpha = float(w[0]), u[:, 0]
            # residual r = sum_j alpha_j (sigma_j - theta c_j); Ritz vector parts as needed
            r = np.empty(ndet)
            for (v, s), seg in vecs.segments([(v, s) for s in range(vecs.nseg)
                                              for j in range(k + 1) for v in (C(j), S(j))]):
                lo, hi = vecs.bounds(s)
                j = v if v < space else v - space
                if v == C(0):
                    r[lo:hi] = 0.0
                r[lo:hi] += alpha[j] * (seg if v >= space else -theta * seg)
            rnorm = float(np.linalg.norm(r))
            de = float("inf") if theta_old is None else theta - theta_old
            converged = abs(de) < args.conv and rnorm < 1e-5
            run.log(f"iter {it:3d}  E = {theta + ecore:.12f}  dE = {de:+.2e}  |r| = "
                    f"{rnorm:.2e}  subspace {k + 1}  tasks here {mine} "
                    f"({time.perf_counter() - t_it:.2f} s)")
            theta_old = theta
            status = ("done", theta, 0)
            if not converged:
                if k + 1 == space:
                    # collapse to the Ritz vector: x = sum a_j c_j, sigma_x = sum a_j sigma_j
                    alive = {j: float(alpha[j]) for j in range(k + 1)}
                    with cio.WriteBehind(depth=args.depth) as wb:
                        for s in range(vecs.nseg):
                            cache = {v: seg.copy() for (v, _), seg in vecs.segments(
                                [(C(j), s) for j in alive] + [(S(j), s) for j in alive])}
                            x = vecs.combine({C(j): a for j, a in alive.items()}, s, cache)
                            sx = vecs.combine({S(j): a for j, a in alive.items()}, s, cache)
                            wb.submit(vecs.awrite, C(0), s, x)
                            wb.submit(vecs.awrite, S(0), s, sx)
                            wb.flush()                 # x and sx are rebuilt next segment
                    heff[:] = 0.0
                    heff[0, 0] = theta
                    k = 0
                    run.log("subspace collapsed to the Ritz vector")
                # Davidson correction, then orthogonalise to the subspace (twice)
                denom = theta - hdiag
                denom[np.abs(denom) < 1e-8] = 1e-8
                t = r / denom
                for _ in range(2):
                    dots = np.zeros(k + 1)
                    for (v, s), seg in vecs.segments([(C(j), s) for s in range(vecs.nseg)
                                                      for j in range(k + 1)]):
                        lo, hi = vecs.bounds(s)
                        dots[v] += seg @ t[lo:hi]
                    for (v, s), seg in vecs.segments([(C(j), s) for s in range(vecs.nseg)
                                                      for j in range(k + 1)]):
                        lo, hi = vecs.bounds(s)
                        t[lo:hi] -= dots[v] * seg
                tn = float(np.linalg.norm(t))
                if tn < 1e-14:
                    converged = True
                else:
                    k += 1
                    vecs.write(C(k), t / tn)
                    vecs.write(S(k), zeros)
                    status = ("go", theta, k)
            if converged:
                status = ("done", theta, k)
        status = comm.bcast(status)
        theta, k = status[1], status[2]
        if status[0] == "done":
            converged = True
            break
    energy = float(theta + ecore)
    stored = comm.allreduce(vecs.stored) if codec is not None else None
    vecs.sf.destroy()
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
