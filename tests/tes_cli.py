"""Running `tes-bridge task` as a user does: its own process, its exit code, its output."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import IO

TES_TASK = [sys.executable, "-m", "bridge", "task"]


def client_env(url: str, **extra: str) -> dict[str, str]:
    """The environment of the tests, without any TES_* or netrc of whoever runs them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TES_", "NETRC"))}
    return {**env, "TES_URL": url, "NETRC": "/nonexistent", **extra}


def tes_task(
    url: str, *args: str, stdin: str | None = None, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*TES_TASK, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=client_env(url, **env),
        timeout=timeout,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result


def follow_logs(
    url: str, task_id: str, *, interval: float, stderr: IO[str], kill_after: float
) -> subprocess.Popen[str]:
    """`tes-bridge task logs --follow` as its own process, its stdout a pipe to read line by
    line as it comes (communicate() would skip what readline() has buffered), killed after
    `kill_after` seconds so that a hung read ends as a failure, not a hang."""
    follow = subprocess.Popen(
        [*TES_TASK, "logs", "--follow", "--interval", str(interval), task_id],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=client_env(url),
    )
    threading.Timer(kill_after, follow.kill).start()
    return follow
