"""`tes-bridge task list`: filters as Slurm users write them (several states, a time window),
the table (with the Slurm job, elapsed time, exit code, peak memory and the reason a task
failed, as this bridge records them), and `--watch`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from bridge.client.api import TesClient
from bridge.client.watch import expected_start

STATES = (
    "UNKNOWN",
    "QUEUED",
    "INITIALIZING",
    "RUNNING",
    "PAUSED",
    "COMPLETE",
    "EXECUTOR_ERROR",
    "SYSTEM_ERROR",
    "CANCELED",
    "PREEMPTED",
    "CANCELING",
)
#: Names for several states: `failed` is every way a task ends without completing on its own
#: terms (a cancel is the user's own doing).
STATE_ALIASES = {"FAILED": ("EXECUTOR_ERROR", "SYSTEM_ERROR", "PREEMPTED")}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def states_option(value: str) -> list[str]:
    """`running,QUEUED` -> ["RUNNING", "QUEUED"] (any case, comma-separated; `failed` for
    EXECUTOR_ERROR, SYSTEM_ERROR and PREEMPTED)."""
    words = [word.strip().upper() for word in value.split(",") if word.strip()]
    states = [state for word in words for state in STATE_ALIASES.get(word, (word,))]
    unknown = [state for state in states if state not in STATES]
    if unknown or not states:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected states among {', '.join(STATES)}, or failed (any case, "
            "comma-separated)"
        )
    return states


def since_option(value: str, now: datetime | None = None) -> datetime:
    """`2h`, `30m`, `1d` ago, or a date/time (`2026-11-25`, `2026-11-25T10:00`, UTC unless it
    says otherwise)."""
    now = now or datetime.now(UTC)
    match = _DURATION.fullmatch(value.strip().lower())
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected a duration (30m, 2h, 1d, 1w) or a date/time (2026-11-25T10:00)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def created(task: dict[str, Any]) -> datetime | None:
    try:
        moment = datetime.fromisoformat(str(task.get("creation_time")))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def matching_tasks(client: TesClient, args: argparse.Namespace, view: str) -> list[dict[str, Any]]:
    """Newest first: one listing per state asked for (the API filters on one), merged, down
    to `--since` and `--limit`."""
    states: list[str | None] = list(dict.fromkeys(s for group in args.state for s in group))
    listings = [
        _since(
            client.tasks(
                state=state,
                name_prefix=args.name_prefix,
                tags=args.tag,
                view=view,
                page_size=args.page_size,
                limit=args.limit,
            ),
            args.since,
        )
        for state in states or [None]
    ]
    tasks = [task for listing in listings for task in listing]
    if len(listings) > 1:
        epoch = datetime.min.replace(tzinfo=UTC)
        tasks.sort(key=lambda task: created(task) or epoch, reverse=True)
    return tasks[: args.limit] if args.limit else tasks


def _since(tasks: Iterator[dict[str, Any]], since: datetime | None) -> list[dict[str, Any]]:
    """The tasks created at or after `since`; the listing is newest first, so it stops at the
    first older one (no further pages are read)."""
    kept = []
    for task in tasks:
        moment = created(task)
        if since is not None and moment is not None and moment < since:
            break
        kept.append(task)
    return kept


# ------------------------------------------------------------------------------ the table
def _when(value: Any) -> str:
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        return str(value or "")
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return f"{moment:%Y-%m-%d %H:%M:%S}"


def duration(seconds: float) -> str:
    """As sacct writes Elapsed: `[D-]HH:MM:SS` (`00:00:05`, `1-02:03:04`)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{clock}" if days else clock


def size(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return ""
    for unit in ("B", "K", "M", "G"):
        if number < 1024:
            return f"{number:.0f}{unit}" if unit == "B" else f"{number:.1f}{unit}"
        number /= 1024
    return f"{number:.1f}T"


def _elapsed(attempt: dict[str, Any], metadata: dict[str, Any], now: datetime) -> str:
    if metadata.get("slurm_elapsed_seconds"):
        try:
            return duration(float(metadata["slurm_elapsed_seconds"]))
        except ValueError:
            pass
    try:
        start = datetime.fromisoformat(str(attempt.get("start_time")))
        end = datetime.fromisoformat(str(attempt["end_time"])) if attempt.get("end_time") else now
    except ValueError:
        return ""
    return duration(max((end - start).total_seconds(), 0.0))


def _positive(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def peak_memory(metadata: dict[str, Any]) -> float | None:
    """The attempt's peak memory as the web page shows it: sacct's MaxRSS where it measured one,
    else the peak of the job's memory cgroup. sacct's MaxRSS is sampled
    (JobAcctGatherFrequency): a job shorter than a sample has none, or 0, while its cgroup kept
    the true peak."""
    return _positive(metadata.get("slurm_max_rss_bytes")) or _positive(
        metadata.get("memory_peak_bytes")
    )


def exit_code(attempt: dict[str, Any]) -> str:
    """The first failing executor's exit code, else the last one's ("" before any ended)."""
    codes = [log.get("exit_code") for log in attempt.get("logs") or [] if log]
    codes = [code for code in codes if isinstance(code, int)]
    failing = [code for code in codes if code != 0]
    return str(failing[0] if failing else codes[-1]) if codes else ""


def _elapsed_or_start(attempt: dict[str, Any], metadata: dict[str, Any], now: datetime) -> str:
    """The attempt's elapsed time; for a job still pending, when Slurm expects it to start."""
    if not attempt.get("start_time") and (expected := expected_start(attempt)):
        return f"start {expected}"
    return _elapsed(attempt, metadata, now) if attempt.get("start_time") or metadata else ""


def row(task: dict[str, Any], now: datetime) -> tuple[str, ...]:
    attempts = task.get("logs") or []
    attempt: dict[str, Any] = (attempts[-1] if attempts else None) or {}
    metadata: dict[str, Any] = attempt.get("metadata") or {}
    memory = peak_memory(metadata)
    return (
        str(task.get("id", "")),
        str(task.get("state", "")),
        _when(task.get("creation_time")),
        str(metadata.get("slurm_job_id") or ""),
        _elapsed_or_start(attempt, metadata, now),
        exit_code(attempt),
        size(memory) if memory else "",
        # Why a final task ended so, as this bridge tells it (`exit 42`, `TIMEOUT`, `input`...).
        str(metadata.get("reason") or ""),
        str(task.get("name") or ""),
    )


HEADER = ("ID", "STATE", "CREATED (UTC)", "JOBID", "ELAPSED", "EXIT", "MAXMEM", "REASON", "NAME")


def table(tasks: Iterable[dict[str, Any]], now: datetime | None = None) -> list[str]:
    """The lines of the table; the last column (NAME) is not padded."""
    now = now or datetime.now(UTC)
    rows = [HEADER, *(row(task, now) for task in tasks)]
    widths = [max(len(r[column]) for r in rows) for column in range(len(HEADER) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]).rstrip()
        for r in rows
    ]
