"""Slurm in memory, for the poller's tests: a :class:`bridge.slurm.SlurmBackend` that mypy checks
against the protocol (see the end of this module), so that the fake cannot drift from it.

It fails the way :class:`bridge.slurm.SlurmClient` does: a failing command's stderr goes through
:func:`bridge.slurm.command_error`, so a test that hands it sbatch's words gets the error, and
the kind of it, that the real client raises for them.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bridge.slurm import (
    RPC_COST,
    JobInfo,
    NodeSizes,
    Outage,
    Partition,
    SlurmBackend,
    SlurmError,
    SlurmRelease,
    SlurmUnavailable,
    StartEstimate,
    command_error,
    parse_sinfo_node_sizes,
    parse_sinfo_partitions,
    parse_test_only,
)
from bridge.system.budget import CallBudget

#: What a Slurm command prints while slurmctld is away (tests/data/slurm/*-controller-down*).
UNREACHABLE = "Unable to contact slurm controller (connect failure)"
#: What sbatch --test-only prints, in the form of 22.05 to 25.05 (src/api/allocate.c; 25.11's
#: is in tests/data/slurm/26.05/sbatch-test-only.txt.stderr).
WILL_RUN = (
    "sbatch: Job 99 to start at 2026-11-29T10:00:00 using 1 processors on nodes n1 in "
    "partition main\n"
)
#: What sbatch prints when its answer is lost: the job may exist all the same.
NO_ANSWER = "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation"


def job(job_id: str = "1", state: str = "RUNNING", **fields: Any) -> JobInfo:
    """A job as squeue or sacct would report it; `fields` replace the defaults."""
    defaults: dict[str, Any] = dict(
        job_id=job_id,
        name="tes-x",
        state=state,
        reason=None,
        exit_code=None,
        signal=None,
        node="n1",
        partition="main",
        start_time=None,
        end_time=None,
        elapsed_seconds=None,
        max_rss_bytes=None,
        comment=None,
    )
    return JobInfo(**(defaults | fields))


def failure(argv: Sequence[str], stderr: str) -> SlurmError:
    """The error SlurmClient raises for a command that printed `stderr` and exited 1."""
    proc = subprocess.CompletedProcess(list(argv), 1, "", stderr)
    return command_error(proc, f"running {argv[0]} (fake)")


class FakeSlurm:
    """Keeps jobs in memory; counts calls; can be told to fail. Each switch is an attribute,
    set at construction or flipped in the middle of a test."""

    def __init__(
        self,
        *,
        sinfo: str | None = "main*|102400|4000\n",
        sinfo_partitions: str = "main*|n1|2|4000|infinite|(null)|0|up|idle\n",
    ) -> None:
        self.jobs: dict[str, JobInfo] = {}
        #: No limit unless a test sets one (the poller only looks at it).
        self.budget = CallBudget.unlimited()
        self.ids = itertools.count(100)
        #: The commands run, in order ("find" for find_by_names; partitions() apart).
        self.calls: list[str] = []
        #: Every command fails, printing `unavailable_message`.
        self.unavailable = False
        self.unavailable_message = UNREACHABLE
        #: sbatch exits 1 printing this: a refusal for good or for a limit, as its words say.
        self.sbatch_error: str | None = None
        #: sbatch creates the job but its answer is lost.
        self.create_then_fail = False
        #: sbatch creates the job, but slurmctld's RPC rate limit slowed it past its time-out:
        #: the client killed it, its last attempt done.
        self.rate_limited_then_killed = False
        #: What `sinfo -h -a -o '%P|%d|%m'` prints (None: sinfo cannot reach slurmctld).
        self.sinfo = sinfo
        #: What `sinfo -h -a -N -o SINFO_PARTITIONS_FORMAT` prints.
        self.sinfo_partitions = sinfo_partitions
        #: Each submitted job script's text.
        self.scripts: list[str] = []
        self.partition_reads = 0
        #: What sacct alone says of a job, ahead of `jobs` (e.g. the PREEMPTED record of a job
        #: Slurm requeued, while squeue shows it pending again).
        self.accounting_only: dict[str, JobInfo] = {}
        #: MaxArraySize, and the size of each array submitted.
        self.array_limit = 1001
        self.arrays: list[int] = []
        #: The element indexes of each array submitted.
        self.array_elements: list[list[int]] = []
        #: The script's own arguments of each sbatch (the lease epoch of an elected poller).
        self.script_args: list[list[str]] = []
        #: sbatch's own options of each sbatch (a staged task's --dependency).
        self.extra_args: list[list[str]] = []
        #: The release `release()` says (the real client reads it once, from squeue --version).
        self.version: tuple[int, ...] | None = (22, 5, 8)
        #: What sbatch --test-only prints on stderr, and each (script, extra args, user) asked.
        self.test_only_stderr = WILL_RUN
        self.tested: list[tuple[str, list[str], str | None]] = []

    def _check(self, command: str) -> None:
        self.calls.append(command)
        # Spent as SlurmClient spends it (a test that sets a budget sees it run down).
        self.budget.take(command, RPC_COST.get(command, 1))
        if self.unavailable:
            raise failure([command], self.unavailable_message)

    def submit(
        self,
        script: Path,
        *,
        job_name: str,
        comment: str | None = None,
        extra_args: Sequence[str] = (),
        as_user: str | None = None,
        array_size: int | None = None,
        script_args: Sequence[str] = (),
        array_indexes: Sequence[int] | None = None,
    ) -> str:
        if array_indexes is not None:
            array_size = None  # the elements given, by index
        elements = list(range(array_size)) if array_size is not None else array_indexes
        self.script_args.append(list(script_args))
        self.extra_args.append(list(extra_args))
        if self.rate_limited_then_killed:
            self._queue(job_name, elements)
            self.calls.append("sbatch")
            raise SlurmUnavailable(
                "sbatch was slowed by slurmctld's RPC rate limit for longer than "
                "slurm.command_timeout (fake)",
                outage=Outage.RATE_LIMITED,
                argv=["sbatch", str(script)],
            )
        if self.create_then_fail:
            self._queue(job_name, elements)
            self.calls.append("sbatch")
            raise failure(["sbatch", str(script)], NO_ANSWER)
        self._check("sbatch")
        if self.sbatch_error is not None:
            raise failure(["sbatch", str(script)], self.sbatch_error)
        self.scripts.append(script.read_text())
        if elements is not None:
            self.arrays.append(len(elements))
            self.array_elements.append(list(elements))
        return self._queue(job_name, elements)

    def test_only(
        self, script: str, *, extra_args: Sequence[str] = (), as_user: str | None = None
    ) -> StartEstimate:
        self._check("sbatch")
        if self.sbatch_error is not None:
            raise failure(["sbatch", "--test-only"], self.sbatch_error)
        self.tested.append((script, list(extra_args), as_user))
        estimate = parse_test_only(self.test_only_stderr)
        if estimate is None:
            raise SlurmError("sbatch --test-only printed no estimate (fake)", argv=["sbatch"])
        return estimate

    def _queue(self, job_name: str, indexes: Sequence[int] | None = None) -> str:
        """A pending job, or (`indexes`) the elements `ID_I` of a pending array."""
        job_id = str(next(self.ids))
        elements = [job_id] if indexes is None else [f"{job_id}_{i}" for i in indexes]
        for element in elements:
            self.jobs[element] = job(element, "PENDING", name=job_name, reason="Priority")
        return job_id

    def release(self) -> SlurmRelease:
        return SlurmRelease(self.version)

    def max_array_size(self) -> int:
        self._check("scontrol")
        return self.array_limit

    def node_sizes(self) -> NodeSizes:
        self._check("sinfo")
        if self.sinfo is None:
            raise failure(["sinfo"], UNREACHABLE)
        return parse_sinfo_node_sizes(self.sinfo)

    def partitions(self) -> list[Partition]:
        # Counted apart from `calls`: the capabilities are read once a minute, whatever the
        # test, and the tests count the calls of the steps they drive.
        self.partition_reads += 1
        if self.unavailable:
            raise failure(["sinfo"], UNREACHABLE)
        return parse_sinfo_partitions(self.sinfo_partitions)

    def queue(self, job_ids: Collection[str]) -> dict[str, JobInfo]:
        self._check("squeue")
        return {j: self.jobs[j] for j in job_ids if j in self.jobs}

    def accounting(self, job_ids: Collection[str]) -> dict[str, JobInfo]:
        self._check("sacct")
        known = self.jobs | self.accounting_only
        return {j: known[j] for j in job_ids if j in known}

    def find_by_names(self, names: Collection[str]) -> dict[str, list[JobInfo]]:
        self._check("find")
        found: dict[str, list[JobInfo]] = {}
        for info in self.jobs.values():
            if info.name in names:
                found.setdefault(info.name, []).append(info)
        return found

    def cancel(self, job_ids: Collection[str], *, as_user: str | None = None) -> None:
        self._check("scancel")
        for job_id in job_ids:
            # As sacct names the uid that ran scancel ("CANCELLED by 0").
            self.jobs[job_id] = replace(self.jobs[job_id], state="CANCELLED", canceled_by="0")


# mypy checks here that the fake has every method of the protocol, with its signature.
_: SlurmBackend = FakeSlurm()
