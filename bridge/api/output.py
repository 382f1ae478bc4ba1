"""The API's live output of a task's executors (`GET /tasks/{id}/output`).

What an executor prints reaches its file at once (bridge.job.output), so a client can follow
it while the task runs without the TES document holding an executor log that has no
`exit_code` yet. The file is read here directly, or in site mode, where task directories are
private to their owners, by `python -m bridge.job read-output` as the owner through the sudo
rule (deploy/sudoers.tes-bridge).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bridge.config import Config
from bridge.job.output import OutputChunk, Stream, chunk_from_json, read_output
from bridge.job.owner import EXIT_REFUSED
from bridge.job.safepath import UnsafePathError
from bridge.store import TaskRecord
from bridge.system.proc import CommandError, as_user, run


class OutputUnavailable(Exception):
    """The output cannot be read now (the message is for the client)."""


class OutputRefused(Exception):
    """The stream is a link or not a regular file: the task put it there, it is never read."""


@dataclass(frozen=True)
class OutputRequest:
    executor: int
    stream: Stream
    offset: int
    max_bytes: int
    #: 1-based; None: the task's latest attempt.
    attempt: int | None = None


def job_of(record: TaskRecord, attempt: int | None) -> str | None:
    """The Slurm job id of an attempt (None: the latest), or None when it has none yet."""
    logs = record.logs or []
    if attempt is None:
        if record.job_id:
            return record.job_id
        attempt = len(logs)
    if not 1 <= attempt <= len(logs):
        return None
    metadata: dict[str, Any] = (logs[attempt - 1] or {}).get("metadata") or {}
    job_id = metadata.get("slurm_job_id")
    return job_id if isinstance(job_id, str) and job_id else None


class LiveOutput:
    def __init__(self, config: Config):
        self.config = config

    def read(self, record: TaskRecord, job_id: str, request: OutputRequest) -> OutputChunk:
        task_dir = self.config.work_dir / record.id
        if self.config.site.run_as_owner and record.owner:
            return self._read_as_owner(record.owner, str(task_dir), job_id, request)
        try:
            return read_output(
                task_dir,
                job_id,
                request.executor,
                request.stream,
                request.offset,
                request.max_bytes,
            )
        except UnsafePathError as exc:
            raise OutputRefused(f"the output is not readable: {exc}") from None
        except (OSError, ValueError) as exc:
            raise OutputUnavailable(f"cannot read the output: {exc}") from None

    def _read_as_owner(
        self, owner: str, task_dir: str, job_id: str, request: OutputRequest
    ) -> OutputChunk:
        # The argument order is the one the sudo rule's regular expression pins.
        command = [
            self.config.job.python,
            "-m",
            "bridge.job",
            "read-output",
            "--work-dir",
            str(self.config.work_dir),
            "--task-dir",
            task_dir,
            "--job-id",
            job_id,
            "--executor",
            str(request.executor),
            "--stream",
            request.stream,
            "--offset",
            str(request.offset),
            "--max-bytes",
            str(request.max_bytes),
        ]
        try:
            proc = run(
                as_user(self.config.site.sudo, owner, command),
                timeout=self.config.slurm.command_timeout,
                cwd="/",
            )
        except (CommandError, ValueError) as exc:
            raise OutputUnavailable(f"cannot read the output as {owner}: {exc}") from None
        detail = proc.stderr.strip().splitlines()[-1:] or ["no message"]
        if proc.returncode == EXIT_REFUSED:
            raise OutputRefused(f"the output is not readable: {detail[0]}")
        if proc.returncode != 0:
            raise OutputUnavailable(f"cannot read the output as {owner}: {detail[0]}")
        try:
            return chunk_from_json(json.loads(proc.stdout))
        except (ValueError, KeyError, TypeError) as exc:
            raise OutputUnavailable(f"unexpected answer from read-output: {exc}") from None
