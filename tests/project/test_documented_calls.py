"""Every call with keywords written in the documentation matches a real signature.

The README once documented ``d.iter_blocks(..., direct=True)`` while ``DiskArray.iter_blocks``
took no ``direct``: the call raised ``TypeError``. This test reads the calls written in

* README.md and docs/*.md: fenced ```python blocks and inline code spans;
* the docstrings of chemio_py's public modules, classes and functions, and of the
  examples' modules: ``>>>`` lines, ``::`` literal blocks and inline ````literals````;

parses each snippet with ``ast`` (snippets that are not Python, such as shell lines, are
skipped), resolves each callee to a chemio callable where it honestly can, and binds the
call's keywords (and its positional count, when the snippet shows all of them) to the
callable's signature with ``inspect.Signature.bind_partial``.

Resolution: names bound to chemio_py (``import chemio_py as cio``, ``from chemio_py...
import X``; ``cio`` always), the public names of ``chemio_py``, in a docstring the names
of its own module; methods of variables whose type comes from an assignment or ``with``
in the same snippet (``d = cio.DiskArray.create(...)`` -> DiskArray, by the return
annotation of what was called), else from the conventional names of ``CONVENTIONAL``.
Calls it cannot resolve are counted and printed, never failed.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import os
import pkgutil
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

import pytest

import chemio_py
from conftest import REPO

ROOT = REPO

# Variable names that mean one type throughout the documentation (used only when the
# snippet itself does not say what the name is).
CONVENTIONAL = {
    "d": chemio_py.DiskArray, "d1": chemio_py.DiskArray, "d2": chemio_py.DiskArray,
    "e": chemio_py.DiskArray, "darray": chemio_py.DiskArray,
    "f": chemio_py.ExclusiveFile, "eaf": chemio_py.ExclusiveFile,
    "sf": chemio_py.SharedFile, "log": chemio_py.RecordFile, "ints": chemio_py.RecordFile,
    "wb": chemio_py.WriteBehind,
}


def _forwarding() -> dict:
    """Callables that take ``**kw`` and pass it on: the callable that receives it, or the
    set of keyword names it accepts."""
    from chemio_py.runtime import config
    from chemio_py.arrays import interop
    D = chemio_py.DiskArray
    return {D.from_dask: D.create, interop.from_dask: D.create,
            D.to_xarray: interop.to_xarray,
            config.configure: set(config.SPECS) | set(config.PASSED_ON)}


@dataclass
class Snippet:
    code: str
    file: str
    line: int                        # line of the snippet's first line in ``file``
    names: dict = field(default_factory=dict)   # what bare names mean here
    owner: Any = None                # the class whose docstring (or method's) this is
    bare: bool = True                # a bare ``name(...)`` may be a method of a public class


@dataclass
class Report:
    checked: int = 0
    unresolved: list = field(default_factory=list)
    forwarded: list = field(default_factory=list)
    problems: list = field(default_factory=list)


# ---------------------------------------------------------------- finding snippets

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
INLINE_MD = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
INLINE_RST = re.compile(r"``(.+?)``", re.S)


def _line_at(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def markdown_snippets(path: str, bare: bool = True) -> list[Snippet]:
    text = open(path, encoding="utf-8").read()
    rel = os.path.relpath(path, ROOT)
    out: list[Snippet] = []
    for m in FENCE.finditer(text):
        if m.group(1) == "python":
            out.append(Snippet(m.group(2), rel, _line_at(text, m.start(2)), bare=bare))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)   # keep line numbers
    for m in INLINE_MD.finditer(prose):
        if "(" in m.group(1):
            out.append(Snippet(m.group(1), rel, _line_at(prose, m.start(1)), bare=bare))
    return out


def docstring_snippets(doc: str, file: str, line: int, names: dict,
                       owner: Any = None) -> list[Snippet]:
    """Snippets of one docstring starting at ``line`` of ``file``."""
    out: list[Snippet] = []
    lines = doc.split("\n")
    i = 0
    while i < len(lines):                               # >>> sessions and :: blocks
        s = lines[i].strip()
        if s.startswith(">>>"):
            start, code = i, []
            while i < len(lines) and lines[i].strip().startswith((">>>", "...")):
                code.append(lines[i].strip()[4:])
                i += 1
            out.append(Snippet("\n".join(code), file, line + start, names, owner))
            continue
        if s.endswith("::"):
            indent = len(lines[i]) - len(lines[i].lstrip())
            j, block = i + 1, []
            while j < len(lines) and (not lines[j].strip()
                                      or len(lines[j]) - len(lines[j].lstrip()) > indent):
                block.append(lines[j])
                j += 1
            if block:
                out.append(Snippet(textwrap.dedent("\n".join(block)), file, line + i + 1,
                                   names, owner))
            i = j
            continue
        i += 1
    for m in INLINE_RST.finditer(doc):
        if "(" in m.group(1):
            out.append(Snippet(" ".join(m.group(1).split()), file,
                               line + doc.count("\n", 0, m.start()), names, owner))
    return out


def _docstrings(tree: ast.Module):
    """(docstring, line of its first line, name of the enclosing top-level class or None)
    of the module and of its public classes, functions and methods (``__init__`` included)."""
    def doc_of(node, owner=None):
        body = getattr(node, "body", None)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            return body[0].value.value, body[0].value.lineno, owner
        return None

    def public(name):
        return not name.startswith("_") or name == "__init__"

    found = [doc_of(tree)]
    stack = [(n, None) for n in tree.body]
    while stack:
        node, owner = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and public(node.name):
            if isinstance(node, ast.ClassDef):
                owner = owner or node.name
                stack.extend((n, owner) for n in node.body)
            found.append(doc_of(node, owner))
    return [d for d in found if d is not None]


def public_modules() -> list:
    mods = [chemio_py]
    for info in pkgutil.iter_modules(chemio_py.__path__):
        if info.name.startswith("_") or info.name == "backends":
            continue
        mods.append(importlib.import_module(f"chemio_py.{info.name}"))
    return mods


def all_snippets() -> list[Snippet]:
    out = markdown_snippets(os.path.join(ROOT, "README.md"))
    docs = os.path.join(ROOT, "docs")
    for name in sorted(os.listdir(docs)) if os.path.isdir(docs) else []:
        if name.endswith(".md"):              # bare names there are the backend contract's
            out += markdown_snippets(os.path.join(docs, name), bare=False)
    for mod in public_modules():
        path = mod.__file__
        tree = ast.parse(open(path, encoding="utf-8").read())
        names = {k: v for k, v in vars(mod).items() if not k.startswith("__")}
        for doc, line, owner in _docstrings(tree):
            out += docstring_snippets(doc, os.path.relpath(path, ROOT), line, names,
                                      getattr(mod, owner, None) if owner else None)
    ex = os.path.join(ROOT, "examples")
    for name in sorted(os.listdir(ex)) if os.path.isdir(ex) else []:
        if name.endswith(".py"):
            path = os.path.join(ex, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for doc, line, _ in _docstrings(tree):
                out += docstring_snippets(doc, os.path.relpath(path, ROOT), line, {})
    return out


# ---------------------------------------------------------------- resolving callees

def _is_chemio(obj: Any) -> bool:
    mod = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
    return isinstance(mod, str) and mod.split(".")[0] == "chemio_py"


def _returned_class(fn: Any, owner: Any) -> Any:
    """The chemio class that calling ``fn`` gives, from its return annotation."""
    if inspect.isclass(fn):
        return fn
    try:
        ann = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(ann, str):
        ann = ann.strip("'\"")
        if ann in ("Self", "typing.Self") and owner is not None:
            return owner
        mod = importlib.import_module(fn.__module__) if getattr(fn, "__module__", None) \
            else None
        ann = getattr(mod, ann, None) or getattr(chemio_py, ann, None)
    return ann if inspect.isclass(ann) and _is_chemio(ann) else None


class Resolver:
    def __init__(self, snippet: Snippet):
        self.names = {k: v for k, v in chemio_py.__dict__.items()
                      if k in chemio_py.__all__}
        self.names.update(snippet.names)
        self.names.update(cio=chemio_py, chemio_py=chemio_py)
        self.types: dict[str, Any] = {}          # variable -> chemio class of its value
        self.owner = snippet.owner
        self.bare = snippet.bare

    def learn(self, tree: ast.AST) -> None:
        """Imports and typed assignments of the snippet, in order."""
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "chemio_py":
                        try:
                            mod = importlib.import_module(a.name)
                        except ImportError:
                            continue
                        self.names[a.asname or a.name.split(".")[0]] = \
                            mod if a.asname else chemio_py
                    else:
                        self.names[a.asname or a.name.split(".")[0]] = None
            elif isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.split(".")[0] == "chemio_py":
                try:
                    mod = importlib.import_module(node.module)
                except ImportError:
                    continue
                for a in node.names:
                    self.names[a.asname or a.name] = getattr(mod, a.name, None)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                self._bind(node.targets[0].id, node.value)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if isinstance(item.optional_vars, ast.Name):
                        self._bind(item.optional_vars.id, item.context_expr)

    def _bind(self, var: str, value: ast.AST) -> None:
        cls = None
        if isinstance(value, ast.Call):
            fn, owner = self.callee(value.func)
            if fn is not None:
                cls = _returned_class(fn, owner)
        self.types[var] = cls                   # None: known, but not a chemio object

    def value(self, node: ast.AST) -> tuple[Any, Any]:
        """(object, class of the instance it stands for) that ``node`` names."""
        if isinstance(node, ast.Name):
            if node.id in self.types:
                return None, self.types[node.id]
            if node.id in self.names:
                return self.names[node.id], None
            if node.id in CONVENTIONAL:
                return None, CONVENTIONAL[node.id]
            return None, None
        if isinstance(node, ast.Attribute):
            obj, inst = self.value(node.value)
            if inst is not None:
                attr = inspect.getattr_static(inst, node.attr, None)
                if isinstance(attr, property):
                    ann = attr.fget and _returned_class(attr.fget, inst)
                    return None, ann
                return (getattr(inst, node.attr, None), None) if attr is not None \
                    else (None, None)
            if obj is not None:
                return getattr(obj, node.attr, None), None
        return None, None

    def callee(self, func: ast.AST) -> tuple[Any, Any]:
        """(callable, the class it is a method of when called on an instance)."""
        if isinstance(func, ast.Attribute):
            obj, inst = self.value(func.value)
            if inst is not None:
                raw = inspect.getattr_static(inst, func.attr, None)
                if raw is None or isinstance(raw, property):
                    return None, None
                if isinstance(raw, (classmethod, staticmethod)):
                    return getattr(inst, func.attr), None
                return raw, inst                # a plain function: drop ``self``
            if obj is not None:
                fn = getattr(obj, func.attr, None)
                return (fn, None) if callable(fn) and _is_chemio(fn) else (None, None)
            return None, None
        if isinstance(func, ast.Name):
            if func.id in self.types:
                return None, None
            fn = self.names.get(func.id)
            if fn is not None and callable(fn) and _is_chemio(fn) \
                    and not hasattr(builtins, func.id):
                return fn, None
        return None, None


    def candidates(self, func: ast.AST) -> list[tuple[Any, Any]]:
        """What a call of ``func`` may call: the callee when resolved; for a bare name that
        is no known name, the method of that name of the class whose docstring this is,
        else of each public chemio class that has one (the documentation's ``flush(...)``,
        ``to_xarray(...)``)."""
        fn, method_of = self.callee(func)
        if fn is not None:
            return [(fn, method_of)]
        if not self.bare or not isinstance(func, ast.Name) or func.id in self.types \
                or func.id in self.names or func.id.startswith("_") \
                or hasattr(builtins, func.id):
            return []
        classes = [self.owner] if self.owner is not None and \
            inspect.getattr_static(self.owner, func.id, None) is not None else \
            [c for k, c in vars(chemio_py).items() if k in chemio_py.__all__ and inspect.isclass(c)]
        found = []
        for c in classes:
            raw = inspect.getattr_static(c, func.id, None)
            if raw is None or isinstance(raw, property) or not callable(getattr(c, func.id)):
                continue
            if isinstance(raw, (classmethod, staticmethod)):
                found.append((getattr(c, func.id), None))
            else:
                found.append((raw, c))
        return found


# ---------------------------------------------------------------- binding

def _signature(fn: Any, method_of: Any) -> inspect.Signature:
    sig = inspect.signature(fn)
    if method_of is not None:                   # a function looked up on the class
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig


def _source(node: ast.AST, code: str) -> str:
    return " ".join((ast.get_source_segment(code, node) or ast.dump(node)).split())


def check_call(node: ast.Call, fn: Any, method_of: Any, where: str, code: str,
               report: Report) -> None:
    try:
        sig = _signature(fn, method_of)
    except (TypeError, ValueError):
        report.unresolved.append(f"{where}: {_source(node, code)} (no signature)")
        return
    positional: list = []
    for a in node.args:                         # ``...`` or ``*x``: more may follow
        if isinstance(a, ast.Starred) or (isinstance(a, ast.Constant) and a.value is ...):
            break
        positional.append(a)
    kws = [k.arg for k in node.keywords if k.arg is not None]
    report.checked += 1
    try:
        bound = sig.bind_partial(*positional, **{k: None for k in kws})
    except TypeError as e:
        report.problems.append(f"{where}: {_source(node, code)}\n    {e}; the signature is "
                               f"{getattr(fn, '__qualname__', fn)}{sig}")
        return
    var_kw = next((p.name for p in sig.parameters.values()
                   if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = sorted(bound.arguments.get(var_kw, {})) if var_kw else []
    if not extra:
        return
    target = _forwarding().get(getattr(fn, "__func__", fn)) \
        or _forwarding().get(fn)
    if target is None:
        report.forwarded.append(f"{where}: {_source(node, code)} ({', '.join(extra)} "
                                f"go to **{var_kw})")
        return
    if isinstance(target, set):
        missing = [k for k in extra if k not in target]
        if missing:
            report.problems.append(f"{where}: {_source(node, code)}\n    {', '.join(missing)} "
                                   f"is not one of {sorted(target)}")
        return
    tsig = inspect.signature(target)
    params = [p for p in tsig.parameters.values()
              if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    names = {p.name for p in params}
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    missing = [k for k in extra if k not in names]
    if missing and not has_var_kw:
        report.problems.append(
            f"{where}: {_source(node, code)}\n    {', '.join(missing)} passed on through "
            f"**{var_kw} to {getattr(target, '__qualname__', target)}{tsig}, which takes no "
            f"such keyword")


def check_snippet(sn: Snippet, report: Report) -> None:
    code = sn.code.replace("…", "...")
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return
    r = Resolver(sn)
    r.learn(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if not node.keywords and not node.args:
            continue
        where = f"{sn.file}:{sn.line + node.lineno - 1}"
        found = r.candidates(node.func)
        if not found:
            report.unresolved.append(f"{where}: {_source(node, code)}")
            continue
        trials = []
        for fn, method_of in found:          # the call is right when one of them takes it
            trials.append(Report())
            check_call(node, fn, method_of, where, code, trials[-1])
            if not trials[-1].problems:
                break
        best = trials[-1]
        report.checked += 1
        report.unresolved += best.unresolved
        report.forwarded += best.forwarded
        if best.problems:
            report.problems += [p if len(trials) == 1 else
                                f"{p}\n    (nor does any of the {len(trials)} methods of that "
                                f"name)" for p in trials[0].problems]


def run_check() -> Report:
    report = Report()
    for sn in all_snippets():
        check_snippet(sn, report)
    return report


# ---------------------------------------------------------------- tests

def test_every_documented_call_matches_a_signature(capsys):
    report = run_check()
    with capsys.disabled():
        print(f"\ndocumented calls: {report.checked} checked against their signatures, "
              f"{len(report.forwarded)} with keywords passed on through **kw unchecked, "
              f"{len(report.unresolved)} not resolved to a chemio callable")
    assert report.checked >= 100, "the checker resolved too few calls to mean anything"
    assert not report.problems, ("documented calls that do not match the signature:\n"
                                 + "\n".join(report.problems))


def test_the_checker_finds_a_keyword_the_method_does_not_take():
    report = Report()
    check_snippet(Snippet("d.iter_blocks(..., nonsense=True)", "x.md", 7), report)
    check_snippet(Snippet("import chemio_py as cio\n"
                          "a = cio.DiskArray.create('x', (4,), 'f8')\n"
                          "a.read((), None, None, None)\n"
                          "cio.prefetch(lambda k, b: None, [], depth=2)\n"
                          "unknown.thing(x=1)", "y.md", 1), report)
    assert report.checked == 4
    assert len(report.problems) == 2, report.problems
    assert report.problems[0].startswith("x.md:7: d.iter_blocks(..., nonsense=True)")
    assert "nonsense" in report.problems[0]
    assert report.problems[1].startswith("y.md:3: a.read(")
    assert report.unresolved == ["y.md:5: unknown.thing(x=1)"]


@pytest.mark.parametrize("call", ["d.iter_blocks(axis=0, size=128, depth=2, direct=True)",
                                  "d.iter_blocks(..., direct=True)"])
def test_the_documented_direct_read_ahead_is_accepted(call):
    report = Report()
    check_snippet(Snippet(call, "README.md", 1), report)
    assert report.checked == 1 and not report.problems, report.problems


def test_diskarray_iter_blocks_takes_what_prefetch_iter_blocks_takes(tmp_path):
    """``d.iter_blocks`` forwards every keyword of ``chemio_py.prefetch.iter_blocks`` with
    the same defaults, so the README's ``d.iter_blocks(..., direct=True)`` runs."""
    import numpy as np
    mine = inspect.signature(chemio_py.DiskArray.iter_blocks).parameters
    prefetch_module = importlib.import_module("chemio_py.prefetch")   # cio.prefetch: the function
    theirs = inspect.signature(prefetch_module.iter_blocks).parameters
    assert [(p.name, p.kind, p.default) for p in list(mine.values())[1:]] == \
        [(p.name, p.kind, p.default) for p in list(theirs.values())[1:]]
    model = np.arange(64 * 512, dtype="f8").reshape(64, 512)
    with chemio_py.DiskArray.create("blocks", model.shape, "f8", path=str(tmp_path)) as d:
        d[:] = model
        for direct in (True, False):
            got = [(s, b.copy()) for s, b in d.iter_blocks(axis=0, size=16, depth=2,
                                                           direct=direct, name="doc")]
            assert len(got) == 4
            assert all((b == model[s]).all() for s, b in got)
        with pytest.raises(chemio_py.errors.ArgumentError):
            next(iter(d.iter_blocks(direct="yes")))
        d.delete()
