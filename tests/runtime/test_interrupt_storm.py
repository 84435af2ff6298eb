"""Interrupts from any raising signal handler are safe on every I/O path (issue 27, item 8).

A SIGALRM handler armed with ``setitimer`` raises at random moments, hundreds of times, in
worker processes under a watchdog that dumps every stack on a hang
(``benchmarks/bench_interrupts.py``): the direct read-ahead (O_DIRECT + Linux AIO), the
page-cache read-ahead, write-behind, RecordFile replay and ``ExclusiveFile.aread_many``.
After each interrupt everything must close, with nothing left in flight. Then the
mechanism itself, in this process: a shield lets bookkeeping finish and raises the
handler's exception after it, the AIO engine delivers completions whole, and a request
whose start an interrupt overlapped still reaches its file.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime import pool, requests
from chemio_py.backends.local import linux_aio
from chemio_py.files.bytefile import _many_args
from conftest import TESTS

HERE = TESTS
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import bench_interrupts  # noqa: E402

K = 4096


def _storm(kind: str, interrupts: int, tmp_path, seed: int) -> dict:
    s = bench_interrupts.storm(kind, interrupts, str(tmp_path), seed=seed, hang_timeout=10.0,
                               max_hangs=2)
    if "skipped" in s:
        pytest.skip(s["skipped"])
    print(bench_interrupts.report(s))
    return s


@pytest.mark.skipif(linux_aio.engine() is None, reason="no Linux AIO here")
def test_direct_read_ahead_survives_500_interrupts(tmp_path):
    # the reported hang: iter_blocks(direct=True) over 64 MiB, the reaper waiting in
    # io_getevents for completions an interrupt had already taken
    s = _storm("direct", 500, tmp_path, seed=27)
    assert s["hangs"] == 0, bench_interrupts.report(s)
    assert s["failures"] == [], bench_interrupts.report(s)
    assert s["interrupts"] >= 500


@pytest.mark.parametrize("kind", ["cached", "writebehind", "replay", "aread_many"])
def test_every_pipeline_survives_an_interrupt_storm(tmp_path, kind):
    s = _storm(kind, 150, tmp_path, seed=8)
    assert s["hangs"] == 0, bench_interrupts.report(s)
    assert s["failures"] == [], bench_interrupts.report(s)
    assert s["interrupts"] >= 150


class _Interrupt(Exception):
    """What the tests' SIGALRM handler raises (a KeyboardInterrupt would stop pytest)."""


