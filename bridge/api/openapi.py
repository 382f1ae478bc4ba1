"""The API's own OpenAPI 3 document, served at `<prefix>/openapi.json`.

Request schemas come from the same pydantic models that validate requests (bridge.core.tes), so the
document cannot drift from what the server accepts; response schemas follow TES 1.1.0 and
describe the views as served: in a MINIMAL task only `id` and `state` are present.
"""

from __future__ import annotations

from typing import Any

from bridge import __version__
from bridge.config import Config
from bridge.core.tes import State, TaskModel

_REF = "#/components/schemas/"
#: ExecutorLog.stdout/stderr as this server fills them (bridge.job.excerpt).
EXCERPT = (
    "The executor's {stream} (FULL view): all of it up to job.log_tail_bytes (10 KiB), else its "
    "head and tail with a line between them: `[tes-bridge: N of M bytes left out here; the "
    "whole {stream}: GET /ga4gh/tes/v1/tasks/ID/output?executor=I&stream={stream}]`."
)


def _string(description: str = "") -> dict[str, Any]:
    return {"type": "string", "description": description} if description else {"type": "string"}


def _response_schemas(request_properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "tesState": {"type": "string", "enum": [s.value for s in State]},
        "tesExecutorLog": {
            "type": "object",
            "required": ["exit_code"],
            "properties": {
                "start_time": _string("RFC 3339"),
                "end_time": _string("RFC 3339"),
                "stdout": _string(EXCERPT.format(stream="stdout")),
                "stderr": _string(EXCERPT.format(stream="stderr")),
                "exit_code": {"type": "integer", "format": "int32"},
            },
        },
        "tesOutputFileLog": {
            "type": "object",
            "required": ["url", "path", "size_bytes"],
            "properties": {
                "url": _string(),
                "path": _string(),
                "size_bytes": _string("int64 as a string"),
            },
        },
        "tesTaskLog": {
            "type": "object",
            "required": ["logs", "outputs"],
            "properties": {
                "logs": {"type": "array", "items": {"$ref": _REF + "tesExecutorLog"}},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                "start_time": _string("RFC 3339"),
                "end_time": _string("RFC 3339"),
                "outputs": {"type": "array", "items": {"$ref": _REF + "tesOutputFileLog"}},
                "system_logs": {"type": "array", "items": {"type": "string"}},
            },
        },
        "tesTask": {
            "type": "object",
            "description": (
                "A task in one view. MINIMAL: `id` and `state` only. BASIC: the task as its "
                "client sent it (without input `content`), `creation_time` and `logs` without "
                "`system_logs` and executor `stdout`/`stderr`. FULL: everything. So only `id` "
                "and `state` are always present."
            ),
            "required": ["id", "state"],
            "properties": {
                **request_properties,
                "id": _string(),
                "state": {"$ref": _REF + "tesState"},
                "logs": {"type": "array", "items": {"$ref": _REF + "tesTaskLog"}},
                "creation_time": _string("RFC 3339"),
            },
        },
        "tesCreateTaskResponse": {
            "type": "object",
            "required": ["id"],
            "properties": {"id": _string()},
        },
        "tesListTasksResponse": {
            "type": "object",
            "required": ["tasks"],
            "properties": {
                "tasks": {"type": "array", "items": {"$ref": _REF + "tesTask"}},
                "next_page_token": _string(),
            },
        },
        "tesCancelTaskResponse": {"type": "object"},
        "ExecutorOutput": {
            "type": "object",
            "description": (
                "An extension of TES: a byte range of an executor's stdout or stderr, readable "
                "while it runs (the task document lists an executor's log only once it has an "
                "exit code). Follow a stream by asking again from `next_offset` until `done`, or "
                "until the task's `state` is final and `next_offset` has reached `size`."
            ),
            "required": [
                "id",
                "state",
                "attempt",
                "executor",
                "stream",
                "text",
                "offset",
                "next_offset",
                "size",
                "done",
                "started",
            ],
            "properties": {
                "id": _string(),
                "state": {"$ref": _REF + "tesState"},
                "attempt": {"type": "integer", "description": "1-based"},
                "executor": {"type": "integer"},
                "stream": {"type": "string", "enum": ["stdout", "stderr"]},
                "slurm_job_id": _string("The attempt's Slurm job (absent before it has one)."),
                "text": _string("The bytes read, as UTF-8 (invalid bytes replaced)."),
                "offset": {"type": "integer", "description": "The byte offset of `text`."},
                "next_offset": {"type": "integer", "description": "Where to continue."},
                "size": {"type": "integer", "description": "The stream's size in bytes now."},
                "done": {"type": "boolean", "description": "The executor has finished."},
                "started": {"type": "boolean", "description": "The executor has started."},
            },
        },
        "Error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "integer"},
                "message": _string(),
                "errors": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"field": _string(), "message": _string()},
                    },
                },
            },
        },
    }


def _query_integer(
    name: str,
    description: str,
    minimum: int | None = None,
    maximum: int | None = None,
    default: int | None = None,
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for key, value in (("minimum", minimum), ("maximum", maximum), ("default", default)):
        if value is not None:
            schema[key] = value
    return {"name": name, "in": "query", "description": description, "schema": schema}


def _json_response(schema: str, description: str = "OK") -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF + schema}}},
    }


