"""The one place a Slurm command runs (:func:`run_slurm`), and what each costs slurmctld.

sbatch and scancel run with ``-v``: where slurmctld's RPC rate limit (``rl_enable``, 23.02+)
tells a command to back off, the command sleeps and tries again without end, and its only trace
is a verbose line on stderr (``sbatch: RPC rate limited 2 time(s). Sleeping then trying
again.``). :func:`run_slurm` counts those lines (the metric ``tes_bridge_slurm_rate_limited``)
and takes every verbose line out of the stderr its callers see, so that they read a tool's
errors as they would without ``-v``. squeue never gets ``-v``: it prints its dump on stdout.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bridge.slurm.errors import Outage, SlurmError, SlurmUnavailable, _outage_in
from bridge.system.budget import CallBudget
from bridge.system.metrics import observe_rate_limited, observe_slurm_command
from bridge.system.proc import CommandNotFound, CommandTimeout, run

log = logging.getLogger("bridge.slurm")

#: A retry slurmctld's RPC rate limit asked for, as the client library says it at -v.
_RATE_LIMITED = re.compile(r"RPC rate limited \d+ time")
#: A tool's own lines ("sbatch: ..."); only those that say "error:", "fatal:" or "warning:" are
#: printed without -v.
_TOOL_LINE = re.compile(r"^(?P<tool>[A-Za-z_]+): (?P<rest>.*)$")
#: The names Slurm's tools print before their lines (their own, whatever the path configured).
_TOOLS = frozenset(["sbatch", "scancel", "squeue", "sacct", "sinfo", "scontrol"])
_KEPT_LEVELS = re.compile(r"(?:error|fatal|warning): ", re.IGNORECASE)
#: Commands slowed by the rate limit are said in the log at most this often per command.
RATE_LIMITED_LOG_SECONDS = 60.0


class _SlowedLog:
    """The warnings for commands the rate limit slowed: one per command a minute at most, with
    the retries counted since the last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.said_at: dict[str, float] = {}
        self.unsaid: dict[str, int] = {}

    def note(self, tool: str, retries: int) -> None:
        now = time.monotonic()
        with self.lock:
            total = self.unsaid.pop(tool, 0) + retries
            if now - self.said_at.get(tool, float("-inf")) < RATE_LIMITED_LOG_SECONDS:
                self.unsaid[tool] = total
                return
            self.said_at[tool] = now
        log.warning(
            "slurmctld's RPC rate limit made %s back off and retry %d time(s) since this was "
            "last said: the service account sends more RPCs than the limit allows; lower "
            "slurm.calls_per_second and slurm.calls_burst under it (tes-bridge check, "
            "'slurm rate limit', says which fit)",
            tool,
            total,
        )


_slowed = _SlowedLog()


def clean_stderr(tool: str, stderr: str) -> tuple[str, int]:
    """`stderr` without the verbose lines (-v) of `tool`, and the rate-limit retries they
    counted.

    A line of the tool's (it names itself: "sbatch: ...") is kept when it says "error:",
    "fatal:" or "warning:" (what the tool prints without -v); the others (its option dump,
    "Terminating job N", the rate-limit retries) go.
    Other lines (a library's own "slurm_load_jobs error: ...", sudo's) are kept as they are."""
    if not stderr:
        return stderr, 0
    names = _TOOLS | {tool}
    kept: list[str] = []
    retries = 0
    for line in stderr.splitlines(keepends=True):
        if _RATE_LIMITED.search(line):
            retries += 1
            continue
        match = _TOOL_LINE.match(line.rstrip("\r\n"))
        if match and match["tool"] in names and not _KEPT_LEVELS.match(match["rest"]):
            continue
        kept.append(line)
    return "".join(kept), retries


