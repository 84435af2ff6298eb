"""Layers that point one way: who may import whom, read from the source with ``ast``.

* ``config``, ``errors``, ``ownfiles`` and ``safejson`` are leaves: they import no chemio
  module except ``errors``, ``ownfiles`` and ``safejson``, neither at module level nor
  inside functions;
* the wings of the house import downward only (runtime -> scratch -> backends ->
  files/arrays -> tools -> face -> cli), so the device layer never imports the user level;
* nothing below the package face imports it, and no module uses another's ``_name``;
* the module-level import graph of ``chemio_py`` has no cycle;
* ``import chemio_py`` loads NumPy and the standard library only.

And the seams that replaced the upward imports keep today's behaviour: configuration
change hooks (``io_threads``/``sync`` restart the I/O pool, ``trace`` re-reads the trace
setting, ``comm=`` sets the communicator), and ``CancelledError`` living in ``errors``.
"""
from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import subprocess
import sys
import threading

import importlib

import pytest

import chemio_py as cio
from chemio_py import errors
from chemio_py.runtime import config, pool, requests, trace
from conftest import REPO

comm_mod = importlib.import_module("chemio_py.runtime.comm")     # cio.comm is the function

ROOT = REPO
PACKAGES = {"chemio_py": "chemio_py", "backends": "chemio_py.backends"}   # dir -> package

LEAVES = ("chemio_py.runtime.config", "chemio_py.errors", "chemio_py.runtime.ownfiles",
          "chemio_py.runtime.safejson", "chemio_py._version")
LEAF_MAY_IMPORT = {"chemio_py.errors", "chemio_py.runtime.ownfiles",
                   "chemio_py.runtime.safejson"}
HEAVY = ("mpi4py", "dask", "h5py", "zarr")


# ---------------------------------------------------------------- reading the imports

def _module_files() -> dict[str, str]:
    """Every module of the package and of the device layer: dotted name -> file."""
    out = {}
    for d, pkg in PACKAGES.items():
        top = os.path.join(ROOT, d)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [n for n in dirnames if not n.startswith((".", "__pycache__"))]
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), top)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join([pkg] + rel)] = os.path.join(dirpath, f)
    return out


MODULES = _module_files()


