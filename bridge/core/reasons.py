"""Why a final task ended as it did, in a word or two for a list (`tes-bridge task list`, the web
page's list and workflow view): `exit 42`, `TIMEOUT`, `OUT_OF_MEMORY`, `image`, `input`,
`output`, `canceled by alice`, ...

Derived when a task is read, from what its last attempt already holds: the task's state, the
executors' exit codes, the Slurm state sacct gave its job (`slurm_state`), and the few
`system_logs` lines this bridge writes when it fails or cancels a task. Those lines are written
with the words below (the job script receives them from `bridge.jobscript.render`, the job side
and the poller import them), so that a wording changes in one place. A task stored before a
line existed still gets the best reason its Slurm state and exit codes give.

The reason travels in the last attempt's `metadata` (`REASON_KEY`), a map TES leaves to the
server: clients that list tasks (BASIC view) read it without the system logs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

#: The task log metadata key a final task's reason is given under (never stored).
REASON_KEY = "reason"

# The lines the bridge writes (or starts) when a task fails or is canceled.
#: The job script, when stage-in failed (an input, the image or the runtime on the node).
STAGE_IN_FAILED = "staging inputs failed; no executor ran"
#: The job script, when uploading the outputs failed after every executor succeeded.
STAGE_OUT_FAILED = "uploading outputs failed after every executor succeeded"
#: The job script: `executor N was killed for using more memory than the job's limit ...`.
OOM_KILLED = "was killed for using more memory than the job's limit"
#: The job side (`stage-in`) and the job script, when an image is not readable on the node.
IMAGE_UNREADABLE = "a container image is not readable on this node"
#: The poller, when an image cannot be pulled (it does not exist, or its registry refuses).
IMAGE_PULL_FAILED = "cannot pull image: "
#: The poller, when sbatch refused the job.
SLURM_REFUSED = "Slurm refused the job: "
#: The poller, when a pending job can never start: `Slurm job 12 can never start (BadConstraints)`.
NEVER_STARTS = "can never start"
#: The poller, when someone canceled the job in Slurm (sacct names them).
CANCELED_OUTSIDE = "canceled outside tes-bridge"
#: The API, when a signed-in user cancels a task: `canceled by alice`.
CANCELED_BY = "canceled by "

_NEVER_STARTS = re.compile(re.escape(NEVER_STARTS) + r" \(([A-Za-z_]+)\)")
#: Slurm states that name the reason themselves.
_LIMITS = ("TIMEOUT", "OUT_OF_MEMORY")
#: Slurm states that say nothing of why a task failed (or that it has not ended).
_SILENT_STATES = frozenset({"", "COMPLETED", "PENDING", "RUNNING", "COMPLETING"})


def canceled_by(user: str) -> str:
    """The line the API writes into a task a signed-in user cancels."""
    return f"{CANCELED_BY}{user}"


def task_reason(state: str, logs: Sequence[Mapping[str, Any]] | None) -> str:
    """The reason a task in `state` with these (stored) `logs` ended as it did; "" for a task
    that completed or has not ended."""
    entry: Mapping[str, Any] = (logs[-1] if logs else None) or {}
    metadata = entry.get("metadata") or {}
    lines = [line for line in entry.get("system_logs") or [] if isinstance(line, str)]
    slurm_state = str(metadata.get("slurm_state") or "")
    if state == "CANCELED":
        return _canceled(lines, slurm_state)
    if state == "PREEMPTED":
        return "preempted"
    if state == "EXECUTOR_ERROR":
        return _limit(slurm_state, lines) or _exit(entry.get("logs")) or slurm_state
    if state == "SYSTEM_ERROR":
        return _limit(slurm_state, lines) or _system(lines, slurm_state)
    return ""


def _canceled(lines: list[str], slurm_state: str) -> str:
    who = next((line for line in lines if line.startswith(CANCELED_BY)), None)
    if who is not None:
        return who
    if any(CANCELED_OUTSIDE in line for line in lines):
        return "canceled in Slurm"
    return "canceled"


def _limit(slurm_state: str, lines: list[str]) -> str:
    """A limit of the job's that ended it: Slurm's word, or the job's own record of the kernel
    killing an executor over its memory (sacct says OUT_OF_MEMORY a moment later)."""
    if slurm_state in _LIMITS:
        return slurm_state
    if any(OOM_KILLED in line for line in lines):
        return "OUT_OF_MEMORY"
    return ""


def _exit(executor_logs: Any) -> str:
    """`exit N` of the first executor that failed."""
    for executor in executor_logs or []:
        code = executor.get("exit_code") if isinstance(executor, Mapping) else None
        if isinstance(code, int) and code != 0:
            return f"exit {code}"
    return ""


def _system(lines: list[str], slurm_state: str) -> str:
    """What the system could not do for the task, the first match in this order."""
    if any(line.startswith((IMAGE_UNREADABLE, IMAGE_PULL_FAILED)) for line in lines):
        return "image"
    if STAGE_IN_FAILED in lines:
        return "input"
    if STAGE_OUT_FAILED in lines:
        return "output"
    if any(line.startswith(SLURM_REFUSED) for line in lines):
        return "refused by Slurm"
    for line in lines:
        match = _NEVER_STARTS.search(line)
        if match:
            return match.group(1)
    if slurm_state not in _SILENT_STATES:
        return slurm_state  # NODE_FAIL with no retries left, a job that ended FAILED, ...
    return "system"
