"""Sprocket's TES backend (crankshaft 0.10.0 over the `tes` crate 0.10.1, as sprocket's
Cargo.lock pins them), replayed on the wire against the service the quickstart starts.

Sprocket is a Rust binary that the test machines cannot fetch. So this test does what it does
for each WDL task, as its source builds it (stjude-rust-labs/sprocket at bc467b28, 2026-08-21:
crates/wdl-engine/src/backend/tes.rs, `TesBackend::execute`; crankshaft 64ab525b (v0.10.0):
crankshaft-engine/src/service/runner/backend/tes.rs and tes/monitor.rs, the conversions in
crankshaft-engine/src/task.rs and task/{execution,input,input/contents,output,resources}.rs;
the tes crate's wire types as of 0.9: src/v1/client.rs and
src/v1/types/{requests,responses,task}.rs):

- Sprocket writes the evaluated command to a local file and gives it to crankshaft as the
  input at `/mnt/task/command` by path (`Contents::Path`), which crankshaft's conversion reads
  and sends inline, as the input's `content` with no `url` (`Contents::one_hot`). It POSTs
  `tasks` with one executor `bash /mnt/task/command` in `/mnt/task/work` (stdout and stderr to
  `/mnt/task/`), `ignore_error: true` on every executor (crankshaft's `Executor::from` sets it
  always), the work directory as a DIRECTORY output and stdout and stderr as FILE outputs under
  `<outputs>/<name>-<timestamp>/`, resources in GB converted from GiB, `preemptible` (true
  while the WDL task's `preemptible` count is above 0), no `backend_parameters`, and the tag
  `crankshaft-task-group` of its monitor. A Docker image goes without its `docker://`, an
  `oras://` or `library://` one with it; a local SIF is refused by sprocket itself.
- Its monitor lists every second (`interval`) the tasks of its tag:
  `GET tasks?tag_key=crankshaft-task-group&tag_value=<tag>&page_size=2047&view=MINIMAL`, page
  by page, decoded as `MinimalTask`s. A task final there (COMPLETE, EXECUTOR_ERROR,
  SYSTEM_ERROR, CANCELED, PREEMPTED) is read once in the FULL view: the exit codes of the LAST
  task log's executor logs, or for SYSTEM_ERROR the last task log's `system_logs`, which
  becomes the error sprocket reports. PREEMPTED is a failure sprocket retries itself (as many
  times as the task's `preemptible` hint allows), submitting a new task; so a site that serves
  sprocket sets slurm.on_preemption = "report" (sprocket cannot send the backend parameter).

The FULL view is checked against serde's reading of the `tes` crate's response types, where a
missing required field fails the whole read (`TaskLog.logs`, `TaskLog.outputs`,
`ExecutorLog.exit_code`, `OutputFile.size_bytes` as a string, RFC 3339 times).
"""

from __future__ import annotations

import subprocess
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fixtures.quickstart import Quickstart, give_to_account

pytestmark = pytest.mark.cluster

#: The tag crankshaft's monitor groups its tasks with (monitor.rs).
GROUP_TAG = "crankshaft-task-group"
#: tes::v1::types::requests::MAX_PAGE_SIZE - 1: the page size the monitor lists with.
PAGE_SIZE = 2047
#: The guest paths of wdl-engine's TES backend.
GUEST_WORK_DIR = "/mnt/task/work"
GUEST_COMMAND = "/mnt/task/command"
GUEST_STDOUT = "/mnt/task/stdout"
GUEST_STDERR = "/mnt/task/stderr"
#: The executor runs `bash` (wdl-engine's default task shell): an image with bash.
IMAGE = "python:3-slim"
#: tes::v1::types::task::State.
TES_STATES = {
    "UNKNOWN", "QUEUED", "INITIALIZING", "RUNNING", "PAUSED", "COMPLETE", "EXECUTOR_ERROR",
    "SYSTEM_ERROR", "CANCELED", "PREEMPTED", "CANCELING",
}  # fmt: skip
FINAL = {"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED", "PREEMPTED"}
GIB_IN_GB = 1024**3 / 1000**3


def file_url(path: Path) -> str:
    return f"file://{path}"


