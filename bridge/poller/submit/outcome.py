"""What becomes of a task the submission steps cannot take further: it failed (SYSTEM_ERROR),
or it waits in QUEUED, saying why, while submissions pause with back-off."""

from __future__ import annotations

import logging

from bridge.poller.attempt import Condition, TaskLogs, failure_logs
from bridge.poller.context import PollerContext, format_time_now
from bridge.store import SubmissionFailure, TaskRecord, unavailable_reason
from bridge.system import metrics

log = logging.getLogger("bridge.poller")


class Wait(Exception):
    """The task waits in QUEUED (submissions paused) for `reason`."""

    def __init__(self, reason: Condition) -> None:
        super().__init__(reason.text)
        self.reason = reason


class Fail(Exception):
    """The task cannot run: SYSTEM_ERROR with this message."""


class Backoff:
    """Doubles with each failed submission in a row (Slurm away, a full work filesystem), up
    to `slurm.submit_backoff_max`; a submission that succeeds starts it afresh. While it runs
    no sbatch starts (each would wait for sbatch's own retries, about 10 s, and fail the same
    way)."""

    def __init__(self, ctx: PollerContext) -> None:
        self.ctx = ctx
        self.failures = 0
        self.paused_until = 0.0
        #: Why the last task that could not be submitted waits.
        self.reason: Condition | None = None

    def pause(self, reason: Condition) -> float:
        self.failures += 1
        self.reason = reason
        cfg = self.ctx.config.slurm
        exponent = min(self.failures - 1, 16)
        delay = min(cfg.submit_backoff_initial * 2.0**exponent, cfg.submit_backoff_max)
        self.paused_until = self.ctx.clock() + delay
        return delay

    @property
    def paused(self) -> bool:
        return self.ctx.clock() < self.paused_until


def tell_waiting(ctx: PollerContext, tasks: list[TaskRecord], reason: Condition | None) -> None:
    """Say in each task's system_logs why it waits in QUEUED (stored only when it changes)."""
    if reason is None:
        return
    for task in tasks:
        logs = TaskLogs(task.logs)
        logs.attempt(task.attempt + 1).set_condition(reason)
        updated = logs.to_json()
        if updated != task.logs:
            ctx.store.note(task.id, updated)


class Outcomes:
    """The store writes of a task that goes no further this round: `fail`, `wait` (with the
    back-off), `tell_waiting`; and `unexpected`, for an error no step expected."""

    def __init__(self, ctx: PollerContext, backoff: Backoff) -> None:
        self.ctx = ctx
        self.backoff = backoff

    def tell_waiting(self, tasks: list[TaskRecord], reason: Condition | None) -> None:
        tell_waiting(self.ctx, tasks, reason)

    def fail(self, task: TaskRecord, message: str, *, attempt: int | None = None) -> None:
        logs = failure_logs(task.logs, attempt or task.attempt, message, format_time_now())
        if self.ctx.store.fail(task.id, logs, attempt=attempt, end_submission=attempt is not None):
            metrics.observe_finished("SYSTEM_ERROR")
        log.info("task %s failed: %s", task.id, message)

    def wait(
        self,
        task: TaskRecord,
        log_attempt: int,
        reason: Condition,
        submission: SubmissionFailure | None = None,
        *,
        delay: float | None = None,
    ) -> float:
        """Keep the task QUEUED, saying why (in the log of `log_attempt`), pause submissions
        (unless `delay` says how long they already are), and try it again after the back-off."""
        if delay is None:
            delay = self.backoff.pause(reason)
        logs = TaskLogs(task.logs)
        logs.attempt(max(log_attempt, 1)).set_condition(reason)
        until = self.ctx.clock() + delay
        self.ctx.store.defer_submission(
            task.id, until=until, logs=logs.to_json(), submission=submission
        )
        log.info("task %s waits %.0fs: %s", task.id, delay, reason.text)
        return delay

    def unexpected(self, exc: Exception, tasks: list[TaskRecord]) -> bool:
        """An error no step expected: True when the round stops (the database is away, the
        tasks stay QUEUED), else the tasks failed."""
        reason = unavailable_reason(exc)
        if reason:
            # Passing (a full or locked database): the tasks stay QUEUED for later.
            log.error("submitting task %s postponed: %s", tasks[0].id, reason)
            return True
        for task in tasks:
            log.exception("submitting task %s failed unexpectedly", task.id)
            self.fail(task, "internal error while submitting the task; see the poller log")
        return False