class Imports(ast.NodeVisitor):
    """The chemio modules one module imports: ``runtime`` ones at module level (what runs
    when it is imported), ``lazy`` ones inside functions, ``typing`` ones under
    ``if TYPE_CHECKING:``. ``importlib.import_module("...")`` of a constant counts too."""

    def __init__(self, name: str, path: str):
        self.name = name
        self.package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        self.runtime: set[str] = set()
        self.lazy: set[str] = set()
        self.typing: set[str] = set()
        self._depth = 0          # functions we are inside
        self._typing = 0         # TYPE_CHECKING blocks we are inside
        with open(path, encoding="utf-8") as f:
            self.visit(ast.parse(f.read(), path))

    def _absolute(self, module: str | None, level: int) -> str:
        if not level:
            return module or ""
        parts = self.package.split(".")
        base = ".".join(parts[: len(parts) - (level - 1)])
        return f"{base}.{module}" if module else base

    def _add(self, target: str) -> None:
        if not (target == "chemio_py" or target.startswith("chemio_py.")):
            return
        (self.typing if self._typing else self.lazy if self._depth else self.runtime).add(target)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._add(a.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.module, node.level)
        for a in node.names:
            sub = f"{base}.{a.name}"
            # ``from . import config`` imports the module chemio_py.runtime.config; ``from .errors
            # import X`` (or ``from chemio_py import configure``) the module named by ``base``.
            self._add(sub if sub in MODULES else base)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if fname in ("import_module", "__import__") and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            target = node.args[0].value
            if target.startswith("."):
                level = len(target) - len(target.lstrip("."))
                target = self._absolute(target.lstrip(".") or None, level)
            self._add(target)
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        t = node.test
        if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
                (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
            self._typing += 1
            for n in node.body:
                self.visit(n)
            self._typing -= 1
            for n in node.orelse:
                self.visit(n)
        else:
            self.generic_visit(node)


@pytest.fixture(scope="module")
def imports() -> dict[str, Imports]:
    return {name: Imports(name, path) for name, path in MODULES.items()}


def _all(imp: Imports) -> set[str]:
    return (imp.runtime | imp.lazy | imp.typing) - {imp.name}


def test_the_scan_sees_the_modules_and_both_kinds_of_import(imports):
    """The reader itself: it finds the modules and tells module-level from lazy imports."""
    for m in ("chemio_py", "chemio_py.runtime.config", "chemio_py.arrays.diskarray",
              "chemio_py.arrays.interop", "chemio_py.backends", "chemio_py.backends.local",
              "chemio_py.backends.local.backend"):
        assert m in imports, sorted(imports)
    assert "chemio_py.errors" in imports["chemio_py.runtime.config"].runtime
    assert "chemio_py.runtime.config" in imports["chemio_py.runtime.pool"].runtime
    assert "chemio_py.arrays.interop" in imports["chemio_py.arrays.diskarray"].lazy  # to_dask
    local = imports["chemio_py.backends.local.backend"].runtime
    assert {"chemio_py.errors", "chemio_py.runtime.config",
            "chemio_py.backends.local.linux_aio"} <= local
    assert "chemio_py" not in local                            # a submodule, not the package
    assert "chemio_py.arrays.diskarray" in imports["chemio_py"].runtime


def test_the_scan_reads_every_form_of_import(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "from . import meta, sections\n"
        "from .chunks import default_chunks\n"
        "import chemio_py.backends.grid as g\n"
        "if TYPE_CHECKING:\n"
        "    from ..prefetch import Pipeline\n"
        "else:\n"
        "    from chemio_py.runtime import handles\n"
        "class K:\n"
        "    from ..runtime.comm import Comm\n"
        "def f():\n"
        "    from ..runtime import pool\n"
        "    import importlib\n"
        "    importlib.import_module('chemio_py.runtime.stats')\n"
        "    return lambda: __import__('chemio_py.prefetch')\n"
        "async def g():\n"
        "    from ..files.records import RecordFile\n")
    imp = Imports("chemio_py.arrays.diskarray", str(src))
    assert imp.runtime == {"chemio_py.arrays.meta", "chemio_py.arrays.sections",
                           "chemio_py.arrays.chunks", "chemio_py.backends.grid",
                           "chemio_py.runtime.handles", "chemio_py.runtime.comm"}
    assert imp.typing == {"chemio_py.prefetch"}
    assert imp.lazy == {"chemio_py.runtime.pool", "chemio_py.runtime.stats",
                        "chemio_py.prefetch", "chemio_py.files.records"}


# ---------------------------------------------------------------- the rules

@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_no_other_chemio_module(imports, leaf):
    bad = sorted(_all(imports[leaf]) - LEAF_MAY_IMPORT)
    assert not bad, (f"{leaf} is a leaf of the layers and may import only "
                     f"{sorted(LEAF_MAY_IMPORT)}, but imports {bad} (at module level or in a "
                     f"function); let the upper module subscribe to it instead "
                     f"(config.on_change)")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = GREY
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = BLACK
                stack.pop()
                path.pop()
            elif colour.get(nxt, BLACK) == GREY:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt) == WHITE:
                colour[nxt] = GREY
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_module_level_imports_have_no_cycle(imports):
    graph = {n: {t for t in imp.runtime if t in MODULES and t != n} for n, imp in imports.items()}
    cycle = _cycle(graph)
    assert cycle is None, (f"module-level import cycle: {' -> '.join(cycle)}; one of these "
                           f"imports must point the other way or move into the function "
                           f"that needs it")


def test_interop_and_diskarray_point_one_way(imports):
    assert "chemio_py.arrays.diskarray" in imports["chemio_py.arrays.interop"].runtime
    assert "chemio_py.arrays.interop" not in imports["chemio_py.arrays.diskarray"].runtime


# ---------------------------------------------------------------- the house

# Wings, from the ground up: a module imports (at module level or in a function) only
# modules of its own wing or of lower ones. The face (``chemio_py``) stands above every
# wing it re-exports; ``cli`` and ``testing`` stand above the face.
WINGS = {
    "chemio_py._version": 0, "chemio_py._imports": 0, "chemio_py.errors": 0,
    "chemio_py.runtime": 1,
    "chemio_py.scratch": 2,
    "chemio_py.backends": 3,
    "chemio_py.files": 4, "chemio_py.arrays": 4, "chemio_py.prefetch": 4, "chemio_py.sync": 4,
    "chemio_py.tools": 5,
    "chemio_py": 6,
    "chemio_py.cli": 7, "chemio_py.testing": 7, "chemio_py.pyscf": 7,
}


def wing(module: str) -> int:
    best = max((p for p in WINGS if module == p or module.startswith(p + ".")), key=len)
    return WINGS[best]


def test_every_module_has_a_wing():
    assert {m: wing(m) for m in MODULES}
    assert wing("chemio_py.backends.zarr.format") == 3 and wing("chemio_py") == 6


