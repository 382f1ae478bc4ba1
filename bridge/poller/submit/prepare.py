"""The first step of a submission: a task's images in the cache, then its task directory and
job script written, by the service or (site mode) by the task's owner."""

from __future__ import annotations

import errno
import logging
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.core import backend_params
from bridge.core.reasons import IMAGE_PULL_FAILED
from bridge.images.ref import ImagePullError
from bridge.jobscript.parts import staged_apart
from bridge.jobscript.render import prepare_task_dir
from bridge.jobscript.task import RenderError, parse_task
from bridge.poller.arrays import PreparedJob, Ready
from bridge.poller.attempt import Condition, ConditionKind, TaskLogs
from bridge.poller.context import CycleStats, ImageSource, PollerContext, short
from bridge.poller.owners import OwnerCommandError, OwnerRunner
from bridge.poller.submit.nodes import NodeSizesCache
from bridge.poller.submit.outcome import Fail, Outcomes, Wait
from bridge.slurm import NodeSizes, SlurmError
from bridge.store import TaskRecord

log = logging.getLogger("bridge.poller")

#: Errors while preparing a task directory that pass by themselves (a full or over-quota
#: filesystem, a file server away): the task waits in QUEUED and is tried again with back-off.
TRANSIENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM, errno.EMFILE,
     errno.ENFILE, errno.EAGAIN, errno.ESTALE, errno.ETIMEDOUT, errno.EBUSY}
)  # fmt: skip


def time_limit(document: dict[str, Any], config: Config) -> backend_params.TimeLimit | None:
    """The --time the render gave the job (it refuses a task whose limit raises here)."""
    params = (document.get("resources") or {}).get("backend_parameters")
    try:
        return backend_params.time_limit(params, config.slurm.times)
    except backend_params.ParameterError:
        return None


def _gigabytes(document: dict[str, Any], key: str) -> float:
    value = (document.get("resources") or {}).get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return 0.0


def disk_gb(document: dict[str, Any]) -> float:
    return _gigabytes(document, "disk_gb")


