"""Tasks through the whole bridge on the real cluster: API → poller → sbatch → Apptainer → back.

Every test here submits real Slurm jobs that run real containers from the local registry.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import requests
import tes

from bench.common import slurm_jobs_by_task
from bridge.slurm import SlurmClient
from tests.tes_cli import tes_task

pytestmark = pytest.mark.cluster

ALPINE = "alpine"


def executor(*command: str, **kw) -> dict:
    return {"image": ALPINE, "command": list(command), **kw}


def only_log(task: dict) -> dict:
    assert len(task["logs"]) == 1, task["logs"]
    return task["logs"][0]


def test_echo_hello_completes_with_its_output(bridge_service):
    task = bridge_service.run({"executors": [executor("echo", "hello")]})
    assert task["state"] == "COMPLETE", task
    log = only_log(task)
    assert log["logs"] == [{**log["logs"][0], "stdout": "hello\n", "stderr": "", "exit_code": 0}]
    assert log["logs"][0]["start_time"] <= log["logs"][0]["end_time"]
    assert log["start_time"] and log["end_time"]
    metadata = log["metadata"]
    assert metadata["slurm_job_id"].isdigit()
    metadata = only_log(bridge_service.with_final_facts(task["id"]))["metadata"]
    assert metadata["slurm_partition"] and metadata["slurm_node"]
    basic = bridge_service.get(task["id"], "BASIC")
    assert "stdout" not in basic["logs"][0]["logs"][0]


def test_missing_command_is_an_executor_error(bridge_service):
    task = bridge_service.run({"executors": [executor("ERROR")]})
    assert task["state"] == "EXECUTOR_ERROR", task
    (entry,) = only_log(task)["logs"]
    assert entry["exit_code"] != 0


def sacct_default(job_id: str, timeout: float = 30) -> dict[str, str]:
    """The job's line of `sacct -X -j ID` as a Slurm user reads it: of its default columns
    (JobID JobName Partition Account AllocCPUS State ExitCode) those that are never blank, at
    their default widths (JobName cut at 10 characters). slurmdbd may hold only its placeholder
    record ("allocation") a while after the job ended (bridge/slurm/sacct.py): read again."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            ["sacct", "-X", "-j", job_id, "--format=JobID,JobName,State,ExitCode"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        header = out[0].split()
        (line,) = [line for line in out[2:] if line.split()[0] == job_id]
        facts = dict(zip(header, line.split(), strict=True))
        if facts["JobName"] != "allocation" or time.monotonic() > deadline:
            return facts
        time.sleep(1)


@pytest.mark.parametrize(("ignore_error", "executor_logs"), [(False, 1), (True, 2)])
def test_first_executor_failing_stops_unless_ignore_error(
    bridge_service, ignore_error, executor_logs
):
    name = f"failing-step-{ignore_error}"
    task = bridge_service.run(
        {
            "name": name,
            "executors": [
                executor("sh", "-c", "echo first; exit 42", ignore_error=ignore_error),
                executor("echo", "second"),
            ],
        }
    )
    logs = only_log(task)["logs"]
    assert len(logs) == executor_logs
    assert logs[0]["exit_code"] == 42 and logs[0]["stdout"] == "first\n"
    if ignore_error:
        assert task["state"] == "COMPLETE"
        assert logs[1]["stdout"] == "second\n"
    else:
        assert task["state"] == "EXECUTOR_ERROR"
    # Slurm's record agrees with the task, under the task's name as sacct shows it by default.
    metadata = only_log(bridge_service.with_final_facts(task["id"]))["metadata"]
    facts = sacct_default(metadata["slurm_job_id"])
    assert facts["JobName"] == f"{name[:9]}+", facts
    if ignore_error:
        assert (facts["State"], facts["ExitCode"], metadata.get("reason")) == (
            "COMPLETED", "0:0", None
        )  # fmt: skip
    else:
        assert (facts["State"], facts["ExitCode"]) == ("FAILED", "42:0"), facts
        basic = bridge_service.get(task["id"], "BASIC")
        assert basic["logs"][-1]["metadata"]["reason"] == "exit 42", basic


