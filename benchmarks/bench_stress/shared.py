"""The SharedFile model and its collective round: every rank writes its own random
segments, then reads everybody's data, truncates and re-creates the file together."""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import (OP_MAX, SF_CAP, SF_SPAN_MAX, Broken, ByteModel, Ctx, KiB, MiB,
                   boxes_overlap, failed, nbytes_draw, pick)


class Sf(ByteModel):
    """A SharedFile on one backend (``sf`` while it exists) and the model every rank keeps."""

    def __init__(self, ctx: Ctx, backend: str):
        name = f"stresssf-{backend}"
        super().__init__(ctx, backend, f"SharedFile({name!r}, backend={backend!r})", SF_CAP)
        self.name = name
        self.sf = None
        self.hard = None

    @property
    def handle(self) -> Any:
        return self.sf

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

    def limited(self, off: int, n: int) -> bool:
        return self.hard is not None and off + n > self.hard

    # ---------------------------------------------------------------- one round
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
                    if n:       # a write of 0 bytes extends nothing, even past the end
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
                    self.check_read("sf.read", off, buf, False, exc)
                else:
                    req = self.sf.aread(off, buf)
                    self.flight.add(req, ((off, off + n),), False,
                                    lambda v, e, off=off, buf=buf:
                                    self.check_read("sf.aread", off, buf, False, e))
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
                if self.read_failed("sf.aread_many", eof, exc, f"aread_many of {ranges}"):
                    continue
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
            eof = self.eof(off, n)
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
            self.check_read(f"sf.{kind}", off, buf, eof, exc)

    def verify(self) -> None:
        self.verify_whole("sf.verify")


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
        def read_other() -> None:
            obj.check_size("sf.read_other")
            obj.read_phase()
            if rng.random() < 0.2:
                obj.verify()
        broken = failed(t, "sf.read_other", obj, read_other)
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
