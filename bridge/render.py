"""The sbatch script of a task: every decision in Python, the template only lays it out.

`render_script` turns a stored task (TES wire format, validated by the API but with hostile
values) into a bash script; `prepare_task_dir` writes it, the task document and the job-side
settings into the task directory (see bridge.job.layout). Every value that comes from the task
reaches the script through `shlex.quote`; values that go into `#SBATCH` lines (which sbatch
parses with its own rules) must match strict patterns instead, or rendering fails with a
`RenderError` naming the field, which the poller records as a SYSTEM_ERROR.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

import bridge
from bridge.config import Config
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
from bridge.naming import is_task_id, job_name
from bridge.slurm import TmpDisk

TEMPLATE = "job.sh.j2"
JOB_MODULE = "bridge.job"


class RenderError(ValueError):
    """The task cannot be turned into a job script; the message names the field."""


# --------------------------------------------------------------------------- validation

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_TIME_LIMIT = re.compile(
    r"^(?:\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}"
    r"|\d+-\d{1,2}:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE)$"
)
_GRES = re.compile(r"^[A-Za-z0-9_:,.-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_&|,.()\[\]*:!-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Characters sbatch reads in an `#SBATCH` value without surprises (for the task directory).
_SBATCH_PATH = re.compile(r"^/[A-Za-z0-9_./+,:=@~-]*$")

#: backend_parameters key -> (sbatch option, pattern its value must match).
BACKEND_PARAMETERS: dict[str, tuple[str, re.Pattern[str]]] = {
    "partition": ("--partition", _NAME),
    "account": ("--account", _NAME),
    "qos": ("--qos", _NAME),
    "time_limit": ("--time", _TIME_LIMIT),
    "gres": ("--gres", _GRES),
    "gpus": ("--gpus", _GRES),
    "constraint": ("--constraint", _CONSTRAINT),
    "reservation": ("--reservation", _NAME),
}

#: Container paths that cannot be bind targets: the runtime owns them.
_RESERVED = ("/proc", "/sys", "/dev")

#: Bound from the attempt's scratch directory on disk: with `--contain` the runtime would
#: otherwise give the container a RAM tmpfs there, charged to the job's memory.
#: container path -> subdirectory of the scratch directory (see templates/job.sh.j2).
SCRATCH_TARGETS = {"/tmp": "tmp", "/var/tmp": "var-tmp"}


def _text(value: Any, where: str) -> str:
    """A task string that can be written into the script (UTF-8, no NUL)."""
    if not isinstance(value, str):
        raise RenderError(f"{where}: expected a string")
    if "\0" in value:
        raise RenderError(f"{where}: contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RenderError(f"{where}: is not valid Unicode (lone surrogate)") from None
    return value


def _path(value: Any, where: str) -> str:
    try:
        return check_container_path(_text(value, where))
    except LayoutError as exc:
        raise RenderError(f"{where}: {exc}") from None


def _under(path: str, parent: str) -> bool:
    return parent == "/" or path == parent or path.startswith(parent + "/")


def _reserved(path: str) -> bool:
    return path == "/" or any(_under(path, r) for r in _RESERVED)


def _megabytes(gigabytes: Any, where: str) -> int | None:
    """GB (TES) -> MB (Slurm) rounded up; 0 or absent -> None (never `--mem=0`: all memory)."""
    if gigabytes is None:
        return None
    if isinstance(gigabytes, bool) or not isinstance(gigabytes, int | float):
        raise RenderError(f"{where}: expected a number")
    if not math.isfinite(gigabytes) or gigabytes < 0:
        raise RenderError(f"{where}: must be a non-negative number")
    if gigabytes == 0:
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
    return f"--tmp={megabytes}"


def sbatch_directives(
    task: dict[str, Any], *, config: Config, layout: TaskLayout, tmp_disk: TmpDisk | None = None
) -> list[str]:
    """The `#SBATCH` options (without the prefix), site directives last. `tmp_disk` is what
    the poller learned of the nodes' TmpDisk (see `disk_directive`)."""
    task_id = task.get("id")
    if not is_task_id(task_id):
        raise RenderError(f"id: {task_id!r} is not a valid task id")
    task_dir = str(layout.task_dir)
    if not _SBATCH_PATH.fullmatch(task_dir):
        raise RenderError(
            f"the task directory {task_dir!r} holds characters sbatch cannot take in a "
            "directive; choose a plainer job.work_dir"
        )
    resources = task.get("resources") or {}
    if not isinstance(resources, dict):
        raise RenderError("resources: expected an object")
    params = resources.get("backend_parameters") or {}
    if not isinstance(params, dict):
        raise RenderError("resources.backend_parameters: expected an object")

    values: dict[str, str] = {}
    for key, raw in params.items():
        key = str(key).lower()
        if key not in BACKEND_PARAMETERS:
            continue  # the API already dropped keys the deployment does not support
        where = f"resources.backend_parameters.{key}"
        value = _text(raw, where)
        pattern = BACKEND_PARAMETERS[key][1]
        if not pattern.fullmatch(value):
            raise RenderError(f"{where}: invalid value {value!r}")
        values[key] = value

    preemptible = resources.get("preemptible") is True
    zones = resources.get("zones") or []
    if "partition" in values:
        values["partition"] = _partition(
            values["partition"], "resources.backend_parameters.partition", config
        )
    elif zones:
        if not isinstance(zones, list):
            raise RenderError("resources.zones: expected a list")
        names = [
            _partition(_text(z, f"resources.zones[{i}]"), f"resources.zones[{i}]", config)
            for i, z in enumerate(zones)
        ]
        values["partition"] = ",".join(dict.fromkeys(names))
    elif preemptible and config.slurm.preemptible_partition:
        values["partition"] = config.slurm.preemptible_partition
    elif config.slurm.default_partition:
        values["partition"] = config.slurm.default_partition
    if "qos" not in values and preemptible and config.slurm.preemptible_qos:
        values["qos"] = config.slurm.preemptible_qos
    if "time_limit" not in values and config.slurm.default_time_limit:
        values["time_limit"] = config.slurm.default_time_limit

    directives = [
        f"--job-name={job_name(task_id)}",
        f"--output={layout.slurm_output}",
        f"--chdir={task_dir}",
        # Each attempt is its own TES log entry: the poller, not Slurm, decides to run again.
        "--no-requeue",
    ]
    for key in ("partition", "qos", "account", "time_limit"):
        if key in values:
            directives.append(f"{BACKEND_PARAMETERS[key][0]}={values[key]}")
    cpu = resources.get("cpu_cores")
    if cpu is not None:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            raise RenderError("resources.cpu_cores: must be a non-negative integer")
        if cpu > 0:  # 0 (which TES allows) means "no request", like an absent value
            directives.append(f"--cpus-per-task={cpu}")
    mem = _megabytes(resources.get("ram_gb"), "resources.ram_gb")
    if mem is not None:
        directives.append(f"--mem={mem}")
    disk = _megabytes(resources.get("disk_gb"), "resources.disk_gb")
    partitions = values["partition"].split(",") if "partition" in values else []
    tmp = disk_directive(disk, partitions, config, tmp_disk)
    if tmp is not None:
        directives.append(tmp)
    for key in ("gres", "gpus", "constraint", "reservation"):
        if key in values:
            directives.append(f"{BACKEND_PARAMETERS[key][0]}={values[key]}")
    directives.extend(config.slurm.extra_directives)
    for line in directives:
        if "\n" in line or "\r" in line:
            raise RenderError(f"slurm.extra_directives: {line!r} spans several lines")
    return directives


