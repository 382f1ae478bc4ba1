"""What a task asks of Slurm beyond TES 1.1: its backend_parameters, its time limit, its GPUs.

The API checks a posted task's parameters here (`check_task`: a 400 naming the field), the
renderer turns them into sbatch options (`time_limit`, `gpu_request`) and the capabilities
document lists them with their patterns (`BACKEND_PARAMETERS`). Values go into `#SBATCH` lines,
which sbatch parses with its own rules, so each must match a strict pattern.
Knows nothing of HTTP, the store or the poller.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
#: Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
#: days-hours:minutes, days-hours:minutes:seconds (sbatch(1)); UNLIMITED/INFINITE for none.
_TIME = re.compile(
    r"^(?:(?P<m1>\d{1,9})(?::(?P<s1>\d{1,2}))?"
    r"|(?P<h2>\d{1,9}):(?P<m2>\d{1,2}):(?P<s2>\d{1,2})"
    r"|(?P<d>\d{1,6})-(?P<h3>\d{1,2})(?::(?P<m3>\d{1,2})(?::(?P<s3>\d{1,2}))?)?"
    r"|(?i:UNLIMITED|INFINITE))$"
)
#: Hours as a decimal number (max_time, after task-execution-schemas PR #141).
_HOURS = re.compile(r"^(?:\d{1,7}(?:\.\d{1,6})?|\.\d{1,6})$")
_GRES = re.compile(r"^[A-Za-z0-9_:,.-]+$")
#: --gpus and --gpus-per-task: `count` or `type:count`.
_GPUS = re.compile(r"^(?:[A-Za-z0-9_.-]+:)?[1-9][0-9]{0,3}$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_&|,.()\[\]*:!-]+$")
#: What becomes of a task whose job Slurm preempted (see `on_preemption`).
ON_PREEMPTION = ("report", "resubmit")
_ON_PREEMPTION = re.compile(rf"^(?:{'|'.join(ON_PREEMPTION)})$")


@dataclass(frozen=True)
class Parameter:
    pattern: re.Pattern[str]
    #: The sbatch option it becomes (the capabilities document and the docs' table); None for
    #: a parameter the poller reads itself.
    option: str | None
    description: str


#: backend_parameters key -> what its value must match and the sbatch option it becomes.
BACKEND_PARAMETERS: dict[str, Parameter] = {
    "partition": Parameter(_NAME, "--partition", "Slurm partition (one of slurm.partitions)"),
    "account": Parameter(_NAME, "--account", "Slurm account"),
    "qos": Parameter(_NAME, "--qos", "quality of service"),
    "time": Parameter(_TIME, "--time", "time limit in a Slurm format, e.g. 1-12:00:00"),
    "time_limit": Parameter(_TIME, "--time", "older name of `time`"),
    "max_time": Parameter(_HOURS, "--time", "time limit in hours, e.g. 1.5"),
    "gres": Parameter(_GRES, "--gres", "generic resources, e.g. gpu:a100:2"),
    "gpus": Parameter(_GPUS, "--gpus", "GPUs for the job: count or type:count"),
    "gpus_per_task": Parameter(_GPUS, "--gpus-per-task", "GPUs per task: count or type:count"),
    "constraint": Parameter(_CONSTRAINT, "--constraint", "node features"),
    "reservation": Parameter(_NAME, "--reservation", "Slurm reservation"),
    "on_preemption": Parameter(
        _ON_PREEMPTION,
        None,
        "a job Slurm preempts: report (the task ends PREEMPTED) or resubmit (a new attempt); "
        "the default is slurm.on_preemption",
    ),
}

#: The keys accepted unless `backend_parameters.supported` says otherwise.
DEFAULT_SUPPORTED = list(BACKEND_PARAMETERS)
#: Keys whose presence asks for GPUs (the executors then get container.gpu_flag).
GPU_KEYS = ("gpus", "gpus_per_task")


class ParameterError(ValueError):
    """A parameter cannot be used; `field` is its path in the task."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def parse_time(text: str) -> int | None:
    """Seconds of a Slurm time limit; None for UNLIMITED/INFINITE; ValueError if malformed.

    Slurm counts limits in whole minutes: a limit with seconds is rounded up by slurmctld."""
    match = _TIME.fullmatch(text)
    if not match:
        raise ValueError(
            f"{text!r} is not a Slurm time (minutes, minutes:seconds, hours:minutes:seconds, "
            "days-hours, days-hours:minutes or days-hours:minutes:seconds)"
        )
    g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if not g:
        return None  # UNLIMITED, INFINITE
    if "m1" in g:
        return g["m1"] * 60 + g.get("s1", 0)
    if "h2" in g:
        return g["h2"] * 3600 + g["m2"] * 60 + g["s2"]
    return g["d"] * 86400 + g["h3"] * 3600 + g.get("m3", 0) * 60 + g.get("s3", 0)


