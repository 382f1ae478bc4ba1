"""Names the server side and the job side agree on: task ids and the Slurm job name.

Pure and dependency-free, so the job side (on compute nodes) can import it too.
"""

from __future__ import annotations

import re
from typing import TypeGuard

#: What a task id may hold: it names the task directory and goes into `#SBATCH` lines.
TASK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
#: Prefix of every job the bridge submits; the poller finds its jobs by it.
JOB_NAME_PREFIX = "tes-"


def is_task_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and TASK_ID.fullmatch(value) is not None


def job_name(task_id: str) -> str:
    """The Slurm job name of a task: `tes-<task id>`."""
    return f"{JOB_NAME_PREFIX}{task_id}"
