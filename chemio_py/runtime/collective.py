"""The one protocol by which every rank makes (or opens) a collective object together.

SharedFile and ``DiskArray.create`` subclass ``Creation`` and fill in its steps;
``DiskArray.open`` uses the smaller ``Collective``. ``Creation.run()`` is, on every rank,
in this order (each *agreed* step runs inside ``comm.agree``, so a failure on one rank
raises on every rank: the failed rank its own error, the others ``CollectiveError``)::

    comm.begin(call)                    one chemio collective call (the rank guard's count)
    check()         every rank, agreed  checks the arguments; returns their spec
    same_everywhere(spec)               ArgumentError(explain(mine, rank 0's)) where they differ
    vet(comm)       every rank, agreed  only with more than one rank, when check() set vet
                                        (a backend's CollectiveCheck: shm needs one node)
    make()          rank 0, agreed      names the object, supersedes this process's old
                                        creator of it, makes it (unless ``together``), writes
                                        what peers need to find it; returns what they need
    bcast                               rank 0's ``made`` and host name (``host0``)
    join(made)      ranks > 0, agreed   supersede, prove they see rank 0's object
                                        (NotSharedError otherwise), open it (unless together)
    open_together(made)  every rank     a collective backend makes and opens it at once
    adopt(made)     rank 0, agreed      ... and rank 0 then records it (owns, reserves)
    finish(made)    every rank, agreed  when ``finishing(made)`` (drop a token, open CRCs)

Failure: when any step raises on any rank, every rank calls the undo actions it registered
(``on_failure``, newest first: close what it opened, remove what it made, then give back
the creation of the path, ``handles.abandon``) and re-raises; an undo that fails does not
stop the others or hide the first error. After ``run()`` the caller builds its handle with
``claim()``, which records it as the creator of the path (``handles.claim``).
"""
from __future__ import annotations

import socket
from typing import Any, Callable, Literal, TypeVar

from chemio_py.runtime import handles
from chemio_py.runtime.comm import Comm

_T = TypeVar("_T", bound=handles.Supersedable)


class Collective:
    """One collective call that may leave things behind: ``comm.begin(call)`` at once;
    agreed steps named ``what``; on an exception inside ``with``, this rank's undo actions."""

    def __init__(self, comm: Comm, call: str, what: str):
        self.comm = comm
        self.what = what
        self._undo: list[Callable[[], Any]] = []
        comm.begin(call)

    def agreed(self, fn: Callable[[], Any], on: str = "all") -> Any:
        """``fn()`` inside ``comm.agree`` on every rank (``on="all"``), on rank 0 only
        (``"root"``) or on the others (``"peers"``); its result there, else None."""
        c = self.comm
        with c.agree(self.what):
            if on == "all" or (on == "root") == (c.rank == 0):
                return fn()
        return None

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        return self.comm.bcast(value if self.comm.rank == 0 else None) \
            if self.comm.size > 1 else value

    def on_failure(self, undo: Callable[[], Any]) -> None:
        """Have this rank call ``undo()`` if the call fails (the newest first)."""
        self._undo.append(undo)

    def supersede(self, path: str, what: str) -> None:
        """``handles.supersede(path, what)``, given back (``abandon``) on failure."""
        handles.supersede(path, what)
        self.on_failure(lambda: handles.abandon(path))

    def __enter__(self) -> "Collective":
        return self

    def __exit__(self, etype: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        undo, self._undo = self._undo, []
        if exc is not None:
            for fn in reversed(undo):
                try:
                    fn()
                except Exception:       # the caller sees the error that started the undo
                    pass
        return False


class Creation(Collective):
    """The steps of ``run()`` (see the module docstring); subclasses override them."""

    together = False        # a collective backend: make and open on every rank at once
    host0 = ""              # rank 0's host name, for the peers' error messages
    vet: Callable[[Comm, str], None] | None = None
    """The backend's check of the communicator (its CollectiveCheck), set by ``check``."""

    def check(self) -> Any:
        """Every rank: check the arguments; return what must equal rank 0's."""
        raise NotImplementedError

    def explain(self, mine: Any, first: Any) -> str:
        """The error of a rank whose spec ``mine`` differs from rank 0's ``first``."""
        raise NotImplementedError

    def make(self) -> Any:
        """Rank 0: make the object; return what the other ranks need to open it."""
        raise NotImplementedError

    def join(self, made: Any) -> None:
        """Every rank but 0: prove it sees ``made`` and open it (unless ``together``)."""
        raise NotImplementedError

    def open_together(self, made: Any) -> None:
        """Every rank at once, for a collective backend: make and open it."""
        raise NotImplementedError

    def adopt(self, made: Any) -> None:
        """Rank 0, after ``open_together``: record what it made."""

    def finishing(self, made: Any) -> bool:
        """Whether ``finish`` has work (on any rank)."""
        return False

    def finish(self, made: Any) -> None:
        """Every rank, agreed, last: what comes after every rank opened."""

    def run(self) -> Any:
        """The protocol; rank 0's ``made`` on every rank."""
        c = self.comm
        with self:
            spec = self.agreed(self.check)
            c.same_everywhere(spec, self.what, self.explain)
            vet = self.vet if c.size > 1 else None
            if vet is not None:
                self.agreed(lambda: vet(c, self.what))
            made = self.agreed(self.make, on="root")
            if c.size > 1:
                made, self.host0 = self.share((made, socket.gethostname()))
                self.agreed(lambda: self.join(made), on="peers")
            if self.together:
                self.open_together(made)
                self.agreed(lambda: self.adopt(made), on="root")
            if self.finishing(made):
                self.agreed(lambda: self.finish(made))
        return made

    @staticmethod
    def claim(path: str, build: Callable[[], _T],
              cleanup: Callable[[], Any] | None = None) -> _T:
        """``build()`` the handle and record it as this process's creator of ``path``; if
        that fails, give the creation back and ``cleanup()`` (this rank only: the others
        hold their handles)."""
        try:
            obj = build()
        except BaseException:
            handles.abandon(path)
            if cleanup is not None:
                cleanup()
            raise
        handles.claim(path, obj)
        return obj
