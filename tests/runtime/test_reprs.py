"""Objects show themselves: one-line reprs with name, shape/dtype or size, backend, mode and
path, and HTML tables for notebooks (checked on the produced HTML, not only "no error")."""
from __future__ import annotations

import html
import re

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime import reprs


def _cells(page: str) -> dict[str, str]:
    pairs = re.findall(r"<th[^>]*>(.*?)</th><td[^>]*>(.*?)</td>", page)
    return {html.unescape(k): html.unescape(v) for k, v in pairs}


def test_sizes_for_readers():
    assert reprs.size_text(None) == "?"
    assert reprs.size_text(512) == "512 B"
    assert reprs.size_text(3 << 29) == f"1.5 GiB ({3 << 29} B)"


@pytest.mark.parametrize("backend, compressor", [("local", None), ("zarr", "zstd:4")])
def test_diskarray_html(tmp_path, backend, compressor):
    kw = {"compressor": compressor} if compressor else {}
    d = cio.DiskArray.create("t2", (300, 200), "f8", chunks=(100, 100),
                             backend=backend, path=tmp_path, **kw)
    d[:100, :] = 1.0
    d.flush()
    r = d._repr_html_()
    cells = _cells(r)
    assert cells["shape"] == "(300, 200)" and cells["dtype"] == "float64"
    assert cells["chunks (on disk)"] == "(100, 100)" and cells["grid"] == "(3, 2)"
    assert cells["bytes"] == f"468.8 KiB ({300 * 200 * 8} B)"
    assert cells["state"] == "open, mode 'r+'" and cells["open requests"] == "0"
    assert cells["kind"] == "persistent" and cells["path"] == d.path
    if backend == "zarr":
        assert cells["backend"] == "zarr (format zarr-v3)"
        assert cells["compression"] == "zstd level 4"
        on_disk = int(re.search(r"\((\d+) B\)", cells["on disk"]).group(1))
        assert 0 < on_disk < 300 * 200 * 8          # zero objects absent, ones compressed
    else:
        assert cells["backend"] == "local (format grid)" and cells["compression"] == "none"
    d.awrite(np.s_[100:200, :], np.ones((100, 200)))
    assert "open requests" in d._repr_html_()
    assert repr(d).startswith("<DiskArray 't2' shape=(300, 200) dtype=float64")
    d.delete()
    assert "closed" in _cells(d._repr_html_())["state"]


def test_byte_files_html_and_reprs(tmp_path):
    odd = tmp_path / "a&<b>"
    odd.mkdir()
    with cio.ExclusiveFile("ex", "w+", dir=str(odd)) as f:
        f.write(0, np.zeros(1000))
        assert re.match(r"<ExclusiveFile '.*a&<b>/ex.*' mode 'w\+' size=8000 backend=local>",
                        repr(f)), repr(f)
        cells = _cells(f._repr_html_())
        assert "a&amp;&lt;b&gt;" in f._repr_html_() and "<b>" not in f._repr_html_()
        assert cells["size"] == "7.8 KiB (8000 B)" and cells["backend"] == "local"
        f.delete()
    sf = cio.SharedFile("shr", soft_limit=1 << 20, hard_limit=4 << 20)
    sf.write(0, b"abc")
    assert "size=3" in repr(sf)
    cells = _cells(sf._repr_html_())
    assert cells["ranks"] == "1" and cells["hard limit"].startswith("4.0 MiB")
    assert cells["reserved"].startswith("1.0 MiB")
    sf.destroy()
    assert _cells(sf._repr_html_())["state"] == "destroyed"
    log = cio.RecordFile("log", "w+")
    log.append(np.arange(10))
    cells = _cells(log._repr_html_())
    assert cells["records"] == "1" and cells["backend"] == "local"
    assert "backend=local" in repr(log)
    log.close()
    log.delete() if hasattr(log, "delete") else None


def test_report_is_an_html_table_in_notebooks(capsys):
    with cio.ExclusiveFile("rep", "w+") as f:
        f.write(0, np.zeros(4))
        f.delete()
    r = cio.report(print_it=False)
    assert capsys.readouterr().out == ""
    assert isinstance(r, str) and "rep" in r and repr(r) == str(r)
    page = r._repr_html_()
    assert page.startswith("<table") and "<th" in page and ">rep" in page and ">total<" in page
    cio.report()
    assert "MiB written" in capsys.readouterr().out             # printed outside notebooks
