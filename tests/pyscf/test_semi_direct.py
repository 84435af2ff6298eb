"""Semi-direct SCF inside PySCF (``chemio_py.pyscf.semi_direct``), checked against PySCF.

Energies of RHF/UHF/ROHF equal PySCF's in-core ones (1e-9 Eh), serially and under a real
``mpiexec -n 2``; J/K of any density stack equal PySCF's direct ``get_jk``; a cache budget
or memory too small, or a cache that runs out of space, leaves batches to be recomputed
(and the log says so) but never changes the energy or fails.
"""
from __future__ import annotations

import importlib
import io
import json
import logging

import numpy as np
import pytest

pytest.importorskip("pyscf")
from pyscf import gto, scf  # noqa: E402

import chemio_py.pyscf as cpyscf  # noqa: E402
from chemio_py.errors import ArgumentError, OutOfSpaceError  # noqa: E402
from chemio_py.files.records import RecordFile  # noqa: E402

WATER = "O 0 0 0; H 0 0.757 0.587; H 0 -0.757 0.587"
OH = "O 0 0 0; H 0 0 0.97"
NH2 = "N 0 0 0; H 0 0.8 0.6; H 0 -0.8 0.6"


def _ref(kind, mol) -> float:
    mf = kind(mol)
    mf.conv_tol = 1e-11
    return float(mf.kernel())


CASES = [
    (scf.RHF, WATER, "cc-pvdz", 0),
    (scf.UHF, OH, "6-31g", 1),
    (scf.ROHF, NH2, "cc-pvdz", 1),
    (scf.UHF, NH2, "sto-3g", 1),
]


@pytest.mark.parametrize("kind,atom,basis,spin", CASES,
                         ids=["rhf-water-ccpvdz", "uhf-oh-631g", "rohf-nh2-ccpvdz",
                              "uhf-nh2-sto3g"])
def test_energies_equal_pyscf(kind, atom, basis, spin):
    mol = gto.M(atom=atom, basis=basis, spin=spin, verbose=0)
    mf = kind(mol)
    mf.conv_tol = 1e-11
    assert cpyscf.semi_direct(mf, max_memory=2) is mf
    try:
        e = float(mf.kernel())
        st = mf.semi_direct.stats
        assert mf.converged and abs(e - _ref(kind, mol)) < 1e-9
        # max_memory=2 MB: several batches, all cached and replayed every later call
        assert st["stored_batches"] == st["batches"] > 1 and st["direct_batches"] == 0
        assert st["replayed"] == st["stored_batches"] * (st["calls"] - 1)
        assert mf.direct_scf              # PySCF's incremental Fock builds were in use
    finally:
        mf.semi_direct.close()


def test_jk_of_any_density_equals_pyscf():
    mol = gto.M(atom=WATER, basis="6-31g", verbose=0)
    n = mol.nao
    mf = cpyscf.semi_direct(scf.RHF(mol), max_memory=1)
    ref = scf.RHF(mol)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((3, n, n))
    sym = a + a.transpose(0, 2, 1)
    try:
        for dm, hermi in [(sym[0], 1), (sym[:2], 1), (a, 0), (a[0] - a[0].T, 2),
                          (sym[:2].reshape(2, 1, n, n), 1)]:
            vj, vk = mf.get_jk(mol, dm, hermi)
            rj, rk = scf.hf.SCF.get_jk(ref, mol, dm, hermi)
            assert vj.shape == rj.shape == np.shape(dm)
            assert np.abs(vj - rj).max() < 1e-10 and np.abs(vk - rk).max() < 1e-10
        vj, vk = mf.get_jk(mol, sym[0], with_k=False)
        assert vk is None and np.abs(vj - scf.hf.SCF.get_j(ref, mol, sym[0])).max() < 1e-10
        c = sym[0] + 1j * (a[1] - a[1].T)                 # a complex Hermitian density
        vj, vk = mf.get_jk(mol, c, 1)
        rj, rk = scf.hf.get_jk(mol, c, 0)
        assert np.abs(vj - rj).max() < 1e-10 and np.abs(vk - rk).max() < 1e-10
        assert mf.semi_direct.stats["calls"] == 7
    finally:
        mf.semi_direct.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_jk_equal_pyscf_on_any_thread_count(threads):
    # the first call contracts the intor buffers, later ones the replayed packed records;
    # one density with J and K (the kernels' fast path), stacks, J or K alone, hermi 0/1
    from pyscf import lib
    mol = gto.M(atom=WATER, basis="6-31g", verbose=0)
    n = mol.nao
    rng = np.random.default_rng(threads)
    a = rng.standard_normal((2, n, n))
    sym = a + a.transpose(0, 2, 1)
    mf = cpyscf.semi_direct(scf.RHF(mol), max_memory=6.4)     # two batches of 36+ rows
    try:
        with lib.with_omp_threads(threads):
            for dm, hermi, wj, wk in [(sym[0], 1, True, True), (sym[0], 1, True, True),
                                      (sym, 1, True, True), (a, 0, True, True),
                                      (a[0], 0, True, True), (sym, 1, False, True),
                                      (sym[1], 1, True, False)]:
                vj, vk = mf.get_jk(mol, dm, hermi, with_j=wj, with_k=wk)
                rj, rk = scf.hf.get_jk(mol, dm, hermi)
                assert (vj is None) != wj and (vk is None) != wk
                assert vj is None or np.abs(vj - rj).max() < 1e-10
                assert vk is None or np.abs(vk - rk).max() < 1e-10
        st = mf.semi_direct.stats
        assert st["batches"] > 1 and st["replayed"] == st["stored_batches"] * 6
        # every batch is long enough to be shared out among the threads
        assert min(len(b.rows) for b in mf.semi_direct.batches) >= 4 * threads
    finally:
        mf.semi_direct.close()


