"""Submitting QUEUED tasks: images, the task directory, sbatch, and waiting with back-off
while Slurm or the work filesystem is away."""

from __future__ import annotations

import errno
import logging
import secrets
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.core import backend_params
from bridge.core.naming import LEASE_EPOCH_ARG, array_job_name, job_name
from bridge.images.ref import ImagePullError
from bridge.jobscript.render import prepare_task_dir
from bridge.jobscript.task import RenderError
from bridge.poller.arrays import ARRAY_JOB_KEY, ArrayPlanner, PreparedJob, Ready, marked_logs
from bridge.poller.attempt import Condition, ConditionKind, TaskLogs, failure_logs
from bridge.poller.cancel import Canceller
from bridge.poller.context import CycleStats, ImageSource, PollerContext, format_time_now, short
from bridge.poller.decisions import TIME_LIMIT_KEY
from bridge.poller.owners import OwnerCommandError, OwnerRunner
from bridge.slurm import NodeSizes, Outage, Refusal, SlurmError, SlurmRejected, SlurmUnavailable
from bridge.store import SubmissionFailure, TaskRecord, unavailable_reason
from bridge.system import metrics

log = logging.getLogger("bridge.poller")

#: Submissions per cycle, so that polling stays regular when thousands of tasks arrive at once.
MAX_SUBMISSIONS_PER_CYCLE = 500
#: Slurm calls that submissions leave in the budget for the rest of the cycle: its squeue (two
#: RPCs), sacct and scancel. Tasks the budget does not let go stay QUEUED for the next cycle.
BUDGET_RESERVE = 4
#: Errors while preparing a task directory that pass by themselves (a full or over-quota
#: filesystem, a file server away): the task waits in QUEUED and is tried again with back-off.
TRANSIENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM, errno.EMFILE,
     errno.ENFILE, errno.EAGAIN, errno.ESTALE, errno.ETIMEDOUT, errno.EBUSY}
)  # fmt: skip
#: After sbatch refuses a `--tmp`, TmpDisk is read again if the last read is older than this
#: (at most one sinfo per this many seconds, however many tasks are refused); after sinfo failed
#: with no answer yet, tasks that can do without it (memory only) try it again no sooner.
TMP_DISK_RECHECK = 30.0


class _Wait(Exception):
    """The task waits in QUEUED (submissions paused) for `reason`."""

    def __init__(self, reason: Condition) -> None:
        super().__init__(reason.text)
        self.reason = reason


class _Fail(Exception):
    """The task cannot run: SYSTEM_ERROR with this message."""


def _time_limit(document: dict[str, Any], config: Config) -> backend_params.TimeLimit | None:
    """The --time the render gave the job (it refuses a task whose limit raises here)."""
    params = (document.get("resources") or {}).get("backend_parameters")
    try:
        return backend_params.time_limit(params, config.slurm.times)
    except backend_params.ParameterError:
        return None


def _gigabytes(document: dict[str, Any], key: str) -> float:
    value = (document.get("resources") or {}).get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return 0.0


def disk_gb(document: dict[str, Any]) -> float:
    return _gigabytes(document, "disk_gb")


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


