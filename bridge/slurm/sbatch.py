"""``sbatch --test-only``: Slurm's answer to "where and when would this job start?", read as a
:class:`StartEstimate`.

sbatch asks slurmctld (one RPC, REQUEST_JOB_WILL_RUN) and creates no job. The answer is a line
the client library prints at info level on stderr, with sbatch's exit code 0; a job Slurm
would refuse exits 1 with Slurm's reason (26.05: ``allocation failure: Invalid feature
specification``, without sbatch's usual prefix), read by
:func:`~bridge.slurm.errors.command_error` as a real sbatch's refusal. Its form (src/api/allocate.c,
``slurm_job_will_run``):

- 22.05 to 25.05: ``sbatch: Job 12 to start at 2026-11-29T10:00:00 using 2 processors on
  nodes node1 in partition main``;
- 25.11 and later: ``... to start at 2026-11-29T10:00:00 on cluster C a using 2 processors
  ...`` (" on cluster C" where the answer names a cluster, and a stray " a": seen on 26.05);
- then, where starting it would preempt jobs, ``sbatch:   Preempts: 41,42``.

The job id is one slurmctld gives no job. The time is in the client's zone (UTC:
:func:`~bridge.slurm.run.run_slurm`) and format (``SLURM_TIME_FORMAT=standard``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from bridge.slurm.jobs import parse_time

_WILL_RUN = re.compile(
    r"Job \d+ to start at (?P<start>\S+)(?: on cluster (?P<cluster>\S+))?(?: a)? "
    r"using (?P<processors>\d+) processors on (?:nodes )?(?P<nodes>\S+)"
    r"(?: in partition (?P<partition>\S+))?"
)
_PREEMPTS = re.compile(r"^\S+:\s+Preempts: (?P<jobs>[0-9_,]+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class StartEstimate:
    """Where and when Slurm would start a job submitted now."""

    #: Timezone-aware UTC; None when Slurm printed a time it does not know ("Unknown").
    start: datetime | None
    processors: int
    #: Slurm's host list ("node[1-2]").
    nodes: str
    partition: str | None
    cluster: str | None = None
    #: The jobs Slurm would preempt to start it.
    preempts: list[str] = field(default_factory=list)
    #: Slurm's line, as it said it.
    said: str = ""


def parse_test_only(stderr: str) -> StartEstimate | None:
    """sbatch --test-only's stderr -> its estimate; None when it holds none."""
    match = _WILL_RUN.search(stderr)
    if match is None:
        return None
    preempts = _PREEMPTS.search(stderr)
    line = stderr[stderr.rfind("\n", 0, match.start()) + 1 :].splitlines()[0]
    return StartEstimate(
        start=parse_time(match["start"]),
        processors=int(match["processors"]),
        nodes=match["nodes"],
        partition=match["partition"],
        cluster=match["cluster"],
        preempts=preempts["jobs"].split(",") if preempts else [],
        said=line.strip(),
    )
