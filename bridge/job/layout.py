"""The task directory contract shared by the renderer, the job side and the poller.

::

    <work_dir>/<task_id>/          mode 0700
        task.json                  the task document (TES wire format)
        job-config.json            settings the job side needs (see bridge.job.settings)
        job.sh                     the rendered sbatch script
        job-stage-in.sh            (staged on the transfer partition) its stage-in job's
        job-stage-out.sh           and its stage-out job's scripts
        slurm-<job id>.out         Slurm's own output of the script
        root/                      container path /a/b lives at root/a/b
        records/<job id>/          what one run of the job did (see bridge.job.records)
        tmp/                       scratch space for the runtime and staging
        lease-fence                the lowest fence token whose jobs may run this task
                                   (see write_lease_fence)
        lease-fence-<part>         the same, for one part of a staged task's chain
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from pathlib import Path

from bridge.core.naming import RUN_PART, STAGE_IN_PART, STAGE_OUT_PART
from bridge.core.naming import has_wildcards as has_wildcards

TASK_JSON = "task.json"
JOB_CONFIG_JSON = "job-config.json"
SCRIPT = "job.sh"
#: The scripts of a task's stage-in and stage-out jobs, when it is staged on the transfer
#: partition (staging.where = "transfer"; bridge.jobscript.parts).
STAGE_IN_SCRIPT = "job-stage-in.sh"
STAGE_OUT_SCRIPT = "job-stage-out.sh"
SLURM_OUTPUT = "slurm-%j.out"
LEASE_FENCE = "lease-fence"


class LayoutError(ValueError):
    """A container path cannot be mapped into the task directory."""


def check_container_path(container_path: str) -> str:
    """Return `container_path` if it is absolute and normalised (no `.`, `..`, `//`, NUL)."""
    if not isinstance(container_path, str) or not container_path.startswith("/"):
        raise LayoutError(f"container path {container_path!r} is not absolute")
    if "\0" in container_path:
        raise LayoutError(f"container path {container_path!r} contains a NUL byte")
    # posixpath.normpath keeps a leading "//"; anything it changes was not normalised.
    if container_path.startswith("//") or posixpath.normpath(container_path) != container_path:
        raise LayoutError(f"container path {container_path!r} is not normalised")
    return container_path


def relative_parts(container_path: str) -> tuple[str, ...]:
    """The components of a checked container path below `/` (empty for `/` itself)."""
    check_container_path(container_path)
    return tuple(part for part in container_path.split("/") if part)


def static_dir(container_path: str) -> str:
    """The directory above the first component with a wildcard: `/out/*/x.txt` -> `/out`."""
    static: list[str] = []
    for part in relative_parts(container_path)[:-1]:
        if has_wildcards(part):
            break
        static.append(part)
    return "/" + "/".join(static)


def write_atomically(path: Path, text: str, mode: int) -> None:
    """Replace `path` with `text` in one rename, never writing through a link at the
    temporary name; readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


#: The parts of a staged task's chain that may be fenced alone (`lease-fence-<part>`).
FENCED_PARTS = (STAGE_IN_PART, RUN_PART, STAGE_OUT_PART)


def lease_fence_name(part: str | None = None) -> str:
    """The fence file of the whole task, or (`part`) of that part of a staged task's chain
    only: the first job its recovery did not find, whose sbatch may yet be acted on, while the
    chain's earlier jobs, which were found, go on."""
    if part is None:
        return LEASE_FENCE
    if part not in FENCED_PARTS:
        raise ValueError(f"not a part of a staged task's chain: {part!r}")
    return f"{LEASE_FENCE}-{part}"


def write_lease_fence(task_dir: Path, epoch: int, part: str | None = None) -> None:
    """Fence the task's directory at `epoch` (a fence token: a lease epoch, or a lone poller's
    clock in ms): a job of this task submitted with an earlier token stands down when it starts
    (templates/job.sh.j2, exit code SUPERSEDED_EXIT_CODE). A poller that found no job for an
    interrupted submission writes it and looks once more before it submits the task again, so
    a job it does not find can never run the task beside the one it submits. Creates the task
    directory when it is missing (as the renderer would)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"a lease epoch is a whole number >= 0, not {epoch!r}")
    name = lease_fence_name(part)
    with contextlib.suppress(FileExistsError):
        os.mkdir(task_dir, 0o700)
    write_atomically(Path(task_dir) / name, f"{epoch}\n", 0o600)


class TaskLayout:
    """Every path of one task directory; `TaskLayout(config.work_dir / task_id)`."""

    def __init__(self, task_dir: Path) -> None:
        self.task_dir = Path(task_dir)

    def __repr__(self) -> str:
        return f"TaskLayout({str(self.task_dir)!r})"

    @property
    def task_json(self) -> Path:
        return self.task_dir / TASK_JSON

    @property
    def job_config(self) -> Path:
        return self.task_dir / JOB_CONFIG_JSON

    @property
    def script(self) -> Path:
        return self.task_dir / SCRIPT

    @property
    def slurm_output(self) -> Path:
        """The `--output` pattern; Slurm replaces `%j` with the job id."""
        return self.task_dir / SLURM_OUTPUT

    def slurm_output_for(self, job_id: str) -> Path:
        return self.task_dir / SLURM_OUTPUT.replace("%j", job_id)

    @property
    def root(self) -> Path:
        return self.task_dir / "root"

    @property
    def records(self) -> Path:
        return self.task_dir / "records"

    def records_dir(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or job_id in {".", ".."} or "\0" in job_id:
            raise LayoutError(f"invalid job id {job_id!r}")
        return self.records / job_id

    @property
    def tmp(self) -> Path:
        return self.task_dir / "tmp"

    def host_path(self, container_path: str) -> Path:
        """Where `container_path` lives on the host: `/data/x` -> `<task_dir>/root/data/x`.

        Purely lexical: the path must be absolute and normalised, so it cannot climb out of
        `root/`. Symbolic links planted by executors are the business of bridge.job.safepath,
        which every reader and writer of `root/` after the executors ran goes through.
        """
        return self.root.joinpath(*relative_parts(container_path))
