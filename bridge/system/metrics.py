"""Prometheus metrics: what the API, the poller and the Slurm client count, and the scrape.

The API's gunicorn workers and the poller are separate processes, so the counters and
histograms live in prometheus_client's multiprocess mode: each process writes its own files
in ``PROMETHEUS_MULTIPROC_DIR`` and a scrape sums them. The library reads that variable when
it is first imported, so ``tes-bridge`` sets it (:func:`bridge.cli.serve.prepare_metrics_dir`)
before anything imports this module. The scrape and the HTTP side are in
:mod:`bridge.api.metrics_api`.

Those files are memory-mapped, and prometheus_client makes them sparse: a page first touched
when the filesystem is full cannot be backed, and the kernel kills the process with SIGBUS
(every API worker, as it started, on a full state directory). :class:`AllocatedValues` gives
each file its blocks before they are mapped, and a process whose file cannot have them keeps
its values in memory instead: unscraped, never a crash.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.mmap_dict import _INITIAL_MMAP_SIZE, MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from bridge.core.tes import TERMINAL_STATES

log = logging.getLogger("bridge.system.metrics")


def _entry_size(key: str) -> int:
    """The bytes MmapedDict._init_value appends for `key`: length, padded key, two doubles."""
    encoded = len(key.encode("utf-8"))
    return 4 + encoded + (8 - (encoded + 4) % 8) + 16


class AllocatedValues(MmapedDict):
    """One process's metrics file with its blocks allocated (`posix_fallocate`) before they are
    mapped, when it is created and whenever it grows; where they cannot be allocated (a full
    filesystem), the values of this process stay in memory from then on, said once in the log.

    prometheus_client's multiprocess values open their files through the name `MmapedDict`
    of `prometheus_client.values`, which is pointed here below (tests/unit/test_metrics_files
    checks that the library still does)."""

    #: The process that said its metrics are no longer recorded in files (once each).
    _warned_pid: int | None = None

    def __init__(self, filename: str, read_mode: bool = False):
        self._in_memory = False
        self._memory = bytearray()
        if not read_mode:
            try:
                _allocate(filename)
            except OSError as exc:
                self._keep_in_memory(filename, exc)
                return
        super().__init__(filename, read_mode)  # type: ignore[no-untyped-call]

    def _init_value(self, key: str) -> None:
        needed = self._used + _entry_size(key)
        if needed > self._capacity:
            capacity = self._capacity
            while needed > capacity:
                capacity *= 2
            self._grow(capacity)
        super()._init_value(key)  # type: ignore[no-untyped-call]

    def _grow(self, capacity: int) -> None:
        if not self._in_memory:
            try:
                # The library's own growth then maps blocks that exist.
                os.posix_fallocate(self._f.fileno(), 0, capacity)
                return
            except OSError as exc:
                data = bytearray(self._m[: self._capacity])
                super().close()  # type: ignore[no-untyped-call]  # the file keeps its values
                self._keep_in_memory(self._fname, exc, data)
        self._memory.extend(bytes(capacity - len(self._memory)))
        self._capacity = capacity

    def _keep_in_memory(self, filename: str, error: OSError, data: bytearray | None = None) -> None:
        if AllocatedValues._warned_pid != os.getpid():
            AllocatedValues._warned_pid = os.getpid()
            log.warning(
                "cannot allocate the metrics file %s (%s): this process's metrics are no "
                "longer recorded for /metrics",
                filename,
                error.strerror or error,
            )
        self._in_memory = True
        # The library's close() does nothing without a file.
        self._f = None  # type: ignore[assignment]
        self._fname = filename
        if data is None:
            self._positions = {}
            data = bytearray(_INITIAL_MMAP_SIZE)
            struct.pack_into("i", data, 0, 8)  # the used bytes: the header alone
            self._used = 8
        self._memory = data
        # MmapedDict only slices, assigns and unpacks its map: a bytearray does as well.
        self._m = data  # type: ignore[assignment]
        self._capacity = len(data)

    def close(self) -> None:
        if not self._in_memory:
            super().close()  # type: ignore[no-untyped-call]


def _allocate(filename: str) -> None:
    """Create `filename` if need be, with blocks for its whole size (at least the library's
    initial size) allocated."""
    fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        size = os.fstat(fd).st_size or _INITIAL_MMAP_SIZE
        os.posix_fallocate(fd, 0, size)
    except OSError:
        if os.fstat(fd).st_size == 0:
            os.unlink(filename)  # no empty file for the scrape to read
        raise
    finally:
        os.close(fd)


values.MmapedDict = AllocatedValues  # type: ignore[attr-defined]

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
SLURM_CALLS = Counter(
    "tes_bridge_slurm_calls",
    "Slurm commands run, by command (each one or more RPCs to slurmctld or slurmdbd).",
    ["command"],
)
SLURM_RATE_LIMITED = Counter(
    "tes_bridge_slurm_rate_limited",
    "Retries slurmctld's RPC rate limit asked of a Slurm command, by command; only commands run "
    "with -v report them: sbatch, and scancel outside site mode.",
    ["command"],
)
SLURM_BUDGET_WAITS = Counter(
    "tes_bridge_slurm_budget_waits",
    "Times a Slurm command, or the poller's work that needed one, waited for the call budget "
    "(slurm.calls_per_second), by command.",
    ["command"],
)
POLL_CYCLE = Histogram(
    "tes_bridge_poll_cycle_seconds",
    "Seconds a full poll cycle took (submit, follow jobs, cancel).",
    buckets=SHORT_BUCKETS,
)
#: This node's poller: 1 while it holds the lease (PostgreSQL) or its lock file (SQLite).
#: Each node has its own metrics directory, so a scrape of a node shows that node's poller.
POLLER_LEADER = Gauge(
    "tes_bridge_poller_leader",
    "1 while this node's poller leads (holds the lease), else 0.",
    multiprocess_mode="livesum",
)
POLLER_TAKEOVERS = Counter(
    "tes_bridge_poller_takeovers", "Times this node's poller became the leader."
)
IMAGE_PULLS = Counter("tes_bridge_image_pulls", "Image pulls into the SIF cache started.")
IMAGE_PULL_FAILURES = Counter(
    "tes_bridge_image_pull_failures",
    "Image cache updates that failed: the registry's digest check or the pull.",
)
FINAL_STATES = sorted(state.value for state in TERMINAL_STATES)
TASKS_FINISHED = Counter(
    "tes_bridge_tasks_finished",
    "Tasks that reached a final state, by that state (the poller's decisions, refused "
    "submissions and the API's cancels).",
    ["state"],
)
# The poller alone sets these gauges; "mostrecent" keeps the value of its last write, whatever
# process wrote it (a restarted poller's files replace the old one's values).
#: The heartbeat's name (read back by `read_heartbeat`).
HEARTBEAT = "tes_bridge_poller_last_cycle_timestamp_seconds"
POLLER_LAST_CYCLE = Gauge(
    HEARTBEAT,
    "Unix time at which the poller last finished a cycle (its heartbeat).",
    multiprocess_mode="max",
)
TASKS_HELD_BY_ADMISSION = Gauge(
    "tes_bridge_tasks_held_by_admission",
    "QUEUED tasks the last submission round held back for slurm.max_jobs_in_flight or "
    "slurm.max_jobs_per_owner.",
    multiprocess_mode="mostrecent",
)
ARRAY_GATHER_HELD = Counter(
    "tes_bridge_array_gather_held",
    "Tasks a submission round held back so that their shape could grow into a job array "
    "(slurm.array_gather_seconds), counted once per round.",
)
TASKS_WAITING_FOR_IMAGE = Gauge(
    "tes_bridge_tasks_waiting_for_image",
    "QUEUED tasks of the last submission round waiting for an image pull.",
    multiprocess_mode="mostrecent",
)
WORK_DIR_FREE = Gauge(
    "tes_bridge_work_dir_free_bytes",
    "Bytes free for the service in the filesystem of the work directory (job.work_dir).",
    multiprocess_mode="mostrecent",
)
WORK_DIR_SIZE = Gauge(
    "tes_bridge_work_dir_size_bytes",
    "Size in bytes of the filesystem of the work directory (job.work_dir).",
    multiprocess_mode="mostrecent",
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


_SLURM_COMMANDS = frozenset(["sbatch", "squeue", "sacct", "scancel", "sinfo", "scontrol"])


def init_label_sets() -> None:
    """Failure counters, rate-limit retries (of the commands that report them) and finished
    tasks exist at 0 before their first event, so that a rate or an alert sees a series from
    the start (an absent series is no increase)."""
    for command in sorted(_SLURM_COMMANDS):
        SLURM_FAILURES.labels(command)
    for command in ("sbatch", "scancel"):  # the commands run with -v, which report it
        SLURM_RATE_LIMITED.labels(command)
    for state in FINAL_STATES:
        TASKS_FINISHED.labels(state)


def observe_finished(state: str) -> None:
    if state in FINAL_STATES:
        TASKS_FINISHED.labels(state).inc()


def observe_poller_cycle(seconds: float, now: float, work_dir: str | os.PathLike[str]) -> None:
    """A cycle ended: its duration, the heartbeat, and the work directory's free space."""
    POLL_CYCLE.observe(seconds)
    POLLER_LAST_CYCLE.set(now)
    try:
        stats = os.statvfs(work_dir)
    except OSError:
        return  # a missing work directory is said by the cycle itself; the gauges keep the last
    WORK_DIR_FREE.set(stats.f_bavail * stats.f_frsize)
    WORK_DIR_SIZE.set(stats.f_blocks * stats.f_frsize)


