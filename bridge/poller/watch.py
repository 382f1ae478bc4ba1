"""What Slurm and the jobs said of the followed jobs: one cache, updated once per cycle."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from bridge.core.tes import State
from bridge.job.records import JobRecords, read_records
from bridge.poller.arrays import attempt_metadata, submitted_name
from bridge.poller.chain import chain_of_task, watched
from bridge.poller.context import CycleStats, PollerContext, short
from bridge.poller.decisions import in_queue
from bridge.poller.owners import OwnerRunner
from bridge.slurm import JobInfo, SlurmError
from bridge.store import TaskRecord

log = logging.getLogger("bridge.poller")

#: Site mode: how long an ended job waits for its owner's records to be readable again (sudo
#: or the owner's account away) before it is decided from Slurm's word alone.
RECORDS_UNREADABLE_GRACE = 300.0


class JobWatch:
    """squeue's and sacct's answers for the followed jobs, when Slurm stopped knowing a job,
    and (site mode) the jobs' records read as their owners. update() reads them all once per
    cycle and never raises: a failed squeue is kept in `unavailable` (nothing can be decided
    then), a failed sacct leaves the jobs that left the queue unknown until the next cycle."""

    def __init__(self, ctx: PollerContext, owners: OwnerRunner | None) -> None:
        self.ctx = ctx
        #: Site mode: reads the records as each task's owner.
        self.owners = owners
        #: Why squeue failed on the last update (None: it answered).
        self.unavailable: str | None = None
        self._queue: dict[str, JobInfo] = {}
        self._accounting: dict[str, JobInfo] = {}
        #: Site mode: the records read as each owner, by task id (and of a staged task's
        #: stage-in job, by task id and that job's id).
        self._records: dict[str, JobRecords] = {}
        self._stage_in_records: dict[tuple[str, str], JobRecords] = {}
        #: Site mode: tasks whose owner's records could not be read: since when.
        self._unreadable_since: dict[str, float] = {}
        #: Followed jobs that neither squeue nor sacct knows: since when.
        #: (job id, job name) -> when neither squeue nor sacct knew that job.
        self._missing_since: dict[tuple[str, str], float] = {}
        #: The last update left Slurm unread to spare the call budget (see _due).
        self.paced = False
        #: When the last update read Slurm, and the budget's calls it spent.
        self._read_at = float("-inf")
        self._read_cost = 0

    def update(self, tasks: list[TaskRecord], awaited: Iterable[str], stats: CycleStats) -> None:
        """Read what Slurm says of `tasks`' jobs; `awaited`: finished jobs whose final record
        is still read from sacct (they ride on the same call)."""
        job_ids = [job_id for job_id, _ in _job_keys(tasks)]
        self.paced = not self._due()
        if self.paced:
            return
        spent = self.ctx.slurm.budget.spent
        self._read_at = self.ctx.clock()
        try:
            queue = self._squeue_with_leaving(job_ids, stats)
        except SlurmError as exc:
            log.warning("squeue failed; keeping the last known states: %s", short(exc))
            self.unavailable = short(exc)
            return
        self.unavailable = None
        names = _names_by_job_id(tasks)
        self._queue = _theirs(queue, names)
        if self.owners is not None:
            self._records = self._read_records_as_owners(self.owners, tasks)
        left = [j for j in job_ids if j not in queue or queue[j].ended]
        gone = set(left)
        left += [job_id for job_id in awaited if job_id not in gone]
        self._accounting = _theirs(self._sacct(left, stats), names)
        now = self.ctx.clock()
        self._missing_since = {
            key: self._missing_since.get(key, now)
            for key in _job_keys(tasks)
            if self.job(*key) is None
        }
        self._read_cost = self.ctx.slurm.budget.spent - spent

    def _due(self) -> bool:
        """Whether to read Slurm this cycle. While the call budget is below half its burst
        (submissions and cancels are waiting for it), the reads take at most half its rate:
        they come no sooner than the last one's calls take at that pace."""
        budget = self.ctx.slurm.budget
        if not budget.rate or budget.available() * 2 >= budget.burst:
            return True
        return self.ctx.clock() - self._read_at >= self._read_cost / (budget.rate / 2)

    def _read_records_as_owners(
        self, owners: OwnerRunner, tasks: list[TaskRecord]
    ) -> dict[str, JobRecords]:
        """One read per owner, of the jobs that have started (a pending one recorded nothing),
        and of the stage-in jobs of staged tasks whose own job has not."""
        waiting = {j for j, info in self._queue.items() if info.tes_state == State.QUEUED.value}
        jobs = [(t, t.job_id) for t in tasks if t.job_id and t.job_id not in waiting]
        for task in tasks:
            # A staged task's stage-in job keeps its records apart until the task's job starts.
            chain = chain_of_task(task)
            if task.job_id in waiting and chain is not None and chain.stage_in:
                jobs.append((task, chain.stage_in))
        found = owners.read_jobs(jobs)
        own_job = {t.id: t.job_id for t in tasks}
        self._stage_in_records = {k: r for k, r in found.items() if k[1] != own_job.get(k[0])}
        self._note_unreadable(jobs, found)
        return {k[0]: r for k, r in found.items() if k[1] == own_job.get(k[0])}

    def _note_unreadable(
        self, asked: list[tuple[TaskRecord, str]], found: dict[tuple[str, str], JobRecords]
    ) -> None:
        """Since when each task's asked records could not be read (see records_unreadable)."""
        now = self.ctx.clock()
        self._unreadable_since = {
            t.id: self._unreadable_since.get(t.id, now)
            for t, job_id in asked
            if t.owner and (t.id, job_id) not in found
        }

    def records_unreadable(self, task: TaskRecord) -> bool:
        """Site mode: the owner's records of the task's job could not be read, lately (for
        less than RECORDS_UNREADABLE_GRACE): nothing is decided of an ended job meanwhile."""
        since = self._unreadable_since.get(task.id)
        return since is not None and self.ctx.clock() - since < RECORDS_UNREADABLE_GRACE

    def _squeue_with_leaving(self, job_ids: list[str], stats: CycleStats) -> dict[str, JobInfo]:
        """squeue's word on the followed jobs, and on the jobs of decided tasks Slurm still
        held (same call): those it lists no more, or lists as ended, leave jobs_leaving."""
        leaving = dict(self.ctx.jobs_leaving)
        followed = set(job_ids)
        asked = job_ids + sorted({job_id for job_id, _ in leaving if job_id not in followed})
        queue = self._squeue(asked, stats)
        self.ctx.jobs_leaving = {
            key: owner for key, owner in leaving.items() if _held(queue.get(key[0]), key[1])
        }
        return queue

    def _squeue(self, job_ids: list[str], stats: CycleStats) -> dict[str, JobInfo]:
        if not job_ids:
            return {}
        stats.slurm_calls += 1
        return self.ctx.slurm.queue(job_ids)

    def _sacct(self, job_ids: list[str], stats: CycleStats) -> dict[str, JobInfo]:
        if not job_ids:
            return {}
        try:
            stats.slurm_calls += 1
            return self.ctx.slurm.accounting(job_ids)
        except SlurmError as exc:
            log.warning("sacct failed; finished jobs wait for the next cycle: %s", short(exc))
            return {}

    def job(self, job_id: str, name: str | None = None) -> JobInfo | None:
        """What Slurm says of the job: sacct's record once it left the queue, else squeue's;
        with `name`, only a record of a job of that name (another job may have the id).
        A job out of the queue that sacct still holds as pending or running is unknown: sacct
        lags behind for a moment, or keeps for ever a job slurmctld forgot (killed before it
        saved its state); past the grace time, it is lost (decisions.decide)."""
        accounted = _named(self._accounting.get(job_id), name)
        queued = _named(self._queue.get(job_id), name)
        if accounted is not None and not accounted.ended and queued is None:
            return None
        return accounted or queued

    def seen_started(self, job_id: str) -> bool:
        """The last update saw the job started (running, or ended)."""
        job = self.job(job_id)
        return job is not None and not in_queue(job)

    def holds(self, task: TaskRecord) -> bool:
        """squeue's last word has the task's job pending, running or completing."""
        assert task.job_id is not None
        return _held(self._queue.get(task.job_id), submitted_name(task))

    def note_leaving(self, task: TaskRecord) -> None:
        """The task is decided, but Slurm may still hold its job: admission counts the job
        until squeue lists it no more (PollerContext.jobs_leaving). Without admission
        control nothing counts them, and nothing is asked of Slurm for them."""
        assert task.job_id is not None
        if not self.ctx.admission_control:
            return
        self.ctx.jobs_leaving[(task.job_id, submitted_name(task))] = task.owner

    def job_of(self, task: TaskRecord) -> JobInfo | None:
        """What Slurm says of the task's job (by its id and its name)."""
        assert task.job_id is not None
        return self.job(task.job_id, submitted_name(task))

    def final_record(self, job_id: str) -> JobInfo | None:
        """sacct's record of a finished job, when it has one."""
        job = self._accounting.get(job_id)
        return job if job is not None and job.ended else None

    def missing_for(self, task: TaskRecord, job: tuple[str, str] | None = None) -> float | None:
        """How long neither squeue nor sacct has known the task's job (`job`: that one of its
        chain, by id and name); None while one does."""
        assert task.job_id is not None
        since = self._missing_since.get(job or (task.job_id, submitted_name(task)))
        return None if since is None else self.ctx.clock() - since

    def records(self, task: TaskRecord) -> JobRecords:
        """What the task's job recorded (nothing while it waits in the queue)."""
        assert task.job_id is not None
        if in_queue(self.job_of(task)):
            return JobRecords(job_id=task.job_id)
        if self.owners is not None:
            return self._records.get(task.id) or JobRecords(job_id=task.job_id)
        return self.read_records(task)

    def records_of(self, task: TaskRecord, records_id: str) -> JobRecords:
        """What the job `records_id` of the task's chain recorded (the stage-in job's own, or
        the task's job's), read now (site mode: as read this cycle)."""
        if self.owners is None:
            return self.read_records(task, records_id)
        if records_id == task.job_id:
            return self._records.get(task.id) or JobRecords(job_id=records_id)
        found = self._stage_in_records.get((task.id, records_id))
        return found or JobRecords(job_id=records_id)

    def read_records(self, task: TaskRecord, records_id: str | None = None) -> JobRecords:
        """What the task's job (or `records_id`: a job of its chain) recorded, read now
        whatever Slurm last said (not in site mode, where only the job's owner may read them)."""
        assert task.job_id is not None
        keep = self.ctx.config.job.log_tail_bytes
        job_id = records_id or task.job_id
        return read_records(self.ctx.task_dir(task.id), job_id, keep_bytes=keep)


