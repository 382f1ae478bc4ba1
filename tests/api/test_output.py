"""`GET /tasks/{id}/output`: live executor output read from the task's directory, in byte
ranges, bounded, never through a link, with GetTask's access rules."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from falcon import testing

from bridge.api.app import create_app
from bridge.config import Config, load_config
from bridge.job.records import read_records
from bridge.store import Store

API = "/ga4gh/tes/v1"
JOB = "4242"


def _task(client: testing.TestClient, headers: dict[str, str] | None = None, **extra: Any) -> str:
    executor = {"image": "alpine", "command": ["true"], **extra}
    body = {"executors": [executor, {"image": "alpine", "command": ["true"]}]}
    answer = client.simulate_post(f"{API}/tasks", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    return str(answer.json["id"])


def _started(store: Store, config: Config, task_id: str) -> Path:
    """The task has job JOB, whose executor 0 has started: its records directory."""
    assert store.mark_submitting(task_id, attempt=1, now=0.0)
    logs = [{"logs": [], "outputs": [], "metadata": {"slurm_job_id": JOB}}]
    store.record_job(task_id, JOB, logs=logs)
    edir = config.work_dir / task_id / "records" / JOB / "executors" / "0"
    edir.mkdir(parents=True)
    # What the poller renders into the task directory (the executors' own stdio paths).
    record = store.get_task(task_id)
    assert record is not None
    (config.work_dir / task_id / "task.json").write_text(json.dumps(record.document))
    return edir


def _output(client: testing.TestClient, task_id: str, **params: Any) -> testing.Result:
    return client.simulate_get(f"{API}/tasks/{task_id}/output", params=params)


def test_output_is_read_in_ranges_while_the_executor_runs(client, config, store):
    task_id = _task(client)
    before = _output(client, task_id)
    assert before.status_code == 200
    assert before.json["started"] is False and before.json["text"] == ""

    edir = _started(store, config, task_id)
    (edir / "stdout").write_bytes(b"line 1\nline 2\n")
    first = _output(client, task_id).json
    assert first["text"] == "line 1\nline 2\n"
    assert (first["offset"], first["next_offset"], first["size"]) == (0, 14, 14)
    assert first["started"] is True and first["done"] is False
    assert first["slurm_job_id"] == JOB and first["state"] == "QUEUED"
    # The task document still lists no executor log: it has no exit code yet.
    assert (
        client.simulate_get(f"{API}/tasks/{task_id}", params={"view": "FULL"})
        .json.get("logs", [{}])[0]
        .get("logs", [])
        == []
    )

    with open(edir / "stdout", "ab") as stream:
        stream.write(b"line 3\n")
    more = _output(client, task_id, offset=first["next_offset"]).json
    assert more["text"] == "line 3\n" and more["next_offset"] == 21
    tail = _output(client, task_id, offset=-7).json
    assert (tail["text"], tail["offset"]) == ("line 3\n", 14)
    bounded = _output(client, task_id, max_bytes=4).json
    assert (bounded["text"], bounded["next_offset"]) == ("line", 4)

    (edir / "stderr").write_bytes(b"oops\n")
    assert _output(client, task_id, stream="stderr").json["text"] == "oops\n"
    (edir / "exit_code").write_text("0\n")
    assert _output(client, task_id, offset=21).json["done"] is True


def test_the_cut_line_in_a_task_document_leads_to_the_whole_stream(client, config, store):
    """What the poller keeps of a long stream (bridge.job.excerpt) names a path of this API;
    read from there in ranges, the stream is whole."""
    task_id = _task(client)
    edir = _started(store, config, task_id)
    data = b"Error: the first line\n" + b"".join(b"%d\n" % n for n in range(300_000))
    (edir / "stderr").write_bytes(data)
    (edir / "exit_code").write_text("1\n")
    keep = config.job.log_tail_bytes
    kept = read_records(config.work_dir / task_id, JOB, keep_bytes=keep).executors[0].stderr
    assert kept.startswith("Error: the first line\n") and len(kept.encode()) < keep + 200
    cut = re.search(r"^\[tes-bridge: ([\d,]+) of ([\d,]+) bytes .*: GET (\S+)\]$", kept, re.M)
    assert cut and int(cut[2].replace(",", "")) == len(data)
    path, _, query = cut[3].partition("?")
    assert path == f"{API}/tasks/{task_id}/output"
    whole, offset = "", 0
    while offset < len(data):
        answer = client.simulate_get(
            path, query_string=f"{query}&offset={offset}&max_bytes=1048576"
        )
        assert answer.status_code == 200, answer.text
        whole += answer.json["text"]
        offset = answer.json["next_offset"]
    assert whole.encode() == data and answer.json["done"] is True


def test_a_character_split_by_the_range_waits_for_its_last_byte(client, config, store):
    task_id = _task(client)
    edir = _started(store, config, task_id)
    (edir / "stdout").write_bytes("é".encode()[:1])
    partial = _output(client, task_id).json
    assert (partial["text"], partial["next_offset"]) == ("", 0)
    (edir / "stdout").write_bytes("é!".encode())
    assert _output(client, task_id).json["text"] == "é!"
    # A tail that starts inside the character skips its rest.
    assert _output(client, task_id, offset=-2).json["text"] == "!"


def test_an_executors_own_stdout_path_is_read_from_root(client, config, store):
    task_id = _task(client, stdout="/outputs/log.txt")
    _started(store, config, task_id)
    own = config.work_dir / task_id / "root" / "outputs"
    own.mkdir(parents=True)
    (own / "log.txt").write_text("mine\n")
    assert _output(client, task_id).json["text"] == "mine\n"


@pytest.mark.parametrize("where", ["stream", "parent", "records"])
def test_links_are_never_followed(client, config, store, tmp_path, where):
    task_id = _task(client, stdout="/outputs/log.txt")
    edir = _started(store, config, task_id)
    secret = tmp_path / "secret"
    (secret / "outputs").mkdir(parents=True)
    (secret / "outputs" / "log.txt").write_text("host secret\n")
    root = config.work_dir / task_id / "root"
    root.mkdir()
    if where == "stream":  # the executor replaced its own stdout file by a link
        (root / "outputs").mkdir()
        os.symlink(secret / "outputs" / "log.txt", root / "outputs" / "log.txt")
        params: dict[str, Any] = {}
    elif where == "parent":  # ... or a directory on the way
        os.symlink(secret / "outputs", root / "outputs")
        params = {}
    else:  # the records of executor 1, read from the records directory
        os.symlink(secret / "outputs" / "log.txt", edir.parent / "1")
        params = {"executor": 1}
    answer = _output(client, task_id, **params)
    assert answer.status_code in (200, 409), answer.text
    assert "host secret" not in answer.text
    if where != "records":
        assert answer.status_code == 409


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"executor": 2}, "executor"),
        ({"executor": "x"}, "executor"),
        ({"stream": "stdin"}, "stream"),
        ({"offset": "1.5"}, "offset"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"max_bytes": 10**9}, "max_bytes"),
        ({"attempt": 2}, "attempt"),
    ],
)
def test_bad_parameters_are_400_naming_them(client, params, field):
    task_id = _task(client)
    answer = _output(client, task_id, **params)
    assert answer.status_code == 400, answer.text
    assert answer.json["errors"][0]["field"] == field


def test_unknown_task_is_404(client):
    assert _output(client, "no-such-task").status_code == 404


def test_other_owners_output_is_404_as_with_get_task(tmp_path, sqlite_store, htpasswd):
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"auth.mode": "basic", "auth.htpasswd_file": str(htpasswd)},
    )
    client = testing.TestClient(create_app(config, store=sqlite_store))

    def basic(user: str, password: str) -> dict[str, str]:
        return {
            "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        }

    alice = basic("tesalice", "alice-secret")
    task_id = _task(client, alice)
    edir = _started(sqlite_store, config, task_id)
    (edir / "stdout").write_text("alice's\n")
    url = f"{API}/tasks/{task_id}/output"
    assert client.simulate_get(url, headers=alice).json["text"] == "alice's\n"
    assert client.simulate_get(url, headers=basic("tesbob", "bob-secret")).status_code == 404
    assert client.simulate_get(url).status_code == 401


def test_the_endpoint_is_in_the_served_openapi_document(client):
    document = client.simulate_get(f"{API}/openapi.json").json
    operation = document["paths"]["/tasks/{id}/output"]["get"]
    assert operation["operationId"] == "GetExecutorOutput"
    names = {p["name"] for p in operation["parameters"]}
    assert names == {"id", "executor", "stream", "offset", "max_bytes", "attempt"}
    assert "ExecutorOutput" in document["components"]["schemas"]
