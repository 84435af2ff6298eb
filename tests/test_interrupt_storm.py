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

import numpy as np
import pytest

import chemio_py as cio
from chemio_py import requests
from chemio_py.backends import linux_aio
from chemio_py.bytefile import _many_args

HERE = os.path.dirname(os.path.abspath(__file__))
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
    with pytest.raises(_Interrupt):
        with requests.shield():
            signal.raise_signal(signal.SIGALRM)
            assert raising_alarm.calls      # the handler ran on time ...
            steps.append("rest of the block")
    assert steps == ["rest of the block"]   # ... and its exception came after the block
    assert signal.getsignal(signal.SIGALRM) is raising_alarm
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


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
def test_an_interrupt_in_the_delivery_reaches_the_waiter_after_it(raising_alarm, tmp_path):
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
        store = f._store
        if store._dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        f.write(0, np.zeros(16 * K, np.uint8))
        rows = cio.aligned_empty((16, K))
        many = _many_args(np.arange(16) * K, rows, writable=True)
        lost = store.native_read_many(many, lambda counts, t0, t1: counts, None)
        assert lost is not None and f.outstanding == 0      # not the file's
        f.delete()
        assert lost.done() and lost.wait() == [K] * 16
