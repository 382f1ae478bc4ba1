"""squeue: its argv, and its output read as :class:`~bridge.slurm.jobs.JobInfo` or states.

Slurm quirks (seen on Slurm 22.05; real output in tests/data/slurm/):

- ``squeue --jobs=N`` for a single unknown id exits 1 with "Invalid job id specified"; with two or
  more ids the unknown ones are just absent. Both mean "not in the controller's memory".
- squeue shows ended jobs only with ``--states=all``, and only for ``MinJobAge`` seconds (300 by
  default); after that only sacct knows them. A job missing from squeue is not finished: ask sacct.
- squeue says "CANCELLED" without who asked (sacct says it); it prints "(null)" for no comment.
  A job cancelled while pending gets a start time equal to its end time in squeue.
- An array (``sbatch --array=0-N``) gets one id; its elements are ``ID_I``. squeue without
  ``-r`` prints the pending ones as one range line (``123_[4-9]``); with ``-r`` (always used
  here) one line each. ``squeue --jobs=123_4`` names one element.
- 23.11.5+: ``--only-job-state`` reads the states alone through a lighter RPC
  (:attr:`~bridge.slurm.releases.SlurmFeatures.only_job_state`).
- A pending job's ``%S`` is Slurm's estimate of its start, the same value ``squeue --start``
  prints (every release): the backfill scheduler sets it every ``bf_interval`` (30 s by
  default) for the jobs it looks at; "N/A" until then, for a held job, and for one whose
  start it cannot foresee (jobs ahead without a time limit). So the estimate comes with the
  squeue every cycle makes, at no extra call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bridge.slurm.jobs import JobInfo, _opt, parse_duration, parse_time
from bridge.slurm.states import ENDED_STATES, base_state

log = logging.getLogger("bridge.slurm")

#: squeue -o fields, "|"-separated; the comment is last so that it may contain "|".
SQUEUE_FORMAT = "%i|%j|%T|%r|%N|%P|%S|%e|%M|%k"
_SQUEUE_NFIELDS = SQUEUE_FORMAT.count("|") + 1

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
        expected = parse_time(start) if state == "PENDING" else None
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
            expected_start=expected,
        )
    return jobs
