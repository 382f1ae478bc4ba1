"""A task's logs as the poller edits them: one typed attempt (AttemptLog) at a time, with the
passing conditions it states while they last (Condition).

A task has one entry per attempt to run it. A Slurm job lost through no fault of the task
(NODE_FAIL, BOOT_FAIL, PREEMPTED: submitted again) does not start an entry of its own: the next
job continues the entry (AttemptLog.lose_job), so logs[0] and logs[-1] both hold the executor
logs of the job that ran to the end, whichever one an engine reads (docs/states.md).

Stored and on the wire an attempt is a TES task log: a condition is one of its `system_logs`
lines, so clients read it as any other line. The store keeps the conditions' kinds beside
them (CONDITION_KINDS_KEY, never rendered), so a condition is found again by its kind, never
by its wording.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bridge.core.tes import CONDITION_KINDS_KEY

Logs = list[dict[str, Any]]

#: The attempt's metadata key for the jobs it lost (NODE_FAIL, ...), comma-separated, oldest first.
LOST_JOBS_KEY = "slurm_lost_job_ids"
#: A task staged on the transfer partition (staging.where = "transfer"): its attempt's
#: metadata marks it before the first sbatch (STAGING_KEY = "transfer"), and holds the ids of
#: its stage-in and stage-out jobs beside `slurm_job_id` (the task's own job) and what Slurm
#: said of each (`slurm_stage_in_state`, ..._node, ..._partition, ..._exit_code).
STAGING_KEY = "slurm_staging"
#: STAGING_KEY's value.
TRANSFER = "transfer"
STAGE_IN_KEY = "slurm_stage_in"
STAGE_OUT_KEY = "slurm_stage_out"
#: The suffixes of each transfer job's keys: STAGE_IN_KEY + "_job_id", ...
PART_FACTS = ("_job_id", "_state", "_node", "_partition", "_exit_code")
#: The metadata one Slurm job gives its attempt: the next job's replace them.
_JOB_FACTS = (
    "slurm_job_id",
    "slurm_state",
    "slurm_node",
    "slurm_partition",
    "slurm_elapsed_seconds",
    "slurm_max_rss_bytes",
    "memory_peak_bytes",
    "cpu_time_seconds",
    "slurm_expected_start",
)


class ConditionKind(enum.Enum):
    """What a task waits for now. A task says at most one of these at a time, besides its
    image pull notes: a new one replaces the last, and it goes when the task moves on."""

    #: squeue: the job waits in Slurm's queue (its reason in the line).
    SLURM_PENDING = "slurm_pending"
    SLURM_SUSPENDED = "slurm_suspended"
    SLURM_STOPPED = "slurm_stopped"
    #: sbatch got no answer from slurmctld: submitted again after the back-off.
    SLURM_UNREACHABLE = "slurm_unreachable"
    #: sbatch was refused for one of Slurm's limits (MaxSubmitJobs, MaxJobCount).
    SLURM_LIMIT = "slurm_limit"
    #: This service's admission control (slurm.max_jobs_in_flight, slurm.max_jobs_per_owner).
    ADMISSION = "admission"
    #: The nodes' TmpDisk could not be read (slurm.disk_request = "auto").
    TMP_DISK_UNKNOWN = "tmp_disk_unknown"
    #: The task directory could not be written (a full or absent work filesystem).
    TASK_DIR_UNWRITABLE = "task_dir_unwritable"
    #: Transient trouble pulling one of the task's images (ImageCache.problem()); one note
    #: per image, replaced together, beside the condition above.
    IMAGE_PULL = "image_pull"


@dataclass(frozen=True)
class Condition:
    kind: ConditionKind
    #: The system_logs line that says it.
    text: str


#: Attempts stored before the kinds were: their condition lines are known by their wording
#: (once: the attempt is stored with its kinds when it is next written).
_EARLIER_CONDITIONS = [
    (re.compile(r"^Slurm job \S+ is pending\b"), ConditionKind.SLURM_PENDING),
    (re.compile(r"^Slurm job \S+ is suspended\b"), ConditionKind.SLURM_SUSPENDED),
    (re.compile(r"^Slurm job \S+ is stopped\b"), ConditionKind.SLURM_STOPPED),
    (re.compile(r"^cannot reach Slurm to submit"), ConditionKind.SLURM_UNREACHABLE),
    # Admission, Slurm's limits and the task directory said "waiting: ": any kind but an image
    # note replaces it the same way.
    (re.compile(r"^waiting: "), ConditionKind.ADMISSION),
    (re.compile(r"^pulling image "), ConditionKind.IMAGE_PULL),
]


def _earlier_kind(line: str) -> ConditionKind | None:
    for pattern, kind in _EARLIER_CONDITIONS:
        if pattern.match(line):
            return kind
    return None


@dataclass
class AttemptLog:
    """One attempt's TES task log. `system_logs` holds the lines that stay (None: the stored
    log has none, not even an empty list); `conditions` come after them on the wire, the one
    condition first, then the image notes."""

    logs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    start_time: str | None = None
    end_time: str | None = None
    metadata: dict[str, str] | None = None
    system_logs: list[str] | None = None
    conditions: list[Condition] = field(default_factory=list)

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> AttemptLog:
        lines: list[str] | None = entry.get("system_logs")
        conditions: list[Condition] = []
        if lines is not None:
            lines, conditions = _split_conditions(lines, entry.get(CONDITION_KINDS_KEY))
        metadata = entry.get("metadata")
        return cls(
            logs=list(entry.get("logs") or []),
            outputs=list(entry.get("outputs") or []),
            start_time=entry.get("start_time"),
            end_time=entry.get("end_time"),
            metadata=None if metadata is None else dict(metadata),
            system_logs=lines,
            conditions=conditions,
        )

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"logs": self.logs, "outputs": self.outputs}
        for key, value in (("start_time", self.start_time), ("end_time", self.end_time)):
            if value is not None:
                entry[key] = value
        if self.system_logs is not None or self.conditions:
            entry["system_logs"] = (self.system_logs or []) + [c.text for c in self.conditions]
        if self.conditions:
            entry[CONDITION_KINDS_KEY] = [c.kind.value for c in self.conditions]
        if self.metadata is not None:
            entry["metadata"] = self.metadata
        return entry

    def ensure_metadata(self) -> dict[str, str]:
        """The metadata, created when missing."""
        if self.metadata is None:
            self.metadata = {}
        return self.metadata

    def add_system_logs(self, lines: Iterable[str]) -> None:
        """Lines that stay, each once."""
        for line in lines:
            if not line:
                continue
            if self.system_logs is None:
                self.system_logs = []
            if line not in self.system_logs:
                self.system_logs.append(line)

    def set_condition(self, condition: Condition | None) -> None:
        """Make `condition` the attempt's one condition (image notes apart); None removes it."""
        notes = [c for c in self.conditions if c.kind is ConditionKind.IMAGE_PULL]
        self.conditions = ([condition] if condition else []) + notes
        if condition and self.system_logs is None:
            self.system_logs = []  # once said, the attempt keeps a (maybe empty) system_logs

    def set_image_notes(self, notes: list[str]) -> bool:
        """Replace the image pull notes by `notes`; returns whether they changed."""
        others = [c for c in self.conditions if c.kind is not ConditionKind.IMAGE_PULL]
        conditions = others + [Condition(ConditionKind.IMAGE_PULL, note) for note in notes]
        if conditions == self.conditions:
            return False
        self.conditions = conditions
        if not conditions and not self.system_logs:
            self.system_logs = None
        return True

    def clear_conditions(self) -> None:
        self.conditions = []

    def lose_job(self) -> None:
        """The attempt's job was lost through no fault of the task and is submitted again: the
        next job continues this attempt. The lost job keeps its lines (why it ended, and here
        its node) and its id in LOST_JOBS_KEY; its times, executor logs, outputs and Slurm
        facts go, as its executors run again."""
        metadata = self.ensure_metadata()
        job_id = metadata.get("slurm_job_id")
        lost = self.lost_jobs()
        if job_id and job_id not in lost:
            node = metadata.get("slurm_node")
            if node:
                self.add_system_logs([f"Slurm job {job_id} ran on node {node}"])
        # A staged task's chain goes whole: its transfer jobs are lost with it.
        chain = [
            metadata.get(STAGE_IN_KEY + "_job_id"),
            job_id,
            metadata.get(STAGE_OUT_KEY + "_job_id"),
        ]
        gone = [j for j in chain if j and j not in lost]
        if gone:
            metadata[LOST_JOBS_KEY] = ",".join([*lost, *gone])
        for key in _JOB_FACTS:
            metadata.pop(key, None)
        for key in (STAGE_IN_KEY, STAGE_OUT_KEY):
            for suffix in PART_FACTS:
                metadata.pop(key + suffix, None)
        self.logs = []
        self.outputs = []
        self.start_time = None
        self.end_time = None

    def lost_jobs(self) -> list[str]:
        """The ids of the jobs this attempt lost (see lose_job)."""
        return [j for j in (self.metadata or {}).get(LOST_JOBS_KEY, "").split(",") if j]


