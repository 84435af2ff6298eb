"""``chemio_py.runtime.safejson``: the one hardened reader of untrusted JSON and TOML (issue 27).

The nesting it measures before parsing is the nesting the parser meets (checked against
random documents full of brackets, quotes and backslashes inside strings), every hostile
input of the shared corpus ends in the caller's error naming the document, numbers are
bounded, and the scans stay linear on inputs built to make a regular expression backtrack.
"""
from __future__ import annotations

import json
import random
import time
import tomllib

import pytest

from chemio_py.runtime import safejson
from chemio_py.errors import ConfigError, MetadataError
from fuzz_corpus import json_corpus, toml_corpus


def _depth(x) -> int:
    todo, deepest = [(x, 0)], 0
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, dict)):
            d += 1
            todo.extend((w, d) for w in (v.values() if isinstance(v, dict) else v))
        deepest = max(deepest, d)
    return deepest


_CHARS = ['[', ']', '{', '}', '"', "\\", ",", ":", "a", "é", "\n", "\\u", "'"]


def _random_doc(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 9 or r < 0.3:
        return rng.choice(["".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 6))),
                           7, -2.5, None, True, 10 ** 20])
    if r < 0.65:
        return [_random_doc(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {"".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 4))):
            _random_doc(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def test_measured_depth_is_the_parsers_depth():
    rng = random.Random(27)
    for _ in range(2000):
        doc = _random_doc(rng)
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1]))
        d = _depth(doc)
        assert safejson.load(text.encode(), what="doc", max_depth=d) == doc
        if d:
            with pytest.raises(MetadataError, match="nested"):
                safejson.load(text, what="doc", max_depth=d - 1)


# (special files -- FIFO, link, directory -- are the readers' business: ownfiles)
@pytest.mark.parametrize("h", [h for h in json_corpus() if not h.special], ids=lambda h: h.name)
def test_every_hostile_json_input_is_the_callers_error(h):
    try:
        safejson.load(h.content, what="document 'x.json'", error=ConfigError, hint="do Y")
    except ConfigError as e:
        assert str(e).startswith("document 'x.json' ") and str(e).endswith("; do Y"), str(e)
        for raw in ("RecursionError", "OverflowError", "UnicodeDecodeError"):
            assert raw not in str(e)
    else:
        assert h.valid_syntax, h.name


@pytest.mark.parametrize("text,expect", [
    ("[" + "9" * 31 + "]", "31 digits"), ("[" + "9" * 5000 + "]", "5000 digits"),
    ("[1e400]", "overflows"), ("[-1e400]", "overflows"), ("[NaN]", "NaN"),
    ("[Infinity]", "Infinity"), ("[-Infinity]", "Infinity"),
    ("[1." + "0" * 200 + "]", "characters"),
])
def test_numbers_out_of_range_are_refused(text, expect):
    with pytest.raises(MetadataError, match=expect):
        safejson.load(text, what="doc")
    got = safejson.load(text, what="doc", lenient_numbers=True)
    assert len(got) == 1 and (got[0] != got[0] or abs(got[0]) == float("inf")
                              or got[0] == 1.0)


def test_numbers_in_range_are_read_exactly():
    doc = {"big": 10 ** 29, "neg": -(10 ** 29), "f": 1.5e300, "tiny": 5e-324, "z": -0.0}
    assert safejson.load(json.dumps(doc), what="doc") == doc


def test_size_and_item_limits():
    with pytest.raises(MetadataError, match="too large"):
        safejson.load(b" " * 101, what="doc", max_bytes=100)
    with pytest.raises(MetadataError, match="values"):
        safejson.load("[" + "0," * 1000 + "0]", what="doc", max_items=1000)
    assert len(safejson.load("[" + "0," * 999 + "0]", what="doc", max_items=1000)) == 1000
    # commas and brackets inside strings are not values
    assert safejson.load(json.dumps(["," * 5000, "[" * 5000]), what="doc", max_items=3,
                         max_depth=1)


def test_scans_stay_linear_on_inputs_made_to_backtrack():
    evil = [b'"' + b'\\"' * 500_000 + b"\\",                 # unterminated, escaped quotes
            b'["' + b'\\\\' * 500_000 + b'"]' + b"[" * 10,
            b"[" + b'"",' * 300_000 + b'"' * 1001]
    t0 = time.monotonic()
    for data in evil:
        with pytest.raises(MetadataError):
            safejson.load(data, what="doc", max_bytes=10 << 20)
    toml_evil = ['x = """' + '"""' * 1000 + "\\" + "a" * 300_000,
                 "x = " + "'a'." * 200_000 + "a = 1",
                 "a" + "_" * 500_000 + " = 1",              # valid: a long bare key
                 "x = [" + '"\\' * 200_000]
    for text in toml_evil:
        try:
            safejson.load_toml(text, what="cfg", error=ConfigError, max_bytes=10 << 20,
                               max_items=10 ** 7)
        except ConfigError:
            pass
    assert time.monotonic() - t0 < 60        # quadratic would take hours


