"""The sbatch script of a task: every decision in Python, the template only lays it out.

`render_script` puts a task's `#SBATCH` options (bridge.jobscript.directives), its bind mounts
(bridge.jobscript.binds) and each executor's runtime command line into templates/job.sh.j2;
`job_settings` is what the job side needs of the configuration; `prepare_task_dir` (or
`task_files`, for site mode) writes the script, the task document and those settings into the
task directory (see bridge.job.layout). Tasks come as stored TES documents, validated by the API
but with hostile values: every value from the task reaches the script through `shlex.quote`, and
one that cannot be used fails rendering with a `RenderError` naming the field
(bridge.jobscript.task), which the poller records as a SYSTEM_ERROR.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

import bridge
from bridge.config import Config
from bridge.core import backend_params, naming, reasons
from bridge.core.naming import (
    AFTER_ARG,
    LEASE_EPOCH_ARG,
    NO_RECORDS_EXIT_CODE,
    RUN_PART,
    SUPERSEDED_EXIT_CODE,
    WHOLE_PART,
)
from bridge.core.tes import ExecutorModel
from bridge.job.layout import (
    FENCED_PARTS,
    LEASE_FENCE,
    TaskLayout,
    lease_fence_name,
    write_atomically,
)
from bridge.job.settings import JobSettings
from bridge.job.stage import STAGE_NO_RECORDS
from bridge.jobscript.binds import SCRATCH_TARGETS, BindPlan, bind_args, compute_binds
from bridge.jobscript.directives import directives_and_rule
from bridge.jobscript.parts import PART_SCRIPTS, staged_apart, transfer_directives
from bridge.jobscript.task import RenderError, TesTask, container_path, parse_task
from bridge.slurm import NodeSizes

TEMPLATE = "job.sh.j2"
JOB_MODULE = "bridge.job"

#: Variables Slurm sets for a job's GPUs, passed into the executors of a task that asks for
#: GPUs (the runtime's --cleanenv drops the job's environment).
GPU_ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "SLURM_JOB_GPUS")
#: How the job script says that the task failed: its exit codes (what sacct shows) and the
#: system_logs lines that give a task its reason (bridge.core.reasons).
_ENDINGS: dict[str, object] = {
    "stage_in_exit_code": naming.STAGE_IN_EXIT_CODE,
    "scratch_exit_code": naming.SCRATCH_EXIT_CODE,
    "stage_out_exit_code": naming.STAGE_OUT_EXIT_CODE,
    "stage_no_records": STAGE_NO_RECORDS,
    "stage_in_failed": reasons.STAGE_IN_FAILED,
    "stage_out_failed": reasons.STAGE_OUT_FAILED,
    "image_unreadable": reasons.IMAGE_UNREADABLE,
    "oom_killed": reasons.OOM_KILLED,
}


def _memory_asked(ram_gb: float | None) -> str:
    """What the task asked for, for the job's out-of-memory message (digits only: JSON-safe)."""
    if not ram_gb:
        return "no resources.ram_gb: the cluster's default"
    return f"resources.ram_gb {ram_gb:g}"


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
        groups.append(["--pwd", container_path(executor.workdir, f"executors[{index}].workdir")])
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


def environment(config: Config) -> jinja2.Environment:
    """The templates' Jinja environment (job.template_dir first, then the packaged ones)."""
    return _environment(tuple(_template_dirs(config)))


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
    nodes: NodeSizes | None = None,
    plan: BindPlan | None = None,
    owner: str | None = None,
    part: str = WHOLE_PART,
) -> str:
    """The job script for `task`; raises RenderError when a task value cannot be used.
    `plan`: the task's `compute_binds`, when the caller has it already; `owner`: the task's
    owner (for `slurm.rules` on Unix groups); `part`: the part of a task staged on the
    transfer partition (bridge.jobscript.parts), else the whole task."""
    typed = parse_task(task)
    layout = TaskLayout(task_dir)
    directives, rule = directives_and_rule(typed, config, layout, nodes, owner)
    if part in PART_SCRIPTS:
        directives, rule = transfer_directives(typed, part, config, layout, owner), None
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
        "no_records_exit_code": NO_RECORDS_EXIT_CODE,
        "superseded_exit_code": SUPERSEDED_EXIT_CODE,
        **_ENDINGS,
        "lease_epoch_arg": LEASE_EPOCH_ARG,
        "after_arg": AFTER_ARG,
        "part": part,
        "lease_fence": LEASE_FENCE,
        "part_fence": lease_fence_name(part) if part in FENCED_PARTS else "",
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
    return environment(config).get_template(TEMPLATE).render(context)


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
        # A stage-in job on a transfer node: the task's job checks the runtime and images.
        check_runtime=not staged_apart(typed, config),
    )


def prepare_task_dir(
    task: dict[str, Any],
    *,
    config: Config,
    image_paths: dict[str, str],
    nodes: NodeSizes | None = None,
    owner: str | None = None,
) -> Path:
    """Create `<work_dir>/<task id>/` with task.json, job-config.json and job.sh.

    Returns the script's path. Renders first, so a RenderError leaves nothing behind.
    """
    typed = parse_task(task)
    layout = TaskLayout(config.work_dir / typed.id)
    files = task_files(typed, config=config, image_paths=image_paths, nodes=nodes, owner=owner)
    config.work_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    # 0700: task documents can carry secrets (env values, content) and outputs.
    layout.task_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(layout.task_dir, 0o700)
    layout.tmp.mkdir(mode=0o700, exist_ok=True)
    write_atomically(layout.task_json, files[layout.task_json.name], 0o600)
    write_atomically(layout.job_config, files[layout.job_config.name], 0o600)
    for name in (layout.script.name, *PART_SCRIPTS.values()):
        if name in files:
            write_atomically(layout.task_dir / name, files[name], 0o700)
    return layout.script


def task_files(
    task: dict[str, Any] | TesTask,
    *,
    config: Config,
    image_paths: dict[str, str],
    nodes: NodeSizes | None = None,
    owner: str | None = None,
) -> dict[str, str]:
    """The texts of task.json, job-config.json and job.sh for `<work_dir>/<task id>/`, and the
    scripts of its stage-in and stage-out jobs when it is staged on the transfer partition.

    Site mode hands them to `bridge.job adopt`, which writes them as the task's owner.
    """
    typed = parse_task(task)
    layout = TaskLayout(config.work_dir / typed.id)
    plan = compute_binds(typed, config=config, layout=layout)
    staged = staged_apart(typed, config)
    script = render_script(
        typed,
        config=config,
        task_dir=layout.task_dir,
        image_paths=image_paths,
        nodes=nodes,
        plan=plan,
        owner=owner,
        part=RUN_PART if staged else WHOLE_PART,
    )
    settings = job_settings(
        typed, config=config, task_dir=layout.task_dir, image_paths=image_paths, plan=plan
    )
    files = {
        layout.task_json.name: json.dumps(typed.document, ensure_ascii=True) + "\n",
        layout.job_config.name: settings.to_json(),
        layout.script.name: script,
    }
    if staged:
        for part, name in PART_SCRIPTS.items():
            files[name] = render_script(
                typed, config=config, task_dir=layout.task_dir, image_paths=image_paths,
                plan=plan, owner=owner, part=part,
            )  # fmt: skip
    return files
