"""The sbatch script of a task: every decision in Python, the template only lays it out.

`render_script` turns a stored task (TES wire format, validated by the API but with hostile
values) into a bash script, after parsing it once into the TES model (`parse_task`);
`prepare_task_dir` writes it, the task document and the job-side settings into the task
directory (see bridge.job.layout). Every value that comes from the task reaches the script
through `shlex.quote`; values that go into `#SBATCH` lines (which sbatch parses with its own
rules) must match strict patterns instead, or rendering fails with a `RenderError` naming the
field, which the poller records as a SYSTEM_ERROR.
"""

from __future__ import annotations

import csv
import grp
import io
import json
import math
import os
import pwd
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeGuard

import jinja2

import bridge
from bridge.config import Config, SiteRule
from bridge.core import backend_params, tes
from bridge.core.naming import FileUrlError, is_local_url, is_task_id, job_name, local_path
from bridge.core.tes import (
    ExecutorModel,
    FileType,
    InputModel,
    OutputModel,
    ResourcesModel,
    TaskModel,
)
from bridge.job.layout import (
    LayoutError,
    TaskLayout,
    check_container_path,
    has_wildcards,
    relative_parts,
    static_dir,
    write_atomically,
)
from bridge.job.settings import JobSettings
from bridge.slurm import TmpDisk

TEMPLATE = "job.sh.j2"
JOB_MODULE = "bridge.job"


class RenderError(ValueError):
    """The task cannot be turned into a job script; the message names the field."""


# --------------------------------------------------------------------------- the typed task


@dataclass(frozen=True)
class TesTask:
    """A stored task parsed once: its id, its TES model, and the document as stored (which
    is what task.json holds for the job side)."""

    id: str
    model: TaskModel
    document: dict[str, Any]

    @property
    def resources(self) -> ResourcesModel:
        return self.model.resources or ResourcesModel()


def parse_task(task: dict[str, Any] | TesTask) -> TesTask:
    """The typed task of a stored document; a value the TES model refuses is a RenderError
    naming the field (the API checked it already, so this is a task stored by hand)."""
    if isinstance(task, TesTask):
        return task
    task_id = task.get("id")
    if not is_task_id(task_id):
        raise RenderError(f"id: {task_id!r} is not a valid task id")
    try:
        model = tes.parse_task(task)
    except tes.TaskValidationError as exc:
        raise RenderError(str(exc)) from None
    return TesTask(id=task_id, model=model, document=task)


# --------------------------------------------------------------------------- validation

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
#: Characters sbatch reads in an `#SBATCH` value without surprises (for the task directory).
_SBATCH_PATH = re.compile(r"^/[A-Za-z0-9_./+,:=@~-]*$")

#: Where each `#SBATCH` option of a task comes from, in the order they are written (after
#: --job-name, --output, --chdir and --no-requeue; before slurm.extra_directives):
#:
#:   key            option             value
#:   partition      --partition        backend_parameters.partition, else resources.zones (each
#:                                     checked against slurm.partitions), else
#:                                     slurm.preemptible_partition for a preemptible task, else
#:                                     slurm.default_partition
#:   qos            --qos              backend_parameters.qos, else slurm.preemptible_qos for a
#:                                     preemptible task
#:   account        --account          backend_parameters.account
#:   time_limit     --time             the tighter of backend_parameters.time (or time_limit)
#:                                     and max_time (hours), else slurm.default_time, else
#:                                     slurm.max_time (see backend_params.time_limit)
#:   cpu_cores      --cpus-per-task    resources.cpu_cores rounded up (0: no request)
#:   ram_gb         --mem              resources.ram_gb in MB, rounded up (0: no request)
#:   disk_gb        --tmp              resources.disk_gb in MB, per slurm.disk_request
#:   gres           --gres             backend_parameters.gres
#:   gpus           --gpus             backend_parameters.gpus
#:   gpus_per_task  --gpus-per-task    backend_parameters.gpus_per_task
#:   constraint     --constraint       backend_parameters.constraint
#:   reservation    --reservation      backend_parameters.reservation
SBATCH_OPTIONS: dict[str, str] = {
    "partition": "--partition",
    "qos": "--qos",
    "account": "--account",
    "time_limit": "--time",
    "cpu_cores": "--cpus-per-task",
    "ram_gb": "--mem",
    "disk_gb": "--tmp",
    "gres": "--gres",
    "gpus": "--gpus",
    "gpus_per_task": "--gpus-per-task",
    "constraint": "--constraint",
    "reservation": "--reservation",
}