# --------------------------------------------------------------------------- bind mounts


@dataclass(frozen=True)
class Bind:
    host: str
    container: str
    readonly: bool
    #: The host side is root/<container> (False for inputs bound from the shared filesystem).
    uniform: bool = True


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
    #: one the task mounts nothing at, under or above.
    scratch_targets: list[str]
    #: Shared directories inside a scratch target: bound after the scratch binds, on mount
    #: points (relative to the attempt's scratch directory) the job script makes.
    after_scratch: list[Bind]
    scratch_mountpoints: list[str]
    #: file:// inputs and outputs whose container path is their own host path inside a shared
    #: directory: the shared bind already shows them, so they are neither staged nor bound.
    in_place_inputs: list[int]
    in_place_outputs: list[int]


def compute_binds(task: dict[str, Any], *, config: Config, layout: TaskLayout) -> BindPlan:
    """Bind mounts shared by all executors of a task, and what stage-in must prepare for them.

    As in Funnel: inputs read-only one by one, the parent directory of each output, each
    DIRECTORY output, each volume and each stdout/stderr parent read-write; a bind inside a
    read-write bind of the same tree is dropped (it is visible through the outer one).
    Each of `storage.shared_dirs` is bound read-write at its own path, before anything the
    task mounts inside it; a file:// input or output at its own path inside one is left there.
    """
    wanted: list[Bind] = [Bind(str(d), str(d), False, uniform=False) for d in shared_dirs(config)]
    in_place_outputs: list[int] = []
    in_place_inputs: list[int] = []

    def uniform(path: str, readonly: bool) -> Bind:
        return Bind(str(layout.host_path(path)), path, readonly)

    def rw_dir(path: str, where: str) -> None:
        if _reserved(path):
            raise RenderError(f"{where}: {path!r} cannot be mounted in the container")
        wanted.append(uniform(path, False))

    for i, item in enumerate(task.get("outputs") or []):
        path = _path(item.get("path"), f"outputs[{i}].path")
        if _in_place(item, path, config):
            in_place_outputs.append(i)
        elif has_wildcards(path):
            rw_dir(static_dir(path), f"outputs[{i}].path")
        elif (item.get("type") or "FILE") == "DIRECTORY":
            rw_dir(path, f"outputs[{i}].path")
        else:
            rw_dir(_parent(path), f"outputs[{i}].path (its directory)")
    for i, volume in enumerate(task.get("volumes") or []):
        rw_dir(_path(volume, f"volumes[{i}]"), f"volumes[{i}]")
    for i, executor in enumerate(task.get("executors") or []):
        for key in ("stdout", "stderr"):
            if executor.get(key) is not None:
                parent = _parent(_path(executor[key], f"executors[{i}].{key}"))
                if not _reserved(parent):  # e.g. /dev/null: the host file is enough
                    wanted.append(uniform(parent, False))
        if executor.get("stdin") is not None:
            _path(executor["stdin"], f"executors[{i}].stdin")
    writable = [b.container for b in wanted]

    inputs: list[tuple[int, Bind, Any]] = []
    for i, item in enumerate(task.get("inputs") or []):
        path = _path(item.get("path"), f"inputs[{i}].path")
        if _reserved(path):
            raise RenderError(f"inputs[{i}].path: {path!r} cannot be mounted in the container")
        if _in_place(item, path, config):
            in_place_inputs.append(i)
            continue
        inputs.append((i, uniform(path, True), item.get("url")))

    bound: list[int] = []
    linkable: list[int] = []
    for i, bind, url in inputs:
        path = bind.container
        shared = _shared_source(task["inputs"][i], url, config)
        # Bound straight from the shared filesystem only where no other mount goes inside it.
        inside = [p for p in writable if _under(p, path)]
        inside += [b.container for j, b, _ in inputs if j != i and _under(b.container, path)]
        if shared and not inside:
            wanted.append(Bind(shared, path, True, uniform=False))
            bound.append(i)
            continue
        # A hardlink shares its inode with the file in the allowed directory: only where the
        # input stays read-only (no read-write mount around or inside it).
        if not any(_under(path, p) or _under(p, path) for p in writable):
            linkable.append(i)
        wanted.append(bind)

    # Parents before children; for one path, read-write before read-only.
    wanted.sort(key=lambda b: (len(relative_parts(b.container)), b.container, b.readonly))
    keep: list[Bind] = []
    for bind in wanted:
        covered = any(
            outer.uniform
            and bind.uniform
            and _under(bind.container, outer.container)
            and (not outer.readonly or bind.readonly)
            for outer in keep
        )
        if not covered and bind not in keep:
            keep.append(bind)
    shared = shared_dirs(config)
    task_paths = [b.container for b in wanted if b.container not in shared or b.uniform]
    scratch = [
        target
        for target in SCRATCH_TARGETS
        if not any(_under(p, target) or _under(target, p) for p in task_paths)
        and not any(_under(target, d) for d in shared)
    ]
    # A shared directory below /tmp or /var/tmp (e.g. /var/tmp/project) is mounted on top of
    # the attempt's scratch bind there, on a mount point the job makes in the scratch directory.
    nested = [
        (b, target)
        for b in keep
        for target in scratch
        if not b.uniform and b.container in shared and _under(b.container, target)
    ]
    return BindPlan(
        binds=[b for b in keep if b not in [n for n, _ in nested]],
        after_scratch=[b for b, _ in nested],
        scratch_mountpoints=[
            SCRATCH_TARGETS[target] + b.container[len(target) :] for b, target in nested
        ],
        scratch_targets=scratch,
        mkdirs=sorted({b.container for b in keep if b.uniform and not b.readonly}),
        bound_inputs=bound,
        linkable_inputs=linkable if config.storage.file_input_mode == "hardlink" else [],
        in_place_inputs=in_place_inputs,
        in_place_outputs=in_place_outputs,
    )


