"""The marks an array's tasks store before its sbatch runs (poller.arrays): the array's name
and each task's element, in one commit; and their undoing when no sbatch could run."""

from __future__ import annotations

import logging

from bridge.poller.arrays import Ready, marked_logs
from bridge.poller.attempt import Condition, ConditionKind
from bridge.poller.context import PollerContext
from bridge.poller.submit.outcome import Outcomes

log = logging.getLogger("bridge.poller")


def mark_array(
    ctx: PollerContext, unit: list[Ready], name: str, *, staged: bool = False
) -> list[Ready]:
    """Each task marked as submitting with its element (its index among the marked ones),
    before sbatch runs; the tasks canceled meanwhile are left out. `staged`: the tasks' chains
    go as three arrays (submit.staged)."""
    members: list[Ready] = []
    now = ctx.clock()
    with ctx.store.batch():  # one commit: all marked before sbatch, or none
        for ready in unit:
            task = ready.task
            attempt = task.attempt + 1
            logs = marked_logs(task, attempt, (name, len(members)), staged=staged)
            if ctx.store.mark_submitting(task.id, attempt=attempt, now=now, logs=logs):
                if logs is not None:
                    task.logs = logs
                members.append(ready)
    return members


def unmark(ctx: PollerContext, outcomes: Outcomes, members: list[Ready], exc: OSError) -> None:
    """The array's script could not be written: no sbatch ran, the tasks wait."""
    log.warning("cannot write the script of a job array: %s", exc)
    reason = Condition(
        ConditionKind.TASK_DIR_UNWRITABLE,
        f"waiting: cannot prepare the task directory ({exc})",
    )
    delay = None
    for ready in members:
        ctx.store.forget_submission(ready.task.id, attempt=ready.task.attempt)
        delay = outcomes.wait(ready.task, ready.task.attempt + 1, reason, delay=delay)
