"""`tes-bridge task`: the command-line client, run as a user runs it (its own process, real
exit codes) against the real server under gunicorn (API only: states and logs that the poller
would write are written into the store here)."""

from __future__ import annotations

import json
import os
import pty
import select
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from bridge.client.cli import build_parser
from bridge.client.watch import new_text
from bridge.store import Store
from tests.fixtures.auth import (
    OIDC,
    PASSWORDS,
    basic_auth_toml,
    bearer_auth_toml,
    write_htpasswd,
)
from tests.fixtures.service import serve_api_only
from tests.tes_cli import TES_TASK, client_env, follow_logs, tes_task

ALPINE = {"executors": [{"image": "alpine", "command": ["true"]}]}
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    state_dir: Path

    @property
    def api(self) -> str:
        return f"{self.url}/ga4gh/tes/v1"

    def task(self, task_id: str, view: str = "FULL") -> dict[str, Any]:
        answer = requests.get(f"{self.api}/tasks/{task_id}", params={"view": view}, timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def create(self, **fields: Any) -> str:
        answer = requests.post(f"{self.api}/tasks", json={**ALPINE, **fields}, timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()["id"]

    def update(self, task_id: str, **changes: Any) -> None:
        """What the poller would record: a state, logs."""
        store = Store.from_url(f"sqlite:///{self.state_dir / 'tes-bridge.db'}")
        try:
            assert store.update_task(task_id, **changes)
        finally:
            store.db.close()


def serve(root: Path, auth_toml: str = "") -> Iterator[Server]:
    with serve_api_only(root, auth_toml) as url:
        yield Server(url, root / "state")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve(tmp_path_factory.mktemp("client"))


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------------------ create
def test_run_creates_the_task_its_options_describe(server: Server):
    name = unique("run")
    result = tes_task(
        server.url,
        "run",
        "--name",
        name,
        "--workdir",
        "/work",
        "--input",
        "https://example.org/get?a=1&b=2=/data/in.txt",
        "--input",
        "s3://bucket/refs/=/data/refs/",
        "--output",
        "/data/out.txt=s3://bucket/out.txt",
        "--cpus",
        "2",
        "--ram",
        "1.5",
        "--disk",
        "3",
        "--env",
        "GREETING=a=b",
        "--tag",
        "project=x",
        "alpine",
        "--",
        "sh",
        "-c",
        'echo "$GREETING" -- --name',
        "--",
        "-x",
    )
    assert result.returncode == 0, result.stderr
    task_id = result.stdout.strip()
    task = server.task(task_id)
    assert task["name"] == name
    assert task["executors"] == [
        {
            "image": "alpine",
            "command": ["sh", "-c", 'echo "$GREETING" -- --name', "--", "-x"],
            "workdir": "/work",
            "env": {"GREETING": "a=b"},
        }
    ]
    assert task["inputs"] == [
        {"url": "https://example.org/get?a=1&b=2", "path": "/data/in.txt", "type": "FILE"},
        {"url": "s3://bucket/refs/", "path": "/data/refs", "type": "DIRECTORY"},
    ]
    assert task["outputs"] == [
        {"url": "s3://bucket/out.txt", "path": "/data/out.txt", "type": "FILE"}
    ]
    assert task["resources"] == {"cpu_cores": 2, "ram_gb": 1.5, "disk_gb": 3.0}
    assert task["tags"] == {"project": "x"}


def test_run_without_a_command_or_with_a_bad_option_says_so(server: Server):
    no_command = tes_task(server.url, "run", "alpine")
    assert no_command.returncode == 1
    assert "run IMAGE -- CMD ARGS" in no_command.stderr
    bad_env = tes_task(server.url, "run", "--env", "NOVALUE", "alpine", "--", "true")
    assert bad_env.returncode == 2
    assert "--env" in bad_env.stderr and "K=V" in bad_env.stderr


@pytest.mark.parametrize("form", ["json", "yaml", "stdin-json", "stdin-yaml"])
def test_submit_reads_a_json_or_yaml_task_from_a_file_or_stdin(
    server: Server, tmp_path: Path, form: str
):
    name = unique(form)
    document = {
        "name": name,
        "executors": [{"image": "alpine", "command": ["echo", "a: b"], "env": {"X": "1"}}],
        "tags": {"form": form},
    }
    if form.endswith("yaml"):
        text = (
            f"name: {name}\n"
            "executors:\n"
            "  - image: alpine\n"
            "    command: [echo, 'a: b']\n"
            "    env: {X: '1'}\n"
            f"tags:\n  form: {form}\n"
        )
    else:
        text = json.dumps(document)
    if form.startswith("stdin"):
        result = tes_task(server.url, "submit", "-", stdin=text)
    else:
        path = tmp_path / f"task.{form}"
        path.write_text(text)
        result = tes_task(server.url, "submit", str(path))
    assert result.returncode == 0, result.stderr
    task = server.task(result.stdout.strip())
    assert {k: task[k] for k in document} == document


def test_submit_of_what_is_not_a_task_names_the_problem(server: Server, tmp_path: Path):
    listing = tes_task(server.url, "submit", "-", stdin="- just\n- a list\n")
    assert listing.returncode == 1
    assert "standard input: expected a task (a mapping), got list" in listing.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("executors: [\n")
    assert "is neither JSON nor YAML" in tes_task(server.url, "submit", str(broken)).stderr
    missing = tes_task(server.url, "submit", str(tmp_path / "absent.json"))
    assert missing.returncode == 1
    assert "cannot read" in missing.stderr and "No such file" in missing.stderr


# ------------------------------------------------------------------------------ read
def test_list_filters_follows_page_tokens_and_prints_a_table(server: Server):
    prefix = unique("list")
    ids = [
        server.create(name=f"{prefix}-{n}", tags={"n": str(n), "batch": prefix}) for n in range(5)
    ]
    newest_first = ids[::-1]

    def listed(*args: str) -> list[str]:
        result = tes_task(server.url, "list", "--json", "--name-prefix", prefix, *args)
        assert result.returncode == 0, result.stderr
        return [task["id"] for task in json.loads(result.stdout)]

    # Pages of two: the client follows next_page_token to the end.
    assert listed("--page-size", "2") == newest_first
    assert listed("--page-size", "2", "--limit", "3") == newest_first[:3]
    assert listed("--tag", "n=3") == [ids[3]]
    assert listed("--tag", f"batch={prefix}", "--tag", "n") == newest_first
    assert listed("--tag", "n=9") == []
    server.update(ids[1], state="CANCELED")
    assert listed("--state", "CANCELED") == [ids[1]]

    table = tes_task(server.url, "list", "--name-prefix", prefix, "--page-size", "2")
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "ID", "STATE", "CREATED", "(UTC)", "JOBID", "ELAPSED", "EXIT", "MAXMEM", "REASON", "NAME"
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[1:]] == newest_first
    assert lines[1].split()[1] == "QUEUED" and lines[1].split()[-1] == f"{prefix}-4"
    assert lines[4].split()[1] == "CANCELED"


def test_list_says_why_each_task_failed_and_what_it_used(server: Server):
    """The server's reason of each final task (its last attempt's metadata in the BASIC view),
    the cgroup's peak where sacct's MaxRSS is 0 (a job shorter than one sample), and the
    elapsed time as sacct writes it."""
    prefix = unique("why")
    timed_out, failed, done = (server.create(name=f"{prefix}-{n}") for n in range(3))
    facts = {"slurm_job_id": "4711", "slurm_max_rss_bytes": "0", "slurm_elapsed_seconds": "5"}
    server.update(
        timed_out,
        state="EXECUTOR_ERROR",
        logs=[{"logs": [], "metadata": {**facts, "slurm_state": "TIMEOUT"}}],
    )
    server.update(
        failed,
        state="EXECUTOR_ERROR",
        logs=[
            {
                "logs": [{"exit_code": 0}, {"exit_code": 42}],
                "metadata": {**facts, "memory_peak_bytes": "225443840", "slurm_state": "FAILED"},
            }
        ],
    )
    server.update(done, state="COMPLETE", logs=[{"logs": [{"exit_code": 0}], "metadata": facts}])
    lines = tes_task(server.url, "list", "--name-prefix", prefix).stdout.splitlines()
    at = {column: lines[0].index(column) for column in ("ELAPSED", "EXIT", "MAXMEM", "REASON")}
    rows = {line.split()[0]: line for line in lines[1:]}

    def cell(task_id: str, column: str) -> str:
        return rows[task_id][at[column] :].split("  ")[0].strip()

    assert [cell(timed_out, c) for c in at] == ["00:00:05", "", "", "TIMEOUT"]
    assert [cell(failed, c) for c in at] == ["00:00:05", "42", "215.0M", "exit 42"]
    assert [cell(done, c) for c in at] == ["00:00:05", "0", "", ""]
    listed = json.loads(tes_task(server.url, "list", "--json", "--name-prefix", prefix).stdout)
    assert {t["id"]: t["logs"][-1]["metadata"].get("reason") for t in listed} == {
        timed_out: "TIMEOUT",
        failed: "exit 42",
        done: None,
    }


def test_get_prints_the_task_in_the_view_asked(server: Server):
    task_id = server.create(name=unique("get"))
    full = json.loads(tes_task(server.url, "get", task_id).stdout)
    assert full["executors"] == ALPINE["executors"] and full["id"] == task_id
    minimal = json.loads(tes_task(server.url, "get", task_id, "--view", "MINIMAL").stdout)
    assert minimal == {"id": task_id, "state": "QUEUED"}


def test_cancel_cancels_each_task_and_reports_the_ones_it_could_not(server: Server):
    first, second = server.create(), server.create()
    result = tes_task(server.url, "cancel", first, "no-such-task", second)
    assert result.returncode == 1
    assert server.task(first)["state"] == server.task(second)["state"] == "CANCELED"
    assert result.stdout.splitlines() == [
        f"{first}: cancel requested",
        f"{second}: cancel requested",
    ]
    assert "404 task 'no-such-task' not found" in result.stderr


def test_cancel_of_a_task_that_already_ended_says_so(server: Server):
    done, queued = server.create(), server.create()
    server.update(done, state="COMPLETE")
    result = tes_task(server.url, "cancel", done, queued)
    assert result.returncode == 1
    assert f"{done}: had already ended COMPLETE; not canceled" in result.stderr
    assert result.stdout.splitlines() == [f"{queued}: cancel requested"]
    assert server.task(done)["state"] == "COMPLETE"
    assert server.task(queued)["state"] == "CANCELED"


# ------------------------------------------------------------------------------ errors
def test_errors_show_the_servers_message_and_never_a_traceback(server: Server):
    missing = tes_task(server.url, "get", "no-such-task")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        f"tes-bridge task: GET {server.api}/tasks/no-such-task: 404 task 'no-such-task' not found"
    )
    bad = tes_task(
        server.url, "run", "--input", "https://example.org/x=relative", "alpine", "--", "true"
    )
    assert bad.returncode == 1
    assert ": 400 inputs[0].path:" in bad.stderr
    bad_state = tes_task(server.url, "list", "--state", "DONE")
    assert bad_state.returncode == 2 and "--state" in bad_state.stderr
    for option, value in [("--limit", "0"), ("--page-size", "-1"), ("--tag", "=x")]:
        refused = tes_task(server.url, "list", option, value)
        assert refused.returncode == 2 and option in refused.stderr, refused.stderr
    # A port held bound but not listening refuses connections for as long as it is held, so no
    # other process can take it between choosing and connecting.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        down = tes_task(f"http://127.0.0.1:{closed.getsockname()[1]}", "list")
    assert down.returncode == 1
    assert "cannot reach" in down.stderr and "Connection refused" in down.stderr
    not_http = tes_task("ftp://example.org", "list")
    assert not_http.returncode == 1 and "expected an http:// or https:// URL" in not_http.stderr


