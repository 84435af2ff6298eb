"""``chemio_py.pyscf``: PySCF's own out-of-core methods on chemio give PySCF's energies.

Each method runs twice in one process, on PySCF's h5py scratch (the model) and inside
``chemio_py.pyscf.patch(backend=...)``, with ``max_memory`` forced small enough to take
its out-of-core branch; the energies agree to 1e-10 Eh and the plug-in's counters and
chemio's I/O statistics show that chemio carried the scratch. Also: ``enable``/``disable``
put back exactly what was there (nested, and after errors), ``call_in_background`` keeps
PySCF's semantics on chemio's pool, and named ``lib.H5TmpFile(name)`` stay h5py files.
"""
from __future__ import annotations

import importlib
import os
import tempfile
import threading
from typing import Callable, NamedTuple

import h5py
import numpy as np
import pytest

pyscf = pytest.importorskip("pyscf")
from pyscf import ao2mo, cc, ci, df, gto, lib, mcscf, mp, scf  # noqa: E402
from pyscf.lib import linalg_helper, misc  # noqa: E402

import chemio_py as cio  # noqa: E402
import chemio_py.pyscf as cpyscf  # noqa: E402
from chemio_py.runtime import stats  # noqa: E402

patch_mod = importlib.import_module("chemio_py.pyscf.plugin")

TOL = 1e-10


@pytest.fixture(scope="module")
def water():
    mol = gto.M(atom="O 0 0 0; H 0 -0.757 0.587; H 0 0.757 0.587", basis="6-31g",
                verbose=0)
    mf = scf.RHF(mol).run(conv_tol=1e-12)
    return mol, mf


@pytest.fixture(scope="module")
def water_min():
    mol = gto.M(atom="O 0 0 0; H 0 -0.757 0.587; H 0 0.757 0.587", basis="sto-3g",
                verbose=0)
    mf = scf.RHF(mol).run(conv_tol=1e-12)
    return mol, mf


def _both(fn, backend):
    """fn() on h5py, then on chemio: (reference, result, usage change, bytes written)."""
    ref = fn()
    before = cpyscf.usage()
    stats.reset()
    with cpyscf.patch(backend=backend):
        got = fn()
    after = cpyscf.usage()
    written = stats.snapshot()["total"]["bytes_written"]
    return ref, got, {k: after[k] - before[k] for k in after}, written


# ---------------------------------------------------------------- PySCF's methods

@pytest.mark.parametrize("backend", ["local", "shm", "auto"])
def test_ao2mo_outcore_general(water, backend):
    mol, mf = water
    mo = mf.mo_coeff

    def run():
        with lib.H5TmpFile() as f:
            ao2mo.outcore.general(mol, (mo, mo[:, :4], mo, mo), f, "eri_mo", max_memory=1,
                                  ioblk_size=0.05)
            return np.asarray(f["eri_mo"])
    ref, got, used, written = _both(run, backend)
    assert np.abs(ref - got).max() <= TOL
    assert used["h5tmpfiles"] >= 2 and written > ref.nbytes


class Outcore(NamedTuple):
    """A PySCF method forced out of core: the molecule fixture, the solver made from the
    SCF object, the settings that force it, its energy attribute, the counters of
    ``usage()`` that must move, a check of the solver after its run, kernel keywords and
    OpenMP threads (None: PySCF's)."""
    mol: str
    make: Callable
    settings: dict
    energy: str
    moved: tuple = ("h5tmpfiles",)
    check: Callable | None = None
    kernel: dict = {}
    omp: int | None = None


def _eris_on_disk(m):
    assert not isinstance(m.ao2mo().ovov, np.ndarray)


def _ovl_on_disk(m):
    assert not isinstance(m._eris.ovL, np.ndarray) if hasattr(m, "_eris") else True


OUTCORE = {
    # max_memory 1 MB: _make_eris_outcore, with PySCF's background writes
    "ccsd": Outcore("water_min", cc.CCSD, {"max_memory": 1, "conv_tol": 1e-11}, "e_corr",
                    ("h5tmpfiles", "background_calls"), _eris_on_disk),
    "cisd": Outcore("water_min", ci.CISD, {"max_memory": 1, "conv_tol": 1e-11}, "e_corr"),
    # mc_ao2mo on H5TmpFiles; one OpenMP thread: with several, PySCF's own CASSCF (h5py
    # too) now and then ends in another stationary point (-75.00864 instead of -74.97617
    # Eh) on a busy machine
    "casscf": Outcore("water_min", lambda mf: mcscf.CASSCF(mf, 4, 4),
                      {"max_memory": 1, "conv_tol": 1e-11}, "e_tot", omp=1),
    # ovL in an H5TmpFile
    "dfmp2": Outcore("water", mp.dfmp2.DFMP2, {"force_outcore": True}, "e_corr",
                     check=_ovl_on_disk, kernel={"with_t2": False}),
}


