"""Staged tasks in job arrays (`slurm.arrays = "auto"`, poller.arrays): tasks staged on the
transfer partition (poller.chain) that ask Slurm for the same in each part go as three arrays,
the stage-in array, the tasks' array (`--dependency=aftercorr:<stage-in array>`) and the
stage-out array (`aftercorr:<tasks' array>`), each with `--kill-on-invalid-dep=yes`. Element I
of each is task I's part: Slurm starts it only once element I of the array before it COMPLETED
with exit code 0, and cancels it when that one ended otherwise. Each task's three elements are
its chain (`slurm_stage_in_job_id`, `slurm_job_id`, `slurm_stage_out_job_id`), followed,
canceled and submitted again one task at a time, as a chain of three jobs is.

Exactly once: before the first sbatch each task stores the arrays' name, its element and the
chain mark (submit.marks); each array's elements as soon as its sbatch answered. After a crash,
or an sbatch of a later array that got no answer, the tasks are interrupted submissions:
recovery (poller.recover) finds each task's elements by the arrays' names and its index, fences
as for a chain, and `resume` submits only the missing arrays, each task keeping its index, which
`aftercorr` pairs with the index of its element of the array before.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bridge.core.naming import (
    AFTER_ARG,
    LEASE_EPOCH_ARG,
    RUN_PART,
    STAGE_IN_PART,
    array_job_name,
    part_job_name,
)
from bridge.poller.arrays import STAGED_PARTS, ArrayPlanner, Ready, array_mark
from bridge.poller.attempt import Condition, ConditionKind, TaskLogs
from bridge.poller.chain import PART_KEYS, Chain
from bridge.poller.context import CycleStats, PollerContext, short
from bridge.poller.submit.chain import prepared_again
from bridge.poller.submit.failures import SbatchFailures
from bridge.poller.submit.marks import mark_array, unmark
from bridge.poller.submit.outcome import Backoff, Outcomes
from bridge.poller.submit.record import Element, Recorder, elements_of
from bridge.slurm import Outage, SlurmError, SlurmRejected, SlurmUnavailable
from bridge.store import TaskRecord

log = logging.getLogger("bridge.poller")


@dataclass
class StagedArraySbatch:
    """Submits the three arrays of staged tasks of one shape, or the ones they still lack."""

    ctx: PollerContext
    backoff: Backoff
    arrays: ArrayPlanner
    outcomes: Outcomes
    failures: SbatchFailures
    recorder: Recorder

    def submit(self, unit: list[Ready], stats: CycleStats) -> int:
        """The three arrays of a round's staged tasks of one shape; how many were submitted."""
        name = array_job_name(secrets.token_hex(6), (r.document.get("name") for r in unit))
        members = mark_array(self.ctx, unit, name, staged=True)
        if not members:
            return 0
        try:
            scripts = {part: self.arrays.write_script(members, name, part) for part in STAGED_PARTS}
        except OSError as exc:
            unmark(self.ctx, self.outcomes, members, exc)
            return 0
        return self._submit_parts(elements_of(members), name, {}, scripts, stats)

    def resume(self, chains: Sequence[tuple[TaskRecord, Chain]], stats: CycleStats) -> int:
        """Submit the arrays that interrupted staged tasks of the same arrays lack (recovery
        found the others, and none of the missing ones once their sbatches settled and the
        tasks were fenced), each task keeping its index; how many tasks were submitted."""
        name = chains[0][1].name
        found = {part: job_id.partition("_")[0] for part, job_id in chains[0][1].parts() if job_id}
        elements = [_resumed(self.ctx, task) for task, _ in chains]
        members = [Ready(e.task, e.prepared, e.task.document or {}, None) for e in elements]
        indexes = [e.index for e in elements]
        try:
            scripts = {
                part: self.arrays.write_script(members, name, part, indexes)
                for part in STAGED_PARTS
                if part not in found
            }
        except OSError as exc:
            # Tried again by the next recovery, which finds the same arrays and none of these.
            reason = f"cannot write the script of a job array ({exc}); retrying"
            self.backoff.pause(Condition(ConditionKind.TASK_DIR_UNWRITABLE, reason))
            log.warning("cannot resume the job arrays %s: %s", name, exc)
            return 0
        return self._submit_parts(elements, name, found, scripts, stats)

    def _submit_parts(
        self,
        elements: list[Element],
        name: str,
        found: dict[str, str],
        scripts: dict[str, Path],
        stats: CycleStats,
    ) -> int:
        """The arrays not `found` (by part), in order, each after the one before; how many
        tasks were submitted (0 when an sbatch failed)."""
        ids = dict(found)
        fresh = not found
        before: str | None = None
        for part in STAGED_PARTS:
            if part not in ids:
                array_id = self._sbatch(elements, name, part, scripts[part], before, fresh, stats)
                if array_id is None:
                    return 0
                ids[part] = array_id
                self._note(elements, part, array_id)
            before = ids[part]
        self.backoff.failures = 0
        self.arrays.accepted(len(elements))
        self.recorder.record_elements(elements, ids[RUN_PART], stats)
        log.info(
            "submitted %d staged tasks as Slurm job arrays %s (stage-in, the tasks', stage-out)",
            len(elements),
            ", ".join(ids[part] for part in STAGED_PARTS),
        )
        return len(elements)

    def _sbatch(
        self,
        elements: list[Element],
        name: str,
        part: str,
        script: Path,
        before: str | None,
        fresh: bool,
        stats: CycleStats,
    ) -> str | None:
        """One part's array, after the array `before`; None when its sbatch failed: the tasks
        failed (Slurm refused it: the elements submitted are canceled), wait (`fresh`: no array
        of theirs exists yet), or are left to recovery (some do)."""
        args: list[str] = []
        script_args = [f"{LEASE_EPOCH_ARG}{self.ctx.fence_token()}"]  # see Sbatch._epoch_args
        if before is not None:
            args += [f"--dependency=aftercorr:{before}", "--kill-on-invalid-dep=yes"]
            script_args.append(f"{AFTER_ARG}{before}")  # element I is given `before`_I
        try:
            self.ctx.check_lease()  # a poller that lost its lease submits nothing
            stats.slurm_calls += 1
            return self.ctx.slurm.submit(
                script, job_name=part_job_name(name, part), extra_args=args,
                script_args=script_args, array_indexes=[e.index for e in elements],
            )  # fmt: skip
        except SlurmRejected as exc:
            message = self.failures.refusal(exc, elements[0].prepared, stats)
            if part != RUN_PART:
                message += f" (the {part} job, staging.transfer_partition / transfer_qos)"
            for element in elements:
                self.outcomes.fail(element.task, message, attempt=element.attempt)
            self._cancel_submitted(elements, stats)
        except SlurmError as exc:
            self._unanswered(elements, part, fresh, exc)
        return None

    def _unanswered(self, elements: list[Element], part: str, fresh: bool, exc: SlurmError) -> None:
        """An sbatch that failed without Slurm's refusal: before the first array, the tasks
        wait as an array's do (Sbatch.submit_array); after it, recovery finds what exists."""
        if fresh and part == STAGE_IN_PART:
            if isinstance(exc, SlurmUnavailable) and exc.outage is Outage.LIMIT:
                self.arrays.refused_for_a_limit(len(elements))
            delay = None
            for element in elements:
                delay = self.failures.wait_for_slurm(element.task, element.attempt, exc, delay)
            return
        reason = Condition(
            ConditionKind.SLURM_UNREACHABLE,
            f"cannot reach Slurm to submit the {part} array ({short(exc)}); retrying",
        )
        self.backoff.pause(reason)
        log.warning("sbatch of the %s array of %d tasks failed: %s", part, len(elements), exc)

    def _note(self, elements: list[Element], part: str, array_id: str) -> None:
        """Store each task's element of a part's array at once (one commit), and, as the next
        sbatch's start, now."""
        key = PART_KEYS[part] + "_job_id" if part in PART_KEYS else "slurm_job_id"
        now = self.ctx.clock()
        with self.ctx.store.batch():
            for element in elements:
                task = element.task
                logs = TaskLogs(task.logs)
                logs.attempt(element.attempt).ensure_metadata()[key] = element.job_id(array_id)
                task.logs = logs.to_json()
                self.ctx.store.note_submission(task.id, now=now, logs=task.logs)

    def _cancel_submitted(self, elements: list[Element], stats: CycleStats) -> None:
        """The tasks cannot be completed: their elements submitted so far go."""
        submitted = []
        for element in elements:
            metadata = TaskLogs(element.task.logs).attempt(element.attempt).metadata or {}
            keys = [key + "_job_id" for key in PART_KEYS.values()] + ["slurm_job_id"]
            submitted += [metadata[key] for key in keys if metadata.get(key)]
        if not submitted:
            return
        try:
            stats.slurm_calls += 1
            self.ctx.slurm.cancel(submitted)
        except SlurmError as exc:
            log.warning("cannot cancel the elements %s of failed tasks: %s", submitted, exc)


def _resumed(ctx: PollerContext, task: TaskRecord) -> Element:
    """An interrupted staged task's element, with the index its array mark stored."""
    mark = array_mark(task)
    assert mark is not None
    return Element(task, max(task.attempt, 1), int(mark[1]), prepared_again(ctx, task))
