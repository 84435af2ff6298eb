"""The DiskArray model and its collective round: a NumPy array every rank keeps; sections
of its own rows written and read, then other ranks' rows, ``write_all``/``read_all``,
persistent arrays closed and reopened."""
from __future__ import annotations

import math

import numpy as np

from .base import DRA_DTYPES, DRA_MAX, Broken, Ctx, Flight, Model, failed, pick


class Dra(Model):
    """The DiskArray of one backend (``d`` while open) and its model (a NumPy array every
    rank keeps)."""

    def __init__(self, ctx: Ctx, backend: str):
        super().__init__(ctx, backend, f"DiskArray(backend={backend!r})")
        self.d = None
        self.model = None
        self.persistent = False
        self.path = None
        self.flight = Flight()
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
        if ctx.any_rank(failed(t, "dra.reopen", obj, obj.reopen)):
            _drop_dra(ctx, obj)
            return
    if obj.d is None:
        def create() -> None:
            obj.create()
            if rng.random() < 0.3:
                obj.verify("dra.create")     # never-written elements read as zero
        if ctx.any_rank(failed(t, "dra.create", obj, create)):
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
    descs: list = []

    def write_mine() -> None:
        descs.extend(obj.local_phase(rows))
        ctx.step(f"{obj.desc}.flush()")
        obj.d.flush()
    broken = failed(t, "dra.write", obj, write_mine)
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
    broken = failed(t, "dra.read_other", obj, obj.read_phase)
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

            def read_all() -> None:
                got = obj.d.read_all(rkey, out, transpose=rtr)
                t.op("dra.read_all", obj.backend)
                obj.check("dra.read_all", rkey, got, rtr)
            broken = failed(t, "dra.read_all", obj, read_all)
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
