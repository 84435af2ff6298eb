"""The launcher side: start P stress processes (``mpiexec`` for P >= 2), watch them, collect
and report their tallies, clean up whatever they left; the runner's ``run`` and the
script's ``main``."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from chemio_py.errors import fmt_bytes

from .base import (BENCH_DIR, FULL_PROCS, HANG_TIMEOUT, KILL_MARGIN, QUICK_PROCS, QUICK_SECONDS,
                   REQUIRED_KINDS, SECONDS)
from common import row, scratch_base  # (the benchmarks directory is on sys.path: .base)

PACKAGE = os.path.dirname(os.path.abspath(__file__))      # run as a script: python PACKAGE

def _mpiexec() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else (shutil.which("mpiexec") or "mpiexec")


def _child_env(scratch: str, shm: str, home: str, shm_limit: str | None = None) -> dict:
    env = dict(os.environ)
    for var in list(env):
        if var.startswith(("CHEMIO_", "PMI_", "PMIX_", "OMPI_", "MPIR_", "HYDRA_")):
            del env[var]
    env.update(CHEMIO_SCRATCH=scratch, CHEMIO_SHARED_SCRATCH=scratch, CHEMIO_SHM_DIR=shm,
               XDG_CONFIG_HOME=home)
    if shm_limit:
        env["CHEMIO_SHM_LIMIT"] = shm_limit
    src = os.path.dirname(BENCH_DIR)          # a source checkout: make sure it is importable
    if os.path.isfile(os.path.join(src, "chemio_py", "__init__.py")):
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)         # stragglers of the group
    except ProcessLookupError:
        pass


MPICH_SHM = "/dev/shm/mpich_shm_*"


def _in_use(paths: set[str]) -> set[str]:
    """Those of ``paths`` that a live process has mapped or open (from /proc)."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", errors="replace") as fh:
                text = fh.read()
            used |= {p for p in paths if p in text}
            fds = f"/proc/{pid}/fd"
            for fd in os.listdir(fds):
                try:
                    target = os.readlink(os.path.join(fds, fd))
                except OSError:
                    continue
                if target in paths:
                    used.add(target)
        except OSError:
            continue
    return used


def _drop_mpich_segments(before: set[str]) -> list[str]:
    """Remove the MPICH shared-memory segments that appeared during the run and that no live
    process uses (left by ranks that were killed or died)."""
    import glob
    new = set(glob.glob(MPICH_SHM)) - before
    if not new:
        return []
    gone = sorted(new - _in_use(new))
    for p in gone:
        try:
            os.unlink(p)
        except OSError:
            pass
    return gone


def _leftovers(*dirs: str) -> list[str]:
    out = []
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(d):
            out += [os.path.join(dirpath, n) for n in filenames + dirnames]
    return out


