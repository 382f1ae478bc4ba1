"""What HPC sites ask for, on the real cluster: time limits that end jobs with a message naming
the limit, fractional CPUs, admission control; sacct shows what Slurm was asked."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from bridge.client.listing import size
from bridge.core.naming import job_name
from tests.fixtures.service import BridgeService, start_bridge_service
from tests.tes_cli import tes_task

pytestmark = pytest.mark.cluster


def sacct(job_id: str, fields: str) -> dict[str, str]:
    """The job line of `sacct -j JOB -o FIELDS`, once slurmdbd has the job's own record (right
    after a job ends it may hold only a placeholder with empty fields)."""
    for _ in range(30):
        out = subprocess.run(
            ["sacct", "-P", "-n", "-X", "-j", job_id, "-o", fields],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        lines = out.splitlines()
        values = dict(zip(fields.split(","), lines[0].split("|"), strict=True)) if lines else {}
        if values and all(values.values()):
            return values
        time.sleep(1)
    return values


def system_logs(task: dict[str, Any]) -> str:
    return "\n".join(line for log in task.get("logs", []) for line in log.get("system_logs", []))


def test_a_task_over_its_time_limit_ends_naming_the_limit(bridge_service: BridgeService) -> None:
    # Slurm counts limits in minutes (0:00:05 is one minute), checks them about every 30 s and
    # gives KillWait (10 s here) between SIGTERM and SIGKILL.
    task = bridge_service.run(
        {
            "executors": [{"image": "alpine", "command": ["sleep", "300"]}],
            "resources": {"backend_parameters": {"time": "0:00:05"}},
        },
        timeout=240,
    )
    assert task["state"] == "EXECUTOR_ERROR", task
    job_id = task["logs"][0]["metadata"]["slurm_job_id"]
    logs = system_logs(task)
    # (The exit code says whether processes outlived SIGTERM and got KillWait's SIGKILL.)
    assert f"Slurm job {job_id} ended in state TIMEOUT (exit code " in logs, logs
    assert (
        "): the job reached its time limit (--time=0:00:05, from resources.backend_parameters.time)"
    ) in logs, logs
    facts = sacct(job_id, "Timelimit,State,ElapsedRaw")
    assert facts["Timelimit"] == "00:01:00", facts
    assert facts["State"] == "TIMEOUT", facts
    # The lists say why (the BASIC view's metadata), where the exit code is blank.
    assert bridge_service.get(task["id"], "BASIC")["logs"][-1]["metadata"]["reason"] == "TIMEOUT"
    assert 60 <= int(facts["ElapsedRaw"]) < 200, facts


def test_max_time_in_hours_is_the_jobs_time_limit(bridge_service: BridgeService) -> None:
    task = bridge_service.run(
        {
            "executors": [{"image": "alpine", "command": ["true"]}],
            "resources": {"backend_parameters": {"max_time": "1.5"}, "cpu_cores": 0.5},
        }
    )
    assert task["state"] == "COMPLETE", task
    assert task["resources"]["cpu_cores"] == 1
    facts = sacct(task["logs"][0]["metadata"]["slurm_job_id"], "Timelimit,ReqCPUS")
    assert facts == {"Timelimit": "01:30:00", "ReqCPUS": "1"}, facts


@pytest.fixture(scope="module")
def admission_service(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    with start_bridge_service(
        local_cluster, tmp_path_factory.mktemp("admission"), slurm_toml="max_jobs_in_flight = 2"
    ) as service:
        yield service


def test_max_jobs_in_flight_bounds_the_jobs_in_squeue(admission_service: BridgeService) -> None:
    ids = [
        admission_service.create(
            {"executors": [{"image": "alpine", "command": ["sleep", "4"]}], "name": f"a{i}"}
        )
        for i in range(6)
    ]
    names = ",".join(job_name(task_id, f"a{i}") for i, task_id in enumerate(ids))
    most = 0
    saw_waiting = False
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        # A job that recorded its outcome may linger COMPLETING while the next one starts:
        # the limit counts the jobs whose tasks are not finished.
        states = "PENDING,CONFIGURING,RUNNING,SUSPENDED"
        out = subprocess.run(
            ["squeue", "-h", "-n", names, "-t", states, "-o", "%i"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        most = max(most, len(out.split()))
        tasks = [admission_service.get(task_id) for task_id in ids]
        saw_waiting = saw_waiting or any(
            "slurm.max_jobs_in_flight = 2" in system_logs(t) for t in tasks
        )
        if all(t["state"] in ("COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR") for t in tasks):
            break
        time.sleep(0.3)
    assert [t["state"] for t in tasks] == ["COMPLETE"] * 6, tasks
    assert most == 2, most
    assert saw_waiting
    for task in tasks:  # the condition line went when the task moved on
        assert "max_jobs_in_flight" not in system_logs(task)


def test_capabilities_show_the_clusters_partitions(bridge_service: BridgeService) -> None:
    lines = subprocess.run(
        ["sinfo", "-h", "-a", "-N", "-o", "%P|%N|%c"], capture_output=True, text=True, check=True
    ).stdout.split()
    expected: dict[str, set[str]] = {}
    for line in lines:
        partition, node, _ = line.split("|")
        expected.setdefault(partition.rstrip("*"), set()).add(node)
    deadline = time.monotonic() + 60
    while True:
        doc = requests.get(f"{bridge_service.api}/capabilities", timeout=10).json()
        if doc["partitions"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    shown = {p["name"]: set(p["nodes"]) for p in doc["partitions"]}
    assert shown == expected, doc
    assert all(p["cpus"] > 0 and p["max_memory_mb_per_node"] > 0 for p in doc["partitions"])
    version = subprocess.run(
        [doc["container"]["runtime"], "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    assert doc["container"]["version"] == version
    assert {"time", "max_time", "gpus"} <= {p["key"] for p in doc["backend_parameters"]}


@pytest.fixture(scope="module")
def rules_service(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    rules = (
        'rules = [{ gpu = true, directives = ["--time=1"] }, '
        '{ gpu = false, directives = ["--time=7"], prologue = "echo site rule prologue ran" }]'
    )
    with start_bridge_service(
        local_cluster, tmp_path_factory.mktemp("rules"), slurm_toml=rules
    ) as service:
        yield service


def test_a_site_rule_adds_its_directives_and_prologue(rules_service: BridgeService) -> None:
    task = rules_service.run({"executors": [{"image": "alpine", "command": ["true"]}]})
    assert task["state"] == "COMPLETE", task
    job_id = task["logs"][0]["metadata"]["slurm_job_id"]
    assert sacct(job_id, "Timelimit") == {"Timelimit": "00:07:00"}
    output = (rules_service.work_dir / task["id"] / f"slurm-{job_id}.out").read_text()
    assert "site rule prologue ran" in output


# The local cluster confines jobs with cgroups (task/cgroup, ConstrainRAMSpace) and gives each
# node two fake GPUs of type "fake" (deploy/local-cluster.sh).
PYTHON = "library/python:3-slim"


def test_an_executor_over_its_memory_is_killed_naming_the_limit_and_peak(
    bridge_service: BridgeService,
) -> None:
    hog = "data = b'x' * (600 << 20); print('survived')"
    task = bridge_service.run(
        {
            "executors": [
                {"image": PYTHON, "command": ["python3", "-c", hog]},
                {"image": "alpine", "command": ["echo", "never runs"]},
            ],
            "resources": {"ram_gb": 0.25},
        },
        timeout=180,
    )
    assert task["state"] == "EXECUTOR_ERROR", task
    attempt = task["logs"][0]
    assert [log["exit_code"] for log in attempt["logs"]] == [137], attempt["logs"]
    assert "survived" not in attempt["logs"][0].get("stdout", "")
    logs = system_logs(task)
    assert (
        "executor 0 was killed for using more memory than the job's limit of 256 MiB "
        "(resources.ram_gb 0.25); peak use 256 MiB"
    ) in logs, logs
    facts = sacct(attempt["metadata"]["slurm_job_id"], "State,AllocTRES")
    assert facts["State"] == "OUT_OF_MEMORY", facts
    basic = bridge_service.get(task["id"], "BASIC")
    assert basic["logs"][-1]["metadata"]["reason"] == "OUT_OF_MEMORY", basic
    assert "mem=256M" in facts["AllocTRES"].split(","), facts


def test_a_short_task_within_its_memory_reports_its_peak(bridge_service: BridgeService) -> None:
    name = f"peak-{uuid.uuid4().hex[:8]}"
    task = bridge_service.run(
        {
            "name": name,
            "executors": [
                {"image": PYTHON, "command": ["python3", "-c", "data = b'x' * (100 << 20)"]}
            ],
            "resources": {"ram_gb": 0.5},
        },
        timeout=180,
    )
    assert task["state"] == "COMPLETE", task
    assert "memory" not in system_logs(task)
    # Too short for an accounting sample, so sacct's MaxRSS may say 0; the cgroup's peak does not.
    peak = int(task["logs"][0]["metadata"]["memory_peak_bytes"])
    assert 100 << 20 < peak < 512 << 20, peak
    # And the CPU time its cgroup used, for the web page's efficiency (seff's TotalCPU).
    cpu = float(task["logs"][0]["metadata"]["cpu_time_seconds"])
    assert 0 < cpu < 60, cpu
    # `task list` shows the peak the page shows, never sacct's 0 for "not sampled".
    final = bridge_service.with_final_facts(task["id"])["logs"][0]["metadata"]
    header, line = tes_task(bridge_service.url, "list", "--name-prefix", name).stdout.splitlines()
    maxmem = line[header.index("MAXMEM") :].split()[0]
    rss = int(final.get("slurm_max_rss_bytes", "0"))
    assert maxmem == size(rss if rss > 0 else peak), (line, final)


def largest_node_memory_mb() -> int:
    """The local cluster's largest RealMemory (Slurm's MB: MiB)."""
    out = subprocess.run(
        ["sinfo", "-h", "-p", "main", "-o", "%m"], capture_output=True, text=True, check=True
    ).stdout
    return max(int(size) for size in out.split())


def test_a_nodes_whole_memory_in_decimal_gb_is_the_whole_node(
    bridge_service: BridgeService,
) -> None:
    # Snakemake and cwl-tes send decimal GB: a node's RealMemory / 1000. Read in MiB (x 1024)
    # that is 2.4% more than the node has, which sbatch refuses ("Memory specification can not
    # be satisfied"); the bridge asks for the node's memory instead.
    node_mb = largest_node_memory_mb()
    task = bridge_service.run(
        {
            "executors": [{"image": "alpine", "command": ["true"]}],
            "resources": {"ram_gb": node_mb / 1000},
        },
        timeout=300,  # a whole node's memory: the job waits for other jobs on it to end
    )
    assert task["state"] == "COMPLETE", task
    facts = sacct(task["logs"][0]["metadata"]["slurm_job_id"], "State,AllocTRES")
    assert f"mem={node_mb}M" in facts["AllocTRES"].split(","), facts


@pytest.mark.parametrize(
    ("parameters", "devices", "tres"),
    [
        ({"gpus": "fake:1"}, "0", "gres/gpu=1"),
        ({"gpus_per_task": "1"}, "0", "gres/gpu=1"),
        ({"gres": "gpu:fake:2"}, "0,1", "gres/gpu=2"),
    ],
)
def test_a_gpu_task_gets_its_gpus_from_slurm(
    bridge_service: BridgeService, parameters: dict[str, str], devices: str, tres: str
) -> None:
    task = bridge_service.run(
        {
            "executors": [
                {"image": "alpine", "command": ["sh", "-c", "echo gpus=$CUDA_VISIBLE_DEVICES"]}
            ],
            "resources": {"backend_parameters": parameters},
        },
        timeout=180,
    )
    assert task["state"] == "COMPLETE", task
    # The executor runs with --cleanenv: Slurm's CUDA_VISIBLE_DEVICES is passed on explicitly.
    assert task["logs"][0]["logs"][0]["stdout"].strip() == f"gpus={devices}", task
    facts = sacct(task["logs"][0]["metadata"]["slurm_job_id"], "AllocTRES")
    assert tres in facts["AllocTRES"].split(","), facts


def test_a_task_without_gpus_sees_none(bridge_service: BridgeService) -> None:
    task = bridge_service.run(
        {
            "executors": [
                {
                    "image": "alpine",
                    "command": ["sh", "-c", "echo gpus=${CUDA_VISIBLE_DEVICES-unset}"],
                }
            ]
        }
    )
    assert task["state"] == "COMPLETE", task
    assert task["logs"][0]["logs"][0]["stdout"].strip() == "gpus=unset", task


def test_a_qos_submit_limit_keeps_tasks_queued_not_failed(bridge_service: BridgeService) -> None:
    # QOS tes-limited lets a user have at most 2 jobs in the queue: sbatch refuses the third
    # with QOSMaxSubmitJobPerUserLimit, and no job exists for it.
    ids = [
        bridge_service.create(
            {
                "executors": [{"image": "alpine", "command": ["sleep", "6"]}],
                "resources": {"backend_parameters": {"qos": "tes-limited"}},
                "name": f"q{i}",
            }
        )
        for i in range(5)
    ]
    names = ",".join(job_name(task_id, f"q{i}") for i, task_id in enumerate(ids))
    saw_refusal = False
    most = 0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["squeue", "-h", "-n", names, "-o", "%i"], capture_output=True, text=True, check=True
        ).stdout
        most = max(most, len(out.split()))
        tasks = [bridge_service.get(task_id) for task_id in ids]
        saw_refusal = saw_refusal or any(
            "Slurm refused the job for a limit (QOSMaxSubmitJobPerUserLimit;" in system_logs(t)
            for t in tasks
        )
        if all(t["state"] in ("COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR") for t in tasks):
            break
        time.sleep(0.3)
    assert [t["state"] for t in tasks] == ["COMPLETE"] * 5, tasks
    assert saw_refusal
    assert most <= 2, most
    for task in tasks:
        facts = sacct(task["logs"][-1]["metadata"]["slurm_job_id"], "QOS,State")
        assert facts == {"QOS": "tes-limited", "State": "COMPLETED"}, facts