def sprocket_task(
    workdir: Path, name: str, command: str, tag: str, preemptible: bool = False
) -> tuple[dict[str, Any], Path]:
    """wdl-engine's TesBackend::execute through crankshaft's conversion to a TES task, for a
    task with the WDL defaults (1 cpu, 2 GiB of memory, one 1 GiB disk at /); returns the body
    and the task's outputs directory."""
    inputs_dir, outputs_dir = workdir / "inputs", workdir / "outputs"
    for directory in (inputs_dir, outputs_dir):
        directory.mkdir(exist_ok=True)
        give_to_account(directory, workdir)
    task_outputs = outputs_dir / f"{name}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    body = {
        "name": name,
        # The command file, read and sent inline (Contents::Path through Contents::one_hot).
        "inputs": [{"path": GUEST_COMMAND, "type": "FILE", "content": command}],
        "outputs": [
            {"url": file_url(task_outputs / "work"), "path": GUEST_WORK_DIR, "type": "DIRECTORY"},
            {"url": file_url(task_outputs / "stdout"), "path": GUEST_STDOUT, "type": "FILE"},
            {"url": file_url(task_outputs / "stderr"), "path": GUEST_STDERR, "type": "FILE"},
        ],
        "resources": {
            "cpu_cores": 1,
            "preemptible": preemptible,
            "ram_gb": 2 * GIB_IN_GB,
            "disk_gb": 1 * GIB_IN_GB,
        },
        "executors": [
            {
                "image": IMAGE,
                "command": ["bash", GUEST_COMMAND],
                "workdir": GUEST_WORK_DIR,
                "stdout": GUEST_STDOUT,
                "stderr": GUEST_STDERR,
                "ignore_error": True,
            }
        ],
        "tags": {GROUP_TAG: tag},
    }
    return body, task_outputs


def rfc3339(value: Any) -> None:
    """chrono's DateTime<Utc> reads RFC 3339 only."""
    assert isinstance(value, str), value
    datetime.fromisoformat(value.replace("Z", "+00:00"))


def decode_as_tes_crate(task: dict[str, Any]) -> None:
    """serde's reading of tes::v1::types::responses::Task: required fields present, of their
    types (a mismatch fails crankshaft's whole read of the task)."""
    assert isinstance(task["id"], str) and task["state"] in TES_STATES, task
    assert all(
        isinstance(e["image"], str) and isinstance(e["command"], list) for e in task["executors"]
    )
    for item in task.get("inputs") or []:
        assert isinstance(item["path"], str) and item["type"] in ("FILE", "DIRECTORY"), item
    for item in task.get("outputs") or []:
        assert isinstance(item["url"], str) and isinstance(item["path"], str), item
        assert item["type"] in ("FILE", "DIRECTORY"), item
    if "creation_time" in task:
        rfc3339(task["creation_time"])
    for log in task.get("logs") or []:
        assert isinstance(log["logs"], list) and isinstance(log["outputs"], list), log
        for key in ("start_time", "end_time"):
            if key in log:
                rfc3339(log[key])
        for executor_log in log["logs"]:
            assert isinstance(executor_log["exit_code"], int), executor_log
        for output in log["outputs"]:
            assert isinstance(output["url"], str) and isinstance(output["path"], str), output
            assert isinstance(output["size_bytes"], str), output
        assert all(isinstance(line, str) for line in log.get("system_logs") or [])


