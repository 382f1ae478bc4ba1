"""The one place a Slurm command runs (:func:`run_slurm`), and what each costs slurmctld."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from bridge.slurm.errors import Outage, SlurmError, SlurmUnavailable, _outage_in
from bridge.system.budget import CallBudget
from bridge.system.metrics import observe_slurm_command
from bridge.system.proc import CommandNotFound, CommandTimeout, run


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
