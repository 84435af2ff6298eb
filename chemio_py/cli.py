"""The ``chemio`` command: info, config, clean, demo, check, ls, trace, bench.

Every subcommand is one row of ``COMMANDS``, a ``Command(name, help, add_arguments, run)``:
``add_arguments(parser)`` adds its arguments, ``run(args)`` does the work and returns the exit
status. The commands of ``chemio_py.tools`` are written there, each module offering
``add_arguments(parser)`` and ``run(args)`` (also used by its own ``main``); the others are
here. A command with ``rest=True`` (``bench``) gets the arguments it does not declare as
``args.rest`` instead of a usage error. To add a command, add a row.

Results go to stdout, problems to stderr. When the reader of stdout stops early
(``chemio info | head -1``) the command ends quietly, without a traceback or an error line,
with status 141 (128 + SIGPIPE): what git, cat and the other Unix tools report there, so a
script under ``set -o pipefail`` tells an early close from a failure (1) and a usage error (2).
"""
from __future__ import annotations

import argparse
import os
import platform
import select
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from chemio_py.errors import RefusedRemoval, fmt_bytes
from chemio_py.runtime import config
from chemio_py.scratch import fs, janitor, jobs
from chemio_py.tools import check, listing, trace_view


def cmd_info(args: argparse.Namespace) -> int:
    import numpy

    import chemio_py
    import chemio_py.backends as backends
    print(f"chemio_py {chemio_py.__version__} (Python {platform.python_version()}, "
          f"NumPy {numpy.__version__}) on {platform.node()}")
    print("\nbackends:")
    for name, (ok, why) in backends.availability().items():
        print(f"  {name:8s} {'available' if ok else 'UNAVAILABLE'}: {why}")
    print("\nscratch:")
    places = [("private (rank 0)", jobs.private_root(0)), ("shared", jobs.shared_root()),
              ("shm", config.get("shm_dir"))]
    for label, path in places:
        try:
            info = fs.stat(path)
            print(f"  {label:17s} {path}  {fmt_bytes(info.free)} free of {fmt_bytes(info.total)}, "
                  f"{info.fstype}")
        except OSError as e:
            print(f"  {label:17s} {path}  not usable: {e}")
    print("\nMPI:")
    try:
        from mpi4py import MPI
        lib = MPI.Get_library_version().strip().splitlines()[0]
        import mpi4py
        print(f"  mpi4py {mpi4py.__version__}; {lib}")
        from chemio_py.backends.mpiio import backend as mpiio
        print(f"  MPI-IO (ROMIO) drivers: {', '.join(mpiio.romio_drivers()) or 'none found'}")
        print(f"  mpiio hints: {', '.join(f'{k}={v}' for k, v in mpiio.hints().items())} "
              f"(defaults {mpiio.DEFAULT_HINTS}, more from the mpiio_hints setting)")
    except ImportError:
        print("  mpi4py not installed (serial only); pip install 'chemio-py[mpi]'")
    print("\nsettings:")
    _print_settings()
    return 0


def _setting_line(s: config.Setting, note: str = "") -> str:
    width = max(map(len, config.SPECS))
    return f"  {s.name:{width}s} = {s.value!r:30s} ({s.source}){note}"


def _print_settings() -> None:
    for s in config.settings().values():
        print(_setting_line(s))