#: Variables Slurm sets for a job's GPUs, passed into the executors of a task that asks for
#: GPUs (the runtime's --cleanenv drops the job's environment).
GPU_ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "SLURM_JOB_GPUS")

#: Container paths that cannot be bind targets: the runtime owns them.
_RESERVED = ("/proc", "/sys", "/dev")

#: Bound from the attempt's scratch directory on disk: with `--contain` the runtime would
#: otherwise give the container a small RAM tmpfs there (Apptainer's `sessiondir max size`,
#: 64 MiB by default), charged to the job's memory.
#: container path -> subdirectory of the scratch directory (see templates/job.sh.j2).
SCRATCH_TARGETS = {"/tmp": "tmp", "/var/tmp": "var-tmp"}


def _path(value: str, where: str) -> str:
    try:
        return check_container_path(value)
    except LayoutError as exc:
        raise RenderError(f"{where}: {exc}") from None


def _under(path: str, parent: str) -> bool:
    return parent == "/" or path == parent or path.startswith(parent + "/")


def _ancestors(path: str) -> list[str]:
    """`/a/b` -> [`/`, `/a`, `/a/b`]: every path `path` is `_under`."""
    parts = [p for p in path.split("/") if p]
    return ["/"] + ["/" + "/".join(parts[: n + 1]) for n in range(len(parts))]


def _reserved(path: str) -> bool:
    return path == "/" or any(_under(path, r) for r in _RESERVED)


def _memory_asked(ram_gb: float | None) -> str:
    """What the task asked for, for the job's out-of-memory message (digits only: JSON-safe)."""
    if not ram_gb:
        return "no resources.ram_gb: the cluster's default"
    return f"resources.ram_gb {ram_gb:g}"


def _megabytes(gigabytes: float | None) -> int | None:
    """GB (TES) -> MB (Slurm) rounded up; 0 or absent -> None (never `--mem=0`: all memory)."""
    if not gigabytes:
        return None
    return max(1, math.ceil(gigabytes * 1024))


# --------------------------------------------------------------------------- sbatch directives


def _partition(name: str, where: str, config: Config) -> str:
    if not _NAME.fullmatch(name):
        raise RenderError(f"{where}: invalid partition name {name!r}")
    allowed = config.slurm.partitions
    if allowed and name not in allowed:
        raise RenderError(
            f"{where}: partition {name!r} is not available (one of {', '.join(allowed)})"
        )
    return name


def disk_directive(
    megabytes: int | None, partitions: list[str], config: Config, tmp_disk: TmpDisk | None
) -> str | None:
    """`--tmp` for a task's disk_gb, per `slurm.disk_request`.

    auto passes it only where the smallest TmpDisk of the partition's nodes (learned with
    sinfo; `partitions` empty: the default partition) is > 0: engines send disk_gb by default,
    and on nodes that declare no TmpDisk sbatch refuses every `--tmp`. A request larger than
    the nodes declare is passed on: Slurm refuses it with a message the poller explains.
    """
    mode = config.slurm.disk_request
    if megabytes is None or mode == "ignore":
        return None
    if mode == "auto" and not (tmp_disk and tmp_disk.smallest(partitions)):
        return None
    return f"{SBATCH_OPTIONS['disk_gb']}={megabytes}"


def _backend_values(resources: ResourcesModel, config: Config) -> dict[str, str]:
    """The supported backend parameters, each checked against its pattern, the time limit
    under `time_limit`."""
    try:
        values = backend_params.checked_values(
            resources.backend_parameters, config.backend_parameters.supported
        )
        limit = backend_params.time_limit(resources.backend_parameters, config.slurm.times)
    except backend_params.ParameterError as exc:
        raise RenderError(str(exc)) from None
    for key in ("time", "time_limit", "max_time"):
        values.pop(key, None)
    if limit is not None:
        values["time_limit"] = limit.option
    return values


