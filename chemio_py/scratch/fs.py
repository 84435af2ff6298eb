"""File systems under scratch: type (``fstype``), free space (``stat``, ``check_space``)
and removing trees without recursion (a bounded stack of directory descriptors, every
entry reached with ``O_NOFOLLOW`` from its parent's descriptor).
"""
from __future__ import annotations

import errno
import os
import stat as _stat
from dataclasses import dataclass
from typing import Any

from chemio_py.errors import OutOfSpaceError

# ---------------------------------------------------------------- space and file systems

@dataclass(frozen=True)
class FsInfo:
    """Free and total bytes of the file system holding ``path`` and its type."""
    path: str
    free: int
    total: int
    fstype: str


def existing_ancestor(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def fstype(path: str) -> str:
    """The file-system type of ``path`` from the mount table (ext4, xfs, tmpfs, nfs, lustre…)."""
    p = os.path.realpath(existing_ancestor(path))
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def stat(path: str) -> FsInfo:
    """``FsInfo(path, free, total, fstype)`` for the file system holding ``path``."""
    p = existing_ancestor(path)
    st = os.statvfs(p)
    return FsInfo(os.path.abspath(path), st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize,
                  fstype(p))


def check_space(path: str, needed: int, what: str = "reserve", free: int | None = None) -> None:
    """Raise ``OutOfSpaceError`` up front when ``needed`` bytes do not fit where ``path`` lives."""
    if needed <= 0:
        return
    if free is None:                    # one statvfs: no mount-table scan, no realpath
        st = os.statvfs(existing_ancestor(path))
        free = st.f_bavail * st.f_frsize
    if needed > free:
        raise OutOfSpaceError(path, needed, free, what=what)


def printable(text: str) -> str:
    """``text`` as is when printable, else its repr (names found on disk may hold anything)."""
    return text if text.isprintable() else repr(text)


# ---------------------------------------------------------------- removing trees
#
# Relative to open directory descriptors (``unlinkat``/``openat``), never through a symbolic
# link (a link is removed itself), iteratively: a hostile tree thousands of levels deep
# costs neither recursion nor one descriptor per level (at most ``MAX_OPEN_DIRS``; a level
# whose descriptor was closed is reopened through ``..`` of its child and checked to be the
# same directory, so nothing outside the tree is ever touched).

MAX_OPEN_DIRS = 32
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Level:
    """One directory on the way down: its descriptor (-1 while closed), identity, name in
    its parent, the subdirectories still to remove, and how many failures there were when
    it was entered. (No path: a tree 100,000 levels deep would make them quadratic.)"""
    __slots__ = ("fd", "dev", "ino", "name", "subdirs", "failed_before")

    def __init__(self, fd: int, name: str, failed_before: int):
        st = os.fstat(fd)
        self.fd, self.dev, self.ino = fd, st.st_dev, st.st_ino
        self.name, self.failed_before = name, failed_before
        self.subdirs: list[str] = []


def _path_of(where: str, stack: list, *more: str) -> str:
    """The path of the directory on top of ``stack`` (``more`` names below it), for a
    message."""
    return os.path.join(where, *(level.name for level in stack[1:]), *more)


def _empty_files(where: str, stack: list, failures: list, keep: Any = None) -> None:
    """Unlink every non-directory of the directory on top of ``stack`` (except names
    ``keep`` is true for) and note its subdirectories in its ``subdirs``."""
    level = stack[-1]
    try:
        with os.scandir(level.fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    except OSError as e:
        failures.append((_path_of(where, stack), e))
        return
    for name, is_dir in entries:
        if keep is not None and keep(name):
            continue
        if is_dir:
            level.subdirs.append(name)
            continue
        try:
            os.unlink(name, dir_fd=level.fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:               # replaced by a directory meanwhile
            level.subdirs.append(name)
        except OSError as e:
            failures.append((_path_of(where, stack, name), e))


def clear_dir_at(fd: int, where: str, failures: list, keep: Any = None) -> None:
    """Remove everything in the open directory ``fd`` (path ``where``, for messages),
    except the names in it that ``keep(name)`` is true for, however deep (see above).

    Entries that vanish meanwhile are fine; every other failure is appended to
    ``failures`` as ``(path, OSError)`` and the rest goes on (a directory is left when
    something in it could not be removed). ``fd`` stays open and is the caller's.
    """
    stack = [_Level(fd, "", len(failures))]
    _empty_files(where, stack, failures, keep)
    lowest_open = 1                 # stack[1:lowest_open] have their descriptors closed
    try:
        while True:
            top = stack[-1]
            if top.subdirs:
                name = top.subdirs.pop()
                try:
                    cfd = os.open(name, DIR_FLAGS, dir_fd=top.fd)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):    # now a link or a file
                        remove_entry_at(top.fd, name, _path_of(where, stack, name), failures)
                    else:
                        failures.append((_path_of(where, stack, name), e))
                    continue
                try:
                    stack.append(_Level(cfd, name, len(failures)))
                except OSError as e:
                    os.close(cfd)
                    failures.append((_path_of(where, stack, name), e))
                    continue
                if len(stack) - lowest_open > MAX_OPEN_DIRS:
                    os.close(stack[lowest_open].fd)
                    stack[lowest_open].fd = -1
                    lowest_open += 1
                _empty_files(where, stack, failures)
                continue
            if len(stack) == 1:
                return
            parent = stack[-2]
            if parent.fd < 0:
                if not _reopen_parent(where, stack, failures):
                    return                  # the tree moved under us: stop, touch nothing
                lowest_open -= 1
            stack.pop()
            os.close(top.fd)
            top.fd = -1
            if len(failures) > top.failed_before:
                continue                    # it cannot be empty: the failures say why
            try:
                os.rmdir(top.name, dir_fd=parent.fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                failures.append((_path_of(where, stack, top.name), e))
    finally:
        for level in stack[1:]:
            if level.fd >= 0:
                os.close(level.fd)
                level.fd = -1


def _reopen_parent(where: str, stack: list, failures: list) -> bool:
    """Open the parent of the top of ``stack`` again, as ``..`` of the top; False (and a
    failure) unless it is still the very directory it was."""
    child, parent = stack[-1], stack[-2]
    try:
        fd = os.open("..", DIR_FLAGS, dir_fd=child.fd)
    except OSError as e:
        failures.append((_path_of(where, stack[:-1]), e))
        return False
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (parent.dev, parent.ino):
        os.close(fd)
        failures.append((_path_of(where, stack), OSError(
            errno.ESTALE, "was moved out of the tree while it was being removed")))
        return False
    parent.fd = fd
    return True


def remove_entry_at(dir_fd: int | None, name: str, path: str, failures: list) -> None:
    """Remove entry ``name`` of ``dir_fd``: a file or link, or a directory with all it holds."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:
        pass
    except PermissionError as e:            # POSIX allows EPERM for a directory
        try:
            is_dir = _stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode)
        except OSError:
            is_dir = False
        if not is_dir:
            failures.append((path, e))
            return
    except OSError as e:
        failures.append((path, e))
        return
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        failures.append((path, e))
        return
    before = len(failures)
    try:
        clear_dir_at(fd, path, failures)
    finally:
        os.close(fd)
    if len(failures) == before:
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            failures.append((path, e))
