"""The local cluster's network-less node (deploy/local-cluster.sh): partition `offline` is one node
whose slurmd, and so every job on it, runs in a network namespace that reaches slurmctld and
nothing else, as a site's compute nodes that see only the shared filesystem; `xfer` holds a node
that reaches the network."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.cluster import LocalCluster
from tests.fixtures.service import BridgeService
from tests.fixtures.storage import StorageServers

pytestmark = pytest.mark.cluster

#: The probe a job runs: "<host>:<port> open" or "<host>:<port> closed" for each target.
PROBE = """#!/bin/bash
echo "node $SLURMD_NODENAME"
for target in {targets}; do
  if timeout 5 bash -c "exec 3<>/dev/tcp/${{target%:*}}/${{target##*:}}" 2>/dev/null; then
    echo "$target open"
  else
    echo "$target closed"
  fi
done
"""


@pytest.fixture(scope="module")
def offline(local_cluster: LocalCluster) -> str:
    """The network-less partition (its one node is LOCAL_CLUSTER_OFFLINE_NODE)."""
    partition = local_cluster.env.get("LOCAL_CLUSTER_OFFLINE_PARTITION", "")
    assert partition, (
        "these tests need the network-less node: deploy/local-cluster.sh up --nodes 2"
        " (LOCAL_CLUSTER_OFFLINE=1)"
    )
    return partition


def scontrol_value(*args: str, key: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", *args], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    match = re.search(rf"\b{key}\s*=\s*(\S+)", out)
    assert match, out[:500]
    return match.group(1)


def host_side_address(node: str) -> str:
    """This machine's end of the node's link: the source address of the route to the node."""
    node_addr = scontrol_value("node", node, key="NodeAddr")
    route = subprocess.run(
        ["ip", "-o", "route", "get", node_addr], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"\bsrc (\S+)", route)
    assert match, route
    return match.group(1)


@pytest.fixture
def listener() -> Iterator[int]:
    """A port open on every address of this machine (the node's link included): reachable from
    wherever nothing but a firewall stands in the way."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def test_the_offline_node_reaches_slurmctld_and_nothing_else(
    local_cluster: LocalCluster,
    offline: str,
    storage_servers: StorageServers,
    listener: int,
    shared_tmp_path: Path,
) -> None:
    node = local_cluster.env["LOCAL_CLUSTER_OFFLINE_NODE"]
    slurmctld = f"127.0.0.1:{scontrol_value('config', key='SlurmctldPort')}"
    http = f"127.0.0.1:{storage_servers.http_port}"
    registry = local_cluster.registry
    everywhere = f"{host_side_address(node)}:{listener}"
    targets = [slurmctld, http, registry, everywhere]
    partitions = [
        offline,
        local_cluster.partition,
        local_cluster.env["LOCAL_CLUSTER_TRANSFER_PARTITION"],
    ]
    for partition in partitions:
        subprocess.run(
            ["sbatch", "--parsable", f"--partition={partition}", "--time=2",
             f"--output={shared_tmp_path}/{partition}.out"],
            input=PROBE.format(targets=" ".join(targets)),
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
    seen: dict[str, list[str]] = {}
    deadline = time.monotonic() + 90
    while len(seen) < len(partitions):
        assert time.monotonic() < deadline, (seen, list(shared_tmp_path.iterdir()))
        for partition in partitions:
            out = shared_tmp_path / f"{partition}.out"
            lines = out.read_text().splitlines() if out.exists() else []
            if len(lines) == len(targets) + 1:
                seen[partition] = lines
        time.sleep(0.3)
    # Only slurmctld, through the node's own 127.0.0.1 as on every node: not the login node's
    # test servers and registry on its loopback, nor a port open on every address here.
    assert seen[offline] == [
        f"node {node}",
        f"{slurmctld} open",
        f"{http} closed",
        f"{registry} closed",
        f"{everywhere} closed",
    ], seen
    # The same probe from the nodes that reach the network finds every target open.
    for partition in partitions[1:]:
        assert seen[partition][0] != f"node {node}"
        assert seen[partition][1:] == [f"{target} open" for target in targets], seen


def system_logs(task: dict[str, Any]) -> str:
    return "\n".join(line for log in task.get("logs", []) for line in log.get("system_logs", []))


def test_offline_tasks_run_containers_but_cannot_stage_from_the_network(
    local_cluster: LocalCluster,
    bridge_service: BridgeService,
    offline: str,
    storage_servers: StorageServers,
) -> None:
    storage_servers.put("http", "offline/in.txt", b"from the network\n")
    url = storage_servers.url_for("http", "offline/in.txt")
    main = local_cluster.partition

    def task(partition: str, inputs: list[dict[str, str]]) -> dict[str, Any]:
        return {
            "inputs": inputs,
            "executors": [{"image": "alpine", "command": ["sh", "-c", "cat /in/* || echo none"]}],
            "resources": {"zones": [partition]},
        }

    # All at once. Stage-in runs in the task's job, on the node.
    fetching = {p: bridge_service.create(task(p, [{"url": url, "path": "/in/in.txt"}]))
                for p in (offline, main)}  # fmt: skip
    plain = bridge_service.create(task(offline, []))
    done = {p: bridge_service.wait(task_id) for p, task_id in fetching.items()}
    assert done[main]["state"] == "COMPLETE", done[main]
    assert done[main]["logs"][-1]["logs"][0]["stdout"] == "from the network\n"
    failed = done[offline]
    assert failed["state"] == "SYSTEM_ERROR", failed
    assert not failed["logs"][-1].get("logs"), failed  # no executor ran
    logs = system_logs(failed)
    assert f"input 0 {url} -> /in/in.txt: GET {url} failed: cannot connect: " in logs, logs
    assert "refused" in logs, logs
    # ... and the line that tells the site what to set.
    assert 'staging.where = "transfer"' in logs, logs
    # The image comes from the shared cache the login node pulled it into: no network needed.
    bridge_service.wait(plain)
    ran = bridge_service.with_final_facts(plain)
    assert ran["state"] == "COMPLETE", ran
    assert ran["logs"][-1]["logs"][0]["stdout"] == "none\n"
    node = local_cluster.env["LOCAL_CLUSTER_OFFLINE_NODE"]
    assert ran["logs"][-1]["metadata"]["slurm_node"] == node, ran["logs"][-1]["metadata"]


def net_namespace(path: str) -> int:
    return os.stat(path).st_ino


def test_up_makes_a_lost_link_anew_and_moves_the_nodes_slurmd_into_it(
    local_cluster: LocalCluster, offline: str
) -> None:
    node = local_cluster.env["LOCAL_CLUSTER_OFFLINE_NODE"]
    netns = Path("/run/netns") / f"tesb-{node}"
    pid_file = local_cluster.state_dir / "run" / f"slurmd-{node}.pid"
    old = int(pid_file.read_text())
    assert net_namespace(f"/proc/{old}/ns/net") == net_namespace(str(netns))
    # The link gone (as after a host's network restart): the node is cut off from slurmctld.
    subprocess.run(["ip", "link", "del", netns.name], check=True)
    local_cluster.up()
    new = int(pid_file.read_text())
    assert new != old
    assert net_namespace(f"/proc/{new}/ns/net") == net_namespace(str(netns))
    assert net_namespace(f"/proc/{new}/ns/net") != net_namespace("/proc/self/ns/net")
    state = subprocess.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert state and set(state) <= {"idle", "mixed", "allocated"}, state
