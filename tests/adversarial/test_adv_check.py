"""``chemio check PATH`` on good and damaged DiskArrays and RecordFiles, and hostile paths.

Exit status 0 = fine, 1 = something wrong (named), 2 = not a chemio file / missing path.
Hostile inputs (a FIFO, a link to /dev/zero, sizes claiming gigabytes) must neither hang
nor allocate: they run in child processes with a timeout and a peak-RSS bound.

Most tests call ``chemio_py.tools.check.main(argv)`` directly (the function ``chemio check``
runs); ``test_module_entry_point`` runs ``python -m chemio_py.tools.check`` as a real process;
``test_console_script_once_wired`` runs the ``chemio`` console script and is skipped until
``cli.py`` wires the sub-command in.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import uuid

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.tools import check

MiB = 1 << 20
TIMEOUT = 60


@pytest.fixture
def workdir(tmp_path):
    d = tmp_path / f"c-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run(capsys, *argv) -> tuple[int, str]:
    status = check.main(list(argv))
    out = capsys.readouterr()
    return status, out.out + out.err


def run_json(capsys, path, *extra) -> dict:
    status = check.main(["--json", str(path), *extra])
    out = capsys.readouterr().out
    doc = json.loads(out)                       # exactly one JSON object
    assert doc["status"] == status
    return doc


def _poke(path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- DiskArrays

def make_array(workdir, name="arr", shape=(100, 300), chunks=(10, 300)) -> str:
    d = cio.DiskArray.create(name, shape, "f8", path=str(workdir), chunks=chunks)
    d[0:20] = np.arange(20 * 300, dtype=np.float64).reshape(20, 300) + 1
    d.close()
    return str(workdir / f"{name}.dra")


def test_good_diskarray_by_data_and_by_metadata(workdir, capsys):
    data = make_array(workdir)
    for p in (data, data + ".json"):
        status, out = run(capsys, p)
        assert status == 0, out
        assert "metadata" in out and "exactly 240000 bytes" in out and "result: OK" in out
    doc = run_json(capsys, data, "--read")
    assert doc["ok"] and doc["kind"] == "DiskArray"
    assert doc["facts"]["chunks_all_zero"] == "8 of 10"       # unwritten chunks are fine
    assert any("all zero" in n for n in doc["notes"])


@pytest.mark.parametrize("damage,expect", [
    ("truncate", "truncated"),
    ("extend", "longer than the array"),
    ("no_data", "missing"),
    ("no_meta", "metadata"),
    ("bad_json", "not valid JSON"),
    ("bad_nbytes", "nbytes"),
    ("bad_dtype", "dtype"),
    ("huge_shape", "limit"),
    ("meta_fifo", "FIFO"),
    ("data_link", "symbolic link"),
])
def test_damaged_diskarray_exit_1_naming_the_problem(workdir, capsys, damage, expect):
    data = make_array(workdir)
    mpath = data + ".json"
    doc = json.load(open(mpath))
    target = mpath
    if damage == "truncate":
        os.truncate(data, 239_000)
    elif damage == "extend":
        os.truncate(data, 250_000)
    elif damage == "no_data":
        os.unlink(data)
        target = data                  # named by a data path that is gone: still the array
    elif damage == "no_meta":
        os.unlink(mpath)
        target = data
    elif damage == "bad_json":
        open(mpath, "w").write('{"format": 1, "shape": [100, ')
    elif damage == "bad_nbytes":
        doc["nbytes"] = 12
        json.dump(doc, open(mpath, "w"))
    elif damage == "bad_dtype":
        doc["dtype"] = "|O"
        json.dump(doc, open(mpath, "w"))
    elif damage == "huge_shape":
        doc["shape"], doc["chunks"] = [1 << 40, 1 << 40], [1, 1]
        doc.pop("nbytes")
        json.dump(doc, open(mpath, "w"))
    elif damage == "meta_fifo":
        os.unlink(mpath)
        os.mkfifo(mpath)
        target = data
    elif damage == "data_link":
        os.unlink(data)
        os.symlink("/dev/zero", data)
    status, out = run(capsys, target)
    assert status == 1 and "PROBLEM" in out and "result: DAMAGED" in out, out
    doc = run_json(capsys, target)
    assert doc["status"] == 1 and any(expect in p for p in doc["problems"]), doc


# ---------------------------------------------------------------- RecordFiles

def make_records(workdir, comp=None, n=3000, name="log") -> str:
    with cio.RecordFile(name, "w+", dir=str(workdir), page_size=MiB, compressor=comp) as log:
        for i in range(n):
            log.append(np.arange(i % 300, dtype=np.int64) + i, np.full(i % 100, i * 0.5))
        return log.path


def locate(path):
    from chemio_py.files import recordformat
    data = open(path, "rb").read()
    best = None
    for so in recordformat.SLOT_OFFSETS:
        magic, gen, tpos, flags, crc = recordformat.SLOT.unpack_from(data, so)
        if magic == recordformat.SMAGIC and (best is None or gen > best[0]):
            best = (gen, tpos)
    _, ioff, ilen, _, jlen = struct.unpack_from("<8sQQII", data, best[1])
    head = json.loads(data[ioff:ioff + jlen])
    table = np.frombuffer(data, "<i8", 5 * head["pages"], ioff + jlen).reshape(-1, 5)
    return {"tpos": best[1], "ioff": ioff, "ilen": ilen, "jlen": jlen, "table": table.copy()}


@pytest.mark.parametrize("comp", [None, "zstd"])
def test_good_recordfile(workdir, capsys, comp):
    path = make_records(workdir, comp)
    status, out = run(capsys, path)
    assert status == 0, out
    doc = run_json(capsys, path)
    assert doc["kind"] == "RecordFile" and doc["facts"]["records"] == 3000
    assert doc["facts"]["compressor"] == comp
    assert any("records: all 3000 parse" in c for c in doc["checked"])
    assert any("CRC" in c for c in doc["checked"])


@pytest.mark.parametrize("comp", [None, "zstd"])
@pytest.mark.parametrize("damage,expect", [
    ("index_crc", "checksum"),
    ("stored_crc", "checksum"),
    ("trailer", "trailer"),
    ("torn_last_page", "page "),
    ("truncate", "truncated"),
    ("header", "commit"),
    ("record_prefix", "page 0"),
])
def test_damaged_recordfile_exit_1_naming_the_problem(workdir, capsys, comp, damage, expect):
    path = make_records(workdir, comp)
    loc = locate(path)
    t = loc["table"]
    if damage == "index_crc":
        _poke(path, loc["ioff"] + loc["jlen"] + 9, b"\x5a")        # a byte of the page table
    elif damage == "stored_crc":
        _poke(path, loc["tpos"] + 24, b"\x00\x00\x00\x00")          # the trailer's CRC field
    elif damage == "trailer":
        _poke(path, loc["tpos"], b"NOTAREC!")
    elif damage == "torn_last_page":
        off, stored = int(t[-1, 0]), int(t[-1, 1])
        _poke(path, off + stored // 2, bytes(min(512, stored - stored // 2)))
    elif damage == "truncate":
        off, stored = int(t[-1, 0]), int(t[-1, 1])
        os.truncate(path, off + stored // 2)                      # inside the last page
    elif damage == "header":
        _poke(path, 512, b"\xff" * 40)                            # the only commit slot
    elif damage == "record_prefix":
        _poke(path, int(t[0, 0]) if comp is None else int(t[0, 0]) + 40, b"\x01\x02\x03\x04")
    status, out = run(capsys, path)
    assert status == 1 and "PROBLEM" in out and "result: DAMAGED" in out, out
    doc = run_json(capsys, path)
    assert any(expect in p for p in doc["problems"]), doc["problems"]


def test_recovered_commit_and_uncommitted_tail(workdir, capsys):
    """A newest plain commit that is damaged: the file opens at the previous commit, and
    check says so (exit 1). An uncommitted tail after the last commit is only a note."""
    where = str(workdir)
    with cio.RecordFile("two", "w+", dir=where, page_size=MiB) as log:
        for i in range(2000):
            log.append(np.arange(i % 300) + i)
            if i == 999:
                log.flush(durable=True)
        log.flush()
        snap = str(workdir / "tail.0")
        for i in range(2000, 4000):
            log.append(np.arange(i % 300) + i)
        log._wb.flush()                             # pages written, no commit yet
        shutil.copyfile(log.path, snap)             # what a SIGKILL now would leave
        path = log.path
    status, out = run(capsys, snap)
    assert status == 0 and "never committed" in out, out
    loc = locate(path)
    _poke(path, loc["ioff"] + 2, b"\xee")
    status, out = run(capsys, path)
    assert status == 1 and "previous commit" in out and "2000 records" in out, out


# ---------------------------------------------------------------- usage errors, hostile

def test_usage_errors_exit_2(workdir, capsys):
    junk = workdir / "junk.bin"
    junk.write_bytes(os.urandom(5000))
    os.mkfifo(workdir / "fifo")
    os.symlink("/dev/zero", workdir / "zero")
    (workdir / "adir").mkdir()
    for p, expect in ((workdir / "missing", "does not exist"), (junk, "not a chemio file"),
                      (workdir / "fifo", "FIFO"), (workdir / "zero", "symbolic link"),
                      (workdir / "adir", "directory")):
        status, out = run(capsys, str(p))
        assert status == 2 and expect in out, out
        doc = run_json(capsys, p)
        assert doc["status"] == 2 and expect in doc["usage_error"]
    assert check.main([]) == 2                         # no PATH: argparse usage error
    capsys.readouterr()


HOSTILE_CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
def peak_mb():
    # Peak RSS of this process since exec: VmHWM (ru_maxrss also counts the RSS of the
    # forked parent that exec'd us, here the whole pytest process).
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
from chemio_py.tools import check
t0 = time.monotonic()
status = check.main(["--json", sys.argv[1]])
sys.stdout.flush()
print(json.dumps({"status": status, "secs": time.monotonic() - t0,
                  "maxrss_mb": peak_mb()}))
"""


