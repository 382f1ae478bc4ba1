"""Cromwell's TES backend, replayed on the wire against the service the quickstart starts.

Cromwell itself cannot run here: its jar comes from GitHub releases, which the test machines
cannot reach. So this test does what Cromwell 93's TES backend does for one WDL call, as its
source builds it (supportedBackends/tes: TesTask.scala, TesJobPaths.scala,
TesAsyncBackendJobExecutionActor.scala; backend/standard/StandardAsyncExecutionActor.scala for
the job script):

- It writes the call's script into `<root>/<workflow>/<id>/call-<name>/execution/` on the host
  and POSTs a task whose inputs and outputs are bare host paths. There is one executor,
  `/bin/bash <script>`, with its stdout and stderr in the container's execution directory. The
  tags carry a null `parent_workflow_id`, and `backend_parameters` carries
  `internal_path_prefix`.
- It polls `GET /tasks/{id}?view=FULL` and decodes the answer with the field types of
  Cromwell's spray-json formats.
- It then reads what Cromwell reads from the host: `execution/rc`, the outputs, the glob's
  list and directory.

Unlike a stand-in, everything after the POST is real: the quickstart's service, Slurm,
Apptainer, and the script's own fifos, `tee`s, `mktemp` and hard links in the execution
directory.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shlex
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fixtures.quickstart import ACCOUNT, Quickstart

pytestmark = pytest.mark.cluster

#: Cromwell's default `dockerRoot`: where the call's directories are in the container.
DOCKER_ROOT = "/cromwell-executions"
#: An image with bash: Cromwell runs the script with its `job-shell`, /bin/bash by default.
IMAGE = "python:3-slim"
GLOB = "*.part"
GLOB_NAME = f"glob-{hashlib.md5(GLOB.encode()).hexdigest()}"  # GlobFunctions.globName


def chown_tree(path: Path, top: Path) -> None:
    """Give `path` and its parents up to `top` to the account, as if Cromwell had made them."""
    account = pwd.getpwnam(ACCOUNT)
    for directory in [path, *path.parents]:
        os.chown(directory, account.pw_uid, account.pw_gid)
        if directory == top:
            break


def command_script(cwd: str, command: str) -> str:
    """StandardAsyncExecutionActor.commandScriptContents for a Docker call with one glob
    output, the backend's defaults filled in (temporary-directory, script-epilogue)."""
    stdout, stderr, rc = (shlex.quote(f"{cwd}/{name}") for name in ("stdout", "stderr", "rc"))
    glob_dir = f"{cwd}/{GLOB_NAME}"
    control = (
        "This file is used by Cromwell to allow for globs that would not match any file.\n"
        "By its presence it works around the limitation of some backends that do not allow "
        "empty globs.\n"
        "Regardless of the outcome of the glob, this file will not be part of the final list "
        "of globbed files."
    )
    return f"""#!/bin/bash

cd {cwd}
tmpDir=$(mktemp -d "$PWD"/tmp.XXXXXX)
chmod 777 "$tmpDir"
export _JAVA_OPTIONS=-Djava.io.tmpdir="$tmpDir"
export TMPDIR="$tmpDir"



out1a2b3c="${{tmpDir}}/out.$$" err1a2b3c="${{tmpDir}}/err.$$"
mkfifo "$out1a2b3c" "$err1a2b3c"
trap 'rm "$out1a2b3c" "$err1a2b3c"' EXIT
touch {stdout} {stderr}
tee {stdout} < "$out1a2b3c" &
tee {stderr} < "$err1a2b3c" >&2 &
(
cd {cwd}

{command}
)  > "$out1a2b3c" 2> "$err1a2b3c"
echo $? > {rc}.tmp
(
# add a .file in every empty directory to facilitate directory delocalization on the cloud
cd {cwd}
find . -type d -exec sh -c '[ -z "$(ls -A '"'"'{{}}'"'"')" ] && touch '"'"'{{}}'"'"'/.file' \\;
)
(
cd {cwd}
sync
# make the directory which will keep the matching files
mkdir {glob_dir}

# create the glob control file that will allow for the globbing to succeed even if there is 0 match
echo "{control}" > {glob_dir}/cromwell_glob_control_file

# hardlink or symlink all the files into the glob directory
( ln -L {cwd}/{GLOB} {glob_dir} 2> /dev/null ) || ( ln {cwd}/{GLOB} {glob_dir} )

# list all the files (except the control file) that match the glob into a file called
# glob-[md5 of glob].list
ls -1 {glob_dir} | grep -v cromwell_glob_control_file > {cwd}/{GLOB_NAME}.list

)
mv {rc}.tmp {rc}

"""