def _split_conditions(
    lines: list[str], kinds: list[str] | None
) -> tuple[list[str], list[Condition]]:
    """The lines that stay and the conditions, which end the stored system_logs."""
    if kinds is None:
        earlier = [(line, _earlier_kind(line)) for line in lines]
        kept = [line for line, kind in earlier if kind is None]
        return kept, [Condition(kind, line) for line, kind in earlier if kind is not None]
    start = len(lines) - len(kinds)
    said = zip(kinds, lines[start:], strict=True)
    return lines[:start], [Condition(ConditionKind(kind), line) for kind, line in said]


class TaskLogs:
    """A task's `logs`, one entry per attempt: the attempts asked for are typed, the others
    stay as stored (never changed: no copy of them is made)."""

    def __init__(self, entries: Logs | None) -> None:
        self._entries: list[dict[str, Any] | AttemptLog] = list(entries or [])

    def __len__(self) -> int:
        return len(self._entries)

    def attempt(self, number: int) -> AttemptLog:
        """The log of Slurm attempt `number` (1-based, the store's `attempt`). A job that
        replaces a lost one continues its entry (see the module doc), so a task has one entry;
        logs stored with one entry per job (before lost jobs were folded) keep that: attempt N
        writes entry N there."""
        number = min(number, max(len(self._entries), 1))
        while len(self._entries) < number:
            self._entries.append(AttemptLog())
        entry = self._entries[number - 1]
        if isinstance(entry, AttemptLog):
            return entry
        typed = AttemptLog.from_json(entry)
        self._entries[number - 1] = typed
        return typed

    def to_json(self) -> Logs:
        return [e.to_json() if isinstance(e, AttemptLog) else e for e in self._entries]


def failure_logs(logs: Logs | None, attempt: int, message: str, now: str) -> Logs:
    """`logs` with `message` in the attempt's system_logs, ended at `now` unless already; the
    task no longer waits for anything."""
    task_logs = TaskLogs(logs)
    entry = task_logs.attempt(max(attempt, 1))
    entry.clear_conditions()
    entry.add_system_logs([message])
    if entry.end_time is None:
        entry.end_time = now
    return task_logs.to_json()
