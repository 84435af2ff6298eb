"""The one collective-creation protocol (``chemio_py.runtime.collective``): the order of its
steps on rank 0 and on the others, what a rank undoes when any rank fails, and that
SharedFile and DiskArray creations leave nothing behind when a step fails.

The two-rank cases run one rank in-process against a fake communicator that plays the
other rank's part in every broadcast and agreement.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.arrays import meta
from chemio_py.errors import CollectiveError
from chemio_py.runtime import handles
from chemio_py.runtime.collective import Collective, Creation
from chemio_py.runtime.comm import Comm, SerialComm


class PeerComm(Comm):
    """Rank 1 of 2: the broadcasts return rank 0's ``values`` in turn; in an agreement, rank 0
    fails with ``fail0`` at the agreement numbered ``fail_at`` (counting from 0)."""

    rank, size = 1, 2

    def __init__(self, *values, fail_at=None, fail0="ValueError: rank 0 broke"):
        self.values, self.fail_at, self.fail0 = list(values), fail_at, fail0
        self.agreements = 0
        self.begun = []

    def begin(self, call):
        self.begun.append(call)

    def bcast(self, obj, root=0):
        return self.values.pop(0)

    def allgather(self, obj):
        here, _ = obj
        first = (here, self.fail0 if self.agreements == self.fail_at else None)
        self.agreements += 1
        return [first, obj]


SPEC = ("x", 1)


class Recorder(Creation):
    """A creation that logs its steps and registers an undo action in each."""

    def __init__(self, comm, *, together=False, fail=None, finishing=True):
        super().__init__(comm, "Thing('x')", "Thing('x') creation")
        self.together, self.fail, self.fin = together, fail, finishing
        self.log, self.undone = [], []

    def _step(self, name, *args):
        self.log.append((name, *args))
        self.on_failure(lambda: self.undone.append(name))
        if self.fail == name:
            raise OSError(f"{name} failed")

    def check(self):
        self._step("check")
        return SPEC

    def explain(self, mine, first):
        return f"mine {mine} first {first}"

    def make(self):
        self._step("make")
        return "/made/x"

    def join(self, made):
        self._step("join", made, self.host0)

    def open_together(self, made):
        self._step("open_together", made)

    def adopt(self, made):
        self._step("adopt", made)

    def finishing(self, made):
        return self.fin

    def finish(self, made):
        self._step("finish", made)


def names(rec):
    return [entry[0] for entry in rec.log]


def test_rank0_checks_makes_and_finishes_in_one_collective_call():
    rec = Recorder(SerialComm())
    assert rec.run() == "/made/x"
    assert names(rec) == ["check", "make", "finish"] and rec.undone == []


def test_a_collective_backend_opens_together_then_rank0_adopts():
    rec = Recorder(SerialComm(), together=True, finishing=False)
    rec.run()
    assert names(rec) == ["check", "make", "open_together", "adopt"]


def test_a_peer_joins_what_rank0_made_and_learns_its_host():
    c = PeerComm(SPEC, ("/made/x", "host-of-0"))
    rec = Recorder(c)
    assert rec.run() == "/made/x"
    assert c.begun == ["Thing('x')"]                      # one chemio collective call
    assert rec.log == [("check",), ("join", "/made/x", "host-of-0"), ("finish", "/made/x")]
    # agreements: check, same_everywhere, make (rank 0), join, finish
    assert c.agreements == 5


def test_a_peer_that_fails_undoes_what_it_did_newest_first_and_raises_its_own_error():
    rec = Recorder(PeerComm(SPEC, ("/made/x", "h")), fail="finish")
    with pytest.raises(OSError, match="finish failed"):
        rec.run()
    assert rec.undone == ["finish", "join", "check"]


def test_when_rank0_fails_the_peer_raises_collective_error_and_undoes_its_part():
    c = PeerComm(SPEC, ("/made/x", "h"), fail_at=2)       # rank 0's make
    rec = Recorder(c)
    with pytest.raises(CollectiveError, match="rank 0 broke"):
        rec.run()
    assert names(rec) == ["check"] and rec.undone == ["check"]


def test_an_undo_that_fails_neither_stops_the_others_nor_hides_the_error():
    done = []
    with pytest.raises(KeyError, match="first"):
        with Collective(SerialComm(), "c", "c") as op:
            op.on_failure(lambda: done.append("a"))
            op.on_failure(lambda: 1 / 0)
            op.on_failure(lambda: done.append("c"))
            raise KeyError("first")
    assert done == ["c", "a"]


def test_success_forgets_the_undo_actions():
    done = []
    with Collective(SerialComm(), "c", "c") as op:
        op.on_failure(lambda: done.append("undone"))
    assert done == []


def test_supersede_is_given_back_on_failure_so_the_name_can_be_created_again(tmp_path):
    path = str(tmp_path / "thing")
    with pytest.raises(OSError):
        with Collective(SerialComm(), "c", "c") as op:
            op.supersede(path, "Thing('thing')")
            raise OSError("no")
    assert _another_thread_can_create(path)


def _another_thread_can_create(path):
    """Whether another thread gets the creation of ``path`` (it waits while one holds it)."""
    def create():
        handles.supersede(path, "Thing('thing')")
        handles.abandon(path)
    t = threading.Thread(target=create, daemon=True)
    t.start()
    t.join(5)
    return not t.is_alive()


def test_claim_gives_the_creation_back_and_cleans_up_when_building_fails(tmp_path):
    path, cleaned = str(tmp_path / "thing"), []
    handles.supersede(path, "Thing('thing')")

    def build():
        raise MemoryError("no room")
    with pytest.raises(MemoryError):
        Creation.claim(path, build, lambda: cleaned.append(path))
    assert cleaned == [path] and _another_thread_can_create(path)


def test_a_diskarray_whose_metadata_cannot_be_written_leaves_nothing(monkeypatch, tmp_path):
    def broken(*a, **k):
        raise OSError("disk on fire")
    monkeypatch.setattr(meta, "write_atomic", broken)
    with pytest.raises(OSError, match="disk on fire"):
        cio.DiskArray.create("burnt", (4, 4), "f8", backend="local", path=str(tmp_path))
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    d = cio.DiskArray.create("burnt", (4, 4), "f8", backend="local", path=str(tmp_path))
    d[:] = np.ones((4, 4))
    d.delete()


def test_a_shared_file_rank0_cannot_record_leaves_nothing(monkeypatch, store):
    from chemio_py.scratch import jobs
    real, made = jobs.own, []

    def refuse(path, *a, **k):
        if path.endswith(".sf"):
            made.append(path)
            raise OSError("cannot own it")
        return real(path, *a, **k)
    monkeypatch.setattr(jobs, "own", refuse)
    with pytest.raises(OSError, match="cannot own it"):
        cio.SharedFile("unowned", backend=store, soft_limit=4096)
    assert made and not os.path.exists(made[0])
    monkeypatch.undo()
    sf = cio.SharedFile("unowned", backend=store, soft_limit=4096)
    assert sf.size == 0 and sf.store is not None and sf.reserved == 4096
    sf.destroy()
    assert sf.store is None and not os.path.exists(sf.path)