def shared_dirs(config: Config) -> list[str]:
    return [str(d) for d in config.storage.shared_dirs]


def _in_place(item: dict[str, Any], path: str, config: Config) -> bool:
    """A file:// input or output whose container `path` is its own host path inside a shared
    directory (judged lexically: the executor sees exactly that path through the shared bind)."""
    url = item.get("url")
    if not isinstance(url, str) or not (url.startswith("/") or url[:5].lower() == "file:"):
        return False
    if isinstance(item.get("content"), str) and item["content"]:
        return False
    if has_wildcards(path):
        return False
    from bridge.job.staging import StagingError
    from bridge.job.staging.file import url_path

    try:
        host = url_path(url)
    except StagingError:
        return False  # stage-in or stage-out reports the reason in system_logs
    return host == path and any(_under(path, d) for d in shared_dirs(config))


def _shared_source(item: dict[str, Any], url: Any, config: Config) -> str | None:
    """With file_input_mode "bind" (or staging.streamable_bind and a `streamable` input): the
    allowed host path of a file:// input, else None."""
    streamed = config.staging.streamable_bind and item.get("streamable") is True
    if not (config.storage.file_input_mode == "bind" or streamed) or not isinstance(url, str):
        return None
    if isinstance(item.get("content"), str) and item["content"]:
        return None
    if not (url.startswith("/") or url[:5].lower() == "file:"):
        return None
    from bridge.job.staging import StagingContext, StagingError
    from bridge.job.staging.file import allowed_path

    ctx = StagingContext(allowed_dirs=config.file_dirs)
    try:
        return str(allowed_path(url, ctx))
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