class CrankshaftMonitor:
    """crankshaft's TES backend: creates tasks with its tag, lists them, reads the final ones."""

    def __init__(self, api: str) -> None:
        self.api = api  # the configured URL; the tes crate adds a trailing slash and `tasks`
        # TaskMonitor::add_task: `<monitor name>-<unix time>-<task id>`.
        self.tag = f"{uuid.uuid4().hex[:12]}-{int(time.time())}-0"
        self.listed: list[list[dict[str, Any]]] = []

    def create(self, body: dict[str, Any]) -> str:
        answer = requests.post(f"{self.api}/tasks", json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        task_id: str = answer.json()["id"]
        return task_id

    def list_group(self) -> dict[str, str]:
        """update_tasks: every page of the tag's tasks in the MINIMAL view."""
        states: dict[str, str] = {}
        page_token: str | None = None
        while True:
            params: list[tuple[str, str | int]] = [
                ("tag_key", GROUP_TAG), ("tag_value", self.tag), ("page_size", PAGE_SIZE),
            ]  # fmt: skip
            if page_token:
                params.append(("page_token", page_token))
            params.append(("view", "MINIMAL"))
            answer = requests.get(f"{self.api}/tasks", params=params, timeout=10)
            assert answer.status_code == 200, answer.text
            page = answer.json()
            assert isinstance(page["tasks"], list), page  # ListTasks.tasks is required
            self.listed.append(page["tasks"])
            for task in page["tasks"]:
                assert isinstance(task["id"], str) and task.get("state") in TES_STATES, task
                states[task["id"]] = task["state"]
            page_token = page.get("next_page_token")
            if not page_token:
                return states

    def wait(self, task_ids: list[str], timeout: float) -> dict[str, str]:
        """The monitor's loop: list every second until each task is final there."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.list_group()
            if all(states.get(task_id) in FINAL for task_id in task_ids):
                return states
            assert time.monotonic() < deadline, states
            time.sleep(1)

    def get_full(self, task_id: str) -> dict[str, Any]:
        answer = requests.get(f"{self.api}/tasks/{task_id}", params={"view": "FULL"}, timeout=10)
        assert answer.status_code == 200, answer.text
        task: dict[str, Any] = answer.json()
        decode_as_tes_crate(task)
        return task


def why(task: dict[str, Any]) -> list[str]:
    """The last attempt's system logs and executor stderr, for a failing assertion's message."""
    log = (task.get("logs") or [{}])[-1]
    return [*log.get("system_logs", []), *(e.get("stderr", "") for e in log.get("logs", []))]


def exit_codes_as_crankshaft(task: dict[str, Any]) -> list[int]:
    """Backend::wait_task for COMPLETE or EXECUTOR_ERROR: the last task log's exit codes."""
    assert task["state"] in ("COMPLETE", "EXECUTOR_ERROR"), task
    codes = [log["exit_code"] for log in task["logs"][-1]["logs"]]
    assert codes, "completed task is missing executor logs"
    return codes


def system_error_as_crankshaft(task: dict[str, Any]) -> str:
    """Backend::wait_task for SYSTEM_ERROR: the error sprocket reports."""
    assert task["state"] == "SYSTEM_ERROR", task
    lines = task["logs"][-1].get("system_logs") or [] if task.get("logs") else []
    return "task failed due to system error:\n\n" + "\n".join(lines)


@pytest.fixture
def monitor(quickstart: Quickstart) -> CrankshaftMonitor:
    return CrankshaftMonitor(quickstart.api)


def test_tasks_found_by_their_tag_in_the_minimal_list_and_read_from_the_last_log(
    quickstart: Quickstart, workdir: Path, monitor: CrankshaftMonitor
) -> None:
    ok_body, ok_outputs = sprocket_task(
        workdir, "hello-0", "echo hello > greeting.txt\necho to-stdout\n", monitor.tag
    )
    failing_body, failing_outputs = sprocket_task(
        workdir, "fails-0", "echo to-stderr >&2\nexit 3\n", monitor.tag
    )
    ids = [monitor.create(ok_body), monitor.create(failing_body)]
    # Another client's task with another tag value is not in the monitor's list.
    other = CrankshaftMonitor(quickstart.api)
    other_body, _ = sprocket_task(workdir, "other-0", "true\n", other.tag)
    other_id = other.create(other_body)

    states = monitor.wait(ids, timeout=quickstart.wait_timeout)
    assert set(states) == set(ids), states
    # MINIMAL: the id and the state only, whatever the state.
    assert all(set(task) == {"id", "state"} for page in monitor.listed for task in page)

    ok, failing = (monitor.get_full(task_id) for task_id in ids)
    # ignore_error: a non-zero exit still ends COMPLETE; crankshaft reads the code itself.
    assert ok["state"] == "COMPLETE" and exit_codes_as_crankshaft(ok) == [0], why(ok)
    assert failing["state"] == "COMPLETE", why(failing)
    assert exit_codes_as_crankshaft(failing) == [3], why(failing)
    assert ok["tags"] == {GROUP_TAG: monitor.tag}
    # What sprocket reads afterwards: the work directory, stdout and stderr, from its outputs.
    assert (ok_outputs / "work" / "greeting.txt").read_text() == "hello\n"
    assert (ok_outputs / "stdout").read_text() == "to-stdout\n"
    assert (failing_outputs / "stderr").read_text() == "to-stderr\n"
    other.wait([other_id], timeout=quickstart.wait_timeout)


def test_a_system_error_is_reported_from_the_last_logs_system_logs(
    quickstart: Quickstart, workdir: Path, monitor: CrankshaftMonitor
) -> None:
    body, _ = sprocket_task(workdir, "lost-input-0", "cat /mnt/inputs/data.txt\n", monitor.tag)
    # An input gone by the time the job runs (one missing at create is a 400 of its own).
    vanishing = workdir / "inputs" / "removed-after-create"
    vanishing.write_text("soon gone\n")
    give_to_account(vanishing, workdir)
    body["inputs"].append(
        {"url": file_url(vanishing), "path": "/mnt/inputs/data.txt", "type": "FILE"}
    )
    task_id = monitor.create(body)
    vanishing.unlink()
    assert monitor.wait([task_id], timeout=quickstart.wait_timeout)[task_id] == "SYSTEM_ERROR"
    message = system_error_as_crankshaft(monitor.get_full(task_id))
    assert "/mnt/inputs/data.txt" in message and str(vanishing) in message, message


def test_a_cancel_as_crankshaft_sends_it(
    quickstart: Quickstart, workdir: Path, monitor: CrankshaftMonitor
) -> None:
    body, _ = sprocket_task(workdir, "long-0", "sleep 300\n", monitor.tag)
    task_id = monitor.create(body)
    # tes::v1::Client::cancel_task posts the unit value `()`: the JSON body `null`.
    answer = requests.post(
        f"{quickstart.api}/tasks/{task_id}:cancel",
        data="null",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    # TES's CancelTaskResponse, `{}`. (The tes crate 0.9, the newest whose source is read here,
    # decodes the answer as `()`, which serde reads only from `null`, so crankshaft logs a failed
    # cancel on any server that follows the spec; the task is canceled all the same.)
    assert answer.json() == {}
    assert monitor.wait([task_id], timeout=60)[task_id] == "CANCELED"


def preemptible_partitions() -> set[str]:
    """Partitions whose jobs Slurm may preempt (PreemptMode other than OFF)."""
    out = subprocess.run(
        ["scontrol", "show", "partition", "-o"], capture_output=True, text=True, check=True
    ).stdout
    found = set()
    for line in out.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if fields.get("PreemptMode", "OFF") != "OFF":
            found.add(fields["PartitionName"])
    return found


def node_memory_mb(node: str) -> int:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%m"], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[0])


def test_a_preempted_task_is_run_again_and_read_from_its_last_attempt(
    quickstart: Quickstart, workdir: Path, monitor: CrankshaftMonitor
) -> None:
    body, outputs = sprocket_task(
        workdir, "preempted-0", "sleep 20\necho survived\n", monitor.tag, preemptible=True
    )
    task_id = monitor.create(body)
    deadline = time.monotonic() + quickstart.wait_timeout
    while True:  # the test's own look: where the first attempt runs
        task = quickstart.get(task_id)
        metadata = (task.get("logs") or [{}])[-1].get("metadata", {})
        if task["state"] == "RUNNING" and metadata.get("slurm_node"):
            break
        assert task["state"] in ("QUEUED", "INITIALIZING", "RUNNING"), task
        assert time.monotonic() < deadline, task
        time.sleep(0.5)
    assert metadata["slurm_partition"] in preemptible_partitions(), metadata
    # A job of the default partition that needs the whole node preempts it.
    node = metadata["slurm_node"]
    blocker = subprocess.run(
        [
            "sbatch", "--parsable", f"--nodelist={node}", f"--mem={node_memory_mb(node)}",
            "--output=/dev/null", "--wrap=sleep 5",
        ],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    try:
        states = monitor.wait([task_id], timeout=quickstart.wait_timeout)
    finally:
        subprocess.run(["scancel", blocker], check=False)
    # The bridge ran it again: crankshaft sees the final state, never PREEMPTED, and reads the
    # last attempt.
    assert states[task_id] == "COMPLETE", states
    final = monitor.get_full(task_id)
    # The preempted job continues the task's one entry, which names it (docs/states.md).
    assert len(final["logs"]) == 1, final["logs"]
    (entry,) = final["logs"]
    assert entry["metadata"]["slurm_lost_job_ids"], entry["metadata"]
    assert any("ended in state PREEMPTED" in line for line in entry["system_logs"]), entry
    assert exit_codes_as_crankshaft(final) == [0]
    assert (outputs / "stdout").read_text() == "survived\n"
