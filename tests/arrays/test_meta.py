"""Array metadata: the schema, validation of untrusted documents, atomic writes."""
import json
import os

import numpy as np
import pytest

from chemio_py.arrays import meta
from chemio_py.errors import ArgumentError, MetadataError


def good_doc(**change):
    doc = meta.Meta(name="t2", shape=(40, 30), dtype=np.dtype("f8"), chunks=(8, 30),
                    backend="local", data="t2.dra", persistent=True, uuid="ab12",
                    created=meta.creation_info(4)).to_doc()
    doc.update(change)
    return doc


def test_round_trip_of_a_document():
    m = meta.loads(json.dumps(good_doc()))
    assert (m.shape, m.chunks, m.dtype, m.name, m.data) == ((40, 30), (8, 30), np.dtype("f8"),
                                                             "t2", "t2.dra")
    assert m.nbytes == 40 * 30 * 8
    assert m.created["ranks"] == 4
    doc = json.loads(meta.dumps(m))
    for key in ("format", "shape", "dtype", "chunks", "backend", "byte_order", "nbytes"):
        assert key in doc


HOSTILE = [
    ("NaN in shape", '{"format": 1, "shape": [NaN, 3]}', "JSON"),
    ("Infinity", None, "JSON"),
    ("negative shape", good_doc(shape=[-4, 30]), "outside"),
    ("float shape", good_doc(shape=[40.0, 30]), "not an int"),
    ("bool shape", good_doc(shape=[True, 30]), "not an int"),
    ("string shape", good_doc(shape="40,30"), "list"),
    ("enormous shape", good_doc(shape=[10**12, 10**12], chunks=[1, 1]), "limit"),
    ("giant int", good_doc(shape=[10**40, 3]), "outside"),
    ("empty shape", good_doc(shape=[], chunks=[]), "entries"),
    ("too many dims", good_doc(shape=[1] * 40, chunks=[1] * 40), "entries"),
    ("zero chunk", good_doc(chunks=[0, 30]), "outside"),
    ("chunk > dim", good_doc(chunks=[80, 30]), "exceeds"),
    ("chunks rank", good_doc(chunks=[8]), "entries"),
    ("unknown dtype", good_doc(dtype="<f16"), "dtype"),
    ("object dtype", good_doc(dtype="|O"), "dtype"),
    ("object name", good_doc(dtype="object"), "dtype"),
    ("string dtype", good_doc(dtype="<U0"), "dtype"),
    ("object field", good_doc(dtype=[["a", "|O"]]), "dtype"),
    ("subarray dtype", good_doc(dtype="(1000000000,)f8"), "dtype"),
    ("long double", good_doc(dtype="<f16"), "dtype"),
    ("generic datetime", good_doc(dtype="<M8"), "dtype"),
    ("huge bytes", good_doc(dtype="|S9999999"), "bytes"),
    ("huge subarray", good_doc(dtype=[["a", "<f8", [1 << 40]]]), "subarray"),
    ("deep structure", good_doc(dtype=json.loads('[["a", ' * 12 + '"<f8"' + ']]' * 12)),
     "deep"),
    ("many fields", good_doc(dtype=[[f"f{i}", "u1"] for i in range(2000)]), "fields"),
    ("twice a name", good_doc(dtype=[["a", "u1"], ["a", "u1"]]), "twice"),
    ("named padding", good_doc(dtype=[["", "<f8"]]), "padding"),
    ("field not a pair", good_doc(dtype=[["a"]]), "field"),
    ("dtype a number", good_doc(dtype=8), "dtype"),
    ("newer format", good_doc(format=2), "newer"),
    ("format string", good_doc(format="1"), "format"),
    ("not an object", [1, 2, 3], "JSON object"),
    ("data escapes", good_doc(data="../../etc/passwd"), "plain file name"),
    ("data absolute", good_doc(data="/etc/passwd"), "plain file name"),
    ("bad name", good_doc(name="a/b"), "plain name"),
    ("wrong nbytes", good_doc(nbytes=7), "nbytes"),
    ("F order", good_doc(order="F"), "order"),
    ("bad byte_order", good_doc(byte_order="middle"), "byte_order"),
    ("bad persistent", good_doc(persistent="yes"), "persistent"),
]


@pytest.mark.parametrize("label,doc,expect", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_documents_are_rejected_clearly(label, doc, expect):
    if doc is None:
        text = json.dumps(good_doc()).replace('"shape": [', '"shape": [Infinity, ')
    elif isinstance(doc, str):
        text = doc
    else:
        text = json.dumps(doc)
    with pytest.raises(MetadataError) as ei:
        meta.loads(text, "'x.json'")
    msg = str(ei.value)
    assert "'x.json'" in msg and expect.lower() in msg.lower(), msg


def test_garbage_and_huge_files(tmp_path):
    p = tmp_path / "m.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(MetadataError, match="not valid JSON"):
        meta.load(str(p))
    p.write_bytes(b" " * (meta.MAX_BYTES + 10))
    with pytest.raises(MetadataError, match="too large"):
        meta.load(str(p))
    p.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(MetadataError):
        meta.load(str(p))
    p.write_text('{"format": 1, "shape": [' + "9" * 5000 + "]}")
    with pytest.raises(MetadataError):
        meta.load(str(p))
    with pytest.raises(MetadataError, match="does not exist"):
        meta.load(str(tmp_path / "missing.json"))


def test_write_atomic_replaces_whole_documents(tmp_path):
    p = str(tmp_path / "a.json")
    m = meta.validate(good_doc())
    meta.write_atomic(p, meta.dumps(m))
    assert meta.load(p) == m
    d2 = good_doc(shape=[50, 30])
    del d2["nbytes"]
    m2 = meta.validate(d2)
    meta.write_atomic(p, meta.dumps(m2))
    assert meta.load(p).shape == (50, 30)
    assert sorted(os.listdir(tmp_path)) == ["a.json"]          # no temp files left
    assert os.stat(p).st_mode & 0o777 == 0o600


def test_user_dtypes_and_shapes():
    for ok in ("bool", "i1", "int16", "<i4", "int64", "u1", "uint16", "u4", "uint64",
               "f4", "float64", "complex64", "c16", ">f8", "f2", "U3", "M8[s]", "V8",
               [("a", "f8")], ">m8[10ms]", "S7"):
        dt = meta.check_dtype(ok)
        assert dt == np.dtype(ok) and dt.str == np.dtype(ok).str      # byte order kept
        assert meta.dtype_from_doc(json.loads(json.dumps(meta.dtype_doc(dt)))) == dt
    for bad in ("O", "M8", "U0", "T", [("a", "O")], ("f8", (3,)), "nonsense", np.float128):
        with pytest.raises(ArgumentError, match="fixed-size"):
            meta.check_dtype(bad)
    assert meta.check_shape(5) == (5,)
    assert meta.check_shape((np.int64(3), 4)) == (3, 4)
    for bad in ((-1, 3), (2.0, 3), (True,), "ab", (), (1,) * 40, None):
        with pytest.raises(ArgumentError):
            meta.check_shape(bad)
