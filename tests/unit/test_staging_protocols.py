"""The job side's protocol modules against real servers on loopback (tests/fixtures/storage.py):
HTTP (GET/PUT), S3 (rclone serve s3) and FTP (pyftpdlib)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from bridge.job.layout import TaskLayout
from bridge.job.records import read_records
from bridge.job.settings import JobSettings
from bridge.job.stage import (
    STAGE_FAILED,
    STAGE_MISSING_OUTPUTS,
    STAGE_OK,
    _no_connection,
    stage_in,
    stage_out,
)
from bridge.job.staging import (
    StagingBackend,
    StagingContext,
    StagingError,
    StagingOptions,
    UnsupportedProtocolError,
    backend_for,
    redact,
    safe_relative,
)
from tests.fixtures.storage import BUCKET, StorageServers

PROTOCOLS = ["http", "s3", "ftp"]
LISTING = ["s3", "ftp"]


def context(servers: StorageServers, notes: list[str] | None = None, **overrides: Any):
    options = StagingOptions.from_dict(servers.staging_options(**overrides))
    log = notes.append if notes is not None else print
    return StagingContext(options=options, log=log)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def upload(servers: StorageServers, path: Path, url: str, **overrides: Any) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        backend_for(url).upload_file(fd, os.fstat(fd).st_size, url, context(servers, **overrides))
    finally:
        os.close(fd)


def assert_no_secret(servers: StorageServers, text: str) -> None:
    for secret in servers.secrets:
        assert secret not in text


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_file_in_and_out_keeps_every_byte(storage_servers, tmp_path, protocol):
    source = storage_servers.put(
        protocol, f"unit-{protocol}/in.bin", os.urandom(3 * 1024 * 1024 + 17)
    )
    dest = tmp_path / "in.bin"
    url = storage_servers.url_for(protocol, f"unit-{protocol}/in.bin")
    backend_for(url).download(url, dest, "FILE", context(storage_servers))
    assert sha256(dest) == sha256(source)

    # Above the 8 MiB multipart threshold of the test config, for S3.
    local = tmp_path / "out.bin"
    local.write_bytes(os.urandom(9 * 1024 * 1024 + 5))
    out_url = storage_servers.url_for(protocol, f"unit-{protocol}/deep/er/out.bin")
    upload(storage_servers, local, out_url)
    assert sha256(storage_servers.server_path(protocol, f"unit-{protocol}/deep/er/out.bin")) == (
        sha256(local)
    )


@pytest.mark.parametrize("protocol", LISTING)
def test_directory_input_copies_the_whole_tree(storage_servers, tmp_path, protocol):
    files = {"a.txt": b"a\n", "sub/b.bin": os.urandom(5000), "sub/deeper/c": b""}
    for name, data in files.items():
        storage_servers.put(protocol, f"tree-{protocol}/{name}", data)
    dest = tmp_path / "tree"
    url = storage_servers.url_for(protocol, f"tree-{protocol}")
    backend_for(url).download(url, dest, "DIRECTORY", context(storage_servers))
    got = {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert got == files


def test_directory_input_over_http_is_a_clear_error(storage_servers, tmp_path):
    url = f"{storage_servers.http}/tree"
    with pytest.raises(StagingError, match="DIRECTORY inputs cannot be staged over HTTP"):
        backend_for(url).download(url, tmp_path / "d", "DIRECTORY", context(storage_servers))


@pytest.mark.parametrize("protocol", LISTING)
def test_empty_or_missing_directory_input_fails(storage_servers, tmp_path, protocol):
    url = storage_servers.url_for(protocol, "no-such-tree")
    with pytest.raises(StagingError):
        backend_for(url).download(url, tmp_path / "d", "DIRECTORY", context(storage_servers))


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("protocol", "reason"), [("http", "HTTP 404"), ("s3", "does not exist"), ("ftp", "550")]
)
def test_missing_input_names_the_url_and_the_reason(storage_servers, tmp_path, protocol, reason):
    url = storage_servers.url_for(protocol, "missing/nothing.txt")
    with pytest.raises(StagingError) as caught:
        backend_for(url).download(url, tmp_path / "x", "FILE", context(storage_servers))
    assert reason in str(caught.value)
    assert "missing/nothing.txt" in str(caught.value)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unreachable_server_fails_quickly_and_clearly(storage_servers, tmp_path, protocol):
    # A port nothing listens on (the fixture's free-port probe, never bound afterwards).
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    urls = {
        "http": f"http://127.0.0.1:{port}/x",
        "s3": f"s3://{BUCKET}/x",
        "ftp": f"ftp://127.0.0.1:{port}/x",
    }
    ctx = context(
        storage_servers, retries=0, timeout=5.0, s3_endpoint_url=f"http://127.0.0.1:{port}"
    )
    with pytest.raises(StagingError) as caught:
        backend_for(urls[protocol]).download(urls[protocol], tmp_path / "x", "FILE", ctx)
    message = str(caught.value).lower()
    assert "connect" in message or "refused" in message
    # What a compute node without outbound network meets: told apart from a refusal of the
    # server's (a 404, access denied), for the line that names staging.where.
    assert _no_connection(caught.value)


def test_bad_s3_credentials_are_refused_without_echoing_them(storage_servers, tmp_path):
    wrong = tmp_path / "aws"
    wrong.write_text(
        f"[tes-test]\naws_access_key_id = {storage_servers.s3_key}\n"
        "aws_secret_access_key = not-the-secret-at-all\n"
    )
    storage_servers.put("s3", "creds.txt", b"x")
    ctx = context(storage_servers, s3_credentials_file=str(wrong), retries=0)
    url = f"s3://{BUCKET}/creds.txt"
    with pytest.raises(StagingError, match="access denied") as caught:
        backend_for(url).download(url, tmp_path / "x", "FILE", ctx)
    assert_no_secret(storage_servers, str(caught.value))
    assert "not-the-secret-at-all" not in str(caught.value)


def test_bad_ftp_login_is_refused_and_url_password_redacted(storage_servers, tmp_path):
    url = f"ftp://tesuser:hunter2-secret@127.0.0.1:{storage_servers.ftp_port}/x.txt"
    ctx = context(storage_servers, netrc_file=None)
    with pytest.raises(StagingError, match="login as 'tesuser' refused") as caught:
        backend_for(url).download(url, tmp_path / "x", "FILE", ctx)
    assert "hunter2-secret" not in str(caught.value)


def test_ftp_anonymous_reads_the_public_tree(storage_servers, tmp_path):
    (storage_servers.ftp_root / "pub" / "open.txt").write_text("public\n")
    url = f"{storage_servers.ftp}/open.txt"
    ctx = context(storage_servers, netrc_file=None)
    backend_for(url).download(url, tmp_path / "open.txt", "FILE", ctx)
    assert (tmp_path / "open.txt").read_text() == "public\n"


def test_http_private_needs_the_netrc_login(storage_servers, tmp_path):
    (storage_servers.http_root / "private").mkdir(exist_ok=True)
    (storage_servers.http_root / "private" / "p.txt").write_text("secret data\n")
    url = f"{storage_servers.http}/private/p.txt"
    with pytest.raises(StagingError, match="HTTP 401"):
        backend_for(url).download(
            url, tmp_path / "no", "FILE", context(storage_servers, netrc_file=None)
        )
    backend_for(url).download(url, tmp_path / "yes", "FILE", context(storage_servers))
    assert (tmp_path / "yes").read_text() == "secret data\n"


def test_http_follows_redirects_and_retries_transient_errors(storage_servers, tmp_path):
    (storage_servers.http_root / "r.txt").write_text("moved\n")
    for i, path in enumerate(["redirect/r.txt", "flaky/r.txt"]):
        url = f"{storage_servers.http}/{path}"
        backend_for(url).download(url, tmp_path / str(i), "FILE", context(storage_servers))
        assert (tmp_path / str(i)).read_text() == "moved\n"


def test_http_upload_is_tried_again_after_a_transient_error(storage_servers, tmp_path):
    local = tmp_path / "again.bin"
    local.write_bytes(os.urandom(200_000))
    upload(storage_servers, local, f"{storage_servers.http}/flaky/put/again.bin")
    assert (storage_servers.http_root / "put" / "again.bin").read_bytes() == local.read_bytes()


def test_http_server_errors_are_reported_after_the_retries(storage_servers, tmp_path):
    url = f"{storage_servers.http}/status/502"
    with pytest.raises(StagingError, match="HTTP 502"):
        backend_for(url).download(url, tmp_path / "x", "FILE", context(storage_servers))


def test_http_upload_needs_the_deployment_to_enable_it(storage_servers, tmp_path):
    local = tmp_path / "o.txt"
    local.write_text("o")
    with pytest.raises(StagingError, match=r"staging\.http_upload"):
        upload(storage_servers, local, f"{storage_servers.http}/o.txt", http_upload=False)
    assert not (storage_servers.http_root / "o.txt").exists()


# --------------------------------------------------------------------------- traversal


@pytest.mark.parametrize(
    "url",
    ["s3://tes/a/../../etc/passwd", "s3://tes/./x", "ftp://127.0.0.1:1/a/../../etc/passwd"],
)
def test_dot_dot_in_remote_paths_is_refused(storage_servers, tmp_path, url):
    with pytest.raises(StagingError, match=r"`\.` and `\.\.` are not allowed"):
        backend_for(url).download(url, tmp_path / "x", "FILE", context(storage_servers))


@pytest.mark.parametrize("name", ["../x", "a/../../x", "a//b", "./a", "a/", ""])
def test_listed_names_that_would_climb_out_are_refused(name):
    with pytest.raises(StagingError, match="cannot be placed safely"):
        safe_relative(name, "input")


def test_redact_hides_userinfo_and_signatures():
    text = "GET https://bob:pa55@h/x?X-Amz-Signature=abc&part=1 and ftp://u:p@h/y failed"
    assert redact(text) == (
        "GET https://***@h/x?X-Amz-Signature=***&part=1 and ftp://***@h/y failed"
    )


@pytest.mark.parametrize(
    "url", ["file:///x", "/x", "http://h/x", "https://h/x", "s3://b/k", "ftp://h/x"]
)
def test_every_enabled_scheme_dispatches_to_a_staging_backend(url):
    backend = backend_for(url, StagingContext())
    assert isinstance(backend, StagingBackend)


def test_disabled_protocol_is_refused(storage_servers):
    ctx = StagingContext(options=StagingOptions(enabled=("file", "s3")))
    with pytest.raises(UnsupportedProtocolError, match="not enabled"):
        backend_for("ftp://h/x", ctx)


# --------------------------------------------------------------------------- stage-in/out


class TaskDir:
    """A task directory as the renderer writes it, with the servers' [staging] options."""

    def __init__(self, tmp_path: Path, servers: StorageServers, task: dict[str, Any]) -> None:
        self.layout = TaskLayout(tmp_path / "work" / "t1")
        self.layout.task_dir.mkdir(parents=True, mode=0o700)
        task = {"id": "t1", "executors": [{"image": "x", "command": ["true"]}], **task}
        self.layout.task_json.write_text(json.dumps(task))
        settings = JobSettings(task_id="t1", runtime="sh", staging=dict(servers.staging_options()))
        self.layout.job_config.write_text(settings.to_json())
        self.records = self.layout.records_dir("1")

    def host(self, path: str) -> Path:
        return self.layout.host_path(path)

    def read(self):  # type: ignore[no-untyped-def]
        return read_records(self.layout.task_dir, "1", keep_bytes=1024)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stage_out_uploads_files_trees_and_wildcards(storage_servers, tmp_path, protocol):
    base = f"so-{protocol}"
    task = TaskDir(
        tmp_path,
        storage_servers,
        {
            "outputs": [
                {"path": "/out/one.txt", "url": storage_servers.url_for(protocol, f"{base}/1")},
                {
                    "path": "/out/tree",
                    "url": storage_servers.url_for(protocol, f"{base}/tree"),
                    "type": "DIRECTORY",
                },
                {
                    "path": "/out/w/*.log",
                    "path_prefix": "/out/w",
                    "url": storage_servers.url_for(protocol, f"{base}/logs"),
                },
                {"path": "/out/gone", "url": storage_servers.url_for(protocol, f"{base}/g")},
                {"path": "/out/link", "url": storage_servers.url_for(protocol, f"{base}/l")},
            ]
        },
    )
    files = {
        "/out/one.txt": b"one\n",
        "/out/tree/a.txt": b"a" * 1000,
        "/out/tree/sub/b.txt": b"b\n",
        "/out/w/x.log": b"x\n",
        "/out/w/y.log": os.urandom(70_000),
    }
    for path, data in files.items():
        task.host(path).parent.mkdir(parents=True, exist_ok=True)
        task.host(path).write_bytes(data)
    task.host("/out/w/skip.txt").write_text("not matched")
    # An executor's link to a host file, as an output and inside a tree: never uploaded.
    task.host("/out/link").symlink_to("/etc/hostname")
    task.host("/out/tree/escape").symlink_to("/etc/hostname")

    assert stage_out(task.layout.task_dir, task.records) == STAGE_MISSING_OUTPUTS
    expected = {
        f"{base}/1": files["/out/one.txt"],
        f"{base}/tree/a.txt": files["/out/tree/a.txt"],
        f"{base}/tree/sub/b.txt": files["/out/tree/sub/b.txt"],
        f"{base}/logs/x.log": files["/out/w/x.log"],
        f"{base}/logs/y.log": files["/out/w/y.log"],
    }
    for name, data in expected.items():
        assert storage_servers.server_path(protocol, name).read_bytes() == data, name
    for absent in ("l", "g", "tree/escape", "logs/skip.txt"):
        assert not storage_servers.server_path(protocol, f"{base}/{absent}").exists()
    records = task.read()
    outputs = {o["path"]: o for o in records.outputs}
    assert set(outputs) == set(files)
    for path, data in files.items():
        assert outputs[path]["size_bytes"] == str(len(data))
    assert outputs["/out/w/y.log"]["url"] == storage_servers.url_for(protocol, f"{base}/logs/y.log")
    logs = "\n".join(records.system_logs)
    assert "/out/gone" in logs and "not found after the executors ran" in logs
    assert "/out/link" in logs and "escape is a symbolic link" in logs


