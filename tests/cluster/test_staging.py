"""Staging through the whole bridge on the real cluster: tasks whose inputs and outputs live on
real HTTP, S3 and FTP servers on loopback (tests/fixtures/storage.py), and inputs named by a DRS
server on loopback (tests/fixtures/drs.py), moved by the job side on the compute node."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fixtures.drs import DrsServer, sha256
from tests.fixtures.service import BridgeService, start_bridge_service
from tests.fixtures.storage import BUCKET, StorageServers

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="session")
def storage_servers(cluster_storage_servers: StorageServers) -> StorageServers:
    return cluster_storage_servers


@pytest.fixture(scope="session")
def drs_server(cluster_drs_server: DrsServer) -> DrsServer:
    return cluster_drs_server


@pytest.fixture(scope="session")
def staging_service(
    local_cluster: Any,
    storage_servers: StorageServers,
    drs_server: DrsServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[BridgeService]:
    toml = storage_servers.staging_toml() + (
        f'ca_bundle = "{drs_server.ca}"\n'
        f'drs_tokens_file = "{drs_server.root / "drs-tokens.toml"}"\n'
    )
    with start_bridge_service(
        local_cluster, tmp_path_factory.mktemp("staging"), extra_toml=toml
    ) as service:
        yield service


def sh(script: str) -> dict[str, Any]:
    return {"image": "alpine", "command": ["sh", "-c", script]}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def system_logs(task: dict[str, Any]) -> str:
    return "\n".join(line for log in task.get("logs", []) for line in log.get("system_logs", []))


@pytest.mark.parametrize("protocol", ["http", "s3", "ftp"])
def test_file_directory_and_wildcard_staging_keeps_every_byte(
    staging_service, storage_servers, drs_server, protocol
):
    base = f"e2e-{protocol}"
    data = os.urandom(300_000)
    source = storage_servers.put(protocol, f"{base}/in/data.bin", data)
    storage_servers.put(protocol, f"{base}/in/tree/a.txt", b"a\n")
    b_bin = storage_servers.put(protocol, f"{base}/in/tree/sub/b.bin", os.urandom(40_000))
    data_url = storage_servers.url_for(protocol, f"{base}/in/data.bin")
    # The same bytes as a DRS object behind the site's bearer token, whose /access call gives
    # this protocol's URL: resolved, fetched and checked on the compute node.
    drs_server.blob(
        f"{base}-drs",
        data,
        methods=[{"type": {"http": "https"}.get(protocol, protocol), "access_id": "a"}],
        access={"a": {"url": data_url}},
        auth="bearer",
    )
    inputs = [
        {"path": "/in/data.bin", "url": data_url},
        {"path": "/in/drs.bin", "url": drs_server.uri(f"{base}-drs")},
    ]
    if protocol != "http":  # plain HTTP cannot list a directory (see the next test)
        inputs.append(
            {
                "path": "/in/tree",
                "url": storage_servers.url_for(protocol, f"{base}/in/tree"),
                "type": "DIRECTORY",
            }
        )
    copy_tree = (
        "cp -r /in/tree /out/tree"
        if protocol != "http"
        else (
            "mkdir -p /out/tree/sub && echo a > /out/tree/a.txt && "
            "cp /in/data.bin /out/tree/sub/b.bin"
        )
    )
    task = staging_service.run(
        {
            "inputs": inputs,
            "outputs": [
                {
                    "path": "/out/data.bin",
                    "url": storage_servers.url_for(protocol, f"{base}/out/data.bin"),
                },
                {
                    "path": "/out/tree",
                    "url": storage_servers.url_for(protocol, f"{base}/out/tree"),
                    "type": "DIRECTORY",
                },
                {
                    "path": "/out/logs/*.log",
                    "path_prefix": "/out/logs",
                    "url": storage_servers.url_for(protocol, f"{base}/out/logs"),
                },
            ],
            "executors": [
                sh(
                    "cmp /in/data.bin /in/drs.bin && "
                    f"cp /in/data.bin /out/data.bin && {copy_tree} && mkdir -p /out/logs && "
                    "echo one > /out/logs/1.log && seq 1 1000 > /out/logs/2.log && "
                    "echo no > /out/logs/3.txt"
                )
            ],
        }
    )
    assert task["state"] == "COMPLETE", system_logs(task)
    out = lambda name: storage_servers.server_path(protocol, f"{base}/out/{name}")  # noqa: E731
    assert digest(out("data.bin")) == digest(source)
    if protocol != "http":
        assert digest(out("tree/sub/b.bin")) == digest(b_bin)
    assert out("tree/a.txt").read_text() == "a\n"
    assert out("logs/1.log").read_text() == "one\n"
    assert out("logs/2.log").read_text() == "".join(f"{i}\n" for i in range(1, 1001))
    assert not out("logs/3.txt").exists()
    uploaded = {o["path"]: o for o in task["logs"][0]["outputs"]}
    assert set(uploaded) == {
        "/out/data.bin",
        "/out/tree/a.txt",
        "/out/tree/sub/b.bin",
        "/out/logs/1.log",
        "/out/logs/2.log",
    }
    for path, entry in uploaded.items():
        name = path.removeprefix("/out/")
        assert entry["size_bytes"] == str(out(name).stat().st_size), path
        assert entry["url"] == storage_servers.url_for(protocol, f"{base}/out/{name}")


def test_directory_input_over_http_is_a_system_error(staging_service, storage_servers):
    url = f"{storage_servers.http}/e2e-http/in"
    task = staging_service.run(
        {
            "inputs": [{"path": "/in/tree", "url": url, "type": "DIRECTORY"}],
            "executors": [sh("true")],
        }
    )
    assert task["state"] == "SYSTEM_ERROR"
    assert task["logs"][0]["logs"] == []
    assert "DIRECTORY inputs cannot be staged over HTTP" in system_logs(task)


def test_missing_and_unreachable_inputs_stop_the_task_before_any_executor(
    staging_service, storage_servers, drs_server
):
    # A DRS object whose bytes are not those its checksum names.
    tampered, original = b"tampered\n", b"original\n"
    drs_server.blob("e2e-tampered", tampered, checksums={"sha-256": sha256(original)})
    urls = [
        f"{storage_servers.http}/nowhere/x.txt",
        f"s3://{BUCKET}/nowhere/x.txt",
        f"{storage_servers.ftp}/nowhere/x.txt",
        "http://127.0.0.1:9/closed-port.txt",
        f"ftp://tesuser:ftp-url-password@127.0.0.1:{storage_servers.ftp_port}/nowhere/y.txt",
        drs_server.uri("e2e-tampered"),
    ]
    task = staging_service.run(
        {
            "inputs": [{"path": f"/in/{i}", "url": url} for i, url in enumerate(urls)],
            "executors": [sh("echo ran > /tmp/x")],
        }
    )
    assert task["state"] == "SYSTEM_ERROR"
    assert task["logs"][0]["logs"] == []
    logs = system_logs(task)
    for url in urls[:4]:
        assert url in logs
    assert "HTTP 404" in logs and "does not exist" in logs and "550" in logs
    assert "cannot connect" in logs
    assert "ftp-url-password" not in logs and "ftp://***@127.0.0.1" in logs
    assert (
        f"input 5 {urls[5]} -> /in/5: checksum mismatch: the DRS object's sha-256 is "
        f"{sha256(original)}, the bytes fetched have {sha256(tampered)}"
    ) in logs


def test_missing_output_is_logged_and_the_others_are_still_uploaded(
    staging_service, storage_servers
):
    task = staging_service.run(
        {
            "outputs": [
                {"path": "/out/absent.txt", "url": f"s3://{BUCKET}/missing-out/absent.txt"},
                {"path": "/out/there.txt", "url": f"s3://{BUCKET}/missing-out/there.txt"},
            ],
            "executors": [sh("echo here > /out/there.txt")],
        }
    )
    # storage.missing_outputs = "ignore", the default (docs/staging.md, "Outcomes"): an optional
    # output a workflow engine declared; the log names it.
    assert task["state"] == "COMPLETE", task
    assert "output 0 /out/absent.txt -> " in system_logs(task)
    assert "not found after the executors ran; ignored" in system_logs(task)
    assert (storage_servers.bucket_dir / "missing-out" / "there.txt").read_text() == "here\n"
    assert [o["path"] for o in task["logs"][0]["outputs"]] == ["/out/there.txt"]


def test_a_file_output_that_is_a_directory_is_uploaded_as_one(staging_service, storage_servers):
    """What Nextflow's nf-ga4gh sends for an nf-core `path "index"` output: type FILE."""
    url = f"s3://{BUCKET}/nf-index/index"
    task = staging_service.run(
        {
            "outputs": [{"path": "/work/index", "url": url}],
            "executors": [
                sh("cd /work && mkdir -p index/sub && echo a > index/a && echo b > index/sub/b")
            ],
        }
    )
    assert task["state"] == "COMPLETE", task
    assert (storage_servers.bucket_dir / "nf-index" / "index" / "a").read_text() == "a\n"
    assert (storage_servers.bucket_dir / "nf-index" / "index" / "sub" / "b").read_text() == "b\n"
    assert sorted((o["path"], o["url"]) for o in task["logs"][0]["outputs"]) == [
        ("/work/index/a", f"{url}/a"),
        ("/work/index/sub/b", f"{url}/sub/b"),
    ]
    assert "is a directory (output type is FILE); uploaded as a directory" in system_logs(task)