def test_long_stdout_keeps_its_head_and_tail_in_the_document_and_is_whole_elsewhere(
    bridge_service,
):
    # log_tail_bytes is 2048 in the test service; 10,000 numbered lines far exceed it.
    whole = "".join(f"{n}\n" for n in range(1, 10001))
    task = bridge_service.run({"executors": [executor("seq", "1", "10000")]})
    stdout = only_log(task)["logs"][0]["stdout"]
    match = re.fullmatch(
        r"(.*\n)\[tes-bridge: ([\d,]+) of ([\d,]+) bytes left out here; the whole stdout: GET "
        rf"/ga4gh/tes/v1/tasks/{task['id']}/output\?executor=0&stream=stdout\]\n(.*)",
        stdout,
        re.DOTALL,
    )
    assert match, stdout
    head, tail = match[1], match[4]
    left_out, size = (int(match[i].replace(",", "")) for i in (2, 3))
    assert head.startswith("1\n2\n3\n") and tail.endswith("9999\n10000\n")
    assert whole.startswith(head) and whole.endswith("\n" + tail)
    assert len(head) + len(tail) + left_out == size == len(whole)
    assert len(head) + len(tail) <= 2048
    # The whole stream: `tes-bridge task logs` reads it from the output endpoint.
    logs = tes_task(bridge_service.url, "logs", task["id"])
    assert (logs.returncode, logs.stdout) == (0, whole), logs.stderr


def test_files_workdir_env_volumes_content_and_directory_output(bridge_service):
    out_dir = bridge_service.data_dir / "result-dir"
    task = bridge_service.run(
        {
            "inputs": [{"path": "/in/greeting.txt", "content": "hello from content\n"}],
            "outputs": [
                {"path": "/out", "url": f"file://{out_dir}", "type": "DIRECTORY"},
                {"path": "/work/sorted.txt", "url": f"file://{bridge_service.data_dir}/sorted.txt"},
            ],
            "volumes": ["/shared"],
            "executors": [
                executor(
                    "sh",
                    "-c",
                    'echo "$GREETING, $OTHER" > /shared/note; pwd; cat; echo oops >&2',
                    workdir="/in",
                    env={"GREETING": "hi, there", "OTHER": "$(id) `id` 'q'"},
                    stdin="/in/greeting.txt",
                    stdout="/out/stdout.txt",
                    stderr="/out/stderr.txt",
                ),
                executor(
                    "sh",
                    "-c",
                    "mkdir -p /out/sub && cat /shared/note > /out/sub/note.txt && "
                    "printf 'b\\na\\n' | sort > /work/sorted.txt",
                ),
            ],
        }
    )
    assert task["state"] == "COMPLETE", task
    log = only_log(task)
    assert (out_dir / "stdout.txt").read_text() == "/in\nhello from content\n"
    assert (out_dir / "stderr.txt").read_text() == "oops\n"
    assert (out_dir / "sub" / "note.txt").read_text() == "hi, there, $(id) `id` 'q'\n"
    assert (bridge_service.data_dir / "sorted.txt").read_text() == "a\nb\n"
    # stdout went to the executor's own file; the log still shows its tail.
    assert log["logs"][0]["stdout"] == "/in\nhello from content\n"
    uploaded = {o["path"]: o for o in log["outputs"]}
    assert uploaded["/out/sub/note.txt"]["size_bytes"] == str(len("hi, there, $(id) `id` 'q'\n"))
    assert uploaded["/work/sorted.txt"]["url"] == f"file://{bridge_service.data_dir}/sorted.txt"
    assert all(isinstance(o["size_bytes"], str) for o in log["outputs"])


def test_env_home_is_the_executors_home_and_binds_nothing_of_the_host(bridge_service):
    """cwl-tes sends HOME = the output directory. Apptainer refuses APPTAINERENV_HOME: it
    arrives as `--no-home --home`, which sets $HOME without binding the host's directory."""
    out_dir = bridge_service.data_dir / "home-out"
    host_home = bridge_service.data_dir / "host-home"
    host_home.mkdir()
    (host_home / "secret.txt").write_text("host file\n")
    task = bridge_service.run(
        {
            "outputs": [{"path": "/out", "url": f"file://{out_dir}", "type": "DIRECTORY"}],
            "executors": [
                executor(
                    "sh",
                    "-c",
                    'echo "$HOME|$OTHER"; cd && pwd; echo hi > "$HOME/h.txt"',
                    env={"HOME": "/out", "OTHER": "x"},
                ),
                executor(
                    "sh",
                    "-c",
                    'echo "$HOME"; cat "$HOME/secret.txt" 2>/dev/null || echo absent',
                    env={"HOME": str(host_home)},
                    workdir="/tmp",
                ),
            ],
        }
    )
    assert task["state"] == "COMPLETE", task
    first, second = only_log(task)["logs"]
    assert first["stdout"] == "/out|x\n/out\n"
    assert (out_dir / "h.txt").read_text() == "hi\n"
    assert second["stdout"] == f"{host_home}\nabsent\n"


