"""The Slurm client: sbatch, squeue, sacct, scancel, sinfo and scontrol as argument lists, and
their parsers.

Knows nothing of HTTP or the store. Every command goes through
:func:`~bridge.slurm.run.run_slurm` (on :func:`bridge.system.proc.run`), and a failed one
becomes, through :func:`~bridge.slurm.errors.command_error`, a :class:`SlurmError` carrying
argv, exit code, stdout and stderr. :class:`SlurmBackend` is what the poller needs of a Slurm
client; the real one and the tests' fake (tests/fakes/slurm.py, type-checked against it) both
satisfy it. A command's error output is read in one place, once: the error's subclass tells the
caller what to do, :class:`SlurmUnavailable` (try again later, with back-off; its
:class:`Outage` says whether the command may have been done all the same) or
:class:`SlurmRejected` (sbatch refused this job for good; its :class:`Refusal` says for what),
and its ``reason`` is Slurm's own words.

Modules, each importing only those before it:

- ``states``: Slurm's job states and the TES state each means (:data:`SLURM_TO_TES`), the
  states that ended, that may be retried, and the pending reasons that never clear.
- ``errors``: :class:`SlurmError` and its kinds, and the stderr patterns that tell them apart.
- ``jobs``: :class:`JobInfo`, and the parsers of the values squeue and sacct print alike.
- ``releases``: the one place that says what differs by Slurm release (:class:`SlurmRelease`,
  :class:`SlurmFeatures`, :data:`TESTED_RELEASES`).
- ``squeue``, ``sacct``, ``sinfo``, ``scontrol``, ``sbatch``: each command's formats and
  parsers (sbatch's: its ``--test-only`` answer, :class:`StartEstimate`).
- ``run``: :func:`run_slurm`, and the RPCs each command costs slurmctld (:data:`RPC_COST`).
- ``client``: :class:`SlurmClient` and the :class:`SlurmBackend` protocol.

Every name is imported from here (``from bridge.slurm import JobInfo``). The Slurm quirks each
module handles (seen on Slurm 22.05, with real output in tests/data/slurm/; later releases from
Slurm's sources) are in its own doc, next to the parser they concern.
"""

from __future__ import annotations

import logging

from bridge.slurm.client import (
    QUEUE_BY_USER_FROM,
    RATE_LIMIT_REFRESH,
    RATE_LIMIT_RETRY,
    RATE_LIMIT_TIMEOUT,
    SlurmBackend,
    SlurmClient,
)
from bridge.slurm.errors import (
    Outage,
    Refusal,
    SlurmError,
    SlurmRejected,
    SlurmUnavailable,
    command_error,
)
from bridge.slurm.jobs import JobInfo, parse_duration, parse_exit_code, parse_size, parse_time
from bridge.slurm.releases import (
    TESTED_RELEASES,
    SlurmFeatures,
    SlurmRelease,
    describe_tested,
    is_tested,
    parse_version,
)
from bridge.slurm.run import RPC_COST, run_slurm
from bridge.slurm.sacct import SACCT_FIELDS, expand_array_range, parse_sacct
from bridge.slurm.sbatch import StartEstimate, parse_test_only
from bridge.slurm.scontrol import (
    RateLimit,
    exempt_because,
    parse_config_version,
    parse_max_array_size,
    parse_rate_limit,
    parse_slurm_user,
)
from bridge.slurm.sinfo import (
    SINFO_NODE_SIZES_FORMAT,
    SINFO_PARTITIONS_FORMAT,
    NodeSizes,
    Partition,
    parse_sinfo_node_sizes,
    parse_sinfo_partitions,
)
from bridge.slurm.squeue import (
    JOB_STATES_FORMAT,
    SQUEUE_FORMAT,
    parse_job_states,
    parse_squeue,
    squeue_argv,
)
from bridge.slurm.states import (
    ENDED_STATES,
    HOPELESS_PENDING_REASONS,
    RETRYABLE_STATES,
    SLURM_TO_TES,
    base_state,
    tes_state_for,
)

#: The package's logger: every module logs as "bridge.slurm".
log = logging.getLogger("bridge.slurm")

__all__ = [
    "ENDED_STATES",
    "HOPELESS_PENDING_REASONS",
    "JOB_STATES_FORMAT",
    "QUEUE_BY_USER_FROM",
    "RATE_LIMIT_REFRESH",
    "RATE_LIMIT_RETRY",
    "RATE_LIMIT_TIMEOUT",
    "RETRYABLE_STATES",
    "RPC_COST",
    "SACCT_FIELDS",
    "SINFO_NODE_SIZES_FORMAT",
    "SINFO_PARTITIONS_FORMAT",
    "SLURM_TO_TES",
    "SQUEUE_FORMAT",
    "TESTED_RELEASES",
    "JobInfo",
    "NodeSizes",
    "Outage",
    "Partition",
    "RateLimit",
    "Refusal",
    "SlurmBackend",
    "SlurmClient",
    "SlurmError",
    "SlurmFeatures",
    "SlurmRejected",
    "SlurmRelease",
    "SlurmUnavailable",
    "StartEstimate",
    "base_state",
    "command_error",
    "describe_tested",
    "exempt_because",
    "expand_array_range",
    "is_tested",
    "log",
    "parse_config_version",
    "parse_duration",
    "parse_exit_code",
    "parse_job_states",
    "parse_max_array_size",
    "parse_rate_limit",
    "parse_sacct",
    "parse_sinfo_node_sizes",
    "parse_sinfo_partitions",
    "parse_size",
    "parse_slurm_user",
    "parse_squeue",
    "parse_test_only",
    "parse_time",
    "parse_version",
    "run_slurm",
    "squeue_argv",
    "tes_state_for",
]