def test_a_url_with_a_tes_base_path_is_used_as_it_is(server: Server):
    task_id = server.create()
    for url in (server.url, f"{server.url}/", f"{server.url}/ga4gh/tes/v1", f"{server.url}/v1"):
        result = tes_task(url, "get", task_id, "--view", "MINIMAL")
        assert json.loads(result.stdout)["id"] == task_id, (url, result.stderr)


# ------------------------------------------------------------------------------ auth
@pytest.fixture
def basic_server(tmp_path: Path) -> Iterator[Server]:
    yield from serve(tmp_path, basic_auth_toml(write_htpasswd(tmp_path / "htpasswd")))


def test_basic_authentication_from_the_environment_or_netrc(basic_server: Server, tmp_path: Path):
    url = basic_server.url
    anonymous = tes_task(url, "list")
    assert anonymous.returncode == 1
    assert ": 401 " in anonymous.stderr and "--user with TES_PASSWORD" in anonymous.stderr
    password = PASSWORDS["tesalice"]
    created = tes_task(
        url, "run", "--user", "tesalice", "alpine", "--", "true", TES_PASSWORD=password
    )
    assert created.returncode == 0, created.stderr
    task_id = created.stdout.strip()
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login tesalice password {password}\n")
    netrc.chmod(0o600)
    # --user with the password from netrc, and the netrc login alone.
    for args in (["--user", "tesalice"], []):
        got = tes_task(url, "get", task_id, "--view", "MINIMAL", *args, NETRC=str(netrc))
        assert got.returncode == 0, got.stderr
    # Another owner does not see it: the server's 404.
    bob = tes_task(url, "get", task_id, TES_USER="tesbob", TES_PASSWORD=PASSWORDS["tesbob"])
    assert bob.returncode == 1 and ": 404 " in bob.stderr
    wrong = tes_task(url, "list", "--user", "tesalice", TES_PASSWORD="wrong")
    assert wrong.returncode == 1 and ": 401 " in wrong.stderr
    nopass = tes_task(url, "list", "--user", "tesbob", NETRC=str(netrc))
    assert nopass.returncode == 1
    assert "no password for tesbob: set TES_PASSWORD or add a netrc entry" in nopass.stderr


