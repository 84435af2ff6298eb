"""RecordFile under real failures and hostile files (issue 11, items 5 and 11).

Item 5: a durable flush is a promise. After ``flush(durable=True)`` a SIGKILL, an ENOSPC on
a real (tiny) tmpfs or a failing later flush must leave every record up to that flush
readable on reopen: the reopened file shows exactly the records of the last complete
commit (at least those of the durable flush), each equal to what was appended (a model).

Item 11: every size read from the file is checked against the file before anything is
allocated. Hostile variants of real files (one field changed) must raise a ChemIOError
quickly in a child process whose peak RSS stays small.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
import zlib

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.errors import ArgumentError, ChemIOError, MetadataError

MiB = 1 << 20
TIMEOUT = 120


# ---------------------------------------------------------------- the model

MODEL_SRC = """
import numpy as np

def rec(i):
    '''Record i of the model: the same arrays in every process that asks.'''
    rng = np.random.default_rng(i)
    return (np.arange(i % 50, dtype=np.int32) + i, rng.random(500 + (i * 37) % 3000),
            np.full((2, i % 3), i, np.int16))
"""
exec(MODEL_SRC)                                   # defines rec(i) here as in the children


def check_prefix(log, at_least: int) -> int:
    """The records of ``log`` are rec(0), rec(1), ... and there are at least ``at_least``."""
    n = len(log)
    assert n >= at_least, f"{n} records after reopening, expected at least {at_least}"
    k = 0
    for got in log.replay():
        want = rec(k)  # noqa: F821 - defined by exec(MODEL_SRC)
        assert len(got) == len(want), f"record {k}"
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, f"record {k}"
            assert np.array_equal(a, b), f"record {k} differs from what was appended"
        k += 1
    assert k == n
    return n


@pytest.fixture
def workdir(tmp_path):
    """A directory for the test's files (removed afterwards, nothing left in /tmp)."""
    d = tmp_path / f"w-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _child_env(workdir) -> dict:
    env = dict(os.environ)
    scr = workdir / "scratch"
    scr.mkdir(exist_ok=True)
    env["CHEMIO_SCRATCH"] = str(scr)     # a killed child leaves its job dir here, not in ours
    env.pop("CHEMIO_SYNC", None)
    return env


# ---------------------------------------------------------------- item 5: SIGKILL

CHILD = MODEL_SRC + """
import sys, time
import chemio_py as cio
d, comp, after = sys.argv[1], sys.argv[2], sys.argv[3]
log = cio.RecordFile("log", "w+", dir=d, page_size=1 << 20,
                     compressor=None if comp == "none" else comp)
for i in range(100):
    log.append(*rec(i))
log.flush(durable=True)
if after == "reopen":                   # closed, reopened to append: r+ must not overwrite
    log.append(*rec(100))
    log.close()
    log = cio.RecordFile("log", "r+", dir=d)
print("durable", flush=True)
i = len(log)
while i < 200_000:
    log.append(*rec(i))
    i += 1
    if after in ("flushes", "reopen") and i % 37 == 0:
        log.flush()
    elif after == "durable" and i % 53 == 0:
        log.flush(durable=True)
    if i == 400:
        print("more", flush=True)
time.sleep(600)
"""


def _run_and_kill(workdir, comp: str, after: str, delay: float) -> None:
    script = workdir / "child.py"
    script.write_text(CHILD)
    p = subprocess.Popen([sys.executable, str(script), str(workdir), comp, after],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_child_env(workdir))
    try:
        t0 = time.monotonic()
        seen = []
        while "more" not in seen:
            line = p.stdout.readline().strip()
            if not line:
                if p.poll() is not None:
                    pytest.fail(f"child ended early ({p.returncode}): {p.stderr.read()}")
                if time.monotonic() - t0 > TIMEOUT:
                    pytest.fail("child did not reach its later appends in time")
                continue
            seen.append(line)
        time.sleep(delay)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=TIMEOUT)
        assert p.returncode == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()


@pytest.mark.parametrize("comp", ["none", "zstd"])
@pytest.mark.parametrize("after,delay", [("appends", 0.0), ("appends", 0.3),
                                         ("flushes", 0.05), ("flushes", 0.4),
                                         ("durable", 0.2), ("reopen", 0.1)])