def _with_defaults(values: dict[str, str], resources: ResourcesModel, config: Config) -> None:
    """Fill in partition and qos from the TES fields and the configuration."""
    preemptible = resources.preemptible is True
    if "partition" in values:
        values["partition"] = _partition(
            values["partition"], "resources.backend_parameters.partition", config
        )
    elif resources.zones:
        names = [
            _partition(zone, f"resources.zones[{i}]", config)
            for i, zone in enumerate(resources.zones)
        ]
        values["partition"] = ",".join(dict.fromkeys(names))
    elif preemptible and config.slurm.preemptible_partition:
        values["partition"] = config.slurm.preemptible_partition
    elif config.slurm.default_partition:
        values["partition"] = config.slurm.default_partition
    if "qos" not in values and preemptible and config.slurm.preemptible_qos:
        values["qos"] = config.slurm.preemptible_qos


def _resource_values(
    values: dict[str, str], resources: ResourcesModel, config: Config, tmp_disk: TmpDisk | None
) -> None:
    """Fill in cpu_cores, ram_gb and disk_gb as sbatch wants them."""
    if resources.cpu_cores:  # 0 (which TES allows) means "no request", like an absent value
        # TES 1.2 allows a fraction of a core; Slurm counts whole CPUs.
        values["cpu_cores"] = str(math.ceil(resources.cpu_cores))
    mem = _megabytes(resources.ram_gb)
    if mem is not None:
        values["ram_gb"] = str(mem)
    partitions = values["partition"].split(",") if "partition" in values else []
    tmp = disk_directive(_megabytes(resources.disk_gb), partitions, config, tmp_disk)
    if tmp is not None:
        values["disk_gb"] = tmp.partition("=")[2]


def _unix_groups(user: str) -> set[str]:
    """The Unix groups of `user` (none for an unknown user)."""
    try:
        gid = pwd.getpwnam(user).pw_gid
        return {grp.getgrgid(g).gr_name for g in os.getgrouplist(user, gid)}
    except (KeyError, OSError):
        return set()


def site_rule(
    typed: TesTask, partition: str | None, config: Config, owner: str | None
) -> SiteRule | None:
    """The first of `slurm.rules` whose every condition holds for the task, if any."""
    gpus = backend_params.wants_gpus(typed.resources.backend_parameters)
    groups: set[str] | None = None
    for rule in config.slurm.rules:
        if rule.gpu is not None and rule.gpu != gpus:
            continue
        if rule.partition is not None and not (
            partition and set(partition.split(",")) <= set(rule.partition)
        ):
            continue
        if rule.owner_group is not None:
            if groups is None:
                groups = _unix_groups(owner) if owner else set()
            if not groups & set(rule.owner_group):
                continue
        return rule
    return None


def sbatch_directives(
    task: dict[str, Any] | TesTask,
    *,
    config: Config,
    layout: TaskLayout,
    tmp_disk: TmpDisk | None = None,
    owner: str | None = None,
) -> list[str]:
    """The `#SBATCH` options (without the prefix), site directives last: those of the first
    matching `slurm.rules` (for `owner`'s groups), then `slurm.extra_directives`. `tmp_disk` is
    what the poller learned of the nodes' TmpDisk (see `disk_directive`)."""
    return _directives_and_rule(parse_task(task), config, layout, tmp_disk, owner)[0]


def _directives_and_rule(
    typed: TesTask,
    config: Config,
    layout: TaskLayout,
    tmp_disk: TmpDisk | None,
    owner: str | None,
) -> tuple[list[str], SiteRule | None]:
    """The `#SBATCH` options and the site rule they took (its prologue goes into the script)."""
    task_dir = str(layout.task_dir)
    if not _SBATCH_PATH.fullmatch(task_dir):
        raise RenderError(
            f"the task directory {task_dir!r} holds characters sbatch cannot take in a "
            "directive; choose a plainer job.work_dir"
        )
    values = _backend_values(typed.resources, config)
    _with_defaults(values, typed.resources, config)
    _resource_values(values, typed.resources, config, tmp_disk)
    directives = [
        f"--job-name={job_name(typed.id)}",
        f"--output={layout.slurm_output}",
        f"--chdir={task_dir}",
        # Each attempt is its own TES log entry: the poller, not Slurm, decides to run again.
        "--no-requeue",
    ]
    directives += [f"{opt}={values[key]}" for key, opt in SBATCH_OPTIONS.items() if key in values]
    if "gpus_per_task" in values:
        # sbatch takes --gpus-per-task only with a task count; the job is one task.
        directives.append("--ntasks=1")
    rule = site_rule(typed, values.get("partition"), config, owner)
    if rule is not None:
        directives.extend(rule.directives)
    directives.extend(config.slurm.extra_directives)
    for line in directives:
        if "\n" in line or "\r" in line:
            raise RenderError(f"slurm.extra_directives: {line!r} spans several lines")
    return directives, rule


