"""The poller's pure decisions: a task's TES state from its job and records, and its logs.

Nothing here calls Slurm, the store or the file system.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from bridge import slurm
from bridge.core.naming import NO_RECORDS_EXIT_CODE, SUPERSEDED_EXIT_CODE, format_time
from bridge.core.reasons import CANCELED_OUTSIDE, NEVER_STARTS
from bridge.core.tes import TERMINAL_STATES, State
from bridge.job.records import JobRecords
from bridge.poller.attempt import AttemptLog, Condition, ConditionKind
from bridge.slurm import JobInfo

#: How long a job may be unknown to both squeue and sacct before the task is failed
#: (slurmdbd can lag behind slurmctld for a moment after a job ends).
MISSING_JOB_GRACE = 120.0
#: A job that could not even start its records (a full or read-only work filesystem on its
#: node) ran nothing of the task, and spends no retry of slurm.retries: faults of the system
#: may meet every attempt of one task (the nemesis: a full work filesystem, a slurmctld that
#: forgot a pending job, a full work filesystem again). This many such jobs at most beyond the
#: retries, so that a fault that never clears still ends the task.
NOTHING_RAN_RESUBMISSIONS = 5
#: The attempt's metadata key for the --time its job was given and where it came from.
TIME_LIMIT_KEY = "slurm_time_limit"
#: The attempt's metadata key for Slurm's estimate of when its pending job starts (RFC 3339).
EXPECTED_START_KEY = "slurm_expected_start"
#: An estimate that moved less than this (seconds) is not written again: the backfill
#: scheduler recomputes every pending job's estimate each bf_interval, and a drift of seconds
#: would rewrite every pending task each time.
EXPECTED_START_STEP = 60.0

OUTCOME_STATES = {
    "complete": State.COMPLETE,
    "executor_error": State.EXECUTOR_ERROR,
    "system_error": State.SYSTEM_ERROR,
}


@dataclass
class Decision:
    state: State
    messages: list[str] = field(default_factory=list)
    #: The job was lost through no fault of the task: submit it again.
    retry: bool = False
    #: The job must be canceled (it can never start).
    cancel_job: bool = False
    #: What the task waits for now (replaces the last condition; None clears it).
    condition: Condition | None = None

    @property
    def final(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def job_done(self) -> bool:
        """The task is done with this job: finished, or to be submitted again."""
        return self.final or self.retry


def decide(
    *,
    job: JobInfo | None,
    records: JobRecords,
    attempt: int,
    retries: int,
    current: State,
    time_limit: str | None = None,
    missing_for: float | None = None,
    on_preemption: str = "resubmit",
) -> Decision:
    """The TES state of a task from what Slurm says of its job and what the job recorded.
    `time_limit`: the --time the job was given and where it came from (TIME_LIMIT_KEY);
    `missing_for`: how long neither squeue nor sacct has known the job (None: they know it);
    `on_preemption`: for a job Slurm preempted, the task's own or the site's choice
    (backend_params.on_preemption): "report" ends it PREEMPTED, "resubmit" runs it again."""
    if records.outcome is not None:
        # The script writes its outcome last: the task is done, whatever Slurm says yet.
        return Decision(OUTCOME_STATES[records.outcome])
    if job is None:
        # The grace rule: slurmdbd can lag behind slurmctld for a moment after a job ends.
        if missing_for is not None and missing_for > MISSING_JOB_GRACE:
            lost = f"Slurm no longer knows job {records.job_id}"
            if records.phase is None and attempt <= retries:
                # Nothing of it ever ran (a pending job that a slurmctld killed before it
                # saved its state forgot): lost through no fault of the task.
                return Decision(
                    State.QUEUED, [f"{lost}, which never started; submitting it again"], retry=True
                )
            return Decision(State.SYSTEM_ERROR, [f"{lost} and it recorded no outcome"])
        return Decision(current)
    if not job.ended:
        return _decide_active(job, records, current)
    if job.state == "FAILED" and job.exit_code is None:
        # squeue's word alone: it has no exit code, and only sacct's (a moment behind
        # slurmctld) tells a job that could not write its records (NO_RECORDS_EXIT_CODE: the
        # system's failure, submitted again) from one that failed. The next cycles read sacct;
        # once the job leaves squeue without it, the missing-job grace above decides.
        return Decision(current)
    if job.state == "CANCELLED" and job.canceled_by is None:
        # squeue's word alone: only sacct names who cancelled the job, and one Slurm cancelled
        # itself is lost, not canceled (_lost_because). The same cycle asks sacct for jobs that
        # squeue lists as ended; this waits only while slurmdbd is a moment behind.
        return Decision(current)
    if job.state == "PREEMPTED" and on_preemption == "report":
        return _preempted(job)
    return _decide_ended(job, records, attempt, retries, time_limit)


def _ended(job: JobInfo) -> str:
    ended = f"Slurm job {job.job_id} ended in state {job.state}"
    if job.exit_code is not None:
        ended += f" (exit code {job.exit_code}" + (f", signal {job.signal})" if job.signal else ")")
    return ended


def _preempted(job: JobInfo) -> Decision:
    """Final here (on_preemption "report"): the client decides whether to run the
    task again. A job Slurm requeues itself is never seen PREEMPTED by squeue: it is
    followed under its id as it runs again."""
    where = f" in partition {job.partition}" if job.partition else ""
    return Decision(
        State.PREEMPTED,
        [
            f"{_ended(job)}: Slurm preempted it{where} for a job of higher priority; "
            "this server does not run it again: submit the task again"
        ],
    )


def _decide_ended(
    job: JobInfo, records: JobRecords, attempt: int, retries: int, time_limit: str | None
) -> Decision:
    """The job ended without recording an outcome: the script itself was stopped."""
    ended = _ended(job)
    in_executor = bool(records.phase and records.phase.startswith("running"))
    why_lost = _lost_because(job, records)
    if why_lost is not None:
        ended += why_lost
        # A job that stood down for a newer lease ran nothing: it spends no retry. Nor does one
        # that could not start its records, up to NOTHING_RAN_RESUBMISSIONS.
        no_records = (
            records.phase is None
            and _records_unwritable(job, records)
            and attempt <= retries + NOTHING_RAN_RESUBMISSIONS
        )
        if attempt <= retries or no_records or _superseded(job, records):
            return Decision(State.QUEUED, [f"{ended}; submitting it again"], retry=True)
        return Decision(State.SYSTEM_ERROR, [f"{ended}; no retries left ({retries})"])
    if job.state == "CANCELLED":
        return Decision(State.CANCELED, [f"{ended}: {CANCELED_OUTSIDE}"])
    if job.state in ("TIMEOUT", "OUT_OF_MEMORY"):
        why = "ran out of memory"
        if job.state == "TIMEOUT":
            limit = time_limit or "no --time was asked: the partition's own limit"
            why = f"reached its time limit ({limit})"
        # An executor that runs too long or too big is the task's failure; staging is not.
        state = State.EXECUTOR_ERROR if in_executor else State.SYSTEM_ERROR
        return Decision(state, [f"{ended}: the job {why}"])
    return Decision(State.SYSTEM_ERROR, [f"{ended} without recording an outcome"])


def _lost_because(job: JobInfo, records: JobRecords) -> str | None:
    """Why the ended job was lost through no fault of the task (to be submitted again), as
    words for its line; None when it was not lost."""
    if job.state in slurm.RETRYABLE_STATES:
        return ""
    if _superseded(job, records):
        return (
            ": it was submitted by a poller whose lease had passed to another login node's, "
            "and stood down before anything of the task ran"
        )
    if _records_unwritable(job, records):
        ran = "nothing of the task ran" if records.phase is None else "it did not finish"
        return (
            ": the job could not write its records in the work directory (a full or "
            f"read-only work filesystem?), so {ran}"
        )
    if (
        job.state == "CANCELLED"
        and not job.node
        and (job.canceled_by == "" or job.reason == "DependencyNeverSatisfied")
    ):
        # Cancelled by Slurm before it started (sacct: plain "CANCELLED", no node): a staged
        # task's later job (the only jobs with a dependency), decided here only once the job
        # before it ended well (poller.chain), when Slurm judged an array element's `aftercorr`
        # by the whole array, the corresponding element purged (docs/staging.md).
        return (
            ": Slurm cancelled it before it started, no one asked (for its dependency, though "
            "the job before it had ended well: an array element judged by its whole array?)"
        )
    if job.state == "FAILED" and job.signal and records.outcome is None:
        # The job script itself was killed (each executor runs in a subshell whose end the
        # script records): only something outside the task does that, such as a node's
        # processes killed as it failed, or an operator's kill.
        on = f" on {job.node}" if job.node else ""
        return f": its script was killed{on} before it could record an outcome"
    return _ended_by_an_id_given_out_twice(job, records)


def _ended_by_an_id_given_out_twice(job: JobInfo, records: JobRecords) -> str | None:
    """Why Slurm itself ended the job, as words for its line, after a slurmctld killed before
    it saved its state gave the id of a job it forgot, still running on a node, to a new one;
    None when that is not what ended it."""
    if job.state == "CANCELLED" and job.node and records.phase is None:
        # Slurm itself killed the job as it launched it, before its script started (the node
        # reported the id as a duplicate): lost through no fault of the task, nor canceled.
        return f" on {job.node} before its script started"
    if job.state == "CANCELLED" and job.canceled_by == "":
        # No one asked (sacct names no canceller): Slurm killed the job as it ran, when the id
        # was reported as a duplicate on its node, an array's every element with it.
        on = f" on {job.node}" if job.node else ""
        return f"{on}: Slurm cancelled it itself, no one asked (a job id given out twice?)"
    if job.state == "COMPLETED" and job.node and not records.started:
        # The script records its start before anything else (or exits with the no-records
        # code): this end is another job's, the orphan still running under the id on the node.
        return (
            f", yet its script never started on {job.node}: Slurm gave the id of a job it had "
            "forgotten to this one, and that job's end was taken for this one's"
        )
    return None


def _script_exited_with(job: JobInfo, records: JobRecords, code: int) -> bool:
    """The job script itself ended with one of its own exit codes, before recording an outcome.
    The script passes an executor's exit code on (so that sacct shows the job FAILED with it)
    only after it wrote the task's outcome, which decides then (`decide`): without an outcome,
    the code is the script's own."""
    return (
        job.state == "FAILED"
        and job.exit_code == code
        and not job.signal
        and records.outcome is None
    )


