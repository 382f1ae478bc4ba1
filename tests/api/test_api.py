"""The TES HTTP API through Falcon's test client, on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

import pytest
from falcon import testing

from bridge.api.app import create_app
from bridge.config import load_config
from bridge.core.tes import State

PREFIXES = ["/ga4gh/tes/v1", "/v1"]
ECHO = {"executors": [{"image": "alpine", "command": ["echo", "hello"]}]}


def create(client: testing.TestClient, body: Any, prefix: str = "/v1", **kw: Any) -> str:
    result = client.simulate_post(f"{prefix}/tasks", json=body, **kw)
    assert result.status_code == 200, result.text
    assert set(result.json) == {"id"}
    return result.json["id"]


def get(client: testing.TestClient, task_id: str, view: str | None = None) -> dict[str, Any]:
    params = {"view": view} if view else None
    result = client.simulate_get(f"/ga4gh/tes/v1/tasks/{task_id}", params=params)
    assert result.status_code == 200, result.text
    return result.json


def assert_no_nulls(value: Any) -> None:
    assert value is not None
    if isinstance(value, dict):
        for item in value.values():
            assert_no_nulls(item)
    elif isinstance(value, list):
        for item in value:
            assert_no_nulls(item)


# ------------------------------------------------------------------------------------- routes


@pytest.mark.parametrize("prefix", PREFIXES)
def test_every_endpoint_answers_under_both_prefixes(client, prefix):
    task_id = create(client, ECHO, prefix)
    assert client.simulate_get(f"{prefix}/tasks/{task_id}").json == {
        "id": task_id,
        "state": "QUEUED",
    }
    assert client.simulate_get(f"{prefix}/tasks").json["tasks"][0]["id"] == task_id
    assert client.simulate_post(f"{prefix}/tasks/{task_id}:cancel").json == {}
    assert client.simulate_get(f"{prefix}/service-info").json["type"]["artifact"] == "tes"
    document = client.simulate_get(f"{prefix}/openapi.json").json
    assert "/tasks/{id}:cancel" in document["paths"]
    assert "tesTaskRequest" in document["components"]["schemas"]


def test_legacy_service_info_has_exactly_the_old_shape(client):
    result = client.simulate_get("/v1/tasks/service-info")
    assert result.status_code == 200
    assert set(result.json) == {"name", "doc", "storage"}


def test_service_info_has_the_ga4gh_fields(client):
    info = client.simulate_get("/ga4gh/tes/v1/service-info").json
    assert info["type"] == {"group": "org.ga4gh", "artifact": "tes", "version": "1.1.0"}
    for key in ("id", "name", "description", "version", "environment", "createdAt", "updatedAt"):
        assert isinstance(info[key], str) and info[key], key
    assert set(info["organization"]) == {"name", "url"}
    assert info["organization"]["url"].startswith("https://")
    # Derived from [staging] by default: each enabled protocol; file:// only per directory,
    # and this server has none.
    assert info["storage"] == ["http://", "https://", "s3://", "ftp://", "drs://"]
    assert "partition" in info["tesResources_backend_parameters"]
    assert "contactUrl" not in info
    assert_no_nulls(info)


def test_service_info_comes_from_config(tmp_path, store):
    config_file = tmp_path / "c.toml"
    config_file.write_text(
        '[service_info]\nname = "HPC TES"\ncontact_url = "mailto:hpc@example.org"\n'
        'documentation_url = "https://docs.example.org"\nstorage = ["file://", "s3://"]\n'
        '[backend_parameters]\nsupported = ["account"]\n'
    )
    config = load_config(config_file, environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)})
    info = testing.TestClient(create_app(config, store=store)).simulate_get("/v1/service-info").json
    assert info["name"] == "HPC TES"
    assert info["contactUrl"] == "mailto:hpc@example.org"
    assert info["documentationUrl"] == "https://docs.example.org"
    assert info["storage"] == ["file://", "s3://"]
    assert info["tesResources_backend_parameters"] == ["account"]


def test_service_info_lists_each_allowed_and_shared_directory_not_a_bare_file_scheme(
    tmp_path, store
):
    allowed, shared = tmp_path / "allowed", tmp_path / "shared"
    shared.mkdir()
    config_file = tmp_path / "c.toml"
    config_file.write_text(
        f'[storage]\nallowed_dirs = ["{allowed}", "{shared}"]\nshared_dirs = ["{shared}"]\n'
        '[staging]\nprotocols = ["s3"]\n'
    )
    config = load_config(config_file, environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    client = testing.TestClient(create_app(config, store=store))
    for path in ("/ga4gh/tes/v1/service-info", "/v1/tasks/service-info"):
        storage = client.simulate_get(path).json["storage"]
        assert storage == [f"file://{allowed}/", f"file://{shared}/", "s3://"]


def test_file_urls_in_shared_directories_are_accepted(tmp_path, store):
    shared = tmp_path / "shared"
    shared.mkdir()
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"storage.shared_dirs": [str(shared)]},
    )
    client = testing.TestClient(create_app(config, store=store))
    task = {
        "executors": [{"image": "alpine", "command": ["true"]}],
        "inputs": [{"path": f"{shared}/js", "url": f"file://{shared}/js", "type": "DIRECTORY"}],
        "outputs": [{"path": "/out.txt", "url": "file:///elsewhere/out.txt"}],
    }
    result = client.simulate_post("/ga4gh/tes/v1/tasks", json=task)
    assert result.status_code == 400
    assert [e["field"] for e in result.json["errors"]] == ["outputs[0].url"]
    task["outputs"][0]["url"] = f"file://{shared}/out.txt"
    assert client.simulate_post("/ga4gh/tes/v1/tasks", json=task).status_code == 200


def test_wrong_method_is_405_with_the_error_shape(client):
    result = client.simulate_delete("/v1/tasks")
    assert result.status_code == 405
    assert result.json["code"] == 405 and "DELETE" in result.json["message"]
    assert client.simulate_put("/ga4gh/tes/v1/tasks/abc").status_code == 405


def test_unknown_path_is_404_json(client):
    result = client.simulate_get("/v1/nothing-here")
    assert result.status_code == 404
    assert result.json["code"] == 404


# ------------------------------------------------------------------------------------- create


def test_create_answers_200_with_only_the_id(client):
    result = client.simulate_post("/v1/tasks", json=ECHO)
    assert result.status_code == 200
    assert result.headers["content-type"].startswith("application/json")
    assert list(result.json) == ["id"]


@pytest.mark.parametrize(
    "content_type",
    ["application/x-www-form-urlencoded", "text/plain", None, "application/json; charset=utf-8"],
)
def test_a_json_body_is_accepted_whatever_the_content_type(client, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    result = client.simulate_post("/v1/tasks", body=json.dumps(ECHO), headers=headers)
    assert result.status_code == 200, result.text


def test_task_is_returned_as_sent_plus_output_fields(client):
    body = {
        "name": "align",
        "description": "bwa mem",
        "inputs": [
            {"url": "https://example.org/data/ref.fa", "path": "/in/ref.fa"},
            {"content": "hello", "path": "/in/hello.txt", "type": "FILE", "streamable": True},
        ],
        "outputs": [{"url": "s3://bucket/data/out", "path": "/out", "type": "DIRECTORY"}],
        "resources": {"cpu_cores": 4, "ram_gb": 1.5, "disk_gb": 10, "preemptible": False},
        "executors": [
            {
                "image": "alpine",
                "command": ["sh", "-c", "echo $X"],
                "workdir": "/in",
                "env": {"X": "1"},
                "stdout": "/out/stdout.txt",
            }
        ],
        "volumes": ["/scratch"],
        "tags": {"project": "p1", "empty": ""},
    }
    task_id = create(client, body)
    task = get(client, task_id, "FULL")
    assert task["id"] == task_id
    assert task["state"] == "QUEUED"
    assert task["creation_time"].endswith("Z")
    expected = json.loads(json.dumps(body))
    expected["inputs"][0]["type"] = "FILE"  # a missing type is returned as FILE
    for key, value in expected.items():
        assert task[key] == value, key
    assert "logs" not in task  # nothing has run yet
    assert_no_nulls(task)


def test_defaults_are_not_added_to_the_returned_task(client):
    task = get(client, create(client, ECHO), "FULL")
    executor = task["executors"][0]
    assert executor == {"image": "alpine", "command": ["echo", "hello"]}
    for absent in ("resources", "inputs", "outputs", "volumes", "tags", "name"):
        assert absent not in task


def test_explicit_nulls_are_treated_as_absent(client):
    body = {
        "name": None,
        "inputs": None,
        "resources": {"cpu_cores": None, "ram_gb": 2, "zones": None},
        "executors": [
            {
                "image": "alpine",
                "command": ["true"],
                "env": None,
                "workdir": None,
                "ignore_error": None,
            }
        ],
        "tags": None,
    }
    task = get(client, create(client, body), "FULL")
    assert task["resources"] == {"ram_gb": 2.0}
    assert task["executors"] == [{"image": "alpine", "command": ["true"]}]
    assert_no_nulls(task)


#: What Galaxy's Pulsar TES runner (pulsar-app 0.16, through pydantic-tes) POSTs for a tool in a
#: container: every unset field an explicit null, three executors in `/` around one volume
#: given with a trailing slash (base64 arguments shortened).
PULSAR_TASK = {
    "id": None,
    "state": None,
    "name": "pulsar-gx1-42",
    "description": None,
    "inputs": None,
    "outputs": None,
    "resources": {
        "cpu_cores": 2,
        "preemptible": None,
        "ram_gb": 4.0,
        "disk_gb": None,
        "zones": None,
        "backend_parameters": None,
        "backend_parameters_strict": False,
    },
    "executors": [
        {
            "image": "galaxy/pulsar-pod-staging:0.15.0.2",
            "command": [command, *args],
            "workdir": "/",
            "stdin": None,
            "stdout": None,
            "stderr": None,
            "env": None,
        }
        for command, args in (
            ("pulsar-submit", ["--no-wait", "--base64", "eyJjb20=", "--app_conf_base64", "eyJt"]),
            ("sh", ["-c", "path='/pulsar_staging//42/command_line'; sh $path"]),
            ("pulsar-finish", ["--base64", "eyJjb20=", "--app_conf_base64", "eyJt"]),
        )
    ],
    "volumes": ["/pulsar_staging/"],
    "tags": None,
    "logs": None,
    "creation_time": None,
}


def test_galaxy_pulsars_task_is_accepted_with_its_directories_normalised(client):
    task = get(client, create(client, PULSAR_TASK, prefix="/ga4gh/tes/v1"), "FULL")
    assert task["volumes"] == ["/pulsar_staging"]
    assert [e["workdir"] for e in task["executors"]] == ["/", "/", "/"]
    assert task["resources"] == {"cpu_cores": 2, "ram_gb": 4.0, "backend_parameters_strict": False}
    assert_no_nulls(task)


@pytest.mark.parametrize(
    ("workdir", "stored"), [("/", "/"), ("//", "/"), ("/data/", "/data"), ("/data", "/data")]
)
def test_a_workdir_is_a_directory_and_may_be_the_root(client, workdir, stored):
    body = {"executors": [{"image": "alpine", "command": ["true"], "workdir": workdir}]}
    assert get(client, create(client, body), "FULL")["executors"][0]["workdir"] == stored


def test_camel_case_aliases_are_accepted_and_returned_snake_case(client):
    body = {"resources": {"cpuCores": 2, "ramGb": 4, "diskGb": 1.5}, **ECHO}
    task = get(client, create(client, body), "FULL")
    assert task["resources"] == {"cpu_cores": 2, "ram_gb": 4.0, "disk_gb": 1.5}


def test_unknown_fields_are_ignored_and_not_returned(client):
    body = {
        "surprise": 1,
        "id": "client-chosen",
        "state": "COMPLETE",
        "executors": [{"image": "alpine", "command": ["true"], "gpu": "yes"}],
    }
    task_id = create(client, body)
    assert task_id != "client-chosen"
    task = get(client, task_id, "FULL")
    assert "surprise" not in task and task["state"] == "QUEUED"
    assert task["executors"] == [{"image": "alpine", "command": ["true"]}]


def test_content_of_128_kib_is_accepted(client):
    content = "x" * (128 * 1024)
    body = {"inputs": [{"path": "/in/big.txt", "content": content}], **ECHO}
    task = get(client, create(client, body), "FULL")
    assert task["inputs"][0]["content"] == content


def error_of(client: testing.TestClient, body: Any, status: int = 400) -> dict[str, Any]:
    result = client.simulate_post(
        "/ga4gh/tes/v1/tasks", body=body if isinstance(body, str | bytes) else json.dumps(body)
    )
    assert result.status_code == status, result.text
    assert result.json["code"] == status
    assert isinstance(result.json["message"], str)
    return result.json


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({}, "executors", "is required"),
        ({"executors": []}, "executors", "must be a non-empty array of executors"),
        ({"executors": {}}, "executors", "must be a non-empty array of executors"),
        ({"executors": [{"command": ["x"]}]}, "executors[0].image", "is required"),
        ({"executors": [{"image": "", "command": ["x"]}]}, "executors[0].image", "non-empty"),
        ({"executors": [{"image": "a"}]}, "executors[0].command", "is required"),
        (
            {"executors": [{"image": "a", "command": "echo hi"}]},
            "executors[0].command",
            "must be a non-empty array of strings",
        ),
        (
            {"executors": [{"image": "a", "command": []}]},
            "executors[0].command",
            "must be a non-empty array of strings",
        ),
        (
            {"executors": [{"image": "a", "command": ["echo", 1]}]},
            "executors[0].command[1]",
            'must be a string, got the int 1; quote it ("1")',
        ),
        (
            {"executors": [{"image": "a", "command": ["echo", None]}]},
            "executors[0].command[1]",
            "must be a string",
        ),
        ({"resources": {"zones": ["a", 2.5]}, **ECHO}, "resources.zones[1]", "got the float 2.5"),
        (
            {"executors": [{"image": "a", "command": ["x"], "workdir": "relative"}]},
            "executors[0].workdir",
            "absolute",
        ),
        (
            {"executors": [{"image": "a", "command": ["x"], "env": {"1A": "x"}}]},
            "executors[0].env",
            "not a valid environment variable name",
        ),
        (
            {"executors": [{"image": "a", "command": ["x"], "env": {"HOME": "/a:/b"}}]},
            "executors[0].env",
            "HOME '/a:/b' must be an absolute path without ':'",
        ),
        (
            {"executors": [{"image": "a", "command": ["x"], "ignore_error": "yes"}]},
            "executors[0].ignore_error",
            "true or false",
        ),
        ({"inputs": [{"url": "file:///a"}], **ECHO}, "inputs[0].path", "is required"),
        ({"inputs": [{"path": "/a"}], **ECHO}, "inputs[0]", "`url` or a `content`"),
        ({"inputs": [{"path": "a", "url": "x"}], **ECHO}, "inputs[0].path", "absolute"),
        ({"inputs": [{"path": "/a/../etc", "url": "x"}], **ECHO}, "inputs[0].path", "normalised"),
        ({"inputs": [{"path": "/a/", "url": "x"}], **ECHO}, "inputs[0].path", "normalised"),
        ({"inputs": [{"path": "/", "url": "x"}], **ECHO}, "inputs[0].path", "root"),
        ({"volumes": ["/"], **ECHO}, "volumes[0]", "root"),
        ({"volumes": ["//"], **ECHO}, "volumes[0]", "root"),
        ({"volumes": ["/a/../b/"], **ECHO}, "volumes[0]", "normalised"),
        (
            {"executors": [{"image": "a", "command": ["x"], "workdir": "/a/./"}]},
            "executors[0].workdir",
            "normalised",
        ),
        (
            {"inputs": [{"path": "/a", "url": "x", "type": "LINK"}], **ECHO},
            "inputs[0].type",
            "FILE or DIRECTORY",
        ),
        ({"outputs": [{"path": "/a"}], **ECHO}, "outputs[0].url", "is required"),
        ({"outputs": [{"url": "file:///a"}], **ECHO}, "outputs[0].path", "is required"),
        (
            {"outputs": [{"url": "file:///a", "path": "/o/*.txt"}], **ECHO},
            "outputs[0]",
            "path_prefix",
        ),
        ({"resources": {"cpu_cores": -1}, **ECHO}, "resources.cpu_cores", "non-negative"),
        ({"resources": {"cpu_cores": "2"}, **ECHO}, "resources.cpu_cores", "non-negative"),
        ({"resources": {"ram_gb": -0.5}, **ECHO}, "resources.ram_gb", "non-negative"),
        ({"resources": {"disk_gb": "10"}, **ECHO}, "resources.disk_gb", "number"),
        ({"resources": {"zones": "a"}, **ECHO}, "resources.zones", "array"),
        ({"volumes": ["/ok", "rel"], **ECHO}, "volumes[1]", "absolute"),
        ({"tags": {"a": 1}, **ECHO}, "tags.a", "string"),
        ({"name": 5, **ECHO}, "name", "string"),
        (
            {"executors": [{"image": "a", "command": ["a\u0000b"]}]},
            "executors[0].command[0]",
            "NUL",
        ),
    ],
)
def test_schema_violations_are_400_naming_the_field(client, body, field, message):
    error = error_of(client, body)
    fields = {e.get("field"): e["message"] for e in error["errors"]}
    assert field in fields, error
    assert message in fields[field]
    assert error["message"].startswith(f"{field}: ")


def test_all_problems_are_listed(client):
    error = error_of(client, {"executors": [{"image": "", "command": []}], "volumes": ["x"]})
    assert {e["field"] for e in error["errors"]} == {
        "executors[0].image",
        "executors[0].command",
        "volumes[0]",
    }


@pytest.mark.parametrize(
    "body",
    [
        "",
        "{",
        "[1, 2]",
        '"a string"',
        "null",
        "42",
        '{"executors": NaN}',
        '{"resources": {"ram_gb": Infinity}, "executors": []}',
        "[" * 100_000 + "]" * 100_000,
        b"\xff\xfe\x00garbage",
        '{"executors": [{"image": "a", "command": ["\\ud800"]}]}',
        '{"resources": {"ram_gb": 1e999}, "executors": [{"image": "a", "command": ["x"]}]}',
        '{"resources": {"cpu_cores": 99999999999999999999999}, '
        '"executors": [{"image": "a", "command": ["x"]}]}',
    ],
)
def test_malformed_bodies_are_400_never_5xx(client, body):
    error_of(client, body)


def test_too_large_body_is_413(tmp_path, store):
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
        overrides={"limits.max_body_bytes": 2048},
    )
    client = testing.TestClient(create_app(config, store=store))
    body = {"inputs": [{"path": "/a", "content": "x" * 4096}], **ECHO}
    result = client.simulate_post("/v1/tasks", json=body)
    assert result.status_code == 413
    assert result.json["code"] == 413


def test_limits_on_counts_and_content(tmp_path, store):
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
        overrides={"limits.max_executors": 2, "limits.max_content_bytes": 128 * 1024},
    )
    client = testing.TestClient(create_app(config, store=store))
    error = error_of(client, {"executors": ECHO["executors"] * 3})
    assert error["errors"][0]["field"] == "executors"
    big = {"inputs": [{"path": "/a", "content": "x" * (128 * 1024 + 1)}], **ECHO}
    assert error_of(client, big)["errors"][0]["field"] == "inputs[0].content"


# ----------------------------------------------------------------------- backend_parameters


def test_unsupported_backend_parameter_in_strict_mode_is_400(client):
    body = {
        "resources": {"backend_parameters": {"VmSize": "big"}, "backend_parameters_strict": True},
        **ECHO,
    }
    error = error_of(client, body)
    assert error["errors"][0]["field"] == "resources.backend_parameters.VmSize"


def test_unsupported_backend_parameters_are_dropped_with_a_warning(client):
    body = {
        "resources": {"backend_parameters": {"Partition": "short", "VmSize": "big"}},
        **ECHO,
    }
    task = get(client, create(client, body), "FULL")
    assert task["resources"]["backend_parameters"] == {"Partition": "short"}
    assert any("VmSize" in line for line in task["logs"][0]["system_logs"])
    basic = get(client, task["id"], "BASIC")
    assert "system_logs" not in basic["logs"][0]
    assert basic["logs"][0]["logs"] == [] and basic["logs"][0]["outputs"] == []


def test_a_misspelled_backend_parameter_is_said_with_the_nearest_key(client, tmp_path, store):
    """TES lets a backend ignore unknown keys: the task runs without them, and its system log
    says which key was meant. backend_parameters.unsupported = "refuse" makes it a 400."""
    body = {"resources": {"backend_parameters": {"tiem": "5", "partiton": "x", "cpus": "2"}}}
    task = get(client, create(client, {**body, **ECHO}), "FULL")
    assert "backend_parameters" not in task["resources"]
    assert task["logs"][0]["system_logs"] == [
        "backend parameter 'cpus' is not supported by this server and was ignored; "
        "did you mean resources.cpu_cores?",
        "backend parameter 'partiton' is not supported by this server and was ignored; "
        "did you mean `partition`?",
        "backend parameter 'tiem' is not supported by this server and was ignored; "
        "did you mean `time`?",
    ]
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "refusing")},
        overrides={"backend_parameters.unsupported": "refuse"},
    )
    refusing = testing.TestClient(create_app(config, store=store))
    errors = {e["field"]: e["message"] for e in error_of(refusing, {**body, **ECHO})["errors"]}
    message = errors["resources.backend_parameters.tiem"]
    assert message.startswith(
        "is not supported by this server (backend_parameters.unsupported = refuse; supported: "
        "account, "
    )
    assert message.endswith("); did you mean `time`?")
    assert "did you mean `partition`?" in errors["resources.backend_parameters.partiton"]


def test_supported_backend_parameters_in_strict_mode_are_kept(client):
    body = {
        "resources": {
            "backend_parameters": {"ACCOUNT": "lab", "qos": "normal"},
            "backend_parameters_strict": True,
        },
        **ECHO,
    }
    task = get(client, create(client, body), "FULL")
    assert task["resources"]["backend_parameters"] == {"ACCOUNT": "lab", "qos": "normal"}
    assert "logs" not in task


# ------------------------------------------------------------------------------------- get


def test_get_views(client, store):
    body = {"inputs": [{"path": "/in/a", "content": "secret"}], **ECHO}
    task_id = create(client, body)
    logs = [
        {
            "logs": [{"exit_code": 0, "stdout": "hello\n", "stderr": "", "start_time": "t"}],
            "outputs": [],
            "system_logs": ["ran on node1"],
        }
    ]
    store.update_task(task_id, logs=logs)
    assert get(client, task_id) == {"id": task_id, "state": "QUEUED"}
    assert get(client, task_id, "MINIMAL") == {"id": task_id, "state": "QUEUED"}
    basic = get(client, task_id, "BASIC")
    assert basic["executors"] == ECHO["executors"]
    assert "content" not in basic["inputs"][0]
    assert basic["logs"] == [{"logs": [{"exit_code": 0, "start_time": "t"}], "outputs": []}]
    full = get(client, task_id, "FULL")
    assert full["inputs"][0]["content"] == "secret"
    assert full["logs"] == logs


def test_bad_view_is_400(client):
    task_id = create(client, ECHO)
    result = client.simulate_get(f"/v1/tasks/{task_id}", params={"view": "EVERYTHING"})
    assert result.status_code == 400
    assert result.json["errors"][0]["field"] == "view"
    assert client.simulate_get("/v1/tasks", params={"view": "x"}).status_code == 400


def test_unknown_task_is_404(client):
    for path in ("/v1/tasks/does-not-exist", "/ga4gh/tes/v1/tasks/a%20b"):
        result = client.simulate_get(path)
        assert result.status_code == 404
        assert result.json["code"] == 404


def test_accepts_json_content_type_and_body_on_get(client):
    task_id = create(client, ECHO)
    result = client.simulate_get(
        f"/v1/tasks/{task_id}", headers={"Content-Type": "application/json"}, body="{}"
    )
    assert result.status_code == 200


# ------------------------------------------------------------------------------------- list


def test_list_is_newest_first_and_minimal_by_default(client):
    ids = [create(client, {"name": f"t{i}", **ECHO}) for i in range(3)]
    tasks = client.simulate_get("/v1/tasks").json["tasks"]
    assert [t["id"] for t in tasks] == ids[::-1]
    assert all(set(t) == {"id", "state"} for t in tasks)
    basic = client.simulate_get("/v1/tasks", params={"view": "BASIC"}).json["tasks"]
    assert basic[0]["name"] == "t2" and basic[0]["executors"]


def test_list_views_hide_the_same_fields_as_get(client, store):
    task_id = create(client, {"inputs": [{"path": "/a", "content": "c"}], **ECHO})
    store.update_task(task_id, logs=[{"logs": [], "outputs": [], "system_logs": ["x"]}])
    basic = client.simulate_get("/v1/tasks", params={"view": "BASIC"}).json["tasks"][0]
    assert basic == get(client, task_id, "BASIC")
    full = client.simulate_get("/v1/tasks", params={"view": "FULL"}).json["tasks"][0]
    assert full == get(client, task_id, "FULL")


def test_name_prefix_is_a_case_sensitive_prefix(client):
    for name in ("align-1", "align-2", "Align-3", "realign", "al"):
        create(client, {"name": name, **ECHO})
    create(client, ECHO)  # no name

    def names(prefix: str) -> list[str]:
        tasks = client.simulate_get(
            "/v1/tasks", params={"name_prefix": prefix, "view": "BASIC"}
        ).json["tasks"]
        return sorted(t["name"] for t in tasks)

    assert names("align") == ["align-1", "align-2"]
    assert names("Align") == ["Align-3"]
    assert names("al") == ["al", "align-1", "align-2"]
    assert names("ign") == []
    assert names("align-%") == []
    assert names("align-_") == []


def test_name_prefix_with_unicode_and_like_metacharacters(client):
    for name in ("ünï-1", "a%b", "a_b", "a\U0010ffffz"):
        create(client, {"name": name, **ECHO})
    tasks = client.simulate_get("/v1/tasks", params={"name_prefix": "a%", "view": "BASIC"})
    assert [t["name"] for t in tasks.json["tasks"]] == ["a%b"]
    tasks = client.simulate_get("/v1/tasks", params={"name_prefix": "ü", "view": "BASIC"})
    assert [t["name"] for t in tasks.json["tasks"]] == ["ünï-1"]
    tasks = client.simulate_get("/v1/tasks", params={"name_prefix": "a\U0010ffff", "view": "BASIC"})
    assert [t["name"] for t in tasks.json["tasks"]] == ["a\U0010ffffz"]


def test_state_filter_and_the_old_spelling(client, store):
    queued = create(client, ECHO)
    canceled = create(client, ECHO)
    initializing = create(client, ECHO)
    client.simulate_post(f"/v1/tasks/{canceled}:cancel")
    store.update_task(initializing, state=State.INITIALIZING.value)

    def ids(state: str) -> list[str]:
        return [
            t["id"] for t in client.simulate_get("/v1/tasks", params={"state": state}).json["tasks"]
        ]

    assert ids("QUEUED") == [queued]
    assert ids("CANCELED") == [canceled]
    assert ids("INITIALIZING") == [initializing]
    assert ids("INITILIZING") == [initializing]
    assert ids("COMPLETE") == []
    result = client.simulate_get("/v1/tasks", params={"state": "DONE"})
    assert result.status_code == 400 and result.json["errors"][0]["field"] == "state"


def test_tag_filters_follow_the_spec_table(client):
    # The table in the TES document: filter -> tags -> match?
    cases = [
        ({"foo": "bar"}, {"foo": "bar"}, True),
        ({"foo": "bar"}, {"foo": "bat"}, False),
        ({"foo": ""}, {"foo": ""}, True),
        ({"foo": "bar", "baz": "bat"}, {"foo": "bar", "baz": "bat"}, True),
        ({"foo": "bar"}, {"foo": "bar", "baz": "bat"}, True),
        ({"foo": "bar", "baz": "bat"}, {"foo": "bar"}, False),
        ({"foo": ""}, {"foo": "bar"}, True),
        ({"foo": ""}, {}, False),
    ]
    for index, (tag_filter, tags, expected) in enumerate(cases):
        task_id = create(client, {"tags": {**tags, "case": str(index)}, **ECHO})
        query = "&".join(
            [f"tag_key={k}" for k in tag_filter]
            + [f"tag_value={v}" for v in tag_filter.values()]
            + [f"tag_key=case&tag_value={index}"]
        )
        # All keys first, then all values: pairs by position (case is the last pair).
        keys = [*tag_filter, "case"]
        values = [*tag_filter.values(), str(index)]
        query = "&".join([f"tag_key={k}" for k in keys] + [f"tag_value={v}" for v in values])
        found = [
            t["id"] for t in client.simulate_get("/v1/tasks", query_string=query).json["tasks"]
        ]
        assert (found == [task_id]) is expected, (tag_filter, tags)


def test_tag_key_without_value_matches_any_value(client):
    a = create(client, {"tags": {"k": "1", "other": "x"}, **ECHO})
    b = create(client, {"tags": {"k": ""}, **ECHO})
    create(client, {"tags": {"z": "1"}, **ECHO})
    found = client.simulate_get("/v1/tasks", query_string="tag_key=k").json["tasks"]
    assert {t["id"] for t in found} == {a, b}
    found = client.simulate_get(
        "/v1/tasks", query_string="tag_key=other&tag_key=k&tag_value=x"
    ).json["tasks"]
    assert [t["id"] for t in found] == [a]


def test_empty_tag_values_are_stored_and_returned(client):
    task = get(client, create(client, {"tags": {"a": ""}, **ECHO}), "BASIC")
    assert task["tags"] == {"a": ""}


@pytest.mark.parametrize("size", ["0", "2048", "-1", "abc", "1.5"])
def test_bad_page_size_is_400(client, size):
    result = client.simulate_get("/v1/tasks", params={"page_size": size})
    assert result.status_code == 400
    assert result.json["errors"][0]["field"] == "page_size"


def test_page_size_default_is_256_and_2047_is_allowed(client, store):
    for _ in range(260):
        store.create_task(ECHO)
    first = client.simulate_get("/v1/tasks").json
    assert len(first["tasks"]) == 256 and "next_page_token" in first
    assert len(client.simulate_get("/v1/tasks", params={"page_size": "2047"}).json["tasks"]) == 260


def test_pages_are_stable_while_tasks_are_created(client, store):
    ids = [store.create_task({"name": f"n{i}", **ECHO}).id for i in range(25)]
    seen: list[str] = []
    token = None
    while True:
        params = {"page_size": "10", **({"page_token": token} if token else {})}
        page = client.simulate_get("/v1/tasks", params=params).json
        seen += [t["id"] for t in page["tasks"]]
        store.create_task({"name": "late", **ECHO})  # new tasks must not shift the pages
        token = page.get("next_page_token")
        if not token:
            break
    assert seen == ids[::-1]


def test_last_page_has_no_token(client):
    create(client, ECHO)
    page = client.simulate_get("/v1/tasks", params={"page_size": "1"}).json
    assert "next_page_token" not in page
    assert client.simulate_get("/v1/tasks", params={"name_prefix": "zz"}).json == {"tasks": []}


@pytest.mark.parametrize("token", ["garbage", "MQ", "1", "MTAwLmFhYWFhYWFhYWFhYQ", "%%%", "é"])
def test_page_token_not_issued_by_the_server_is_400(client, token):
    create(client, ECHO)
    result = client.simulate_get("/v1/tasks", params={"page_token": token})
    assert result.status_code == 400
    assert result.json["errors"][0]["field"] == "page_token"


def test_filters_combine_with_paging(client):
    for i in range(6):
        create(client, {"name": f"job-{i}", "tags": {"even": str(i % 2 == 0)}, **ECHO})
        create(client, {"name": f"other-{i}", "tags": {"even": str(i % 2 == 0)}, **ECHO})
    seen, token = [], None
    while True:
        params = {
            "name_prefix": "job-",
            "tag_key": "even",
            "tag_value": "True",
            "page_size": "2",
            "view": "BASIC",
            **({"page_token": token} if token else {}),
        }
        page = client.simulate_get("/v1/tasks", params=params).json
        seen += [t["name"] for t in page["tasks"]]
        token = page.get("next_page_token")
        if not token:
            break
    assert seen == ["job-4", "job-2", "job-0"]


# ------------------------------------------------------------------------------------- cancel


def test_cancel_of_queued_task_makes_it_canceled(client):
    task_id = create(client, ECHO)
    result = client.simulate_post(f"/ga4gh/tes/v1/tasks/{task_id}:cancel", json={})
    assert result.status_code == 200 and result.json == {}
    assert get(client, task_id)["state"] == "CANCELED"


def test_cancel_is_idempotent_and_keeps_terminal_states(client, store):
    done = create(client, ECHO)
    store.update_task(done, state=State.COMPLETE.value)
    for _ in range(2):
        assert client.simulate_post(f"/v1/tasks/{done}:cancel").status_code == 200
    assert get(client, done)["state"] == "COMPLETE"
    queued = create(client, ECHO)
    for _ in range(2):
        assert client.simulate_post(f"/v1/tasks/{queued}:cancel").json == {}
    assert get(client, queued)["state"] == "CANCELED"


def test_cancel_of_unknown_task_is_404(client):
    result = client.simulate_post("/v1/tasks/nope:cancel")
    assert result.status_code == 404 and result.json["code"] == 404


def test_cancel_of_a_submitted_task_leaves_work_for_the_poller(client, store):
    task_id = create(client, ECHO)
    store.update_task(task_id, job_id="123", state=State.RUNNING.value)
    client.simulate_post(f"/v1/tasks/{task_id}:cancel")
    record = store.get_task(task_id)
    assert record.state == "CANCELED" and record.cancel_pending
    queued = create(client, ECHO)
    client.simulate_post(f"/v1/tasks/{queued}:cancel")
    assert not store.get_task(queued).cancel_pending


def test_terminal_state_never_changes(client, store):
    task_id = create(client, ECHO)
    client.simulate_post(f"/v1/tasks/{task_id}:cancel")
    assert not store.update_task(task_id, state=State.RUNNING.value)
    assert get(client, task_id)["state"] == "CANCELED"


# ----------------------------------------------------------------------- local images


def test_local_sif_images_only_from_the_configured_directories(tmp_path, store):
    images = tmp_path / "images"
    images.mkdir()
    (images / "tool.sif").write_text("sif")
    (tmp_path / "elsewhere.sif").write_text("sif")
    (images / "link.sif").symlink_to(tmp_path / "elsewhere.sif")
    step = {"command": ["true"]}

    def body(*paths: str) -> dict:
        return {"executors": [{"image": "alpine", **step}] + [{"image": p, **step} for p in paths]}

    # Default: no directory, so no local image at all.
    default = testing.TestClient(
        create_app(load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)}), store=store)
    )
    error = error_of(default, body(str(images / "tool.sif")))
    assert error["errors"][0]["field"] == "executors[1].image"
    assert "container.local_image_dirs" in error["errors"][0]["message"]

    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
        overrides={"container.local_image_dirs": [str(images)]},
    )
    client = testing.TestClient(create_app(config, store=store))
    assert create(client, body(str(images / "tool.sif")))
    for path, reason in [
        (tmp_path / "elsewhere.sif", "must be a .sif file under"),
        (images / "link.sif", "leads out of"),
        (images / "missing.sif", "does not exist"),
        (images / ".." / "elsewhere.sif", "normalised"),
        ("/etc/passwd", "normalised absolute path to a .sif"),
    ]:
        error = error_of(client, body(str(path)))
        assert [e["field"] for e in error["errors"]] == ["executors[1].image"], path
        assert reason in error["errors"][0]["message"], (path, error)


# ----------------------------------------------------------------------- hostile requests


def test_as_many_tag_filters_as_a_task_may_have_tags(client):
    """One more than `limits.max_tags` is a 400 naming tag_key; up to it, the filter works
    (it once overflowed the stack building the query: a 500 from 319 keys on)."""
    tags = {f"k{i}": f"v{i}" for i in range(256)}
    task_id = create(client, {"tags": tags, **ECHO})
    create(client, {"tags": {"k0": "v0"}, **ECHO})
    keys = "&".join(f"tag_key=k{i}" for i in range(256))
    values = "&".join(f"tag_value=v{i}" for i in range(256))
    for query in (keys, f"{keys}&{values}"):
        result = client.simulate_get("/v1/tasks", query_string=query)
        assert result.status_code == 200, result.text
        assert [t["id"] for t in result.json["tasks"]] == [task_id]
    for count in (257, 2000):
        query = "&".join(f"tag_key=k{i}" for i in range(count))
        result = client.simulate_get("/v1/tasks", query_string=query)
        assert result.status_code == 400, result.text
        assert result.json["errors"][0]["field"] == "tag_key"
        assert "256" in result.json["message"]


@pytest.mark.parametrize(
    ("path", "query", "field"),
    [
        ("/v1/tasks/a%00b", "", "id"),
        ("/ga4gh/tes/v1/tasks/%00", "view=FULL", "id"),
        ("/v1/tasks", "name_prefix=a%00", "name_prefix"),
        ("/v1/tasks", "tag_key=a%00b", "tag_key"),
        ("/v1/tasks", "tag_key=a&tag_value=%00", "tag_value"),
        ("/v1/tasks", "state=QUEUED%00", "state"),
        ("/v1/tasks", "view=%00", "view"),
        ("/v1/tasks", "page_token=%00", "page_token"),
    ],
)
def test_nul_in_a_path_or_query_parameter_is_400_naming_it(client, path, query, field):
    """PostgreSQL refuses NUL in a string parameter; the answer must not be a 500."""
    create(client, {"name": "a", "tags": {"a": "b"}, **ECHO})
    result = client.simulate_get(path, query_string=query)
    assert result.status_code == 400, result.text
    assert result.json["errors"][0]["field"] == field
    if field == "id":
        result = client.simulate_post(f"{path}:cancel")
        assert result.status_code == 400, result.text
        assert result.json["errors"][0]["field"] == "id"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "a\u0000", **ECHO}, "name"),
        ({"tags": {"k\u0000": "v"}, **ECHO}, "tags.k\u0000"),
        ({"tags": {"k": "\u0000"}, **ECHO}, "tags.k"),
        ({"executors": [{"image": "a", "command": ["x"], "env": {"A": "\u0000"}}]}, "env.A"),
        ({"inputs": [{"path": "/a", "content": "\u0000"}], **ECHO}, "inputs[0].content"),
    ],
)
def test_nul_anywhere_in_a_created_task_is_400_naming_the_field(client, body, field):
    error = error_of(client, body)
    assert error["errors"][0]["field"].endswith(field), error
    assert "NUL" in error["errors"][0]["message"]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("name", ["service-info", "openapi.json"])
def test_documents_below_tasks_are_not_a_500(client, prefix, name):
    """`/tasks/service-info` is the old clients' service-info under /v1 and an unknown task
    id elsewhere, like `/tasks/openapi.json`: never the 500 of a public path without an
    identity."""
    result = client.simulate_get(f"{prefix}/tasks/{name}")
    if prefix == "/v1" and name == "service-info":
        assert result.status_code == 200 and set(result.json) == {"name", "doc", "storage"}
    else:
        assert result.status_code == 404, result.text
        assert result.json["code"] == 404
        assert client.simulate_post(f"{prefix}/tasks/{name}:cancel").status_code == 404


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ({"ram_gb": 1e308}, "resources.ram_gb"),
        ({"ramGb": 1e300}, "resources.ramGb"),
        ({"disk_gb": 1e308}, "resources.disk_gb"),
        ({"ram_gb": 1e9 + 1}, "resources.ram_gb"),
        ({"cpu_cores": 65534}, "resources.cpu_cores"),
        ({"cpu_cores": 2**31 - 1}, "resources.cpu_cores"),
        ({"cpu_cores": 1e300}, "resources.cpu_cores"),
        ({"preemptible": 1}, "resources.preemptible"),
        ({"preemptible": "true"}, "resources.preemptible"),
        ({"backend_parameters_strict": 0}, "resources.backend_parameters_strict"),
    ],
)
def test_absurd_resources_are_400_naming_the_field(client, resources, field):
    """A value no Slurm job can take is refused at create (1e308 GB was accepted, and the
    poller's conversion to MB then failed the task with an internal error)."""
    error = error_of(client, {"resources": resources, **ECHO})
    assert error["errors"][0]["field"] == field, error


def test_the_largest_resources_allowed_render_into_sbatch_directives(client, tmp_path, config):
    from bridge.job.layout import TaskLayout
    from bridge.jobscript.directives import sbatch_directives
    from bridge.slurm import NodeSizes

    resources = {"cpu_cores": 65533, "ram_gb": 1e9, "disk_gb": 1e9}
    task = get(client, create(client, {"resources": resources, **ECHO}), "FULL")
    nodes = NodeSizes({"main": 102400}, {"main": 102400}, "main", memory_largest={"main": 4000})
    layout = TaskLayout(tmp_path / task["id"])
    directives = sbatch_directives(task, config=config, layout=layout, nodes=nodes)
    assert "--cpus-per-task=65533" in directives
    assert f"--mem={10**9 * 1024}" in directives and f"--tmp={10**9 * 1024}" in directives


# ----------------------------------------------------------------------- the served OpenAPI


def test_every_view_is_valid_against_the_served_openapi_document(client, store):
    """GET and list answers in each view validate against the schemas of the document the
    server serves (the MINIMAL view once broke a schema that required `executors`)."""
    import jsonschema

    document = client.simulate_get("/ga4gh/tes/v1/openapi.json").json
    assert document["openapi"].startswith("3.1")

    def validator(path: str, method: str, status: str = "200") -> jsonschema.Validator:
        schema = document["paths"][path][method]["responses"][status]["content"]
        schema = {**schema["application/json"]["schema"], "components": document["components"]}
        return jsonschema.Draft202012Validator(schema)

    body = {
        "name": "n",
        "inputs": [{"path": "/in/a", "content": "c"}, {"path": "/in/b", "url": "s3://b/k"}],
        "outputs": [{"path": "/out/x", "url": "s3://b/x"}],
        "resources": {"cpu_cores": 2, "ramGb": 1.5, "backend_parameters": {"qos": "q"}},
        "volumes": ["/vol"],
        "tags": {"k": "v"},
        **ECHO,
    }
    task_id = create(client, body)
    create(client, ECHO)
    store.update_task(
        task_id,
        logs=[
            {
                "logs": [{"exit_code": 0, "stdout": "o", "stderr": "", "start_time": "t"}],
                "outputs": [{"url": "s3://b/x", "path": "/out/x", "size_bytes": "3"}],
                "system_logs": ["ran"],
                "metadata": {"slurm_job_id": "1"},
            }
        ],
    )
    get_task = validator("/tasks/{id}", "get")
    list_tasks = validator("/tasks", "get")
    for view in ("MINIMAL", "BASIC", "FULL"):
        get_task.validate(get(client, task_id, view))
        page = client.simulate_get("/v1/tasks", params={"view": view, "page_size": "1"}).json
        assert page["next_page_token"]
        list_tasks.validate(page)
    validator("/tasks", "post").validate(client.simulate_post("/v1/tasks", json=ECHO).json)
    error = client.simulate_get("/v1/tasks/nope")
    validator("/tasks/{id}", "get", "404").validate(error.json)
    for name in ("tesTaskRequest", "tesTask"):
        jsonschema.Draft202012Validator.check_schema(
            {**document["components"]["schemas"][name], "components": document["components"]}
        )


def test_a_list_page_stops_at_its_byte_budget_with_a_token(tmp_path, store):
    """30 tasks of 1 MB with a 4 MB budget: pages of at most 4 MB (a task alone may be larger),
    every task exactly once, in order; MINIMAL pages are not cut."""
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
        overrides={"limits.list_budget_bytes": 4 * 1024 * 1024},
    )
    client = testing.TestClient(create_app(config, store=store))
    big = {"inputs": [{"path": "/in/a", "content": "x" * (1024 * 1024)}], **ECHO}
    ids = [store.create_task({"name": f"t{i}", **big}).id for i in range(30)]
    huge = {"inputs": [{"path": f"/in/{i}", "content": "y" * (1024 * 1024)} for i in range(5)]}
    ids.append(store.create_task({**huge, **ECHO}).id)
    for view, most in (("FULL", 4), ("BASIC", 31)):
        seen: list[str] = []
        token = None
        while True:
            params = {"view": view, **({"page_token": token} if token else {})}
            result = client.simulate_get("/v1/tasks", params=params)
            assert result.status_code == 200
            tasks = result.json["tasks"]
            assert 1 <= len(tasks) <= most, view
            assert len(result.content) <= 4 * 1024 * 1024 or len(tasks) == 1
            seen += [t["id"] for t in tasks]
            token = result.json.get("next_page_token")
            if not token:
                break
        assert seen == ids[::-1], view
    minimal = client.simulate_get("/v1/tasks").json
    assert len(minimal["tasks"]) == 31 and "next_page_token" not in minimal


