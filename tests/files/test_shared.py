"""Shared Files in one process, on every backend, against bytearray / NumPy models.

The multi-process behaviour (the ChemIO/GA test, collective failures, node-local scratch)
is in tests/files/test_shared_mpi.py.
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.scratch import fs, jobs
from chemio_py.errors import (ArgumentError, ChemIOError, EndOfFileError, InvalidNameError,
                              LimitExceededError, OutOfSpaceError)
from chemio_py.files.shared import GROW_STEP

MiB = 1 << 20


def shared_path(store, name):
    """Where a shared file of this name lives (rank 0's job dir under the shared root)."""
    root = backends.resolve(store).root("shared")
    return os.path.join(jobs.job_dir(root), name + ".sf")


def allocated(path):
    return os.stat(path).st_blocks * 512


def can_preallocate(path):
    return fs.fstype(path) in ("ext4", "xfs", "btrfs", "tmpfs", "f2fs", "ocfs2", "gpfs")


def test_fresh_file_is_empty_and_holes_read_zero(store):
    sf = cio.SharedFile("holes", backend=store)
    try:
        assert sf.size == 0
        assert sf.path == shared_path(store, "holes")
        sf.write(4096, np.arange(1, 9, dtype=np.float64))
        assert sf.size == 4096 + 64
        out = sf.read(0, np.full(512 + 8, -1.0))
        np.testing.assert_array_equal(out[:512], 0.0)
        np.testing.assert_array_equal(out[512:], np.arange(1, 9))
    finally:
        sf.destroy()
    assert not os.path.exists(sf.path)


def test_read_past_end_raises_blocking_and_async(store):
    with cio.SharedFile("eof", backend=store) as sf:
        sf.write(0, b"0123456789")
        assert sf.read_bytes(6, 4) == b"6789"
        with pytest.raises(EndOfFileError, match="size 10 bytes") as ei:
            sf.read(8, bytearray(3))
        assert (ei.value.offset, ei.value.nbytes, ei.value.size) == (8, 3, 10)
        req = sf.aread(11, bytearray(1))
        with pytest.raises(EndOfFileError):
            req.wait()
        assert sf.size == 10


def test_hard_limit_holds_and_writes_nothing(store):
    with cio.SharedFile("hard", hard_limit=1000, backend=store) as sf:
        sf.write(0, b"a" * 600)
        with pytest.raises(LimitExceededError, match="hard limit of 1000 bytes") as ei:
            sf.write(500, b"b" * 501)
        assert "nothing was written" in str(ei.value)
        with pytest.raises(LimitExceededError):
            sf.awrite(990, np.zeros(2))            # refused before any request is made
        assert sf.outstanding == 0
        assert sf.size == 600
        assert sf.read_bytes(0, 600) == b"a" * 600
        sf.write(600, b"c" * 400)                   # ending exactly at the limit is fine
        assert sf.size == 1000
        with pytest.raises(LimitExceededError):
            sf.truncate(1001)
        with pytest.raises(LimitExceededError):
            sf.write(1000, b"x")
        assert sf.size == 1000
        assert sf.read_bytes(0, 1000) == b"a" * 600 + b"c" * 400


def test_recreating_a_destroyed_name_starts_empty(store):
    sf = cio.SharedFile("again", backend=store)
    sf.write(0, np.ones(100))
    sf.destroy()
    sf.destroy()                                    # idempotent
    assert not os.path.exists(sf.path)
    with pytest.raises(ChemIOError, match="closed"):
        sf.read(0, np.empty(1))
    with cio.SharedFile("again", backend=store) as sf2:
        assert sf2.size == 0
        with pytest.raises(EndOfFileError):
            sf2.read(0, np.empty(1))


def test_stale_file_is_replaced_and_old_handle_cannot_remove_new(store):
    path = shared_path(store, "stale")
    with open(path, "wb") as fh:                    # left over by an earlier run
        fh.write(b"old data " * 100)
    first = cio.SharedFile("stale", backend=store)
    assert first.size == 0
    first.write(0, b"first")
    second = cio.SharedFile("stale", backend=store)  # replaces the file of `first`
    assert second.size == 0
    with pytest.raises(cio.ChemIOError, match="replaced it"):
        first.read_bytes(0, 5)                      # the old handle is closed, and says why
    first.destroy()
    assert os.path.exists(second.path)
    second.write(0, b"second")
    assert second.read_bytes(0, 6) == b"second"
    second.destroy()
    assert not os.path.exists(path)


def test_async_requests_and_waitall(store):
    blocks = [np.full(8192, float(i)) for i in range(6)]
    with cio.SharedFile("async", backend=store, request_size=8192 * 8) as sf:
        reqs = [sf.awrite(i * 8192 * 8, b) for i, b in enumerate(blocks)]
        assert cio.waitall(reqs) == [8192 * 8] * 6
        sf.flush()
        outs = [np.empty(8192) for _ in blocks]
        got = cio.waitall([sf.aread(i * 8192 * 8, o) for i, o in enumerate(outs)])
        for g, o, b in zip(got, outs, blocks):
            assert g is o
            np.testing.assert_array_equal(o, b)


def test_soft_limit_preallocates_rounded_to_requests(store):
    with cio.SharedFile("soft", soft_limit=3 * MiB + 1, request_size=MiB, backend=store) as sf:
        assert sf.size == 0                         # preallocation keeps the size
        assert sf.reserved == 4 * MiB               # whole requests
        if can_preallocate(sf.path):
            assert allocated(sf.path) >= 4 * MiB
        with pytest.raises(EndOfFileError):
            sf.read(0, bytearray(1))                # reserved is not written
        sf.write(5 * MiB, b"z")                     # past the soft limit: grows ahead
        assert sf.reserved == -(-(5 * MiB + 1) // GROW_STEP) * GROW_STEP
        assert sf.size == 5 * MiB + 1
        assert sf.read_bytes(0, 16) == bytes(16)


def test_request_size_grows_reservation_in_whole_requests_capped_by_hard_limit(store):
    req = 3 * MiB
    step = -(-GROW_STEP // req) * req
    with cio.SharedFile("grow", request_size=req, hard_limit=2 * step, backend=store) as sf:
        assert sf.reserved == 0
        sf.write(10, b"x")
        assert sf.reserved == step
        sf.write(step + 7, b"y")                    # next step would pass the hard limit
        assert sf.reserved == 2 * step
        if can_preallocate(sf.path):
            assert allocated(sf.path) >= 2 * step
        assert sf.size == step + 8
    with cio.SharedFile("plain", backend=store) as sf:   # no hints: a plain sparse file
        sf.write(64 * MiB, b"q")
        assert sf.reserved == 0
        if store == "local":                      # (shm backs every page it extends over)
            assert allocated(sf.path) < MiB


def test_soft_limit_beyond_free_space_fails_up_front(store):
    free = fs.stat(shared_path(store, "huge")).free
    with pytest.raises(OutOfSpaceError, match="soft_limit of shared file 'huge'") as ei:
        cio.SharedFile("huge", soft_limit=free + (1 << 40), backend=store)
    assert ei.value.needed == free + (1 << 40)
    assert not os.path.exists(shared_path(store, "huge"))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"name": "../x"}, InvalidNameError, "invalid scratch name"),
    ({"name": "a/b"}, InvalidNameError, "invalid scratch name"),
    ({"hard_limit": -1}, ArgumentError, "hard_limit must be >= 0"),
    ({"soft_limit": 1.5}, ArgumentError, "soft_limit must be an integer"),
    ({"request_size": 0}, ArgumentError, "request_size must be >= 1"),
    ({"soft_limit": 10, "hard_limit": 5}, ArgumentError, "larger than hard_limit"),
])
def test_bad_arguments_create_nothing(store, kwargs, error, match):
    kwargs = {"name": "bad", **kwargs}
    name = kwargs.pop("name")
    job = jobs.job_dir(backends.resolve(store).root("shared"))
    before = set(os.listdir(job))
    with pytest.raises(error, match=match):
        cio.SharedFile(name, backend=store, **kwargs)
    assert set(os.listdir(job)) == before


