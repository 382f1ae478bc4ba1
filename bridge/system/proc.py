"""Child processes that never outlive the process that started them, and the one command runner.

:func:`run` runs every external command of the poller (the Slurm client's and the site-mode
owner commands'); :func:`as_user` builds the one sudo argv.

Linux's ``PR_SET_PDEATHSIG`` asks the kernel to signal a child when the thread that forked it
ends, whatever the reason (kill -9 included). It survives ``execve`` of a normal program, and is
cleared by the exec of a set-user-ID one (``sudo``): such children are not covered.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def set_parent_death_signal(sig: int, parent: int) -> None:
    """From now on, this process gets `sig` when `parent` (its parent) dies."""
    # Async-signal-safe enough for a preexec_fn: one system call, no allocation, no lock.
    _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    # The parent may have died before prctl: then nobody would signal us.
    if os.getppid() != parent:
        os._exit(1)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets `sig` when we die."""
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig, parent)

    return preexec


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class CommandError(Exception):
    """A command failed: carries its argv, exit code (None when it did not exit) and output."""

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message)
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class CommandNotFound(CommandError):
    """The program does not exist."""


class CommandTimeout(CommandError):
    """The command did not end within its time-out; its whole process group was killed."""


def as_user(sudo: str, user: str, argv: Sequence[str]) -> list[str]:
    """`argv` run as `user` through a `sudo -n -u USER --` rule (deploy/sudoers.tes-bridge)."""
    if not user or "\n" in user or "\r" in user:
        raise ValueError(f"user must be non-empty, one line: {user!r}")
    return [sudo, "-n", "-u", user, "--", *argv]


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command to its end and return what it printed, whatever its exit code.

    It gets its own process group, killed whole on a time-out (a wrapper's children too), and
    SIGKILL when this process dies, so it never outlives its caller (sudo's children excepted,
    see the module doc). Output that is not UTF-8 is read with replacement characters. Raises
    :class:`CommandNotFound`, :class:`CommandTimeout`, or :class:`CommandError` when the
    program cannot be started.
    """
    args = list(argv)
    try:
        child = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=None if env is None else dict(env),
            cwd=cwd,
            process_group=0,
            preexec_fn=die_with_parent(),
        )
    except FileNotFoundError as exc:
        raise CommandNotFound(f"{args[0]}: not found", argv=args) from exc
    except OSError as exc:
        raise CommandError(f"{args[0]}: {exc.strerror or exc}", argv=args) from exc
    try:
        stdout, stderr = child.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        kill_group(child.pid)
        child.wait()
        raise CommandTimeout(
            f"{Path(args[0]).name} did not answer within {timeout:g} s",
            argv=args,
            stdout=_text(exc.stdout),
            stderr=_text(exc.stderr),
        ) from exc
    except BaseException:
        kill_group(child.pid)
        child.wait()
        raise
    return subprocess.CompletedProcess(args, child.returncode, stdout, stderr)


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
