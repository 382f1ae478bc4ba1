"""Job arrays: QUEUED tasks ready in one submission round whose job scripts ask Slurm for the
same (`slurm.arrays = "auto"`) go as one `sbatch --array=0-N`, in chunks of the cluster's
MaxArraySize.

While a burst arrives (a round of at least `slurm.array_min_tasks` tasks), each shape is held
back, left QUEUED as it is, while its tasks keep arriving: until none has arrived for
`slurm.array_gather_seconds`, or its oldest task has waited `slurm.array_gather_max_seconds`.
So a burst of one shape becomes one array (not one per round), and a shape too small for an
array can still grow into one; a lone task is never held.

Each task keeps its directory and job script; the array's script (bridge.jobscript.array) holds
the manifest, the task directories in element order. Before sbatch runs, each task stores the
array's name and its element (`ARRAY_NAME_KEY`, `ARRAY_INDEX_KEY` in its attempt's metadata,
written with `store.mark_submitting`): after a crash, recovery finds the array by its name and
gives each task its own element `ID_I`, exactly once. From then on an element is a job like any
other: followed, canceled (`scancel ID_I`) and submitted again (alone or in a later array) one
task at a time.

Staged tasks (poller.chain) of one shape, the same for each of their three parts, go as three
arrays (submit.staged): stage-in, the tasks' jobs (`aftercorr:` the stage-in array) and
stage-out (`aftercorr:` the tasks' array), element I of each task I's part. The array marks are
the tasks' array's (`ARRAY_NAME_KEY`: the transfer arrays' names add their part, as a chain's
jobs do), with the chain's (`STAGING_KEY`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.core import backend_params
from bridge.core.naming import RUN_PART, STAGE_IN_PART, STAGE_OUT_PART, job_name, part_job_name
from bridge.job.layout import SCRIPT, write_atomically
from bridge.jobscript.array import read_directives, render_array_script, shape
from bridge.jobscript.parts import PART_SCRIPTS
from bridge.poller.attempt import STAGE_IN_KEY, STAGE_OUT_KEY, STAGING_KEY, TRANSFER, TaskLogs
from bridge.poller.context import CycleStats, PollerContext
from bridge.slurm import SlurmError
from bridge.store import TaskRecord

log = logging.getLogger("bridge.poller")

#: The attempt's metadata while its sbatch runs, and after: the array's job name and the task's
#: element in it (a decimal string, as TES metadata values are strings).
ARRAY_NAME_KEY = "slurm_array_name"
ARRAY_INDEX_KEY = "slurm_array_index"
#: The array's own job id (the task's job is `ID_I`).
ARRAY_JOB_KEY = "slurm_array_job_id"
#: The attempt's metadata while its sbatch runs, and after, for a job of its own: the job's
#: name (`naming.job_name`: the task's name first). An attempt without it (nor an array's name)
#: was submitted by an earlier version, as `tes-<task id>`.
JOB_NAME_KEY = "slurm_job_name"
_MARKS = (
    ARRAY_NAME_KEY, ARRAY_INDEX_KEY, ARRAY_JOB_KEY, JOB_NAME_KEY, STAGING_KEY,
    STAGE_IN_KEY + "_job_id", STAGE_OUT_KEY + "_job_id",
)  # fmt: skip
#: The parts of a staged task, in the order of their arrays.
STAGED_PARTS = (STAGE_IN_PART, RUN_PART, STAGE_OUT_PART)
#: Slurm's own ceiling of MaxArraySize.
MAX_ANY = 4_000_001


@dataclass(frozen=True)
class PreparedJob:
    """A task's job script, with what it asks Slurm for that explains a refusal or a TIMEOUT."""

    script: Path
    #: The job's --time and where it came from; None: the partition's own limit.
    time_limit: backend_params.TimeLimit | None
    #: resources.disk_gb (0: none), which sbatch --tmp asks for per slurm.disk_request.
    disk_gb: float
    #: Staged on the transfer partition: stage-in, this job and stage-out (poller.chain),
    #: alone or in three arrays (submit.staged).
    staged: bool = False


@dataclass(frozen=True)
class Ready:
    """A task whose directory and job script are written, waiting for its sbatch."""

    task: TaskRecord
    prepared: PreparedJob
    document: dict[str, Any]
    #: Who runs sbatch (site mode: the task's owner).
    owner: str | None


@dataclass(frozen=True)
class Plan:
    """A round's submissions, and the tasks held back to gather."""

    #: In order: arrays (several tasks) and single tasks.
    units: list[list[Ready]]
    #: Tasks of a shape too small for an array yet: not submitted this round, left QUEUED.
    held: list[Ready] = field(default_factory=list)


