"""Job arrays on the real cluster (slurm.arrays = "auto"): tasks of one shape ready in one
round go as one `sbatch --array`, and everything per task still holds for an element: its own
outputs, logs and records, a cancel, a node lost for real, the poller killed inside the array's
sbatch, and admission control counting elements.

To make a burst ready in one round, the tests stop the poller, create the tasks, and start it
again. The node-loss test kills a node: run it under `flock -x -o /tmp/cluster.lock`.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.core.naming import job_name
from bridge.slurm import SlurmClient
from tests.cluster.test_multinode import kill_node, restore_nodes  # noqa: F401 (a fixture)
from tests.cluster.test_reliability import (  # noqa: F401 (slow_service: a fixture)
    set_delays,
    slow_service,
)
from tests.fixtures.cluster import LocalCluster
from tests.fixtures.service import BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster

ALPINE = "alpine"


def task(*command: str, **resources: Any) -> dict[str, Any]:
    document: dict[str, Any] = {"executors": [{"image": ALPINE, "command": list(command)}]}
    if resources:
        document["resources"] = resources
    return document


def burst(service: BridgeService, documents: list[dict[str, Any]]) -> list[str]:
    """Create the tasks while no poller runs: its next round finds them all ready at once."""
    service.kill_poller()
    ids = [service.create(document) for document in documents]
    service.start_poller()
    return ids


def metadata(task: dict[str, Any]) -> dict[str, str]:
    return task["logs"][0]["metadata"]


def sacct_elements(array_id: str) -> dict[str, tuple[str, str]]:
    """sacct's job lines of an array: element id -> (state, node)."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", array_id, "--format=JobID,State,NodeList"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    rows = [line.split("|") for line in out.splitlines() if line]
    return {job_id: (state.split()[0], node) for job_id, state, node in rows}