def test_an_argument_or_environment_the_kernel_cannot_pass_is_400(client):
    """Linux refuses exec of one argument or environment string over 128 KiB (MAX_ARG_STRLEN),
    or of more than ARG_MAX in all: such a task once ended EXECUTOR_ERROR 126 with no reason."""
    step = {"image": "alpine"}
    most = 128 * 1024 - 64
    assert create(client, {"executors": [{**step, "command": ["echo", "x" * most]}]})
    assert create(client, {"executors": [{**step, "command": ["env"], "env": {"V": "x" * 1000}}]})
    for executor, field in [
        ({"command": ["echo", "x" * (128 * 1024)]}, "executors[0].command[1]"),
        ({"command": ["echo", "é" * (64 * 1024)]}, "executors[0].command[1]"),
        ({"command": ["env"], "env": {"BIG": "x" * (128 * 1024)}}, "executors[0].env.BIG"),
        ({"command": ["echo"] + ["x" * 100_000] * 11}, "executors[0]"),
        ({"command": ["env"], "env": {f"V{i}": "x" * 100_000 for i in range(11)}}, "executors[0]"),
    ]:
        body = {"executors": [ECHO["executors"][0], {**step, **executor}]}
        body["executors"].reverse()
        error = error_of(client, body)
        assert [e["field"] for e in error["errors"]] == [field], error
        assert "bytes" in error["errors"][0]["message"]


