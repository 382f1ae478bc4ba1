"""The records one run of a job leaves in `records/<job id>/`, and the poller's reader.

Files (each small one is replaced atomically by write-then-rename; the `.jsonl` files are only
appended to, one JSON object per line, so a job killed half-way leaves at worst a torn last
line, which the reader skips)::

    start_time, end_time           RFC 3339 UTC, the job script's own run
    phase                          staging | running <N> | uploading | done
    outcome                        complete | executor_error | system_error (absent: unfinished)
    memory_peak_bytes              the peak of the job's memory cgroup, when it has one
    cpu_usage_usec                 the CPU time (µs) the job's cgroup used, when it has one
    system_logs.jsonl              {"time": ..., "message": ...}
    outputs.jsonl                  {"url": ..., "path": ..., "size_bytes": "123"}
    executors/<N>/start_time, end_time, exit_code
    executors/<N>/stdout, stderr   the full streams, unless the executor named its own
                                   stdout/stderr path (then that file under root/ holds it);
                                   the reader keeps an excerpt of each (bridge.job.excerpt)

Everything is written by the job script (bash) and by `python -m bridge.job` on the node.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeGuard, get_args

from bridge.core.naming import format_time_now
from bridge.job import safepath
from bridge.job.excerpt import read_excerpt
from bridge.job.layout import LayoutError, TaskLayout, relative_parts

Outcome = Literal["complete", "executor_error", "system_error"]
OUTCOMES: tuple[str, ...] = get_args(Outcome)

SYSTEM_LOGS = "system_logs.jsonl"
OUTPUTS = "outputs.jsonl"
EXECUTORS = "executors"


def _is_outcome(text: str | None) -> TypeGuard[Outcome]:
    return text in OUTCOMES


def executor_dir(records_dir: Path, index: int) -> Path:
    return records_dir / EXECUTORS / str(index)


# --------------------------------------------------------------------------- writers


def _append_json_line(path: Path, entry: dict[str, Any]) -> None:
    line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
    # One write() on an O_APPEND descriptor: concurrent writers never interleave a line.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def write_value(path: Path, value: str) -> None:
    """Replace a one-line record file atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(value + "\n", encoding="utf-8")
    os.replace(tmp, path)


class RecordsWriter:
    """What the Python job side adds to the records (bash writes phases, times, exit codes)."""

    def __init__(self, records_dir: Path) -> None:
        self.dir = Path(records_dir)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def system_log(self, message: str) -> None:
        _append_json_line(self.dir / SYSTEM_LOGS, {"time": format_time_now(), "message": message})

    def output(self, *, url: str, path: str, size_bytes: int) -> None:
        entry = {"url": url, "path": path, "size_bytes": str(size_bytes)}
        _append_json_line(self.dir / OUTPUTS, entry)


# --------------------------------------------------------------------------- reader


@dataclass
class ExecutorRecord:
    index: int
    start_time: datetime | None = None
    end_time: datetime | None = None
    #: None while the executor runs (or when the job was killed during it).
    exit_code: int | None = None
    #: What the task document keeps of each stream (bridge.job.excerpt): all of it, or its
    #: head and tail around a line that says what was left out; invalid UTF-8 replaced.
    stdout: str = ""
    stderr: str = ""


@dataclass
class JobRecords:
    job_id: str
    #: staging | running <N> | uploading | done; None when the job has not started.
    phase: str | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    executors: list[ExecutorRecord] = field(default_factory=list)
    #: TES OutputFileLog dicts: url, path, size_bytes (a string).
    outputs: list[dict[str, str]] = field(default_factory=list)
    system_logs: list[str] = field(default_factory=list)
    #: None until the job script finished (a killed job never gets one).
    outcome: Outcome | None = None
    #: The peak of the job's memory cgroup (None without one): also for jobs too short for
    #: Slurm's accounting samples.
    memory_peak_bytes: int | None = None
    #: The CPU time in microseconds of the job's cgroup (None without one), for efficiency.
    cpu_usage_usec: int | None = None

    @property
    def started(self) -> bool:
        return self.phase is not None or self.start_time is not None


