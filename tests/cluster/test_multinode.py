"""The bridge on a cluster of several compute nodes (deploy/local-cluster.sh up --nodes 2).

Each node is its own slurmd in its own mount namespace: its own /tmp, the shared filesystem,
nothing of the login node's state. Jobs land on both nodes, never see the bridge's database or
config, and a node lost for real (its slurmd killed with SIGKILL) sends the task to another node
in the same attempt (one log entry, the lost job named in its metadata and system_logs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.common import REPO
from bench.common import kill_node as kill_node_processes
from bench.nemesis.cluster import start_node
from tests.fixtures.cluster import LocalCluster
from tests.fixtures.service import BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster

ALPINE = "alpine"


def executor(*command: str) -> dict[str, Any]:
    return {"image": ALPINE, "command": list(command)}


def sacct_nodes(job_ids: list[str]) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), "--format=JobID,NodeList"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if line)


def sbatch_on(node: str, script: str, *options: str) -> str:
    """sbatch of `script` on `node`; its job id (with --wait: once the job has ended)."""
    return subprocess.run(
        ["sbatch", "--parsable", f"--nodelist={node}", *options],
        input=script,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()


@pytest.fixture(autouse=True)
def several_nodes(local_cluster: LocalCluster) -> None:
    assert len(local_cluster.nodes) >= 2, (
        f"these tests need several compute nodes, the cluster has {local_cluster.nodes}:"
        " deploy/local-cluster.sh up --nodes 2"
    )


# ------------------------------------------------------------------------ the cluster script


def test_up_after_kill_9_of_a_nodes_slurmd_brings_it_back_within_seconds(
    local_cluster: LocalCluster, restore_nodes: None
) -> None:
    node = local_cluster.nodes[-1]
    pid_file = local_cluster.state_dir / "run" / f"slurmd-{node}.pid"
    old = int(pid_file.read_text())
    os.kill(old, signal.SIGKILL)
    started = time.monotonic()
    local_cluster.up()
    elapsed = time.monotonic() - started
    assert elapsed < 30, elapsed
    status = local_cluster.run_script("status").stdout
    line = next(line for line in status.splitlines() if line.split()[:1] == [f"slurmd-{node}"])
    assert " running " in line and str(old) not in line, line
    state = subprocess.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True, check=True
    )
    # One line per partition the node is in (main and the preemptible one).
    states = set(state.stdout.split())
    assert states and states <= {"idle", "mixed", "allocated"}, state.stdout


def test_a_node_the_nemesis_brings_back_sees_what_up_gave_it(
    local_cluster: LocalCluster, shared_tmp_path: Path, restore_nodes: None
) -> None:
    """The soak's node fault starts a killed slurmd again through the cluster script's `_slurmd`:
    its jobs see this checkout (the job scripts run its Python), read-only, wherever it lies,
    a `mktemp -d` clone under the login node's /tmp included."""
    node = local_cluster.nodes[-1]
    kill_node(local_cluster, node)
    start_node(node, None)
    venv_python = Path(sys.executable).parent / "python"
    result = shared_tmp_path / "views.txt"
    body = (
        f"test -x {venv_python} && echo python || echo no-python\n"
        f"test -d {REPO}/bridge && echo checkout || echo no-checkout\n"
        f"test -w {REPO} && echo writable || echo read-only\n"
    )
    sbatch_on(node, f"#!/bin/bash\n{body}", "--wait", f"--output={result}")
    assert result.read_text().split() == ["python", "checkout", "read-only"]


# --------------------------------------------------------------------------- the nodes' views