@pytest.mark.parametrize("method, backend", [("ccsd", "local"), ("ccsd", "shm"),
                                             ("cisd", "auto"), ("casscf", "shm"),
                                             ("dfmp2", "local")])
def test_outcore_method_energy(request, method, backend):
    case = OUTCORE[method]
    _, mf = request.getfixturevalue(case.mol)

    def run():
        with lib.with_omp_threads(case.omp):
            m = case.make(mf)
            for k, v in case.settings.items():
                setattr(m, k, v)
            m.kernel(**case.kernel)
            if case.check is not None:
                case.check(m)
            return getattr(m, case.energy)
    ref, got, used, written = _both(run, backend)
    assert abs(ref - got) <= TOL
    assert all(used[k] > 0 for k in case.moved) and written > 0, used


def test_df_outcore_cholesky_eri(water, tmp_path):
    """PySCF names these files itself (h5py stays); its prefetch runs on chemio's pool."""
    mol, _ = water

    def run():
        with tempfile.NamedTemporaryFile(dir=tmp_path) as t:
            df.outcore.cholesky_eri(mol, t.name, auxbasis="weigend", max_memory=1)
            with h5py.File(t.name, "r") as f:
                return np.asarray(f["j3c"])
    ref, got, used, _ = _both(run, "shm")
    assert np.abs(ref - got).max() <= TOL
    assert used["prefetch_maps"] > 0


@pytest.mark.parametrize("backend", ["local", "auto"])
def test_davidson_subspace_on_disk(backend):
    rng = np.random.default_rng(1)
    n = 300
    a = rng.random((n, n))
    a = a + a.T + np.diag(np.arange(n) * 10.0)
    diag = a.diagonal()

    def run():
        e, _ = lib.davidson(lambda x: a @ x, np.eye(n)[0],
                            lambda dx, e, x0: dx / (diag - e + 1e-8),
                            max_memory=1e-3, tol=1e-12, nroots=2)   # _Xlist, not lists
        return np.asarray(e)
    ref, got, used, written = _both(run, backend)
    assert np.abs(ref - got).max() <= TOL
    assert used["xlists"] >= 2 and written > 0


# ---------------------------------------------------------------- the switch

def _state():
    return (lib.H5TmpFile, misc.H5TmpFile, lib.call_in_background, misc.call_in_background,
            lib.map_with_prefetch, misc.map_with_prefetch, linalg_helper._Xlist,
            lib.param.MAX_MEMORY)


def test_enable_disable_restore_exactly_and_nest():
    before = _state()
    cpyscf.disable()                                        # nothing enabled: no-op
    assert _state() == before and not cpyscf.enabled()
    with cpyscf.patch(backend="shm", max_memory=123):
        outer = _state()
        assert outer[0] is not before[0] and outer[0] is outer[1]
        assert lib.param.MAX_MEMORY == 123 and cpyscf.enabled()
        with cpyscf.patch(backend="local"):
            assert _state()[0] is not outer[0]
            assert lib.param.MAX_MEMORY == 123
        assert _state() == outer
        cpyscf.enable(backend="auto", max_memory=7)         # left on by the body ...
    assert _state() == before and not cpyscf.enabled()      # ... and undone with the patch
    with pytest.raises(RuntimeError):
        with cpyscf.patch(backend="shm"):
            raise RuntimeError("boom")
    assert _state() == before


def test_bad_arguments_change_nothing():
    before = _state()
    with pytest.raises(cio.BackendUnavailableError):
        cpyscf.enable(backend="no-such-backend")
    with pytest.raises(cio.errors.ArgumentError):
        cpyscf.enable(max_memory=-1)
    assert _state() == before and not cpyscf.enabled()


