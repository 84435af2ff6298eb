"""Stress run: P processes doing a random mix of every chemio_py operation for a fixed time,
every byte checked against an independent model. Not a speed benchmark: its figure of merit
is ``lost or wrong bytes: 0`` (issue 11, "Trust").

What runs. P = 1..4 processes for ``--seconds`` each (default 60; quick mode 10 at P = 1, 2).
P = 1 is a plain ``python`` process (the serial path of ``cio.comm()``, as in Jupyter);
P >= 2 is a real ``mpiexec -n P python -m mpi4py`` (the mpich wheel's launcher), because
SharedFile and DiskArray creation, ``write_all``/``read_all``, ``close`` and ``destroy`` are
collective. Each process works in rounds until the time is up:

* an independent slice on its private files, on every backend (``local``, ``local`` with
  O_DIRECT, ``shm``, ``auto``): ExclusiveFile ``write``/``read``/``read_bytes``/``awrite``/
  ``aread``/``aread_many``/``awrite_many``/``truncate``/``flush`` at random offsets and sizes
  (0 B to 4 MiB, past the end of the file too, leaving holes; 4 KiB-aligned buffers from
  ``cio.aligned_empty`` for the AIO path), close/reopen (``r`` and ``r+``, some writes still
  in flight at the close), delete/re-create; RecordFile ``append`` (1-4 arrays of any dtype
  and shape, records larger than a page, compressed and not), ``flush`` (durable or not),
  full and partial ``replay``, close/reopen (``r``/``r+``), re-create;
* then a collective phase on one backend (cycled): either a SharedFile round (every rank
  writes random sub-ranges of its own random disjoint segments, blocking and async; flush,
  barrier; every rank reads other ranks' data, and past the end; sometimes one rank
  truncates; sometimes the file is destroyed and created again, with or without
  ``hard_limit``/``soft_limit``/``request_size``) or a DiskArray round (1-3 dimensions, every
  supported dtype, random chunks or ``request_shape``; each rank writes random aligned and
  non-aligned sections of its own rows with ``write``/``awrite``/``d[...] = ``, transposed
  too, reads them back; barrier; ``write_all``/``read_all``; reads of other ranks' rows;
  persistent arrays are closed and reopened, ``r`` then ``r+``).

The model. A NumPy byte array per file (with its size), a NumPy array per DiskArray, a list
of arrays per RecordFile. Every process applies the writes of the other processes from
their descriptors (offset, length, position in a data pool that every rank derives from the
seed), so a read of another rank's data is checked byte for byte. Async requests in flight
never overlap a write in flight (MPI semantics), and a read that the model says passes the
end of the file expects ``EndOfFileError``; expected errors (``EndOfFileError``,
``LimitExceededError`` past ``hard_limit``, ``ModeError`` on a read-only handle,
``SectionError`` on a section outside the shape) count as checks. Anything else raised is an
error, reported with the seed, rank, round, operation number and traceback; a read that
differs from the model counts its differing bytes as lost or wrong. Every object is also
verified whole at random times and at the end.

Bounds. Draws come from ``numpy.random.default_rng`` seeded with ``--seed`` (printed; a
random one when not given): the same seed and P replay the same operations in the same
order (how many rounds fit in the time varies). Each round is a bounded amount of work and
no new round starts when the previous ones say it would not end in time, so a run ends a
few seconds after ``--seconds``. A process stuck in one operation for ``--hang-timeout``
seconds (default 120) dumps its stack and exits (faulthandler); the launcher kills the whole
process group at ``--seconds`` + hang timeout + 60 s at the latest. Every file lives in a
work directory and a private ``/dev/shm/cio-stress-*`` directory that are removed at the
end, on failure too; files that the library's own cleanup left behind are reported.

Run it::

    chemio bench --only stress [--seconds 60] [--procs 4] [--seed N]
    python benchmarks/bench_stress.py --seconds 600 --procs 4 [--seed N] [--json out.json]

``--shm-limit 48M`` (script only) sets a small RAM budget (``CHEMIO_SHM_LIMIT``): ``auto``
files then spill to disk under the load (counted in the report) and ``shm`` is left out,
its files being refused by design; a SharedFile of ``auto`` refused growth with
``OutOfSpaceError`` counts as expected. ``--inject corrupt|hang`` (tests only) flips bytes
in some writes or blocks one read forever, to prove that the checks and the watchdog work.

The runner gets one row per P (operations, bytes verified, errors, lost or wrong bytes, and
a PASS/FAIL "clean" row; per-kind counts in the row's ``detail``); a run that is not clean
raises, so ``chemio bench`` exits 1 with the report in ``results.json``. The script prints the
report and exits 1 when anything was lost or wrong or any error happened.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from common import GiB, KiB, MiB, row  # noqa: E402

BACKENDS = ("local", "shm", "auto")
SECONDS = 60
QUICK_SECONDS = 10
FULL_PROCS = (1, 2, 3, 4)
QUICK_PROCS = (1, 2)
HANG_TIMEOUT = 120.0          # one operation (or one collective wait) longer than this: a hang
KILL_MARGIN = 60.0            # launcher kills the process group at seconds + hang + this

POOL_BYTES = 16 * MiB         # random bytes every rank derives from the seed (write payloads)
DPOOL_BYTES = 8 * MiB         # per DiskArray dtype
OP_MAX = 4 * MiB              # largest single transfer
EAF_MAX = 24 * MiB            # largest ExclusiveFile
SF_SPAN_MAX = 8 * MiB         # SharedFile segments lie in [0, span)
SF_CAP = SF_SPAN_MAX + 2 * MiB
DRA_MAX = 6 * MiB
REC_MAX = 12 * MiB            # raw stream bytes of one RecordFile before it is re-created
INF = 1 << 62
DRA_DTYPES = ("<f8", "<f4", "<i8", "<i4", "<i2", "|u1", "<u8", "|b1", "<c16", "<c8")
REC_DTYPES = ("<f8", "<f4", "<i8", "<i4", "|u1", "<c16", "|b1", "<u2")
MAX_ERRORS_KEPT = 40

# Operation kinds a healthy run performs (the smoke test demands each at least once).
KINDS = {
    "eaf": ("write", "read", "read_bytes", "awrite", "aread", "aread_many", "awrite_many",
            "truncate", "flush", "reopen", "recreate", "verify"),
    "rec": ("append", "flush", "replay", "replay_partial", "reopen", "recreate"),
    "sf": ("create", "write", "awrite", "awrite_many", "read", "aread", "aread_many",
           "read_other", "truncate", "destroy"),
    "dra": ("create", "write", "awrite", "setitem", "read", "aread", "read_other",
            "write_all", "read_all", "reopen", "close"),
}
REQUIRED_KINDS = tuple(f"{obj}.{k}" for obj, ks in KINDS.items() for k in ks)


# ====================================================================== worker side

class Tally:
    """What one process did and found."""

    def __init__(self, rank: int, seed: int, procs: int):
        self.rank, self.seed, self.procs = rank, seed, procs
        self.ops: Counter = Counter()
        self.by_backend: Counter = Counter()
        self.expected: Counter = Counter()
        self.verified = 0
        self.wrong = 0
        self.nerrors = 0
        self.errors: list[dict] = []
        self.round = 0
        self.opno = 0
        self.what = ""

    def op(self, kind: str, backend: str, n: int = 1) -> None:
        self.ops[kind] += n
        self.by_backend[backend] += n

    def error(self, kind: str, obj: Any, message: str, tb: str = "") -> None:
        self.nerrors += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append({
                "rank": self.rank, "round": self.round, "op": self.opno, "kind": kind,
                "object": getattr(obj, "desc", str(obj)), "doing": self.what,
                "message": message, "traceback": tb[-6000:],
                "replay": f"--seed {self.seed} --procs {self.procs}"})

    def exception(self, kind: str, obj: Any, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.error(kind, obj, f"unexpected {type(exc).__name__}: {exc}", tb)

    def compare(self, kind: str, obj: Any, got: Any, want: Any, where: str) -> bool:
        """Compare bytes (and dtype/shape for arrays); count verified and wrong bytes."""
        if isinstance(want, np.ndarray) and isinstance(got, np.ndarray):
            if got.shape != want.shape or got.dtype != want.dtype:
                self.wrong += want.nbytes
                self.error(kind, obj, f"{where}: got an array {got.dtype}{got.shape}, the "
                                      f"model has {want.dtype}{want.shape}")
                return False
            g = np.ascontiguousarray(got).reshape(-1).view(np.uint8)
            w = np.ascontiguousarray(want).reshape(-1).view(np.uint8)
        else:
            g = np.frombuffer(got, np.uint8) if not isinstance(got, np.ndarray) else \
                got.reshape(-1).view(np.uint8)
            w = np.frombuffer(want, np.uint8) if not isinstance(want, np.ndarray) else \
                want.reshape(-1).view(np.uint8)
        if g.size != w.size:
            self.wrong += max(g.size, w.size)
            self.error(kind, obj, f"{where}: got {g.size} bytes, the model has {w.size}")
            return False
        self.verified += w.size
        if np.array_equal(g, w):
            return True
        bad = np.flatnonzero(g != w)
        self.wrong += int(bad.size)
        i = int(bad[0])
        self.error(kind, obj, f"{where}: {bad.size} of {w.size} bytes differ from the model; "
                              f"first at byte {i} of the transfer: got "
                              f"{bytes(g[i:i + 8]).hex()} want {bytes(w[i:i + 8]).hex()}")
        return False

    def as_dict(self) -> dict:
        return {"rank": self.rank, "ops": dict(self.ops), "by_backend": dict(self.by_backend),
                "expected": dict(self.expected), "verified": self.verified, "wrong": self.wrong,
                "nerrors": self.nerrors, "errors": self.errors, "rounds": self.round}


class Broken(Exception):
    """A check failed in a way that makes the object's model unreliable (already reported)."""


