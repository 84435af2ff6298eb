"""``progress=``: True (a tqdm bar), False/None (nothing), a callable, 'auto'; bad values."""
from __future__ import annotations

import glob
import io
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime import progress
from chemio_py.errors import ArgumentError
from conftest import run_on_tty


def _bar_text(buf: io.StringIO) -> str:
    return buf.getvalue().replace("\r", "\n")


def test_true_draws_a_tqdm_bar_that_reaches_the_total():
    out = io.StringIO()
    with progress.Progress(True, 3 << 20, "copy x", file=out) as bar:
        for _ in range(3):
            bar.update(1 << 20)
    text = _bar_text(out)
    assert "copy x" in text and "100%" in text
    assert "3.00M/3.00M" in text                # bytes, scaled by 1024


def test_callable_gets_done_and_total_and_false_reports_nothing(capsys):
    seen: list[tuple[int, int | None]] = []
    with progress.Progress(lambda d, t: seen.append((d, t)), 10, "x") as bar:
        bar.update(4)
        bar.update(6)
    assert seen == [(4, 10), (10, 10)]
    for off in (False, None):
        with progress.Progress(off, 10, "x") as bar:
            bar.update(10)
        assert not bar.active and bar.done == 10
    assert capsys.readouterr() == ("", "")


def test_auto_is_silent_off_a_terminal():
    out = io.StringIO()                         # not a tty: an 'auto' bar stays hidden
    items = list(progress.track(range(5), "auto", "loop", file=out))
    assert items == list(range(5)) and out.getvalue() == ""


def test_track_counts_items_and_stops_with_the_loop():
    out = io.StringIO()
    got = []
    for i in progress.track(iter(range(100)), True, "walk", total=100, unit="step", file=out):
        got.append(i)
        if i == 9:
            break
    text = _bar_text(out)
    assert got == list(range(10))
    assert "9/100" in text and "step" in text       # the 10th item was not finished


@pytest.mark.parametrize("bad", ["yes", 1, 0, 0.5, object(), np.array([1, 2])])
def test_bad_progress_values_are_refused(bad):
    with pytest.raises(ArgumentError, match="progress must be"):
        progress.Progress(bad, 1, "x")


def test_hdf5_and_dask_conversions_report_progress(tmp_path, capfd, scratch_root):
    m = np.arange(40 * 30, dtype="f8").reshape(40, 30)
    d = cio.DiskArray.create("prog", m.shape, m.dtype, chunks=(8, 30))
    d[...] = m
    h5 = tmp_path / "p.h5"
    d.to_hdf5(h5, "a", progress=True, slab_bytes=8 * 30 * 8)
    err = capfd.readouterr().err.replace("\r", "\n")
    assert "to_hdf5 a" in err and "100%" in err
    seen: list = []
    e = cio.DiskArray.from_hdf5(h5, "a", "prog2", slab_bytes=8 * 30 * 8,
                                progress=lambda a, b: seen.append((a, b)))
    assert seen[-1] == (m.nbytes, m.nbytes) and len(seen) == 5
    np.testing.assert_array_equal(e[...], m)
    e.delete()
    import dask.array as da
    seen.clear()
    f = cio.DiskArray.from_dask(da.from_array(m, chunks=(10, 30)), "prog3",
                                progress=lambda a, b: seen.append((a, b)))
    assert len(seen) == 4 and sorted(seen)[-1] == (m.nbytes, m.nbytes)
    np.testing.assert_array_equal(f[...], m)
    f.delete()
    # a bad value changes nothing: the dataset stays, no array is made
    with pytest.raises(ArgumentError, match="progress must be"):
        d.to_hdf5(h5, "a", overwrite=True, progress="loud")
    with h5py.File(h5, "r") as fh:
        np.testing.assert_array_equal(fh["a"][...], m)
    with pytest.raises(ArgumentError, match="progress must be"):
        cio.DiskArray.from_dask(da.from_array(m), "prog4", progress=2)
    assert glob.glob(os.path.join(scratch_root, "*", "prog4*")) == []
    d.delete()


def test_import_chemio_py_does_not_import_tqdm():
    r = subprocess.run([sys.executable, "-c", "import sys, chemio_py, chemio_py.runtime.progress; "
                        "print('tqdm' in sys.modules)"], capture_output=True, text=True,
                       timeout=60, check=True)
    assert r.stdout.strip() == "False"


def test_check_read_shows_a_bar_on_a_terminal(tmp_path):
    """``chemio check --read`` on a terminal: an 'auto' bar (after its delay) on stderr."""
    p = tmp_path / "big.dra"
    d = cio.DiskArray.create("big", (64, 1024), "f8", path=p, persistent=True)
    d[...] = 1.0
    d.close()
    code = ("import chemio_py.runtime.progress as P; P.AUTO_DELAY = 0.0; import sys; "
            "from chemio_py.tools.check import main; sys.exit(main(['--read', sys.argv[1]]))")
    rc, out, err = run_on_tty([sys.executable, "-c", code, str(p)], columns=100, timeout=60)
    assert rc == 0, out + err
    assert "result: OK" in out
    assert "check big.dra" in err and "100%" in err
    os.unlink(p)
    os.unlink(str(p) + ".json")
