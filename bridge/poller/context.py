"""What the poller's collaborators share: the configuration, the store, Slurm and the clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bridge.config import Config
from bridge.core.naming import format_time_now as format_time_now
from bridge.slurm import SlurmBackend
from bridge.store import Store


class ImageSource(Protocol):
    """What the poller needs of the image cache (`ImageCache`; a fake in tests)."""

    def resolve(self, images: Sequence[str]) -> dict[str, str] | None: ...

    def problem(self, image: str) -> str | None: ...

    def prune(self, oldest_unfinished: float | None) -> object: ...


@dataclass
class CycleStats:
    submitted: int = 0
    updated: int = 0
    canceled: int = 0
    slurm_calls: int = 0
    seconds: float = 0.0


def _no_lease() -> None:
    """One poller per store (SQLite's lock file): it always leads."""


@dataclass
class PollerContext:
    config: Config
    store: Store
    slurm: SlurmBackend
    clock: Callable[[], float] = field(default=time.time)
    #: Raises NotLeader unless this poller still holds its lease (bridge.poller.lease):
    #: called just before every sbatch and scancel.
    check_lease: Callable[[], None] = field(default=_no_lease)
    #: Jobs of tasks already decided (finished, canceled, or to be submitted again) that Slurm
    #: still held at its last word: (job id, job name) -> the task's owner. Admission counts
    #: them until squeue lists them neither pending, running nor completing (JobWatch.update):
    #: a task decided from its records frees its slot only once its job has left Slurm.
    jobs_leaving: dict[tuple[str, str], str | None] = field(default_factory=dict)
    #: The jobs staged tasks' chains hold in Slurm beyond the one the store counts for each
    #: task (their later parts, pending on their dependency), by owner, at the last follow
    #: (poller.chain.jobs_held): admission counts a chain's jobs, not one per task.
    chain_jobs_beyond_one: dict[str | None, int] = field(default_factory=dict)
    _last_token: int = field(default=0, repr=False)

    def fence_token(self) -> int:
        """What each sbatch gives its job (`lease-epoch=`) and what recovery fences a task's
        directory at (recover.py): an elected poller's lease epoch; a lone poller's clock in
        milliseconds. A job whose sbatch started before the fence stands down when it starts
        (templates/job.sh.j2): an sbatch that timed out, which slurmctld acted on after the
        poller looked for its job and found none, does not run the task a second time."""
        epoch = self.store.fence_epoch
        if epoch is not None:
            return epoch
        # Each above the one before: a clock stepped back must not fence out new jobs.
        self._last_token = max(int(self.clock() * 1000), self._last_token + 1)
        return self._last_token

    @property
    def admission_control(self) -> bool:
        """Whether the service limits its jobs in Slurm (slurm.max_jobs_in_flight or
        slurm.max_jobs_per_owner): only then are `jobs_leaving` kept and counted."""
        slurm = self.config.slurm
        return bool(slurm.max_jobs_in_flight or slurm.max_jobs_per_owner)

    @property
    def site(self) -> bool:
        """Site mode: every task runs as its owner (sudo -n -u OWNER)."""
        return self.config.site.run_as_owner

    def task_dir(self, task_id: str) -> Path:
        return self.config.work_dir / task_id


def short(exc: Exception) -> str:
    """The first line of an error, for logs and system_logs."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