class NodeSizesCache:
    """The partitions' node TmpDisk (slurm.disk_request "auto") and memory (`--mem` of a whole
    node), read with one sinfo now and then."""

    def __init__(self, ctx: PollerContext) -> None:
        self.ctx = ctx
        self._nodes: NodeSizes | None = None
        self._read_at = 0.0
        self._failed_at = float("-inf")

    def get(self, stats: CycleStats) -> NodeSizes:
        """Read again after `slurm.tmp_disk_refresh_seconds`. When sinfo fails the last answer
        stays in use; with none yet, the SlurmError is raised."""
        now = self.ctx.clock()
        refresh = self.ctx.config.slurm.tmp_disk_refresh_seconds
        if self._nodes is None or now - self._read_at >= refresh:
            try:
                stats.slurm_calls += 1
                self._nodes = self.ctx.slurm.node_sizes()
                log.info(
                    "node-local disk (TmpDisk) by partition: %s; largest node memory: %s",
                    self._nodes.describe_tmp_disk(),
                    self._nodes.memory_largest,
                )
            except SlurmError as exc:
                if self._nodes is None:
                    raise
                log.warning("sinfo failed; keeping the node sizes read before: %s", exc)
            self._read_at = now
        return self._nodes

    def known(self, stats: CycleStats) -> NodeSizes | None:
        """`get`, or None when sinfo fails; with no answer yet, sinfo is tried again only
        `TMP_DISK_RECHECK` seconds after it failed (tasks that can do without it go on)."""
        if self._nodes is None and self.ctx.clock() - self._failed_at < TMP_DISK_RECHECK:
            return None
        try:
            return self.get(stats)
        except SlurmError as exc:
            log.warning("sinfo failed; --mem stays as asked: %s", exc)
            self._failed_at = self.ctx.clock()
            return None

    def hint(self, disk: float, stats: CycleStats) -> str:
        """Why sbatch refused the `--tmp` of `disk` GB, and the setting that decides it."""
        mode = self.ctx.config.slurm.disk_request
        if self.ctx.clock() - self._read_at > TMP_DISK_RECHECK:
            self._read_at = float("-inf")  # what the nodes declare may have changed
        try:
            declared = f"the nodes declare TmpDisk {self.get(stats).describe_tmp_disk()}"
        except SlurmError:
            declared = "the nodes' TmpDisk could not be read"
        hint = (
            f". resources.disk_gb = {disk:g} asks Slurm for that much node-local "
            f'disk (sbatch --tmp, slurm.disk_request = "{mode}"), and {declared}'
        )
        if mode == "tmp":
            return hint + (
                "; a node that declares no TmpDisk (0) gives no --tmp at all: set "
                'slurm.disk_request = "auto" to pass disk_gb only where nodes declare TmpDisk'
            )
        return hint + "; ask for less disk_gb, or for a partition with larger TmpDisk"


class Admission:
    """Admission control: `slurm.max_jobs_in_flight` jobs of this service in Slurm at most, and
    `slurm.max_jobs_per_owner` of one owner; counted from the store once per submission round,
    with the jobs of decided tasks that squeue still listed (PollerContext.jobs_leaving): a job
    is counted until the poller has seen it leave Slurm, never less."""

    def __init__(self, ctx: PollerContext) -> None:
        cfg = ctx.config.slurm
        self.max_total = cfg.max_jobs_in_flight
        self.max_owner = cfg.max_jobs_per_owner
        self.by_owner: dict[str | None, int] = {}
        if ctx.admission_control:
            self.by_owner = ctx.store.jobs_in_flight_by_owner()
            # Jobs of tasks already decided that Slurm has not let go yet.
            for owner in ctx.jobs_leaving.values():
                self.by_owner[owner] = self.by_owner.get(owner, 0) + 1
        self.total = sum(self.by_owner.values())

    @property
    def full(self) -> bool:
        return bool(self.max_total) and self.total >= self.max_total

    def refusal(self, owner: str | None) -> Condition | None:
        """Why a task of `owner` waits, or None when it may be submitted."""
        if self.full:
            return Condition(
                ConditionKind.ADMISSION,
                f"waiting: {self.total} jobs of this service are in Slurm, the most it submits "
                f"at once (slurm.max_jobs_in_flight = {self.max_total})",
            )
        if self.max_owner and self.by_owner.get(owner, 0) >= self.max_owner:
            return Condition(
                ConditionKind.ADMISSION,
                f"waiting: {self.by_owner.get(owner, 0)} jobs of this task's owner are in Slurm, "
                f"the most one owner may have (slurm.max_jobs_per_owner = {self.max_owner})",
            )
        return None

    def owners_at_limit(self) -> list[str | None]:
        """Owners with no room left: their tasks are left out of a full round, so that a
        thousand of them queued first do not keep everyone else's out of it."""
        if not self.max_owner or self.full:
            return []  # when full, every task is read to be told why it waits
        return [owner for owner, jobs in self.by_owner.items() if jobs >= self.max_owner]

    def add(self, owner: str | None) -> None:
        self.total += 1
        self.by_owner[owner] = self.by_owner.get(owner, 0) + 1


