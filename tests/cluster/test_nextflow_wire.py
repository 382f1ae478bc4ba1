"""Nextflow's TES executor (the nf-ga4gh plugin 1.4), replayed on the wire against the service
the quickstart starts.

Nextflow cannot run here: its launcher downloads its jars and the plugin at the first run, and
the test machines reach neither GitHub nor the plugin registry. So this test does what the
plugin does for each task, as its source builds it (nf-ga4gh 1.4.0 and 1.4.2,
src/main/groovy/nextflow/ga4gh/tes/executor/: TesTaskHandler.groovy, TesExecutor.groovy,
TesFileCopyStrategy.groovy; its generated client under tes/client/), with Nextflow's own
`.command.run` (modules/nextflow/src/main/resources/nextflow/executor/command-run.txt, as
BashWrapperBuilder fills it in for an executor whose containers are native to it):

- Nextflow writes `.command.sh` and `.command.run` into the task's work directory
  (`<work>/<2 hex>/<30 hex>`) and the plugin POSTs `/v1/tasks` (`tes.endpoint` has no version;
  the client adds `/v1`): inputs and outputs are bare host paths (FilesEx.toUriString of a local
  path), staged at `/work`; the four control files (`.command.out`, `.command.err`,
  `.command.log`, `.exitcode`) are outputs without a `type`; a glob output has the work
  directory as `url` and `/work` as `path_prefix`; every other output is `FILE` unless declared
  `type: 'dir'`. `resources` carries `cpu_cores`, `ram_gb` (the `memory` directive) and
  `backend_parameters_strict: false` (the generated model's initial value, which Gson writes);
  nothing else: not `time`, not `accelerator`, not `preemptible`. One executor runs
  `bash -o pipefail -c "bash /work/.command.run 2>&1 | tee /work/.command.log"` in `/work`.
- TaskPollingMonitor checks each task every `tes.pollInterval` (1.4.2: 5 s by default; 1.4.0:
  50 ms): `checkIfRunning` (while SUBMITTED) and `checkIfCompleted` each GET the task without a
  view (the server's MINIMAL); once the state is final, `readExitStatus` GETs the FULL view and
  reads `logs[0].logs[0].exit_code` (1.4.0 always; 1.4.2 only for EXECUTOR_ERROR: COMPLETE
  reads 0, any other final state 1), `Integer.MAX_VALUE` where Groovy would throw.
- Nextflow then reads the work directory on its host: the outputs, `.command.out` (stdout),
  `.command.err`; on abort it POSTs `/v1/tasks/{id}:cancel` and polls no more.

Everything after the POST is real: the quickstart's service, Slurm, Apptainer and the wrapper's
traps, subshells and `tee`s in the container's `/work`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.cluster.test_multinode import kill_node, restore_nodes
from tests.fixtures.cluster import LocalCluster
from tests.fixtures.quickstart import Quickstart, give_to_account

pytestmark = pytest.mark.cluster

__all__ = ["restore_nodes"]  # a fixture of test_multinode's, used here

#: TesTaskHandler.WORK_DIR: where the task's files are in the container.
WORK = "/work"
#: The executor's command is `bash ...`: the image needs bash (alpine's busybox has none).
IMAGE = "python:3-slim"
#: What Groovy's readExitStatus returns when reading the exit code throws.
JAVA_MAX_INT = 2**31 - 1
#: TesState, the client's enum: Gson turns any other state into null.
TES_STATES = {
    "UNKNOWN", "QUEUED", "INITIALIZING", "RUNNING", "PAUSED", "COMPLETE", "EXECUTOR_ERROR",
    "SYSTEM_ERROR", "CANCELED", "PREEMPTED", "CANCELING",
}  # fmt: skip
FINAL = ("COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED")
STARTED = ("INITIALIZING", "RUNNING", "PAUSED", *FINAL)
#: TaskRun's control files, as the plugin lists them among the outputs (without a type).
CONTROL_OUTPUTS = (".command.out", ".command.err", ".command.log", ".exitcode")


@dataclass(frozen=True)
class Plugin:
    version: str
    #: TesExecutor.createTaskMonitor: `tes.pollInterval` (1.4.2) or a fixed 50 ms (1.4.0).
    poll_interval: float


PLUGIN_140 = Plugin("1.4.0", poll_interval=0.05)
PLUGIN_142 = Plugin("1.4.2", poll_interval=5.0)


def command_run(task_name: str) -> str:
    """Nextflow's `.command.run` for a TES task: BashWrapperBuilder's rendering of
    command-run.txt with TesFileCopyStrategy (no staging or unstaging script, `.exitcode`
    written relative to the work directory), `NXF_CHDIR=/work` as header
    (TesTaskHandler.newTesBashBuilder), no container command (the executor is
    container-native), no scratch, no trace. Helpers the rendering does not call are left out."""
    return f"""#!/bin/bash
