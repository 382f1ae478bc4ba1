"""The real server: `tes-bridge serve` under gunicorn, over HTTP, and the py-tes client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pydantictes.api
import pytest
import requests
import tes
from pydantictes import models

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
        # The socket listens before the workers have booted: on a loaded machine the first
        # answer can take longer than the request's timeout.
        except (requests.ConnectionError, requests.Timeout):
            time.sleep(0.1)
    raise AssertionError("server did not answer in time")


def _start(
    state: Path, config: str = "", *, log_path: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """`tes-bridge serve` (2 workers, no poller) on a free port, once it answers; its output
    goes to `log_path` (default: server.log in the state directory)."""
    port = free_port()
    config_path = state / "tes-bridge.toml"
    config_path.write_text(config)
    env = {**os.environ, "TES_BRIDGE_STATE_DIR": str(state)}
    with open(log_path or state / "server.log", "a") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bridge",
                "--config",
                str(config_path),
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
    except AssertionError:
        process.kill()
        raise
    return process, url


def _serve(state: Path, config: str = "") -> Iterator[tuple[str, Path]]:
    process, url = _start(state, config)
    try:
        yield url, state / "server.log"
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    yield from _serve(tmp_path_factory.mktemp("server-state"))


#: Read timeouts of the server that slow clients are tested against.
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    config = (
        f"[server]\nheader_timeout_seconds = {HEADER_TIMEOUT}\n"
        f"body_timeout_seconds = {BODY_TIMEOUT}\n"
    )
    yield from _serve(tmp_path_factory.mktemp("strict-server-state"), config)


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


def test_galaxys_client_pydantic_tes(server):
    """pydantic-tes, the client of Galaxy's Pulsar TES runner: its requests carry
    `Content-Type: application/json` even without a body, its create sends every unset field as
    null, and its models require `name` in service-info and `tasks` in a list."""
    url, _ = server
    client = pydantictes.api.TesClient(f"{url}/ga4gh/tes/")  # it urljoins "v1/tasks"
    info = client.service_info()
    assert info.type.artifact == "tes" and info.name
    executor = models.TesExecutor(image="alpine", command=["true"], workdir="/")
    task = models.TesTask(name="pydantic-tes", executors=[executor], volumes=["/staging/"])
    created = client.create_task(task)
    read = client.get_task(created, "FULL")
    assert read.state == models.TesState.QUEUED and read.volumes == ["/staging"]
    assert created.id in [t.id for t in client.list_tasks().tasks]
    client.cancel_task(created)
    # Its models need `executors`, so it reads MINIMAL views only through lists.
    assert client.get_task(created.id, "FULL").state == models.TesState.CANCELED


def test_a_request_in_progress_is_answered_when_serve_stops(tmp_path):
    """SIGTERM lets the answers being computed go out (within graceful_timeout): a create that
    waits for the database when serve stops is stored and answered, not cut off."""
    import sqlite3

    process, url = _start(tmp_path)
    try:
        # Another connection holds the write lock: the create waits for it (busy timeout).
        blocker = sqlite3.connect(tmp_path / "tes-bridge.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        answers: list[requests.Response | Exception] = []

        def create() -> None:
            try:
                answers.append(requests.post(f"{url}/v1/tasks", json=ECHO, timeout=30))
            except requests.RequestException as exc:
                answers.append(exc)

        thread = threading.Thread(target=create)
        thread.start()
        time.sleep(1)
        process.terminate()  # SIGTERM to gunicorn's master
        time.sleep(3)
        blocker.execute("COMMIT")
        blocker.close()
        thread.join(timeout=30)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert isinstance(answers[0], requests.Response), answers
    assert answers[0].status_code == 200, answers[0].text


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (the suite runs as root), unmounted at the end."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(directory: Path) -> None:
    """Write to a file in `directory` until its filesystem is full (again: appended to, for
    the room SQLite frees when it checkpoints and removes its write-ahead log)."""
    with open(directory / "filler", "ab", buffering=0) as filler:
        with contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * 65536)
        with contextlib.suppress(OSError):
            while True:
                filler.write(b"\0")


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_a_full_state_filesystem_costs_writes_a_503_never_reads_or_a_worker(
    small_disk: Path, tmp_path: Path
):
    """The workers' metrics files are memory-mapped in <state_dir>/metrics: a page the full
    filesystem cannot back once killed each worker with SIGBUS as it started."""
    state = small_disk / "state"
    state.mkdir()
    log = tmp_path / "server.log"  # off the full disk
    process, url = _start(state, log_path=log)
    try:
        task_id = requests.post(f"{url}/v1/tasks", json=ECHO, timeout=10).json()["id"]
        _fill(small_disk)
        for _ in range(2):  # before and after a restart with the disk still full
            for _ in range(20):  # both workers, new metric labels included
                for path in ("/v1/service-info", "/v1/tasks", f"/v1/tasks/{task_id}", "/v1/x"):
                    answer = requests.get(f"{url}{path}", timeout=10)
                    assert answer.status_code == (404 if path == "/v1/x" else 200), path
                big = {"name": "x" * 100_000, **ECHO}  # more than the pages SQLite has free
                _fill(small_disk)
                created = requests.post(f"{url}/v1/tasks", json=big, timeout=10)
                assert created.status_code == 503, created.text
                assert created.json()["code"] == 503 and "full" in created.json()["message"]
                assert int(created.headers["Retry-After"]) > 0
            assert process.poll() is None
            _stop(process)
            text = log.read_text()
            assert "SIGBUS" not in text and "was sent" not in text, text[-3000:]
            process, url = _start(state, log_path=log)
        # The restarted workers could not allocate new files: they keep their values in memory.
        # Unless removing the stopped workers' files (`serve` does as it starts) left room for
        # theirs, as on a loaded machine whose workers had made more of them: then every file
        # is whole, each block allocated (none that a write could fault on).
        if "cannot allocate the metrics file" not in log.read_text():
            for path in (state / "metrics").glob("*.db"):
                assert path.stat().st_blocks * 512 >= path.stat().st_size, path
    finally:
        _stop(process)


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


# ------------------------------------------------------------------------------ raw HTTP
def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (AssertionError if it does
    not within `timeout`)."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        raise AssertionError(
            f"the server kept the connection open; got {received[:200]!r}"
        ) from None
    except ConnectionResetError:
        pass
    return received


def _exchange(url: str, request: bytes, timeout: float = 10) -> tuple[int, dict, float]:
    """Send raw bytes; (status, JSON body, seconds until the server closed)."""
    started = time.monotonic()
    with _connect(url) as sock:
        sock.sendall(request)
        answer = _read_until_closed(sock, timeout)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body), time.monotonic() - started


def _tasks_count(url: str) -> int:
    return len(requests.get(f"{url}/v1/tasks", timeout=5).json().get("tasks", []))


def test_a_chunked_request_body_is_read(server):
    url, _ = server
    body = json.dumps(ECHO).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:]))
    request = (
        b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n"
    )
    status, answer, _ = _exchange(url, request)
    assert status == 200, answer
    assert requests.get(f"{url}/v1/tasks/{answer['id']}", timeout=5).json()["state"] == "QUEUED"


def test_a_body_shorter_than_its_content_length_is_a_400_after_the_body_timeout(strict_server):
    url, _ = strict_server
    before = _tasks_count(url)
    body = json.dumps(ECHO).encode()
    # A complete JSON document, but the client announced more: it is never parsed.
    request = (
        b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body) + 10, body)
    )
    status, answer, seconds = _exchange(url, request)
    assert status == 400 and answer["code"] == 400
    assert "did not arrive" in answer["message"]
    assert BODY_TIMEOUT - 0.5 < seconds < BODY_TIMEOUT + 3
    assert _tasks_count(url) == before


@pytest.mark.parametrize(
    ("what", "request_bytes", "status"),
    [
        ("request line", b"GET /v1/tasks/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n", 414),
        ("headers", b"GET /v1/tasks HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n", 431),
        (
            "body",
            b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n",
            413,
        ),
    ],
)
def test_requests_over_the_size_limits_get_the_json_error_shape(
    server, what, request_bytes, status
):
    url, _ = server
    answer_status, answer, _ = _exchange(url, request_bytes + b"Connection: close\r\n\r\n")
    assert answer_status == status, what
    assert answer["code"] == status, what
    assert "than this server accepts" in answer["message"], what


@pytest.mark.parametrize("chunk_size", [64 * 1024, 32 * 1024 * 1024])
def test_a_chunked_body_over_the_size_limit_gets_the_json_413(server, chunk_size):
    """Tornado answered a bare `400 Bad Request` to a chunked body over max_body_size; whether
    in many chunks or in one chunk announced larger than the limit, it is the JSON 413."""
    url, _ = server
    before = _tasks_count(url)
    chunk = b"%x\r\n%s\r\n" % (chunk_size, b" " * chunk_size)
    head = (
        b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    with _connect(url) as sock:
        sock.sendall(head)
        # Sent until the server answers: it stops reading once over the limit (16 MiB).
        with contextlib.suppress(OSError):
            for _ in range(2 * 16 * 1024 * 1024 // chunk_size + 1):
                sock.sendall(chunk)
        answer = _read_until_closed(sock, 10)
    head_bytes, _, body = answer.partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.1 413 "), answer[:300]
    error = json.loads(body)
    assert error["code"] == 413 and "than this server accepts" in error["message"]
    assert _tasks_count(url) == before


def test_slow_and_idle_clients_neither_delay_requests_nor_stay_connected(strict_server):
    """A hundred clients that trickle their headers byte by byte, trickle a body, or connect
    and wait: a normal request still answers within a second, and every slow connection is
    closed once its read timeout has passed."""
    url, _ = strict_server
    head = b"GET /v1/tasks HTTP/1.1\r\nHost: x\r\n"
    post = b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
    slow: list[socket.socket] = []
    tricklers: list[socket.socket] = []
    for i in range(100):
        sock = _connect(url)
        slow.append(sock)
        if i % 3 == 0:
            sock.sendall(head)
            tricklers.append(sock)
        elif i % 3 == 1:
            sock.sendall(post)
            tricklers.append(sock)
        # else: connected and idle
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.2):
            for sock in tricklers:
                # Closed by the server: what should happen after the timeout.
                with contextlib.suppress(OSError):
                    sock.send(b"a")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        latencies = []
        while time.monotonic() - started < HEADER_TIMEOUT - 0.5:
            begin = time.monotonic()
            assert requests.get(f"{url}/v1/tasks", timeout=5).status_code == 200
            latencies.append(time.monotonic() - begin)
        assert len(latencies) >= 5 and max(latencies) < 1.0, latencies
        # All of them are closed once the read timeouts have passed, trickling or not.
        for sock in slow:
            remaining = started + max(HEADER_TIMEOUT, BODY_TIMEOUT) + 3 - time.monotonic()
            _read_until_closed(sock, max(remaining, 0.1))
    finally:
        stop.set()
        thread.join()
        for sock in slow:
            sock.close()
