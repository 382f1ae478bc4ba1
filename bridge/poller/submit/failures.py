"""What a failed sbatch means, from the kind of Slurm's error alone: a `Refusal` fails the
task (with a hint for `--tmp` and `--time`), an `Outage` makes it wait with back-off."""

from __future__ import annotations

import logging

from bridge.core import backend_params
from bridge.core.reasons import SLURM_REFUSED
from bridge.poller.arrays import PreparedJob
from bridge.poller.attempt import Condition, ConditionKind
from bridge.poller.context import CycleStats, PollerContext, short
from bridge.poller.submit.nodes import NodeSizesCache
from bridge.poller.submit.outcome import Outcomes
from bridge.slurm import Outage, Refusal, SlurmError, SlurmRejected, SlurmUnavailable
from bridge.store import SubmissionFailure, TaskRecord

log = logging.getLogger("bridge.poller")


def _time_limit_hint(limit: backend_params.TimeLimit | None) -> str:
    """Why sbatch refused a --time, and how to ask for one it takes."""
    if limit is None:
        return (
            ". The job asked for no --time of its own (the partition's limit applies): set "
            "slurm.default_time, or ask for a time limit"
        )
    return (
        f". The job asked for {limit.describe()}: ask for less time, or for a partition whose "
        "limit is longer (sinfo -o '%P %l')"
    )


class SbatchFailures:
    """A refused sbatch's message for the failed task, and the wait of a task whose sbatch
    could not be done now (its submission remembered when the job may exist all the same)."""

    def __init__(self, ctx: PollerContext, nodes: NodeSizesCache, outcomes: Outcomes) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.outcomes = outcomes

    def refusal(self, exc: SlurmRejected, prepared: PreparedJob, stats: CycleStats) -> str:
        """What a task that sbatch refused says in its system_logs: Slurm's words, and for a
        request that can be changed, what the job asked for and where to change it."""
        message = f"{SLURM_REFUSED}{exc.reason}"
        if exc.refusal is Refusal.TMP_DISK:
            return message + self.nodes.hint(prepared.disk_gb, stats)
        if exc.refusal is Refusal.TIME_LIMIT:
            return message + _time_limit_hint(prepared.time_limit)
        return message

    def wait_for_slurm(
        self, task: TaskRecord, attempt: int, exc: SlurmError, delay: float | None = None
    ) -> float:
        """sbatch could not be done now: the task waits for the back-off (`delay`: the one an
        array's first task started). When the job may exist all the same (no answer), recovery
        looks for it by name before it is submitted again. Returns the delay."""
        # This sbatch has ended (its process group was killed on a time-out), so only the settle
        # time is left to wait: the submission's start is moved back accordingly.
        maybe_started_at = self._maybe_started() if exc.may_have_acted else None
        if isinstance(exc, SlurmUnavailable) and exc.outage is Outage.LIMIT:
            waiting = Condition(
                ConditionKind.SLURM_LIMIT,
                f"waiting: Slurm refused the job for a limit ({exc.reason}); "
                "submitted again when earlier jobs have ended",
            )
            log.warning("sbatch for task %s refused for a limit: %s", task.id, exc)
        elif isinstance(exc, SlurmUnavailable) and exc.outage is Outage.RATE_LIMITED:
            # slurmctld answers, slowly: the job may exist (looked up by name, as for no answer).
            waiting = Condition(
                ConditionKind.SLURM_UNREACHABLE,
                "waiting: slurmctld's RPC rate limit slowed the submission past "
                "slurm.command_timeout; submitted again after the back-off, unless the job "
                "turns out to exist",
            )
            log.warning("sbatch for task %s slowed by the rate limit: %s", task.id, exc)
        else:
            waiting = Condition(
                ConditionKind.SLURM_UNREACHABLE,
                f"cannot reach Slurm to submit the job ({short(exc)}); retrying with back-off",
            )
            log.warning("sbatch for task %s failed: %s", task.id, exc)
        submission = SubmissionFailure(task.attempt, maybe_started_at)
        return self.outcomes.wait(task, attempt, waiting, submission, delay=delay)

    def _maybe_started(self) -> float:
        """When an sbatch that ended without an answer may have started: its own time-out ago
        (only the settle time is left to wait before the task is submitted again)."""
        return self.ctx.clock() - self.ctx.config.slurm.command_timeout
