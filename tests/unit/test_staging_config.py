"""`[staging]` on the login node: what the API refuses at create, what service-info lists, and
what the renderer hands the job side (names and paths, never a secret)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from falcon import testing

from bridge.api.app import create_app
from bridge.config import ConfigError, load_config
from bridge.job.settings import read_settings
from bridge.job.staging import StagingOptions
from bridge.jobscript.render import prepare_task_dir

ECHO = {"executors": [{"image": "alpine", "command": ["true"]}]}


def make_client(tmp_path: Path, sqlite_store, toml: str = "") -> testing.TestClient:
    config_file = tmp_path / "c.toml"
    config_file.write_text(toml)
    config = load_config(config_file, environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)})
    return testing.TestClient(create_app(config, store=sqlite_store))


@pytest.mark.parametrize(
    ("task", "field"),
    [
        ({"inputs": [{"path": "/in/x", "url": "file:///etc/passwd"}]}, "inputs[0].url"),
        ({"inputs": [{"path": "/in/x", "url": "/data/../etc/passwd"}]}, "inputs[0].url"),
        ({"inputs": [{"path": "/in/x", "url": "file:///datax/y"}]}, "inputs[0].url"),
        ({"inputs": [{"path": "/in/x", "url": "file://otherhost/data/y"}]}, "inputs[0].url"),
        ({"outputs": [{"path": "/o", "url": "/tmp/out"}]}, "outputs[0].url"),
    ],
)
def test_file_urls_outside_the_allowed_directories_are_a_400(tmp_path, sqlite_store, task, field):
    client = make_client(tmp_path, sqlite_store, '[storage]\nallowed_dirs = ["/data"]\n')
    result = client.simulate_post("/ga4gh/tes/v1/tasks", json={**ECHO, **task})
    assert result.status_code == 400, result.text
    assert [e["field"] for e in result.json["errors"]] == [field]


def test_file_urls_inside_the_allowed_directories_and_other_schemes_are_accepted(
    tmp_path, sqlite_store
):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for name in ("a", "sub/b"):
        (data / name).write_text(name)  # inputs this host sees missing are a 400 of their own
    client = make_client(tmp_path, sqlite_store, f'[storage]\nallowed_dirs = ["{data}"]\n')
    task = {
        **ECHO,
        "inputs": [
            {"path": "/in/a", "url": f"file://{data}/a"},
            {"path": "/in/b", "url": f"{data}/sub/b"},
            {"path": "/in/c", "url": "s3://bucket/../c"},  # judged by the job side
        ],
        "outputs": [{"path": "/o", "url": f"file://{data}", "type": "DIRECTORY"}],
    }
    result = client.simulate_post("/ga4gh/tes/v1/tasks", json=task)
    assert result.status_code == 200, result.text


def test_without_allowed_directories_every_file_url_is_a_400(tmp_path, sqlite_store):
    client = make_client(tmp_path, sqlite_store)
    task = {**ECHO, "inputs": [{"path": "/in/a", "url": "file:///data/a"}]}
    result = client.simulate_post("/ga4gh/tes/v1/tasks", json=task)
    assert result.status_code == 400
    assert "disabled" in result.json["errors"][0]["message"]


def test_service_info_storage_is_derived_from_the_enabled_protocols(tmp_path, sqlite_store):
    (tmp_path / "data").mkdir()
    client = make_client(
        tmp_path,
        sqlite_store,
        f'[staging]\nprotocols = ["s3"]\n[storage]\nshared_dirs = ["{tmp_path}/data"]\n',
    )
    expected = [f"file://{tmp_path}/data/", "s3://"]
    assert client.simulate_get("/ga4gh/tes/v1/service-info").json["storage"] == expected
    legacy = client.simulate_get("/v1/tasks/service-info").json
    assert legacy["storage"] == expected


def test_unknown_protocols_and_endpoints_with_credentials_are_config_errors(tmp_path):
    for toml in (
        '[staging]\nprotocols = ["gopher"]\n',
        '[staging]\ns3_endpoint_url = "https://AKIA:secret@s3.example.org"\n',
    ):
        (tmp_path / "c.toml").write_text(toml)
        with pytest.raises(ConfigError, match="staging"):
            load_config(tmp_path / "c.toml", environ={})


def test_job_config_carries_staging_names_and_paths_only(tmp_path):
    secret = "wJalrXUtnFEMI-not-in-any-rendered-file"
    creds = tmp_path / "aws-credentials"
    creds.write_text(f"[p]\naws_access_key_id = AKIAX\naws_secret_access_key = {secret}\n")
    (tmp_path / "c.toml").write_text(
        f'[staging]\ns3_endpoint_url = "http://127.0.0.1:9000"\ns3_profile = "p"\n'
        f's3_credentials_file = "{creds}"\nnetrc_file = "/etc/tes/netrc"\nhttp_upload = true\n'
        f'protocols = ["file", "s3"]\n'
    )
    config = load_config(tmp_path / "c.toml", environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)})
    task = {"id": "t1", **ECHO, "inputs": [{"path": "/in/x", "url": "s3://b/k"}]}
    script = prepare_task_dir(task, config=config, image_paths={"alpine": "/img.sif"})
    settings = read_settings(script.parent / "job-config.json")
    options = StagingOptions.from_dict(settings.staging)
    assert options.s3_endpoint_url == "http://127.0.0.1:9000"
    assert options.s3_credentials_file == str(creds)
    assert options.netrc_file == "/etc/tes/netrc"
    assert options.http_upload is True and options.enabled == ("file", "s3")
    for name in ("job-config.json", "job.sh", "task.json"):
        text = (script.parent / name).read_text()
        assert secret not in text and "AKIAX" not in text, name
    assert json.loads((script.parent / "job-config.json").read_text())["staging"]["s3_profile"]


def test_streamable_inputs_are_bound_when_the_deployment_allows_it(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "big.bam").write_bytes(b"x")
    base = f'[storage]\nallowed_dirs = ["{data}"]\n'
    task = {
        "id": "t1",
        **ECHO,
        "inputs": [
            {"path": "/in/big.bam", "url": f"file://{data}/big.bam", "streamable": True},
            {"path": "/in/small", "url": f"file://{data}/big.bam"},
        ],
    }
    for streamable_bind, bound in ((False, []), (True, [0])):
        (tmp_path / "c.toml").write_text(
            f"{base}[staging]\nstreamable_bind = {str(streamable_bind).lower()}\n"
        )
        config = load_config(tmp_path / "c.toml", environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)})
        script = prepare_task_dir(task, config=config, image_paths={"alpine": "/img.sif"})
        assert read_settings(script.parent / "job-config.json").bound_inputs == bound
        assert (f"{data}/big.bam:/in/big.bam:ro" in script.read_text()) is streamable_bind
