"""The bridge on the Slurm release the local cluster runs (LOCAL_CLUSTER_SLURM: 22.05, 24.11 or
26.05): the exit codes it reports, the release it says it runs on, and life under slurmctld's
RPC rate limit (24.11 and later here, as at a careful site). CI runs this module on every
release (tests/cluster/conftest.py)."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from bridge.slurm import TESTED_RELEASES, parse_rate_limit
from tests.fixtures.cluster import LocalCluster
from tests.fixtures.quickstart import ACCOUNT, Quickstart
from tests.fixtures.service import BridgeService

pytestmark = pytest.mark.cluster


def sh(script: str) -> dict[str, Any]:
    return {"image": "alpine", "command": ["sh", "-c", script]}


def slurm_version() -> str:
    """`sinfo -V` of the commands on PATH: "slurm-wlm 26.05.5" -> "26.05.5"."""
    out = subprocess.run(["sinfo", "-V"], capture_output=True, text=True, check=True).stdout
    return out.split()[-1]


def has_rate_limit(version: str) -> bool:
    """slurmctld's rl_enable exists from 23.02 on; the local cluster turns it on there."""
    return tuple(int(part) for part in version.split(".")[:2]) >= (23, 2)


def test_the_local_cluster_runs_the_release_asked_for(local_cluster: LocalCluster) -> None:
    version = slurm_version()
    asked = os.environ.get("LOCAL_CLUSTER_SLURM")
    if asked:
        # A newer Debian unstable may carry a later release under the same name (see the script).
        assert version.startswith(asked + ".") or asked == "26.05", (asked, version)
    env = local_cluster.env or {}
    assert env.get("LOCAL_CLUSTER_SLURM_VERSION", version) == version
    config = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"^SLURM_VERSION\s*=\s*" + re.escape(version), config, re.M), config[:500]
    # 24.11 and later run with slurmctld's rate limit on; 22.05 has none to turn on.
    assert (parse_rate_limit(config) is not None) == has_rate_limit(version), config


def test_an_executor_exiting_3_reports_3_and_one_killed_by_sigkill_reports_137(
    bridge_service: BridgeService,
) -> None:
    exits = bridge_service.create({"executors": [sh("echo about to fail; exit 3")]})
    killed = bridge_service.create({"executors": [sh("echo about to die; kill -9 $$")]})
    for task_id, code, stdout in ((exits, 3, "about to fail\n"), (killed, 137, "about to die\n")):
        task = bridge_service.wait(task_id)
        assert task["state"] == "EXECUTOR_ERROR", task
        (entry,) = task["logs"][-1]["logs"]
        assert entry["exit_code"] == code, task
        assert entry["stdout"] == stdout


def test_the_release_is_in_the_capabilities_and_the_check(bridge_service: BridgeService) -> None:
    version = slurm_version()
    deadline = time.monotonic() + 60
    while True:
        answer = requests.get(f"{bridge_service.api}/capabilities", timeout=10)
        assert answer.status_code == 200, answer.text
        slurm = answer.json().get("slurm") or {}
        if slurm.get("version") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    tested = tuple(int(part) for part in version.split(".")[:2]) in TESTED_RELEASES
    assert slurm == {"version": version, "tested": tested}, answer.json()
    check = subprocess.run(
        [bridge_service.python, "-m", "bridge", "--config", str(bridge_service.config_path),
         "check", "--json"],
        capture_output=True, text=True, env=bridge_service.env, timeout=120, check=False,
    )  # fmt: skip
    results = {r["name"]: r for r in json.loads(check.stdout)}
    assert results["slurm release"]["ok"], results
    assert version in results["slurm release"]["message"]
    limit = results["slurm rate limit"]
    assert limit["ok"], results
    assert ("rl_enable" in limit["message"]) == has_rate_limit(version), limit


def _rate_limited_lines(log: Path, uid: int, since: int) -> list[str]:
    """slurmctld's "RPC rate limit exceeded by uid N" lines (it logs every one: rl_log_freq=0)
    written after byte `since` of its log."""
    with log.open("rb") as handle:
        handle.seek(since)
        text = handle.read().decode(errors="replace")
    return [line for line in text.splitlines() if f"rate limit exceeded by uid {uid} " in line]


def test_a_burst_as_the_service_account_completes_without_slurmctld_limiting_it(
    quickstart: Quickstart, local_cluster: LocalCluster
) -> None:
    """The quickstart's service runs as an ordinary account, which slurmctld's rate limit covers
    (root and SlurmUser are exempt). Its default call budget keeps it under the limit: forty
    tasks, with their polls and a cancel, and not one RPC is told to back off."""
    log = local_cluster.state_dir / "log" / "slurmctld.log"
    since = log.stat().st_size
    uid = pwd.getpwnam(ACCOUNT).pw_uid
    ids = [quickstart.create({"executors": [sh(f"echo {i}")]}) for i in range(40)]
    canceled = quickstart.create({"executors": [sh("sleep 300")]})
    quickstart.cancel(canceled)
    for task_id in ids:
        task = quickstart.wait(task_id)
        assert task["state"] == "COMPLETE", task
    assert quickstart.wait(canceled)["state"] == "CANCELED"
    assert _rate_limited_lines(log, uid, since) == []