@pytest.fixture
def full_disk_store(tmp_path):
    """A SQLite store on a 1 MiB tmpfs (root mounts it; the suite runs as root) and a function
    that fills the filesystem up; the filler is removed by the test to free it again."""
    import os
    import subprocess

    from tests.conftest import _fresh_store

    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    store = _fresh_store(f"sqlite:///{mount / 'tes.db'}")

    def fill() -> None:
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)

    try:
        yield store, fill, mount / "filler"
    finally:
        store.db.close()
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_database_answers_503_with_retry_after_and_loses_nothing(config, full_disk_store):
    store, fill, filler = full_disk_store
    client = testing.TestClient(create_app(config, store=store))
    before = [create(client, {"name": f"t{i}", **ECHO}) for i in range(3)]
    fill()
    for result in (
        client.simulate_post("/v1/tasks", json={"name": "x" * 100_000, **ECHO}),
        client.simulate_post(f"/v1/tasks/{before[0]}:cancel"),
    ):
        assert result.status_code == 503, result.text
        assert int(result.headers["retry-after"]) > 0
        assert result.json["code"] == 503 and "full" in result.json["message"]
    # Reads still answer, and nothing was half-written.
    assert [t["id"] for t in client.simulate_get("/v1/tasks").json["tasks"]] == before[::-1]
    filler.unlink()
    late = create(client, {"name": "x" * 100_000, **ECHO})
    assert client.simulate_post(f"/v1/tasks/{before[0]}:cancel").status_code == 200
    tasks = client.simulate_get("/v1/tasks").json["tasks"]
    assert [t["id"] for t in tasks] == [late, *before[::-1]]
    assert [t["state"] for t in tasks] == ["QUEUED", "QUEUED", "QUEUED", "CANCELED"]


