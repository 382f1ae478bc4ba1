"""A task staged on the transfer partition (`staging.where = "transfer"`, docs/staging.md) runs
as a chain of three jobs: stage-in, the task's own job (`afterok:` the stage-in job), stage-out
(`afterok:` the task's job), each with `--kill-on-invalid-dep=yes`, so a part that did not end
well ends the rest without their running. What the poller follows of them is one TES state
machine, decided by `decisions.decide` from the part the chain is at:

- the stage-in job, with its own records (`records/<stage-in id>/`), until it ended well:
  pending is QUEUED, running INITIALIZING; a failed stage-in recorded its outcome
  (SYSTEM_ERROR), a lost one (NODE_FAIL, ...) is submitted again, the whole chain;
- the task's job, with the task's records (which start with the stage-in's lines): pending
  (waiting for its nodes) stays INITIALIZING, running is RUNNING; one that ended badly is
  decided as a one-job task's (a time limit, a lost node, ...);
- the stage-out job, writing into the task's records: pending or running is RUNNING, and its
  recorded outcome ends the task.

The attempt's metadata names the chain (attempt.STAGING_KEY) before the first sbatch, then
each part's job id as it is submitted; `slurm_job_id` (the task's `job_id`) is the task's
own job, as for any task. Staged tasks submitted as three job arrays (submit.staged) are each
such a chain of their elements (`aftercorr:` in place of `afterok:`), named by the arrays'
names (`name`: the tasks' array's).
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge.core.naming import RUN_PART, STAGE_IN_PART, STAGE_OUT_PART, part_job_name
from bridge.core.tes import State
from bridge.poller.arrays import attempt_metadata, submitted_name
from bridge.poller.attempt import PART_FACTS, STAGE_IN_KEY, STAGE_OUT_KEY, STAGING_KEY, TRANSFER
from bridge.poller.decisions import Decision, in_queue
from bridge.slurm import JobInfo
from bridge.store import TaskRecord

#: The jobs of a chain: stage-in, the task's job, stage-out.
CHAIN_JOBS = 3

#: The metadata key of each transfer part's facts.
PART_KEYS = {STAGE_IN_PART: STAGE_IN_KEY, STAGE_OUT_PART: STAGE_OUT_KEY}


@dataclass(frozen=True)
class Chain:
    """The jobs of one attempt of a staged task (an id is None before its sbatch returned)."""

    #: The task's job's name (`naming.job_name`); the transfer jobs' add their part.
    name: str
    stage_in: str | None
    run: str | None
    stage_out: str | None

    def parts(self) -> list[tuple[str, str | None]]:
        return [
            (STAGE_IN_PART, self.stage_in),
            (RUN_PART, self.run),
            (STAGE_OUT_PART, self.stage_out),
        ]

    def ids(self) -> list[str]:
        return [job_id for _, job_id in self.parts() if job_id]

    def name_of(self, part: str) -> str:
        return part_job_name(self.name, part)


def chain_of(metadata: dict[str, str] | None, name: str) -> Chain | None:
    """The chain an attempt's metadata names (None: a task of one job). `name`: the task's
    job's name (arrays.submitted_name)."""
    if not metadata or metadata.get(STAGING_KEY) != TRANSFER:
        return None
    return Chain(
        name,
        metadata.get(STAGE_IN_KEY + "_job_id"),
        metadata.get("slurm_job_id"),
        metadata.get(STAGE_OUT_KEY + "_job_id"),
    )


def chain_of_task(task: TaskRecord) -> Chain | None:
    """The chain of jobs the task's attempt runs as (None: one job)."""
    return chain_of(attempt_metadata(task), submitted_name(task))


def ended_well(job: JobInfo | None) -> bool:
    """The job ended as `afterok` wants: COMPLETED with exit code 0 (squeue's COMPLETED has
    none yet)."""
    return job is not None and job.state == "COMPLETED" and job.exit_code in (0, None)


