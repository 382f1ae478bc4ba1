"""The submission of a task staged on the transfer partition (poller.chain) alone (several of
one shape go as three arrays: submit.staged): three sbatches,
the stage-in job, the task's job (`--dependency=afterok:<stage-in>`) and the stage-out job
(`afterok:<task's job>`), each with `--kill-on-invalid-dep=yes`, so a part that did not end
well cancels the rest before they run.

Exactly once: the chain's mark (its jobs' names) is stored before the first sbatch, and each
job's id as soon as its sbatch answered, with the start of the next one. After a crash, or an
sbatch of a later part that got no answer, the task is an interrupted submission: recovery
(poller.recover) finds the chain's jobs by name and `resume` submits only the missing ones.
"""

from __future__ import annotations

import logging

from bridge.core.naming import AFTER_ARG, LEASE_EPOCH_ARG, RUN_PART, STAGE_IN_PART, job_name
from bridge.job.layout import SCRIPT
from bridge.jobscript.parts import PART_SCRIPTS
from bridge.poller.arrays import PreparedJob, Ready, marked_logs
from bridge.poller.attempt import Condition, ConditionKind, TaskLogs
from bridge.poller.chain import PART_KEYS, Chain
from bridge.poller.context import CycleStats, PollerContext, short
from bridge.poller.owners import OwnerRunner
from bridge.poller.submit.failures import SbatchFailures
from bridge.poller.submit.outcome import Backoff, Outcomes
from bridge.poller.submit.prepare import disk_gb, time_limit
from bridge.poller.submit.record import Recorder
from bridge.slurm import SlurmError, SlurmRejected
from bridge.store import TaskRecord

log = logging.getLogger("bridge.poller")


def prepared_again(ctx: PollerContext, task: TaskRecord) -> PreparedJob:
    """The prepared job of a staged task whose submission was interrupted (its directory and
    scripts were written before)."""
    assert task.document is not None
    return PreparedJob(
        ctx.task_dir(task.id) / SCRIPT,
        time_limit(task.document, ctx.config),
        disk_gb(task.document),
        staged=True,
    )