@pytest.fixture
def raising_alarm():
    """SIGALRM's handler raises ``_Interrupt``; ``calls`` records when it ran."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread only")
    calls: list = []

    def handler(signum, frame):
        calls.append(signum)
        raise _Interrupt()
    old = signal.signal(signal.SIGALRM, handler)
    handler.calls = calls                   # type: ignore[attr-defined]
    try:
        yield handler
    finally:
        signal.signal(signal.SIGALRM, old)


def test_a_shield_finishes_its_block_and_raises_after_it(raising_alarm):
    steps: list = []
    sigint = signal.getsignal(signal.SIGINT)    # (ignored under nohup: as found)
    with pytest.raises(_Interrupt):
        with requests.shield():
            signal.raise_signal(signal.SIGALRM)
            assert raising_alarm.calls      # the handler ran on time ...
            steps.append("rest of the block")
    assert steps == ["rest of the block"]   # ... and its exception came after the block
    assert signal.getsignal(signal.SIGALRM) is raising_alarm
    assert signal.getsignal(signal.SIGINT) == sigint


def test_a_deferring_shield_runs_the_handler_after_the_bookkeeping(raising_alarm):
    seen_by_handler: list = []
    raising_alarm.calls.clear()

    def bookkeeping() -> str:
        signal.raise_signal(signal.SIGALRM)
        seen_by_handler.append(len(raising_alarm.calls))   # not run yet
        return "done"
    with pytest.raises(_Interrupt):
        requests.shielded(bookkeeping)
    assert seen_by_handler == [0] and raising_alarm.calls == [signal.SIGALRM]
    assert signal.getsignal(signal.SIGALRM) is raising_alarm


def test_an_interrupt_while_a_request_starts_is_raised_once_it_is_registered(raising_alarm):
    pending = requests.Pending()
    req = requests.Request()

    def start() -> requests.Request:
        signal.raise_signal(signal.SIGALRM)
        return req
    assert requests.shielded_start(start) is req      # not lost on the way to its owner
    with pytest.raises(_Interrupt):
        pending.add(req)
    assert len(pending) == 1                # close() waits for it
    req.set_result(None)
    assert pending.drain() == []


@pytest.mark.skipif(linux_aio.engine() is None, reason="no Linux AIO here")
def test_an_interrupt_in_the_delivery_reaches_the_waiter_after_it(raising_alarm, tmp_path,
                                                                  monkeypatch):
    # a handler raising while the waiting main thread delivers a batch of completions:
    # every request keeps its own result, the interrupt is raised to the waiter after the
    # delivery (it used to become the error of the request being delivered)
    path = str(tmp_path / "deliver")
    with open(path, "wb") as f:
        f.write(bytes(64 * K))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    eng = linux_aio.engine()
    monkeypatch.setattr(eng, "_poll_step", lambda: 0)  # submitting collects nothing: waits do
    bufs = cio.aligned_empty((8, K))
    fired: list = []

    def then(result: int, t0: float, t1: float) -> int:
        if not fired and threading.current_thread() is threading.main_thread():
            fired.append(1)                 # delivered by the waiting main thread
            signal.raise_signal(signal.SIGALRM)
        return result
    try:
        for _attempt in range(200):
            reqs = [eng.submit(False, fd, bufs[i].ctypes.data, K, i * K, bufs[i], then)
                    for i in range(8)]
            assert all(r is not None for r in reqs)
            caught = 0
            for r in reqs:
                try:
                    r.wait(timeout=10)
                except _Interrupt:
                    caught += 1
            if fired:
                break
        else:
            pytest.skip("the reaper thread delivered every batch")
        assert caught == 1
        assert all(r.done() and r.error is None for r in reqs)
        assert [r.wait() for r in reqs] == [K] * 8
        assert eng.in_flight == 0
    finally:
        os.close(fd)


@pytest.mark.skipif(linux_aio.engine() is None, reason="no Linux AIO here")
def test_closing_a_store_waits_for_transfers_an_interrupt_cut_off(tmp_path):
    # a request that never reached its file (its caller was interrupted on the way) still
    # has its transfers in flight: the store's close waits for them
    with cio.ExclusiveFile("cutoff", "w+", dir=str(tmp_path), direct=True) as f:
        store = f.store
        if store._dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        f.write(0, np.zeros(16 * K, np.uint8))
        rows = cio.aligned_empty((16, K))
        many = _many_args(np.arange(16) * K, rows, writable=True)
        lost = store.native_read_many(many, lambda counts, t0, t1: counts, None)
        assert lost is not None and f.outstanding == 0      # not the file's
        f.delete()
        assert lost.done() and lost.wait() == [K] * 16


# ------------------------------------------------- aread / awrite / close (issue 27, item 2d)

def test_an_interrupt_inside_close_still_closes_the_store(raising_alarm, monkeypatch):
    # a second interrupt landing while close() closes the store: the store used to stay
    # open, with nothing left to close it (the file already counted as closed)
    f = cio.ExclusiveFile("close_cut", "w+", backend="shm")
    f.write(0, bytes(100))
    store, real, closed = f.store, f.store.close, []

    def interrupted_close() -> None:
        signal.raise_signal(signal.SIGALRM)
        real()
        closed.append(1)
    monkeypatch.setattr(store, "close", interrupted_close)
    with pytest.raises(_Interrupt):
        f.close()
    assert closed == [1] and f.closed                   # closed whole, then interrupted
    f.close()                                           # idempotent
    assert cio.ExclusiveFile.remove("close_cut", backend="shm")


@pytest.mark.parametrize("call", ["awrite", "aread"])
def test_an_interrupt_as_a_pool_request_starts_leaves_it_with_its_file(raising_alarm,
                                                                      monkeypatch, call):
    # the I/O pool path: an interrupt between submitting the transfer and registering its
    # request used to leave a transfer on the caller's buffer that close() did not wait for
    f = cio.ExclusiveFile("start_cut", "w+", backend="shm")
    f.write(0, np.arange(16, dtype="f8"))
    assert f._caps.native_write is None and f._caps.read_nowait is None   # the pool path
    gate, ran = threading.Event(), []
    body = f._do_write if call == "awrite" else f._do_read

    def held(*args):
        gate.wait(10)
        ran.append(1)
        return body(*args)
    monkeypatch.setattr(f, "_do_write" if call == "awrite" else "_do_read", held)
    real_submit = pool.submit

    def submit_then_interrupt(*args, **kw):
        req = real_submit(*args, **kw)
        signal.raise_signal(signal.SIGALRM)              # right after the start
        return req
    monkeypatch.setattr(pool, "submit", submit_then_interrupt)
    buf = np.full(16, 7.0)
    with pytest.raises(_Interrupt):
        getattr(f, call)(0, buf)
    monkeypatch.setattr(pool, "submit", real_submit)
    assert f.outstanding == 1                           # registered: close() waits for it
    threading.Timer(0.2, gate.set).start()
    f.close()
    assert ran == [1]                                   # it ran before close() returned
    with cio.ExclusiveFile("start_cut", "r", backend="shm") as g:
        expect = np.full(16, 7.0) if call == "awrite" else np.arange(16, dtype="f8")
        np.testing.assert_array_equal(g.read(0, np.empty(16)), expect)
    if call == "aread":
        np.testing.assert_array_equal(buf, np.arange(16, dtype="f8"))
    assert cio.ExclusiveFile.remove("start_cut", backend="shm")


BYTEFILE_STORM = r'''
import faulthandler, json, math, os, signal, sys, time, traceback
import numpy as np
sys.path.insert(0, sys.argv[1])
import bench_interrupts as bi                       # the storm's alarm and quiet retries
import chemio_py as cio

N, SEED = int(sys.argv[2]), int(sys.argv[3])
alarm = bi._Alarm()
signal.signal(signal.SIGALRM, alarm)
rng = np.random.default_rng(SEED)
SEG = 32768
src = (np.arange(SEG) % 251).astype("u1")
live, paths, failures = [], set(), []


def open_file(it):
    # (opened before the alarm is armed: the storm is about the I/O and the close)
    f = cio.ExclusiveFile(f"storm{it % 3}", "w+", backend=("shm", "auto")[it % 2])
    live.append(f)
    paths.add(f.path)
    return f


def op(f):
    # the I/O pool path (shm and auto have no native one): awrite, aread, close, delete
    with f:
        for r in [f.awrite(k * SEG, src) for k in range(8)]:
            r.wait()
        outs = np.empty((8, SEG), "u1")
        for k, r in enumerate([f.aread(k * SEG, outs[k]) for k in range(8)]):
            if r.wait().base is not outs or not np.array_equal(outs[k], src):
                raise AssertionError(f"aread {k} handed out the wrong bytes")
    f.delete()


def close_all():
    for f in live:
        f.delete()                      # closes (waits for its requests), removes
    live.clear()


fds = len(os.listdir("/proc/self/fd"))
sigint = signal.getsignal(signal.SIGINT)     # as found (ignored under nohup)
faulthandler.dump_traceback_later(30, exit=True)
t0 = time.perf_counter()
op(open_file(-1))
span = max(time.perf_counter() - t0, 0.002)
close_all()
fds = len(os.listdir("/proc/self/fd"))
it = 0
while alarm.raised < N:
    faulthandler.dump_traceback_later(10, exit=True)        # the watchdog
    delay = (math.exp(rng.uniform(math.log(20e-6), math.log(1.3 * span)))
             if rng.random() < 0.5 else float(rng.uniform(20e-6, 1.3 * span)))
    burst = int(rng.integers(1, 6)) if rng.random() < 0.3 else 0
    f = open_file(it)
    try:
        try:
            alarm.arm(delay, float(rng.uniform(50e-6, 1e-3)) if burst else 0.0, burst)
            op(f)
        finally:
            alarm.armed = False
    except KeyboardInterrupt:
        pass
    except Exception:
        failures.append(f"iteration {it}: {traceback.format_exc()}")
    bi._quietly(alarm.disarm)
    tracked = list(live)
    bi._quietly(close_all)
    bad = [f"{f.path}: open" for f in tracked if not f.closed]
    bad += [f"{f.path}: {f.outstanding} outstanding" for f in tracked if f.outstanding]
    bad += [f"{p}: left behind" for p in paths if os.path.exists(p)]
    now = len(os.listdir("/proc/self/fd"))
    if now != fds:
        bad.append(f"{now - fds} file descriptors leaked (an open store)")
        fds = now
    if signal.getsignal(signal.SIGINT) != sigint:
        bad.append("SIGINT handler left replaced")
    if bad:
        failures.append(f"iteration {it}: " + "; ".join(bad))
    it += 1
faulthandler.cancel_dump_traceback_later()
print(json.dumps({"interrupts": alarm.raised, "iterations": it, "failures": failures}))
'''


def test_aread_awrite_close_survive_an_interrupt_storm(tmp_path):
    """Issue 27, item 2d: interrupts at random moments of awrite/aread on the I/O pool and
    of close/delete (the file is opened before the alarm is armed): no hang (the worker's
    watchdog), no store left open (file descriptors), no request left outstanding, no file
    left behind."""
    import json
    import subprocess
    script = tmp_path / "storm_bytefile.py"
    script.write_text(BYTEFILE_STORM)
    scr = tmp_path / "scratch"
    scr.mkdir()
    env = dict(os.environ, CHEMIO_SCRATCH=str(scr), PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, str(script), bench_interrupts.HERE, "200", "27"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Timeout (" not in proc.stderr, proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failures"] == [], "\n".join(out["failures"][:3])
    assert out["interrupts"] >= 200
    assert not [p for p in scr.rglob("*") if p.is_file()]


WATCHDOG = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
import bench_interrupts as b
b.STALL_LIMIT = float(sys.argv[4])
w = b._Watchdog(0.3, sys.argv[2], None)
if sys.argv[3] != "-":
    w.inflight = sys.argv[3]            # the device's in-flight counts, as the kernel shows them
w.arm()
time.sleep(float(sys.argv[5]))
print("survived", w.stalls)
'''


@pytest.mark.parametrize("inflight, ends", [("0 0", True), ("0 3", True), ("0 3", False)])
def test_the_storm_watchdog_tells_a_hang_from_a_device_stall(tmp_path, inflight, ends):
    """An iteration past the hang timeout with nothing in flight on the device ends the
    worker at once with the marker the launcher counts as a hang; one whose device still
    has requests in flight is a stall, waited for up to STALL_LIMIT (then a hang too)."""
    import subprocess
    counts = tmp_path / "inflight"
    counts.write_text(inflight + "\n")
    busy = inflight != "0 0"
    limit, sleep = ("1.0", "6") if ends else ("30", "2")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WATCHDOG, bench_interrupts.HERE,
                           str(tmp_path), str(counts), limit, sleep],
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    if ends:
        assert proc.returncode == 1 and "Timeout (" in proc.stderr, proc.stderr[-3000:]
        assert "hung: no AIO engine" in proc.stderr
        assert ("stall: " in proc.stderr) == busy
        assert took < 5.5                       # not the full sleep
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split() == ["survived", "1"]
        assert proc.stderr.count("stall: ") == 1


def _launcher(*args: str) -> tuple[list[str], dict]:
    """The command line and environment of the storm launcher run as a program."""
    env = dict(os.environ)
    env["PYTHONPATH"] = bench_interrupts.ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return [sys.executable, os.path.join(bench_interrupts.HERE, "bench_interrupts.py"),
            *args], env


def test_a_storm_ended_by_sigterm_removes_its_work_directory(tmp_path):
    """A batch system's SIGTERM to the launcher mid-run: it exits (143), its worker is
    gone and no ``chemio-storm-*`` directory is left in the work directory."""
    import subprocess
    argv, env = _launcher("--kind", "cached", "--interrupts", "100000",
                          "--workdir", str(tmp_path))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                p.name.startswith("storm-") for d in tmp_path.glob("chemio-storm-*")
                for p in d.iterdir()):
            time.sleep(0.05)                # until a worker is running
        assert list(tmp_path.glob("chemio-storm-*")), "the storm never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_storm_launched_with_sigint_ignored_reports_no_false_failure(tmp_path):
    """Under ``nohup`` or as a background job of a script, a process starts with SIGINT
    ignored and Python leaves it so. The worker's check that no SIGINT handler is left
    replaced compares against what it found, not against Python's default handler."""
    import subprocess
    argv, env = _launcher("--kind", "replay", "--interrupts", "20", "--seed", "3",
                          "--workdir", str(tmp_path))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "left replaced" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []
