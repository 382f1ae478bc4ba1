"""What squeue and sacct say of a job (:class:`JobInfo`), and the parsers of the values they
print alike.

Slurm quirks (seen on Slurm 22.05; real output in tests/data/slurm/): times are "Unknown",
"None", "N/A" or "NONE" when not set, and squeue prints "(null)" for no comment (each
:func:`_opt`, None); times are printed in the client's time zone (the client runs every command
with TZ=UTC, :func:`bridge.slurm.run.run_slurm`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from bridge.slurm.states import ENDED_STATES, tes_state_for

log = logging.getLogger("bridge.slurm")


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
    #: Slurm's estimate of when a pending job starts (squeue's %S while PENDING, what
    #: `squeue --start` shows); None when it has none (held, or not estimated yet).
    expected_start: datetime | None = None

    @property
    def tes_state(self) -> str:
        return tes_state_for(self.state)

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES


_UNSET = {"", "none", "unknown", "n/a", "(null)", "none assigned", "invalid"}
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}


def _opt(value: str) -> str | None:
    """The value, stripped; None for Slurm's words for "not set" ("None", "(null)", ...)."""
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