def _records_unwritable(job: JobInfo, records: JobRecords) -> bool:
    """The script exited because it could not start or write its records (see
    templates/job.sh.j2, start_records and record): the system's failure, never the task's."""
    return _script_exited_with(job, records, NO_RECORDS_EXIT_CODE)


def _superseded(job: JobInfo, records: JobRecords) -> bool:
    """The script stood down at its start: the task's directory is fenced at a newer lease
    epoch than the one its job was submitted under (templates/job.sh.j2)."""
    return _script_exited_with(job, records, SUPERSEDED_EXIT_CODE) and records.phase is None


def _decide_active(job: JobInfo, records: JobRecords, current: State) -> Decision:
    tes_state = job.tes_state
    if tes_state == State.QUEUED.value:
        if job.reason in slurm.HOPELESS_PENDING_REASONS:
            return Decision(
                State.SYSTEM_ERROR,
                [f"Slurm job {job.job_id} {NEVER_STARTS} ({job.reason}); it was canceled"],
                cancel_job=True,
            )
        if not job.reason:
            return Decision(State.QUEUED)
        pending = f"Slurm job {job.job_id} is pending ({job.reason})"
        return Decision(State.QUEUED, condition=Condition(ConditionKind.SLURM_PENDING, pending))
    if tes_state == State.PAUSED.value:
        kind = ConditionKind.SLURM_SUSPENDED
        if job.state == "STOPPED":
            kind = ConditionKind.SLURM_STOPPED
        paused = f"Slurm job {job.job_id} is {job.state.lower()}"
        return Decision(State.PAUSED, condition=Condition(kind, paused))
    if tes_state in (State.INITIALIZING.value, State.RUNNING.value):
        # "ran": a staged task's job ended its executors, its stage-out job uploads next.
        if records.phase and (
            records.phase.startswith("running") or records.phase in ("uploading", "ran")
        ):
            return Decision(State.RUNNING)
        return Decision(State.INITIALIZING)
    return Decision(current)  # a state we do not know: keep what we had (bridge.slurm warns, once)


