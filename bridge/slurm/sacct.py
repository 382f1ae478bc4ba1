"""sacct: the accounting records of jobs, any age, read as :class:`~bridge.slurm.jobs.JobInfo`.

Slurm quirks (seen on Slurm 22.05; real output in tests/data/slurm/):

- ``sacct --jobs`` looks back to the epoch, but ``sacct --name`` only to midnight today unless
  ``--starttime`` is given. sacct asks slurmdbd: it still answers with slurmctld down.
- sacct prints one line per job and one per step (``N.batch``, ``N.extern``, ``N.0``). MaxRSS is
  on the steps only; a cancelled or timed-out job has ExitCode ``0:0`` on the job line and the
  signal (``0:15``) on its batch step. That signal comes a moment after the job line says
  CANCELLED: until slurmd reports the step's end (after the script's own TERM trap, up to
  KillWait), the batch step's line says ``CANCELLED`` ``0:0`` with no MaxRSS, while squeue says
  COMPLETING.
- ExitCode is ``code:signal``. Up to 25.05 sacct printed an exit status of 128 or more less 128
  (a script that exited 137 as ``9:0``); 25.11 prints it as it is (``137:0``, as
  ``scontrol show job`` does): :attr:`~bridge.slurm.releases.SlurmFeatures.sacct_exit_code_raw`.
- A job that ended NODE_FAIL has the ExitCode Slurm gives it, ``0:0`` up to 24.05 and ``1:0``
  from 24.11, whatever its script did: :func:`parse_sacct` gives it no exit code or signal.
- States come as "CANCELLED by 0" (the uid that asked, for every scancel, of a job or a whole
  array); a job Slurm cancels itself has plain "CANCELLED": when a slurmctld restarted from an
  older state gives out a running job's id again, the node reports the duplicate and Slurm kills
  the new job, every element of an array that has the id.
- Right after a job starts or ends, slurmdbd may hold only a placeholder for it (JobName
  "allocation", no partition, no comment, ExitCode 0:0 whatever the outcome), written from its
  step records before the job's own. :func:`parse_sacct` leaves such records out, as if sacct did
  not know the job yet; the next poll gets the real one.
- ``sacct --jobs=123_4`` names one element of an array; sacct says nothing of an element that
  has not started, and ``sacct --name`` prints them as one range line (``123_[4-9]``, expanded
  by :func:`parse_sacct`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import replace

from bridge.slurm.jobs import JobInfo, _opt, parse_exit_code, parse_size, parse_time
from bridge.slurm.states import ENDED_STATES, base_state

log = logging.getLogger("bridge.slurm")

#: sacct --format fields (with -P: "|"-separated); Comment last so that it may contain "|".
SACCT_FIELDS = (
    "JobID,JobName,State,ExitCode,Reason,NodeList,Partition,Start,End,ElapsedRaw,MaxRSS,Comment"
)
_SACCT_NFIELDS = SACCT_FIELDS.count(",") + 1
_SACCT_MAX_RSS = SACCT_FIELDS.split(",").index("MaxRSS")
_SACCT_EXIT_CODE = SACCT_FIELDS.split(",").index("ExitCode")


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
    # A NODE_FAIL job's ExitCode is Slurm's mark (1:0 from 24.11, 0:0 before), not the script's.
    exit_code, signal = (
        parse_exit_code(exit_text) if ended and state != "NODE_FAIL" else (None, None)
    )
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
