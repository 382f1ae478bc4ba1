"""Finding again the jobs of interrupted submissions (a crash between sbatch and the database
write, or an sbatch that failed without an answer), by job name (an array's element by the
array's name and the element stored with the task before sbatch; a staged task's chain in
arrays, its element of each part's array): a task is never submitted twice.

An sbatch may create its job later than the poller looks for it: with two login nodes, a leader
frozen between its lease check and its sbatch for longer than the lease; with one, an sbatch that
timed out while slurmctld held the request, acted on after the settle time. So a poller that
finds no job fences the task's directory (`bridge.job.layout.write_lease_fence`) at its fence
token (`PollerContext.fence_token`: an elected leader's epoch, a lone poller's clock) and looks
again: a job it still does not find, whose sbatch started before the fence, stands down when it
starts (templates/job.sh.j2); a task whose fence cannot be written is not submitted again until
it can. A task whose job is found is not fenced: that job is the task's run (fencing it would
make it stand down and be submitted again)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from bridge.core.naming import RUN_PART, STAGE_IN_PART, STAGE_OUT_PART
from bridge.job.layout import write_lease_fence
from bridge.poller.arrays import ARRAY_JOB_KEY, array_mark, element_index, submitted_name
from bridge.poller.attempt import AttemptLog, TaskLogs
from bridge.poller.chain import PART_KEYS, Chain, chain_of_task
from bridge.poller.context import CycleStats, PollerContext
from bridge.poller.owners import OwnerCommandError, OwnerRunner
from bridge.slurm import JobInfo, SlurmError
from bridge.store import TaskRecord

log = logging.getLogger("bridge.poller")


class Recovery:
    def __init__(self, ctx: PollerContext, owners: OwnerRunner | None = None) -> None:
        self.ctx = ctx
        #: Site mode: the fence is written as the task's owner.
        self.owners = owners
        #: The token each interrupted task's directory is fenced at (by this poller), by task id
        #: and the part of a staged task's chain fenced alone (None: the whole task).
        self._fenced: dict[tuple[str, str | None], int] = {}
        #: Submits the jobs a staged task's chain lacks (ChainSbatch.resume; set by the loop).
        self.resume_chain: Callable[[TaskRecord, Chain, CycleStats], int] | None = None
        #: Submits the arrays staged tasks of the same arrays lack (StagedArraySbatch.resume;
        #: set by the loop).
        self.resume_arrays: Callable[[list[tuple[TaskRecord, Chain]], CycleStats], int] | None = (
            None
        )
        #: This look's staged tasks in arrays to resume, by their arrays (name, ids found).
        self._to_resume: dict[tuple[str | None, ...], list[tuple[TaskRecord, Chain]]] = {}
        #: Until then (this poller's clock) no interrupted submission is forgotten: set on a
        #: takeover, when the old leader's sbatch may still be under way on another host
        #: (see `hold_after_takeover`).
        self.hold_until = float("-inf")

    def hold_after_takeover(self) -> None:
        """A new leader: the old one started no sbatch after its lease ended by its own clock,
        which was before this takeover, and each sbatch is killed at its time-out; so "no
        job" is believed only `command_timeout + submit_settle` after now, whatever the old
        host's clock wrote into `submit_started_at`."""
        slurm_cfg = self.ctx.config.slurm
        self.hold_until = self.ctx.clock() + slurm_cfg.command_timeout + slurm_cfg.submit_settle

    def recover(self, stats: CycleStats) -> None:
        """Tasks whose `sbatch` started but whose job id was never stored: look for the job
        (an array's element: by the array's name and the task's element in it). A task whose
        job is not found once the sbatch has settled is fenced, then looked for again: only a
        task fenced before a look that found nothing is forgotten (and submitted again)."""
        pending = self.ctx.store.interrupted_submissions()
        ids = {task.id for task in pending}
        self._fenced = {key: e for key, e in self._fenced.items() if key[0] in ids}
        if not pending:
            return
        names: dict[str, list[tuple[TaskRecord, str | None]]] = {}
        chains: list[tuple[TaskRecord, Chain]] = []
        for task in pending:
            chain = chain_of_task(task)
            if chain is not None:
                chains.append((task, chain))
                for part, job_id in chain.parts():
                    if job_id is None:
                        names.setdefault(chain.name_of(part), [])
                continue
            mark = array_mark(task)
            name, index = mark if mark else (submitted_name(task), None)
            names.setdefault(name, []).append((task, index))
        # Fenced before this look: a job of the old leader not found now stands down.
        fenced = self._fenced_now()
        try:
            stats.slurm_calls += 2
            found = self.ctx.slurm.find_by_names(list(names))
        except SlurmError as exc:
            log.warning("cannot look for interrupted submissions yet: %s", exc)
            return
        # An sbatch dies with the poller and is killed at its time-out, but slurmctld may still
        # act on a request it received: "no job" is believed only once that time has passed.
        slurm_cfg = self.ctx.config.slurm
        settled_before = self.ctx.clock() - slurm_cfg.command_timeout - slurm_cfg.submit_settle
        to_fence: list[tuple[TaskRecord, str | None]] = []
        for name, members in names.items():
            jobs = found.get(name, [])
            for task, index in members:
                if not self._adopted(task, index, jobs):
                    to_fence += self._no_job(task, settled_before, fenced)
        for task, chain in chains:
            to_fence += self._recover_chain(task, chain, found, settled_before, fenced, stats)
        self._resume_arrays(stats)
        self._fence(to_fence)

    def _recover_chain(
        self,
        task: TaskRecord,
        chain: Chain,
        found: dict[str, list[JobInfo]],
        settled_before: float,
        fenced: set[tuple[str, str | None]],
        stats: CycleStats,
    ) -> list[tuple[TaskRecord, str | None]]:
        """A staged task's interrupted chain (poller.chain): its jobs found by name are
        adopted, in order; a chain found whole is the task's; the missing jobs are submitted
        (`resume_chain`; in arrays, with the tasks of the same arrays: `resume_arrays`) once
        their sbatch has settled and the first of them was fenced alone (the jobs found were
        submitted under the same token and go on), none twice. A chain without its stage-in job
        is forgotten like any job not found."""
        now = _chain_found(task, chain, found)
        if now != chain:
            task.logs = _with_chain(task, now)
            log.info("found jobs %s of the interrupted chain of task %s", now.ids(), task.id)
            self.ctx.store.note_submission(task.id, logs=task.logs)
        if now.stage_in is None:
            return self._no_job(task, settled_before, fenced)
        # The first job not found (the task's or the stage-out); none: the chain is whole.
        missing = next((part for part, job_id in now.parts() if job_id is None), None)
        if missing is None:
            assert now.run is not None
            self.ctx.store.record_job(task.id, now.run, logs=task.logs)
        elif (task.submit_started_at or 0.0) > settled_before or self._holding():
            log.info("interrupted chain of task %s: looking again for its later jobs", task.id)
        elif (task.id, missing) in fenced:
            # Fenced alone: a late job of that part stands down; the jobs found go on.
            self._resume(task, now, stats)
        else:
            return [(task, missing)]
        return []

    def _resume(self, task: TaskRecord, chain: Chain, stats: CycleStats) -> None:
        """Submit the jobs the chain lacks: at once for a chain of its own; for a staged task
        in arrays, with the others of its arrays that lack the same (`_resume_arrays`)."""
        if array_mark(task) is None:
            if self.resume_chain is not None:
                self.resume_chain(task, chain, stats)
            return
        arrays = tuple(job_id.partition("_")[0] if job_id else None for _, job_id in chain.parts())
        self._to_resume.setdefault((chain.name, *arrays), []).append((task, chain))

    def _resume_arrays(self, stats: CycleStats) -> None:
        """The missing arrays of this look's staged tasks in arrays, one sbatch per array."""
        groups, self._to_resume = self._to_resume, {}
        if self.resume_arrays is None:
            return
        for chains in groups.values():
            self.resume_arrays(chains, stats)

    def _adopted(self, task: TaskRecord, index: str | None, jobs: list[JobInfo]) -> bool:
        """Whether the task's job is among `jobs` (an array's: the array is, its element may not
        be listed yet), and taken as the task's."""
        if index is not None:
            if jobs:
                self._adopt_element(task, index, jobs)
            return bool(jobs)
        job = _newest_job_of_this_attempt(task, jobs)
        if job is not None:
            self._adopt(task, job)
        return job is not None

    def _no_job(
        self, task: TaskRecord, settled_before: float, fenced: set[tuple[str, str | None]]
    ) -> list[tuple[TaskRecord, str | None]]:
        """No job found for the task: wait for its sbatch to settle, forget it once it was
        fenced before this look, else the task to fence now ([(task, None)])."""
        if (task.submit_started_at or 0.0) > settled_before or self._holding():
            log.info("interrupted submission of task %s: no job yet, looking again", task.id)
        elif (task.id, None) in fenced:
            # No job before the fence, and none after it may run: submitted again.
            self.ctx.store.forget_submission(task.id, attempt=max(task.attempt - 1, 0))
        else:
            return [(task, None)]
        return []

    def _fenced_now(self) -> set[tuple[str, str | None]]:
        """The tasks (and parts of chains) this poller has fenced (an elected one: at its
        current epoch)."""
        epoch = self.ctx.store.fence_epoch
        if epoch is None:
            return set(self._fenced)
        return {key for key, e in self._fenced.items() if e == epoch}

    def _fence(self, tasks: list[tuple[TaskRecord, str | None]]) -> None:
        """Fence the directories of tasks whose job was not found (or the part of a staged
        task's chain not found), at this leader's epoch: the next look, finding none again,
        forgets them. Only those: a job that was found is the task's, and runs."""
        if not tasks:
            return
        epoch = self.ctx.fence_token()
        for task, part in tasks:
            task_dir = self.ctx.task_dir(task.id)
            try:
                if self.owners is not None and task.owner:
                    self.owners.fence(task.owner, task_dir, epoch, part)
                else:
                    write_lease_fence(task_dir, epoch, part)
            except (OSError, OwnerCommandError) as exc:
                log.warning("cannot fence the directory of task %s yet: %s", task.id, exc)
                continue
            log.info("interrupted submission of task %s: no job, fenced, looking again", task.id)
            self._fenced[(task.id, part)] = epoch

    def _adopt(self, task: TaskRecord, job: JobInfo) -> None:
        log.info("found job %s of interrupted submission of task %s", job.job_id, task.id)
        # Canceled while its sbatch ran: record_job marks the job for scancel.
        self.ctx.store.record_job(task.id, job.job_id)

    def _adopt_element(self, task: TaskRecord, index: str, jobs: list[JobInfo]) -> None:
        """The array exists: the task's job is its element `index`, never submitted again."""
        element = next((j for j in jobs if element_index(j.job_id) == index), None)
        if element is None:
            # The array was created with this element (the manifest was fixed before sbatch);
            # Slurm shows it once squeue or sacct lists it.
            log.info("array of task %s found, element %s not listed yet", task.id, index)
            return
        array_id = element.job_id.partition("_")[0]
        logs = TaskLogs(task.logs)
        metadata = logs.attempt(max(task.attempt, 1)).ensure_metadata()
        metadata.update({"slurm_job_id": element.job_id, ARRAY_JOB_KEY: array_id})
        log.info("found job %s of interrupted submission of task %s", element.job_id, task.id)
        self.ctx.store.record_job(task.id, element.job_id, logs=logs.to_json())

    def _holding(self) -> bool:
        return self.ctx.clock() < self.hold_until


