"""Following jobs: what Slurm and the jobs said (watch.JobWatch, read once per cycle), each
task's TES state and logs from it (decisions.decide), written in batches."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from bridge.core import backend_params
from bridge.core.naming import RUN_PART, STAGE_OUT_PART
from bridge.core.tes import TERMINAL_STATES, State
from bridge.job.records import JobRecords
from bridge.poller.arrays import attempt_metadata
from bridge.poller.attempt import AttemptLog, TaskLogs
from bridge.poller.chain import (
    PART_KEYS,
    Chain,
    Position,
    adjust,
    chain_of_task,
    jobs_held,
    part_facts,
    position,
    stage_in_done,
)
from bridge.poller.context import CycleStats, PollerContext, short
from bridge.poller.decisions import (
    TIME_LIMIT_KEY,
    decide,
    fill_attempt_log,
    in_queue,
    log_decision,
    slurm_facts,
)
from bridge.poller.owners import OwnerRunner
from bridge.poller.watch import JobWatch
from bridge.slurm import JobInfo, SlurmError
from bridge.store import JobDecision, TaskRecord, unavailable_reason
from bridge.system import metrics

log = logging.getLogger("bridge.poller")

#: A finished task's Slurm facts (final state, node, elapsed, MaxRSS) come from sacct; when the
#: job recorded its outcome before slurmdbd had its final record, they are read again on the
#: following cycles, for at most this long.
FINAL_FACTS_GRACE = 300.0
#: Task updates committed together (each batch one transaction): 10,000 state changes cost
#: 40 commits instead of 10,000, while a batch holds SQLite's write lock for tens of ms only.
DECISION_BATCH = 256
#: After the job's final record, how long its MaxRSS is waited for.
FINAL_RSS_WAIT = 15.0


@dataclass(frozen=True)
class AwaitedFacts:
    """A finished task's job (or a job of its chain) whose final Slurm facts sacct did not
    have yet."""

    task_id: str
    job_id: str
    attempt: int
    since: float


@dataclass(frozen=True)
class _Canceled:
    """A task whose job was scanceled, until sacct has the job's final record."""

    task: TaskRecord
    since: float


@dataclass
class _Decided:
    """A decision to write, and what the metrics are told once it changed the task."""

    update: JobDecision
    creation_time: str | None
    attempt_log: dict[str, Any]
    before: State
    after: State
    job_done: bool

    def observe(self) -> None:
        metrics.observe_task_change(
            self.creation_time,
            self.attempt_log,
            self.before.value,
            self.after.value,
            self.job_done,
        )
        if self.after is not self.before and self.after in TERMINAL_STATES:
            metrics.observe_finished(self.after.value)


