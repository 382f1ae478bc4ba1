"""Inputs given inline as `content` (UTF-8 text in the task document)."""

from __future__ import annotations

import os
from pathlib import Path

from bridge.job.staging import FileKind, StagingError


def write_content(content: str, dest: Path, kind: FileKind) -> None:
    if kind != "FILE":
        raise StagingError("an input with `content` must be of type FILE")
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as handle:
        # surrogateescape: content that came from JSON can hold lone surrogates.
        handle.write(content.encode("utf-8", errors="surrogateescape"))
