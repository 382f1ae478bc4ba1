"""The last step of a submission: the task's job id stored, with what its attempt's log says
of the job."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bridge.poller.arrays import ARRAY_JOB_KEY, PreparedJob, Ready
from bridge.poller.attempt import TaskLogs
from bridge.poller.cancel import Canceller
from bridge.poller.context import CycleStats, PollerContext
from bridge.poller.decisions import TIME_LIMIT_KEY
from bridge.store import TaskRecord


@dataclass(frozen=True)
class Element:
    """A task's element of a job array: its attempt, and its index I (the job `ID_I`)."""

    task: TaskRecord
    attempt: int
    index: int
    prepared: PreparedJob

    def job_id(self, array_id: str) -> str:
        return f"{array_id}_{self.index}"


def elements_of(members: Sequence[Ready]) -> list[Element]:
    """The elements of an array's tasks just marked (submit.marks): member i is element i, of
    its task's next attempt."""
    return [Element(r.task, r.task.attempt + 1, i, r.prepared) for i, r in enumerate(members)]


class Recorder:
    """Stores each submitted task's job id (`store.record_job`), and scancels the job at once
    when the task was canceled while sbatch ran."""

    def __init__(self, ctx: PollerContext, canceller: Canceller) -> None:
        self.ctx = ctx
        self.canceller = canceller

    def record(
        self, task: TaskRecord, attempt: int, job_id: str, prepared: PreparedJob, stats: CycleStats
    ) -> None:
        """Store the task's job id; scancel it at once when the task was canceled meanwhile."""
        if self._store(task, attempt, job_id, prepared):
            self._cancel_now([task.id], stats)

    def record_array(self, members: Sequence[Ready], array_id: str, stats: CycleStats) -> None:
        """Store each member's element of array `array_id` (member i is element i), all in one
        transaction; then scancel the elements whose tasks were canceled meanwhile."""
        self.record_elements(elements_of(members), array_id, stats)

    def record_elements(
        self, elements: Sequence[Element], array_id: str, stats: CycleStats
    ) -> None:
        """Store each task's element `ID_I` of array `array_id`, all in one transaction; then
        scancel the elements whose tasks were canceled meanwhile."""
        canceled: list[str] = []
        with self.ctx.store.batch():
            for element in elements:
                job_id = element.job_id(array_id)
                if self._store(element.task, element.attempt, job_id, element.prepared, array_id):
                    canceled.append(element.task.id)
        self._cancel_now(canceled, stats)

    def _store(
        self,
        task: TaskRecord,
        attempt: int,
        job_id: str,
        prepared: PreparedJob,
        array_id: str | None = None,
    ) -> bool:
        """The job id and the attempt's log stored; whether the task was canceled meanwhile."""
        logs = TaskLogs(task.logs)
        entry = logs.attempt(attempt)
        entry.set_condition(None)
        metadata = entry.ensure_metadata()
        metadata["slurm_job_id"] = job_id
        if array_id is not None:
            metadata[ARRAY_JOB_KEY] = array_id
        if prepared.time_limit:
            metadata[TIME_LIMIT_KEY] = prepared.time_limit.describe()
        return self.ctx.store.record_job(task.id, job_id, logs=logs.to_json())

    def _cancel_now(self, task_ids: list[str], stats: CycleStats) -> None:
        """Canceled while sbatch ran (the API saw no job yet): scancel before they can start."""
        tasks = [t for t in (self.ctx.store.get_task(i) for i in task_ids) if t is not None]
        if tasks:
            self.canceller.carry_out(tasks, stats)
