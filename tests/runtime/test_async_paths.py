"""The three ways an async call completes: inline from the page cache, Linux AIO for
aligned O_DIRECT requests, the I/O pool for the rest — all with the same results."""
import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime.trace import trace_events
from chemio_py.backends.local import linux_aio


def test_cached_read_completes_inline():
    with cio.ExclusiveFile("inline", "w+") as f:
        f.write(0, np.arange(1000.0))
        req = f.aread(800, np.empty(10))
        assert req.done()                          # no thread hand-off for cached data
        np.testing.assert_array_equal(req.wait(), np.arange(100.0, 110.0))
        f.delete()


@pytest.mark.skipif(linux_aio.engine() is None, reason="no Linux AIO on this kernel/arch")
def test_direct_aligned_requests_use_linux_aio(tmp_path):
    trace = tmp_path / "t.json"
    cio.configure(trace=str(trace))
    try:
        n = 64
        data = [cio.aligned_empty(4096, np.uint8) for _ in range(n)]
        for i, d in enumerate(data):
            d[:] = i
        with cio.ExclusiveFile("aio", "w+", dir=str(tmp_path), direct=True) as f:
            if f.store._dfd is None:
                pytest.skip("this file system refuses O_DIRECT")
            cio.waitall([f.awrite(i * 4096, data[i]) for i in range(n)])
            f.store.evict()
            outs = [cio.aligned_empty(4096, np.uint8) for _ in range(n)]
            reqs = [f.aread(i * 4096, outs[i]) for i in reversed(range(n))]
            cio.waitall(reqs)
            for i in range(n):
                assert (outs[i] == i).all()
            # aligned but past the end: a short AIO read becomes EndOfFileError at wait()
            late = f.aread(n * 4096, cio.aligned_empty(4096, np.uint8))
            with pytest.raises(cio.EndOfFileError):
                late.wait()
            unaligned = f.aread(100, bytearray(50))      # falls back to the pool/cache
            assert bytes(unaligned.wait()) == bytes([0] * 50)
            st = f.stats.as_dict()
            f.delete()
        events = trace_events()
        aio = [e for e in events if e["tid"] == "chemio-aio"]
        assert len([e for e in aio if e["name"] == "write"]) == n
        assert len([e for e in aio if e["name"] == "read"]) >= n
        assert st["bytes_written"] == n * 4096 and st["reads"] >= n + 1
    finally:
        cio.configure(trace=None)


def test_sync_mode_bypasses_aio_and_pool(tmp_path):
    cio.configure(sync=True)
    try:
        buf = cio.aligned_empty(4096, np.uint8)
        buf[:] = 7
        with cio.ExclusiveFile("syncaio", "w+", dir=str(tmp_path), direct=True) as f:
            w = f.awrite(0, buf)
            assert w.done() and w.wait() == 4096
            r = f.aread(0, cio.aligned_empty(4096, np.uint8))
            assert r.done() and (r.wait() == 7).all()
            f.delete()
    finally:
        cio.configure(sync=None)
