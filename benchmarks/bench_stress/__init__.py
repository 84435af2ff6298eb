"""Stress run: P processes doing a random mix of every chemio_py operation for a fixed time,
every byte checked against an independent model. Not a speed benchmark: its figure of merit
is ``lost or wrong bytes: 0`` (issue 11, "Trust").

What runs. P = 1..4 processes for ``--seconds`` each (default 60; quick mode 10 at P = 1, 2).
P = 1 is a plain ``python`` process (the serial path of ``cio.comm()``, as in Jupyter);
P >= 2 is a real ``mpiexec -n P python -m mpi4py`` (the mpich wheel's launcher), because
SharedFile and DiskArray creation, ``write_all``/``read_all``, ``close`` and ``destroy`` are
collective. Each process works in rounds until the time is up:

* an independent slice on its private files, on every backend (``local``, ``local`` with
  O_DIRECT, ``shm``, ``auto``): ExclusiveFile ``write``/``read``/``read_bytes``/``awrite``/
  ``aread``/``aread_many``/``awrite_many``/``truncate``/``flush`` at random offsets and sizes
  (0 B to 4 MiB, past the end of the file too, leaving holes; 4 KiB-aligned buffers from
  ``cio.aligned_empty`` for the AIO path), close/reopen (``r`` and ``r+``, some writes still
  in flight at the close), delete/re-create; RecordFile ``append`` (1-4 arrays of any dtype
  and shape, records larger than a page, compressed and not), ``flush`` (durable or not),
  full and partial ``replay``, close/reopen (``r``/``r+``), re-create;
* then a collective phase on one backend (cycled): either a SharedFile round (every rank
  writes random sub-ranges of its own random disjoint segments, blocking and async; flush,
  barrier; every rank reads other ranks' data, and past the end; sometimes one rank
  truncates; sometimes the file is destroyed and created again, with or without
  ``hard_limit``/``soft_limit``/``request_size``) or a DiskArray round (1-3 dimensions, every
  supported dtype, random chunks or ``request_shape``; each rank writes random aligned and
  non-aligned sections of its own rows with ``write``/``awrite``/``d[...] = ``, transposed
  too, reads them back; barrier; ``write_all``/``read_all``; reads of other ranks' rows;
  persistent arrays are closed and reopened, ``r`` then ``r+``).

The model. A NumPy byte array per file (with its size), a NumPy array per DiskArray, a list
of arrays per RecordFile. Every process applies the writes of the other processes from
their descriptors (offset, length, position in a data pool that every rank derives from the
seed), so a read of another rank's data is checked byte for byte. Async requests in flight
never overlap a write in flight (MPI semantics), and a read that the model says passes the
end of the file expects ``EndOfFileError``; expected errors (``EndOfFileError``,
``LimitExceededError`` past ``hard_limit``, ``ModeError`` on a read-only handle,
``SectionError`` on a section outside the shape) count as checks. Anything else raised is an
error, reported with the seed, rank, round, operation number and traceback; a read that
differs from the model counts its differing bytes as lost or wrong. Every object is also
verified whole at random times and at the end.

Bounds. Draws come from ``numpy.random.default_rng`` seeded with ``--seed`` (printed; a
random one when not given): the same seed and P replay the same operations in the same
order (how many rounds fit in the time varies). Each round is a bounded amount of work and
no new round starts when the previous ones say it would not end in time, so a run ends a
few seconds after ``--seconds``. A process stuck in one operation for ``--hang-timeout``
seconds (default 120) dumps its stack and exits (faulthandler); the launcher kills the whole
process group at ``--seconds`` + hang timeout + 60 s at the latest. Every file lives in a
work directory and a private ``/dev/shm/cio-stress-*`` directory that are removed at the
end, on failure too; files that the library's own cleanup left behind are reported.

Run it::

    chemio bench --only stress [--seconds 60] [--procs 4] [--seed N]
    python benchmarks/bench_stress --seconds 600 --procs 4 [--seed N] [--json out.json]

``--shm-limit 48M`` (script only) sets a small RAM budget (``CHEMIO_SHM_LIMIT``): ``auto``
files then spill to disk under the load (counted in the report) and ``shm`` is left out,
its files being refused by design; a SharedFile of ``auto`` refused growth with
``OutOfSpaceError`` counts as expected. ``--inject corrupt|hang`` (tests only) flips bytes
in some writes or blocks one read forever, to prove that the checks and the watchdog work.

The runner gets one row per P (operations, bytes verified, errors, lost or wrong bytes, and
a PASS/FAIL "clean" row; per-kind counts in the row's ``detail``); a run that is not clean
raises, so ``chemio bench`` exits 1 with the report in ``results.json``. The script prints the
report and exits 1 when anything was lost or wrong or any error happened.

The package, one model per file on a shared base:

* ``base``: settings, ``Tally``, ``Ctx`` (the worker's context), random draws, ``Flight``
  (requests in flight), ``Model`` and ``ByteModel`` (the bases of the models);
* ``eaf`` (ExclusiveFile), ``records`` (RecordFile), ``shared`` (SharedFile and its
  collective round), ``diskarray`` (DiskArray and its collective round): the models;
* ``worker``: one stress process; ``launcher``: start, watch, report (``run``, ``main``);
* ``__main__``: ``python benchmarks/bench_stress`` (the script, and each worker process).
"""
from __future__ import annotations

from .base import REQUIRED_KINDS
from .launcher import MPICH_SHM, StressFailure, main, report, run, stress

__all__ = ["MPICH_SHM", "REQUIRED_KINDS", "StressFailure", "main", "report", "run", "stress"]