class ChainSbatch:
    """Submits a staged task's three jobs in order, or the ones its chain still lacks."""

    def __init__(
        self,
        ctx: PollerContext,
        owners: OwnerRunner | None,
        backoff: Backoff,
        outcomes: Outcomes,
        failures: SbatchFailures,
        recorder: Recorder,
    ) -> None:
        self.ctx = ctx
        #: Site mode: the jobs are submitted (and canceled) as the task's owner.
        self.owners = owners
        self.backoff = backoff
        self.outcomes = outcomes
        self.failures = failures
        self.recorder = recorder

    def submit(self, ready: Ready, stats: CycleStats) -> int:
        """The chain of a task prepared this round; 1 when all three jobs were submitted."""
        task = ready.task
        attempt = task.attempt + 1
        name = job_name(task.id, ready.document.get("name"))
        logs = marked_logs(task, attempt, (name, None), staged=True)
        if not self.ctx.store.mark_submitting(
            task.id, attempt=attempt, now=self.ctx.clock(), logs=logs
        ):
            return 0  # canceled meanwhile
        if logs is not None:
            task.logs = logs
        return self._submit_parts(task, Chain(name, None, None, None), ready.prepared, stats)

    def resume(self, task: TaskRecord, chain: Chain, stats: CycleStats) -> int:
        """Submit the parts an interrupted chain lacks (recovery found the others, and no job
        of the missing ones once their sbatches settled and the task was fenced)."""
        return self._submit_parts(task, chain, prepared_again(self.ctx, task), stats)

    def _submit_parts(
        self, task: TaskRecord, chain: Chain, prepared: PreparedJob, stats: CycleStats
    ) -> int:
        attempt = max(task.attempt, 1)
        known = dict(chain.parts())
        before: str | None = None
        for part, job_id in chain.parts():
            if job_id is None:
                job_id = self._sbatch(task, chain, part, before, prepared, stats)
                if job_id is None:
                    return 0
                known[part] = job_id
                self._note(task, attempt, part, job_id)
            before = job_id
        run = known[RUN_PART]
        assert run is not None
        self.backoff.failures = 0
        self.recorder.record(task, attempt, run, prepared, stats)
        log.info(
            "submitted task %s as Slurm jobs %s (stage-in, the task's, stage-out)",
            task.id,
            ", ".join(j for j in known.values() if j),
        )
        return 1

    def _sbatch(
        self,
        task: TaskRecord,
        chain: Chain,
        part: str,
        before: str | None,
        prepared: PreparedJob,
        stats: CycleStats,
    ) -> str | None:
        """One part's sbatch, after `before` (the job it waits for); None when it failed: the
        task failed (Slurm refused it: the parts submitted are canceled), waits (no part of
        the chain exists), or is left to recovery (some do)."""
        task_dir = self.ctx.task_dir(task.id)
        script = task_dir / PART_SCRIPTS.get(part, SCRIPT)
        owner = self._owner(task)
        args = self.owners.account_args(owner, task.document or {}) if self.owners else []
        # The fence token, as every job's (see Sbatch._epoch_args).
        script_args = [f"{LEASE_EPOCH_ARG}{self.ctx.fence_token()}"]
        if before is not None:
            args += [f"--dependency=afterok:{before}", "--kill-on-invalid-dep=yes"]
            script_args.append(f"{AFTER_ARG}{before}")
        try:
            self.ctx.check_lease()  # a poller that lost its lease submits nothing
            stats.slurm_calls += 1
            return self.ctx.slurm.submit(
                script, job_name=chain.name_of(part), comment=task.id, extra_args=args,
                as_user=owner, script_args=script_args,
            )  # fmt: skip
        except SlurmRejected as exc:
            message = self.failures.refusal(exc, prepared, stats)
            if part != RUN_PART:
                message += f" (the {part} job, staging.transfer_partition / transfer_qos)"
            self.outcomes.fail(task, message, attempt=max(task.attempt, 1))
            self._cancel_submitted(task, stats)
        except SlurmError as exc:
            if part == STAGE_IN_PART:
                self.failures.wait_for_slurm(task, max(task.attempt, 1), exc)
            else:
                # Its earlier jobs exist: recovery finds them, and this one if it was made.
                reason = Condition(
                    ConditionKind.SLURM_UNREACHABLE,
                    f"cannot reach Slurm to submit the {part} job ({short(exc)}); retrying",
                )
                self.backoff.pause(reason)
                log.warning("sbatch of the %s job of task %s failed: %s", part, task.id, exc)
        return None

    def _owner(self, task: TaskRecord) -> str | None:
        """Who runs sbatch and scancel for the task (site mode: its owner)."""
        return task.owner if self.owners is not None else None

    def _note(self, task: TaskRecord, attempt: int, part: str, job_id: str) -> None:
        """Store a part's job id at once (and, as the next sbatch's start, now)."""
        logs = TaskLogs(task.logs)
        metadata = logs.attempt(attempt).ensure_metadata()
        metadata[PART_KEYS[part] + "_job_id" if part in PART_KEYS else "slurm_job_id"] = job_id
        task.logs = logs.to_json()
        self.ctx.store.note_submission(task.id, now=self.ctx.clock(), logs=task.logs)

    def _cancel_submitted(self, task: TaskRecord, stats: CycleStats) -> None:
        """The chain cannot be completed: its jobs submitted so far go."""
        logs = TaskLogs(task.logs)
        metadata = logs.attempt(max(task.attempt, 1)).metadata or {}
        ids = [metadata.get(key + "_job_id") for key in PART_KEYS.values()]
        ids.append(metadata.get("slurm_job_id"))
        submitted = [j for j in ids if j]
        if not submitted:
            return
        try:
            stats.slurm_calls += 1
            self.ctx.slurm.cancel(submitted, as_user=self._owner(task))
        except SlurmError as exc:
            log.warning("cannot cancel jobs %s of failed task %s: %s", submitted, task.id, exc)