def test_only_who_may_read_a_task_may_resubmit_it_and_the_copy_is_theirs(
    basic_server: Server,
):
    alice = {"TES_USER": "tesalice", "TES_PASSWORD": PASSWORDS["tesalice"]}
    bob = {"TES_USER": "tesbob", "TES_PASSWORD": PASSWORDS["tesbob"]}
    created = tes_task(basic_server.url, "run", "alpine", "--", "true", **alice)
    assert created.returncode == 0, created.stderr
    original = created.stdout.strip()
    refused = tes_task(basic_server.url, "resubmit", original, **bob)
    assert refused.returncode == 1 and ": 404 " in refused.stderr
    again = tes_task(basic_server.url, "resubmit", original, "-t", "5", **alice)
    assert again.returncode == 0, again.stderr
    store = Store.from_url(f"sqlite:///{basic_server.state_dir / 'tes-bridge.db'}")
    try:
        record = store.get_task(again.stdout.strip())
        assert record is not None and record.owner == "tesalice"
    finally:
        store.db.close()


def test_bearer_token_from_option_or_environment(tmp_path: Path, oidc: OIDC):
    for bearer in serve(tmp_path, bearer_auth_toml(oidc)):
        token = oidc.token("tesalice")
        created = tes_task(bearer.url, "run", "alpine", "--", "true", TES_TOKEN=token)
        assert created.returncode == 0, created.stderr
        listed = tes_task(bearer.url, "list", "--json", "--token", token)
        assert [t["id"] for t in json.loads(listed.stdout)] == [created.stdout.strip()]
        expired = tes_task(bearer.url, "list", "--token", oidc.token("tesalice", expires_in=-300))
        assert expired.returncode == 1 and ": 401 " in expired.stderr
        both = tes_task(bearer.url, "list", "--token", token, "--user", "tesalice")
        assert both.returncode == 1 and "either --token or --user" in both.stderr


