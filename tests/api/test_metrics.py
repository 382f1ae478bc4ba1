"""Prometheus metrics: the collectors, `GET /metrics` through Falcon's test client (who may
read it, route templates as labels), and the multiprocess directory `tes-bridge` prepares."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from falcon import testing
from prometheus_client.parser import text_string_to_metric_families

from bridge.api.app import create_app
from bridge.api.metrics_api import TaskStates, scrape
from bridge.cli.serve import prepare_metrics_dir
from bridge.config import Config, ConfigError, load_config
from bridge.store import Store
from bridge.system import metrics
from tests.fixtures.auth import PASSWORDS

API = "/ga4gh/tes/v1"
TASK = {"executors": [{"image": "alpine", "command": ["true"]}]}


def samples(text: str | bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a text exposition: (name, sorted labels) -> value."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(text: str | bytes, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


def test_tasks_by_state_come_from_one_group_by(sqlite_store: Store) -> None:
    with sqlite_store.db.connection_context():
        for _ in range(3):
            sqlite_store.create_task(dict(TASK))
        queued = sqlite_store.create_task(dict(TASK))
        sqlite_store.cancel_task(queued.id)
        counts = sqlite_store.count_by_state()
    assert counts == {"QUEUED": 3, "CANCELED": 1}
    family = next(TaskStates(lambda: counts).collect())
    by_state = {s.labels["state"]: s.value for s in family.samples}
    assert by_state["QUEUED"] == 3 and by_state["CANCELED"] == 1 and by_state["RUNNING"] == 0


def test_slurm_commands_are_counted_by_program_name_even_through_sudo() -> None:
    before = scrape(dict)
    metrics.observe_slurm_command(["/usr/bin/squeue", "-h", "-j", "1"], 0.02, failed=False)
    metrics.observe_slurm_command(
        ["sudo", "-n", "-u", "alice", "--", "/opt/slurm/bin/sbatch", "x"], 0.1, failed=True
    )
    after = scrape(dict)
    count = "tes_bridge_slurm_command_seconds_count"
    assert value(after, count, command="squeue") == value(before, count, command="squeue") + 1
    assert value(after, count, command="sbatch") == value(before, count, command="sbatch") + 1
    failures = "tes_bridge_slurm_command_failures_total"
    assert value(after, failures, command="sbatch") == value(before, failures, command="sbatch") + 1
    assert value(after, failures, command="squeue") == value(before, failures, command="squeue")


def test_submit_latency_and_run_time_are_observed_once_per_attempt() -> None:
    created = "2026-01-01T00:00:00Z"
    entry = {"start_time": "2026-01-01T00:00:30Z"}
    before = scrape(dict)
    metrics.observe_task_change(created, entry, "QUEUED", "INITIALIZING", final=False)
    metrics.observe_task_change(created, entry, "INITIALIZING", "RUNNING", final=False)
    metrics.observe_task_change(created, entry, "RUNNING", "RUNNING", final=False)
    entry["end_time"] = "2026-01-01T00:02:30Z"
    metrics.observe_task_change(created, entry, "RUNNING", "COMPLETE", final=True)
    after = scrape(dict)
    latency = "tes_bridge_task_submit_latency_seconds"
    assert value(after, latency + "_count") == value(before, latency + "_count") + 1
    assert value(after, latency + "_sum") == value(before, latency + "_sum") + 30
    run = "tes_bridge_task_run_seconds"
    assert value(after, run + "_count") == value(before, run + "_count") + 1
    assert value(after, run + "_sum") == value(before, run + "_sum") + 120


def test_metrics_endpoint_labels_requests_by_route_template(client: testing.TestClient) -> None:
    task_id = client.simulate_post(f"{API}/tasks", json=TASK).json["id"]
    client.simulate_get(f"{API}/tasks/{task_id}")
    client.simulate_get(f"{API}/tasks/no-such-task")
    answer = client.simulate_get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    assert value(text, "tes_bridge_tasks", state="QUEUED") == 1
    assert value(text, "tes_bridge_tasks_created_total") >= 1
    route = f"{API}/tasks/{{task_id}}"
    assert value(text, "tes_bridge_http_requests_total", method="GET", route=route, status="200")
    assert value(text, "tes_bridge_http_requests_total", method="GET", route=route, status="404")
    # A raw task id never becomes a label value.
    assert task_id not in text and "no-such-task" not in text


def test_metrics_are_for_admins_only(tmp_path: Path, sqlite_store: Store, htpasswd: Path) -> None:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={
            "auth.mode": "basic",
            "auth.htpasswd_file": str(htpasswd),
            "auth.admin_users": ["tesadmin"],
        },
    )
    client = testing.TestClient(create_app(config, store=sqlite_store))
    assert client.simulate_get("/metrics").status_code == 401
    alice = ("tesalice", PASSWORDS["tesalice"])
    refused = client.simulate_get("/metrics", headers=_basic(*alice))
    assert refused.status_code == 403
    assert "admin" in refused.json["message"]
    admin = ("tesadmin", PASSWORDS["tesadmin"])
    assert client.simulate_get("/metrics", headers=_basic(*admin)).status_code == 200


def test_metrics_can_be_turned_off(tmp_path: Path, sqlite_store: Store) -> None:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"metrics.enabled": False},
    )
    client = testing.TestClient(create_app(config, store=sqlite_store))
    assert client.simulate_get("/metrics").status_code == 404


def _basic(user: str, password: str) -> dict[str, str]:
    import base64

    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_serve_start_drops_the_files_of_dead_processes_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Set first, so that the variable prepare_metrics_dir sets is removed after the test (a
    # later scrape in this process would read this test's empty files).
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    directory = prepare_metrics_dir(config, wipe=False)
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    ).stdout.strip()
    (directory / f"counter_{dead}.db").write_bytes(b"")
    (directory / f"counter_{os.getpid()}.db").write_bytes(b"")
    prepare_metrics_dir(config, wipe=True)
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(directory)
    assert sorted(p.name for p in directory.iterdir()) == [f"counter_{os.getpid()}.db"]


def test_the_cli_imports_no_prometheus_client_before_the_directory_is_set() -> None:
    # prometheus_client picks single- or multiprocess mode once, when it is first imported.
    code = "import sys, bridge.cli.main; print('prometheus_client' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True)
    assert result.stdout.strip() == "False", result.stderr


def test_serve_says_how_to_fix_an_unusable_metrics_dir(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "metrics").write_text("not a directory")
    env = {"TES_BRIDGE_STATE_DIR": str(tmp_path / "state"), "PATH": os.environ["PATH"]}
    argv = [sys.executable, "-m", "bridge", "serve", "--no-poller", "--bind", "127.0.0.1:0"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "metrics" in result.stderr and "metrics.enabled = false" in result.stderr


@pytest.mark.parametrize("bind", ["9464", "host:", "127.0.0.1:99999", ":9464"])
def test_a_metrics_bind_must_be_host_and_port(bind: str) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.bind: .*HOST:PORT"):
        load_config(environ={}, overrides={"metrics.bind": bind})


def test_with_a_metrics_bind_the_api_serves_no_metrics(tmp_path: Path, sqlite_store: Store) -> None:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"metrics.bind": "127.0.0.1:9464"},
    )
    client = testing.TestClient(create_app(config, store=sqlite_store))
    assert client.simulate_get("/metrics").status_code == 404


def test_failure_counters_and_finished_tasks_exist_at_zero_with_the_build_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An alert's rate() needs a series before the first failure: every label set is there."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # this process's values
    text = scrape(dict)
    found = samples(text)
    for command in ("sbatch", "squeue", "sacct", "scancel", "sinfo"):
        assert ("tes_bridge_slurm_command_failures_total", (("command", command),)) in found
    for state in ("COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED", "PREEMPTED"):
        assert ("tes_bridge_tasks_finished_total", (("state", state),)) in found
    assert ("tes_bridge_image_pull_failures_total", ()) in found
    from bridge import __version__

    assert value(text, "tes_bridge_build_info", version=__version__) == 1


def test_a_cancel_through_the_api_counts_one_canceled_task(
    client: testing.TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    before = scrape(dict)
    task_id = client.simulate_post(f"{API}/tasks", json=TASK).json["id"]
    assert client.simulate_post(f"{API}/tasks/{task_id}:cancel", json={}).status_code == 200
    assert client.simulate_post(f"{API}/tasks/{task_id}:cancel", json={}).status_code == 200
    after = scrape(dict)
    name = "tes_bridge_tasks_finished_total"
    assert value(after, name, state="CANCELED") == value(before, name, state="CANCELED") + 1


def test_the_poller_gauges_heartbeat_work_dir_and_submission_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics.observe_poller_cycle(0.5, 1_700_000_000.0, tmp_path)
    metrics.observe_submission_round(3, 2)
    text = scrape(dict)
    assert value(text, "tes_bridge_poller_last_cycle_timestamp_seconds") == 1_700_000_000.0
    stats = os.statvfs(tmp_path)
    assert value(text, "tes_bridge_work_dir_size_bytes") == stats.f_blocks * stats.f_frsize
    assert 0 < value(text, "tes_bridge_work_dir_free_bytes") <= stats.f_blocks * stats.f_frsize
    assert value(text, "tes_bridge_tasks_held_by_admission") == 3
    assert value(text, "tes_bridge_tasks_waiting_for_image") == 2
    # A missing work directory keeps the last values, and the heartbeat still moves.
    metrics.observe_poller_cycle(0.5, 1_700_000_010.0, tmp_path / "gone")
    text = scrape(dict)
    assert value(text, "tes_bridge_poller_last_cycle_timestamp_seconds") == 1_700_000_010.0
    assert value(text, "tes_bridge_work_dir_size_bytes") == stats.f_blocks * stats.f_frsize


def test_the_oldest_queued_task_and_the_state_dir_are_read_at_scrape_time(
    client: testing.TestClient, config: Config, store: Store
) -> None:
    """For the alerts on a task QUEUED too long and a full state directory (the SQLite
    database's, the metrics files'): both read by the API that answers, for its own node."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    assert value(client.simulate_get("/metrics").text, AGE) == 0.0  # none QUEUED
    first = client.simulate_post(f"{API}/tasks", json=TASK).json["id"]
    client.simulate_post(f"{API}/tasks", json=TASK)
    # The first task is the oldest: its age is read, not the newer one's.
    with store.db.connection_context():
        store.update_task(first, creation_time="2000-01-01T00:00:00+00:00")
    text = client.simulate_get("/metrics").text
    assert value(text, AGE) > time.time() - 946_684_800 - 60
    stats = os.statvfs(config.state_dir)
    assert value(text, "tes_bridge_state_dir_size_bytes") == stats.f_blocks * stats.f_frsize
    assert 0 < value(text, "tes_bridge_state_dir_free_bytes") <= stats.f_blocks * stats.f_frsize
    # Canceled, the oldest QUEUED task is the newer one.
    client.simulate_post(f"{API}/tasks/{first}:cancel")
    assert value(client.simulate_get("/metrics").text, AGE) < 60


AGE = "tes_bridge_oldest_queued_task_age_seconds"
