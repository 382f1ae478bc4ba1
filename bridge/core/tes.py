"""TES 1.1 documents: validation of a posted task, states, views and wire spellings.

This module knows nothing of Slurm, HTTP or the database. A posted task goes through
:func:`validate_task`, which returns the *stored document*: the task as the client sent it
(camelCase aliases folded to snake_case, explicit nulls and unknown fields dropped, a missing
input/output ``type`` filled in as ``FILE``). Responses are built from that document by
:func:`render_task` in one of the three views.

Validation is done by pydantic models in strict mode (``"4"`` is not an integer, ``1`` is not a
string); their errors are turned into one message per field path, e.g.
``executors[0].command: must be a non-empty array of strings``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, NoReturn

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from bridge.core.drs import DrsUriError, is_drs_url, parse_drs_uri, resolve
from bridge.core.naming import FileUrlError, has_wildcards, is_local_url, local_path
from bridge.core.reasons import REASON_KEY, task_reason


class State(StrEnum):
    UNKNOWN = "UNKNOWN"
    QUEUED = "QUEUED"
    INITIALIZING = "INITIALIZING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    COMPLETE = "COMPLETE"
    EXECUTOR_ERROR = "EXECUTOR_ERROR"
    SYSTEM_ERROR = "SYSTEM_ERROR"
    CANCELED = "CANCELED"
    PREEMPTED = "PREEMPTED"
    CANCELING = "CANCELING"


#: Nothing moves a task out of these states. PREEMPTED ("preempted by the system") ends a
#: task only where the site asks for it (slurm.on_preemption); the client may submit it again.
TERMINAL_STATES = frozenset(
    {State.COMPLETE, State.EXECUTOR_ERROR, State.SYSTEM_ERROR, State.CANCELED, State.PREEMPTED}
)

#: Earlier TES versions (and clients generated from them) spell it this way.
STATE_ALIASES = {"INITILIZING": State.INITIALIZING}
#: Stored on a task log, never rendered: the kinds of the passing conditions whose lines end
#: its system_logs, one per line (bridge.poller.attempt).
CONDITION_KINDS_KEY = "condition_kinds"


class View(StrEnum):
    MINIMAL = "MINIMAL"
    BASIC = "BASIC"
    FULL = "FULL"


class TaskValidationError(ValueError):
    """A posted task (or a query) does not conform; ``errors`` lists ``(field, message)``."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        first_field, first_message = errors[0]
        text = f"{first_field}: {first_message}" if first_field else first_message
        if len(errors) > 1:
            text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        super().__init__(text)


# --------------------------------------------------------------------------------------------
# Models of a posted task
# --------------------------------------------------------------------------------------------

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Slurm counts a job's CPUs in 16 bits, the two largest values meaning "unset" and
#: "unlimited"; more would be refused or wrapped around by sbatch.
MAX_CPU_CORES = 2**16 - 3
#: Linux refuses to exec a single argument or environment string of 128 KiB or more
#: (MAX_ARG_STRLEN, with its NUL); the runtime adds a prefix of up to 16 bytes to each
#: variable's name (SINGULARITYENV_).
MAX_ARG_BYTES = 128 * 1024 - 64
#: All of an executor's arguments and variables (strings, NULs and pointers): half of the usual
#: ARG_MAX (2 MiB), the other half left to the runtime's own flags and the job's environment.
MAX_EXEC_BYTES = 1024 * 1024
#: Each argument or variable costs at least this much of MAX_EXEC_BYTES (a NUL, a pointer).
MAX_EXEC_STRINGS = MAX_EXEC_BYTES // 9
MAX_ZONES = 1024
MAX_BACKEND_PARAMETERS = 64
#: ram_gb and disk_gb: far beyond any node (an exabyte), and still an exact number of MB.
MAX_GIGABYTES = 1e9


class FileType(StrEnum):
    FILE = "FILE"
    DIRECTORY = "DIRECTORY"


