"""The real server: `tes-bridge serve` under gunicorn, over HTTP, and the py-tes client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import tes

from tests.procs import free_port

ECHO = {"executors": [{"image": "alpine", "command": ["echo", "hello"]}]}


def wait_until_up(url: str, process: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}")
        try:
            if requests.get(f"{url}/ga4gh/tes/v1/service-info", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            time.sleep(0.1)
    raise AssertionError("server did not answer in time")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    state = tmp_path_factory.mktemp("server-state")
    port = free_port()
    log_path = state / "server.log"
    env = {**os.environ, "TES_BRIDGE_STATE_DIR": str(state)}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bridge",
                "serve",
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                "2",
                "--no-poller",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, process)
        yield url, log_path
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("prefix", ["/ga4gh/tes/v1", "/v1"])
def test_gunicorn_serves_both_prefixes(server, prefix):
    url, _ = server
    created = requests.post(f"{url}{prefix}/tasks", json=ECHO, timeout=5)
    assert created.status_code == 200
    assert created.headers["Content-Type"].startswith("application/json")
    task_id = created.json()["id"]
    # Any worker can read what another stored: they share the SQLite file.
    for _ in range(4):
        got = requests.get(f"{url}{prefix}/tasks/{task_id}", timeout=5)
        assert got.json() == {"id": task_id, "state": "QUEUED"}
    assert requests.post(f"{url}{prefix}/tasks/{task_id}:cancel", json={}, timeout=5).json() == {}
    assert requests.get(f"{url}{prefix}/tasks/{task_id}", timeout=5).json()["state"] == "CANCELED"
    assert requests.get(f"{url}/v1/tasks/service-info", timeout=5).json().keys() == {
        "name",
        "doc",
        "storage",
    }


def test_curl_default_form_content_type_is_accepted(server):
    url, _ = server
    result = subprocess.run(
        ["curl", "-sS", "-X", "POST", "--data", json.dumps(ECHO), f"{url}/v1/tasks"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert set(json.loads(result.stdout)) == {"id"}


def test_access_log_is_json_lines_on_stderr(server):
    url, log_path = server
    requests.get(f"{url}/v1/tasks/not-there", timeout=5)
    time.sleep(0.2)
    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    access = [e for e in entries if e.get("logger") == "bridge.access"]
    assert any(e["status"] == 404 and e["path"] == "/v1/tasks/not-there" for e in access)


def test_reference_client_py_tes(server):
    url, _ = server
    client = tes.HTTPClient(url, timeout=10)
    info = client.get_service_info()
    assert info.type["artifact"] == "tes" and "https://" in info.storage
    task = tes.Task(
        name="py-tes",
        executors=[tes.Executor(image="alpine", command=["echo", "hello"])],
        inputs=[tes.Input(path="/in/a.txt", content="hello")],
        tags={"client": "py-tes"},
    )
    task_id = client.create_task(task)
    assert isinstance(task_id, str)
    minimal = client.get_task(task_id, view="MINIMAL")
    assert minimal.id == task_id and minimal.state == "QUEUED"
    basic = client.get_task(task_id, view="BASIC")
    assert basic.name == "py-tes" and basic.inputs[0].content is None
    full = client.get_task(task_id, view="FULL")
    assert full.inputs[0].content == "hello"
    assert full.executors[0].command == ["echo", "hello"]
    listed = client.list_tasks(view="BASIC")
    assert task_id in [t.id for t in listed.tasks]
    client.cancel_task(task_id)
    assert client.get_task(task_id, view="MINIMAL").state == "CANCELED"


def test_serve_starts_the_poller_again_when_it_dies(tmp_path):
    """`tes-bridge serve` supervises its poller: a killed poller is replaced."""
    port = free_port()
    lock = tmp_path / "poller.lock"
    env = {**os.environ, "TES_BRIDGE_STATE_DIR": str(tmp_path)}
    # The suite runs as root: a poller started as root must be allowed to.
    config = tmp_path / "root.toml"
    config.write_text(f"[container]\nallow_root = {str(os.geteuid() == 0).lower()}\n")
    bind = f"127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "bridge", "--config", str(config), "serve", "--bind", bind],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until_up(f"http://127.0.0.1:{port}", process)

        def poller_pid(other_than: int = 0) -> int:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                text = lock.read_text().strip() if lock.exists() else ""
                if text.isdigit() and int(text) != other_than:
                    pid = int(text)
                    if Path(f"/proc/{pid}").exists():
                        return pid
                time.sleep(0.2)
            raise AssertionError((tmp_path / "serve.log").read_text()[-2000:])

        first = poller_pid()
        os.kill(first, signal.SIGKILL)
        second = poller_pid(other_than=first)
        assert second != first
        assert "bridge" in Path(f"/proc/{second}/cmdline").read_text()
    finally:
        process.terminate()
        process.wait(timeout=60)
    # Stopping serve stops its poller too.
    deadline = time.monotonic() + 30
    while Path(f"/proc/{second}").exists() and "zombie" not in _status(second):
        assert time.monotonic() < deadline, "the poller outlived `tes-bridge serve`"
        time.sleep(0.2)


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"