def run_slurm(
    argv: Sequence[str],
    timeout: float,
    budget: CallBudget | None = None,
    *,
    stdin: str | None = None,
    clean: bool = True,
) -> subprocess.CompletedProcess[str]:
    """The one place that runs a Slurm command: in UTC, with Slurm's standard time format, killed
    after `timeout` seconds (raising :class:`SlurmUnavailable`), timed for the metrics; with a
    `budget`, it first takes the command's RPCs from it (RPC_COST), waiting if need be. Its
    stderr comes back without verbose lines (:func:`clean_stderr`), the rate-limit retries
    they told of counted and logged; with `clean` False, as the tool printed it (a command
    run without -v, whose answer is an info line: sbatch --test-only). `stdin`: what the
    command reads (sbatch: the job script)."""
    tool = _tool(argv)
    if budget is not None:
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
        proc = run(argv, timeout=timeout, env=env, stdin=stdin)
        failed = proc.returncode != 0
        stderr, retries = clean_stderr(tool, proc.stderr) if clean else (proc.stderr, 0)
        _count_retries(tool, retries)
        return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, stderr)
    except CommandNotFound as exc:
        raise SlurmError(
            f"{argv[0]} not found; install the Slurm client commands on this host or set "
            f"the path in the [slurm] section of the configuration",
            argv=argv,
        ) from exc
    except CommandTimeout as exc:
        # What it printed until it was killed, cleaned as a finished command's is.
        stderr, retries = clean_stderr(tool, exc.stderr)
        _count_retries(tool, retries)
        raise _timed_out(argv, tool, timeout, exc.stdout, stderr, retries) from exc
    finally:
        observe_slurm_command(argv, time.monotonic() - started, failed)


def _count_retries(tool: str, retries: int) -> None:
    if retries:
        observe_rate_limited(tool, retries)
        _slowed.note(tool, retries)


def _timed_out(
    argv: Sequence[str], tool: str, timeout: float, stdout: str, stderr: str, retries: int
) -> SlurmUnavailable:
    """The error of a command killed at its time-out: waiting out a limit of Slurm's (LIMIT),
    slowed by slurmctld's RPC rate limit (RATE_LIMITED), or with no answer at all."""
    outage = _outage_in(stderr)
    if outage is not Outage.LIMIT and retries:
        return SlurmUnavailable(
            f"{tool} was slowed by slurmctld's RPC rate limit for longer than "
            f"slurm.command_timeout ({timeout:g} s; told to back off {retries} time(s)): "
            "slurmctld answers, but this account sends it more RPCs than its limit allows; "
            "lower the call budget (slurm.calls_per_second, slurm.calls_burst) under the limit "
            "(`tes-bridge check` says which fits); trying again later",
            outage=Outage.RATE_LIMITED,
            argv=argv,
            stdout=stdout,
            stderr=stderr,
        )
    return SlurmUnavailable(
        f"{tool} did not answer within {timeout:g} s "
        f"(slurmctld or slurmdbd overloaded or unreachable); try again later",
        # Killed while it waited out a limit, or with no answer at all.
        outage=outage or Outage.UNCERTAIN,
        argv=argv,
        stdout=stdout,
        stderr=stderr,
    )


#: slurmctld RPCs per command where more than one, the most any tested release makes (counted
#: with `sdiag` and with rl_enable's own log): squeue asks for the jobs and the partitions, and
#: on 24.11 and later for the federation too when it names a single job (REQUEST_FED_INFO,
#: which the rate limit counts); sinfo asks for the partitions and the nodes; `scontrol show
#: config` makes two from 24.11 on. sbatch and scancel make one; sacct asks slurmdbd, which
#: has no rate limit, and counts one all the same.
RPC_COST = {"squeue": 3, "sinfo": 2, "scontrol": 2}


def _tool(argv: Sequence[str]) -> str:
    """The Slurm tool's name (through sudo, site mode: the word after `--`)."""
    words = [str(a) for a in argv]
    return Path(words[words.index("--") + 1] if "--" in words[:5] else words[0]).name