def test_file_input_from_an_allowed_directory(bridge_service):
    source = bridge_service.data_dir / "input.bin"
    source.write_bytes(bytes(range(256)) * 1000)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    task = bridge_service.run(
        {
            "inputs": [{"path": "/data/input.bin", "url": f"file://{source}"}],
            "executors": [executor("sha256sum", "/data/input.bin")],
        }
    )
    assert task["state"] == "COMPLETE", task
    assert only_log(task)["logs"][0]["stdout"].split()[0] == digest


def test_hostile_values_run_exactly_what_was_asked(bridge_service, local_cluster, tmp_path):
    marker = Path("/tmp/tes-bridge-pwned")
    # Where a job would leave it: the /tmp of its compute node.
    markers = [d / marker.name for d in local_cluster.tmp_dirs()]
    for path in markers:
        path.unlink(missing_ok=True)
    hostile = [
        f"'; touch {marker} #",
        f'"; touch {marker}; "',
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"a\ntouch {marker}\n",
        "ünïcödé ✓ \\ \t end",
    ]
    task = bridge_service.run(
        {
            "name": hostile[0],
            "description": hostile[2],
            "tags": {hostile[1]: hostile[3]},
            "inputs": [{"path": "/in/$(id)'x\"`y`", "content": hostile[4]}],
            "executors": [
                executor("printf", "%s|", *hostile, env={"V": hostile[2]}, workdir="/in"),
                # The input's hostile file name is reached by a glob, not by quoting it again.
                executor("sh", "-c", 'printf "%s" "$V"; cat /in/*', env={"V": hostile[3]}),
            ],
        }
    )
    assert task["state"] == "COMPLETE", task
    first, second = only_log(task)["logs"]
    assert first["stdout"] == "|".join(hostile) + "|"
    assert second["stdout"] == hostile[3] + hostile[4]
    assert not any(path.exists() for path in markers)


def test_more_memory_than_any_node_has_is_refused_at_create(bridge_service):
    """Once the poller has read the partitions (GET /capabilities), a task sbatch would refuse
    for its memory is a 400 naming resources.ram_gb and the largest node's memory; so are
    CPUs and GPUs no node has."""
    deadline = time.monotonic() + 60
    while not requests.get(f"{bridge_service.api}/capabilities", timeout=10).json()["partitions"]:
        assert time.monotonic() < deadline, "the poller never read the partitions"
        time.sleep(0.5)
    body = {"resources": {"ram_gb": 100000}, "executors": [executor("true")]}
    answer = requests.post(f"{bridge_service.api}/tasks", json=body, timeout=10)
    assert answer.status_code == 400, answer.text
    (error,) = answer.json()["errors"]
    assert (
        error["field"] == "resources.ram_gb" and "largest node of any partition" in error["message"]
    )
    body = {
        "resources": {"backend_parameters": {"partition": "mian"}},
        "executors": [executor("true")],
    }
    answer = requests.post(f"{bridge_service.api}/tasks", json=body, timeout=10)
    assert answer.status_code == 400 and "its partitions: " in answer.text and "main" in answer.text
    # So are CPUs and GPUs no node has (the nodes: 2 fake GPUs each), and an input not there.
    cpus = max(p["max_cpus_per_node"] for p in requests.get(
        f"{bridge_service.api}/capabilities", timeout=10).json()["partitions"])  # fmt: skip
    where = "resources.backend_parameters"
    for resources, field, said in [
        ({"cpu_cores": cpus + 1}, "resources.cpu_cores", f"has: {cpus} CPUs"),
        ({"backend_parameters": {"gpus": "fake:3"}}, f"{where}.gpus", "one node of any "),
        ({"backend_parameters": {"gres": "gpu:a100:1"}}, f"{where}.gres", "types there: fake"),
    ]:
        body = {"resources": resources, "executors": [executor("true")]}
        answer = requests.post(f"{bridge_service.api}/tasks", json=body, timeout=10)
        assert answer.status_code == 400, answer.text
        assert [(e["field"], said in e["message"]) for e in answer.json()["errors"]] == [
            (field, True)
        ], answer.text
    missing = f"file://{bridge_service.data_dir}/never-written.txt"
    body = {"inputs": [{"url": missing, "path": "/in.txt"}], "executors": [executor("true")]}
    answer = requests.post(f"{bridge_service.api}/tasks", json=body, timeout=10)
    assert answer.status_code == 400 and "inputs[0].url" in answer.text, answer.text


