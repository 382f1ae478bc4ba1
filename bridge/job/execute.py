"""`exec`: open an executor's stdin/stdout/stderr on the host safely, then become the runtime.

The job script could redirect with `<`, `>` itself, but the shell follows links: an earlier
executor that replaced `/outputs/log.txt` by a link to a host file would make the next
executor's `stdout: /outputs/log.txt` overwrite that host file (the job script is not
confined). This wrapper opens the files without following links (bridge.job.safepath), puts
them on descriptors 0/1/2 and `exec`s the runtime, so no extra process stays around and the
exit code is the runtime's own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from bridge.job import safepath
from bridge.job.layout import LayoutError, TaskLayout, relative_parts
from bridge.job.records import RecordsWriter, executor_dir
from bridge.job.settings import read_settings

#: Exit code when the executor could not be started (its stdio could not be opened).
EXIT_CANNOT_START = 125


def _executor(layout: TaskLayout, index: int) -> dict[str, object]:
    task = json.loads(layout.task_json.read_text(encoding="utf-8"))
    executor = task["executors"][index]
    if not isinstance(executor, dict):
        raise ValueError(f"executor {index} is not an object")
    return executor


def _open_own(layout: TaskLayout, container_path: str, *, write: bool) -> int:
    parts = relative_parts(container_path)
    if write:
        return safepath.open_write(layout.root, parts)
    return safepath.open_read(layout.root, parts)


def _open_record(path: Path) -> int:
    return os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )


def _open_stdio(layout: TaskLayout, edir: Path, target: int, key: str, where: str | None) -> int:
    """The descriptor for `key` (on `target`): the executor's own file or /dev/null, else
    nothing for stdin and its record for stdout and stderr."""
    if where == os.devnull:  # a common way to say "discard" / "no input"
        return os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    if where:
        return _open_own(layout, where, write=target != 0)
    if target == 0:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _open_record(edir / key)


def _cannot_start(records_dir: Path, message: str, stderr: int = 2) -> int:
    """Say why in the task's system logs and on `stderr`; the exit code of a failed start."""
    RecordsWriter(records_dir).system_log(message)
    os.write(stderr, f"tes-bridge: {message}\n".encode(errors="replace"))
    return EXIT_CANNOT_START


def run_executor(task_dir: Path, records_dir: Path, index: int, argv: Sequence[str]) -> int:
    """Exec `argv` with the executor's stdio; returns only when that is impossible."""
    layout = TaskLayout(task_dir)
    edir = executor_dir(records_dir, index)
    edir.mkdir(mode=0o700, parents=True, exist_ok=True)
    executor = _executor(layout, index)
    if os.geteuid() == 0 and not read_settings(layout.job_config).allow_root:
        # Root in the job is root on the host behind the runtime's user namespace.
        return _cannot_start(
            records_dir,
            f"executor {index}: refusing to run as root; run the bridge as an unprivileged "
            "account (or set container.allow_root, which is dangerous)",
        )
    fds: dict[int, int] = {}
    try:
        # stderr first, so that a problem with the others can be reported in it.
        for target, key in ((2, "stderr"), (1, "stdout"), (0, "stdin")):
            own = executor.get(key)
            where = own if isinstance(own, str) else None
            try:
                fds[target] = _open_stdio(layout, edir, target, key, where)
            except (OSError, LayoutError) as exc:
                if target == 2:
                    # Still keep a stderr, in the records, for the message below.
                    fds[2] = _open_record(edir / "stderr")
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                message = f"executor {index}: cannot open {key} {where}: {reason}"
                return _cannot_start(records_dir, message, fds[2])
        for target, fd in fds.items():
            os.dup2(fd, target)  # dup2 clears close-on-exec on the target
        try:
            os.execvp(argv[0], list(argv))
        except OSError as exc:
            message = f"executor {index}: cannot run {argv[0]}: {exc.strerror}"
            return _cannot_start(records_dir, message)
    finally:
        for fd in fds.values():
            if fd > 2:
                os.close(fd)
    return EXIT_CANNOT_START  # not reached: execvp either replaces us or raises