# --------------------------------------------------------------------------- bind mounts


@dataclass(frozen=True)
class Bind:
    host: str
    container: str
    readonly: bool
    #: The host side is root/<container> (False for inputs bound from the shared filesystem).
    uniform: bool = True
    #: The container side is a file (a FILE input), not a directory: how its mount point is made.
    file: bool = field(default=False, compare=False)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


@dataclass(frozen=True)
class BindPlan:
    binds: list[Bind]
    #: Container directories stage-in creates under root/ (sources of read-write binds).
    mkdirs: list[str]
    #: Inputs bound straight from the shared filesystem (file_input_mode "bind").
    bound_inputs: list[int]
    #: Inputs that may be hardlinked (file_input_mode "hardlink"): those that stay read-only.
    linkable_inputs: list[int]
    #: Of /tmp and /var/tmp, those that get the attempt's disk-backed scratch directory: each
    #: one the task mounts nothing at or above.
    scratch_targets: list[str]
    #: Binds inside a scratch target (shared directories, the task's inputs, outputs and
    #: volumes): bound after the scratch binds, on mount points (relative to the attempt's
    #: scratch directory) the job script makes: directories, and empty files for FILE inputs.
    after_scratch: list[Bind]
    scratch_mountpoints: list[str]
    scratch_mountfiles: list[str]
    #: file:// inputs and outputs whose container path is their own host path inside a shared
    #: directory: the shared bind already shows them, so they are neither staged nor bound.
    in_place_inputs: list[int]
    in_place_outputs: list[int]


class _BindCollector:
    """The binds a task asks for, in the order `compute_binds` collects them."""

    def __init__(self, config: Config, layout: TaskLayout) -> None:
        self.config = config
        self.layout = layout
        self.shared = shared_dirs(config)
        self.wanted = [Bind(d, d, False, uniform=False) for d in self.shared]
        self.in_place_inputs: list[int] = []
        self.in_place_outputs: list[int] = []
        self.bound: list[int] = []
        self.linkable: list[int] = []

    def uniform(self, path: str, readonly: bool, file: bool = False) -> Bind:
        return Bind(str(self.layout.host_path(path)), path, readonly, file=file)

    def rw_dir(self, path: str, where: str) -> None:
        if _reserved(path):
            raise RenderError(f"{where}: {path!r} cannot be mounted in the container")
        self.wanted.append(self.uniform(path, False))

    def outputs(self, outputs: list[OutputModel]) -> None:
        """The parent directory of each output, each DIRECTORY output, read-write."""
        for i, item in enumerate(outputs):
            where = f"outputs[{i}].path"
            path = _path(item.path, where)
            if _in_place(item.url, None, path, self.config):
                self.in_place_outputs.append(i)
            elif has_wildcards(path):
                self.rw_dir(static_dir(path), where)
            elif item.type == FileType.DIRECTORY:
                self.rw_dir(path, where)
            else:
                self.rw_dir(_parent(path), f"{where} (its directory)")

    def executors(self, executors: list[ExecutorModel]) -> None:
        """The parent directory of each stdout and stderr, read-write."""
        for i, executor in enumerate(executors):
            for key, value in (("stdout", executor.stdout), ("stderr", executor.stderr)):
                if value is not None:
                    parent = _parent(_path(value, f"executors[{i}].{key}"))
                    if not _reserved(parent):  # e.g. /dev/null: the host file is enough
                        self.wanted.append(self.uniform(parent, False))
            if executor.stdin is not None:
                _path(executor.stdin, f"executors[{i}].stdin")

    def inputs(self, inputs: list[InputModel]) -> None:
        """Each input read-only: bound from the shared filesystem, or staged into root/."""
        writable = [b.container for b in self.wanted]
        staged: list[tuple[int, Bind, InputModel]] = []
        for i, item in enumerate(inputs):
            path = _path(item.path, f"inputs[{i}].path")
            if _reserved(path):
                raise RenderError(f"inputs[{i}].path: {path!r} cannot be mounted in the container")
            if _in_place(item.url, item.content, path, self.config):
                self.in_place_inputs.append(i)
            else:
                is_file = item.type != FileType.DIRECTORY
                staged.append((i, self.uniform(path, True, file=is_file), item))
        for i, bind, item in staged:
            path = bind.container
            source = _shared_source(item, self.config)
            # Bound straight from the shared filesystem only where no other mount goes inside.
            if source and not self._mounts_inside(path, writable, staged, i):
                self.wanted.append(Bind(source, path, True, uniform=False, file=bind.file))
                self.bound.append(i)
                continue
            # A hardlink shares its inode with the file in the allowed directory: only where
            # the input stays read-only (no read-write mount around or inside it).
            if not any(_under(path, p) or _under(p, path) for p in writable):
                self.linkable.append(i)
            self.wanted.append(bind)

    @staticmethod
    def _mounts_inside(
        path: str, writable: list[str], staged: list[tuple[int, Bind, InputModel]], index: int
    ) -> bool:
        """Whether a read-write bind or another input lies at or below input `index`."""
        return any(_under(p, path) for p in writable) or any(
            j != index and _under(b.container, path) for j, b, _ in staged
        )

    def kept(self) -> list[Bind]:
        """The binds without those visible through an outer one: parents before children;
        for one path, read-write before read-only."""
        ordered = sorted(
            self.wanted, key=lambda b: (len(relative_parts(b.container)), b.container, b.readonly)
        )
        keep: list[Bind] = []
        seen: set[Bind] = set()
        #: Container path -> whether a kept uniform bind there is read-write.
        uniform_at: dict[str, bool] = {}
        for bind in ordered:
            # Covered: a kept uniform bind at the same path or above, read-write or as
            # read-only as this one (a lookup per ancestor, not a scan of all kept binds).
            covered = bind.uniform and any(
                uniform_at[outer] or bind.readonly
                for outer in _ancestors(bind.container)
                if outer in uniform_at
            )
            if not covered and bind not in seen:
                keep.append(bind)
                seen.add(bind)
                if bind.uniform:
                    uniform_at[bind.container] = uniform_at.get(bind.container, False) or (
                        not bind.readonly
                    )
        return keep

    def scratch_targets(self) -> list[str]:
        """/tmp and /var/tmp where nothing is mounted at or above them: what is mounted below
        goes on top of the scratch bind."""
        return [
            target
            for target in SCRATCH_TARGETS
            if not any(_under(target, b.container) for b in self.wanted)
        ]


