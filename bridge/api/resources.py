"""Falcon responders: parse the request, call the store, shape the answer. Nothing else.

The API never runs a Slurm command: a cancel is recorded in the store and the poller acts on it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import falcon

from bridge import __version__
from bridge.api.openapi import openapi_document
from bridge.api.output import LiveOutput, OutputRefused, OutputRequest, OutputUnavailable, job_of
from bridge.config import Config
from bridge.core import backend_params
from bridge.core.reasons import canceled_by
from bridge.core.tes import (
    Limits,
    State,
    TaskValidationError,
    ValidatedTask,
    View,
    local_input_problems,
    parse_state,
    parse_view,
    render_task,
    validate_task,
)
from bridge.job.output import OutputChunk, chunk_to_json
from bridge.store import CAPABILITIES_KEY, InvalidPageToken, Store, TaskFilter, TaskRecord
from bridge.system.metrics import TASKS_CREATED, observe_finished
from bridge.system.wake import WakeSender

log = logging.getLogger("bridge.api")

DEFAULT_PAGE_SIZE = 256
#: A create checks the task against the partitions the poller read, read again this often.
CLUSTER_FACTS_SECONDS = 10.0
MAX_PAGE_SIZE = 2047


class RequestError(falcon.HTTPError):
    """A 4xx with our JSON shape; `errors` lists (field, message) pairs."""

    def __init__(self, status: str, message: str, errors: list[tuple[str, str]] | None = None):
        super().__init__(status, description=message)
        self.errors = errors or []


def _bad_request(exc: TaskValidationError) -> RequestError:
    return RequestError(falcon.HTTP_400, str(exc), exc.errors)


def _reject_nan(token: str) -> None:
    raise ValueError(f"{token} is not valid JSON")


def read_json_body(req: falcon.Request, max_bytes: int) -> Any:
    """The body as JSON, whatever the Content-Type says (curl sends a form type by default)."""
    if req.content_length is not None and req.content_length > max_bytes:
        raise RequestError(
            falcon.HTTP_413,
            f"the request body is larger than this server accepts ({max_bytes} bytes)",
        )
    raw = req.bounded_stream.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise RequestError(
            falcon.HTTP_413,
            f"the request body is larger than this server accepts ({max_bytes} bytes)",
        )
    if not raw.strip():
        raise RequestError(falcon.HTTP_400, "the request body is empty; send a JSON object")
    try:
        return json.loads(raw, parse_constant=_reject_nan)
    except (ValueError, RecursionError) as exc:
        raise RequestError(falcon.HTTP_400, f"the request body is not valid JSON: {exc}") from None


class Tasks:
    """`/tasks`: create and list."""

    def __init__(self, config: Config, store: Store, wake: WakeSender | None = None):
        self.config = config
        self.store = store
        self.wake = wake
        # Every document limit comes from the config's [limits] of the same name.
        self.limits = Limits(
            **{name: getattr(config.limits, name) for name in Limits.__dataclass_fields__}
        )
        self._partitions_cache: list[dict[str, Any]] = []
        self._partitions_read_at = float("-inf")

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        task = self.validated(read_json_body(req, self.config.limits.max_body_bytes))
        record = self.store.create_task(
            task.document, system_logs=task.warnings, owner=req.context.identity.user
        )
        TASKS_CREATED.inc()
        if self.wake is not None:
            self.wake.nudge()  # the poller submits it now (bridge.system.wake)
        resp.media = {"id": record.id}

    def validated(self, body: Any) -> ValidatedTask:
        """The posted task as it would be stored, or a 400 naming the field: the TES document,
        then what it asks of Slurm (patterns, the time limit within slurm.max_time, the
        partitions and memory the poller last read)."""
        try:
            task = validate_task(
                body,
                limits=self.limits,
                supported_backend_parameters=self.config.backend_parameters.supported,
                refuse_unsupported_backend_parameters=(
                    self.config.backend_parameters.unsupported == "refuse"
                ),
                allowed_dirs=[str(d) for d in self.config.file_dirs],
                local_image_dirs=[str(d) for d in self.config.container.local_image_dirs],
                drs_prefixes=self.config.staging.drs_prefixes,
            )
            # What the task asks of Slurm (patterns, the time limit within slurm.max_time),
            # then what the cluster and the shared filesystem cannot give it.
            problems = backend_params.check_task(
                task.document, self.config.backend_parameters.supported, self.config.slurm.times
            ) or [
                *backend_params.cluster_problems(task.document, self._partitions()),
                *self._input_problems(task.document),
            ]
            if problems:
                raise TaskValidationError(problems)
        except TaskValidationError as exc:
            raise _bad_request(exc) from None
        return task

    def _input_problems(self, document: dict[str, Any]) -> list[tuple[str, str]]:
        if not self.config.storage.check_inputs:
            return []
        return local_input_problems(document, [str(d) for d in self.config.file_dirs])

    def _partitions(self) -> list[dict[str, Any]]:
        """The partitions the poller last read (bridge.poller.capabilities), read again from
        the store after CLUSTER_FACTS_SECONDS (at each create while none are known); []
        while unknown."""
        now = time.monotonic()
        if not self._partitions_cache or now - self._partitions_read_at >= CLUSTER_FACTS_SECONDS:
            try:
                facts = json.loads(self.store.meta(CAPABILITIES_KEY) or "{}")
                self._partitions_cache = list(facts.get("partitions") or [])
            except (ValueError, AttributeError, TypeError):
                self._partitions_cache = []
            self._partitions_read_at = now
        return self._partitions_cache

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        try:
            view = parse_view(_param(req, "view"))
            state = _param(req, "state")
            task_filter = TaskFilter(
                name_prefix=_param(req, "name_prefix") or None,
                state=parse_state(state).value if state else None,
                tags=_tag_pairs(req, self.config.limits.max_tags),
                owner=req.context.identity.owner_filter,
            )
            page_size = _page_size(_param(req, "page_size"))
            page_token = _param(req, "page_token") or None
        except TaskValidationError as exc:
            raise _bad_request(exc) from None
        try:
            records, next_token = self.store.list_tasks(
                task_filter,
                page_size=page_size,
                page_token=page_token,
                full=view is not View.MINIMAL,
                budget_bytes=self.config.limits.list_budget_bytes,
            )
        except InvalidPageToken as exc:
            raise RequestError(
                falcon.HTTP_400, f"page_token: {exc}", [("page_token", str(exc))]
            ) from None
        result: dict[str, Any] = {"tasks": [_wire(record, view) for record in records]}
        if next_token:
            result["next_page_token"] = next_token
        resp.media = result


def _wire(record: TaskRecord, view: View) -> dict[str, Any]:
    """A stored task as GET and list answer it, in `view`."""
    return render_task(
        task_id=record.id,
        state=record.state,
        document=record.document,
        creation_time=record.creation_time,
        logs=record.logs,
        view=view,
    )


def _no_nul(name: str, value: str) -> str:
    # PostgreSQL cannot take a NUL in a string parameter, and no stored string holds one.
    if "\x00" in value:
        raise TaskValidationError([(name, "must not contain NUL characters")])
    return value


def _param(req: falcon.Request, name: str) -> str | None:
    value = req.get_param(name)
    return None if value is None else _no_nul(name, value)


def _tag_pairs(req: falcon.Request, max_pairs: int) -> list[tuple[str, str | None]]:
    """tag_key/tag_value are paired by position; a missing or empty value matches any value.

    At most `max_pairs` (limits.max_tags, the most tags a task may have) keep the query small."""
    keys = [_no_nul("tag_key", k) for k in req.get_param_as_list("tag_key") or []]
    values = [_no_nul("tag_value", v) for v in req.get_param_as_list("tag_value") or []]
    if len(keys) > max_pairs:
        raise TaskValidationError(
            [("tag_key", f"at most {max_pairs} tag_key parameters allowed on this server")]
        )
    if len(values) > len(keys):
        raise TaskValidationError([("tag_value", "more tag_value than tag_key parameters")])
    pairs = [
        (key, values[i] if i < len(values) and values[i] != "" else None)
        for i, key in enumerate(keys)
    ]
    return list(dict.fromkeys(pairs))


def _page_size(value: str | None) -> int:
    if value is None or value == "":
        return DEFAULT_PAGE_SIZE
    try:
        size = int(value)
    except ValueError:
        size = -1
    if not 1 <= size <= MAX_PAGE_SIZE:
        raise TaskValidationError([("page_size", f"must be an integer from 1 to {MAX_PAGE_SIZE}")])
    return size


class Task:
    """`/tasks/{task_id}` and `/tasks/{task_id}:cancel`."""

    def __init__(self, store: Store, wake: WakeSender | None = None):
        self.store = store
        self.wake = wake

    def on_get(self, req: falcon.Request, resp: falcon.Response, task_id: str) -> None:
        try:
            _no_nul("id", task_id)
            view = parse_view(_param(req, "view"))
        except TaskValidationError as exc:
            raise _bad_request(exc) from None
        # Another owner's task answers 404, as an unknown one: ids are not confirmed to exist.
        owner = req.context.identity.owner_filter
        record = self.store.get_task(task_id, owner=owner, full=view is not View.MINIMAL)
        if record is None:
            raise _not_found(task_id)
        resp.media = _wire(record, view)

    def on_post_cancel(self, req: falcon.Request, resp: falcon.Response, task_id: str) -> None:
        # The body is ignored (the compliance suite sends `{}`).
        try:
            _no_nul("id", task_id)
        except TaskValidationError as exc:
            raise _bad_request(exc) from None
        identity = req.context.identity
        note = canceled_by(identity.user) if identity.user else None
        if note and identity.is_admin:
            note += " (an administrator)"
        record = self.store.cancel_task(task_id, owner=identity.owner_filter, note=note)
        if record is None:
            raise _not_found(task_id)
        if record.canceled_now:
            observe_finished(State.CANCELED.value)
        if record.canceled_now and identity.user:
            # Slurm's accounting shows the owner canceling (scancel runs as them in site mode).
            log.info(
                "task %s canceled by %s",
                task_id,
                identity.user,
                extra={
                    "task_id": task_id,
                    "canceled_by": identity.user,
                    "admin": identity.is_admin,
                },
            )
        if self.wake is not None:
            self.wake.nudge()  # its job is canceled now (bridge.system.wake)
        resp.media = {}


#: What one output request returns at most when it does not say (max_bytes).
DEFAULT_OUTPUT_BYTES = 64 * 1024
MAX_OUTPUT_BYTES = 1024 * 1024


def _int_param(req: falcon.Request, name: str, default: int, low: int, high: int) -> int:
    value = _param(req, name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise TaskValidationError([(name, f"must be an integer from {low} to {high}")])
    return number


def _output_request(req: falcon.Request, executors: int, attempts: int) -> OutputRequest:
    stream = _param(req, "stream") or "stdout"
    if stream not in ("stdout", "stderr"):
        raise TaskValidationError([("stream", "must be stdout or stderr")])
    attempt = _param(req, "attempt")
    return OutputRequest(
        executor=_int_param(req, "executor", 0, 0, max(executors - 1, 0)),
        stream="stdout" if stream == "stdout" else "stderr",
        # Negative: that many bytes before the end (a tail).
        offset=_int_param(req, "offset", 0, -MAX_OUTPUT_BYTES, 2**62),
        max_bytes=_int_param(req, "max_bytes", DEFAULT_OUTPUT_BYTES, 1, MAX_OUTPUT_BYTES),
        attempt=None if not attempt else _int_param(req, "attempt", 1, 1, max(attempts, 1)),
    )


class TaskOutput:
    """`/tasks/{task_id}/output`: a byte range of an executor's stdout or stderr, live.

    An extension of TES: while an executor runs, its log is not in the task document (TES
    requires an `exit_code` on every executor log), so clients that follow output read it here.
    """

    def __init__(self, config: Config, store: Store):
        self.store = store
        self.output = LiveOutput(config)

    def on_get(self, req: falcon.Request, resp: falcon.Response, task_id: str) -> None:
        try:
            _no_nul("id", task_id)
        except TaskValidationError as exc:
            raise _bad_request(exc) from None
        record = self.store.get_task(task_id, owner=req.context.identity.owner_filter)
        if record is None or record.document is None:
            raise _not_found(task_id)
        try:
            request = _output_request(
                req, len(record.document.get("executors") or []), len(record.logs or [])
            )
        except TaskValidationError as exc:
            raise _bad_request(exc) from None
        answer: dict[str, Any] = {
            "id": task_id,
            "state": record.state,
            "attempt": request.attempt or max(record.attempt, len(record.logs or []), 1),
            "executor": request.executor,
            "stream": request.stream,
        }
        job_id = job_of(record, request.attempt)
        if job_id is None:  # not submitted yet: nothing written
            nothing = OutputChunk(
                "", max(request.offset, 0), max(request.offset, 0), 0, False, False
            )
            resp.media = {**answer, **chunk_to_json(nothing)}
            return
        try:
            chunk = self.output.read(record, job_id, request)
        except OutputRefused as exc:
            raise RequestError(falcon.HTTP_409, str(exc)) from None
        except OutputUnavailable as exc:
            raise RequestError(falcon.HTTP_503, str(exc)) from None
        resp.media = {**answer, "slurm_job_id": job_id, **chunk_to_json(chunk)}


def _not_found(task_id: str) -> RequestError:
    return RequestError(falcon.HTTP_404, f"task {task_id!r} not found")


class ServiceInfo:
    def __init__(self, config: Config, store: Store):
        self.config = config
        self.store = store

    def document(self) -> dict[str, Any]:
        info = self.config.service_info
        result: dict[str, Any] = {
            "id": info.id,
            "name": info.name,
            "type": {"group": "org.ga4gh", "artifact": "tes", "version": "1.1.0"},
            "description": info.description,
            "organization": {"name": info.organization_name, "url": info.organization_url},
            "version": __version__,
            "environment": info.environment,
            "storage": self.config.service_storage(),
            "tesResources_backend_parameters": list(self.config.backend_parameters.supported),
        }
        optional = {
            "documentationUrl": info.documentation_url,
            "contactUrl": info.contact_url,
            "createdAt": info.created_at or self.store.meta("created_at"),
            "updatedAt": info.updated_at or self.store.meta("updated_at"),
        }
        result.update({k: v for k, v in optional.items() if v})
        return result

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self.document()


class Capabilities:
    """`/capabilities` (an extension shaped after task-execution-schemas PR #244): what a
    client may ask for and what the partitions offer, as the poller last read them."""

    def __init__(self, config: Config, store: Store):
        self.config = config
        self.store = store

    def document(self) -> dict[str, Any]:
        slurm = self.config.slurm
        supported = {key.lower() for key in self.config.backend_parameters.supported}
        cluster = json.loads(self.store.meta(CAPABILITIES_KEY) or "{}")
        document: dict[str, Any] = {
            "tes_version": "1.1.0",
            "read_at": cluster.get("read_at"),
            "partitions": cluster.get("partitions", []),
            "resources": {
                "cpu_cores": "a number; a fraction (TES 1.2) is rounded up to whole CPUs",
                "ram_gb": "a number; rounded up to whole MB",
                "disk_gb": f"a number; rounded up to whole MB (slurm.disk_request = "
                f"{slurm.disk_request})",
                "preemptible": bool(slurm.preemptible_partition or slurm.preemptible_qos),
                "zones": "partition names"
                + (f": {', '.join(slurm.partitions)}" if slurm.partitions else ""),
            },
            "backend_parameters": [
                {
                    "key": key,
                    "pattern": parameter.pattern.pattern,
                    **({"sbatch_option": parameter.option} if parameter.option else {}),
                    "description": parameter.description,
                }
                for key, parameter in backend_params.BACKEND_PARAMETERS.items()
                if key in supported
            ],
            "time_limit": {"default": slurm.default_time, "maximum": slurm.max_time},
            "admission": {
                "max_jobs_in_flight": slurm.max_jobs_in_flight or None,
                "max_jobs_per_owner": slurm.max_jobs_per_owner or None,
            },
            "container": {
                "runtime": os.path.basename(self.config.container.runtime),
                "version": cluster.get("runtime_version"),
                "gpu_flag": self.config.container.gpu_flag,
            },
        }
        # The Slurm release, once the poller has read it (absent from what older pollers stored).
        if isinstance(cluster.get("slurm"), dict):
            document["slurm"] = {
                "version": cluster["slurm"].get("version"),
                "tested": bool(cluster["slurm"].get("tested")),
            }
        return document

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self.document()


class LegacyServiceInfo(ServiceInfo):
    """`/v1/tasks/service-info` in the pre-1.0 shape: py-tes 0.4 fails on any other key."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        info = self.config.service_info
        resp.media = {
            "name": info.name,
            "doc": info.description,
            "storage": self.config.service_storage(),
        }


class OpenAPI:
    def __init__(self, config: Config):
        self.document = openapi_document(config)

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = self.document
