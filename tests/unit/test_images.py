"""Image references and the bookkeeping of the SIF cache.

The registry here is a small distribution-API server on loopback whose tags the tests move, stop
and stall; the runtime is a stand-in script that writes the file it is asked for. Real pulls from
the local cluster's registry run in tests/cluster/test_images_cluster.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config
from bridge.core.tes import local_image_problem
from bridge.images.cache import ImageCache
from bridge.images.index import sandbox_of
from bridge.images.ref import ImagePullError
from bridge.images.sandboxes import image_format

FAKE_RUNTIME = """#!{python}
import json, os, subprocess, sys, time
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_PULL_HANG"):
    # A stalled pull that started a helper of its own: both must be killed.
    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["FAKE_PULL_HANG"], "w") as pids:
        pids.write(f"{{os.getpid()}} {{child.pid}}")
    time.sleep(300)
if args[1] == "build":
    # build --sandbox TARGET SIF: a directory that says which SIF it came from.
    time.sleep(float(os.environ.get("FAKE_BUILD_SECONDS", "0.1")))
    if os.path.exists({fail!r} + "-build"):
        print("FATAL: no space left on device", file=sys.stderr)
        sys.exit(255)
    os.makedirs(args[-2])
    with open(os.path.join(args[-2], "from"), "w") as out:
        out.write(open(args[-1]).read())
    sys.exit(0)
time.sleep(float(os.environ.get("FAKE_PULL_SECONDS", "0.3")))
if os.path.exists({fail!r}):
    print(open({fail!r}).read() or "FATAL: manifest unknown", file=sys.stderr)
    sys.exit(255)
name = args[args.index("--name") + 1]
with open(name, "w") as out:
    out.write("SIF " + args[-1] + os.environ.get("FAKE_PULL_CONTENT", ""))
"""


@pytest.fixture
def runtime(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "bin": tmp_path / "bin" / "apptainer",
        "log": tmp_path / "pulls.log",
        "fail": tmp_path / "fail-pulls",
    }
    paths["bin"].parent.mkdir()
    paths["bin"].write_text(
        FAKE_RUNTIME.format(python=sys.executable, log=str(paths["log"]), fail=str(paths["fail"]))
    )
    paths["bin"].chmod(0o755)
    return paths


class Registry:
    """Answers `HEAD /v2/<name>/manifests/<tag>` with the digest a test gives the tag."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.status = 200
        self.requests: list[str] = []
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                registry.requests.append(self.path)
                ref = self.path.removeprefix("/v2/").replace("/manifests/", ":")
                digest = registry.tags.get(ref)
                status = registry.status if registry.status != 200 else (200 if digest else 404)
                self.send_response(status)
                if status == 200 and digest:
                    self.send_header("Docker-Content-Digest", digest)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def push(self, ref: str, content: str) -> str:
        self.tags[ref] = "sha256:" + hashlib.sha256(content.encode()).hexdigest()
        return self.tags[ref]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def registry() -> Iterator[Registry]:
    server = Registry()
    for ref in ("library/alpine:latest", "library/alpine:3", "library/python:3-slim"):
        server.push(ref, ref)
    yield server
    server.stop()


def make_cache(
    tmp_path: Path,
    runtime: dict[str, Path],
    registry: Registry | str = "127.0.0.1:5000",
    container: dict[str, Any] | None = None,
    **kwargs: Any,
) -> ImageCache:
    address = registry if isinstance(registry, str) else registry.address
    config = Config.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "container": {
                "runtime": str(runtime["bin"]),
                "default_registry": address,
                "insecure_registries": [address],
                # The SIF bookkeeping; sandboxes have tests of their own below.
                "image_format": "sif",
                **(container or {}),
            },
        }
    )
    return ImageCache(config, **kwargs)


def pulls(runtime: dict[str, Path]) -> list[list[str]]:
    if not runtime["log"].exists():
        return []
    return [json.loads(line) for line in runtime["log"].read_text().splitlines()]


