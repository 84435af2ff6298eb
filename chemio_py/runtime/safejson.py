"""One hardened reader for untrusted JSON and TOML: metadata, markers, leases, traces, config.

Every document chemio reads from disk may be damaged or written by someone hostile. ``load``
(JSON), ``iter_items`` (the items of a large JSON list, one at a time) and ``load_toml``
(TOML) parse it within limits and turn every way it can be wrong into the chemio error the
caller names (``MetadataError`` unless told otherwise), with a
message that names the document (``what``), says what was found and, with ``hint``, what to
do. They never let ``RecursionError``, ``OverflowError``, ``UnicodeDecodeError`` or a bare
``ValueError`` escape.

The limits:

* **size** -- ``max_bytes`` (checked first, before anything is decoded);
* **nesting depth** -- ``max_depth``, measured by a linear scan of the brackets outside
  strings (and, for TOML, comments and dotted keys) *before* the parser runs, so input
  100,000 levels deep never reaches the recursion of ``json.loads`` or ``tomllib``;
* **items** -- ``max_items``, the values in all arrays and objects together;
* **numbers** (JSON) -- integers of more than ``MAX_INT_DIGITS`` digits, floats that overflow
  to infinity and the literals ``NaN``/``Infinity`` are refused. ``lenient_numbers=True``
  turns each of them into a float that is not finite (nan, or inf for an overflow) instead,
  for readers that skip bad records themselves and count them (``chemio trace``).

This is a leaf: it imports the standard library and ``chemio_py.errors`` only. Reading the
bytes (without following links, without blocking on a FIFO, with a bound) is the caller's
job: ``ownfiles.read_small`` or ``ownfiles.open_regular`` + ``read_bounded``.
"""
from __future__ import annotations

import itertools
import json
import math
import re
import tomllib
from typing import Any, Callable, Generator, Iterator

from chemio_py.errors import MetadataError

MAX_BYTES = 1 << 20             # a chemio metadata document, marker or lease is tiny
MAX_DEPTH = 64                  # chemio's documents nest 3 or 4 levels
MAX_ITEMS = 100_000
MAX_INT_DIGITS = 30             # far beyond any size or time chemio records (2**63 has 19)
MAX_NUMBER_CHARS = 100          # a float literal longer than this is not one chemio wrote

# The JSON scan works on the UTF-8 bytes (no byte of a multi-byte character is ASCII): escape
# pairs out, everything but brackets, commas and quotes out, adjacent quotes out (a pair of
# adjacent quotes encloses nothing, inside or outside a string), then the few strings left
# (those holding brackets or commas) out. Each step is one pass in C, the last a regex whose
# match never fails and never backtracks (an unterminated string runs to the end).
_JSON_KEEP = b'[]{}",'
_JSON_DROP = bytes(c for c in range(256) if c not in _JSON_KEEP)
_JSON_STRING = re.compile(rb'"[^"]*(?:"|\Z)')
# TOML: multi-line strings (up to two quotes of content before the closing delimiter),
# one-line strings (unterminated: up to the end of the line), comments.
_TOML_SKIP = re.compile(r'''
      """ (?:[^\\]|\\.)*? (?:"""(?:"{0,2})|\\?\Z)
    | \'\'\' .*? (?:\'\'\'(?:'{0,2})|\Z)
    | " [^"\\\n]* (?:\\.[^"\\\n]*)* (?:"|\\?\Z|(?=\n))
    | ' [^'\n]* (?:'|\Z|(?=\n))
    | \# [^\n]*
''', re.DOTALL | re.VERBOSE)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = [0] * 256                   # bracket byte -> +1 / -1
for _c in b"[{":
    _STEP[_c] = 1
for _c in b"]}":
    _STEP[_c] = -1
# A TOML key with at least one dot (``a.b.c``, ``"x".y``; strings are ``""`` by then),
# started only where a key part starts, so each part is scanned once.
_DOTTED = re.compile(r'(?<![\w"-])(?:[\w-]+|"")(?:[ \t]*\.[ \t]*(?:[\w-]+|""))+')


class _Refused(Exception):
    """Raised inside the parser's hooks; becomes the caller's error."""


def _fail(error: type[Exception], what: str, problem: str, hint: str) -> Exception:
    return error(f"{what} {problem}" + (f"; {hint}" if hint else ""))


def _text(data: bytes | bytearray | memoryview | str, what: str, kind: str, max_bytes: int,
          error: type[Exception], hint: str) -> str:
    """``data`` as text, within ``max_bytes`` and decoded as UTF-8."""
    if not isinstance(data, (bytes, bytearray, memoryview, str)):
        raise TypeError(f"safejson reads bytes or str, not {type(data).__name__}")
    n = len(data) if not isinstance(data, memoryview) else data.nbytes
    if n > max_bytes:
        raise _fail(error, what, f"is {n} bytes, too large for {kind} (the limit is "
                                 f"{max_bytes}): it is not a file chemio wrote", hint)
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(error, what, f"is not valid {kind}: not UTF-8 text (byte {e.start} is "
                                 f"{bytes(data[e.start:e.start + 1])!r})", hint) from None


