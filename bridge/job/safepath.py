"""File access under a task's `root/` that never follows a symbolic link.

After the first executor ran, everything under `root/` is controlled by the task: an executor
can replace `/outputs/out.txt` by a link to `/etc/shadow` (a link that the host, not the
container, would resolve). Every access to `root/` made after that point on the host (stdio
redirections, stage-out, the poller reading output excerpts) walks the path one component at a
time with `O_NOFOLLOW` relative to the parent's descriptor, so a link anywhere on the way is an
error instead of an escape.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A path under root/ is a symbolic link, a special file, or otherwise not acceptable."""


def _check_name(name: str) -> str:
    if not name or name in {".", ".."} or "/" in name or "\0" in name:
        raise UnsafePathError(errno.EINVAL, f"invalid path component {name!r}")
    return name


def open_dir(root: Path, parts: Sequence[str], *, create: bool = False, mode: int = 0o755) -> int:
    """Open the directory `root/parts...` without following links; returns a descriptor.

    `root` itself is trusted (it comes from the configuration). With `create`, missing
    components are created with `mode`.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts:
            _check_name(name)
            try:
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                # Created meanwhile, or a link: the open below decides.
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, mode, dir_fd=fd)
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(
                        exc.errno, f"{name!r} is a symbolic link or not a directory"
                    ) from exc
                raise
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def dir_fd(root: Path, parts: Sequence[str], *, create: bool = False) -> Iterator[int]:
    fd = open_dir(root, parts, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def lstat_kind(root: Path, parts: Sequence[str]) -> str | None:
    """`file`, `dir`, `link`, `other`, or None when absent (or a parent is not a plain dir)."""
    if not parts:
        return "dir"
    try:
        with dir_fd(root, parts[:-1]) as parent:
            st = os.stat(_check_name(parts[-1]), dir_fd=parent, follow_symlinks=False)
    except (FileNotFoundError, UnsafePathError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        return "link"
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISREG(st.st_mode):
        return "file"
    return "other"


def open_regular(parent_fd: int, name: str) -> int:
    """Open an existing regular file for reading relative to `parent_fd`, refusing links."""
    # O_NONBLOCK: opening a FIFO planted by an executor must not hang the job or the poller.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(_check_name(name), flags, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(exc.errno, f"{name!r} is a symbolic link") from exc
        raise
    return _regular_and_blocking(fd, name)


def _regular_and_blocking(fd: int, name: str) -> int:
    """Keep `fd` only if it is a regular file, back in blocking mode; close it otherwise."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(errno.EINVAL, f"{name!r} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_read(root: Path, parts: Sequence[str]) -> int:
    """Open `root/parts...` (a regular file) for reading; no link is followed on the way."""
    if not parts:
        raise UnsafePathError(errno.EISDIR, "the root is not a file")
    with dir_fd(root, parts[:-1]) as parent:
        return open_regular(parent, parts[-1])


def open_write(root: Path, parts: Sequence[str], *, mode: int = 0o644, append: bool = False) -> int:
    """Create or truncate `root/parts...` for writing; parents are created, links refused."""
    if not parts:
        raise UnsafePathError(errno.EISDIR, "the root is not a file")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_APPEND if append else os.O_TRUNC
    with dir_fd(root, parts[:-1], create=True) as parent:
        name = _check_name(parts[-1])
        try:
            fd = os.open(name, flags, mode, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(exc.errno, f"{name!r} is a symbolic link") from exc
            if exc.errno == errno.ENXIO:
                raise UnsafePathError(exc.errno, f"{name!r} is a FIFO") from exc
            raise
    return _regular_and_blocking(fd, name)


def _tail_fd(fd: int, tail_bytes: int) -> bytes:
    if tail_bytes <= 0:
        return b""
    size = os.fstat(fd).st_size
    os.lseek(fd, max(0, size - tail_bytes), os.SEEK_SET)
    chunks = []
    remaining = tail_bytes
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)[-tail_bytes:]


def open_read_path(path: Path) -> int:
    """Open a trusted path (records/) for reading, still refusing a link at the last component
    and anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    return _regular_and_blocking(fd, str(path))


def read_tail_path(path: Path, tail_bytes: int) -> bytes:
    """The tail of a trusted path (records/), still refusing a link at the last component."""
    fd = open_read_path(path)
    try:
        return _tail_fd(fd, tail_bytes)
    finally:
        os.close(fd)