def observe_submission_round(
    held_by_admission: int, waiting_for_image: int, held_to_gather: int = 0
) -> None:
    TASKS_HELD_BY_ADMISSION.set(held_by_admission)
    TASKS_WAITING_FOR_IMAGE.set(waiting_for_image)
    if held_to_gather:
        ARRAY_GATHER_HELD.inc(held_to_gather)


def observe_slurm_command(argv: Sequence[str], seconds: float, failed: bool) -> None:
    # The program's name, never its path or arguments (few, fixed label values);
    # `sudo -n -u OWNER -- sbatch ...` counts as sbatch.
    names = [os.path.basename(word) for word in argv]
    command = next((n for n in names if n in _SLURM_COMMANDS), names[0] if names else "?")
    SLURM_COMMAND.labels(command).observe(seconds)
    SLURM_CALLS.labels(command).inc()
    if failed:
        SLURM_FAILURES.labels(command).inc()


def observe_rate_limited(command: str, retries: int) -> None:
    """slurmctld's RPC rate limit made `command` back off and retry `retries` times."""
    name = os.path.basename(command)
    SLURM_RATE_LIMITED.labels(name if name in _SLURM_COMMANDS else "?").inc(retries)


def observe_budget_wait(command: str) -> None:
    """A Slurm command (or the work that needed one) waited for the call budget."""
    name = os.path.basename(command)
    SLURM_BUDGET_WAITS.labels(name if name in _SLURM_COMMANDS else "?").inc()


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


def read_heartbeat(directory: Path) -> float | None:
    """The poller's heartbeat in a metrics directory, read as a scrape reads it (the newest
    of every process's files) and without writing: for `tes-bridge check`. None: no poller
    has recorded a cycle there."""
    if not directory.is_dir():
        return None
    for metric in MultiProcessCollector(None, path=str(directory)).collect():
        if metric.name == HEARTBEAT:
            newest = max((sample.value for sample in metric.samples), default=0.0)
            return newest or None
    return None


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
        SLURM_CALLS,
        SLURM_RATE_LIMITED,
        SLURM_BUDGET_WAITS,
        POLL_CYCLE,
        IMAGE_PULLS,
        IMAGE_PULL_FAILURES,
        HTTP_REQUESTS,
        HTTP_DURATION,
        TASKS_FINISHED,
        POLLER_LAST_CYCLE,
        TASKS_HELD_BY_ADMISSION,
        ARRAY_GATHER_HELD,
        TASKS_WAITING_FOR_IMAGE,
        WORK_DIR_FREE,
        WORK_DIR_SIZE,
    ):
        result.register(metric)
    return result


init_label_sets()
