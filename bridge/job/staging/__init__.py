"""Moving task inputs in and outputs out, one module per URL scheme.

A protocol module offers (see `bridge.job.staging.file` for the reference implementation)::

    download(url: str, dest: Path, kind: str, ctx: StagingContext) -> None
        Create `dest` (a FILE, or a DIRECTORY tree) from `url`. `dest` does not exist yet;
        its parent does, and lies in a tree no executor has touched.
    upload_file(source_fd: int, size: int, url: str, ctx: StagingContext) -> None
        Store the open regular file `source_fd` at `url`. The caller opened it without
        following links and records the upload.
    ensure_directory(url: str, ctx: StagingContext) -> None
        Create an (empty) directory at `url`; schemes without directories do nothing.

Adding a protocol means one new module and one line in `_MODULES`. Network protocols read
their settings (endpoints, paths of credential files; never secrets) from `ctx.options`, which
comes from job-config.json. Every message they raise goes through `redact`.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

#: Scheme -> module implementing it.
_MODULES = {
    "file": "bridge.job.staging.file",
    "http": "bridge.job.staging.http",
    "https": "bridge.job.staging.http",
    "s3": "bridge.job.staging.s3",
    "ftp": "bridge.job.staging.ftp",
}
#: Schemes the TES API accepts but this deployment cannot stage yet.
_PLANNED = {"sftp", "gs", "drs", "htsget", "azblob"}
#: `scheme://user:password@` -> `scheme://***@`, and signature-like query values.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]*@")
_SECRET_QUERY = re.compile(
    r"(?i)([?&](?:[a-z0-9_.-]*(?:signature|token|credential|password|secret|sig|key)"
    r"[a-z0-9_.-]*)=)[^&\s#]*"
)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class StagingError(Exception):
    """An input or output could not be moved; the message is shown in system_logs."""


class UnsupportedProtocolError(StagingError):
    pass


def redact(text: str) -> str:
    """`text` without the credentials a URL can carry (user:password@, signed query values)."""
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


@dataclass(frozen=True)
class StagingOptions:
    """The `[staging]` settings the job side uses (see bridge.config.StagingConfig).

    Only names and paths: credentials stay in the files and environment these point to.
    """

    enabled: tuple[str, ...] = ("file", "http", "https", "s3", "ftp")
    http_upload: bool = False
    retries: int = 3
    timeout: float = 60.0
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_profile: str | None = None
    s3_credentials_file: str | None = None
    s3_addressing_style: str = "auto"
    s3_multipart_threshold_mb: int = 64
    s3_multipart_chunk_mb: int = 64
    s3_max_concurrency: int = 4
    netrc_file: str | None = None
    ftp_passive: bool = True

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StagingOptions:
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in (data or {}).items() if k in known}
        if "enabled" in values:
            values["enabled"] = tuple(values["enabled"])
        return cls(**values)


@dataclass
class StagingContext:
    allowed_dirs: list[Path] = field(default_factory=list)
    file_input_mode: str = "copy"
    #: Scratch space on the same filesystem as the task directory.
    tmp_dir: Path | None = None
    #: Adds a line to the task's system_logs (notes such as a skipped link).
    log: Callable[[str], None] = print
    options: StagingOptions = field(default_factory=StagingOptions)


def scheme_of(url: str) -> str:
    """The lower-cased scheme; a bare absolute path counts as `file`."""
    if url.startswith("/"):
        return "file"
    match = _SCHEME.match(url)
    if not match:
        raise StagingError(f"URL {redact(url)!r} has no scheme and is not an absolute path")
    return match.group(1).lower()


def backend_for(url: str, ctx: StagingContext | None = None) -> ModuleType:
    scheme = scheme_of(url)
    name = _MODULES.get(scheme)
    if name is not None and ctx is not None and scheme not in ctx.options.enabled:
        raise UnsupportedProtocolError(
            f"protocol {scheme}:// is not enabled on this deployment (staging.protocols)"
        )
    if name is None:
        if scheme in _PLANNED:
            raise UnsupportedProtocolError(
                f"protocol {scheme}:// is not supported by this deployment yet"
            )
        raise UnsupportedProtocolError(f"unknown URL scheme {scheme}://")
    return importlib.import_module(name)


def safe_relative(name: str, where: str) -> tuple[str, ...]:
    """Components of a remote relative name (an S3 key below a prefix, an FTP listing path)
    that can be placed under a local directory: no `..`, `.`, empty parts or NUL."""
    parts = tuple(name.split("/"))
    if not name or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise StagingError(f"{where}: the name {name!r} cannot be placed safely")
    return parts


def check_remote_path(path: str, url: str) -> str:
    """A remote path or key from a URL must not hold `.` or `..` components."""
    if any(p in (".", "..") for p in path.split("/")) or "\0" in path:
        raise StagingError(f"{redact(url)!r}: `.` and `..` are not allowed in the path")
    return path


def create_file(dest: Path) -> int:
    """Open a new file for writing without following a link at `dest`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(dest, flags, 0o644)


def make_parents(top: Path, parts: tuple[str, ...]) -> Path:
    """Create top/parts[:-1] (never through a link) and return top/parts."""
    current = top
    for part in parts[:-1]:
        current = current / part
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            raise StagingError(f"{current} is in the way of a directory")
        current.mkdir(mode=0o755, exist_ok=True)
    return top.joinpath(*parts)
