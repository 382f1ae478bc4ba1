"""The Slurm client: sbatch, squeue, sacct, scancel and sinfo as argument lists, and their parsers.

Knows nothing of HTTP or the store. Every command goes through :func:`run_slurm` (on
:func:`bridge.system.proc.run`), and a failed one becomes, through :func:`command_error`, a
:class:`SlurmError` carrying argv, exit code, stdout and stderr. :class:`SlurmBackend` is what
the poller needs of a Slurm client; the real one and the tests' fake (tests/fakes/slurm.py,
type-checked against it) both satisfy it. A command's error output is read here only, once: the
error's subclass tells the caller what to do, :class:`SlurmUnavailable` (try again later, with
back-off; its :class:`Outage` says whether the command may have been done all the same) or
:class:`SlurmRejected` (sbatch refused this job for good; its :class:`Refusal` says for what),
and its ``reason`` is Slurm's own words.

Slurm quirks this module handles (seen on Slurm 22.05; real output in tests/data/slurm/):

- ``squeue --jobs=N`` for a single unknown id exits 1 with "Invalid job id specified"; with two or
  more ids the unknown ones are just absent. Both mean "not in the controller's memory".
- squeue shows ended jobs only with ``--states=all``, and only for ``MinJobAge`` seconds (300 by
  default); after that only sacct knows them. A job missing from squeue is not finished: ask sacct.
- ``sacct --jobs`` looks back to the epoch, but ``sacct --name`` only to midnight today unless
  ``--starttime`` is given.
- sacct prints one line per job and one per step (``N.batch``, ``N.extern``, ``N.0``). MaxRSS is
  on the steps only; a cancelled or timed-out job has ExitCode ``0:0`` on the job line and the
  signal (``0:15``) on its batch step. That signal comes a moment after the job line says
  CANCELLED: until slurmd reports the step's end (after the script's own TERM trap, up to
  KillWait), the batch step's line says ``CANCELLED`` ``0:0`` with no MaxRSS, while squeue says
  COMPLETING.
- States come as "CANCELLED by 0" (sacct: the uid that asked, for every scancel, of a job or a
  whole array); a job Slurm cancels itself has plain "CANCELLED" in sacct: when a slurmctld
  restarted from an older state gives out a running job's id again, the node reports the
  duplicate and Slurm kills the new job, every element of an array that has the id. squeue
  says "CANCELLED" either way; squeue prints "(null)" for no comment; times are "Unknown",
  "None", "N/A" or "NONE" when not set. A job cancelled while pending gets a start time equal to
  its end time in squeue.
- scancel of an unknown or already finished job exits 0 and prints nothing.
- Right after a job starts or ends, slurmdbd may hold only a placeholder for it (JobName
  "allocation", no partition, no comment, ExitCode 0:0 whatever the outcome), written from its
  step records before the job's own. :func:`parse_sacct` leaves such records out, as if sacct did
  not know the job yet; the next poll gets the real one.
- sbatch refusing a job for its size (exit 1, "Requested node configuration is not available")
  still uses a job id: sacct and squeue show a FAILED (1:0) job of that name that never ran.
- ``sinfo -o '%P|%d|%m'`` prints one line per partition and distinct TmpDisk and memory (MB) of
  its nodes, the default partition with a ``*``; a node that declares no TmpDisk shows 0. sbatch
  refuses ``--tmp`` more than every node declares: "Temporary disk specification can not be
  satisfied", and ``--mem`` more than the largest node's memory: "Memory specification can not
  be satisfied".
- An array (``sbatch --array=0-N``) gets one id; its elements are ``ID_I``. squeue without
  ``-r`` prints the pending ones as one range line (``123_[4-9]``); with ``-r`` (always used
  here) one line each. ``squeue --jobs=123_4`` and ``sacct --jobs=123_4`` name one element;
  sacct says nothing of an element that has not started, and ``sacct --name`` prints them as
  one range line (``123_[4-9]``, expanded by :func:`parse_sacct`). ``scancel 123_4`` cancels
  one element. The array may have at most ``MaxArraySize - 1`` as its highest index
  (``scontrol show config``).
- With slurmctld down, sbatch, squeue and scancel each retry for about 9 s before failing with
  "Unable to contact slurm controller"; sacct still answers (it asks slurmdbd).
- A job whose memory use passes ``--mem`` under ``JobAcctGatherParams=OverMemoryKill`` ends FAILED
  with signal 9. With task/cgroup (``ConstrainRAMSpace=yes``) the kernel kills the biggest
  process in the job's cgroup (an executor, not the job script, which goes on) and the job ends
  OUT_OF_MEMORY whatever the script's exit code; the script records the OOM kill itself.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Protocol, TypedDict

from bridge.system.budget import CallBudget
from bridge.system.metrics import observe_slurm_command
from bridge.system.proc import CommandError, CommandNotFound, CommandTimeout, as_user, run

log = logging.getLogger(__name__)

# --- state table -----------------------------------------------------------------------------

#: Slurm job state (the base word, as squeue %T and sacct State print it) -> TES state, as
#: Slurm alone sees it. The poller (bridge.poller.decide) refines it with the job's own
#: records: a recorded outcome always wins, and an ended job whose script recorded none was
#: cut short (see decide for how each case ends). Every ended job maps to a final TES state
#: (core.tes.TERMINAL_STATES); TES clients (Nextflow, Cromwell) wait forever on any other.
SLURM_TO_TES: dict[str, str] = {
    "PENDING": "QUEUED",
    # Nodes are being booted or configured for the job.
    "CONFIGURING": "INITIALIZING",
    "POWER_UP_NODE": "INITIALIZING",
    "RUNNING": "RUNNING",
    # Still running: the job's processes are ending and epilogs run; the outcome is not known yet.
    "COMPLETING": "RUNNING",
    # Burst-buffer stage-out after the script ended: not done yet.
    "STAGE_OUT": "RUNNING",
    # Being sent a signal (e.g. by scancel --signal); it has not ended.
    "SIGNALING": "RUNNING",
    "RESIZING": "RUNNING",
    "SUSPENDED": "PAUSED",
    # Stopped with SIGSTOP, keeping its resources: paused, not ended.
    "STOPPED": "PAUSED",
    # The script exited 0. The job's own records still decide between COMPLETE and an error.
    "COMPLETED": "COMPLETE",
    # The batch script exited non-zero. The bridge's job script exits 0 after an executor
    # failure and non-zero after a staging one; its records tell which.
    "FAILED": "EXECUTOR_ERROR",
    "CANCELLED": "CANCELED",
    # The time limit ended the executors: running it again the same way would end the same way.
    "TIMEOUT": "EXECUTOR_ERROR",
    # The task used more memory than it asked for.
    "OUT_OF_MEMORY": "EXECUTOR_ERROR",
    # Lost through no fault of the task (see RETRYABLE_STATES); final only once retries run out.
    "NODE_FAIL": "SYSTEM_ERROR",
    "BOOT_FAIL": "SYSTEM_ERROR",
    # Preempted by a job of higher priority (with --no-requeue; a job that may be requeued goes
    # back to PENDING instead). The poller submits it again or, where slurm.on_preemption says
    # so, ends the task PREEMPTED: Nextflow and Cromwell take PREEMPTED as still running.
    "PREEMPTED": "PREEMPTED",
    "LAUNCH_FAILED": "SYSTEM_ERROR",
    "RECONFIG_FAIL": "SYSTEM_ERROR",
    # Ended by its --deadline; the bridge never sets one, so a site policy did.
    "DEADLINE": "SYSTEM_ERROR",
    # Federation: another cluster took the job. The bridge does not use federation.
    "REVOKED": "SYSTEM_ERROR",
    # Requeued (after a node failure, preemption or by an admin): it will run again.
    "REQUEUED": "QUEUED",
    "REQUEUE_FED": "QUEUED",
    # Held in the queue until someone releases it; still queued, not ended.
    "REQUEUE_HOLD": "QUEUED",
    "SPECIAL_EXIT": "QUEUED",
    "RESV_DEL_HOLD": "QUEUED",
    # Pending while the controller records the job in the database.
    "UPDATE_DB": "QUEUED",
}

#: Compact state codes (squeue %t, ``squeue -t``), for input that uses them.
_COMPACT: dict[str, str] = {
    "PD": "PENDING", "CF": "CONFIGURING", "R": "RUNNING", "CG": "COMPLETING", "CD": "COMPLETED",
    "F": "FAILED", "CA": "CANCELLED", "TO": "TIMEOUT", "NF": "NODE_FAIL", "PR": "PREEMPTED",
    "BF": "BOOT_FAIL", "DL": "DEADLINE", "OOM": "OUT_OF_MEMORY", "RQ": "REQUEUED",
    "RH": "REQUEUE_HOLD", "RF": "REQUEUE_FED", "RD": "RESV_DEL_HOLD", "RS": "RESIZING",
    "RV": "REVOKED", "SE": "SPECIAL_EXIT", "SI": "SIGNALING", "SO": "STAGE_OUT", "ST": "STOPPED",
    "S": "SUSPENDED",
}  # fmt: skip

#: Jobs lost through no fault of the task: submitting again is worth it (PREEMPTED: unless
#: slurm.on_preemption ends the task PREEMPTED).
RETRYABLE_STATES: frozenset[str] = frozenset({"NODE_FAIL", "PREEMPTED", "BOOT_FAIL"})

#: States after which the job will not run again by itself.
ENDED_STATES: frozenset[str] = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
     "PREEMPTED", "DEADLINE", "REVOKED", "LAUNCH_FAILED", "RECONFIG_FAIL"}
)  # fmt: skip

#: Pending reasons that never clear by themselves: the job, as submitted, cannot start (sites
#: without ``EnforcePartLimits=ALL`` accept such jobs instead of refusing them).
HOPELESS_PENDING_REASONS: frozenset[str] = frozenset(
    {"BadConstraints", "PartitionConfig", "InvalidAccount", "InvalidQOS",
     "DependencyNeverSatisfied"}
)  # fmt: skip

_warned_states: set[str] = set()


def base_state(slurm_state: str) -> str:
    """The state word: "CANCELLED by 0" and "CANCELLED+" -> "CANCELLED"; "PD" -> "PENDING"."""
    words = slurm_state.split()
    word = words[0].rstrip("+").upper() if words else ""
    return _COMPACT.get(word, word)


def tes_state_for(slurm_state: str) -> str:
    """The TES state for a Slurm state; "UNKNOWN" (with a warning, once per state) if unknown."""
    state = base_state(slurm_state)
    tes = SLURM_TO_TES.get(state)
    if tes is None:
        if state not in _warned_states:
            _warned_states.add(state)
            log.warning("unknown Slurm job state %r; reporting the task as UNKNOWN", slurm_state)
        return "UNKNOWN"
    return tes


# --- errors ----------------------------------------------------------------------------------


class Refusal(StrEnum):
    """What of a job sbatch refused for good (:attr:`SlurmRejected.refusal`)."""

    #: `--tmp` above the TmpDisk every node declares (tests/data/slurm/sbatch-too-much-tmp.txt).
    TMP_DISK = "tmp_disk"
    #: `--mem` above what any node has.
    MEMORY = "memory"
    #: More CPUs than a node, or the partition, allows.
    CPUS = "cpus"
    #: `--time` unreadable, or above the partition's or the association's limit.
    TIME_LIMIT = "time_limit"
    PARTITION = "partition"
    ACCOUNT = "account"
    QOS = "qos"
    #: Another resource no node has (GRES, features, node count).
    NODE_CONFIGURATION = "node_configuration"
    #: Anything else (an unreadable script, an option sbatch does not know).
    OTHER = "other"


class Outage(StrEnum):
    """Why Slurm could not do a command now (:attr:`SlurmUnavailable.outage`)."""

    #: slurmctld (slurmdbd for sacct) could not be contacted at all (down, the connection
    #: refused, munge failing on this host): the command did nothing.
    UNREACHABLE = "unreachable"
    #: Refused for one of Slurm's limits (a QOS or association submit limit, MaxJobCount): the
    #: command did nothing unless it was killed while it waited the limit out, and the refusal
    #: clears when earlier jobs end.
    LIMIT = "limit"
    #: No clear answer (a time-out, a lost connection, a controller in standby): the command may
    #: have been done all the same.
    UNCERTAIN = "uncertain"


class SlurmError(CommandError):
    """A Slurm command failed. Carries the command, its exit code and what it printed."""

    @property
    def reason(self) -> str:
        """What Slurm said: its last error lines, without the tool's prefix or retry notices."""
        return _slurm_words(self.stderr or self.stdout)

    @property
    def may_have_acted(self) -> bool:
        """Whether the command may have been done all the same (sbatch: a job may exist). Only
        a refusal, or an outage that says so, rules it out."""
        return True


