"""aread_many / awrite_many: many transfers in one request, checked against a bytearray model,
on every backend (the pool path) and through grouped Linux AIO for aligned O_DIRECT data."""
import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime.trace import trace_events
from chemio_py.errors import ArgumentError
from chemio_py.backends.local import linux_aio


def _model_apply(model: bytearray, offsets, bufs) -> None:
    for off, b in zip(offsets, bufs):
        raw = bytes(memoryview(b).cast("B"))
        end = off + len(raw)
        if end > len(model):
            model.extend(bytes(end - len(model)))
        model[off:end] = raw


def test_mixed_sizes_round_trip_against_model(store):
    rng = np.random.default_rng(3)
    sizes, offsets = [], []
    for _ in range(2):                # disjoint within a call, overlapping across the two
        part = rng.integers(1, 20000, 20)
        starts = np.cumsum(part + rng.integers(0, 5000, 20)) - part
        order = rng.permutation(20)
        sizes += part[order].tolist()
        offsets += starts[order].tolist()
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    model = bytearray()
    with cio.ExclusiveFile("many", "w+", backend=store) as f:
        for part in (slice(0, 20), slice(20, 40)):
            want = sum(sizes[part])
            assert f.awrite_many(offsets[part], bufs[part]).wait() == want
            _model_apply(model, offsets[part], bufs[part])
        assert f.size == len(model)
        outs = [bytearray(n) for n in sizes]
        req = f.aread_many(offsets, outs)
        assert req.wait() is outs
        for off, n, out in zip(offsets, sizes, outs):
            assert bytes(out) == bytes(model[off:off + n])
        assert f.stats.writes == 40 and f.stats.bytes_written == sum(sizes)
        f.delete()


def test_rows_of_an_array_are_the_buffers(store):
    k = 50
    data = np.arange(k * 128, dtype=np.uint32).reshape(k, 128)     # rows of 512 bytes
    offsets = (np.random.default_rng(5).permutation(200)[:k] * data[0].nbytes)
    with cio.ExclusiveFile("rows", "w+", backend=store) as f:
        f.awrite_many(offsets, data).wait()
        out = np.zeros_like(data)
        assert f.aread_many(offsets, out).wait() is out
        np.testing.assert_array_equal(out, data)
        one = np.empty(128, dtype=np.uint32)
        f.read(int(offsets[7]), one)
        np.testing.assert_array_equal(one, data[7])
        f.delete()


def test_strided_write_buffers_are_copied_first(store):
    src = np.arange(16.0)
    with cio.ExclusiveFile("strided", "w+", backend=store) as f:
        assert f.awrite_many([0, 64], [src[::2], src.reshape(4, 4).T]).wait() == 192
        out = [np.empty(8), np.empty((4, 4))]
        f.aread_many([0, 64], out).wait()
        np.testing.assert_array_equal(out[0], src[::2])
        np.testing.assert_array_equal(out[1], src.reshape(4, 4).T)
        f.delete()


def test_empty_calls_complete_at_once(store):
    with cio.ExclusiveFile("empty", "w+", backend=store) as f:
        r = f.awrite_many([], [])
        assert r.done() and r.wait() == 0
        bufs: list = []
        assert f.aread_many([], bufs).wait() is bufs
        assert f.size == 0
        f.delete()


def test_read_past_end_fails_the_request_after_all_finished(store):
    with cio.ExclusiveFile("eof", "w+", backend=store) as f:
        f.write(0, bytes(range(200)) * 50)                # 10,000 bytes
        outs = [bytearray(100), bytearray(100), bytearray(100)]
        req = f.aread_many([0, 9_950, 100], outs)
        with pytest.raises(cio.EndOfFileError):
            req.wait()
        assert bytes(outs[0]) == bytes(range(100))       # the others were still done
        assert bytes(outs[2]) == bytes(range(100, 200))
        f.delete()


