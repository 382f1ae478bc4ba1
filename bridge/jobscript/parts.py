"""A task staged where the network is (`staging.where = "transfer"`): which tasks are, and the
`#SBATCH` options of their stage-in and stage-out jobs.

A task with an input or output that needs the network (any URL but a `file:` URL or bare path,
and content inputs, which have none) runs as a chain of three jobs, each rendered from
templates/job.sh.j2 with its part: the stage-in job on the transfer partition or QOS, the task's
own job (its resources, `--dependency=afterok:<stage-in>`), then the stage-out job on the
transfer partition (`afterok:<task's job>`). Every other task is one job, as with "job".
"""

from __future__ import annotations

from bridge.config import Config
from bridge.core.naming import STAGE_IN_PART, STAGE_OUT_PART, is_local_url, job_name, part_job_name
from bridge.job.layout import STAGE_IN_SCRIPT, STAGE_OUT_SCRIPT, TaskLayout
from bridge.jobscript.directives import directives_and_rule
from bridge.jobscript.task import TesTask

#: The job scripts of the transfer jobs, beside the task's own job.sh.
PART_SCRIPTS = {STAGE_IN_PART: STAGE_IN_SCRIPT, STAGE_OUT_PART: STAGE_OUT_SCRIPT}


def remote_urls(typed: TesTask) -> list[str]:
    """The task's input and output URLs that need the network, as field paths
    (`inputs[0].url`), in order."""
    urls = [("inputs", i, item.url) for i, item in enumerate(typed.model.inputs or ())]
    urls += [("outputs", i, item.url) for i, item in enumerate(typed.model.outputs or ())]
    return [f"{kind}[{i}].url" for kind, i, url in urls if url and not is_local_url(url)]


def staged_apart(typed: TesTask, config: Config) -> bool:
    """Whether the task runs as stage-in, its job and stage-out (staging.where = "transfer" and
    an input or output that needs the network)."""
    return config.staging.where == "transfer" and bool(remote_urls(typed))


def transfer_directives(
    typed: TesTask, part: str, config: Config, layout: TaskLayout, owner: str | None
) -> list[str]:
    """The `#SBATCH` options of the task's stage-in or stage-out job: its own name, the
    transfer partition or QOS, one CPU, `staging.transfer_memory_mb` and
    `staging.transfer_time_limit`, the task's account (its job's checks apply), and for the
    stage-in `staging.stage_in_nice`."""
    directives, _ = directives_and_rule(typed, config, layout, None, owner)
    account = [d for d in directives if d.startswith("--account=")]
    staging = config.staging
    lines = [
        f"--job-name={part_job_name(job_name(typed.id, typed.model.name), part)}",
        f"--output={layout.slurm_output}",
        f"--chdir={layout.task_dir}",
        "--no-requeue",
    ]
    if staging.transfer_partition:
        lines.append(f"--partition={staging.transfer_partition}")
    if staging.transfer_qos:
        lines.append(f"--qos={staging.transfer_qos}")
    lines += [
        "--ntasks=1",
        "--cpus-per-task=1",
        f"--mem={staging.transfer_memory_mb}",
        f"--time={staging.transfer_time_limit}",
        *account,
    ]
    if part == STAGE_IN_PART and staging.stage_in_nice:
        lines.append(f"--nice={staging.stage_in_nice}")
    return lines


__all__ = ["PART_SCRIPTS", "STAGE_IN_PART", "STAGE_OUT_PART", "remote_urls", "staged_apart"]
