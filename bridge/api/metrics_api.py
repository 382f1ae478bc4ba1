"""The HTTP side of the metrics: `GET /metrics` and the request counts (a Falcon middleware)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import falcon
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
    start_wsgi_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from bridge import __version__
from bridge.core.tes import State
from bridge.system import metrics


class TaskStates:
    """Tasks by state, read from the store at scrape time (one GROUP BY)."""

    def __init__(self, count_by_state: Callable[[], dict[str, int]]):
        self.count_by_state = count_by_state

    def collect(self) -> Iterator[Metric]:
        counts = self.count_by_state()
        family = GaugeMetricFamily(
            "tes_bridge_tasks", "Tasks in the store by state.", labels=["state"]
        )
        for state in State:
            family.add_metric([state.value], counts.get(state.value, 0))
        yield family


class BuildInfo:
    """`tes_bridge_build_info{version}` 1: which version answers (a dashboard's annotation)."""

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tes_bridge_build_info", "The bridge's version; always 1.", labels=["version"]
        )
        family.add_metric([__version__], 1)
        yield family


def _registry(count_by_state: Callable[[], dict[str, int]]) -> CollectorRegistry:
    collected = metrics.registry()
    collected.register(TaskStates(count_by_state))
    collected.register(BuildInfo())
    return collected


def scrape(count_by_state: Callable[[], dict[str, int]]) -> bytes:
    """The text exposition of every process's metrics and the store's task states."""
    return generate_latest(_registry(count_by_state))


class _Scrape:
    """Every process's metrics and the store's task states, for prometheus_client's server."""

    def __init__(self, count_by_state: Callable[[], dict[str, int]]):
        self.count_by_state = count_by_state

    def collect(self) -> Iterator[Metric]:
        yield from _registry(self.count_by_state).collect()


def serve_metrics(bind: str, count_by_state: Callable[[], dict[str, int]]) -> None:
    """`metrics.bind`: the metrics on an address of their own, served by prometheus_client's
    server in a daemon thread of this process (gunicorn's master), without authentication."""
    host, _, port = bind.rpartition(":")
    start_wsgi_server(int(port), host.strip("[]"), registry=_Scrape(count_by_state))


class MetricsResource:
    """`GET /metrics`: for admins (every caller when auth.mode is none, on loopback)."""

    def __init__(self, count_by_state: Callable[[], dict[str, int]]):
        self.count_by_state = count_by_state

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        identity = req.context.identity
        if identity is None or not identity.is_admin:
            raise falcon.HTTPForbidden(description="metrics are for admins (auth.admin_users)")
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = scrape(self.count_by_state)


class RequestMetrics:
    """Falcon middleware: requests by route template (never a raw task id) and status."""

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.metrics_started = time.perf_counter()

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: Any, req_succeeded: bool
    ) -> None:
        started = getattr(req.context, "metrics_started", None)
        if started is None:
            return
        route = req.uri_template or "unmatched"
        metrics.HTTP_REQUESTS.labels(req.method, route, str(resp.status_code)).inc()
        metrics.HTTP_DURATION.labels(req.method, route).observe(time.perf_counter() - started)