def test_each_node_has_its_own_tmp_and_not_the_login_nodes(
    local_cluster: LocalCluster, shared_tmp_path: Path, tmp_path: Path
) -> None:
    (tmp_path / "login-only").write_text("the login node's /tmp\n")
    ids = {}
    for node in local_cluster.nodes[:2]:
        # Each job leaves a file in its node's /tmp, then lists what that /tmp holds.
        body = (
            f"touch /tmp/mark-{node}-$SLURM_JOB_ID\n"
            f"ls -a /tmp > {shared_tmp_path}/tmp-{node}.txt\n"
            f"test -e {tmp_path}/login-only && echo visible || echo hidden"
            f" > {shared_tmp_path}/login-{node}.txt\n"
            f"touch /usr/probe-{node} 2>/dev/null && echo writable || echo read-only"
            f" > {shared_tmp_path}/usr-{node}.txt\n"
        )
        ids[node] = sbatch_on(
            node, f"#!/bin/bash\nset -e\n{body}", f"--output={shared_tmp_path}/%j.out"
        )
    deadline = time.monotonic() + 90
    while not all((shared_tmp_path / f"usr-{n}.txt").exists() for n in ids):
        assert time.monotonic() < deadline, list(shared_tmp_path.iterdir())
        time.sleep(0.5)
    first, second = ids
    for node, other in ((first, second), (second, first)):
        listing = (shared_tmp_path / f"tmp-{node}.txt").read_text().split()
        assert f"mark-{node}-{ids[node]}" in listing
        assert not any(name.startswith(f"mark-{other}-") for name in listing), listing
        assert not any(name.startswith("pytest-of-") for name in listing), listing
        assert (shared_tmp_path / f"login-{node}.txt").read_text() == "hidden\n"
        assert (shared_tmp_path / f"usr-{node}.txt").read_text() == "read-only\n"
    expected = {job: node for node, job in ids.items()}
    deadline = time.monotonic() + 30  # slurmdbd may lag behind the jobs' end
    while (found := sacct_nodes(list(ids.values()))) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert found == expected
    for node, job in ids.items():
        (local_cluster.state_dir / "nodes" / node / "tmp" / f"mark-{node}-{job}").unlink()