# ------------------------------------------------------------------------------ wait
@pytest.mark.parametrize(
    ("states", "code"),
    [
        (["COMPLETE"], 0),
        (["EXECUTOR_ERROR"], 3),
        (["SYSTEM_ERROR"], 4),
        (["CANCELED"], 5),
        (["COMPLETE", "EXECUTOR_ERROR", "COMPLETE"], 3),
        (["EXECUTOR_ERROR", "SYSTEM_ERROR"], 4),
    ],
)
def test_wait_exits_with_the_outcome(server: Server, states: list[str], code: int):
    ids = [server.create() for _ in states]
    for task_id, state in zip(ids, states, strict=True):
        server.update(task_id, state=state)
    result = tes_task(server.url, "wait", "--interval", "0.2", *ids)
    assert result.returncode == code, result.stderr
    # Not a terminal: one plain line per task and state.
    lines = result.stdout.splitlines()
    assert lines[: len(ids)] == [f"{i} {s}" for i, s in zip(ids, states, strict=True)]
    if len(ids) > 1:
        assert lines[-1].startswith(f"{len(ids)} tasks: ")


def test_wait_follows_changes_and_gives_up_at_its_timeout(server: Server):
    task_id = server.create()
    waiting = subprocess.Popen(
        [*TES_TASK, "wait", "--interval", "0.2", task_id],
        stdout=subprocess.PIPE,
        text=True,
        env=client_env(server.url),
    )
    time.sleep(2)
    server.update(task_id, state="RUNNING")
    time.sleep(1)
    server.update(task_id, state="COMPLETE")
    out, _ = waiting.communicate(timeout=30)
    assert waiting.returncode == 0
    assert out.splitlines() == [f"{task_id} QUEUED", f"{task_id} RUNNING", f"{task_id} COMPLETE"]

    stuck = server.create()
    started = time.monotonic()
    result = tes_task(server.url, "wait", "--interval", "0.2", "--timeout", "1", stuck)
    assert result.returncode == 7
    assert time.monotonic() - started < 15
    assert "1 task(s) not final after 1 s" in result.stderr


def test_wait_says_why_a_queued_task_waits(server: Server):
    """The latest system log line of a waiting task (an image pull retried, a limit) is shown
    once on stderr, stdout keeping its `ID STATE` lines."""
    task_id = server.create()
    reason = "pulling image reg.invalid/x: registry reg.invalid unreachable (host name not found)"
    server.update(task_id, logs=[{"logs": [], "outputs": [], "system_logs": [reason]}])
    result = tes_task(server.url, "wait", "--interval", "0.2", "--timeout", "1", task_id)
    assert result.returncode == 7
    assert result.stdout.splitlines() == [f"{task_id} QUEUED"]
    assert result.stderr.count(f"{task_id}: {reason}\n") == 1, result.stderr


