"""The last step of a submission: the task's job id stored, with what its attempt's log says
of the job."""

from __future__ import annotations

from bridge.poller.arrays import ARRAY_JOB_KEY, PreparedJob
from bridge.poller.attempt import TaskLogs
from bridge.poller.cancel import Canceller
from bridge.poller.context import CycleStats, PollerContext
from bridge.poller.decisions import TIME_LIMIT_KEY
from bridge.store import TaskRecord


class Recorder:
    """Stores each submitted task's job id (`store.record_job`), and scancels the job at once
    when the task was canceled while sbatch ran."""

    def __init__(self, ctx: PollerContext, canceller: Canceller) -> None:
        self.ctx = ctx
        self.canceller = canceller

    def record(
        self,
        task: TaskRecord,
        attempt: int,
        job_id: str,
        prepared: PreparedJob,
        stats: CycleStats,
        array_id: str | None = None,
    ) -> None:
        """Store the task's job id; scancel it at once when the task was canceled meanwhile."""
        logs = TaskLogs(task.logs)
        entry = logs.attempt(attempt)
        entry.set_condition(None)
        metadata = entry.ensure_metadata()
        metadata["slurm_job_id"] = job_id
        if array_id is not None:
            metadata[ARRAY_JOB_KEY] = array_id
        if prepared.time_limit:
            metadata[TIME_LIMIT_KEY] = prepared.time_limit.describe()
        canceled = self.ctx.store.record_job(task.id, job_id, logs=logs.to_json())
        if canceled:
            # Canceled while sbatch ran (the API saw no job yet): scancel before it can start.
            now = self.ctx.store.get_task(task.id)
            if now is not None:
                self.canceller.carry_out([now], stats)