def test_a_body_of_millions_of_items_is_refused_fast(client):
    """16 MiB of `{},` once took 272 s and 14 GB in one worker: pydantic made one error per
    item. Counts are checked before validation, each collection naming its field."""
    import time

    count = (16 * 1024 * 1024 - 100) // 3
    bodies = [
        ('{"executors": [' + "{}," * count + "{}]}", "executors"),
        ('{"volumes": [' + "0," * count + "0]}", "volumes"),
        ('{"tags": {' + ",".join(f'"{i}":0' for i in range(1_000_000)) + "}}", "tags"),
        (
            '{"executors": [{"image": "a", "command": [' + "0," * count + "0]}]}",
            "executors[0].command",
        ),
        (
            '{"executors": [{"image": "a", "command": ["x"], "env": {'
            + ",".join(f'"V{i}":0' for i in range(1_000_000))
            + "}}]}",
            "executors[0].env",
        ),
        ('{"resources": {"zones": [' + "0," * count + "0]}}", "resources.zones"),
        (
            '{"resources": {"backend_parameters": {'
            + ",".join(f'"k{i}":0' for i in range(1_000_000))
            + "}}}",
            "resources.backend_parameters",
        ),
    ]
    for body, field in bodies:
        started = time.monotonic()
        result = client.simulate_post("/v1/tasks", body=body)
        assert result.status_code == 400, result.text[:300]
        assert [e["field"] for e in result.json["errors"]] == [field]
        assert time.monotonic() - started < 10, field