def test_file_output_that_is_a_directory_is_uploaded_as_a_tree_to_s3(storage_servers, tmp_path):
    url = storage_servers.url_for("s3", "nf-index/index")
    task = TaskDir(tmp_path, storage_servers, {"outputs": [{"path": "/work/index", "url": url}]})
    task.host("/work/index/sub").mkdir(parents=True)
    task.host("/work/index/a.bin").write_bytes(b"a" * 1000)
    task.host("/work/index/sub/b.txt").write_bytes(b"b\n")
    assert stage_out(task.layout.task_dir, task.records) == STAGE_OK
    assert storage_servers.server_path("s3", "nf-index/index/a.bin").read_bytes() == b"a" * 1000
    assert storage_servers.server_path("s3", "nf-index/index/sub/b.txt").read_bytes() == b"b\n"
    records = task.read()
    assert sorted((o["path"], o["url"], o["size_bytes"]) for o in records.outputs) == [
        ("/work/index/a.bin", f"{url}/a.bin", "1000"),
        ("/work/index/sub/b.txt", f"{url}/sub/b.txt", "2"),
    ]
    assert "uploaded as a directory" in records.system_logs[0]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stage_in_failure_names_the_url_and_leaks_no_secret(storage_servers, tmp_path, protocol):
    storage_servers.put("s3", "ok.txt", b"fine\n")
    url = storage_servers.url_for(protocol, "absent/input.txt")
    task = TaskDir(
        tmp_path,
        storage_servers,
        {
            "inputs": [
                {"path": "/in/ok.txt", "url": f"s3://{BUCKET}/ok.txt"},
                {"path": "/in/missing.txt", "url": url},
            ]
        },
    )
    assert stage_in(task.layout.task_dir, task.records) == STAGE_FAILED
    records = task.read()
    assert len(records.system_logs) == 1  # a missing file is no network trouble: no hint
    assert url in records.system_logs[0] and "/in/missing.txt" in records.system_logs[0]
    assert task.host("/in/ok.txt").read_text() == "fine\n"
    everything = records.system_logs[0] + task.layout.job_config.read_text()
    assert_no_secret(storage_servers, everything)


