"""Site mode: the per-user steps, run as each task's owner through the sudo rule.

`python -m bridge.job adopt | read-records | remove` (bridge/job/owner.py) as `sudo -n -u OWNER`
(deploy/sudoers.tes-bridge), and the owner's Slurm account.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.job.owner import records_from_json
from bridge.job.records import JobRecords
from bridge.jobscript.render import task_files
from bridge.poller.context import short
from bridge.slurm import NodeSizes
from bridge.store import TaskRecord
from bridge.system.proc import CommandError, as_user, run
from bridge.system.users import UserMap

log = logging.getLogger("bridge.poller")


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

    def read_records(self, tasks: list[TaskRecord]) -> dict[str, JobRecords]:
        """The records of these tasks' jobs by task id: one `read-records` per owner. An owner
        whose records cannot be read is left out (logged)."""
        found: dict[str, JobRecords] = {}
        by_owner: dict[str, list[TaskRecord]] = {}
        for task in tasks:
            if task.owner and task.job_id:
                by_owner.setdefault(task.owner, []).append(task)
        tail = str(self.config.job.log_tail_bytes)
        for owner, owned in by_owner.items():
            pairs = {f"{self.config.work_dir / t.id}:{t.job_id}": t for t in owned}
            try:
                out = self.run(owner, ["read-records", "--tail-bytes", tail, *pairs])
                for pair, data in json.loads(out).items():
                    if pair in pairs:
                        found[pairs[pair].id] = records_from_json(data)
            except (OwnerCommandError, ValueError, KeyError, TypeError) as exc:
                log.warning("cannot read the records of %s's jobs: %s", owner, short(exc))
        return found

    def remove(self, owner: str, task_dir: Path) -> None:
        self.run(owner, ["remove", "--task-dir", str(task_dir)])

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
