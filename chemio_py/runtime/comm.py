"""One communicator interface over "serial" and an mpi4py communicator.

``cio.comm()`` is the communicator given to ``cio.configure(comm=...)`` (kept here: config
passes it on through its change hook), else MPI ``COMM_WORLD`` when the process was started
by an MPI launcher or mpi4py is already initialised, else a serial communicator of one rank.
mpi4py is imported only when it is needed, so ``import chemio_py`` works without it.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any, Callable, Literal

import numpy as np

from chemio_py.errors import ArgumentError, ChemIOError, CollectiveError, CollectiveMismatchError
from chemio_py.runtime import config, rankguard

# Variables that MPI launchers (hydra/MPICH, Open MPI, PMIx, MVAPICH, Cray ALPS) set per rank.
LAUNCHER_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                 "MV2_COMM_WORLD_SIZE", "ALPS_APP_PE", "PMI_FD")

_OPS = {"sum", "max", "min", "prod", "land", "lor", "band", "bor"}


class Comm:
    """A group of processes: ``rank``, ``size`` and the collectives chemio_py needs."""

    rank: int = 0
    size: int = 1
    mpi: Any = None

    def barrier(self) -> None:
        pass

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather(self, obj: Any) -> list:
        return [obj]

    def allreduce(self, value: Any, op: str = "sum") -> Any:
        _check_op(op)
        return value

    def begin(self, call: str) -> None:
        """Collective: start the collective call named ``call`` (``"DiskArray 'x'
        write_all()"``). Every rank must begin the same calls in the same order; under MPI a
        rank in another call, or one that has left, makes every rank raise
        ``CollectiveMismatchError`` instead of waiting (see ``chemio_py.runtime.rankguard``)."""

    @property
    def broken(self) -> str | None:
        """Why this communicator takes no further chemio collective call (None: it does)."""
        return None

    @property
    def calls_made(self) -> int:
        """Collective calls begun on this communicator (its sequence number)."""
        return 0

    def out_of_step(self, where: list[tuple[int, str]]) -> CollectiveMismatchError:
        """The error for ranks found in different steps (``where[rank] = (seq, step)``);
        the communicator takes no further chemio collective call."""
        return CollectiveMismatchError(rankguard.mismatch_message(where)[0], {})

    def agree(self, what: str) -> "_Agreement":
        """Context manager for work that one rank may fail alone.

        On leaving, every rank learns whether any rank raised: a rank that raised re-raises
        its own error, every other rank raises ``CollectiveError`` naming the failed ranks
        and their reasons. No rank is left waiting in the next collective.
        """
        return _Agreement(self, what)

    def same_everywhere(self, value: Any, what: str, explain: Callable[[Any, Any], str]) -> None:
        """Collective: every rank raises unless all passed a value equal to rank 0's.

        The rank that differs raises ``ArgumentError(explain(mine, rank0s))``; the others
        raise ``CollectiveError`` naming it.
        """
        if self.size == 1:
            return
        v0 = self.bcast(value if self.rank == 0 else None)
        with self.agree(what):
            if value != v0:
                raise ArgumentError(explain(value, v0))

    def hostname(self) -> str:
        return socket.gethostname()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"allreduce op {op!r} is not one of {sorted(_OPS)}")


class SerialComm(Comm):
    """The communicator of a process that runs alone."""


class MPIComm(Comm):
    """A wrapper of an mpi4py communicator."""

    def __init__(self, mpi_comm: Any):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._calls = rankguard.sequence(mpi_comm) if self.size > 1 else None

    def begin(self, call: str) -> None:
        if self._calls is not None:
            self._calls.enter(call)

    @property
    def broken(self) -> str | None:
        return None if self._calls is None else self._calls.broken

    @property
    def calls_made(self) -> int:
        return 0 if self._calls is None else self._calls.count

    def out_of_step(self, where: list[tuple[int, str]]) -> CollectiveMismatchError:
        if self._calls is None:
            return super().out_of_step(where)
        return self._calls.out_of_step(where)

    def barrier(self) -> None:
        self.mpi.Barrier()

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.mpi.bcast(obj, root=root)

    def allgather(self, obj: Any) -> list:
        out: list = self.mpi.allgather(obj)
        return out

    def allreduce(self, value: Any, op: str = "sum") -> Any:
        _check_op(op)
        from mpi4py import MPI
        mop = getattr(MPI, op.upper())
        if isinstance(value, np.ndarray) and value.flags.c_contiguous and value.dtype.isnative:
            self.mpi.Allreduce(MPI.IN_PLACE, value, op=mop)
            return value
        return self.mpi.allreduce(value, op=mop)


class _Agreement:
    def __init__(self, comm: Comm, what: str):
        self.comm = comm
        self.what = what

    def __enter__(self) -> "_Agreement":
        return self

    def __exit__(self, etype: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if self.comm.size == 1:
            return False
        mine = None if exc is None else f"{type(exc).__name__}: {exc}"
        here = (self.comm.calls_made, self.what)
        got = self.comm.allgather((here, mine))
        if any(h != here for h, _ in got):
            raise self.comm.out_of_step([h for h, _ in got])
        failures = {r: m for r, (_, m) in enumerate(got) if m is not None}
        if not failures or exc is not None:
            return False
        raise CollectiveError(self.what, failures)


_world: list[Comm] = []
_world_lock = threading.Lock()
_explicit: Any = None           # what configure(comm=...) set (None: the default)


def _configured(changes: dict[str, Any], reset: bool) -> None:
    global _explicit
    _explicit = changes["comm"]     # None after configure(comm=None) and config.reset()


config.on_change(("comm",), _configured)


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process (its variables are set)."""
    return any(os.environ.get(v) for v in LAUNCHER_VARS)


def _mpi_initialised() -> bool:
    mod = sys.modules.get("mpi4py.MPI")
    return bool(mod is not None and mod.Is_initialized() and not mod.Is_finalized())


def wrap(c: Any) -> Comm:
    """A ``Comm`` for a ``Comm`` or an mpi4py communicator."""
    if isinstance(c, Comm):
        return c
    if hasattr(c, "Get_rank") and hasattr(c, "Get_size"):
        return MPIComm(c)
    raise TypeError(f"expected an mpi4py communicator or chemio_py Comm, got {type(c).__name__}")


def comm() -> Comm:
    """The communicator collective calls use (see module docstring)."""
    explicit = _explicit
    if explicit is not None:
        return wrap(explicit)
    with _world_lock:
        if _world:
            return _world[0]
        if launched_by_mpi() or _mpi_initialised():
            try:
                from mpi4py import MPI
            except ImportError:
                size = int(os.environ.get("PMI_SIZE")
                           or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
                if size > 1:
                    raise ChemIOError(
                        f"this process was started by an MPI launcher with {size} ranks, but "
                        f"mpi4py is not installed, so the ranks cannot cooperate; "
                        f"pip install 'chemio-py[mpi]' (mpi4py + mpich)") from None
                _world.append(SerialComm())
            else:
                _world.append(MPIComm(MPI.COMM_WORLD))
        else:
            _world.append(SerialComm())
        return _world[0]


def resolve(c: Any | None) -> Comm:
    """``c`` as a Comm, or the default communicator when ``c`` is None."""
    return comm() if c is None else wrap(c)
