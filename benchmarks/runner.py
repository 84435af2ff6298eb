"""Run the chemio_py benchmarks: ``python benchmarks/runner.py [--quick] [--only NAME]``.

Every ``bench_<name>.py`` next to this file is a benchmark: a module with
``run(quick: bool, workdir: str) -> list[dict]`` returning result rows (see ``common.row``);
so is every package ``bench_<name>/`` whose ``__init__.py`` offers that ``run``.
``--seconds``, ``--procs`` and ``--seed`` go to the benchmarks whose ``run`` takes them
(``bench_stress``).
The runner gives each benchmark its own empty directory inside one work directory, which it
removes at the end, and writes ``results.json`` (rows + machine description) and
``results.md`` (a table, with a pass/fail mark where the row has a target) into ``--out``.

On a terminal a ``tqdm`` bar over the selected benchmarks runs on stderr (``--quiet``: none,
and no per-benchmark lines; the table and the paths written are still printed).

Exit status: 0 when every selected benchmark ran, 1 when one raised or returned malformed
rows (or, with ``--strict``, when a target was missed), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402  (this directory is now on sys.path)
from chemio_py.errors import fmt_bytes  # noqa: E402
from chemio_py.runtime import progress  # noqa: E402

REQUIRED_KEYS = common.ROW_KEYS


def discover(directory: str = HERE) -> dict[str, str]:
    """``{name: path}`` of the benchmarks in ``directory``, sorted by name: ``bench_<name>.py``
    files and ``bench_<name>/`` packages (the path of the folder)."""
    found = glob.glob(os.path.join(directory, "bench_*.py")) + [
        os.path.dirname(p) for p in glob.glob(os.path.join(directory, "bench_*", "__init__.py"))]
    out = {}
    for path in sorted(found, key=os.path.basename):
        base = os.path.basename(path)
        out[base[len("bench_"):].removesuffix(".py")] = path
    return out


def _load(name: str, path: str) -> Any:
    modname = f"chemio_bench_{name}"
    if os.path.isdir(path):                  # a package: its modules import each other
        spec = importlib.util.spec_from_file_location(
            modname, os.path.join(path, "__init__.py"), submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    if not callable(getattr(mod, "run", None)):
        raise TypeError(f"{path} has no run(quick, workdir) function")
    return mod


def check_rows(name: str, rows: Any) -> list[dict]:
    """The rows as a list of dicts, or ``ValueError`` saying which row lacks what."""
    if not isinstance(rows, list):
        raise ValueError(f"bench_{name}.run() must return a list of dicts, got "
                         f"{type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"bench_{name} row {i} is a {type(r).__name__}, not a dict")
        missing = [k for k in REQUIRED_KEYS if k not in r]
        if missing:
            raise ValueError(f"bench_{name} row {i} ({r.get('case')!r}) lacks keys {missing}; "
                             f"build rows with common.row(...)")
    return rows


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and callable(x.item):      # NumPy scalars
        return _json_safe(x.item())
    return x


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-2):
            return f"{x:.{digits}g}"
        return f"{x:.{digits - 1}f}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def _mark(r: dict) -> str:
    v = common.verdict(r)
    return "" if v is None else ("PASS" if v else "FAIL")


def markdown(results: dict) -> str:
    """The results as a markdown document (machine line, then one table)."""
    m = results["machine"]
    mem = m.get("mem_total_bytes")
    lines = [
        "# chemio_py benchmarks" + (" (quick)" if results["quick"] else ""),
        "",
        f"{m.get('date')} · {m.get('cpu_count')} CPUs ({m.get('cpu_model')}) · "
        f"{fmt_bytes(mem or 0, 'GiB')} RAM · workdir fs {m.get('workdir_fs')} · "
        f"Python {m.get('python')} · NumPy {m.get('numpy')} · {m.get('fio') or 'no fio'}",
        "",
        "| benchmark | case | metric | value | baseline | baseline value | ratio | target "
        "| ok | note |",
        "|---|---|---|---:|---|---:|---:|---:|---|---|",
    ]
    for r in results["rows"]:
        tgt = r.get("target")
        tgt_s = "" if tgt is None else ("<= " if r.get("better") == "lower" else ">= ") + _fmt(tgt)
        note = str(r.get("note", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r['benchmark']} | {r['case']} | {r['metric']} | {_fmt(r['value'])} | "
            f"{r.get('baseline_name') or ''} | {_fmt(r.get('baseline'))} | "
            f"{_fmt(r.get('ratio'))} | {tgt_s} | {_mark(r)} | {note} |")
    for name, b in results["benchmarks"].items():
        if b.get("error"):
            first = b["error"].strip().splitlines()[-1]
            lines.append(f"\n**bench_{name} failed:** `{first}`")
    n_pass = sum(1 for r in results["rows"] if common.verdict(r) is True)
    n_fail = sum(1 for r in results["rows"] if common.verdict(r) is False)
    lines += ["", f"Targets: {n_pass} met, {n_fail} missed."]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chemio bench", description="Run chemio_py benchmarks (benchmarks/bench_*.py).")
    p.add_argument("--only", action="append", metavar="NAME", default=None,
                   help="run only this benchmark (e.g. eaf or bench_eaf); repeatable")
    p.add_argument("--quick", action="store_true",
                   help="small sizes for a sanity check (each benchmark < 60 s)")
    p.add_argument("--smoke", action="store_true",
                   help="--quick with the least work that still makes every row (benchmarks "
                        "that read common.SMOKE: eaf): checks the harness, the figures mean "
                        "nothing")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="where results.json and results.md go (default ./bench-results)")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="directory in which to make the temporary work directory "
                        "(default: first CHEMIO_SCRATCH entry, else /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar and no per-benchmark lines")
    p.add_argument("--dir", default=HERE, metavar="DIR",
                   help="where the bench_*.py files and bench_*/ packages are (default: next "
                        "to the runner)")
    p.add_argument("--seconds", type=float, default=None,
                   help="run time per process count (benchmarks that take it: stress)")
    p.add_argument("--procs", default=None, metavar="P[,P...]",
                   help="process counts, e.g. 4 or 1,2,3,4 (benchmarks that take it: stress)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed, to replay a run (benchmarks that take it: stress)")
    return p


def _options_for(fn: Any, args: argparse.Namespace) -> dict:
    """The optional ``--seconds/--procs/--seed`` values that ``fn`` accepts."""
    params = inspect.signature(fn).parameters
    return {k: getattr(args, k) for k in ("seconds", "procs", "seed")
            if getattr(args, k) is not None and k in params}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``chemio bench`` and ``python benchmarks/runner.py``."""
    p = _parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:            # argparse exits; callers want a status
        return int(e.code or 0)
    if args.smoke:
        args.quick = common.SMOKE = True
    if not os.path.isdir(args.dir):
        print(f"chemio bench: --dir {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    found = discover(args.dir)
    if args.list:
        for name, path in found.items():
            print(f"{name:16s} {path}")
        return 0
    if args.only:
        wanted = [n[len("bench_"):] if n.startswith("bench_") else n for n in args.only]
        wanted = [n[:-3] if n.endswith(".py") else n for n in wanted]
        unknown = [n for n in wanted if n not in found]
        if unknown:
            print(f"chemio bench: no benchmark named {', '.join(unknown)}; available: "
                  f"{', '.join(found) or 'none'}", file=sys.stderr)
            return 2
        selected = {n: found[n] for n in dict.fromkeys(wanted)}
    else:
        selected = found
    if not selected:
        print(f"chemio bench: no bench_*.py files or bench_*/ packages in {args.dir}",
              file=sys.stderr)
        return 2

    base = args.workdir or common.scratch_base()
    if not os.path.isdir(base):
        print(f"chemio bench: --workdir {base!r} is not a directory", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="chemio-bench-", dir=base)
    results: dict[str, Any] = {"quick": args.quick, "smoke": args.smoke,
                               "machine": common.machine_info(work), "benchmarks": {},
                               "rows": []}
    status = 0
    say = (lambda msg: None) if args.quiet else (lambda msg: progress.write(msg, sys.stdout))
    bar = progress.Progress(False if args.quiet else progress.AUTO, len(selected),
                            "chemio bench", unit="bench")
    try:
        for name, path in selected.items():
            say(f"== bench_{name} ({'quick' if args.quick else 'full'}) ...")
            bar.set_postfix(name)
            t0 = time.perf_counter()
            entry: dict[str, Any] = {"path": path, "error": None, "rows": []}
            try:
                mod = _load(name, path)
                rows = check_rows(name, mod.run(quick=args.quick,
                                                workdir=common.fresh_dir(work, name),
                                                **_options_for(mod.run, args)))
                entry["rows"] = rows
            except Exception:          # one broken benchmark must not hide the others
                entry["error"] = traceback.format_exc()
                print(entry["error"], file=sys.stderr)
                status = 1
            finally:
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
            entry["seconds"] = time.perf_counter() - t0
            results["benchmarks"][name] = entry
            results["rows"].extend({"benchmark": name, **r} for r in entry["rows"])
            say(f"   {len(entry['rows'])} rows in {entry['seconds']:.1f} s")
            bar.update(1)
    finally:
        bar.close()
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    results = _json_safe(results)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "results.json")
    md_path = os.path.join(args.out, "results.md")
    with open(json_path, "w") as fh:
        json.dump(results, fh, indent=2)
        fh.write("\n")
    text = markdown(results)
    with open(md_path, "w") as fh:
        fh.write(text)
    print()
    print(text)
    print(f"wrote {json_path} and {md_path}")
    if args.strict and any(common.verdict(r) is False for r in results["rows"]):
        status = status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
