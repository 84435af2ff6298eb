"""Issue 27, item 2: ByteFile's buffer checks, huge read_bytes, size_hint past `ulimit -f`,
and to_dask of an empty but enormous DiskArray."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.errors import ArgumentError, EndOfFileError


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


BAD_OUTS = {
    "bytes": lambda: bytes(16),
    "read-only ndarray": lambda: _read_only(np.zeros(16, "u1")),
    "read-only memoryview": lambda: memoryview(bytes(16)),
    "strided ndarray": lambda: np.zeros(32, "u1")[::2],
    "F-order ndarray": lambda: np.zeros((4, 4), "u1", order="F"),
}


@pytest.mark.parametrize("kind", ["ExclusiveFile", "SharedFile"])
@pytest.mark.parametrize("call", ["read", "aread"])
@pytest.mark.parametrize("bad", list(BAD_OUTS))
def test_read_into_an_unusable_buffer_says_what_to_pass(store, kind, call, bad):
    f = getattr(cio, kind)(f"ro_{call}", backend=store)
    try:
        f.write(0, bytes(range(64)))
        out = BAD_OUTS[bad]()
        with pytest.raises(ArgumentError) as ei:
            r = getattr(f, call)(0, out)
            if call == "aread":
                r.wait()
        msg = str(ei.value)
        assert f"{call}() needs a writable C-contiguous buffer" in msg, msg
        readonly = memoryview(out).readonly
        assert type(out).__name__ in msg and ("read-only" in msg) == readonly, msg
        assert readonly or "strides" in msg, msg
        assert "bytearray(n)" in msg and "np.empty(n, 'u1')" in msg, msg
        assert f.outstanding == 0
        good = np.empty(16, "u1")                     # the file still works
        assert bytes(f.read(0, good)) == bytes(range(16))
    finally:
        f.destroy() if kind == "SharedFile" else f.delete()


def test_read_bytes_past_the_end_is_refused_before_allocating(store):
    with cio.ExclusiveFile("huge_rb", backend=store) as f:
        f.write(0, bytes(100))
        with pytest.raises(EndOfFileError, match="passes the end"):
            f.read_bytes(0, 2**62)                    # was: MemoryError('')
        with pytest.raises(EndOfFileError):
            f.read_bytes(50, 51 + (1 << 21))
        assert f.read_bytes(50, 50) == bytes(50)
        f.delete()


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))


def test_read_bytes_beyond_memory_names_n_and_the_chunked_way():
    # a sparse file of 64 GiB read whole by a process limited to ~1 GiB more address space
    proc = _run("""
        import resource, chemio_py as cio
        from chemio_py.errors import LimitExceededError
        with cio.ExclusiveFile("sparse", backend="local") as f:
            f.truncate(1 << 36)
            vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
            resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
            try:
                f.read_bytes(0, 1 << 35)
            except LimitExceededError as e:
                print("REFUSED", e)
            f.delete()
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip()
    assert line.startswith("REFUSED"), (line, proc.stderr[-2000:])
    assert str(1 << 35) in line and "read(offset, out)" in line and "chunks" in line, line


SIZE_HINT = """
import resource, signal, chemio_py as cio
from chemio_py.errors import LimitExceededError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # (Python's default: EFBIG, not death)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
for be in ("local", "shm"):
    try:
        cio.ExclusiveFile("hinted", "w+", backend=be, size_hint=2 << 20)
        print("ACCEPTED", be)
    except LimitExceededError as e:
        print("REFUSED", be, e)
    print("EXISTS", be, cio.ExclusiveFile.remove("hinted", backend=be))
    with cio.ExclusiveFile("hinted", "w+", backend=be, size_hint=1 << 19) as f:   # fits
        f.write(0, b"x")
        f.delete()
print("DONE")
"""


def test_size_hint_above_the_file_size_limit_is_refused_at_open():
    proc = _run(SIZE_HINT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("DONE"), proc.stdout
    for be in ("local", "shm"):
        refused = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"REFUSED {be} ")]
        assert refused, proc.stdout
        msg = refused[0]
        assert str(2 << 20) in msg and str(1 << 20) in msg and "ulimit -f" in msg, msg
        assert f"EXISTS {be} False" in proc.stdout          # nothing was created


def test_to_dask_of_an_empty_but_enormous_array():
    pytest.importorskip("dask.array")
    d = cio.DiskArray.create("empty_huge", (0, 10**18), "f8")
    try:
        x = d.to_dask()
        assert x.shape == (0, 10**18)
        assert float(x.sum().compute()) == 0.0
    finally:
        d.delete()