def test_tiny_disk_budget_recomputes_part_and_says_so(caplog):
    mol = gto.M(atom=WATER, basis="cc-pvdz", verbose=0)
    mf = scf.RHF(mol)
    mf.conv_tol = 1e-11
    mf.verbose = 4
    mf.stdout = io.StringIO()
    cpyscf.semi_direct(mf, max_memory=1, max_disk=0.1)
    try:
        with caplog.at_level(logging.INFO, logger="chemio_py.pyscf"):
            e = float(mf.kernel())
        st = mf.semi_direct.stats
        assert 0 < st["stored_batches"] < st["batches"] and st["direct_batches"] > 0
        assert st["stored_bytes"] <= 0.1e6 and st["recomputed"] > 0
        assert abs(e - _ref(scf.RHF, mol)) < 1e-9
        assert "recomputed every cycle" in caplog.text and "max_disk=0.1 MB" in caplog.text
        assert "chemio semi-direct" in mf.stdout.getvalue()         # PySCF's logger too
    finally:
        mf.semi_direct.close()


def test_shm_cache_is_capped_by_a_tiny_max_memory(caplog):
    mol = gto.M(atom=OH, basis="cc-pvdz", spin=1, verbose=0)
    mf = scf.UHF(mol)
    mf.conv_tol = 1e-11
    cpyscf.semi_direct(mf, max_memory=0.05, backend="shm")
    try:
        with caplog.at_level(logging.INFO, logger="chemio_py.pyscf"):
            e = float(mf.kernel())
        st = mf.semi_direct.stats
        assert st["budget"] == 50000 and st["direct_batches"] > 0
        assert abs(e - _ref(scf.UHF, mol)) < 1e-9
        assert "max_memory (the shm backend" in caplog.text
    finally:
        mf.semi_direct.close()


def test_out_of_space_keeps_the_last_commit_and_goes_on(monkeypatch, caplog):
    """The device fills up after a few batches: what was committed stays cached, the rest
    is recomputed, the energy is PySCF's."""
    sd = importlib.import_module("chemio_py.pyscf.semidirect")
    monkeypatch.setattr(sd, "_COMMIT_EVERY", 1)          # commit after every batch
    real = RecordFile.append
    count = [0]

    def append(self, *arrays):
        count[0] += 1
        if count[0] > 3:
            raise OutOfSpaceError(self.path, 1 << 20, 0)
        return real(self, *arrays)

    monkeypatch.setattr(RecordFile, "append", append)
    mol = gto.M(atom=WATER, basis="cc-pvdz", verbose=0)
    mf = scf.RHF(mol)
    mf.conv_tol = 1e-11
    cpyscf.semi_direct(mf, max_memory=1)
    try:
        with caplog.at_level(logging.WARNING, logger="chemio_py.pyscf"):
            e = float(mf.kernel())
        st = mf.semi_direct.stats
        assert st["stored_batches"] == 3 and st["direct_batches"] == st["batches"] - 3
        assert abs(e - _ref(scf.RHF, mol)) < 1e-9
        assert "OutOfSpaceError" in caplog.text
    finally:
        mf.semi_direct.close()


