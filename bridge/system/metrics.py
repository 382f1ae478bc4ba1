"""Prometheus metrics: what the API, the poller and the Slurm client count, and the scrape.

The API's gunicorn workers and the poller are separate processes, so the counters and
histograms live in prometheus_client's multiprocess mode: each process writes its own files
in ``PROMETHEUS_MULTIPROC_DIR`` and a scrape sums them. The library reads that variable when
it is first imported, so ``tes-bridge`` sets it (:func:`bridge.cli.serve.prepare_metrics_dir`)
before anything imports this module. The scrape and the HTTP side are in
:mod:`bridge.api.metrics_api`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

#: Seconds from a task's creation to its job's start: Slurm queueing dominates.
LATENCY_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600)
#: Seconds from a job's start to its end.
RUN_BUCKETS = (1, 5, 10, 30, 60, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600, 48 * 3600)
#: Seconds a Slurm command or an HTTP request takes.
SHORT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

TASKS_CREATED = Counter("tes_bridge_tasks_created", "Tasks created through the API.")
SUBMIT_LATENCY = Histogram(
    "tes_bridge_task_submit_latency_seconds",
    "Seconds from a task's creation to the start of its Slurm job.",
    buckets=LATENCY_BUCKETS,
)
RUN_TIME = Histogram(
    "tes_bridge_task_run_seconds",
    "Seconds from the start of a task's Slurm job to its end, per finished attempt.",
    buckets=RUN_BUCKETS,
)
SLURM_COMMAND = Histogram(
    "tes_bridge_slurm_command_seconds",
    "Seconds a Slurm command took, by command.",
    ["command"],
    buckets=SHORT_BUCKETS,
)
SLURM_FAILURES = Counter(
    "tes_bridge_slurm_command_failures",
    "Slurm commands that exited non-zero, timed out or could not start, by command.",
    ["command"],
)
POLL_CYCLE = Histogram(
    "tes_bridge_poll_cycle_seconds",
    "Seconds a full poll cycle took (submit, follow jobs, cancel).",
    buckets=SHORT_BUCKETS,
)
IMAGE_PULLS = Counter("tes_bridge_image_pulls", "Image pulls into the SIF cache started.")
IMAGE_PULL_FAILURES = Counter(
    "tes_bridge_image_pull_failures",
    "Image cache updates that failed: the registry's digest check or the pull.",
)
HTTP_REQUESTS = Counter(
    "tes_bridge_http_requests",
    "HTTP requests answered, by method, route template and status.",
    ["method", "route", "status"],
)
HTTP_DURATION = Histogram(
    "tes_bridge_http_request_seconds",
    "Seconds the app took to answer, by method and route template.",
    ["method", "route"],
    buckets=SHORT_BUCKETS,
)


_SLURM_COMMANDS = frozenset(["sbatch", "squeue", "sacct", "scancel", "sinfo"])


def observe_slurm_command(argv: Sequence[str], seconds: float, failed: bool) -> None:
    # The program's name, never its path or arguments (few, fixed label values);
    # `sudo -n -u OWNER -- sbatch ...` counts as sbatch.
    names = [os.path.basename(word) for word in argv]
    command = next((n for n in names if n in _SLURM_COMMANDS), names[0] if names else "?")
    SLURM_COMMAND.labels(command).observe(seconds)
    if failed:
        SLURM_FAILURES.labels(command).inc()


def _seconds_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    except ValueError:
        return None


#: TES states in which a task's job has not started yet.
_NOT_STARTED = {"QUEUED", "INITIALIZING"}


def observe_task_change(
    creation_time: str | None, attempt_log: dict[str, Any], before: str, after: str, final: bool
) -> None:
    """A task went from `before` to `after` with `attempt_log` (a TES log entry): the submit
    latency when its job started, the run time when the attempt ended."""
    started = attempt_log.get("start_time")
    if before in _NOT_STARTED and after not in _NOT_STARTED:
        latency = _seconds_between(creation_time, started)
        if latency is not None and latency >= 0:
            SUBMIT_LATENCY.observe(latency)
    if final:
        run = _seconds_between(started, attempt_log.get("end_time"))
        if run is not None and run >= 0:
            RUN_TIME.observe(run)


def registry() -> CollectorRegistry:
    """A registry of every process's metrics (this process's alone outside multiprocess
    mode: tests, or `create_app` run outside `tes-bridge`)."""
    result = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(result)
        return result
    for metric in (
        TASKS_CREATED,
        SUBMIT_LATENCY,
        RUN_TIME,
        SLURM_COMMAND,
        SLURM_FAILURES,
        POLL_CYCLE,
        IMAGE_PULLS,
        IMAGE_PULL_FAILURES,
        HTTP_REQUESTS,
        HTTP_DURATION,
    ):
        result.register(metric)
    return result
