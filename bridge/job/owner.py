"""Site mode: what the poller does in a task directory as the task's owner, through sudo.

In site mode task directories belong to the task's owner and stay private (0700): the poller,
running as the service account, never touches them itself. It calls, through the narrow rule in
deploy/sudoers.tes-bridge (``sudo -n -u OWNER <python> -m bridge.job ...``):

- ``adopt --work-dir WORK --task-dir DIR``: create DIR (0700) as the owner and write the
  rendered task.json, job-config.json and job.sh into it, read as one JSON object from stdin;
- ``read-records --work-dir WORK --tail-bytes N DIR:JOBID...``: the records of those jobs, as
  JSON on stdout (one call per owner and poll cycle, for all of that owner's running tasks),
  with N bytes of each executor stream (its excerpt, bridge.job.excerpt: the option keeps its
  older name, which the sudo rule pins);
- ``remove --work-dir WORK --task-dir DIR``: remove an old task directory;
- ``fence --work-dir WORK --task-dir DIR --epoch N [--part P]``: fence DIR (or only part P of
  a staged task's chain) at token N (a lease epoch,
  or a lone poller's clock in ms): a job whose sbatch started before stands down
  (bridge.job.layout.write_lease_fence);
- ``read-output --work-dir WORK --task-dir DIR --job-id J --executor N --stream S --offset K
  --max-bytes M``: a range of an executor's live output (bridge.job.output), as JSON on stdout,
  for the API's output endpoint.

These run as the owner, not as root, so the worst a wrong argument can do is what the owner
could do; still they refuse anything but a task directory directly inside WORK (the sudo rule
pins WORK): every DIR must be absolute, normalised, named by a plain task id, and WORK/<id>
once links are resolved. An option given twice is an error (argparse would keep the last one,
and a sudo wildcard could append one).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import stat
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from bridge.core.naming import is_task_id
from bridge.job.layout import (
    FENCED_PARTS,
    JOB_CONFIG_JSON,
    SCRIPT,
    STAGE_IN_SCRIPT,
    STAGE_OUT_SCRIPT,
    TASK_JSON,
    TaskLayout,
    write_atomically,
    write_lease_fence,
)
from bridge.job.output import STREAMS, chunk_to_json, read_output
from bridge.job.records import ExecutorRecord, JobRecords, read_records
from bridge.job.safepath import UnsafePathError

#: The files adopt writes, with their modes (the script must be executable by its owner only).
FILES = {TASK_JSON: 0o600, JOB_CONFIG_JSON: 0o600, SCRIPT: 0o700}
#: The scripts adopt also writes for a task staged on the transfer partition (both or none).
PART_FILES = {STAGE_IN_SCRIPT: 0o700, STAGE_OUT_SCRIPT: 0o700}


#: read-output's exit status when the stream is a link or not a regular file.
EXIT_REFUSED = 3


class OwnerError(Exception):
    pass


def _absolute(value: str) -> str:
    if not value.startswith("/") or value.startswith("//") or os.path.normpath(value) != value:
        raise OwnerError(f"{value!r} is not an absolute, normalised path")
    return value


def _task_dir(value: str, work_dir: str) -> Path:
    """`value` if it is `work_dir/<task id>`, also once links are resolved."""
    path = Path(_absolute(value))
    if not is_task_id(path.name) or path.name in {".", ".."}:
        raise OwnerError(f"{path.name!r} is not a task id")
    work = _absolute(work_dir)
    if str(path.parent) != work:
        raise OwnerError(f"{value} is not a task directory in the work directory {work}")
    if os.path.realpath(path) != os.path.join(os.path.realpath(work), path.name):
        raise OwnerError(f"{value} leads outside the work directory {work} (a link)")
    return path


def _own_dir(path: Path) -> None:
    """`path` must be a real directory of ours (not a link someone planted)."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OwnerError(f"{path} exists and is not a directory of this user")


def adopt(task_dir: Path, files: dict[str, str]) -> None:
    wanted = dict(FILES)
    if set(files) & set(PART_FILES):
        wanted.update(PART_FILES)
    if set(files) != set(wanted):
        raise OwnerError(f"expected exactly the files {sorted(wanted)}")
    with contextlib.suppress(FileExistsError):  # a later attempt of the same task
        os.mkdir(task_dir, 0o700)
    _own_dir(task_dir)
    os.chmod(task_dir, 0o700)  # task documents can carry secrets
    layout = TaskLayout(task_dir)
    layout.tmp.mkdir(mode=0o700, exist_ok=True)
    for name, mode in wanted.items():
        write_atomically(task_dir / name, files[name], mode)


def remove(task_dir: Path) -> None:
    if not os.path.lexists(task_dir):
        return
    _own_dir(task_dir)
    shutil.rmtree(task_dir)


