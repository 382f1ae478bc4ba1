"""What the API says of HPC requests: a 400 naming the backend parameter, the time limit within
slurm.max_time, fractional cpu_cores that 1.1 clients still read, the capabilities document."""

from __future__ import annotations

import json
from typing import Any

import pytest
import tes
from falcon import testing

from bridge.app import create_app
from bridge.config import load_config

ECHO = {"executors": [{"image": "alpine", "command": ["echo", "hi"]}]}


def with_params(**values: str) -> dict[str, Any]:
    return {**ECHO, "resources": {"backend_parameters": values}}


def errors_of(client: testing.TestClient, body: dict[str, Any]) -> dict[str, str]:
    result = client.simulate_post("/ga4gh/tes/v1/tasks", json=body)
    assert result.status_code == 400, result.text
    return {e["field"]: e["message"] for e in result.json["errors"]}


@pytest.fixture
def limited(tmp_path, store) -> testing.TestClient:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
        overrides={"slurm.max_time": "1-00:00:00", "slurm.default_time": "1:00:00"},
    )
    return testing.TestClient(create_app(config, store=store))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("time", "soon"),
        ("time", "10\n#SBATCH --uid=0"),
        ("time_limit", "1:2:3:4"),
        ("max_time", "-1"),
        ("max_time", "0"),
        ("gpus", "0"),
        ("gpus", "2 --uid=0"),
        ("gpus_per_task", "a:b:1"),
        ("gres", "gpu;id"),
        ("partition", "a b"),
        ("qos", "$(id)"),
    ],
)
def test_a_bad_backend_parameter_is_a_400_naming_it(client, key: str, value: str) -> None:
    errors = errors_of(client, with_params(**{key: value}))
    assert f"resources.backend_parameters.{key}" in errors, errors


def test_a_time_above_the_maximum_is_a_400_naming_the_limit(limited) -> None:
    errors = errors_of(limited, with_params(time="1-00:01:00"))
    assert "slurm.max_time" in errors["resources.backend_parameters.time"]
    errors = errors_of(limited, with_params(max_time="24.5"))
    assert "at most 1-00:00:00" in errors["resources.backend_parameters.max_time"]
    errors = errors_of(limited, with_params(time="UNLIMITED"))
    assert "resources.backend_parameters.time" in errors
    ok = limited.simulate_post("/ga4gh/tes/v1/tasks", json=with_params(max_time="24"))
    assert ok.status_code == 200, ok.text


def test_fractional_cpu_cores_are_stored_and_read_back_by_py_tes(client, store) -> None:
    body = {**ECHO, "resources": {"cpu_cores": 0.5, "ram_gb": 0.25}}
    created = client.simulate_post("/ga4gh/tes/v1/tasks", json=body)
    assert created.status_code == 200, created.text
    task_id = created.json["id"]
    record = store.get_task(task_id)
    assert record.document["resources"]["cpu_cores"] == 0.5  # kept as sent
    for view in ("BASIC", "FULL"):
        got = client.simulate_get(f"/ga4gh/tes/v1/tasks/{task_id}", params={"view": view})
        assert got.json["resources"]["cpu_cores"] == 1
        parsed = tes.client.unmarshal(json.dumps(got.json), tes.Task)
        assert parsed.resources.cpu_cores == 1
    listed = client.simulate_get("/ga4gh/tes/v1/tasks", params={"view": "BASIC"})
    tes.client.unmarshal(json.dumps(listed.json), tes.ListTasksResponse)
