"""Semi-direct SCF inside PySCF: integrals computed once, kept in a RecordFile, replayed.

    >>> from pyscf import gto, scf
    >>> import chemio_py.pyscf
    >>> mf = chemio_py.pyscf.semi_direct(scf.RHF(mol), max_memory=400)   # same object
    >>> e = mf.kernel()                        # PySCF's own SCF loop, DIIS, convergence
    >>> mf.semi_direct.close()                 # drop the cache (else at exit)

``semi_direct(mf, ...)`` gives the SCF object (RHF, UHF, ROHF, ... anything that builds
its Fock matrix through ``mf.get_jk``) a ``get_jk`` that

* in its first call computes the two-electron integrals in *batches* — rows ``(ij|`` of the
  8-fold symmetric ERI tensor, ``i`` in a run of shells, ``j <= i`` in a run of shells,
  ``kl <= ij`` — skips the batches whose Schwarz bound is below ``1e-14``, contracts each
  with the density at hand (PySCF's own in-core kernels, ``CVHFics8_*``, on
  ``lib.num_threads()`` threads) and appends it to
  a ``RecordFile`` of this rank (compressed with ``compress``: None, ``"zstd"``,
  ``"blosc"`` or a numcodecs codec);
* in later calls replays the file with read-ahead (``RecordFile.replay``) and recomputes
  the batches that are not in it. J and K are those of whatever density it is handed: an
  incremental Fock build (``mf.direct_scf``, a difference density), one (n, n) density,
  (2, n, n) for UHF/ROHF or any stack, ``hermi`` 0, 1 or 2, complex densities. ``omega``
  (range-separated integrals) goes to the SCF object's own ``get_jk``.

Space never makes it fail: a batch that does not fit the cache budget (``max_disk`` MB,
default half the free space where the cache lives; with the ``shm`` backend at most
``max_memory``), or whose append raises ``LimitExceededError`` or ``OutOfSpaceError``, is
recomputed every cycle instead (direct SCF), and the log says how many. After the first
replay the measured read rate is compared with the measured integral rate: a cache slower
to read than to recompute is dropped and the run goes on direct.

The batch size is the library's choice: it times two integral calls of different sizes
(fixed cost per call and cost per integral), takes batches large enough that the fixed
cost stays under 2 % and small enough that a batch, its packed copy and the RecordFile's
page buffers fit ``max_memory`` (MB, default the SCF object's ``max_memory``).

Under ``mpiexec`` every call is collective: the shell rows are cut into one run per rank
of about equal estimated cost, each rank keeps the batches of its run in its own
RecordFile, and J and K are summed over the ranks (``allreduce`` through chemio's comm,
then rank 0's sum is broadcast so every rank's SCF takes the same steps).

Messages go to ``logging.getLogger("chemio_py.pyscf")`` and, at the SCF object's
``verbose``, to PySCF's ``lib.logger``. ``mf.semi_direct`` is the engine: ``stats``
(batches stored/recomputed, bytes, seconds), ``close()``.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import time
import weakref
from typing import Any

import numpy as np

from chemio_py.errors import (ArgumentError, ChemIOError, LimitExceededError,
                              OutOfSpaceError)
from chemio_py.files.records import RecordFile
from chemio_py.runtime import config, finalizers
from chemio_py.runtime.comm import resolve as resolve_comm
from chemio_py.scratch.fs import stat as fs_stat

log = logging.getLogger("chemio_py.pyscf")

SCHWARZ = 1e-14          # batches whose bound (ij|kl) <= Q_ij Q_kl is below this are zero
_MB = 1e6
_COMMIT_EVERY = 128 << 20    # commit the cache every so many bytes: a later ENOSPC keeps them
_counter = [0]


def semi_direct(mf: Any, max_memory: float | None = None, backend: str | None = None,
                compress: Any = None, *, max_disk: float | None = None,
                comm: Any = None) -> Any:
    """Make ``mf`` (a PySCF SCF object) semi-direct; return it (see the module docstring).

    ``max_memory`` (MB): memory for the integral batches and the cache's page buffers
    (default ``mf.max_memory``); ``backend``: where the cache lives (chemio's setting when
    None); ``compress``: the cache's codec (None: raw); ``max_disk`` (MB): cap on the
    cache of each rank; ``comm``: the communicator (chemio's when None). Calling it again
    on the same object replaces the previous cache.
    """
    if not callable(getattr(mf, "get_jk", None)) or getattr(mf, "mol", None) is None:
        raise ArgumentError(f"semi_direct needs a PySCF SCF object (with .mol and .get_jk), "
                            f"got {type(mf).__name__}; nothing was changed")
    for what, v in (("max_memory", max_memory), ("max_disk", max_disk)):
        if v is not None and (not isinstance(v, (int, float)) or not v >= 0
                              or not math.isfinite(v)):
            raise ArgumentError(f"{what} must be a number of MB >= 0, got {v!r}; nothing "
                                f"was changed")
    if compress is not None:
        from chemio_py.files.recordformat import make_codec
        make_codec(compress)                 # a bad codec fails here, before anything changes
    old = mf.__dict__.get("semi_direct")
    if isinstance(old, SemiDirectJK):
        old.close()
        orig = old.fallback
    else:
        orig = mf.get_jk
    engine = SemiDirectJK(mf, orig, max_memory=max_memory, backend=backend,
                          compress=compress, max_disk=max_disk, comm=comm)

    def get_jk(mol: Any = None, dm: Any = None, hermi: int = 1, with_j: bool = True,
               with_k: bool = True, omega: float | None = None) -> tuple:
        if mol is None:
            mol = mf.mol
        if dm is None:
            dm = mf.make_rdm1()
        if omega:
            engine.say(logging.DEBUG, f"omega={omega}: range-separated J/K from PySCF's "
                                      f"own get_jk (the cache holds full-range integrals)")
            return orig(mol, dm, hermi, with_j, with_k, omega)
        return engine.get_jk(mol, dm, hermi, with_j, with_k)

    get_jk.__doc__ = f"Semi-direct J/K (chemio_py.pyscf.semi_direct).\n\n{orig.__doc__ or ''}"
    mf.get_jk = get_jk
    mf.semi_direct = engine
    keys = getattr(mf, "_keys", None)
    if keys is not None:             # PySCF's check_sanity warns on attributes it does not know
        mf._keys = set(keys).union({"get_jk", "semi_direct"})
    return mf


class _Batch:
    """Rows (i, j), i in [i0, i1), j in [j0, min(j1, i + 1)), of the s8 ERI tensor."""

    __slots__ = ("id", "shls", "i0", "i1", "j0", "j1", "npair", "rows", "n_elem", "nbytes",
                 "cost", "seconds")

    def __init__(self, bid: int, shls: tuple, ao_loc: np.ndarray):
        self.id = bid
        self.shls = shls                       # (ish0, ish1, jsh0, jsh1)
        i0, i1 = int(ao_loc[shls[0]]), int(ao_loc[shls[1]])
        j0, j1 = int(ao_loc[shls[2]]), int(ao_loc[shls[3]])
        self.i0, self.i1, self.j0, self.j1 = i0, i1, j0, j1
        self.npair = i1 * (i1 + 1) // 2
        nj = j1 - j0
        rows = []                              # (i, j, offset in the packed record, in buf)
        off = 0
        for i in range(i0, i1):
            for j in range(j0, min(j1, i + 1)):
                ij = i * (i + 1) // 2 + j
                rows.append((i, j, off, ((i - i0) * nj + (j - j0)) * self.npair, ij + 1))
                off += ij + 1
        self.rows = rows
        self.n_elem = (i1 - i0) * nj * self.npair      # computed (the intor buffer)
        self.nbytes = off * 8                          # stored (packed rows)
        self.cost = 0.0
        self.seconds = 0.0


class _Kernels:
    """PySCF's in-core s8 row kernels (libcvhf), called with pointers as ``c_void_p`` and
    ints as plain ints.

    Plain ``CDLL`` function objects (``restype`` None, no ``argtypes``): a call costs about
    a third of one through a ``CFUNCTYPE`` prototype, and a cycle makes one per (i, j) row
    per density per kernel.
    """

    def __init__(self) -> None:
        from pyscf.scf import _vhf
        lib = _vhf.libcvhf

        def fn(name: str) -> Any:
            f = lib._FuncPtr((name, lib))      # our own object: PySCF's stays as it was
            f.restype = None
            return f
        self.vj = fn("CVHFics8_tridm_vj")
        self.vk_s2 = fn("CVHFics8_jk_s2il")
        self.vk_s1 = fn("CVHFics8_jk_s1il")


class _Contraction:
    """J and K of a stack of densities, accumulated row by row on ``len(accs)`` threads.

    The kernels release the GIL: each thread adds every ``threads``-th row of a batch into
    its own J/K accumulators, summed by ``finish``.
    """

    def __init__(self, kern: _Kernels, dms: np.ndarray, hermi: int, with_j: bool,
                 with_k: bool, pool: Any = None, threads: int = 1):
        from pyscf import lib
        n_dm, n, _ = dms.shape
        self.n = n
        self.hermi = hermi
        self.pool = pool
        self._keep: list = [dms]
        tri = None
        if with_j:
            tri = lib.pack_tril(dms + dms.transpose(0, 2, 1))
            idx = np.arange(n)
            tri[:, idx * (idx + 1) // 2 + idx] *= .5
            tri = np.ascontiguousarray(tri)
            self._keep.append(tri)
        fk = kern.vk_s1 if hermi == 0 else kern.vk_s2
        self.accs: list[tuple] = []            # per thread: (vj, vk, calls)
        for _ in range(max(1, threads)):
            vj = np.zeros((n_dm, n, n)) if with_j else None
            vk = np.zeros((n_dm, n, n)) if with_k else None
            calls: list[tuple[Any, Any, Any]] = []          # (kernel, dm, v) pointers
            if vj is not None and tri is not None:
                calls += [(kern.vj, _ptr(tri[x]), _ptr(vj[x])) for x in range(n_dm)]
            if vk is not None:
                calls += [(fk, _ptr(dms[x]), _ptr(vk[x])) for x in range(n_dm)]
            self.accs.append((vj, vk, calls))

    def _rows(self, rows: list, base: int, packed: bool, calls: list) -> None:
        n = self.n
        p = ctypes.c_void_p()                  # this thread's row pointer, reset per row
        at = 2 if packed else 3                # the row's offset in the record / the buffer
        if len(calls) == 2:                    # one density, J and K: the common case
            (f, d, v), (g, e, w) = calls
            for r in rows:
                p.value = base + 8 * r[at]
                i, j = r[0], r[1]
                f(p, d, v, n, i, j)
                g(p, e, w, n, i, j)
            return
        for r in rows:
            p.value = base + 8 * r[at]
            i, j = r[0], r[1]
            for f, d, v in calls:
                f(p, d, v, n, i, j)

    def add(self, batch: _Batch, base: int, packed: bool) -> None:
        """Add ``batch``'s share: its rows start at address ``base`` (packed or intor buffer)."""
        t = len(self.accs)
        rows = batch.rows
        if t == 1 or self.pool is None or len(rows) < 4 * t:
            self._rows(rows, base, packed, self.accs[0][2])
            return
        futs = [self.pool.submit(self._rows, rows[x::t], base, packed, self.accs[x][2])
                for x in range(1, t)]
        try:
            self._rows(rows[::t], base, packed, self.accs[0][2])
        finally:
            for f in futs:
                f.result()

    def finish(self) -> tuple:
        from pyscf import lib
        vj, vk, _ = self.accs[0]
        for oj, ok, _ in self.accs[1:]:
            if vj is not None:
                vj += oj
            if vk is not None:
                vk += ok
        if vj is not None:
            for v in vj:
                lib.hermi_triu(v, 1, inplace=True)
        if vk is not None and self.hermi != 0:
            for v in vk:
                lib.hermi_triu(v, self.hermi, inplace=True)
        return vj, vk


class SemiDirectJK:
    """The engine behind ``semi_direct``: the batches, the cache and the statistics."""

    def __init__(self, mf: Any, fallback: Any, *, max_memory: float | None,
                 backend: str | None, compress: Any, max_disk: float | None, comm: Any):
        self._mf = weakref.ref(mf)
        self.fallback = fallback
        self.backend = backend
        self.compress = compress
        self.max_memory = max_memory
        self.max_disk = max_disk
        self.comm = resolve_comm(comm)
        _counter[0] += 1
        self.name = f"semi-direct-jk.{os.getpid()}.{_counter[0]}"
        self.verbose = getattr(mf, "verbose", 0)
        self.mol: Any = None
        self.cache: RecordFile | None = None
        self.batches: list[_Batch] = []
        self.cached: set[int] = set()          # batch ids whose records are in the cache
        self.direct: list[_Batch] = []         # batches recomputed every call
        self.calls = 0
        self.stats: dict[str, Any] = {}
        self._kern: _Kernels | None = None
        self._pool: Any = None
        self._pool_size = 0
        self._cache_box: list = [None]      # what the finalizer removes if nobody closes
        self._finalizer = weakref.finalize(self, SemiDirectJK._drop, self._cache_box)

    # ------------------------------------------------------------------ messages
    def say(self, level: int, msg: str) -> None:
        """``msg`` to the ``chemio_py.pyscf`` logger and to PySCF's logger at ``verbose``."""
        if self.comm.size > 1:
            msg = f"[rank {self.comm.rank}] {msg}"
        mf = self._mf()
        forward = mf is not None and (self.comm.rank == 0 or level >= logging.WARNING)
        # the plug-in's handler (chemio_py.pyscf.patch) does not repeat what is written here
        log.log(level, msg, extra={"pyscf_logged": forward})
        if not forward:
            return
        from pyscf.lib import logger
        fn = {logging.DEBUG: logger.debug, logging.INFO: logger.info,
              logging.WARNING: logger.warn}.get(level, logger.note)
        fn(mf, "chemio semi-direct: %s", msg)

    # ------------------------------------------------------------------ the call
    def get_jk(self, mol: Any, dm: Any, hermi: int, with_j: bool, with_k: bool) -> tuple:
        """J and K of ``dm`` (any stack of (n, n) densities). Collective under MPI."""
        dm = np.asarray(dm)
        shape = dm.shape
        n = mol.nao_nr()
        if dm.ndim < 2 or shape[-1] != n or shape[-2] != n:
            raise ArgumentError(f"get_jk: the density has shape {shape}, but the molecule has "
                                f"{n} basis functions: expected (..., {n}, {n})")
        if not (with_j or with_k):
            return None, None
        if np.iscomplexobj(dm):
            dms = np.concatenate([dm.real.reshape(-1, n, n), dm.imag.reshape(-1, n, n)])
            vj, vk = self._jk(mol, dms, 0, with_j, with_k)
            m = dms.shape[0] // 2
            vj = None if vj is None else (vj[:m] + 1j * vj[m:]).reshape(shape)
            vk = None if vk is None else (vk[:m] + 1j * vk[m:]).reshape(shape)
            return vj, vk
        vj, vk = self._jk(mol, np.ascontiguousarray(dm, dtype=np.float64).reshape(-1, n, n),
                          hermi, with_j, with_k)
        return (None if vj is None else vj.reshape(shape),
                None if vk is None else vk.reshape(shape))

    def _jk(self, mol: Any, dms: np.ndarray, hermi: int, with_j: bool, with_k: bool) -> tuple:
        comm = self.comm
        if comm.size > 1:
            dms = comm.bcast(dms)              # one density everywhere, to the last bit
        if self.mol is None or not _same_mol(self.mol, mol):
            if self.mol is not None:
                self.say(logging.INFO, "the molecule changed: integrals computed again")
                self._close_cache()
            t = time.perf_counter()
            self._plan(mol)
            self.stats["plan_seconds"] = time.perf_counter() - t
        if self._kern is None:
            self._kern = _Kernels()
        threads = self._threads()
        t0 = time.perf_counter()
        con = _Contraction(self._kern, dms, hermi, with_j, with_k, self._pool, threads)
        with comm.agree("semi-direct J/K"):
            if self.calls == 0:
                self._first(con)
            else:
                self._again(con)
        vj, vk = con.finish()
        if comm.size > 1:
            for v in (vj, vk):
                if v is not None:
                    comm.allreduce(v, "sum")
            vj, vk = comm.bcast((vj, vk))
        self.calls += 1
        self.stats["calls"] = self.calls
        self.stats["last_seconds"] = time.perf_counter() - t0
        return vj, vk

    def _threads(self) -> int:
        """PySCF's thread count (``lib.num_threads()``): the contraction's threads."""
        from pyscf import lib
        t = max(1, int(lib.num_threads()))
        if t > 1 and (self._pool is None or self._pool_size != t - 1):
            from concurrent.futures import ThreadPoolExecutor
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = ThreadPoolExecutor(t - 1, thread_name_prefix="chemio-jk")
            self._pool_size = t - 1
        return t

    # ------------------------------------------------------------------ planning
    def _plan(self, mol: Any) -> None:
        """Schwarz bounds, cost model, this rank's shell rows, the batch size, the batches."""
        from pyscf import lib
        from pyscf.gto import moleintor
        self.mol = mol
        self.calls = 0
        self.cached, self.direct = set(), []
        self.stats = {"calls": 0}
        comm = self.comm
        ao_loc = mol.ao_loc_nr()
        self._ao_loc = ao_loc
        nbas = mol.nbas
        n = int(ao_loc[-1])
        self._intor = mol._add_suffix("int2e")
        self._cintopt = moleintor.make_cintopt(mol._atm, mol._bas, mol._env, self._intor)
        mf = self._mf()
        mem_mb = self.max_memory
        if mem_mb is None:
            mem_mb = getattr(mf, "max_memory", None) or lib.param.MAX_MEMORY
        self._mem = max(0, int(mem_mb * _MB))

        q = self._schwarz(mol, nbas, ao_loc)
        # cost weights per shell (primitives x functions x angular momentum)
        w = np.array([mol.bas_nprim(s) * mol.bas_nctr(s) * (2 * mol.bas_angular(s) + 1)
                      * (mol.bas_angular(s) + 1) for s in range(nbas)], float)
        tri = np.tril(np.outer(w, w))                   # w_k w_l, l <= k
        wkl = np.concatenate([[0.0], np.cumsum(tri.sum(axis=1))])    # kl pairs below shell
        wj = np.concatenate([[0.0], np.cumsum(w)])
        row_cost = np.array([w[i] * wj[i + 1] * wkl[i + 1] for i in range(nbas)])

        # this rank's run of shell rows: equal shares of the estimated cost
        cum = np.concatenate([[0.0], np.cumsum(row_cost)])
        cuts = [0] + [int(np.searchsorted(cum, cum[-1] * r / comm.size)) for r in
                      range(1, comm.size)] + [nbas]
        cuts = [min(max(c, 0), nbas) for c in cuts]
        for r in range(1, len(cuts)):
            cuts[r] = max(cuts[r], cuts[r - 1])
        lo, hi = cuts[comm.rank], cuts[comm.rank + 1]

        target, why = self._granularity(mol, n)
        self._target = target
        # batches: consecutive rows merged up to ``target`` integrals, long rows cut along j
        batches: list[_Batch] = []
        screened = 0
        qmax_row = [q[i, :i + 1].max() if i >= 0 else 0.0 for i in range(nbas)]
        qkl_prefix = np.maximum.accumulate(np.array(qmax_row))   # max Q_kl over k <= shell

        def add(shls: tuple) -> None:
            nonlocal screened
            i_s0, i_s1, j_s0, j_s1 = shls
            bound = q[i_s0:i_s1, j_s0:j_s1].max() * qkl_prefix[i_s1 - 1]
            if bound < SCHWARZ:
                screened += 1
                return
            b = _Batch(len(batches), shls, ao_loc)
            if not b.rows:
                return
            b.cost = float(sum(w[i] * (wj[min(j_s1, i + 1)] - wj[j_s0]) * wkl[i_s1]
                               for i in range(i_s0, i_s1) if j_s0 <= i))
            batches.append(b)

        s = lo
        while s < hi:
            i1s = s + 1
            di = int(ao_loc[s + 1] - ao_loc[s])
            full = di * int(ao_loc[s + 1]) * (int(ao_loc[s + 1]) * (int(ao_loc[s + 1]) + 1) // 2)
            if full > target:                  # one shell row is too big: cut along j
                npair = int(ao_loc[s + 1]) * (int(ao_loc[s + 1]) + 1) // 2
                j = 0
                while j <= s:
                    j1 = j + 1
                    while (j1 <= s and di * int(ao_loc[j1 + 1] - ao_loc[j]) * npair <= target):
                        j1 += 1
                    add((s, s + 1, j, j1))
                    j = j1
                s = i1s
                continue
            while i1s < hi:                     # merge the following rows while they fit
                a1 = int(ao_loc[i1s + 1])
                if int(ao_loc[i1s + 1] - ao_loc[s]) * a1 * (a1 * (a1 + 1) // 2) > target:
                    break
                i1s += 1
            add((s, i1s, 0, i1s))
            s = i1s
        self.batches = batches
        nbytes = sum(b.nbytes for b in batches)
        self.stats.update({"batches": len(batches), "screened": screened,
                           "batch_integrals": target, "granularity": why,
                           "bytes": nbytes, "rows": (lo, hi)})
        self.say(logging.INFO, f"{n} basis functions, {nbas} shells: this rank has shell "
                               f"rows {lo}..{hi - 1} in {len(batches)} batches "
                               f"({nbytes / _MB:.1f} MB of integrals, {screened} batches "
                               f"screened out by Schwarz < {SCHWARZ:g}); {why}")

    def _schwarz(self, mol: Any, nbas: int, ao_loc: np.ndarray) -> np.ndarray:
        """Q_ab = sqrt(max |(ab|ab)|) per shell pair: PySCF's own ``q_cond`` (C, OpenMP),
        or shell pair by shell pair where that is not available."""
        from pyscf import lib
        try:
            from pyscf.scf import _vhf
            opt = _vhf._VHFOpt(mol, "int2e", "CVHFnrs8_prescreen", "CVHFnr_int2e_q_cond",
                               "CVHFnr_dm_cond", SCHWARZ)
            q = np.array(opt.q_cond, dtype=np.float64)
            if q.shape == (nbas, nbas) and np.isfinite(q).all():
                return q
        except Exception as e:          # another PySCF version: compute it here
            log.debug("PySCF's q_cond is not available (%s): Schwarz bounds computed here", e)
        q = np.zeros((nbas, nbas))
        with lib.with_omp_threads(1):                       # tiny calls: no OpenMP
            for a in range(nbas):
                for b in range(a + 1):
                    blk = self._ints((a, a + 1, b, b + 1, a, a + 1, b, b + 1), "s1")
                    da, db = ao_loc[a + 1] - ao_loc[a], ao_loc[b + 1] - ao_loc[b]
                    d = blk.reshape(da * db, da * db).diagonal()
                    q[a, b] = q[b, a] = math.sqrt(float(np.abs(d).max()))
        return q

    def _granularity(self, mol: Any, n: int) -> tuple[int, str]:
        """Integrals per batch, from two timed integral calls and the memory budget."""
        ao_loc = self._ao_loc
        nbas = mol.nbas
        s = nbas - 1                                     # the last (most expensive) row
        t_small = t_big = e_small = e_big = 0.0
        if self.comm.rank == 0:
            npair = int(ao_loc[-1]) * (int(ao_loc[-1]) + 1) // 2
            di = int(ao_loc[s + 1] - ao_loc[s])
            small = (s, s + 1, s, s + 1, 0, nbas, 0, nbas)
            jb = max(0, s - max(1, nbas // 16))
            big = (s, s + 1, jb, s + 1, 0, nbas, 0, nbas)
            e_small = di * int(ao_loc[s + 1] - ao_loc[s]) * npair
            e_big = di * int(ao_loc[s + 1] - ao_loc[jb]) * npair
            t_small = min(_timed(self._ints, small, "s2kl") for _ in range(2))
            t_big = _timed(self._ints, big, "s2kl")
        t_small, t_big, e_small, e_big = self.comm.bcast((t_small, t_big, e_small, e_big))
        # s per integral and s per call; a noisy machine can time the small call longer
        # than the big one: then the big call's mean rate bounds the rate from above
        rate = max((t_big - t_small) / max(e_big - e_small, 1.0), 0.25 * t_big / max(e_big, 1.0),
                   1e-12)
        fixed = max(t_small - rate * e_small, 0.0)
        self._rate = rate
        want = int(fixed / rate / 0.02)                   # fixed cost under 2 %
        # memory: the intor buffer, its packed copy, the RecordFile's page buffers (write
        # behind and read ahead)
        page = self._page_size()
        mem_room = max(0, self._mem - 6 * page) // 16
        floor = page // 8                                 # a batch fills about a page
        total = n * (n + 1) // 2
        total = total * (total + 1) // 2 // self.comm.size
        # at least 8 batches per rank (overflow and read-ahead need more than one), at most
        # 256 MB each (beyond that the fixed cost is noise anyway)
        target = min(max(want, floor), max(total // 8, floor), 32 << 20)
        cap = max(mem_room, 1)
        why = (f"batches of about {target * 8 / _MB:.1f} MB (measured {fixed * 1e3:.2f} ms "
               f"per integral call + {rate * 1e9:.1f} ns per integral; fixed cost under 2 % "
               f"from {want * 8 / _MB:.1f} MB")
        if target > cap:
            target = cap
            why += f"; max_memory {self._mem / _MB:.0f} MB caps them at {cap * 8 / _MB:.2f} MB"
        why += ")"
        return max(int(target), 1), why

    def _page_size(self) -> int:
        mem = self._mem
        for p in (4 << 20, 2 << 20):
            if 24 * p <= mem:
                return p
        return 1 << 20

    def _ints(self, shls: tuple, aosym: str, out: np.ndarray | None = None) -> np.ndarray:
        from pyscf.gto import moleintor
        mol = self.mol
        return moleintor.getints4c(self._intor, mol._atm, mol._bas, mol._env, shls, 1, aosym,
                                   self._ao_loc, self._cintopt, out)

    def _compute(self, b: _Batch, buf: np.ndarray) -> np.ndarray:
        shls = (b.shls[0], b.shls[1], b.shls[2], b.shls[3], 0, b.shls[1], 0, b.shls[1])
        return self._ints(shls, "s2kl", buf[:b.n_elem])

    # ------------------------------------------------------------------ cycles
    def _budget(self) -> int:
        """Bytes the cache of this rank may take."""
        cache = self.cache
        assert cache is not None
        free = fs_stat(os.path.dirname(cache.path)).free
        budget = free // 2
        why = f"half the free space of {os.path.dirname(cache.path)}"
        if self.max_disk is not None:
            if int(self.max_disk * _MB) < budget:
                budget, why = int(self.max_disk * _MB), f"max_disk={self.max_disk:g} MB"
        name = config.backend_for(self.name, self.backend).value
        if name == "shm" and self._mem < budget:
            budget, why = self._mem, "max_memory (the shm backend keeps the cache in RAM)"
        self.stats["budget"] = budget
        self.stats["budget_from"] = why
        return budget

    def _first(self, con: _Contraction) -> None:
        """Compute every batch of this rank, contract it, keep what fits."""
        t0 = time.perf_counter()
        batches = self.batches
        try:
            self.cache = RecordFile(self.name, "w+", page_size=self._page_size(),
                                    compressor=self.compress, backend=self.backend)
            self._cache_box[0] = self.cache
            budget = self._budget()
        except (OutOfSpaceError, LimitExceededError, OSError) as e:
            self.say(logging.WARNING, f"no integral cache ({e}): direct SCF")
            self.cache, budget = None, 0
        # when the budget is short, keep the batches that cost most to compute per byte
        total = sum(b.nbytes for b in batches)
        keep: set[int] = set()
        if total <= budget:
            keep = {b.id for b in batches}
        else:
            room = budget
            for b in sorted(batches, key=lambda b: -b.cost / max(b.nbytes, 1)):
                if b.nbytes + 64 <= room:
                    keep.add(b.id)
                    room -= b.nbytes + 64
        biggest = max((b.n_elem for b in batches), default=0)
        buf = np.empty(biggest)
        pack = np.empty(max((b.nbytes // 8 for b in batches), default=0))
        hdr = np.zeros(1, np.int64)
        t_int = 0.0
        since_commit = 0
        failed: str | None = None
        appended: list[int] = []
        for b in batches:
            t = time.perf_counter()
            eri = self._compute(b, buf)
            b.seconds = time.perf_counter() - t
            t_int += b.seconds
            base = eri.ctypes.data
            con.add(b, base, packed=False)
            if b.id not in keep or self.cache is None or failed is not None:
                continue
            flat = eri.reshape(-1)
            out = pack[:b.nbytes // 8]
            for _, _, off, boff, ln in b.rows:
                out[off:off + ln] = flat[boff:boff + ln]
            hdr[0] = b.id
            if self.cache.raw_nbytes + RecordFile.record_nbytes(hdr, out) > budget:
                continue
            try:
                self.cache.append(hdr, out)
                appended.append(b.id)
                since_commit += b.nbytes
                if since_commit >= _COMMIT_EVERY:
                    self.cache.flush()
                    since_commit = 0
            except LimitExceededError as e:
                self.say(logging.DEBUG, f"batch {b.id} not cached: {e}")
            except (OSError, ChemIOError) as e:          # OutOfSpaceError among them
                failed = f"{type(e).__name__}: {e}"

        del buf, pack
        self._seal(appended, failed)
        stored = [b for b in batches if b.id in self.cached]
        self.direct = [b for b in batches if b.id not in self.cached]
        sb = sum(b.nbytes for b in stored)
        db = sum(b.nbytes for b in self.direct)
        self.stats.update({"stored_batches": len(stored), "stored_bytes": sb,
                           "direct_batches": len(self.direct), "direct_bytes": db,
                           "integral_seconds": t_int,
                           "first_seconds": time.perf_counter() - t0,
                           "cache_bytes": 0 if self.cache is None else self.cache.nbytes})
        msg = (f"first cycle: {len(batches)} batches computed in {t_int:.2f} s; "
               f"{len(stored)} cached ({sb / _MB:.1f} MB"
               f"{'' if self.compress is None else f', {self.compress} compressed'})")
        if self.direct:
            why = failed or (f"cache budget {self.stats.get('budget', 0) / _MB:.1f} MB "
                             f"({self.stats.get('budget_from', 'no cache')})")
            self.say(logging.WARNING, f"{msg}; {len(self.direct)} batches "
                                      f"({db / _MB:.1f} MB) do not fit and are recomputed "
                                      f"every cycle (direct): {why}")
        else:
            self.say(logging.INFO, msg)

    def _seal(self, appended: list[int], failed: str | None) -> None:
        """Commit the cache and learn which batches it holds: all those appended, or after
        a failure those of its last commit (read back from the file)."""
        cache = self.cache
        if cache is None:
            return
        if failed is None:
            try:
                cache.close()
            except (OSError, ChemIOError) as e:
                failed = str(e)
        if failed is not None:
            self.say(logging.WARNING, f"the integral cache failed ({failed}); keeping what "
                                      f"it had committed")
            try:
                cache.close()
            except Exception:
                pass
        try:
            self.cache = RecordFile(self.name, "r", backend=self.backend)
            self._cache_box[0] = self.cache
            if failed is None:
                self.cached = set(appended)
            else:
                self.cached = {int(hdr[0]) for hdr, _ in self.cache.replay()}
        except (OSError, ChemIOError) as e:
            self.say(logging.WARNING, f"the integral cache cannot be read back ({e}): "
                                      f"its batches are recomputed")
            self._close_cache()
            self.cached = set()
        if not self.cached:
            self._close_cache()

    def _again(self, con: _Contraction) -> None:
        """Replay the cache, recompute the rest."""
        t0 = time.perf_counter()
        replayed = 0
        nbytes = 0
        cache = self.cache
        byid = {b.id: b for b in self.batches}
        if cache is not None and self.cached:
            for hdr, data in cache.replay(depth=2):
                b = byid[int(hdr[0])]
                con.add(b, data.ctypes.data, packed=True)
                replayed += 1
                nbytes += b.nbytes
        t_rep = time.perf_counter() - t0
        t1 = time.perf_counter()
        if self.direct:
            buf = np.empty(max(b.n_elem for b in self.direct))
            for b in self.direct:
                eri = self._compute(b, buf)
                con.add(b, eri.ctypes.data, packed=False)
        t_dir = time.perf_counter() - t1
        st = self.stats
        st["replayed"] = st.get("replayed", 0) + replayed
        st["recomputed"] = st.get("recomputed", 0) + len(self.direct)
        st["replay_seconds"] = st.get("replay_seconds", 0.0) + t_rep
        st["direct_seconds"] = st.get("direct_seconds", 0.0) + t_dir
        self.say(logging.DEBUG, f"call {self.calls + 1}: {replayed} batches replayed "
                                f"({nbytes / _MB:.1f} MB, {t_rep:.2f} s), "
                                f"{len(self.direct)} recomputed ({t_dir:.2f} s)")
        if self.calls == 1 and replayed:
            # the I/O rate against the integral rate: is the cache worth reading?
            compute = sum(byid[i].seconds for i in self.cached if i in byid)
            st["read_MBps"] = nbytes / _MB / max(t_rep, 1e-9)
            if t_rep > 1.5 * compute + 0.05:
                self.say(logging.WARNING,
                         f"replaying the cache ({st['read_MBps']:.0f} MB/s, {t_rep:.2f} s) is "
                         f"slower than computing its integrals ({compute:.2f} s): dropping "
                         f"it, direct SCF from now on")
                self.direct = list(self.batches)
                self.cached = set()
                self._close_cache()

    # ------------------------------------------------------------------ ending
    def _close_cache(self) -> None:
        cache, self.cache = self.cache, None
        self._cache_box[0] = None
        if cache is not None:
            try:
                cache.delete()
            except Exception as e:          # cleanup never hides the SCF's result
                log.warning("could not remove the integral cache %s: %s", cache.path, e)

    def close(self) -> None:
        """Remove the cache; the next ``get_jk`` computes the integrals again."""
        self._close_cache()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool, self._pool_size = None, 0
        self.mol = None
        self.calls = 0

    @staticmethod
    def _drop(box: list) -> None:
        cache = box[0]
        if cache is not None:
            finalizers.close_later(cache.delete)

    def __repr__(self) -> str:
        s = self.stats
        return (f"<SemiDirectJK {self.name}: {s.get('stored_batches', 0)} batches cached, "
                f"{s.get('direct_batches', 0)} direct, {self.calls} calls>")


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    """The address of ``a``'s data as a ``c_void_p`` (the caller keeps ``a`` alive)."""
    return ctypes.c_void_p(a.ctypes.data)


def _timed(fn: Any, *args: Any) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def _same_mol(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return (np.array_equal(a._atm, b._atm) and np.array_equal(a._bas, b._bas)
            and np.array_equal(a._env, b._env) and a.cart == b.cart)