def _read_small(path: Path, limit: int = 4096) -> str | None:
    try:
        data = safepath.read_tail_path(path, limit)
    except OSError:
        return None
    text = data.decode("utf-8", errors="replace").strip()
    return text or None


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_json_lines(path: Path, limit: int = 64 * 1024 * 1024) -> list[dict[str, Any]]:
    try:
        data = safepath.read_tail_path(path, limit)
    except OSError:
        return []
    entries = []
    for line in data.split(b"\n"):
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # torn last line of a killed job, or garbage
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def _stdio_paths(layout: TaskLayout) -> list[dict[str, str]]:
    """Each executor's own stdout/stderr container paths, from task.json (never raises)."""
    try:
        task = json.loads(layout.task_json.read_text(encoding="utf-8"))
        executors = task.get("executors") or []
        return [
            {k: v for k, v in ex.items() if k in ("stdout", "stderr") and isinstance(v, str)}
            if isinstance(ex, dict)
            else {}
            for ex in executors
        ]
    except (OSError, ValueError, AttributeError):
        return []


def _stream_excerpt(
    layout: TaskLayout, records_dir: Path, index: int, stream: str, own: str | None, keep: int
) -> str:
    try:
        if own:
            fd = safepath.open_read(layout.root, relative_parts(own))
        else:
            fd = safepath.open_read_path(executor_dir(records_dir, index) / stream)
    except (OSError, LayoutError):
        return ""
    try:
        return read_excerpt(fd, keep, task_id=layout.task_dir.name, index=index, stream=stream)
    except OSError:
        return ""
    finally:
        os.close(fd)


def read_records(task_dir: Path, job_id: str, *, keep_bytes: int) -> JobRecords:
    """Everything one job run recorded so far, with `keep_bytes` of each executor stream (its
    excerpt); robust to partial files, never raises on them."""
    layout = TaskLayout(task_dir)
    records = JobRecords(job_id=job_id)
    try:
        records_dir = layout.records_dir(job_id)
    except LayoutError:
        return records
    if not os.path.isdir(records_dir):
        return records  # the job has not started: skip the dozen reads that would all fail
    records.phase = _read_small(records_dir / "phase", 256)
    records.start_time = _parse_time(_read_small(records_dir / "start_time", 256))
    records.end_time = _parse_time(_read_small(records_dir / "end_time", 256))
    outcome = _read_small(records_dir / "outcome", 256)
    records.outcome = outcome if _is_outcome(outcome) else None
    records.memory_peak_bytes = _parse_int(_read_small(records_dir / "memory_peak_bytes", 256))
    records.cpu_usage_usec = _parse_int(_read_small(records_dir / "cpu_usage_usec", 256))

    stdio = _stdio_paths(layout)
    for index in _executor_indexes(records_dir):
        edir = executor_dir(records_dir, index)
        own = stdio[index] if index < len(stdio) else {}
        records.executors.append(
            ExecutorRecord(
                index=index,
                start_time=_parse_time(_read_small(edir / "start_time", 256)),
                end_time=_parse_time(_read_small(edir / "end_time", 256)),
                exit_code=_parse_int(_read_small(edir / "exit_code", 256)),
                stdout=_stream_excerpt(
                    layout, records_dir, index, "stdout", own.get("stdout"), keep_bytes
                ),
                stderr=_stream_excerpt(
                    layout, records_dir, index, "stderr", own.get("stderr"), keep_bytes
                ),
            )
        )
    for entry in _read_json_lines(records_dir / OUTPUTS):
        url, path, size = entry.get("url"), entry.get("path"), entry.get("size_bytes")
        if isinstance(url, str) and isinstance(path, str) and isinstance(size, str | int):
            records.outputs.append({"url": url, "path": path, "size_bytes": str(size)})
    for entry in _read_json_lines(records_dir / SYSTEM_LOGS):
        if isinstance(entry.get("message"), str):
            records.system_logs.append(entry["message"])
    return records


def _executor_indexes(records_dir: Path) -> list[int]:
    """Executors that started, in order (a directory is created when one starts)."""
    try:
        names = os.listdir(records_dir / EXECUTORS)
    except OSError:
        return []
    indexes = sorted(int(name) for name in names if name.isdigit() and len(name) < 7)
    # Only a gap-free prefix: 0, 1, 2... (anything else is garbage, not an executor).
    return [i for n, i in enumerate(indexes) if i == n]
