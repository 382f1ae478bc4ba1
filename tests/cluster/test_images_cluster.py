"""The image cache on the real cluster: tags pushed again, registries that go away or stall,
images that do not exist, local SIFs, SIFs pushed to the registry with `apptainer push oras://`.

Images are built from the local cluster's alpine OCI layout with a marker file (umoci) and
pushed with skopeo under `test/images-*` in the local registry. Registry outages are played on a
loopback port of our own in front of the shared registry (closed: connection refused; a socket
that never answers: a stall), so other users of the registry are not disturbed.
"""

from __future__ import annotations

import contextlib
import json
import pwd
import re
import shutil
import socket
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fixtures.service import BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster

#: Small, so a moved tag is seen within the test; the default is 300 s.
REFRESH = 2.0
PULL_TIMEOUT = 6.0
#: Longer than a closed door test keeps its registry away (a few seconds).
GIVE_UP = 25.0


class RegistryDoor:
    """A loopback port forwarding to the registry, which a test can close and open again."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self.open()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        """From now on: connection refused, and open connections are cut."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in self._connections:
            with_suppressed(conn.close)
        self._connections.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with_suppressed(lambda: sink.shutdown(socket.SHUT_WR))


def with_suppressed(call: Any) -> None:
    with contextlib.suppress(OSError):
        call()


@pytest.fixture(scope="module")
def door(local_cluster: Any) -> Iterator[RegistryDoor]:
    door = RegistryDoor(local_cluster.registry)
    yield door
    door.close()