def test_cancel_of_a_running_task(bridge_service):
    task_id = bridge_service.create({"name": "sleeper", "executors": [executor("sleep", "300")]})
    task = bridge_service.wait(task_id, states={"RUNNING"}, timeout=120)
    job_id = task["logs"][0]["metadata"]["slurm_job_id"]
    # A plain squeue shows 8 characters of a job's name: the task's name comes first.
    queue = subprocess.run(
        ["squeue", "-j", job_id], env={k: v for k, v in os.environ.items() if k != "SQUEUE_FORMAT"},
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    columns = dict(zip(queue[0].split(), queue[1].split(), strict=False))
    assert columns["NAME"] == "sleeper-", queue
    bridge_service.cancel(task_id)
    assert bridge_service.get(task_id, "MINIMAL")["state"] == "CANCELED"
    client = SlurmClient()
    deadline = time.monotonic() + 60
    while True:
        info = client.queue([job_id]).get(job_id)
        if info is None or info.state not in {"RUNNING", "PENDING", "COMPLETING"}:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.5)
    assert info is None or info.state == "CANCELLED"
    time.sleep(2)
    assert bridge_service.get(task_id, "MINIMAL")["state"] == "CANCELED"


def test_a_task_canceled_while_its_executor_runs_gets_its_jobs_final_record(bridge_service):
    task_id = bridge_service.create(
        {
            "executors": [
                executor("echo", "first"),
                executor("sh", "-c", "echo started; sleep 300"),
            ]
        }
    )
    # The first executor's log is there: the second has started.
    deadline = time.monotonic() + 120
    while True:
        task = bridge_service.get(task_id)
        if task["state"] == "RUNNING" and task["logs"] and task["logs"][-1].get("logs"):
            break
        assert task["state"] in {"QUEUED", "INITIALIZING", "RUNNING"}, task
        assert time.monotonic() < deadline, task
        time.sleep(0.3)
    time.sleep(1)
    bridge_service.cancel(task_id)
    deadline = time.monotonic() + 90
    while True:
        task = bridge_service.get(task_id, "FULL")
        assert task["state"] == "CANCELED", task
        last = task["logs"][-1]
        if last.get("metadata", {}).get("slurm_state") == "CANCELLED":
            break
        assert time.monotonic() < deadline, task
        time.sleep(0.5)
    metadata = last["metadata"]
    assert "end_time" in last and "start_time" in last, last
    assert metadata["slurm_node"] and "slurm_elapsed_seconds" in metadata, metadata
    # Only executors whose exit code is known are listed (TES wants an integer).
    assert last["logs"][0]["exit_code"] == 0 and last["logs"][0]["stdout"] == "first\n"
    assert all(isinstance(e["exit_code"], int) for e in last["logs"]), last["logs"]
    assert any("ended in state CANCELLED" in line for line in last["system_logs"]), last


def test_a_job_cancelled_in_slurm_by_an_operator_ends_its_task_canceled(bridge_service):
    """An operator's scancel ("CANCELLED by 0" in sacct) is a cancel: the task ends CANCELED,
    not submitted again as a job Slurm cancelled itself would be (plain "CANCELLED")."""
    task_id = bridge_service.create({"executors": [executor("sleep", "300")]})
    task = bridge_service.wait(task_id, states={"RUNNING"}, timeout=120)
    job_id = task["logs"][0]["metadata"]["slurm_job_id"]
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    task = bridge_service.wait(task_id, timeout=90)
    assert task["state"] == "CANCELED", task
    last = bridge_service.get(task_id, "FULL")["logs"][-1]
    assert f"Slurm job {job_id} ended in state CANCELLED" in " ".join(last["system_logs"]), last
    assert "canceled outside tes-bridge" in " ".join(last["system_logs"]), last
    assert len(bridge_service.get(task_id, "FULL")["logs"]) == 1  # not submitted again


