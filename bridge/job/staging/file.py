"""`file://` URLs and bare absolute paths on a filesystem shared with the compute nodes.

Only paths inside `storage.allowed_dirs` may be read or written, judged after resolving
links, so a link inside an allowed directory cannot lead outside it. What a URL names is
`bridge.core.naming.local_path`'s to say, for the server and the job side alike: the path taken
literally (no percent-decoding), as Funnel and the usual TES clients do (`file:///a b` is the
file `/a b`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
import tempfile
from pathlib import Path

from bridge.core.naming import FileUrlError, local_path
from bridge.job.staging import FileKind, StagingContext, StagingError

FILE_MODE = 0o644
DIR_MODE = 0o755


def url_path(url: str) -> str:
    """The host path of a `file:` URL or bare path (see `bridge.core.naming.local_path`)."""
    try:
        return local_path(url)
    except FileUrlError as exc:
        raise StagingError(str(exc)) from None


def allowed_path(url: str, ctx: StagingContext) -> Path:
    """The host path of `url` if it lies inside an allowed directory (links resolved)."""
    path = url_path(url)
    if not ctx.allowed_dirs:
        raise StagingError(
            "file:// URLs and local paths are disabled: storage.allowed_dirs is empty"
        )
    resolved = Path(os.path.realpath(path))
    for allowed in ctx.allowed_dirs:
        if resolved.is_relative_to(os.path.realpath(allowed)):
            return resolved
    raise StagingError(f"{path} is outside the allowed directories (storage.allowed_dirs)")


# --------------------------------------------------------------------------- download


def download(url: str, dest: Path, kind: FileKind, ctx: StagingContext) -> None:
    source = allowed_path(url, ctx)
    try:
        st = source.stat()
    except FileNotFoundError:
        raise StagingError(f"{source} does not exist") from None
    except OSError as exc:
        raise StagingError(f"cannot read {source}: {exc.strerror}") from None
    if kind == "DIRECTORY":
        if not stat.S_ISDIR(st.st_mode):
            raise StagingError(f"{source} is not a directory (input type is DIRECTORY)")
        _copy_tree(source, dest, ctx)
    else:
        if not stat.S_ISREG(st.st_mode):
            raise StagingError(f"{source} is not a regular file (input type is FILE)")
        _place_file(source, dest, ctx)


def _place_file(source: Path, dest: Path, ctx: StagingContext) -> None:
    if ctx.file_input_mode == "hardlink":
        try:
            os.link(source, dest, follow_symlinks=False)
            return
        except OSError:
            pass  # another filesystem, or links not permitted: copy instead
    try:
        shutil.copyfile(source, dest, follow_symlinks=False)
        os.chmod(dest, FILE_MODE | (source.stat().st_mode & 0o111))
    except OSError as exc:
        raise StagingError(f"cannot copy {source}: {exc.strerror or exc}") from None


def _copy_tree(source: Path, dest: Path, ctx: StagingContext) -> None:
    dest.mkdir(mode=DIR_MODE, exist_ok=True)
    try:
        for dirpath, dirnames, filenames in os.walk(source, followlinks=False):
            rel = Path(dirpath).relative_to(source)
            for name in dirnames:
                entry = Path(dirpath, name)
                if entry.is_symlink():
                    ctx.log(f"input {source}: skipped link to a directory {rel / name}")
                    continue
                (dest / rel / name).mkdir(mode=DIR_MODE, exist_ok=True)
            for name in filenames:
                entry = Path(dirpath, name)
                if entry.is_symlink():
                    # A link is staged as the file it points to, if that is allowed too.
                    try:
                        target = allowed_path(os.path.realpath(entry), ctx)
                    except StagingError:
                        ctx.log(f"input {source}: skipped link {rel / name} leading outside")
                        continue
                    if not target.is_file():
                        continue
                    entry = target
                elif not entry.is_file():
                    continue  # FIFOs, sockets, devices
                _place_file(entry, dest / rel / name, ctx)
    except OSError as exc:
        raise StagingError(f"cannot copy {source}: {exc.strerror or exc}") from None


# --------------------------------------------------------------------------- upload


def _make_dirs(path: Path, ctx: StagingContext) -> None:
    """Create `path` and its parents with DIR_MODE, staying inside the allowed directory."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=DIR_MODE)
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the job's umask 077
    allowed_path(str(path), ctx)  # the parent could have been a link created meanwhile


def upload_file(source_fd: int, size: int, url: str, ctx: StagingContext) -> None:
    path = url_path(url)
    if path == "/":
        raise StagingError(f"{url!r} names no file")
    # The entry is checked, not what a link there points to: the rename below replaces a
    # link instead of writing through it.
    dest = allowed_path(posixpath.dirname(path), ctx) / posixpath.basename(path)
    if dest.is_dir() and not dest.is_symlink():
        raise StagingError(f"{dest} exists and is a directory")
    try:
        _make_dirs(dest.parent, ctx)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tes-upload-", suffix=".part")
    except OSError as exc:
        raise StagingError(f"cannot write into {dest.parent}: {exc.strerror or exc}") from None
    try:
        os.lseek(source_fd, 0, os.SEEK_SET)
        _copy_fd(source_fd, fd, size)
        os.fchmod(fd, FILE_MODE)
        os.close(fd)
        fd = -1
        # rename replaces whatever is at dest (a link too) without following it.
        os.replace(tmp, dest)
    except OSError as exc:
        raise StagingError(f"cannot write {dest}: {exc.strerror or exc}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _copy_fd(source_fd: int, dest_fd: int, size: int) -> None:
    offset = 0
    try:
        while True:
            sent = os.sendfile(dest_fd, source_fd, offset, 1 << 24)
            if sent == 0:
                return
            offset += sent
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS) or offset:
            raise
    while chunk := os.read(source_fd, 1 << 20):
        view = memoryview(chunk)
        while view:
            view = view[os.write(dest_fd, view) :]


def ensure_directory(url: str, ctx: StagingContext) -> None:
    dest = Path(url_path(url))
    allowed_path(str(dest), ctx)
    if dest.exists() and not dest.is_dir():
        raise StagingError(f"{dest} exists and is not a directory")
    try:
        _make_dirs(dest, ctx)
    except OSError as exc:
        raise StagingError(f"cannot create {dest}: {exc.strerror or exc}") from None