def _child(path, workdir) -> tuple[dict, dict]:
    env = dict(os.environ, CHEMIO_SCRATCH=str(workdir))
    p = subprocess.run([sys.executable, "-c", HOSTILE_CHILD, str(path)], capture_output=True,
                       text=True, timeout=TIMEOUT, env=env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    return json.loads(lines[-2]), json.loads(lines[-1])


@pytest.mark.parametrize("field", ["payload", "header", "shape", "index_len", "page_raw"])
def test_hostile_sizes_fail_fast_with_little_memory(workdir, field):
    with cio.RecordFile("h", "w+", dir=str(workdir)) as log:
        log.append(np.arange(3, dtype=np.int64), np.array([1.5]))
        path = log.path
    loc = locate(path)
    at = int(loc["table"][0, 0])
    if field == "payload":
        _poke(path, at + 8, struct.pack("<Q", 4 << 30))
    elif field == "header":
        _poke(path, at + 4, struct.pack("<I", (1 << 32) - 8))
    elif field == "shape":
        _poke(path, at + 16 + 2 + 3, struct.pack("<q", 1 << 62))     # '<i8' then the shape
    elif field == "index_len":
        _poke(path, loc["tpos"] + 16, struct.pack("<Q", 1 << 40))
    elif field == "page_raw":
        _poke(path, loc["ioff"] + loc["jlen"] + 16, struct.pack("<q", 1 << 40))
    doc, res = _child(path, workdir)
    assert res["status"] == 1 and doc["problems"], doc
    assert res["maxrss_mb"] < 200 and res["secs"] < 10, res


def test_fifo_metadata_and_zero_link_do_not_hang(workdir):
    os.mkfifo(workdir / "a.dra.json")
    (workdir / "a.dra").write_bytes(bytes(64))
    os.symlink("/dev/zero", workdir / "b.dra")
    doc, res = _child(workdir / "a.dra", workdir)
    assert res["status"] == 1 and "FIFO" in doc["problems"][0], doc
    doc, res = _child(workdir / "b.dra", workdir)
    assert res["status"] == 2 and "symbolic link" in doc["usage_error"], doc
    assert res["maxrss_mb"] < 200


# ---------------------------------------------------------------- entry points

def test_module_entry_point(workdir):
    """A real process: ``python -m chemio_py.tools.check PATH`` (works before cli.py is wired)."""
    path = make_records(workdir, "zstd", n=500)
    env = dict(os.environ, CHEMIO_SCRATCH=str(workdir))
    p = subprocess.run([sys.executable, "-m", "chemio_py.tools.check", path], capture_output=True,
                       text=True, timeout=TIMEOUT, env=env)
    assert p.returncode == 0 and "result: OK" in p.stdout, p.stdout + p.stderr
    _poke(path, locate(path)["tpos"], b"XXXXXXXX")
    p = subprocess.run([sys.executable, "-m", "chemio_py.tools.check", "--json", path],
                       capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert p.returncode == 1 and json.loads(p.stdout)["problems"], p.stdout + p.stderr


def _chemio_script() -> str | None:
    cand = os.path.join(os.path.dirname(sys.executable), "chemio")
    return cand if os.path.exists(cand) else shutil.which("chemio")


def test_console_script_once_wired(workdir):
    """``chemio check PATH`` through the console script: skipped until cli.py has it."""
    exe = _chemio_script()
    if exe is None:
        pytest.skip("no chemio console script installed")
    env = dict(os.environ, CHEMIO_SCRATCH=str(workdir))
    probe = subprocess.run([exe, "check", "--help"], capture_output=True, text=True,
                           timeout=TIMEOUT, env=env)
    if probe.returncode != 0:
        pytest.skip("cli.py does not wire 'chemio check' in yet")
    data = make_array(workdir)
    p = subprocess.run([exe, "check", data], capture_output=True, text=True, timeout=TIMEOUT,
                       env=env)
    assert p.returncode == 0 and "result: OK" in p.stdout, p.stdout + p.stderr
    os.truncate(data, 1000)
    p = subprocess.run([exe, "check", "--json", data], capture_output=True, text=True,
                       timeout=TIMEOUT, env=env)
    assert p.returncode == 1 and "truncated" in json.loads(p.stdout)["problems"][0]
    p = subprocess.run([exe, "check", str(workdir / "nope")], capture_output=True, text=True,
                       timeout=TIMEOUT, env=env)
    assert p.returncode == 2