def wait_for(predicate: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("alpine", "docker://127.0.0.1:5000/library/alpine:latest"),
        ("ubuntu:22.04", "docker://127.0.0.1:5000/library/ubuntu:22.04"),
        ("biocontainers/samtools:1.9", "docker://127.0.0.1:5000/biocontainers/samtools:1.9"),
        ("quay.io/org/img:tag", "docker://quay.io/org/img:tag"),
        ("docker://alpine", "docker://127.0.0.1:5000/library/alpine:latest"),
        ("docker://docker.io/ubuntu", "docker://docker.io/library/ubuntu:latest"),
        ("localhost:5000/x/y", "docker://localhost:5000/x/y:latest"),
        ("oras://ghcr.io/org/img:1", "oras://ghcr.io/org/img:1"),
        ("library://sylabs/default/alpine:3", "library://sylabs/default/alpine:3"),
        ("/images/tool.sif", "/images/tool.sif"),
        (
            "alpine@sha256:" + "a" * 64,
            "docker://127.0.0.1:5000/library/alpine@sha256:" + "a" * 64,
        ),
    ],
)
def test_normalize(tmp_path: Path, runtime: dict[str, Path], image: str, expected: str) -> None:
    assert make_cache(tmp_path, runtime).normalize(image) == expected


def test_docker_hub_is_the_usual_default(tmp_path: Path) -> None:
    cache = ImageCache(Config.model_validate({"state_dir": str(tmp_path)}))
    assert cache.normalize("alpine") == "docker://docker.io/library/alpine:latest"
    assert cache.normalize("ghcr.io/a/b") == "docker://ghcr.io/a/b:latest"


@pytest.mark.parametrize(
    "image",
    ["", " alpine", "Alpine", "alpine;id", "alpine:", "a b", "x://y", "/etc/shadow", "/a/../b.sif"],
)
def test_invalid_references_are_refused(
    tmp_path: Path, runtime: dict[str, Path], image: str
) -> None:
    with pytest.raises(ImagePullError):
        make_cache(tmp_path, runtime).normalize(image)