def test_files_pyscf_names_stay_h5py_and_groups_count_as_h5py(tmp_path):
    with cpyscf.patch(backend="shm"):
        with lib.H5TmpFile() as ftmp:
            assert isinstance(ftmp, cio.H5TmpFile) and isinstance(ftmp, h5py.Group)
            assert isinstance(ftmp.create_group("g"), h5py.Group)
        named = lib.H5TmpFile(str(tmp_path / "named.h5"), "w")
        assert isinstance(named, h5py.File)
        named.close()
        with lib.H5TmpFile(libver="latest", dir=str(tmp_path)) as ftmp:   # h5py keywords
            ftmp["x"] = np.ones(3)


def test_scratch_dir_follows_pyscf(tmp_path, monkeypatch):
    monkeypatch.delenv("PYSCF_TMPDIR", raising=False)
    monkeypatch.setattr(lib.param, "TMPDIR", tempfile.gettempdir())
    assert cpyscf.scratch_dir() is None
    monkeypatch.setattr(lib.param, "TMPDIR", str(tmp_path))
    assert cpyscf.scratch_dir() == str(tmp_path)
    monkeypatch.setenv("PYSCF_TMPDIR", str(tmp_path / "env"))
    assert cpyscf.scratch_dir() == str(tmp_path / "env")
    assert cpyscf.scratch_dir(tmp_path / "x") == str(tmp_path / "x")
    monkeypatch.delenv("PYSCF_TMPDIR")
    with cpyscf.patch(backend="local"):
        with lib.H5TmpFile() as ftmp:
            d = ftmp.create_dataset("x", data=np.arange(4.0))
            assert d.path.startswith(str(tmp_path)) and os.path.exists(d.path)
            path = d.path
    assert not os.path.exists(path)


def test_call_in_background_semantics():
    with cpyscf.patch(backend="shm"):
        order, threads = [], []
        lock = threading.Lock()

        def work(i, delay=0.0):
            import time
            time.sleep(delay)
            with lock:
                order.append(i)
                threads.append(threading.current_thread().name)
            return i

        with lib.call_in_background(work) as awork:
            for i in range(5):
                awork(i, 0.01)                  # each waits for its previous call
        assert order == list(range(5))
        assert all(t.startswith("chemio-io") for t in threads), threads
        order.clear()
        with lib.call_in_background(work, work) as (f1, f2):
            f1(1)
            f2(2)
        assert sorted(order) == [1, 2]          # both done at the block's end

        def fail():
            raise ValueError("inside")
        with pytest.raises(misc.ThreadRuntimeError, match="inside"):
            with lib.call_in_background(fail) as afail:
                afail()
        with pytest.raises(misc.ThreadRuntimeError, match="inside"):
            with lib.call_in_background(fail) as afail:
                afail()
                afail()                         # the first call's error, here
        threads.clear()
        with lib.call_in_background(work, sync=True) as swork:
            swork(9)
        assert threads == [threading.current_thread().name]
        assert list(lib.map_with_prefetch(lambda x: x * x, range(6))) == \
            [x * x for x in range(6)]
        it = lib.map_with_prefetch(lambda x: x + 1, range(100))
        assert next(it) == 1
        it.close()                              # stops early: the call in flight ends


def test_call_in_background_never_takes_the_last_pool_thread():
    cio.configure(io_threads=2)
    with cpyscf.patch(backend="shm"):
        before = cpyscf.usage()["background_inline"]
        gate = threading.Event()
        with lib.call_in_background(lambda: gate.wait(5), lambda: None) as (f1, f2):
            f1()                                # holds one of the two pool threads
            f2()                                # would leave none for chemio's own I/O
            gate.set()
        assert cpyscf.usage()["background_inline"] == before + 1


