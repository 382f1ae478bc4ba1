"""What a task's document keeps of an executor's stdout and stderr (ExecutorLog.stdout/stderr).

TES lets a server keep part of a stream ("only the head, only the tail, a URL reference
only"). The bridge keeps all of a stream that fits in `job.log_tail_bytes` (10 KiB). Of a
longer one it keeps the head (a fifth of that: a program often says what went wrong first)
and the tail (the rest: how it ended), each cut at the end of a line when one is near, and
puts between them one line (`marker`, folded here) that says how much was left out and
where the whole stream is::

    [tes-bridge: 28,925 of 39,157 bytes left out here; the whole stderr: GET
    /ga4gh/tes/v1/tasks/ID/output?executor=0&stream=stderr]

The whole stream stays readable from that endpoint (bridge.job.output) as long as the task's
directory is kept (`job.retention_days`). Clients find the cut by that line (docs/api.md);
the web page and `tes-bridge task logs` read the whole stream instead.
"""

from __future__ import annotations

import os

#: The head gets this share of the bytes kept; the tail gets the rest.
HEAD_SHARE = 1 / 5
#: A cut moves to a line's end only when that keeps at least this share of its side.
LINE_SLACK = 1 / 2


def marker(task_id: str, index: int, stream: str, left_out: int, size: int) -> str:
    """The line that stands where bytes were left out (without its newline)."""
    return (
        f"[tes-bridge: {left_out:,} of {size:,} bytes left out here; the whole {stream}: "
        f"GET /ga4gh/tes/v1/tasks/{task_id}/output?executor={index}&stream={stream}]"
    )


def _head(data: bytes) -> bytes:
    """`data` up to its last newline, if that keeps most of it."""
    end = data.rfind(b"\n") + 1
    return data[:end] if end >= len(data) * LINE_SLACK else data


def _tail(data: bytes, whole_line: bool) -> bytes:
    """`data` from its first whole line: after its first newline, unless it begins one
    (`whole_line`) or that would drop most of it; never from inside a character."""
    if whole_line:
        return data
    start = data.find(b"\n") + 1
    if 0 < start <= len(data) * (1 - LINE_SLACK):
        return data[start:]
    skip = 0
    while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:  # UTF-8 continuation bytes
        skip += 1
    return data[skip:]


def read_excerpt(fd: int, keep_bytes: int, *, task_id: str, index: int, stream: str) -> str:
    """What the task document keeps of the stream open at `fd`: all of it when it fits in
    `keep_bytes`, else its head and tail with the marker line between them. Bytes that are not
    UTF-8 are replaced (U+FFFD)."""
    size = os.fstat(fd).st_size
    if size <= keep_bytes:
        data = os.pread(fd, keep_bytes, 0)
        return data.decode("utf-8", errors="replace")
    keep_bytes = max(keep_bytes, 0)
    head_bytes = int(keep_bytes * HEAD_SHARE)
    tail_bytes = keep_bytes - head_bytes
    head = _head(os.pread(fd, head_bytes, 0)) if head_bytes else b""
    tail = b""
    if tail_bytes:
        # One byte more, before the tail: whether the tail begins a line.
        start = size - tail_bytes - 1
        window = os.pread(fd, tail_bytes + 1, start)
        tail = _tail(window[1:], window[:1] == b"\n")
    left_out = size - len(head) - len(tail)
    kept_head = head.decode("utf-8", errors="replace")
    if kept_head and not kept_head.endswith("\n"):
        kept_head += "\n"  # a head cut inside a line: the marker still has a line of its own
    cut = marker(task_id, index, stream, left_out, size)
    return f"{kept_head}{cut}\n{tail.decode('utf-8', errors='replace')}"