def cmd_config(args: argparse.Namespace) -> int:
    """Every setting with its source, the per-name rules and the backend of each NAME; then
    every problem of the settings (on stderr). ``--check`` prints only the verdict. Exit 1
    when anything is wrong (a bad value, file, rule or directory), else 0."""
    found = config.survey()
    if not args.check:
        print(f"config file: {found.config_file or '(none)'}")
        for s in found.settings.values():
            print(_setting_line(s, "  INVALID (see below)" if s.name in found.invalid else ""))
        if found.rules:
            print("\nper-name rules:")
            for pattern, values, source in found.rules:
                print(f"  {pattern!r}: {values}  ({source})")
        if args.names and not found.problems:
            print("\nbackend by name:")
            for n in args.names:
                s = config.backend_for(n)
                print(f"  {n:24s} -> {s.value:8s} ({s.source})")
    if found.problems:
        n = len(found.problems)
        print(f"chemio config: {n} problem{'s' if n > 1 else ''} with the settings; fix "
              f"{'them' if n > 1 else 'it'} before running a job:", file=sys.stderr)
        for problem in found.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    if args.check:
        print(f"chemio config: all {len(found.settings)} settings valid (config file: "
              f"{found.config_file or 'none'})")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    """Remove job directories that carry chemio's marker and whose every lease is provably
    dead; list everything else with the reason it stays. Exit 1 only when a removal failed."""
    roots = args.root or janitor.all_roots()
    infos = janitor.scan_job_dirs(roots)
    labels = {"in use": "in use", "keep": "keeping", "vanished": "vanished",
              "skipped": "skipped"}
    stale = kept = 0
    failed: list[str] = []
    temps_removed = temps_kept = 0
    for i in infos:
        shown = fs.printable(i.path)
        if i.status != "stale":
            kept += i.status in ("keep", "skipped")
            print(f"{labels.get(i.status, i.status):12s} {shown}  ({i.reason})")
            if i.status == "in use":            # temp files of writers killed mid-write
                sweep = jobs.sweep_temps(i.path, dry_run=args.dry_run)
                for name, why in sweep.removed:
                    print(f"  {'would remove' if args.dry_run else 'removed':12s} temp file "
                          f"{fs.printable(name)}  ({why})")
                for name, why in sweep.kept:
                    print(f"  {'keeping':12s} temp file {fs.printable(name)}  ({why})")
                for name, why in sweep.failed:
                    failed.append(os.path.join(i.path, name))
                    print(f"  FAILED: could not remove temp file {fs.printable(name)}"
                          f"  ({why})")
                temps_removed += len(sweep.removed)
                temps_kept += len(sweep.kept)
            continue
        stale += 1
        print(f"{'would remove' if args.dry_run else 'removing':12s} {shown}  ({i.reason})")
        if args.dry_run:
            continue
        try:
            janitor.remove_job_dir(i.path, roots)
        except RefusedRemoval as e:            # it changed since the scan: keep it
            print(f"  kept after all: {e}")
        except OSError as e:
            failed.append(i.path)
            print(f"  FAILED: could not remove {shown}: {e}")
    if not infos:
        print(f"no chemio job directories under {', '.join(roots)}")
    print(f"{stale} stale of {len(infos)} job directories"
          f"{' (dry run: nothing removed)' if args.dry_run else ''}"
          f"{f'; {kept} kept (see the reasons above)' if kept else ''}")
    if temps_removed or temps_kept:
        print(f"{temps_removed} temp file{'s' if temps_removed != 1 else ''} of dead writers "
              f"{'would be ' if args.dry_run else ''}removed from job directories in use"
              f"{f', {temps_kept} kept' if temps_kept else ''}")
    if failed:
        print(f"chemio clean: could not remove {len(failed)} stale job director"
              f"{'y' if len(failed) == 1 else 'ies'} or temp files: "
              f"{', '.join(map(fs.printable, failed))} "
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
    print(f"  scratch: {jobs.private_root(cio.comm().rank)} "
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


def _benchmark_places() -> list[str]:
    """Where ``chemio bench`` looks for the suite (``benchmarks/runner.py``), in order."""
    import chemio_py
    cands = [os.path.join(p, "benchmarks") for p in chemio_py.__path__]
    here = os.path.dirname(os.path.abspath(chemio_py.__file__))
    cands += [os.path.join(here, "..", "benchmarks"),
              os.path.join(os.getcwd(), "benchmarks")]
    return [os.path.abspath(c) for c in cands]


def _benchmarks_dir() -> str | None:
    for c in _benchmark_places():
        if os.path.isfile(os.path.join(c, "runner.py")):
            return c
    return None


_BENCH_NOT_HERE = ("the benchmark suite is not part of the installed package: it is the "
                   "benchmarks/ folder of the chemio_py source checkout. Run 'chemio bench' "
                   "from a checkout (or pass --dir PATH/benchmarks)")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the suite's runner with ``args.rest``; without the suite, ``--help`` says where it
    is (exit 0) and anything else says so as an error (exit 2)."""
    d = args.dir or _benchmarks_dir()
    if d is None or not os.path.isfile(os.path.join(d, "runner.py")):
        if args.dir is None and any(a in ("-h", "--help") for a in args.rest):
            args.bench_parser.print_help()
            print(f"\n{_BENCH_NOT_HERE}; there 'chemio bench --help' lists the runner's "
                  f"options (--quick, --only NAME, --list, --out DIR, ...).\nLooked in: "
                  f"{', '.join(_benchmark_places())}")
            return 0
        where = (f"--dir {args.dir!r} holds no runner.py" if args.dir is not None
                 else f"{_BENCH_NOT_HERE} (looked in: {', '.join(_benchmark_places())})")
        print(f"chemio bench: {where}", file=sys.stderr)
        return 2
    sys.path.insert(0, d)
    mod = _load_script(os.path.join(d, "runner.py"), "chemio_benchmarks_runner")
    return int(mod.main(args.rest) or 0)


# ---------------------------------------------------------------- arguments of each command

def _no_arguments(p: argparse.ArgumentParser) -> None:
    pass


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="file names to show the backend rule for")
    p.add_argument("--check", action="store_true", help="only check: list every problem of "
                   "the environment, config file and directories (exit 1), or say all is well")


def _clean_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--root", action="append", help="scratch root to sweep (repeatable); "
                   "default: every root chemio uses here")


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eaf", action="store_true", help="run the short EAF pass instead "
                   "(no PySCF needed)")
    p.add_argument("--records", type=int, default=64, help="1 MiB records of the --eaf pass")


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="benchmarks directory (default: the source checkout's)")
    p.set_defaults(bench_parser=p)


@dataclass(frozen=True)
class Command:
    """One subcommand, ``chemio NAME``: its one-line ``help``, ``add_arguments(parser)`` adding
    its arguments, ``run(args)`` returning the exit status; ``parser`` holds more keywords of
    ``add_parser`` (description, usage, add_help); ``rest``: undeclared arguments go to
    ``run`` as ``args.rest`` instead of being a usage error."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    parser: dict[str, Any] = field(default_factory=dict)
    rest: bool = False


COMMANDS: tuple[Command, ...] = (
    Command("info", "version, backends, scratch dirs, MPI, settings", _no_arguments, cmd_info),
    Command("config", "effective settings with their sources, and their problems (exit 1 "
            "when there is one)", _config_arguments, cmd_config),
    Command("clean", "remove scratch of jobs whose processes are gone", _clean_arguments,
            cmd_clean),
    Command("demo", "the main job: out-of-core RI-MP2 checked against PySCF", _demo_arguments,
            cmd_demo),
    Command("check", "verify a persistent DiskArray, a Zarr array or a RecordFile",
            check.add_arguments, check.run, {"description": check.DESCRIPTION}),
    Command("ls", "list the scratch: jobs, their processes and liveness, and their objects",
            listing.add_arguments, listing.run),
    Command("trace", "a recorded I/O trace (CHEMIO_TRACE) as a timeline picture and summary",
            trace_view.add_arguments, trace_view.run),
    Command("bench", "run the benchmark suite of the source checkout (options go to its "
            "runner)", _bench_arguments, cmd_bench,
            {"add_help": False, "usage": "chemio bench [--dir DIR] [runner options: --quick, "
             "--only NAME, --list, --out DIR, ...]"}, rest=True),
)


class _Parser(argparse.ArgumentParser):
    """argparse, but help, usage and version text that cannot be written is not dropped in
    silence: a closed stdout ends ``chemio --help`` as it ends any other command (``main``)."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            (file or sys.stderr).write(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``chemio`` parser with one subparser per row of ``COMMANDS``."""
    import chemio_py
    p = _Parser(prog="chemio", description="chemio_py: out-of-core scratch I/O for "
                "computational chemistry")
    p.add_argument("--version", action="version", version=f"chemio_py {chemio_py.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for c in COMMANDS:
        c.add_arguments(sub.add_parser(c.name, help=c.help, **c.parser))
    return p


# The exit status of a command whose reader closed stdout: 128 + SIGPIPE, as a shell reports
# git or cat stopped by that signal.
EXIT_READER_GONE = 141


def _reader_gone() -> bool:
    """True when stdout is a pipe or socket whose reading end has been closed."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):     # no real descriptor (captured, closed)
        return False


def _run(argv: list[str]) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    command = next(c for c in COMMANDS if c.name == args.cmd)
    if command.rest:
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    import chemio_py.backends as backends
    config.set_choices("backend", backends.names)     # backend names checked with the rest
    try:
        return command.run(args)
    except Exception as e:
        from chemio_py.errors import ChemIOError
        if isinstance(e, BrokenPipeError) and _reader_gone():
            raise                                      # the reader left: see main()
        if isinstance(e, (ChemIOError, OSError)):
            print(f"chemio {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``chemio`` with ``argv`` (default: the command line); returns the exit status:
    0 done, 1 failed (the reason on stderr), 2 usage error, 141 stdout closed by its reader."""
    try:
        try:
            return _run(list(sys.argv[1:] if argv is None else argv))
        finally:
            sys.stdout.flush()              # a closed pipe fails here, not at interpreter exit
    except BrokenPipeError:
        if not _reader_gone():
            raise
        # Nobody reads what is left: send it (and the flush at exit) to /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_READER_GONE


if __name__ == "__main__":
    sys.exit(main())