def cromwell_task(
    root: Path, workflow_id: str, name_file: Path, output_mode: str
) -> dict[str, Any]:
    """TesTask.makeTask for the call `wf.hello` (one File input, one File output, one glob),
    in Cromwell's output mode `granular` (its default) or `root`."""
    call = f"wf/{workflow_id}/call-hello"
    host_exec, cwd = f"{root}/{call}/execution", f"{DOCKER_ROOT}/{call}/execution"
    # mapInputPath: a file outside the call's directories goes under call-hello/inputs/.
    input_path = f"{DOCKER_ROOT}/{call}/inputs{name_file}"
    command = (
        f'echo "hello $(cat {input_path})" > greeting.txt\n'
        "echo one > a.part\necho two > b.part\n"
        "echo to-stdout\necho to-stderr >&2"
    )
    script = Path(host_exec) / "script"
    script.parent.mkdir(parents=True)
    script.write_text(command_script(cwd, command))
    chown_tree(script, root)

    def output(out_name: str, file: str, kind: str = "FILE") -> dict[str, Any]:
        return {
            "name": out_name,
            "description": f"wf.hello.{out_name}",
            "url": f"{host_exec}/{file}",
            "path": f"{cwd}/{file}",
            "type": kind,
        }

    if output_mode == "granular":
        outputs = [output(n, n) for n in ("rc", "stdout", "stderr")] + [
            {**output("commandScript", "script"), "description": "wf.hello.commandScript"},
            output("wf.hello.output.0", "greeting.txt"),
            output("globDir.1", GLOB_NAME, "DIRECTORY"),
            output("globList.1", f"{GLOB_NAME}.list"),
        ]
    else:
        outputs = [
            {
                "name": "execution.dir.output",
                "description": "wf.hello.execution.dir.output",
                "url": host_exec,
                "path": cwd,
                "type": "DIRECTORY",
            }
        ]
    return {
        "name": "wf.hello",
        "description": f"{workflow_id}:BackendJobDescriptorKey_CommandCallNode_wf.hello:-1:1",
        "inputs": [
            {
                "name": "wf.hello.name_file.0",
                "description": "wf.wf.hello.name_file.0",
                "url": str(name_file),
                "path": input_path,
                "type": "FILE",
            },
            {
                "name": "commandScript",
                "description": "wf.hello.commandScript",
                "url": str(script),
                "path": f"{cwd}/script",
                "type": "FILE",
            },
        ],
        "outputs": outputs,
        "resources": {
            "cpu_cores": 1,
            "ram_gb": 2.0,
            "disk_gb": 2.0,
            "preemptible": False,
            "backend_parameters": {"internal_path_prefix": f"{root}/{call}/tes_task"},
        },
        "executors": [
            {
                "image": IMAGE,
                "command": ["/bin/bash", f"{cwd}/script"],
                "stdout": f"{cwd}/stdout",
                "stderr": f"{cwd}/stderr",
            }
        ],
        "tags": {
            "workflow_id": workflow_id,
            "root_workflow_id": workflow_id,
            "parent_workflow_id": None,  # spray-json writes the None of a top-level workflow
        },
    }


