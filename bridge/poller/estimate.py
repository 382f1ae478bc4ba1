"""Where and when Slurm would start a task, without creating it: the API's `POST
/tasks:test-only`, asked over bridge.system.relay (the API runs no Slurm command).

The answer is `sbatch --test-only` of the job script the task would get: rendered as a
submission renders it (its `#SBATCH` options, `slurm.rules`, `slurm.extra_directives`, the
nodes' memory and TmpDisk), for a task id no task has, and read by sbatch from stdin; in site
mode as the task's owner, with the owner's account. Its images are named as posted, not pulled:
the script does not run. It spends the call budget like any sbatch, and only while
ESTIMATE_RESERVE tokens are left for the poller's own cycle.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from bridge.core.naming import format_time
from bridge.jobscript.render import render_script
from bridge.jobscript.task import RenderError
from bridge.poller.context import CycleStats, PollerContext, short
from bridge.poller.owners import OwnerRunner
from bridge.poller.submit.nodes import NodeSizesCache
from bridge.slurm import NodeSizes, SlurmError, SlurmRejected, StartEstimate
from bridge.store import new_task_id

log = logging.getLogger("bridge.poller")

#: Tokens of the call budget an estimate leaves to the poller's cycle (its squeue, sacct,
#: sbatch and scancel); with fewer, the API answers 503 and the client tries again.
ESTIMATE_RESERVE = 8


class StartEstimates:
    """Answers the relay's `{"kind": "test-only", "task": {...}, "owner": ...}` requests (in
    the relay's threads)."""

    def __init__(self, ctx: PollerContext, owners: OwnerRunner | None) -> None:
        self.ctx = ctx
        self.owners = owners
        self.nodes = NodeSizesCache(ctx)
        #: The nodes' sizes are read by one relay thread at a time.
        self._nodes_lock = threading.Lock()

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """`{"estimate": {...}}`, `{"refused": Slurm's reason}`, or `{"error": "bad-request" |
        "busy" | "unavailable", "message": ...}`."""
        document, owner = request.get("task"), request.get("owner")
        if not isinstance(document, dict) or not (owner is None or isinstance(owner, str)):
            return _error("bad-request", "bad test-only request: a task and its owner")
        if self.owners is not None and not owner:
            return _error("bad-request", "in site mode tasks run only as their owner")
        task = {**document, "id": new_task_id()}
        try:
            script = render_script(
                task,
                config=self.ctx.config,
                task_dir=self.ctx.task_dir(task["id"]),
                image_paths=_images_as_posted(task),
                nodes=self._nodes(task),
                owner=owner,
            )
        except RenderError as exc:
            return _error("bad-request", f"cannot run this task here: {exc}")
        if not self.ctx.slurm.budget.allows(keep=ESTIMATE_RESERVE, command="sbatch"):
            return _error("busy", "the budget of Slurm calls is spent for now")
        try:
            estimate = self.ctx.slurm.test_only(
                script, extra_args=self._account(owner, document), as_user=self._user(owner)
            )
        except SlurmRejected as exc:
            return {"refused": exc.reason}
        except SlurmError as exc:
            log.warning("sbatch --test-only failed: %s", exc)
            return _error("unavailable", short(exc))
        return {"estimate": estimate_json(estimate)}

    def _user(self, owner: str | None) -> str | None:
        return owner if self.owners is not None else None

    def _account(self, owner: str | None, document: dict[str, Any]) -> list[str]:
        return self.owners.account_args(owner, document) if self.owners is not None else []

    def _nodes(self, task: dict[str, Any]) -> NodeSizes | None:
        """The nodes' sizes where the task's --mem or --tmp depends on them."""
        resources = task.get("resources") or {}
        if not (resources.get("ram_gb") or resources.get("disk_gb")):
            return None
        with self._nodes_lock:
            return self.nodes.known(CycleStats())


def _images_as_posted(task: dict[str, Any]) -> dict[str, str]:
    return {
        executor["image"]: executor["image"]
        for executor in task.get("executors") or []
        if isinstance(executor, dict) and isinstance(executor.get("image"), str)
    }


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"error": kind, "message": message}


def estimate_json(estimate: StartEstimate) -> dict[str, Any]:
    """The API's answer: Slurm's estimate (its time in RFC 3339, UTC) and Slurm's own line."""
    answer: dict[str, Any] = {
        "start_time": format_time(estimate.start) if estimate.start else None,
        "nodes": estimate.nodes,
        "processors": estimate.processors,
        "partition": estimate.partition,
        "cluster": estimate.cluster,
        "preempts": estimate.preempts,
        "slurm": estimate.said,
    }
    return {key: value for key, value in answer.items() if value not in (None, [])}