def _executor_context(
    index: int,
    executor: dict[str, Any],
    *,
    config: Config,
    binds: list[str],
    scratch_targets: list[str],
    after_scratch: list[str],
    image_paths: dict[str, str],
) -> dict[str, Any]:
    where = f"executors[{index}]"
    image = _text(executor.get("image"), f"{where}.image")
    sif = image_paths.get(image)
    if not sif:
        raise RenderError(f"{where}.image: no local image for {image!r} (not pulled yet)")
    command = executor.get("command")
    if not isinstance(command, list) or not command:
        raise RenderError(f"{where}.command: expected a non-empty list")
    argv = [_text(arg, f"{where}.command[{i}]") for i, arg in enumerate(command)]
    runtime = config.container.runtime
    # One group of words per line of the script, for a reader of job.sh.
    global_flags = config.container.global_flags
    groups = [
        [runtime, *global_flags, "exec", *config.container.exec_flags],
        config.container.isolation_flags,
        config.container.extra_flags,
    ]
    groups += [binds[i : i + 2] for i in range(0, len(binds), 2)]
    if executor.get("workdir") is not None:
        groups.append(["--pwd", _path(executor["workdir"], f"{where}.workdir")])
    groups += [[sif], argv]
    call = [" ".join(shlex.quote(arg) for arg in group) for group in groups if group]
    # The scratch directory is made by the job on the node: the script expands $EXEC_TMP (its
    # path is checked there for the `:` and `,` that --bind takes as separators).
    scratch = [
        f'--bind "$EXEC_TMP/{SCRATCH_TARGETS[target]}:{target}"' for target in scratch_targets
    ]
    after = [
        " ".join(map(shlex.quote, after_scratch[i : i + 2]))
        for i in range(0, len(after_scratch), 2)
    ]
    call[-2:-2] = scratch + after
    env = executor.get("env") or {}
    if not isinstance(env, dict):
        raise RenderError(f"{where}.env: expected an object")
    assignments = []
    prefix = _env_prefix(runtime)
    evaluated = "--no-eval" not in [*config.container.exec_flags, *config.container.extra_flags]
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise RenderError(f"{where}.env: invalid variable name {name!r}")
        value = _text(value, f"{where}.env.{name}")
        if evaluated:
            value = _ENV_EVAL_SPECIAL.sub(r"\\\g<0>", value)
        assignments.append(f"{prefix}{name}={shlex.quote(value)}")
    return {
        "index": index,
        "ignore_error": executor.get("ignore_error") is True,
        "env": assignments,
        "call": call,
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
    task: dict[str, Any],
    *,
    config: Config,
    task_dir: Path,
    image_paths: dict[str, str],
    tmp_disk: TmpDisk | None = None,
) -> str:
    """The job script for `task`; raises RenderError when a task value cannot be used."""
    layout = TaskLayout(task_dir)
    directives = sbatch_directives(task, config=config, layout=layout, tmp_disk=tmp_disk)
    executors = task.get("executors")
    if not isinstance(executors, list) or not executors:
        raise RenderError("executors: expected a non-empty list")
    plan = compute_binds(task, config=config, layout=layout)
    flags = bind_args(plan.binds)
    context = {
        "directives": directives,
        "task_dir": str(layout.task_dir),
        "python": config.job.python,
        "runtime": config.container.runtime,
        "job_module": JOB_MODULE,
        "prologue": config.slurm.prologue,
        "epilogue": config.slurm.epilogue,
        "scratch_dir": str(config.job.scratch_dir or ""),
        "scratch_prefix": f"tes-tmp-{task['id']}",
        "scratch_mountpoints": plan.scratch_mountpoints,
        "executors": [
            _executor_context(
                i,
                ex,
                config=config,
                binds=flags,
                scratch_targets=plan.scratch_targets,
                after_scratch=bind_args(plan.after_scratch),
                image_paths=image_paths,
            )
            for i, ex in enumerate(executors)
        ],
    }
    template = _environment(tuple(_template_dirs(config))).get_template(TEMPLATE)
    return template.render(context)


