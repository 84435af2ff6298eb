"""The ``chemio`` command: info, config, clean, demo, bench."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any, Sequence

from . import check, config, scratch


def _human(n: int | None) -> str:
    from .errors import _fmt_bytes
    return _fmt_bytes(n)


def cmd_info(args: argparse.Namespace) -> int:
    import chemio_py
    import chemio_py.backends as backends
    import numpy
    print(f"chemio_py {chemio_py.__version__} (Python {platform.python_version()}, "
          f"NumPy {numpy.__version__}) on {platform.node()}")
    print("\nbackends:")
    for name, (ok, why) in backends.availability().items():
        print(f"  {name:8s} {'available' if ok else 'UNAVAILABLE'}: {why}")
    print("\nscratch:")
    places = [("private (rank 0)", scratch.private_root(0)), ("shared", scratch.shared_root()),
              ("shm", config.get("shm_dir"))]
    for label, path in places:
        try:
            fs = scratch.stat(path)
            print(f"  {label:17s} {path}  {_human(fs.free)} free of {_human(fs.total)}, "
                  f"{fs.fstype}")
        except OSError as e:
            print(f"  {label:17s} {path}  not usable: {e}")
    print("\nMPI:")
    try:
        from mpi4py import MPI
        lib = MPI.Get_library_version().strip().splitlines()[0]
        import mpi4py
        print(f"  mpi4py {mpi4py.__version__}; {lib}")
        from chemio_py.backends import mpiio
        print(f"  MPI-IO (ROMIO) drivers: {', '.join(mpiio.romio_drivers()) or 'none found'}")
        print(f"  mpiio hints: {', '.join(f'{k}={v}' for k, v in mpiio.hints().items())} "
              f"(defaults {mpiio.DEFAULT_HINTS}, more from the mpiio_hints setting)")
    except ImportError:
        print("  mpi4py not installed (serial only); pip install 'chemio-py[mpi]'")
    print("\nsettings:")
    _print_settings()
    return 0


def _print_settings() -> None:
    for s in config.settings().values():
        print(f"  {s.name:15s} = {s.value!r:30s} ({s.source})")


def cmd_config(args: argparse.Namespace) -> int:
    print(f"config file: {config.config_path() or '(none)'}")
    _print_settings()
    rules = config.file_rules()
    if rules:
        print("\nper-name rules:")
        for pattern, values, source in rules:
            print(f"  {pattern!r}: {values}  ({source})")
    if args.names:
        print("\nbackend by name:")
        for n in args.names:
            s = config.backend_for(n)
            print(f"  {n:24s} -> {s.value:8s} ({s.source})")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    """Remove job directories that carry chemio's marker and whose every lease is provably
    dead; list everything else with the reason it stays. Exit 1 only when a removal failed."""
    roots = args.root or scratch.all_roots()
    infos = scratch.scan_job_dirs(roots)
    labels = {"in use": "in use", "keep": "keeping", "vanished": "vanished",
              "skipped": "skipped"}
    stale = kept = 0
    failed: list[str] = []
    for i in infos:
        shown = scratch.printable(i.path)
        if i.status != "stale":
            kept += i.status in ("keep", "skipped")
            print(f"{labels.get(i.status, i.status):12s} {shown}  ({i.reason})")
            continue
        stale += 1
        print(f"{'would remove' if args.dry_run else 'removing':12s} {shown}  ({i.reason})")
        if args.dry_run:
            continue
        try:
            scratch.remove_job_dir(i.path, roots)
        except scratch.RefusedRemoval as e:       # it changed since the scan: keep it
            print(f"  kept after all: {e}")
        except OSError as e:
            failed.append(i.path)
            print(f"  FAILED: could not remove {shown}: {e}")
    if not infos:
        print(f"no chemio job directories under {', '.join(roots)}")
    print(f"{stale} stale of {len(infos)} job directories"
          f"{' (dry run: nothing removed)' if args.dry_run else ''}"
          f"{f'; {kept} kept (see the reasons above)' if kept else ''}")
    if failed:
        print(f"chemio clean: could not remove {len(failed)} stale job director"
              f"{'y' if len(failed) == 1 else 'ies'}: {', '.join(map(scratch.printable, failed))} "
              f"(see above); fix the cause and run 'chemio clean' again", file=sys.stderr)
        return 1
    return 0


def _load_script(path: str, name: str) -> Any:
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None     # path names a .py file
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _examples_dir() -> str | None:
    import importlib.util
    try:
        spec = importlib.util.find_spec("chemio_py.examples")
    except ImportError:
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(d, "ri_mp2.py")):
            return d
    return None


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: out-of-core RI-MP2 of water with read-ahead, checked against PySCF."""
    if args.eaf:
        return demo_eaf(args.records)
    d = _examples_dir()
    if d is None:
        print("chemio demo: the examples are not installed with this chemio_py; "
              "reinstall from the source tree (pip install '.[mpi,examples]')", file=sys.stderr)
        return 2
    try:
        import pyscf  # noqa: F401
    except ImportError:
        print("chemio demo runs RI-MP2 with PySCF integrals, and PySCF is not installed: "
              "pip install 'chemio-py[examples]' (or run 'chemio demo --eaf')", file=sys.stderr)
        return 2
    mod = _load_script(os.path.join(d, "ri_mp2.py"), "chemio_demo_ri_mp2")
    return int(mod.main(list(mod.DEMO_ARGV)) or 0)