class SlurmUnavailable(SlurmError):
    """The controller or the accounting daemon did not answer: try again later, with back-off."""

    def __init__(
        self,
        message: str,
        *,
        outage: Outage,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message, argv=argv, returncode=returncode, stdout=stdout, stderr=stderr)
        self.outage = outage

    @property
    def may_have_acted(self) -> bool:
        # A command killed at its time-out (no exit code) while it waited out a limit may have
        # got through at last.
        return self.outage is Outage.UNCERTAIN or (
            self.outage is Outage.LIMIT and self.returncode is None
        )


class SlurmRejected(SlurmError):
    """sbatch refused this job for good (resources no node has, unknown partition, ...)."""

    def __init__(
        self,
        message: str,
        *,
        refusal: Refusal,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message, argv=argv, returncode=returncode, stdout=stdout, stderr=stderr)
        self.refusal = refusal

    @property
    def may_have_acted(self) -> bool:
        return False


def _any_of(*texts: str) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(text) for text in texts), re.IGNORECASE)


#: stderr text that means "Slurm is not reachable right now", not "your request is wrong", by
#: what it means for the command.
_OUTAGES: tuple[tuple[Outage, re.Pattern[str]], ...] = (
    # sbatch refused for a limit. A submit limit of the user's QOS or association (MaxSubmitJobs:
    # "sbatch: error: QOSMaxSubmitJobPerUserLimit" then "Batch job submission failed: Job
    # violates accounting/QOS policy (job submit limit, ...)"), or slurmctld's MaxJobCount
    # ("Slurm temporarily unable to accept job, sleeping and retrying", then "Resource
    # temporarily unavailable" once sbatch gives up).
    (
        Outage.LIMIT,
        _any_of(
            "Job violates accounting/QOS policy",
            "temporarily unable to accept job",
            "Resource temporarily unavailable",
        ),
    ),
    # The request may have reached slurmctld and been done: slurmctld went away after the
    # connection was made (killed, or restarted, in the middle of the RPC).
    (
        Outage.UNCERTAIN,
        _any_of(
            "Unable to contact slurm controller (send failure)",
            "Unable to contact slurm controller (receive failure)",
            "Unexpected missing socket error",
            "Connection reset by peer",
            "Broken pipe",
            "Communication send failure",
            "Communication receive failure",
            "Communication shutdown failure",
        ),
    ),
    # The request never reached slurmctld.
    (
        Outage.UNREACHABLE,
        _any_of(
            "Unable to contact slurm controller",
            "Connection refused",
            # munged down or overloaded on this host.
            "Munge encode failed",
        ),
    ),
    (
        Outage.UNCERTAIN,
        _any_of(
            "Socket timed out on send/recv",
            "Slurm backup controller in standby mode",
            "Connection timed out",
            "Problem talking to the database",
            "Zero Bytes were transmitted or received",
            "Transport endpoint is not connected",
            "Communication connection failure",
            "Requested operation is presently disabled",
            "Protocol authentication error",
        ),
    ),
)