def test_rank0_removes_the_file_at_cleanup(store):
    sf = cio.SharedFile("atexit", backend=store)
    sf.write(0, b"data")
    path = sf.path
    jobs.cleanup()                               # what runs at exit
    assert sf.closed
    assert not os.path.exists(path)


def test_size_and_data_seen_through_a_second_handle(store):
    """Two handles on the same shared file (two "ranks" of one process) see each other."""
    with cio.SharedFile("two", backend=store) as sf:
        other = backends.resolve(store).open_bytes(sf.path, "r+")
        try:
            other.pwrite(100, b"from the other one")
            assert sf.size == 118
            assert sf.read_bytes(100, 18) == b"from the other one"
            sf.write(200, b"!")
            assert other.size() == 201
        finally:
            other.close()


# ------------------------------------------------------------------ property test

_ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 3000), st.binary(min_size=0, max_size=300)),
    st.tuples(st.just("awrite"), st.integers(0, 3000), st.binary(min_size=1, max_size=300)),
    st.tuples(st.just("read"), st.integers(0, 3400), st.integers(0, 300)),
    st.tuples(st.just("aread"), st.integers(0, 3400), st.integers(1, 300)),
    st.tuples(st.just("truncate"), st.integers(0, 3400), st.none()),
    st.tuples(st.just("flush"), st.none(), st.none()),
), max_size=25)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops, hard=st.one_of(st.none(), st.integers(0, 3200)),
       soft=st.one_of(st.none(), st.integers(0, 2000)),
       req=st.one_of(st.none(), st.integers(1, 5000)))
