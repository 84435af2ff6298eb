"""Keeping the ranks of an MPI job in step, so that a rank that leaves never hangs the rest.

* **Call sequence.** Every collective call of the user layer starts with ``Comm.begin(call)``.
  Under MPI the ranks compare the call's name and its number on the communicator in one
  nonblocking allreduce (O(log P), constant memory). A rank in another call, or one whose
  interpreter is exiting, makes *every* rank raise ``CollectiveMismatchError`` naming who is
  where; the communicator then refuses further chemio collectives at once (no waiting), and
  ``close()`` of its objects releases local resources only.
* **Watchdog.** With ``collective_timeout`` (``CHEMIO_COLLECTIVE_TIMEOUT``) set, a rank that
  waited that long for the others raises ``CollectiveTimeoutError``; rank 0 takes a roll call
  (point-to-point, O(1) per rank, O(P) on rank 0) to name the ranks that never arrived.
* **Uncaught errors.** Once chemio runs on an MPI communicator of more than one rank, an
  uncaught exception on one rank prints its traceback and aborts the job at interpreter exit
  (as ``python -m mpi4py`` does), unless ``abort_on_error`` is off.
* **Leaving.** At interpreter exit each communicator chemio used enters one more call,
  "interpreter exit": ranks still waiting in a chemio collective learn that this rank left
  (and raise), instead of waiting for ever. A normal end of the job matches everywhere.

State lives with the MPI communicator (an attribute of it), so every wrapper of one
communicator shares one sequence; freeing the communicator drops it.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import zlib
from typing import Any

import numpy as np

from chemio_py.runtime import config
from chemio_py.errors import CollectiveMismatchError, CollectiveTimeoutError

EXIT_CALL = "interpreter exit"
_ROLL_TAG = 0x6C10                      # point-to-point tags of the roll call
_VERDICT_TAG = 0x6C11
SPIN_SECONDS = 0.005                    # a wait polls without sleeping this long first,
MAX_PAUSE = 0.001                       # then sleeps at most this long between polls
_SHOWN_GROUPS = 6                       # calls listed in a mismatch message
_SHOWN_RANKS = 12                       # rank ranges listed per call

_lock = threading.Lock()
_keyval: Any = None
_live: dict[int, "CallSequence"] = {}   # id -> sequence, in order of first use
_hooks_installed = False


def _mpi() -> Any:
    from mpi4py import MPI
    return MPI


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0–2, 5"`` (at most ``_SHOWN_RANKS`` ranges)."""
    runs: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [f"{a}" if a == b else f"{a}–{b}" for a, b in runs[:_SHOWN_RANKS]]
    if len(runs) > _SHOWN_RANKS:
        parts.append(f"... ({len(ranks)} ranks in all)")
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _in(call: str, seq: int) -> str:
    return "has left (its interpreter is exiting)" if call == EXIT_CALL else \
        f"is in {call} (collective call #{seq})"


def mismatch_message(where: list[tuple[int, str]]) -> tuple[str, dict]:
    """The message for ranks found in different calls: ``where[rank] = (seq, call)``."""
    groups: dict[tuple[int, str], list[int]] = {}
    for rank, key in enumerate(where):
        groups.setdefault((int(key[0]), str(key[1])), []).append(rank)
    order = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    parts = []
    for (seq, call), ranks in order[:_SHOWN_GROUPS]:
        verb = _in(call, seq)
        if len(ranks) > 1:
            verb = verb.replace("is in", "are in").replace("has left", "have left")
        parts.append(f"{ranks_text(ranks)} {verb}")
    if len(order) > _SHOWN_GROUPS:
        parts.append(f"and {len(order) - _SHOWN_GROUPS} more groups")
    head = parts[0] + " while " + "; ".join(parts[1:]) if len(parts) > 1 else parts[0]
    return (f"ranks are out of step: {head}. Every rank must make the same chemio collective "
            f"calls in the same order (a rank that catches an error must not skip the "
            f"collective calls the others make); the communicator is unusable for chemio "
            f"collectives from here on"), groups