#: sbatch's words for each refusal (its own checks and slurmctld's errors), the first that
#: matches wins: "Temporary disk specification can not be satisfied" comes with "Requested node
#: configuration is not available".
_REFUSALS: tuple[tuple[Refusal, re.Pattern[str]], ...] = (
    (Refusal.TMP_DISK, _any_of("Temporary disk specification can not be satisfied")),
    (Refusal.MEMORY, _any_of("Memory specification can not be satisfied")),
    (Refusal.CPUS, _any_of("More processors requested than permitted")),
    (Refusal.TIME_LIMIT, _any_of("Requested time limit is invalid", "Invalid --time")),
    (Refusal.PARTITION, _any_of("Invalid partition name specified", "invalid partition")),
    (Refusal.ACCOUNT, _any_of("Invalid account")),
    (Refusal.QOS, _any_of("Invalid qos specification")),
    (
        Refusal.NODE_CONFIGURATION,
        _any_of(
            "Requested node configuration is not available",
            "Invalid generic resource (gres) specification",
            "Invalid feature specification",
            "Node count specification invalid",
        ),
    ),
)
_INVALID_JOB_ID = "Invalid job id specified"
#: What Slurm's tools put before their error lines ("sbatch: error: ").
_TOOL_PREFIX = re.compile(r"^[a-z]+: error: ")


def _outage_in(stderr: str) -> Outage | None:
    """The outage a Slurm tool's error lines tell of; None when they tell of none."""
    for outage, pattern in _OUTAGES:
        if pattern.search(stderr):
            return outage
    return None


def _refusal_in(stderr: str) -> Refusal:
    """What of a job sbatch's error lines say it refused."""
    for refusal, pattern in _REFUSALS:
        if pattern.search(stderr):
            return refusal
    return Refusal.OTHER


def _slurm_words(text: str) -> str:
    """A tool's last three error lines, without its prefix and its retry notices, once each."""
    lines = [_TOOL_PREFIX.sub("", line.strip()) for line in text.splitlines()]
    kept = [line for line in lines if line and "sleeping and retrying" not in line]
    return "; ".join(list(dict.fromkeys(kept))[-3:]) or "no error message"


# --- job information -------------------------------------------------------------------------


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    name: str
    #: The Slurm base state word ("CANCELLED" for "CANCELLED by 0").
    state: str
    #: squeue/sacct reason ("Resources", "Priority", "JobHeldUser", ...); None for "None".
    reason: str | None
    #: From ExitCode "3:0"; None while the job has not ended.
    exit_code: int | None
    signal: int | None
    node: str | None
    partition: str | None
    #: Timezone-aware UTC; None when the job never started / has not ended.
    start_time: datetime | None
    end_time: datetime | None
    elapsed_seconds: int | None
    #: Largest MaxRSS of the job's steps (sacct only).
    max_rss_bytes: int | None
    comment: str | None
    #: Who cancelled a CANCELLED job, from sacct ("CANCELLED by 1000": "1000"); "" when sacct
    #: names no one: Slurm ended the job itself (e.g. slurmd found its id a duplicate). None when
    #: not known: squeue does not say, and another state has no canceller.
    canceled_by: str | None = None

    @property
    def tes_state(self) -> str:
        return tes_state_for(self.state)

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


#: squeue -o fields, "|"-separated; the comment is last so that it may contain "|".
SQUEUE_FORMAT = "%i|%j|%T|%r|%N|%P|%S|%e|%M|%k"
#: sacct --format fields (with -P: "|"-separated); Comment last for the same reason.
SACCT_FIELDS = (
    "JobID,JobName,State,ExitCode,Reason,NodeList,Partition,Start,End,ElapsedRaw,MaxRSS,Comment"
)
_SQUEUE_NFIELDS = SQUEUE_FORMAT.count("|") + 1
_SACCT_NFIELDS = SACCT_FIELDS.count(",") + 1

_UNSET = {"", "none", "unknown", "n/a", "(null)", "none assigned", "invalid"}
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}


def _opt(value: str) -> str | None:
    value = value.strip()
    return None if value.lower() in _UNSET else value


def parse_time(value: str) -> datetime | None:
    """A Slurm timestamp, printed in UTC because the client runs Slurm commands with TZ=UTC."""
    value = value.strip()
    if value.lower() in _UNSET:
        return None
    try:
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    except ValueError:
        log.warning("unparsable Slurm time %r", value)
        return None


def parse_exit_code(value: str) -> tuple[int | None, int | None]:
    """sacct ExitCode "3:0" -> (3, 0): the script's exit code and the signal that ended it."""
    code, _, sig = value.strip().partition(":")
    try:
        return int(code), int(sig or 0)
    except ValueError:
        return None, None


def parse_duration(value: str) -> int | None:
    """squeue %M ("5:03", "1:02:03", "2-01:02:03") -> seconds."""
    value = value.strip()
    if value.lower() in _UNSET:
        return None
    days, _, clock = value.rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        seconds = 0
        for part in parts:
            seconds = seconds * 60 + part
        return seconds + int(days or 0) * 86400
    except ValueError:
        return None