@pytest.fixture(scope="module")
def black_hole() -> Iterator[str]:
    """A listening port that never answers: connections are queued, never served."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)
        yield f"127.0.0.1:{hole.getsockname()[1]}"


@pytest.fixture(scope="module")
def sif_dir(local_cluster: Any) -> Iterator[Path]:
    """A site's directory of local images, holding the cluster's alpine SIF (on the shared
    filesystem: the jobs run it on the compute nodes), inside a parent of its own."""
    parent = local_cluster.shared_path("sifs")
    directory = parent / "allowed"
    directory.mkdir()
    shutil.copy(local_cluster.state_dir / "cache" / "images" / "alpine.sif", directory)
    (directory / "alpine.sif").chmod(0o644)
    yield directory
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def service(
    local_cluster: Any,
    tmp_path_factory: pytest.TempPathFactory,
    door: RegistryDoor,
    black_hole: str,
    sif_dir: Path,
) -> Iterator[BridgeService]:
    with start_bridge_service(
        local_cluster,
        tmp_path_factory.mktemp("bridge-images"),
        container={
            "insecure_registries": [local_cluster.registry, door.address, black_hole],
            "refresh_seconds": REFRESH,
            "pull_timeout_seconds": PULL_TIMEOUT,
            "pull_give_up_seconds": GIVE_UP,
            "local_image_dirs": [str(sif_dir)],
        },
    ) as service:
        yield service


class Publisher:
    """Builds alpine + /marker images and pushes them to the local registry."""

    def __init__(self, local_cluster: Any, root: Path) -> None:
        layouts = sorted((local_cluster.state_dir / "cache" / "images").glob("alpine-oci-*"))
        assert layouts, "the local cluster has no alpine OCI layout"
        self.base = layouts[-1]
        self.root = root
        self.registry = local_cluster.registry

    def push(self, repo_tag: str, marker: str) -> str:
        """Push alpine with `/marker` holding `marker`; returns the manifest digest."""
        work = self.root / uuid.uuid4().hex
        layout = work / "layout"
        shutil.copytree(self.base, layout)
        (work / "marker").write_text(marker)
        run("umoci", "insert", "--image", f"{layout}:latest", str(work / "marker"), "/marker")
        run(
            "skopeo", "copy", "--quiet", "--insecure-policy", "--dest-tls-verify=false",
            f"oci:{layout}:latest", f"docker://{self.registry}/{repo_tag}",
        )  # fmt: skip
        shutil.rmtree(work)
        repo, tag = repo_tag.rsplit(":", 1)
        answer = requests.head(
            f"http://{self.registry}/v2/{repo}/manifests/{tag}",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
            timeout=10,
        )
        answer.raise_for_status()
        return answer.headers["Docker-Content-Digest"]


def run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"


@pytest.fixture(scope="module")
def publisher(local_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Publisher:
    return Publisher(local_cluster, tmp_path_factory.mktemp("oci"))


def cat_marker(image: str) -> dict[str, Any]:
    return {"executors": [{"image": image, "command": ["cat", "/marker"]}]}


def stdout(task: dict[str, Any]) -> str:
    assert task["state"] == "COMPLETE", json.dumps(task, indent=1)[-3000:]
    return task["logs"][-1]["logs"][0]["stdout"]


def images_list(service: BridgeService) -> list[dict[str, Any]]:
    argv = [service.python, "-m", "bridge", "--config", str(service.config_path)]
    proc = subprocess.run(
        [*argv, "images", "list", "--json"],
        env=service.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout)


def system_logs(task: dict[str, Any]) -> list[str]:
    return [line for entry in task.get("logs", []) for line in entry.get("system_logs", [])]


def wait_for_log(service: BridgeService, task_id: str, text: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        task = service.get(task_id)
        if any(text in line for line in system_logs(task)):
            return task
        assert time.monotonic() < deadline, f"no {text!r} in {json.dumps(task)[-2000:]}"
        time.sleep(0.3)


def test_a_tag_pushed_again_is_used_after_the_refresh_interval(
    service: BridgeService, publisher: Publisher, local_cluster: Any
) -> None:
    token = uuid.uuid4().hex[:8]
    tag = "test/images-refresh:latest"
    image = f"{local_cluster.registry}/{tag}"
    first = publisher.push(tag, f"one {token}")
    assert stdout(service.run(cat_marker(image))) == f"one {token}"

    second = publisher.push(tag, f"two {token}")
    assert second != first
    time.sleep(REFRESH + 0.5)
    assert stdout(service.run(cat_marker(image))) == f"two {token}"

    # A digest reference names the first image for good: it is never checked again.
    pinned = f"{local_cluster.registry}/test/images-refresh@{first}"
    assert stdout(service.run(cat_marker(pinned))) == f"one {token}"
    entries = {e["reference"]: e for e in images_list(service)}
    checked = entries[f"docker://{pinned}"]["checked_at"]
    time.sleep(REFRESH + 0.5)
    assert stdout(service.run(cat_marker(pinned))) == f"one {token}"
    entries = {e["reference"]: e for e in images_list(service)}
    assert entries[f"docker://{pinned}"]["checked_at"] == checked
    assert entries[f"docker://{image}"]["digest"] == second
    # Both SIFs are there, named by their digests.
    sifs = {e["sif"] for e in entries.values()}
    assert any(first.split(":")[1][:32] in s for s in sifs)
    assert any(second.split(":")[1][:32] in s for s in sifs)


def test_a_registry_that_is_down_keeps_the_task_queued_until_it_is_back(
    service: BridgeService, publisher: Publisher, door: RegistryDoor
) -> None:
    token = uuid.uuid4().hex[:8]
    publisher.push(f"test/images-door:{token}", f"door {token}")
    door.close()
    try:
        task_id = service.create(cat_marker(f"{door.address}/test/images-door:{token}"))
        task = wait_for_log(service, task_id, "unreachable (connection refused); retrying in")
        assert task["state"] == "QUEUED"
        time.sleep(5)  # a few failed attempts: still waiting, never failed
        assert service.get(task_id)["state"] == "QUEUED"
    finally:
        door.open()
    back = time.monotonic()
    task = service.wait(task_id, timeout=120)
    assert stdout(task) == f"door {token}"
    # Retried soon after the registry answered again (back-off at most 30 s, 8 s here).
    assert time.monotonic() - back < 45
    assert not [line for line in system_logs(task) if line.startswith("pulling image")]


def test_a_misspelled_registry_host_fails_the_task_after_the_give_up_time(
    service: BridgeService,
) -> None:
    """No such host (DNS): the task waits saying so in one line, then ends SYSTEM_ERROR once
    the registry has been unreachable for container.pull_give_up_seconds."""
    task_id = service.create(cat_marker("registry.no-such-host.invalid/test/tool:1"))
    task = wait_for_log(service, task_id, "unreachable (host name not found); retrying in")
    assert task["state"] == "QUEUED"
    started = time.monotonic()
    task = service.wait(task_id, timeout=GIVE_UP + 60)
    assert task["state"] == "SYSTEM_ERROR"
    assert time.monotonic() - started < GIVE_UP + 30
    line = next(line for line in system_logs(task) if "gave up" in line)
    assert "registry registry.no-such-host.invalid unreachable (host name not found)" in line
    assert "(container.pull_give_up_seconds)" in line and "\n" not in line
    assert "urllib3" not in line and "Pool" not in line


def test_a_stalled_registry_times_out_and_says_so(service: BridgeService, black_hole: str) -> None:
    task_id = service.create(cat_marker(f"{black_hole}/test/images-stall:1"))
    task = wait_for_log(
        service, task_id, f"did not answer within {PULL_TIMEOUT:.0f} s", timeout=PULL_TIMEOUT + 30
    )
    assert task["state"] == "QUEUED"
    service.cancel(task_id)


@pytest.mark.parametrize("scheme", ["", "oras://"])
def test_an_image_that_does_not_exist_fails_the_task_with_the_reason(
    service: BridgeService, local_cluster: Any, scheme: str
) -> None:
    image = f"{scheme}{local_cluster.registry}/test/images-refresh:no-such-tag"
    task = service.run(cat_marker(image))
    assert task["state"] == "SYSTEM_ERROR"
    assert any("does not exist" in line for line in system_logs(task)), task


def push_oras(local_cluster: Any, sif: Path, reference: str) -> str:
    """`apptainer push` of a SIF to the local registry as an OCI artifact; its manifest digest."""
    run(local_cluster.apptainer, "push", "--no-https", str(sif), f"oras://{reference}")
    repo, tag = reference.split("/", 1)[1].rsplit(":", 1)
    answer = requests.head(
        f"http://{local_cluster.registry}/v2/{repo}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        timeout=10,
    )
    answer.raise_for_status()
    return answer.headers["Docker-Content-Digest"]


def test_an_oras_image_runs_and_its_tag_pushed_again_is_used_after_the_refresh(
    service: BridgeService, publisher: Publisher, local_cluster: Any, tmp_path: Path
) -> None:
    """A SIF pushed with `apptainer push oras://` runs as an executor's image; its tag is
    checked and pulled again by digest like a Docker image's."""
    token = uuid.uuid4().hex[:8]
    reference = f"{local_cluster.registry}/test/images-oras:{token}"
    image = f"oras://{reference}"
    probe = {"executors": [{"image": image, "command": ["sh", "-c", "cat /marker || echo none"]}]}
    # The cluster's own alpine SIF, as it is: no /marker in it.
    first = push_oras(local_cluster, local_cluster.state_dir / "cache/images/alpine.sif", reference)
    assert stdout(service.run(probe)) == "none\n"

    # Another SIF under the same tag: alpine with a /marker, pulled from the registry to a SIF.
    publisher.push(f"test/images-oras-source:{token}", f"oras {token}")
    marked = tmp_path / "marked.sif"
    source = f"docker://{local_cluster.registry}/test/images-oras-source:{token}"
    run(local_cluster.apptainer, "pull", "--no-https", str(marked), source)
    second = push_oras(local_cluster, marked, reference)
    assert second != first
    time.sleep(REFRESH + 0.5)
    assert stdout(service.run(probe)) == f"oras {token}"
    entries = {e["reference"]: e for e in images_list(service)}
    assert entries[image]["digest"] == second
    assert second.split(":")[1][:32] in entries[image]["sif"]


