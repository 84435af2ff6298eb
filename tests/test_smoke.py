import numpy as np
import chemio_py as cio


def test_roundtrip(store):
    with cio.ExclusiveFile("smoke", "w+", backend=store) as f:
        f.write(0, np.arange(10.0))
        assert np.array_equal(f.read(0, np.empty(10)), np.arange(10.0))


def test_mpi(mpirun):
    p = mpirun(2, """
        import chemio_py as cio
        c = cio.comm()
        print("rank", c.rank, c.size)
    """)
    assert "rank 1 2" in p.stdout