def test_traversal_and_links_never_reach_outside(staging_service, storage_servers):
    secret_file = Path("/etc/hostname").read_text()
    task = staging_service.run(
        {
            "outputs": [
                {"path": "/out/a.txt", "url": f"s3://{BUCKET}/trav/../../escaped.txt"},
                {"path": "/out/b.txt", "url": f"{storage_servers.ftp}/trav/../../escaped.txt"},
                {"path": "/out/link", "url": f"s3://{BUCKET}/trav/link"},
                {"path": "/out/tree", "url": f"s3://{BUCKET}/trav/tree", "type": "DIRECTORY"},
            ],
            "executors": [
                sh(
                    "echo a > /out/a.txt; echo b > /out/b.txt; ln -s /etc/hostname /out/link; "
                    "mkdir -p /out/tree; echo ok > /out/tree/ok.txt; "
                    "ln -s /etc/hostname /out/tree/escape"
                )
            ],
        }
    )
    assert task["state"] == "SYSTEM_ERROR"
    logs = system_logs(task)
    assert logs.count("`.` and `..` are not allowed") == 2
    assert "is a symbolic link" in logs
    assert not (storage_servers.s3_root / "escaped.txt").exists()
    assert not (storage_servers.root / "escaped.txt").exists()
    assert not (storage_servers.bucket_dir / "trav" / "link").exists()
    assert not (storage_servers.bucket_dir / "trav" / "tree" / "escape").exists()
    assert (storage_servers.bucket_dir / "trav" / "tree" / "ok.txt").read_text() == "ok\n"
    assert secret_file not in json.dumps(task["logs"][0]["outputs"])


