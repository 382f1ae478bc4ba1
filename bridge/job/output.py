"""Live output: a byte range of an executor's stdout or stderr, while it runs or after.

The executor's stdio goes straight to a file (bridge.job.execute), so what it printed is on
disk as soon as it printed it: `records/<job id>/executors/<N>/<stream>`, or the executor's own
`stdout`/`stderr` path under `root/`. Both are read from the task directory down, one component
at a time without following links (bridge.job.safepath): a link planted by an executor is an
error, never a way out of the task's directory. The API reads through this module directly, or
in site mode through `python -m bridge.job read-output` run as the task's owner.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bridge.job import safepath
from bridge.job.layout import TaskLayout, relative_parts
from bridge.job.records import EXECUTORS

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, ...] = ("stdout", "stderr")
#: The most one read returns: a follower asks again from `next_offset`.
MAX_READ_BYTES = 1024 * 1024


@dataclass
class OutputChunk:
    #: The bytes read, decoded as UTF-8 (invalid bytes replaced); never a split character
    #: while the stream may still grow.
    text: str
    #: The byte offset where `text` starts (0 when the stream started afresh, after a requeue).
    offset: int
    #: Where the next read continues.
    next_offset: int
    #: The stream's size in bytes now.
    size: int
    #: The executor has finished (or never will write here): the stream will not grow.
    done: bool
    #: The executor has started (its stream may still be missing when it writes nothing).
    started: bool


def _own_path(task_json: Path, index: int, stream: str) -> str | None:
    """The executor's own container path for `stream`, from task.json (None: the records)."""
    try:
        executors = json.loads(task_json.read_text(encoding="utf-8")).get("executors") or []
        own = executors[index].get(stream) if index < len(executors) else None
    except (OSError, ValueError, AttributeError):
        return None
    return own if isinstance(own, str) and own != os.devnull else None


def _complete_utf8_end(data: bytes) -> int:
    """The length of `data` without a trailing, incomplete UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        needed = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
        if byte & 0x80 and byte & 0xC0 == 0xC0 and back < needed:
            return len(data) - back
        return len(data)
    return len(data)


def _read_range(fd: int, offset: int, max_bytes: int) -> tuple[bytes, int, int]:
    """(bytes, start, size): up to `max_bytes` from `offset` (negative: from the end)."""
    size = os.fstat(fd).st_size
    if offset < 0:
        start = max(0, size + offset)
    elif offset > size:
        start = 0  # shorter than the reader saw: the stream started afresh (a requeued job)
    else:
        start = offset
    data = os.pread(fd, min(max_bytes, size - start), start) if size > start else b""
    return data, start, size


def read_output(
    task_dir: Path, job_id: str, index: int, stream: Stream, offset: int, max_bytes: int
) -> OutputChunk:
    """Up to `max_bytes` of executor `index`'s `stream` in job `job_id`, from `offset`."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {', '.join(STREAMS)}")
    max_bytes = max(1, min(max_bytes, MAX_READ_BYTES))
    layout = TaskLayout(task_dir)
    layout.records_dir(job_id)  # refuses a job id that is not one path component
    edir = (layout.records.name, job_id, EXECUTORS, str(index))
    started = safepath.lstat_kind(task_dir, edir) == "dir"
    done = safepath.lstat_kind(task_dir, (*edir, "exit_code")) == "file"
    own = _own_path(layout.task_json, index, stream)
    try:
        if own:
            fd = safepath.open_read(layout.root, relative_parts(own))
        else:
            fd = safepath.open_read(task_dir, (*edir, stream))
    except FileNotFoundError:
        return OutputChunk("", max(offset, 0), max(offset, 0), 0, done, started)
    try:
        data, start, size = _read_range(fd, offset, max_bytes)
    finally:
        os.close(fd)
    # A read from the end may begin inside a character: skip its continuation bytes.
    skip = 0
    while offset < 0 and skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:
        skip += 1
    data, start = data[skip:], start + skip
    if not done:
        data = data[: _complete_utf8_end(data)]
    text = data.decode("utf-8", errors="replace")
    return OutputChunk(text, start, start + len(data), size, done, started)


def chunk_to_json(chunk: OutputChunk) -> dict[str, Any]:
    return dataclasses.asdict(chunk)


def chunk_from_json(data: dict[str, Any]) -> OutputChunk:
    return OutputChunk(
        text=str(data["text"]),
        offset=int(data["offset"]),
        next_offset=int(data["next_offset"]),
        size=int(data["size"]),
        done=bool(data["done"]),
        started=bool(data["started"]),
    )