def _limits(brackets: bytes, commas: int, what: str, kind: str, max_depth: int,
            max_items: int, error: type[Exception], hint: str) -> None:
    """Refuse a document whose ``brackets`` outside strings (in order) nest deeper than
    ``max_depth``, or which holds more than ``max_items`` values; no recursion."""
    depth = max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)
    if depth > max_depth:
        raise _fail(error, what, f"is not valid {kind} for chemio: nested {depth} levels deep, "
                                 f"more than the {max_depth} allowed", hint)
    opens = brackets.count(b"[") + brackets.count(b"{")
    if commas + opens > max_items:
        raise _fail(error, what, f"holds about {commas + opens} values, more than the "
                                 f"{max_items} allowed", hint)


def check_json_structure(data: bytes | bytearray | memoryview | str, *, what: str,
                         max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS,
                         error: type[Exception] = MetadataError, hint: str = "") -> None:
    """Raise ``error`` when JSON ``data`` nests deeper than ``max_depth`` or holds more than
    ``max_items`` values; linear time, no recursion, whatever ``data`` holds."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    raw = raw.translate(None, _JSON_DROP).replace(b'""', b"")
    raw = _JSON_STRING.sub(b"", raw)
    _limits(raw.translate(None, b","), raw.count(b","), what, "JSON", max_depth, max_items,
            error, hint)


_Hook = Callable[[str], Any]


def _number_hooks(lenient: bool) -> tuple[_Hook, _Hook, _Hook]:
    """``json``'s ``parse_int``, ``parse_float`` and ``parse_constant`` with the limits."""
    nan = float("nan")

    def bad(problem: str) -> Any:
        if lenient:
            return nan
        raise _Refused(problem)

    def parse_int(s: str) -> Any:
        digits = len(s) - (s[0] == "-")
        if digits > MAX_INT_DIGITS:
            return bad(f"holds an integer of {digits} digits, outside the range chemio "
                       f"reads (at most {MAX_INT_DIGITS} digits)")
        return int(s)

    def parse_float(s: str) -> Any:
        if len(s) > MAX_NUMBER_CHARS:
            return bad(f"holds a number written with {len(s)} characters, outside the range "
                       f"chemio reads (at most {MAX_NUMBER_CHARS})")
        x = float(s)
        if not math.isfinite(x):
            return bad(f"holds the number {s[:40]}, which overflows a float")
        return x

    def parse_constant(s: str) -> Any:
        return bad(f"holds {s}, which chemio's JSON never contains (NaN and Infinity are "
                   f"refused)")

    return parse_int, float if lenient else parse_float, parse_constant


_PARSE_FAILURES = (_Refused, RecursionError, MemoryError, OverflowError, ValueError)


def _parse_failure(e: BaseException, error: type[Exception], what: str,
                   hint: str) -> Exception:
    """The caller's ``error`` for a failure of the parser (one of ``_PARSE_FAILURES``)."""
    if isinstance(e, _Refused):
        problem = str(e)
    elif isinstance(e, json.JSONDecodeError):
        problem = f"is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})"
    else:                                   # never expected after the checks
        problem = f"is not valid JSON for chemio ({type(e).__name__}: {str(e)[:120]})"
    return _fail(error, what, problem, hint)


def load(data: bytes | bytearray | memoryview | str, *, what: str, max_bytes: int = MAX_BYTES,
         max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS,
         error: type[Exception] = MetadataError, hint: str = "",
         lenient_numbers: bool = False) -> Any:
    """The JSON document ``data`` (UTF-8 bytes or text), parsed within the limits.

    ``what`` names the document in messages ("metadata '/s/a.dra.json'"); every failure
    raises ``error(message)`` (``hint``, when given, is appended: what to do about it).
    """
    text = _text(data, what, "JSON", max_bytes, error, hint)
    check_json_structure(data, what=what, max_depth=max_depth, max_items=max_items,
                         error=error, hint=hint)
    try:
        hooks = _number_hooks(lenient_numbers)
        return json.loads(text, parse_int=hooks[0], parse_float=hooks[1],
                          parse_constant=hooks[2])
    except _PARSE_FAILURES as e:
        raise _parse_failure(e, error, what, hint) from None


_WS = re.compile(r"[ \t\n\r]*")


def iter_items(data: bytes | bytearray | memoryview | str, *, what: str, key: str | None = None,
               max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
               max_items: int = MAX_ITEMS, error: type[Exception] = MetadataError,
               hint: str = "", lenient_numbers: bool = False) -> Iterator[Any]:
    """The items of a JSON list, parsed one at a time within the limits, for documents too
    large to hold parsed at once: the top-level list, or -- when the top level is an object
    and ``key`` is given -- the list under ``key`` (its other values are parsed and dropped).

    Memory: the text and one item at a time. Failures as for ``load``; a document of
    another shape raises ``error`` saying so.
    """
    text = _text(data, what, "JSON", max_bytes, error, hint)
    check_json_structure(data, what=what, max_depth=max_depth, max_items=max_items,
                         error=error, hint=hint)
    hooks = _number_hooks(lenient_numbers)
    decode = json.JSONDecoder(parse_int=hooks[0], parse_float=hooks[1],
                              parse_constant=hooks[2]).raw_decode
    items = _list_items(text, key, decode)
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except _PARSE_FAILURES as e:
            raise _parse_failure(e, error, what, hint) from None
        yield item


