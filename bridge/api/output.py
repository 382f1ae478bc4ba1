"""The API's live output of a task's executors (`GET /tasks/{id}/output`).

What an executor prints reaches its file at once (bridge.job.output), so a client can follow
it while the task runs without the TES document holding an executor log that has no
`exit_code` yet. The file is read here directly, or in site mode, where task directories are
private to their owners, by the poller (bridge.system.relay), which runs `python -m bridge.job
read-output` as the owner through the sudo rule (deploy/sudoers.tes-bridge): the API's unit
forbids sudo (NoNewPrivileges), only the poller's site-mode drop-in allows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.config import Config
from bridge.job.output import OutputChunk, Stream, chunk_from_json, read_output
from bridge.job.safepath import UnsafePathError
from bridge.store import TaskRecord
from bridge.system.relay import RelayUnavailable, ask


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
            return self._read_as_owner(record.owner, record.id, job_id, request)
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
        self, owner: str, task_id: str, job_id: str, request: OutputRequest
    ) -> OutputChunk:
        # sudo is the poller's alone (the API's unit has NoNewPrivileges): ask it.
        question = {
            "kind": "output",
            "owner": owner,
            "task_id": task_id,
            "job_id": job_id,
            "executor": request.executor,
            "stream": request.stream,
            "offset": request.offset,
            "max_bytes": request.max_bytes,
        }
        try:
            answer = ask(self.config.state_dir, question, self.config.slurm.command_timeout + 5)
        except RelayUnavailable as exc:
            raise OutputUnavailable(
                f"cannot read the output as {owner}: {exc}; in site mode the poller reads it"
            ) from None
        except (OSError, ValueError) as exc:
            raise OutputUnavailable(f"cannot read the output as {owner}: {exc}") from None
        if answer.get("error") == "refused":
            raise OutputRefused(str(answer.get("message")))
        if "chunk" not in answer:
            raise OutputUnavailable(str(answer.get("message") or "no answer from the poller"))
        try:
            return chunk_from_json(answer["chunk"])
        except (ValueError, KeyError, TypeError) as exc:
            raise OutputUnavailable(f"unexpected answer from read-output: {exc}") from None
