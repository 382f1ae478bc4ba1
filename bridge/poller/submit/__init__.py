"""Submitting QUEUED tasks: images, the task directory, sbatch, and waiting with back-off
while Slurm or the work filesystem is away.

A submission round is a short pipeline of steps, each in its own module, which `Submitter`
runs in order:

1. read the round (`store.tasks_to_submit`) and **admit** (`admit.Admission`:
   `slurm.max_jobs_in_flight`, `slurm.max_jobs_per_owner`);
2. **prepare** each task admission lets go (`prepare.Preparer`: its images, its task
   directory and job script, with the nodes' sizes of `nodes.NodeSizesCache`);
3. **group** the prepared tasks into arrays by shape (`bridge.poller.arrays.ArrayPlanner`);
4. **submit** each unit (`sbatch.Sbatch`: the call budget, the submitting mark before sbatch,
   the fence token given to the job; a failed sbatch read by `failures.SbatchFailures`; staged
   tasks as a chain, `chain.ChainSbatch`, or three arrays, `staged.StagedArraySbatch`);
5. **record** the job ids (`record.Recorder`, which scancels a job whose task was canceled
   meanwhile).

A task that goes no further fails or waits with back-off (`outcome`: `Outcomes`, `Backoff`).
"""

from __future__ import annotations

from bridge.poller.arrays import ArrayPlanner, Ready
from bridge.poller.cancel import Canceller
from bridge.poller.chain import CHAIN_JOBS
from bridge.poller.context import CycleStats, ImageSource, PollerContext
from bridge.poller.owners import OwnerRunner
from bridge.poller.submit.admit import Admission
from bridge.poller.submit.failures import SbatchFailures
from bridge.poller.submit.nodes import TMP_DISK_RECHECK, NodeSizesCache
from bridge.poller.submit.outcome import Backoff, Outcomes, tell_waiting
from bridge.poller.submit.prepare import TRANSIENT_ERRNOS, Preparer, disk_gb
from bridge.poller.submit.record import Recorder
from bridge.poller.submit.sbatch import BUDGET_RESERVE, Sbatch
from bridge.store import TaskRecord
from bridge.system import metrics

__all__ = [
    "BUDGET_RESERVE",
    "MAX_SUBMISSIONS_PER_CYCLE",
    "TMP_DISK_RECHECK",
    "TRANSIENT_ERRNOS",
    "Admission",
    "Backoff",
    "NodeSizesCache",
    "Preparer",
    "Submitter",
    "disk_gb",
    "tell_waiting",
]

#: Submissions per cycle, so that polling stays regular when thousands of tasks arrive at once.
MAX_SUBMISSIONS_PER_CYCLE = 500


class Submitter:
    """Submits the QUEUED tasks that admission lets go, one sbatch each or several of one
    shape as an array (poller.arrays), and decides what a failed sbatch means: the task
    failed, or it waits with back-off."""

    def __init__(
        self,
        ctx: PollerContext,
        images: ImageSource,
        owners: OwnerRunner | None,
        canceller: Canceller,
    ) -> None:
        self.ctx = ctx
        #: Site mode: task directories are written, and jobs submitted, as the task's owner.
        self.owners = owners
        self.canceller = canceller
        self.backoff = Backoff(ctx)
        self.outcomes = Outcomes(ctx, self.backoff)
        self.prepare = Preparer(ctx, images, owners, self.outcomes)
        self.arrays = ArrayPlanner(ctx)
        self.record = Recorder(ctx, canceller)
        failures = SbatchFailures(ctx, self.prepare.nodes, self.outcomes)
        self.sbatch = Sbatch(
            ctx, owners, self.backoff, self.arrays, self.outcomes, failures, self.record
        )
        #: Tasks the last submission round held back for admission control.
        self.held_by_admission = 0

    @property
    def images(self) -> ImageSource:
        return self.prepare.images

    @images.setter
    def images(self, images: ImageSource) -> None:
        self.prepare.images = images

    @property
    def waiting_for_images(self) -> int:
        """Tasks of this submission round waiting for an image pull (a gauge)."""
        return self.prepare.waiting_for_images

    def submit_queued(self, stats: CycleStats) -> None:
        self.arrays.gather_until = None  # set again when this round holds tasks to gather
        if self.backoff.paused:
            return
        now = self.ctx.clock()
        tasks = self.ctx.store.tasks_to_submit(now=now, limit=MAX_SUBMISSIONS_PER_CYCLE)
        self.prepare.waiting_for_images = 0
        self.held_by_admission = 0
        if not tasks:
            self.prepare.keep([])
            metrics.observe_submission_round(0, 0)
            return
        admission = Admission(self.ctx)
        # A full round may hold tasks of owners with no room left, and others' tasks may wait
        # behind it: it is read again without them.
        tasks = admission.round_for_others(tasks, now=now, limit=MAX_SUBMISSIONS_PER_CYCLE)
        ready, held, no_room = self._admit_and_prepare(tasks, admission, stats)
        self.held_by_admission = held
        gathering = 0
        # Prepared and left QUEUED: staged tasks whose chain found no room, held to gather into
        # an array, or not reached by the round (the call budget spent): the next round takes
        # them as they are, not written again (a round of 500 tasks under a budget of a few
        # sbatches a cycle rewrote them all).
        kept = no_room
        if ready:
            # The tasks prepared before one had to wait go on, as they would one by one; those
            # held back to gather into an array stay QUEUED, untouched, for a later round.
            # Nothing is gathered where the round could not grow: admission held tasks back, or
            # the round is full (the tasks behind it are not read).
            may_gather = not held and len(tasks) < MAX_SUBMISSIONS_PER_CYCLE
            plan = self.arrays.plan(ready, stats, gather=may_gather)
            gathering = len(plan.held)
            kept += plan.held + self.sbatch.submit_round(plan.units, stats)
        self.prepare.keep(kept, read=[task.id for task in tasks])
        metrics.observe_submission_round(held, self.waiting_for_images, gathering)

    def _admit_and_prepare(
        self, tasks: list[TaskRecord], admission: Admission, stats: CycleStats
    ) -> tuple[list[Ready], int, list[Ready]]:
        """The round's tasks that admission lets go, their directories and job scripts written
        (counted in `admission` as they come), how many tasks admission held back, and those of
        them it held once prepared (a staged task's chain with no room for its three jobs); the
        others wait or failed."""
        ready: list[Ready] = []
        no_room: list[Ready] = []
        held = 0
        for index, task in enumerate(tasks):
            try:
                waiting = admission.refusal(task.owner)
                if waiting and admission.full:
                    # Every task behind it waits for the same jobs to end: say so, stop here.
                    self.outcomes.tell_waiting(tasks[index:], waiting)
                    held += len(tasks) - index
                    break
                if waiting:
                    self.outcomes.tell_waiting([task], waiting)
                    held += 1
                    continue
                item = self.prepare.ready(task, stats)
                if item is None:
                    continue
                jobs = CHAIN_JOBS if item.prepared.staged else 1
                if jobs > 1 and (waiting := admission.refusal(task.owner, jobs)):
                    self.outcomes.tell_waiting([task], waiting)  # its chain does not fit yet
                    no_room.append(item)
                    held += 1
                    continue
                ready.append(item)
                admission.add(task.owner, jobs)
            except Exception as exc:  # one broken task must not stop the others
                if self.outcomes.unexpected(exc, [task]):
                    break
            if self.backoff.paused:
                # The tasks that wait behind it wait for the same reason: say so.
                self.outcomes.tell_waiting(tasks[index + 1 :], self.backoff.reason)
                break
        return ready, held, no_room
