"""What the API says of HPC requests: a 400 naming the backend parameter, the time limit within
slurm.max_time, fractional cpu_cores that 1.1 clients still read, the capabilities document."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import tes
from falcon import testing

from bridge.api.app import create_app
from bridge.config import load_config
from bridge.poller import Poller
from bridge.slurm import SlurmClient, parse_sinfo_partitions
from bridge.store import CAPABILITIES_KEY
from tests.fakes.slurm import FakeSlurm
from tests.fixtures.auth import PASSWORDS
from tests.unit.test_poller import FakeImages

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
        ("on_preemption", "never"),
        ("on_preemption", "Report"),
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


# ------------------------------------------------------------------------------ capabilities

DATA = Path(__file__).parents[1] / "data" / "slurm"
#: Two partitions with GPUs, as sinfo -N prints them (written by hand: the local cluster has no
#: GRES; the format is the captured one of sinfo-partitions.txt).
GPU_SINFO = (
    "gpu|g1|64|512000|2-00:00:00|gpu:a100:4(S:0-1)|800000|up|mixed\n"
    "gpu|g2|64|512000|2-00:00:00|gpu:h100:2(S:0),shard:8|800000|up|idle\n"
    "cpu*|c1|128|256000|infinite|(null)|0|up|idle\n"
    "cpu*|c1|128|256000|infinite|(null)|0|up|idle\n"
    "cpu*|c2|96|192000|infinite|(null)|100|up|allocated\n"
)


def test_sinfo_partitions_parse_nodes_cpus_memory_time_and_gpus() -> None:
    captured = parse_sinfo_partitions((DATA / "sinfo-partitions.txt").read_text())
    assert [p.name for p in captured] == ["main"] and captured[0].default
    assert captured[0].cpus > 0 and captured[0].max_memory_mb_per_node > 0
    assert captured[0].gres == {} and captured[0].max_time == "infinite"
    gpu, cpu = parse_sinfo_partitions(GPU_SINFO)
    assert gpu.nodes == ("g1", "g2") and not gpu.default and gpu.max_time == "2-00:00:00"
    assert gpu.gpus == 6 and gpu.gpu_types == {"a100": 4, "h100": 2}
    assert gpu.gres["shard"] == 8
    assert gpu.max_gres_per_node == {"gpu": 4, "gpu:a100": 4, "gpu:h100": 2, "shard": 8}
    assert cpu.default and cpu.nodes == ("c1", "c2") and cpu.cpus == 224
    assert cpu.max_cpus_per_node == 128 and cpu.min_tmp_disk_mb == 0


def test_partitions_are_one_sinfo_call(tmp_path: Path) -> None:
    from tests.unit.test_slurm import calls, replay

    client = SlurmClient(sinfo=replay(tmp_path, "sinfo", "sinfo-partitions.txt"))
    assert client.partitions()[0].name == "main"
    assert calls(tmp_path, "sinfo") == ["-h -a -N -o %P|%N|%c|%m|%l|%G|%d|%a|%T"]


def test_capabilities_show_what_the_poller_read(tmp_path, sqlite_store) -> None:
    runtime = tmp_path / "apptainer"
    runtime.write_text("#!/bin/sh\necho 'apptainer version 9.8.7'\n")
    runtime.chmod(0o755)
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={
            "slurm.max_time": "2-00:00:00",
            "slurm.max_jobs_in_flight": 100,
            "container.runtime": str(runtime),
            "backend_parameters.supported": ["time", "gpus", "on_preemption"],
        },
    )
    fake = FakeSlurm(sinfo_partitions=GPU_SINFO)
    poller = Poller(config, sqlite_store, slurm_client=fake, images=FakeImages())
    client = testing.TestClient(create_app(config, store=sqlite_store))
    empty = client.simulate_get("/ga4gh/tes/v1/capabilities").json
    assert empty["partitions"] == [] and empty["read_at"] is None and "slurm" not in empty
    fake.version = (26, 5, 5)
    poller.cycle()
    poller.cycle()
    assert fake.partition_reads == 1  # kept for slurm.capabilities_refresh_seconds
    for prefix in ("/ga4gh/tes/v1", "/v1"):
        doc = client.simulate_get(f"{prefix}/capabilities").json
        gpu = doc["partitions"][0]
        assert gpu["name"] == "gpu" and gpu["gpus"] == 6
        assert gpu["gpu_types"] == {"a100": 4, "h100": 2} and gpu["nodes"] == ["g1", "g2"]
        assert gpu["max_time"] == "2-00:00:00" and gpu["max_cpus_per_node"] == 64
        keys = [p["key"] for p in doc["backend_parameters"]]
        assert keys == ["time", "gpus", "on_preemption"]
        assert doc["backend_parameters"][1]["sbatch_option"] == "--gpus"
        # Read by the poller, no sbatch option.
        assert "sbatch_option" not in doc["backend_parameters"][2]
        assert re.fullmatch(doc["backend_parameters"][1]["pattern"], "a100:2")
        assert doc["time_limit"] == {"default": None, "maximum": "2-00:00:00"}
        assert doc["admission"] == {"max_jobs_in_flight": 100, "max_jobs_per_owner": None}
        assert doc["container"] == {"runtime": "apptainer", "version": "9.8.7", "gpu_flag": "--nv"}
        assert doc["slurm"] == {"version": "26.05.5", "tested": True}
    info = client.simulate_get("/ga4gh/tes/v1/service-info").json
    assert "partitions" not in json.dumps(info)  # strict 1.1 clients refuse unknown keys
    paths = client.simulate_get("/ga4gh/tes/v1/openapi.json").json["paths"]
    assert "/capabilities" in paths


def test_the_capabilities_say_the_slurm_release_once_it_is_known(tmp_path, sqlite_store) -> None:
    """An untested release is said as such; an unknown one (squeue --version unreadable) and a
    document stored by an older poller, without the key, leave it out."""
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"container.runtime": str(tmp_path / "absent")},
    )
    fake = FakeSlurm()
    client = testing.TestClient(create_app(config, store=sqlite_store))
    for version, slurm in [
        ((25, 5, 1), {"version": "25.05.1", "tested": False}),
        ((22, 5, 8), {"version": "22.05.8", "tested": True}),
        (None, None),
    ]:
        fake.version = version
        Poller(config, sqlite_store, slurm_client=fake, images=FakeImages()).cycle()
        doc = client.simulate_get("/ga4gh/tes/v1/capabilities").json
        assert doc.get("slurm") == slurm, version
    sqlite_store.put_meta(CAPABILITIES_KEY, json.dumps({"read_at": None, "partitions": []}))
    assert "slurm" not in client.simulate_get("/ga4gh/tes/v1/capabilities").json


def test_capabilities_need_the_same_authentication(tmp_path, sqlite_store, htpasswd) -> None:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"auth.mode": "basic", "auth.htpasswd_file": str(htpasswd)},
    )
    client = testing.TestClient(create_app(config, store=sqlite_store))
    assert client.simulate_get("/ga4gh/tes/v1/capabilities").status_code == 401
    user, password = next(iter(PASSWORDS.items()))
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    ok = client.simulate_get(
        "/ga4gh/tes/v1/capabilities", headers={"Authorization": f"Basic {raw}"}
    )
    assert ok.status_code == 200, ok.text


def test_the_openapi_document_bounds_a_fractional_cpu_cores(client) -> None:
    schemas = client.simulate_get("/ga4gh/tes/v1/openapi.json").json["components"]["schemas"]
    members = schemas["ResourcesModel"]["properties"]["cpu_cores"]["anyOf"]
    numbers = [m for m in members if m["type"] in ("integer", "number")]
    assert {m["type"] for m in numbers} == {"integer", "number"}
    assert all(m["minimum"] == 0 and m["maximum"] == 65533 for m in numbers)


def test_what_the_cluster_cannot_run_is_a_400_once_its_partitions_are_known(
    tmp_path, sqlite_store
) -> None:
    """An unknown partition or more memory than any node has: sbatch would refuse the job, and
    the capabilities the poller read already say so, so create refuses naming the field."""
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    client = testing.TestClient(create_app(config, store=sqlite_store))
    big = {**ECHO, "resources": {"ram_gb": 4000}}
    # Not known yet: accepted (the poller's sbatch decides).
    assert client.simulate_post("/ga4gh/tes/v1/tasks", json=big).status_code == 200

    fake = FakeSlurm(sinfo_partitions=GPU_SINFO)
    Poller(config, sqlite_store, slurm_client=fake, images=FakeImages()).cycle()
    client = testing.TestClient(create_app(config, store=sqlite_store))
    partitions = client.simulate_get("/ga4gh/tes/v1/capabilities").json["partitions"]
    names = [p["name"] for p in partitions]
    largest = max(p["max_memory_mb_per_node"] for p in partitions)

    message = errors_of(client, with_params(partition="mian"))[
        "resources.backend_parameters.partition"
    ]
    assert message == f"no partition 'mian' on this cluster; its partitions: {', '.join(names)}"
    zones = errors_of(client, {**ECHO, "resources": {"zones": [names[0], "nope"]}})
    assert "no partition 'nope'" in zones["resources.zones[1]"]
    ram = errors_of(client, big)["resources.ram_gb"]
    assert ram == (
        f"4000 GB is more than the largest node of any partition has: {largest} MB "
        f"({largest / 1000:g} GB)"
    )
    in_cpu = {**ECHO, "resources": {"ram_gb": 300, "backend_parameters": {"partition": "cpu"}}}
    assert "largest node of cpu has: 256000 MB" in errors_of(client, in_cpu)["resources.ram_gb"]
    # A node's whole memory in decimal GB fits (the job gets the whole node).
    in_cpu["resources"]["ram_gb"] = 256
    assert client.simulate_post("/ga4gh/tes/v1/tasks", json=in_cpu).status_code == 200


def test_cpus_or_gpus_no_node_has_are_a_400_naming_the_field_and_what_exists(
    tmp_path, sqlite_store
) -> None:
    """More CPUs or GPUs than one node has, or a GPU type no node has: sbatch refuses the first
    ("More processors requested than permitted"), and a task runs on one node, so none of them
    could run. The nodes: gpu g1 (64 CPUs, 4 a100) and g2 (64 CPUs, 2 h100); cpu c1 (128) and
    c2 (96), no GPUs."""
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    Poller(config, sqlite_store, slurm_client=FakeSlurm(sinfo_partitions=GPU_SINFO),
           images=FakeImages()).cycle()  # fmt: skip
    client = testing.TestClient(create_app(config, store=sqlite_store))

    def resources(partition: str | None = None, **fields: Any) -> dict[str, Any]:
        params = {k: v for k, v in fields.items() if k in ("gpus", "gpus_per_task", "gres")}
        if partition:
            params["partition"] = partition
        other = {k: v for k, v in fields.items() if k not in params}
        return {**ECHO, "resources": {**other, "backend_parameters": params}}

    def accepted(body: dict[str, Any]) -> bool:
        return client.simulate_post("/ga4gh/tes/v1/tasks", json=body).status_code == 200

    assert errors_of(client, resources(cpu_cores=200)) == {
        "resources.cpu_cores": "200 CPUs are more than the largest node of any partition has: "
        "128 CPUs"
    }
    assert errors_of(client, resources("gpu", cpu_cores=65)) == {
        "resources.cpu_cores": "65 CPUs are more than the largest node of gpu has: 64 CPUs"
    }
    assert accepted(resources("gpu", cpu_cores=63.5)) and accepted(resources(cpu_cores=128))

    field = "resources.backend_parameters"
    assert errors_of(client, resources("gpu", gpus="6")) == {
        f"{field}.gpus": "6 GPUs are more than one node of gpu has: 4 (a task runs on one node)"
    }
    assert errors_of(client, resources("gpu", gpus_per_task="h100:3")) == {
        f"{field}.gpus_per_task": "3 GPUs of type 'h100' are more than one node of gpu has: 2 "
        "(a task runs on one node)"
    }
    assert errors_of(client, resources("gpu", gres="gpu:v100:1")) == {
        f"{field}.gres": "no node of gpu has GPUs of type 'v100'; types there: a100, h100"
    }
    assert errors_of(client, resources("cpu", gpus="1")) == {
        f"{field}.gpus": "no node of cpu has GPUs"
    }
    # Each problem at once, each under its own field.
    several = errors_of(client, resources("cpu", cpu_cores=129, ram_gb=300, gres="gpu:1"))
    assert set(several) == {"resources.cpu_cores", "resources.ram_gb", f"{field}.gres"}
    for fine in (
        resources("gpu", gpus="a100:4", cpu_cores=64),
        resources(gpus="h100:2"),
        resources("gpu", gres="gpu:2,shard:8"),
        resources("cpu", gres="shard:1"),  # not a GPU: left to Slurm
    ):
        assert accepted(fine), fine

    # Partitions stored by a poller that did not count GPUs per node: the types still tell.
    facts = json.loads(sqlite_store.meta(CAPABILITIES_KEY))
    for partition in facts["partitions"]:
        del partition["max_gres_per_node"]
    sqlite_store.put_meta(CAPABILITIES_KEY, json.dumps(facts))
    client = testing.TestClient(create_app(config, store=sqlite_store))
    assert accepted(resources("gpu", gpus="6"))
    assert f"{field}.gpus" in errors_of(client, resources("gpu", gpus="v100:1"))