@pytest.mark.parametrize("offsets, bufs, what", [
    ([0, 1], [b"ab"], "2 offsets for 1 buffers"),
    ([-1], [b"ab"], ">= 0"),
    ([0.5], [b"ab"], "integer offsets"),
    ([[0]], [b"ab"], "1-D sequence"),
    ([0], [3], "sequence of buffers"),
    ([0], 7, "sequence of buffers"),
])
def test_bad_write_arguments_write_nothing(store, offsets, bufs, what):
    with cio.ExclusiveFile("badw", "w+", backend=store) as f:
        with pytest.raises(ArgumentError, match=what):
            f.awrite_many(offsets, bufs)
        assert f.size == 0 and f.outstanding == 0
        f.delete()


def test_bad_read_arguments(store):
    with cio.ExclusiveFile("badr", "w+", backend=store) as f:
        f.write(0, bytes(100))
        with pytest.raises(ArgumentError, match="writable"):
            f.aread_many([0], [b"read-only bytes"])
        ro = np.zeros((2, 8), np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ArgumentError, match="writable"):
            f.aread_many([0, 8], ro)
        strided = np.zeros(16)
        with pytest.raises(ArgumentError, match="strided"):   # it would fill a copy
            f.aread_many([0], [strided[::2]])
        assert not strided.any() and f.outstanding == 0
        f.close()
        with cio.ExclusiveFile("badr", "r", backend=store) as g:
            with pytest.raises(cio.ModeError):
                g.awrite_many([0], [b"x"])
            g.delete()


def test_shared_file_limit_checked_before_any_byte_moves(store):
    with cio.SharedFile("manylim", hard_limit=1000, backend=store) as sf:
        with pytest.raises(cio.LimitExceededError):
            sf.awrite_many([0, 990], [b"a" * 10, b"b" * 20])
        assert sf.size == 0
        sf.awrite_many([0, 990], [b"a" * 10, b"b" * 10]).wait()
        assert sf.read_bytes(990, 10) == b"b" * 10
        sf.destroy()


@pytest.mark.skipif(linux_aio.engine() is None, reason="no Linux AIO on this kernel/arch")
def test_aligned_direct_groups_go_to_linux_aio(tmp_path):
    trace = tmp_path / "t.json"
    cio.configure(trace=str(trace))
    try:
        k, size = 100, 4096                     # more than one group block (32)
        data = cio.aligned_empty((k, size))
        data[...] = (np.arange(k) % 251)[:, None]
        offsets = np.random.default_rng(1).permutation(4 * k)[:k] * size
        with cio.ExclusiveFile("grp", "w+", dir=str(tmp_path), direct=True) as f:
            if f.store._dfd is None:
                pytest.skip("this file system refuses O_DIRECT")
            assert f.awrite_many(offsets, data).wait() == k * size
            f.store.evict()
            # more calls at once than the engine has blocks: the rest take the pool
            outs = [cio.aligned_empty((k, size)) for _ in range(12)]
            reqs = [f.aread_many(offsets, o) for o in outs]
            cio.waitall(reqs)
            for o in outs:
                np.testing.assert_array_equal(o, data)
            late = cio.aligned_empty((2, size))
            with pytest.raises(cio.EndOfFileError):
                f.aread_many([int(offsets.min()), int(offsets.max()) + size], late).wait()
            np.testing.assert_array_equal(late[0], data[int(np.argmin(offsets))])
            st = f.stats.as_dict()
            f.delete()
        assert st["writes"] == k and st["reads"] == 12 * k + 2
        aio = [e for e in trace_events() if e["tid"] == "chemio-aio"]
        assert [e["args"]["bytes"] for e in aio if e["name"] == "write"] == [k * size]
        assert len([e for e in aio if e["name"] == "read"]) >= 1
        assert linux_aio.engine().in_flight == 0
    finally:
        cio.configure(trace=None)


def test_sync_mode_runs_groups_in_the_caller(tmp_path):
    cio.configure(sync=True)
    try:
        with cio.ExclusiveFile("gsync", "w+", dir=str(tmp_path)) as f:
            r = f.awrite_many([0, 4096], [b"x" * 10, b"y" * 10])
            assert r.done() and r.wait() == 20
            outs = [bytearray(10), bytearray(10)]
            assert f.aread_many([0, 4096], outs).done()
            assert outs == [bytearray(b"x" * 10), bytearray(b"y" * 10)]
            f.delete()
    finally:
        cio.configure(sync=None)
