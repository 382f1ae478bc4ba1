"""The Falcon application: routes under both prefixes, one error shape, request logging.

`create_app(config, store=...)` builds the app from its collaborators (tests pass their own);
`get_app()` is what gunicorn loads: ``gunicorn 'bridge.api.app:get_app()'``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import falcon

from bridge.api.auth import Authenticator, AuthError, NoLocalUser, build_authenticator
from bridge.api.estimate import TaskTestOnly
from bridge.api.metrics_api import MetricsResource, Readings, RequestMetrics
from bridge.api.resources import (
    Capabilities,
    LegacyServiceInfo,
    OpenAPI,
    RequestError,
    ServiceInfo,
    Task,
    TaskOutput,
    Tasks,
)
from bridge.api.ui import add_routes as add_ui_routes
from bridge.api.ui import is_ui_path
from bridge.api.ui_data import add_routes as add_ui_data_routes
from bridge.config import Config, load_config
from bridge.store import Store, unavailable_reason
from bridge.system.wake import WakeSender

#: The spec's base path, and the one most clients use (Nextflow, py-tes, Funnel's CLI, Cromwell).
PREFIXES = ("/ga4gh/tes/v1", "/v1")

access_log = logging.getLogger("bridge.access")
error_log = logging.getLogger("bridge.error")


class DatabaseSession:
    """A database connection for each request, returned (or pooled) when the answer is out."""

    def __init__(self, store: Store):
        self.store = store

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.store.db.connect(reuse_if_open=True)

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: Any, req_succeeded: bool
    ) -> None:
        # SQLite keeps the worker's one connection open: opening one runs the pragmas and
        # closing the last one checkpoints the WAL, together ~1.5 ms of every request.
        if not self.store.is_sqlite and not self.store.db.is_closed():
            self.store.db.close()


class Authentication:
    """Sets `req.context.identity` (user, is_admin); a 401 when the credentials do not do.

    service-info (both shapes), the OpenAPI document and the web page's static files stay
    public: those exact paths, not every path ending like them (`/tasks/openapi.json` is a task
    id, and needs an identity); the page's data comes from the API, with credentials.
    The 401 never says which part of the credentials was wrong; the reason goes to the log.
    Good credentials that name no local Unix user are a 403 that says so.
    """

    PUBLIC_PATHS = frozenset(
        [f"{p}/{name}" for p in PREFIXES for name in ("service-info", "openapi.json")]
        + ["/v1/tasks/service-info"]
    )

    def __init__(self, authenticator: Authenticator):
        self.authenticator = authenticator

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.path in self.PUBLIC_PATHS or is_ui_path(req.path):
            req.context.identity = None
            return
        try:
            req.context.identity = self.authenticator.authenticate(req.get_header("Authorization"))
        except NoLocalUser as exc:
            error_log.warning("access refused for %s %s: %s", req.method, req.path, exc)
            raise falcon.HTTPForbidden(description=exc.public) from None
        except AuthError as exc:
            error_log.info("authentication refused for %s %s: %s", req.method, req.path, exc)
            challenge = self.authenticator.challenge
            raise falcon.HTTPUnauthorized(
                description="authentication required",
                challenges=[challenge] if challenge else None,
            ) from None


class AccessLog:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.started = time.perf_counter()

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: Any, req_succeeded: bool
    ) -> None:
        if not self.enabled:
            return
        access_log.info(
            "%s %s %s",
            req.method,
            req.relative_uri,
            resp.status_code,
            extra={
                "method": req.method,
                "path": req.path,
                "query": req.query_string,
                "status": resp.status_code,
                "duration_ms": round((time.perf_counter() - req.context.started) * 1000, 2),
                "remote": req.remote_addr,
                "user": getattr(getattr(req.context, "identity", None), "user", None),
            },
        )


def _error_body(status_code: int, message: str, errors: list[tuple[str, str]]) -> dict[str, Any]:
    body: dict[str, Any] = {"code": status_code, "message": message}
    if errors:
        body["errors"] = [
            {"field": field, "message": text} if field else {"message": text}
            for field, text in errors
        ]
    return body


def _serialize_error(req: falcon.Request, resp: falcon.Response, exc: falcon.HTTPError) -> None:
    """Every error answer has the same JSON shape: code, message and, for 400, the fields."""
    errors = exc.errors if isinstance(exc, RequestError) else []
    message = exc.description or exc.title or "error"
    if exc.status_code == 405:
        message = f"method {req.method} is not allowed on {req.path}"
    elif exc.status_code == 404 and not isinstance(exc, RequestError):
        message = f"no such endpoint: {req.path}"
    resp.content_type = falcon.MEDIA_JSON
    resp.media = _error_body(exc.status_code, message, errors)


#: Seconds a client is asked to wait when the database cannot take a request.
RETRY_AFTER_SECONDS = 30


def _handle_unexpected(
    req: falcon.Request, resp: falcon.Response, ex: Exception, params: Any
) -> None:
    if isinstance(ex, falcon.HTTPError):
        raise ex
    reason = unavailable_reason(ex)
    if reason:
        # A full or locked SQLite database rolled the transaction back: nothing was written.
        error_log.error("%s %s refused: %s", req.method, req.path, reason)
        raise falcon.HTTPServiceUnavailable(
            description=f"{reason}; retry later",
            retry_after=RETRY_AFTER_SECONDS,
        )
    error_log.exception("unhandled error in %s %s", req.method, req.path)
    raise falcon.HTTPInternalServerError(description="internal error; see the server log")


def create_app(
    config: Config, *, store: Store, authenticator: Authenticator | None = None
) -> falcon.App[falcon.Request, falcon.Response]:
    authentication = Authentication(authenticator or build_authenticator(config))
    app: falcon.App[falcon.Request, falcon.Response] = falcon.App(
        middleware=[
            RequestMetrics(),
            AccessLog(config.server.access_log),
            authentication,
            DatabaseSession(store),
        ],
        cors_enable=False,
    )
    app.req_options.keep_blank_qs_values = True
    app.req_options.auto_parse_qs_csv = False
    app.set_error_serializer(_serialize_error)
    app.add_error_handler(Exception, _handle_unexpected)

    # One socket per worker, shared by its threads; the nudge is a hint (bridge.system.wake).
    wake = WakeSender(config.state_dir)
    tasks = Tasks(config, store, wake)
    test_only = TaskTestOnly(config, tasks)
    task = Task(store, wake)
    output = TaskOutput(config, store)
    service_info = ServiceInfo(config, store)
    capabilities = Capabilities(config, store)
    openapi = OpenAPI(config)
    # The literal `service-info` segment wins over `{task_id}` in Falcon's router.
    app.add_route("/v1/tasks/service-info", LegacyServiceInfo(config, store))
    for prefix in PREFIXES:
        app.add_route(f"{prefix}/service-info", service_info)
        app.add_route(f"{prefix}/tasks", tasks)
        app.add_route(f"{prefix}/tasks:test-only", test_only)
        app.add_route(f"{prefix}/tasks/{{task_id}}", task)
        app.add_route(f"{prefix}/tasks/{{task_id}}:cancel", task, suffix="cancel")
        app.add_route(f"{prefix}/tasks/{{task_id}}/output", output)
        app.add_route(f"{prefix}/openapi.json", openapi)
        app.add_route(f"{prefix}/capabilities", capabilities)
    add_ui_routes(app)
    add_ui_data_routes(app, config, store)
    if config.metrics.enabled and not config.metrics.bind:
        readings = Readings(store.count_by_state, store.oldest_queued_time, config.state_dir)
        app.add_route("/metrics", MetricsResource(readings))
    return app


def get_app() -> falcon.App[falcon.Request, falcon.Response]:
    """Entry point for gunicorn workers: configuration from the environment."""
    config = load_config()
    return create_app(config, store=Store.from_url(config.database_url))