def _chain_found(task: TaskRecord, chain: Chain, found: dict[str, list[JobInfo]]) -> Chain:
    """The chain with its jobs `found` by name, in order, up to the first not found; a staged
    task in arrays (submit.staged) has its element of each part's array, by its index."""
    ids = dict(chain.parts())
    mark = array_mark(task)
    for part, job_id in chain.parts():
        if job_id is None:
            jobs = found.get(chain.name_of(part), [])
            if mark is not None:
                jobs = [j for j in jobs if element_index(j.job_id) == mark[1]]
            job = _newest_job_of_this_attempt(task, jobs)
            if job is None:
                break
            ids[part] = job.job_id
    return Chain(chain.name, ids[STAGE_IN_PART], ids[RUN_PART], ids[STAGE_OUT_PART])


def _with_chain(task: TaskRecord, chain: Chain) -> list[dict[str, Any]]:
    """The task's logs with the chain's job ids in its attempt's metadata."""
    logs = TaskLogs(task.logs)
    metadata = logs.attempt(max(task.attempt, 1)).ensure_metadata()
    for part, job_id in chain.parts():
        if job_id:
            metadata[PART_KEYS[part] + "_job_id" if part in PART_KEYS else "slurm_job_id"] = job_id
    if chain.run and element_index(chain.run) is not None:  # staged tasks in arrays
        metadata[ARRAY_JOB_KEY] = chain.run.partition("_")[0]
    return logs.to_json()


def _newest_job_of_this_attempt(task: TaskRecord, jobs: list[JobInfo]) -> JobInfo | None:
    # Jobs of earlier attempts (lost to NODE_FAIL, ...) carry the same name: each attempt's
    # lost jobs, and in logs stored with one entry per job, the entries before this one.
    earlier: set[str | None] = {
        job_id for entry in task.logs or [] for job_id in AttemptLog.from_json(entry).lost_jobs()
    }
    earlier |= {
        (entry.get("metadata") or {}).get("slurm_job_id")
        for entry in (task.logs or [])[: max(task.attempt - 1, 0)]
    }
    ours = [j for j in jobs if j.job_id not in earlier]
    ours.sort(key=lambda j: int(j.job_id.split("_")[0]))
    return ours[-1] if ours else None