def test_wait_and_list_say_when_slurm_expects_a_pending_task_to_start(server: Server):
    task_id = server.create(name=unique("pending"))
    pending = "Slurm job 4712 is pending (Resources)"
    attempt = {
        "logs": [],
        "outputs": [],
        "system_logs": [pending],
        "metadata": {"slurm_job_id": "4712", "slurm_expected_start": "2026-11-29T14:05:00Z"},
    }
    server.update(task_id, logs=[attempt])
    result = tes_task(server.url, "wait", "--interval", "0.2", "--timeout", "1", task_id)
    assert result.returncode == 7
    expected = f"{task_id}: {pending}; Slurm expects it to start at 2026-11-29 14:05:00 UTC\n"
    assert result.stderr.count(expected) == 1, result.stderr
    table = tes_task(server.url, "list", "--name-prefix", "pending-").stdout.splitlines()
    line = next(line for line in table if line.startswith(task_id))
    assert line.split()[4:7] == ["4712", "start", "2026-11-29"], table
    assert line.split()[7] == "14:05:00", table


def test_wait_on_a_terminal_shows_states_live_and_a_count_line(server: Server):
    names = [unique("waited"), "", unique("waited")]
    ids = [server.create(**({"name": name} if name else {})) for name in names]
    primary, replica = pty.openpty()
    process = subprocess.Popen(
        [*TES_TASK, "wait", "--interval", "0.2", *ids],
        stdout=replica,
        stderr=replica,
        env=client_env(server.url, COLUMNS="200"),
    )
    os.close(replica)
    seen = b""

    def read_until(text: bytes, timeout: float = 20) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while text not in seen:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            if select.select([primary], [], [], 0.5)[0]:
                try:
                    seen += os.read(primary, 4096)
                except OSError:  # the process ended: EIO on Linux
                    break

    read_until(b"3 tasks: 3 QUEUED")
    server.update(ids[0], state="RUNNING")
    read_until(b"3 tasks: 2 QUEUED, 1 RUNNING")
    server.update(ids[0], state="COMPLETE")
    server.update(ids[1], state="COMPLETE")
    server.update(ids[2], state="EXECUTOR_ERROR")
    read_until(b"3 tasks: 2 COMPLETE, 1 EXECUTOR_ERROR\r\n")
    assert process.wait(timeout=30) == 3
    os.close(primary)
    text = seen.decode()
    # The status line is redrawn in place; each change is a line of its own.
    assert "\r\x1b[K" in text
    # Each with its name, when it has one.
    for index, state in [(0, "RUNNING"), (0, "COMPLETE"), (1, "COMPLETE"), (2, "EXECUTOR_ERROR")]:
        name = f"  {names[index]}" if names[index] else ""
        assert f"  {ids[index]}  {state}{name}\r\n" in text


# ------------------------------------------------------------------------------ logs
def _attempt(stdout: str, stderr: str = "", system: list[str] | None = None) -> dict[str, Any]:
    return {
        "logs": [{"exit_code": 0, "stdout": stdout, "stderr": stderr}],
        "outputs": [],
        "system_logs": system or [],
    }


def test_logs_prints_the_last_attempts_output_and_system_logs(server: Server):
    task_id = server.create()
    server.update(
        task_id,
        state="COMPLETE",
        logs=[_attempt("first try\n"), _attempt("hello\n", "warning\n", ["staged 2 inputs"])],
    )
    result = tes_task(server.url, "logs", task_id)
    assert result.returncode == 0
    assert result.stdout == "hello\n"
    assert result.stderr == "warning\nexecutor 0: exit code 0\nsystem: staged 2 inputs\n"
    queued = server.create()
    early = tes_task(server.url, "logs", queued)
    assert early.returncode == 0 and early.stdout == ""
    assert early.stderr == f"task {queued} is QUEUED; --follow prints what comes\n"


def test_logs_of_a_failed_task_show_exit_codes_and_exit_with_the_outcome(server: Server):
    task_id = server.create(executors=TWO_EXECUTORS)
    attempt = {
        "logs": [{"exit_code": 0, "stdout": "ok\n"}, {"exit_code": 2, "stderr": "no such file\n"}],
        "outputs": [],
    }
    server.update(task_id, state="EXECUTOR_ERROR", logs=[attempt])
    result = tes_task(server.url, "logs", task_id)
    assert result.returncode == 3
    assert result.stdout == "--- executor 0 stdout ---\nok\n"
    assert result.stderr == (
        "executor 0: exit code 0\n--- executor 1 stderr ---\nno such file\n"
        f"executor 1: exit code 2\ntask {task_id}: EXECUTOR_ERROR\n"
    )


