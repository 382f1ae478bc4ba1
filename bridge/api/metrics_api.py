"""The HTTP side of the metrics: `GET /metrics` and the request counts (a Falcon middleware)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
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
    """Tasks by state, read from the store at scrape time (one GROUP BY); with
    `oldest_queued` (the creation time of the oldest QUEUED task), that task's age."""

    def __init__(
        self,
        count_by_state: Callable[[], dict[str, int]],
        oldest_queued: Callable[[], float | None] | None = None,
    ):
        self.count_by_state = count_by_state
        self.oldest_queued = oldest_queued

    def collect(self) -> Iterator[Metric]:
        counts = self.count_by_state()
        family = GaugeMetricFamily(
            "tes_bridge_tasks", "Tasks in the store by state.", labels=["state"]
        )
        for state in State:
            family.add_metric([state.value], counts.get(state.value, 0))
        yield family
        if self.oldest_queued is not None:
            created = self.oldest_queued()
            age = GaugeMetricFamily(
                "tes_bridge_oldest_queued_task_age_seconds",
                "Seconds since the oldest task in QUEUED was created (0: no task is QUEUED).",
            )
            age.add_metric([], 0.0 if created is None else max(0.0, time.time() - created))
            yield age


class StateDirSpace:
    """This node's state directory's filesystem (the SQLite database, the metrics files),
    read at scrape time: an API answers for its own node, whichever node's poller leads."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir

    def collect(self) -> Iterator[Metric]:
        try:
            stats = os.statvfs(self.state_dir)
        except OSError:
            return
        for name, what, value in (
            ("free", "Bytes free for the service in", stats.f_bavail * stats.f_frsize),
            ("size", "Size in bytes of", stats.f_blocks * stats.f_frsize),
        ):
            family = GaugeMetricFamily(
                f"tes_bridge_state_dir_{name}_bytes",
                f"{what} the filesystem of this node's state directory (state_dir).",
            )
            family.add_metric([], value)
            yield family


class BuildInfo:
    """`tes_bridge_build_info{version}` 1: which version answers (a dashboard's annotation)."""

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tes_bridge_build_info", "The bridge's version; always 1.", labels=["version"]
        )
        family.add_metric([__version__], 1)
        yield family


@dataclass(frozen=True)
class Readings:
    """What a scrape reads at its own time, beside the processes' files: the store's tasks by
    state and its oldest QUEUED task, and this node's state directory."""

    count_by_state: Callable[[], dict[str, int]]
    oldest_queued: Callable[[], float | None] | None = None
    state_dir: Path | None = None


def _registry(readings: Readings) -> CollectorRegistry:
    collected = metrics.registry()
    collected.register(TaskStates(readings.count_by_state, readings.oldest_queued))
    if readings.state_dir is not None:
        collected.register(StateDirSpace(readings.state_dir))
    collected.register(BuildInfo())
    return collected


def scrape(count_by_state: Callable[[], dict[str, int]] | Readings) -> bytes:
    """The text exposition of every process's metrics and the store's task states."""
    if not isinstance(count_by_state, Readings):
        count_by_state = Readings(count_by_state)
    return generate_latest(_registry(count_by_state))


class _Scrape:
    """Every process's metrics and the store's task states, for prometheus_client's server."""

    def __init__(self, readings: Readings):
        self.readings = readings

    def collect(self) -> Iterator[Metric]:
        yield from _registry(self.readings).collect()


def serve_metrics(bind: str, readings: Readings) -> None:
    """`metrics.bind`: the metrics on an address of their own, served by prometheus_client's
    server in a daemon thread of this process (gunicorn's master), without authentication."""
    host, _, port = bind.rpartition(":")
    start_wsgi_server(int(port), host.strip("[]"), registry=_Scrape(readings))


class MetricsResource:
    """`GET /metrics`: for admins (every caller when auth.mode is none, on loopback)."""

    def __init__(self, readings: Readings):
        self.readings = readings

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        identity = req.context.identity
        if identity is None or not identity.is_admin:
            raise falcon.HTTPForbidden(description="metrics are for admins (auth.admin_users)")
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = scrape(self.readings)


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