def _check_container_path(value: str) -> str:
    """A container path must be absolute and normalised, so it maps to exactly one host path."""
    if not value.startswith("/") or value.startswith("//"):
        raise ValueError("must be an absolute path")
    if value == "/":
        raise ValueError("must not be the container's root directory")
    if posixpath.normpath(value) != value:
        raise ValueError("must be a normalised absolute path (no '.', '..', '//' or trailing '/')")
    return value


ContainerPath = Annotated[StrictStr, AfterValidator(_check_container_path)]


def _check_volume(value: str) -> str:
    """A volume is a directory: `/pulsar_staging/` (Galaxy's Pulsar sends it so) is the
    directory /pulsar_staging, and is stored without the slash."""
    return _check_container_path(value.rstrip("/") or "/")


def _check_workdir(value: str) -> str:
    """A working directory is a directory too, and may be the container's root (Pulsar's
    executors all start in `/`); nothing is mounted there, the executor only starts in it."""
    if value.startswith("/") and not value.strip("/"):
        return "/"
    return _check_volume(value)


VolumePath = Annotated[StrictStr, AfterValidator(_check_volume)]
WorkdirPath = Annotated[StrictStr, AfterValidator(_check_workdir)]


def _file_type(value: Any) -> Any:
    # Strict mode wants an enum instance; JSON gives the name.
    return FileType(value) if value in ("FILE", "DIRECTORY") else value


def _integral(value: Any) -> Any:
    # JSON encoders write 2.0 for a float that holds an integer; take it as 2.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class _Document(BaseModel):
    # Strict types, unknown fields ignored (TES clients send extra fields), no NaN/Infinity.
    model_config = ConfigDict(
        extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True
    )


class InputModel(_Document):
    name: StrictStr | None = None
    description: StrictStr | None = None
    url: StrictStr | None = None
    path: ContainerPath
    type: Annotated[FileType, BeforeValidator(_file_type)] = FileType.FILE
    content: StrictStr | None = None
    streamable: StrictBool | None = None

    @model_validator(mode="after")
    def _url_or_content(self) -> InputModel:
        if self.content is None and not self.url:
            raise ValueError("an input needs a `url` or a `content`")
        if self.content is not None and self.type == FileType.DIRECTORY:
            raise ValueError("an input with `content` must be of type FILE")
        return self


class OutputModel(_Document):
    name: StrictStr | None = None
    description: StrictStr | None = None
    url: Annotated[StrictStr, Field(min_length=1)]
    path: ContainerPath
    path_prefix: StrictStr | None = None
    type: Annotated[FileType, BeforeValidator(_file_type)] = FileType.FILE

    @model_validator(mode="after")
    def _wildcards_need_prefix(self) -> OutputModel:
        if has_wildcards(self.path) and not self.path_prefix:
            raise ValueError("an output whose `path` has wildcards needs a `path_prefix`")
        return self


class ExecutorModel(_Document):
    image: Annotated[StrictStr, Field(min_length=1)]
    command: Annotated[list[StrictStr], Field(min_length=1)]
    workdir: WorkdirPath | None = None
    stdin: ContainerPath | None = None
    stdout: ContainerPath | None = None
    stderr: ContainerPath | None = None
    env: dict[StrictStr, StrictStr] | None = None
    ignore_error: StrictBool | None = None

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if value != value.strip() or any(c.isspace() for c in value):
            raise ValueError("must be an image name without white space")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for name in value or {}:
            if not _ENV_NAME.match(name):
                raise ValueError(
                    f"{name!r} is not a valid environment variable name "
                    "(letters, digits and '_', not starting with a digit)"
                )
        home = (value or {}).get("HOME")
        # HOME becomes the runtime's `--home` (see bridge.jobscript.render), which splits at ':'.
        if home is not None and (not home.startswith("/") or any(c in home for c in ":\n\r")):
            raise ValueError(f"HOME {home!r} must be an absolute path without ':'")
        return value


def _non_negative_number(value: Any) -> Any:
    # Strict mode would accept only floats for `float` fields; JSON clients send 4 or 4.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be a non-negative number")
    if value > MAX_GIGABYTES:
        raise ValueError(f"must be at most {MAX_GIGABYTES:.0f} (GB)")
    return float(value)


