"""What the nemesis reports beside the checks: the poller's RSS and open files over the run,
and the verdict of a run."""

from __future__ import annotations

import os
import statistics
import threading
from pathlib import Path
from typing import Any

from bench.nemesis.cluster import now
from bench.nemesis.service import Bridge


def sample_poller(
    bridge: Bridge, t0: float, samples: list[dict[str, Any]], stopping: threading.Event
) -> None:
    """The poller's RSS and open files every 5 s."""
    while not stopping.wait(5):
        for pid in bridge.roles()["poller"]:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                rss = int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1])
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration):
                continue
            samples.append({"t": round(now() - t0, 1), "pid": pid, "rss_kb": rss, "fds": fds})


def trend(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last quarter of the run (medians), and the longest-lived poller's first and
    last sample (pollers killed by the nemesis start afresh)."""
    if len(samples) < 4:
        return {"samples": len(samples)}
    quarter = max(1, len(samples) // 4)
    first, last = samples[:quarter], samples[-quarter:]
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        by_pid.setdefault(sample["pid"], []).append(sample)
    longest = max(by_pid.values(), key=lambda s: s[-1]["t"] - s[0]["t"])
    return {
        "samples": len(samples),
        "pollers": len(by_pid),
        "rss_kb_first_quarter": statistics.median(s["rss_kb"] for s in first),
        "rss_kb_last_quarter": statistics.median(s["rss_kb"] for s in last),
        "fds_first_quarter": statistics.median(s["fds"] for s in first),
        "fds_last_quarter": statistics.median(s["fds"] for s in last),
        "longest_lived": {
            "pid": longest[0]["pid"],
            "seconds": longest[-1]["t"] - longest[0]["t"],
            "rss_kb": [longest[0]["rss_kb"], longest[-1]["rss_kb"]],
            "fds": [longest[0]["fds"], longest[-1]["fds"]],
        },
    }


def passed(result: dict[str, Any]) -> bool:
    workflow = result["workflow"]
    runs = workflow["runs"] if isinstance(workflow, dict) else []
    return (
        result["lost"] == 0
        and result["twice"] == 0
        and result["falsely_failed"] == 0
        and result["not_final"] == 0
        and result["wrong_outputs"] == 0
        and result["five_xx_while_up"] == 0
        and all(r["outputs_right"] for r in runs)
        # A fault the harness could not inject or undo leaves the run short of its faults.
        and not result["fault_errors"]
    )