def compute_binds(
    task: dict[str, Any] | TesTask, *, config: Config, layout: TaskLayout
) -> BindPlan:
    """Bind mounts shared by all executors of a task, and what stage-in must prepare for them.

    As in Funnel: inputs read-only one by one, the parent directory of each output, each
    DIRECTORY output, each volume and each stdout/stderr parent read-write; a bind inside a
    read-write bind of the same tree is dropped (it is visible through the outer one).
    Each of `storage.shared_dirs` is bound read-write at its own path, before anything the
    task mounts inside it; a file:// input or output at its own path inside one is left there.
    """
    model = parse_task(task).model
    collect = _BindCollector(config, layout)
    collect.outputs(model.outputs or [])
    for i, volume in enumerate(model.volumes or []):
        collect.rw_dir(_path(volume, f"volumes[{i}]"), f"volumes[{i}]")
    collect.executors(model.executors)
    collect.inputs(model.inputs or [])
    keep = collect.kept()
    scratch = collect.scratch_targets()
    # What lies below /tmp or /var/tmp (a shared /var/tmp/project, an input at /tmp/in/x) is
    # mounted on top of the attempt's scratch bind there, so the rest of /tmp stays on disk;
    # its mount point is made by the job in the scratch directory (kept order: parents first).
    nested = [(b, t) for b in keep for t in scratch if _under(b.container, t)]
    mountpoints = {b.container: SCRATCH_TARGETS[t] + b.container[len(t) :] for b, t in nested}
    files = [mountpoints[b.container] for b, _ in nested if b.file]
    return BindPlan(
        binds=[b for b in keep if b.container not in mountpoints],
        after_scratch=[b for b, _ in nested],
        scratch_mountpoints=sorted({_parent(m) if m in files else m for m in mountpoints.values()}),
        scratch_mountfiles=sorted(set(files)),
        scratch_targets=scratch,
        mkdirs=sorted({b.container for b in keep if b.uniform and not b.readonly}),
        bound_inputs=collect.bound,
        linkable_inputs=collect.linkable if config.storage.file_input_mode == "hardlink" else [],
        in_place_inputs=collect.in_place_inputs,
        in_place_outputs=collect.in_place_outputs,
    )