def parse_size(value: str) -> int | None:
    """sacct MaxRSS ("624004K", "1.50G", "0") -> bytes."""
    value = value.strip().upper()
    if not value:
        return None
    match = re.fullmatch(r"([0-9.]+)([KMGTP]?)", value)
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_squeue(text: str) -> dict[str, JobInfo]:
    """Parse ``squeue -h -o SQUEUE_FORMAT`` output."""
    jobs: dict[str, JobInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|", _SQUEUE_NFIELDS - 1)
        if len(fields) != _SQUEUE_NFIELDS:
            log.warning("skipping squeue line with %d fields: %r", len(fields), line)
            continue
        job_id, name, state_text, reason, node, part, start, end, used, comment = fields
        state = base_state(state_text)
        ended = state in ENDED_STATES
        node_name = _opt(node)
        # squeue's start is an estimate while pending, and is set to the end time for a job that
        # was cancelled before it ran (no node); its end is the time limit while running.
        started = state not in ("PENDING", "CONFIGURING") and node_name is not None
        jobs[job_id] = JobInfo(
            job_id=job_id,
            name=name,
            state=state,
            reason=_opt(reason),
            exit_code=None,
            signal=None,
            node=node_name,
            partition=_opt(part),
            start_time=parse_time(start) if started else None,
            end_time=parse_time(end) if ended else None,
            elapsed_seconds=parse_duration(used),
            max_rss_bytes=None,
            comment=_opt(comment),
        )
    return jobs


def parse_sacct(text: str) -> dict[str, JobInfo]:
    """Parse ``sacct -P -n --format=SACCT_FIELDS`` output, merging steps into their job."""
    jobs: dict[str, JobInfo] = {}
    steps: dict[str, list[list[str]]] = {}
    for fields in _sacct_records(text):
        job_id, _, step = fields[0].partition(".")
        if step:
            steps.setdefault(job_id, []).append(fields)
        elif (info := _sacct_job(job_id, fields)) is not None:
            for element in expand_array_range(job_id):
                jobs[element] = replace(info, job_id=element)
    return {job_id: _with_steps(info, steps.get(job_id, [])) for job_id, info in jobs.items()}


def _sacct_records(text: str) -> Iterator[list[str]]:
    """The fields of each sacct line, job and step lines alike; malformed lines are skipped."""
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|", _SACCT_NFIELDS - 1)
        if len(fields) != _SACCT_NFIELDS:
            log.warning("skipping sacct line with %d fields: %r", len(fields), line)
            continue
        yield fields


def _sacct_job(job_id: str, fields: list[str]) -> JobInfo | None:
    """A job line; None for slurmdbd's placeholder until the job's own record arrives (see the
    module doc)."""
    _, name, state_text, exit_text, reason, node, part, start, end, elapsed, rss, comment = fields
    if not part.strip():
        log.debug("sacct has only a placeholder for job %s so far", job_id)
        return None
    state = base_state(state_text)
    node_name = _opt(node)
    ended = state in ENDED_STATES
    # "CANCELLED by 1000" -> "1000"; plain "CANCELLED" -> "" (no one asked).
    canceled_by = state_text.partition(" by ")[2].strip() if state == "CANCELLED" else None
    exit_code, signal = parse_exit_code(exit_text) if ended else (None, None)
    return JobInfo(
        job_id=job_id,
        name=name,
        state=state,
        reason=_opt(reason),
        exit_code=exit_code,
        signal=signal,
        node=node_name,
        partition=_opt(part),
        # A job cancelled before it ran has Start "None" or its end time: it never started.
        start_time=parse_time(start) if node_name is not None else None,
        end_time=parse_time(end) if ended else None,
        elapsed_seconds=int(elapsed) if elapsed.strip().isdigit() else None,
        max_rss_bytes=parse_size(rss),
        comment=_opt(comment),
        canceled_by=canceled_by,
    )


_ARRAY_RANGE = re.compile(r"([0-9]+)_\[([0-9,\-]+)(?:%[0-9]+)?\]")
#: A range line of more elements than this is kept as it is (MaxArraySize is at most 4000001).
_MAX_RANGE = 4_000_001


def expand_array_range(job_id: str) -> list[str]:
    """`123_[4-6,9]` (or `123_[4-6%2]`) -> the element ids `123_4 ... 123_9`; any other id
    unchanged."""
    match = _ARRAY_RANGE.fullmatch(job_id)
    if match is None:
        return [job_id]
    elements: list[str] = []
    for part in match.group(2).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return [job_id]
        last = int(high or low)
        if last - int(low) > _MAX_RANGE:
            return [job_id]
        elements += [f"{match.group(1)}_{i}" for i in range(int(low), last + 1)]
    return elements


def parse_max_array_size(text: str) -> int:
    """`scontrol show config`'s `MaxArraySize = 1001`; ValueError when it is missing."""
    match = re.search(r"^MaxArraySize\s*=\s*([0-9]+)\s*$", text, re.MULTILINE)
    if match is None:
        raise ValueError("scontrol show config printed no MaxArraySize")
    return int(match.group(1))


_SACCT_MAX_RSS = SACCT_FIELDS.split(",").index("MaxRSS")
_SACCT_EXIT_CODE = SACCT_FIELDS.split(",").index("ExitCode")


def _with_steps(job: JobInfo, steps: list[list[str]]) -> JobInfo:
    """The job with what only its steps' lines hold: the largest MaxRSS and, for an ended job
    whose line says 0:0, the signal on its batch step."""
    sizes = [size for size in (parse_size(s[_SACCT_MAX_RSS]) for s in steps) if size is not None]
    if job.max_rss_bytes is not None:
        sizes.append(job.max_rss_bytes)
    signal = job.signal
    if job.ended and job.exit_code == 0 and job.signal == 0:
        # Cancel and time-out leave 0:0 on the job line; the batch step has the signal.
        for step in steps:
            if step[0].endswith(".batch"):
                signal = parse_exit_code(step[_SACCT_EXIT_CODE])[1] or 0
    return replace(job, max_rss_bytes=max(sizes, default=None), signal=signal)


# --- the client --------------------------------------------------------------------------------


# Arguments longer than this are refused by Linux (MAX_ARG_STRLEN is 128 KiB): split id lists.
@dataclass(frozen=True)
class NodeSizes:
    """What the nodes of each partition can give one job, in MB (Slurm's MB are MiB): the
    smallest and the largest node-local disk (`TmpDisk`, for `--tmp`) and the largest memory
    (`RealMemory`, for `--mem`)."""

    tmp_disk_smallest: dict[str, int]
    tmp_disk_largest: dict[str, int]
    default_partition: str | None = None
    memory_largest: dict[str, int] = field(default_factory=dict)

    def _names(self, partitions: Sequence[str]) -> list[str]:
        """`partitions`, or the default partition when none is named."""
        return list(partitions) or ([self.default_partition] if self.default_partition else [])

    def smallest_tmp_disk(self, partitions: Sequence[str]) -> int | None:
        """The smallest TmpDisk of these partitions' nodes (of the default partition when none
        is named); None when sinfo did not list one of them."""
        names = self._names(partitions)
        if not names or any(name not in self.tmp_disk_smallest for name in names):
            return None
        return min(self.tmp_disk_smallest[name] for name in names)

    def largest_memory(self, partitions: Sequence[str]) -> int | None:
        """The memory of the largest node of these partitions (of the default partition when
        none is named): the most `--mem` sbatch accepts for a job that may run in any of them;
        None when sinfo did not say it for one of them."""
        names = self._names(partitions)
        if not names or any(name not in self.memory_largest for name in names):
            return None
        return max(self.memory_largest[name] for name in names)

    def describe_tmp_disk(self) -> str:
        """`main 0 MB, big 1000-102400 MB` for messages."""
        parts = []
        for name, low in self.tmp_disk_smallest.items():
            high = self.tmp_disk_largest[name]
            parts.append(f"{name} {low if low == high else f'{low}-{high}'} MB")
        return ", ".join(parts) or "no partition"


SINFO_NODE_SIZES_FORMAT = "%P|%d|%m"


def parse_sinfo_node_sizes(text: str) -> NodeSizes:
    """`sinfo -h -a -o '%P|%d|%m'`: one line per partition and distinct TmpDisk and memory of
    its nodes. A line without a memory field (or an unreadable one) leaves the memory unknown."""
    tmp_low: dict[str, int] = {}
    tmp_high: dict[str, int] = {}
    memory: dict[str, int] = {}
    unknown_memory: set[str] = set()
    default = None
    for line in text.splitlines():
        name, *sizes = line.strip().split("|")
        if not sizes or not sizes[0].strip().isdigit():
            continue
        if name.endswith("*"):
            name = name[:-1]
            default = name
        if not name:
            continue
        mb = int(sizes[0])
        tmp_low[name] = min(mb, tmp_low.get(name, mb))
        tmp_high[name] = max(mb, tmp_high.get(name, mb))
        if len(sizes) > 1 and sizes[1].strip().isdigit():
            memory[name] = max(int(sizes[1]), memory.get(name, 0))
        else:
            unknown_memory.add(name)
    for name in unknown_memory:  # one node group of unknown memory: the largest is unknown
        memory.pop(name, None)
    return NodeSizes(tmp_low, tmp_high, default_partition=default, memory_largest=memory)


#: `sinfo -N` fields, one line per node and partition: partition (`*` on the default), node,
#: CPUs, memory (MB), the partition's time limit, GRES, TmpDisk (MB), availability, node state.
SINFO_PARTITIONS_FORMAT = "%P|%N|%c|%m|%l|%G|%d|%a|%T"
_SINFO_PARTITIONS_NFIELDS = SINFO_PARTITIONS_FORMAT.count("|") + 1


@dataclass(frozen=True)
class Partition:
    """What a partition offers, summed over its nodes (the capabilities document)."""

    name: str
    default: bool
    available: bool
    nodes: tuple[str, ...]
    cpus: int
    max_cpus_per_node: int
    max_memory_mb_per_node: int
    #: Slurm's spelling: `infinite`, `1-00:00:00`.
    max_time: str
    #: GRES name (and type) -> count over the partition's nodes: {"gpu": 4, "gpu:a100": 4}.
    gres: dict[str, int]
    min_tmp_disk_mb: int

    @property
    def gpus(self) -> int:
        return self.gres.get("gpu", 0)

    @property
    def gpu_types(self) -> dict[str, int]:
        return {k.split(":", 1)[1]: n for k, n in self.gres.items() if k.startswith("gpu:")}


def _gres_counts(text: str) -> dict[str, int]:
    """`gpu:a100:2(S:0-1),shard:8` -> {"gpu": 2, "gpu:a100": 2, "shard": 8}."""
    counts: dict[str, int] = {}
    if _opt(text) is None:
        return counts
    for item in re.sub(r"\([^)]*\)", "", text).split(","):
        parts = item.strip().split(":")
        if not parts[0]:
            continue
        count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        names = [parts[0]] + ([f"{parts[0]}:{parts[1]}"] if len(parts) == 3 else [])
        for name in names:
            counts[name] = counts.get(name, 0) + count
    return counts


def parse_sinfo_partitions(text: str) -> list[Partition]:
    """`sinfo -h -a -N -o SINFO_PARTITIONS_FORMAT`, in the order sinfo lists partitions."""
    rows: dict[str, list[list[str]]] = {}
    default: str | None = None
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != _SINFO_PARTITIONS_NFIELDS or not fields[0]:
            continue
        name = fields[0]
        if name.endswith("*"):
            name = default = name[:-1]
        rows.setdefault(name, []).append(fields)
    partitions = []
    for name, lines in rows.items():
        by_node = {f[1]: f for f in lines}  # a node listed twice (two states) counts once
        cpus = [int(f[2]) for f in by_node.values() if f[2].isdigit()]
        memory = [int(f[3]) for f in by_node.values() if f[3].isdigit()]
        tmp = [int(f[6]) for f in by_node.values() if f[6].isdigit()]
        gres: dict[str, int] = {}
        for f in by_node.values():
            for key, count in _gres_counts(f[5]).items():
                gres[key] = gres.get(key, 0) + count
        partitions.append(
            Partition(
                name=name,
                default=name == default,
                available=lines[0][7] == "up",
                nodes=tuple(sorted(by_node)),
                cpus=sum(cpus),
                max_cpus_per_node=max(cpus, default=0),
                max_memory_mb_per_node=max(memory, default=0),
                max_time=lines[0][4],
                gres=gres,
                min_tmp_disk_mb=min(tmp, default=0),
            )
        )
    return partitions


_MAX_LIST_CHARS = 100_000

#: How often slurmctld's rate limit (`scontrol show config`) is read again, and how soon after
#: a failed read.
RATE_LIMIT_REFRESH = 3600.0
RATE_LIMIT_RETRY = 60.0
#: The longest wait for `scontrol show config`.
RATE_LIMIT_TIMEOUT = 10.0

#: From this many job ids on, :meth:`SlurmClient.queue` lists the jobs of its `queue_user`
#: instead of naming the ids: slurmctld matches a ``--jobs`` list against every job it holds,
#: which took 0.55-0.61 s for 10,000 ids against 0.10 s for the same jobs listed by user
#: (1,000 ids: 0.16 s; Slurm 22.05, docs/benchmarks.md "At site scale", row 3).
QUEUE_BY_USER_FROM = 1000


def _chunks(items: Sequence[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for item in items:
        if chunk and size + len(item) + 1 > _MAX_LIST_CHARS:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += len(item) + 1
    if chunk:
        yield chunk


def _check_ids(job_ids: Iterable[str]) -> list[str]:
    ids = sorted({str(j).strip() for j in job_ids}, key=lambda j: (len(j), j))
    for job_id in ids:
        if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
            raise ValueError(f"not a Slurm job id: {job_id!r}")
    return ids


def _check_text(what: str, value: str) -> None:
    # "|" would break the parsers (the name is not the last field), newlines any line format.
    if not value or "\n" in value or "\r" in value or (what == "job name" and "|" in value):
        raise ValueError(f"{what} must be non-empty, one line, without '|': {value!r}")


class SlurmBackend(Protocol):
    """What the poller needs of Slurm (:class:`SlurmClient`; a fake in the unit tests).

    Every call may raise :class:`SlurmError`; ``as_user`` runs the command as that user
    (site mode). Every command takes its RPCs from `budget` first (waiting for them if need
    be); the poller looks at it to leave work for a later cycle instead."""

    budget: CallBudget

    def submit(
        self,
        script: Path,
        *,
        job_name: str,
        comment: str | None = None,
        extra_args: Sequence[str] = (),
        as_user: str | None = None,
        array_size: int | None = None,
        script_args: Sequence[str] = (),
    ) -> str: ...

    def max_array_size(self) -> int: ...

    def queue(self, job_ids: Collection[str]) -> dict[str, JobInfo]: ...

    def accounting(self, job_ids: Collection[str]) -> dict[str, JobInfo]: ...

    def find_by_names(self, names: Collection[str]) -> dict[str, list[JobInfo]]: ...

    def node_sizes(self) -> NodeSizes: ...

    def partitions(self) -> list[Partition]: ...

    def cancel(self, job_ids: Collection[str], *, as_user: str | None = None) -> None: ...


def run_slurm(
    argv: Sequence[str], timeout: float, budget: CallBudget | None = None
) -> subprocess.CompletedProcess[str]:
    """The one place that runs a Slurm command: in UTC, with Slurm's standard time format, killed
    after `timeout` seconds (raising :class:`SlurmUnavailable`), timed for the metrics; with a
    `budget`, it first takes the command's RPCs from it (RPC_COST), waiting if need be."""
    if budget is not None:
        tool = _tool(argv)
        budget.take(tool, RPC_COST.get(tool, 1))
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SQUEUE_", "SACCT_"))
    }  # a user's SQUEUE_USERS or SACCT_FORMAT would change what the parsers see
    env["TZ"] = "UTC"  # times are printed in the client's zone: make it UTC
    env["SLURM_TIME_FORMAT"] = "standard"
    started = time.monotonic()
    failed = True
    try:
        # Killed at its time-out and when the poller dies: an sbatch never outlives the
        # poller that started it (see the poller's recovery of interrupted submissions).
        proc = run(argv, timeout=timeout, env=env)
        failed = proc.returncode != 0
        return proc
    except CommandNotFound as exc:
        raise SlurmError(
            f"{argv[0]} not found; install the Slurm client commands on this host or set "
            f"the path in the [slurm] section of the configuration",
            argv=argv,
        ) from exc
    except CommandTimeout as exc:
        raise SlurmUnavailable(
            f"{Path(argv[0]).name} did not answer within {timeout:g} s "
            f"(slurmctld or slurmdbd overloaded or unreachable); try again later",
            # Killed while it waited out a limit, or with no answer at all.
            outage=_outage_in(exc.stderr) or Outage.UNCERTAIN,
            argv=argv,
            stdout=exc.stdout,
            stderr=exc.stderr,
        ) from exc
    finally:
        observe_slurm_command(argv, time.monotonic() - started, failed)


#: slurmctld RPCs per command where more than one (Slurm 22.05, counted with `sdiag`): squeue
#: asks for the jobs and the partitions, sinfo for the partitions and the nodes. sbatch,
#: scancel and scontrol make one; sacct asks slurmdbd, and counts one all the same.
RPC_COST = {"squeue": 2, "sinfo": 2}


def _tool(argv: Sequence[str]) -> str:
    """The Slurm tool's name (through sudo, site mode: the word after `--`)."""
    words = [str(a) for a in argv]
    return Path(words[words.index("--") + 1] if "--" in words[:5] else words[0]).name


class _Command(TypedDict):
    """What a failed command's error carries of it."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def command_error(
    proc: subprocess.CompletedProcess[str], what: str, *, sbatch: str = "sbatch"
) -> SlurmError:
    """The error for a Slurm command that exited non-zero, read once for every caller: its
    subclass and kind (:class:`Outage`, :class:`Refusal`) tell what to do, its message what went
    wrong (`what`: the operation) and where to look."""
    argv = [str(a) for a in proc.args]
    detail = _slurm_words(proc.stderr or proc.stdout)
    # Through sudo (site mode) the Slurm tool is the word after `--`.
    tool = Path(argv[argv.index("--") + 1] if "--" in argv[:5] else argv[0]).name
    command = _Command(
        argv=argv, returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr
    )
    outage = _outage_in(proc.stderr)
    if outage is not None:
        daemon = "slurmdbd" if tool == "sacct" else "slurmctld"
        return SlurmUnavailable(
            f"{what}: Slurm is not reachable ({detail}); try again later, and if this lasts "
            f"check `scontrol ping` / `sacctmgr show cluster` and {daemon}'s log",
            outage=outage,
            **command,
        )
    if tool == Path(sbatch).name:
        return SlurmRejected(
            f"{what}: sbatch refused the job ({detail}); compare its resources and partition "
            f"with `sinfo -o '%P %c %m %l'`",
            refusal=_refusal_in(proc.stderr),
            **command,
        )
    if "accounting storage is disabled" in proc.stderr:
        return SlurmError(
            f"{what}: {detail}; sacct needs slurmdbd (AccountingStorageType="
            f"accounting_storage/slurmdbd in slurm.conf)",
            **command,
        )
    return SlurmError(f"{what}: {tool} exited {proc.returncode} ({detail})", **command)


class SlurmClient:
    """Runs Slurm's command-line tools; one call per operation for any number of jobs."""

    def __init__(
        self,
        *,
        sbatch: str = "sbatch",
        squeue: str = "squeue",
        sacct: str = "sacct",
        scancel: str = "scancel",
        sinfo: str = "sinfo",
        scontrol: str = "scontrol",
        timeout: float = 30.0,
        history: timedelta = timedelta(days=30),
        sudo: str = "sudo",
        queue_user: str | None = None,
        budget: CallBudget | None = None,
    ) -> None:
        self.sudo = sudo
        #: Every command takes a token from it first (slurm.calls_per_second).
        self.budget = budget or CallBudget.unlimited()
        self.scontrol = scontrol
        #: What this cluster's squeue can do, read once (:meth:`features`).
        self._features: SlurmFeatures | None = None
        #: When slurmctld's own rate limit is read again (:meth:`_run`).
        self._rate_limit_due = 0.0
        #: The last answer of :meth:`_queue_changed`.
        self._seen: dict[str, JobInfo] = {}
        #: The user every job asked about belongs to (the service account, outside site mode):
        #: many ids are then looked up by listing this user's jobs (QUEUE_BY_USER_FROM).
        self.queue_user = queue_user
        self.sbatch = sbatch
        self.squeue = squeue
        self.sacct = sacct
        self.scancel = scancel
        self.sinfo = sinfo
        self.scontrol = scontrol
        self.timeout = timeout
        #: How far back find_by_names asks sacct.
        self.history = history

    def _run(
        self, argv: list[str], timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """run_slurm with the budget, lowered first (at the first command, then every
        RATE_LIMIT_REFRESH s) to slurmctld's own rate limit where it has one."""
        if self.budget.rate and time.monotonic() >= self._rate_limit_due:
            self._apply_rate_limit()
        return run_slurm(argv, timeout or self.timeout, self.budget)

    def _apply_rate_limit(self) -> None:
        try:
            limit = self.rate_limit()
        except SlurmError as exc:
            log.warning("cannot read slurmctld's rate limit; trying again soon: %s", exc)
            self._rate_limit_due = time.monotonic() + RATE_LIMIT_RETRY
            return
        self._rate_limit_due = time.monotonic() + RATE_LIMIT_REFRESH
        before = self.budget.describe()
        if limit is None:
            self.budget.limit_to(None, None)
        else:
            self.budget.limit_to(limit.per_second, limit.safe_burst)
        if self.budget.describe() != before or limit is not None:
            log.info(
                "Slurm call budget: %s (slurmctld's rate limit: %s)",
                self.budget.describe(),
                limit or "none",
            )

    def _as(self, user: str | None, argv: list[str]) -> list[str]:
        """Site mode: run as `user` through the sudo rule of deploy/sudoers.tes-bridge."""
        if user is None:
            return argv
        _check_text("user", user)
        return as_user(self.sudo, user, argv)

    def submit(
        self,
        script: Path,
        *,
        job_name: str,
        comment: str | None = None,
        extra_args: Sequence[str] = (),
        as_user: str | None = None,
        array_size: int | None = None,
        script_args: Sequence[str] = (),
    ) -> str:
        """Submit a batch script; returns the job id. `array_size`: an array of that many
        elements (``--array=0-N``), whose element I is the job ``ID_I``; `script_args`: the
        script's own arguments (after it on sbatch's command line).

        On :class:`SlurmUnavailable` after a time-out the job may have been queued all the same:
        look for it with :meth:`find_by_names` before submitting again.
        """
        _check_text("job name", job_name)
        argv = [self.sbatch, "--parsable", f"--job-name={job_name}"]
        if comment is not None:
            _check_text("comment", comment)
            argv.append(f"--comment={comment}")
        if array_size is not None:
            if array_size < 1:
                raise ValueError(f"an array needs at least one element: {array_size}")
            argv.append(f"--array=0-{array_size - 1}")
        for arg in script_args:
            _check_text("script argument", arg)
        argv += [*extra_args, str(script), *script_args]
        proc = self._run(self._as(as_user, argv))
        if proc.returncode != 0:
            raise command_error(proc, f"submitting {script}", sbatch=self.sbatch)
        # --parsable prints "id" or "id;cluster".
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        job_id = lines[-1].split(";")[0] if lines else ""
        if not job_id.isdigit():
            raise SlurmError(
                f"sbatch printed no job id: {proc.stdout!r}",
                argv=argv,
                returncode=proc.returncode,
                stdout=proc.stdout,
                stderr=proc.stderr,
            )
        return job_id

    def _squeue(self, *selector: str) -> dict[str, JobInfo]:
        proc = self._run(squeue_argv(self.squeue, selector))
        if proc.returncode != 0:
            if _INVALID_JOB_ID in proc.stderr:
                return {}  # a single id the controller no longer (or never) knew
            raise command_error(proc, "reading the queue")
        return parse_squeue(proc.stdout)

    def _sacct(self, selector: Sequence[str]) -> dict[str, JobInfo]:
        argv = [self.sacct, "-P", "-n", *selector, f"--format={SACCT_FIELDS}"]
        proc = self._run(argv)
        if proc.returncode != 0:
            raise command_error(proc, "reading accounting")
        return parse_sacct(proc.stdout)

    def queue(self, job_ids: Collection[str]) -> dict[str, JobInfo]:
        """What the controller knows of these jobs (queued, running, or ended < MinJobAge ago).

        Jobs it no longer knows are absent: ask :meth:`accounting`, they are not "finished".
        Many ids are looked up by listing `queue_user`'s jobs (see QUEUE_BY_USER_FROM), or,
        where squeue has `--only-job-state` (23.11.5+), by their states first (see
        :meth:`_queue_changed`).
        """
        ids = _check_ids(job_ids)
        if len(ids) >= QUEUE_BY_USER_FROM and self.features().only_job_state:
            return self._queue_changed(ids)
        return self._queue_full(ids)

    def _queue_full(self, ids: list[str]) -> dict[str, JobInfo]:
        if self.queue_user is not None and len(ids) >= QUEUE_BY_USER_FROM:
            _check_text("user", self.queue_user)
            wanted = set(ids)
            # --all: hidden partitions too, where a site's rules may send jobs.
            listed = self._squeue("--all", f"--user={self.queue_user}")
            return {job_id: info for job_id, info in listed.items() if job_id in wanted}
        found: dict[str, JobInfo] = {}
        for chunk in _chunks(ids):
            found.update(self._squeue(f"--jobs={','.join(chunk)}"))
        return found

    def _queue_changed(self, ids: list[str]) -> dict[str, JobInfo]:
        """At site scale most followed jobs run for hours: their states come through the
        lighter RPC, and only the jobs that are not still RUNNING as last seen (new, pending
        with a reason that may change, ended) are read in full."""
        states = self._job_states(ids)
        found = {
            job_id: self._seen[job_id]
            for job_id, state in states.items()
            if state == "RUNNING" and job_id in self._seen and self._seen[job_id].state == state
        }
        changed = [job_id for job_id in states if job_id not in found]
        if changed:
            found.update(self._queue_full(changed))
        self._seen = found
        return found

    def features(self) -> SlurmFeatures:
        """What this cluster's squeue can do, from `squeue --version`, read once (one call; a
        failure reads as 22.05's and is tried again next time)."""
        if self._features is None:
            try:
                proc = self._run([self.squeue, "--version"])
            except SlurmError as exc:
                log.warning("cannot read squeue's version: %s", exc)
                return SlurmFeatures.of(None)
            version = parse_version(proc.stdout) if proc.returncode == 0 else None
            self._features = SlurmFeatures.of(version)
            log.info("Slurm %s: %s", ".".join(map(str, version or ())) or "?", self._features)
        return self._features

    def queue_states(self, job_ids: Collection[str]) -> dict[str, str]:
        """The state word of each of these jobs the controller knows. Where squeue has
        `--only-job-state` (23.11.5+) it asks with that lighter RPC, else as :meth:`queue`."""
        ids = _check_ids(job_ids)
        if not self.features().only_job_state:
            return {job_id: info.state for job_id, info in self._queue_full(ids).items()}
        return self._job_states(ids)

    def _job_states(self, ids: list[str]) -> dict[str, str]:
        states: dict[str, str] = {}
        for chunk in _chunks(ids):
            argv = squeue_argv(self.squeue, [f"--jobs={','.join(chunk)}"], states_only=True)
            proc = self._run(argv)
            if proc.returncode != 0:
                if _INVALID_JOB_ID in proc.stderr:
                    continue
                raise command_error(proc, "reading the queue's job states")
            states.update(parse_job_states(proc.stdout))
        return states

    def rate_limit(self) -> RateLimit | None:
        """slurmctld's RPC rate limit for each user (`scontrol show config`), or None when it
        has none (or cannot be read: then nothing lowers the configured budget)."""
        self._rate_limit_due = time.monotonic() + RATE_LIMIT_REFRESH  # no recursion
        self._rate_limit_due = time.monotonic() + RATE_LIMIT_REFRESH  # no recursion
        # Not worth the whole command timeout: without an answer the setting stands.
        proc = self._run([self.scontrol, "show", "config"], min(self.timeout, RATE_LIMIT_TIMEOUT))
        if proc.returncode != 0:
            raise command_error(proc, "reading slurmctld's configuration")
        return parse_rate_limit(proc.stdout)

    def accounting(self, job_ids: Collection[str]) -> dict[str, JobInfo]:
        """The accounting records of these jobs (any age: ``--jobs`` looks back to the epoch)."""
        found: dict[str, JobInfo] = {}
        for chunk in _chunks(_check_ids(job_ids)):
            found.update(self._sacct([f"--jobs={','.join(chunk)}"]))
        return found

    def find_by_names(self, names: Collection[str]) -> dict[str, list[JobInfo]]:
        """Jobs, queued or ended, named one of ``names``, oldest first.

        For recovery after a crash between sbatch and recording the job id: the job may exist.
        squeue covers jobs sacct has not recorded yet; sacct covers those squeue forgot.
        """
        wanted = sorted(set(names))
        if not wanted:
            return {}
        for name in wanted:
            _check_text("job name", name)
        since = (datetime.now(UTC) - self.history).strftime("%Y-%m-%dT%H:%M:%S")
        jobs: dict[str, JobInfo] = {}
        for chunk in _chunks(wanted):
            joined = ",".join(chunk)
            # sacct --name looks back only to midnight unless --starttime is given.
            # --allusers: as a service account (site mode) sacct --name shows only its own jobs.
            jobs.update(self._sacct([f"--name={joined}", "--allusers", f"--starttime={since}"]))
            for job_id, info in self._squeue(f"--name={joined}").items():
                # The controller's view is the fresher one, and only it has very new jobs.
                old = jobs.get(job_id)
                jobs[job_id] = info if old is None or not info.ended else _merge(old, info)
        result: dict[str, list[JobInfo]] = {}
        for info in sorted(jobs.values(), key=lambda j: (len(j.job_id), j.job_id)):
            if info.name in wanted:
                result.setdefault(info.name, []).append(info)
        return result

    def max_array_size(self) -> int:
        """The cluster's MaxArraySize: an array's indexes must stay below it."""
        proc = self._run([self.scontrol, "show", "config"])
        if proc.returncode != 0:
            raise command_error(proc, "reading the configuration")
        try:
            return parse_max_array_size(proc.stdout)
        except ValueError as exc:
            raise SlurmError(str(exc), argv=[self.scontrol, "show", "config"]) from exc

    def node_sizes(self) -> NodeSizes:
        """Each partition's node TmpDisk and memory, in one call (`-a`: hidden partitions too)."""
        proc = self._run([self.sinfo, "-h", "-a", "-o", SINFO_NODE_SIZES_FORMAT])
        if proc.returncode != 0:
            raise command_error(proc, "reading the partitions' node sizes")
        return parse_sinfo_node_sizes(proc.stdout)

    def partitions(self) -> list[Partition]:
        """Every partition's nodes, CPUs, memory, time limit and GRES, in one call."""
        proc = self._run([self.sinfo, "-h", "-a", "-N", "-o", SINFO_PARTITIONS_FORMAT])
        if proc.returncode != 0:
            raise command_error(proc, "reading the partitions")
        return parse_sinfo_partitions(proc.stdout)

    def cancel(self, job_ids: Collection[str], *, as_user: str | None = None) -> None:
        """Cancel these jobs; unknown and already ended ones are ignored by scancel."""
        for chunk in _chunks(_check_ids(job_ids)):
            proc = self._run(self._as(as_user, [self.scancel, *chunk]))
            if proc.returncode != 0:
                raise command_error(proc, f"cancelling job(s) {' '.join(chunk)}")


# --- what the cluster's Slurm allows ------------------------------------------------------------


@dataclass(frozen=True)
class RateLimit:
    """slurmctld's RPC rate limit per user (``SlurmctldParameters=rl_enable``, 23.02+): a
    bucket of `bucket_size` tokens, `refill_rate` more every `refill_period` seconds."""

    bucket_size: int = 30
    refill_rate: int = 2
    refill_period: int = 1

    @property
    def per_second(self) -> float:
        return self.refill_rate / self.refill_period

    @property
    def safe_burst(self) -> int:
        """The burst a bucket refilled evenly may take and stay inside this one: slurmctld
        adds its tokens at whole periods, so up to one refill arrives later than ours."""
        return max(1, self.bucket_size - self.refill_rate)


_RL_KEYS = {"rl_bucket_size": "bucket_size", "rl_refill_rate": "refill_rate",
            "rl_refill_period": "refill_period"}  # fmt: skip


def parse_rate_limit(text: str) -> RateLimit | None:
    """`scontrol show config`'s ``SlurmctldParameters = enable_configless,rl_enable,...``:
    the rate limit, with slurmctld's defaults for what it leaves out; None without
    ``rl_enable``. Values slurmctld would refuse (not positive) keep their defaults, as it does."""
    match = re.search(r"^SlurmctldParameters\s*=\s*(.*)$", text, re.M)
    words = [w.strip() for w in match.group(1).split(",")] if match else []
    if "rl_enable" not in (w.lower() for w in words):
        return None
    values: dict[str, int] = {}
    for word in words:
        key, _, value = word.partition("=")
        field_name = _RL_KEYS.get(key.strip().lower())
        if field_name and value.strip().isdigit() and int(value) > 0:
            values[field_name] = int(value)
    return RateLimit(**values)


def parse_version(text: str) -> tuple[int, ...] | None:
    """`squeue --version` ("slurm 22.05.8", "slurm 23.11.5-1") -> (22, 5, 8)."""
    match = re.search(r"^slurm\S*\s+(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not match:
        return None
    return tuple(int(part) for part in match.groups() if part is not None)


@dataclass(frozen=True)
class SlurmFeatures:
    """What a Slurm version's squeue can do that the client uses."""

    #: 23.02+: `--json` honours the job filters (--jobs, --user, --states).
    json_filters: bool = False
    #: 23.11.5+: `--only-job-state`, a lighter RPC that reads job states only (with --jobs,
    #: not --user or --partition).
    only_job_state: bool = False

    @classmethod
    def of(cls, version: tuple[int, ...] | None) -> SlurmFeatures:
        """Unknown versions are treated as 22.05 (the forms every version has)."""
        v = version or (0,)
        return cls(json_filters=v >= (23, 2), only_job_state=v >= (23, 11, 5))


#: `--only-job-state` output: job id and state.
JOB_STATES_FORMAT = "%i|%T"


def squeue_argv(squeue: str, selector: Sequence[str], *, states_only: bool = False) -> list[str]:
    """squeue's argv: every field the parsers read, or (`states_only`, 23.11.5+) the states
    alone through the lighter RPC. --states=all: jobs that ended < MinJobAge ago too."""
    if states_only:
        return [squeue, "-h", "-r", "--only-job-state", "--states=all", *selector,
                "-o", JOB_STATES_FORMAT]  # fmt: skip
    # -r: an array's pending elements one line each (123_4), not one range (123_[4-9]).
    return [squeue, "-h", "-r", "--states=all", *selector, "-o", SQUEUE_FORMAT]


def parse_job_states(text: str) -> dict[str, str]:
    """``squeue --only-job-state -o '%i|%T'`` -> job id: base state word."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        job_id, sep, state = line.strip().partition("|")
        if sep and job_id:
            states[job_id] = base_state(state)
    return states


def _merge(accounting: JobInfo, queue: JobInfo) -> JobInfo:
    """An ended job seen by both: squeue's state with sacct's exit code and memory."""
    return replace(
        queue,
        exit_code=accounting.exit_code,
        signal=accounting.signal,
        max_rss_bytes=accounting.max_rss_bytes,
        elapsed_seconds=accounting.elapsed_seconds,
        start_time=accounting.start_time or queue.start_time,
        end_time=accounting.end_time or queue.end_time,
    )
