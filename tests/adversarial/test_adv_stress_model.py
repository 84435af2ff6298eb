"""The stress run's own models (``benchmarks/bench_stress/``) must not report a library bug
where the library is right.

A 150 s run at P = 4 once reported an ``EndOfFileError`` from ``ExclusiveFile.read`` on
``auto`` (rank 3, round 221, op 15958 of seed 3222815806). Replayed with every step
logged, the ops before it were: ``awrite(5815421, 322264 B)`` past the end (a hole from
4665762), then a blocking ``write(5897419, 0 B)``, then ``read(4528883, 228571 B)`` inside
the hole. A write of 0 bytes extends nothing (``pwrite`` semantics, and the model's own
``mwrite`` agrees), yet the model raised its "file is at least this long" mark (``stable``)
to 5897419, so it did not wait for the ``awrite`` before reading; when the ``awrite`` had
not landed yet the file was 4665762 bytes and the library rightly raised.

The test drives the models through that sequence with a file whose ``awrite`` lands only
when it is waited for (the latest a request may complete), in a child process: the models
arm a ``faulthandler`` watchdog that must not touch pytest's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")

BODY = r"""
import faulthandler, json, sys
sys.path.insert(0, BENCH)
from bench_stress.base import Broken, Ctx
from bench_stress.eaf import Eaf


class Late:
    '''An awrite request that writes when it is waited for, not before.'''

    def __init__(self, f, off, data):
        self.f, self.off, self.data, self.val = f, off, data, None

    def done(self):
        return self.val is not None

    def wait(self, timeout=None):
        if self.val is None:
            self.val = self.f.write(self.off, self.data)
        return self.val


class LateFile:
    '''An ExclusiveFile whose awrite lands only at wait().'''

    def __init__(self, f):
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def awrite(self, off, data):
        return Late(self._f, off, data)


ctx = Ctx({"seed": 1, "hang": 600.0, "run": RUN, "keep": RUN})
m = Eaf(ctx, BACKEND, False, 3)
m.open("w+")
script = {"w": [(0, 4096, False), (8192, 4096, False), (10000, 0, False)],
          "r": [(5000, 3000, False)]}
m.draw_write = lambda rng: script["w"].pop(0)
m.draw_read = lambda rng: script["r"].pop(0)
rng = ctx.mine
outcome = "clean"
try:
    m.write(rng)                     # [0, 4096): the file is 4096 bytes
    m.f = LateFile(m.f)
    m.awrite(rng)                    # [8192, 12288) in flight: a hole [4096, 8192)
    m.write(rng)                     # 0 bytes at 10000: extends nothing
    stable_after_empty_write = m.stable
    m.read(rng)                      # [5000, 8000): in the hole, past the end until the
    m.verify()                       # awrite lands
except Broken:
    outcome = "broken"
finally:
    faulthandler.cancel_dump_traceback_later()
    m.f = getattr(m.f, "_f", m.f)
    m.f.delete()
print(json.dumps({"outcome": outcome, "errors": ctx.t.errors,
                  "stable": stable_after_empty_write, "real": 4096}))
"""


@pytest.mark.parametrize("backend", ["local", "shm", "auto"])
def test_eaf_model_waits_for_an_awrite_after_an_empty_write(tmp_path, backend):
    run = tmp_path / "run"
    run.mkdir()
    code = f"BENCH = {BENCH!r}; RUN = {str(run)!r}; BACKEND = {backend!r}\n" + BODY
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["stable"] <= got["real"], "a 0-byte write raised the model's size floor"
    assert got["outcome"] == "clean" and got["errors"] == [], got["errors"][:2]
