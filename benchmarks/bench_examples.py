"""The chemistry examples at scale, against PySCF on the same molecule in the same run.

* ``examples/ri_mp2.py --scf df``: n-dodecane C12H26 in cc-pVDZ (298 basis functions, 49
  occupied, 1036 cc-pVDZ-RI auxiliary functions: B is 101 MB) with ``--max-memory`` at 10 %
  of B. The out-of-core part (B built on disk + the energy loop, ``ooc_seconds``) against
  PySCF's in-core ``DFMP2`` (``with_t2=False``) on the same density-fitted SCF, timed by the
  example in the same process (``reference_seconds``). Runs alternate the order (the
  reference first in every second run). Target: at most 1.5x PySCF's time; the energies
  must agree to 1e-8 Eh.
* ``examples/ri_mp2.py --scf df --max-memory 3`` quiet and beside a busy loop (issue 28):
  benzene cc-pVTZ, naphthalene cc-pVDZ and pyridine cc-pVTZ, each run once as is and once
  with a child process spinning on one core (started before the example, killed after:
  the SCF, the out-of-core part and PySCF's DFMP2 all run beside it), rounds interleaved
  (quiet, busy, quiet, busy, ...; every second round with the reference first). Targets:
  out of core <= 1.0x PySCF's in-core DFMP2 quiet, <= 1.5x beside the busy loop. The notes
  say where the time went (integrals + transformation, fitting pass, energy loop) and the
  BLAS threads the example chose (``blas_threads``: build, energy).
* ``examples/semi_direct_scf.py``: n-butane C4H10 in cc-pVDZ (106 basis functions, shell
  groups of at most 16 functions: 406 batches), half the batches cached, against PySCF's
  RHF in core and direct on the same molecule (timed by the example). Information: no
  target.

Each run is a subprocess with the same thread settings for both sides (``OMP_NUM_THREADS``
= ``OPENBLAS_NUM_THREADS`` = the CPUs of this process: BLAS on every core for chemio and
for PySCF) and its scratch in the benchmark's work directory. Quick mode: propane and
water, one run each. Without PySCF one row says the benchmark was skipped.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import row  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
WATER = "O 0 0 0; H 0 0.757 0.587; H 0 -0.757 0.587"
TIMEOUT = 900


def alkane(n: int) -> str:
    """The all-trans n-alkane CnH(2n+2) (C-C 1.54, C-H 1.09 Angstrom, tetrahedral), in
    PySCF's geometry syntax."""
    import numpy as np
    cc, ch = 1.54, 1.09
    half = math.radians(109.47) / 2
    dx, dy = cc * math.sin(half), cc * math.cos(half)
    hy, hz = ch * math.cos(math.radians(54.75)), ch * math.sin(math.radians(54.75))
    atoms = []
    carbons = [np.array([i * dx, (i % 2) * dy, 0.0]) for i in range(n)]
    atoms += [("C", c) for c in carbons]
    for i, c in enumerate(carbons):
        up = 1 if i % 2 else -1                  # the side away from the chain
        atoms.append(("H", c + [0.0, up * hy, hz]))
        atoms.append(("H", c + [0.0, up * hy, -hz]))
        if i in (0, n - 1):                      # methyl ends: a third hydrogen
            sx = -1 if i == 0 else 1
            atoms.append(("H", c + [sx * ch * math.sin(half), -up * ch * math.cos(half), 0.0]))
    return "; ".join(f"{s} {x:.6f} {y:.6f} {z:.6f}" for s, (x, y, z) in atoms)


def b_tensor_bytes(atom: str, basis: str) -> int:
    """nocc * nvir * naux * 8 of ri_mp2's B (mp2fit auxiliary basis)."""
    from pyscf import df, gto
    mol = gto.M(atom=atom, basis=basis, verbose=0)
    naux = df.addons.make_auxmol(mol, df.make_auxbasis(mol, mp2fit=True)).nao_nr()
    nocc = mol.nelectron // 2
    return nocc * (mol.nao_nr() - nocc) * naux * 8


def _spinner(cpu: int | None):
    """A child process spinning on one core (pinned to ``cpu`` when given), started now."""
    code = ("import os, sys\n"
            "cpu = int(sys.argv[1])\n"
            "if cpu >= 0 and hasattr(os, 'sched_setaffinity'):\n"
            "    os.sched_setaffinity(0, {cpu})\n"
            "while True:\n"
            "    pass\n")
    return subprocess.Popen([sys.executable, "-c", code, str(-1 if cpu is None else cpu)])


