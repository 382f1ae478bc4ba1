"""bridge.api.server.watch_master: an API worker never outlives its gunicorn master for long."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# A stand-in master that forks one worker, as gunicorn does, and runs post_fork in it. The
# worker then gets stuck the worst way: its SIGTERM handler does nothing (as a graceful stop
# waiting for a request that never ends would) and its main thread waits forever.
MASTER = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from types import SimpleNamespace
    from bridge.api.server import watch_master

    pid = os.fork()
    if pid == 0:
        arbiter = SimpleNamespace(pid=os.getppid())
        worker = SimpleNamespace(cfg=SimpleNamespace(graceful_timeout={grace}))
        watch_master(arbiter, worker)
        signal.signal(signal.SIGTERM, lambda *_: None)
        open({pid_file!r}, "w").write(str(os.getpid()))
        threading.Event().wait()
    time.sleep(600)
    """
)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited, not reaped yet by its new parent


def _wait_for_file(path: Path) -> int:
    for _ in range(100):
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.1)
    pytest.fail("the worker never started")


def test_a_stuck_worker_is_ended_after_its_master_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    code = MASTER.format(grace=0, pid_file=str(pid_file))
    master = subprocess.Popen([sys.executable, "-c", code])
    try:
        worker = _wait_for_file(pid_file)
        time.sleep(0.5)
        assert not _gone(worker)  # the watch leaves a worker alone while its master lives
        master.send_signal(signal.SIGKILL)
        master.wait()
        started = time.monotonic()
        while not _gone(worker):
            # graceful_timeout (0 here) + 5 s, polled each second.
            assert time.monotonic() - started < 15, "the stuck worker outlived its master"
            time.sleep(0.2)
        assert time.monotonic() - started >= 4  # it had its grace period first
    finally:
        master.kill()
        if pid_file.exists() and pid_file.read_text():
            with_pid = int(pid_file.read_text())
            if not _gone(with_pid):
                os.kill(with_pid, signal.SIGKILL)