def test_cancel_right_after_create(bridge_service):
    task_id = bridge_service.create({"executors": [executor("sleep", "60")]})
    bridge_service.cancel(task_id)
    assert bridge_service.wait(task_id, timeout=30)["state"] == "CANCELED"


def test_fifty_tasks_at_once_all_complete(bridge_service):
    ids = [
        bridge_service.create({"name": f"bulk-{i}", "executors": [executor("echo", str(i))]})
        for i in range(50)
    ]
    for i, task_id in enumerate(ids):
        task = bridge_service.wait(task_id, timeout=600)
        assert task["state"] == "COMPLETE", task
        assert only_log(task)["logs"][0]["stdout"] == f"{i}\n"


def test_poller_killed_while_tasks_run_loses_nothing_and_submits_nothing_twice(bridge_service):
    ids = [
        bridge_service.create({"executors": [executor("sh", "-c", f"sleep 2; echo {i}")]})
        for i in range(8)
    ]
    bridge_service.wait(ids[0], states={"RUNNING", "INITIALIZING", "COMPLETE"}, timeout=120)
    bridge_service.kill_poller()
    time.sleep(3)
    bridge_service.start_poller()
    tasks = []
    for i, task_id in enumerate(ids):
        task = bridge_service.wait(task_id, timeout=300)
        assert task["state"] == "COMPLETE", task
        assert only_log(task)["logs"][0]["stdout"] == f"{i}\n"
        tasks.append(task)
    # One job each, its own or an element of an array (slurm.arrays).
    jobs = slurm_jobs_by_task(bridge_service.work_dir, tasks)
    assert {task_id: len(found) for task_id, found in jobs.items()} == dict.fromkeys(ids, 1)


def test_py_tes_wait_returns_complete(bridge_service):
    client = tes.HTTPClient(bridge_service.url, timeout=10)
    task_id = client.create_task(
        tes.Task(executors=[tes.Executor(image=ALPINE, command=["echo", "py-tes"])])
    )
    done = client.wait(task_id, timeout=180)
    assert done.state == "COMPLETE"
    full = client.get_task(task_id, view="FULL")
    assert full.logs[0].logs[0].stdout == "py-tes\n"


def test_python_image_runs(bridge_service):
    task = bridge_service.run(
        {
            "executors": [
                {"image": "library/python:3-slim", "command": ["python3", "-c", "print(6 * 7)"]}
            ]
        }
    )
    assert task["state"] == "COMPLETE", task
    assert only_log(task)["logs"][0]["stdout"] == "42\n"


def test_image_that_cannot_be_pulled_is_a_system_error(bridge_service):
    task = bridge_service.run({"executors": [executor("true") | {"image": "no-such/image:1"}]})
    assert task["state"] == "SYSTEM_ERROR", task
    assert any("image" in line for line in only_log(task)["system_logs"])


def test_api_keeps_answering_while_slurm_is_down(bridge_service, local_cluster):
    script = Path(__file__).parents[2] / "deploy" / "local-cluster.sh"
    subprocess.run([str(script), "down", "slurmctld"], check=True, capture_output=True)
    try:
        started = time.monotonic()
        task_id = bridge_service.create({"executors": [executor("echo", "after outage")]})
        assert time.monotonic() - started < 2
        # sbatch itself retries for about 10 s before it gives up.
        deadline = time.monotonic() + 60
        while True:
            task = bridge_service.get(task_id)
            assert task["state"] == "QUEUED"
            lines = task.get("logs", [{}])[0].get("system_logs", [])
            if any("cannot reach Slurm" in line for line in lines):
                break
            assert time.monotonic() < deadline, task
            time.sleep(1)
        started = time.monotonic()
        assert requests.get(f"{bridge_service.api}/tasks", timeout=5).ok
        assert time.monotonic() - started < 1
    finally:
        subprocess.run([str(script), "up", "--quiet"], check=True, capture_output=True)
    task = bridge_service.wait(task_id, timeout=180)
    assert task["state"] == "COMPLETE", task
    assert task["logs"][-1]["logs"][0]["stdout"] == "after outage\n"
    jobs = SlurmClient().find_by_names([f"tes-{task_id}"])
    assert len(jobs[f"tes-{task_id}"]) == 1
