"""Following jobs: one squeue for every active job, one sacct for those that left the queue,
each job's own records, and the task's TES state and logs from them (see decisions.decide)."""

from __future__ import annotations

import logging
from typing import Any

from bridge.core.tes import TERMINAL_STATES, State
from bridge.job.records import JobRecords, read_records
from bridge.poller.context import CycleStats, PollerContext, short
from bridge.poller.decisions import (
    TIME_LIMIT_KEY,
    add_system_logs,
    attempt_log,
    copy_logs,
    decide,
    fill_attempt_log,
    missing_job,
    set_condition,
    slurm_facts,
)
from bridge.poller.owners import OwnerRunner
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


class Follower:
    def __init__(self, ctx: PollerContext, owners: OwnerRunner | None) -> None:
        self.ctx = ctx
        #: Site mode: reads the records as each task's owner.
        self.owners = owners
        self._missing_since: dict[str, float] = {}
        #: Site mode: records read as each owner at the start of a follow cycle.
        self._records: dict[str, JobRecords] = {}
        #: Finished tasks whose final Slurm facts sacct did not have yet:
        #: task id -> (job id, attempt, since).
        self._facts_pending: dict[str, tuple[str, int, float]] = {}
        #: Tasks of the last follow() whose job is done with (final, or to be submitted again).
        self.finished: set[str] = set()
        #: Decided, not yet written: task id -> what metrics.observe_task_change is told once
        #: the decision has changed the task.
        self._observations: dict[str, tuple[str | None, dict[str, Any], str, str, bool]] = {}

    def follow(self, tasks: list[TaskRecord], stats: CycleStats) -> None:
        self.finished = set()
        if not tasks and not self._facts_pending:
            return
        job_ids = [t.job_id for t in tasks if t.job_id]
        queue: dict[str, JobInfo] = {}
        try:
            if job_ids:
                stats.slurm_calls += 1
                queue = self.ctx.slurm.queue(job_ids)
        except SlurmError as exc:
            log.warning("squeue failed; keeping the last known states: %s", short(exc))
            return
        if self.owners is not None:
            pending = {j for j, info in queue.items() if info.tes_state == State.QUEUED.value}
            self._records = self.owners.read_records([t for t in tasks if t.job_id not in pending])
        left = [j for j in job_ids if j not in queue or queue[j].ended]
        # Finished tasks still waiting for their final Slurm facts ride on the same sacct call.
        refresh = dict(self._facts_pending)
        left += [job_id for job_id, _, _ in refresh.values() if job_id not in left]
        accounting: dict[str, JobInfo] = {}
        if left:
            try:
                stats.slurm_calls += 1
                accounting = self.ctx.slurm.accounting(left)
            except SlurmError as exc:
                log.warning("sacct failed; finished jobs wait for the next cycle: %s", short(exc))
        decisions: list[JobDecision] = []
        for task in tasks:
            assert task.job_id is not None
            job = accounting.get(task.job_id) or queue.get(task.job_id)
            try:
                decisions.append(self._decide(task, job))
            except Exception:
                log.exception("updating task %s failed unexpectedly", task.id)
            if len(decisions) == DECISION_BATCH:  # written as they come: a batch's logs at most
                stats.updated += self._apply(decisions)
                decisions = []
        if decisions:
            stats.updated += self._apply(decisions)
        self._refresh_facts(refresh, accounting)

    def _apply(self, batch: list[JobDecision]) -> int:
        """One transaction for the batch. A crash between batches loses only uncommitted
        decisions, and those tasks keep their last state: the next cycle decides them again
        from Slurm and the job's records, and every update is conditional on the state it
        expects, so applying a decision again changes nothing it should not."""
        changed: list[JobDecision] = []
        try:
            changed = self.ctx.store.apply_decisions(batch)
        except Exception as exc:
            if unavailable_reason(exc):
                raise  # the cycle fails and is tried again
            # The batch rolled back whole: one by one, so a bad row costs only its own update.
            for decision in batch:
                try:
                    changed += self.ctx.store.apply_decisions([decision])
                except Exception:
                    log.exception("updating task %s failed unexpectedly", decision.task_id)
        for decision in changed:
            observed = self._observations.get(decision.task_id)
            if observed is not None:
                metrics.observe_task_change(*observed)
        self._observations.clear()
        return len(changed)

    def _refresh_facts(
        self, refresh: dict[str, tuple[str, int, float]], accounting: dict[str, JobInfo]
    ) -> None:
        """Write sacct's final record into finished tasks that were missing it."""
        now = self.ctx.clock()
        for task_id, (job_id, attempt, since) in refresh.items():
            job = accounting.get(job_id)
            if job is not None and job.ended:
                self._write_facts(task_id, attempt, job)
                # A step's MaxRSS can land in slurmdbd a moment after the job's own record;
                # a job too short for any accounting sample never gets one.
                ended_ago = now - job.end_time.timestamp() if job.end_time else 0.0
                if job.max_rss_bytes is not None or ended_ago > FINAL_RSS_WAIT:
                    self._facts_pending.pop(task_id, None)
                    continue
            if now - since > FINAL_FACTS_GRACE:
                log.warning("sacct has no final record of job %s (task %s)", job_id, task_id)
                self._facts_pending.pop(task_id, None)

    def _write_facts(self, task_id: str, attempt: int, job: JobInfo) -> None:
        task = self.ctx.store.get_task(task_id)
        if task is not None and len(task.logs or []) >= attempt:
            logs = task.logs or []
            slurm_facts(logs[attempt - 1].setdefault("metadata", {}), job)
            self.ctx.store.amend_final_logs(task_id, logs)

    def _job_records(self, task: TaskRecord, job_pending: bool) -> JobRecords:
        assert task.job_id is not None
        if job_pending:
            return JobRecords(job_id=task.job_id)
        if self.owners is not None:
            return self._records.get(task.id) or JobRecords(job_id=task.job_id)
        return read_records(
            self.ctx.task_dir(task.id), task.job_id, tail_bytes=self.ctx.config.job.log_tail_bytes
        )

    def _decide(self, task: TaskRecord, job: JobInfo | None) -> JobDecision:
        assert task.job_id is not None
        now = self.ctx.clock()
        job_pending = job is not None and not job.ended and job.tes_state == State.QUEUED.value
        records = self._job_records(task, job_pending)
        current = State(task.state)
        entries = task.logs or []
        attempt = entries[task.attempt - 1] if 0 < task.attempt <= len(entries) else {}
        asked = attempt.get("metadata") or {}
        decision = decide(
            job=job,
            records=records,
            attempt=task.attempt,
            retries=self.ctx.config.slurm.retries,
            current=current,
            time_limit=asked.get(TIME_LIMIT_KEY),
        )
        if job is None and records.outcome is None:
            since = self._missing_since.setdefault(task.job_id, now)
            decision = missing_job(task.job_id, since, now) or decision
        else:
            self._missing_since.pop(task.job_id, None)

        final = decision.state in TERMINAL_STATES
        if final or decision.retry:
            self.finished.add(task.id)
        logs = copy_logs(task.logs)
        entry = attempt_log(logs, max(task.attempt, 1))
        if not job_pending:
            fill_attempt_log(entry, records, job, final=final or decision.retry)
        add_system_logs(entry, decision.messages)
        set_condition(entry, None if final or decision.retry else decision.condition)
        if final and (job is None or not job.ended or job.max_rss_bytes is None):
            self._facts_pending[task.id] = (task.job_id, max(task.attempt, 1), now)
        # What the metrics are told if the decision changes the task (see _apply).
        self._observations[task.id] = (
            task.creation_time,
            entry,
            current.value,
            decision.state.value,
            final or decision.retry,
        )
        return JobDecision(
            task.id,
            task.job_id,
            state=None if decision.state is current else decision.state,
            logs=None if logs == task.logs else logs,
            resubmit=decision.retry,
            cancel_job=decision.cancel_job,
        )
