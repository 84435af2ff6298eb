"""Checkpoint / restart: a long loop that survives SIGKILL and resumes on any number of ranks.

The loop: preconditioned steepest descent for the lowest root of a CAS Hamiltonian. Each
step takes the state vector c, forms sigma = H c (PySCF's ``contract_2e``, the work split
over the ranks by blocks of integrals and summed), the Rayleigh quotient E, the Davidson
correction t = r / (E - diag H), and the lowest vector of H in span{c, t} as the new c.
The state is c alone, so a run resumed from step n continues exactly as before.

Every ``--every`` steps the state goes to a persistent ``cio.DiskArray`` of two
generations, shape (2, ndet). A checkpoint writes the generation that is *not* current
(each rank ``write_all``s its ``block_section``), flushes it to the device, and only then
switches the atomic "latest" pointer (``latest.json``: written to a temporary file,
fsync'ed, renamed over the old one, directory fsync'ed). A crash at any moment leaves the
pointer naming a complete generation. Started again -- with any number of ranks -- the
run finds the pointer and resumes from that step.

    python examples/checkpoint_restart.py --checkpoint-dir ckpt --steps 30 --every 3
    # kill it (kill -9) and run the same command again, under mpiexec -n 2 if you like

Reference: PySCF's CASCI energy of the same active space (|dE| < 1e-8 Eh once converged).
On success the checkpoint is removed (``--keep-checkpoint`` keeps it).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import chemio_py as cio  # noqa: E402
from mrci_davidson import cas_problem  # noqa: E402

TOLERANCE = 1e-8
POINTER = "latest.json"
STATE = "state"


def _api():
    from chemio_py.arrays.diskarray import DiskArray, block_section
    return getattr(cio, "DiskArray", DiskArray), getattr(cio, "block_section", block_section)


def write_pointer(directory: str, record: dict) -> None:
    """Replace ``latest.json`` atomically and durably (temp file, fsync, rename, fsync dir)."""
    path = os.path.join(directory, POINTER)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(record, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_pointer(directory: str) -> dict | None:
    path = os.path.join(directory, POINTER)
    try:
        with open(path) as fh:
            rec = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: checkpoint pointer {path!r} is unreadable ({e}); remove the "
                         f"directory or run with --fresh") from None
    if not isinstance(rec, dict) or rec.get("generation") not in (0, 1) \
            or not isinstance(rec.get("step"), int) or not isinstance(rec.get("energies"), list):
        raise SystemExit(f"error: checkpoint pointer {path!r} is not a checkpoint of this "
                         f"script; remove it or run with --fresh")
    return rec


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--ncas", type=int, default=6)
    p.add_argument("--nelecas", type=int, default=6)
    p.add_argument("--steps", type=int, default=30, help="length of the loop")
    p.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    p.add_argument("--checkpoint-dir", default="chemio-checkpoint",
                   help="directory of the persistent checkpoint (created if missing)")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    p.add_argument("--keep-checkpoint", action="store_true",
                   help="keep the checkpoint after a successful run")
    p.add_argument("--step-delay", type=float, default=0.0, metavar="S",
                   help="sleep this long per step (stands in for a long computation)")
    p.add_argument("--die-in-checkpoint", type=int, default=None, metavar="STEP",
                   help="testing: SIGKILL rank 0 halfway through writing the checkpoint of "
                        "step STEP, after part of the new generation is written")
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        p.error("--steps and --every must be >= 1")
    DiskArray, block_section = _api()
    run = _common.Run("checkpoint_restart", args)
    comm = run.comm
    run.log(f"rank {comm.rank} pid {os.getpid()}", all_ranks=True)
    from pyscf import fci
    from pyscf.fci import direct_spin1

    h2, ecore, nelec, hdiag, ref, nao, _ = cas_problem(run, args)
    norb = args.ncas
    na = fci.cistring.num_strings(norb, nelec[0])
    nb = fci.cistring.num_strings(norb, nelec[1])
    ndet = na * nb
    link = (fci.cistring.gen_linkstr_index_trilidx(range(norb), nelec[0]),
            fci.cistring.gen_linkstr_index_trilidx(range(norb), nelec[1]))
    npair = h2.shape[0]
    mine_rows = [(r0, r1) for t, (r0, r1) in enumerate(zip(range(0, npair, 4),
                                                             range(4, npair + 4, 4)))
                 if t % comm.size == comm.rank]

    def hc(v: np.ndarray) -> np.ndarray:
        """H v (without the core energy), summed over the ranks' blocks of integrals."""
        out = np.zeros(ndet)
        for r0, r1 in mine_rows:
            block = np.zeros_like(h2)
            block[r0:r1] = h2[r0:r1]
            out += direct_spin1.contract_2e(block, v.reshape(na, nb), norb, nelec,
                                            link_index=link).ravel()
        comm.allreduce(out, "sum")
        return comm.bcast(out)                  # bit-identical on every rank

    # -------------------------------------------------------------- start or resume
    ckdir = os.path.abspath(args.checkpoint_dir)
    signature = {"atom": _common.read_atom(args.atom), "basis": args.basis,
                 "charge": args.charge, "ncas": norb, "nelec": list(nelec), "ndet": ndet}
    rec = None
    with comm.agree("reading the checkpoint pointer"):
        if run.root:
            os.makedirs(ckdir, exist_ok=True)
            rec = None if args.fresh else read_pointer(ckdir)
            if rec is not None and rec.get("signature") != signature:
                raise SystemExit(f"error: the checkpoint in {ckdir!r} belongs to another "
                                 f"problem ({rec.get('signature')}); use another "
                                 f"--checkpoint-dir or --fresh")
    rec = comm.bcast(rec)
    data_path = os.path.join(ckdir, STATE + ".dra")
    if rec is None:
        state = DiskArray.create(STATE, (2, ndet), "f8", path=ckdir, persistent=True,
                                 overwrite=True, chunks=(1, ndet))
        c = np.zeros(ndet)
        c[int(np.argmin(hdiag))] = 1.0
        step, gen, energies, resumed_from = 0, 1, [], None
        run.log(f"fresh start: {ndet} determinants, checkpoint in {ckdir}")
    else:
        state = DiskArray.open(data_path, "r+")
        gen, step, energies = rec["generation"], rec["step"], list(rec["energies"])
        c = state.read((slice(gen, gen + 1), slice(0, ndet)))[0]
        resumed_from = step
        run.log(f"resuming from the checkpoint of step {step} (generation {gen}, written by "
                f"{rec.get('ranks')} rank(s)) on {comm.size} rank(s)")
    mysec = block_section((ndet,), comm, axis=0)[0]
    written = 0

    def checkpoint(step: int, c: np.ndarray) -> int:
        """Write c into the other generation, make it durable, then switch the pointer."""
        new = 1 - gen
        lo, hi = mysec.start, mysec.stop
        mid = lo + (hi - lo) // 2
        state.write_all((slice(new, new + 1), slice(lo, mid)), c[None, lo:mid])
        if args.die_in_checkpoint == step and run.root:
            run.log(f"--die-in-checkpoint {step}: SIGKILL in the middle of the checkpoint")
            os.kill(os.getpid(), signal.SIGKILL)
        state.write_all((slice(new, new + 1), slice(mid, hi)), c[None, mid:hi])
        state.flush()                                   # this rank's part is on the device
        comm.barrier()                                  # ... and every rank's
        if run.root:
            write_pointer(ckdir, {"generation": new, "step": step, "energies": energies,
                                  "signature": signature, "ranks": comm.size,
                                  "time": time.time()})
        comm.barrier()
        return new

    # -------------------------------------------------------------- the loop
    for _ in run.progress(range(step, args.steps), "steps", unit="step"):
        t0 = time.perf_counter()
        s = hc(c)
        e = float(c @ s)
        r = s - e * c
        d = e - hdiag
        d[np.abs(d) < 1e-8] = 1e-8
        t = r / d
        t -= (c @ t) * c
        tn = float(np.linalg.norm(t))
        if tn > 1e-14:
            t /= tn
            st = hc(t)
            w, u = np.linalg.eigh(np.array([[e, c @ st], [c @ st, t @ st]]))
            c = u[0, 0] * c + u[1, 0] * t
            c /= np.linalg.norm(c)
        if args.step_delay:
            time.sleep(args.step_delay)
        step += 1
        energies.append(e + ecore)
        run.log(f"step {step:3d}  E = {e + ecore:.12f}  |r| = {np.linalg.norm(r):.2e}  "
                f"({time.perf_counter() - t0:.2f} s)")
        if step % args.every == 0 or step == args.steps:
            gen = checkpoint(step, c)
            written += 1
            run.log(f"checkpoint of step {step} complete (generation {gen})")

    energy = float(c @ hc(c)) + ecore
    checksum = float(np.abs(c) @ np.arange(1, ndet + 1)) / ndet    # sign-free fingerprint
    done = abs(energy - ref) <= TOLERANCE
    if done and not args.keep_checkpoint:
        state.delete()                                   # collective: data and metadata
        if run.root:
            for name in os.listdir(ckdir):
                if name == POINTER or name.startswith(POINTER + ".tmp"):
                    os.unlink(os.path.join(ckdir, name))
            try:
                os.rmdir(ckdir)
            except OSError:
                pass                                     # the user's other files stay
    else:
        state.close()
    return run.finish(energy, ref, TOLERANCE, steps=step, resumed_from=resumed_from,
                      checkpoints_written=written, trajectory=energies,
                      state_fingerprint=checksum, determinants=ndet, checkpoint_dir=ckdir,
                      checkpoint_kept=not (done and not args.keep_checkpoint))


if __name__ == "__main__":
    _common.cli(main)