#: The group key of a task submitted as a job of its own whatever others there are.
_ALONE = object()


def attempt_metadata(task: TaskRecord) -> dict[str, str]:
    """The metadata of the task's current attempt (empty before it has one), read from the
    stored entry as it is: the follow asks for it several times per task and cycle, and typing
    the entry (TaskLogs) each time cost a cycle with 10,000 array elements in flight seconds."""
    if not task.logs:
        return {}
    # The entry TaskLogs.attempt() would give; never one it would append (that has none).
    entry = task.logs[min(max(task.attempt, 1), len(task.logs)) - 1]
    return entry.get("metadata") or {}


def array_mark(task: TaskRecord) -> tuple[str, str] | None:
    """The array name and element index its current attempt's sbatch was given, if any."""
    metadata = attempt_metadata(task)
    name, index = metadata.get(ARRAY_NAME_KEY), metadata.get(ARRAY_INDEX_KEY)
    return (name, index) if name and index is not None else None


def submitted_name(task: TaskRecord) -> str:
    """The name its current attempt's job was given (an array's element carries the array's);
    `tes-<task id>` for a job an earlier version submitted, which stored no name."""
    mark = array_mark(task)
    if mark is not None:
        return mark[0]
    return attempt_metadata(task).get(JOB_NAME_KEY) or job_name(task.id)


def marked_logs(
    task: TaskRecord, attempt: int, mark: tuple[str, int | None], *, staged: bool = False
) -> Any:
    """The task's logs with attempt `attempt` marked with the name its job is given, and the
    element `mark[1]` of the array `mark[0]` (None: a job of its own, named `mark[0]`), the marks
    of an earlier submission removed; `staged`: the job (or element) is the middle of a chain of
    three (poller.chain). None when nothing changes."""
    logs = TaskLogs(task.logs)
    metadata = logs.attempt(attempt).ensure_metadata()
    before = {key: metadata.get(key) for key in _MARKS}
    for key in _MARKS:
        metadata.pop(key, None)
    name, element = mark
    if element is None:
        metadata[JOB_NAME_KEY] = name
    else:
        metadata[ARRAY_NAME_KEY] = name
        metadata[ARRAY_INDEX_KEY] = str(element)
    if staged:
        metadata[STAGING_KEY] = TRANSFER
    if {key: metadata.get(key) for key in _MARKS} == before:
        return None
    return logs.to_json()


def element_index(job_id: str) -> str | None:
    """`123_4` -> "4"; None for a job that is no array element."""
    _, sep, index = job_id.partition("_")
    return index if sep and index.isdigit() else None


