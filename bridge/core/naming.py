"""Names the server side and the job side agree on: task ids, the Slurm job name, the host
path a `file:` URL names, what makes an output path a pattern, and how a moment is written.

Pure and dependency-free, so the job side (on compute nodes) can import it too.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TypeGuard

#: What a task id may hold: it names the task directory and goes into `#SBATCH` lines.
TASK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
#: Prefix of the unique part of every job name the bridge gives (`tes-<task id>`,
#: `tes-array-<token>`), which the task's name may precede.
JOB_NAME_PREFIX = "tes-"
#: How much of a task's name goes first into its job's name: squeue shows 8 characters of a job
#: name by default and sacct 10, so the name's start is what Slurm users see; the rest is kept
#: short enough for any column.
JOB_NAME_TASK_CHARS = 40
#: What a job name keeps of a task's name: characters every Slurm command and its callers take
#: as they are (no comma, which separates names in `--name=a,b`; no space or `|`).
_UNNAMEABLE = re.compile(r"[^A-Za-z0-9_.-]+")
#: The job script's exit code when it cannot even start its records (a full or read-only work
#: filesystem): none of the task ran, so the poller submits the job again (EX_TEMPFAIL).
NO_RECORDS_EXIT_CODE = 75
#: The job script's exit code when it stands down before doing anything: its sbatch started
#: before the poller fenced the task (a leader frozen between its lease check and sbatch, or an
#: sbatch that timed out and that slurmctld acted on late; see
#: `bridge.job.layout.write_lease_fence`).
SUPERSEDED_EXIT_CODE = 76
#: The job script's exit codes when the task ended SYSTEM_ERROR in its job (sacct shows the job
#: FAILED with them): an input could not be staged, or the image or the container runtime is
#: missing on the node (EX_NOINPUT); the executors' scratch directory could not be made
#: (EX_OSERR); an output could not be uploaded after every executor succeeded (EX_CANTCREAT).
#: An executor that failed makes the job exit with the executor's own code instead. The
#: poller decides from the job's recorded outcome, never from these codes.
STAGE_IN_EXIT_CODE = 66
SCRATCH_EXIT_CODE = 71
STAGE_OUT_EXIT_CODE = 73
#: The argument a job script is given (after its array element's id, if any) with its
#: submission's fence token (`PollerContext.fence_token`): the lease epoch of an elected poller
#: (`lease-epoch=7`), a lone poller's clock in milliseconds.
LEASE_EPOCH_ARG = "lease-epoch="
#: The argument the later jobs of a staged task's chain are given (staging.where =
#: "transfer"): `after=<job id>`, the chain's job before them (the task's job: the stage-in
#: job, whose records it continues; the stage-out job: the task's job, whose records it
#: completes).
AFTER_ARG = "after="
#: The parts of a staged task's chain, in order: its job's own part is `run`; a task whose
#: inputs and outputs need no network is one job, `whole`.
STAGE_IN_PART = "stage-in"
RUN_PART = "run"
STAGE_OUT_PART = "stage-out"
WHOLE_PART = "whole"


def is_task_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and TASK_ID.fullmatch(value) is not None


def job_name_part(task_name: object) -> str:
    """What of a task's name goes into its job's name: the characters Slurm's commands take as
    they are (a run of others becomes `_`), at most JOB_NAME_TASK_CHARS, without separators at
    either end; "" for no name."""
    if not isinstance(task_name, str):
        return ""
    part = _UNNAMEABLE.sub("_", task_name).strip("._-")
    return part[:JOB_NAME_TASK_CHARS].rstrip("._-")


def job_name(task_id: str, task_name: object = None) -> str:
    """The Slurm job name of a task: `<name>-tes-<task id>`, the task's name first where squeue
    and sacct show it (see `job_name_part`), and `tes-<task id>`, unique, after it; a task
    without a name (or one of no usable character) is `tes-<task id>`, the only name earlier
    versions gave."""
    unique = f"{JOB_NAME_PREFIX}{task_id}"
    part = job_name_part(task_name)
    return f"{part}-{unique}" if part else unique


def part_job_name(name: str, part: str) -> str:
    """The job name of a part of a staged task's chain: the task's job name (`job_name`) for its
    own job, that name and `-stage-in` or `-stage-out` for the transfer jobs around it."""
    return name if part in (RUN_PART, WHOLE_PART) else f"{name}-{part}"


def array_job_name(token: str, task_names: Iterable[object] = ()) -> str:
    """The Slurm job name of a job array: `<common>-tes-array-<token>`, never a task's (task ids
    are UUIDs), where `<common>` is the start the array's task names share (in job name form:
    a scatter's `align (1)`, `align (2)` give `align`), left out when they share none; each
    task stores the name and its element before sbatch runs."""
    unique = f"{JOB_NAME_PREFIX}array-{token}"
    common = _shared_start([job_name_part(name) for name in task_names]).rstrip("._-")
    return f"{common}-{unique}" if common else unique


def _shared_start(words: list[str]) -> str:
    """The longest start all of `words` have ("" for none): that of the first and the last in
    sorted order, which every word between them shares."""
    if not words:
        return ""
    first, last = min(words), max(words)
    pairs = enumerate(zip(first, last, strict=False))
    return first[: next((i for i, (a, b) in pairs if a != b), len(first))]


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with a `Z`, e.g. ``2026-11-22T02:24:15.123456Z`` (TES times)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def format_time_now() -> str:
    """The current moment, as `format_time` writes it."""
    return format_time(datetime.now(UTC))


#: The characters that make an output path a POSIX glob pattern.
_WILDCARDS = frozenset("*?[")


def has_wildcards(path: str) -> bool:
    """Whether an output `path` is a glob pattern (TES: then it needs a `path_prefix`)."""
    return any(ch in _WILDCARDS for ch in path)


class FileUrlError(ValueError):
    """A `file:` URL or bare path that names no usable local path; the message says why."""


def is_local_url(url: str) -> bool:
    """Whether `url` is for the local filesystem: a `file:` URL or a bare absolute path."""
    return url.startswith("/") or url[:5].lower() == "file:"


def local_path(url: str) -> str:
    """The host path a `file:` URL or bare absolute path names, without a trailing slash.

    The path is taken literally, with no percent-decoding (as Funnel and the usual TES clients
    do: `file:///a b` is the file `/a b`, `%2e%2e` is a name, not `..`). Only the local host
    (`file:///`, `file://localhost/`) and normalised absolute paths are accepted; whether the
    path may be used (storage.allowed_dirs) is for the caller to judge.
    """
    if url.startswith("/"):
        path = url
    elif url[:5].lower() == "file:":
        rest = url[5:]
        if rest.startswith("//"):
            host, slash, tail = rest[2:].partition("/")
            if host not in ("", "localhost"):
                raise FileUrlError(f"file URL {url!r} names host {host!r}; only local paths work")
            path = slash + tail
        else:
            path = rest
    else:
        raise FileUrlError(f"{url!r} is not a file URL")
    if "\0" in path:
        raise FileUrlError(f"file URL {url!r} holds a NUL character")
    if not path.startswith("/"):
        raise FileUrlError(f"file URL {url!r} does not hold an absolute path")
    stripped = path.rstrip("/") or "/"
    # normpath keeps a leading `//` (POSIX leaves its meaning open): refused too.
    if posixpath.normpath(path) != stripped or stripped.startswith("//"):
        raise FileUrlError(f"file URL {url!r} is not normalised (`..`, `.` or `//`)")
    return stripped
