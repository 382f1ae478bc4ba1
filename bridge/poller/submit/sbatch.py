"""The submission itself: one sbatch per unit of the round (a task alone, or an array), within
the Slurm call budget, each task marked as submitting before its sbatch runs (so that after a
crash its job is looked up by name, not submitted twice) and its job given the fence token."""

from __future__ import annotations

import logging
import secrets

from bridge.core.naming import LEASE_EPOCH_ARG, array_job_name, job_name
from bridge.poller.arrays import ArrayPlanner, Ready, marked_logs
from bridge.poller.chain import CHAIN_JOBS
from bridge.poller.context import CycleStats, PollerContext
from bridge.poller.owners import OwnerRunner
from bridge.poller.submit.chain import ChainSbatch
from bridge.poller.submit.failures import SbatchFailures
from bridge.poller.submit.marks import mark_array, unmark
from bridge.poller.submit.outcome import Backoff, Outcomes
from bridge.poller.submit.record import Recorder
from bridge.poller.submit.staged import StagedArraySbatch
from bridge.slurm import Outage, SlurmError, SlurmRejected, SlurmUnavailable
from bridge.store import TaskRecord

log = logging.getLogger("bridge.poller")

#: Slurm calls that submissions leave in the budget for the rest of the cycle: its squeue (two
#: RPCs), sacct and scancel. Tasks the budget does not let go stay QUEUED for the next cycle.
BUDGET_RESERVE = 4