def test_an_allowed_local_sif_runs_and_others_are_refused(
    service: BridgeService, sif_dir: Path
) -> None:
    image = str(sif_dir / "alpine.sif")
    task = service.run({"executors": [{"image": image, "command": ["echo", "local sif"]}]})
    assert stdout(task) == "local sif\n"
    outside = sif_dir.parent / "outside.sif"
    shutil.copy(sif_dir / "alpine.sif", outside)
    answer = requests.post(
        f"{service.api}/tasks",
        json={"executors": [{"image": str(outside), "command": ["true"]}]},
        timeout=10,
    )
    assert answer.status_code == 400
    assert answer.json()["errors"][0]["field"] == "executors[0].image"


def test_a_full_cache_disk_is_transient_and_the_pull_succeeds_once_there_is_room(
    local_cluster: Any, tmp_path: Path
) -> None:
    from bridge.config import Config
    from bridge.images.cache import ImageCache
    from bridge.images.ref import ImagePullError

    cache_dir = tmp_path / "small"
    cache_dir.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(cache_dir))
    try:
        config = Config.model_validate(
            {
                "state_dir": str(tmp_path / "state"),
                "container": {
                    "runtime": local_cluster.apptainer,
                    "cache_dir": str(cache_dir),
                    "default_registry": local_cluster.registry,
                    "insecure_registries": [local_cluster.registry],
                },
            }
        )
        cache = ImageCache(config)
        with pytest.raises(ImagePullError, match="no space left on device"):
            cache.pull("alpine", timeout=120)
        assert cache.ensure("alpine") is None  # waiting, not failed
        assert "no space left on device" in cache.problem("alpine")
        assert "retrying in" in cache.problem("alpine")
        run("mount", "-o", "remount,size=64m", str(cache_dir))
        deadline = time.monotonic() + 60
        while (path := cache.ensure("alpine")) is None:
            assert time.monotonic() < deadline, cache.problem("alpine")
            time.sleep(0.2)
        assert path.stat().st_size > 0 and cache.problem("alpine") is None
        cache.close()
    finally:
        run("umount", "-l", str(cache_dir))


