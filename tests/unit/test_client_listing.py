"""`tes-bridge task list`: the columns Slurm users read as sacct's (bridge.client.listing)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from bridge.client.listing import HEADER, duration, peak_memory, row, table

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "00:00:00"),
        (5, "00:00:05"),
        (65.9, "00:01:05"),
        (3725, "01:02:05"),
        (86399, "23:59:59"),
        (86400 + 2 * 3600 + 3 * 60 + 4, "1-02:03:04"),
        (12 * 86400, "12-00:00:00"),
    ],
)
def test_elapsed_is_written_as_sacct_writes_it(seconds: float, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize(
    ("metadata", "peak"),
    [
        # sacct's MaxRSS of a job shorter than one accounting sample is "0": no measure.
        ({"slurm_max_rss_bytes": "0", "memory_peak_bytes": "225443840"}, 225443840.0),
        ({"memory_peak_bytes": "225443840"}, 225443840.0),
        ({"slurm_max_rss_bytes": "1048576", "memory_peak_bytes": "2097152"}, 1048576.0),
        ({"slurm_max_rss_bytes": "0"}, None),
        ({"slurm_max_rss_bytes": "x", "memory_peak_bytes": ""}, None),
        ({}, None),
    ],
)
def test_peak_memory_is_the_pages(metadata: dict[str, str], peak: float | None) -> None:
    assert peak_memory(metadata) == peak


def task(state: str, **metadata: str) -> dict[str, Any]:
    attempt: dict[str, Any] = {
        "start_time": "2026-11-25T10:00:00Z",
        "end_time": "2026-11-25T10:00:09Z",
        "logs": [],
        "metadata": {"slurm_job_id": "4711", **metadata},
    }
    return {
        "id": "t1",
        "state": state,
        "name": "align",
        "creation_time": "2026-11-25T09:59:00Z",
        "logs": [attempt],
    }


def test_a_task_killed_at_its_time_limit_says_so_in_its_row() -> None:
    timed_out = task(
        "EXECUTOR_ERROR",
        slurm_state="TIMEOUT",
        slurm_elapsed_seconds="3725",
        slurm_max_rss_bytes="0",
        memory_peak_bytes="225443840",
        reason="TIMEOUT",
    )
    assert dict(zip(HEADER, row(timed_out, NOW), strict=True)) == {
        "ID": "t1",
        "STATE": "EXECUTOR_ERROR",
        "CREATED (UTC)": "2026-11-25 09:59:00",
        "JOBID": "4711",
        "ELAPSED": "01:02:05",
        "EXIT": "",
        "MAXMEM": "215.0M",
        "REASON": "TIMEOUT",
        "NAME": "align",
    }


def test_the_reason_column_keeps_its_words_together() -> None:
    lines = table(
        [task("CANCELED", reason="canceled by alice"), task("COMPLETE"), task("QUEUED")], NOW
    )
    assert lines[0].split()[-2:] == ["REASON", "NAME"]
    at = lines[0].index("REASON")
    assert lines[1][at:].split("  ")[0] == "canceled by alice"
    assert lines[2][at:].strip() == "align"
    # Elapsed from the attempt's times where sacct has none yet.
    assert "00:00:09" in lines[2]