class Ctx:
    """One process's worker state: communicator, RNGs, data pools, tally, watchdog."""

    def __init__(self, cfg: dict):
        import chemio_py as cio
        self.cio = cio
        self.c = cio.comm()
        self.rank, self.P = self.c.rank, self.c.size
        self.seed = int(cfg["seed"])
        self.hang = float(cfg["hang"])
        self.run_dir = cfg["run"]
        self.keep_dir = cfg["keep"]
        # With a small RAM budget (--shm-limit) the auto backend spills private files to
        # disk; shm is left out (its files would be refused), and a SharedFile of auto on
        # several ranks may be refused growth (OutOfSpaceError, documented): expected.
        self.budget = cfg.get("shm_limit") or None
        self.backends = ("local", "auto") if self.budget else BACKENDS
        if self.budget:
            import warnings
            warnings.simplefilter("ignore", cio.errors.SpillWarning)
        self.shared = np.random.default_rng([self.seed, 1])        # same draws on every rank
        self.mine = np.random.default_rng([self.seed, 2, self.rank])
        self.pool = np.random.default_rng([self.seed, 3]).integers(0, 256, POOL_BYTES,
                                                                   dtype=np.uint8)
        self.pool.flags.writeable = False
        self._dpools: dict[str, np.ndarray] = {}
        self.t = Tally(self.rank, self.seed, self.P)
        self.plan: Counter = Counter()      # collective decisions taken (same on every rank)
        self._status = os.open(os.path.join(self.run_dir, f"status.{self.rank}"),
                               os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._hang_fh = open(os.path.join(self.run_dir, f"stack.{self.rank}"), "w")
        faulthandler.enable(file=self._hang_fh)

    # ---------------------------------------------------------------- watchdog
    def step(self, what: str) -> None:
        """Note the operation about to run and re-arm the hang watchdog."""
        self.t.opno += 1
        self.t.what = what
        line = f"round {self.t.round} op {self.t.opno}: {what}"[:400].encode()
        os.pwrite(self._status, line.ljust(400), 0)
        faulthandler.dump_traceback_later(self.hang, exit=True, file=self._hang_fh)

    def close(self) -> None:
        """The run is over: the watchdog stays armed through the interpreter's exit cleanup."""
        self.step("exit (the library's cleanup at interpreter exit)")

    def refused(self, exc: BaseException, backend: str) -> bool:
        """Is ``exc`` the RAM budget refusing a shared auto segment (expected, --shm-limit)?"""
        if not (self.budget and backend == "auto"):
            return False
        seen = [exc, exc.__cause__, *getattr(exc, "errors", [])]
        if any(isinstance(e, self.cio.OutOfSpaceError) for e in seen):
            self.t.expected["OutOfSpaceError (RAM budget, shared segment)"] += 1
            return True
        return False

    # ---------------------------------------------------------------- data
    def payload(self, n: int, rng: np.random.Generator | None = None) -> tuple[int, np.ndarray]:
        """(pool position, n read-only pool bytes)."""
        s = int((rng or self.mine).integers(0, POOL_BYTES - n + 1))
        return s, self.pool[s:s + n]

    def dpool(self, dt: np.dtype) -> np.ndarray:
        p = self._dpools.get(dt.str)
        if p is None:
            rng = np.random.default_rng([self.seed, 4, DRA_DTYPES.index(dt.str)])
            n = DPOOL_BYTES // dt.itemsize
            if dt.kind == "b":
                p = rng.integers(0, 2, n).astype(bool)
            elif dt.kind in "iu":
                info = np.iinfo(dt)
                p = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
            elif dt.kind == "f":
                p = (rng.standard_normal(n) * 1e3).astype(dt)
            else:
                p = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
            p.flags.writeable = False
            self._dpools[dt.str] = p
        return p

    # ---------------------------------------------------------------- collectives
    def barrier(self) -> None:
        """A barrier that sleeps instead of spinning (P may exceed the cores)."""
        if self.c.mpi is None:
            return
        self.step("barrier")
        req = self.c.mpi.Ibarrier()
        while not req.Test():
            time.sleep(0.0005)

    def any_rank(self, flag: bool) -> bool:
        if self.P == 1:
            return bool(flag)
        self.step("allreduce of a flag")
        return bool(self.c.allreduce(int(bool(flag))))

    def allgather(self, obj: Any) -> list:
        if self.P == 1:
            return [obj]
        self.step("allgather")
        return self.c.allgather(obj)


# ---------------------------------------------------------------- random helpers

def nbytes_draw(rng: np.random.Generator, cap: int = OP_MAX, aligned: bool = False) -> int:
    """A transfer size: 0 B to ``cap``, mostly small, sometimes MiBs."""
    r = rng.random()
    if r < 0.04:
        n = 0
    elif r < 0.24:
        n = int(rng.integers(1, 256))
    elif r < 0.50:
        n = int(rng.integers(256, 8 * KiB))
    elif r < 0.80:
        n = int(rng.integers(8 * KiB, 256 * KiB))
    elif r < 0.94:
        n = int(rng.integers(256 * KiB, MiB))
    else:
        n = int(rng.integers(MiB, OP_MAX + 1))
    if aligned:
        n = max(4096, n // 4096 * 4096)
    return max(0, min(n, cap))


def boxes_overlap(a: tuple, b: tuple) -> bool:
    """Do two boxes (tuples of (lo, hi) per axis) share an element?"""
    for (alo, ahi), (blo, bhi) in zip(a, b):
        if ahi <= alo or bhi <= blo or ahi <= blo or bhi <= alo:
            return False
    return True


def pick(rng: np.random.Generator, weights: dict, done: Counter, prefix: str) -> str:
    """An operation kind by weight; kinds never done yet come first (coverage)."""
    todo = [k for k in weights if done[f"{prefix}.{k}"] == 0 and weights[k] > 0]
    if todo and rng.random() < 0.5:
        return todo[int(rng.integers(len(todo)))]
    keys = list(weights)
    w = np.array([weights[k] for k in keys], float)
    return keys[int(rng.choice(len(keys), p=w / w.sum()))]


class Flight:
    """Async requests of one object in flight, with the element boxes they touch."""

    def __init__(self):
        self.items: list[tuple] = []

    def clash(self, box: tuple, write: bool) -> bool:
        return any(boxes_overlap(box, b) and (write or w) for _, b, w, _ in self.items)

    def add(self, req: Any, box: tuple, write: bool,
            done: Callable[[Any, BaseException | None], None]) -> None:
        self.items.append((req, box, write, done))

    def __len__(self) -> int:
        return len(self.items)

    def settle(self, ctx: Ctx, reads_only: bool = False) -> None:
        """Wait for every request (or every read: writes may stay in flight through a
        ``flush``/``close``, which must complete them) and run its check. A read that is
        expected to fail must be waited for before ``flush``/``close``, which would raise
        its error too."""
        if reads_only:
            items = [it for it in self.items if not it[2]]
            self.items = [it for it in self.items if it[2]]
        else:
            items, self.items = self.items, []
        broken = False
        for req, _, _, done in items:
            try:
                val = req.wait(timeout=ctx.hang)
                exc = None
            except Exception as e:          # handled by the callback (expected or not)
                val, exc = None, e
            try:
                done(val, exc)
            except Broken:
                broken = True
        if broken:
            raise Broken()


# ====================================================================== ExclusiveFile

class Eaf:
    """One private file and its model: ``model[:size]`` is the file, ``model[size:]`` zeros."""

    def __init__(self, ctx: Ctx, backend: str, direct: bool, idx: int):
        self.ctx, self.backend, self.direct = ctx, backend, direct
        self.name = f"stress{idx}-{backend}{'-direct' if direct else ''}"
        self.desc = f"ExclusiveFile({self.name!r}, backend={backend!r}, direct={direct})"
        self.model = np.zeros(EAF_MAX + OP_MAX + 8, np.uint8)
        self.size = 0
        self.stable = 0            # size at the last settle: async reads below it are safe
        self.flight = Flight()
        self.f = None
        self.mode = None

    def open(self, mode: str) -> None:
        kw = {"direct": True} if self.direct else {}
        self.f = self.ctx.cio.ExclusiveFile(self.name, mode, backend=self.backend, **kw)
        self.mode = mode
        if mode in ("w+", "x+"):
            self.size = 0
            self.model[:] = 0
        self.stable = self.size

    # ------------------------------------------------------------ model helpers
    def mwrite(self, off: int, data: Any) -> None:
        n = len(data) if not isinstance(data, np.ndarray) else data.nbytes
        if n == 0:
            return
        self.model[off:off + n] = np.frombuffer(data, np.uint8) if not isinstance(
            data, np.ndarray) else data.reshape(-1).view(np.uint8)
        self.size = max(self.size, off + n)

    def eof(self, off: int, n: int) -> bool:
        return off + n > self.size if n else off > self.size

    def settle(self) -> None:
        self.flight.settle(self.ctx)
        self.stable = self.size

    def check_size(self, kind: str) -> None:
        got = self.f.size
        if got != self.size:
            self.ctx.t.error(kind, self, f"size is {got} bytes, the model says {self.size}")
            raise Broken()

    # ------------------------------------------------------------ draws
    def draw_write(self, rng: np.random.Generator) -> tuple[int, int, bool]:
        aligned = self.direct and rng.random() < 0.5 or rng.random() < 0.1
        n = nbytes_draw(rng, aligned=aligned)
        r = rng.random()
        if n == 0 or r < 0.45:
            off = int(rng.integers(0, self.size + 1))
        elif r < 0.65:
            off = self.size + int(rng.integers(1, 4 * MiB))          # leaves a hole
        else:
            off = max(0, self.size + int(rng.integers(-64 * KiB, 64 * KiB)))
        if aligned:
            off = off // 4096 * 4096
        if off + n > EAF_MAX:
            off = int(rng.integers(0, EAF_MAX - n + 1))
            if aligned:
                off = off // 4096 * 4096
        return off, n, aligned

    def draw_read(self, rng: np.random.Generator) -> tuple[int, int, bool]:
        aligned = self.direct and rng.random() < 0.5 or rng.random() < 0.1
        n = nbytes_draw(rng, aligned=aligned)
        r = rng.random()
        if r < 0.12:                                   # past the end: EndOfFileError
            off = max(0, self.size - n + int(rng.integers(1, 64 * KiB)))
        else:
            n = min(n, self.size)
            if aligned and n >= 4096:
                n = n // 4096 * 4096
            off = int(rng.integers(0, self.size - n + 1))
        if aligned:
            off = off // 4096 * 4096
        return off, n, aligned

    def buffer(self, n: int, aligned: bool) -> np.ndarray:
        if aligned:
            return self.ctx.cio.aligned_empty((n,))
        return np.empty(n, np.uint8)

    def wbuffer(self, data: np.ndarray, aligned: bool) -> Any:
        """The payload as the caller would pass it: an aligned copy, bytes, or a view."""
        if aligned:
            b = self.ctx.cio.aligned_empty((data.size,))
            b[:] = data
            return b
        if self.ctx.mine.random() < 0.2:
            return data.tobytes()
        return data

    # ------------------------------------------------------------ checks
    def check_read(self, kind: str, off: int, buf: Any, eof: bool, exc: BaseException | None):
        t = self.ctx.t
        EOF = self.ctx.cio.EndOfFileError
        if exc is not None:
            if eof and isinstance(exc, EOF):
                t.expected["EndOfFileError"] += 1
                return
            t.exception(kind, self, exc)
            raise Broken()
        if eof:
            t.error(kind, self, f"read of {len(memoryview(buf).cast('B'))} bytes at {off} passed "
                                f"the end ({self.size} bytes) without EndOfFileError")
            raise Broken()
        n = memoryview(buf).nbytes
        if not t.compare(kind, self, buf, self.model[off:off + n], f"read at offset {off}"):
            raise Broken()

    # ------------------------------------------------------------ operations
    def write(self, rng) -> None:
        off, n, aligned = self.draw_write(rng)
        if self.flight.clash(((off, off + n),), True):
            self.settle()
        s, data = self.ctx.payload(n)
        self.ctx.step(f"{self.desc}.write({off}, {n} B)")
        self.f.write(off, self.wbuffer(data, aligned))
        self.mwrite(off, data)
        self.ctx.t.op("eaf.write", self.backend)
        self.stable = max(self.stable, off + n) if len(self.flight) else self.size

    def read(self, rng, as_bytes: bool = False) -> None:
        off, n, aligned = self.draw_read(rng)
        eof = self.eof(off, n)
        box = ((off, INF),) if eof else ((off, off + n),)
        if self.flight.clash(box, False) or off + n > self.stable:
            self.settle()
            eof = self.eof(off, n)
        kind = "eaf.read_bytes" if as_bytes else "eaf.read"
        self.ctx.step(f"{self.desc}.{kind[4:]}({off}, {n} B)")
        buf = self.buffer(n, aligned)
        try:
            got = self.f.read_bytes(off, n) if as_bytes else self.f.read(off, buf)
            exc = None
        except Exception as e:
            got, exc = buf, e
        self.ctx.t.op(kind, self.backend)
        if exc is None and not as_bytes and got is not buf:
            self.ctx.t.error(kind, self, "read() did not return the buffer it filled")
        self.check_read(kind, off, got, eof, exc)

    def async_batch(self, rng) -> None:
        """1..8 awrite/aread requests; some stay in flight for later operations."""
        for _ in range(int(rng.integers(1, 9))):
            if rng.random() < 0.5:
                off, n, aligned = self.draw_write(rng)
                if self.flight.clash(((off, off + n),), True):
                    self.settle()
                s, data = self.ctx.payload(n)
                self.ctx.step(f"{self.desc}.awrite({off}, {n} B)")
                req = self.f.awrite(off, self.wbuffer(data, aligned))
                self.mwrite(off, data)
                self.ctx.t.op("eaf.awrite", self.backend)
                self.flight.add(req, ((off, off + n),), True, self._write_done(off, n))
            else:
                off, n, aligned = self.draw_read(rng)
                eof = self.eof(off, n)
                box = ((off, INF),) if eof else ((off, off + n),)
                if self.flight.clash(box, False) or off + n > self.stable:
                    self.settle()
                    eof = self.eof(off, n)
                    box = ((off, INF),) if eof else ((off, off + n),)
                buf = self.buffer(n, aligned)
                self.ctx.step(f"{self.desc}.aread({off}, {n} B)")
                self.ctx.t.op("eaf.aread", self.backend)
                try:
                    req = self.f.aread(off, buf)
                except Exception as e:       # EndOfFileError may come at once
                    self.check_read("eaf.aread", off, buf, eof, e)
                    continue
                self.flight.add(req, box, False, self._read_done("eaf.aread", off, buf, eof))
        if rng.random() < 0.6:
            self.settle()

    def _write_done(self, off: int, n: int):
        def done(val: Any, exc: BaseException | None) -> None:
            if exc is not None:
                self.ctx.t.exception("eaf.awrite", self, exc)
                raise Broken()
            if val != n:
                self.ctx.t.error("eaf.awrite", self, f"awrite of {n} B at {off} returned {val!r}")
        return done

    def _read_done(self, kind: str, off: int, buf: Any, eof: bool):
        def done(val: Any, exc: BaseException | None) -> None:
            if exc is None and val is not buf:
                self.ctx.t.error(kind, self, "aread().wait() did not return the buffer")
            self.check_read(kind, off, buf, eof, exc)
        return done

    def _ranges(self, rng, k: int, lo: int, hi: int, rows: int | None, aligned: bool):
        """k disjoint (offset, size) ranges in [lo, hi), shuffled; fewer if they do not fit."""
        out = []
        cur = lo
        for _ in range(k):
            n = rows if rows is not None else max(1, nbytes_draw(rng, cap=256 * KiB,
                                                                 aligned=aligned))
            gap = int(rng.integers(0, 2 * n + 1)) if rng.random() < 0.7 else 0
            off = cur + gap
            if aligned:
                off = -(-off // 4096) * 4096
            if off + n > hi:
                break
            out.append((off, n))
            cur = off + n
        rng.shuffle(out)
        return out

    def read_many(self, rng) -> None:
        aligned = self.direct and rng.random() < 0.6
        k = int(rng.integers(1, 33))
        rows = None
        if rng.random() < 0.5:
            rows = 4096 * int(rng.integers(1, 5)) if aligned else int(rng.integers(1, 64 * KiB))
        eof_case = rng.random() < 0.1
        self.settle()
        hi = self.size + (8 * MiB if eof_case else 0)
        start = int(rng.integers(0, max(1, self.size // 2)))
        if aligned:
            start = start // 4096 * 4096
        ranges = self._ranges(rng, k, start, hi, rows, aligned)
        if not ranges:
            return
        if rows is not None and rng.random() < 0.6:
            bufs = (self.ctx.cio.aligned_empty((len(ranges), rows)) if aligned
                    else np.empty((len(ranges), rows), np.uint8))
            views = list(bufs)
        else:
            bufs = [self.buffer(n, aligned) for _, n in ranges]
            views = bufs
        eof = any(o + n > self.size for o, n in ranges)
        offs = [o for o, _ in ranges]
        self.ctx.step(f"{self.desc}.aread_many({len(ranges)} ranges)")
        self.ctx.t.op("eaf.aread_many", self.backend)
        t = self.ctx.t
        try:
            got = self.f.aread_many(offs, bufs).wait(timeout=self.ctx.hang)
            exc = None
        except Exception as e:
            got, exc = None, e
        if exc is not None:
            if eof and isinstance(exc, self.ctx.cio.EndOfFileError):
                t.expected["EndOfFileError"] += 1
                return
            t.exception("eaf.aread_many", self, exc)
            raise Broken()
        if eof:
            t.error("eaf.aread_many", self, f"ranges past the end ({self.size} bytes) read "
                                            f"without EndOfFileError: {ranges}")
            raise Broken()
        if got is not bufs:
            t.error("eaf.aread_many", self, "wait() did not return the buffers")
        ok = True
        for (o, n), v in zip(ranges, views):
            ok &= t.compare("eaf.aread_many", self, v, self.model[o:o + n], f"range at {o}")
        if not ok:
            raise Broken()

    def write_many(self, rng) -> None:
        aligned = self.direct and rng.random() < 0.6
        k = int(rng.integers(1, 33))
        rows = None
        if rng.random() < 0.5:
            rows = 4096 * int(rng.integers(1, 5)) if aligned else int(rng.integers(1, 64 * KiB))
        self.settle()
        start = int(rng.integers(0, self.size + 2 * MiB))
        if aligned:
            start = start // 4096 * 4096
        ranges = self._ranges(rng, k, start, EAF_MAX, rows, aligned)
        if not ranges:
            return
        datas = [self.ctx.payload(n)[1] for _, n in ranges]
        if rows is not None and rng.random() < 0.6:
            bufs = (self.ctx.cio.aligned_empty((len(ranges), rows)) if aligned
                    else np.empty((len(ranges), rows), np.uint8))
            for i, d in enumerate(datas):
                bufs[i] = d
        elif aligned:
            bufs = [self.wbuffer(d, True) for d in datas]
        else:
            bufs = datas
        offs = [o for o, _ in ranges]
        total = sum(n for _, n in ranges)
        self.ctx.step(f"{self.desc}.awrite_many({len(ranges)} ranges, {total} B)")
        req = self.f.awrite_many(offs, bufs)
        for (o, _n), d in zip(ranges, datas):
            self.mwrite(o, d)
        self.ctx.t.op("eaf.awrite_many", self.backend)
        box_lo = min(offs)
        box_hi = max(o + n for o, n in ranges)

        def done(val, exc):
            if exc is not None:
                self.ctx.t.exception("eaf.awrite_many", self, exc)
                raise Broken()
            if val != total:
                self.ctx.t.error("eaf.awrite_many", self, f"wait() returned {val!r}, "
                                                          f"wrote {total} bytes")
        self.flight.add(req, ((box_lo, box_hi),), True, done)
        if rng.random() < 0.5:
            self.settle()

    def truncate(self, rng) -> None:
        r = rng.random()
        if r < 0.1:
            n = 0
        elif r < 0.7:
            n = int(rng.integers(0, self.size + 1))
        else:
            n = min(EAF_MAX, self.size + int(rng.integers(1, 2 * MiB)))
        self.settle()
        self.ctx.step(f"{self.desc}.truncate({n})")
        self.f.truncate(n)
        if n < self.size:
            self.model[n:self.size] = 0
        self.size = self.stable = n
        self.ctx.t.op("eaf.truncate", self.backend)
        self.check_size("eaf.truncate")

    def flush(self, rng) -> None:
        self.flight.settle(self.ctx, reads_only=True)
        self.ctx.step(f"{self.desc}.flush() with {len(self.flight)} writes in flight")
        try:
            self.f.flush()
        finally:
            self.settle()
        self.ctx.t.op("eaf.flush", self.backend)

    def verify(self, kind: str = "eaf.verify") -> None:
        self.settle()
        self.ctx.step(f"{self.desc} verify whole file ({self.size} B)")
        self.check_size(kind)
        buf = np.empty(self.size, np.uint8)
        if self.size:
            self.f.read(0, buf)
        if not self.ctx.t.compare(kind, self, buf, self.model[:self.size], "whole file"):
            raise Broken()
        if kind == "eaf.verify":
            self.ctx.t.op(kind, self.backend)

    def reopen(self, rng) -> None:
        if rng.random() < 0.5:      # leave writes in flight: close() must complete them
            for _ in range(int(rng.integers(1, 4))):
                off, n, aligned = self.draw_write(rng)
                if self.flight.clash(((off, off + n),), True):
                    self.settle()
                s, data = self.ctx.payload(n)
                self.ctx.step(f"{self.desc}.awrite({off}, {n} B) left in flight")
                req = self.f.awrite(off, self.wbuffer(data, aligned))
                self.mwrite(off, data)
                self.ctx.t.op("eaf.awrite", self.backend)
                self.flight.add(req, ((off, off + n),), True, self._write_done(off, n))
        self.flight.settle(self.ctx, reads_only=True)
        self.ctx.step(f"{self.desc}.close() with {len(self.flight)} writes in flight")
        try:
            self.f.close()
        finally:
            self.settle()
        if rng.random() < 0.4:
            self.ctx.step(f"{self.desc} reopen 'r'")
            self.open("r")
            self.verify("eaf.reopen")
            self.ctx.step(f"{self.desc}.write on a read-only handle")
            try:
                self.f.write(0, b"x")
            except self.ctx.cio.ModeError:
                self.ctx.t.expected["ModeError"] += 1
            else:
                self.ctx.t.error("eaf.reopen", self, "write on a mode 'r' file did not raise "
                                                     "ModeError")
                raise Broken()
            self.f.close()
        self.ctx.step(f"{self.desc} reopen 'r+'")
        self.open("r+")
        self.verify("eaf.reopen")
        self.ctx.t.op("eaf.reopen", self.backend)

    def recreate(self, rng) -> None:
        self.flight.settle(self.ctx, reads_only=True)
        self.ctx.step(f"{self.desc} delete + create with {len(self.flight)} writes in flight")
        r = rng.random()
        if r < 0.4:
            self.f.delete()
            self.settle()
            self.open("x+")
        elif r < 0.7:
            self.f.close()
            self.settle()
            cls = self.ctx.cio.ExclusiveFile
            if not cls.remove(self.name, backend=self.backend):
                self.ctx.t.error("eaf.recreate", self, "ExclusiveFile.remove() of an existing "
                                                       "file returned False")
            if cls.remove(self.name, backend=self.backend):
                self.ctx.t.error("eaf.recreate", self, "a second ExclusiveFile.remove() "
                                                       "returned True")
            self.open("x+")
        else:
            self.f.close()
            self.settle()
            self.open("w+")          # truncates the existing file
        self.check_size("eaf.recreate")
        self.ctx.t.op("eaf.recreate", self.backend)

    WEIGHTS = {"write": 16, "read": 14, "read_bytes": 3, "awrite": 6, "aread": 6,
               "aread_many": 5, "awrite_many": 5, "truncate": 3, "flush": 2, "reopen": 2,
               "recreate": 1, "verify": 1}

    def one_op(self, rng) -> None:
        kind = pick(rng, self.WEIGHTS, self.ctx.t.ops, "eaf")
        {"write": self.write, "read": self.read,
         "read_bytes": lambda r: self.read(r, as_bytes=True), "awrite": self.async_batch,
         "aread": self.async_batch,
         "aread_many": self.read_many, "awrite_many": self.write_many,
         "truncate": self.truncate, "flush": self.flush, "reopen": self.reopen,
         "recreate": self.recreate, "verify": lambda r: self.verify()}[kind](rng)

    def finish(self) -> None:
        self.verify("eaf.verify")
        self.ctx.step(f"{self.desc}.delete()")
        self.f.delete()

    def abandon(self) -> None:
        """After a failure: drop in-flight requests, close, remove, start afresh."""
        self.flight.items = []
        try:
            if self.f is not None:
                self.f.delete()
        except Exception:
            pass
        self.f = None


# ====================================================================== RecordFile

class Rec:
    """One RecordFile and its model (a list of records, each a tuple of arrays)."""

    def __init__(self, ctx: Ctx, backend: str, idx: int):
        self.ctx, self.backend = ctx, backend
        self.name = f"stressrec{idx}-{backend}"
        self.desc = f"RecordFile({self.name!r}, backend={backend!r})"
        self.log = None
        self.records: list[tuple] = []
        self.raw = 0

    def create(self, rng) -> None:
        comp: Any = [None, None, "zstd", "blosc", "zlib"][int(rng.integers(5))]
        if comp == "zlib":                     # a numcodecs codec object, not a name
            import numcodecs
            comp = numcodecs.Zlib(level=1)
        page = int(rng.choice([MiB, MiB, 2 * MiB, 4 * MiB]))
        depth = int(rng.integers(0, 4))
        self.desc = (f"RecordFile({self.name!r}, backend={self.backend!r}, page_size={page}, "
                     f"compressor={comp!r}, depth={depth})")
        self.ctx.step(f"{self.desc} create")
        self.log = self.ctx.cio.RecordFile(self.name, "w+", page_size=page, compressor=comp,
                                           depth=depth, backend=self.backend)
        self.records, self.raw = [], 0

    def make_record(self, rng) -> tuple:
        arrs = []
        for _ in range(int(rng.integers(1, 5))):
            dt = np.dtype(REC_DTYPES[int(rng.integers(len(REC_DTYPES)))])
            nb = nbytes_draw(rng, cap=(3 * MiB if rng.random() < 0.05 else 256 * KiB))
            n = nb // dt.itemsize
            nd = int(rng.integers(0, 4))
            if nd == 0:
                shape: tuple = ()
                n = 1
            elif nd == 1:
                shape = (n,)
            else:
                a = int(rng.integers(1, max(2, int(n ** 0.5) + 1)))
                shape = (a, n // a) if nd == 2 else (a, 1, n // a)
            n = math.prod(shape)
            s, raw = self.ctx.payload(n * dt.itemsize, rng)
            if dt.kind == "b":
                a = (raw & 1).view(bool).reshape(shape)
            else:
                a = raw.view(dt).reshape(shape)          # possibly unaligned view: fine
            if a.ndim == 2 and rng.random() < 0.2:
                a = a.T                                   # not C-contiguous
            arrs.append(a)
        return tuple(arrs)

    def append(self, rng) -> None:
        for _ in range(int(rng.integers(1, 12))):
            rec = self.make_record(rng)
            if self.raw > REC_MAX:
                return self.recreate(rng)
            self.ctx.step(f"{self.desc}.append({len(rec)} arrays, "
                          f"{sum(a.nbytes for a in rec)} B)")
            self.log.append(*rec)
            self.records.append(tuple(np.array(a, copy=True) for a in rec))
            self.raw += sum(a.nbytes for a in rec)
            self.ctx.t.op("rec.append", self.backend)
        if len(self.log) != len(self.records):
            self.ctx.t.error("rec.append", self, f"len() is {len(self.log)}, the model has "
                                                 f"{len(self.records)} records")
            raise Broken()

    def flush(self, rng) -> None:
        durable = bool(rng.random() < 0.3)
        self.ctx.step(f"{self.desc}.flush(durable={durable})")
        self.log.flush(durable=durable)
        self.ctx.t.op("rec.flush", self.backend)

    def replay(self, rng, stop: int | None = None, kind: str = "rec.replay") -> None:
        depth = int(rng.integers(0, 4))
        self.ctx.step(f"{self.desc}.replay(depth={depth}) of {len(self.records)} records"
                      + (f", stopping after {stop}" if stop is not None else ""))
        t = self.ctx.t
        rep = self.log.replay(depth=depth)
        i = 0
        try:
            for i_rec in rep:
                if stop is not None and i >= stop:
                    break
                if i >= len(self.records):
                    t.error(kind, self, f"replay yields more than the {len(self.records)} "
                                        f"records appended")
                    raise Broken()
                want = self.records[i]
                if len(i_rec) != len(want):
                    t.error(kind, self, f"record {i} has {len(i_rec)} arrays, the model "
                                        f"{len(want)}")
                    t.wrong += sum(a.nbytes for a in want)
                    raise Broken()
                ok = True
                for a, w in zip(i_rec, want):
                    ok &= t.compare(kind, self, a, w, f"record {i}")
                if not ok:
                    raise Broken()
                i += 1
        finally:
            rep.close()
        if stop is None and i != len(self.records):
            t.error(kind, self, f"replay ended after {i} of {len(self.records)} records")
            t.wrong += sum(a.nbytes for r in self.records[i:] for a in r)
            raise Broken()
        t.op(kind, self.backend)

    def replay_partial(self, rng) -> None:
        stop = int(rng.integers(0, len(self.records) + 1))
        self.replay(rng, stop=stop, kind="rec.replay_partial")
        if self.log.mode != "r" and rng.random() < 0.3:     # appending while a replay is open
            rep = self.log.replay(depth=1)
            try:
                self.ctx.step(f"{self.desc}.append during an open replay")
                try:
                    self.log.append(np.zeros(3))
                except self.ctx.cio.ChemIOError:
                    self.ctx.t.expected["append during replay"] += 1
                else:
                    self.records.append((np.zeros(3),))
                    self.ctx.t.error("rec.replay_partial", self, "append() while a replay was "
                                                                 "open did not raise")
                    raise Broken()
            finally:
                rep.close()

    def reopen(self, rng) -> None:
        self.ctx.step(f"{self.desc}.close()")
        self.log.close()
        t = self.ctx.t
        if rng.random() < 0.4:
            self.ctx.step(f"{self.desc} reopen 'r'")
            self.log = self.ctx.cio.RecordFile(self.name, "r", backend=self.backend,
                                               depth=int(rng.integers(0, 4)))
            self._check_len("rec.reopen")
            self.replay(rng, kind="rec.reopen")
            self.ctx.step(f"{self.desc}.append on a read-only file")
            try:
                self.log.append(np.zeros(1))
            except self.ctx.cio.ModeError:
                t.expected["ModeError"] += 1
            else:
                t.error("rec.reopen", self, "append on a mode 'r' RecordFile did not raise")
                raise Broken()
            self.log.close()
        self.ctx.step(f"{self.desc} reopen 'r+'")
        self.log = self.ctx.cio.RecordFile(self.name, "r+", backend=self.backend,
                                           depth=int(rng.integers(0, 4)))
        self._check_len("rec.reopen")
        if rng.random() < 0.5:
            self.replay(rng, kind="rec.reopen")
        else:
            t.op("rec.reopen", self.backend)

    def _check_len(self, kind: str) -> None:
        if len(self.log) != len(self.records):
            self.ctx.t.error(kind, self, f"reopened with {len(self.log)} records, the model has "
                                         f"{len(self.records)}")
            self.ctx.t.wrong += sum(a.nbytes for r in self.records[len(self.log):] for a in r)
            raise Broken()

    def recreate(self, rng) -> None:
        self.ctx.step(f"{self.desc}.delete()")
        self.log.delete()
        self.log = None
        self.create(rng)
        self.ctx.t.op("rec.recreate", self.backend)

    WEIGHTS = {"append": 24, "flush": 4, "replay": 3, "replay_partial": 2, "reopen": 2,
               "recreate": 1}

    def one_op(self, rng) -> None:
        kind = pick(rng, self.WEIGHTS, self.ctx.t.ops, "rec")
        getattr(self, kind)(rng)

    def finish(self) -> None:
        self.replay(self.ctx.mine)
        self.ctx.step(f"{self.desc}.delete()")
        self.log.delete()

    def abandon(self) -> None:
        try:
            if self.log is not None:
                self.log.delete()
        except Exception:
            pass
        self.log = None


# ====================================================================== SharedFile

class Sf:
    """A SharedFile on one backend and the model every rank keeps of it."""

    def __init__(self, ctx: Ctx, backend: str):
        self.ctx, self.backend = ctx, backend
        self.name = f"stresssf-{backend}"
        self.desc = f"SharedFile({self.name!r}, backend={backend!r})"
        self.sf = None
        self.model = np.zeros(SF_CAP, np.uint8)
        self.size = 0
        self.hard = None
        self.stable = 0            # the file is at least this long (async reads below it)
        self.flight = Flight()

    def create(self) -> None:
        rng = self.ctx.shared
        hard = soft = req = None
        if rng.random() < 0.25:
            hard = int(rng.integers(MiB, SF_SPAN_MAX))
        if rng.random() < 0.4:
            soft = int(rng.integers(0, 4 * MiB))
            if hard is not None:
                soft = min(soft, hard)
        if rng.random() < 0.4:
            req = int(rng.choice([4096, 32 * KiB, 1 << 20, 12345]))
        self.desc = (f"SharedFile({self.name!r}, backend={self.backend!r}, hard_limit={hard}, "
                     f"soft_limit={soft}, request_size={req})")
        self.ctx.step(f"{self.desc} create")
        self.sf = self.ctx.cio.SharedFile(self.name, hard_limit=hard, soft_limit=soft,
                                          request_size=req, backend=self.backend)
        self.hard = hard
        self.model[:] = 0
        self.size = 0
        self.ctx.t.op("sf.create", self.backend)

    def destroy(self) -> None:
        self.ctx.step(f"{self.desc}.destroy()")
        sf, self.sf = self.sf, None
        sf.destroy()
        self.ctx.t.op("sf.destroy", self.backend)

    def mwrite(self, off: int, data: np.ndarray) -> None:
        if data.size:
            self.model[off:off + data.size] = data
            self.size = max(self.size, off + data.size)

    def check_size(self, kind: str) -> None:
        got = self.sf.size
        if got != self.size:
            self.ctx.t.error(kind, self, f"size is {got} bytes on rank {self.ctx.rank}, the "
                                         f"model says {self.size}")
            raise Broken()

    def limited(self, off: int, n: int) -> bool:
        return self.hard is not None and off + n > self.hard

    def read_check(self, kind: str, off: int, buf: np.ndarray, eof: bool,
                   exc: BaseException | None) -> None:
        t = self.ctx.t
        if exc is not None:
            if eof and isinstance(exc, self.ctx.cio.EndOfFileError):
                t.expected["EndOfFileError"] += 1
                return
            t.exception(kind, self, exc)
            raise Broken()
        if eof:
            t.error(kind, self, f"read of {buf.size} B at {off} passed the end ({self.size} B) "
                                f"without EndOfFileError")
            raise Broken()
        if not t.compare(kind, self, buf, self.model[off:off + buf.size], f"read at {off}"):
            raise Broken()

    # ---------------------------------------------------------------- one round
    def settle(self) -> None:
        self.flight.settle(self.ctx)
        self.stable = self.size

    def local_phase(self, segs: list[tuple[int, int]]) -> list[tuple]:
        """Writes (and reads of its own data) in this rank's segments; returns descriptors."""
        rng = self.ctx.mine
        t = self.ctx.t
        descs: list[tuple] = []
        self.stable = self.size
        if not segs:
            return descs
        lens = np.array([b - a for a, b in segs], float)
        p = lens / lens.sum()

        def sub(n_cap: int = OP_MAX) -> tuple[int, int]:
            a, b = segs[int(rng.choice(len(segs), p=p))]
            n = min(nbytes_draw(rng, cap=n_cap), b - a)
            off = int(rng.integers(a, b - n + 1))
            return off, n

        for _ in range(int(rng.integers(3, 12))):
            kind = pick(rng, {"write": 4, "awrite": 4, "awrite_many": 2, "read": 2, "aread": 2},
                        t.ops, "sf")
            if kind in ("write", "awrite"):
                off, n = sub()
                if n == 0 and off > self.size:
                    continue
                if self.flight.clash(((off, off + n),), True):
                    self.settle()
                s, data = self.ctx.payload(n)
                self.ctx.step(f"{self.desc}.{kind}({off}, {n} B)")
                t.op(f"sf.{kind}", self.backend)
                if self.limited(off, n):
                    try:
                        (self.sf.write if kind == "write" else self.sf.awrite)(off, data)
                    except self.ctx.cio.LimitExceededError:
                        t.expected["LimitExceededError"] += 1
                        continue
                    t.error(f"sf.{kind}", self, f"{kind} ending at {off + n} past hard_limit "
                                                f"{self.hard} did not raise LimitExceededError")
                    raise Broken()
                if kind == "write":
                    self.sf.write(off, data)
                    self.stable = max(self.stable, off + n)
                else:
                    req = self.sf.awrite(off, data)
                    self.flight.add(req, ((off, off + n),), True, self._awrite_done(n))
                self.mwrite(off, data)
                descs.append((off, n, s))
            elif kind == "awrite_many":
                picks = []
                for _ in range(int(rng.integers(1, 9))):
                    off, n = sub(64 * KiB)
                    if n and not any(boxes_overlap(((off, off + n),), ((o, o + m),))
                                     for o, m, _ in picks) and not self.limited(off, n):
                        picks.append((off, n, self.ctx.payload(n)[0]))
                if not picks:
                    continue
                if any(self.flight.clash(((o, o + m),), True) for o, m, _ in picks):
                    self.settle()
                datas = [self.ctx.pool[s:s + m] for _, m, s in picks]
                self.ctx.step(f"{self.desc}.awrite_many({len(picks)} ranges)")
                t.op("sf.awrite_many", self.backend)
                req = self.sf.awrite_many([o for o, _, _ in picks], datas)
                total = sum(m for _, m, _ in picks)
                lo = min(o for o, _, _ in picks)
                hi = max(o + m for o, m, _ in picks)
                self.flight.add(req, ((lo, hi),), True, self._awrite_done(total, "sf.awrite_many"))
                for (o, m, s), d in zip(picks, datas):
                    self.mwrite(o, d)
                    descs.append((o, m, s))
            else:
                off, n = sub(256 * KiB)
                if self.flight.clash(((off, off + n),), False) or off + n > self.stable:
                    self.settle()
                if off + n > self.stable:        # other ranks may not have written up to here
                    continue
                buf = np.empty(n, np.uint8)
                self.ctx.step(f"{self.desc}.{kind}({off}, {n} B) of own data")
                t.op(f"sf.{kind}", self.backend)
                if kind == "read":
                    try:
                        self.sf.read(off, buf)
                        exc = None
                    except Exception as e:
                        exc = e
                    self.read_check("sf.read", off, buf, False, exc)
                else:
                    req = self.sf.aread(off, buf)
                    self.flight.add(req, ((off, off + n),), False,
                                    lambda v, e, off=off, buf=buf:
                                    self.read_check("sf.aread", off, buf, False, e))
        return descs

    def _awrite_done(self, n: int, kind: str = "sf.awrite"):
        def done(val, exc):
            if exc is not None:
                if not self.ctx.refused(exc, self.backend):
                    self.ctx.t.exception(kind, self, exc)
                raise Broken()
            if val != n:
                self.ctx.t.error(kind, self, f"wait() returned {val!r} for {n} bytes")
        return done

    def read_phase(self) -> None:
        """After the barrier: reads anywhere (other ranks' data, holes, past the end)."""
        rng = self.ctx.mine
        t = self.ctx.t
        for _ in range(int(rng.integers(2, 8))):
            kind = pick(rng, {"read_other": 3, "aread": 2, "aread_many": 2}, t.ops, "sf")
            if kind == "aread_many":
                ranges = []
                cur = int(rng.integers(0, max(1, self.size)))
                for _ in range(int(rng.integers(1, 17))):
                    n = max(1, nbytes_draw(rng, cap=128 * KiB))
                    off = cur + int(rng.integers(0, n + 1))
                    ranges.append((off, n))
                    cur = off + n
                rng.shuffle(ranges)
                eof = any(o + n > self.size for o, n in ranges)
                bufs = [np.empty(n, np.uint8) for _, n in ranges]
                self.ctx.step(f"{self.desc}.aread_many({len(ranges)} ranges)")
                t.op("sf.aread_many", self.backend)
                try:
                    self.sf.aread_many([o for o, _ in ranges], bufs).wait(timeout=self.ctx.hang)
                    exc = None
                except Exception as e:
                    exc = e
                if exc is not None:
                    if eof and isinstance(exc, self.ctx.cio.EndOfFileError):
                        t.expected["EndOfFileError"] += 1
                        continue
                    t.exception("sf.aread_many", self, exc)
                    raise Broken()
                if eof:
                    t.error("sf.aread_many", self, "ranges past the end read without "
                                                   "EndOfFileError")
                    raise Broken()
                for (o, n), b in zip(ranges, bufs):
                    if not t.compare("sf.aread_many", self, b, self.model[o:o + n], f"at {o}"):
                        raise Broken()
                continue
            n = nbytes_draw(rng)
            if rng.random() < 0.12:
                off = max(0, self.size - n + int(rng.integers(1, 64 * KiB)))
            else:
                n = min(n, self.size)
                off = int(rng.integers(0, self.size - n + 1))
            eof = off + n > self.size if n else off > self.size
            buf = np.empty(n, np.uint8)
            self.ctx.step(f"{self.desc}.{'read' if kind == 'read_other' else 'aread'}"
                          f"({off}, {n} B) after the barrier")
            t.op(f"sf.{kind}", self.backend)
            try:
                if kind == "read_other":
                    self.sf.read(off, buf)
                else:
                    self.sf.aread(off, buf).wait(timeout=self.ctx.hang)
                exc = None
            except Exception as e:
                exc = e
            self.read_check(f"sf.{kind}", off, buf, eof, exc)

    def verify(self) -> None:
        self.ctx.step(f"{self.desc} verify whole file ({self.size} B)")
        self.check_size("sf.verify")
        buf = np.empty(self.size, np.uint8)
        if self.size:
            self.sf.read(0, buf)
        if not self.ctx.t.compare("sf.verify", self, buf, self.model[:self.size], "whole file"):
            raise Broken()


def sf_round(ctx: Ctx, sfs: dict, backend: str) -> None:
    """One collective SharedFile round (every rank calls it with the same backend)."""
    rng = ctx.shared
    t = ctx.t
    obj: Sf = sfs[backend]
    recreate = rng.random() < 0.15 or ctx.plan["sf.destroy"] == 0
    recreate = recreate and obj.sf is not None
    fail = False
    if recreate:
        try:
            obj.destroy()
        except Exception as e:
            t.exception("sf.destroy", obj, e)
            fail = True
        ctx.plan["sf.destroy"] += 1
    if ctx.any_rank(fail):
        obj.sf = None
        return
    if obj.sf is None:
        try:
            obj.create()
        except Exception as e:
            if not ctx.refused(e, backend):
                t.exception("sf.create", obj, e)
            fail = True
        if ctx.any_rank(fail):
            if obj.sf is not None:
                try:
                    obj.sf.close()
                except Exception:
                    pass
            obj.sf = None
            return
    # random disjoint segments of [0, span), each owned by one rank
    span = int(rng.integers(64 * KiB, SF_SPAN_MAX))
    k = int(rng.integers(ctx.P, 6 * ctx.P + 1))
    cuts = np.unique(np.concatenate([[0, span], rng.integers(1, span, k - 1)]))
    owners = rng.integers(0, ctx.P, len(cuts) - 1)
    trunc = rng.random() < 0.12 or ctx.plan["sf.truncate"] == 0
    ctx.plan["sf.truncate"] += trunc
    trunc_rank = int(rng.integers(0, ctx.P))
    trunc_to = int(rng.integers(0, SF_CAP - MiB))
    mine = [(int(a), int(b)) for a, b, o in zip(cuts[:-1], cuts[1:], owners) if o == ctx.rank]
    descs: list = []
    broken = False
    try:
        descs = obj.local_phase(mine)
        obj.flight.settle(ctx, reads_only=True)
        ctx.step(f"{obj.desc}.flush() with {len(obj.flight)} writes in flight")
        try:
            obj.sf.flush()
        finally:
            obj.settle()
    except Broken:
        broken = True
    except Exception as e:
        if not ctx.refused(e, backend):
            t.exception("sf.write", obj, e)
        broken = True
    ctx.barrier()
    everyone = ctx.allgather(None if broken else descs)
    if any(d is None for d in everyone):
        broken = True
    else:
        for r, ds in enumerate(everyone):
            if r != ctx.rank:
                for off, n, s in ds:
                    obj.mwrite(off, ctx.pool[s:s + n])
    if not broken:
        try:
            obj.check_size("sf.read_other")
            obj.read_phase()
            if rng.random() < 0.2:
                obj.verify()
        except Broken:
            broken = True
        except Exception as e:
            t.exception("sf.read_other", obj, e)
            broken = True
    ctx.barrier()
    if trunc and not ctx.any_rank(broken):
        ok = True
        if ctx.rank == trunc_rank:
            ctx.step(f"{obj.desc}.truncate({trunc_to})")
            try:
                if obj.hard is not None and trunc_to > obj.hard:
                    try:
                        obj.sf.truncate(trunc_to)
                    except ctx.cio.LimitExceededError:
                        t.expected["LimitExceededError"] += 1
                    else:
                        t.error("sf.truncate", obj, "truncate past hard_limit did not raise")
                        ok = False
                else:
                    obj.sf.truncate(trunc_to)
                t.op("sf.truncate", obj.backend)
            except Exception as e:
                if not ctx.refused(e, backend):
                    t.exception("sf.truncate", obj, e)
                ok = False
        ctx.barrier()
        if not (obj.hard is not None and trunc_to > obj.hard):
            if trunc_to < obj.size:
                obj.model[trunc_to:obj.size] = 0
            obj.size = trunc_to
        broken = not ok
        if not broken:
            try:
                obj.check_size("sf.truncate")
            except Broken:
                broken = True
    if ctx.any_rank(broken):
        ctx.step(f"{obj.desc}: model lost on some rank, destroying")
        try:
            obj.destroy()
        except Exception as e:
            t.exception("sf.destroy", obj, e)
        obj.sf = None


# ====================================================================== DiskArray

class Dra:
    """The DiskArray of one backend and its model (a NumPy array every rank keeps)."""

    def __init__(self, ctx: Ctx, backend: str):
        self.ctx, self.backend = ctx, backend
        self.d = None
        self.model = None
        self.persistent = False
        self.path = None
        self.flight = Flight()
        self.desc = f"DiskArray(backend={backend!r})"
        self.serial = 0

    # ---------------------------------------------------------------- lifetime (collective)
    def create(self) -> None:
        rng = self.ctx.shared
        dt = np.dtype(DRA_DTYPES[int(rng.integers(len(DRA_DTYPES)))])
        ndim = int(rng.integers(1, 4))
        cap = DRA_MAX // dt.itemsize
        shape = []
        for ax in range(ndim):
            room = max(1, cap // max(1, math.prod(shape)))
            lim = max(1, int(room ** (1.0 / (ndim - ax))) * 2)
            shape.append(int(rng.integers(1, min(room, lim) + 1)))
        if rng.random() < 0.03:
            shape[int(rng.integers(ndim))] = 0
        shape_t = tuple(shape)
        r = rng.random()
        kw: dict = {}
        if r < 0.45:                    # at most 8 chunks per axis, sometimes odd sizes
            ch = tuple(max(1, -(-n // int(rng.integers(1, 9)))) if rng.random() < 0.7 else
                       int(rng.integers(max(1, n // 8), max(1, n) + 1)) for n in shape_t)
            kw["chunks"] = ch
        elif r < 0.7:
            kw["request_shape"] = tuple(None if rng.random() < 0.3 else
                                        int(rng.integers(1, max(1, n) + 1)) for n in shape_t)
        self.persistent = (self.ctx.plan["dra.create"] == 0 or rng.random() < 0.4)
        self.serial += 1
        name = f"stressdra-{self.backend}"
        if self.persistent:
            kw["path"] = self.ctx.keep_dir
            name = f"{name}-{self.serial}"
        self.ctx.plan["dra.create"] += 1
        self.desc = (f"DiskArray.create({name!r}, {shape_t}, {dt.str!r}, backend="
                     f"{self.backend!r}, {', '.join(f'{k}={v!r}' for k, v in kw.items())})")
        self.ctx.step(self.desc)
        self.d = self.ctx.cio.DiskArray.create(name, shape_t, dt, backend=self.backend, **kw)
        self.path = self.d.path
        self.model = np.zeros(shape_t, dt)
        self.ctx.t.op("dra.create", self.backend)

    def close(self) -> None:
        d, self.d = self.d, None
        self.ctx.step(f"{self.desc}.{'delete' if self.persistent else 'close'}()")
        if self.persistent:
            d.delete()
        else:
            d.close()
        self.ctx.t.op("dra.close", self.backend)

    def reopen(self) -> None:
        """Persistent arrays: close, open 'r' (check, refuse a write), close, open 'r+'."""
        cio = self.ctx.cio
        self.ctx.step(f"{self.desc}.close() before reopening")
        self.d.close()
        self.d = None
        if self.ctx.shared.random() < 0.5:
            self.ctx.step(f"DiskArray.open({self.path!r}, 'r')")
            self.d = cio.DiskArray.open(self.path, "r")
            self.verify("dra.reopen")
            if self.model.size:
                self.ctx.step(f"{self.desc}: write to a read-only array")
                try:
                    self.d[(0,) * self.model.ndim] = self.model[(0,) * self.model.ndim]
                except cio.ModeError:
                    self.ctx.t.expected["ModeError"] += 1
                else:
                    self.ctx.t.error("dra.reopen", self, "write to a mode 'r' DiskArray did "
                                                         "not raise ModeError")
                    raise Broken()
            self.ctx.step(f"{self.desc}.close() of the read-only handle")
            self.d.close()
            self.d = None
        self.ctx.step(f"DiskArray.open({self.path!r}, 'r+')")
        self.d = cio.DiskArray.open(self.path, "r+")
        if self.d.shape != self.model.shape or self.d.dtype != self.model.dtype:
            self.ctx.t.error("dra.reopen", self, f"reopened as {self.d.dtype}{self.d.shape}, "
                                                 f"created as {self.model.dtype}"
                                                 f"{self.model.shape}")
            raise Broken()
        self.verify("dra.reopen")
        self.ctx.t.op("dra.reopen", self.backend)

    def verify(self, kind: str = "dra.verify") -> None:
        self.ctx.step(f"{self.desc} read whole array")
        got = self.d.read(())
        if not self.ctx.t.compare(kind, self, got, self.model, "whole array"):
            raise Broken()

    # ---------------------------------------------------------------- sections
    def section(self, rng, rows: tuple[int, int], *, ints: bool = True,
                empty_ok: bool = True) -> tuple[tuple, tuple]:
        """(key, box) inside ``rows`` of axis 0 and anywhere on the other axes."""
        key, box = [], []
        chunks = self.d.chunks
        for ax, n in enumerate(self.model.shape):
            a, b = rows if ax == 0 else (0, n)
            if b <= a:
                key.append(slice(a, a))
                box.append((a, a))
                continue
            r = rng.random()
            if ints and r < 0.08:
                i = int(rng.integers(a, b))
                key.append(i - n if rng.random() < 0.3 else i)
                box.append((i, i + 1))
                continue
            if r < 0.35:                                  # chunk-aligned bounds
                c = chunks[ax]
                cands = sorted({a, b, *range(-(-a // c) * c, b, c)})
                i, j = sorted(rng.choice(len(cands), 2, replace=len(cands) < 2))
                lo, hi = cands[i], cands[j]
                if lo == hi and not empty_ok:
                    lo, hi = a, b
            else:
                lo = int(rng.integers(a, b))
                hi = int(rng.integers(lo + 1, b + 1))
                if empty_ok and rng.random() < 0.03:
                    hi = lo
            box.append((lo, hi))
            if rng.random() < 0.15 and lo > 0:            # negative bounds
                key.append(slice(lo - n, hi - n if hi < n else None))
            else:
                key.append(slice(lo, hi))
        return tuple(key), tuple(box)

    def data_for(self, key: tuple, transpose: bool, s: int | None) -> tuple[np.ndarray, int]:
        shape = self.model[key].shape
        dshape = shape[::-1] if transpose else shape
        pool = self.ctx.dpool(self.model.dtype)
        n = math.prod(dshape)
        if s is None:
            s = int(self.ctx.mine.integers(0, pool.size - n + 1))
        return pool[s:s + n].reshape(dshape), s

    def apply(self, key: tuple, transpose: bool, s: int, scalar: bool) -> None:
        if scalar:
            self.model[key] = self.ctx.dpool(self.model.dtype)[s]
        else:
            data, _ = self.data_for(key, transpose, s)
            self.model[key] = data.T if transpose else data

    def check(self, kind: str, key: tuple, got: np.ndarray, transpose: bool) -> None:
        want = self.model[key]
        if transpose:
            want = want.T
        if not self.ctx.t.compare(kind, self, got, np.asarray(want), f"section {key!r}"):
            raise Broken()

    # ---------------------------------------------------------------- one round
    def local_phase(self, rows: tuple[int, int]) -> list[tuple]:
        rng = self.ctx.mine
        t = self.ctx.t
        d = self.d
        descs: list[tuple] = []
        for _ in range(int(rng.integers(3, 10))):
            kind = pick(rng, {"write": 4, "awrite": 3, "setitem": 2, "read": 3, "aread": 2,
                              "bad_section": 0.3}, t.ops, "dra")
            if kind == "bad_section":
                self._bad_section(rng)
                continue
            key, box = self.section(rng, rows)
            plain = all(isinstance(k, slice) for k in key)
            transpose = plain and kind != "setitem" and rng.random() < 0.25
            if kind in ("write", "awrite", "setitem"):
                if self.flight.clash(box, True):
                    self.flight.settle(self.ctx)
                scalar = kind == "setitem" and rng.random() < 0.5
                if scalar:
                    s = int(rng.integers(0, self.ctx.dpool(self.model.dtype).size))
                    val = self.ctx.dpool(self.model.dtype)[s]
                    self.ctx.step(f"{self.desc}[{key!r}] = scalar")
                    d[key] = val
                else:
                    data, s = self.data_for(key, transpose, None)
                    if kind == "setitem":
                        self.ctx.step(f"{self.desc}[{key!r}] = array{data.shape}")
                        d[key] = data
                    elif kind == "write":
                        self.ctx.step(f"{self.desc}.write({key!r}, transpose={transpose})")
                        d.write(key, data, transpose=transpose)
                    else:
                        self.ctx.step(f"{self.desc}.awrite({key!r}, transpose={transpose})")
                        req = d.awrite(key, data, transpose=transpose)
                        self.flight.add(req, box, True, self._awrite_done())
                self.apply(key, transpose, s, scalar)
                descs.append((key, transpose, s, scalar))
                t.op(f"dra.{kind}", self.backend)
            else:
                if self.flight.clash(box, False):
                    self.flight.settle(self.ctx)
                shape = self.model[key].shape
                oshape = shape[::-1] if transpose else shape
                out = np.empty(oshape, self.model.dtype) if rng.random() < 0.6 else None
                self.ctx.step(f"{self.desc}.{kind}({key!r}, transpose={transpose})")
                t.op(f"dra.{kind}", self.backend)
                if kind == "read":
                    got = d.read(key, out, transpose=transpose)
                    if out is not None and got is not out:
                        t.error("dra.read", self, "read() did not return `out`")
                    self.check("dra.read", key, got, transpose)
                else:
                    req = d.aread(key, out, transpose=transpose)
                    self.flight.add(req, box, False, self._aread_done(key, transpose))
            if rng.random() < 0.3:
                self.flight.settle(self.ctx)
        self.flight.settle(self.ctx)
        return descs

    def _awrite_done(self):
        def done(val, exc):
            if exc is not None:
                self.ctx.t.exception("dra.awrite", self, exc)
                raise Broken()
        return done

    def _aread_done(self, key, transpose):
        def done(val, exc):
            if exc is not None:
                self.ctx.t.exception("dra.aread", self, exc)
                raise Broken()
            self.check("dra.aread", key, val, transpose)
        return done

    def _bad_section(self, rng) -> None:
        shape = self.model.shape
        ax = int(rng.integers(len(shape)))
        key = [slice(None)] * len(shape)
        key[ax] = slice(0, shape[ax] + int(rng.integers(1, 5)))
        key = tuple(key)
        self.ctx.step(f"{self.desc} section {key!r} outside the shape")
        cio = self.ctx.cio
        for call in (lambda: self.d.read(key), lambda: self.d.write(key, np.zeros(1))):
            try:
                call()
            except cio.SectionError:
                self.ctx.t.expected["SectionError"] += 1
            else:
                self.ctx.t.error("dra.bad_section", self, f"section {key!r} of shape {shape} "
                                                          f"did not raise SectionError")
                raise Broken()
        self.ctx.t.op("dra.bad_section", self.backend)

    def read_phase(self) -> None:
        rng = self.ctx.mine
        for _ in range(int(rng.integers(1, 5))):
            key, box = self.section(rng, (0, self.model.shape[0]))
            transpose = all(isinstance(k, slice) for k in key) and rng.random() < 0.2
            self.ctx.step(f"{self.desc}.read({key!r}) of any rank's rows")
            got = self.d.read(key, transpose=transpose)
            self.ctx.t.op("dra.read_other", self.backend)
            self.check("dra.read_other", key, got, transpose)


def dra_round(ctx: Ctx, dras: dict, backend: str) -> None:
    """One collective DiskArray round (every rank calls it with the same backend)."""
    rng = ctx.shared
    t = ctx.t
    obj: Dra = dras[backend]
    fail = False
    action = rng.random()
    if obj.d is not None and (action < 0.2 or (ctx.plan["dra.close"] == 0
                                               and ctx.plan["dra.reopen"] > 0)):
        ctx.plan["dra.close"] += 1
        try:
            obj.close()
        except Exception as e:
            t.exception("dra.close", obj, e)
            fail = True
        if ctx.any_rank(fail):
            obj.d = None
            return
    elif obj.d is not None and obj.persistent and (action < 0.35 or ctx.plan["dra.reopen"] == 0):
        ctx.plan["dra.reopen"] += 1
        try:
            obj.reopen()
        except Broken:
            fail = True
        except Exception as e:
            t.exception("dra.reopen", obj, e)
            fail = True
        if ctx.any_rank(fail):
            _drop_dra(ctx, obj)
            return
    if obj.d is None:
        try:
            obj.create()
            if rng.random() < 0.3:
                obj.verify("dra.create")     # never-written elements read as zero
        except Broken:
            fail = True
        except Exception as e:
            t.exception("dra.create", obj, e)
            fail = True
        if ctx.any_rank(fail):
            _drop_dra(ctx, obj)
            return
    shape = obj.model.shape
    # rows of axis 0 per rank: chunk-aligned (one writer per chunk), or any rows (the
    # stores here are byte-addressable: disjoint regions inside a chunk are safe)
    n0, c0 = shape[0], obj.d.chunks[0]
    if rng.random() < 0.75:
        nch = -(-n0 // c0)
        cuts = np.sort(rng.integers(0, nch + 1, ctx.P - 1)) * c0
    else:
        cuts = np.sort(rng.integers(0, n0 + 1, ctx.P - 1))
    cuts = np.minimum(np.concatenate([[0], cuts, [n0]]), n0)
    rows = (int(cuts[ctx.rank]), int(cuts[ctx.rank + 1]))
    do_all = rng.random() < 0.6 or ctx.plan["dra.write_all"] == 0
    ctx.plan["dra.write_all"] += do_all
    broken = False
    descs: list = []
    try:
        descs = obj.local_phase(rows)
        ctx.step(f"{obj.desc}.flush()")
        obj.d.flush()
    except Broken:
        broken = True
    except Exception as e:
        t.exception("dra.write", obj, e)
        broken = True
    obj.flight.items = [] if broken else obj.flight.items
    ctx.barrier()
    everyone = ctx.allgather(None if broken else descs)
    if any(x is None for x in everyone):
        broken = True
    else:
        for r, ds in enumerate(everyone):
            if r != ctx.rank:
                for key, tr, s, sc in ds:
                    obj.apply(key, tr, s, sc)
    if ctx.any_rank(broken):
        _drop_dra(ctx, obj)
        return
    try:
        obj.read_phase()
    except Broken:
        broken = True
    except Exception as e:
        t.exception("dra.read_other", obj, e)
        broken = True
    ctx.barrier()
    if do_all and not ctx.any_rank(broken):
        wkey, _ = obj.section(ctx.mine, rows, ints=False)
        wtr = ctx.mine.random() < 0.2
        data, s = obj.data_for(wkey, wtr, None)
        ctx.step(f"{obj.desc}.write_all({wkey!r}, transpose={wtr})")
        try:
            obj.d.write_all(wkey, data, transpose=wtr)
            t.op("dra.write_all", obj.backend)
            ok = True
        except Exception as e:
            t.exception("dra.write_all", obj, e)
            ok = False
        everyone = ctx.allgather((wkey, wtr, s) if ok else None)
        if any(x is None for x in everyone):
            broken = True
        else:
            for key, tr, s in everyone:
                obj.apply(key, tr, s, False)
            rkey, _ = obj.section(ctx.mine, (0, shape[0]), ints=False)
            rtr = ctx.mine.random() < 0.2
            rshape = obj.model[rkey].shape
            out = np.empty(rshape[::-1] if rtr else rshape, obj.model.dtype)
            ctx.step(f"{obj.desc}.read_all({rkey!r}, transpose={rtr})")
            try:
                got = obj.d.read_all(rkey, out, transpose=rtr)
                t.op("dra.read_all", obj.backend)
                obj.check("dra.read_all", rkey, got, rtr)
            except Broken:
                broken = True
            except Exception as e:
                t.exception("dra.read_all", obj, e)
                broken = True
    if ctx.any_rank(broken):
        _drop_dra(ctx, obj)


def _drop_dra(ctx: Ctx, obj: Dra) -> None:
    """Every rank: forget a DiskArray whose model is no longer trusted (collective delete)."""
    obj.flight.items = []
    if ctx.any_rank(obj.d is None):
        obj.d = None                  # ranks disagree on whether it exists: no collectives
        return
    ctx.step(f"{obj.desc}: model lost on some rank, deleting")
    try:
        obj.d.delete()
    except Exception as e:
        ctx.t.exception("dra.close", obj, e)
    obj.d = None


# ====================================================================== the worker

def _independent(ctx: Ctx, eafs: list, recs: list) -> None:
    rng = ctx.mine
    objs = eafs + recs
    for _ in range(int(rng.integers(8, 30))):
        obj = objs[int(rng.integers(len(objs)))]
        try:
            if isinstance(obj, Eaf):
                if obj.f is None:
                    obj.open("w+")
                obj.one_op(rng)
            else:
                if obj.log is None:
                    obj.create(rng)
                obj.one_op(rng)
        except Broken:
            obj.abandon()
        except Exception as e:
            ctx.t.exception("eaf" if isinstance(obj, Eaf) else "rec", obj, e)
            obj.abandon()


def _inject(ctx: Ctx, what: str) -> None:
    """Fault injection, to prove that the checks catch what they should (tests only).

    ``corrupt``: every 7th blocking ``write`` of a byte file or DiskArray stores one flipped
    byte (the caller's buffer is left alone). ``hang``: the 40th blocking byte-file ``read``
    never returns."""
    from chemio_py.files import bytefile
    cls = bytefile.ByteFile
    calls = Counter()
    if what == "corrupt":
        w0, dw0 = cls.write, ctx.cio.DiskArray.write

        def write(self, offset, data):
            calls["w"] += 1
            b = bytearray(memoryview(data).cast("B"))
            if calls["w"] % 7 == 0 and b:
                b[len(b) // 2] ^= 0x5A
                data = b
            return w0(self, offset, data)

        def dwrite(self, section, data, *, transpose=False):
            calls["d"] += 1
            a = np.array(data, copy=True)
            if calls["d"] % 7 == 0 and a.nbytes:
                a.reshape(-1).view(np.uint8)[a.nbytes // 2] ^= 0x5A
            return dw0(self, section, a, transpose=transpose)
        cls.write, ctx.cio.DiskArray.write = write, dwrite
    elif what == "hang":
        r0 = cls.read

        def read(self, offset, out):
            calls["r"] += 1
            if calls["r"] == 40:
                time.sleep(1e6)
            return r0(self, offset, out)
        cls.read = read
    elif what:
        raise ValueError(f"unknown fault to inject: {what!r}")


def _dump(ctx: Ctx, elapsed: float, final: bool) -> None:
    """Write this rank's tally (``.partial`` during the run: what the launcher reports if
    the process dies)."""
    res = ctx.t.as_dict()
    res["seconds"] = elapsed
    from chemio_py.backends import auto
    res["spills"] = len(auto.spills())
    out = os.path.join(ctx.run_dir, f"result.{ctx.rank}.json" + ("" if final else ".partial"))
    with open(out + ".tmp", "w") as fh:
        json.dump(res, fh)
    os.replace(out + ".tmp", out)


def _verify_and_end(t: Any, ctx: Any, obj: Any, attr: str, kind: str, end: str) -> None:
    """Verify a collective object against its model, then end it (``destroy``/``close``)
    on every rank together; errors are recorded, never raised."""
    if getattr(obj, attr) is not None:
        try:
            obj.verify()
        except Broken:
            pass
        except Exception as e:
            t.exception(f"{kind}.verify", obj, e)
    open_here = getattr(obj, attr) is not None             # verify may have dropped it
    if ctx.any_rank(open_here) and not ctx.any_rank(not open_here):
        try:
            getattr(obj, end)()
        except Exception as e:
            t.exception(f"{kind}.{end}", obj, e)
    setattr(obj, attr, None)


def worker(cfg: dict) -> int:
    ctx = Ctx(cfg)
    t = ctx.t
    _inject(ctx, cfg.get("inject") or "")
    bes = ctx.backends
    ram = "shm" if "shm" in bes else "auto"
    eafs = [Eaf(ctx, "local", False, 0), Eaf(ctx, "local", True, 1),
            Eaf(ctx, ram, False, 2), Eaf(ctx, "auto", False, 3)]
    recs = [Rec(ctx, be, i) for i, be in enumerate((*bes, "auto")[:3])]
    sfs = {be: Sf(ctx, be) for be in bes}
    dras = {be: Dra(ctx, be) for be in bes}
    ctx.barrier()
    t0 = time.monotonic()
    deadline = t0 + float(cfg["seconds"])
    longest = 0.3                      # seconds of the longest recent round
    dumped = t0
    while True:
        r0 = time.monotonic()
        go = ctx.c.bcast(r0 + 1.5 * longest < deadline if ctx.rank == 0 else None) \
            if ctx.P > 1 else r0 + 1.5 * longest < deadline
        if not go:
            break
        t.round += 1
        _independent(ctx, eafs, recs)
        # the collective phase: SF or DRA on the backend least used so far
        kind = "sf" if ctx.plan["sf"] <= ctx.plan["dra"] else "dra"
        if ctx.shared.random() < 0.3:
            kind = "dra" if kind == "sf" else "sf"
        ctx.plan[kind] += 1
        least = min(ctx.plan[f"{kind}:{be}"] for be in bes)
        cands = [be for be in bes if ctx.plan[f"{kind}:{be}"] == least]
        be = cands[int(ctx.shared.integers(len(cands)))]
        ctx.plan[f"{kind}:{be}"] += 1
        try:
            (sf_round if kind == "sf" else dra_round)(ctx, sfs if kind == "sf" else dras, be)
        except Exception as e:          # a bug of this script, or of a collective call
            t.exception(kind, kind, e)
        ctx.barrier()
        longest = max(0.8 * longest, time.monotonic() - r0)
        if time.monotonic() - dumped > 2.0:
            _dump(ctx, time.monotonic() - t0, final=False)
            dumped = time.monotonic()
    # the end: verify everything once more, then remove it
    elapsed = time.monotonic() - t0
    for obj in eafs + recs:
        try:
            if (obj.f if isinstance(obj, Eaf) else obj.log) is not None:
                obj.finish()
        except Broken:
            obj.abandon()
        except Exception as e:
            t.exception("eaf.verify" if isinstance(obj, Eaf) else "rec.replay", obj, e)
            obj.abandon()
    for kind, objs, attr, end in (("sf", sfs, "sf", "destroy"), ("dra", dras, "d", "close")):
        for obj in objs.values():
            _verify_and_end(t, ctx, obj, attr, kind, end)
    _dump(ctx, elapsed, final=True)
    ctx.barrier()
    ctx.close()
    return 0


# ====================================================================== launcher side

def _mpiexec() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else (shutil.which("mpiexec") or "mpiexec")


def _child_env(scratch: str, shm: str, home: str, shm_limit: str | None = None) -> dict:
    env = dict(os.environ)
    for var in list(env):
        if var.startswith(("CHEMIO_", "PMI_", "PMIX_", "OMPI_", "MPIR_", "HYDRA_")):
            del env[var]
    env.update(CHEMIO_SCRATCH=scratch, CHEMIO_SHARED_SCRATCH=scratch, CHEMIO_SHM_DIR=shm,
               XDG_CONFIG_HOME=home)
    if shm_limit:
        env["CHEMIO_SHM_LIMIT"] = shm_limit
    src = os.path.dirname(HERE)          # a source checkout: make sure it is importable
    if os.path.isfile(os.path.join(src, "chemio_py", "__init__.py")):
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)         # stragglers of the group
    except ProcessLookupError:
        pass


MPICH_SHM = "/dev/shm/mpich_shm_*"


def _in_use(paths: set[str]) -> set[str]:
    """Those of ``paths`` that a live process has mapped or open (from /proc)."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", errors="replace") as fh:
                text = fh.read()
            used |= {p for p in paths if p in text}
            fds = f"/proc/{pid}/fd"
            for fd in os.listdir(fds):
                try:
                    target = os.readlink(os.path.join(fds, fd))
                except OSError:
                    continue
                if target in paths:
                    used.add(target)
        except OSError:
            continue
    return used


def _drop_mpich_segments(before: set[str]) -> list[str]:
    """Remove the MPICH shared-memory segments that appeared during the run and that no live
    process uses (left by ranks that were killed or died)."""
    import glob
    new = set(glob.glob(MPICH_SHM)) - before
    if not new:
        return []
    gone = sorted(new - _in_use(new))
    for p in gone:
        try:
            os.unlink(p)
        except OSError:
            pass
    return gone


def _leftovers(*dirs: str) -> list[str]:
    out = []
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(d):
            out += [os.path.join(dirpath, n) for n in filenames + dirnames]
    return out


def stress(procs: int, seconds: float, seed: int, workdir: str, *,
           hang: float = HANG_TIMEOUT, inject: str | None = None,
           shm_limit: str | None = None) -> dict:
    """One stress run with ``procs`` processes; returns the summary (see ``report``)."""
    run = os.path.join(workdir, f"stress-p{procs}")
    shutil.rmtree(run, ignore_errors=True)
    scratch = os.path.join(run, "scratch")
    keep = os.path.join(run, "keep")
    for d in (run, scratch, keep):
        os.makedirs(d, mode=0o700, exist_ok=True)
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else run
    shm = tempfile.mkdtemp(prefix="cio-stress-", dir=shm_parent)
    cfg = {"seconds": seconds, "seed": seed, "hang": hang, "run": run, "keep": keep,
           "inject": inject, "shm_limit": shm_limit}
    me = os.path.abspath(__file__)
    if procs == 1:
        cmd = [sys.executable, me, "--worker", json.dumps(cfg)]
    else:
        cmd = [_mpiexec(), "-n", str(procs), sys.executable, "-m", "mpi4py", me,
               "--worker", json.dumps(cfg)]
    limit = seconds + hang + KILL_MARGIN
    summary: dict[str, Any] = {"procs": procs, "seed": seed, "seconds_asked": seconds,
                               "replay": f"python {os.path.relpath(me)} --procs {procs} "
                                         f"--seconds {seconds:g} --seed {seed}"
                                         + (f" --shm-limit {shm_limit}" if shm_limit else "")}
    problems: list[dict] = []
    import glob
    mpich_before = set(glob.glob(MPICH_SHM))
    t0 = time.monotonic()
    try:
        with open(os.path.join(run, "stdout.txt"), "w") as out, \
                open(os.path.join(run, "stderr.txt"), "w") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=run,
                                    env=_child_env(scratch, shm, run, shm_limit),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                killed = False
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc, killed = proc.returncode, True
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        summary["wall_seconds"] = time.monotonic() - t0
        summary["exit_status"] = rc
        results, partial = [], 0
        for r in range(procs):
            p = os.path.join(run, f"result.{r}.json")
            if not os.path.exists(p) and os.path.exists(p + ".partial"):
                p += ".partial"              # the process died: what it did until then
                partial += 1
            if os.path.exists(p):
                with open(p) as fh:
                    results.append(json.load(fh))
        if killed or rc != 0 or len(results) != procs or partial:
            what = (f"killed after {limit:.0f} s (a hang)" if killed else
                    f"exited with status {rc}")
            if partial or len(results) != procs:
                what += (f"; {procs - len(results) + partial} of {procs} processes did not "
                         f"finish (their counts below stop at their last round)")
            detail = []
            for r in range(procs):
                for fname, label in ((f"status.{r}", "last operation"),
                                     (f"stack.{r}", "stack dump (faulthandler)")):
                    p = os.path.join(run, fname)
                    if os.path.exists(p):
                        with open(p, errors="replace") as fh:
                            text = fh.read().strip()
                        if text:
                            detail.append(f"rank {r} {label}: {text[-4000:]}")
            for fname in ("stdout.txt", "stderr.txt"):
                with open(os.path.join(run, fname), errors="replace") as fh:
                    text = fh.read().strip()
                if text:
                    detail.append(f"{fname}: {text[-4000:]}")
            problems.append({"rank": None, "kind": "run", "message":
                             f"the stress processes {what}", "traceback": "\n".join(detail),
                             "replay": summary["replay"]})
        elif _leftovers(scratch, shm, keep):
            left = _leftovers(scratch, shm, keep)
            problems.append({"rank": None, "kind": "cleanup", "message":
                             f"{len(left)} files or directories left after every process "
                             f"ended normally: {left[:8]}", "traceback": "",
                             "replay": summary["replay"]})
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
        if procs > 1:
            summary["mpich_segments_removed"] = _drop_mpich_segments(mpich_before)
    ops, by_backend, expected = Counter(), Counter(), Counter()
    verified = wrong = nerr = rounds = spills = 0
    errors = []
    for res in results:
        ops.update(res["ops"])
        by_backend.update(res["by_backend"])
        expected.update(res["expected"])
        verified += res["verified"]
        wrong += res["wrong"]
        nerr += res["nerrors"]
        rounds = max(rounds, res["rounds"])
        spills += res.get("spills", 0)
        errors += res["errors"]
    summary.update(ops=dict(sorted(ops.items())), by_backend=dict(by_backend),
                   expected_errors=dict(expected), bytes_verified=verified,
                   lost_or_wrong_bytes=wrong, errors=nerr + len(problems),
                   error_details=problems + errors, rounds=rounds, spills=spills,
                   shm_limit=shm_limit,
                   missing_kinds=[k for k in REQUIRED_KINDS if not ops.get(k)])
    summary["clean"] = wrong == 0 and summary["errors"] == 0
    return summary


def report(s: dict) -> str:
    """The human summary of one run."""
    lines = [f"bench_stress P={s['procs']} seed={s['seed']} "
             f"({s.get('wall_seconds', 0):.1f} s wall for --seconds {s['seconds_asked']:g}, "
             f"{s['rounds']} rounds; replay: {s['replay']})"]
    ops = s["ops"]
    lines.append(f"  operations: {sum(ops.values())}")
    groups: dict[str, list] = {}
    for k, v in ops.items():
        groups.setdefault(k.split(".")[0], []).append(f"{k.split('.', 1)[1]} {v}")
    for g, items in groups.items():
        lines.append(f"    {g:4s} " + ", ".join(items))
    lines.append("  by backend: " + ", ".join(f"{k} {v}" for k, v in
                                                sorted(s["by_backend"].items())))
    if s.get("shm_limit"):
        lines.append(f"  RAM budget CHEMIO_SHM_LIMIT={s['shm_limit']}: {s['spills']} spills of "
                     f"auto files to disk")
    lines.append(f"  bytes verified: {s['bytes_verified']} "
                 f"({s['bytes_verified'] / GiB:.2f} GiB)")
    lines.append("  expected errors checked: " + (", ".join(
        f"{k} {v}" for k, v in sorted(s["expected_errors"].items())) or "none"))
    if s["missing_kinds"]:
        lines.append("  kinds that never ran: " + ", ".join(s["missing_kinds"]))
    lines.append(f"  errors: {s['errors']}")
    for e in s["error_details"][:10]:
        where = f"rank {e['rank']} round {e.get('round')} op {e.get('op')}" \
            if e.get("rank") is not None else "launcher"
        lines.append(f"    [{where}] {e['kind']} on {e.get('object', '-')}: {e['message']}")
        if e.get("doing"):
            lines.append(f"      while: {e['doing']}")
        lines.append(f"      replay: {e['replay']}")
        if e.get("traceback"):
            lines += ["      " + ln for ln in e["traceback"].strip().splitlines()[-25:]]
    lines.append(f"  lost or wrong bytes: {s['lost_or_wrong_bytes']}")
    return "\n".join(lines)


class StressFailure(RuntimeError):
    """A stress run lost or corrupted bytes, or hit an error (the message is the report)."""


def _rows(s: dict) -> list[dict]:
    p = f"P={s['procs']}"
    detail = {k: s[k] for k in ("seed", "ops", "by_backend", "expected_errors", "rounds",
                                "wall_seconds", "missing_kinds", "replay")}
    first = row(f"{p}: operations", "ops", sum(s["ops"].values()),
                note=f"seed {s['seed']}, {s['seconds_asked']:g} s, {s['rounds']} rounds; "
                     f"{len(s['ops'])} kinds of operation on {', '.join(sorted(s['by_backend']))}")
    first["detail"] = detail
    return [first,
            row(f"{p}: bytes verified", "bytes", s["bytes_verified"],
                note="bytes read back and compared with the model"),
            row(f"{p}: errors", "count", s["errors"],
                note="unexpected exceptions, hangs, leftovers"),
            row(f"{p}: lost or wrong bytes", "bytes", s["lost_or_wrong_bytes"], note="must be 0"),
            row(f"{p}: clean", "ok", 1.0 if s["clean"] else 0.0, "required", 1.0, target=1.0,
                note="0 lost or wrong bytes and 0 errors")]


def _procs_list(procs: Any) -> tuple[int, ...]:
    if isinstance(procs, int):
        procs = (procs,)
    elif isinstance(procs, str):
        procs = tuple(int(x) for x in procs.replace(",", " ").split())
    out = tuple(int(p) for p in procs)
    if not out or any(p < 1 for p in out):
        raise ValueError(f"procs must be positive process counts, got {procs!r}")
    return out


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def run(quick: bool, workdir: str, seconds: float | None = None, procs: Any = None,
        seed: int | None = None) -> list[dict]:
    """Runner entry: P = 1..4 (quick: 1, 2) for ``seconds`` each; raises if not clean."""
    secs = float(seconds if seconds is not None else (QUICK_SECONDS if quick else SECONDS))
    plist = _procs_list(procs if procs is not None else (QUICK_PROCS if quick else FULL_PROCS))
    seed = new_seed() if seed is None else int(seed)
    print(f"bench_stress: seed {seed}, P = {', '.join(map(str, plist))}, {secs:g} s each",
          flush=True)
    rows, bad = [], []
    for p in plist:
        s = stress(p, secs, seed, workdir)
        text = report(s)
        print(text, flush=True)
        rows += _rows(s)
        if not s["clean"]:
            bad.append(text)
    if bad:
        raise StressFailure("stress run not clean:\n" + "\n\n".join(bad))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="chemio_py stress run (see the module docstring)")
    p.add_argument("--seconds", type=float, default=SECONDS, help="per process count (60)")
    p.add_argument("--procs", default="4", help="process counts, e.g. 4 or 1,2,3,4 (4)")
    p.add_argument("--seed", type=int, default=None, help="replay a run (default: random)")
    p.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT,
                   help="seconds one operation may take before it counts as a hang (120)")
    p.add_argument("--workdir", default=None, help="where the work directory goes "
                                                   "(default: CHEMIO_SCRATCH or /tmp)")
    p.add_argument("--json", default=None, help="also write the summaries here")
    p.add_argument("--shm-limit", default=None, metavar="SIZE",
                   help="RAM budget (CHEMIO_SHM_LIMIT, e.g. 64M): auto files spill to disk; "
                        "backends local and auto only")
    p.add_argument("--inject", choices=("corrupt", "hang"), default=None,
                   help="inject a fault to check the checker (tests only)")
    args = p.parse_args(argv)
    from common import scratch_base
    seed = new_seed() if args.seed is None else args.seed
    plist = _procs_list(args.procs)
    print(f"bench_stress: seed {seed}, P = {', '.join(map(str, plist))}, "
          f"{args.seconds:g} s each", flush=True)
    summaries = []
    with tempfile.TemporaryDirectory(prefix="chemio-stress-",
                                     dir=args.workdir or scratch_base()) as work:
        for procs in plist:
            s = stress(procs, args.seconds, seed, work, hang=args.hang_timeout,
                       inject=args.inject, shm_limit=args.shm_limit)
            summaries.append(s)
            print(report(s), flush=True)
            for r in _rows(s):
                print(json.dumps({k: v for k, v in r.items() if k != "detail"}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summaries, fh, indent=1)
    return 0 if all(s["clean"] for s in summaries) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(json.loads(sys.argv[2])))
    sys.exit(main())
