"""BLAS threads beside the I/O threads: ``free_cores``, ``blas_threads_beside_io``.

On a node where another process holds a core, a threaded BLAS that starts one thread per
core spins against that process and against the read-ahead's I/O threads: a loop of
small GEMMs slowed 20x on two cores with one busy. ``blas_threads_beside_io()`` limits the
BLAS (and OpenMP) thread pools for the duration of a ``with`` block to the cores that are
free, less the ones the I/O threads keep busy::

    with cio.blas_threads_beside_io(io_threads=0.5) as n:   # n threads while inside
        for sec, blk in d.iter_blocks(axis=0, size=64):
            acc += blk @ blk.T

* ``free_cores()``: the cores of this process's CPU set (``os.sched_getaffinity``, capped
  by a cgroup ``cpu.max`` quota) that other processes left idle, from ``/proc/stat``
  sampled over a short interval, less this process's own CPU time: our own threads do not
  count as busy. The 1-minute load average reacts too slowly to be of use here.
* ``cpu_share()``: ``cpu_set()`` over the ranks of the job on this node (from the
  launcher's environment): what one rank may keep busy on a packed node.
* ``blas_threads(io_threads, free)``: ``max(1, round(free - io_threads))``.
* The pools are set with ``threadpoolctl`` (imported on first use; ``import chemio_py``
  stays light) and restored on leaving the block. Without ``/proc/stat`` the CPU set
  counts as free.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Iterator, Sequence

from chemio_py.errors import ArgumentError

DEFAULT_INTERVAL = 0.05          # seconds of /proc/stat sampling (5 ticks per core at 100 Hz)
_APIS = ("blas", "openmp")


def cpu_set() -> float:
    """The cores this process may run on: its affinity set, capped by a cgroup v2 quota."""
    try:
        n: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            n = min(n, max(1.0, int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return n


# Ranks of this job on this node, as the launchers say: MPICH/hydra, Open MPI, MVAPICH, Slurm.
_LOCAL_RANKS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                "SLURM_NTASKS_PER_NODE")


def ranks_on_node() -> int:
    """How many ranks of this job share the node (1 outside a launcher that says)."""
    for var in _LOCAL_RANKS:
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return 1


def cpu_share() -> float:
    """This process's share of its CPU set: ``cpu_set()`` over the ranks on the node (the
    cores one rank may keep busy without taking another rank's)."""
    return cpu_set() / ranks_on_node()


def _cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


class CpuSample:
    """One reading of the busy time of this process's CPUs and of its own CPU time.

    ``free_cores(since=sample)`` measures over the time since ``sample`` was taken, so a
    caller can take one at the start of other work and pay no sampling delay later.
    """

    __slots__ = ("wall", "own", "busy")

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.own = time.process_time()
        self.busy = _busy_seconds(_cpus())


def _busy_seconds(cpus: set[int] | None) -> float | None:
    """Seconds the CPUs ``cpus`` (all when None) were not idle since boot, or None."""
    try:
        with open("/proc/stat") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    seen = False
    for ln in lines:
        if not ln.startswith("cpu") or ln.startswith("cpu "):
            continue
        name, *fields = ln.split()
        try:
            cpu = int(name[3:])
            ticks = [int(x) for x in fields[:8]]
        except ValueError:
            continue
        if cpus is not None and cpu not in cpus:
            continue
        # user nice system idle iowait irq softirq steal: idle and iowait are free time;
        # steal (another guest ran on the host core) counts as taken
        busy += sum(ticks) - ticks[3] - ticks[4]
        seen = True
    return busy / hz if seen else None


def free_cores(interval: float = DEFAULT_INTERVAL, *, since: CpuSample | None = None) -> float:
    """Cores of this process's CPU set that other processes leave idle (a float >= 0).

    Measured from ``/proc/stat`` over ``interval`` seconds (sleeping that long), or over the
    time since ``since`` when that is at least ``interval`` (no sleep); this process's own
    CPU time is not counted as busy. Without ``/proc/stat``: ``cpu_set()``.
    """
    if not (isinstance(interval, (int, float)) and math.isfinite(interval) and interval > 0):
        raise ArgumentError(f"interval must be a number of seconds > 0, got {interval!r}; "
                            f"nothing was measured")
    start = since if since is not None else CpuSample()
    wait = interval - (time.perf_counter() - start.wall)
    if wait > 0:
        time.sleep(wait)
    end = CpuSample()
    total = cpu_set()
    if start.busy is None or end.busy is None:
        return float(total)
    wall = max(end.wall - start.wall, 1e-9)
    others = ((end.busy - start.busy) - (end.own - start.own)) / wall
    return float(min(total, max(0.0, total - max(0.0, others))))


def blas_threads(io_threads: float = 1.0, free: float | None = None) -> int:
    """BLAS threads for compute beside I/O: ``max(1, round(free - io_threads))``.

    ``io_threads``: the cores the I/O threads keep busy (a fraction when they mostly wait);
    ``free``: ``free_cores()`` when not given.
    """
    io = _check_cores("io_threads", io_threads)
    f = free_cores() if free is None else _check_cores("free", free)
    return max(1, int(math.floor(f - io + 0.5)))


def _check_cores(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ArgumentError(f"{what} must be a number of cores >= 0, got {value!r}; no "
                            f"thread count was changed")
    return float(value)


@contextlib.contextmanager
def blas_threads_beside_io(io_threads: float = 1.0, *, threads: int | None = None,
                           since: CpuSample | None = None,
                           apis: Sequence[str] = _APIS) -> Iterator[int]:
    """Limit the BLAS and OpenMP thread pools to the cores free beside the I/O threads.

    Inside the block the pools of ``apis`` (threadpoolctl ``user_api`` names: ``"blas"``,
    ``"openmp"``) run ``threads`` threads, by default ``blas_threads(io_threads)`` measured
    now (or since the ``CpuSample`` ``since``); the block gets that number. Leaving it
    restores the previous counts. Pools loaded inside the block are not limited.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ArgumentError(f"threads must be an integer >= 1, got {threads!r}; no thread "
                            f"count was changed")
    bad = [a for a in apis if a not in _APIS]
    if bad or isinstance(apis, str):
        raise ArgumentError(f"apis must be a sequence of {_APIS}, got {apis!r}; no thread "
                            f"count was changed")
    n = threads if threads is not None else blas_threads(
        io_threads, free_cores(since=since) if since is not None else None)
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    with contextlib.ExitStack() as stack:
        for api in apis:
            stack.enter_context(threadpool_limits(limits=n, user_api=api))
        yield n