class CallSequence:
    """The chemio collective calls made on one MPI communicator."""

    def __init__(self, mpi_comm: Any):
        self.mpi = mpi_comm
        self.count = 0
        self.broken: str | None = None          # why no further call may be made
        self.abandoned: list[Any] = []          # MPI requests left pending by a failure
        self.lock = threading.Lock()

    # -------------------------------------------------------------- one call
    def enter(self, call: str, give_up: float | None = None) -> bool:
        """Start collective call ``call``; raise on every rank if the ranks are not in step.
        With ``give_up`` (seconds), return False instead of waiting longer (and leave the
        communicator unusable); else True."""
        if self.broken is not None:
            raise CollectiveMismatchError(
                f"{call}: not attempted, an earlier chemio collective on this communicator "
                f"failed ({self.broken})", {})
        with self.lock:
            self.count += 1
            seq = self.count
        key = zlib.crc32(call.encode("utf-8", "replace"))
        header = np.array([seq, key, -seq, -key], dtype=np.int64)
        MPI = _mpi()
        req = self.mpi.Iallreduce(MPI.IN_PLACE, header, op=MPI.MIN)
        if not self._wait(req, call, seq, give_up):
            return False
        if header[0] == -header[2] and header[1] == -header[3]:
            return True
        raise self.out_of_step(self.mpi.allgather((seq, call)))

    def out_of_step(self, where: list[tuple[int, str]]) -> CollectiveMismatchError:
        """Mark the communicator broken; the error naming who is where."""
        message, groups = mismatch_message(where)
        self.broken = message
        return CollectiveMismatchError(message, groups)

    def _wait(self, req: Any, call: str, seq: int, give_up: float | None = None) -> bool:
        """Wait for ``req``, polling (so signal handlers run) and honouring the timeout;
        False when ``give_up`` seconds passed first."""
        start = time.monotonic()
        pause = 0.0
        timeout: float | None = None
        try:
            while not req.Test():
                waited = time.monotonic() - start
                if waited < SPIN_SECONDS:       # MPI progresses only inside MPI calls;
                    os.sched_yield()            # a core shared by ranks goes to the others
                    continue
                if pause == 0.0:                # a long wait: now the setting matters
                    timeout = config.get("collective_timeout")
                if give_up is not None and waited > give_up:
                    self.abandoned.append(req)
                    self.broken = f"rank {self.mpi.Get_rank()} stopped waiting in {call}"
                    return False
                if timeout is not None and waited > timeout:
                    self._timed_out(req, call, seq, timeout)
                pause = min(MAX_PAUSE, pause * 2 or 2e-5)
                time.sleep(pause)
            return True
        except BaseException as e:
            if not isinstance(e, CollectiveTimeoutError):
                self.abandoned.append(req)
                self.broken = (f"{type(e).__name__} while rank {self.mpi.Get_rank()} waited "
                               f"for the others in {call} (collective call #{seq})")
            raise

    def _timed_out(self, req: Any, call: str, seq: int, timeout: float) -> None:
        self.abandoned.append(req)
        missing = self._roll_call(call, seq, timeout)
        me = self.mpi.Get_rank()
        if missing is None:
            who = ("rank 0 did not answer the roll call, so it may be one of them (it names "
                   "the missing ranks when it is present)")
        elif missing:
            who = f"{ranks_text(missing)} never arrived"
        else:
            who = "every rank arrived late, after the roll call started"
        message = (f"rank {me} waited {timeout:g} s (collective_timeout) in {call} "
                   f"(collective call #{seq}): {who}. They may have left, hung, or be making "
                   f"another call; the communicator is unusable for chemio collectives")
        self.broken = message
        raise CollectiveTimeoutError(message, missing)

    def _roll_call(self, call: str, seq: int, timeout: float) -> list[int] | None:
        """Rank 0 collects who is waiting and tells them who is missing; None if unknown."""
        MPI = _mpi()
        me, size = self.mpi.Get_rank(), self.mpi.Get_size()
        grace = min(max(1.0, timeout / 10), 10.0)
        if me != 0:
            self.abandoned.append(self.mpi.isend((seq, call), dest=0, tag=_ROLL_TAG))
            verdict = self.mpi.irecv(source=0, tag=_VERDICT_TAG)
            deadline = time.monotonic() + timeout + grace
            while time.monotonic() < deadline:
                done, missing = verdict.test()
                if done:
                    return list(missing)
                time.sleep(0.01)
            self.abandoned.append(verdict)
            return None
        present = {0}
        status = MPI.Status()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            while self.mpi.iprobe(source=MPI.ANY_SOURCE, tag=_ROLL_TAG, status=status):
                src = status.Get_source()
                self.mpi.recv(source=src, tag=_ROLL_TAG)
                present.add(src)
            time.sleep(0.01)
        missing = sorted(set(range(size)) - present)
        for r in sorted(present - {0}):
            self.abandoned.append(self.mpi.isend(missing, dest=r, tag=_VERDICT_TAG))
        return missing

    # -------------------------------------------------------------- leaving
    def leave(self, give_up: float | None = None) -> str | None:
        """At interpreter exit: the "interpreter exit" call. None when every rank is leaving
        too (or ``give_up`` seconds passed); else the mismatch message (the others raise
        it)."""
        if self.broken is not None or self.count == 0:
            return None
        try:
            self.enter(EXIT_CALL, give_up)
        except CollectiveMismatchError as e:
            return str(e)
        return None