class ArrayPlanner:
    """Which ready tasks go together, and the cluster's MaxArraySize (read once)."""

    def __init__(self, ctx: PollerContext) -> None:
        self.ctx = ctx
        self._max_size: int | None = None
        #: The largest array a submit limit let through lately (None: no limit met).
        self._cap: int | None = None
        #: When each task held back to gather was first held, by the poller's clock: a hold
        #: ends in time even when the task's creation time is ahead of this clock.
        self._held_since: dict[str, float] = {}
        #: When the first group held in the last round may go (None: none held): the poller's
        #: quick check starts a round then, new tasks or not.
        self.gather_until: float | None = None

    @property
    def enabled(self) -> bool:
        cfg = self.ctx.config.slurm
        # Site mode: each task's files are written, and its sbatch run, as its owner.
        return cfg.arrays == "auto" and not self.ctx.site

    def plan(self, ready: Sequence[Ready], stats: CycleStats, *, gather: bool = True) -> Plan:
        """The round's submissions in order: arrays (several tasks) and single tasks; and the
        tasks held back to gather (`_gathering`; none unless `gather`)."""
        minimum = self.ctx.config.slurm.array_min_tasks
        self.gather_until = None
        # A round of a handful is no burst; unless it holds the end of one, gathered so far.
        burst = len(ready) >= minimum or any(r.task.id in self._held_since for r in ready)
        if not self.enabled or not burst:
            self._held_since.clear()
            return Plan([[r] for r in ready])
        groups: dict[tuple[Any, ...], list[Ready]] = {}
        for item in ready:
            groups.setdefault(self._key(item), []).append(item)
        size = min(self._array_size(stats), self._cap or MAX_ANY)
        now = self.ctx.clock()
        held_since = self._held_since
        self._held_since = {}
        units: list[list[Ready]] = []
        held: list[Ready] = []
        for key, group in groups.items():
            # Full arrays go at once, the rest of the shape may wait for more; only a cluster
            # that takes arrays gathers.
            if gather and key[0] is not _ALONE and minimum <= size:
                rest = group[len(group) - len(group) % size :]
                if rest and self._gathering(rest, now, held_since):
                    held += rest
                    group = group[: len(group) - len(rest)]
            units += _units(group, size, minimum)
        return Plan(units, held)

    def _gathering(self, group: list[Ready], now: float, held_since: dict[str, float]) -> bool:
        """Whether a group waits for more of its shape: while its tasks keep arriving (the
        newest first seen in a round less than `slurm.array_gather_seconds` ago), for at most
        `slurm.array_gather_max_seconds` after its oldest was created or first seen. Arrivals
        are the poller's own sightings, by its clock: a creation time (another host's clock,
        perhaps) only ever shortens the wait."""
        cfg = self.ctx.config.slurm
        quiet, longest = cfg.array_gather_seconds, cfg.array_gather_max_seconds
        if quiet <= 0:
            return False
        since = {r.task.id: held_since.get(r.task.id, now) for r in group}
        created = [r.task.created_at for r in group]
        oldest = min([*since.values(), *(c for c in created if c is not None)])
        until = min(max(since.values()) + quiet, oldest + max(longest, quiet))
        if now >= until:
            return False
        self._held_since.update(since)
        if self.gather_until is None or until < self.gather_until:
            self.gather_until = until
        return True

    def refused_for_a_limit(self, size: int) -> None:
        """Slurm refused an array of `size` for a limit (a QOS's MaxSubmitJobs counts each
        element): the next ones are at most half as large, down to one job per task."""
        self._cap = max(1, size // 2)

    def accepted(self, size: int) -> None:
        """An array of `size` went through: the cap grows back."""
        if self._cap is not None and size >= self._cap:
            self._cap *= 2

    def _key(self, item: Ready) -> tuple[Any, ...]:
        # A staged task's three parts each ask the same as the others' (submit.staged).
        parts = STAGED_PARTS if item.prepared.staged else (RUN_PART,)
        try:
            shapes = tuple(shape(read_directives(part_script(item, p))) for p in parts)
        except (OSError, UnicodeDecodeError):
            return (_ALONE, item.task.id)  # unreadable here: submitted as a job of its own
        return (item.task.owner, item.owner, item.prepared.staged, shapes)

    def _array_size(self, stats: CycleStats) -> int:
        """MaxArraySize (1: arrays are off until scontrol answers)."""
        if self._max_size is None:
            try:
                stats.slurm_calls += 1
                self._max_size = self.ctx.slurm.max_array_size()
                log.info("Slurm's MaxArraySize: %d", self._max_size)
            except SlurmError as exc:
                log.warning("cannot read MaxArraySize; one job per task for now: %s", exc)
                return 1
        return self._max_size

    def write_script(
        self,
        members: Sequence[Ready],
        name: str,
        part: str = RUN_PART,
        indexes: Sequence[int] | None = None,
    ) -> Path:
        """The array's script (of staged tasks: of their `part`, named `name` and the part, as
        a chain's jobs are), in its first task's directory (sbatch reads it once); `indexes`:
        each member's element (default: its place)."""
        job = part_job_name(name, part)
        shared = [*shape(read_directives(part_script(members[0], part))), f"--job-name={job}"]
        text = render_array_script(
            config=self.ctx.config,
            shared=shared,
            task_dirs=[self.ctx.task_dir(m.task.id) for m in members],
            indexes=indexes,
            script=PART_SCRIPTS.get(part, SCRIPT),
        )
        path = self.ctx.task_dir(members[0].task.id) / f"{job}.sh"
        write_atomically(path, text, 0o700)
        return path


def part_script(item: Ready, part: str) -> Path:
    """The task's job script of `part` (a staged task's transfer parts have theirs beside it)."""
    if part not in PART_SCRIPTS:
        return item.prepared.script
    return item.prepared.script.parent / PART_SCRIPTS[part]


def _units(group: list[Ready], size: int, minimum: int) -> list[list[Ready]]:
    """A group's submissions: arrays of at most `size`, a job per task where fewer than
    `minimum` are left."""
    units: list[list[Ready]] = []
    for chunk in _chunks(group, size):
        units += [chunk] if len(chunk) >= minimum else [[r] for r in chunk]
    return units


def _chunks(items: list[Ready], size: int) -> Iterator[list[Ready]]:
    for start in range(0, len(items), max(size, 1)):
        yield items[start : start + size]