def test_sigkill_after_durable_flush_keeps_its_records(workdir, comp, after, delay):
    """A real SIGKILL while appending (and flushing) after flush(durable=True): reopen
    shows at least the 100 durable records, all correct, and nothing that was not written."""
    _run_and_kill(workdir, comp, after, delay)
    with cio.RecordFile("log", "r", dir=str(workdir)) as log:
        n = check_prefix(log, 100)
    if after == "appends":
        assert n == 100                        # nothing after the durable flush was indexed
    if after == "reopen":
        assert n >= 101                        # the close committed one more
    with cio.RecordFile("log", "r+", dir=str(workdir)) as log:   # and it can be continued
        for i in range(n, n + 30):
            log.append(*rec(i))  # noqa: F821
    with cio.RecordFile("log", "r", dir=str(workdir)) as log:
        assert check_prefix(log, n + 30) == n + 30


# ---------------------------------------------------------------- item 5: ENOSPC

@pytest.fixture
def tiny_fs(make_tmpfs):
    """A real 8 MiB tmpfs (root), else None (fault injection)."""
    return make_tmpfs("8m")


@pytest.fixture
def enospc_past(monkeypatch):
    """Fault injection at the syscall when tmpfs cannot be mounted: writes that would take
    the file past ``limit`` bytes fail with ENOSPC (as a full file system would)."""
    from chemio_py.backends.local import backend as local

    def install(limit: int) -> None:
        real_pwrite, real_pwritev = os.pwrite, os.pwritev

        def too_far(offset, n):
            return offset + n > limit

        def pwrite(fd, data, offset, *a):
            if too_far(offset, memoryview(data).nbytes):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_pwrite(fd, data, offset, *a)

        def pwritev(fd, bufs, offset, *a):
            if too_far(offset, sum(memoryview(b).nbytes for b in bufs)):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_pwritev(fd, bufs, offset, *a)

        class OS:
            def __getattr__(self, name):
                return getattr(os, name)
        fake = OS()
        fake.pwrite, fake.pwritev = pwrite, pwritev
        monkeypatch.setattr(local, "os", fake)
    return install