def test_random_sequences_match_bytearray_model(store, ops, hard, soft, req):
    if soft is not None and hard is not None and soft > hard:
        soft = hard
    model = bytearray()
    pending = []                                  # (request, lo, hi) of unfinished awrites

    def settle():
        cio.waitall([r for r, _, _ in pending])
        pending.clear()

    def put(off, data):
        if not data:
            return                                # an empty write extends nothing (POSIX)
        if len(model) < off + len(data):
            model.extend(bytes(off + len(data) - len(model)))
        model[off:off + len(data)] = data

    sf = cio.SharedFile("prop", hard_limit=hard, soft_limit=soft, request_size=req,
                        backend=store)
    try:
        for op, a, b in ops:
            if op in ("write", "awrite"):
                if hard is not None and a + len(b) > hard:
                    with pytest.raises(LimitExceededError):
                        (sf.write if op == "write" else sf.awrite)(a, b)
                    continue
                if op == "write":
                    settle()
                    assert sf.write(a, b) == len(b)
                else:
                    if any(lo < a + len(b) and a < hi for _, lo, hi in pending):
                        settle()                  # overlapping writes: the app orders them
                    pending.append((sf.awrite(a, b), a, a + len(b)))
                put(a, b)
            elif op in ("read", "aread"):
                settle()
                out = bytearray(b)
                if a + b > len(model):
                    with pytest.raises(EndOfFileError):
                        if op == "read":
                            sf.read(a, out)
                        else:
                            sf.aread(a, out).wait()
                else:
                    (sf.read(a, out) if op == "read" else sf.aread(a, out).wait())
                    assert out == model[a:a + b]
            elif op == "truncate":
                settle()
                if hard is not None and a > hard:
                    with pytest.raises(LimitExceededError):
                        sf.truncate(a)
                    continue
                sf.truncate(a)
                del model[a:]
                model.extend(bytes(a - len(model)))
            else:
                sf.flush()
                pending.clear()                   # flush waits for every request
            if not pending:
                assert sf.size == len(model)
        settle()
        assert sf.size == len(model)
        assert sf.read_bytes(0, len(model)) == bytes(model)
    finally:
        sf.destroy()
