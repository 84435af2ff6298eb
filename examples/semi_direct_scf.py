"""Semi-direct restricted Hartree-Fock: the integral cache of NWChem's SCF, in Python.

Two-electron integrals are computed by PySCF in batches of shell blocks
(``mol.intor("int2e", shls_slice=...)``). Each batch is one unique quartet of shell
groups (8-fold permutational symmetry at group level), screened by the Schwarz
inequality and given a cost estimate. The most expensive ``--stored-fraction`` of the
batches is computed once and appended to a ``cio.RecordFile`` (one per rank, an Exclusive
Access File); every SCF iteration replays the stored batches with read-ahead and
recomputes the others (direct). J and K are built from the batches; DIIS; the run stops
when the energy changes by less than ``--conv`` (1e-9 Eh) and the DIIS error is small.

Under ``mpiexec -n N`` the batches are dealt out dynamically with ``cio.sync.Counter``
(GA's nxtval), every rank keeps the stored batches it computed, and the two-electron
part of the Fock matrix is summed over the ranks.

    python examples/semi_direct_scf.py --basis cc-pvdz --stored-fraction 0.5

Reference: ``pyscf.scf.RHF`` on the same molecule; the run passes when |dE| < 1e-8 Eh.
PySCF runs it twice, in core (the 8-fold ERI tensor in memory, its default when that
fits) and direct (J and K from integrals recomputed every cycle); the JSON line has both
energies and times beside this script's (``scf_seconds``, ``pyscf_incore_seconds``,
``pyscf_direct_seconds``).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import chemio_py as cio  # noqa: E402

TOLERANCE = 1e-8

# The eight index permutations of (pq|rs) that leave the integral unchanged, as
# (transpose of the computed block, order of the four shell groups).
_IMAGES = [((0, 1, 2, 3), (0, 1, 2, 3)), ((1, 0, 2, 3), (1, 0, 2, 3)),
           ((0, 1, 3, 2), (0, 1, 3, 2)), ((1, 0, 3, 2), (1, 0, 3, 2)),
           ((2, 3, 0, 1), (2, 3, 0, 1)), ((3, 2, 0, 1), (3, 2, 0, 1)),
           ((2, 3, 1, 0), (2, 3, 1, 0)), ((3, 2, 1, 0), (3, 2, 1, 0))]


class Batches:
    """The unique shell-group quartets of a molecule, screened and ranked by cost.

    Shells are grouped in order into groups of at most ``group_ao`` functions (one shell
    at least). Batch ``k`` is the quartet ``(a, b, c, d)`` of groups with ``a >= b``,
    ``c >= d`` and pair ``ab >= cd``; together the quartets and their symmetry images
    cover the whole (pq|rs) tensor exactly once. Batches whose Schwarz bound
    ``Q_ab * Q_cd`` is below ``threshold`` are dropped; the rest are sorted by their cost
    estimate, most expensive first.
    """

    def __init__(self, mol, group_ao: int, threshold: float):
        self.mol = mol
        self.ao_loc = ao_loc = mol.ao_loc_nr()
        groups, start = [], 0
        for sh in range(1, mol.nbas):
            if ao_loc[sh + 1] - ao_loc[start] > group_ao:
                groups.append((start, sh))
                start = sh
        groups.append((start, mol.nbas))
        self.groups = groups
        self.aos = [(int(ao_loc[s0]), int(ao_loc[s1])) for s0, s1 in groups]
        weight = []
        for s0, s1 in groups:      # primitive quartets x functions x angular momentum
            weight.append(sum(mol.bas_nprim(s) * mol.bas_nctr(s) * (2 * mol.bas_angular(s) + 1)
                              * (mol.bas_angular(s) + 1) for s in range(s0, s1)))
        ng = len(groups)
        pairs = [(a, b) for a in range(ng) for b in range(a + 1)]
        schwarz = {p: self._schwarz(*p) for p in pairs}
        quartets, self.screened = [], 0
        for i, ab in enumerate(pairs):
            for cd in pairs[:i + 1]:
                if schwarz[ab] * schwarz[cd] < threshold:
                    self.screened += 1
                    continue
                q = ab + cd
                quartets.append((float(np.prod([weight[g] for g in q])), q))
        quartets.sort(key=lambda t: -t[0])
        self.cost = [c for c, _ in quartets]
        self.quartets = [q for _, q in quartets]
        self.total = len(pairs) * (len(pairs) + 1) // 2

    def __len__(self) -> int:
        return len(self.quartets)

    def _slice(self, q) -> tuple:
        return tuple(x for g in q for x in self.groups[g])

    def _schwarz(self, a: int, b: int) -> float:
        block = self.mol.intor("int2e", shls_slice=self._slice((a, b, a, b)))
        return float(np.sqrt(np.abs(np.einsum("pqpq->pq", block)).max()))

    def shape(self, k: int) -> tuple:
        return tuple(self.aos[g][1] - self.aos[g][0] for g in self.quartets[k])

    def compute(self, k: int) -> np.ndarray:
        """The integrals (pq|rs) of batch ``k``, shape ``shape(k)``."""
        return self.mol.intor("int2e", shls_slice=self._slice(self.quartets[k]))

    def add_jk(self, k: int, eri: np.ndarray, dm: np.ndarray, vj: np.ndarray,
               vk: np.ndarray) -> None:
        """Add batch ``k``'s share of J[D] and K[D]: every distinct symmetry image once.

        J_pq = sum_rs (pq|rs) D_rs;  K_pr = sum_qs (pq|rs) D_qs.
        """
        q = self.quartets[k]
        seen = set()
        for axes, order in _IMAGES:
            g = tuple(q[i] for i in order)
            if g in seen:
                continue
            seen.add(g)
            x = eri.transpose(axes)
            p, qq, r, s = (slice(*self.aos[i]) for i in g)
            vj[p, qq] += np.tensordot(x, dm[r, s], axes=([2, 3], [0, 1]))
            vk[p, r] += np.einsum("pqrs,qs->pr", x, dm[qq, s], optimize=True)


class Diis:
    """Pulay DIIS on the Fock matrix with the orthonormalised commutator FDS - SDF."""

    def __init__(self, space: int = 8):
        self.space = space
        self.focks: list[np.ndarray] = []
        self.errs: list[np.ndarray] = []

    def update(self, f: np.ndarray, err: np.ndarray) -> np.ndarray:
        self.focks.append(f)
        self.errs.append(err)
        del self.focks[:-self.space], self.errs[:-self.space]
        n = len(self.focks)
        b = np.empty((n + 1, n + 1))
        b[-1, :] = b[:, -1] = -1.0
        b[-1, -1] = 0.0
        for i in range(n):
            for j in range(i + 1):
                b[i, j] = b[j, i] = np.vdot(self.errs[i], self.errs[j])
        rhs = np.zeros(n + 1)
        rhs[-1] = -1.0
        try:
            c = np.linalg.solve(b, rhs)[:n]
        except np.linalg.LinAlgError:
            c = np.linalg.lstsq(b, rhs, rcond=None)[0][:n]
        return sum(ci * fi for ci, fi in zip(c, self.focks))


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--stored-fraction", type=float, default=0.5,
                   help="fraction of the batches (the most expensive ones) kept on disk")
    p.add_argument("--group-ao", type=int, default=6,
                   help="at most this many basis functions per shell group (batch granularity)")
    p.add_argument("--schwarz", type=float, default=1e-12, help="Schwarz screening threshold")
    p.add_argument("--conv", type=float, default=1e-9, help="energy convergence (Eh)")
    p.add_argument("--max-cycle", type=int, default=60)
    p.add_argument("--depth", type=int, default=2, help="read-ahead depth of the replay")
    p.add_argument("--max-disk", type=float, default=None, metavar="MB",
                   help="cache budget per rank (default: half the free space where it lives); "
                        "batches that do not fit are recomputed by the rank that took them")
    args = p.parse_args(argv)
    if not 0.0 <= args.stored_fraction <= 1.0:
        p.error(f"--stored-fraction must be in [0, 1], got {args.stored_fraction}")
    run = _common.Run("semi_direct_scf", args)
    comm = run.comm
    mol = _common.make_mol(args)
    if mol.nelectron % 2:
        p.error(f"restricted Hartree-Fock needs an even number of electrons, got "
                f"{mol.nelectron}; change --charge")

    from pyscf import scf

    t_scf = time.perf_counter()
    batches = Batches(mol, args.group_ao, args.schwarz)
    nstored = int(round(args.stored_fraction * len(batches)))
    stored_bytes = sum(int(np.prod(batches.shape(k))) * 8 for k in range(nstored))
    cost_share = sum(batches.cost[:nstored]) / max(sum(batches.cost), 1.0)
    if args.max_memory is not None and stored_bytes / comm.size > args.max_memory * 1e6:
        # the cache is on disk anyway; say so rather than refusing
        run.log(f"note: the stored batches ({stored_bytes / 1e6:.1f} MB) exceed "
                f"--max-memory; they live on disk and are streamed each iteration")
    run.log(f"{mol.natm} atoms, {mol.nao_nr()} basis functions ({args.basis}), "
            f"{len(batches.groups)} shell groups, {len(batches)} batches "
            f"({batches.screened} of {batches.total} screened out by Schwarz < "
            f"{args.schwarz:g}); storing the {nstored} most expensive "
            f"({cost_share:.0%} of the estimated cost, {stored_bytes / 2**20:.2f} MiB over "
            f"all ranks), ranks: {comm.size}")

    nao = mol.nao_nr()
    nocc = mol.nelectron // 2
    s = mol.intor("int1e_ovlp")
    hcore = mol.intor("int1e_kin") + mol.intor("int1e_nuc")
    enuc = mol.energy_nuc()
    w, v = np.linalg.eigh(s)
    keep = w > 1e-9
    x = v[:, keep] / np.sqrt(w[keep])                   # canonical orthogonalisation
    dm = scf.hf.init_guess_by_minao(mol)

    cache = _common.record_file("scf-batches", page_size=1 << 20)
    # like NWChem, ask for the free space before filling the cache
    free = cio.stat(os.path.dirname(cache.path)).free
    budget = free // 2 if args.max_disk is None else min(free // 2, int(args.max_disk * 1e6))
    overflow: list[int] = []          # stored-class batches this rank could not keep
    loop = _common.SharedLoop(comm)
    diis = Diis()
    e_old, energy, converged = None, None, False
    first = True
    it = 0
    for it in run.progress(range(1, args.max_cycle + 1), "SCF cycles", unit="cycle"):
        t_it = time.perf_counter()
        vj = np.zeros((nao, nao))
        vk = np.zeros((nao, nao))
        nreplayed = ncomputed = 0
        if first:
            # every batch once, dealt out by the counter; keep the expensive ones
            for k in loop.tasks(len(batches)):
                eri = batches.compute(k)
                if k < nstored:
                    key = np.array([k], np.int64)
                    if cache.raw_nbytes + cache.record_nbytes(key, eri) <= budget:
                        cache.append(key, eri)
                    else:
                        overflow.append(k)
                batches.add_jk(k, eri, dm, vj, vk)
                ncomputed += 1
            cache.close()                   # writes the page index: the cache is complete
            cache = _common.record_file("scf-batches", "r")
            first = False
        else:
            for idx, eri in cache.replay(depth=args.depth):
                batches.add_jk(int(idx[0]), eri, dm, vj, vk)
                nreplayed += 1
            for k in overflow:
                batches.add_jk(k, batches.compute(k), dm, vj, vk)
                ncomputed += 1
            for t in loop.tasks(len(batches) - nstored):
                k = nstored + t
                batches.add_jk(k, batches.compute(k), dm, vj, vk)
                ncomputed += 1
        veff = vj - 0.5 * vk
        comm.allreduce(veff, "sum")
        fock = hcore + veff
        energy = float(np.einsum("ij,ji->", dm, hcore + 0.5 * veff)) + enuc
        err = x.T @ (fock @ dm @ s - s @ dm @ fock) @ x
        err_norm = float(np.linalg.norm(err))
        de = float("inf") if e_old is None else energy - e_old
        converged = abs(de) < args.conv and err_norm < 1e-6
        converged = bool(comm.bcast(converged))      # every rank stops at the same cycle
        run.log(f"cycle {it:2d}  E = {energy:.12f}  dE = {de:+.2e}  |FDS-SDF| = "
                f"{err_norm:.2e}  batches: {nreplayed} replayed, {ncomputed} computed "
                f"({time.perf_counter() - t_it:.2f} s)")
        if converged:
            break
        e_old = energy
        f = diis.update(fock, err) if it > 1 else fock
        e, c = np.linalg.eigh(x.T @ f @ x)
        c = x @ c
        dm = 2.0 * c[:, :nocc] @ c[:, :nocc].T
        dm = comm.bcast(dm)                            # one density for all ranks
    t_scf = time.perf_counter() - t_scf
    cache_bytes = cache.nbytes
    n_overflow = int(comm.allreduce(len(overflow), "sum"))
    if n_overflow:
        run.log(f"{n_overflow} batches did not fit the cache budget and were recomputed")
    cache.delete()
    loop.free()
    if not converged:
        run.log(f"not converged in {args.max_cycle} cycles")

    pyscf_runs: dict = {}

    def pyscf_rhf(direct: bool) -> float:
        mf = scf.RHF(mol)
        mf.conv_tol = 1e-11
        if direct:                 # never keep the ERI tensor: J and K from integrals
            mf._is_mem_enough = lambda: False
        t = time.perf_counter()
        e = float(mf.kernel())
        key = "direct" if direct else "incore"
        pyscf_runs[key] = (e, time.perf_counter() - t, int(mf.cycles), bool(mf.converged))
        return e

    def reference() -> float:
        e = pyscf_rhf(direct=False)                     # the reference energy
        pyscf_rhf(direct=True)
        return e

    ref = _common.energy_reference(run, reference)
    pyscf_runs = comm.bcast(pyscf_runs if run.root else None)
    (e_in, t_in, c_in, _), (e_dir, t_dir, c_dir, _) = pyscf_runs["incore"], pyscf_runs["direct"]
    run.log(f"E(semi-direct RHF) = {energy:.12f}   E(PySCF RHF) = {ref:.12f}   "
            f"diff = {energy - ref:+.2e}")
    run.log(f"time: semi-direct {t_scf:.2f} s ({it} cycles); PySCF in core {t_in:.2f} s "
            f"({c_in} cycles), direct {t_dir:.2f} s ({c_dir} cycles, E = {e_dir:.12f})")
    return run.finish(energy, ref, TOLERANCE if converged else 0.0, iterations=it,
                      converged=converged, batches=len(batches), stored_batches=nstored,
                      screened_batches=batches.screened, stored_fraction=args.stored_fraction,
                      stored_bytes=stored_bytes, stored_cost_share=round(cost_share, 4),
                      cache_bytes_this_rank=cache_bytes,
                      overflow_batches=n_overflow, nao=nao, scf_seconds=round(t_scf, 3),
                      pyscf_incore_energy=e_in, pyscf_incore_seconds=round(t_in, 3),
                      pyscf_incore_cycles=c_in, pyscf_direct_energy=e_dir,
                      pyscf_direct_seconds=round(t_dir, 3), pyscf_direct_cycles=c_dir)


if __name__ == "__main__":
    _common.cli(main)