def wait_running(service: BridgeService, task_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        current = service.get(task_id)
        node = (current.get("logs") or [{}])[-1].get("metadata", {}).get("slurm_node")
        if current["state"] == "RUNNING" and node:
            return current
        assert current["state"] in {"QUEUED", "INITIALIZING", "RUNNING"}, current
        assert time.monotonic() < deadline, current
        time.sleep(0.3)


@pytest.fixture(scope="module")
def service(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    with start_bridge_service(local_cluster, tmp_path_factory.mktemp("arrays")) as service:
        warm_up(service)
        yield service


def warm_up(service: BridgeService) -> None:
    """One task first: the image is pulled (and unpacked) before a burst, which is then ready
    in one round, not split by the pull's end."""
    assert service.run(task("true"), timeout=180)["state"] == "COMPLETE"


# ----------------------------------------------------------------------------- one array


def test_fifty_tasks_of_one_shape_are_one_array_each_with_its_own_outputs(service):
    ids = burst(service, [task("sh", "-c", f"echo out {i}; echo err {i} >&2") for i in range(50)])
    tasks = [service.wait(task_id, timeout=600) for task_id in ids]
    array_ids = set()
    for index, current in enumerate(tasks):
        assert current["state"] == "COMPLETE", current
        meta = metadata(current)
        array_id = meta["slurm_array_job_id"]
        array_ids.add(array_id)
        assert meta["slurm_job_id"] == f"{array_id}_{index}"
        executor_log = current["logs"][0]["logs"][0]
        assert executor_log["stdout"] == f"out {index}\n"
        assert executor_log["stderr"] == f"err {index}\n"
        task_dir = service.work_dir / current["id"]
        assert (task_dir / "records" / meta["slurm_job_id"] / "outcome").is_file()
        assert (task_dir / f"slurm-{meta['slurm_job_id']}.out").is_file()
    assert len(array_ids) == 1
    (array_id,) = array_ids
    expected = sorted(f"{array_id}_{i}" for i in range(50))
    # slurmdbd records an element a moment after slurmctld ended it (the tasks end by squeue
    # and their records): wait for accounting to list them all.
    deadline = time.monotonic() + 60
    while sorted(elements := sacct_elements(array_id)) != expected and time.monotonic() < deadline:
        time.sleep(2)
    assert sorted(elements) == expected
    assert {state for state, _ in elements.values()} == {"COMPLETED"}


def test_three_shapes_are_three_arrays(service):
    shapes = [{"cpu_cores": 1}, {"cpu_cores": 2}, {"ram_gb": 0.25}]
    documents = [task("true", **shape) for shape in shapes for _ in range(4)]
    ids = burst(service, documents)
    tasks = [service.wait(task_id, timeout=300) for task_id in ids]
    assert all(t["state"] == "COMPLETE" for t in tasks), tasks
    arrays = [metadata(t)["slurm_array_job_id"] for t in tasks]
    assert len(set(arrays)) == 3
    assert [len(set(arrays[i : i + 4])) for i in (0, 4, 8)] == [1, 1, 1]


def test_a_lone_task_is_a_job_of_its_own(service):
    (task_id,) = burst(service, [task("true")])
    current = service.wait(task_id, timeout=120)
    assert current["state"] == "COMPLETE"
    assert "_" not in metadata(current)["slurm_job_id"]
    assert "slurm_array_job_id" not in metadata(current)


# ----------------------------------------------------------------------------- per element


def test_canceling_one_element_cancels_only_its_task(service):
    ids = burst(service, [task("sh", "-c", "sleep 6; echo done") for _ in range(5)])
    victim = ids[1]
    running = wait_running(service, victim)
    service.cancel(victim)
    tasks = {task_id: service.wait(task_id, timeout=300) for task_id in ids}
    assert tasks[victim]["state"] == "CANCELED"
    others = [tasks[task_id] for task_id in ids if task_id != victim]
    assert all(t["state"] == "COMPLETE" for t in others), others
    element = metadata(running)["slurm_job_id"]
    array_id = element.split("_")[0]
    deadline = time.monotonic() + 60
    while (states := sacct_elements(array_id)).get(element, ("",))[0] != "CANCELLED":
        assert time.monotonic() < deadline, states
        time.sleep(1)
    assert [e for e, (state, _) in states.items() if state != "COMPLETED"] == [element]


def test_a_node_lost_under_an_array_retries_only_its_elements_elsewhere(
    service,
    local_cluster: LocalCluster,
    restore_nodes: None,  # noqa: F811 (the fixture)
):
    ids = burst(service, [task("sh", "-c", "sleep 15; echo done") for _ in range(4)])
    first = wait_running(service, ids[0])
    node = metadata(first)["slurm_node"]
    time.sleep(2)  # the other elements start too, where there is room
    before = {task_id: metadata(service.get(task_id)) for task_id in ids}
    kill_node(local_cluster, node)
    tasks = {task_id: service.wait(task_id, timeout=300) for task_id in ids}
    lost = [t for t in ids if before[t].get("slurm_node") == node]
    assert ids[0] in lost
    for task_id, current in tasks.items():
        assert current["state"] == "COMPLETE", current
        assert len(current["logs"]) == 1
        meta = metadata(current)
        if task_id in lost:
            # Submitted again, alone or in a later array, on the other node.
            assert meta["slurm_lost_job_ids"] == before[task_id]["slurm_job_id"]
            assert meta["slurm_job_id"] != before[task_id]["slurm_job_id"]
            assert meta["slurm_node"] != node
        else:
            # Untouched: the element it had, which ran to its end.
            assert meta["slurm_job_id"] == before[task_id]["slurm_job_id"]
            assert "slurm_lost_job_ids" not in meta


# ----------------------------------------------------------------------------- crash window


@pytest.fixture
def warm_slow_service(slow_service: BridgeService) -> BridgeService:  # noqa: F811 (the fixture)
    """test_reliability's service whose sbatch sleeps 2 s before and after, its image pulled."""
    warm_up(slow_service)
    return slow_service


def wait_for_array_sbatch(root: Path, seen: int, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    log = root / "sbatch.log"
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().count("--array=") > seen:
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError("no array sbatch started")


def test_poller_killed_inside_the_arrays_sbatch_runs_every_task_once(warm_slow_service):
    service, root = warm_slow_service, warm_slow_service.root
    ids: list[str] = []
    # In the wrapper's first sleep (no array yet), around the real sbatch, in its second sleep
    # (the array exists, the elements' ids are not stored yet).
    for round_, offset in enumerate((0.5, 2.3, 3.2)):
        batch = burst(service, [task("sh", "-c", f"echo {offset}") for _ in range(5)])
        ids += batch
        started = wait_for_array_sbatch(root, round_)
        time.sleep(max(0.0, started + offset - time.monotonic()))
        service.kill_poller()
        service.start_poller()
    set_delays(root, 0, 0)
    tasks = {task_id: service.wait(task_id, timeout=300) for task_id in ids}
    for current in tasks.values():
        assert current["state"] == "COMPLETE", current
        runs = list((service.work_dir / current["id"] / "records").glob("*/executors/0"))
        assert len(runs) == 1, (current["id"], runs)
    # Every array sbatch ever started, by its name: their elements are the tasks, once each.
    sbatches = (root / "sbatch.log").read_text()
    names = set(re.findall(r"--job-name=([A-Za-z0-9_.-]*tes-array-[0-9a-f]+)", sbatches))
    names |= {job_name(t["id"], t.get("name")) for t in tasks.values()}
    found = SlurmClient().find_by_names(sorted(names))
    jobs = [job for name in found for job in found[name] if job.state != "PENDING"]
    assert len(jobs) == len(ids), [(j.job_id, j.name, j.state) for j in jobs]
    assert {metadata(t)["slurm_job_id"] for t in tasks.values()} == {j.job_id for j in jobs}


# ----------------------------------------------------------------------------- admission


@pytest.fixture
def admission_service(local_cluster: LocalCluster, tmp_path: Path) -> Iterator[BridgeService]:
    with start_bridge_service(
        local_cluster, tmp_path, slurm_toml="max_jobs_in_flight = 5"
    ) as service:
        warm_up(service)
        yield service


def test_max_jobs_in_flight_five_with_forty_tasks_never_more_than_five_elements(
    admission_service,
):
    service = admission_service
    ids = burst(service, [task("sh", "-c", "sleep 1") for _ in range(40)])
    work = str(service.work_dir)
    most = 0
    deadline = time.monotonic() + 600
    while True:
        # Our jobs in Slurm (pending or running): their scripts lie in our work directory.
        out = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i|%T|%o"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        ours = [line for line in out.splitlines() if f"|{work}/" in line]
        most = max(most, len(ours))
        states = [service.get(task_id, "MINIMAL")["state"] for task_id in ids]
        if all(state == "COMPLETE" for state in states):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    assert 0 < most <= 5
    arrays = {metadata(service.get(task_id)).get("slurm_array_job_id") for task_id in ids}
    assert len(arrays - {None}) >= 2  # the room that frees up goes to later arrays