def stress(procs: int, seconds: float, seed: int, workdir: str, *,
           hang: float = HANG_TIMEOUT, inject: str | None = None,
           shm_limit: str | None = None) -> dict:
    """One stress run with ``procs`` processes; returns the summary (see ``report``)."""
    run = os.path.join(workdir, f"stress-p{procs}")
    shutil.rmtree(run, ignore_errors=True)
    scratch = os.path.join(run, "scratch")
    keep = os.path.join(run, "keep")
    for d in (run, scratch, keep):
        os.makedirs(d, mode=0o700, exist_ok=True)
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else run
    shm = tempfile.mkdtemp(prefix="cio-stress-", dir=shm_parent)
    cfg = {"seconds": seconds, "seed": seed, "hang": hang, "run": run, "keep": keep,
           "inject": inject, "shm_limit": shm_limit}
    me = PACKAGE
    if procs == 1:
        cmd = [sys.executable, me, "--worker", json.dumps(cfg)]
    else:
        cmd = [_mpiexec(), "-n", str(procs), sys.executable, "-m", "mpi4py", me,
               "--worker", json.dumps(cfg)]
    limit = seconds + hang + KILL_MARGIN
    summary: dict[str, Any] = {"procs": procs, "seed": seed, "seconds_asked": seconds,
                               "replay": f"python {os.path.relpath(me)} --procs {procs} "
                                         f"--seconds {seconds:g} --seed {seed}"
                                         + (f" --shm-limit {shm_limit}" if shm_limit else "")}
    problems: list[dict] = []
    import glob
    mpich_before = set(glob.glob(MPICH_SHM))
    t0 = time.monotonic()
    try:
        with open(os.path.join(run, "stdout.txt"), "w") as out, \
                open(os.path.join(run, "stderr.txt"), "w") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=run,
                                    env=_child_env(scratch, shm, run, shm_limit),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                killed = False
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc, killed = proc.returncode, True
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        summary["wall_seconds"] = time.monotonic() - t0
        summary["exit_status"] = rc
        results, partial = [], 0
        for r in range(procs):
            p = os.path.join(run, f"result.{r}.json")
            if not os.path.exists(p) and os.path.exists(p + ".partial"):
                p += ".partial"              # the process died: what it did until then
                partial += 1
            if os.path.exists(p):
                with open(p) as fh:
                    results.append(json.load(fh))
        if killed or rc != 0 or len(results) != procs or partial:
            what = (f"killed after {limit:.0f} s (a hang)" if killed else
                    f"exited with status {rc}")
            if partial or len(results) != procs:
                what += (f"; {procs - len(results) + partial} of {procs} processes did not "
                         f"finish (their counts below stop at their last round)")
            detail = []
            for r in range(procs):
                for fname, label in ((f"status.{r}", "last operation"),
                                     (f"stack.{r}", "stack dump (faulthandler)")):
                    p = os.path.join(run, fname)
                    if os.path.exists(p):
                        with open(p, errors="replace") as fh:
                            text = fh.read().strip()
                        if text:
                            detail.append(f"rank {r} {label}: {text[-4000:]}")
            for fname in ("stdout.txt", "stderr.txt"):
                with open(os.path.join(run, fname), errors="replace") as fh:
                    text = fh.read().strip()
                if text:
                    detail.append(f"{fname}: {text[-4000:]}")
            problems.append({"rank": None, "kind": "run", "message":
                             f"the stress processes {what}", "traceback": "\n".join(detail),
                             "replay": summary["replay"]})
        elif _leftovers(scratch, shm, keep):
            left = _leftovers(scratch, shm, keep)
            problems.append({"rank": None, "kind": "cleanup", "message":
                             f"{len(left)} files or directories left after every process "
                             f"ended normally: {left[:8]}", "traceback": "",
                             "replay": summary["replay"]})
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
        if procs > 1:
            summary["mpich_segments_removed"] = _drop_mpich_segments(mpich_before)
    ops, by_backend, expected = Counter(), Counter(), Counter()
    verified = wrong = nerr = rounds = spills = 0
    errors = []
    for res in results:
        ops.update(res["ops"])
        by_backend.update(res["by_backend"])
        expected.update(res["expected"])
        verified += res["verified"]
        wrong += res["wrong"]
        nerr += res["nerrors"]
        rounds = max(rounds, res["rounds"])
        spills += res.get("spills", 0)
        errors += res["errors"]
    summary.update(ops=dict(sorted(ops.items())), by_backend=dict(by_backend),
                   expected_errors=dict(expected), bytes_verified=verified,
                   lost_or_wrong_bytes=wrong, errors=nerr + len(problems),
                   error_details=problems + errors, rounds=rounds, spills=spills,
                   shm_limit=shm_limit,
                   missing_kinds=[k for k in REQUIRED_KINDS if not ops.get(k)])
    summary["clean"] = wrong == 0 and summary["errors"] == 0
    return summary


def report(s: dict) -> str:
    """The human summary of one run."""
    lines = [f"bench_stress P={s['procs']} seed={s['seed']} "
             f"({s.get('wall_seconds', 0):.1f} s wall for --seconds {s['seconds_asked']:g}, "
             f"{s['rounds']} rounds; replay: {s['replay']})"]
    ops = s["ops"]
    lines.append(f"  operations: {sum(ops.values())}")
    groups: dict[str, list] = {}
    for k, v in ops.items():
        groups.setdefault(k.split(".")[0], []).append(f"{k.split('.', 1)[1]} {v}")
    for g, items in groups.items():
        lines.append(f"    {g:4s} " + ", ".join(items))
    lines.append("  by backend: " + ", ".join(f"{k} {v}" for k, v in
                                                sorted(s["by_backend"].items())))
    if s.get("shm_limit"):
        lines.append(f"  RAM budget CHEMIO_SHM_LIMIT={s['shm_limit']}: {s['spills']} spills of "
                     f"auto files to disk")
    lines.append(f"  bytes verified: {s['bytes_verified']} ({fmt_bytes(s['bytes_verified'])})")
    lines.append("  expected errors checked: " + (", ".join(
        f"{k} {v}" for k, v in sorted(s["expected_errors"].items())) or "none"))
    if s["missing_kinds"]:
        lines.append("  kinds that never ran: " + ", ".join(s["missing_kinds"]))
    lines.append(f"  errors: {s['errors']}")
    for e in s["error_details"][:10]:
        where = f"rank {e['rank']} round {e.get('round')} op {e.get('op')}" \
            if e.get("rank") is not None else "launcher"
        lines.append(f"    [{where}] {e['kind']} on {e.get('object', '-')}: {e['message']}")
        if e.get("doing"):
            lines.append(f"      while: {e['doing']}")
        lines.append(f"      replay: {e['replay']}")
        if e.get("traceback"):
            lines += ["      " + ln for ln in e["traceback"].strip().splitlines()[-25:]]
    lines.append(f"  lost or wrong bytes: {s['lost_or_wrong_bytes']}")
    return "\n".join(lines)