class Preparer:
    """A task made `Ready`: its images resolved (pulls start in the background), then its task
    directory and job script written, with the nodes' TmpDisk that `slurm.disk_request =
    "auto"` needs and their memory (`memory_directive`). A task that cannot be prepared
    failed or waits (`Outcomes`)."""

    def __init__(
        self,
        ctx: PollerContext,
        images: ImageSource,
        owners: OwnerRunner | None,
        outcomes: Outcomes,
    ) -> None:
        self.ctx = ctx
        self.images = images
        #: Site mode: task directories are written as the task's owner.
        self.owners = owners
        self.outcomes = outcomes
        self.nodes = NodeSizesCache(ctx)
        #: Tasks of this submission round waiting for an image pull (a gauge).
        self.waiting_for_images = 0
        #: Tasks left QUEUED by the last round (`keep`: held back to gather into an array, or
        #: not reached before the call budget was spent), as prepared, with their images: the
        #: next round submits them without writing their directories again (a burst's tasks
        #: are held for several rounds while more of their shape arrive, or wait for the
        #: budget a few sbatches a cycle).
        self._kept: dict[str, tuple[int, dict[str, str], Ready]] = {}
        #: The images each task of this round was prepared with.
        self._round_images: dict[str, dict[str, str]] = {}

    def keep(self, held: list[Ready], read: Collection[str] = ()) -> None:
        """The round is over: remember `held` as prepared, for the next round; and what was
        kept of the tasks the round `read` (by id) but told to wait before preparing them (a
        round full for admission): they are taken as they are once their turn comes."""
        images = self._round_images
        kept = {
            r.task.id: (r.task.attempt, images[r.task.id], r) for r in held if r.task.id in images
        }
        for task_id in read:
            if task_id not in images and task_id in self._kept:
                kept.setdefault(task_id, self._kept[task_id])
        self._kept = kept
        self._round_images = {}

    def ready(self, task: TaskRecord, stats: CycleStats) -> Ready | None:
        """The task's directory and job script written, or None (it waits, or failed)."""
        assert task.document is not None
        image_paths = self._images(task)
        if image_paths is None:
            return None  # pulling in the background (or failed); tried again next cycle
        self._round_images[task.id] = image_paths
        kept = self._kept.get(task.id)
        if kept is not None and kept[0] == task.attempt and kept[1] == image_paths:
            # Written last round, for the same attempt and images: the document cannot have
            # changed (tasks are immutable), the nodes' sizes are kept for minutes anyway.
            return replace(kept[2], task=task)
        document = {**task.document, "id": task.id}
        owner = task.owner if self.owners is not None else None
        try:
            if self.owners is not None and not owner:
                raise Fail("this task has no owner; in site mode tasks run only as their owner")
            prepared = self.job(document, owner, image_paths, stats, task_owner=task.owner)
        except Fail as exc:
            self.outcomes.fail(task, str(exc))
            return None
        except Wait as exc:
            self.outcomes.wait(task, task.attempt + 1, exc.reason)
            return None
        return Ready(task, prepared, document, owner)

    def job(
        self,
        document: dict[str, Any],
        owner: str | None,
        image_paths: dict[str, str],
        stats: CycleStats,
        *,
        task_owner: str | None = None,
    ) -> PreparedJob:
        """Raises Fail or Wait. `owner`: who writes it (site mode), `task_owner`: whose groups
        `slurm.rules` look at."""
        disk = disk_gb(document)
        script = self._write(
            document, owner, image_paths, self._nodes(disk, document, stats), task_owner
        )
        staged = staged_apart(parse_task(document), self.ctx.config)
        return PreparedJob(script, time_limit(document, self.ctx.config), disk, staged)

    def _nodes(self, disk: float, document: dict[str, Any], stats: CycleStats) -> NodeSizes | None:
        """What the task's directives need of the nodes, read when it asks for disk
        (disk_request "auto") or memory. Unknown disk holds the task; unknown memory only
        leaves `--mem` as asked."""
        if not (self.ctx.config.slurm.disk_request == "auto" and disk > 0):
            return self.nodes.known(stats) if _gigabytes(document, "ram_gb") else None
        try:
            return self.nodes.get(stats)
        except SlurmError as exc:
            log.warning("sinfo failed: %s", exc)
            reason = f"cannot read the nodes' TmpDisk from Slurm ({short(exc)}); retrying"
            raise Wait(Condition(ConditionKind.TMP_DISK_UNKNOWN, reason)) from exc

    def _write(
        self,
        document: dict[str, Any],
        owner: str | None,
        image_paths: dict[str, str],
        nodes: NodeSizes | None,
        task_owner: str | None,
    ) -> Path:
        """The task directory, rendered and written; returns its job script."""
        try:
            if owner and self.owners is not None:
                return self.owners.adopt(owner, document, image_paths, nodes)
            return prepare_task_dir(
                document,
                config=self.ctx.config,
                image_paths=image_paths,
                nodes=nodes,
                owner=task_owner,
            )
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS:
                raise Fail(f"cannot prepare the task directory: {exc}") from exc
            # Every task would meet the same full disk: all submissions wait for the back-off.
            log.warning("cannot prepare the directory of task %s: %s", document["id"], exc)
            reason = f"waiting: cannot prepare the task directory ({exc})"
            raise Wait(Condition(ConditionKind.TASK_DIR_UNWRITABLE, reason)) from exc
        except RenderError as exc:
            raise Fail(f"cannot run this task here: {exc}") from exc
        except OwnerCommandError as exc:
            raise Fail(f"cannot create the task directory as {owner}: {exc}") from exc

    def _images(self, task: TaskRecord) -> dict[str, str] | None:
        """The task's images in the cache, or None while they are pulled (all of the task's
        pulls start at once) or when one cannot be pulled (the task then failed)."""
        assert task.document is not None
        images = [e["image"] for e in task.document["executors"]]
        try:
            image_paths = self.images.resolve(images)
        except ImagePullError as exc:
            self._note_images(task, [], write=False)
            self.outcomes.fail(task, f"{IMAGE_PULL_FAILED}{exc}")
            return None
        # Transient trouble (registry down, full cache) is said in system_logs while it lasts.
        notes = [] if image_paths else [p for p in map(self.images.problem, images) if p]
        if image_paths is None:
            self.waiting_for_images += 1
        self._note_images(task, notes, write=image_paths is None)
        return image_paths

    def _note_images(self, task: TaskRecord, notes: list[str], *, write: bool) -> None:
        """Replace the task's "pulling image" lines by `notes` (stored only when they change)."""
        if not notes and not task.logs:
            return
        logs = TaskLogs(task.logs)
        if not logs.attempt(task.attempt + 1).set_image_notes(notes):
            return
        task.logs = logs.to_json()
        if write:
            self.ctx.store.note(task.id, task.logs)