def format_time(seconds: int) -> str:
    """`days-hours:minutes:seconds`, which sbatch and sacct both read."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"


@dataclass(frozen=True)
class TimeLimit:
    #: The --time value; None: UNLIMITED.
    seconds: int | None
    #: Where it comes from, for messages: `resources.backend_parameters.time`, `slurm.default_time`.
    source: str
    #: The value as written, when it was written in a Slurm format.
    text: str | None = None

    @property
    def option(self) -> str:
        if self.text is not None:
            return self.text
        return "UNLIMITED" if self.seconds is None else format_time(self.seconds)

    def describe(self) -> str:
        return f"--time={self.option}, from {self.source}"


def _lowered(params: Mapping[str, str] | None) -> dict[str, str]:
    return {key.lower(): value for key, value in (params or {}).items()}


@dataclass(frozen=True)
class SiteTimes:
    """The site's time settings (`slurm.default_time`, `slurm.max_time`), in Slurm's formats."""

    default: str | None = None
    maximum: str | None = None


def _asked_limits(values: Mapping[str, str]) -> list[TimeLimit]:
    """The limits a task's own parameters ask for: `time`, `time_limit`, `max_time` (hours)."""
    where = "resources.backend_parameters"
    asked: list[TimeLimit] = []
    for key in ("time", "time_limit"):
        if key in values:
            try:
                asked.append(TimeLimit(parse_time(values[key]), f"{where}.{key}", values[key]))
            except ValueError as exc:
                raise ParameterError(f"{where}.{key}", str(exc)) from None
    if "max_time" in values:
        if not _HOURS.fullmatch(values["max_time"]) or float(values["max_time"]) <= 0:
            raise ParameterError(f"{where}.max_time", "must be a positive number of hours")
        asked.append(TimeLimit(math.ceil(float(values["max_time"]) * 3600), f"{where}.max_time"))
    return asked


def time_limit(params: Mapping[str, str] | None, site: SiteTimes) -> TimeLimit | None:
    """The task's --time: the tighter of backend_parameters `time` (or `time_limit`) and
    `max_time` (hours, rounded up to a second), else slurm.default_time; None: the partition's
    own limit. Raises ParameterError above slurm.max_time."""
    asked = _asked_limits(_lowered(params))
    limits = [t for t in asked if t.seconds is not None] or asked
    chosen = min(limits, key=lambda t: t.seconds or 0) if limits else None
    if chosen is None and site.default:
        chosen = TimeLimit(parse_time(site.default), "slurm.default_time", site.default)
    maximum = parse_time(site.maximum) if site.maximum else None
    if maximum is not None:
        if chosen is None:
            return TimeLimit(maximum, "slurm.max_time", site.maximum)
        if chosen.seconds is None or chosen.seconds > maximum:
            raise ParameterError(
                chosen.source,
                f"asks for {chosen.option}; this server allows at most "
                f"{site.maximum} (slurm.max_time)",
            )
    if chosen is not None and chosen.seconds == 0:
        raise ParameterError(chosen.source, "must be more than 0 (0 would mean no limit)")
    return chosen


