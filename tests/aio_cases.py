"""Cases shared by the native asynchronous engines' tests (Linux AIO, io_uring): the same
semantics asked of each engine."""
from __future__ import annotations

import threading

import numpy as np

import chemio_py as cio

K = 4096


def threads_write_and_read(f, threads: int = 4, rounds: int = 64) -> None:
    """``threads`` threads each write and read back ``rounds`` batches of 8 aligned 4 KiB
    rows of the O_DIRECT ExclusiveFile ``f`` at once (their own blocks); every thread ends
    within 60 s and every batch reads back what it wrote."""
    errors: list[BaseException] = []
    f.truncate(threads * rounds * 8 * K)

    def worker(t: int) -> None:
        try:
            rng = np.random.default_rng(t)
            rows = cio.aligned_empty((8, K))
            back = cio.aligned_empty((8, K))
            for i in range(rounds):
                rows[...] = rng.integers(0, 256, (8, 1), dtype=np.uint8)
                offs = (t * rounds + i) * 8 * K + np.arange(8) * K
                assert f.awrite_many(offs, rows).wait(timeout=10) == 8 * K
                assert f.aread_many(offs, back).wait(timeout=10) is back
                assert (back == rows).all()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(60)
    assert not any(th.is_alive() for th in pool)
    assert errors == []


class Escape(BaseException):
    """What a completion callback might let escape (not an Exception)."""


def reaper_lives_on_after_a_callback_escapes(eng, fd: int) -> None:
    """Two reads of the O_DIRECT descriptor ``fd`` that nobody waits for; the first one's
    callback raises a BaseException on the reaper thread. Each must be completed by the
    reaper all the same. While a read is submitted and its callback attached, a helper
    thread holds the engine's token, so nothing delivers it before the callback is on."""
    import time

    from chemio_py.runtime import requests
    buf = cio.aligned_empty(K)
    for k in range(2):
        held, release = threading.Event(), threading.Event()

        def hold(held=held, release=release) -> None:
            with eng._token:
                held.set()
                release.wait(10)
        t = threading.Thread(target=hold)
        t.start()
        try:
            assert held.wait(10)
            req = eng.submit(False, fd, buf.ctypes.data, K, k * K, buf, lambda n, t0, t1: n)
            assert req is not None
            if k == 0:
                req.add_done_callback(lambda r: (_ for _ in ()).throw(Escape("callback")))
        finally:
            release.set()
            t.join(10)
        deadline = time.monotonic() + 10
        while not requests.Request.done(req) and time.monotonic() < deadline:
            time.sleep(0.01)                # (not wait() or done(): they would reap here)
        assert requests.Request.done(req), f"read {k} was not completed by the reaper"
        assert req.wait() == K
