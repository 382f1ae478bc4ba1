"""Admission control: which of a round's tasks may go to Slurm now, and whose tasks to leave
out of a full round."""

from __future__ import annotations

from bridge.poller.attempt import Condition, ConditionKind
from bridge.poller.context import PollerContext
from bridge.store import TaskRecord


def _over(held: int, jobs: int, limit: int) -> bool:
    """Whether `jobs` more would pass `limit` (0: none) with `held` in Slurm; a task of more
    jobs than the limit goes when none are held, rather than never."""
    return bool(limit) and (held >= limit or (held > 0 and held + jobs > limit))


class Admission:
    """Admission control: `slurm.max_jobs_in_flight` jobs of this service in Slurm at most, and
    `slurm.max_jobs_per_owner` of one owner; counted from the store once per submission round,
    with the jobs of decided tasks that squeue still listed (PollerContext.jobs_leaving): a job
    is counted until the poller has seen it leave Slurm, never less. A task staged on the
    transfer partition is the jobs its chain holds (PollerContext.chain_jobs_beyond_one): three
    to submit, and room for all three, unless none of its kind is in Slurm (a limit below three
    would hold it for ever)."""

    def __init__(self, ctx: PollerContext) -> None:
        self.ctx = ctx
        cfg = ctx.config.slurm
        self.max_total = cfg.max_jobs_in_flight
        self.max_owner = cfg.max_jobs_per_owner
        self.by_owner: dict[str | None, int] = {}
        if ctx.admission_control:
            self.by_owner = ctx.store.jobs_in_flight_by_owner()
            # Jobs of tasks already decided that Slurm has not let go yet.
            for owner in ctx.jobs_leaving.values():
                self.by_owner[owner] = self.by_owner.get(owner, 0) + 1
            for owner, jobs in ctx.chain_jobs_beyond_one.items():
                self.by_owner[owner] = self.by_owner.get(owner, 0) + jobs
        self.total = sum(self.by_owner.values())

    @property
    def full(self) -> bool:
        return bool(self.max_total) and self.total >= self.max_total

    def refusal(self, owner: str | None, jobs: int = 1) -> Condition | None:
        """Why a task of `owner` that is `jobs` jobs in Slurm waits, or None when it may be
        submitted."""
        chain = f"; staged on the transfer partition, this task is {jobs} jobs" if jobs > 1 else ""
        if _over(self.total, jobs, self.max_total):
            return Condition(
                ConditionKind.ADMISSION,
                f"waiting: {self.total} jobs of this service are in Slurm, the most it submits "
                f"at once (slurm.max_jobs_in_flight = {self.max_total}){chain}",
            )
        if _over(self.by_owner.get(owner, 0), jobs, self.max_owner):
            return Condition(
                ConditionKind.ADMISSION,
                f"waiting: {self.by_owner.get(owner, 0)} jobs of this task's owner are in Slurm, "
                f"the most one owner may have (slurm.max_jobs_per_owner = {self.max_owner})"
                f"{chain}",
            )
        return None

    def owners_at_limit(self) -> list[str | None]:
        """Owners with no room left: their tasks are left out of a full round, so that a
        thousand of them queued first do not keep everyone else's out of it."""
        if not self.max_owner or self.full:
            return []  # when full, every task is read to be told why it waits
        return [owner for owner, jobs in self.by_owner.items() if jobs >= self.max_owner]

    def add(self, owner: str | None, jobs: int = 1) -> None:
        self.total += jobs
        self.by_owner[owner] = self.by_owner.get(owner, 0) + jobs

    def round_for_others(
        self, tasks: list[TaskRecord], *, now: float, limit: int
    ) -> list[TaskRecord]:
        """The round `tasks` (read with `limit`), read again without the owners at their limit
        when it is full and holds tasks of theirs: others' tasks may wait behind it."""
        at_limit = self.owners_at_limit()
        if len(tasks) == limit and any(t.owner in at_limit for t in tasks):
            return self.ctx.store.tasks_to_submit(now=now, limit=limit, skip_owners=at_limit)
        return tasks