# --------------------------------------------------------------------------- sandboxes


def test_the_account_runs_executors_from_a_sandbox_unpacked_once(quickstart: Any) -> None:
    """`container.image_format = auto` on the local cluster's disk: each image is unpacked once
    beside its SIF, jobs start from the directory, and an executor cannot change it."""
    from tests.fixtures.quickstart import ACCOUNT

    images = quickstart.state / "images"
    probe = "grep ^ID= /etc/os-release; touch /bin/changed 2>/dev/null && echo WROTE; true"
    first = quickstart.wait(
        quickstart.create({"executors": [{"image": "alpine", "command": ["sh", "-c", probe]}]})
    )
    assert first["state"] == "COMPLETE", json.dumps(first["logs"])
    deadline = time.monotonic() + 120
    while not (sandboxes := [p for p in images.glob("alpine-*.sandbox") if p.is_dir()]):
        assert time.monotonic() < deadline, sorted(p.name for p in images.iterdir())
        time.sleep(0.5)
    (sandbox,) = sandboxes
    assert sandbox.with_suffix(".sif").is_file()
    assert sandbox.stat().st_uid == pwd.getpwnam(ACCOUNT).pw_uid
    assert stat.S_IMODE(sandbox.stat().st_mode) == 0o755
    assert not list(images.glob(".*.tmp"))
    built = sandbox.stat().st_mtime_ns

    second = quickstart.wait(
        quickstart.create({"executors": [{"image": "alpine", "command": ["sh", "-c", probe]}]})
    )
    assert second["state"] == "COMPLETE", json.dumps(second["logs"])
    stdout = second["logs"][-1]["logs"][0]["stdout"]
    assert stdout == first["logs"][-1]["logs"][0]["stdout"] and "WROTE" not in stdout, stdout
    assert re.fullmatch(r"ID=\w+\n", stdout), stdout
    script = (quickstart.state / "work" / second["id"] / "job.sh").read_text()
    assert str(sandbox) in script and str(sandbox.with_suffix(".sif")) not in script
    assert not (sandbox / "bin" / "changed").exists()
    assert sandbox.stat().st_mtime_ns == built  # unpacked once