TWO_EXECUTORS = [
    {"image": "alpine", "command": ["sh", "-c", "echo one"]},
    {"image": "alpine", "command": ["sh", "-c", "echo two"]},
]


def _job(server: Server, task_id: str, *, state: str, logs: list[Any], job: str = "77") -> Path:
    """What the poller would have: the task's job `job` in `state`, with `logs`; the job's
    executors' records directory (each executor's stdout and stderr files go there)."""
    store = Store.from_url(f"sqlite:///{server.state_dir / 'tes-bridge.db'}")
    try:
        assert store.mark_submitting(task_id, attempt=1, now=0.0)
        store.record_job(task_id, job, logs=logs)
        assert store.update_task(task_id, state=state, logs=logs)
    finally:
        store.db.close()
    records = server.state_dir / "work" / task_id / "records" / job / "executors"
    records.mkdir(parents=True)
    return records


def _wrote(records: Path, executor: int, exit_code: int | None = None, **streams: bytes) -> None:
    (records / str(executor)).mkdir()
    for stream, data in streams.items():
        (records / str(executor) / stream).write_bytes(data)
    if exit_code is not None:
        (records / str(executor) / "exit_code").write_text(f"{exit_code}\n")


def test_logs_of_a_running_task_print_each_executors_output_so_far_under_a_header(
    server: Server,
):
    task_id = server.create(executors=TWO_EXECUTORS)
    attempt = {"logs": [{"exit_code": 0, "stdout": "one\n"}], "outputs": []}
    records = _job(server, task_id, state="RUNNING", logs=[attempt])
    _wrote(records, 0, 0, stdout=b"one\n")
    _wrote(records, 1, stdout=b"two so far\n", stderr=b"warming up\n")
    result = tes_task(server.url, "logs", task_id)
    assert result.returncode == 0
    assert (
        result.stdout == "--- executor 0 stdout ---\none\n--- executor 1 stdout ---\ntwo so far\n"
    )
    assert result.stderr == (
        "executor 0: exit code 0\n--- executor 1 stderr ---\nwarming up\n"
        f"task {task_id} is RUNNING; --follow prints what comes\n"
    )


@pytest.mark.parametrize(
    ("state", "code", "system"),
    [
        (
            "EXECUTOR_ERROR",
            3,
            "Slurm job 77 ended in state TIMEOUT: the job reached its time limit (--time=1, "
            "from resources.backend_parameters.time)",
        ),
        ("CANCELED", 5, "canceled"),
    ],
)
def test_logs_of_a_stopped_executor_print_all_it_wrote(
    server: Server, state: str, code: int, system: str
):
    """An executor stopped by its time limit or a cancel has no exit code, so no log in the
    task document; what it wrote is still printed, whole: here the first line of 1.5 MB."""
    task_id = server.create()
    attempt = {"logs": [], "outputs": [], "system_logs": [system]}
    records = _job(server, task_id, state=state, logs=[attempt])
    stdout = b"Error: the first line\n" + b"".join(b"%07d\n" % n for n in range(190_000))
    _wrote(records, 0, stdout=stdout, stderr=b"killed\n")
    result = tes_task(server.url, "logs", task_id)
    assert result.returncode == code
    assert result.stdout.encode() == stdout  # one executor: no header
    assert result.stderr == f"killed\nsystem: {system}\ntask {task_id}: {state}\n"


def test_logs_of_an_unreadable_stream_say_why_and_print_what_the_document_keeps(
    server: Server, tmp_path: Path
):
    task_id = server.create()
    attempt = {"logs": [{"exit_code": 0, "stdout": "kept\n", "stderr": "also kept\n"}]}
    records = _job(server, task_id, state="COMPLETE", logs=[{**attempt, "outputs": []}])
    _wrote(records, 0, 0, stderr=b"whole\n")
    (tmp_path / "elsewhere").write_text("not the task's\n")
    (records / "0" / "stdout").symlink_to(tmp_path / "elsewhere")  # 409 from the endpoint
    result = tes_task(server.url, "logs", task_id)
    assert (result.returncode, result.stdout) == (0, "kept\n")
    assert "409" in result.stderr and "not the task's" not in result.stderr
    assert result.stderr.endswith("\nwhole\nexecutor 0: exit code 0\n")


def test_logs_of_a_task_whose_files_are_gone_print_what_the_document_keeps(server: Server):
    task_id = server.create()
    kept = "Error: first\n[tes-bridge: 9 of 30 bytes left out here; the whole stdout: GET x]\nend\n"
    attempt = {"logs": [{"exit_code": 1, "stdout": kept}], "outputs": []}
    _job(server, task_id, state="EXECUTOR_ERROR", logs=[attempt])  # no files: removed
    result = tes_task(server.url, "logs", task_id)
    assert (result.returncode, result.stdout) == (3, kept)


