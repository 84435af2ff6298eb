"""POSIX and Linux primitives the file backends build on.

Functions of paths, descriptors and buffers that hold no state of a store: opening a data
file safely (``open_checked``: no symbolic link, no FIFO, errors that say what to do) and
clearing the way for a new one; preallocating blocks without changing the size
(``fallocate`` with ``FALLOC_FL_KEEP_SIZE``); buffers and their byte views (``aligned_empty``
for O_DIRECT, flat views of strided arrays, the sieve buffer for skipped holes); page-cache
residency (``mincore``) and copies by the kernel (``process_vm_readv``/``writev``), which
stop short instead of raising SIGBUS when a mapped file shrank; the file-system type of a
descriptor (one ``fstatfs``); removal of directory trees relative to directory descriptors
(``clear_dir``: one ``unlinkat`` per file, never through a link).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import mmap
import operator
import os
import queue
import stat as _stat
import struct
import threading
import time
from typing import Any

import numpy as np

from chemio_py.errors import ArgumentError, OutOfSpaceError, StorageError
from chemio_py.scratch import fs, jobs

DIRECT_ALIGN = 4096             # O_DIRECT alignment of buffer address, offset and length
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)     # no room: OutOfSpaceError, not StorageError


def free_bytes(fd: int) -> int | None:
    """Bytes free to this user on the file system of ``fd`` (None if it cannot say)."""
    try:
        st = os.fstatvfs(fd)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def datasync(fd: int, path: str) -> None:
    """``fdatasync(fd)``: a full device or quota raises ``OutOfSpaceError`` (with the free
    bytes), any other failure ``StorageError``."""
    try:
        os.fdatasync(fd)
    except OSError as e:
        if e.errno in SPACE_ERRNOS:
            raise OutOfSpaceError(path, None, free_bytes(fd), what="flush") from e
        raise StorageError(e.errno, path, None, None, "flush") from e


# ---------------------------------------------------------------- opening data files

def open_checked(path: str, flags: int, mode: str, perms: int = 0o600) -> int:
    """``os.open`` of a data file with errors that say what to do.

    Never follows a final symbolic link and never blocks (a FIFO put where a data file
    should be): anything but a regular file is refused with a ``StorageError``.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, perms)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, f"directory {parent!r} does not exist; create "
                                    f"it first or pass another dir=", path) from None
        raise FileNotFoundError(errno.ENOENT, f"no such file (mode {mode!r} opens an existing "
                                f"file; use 'w+' to create it)", path) from None
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "file exists (mode 'x+' creates a new file; use "
                              "'r+' to open it or 'w+' to replace it)", path) from None
    except OSError as e:
        hint: dict[int | None, str]
        hint = {errno.EMFILE: "this process has too many open files: close files or raise "
                              "the limit (ulimit -n)",
                errno.ELOOP: "the path is a symbolic link, which scratch files never follow",
                errno.ENXIO: "the path is a FIFO, not a data file",
                errno.EACCES: "no permission: choose a scratch directory you can write"}
        raise StorageError(e.errno, path, None, None, "open", hint.get(e.errno, "")) from e
    try:
        require_regular(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def require_regular(fd: int, path: str) -> None:
    """Check that ``fd`` (opened ``O_NONBLOCK``) is a regular file and make it blocking;
    a FIFO, device or directory is a ``StorageError``."""
    if not _stat.S_ISREG(os.fstat(fd).st_mode):
        raise StorageError(errno.EINVAL, path, None, None, "open",
                           "it is not a regular file (a FIFO, device or directory?); "
                           "chemio's data files are regular files")
    os.set_blocking(fd, True)


def unlink_regular(path: str) -> None:
    """Remove an old file at ``path`` before it is created anew (not a directory, FIFO...)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not (_stat.S_ISREG(st.st_mode) or _stat.S_ISLNK(st.st_mode)):
        raise StorageError(errno.EEXIST, path, None, None, "create the array",
                           "something that is not a regular file is in the way; remove it "
                           "or choose another name")
    os.unlink(path)


# ---------------------------------------------------------------- preallocation

_libc: list[Any] = []
FALLOC_FL_KEEP_SIZE = 1


def fallocate_keep_size(fd: int, n: int) -> int:
    """fallocate(2) with FALLOC_FL_KEEP_SIZE (not in the os module); returns errno or 0."""
    if not _libc:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "fallocate", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
        _libc.append((fn, ctypes))
    fn, ctypes = _libc[0]
    if fn is None:
        return errno.ENOSYS
    return 0 if fn(fd, FALLOC_FL_KEEP_SIZE, 0, n) == 0 else ctypes.get_errno()


# ---------------------------------------------------------------- file systems

# f_type of fstatfs(2) (linux/magic.h) -> the name /proc/self/mounts gives the type
# (ext2, ext3 and ext4 share one magic number).
FS_MAGIC = {0xEF53: "ext4", 0x58465342: "xfs", 0x01021994: "tmpfs", 0x9123683E: "btrfs",
            0x6969: "nfs", 0x0BD00BD0: "lustre", 0x47504653: "gpfs", 0x2FC12FC1: "zfs",
            0x19830326: "beegfs", 0x00C36400: "ceph", 0xAAD7AAEA: "panfs",
            0x794C7630: "overlay", 0x65735546: "fuse", 0x858458F6: "ramfs",
            0xFF534D42: "cifs", 0xFE534D42: "smb2", 0xF2F52010: "f2fs"}
_fstatfs_fn: list[Any] = []


FLOCK = struct.Struct("@hhqqi4x")      # struct flock on 64-bit Linux


def ofd_lock(fd: int, kind: int, wait: bool = False, at: int = 0) -> bool:
    """An open-file-description lock (F_RDLCK / F_WRLCK / F_UNLCK) on byte ``at`` of
    ``fd``; False when another holder has it and ``wait`` is False. OSError otherwise
    (EINVAL: a kernel before 3.15, without such locks)."""
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, FLOCK.pack(kind, os.SEEK_SET, at, 1, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def wait_until(attempt: Any, timeout: float, cap: float = 0.01) -> bool:
    """Call ``attempt()`` until it returns True (then True), sleeping 0.1 ms, doubling up
    to ``cap`` seconds between calls, for at most ``timeout`` seconds (then False): the
    wait for a lock that another process might hold for ever."""
    if attempt():
        return True
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not attempt():
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, cap)
    return True


def fs_type(fd: int) -> str | None:
    """The type of the file system holding the open descriptor ``fd`` (``"ext4"``,
    ``"xfs"``, ``"tmpfs"``, ``"lustre"``..., ``"0x<magic>"`` for one not in ``FS_MAGIC``)
    from one ``fstatfs`` call: no path lookup, no mount table. None where ``fstatfs`` is
    not available through ctypes (the caller falls back to ``fs.fstype(path)``)."""
    if not _fstatfs_fn:
        fn = None
        try:
            if os.uname().sysname == "Linux" and ctypes.sizeof(ctypes.c_long) == 8:
                fn = ctypes.CDLL(None, use_errno=True).fstatfs
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
                fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _fstatfs_fn.append(fn)
    fn = _fstatfs_fn[0]
    if fn is None:
        return None
    buf = (ctypes.c_long * 32)()        # struct statfs: 120 bytes on 64-bit Linux, f_type first
    if fn(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    magic = buf[0] & 0xFFFFFFFF
    return FS_MAGIC.get(magic, f"0x{magic:x}")


# ---------------------------------------------------------------- removing directory trees
#
# Relative to open directory descriptors (``unlinkat``/``openat``): one system call per
# file, no stat per entry (getdents gives its type), never through a symbolic link (a link
# is removed itself, never followed), nothing outside the directory it starts from.

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_entry_at(dir_fd: int | None, name: str, where: str, failures: list) -> None:
    """Remove entry ``name`` of the open directory ``dir_fd`` (None: a path relative to
    the working directory; ``where``: the directory's path, for errors): a file or link
    with one ``unlinkat``, a real directory with all it holds, however deep, never through
    a link. An entry already gone is fine; every other failure is appended to ``failures``
    as ``(path, OSError)`` and the rest goes on (``fs.remove_entry_at``)."""
    fs.remove_entry_at(dir_fd, name, os.path.join(where, name), failures)


remove_dir_at = remove_entry_at     # a link or file found where a directory was goes itself


def clear_dir(fd: int, where: str, failures: list, keep: Any = None) -> None:
    """Remove every entry of the open directory ``fd`` (path ``where``), directories with
    all they hold, except names ``keep(name)`` is true for; failures as ``remove_entry_at``
    (``fs.clear_dir_at``: iterative, a bounded number of descriptors)."""
    fs.clear_dir_at(fd, where, failures, keep)


def removal_error(path: str, failures: list, what: str) -> StorageError:
    """The error of a removal of ``path`` that left ``failures`` (``(path, OSError)``):
    the errno and path of the first, how many there were."""
    p, err = failures[0]
    code = getattr(err, "errno", None) or errno.EIO
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    return StorageError(code, p, None, None, what,
                        f"{getattr(err, 'strerror', None) or err}{more}; the rest of "
                        f"{path!r} was removed, nothing outside it was touched")


# ---------------------------------------------------------------- buffers

HUGE_PAGE = 2 << 20             # a transparent huge page (x86-64 and aarch64 with 4 KiB pages)


def _buffer_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints, none negative, as NumPy takes it: a tuple,
    a list, a 1-d integer array) as a tuple of ints."""
    try:
        dims: tuple[int, ...] = (operator.index(shape),)
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise ArgumentError(f"aligned_empty() shape must be an int or a sequence of "
                                f"ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ArgumentError(f"aligned_empty() shape {dims} has a negative dimension; "
                            f"dimensions are element counts >= 0")
    return dims


def _buffer_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a NumPy dtype of plain values (no Python objects)."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ArgumentError(f"aligned_empty() dtype {dtype!r} is not a NumPy dtype: "
                            f"{e}") from None
    if dt.hasobject:
        raise ArgumentError(f"aligned_empty() dtype {dt} holds Python objects, which cannot "
                            f"live in raw I/O memory; use a numeric or bytes dtype")
    return dt


def aligned_empty(shape: Any, dtype: Any = np.uint8, align: int = DIRECT_ALIGN) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts on an ``align``-byte boundary.

    From ``HUGE_PAGE`` bytes on it is private anonymous memory that starts on a huge-page
    boundary, marked for transparent huge pages (``MADV_HUGEPAGE``), as NumPy marks its own
    large arrays: an O_DIRECT transfer then pins a few physically contiguous huge pages, and
    the device gets fewer, larger requests (8 MiB random writes on a virtio disk: requests
    of 4 MiB, its largest, instead of under 1 MiB, and about twice the throughput). Where the
    kernel gives no huge pages the memory is the same, in small pages. Smaller buffers are
    page-aligned private memory, or, under a page or for an alignment past one, an aligned
    slice of a NumPy array."""
    shape, dtype = _buffer_shape(shape), _buffer_dtype(dtype)
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align < 1 \
            or align & (align - 1):
        raise ArgumentError(f"aligned_empty() align must be a power of two (bytes), got "
                            f"{align!r}; O_DIRECT needs {DIRECT_ALIGN}")
    align = int(align)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if nbytes >= HUGE_PAGE and align <= HUGE_PAGE and private:
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=private)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError, ValueError):
            pass                        # no THP here: small pages, still correct
        raw = np.frombuffer(mm, dtype=np.uint8)
        start = (-raw.ctypes.data) % HUGE_PAGE
        raw = raw[start:start + nbytes]
    elif nbytes >= mmap.PAGESIZE and align <= mmap.PAGESIZE:
        mm = mmap.mmap(-1, nbytes, flags=private) if private else mmap.mmap(-1, nbytes)
        raw = np.frombuffer(mm, dtype=np.uint8)     # page-aligned, lazy zero
    else:
        raw = np.empty(nbytes + align, dtype=np.uint8)
        start = (-raw.ctypes.data) % align
        raw = raw[start:start + nbytes]
    return raw.view(dtype).reshape(shape)


def bytes_view(buf: Any, writable: bool) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if writable and mv.readonly:
        raise TypeError(f"read buffer must be writable, got a read-only {type(buf).__name__}")
    if not mv.c_contiguous:
        raise TypeError(f"buffer must be C-contiguous, got {type(buf).__name__} "
                        f"with strides {mv.strides}")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def buffer_address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0] if len(mv) else 0


def byte_span(a: np.ndarray, writable: bool) -> memoryview | None:
    """A flat byte view of the memory array ``a`` spans; None when its strides do not allow."""
    isz = a.itemsize
    if any(s < 0 or s % isz for n, s in zip(a.shape, a.strides) if n > 1):
        return None
    span = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) // isz + 1
    flat = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(isz,),
                                           writeable=writable and a.flags.writeable)
    # numpy's stubs make ndarray a Buffer for Python 3.12+ only
    return memoryview(flat.view(np.uint8))  # type: ignore[arg-type]


_sieve: list[memoryview] = []


def sieve_buffer(n: int) -> memoryview:
    """A scratch buffer that reads fill with the bytes of holes nobody asked for.

    One buffer for every thread: its content is never looked at."""
    if not n:
        return memoryview(b"")
    if not _sieve or len(_sieve[0]) < n:
        _sieve[:] = [memoryview(bytearray(n))]
    return _sieve[0]


# ---------------------------------------------------------------- page residency and kernel copies

mincore_fn: list[Any] = []
_pvm_fns: list[Any] = []
_IOV_MAX = 1024


def mincore_ok() -> bool:
    if not mincore_fn:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.mincore
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            mincore_fn.append(fn)
        except (OSError, AttributeError):
            mincore_fn.append(None)
    return mincore_fn[0] is not None


def mincore_pages(addr: int, length: int) -> np.ndarray | None:
    """Residency (one byte per page, bit 0 set = in the page cache) of a mapped range."""
    vec = np.zeros(-(-length // mmap.PAGESIZE), dtype=np.uint8)
    if mincore_fn[0](addr, length, vec.ctypes.data) != 0:
        return None
    return vec & 1


_SMALL_VEC = 64                         # pages of a residency check without NumPy
_small_vec = threading.local()          # .buf: this thread's vector for them


def resident(addr: int, ranges: list, pages: int) -> bool | None:
    """Whether every page of the mapped page ranges ``[(first, end), ...]`` (sorted,
    disjoint, ``pages`` in all; at least one) from ``addr`` is in the page cache; None when
    mincore fails."""
    fn, size = mincore_fn[0], mmap.PAGESIZE
    lo, hi = ranges[0][0], ranges[-1][1]
    if len(ranges) > 1 and hi - lo - pages <= 64 * (len(ranges) - 1):
        # Ranges close together: one call over all of them (a call costs about as much as
        # the kernel's look at 64 pages), then the pages between them left out.
        vec = np.empty(hi - lo, dtype=np.uint8)
        if fn(addr + lo * size, (hi - lo) * size, vec.ctypes.data) != 0:
            return None
        np.bitwise_and(vec, 1, out=vec)
        if vec.all():
            return True
        miss = np.concatenate(([0], np.cumsum(vec == 0)))
        r = np.array(ranges, dtype=np.int64) - lo
        return bool((miss[r[:, 1]] == miss[r[:, 0]]).all())
    if len(ranges) == 1:                # a small section: one call, no arrays
        if pages <= _SMALL_VEC:
            buf = getattr(_small_vec, "buf", None)
            if buf is None:
                buf = _small_vec.buf = (ctypes.c_ubyte * _SMALL_VEC)()
            if fn(addr + lo * size, pages * size, ctypes.addressof(buf)) != 0:
                return None
            return all(x & 1 for x in buf[:pages])
    vec = np.empty(pages, dtype=np.uint8)
    at = vec.ctypes.data
    for a, b in ranges:
        if fn(addr + a * size, (b - a) * size, at) != 0:
            return None
        at += b - a
    return bool((vec & 1).all())


def process_vm() -> tuple | None:
    """(process_vm_readv, process_vm_writev) from libc, or None where they are missing or
    forbidden (a seccomp filter)."""
    if not _pvm_fns:
        fns = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fns = (libc.process_vm_readv, libc.process_vm_writev)
            for fn in fns:
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                               ctypes.c_ulong, ctypes.c_ulong]
                fn.restype = ctypes.c_ssize_t
            probe = ctypes.create_string_buffer(8)
            iov = (ctypes.c_uint64 * 2)(ctypes.addressof(probe), 8)
            if fns[0](os.getpid(), iov, 1, iov, 1, 0) != 8:
                fns = None
        except (OSError, AttributeError):
            fns = None
        _pvm_fns.append(fns)
    return _pvm_fns[0]


def copy_runs(write: bool, file_addrs: np.ndarray, mem_addrs: np.ndarray,
               lens: np.ndarray) -> bool:
    """Copy runs between mapped file pages and memory by the kernel; True when every byte
    moved (False: a page could not be had, e.g. the file was truncated)."""
    fns = process_vm()
    assert fns is not None, "callers check process_vm() first"
    fn = fns[1 if write else 0]
    k = lens.size
    mem = np.empty((k, 2), dtype=np.uint64)
    mem[:, 0] = mem_addrs
    mem[:, 1] = lens
    fil = np.empty((k, 2), dtype=np.uint64)
    fil[:, 0] = file_addrs
    fil[:, 1] = lens
    pid = os.getpid()
    for i in range(0, k, _IOV_MAX):
        j = min(k, i + _IOV_MAX)
        want = int(lens[i:j].sum())
        if fn(pid, mem[i:j].ctypes.data, j - i, fil[i:j].ctypes.data, j - i, 0) != want:
            return False
    return True


# ---------------------------------------------------------------- SIGBUS guard for mapped reads
#
# A load from a shared file mapping past the end of a file that another process truncated
# raises SIGBUS, which kills the process. While a copy from a guarded range runs, the handler
# below puts anonymous zero pages from the faulting page on and marks the range poisoned: the
# copy finishes (with zeros there), the reader sees the mark and reads again with preadv,
# which reports the short file. A SIGBUS anywhere else goes to the handler that was there
# before (restored first, so the fault repeats under it: default action or faulthandler).

class Guarded:
    """An address range registered with the SIGBUS guard; ``poisoned`` once a page of it
    was replaced (its file shrank under a reader): its contents can no longer be trusted."""

    __slots__ = ("lo", "hi", "poisoned")

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi, self.poisoned = lo, hi, False


_SIGBUS = 7
_SA_SIGINFO = 4
_SI_ADDR_OFFSET = 16                    # siginfo_t: 3 ints, padding, then the fault address
_guard: dict[str, Any] = {}
_guarded: list[tuple[Guarded, ...]] = [()]


class _Sigaction(ctypes.Structure):
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16),
                ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]


def _on_sigbus(sig: int, info: int, ctx: int) -> None:
    addr = ctypes.c_void_p.from_address(info + _SI_ADDR_OFFSET).value or 0
    code = ctypes.c_int.from_address(info + 8).value
    if code > 0:                        # raised by the kernel for a memory access
        for g in _guarded[0]:
            if g.lo <= addr < g.hi:
                g.poisoned = True       # before the page is replaced: readers see it first
                _guard["caught"] = _guard.get("caught", 0) + 1
                page = addr - addr % mmap.PAGESIZE
                # zeros from here to the end of the range: one fault per copy, not per page
                got = _guard["mmap"](page, g.hi - page, mmap.PROT_READ,
                                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)
                if got == page:         # 0x10 = MAP_FIXED
                    return
                break
    _guard["sigaction"](_SIGBUS, ctypes.byref(_guard["old"]), None)


def sigbus_guard_ok() -> bool:
    """True where mapped copies can be guarded (Linux, 64-bit, libc through ctypes)."""
    if "ok" not in _guard:
        ok = False
        try:
            import platform
            if os.uname().sysname == "Linux" and ctypes.sizeof(ctypes.c_void_p) == 8 \
                    and platform.machine() in ("x86_64", "aarch64"):
                libc = ctypes.CDLL(None, use_errno=True)
                sa = libc.sigaction
                sa.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                sa.restype = ctypes.c_int
                mm = libc.mmap
                mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
                mm.restype = ctypes.c_void_p
                mu = libc.munmap
                mu.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                mu.restype = ctypes.c_int
                cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
                    _on_sigbus)
                _guard.update(sigaction=sa, mmap=mm, munmap=mu, cb=cb,
                              addr=ctypes.cast(cb, ctypes.c_void_p).value,
                              old=_Sigaction(), cur=_Sigaction())
                ok = True
        except (OSError, AttributeError, ValueError):
            ok = False
        _guard["ok"] = ok
    return bool(_guard["ok"])


def sigbus_guard_arm() -> bool:
    """Make sure the guard's handler is the process's SIGBUS handler (another library may
    have installed its own since; that one becomes the handler of foreign faults)."""
    cur = _guard["cur"]
    if _guard["sigaction"](_SIGBUS, None, ctypes.byref(cur)) != 0:
        return False
    if cur.handler == _guard["addr"]:
        return True
    new = _Sigaction()
    new.handler = _guard["addr"]
    new.flags = _SA_SIGINFO
    if _guard["sigaction"](_SIGBUS, ctypes.byref(new), ctypes.byref(_guard["old"])) != 0:
        return False
    return True


def sigbus_caught() -> int:
    """How many SIGBUS faults in guarded ranges this process survived."""
    return int(_guard.get("caught", 0))


def guard_register(lo: int, hi: int) -> Guarded:
    g = Guarded(lo, hi)
    _guarded[0] = _guarded[0] + (g,)
    return g


def guard_unregister(g: Guarded) -> None:
    _guarded[0] = tuple(x for x in _guarded[0] if x is not g)


def map_file(fd: int, nbytes: int) -> int | None:
    """A read-only shared mapping of the first ``nbytes`` of ``fd`` (its address), or None."""
    if not sigbus_guard_ok():
        return None
    addr = _guard["mmap"](None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    return int(addr)


def unmap(addr: int, nbytes: int) -> None:
    _guard["munmap"](addr, nbytes)


# ---------------------------------------------------------------- page tables of read mappings

_MADV_POPULATE_READ = 22        # Linux 5.14+: fill the page tables of a range, reading as needed


class PageTableFiller:
    """Fills the page tables of ranges of a read mapping in one background thread
    (``madvise(MADV_POPULATE_READ)``, which releases the GIL), while the caller goes on.

    The first copy from a fresh mapping pays one page fault per few pages, about 10 ms per
    128 MB here; a read that brings pages into the page cache with ``preadv`` hands each
    range over when it has read it, so the filling overlaps the rest of its I/O and a later
    copy from the mapping costs no faults (as a ``numpy.memmap`` is mapped by its first
    read). ``start()`` a batch, ``add`` its ranges, ``wait`` for it: ranges are done in
    order, so nothing queued before is left running when ``wait`` returns. Where the kernel
    lacks the advice, ``ok`` turns False.
    """

    def __init__(self) -> None:
        self.ok = True
        self._queue: Any = None
        self._pid = -1
        self._madvise: Any = None

    def start(self) -> Any:
        """A new batch (a ``threading.Event`` set when its ranges are done), or None."""
        if not self.ok:
            return None
        if self._pid != os.getpid():            # first use, or a forked child: no thread
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                self.ok = False
                return None
            self._madvise, self._queue, self._pid = fn, queue.SimpleQueue(), os.getpid()
            threading.Thread(target=self._run, args=(self._queue,), daemon=True,
                             name="chemio-io-pagetables").start()
        return threading.Event()

    def add(self, addr: int, nbytes: int) -> None:
        """Queue the pages of ``[addr, addr + nbytes)`` (rounded out to whole pages)."""
        lo = addr - addr % mmap.PAGESIZE
        self._queue.put((lo, -(-(addr + nbytes - lo) // mmap.PAGESIZE) * mmap.PAGESIZE, None))

    def wait(self, batch: Any) -> None:
        self._queue.put((0, 0, batch))
        batch.wait()

    def _run(self, q: Any) -> None:
        fn = self._madvise
        while True:
            addr, n, batch = q.get()
            if batch is not None:
                batch.set()
            elif self.ok and fn(addr, n, _MADV_POPULATE_READ) != 0 \
                    and ctypes.get_errno() == errno.EINVAL:
                self.ok = False                 # a kernel before 5.14


page_tables = PageTableFiller()


class ScratchPlaces:
    """The ``Backend`` methods of a backend whose objects are plain files or directories in
    the job's scratch (``local``, ``mpiio``, ``zarr``): where they go, whether one is
    there, the file system's space, and removal of a file or a whole directory tree."""

    def root(self, scope: str, rank: int = 0) -> str:
        return jobs.shared_root() if scope == "shared" else jobs.private_root(rank)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def stat(self, path: str) -> fs.FsInfo:
        return fs.stat(path)

    def remove(self, path: str) -> bool:
        """Delete the file (or directory tree) at ``path``; False when it did not exist."""
        return jobs.remove_path(path)