def test_a_store_opened_read_only_answers_503_then_writes_once_it_can(config, tmp_path):
    """SQLite opens a file it cannot write at that moment read-only, for the life of the
    connection: a worker started then answered every write 500 "attempt to write a readonly
    database", long after the files were writable again. The store sees the files read-only
    through a read-only bind mount (root ignores file modes); the WAL is kept by another
    connection on the writable side, as the poller or another worker would."""
    import sqlite3
    import subprocess

    from bridge.store import Store
    from tests.conftest import _fresh_store

    disk, view = tmp_path / "disk", tmp_path / "view"
    disk.mkdir()
    view.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    subprocess.run(["mount", "--bind", str(disk), str(view)], check=True)
    other = None
    try:
        _fresh_store(f"sqlite:///{disk / 'tes.db'}").db.close()
        other = sqlite3.connect(disk / "tes.db")
        other.execute("SELECT count(*) FROM tasks").fetchall()
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        store = Store.from_url(f"sqlite:///{view / 'tes.db'}")
        client = testing.TestClient(create_app(config, store=store))
        assert client.simulate_get("/v1/tasks").status_code == 200
        for _ in range(2):
            refused = client.simulate_post("/v1/tasks", json=ECHO)
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["retry-after"]) > 0
            assert "read-only" in refused.json["message"]
        subprocess.run(["mount", "-o", "remount,bind,rw", str(view)], check=True)
        task_id = create(client, ECHO)
        assert client.simulate_get(f"/v1/tasks/{task_id}").json["state"] == "QUEUED"
        store.db.close()
    finally:
        if other is not None:
            other.close()
        subprocess.run(["umount", "-l", str(view)], check=True)
        subprocess.run(["umount", "-l", str(disk)], check=True)