def in_queue(job: JobInfo | None) -> bool:
    """The job waits in Slurm's queue: it has not started, so it has recorded nothing yet."""
    return job is not None and not job.ended and job.tes_state == State.QUEUED.value


# ---------------------------------------------------------------------------------- logs
def log_decision(
    entry: AttemptLog, decision: Decision, records: JobRecords, job: JobInfo | None
) -> None:
    """Write into the attempt's log what the job recorded, what sacct or squeue said of it, and
    the decision's messages and condition. A job still pending has recorded nothing yet."""
    if not in_queue(job):
        fill_attempt_log(entry, records, job, final=decision.job_done)
    note_expected_start(entry, job if in_queue(job) else None)
    entry.add_system_logs(decision.messages)
    entry.set_condition(None if decision.job_done else decision.condition)


def note_expected_start(entry: AttemptLog, pending: JobInfo | None) -> None:
    """Slurm's estimate of the pending job's start in the attempt's metadata, rewritten when it
    moved by EXPECTED_START_STEP or more; gone once the job left the queue, or Slurm has no
    estimate any more."""
    expected = pending.expected_start if pending is not None else None
    metadata = entry.metadata or {}
    known = metadata.get(EXPECTED_START_KEY)
    if expected is None:
        metadata.pop(EXPECTED_START_KEY, None)
        return
    if known is not None and not _moved(known, expected):
        return
    entry.ensure_metadata()[EXPECTED_START_KEY] = format_time(expected)


