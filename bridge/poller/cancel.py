"""Carrying out the cancels the API recorded: one scancel for all jobs (one per owner in site
mode)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from bridge.poller.attempt import TaskLogs
from bridge.poller.chain import chain_of_task
from bridge.poller.context import CycleStats, PollerContext, short
from bridge.slurm import SlurmError
from bridge.store import TaskRecord

log = logging.getLogger("bridge.poller")


def job_ids(task: TaskRecord) -> list[str]:
    """The task's jobs: its job, and the transfer jobs of a staged task's chain (poller.chain)."""
    chain = chain_of_task(task)
    ids = chain.ids() if chain is not None else []
    return ids if task.job_id in ids else [j for j in [task.job_id, *ids] if j]


class Canceller:
    def __init__(
        self, ctx: PollerContext, follow_up: Callable[[TaskRecord], None] | None = None
    ) -> None:
        self.ctx = ctx
        #: Told of each task whose job was scanceled, to record the job's final facts
        #: (Follower.await_canceled).
        self.follow_up = follow_up

    def carry_out(self, tasks: list[TaskRecord], stats: CycleStats) -> None:
        with_job = [t for t in tasks if t.job_id]
        if not with_job:
            return
        groups: dict[str | None, list[TaskRecord]] = {}
        for task in with_job:
            groups.setdefault(task.owner if self.ctx.site else None, []).append(task)
        done: list[TaskRecord] = []
        for owner, owned in groups.items():
            try:
                self.ctx.check_lease()  # a poller that lost its lease cancels nothing
                stats.slurm_calls += 1
                self.ctx.slurm.cancel([j for t in owned for j in job_ids(t)], as_user=owner)
                done += owned
            except SlurmError as exc:
                log.warning("scancel failed; trying again next cycle: %s", short(exc))
        for task in done:
            self.ctx.store.finish_cancel(task.id)
            self._stop_waiting(task.id)
            if self.follow_up is not None:
                self.follow_up(task)
            stats.canceled += 1
            log.info("canceled Slurm job %s of task %s", task.job_id, task.id)

    def _stop_waiting(self, task_id: str) -> None:
        """A canceled task waits for nothing: its condition lines (a pending job's reason, ...)
        go now, not only once sacct has the job's final record (Follower.await_canceled),
        which it may never have."""
        task = self.ctx.store.get_task(task_id)
        if task is None or not task.logs:
            return
        logs = TaskLogs(task.logs)
        logs.attempt(max(task.attempt, 1)).clear_conditions()
        cleared = logs.to_json()
        if cleared != task.logs:
            self.ctx.store.amend_final_logs(task_id, cleared)