def _is_enospc(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    return False


@pytest.mark.parametrize("comp", [None, "zstd"])
@pytest.mark.parametrize("later", ["appends", "flushes"])
def test_enospc_after_durable_flush_keeps_its_records(tiny_fs, enospc_past, workdir, comp,
                                                      later):
    """Append until the (real) file system is full after a durable flush; close raises a
    clear error or succeeds; reopen replays the 100 durable records (or more), all correct."""
    if tiny_fs is None:
        enospc_past(8 * MiB)
        where = str(workdir)
    else:
        where = tiny_fs
    log = cio.RecordFile("log", "w+", dir=where, page_size=MiB, compressor=comp)
    for i in range(100):
        log.append(*rec(i))  # noqa: F821
    log.flush(durable=True)
    err = None
    try:
        for i in range(100, 20_000):
            log.append(*rec(i))  # noqa: F821
            if later == "flushes" and i % 41 == 0:
                log.flush()
    except (ChemIOError, OSError) as e:
        err = e
    assert err is not None and _is_enospc(err), f"expected ENOSPC, got {err!r}"
    with pytest.raises((ChemIOError, OSError)) as ei:       # the failure sticks
        log.append(*rec(0))  # noqa: F821
    assert _is_enospc(ei.value)
    try:
        log.close()
    except (ChemIOError, OSError) as e:                     # may raise: clearly, not lose
        assert _is_enospc(e), f"close raised something unclear: {e!r}"
    assert log.closed
    with cio.RecordFile("log", "r", dir=where) as back:
        n = check_prefix(back, 100)
    if later == "appends":
        assert n == 100
    cio.RecordFile.remove("log", dir=where)


def test_failed_later_flush_keeps_the_durable_records(workdir, monkeypatch):
    """A later flush that fails half-way through its index (EIO on that write) leaves the
    durable commit readable."""
    from chemio_py.backends.local import backend as local
    where = str(workdir)
    real_pwrite, real_pwritev = os.pwrite, os.pwritev
    armed = []

    class OS:
        def __getattr__(self, name):
            return getattr(os, name)

        def pwrite(self, fd, data, offset, *a):     # the index is the small write at the end
            n = memoryview(data).nbytes
            if armed and n < 64 * 1024:
                real_pwrite(fd, bytes(memoryview(data).cast("B")[:n // 2]), offset)  # half lands
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_pwrite(fd, data, offset, *a)

        def pwritev(self, fd, bufs, offset, *a):
            if armed and len(bufs) == 1:
                return self.pwrite(fd, bufs[0], offset)
            return real_pwritev(fd, bufs, offset, *a)
    monkeypatch.setattr(local, "os", OS())           # before open: the fast path binds it
    log = cio.RecordFile("log", "w+", dir=where, page_size=MiB)
    for i in range(100):
        log.append(*rec(i))  # noqa: F821
    log.flush(durable=True)
    for i in range(100, 300):
        log.append(*rec(i))  # noqa: F821
    armed.append(True)
    with pytest.raises(OSError):
        log.flush()
    monkeypatch.undo()
    try:
        log.close()
    except (ChemIOError, OSError):
        pass
    with cio.RecordFile("log", "r", dir=where) as back:
        assert check_prefix(back, 100) == 100


def test_durable_then_plain_flushes_each_reopen_consistently(workdir):
    """Copies of the file taken after each step (what a crash right then would leave)
    reopen with exactly the records committed by then."""
    where = str(workdir)
    snaps = []
    with cio.RecordFile("log", "w+", dir=where, page_size=MiB, compressor="zstd") as log:
        for i in range(450):
            log.append(*rec(i))  # noqa: F821
            if i in (99, 100, 180, 181, 330):
                log.flush(durable=(i == 99))
            if i in (99, 150, 181, 250, 449):
                snaps.append((i, _snapshot(log.path, workdir)))
    committed = {99: 100, 150: 101, 181: 182, 250: 182, 449: 331}
    for i, snap in snaps:
        with cio.RecordFile(os.path.basename(snap)[:-2], "r", dir=where) as back:
            assert check_prefix(back, committed[i]) == committed[i], f"snapshot at {i}"


def _snapshot(path: str, workdir) -> str:
    name = f"snap{uuid.uuid4().hex[:6]}.0"
    dst = os.path.join(str(workdir), name)
    shutil.copyfile(path, dst)
    return dst


# ---------------------------------------------------------------- recovery policy

def _two_commits(where: str, durable_last: bool) -> str:
    with cio.RecordFile("two", "w+", dir=where, page_size=MiB) as log:
        for i in range(100):
            log.append(*rec(i))  # noqa: F821
        log.flush(durable=True)
        for i in range(100, 150):
            log.append(*rec(i))  # noqa: F821
        log.flush(durable=durable_last)
        path = log.path
    return path


def test_damaged_newest_plain_commit_falls_back_with_a_warning(workdir):
    path = _two_commits(str(workdir), durable_last=False)
    loc = locate(path)
    _poke(path, loc["ioff"] + 3, b"\xff")                 # the newest index fails its CRC
    with pytest.warns(UserWarning, match="previous commit"):
        back = cio.RecordFile("two", "r", dir=str(workdir))
    with back:
        assert check_prefix(back, 100) == 100


def test_damaged_newest_durable_commit_is_an_error(workdir):
    path = _two_commits(str(workdir), durable_last=True)
    loc = locate(path)
    _poke(path, loc["ioff"] + 3, b"\xff")
    with pytest.raises(MetadataError, match="checksum"):
        cio.RecordFile("two", "r", dir=str(workdir))


# ---------------------------------------------------------------- format helpers (tests)

def locate(path: str) -> dict:
    """Where the committed index of a record file is (the documented layout)."""
    from chemio_py.files import recordformat
    data = open(path, "rb").read()
    hdr = getattr(recordformat, "HMAGIC", None)
    if hdr is not None and data[:8] == hdr:
        best = None
        for so in recordformat.SLOT_OFFSETS:
            magic, gen, tpos, flags, crc = recordformat.SLOT.unpack_from(data, so)
            body = data[so:so + recordformat.SLOT.size - 4]
            if magic == recordformat.SMAGIC and zlib.crc32(body) == crc:
                if best is None or gen > best[0]:
                    best = (gen, tpos, so)
        tpos = best[1]
        slot = best[2]
    else:
        tpos, slot = len(data) - 32, None
    magic, ioff, ilen, crc, jlen = struct.unpack_from("<8sQQII", data, tpos)
    head = json.loads(data[ioff:ioff + jlen])
    ncol = (ilen - jlen) // 8 // max(head["pages"], 1) if head["pages"] else 4
    table = np.frombuffer(data, "<i8", ncol * head["pages"], ioff + jlen).reshape(-1, ncol)
    return {"tpos": tpos, "ioff": ioff, "ilen": ilen, "jlen": jlen, "head": head,
            "table": table.copy(), "ncol": ncol, "slot": slot}


def _poke(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _rewrite_index(path: str, loc: dict, head: dict | None = None,
                   table: np.ndarray | None = None, ilen: int | None = None) -> None:
    """Replace the committed index (same length) and fix its CRC: a hostile but
    self-consistent file."""
    data = bytearray(open(path, "rb").read())
    ioff, jlen = loc["ioff"], loc["jlen"]
    if head is not None:
        js = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
        js = js + b" " * (jlen - len(js))
        assert len(js) == jlen, "hostile header must not be longer than the real one"
        data[ioff:ioff + jlen] = js
    if table is not None:
        tb = table.astype("<i8").tobytes()
        data[ioff + jlen:ioff + jlen + len(tb)] = tb
    blob = bytes(data[ioff:ioff + loc["ilen"]])
    struct.pack_into("<8sQQII", data, loc["tpos"], b"CIOREC01", ioff,
                     loc["ilen"] if ilen is None else ilen, zlib.crc32(blob), jlen)
    open(path, "wb").write(bytes(data))


# ---------------------------------------------------------------- item 11: hostile sizes

HOSTILE_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))   # a bug fails, not the machine
def peak_mb():
    # Peak RSS of this process since exec: VmHWM (ru_maxrss also counts the RSS of the
    # forked parent that exec'd us, here the whole pytest process).
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
import chemio_py as cio
d = sys.argv[1]
t0 = time.monotonic()
kind = "none"
try:
    with cio.RecordFile("h", "r", dir=d) as log:
        for rec in log.replay():
            pass
    msg = "opened and replayed without an error"
except BaseException as e:
    kind = "chemio" if isinstance(e, cio.ChemIOError) else type(e).__name__
    msg = f"{type(e).__name__}: {e}"
print(json.dumps({"kind": kind, "msg": msg, "secs": time.monotonic() - t0,
                  "maxrss_mb": peak_mb()}))
"""


def _small_file(where: str, comp=None, recs=None) -> str:
    with cio.RecordFile("h", "w+", dir=where, compressor=comp) as log:
        for r in recs or [(np.arange(3, dtype=np.int64), np.array([1.5]))]:
            log.append(*r)
        return log.path


def _prefix_at(path: str) -> int:
    loc = locate(path)
    return int(loc["table"][0, 0])          # page 0 starts with the first record's prefix


def _set_prefix(path, **fields):
    at = _prefix_at(path)
    data = open(path, "rb").read()
    magic, na, hl, pl = struct.unpack_from("<HHIQ", data, at)
    vals = {"na": na, "hl": hl, "pl": pl}
    vals.update(fields)
    _poke(path, at, struct.pack("<HHIQ", magic, vals["na"], vals["hl"], vals["pl"]))


def _set_desc(path, array: int = 0, ndim=None, shape=None):
    at = _prefix_at(path) + 16
    data = bytearray(open(path, "rb").read())
    q = at
    for _ in range(array):
        dl, nd = data[q], data[q + 1]
        q += 2 + dl + 8 * nd
    dl, nd = data[q], data[q + 1]
    if ndim is not None:
        data[q + 1] = ndim
    if shape is not None:
        struct.pack_into(f"<{len(shape)}q", data, q + 2 + dl, *shape)
    open(path, "wb").write(bytes(data))


def _hostile(kind: str, path: str) -> None:
    if kind == "payload_4g":
        _set_prefix(path, pl=(4 << 30) + 8)
    elif kind == "payload_max":
        _set_prefix(path, pl=(1 << 64) - 8)
    elif kind == "header_4g":
        _set_prefix(path, hl=(1 << 32) - 8)
    elif kind == "n_arrays":
        _set_prefix(path, na=0xFFFF)
    elif kind == "ndim":
        _set_desc(path, ndim=64)
    elif kind == "ndim_255":
        _set_desc(path, ndim=255)
    elif kind == "shape_overflow":
        _set_desc(path, shape=[1 << 62])
    elif kind == "shape_negative":
        _set_desc(path, shape=[-(1 << 40)])
    elif kind == "index_length":
        loc = locate(path)
        _rewrite_index(path, loc, ilen=1 << 40)
    elif kind in ("page_raw", "page_stored", "page_offset"):
        loc = locate(path)
        t = loc["table"]
        col = {"page_raw": 2, "page_stored": 1, "page_offset": 0}[kind]
        t[0, col] = 1 << 40
        _rewrite_index(path, loc, table=t)
    elif kind == "stream_bytes":
        loc = locate(path)
        h = dict(loc["head"])
        h["stream_bytes"] = 1 << 40
        _rewrite_index(path, loc, head=h)
    elif kind == "page_size_records":
        loc = locate(path)
        h = dict(loc["head"])
        h["records"] = (1 << 40)
        _rewrite_index(path, loc, head=h)
    else:
        raise AssertionError(kind)


HOSTILE = ["payload_4g", "payload_max", "header_4g", "n_arrays", "ndim", "ndim_255",
           "shape_overflow", "shape_negative", "index_length", "page_raw", "page_stored",
           "page_offset", "stream_bytes", "page_size_records"]


def run_hostile(where: str, env: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", HOSTILE_CHILD, where], capture_output=True,
                       text=True, timeout=TIMEOUT, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_sizes_fail_fast_with_little_memory(workdir, kind):
    where = str(workdir)
    path = _small_file(where)
    _hostile(kind, path)
    res = run_hostile(where, _child_env(workdir))
    assert res["kind"] == "chemio", res
    assert res["maxrss_mb"] < 200, res
    assert res["secs"] < 10, res
    assert "damaged" in res["msg"] or "hostile" in res["msg"] or "index" in res["msg"], res


def test_record_larger_than_the_rest_of_the_stream_spanning_pages(workdir):
    """A prefix claiming more than the stream holds, in a file of several pages, raises
    before gathering (the gather path, not the in-page path)."""
    where = str(workdir)
    big = np.random.default_rng(0).random(300_000)          # 2.4 MB: spans 3 pages of 1 MiB
    with cio.RecordFile("h", "w+", dir=where, page_size=MiB) as log:
        log.append(np.arange(5))
        log.append(big)
        path = log.path
    at = _prefix_at(path)
    data = open(path, "rb").read()
    _, _, hl, pl = struct.unpack_from("<HHIQ", data, at)
    second = at + 16 + hl + pl
    magic, na, hl2, pl2 = struct.unpack_from("<HHIQ", data, second)
    _poke(path, second, struct.pack("<HHIQ", magic, na, hl2, (3 << 30) + 8))
    res = run_hostile(where, _child_env(workdir))
    assert res["kind"] == "chemio" and res["maxrss_mb"] < 200, res


def test_short_decompression_is_detected(workdir):
    """A compressed page replaced by a valid frame that decodes to fewer bytes than the
    page holds (its first half) must raise, never replay stale buffer bytes as records."""
    import numcodecs
    where = str(workdir)
    recs = [(np.full(1000 + i % 7, i, np.float64),) for i in range(700)]   # ~5.6 MiB
    with cio.RecordFile("h", "w+", dir=where, page_size=MiB, compressor="zstd") as log:
        for r in recs:
            log.append(*r)
        path = log.path
    loc = locate(path)
    t = loc["table"]
    k = 3                                   # its ring buffer held page 0 before
    off, stored, raw = (int(x) for x in t[k, :3])
    codec = numcodecs.Zstd(level=1)
    page = np.frombuffer(open(path, "rb").read()[off:off + stored], np.uint8)
    true = np.frombuffer(bytes(codec.decode(page)), np.uint8)
    short = codec.encode(true[:raw // 2].copy())
    assert len(short) <= stored
    _poke(path, off, short)
    t[k, 1] = len(short)
    _rewrite_index(path, loc, table=t)
    got = 0
    with cio.RecordFile("h", "r", dir=where) as back, pytest.raises(MetadataError):
        for rec_ in back.replay():
            assert np.array_equal(rec_[0], recs[got][0]), f"record {got} replayed wrong"
            got += 1


# ---------------------------------------------------------------- format 1 files

def test_format1_file_replays_and_refuses_append(workdir):
    """A file in the earlier layout (no header, pages at i * page_size, trailer at the end,
    no page checksums) is still replayed; appending to it is refused with a clear error."""
    where = str(workdir)
    recs = [(np.arange(i % 40) + i, np.full(3, i * 0.5)) for i in range(500)]
    with cio.RecordFile("new", "w+", dir=where, page_size=MiB) as log:
        for r in recs:
            log.append(*r)
        path = log.path
    loc = locate(path)
    off, stored, raw = (int(x) for x in loc["table"][0, :3])
    stream = open(path, "rb").read()[off:off + raw]
    head = json.dumps({"format": "chemio.records", "version": 1, "page_size": MiB,
                       "compressor": None, "records": 500, "stream_bytes": raw, "pages": 1},
                      sort_keys=True).encode()
    blob = head + np.array([[0, raw, raw, 0]], "<i8").tobytes()
    old = stream + blob + struct.pack("<8sQQII", b"CIOREC01", raw, len(blob), zlib.crc32(blob),
                                      len(head))
    (workdir / "old.0").write_bytes(old)
    with cio.RecordFile("old", "r", dir=where) as back:
        got = [tuple(a.copy() for a in r) for r in back.replay()]
    assert len(got) == 500 and all(np.array_equal(a, b) for g, r in zip(got, recs)
                                   for a, b in zip(g, r))
    with pytest.raises(cio.ModeError, match="format 1"):
        cio.RecordFile("old", "r+", dir=where)
    from chemio_py.tools import check
    rep = check.check_path(str(workdir / "old.0"))
    assert rep.status == 0 and rep.facts["format"] == 1 and rep.facts["records"] == 500


# ---------------------------------------------------------------- page checksum algorithms

@pytest.mark.parametrize("algo", ["crc32c", "crc32"])
def test_damaged_page_is_detected_with_each_checksum(workdir, algo):
    """One flipped bit inside a page fails the replay with the algorithm the file names,
    and ``chemio check`` reports it; the same file undamaged replays."""
    where = str(workdir)
    recs = [(np.arange(i % 300, dtype=np.int64), np.full(7, i * 0.25)) for i in range(4000)]
    with cio.RecordFile("crc", "w+", dir=where, page_size=1 << 20, checksum=algo) as log:
        for r in recs:
            log.append(*r)
        path = log.path
        assert log.checksum == algo
    loc = locate(path)
    assert loc["head"]["checksum"] == algo and len(loc["table"]) >= 2
    with cio.RecordFile("crc", "r", dir=where) as back:
        assert back.checksum == algo and sum(1 for _ in back.replay()) == len(recs)
    off = int(loc["table"][1, 0]) + 5000               # inside the second page's bytes
    byte = open(path, "rb").read()[off]
    _poke(path, off, bytes([byte ^ 0x10]))
    with cio.RecordFile("crc", "r", dir=where) as back:
        with pytest.raises(MetadataError, match=f"page 1 .* fails its {algo} checksum"):
            for _ in back.replay():
                pass
    from chemio_py.tools import check
    rep = check.check_path(path)
    assert rep.status != 0 and f"fails its {algo} checksum" in str(rep.problems)


def test_index_without_a_checksum_name_is_read_as_crc32(workdir):
    """Files written before the index named its page checksum (zlib CRC-32 pages, no
    ``checksum`` key) replay, append (``r+``, staying CRC-32) and pass ``chemio check``."""
    where = str(workdir)
    recs = [(np.arange(i % 200), np.full(3, i * 0.5)) for i in range(3000)]
    with cio.RecordFile("legacy", "w+", dir=where, page_size=1 << 20, checksum="crc32") as log:
        for r in recs:
            log.append(*r)
        path = log.path
    loc = locate(path)
    head = dict(loc["head"])
    del head["checksum"]
    _rewrite_index(path, loc, head=head)
    assert "checksum" not in locate(path)["head"]
    with cio.RecordFile("legacy", "r+", dir=where) as log:
        assert log.checksum == "crc32"
        log.append(np.arange(5), np.zeros(3))
    with cio.RecordFile("legacy", "r", dir=where) as back:
        got = [tuple(a.copy() for a in r) for r in back.replay()]
    assert len(got) == len(recs) + 1
    assert all(np.array_equal(a, b) for g, r in zip(got, recs) for a, b in zip(g, r))
    assert locate(path)["head"]["checksum"] == "crc32"
    from chemio_py.tools import check
    assert check.check_path(path).status == 0


def test_unknown_checksum_algorithm_is_refused(workdir):
    """An index naming a checksum this version does not know is refused on open (it is
    not replayed unchecked), with the name and what to do; nothing is changed."""
    where = str(workdir)
    with cio.RecordFile("alien", "w+", dir=where, page_size=1 << 20) as log:
        for i in range(100):
            log.append(np.arange(i))
        path = log.path
    loc = locate(path)
    head = dict(loc["head"], checksum="xxh3")
    _rewrite_index(path, loc, head=head)
    before = open(path, "rb").read()
    for mode in ("r", "r+"):
        with pytest.raises(MetadataError, match="page checksum 'xxh3'.*does not know"):
            cio.RecordFile("alien", mode, dir=where)
    assert open(path, "rb").read() == before
    with pytest.raises(ArgumentError, match="checksum .md5. is not known"):
        cio.RecordFile("other", "w+", dir=where, checksum="md5")
    assert not os.path.exists(os.path.join(where, "other.0"))
