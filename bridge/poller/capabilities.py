"""Now and then: what the cluster offers, for `GET /capabilities`.

The API never runs a Slurm command, so the poller reads the partitions (one `sinfo`, again
after `slurm.capabilities_refresh_seconds`), the Slurm release (`squeue --version`, read once by
the client) and the container runtime's version (once), and stores them for the API to serve
(`Store.put_meta(CAPABILITIES_KEY, ...)`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import Any

from bridge.poller.context import PollerContext, format_time_now, short
from bridge.slurm import Partition, SlurmError
from bridge.store import CAPABILITIES_KEY
from bridge.system.proc import CommandError, run

log = logging.getLogger("bridge.poller")

RUNTIME_VERSION_TIMEOUT = 30.0
#: Slurm calls the capabilities' sinfo leaves in the budget for the work that waits on Slurm.
CAPABILITIES_RESERVE = 8


def partition_facts(partition: Partition) -> dict[str, Any]:
    facts = asdict(partition)
    facts["nodes"] = list(partition.nodes)
    facts["gpus"] = partition.gpus
    facts["gpu_types"] = partition.gpu_types
    return facts


class CapabilitiesReader:
    def __init__(self, ctx: PollerContext) -> None:
        self.ctx = ctx
        self.read_at = float("-inf")
        self.runtime_version: str | None = None

    def maybe_refresh(self) -> None:
        now = self.ctx.clock()
        if now - self.read_at < self.ctx.config.slurm.capabilities_refresh_seconds:
            return
        if not self.ctx.slurm.budget.allows(keep=CAPABILITIES_RESERVE, command="sinfo", cost=2):
            return  # the least urgent call: only from a budget with room to spare
        self.read_at = now
        try:
            partitions = self.ctx.slurm.partitions()
        except SlurmError as exc:
            log.warning(
                "sinfo failed; the capabilities keep the partitions read before: %s", short(exc)
            )
            return
        if self.runtime_version is None:
            self.runtime_version = self._runtime_version()
        facts: dict[str, Any] = {
            "read_at": format_time_now(),
            "partitions": [partition_facts(p) for p in partitions],
            "runtime_version": self.runtime_version,
        }
        release = self.ctx.slurm.release()
        if release.version is not None:  # unknown: left out, as by a poller before this key
            facts["slurm"] = {"version": str(release), "tested": release.tested}
        self.ctx.store.put_meta(CAPABILITIES_KEY, json.dumps(facts))

    def _runtime_version(self) -> str | None:
        """`apptainer version 1.4.5` -> `1.4.5`; None when the runtime does not answer."""
        runtime = self.ctx.config.container.runtime
        try:
            proc = run([runtime, "--version"], timeout=RUNTIME_VERSION_TIMEOUT)
        except CommandError as exc:
            log.warning("cannot read the version of %s: %s", runtime, short(exc))
            return None
        words = proc.stdout.split()
        return words[-1] if proc.returncode == 0 and words else None
