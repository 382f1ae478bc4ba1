"""resources.disk_gb on the real cluster, whose node declares a TmpDisk (deploy/local-cluster.sh):
`--tmp` where the nodes can honour it, and Slurm's own refusal, explained, where they cannot."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fixtures.service import BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster

ECHO = [{"image": "alpine", "command": ["echo", "hello"]}]


def node_tmp_disk_mb() -> int:
    out = subprocess.run(
        ["sinfo", "-h", "-o", "%d"], capture_output=True, text=True, check=True
    ).stdout
    return min(int(line) for line in out.split())


def system_logs(task: dict[str, Any]) -> str:
    return "\n".join(line for log in task.get("logs", []) for line in log.get("system_logs", []))


@pytest.fixture(scope="module")
def tmp_mode_service(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    with start_bridge_service(
        local_cluster, tmp_path_factory.mktemp("disk-tmp"), slurm_toml='disk_request = "tmp"'
    ) as service:
        yield service


def test_fractional_disk_gb_completes_with_tmp_rounded_up(bridge_service: BridgeService) -> None:
    assert node_tmp_disk_mb() > 0, "the local cluster's node should declare a TmpDisk"
    task = bridge_service.run({"executors": ECHO, "resources": {"disk_gb": 2.15}})
    assert task["state"] == "COMPLETE", task
    script = (bridge_service.work_dir / task["id"] / "job.sh").read_text()
    assert "#SBATCH --tmp=2202" in script.splitlines()  # 2.15 * 1024 = 2201.6 MB
    job_id = task["logs"][0]["metadata"]["slurm_job_id"]
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True
    ).stdout
    # Slurm keeps an ended job for MinJobAge (300 s): it asked for the disk.
    assert re.search(r"MinTmpDiskNode=2202M\b", shown), shown


def test_toil_sized_disk_gb_is_at_least_one_megabyte(bridge_service: BridgeService) -> None:
    task = bridge_service.run({"executors": ECHO, "resources": {"disk_gb": 0.00093}})
    assert task["state"] == "COMPLETE", task
    script = (bridge_service.work_dir / task["id"] / "job.sh").read_text()
    assert "#SBATCH --tmp=1" in script.splitlines()


@pytest.mark.parametrize("mode", ["auto", "tmp"])
def test_more_disk_than_any_node_declares_is_slurms_refusal_explained(
    bridge_service: BridgeService, tmp_mode_service: BridgeService, mode: str
) -> None:
    service = tmp_mode_service if mode == "tmp" else bridge_service
    declared = node_tmp_disk_mb()
    disk_gb = declared // 1024 + 10
    task = service.run({"executors": ECHO, "resources": {"disk_gb": disk_gb}})
    assert task["state"] == "SYSTEM_ERROR", task
    logs = system_logs(task)
    assert "Temporary disk specification can not be satisfied" in logs, logs
    assert f"resources.disk_gb = {disk_gb} asks Slurm" in logs
    assert f'slurm.disk_request = "{mode}"' in logs
    assert f"the nodes declare TmpDisk main {declared} MB" in logs
