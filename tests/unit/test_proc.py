"""bridge.system.proc: the one command runner under the Slurm client and the owner commands."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from bridge.system.proc import CommandError, CommandNotFound, CommandTimeout, as_user, run


def test_run_returns_output_and_exit_code_and_feeds_stdin() -> None:
    code = "import sys; data = sys.stdin.read(); print(data.upper()); sys.exit(3)"
    proc = run([sys.executable, "-c", code], timeout=10, stdin="hello", cwd="/")
    assert (proc.returncode, proc.stdout.strip()) == (3, "HELLO")


def test_run_without_stdin_gives_the_command_an_empty_one() -> None:
    proc = run([sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"], timeout=10)
    assert proc.stdout.strip() == "''"


def test_time_out_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    started = time.monotonic()
    with pytest.raises(CommandTimeout) as raised:
        run([sys.executable, "-c", code], timeout=1.5)
    assert time.monotonic() - started < 10
    assert "did not answer within 1.5 s" in str(raised.value)
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is asynchronous: give the kernel a moment
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the command's own child outlived its time-out")


def test_missing_program_is_command_not_found(tmp_path: Path) -> None:
    with pytest.raises(CommandNotFound) as raised:
        run([str(tmp_path / "no-such-tool")], timeout=5)
    assert isinstance(raised.value, CommandError) and raised.value.argv


def test_as_user_is_the_one_sudo_argv() -> None:
    assert as_user("sudo", "alice", ["scancel", "1"]) == [
        "sudo", "-n", "-u", "alice", "--", "scancel", "1"
    ]  # fmt: skip
    for bad in ("", "alice\nroot"):
        with pytest.raises(ValueError):
            as_user("sudo", bad, ["true"])
