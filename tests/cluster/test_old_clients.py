"""py-tes 0.4.2, which the Snakemake and Toil TES plugins pin, against the real service.

It rejects any field and any state it does not know, so it guards the wire format: no TES 1.1
defaults added to tasks, the old service-info shape at /v1/tasks/service-info, logs it can
read. It runs in a virtual environment of its own, next to the current py-tes of the suite,
against a bridge of its own: a task is returned as its client sent it, so py-tes 0.4 cannot
list tasks that newer clients sent with TES 1.1 fields (such as `ignore_error`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.service import BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster

CLIENT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import tes

    client = tes.HTTPClient(sys.argv[1])
    info = client.get_service_info()
    task_id = client.create_task(tes.Task(
        name="old client",
        executors=[tes.Executor(image="alpine", command=["echo", "from py-tes 0.4.2"])],
        inputs=[tes.Input(path="/in/a.txt", content="x")],
        tags={"client": "py-tes-0.4.2"},
    ))
    task_id = getattr(task_id, "id", task_id)
    done = client.wait(task_id, timeout=240)
    full = client.get_task(task_id, view="FULL")
    basic = client.get_task(task_id, view="BASIC")
    listed = client.list_tasks(view="BASIC")
    print(json.dumps({
        "storage": info.storage,
        "state": done.state,
        "stdout": full.logs[0].logs[0].stdout,
        "exit_code": full.logs[0].logs[0].exit_code,
        "basic_content": basic.inputs[0].content,
        "listed": task_id in [t.id for t in listed.tasks],
    }))
    """
)


@pytest.fixture(scope="module")
def old_py_tes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("py-tes-0.4.2")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # six is a dependency py-tes 0.4.2 uses but does not declare.
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "py-tes==0.4.2", "six"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def old_clients_service(local_cluster, tmp_path_factory) -> Iterator[BridgeService]:
    with start_bridge_service(local_cluster, tmp_path_factory.mktemp("old-clients")) as service:
        yield service


def test_py_tes_0_4_2_runs_a_task_end_to_end(old_clients_service, old_py_tes):
    bridge_service = old_clients_service
    result = subprocess.run(
        [str(old_py_tes), "-c", CLIENT_SCRIPT, bridge_service.url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {
        "storage": seen["storage"],
        "state": "COMPLETE",
        "stdout": "from py-tes 0.4.2\n",
        "exit_code": 0,
        "basic_content": None,
        "listed": True,
    }
    assert f"file://{bridge_service.data_dir}/" in seen["storage"]