def sequence(mpi_comm: Any) -> CallSequence:
    """The call sequence of an mpi4py communicator (made on first use)."""
    global _keyval
    with _lock:
        MPI = _mpi()
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval(delete_fn=_dropped)
        seq = mpi_comm.Get_attr(_keyval)
        if seq is None:
            seq = CallSequence(mpi_comm)
            mpi_comm.Set_attr(_keyval, seq)
            _live[id(seq)] = seq
        _install_hooks()
        return seq


def _dropped(comm: Any, keyval: Any, seq: Any) -> None:
    _live.pop(id(seq), None)


# ------------------------------------------------------------------ the whole job
def _install_hooks() -> None:
    """Once per process: the uncaught-exception hook and the exit agreement."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def excepthook(etype: Any, value: Any, tb: Any) -> None:
        previous(etype, value, tb)
        abort_job_on_exit(value)

    sys.excepthook = excepthook
    atexit.register(_leave_all)


def _abort_wanted() -> bool:
    try:
        return bool(config.get("abort_on_error"))
    except Exception:
        return True


def _world() -> Any:
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return MPI


_abort_status = 0


def abort_job_on_exit(exc: BaseException | None) -> None:
    """After an uncaught ``exc``: arrange for ``MPI_Abort`` of the whole job at exit (the
    other ranks would otherwise wait for this one in their next collective)."""
    MPI = _world()
    if MPI is None or MPI.COMM_WORLD.Get_size() == 1 or not _abort_wanted():
        return
    status = 130 if isinstance(exc, KeyboardInterrupt) else 1
    if isinstance(exc, SystemExit):
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if status == 0:
            return
    sys.stderr.write(f"chemio_py: rank {MPI.COMM_WORLD.Get_rank()} of "
                     f"{MPI.COMM_WORLD.Get_size()} ended with an uncaught "
                     f"{type(exc).__name__}; aborting the MPI job so that the other ranks do "
                     f"not wait for it (CHEMIO_ABORT_ON_ERROR=0 turns this off)\n")
    sys.stderr.flush()
    _abort_after_exit(MPI, status)


ABORT_NOTICE_WAIT = 3.0                 # seconds an aborting rank lets the others learn why


def _leave_all() -> None:
    """atexit: enter "interpreter exit" on every communicator chemio used, so that ranks
    waiting in a collective learn that this one left (they raise, clean up and end the job);
    abort the job when one was waiting, or a wait was abandoned. A rank that is aborting
    anyway waits at most ``ABORT_NOTICE_WAIT`` seconds for the others."""
    MPI = _world()
    if MPI is None:
        return
    abandoned = False
    for seq in list(_live.values()):
        if seq.abandoned:
            abandoned = True
            continue
        if seq.mpi == MPI.COMM_NULL:
            continue
        try:
            message = seq.leave(ABORT_NOTICE_WAIT if _abort_status else None)
        except Exception as e:  # noqa: BLE001 - reported, and the job is ended below
            message = f"{type(e).__name__}: {e}"
        if message is not None:
            sys.stderr.write(f"chemio_py: rank {MPI.COMM_WORLD.Get_rank()} is leaving while "
                             f"other ranks wait in a collective call: {message}\n")
            sys.stderr.flush()
            abandoned = True
    if abandoned and not _abort_status and _abort_wanted():
        time.sleep(1.0)                 # let the others report why they stop
        _abort_after_exit(MPI, 1)


def _abort_after_exit(MPI: Any, status: int) -> None:
    """``MPI_Abort(status)`` once the interpreter's exit handlers (scratch cleanup) ran."""
    global _abort_status
    _abort_status = status
    set_status = getattr(MPI, "_set_abort_status", None)
    if set_status is not None:
        set_status(status)              # mpi4py aborts instead of finalizing, at the very end
    else:                               # pragma: no cover - mpi4py < 4
        MPI.COMM_WORLD.Abort(status)
