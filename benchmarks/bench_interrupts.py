"""Interrupt storm: a signal handler that raises at random moments inside chemio's I/O paths.

Not a speed benchmark: its figure of merit is ``hangs: 0`` (issue 27, item 8). A SIGALRM
handler armed with ``setitimer`` raises ``KeyboardInterrupt`` at a random moment of an
operation, sometimes as a burst of several in a row (the next ones land in the clean-up
the first one started). After each interrupt the worker closes everything (again, until a
close is not interrupted) and checks that nothing is left: no request in flight in the
pipeline, the file or the Linux AIO engine, every block it was handed complete and right.

Paths (``--kind``, repeatable):

* ``direct``: ``iter_blocks(direct=True)`` over a 64 MiB local DiskArray whose pages are
  not cached (O_DIRECT + Linux AIO into the ring buffers);
* ``cached``: ``iter_blocks`` over the same array from the page cache (I/O threads);
* ``writebehind``: ``WriteBehind`` of 8 MiB ``DiskArray.awrite`` calls (I/O threads) and
  of 128 KiB ``ExclusiveFile.awrite`` calls on an O_DIRECT file (Linux AIO), in turn;
* ``replay``: ``RecordFile.replay`` of 16 MiB of records (page reads on the I/O threads);
* ``aread_many``: ``ExclusiveFile.aread_many`` of 64 transfers of 4 KiB at a time on an
  O_DIRECT file (groups of control blocks), the file opened and closed each operation.

Each kind runs in worker processes (``--worker``) under a watchdog that prints the AIO
engine's state and every thread's stack and ends the worker when one iteration takes
``--hang-timeout`` seconds; the launcher counts that as a hang, keeps the stacks and starts
a new worker for the interrupts still to go (at most ``--max-hangs`` times). An iteration
whose work directory's device still has requests in flight is a stall, not a hang: the
device is slow (another job's writes or discards on a shared node), and it may take up to
``STALL_LIMIT`` seconds; stalls are counted apart. The direct and AIO kinds need
O_DIRECT on the work directory's file system: the worker reports them skipped otherwise.

    python benchmarks/bench_interrupts.py --kind direct --interrupts 500
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np

KINDS = ("direct", "cached", "writebehind", "replay", "aread_many")
INTERRUPTS = 500                # per kind, full run
QUICK_INTERRUPTS = 100
HANG_TIMEOUT = 10.0             # seconds one iteration may take (a normal one: < 0.5 s)
STALL_LIMIT = 60.0              # ... while the device still has requests in flight
MAX_HANGS = 5                   # workers started again after a hang, at most
ROWS, COLS, BLOCK = 2048, 4096, 256     # 64 MiB of float64, 8 MiB blocks (chunks of rows)
K = 4096
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---------------------------------------------------------------- the worker process
class _Alarm:
    """SIGALRM handler: raises KeyboardInterrupt while armed (``burst`` more to come)."""

    def __init__(self) -> None:
        self.armed = False
        self.burst = 0
        self.raised = 0

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.armed:
            return                      # a late tick after the iteration: nothing to hit
        if self.burst > 0:
            self.burst -= 1
        else:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        self.raised += 1
        raise KeyboardInterrupt("storm")

    def arm(self, delay: float, interval: float, burst: int) -> None:
        # no cyclic-GC finaliser runs while armed: an interrupted __del__ would be an
        # "unraisable" exception, not the interrupt of the code under test
        gc.disable()
        self.burst = burst
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, delay, interval)

    def disarm(self) -> None:
        self.armed = False              # from here a tick returns quietly
        signal.setitimer(signal.ITIMER_REAL, 0)
        gc.enable()


def _quietly(fn: Callable[[], Any]) -> Any:
    """``fn()`` again until no interrupt cuts it short (the alarm is disarmed first)."""
    while True:
        try:
            return fn()
        except KeyboardInterrupt:
            pass


def _check_block(section: tuple, block: np.ndarray) -> None:
    """Row ``i`` of the array holds ``i`` everywhere: the first and last column prove a
    block handed out is complete and from the right place."""
    rows = np.arange(section[0].start, section[0].stop, dtype=np.float64)
    if not (np.array_equal(block[:, 0], rows) and np.array_equal(block[:, -1], rows)):
        raise AssertionError(f"block {section[0]} handed out incomplete or wrong")


class _Paths:
    """The objects of one worker and one operation (iteration) per kind."""

    def __init__(self, kind: str, workdir: str):
        import chemio_py as cio
        from chemio_py.backends.local import linux_aio
        self.cio, self.kind, self.dir = cio, kind, workdir
        self.eng = linux_aio.engine()
        self.blocks_seen = 0
        self.d = self.rf = None
        self.live: list = []                # pipelines / files an interrupt may leave open
        # SIGINT's handler as the worker found it (SIG_IGN under nohup or a background
        # job of a script, Python's default_int_handler otherwise)
        self.sigint = signal.getsignal(signal.SIGINT)
        if kind in ("direct", "cached", "writebehind"):
            model = np.repeat(np.arange(ROWS, dtype=np.float64)[:, None], COLS, axis=1)
            self.d = cio.DiskArray.create("storm", (ROWS, COLS), "f8", chunks=(BLOCK, COLS),
                                          backend="local")
            self.d[...] = model
            self.d.flush()
            self.blocks = [model[k:k + BLOCK] for k in range(0, ROWS, BLOCK)]
            if kind == "direct":
                self.d.evict()
                probe = cio.aligned_empty((BLOCK, COLS), np.float64)
                req = self.d.aread_direct(np.s_[0:BLOCK], probe)
                if req is None:
                    raise _Skip("no O_DIRECT + Linux AIO for this array here")
                req.wait()
        if kind in ("writebehind", "aread_many"):
            self.rows = cio.aligned_empty((256, 2 * K))         # row i: 8 KiB of i
            self.rows[...] = np.arange(256)[:, None]
            with cio.ExclusiveFile("storm", "w+", dir=workdir, direct=True) as f:
                if f.store._dfd is None or self.eng is None:
                    raise _Skip("this file system refuses O_DIRECT (or no Linux AIO)")
                f.write(0, self.rows)
        if kind == "replay":
            self.rf = cio.RecordFile("storm", "w+", dir=workdir, page_size=1 << 20)
            for i in range(64):
                self.rf.append(np.array([i]), np.full(32 * 1024, i, dtype=np.float64))
            self.rf.flush()

    # one operation per kind; a with block closes what it opened, even when interrupted
    def op(self, it: int) -> None:
        getattr(self, "_op_" + self.kind)(it)

    def _op_direct(self, it: int) -> None:
        self.d.evict()                  # (a block read the ordinary way would be cached)
        self._read_blocks(True)

    def _op_cached(self, it: int) -> None:
        self._read_blocks(False)

    def _read_blocks(self, direct: bool) -> None:
        from chemio_py.prefetch import iter_blocks
        pipe = iter_blocks(self.d, size=BLOCK, depth=2, direct=direct)
        self.live.append(pipe)
        with pipe:
            for section, block in pipe:
                _check_block(section, block)
                self.blocks_seen += 1

    def _op_writebehind(self, it: int) -> None:
        if it % 2:
            wb = self.cio.WriteBehind(depth=2)
            self.live.append(wb)
            with wb:
                for k, data in zip(range(0, ROWS, BLOCK), self.blocks):
                    wb.submit(self.d.awrite, np.s_[k:k + BLOCK], data)
            return
        f = self.cio.ExclusiveFile("storm", "r+", dir=self.dir, direct=True)
        self.live.append(f)
        with f:
            wb = self.cio.WriteBehind(depth=4)
            self.live.append(wb)
            with wb:
                for i in range(0, 256, 16):
                    wb.submit(f.awrite, i * self.rows[0].nbytes, self.rows[i:i + 16])

    def _op_replay(self, it: int) -> None:
        rep = self.rf.replay(depth=2)
        self.live.append(rep)
        with rep:
            for i, (idx, val) in enumerate(rep):
                if idx[0] != i or val[0] != i or val[-1] != i:
                    raise AssertionError(f"record {i} replayed wrong")
                self.blocks_seen += 1

    def _op_aread_many(self, it: int) -> None:
        f = self.cio.ExclusiveFile("storm", "r", dir=self.dir, direct=True)
        self.live.append(f)
        with f:
            out = self.cio.aligned_empty((64, K))       # the first 4 KiB of 64 rows
            for g in range(8):
                base = (g * 64 + it) % 192
                offsets = (base + np.arange(64)) * self.rows[0].nbytes
                f.aread_many(offsets, out).wait()
                if not np.array_equal(out[:, 0], base + np.arange(64)):
                    raise AssertionError("aread_many filled the wrong rows")
                self.blocks_seen += 1

    def close_all(self) -> None:
        """Close what an interrupt left open (no alarm armed now): must not hang."""
        for obj in reversed(self.live):     # pipelines before the files they write to
            obj.close()
        self.live.clear()

    def leftovers(self) -> list[str]:
        """What is still in flight after everything was closed: nothing, if all is well."""
        bad = []
        if self.d is not None and self.d.outstanding:
            bad.append(f"DiskArray: {self.d.outstanding} requests outstanding")
        eng = self.eng
        if eng is not None:
            if eng.in_flight:
                bad.append(f"AIO engine: {eng.in_flight} transfers in flight")
            if eng._waiting:
                bad.append(f"AIO engine: {len(eng._waiting)} waiters recorded")
            if len(eng._free) != len(eng._entries) or len(eng._gfree) != len(eng._gowner):
                bad.append("AIO engine: control blocks leaked")
        if signal.getsignal(signal.SIGINT) != self.sigint:
            bad.append(f"SIGINT handler left replaced: {signal.getsignal(signal.SIGINT)!r} "
                       f"(was {self.sigint!r})")
        return bad

    def finish(self) -> None:
        for obj in (self.d, self.rf):
            if obj is not None:
                obj.delete() if hasattr(obj, "delete") else obj.close()
        if self.kind in ("writebehind", "aread_many"):
            self.cio.ExclusiveFile.remove("storm", dir=self.dir)


class _Skip(Exception):
    pass


class _Watchdog:
    """Ends the worker on a hang: an iteration (``arm``) running ``timeout`` seconds while
    the work directory's device has nothing in flight, or ``STALL_LIMIT`` seconds in any
    case. It prints the AIO engine's state and every thread's stack first. faulthandler's
    own timer stays armed behind it, for a thread that never lets the GIL go."""

    def __init__(self, timeout: float, workdir: str, eng: Any) -> None:
        self.timeout, self.eng = timeout, eng
        dev = os.stat(workdir).st_dev
        self.inflight = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/inflight"
        self.started: float | None = None
        self.stalled, self.stalls = False, 0
        threading.Thread(target=self._watch, name="storm-watchdog", daemon=True).start()

    def arm(self) -> None:
        self.stalled = False
        self.started = time.monotonic()
        faulthandler.dump_traceback_later(STALL_LIMIT + 10, exit=True)

    def device_busy(self) -> bool:
        try:
            with open(self.inflight) as f:
                return any(int(v) for v in f.read().split())
        except (OSError, ValueError):
            return False                # (no block device: a tmpfs, an overlay)

    def state(self) -> str:
        eng = self.eng
        if eng is None:
            return "no AIO engine"
        text = (f"AIO engine: {eng.in_flight} transfers in flight, {len(eng._waiting)} "
                f"waiting, {getattr(eng, 'reaped', '?')} completions reaped, "
                f"{getattr(eng, 'handed', '?')} delivered, last error "
                f"{getattr(eng, 'last_error', None)}")
        ctx = getattr(getattr(eng, "_ctx", None), "value", 0)
        if ctx:     # the kernel's completion ring, mapped here: head and tail
            import ctypes
            head = ctypes.c_uint.from_address(ctx + 8).value
            tail = ctypes.c_uint.from_address(ctx + 12).value
            text += f"; ring head {head}, tail {tail}"
        return text + f"; device busy: {self.device_busy()}; load {os.getloadavg()}"

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            t0 = self.started
            if t0 is None:
                continue
            late = time.monotonic() - t0
            if late < self.timeout:
                continue
            if late < STALL_LIMIT and self.device_busy():
                if not self.stalled:
                    self.stalled = True
                    self.stalls += 1
                    print(f"stall: {self.state()}", file=sys.stderr, flush=True)
                continue
            print(f"Timeout ({late:.0f} s): {self.state()}", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)
            print(f"hung: {self.state()}", file=sys.stderr, flush=True)   # (the tail is kept)
            os._exit(1)


def worker(kind: str, interrupts: int, seed: int, workdir: str, hang_timeout: float) -> dict:
    """Run ``kind`` until ``interrupts`` handler raises landed inside operations."""
    alarm = _Alarm()
    signal.signal(signal.SIGALRM, alarm)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"kind": kind, "interrupts": 0, "iterations": 0, "failures": []}
    try:
        paths = _Paths(kind, workdir)
    except _Skip as e:
        out["skipped"] = str(e)
        return out
    t0 = time.perf_counter()
    watch = _Watchdog(hang_timeout * 3, workdir, paths.eng)
    watch.arm()
    paths.op(-1)                        # one pass without interrupts: its length
    span = max(time.perf_counter() - t0, 0.002)
    it = 0
    watch.timeout = hang_timeout
    while alarm.raised < interrupts:
        watch.arm()
        if rng.random() < 0.5:          # early moments (set-up, first steps) in detail
            delay = math.exp(rng.uniform(math.log(20e-6), math.log(1.3 * span)))
        else:                           # anywhere in the operation
            delay = float(rng.uniform(20e-6, 1.3 * span))
        burst = int(rng.integers(1, 6)) if rng.random() < 0.3 else 0
        interval = float(rng.uniform(50e-6, 1e-3)) if burst else 0.0
        before = alarm.raised
        try:
            try:
                alarm.arm(delay, interval, burst)
                paths.op(it)
            finally:
                alarm.armed = False     # no call before it: nothing lands in between
        except KeyboardInterrupt:
            pass
        except Exception:               # noqa: BLE001 - reported, the storm goes on
            out["failures"].append(f"iteration {it}: {traceback.format_exc()}")
        _quietly(alarm.disarm)
        _quietly(paths.close_all)
        bad = paths.leftovers()
        if bad:
            out["failures"].append(f"iteration {it}: " + "; ".join(bad))
        it += 1
        if alarm.raised > before:
            print(f"landed {alarm.raised}", flush=True)
    watch.started = None
    faulthandler.cancel_dump_traceback_later()
    out.update(interrupts=alarm.raised, iterations=it, blocks=paths.blocks_seen,
               seconds=time.perf_counter() - t0)
    paths.finish()
    return out


# ---------------------------------------------------------------- the launcher
def storm(kind: str, interrupts: int, workdir: str, seed: int = 0,
          hang_timeout: float = HANG_TIMEOUT, max_hangs: int = MAX_HANGS) -> dict:
    """Run ``kind`` in worker processes until ``interrupts`` landed; count the hangs."""
    done, hangs, stalls, stacks, failures, iterations = 0, 0, 0, [], [], 0
    t0 = time.perf_counter()
    result: dict[str, Any] = {}
    attempt = 0
    while done < interrupts:
        wdir = tempfile.mkdtemp(prefix=f"storm-{kind}-", dir=workdir)
        env = dict(os.environ, CHEMIO_SCRATCH=wdir, PYTHONFAULTHANDLER="1")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind,
               "--interrupts", str(interrupts - done), "--seed", str(seed + attempt),
               "--hang-timeout", str(hang_timeout), "--workdir", wdir]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=hang_timeout * (interrupts - done + 10))
        except subprocess.TimeoutExpired as e:
            proc = None
            stacks.append(f"worker killed after {e.timeout:.0f} s\n{e.stderr or ''}")
        finally:
            shutil.rmtree(wdir, ignore_errors=True)
        attempt += 1
        stalls += proc.stderr.count("stall: ") if proc is not None else 0
        last = [ln for ln in (proc.stdout if proc else "").splitlines() if ln.strip()]
        if proc is not None and proc.returncode == 0 and last and last[-1].startswith("{"):
            result = json.loads(last[-1])
            if "skipped" in result:
                return {"kind": kind, "skipped": result["skipped"]}
            done += result["interrupts"]
            iterations += result["iterations"]
            failures += result["failures"]
            continue
        landed = [int(ln.split()[1]) for ln in last if ln.startswith("landed ")]
        done += landed[-1] if landed else 0
        if proc is not None and "Timeout (" not in proc.stderr:
            failures.append(f"worker exited {proc.returncode}:\n{proc.stderr[-4000:]}")
            if not landed:
                break                   # it fails before the storm: no point in again
        else:
            hangs += 1
            if proc is not None:
                stacks.append(proc.stderr[-8000:])
        if hangs + len(failures) > max_hangs:
            break
    return {"kind": kind, "interrupts": done, "hangs": hangs, "failures": failures,
            "stacks": stacks, "iterations": iterations, "stalls": stalls,
            "seconds": time.perf_counter() - t0}


def report(s: dict) -> str:
    if "skipped" in s:
        return f"{s['kind']}: skipped ({s['skipped']})"
    text = (f"{s['kind']}: {s['interrupts']} interrupts in {s['iterations']} operations, "
            f"hangs {s['hangs']}, failures {len(s['failures'])}, "
            f"device stalls {s['stalls']}, {s['seconds']:.1f} s")
    for f in s["failures"][:3]:
        text += "\n  failure: " + f.strip()[-2000:]
    for st in s["stacks"][:2]:
        text += "\n  hang, stacks:\n" + st.strip()[-4000:]
    return text


def run(quick: bool, workdir: str) -> list[dict]:
    """Runner entry: every kind, ``INTERRUPTS`` interrupts each (quick: 100)."""
    from common import row
    n = QUICK_INTERRUPTS if quick else INTERRUPTS
    rows = []
    for kind in KINDS:
        s = storm(kind, n, workdir)
        print(report(s), flush=True)
        if "skipped" in s:
            continue
        rows.append(row(f"interrupt storm: {kind}", "hangs", s["hangs"], target=None,
                        note=f"{s['interrupts']} interrupts, {len(s['failures'])} failures, "
                             f"{s['seconds']:.0f} s"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="chemio_py interrupt storm (see the docstring)")
    p.add_argument("--kind", action="append", choices=KINDS, help="(default: all)")
    p.add_argument("--interrupts", type=int, default=INTERRUPTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT)
    p.add_argument("--max-hangs", type=int, default=MAX_HANGS)
    p.add_argument("--workdir", default=None, help="(default: CHEMIO_SCRATCH or /tmp)")
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.interrupts, a.seed, a.workdir, a.hang_timeout)),
              flush=True)
        return 0
    base = a.workdir or os.environ.get("CHEMIO_SCRATCH", "").split(os.pathsep)[0] or None
    # A SIGTERM (a batch system's, a kill) ends the run through the finally below: the
    # running worker is killed by subprocess.run and the work directory removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = tempfile.mkdtemp(prefix="chemio-storm-", dir=base)
    clean = True
    try:
        for kind in a.kind or KINDS:
            s = storm(kind, a.interrupts, work, a.seed, a.hang_timeout, a.max_hangs)
            print(report(s), flush=True)
            clean &= "skipped" in s or (not s["hangs"] and not s["failures"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