def wants_gpus(params: Mapping[str, str] | None) -> bool:
    """Whether the task asks for GPUs (`gpus`, `gpus_per_task`, or a `gres` of gpu)."""
    values = _lowered(params)
    gres = values.get("gres", "")
    return any(k in values for k in GPU_KEYS) or any(
        item.split(":")[0] == "gpu" for item in gres.split(",")
    )


def on_preemption(params: Mapping[str, str] | None, site_default: str) -> str:
    """What becomes of the task when Slurm preempts its job: its own
    backend_parameters.on_preemption (`report`: it ends PREEMPTED, for clients that count
    preemptible attempts themselves, such as sprocket; `resubmit`: a new attempt), else the
    site's slurm.on_preemption."""
    value = _lowered(params).get("on_preemption")
    return value if value in ON_PREEMPTION else site_default


def checked_values(params: Mapping[str, str] | None, supported: list[str]) -> dict[str, str]:
    """The supported parameters, lower-cased keys, each checked against its pattern."""
    allowed = {key.lower() for key in supported}
    values: dict[str, str] = {}
    for key, value in _lowered(params).items():
        if key not in allowed or key not in BACKEND_PARAMETERS:
            continue
        if not BACKEND_PARAMETERS[key].pattern.fullmatch(value):
            raise ParameterError(
                f"resources.backend_parameters.{key}",
                f"invalid value {value!r} ({BACKEND_PARAMETERS[key].description})",
            )
        values[key] = value
    return values


def check_task(
    document: Mapping[str, Any], supported: list[str], site: SiteTimes
) -> list[tuple[str, str]]:
    """The problems of a stored task's backend_parameters, as (field, message) for a 400."""
    resources = document.get("resources") or {}
    params = resources.get("backend_parameters")
    try:
        checked_values(params, supported)
        time_limit(params, site)
    except ParameterError as exc:
        return [(exc.field, exc.message)]
    return []