def test_stage_in_directory_inputs_from_every_listing_protocol(storage_servers, tmp_path):
    for protocol in LISTING:
        storage_servers.put(protocol, "si-tree/s/f.txt", protocol.encode())
    task = TaskDir(
        tmp_path,
        storage_servers,
        {
            "inputs": [
                {
                    "path": f"/in/{p}",
                    "url": storage_servers.url_for(p, "si-tree"),
                    "type": "DIRECTORY",
                }
                for p in LISTING
            ]
        },
    )
    assert stage_in(task.layout.task_dir, task.records) == STAGE_OK, task.read().system_logs
    for protocol in LISTING:
        assert task.host(f"/in/{protocol}/s/f.txt").read_text() == protocol


@pytest.mark.parametrize("check_runtime", [True, False])
def test_an_input_no_connection_reaches_names_the_transfer_setting(
    storage_servers, tmp_path, check_runtime
):
    """Staging in the task's own job (staging.where = "job") on a node that cannot connect: the
    task's system_logs name the setting that moves staging to nodes with network; a stage-in
    job on the transfer partition (check_runtime off) has nothing to suggest."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    task = TaskDir(
        tmp_path,
        storage_servers,
        {"inputs": [{"path": "/in/x", "url": f"http://127.0.0.1:{port}/x"}]},
    )
    settings = JobSettings.from_json(task.layout.job_config.read_text())
    staging = {**settings.staging, "retries": 0, "timeout": 5.0}
    settings = dataclasses.replace(settings, check_runtime=check_runtime, staging=staging)
    task.layout.job_config.write_text(settings.to_json())
    assert stage_in(task.layout.task_dir, task.records) == STAGE_FAILED
    lines = task.read().system_logs
    hint = [line for line in lines if 'staging.where = "transfer"' in line]
    assert len(hint) == (1 if check_runtime else 0), lines
    # An upload alike (its records follow stage-in's in the same job).
    task.layout.task_json.write_text(
        json.dumps(
            {
                "id": "t1",
                "executors": [{"image": "x", "command": ["true"]}],
                "outputs": [{"path": "/out/y", "url": f"http://127.0.0.1:{port}/y"}],
            }
        )
    )
    task.host("/out/y").parent.mkdir(parents=True, exist_ok=True)
    task.host("/out/y").write_text("y\n")
    assert stage_out(task.layout.task_dir, task.records) == STAGE_FAILED
    lines = task.read().system_logs
    assert [line for line in lines if 'staging.where = "transfer"' in line] == hint * 2, lines
