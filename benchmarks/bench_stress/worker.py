"""One stress process: rounds of independent operations on its private files, then a
collective SharedFile or DiskArray round, until the time is up; the tally goes to
``result.<rank>.json`` in the run directory. Run by the launcher, never imported by hand."""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

import numpy as np

from .base import Broken, Ctx
from .diskarray import Dra, dra_round
from .eaf import Eaf
from .records import Rec
from .shared import Sf, sf_round


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