class Follower:
    def __init__(self, ctx: PollerContext, owners: OwnerRunner | None) -> None:
        self.ctx = ctx
        self.watch = JobWatch(ctx, owners)
        #: Finished tasks' jobs whose final Slurm facts are still read from sacct, by task id
        #: and job id.
        self._awaited: dict[tuple[str, str], AwaitedFacts] = {}
        #: Canceled tasks whose job's final record is still read from sacct, by task id.
        self._canceled: dict[str, _Canceled] = {}
        #: Tasks of the last follow() whose job is done with (final, or to be submitted again).
        self.finished: set[str] = set()
        #: Jobs of staged tasks' chains that are done with while Slurm still holds them (a
        #: failed stage-in's later jobs), by who cancels them (site mode: the task's owner):
        #: canceled at the end of the follow, one scancel each.
        self._leftovers: dict[str | None, list[str]] = {}
        #: This follow's count of PollerContext.chain_jobs_beyond_one.
        self._chain_jobs: dict[str | None, int] = {}

    def await_canceled(self, task: TaskRecord) -> None:
        """`task` was canceled and its job scanceled: the job's final facts (sacct's state, end
        time, node, elapsed time) and what it recorded (the executor logs whose exit code is
        known) are written into its log once sacct has them, for at most FINAL_FACTS_GRACE."""
        if task.job_id:
            self._canceled[task.id] = _Canceled(task, self.ctx.clock())
            self.watch.note_leaving(task)  # a running job takes a moment to end

    def follow(self, tasks: list[TaskRecord], stats: CycleStats) -> None:
        self.finished = set()
        if not tasks and not self._awaited and not self._canceled and not self.ctx.jobs_leaving:
            return
        awaited = dict(self._awaited)
        canceled = dict(self._canceled)
        watched = tasks + [c.task for c in canceled.values()]
        self.watch.update(watched, [facts.job_id for facts in awaited.values()], stats)
        if self.watch.unavailable or self.watch.paced:
            return  # the tasks keep their last known states
        batch: list[_Decided] = []
        self._chain_jobs = {}
        for task in tasks:
            if self.watch.records_unreadable(task) and not in_queue(self.watch.job_of(task)):
                # Decided from Slurm alone, a job that recorded its outcome could end wrong
                # (a failed executor's job ends FAILED, as a job stopped before its end does).
                continue
            try:
                batch.append(self._decide(task))
            except Exception:
                log.exception("updating task %s failed unexpectedly", task.id)
            if len(batch) == DECISION_BATCH:  # written as they come: a batch's logs at most
                stats.updated += self._apply(batch)
                batch = []
        if batch:
            stats.updated += self._apply(batch)
        self.ctx.chain_jobs_beyond_one = self._chain_jobs
        self._refresh_facts(awaited)
        self._finish_canceled(canceled)
        self._cancel_leftovers(stats)

    def finish_recorded(self, recorded: list[tuple[str, str]], stats: CycleStats) -> None:
        """Decide the tasks of `recorded` (task id, job id) whose job wrote its outcome from
        their records, without a Slurm command. Slurm's last word on the job (squeue's, at the
        last cycle) is used only where it says the job started: one that started and ended
        since has recorded all the same. A task this cannot decide is left to the next cycle."""
        batch: list[_Decided] = []
        for task_id, job_id in recorded:
            try:
                task = self.ctx.store.get_task(task_id)
                if task is None or task.job_id != job_id or State(task.state) in TERMINAL_STATES:
                    continue
                records = self.watch.read_records(task)
                if records.outcome is not None:
                    job = self.watch.job_of(task)
                    known = None if in_queue(job) else job
                    batch.append(self._decide(task, job=known, records=records))
            except Exception as exc:
                if unavailable_reason(exc):
                    raise
                log.exception("updating task %s failed unexpectedly", task_id)
        if batch:
            stats.updated += self._apply(batch)

    def _decide(
        self, task: TaskRecord, job: JobInfo | None = None, records: JobRecords | None = None
    ) -> _Decided:
        """The task's decision from what the watch read this cycle (or from `job` and
        `records`, given by finish_recorded)."""
        assert task.job_id is not None
        chain = chain_of_task(task)
        at, job, records = self._view(task, chain, job, records)
        current = State(task.state)
        logs = TaskLogs(task.logs)
        attempt = max(task.attempt, 1)
        entry = logs.attempt(attempt)
        missing = (at.job_id, chain.name_of(at.part)) if at and chain else None
        decision = decide(
            job=job,
            records=records,
            attempt=task.attempt,
            retries=self.ctx.config.slurm.retries,
            current=current,
            time_limit=(entry.metadata or {}).get(TIME_LIMIT_KEY),
            missing_for=self.watch.missing_for(task, missing),
            on_preemption=self._on_preemption(task, job),
        )
        if at is not None:
            decision = adjust(decision, at)
        log_decision(entry, decision, records, job)
        if chain is not None:
            self._chain_facts(entry, chain, task, at, decision.job_done)
        if decision.retry:
            entry.lose_job()  # the next job continues this attempt (see poller.attempt)
        if decision.job_done:
            self.finished.add(task.id)
            if self.watch.holds(task):  # decided from its records before Slurm let it go
                self.watch.note_leaving(task)
        if decision.final:
            run_job = job if at is None or at.part == RUN_PART else None
            self._await_facts(task, attempt, chain, run_job)
        new_logs = logs.to_json()
        update = JobDecision(
            task.id,
            task.job_id,
            state=None if decision.state is current else decision.state,
            logs=None if new_logs == task.logs else new_logs,
            resubmit=decision.retry,
            cancel_job=decision.cancel_job,
        )
        return _Decided(
            update,
            task.creation_time,
            entry.to_json(),
            current,
            decision.state,
            decision.job_done,
        )

    def _on_preemption(self, task: TaskRecord, job: JobInfo | None) -> str:
        """The task's own backend_parameters.on_preemption, else the site's. Its document is
        read only for a job Slurm preempted: following jobs reads none (tasks_in_flight)."""
        site = self.ctx.config.slurm.on_preemption
        if job is None or job.state != "PREEMPTED":
            return site
        stored = task if task.document is not None else self.ctx.store.get_task(task.id)
        resources = ((stored.document if stored else None) or {}).get("resources") or {}
        return backend_params.on_preemption(resources.get("backend_parameters"), site)

    def _view(
        self,
        task: TaskRecord,
        chain: Chain | None,
        job: JobInfo | None,
        records: JobRecords | None,
    ) -> tuple[Position | None, JobInfo | None, JobRecords]:
        """What the task is decided from: the part of its chain it is at (None: its one job),
        that job and the records; `records` given (finish_recorded): those, with `job`."""
        if records is not None:
            return None, job, records
        if chain is not None:
            return self._chain_view(task, chain)
        return None, self.watch.job_of(task), self.watch.records(task)

    def _await_facts(
        self, task: TaskRecord, attempt: int, chain: Chain | None, job: JobInfo | None
    ) -> None:
        """A final task's jobs whose final facts sacct did not give yet (`job`: what Slurm said
        of the task's job, None when not read this time) are read again on the next cycles;
        a staged task's stage-out job's too."""
        assert task.job_id is not None
        now = self.ctx.clock()
        if job is None or not job.ended or job.max_rss_bytes is None:
            self._awaited[(task.id, task.job_id)] = AwaitedFacts(task.id, task.job_id, attempt, now)
        if chain is not None and chain.stage_out:
            out = self.watch.job(chain.stage_out, chain.name_of(STAGE_OUT_PART))
            if out is None or not out.ended:
                facts = AwaitedFacts(task.id, chain.stage_out, attempt, now)
                self._awaited[(task.id, chain.stage_out)] = facts

    def _chain_view(
        self, task: TaskRecord, chain: Chain
    ) -> tuple[Position | None, JobInfo | None, JobRecords]:
        """Where a staged task's chain is (poller.chain.position), that part's job, and the
        records that hold the task's."""
        if not (chain.stage_in and chain.run and chain.stage_out):
            # An earlier version's marks, or a chain recovery has not completed: the task's job.
            return None, self.watch.job_of(task), self.watch.records(task)
        jobs = {
            job_id: self.watch.job(job_id, chain.name_of(part))
            for part, job_id in chain.parts()
            if job_id
        }
        done = stage_in_done(attempt_metadata(task))
        at = position(chain, jobs, done)
        if (beyond_one := jobs_held(chain, jobs, at) - 1) > 0:
            self._chain_jobs[task.owner] = self._chain_jobs.get(task.owner, 0) + beyond_one
        job = jobs.get(at.job_id)
        if in_queue(job):
            return at, job, JobRecords(job_id=at.records_id)
        return at, job, self.watch.records_of(task, at.records_id)

    def _chain_facts(
        self,
        entry: AttemptLog,
        chain: Chain,
        task: TaskRecord,
        at: Position | None,
        done: bool,
    ) -> None:
        """The attempt's metadata of a staged task: `slurm_job_id` is the task's job, Slurm's
        facts of a transfer job go under its part's keys (not the task's job's); a chain done
        with leaves no job behind."""
        metadata = entry.ensure_metadata()
        run = task.job_id
        assert run is not None
        owner = task.owner if self.ctx.site else None
        for part, job_id in chain.parts():
            job = self.watch.job(job_id, chain.name_of(part)) if job_id else None
            if job is None:
                continue
            if part in PART_KEYS:
                part_facts(metadata, part, job)
            if done and in_queue(job):
                # Never to run: a later part after a chain that ended (a failed stage-in).
                self._leftovers.setdefault(owner, []).append(job.job_id)
        if at is not None and at.part != RUN_PART:
            # fill_attempt_log wrote the transfer job's as the task's job's: put them back.
            run_job = self.watch.job(run, chain.name)
            for key in ("slurm_state", "slurm_node", "slurm_partition", "slurm_elapsed_seconds"):
                metadata.pop(key, None)
            if run_job is not None and not in_queue(run_job):
                slurm_facts(metadata, run_job)
        metadata["slurm_job_id"] = run

    def _cancel_leftovers(self, stats: CycleStats) -> None:
        """One scancel (per owner in site mode) for the chains' jobs that are done with (a
        failed stage-in's later jobs, which Slurm cancels for their dependency too, a moment
        later)."""
        leftovers, self._leftovers = self._leftovers, {}
        for owner, job_ids in leftovers.items():
            try:
                self.ctx.check_lease()
                stats.slurm_calls += 1
                self.ctx.slurm.cancel(sorted(set(job_ids)), as_user=owner)
            except SlurmError as exc:
                log.warning("cannot cancel the chain jobs %s: %s", job_ids, short(exc))

    def _apply(self, batch: list[_Decided]) -> int:
        """One transaction for the batch. A crash between batches loses only uncommitted
        decisions, and those tasks keep their last state: the next cycle decides them again
        from Slurm and the job's records, and every update is conditional on the state it
        expects, so applying a decision again changes nothing it should not."""
        updates = [decided.update for decided in batch]
        changed: list[JobDecision] = []
        try:
            changed = self.ctx.store.apply_decisions(updates)
        except Exception as exc:
            if unavailable_reason(exc):
                raise  # the cycle fails and is tried again
            # The batch rolled back whole: one by one, so a bad row costs only its own update.
            for update in updates:
                try:
                    changed += self.ctx.store.apply_decisions([update])
                except Exception:
                    log.exception("updating task %s failed unexpectedly", update.task_id)
        changed_tasks = {update.task_id for update in changed}
        for decided in batch:
            if decided.update.task_id in changed_tasks:
                decided.observe()
        return len(changed)

    def _refresh_facts(self, awaited: dict[tuple[str, str], AwaitedFacts]) -> None:
        """Write sacct's final record into finished tasks that were missing it."""
        now = self.ctx.clock()
        for key, facts in awaited.items():
            task_id = facts.task_id
            job = self.watch.final_record(facts.job_id)
            if job is not None:
                self._write_facts(task_id, facts.attempt, job)
                # A step's MaxRSS can land in slurmdbd a moment after the job's own record;
                # a job too short for any accounting sample never gets one.
                ended_ago = now - job.end_time.timestamp() if job.end_time else 0.0
                if job.max_rss_bytes is not None or ended_ago > FINAL_RSS_WAIT:
                    self._awaited.pop(key, None)
                    continue
            if now - facts.since > FINAL_FACTS_GRACE:
                log.warning("sacct has no final record of job %s (task %s)", facts.job_id, task_id)
                self._awaited.pop(key, None)

    def _write_facts(self, task_id: str, attempt: int, job: JobInfo) -> None:
        task = self.ctx.store.get_task(task_id)
        if task is None or not task.logs:
            return
        logs = TaskLogs(task.logs)
        metadata = logs.attempt(attempt).ensure_metadata()
        if metadata.get("slurm_job_id") == job.job_id:
            slurm_facts(metadata, job)
            self.ctx.store.amend_final_logs(task_id, logs.to_json())
            return
        for part, key in PART_KEYS.items():
            if metadata.get(key + "_job_id") == job.job_id:
                part_facts(metadata, part, job)
                self.ctx.store.amend_final_logs(task_id, logs.to_json())

    def _finish_canceled(self, canceled: dict[str, _Canceled]) -> None:
        """Write the final record of the scanceled jobs that sacct knows as ended."""
        now = self.ctx.clock()
        for task_id, waiting in canceled.items():
            assert waiting.task.job_id is not None
            job = self.watch.final_record(waiting.task.job_id)
            if job is not None:
                self._canceled.pop(task_id, None)
                self._write_canceled(task_id, job)
            elif now - waiting.since > FINAL_FACTS_GRACE:
                log.warning("sacct has no final record of canceled job %s", waiting.task.job_id)
                self._canceled.pop(task_id, None)

    def _write_canceled(self, task_id: str, job: JobInfo) -> None:
        task = self.ctx.store.get_task(task_id)
        if task is None or task.state != State.CANCELED.value or task.job_id != job.job_id:
            return
        logs = TaskLogs(task.logs)
        attempt = max(task.attempt, 1)
        entry = logs.attempt(attempt)
        fill_attempt_log(entry, self.watch.records(task), job, final=True)
        entry.clear_conditions()
        entry.add_system_logs([f"Slurm job {job.job_id} ended in state {job.state}"])
        self.ctx.store.amend_final_logs(task_id, logs.to_json())
        if job.max_rss_bytes is None:  # it may land in slurmdbd a moment later
            facts = AwaitedFacts(task_id, job.job_id, attempt, self.ctx.clock())
            self._awaited[(task_id, job.job_id)] = facts