def shared_dirs(config: Config) -> list[str]:
    return [str(d) for d in config.storage.shared_dirs]


def _is_file_url(url: str | None) -> TypeGuard[str]:
    return isinstance(url, str) and is_local_url(url)


def _in_place(url: str | None, content: str | None, path: str, config: Config) -> bool:
    """A file:// input or output whose container `path` is its own host path inside a shared
    directory (judged lexically: the executor sees exactly that path through the shared bind)."""
    if not _is_file_url(url) or content or has_wildcards(path):
        return False
    try:
        host = local_path(url)
    except FileUrlError:
        return False  # stage-in or stage-out reports the reason in system_logs
    return host == path and any(_under(path, d) for d in shared_dirs(config))


def _shared_source(item: InputModel, config: Config) -> str | None:
    """With file_input_mode "bind" (or staging.streamable_bind and a `streamable` input): the
    allowed host path of a file:// input, else None."""
    streamed = config.staging.streamable_bind and item.streamable is True
    if not (config.storage.file_input_mode == "bind" or streamed) or item.content:
        return None
    if not _is_file_url(item.url):
        return None
    from bridge.job.staging import StagingContext, StagingError
    from bridge.job.staging.file import allowed_path

    ctx = StagingContext(allowed_dirs=config.file_dirs)
    try:
        return str(allowed_path(item.url, ctx))
    except StagingError:
        return None  # stage-in reports the reason in system_logs


def _csv_field(text: str) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow([text])
    return out.getvalue()


def bind_args(binds: Iterable[Bind]) -> list[str]:
    """Runtime flags for the binds: `--bind h:c[:ro]`, or `--mount` (CSV-quoted) when a path
    holds `:` or `,`, which `--bind` takes as separators."""
    args: list[str] = []
    for bind in binds:
        if any(ch in bind.host + bind.container for ch in ':,\n\r"'):
            fields = ["type=bind", f"source={bind.host}", f"destination={bind.container}"]
            if bind.readonly:
                fields.append("ro")
            args += ["--mount", ",".join(_csv_field(f) for f in fields)]
        else:
            args += ["--bind", f"{bind.host}:{bind.container}" + (":ro" if bind.readonly else "")]
    return args


# --------------------------------------------------------------------------- executors


#: Without `--no-eval`, Apptainer and Singularity write each APPTAINERENV_X value into
#: `export X="value"` and source it inside the container (escaping `"` themselves): `$`,
#: backquote and backslash would be evaluated there, so they get one level of escaping.
_ENV_EVAL_SPECIAL = re.compile(r"[\\$`]")


def _env_prefix(runtime: str) -> str:
    return "SINGULARITYENV_" if "singularity" in os.path.basename(runtime) else "APPTAINERENV_"


@dataclass(frozen=True)
class _RuntimeFlags:
    """The runtime flags every executor of a task shares."""

    binds: list[str]
    scratch_targets: list[str]
    after_scratch: list[str]
    #: container.gpu_flag for a task that asks for GPUs, else nothing.
    gpu: list[str]


def _call(
    index: int, executor: ExecutorModel, sif: str, config: Config, flags: _RuntimeFlags
) -> list[str]:
    """The runtime command line, one group of words per line of the script for a reader."""
    runtime = config.container.runtime
    groups = [
        [runtime, *config.container.global_flags, "exec", *config.container.exec_flags],
        config.container.isolation_flags,
        config.container.extra_flags,
        flags.gpu,
    ]
    groups += [flags.binds[i : i + 2] for i in range(0, len(flags.binds), 2)]
    groups.append(_home_flags(executor))
    if executor.workdir is not None:
        groups.append(["--pwd", _path(executor.workdir, f"executors[{index}].workdir")])
    groups += [[sif], list(executor.command)]
    call = [" ".join(shlex.quote(arg) for arg in group) for group in groups if group]
    # The scratch directory is made by the job on the node: the script expands $EXEC_TMP (its
    # path is checked there for the `:` and `,` that --bind takes as separators).
    scratch = [
        f'--bind "$EXEC_TMP/{SCRATCH_TARGETS[target]}:{target}"' for target in flags.scratch_targets
    ]
    after = [
        " ".join(map(shlex.quote, flags.after_scratch[i : i + 2]))
        for i in range(0, len(flags.after_scratch), 2)
    ]
    call[-2:-2] = scratch + after
    return call