def job_settings(
    task: dict[str, Any], *, config: Config, task_dir: Path, image_paths: dict[str, str]
) -> JobSettings:
    """What the job side needs from the configuration (written as job-config.json)."""
    plan = compute_binds(task, config=config, layout=TaskLayout(task_dir))
    return JobSettings(
        task_id=str(task["id"]),
        runtime=config.container.runtime,
        allowed_dirs=[str(d) for d in config.file_dirs],
        file_input_mode=config.storage.file_input_mode,
        log_tail_bytes=config.job.log_tail_bytes,
        images=sorted(set(image_paths[ex["image"]] for ex in task["executors"])),
        mkdirs=plan.mkdirs,
        bound_inputs=plan.bound_inputs,
        linkable_inputs=plan.linkable_inputs,
        in_place_inputs=plan.in_place_inputs,
        in_place_outputs=plan.in_place_outputs,
        allow_root=config.container.allow_root,
        staging=config.staging.job_options(),
    )


def prepare_task_dir(
    task: dict[str, Any],
    *,
    config: Config,
    image_paths: dict[str, str],
    tmp_disk: TmpDisk | None = None,
) -> Path:
    """Create `<work_dir>/<task id>/` with task.json, job-config.json and job.sh.

    Returns the script's path. Renders first, so a RenderError leaves nothing behind.
    """
    task_id = task.get("id")
    if not is_task_id(task_id):
        raise RenderError(f"id: {task_id!r} is not a valid task id")
    layout = TaskLayout(config.work_dir / task_id)
    files = task_files(task, config=config, image_paths=image_paths, tmp_disk=tmp_disk)
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
    task: dict[str, Any],
    *,
    config: Config,
    image_paths: dict[str, str],
    tmp_disk: TmpDisk | None = None,
) -> dict[str, str]:
    """The texts of task.json, job-config.json and job.sh for `<work_dir>/<task id>/`.

    Site mode hands them to `bridge.job adopt`, which writes them as the task's owner.
    """
    task_id = task.get("id")
    if not is_task_id(task_id):
        raise RenderError(f"id: {task_id!r} is not a valid task id")
    layout = TaskLayout(config.work_dir / task_id)
    script = render_script(
        task, config=config, task_dir=layout.task_dir, image_paths=image_paths, tmp_disk=tmp_disk
    )
    settings = job_settings(task, config=config, task_dir=layout.task_dir, image_paths=image_paths)
    return {
        layout.task_json.name: json.dumps(task, ensure_ascii=True) + "\n",
        layout.job_config.name: settings.to_json(),
        layout.script.name: script,
    }