def test_bad_input_changes_nothing():
    mf = scf.RHF(gto.M(atom=WATER, basis="sto-3g", verbose=0))
    before = mf.get_jk
    with pytest.raises(ArgumentError, match="PySCF SCF object"):
        cpyscf.semi_direct(object())
    with pytest.raises(ArgumentError, match="max_memory"):
        cpyscf.semi_direct(mf, max_memory=-1)
    with pytest.raises(ArgumentError, match="max_disk"):
        cpyscf.semi_direct(mf, max_disk=float("nan"))
    assert mf.get_jk == before and "semi_direct" not in mf.__dict__
    cpyscf.semi_direct(mf)
    with pytest.raises(ArgumentError, match="basis functions"):
        mf.get_jk(mf.mol, np.zeros((3, 3)))
    mf.semi_direct.close()


def test_calling_twice_replaces_the_cache():
    mol = gto.M(atom=WATER, basis="sto-3g", verbose=0)
    mf = cpyscf.semi_direct(scf.RHF(mol))
    mf.kernel()
    first = mf.semi_direct
    cpyscf.semi_direct(mf, max_memory=1)
    assert first.cache is None and mf.semi_direct is not first
    assert abs(mf.kernel() - _ref(scf.RHF, mol)) < 1e-9
    mf.semi_direct.close()


MPI_BODY = """
import json
import chemio_py as cio, chemio_py.pyscf as cp
from pyscf import gto, scf
c = cio.comm()
out = {}
for name, kind, atom, basis, spin in [("rhf", scf.RHF, "%s", "cc-pvdz", 0),
                                      ("uhf", scf.UHF, "%s", "6-31g", 1),
                                      ("rohf", scf.ROHF, "%s", "6-31g", 1)]:
    mol = gto.M(atom=atom, basis=basis, spin=spin, verbose=0)
    mf = kind(mol); mf.conv_tol = 1e-11
    cp.semi_direct(mf, max_memory=1, max_disk=0.004 if name == "uhf" else None)
    e = float(mf.kernel())
    st = mf.semi_direct.stats
    mf.semi_direct.close()
    ref = kind(mol); ref.conv_tol = 1e-11
    out[name] = [e, float(ref.kernel()), st["batches"], st["direct_batches"], mf.cycles]
import sys                      # one write per line: two ranks' lines never interleave
sys.stdout.write(f"RESULT {c.rank} {json.dumps(out)}\\n")
sys.stdout.flush()
""" % (WATER, OH, NH2)


@pytest.mark.mpi
def test_under_mpiexec_two_ranks(mpirun, tmp_path):
    p = mpirun(2, MPI_BODY)
    res = {}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT"):
            _, rank, body = line.split(" ", 2)
            res[int(rank)] = json.loads(body)
    assert sorted(res) == [0, 1], p.stdout + p.stderr
    for name in ("rhf", "uhf", "rohf"):
        for rank in (0, 1):
            e, ref, nb, _, _ = res[rank][name]
            assert abs(e - ref) < 1e-9, (name, rank, e, ref)
            assert nb > 0                              # each rank had its own batches
        assert res[0][name][0] == res[1][name][0]      # the same energy, to the last bit
        assert res[0][name][4] == res[1][name][4]      # and the same cycles
    assert res[0]["uhf"][3] + res[1]["uhf"][3] > 0     # max_disk: part recomputed


def test_compressed_cache_gives_the_same_energy():
    pytest.importorskip("numcodecs")
    mol = gto.M(atom=WATER, basis="6-31g", verbose=0)
    mf = scf.RHF(mol)
    mf.conv_tol = 1e-11
    cpyscf.semi_direct(mf, max_memory=1, compress="zstd")
    try:
        e = float(mf.kernel())
        assert mf.semi_direct.cache.compressor == "zstd"
        st = mf.semi_direct.stats
        assert st["stored_batches"] == st["batches"] and st["replayed"] > 0
        assert abs(e - _ref(scf.RHF, mol)) < 1e-9
    finally:
        mf.semi_direct.close()
    with pytest.raises(ArgumentError):
        cpyscf.semi_direct(scf.RHF(mol), compress="no-such-codec")