def test_wings_import_downward(imports):
    found = [f"{name} (wing {wing(name)}) imports {t} (wing {wing(t)})"
             for name, imp in sorted(imports.items())
             for t in sorted(imp.runtime | imp.lazy)
             if t != name and wing(t) > wing(name)]
    assert not found, ("imports that climb: " + "; ".join(found) + ". Order: runtime -> "
                       "scratch -> backends -> files/arrays -> tools -> face -> cli; move the "
                       "code down, or let the lower module offer a hook the upper one fills")


def test_nothing_below_the_face_takes_a_name_from_it(imports):
    """``from chemio_py import DiskArray`` inside the package would import the face (and so
    everything) from a module the face itself imports; take the name from its module."""
    found = sorted(name for name, imp in imports.items()
                   if wing(name) < WINGS["chemio_py"] and "chemio_py" in _all(imp))
    assert not found, f"{found} import the package face; import the defining module instead"


class PrivateUses(ast.NodeVisitor):
    """``_names`` that one module takes from another chemio module: ``from m import _x``,
    ``alias._x`` where ``alias`` names a chemio module, and ``getattr(alias, "_x")``."""

    def __init__(self, name: str, path: str):
        self.name = name
        self.aliases: dict[str, str] = {}
        self.found: list[str] = []
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    root = ".".join(parts[: len(parts) - (node.level - 1)])
                    base = f"{root}.{base}" if base else root
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        self.aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in MODULES and base != name and _private(a.name):
                        self.found.append(f"from {base} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        self.aliases[a.asname] = a.name
        self.visit(tree)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        v = node.value
        if isinstance(v, ast.Name) and v.id in self.aliases and _private(node.attr) \
                and self.aliases[v.id] != self.name:
            self.found.append(f"{self.aliases[v.id]}.{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "setattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) \
                and node.args[0].id in self.aliases and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            self.found.append(f"{f.id}({self.aliases[node.args[0].id]}, {node.args[1].value!r})")
        self.generic_visit(node)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_private_names_stay_in_their_module():
    found = {name: PrivateUses(name, path).found for name, path in MODULES.items()}
    found = {k: v for k, v in found.items() if v}
    assert not found, (f"modules use other modules' private names: {found}; a name a "
                       f"sibling needs is public inside its family (drop the underscore)")


def test_the_private_name_reader_sees_every_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from chemio_py.runtime import stats as st\n"
                   "from chemio_py.runtime.requests import _x, Request\n"
                   "st._trace.on\n"
                   "getattr(st, '_trace')\n"
                   "st.report()\n")
    got = PrivateUses("chemio_py.files.records", str(src)).found
    assert sorted(got) == sorted(["from chemio_py.runtime.requests import _x",
                                  "chemio_py.runtime.stats._trace",
                                  "getattr(chemio_py.runtime.stats, '_trace')"])


def _fresh_import(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHEMIO_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_chemio_py_is_light():
    """A fresh ``import chemio_py`` loads NumPy and the standard library, nothing else."""
    got = _fresh_import(
        "import json, sys\n"
        "import numpy\n"
        "before = set(sys.modules)\n"
        "import chemio_py\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print(json.dumps({'new': new, 'all': sorted(sys.modules)}))\n")
    heavy = sorted(m for m in got["all"] if m.split(".")[0] in HEAVY)
    assert not heavy, f"import chemio_py loaded {heavy}; import them on first use"
    other = sorted({m.split(".")[0] for m in got["new"]}
                   - set(sys.stdlib_module_names) - {"chemio_py"})
    assert not other, f"import chemio_py loaded third-party modules {other}"
    assert "chemio_py.arrays.interop" not in got["all"]


# ---------------------------------------------------------------- config change hooks

def test_on_change_calls_subscribers_of_changed_names_only():
    calls = []
    remove = config.on_change(("sync", "trace"), lambda ch, reset: calls.append((ch, reset)))
    try:
        cio.configure(backend="local")
        assert calls == []
        cio.configure(sync=True, keep=True)
        assert calls == [({"sync": True}, False)]
        cio.configure(sync=None)
        assert calls[-1] == ({"sync": None}, False)
        calls.clear()
        config.reset()
        assert calls == [({"sync": None, "trace": None}, True)]
    finally:
        remove()
    calls.clear()
    cio.configure(sync=False)
    cio.configure(sync=None)
    assert calls == []              # removed


def test_on_change_refuses_unknown_names():
    with pytest.raises(config.ConfigError, match="iothreads"):
        config.on_change(("iothreads",), lambda ch, reset: None)


def test_invalid_configure_changes_nothing_and_calls_no_hook():
    calls = []
    remove = config.on_change(("io_threads", "comm"), lambda ch, reset: calls.append(ch))
    mine = comm_mod.SerialComm()
    try:
        with pytest.raises(config.ConfigError):
            cio.configure(comm=mine, io_threads=0)
        assert calls == [] and cio.comm() is not mine
    finally:
        remove()


def _io_threads_alive() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("chemio-io_") and t.is_alive())


