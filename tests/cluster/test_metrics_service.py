"""/metrics of the real service on the real cluster: two gunicorn workers and a poller write
their own metrics files, and one scrape (parsed with prometheus_client's own parser) sums
them; only an admin may read it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.api.test_metrics import samples, value
from tests.fixtures.auth import PASSWORDS, write_htpasswd
from tests.fixtures.service import TERMINAL, BridgeService, start_bridge_service
from tests.procs import free_port
from tests.unit.test_monitoring_files import (
    PROMETHEUS_OWN,
    dashboard_exprs,
    metric_names,
    rule_exprs,
)

pytestmark = pytest.mark.cluster

ADMIN = ("tesadmin", PASSWORDS["tesadmin"])
USER = ("tesalice", PASSWORDS["tesalice"])


@pytest.fixture(scope="module")
def service(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    root = tmp_path_factory.mktemp("metrics")
    htpasswd = write_htpasswd(root / "htpasswd")
    extra = f"""
[auth]
mode = "basic"
htpasswd_file = "{htpasswd}"
admin_users = ["tesadmin"]
"""
    with start_bridge_service(local_cluster, root, extra_toml=extra) as service:
        yield service


def _scrape(service: BridgeService) -> str:
    answer = requests.get(f"{service.url}/metrics", auth=ADMIN, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.text


def _wait(service: BridgeService, task_id: str, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        task = requests.get(f"{service.api}/tasks/{task_id}", auth=USER, timeout=10).json()
        if task["state"] in TERMINAL:
            return task
        assert time.monotonic() < deadline, (
            f"{task_id} still {task['state']}:\n{service.log_tail()}"
        )
        time.sleep(0.5)


def test_a_scrape_sums_what_every_worker_and_the_poller_counted(service: BridgeService) -> None:
    before = _scrape(service)
    tasks = [
        {"executors": [{"image": "alpine", "command": ["sh", "-c", "sleep 1"]}]},
        {"executors": [{"image": "alpine", "command": ["true"]}]},
        {"executors": [{"image": "alpine", "command": ["sh", "-c", "exit 3"]}]},
    ]
    ids = []
    for task in tasks:
        answer = requests.post(f"{service.api}/tasks", json=task, auth=USER, timeout=10)
        assert answer.status_code == 200, answer.text
        ids.append(answer.json()["id"])
    # Many requests, so both workers answer some of them.
    for _ in range(40):
        assert requests.get(f"{service.api}/tasks/{ids[0]}", auth=USER, timeout=10).ok
    states = [_wait(service, task_id)["state"] for task_id in ids]
    assert states == ["COMPLETE", "COMPLETE", "EXECUTOR_ERROR"]
    after = _scrape(service)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("tes_bridge_tasks_created_total") == 3
    assert value(after, "tes_bridge_tasks", state="COMPLETE") == 2
    assert value(after, "tes_bridge_tasks", state="EXECUTOR_ERROR") == 1
    assert moved("tes_bridge_task_submit_latency_seconds_count") >= 3
    assert moved("tes_bridge_task_run_seconds_count") >= 3
    assert value(after, "tes_bridge_task_run_seconds_sum") >= 1  # the `sleep 1` at least
    assert moved("tes_bridge_slurm_command_seconds_count", command="sbatch") >= 3
    assert moved("tes_bridge_slurm_command_seconds_count", command="squeue") >= 1
    assert moved("tes_bridge_poll_cycle_seconds_count") >= 1
    assert value(after, "tes_bridge_image_pulls_total") >= 1  # the first task pulled alpine
    route = "/ga4gh/tes/v1/tasks/{task_id}"
    gets = "tes_bridge_http_requests_total"
    assert moved(gets, method="GET", route=route, status="200") >= 40
    assert moved(gets, method="POST", route="/ga4gh/tes/v1/tasks", status="200") == 3

    # Each process writes its own files: the poller and both workers counted something.
    pids = {path.stem.rsplit("_", 1)[-1] for path in (service.root / "state/metrics").glob("*.db")}
    assert len(pids) >= 3, pids


def test_an_image_that_cannot_be_pulled_is_counted(service: BridgeService) -> None:
    before = _scrape(service)
    task = {"executors": [{"image": "no-such-image-for-metrics:1", "command": ["true"]}]}
    answer = requests.post(f"{service.api}/tasks", json=task, auth=USER, timeout=10)
    task_id = answer.json()["id"]
    deadline = time.monotonic() + 120
    while value(_scrape(service), "tes_bridge_image_pull_failures_total") <= value(
        before, "tes_bridge_image_pull_failures_total"
    ):
        assert time.monotonic() < deadline, service.log_tail()
        time.sleep(1)
    requests.post(f"{service.api}/tasks/{task_id}:cancel", json={}, auth=USER, timeout=10)


def test_metrics_need_an_admin(service: BridgeService) -> None:
    assert requests.get(f"{service.url}/metrics", timeout=10).status_code == 401
    assert requests.get(f"{service.url}/metrics", auth=USER, timeout=10).status_code == 403
    assert requests.get(f"{service.url}/metrics", auth=ADMIN, timeout=10).status_code == 200


def test_root_of_state_holds_a_private_metrics_dir(service: BridgeService) -> None:
    directory = Path(service.root / "state/metrics")
    assert directory.stat().st_mode & 0o777 == 0o700


def test_counts_survive_a_worker_that_dies(service: BridgeService) -> None:
    """A dead worker's counters stay in the sum (its files are kept; only its live gauges
    go, in gunicorn's child_exit), so a counter never goes back when gunicorn replaces it."""
    before = _scrape(service)
    api = service.processes["api"].pid
    workers = subprocess.run(["pgrep", "-P", str(api)], capture_output=True, text=True)
    victim = int(workers.stdout.split()[0])
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        now = subprocess.run(["pgrep", "-P", str(api)], capture_output=True, text=True)
        pids = {int(p) for p in now.stdout.split()}
        if victim not in pids and len(pids) >= 2:
            break
        assert time.monotonic() < deadline, now.stdout
        time.sleep(0.2)
    after = _scrape(service)
    name = "tes_bridge_tasks_created_total"
    assert value(after, name) == value(before, name)
    gets = value(
        after, "tes_bridge_http_requests_total", method="GET", route="/metrics", status="200"
    )
    assert gets >= value(
        before, "tes_bridge_http_requests_total", method="GET", route="/metrics", status="200"
    )