NXF_CHDIR={WORK}
# NEXTFLOW TASK: {task_name}
set -e
set -u
NXF_DEBUG=${{NXF_DEBUG:=0}}; [[ $NXF_DEBUG > 1 ]] && set -x
NXF_ENTRY=${{1:-nxf_main}}

nxf_kill() {{
    declare -a children
    while read P PP;do
        children[$PP]+=" $P"
    done < <(ps -e -o pid= -o ppid=)

    kill_all() {{
        [[ $1 != $$ ]] && kill $1 2>/dev/null || true
        for i in ${{children[$1]:=}}; do kill_all $i; done
    }}

    kill_all $1
}}

on_exit() {{
    exit_status=${{nxf_main_ret:=$?}}
    printf -- $exit_status > .exitcode
    set +u
    exit $exit_status
}}

on_term() {{
    set +e
    [[ "$pid" ]] && nxf_kill $pid
}}

nxf_launch() {{
    /bin/bash -ue .command.sh
}}

nxf_main() {{
    trap on_exit EXIT
    trap on_term TERM INT USR2
    trap '' USR1

    [[ "${{NXF_CHDIR:-}}" ]] && cd "$NXF_CHDIR"
    NXF_SCRATCH=''
    set +u
    set -u
    [[ $NXF_SCRATCH ]] && cd $NXF_SCRATCH
    export NXF_TASK_WORKDIR="$PWD"

    set +e
    (set -o pipefail; (nxf_launch | tee .command.out) 3>&1 1>&2 2>&3 | tee .command.err) &
    pid=$!
    wait $pid || nxf_main_ret=$?
}}

$NXF_ENTRY
"""


@dataclass
class NextflowTask:
    """What a TaskRun holds that the plugin reads."""

    name: str
    script: str
    #: The stage name of each input file (TaskRun.getInputFilesMap) and where it is.
    inputs: dict[str, Path] = field(default_factory=dict)
    #: Each `path` output's pattern and the type the process declares ('file' unless 'dir').
    outputs: list[tuple[str, str]] = field(default_factory=list)
    cpus: int = 1
    memory_bytes: int | None = None
    work_dir: Path = Path()


def make_work_dir(work: Path) -> Path:
    """TaskProcessor's work directory of a task: `<work>/<first 2 hex of the hash>/<rest>`."""
    digest = secrets.token_hex(16)
    path = work / digest[:2] / digest[2:]
    path.mkdir(parents=True)
    give_to_account(path, work)
    return path


def write_task_files(task: NextflowTask, work: Path) -> None:
    """BashWrapperBuilder.build: `.command.run`, and `.command.sh` with the shebang of the
    `shell` directive (`/bin/bash -ue`, TaskProcessor.normalizeScript)."""
    task.work_dir = make_work_dir(work)
    for name, text in (
        (".command.run", command_run(task.name)),
        (".command.sh", f"#!/bin/bash -ue\n{task.script}\n"),
    ):
        (task.work_dir / name).write_text(text)
        give_to_account(task.work_dir / name, task.work_dir)