def test_configure_io_threads_restarts_the_pool_and_reset_keeps_it():
    """As before the hooks: ``configure(io_threads=)`` starts a new pool of that size;
    ``reset()`` only makes the next request re-read ``sync``."""
    try:
        cio.configure(io_threads=3)
        pool.submit(lambda: None).wait(10)
        assert _io_threads_alive() == 3
        config.reset()
        pool.submit(lambda: None).wait(10)
        assert _io_threads_alive() == 3
        cio.configure(io_threads=2)
        pool.submit(lambda: None).wait(10)
        assert _io_threads_alive() == 2
    finally:
        cio.configure(io_threads=None)


def test_reset_rereads_sync_from_the_environment(monkeypatch):
    assert pool.sync_mode() is False
    monkeypatch.setenv("CHEMIO_SYNC", "1")
    assert pool.sync_mode() is False            # cached until something changes
    config.reset()
    assert pool.sync_mode() is True
    r = pool.submit(lambda: 7)
    assert r.done() and r.wait() == 7
    monkeypatch.delenv("CHEMIO_SYNC")
    config.reset()
    assert pool.sync_mode() is False


def test_configure_trace_reaches_stats(tmp_path):
    target = str(tmp_path / "trace.json")
    cio.configure(trace=target)
    assert trace.collector.on and trace.collector.path == target
    cio.configure(trace=None)
    assert not trace.collector.on


# ---------------------------------------------------------------- the communicator

def test_configure_comm_sets_the_default_communicator():
    default = cio.comm()
    mine = comm_mod.SerialComm()
    cio.configure(comm=mine)
    assert cio.comm() is mine and comm_mod.resolve(None) is mine
    cio.configure(comm=None)
    assert cio.comm() is default
    cio.configure(comm=mine)
    config.reset()
    assert cio.comm() is default
    assert "comm" not in cio.settings()
    with pytest.raises(config.ConfigError, match="'comm'"):
        cio.configure(commm=mine)


def test_configure_comm_takes_an_mpi_sub_communicator(mpirun):
    mpirun(3, """
        from mpi4py import MPI
        import numpy as np
        import chemio_py as cio
        world = MPI.COMM_WORLD
        assert cio.comm().size == 3
        sub = world.Split(world.rank % 2, world.rank)
        cio.configure(comm=sub)
        c = cio.comm()
        assert (c.size, c.rank) == (sub.Get_size(), sub.Get_rank()), (c, sub)
        d = cio.DiskArray.create(f"layers{world.rank % 2}", (4, 3), "f8")
        if c.rank == 0:
            d[:] = np.full((4, 3), world.rank % 2 + 1.0)
        c.barrier()
        assert (d[:] == world.rank % 2 + 1.0).all()
        d.delete()   # collective over the sub-communicator only
        cio.configure(comm=None)
        assert cio.comm().size == 3
        world.Barrier()
        sub.Free()
    """, timeout=120)


# ---------------------------------------------------------------- CancelledError

def test_cancelled_error_lives_in_errors_and_is_a_futures_cancellation():
    assert requests.CancelledError is errors.CancelledError
    assert issubclass(errors.CancelledError, concurrent.futures.CancelledError)
    assert issubclass(errors.CancelledError, errors.ChemIOError)
    assert "CancelledError" in errors.__all__
    assert config.ConfigError is errors.ConfigError


def test_a_cancelled_request_is_caught_as_a_futures_cancellation():
    cio.configure(io_threads=1)
    try:
        gate, started = threading.Event(), threading.Event()
        blocker = pool.submit(lambda: (started.set(), gate.wait(30)))
        assert started.wait(10)
        queued = pool.submit(lambda: "ran")
        pending = requests.Pending()
        pending.add(queued)
        assert queued.cancel() is True
        with pytest.raises(concurrent.futures.CancelledError) as ei:
            queued.wait()
        assert type(ei.value) is errors.CancelledError
        assert isinstance(queued.exception(), errors.CancelledError)
        gate.set()
        blocker.wait(10)
        assert pending.drain() == []        # a cancellation is not an unobserved I/O error
    finally:
        gate.set()
        cio.configure(io_threads=None)
