"""Preemption for real: a task with `resources.preemptible` runs in the local cluster's
scavenger partition (slurm.preemptible_partition); a plain sbatch job of the default partition,
a higher PriorityTier, that needs the whole node makes Slurm preempt it (PreemptMode=REQUEUE;
the bridge's --no-requeue makes that a cancel, state PREEMPTED). What becomes of the task is the
task's own choice (backend_parameters.on_preemption), else the site's (slurm.on_preemption):
PREEMPTED and final ("report"), or a new attempt that completes ("resubmit"). Each test asks
the opposite of its site's setting.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.cluster import LocalCluster
from tests.fixtures.service import TERMINAL, BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster


@pytest.fixture
def meeting(local_cluster: LocalCluster) -> Iterator[Path]:
    """A directory on the shared filesystem that executors see read-write (storage.shared_dirs)."""
    path = local_cluster.shared_path("preempt")
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def blockers() -> Iterator[list[str]]:
    """Plain sbatch jobs a test starts; cancelled at its end."""
    jobs: list[str] = []
    try:
        yield jobs
    finally:
        if jobs:
            subprocess.run(["scancel", *jobs], check=False, timeout=30)


def start_service(
    local_cluster: LocalCluster, root: Path, meeting: Path, on_preemption: str, slurm_toml: str = ""
) -> BridgeService:
    return start_bridge_service(
        local_cluster,
        root,
        storage_toml=f"shared_dirs = [{json.dumps(str(meeting))}]",
        slurm_toml=(
            f"preemptible_partition = {json.dumps(local_cluster.preemptible_partition)}\n"
            f"on_preemption = {json.dumps(on_preemption)}\n{slurm_toml}"
        ),
    )


def preemptible_task(meeting: Path, on_preemption: str | None = None) -> dict[str, Any]:
    """Runs long the first time (leaving a mark), and ends at once when run again."""
    mark = meeting / "ran-once"
    script = f"if [ -e {mark} ]; then echo again; else touch {mark}; echo first; sleep 600; fi"
    resources: dict[str, Any] = {"preemptible": True}
    if on_preemption is not None:
        resources["backend_parameters"] = {"on_preemption": on_preemption}
    return {
        "executors": [{"image": "alpine", "command": ["sh", "-c", script]}],
        "resources": resources,
    }


def running_job(service: BridgeService, task_id: str, meeting: Path) -> dict[str, str]:
    """The metadata of the task's attempt once its executor runs."""
    deadline = time.monotonic() + 180
    while True:
        task = service.get(task_id)
        metadata = task["logs"][-1].get("metadata", {}) if task.get("logs") else {}
        started = (meeting / "ran-once").exists()
        if task["state"] == "RUNNING" and metadata.get("slurm_node") and started:
            return metadata
        assert task["state"] in {"QUEUED", "INITIALIZING", "RUNNING"}, task
        assert time.monotonic() < deadline, task
        time.sleep(0.3)


def fill_node(node: str, blockers: list[str], seconds: int) -> str:
    """A job of the default partition (higher tier) that needs all of `node`'s memory, so it can
    start only once Slurm preempts the preemptible job there."""
    memory = subprocess.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%m"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()[0]
    job = subprocess.run(
        ["sbatch", "--parsable", f"--nodelist={node}", f"--mem={memory}", "--output=/dev/null"],
        input=f"#!/bin/sh\nsleep {seconds}\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    blockers.append(job)
    return job


def test_a_task_that_asks_to_be_told_ends_preempted_with_the_reason(
    local_cluster: LocalCluster, tmp_path: Path, meeting: Path, blockers: list[str]
) -> None:
    # As sprocket wants it, which counts preemptible attempts itself.
    with start_service(local_cluster, tmp_path, meeting, "resubmit") as service:
        task_id = service.create(preemptible_task(meeting, "report"))
        first = running_job(service, task_id, meeting)
        assert first["slurm_partition"] == local_cluster.preemptible_partition, first
        fill_node(first["slurm_node"], blockers, 60)
        task = service.wait(task_id, timeout=240)
    assert task["state"] == "PREEMPTED", task
    assert len(task["logs"]) == 1, task["logs"]
    log = task["logs"][0]
    assert log["metadata"]["slurm_state"] == "PREEMPTED", log
    reasons = "\n".join(log.get("system_logs", []))
    job = first["slurm_job_id"]
    assert f"Slurm job {job} ended in state PREEMPTED" in reasons, log
    assert "preempted it in partition" in reasons and "submit the task again" in reasons, log
    assert "end_time" in log, log


def test_a_preempted_task_is_submitted_again_and_completes(
    local_cluster: LocalCluster, tmp_path: Path, meeting: Path, blockers: list[str]
) -> None:
    with start_service(local_cluster, tmp_path, meeting, "report") as service:
        task_id = service.create(preemptible_task(meeting, "resubmit"))
        first = running_job(service, task_id, meeting)
        fill_node(first["slurm_node"], blockers, 5)
        task = service.wait(task_id, timeout=240)
        assert task["state"] == "COMPLETE", task
        task = service.with_final_facts(task_id)
    # The preempted job continues the task's one entry (docs/states.md), which names it.
    assert len(task["logs"]) == 1, task["logs"]
    (entry,) = task["logs"]
    job = first["slurm_job_id"]
    assert entry["metadata"]["slurm_lost_job_ids"] == job, entry["metadata"]
    assert f"Slurm job {job} ended in state PREEMPTED" in "\n".join(entry["system_logs"]), entry
    assert entry["metadata"]["slurm_job_id"] != job, entry
    assert entry["metadata"]["slurm_partition"] == local_cluster.preemptible_partition
    assert entry["logs"][0]["stdout"] == "again\n", entry


def sacct_states(job: str) -> list[str]:
    """Every record sacct keeps of the job id, a requeued job's earlier runs included."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "--duplicates", "-j", job, "--format=State"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return out.split()


def test_a_job_slurm_requeues_itself_is_followed_to_completion_under_its_id(
    local_cluster: LocalCluster, tmp_path: Path, meeting: Path, blockers: list[str]
) -> None:
    # A site that lets Slurm requeue preempted jobs (--requeue after the bridge's --no-requeue):
    # squeue never shows the job PREEMPTED, only COMPLETING then PENDING (BeginTime, two
    # minutes on) under the same id; it is neither PREEMPTED nor submitted again.
    requeue = 'extra_directives = ["--requeue"]'
    with start_service(local_cluster, tmp_path, meeting, "report", requeue) as service:
        task_id = service.create(preemptible_task(meeting))
        first = running_job(service, task_id, meeting)
        fill_node(first["slurm_node"], blockers, 5)
        queued = service.wait(task_id, timeout=120, states={"QUEUED", *TERMINAL})
        assert queued["state"] == "QUEUED", queued
        job = first["slurm_job_id"]
        # Not two minutes: let it start again now.
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        task = service.wait(task_id, timeout=180)
    assert task["state"] == "COMPLETE", task
    assert len(task["logs"]) == 1, task["logs"]
    assert task["logs"][0]["metadata"]["slurm_job_id"] == job
    assert task["logs"][0]["logs"][0]["stdout"] == "again\n", task["logs"]
    assert sacct_states(job) == ["PREEMPTED", "COMPLETED"]