# Field before the validator, so that the schema says minimum/maximum (the OpenAPI document).
Gigabytes = Annotated[float, Field(ge=0, le=MAX_GIGABYTES), BeforeValidator(_non_negative_number)]


def _cpu_cores(value: Any) -> Any:
    # TES 1.2 allows a fraction of a core (rounded up for Slurm); an integral value stays an
    # integer so that 1.1 clients (py-tes wants an int) read their task back.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_CPU_CORES  # also NaN
    ):
        raise ValueError(f"must be a non-negative number, at most {MAX_CPU_CORES}")
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_CPU_CORES:
        return int(value)
    return value


#: Constraints on each member, so that the OpenAPI schema says minimum and maximum.
CpuCores = Annotated[
    Annotated[int, Field(ge=0, le=MAX_CPU_CORES)] | Annotated[float, Field(ge=0, le=MAX_CPU_CORES)],
    BeforeValidator(_cpu_cores),
]


class ResourcesModel(_Document):
    cpu_cores: CpuCores | None = Field(
        default=None, validation_alias=AliasChoices("cpu_cores", "cpuCores")
    )
    preemptible: StrictBool | None = None
    ram_gb: Gigabytes | None = Field(default=None, validation_alias=AliasChoices("ram_gb", "ramGb"))
    disk_gb: Gigabytes | None = Field(
        default=None, validation_alias=AliasChoices("disk_gb", "diskGb")
    )
    zones: list[Annotated[StrictStr, Field(min_length=1)]] | None = None
    backend_parameters: dict[StrictStr, StrictStr] | None = None
    backend_parameters_strict: StrictBool | None = None


class TaskModel(_Document):
    name: StrictStr | None = None
    description: StrictStr | None = None
    inputs: list[InputModel] | None = None
    outputs: list[OutputModel] | None = None
    resources: ResourcesModel | None = None
    executors: Annotated[list[ExecutorModel], Field(min_length=1)]
    volumes: list[VolumePath] | None = None
    tags: dict[StrictStr, StrictStr] | None = None


# Messages for the fields whose generic pydantic wording would not help a client.
_FIELD_MESSAGES = {
    "executors": "must be a non-empty array of executors",
    "command": "must be a non-empty array of strings",
    "image": "must be a non-empty string",
    "url": "must be a non-empty string",
    "zones": "must be an array of non-empty strings",
    "env": "must be an object whose values are strings",
    "tags": "must be an object whose values are strings",
    "backend_parameters": "must be an object whose values are strings",
    "cpu_cores": f"must be a non-negative number, at most {MAX_CPU_CORES}",
    "type": "must be FILE or DIRECTORY",
}

_GENERIC_MESSAGES = {
    "missing": "is required",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "int_type": "must be an integer",
    "enum": "must be one of FILE, DIRECTORY",
    "too_short": "must not be empty",
    "greater_than_equal": "must not be negative",
}