# ------------------------------------------------------------------------------ records as JSON
def _plain(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def records_to_json(records: JobRecords) -> dict[str, Any]:
    return dataclasses.asdict(records, dict_factory=lambda kv: {k: _plain(v) for k, v in kv})


def _time(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def records_from_json(data: dict[str, Any]) -> JobRecords:
    executors = [
        ExecutorRecord(
            index=int(e["index"]),
            start_time=_time(e.get("start_time")),
            end_time=_time(e.get("end_time")),
            exit_code=e.get("exit_code"),
            stdout=e.get("stdout") or "",
            stderr=e.get("stderr") or "",
        )
        for e in data.get("executors") or []
    ]
    return JobRecords(
        job_id=str(data["job_id"]),
        phase=data.get("phase"),
        start_time=_time(data.get("start_time")),
        end_time=_time(data.get("end_time")),
        executors=executors,
        outputs=list(data.get("outputs") or []),
        system_logs=list(data.get("system_logs") or []),
        outcome=data.get("outcome"),
    )


def read_many(pairs: list[str], keep_bytes: int, work_dir: str) -> dict[str, Any]:
    """`DIR:JOBID` pairs -> {"DIR:JOBID": records}; an unreadable directory is left out."""
    result: dict[str, Any] = {}
    for pair in pairs:
        directory, sep, job_id = pair.rpartition(":")
        if not sep:
            raise OwnerError(f"{pair!r} is not DIR:JOBID")
        task_dir = _task_dir(directory, work_dir)
        try:
            _own_dir(task_dir)
            result[pair] = records_to_json(read_records(task_dir, job_id, keep_bytes=keep_bytes))
        except (OSError, OwnerError):
            continue
    return result


# ------------------------------------------------------------------------------ commands
def _adopt(args: argparse.Namespace) -> int:
    files = json.load(sys.stdin)
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise OwnerError("stdin must be a JSON object of file texts")
    adopt(_task_dir(args.task_dir, args.work_dir), files)
    return 0


def _remove(args: argparse.Namespace) -> int:
    remove(_task_dir(args.task_dir, args.work_dir))
    return 0


def _fence(args: argparse.Namespace) -> int:
    task_dir = _task_dir(args.task_dir, args.work_dir)
    if os.path.lexists(task_dir):
        _own_dir(task_dir)
    write_lease_fence(task_dir, args.epoch, args.part)
    return 0


def _read_records(args: argparse.Namespace) -> int:
    json.dump(read_many(args.pairs, args.tail_bytes, args.work_dir), sys.stdout)
    return 0


def _read_output(args: argparse.Namespace) -> int:
    task_dir = _task_dir(args.task_dir, args.work_dir)
    _own_dir(task_dir)
    try:
        chunk = read_output(
            task_dir, args.job_id, args.executor, args.stream, args.offset, args.max_bytes
        )
    except UnsafePathError as exc:
        print(f"bridge.job: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    json.dump(chunk_to_json(chunk), sys.stdout)
    return 0


def _guarded(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except (OSError, OwnerError, ValueError) as exc:
            print(f"bridge.job: {exc}", file=sys.stderr)
            return 1

    return run


class Once(argparse.Action):
    """An option that may be given once: argparse would silently keep the last of several."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        seen: set[str] = getattr(namespace, "_options_seen", set())
        if self.dest in seen:
            parser.error(f"{option_string} given more than once")
        seen.add(self.dest)
        namespace._options_seen = seen
        setattr(namespace, self.dest, values)


WORK_DIR_HELP = "the work directory (job.work_dir); every task directory must be in it"


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    adopt_cmd = subparsers.add_parser(
        "adopt", help="(site mode, as the owner) create a task directory from stdin"
    )
    adopt_cmd.add_argument("--work-dir", required=True, action=Once, help=WORK_DIR_HELP)
    adopt_cmd.add_argument("--task-dir", required=True, action=Once)
    adopt_cmd.set_defaults(job_func=_guarded(_adopt))

    remove_cmd = subparsers.add_parser(
        "remove", help="(site mode, as the owner) remove an old task directory"
    )
    remove_cmd.add_argument("--work-dir", required=True, action=Once, help=WORK_DIR_HELP)
    remove_cmd.add_argument("--task-dir", required=True, action=Once)
    remove_cmd.set_defaults(job_func=_guarded(_remove))

    fence_cmd = subparsers.add_parser(
        "fence",
        help="(site mode, as the owner) fence a task directory at a token (a lease epoch, or a "
        "lone poller's clock in ms): a job submitted with an earlier token stands down",
    )
    fence_cmd.add_argument("--work-dir", required=True, action=Once, help=WORK_DIR_HELP)
    fence_cmd.add_argument("--task-dir", required=True, action=Once)
    fence_cmd.add_argument("--epoch", type=int, required=True, action=Once)
    fence_cmd.add_argument(
        "--part", choices=FENCED_PARTS, action=Once, help="only this part of a staged task's chain"
    )
    fence_cmd.set_defaults(job_func=_guarded(_fence))

    read = subparsers.add_parser(
        "read-records", help="(site mode, as the owner) job records as JSON on stdout"
    )
    read.add_argument("--work-dir", required=True, action=Once, help=WORK_DIR_HELP)
    read.add_argument("--tail-bytes", type=int, required=True, action=Once)
    read.add_argument("pairs", nargs="*", metavar="DIR:JOBID")
    read.set_defaults(job_func=_guarded(_read_records))

    output = subparsers.add_parser(
        "read-output", help="(site mode, as the owner) a range of an executor's output as JSON"
    )
    output.add_argument("--work-dir", required=True, action=Once, help=WORK_DIR_HELP)
    output.add_argument("--task-dir", required=True, action=Once)
    output.add_argument("--job-id", required=True, action=Once)
    output.add_argument("--executor", type=int, required=True, action=Once)
    output.add_argument("--stream", choices=STREAMS, required=True, action=Once)
    output.add_argument("--offset", type=int, required=True, action=Once)
    output.add_argument("--max-bytes", type=int, required=True, action=Once)
    output.set_defaults(job_func=_guarded(_read_output))