def _run_example(name: str, args: list[str], workdir: str, busy: bool = False) -> dict:
    scratch = os.path.join(workdir, "scratch")
    os.makedirs(scratch, exist_ok=True)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env = dict(os.environ)
    env.update({"CHEMIO_SCRATCH": scratch, "OMP_NUM_THREADS": str(ncpu),
                "OPENBLAS_NUM_THREADS": str(ncpu), "MKL_NUM_THREADS": str(ncpu)})
    cmd = [sys.executable, os.path.join(EXAMPLES, f"{name}.py"), *args, "--quiet"]
    spin = None
    if busy:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        spin = _spinner(cpus[-1] if cpus else None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env,
                              cwd=workdir)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _span(xs: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if len(xs) == 1 else f"{fmt.format(lo)}-{fmt.format(hi)}"


def ri_mp2_rows(quick: bool, workdir: str) -> list[dict]:
    n, runs = (3, 1) if quick else (12, 2)
    basis = "cc-pvdz"
    atom = alkane(n)
    xyz = os.path.join(workdir, f"c{n}.xyz")
    items = atom.split("; ")
    with open(xyz, "w") as fh:
        fh.write(f"{len(items)}\nn-alkane C{n}H{2 * n + 2}\n" + "\n".join(items) + "\n")
    tensor = b_tensor_bytes(atom, basis)
    mem = math.floor(tensor * 0.1 / 1e6 * 100) / 100       # MB, <= 10 % of B
    res = []
    for k in range(runs):
        args = ["--atom", xyz, "--basis", basis, "--scf", "df", "--max-memory", str(mem)]
        if k % 2:
            args.append("--reference-first")
        res.append(_run_example("ri_mp2", args, workdir))
    ooc = [r["ooc_seconds"] for r in res]
    ref = [r["reference_seconds"] for r in res]
    ratios = [a / b for a, b in zip(ooc, ref)]
    err = max(r["abs_error"] for r in res)
    r0 = res[0]
    what = (f"ri_mp2 C{n}H{2 * n + 2} {basis} DF-RHF, B {tensor / 1e6:.0f} MB, "
            f"--max-memory {mem:g} MB")
    per_run = ", ".join(f"{a:.2f}/{b:.2f} s" for a, b in zip(ooc, ref))
    note = (f"median of {runs}; per run chemio/PySCF {per_run} (x{_span(ratios)}); "
            f"{r0['passes']} passes over B in blocks of {r0['block_rows']} rows, "
            f"{r0['aux_blocks']} aux blocks; build {_span([r['build_seconds'] for r in res])}"
            f" s, energy {_span([r['energy_seconds'] for r in res])} s; SCF "
            f"{_span([r['scf_seconds'] for r in res])} s")
    return [
        row(f"{what}: out-of-core B + energy", "s", statistics.median(ooc),
            "PySCF DFMP2 in core", statistics.median(ref), target=None if quick else 1.5,
            note=note if not quick else note + " (quick: no target, a sanity check)",
            lower_is_better=True),
        row(f"{what}: |E_corr - E_corr(PySCF DFMP2)|", "Eh", err, "tolerance 1e-8", 1e-8,
            target=1.0, lower_is_better=True,
            note=f"E_corr = {r0['energy']:.10f} Eh over {runs} run(s)"),
    ]


def ring(n: int, hetero: dict[int, str] | None = None) -> str:
    """Planar fused six-rings (``n`` = 1: benzene, 2: naphthalene; C-C 1.40, C-H 1.08
    Angstrom), with ``hetero`` atoms replacing CH groups by index (``{0: "N"}``: pyridine)."""
    cc, ch = 1.40, 1.08
    cx = cc * math.sqrt(3) / 2
    centers = [0.0] if n == 1 else [-cx, cx]
    carbons: list[tuple[float, float, int]] = []     # x, y, ring index
    for r, c in enumerate(centers):
        for k in range(6):
            a = math.radians(30 + 60 * k)
            x, y = c + cc * math.cos(a), cc * math.sin(a)
            if not any(abs(x - u) < 1e-6 and abs(y - v) < 1e-6 for u, v, _ in carbons):
                carbons.append((x, y, r))
    atoms = []
    for k, (x, y, r) in enumerate(carbons):
        el = (hetero or {}).get(k, "C")
        atoms.append(f"{el} {x:.6f} {y:.6f} 0.000000")
        if n > 1 and abs(x) < 1e-6:                  # the shared bond: no hydrogen
            continue
        if el != "C":
            continue
        dx, dy = x - centers[r], y
        norm = math.hypot(dx, dy)
        atoms.append(f"H {x + ch * dx / norm:.6f} {y + ch * dy / norm:.6f} 0.000000")
    return "; ".join(atoms)


CONTENTION_CASES = [("benzene", ring(1), "cc-pvtz"), ("naphthalene", ring(2), "cc-pvdz"),
                    ("pyridine", ring(1, {0: "N"}), "cc-pvtz")]


def ri_mp2_contention_rows(quick: bool, workdir: str) -> list[dict]:
    """ri_mp2 --max-memory 3 quiet and beside a one-core busy loop, rounds interleaved."""
    cases = [("water", WATER, "cc-pvtz")] if quick else CONTENTION_CASES
    rounds = 1 if quick else 3
    out = []
    for label, atom, basis in cases:
        res: dict[bool, list[dict]] = {False: [], True: []}
        for k in range(rounds):
            for busy in (False, True):
                args = ["--atom", atom, "--basis", basis, "--scf", "df", "--max-memory", "3"]
                if k % 2:
                    args.append("--reference-first")
                r = _run_example("ri_mp2", args, workdir, busy=busy)
                res[busy].append(r)
                print(f"bench_examples: ri_mp2 {label} {'busy' if busy else 'quiet'} round "
                      f"{k + 1}: chemio {r['ooc_seconds']:.2f} s (integrals "
                      f"{r['integral_seconds']:.2f}, fit {r['fit_seconds']:.2f}, energy "
                      f"{r['energy_seconds']:.2f}; BLAS threads {r['blas_threads']}), PySCF "
                      f"{r['reference_seconds']:.2f} s", file=sys.stderr, flush=True)
        for busy, target in ((False, 1.0), (True, 1.5)):
            rs = res[busy]
            ratios = [r["ooc_seconds"] / r["reference_seconds"] for r in rs]
            r0 = rs[0]
            what = (f"ri_mp2 {label} {basis} --max-memory 3 "
                    f"{'beside a one-core busy loop' if busy else 'quiet'} ({r0['nao']} bf, "
                    f"{r0['naux']} aux, B {r0['tensor_bytes'] / 1e6:.0f} MB)")
            note = (f"median of {rounds}; per run chemio/PySCF "
                    + ", ".join(f"{r['ooc_seconds']:.2f}/{r['reference_seconds']:.2f} s"
                                for r in rs)
                    + f" (x{_span(ratios)}); integrals {_span([r['integral_seconds'] for r in rs])}"
                    f" s ({r0['aux_blocks']} aux blocks), fitting "
                    f"{_span([r['fit_seconds'] for r in rs])} s, energy "
                    f"{_span([r['energy_seconds'] for r in rs])} s ({r0['passes']} passes, "
                    f"{r0['block_rows']} rows a block); BLAS threads "
                    + " ".join(f"{r['blas_threads']}" for r in rs)
                    + f"; max |dE| {max(r['abs_error'] for r in rs):.1e} Eh")
            out.append(row(f"{what}: out-of-core B + energy", "s",
                           statistics.median(r["ooc_seconds"] for r in rs),
                           "PySCF DFMP2 in core, same conditions",
                           statistics.median(r["reference_seconds"] for r in rs),
                           target=None if quick else target, lower_is_better=True,
                           note=note if not quick else note + " (quick: no target)"))
    return out


def semi_direct_rows(quick: bool, workdir: str) -> list[dict]:
    if quick:
        atom, label, runs = WATER, "H2O", 1
    else:
        atom, label, runs = alkane(4), "C4H10", 2
    args = ["--atom", atom, "--basis", "cc-pvdz", "--group-ao", "6" if quick else "16"]
    res = [_run_example("semi_direct_scf", args, workdir) for _ in range(runs)]
    ours = [r["scf_seconds"] for r in res]
    incore = [r["pyscf_incore_seconds"] for r in res]
    direct = [r["pyscf_direct_seconds"] for r in res]
    r0 = res[0]
    what = (f"semi_direct_scf {label} cc-pVDZ ({r0['nao']} bf, {r0['stored_batches']} of "
            f"{r0['batches']} batches cached)")
    note = (f"median of {runs}; semi-direct {_span(ours)} s ({r0['iterations']} cycles), "
            f"PySCF in core {_span(incore)} s ({r0['pyscf_incore_cycles']} cycles), direct "
            f"{_span(direct)} s ({r0['pyscf_direct_cycles']} cycles)")
    dmax = max(max(abs(r["energy"] - r["pyscf_incore_energy"]),
                   abs(r["energy"] - r["pyscf_direct_energy"])) for r in res)
    return [
        row(f"{what}: SCF time vs PySCF in core", "s", statistics.median(ours),
            "PySCF RHF in core", statistics.median(incore), note=note, lower_is_better=True),
        row(f"{what}: SCF time vs PySCF direct", "s", statistics.median(ours),
            "PySCF RHF direct", statistics.median(direct), lower_is_better=True,
            note="same runs"),
        row(f"{what}: |E - E(PySCF)| (in core and direct)", "Eh", dmax, "tolerance 1e-8",
            1e-8, target=1.0, lower_is_better=True, note=f"E = {r0['energy']:.10f} Eh"),
    ]


def run(quick: bool, workdir: str) -> list[dict]:
    try:
        import pyscf  # noqa: F401
    except ImportError as e:
        return [row("examples", "available", 0.0,
                    note=f"skipped: PySCF is not installed ({e}); pip install pyscf")]
    cases = {"ri_mp2": ri_mp2_rows, "contention": ri_mp2_contention_rows,
             "semi_direct": semi_direct_rows}
    only = os.environ.get("BENCH_EXAMPLES_ONLY")        # e.g. "contention"
    return [r for name, fn in cases.items() if not only or name in only.split(",")
            for r in fn(quick, workdir)]


if __name__ == "__main__":
    import tempfile
    quick = "--quick" in sys.argv
    with tempfile.TemporaryDirectory(prefix="bench-examples-") as d:
        for r in run(quick, d):
            print(json.dumps(r))