class Sbatch:
    """Runs the round's sbatches; a failed one fails its tasks or makes them wait
    (`SbatchFailures`), a successful one has its job ids stored (`Recorder`)."""

    def __init__(
        self,
        ctx: PollerContext,
        owners: OwnerRunner | None,
        backoff: Backoff,
        arrays: ArrayPlanner,
        outcomes: Outcomes,
        failures: SbatchFailures,
        recorder: Recorder,
    ) -> None:
        self.ctx = ctx
        #: Site mode: jobs are submitted as the task's owner, with the owner's account.
        self.owners = owners
        self.backoff = backoff
        self.arrays = arrays
        self.outcomes = outcomes
        self.failures = failures
        self.recorder = recorder
        #: Tasks staged on the transfer partition: three jobs each.
        self.chain = ChainSbatch(ctx, owners, backoff, outcomes, failures, recorder)
        #: Staged tasks of one shape: three arrays.
        self.staged = StagedArraySbatch(ctx, backoff, arrays, outcomes, failures, recorder)

    def submit_round(self, units: list[list[Ready]], stats: CycleStats) -> list[Ready]:
        """One sbatch per unit: a task of its own, or several as one array; a failed sbatch
        stops the round (the back-off it starts). Returns the tasks the round did not reach
        (the call budget spent, a back-off): still prepared, for the next round."""
        paused_until = self.backoff.paused_until
        # While the budget sets the pace, a round lasts one poll interval at most: the follow
        # and the cancels of this cycle come in between.
        until = self.ctx.clock() + self.ctx.config.slurm.poll_interval
        for index, unit in enumerate(units):
            if self.backoff.paused_until > paused_until and self.backoff.paused:
                waiting = [r.task for later in units[index:] for r in later]
                self.outcomes.tell_waiting(waiting, self.backoff.reason)
                return _unreached(units[index:])
            # Staged tasks are three sbatches: a chain (submit.chain) or three arrays
            # (submit.staged).
            staged = unit[0].prepared.staged
            if self._budget_spent(until, CHAIN_JOBS if staged else 1):
                return _unreached(units[index:])  # the budget is spent: the rest go next cycle
            try:
                if staged and len(unit) == 1:
                    stats.submitted += self.chain.submit(unit[0], stats)
                elif staged:
                    stats.submitted += self.staged.submit(unit, stats)
                elif len(unit) == 1:
                    stats.submitted += self.submit_one(unit[0], stats)
                else:
                    stats.submitted += self.submit_array(unit, stats)
            except Exception as exc:  # one broken submission must not stop the others
                if self.outcomes.unexpected(exc, [r.task for r in unit]):
                    return _unreached(units[index + 1 :])
        return []

    def _budget_spent(self, until: float, sbatches: int = 1) -> bool:
        """Whether this round stops for the call budget: the unit's `sbatches` would leave
        fewer than BUDGET_RESERVE tokens, or it has used its time (counted as a wait either
        way)."""
        budget = self.ctx.slurm.budget
        if not budget.allows(keep=BUDGET_RESERVE, command="sbatch", cost=sbatches):
            return True
        if budget.rate and self.ctx.clock() > until:
            budget.note_wait("sbatch")
            return True
        return False

    def submit_one(self, ready: Ready, stats: CycleStats) -> int:
        """One sbatch for one task; 1 when it was submitted."""
        task = ready.task
        attempt = task.attempt + 1
        name = job_name(task.id, ready.document.get("name"))
        # Recorded before sbatch runs: after a crash, the job is looked up by name, not resubmitted.
        logs = marked_logs(task, attempt, (name, None))  # an earlier try's array marks go
        if not self.ctx.store.mark_submitting(
            task.id, attempt=attempt, now=self.ctx.clock(), logs=logs
        ):
            return 0  # canceled meanwhile
        if logs is not None:
            task.logs = logs
        job_id = self._sbatch(task, attempt, name, ready, stats)
        if job_id is None:
            return 0
        self.backoff.failures = 0
        self.recorder.record(task, attempt, job_id, ready.prepared, stats)
        log.info("submitted task %s as Slurm job %s", task.id, job_id)
        return 1

    def submit_array(self, unit: list[Ready], stats: CycleStats) -> int:
        """One `sbatch --array` for tasks of one shape; how many were submitted."""
        name = array_job_name(secrets.token_hex(6), (r.document.get("name") for r in unit))
        members = mark_array(self.ctx, unit, name)
        if not members:
            return 0
        try:
            script = self.arrays.write_script(members, name)
        except OSError as exc:
            unmark(self.ctx, self.outcomes, members, exc)
            return 0
        try:
            self.ctx.check_lease()  # a poller that lost its lease submits nothing
            stats.slurm_calls += 1
            array_id = self.ctx.slurm.submit(
                script, job_name=name, extra_args=self._account(members[0]),
                array_size=len(members), script_args=self._epoch_args(),
            )  # fmt: skip
        except SlurmRejected as exc:
            message = self.failures.refusal(exc, members[0].prepared, stats)
            for ready in members:
                self.outcomes.fail(ready.task, message, attempt=ready.task.attempt + 1)
            return 0
        except SlurmError as exc:
            if isinstance(exc, SlurmUnavailable) and exc.outage is Outage.LIMIT:
                self.arrays.refused_for_a_limit(len(members))
            delay = None
            for ready in members:
                attempt = ready.task.attempt + 1
                delay = self.failures.wait_for_slurm(ready.task, attempt, exc, delay)
            return 0
        self.backoff.failures = 0
        self.arrays.accepted(len(members))
        self.recorder.record_array(members, array_id, stats)
        log.info("submitted %d tasks as Slurm job array %s (%s)", len(members), array_id, name)
        return len(members)

    def _epoch_args(self) -> list[str]:
        """Each job gets its submission's fence token (PollerContext.fence_token): a job
        submitted by a leader that had lost its lease, or by an sbatch that timed out and
        was acted on late, stands down where recovery fenced the task since (recover.py)."""
        return [f"{LEASE_EPOCH_ARG}{self.ctx.fence_token()}"]

    def _account(self, ready: Ready) -> list[str]:
        return self.owners.account_args(ready.owner, ready.document) if self.owners else []

    def _sbatch(
        self, task: TaskRecord, attempt: int, name: str, ready: Ready, stats: CycleStats
    ) -> str | None:
        """The job id, or None when sbatch failed (the task then failed or waits)."""
        try:
            self.ctx.check_lease()  # a poller that lost its lease submits nothing
            stats.slurm_calls += 1
            return self.ctx.slurm.submit(
                ready.prepared.script, job_name=name, comment=task.id,
                extra_args=self._account(ready), as_user=ready.owner,
                script_args=self._epoch_args(),
            )  # fmt: skip
        except SlurmRejected as exc:
            message = self.failures.refusal(exc, ready.prepared, stats)
            self.outcomes.fail(task, message, attempt=attempt)
        except SlurmError as exc:
            self.failures.wait_for_slurm(task, attempt, exc)
        return None


def _unreached(units: list[list[Ready]]) -> list[Ready]:
    return [ready for unit in units for ready in unit]