def test_sif_names_are_content_addressed(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    cache = make_cache(tmp_path, runtime, registry)
    assert cache.key("alpine") == cache.key(f"docker://{registry.address}/library/alpine:latest")
    assert cache.key("alpine") != cache.key("alpine:3")
    # Two tags of one digest share the file; the name shows the image and its digest.
    a = cache.pull("alpine", timeout=30)
    registry.tags["library/alpine:3"] = registry.tags["library/alpine:latest"]
    b = cache.pull("alpine:3", timeout=30)
    digest = registry.tags["library/alpine:latest"].split(":")[1]
    assert a == b and a.name == f"alpine-{digest[:32]}.sif"
    assert len(pulls(runtime)) == 1


def test_ensure_pulls_once_in_the_background_then_returns_the_sif(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    cache = make_cache(tmp_path, runtime, registry)
    started = time.monotonic()
    assert cache.ensure("alpine") is None
    assert time.monotonic() - started < 0.2  # never waits for the pull
    assert cache.ensure("docker://alpine") is None  # same image: no second pull
    path = cache.pull("alpine", timeout=30)
    digest = registry.tags["library/alpine:latest"]
    # Pulled by the digest that was checked, so the SIF is exactly that image.
    assert path.read_text() == f"SIF docker://{registry.address}/library/alpine@{digest}"
    assert cache.ensure("alpine") == path
    assert len(pulls(runtime)) == 1
    args = pulls(runtime)[0]
    assert args[args.index("pull") + 1] == "--no-https"  # the registry is insecure
    assert [e.digest for e in cache.entries()] == [digest]


def test_concurrent_callers_start_one_pull(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    cache = make_cache(tmp_path, runtime, registry)
    threads = [threading.Thread(target=cache.ensure, args=("alpine",)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cache.pull("alpine", timeout=30)
    assert len(pulls(runtime)) == 1


def test_two_processes_never_pull_the_same_image_at_once(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    # Another process (another cache object holding the lock file) pulls the same image.
    code = (
        "import sys; from bridge.config import Config; from bridge.images.cache import ImageCache; "
        f"c = ImageCache(Config.model_validate({{'state_dir': {str(tmp_path / 'state')!r}, "
        f"'container': {{'runtime': {str(runtime['bin'])!r}, "
        f"'default_registry': {registry.address!r}, "
        f"'insecure_registries': [{registry.address!r}], 'image_format': 'sif'}}}})); "
        "print(c.pull('alpine', timeout=30))"
    )
    repo = Path(__file__).resolve().parents[2]
    other = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo), "FAKE_PULL_SECONDS": "1.5"},
    )
    wait_for(lambda: runtime["log"].exists())
    cache = make_cache(tmp_path, runtime, registry)
    path = cache.pull("alpine", timeout=30)
    assert other.communicate(timeout=30)[0].strip() == str(path)
    assert len(pulls(runtime)) == 1


def test_a_moved_tag_is_pulled_again_after_the_refresh_interval(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    cache = make_cache(tmp_path, runtime, registry, {"refresh_seconds": 1})
    first = cache.pull("alpine", timeout=30)
    pinned = f"alpine@{registry.tags['library/alpine:latest']}"
    assert cache.pull(pinned, timeout=30) == first  # same content: no second pull
    assert len(pulls(runtime)) == 1

    registry.push("library/alpine:latest", "a new alpine")
    assert cache.ensure("alpine") == first  # within the refresh interval: cached
    time.sleep(1.1)
    assert cache.ensure("alpine") is None  # checked again: the task waits for it
    second = wait_for(lambda: cache.ensure("alpine"))
    assert second != first and "a new alpine" not in second.name
    assert registry.tags["library/alpine:latest"].split(":")[1][:32] in second.name
    assert first.is_file()  # jobs submitted before may still use it
    assert len(pulls(runtime)) == 2

    # The same digest again: checked, not pulled.
    time.sleep(1.1)
    assert cache.ensure("alpine") is None
    assert wait_for(lambda: cache.ensure("alpine")) == second
    assert len(pulls(runtime)) == 2

    # A digest reference is never checked again.
    checks = len(registry.requests)
    time.sleep(1.1)
    assert cache.ensure(pinned) == first
    assert len(registry.requests) == checks


def test_an_oras_tag_is_checked_pulled_by_digest_and_refreshed_as_a_docker_one(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    image = f"oras://{registry.address}/sifs/tool:1"
    first_digest = registry.push("sifs/tool:1", "one")
    cache = make_cache(tmp_path, runtime, registry, {"refresh_seconds": 1})
    first = cache.pull(image, timeout=30)
    assert first.read_text() == f"SIF oras://{registry.address}/sifs/tool@{first_digest}"
    assert first_digest.split(":")[1][:32] in first.name
    second_digest = registry.push("sifs/tool:1", "two")
    assert cache.ensure(image) == first  # within the refresh interval
    time.sleep(1.1)
    assert cache.ensure(image) is None
    second = wait_for(lambda: cache.ensure(image))
    assert second_digest.split(":")[1][:32] in second.name and first.is_file()
    assert [p[-1] for p in pulls(runtime)] == [
        f"oras://{registry.address}/sifs/tool@{first_digest}",
        f"oras://{registry.address}/sifs/tool@{second_digest}",
    ]


def test_a_library_image_is_pulled_again_after_the_refresh_interval_and_named_by_its_content(
    tmp_path: Path, runtime: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """library:// has no registry to ask for a digest: the runtime pulls it again after
    container.refresh_seconds (from its own cache when the library's image is the same), and
    the SIF is named by its content, so a changed image gets a new file as a moved tag does."""
    image = "library://sylabs/default/alpine:3"
    cache = make_cache(tmp_path, runtime, container={"refresh_seconds": 1})
    first = cache.pull(image, timeout=30)
    content = hashlib.sha256(first.read_bytes()).hexdigest()
    assert first.name == f"alpine-{content[:32]}.sif"
    (entry,) = cache.entries()
    assert entry.digest == f"sha256:{content}" and entry.sif == first.name
    assert cache.ensure(image) == first and len(pulls(runtime)) == 1  # fresh: not pulled

    time.sleep(1.1)
    assert cache.ensure(image) is None  # pulled again: the same image, the same file
    assert wait_for(lambda: cache.ensure(image)) == first
    assert len(pulls(runtime)) == 2 and sorted(p.name for p in first.parent.glob("*.sif")) == [
        first.name
    ]

    monkeypatch.setenv("FAKE_PULL_CONTENT", " changed")  # the library's image changed
    time.sleep(1.1)
    assert cache.ensure(image) is None
    second = wait_for(lambda: cache.ensure(image))
    assert second != first and second.read_text().endswith(" changed") and first.is_file()

    # Pinned by its hash: never pulled again.
    pinned = f"library://sylabs/default/alpine:sha256.{content}"
    cache.pull(pinned, timeout=30)
    pulled = len(pulls(runtime))
    time.sleep(1.1)
    assert cache.ensure(pinned) is not None and len(pulls(runtime)) == pulled
    assert not list(first.parent.glob(".*pulled*"))


def test_a_library_that_cannot_be_reached_is_waited_for_then_given_up_on(
    tmp_path: Path, runtime: dict[str, Path]
) -> None:
    """What Apptainer 1.4 says when the library's host is unknown (seen on the local cluster):
    transient, then given up on after container.pull_give_up_seconds, like a registry."""
    runtime["fail"].write_text(
        "FATAL:   While pulling library image: error fetching image: error making request to "
        'server:\n\tGet "https://library.invalid/v1/images/alpine:3?arch=amd64": dial tcp: '
        "lookup library.invalid on 10.255.255.53:53: no such host"
    )
    image = "library://library.invalid/sylabs/default/alpine:3"
    cache = make_cache(tmp_path, runtime, container={"pull_give_up_seconds": 2})
    assert cache.ensure(image) is None

    def retrying() -> str | None:
        cache.ensure(image)
        problem = cache.problem(image)
        return problem if problem and "retrying" in problem else None

    assert "no such host" in wait_for(retrying)

    def gave_up() -> str | None:
        try:
            cache.ensure(image)
        except ImagePullError as exc:
            return exc.reason
        return None

    reason = wait_for(gave_up, timeout=15)
    assert "no such host" in reason
    assert reason.endswith("(container.pull_give_up_seconds)")


def test_a_missing_tag_fails_at_once_and_is_looked_up_again_after_the_ttl(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    cache = make_cache(tmp_path, runtime, registry, failure_ttl=60)
    with pytest.raises(ImagePullError, match="does not exist") as info:
        cache.pull("alpine:missing", timeout=30)
    assert "404" in info.value.reason
    for _ in range(3):
        with pytest.raises(ImagePullError, match="does not exist"):
            cache.ensure("alpine:missing")
    assert len(registry.requests) == 1 and pulls(runtime) == []

    registry.push("library/alpine:missing", "now it exists")
    cache.jobs.failure_ttl = 0
    assert cache.pull("alpine:missing", timeout=30).is_file()


def test_a_runtime_error_that_is_not_transient_fails_the_image(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    runtime["fail"].write_text("FATAL: While making image from oci registry: manifest unknown")
    cache = make_cache(tmp_path, runtime, registry)
    with pytest.raises(ImagePullError, match="manifest unknown") as info:
        cache.pull("alpine", timeout=30)
    assert "exited 255" in info.value.reason
    assert not list((tmp_path / "state" / "images").glob("*.sif"))


@pytest.mark.parametrize(
    ("trouble", "expected"),
    [
        ("503", "answered 503"),
        ("down", "unreachable (connection refused)"),
        ("full disk", "no space left on device"),
    ],
)
def test_transient_failures_keep_the_task_waiting_and_retry_soon(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry, trouble: str, expected: str
) -> None:
    woken = threading.Event()
    address: Registry | str = registry
    if trouble == "503":
        registry.status = 503
    elif trouble == "down":
        with socket.socket() as sock:  # a loopback port nobody listens on
            sock.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{sock.getsockname()[1]}"
    else:
        runtime["fail"].write_text("FATAL: write /cache/x: no space left on device")
    cache = make_cache(tmp_path, runtime, address, on_pulled=woken.set)
    assert cache.ensure("alpine") is None
    assert woken.wait(10)
    problem = wait_for(lambda: cache.ensure("alpine") is None and cache.problem("alpine"))
    assert problem.startswith("pulling image alpine: ") and expected in problem
    assert problem.endswith("; retrying in 2 s")
    assert cache.problem("alpine") == problem  # stable until the next attempt
    with pytest.raises(ImagePullError, match=re.escape(expected)):
        cache.pull("alpine", timeout=30, check=True)
    # The back-off grows while the trouble lasts.
    assert cache.problem("alpine").endswith("; retrying in 4 s")

    if trouble == "down":
        return  # nothing comes back on that port
    registry.status = 200
    runtime["fail"].unlink(missing_ok=True)
    started = time.monotonic()
    path = wait_for(lambda: cache.ensure("alpine"), timeout=15)
    assert path.is_file() and time.monotonic() - started < 6
    assert cache.problem("alpine") is None


def test_a_pull_in_progress_is_said_from_the_start(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stalled pull can last container.pull_timeout_seconds: the waiting task says so at once,
    in words that stay the same while it lasts (stored once, not every cycle)."""
    monkeypatch.setenv("FAKE_PULL_SECONDS", "3")
    cache = make_cache(tmp_path, runtime, registry)
    before = time.time()
    assert cache.ensure("alpine") is None
    problem = wait_for(lambda: cache.problem("alpine"), timeout=5)
    assert problem.startswith("waiting: pulling image alpine (started ")
    started = datetime.fromisoformat(problem.split("(started ")[1].rstrip(")"))
    assert before - 1 <= started.timestamp() <= time.time()
    assert cache.problem("alpine") == problem
    wait_for(lambda: cache.ensure("alpine"), timeout=20)
    assert cache.problem("alpine") is None


def test_a_stalled_registry_times_out(tmp_path: Path, runtime: dict[str, Path]) -> None:
    with socket.socket() as hole:  # accepts connections (backlog) and never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        address = f"127.0.0.1:{hole.getsockname()[1]}"
        cache = make_cache(tmp_path, runtime, address, {"pull_timeout_seconds": 1})
        started = time.monotonic()
        with pytest.raises(ImagePullError, match="did not answer within 1 s"):
            cache.pull("alpine", timeout=30)
        assert time.monotonic() - started < 5
        assert "did not answer" in cache.problem("alpine")


def test_a_stalled_pull_is_killed_with_its_children(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("FAKE_PULL_HANG", str(pids_file))
    # Time enough for the fake to start its helper on a loaded machine before it is killed.
    cache = make_cache(tmp_path, runtime, registry, {"pull_timeout_seconds": 4})
    with pytest.raises(ImagePullError, match=r"stalled.*killed"):
        cache.pull("alpine", timeout=30)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2

    def dead(pid: int) -> bool:
        # Gone, or at most a zombie of an exited parent about to be reaped by init. SIGKILL
        # is delivered asynchronously: a loaded machine may take a moment to end the helper.
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
        except FileNotFoundError:
            return True

    for pid in pids:
        wait_for(lambda pid=pid: dead(pid), timeout=10)


def test_the_cached_sif_serves_while_the_registry_cannot_be_reached(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    cache = make_cache(tmp_path, runtime, registry, {"refresh_seconds": 1})
    path = cache.pull("alpine", timeout=30)
    registry.status = 503
    time.sleep(1.1)
    assert cache.ensure("alpine") is None  # the check runs; the task waits for it
    assert wait_for(lambda: cache.ensure("alpine")) == path
    assert "answered 503" in cache.problem("alpine")


def test_the_done_callback_cannot_deadlock_ensure(tmp_path: Path) -> None:
    # A job that ends before ensure() adds its callback runs the callback in ensure's thread;
    # with the missing runtime the job ends at once. This hung in 6 of 10 runs.
    config = Config.model_validate(
        {"state_dir": str(tmp_path), "container": {"runtime": "no-such-apptainer"}}
    )
    for _ in range(50):
        cache = ImageCache(config, on_pulled=lambda: None)
        outcome: list[BaseException] = []

        def run(cache: ImageCache = cache, outcome: list[BaseException] = outcome) -> None:
            try:
                cache.pull("alpine", timeout=10)
            except ImagePullError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "ensure() deadlocked"
        assert outcome and "container.runtime" in str(outcome[0])
        cache.close()


def test_missing_runtime_is_a_pull_error_that_says_how_to_fix_it(tmp_path: Path) -> None:
    config = Config.model_validate(
        {"state_dir": str(tmp_path), "container": {"runtime": "no-such-apptainer"}}
    )
    with pytest.raises(ImagePullError, match=r"container\.runtime"):
        ImageCache(config).pull("alpine", timeout=10)


def test_local_sifs_only_from_the_configured_directories(
    tmp_path: Path, runtime: dict[str, Path]
) -> None:
    images = tmp_path / "images"
    images.mkdir()
    sif = images / "tool.sif"
    sif.write_text("x")
    outside = tmp_path / "secret.sif"
    outside.write_text("y")
    (images / "escape.sif").symlink_to(outside)
    (images / "inner.sif").symlink_to(sif)
    cache = make_cache(tmp_path, runtime, container={"local_image_dirs": [str(images)]})
    assert cache.ensure(str(sif)) == sif
    assert cache.ensure(str(images / "inner.sif")) == sif  # a link inside the directory
    for image, reason in [
        (outside, "must be a .sif file under"),
        (images / "escape.sif", "leads out of"),
        (images / "missing.sif", "does not exist"),
    ]:
        with pytest.raises(ImagePullError, match=reason):
            cache.ensure(str(image))
    assert pulls(runtime) == []
    nothing = make_cache(tmp_path, runtime)
    with pytest.raises(ImagePullError, match="disabled"):
        nothing.ensure(str(sif))
    assert local_image_problem("/a/../b.sif", [str(images)]) is not None


def test_resolve_maps_every_image_once_all_are_ready(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    cache = make_cache(tmp_path, runtime, registry)
    assert cache.resolve(["alpine", "alpine", "python:3-slim"]) is None
    cache.pull("alpine", timeout=30)
    cache.pull("python:3-slim", timeout=30)
    paths = cache.resolve(["alpine", "python:3-slim"])
    assert paths is not None and set(paths) == {"alpine", "python:3-slim"}
    assert all(Path(p).is_file() for p in paths.values())


def test_forget_and_prune_keep_what_unfinished_tasks_may_use(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    cache = make_cache(tmp_path, runtime, registry, {"refresh_seconds": 1})
    old = cache.pull("alpine", timeout=30)
    registry.push("library/alpine:latest", "newer")
    new = cache.pull("alpine", timeout=30, check=True)
    assert new != old
    task_created = time.time()  # a task created while the old SIF was current
    time.sleep(0.05)
    deleted, kept = cache.prune(oldest_unfinished=task_created)
    assert deleted == [] and kept == [old]
    deleted, kept = cache.prune(oldest_unfinished=task_created)
    assert deleted == [] and kept == [old]  # that task may still run with it
    deleted, kept = cache.prune(oldest_unfinished=None)
    assert deleted == [old] and new.is_file()

    assert cache.forget("alpine") and not cache.entries()
    assert cache.prune(oldest_unfinished=None) == ([], [new])  # unused from now on
    assert cache.prune(oldest_unfinished=time.time() + 1) == ([new], [])
    assert cache.ensure("alpine") is None  # forgotten: looked up and pulled again
    assert wait_for(lambda: cache.ensure("alpine")) == new
    assert not cache.forget("alpine:3")


def test_images_commands_list_pull_and_forget(
    tmp_path: Path,
    runtime: dict[str, Path],
    registry: Registry,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bridge.cli.main import main

    config = tmp_path / "tes-bridge.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[container]\nruntime = "{runtime["bin"]}"\n'
        f'default_registry = "{registry.address}"\ninsecure_registries = ["{registry.address}"]\n'
    )
    base = ["--config", str(config), "images"]
    assert main([*base, "pull", "alpine", "alpine:nope"]) == 1
    out, err = capsys.readouterr()
    # The image's sandbox: `auto` unpacks images on a local filesystem such as tmp_path's.
    assert out.startswith("alpine: ") and out.strip().endswith(".sandbox"), out
    assert "alpine:nope" in err and "does not exist" in err
    assert main([*base, "pull", "alpine"]) == 0  # checked again, same digest: no pull
    assert len([call for call in pulls(runtime) if call[1] == "pull"]) == 1
    capsys.readouterr()
    assert main([*base, "list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr()[0])
    assert row["digest"] == registry.tags["library/alpine:latest"] and row["size"] > 0
    assert row["sandbox"] == row["path"].removesuffix(".sif") + ".sandbox"
    assert main([*base, "list"]) == 0
    assert "library/alpine:latest" in capsys.readouterr()[0]

    assert main([*base, "forget", "alpine"]) == 0
    out = capsys.readouterr()[0]
    assert "alpine: forgotten" in out and "kept " in out  # unused only from now on
    assert main([*base, "forget", "alpine"]) == 0
    out = capsys.readouterr()[0]
    assert "not in the cache" in out and "removed " in out  # no unfinished task: gone
    assert not list((tmp_path / "state" / "images").glob("*.sif"))


def test_a_pull_dies_with_the_process_that_started_it(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> None:
    # kill -9 of the poller mid-pull: the runtime it started must not pull on as an orphan.
    pids_file = tmp_path / "pids"
    code = (
        "import time; from bridge.config import Config; "
        "from bridge.images.cache import ImageCache; "
        f"c = ImageCache(Config.model_validate({{'state_dir': {str(tmp_path / 'state')!r}, "
        f"'container': {{'runtime': {str(runtime['bin'])!r}, "
        f"'default_registry': {registry.address!r}, "
        f"'insecure_registries': [{registry.address!r}]}}}})); "
        "c.ensure('alpine'); time.sleep(300)"
    )
    repo = Path(__file__).resolve().parents[2]
    poller = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=repo,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo), "FAKE_PULL_HANG": str(pids_file)},
    )
    try:
        pids = wait_for(lambda: pids_file.exists() and pids_file.read_text().split())
        pull = int(pids[0])
        poller.kill()
        poller.wait(timeout=10)
        wait_for(lambda: not alive(pull), timeout=10)
    finally:
        poller.kill()
        if pids_file.exists() and len(pids_file.read_text().split()) == 2:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pids_file.read_text().split()[1]), signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


# --- sandboxes ----------------------------------------------------------------------------------


def builds(runtime: dict[str, Path]) -> list[list[str]]:
    return [call for call in pulls(runtime) if call[1] == "build"]


@pytest.fixture
def sandbox_cache(
    tmp_path: Path, runtime: dict[str, Path], registry: Registry
) -> Iterator[ImageCache]:
    cache = make_cache(tmp_path, runtime, registry, {"image_format": "sandbox"})
    yield cache
    cache.close()


def test_a_sandbox_is_unpacked_once_in_the_background_and_the_sif_serves_meanwhile(
    sandbox_cache: ImageCache, runtime: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_BUILD_SECONDS", "1")
    cache = sandbox_cache
    sif = cache.pull("alpine")
    assert sif.is_dir() and sif == sandbox_of(sif.with_suffix(".sif"))  # pull() waits
    assert (sif / "from").read_text() == (sif.with_suffix(".sif")).read_text()
    # A second image: ensure() never waits for the unpacking; the SIF runs meanwhile.
    wait_for(lambda: cache.ensure("python:3-slim"))
    first = cache.ensure("python:3-slim")
    assert first is not None and first.suffix == ".sif"
    for _ in range(20):
        assert cache.ensure("python:3-slim") in (first, sandbox_of(first))
    ready = wait_for(lambda: (p := cache.ensure("python:3-slim")) != first and p)
    assert ready == sandbox_of(first) and ready.is_dir()
    assert len(builds(runtime)) == 2  # one a SIF, however often it was asked for
    assert not list(cache.cache_dir.glob(".*.tmp"))
    assert oct(ready.stat().st_mode & 0o777) == oct(0o755)


def test_a_failed_unpacking_leaves_nothing_and_the_sif_keeps_serving(
    sandbox_cache: ImageCache, runtime: dict[str, Path]
) -> None:
    Path(str(runtime["fail"]) + "-build").touch()
    sif = sandbox_cache.pull("alpine")
    assert sif.suffix == ".sif" and sif.is_file()
    assert sandbox_cache.ensure("alpine") == sif
    time.sleep(0.5)
    assert sandbox_cache.ensure("alpine") == sif
    # Tried once by pull(), once in the background; not again before RETRY_SECONDS.
    assert len(builds(runtime)) == 2
    assert not sandbox_of(sif).exists() and not list(sandbox_cache.cache_dir.glob(".*.tmp"))


def test_a_half_built_sandbox_is_never_used_and_prune_clears_sandboxes(
    sandbox_cache: ImageCache,
) -> None:
    cache = sandbox_cache
    sif = cache.pull("alpine", check=True).with_suffix(".sif")
    sandbox = sandbox_of(sif)
    shutil.rmtree(sandbox)
    # What a build killed halfway leaves: a temporary name, never the sandbox's own.
    leftover = sif.with_name(f".{sandbox.name}.999.1.tmp")
    leftover.mkdir()
    assert cache.ensure("alpine") == sif
    wait_for(lambda: sandbox.is_dir())
    assert cache.ensure("alpine") == sandbox
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))
    stray = sif.with_name("gone-0123.sandbox")  # its SIF was removed
    stray.mkdir()
    assert cache.prune(oldest_unfinished=None) == ([], [])
    assert not leftover.exists() and not stray.exists() and sandbox.is_dir()
    cache.forget("alpine")
    cache.prune(oldest_unfinished=None)  # marks the SIF unused
    assert cache.prune(oldest_unfinished=None) == ([sif], [])
    assert not sandbox.exists() and not sif.exists()


def test_auto_unpacks_on_a_local_filesystem_outside_site_mode(tmp_path: Path) -> None:
    def config(cache_dir: Path, **extra: Any) -> Config:
        return Config.model_validate(
            {
                "state_dir": str(tmp_path / "state"),
                "container": {"cache_dir": str(cache_dir)},
                **extra,
            }
        )

    kind, why = image_format(config(tmp_path / "images"))
    assert kind == "sandbox" and "local filesystem" in why, why
    # /proc stands in for a filesystem that is not a local disk (NFS, Lustre, ...).
    kind, why = image_format(config(Path("/proc/no/such/cache")))
    assert kind == "sif" and "proc" in why, why
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text("")
    site = {
        "site": {"run_as_owner": True},
        "auth": {"mode": "basic", "htpasswd_file": str(htpasswd)},
    }
    kind, why = image_format(config(tmp_path / "images", **site))
    assert kind == "sif" and "site mode" in why
    with pytest.raises(ValueError, match="image_format"):
        Config.model_validate(
            {"state_dir": str(tmp_path), "container": {"image_format": "sandbox"}, **site}
        )


def test_an_unknown_registry_host_fails_its_tasks_after_the_give_up_time(
    tmp_path: Path, runtime: dict[str, Path]
) -> None:
    """A misspelled registry host (DNS) waits with a one-line reason naming the host, then,
    after container.pull_give_up_seconds, fails the task with the setting named."""
    host = "no-such-registry.invalid"
    cache = make_cache(tmp_path, runtime, host, {"pull_give_up_seconds": 2})
    assert cache.ensure(f"{host}/tool:1") is None
    image = f"{host}/tool:1"

    def retrying() -> str | None:
        cache.ensure(image)
        problem = cache.problem(image)
        return problem if problem and "retrying" in problem else None

    problem = wait_for(retrying)
    assert problem == (
        f"pulling image {host}/tool:1: registry {host} unreachable (host name not found); "
        "retrying in 2 s"
    )
    assert "\n" not in problem and "urllib3" not in problem and "Pool" not in problem

    def gave_up() -> str | None:
        try:
            cache.ensure(f"{host}/tool:1")
        except ImagePullError as exc:
            return exc.reason
        return None

    reason = wait_for(gave_up, timeout=15)
    assert reason.startswith(f"registry {host} unreachable (host name not found) since ")
    assert reason.endswith("; gave up after 2 s (container.pull_give_up_seconds)")
