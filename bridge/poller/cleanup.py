"""Now and then: remove old task directories and prune the image cache."""

from __future__ import annotations

import logging
import shutil

from bridge.core.tes import State
from bridge.poller.context import ImageSource, PollerContext
from bridge.poller.owners import OwnerCommandError, OwnerRunner

log = logging.getLogger("bridge.poller")

CLEANUP_INTERVAL = 600.0
_DAY = 86400.0


class Cleaner:
    def __init__(self, ctx: PollerContext, images: ImageSource, owners: OwnerRunner | None):
        self.ctx = ctx
        self.images = images
        #: Site mode: directories are removed as their owner.
        self.owners = owners
        self.last_cleanup = 0.0

    def maybe_clean(self) -> None:
        if self.ctx.clock() - self.last_cleanup > CLEANUP_INTERVAL:
            self.last_cleanup = self.ctx.clock()
            self.ctx.check_lease()  # files on the shared filesystem: the leader's alone
            self.clean_task_dirs()
            self.prune_images()

    def clean_task_dirs(self) -> None:
        """Remove task directories after the retention time (failed tasks are kept longer)."""
        now = self.ctx.clock()
        job = self.ctx.config.job
        policies = [
            (
                [State.COMPLETE.value, State.CANCELED.value, State.PREEMPTED.value],
                job.retention_days,
            ),
            ([State.EXECUTOR_ERROR.value, State.SYSTEM_ERROR.value], job.failed_retention_days),
        ]
        store = self.ctx.store
        for states, days in policies:
            for task in store.finished_before(now - days * _DAY, states):
                path = self.ctx.task_dir(task.id)
                if self.owners is not None:
                    full = store.get_task(task.id)
                    if full is not None and full.owner:
                        try:
                            self.owners.remove(full.owner, path)
                        except OwnerCommandError as exc:
                            log.warning("cannot remove the directory of %s: %s", task.id, exc)
                            continue
                elif path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                    log.info("removed the directory of task %s", task.id)
                store.mark_cleaned(task.id)

    def prune_images(self) -> None:
        """Remove SIFs a moved tag left behind once no unfinished task may still use them."""
        try:
            self.images.prune(self.ctx.store.oldest_unfinished_time())
        except OSError as exc:
            log.warning("cannot prune the image cache: %s", exc)