_BLANKS = " \t\n\r"


def _list_items(text: str, key: str | None, decode: Callable) -> Iterator[Any]:
    """The items of ``iter_items``; raises what the parser raises and ``_Refused``."""
    end = len(text)
    blanks = _WS.match

    def skip(i: int) -> int:
        """The first position from ``i`` on that is not a blank."""
        m = blanks(text, i)
        return i if m is None else m.end()

    def expect(i: int, chars: str, looking_for: str) -> int:
        i = skip(i)
        if i >= end or text[i] not in chars:
            found = "the end" if i >= end else repr(text[i])
            raise _Refused(f"is not valid JSON of the expected shape (expecting "
                           f"{looking_for}, found {found} at character {i})")
        return i

    def items(i: int) -> Generator[Any, None, int]:
        """The items of the list whose ``[`` is at ``i``; returns the position after it."""
        i = skip(i + 1)
        if text.startswith("]", i):
            return i + 1
        while True:
            item, i = decode(text, i)
            yield item
            if text.startswith(",", i):             # the usual case: "," right after it
                i += 1
            elif text[expect(i, ",]", "',' or ']'")] == "]":
                return skip(i) + 1
            else:
                i = skip(i) + 1
            if text[i:i + 1] in _BLANKS:
                i = skip(i)

    i = expect(0, "[{" if key is not None else "[", "a list" if key is None
               else f"a list or an object with {key!r}")
    if text[i] == "[":
        i = yield from items(i)
    else:
        found = False
        i = skip(i + 1)
        if text.startswith("}", i):
            i += 1
        else:
            while True:
                name, i = decode(text, expect(i, '"', "a key"))
                i = skip(expect(i, ":", "':'") + 1)
                if name == key and text.startswith("[", i):
                    found = True
                    i = yield from items(i)
                else:
                    _, i = decode(text, i)          # parsed (so checked) and dropped
                i = expect(i, ",}", "',' or '}'") + 1
                if text[i - 1] == "}":
                    break
        if not found:
            raise _Refused(f"has no {key!r} list")
    if skip(i) != end:
        raise _Refused(f"is not valid JSON (extra data at character {i})")


def _toml_blank(m: re.Match) -> str:
    return "" if m.group().startswith("#") else '""'


def _walk_limits(doc: Any, what: str, max_depth: int, max_items: int,
                 error: type[Exception], hint: str) -> None:
    """Refuse a parsed document nested or filled beyond the limits (an explicit stack)."""
    todo = [(doc, 0)]
    items = 0
    while todo:
        node, depth = todo.pop()
        if depth > max_depth:
            raise _fail(error, what, f"is not valid TOML for chemio: nested more than "
                                     f"{max_depth} levels deep (dotted keys count)", hint)
        values = node.values() if isinstance(node, dict) else node
        for v in values:
            items += 1
            if isinstance(v, (dict, list)):
                todo.append((v, depth + 1))
        if items > max_items:
            raise _fail(error, what, f"holds more than {max_items} values", hint)


def load_toml(data: bytes | bytearray | memoryview | str, *, what: str,
              max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
              max_items: int = MAX_ITEMS, error: type[Exception] = MetadataError,
              hint: str = "") -> dict:
    """The TOML document ``data`` (UTF-8 bytes or text), parsed within the limits.

    Nesting (arrays, inline tables, and dotted keys, which ``tomllib`` expands at a cost
    that grows with the square of their length) is measured on the text first. TOML's
    ``nan``/``inf`` are valid TOML and are returned as floats: the caller's checks of each
    value refuse them where they make no sense. Failures as for ``load``.
    """
    text = _text(data, what, "TOML", max_bytes, error, hint)
    bare = _TOML_SKIP.sub(_toml_blank, text)
    _limits(_NOT_BRACKET.sub("", bare).encode(), bare.count(","), what, "TOML", max_depth,
            max_items, error, hint)
    dots = max((m.group().count(".") for m in _DOTTED.finditer(bare)), default=0)
    if dots >= max_depth:
        raise _fail(error, what, f"is not valid TOML for chemio: a dotted key of {dots + 1} "
                                 f"parts, more than the {max_depth} allowed", hint)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _fail(error, what, f"is not valid TOML: {e}", hint) from None
    except ValueError as e:        # int() of more than 4300 digits: not a TOMLDecodeError
        raise _fail(error, what, f"is not valid TOML for chemio: it holds a value too large "
                                 f"to read ({str(e).split(';')[0][:120]})", hint) from None
    except (RecursionError, MemoryError, OverflowError) as e:
        raise _fail(error, what, f"is not valid TOML for chemio ({type(e).__name__}: "
                                 f"{str(e)[:120]})", hint) from None
    _walk_limits(doc, what, max_depth, max_items, error, hint)
    return doc
