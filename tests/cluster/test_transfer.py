"""Staging on the transfer partition (staging.where = "transfer") on the real cluster: a task with
remote inputs (HTTP, S3, DRS) and an S3 output runs as three Slurm jobs, its stage-in and
stage-out on the transfer partition, its own job between them, chained with
--dependency=afterok; staged tasks of one shape ready together go as three job arrays chained
with --dependency=aftercorr.

The local cluster names its network-less partition and its transfer partition in cluster.env
(LOCAL_CLUSTER_OFFLINE_PARTITION, LOCAL_CLUSTER_TRANSFER_PARTITION); where it has neither, the
tasks run on its main partition and the transfer jobs on its preemptible one, which checks the
chain and the partitions each job ran on, not the absence of the network.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bridge.slurm import expand_array_range
from tests.fixtures.drs import DrsServer
from tests.fixtures.service import BridgeService, start_bridge_service
from tests.fixtures.storage import BUCKET, StorageServers

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def partitions(local_cluster: Any) -> tuple[str, str]:
    """(the tasks' partition, the transfer partition)."""
    env = local_cluster.env
    return (
        env.get("LOCAL_CLUSTER_OFFLINE_PARTITION") or local_cluster.partition,
        env.get("LOCAL_CLUSTER_TRANSFER_PARTITION") or local_cluster.preemptible_partition,
    )


@pytest.fixture(scope="module")
def servers(cluster_storage_servers: StorageServers) -> StorageServers:
    return cluster_storage_servers


@pytest.fixture(scope="module")
def service(
    local_cluster: Any,
    servers: StorageServers,
    cluster_drs_server: DrsServer,
    partitions: tuple[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[BridgeService]:
    drs = cluster_drs_server
    toml = servers.staging_toml() + (
        f'where = "transfer"\ntransfer_partition = "{partitions[1]}"\n'
        'transfer_time_limit = "10:00"\ntransfer_memory_mb = 256\n'
        f'ca_bundle = "{drs.ca}"\ndrs_tokens_file = "{drs.root / "drs-tokens.toml"}"\n'
    )
    # Three staged tasks of one shape ready in one round go as three arrays (a lone task, as
    # the other tests create, as a chain).
    with start_bridge_service(
        local_cluster,
        tmp_path_factory.mktemp("transfer"),
        extra_toml=toml,
        slurm_toml="array_min_tasks = 3\n",
    ) as service:
        yield service


def sacct(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """sacct's job lines: id -> JobName, Partition, State, Start, End."""
    fields = ["JobID", "JobName", "Partition", "State", "Start", "End"]
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), f"--format={','.join(fields)}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines()]
    return {row["JobID"]: row for row in rows}


def chain_ids(task: dict[str, Any]) -> list[str]:
    metadata = task["logs"][-1]["metadata"]
    return [
        metadata["slurm_stage_in_job_id"],
        metadata["slurm_job_id"],
        metadata["slurm_stage_out_job_id"],
    ]


def final_records(job_ids: list[str], timeout: float = 30) -> dict[str, dict[str, str]]:
    """sacct's records once every job has ended (slurmdbd may be a moment behind, and hold
    only a placeholder, "allocation" with no partition, for a job that just ended)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = sacct(job_ids)
        ended = all(
            rows.get(j, {}).get("State", "") not in ("", "PENDING", "RUNNING")
            and rows[j]["JobName"] != "allocation"
            for j in job_ids
        )
        if ended or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def element_records(array_ids: list[str]) -> dict[str, dict[str, str]]:
    """sacct's job lines of these arrays by element id. Slurm 22.05 keeps an element cancelled
    while still pending in its array's own record: `sacct -j ID_I` has no line of it, `sacct -j
    ID` shows it within the array's range (`ID_[0-2]`), under the lines of the elements split
    from it."""
    rows = sacct(array_ids)
    by_element: dict[str, dict[str, str]] = {}
    for job_id in sorted(rows, key=lambda j: "[" not in j):  # ranges first, elements over them
        for element in expand_array_range(job_id):
            by_element[element] = rows[job_id]
    return by_element


def system_logs(task: dict[str, Any]) -> str:
    return "\n".join(line for log in task.get("logs", []) for line in log.get("system_logs", []))


def test_remote_inputs_and_output_run_as_three_chained_jobs(
    service, servers, cluster_drs_server, partitions
):
    task_partition, transfer_partition = partitions
    data = os.urandom(50_000)
    servers.put("http", "xfer/in/a.bin", data)
    servers.put("s3", "xfer/in/b.txt", b"bee\n")
    cluster_drs_server.blob("xfer-drs", b"dee\n")
    task = service.run(
        {
            "name": "xfer",
            "resources": {"backend_parameters": {"partition": task_partition}},
            "inputs": [
                {"path": "/in/a.bin", "url": servers.url_for("http", "xfer/in/a.bin")},
                {"path": "/in/b.txt", "url": f"s3://{BUCKET}/xfer/in/b.txt"},
                {"path": "/in/c.txt", "url": cluster_drs_server.uri("xfer-drs")},
            ],
            "outputs": [{"path": "/out/sum", "url": f"s3://{BUCKET}/xfer/out/sum"}],
            "executors": [
                {
                    "image": "alpine",
                    "command": [
                        "sh",
                        "-c",
                        "wc -c < /in/a.bin > /out/sum; cat /in/b.txt /in/c.txt >> /out/sum",
                    ],
                }
            ],
        }
    )
    assert task["state"] == "COMPLETE", system_logs(task)
    assert servers.server_path("s3", "xfer/out/sum").read_text().split() == ["50000", "bee", "dee"]
    stage_in, run, stage_out = chain_ids(task)
    rows = final_records([stage_in, run, stage_out])
    assert [rows[j]["Partition"] for j in (stage_in, run, stage_out)] == [
        transfer_partition,
        task_partition,
        transfer_partition,
    ]
    assert {rows[j]["State"] for j in rows} == {"COMPLETED"}
    name = rows[run]["JobName"]
    assert rows[stage_in]["JobName"] == f"{name}-stage-in"
    assert rows[stage_out]["JobName"] == f"{name}-stage-out"
    # The dependency held each job until the one before it had ended.
    assert rows[stage_in]["End"] <= rows[run]["Start"]
    assert rows[run]["End"] <= rows[stage_out]["Start"]
    metadata = task["logs"][-1]["metadata"]
    assert metadata["slurm_stage_in_partition"] == transfer_partition
    assert task["logs"][-1]["logs"][0]["exit_code"] == 0
    assert [o["path"] for o in task["logs"][-1]["outputs"]] == ["/out/sum"]


def test_a_failed_stage_in_never_runs_the_task_s_job(service, servers, partitions):
    task = service.run(
        {
            "resources": {"backend_parameters": {"partition": partitions[0]}},
            "inputs": [{"path": "/in/x", "url": f"s3://{BUCKET}/xfer/missing.txt"}],
            "outputs": [{"path": "/out/y", "url": f"s3://{BUCKET}/xfer/out/y"}],
            "executors": [{"image": "alpine", "command": ["touch", "/out/y"]}],
        }
    )
    assert task["state"] == "SYSTEM_ERROR"
    assert "xfer/missing.txt" in system_logs(task)
    assert task["logs"][-1]["logs"] == []
    stage_in, run, stage_out = chain_ids(task)
    rows = final_records([stage_in, run, stage_out])
    assert rows[stage_in]["State"] == "FAILED"
    for job_id in (run, stage_out):
        assert rows[job_id]["State"].startswith("CANCELLED"), rows
        # Their scripts never started: they wrote no records.
        assert not (service.shared / "work" / task["id"] / "records" / job_id).exists()
    assert not servers.server_path("s3", "xfer/out/y").exists()


def test_cancel_during_stage_in_leaves_no_job_behind(service, servers, partitions):
    servers.put("http", "xfer/in/c.bin", b"c")
    task_id = service.create(
        {
            "resources": {"backend_parameters": {"partition": partitions[0]}},
            "inputs": [{"path": "/in/c", "url": servers.url_for("http", "xfer/in/c.bin")}],
            "executors": [{"image": "alpine", "command": ["sleep", "60"]}],
        }
    )
    deadline = time.monotonic() + 60
    while "slurm_stage_out_job_id" not in (
        (service.get(task_id).get("logs") or [{}])[-1].get("metadata") or {}
    ):
        assert time.monotonic() < deadline, service.get(task_id)
        time.sleep(0.2)
    # Its stage-in job has not ended yet (the task's job, whose executor sleeps, would say
    # RUNNING): the cancel comes while the chain is at its first job.
    assert service.get(task_id)["state"] in ("QUEUED", "INITIALIZING")
    service.cancel(task_id)
    ids = chain_ids(service.get(task_id))
    deadline = time.monotonic() + 30
    while True:
        queued = subprocess.run(
            ["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"],
            capture_output=True,
            text=True,
        ).stdout.split("\n")
        queued = [line for line in queued if line.strip()]
        if not queued:
            break
        assert time.monotonic() < deadline, queued
        time.sleep(0.5)
    assert service.get(task_id)["state"] == "CANCELED"


def test_staged_tasks_of_one_shape_go_as_three_arrays(service, servers, partitions):
    """Three staged tasks ready in one round (created while no poller runs): three arrays,
    element I of each task I's part; the one whose input is missing (404) ends SYSTEM_ERROR and
    its later elements never run, while the others complete."""
    task_partition, transfer_partition = partitions
    servers.put("http", "xfer/arrays/in.txt", b"in\n")
    urls = [servers.url_for("http", f"xfer/arrays/{n}") for n in ("in.txt", "in.txt", "gone")]
    documents = [
        {
            "name": "staged-array",
            "resources": {"backend_parameters": {"partition": task_partition}},
            "inputs": [{"path": "/in/x", "url": url}],
            "outputs": [{"path": "/out/y", "url": f"s3://{BUCKET}/xfer/arrays/out-{i}"}],
            "executors": [{"image": "alpine", "command": ["cp", "/in/x", "/out/y"]}],
        }
        for i, url in enumerate(urls)
    ]
    service.kill_poller()
    ids = [service.create(document) for document in documents]
    service.start_poller()
    tasks = [service.wait(task_id) for task_id in ids]
    assert [t["state"] for t in tasks] == ["COMPLETE", "COMPLETE", "SYSTEM_ERROR"], [
        system_logs(t) for t in tasks
    ]
    assert "xfer/arrays/gone" in system_logs(tasks[2])
    for i in (0, 1):
        assert servers.server_path("s3", f"xfer/arrays/out-{i}").read_bytes() == b"in\n"
    assert not servers.server_path("s3", "xfer/arrays/out-2").exists()
    # One array per part, each task its element of each by the index it was marked with.
    marks = [t["logs"][-1]["metadata"] for t in tasks]
    assert len({m["slurm_array_name"] for m in marks}) == 1
    chains = [chain_ids(t) for t in tasks]
    arrays = {tuple(job_id.partition("_")[0] for job_id in chain) for chain in chains}
    assert len(arrays) == 1 and len(set(next(iter(arrays)))) == 3
    for mark, chain in zip(marks, chains, strict=True):
        assert {job_id.partition("_")[2] for job_id in chain} == {mark["slurm_array_index"]}
    final_records([j for i in (0, 1) for j in chains[i]])  # the completed tasks' elements
    rows = element_records(list(next(iter(arrays))))
    for task, (stage_in, run, stage_out) in zip(tasks, chains, strict=True):
        assert rows[stage_in]["Partition"] == rows[stage_out]["Partition"] == transfer_partition
        assert rows[run]["Partition"] == task_partition
        if task["state"] == "COMPLETE":
            assert {rows[j]["State"] for j in (stage_in, run, stage_out)} == {"COMPLETED"}
            assert rows[stage_in]["End"] <= rows[run]["Start"] <= rows[run]["End"]
            assert rows[run]["End"] <= rows[stage_out]["Start"]
            continue
        assert rows[stage_in]["State"] == "FAILED"
        for job_id in (run, stage_out):
            assert rows[job_id]["State"].startswith("CANCELLED"), rows
            assert not (service.shared / "work" / task["id"] / "records" / job_id).exists()
