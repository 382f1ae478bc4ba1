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

Adding a protocol (http, s3, ftp...) means one new module and one line in `_MODULES`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

#: Scheme -> module implementing it.
_MODULES = {"file": "bridge.job.staging.file"}
#: Schemes the TES API accepts but this deployment cannot stage yet.
_PLANNED = {"http", "https", "s3", "ftp", "sftp", "gs", "drs", "htsget", "azblob"}

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class StagingError(Exception):
    """An input or output could not be moved; the message is shown in system_logs."""


class UnsupportedProtocolError(StagingError):
    pass


@dataclass
class StagingContext:
    allowed_dirs: list[Path] = field(default_factory=list)
    file_input_mode: str = "copy"
    #: Scratch space on the same filesystem as the task directory.
    tmp_dir: Path | None = None
    #: Adds a line to the task's system_logs (notes such as a skipped link).
    log: Callable[[str], None] = print


def scheme_of(url: str) -> str:
    """The lower-cased scheme; a bare absolute path counts as `file`."""
    if url.startswith("/"):
        return "file"
    match = _SCHEME.match(url)
    if not match:
        raise StagingError(f"URL {url!r} has no scheme and is not an absolute path")
    return match.group(1).lower()


def backend_for(url: str) -> ModuleType:
    scheme = scheme_of(url)
    name = _MODULES.get(scheme)
    if name is None:
        if scheme in _PLANNED:
            raise UnsupportedProtocolError(
                f"protocol {scheme}:// is not supported by this deployment yet"
            )
        raise UnsupportedProtocolError(f"unknown URL scheme {scheme}://")
    return importlib.import_module(name)