def demo_eaf(nrec: int) -> int:
    """A short pass without chemistry: 1 MiB records written behind, read back ahead."""
    import numpy as np
    import chemio_py as cio
    rec = 1 << 17                              # records of 128k doubles = 1 MiB
    print("chemio demo --eaf: an integral-cache pass through an Exclusive Access File")
    print(f"  scratch: {scratch.private_root(cio.comm().rank)} "
          f"(backend {config.backend_for('demo.cache').value})")
    t0 = time.perf_counter()
    with cio.ExclusiveFile("demo.cache", "w+", size_hint=nrec * rec * 8) as f:
        bufs = [np.full(rec, float(k)) for k in range(nrec)]
        cio.waitall([f.awrite(k * rec * 8, bufs[k]) for k in range(nrec)])
        print(f"  wrote {nrec} records of 1 MiB with {nrec} async writes "
              f"in {time.perf_counter() - t0:.3f} s")
        t1 = time.perf_counter()
        total = 0.0
        read = lambda k, buf: f.aread(k * rec * 8, buf)   # noqa: E731
        for k, block in cio.prefetch(read, range(nrec), lambda: np.empty(rec), depth=4):
            if block[-1] != float(k):
                raise AssertionError(f"record {k} holds {block[-1]}")
            total += float(block[0]) * rec
        expect = rec * nrec * (nrec - 1) / 2
        print(f"  read them back with 4 reads in flight in {time.perf_counter() - t1:.3f} s; "
              f"checksum {total:.0f} (expected {expect:.0f})")
        ok = total == expect
        f.delete()
    print("\nI/O report:")
    cio.report()
    print("\nOK" if ok else "\nFAILED: checksum mismatch")
    return 0 if ok else 1


def _benchmarks_dir() -> str | None:
    import chemio_py
    cands = [os.path.join(p, "benchmarks") for p in chemio_py.__path__]
    here = os.path.dirname(os.path.abspath(chemio_py.__file__))
    cands += [os.path.join(here, "..", "benchmarks"),
              os.path.join(os.getcwd(), "benchmarks")]
    for c in cands:
        if os.path.isfile(os.path.join(c, "runner.py")):
            return os.path.abspath(c)
    return None


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    d = args.dir or _benchmarks_dir()
    if d is None or not os.path.isfile(os.path.join(d, "runner.py")):
        print("chemio bench: no benchmarks/ directory found; run it from a source checkout "
              "or pass --dir PATH/benchmarks", file=sys.stderr)
        return 2
    sys.path.insert(0, d)
    mod = _load_script(os.path.join(d, "runner.py"), "chemio_benchmarks_runner")
    return int(mod.main(rest) or 0)


def _add_ls_trace(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from . import listing, trace_view
    listing.add_arguments(sub.add_parser(
        "ls", help="list the scratch: jobs, their processes and liveness, and their objects"))
    trace_view.add_arguments(sub.add_parser(
        "trace", help="a recorded I/O trace (CHEMIO_TRACE) as a timeline picture and summary"))


def cmd_ls(args: argparse.Namespace) -> int:
    from .listing import cmd_ls as run
    return run(args)


def cmd_trace(args: argparse.Namespace) -> int:
    from .trace_view import cmd_trace as run
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chemio", description="chemio_py: out-of-core scratch I/O "
                                "for computational chemistry")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="version, backends, scratch dirs, MPI, settings")
    c = sub.add_parser("config", help="effective settings with their sources")
    c.add_argument("names", nargs="*", help="file names to show the backend rule for")
    cl = sub.add_parser("clean", help="remove scratch of jobs whose processes are gone")
    cl.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    cl.add_argument("--root", action="append", help="scratch root to sweep (repeatable); "
                    "default: every root chemio uses here")
    d = sub.add_parser("demo", help="the main job: out-of-core RI-MP2 checked against PySCF")
    d.add_argument("--eaf", action="store_true", help="run the short EAF pass instead "
                   "(no PySCF needed)")
    d.add_argument("--records", type=int, default=64, help="1 MiB records of the --eaf pass")
    check.add_parser(sub)
    _add_ls_trace(sub)
    b = sub.add_parser("bench", help="run the benchmark suite (options go to the runner)",
                       add_help=False)
    b.add_argument("--dir", help="benchmarks directory (default: the source checkout's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handler = {"info": cmd_info, "config": cmd_config, "clean": cmd_clean, "demo": cmd_demo,
               "check": check.cmd_check, "ls": cmd_ls, "trace": cmd_trace}[args.cmd]
    try:
        return handler(args)
    except Exception as e:
        from .errors import ChemIOError
        if isinstance(e, (ChemIOError, OSError)):
            print(f"chemio {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