def _home_flags(executor: ExecutorModel) -> list[str]:
    """`env.HOME` (cwl-tes sends the output directory) as the runtime takes it: Apptainer
    refuses APPTAINERENV_HOME, and `--home DIR` alone binds the host's DIR into the container;
    with `--no-home` it only sets $HOME (an absolute path without ':', checked by the model)."""
    home = (executor.env or {}).get("HOME")
    return [] if home is None else ["--no-home", "--home", home]


def _env_assignments(executor: ExecutorModel, config: Config) -> list[str]:
    prefix = _env_prefix(config.container.runtime)
    evaluated = "--no-eval" not in [*config.container.exec_flags, *config.container.extra_flags]
    assignments = []
    for name, value in (executor.env or {}).items():
        if name == "HOME":
            continue  # passed as --home (see _home_flags)
        if evaluated:
            value = _ENV_EVAL_SPECIAL.sub(r"\\\g<0>", value)
        assignments.append(f"{prefix}{name}={shlex.quote(value)}")
    return assignments


def _executor_context(
    index: int,
    executor: ExecutorModel,
    *,
    config: Config,
    flags: _RuntimeFlags,
    image_paths: dict[str, str],
) -> dict[str, Any]:
    sif = image_paths.get(executor.image)
    if not sif:
        raise RenderError(
            f"executors[{index}].image: no local image for {executor.image!r} (not pulled yet)"
        )
    return {
        "index": index,
        "ignore_error": executor.ignore_error is True,
        "env": _env_assignments(executor, config),
        "call": _call(index, executor, sif, config, flags),
        # Stdio only in the records (or discarded): the job script redirects it itself and
        # runs the runtime without the Python wrapper, which opens a task's own stdio paths
        # without following links (bridge.job.execute).
        "direct": all(
            path in (None, os.devnull)
            for path in (executor.stdin, executor.stdout, executor.stderr)
        ),
        "stdout_null": executor.stdout == os.devnull,
        "stderr_null": executor.stderr == os.devnull,
    }


# --------------------------------------------------------------------------- templates


def _template_dirs(config: Config) -> list[str]:
    dirs = []
    if config.job.template_dir:
        dirs.append(str(config.job.template_dir))
    packaged = Path(bridge.__file__).parent / "templates"
    repository = Path(bridge.__file__).parent.parent / "templates"
    dirs.append(str(packaged if (packaged / TEMPLATE).is_file() else repository))
    return dirs


