"""`ftp://[user@]host[:port]/path` through ftplib: download (FILE or DIRECTORY, listed with
MLSD), upload with STOR and MKD.

Logins come from the site's netrc file (`staging.netrc_file`, by host name), else from the URL,
else anonymous. The URL path is percent-decoded and taken from the server's root (`/path`),
and may not hold `.` or `..` components.
"""

from __future__ import annotations

import contextlib
import ftplib
import os
import posixpath
import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from bridge.job.staging import (
    FileKind,
    StagingContext,
    StagingError,
    check_remote_path,
    create_file,
    make_parents,
    netrc_login,
    redact,
    safe_relative,
)

_ERRORS = (ftplib.Error, OSError, EOFError)


def _parse(url: str) -> tuple[urllib.parse.SplitResult, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() != "ftp" or not parts.hostname:
        raise StagingError(f"{redact(url)!r} is not an ftp:// URL with a host")
    path = urllib.parse.unquote(parts.path) or "/"
    if "\n" in path or "\r" in path:
        raise StagingError(f"{redact(url)!r}: line breaks are not allowed in the path")
    return parts, check_remote_path(path, url)


def _login(parts: urllib.parse.SplitResult, ctx: StagingContext) -> tuple[str, str]:
    entry = netrc_login(parts.hostname or "", ctx)
    if entry is not None:
        return entry[0] or "anonymous", entry[1]
    if parts.username:
        return urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
    return "anonymous", "anonymous@"


@contextlib.contextmanager
def _connect(url: str, ctx: StagingContext) -> Iterator[tuple[ftplib.FTP, str]]:
    parts, path = _parse(url)
    ftp = ftplib.FTP(timeout=ctx.options.timeout)
    try:
        ftp.connect(parts.hostname or "", parts.port or 21)
        user, password = _login(parts, ctx)
        try:
            ftp.login(user, password)
        except ftplib.error_perm as exc:
            raise StagingError(f"{redact(url)}: login as {user!r} refused: {exc}") from None
        ftp.set_pasv(ctx.options.ftp_passive)
        yield ftp, path
    except _ERRORS as exc:
        raise StagingError(f"{redact(url)}: {_reason(exc)}") from None
    finally:
        with contextlib.suppress(*_ERRORS):
            ftp.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "cannot connect (connection refused)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return redact(str(exc)) or exc.__class__.__name__


def _retrieve(ftp: ftplib.FTP, path: str, dest: Path) -> None:
    fd = create_file(dest)
    with os.fdopen(fd, "wb") as handle:
        ftp.retrbinary(f"RETR {path}", handle.write, blocksize=1 << 20)


def _walk(ftp: ftplib.FTP, top: str, rel: str = "") -> Iterator[tuple[str, str]]:
    """(relative name, type) of every entry below `top`, depth first."""
    directory = posixpath.join(top, rel) if rel else top
    for name, facts in sorted(ftp.mlsd(directory, facts=["type"])):
        kind = facts.get("type", "").lower()
        if kind in ("cdir", "pdir") or name in (".", ".."):
            continue
        child = f"{rel}/{name}" if rel else name
        yield child, kind
        if kind == "dir":
            yield from _walk(ftp, top, child)


def download(url: str, dest: Path, kind: FileKind, ctx: StagingContext) -> None:
    with _connect(url, ctx) as (ftp, path):
        if kind != "DIRECTORY":
            try:
                _retrieve(ftp, path, dest)
            except ftplib.error_perm as exc:
                raise StagingError(f"{redact(url)}: {exc}") from None
            return
        try:
            ftp.cwd(path)
        except ftplib.error_perm as exc:
            raise StagingError(f"{redact(url)} is not a readable directory: {exc}") from None
        dest.mkdir(mode=0o755, exist_ok=True)
        for name, entry_kind in _walk(ftp, path):
            try:
                parts = safe_relative(name, f"input {redact(url)}")
            except StagingError as exc:
                ctx.log(f"{exc}; skipped")
                continue
            target = make_parents(dest, parts)
            if entry_kind == "dir":
                target.mkdir(mode=0o755, exist_ok=True)
            elif entry_kind == "file":
                _retrieve(ftp, posixpath.join(path, name), target)


def _make_dirs(ftp: ftplib.FTP, path: str) -> None:
    current = ""
    for part in [p for p in path.split("/") if p]:
        current += "/" + part
        with contextlib.suppress(ftplib.error_perm):  # exists already; STOR shows real problems
            ftp.mkd(current)


def upload_file(source_fd: int, size: int, url: str, ctx: StagingContext) -> None:
    with _connect(url, ctx) as (ftp, path):
        if path.endswith("/") or path == "/":
            raise StagingError(f"{redact(url)} names no file")
        _make_dirs(ftp, posixpath.dirname(path))
        os.lseek(source_fd, 0, os.SEEK_SET)
        try:
            with open(source_fd, "rb", closefd=False) as body:
                ftp.storbinary(f"STOR {path}", body, blocksize=1 << 20)
        except ftplib.error_perm as exc:
            raise StagingError(f"{redact(url)}: {exc}") from None


def ensure_directory(url: str, ctx: StagingContext) -> None:
    with _connect(url, ctx) as (ftp, path):
        _make_dirs(ftp, path)
