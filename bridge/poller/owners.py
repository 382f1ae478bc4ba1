"""Site mode: the per-user steps, run as each task's owner through the sudo rule.

`python -m bridge.job adopt | read-records | remove | read-output` (bridge/job/owner.py) as
`sudo -n -u OWNER` (deploy/sudoers.tes-bridge), and the owner's Slurm account. `read-output` is
the API's, asked of the poller over bridge.system.relay: only the poller's unit may use sudo.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.core.naming import is_task_id
from bridge.job.owner import EXIT_REFUSED, records_from_json
from bridge.job.records import JobRecords
from bridge.jobscript.render import task_files
from bridge.poller.context import short
from bridge.slurm import NodeSizes
from bridge.store import TaskRecord
from bridge.system.proc import CommandError, as_user, run
from bridge.system.users import UserMap

log = logging.getLogger("bridge.poller")


_USER = re.compile(r"^[a-z_][a-z0-9_.-]{0,63}\$?$")
_JOB_ID = re.compile(r"^[0-9_+]{1,32}$")


def _output_args(request: dict[str, Any]) -> tuple[str, list[str]]:
    """The owner and read-output's arguments from the API's request; ValueError when a field is
    not what the sudo rule would accept."""
    owner, task_id, job_id = request.get("owner"), request.get("task_id"), request.get("job_id")
    executor, stream = request.get("executor"), request.get("stream")
    offset, max_bytes = request.get("offset"), request.get("max_bytes")
    if not (isinstance(owner, str) and _USER.fullmatch(owner)) or owner == "root":
        raise ValueError("owner")
    if not is_task_id(task_id) or task_id in (".", ".."):
        raise ValueError("task_id")
    if not (isinstance(job_id, str) and _JOB_ID.fullmatch(job_id)):
        raise ValueError("job_id")
    if stream not in ("stdout", "stderr"):
        raise ValueError("stream")
    numbers = (executor, offset, max_bytes)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise ValueError("executor, offset and max_bytes must be integers")
    args = ["--task-dir", task_id, "--job-id", job_id, "--executor", str(executor)]
    args += ["--stream", str(stream), "--offset", str(offset), "--max-bytes", str(max_bytes)]
    return owner, args


class OwnerCommandError(Exception):
    """A site-mode command run as a task's owner (sudo) failed."""


class OwnerRunner:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._user_map: UserMap | None = None

    def run(self, owner: str, args: list[str], stdin: str | None = None) -> str:
        """`python -m bridge.job ARGS` as `owner`, through the sudo rule; returns stdout."""
        # The sudo rule pins --work-dir right after the subcommand.
        command = [self.config.job.python, "-m", "bridge.job", args[0]]
        command += ["--work-dir", str(self.config.work_dir), *args[1:]]
        try:
            proc = run(
                as_user(self.config.site.sudo, owner, command),
                stdin=stdin,
                timeout=self.config.slurm.command_timeout,
                cwd="/",  # `-m` puts the working directory on sys.path
            )
        except (CommandError, ValueError) as exc:
            raise OwnerCommandError(f"{args[0]}: {exc}") from exc
        if proc.returncode != 0:
            detail = "; ".join(proc.stderr.strip().splitlines()[-3:]) or "no message"
            raise OwnerCommandError(f"{args[0]} exited {proc.returncode}: {detail}")
        return proc.stdout

    def adopt(
        self,
        owner: str,
        document: dict[str, Any],
        image_paths: dict[str, str],
        nodes: NodeSizes | None,
    ) -> Path:
        """The task directory, rendered here and written by the owner (so it is the owner's
        and private); returns its job script."""
        files = task_files(
            document, config=self.config, image_paths=image_paths, nodes=nodes, owner=owner
        )
        task_dir: Path = self.config.work_dir / str(document["id"])
        self.run(owner, ["adopt", "--task-dir", str(task_dir)], json.dumps(files))
        return task_dir / "job.sh"

    def read_jobs(self, jobs: list[tuple[TaskRecord, str]]) -> dict[tuple[str, str], JobRecords]:
        """The records of these jobs of these tasks (a task's job; a staged task's stage-in
        job) by task id and job id: one `read-records` per owner. An owner whose records
        cannot be read is left out (logged)."""
        found: dict[tuple[str, str], JobRecords] = {}
        by_owner: dict[str, list[tuple[TaskRecord, str]]] = {}
        for task, job_id in jobs:
            if task.owner:
                by_owner.setdefault(task.owner, []).append((task, job_id))
        keep = str(self.config.job.log_tail_bytes)
        for owner, owned in by_owner.items():
            pairs = {f"{self.config.work_dir / t.id}:{j}": (t.id, j) for t, j in owned}
            try:
                out = self.run(owner, ["read-records", "--tail-bytes", keep, *pairs])
                for pair, data in json.loads(out).items():
                    if pair in pairs:
                        found[pairs[pair]] = records_from_json(data)
            except (OwnerCommandError, ValueError, KeyError, TypeError) as exc:
                log.warning("cannot read the records of %s's jobs: %s", owner, short(exc))
        return found

    def read_output(self, request: dict[str, Any]) -> dict[str, Any]:
        """The API's live output request (bridge.system.relay): `{"chunk": ...}`, or
        `{"error": "refused" | "unavailable" | "bad-request", "message": ...}`."""
        try:
            owner, args = _output_args(request)
        except ValueError as exc:
            return {"error": "bad-request", "message": f"bad output request: {exc}"}
        args[1] = str(self.config.work_dir / args[1])
        command = [self.config.job.python, "-m", "bridge.job", "read-output"]
        command += ["--work-dir", str(self.config.work_dir), *args]
        try:
            proc = run(
                as_user(self.config.site.sudo, owner, command),
                timeout=self.config.slurm.command_timeout,
                cwd="/",
            )
        except (CommandError, ValueError) as exc:
            return {"error": "unavailable", "message": f"cannot read the output as {owner}: {exc}"}
        detail = (proc.stderr.strip().splitlines()[-1:] or ["no message"])[0]
        if proc.returncode == EXIT_REFUSED:
            return {"error": "refused", "message": f"the output is not readable: {detail}"}
        if proc.returncode != 0:
            message = f"cannot read the output as {owner}: {detail}"
            return {"error": "unavailable", "message": message}
        try:
            return {"chunk": json.loads(proc.stdout)}
        except ValueError as exc:
            return {"error": "unavailable", "message": f"unexpected answer from read-output: {exc}"}

    def remove(self, owner: str, task_dir: Path) -> None:
        self.run(owner, ["remove", "--task-dir", str(task_dir)])

    def fence(self, owner: str, task_dir: Path, epoch: int, part: str | None = None) -> None:
        """Fence the task directory (or `part` of a staged task's chain) at lease `epoch` as
        its owner (bridge.job.owner fence)."""
        args = ["fence", "--task-dir", str(task_dir), "--epoch", str(epoch)]
        self.run(owner, args + (["--part", part] if part else []))

    def account_args(self, owner: str | None, document: dict[str, Any]) -> list[str]:
        """`--account=` from the mapping file, unless the task names its own account."""
        if owner is None:
            return []
        params = (document.get("resources") or {}).get("backend_parameters") or {}
        if any(str(k).lower() == "account" for k in params):
            return []
        if self._user_map is None:
            self._user_map = UserMap.load(self.config.auth.user_map_file)
        account = self._user_map.account_for(owner) or self.config.site.default_account
        return [f"--account={account}"] if account else []
