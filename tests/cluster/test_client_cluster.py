"""`tes-bridge task` against the bridge on the real cluster: `run --wait` waits for a real
Slurm job running a real container, and `logs` shows what the executor printed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tes_cli import TES_TASK, client_env, tes_task

pytestmark = pytest.mark.cluster


def test_run_wait_then_logs_show_the_executors_output(bridge_service):
    url = bridge_service.url
    run = tes_task(
        url,
        "run",
        "--wait",
        "--interval",
        "0.5",
        "--env",
        "WHO=slurm",
        "--name",
        "client-hello",
        "alpine",
        "--",
        "sh",
        "-c",
        'echo "hello from $WHO"; echo to-stderr >&2',
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    task_id = lines[0]
    # Not a terminal: one plain line per state the client saw, the last one final.
    assert lines[-1] == f"{task_id} COMPLETE"
    assert all(line.startswith(f"{task_id} ") for line in lines[1:])
    assert bridge_service.get(task_id)["state"] == "COMPLETE"

    logs = tes_task(url, "logs", task_id)
    assert logs.returncode == 0
    assert logs.stdout == "hello from slurm\n"
    assert logs.stderr.startswith("to-stderr\n")


def test_a_failing_executor_gives_its_exit_code_to_run_wait_and_logs_follow(bridge_service):
    url = bridge_service.url
    failing = tes_task(
        url,
        "run",
        "--wait",
        "--interval",
        "0.5",
        "alpine",
        "--",
        "sh",
        "-c",
        "echo partial; exit 3",
        timeout=300,
    )
    assert failing.returncode == 3, failing.stdout + failing.stderr
    task_id = failing.stdout.splitlines()[0]
    assert failing.stdout.splitlines()[-1] == f"{task_id} EXECUTOR_ERROR"

    # --follow from the start of a task prints its output once, and exits with its outcome.
    created = tes_task(url, "run", "alpine", "--", "sh", "-c", "echo one; sleep 2; echo two")
    follow = subprocess.run(
        [*TES_TASK, "logs", "--follow", "--interval", "0.5", created.stdout.strip()],
        capture_output=True,
        text=True,
        env=client_env(url),
        timeout=300,
    )
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout == "one\ntwo\n"
    assert follow.stderr.endswith(f"task {created.stdout.strip()}: COMPLETE\n")


def test_the_client_docs_examples_run_as_written(bridge_service, tmp_path):
    doc = (Path(__file__).parents[2] / "docs" / "client.md").read_text()
    section = doc.split("## Examples\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    script = "\n".join(blocks).replace("http://127.0.0.1:8000", bridge_service.url)
    env = client_env(bridge_service.url)
    # `tes-bridge` as installed next to the Python that runs the tests.
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # wait: one line per state seen, the last COMPLETE; then logs; then the table.
    hello = lines.index("hello")
    task_id = lines[hello - 1].split()[0]
    assert lines[hello - 1] == f"{task_id} COMPLETE", lines
    header, row = lines[hello + 1].split(), lines[hello + 2].split()
    assert header[:2] == ["ID", "STATE"] and row[:2] == [task_id, "COMPLETE"], lines
    assert row[-1] == "hello", lines
    submitted = lines[hello + 3]
    assert lines[-1] == f"{submitted} COMPLETE", lines
    assert "md5sum" in json.dumps(bridge_service.get(submitted))


def test_run_test_only_says_where_slurm_would_start_it_and_creates_nothing(bridge_service):
    url = bridge_service.url

    def ids() -> list[str]:
        listed = tes_task(url, "list", "--json", "--view", "MINIMAL")
        assert listed.returncode == 0, listed.stderr
        return [task["id"] for task in json.loads(listed.stdout)]

    before = ids()
    asked = tes_task(url, "run", "--test-only", "--cpus", "2", "alpine", "--", "true")
    assert asked.returncode == 0, asked.stdout + asked.stderr
    assert re.fullmatch(
        r"Slurm would start it at \S+ \S+ UTC on node\S* \(2 processors, partition main\)\n",
        asked.stdout,
    ), asked.stdout
    # A node feature no node has: Slurm would refuse the job, and says why.
    refused = tes_task(
        url, "run", "--test-only", "--backend-parameter", "constraint=no-such-feature",
        "alpine", "--", "true",
    )  # fmt: skip
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stdout.startswith("Slurm would refuse it: "), refused.stdout
    assert "feature" in refused.stdout.lower(), refused.stdout
    assert ids() == before
