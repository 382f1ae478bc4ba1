"""The `#SBATCH` options of a task: where each comes from (`SBATCH_OPTIONS`), the partition
and qos defaults, resources in Slurm's units (`--tmp` per `disk_directive`), then the site's
directives: the first matching `slurm.rules` (`site_rule`) and `slurm.extra_directives`.

sbatch parses these lines with its own rules, so each value must match a strict pattern, or
rendering fails with a `RenderError` naming the field.
"""

from __future__ import annotations

import grp
import math
import os
import pwd
import re
from decimal import Decimal
from typing import Any

from bridge.config import Config, SiteRule
from bridge.core import backend_params
from bridge.core.naming import job_name
from bridge.core.tes import ResourcesModel
from bridge.job.layout import TaskLayout
from bridge.jobscript.task import RenderError, TesTask, parse_task
from bridge.slurm import NodeSizes

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
#:   ram_gb         --mem              resources.ram_gb in MB, rounded up (0: no request),
#:                                     the node's whole memory when that is the request in
#:                                     decimal GB (see `memory_directive`)
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


def _megabytes(gigabytes: float | None) -> int | None:
    """GB (TES) -> MB (Slurm) rounded up; 0 or absent -> None (never `--mem=0`: all memory)."""
    if not gigabytes:
        return None
    return max(1, math.ceil(gigabytes * 1024))


def memory_directive(
    ram_gb: float | None, partitions: list[str], nodes: NodeSizes | None
) -> str | None:
    """`--mem` for a task's ram_gb: GiB in Slurm's MB (MiB), rounded up.

    Engines read ram_gb either way: Nextflow and Toil send GiB, Snakemake, cwl-tes and
    crankshaft decimal GB (docs/api.md). So when the largest node of the task's partitions
    (`partitions` empty: the default partition) has M MB, and M lies between the request read
    in decimal MB and read in MiB, the job asks for M: the node's whole memory, which is the
    request in the decimal reading and, in the GiB reading, the most any of those nodes can
    give (a GiB request a node can give is never lowered). Otherwise sbatch would refuse a
    decimal request of exactly a node's memory.
    """
    mebibytes = _megabytes(ram_gb)
    if mebibytes is None or ram_gb is None:
        return None
    largest = nodes.largest_memory(partitions) if nodes else None
    # The float's shortest decimal, so that 23.081 GB is 23081 MB, not 23081.000000000004.
    decimal = math.ceil(Decimal(repr(ram_gb)) * 1000)
    if largest is not None and decimal <= largest < mebibytes:
        mebibytes = largest
    return f"{SBATCH_OPTIONS['ram_gb']}={mebibytes}"


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
    megabytes: int | None, partitions: list[str], config: Config, nodes: NodeSizes | None
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
    if mode == "auto" and not (nodes and nodes.smallest_tmp_disk(partitions)):
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
    values: dict[str, str], resources: ResourcesModel, config: Config, nodes: NodeSizes | None
) -> None:
    """Fill in cpu_cores, ram_gb and disk_gb as sbatch wants them."""
    if resources.cpu_cores:  # 0 (which TES allows) means "no request", like an absent value
        # TES 1.2 allows a fraction of a core; Slurm counts whole CPUs.
        values["cpu_cores"] = str(math.ceil(resources.cpu_cores))
    partitions = values["partition"].split(",") if "partition" in values else []
    mem = memory_directive(resources.ram_gb, partitions, nodes)
    if mem is not None:
        values["ram_gb"] = mem.partition("=")[2]
    tmp = disk_directive(_megabytes(resources.disk_gb), partitions, config, nodes)
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
    nodes: NodeSizes | None = None,
    owner: str | None = None,
) -> list[str]:
    """The `#SBATCH` options (without the prefix), site directives last: those of the first
    matching `slurm.rules` (for `owner`'s groups), then `slurm.extra_directives`. `nodes` is
    what the poller learned of the nodes' TmpDisk and memory (see `disk_directive` and
    `memory_directive`)."""
    return directives_and_rule(parse_task(task), config, layout, nodes, owner)[0]


def directives_and_rule(
    typed: TesTask,
    config: Config,
    layout: TaskLayout,
    nodes: NodeSizes | None,
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
    _resource_values(values, typed.resources, config, nodes)
    directives = [
        f"--job-name={job_name(typed.id, typed.model.name)}",
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