@pytest.fixture(scope="module")
def meeting(local_cluster: LocalCluster) -> Iterator[Path]:
    """A directory on the shared filesystem that executors see read-write (storage.shared_dirs)."""
    path = local_cluster.shared_path("meet")
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def service(
    local_cluster: LocalCluster, meeting: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    # The job script's side: every job tries the state directory, the database and the config
    # of its service before anything else, and leaves what it found in the meeting directory.
    root = tmp_path_factory.mktemp("multinode")
    probes = " ".join(
        str(p) for p in (root / "state", root / "state" / "tes-bridge.db", root / "tes-bridge.toml")
    )
    prologue = (
        f'for f in {probes}; do if cat -- "$f" >/dev/null 2>&1 || test -e "$f"; then'
        f' echo "open $f"; else echo "cannot open $f"; fi; done'
        f" > {meeting}/probe-$SLURM_JOB_ID.txt"
    )
    with start_bridge_service(
        local_cluster,
        root,
        storage_toml=f"shared_dirs = [{json.dumps(str(meeting))}]",
        slurm_toml=f"prologue = {json.dumps(prologue)}",
    ) as service:
        yield service


def node_memory_mb(node: str) -> int:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%m"], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[0])


def test_tasks_land_on_both_nodes(
    service: BridgeService, local_cluster: LocalCluster, meeting: Path
) -> None:
    # Two tasks that wait for each other run at the same time; each asks for more than half a
    # node's memory, so they run on two different nodes.
    place = meeting / "both"
    place.mkdir(mode=0o777)
    ram_gb = round(node_memory_mb(local_cluster.nodes[0]) * 0.6 / 1024, 1)
    wait = (
        f"touch {place}/$0; n=0; while [ $(ls {place} | wc -l) -lt 2 ]; do"
        " n=$((n+1)); [ $n -lt 900 ] || exit 9; sleep 0.1; done; echo met; ls -a /tmp"
    )
    ids = [
        service.create(
            {"executors": [executor("sh", "-c", wait, name)], "resources": {"ram_gb": ram_gb}}
        )
        for name in ("a", "b")
    ]
    tasks = [service.wait(task_id, timeout=240) for task_id in ids]
    for task in tasks:
        assert task["state"] == "COMPLETE", task
        assert task["logs"][0]["logs"][0]["stdout"].startswith("met\n")
    jobs = [task["logs"][0]["metadata"]["slurm_job_id"] for task in tasks]
    nodes = sacct_nodes(jobs)
    assert sorted(nodes[job] for job in jobs) == sorted(local_cluster.nodes[:2]), nodes
    assert [task["logs"][0]["metadata"]["slurm_node"] for task in tasks] == [
        nodes[job] for job in jobs
    ]


def test_a_job_cannot_open_the_database_or_the_config_and_the_task_completes(
    service: BridgeService, meeting: Path
) -> None:
    state = service.root / "state"
    database = state / "tes-bridge.db"
    assert database.is_file() and service.config_path.is_file()
    paths = [str(state), str(database), str(service.config_path)]
    # The executor's side: the same paths from inside the container.
    probe = "; ".join(
        f"if cat {p} >/dev/null 2>&1 || test -e {p}; then echo open {p}; fi" for p in paths
    )
    task = service.run({"executors": [executor("sh", "-c", f"{probe}; echo tried")]})
    assert task["state"] == "COMPLETE", task
    assert task["logs"][0]["logs"][0]["stdout"] == "tried\n"
    job = task["logs"][0]["metadata"]["slurm_job_id"]
    found = (meeting / f"probe-{job}.txt").read_text().splitlines()
    assert found == [f"cannot open {p}" for p in paths]


# ------------------------------------------------------------------------------ node failure


@pytest.fixture
def restore_nodes(local_cluster: LocalCluster) -> Iterator[None]:
    """Whatever a test does to the nodes, `up` brings every slurmd back and the nodes to idle."""
    try:
        yield
    finally:
        local_cluster.up()


def kill_node(local_cluster: LocalCluster, node: str) -> None:
    """The node fails for real: SIGKILL to its slurmd and to every process of its jobs."""
    slurmd = int((local_cluster.state_dir / "run" / f"slurmd-{node}.pid").read_text())
    kill_node_processes(slurmd)


def running_node(service: BridgeService, task_id: str) -> tuple[str, str]:
    """The job and the node of the task's current attempt, once its executor runs."""
    deadline = time.monotonic() + 120
    while True:
        task = service.get(task_id)
        log = task["logs"][-1] if task.get("logs") else {}
        node = log.get("metadata", {}).get("slurm_node")
        if task["state"] == "RUNNING" and node:
            return log["metadata"]["slurm_job_id"], node
        assert task["state"] in {"QUEUED", "INITIALIZING", "RUNNING"}, task
        assert time.monotonic() < deadline, task
        time.sleep(0.3)


@pytest.fixture
def no_retry_service(local_cluster: LocalCluster, tmp_path: Path) -> Iterator[BridgeService]:
    with start_bridge_service(local_cluster, tmp_path, slurm_toml="retries = 0") as service:
        yield service


def test_a_node_lost_for_real_sends_the_task_to_another_node_in_the_same_attempt(
    service: BridgeService, local_cluster: LocalCluster, restore_nodes: None
) -> None:
    task_id = service.create({"executors": [executor("sh", "-c", "sleep 12; echo done; exit 3")]})
    job, node = running_node(service, task_id)
    kill_node(local_cluster, node)
    task = service.wait(task_id, timeout=150)
    assert task["state"] == "EXECUTOR_ERROR", task
    # The job that replaces the lost one continues its entry (docs/states.md): nf-ga4gh's
    # logs[0].logs[0] and cwl-tes's logs[-1].logs[-1] both read the final exit code.
    assert len(task["logs"]) == 1, task["logs"]
    assert task["logs"][0]["logs"][0]["exit_code"] == 3, task["logs"]
    assert task["logs"][-1]["logs"][-1]["exit_code"] == 3, task["logs"]
    assert task["logs"][0]["logs"][0]["stdout"] == "done\n"
    metadata = task["logs"][0]["metadata"]
    second = metadata["slurm_job_id"]
    assert second != job and metadata["slurm_lost_job_ids"] == job
    assert metadata["slurm_node"] != node
    assert sacct_nodes([job, second]) == {job: node, second: metadata["slurm_node"]}
    lines = "\n".join(task["logs"][0].get("system_logs", []))
    assert f"Slurm job {job} ended in state NODE_FAIL" in lines, task["logs"]
    assert f"Slurm job {job} ran on node {node}" in lines, task["logs"]


def test_a_node_lost_with_no_retries_left_is_a_system_error_with_the_reason(
    no_retry_service: BridgeService, local_cluster: LocalCluster, restore_nodes: None
) -> None:
    service = no_retry_service
    task_id = service.create({"executors": [executor("sh", "-c", "sleep 60")]})
    job, node = running_node(service, task_id)
    kill_node(local_cluster, node)
    task = service.wait(task_id, timeout=120)
    assert task["state"] == "SYSTEM_ERROR", task
    assert len(task["logs"]) == 1, task["logs"]
    reasons = "\n".join(task["logs"][0].get("system_logs", []))
    assert f"Slurm job {job} ended in state NODE_FAIL" in reasons, task["logs"]
    assert "no retries left (0)" in reasons, task["logs"]