def test_list_takes_several_states_any_case_a_time_window_and_shows_slurm_facts(server: Server):
    prefix = unique("slurmy")
    ids = [server.create(name=f"{prefix}-{n}") for n in range(4)]
    server.update(ids[0], state="RUNNING")
    server.update(ids[1], state="EXECUTOR_ERROR")
    attempt = {
        "logs": [{"exit_code": 0}, {"exit_code": 137}],
        "outputs": [],
        "start_time": "2026-11-25T10:00:00Z",
        "end_time": "2026-11-25T11:02:03Z",
        "metadata": {"slurm_job_id": "4711", "slurm_max_rss_bytes": str(3 * 1024**3 // 2)},
    }
    server.update(ids[2], state="COMPLETE", logs=[attempt])

    def listed(*args: str) -> list[str]:
        result = tes_task(server.url, "list", "--json", "--name-prefix", prefix, *args)
        assert result.returncode == 0, result.stderr
        return [task["id"] for task in json.loads(result.stdout)]

    assert listed("--state", "running,executor_error") == [ids[1], ids[0]]
    assert listed("--state", "Complete", "--state", "RUNNING") == [ids[2], ids[0]]
    assert listed("--since", "1h") == ids[::-1]
    assert listed("--since", "2000-01-01", "--state", "queued") == [ids[3]]
    assert listed("--since", "2999-01-01") == []
    bad = tes_task(server.url, "list", "--state", "RUNING")
    assert bad.returncode == 2 and "expected states among" in bad.stderr

    table = tes_task(server.url, "list", "--name-prefix", prefix).stdout.splitlines()
    done = next(line for line in table if line.startswith(ids[2])).split()
    assert done[1:] == ["COMPLETE", *done[2:4], "4711", "01:02:03", "137", "1.5G", f"{prefix}-2"]


def test_list_watch_prints_the_table_again(server: Server):
    prefix = unique("watched")
    server.create(name=prefix)
    watch = subprocess.Popen(
        [*TES_TASK, "list", "--watch", "--interval", "0.3", "--name-prefix", prefix],
        stdout=subprocess.PIPE,
        text=True,
        env=client_env(server.url),
    )
    time.sleep(2.5)
    watch.terminate()
    out, _ = watch.communicate(timeout=30)
    assert out.count("every 0.3 s, ") >= 2 and out.count(prefix) >= 2


def test_resubmit_posts_a_copy_of_the_task_that_names_it(server: Server):
    original = server.create(name=unique("again"), tags={"k": "v"})
    server.update(original, state="SYSTEM_ERROR", logs=[_attempt("x")])
    result = tes_task(server.url, "resubmit", original)
    assert result.returncode == 0, result.stderr
    copy = result.stdout.strip()
    assert copy != original
    first, second = server.task(original), server.task(copy)
    assert second["state"] == "QUEUED" and "logs" not in second
    assert second["tags"] == {"k": "v", "tes-bridge.resubmit_of": original}
    dropped = ("id", "state", "creation_time", "logs", "tags")
    assert {k: v for k, v in first.items() if k not in dropped} == {
        k: v for k, v in second.items() if k not in dropped
    }


def test_resubmit_after_a_timeout_with_more_time_memory_cpus_and_another_partition(
    server: Server,
):
    """The Slurm user's way: `-t` was refused with the top level's usage and no word of what
    the command takes."""
    original = server.create(
        name=unique("timeout"),
        resources={
            "cpu_cores": 1,
            "ram_gb": 2,
            "zones": ["short"],
            "backend_parameters": {"time": "10", "max_time": "0.25", "qos": "normal"},
        },
    )
    server.update(original, state="EXECUTOR_ERROR")
    result = tes_task(
        server.url, "resubmit", original, "-t", "2:00:00", "--ram", "8", "--cpus", "4",
        "-p", "long", "--mem", "8G",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    copy = server.task(result.stdout.strip())
    assert copy["resources"] == {
        "cpu_cores": 4,
        "ram_gb": 8.0,
        "backend_parameters": {"qos": "normal", "time": "2:00:00", "partition": "long"},
    }
    assert copy["tags"] == {"tes-bridge.resubmit_of": original}
    assert copy["name"] == server.task(original)["name"] and copy["state"] == "QUEUED"


def test_run_names_the_task_after_its_command_and_says_what_a_relative_path_became(
    server: Server, tmp_path: Path
):
    named = tes_task(server.url, "run", "alpine", "--", "python3", "/work/job.py", "-v")
    assert named.returncode == 0, named.stderr
    assert server.task(named.stdout.strip())["name"] == "job.py"
    # This server takes no local paths: its refusal follows what the path was sent as.
    result = subprocess.run(
        [*TES_TASK, "run", "--input", "in.txt=/in.txt", "alpine", "--", "true"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env=client_env(server.url, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert result.returncode == 1
    note, refusal = result.stderr.splitlines()
    assert note == f"tes-bridge task: --input in.txt is file://{tmp_path}/in.txt"
    assert refusal.endswith(": 400 inputs[0].url: file:// URLs and local paths are disabled on "
                            "this server")  # fmt: skip


def test_logs_follow_prints_only_new_text_until_the_task_is_final(server: Server):
    task_id = server.create()
    server.update(task_id, state="RUNNING", logs=[_attempt("line 1\n", system=["started"])])
    follow = subprocess.Popen(
        [*TES_TASK, "logs", "--follow", "--interval", "0.2", task_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=client_env(server.url),
    )
    # The first look printed (however long the client took to start on a busy machine).
    assert follow.stderr is not None
    first = follow.stderr.readline()
    server.update(task_id, logs=[_attempt("line 1\nline 2\n", "oops\n", ["started"])])
    time.sleep(1)
    server.update(
        task_id,
        state="EXECUTOR_ERROR",
        logs=[_attempt("line 1\nline 2\nline 3\n", "oops\n", ["started", "exit 1"])],
    )
    # Read through the same buffered streams (communicate() would skip what readline() buffered).
    err = follow.stderr.read()
    assert follow.stdout is not None
    out = follow.stdout.read()
    assert follow.wait(timeout=30) == 3
    assert out == "line 1\nline 2\nline 3\n"
    # (This fake attempt has executor 0's exit code from the start.)
    assert first + err == (
        "executor 0: exit code 0\nsystem: started\noops\nsystem: exit 1\n"
        f"task {task_id}: EXECUTOR_ERROR\n"
    )


def test_logs_follow_prints_a_running_executors_output_as_it_is_written(server: Server):
    """Through the output endpoint: lines appear while the task runs, each once, although the
    task document lists no executor log until it has an exit code."""
    task_id = server.create()
    store = Store.from_url(f"sqlite:///{server.state_dir / 'tes-bridge.db'}")
    try:
        assert store.mark_submitting(task_id, attempt=1, now=0.0)
        store.record_job(task_id, "77", logs=[_attempt("")])
        assert store.update_task(task_id, state="RUNNING", logs=[{"logs": [], "outputs": []}])
    finally:
        store.db.close()
    edir = server.state_dir / "work" / task_id / "records" / "77" / "executors" / "0"
    edir.mkdir(parents=True)
    stdout = edir / "stdout"
    stdout.write_text("tick 1\n")
    stderr = (server.state_dir / f"{task_id}.stderr").open("w+")
    follow = follow_logs(server.url, task_id, interval=0.2, stderr=stderr, kill_after=60)
    assert follow.stdout is not None
    assert follow.stdout.readline() == "tick 1\n"  # blocks until printed: the task runs on
    with stdout.open("a") as stream:
        stream.write("tick 2\n")
    assert follow.stdout.readline() == "tick 2\n"
    (edir / "exit_code").write_text("0\n")
    server.update(task_id, state="COMPLETE", logs=[_attempt("tick 1\ntick 2\n")])
    out = follow.stdout.read()
    follow.wait(timeout=30)
    stderr.seek(0)
    err = stderr.read()
    assert follow.returncode == 0, err
    assert out == ""  # nothing twice
    assert err.endswith(f"task {task_id}: COMPLETE\n")


def test_new_text_when_the_kept_tail_moved_on():
    assert new_text("", "abc") == "abc"
    assert new_text("abc", "abcdef") == "def"
    # A server that keeps the last N bytes: the start was dropped, the text goes on.
    assert new_text("0123456789", "56789abc") == "abc"
    assert new_text("xyz", "nothing in common") == "nothing in common"


# ------------------------------------------------------------------------------ help
def test_help_explains_each_command_with_an_example():
    top = subprocess.run(
        [*TES_TASK[:-1], "--help"], capture_output=True, text=True, check=True, timeout=60
    )
    assert "a client for any TES server" in top.stdout
    assert (
        "tes-bridge task wait"
        in subprocess.run(
            [*TES_TASK, "--help"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    )
    actions = next(a for a in build_parser()._actions if a.dest == "action").choices
    assert set(actions) == {"run", "submit", "resubmit", "list", "get", "cancel", "logs", "wait"}
    for name, parser in actions.items():
        text = parser.format_help()
        assert "example" in text and f"tes-bridge task {name}" in text, name
        if name in ("run", "submit", "resubmit", "logs", "wait"):
            assert "3  a task ended EXECUTOR_ERROR" in text, name
            assert "5  a task was CANCELED" in text, name