def tes_body(task: NextflowTask) -> dict[str, Any]:
    """TesTaskHandler.newTesTask, serialised as its Gson client does (nulls left out)."""

    def in_item(path: Path, name: str | None = None) -> dict[str, Any]:
        return {
            "url": str(path),
            "path": f"{WORK}/{name or path.name}",
            "type": "DIRECTORY" if path.is_dir() else "FILE",
        }

    def out_item(name: str, kind: str | None = None) -> dict[str, Any]:
        if "*" in name or "?" in name:
            item = {"url": str(task.work_dir), "path": f"{WORK}/{name}", "path_prefix": WORK}
        else:
            item = {"url": str(task.work_dir / name), "path": f"{WORK}/{name}"}
        return {**item, "type": kind} if kind else item

    inputs = [in_item(task.work_dir / ".command.sh"), in_item(task.work_dir / ".command.run")]
    inputs += [in_item(path, name) for name, path in task.inputs.items()]
    outputs = [out_item(name) for name in CONTROL_OUTPUTS]
    outputs += [
        out_item(pattern, "DIRECTORY" if kind == "dir" else "FILE")
        for pattern, kind in task.outputs
    ]
    resources: dict[str, Any] = {"cpu_cores": task.cpus, "backend_parameters_strict": False}
    if task.memory_bytes is not None:
        resources["ram_gb"] = task.memory_bytes / 1073741824
    return {
        "name": task.name,
        "inputs": inputs,
        "outputs": outputs,
        "resources": resources,
        "executors": [
            {
                "image": IMAGE,
                "command": [
                    "bash",
                    "-o",
                    "pipefail",
                    "-c",
                    f"bash {WORK}/.command.run 2>&1 | tee {WORK}/.command.log",
                ],
                "workdir": WORK,
            }
        ],
    }


def decode_as_gson(task: dict[str, Any]) -> None:
    """What the plugin's Gson models need of an answer: a known state, string metadata
    (Map<String, String>), an integer exit code, lists where the models hold lists."""
    assert isinstance(task["id"], str) and task["state"] in TES_STATES, task
    for log in task.get("logs") or []:
        assert all(isinstance(v, str) for v in (log.get("metadata") or {}).values()), log
        assert isinstance(log.get("logs", []), list) and isinstance(log.get("outputs", []), list)
        for executor_log in log.get("logs") or []:
            assert isinstance(executor_log.get("exit_code", 0), int), executor_log


class GroovyNullPointer(Exception):
    """What Groovy throws where the plugin dereferences a null."""


def groovy_index(items: list[Any] | None, index: int) -> Any:
    """Groovy's `list[i]`: null past the end, a NullPointerException on a null list."""
    if items is None:
        raise GroovyNullPointer
    return items[index] if index < len(items) else None


def executor_exit_code(task: dict[str, Any]) -> int:
    """`tesTask.logs[0].logs[0].exitCode`; Gson leaves TesTaskLog.logs an empty list when the
    field is absent, and an absent exitCode is a null Integer."""
    task_log = groovy_index(task.get("logs"), 0)
    if task_log is None:
        raise GroovyNullPointer
    executor_log = groovy_index(task_log.get("logs", []), 0)
    if executor_log is None or executor_log.get("exit_code") is None:
        raise GroovyNullPointer
    return int(executor_log["exit_code"])


def read_exit_status(plugin: Plugin, task: dict[str, Any]) -> int:
    """TesTaskHandler.readExitStatus over the FULL view, as each version reads it."""
    try:
        if plugin.version == "1.4.0":
            return executor_exit_code(task)
        if task["state"] == "COMPLETE":
            return 0
        code = executor_exit_code(task)  # evaluated before the state is looked at
        return code if task["state"] == "EXECUTOR_ERROR" else 1
    except GroovyNullPointer:
        return JAVA_MAX_INT


@dataclass
class Handler:
    """One TesTaskHandler: its task, its request id and status, and what it read."""

    task: NextflowTask
    request_id: str = ""
    status: str = "NEW"
    exit_status: int | None = None
    final: dict[str, Any] = field(default_factory=dict)


