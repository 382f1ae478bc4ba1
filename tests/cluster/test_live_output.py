"""Live output on the real cluster: a task prints a line a second in a real container; the
output endpoint and `tes-bridge task logs --follow` show its lines while it still runs, and
the task document lists no executor log until the executor has an exit code."""

from __future__ import annotations

import time

import pytest
import requests

from tests.tes_cli import follow_logs

pytestmark = pytest.mark.cluster

LINES = 12
TICKING = {
    "name": "live-output",
    "executors": [
        {
            "image": "alpine",
            "command": ["sh", "-c", f"i=0; while [ $i -lt {LINES} ]; do i=$((i+1)); "
                        "echo line $i; echo err $i >&2; sleep 1; done"],
        }
    ],
}  # fmt: skip


def test_a_running_executors_lines_are_readable_before_it_ends(bridge_service, tmp_path):
    task_id = bridge_service.create(TICKING)
    stderr = (tmp_path / "stderr").open("w+")
    follow = follow_logs(bridge_service.url, task_id, interval=0.5, stderr=stderr, kill_after=300)
    try:
        # The endpoint: lines appear while the task runs, from where the last read stopped.
        url = f"{bridge_service.api}/tasks/{task_id}/output"
        seen, offset = "", 0
        deadline = time.monotonic() + 240
        while "line 3\n" not in seen:
            assert time.monotonic() < deadline, bridge_service.log_tail()
            answer = requests.get(url, params={"offset": offset}, timeout=10)
            assert answer.status_code == 200, answer.text
            chunk = answer.json()
            assert chunk["offset"] == offset
            seen += chunk["text"]
            offset = chunk["next_offset"]
            time.sleep(0.3)
        task = bridge_service.get(task_id)
        assert task["state"] == "RUNNING" and not chunk["done"]
        assert task["logs"][-1]["logs"] == []  # no executor log without an exit code
        assert seen.startswith("line 1\nline 2\nline 3\n")
        errors = requests.get(url, params={"stream": "stderr", "offset": -6}, timeout=10).json()
        assert errors["text"].startswith("err ") and errors["offset"] == errors["size"] - 6

        # The client: its first lines come before the task ends.
        assert follow.stdout is not None
        first = follow.stdout.readline()
        assert first == "line 1\n"
        assert bridge_service.get(task_id, view="MINIMAL")["state"] == "RUNNING"
        out = follow.stdout.read()  # to the end: the client exits when the task is final
        follow.wait(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
    stderr.seek(0)
    err = stderr.read()
    assert follow.returncode == 0, err
    # Each line once, in order, and the same as the task document's log once it finished.
    assert first + out == "".join(f"line {i}\n" for i in range(1, LINES + 1))
    assert err.endswith(f"task {task_id}: COMPLETE\n")
    streamed = [line for line in err.splitlines(keepends=True) if not line.startswith("system: ")]
    assert "".join(streamed).startswith("".join(f"err {i}\n" for i in range(1, LINES + 1)))
    final = bridge_service.get(task_id)["logs"][-1]["logs"][0]
    assert final["exit_code"] == 0 and final["stdout"] == first + out
