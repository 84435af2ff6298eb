"""The benchmark harness: runner, result files, shared helpers and the EAF benchmark's rows.

No speed is asserted anywhere: only that the harness runs, measures what it says and writes
complete, consistent results.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO

ROOT = REPO
BENCH_DIR = os.path.join(ROOT, "benchmarks")
RUNNER = os.path.join(BENCH_DIR, "runner.py")
sys.path.insert(0, BENCH_DIR)

import common  # noqa: E402

KEYS = {"case", "metric", "value", "baseline_name", "baseline", "ratio", "target", "note"}
MACHINE_KEYS = {"date", "cpu_count", "mem_total_bytes", "workdir_fs", "fio", "python", "numpy"}


def _run(tmp_path, *args, timeout=240):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, RUNNER, *args], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def eaf_quick(tmp_path_factory):
    """One smoke run (quick, least work) of the EAF benchmark through the runner, in a
    subprocess."""
    tmp = tmp_path_factory.mktemp("bench")
    work = tmp / "work"
    work.mkdir()
    proc = _run(tmp, "--smoke", "--only", "eaf", "--workdir", str(work))
    return tmp, work, proc


def test_eaf_quick_run_writes_complete_results(eaf_quick):
    tmp, work, proc = eaf_quick
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp / "bench-results"                     # the default --out, relative to cwd
    data = json.loads((out / "results.json").read_text())
    assert data["quick"] is True and data["smoke"] is True
    assert MACHINE_KEYS <= set(data["machine"])
    assert data["machine"]["cpu_count"] == os.cpu_count()
    assert data["machine"]["numpy"] == np.__version__
    assert data["machine"]["workdir_fs"] == common.fs_type(str(work))
    assert data["benchmarks"]["eaf"]["error"] is None
    rows = data["rows"]
    assert rows and all(KEYS <= set(r) and r["benchmark"] == "eaf" for r in rows)
    cases = {r["case"]: r for r in rows}
    assert len(cases) == len(rows), "case names must be unique"

    for label, target in (("1.6 kB", 0.75), ("16 kB", 0.9), ("160 kB", 0.9), ("1.6 MB", 0.9)):
        for phase in ("write+sync", "write to page cache", "cold read"):
            raw = cases[f"{phase} {label}: raw"]
            assert raw["baseline"] is None and raw["ratio"] is None and raw["value"] > 0
            for m in ("eaf", "pyfile", "memmap"):
                r = cases[f"{phase} {label}: {m}"]
                assert r["metric"] == "MiB/s" and r["baseline_name"] == "raw"
                assert r["baseline"] == raw["value"]
                assert r["ratio"] == pytest.approx(r["value"] / r["baseline"])
                want = target if (m == "eaf" and phase != "write to page cache") else None
                assert r["target"] == want, r["case"]
    for kib in (4, 16):
        blocking = cases[f"cold read {kib} KiB page cache: eaf blocking"]
        a = cases[f"cold read {kib} KiB page cache: eaf async x16"]
        assert a["baseline"] == blocking["value"] and a["target"] == 3.0
        assert a["ratio"] == pytest.approx(a["value"] / blocking["value"])
        assert cases[f"warm read {kib} KiB: eaf async x16 (request ceiling)"]["value"] > 0
    # the temporary work directory is gone, nothing left behind in --workdir
    assert os.listdir(work) == []


def test_eaf_quick_markdown_matches_json(eaf_quick):
    tmp, _, proc = eaf_quick
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp / "bench-results" / "results.json").read_text())
    md = (tmp / "bench-results" / "results.md").read_text()
    lines = [ln for ln in md.splitlines() if ln.startswith("| eaf |")]
    assert len(lines) == len(data["rows"])
    assert "| benchmark | case | metric | value |" in md
    for ln, r in zip(lines, data["rows"]):
        assert f"| {r['case']} |" in ln
        v = common.verdict(r)
        assert ("PASS" in ln) == (v is True) and ("FAIL" in ln) == (v is False)
    n_pass = sum(common.verdict(r) is True for r in data["rows"])
    n_fail = sum(common.verdict(r) is False for r in data["rows"])
    assert f"Targets: {n_pass} met, {n_fail} missed." in md
    assert md.strip() in proc.stdout        # the table is printed too


def test_runner_isolates_failures_and_rejects_bad_input(tmp_path):
    bdir = tmp_path / "benches"
    bdir.mkdir()
    (bdir / "bench_good.py").write_text(textwrap.dedent("""
        import os
        from common import row
        def run(quick, workdir):
            assert os.path.isdir(workdir) and os.listdir(workdir) == []
            open(os.path.join(workdir, "junk"), "w").close()
            return [row("a", "x/s", 2.0, "base", 4.0, 0.4), row("b", "s", 3.0, "base", 2.0,
                    1.0, lower_is_better=True), row("c", "x/s", 1.0)]
    """))
    (bdir / "bench_broken.py").write_text(
        "def run(quick, workdir):\n    raise ValueError('boom')\n")
    (bdir / "bench_malformed.py").write_text(
        "def run(quick, workdir):\n    return [{'case': 'x'}]\n")
    out = tmp_path / "out"
    proc = _run(tmp_path, "--dir", str(bdir), "--out", str(out), "--workdir", str(tmp_path))
    assert proc.returncode == 1
    data = json.loads((out / "results.json").read_text())
    assert "ValueError: boom" in data["benchmarks"]["broken"]["error"]
    assert "lacks keys" in data["benchmarks"]["malformed"]["error"]
    good = [r for r in data["rows"] if r["benchmark"] == "good"]
    assert [r["case"] for r in good] == ["a", "b", "c"]
    assert [common.verdict(r) for r in good] == [True, False, None]
    md = (out / "results.md").read_text()
    assert "bench_broken failed" in md and "Targets: 1 met, 1 missed." in md
    assert sorted(os.listdir(tmp_path)) == ["benches", "out"]   # work dir removed

    strict = _run(tmp_path, "--dir", str(bdir), "--only", "good", "--strict",
                  "--out", str(out), "--workdir", str(tmp_path))
    assert strict.returncode == 1                 # a missed target under --strict
    assert _run(tmp_path, "--dir", str(bdir), "--only", "bench_good",
                "--out", str(out), "--workdir", str(tmp_path)).returncode == 0

    bad = _run(tmp_path, "--dir", str(bdir), "--only", "nosuch", "--out", str(tmp_path / "o2"))
    assert bad.returncode == 2 and "no benchmark named nosuch" in bad.stderr
    assert not (tmp_path / "o2").exists()
    listing = _run(tmp_path, "--dir", str(bdir), "--list")
    assert listing.returncode == 0
    assert [ln.split()[0] for ln in listing.stdout.splitlines()] == ["broken", "good",
                                                                    "malformed"]


def test_runner_runs_benchmark_packages(tmp_path):
    """A ``bench_<name>/`` package is a benchmark as a ``bench_<name>.py`` file is; its
    modules import each other; a folder without ``__init__.py`` is none."""
    bdir = tmp_path / "benches"
    (bdir / "bench_pkg").mkdir(parents=True)
    (bdir / "bench_notes").mkdir()
    (bdir / "bench_pkg" / "model.py").write_text("from common import row\nCASE = 'from a module'\n")
    (bdir / "bench_pkg" / "__init__.py").write_text(
        "from .model import CASE, row\n\ndef run(quick, workdir):\n"
        "    return [row(CASE, 'x/s', 1.0)]\n")
    listing = _run(tmp_path, "--dir", str(bdir), "--list")
    assert listing.returncode == 0
    assert [ln.split() for ln in listing.stdout.splitlines()] == [["pkg", str(bdir / "bench_pkg")]]
    out = tmp_path / "out"
    proc = _run(tmp_path, "--dir", str(bdir), "--only", "pkg", "--out", str(out),
                "--workdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["benchmark"], r["case"]) for r in rows] == [("pkg", "from a module")]


def test_runner_main_is_callable_in_process(tmp_path, capsys):
    import runner
    assert runner.main(["--only", "nosuch", "--out", str(tmp_path / "o")]) == 2
    assert runner.main(["--help"]) == 0
    assert "--quick" in capsys.readouterr().out
    assert "eaf" in runner.discover() and runner.discover()["stress"].endswith("bench_stress")


def test_row_and_verdict():
    r = common.row("c", "MiB/s", 90, "raw", 100, 0.9, "n")
    assert set(r) == KEYS and r["ratio"] == pytest.approx(0.9) and common.verdict(r) is True
    assert common.verdict(common.row("c", "MiB/s", 89, "raw", 100, 0.9)) is False
    assert common.verdict(common.row("c", "MiB/s", 89)) is None
    low = common.row("c", "s", 1.0, "raw", 2.0, 0.6, lower_is_better=True)
    assert low["better"] == "lower" and common.verdict(low) is True


def test_measure_runs_setup_before_every_call():
    log = []
    t = common.measure(lambda: log.append("fn"), repeat=3, setup=lambda: log.append("setup"),
                       warmup=1)
    assert log == ["setup", "fn"] * 4
    assert len(t.times) == 3 and t.best <= t.median and all(x >= 0 for x in t.times)
    with pytest.raises(ValueError):
        common.measure(lambda: None, repeat=0)


def test_raw_sequential_helpers_and_eviction(tmp_path):
    path = str(tmp_path / "seq")
    buf = common.payload(64 * 1024, seed=5)
    secs = common.raw_write_seq(path, 1_000_000, chunk=64 * 1024, buf=buf)
    assert secs > 0 and os.path.getsize(path) == 1_000_000
    data = np.fromfile(path, np.uint8)
    for k in range(0, 1_000_000, 64 * 1024):                  # each chunk holds the payload
        n = min(64 * 1024, 1_000_000 - k)
        assert np.array_equal(data[k:k + n], buf[:n])
    assert common.raw_read_seq(path, chunk=64 * 1024) > 0
    assert common.resident_fraction(path) == pytest.approx(1.0)
    common.evict(path, str(tmp_path / "missing"))               # a missing path is skipped
    frac = common.resident_fraction(path)
    if common.fs_type(path) not in ("tmpfs", "ramfs", "overlay"):
        assert frac == 0.0
    assert set(common.machine_info(str(tmp_path))) >= MACHINE_KEYS


def test_workdir_is_removed(tmp_path):
    with common.workdir(base=str(tmp_path)) as d:
        open(os.path.join(d, "f"), "w").close()
        sub = common.fresh_dir(d, "x")
        assert os.listdir(sub) == []
    assert os.listdir(tmp_path) == []


def test_run_fio(tmp_path):
    if not common.fio_available():
        assert common.run_fio(filename=str(tmp_path / "f"), rw="read", size="1m") is None
        pytest.skip("fio is not installed")
    res = common.run_fio(name="t", filename=str(tmp_path / "f"), rw="write", bs="64k",
                         size="1m", ioengine="psync", end_fsync=1)
    assert res["write"]["io_bytes"] == 1 << 20
    assert res["write_mib_s"] > 0 and res["write_iops"] > 0 and res["read_iops"] == 0
    assert os.path.getsize(tmp_path / "f") == 1 << 20
    with pytest.raises(RuntimeError, match="fio failed"):
        common.run_fio(filename=str(tmp_path / "f"), rw="nonsense", size="1m")