def _names_by_job_id(tasks: list[TaskRecord]) -> dict[str, set[str]]:
    """The job names followed under each id: two tasks may follow one id (Slurm gave a
    forgotten job's id to another task's job)."""
    names: dict[str, set[str]] = {}
    for job_id, name in _job_keys(tasks):
        names.setdefault(job_id, set()).add(name)
    return names


def _job_keys(tasks: list[TaskRecord]) -> list[tuple[str, str]]:
    """The (id, name) of each job followed: the tasks' jobs, and the transfer jobs of staged
    tasks still asked of Slurm (chain.watched)."""
    keys = []
    for task in tasks:
        if not task.job_id:
            continue
        keys.append((task.job_id, submitted_name(task)))
        chain = chain_of_task(task)
        if chain is not None:
            keys += watched(chain, attempt_metadata(task))
    return keys


def _named(info: JobInfo | None, name: str | None) -> JobInfo | None:
    """The record, unless it names another job than `name`."""
    if info is None or name is None or not info.name or info.name == name:
        return info
    return None


def _held(info: JobInfo | None, name: str) -> bool:
    """squeue's record is of the job named `name`, which Slurm still holds (not ended)."""
    named = _named(info, name)
    return named is not None and not named.ended


def _theirs(found: dict[str, JobInfo], names: dict[str, set[str]]) -> dict[str, JobInfo]:
    """Leave out a record of another job under a followed job's id. Slurm reuses the ids of
    jobs it forgot (a slurmctld killed before it saved its state): the followed job is then
    unknown to it, and the id names someone else's job, whose state is not this task's."""
    return {
        job_id: info
        for job_id, info in found.items()
        if not info.name or job_id not in names or info.name in names[job_id]
    }
