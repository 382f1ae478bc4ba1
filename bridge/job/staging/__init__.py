"""Moving task inputs in and outputs out, one module per URL scheme.

Each protocol module is a `StagingBackend` (see `bridge.job.staging.file` for the reference
implementation): it defines `download`, `upload_file` and `ensure_directory` at module level,
and mypy checks it against the Protocol where `_LOADERS` returns it.

Adding a protocol means one new module and one loader in `_LOADERS`. Network protocols read
their settings (endpoints, paths of credential files; never secrets) from `ctx.options`, which
comes from job-config.json; logins from the site's netrc file through `netrc_login`. Every
message they raise goes through `redact`.
"""

from __future__ import annotations

import netrc
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

#: Schemes the TES API accepts but this deployment cannot stage yet.
_PLANNED = {"sftp", "gs", "htsget", "azblob"}
#: `scheme://user:password@` -> `scheme://***@`, and signature-like query values.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]*@")
_SECRET_QUERY = re.compile(
    r"(?i)([?&](?:[a-z0-9_.-]*(?:signature|token|credential|password|secret|sig|key)"
    r"[a-z0-9_.-]*)=)[^&\s#]*"
)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")

#: A TES input or output `type`.
FileKind = Literal["FILE", "DIRECTORY"]


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

    enabled: tuple[str, ...] = ("file", "http", "https", "s3", "ftp", "drs")
    http_upload: bool = False
    retries: int = 3
    timeout: float = 60.0
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_profile: str | None = None
    s3_credentials_file: str | None = None
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"
    s3_multipart_threshold_mb: int = 64
    s3_multipart_chunk_mb: int = 64
    s3_max_concurrency: int = 4
    netrc_file: str | None = None
    ftp_passive: bool = True
    ca_bundle: str | None = None
    drs_tokens_file: str | None = None
    #: Compact DRS identifier prefix -> host[:port], as pairs (the options are hashable: the S3
    #: client is cached by them).
    drs_prefixes: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StagingOptions:
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in (data or {}).items() if k in known}
        if "enabled" in values:
            values["enabled"] = tuple(values["enabled"])
        if "drs_prefixes" in values:
            values["drs_prefixes"] = tuple(sorted(dict(values["drs_prefixes"]).items()))
        return cls(**values)

    @property
    def verify(self) -> str | bool:
        """What requests and boto3 take as `verify`: the site's CA bundle, else their own."""
        return self.ca_bundle or True


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


@runtime_checkable
class StagingBackend(Protocol):
    """What a protocol module offers; `dest`, `source_fd` and `url` are the caller's."""

    def download(self, url: str, dest: Path, kind: FileKind, ctx: StagingContext) -> None:
        """Create `dest` (a FILE, or a DIRECTORY tree) from `url`. `dest` does not exist yet;
        its parent does, and lies in a tree no executor has touched."""

    def upload_file(self, source_fd: int, size: int, url: str, ctx: StagingContext) -> None:
        """Store the open regular file `source_fd` at `url`. The caller opened it without
        following links and records the upload."""

    def ensure_directory(self, url: str, ctx: StagingContext) -> None:
        """Create an (empty) directory at `url`; schemes without directories do nothing."""


# Imported on first use: a job that stages only files never loads boto3 or requests.
def _file() -> StagingBackend:
    from bridge.job.staging import file

    return file


def _http() -> StagingBackend:
    from bridge.job.staging import http

    return http


def _s3() -> StagingBackend:
    from bridge.job.staging import s3

    return s3


def _ftp() -> StagingBackend:
    from bridge.job.staging import ftp

    return ftp


def _drs() -> StagingBackend:
    from bridge.job.staging import drs

    return drs


#: Scheme -> the module implementing it.
_LOADERS: dict[str, Callable[[], StagingBackend]] = {
    "file": _file,
    "http": _http,
    "https": _http,
    "s3": _s3,
    "ftp": _ftp,
    "drs": _drs,
}


def can_stage(scheme: str, ctx: StagingContext) -> bool:
    """Whether this deployment stages `scheme` (a protocol module, enabled in staging.protocols)."""
    return scheme in _LOADERS and scheme in ctx.options.enabled


def backend_for(url: str, ctx: StagingContext | None = None) -> StagingBackend:
    scheme = scheme_of(url)
    loader = _LOADERS.get(scheme)
    if loader is not None and ctx is not None and scheme not in ctx.options.enabled:
        raise UnsupportedProtocolError(
            f"protocol {scheme}:// is not enabled on this deployment (staging.protocols)"
        )
    if loader is None:
        if scheme in _PLANNED:
            raise UnsupportedProtocolError(
                f"protocol {scheme}:// is not supported by this deployment yet"
            )
        raise UnsupportedProtocolError(f"unknown URL scheme {scheme}://")
    return loader()


def netrc_login(host: str, ctx: StagingContext) -> tuple[str, str] | None:
    """(login, password) for `host` from the site's netrc file (`staging.netrc_file`), or
    None when there is no file or no entry for the host."""
    if not ctx.options.netrc_file:
        return None
    try:
        entry = netrc.netrc(ctx.options.netrc_file).authenticators(host)
    except (OSError, netrc.NetrcParseError) as exc:
        # The parse error can quote a line of the file: keep only that it failed.
        raise StagingError(
            f"cannot read the netrc file {ctx.options.netrc_file}: "
            f"{getattr(exc, 'strerror', None) or 'parse error'}"
        ) from None
    if entry is None:
        return None
    login, _, password = entry
    return (login or "", password or "")


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
