"""Issue 27: one hardened reader for every untrusted input, run against one fuzz corpus.

Every reader of a file chemio did not necessarily write -- DiskArray metadata
(``DiskArray.open``), ``chemio.toml`` (``chemio config --check`` and lookups), job markers
and leases (``chemio clean``, ``chemio ls``), traces (``chemio trace``) and the header of a
RecordFile index -- meets every input of ``tests/fuzz_corpus.py``: deep, huge, overflowing,
NaN, wrong-typed, binary, UTF-16, empty, a FIFO, a symbolic link to ``/dev/zero``, a
directory. Each must end with the chemio error naming the file (or a reported skip), never
a traceback of ``RecursionError``/``OverflowError``/``ValueError``/``UnicodeDecodeError``,
never a hang, and with a bounded peak RSS: the readers run in subprocesses of a wrapper
process that reports ``getrusage(RUSAGE_CHILDREN).ru_maxrss``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.scratch import fs
from fuzz_corpus import (Hostile, json_corpus, set_first_record_shape,
                         set_record_index_header, toml_corpus)

RAW = ("Traceback", "RecursionError", "OverflowError", "UnicodeDecodeError", "MemoryError")
PEAK_MB = 300                   # a Python with NumPy and chemio is about 60-100 MB
RUN_TIMEOUT = 60                # one reader run; a FIFO that blocks fails here

WRAPPER = """
import json, resource, subprocess, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway fails, not the machine
out = []
for run in json.loads(sys.argv[1]):
    try:
        p = subprocess.run(run["argv"], capture_output=True, text=True, env=run["env"],
                           timeout=run["timeout"])
        out.append({"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr})
    except subprocess.TimeoutExpired:
        out.append({"rc": None, "stdout": "", "stderr": "timed out (blocked on a FIFO?)"})
print(json.dumps({"runs": out,
                  "peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def measured(runs: list[dict]) -> tuple[list[dict], float]:
    """Run ``runs`` (``argv``, ``env``) one after another in a fresh wrapper process: their
    results and the peak RSS (MiB) of the largest of them."""
    for run in runs:
        run.setdefault("env", dict(os.environ))
        run.setdefault("timeout", RUN_TIMEOUT)
    p = subprocess.run([sys.executable, "-c", WRAPPER, json.dumps(runs)], capture_output=True,
                       text=True, timeout=RUN_TIMEOUT * len(runs) + 60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    return doc["runs"], doc["peak_mb"]


def python(code: str, *args: str, env: dict | None = None) -> dict:
    return {"argv": [sys.executable, "-c", textwrap.dedent(code), *args],
            "env": env or dict(os.environ)}


def chemio(*args: str, env: dict | None = None) -> dict:
    return {"argv": [sys.executable, "-m", "chemio_py.cli", *args],
            "env": env or dict(os.environ)}


CLI_ALL = """
import json, os, sys, tempfile, traceback
from chemio_py import cli
from chemio_py.runtime import config
base = dict(os.environ)
out = []
for run in json.loads(sys.argv[1]):
    os.environ.clear()
    os.environ.update(base, **run["env"])
    config.reset()
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            rc = cli.main(run["argv"])
        except SystemExit as x:
            rc = x.code if isinstance(x.code, int) else 1
        except BaseException:
            traceback.print_exc()           # what the interpreter would print: a raw error
            rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        o.seek(0)
        e.seek(0)
        out.append({"rc": rc, "stdout": o.read().decode(errors="replace"),
                    "stderr": e.read().decode(errors="replace")})
print(json.dumps(out))
"""


def chemio_in_one_process(runs: list[tuple[list[str], dict]]) -> tuple[list[dict], float]:
    """Run ``chemio`` command lines (``argv``, environment overrides) one after another in
    one fresh Python through ``chemio_py.cli.main`` (what ``python -m chemio_py.cli`` runs),
    each with the settings reset and file descriptors 1 and 2 captured: each run's exit
    status, stdout and stderr as a process of its own would give them, without an
    interpreter start per run. Returns the results and the peak RSS (MiB) of the process."""
    batch = python(CLI_ALL, json.dumps([{"argv": a, "env": e} for a, e in runs]))
    batch["timeout"] = RUN_TIMEOUT * 2
    (run,), peak = measured([batch])
    assert run["rc"] == 0, f"the batch of chemio runs ended with {run['rc']}: {run['stderr']}"
    return json.loads(run["stdout"]), peak


def each_argument(body: str) -> str:
    """A script that runs ``body`` for every command-line argument ``arg`` and prints
    ``{arg: [outcome, message]}`` as JSON: the ``result`` that ``body`` sets, or when it
    raises, ``"chemio"`` for a ``ChemIOError`` (else the exception's type) and its text."""
    return f"""
import json, os, sys
import chemio_py as cio
from chemio_py.runtime import config
out = {{}}
for arg in sys.argv[1:]:
    try:
{textwrap.indent(textwrap.dedent(body).strip(), " " * 8)}
        out[arg] = result
    except BaseException as e:
        kind = "chemio" if isinstance(e, cio.ChemIOError) else type(e).__name__
        out[arg] = [kind, f"{{type(e).__name__}}: {{e}}"[:600]]
print(json.dumps(out))
"""


def assert_no_raw_error(text: str, what: str) -> None:
    for word in RAW:
        assert word not in text, f"{what}: {word} in\n{text[-3000:]}"


def corpus_dirs(base, corpus: list[Hostile]) -> dict[str, str]:
    """One fresh directory per hostile input: ``{name: dir}``."""
    out = {}
    for i, h in enumerate(corpus):
        d = base / f"case{i:02d}"
        d.mkdir(mode=0o700)
        out[h.name] = str(d)
    return out


# ---------------------------------------------------------------- DiskArray metadata

OPEN_ALL = each_argument("""
    cio.DiskArray.open(arg).close()
    result = ["opened", ""]
""")


def test_diskarray_metadata_corpus(tmp_path):
    corpus = json_corpus()
    dirs = corpus_dirs(tmp_path, corpus)
    datas = []
    for h in corpus:
        data = os.path.join(dirs[h.name], "a.dra")
        with open(data, "wb") as fh:
            fh.write(bytes(64))
        h.make(data + ".json")
        datas.append(data)
    (run,), peak = measured([python(OPEN_ALL, *datas)])
    assert run["rc"] == 0, run["stderr"]
    got = json.loads(run["stdout"])
    for h, data in zip(corpus, datas):
        kind, msg = got[data]
        assert kind == "chemio", f"{h.name}: {msg}"
        assert data in msg, f"{h.name}: the message does not name the file: {msg}"
        assert_no_raw_error(msg, h.name)
    assert peak < PEAK_MB, f"peak RSS {peak:.0f} MiB"


# ---------------------------------------------------------------- RecordFile index headers

REPLAY_ALL = each_argument("""
    with cio.RecordFile("h", "r", dir=arg) as log:
        for rec in log.replay():
            pass
    result = ["replayed", ""]
""")


def _record_file(d: str, *arrays) -> str:
    with cio.RecordFile("h", "w+", dir=d) as log:
        log.append(*(arrays or (np.arange(3, dtype=np.int64), np.array([1.5]))))
        return log.path


def test_record_index_header_corpus(tmp_path):
    corpus = [h for h in json_corpus() if h.special is None]
    dirs = corpus_dirs(tmp_path, corpus)
    for h in corpus:
        set_record_index_header(_record_file(dirs[h.name]), h.content)
    shape_dir = tmp_path / "shape"
    shape_dir.mkdir()
    path = _record_file(str(shape_dir), np.zeros((0, 4)))
    set_first_record_shape(path, (0, 2 ** 62))
    (run,), peak = measured([python(REPLAY_ALL, *dirs.values(), str(shape_dir))])
    assert run["rc"] == 0, run["stderr"]
    got = json.loads(run["stdout"])
    for h in corpus:
        kind, msg = got[dirs[h.name]]
        assert kind == "chemio", f"{h.name}: {msg}"
        assert "h.0" in msg and "index" in msg, f"{h.name}: {msg}"
        assert_no_raw_error(msg, h.name)
    kind, msg = got[str(shape_dir)]
    assert kind == "chemio" and "MetadataError" in msg, msg
    assert path in msg and "record 0" in msg and str(2 ** 62) in msg, msg
    assert peak < PEAK_MB, f"peak RSS {peak:.0f} MiB"


# ---------------------------------------------------------------- chemio.toml

LOOKUP_ALL = each_argument("""
    os.environ["CHEMIO_CONFIG"] = arg
    result = ["value", repr(config.get("io_threads"))]
""")


def test_config_file_corpus(tmp_path):
    corpus = toml_corpus()
    dirs = corpus_dirs(tmp_path, corpus)
    paths = []
    for h in corpus:
        p = os.path.join(dirs[h.name], "chemio.toml")
        h.make(p)
        paths.append(p)
    (lookup,), peak = measured([python(LOOKUP_ALL, *paths)])
    assert lookup["rc"] == 0, lookup["stderr"]
    got = json.loads(lookup["stdout"])
    # `chemio config --check` once per file, all in one process (see chemio_in_one_process)
    checks, peak_cli = chemio_in_one_process([(["config", "--check"], {"CHEMIO_CONFIG": p})
                                              for p in paths])
    peak = max(peak, peak_cli)
    for h, p, check in zip(corpus, paths, checks):
        kind, msg = got[p]
        assert kind == "chemio", f"{h.name}: {msg}"
        assert p in msg, f"{h.name}: the message does not name the file: {msg}"
        assert_no_raw_error(msg, h.name)
        out = check["stdout"] + check["stderr"]
        assert check["rc"] == 1, f"{h.name}: chemio config --check gave {check['rc']}:\n{out}"
        assert p in out, f"{h.name}: {out}"
        assert_no_raw_error(out, f"{h.name} (chemio config --check)")
    assert peak < PEAK_MB, f"peak RSS {peak:.0f} MiB"


# ---------------------------------------------------------------- job markers and leases

DEAD = """
import os, numpy as np, chemio_py as cio
f = cio.ExclusiveFile("orphan", "w+")
f.write(0, np.ones(512))
print(os.path.dirname(f.path), flush=True)
os._exit(0)                 # no cleanup: a job that died
"""

MARKER = ".chemio-job.json"


def _dead_job(root) -> str:
    env = {**os.environ, "CHEMIO_SCRATCH": str(root)}
    for k in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "COBALT_JOBID", "FLUX_JOB_ID"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", DEAD], capture_output=True, text=True, env=env,
                       timeout=RUN_TIMEOUT)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def _deep_tree(d: str, depth: int) -> None:
    """A chain of ``depth`` nested directories in ``d`` with a file at the bottom."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", 0o700, dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


@pytest.fixture
def tmp_tree(tmp_path):
    """``tmp_path``, emptied afterwards without recursion, pass or fail: pytest's own
    removal of old temporary directories recurses, and would fail on the deep trees made
    here (in every later pytest session of this user)."""
    yield tmp_path
    failures: list = []
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fs.clear_dir_at(fd, str(tmp_path), failures)
    finally:
        os.close(fd)
    assert not failures, failures[:3]


@pytest.fixture
def hostile_scratch(tmp_tree):
    """A scratch root of dead jobs: a control, one with a 1,500-deep tree, and per corpus
    input one whose lease, one whose marker and one whose ``a.dra.json`` is that input."""
    tmp_path = tmp_tree
    root = tmp_path / "root"
    root.mkdir()
    first = _dead_job(root)
    template = str(tmp_path / "template")
    shutil.move(first, template)
    lease = [n for n in os.listdir(template) if n.startswith(".lease.")]
    assert len(lease) == 1, lease
    jobs: dict[str, tuple[str, str]] = {}          # path -> (where the input is, its name)

    def clone(label: str) -> str:
        d = str(root / f"chemio-{label}")
        shutil.copytree(template, d, symlinks=True)
        os.chmod(d, 0o700)
        return d

    control, deep = clone("control"), clone("deep")
    _deep_tree(deep, 1500)
    for i, h in enumerate(json_corpus()):
        d = clone(f"lease{i:02d}")
        os.unlink(os.path.join(d, lease[0]))
        h.make(os.path.join(d, lease[0]))
        jobs[d] = ("lease", h.name)
        d = clone(f"marker{i:02d}")
        os.unlink(os.path.join(d, MARKER))
        h.make(os.path.join(d, MARKER))
        jobs[d] = ("marker", h.name)
        d = clone(f"meta{i:02d}")
        with open(os.path.join(d, "a.dra"), "wb") as fh:
            fh.write(bytes(64))
        h.make(os.path.join(d, "a.dra.json"))
        jobs[d] = ("metadata", h.name)
    yield root, control, deep, jobs


def _line(out: str, path: str) -> str:
    lines = [ln for ln in out.splitlines() if f" {path}  (" in ln]
    assert lines, f"no line for {path} in:\n{out[-5000:]}"
    return lines[0]


def test_clean_and_ls_over_hostile_job_dirs(hostile_scratch):
    root, control, deep, jobs = hostile_scratch
    env = {**os.environ, "CHEMIO_SCRATCH": str(root)}
    runs = [chemio("ls", "--all", "--root", str(root), env=env),
            chemio("ls", "--all", "--json", "--root", str(root), env=env),
            chemio("clean", "--dry-run", "--root", str(root), env=env),
            chemio("clean", "--root", str(root), env=env)]
    (ls, ls_json, dry, wet), peak = measured(runs)
    for name, r in (("ls", ls), ("ls --json", ls_json), ("clean --dry-run", dry),
                    ("clean", wet)):
        assert r["rc"] == 0, f"chemio {name} exit {r['rc']}:\n{r['stdout'][-3000:]}{r['stderr']}"
        assert_no_raw_error(r["stdout"] + r["stderr"], f"chemio {name}")

    # ls: every directory listed; every hostile metadata file reported on its object
    listed = {j["path"]: j for j in json.loads(ls_json["stdout"])["jobs"]}
    for d, (where, name) in jobs.items():
        assert d in listed and d in ls["stdout"], f"{where} {name}: not listed"
        if where == "metadata" and name != "wrong types":     # (the only JSON object)
            (obj,) = [o for o in listed[d]["objects"] if o["name"] == "a.dra"]
            assert obj["note"] and "a.dra.json" in obj["note"], (name, obj)
    (tree,) = [o for o in listed[deep]["objects"] if o["name"] == "d"]
    assert "deeper than" in tree["note"], tree

    # clean: hostile leases and markers keep their directory, with the reason; the rest goes
    for d, (where, name) in jobs.items():
        if where in ("lease", "marker"):
            assert os.path.isdir(d), f"hostile {where} {name}: its directory was removed"
            line = _line(wet["stdout"], d)
            assert line.startswith("keeping"), line
            assert where in line, line
        else:
            assert _line(dry["stdout"], d).startswith("would remove")
            assert not os.path.exists(d), f"{where} {name}: the stale directory stayed"
    assert not os.path.exists(control) and not os.path.exists(deep), wet["stdout"][-3000:]
    assert peak < PEAK_MB, f"peak RSS {peak:.0f} MiB"


def test_clean_removes_a_very_deep_tree_without_recursion(tmp_tree):
    """3,000 levels: no recursion (Python's limit is 1,000), no descriptor per level (the
    command runs with its descriptor limit at 1,024). Three times either limit; 20,000
    levels took 7-12 s of the suite."""
    root = tmp_tree / "root"
    root.mkdir()
    d = _dead_job(root)
    assert 3_000 > 2 * sys.getrecursionlimit()
    _deep_tree(d, 3_000)
    clean = python("""
        import resource, runpy, sys
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        sys.argv = ["chemio", *sys.argv[1:]]
        runpy.run_module("chemio_py.cli", run_name="__main__")
        """, "clean", "--root", str(root), env={**os.environ, "CHEMIO_SCRATCH": str(root)})
    (wet,), peak = measured([clean])
    assert wet["rc"] == 0, wet["stdout"] + wet["stderr"]
    assert_no_raw_error(wet["stdout"] + wet["stderr"], "chemio clean")
    assert os.listdir(root) == []


def test_removal_of_a_deep_tree_reports_what_it_cannot_remove(tmp_tree):
    """A file that cannot be removed 300 levels down (immutable, or in a read-only
    directory when not root) is reported with its path; the rest goes, and the marker and
    the lease stay for a later run."""
    root = tmp_tree / "root"
    root.mkdir()
    d = _dead_job(root)
    _deep_tree(d, 300)
    deep = os.path.join(d, *["d"] * 300)
    os.close(os.open(os.path.join(d, "data"), os.O_WRONLY | os.O_CREAT, 0o600))
    if os.geteuid() == 0:
        fix = ["chattr", "-i", os.path.join(deep, "bottom")]
        if subprocess.run(["chattr", "+i", fix[2]], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not possible here")
    else:
        os.chmod(deep, 0o500)
        fix = ["chmod", "700", deep]
    try:
        (wet,), _ = measured([chemio("clean", "--root", str(root), env={
            **os.environ, "CHEMIO_SCRATCH": str(root)})])
        out = wet["stdout"] + wet["stderr"]
        assert wet["rc"] == 1 and "bottom" in out, out
        assert_no_raw_error(out, "chemio clean")
        assert os.path.exists(os.path.join(d, MARKER))
        assert not os.path.exists(os.path.join(d, "data"))
    finally:
        subprocess.run(fix, capture_output=True)


# ---------------------------------------------------------------- traces

def test_trace_corpus(tmp_path):
    corpus = json_corpus()
    dirs = corpus_dirs(tmp_path, corpus)
    paths = []
    for h in corpus:
        p = os.path.join(dirs[h.name], "trace.json")
        h.make(p)
        paths.append(p)
    results, peak = chemio_in_one_process([(["trace", p], {}) for p in paths])
    for h, p, r in zip(corpus, paths, results):
        out = r["stdout"] + r["stderr"]
        assert r["rc"] is not None, f"{h.name}: chemio trace hung"
        assert_no_raw_error(out, h.name)
        if r["rc"] == 0:                # a list of anything but events is an empty trace
            assert h.name in ("a list", "400k items") and "0 events" in r["stdout"], \
                f"{h.name}: {out}"
        else:
            assert r["rc"] == 1 and "chemio trace:" in r["stderr"], f"{h.name}: {out}"
            assert p in r["stderr"], f"{h.name}: the message does not name the file: {out}"
    assert peak < PEAK_MB, f"peak RSS {peak:.0f} MiB"


def _event(tid, ts, dur, **args):
    ev = {"name": "read", "cat": "io", "ph": "X", "pid": 7, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = args
    return ev


def test_trace_bad_numbers_are_skipped_and_reported(tmp_path):
    good = [_event("io 1", 1_000_000.0 + 10 * k, 5.0, file="/s/a.dra", bytes=4096)
            for k in range(10)]
    text = json.dumps({"traceEvents": good + [{"ph": "X", "ts": "NAN_TS", "dur": 1}]})
    text = text.replace('"NAN_TS"', "NaN")[:-2]
    text += (', {"ph": "X", "ts": 1' + "0" * 400 + ', "dur": 1}'
             ', {"ph": "X", "ts": 5, "dur": Infinity}'
             ', {"ph": "X", "ts": 5, "dur": -3}'
             ', {"ph": "X", "ts": true, "dur": 1}'
             ', {"ph": "X", "ts": 5, "dur": 1e400}'
             ', {"ph": "X", "ts": 5, "dur": 1, "args": {"bytes": 1e400}}'
             ', {"ph": "X", "ts": 5, "dur": 1, "args": {"bytes": -1}}'
             ', {"ph": "X", "ts": 5, "dur": 1, "args": {"bytes": ' + "9" * 40 + "}}]}")
    p = tmp_path / "t.json"
    p.write_text(text)
    (r, rj), peak = measured([chemio("trace", str(p)), chemio("trace", str(p), "--json")])
    assert r["rc"] == 0 and rj["rc"] == 0, r["stderr"] + rj["stderr"]
    assert "nan s" not in r["stdout"] and "inf s" not in r["stdout"], r["stdout"]
    assert "9 bad events skipped" in r["stdout"], r["stdout"]
    s = json.loads(rj["stdout"])
    assert all(np.isfinite(s[k]) for k in ("seconds", "io_busy_seconds", "wait_seconds"))
    assert s["events"] == 10 and s["bad_events"] == 9 and s["bytes"] == 10 * 4096
    assert s["seconds"] == pytest.approx(95e-6)


def test_trace_of_20k_tracks_is_bounded(tmp_path):
    pytest.importorskip("matplotlib")
    events = []
    for k in range(20_000):
        for j in range(2):
            events.append(_event(f"thread {k}", 1e15 + 100.0 * k + 40 * j, 20.0 + (k % 7),
                                 file=f"/s/f{k % 9}.dra", bytes=4096))
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "t.png"
    (r,), peak = measured([chemio("trace", str(p), "-o", str(out))])
    assert r["rc"] == 0, r["stderr"]
    assert "the 64 busiest of 20000 tracks drawn" in r["stdout"], r["stdout"]
    assert out.stat().st_size < 2 << 20
    assert peak < 800, f"peak RSS {peak:.0f} MiB"


def test_trace_events_past_the_cap_are_counted_not_read(tmp_path):
    events = [_event("io", 1e15 + k, 1.0, bytes=1) for k in range(5000)]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": events}))
    (r, rj), _ = measured([chemio("trace", str(p), "--max-events", "1000"),
                           chemio("trace", str(p), "--max-events", "1000", "--json")])
    assert r["rc"] == 0, r["stderr"]
    assert "4000 events past the first 1000 not read" in r["stdout"], r["stdout"]
    s = json.loads(rj["stdout"])
    assert s["events"] == 1000 and s["events_not_read"] == 4000