def _moved(known: str, expected: datetime) -> bool:
    """Whether the estimate moved by EXPECTED_START_STEP or more from the one written."""
    try:
        moved = abs((datetime.fromisoformat(known) - expected).total_seconds())
    except (ValueError, TypeError):
        return True  # not one written here: written again
    return moved >= EXPECTED_START_STEP


def slurm_facts(metadata: dict[str, str], job: JobInfo) -> None:
    for key, value in (
        ("slurm_state", job.state),
        ("slurm_node", job.node),
        ("slurm_partition", job.partition),
        ("slurm_elapsed_seconds", job.elapsed_seconds),
        ("slurm_max_rss_bytes", job.max_rss_bytes),
    ):
        if value not in (None, ""):
            metadata[key] = str(value)


def fill_attempt_log(
    entry: AttemptLog, records: JobRecords, job: JobInfo | None, *, final: bool
) -> None:
    """Executor logs, outputs and metadata of one attempt, from its records and sacct."""
    start = records.start_time or (job.start_time if job else None)
    if start:
        entry.start_time = format_time(start)
    end = records.end_time or (job.end_time if job else None)
    if final and end:
        entry.end_time = format_time(end)
    entry.logs = executor_logs(records)
    entry.outputs = list(records.outputs)
    entry.add_system_logs(records.system_logs)
    _fill_metadata(entry.ensure_metadata(), records, job, final=final)


def _fill_metadata(
    metadata: dict[str, str], records: JobRecords, job: JobInfo | None, *, final: bool
) -> None:
    metadata["slurm_job_id"] = records.job_id
    if records.memory_peak_bytes is not None:
        metadata["memory_peak_bytes"] = str(records.memory_peak_bytes)
    if records.cpu_usage_usec is not None:
        metadata["cpu_time_seconds"] = f"{records.cpu_usage_usec / 1e6:.3f}"
    if final and (job is None or not job.ended):
        # The job recorded its outcome before Slurm ended it: squeue's RUNNING is not a final
        # fact. sacct's final record is read on a following cycle (Follower._refresh_facts).
        metadata.pop("slurm_state", None)
        if job is not None and job.node:
            metadata["slurm_node"] = job.node
    elif job is not None:
        slurm_facts(metadata, job)


def executor_logs(records: JobRecords) -> list[dict[str, Any]]:
    items = []
    for executor in records.executors:
        # TES requires an integer exit_code on every executor log: a running one is not listed.
        if executor.exit_code is None:
            continue
        item: dict[str, Any] = {"exit_code": executor.exit_code}
        if executor.start_time:
            item["start_time"] = format_time(executor.start_time)
        if executor.end_time:
            item["end_time"] = format_time(executor.end_time)
        item["stdout"] = executor.stdout
        item["stderr"] = executor.stderr
        items.append(item)
    return items