def decode_as_cromwell(task: dict[str, Any]) -> None:
    """What Cromwell's spray-json formats (TesResponseJsonFormatter) require of a FULL view:
    a mismatch there fails the call at once, without a retry."""
    assert isinstance(task["id"], str) and isinstance(task["state"], str)
    for executor in task["executors"]:
        assert isinstance(executor["image"], str) and isinstance(executor["command"], list)
    for item in task.get("inputs", []) + task.get("outputs", []):
        assert isinstance(item["path"], str)
    for value in (task.get("tags") or {}).values():
        assert value is None or isinstance(value, str)
    for log in task.get("logs") or []:
        assert all(isinstance(v, str) for v in (log.get("metadata") or {}).values()), log
        assert all(isinstance(line, str) for line in log.get("system_logs") or [])
        for executor_log in log.get("logs") or []:
            assert isinstance(executor_log.get("exit_code", 0), int)
        for output_log in log.get("outputs") or []:
            # OutputFileLog: url and path strings, size_bytes a string that `toInt` reads.
            assert isinstance(output_log["url"], str) and isinstance(output_log["path"], str)
            assert isinstance(output_log["size_bytes"], str), output_log
            int(output_log["size_bytes"])


def poll_as_cromwell(endpoint: str, task_id: str, timeout: float) -> dict[str, Any]:
    """`GET {endpoint}/{id}?view=FULL` until COMPLETE, EXECUTOR_ERROR, SYSTEM_ERROR or
    CANCELED (Cromwell takes every other state, PREEMPTED included, as still running)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = requests.get(f"{endpoint}/{task_id}", params={"view": "FULL"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["Content-Type"].startswith("application/json")
        task = answer.json()
        decode_as_cromwell(task)
        if task["state"] in ("COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED"):
            return task
        assert time.monotonic() < deadline, task
        time.sleep(1)


@pytest.mark.parametrize("output_mode", ["granular", "root"])
def test_a_call_as_cromwell_runs_it(
    quickstart: Quickstart, workdir: Path, output_mode: str
) -> None:
    # Cromwell's endpoint setting names the tasks collection itself; it appends only /{id}.
    endpoint = f"{quickstart.url}/ga4gh/tes/v1/tasks"
    root = workdir / "cromwell-executions"
    name_file = workdir / "name.txt"
    name_file.write_text("world\n")
    chown_tree(name_file, workdir)
    workflow_id = str(uuid.uuid4())
    task = cromwell_task(root, workflow_id, name_file, output_mode)

    created = requests.post(endpoint, json=task, timeout=30)
    assert created.status_code == 200, created.text
    assert created.headers["Content-Type"].startswith("application/json")
    task_id = created.json()["id"]
    final = poll_as_cromwell(endpoint, task_id, timeout=quickstart.wait_timeout)
    assert final["state"] == "COMPLETE", final
    assert final["tags"] == {"workflow_id": workflow_id, "root_workflow_id": workflow_id}
    system_logs = [line for log in final["logs"] for line in log.get("system_logs", [])]
    assert (
        "backend parameter 'internal_path_prefix' is not supported by this server and was "
        "ignored" in system_logs
    ), system_logs

    # What Cromwell reads next, from the host: the return code, the outputs, the glob.
    execution = root / "wf" / workflow_id / "call-hello" / "execution"
    assert (execution / "rc").read_text() == "0\n"
    assert (execution / "greeting.txt").read_text() == "hello world\n"
    assert (execution / "stdout").read_text() == "to-stdout\n"
    assert (execution / "stderr").read_text() == "to-stderr\n"
    assert (execution / f"{GLOB_NAME}.list").read_text() == "a.part\nb.part\n"
    assert (execution / GLOB_NAME / "a.part").read_text() == "one\n"
    assert (execution / GLOB_NAME / "b.part").read_text() == "two\n"

    # An abort of a call that already ended: Cromwell parses the answer as JSON.
    cancel = requests.post(f"{endpoint}/{task_id}:cancel", timeout=30)
    assert cancel.status_code == 200 and cancel.json() == {}, cancel.text
    assert cancel.headers["Content-Type"].startswith("application/json")