class NextflowClient:
    """The plugin's TaskServiceApi over `tes.endpoint`, recording each request's method, path
    and view."""

    def __init__(self, endpoint: str, plugin: Plugin) -> None:
        self.endpoint = endpoint
        self.plugin = plugin
        self.requests: list[tuple[str, str, str | None]] = []

    def _get_task(self, task_id: str, view: str | None) -> dict[str, Any]:
        # ApiClient.parameterToPair leaves out a null view: no `view` parameter at all.
        params = {"view": view} if view else {}
        answer = requests.get(f"{self.endpoint}/v1/tasks/{task_id}", params=params, timeout=10)
        self.requests.append(("GET", f"/v1/tasks/{task_id}", view))
        assert answer.status_code == 200, answer.text
        task = answer.json()
        decode_as_gson(task)
        return task

    def submit(self, handler: Handler) -> None:
        answer = requests.post(f"{self.endpoint}/v1/tasks", json=tes_body(handler.task), timeout=10)
        self.requests.append(("POST", "/v1/tasks", None))
        assert answer.status_code == 200, answer.text
        handler.request_id = answer.json()["id"]
        handler.status = "SUBMITTED"

    def check_if_running(self, handler: Handler) -> bool:
        if handler.status != "SUBMITTED":
            return False
        if self._get_task(handler.request_id, None)["state"] in STARTED:
            handler.status = "RUNNING"
            return True
        return False

    def check_if_completed(self, handler: Handler) -> bool:
        if handler.status != "RUNNING":
            return False
        if self._get_task(handler.request_id, None)["state"] not in FINAL:
            return False
        handler.final = self._get_task(handler.request_id, "FULL")
        handler.exit_status = read_exit_status(self.plugin, handler.final)
        handler.status = "COMPLETED"
        return True

    def kill(self, handler: Handler) -> dict[str, Any]:
        answer = requests.post(f"{self.endpoint}/v1/tasks/{handler.request_id}:cancel", timeout=10)
        self.requests.append(("POST", f"/v1/tasks/{handler.request_id}:cancel", None))
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()  # TesCancelTaskResponse: a JSON object
        return body

    def run(
        self,
        handlers: list[Handler],
        timeout: float,
        until: Callable[[list[Handler]], bool] | None = None,
    ) -> None:
        """TaskPollingMonitor: submit, then every poll interval checkTaskStatus of each task
        (checkIfRunning, then checkIfCompleted), until all completed or `until` holds."""
        for handler in handlers:
            self.submit(handler)
        self.poll(handlers, timeout, until)

    def poll(
        self,
        handlers: list[Handler],
        timeout: float,
        until: Callable[[list[Handler]], bool] | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        while not all(h.status == "COMPLETED" for h in handlers):
            for handler in handlers:
                self.check_if_running(handler)
                self.check_if_completed(handler)
            if until and until(handlers):
                return
            assert time.monotonic() < deadline, [h.status for h in handlers]
            time.sleep(self.plugin.poll_interval)


@pytest.fixture
def work(workdir: Path) -> Path:
    """Nextflow's `-w`: inside the quickstart's shared data directory."""
    path = workdir / "work"
    path.mkdir()
    give_to_account(path, workdir)
    return path


def new_task(work: Path, name: str, script: str, **kwargs: Any) -> Handler:
    task = NextflowTask(name=name, script=script, **kwargs)
    write_task_files(task, work)
    return Handler(task)


def system_logs(task: dict[str, Any]) -> list[str]:
    return [line for log in task.get("logs") or [] for line in log.get("system_logs") or []]


def test_the_body_is_what_the_plugin_posts_and_the_server_keeps_it(
    quickstart: Quickstart, work: Path
) -> None:
    # The POST as the plugin sends it (outputs without a type, a glob with path_prefix,
    # backend_parameters_strict false) is accepted and kept as sent.
    handler = new_task(
        work, "SAY (1)", "echo hi > one.txt", outputs=[("*.txt", "file")], memory_bytes=2**29
    )
    body = tes_body(handler.task)
    assert body["resources"] == {
        "cpu_cores": 1, "backend_parameters_strict": False, "ram_gb": 0.5
    }  # fmt: skip
    client = NextflowClient(quickstart.url, PLUGIN_142)
    client.run([handler], timeout=quickstart.wait_timeout)
    final = handler.final
    assert final["state"] == "COMPLETE", final
    assert handler.exit_status == 0
    assert final["inputs"] == body["inputs"]
    # The control outputs come back with TES's default type: the plugin's Gson model reads it.
    assert final["outputs"] == [{"type": "FILE", **item} for item in body["outputs"]]
    assert final["executors"] == body["executors"]
    assert final["resources"]["backend_parameters_strict"] is False
    # The views the plugin asked for: none while polling (the server's MINIMAL), FULL once.
    views = [view for method, _, view in client.requests if method == "GET"]
    assert views[-1] == "FULL" and set(views[:-1]) == {None}, views
    # What Nextflow reads on its host afterwards.
    assert (handler.task.work_dir / ".exitcode").read_text() == "0"
    assert (handler.task.work_dir / "one.txt").read_text() == "hi\n"
    assert (handler.task.work_dir / ".command.out").read_text() == ""
    assert (handler.task.work_dir / ".command.err").read_text() == ""


def test_a_chained_pipeline_reads_the_first_tasks_output_from_its_work_directory(
    quickstart: Quickstart, work: Path
) -> None:
    client = NextflowClient(quickstart.url, PLUGIN_142)
    first = new_task(
        work, "CHAIN:MAKE (1)", "printf 'a\\nb\\nc\\n' > lines.txt; echo made",
        outputs=[("lines.txt", "file")],
    )  # fmt: skip
    client.run([first], timeout=quickstart.wait_timeout)
    assert first.final["state"] == "COMPLETE" and first.exit_status == 0, first.final
    made = first.task.work_dir / "lines.txt"
    assert made.read_text() == "a\nb\nc\n"
    assert (first.task.work_dir / ".command.out").read_text() == "made\n"
    assert (first.task.work_dir / ".command.log").read_text() == "made\n"

    # Task 2's input is task 1's output, where Nextflow found it: a bare path in task 1's work
    # directory, staged under its own name.
    second = new_task(
        work, "CHAIN:COUNT (1)", "wc -l < lines.txt > count.txt",
        inputs={"lines.txt": made}, outputs=[("count.txt", "file")],
    )  # fmt: skip
    client.run([second], timeout=quickstart.wait_timeout)
    assert second.final["state"] == "COMPLETE" and second.exit_status == 0, second.final
    assert (second.task.work_dir / "count.txt").read_text() == "3\n"
    assert (second.task.work_dir / ".exitcode").read_text() == "0"


def test_a_scatter_at_the_1_4_0_cadence_runs_every_task(quickstart: Quickstart, work: Path) -> None:
    # The default queueSize of the executor is 5: five tasks at once, each polled every 50 ms.
    handlers = [
        new_task(
            work, f"SCATTER (chunk_{i})", f"echo {i} > part_{i}.out", outputs=[("*.out", "file")]
        )
        for i in range(5)
    ]
    client = NextflowClient(quickstart.url, PLUGIN_140)
    client.run(handlers, timeout=quickstart.wait_timeout)
    for i, handler in enumerate(handlers):
        assert handler.final["state"] == "COMPLETE", handler.final
        assert handler.exit_status == 0, handler.final  # 1.4.0 reads it from logs[0].logs[0]
        assert (handler.task.work_dir / f"part_{i}.out").read_text() == f"{i}\n"
        assert (handler.task.work_dir / ".exitcode").read_text() == "0"


@pytest.mark.parametrize("plugin", [PLUGIN_140, PLUGIN_142], ids=lambda p: p.version)
def test_a_failing_script_is_read_as_its_exit_code(
    quickstart: Quickstart, work: Path, plugin: Plugin
) -> None:
    handler = new_task(work, "FAIL (1)", "echo about to fail >&2\nexit 3")
    NextflowClient(quickstart.url, plugin).run([handler], timeout=quickstart.wait_timeout)
    assert handler.final["state"] == "EXECUTOR_ERROR", handler.final
    assert handler.exit_status == 3
    # The wrapper's own record agrees, and the outputs came back for Nextflow's error report.
    assert (handler.task.work_dir / ".exitcode").read_text() == "3"
    assert (handler.task.work_dir / ".command.err").read_text() == "about to fail\n"
    assert "about to fail" in (handler.task.work_dir / ".command.log").read_text()


def test_a_task_nextflow_kills_is_canceled(quickstart: Quickstart, work: Path) -> None:
    handler = new_task(work, "LONG (1)", "sleep 300")
    client = NextflowClient(quickstart.url, PLUGIN_142)
    # Abort once it runs: TaskPollingMonitor.cleanup calls kill() on each task in its queue.
    client.run(
        [handler], timeout=quickstart.wait_timeout, until=lambda hs: hs[0].status == "RUNNING"
    )
    assert client.kill(handler) == {}
    assert client.requests[-1] == ("POST", f"/v1/tasks/{handler.request_id}:cancel", None)
    # Nextflow polls no more; a look afterwards sees the state the server keeps.
    assert client._get_task(handler.request_id, None)["state"] == "CANCELED"
    assert client._get_task(handler.request_id, "FULL")["state"] == "CANCELED"


def test_an_nf_core_index_directory_declared_as_a_path_comes_back_as_a_directory(
    quickstart: Quickstart, work: Path
) -> None:
    # nf-core modules declare `path "index"` (no `type: 'dir'`): the plugin sends it as FILE.
    handler = new_task(
        work,
        "INDEX (genome)",
        "mkdir -p index/sub\necho a > index/a.idx\necho b > index/sub/b.idx",
        outputs=[("index", "file")],
    )
    NextflowClient(quickstart.url, PLUGIN_142).run([handler], timeout=quickstart.wait_timeout)
    final = handler.final
    assert final["state"] == "COMPLETE" and handler.exit_status == 0, final
    index = handler.task.work_dir / "index"
    assert (index / "a.idx").read_text() == "a\n"
    assert (index / "sub" / "b.idx").read_text() == "b\n"
    listed = {item["url"] for item in final["logs"][-1]["outputs"]}
    assert {str(index / "a.idx"), str(index / "sub" / "b.idx")} <= listed, listed
    assert any(
        f"{WORK}/index" in line and "uploaded as a directory" in line for line in system_logs(final)
    ), system_logs(final)


def test_an_optional_output_not_written_leaves_the_task_complete(
    quickstart: Quickstart, work: Path
) -> None:
    # `path "report.html", optional: true` is listed by the plugin like any other output.
    handler = new_task(
        work, "MAYBE (1)", "echo kept > kept.txt",
        outputs=[("kept.txt", "file"), ("report.html", "file")],
    )  # fmt: skip
    NextflowClient(quickstart.url, PLUGIN_142).run([handler], timeout=quickstart.wait_timeout)
    final = handler.final
    assert final["state"] == "COMPLETE" and handler.exit_status == 0, final
    assert (handler.task.work_dir / "kept.txt").read_text() == "kept\n"
    assert not (handler.task.work_dir / "report.html").exists()
    assert any(
        f"{WORK}/report.html" in line and "not found after the executors ran; ignored" in line
        for line in system_logs(final)
    ), system_logs(final)


def test_a_task_retried_after_a_node_loss_is_read_with_its_last_exit_code(
    quickstart: Quickstart, local_cluster: LocalCluster, work: Path, restore_nodes: None
) -> None:
    handler = new_task(work, "RETRIED (1)", "sleep 15\nexit 3")
    client = NextflowClient(quickstart.url, PLUGIN_142)
    client.submit(handler)
    # The test's own look (not the plugin's): the node the first attempt's executor runs on.
    deadline = time.monotonic() + quickstart.wait_timeout
    while True:
        task = quickstart.get(handler.request_id)
        log = task["logs"][-1] if task.get("logs") else {}
        node = log.get("metadata", {}).get("slurm_node")
        if task["state"] == "RUNNING" and node:
            break
        assert task["state"] in ("QUEUED", "INITIALIZING", "RUNNING"), task
        assert time.monotonic() < deadline, task
        time.sleep(0.3)
    kill_node(local_cluster, node)
    client.poll([handler], timeout=quickstart.wait_timeout)
    final = handler.final
    assert final["state"] == "EXECUTOR_ERROR", final
    # The lost job continues the task's one entry (docs/states.md), which names it.
    assert len(final["logs"]) == 1, final["logs"]
    (entry,) = final["logs"]
    assert entry["metadata"]["slurm_lost_job_ids"], entry["metadata"]
    assert any("submitting it again" in line for line in entry["system_logs"]), entry
    assert entry["logs"][0]["exit_code"] == 3, final["logs"]
    assert (handler.task.work_dir / ".exitcode").read_text() == "3"
    # What Nextflow reads: logs[0].logs[0].exit_code of the FULL view.
    assert handler.exit_status == 3, final["logs"]