class Preparer:
    """The task directory and its job script, written by the service or (site mode) by the
    task's owner, with the nodes' TmpDisk that `slurm.disk_request = "auto"` needs and their
    memory (`memory_directive`)."""

    def __init__(self, ctx: PollerContext, owners: OwnerRunner | None) -> None:
        self.ctx = ctx
        self.owners = owners
        self.nodes = NodeSizesCache(ctx)

    def __call__(
        self,
        document: dict[str, Any],
        owner: str | None,
        image_paths: dict[str, str],
        stats: CycleStats,
        *,
        task_owner: str | None = None,
    ) -> PreparedJob:
        """Raises _Fail or _Wait. `owner`: who writes it (site mode), `task_owner`: whose groups
        `slurm.rules` look at."""
        disk = disk_gb(document)
        script = self._write(
            document, owner, image_paths, self._nodes(disk, document, stats), task_owner
        )
        return PreparedJob(script, _time_limit(document, self.ctx.config), disk)

    def _nodes(self, disk: float, document: dict[str, Any], stats: CycleStats) -> NodeSizes | None:
        """What the task's directives need of the nodes, read when it asks for disk
        (disk_request "auto") or memory. Unknown disk holds the task; unknown memory only
        leaves `--mem` as asked."""
        if not (self.ctx.config.slurm.disk_request == "auto" and disk > 0):
            return self.nodes.known(stats) if _gigabytes(document, "ram_gb") else None
        try:
            return self.nodes.get(stats)
        except SlurmError as exc:
            log.warning("sinfo failed: %s", exc)
            reason = f"cannot read the nodes' TmpDisk from Slurm ({short(exc)}); retrying"
            raise _Wait(Condition(ConditionKind.TMP_DISK_UNKNOWN, reason)) from exc

    def _write(
        self,
        document: dict[str, Any],
        owner: str | None,
        image_paths: dict[str, str],
        nodes: NodeSizes | None,
        task_owner: str | None,
    ) -> Path:
        """The task directory, rendered and written; returns its job script."""
        try:
            if owner and self.owners is not None:
                return self.owners.adopt(owner, document, image_paths, nodes)
            return prepare_task_dir(
                document,
                config=self.ctx.config,
                image_paths=image_paths,
                nodes=nodes,
                owner=task_owner,
            )
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS:
                raise _Fail(f"cannot prepare the task directory: {exc}") from exc
            # Every task would meet the same full disk: all submissions wait for the back-off.
            log.warning("cannot prepare the directory of task %s: %s", document["id"], exc)
            reason = f"waiting: cannot prepare the task directory ({exc})"
            raise _Wait(Condition(ConditionKind.TASK_DIR_UNWRITABLE, reason)) from exc
        except RenderError as exc:
            raise _Fail(f"cannot run this task here: {exc}") from exc
        except OwnerCommandError as exc:
            raise _Fail(f"cannot create the task directory as {owner}: {exc}") from exc


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
        self.images = images
        #: Site mode: task directories are written, and jobs submitted, as the task's owner.
        self.owners = owners
        self.canceller = canceller
        self.backoff = Backoff(ctx)
        self.prepare = Preparer(ctx, owners)
        self.arrays = ArrayPlanner(ctx)
        #: Tasks of this submission round waiting for an image pull (a gauge).
        self.waiting_for_images = 0
        #: Tasks the last submission round held back for admission control.
        self.held_by_admission = 0

    def submit_queued(self, stats: CycleStats) -> None:
        self.arrays.gather_until = None  # set again when this round holds tasks to gather
        if self.backoff.paused:
            return
        store = self.ctx.store
        now = self.ctx.clock()
        tasks = store.tasks_to_submit(now=now, limit=MAX_SUBMISSIONS_PER_CYCLE)
        self.waiting_for_images = 0
        self.held_by_admission = 0
        if not tasks:
            metrics.observe_submission_round(0, 0)
            return
        admission = Admission(self.ctx)
        at_limit = admission.owners_at_limit()
        if len(tasks) == MAX_SUBMISSIONS_PER_CYCLE and any(t.owner in at_limit for t in tasks):
            # A full round may hold tasks of owners with no room left, and others' tasks may wait
            # behind it: read the round again without them.
            tasks = store.tasks_to_submit(
                now=now, limit=MAX_SUBMISSIONS_PER_CYCLE, skip_owners=at_limit
            )
        ready, held = self._prepare_round(tasks, admission, stats)
        self.held_by_admission = held
        gathering = 0
        if ready:
            # The tasks prepared before one had to wait go on, as they would one by one; those
            # held back to gather into an array stay QUEUED, untouched, for a later round.
            # Nothing is gathered where the round could not grow: admission held tasks back, or
            # the round is full (the tasks behind it are not read).
            may_gather = not held and len(tasks) < MAX_SUBMISSIONS_PER_CYCLE
            plan = self.arrays.plan(ready, stats, gather=may_gather)
            gathering = len(plan.held)
            self._submit_round(plan.units, stats)
        metrics.observe_submission_round(held, self.waiting_for_images, gathering)

    def _prepare_round(
        self, tasks: list[TaskRecord], admission: Admission, stats: CycleStats
    ) -> tuple[list[Ready], int]:
        """The round's tasks that admission lets go, their directories and job scripts written
        (counted in `admission` as they come), and how many tasks admission held back; the
        others wait or failed."""
        ready: list[Ready] = []
        held = 0
        for index, task in enumerate(tasks):
            try:
                waiting = admission.refusal(task.owner)
                if waiting and admission.full:
                    # Every task behind it waits for the same jobs to end: say so, stop here.
                    tell_waiting(self.ctx, tasks[index:], waiting)
                    held += len(tasks) - index
                    break
                if waiting:
                    tell_waiting(self.ctx, [task], waiting)
                    held += 1
                    continue
                item = self._ready(task, stats)
                if item is not None:
                    ready.append(item)
                    admission.add(task.owner)
            except Exception as exc:  # one broken task must not stop the others
                if self._unexpected(exc, [task]):
                    break
            if self.backoff.paused:
                # The tasks that wait behind it wait for the same reason: say so.
                tell_waiting(self.ctx, tasks[index + 1 :], self.backoff.reason)
                break
        return ready, held

    def _budget_spent(self, until: float) -> bool:
        """Whether this round stops for the call budget: it would leave fewer than
        BUDGET_RESERVE tokens, or it has used its time (counted as a wait either way)."""
        budget = self.ctx.slurm.budget
        if not budget.allows(keep=BUDGET_RESERVE, command="sbatch"):
            return True
        if budget.rate and self.ctx.clock() > until:
            budget.note_wait("sbatch")
            return True
        return False

    def _submit_round(self, units: list[list[Ready]], stats: CycleStats) -> None:
        """One sbatch per unit: a task of its own, or several as one array; a failed sbatch
        stops the round (the back-off it starts)."""
        paused_until = self.backoff.paused_until
        # While the budget sets the pace, a round lasts one poll interval at most: the follow
        # and the cancels of this cycle come in between.
        until = self.ctx.clock() + self.ctx.config.slurm.poll_interval
        for index, unit in enumerate(units):
            if self.backoff.paused_until > paused_until and self.backoff.paused:
                waiting = [r.task for later in units[index:] for r in later]
                tell_waiting(self.ctx, waiting, self.backoff.reason)
                break
            if self._budget_spent(until):
                break  # the Slurm call budget is spent for now: the rest go next cycle
            try:
                if len(unit) == 1:
                    stats.submitted += self._submit(unit[0], stats)
                else:
                    stats.submitted += self._submit_array(unit, stats)
            except Exception as exc:  # one broken submission must not stop the others
                if self._unexpected(exc, [r.task for r in unit]):
                    break

    def _unexpected(self, exc: Exception, tasks: list[TaskRecord]) -> bool:
        """An error no step expected: True when the round stops (the database is away, the
        tasks stay QUEUED), else the tasks failed."""
        reason = unavailable_reason(exc)
        if reason:
            # Passing (a full or locked database): the tasks stay QUEUED for later.
            log.error("submitting task %s postponed: %s", tasks[0].id, reason)
            return True
        for task in tasks:
            log.exception("submitting task %s failed unexpectedly", task.id)
            self._fail(task, "internal error while submitting the task; see the poller log")
        return False

    def _ready(self, task: TaskRecord, stats: CycleStats) -> Ready | None:
        """The task's directory and job script written, or None (it waits, or failed)."""
        assert task.document is not None
        image_paths = self._images(task)
        if image_paths is None:
            return None  # pulling in the background (or failed); tried again next cycle
        document = {**task.document, "id": task.id}
        owner = task.owner if self.owners is not None else None
        try:
            if self.owners is not None and not owner:
                raise _Fail("this task has no owner; in site mode tasks run only as their owner")
            prepared = self.prepare(document, owner, image_paths, stats, task_owner=task.owner)
        except _Fail as exc:
            self._fail(task, str(exc))
            return None
        except _Wait as exc:
            self._wait(task, task.attempt + 1, exc.reason)
            return None
        return Ready(task, prepared, document, owner)

    def _submit(self, ready: Ready, stats: CycleStats) -> int:
        """One sbatch for one task; 1 when it was submitted."""
        task = ready.task
        attempt = task.attempt + 1
        # Recorded before sbatch runs: after a crash, the job is looked up by name, not resubmitted.
        logs = marked_logs(task, attempt, None)  # an earlier try's array marks go
        if not self.ctx.store.mark_submitting(
            task.id, attempt=attempt, now=self.ctx.clock(), logs=logs
        ):
            return 0  # canceled meanwhile
        if logs is not None:
            task.logs = logs
        job_id = self._sbatch(task, attempt, ready, stats)
        if job_id is None:
            return 0
        self.backoff.failures = 0
        self._record(task, attempt, job_id, ready.prepared, stats)
        log.info("submitted task %s as Slurm job %s", task.id, job_id)
        return 1

    def _submit_array(self, unit: list[Ready], stats: CycleStats) -> int:
        """One `sbatch --array` for tasks of one shape; how many were submitted."""
        name = array_job_name(secrets.token_hex(6))
        members = self._mark_array(unit, name)
        if not members:
            return 0
        try:
            script = self.arrays.write_script(members, name)
        except OSError as exc:
            self._unmark(members, exc)
            return 0
        try:
            self.ctx.check_lease()  # a poller that lost its lease submits nothing
            stats.slurm_calls += 1
            array_id = self.ctx.slurm.submit(
                script, job_name=name, extra_args=self._account(members[0]),
                array_size=len(members), script_args=self._epoch_args(),
            )  # fmt: skip
        except SlurmRejected as exc:
            message = self._refusal(exc, members[0].prepared, stats)
            for ready in members:
                self._fail(ready.task, message, attempt=ready.task.attempt + 1)
            return 0
        except SlurmError as exc:
            if isinstance(exc, SlurmUnavailable) and exc.outage is Outage.LIMIT:
                self.arrays.refused_for_a_limit(len(members))
            delay = None
            for ready in members:
                delay = self._wait_for_slurm(ready.task, ready.task.attempt + 1, exc, delay)
            return 0
        self.backoff.failures = 0
        self.arrays.accepted(len(members))
        for index, ready in enumerate(members):
            task = ready.task
            job_id = f"{array_id}_{index}"
            self._record(task, task.attempt + 1, job_id, ready.prepared, stats, array_id)
        log.info("submitted %d tasks as Slurm job array %s (%s)", len(members), array_id, name)
        return len(members)

    def _mark_array(self, unit: list[Ready], name: str) -> list[Ready]:
        """Each task marked as submitting with its element (its index among the marked ones),
        before sbatch runs; the tasks canceled meanwhile are left out."""
        members: list[Ready] = []
        now = self.ctx.clock()
        for ready in unit:
            task = ready.task
            attempt = task.attempt + 1
            logs = marked_logs(task, attempt, (name, len(members)))
            if self.ctx.store.mark_submitting(task.id, attempt=attempt, now=now, logs=logs):
                if logs is not None:
                    task.logs = logs
                members.append(ready)
        return members

    def _unmark(self, members: list[Ready], exc: OSError) -> None:
        """The array's script could not be written: no sbatch ran, the tasks wait."""
        log.warning("cannot write the script of a job array: %s", exc)
        reason = Condition(
            ConditionKind.TASK_DIR_UNWRITABLE,
            f"waiting: cannot prepare the task directory ({exc})",
        )
        delay = None
        for ready in members:
            self.ctx.store.forget_submission(ready.task.id, attempt=ready.task.attempt)
            delay = self._wait(ready.task, ready.task.attempt + 1, reason, delay=delay)

    def _record(
        self,
        task: TaskRecord,
        attempt: int,
        job_id: str,
        prepared: PreparedJob,
        stats: CycleStats,
        array_id: str | None = None,
    ) -> None:
        """Store the task's job id; scancel it at once when the task was canceled meanwhile."""
        logs = TaskLogs(task.logs)
        entry = logs.attempt(attempt)
        entry.set_condition(None)
        metadata = entry.ensure_metadata()
        metadata["slurm_job_id"] = job_id
        if array_id is not None:
            metadata[ARRAY_JOB_KEY] = array_id
        if prepared.time_limit:
            metadata[TIME_LIMIT_KEY] = prepared.time_limit.describe()
        canceled = self.ctx.store.record_job(task.id, job_id, logs=logs.to_json())
        if canceled:
            # Canceled while sbatch ran (the API saw no job yet): scancel before it can start.
            now = self.ctx.store.get_task(task.id)
            if now is not None:
                self.canceller.carry_out([now], stats)

    def _images(self, task: TaskRecord) -> dict[str, str] | None:
        """The task's images in the cache, or None while they are pulled (all of the task's
        pulls start at once) or when one cannot be pulled (the task then failed)."""
        assert task.document is not None
        images = [e["image"] for e in task.document["executors"]]
        try:
            image_paths = self.images.resolve(images)
        except ImagePullError as exc:
            self._note_images(task, [], write=False)
            self._fail(task, f"cannot pull image: {exc}")
            return None
        # Transient trouble (registry down, full cache) is said in system_logs while it lasts.
        notes = [] if image_paths else [p for p in map(self.images.problem, images) if p]
        if image_paths is None:
            self.waiting_for_images += 1
        self._note_images(task, notes, write=image_paths is None)
        return image_paths

    def _epoch_args(self) -> list[str]:
        """Each job gets its submission's fence token (PollerContext.fence_token): a job
        submitted by a leader that had lost its lease, or by an sbatch that timed out and
        was acted on late, stands down where recovery fenced the task since (recover.py)."""
        return [f"{LEASE_EPOCH_ARG}{self.ctx.fence_token()}"]

    def _account(self, ready: Ready) -> list[str]:
        return self.owners.account_args(ready.owner, ready.document) if self.owners else []

    def _sbatch(
        self, task: TaskRecord, attempt: int, ready: Ready, stats: CycleStats
    ) -> str | None:
        """The job id, or None when sbatch failed (the task then failed or waits)."""
        try:
            self.ctx.check_lease()  # a poller that lost its lease submits nothing
            stats.slurm_calls += 1
            return self.ctx.slurm.submit(
                ready.prepared.script, job_name=job_name(task.id), comment=task.id,
                extra_args=self._account(ready), as_user=ready.owner,
                script_args=self._epoch_args(),
            )  # fmt: skip
        except SlurmRejected as exc:
            self._fail(task, self._refusal(exc, ready.prepared, stats), attempt=attempt)
        except SlurmError as exc:
            self._wait_for_slurm(task, attempt, exc)
        return None

    def _refusal(self, exc: SlurmRejected, prepared: PreparedJob, stats: CycleStats) -> str:
        """What a task that sbatch refused says in its system_logs: Slurm's words, and for a
        request that can be changed, what the job asked for and where to change it."""
        message = f"Slurm refused the job: {exc.reason}"
        if exc.refusal is Refusal.TMP_DISK:
            return message + self.prepare.nodes.hint(prepared.disk_gb, stats)
        if exc.refusal is Refusal.TIME_LIMIT:
            return message + _time_limit_hint(prepared.time_limit)
        return message

    def _wait_for_slurm(
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
        else:
            waiting = Condition(
                ConditionKind.SLURM_UNREACHABLE,
                f"cannot reach Slurm to submit the job ({short(exc)}); retrying with back-off",
            )
            log.warning("sbatch for task %s failed: %s", task.id, exc)
        submission = SubmissionFailure(task.attempt, maybe_started_at)
        return self._wait(task, attempt, waiting, submission, delay=delay)

    def _maybe_started(self) -> float:
        """When an sbatch that ended without an answer may have started: its own time-out ago
        (only the settle time is left to wait before the task is submitted again)."""
        return self.ctx.clock() - self.ctx.config.slurm.command_timeout

    def _wait(
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

    def _note_images(self, task: TaskRecord, notes: list[str], *, write: bool) -> None:
        """Replace the task's "pulling image" lines by `notes` (stored only when they change)."""
        if not notes and not task.logs:
            return
        logs = TaskLogs(task.logs)
        if not logs.attempt(task.attempt + 1).set_image_notes(notes):
            return
        task.logs = logs.to_json()
        if write:
            self.ctx.store.note(task.id, task.logs)

    def _fail(self, task: TaskRecord, message: str, *, attempt: int | None = None) -> None:
        logs = failure_logs(task.logs, attempt or task.attempt, message, format_time_now())
        if self.ctx.store.fail(task.id, logs, attempt=attempt, end_submission=attempt is not None):
            metrics.observe_finished("SYSTEM_ERROR")
        log.info("task %s failed: %s", task.id, message)
