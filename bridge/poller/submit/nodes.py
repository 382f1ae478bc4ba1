"""The nodes' sizes a task's directives may need: TmpDisk for `--tmp`, memory for `--mem`."""

from __future__ import annotations

import logging

from bridge.poller.context import CycleStats, PollerContext
from bridge.slurm import NodeSizes, SlurmError

log = logging.getLogger("bridge.poller")

#: After sbatch refuses a `--tmp`, TmpDisk is read again if the last read is older than this
#: (at most one sinfo per this many seconds, however many tasks are refused); after sinfo failed
#: with no answer yet, tasks that can do without it (memory only) try it again no sooner.
TMP_DISK_RECHECK = 30.0


class NodeSizesCache:
    """The partitions' node TmpDisk (slurm.disk_request "auto") and memory (`--mem` of a whole
    node), read with one sinfo now and then."""

    def __init__(self, ctx: PollerContext) -> None:
        self.ctx = ctx
        self._nodes: NodeSizes | None = None
        self._read_at = 0.0
        self._failed_at = float("-inf")

    def get(self, stats: CycleStats) -> NodeSizes:
        """Read again after `slurm.tmp_disk_refresh_seconds`. When sinfo fails the last answer
        stays in use; with none yet, the SlurmError is raised."""
        now = self.ctx.clock()
        refresh = self.ctx.config.slurm.tmp_disk_refresh_seconds
        if self._nodes is None or now - self._read_at >= refresh:
            try:
                stats.slurm_calls += 1
                self._nodes = self.ctx.slurm.node_sizes()
                log.info(
                    "node-local disk (TmpDisk) by partition: %s; largest node memory: %s",
                    self._nodes.describe_tmp_disk(),
                    self._nodes.memory_largest,
                )
            except SlurmError as exc:
                if self._nodes is None:
                    raise
                log.warning("sinfo failed; keeping the node sizes read before: %s", exc)
            self._read_at = now
        return self._nodes

    def known(self, stats: CycleStats) -> NodeSizes | None:
        """`get`, or None when sinfo fails; with no answer yet, sinfo is tried again only
        `TMP_DISK_RECHECK` seconds after it failed (tasks that can do without it go on)."""
        if self._nodes is None and self.ctx.clock() - self._failed_at < TMP_DISK_RECHECK:
            return None
        try:
            return self.get(stats)
        except SlurmError as exc:
            log.warning("sinfo failed; --mem stays as asked: %s", exc)
            self._failed_at = self.ctx.clock()
            return None

    def hint(self, disk: float, stats: CycleStats) -> str:
        """Why sbatch refused the `--tmp` of `disk` GB, and the setting that decides it."""
        mode = self.ctx.config.slurm.disk_request
        if self.ctx.clock() - self._read_at > TMP_DISK_RECHECK:
            self._read_at = float("-inf")  # what the nodes declare may have changed
        try:
            declared = f"the nodes declare TmpDisk {self.get(stats).describe_tmp_disk()}"
        except SlurmError:
            declared = "the nodes' TmpDisk could not be read"
        hint = (
            f". resources.disk_gb = {disk:g} asks Slurm for that much node-local "
            f'disk (sbatch --tmp, slurm.disk_request = "{mode}"), and {declared}'
        )
        if mode == "tmp":
            return hint + (
                "; a node that declares no TmpDisk (0) gives no --tmp at all: set "
                'slurm.disk_request = "auto" to pass disk_gb only where nodes declare TmpDisk'
            )
        return hint + "; ask for less disk_gb, or for a partition with larger TmpDisk"