def test_metrics_on_a_bind_of_their_own(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """With metrics.bind, gunicorn's master serves them on that address, without
    credentials, and the API no longer does."""
    port = free_port()
    root = tmp_path_factory.mktemp("metrics-bind")
    with start_bridge_service(
        local_cluster, root, extra_toml=f'[metrics]\nbind = "127.0.0.1:{port}"\n'
    ) as service:
        task = {"executors": [{"image": "alpine", "command": ["true"]}]}
        assert service.run(task)["state"] == "COMPLETE"
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert value(text, "tes_bridge_tasks_created_total") == 1
        assert value(text, "tes_bridge_tasks", state="COMPLETE") == 1
        assert value(text, "tes_bridge_slurm_command_seconds_count", command="sbatch") == 1
        assert requests.get(f"{service.url}/metrics", timeout=10).status_code == 404


def test_the_alerts_and_the_dashboard_use_only_metrics_the_bridge_exports(
    service: BridgeService,
) -> None:
    """Every metric name in deploy/prometheus's rules and deploy/grafana's dashboard is a series
    of this real bridge's /metrics (API workers and poller), after a task ran."""
    task_id = requests.post(
        f"{service.api}/tasks",
        json={"executors": [{"image": "alpine", "command": ["true"]}]},
        auth=USER,
        timeout=10,
    ).json()["id"]
    assert _wait(service, task_id)["state"] == "COMPLETE"
    text = _scrape(service)
    exported = {name for name, _ in samples(text)}
    used: set[str] = set()
    for expr in rule_exprs() + dashboard_exprs():
        used |= metric_names(expr) - PROMETHEUS_OWN
    assert used and used <= exported, sorted(used - exported)
    # The poller's own gauges are live: a heartbeat of the last seconds, a work dir with room.
    assert time.time() - value(text, "tes_bridge_poller_last_cycle_timestamp_seconds") < 60
    assert (
        0
        < value(text, "tes_bridge_work_dir_free_bytes")
        <= value(text, "tes_bridge_work_dir_size_bytes")
    )
    assert value(text, "tes_bridge_tasks_finished_total", state="COMPLETE") >= 1
    assert ("tes_bridge_tasks_finished_total", (("state", "SYSTEM_ERROR"),)) in samples(text)
