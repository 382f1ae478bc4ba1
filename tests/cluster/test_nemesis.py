"""The nemesis of bench/nemesis/, shortened: 5 minutes, 300 tasks on SQLite, a fault every
30 s (kill -9 of the poller, an API worker, gunicorn's master, slurmctld; a node lost; the
registry stalled; the work filesystem full), then the checks against sacct and the API.

It kills the cluster's daemons (and undoes every fault at the end): run it alone on the
cluster. NEMESIS_SEED=N replays a run (its seed is printed); NEMESIS_MINUTES, NEMESIS_TASKS
change its length.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from bench.nemesis import passed, run_nemesis

pytestmark = pytest.mark.cluster


def test_nemesis_loses_nothing_runs_nothing_twice_and_fails_nothing_falsely(
    local_cluster: Any,
) -> None:
    seed = int(os.environ.get("NEMESIS_SEED", time.time_ns() % 1_000_000))
    print(f"nemesis seed: {seed} (rerun with NEMESIS_SEED={seed})")
    minutes = float(os.environ.get("NEMESIS_MINUTES", "5"))
    tasks = int(os.environ.get("NEMESIS_TASKS", "300"))
    result = run_nemesis("sqlite", minutes, tasks, seed, drain_timeout=240)
    summary = {k: v for k, v in result.items() if k not in ("details", "faults", "api")}
    print(json.dumps(summary, indent=1))
    context = json.dumps({**summary, "faults": result["faults"], "details": result["details"]})
    assert result["tasks"] >= tasks, context
    assert result["lost"] == 0, context
    assert result["not_final"] == 0, context
    assert result["twice"] == 0, context
    assert result["falsely_failed"] == 0, context
    assert result["wrong_outputs"] == 0, context
    assert result["five_xx_while_up"] == 0, context
    assert result["fault_errors"] == [], context
    assert passed(result), context
