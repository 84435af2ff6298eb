"""The harness every stress model shares: settings, the tally of checks, the worker's
context (communicator, seeded RNGs, data pools, hang watchdog), random draws, the requests
in flight, and the model bases (``Model``; ``ByteModel`` for byte files).

A model keeps an independent copy of what one chemio object should hold and checks every
read against it. A check that fails is recorded in the tally (``Tally.error``) and raises
``Broken``: the caller drops the object and starts afresh; nothing here raises otherwise.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback
from collections import Counter
from typing import Any, Callable

import numpy as np

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)
from common import KiB, MiB  # noqa: E402

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


def failed(t: Any, what: str, obj: Any, step: Any) -> bool:
    """Run ``step()``; True when it broke the object's model: a ``Broken`` check (already
    reported) or any other exception, recorded in the tally ``t`` as ``what``."""
    try:
        step()
    except Broken:
        return True
    except Exception as e:
        t.exception(what, obj, e)
        return True
    return False


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



# ---------------------------------------------------------------- model bases

class Model:
    """What every model has: the worker's context, the backend of its object and ``desc``,
    how reports name the object."""

    def __init__(self, ctx: Ctx, backend: str, desc: str):
        self.ctx, self.backend, self.desc = ctx, backend, desc

    def fail(self, kind: str, message: str) -> Broken:
        """Record a failed check of ``kind``; the ``Broken`` to raise."""
        self.ctx.t.error(kind, self, message)
        return Broken()


class ByteModel(Model):
    """A byte file and its model: ``model[:size]`` is the file, ``model[size:]`` zeros. Async
    requests in flight are in ``flight``; the file is at least ``stable`` bytes long (reads
    below it need not wait for the writes in flight). ``handle`` is the open chemio object."""

    def __init__(self, ctx: Ctx, backend: str, desc: str, capacity: int):
        super().__init__(ctx, backend, desc)
        self.model = np.zeros(capacity, np.uint8)
        self.size = 0
        self.stable = 0
        self.flight = Flight()

    @property
    def handle(self) -> Any:
        raise NotImplementedError

    def mwrite(self, off: int, data: Any) -> None:
        """Apply a write of ``data`` (bytes or an array) at ``off`` to the model."""
        b = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else \
            np.frombuffer(data, np.uint8)
        if b.size:
            self.model[off:off + b.size] = b
            self.size = max(self.size, off + b.size)

    def eof(self, off: int, n: int) -> bool:
        """Does a read of ``n`` bytes at ``off`` pass the end of the file?"""
        return off + n > self.size if n else off > self.size

    def settle(self) -> None:
        self.flight.settle(self.ctx)
        self.stable = self.size

    def check_size(self, kind: str) -> None:
        got = self.handle.size
        if got != self.size:
            raise self.fail(kind, f"size is {got} bytes on rank {self.ctx.rank}, the model "
                                  f"says {self.size}")

    def read_failed(self, kind: str, eof: bool, exc: BaseException | None, what: str) -> bool:
        """Judge how a read (``what``) ended: True when it raised ``EndOfFileError`` as the
        model expects, False when it returned as expected (its bytes are to be compared);
        ``Broken`` (recorded) when it raised anything else or passed the end silently."""
        if exc is not None:
            if eof and isinstance(exc, self.ctx.cio.EndOfFileError):
                self.ctx.t.expected["EndOfFileError"] += 1
                return True
            self.ctx.t.exception(kind, self, exc)
            raise Broken()
        if eof:
            raise self.fail(kind, f"{what} passed the end ({self.size} bytes) without "
                                  f"EndOfFileError")
        return False

    def check_read(self, kind: str, off: int, buf: Any, eof: bool,
                   exc: BaseException | None) -> None:
        """Check a read of ``buf`` at ``off``: its outcome, then its bytes."""
        n = memoryview(buf).nbytes
        if self.read_failed(kind, eof, exc, f"read of {n} bytes at {off}"):
            return
        if not self.ctx.t.compare(kind, self, buf, self.model[off:off + n], f"read at {off}"):
            raise Broken()

    def verify_whole(self, kind: str) -> None:
        """Read the whole file and compare it with the model."""
        self.ctx.step(f"{self.desc} verify whole file ({self.size} B)")
        self.check_size(kind)
        buf = np.empty(self.size, np.uint8)
        if self.size:
            self.handle.read(0, buf)
        if not self.ctx.t.compare(kind, self, buf, self.model[:self.size], "whole file"):
            raise Broken()
