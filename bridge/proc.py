"""Child processes that never outlive the process that started them.

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
from collections.abc import Callable

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
