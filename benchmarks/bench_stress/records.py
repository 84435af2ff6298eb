"""The RecordFile model: a list of records (tuples of arrays) per file, appended, flushed,
replayed whole and in part, reopened and re-created."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import REC_DTYPES, REC_MAX, Broken, Ctx, KiB, MiB, Model, nbytes_draw, pick


class Rec(Model):
    """One RecordFile (``log`` while open) and its model (a list of records, each a tuple of
    arrays)."""

    def __init__(self, ctx: Ctx, backend: str, idx: int):
        name = f"stressrec{idx}-{backend}"
        super().__init__(ctx, backend, f"RecordFile({name!r}, backend={backend!r})")
        self.name = name
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