class StressFailure(RuntimeError):
    """A stress run lost or corrupted bytes, or hit an error (the message is the report)."""


def _rows(s: dict) -> list[dict]:
    p = f"P={s['procs']}"
    detail = {k: s[k] for k in ("seed", "ops", "by_backend", "expected_errors", "rounds",
                                "wall_seconds", "missing_kinds", "replay")}
    first = row(f"{p}: operations", "ops", sum(s["ops"].values()),
                note=f"seed {s['seed']}, {s['seconds_asked']:g} s, {s['rounds']} rounds; "
                     f"{len(s['ops'])} kinds of operation on {', '.join(sorted(s['by_backend']))}")
    first["detail"] = detail
    return [first,
            row(f"{p}: bytes verified", "bytes", s["bytes_verified"],
                note="bytes read back and compared with the model"),
            row(f"{p}: errors", "count", s["errors"],
                note="unexpected exceptions, hangs, leftovers"),
            row(f"{p}: lost or wrong bytes", "bytes", s["lost_or_wrong_bytes"], note="must be 0"),
            row(f"{p}: clean", "ok", 1.0 if s["clean"] else 0.0, "required", 1.0, target=1.0,
                note="0 lost or wrong bytes and 0 errors")]


def _procs_list(procs: Any) -> tuple[int, ...]:
    if isinstance(procs, int):
        procs = (procs,)
    elif isinstance(procs, str):
        procs = tuple(int(x) for x in procs.replace(",", " ").split())
    out = tuple(int(p) for p in procs)
    if not out or any(p < 1 for p in out):
        raise ValueError(f"procs must be positive process counts, got {procs!r}")
    return out


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def run(quick: bool, workdir: str, seconds: float | None = None, procs: Any = None,
        seed: int | None = None) -> list[dict]:
    """Runner entry: P = 1..4 (quick: 1, 2) for ``seconds`` each; raises if not clean."""
    secs = float(seconds if seconds is not None else (QUICK_SECONDS if quick else SECONDS))
    plist = _procs_list(procs if procs is not None else (QUICK_PROCS if quick else FULL_PROCS))
    seed = new_seed() if seed is None else int(seed)
    print(f"bench_stress: seed {seed}, P = {', '.join(map(str, plist))}, {secs:g} s each",
          flush=True)
    rows, bad = [], []
    for p in plist:
        s = stress(p, secs, seed, workdir)
        text = report(s)
        print(text, flush=True)
        rows += _rows(s)
        if not s["clean"]:
            bad.append(text)
    if bad:
        raise StressFailure("stress run not clean:\n" + "\n\n".join(bad))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="chemio_py stress run (see the module docstring)")
    p.add_argument("--seconds", type=float, default=SECONDS, help="per process count (60)")
    p.add_argument("--procs", default="4", help="process counts, e.g. 4 or 1,2,3,4 (4)")
    p.add_argument("--seed", type=int, default=None, help="replay a run (default: random)")
    p.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT,
                   help="seconds one operation may take before it counts as a hang (120)")
    p.add_argument("--workdir", default=None, help="where the work directory goes "
                                                   "(default: CHEMIO_SCRATCH or /tmp)")
    p.add_argument("--json", default=None, help="also write the summaries here")
    p.add_argument("--shm-limit", default=None, metavar="SIZE",
                   help="RAM budget (CHEMIO_SHM_LIMIT, e.g. 64M): auto files spill to disk; "
                        "backends local and auto only")
    p.add_argument("--inject", choices=("corrupt", "hang"), default=None,
                   help="inject a fault to check the checker (tests only)")
    args = p.parse_args(argv)
    seed = new_seed() if args.seed is None else args.seed
    plist = _procs_list(args.procs)
    print(f"bench_stress: seed {seed}, P = {', '.join(map(str, plist))}, "
          f"{args.seconds:g} s each", flush=True)
    summaries = []
    with tempfile.TemporaryDirectory(prefix="chemio-stress-",
                                     dir=args.workdir or scratch_base()) as work:
        for procs in plist:
            s = stress(procs, args.seconds, seed, work, hang=args.hang_timeout,
                       inject=args.inject, shm_limit=args.shm_limit)
            summaries.append(s)
            print(report(s), flush=True)
            for r in _rows(s):
                print(json.dumps({k: v for k, v in r.items() if k != "detail"}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summaries, fh, indent=1)
    return 0 if all(s["clean"] for s in summaries) else 1