def _named_partitions(resources: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(field, partition) the task names: backend_parameters.partition, else its zones."""
    partition = _lowered(resources.get("backend_parameters")).get("partition")
    if partition:
        return [("resources.backend_parameters.partition", partition)]
    zones = resources.get("zones") or []
    return [(f"resources.zones[{i}]", str(zone)) for i, zone in enumerate(zones)]


def _memory_problem(
    ram: object, candidates: Sequence[Mapping[str, Any]], where: str
) -> list[tuple[str, str]]:
    """ram_gb larger than the largest node of the `candidates` partitions has."""
    if not isinstance(ram, int | float) or ram <= 0:
        return []
    largest = max(int(p.get("max_memory_mb_per_node") or 0) for p in candidates)
    # The decimal reading, the smaller one: a node of exactly that much gets the job (render).
    needed = math.ceil(Decimal(repr(float(ram))) * 1000)
    if largest <= 0 or needed <= largest:
        return []
    message = (
        f"{ram:g} GB is more than the largest node of {where} has: {largest} MB "
        f"({largest / 1000:g} GB)"
    )
    return [("resources.ram_gb", message)]


def _cpu_problem(
    cores: object, candidates: Sequence[Mapping[str, Any]], where: str
) -> list[tuple[str, str]]:
    """cpu_cores (rounded up, as the job asks) more than the largest node of `candidates` has:
    `--cpus-per-task` is on one node ("More processors requested than permitted")."""
    if not isinstance(cores, int | float) or cores <= 0:
        return []
    largest = max(int(p.get("max_cpus_per_node") or 0) for p in candidates)
    if largest <= 0 or math.ceil(cores) <= largest:
        return []
    message = f"{cores:g} CPUs are more than the largest node of {where} has: {largest} CPUs"
    return [("resources.cpu_cores", message)]


def _gpu_requests(params: Mapping[str, str] | None) -> list[tuple[str, str | None, int]]:
    """(field, GPU type or None, count) of each GPU request in a task's backend_parameters:
    `gpus` and `gpus_per_task` (`[type:]count`), and each `gpu[:type][:count]` of `gres`."""
    values = _lowered(params)
    where = "resources.backend_parameters"
    asked: list[tuple[str, str | None, int]] = []
    for key in GPU_KEYS:
        kind, _, count = values.get(key, "").rpartition(":")
        if count.isdigit():
            asked.append((f"{where}.{key}", kind or None, int(count)))
    for item in values.get("gres", "").split(","):
        name, *rest = item.split(":")
        if name != "gpu" or len(rest) > 2:
            continue
        number = int(rest.pop()) if rest and rest[-1].isdigit() else 1
        asked.append((f"{where}.gres", rest[0] if rest else None, number))
    return asked


def _gpu_problem(
    kind: str | None, count: int, candidates: Sequence[Mapping[str, Any]], where: str
) -> str | None:
    """Why no node of `candidates` can give one task `count` GPUs (of `kind`), or None."""
    key = f"gpu:{kind}" if kind else "gpu"
    if not any((p.get("gres") or {}).get(key) for p in candidates):
        return _no_such_gpus(kind, candidates, where)
    per_node = [p.get("max_gres_per_node") for p in candidates]
    if not all(isinstance(n, dict) for n in per_node):
        return None  # read by a poller that did not count them per node
    most = max(int(n.get(key) or 0) for n in per_node if isinstance(n, dict))
    if count <= most:
        return None
    what = f"GPUs of type {kind!r}" if kind else "GPUs"
    return f"{count} {what} are more than one node of {where} has: {most} (a task runs on one node)"


def _no_such_gpus(kind: str | None, candidates: Sequence[Mapping[str, Any]], where: str) -> str:
    if kind and any((p.get("gres") or {}).get("gpu") for p in candidates):
        types = sorted({t for p in candidates for t in p.get("gpu_types") or {}})
        return (
            f"no node of {where} has GPUs of type {kind!r}; "
            f"types there: {', '.join(types) or 'none named'}"
        )
    return f"no node of {where} has GPUs"


def _gpu_problems(
    params: Mapping[str, str] | None, candidates: Sequence[Mapping[str, Any]], where: str
) -> list[tuple[str, str]]:
    problems = []
    for field, kind, count in _gpu_requests(params):
        problem = _gpu_problem(kind, count, candidates, where)
        if problem:
            problems.append((field, problem))
    return problems


def cluster_problems(
    document: Mapping[str, Any], partitions: list[dict[str, Any]]
) -> list[tuple[str, str]]:
    """What sbatch would refuse, or no node could run, known from the partitions the poller
    last read (the capabilities document's `partitions`; empty: not known yet, nothing is
    refused): a partition that does not exist; more memory or CPUs than the largest node (of
    the partitions named, else of any) has; GPUs of a type no node has, or more than one node
    has. As (field, message) for a 400."""
    by_name = {str(p["name"]): p for p in partitions if isinstance(p, dict) and p.get("name")}
    if not by_name:
        return []
    resources = document.get("resources") or {}
    named = _named_partitions(resources)
    unknown = [
        (field, f"no partition {name!r} on this cluster; its partitions: {', '.join(by_name)}")
        for field, name in named
        if name not in by_name
    ]
    if unknown:
        return unknown
    candidates = [by_name[name] for _, name in named] or list(by_name.values())
    where = ", ".join(name for _, name in named) if named else "any partition"
    return [
        *_memory_problem(resources.get("ram_gb"), candidates, where),
        *_cpu_problem(resources.get("cpu_cores"), candidates, where),
        *_gpu_problems(resources.get("backend_parameters"), candidates, where),
    ]