def format_field_path(loc: Iterable[str | int]) -> str:
    """``("executors", 0, "command")`` -> ``executors[0].command``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def _element_message(error: Mapping[str, Any]) -> str:
    """An element of an array of strings that is not one: what it is, and (YAML writes
    `[sleep, 1]` for ["sleep", 1]) how to write it as a string."""
    value = error.get("input")
    if isinstance(value, bool | int | float) and error["type"] == "string_type":
        shown = json.dumps(value)
        return f'must be a string, got the {type(value).__name__} {shown}; quote it ("{shown}")'
    return _GENERIC_MESSAGES.get(error["type"], str(error["msg"]))


def _describe(error: Mapping[str, Any]) -> tuple[str, str]:
    loc = [p for p in error["loc"] if p not in ("function-after", "function-before")]
    # A dedicated message applies to an error at the field itself, and an element's error is
    # reported at the element (`executors[0].command[1]: must be a string, got ...`).
    if error["type"] not in ("missing", "value_error"):
        for depth, part in enumerate(loc):
            rest = loc[depth + 1 :]
            if part in _FIELD_MESSAGES and len(rest) == 1 and isinstance(rest[0], int):
                return format_field_path(loc), _element_message(error)
            if part in _FIELD_MESSAGES and not rest:
                return format_field_path(loc[: depth + 1]), _FIELD_MESSAGES[part]
    if error["type"] == "value_error":
        message = str(error.get("ctx", {}).get("error", error["msg"]))
    else:
        message = _GENERIC_MESSAGES.get(error["type"], error["msg"])
    return format_field_path(loc), message


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    max_executors: int = 64
    max_inputs: int = 4096
    max_outputs: int = 4096
    max_volumes: int = 256
    max_tags: int = 256
    max_content_bytes: int = 1024 * 1024


@dataclass(frozen=True)
class ValidatedTask:
    document: dict[str, Any]
    #: Warnings for the task's system_logs (e.g. dropped backend parameters).
    warnings: list[str]


def _drop_nulls(value: Any) -> Any:
    """Explicit nulls mean "absent" (Cromwell sends them); nulls inside arrays stay errors."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _unstorable_strings(value: Any, loc: tuple[str | int, ...] = ()) -> Iterator[tuple[str, str]]:
    """NUL characters and lone surrogates parse as JSON but cannot be stored or run."""
    if isinstance(value, str):
        if "\x00" in value:
            yield format_field_path(loc), "must not contain NUL characters"
        else:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                yield format_field_path(loc), "must be valid UTF-8 (lone surrogate)"
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield from _unstorable_strings(key, (*loc, key))
            yield from _unstorable_strings(item, (*loc, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _unstorable_strings(item, (*loc, index))


def parse_task(document: Mapping[str, Any]) -> TaskModel:
    """The TES model of a task document (posted, or as stored); raises TaskValidationError.

    Explicit nulls count as absent; strings with NUL characters or lone surrogates are refused.
    """
    body = _drop_nulls(dict(document))
    bad_strings = list(_unstorable_strings(body))
    if bad_strings:
        raise TaskValidationError(bad_strings)
    try:
        return TaskModel.model_validate(body)
    except ValidationError as exc:
        raise TaskValidationError([_describe(e) for e in exc.errors()]) from None


def validate_task(
    body: Any,
    *,
    limits: Limits = Limits(),
    supported_backend_parameters: Iterable[str] = (),
    refuse_unsupported_backend_parameters: bool = False,
    allowed_dirs: Iterable[str] | None = None,
    local_image_dirs: Iterable[str] = (),
    drs_prefixes: Mapping[str, str] | None = None,
) -> ValidatedTask:
    """Check a posted task and return the document to store, or raise TaskValidationError.

    With `allowed_dirs` (the deployment's storage.allowed_dirs), a `file://` URL or bare path
    must lie inside one of them (judged lexically; the job side judges again after resolving
    links). A `drs://` input must be a DRS URI the job side can resolve: hostname-based, or a
    compact identifier whose prefix is one of `drs_prefixes` (staging.drs_prefixes); DRS is
    read-only, so no output goes to one. An executor image that is an absolute path must be a
    `.sif` file inside one of `local_image_dirs` (container.local_image_dirs), links
    resolved."""
    if not isinstance(body, dict):
        raise TaskValidationError([("", "the request body must be a JSON object (a tesTask)")])
    oversized = _oversized_collections(body, limits)
    if oversized:
        raise TaskValidationError(oversized)
    body = _drop_nulls(body)
    model = parse_task(body)

    problems = _check_limits(model, limits)
    if allowed_dirs is not None:
        problems += _check_local_urls(model, [d.rstrip("/") or "/" for d in allowed_dirs])
    problems += _check_drs_urls(model, drs_prefixes or {})
    image_dirs = list(local_image_dirs)
    for index, executor in enumerate(model.executors):
        if executor.image.startswith("/"):
            problem = local_image_problem(executor.image, image_dirs)
            if problem:
                problems.append((f"executors[{index}].image", problem))
    if problems:
        raise TaskValidationError(problems)

    document = model.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    # The server fills in a missing input/output type (TES: "required that the server fill in").
    for kind in ("inputs", "outputs"):
        for item in document.get(kind, []):
            item.setdefault("type", FileType.FILE.value)
    warnings = _filter_backend_parameters(
        document, supported_backend_parameters, refuse=refuse_unsupported_backend_parameters
    )
    return ValidatedTask(document=document, warnings=warnings)


def _oversized_collections(body: dict[str, Any], limits: Limits) -> list[tuple[str, str]]:
    """Arrays and objects with more items than allowed, counted before validation: pydantic
    makes one error per bad item, and 16 MiB of `{},` took minutes and gigabytes."""
    problems: list[tuple[str, str]] = []

    def check(field: str, value: Any, limit: int) -> bool:
        if isinstance(value, list | dict) and len(value) > limit:
            problems.append((field, f"at most {limit} allowed on this server, got {len(value)}"))
            return False
        return True

    for field in ("inputs", "outputs", "volumes", "tags"):
        check(field, body.get(field), getattr(limits, f"max_{field}"))
    resources = body.get("resources")
    if isinstance(resources, dict):
        check("resources.zones", resources.get("zones"), MAX_ZONES)
        check(
            "resources.backend_parameters",
            resources.get("backend_parameters"),
            MAX_BACKEND_PARAMETERS,
        )
    executors = body.get("executors")
    if check("executors", executors, limits.max_executors) and isinstance(executors, list):
        for index, executor in enumerate(executors):
            if isinstance(executor, dict):
                for field in ("command", "env"):
                    where = f"executors[{index}].{field}"
                    check(where, executor.get(field), MAX_EXEC_STRINGS)
    return problems


def _check_limits(model: TaskModel, limits: Limits) -> list[tuple[str, str]]:
    problems = []
    for index, executor in enumerate(model.executors):
        problems += _check_exec_size(index, executor)
    for index, item in enumerate(model.inputs or ()):
        if item.content is not None and len(item.content.encode()) > limits.max_content_bytes:
            problems.append(
                (
                    f"inputs[{index}].content",
                    f"inline content is limited to {limits.max_content_bytes} bytes on this "
                    "server; stage larger files by `url`",
                )
            )
    return problems


def _check_exec_size(index: int, executor: ExecutorModel) -> list[tuple[str, str]]:
    """What the kernel would refuse to exec (the executor would end 126 with no reason)."""
    problems = []
    total = 0
    strings = [(f"command[{i}]", arg) for i, arg in enumerate(executor.command)]
    strings += [(f"env.{name}", f"{name}={value}") for name, value in (executor.env or {}).items()]
    for where, text in strings:
        size = len(text.encode())
        total += size + 1 + 8
        if size > MAX_ARG_BYTES:
            problems.append(
                (
                    f"executors[{index}].{where}",
                    f"is {size} bytes; one argument or variable may have at most "
                    f"{MAX_ARG_BYTES} bytes (Linux's limit is 128 KiB)",
                )
            )
    if total > MAX_EXEC_BYTES and not problems:
        problems.append(
            (
                f"executors[{index}]",
                f"command and env take {total} bytes; at most {MAX_EXEC_BYTES} bytes "
                "(Linux's ARG_MAX) for all of an executor's arguments and variables",
            )
        )
    return problems


def local_image_problem(image: str, dirs: Iterable[str]) -> str | None:
    """Why the absolute path `image` may not serve as an executor image (None when it may).

    It must be a `.sif` file inside one of `dirs`, and stay inside it once links are resolved:
    a link in an image directory cannot lead to any other file of the host."""
    dirs = [str(d).rstrip("/") or "/" for d in dirs]
    if not dirs:
        return (
            "local .sif images are disabled on this server (container.local_image_dirs); "
            "name a registry image"
        )
    if "\x00" in image or posixpath.normpath(image) != image or not image.endswith(".sif"):
        return "a local image must be a normalised absolute path to a .sif file"
    for base in dirs:
        if base != "/" and not image.startswith(base + "/"):
            continue
        real_base = os.path.realpath(base)
        real = os.path.realpath(image)
        if real_base != "/" and not real.startswith(real_base + "/"):
            return f"leads out of {base} through a link"
        if not os.path.isfile(real):
            return f"{image} does not exist or is not a file"
        return None
    return f"must be a .sif file under {', '.join(dirs)} (container.local_image_dirs)"


def _check_local_urls(model: TaskModel, allowed: list[str]) -> list[tuple[str, str]]:
    problems = []
    items = [("inputs", i, item.url) for i, item in enumerate(model.inputs or ())]
    items += [("outputs", i, item.url) for i, item in enumerate(model.outputs or ())]
    for kind, index, url in items:
        if not url or not is_local_url(url):
            continue
        where = f"{kind}[{index}].url"
        try:
            stripped = local_path(url)
        except FileUrlError as exc:
            problems.append((where, str(exc)))
            continue
        if not allowed:
            problems.append((where, "file:// URLs and local paths are disabled on this server"))
        elif not any(d == "/" or stripped == d or stripped.startswith(d + "/") for d in allowed):
            problems.append((where, "is outside the directories this server may read and write"))
    return problems


def _check_drs_urls(model: TaskModel, prefixes: Mapping[str, str]) -> list[tuple[str, str]]:
    problems = []
    for index, item in enumerate(model.inputs or ()):
        if item.url and is_drs_url(item.url):
            try:
                resolve(parse_drs_uri(item.url), prefixes)
            except DrsUriError as exc:
                problems.append((f"inputs[{index}].url", str(exc)))
    for index, output in enumerate(model.outputs or ()):
        if is_drs_url(output.url):
            problems.append(
                (f"outputs[{index}].url", "DRS is read-only: an output cannot go to a drs:// URI")
            )
    return problems


#: Keys people write for what TES asks elsewhere (difflib would suggest `gpus` for `cpus`).
_TES_FIELDS = {
    **dict.fromkeys(("cpus", "cpu", "ncpus", "cores", "cpus_per_task"), "resources.cpu_cores"),
    **dict.fromkeys(("mem", "memory", "ram", "mem_mb", "mem_gb"), "resources.ram_gb"),
    **dict.fromkeys(("disk", "tmp", "disk_mb"), "resources.disk_gb"),
}


def suggestion(key: str, allowed: Iterable[str]) -> str:
    """`did you mean `time`?` for a key close to a supported one (or a TES field), or ""."""
    lowered = key.lower()
    if lowered in _TES_FIELDS:
        return f"did you mean {_TES_FIELDS[lowered]}?"
    close = difflib.get_close_matches(lowered, sorted(allowed), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else ""


def _joined(*parts: str) -> str:
    return "; ".join(part for part in parts if part)


def _refuse(unsupported: list[str], allowed: set[str], why: str) -> NoReturn:
    supported = ", ".join(sorted(allowed)) or "none"
    raise TaskValidationError(
        [
            (
                f"resources.backend_parameters.{key}",
                _joined(
                    f"is not supported by this server ({why}; supported: {supported})",
                    suggestion(key, allowed),
                ),
            )
            for key in unsupported
        ]
    )


def _filter_backend_parameters(
    document: dict[str, Any], supported: Iterable[str], *, refuse: bool = False
) -> list[str]:
    """Keep the supported keys (case-insensitively); strict mode (the task's
    backend_parameters_strict, or the server's `refuse`) refuses the others."""
    resources = document.get("resources")
    if not resources or "backend_parameters" not in resources:
        return []
    allowed = {key.lower() for key in supported}
    given: dict[str, str] = resources["backend_parameters"]
    unsupported = sorted(key for key in given if key.lower() not in allowed)
    if not unsupported:
        return []
    if resources.get("backend_parameters_strict"):
        _refuse(unsupported, allowed, "backend_parameters_strict is true")
    if refuse:
        _refuse(unsupported, allowed, "backend_parameters.unsupported = refuse")
    kept = {k: v for k, v in given.items() if k.lower() in allowed}
    if kept:
        resources["backend_parameters"] = kept
    else:
        del resources["backend_parameters"]
    return [
        _joined(
            f"backend parameter {key!r} is not supported by this server and was ignored",
            suggestion(key, allowed),
        )
        for key in unsupported
    ]


def parse_state(value: str) -> State:
    """A state name from a query string; accepts the old INITILIZING spelling."""
    if value in STATE_ALIASES:
        return STATE_ALIASES[value]
    try:
        return State(value)
    except ValueError:
        raise TaskValidationError(
            [("state", f"unknown state {value!r}; one of {', '.join(s.value for s in State)}")]
        ) from None


def parse_view(value: str | None) -> View:
    if value is None or value == "":
        return View.MINIMAL
    try:
        return View(value.upper())
    except ValueError:
        raise TaskValidationError([("view", "must be one of MINIMAL, BASIC, FULL")]) from None


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def render_task(
    *,
    task_id: str,
    state: str,
    document: Mapping[str, Any] | None,
    creation_time: str | None,
    logs: list[dict[str, Any]] | None,
    view: View,
) -> dict[str, Any]:
    """Build the wire form of a task in a view. No nulls and nothing outside the spec."""
    if view is View.MINIMAL:
        return {"id": task_id, "state": state}
    assert document is not None
    task: dict[str, Any] = {"id": task_id, "state": state}
    for key, value in document.items():
        if view is View.BASIC and key == "inputs":
            value = [{k: v for k, v in item.items() if k != "content"} for item in value]
        elif key == "resources" and isinstance(value.get("cpu_cores"), float):
            # TES 1.1 clients (py-tes) refuse a fractional cpu_cores in any task they read:
            # responses give the whole CPUs the job asks for; the stored task keeps the fraction.
            value = {**value, "cpu_cores": math.ceil(value["cpu_cores"])}
        task[key] = value
    if logs:
        task["logs"] = _render_logs(state, logs, view)
    if creation_time:
        task["creation_time"] = creation_time
    return task


def _render_logs(state: str, logs: list[dict[str, Any]], view: View) -> list[dict[str, Any]]:
    """The task's logs in `view`; a final task's last attempt says why it ended so in its
    metadata (bridge.core.reasons), for the lists, which read no system logs."""
    # A final task waits for nothing: a condition line left by a path the poller never
    # follows (a task canceled while it waited to be submitted) is not shown.
    final = state in {s.value for s in TERMINAL_STATES}
    rendered = [_render_task_log(entry, view, final=final) for entry in logs]
    reason = task_reason(state, logs) if final else ""
    if reason:
        last = rendered[-1]
        last["metadata"] = {**(last.get("metadata") or {}), REASON_KEY: reason}
    return rendered


def _without_conditions(entry: Mapping[str, Any]) -> Mapping[str, Any]:
    """The task log without its condition lines, which end its system_logs."""
    kinds = entry.get(CONDITION_KINDS_KEY)
    lines = entry.get("system_logs")
    if not kinds or not isinstance(kinds, list) or not isinstance(lines, list):
        return entry
    return {**entry, "system_logs": lines[: max(len(lines) - len(kinds), 0)]}


def _render_task_log(entry: Mapping[str, Any], view: View, *, final: bool) -> dict[str, Any]:
    if final:
        entry = _without_conditions(entry)
    log: dict[str, Any] = {}
    for key, value in entry.items():
        if key == "logs":
            value = [
                {
                    k: v
                    for k, v in executor_log.items()
                    if view is View.FULL or k not in ("stdout", "stderr")
                }
                for executor_log in value
            ]
        elif key == CONDITION_KINDS_KEY or (key == "system_logs" and view is not View.FULL):
            continue
        log[key] = value
    # TES requires both lists on every task log, even when empty.
    log.setdefault("logs", [])
    log.setdefault("outputs", [])
    return log