def _never_started(job: JobInfo | None) -> bool:
    """Pending still, or ended without starting (e.g. cancelled for its dependency: Slurm gives
    a job it cancels for `--kill-on-invalid-dep` a start time, but no node)."""
    if job is None or in_queue(job):
        return True
    if job.state == "CANCELLED" and not job.node:
        return True
    return job.ended and job.start_time is None and not job.node


@dataclass(frozen=True)
class Position:
    """Where the chain is: the part whose job Slurm's word is taken from, that job, and whose
    records hold the task's (the stage-in job's own until the task's job started)."""

    part: str
    job_id: str
    records_id: str


def position(chain: Chain, job: dict[str, JobInfo | None], stage_in_done: bool) -> Position:
    """The part the chain is at, from what Slurm says of each job (`job`, by id);
    `stage_in_done`: the stage-in job's end was recorded as good already (its facts are in the
    metadata, and it is no longer asked of Slurm)."""
    assert chain.stage_in and chain.run and chain.stage_out
    run = job.get(chain.run)
    stage_in_well = stage_in_done or ended_well(job.get(chain.stage_in))
    if _never_started(run) and not stage_in_well:
        return Position(STAGE_IN_PART, chain.stage_in, chain.stage_in)
    if not ended_well(run):
        return Position(RUN_PART, chain.run, chain.run)
    return Position(STAGE_OUT_PART, chain.stage_out, chain.run)


def jobs_held(chain: Chain, job: dict[str, JobInfo | None], at: Position) -> int:
    """How many of the chain's jobs Slurm may still hold (admission control counts them all):
    from the part it is at on, each not known to have ended. A stage-out job pending on its
    dependency counts against a QOS's MaxSubmitJobs as a running job does."""
    parts = chain.parts()
    start = [part for part, _ in parts].index(at.part)
    return sum(
        1
        for _, job_id in parts[start:]
        if job_id and not ((found := job.get(job_id)) is not None and found.ended)
    )


def adjust(decision: Decision, at: Position) -> Decision:
    """`decide`'s word on the part's job, as the chain's: the task's job waiting for its nodes
    after its inputs were staged is INITIALIZING, the stage-out job waiting for its node is
    RUNNING (the executors ran); the condition (what it waits for) stays."""
    if decision.state is not State.QUEUED or decision.retry:
        return decision
    if at.part == RUN_PART:
        decision.state = State.INITIALIZING
    elif at.part == STAGE_OUT_PART:
        decision.state = State.RUNNING
    return decision


def part_facts(metadata: dict[str, str], part: str, job: JobInfo) -> None:
    """What Slurm said of a transfer job, in the attempt's metadata."""
    key = PART_KEYS[part]
    values = {
        "_job_id": job.job_id,
        "_state": job.state,
        "_node": job.node,
        "_partition": job.partition,
        "_exit_code": None if job.exit_code is None else str(job.exit_code),
    }
    for suffix in PART_FACTS:
        value = values[suffix]
        if value:
            metadata[key + suffix] = value


def stage_in_done(metadata: dict[str, str]) -> bool:
    """The stage-in job's good end is recorded (sacct's COMPLETED with exit code 0)."""
    return (
        metadata.get(STAGE_IN_KEY + "_state") == "COMPLETED"
        and metadata.get(STAGE_IN_KEY + "_exit_code") == "0"
    )


def watched(chain: Chain, metadata: dict[str, str]) -> list[tuple[str, str]]:
    """The chain's transfer jobs to ask Slurm of (id, name): the stage-in job until its good
    end is recorded, the stage-out job always (the task's job is the task's `job_id`)."""
    parts = [(STAGE_OUT_PART, chain.stage_out)]
    if not stage_in_done(metadata):
        parts.insert(0, (STAGE_IN_PART, chain.stage_in))
    return [(job_id, chain.name_of(part)) for part, job_id in parts if job_id]