@lru_cache(maxsize=8)
def _environment(dirs: tuple[str, ...]) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(list(dirs)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["shquote"] = lambda value: shlex.quote(str(value))
    return env


def render_script(
    task: dict[str, Any] | TesTask,
    *,
    config: Config,
    task_dir: Path,
    image_paths: dict[str, str],
    tmp_disk: TmpDisk | None = None,
    plan: BindPlan | None = None,
    owner: str | None = None,
) -> str:
    """The job script for `task`; raises RenderError when a task value cannot be used.
    `plan`: the task's `compute_binds`, when the caller has it already; `owner`: the task's
    owner (for `slurm.rules` on Unix groups)."""
    typed = parse_task(task)
    layout = TaskLayout(task_dir)
    directives, rule = _directives_and_rule(typed, config, layout, tmp_disk, owner)
    plan = plan or compute_binds(typed, config=config, layout=layout)
    gpus = backend_params.wants_gpus(typed.resources.backend_parameters)
    flags = _RuntimeFlags(
        binds=bind_args(plan.binds),
        scratch_targets=plan.scratch_targets,
        after_scratch=bind_args(plan.after_scratch),
        gpu=[config.container.gpu_flag] if gpus else [],
    )
    executors = [
        _executor_context(i, ex, config=config, flags=flags, image_paths=image_paths)
        for i, ex in enumerate(typed.model.executors)
    ]
    context = {
        "directives": directives,
        "task_dir": str(layout.task_dir),
        "python": config.job.python,
        "runtime": config.container.runtime,
        "job_module": JOB_MODULE,
        "prologue": config.slurm.prologue + ("\n" + rule.prologue if rule else ""),
        "epilogue": config.slurm.epilogue,
        "scratch_dir": str(config.job.scratch_dir or ""),
        "scratch_prefix": f"tes-tmp-{typed.id}",
        "scratch_mountpoints": plan.scratch_mountpoints,
        "scratch_mountfiles": plan.scratch_mountfiles,
        "gpu_environment": list(GPU_ENVIRONMENT) if gpus else [],
        "memory_asked": _memory_asked(typed.resources.ram_gb),
        "refuse_root": not config.container.allow_root,
        # Nothing to fetch or upload: the script prepares the task directory itself instead of
        # starting Python for `stage-in` and `stage-out`.
        "stage_in_shell": not typed.model.inputs and not typed.model.outputs,
        "has_outputs": bool(typed.model.outputs),
        "mkdirs": plan.mkdirs,
        # Known for every executor: building `executors` above checked that.
        "images": sorted(set(image_paths[ex.image] for ex in typed.model.executors)),
        "env_prefix": _env_prefix(config.container.runtime),
        "executor_umask": config.container.umask,
        "executors": executors,
    }
    template = _environment(tuple(_template_dirs(config))).get_template(TEMPLATE)
    return template.render(context)


def job_settings(
    task: dict[str, Any] | TesTask,
    *,
    config: Config,
    task_dir: Path,
    image_paths: dict[str, str],
    plan: BindPlan | None = None,
) -> JobSettings:
    """What the job side needs from the configuration (written as job-config.json)."""
    typed = parse_task(task)
    plan = plan or compute_binds(typed, config=config, layout=TaskLayout(task_dir))
    return JobSettings(
        task_id=typed.id,
        runtime=config.container.runtime,
        allowed_dirs=[str(d) for d in config.file_dirs],
        file_input_mode=config.storage.file_input_mode,
        log_tail_bytes=config.job.log_tail_bytes,
        images=sorted(set(image_paths[ex.image] for ex in typed.model.executors)),
        mkdirs=plan.mkdirs,
        bound_inputs=plan.bound_inputs,
        linkable_inputs=plan.linkable_inputs,
        in_place_inputs=plan.in_place_inputs,
        in_place_outputs=plan.in_place_outputs,
        allow_root=config.container.allow_root,
        missing_outputs=config.storage.missing_outputs,
        staging=config.staging.job_options(),
    )


def prepare_task_dir(
    task: dict[str, Any],
    *,
    config: Config,
    image_paths: dict[str, str],
    tmp_disk: TmpDisk | None = None,
    owner: str | None = None,
) -> Path:
    """Create `<work_dir>/<task id>/` with task.json, job-config.json and job.sh.

    Returns the script's path. Renders first, so a RenderError leaves nothing behind.
    """
    typed = parse_task(task)
    layout = TaskLayout(config.work_dir / typed.id)
    files = task_files(
        typed, config=config, image_paths=image_paths, tmp_disk=tmp_disk, owner=owner
    )
    config.work_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    # 0700: task documents can carry secrets (env values, content) and outputs.
    layout.task_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(layout.task_dir, 0o700)
    layout.tmp.mkdir(mode=0o700, exist_ok=True)
    write_atomically(layout.task_json, files[layout.task_json.name], 0o600)
    write_atomically(layout.job_config, files[layout.job_config.name], 0o600)
    write_atomically(layout.script, files[layout.script.name], 0o700)
    return layout.script


def task_files(
    task: dict[str, Any] | TesTask,
    *,
    config: Config,
    image_paths: dict[str, str],
    tmp_disk: TmpDisk | None = None,
    owner: str | None = None,
) -> dict[str, str]:
    """The texts of task.json, job-config.json and job.sh for `<work_dir>/<task id>/`.

    Site mode hands them to `bridge.job adopt`, which writes them as the task's owner.
    """
    typed = parse_task(task)
    layout = TaskLayout(config.work_dir / typed.id)
    plan = compute_binds(typed, config=config, layout=layout)
    script = render_script(
        typed,
        config=config,
        task_dir=layout.task_dir,
        image_paths=image_paths,
        tmp_disk=tmp_disk,
        plan=plan,
        owner=owner,
    )
    settings = job_settings(
        typed, config=config, task_dir=layout.task_dir, image_paths=image_paths, plan=plan
    )
    return {
        layout.task_json.name: json.dumps(typed.document, ensure_ascii=True) + "\n",
        layout.job_config.name: settings.to_json(),
        layout.script.name: script,
    }