MPI_BODY = """
import numpy as np
from pyscf import gto, scf, ao2mo, lib
import chemio_py as cio, chemio_py.pyscf as cpyscf
c = cio.comm()
assert c.size == 2
# one process per rank, as PySCF runs: each rank its own molecule and its own scratch
mol = gto.M(atom=f"O 0 0 0; H 0 -0.757 0.587; H 0 0.757 {{0.587 + 0.05 * c.rank}}",
            basis="sto-3g", verbose=0)
mo = scf.RHF(mol).run(conv_tol=1e-12).mo_coeff
def run():
    with lib.H5TmpFile() as f:
        ao2mo.outcore.general(mol, (mo, mo, mo, mo), f, "eri_mo", max_memory=1,
                              ioblk_size=0.01)
        return np.asarray(f["eri_mo"])
ref = run()
with cpyscf.patch(backend="{backend}"):
    got = run()
assert np.abs(ref - got).max() <= 1e-10
assert cpyscf.usage()["h5tmpfiles"] >= 2
print(f"rank{{c.rank}}:same", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["shm", "mpiio"])
def test_one_process_per_rank_under_mpiexec(mpirun, backend):
    p = mpirun(2, MPI_BODY.format(backend=backend))
    assert p.stdout.count(":same") == 2, p.stdout


# ---------------------------------------------------------------- messages to lib.logger

def _spill(backend_verbose: dict) -> None:
    """Under ``patch(**backend_verbose)``: a PySCF scratch dataset larger than the auto
    backend's 1 MiB RAM budget (it spills, with a SpillWarning and a log record)."""
    import warnings
    from chemio_py.runtime import config
    config.configure(shm_limit="1M")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cio.errors.SpillWarning)
        with cpyscf.patch(backend="auto", **backend_verbose):
            f = lib.H5TmpFile()
            f["amps"] = np.ones((512, 1024))         # 4 MiB
            assert np.array_equal(f["amps"][3], np.ones(1024))
            f.close()


@pytest.mark.parametrize("verbose", [0, 1, 2, 3])
def test_spill_reaches_pyscf_logger_at_its_verbosity(capsys, verbose):
    """A spill of auto is a WARNING of the chemio_py logger: printed by lib.logger.warn
    (``WARN: chemio: ...`` on stdout) from verbose 2 (logger.WARN) on, and not below."""
    _spill({"verbose": verbose})
    out = capsys.readouterr().out
    if verbose >= 2:
        assert out.count("WARN: chemio: ") >= 1 and "moved from RAM to disk" in out
    else:
        assert "chemio" not in out and out == ""


def test_pyscf_logger_default_verbosity_is_pyscfs(capsys, monkeypatch):
    """verbose=None: PySCF's default (``__config__.VERBOSE``, else NOTE = 3)."""
    import pyscf
    monkeypatch.setattr(pyscf.__config__, "VERBOSE", 0, raising=False)
    _spill({})
    assert capsys.readouterr().out == ""
    monkeypatch.delattr(pyscf.__config__, "VERBOSE", raising=False)
    _spill({})
    assert "WARN: chemio: " in capsys.readouterr().out


def test_messages_levels_nesting_and_removal(capsys):
    """INFO and DEBUG records need verbose 4 and 5; nested patches print each record once
    (the innermost verbose applies); after the last patch nothing is printed and the
    chemio_py logger has its handlers and level back."""
    import logging
    root = logging.getLogger("chemio_py")
    handlers, level = list(root.handlers), root.level
    log = logging.getLogger("chemio_py.test_plugin")
    with cpyscf.patch(verbose=4):
        log.info("info-at-4")
        log.debug("debug-at-4")
        with cpyscf.patch(verbose=5):
            log.warning("warn-nested")
            log.debug("debug-at-5")
            with cpyscf.patch(verbose=0):
                log.warning("warn-quiet")
        log.error("error-at-4")
        assert root.level <= logging.INFO
    log.warning("after")
    out = capsys.readouterr().out
    assert out.count("chemio: info-at-4") == 1 and "debug-at-4" not in out
    assert out.count("WARN: chemio: warn-nested") == 1
    assert out.count("chemio: debug-at-5") == 1
    assert out.count("ERROR: chemio: error-at-4") == 1
    assert "warn-quiet" not in out and "after" not in out
    assert root.handlers == handlers and root.level == level
    with pytest.raises(cio.errors.ArgumentError, match="verbose"):
        cpyscf.enable(verbose=-1)
    assert not cpyscf.enabled() and root.handlers == handlers


def test_semi_direct_messages_are_not_repeated_under_patch(capsys):
    """semi_direct writes its messages to lib.logger itself; the plug-in does not repeat them."""
    import sys
    mol = gto.M(atom="O 0 0 0; H 0 .757 .587; H 0 -.757 .587", basis="sto-3g", verbose=0)
    mol.stdout = sys.stdout                      # PySCF's default is the stdout of import
    with cpyscf.patch(backend="local", verbose=4):
        mf = cpyscf.semi_direct(scf.RHF(mol), max_memory=200)
        mf.verbose = 4
        e = mf.kernel()
        mf.semi_direct.close()
    out = capsys.readouterr().out
    assert abs(e - scf.RHF(mol).kernel()) < 1e-9
    assert out.count("chemio semi-direct: first cycle") == 1
    assert "chemio: first cycle" not in out
