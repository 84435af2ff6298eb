"""The ExclusiveFile model: one private file per backend (``local`` also with O_DIRECT),
every operation of its API at random offsets and sizes, checked byte for byte."""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import EAF_MAX, INF, OP_MAX, Broken, ByteModel, Ctx, KiB, MiB, nbytes_draw, pick


class Eaf(ByteModel):
    """One private ExclusiveFile (``f`` while open) and its model."""

    def __init__(self, ctx: Ctx, backend: str, direct: bool, idx: int):
        name = f"stress{idx}-{backend}{'-direct' if direct else ''}"
        super().__init__(ctx, backend, f"ExclusiveFile({name!r}, backend={backend!r}, "
                                       f"direct={direct})", EAF_MAX + OP_MAX + 8)
        self.name, self.direct = name, direct
        self.f = None
        self.mode = None

    @property
    def handle(self) -> Any:
        return self.f

    def open(self, mode: str) -> None:
        kw = {"direct": True} if self.direct else {}
        self.f = self.ctx.cio.ExclusiveFile(self.name, mode, backend=self.backend, **kw)
        self.mode = mode
        if mode in ("w+", "x+"):
            self.size = 0
            self.model[:] = 0
        self.stable = self.size

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
        if not len(self.flight):
            self.stable = self.size
        elif n:                 # a write of 0 bytes extends nothing, even past the end
            self.stable = max(self.stable, off + n)

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

    def awrite(self, rng, note: str = "") -> None:
        """One ``awrite``, left in flight."""
        off, n, aligned = self.draw_write(rng)
        if self.flight.clash(((off, off + n),), True):
            self.settle()
        s, data = self.ctx.payload(n)
        self.ctx.step(f"{self.desc}.awrite({off}, {n} B){note}")
        req = self.f.awrite(off, self.wbuffer(data, aligned))
        self.mwrite(off, data)
        self.ctx.t.op("eaf.awrite", self.backend)
        self.flight.add(req, ((off, off + n),), True, self._write_done(off, n))

    def async_batch(self, rng) -> None:
        """1..8 awrite/aread requests; some stay in flight for later operations."""
        for _ in range(int(rng.integers(1, 9))):
            if rng.random() < 0.5:
                self.awrite(rng)
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
        if self.read_failed("eaf.aread_many", eof, exc, f"aread_many of ranges {ranges}"):
            return
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
        self.verify_whole(kind)
        if kind == "eaf.verify":
            self.ctx.t.op(kind, self.backend)

    def reopen(self, rng) -> None:
        if rng.random() < 0.5:      # leave writes in flight: close() must complete them
            for _ in range(int(rng.integers(1, 4))):
                self.awrite(rng, " left in flight")
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