def test_iter_items_reads_a_large_list_one_item_at_a_time():
    doc = {"displayTimeUnit": "ms", "other": {"x": [1, [2]]},
           "traceEvents": [{"ph": "X", "ts": 1}, 2, "three", [4]], "tail": None}
    items = list(safejson.iter_items(json.dumps(doc, indent=2), what="t", key="traceEvents"))
    assert items == doc["traceEvents"]
    assert list(safejson.iter_items(" [1 , [2] ] ", what="t")) == [1, [2]]
    assert list(safejson.iter_items("[]", what="t", key="traceEvents")) == []
    assert list(safejson.iter_items("[NaN, 1e400, " + "9" * 40 + "]", what="t",
                                    lenient_numbers=True))[0] != 0
    for bad, expect in [('{"a": 1}', "no 'traceEvents' list"), ("[1] x", "extra data"),
                        ("[1 2]", "expecting"), ('"s"', "expecting"), ("", "expecting"),
                        ("[1,]", "not valid JSON"), ('{"traceEvents": 5}', "no 'traceEvents'"),
                        ("[" * 100 + "]" * 100, "nested"), ("[NaN]", "NaN")]:
        with pytest.raises(MetadataError, match=expect):
            list(safejson.iter_items(bad, what="t", key="traceEvents"))


# ---------------------------------------------------------------- TOML

def test_toml_is_parsed_as_tomllib_parses_it():
    text = '''# a chemio.toml with everything that hides brackets
backend = "local"   # comment with [[[ and "quotes"
scratch = 'C:\\no\\escapes [here'
io_threads = 4
shm_limit = "50%"
note = """a "multi-line" string with [ brackets
and # no comment, and four quotes at the end """"
lit = \'\'\'[[[ literal ]]] \'\'\'\'
nums = [1.5, 2.5, nan, inf, -inf, 1979-05-27T07:32:00.999-07:00]
a.b."c.d".e = 1
[files."*.[ch]aoints"]
backend = "shm"
[[jobs]]
x = {y = [1, {z = 2}]}
'''
    assert repr(safejson.load_toml(text, what="cfg")) == repr(tomllib.loads(text))


@pytest.mark.parametrize("h", [h for h in toml_corpus() if not h.special], ids=lambda h: h.name)
def test_every_hostile_toml_input_is_the_callers_error(h):
    try:
        safejson.load_toml(h.content, what="config file 'c.toml'", error=ConfigError)
    except ConfigError as e:
        assert str(e).startswith("config file 'c.toml' "), str(e)
        assert "RecursionError" not in str(e) and "sys.set_int_max_str_digits" not in str(e)
    else:
        assert h.valid_syntax, h.name


@pytest.mark.parametrize("text", [
    'k = [ """a"""" , ' + "[" * 5000 + "]" * 5000 + "]",     # 4 quotes end a multi-line string
    'k = [ \'\'\'a\'\'\'\'\' , ' + "[" * 5000 + "]" * 5000 + "]",
    'k = "#"\nv = ' + "[" * 5000 + "]" * 5000,
    "k = '#'\nv = " + "[" * 5000 + "]" * 5000,
    "k = '''\n'''\nv = " + "{a=" * 3000 + "1" + "}" * 3000,
])
def test_toml_nesting_hidden_behind_strings_is_still_seen(text):
    with pytest.raises(MetadataError, match="nested"):
        safejson.load_toml(text, what="cfg")


def test_toml_dotted_keys_and_tables_are_bounded():
    ok = "a" + ".a" * 63 + " = 1\n"
    assert safejson.load_toml(ok, what="cfg")
    for text in ("a" + ".a" * 64 + " = 1\n", "[" + "a." * 64 + "a]\n",
                 'x = {' + '"q".' * 70 + 'z = 1}'):
        with pytest.raises(MetadataError, match="dotted key"):
            safejson.load_toml(text, what="cfg")
    # depth from tables, dotted keys and arrays together: the parsed document is checked too
    text = "[" + ".".join(["t"] * 40) + "]\n" + ".".join(["k"] * 40) + " = 1\n"
    with pytest.raises(MetadataError, match="nested more than 64"):
        safejson.load_toml(text, what="cfg")