def openapi_document(config: Config) -> dict[str, Any]:
    request = TaskModel.model_json_schema(ref_template=_REF + "{model}", mode="validation")
    schemas = request.pop("$defs", {})
    schemas["tesTaskRequest"] = request
    schemas.update(_response_schemas(request["properties"]))
    errors = {
        "400": _json_response("Error", "The request is malformed; `errors` names the fields."),
        "404": _json_response("Error", "No such task."),
        "default": _json_response("Error", "Any other error (401, 405, 413, 503, ...)."),
    }
    view = {
        "name": "view",
        "in": "query",
        "schema": {"type": "string", "enum": ["MINIMAL", "BASIC", "FULL"], "default": "MINIMAL"},
    }
    task_id = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        # 3.1: its schemas are JSON Schema 2020-12, which pydantic writes (`"type": "null"`).
        "openapi": "3.1.0",
        "info": {
            "title": config.service_info.name,
            "description": "GA4GH Task Execution Service 1.1.0 on Slurm",
            "version": __version__,
        },
        "servers": [{"url": "/ga4gh/tes/v1"}, {"url": "/v1"}],
        "paths": {
            "/service-info": {
                "get": {
                    "operationId": "GetServiceInfo",
                    "responses": {"200": {"description": "GA4GH service-info with TES fields"}},
                }
            },
            "/capabilities": {
                "get": {
                    "operationId": "GetCapabilities",
                    "description": (
                        "An extension, shaped after task-execution-schemas PR #244: each "
                        "partition's nodes, CPUs, memory, time limit and GPUs (read by the "
                        "poller with one sinfo, again after "
                        "slurm.capabilities_refresh_seconds), the supported backend_parameters "
                        "with their patterns, the time limits, admission limits, the "
                        "container runtime and, once the poller has read it, the Slurm release "
                        "(slurm: version, tested). Not part of service-info: strict TES 1.1 "
                        "clients refuse unknown keys there."
                    ),
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "default": errors["default"],
                    },
                }
            },
            "/tasks": {
                "get": {
                    "operationId": "ListTasks",
                    "parameters": [
                        {"name": "name_prefix", "in": "query", "schema": {"type": "string"}},
                        {"name": "state", "in": "query", "schema": {"$ref": _REF + "tesState"}},
                        {
                            "name": "tag_key",
                            "in": "query",
                            "schema": {"type": "array", "items": {"type": "string"}},
                        },
                        {
                            "name": "tag_value",
                            "in": "query",
                            "schema": {"type": "array", "items": {"type": "string"}},
                        },
                        {
                            "name": "page_size",
                            "in": "query",
                            "schema": {
                                "type": "integer",
                                "minimum": 1,
                                "maximum": 2047,
                                "default": 256,
                            },
                        },
                        {"name": "page_token", "in": "query", "schema": {"type": "string"}},
                        view,
                    ],
                    "responses": {"200": _json_response("tesListTasksResponse"), **errors},
                },
                "post": {
                    "operationId": "CreateTask",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": _REF + "tesTaskRequest"}}
                        },
                    },
                    "responses": {
                        "200": _json_response("tesCreateTaskResponse"),
                        "400": errors["400"],
                        "413": _json_response("Error", "The request body is too large."),
                        "default": errors["default"],
                    },
                },
            },
            "/tasks:test-only": {
                "post": {
                    "operationId": "TestTask",
                    "description": (
                        "An extension: where and when Slurm would start this task "
                        "(sbatch --test-only of the job script it would get), without creating "
                        "it. The task is checked as CreateTask checks it. The answer: "
                        "start_time, nodes, processors, partition, preempts (job ids), slurm "
                        "(Slurm's own line); or refused (Slurm's reason) where Slurm would "
                        "refuse such a job. 503 with Retry-After while the poller cannot ask."
                    ),
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": _REF + "tesTaskRequest"}}
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "400": errors["400"],
                        "503": {
                            **_json_response(
                                "Error",
                                "Slurm cannot be asked now (no poller answers, the call "
                                "budget is spent, or Slurm does not answer); the task itself "
                                "passed every check: ask again after Retry-After seconds.",
                            ),
                            "headers": {
                                "Retry-After": {
                                    "required": True,
                                    "schema": {"type": "integer", "minimum": 1},
                                }
                            },
                        },
                        "default": errors["default"],
                    },
                }
            },
            "/tasks/{id}": {
                "get": {
                    "operationId": "GetTask",
                    "parameters": [task_id, view],
                    "responses": {"200": _json_response("tesTask"), **errors},
                }
            },
            "/tasks/{id}/output": {
                "get": {
                    "operationId": "GetExecutorOutput",
                    "description": (
                        "Live output of an executor (an extension of TES), with the same "
                        "access rules as GetTask."
                    ),
                    "parameters": [
                        task_id,
                        _query_integer("executor", "0-based", minimum=0, default=0),
                        {
                            "name": "stream",
                            "in": "query",
                            "schema": {
                                "type": "string",
                                "enum": ["stdout", "stderr"],
                                "default": "stdout",
                            },
                        },
                        _query_integer(
                            "offset",
                            "Byte offset to read from; negative: that many bytes before the end.",
                            minimum=-1048576,
                            default=0,
                        ),
                        _query_integer("max_bytes", "At most this many bytes.", 1, 1048576, 65536),
                        _query_integer("attempt", "1-based; the latest by default.", minimum=1),
                    ],
                    "responses": {
                        "200": _json_response("ExecutorOutput"),
                        **errors,
                        "409": _json_response(
                            "Error", "The stream is a link or not a regular file: never read."
                        ),
                    },
                }
            },
            "/tasks/{id}:cancel": {
                "post": {
                    "operationId": "CancelTask",
                    "parameters": [task_id],
                    "responses": {"200": _json_response("tesCancelTaskResponse"), **errors},
                }
            },
        },
        "components": {"schemas": schemas},
    }