def test_file_url_outside_the_allowed_directories_is_a_400(staging_service):
    task = {
        "inputs": [{"path": "/in/x", "url": "file:///etc/shadow"}],
        "executors": [sh("true")],
    }
    result = requests.post(f"{staging_service.api}/tasks", json=task, timeout=10)
    assert result.status_code == 400
    assert result.json()["errors"][0]["field"] == "inputs[0].url"


def test_service_info_lists_what_this_deployment_stages(staging_service):
    info = requests.get(f"{staging_service.api}/service-info", timeout=10).json()
    # file:// per allowed directory: a bare file:// would claim every local path.
    local = f"file://{staging_service.data_dir}/"
    assert info["storage"] == [local, "http://", "https://", "s3://", "ftp://", "drs://"]


def test_bad_credentials_are_a_system_error_that_leaks_nothing(
    local_cluster, storage_servers, tmp_path_factory, request
):
    root = local_cluster.shared_path("bad-credentials")
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    wrong = root / "aws-credentials"
    wrong.write_text(
        f"[tes-test]\naws_access_key_id = {storage_servers.s3_key}\n"
        "aws_secret_access_key = definitely-wrong-secret\n"
    )
    netrc = root / "netrc"
    netrc.write_text("machine 127.0.0.1 login tesuser password wrong-ftp-password\n")
    toml = storage_servers.staging_toml()
    toml = toml.replace(str(storage_servers.aws_credentials), str(wrong))
    toml = toml.replace(str(storage_servers.netrc), str(netrc))
    storage_servers.put("s3", "creds.txt", b"x")
    storage_servers.put("ftp", "creds.txt", b"x")
    with start_bridge_service(local_cluster, root, extra_toml=toml) as service:
        task = service.run(
            {
                "inputs": [
                    {"path": "/in/s3", "url": f"s3://{BUCKET}/creds.txt"},
                    {"path": "/in/ftp", "url": f"{storage_servers.ftp}/creds.txt"},
                ],
                "executors": [sh("true")],
            }
        )
        assert task["state"] == "SYSTEM_ERROR"
        logs = system_logs(task)
        assert "access denied" in logs and "login as 'tesuser' refused" in logs
        everything = json.dumps(task) + "".join(
            p.read_text() for p in service.work_dir.glob("*/*") if p.is_file()
        )
        for secret in ("definitely-wrong-secret", "wrong-ftp-password", *storage_servers.secrets):
            assert secret not in everything


def test_no_secret_reaches_task_files_logs_or_responses(
    staging_service, storage_servers, drs_server
):
    # Runs last in this module: it inspects every task the tests above ran.
    task_dirs = [d for d in staging_service.work_dir.iterdir() if d.is_dir()]
    assert len(task_dirs) >= 6
    texts = []
    for task_dir in task_dirs:
        for name in ("task.json", "job-config.json", "job.sh"):
            texts.append((task_dir / name).read_text())
        texts += [p.read_text() for p in (task_dir / "records").rglob("*") if p.is_file()]
        texts += [p.read_text() for p in task_dir.glob("slurm-*.out")]
    listing = requests.get(f"{staging_service.api}/tasks", params={"view": "FULL"}, timeout=10).text
    texts += [listing, requests.get(f"{staging_service.api}/service-info", timeout=10).text]
    everything = "\n".join(texts)
    assert "s3_credentials_file" in everything  # the path is there, the keys are not
    assert "drs_tokens_file" in everything  # and the DRS tokens file's path, not its tokens
    for secret in storage_servers.secrets + drs_server.secrets:
        assert secret not in everything
