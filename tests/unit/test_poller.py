"""The poller's decisions and bookkeeping, with a fake Slurm for speed.

The same paths run against the real cluster in tests/cluster/test_execution.py; these tests pin
the corner cases that are hard to produce on demand there (a crash between sbatch and the
database write, a controller that times out, lost nodes).
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bridge.config import Config, load_config
from bridge.core.naming import (
    LEASE_EPOCH_ARG,
    NO_RECORDS_EXIT_CODE,
    STAGE_IN_EXIT_CODE,
    STAGE_OUT_EXIT_CODE,
    SUPERSEDED_EXIT_CODE,
)
from bridge.core.reasons import task_reason
from bridge.core.tes import State, View, render_task
from bridge.job.layout import LEASE_FENCE
from bridge.job.records import ExecutorRecord, JobRecords
from bridge.poller import Poller, decide, job_name
from bridge.poller.attempt import LOST_JOBS_KEY, Condition, ConditionKind
from bridge.poller.decisions import MISSING_JOB_GRACE, NOTHING_RAN_RESUBMISSIONS, Decision
from bridge.poller.follow import FINAL_FACTS_GRACE
from bridge.slurm import parse_sacct
from bridge.store import Store
from tests.fakes.slurm import FakeSlurm, job

ECHO = {"executors": [{"image": "alpine", "command": ["echo", "hello"]}]}


def second_executor_running(job_id: str) -> JobRecords:
    """A job's records while its second executor runs: the first ended 0, the second printed."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    return JobRecords(
        job_id=job_id,
        phase="running 1",
        start_time=t0,
        executors=[
            ExecutorRecord(0, t0, t0, 0, "one\n", ""),
            ExecutorRecord(1, t0, None, None, "two so far", ""),
        ],
    )


#: Slurm's output, captured on the local cluster (tests/data/slurm/README).
DATA = Path(__file__).parents[1] / "data" / "slurm"


class FakeImages:
    def __init__(self) -> None:
        self.ready = True
        #: image -> what ImageCache.problem() says (transient trouble).
        self.problems: dict[str, str] = {}
        self.pruned: list[float | None] = []

    def resolve(self, images) -> dict[str, str] | None:
        return {image: f"/cache/{image}.sif" for image in images} if self.ready else None

    def problem(self, image: str) -> str | None:
        return self.problems.get(image)

    def prune(self, oldest_unfinished: float | None) -> None:
        self.pruned.append(oldest_unfinished)


@pytest.fixture
def env(tmp_path: Path, sqlite_store: Store):
    # A round's tasks go at once: gathering a burst into arrays is tests/unit/test_arrays.py's.
    config: Config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"slurm.array_gather_seconds": 0},
    )
    slurm = FakeSlurm()
    images = FakeImages()
    poller = Poller(config, sqlite_store, slurm_client=slurm, images=images)
    return poller, sqlite_store, slurm, images


def records(**kw) -> JobRecords:
    return JobRecords(job_id="1", **kw)


# ----------------------------------------------------------------------------- decide()


@pytest.mark.parametrize(
    ("outcome", "state"),
    [
        ("complete", State.COMPLETE),
        ("executor_error", State.EXECUTOR_ERROR),
        ("system_error", State.SYSTEM_ERROR),
    ],
)
def test_the_job_records_decide_the_final_state(outcome, state):
    for slurm_state in ("RUNNING", "COMPLETING", "COMPLETED", "FAILED"):
        decision = decide(
            job=job(state=slurm_state),
            records=records(outcome=outcome),
            attempt=1,
            retries=2,
            current=State.RUNNING,
        )
        assert decision.state is state


def test_pending_job_is_queued_with_its_reason():
    decision = decide(
        job=job(state="PENDING", reason="Resources"),
        records=records(),
        attempt=1,
        retries=2,
        current=State.QUEUED,
    )
    assert decision.state is State.QUEUED
    assert decision.condition == Condition(
        ConditionKind.SLURM_PENDING, "Slurm job 1 is pending (Resources)"
    )


@pytest.mark.parametrize(
    ("phase", "state"),
    [
        (None, State.INITIALIZING),
        ("staging", State.INITIALIZING),
        ("running 0", State.RUNNING),
        ("running 3", State.RUNNING),
        ("uploading", State.RUNNING),
    ],
)
def test_running_job_state_follows_its_phase(phase, state):
    decision = decide(
        job=job(state="RUNNING"),
        records=records(phase=phase),
        attempt=1,
        retries=2,
        current=State.QUEUED,
    )
    assert decision.state is state


@pytest.mark.parametrize("slurm_state", ["NODE_FAIL", "PREEMPTED", "BOOT_FAIL"])
def test_lost_jobs_are_retried_then_fail(slurm_state):
    lost = job(state=slurm_state)
    # retries = 2: two more attempts after the first, so attempt 3 is the last.
    for attempt in (1, 2):
        decision = decide(
            job=lost, records=records(), attempt=attempt, retries=2, current=State.RUNNING
        )
        assert decision.retry and decision.state is State.QUEUED
    decision = decide(job=lost, records=records(), attempt=3, retries=2, current=State.RUNNING)
    assert not decision.retry and decision.state is State.SYSTEM_ERROR


def test_preempted_job_ends_the_task_preempted_when_the_site_says_so():
    preempted = job(state="PREEMPTED", exit_code=0, partition="scavenger")
    decision = decide(
        job=preempted,
        records=records(phase="running 0"),
        attempt=1,
        retries=2,
        current=State.RUNNING,
        on_preemption="report",
    )
    assert decision.state is State.PREEMPTED and decision.final and not decision.retry
    (message,) = decision.messages
    assert "Slurm job 1 ended in state PREEMPTED" in message
    assert "scavenger" in message and "submit the task again" in message
    # The default: a new attempt, as for a lost node.
    again = decide(job=preempted, records=records(), attempt=1, retries=2, current=State.RUNNING)
    assert again.retry and again.state is State.QUEUED


def test_a_preempted_job_that_recorded_its_outcome_keeps_it():
    decision = decide(
        job=job(state="PREEMPTED"),
        records=records(outcome="complete"),
        attempt=1,
        retries=2,
        current=State.RUNNING,
        on_preemption="report",
    )
    assert decision.state is State.COMPLETE


@pytest.mark.parametrize(
    ("slurm_state", "phase", "state", "words"),
    [
        ("TIMEOUT", "running 0", State.EXECUTOR_ERROR, "time limit"),
        ("TIMEOUT", "staging", State.SYSTEM_ERROR, "time limit"),
        ("OUT_OF_MEMORY", "running 1", State.EXECUTOR_ERROR, "out of memory"),
        ("OUT_OF_MEMORY", "uploading", State.SYSTEM_ERROR, "out of memory"),
        ("FAILED", "running 0", State.SYSTEM_ERROR, "without recording an outcome"),
        ("COMPLETED", "staging", State.SYSTEM_ERROR, "without recording an outcome"),
        ("CANCELLED", "running 0", State.CANCELED, "canceled outside"),
    ],
)
def test_jobs_that_end_without_an_outcome(slurm_state, phase, state, words):
    canceled_by = "1000" if slurm_state == "CANCELLED" else None  # sacct: "CANCELLED by 1000"
    decision = decide(
        job=job(state=slurm_state, exit_code=1, canceled_by=canceled_by),
        records=records(phase=phase),
        attempt=1,
        retries=0,
        current=State.RUNNING,
    )
    assert decision.state is state
    assert words in decision.messages[0]


@pytest.mark.parametrize(
    ("exit_code", "outcome", "state"),
    [
        (42, "executor_error", State.EXECUTOR_ERROR),
        # An executor's own exit code may be one the script keeps for itself: the outcome the
        # script wrote before passing it on decides, never the code (no resubmission).
        (NO_RECORDS_EXIT_CODE, "executor_error", State.EXECUTOR_ERROR),
        (SUPERSEDED_EXIT_CODE, "executor_error", State.EXECUTOR_ERROR),
        (STAGE_IN_EXIT_CODE, "system_error", State.SYSTEM_ERROR),
        (STAGE_OUT_EXIT_CODE, "system_error", State.SYSTEM_ERROR),
    ],
)
def test_a_failed_job_that_recorded_its_outcome_is_decided_by_it(exit_code, outcome, state):
    """The job script ends FAILED with the failing executor's exit code (or its own staging
    code), after recording the task's outcome: that outcome is the task's state, whatever the
    code, and no retry is spent."""
    failed = job(state="FAILED", exit_code=exit_code, signal=0)
    for phase in (None, "done"):
        decision = decide(
            job=failed,
            records=records(phase=phase, outcome=outcome),
            attempt=3,
            retries=2,
            current=State.RUNNING,
        )
        assert decision.state is state and not decision.retry and decision.messages == []


def test_a_job_that_could_not_write_its_records_is_lost_not_failed():
    """The script exits NO_RECORDS_EXIT_CODE when it cannot even start its records (a full or
    read-only work filesystem): none of the task ran, so the job is submitted again."""
    unwritten = job(state="FAILED", exit_code=NO_RECORDS_EXIT_CODE, signal=0)
    decision = decide(
        job=unwritten, records=records(), attempt=1, retries=2, current=State.INITIALIZING
    )
    assert decision.retry and decision.state is State.QUEUED
    (message,) = decision.messages
    assert "could not write its records" in message and "submitting it again" in message
    # Nothing of the task ran: no retry spent (the nemesis: one task's attempts met a full work
    # filesystem, a slurmctld that forgot the job, a full work filesystem again), up to a bound.
    again = decide(job=unwritten, records=records(), attempt=3, retries=2, current=State.QUEUED)
    assert again.retry and again.state is State.QUEUED
    bound = 2 + NOTHING_RAN_RESUBMISSIONS
    last = decide(
        job=unwritten, records=records(), attempt=bound + 1, retries=2, current=State.QUEUED
    )
    assert last.state is State.SYSTEM_ERROR and "no retries left (2)" in last.messages[0]
    # One that had started its records and did not finish spends a retry.
    spent = decide(
        job=unwritten, records=records(phase="staging"), attempt=3, retries=2,
        current=State.RUNNING,
    )  # fmt: skip
    assert spent.state is State.SYSTEM_ERROR and "no retries left (2)" in spent.messages[0]


def test_a_job_that_stood_down_for_a_newer_lease_is_submitted_again_with_no_retry_spent():
    """Two login nodes: a job an old leader submitted, found and followed by the new leader,
    which had fenced its task first, exits SUPERSEDED_EXIT_CODE before anything ran. The task
    is submitted again, even with no retries left: nothing of it ran, nothing failed."""
    stood_down = job(state="FAILED", exit_code=SUPERSEDED_EXIT_CODE, signal=0)
    for attempt in (1, 3):
        decision = decide(
            job=stood_down, records=records(), attempt=attempt, retries=2, current=State.QUEUED
        )
        assert decision.retry and decision.state is State.QUEUED
        (message,) = decision.messages
        assert "lease had passed to another" in message and "submitting it again" in message
    # The same code from a job that had started its records is no stand-down: a failure.
    started = decide(
        job=stood_down, records=records(phase="staging"), attempt=1, retries=2,
        current=State.RUNNING,
    )  # fmt: skip
    assert started.state is State.SYSTEM_ERROR


@pytest.mark.parametrize("phase", ["staging", "running 0", "uploading"])
def test_a_job_whose_records_became_unwritable_later_is_lost_not_failed(phase):
    """The work filesystem fills up while the job runs: the record it cannot write ends it with
    the no-records code (templates/job.sh.j2, record). It did not finish, through no fault of
    the task: submitted again (it used to end SYSTEM_ERROR, "exit code 1")."""
    decision = decide(
        job=job(state="FAILED", exit_code=NO_RECORDS_EXIT_CODE, signal=0),
        records=records(phase=phase),
        attempt=1,
        retries=2,
        current=State.RUNNING,
    )
    assert decision.retry and decision.state is State.QUEUED
    assert "could not write its records" in decision.messages[0]
    assert "it did not finish; submitting it again" in decision.messages[0]


@pytest.mark.parametrize("phase", [None, "staging", "running 0", "uploading"])
def test_a_job_whose_script_was_killed_by_a_signal_is_lost_not_failed(phase):
    """The nemesis soak: a node's processes killed (SIGKILL) as it failed, while Slurm's step
    daemon lived to report it: sacct says FAILED, exit code 0, signal 9. The script records
    every executor's end, so a signal on the job itself came from outside the task: it is
    submitted again (it used to end SYSTEM_ERROR "without recording an outcome"), within the
    retries, as for NODE_FAIL."""
    killed = job(state="FAILED", exit_code=0, signal=9, node="node2")
    decision = decide(
        job=killed, records=records(phase=phase), attempt=1, retries=2, current=State.RUNNING
    )
    assert decision.retry and decision.state is State.QUEUED
    (message,) = decision.messages
    assert "(exit code 0, signal 9): its script was killed on node2" in message
    assert message.endswith("submitting it again")
    last = decide(job=killed, records=records(phase=phase), attempt=3, retries=2,
                  current=State.RUNNING)  # fmt: skip
    assert last.state is State.SYSTEM_ERROR and "no retries left (2)" in last.messages[0]


def test_a_failed_job_waits_for_sacct_s_exit_code_before_it_is_decided():
    """squeue lists an ended job as FAILED with no exit code; sacct's, a moment later, tells a
    job that could not write its records (the system's failure: submitted again) from one that
    failed (the nemesis soak: array elements on a full work filesystem ended SYSTEM_ERROR
    "FAILED without recording an outcome", decided from squeue before sacct had them)."""
    from_squeue = decide(
        job=job(state="FAILED", exit_code=None),
        records=records(phase="staging"),
        attempt=1,
        retries=2,
        current=State.RUNNING,
    )
    assert from_squeue.state is State.RUNNING and not from_squeue.job_done
    from_sacct = decide(
        job=job(state="FAILED", exit_code=NO_RECORDS_EXIT_CODE, signal=0),
        records=records(phase="staging"),
        attempt=1,
        retries=2,
        current=State.RUNNING,
    )
    assert from_sacct.retry and from_sacct.state is State.QUEUED


@pytest.mark.parametrize(
    ("exit_code", "phase"),
    [
        (1, None),  # any other early failure stays the system's error it always was
        (1, "uploading"),
        (2, "running 0"),
    ],
)
def test_only_the_scripts_own_no_records_exit_is_taken_for_a_lost_job(exit_code, phase):
    decision = decide(
        job=job(state="FAILED", exit_code=exit_code, signal=0),
        records=records(phase=phase),
        attempt=1,
        retries=2,
        current=State.RUNNING,
    )
    assert not decision.retry and decision.state is State.SYSTEM_ERROR
    assert "without recording an outcome" in decision.messages[0]


def test_suspended_job_is_paused_and_unknown_states_keep_the_last_one():
    paused = decide(
        job=job(state="SUSPENDED"), records=records(), attempt=1, retries=0, current=State.RUNNING
    )
    assert paused.state is State.PAUSED
    unknown = decide(
        job=job(state="SOMETHING_NEW"),
        records=records(),
        attempt=1,
        retries=0,
        current=State.RUNNING,
    )
    assert unknown.state is State.RUNNING


def test_a_job_unknown_to_slurm_fails_its_task_after_the_grace_time_only():
    unknown = {"job": None, "records": records(phase="running 0"), "attempt": 1, "retries": 2}
    waiting = decide(**unknown, current=State.RUNNING, missing_for=MISSING_JOB_GRACE)
    assert waiting.state is State.RUNNING and not waiting.messages
    lost = decide(**unknown, current=State.RUNNING, missing_for=MISSING_JOB_GRACE + 1)
    assert lost.state is State.SYSTEM_ERROR
    assert lost.messages == ["Slurm no longer knows job 1 and it recorded no outcome"]
    done = decide(
        **{**unknown, "records": records(outcome="complete")},
        current=State.RUNNING,
        missing_for=MISSING_JOB_GRACE + 1,
    )
    assert done.state is State.COMPLETE


def test_the_grace_time_counts_from_the_first_cycle_without_the_job(env):
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    running = replace(slurm.jobs[job_id], state="RUNNING", reason=None)
    slurm.jobs[job_id] = running
    poller.cycle()
    del slurm.jobs[job_id]  # neither squeue nor sacct knows it
    poller.cycle()
    now[0] += 100
    slurm.jobs[job_id] = running  # back (slurmdbd caught up): the count starts again
    poller.cycle()
    del slurm.jobs[job_id]
    for step in (0, 60, 60):
        now[0] += step
        poller.cycle()
        assert store.get_task(task.id).state == "INITIALIZING"
    slurm.unavailable = True  # squeue fails: nothing is decided
    now[0] += 1
    poller.cycle()
    assert store.get_task(task.id).state == "INITIALIZING"
    slurm.unavailable = False
    poller.cycle()
    record = store.get_task(task.id)
    # It recorded nothing (it never started): lost, submitted again (see the test below).
    assert record.logs[0]["metadata"][LOST_JOBS_KEY] == job_id
    assert any("Slurm no longer knows job" in x for x in record.logs[0]["system_logs"])


def test_a_job_slurm_forgot_before_it_started_is_submitted_again_within_the_retries():
    """A slurmctld killed -9 before it saved its state forgets the jobs submitted since:
    nothing of them ever ran, so the task is not failed for it."""
    unknown = {"job": None, "records": records(), "current": State.QUEUED}
    lost = decide(**unknown, attempt=1, retries=2, missing_for=MISSING_JOB_GRACE + 1)
    assert lost.state is State.QUEUED and lost.retry
    assert lost.messages == [
        "Slurm no longer knows job 1, which never started; submitting it again"
    ]
    spent = decide(**unknown, attempt=3, retries=2, missing_for=MISSING_JOB_GRACE + 1)
    assert spent.state is State.SYSTEM_ERROR and not spent.retry


def test_a_job_completed_whose_script_never_started_is_submitted_again():
    """Seen in a nemesis run: a slurmctld killed -9 came back from an older state and gave the
    id of a job still running on node2 to an array element; the element was never launched
    (the id was taken there), and the orphan's end at exit 0 was recorded as the element's."""
    orphaned = job(job_id="38300_0", state="COMPLETED", node="node2", exit_code=0, signal=0)
    lost = decide(job=orphaned, records=records(), attempt=1, retries=2, current=State.QUEUED)
    assert lost.state is State.QUEUED and lost.retry
    assert "its script never started on node2" in lost.messages[0]
    spent = decide(job=orphaned, records=records(), attempt=3, retries=2, current=State.QUEUED)
    assert spent.state is State.SYSTEM_ERROR and not spent.retry
    # Its script started but recorded no outcome: what the job did is unknown, not run again.
    started = decide(job=orphaned, records=records(phase="staging"), attempt=1, retries=2,
                     current=State.INITIALIZING)  # fmt: skip
    assert started.state is State.SYSTEM_ERROR and not started.retry


def test_a_job_slurm_killed_as_it_launched_it_is_submitted_again_not_canceled():
    """A node that reports a job id Slurm reused (after a slurmctld killed -9 lost its state)
    as a duplicate: Slurm cancels the new job at launch, before its script starts."""
    killed = job(state="CANCELLED", node="node1", exit_code=0, signal=0, canceled_by="")
    lost = decide(job=killed, records=records(), attempt=1, retries=2, current=State.INITIALIZING)
    assert lost.state is State.QUEUED and lost.retry
    assert "before its script started; submitting it again" in lost.messages[0]
    spent = decide(job=killed, records=records(), attempt=3, retries=2, current=State.QUEUED)
    assert spent.state is State.SYSTEM_ERROR
    # Canceled by someone while pending (no node), or once its script ran: a cancel, final.
    killed = replace(killed, canceled_by="1000")
    pending = replace(killed, node=None)
    assert decide(job=pending, records=records(), attempt=1, retries=2,
                  current=State.QUEUED).state is State.CANCELED  # fmt: skip
    ran = decide(job=killed, records=records(phase="running 0"), attempt=1, retries=2,
                 current=State.RUNNING)  # fmt: skip
    assert ran.state is State.CANCELED


def test_a_running_job_slurm_cancelled_itself_is_submitted_again_not_canceled():
    """slurmctld restarted from an older state gives a running job's id out again (to a new
    array): the node reports the duplicate and Slurm kills the id, every running element of
    the array with it. sacct says plain "CANCELLED" (no one asked) for them
    (tests/data/slurm/sacct-cancelled-by-slurm.txt); a scancel says "CANCELLED by UID"."""
    element = parse_sacct((DATA / "sacct-cancelled-by-slurm.txt").read_text())["96434_21"]
    assert (element.state, element.canceled_by, element.node) == ("CANCELLED", "", "node1")
    running = records(phase="running 0")
    lost = decide(job=element, records=running, attempt=1, retries=2, current=State.RUNNING)
    assert lost.state is State.QUEUED and lost.retry
    assert lost.messages == [
        "Slurm job 96434_21 ended in state CANCELLED (exit code 15) on node1: Slurm cancelled "
        "it itself, no one asked (a job id given out twice?); submitting it again"
    ]
    spent = decide(job=element, records=running, attempt=3, retries=2, current=State.RUNNING)
    assert spent.state is State.SYSTEM_ERROR and "no retries left (2)" in spent.messages[0]
    # Someone's scancel: a cancel, final.
    asked = replace(element, canceled_by="1000")
    assert decide(job=asked, records=running, attempt=1, retries=2,
                  current=State.RUNNING).state is State.CANCELED  # fmt: skip
    # squeue's word alone names no one: wait for sacct's.
    queued = replace(element, canceled_by=None)
    assert decide(job=queued, records=running, attempt=1, retries=2,
                  current=State.RUNNING) == Decision(State.RUNNING)  # fmt: skip


def test_a_job_id_slurm_reused_for_another_job_is_not_taken_for_the_tasks_job(env):
    """slurmctld killed -9 forgets the task's job and gives its id to another job: what squeue
    and sacct say of that id is not the task's (its name is another's)."""
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING", reason=None)
    poller.cycle()
    slurm.jobs[job_id] = job(job_id, "CANCELLED", name="tes-someone-else", exit_code=0, signal=0)
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "INITIALIZING", record.logs
    assert not any("CANCELLED" in x for x in record.logs[0].get("system_logs", []))


def test_two_tasks_following_one_reused_job_id_each_see_only_their_own_job(env):
    """slurmctld killed -9 forgets task A's job and gives its id to task B's new job: both
    tasks then follow one id. B's job ending is not A's: A's job is lost (never started), not
    a job that "ended COMPLETED without recording an outcome"."""
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    first = store.create_task(ECHO)
    second = store.create_task(ECHO)
    poller.cycle()
    reused = store.get_task(first.id).job_id
    theirs = store.get_task(second.id).job_id
    assert reused and theirs and reused != theirs
    # Slurm forgot the first task's job; the second task's job got its id.
    del slurm.jobs[theirs]
    slurm.jobs[reused] = job(reused, "COMPLETED", name=job_name(second.id), exit_code=0, signal=0)
    store.update_task(second.id, job_id=reused)
    poller.cycle()
    assert store.get_task(first.id).state != "SYSTEM_ERROR", store.get_task(first.id).logs
    now[0] += MISSING_JOB_GRACE + 1
    poller.cycle()
    record = store.get_task(first.id)
    assert record.state != "SYSTEM_ERROR", record.logs
    assert record.logs[0]["metadata"][LOST_JOBS_KEY] == reused, record.logs
    assert not any("without recording" in x for x in record.logs[0].get("system_logs", []))


def test_a_job_out_of_the_queue_that_sacct_holds_as_running_for_ever_is_lost(env):
    """sacct keeps a job slurmctld forgot as PENDING or RUNNING for ever: once the job is out
    of the queue for the grace time with nothing recorded, it is submitted again."""
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    stale = replace(slurm.jobs[job_id], state="PENDING")
    del slurm.jobs[job_id]
    slurm.accounting_only[job_id] = stale
    poller.cycle()
    now[0] += MISSING_JOB_GRACE + 1
    poller.cycle()
    record = store.get_task(task.id)
    assert record.logs[0]["metadata"][LOST_JOBS_KEY] == job_id, record.logs
    poller.cycle()
    assert store.get_task(task.id).job_id not in (None, job_id)


def test_job_that_can_never_start_fails_and_is_canceled(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], reason="BadConstraints")
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "SYSTEM_ERROR"
    assert "can never start (BadConstraints)" in record.logs[0]["system_logs"][-1]
    poller.cycle()
    assert slurm.jobs[job_id].state == "CANCELLED"


@pytest.mark.parametrize("reason", ["Constraints", "SomeReasonOfALaterRelease"])
def test_a_pending_reason_that_may_clear_leaves_the_task_queued(reason):
    decision = decide(
        job=job(state="PENDING", reason=reason, node=None),
        records=records(),
        attempt=1,
        retries=2,
        current=State.QUEUED,
    )
    assert decision.state is State.QUEUED
    assert not (decision.final or decision.retry or decision.cancel_job)
    assert decision.condition == Condition(
        ConditionKind.SLURM_PENDING, f"Slurm job 1 is pending ({reason})"
    )


@pytest.mark.parametrize("current", [State.QUEUED, State.INITIALIZING, State.RUNNING])
@pytest.mark.parametrize("node", ["n1", None])
def test_a_job_state_slurm_added_later_keeps_the_tasks_state(current, node):
    decision = decide(
        job=job(state="WORD_OF_A_LATER_RELEASE", node=node),
        records=records(phase="running 0" if current is State.RUNNING else None),
        attempt=1,
        retries=2,
        current=current,
    )
    assert decision == Decision(current)


def test_an_expediting_job_is_queued_again(env):
    # Slurm 25.11: a job that failed under --requeue=expedite, on its way back to the queue.
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING", reason=None)
    poller.cycle()
    assert store.get_task(task.id).state == "INITIALIZING"
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="EXPEDITING")
    poller.cycle()
    record = store.get_task(task.id)
    assert (record.state, record.job_id) == ("QUEUED", job_id)
    assert slurm.jobs[job_id].state == "EXPEDITING"  # not canceled


# ----------------------------------------------------------------------------- cycles


def test_queued_task_is_submitted_once_under_its_task_name(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1
    record = store.get_task(task.id)
    assert record.job_id == "100" and record.attempt == 1
    assert slurm.jobs["100"].name == job_name(task.id)
    assert (poller.task_dir(task.id) / "job.sh").is_file()
    assert record.logs[0]["metadata"]["slurm_job_id"] == "100"


def test_a_named_task_is_submitted_under_its_name_first(env):
    """squeue shows 8 characters of a job's name and sacct 10: the task's name comes first,
    `tes-<task id>` after it; the name is stored with the attempt before sbatch runs."""
    poller, store, slurm, _ = env
    task = store.create_task({**ECHO, "name": "align sample/1"})
    poller.cycle()
    record = store.get_task(task.id)
    name = f"align_sample_1-tes-{task.id}"
    assert slurm.jobs[record.job_id].name == name == job_name(task.id, "align sample/1")
    assert record.logs[0]["metadata"]["slurm_job_name"] == name
    assert f"#SBATCH --job-name={name}\n" in slurm.scripts[0]
    # Followed under that name: a record of another job under its id is not its job's.
    slurm.jobs[record.job_id] = replace(slurm.jobs[record.job_id], state="RUNNING", reason=None)
    poller.cycle()
    assert store.get_task(task.id).state == "INITIALIZING"


def test_a_submission_an_earlier_version_started_is_found_under_its_old_name(env):
    """An upgrade between sbatch and the database write: the earlier version named the job
    `tes-<task id>` and stored no name; the named task's job is found under that name, and
    followed under it."""
    poller, store, slurm, _ = env
    task = store.create_task({**ECHO, "name": "align"})
    slurm.jobs["77"] = job("77", "RUNNING", name=f"tes-{task.id}")
    store.update_task(task.id, submit_started_at=1.0, attempt=1)
    poller.cycle()
    assert "sbatch" not in slurm.calls
    assert store.get_task(task.id).job_id == "77"
    poller.cycle()
    assert store.get_task(task.id).state == "INITIALIZING"


def test_crash_between_sbatch_and_the_database_write_does_not_submit_twice(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    # What a poller killed right after sbatch leaves behind: a job, and no job id stored.
    slurm.jobs["77"] = job("77", "RUNNING", name=job_name(task.id))
    store.update_task(task.id, submit_started_at=1.0, attempt=1)
    poller.cycle()
    assert "sbatch" not in slurm.calls
    assert store.get_task(task.id).job_id == "77"


def test_interrupted_submission_without_a_job_is_submitted_again(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    store.update_task(task.id, submit_started_at=1.0, attempt=1)
    poller.task_dir(task.id).mkdir(parents=True)
    poller.cycle()  # no job: the task's directory is fenced
    assert "sbatch" not in slurm.calls
    poller.cycle()  # still none: submitted again
    assert slurm.calls.count("sbatch") == 1
    record = store.get_task(task.id)
    assert record.job_id is not None and record.attempt == 1


def test_unreachable_slurm_keeps_the_task_queued_and_says_why(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    slurm.unavailable = True
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "QUEUED" and record.job_id is None
    assert any("cannot reach Slurm" in line for line in record.logs[0]["system_logs"])
    assert record.next_submit_at is not None
    # Back-off: the next cycle does not call sbatch again at once.
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1
    slurm.unavailable = False
    poller.clock = lambda: record.next_submit_at + 1
    poller.cycle()
    assert store.get_task(task.id).job_id is not None


def test_a_task_that_fails_after_waiting_no_longer_says_it_waits(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    slurm.unavailable = True
    poller.cycle()
    assert any("cannot reach Slurm" in x for x in store.get_task(task.id).logs[0]["system_logs"])
    slurm.unavailable = False
    slurm.sbatch_error = "sbatch: error: Memory specification can not be satisfied"
    poller.clock = lambda: 1e12  # the back-off has passed
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "SYSTEM_ERROR"
    assert record.logs[0]["system_logs"] == [
        "Slurm refused the job: Memory specification can not be satisfied"
    ]


@pytest.mark.parametrize("name", [None, "align"])
def test_sbatch_that_created_a_job_but_lost_the_answer_is_not_repeated(env, name):
    """The job is looked for under the name sbatch gave it (a named task's: its name first)."""
    poller, store, slurm, _ = env
    task = store.create_task({**ECHO, "name": name} if name else ECHO)
    slurm.create_then_fail = True
    poller.cycle()
    slurm.create_then_fail = False
    poller.clock = lambda: 1e12  # any back-off has passed
    poller.cycle()
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1
    assert store.get_task(task.id).job_id == "100"
    assert slurm.jobs["100"].name == job_name(task.id, name)


def test_sbatch_slowed_past_its_time_out_by_the_rate_limit_waits_and_is_not_repeated(env):
    """The rate limit fails no task: it waits, saying why, and the job its last attempt
    created is found by name instead of being submitted again."""
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    slurm.rate_limited_then_killed = True
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "QUEUED" and record.job_id is None
    assert any(
        line.startswith("waiting: slurmctld's RPC rate limit slowed the submission")
        for line in record.logs[0]["system_logs"]
    )
    slurm.rate_limited_then_killed = False
    poller.clock = lambda: 1e12  # any back-off has passed
    poller.cycle()
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1
    assert store.get_task(task.id).job_id == "100"


def test_rejected_job_is_a_system_error_with_slurm_message(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    slurm.sbatch_error = (DATA / "sbatch-too-much-memory.txt.stderr").read_text()
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "SYSTEM_ERROR"
    # Slurm's words on one line, without sbatch's prefix.
    assert record.logs[0]["system_logs"] == [
        "Slurm refused the job: Memory specification can not be satisfied; "
        "Batch job submission failed: Requested node configuration is not available"
    ]


DISK = {**ECHO, "resources": {"disk_gb": 2.15}}


def tmp_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH --tmp")]


def test_auto_disk_request_reads_tmp_disk_once_and_again_after_the_refresh(env):
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    store.create_task(ECHO)  # no disk_gb: no sinfo
    poller.cycle()
    assert "sinfo" not in slurm.calls
    store.create_task(DISK)
    store.create_task(DISK)
    poller.cycle()
    assert slurm.calls.count("sinfo") == 1
    with_tmp = ["#SBATCH --tmp=2202"]
    assert [tmp_lines(s) for s in slurm.scripts] == [[], with_tmp, with_tmp]
    # The node's TmpDisk is gone (slurm.conf changed): seen after the refresh, not before.
    slurm.sinfo = "main*|0\n"
    now[0] += 599
    store.create_task(DISK)
    poller.cycle()
    assert slurm.calls.count("sinfo") == 1 and tmp_lines(slurm.scripts[-1]) != []
    now[0] += 2
    store.create_task(DISK)
    poller.cycle()
    assert slurm.calls.count("sinfo") == 2 and tmp_lines(slurm.scripts[-1]) == []
    # sinfo failing later keeps the last answer.
    slurm.sinfo = None
    now[0] += 601
    task = store.create_task(DISK)
    poller.cycle()
    assert store.get_task(task.id).job_id and tmp_lines(slurm.scripts[-1]) == []


def test_auto_disk_request_waits_while_tmp_disk_cannot_be_read_at_first(env):
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    slurm.sinfo = None
    task = store.create_task(DISK)
    for _ in range(3):  # back-off rounds: the task says why it waits, once
        poller.cycle()
        now[0] += 1e6  # the back-off has passed
        record = store.get_task(task.id)
        assert record.state == "QUEUED" and "sbatch" not in slurm.calls
        waits = [x for x in record.logs[0]["system_logs"] if "cannot read the nodes' TmpDisk" in x]
        assert len(waits) == 1, record.logs
    slurm.sinfo = "main*|102400\n"
    poller.cycle()
    assert tmp_lines(slurm.scripts[-1]) == ["#SBATCH --tmp=2202"]
    # Submitted: the task no longer waits for TmpDisk, and its log no longer says so.
    record = store.get_task(task.id)
    assert record.job_id and record.logs[0]["system_logs"] == [
        f"Slurm job {record.job_id} is pending (Priority)"
    ]


def mem_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH --mem")]


def test_memory_of_a_whole_node_asks_for_the_node_read_once_with_the_tmp_disk(env):
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    slurm.sinfo = "main*|0|4000\n"  # as Snakemake asks for a 4000 MB node: mem_mb / 1000
    for _ in range(2):
        store.create_task({**ECHO, "resources": {"ram_gb": 4}})
    store.create_task({**ECHO, "resources": {"ram_gb": 4, "disk_gb": 1}})
    poller.cycle()
    assert slurm.calls.count("sinfo") == 1
    assert [mem_lines(s) for s in slurm.scripts] == [["#SBATCH --mem=4000"]] * 3
    assert [tmp_lines(s) for s in slurm.scripts] == [[]] * 3  # no TmpDisk: no --tmp


def test_memory_requests_go_on_as_asked_while_sinfo_cannot_be_read(env):
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    slurm.sinfo = None
    first = store.create_task({**ECHO, "resources": {"ram_gb": 4}})
    second = store.create_task({**ECHO, "resources": {"ram_gb": 4}})
    poller.cycle()
    assert store.get_task(first.id).job_id and store.get_task(second.id).job_id
    assert [mem_lines(s) for s in slurm.scripts] == [["#SBATCH --mem=4096"]] * 2
    # Tried again after a while, not for every task.
    assert slurm.calls.count("sinfo") == 1
    slurm.sinfo = "main*|0|4000\n"
    store.create_task({**ECHO, "resources": {"ram_gb": 4}})
    poller.cycle()
    assert slurm.calls.count("sinfo") == 1 and mem_lines(slurm.scripts[-1]) == [
        "#SBATCH --mem=4096"
    ]
    now[0] += 31
    store.create_task({**ECHO, "resources": {"ram_gb": 4}})
    poller.cycle()
    assert slurm.calls.count("sinfo") == 2
    assert mem_lines(slurm.scripts[-1]) == ["#SBATCH --mem=4000"]


def test_tmp_disk_request_on_nodes_without_tmp_disk_fails_saying_why(tmp_path, sqlite_store):
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"slurm.disk_request": "tmp"},
    )
    slurm = FakeSlurm()
    poller = Poller(config, sqlite_store, slurm_client=slurm, images=FakeImages())
    # What sbatch says (captured on the local cluster), on nodes that declare no TmpDisk.
    slurm.sbatch_error = (DATA / "sbatch-too-much-tmp.txt.stderr").read_text()
    slurm.sinfo = "main*|0\n"
    task = sqlite_store.create_task(DISK)
    other = sqlite_store.create_task(DISK)
    poller.cycle()
    assert slurm.calls.count("sinfo") == 1  # one read explains every refusal of the cycle
    assert sqlite_store.get_task(other.id).state == "SYSTEM_ERROR"
    record = sqlite_store.get_task(task.id)
    assert record.state == "SYSTEM_ERROR"
    (message,) = record.logs[0]["system_logs"]
    assert "Temporary disk specification can not be satisfied" in message
    assert "resources.disk_gb = 2.15" in message
    assert 'slurm.disk_request = "tmp"' in message
    assert "the nodes declare TmpDisk main 0 MB" in message
    assert 'set slurm.disk_request = "auto"' in message


def test_task_waits_in_queued_while_its_image_is_pulled(env):
    poller, store, slurm, images = env
    task = store.create_task(ECHO)
    images.ready = False
    poller.cycle()
    assert "sbatch" not in slurm.calls and store.get_task(task.id).state == "QUEUED"
    images.ready = True
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1


def test_transient_image_trouble_is_said_in_system_logs_while_it_lasts(env):
    poller, store, slurm, images = env
    task = store.create_task(ECHO)
    image = ECHO["executors"][0]["image"]
    images.ready = False
    images.problems[image] = f"pulling image {image}: registry down; retrying in 2 s"
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "QUEUED"
    assert record.logs[0]["system_logs"] == [images.problems[image]]
    images.problems[image] = f"pulling image {image}: registry down; retrying in 4 s"
    poller.cycle()
    # Replaced, not piled up.
    assert store.get_task(task.id).logs[0]["system_logs"] == [images.problems[image]]
    images.ready = True
    images.problems.clear()
    poller.cycle()
    record = store.get_task(task.id)
    assert slurm.calls.count("sbatch") == 1 and record.job_id
    # Nothing stale once it runs.
    assert not any(line.startswith("pulling image") for line in record.logs[0]["system_logs"])


def test_image_cache_is_pruned_with_the_oldest_unfinished_task(env):
    poller, store, _, images = env
    assert store.oldest_unfinished_time() is None
    first = store.create_task(ECHO)
    store.create_task(ECHO)
    poller.cycle()
    oldest = store.oldest_unfinished_time()
    assert oldest is not None and abs(oldest - time.time()) < 60
    assert images.pruned == [oldest]
    store.update_task(first.id, state="COMPLETE")
    assert store.oldest_unfinished_time() > oldest


def test_polling_costs_at_most_two_slurm_calls_whatever_the_number_of_jobs(env):
    poller, store, slurm, _ = env
    tasks = [store.create_task(ECHO) for _ in range(300)]
    poller.cycle()
    for info in list(slurm.jobs.values())[::2]:
        slurm.jobs[info.job_id] = replace(info, state="FAILED", exit_code=1)
    slurm.calls.clear()
    stats = poller.cycle()
    assert slurm.calls == ["squeue", "sacct"]
    assert stats.slurm_calls == 2
    states = {store.get_task(t.id).state for t in tasks}
    assert states == {"QUEUED", "SYSTEM_ERROR"}  # no records were written by the fake jobs


def test_updates_are_batched_and_a_bad_one_costs_only_its_own(env, monkeypatch, caplog):
    poller, store, slurm, _ = env
    monkeypatch.setattr("bridge.poller.follow.DECISION_BATCH", 2)
    tasks = [store.create_task(ECHO) for _ in range(5)]
    poller.cycle()
    for info in list(slurm.jobs.values()):
        slurm.jobs[info.job_id] = replace(info, state="RUNNING", reason=None)
    apply_one = store._apply_decision

    def failing(decision, now):
        if decision.task_id == tasks[2].id:
            raise ValueError("cannot be written")
        return apply_one(decision, now)

    monkeypatch.setattr(store, "_apply_decision", failing)
    stats = poller.cycle()
    assert stats.updated == 4
    states = [store.get_task(t.id).state for t in tasks]
    assert states == ["INITIALIZING", "INITIALIZING", "QUEUED", "INITIALIZING", "INITIALIZING"]
    assert f"updating task {tasks[2].id} failed unexpectedly" in caplog.text


def test_unreachable_slurm_pauses_all_submissions_for_the_back_off(env):
    poller, store, slurm, _ = env
    tasks = [store.create_task(ECHO) for _ in range(5)]
    slurm.unavailable = True
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1  # not one ~10 s wait per task
    slurm.unavailable = False
    poller.clock = lambda: 1e12
    poller.cycle()
    poller.cycle()
    assert all(store.get_task(t.id).job_id for t in tasks)
    # The five, ready in one round and alike, go as one array (slurm.arrays = "auto").
    assert slurm.calls.count("sbatch") == 2 and slurm.arrays == [5]


def test_failed_squeue_keeps_the_last_state(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    store.update_task(task.id, state="RUNNING")
    slurm.unavailable = True
    poller.cycle()
    assert store.get_task(task.id).state == "RUNNING"


def test_cancel_of_submitted_tasks_is_one_scancel(env):
    poller, store, slurm, _ = env
    tasks = [store.create_task(ECHO) for _ in range(3)]
    poller.cycle()
    for task in tasks:
        store.cancel_task(task.id)
    slurm.calls.clear()
    poller.cycle()
    assert slurm.calls.count("scancel") == 1
    assert all(info.state == "CANCELLED" for info in slurm.jobs.values())
    for task in tasks:
        record = store.get_task(task.id)
        assert record.state == "CANCELED" and not record.cancel_pending


def test_a_task_canceled_while_running_gets_its_jobs_final_record(env, monkeypatch):
    poller, store, slurm, _ = env
    task = store.create_task({"executors": [ECHO["executors"][0]] * 2})
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    running = second_executor_running(job_id)
    monkeypatch.setattr("bridge.poller.watch.read_records", lambda *a, **k: running)
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING", node="n1")
    poller.cycle()
    assert store.get_task(task.id).logs[-1]["metadata"]["slurm_state"] == "RUNNING"
    store.cancel_task(task.id)
    # scancel: the job stops; sacct has its final record only a moment later.
    monkeypatch.setattr(slurm, "cancel", lambda job_ids, as_user=None: slurm.calls.append("x"))
    poller.cycle()
    assert not store.get_task(task.id).cancel_pending
    poller.cycle()  # sacct still says RUNNING: the task waits for the final record
    assert "end_time" not in store.get_task(task.id).logs[-1]
    end = datetime(2026, 1, 1, 0, 0, 7, tzinfo=UTC)
    slurm.jobs[job_id] = replace(
        slurm.jobs[job_id], state="CANCELLED", end_time=end, elapsed_seconds=7, max_rss_bytes=1000
    )
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "CANCELED"
    last = record.logs[-1]
    assert last["metadata"]["slurm_state"] == "CANCELLED"
    assert last["metadata"]["slurm_node"] == "n1"
    assert last["metadata"]["slurm_elapsed_seconds"] == "7"
    assert last["end_time"] == "2026-01-01T00:00:07.000000Z"
    # TES wants an integer exit code: the executor the cancel stopped is not listed.
    assert [e["stdout"] for e in last["logs"]] == ["one\n"]
    assert any(f"{job_id} ended in state CANCELLED" in line for line in last["system_logs"])
    slurm.calls.clear()
    poller.cycle()
    assert "sacct" not in slurm.calls  # no longer followed


def test_a_canceled_task_stops_waiting_for_a_final_record_sacct_never_has(env):
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    store.cancel_task(task.id)
    poller.cycle()
    del slurm.jobs[job_id]  # purged from accounting
    poller.cycle()
    now[0] += FINAL_FACTS_GRACE + 1
    poller.cycle()
    slurm.calls.clear()
    poller.cycle()
    assert slurm.calls == []
    assert store.get_task(task.id).state == "CANCELED"


def test_a_task_canceled_while_its_job_pends_no_longer_says_it_pends(env, monkeypatch):
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], reason="Resources", node=None)
    poller.cycle()
    assert store.get_task(task.id).logs[0]["system_logs"] == [
        f"Slurm job {job_id} is pending (Resources)"
    ]
    store.cancel_task(task.id)
    # scancel is sent; squeue and sacct do not show the job ended yet.
    monkeypatch.setattr(slurm, "cancel", lambda job_ids, as_user=None: slurm.calls.append("x"))
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "CANCELED" and not record.cancel_pending
    assert record.logs[0]["system_logs"] == [], record.logs
    assert "condition_kinds" not in record.logs[0]
    # Then sacct has the final record of the job that never started.
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="CANCELLED")
    poller.cycle()
    lines = store.get_task(task.id).logs[0]["system_logs"]
    assert lines == [f"Slurm job {job_id} ended in state CANCELLED"]


def test_a_canceled_pending_job_that_sacct_never_records_leaves_no_pending_line(env):
    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], reason="Priority", node=None)
    poller.cycle()
    store.cancel_task(task.id)
    poller.cycle()
    del slurm.jobs[job_id]  # neither squeue nor sacct will ever say more of it
    for _ in range(2):
        poller.cycle()
        now[0] += FINAL_FACTS_GRACE
    record = store.get_task(task.id)
    assert record.state == "CANCELED"
    assert not any("pending" in line for line in record.logs[0]["system_logs"]), record.logs


def test_a_task_canceled_while_it_waits_for_its_image_shows_no_waiting_line(env):
    poller, store, _, images = env
    task = store.create_task(ECHO)
    image = ECHO["executors"][0]["image"]
    images.ready = False
    images.problems[image] = f"waiting: pulling image {image} (started 2026-01-01T00:00:00Z)"
    poller.cycle()
    assert store.get_task(task.id).logs[0]["system_logs"] == [images.problems[image]]
    store.cancel_task(task.id)  # no job: the poller has nothing to carry out
    poller.cycle()
    record = store.get_task(task.id)
    rendered = render_task(
        task_id=record.id,
        state=record.state,
        document=record.document,
        creation_time=record.creation_time,
        logs=record.logs,
        view=View.FULL,
    )
    assert rendered["state"] == "CANCELED"
    assert rendered["logs"][0]["system_logs"] == [], rendered["logs"]


def test_cancel_during_an_interrupted_submission_cancels_the_found_job(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    slurm.jobs["55"] = job("55", "RUNNING", name=job_name(task.id))
    store.update_task(task.id, submit_started_at=1.0, attempt=1)
    store.cancel_task(task.id)
    poller.cycle()
    assert slurm.jobs["55"].state == "CANCELLED"
    assert store.get_task(task.id).state == "CANCELED"


def test_lost_node_continues_the_attempt_in_a_new_job(env, monkeypatch):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    first = store.get_task(task.id).job_id
    slurm.jobs[first] = replace(slurm.jobs[first], state="NODE_FAIL")
    poller.cycle()  # notices the loss
    poller.cycle()  # submits again
    record = store.get_task(task.id)
    assert record.attempt == 2 and record.job_id not in (None, first)
    assert len(record.logs) == 1
    assert any("NODE_FAIL" in line for line in record.logs[0]["system_logs"])
    assert record.logs[0]["metadata"]["slurm_job_id"] == record.job_id
    assert record.logs[0]["metadata"][LOST_JOBS_KEY] == first


def test_a_retry_gives_every_engine_the_final_executor_exit_code(env, monkeypatch):
    """nf-ga4gh reads logs[0].logs[0], cwl-tes logs[-1].logs[-1], Toil the last exit code
    from the end, sprocket every executor of logs[-1]: after a lost node, all of them must
    read the exit code of the job that ran to the end (docs/states.md)."""
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    first = store.get_task(task.id).job_id
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    recorded = {
        # The executor exited 0, then the node was lost while outputs were uploaded.
        first: JobRecords(
            job_id=first,
            phase="uploading",
            start_time=t0,
            executors=[ExecutorRecord(0, t0, t0, 0, "first run\n", "")],
        )
    }
    monkeypatch.setattr(
        "bridge.poller.watch.read_records",
        lambda task_dir, job_id, **k: recorded.get(job_id, JobRecords(job_id=job_id)),
    )
    slurm.jobs[first] = replace(slurm.jobs[first], state="RUNNING", node="n1")
    poller.cycle()
    slurm.jobs[first] = replace(slurm.jobs[first], state="NODE_FAIL", node="n1")
    poller.cycle()  # notices the loss
    lost = store.get_task(task.id)
    assert lost.state == "QUEUED"
    assert lost.logs[0]["logs"] == [] and "end_time" not in lost.logs[0]
    poller.cycle()  # submits again
    second = store.get_task(task.id).job_id
    assert second not in (None, first)
    recorded[second] = JobRecords(
        job_id=second,
        phase="done",
        outcome="executor_error",
        start_time=t0,
        end_time=t0,
        executors=[ExecutorRecord(0, t0, t0, 3, "second run\n", "")],
    )
    slurm.jobs[second] = replace(slurm.jobs[second], state="COMPLETED", node="n2", exit_code=0)
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "EXECUTOR_ERROR"
    logs = render_task(
        task_id=record.id,
        state=record.state,
        document=record.document,
        creation_time=record.creation_time,
        logs=record.logs,
        view=View.FULL,
    )["logs"]
    assert logs[0]["logs"][0]["exit_code"] == 3  # nf-ga4gh
    assert logs[-1]["logs"][-1]["exit_code"] == 3  # cwl-tes, Toil
    assert [e["exit_code"] for e in logs[-1]["logs"]] == [3]  # sprocket
    # The lost job stays visible: its id, and the line that says what became of it.
    metadata = logs[0]["metadata"]
    assert metadata["slurm_job_id"] == second and metadata["slurm_node"] == "n2"
    assert metadata[LOST_JOBS_KEY] == first
    assert any(first in line and "NODE_FAIL" in line for line in logs[0]["system_logs"])
    assert any(first in line and "n1" in line for line in logs[0]["system_logs"])


def preempting_poller(tmp_path: Path, store: Store, on_preemption: str) -> tuple[Poller, FakeSlurm]:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"slurm.on_preemption": on_preemption},
    )
    slurm = FakeSlurm()
    return Poller(config, store, slurm_client=slurm, images=FakeImages()), slurm


def test_preempted_job_ends_its_task_preempted_and_final(tmp_path, sqlite_store):
    poller, slurm = preempting_poller(tmp_path, sqlite_store, "report")
    task = sqlite_store.create_task(ECHO)
    poller.cycle()
    job_id = sqlite_store.get_task(task.id).job_id
    preempt(slurm, job_id)
    poller.cycle()
    poller.cycle()
    record = sqlite_store.get_task(task.id)
    assert record.state == "PREEMPTED"
    assert slurm.calls.count("sbatch") == 1 and record.attempt == 1
    assert "PREEMPTED" in record.logs[0]["system_logs"][-1]
    assert record.logs[0]["metadata"]["slurm_state"] == "PREEMPTED"
    # Final: a cancel changes nothing, and the poller no longer follows it.
    sqlite_store.cancel_task(task.id)
    slurm.calls.clear()
    poller.cycle()
    assert sqlite_store.get_task(task.id).state == "PREEMPTED"
    assert "squeue" not in slurm.calls and "scancel" not in slurm.calls


def preempt(slurm: FakeSlurm, job_id: str) -> None:
    """What squeue shows once Slurm preempted a --no-requeue job (seen on the local cluster)."""
    slurm.jobs[job_id] = replace(
        slurm.jobs[job_id], state="PREEMPTED", exit_code=0, partition="scavenger"
    )


@pytest.mark.parametrize(
    ("site", "asked", "state"),
    [
        # "preempted" is the site setting's older name of "report".
        ("preempted", None, "PREEMPTED"),
        ("resubmit", "report", "PREEMPTED"),
        ("report", "resubmit", "QUEUED"),
        ("report", None, "PREEMPTED"),
    ],
)
def test_a_task_says_what_becomes_of_it_when_preempted_and_the_site_says_it_otherwise(
    tmp_path, sqlite_store, site, asked, state
):
    poller, slurm = preempting_poller(tmp_path, sqlite_store, site)
    params = {} if asked is None else {"on_preemption": asked}
    task = sqlite_store.create_task({**ECHO, "resources": {"backend_parameters": params}})
    poller.cycle()
    job_id = sqlite_store.get_task(task.id).job_id
    preempt(slurm, job_id)
    poller.cycle()
    record = sqlite_store.get_task(task.id)
    assert record.state == state
    if state == "QUEUED":  # submitted again, as a job lost to a node failure
        poller.cycle()
        assert slurm.calls.count("sbatch") == 2
        assert sqlite_store.get_task(task.id).logs[0]["metadata"]["slurm_lost_job_ids"] == job_id


def test_job_requeued_by_slurm_is_followed_not_failed_nor_submitted_again(
    tmp_path, sqlite_store, monkeypatch
):
    poller, slurm = preempting_poller(tmp_path, sqlite_store, "report")
    task = sqlite_store.create_task(ECHO)
    poller.cycle()
    job_id = sqlite_store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING", reason=None)
    running = JobRecords(job_id=job_id, phase="running 0")
    monkeypatch.setattr("bridge.poller.watch.read_records", lambda *a, **k: running)
    poller.cycle()
    assert sqlite_store.get_task(task.id).state == "RUNNING"
    # A job that allows requeueing (a site's --requeue), preempted: squeue shows it COMPLETING,
    # then PENDING again under the same id, while sacct briefly shows the PREEMPTED record.
    slurm.accounting_only[job_id] = replace(slurm.jobs[job_id], state="PREEMPTED")
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="COMPLETING")
    poller.cycle()
    assert sqlite_store.get_task(task.id).state == "RUNNING"
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="PENDING", reason="BeginTime")
    poller.cycle()
    record = sqlite_store.get_task(task.id)
    assert record.state == "QUEUED"
    assert f"Slurm job {job_id} is pending (BeginTime)" in record.logs[0]["system_logs"]
    # It runs again from a clean start and completes.
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="COMPLETED", exit_code=0)
    done = JobRecords(job_id=job_id, phase="done", outcome="complete")
    monkeypatch.setattr("bridge.poller.watch.read_records", lambda *a, **k: done)
    poller.cycle()
    record = sqlite_store.get_task(task.id)
    assert record.state == "COMPLETE" and record.attempt == 1 and len(record.logs) == 1
    assert slurm.calls.count("sbatch") == 1


def test_a_suspended_job_pauses_its_task_which_is_followed_until_it_runs_again(env):
    # As with PreemptMode=SUSPEND, or an admin's scontrol suspend and resume.
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="SUSPENDED", reason=None)
    poller.cycle()
    assert store.get_task(task.id).state == "PAUSED"
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING")
    poller.cycle()
    assert store.get_task(task.id).state == "INITIALIZING"


def test_executor_logs_appear_once_their_exit_code_is_known(env, monkeypatch):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING")
    running = second_executor_running(job_id)
    monkeypatch.setattr("bridge.poller.watch.read_records", lambda *a, **k: running)
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "RUNNING"
    assert [e["stdout"] for e in record.logs[0]["logs"]] == ["one\n"]
    assert all(isinstance(e["exit_code"], int) for e in record.logs[0]["logs"])
    assert "end_time" not in record.logs[0]


def test_quick_check_submits_new_tasks_without_calling_squeue(env):
    poller, store, slurm, _ = env
    poller.cycle()
    assert poller.quick_check() is None
    task = store.create_task(ECHO)
    assert poller.quick_check() == "submit"
    slurm.calls.clear()
    poller.submit_new()
    assert slurm.calls == ["sbatch"]
    assert store.get_task(task.id).job_id is not None
    assert poller.quick_check() is None


def write_finished_records(records_dir: Path, outcome: str, exit_code: int) -> None:
    """What a job script leaves once done: its times, one executor's, its outcome last."""
    executor = records_dir / "executors" / "0"
    executor.mkdir(parents=True)
    for directory in (records_dir, executor):
        (directory / "start_time").write_text("2026-01-01T00:00:00.000Z\n")
        (directory / "end_time").write_text("2026-01-01T00:00:02.000Z\n")
    (executor / "exit_code").write_text(f"{exit_code}\n")
    (executor / "stdout").write_text("hello\n")
    (executor / "stderr").write_text("")
    (records_dir / "phase").write_text("done\n")
    (records_dir / "outcome").write_text(f"{outcome}\n")


def job_seen(env, **job_fields) -> tuple[str, str]:
    """A task whose job the last cycle saw as `job_fields` say: (task id, job id)."""
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], **job_fields)
    poller.cycle()
    return task.id, job_id


def reason_of(store: Store, task_id: str) -> str:
    """The reason the lists show for the task as the poller left it (bridge.core.reasons)."""
    record = store.get_task(task_id)
    assert record is not None
    return task_reason(record.state, record.logs)


@pytest.mark.parametrize(
    ("slurm_state", "exit_code", "outcome", "reason"),
    [
        # The job records the executor's failure, then ends FAILED with its exit code.
        ("FAILED", 42, "executor_error", "exit 42"),
        # Stopped at its time limit while its executor ran: no outcome, no exit code.
        ("TIMEOUT", 0, None, "TIMEOUT"),
    ],
)
def test_the_lists_reason_of_a_task_whose_executor_failed(
    env, slurm_state, exit_code, outcome, reason
):
    poller, store, slurm, _ = env
    task_id, job_id = job_seen(env, state="RUNNING", node="node1")
    records = poller.task_dir(task_id) / "records" / job_id
    if outcome:
        write_finished_records(records, outcome, exit_code)
    else:
        records.mkdir(parents=True)
        (records / "phase").write_text("running 0\n")
    slurm.jobs[job_id] = replace(
        slurm.jobs[job_id], state=slurm_state, exit_code=exit_code, signal=0
    )
    poller.cycle()
    assert store.get_task(task_id).state == "EXECUTOR_ERROR"
    assert reason_of(store, task_id) == reason


def test_the_lists_reason_of_a_task_slurm_refused(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    slurm.sbatch_error = "sbatch: error: Memory specification can not be satisfied"
    poller.cycle()
    assert store.get_task(task.id).state == "SYSTEM_ERROR"
    assert reason_of(store, task.id) == "refused by Slurm"


def test_quick_check_decides_a_task_whose_job_recorded_its_outcome_without_slurm(env):
    poller, store, slurm, _ = env
    task_id, job_id = job_seen(env, state="RUNNING", node="node1")
    assert poller.quick_check() is None
    write_finished_records(poller.task_dir(task_id) / "records" / job_id, "complete", 0)
    assert poller.quick_check() == "finish"
    slurm.calls.clear()
    poller.finish_recorded()
    assert slurm.calls == []  # squeue's word waits for the next cycle
    record = store.get_task(task_id)
    assert record.state == "COMPLETE"
    log = record.logs[-1]
    assert log["logs"] == [
        {
            "exit_code": 0,
            "start_time": "2026-01-01T00:00:00.000000Z",
            "end_time": "2026-01-01T00:00:02.000000Z",
            "stdout": "hello\n",
            "stderr": "",
        }
    ]
    assert log["end_time"] == "2026-01-01T00:00:02.000000Z"
    assert log["metadata"]["slurm_node"] == "node1"
    assert poller.quick_check() is None  # a finished task is not watched any more
    # The next cycle reads the ended job's final facts from sacct.
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="COMPLETED", elapsed_seconds=2)
    poller.cycle()
    assert store.get_task(task_id).logs[-1]["metadata"]["slurm_state"] == "COMPLETED"


def test_a_job_seen_pending_that_ran_and_recorded_before_the_next_cycle_gets_a_cycle(env):
    # squeue's last word (pending) is older than the records: a cycle reads where the job ran,
    # then decides from the records, and the pending condition goes with the final state.
    poller, store, slurm, _ = env
    task_id, job_id = job_seen(env, state="PENDING", reason="Priority")
    write_finished_records(poller.task_dir(task_id) / "records" / job_id, "executor_error", 3)
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="COMPLETED", node="node2", exit_code=0)
    assert poller.quick_check() == "cycle"
    poller.cycle()
    record = store.get_task(task_id)
    assert record.state == "EXECUTOR_ERROR"
    assert [executor["exit_code"] for executor in record.logs[-1]["logs"]] == [3]
    assert record.logs[-1]["metadata"]["slurm_node"] == "node2"
    assert not any("pending" in line for line in record.logs[-1].get("system_logs", []))


def test_finishing_from_the_records_fills_the_log_even_if_the_job_was_last_seen_waiting(env):
    # finish_recorded's own guard, should squeue's last word be older than the records.
    poller, store, _, _ = env
    task_id, job_id = job_seen(env, state="PENDING", reason="Priority")
    write_finished_records(poller.task_dir(task_id) / "records" / job_id, "complete", 0)
    poller._recorded = [(task_id, job_id)]
    poller.finish_recorded()
    record = store.get_task(task_id)
    assert record.state == "COMPLETE"
    assert [executor["stdout"] for executor in record.logs[-1]["logs"]] == ["hello\n"]
    assert not any("pending" in line for line in record.logs[-1].get("system_logs", []))


def test_a_task_canceled_before_the_quick_check_decides_it_stays_canceled(env):
    poller, store, _, _ = env
    task_id, job_id = job_seen(env, state="RUNNING")
    write_finished_records(poller.task_dir(task_id) / "records" / job_id, "complete", 0)
    assert poller.quick_check() == "finish"
    store.cancel_task(task_id)
    poller.finish_recorded()
    assert store.get_task(task_id).state == "CANCELED"


# ----------------------------------------------------------------- honest states and facts


def test_pending_reason_is_one_line_that_goes_when_the_task_moves_on(env, monkeypatch):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    for reason in ("Priority", "Resources", "Resources"):
        slurm.jobs[job_id] = replace(slurm.jobs[job_id], reason=reason)
        poller.cycle()
    lines = store.get_task(task.id).logs[0]["system_logs"]
    assert lines == [f"Slurm job {job_id} is pending (Resources)"]
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING", reason=None)
    done = JobRecords(job_id=job_id, phase="done", outcome="complete")
    monkeypatch.setattr("bridge.poller.watch.read_records", lambda *a, **k: done)
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "COMPLETE"
    assert not any("pending" in line for line in record.logs[0].get("system_logs", []))


def test_a_pending_job_shows_slurms_expected_start_in_its_attempt_until_it_runs(env, monkeypatch):
    poller, store, slurm, _ = env
    task_id = store.create_task(ECHO).id

    def expected_now() -> str | None:
        return store.get_task(task_id).logs[0]["metadata"].get("slurm_expected_start")

    poller.cycle()
    job_id = store.get_task(task_id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], reason="Resources")
    poller.cycle()
    assert expected_now() is None  # squeue's N/A

    estimate = datetime(2026, 11, 29, 14, 5, tzinfo=UTC)
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], expected_start=estimate)
    slurm.calls.clear()
    poller.cycle()
    assert expected_now() == "2026-11-29T14:05:00.000000Z"
    assert slurm.calls == ["squeue"]  # read with the squeue of every cycle
    # Backfill's drift of seconds is not written again; a minute is.
    slurm.jobs[job_id] = replace(
        slurm.jobs[job_id], expected_start=estimate + timedelta(seconds=59)
    )
    poller.cycle()
    assert expected_now() == "2026-11-29T14:05:00.000000Z"
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], expected_start=estimate - timedelta(hours=1))
    poller.cycle()
    assert expected_now() == "2026-11-29T13:05:00.000000Z"
    # Held: Slurm has no estimate any more.
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], reason="JobHeldUser", expected_start=None)
    poller.cycle()
    assert expected_now() is None
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], reason="Priority", expected_start=estimate)
    poller.cycle()
    assert expected_now() is not None
    slurm.jobs[job_id] = replace(
        slurm.jobs[job_id], state="RUNNING", reason=None, expected_start=None
    )
    running = JobRecords(job_id=job_id, phase="running 0")
    monkeypatch.setattr("bridge.poller.watch.read_records", lambda *a, **k: running)
    poller.cycle()
    assert store.get_task(task_id).state == "RUNNING" and expected_now() is None


def test_final_log_has_sacct_facts_never_a_leftover_running(env, monkeypatch):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING", reason=None)
    monkeypatch.setattr(
        "bridge.poller.watch.read_records", lambda *a, **k: JobRecords(job_id=job_id)
    )
    poller.cycle()
    assert store.get_task(task.id).logs[0]["metadata"]["slurm_state"] == "RUNNING"
    # The job recorded its outcome; squeue still says RUNNING and sacct has nothing final yet.
    done = JobRecords(job_id=job_id, phase="done", outcome="complete")
    monkeypatch.setattr("bridge.poller.watch.read_records", lambda *a, **k: done)
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "COMPLETE"
    assert "slurm_state" not in record.logs[0]["metadata"]
    # The next cycles ask sacct (on the call they make anyway) until the final record is there.
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="COMPLETED", exit_code=0)
    poller.cycle()
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], max_rss_bytes=4096, elapsed_seconds=3)
    slurm.calls.clear()
    poller.cycle()
    assert slurm.calls == ["sacct"]
    metadata = store.get_task(task.id).logs[0]["metadata"]
    assert metadata["slurm_state"] == "COMPLETED"
    assert metadata["slurm_max_rss_bytes"] == "4096"
    assert metadata["slurm_elapsed_seconds"] == "3"
    slurm.calls.clear()
    poller.cycle()
    assert slurm.calls == []  # done: nothing more to ask


def test_final_facts_are_given_up_after_the_grace_time(env, monkeypatch):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    job_id = store.get_task(task.id).job_id
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state="RUNNING", reason=None)
    done = JobRecords(job_id=job_id, phase="done", outcome="complete")
    monkeypatch.setattr("bridge.poller.watch.read_records", lambda *a, **k: done)
    poller.cycle()
    later = poller.clock() + 301
    poller.clock = lambda: later
    poller.cycle()
    slurm.calls.clear()
    poller.cycle()
    assert slurm.calls == []


# ----------------------------------------------------------------- transient conditions


def test_full_work_filesystem_keeps_tasks_queued_and_retries(env, monkeypatch):
    import errno

    poller, store, slurm, _ = env
    tasks = [store.create_task(ECHO) for _ in range(3)]
    real = __import__(
        "bridge.poller.submit.prepare", fromlist=["prepare_task_dir"]
    ).prepare_task_dir
    full = True

    def prepare(*args, **kwargs):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr("bridge.poller.submit.prepare.prepare_task_dir", prepare)
    now = [1000.0]
    poller.clock = lambda: now[0]
    for _ in range(3):
        poller.cycle()
        now[0] += 400  # past any back-off
    for task in tasks:  # every waiting task says why, once
        record = store.get_task(task.id)
        assert record.state == "QUEUED"
        assert record.logs[0]["system_logs"] == [
            "waiting: cannot prepare the task directory ([Errno 28] No space left on device)"
        ]
    assert "sbatch" not in slurm.calls
    full = False
    for _ in range(2):
        poller.cycle()
        now[0] += 400
    for task in tasks:
        record = store.get_task(task.id)
        assert record.state == "QUEUED" and record.job_id is not None, record
        assert not any("waiting" in x for x in record.logs[0]["system_logs"]), record.logs
    assert slurm.calls.count("sbatch") == 3


def test_a_job_started_on_a_full_work_filesystem_runs_again_once_space_is_back(env, monkeypatch):
    import errno

    poller, store, slurm, _ = env
    now = [1000.0]
    poller.clock = lambda: now[0]
    task = store.create_task(ECHO)
    poller.cycle()
    first = store.get_task(task.id).job_id
    # The work filesystem filled up before the job started: it could not write its records.
    slurm.jobs[first] = replace(
        slurm.jobs[first], state="FAILED", exit_code=NO_RECORDS_EXIT_CODE, signal=0, reason=None
    )
    real = __import__(
        "bridge.poller.submit.prepare", fromlist=["prepare_task_dir"]
    ).prepare_task_dir
    full = True

    def prepare(*args, **kwargs):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr("bridge.poller.submit.prepare.prepare_task_dir", prepare)
    for _ in range(3):  # the loss is noticed; the new job waits while the filesystem is full
        poller.cycle()
        now[0] += 400
    record = store.get_task(task.id)
    assert record.state == "QUEUED" and record.job_id is None
    assert slurm.calls.count("sbatch") == 1
    lines = record.logs[0]["system_logs"]
    assert any(first in line and "could not write its records" in line for line in lines), lines
    assert lines[-1].startswith("waiting: cannot prepare the task directory"), lines
    full = False
    poller.cycle()
    record = store.get_task(task.id)
    assert slurm.calls.count("sbatch") == 2
    assert record.job_id not in (None, first) and record.attempt == 2
    assert len(record.logs) == 1
    assert record.logs[0]["metadata"][LOST_JOBS_KEY] == first
    assert record.logs[0]["metadata"]["slurm_job_id"] == record.job_id
    assert not any(line.startswith("waiting") for line in record.logs[0]["system_logs"])


def sbatch_timed_out(env) -> tuple[str, list[float]]:
    """A task whose first sbatch timed out, at the time in the list (the poller's clock)."""
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    now = [1_000.0]
    poller.clock = lambda: now[0]
    slurm.unavailable_message = "Socket timed out on send/recv operation"
    slurm.unavailable = True
    poller.cycle()
    slurm.unavailable = False
    return task.id, now


def test_sbatch_time_out_is_retried_only_after_the_settle_time(env):
    poller, store, slurm, _ = env
    task_id, now = sbatch_timed_out(env)
    record = store.get_task(task_id)
    assert record.state == "QUEUED" and record.submit_started_at is not None
    # The back-off has passed, but slurmctld may still act on the request: no second sbatch.
    now[0] += poller.config.slurm.submit_settle - 1
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1
    # The late request creates the job: it is adopted, not submitted again.
    slurm.jobs["300"] = job("300", "PENDING", name=job_name(task_id), reason="Priority")
    poller.cycle()
    assert store.get_task(task_id).job_id == "300"
    assert slurm.calls.count("sbatch") == 1


def test_an_sbatch_acted_on_after_the_settle_time_is_fenced_out_by_a_lone_poller(env):
    # slurmctld held a timed-out sbatch's request past the settle time: the poller found no
    # job, fenced the directory, found none again and submitted the task again. The late job
    # carries its sbatch's start as its token, older than the fence: it stands down where it
    # starts (tests/unit/test_job_side.py), and only the new job runs the task.
    poller, _, slurm, _ = env
    task_id, now = sbatch_timed_out(env)
    now[0] += poller.config.slurm.command_timeout + poller.config.slurm.submit_settle
    poller.cycle()  # no job: fenced
    fence = poller.task_dir(task_id) / LEASE_FENCE
    assert fence.read_text() == f"{int(now[0] * 1000)}\n"
    assert slurm.calls.count("sbatch") == 1
    now[0] += 1
    poller.cycle()  # still none: submitted again
    assert slurm.calls.count("sbatch") == 2
    late, new = (int(arg.removeprefix(LEASE_EPOCH_ARG)) for [arg] in slurm.script_args)
    assert late < int(fence.read_text()) <= new


def test_interrupted_submission_waits_out_the_settle_time_before_submitting_again(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    now = [10_000.0]
    poller.clock = lambda: now[0]
    # A poller killed during sbatch, just now.
    store.update_task(task.id, submit_started_at=now[0] - 1, attempt=1)
    poller.task_dir(task.id).mkdir(parents=True)
    poller.cycle()
    assert "sbatch" not in slurm.calls
    wait = poller.config.slurm.command_timeout + poller.config.slurm.submit_settle
    now[0] += wait
    poller.cycle()  # fenced
    poller.cycle()  # forgotten, submitted again
    assert slurm.calls.count("sbatch") == 1
    assert store.get_task(task.id).attempt == 1


# ----------------------------------------------------------------- cancel races


def test_cancel_landing_during_sbatch_scancels_the_job_at_once(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    submit = slurm.submit

    def submit_while_canceled(*args, **kwargs):
        # A cancel that read the task before `submit_started_at` was written, and wrote
        # CANCELED while sbatch ran: it saw no job, so it left no cancel for the poller.
        store.update_task(task.id, state="CANCELED", cancel_pending=False)
        return submit(*args, **kwargs)

    slurm.submit = submit_while_canceled
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "CANCELED" and record.job_id is not None
    assert slurm.jobs[record.job_id].state == "CANCELLED"
    assert slurm.calls.index("scancel") == slurm.calls.index("sbatch") + 1


def test_quick_check_asks_for_a_cycle_when_a_cancel_arrives(env):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    assert poller.quick_check() is None
    store.cancel_task(task.id)
    assert poller.quick_check() == "cycle"
    poller.cycle()
    assert slurm.calls[-1] == "scancel"
    assert poller.quick_check() is None


def test_back_off_grows_while_the_work_filesystem_stays_full_even_as_slurm_answers(
    env, monkeypatch
):
    import errno

    poller, store, _, _ = env
    running = store.create_task(ECHO)
    poller.cycle()  # one job to follow: squeue answers every cycle
    assert store.get_task(running.id).job_id
    waiting = store.create_task(ECHO)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("bridge.poller.submit.prepare.prepare_task_dir", full)
    now = [1000.0]
    poller.clock = lambda: now[0]
    delays = []
    for _ in range(4):
        poller.cycle()
        record = store.get_task(waiting.id)
        delays.append(round(record.next_submit_at - now[0], 6))
        now[0] = record.next_submit_at + 0.1
    assert delays == [2.0, 4.0, 8.0, 16.0]


def test_interrupted_retry_does_not_adopt_the_job_of_an_earlier_attempt(env, monkeypatch):
    poller, store, slurm, _ = env
    task = store.create_task(ECHO)
    poller.cycle()
    first = store.get_task(task.id).job_id
    slurm.jobs[first] = replace(slurm.jobs[first], state="NODE_FAIL", exit_code=0)
    monkeypatch.setattr(
        "bridge.poller.watch.read_records", lambda *a, **k: JobRecords(job_id=first)
    )
    poller.cycle()  # lost node: a second attempt is due
    record = store.get_task(task.id)
    assert record.job_id is None and record.state == "QUEUED"
    # The poller dies during the second sbatch, before it reached slurmctld.
    store.update_task(task.id, submit_started_at=1.0, attempt=2)
    poller.cycle()
    poller.cycle()
    record = store.get_task(task.id)
    assert record.job_id not in (None, first), record
    assert record.attempt == 2 and record.state == "QUEUED"
    assert slurm.calls.count("sbatch") == 2


def test_a_full_database_while_submitting_postpones_and_never_fails_the_task(env, monkeypatch):
    """SQLite's "database or disk is full" passes: the task stays QUEUED and is submitted once
    there is room again (it was failed with "internal error")."""
    import peewee

    poller, store, slurm, _ = env
    task_id = store.create_task(ECHO).id
    submit = poller.submitter.sbatch.submit_one

    def full(task, stats):
        raise peewee.OperationalError("database or disk is full")

    monkeypatch.setattr(poller.submitter.sbatch, "submit_one", full)
    poller.cycle()
    assert store.get_task(task_id).state == State.QUEUED.value
    monkeypatch.setattr(poller.submitter.sbatch, "submit_one", submit)
    poller.cycle()
    record = store.get_task(task_id)
    assert record.job_id is not None and record.state == State.QUEUED.value
    assert slurm.calls.count("sbatch") == 1


def test_site_mode_waits_for_the_owners_records_before_deciding_an_ended_job(
    tmp_path: Path, sqlite_store: Store
) -> None:
    """A failed executor's job ends FAILED 3:0, as a job stopped before its end does: while
    the owner's records cannot be read (sudo or the account away), the task keeps its state;
    once they can, it is decided from them; after RECORDS_UNREADABLE_GRACE, from Slurm alone."""
    from bridge.poller.watch import RECORDS_UNREADABLE_GRACE

    htpasswd = tmp_path / "htpasswd"
    htpasswd.touch()
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={
            "site.run_as_owner": True,
            "auth.mode": "basic",
            "auth.htpasswd_file": str(htpasswd),
        },
    )
    slurm = FakeSlurm()
    poller = Poller(config, sqlite_store, slurm_client=slurm, images=FakeImages())
    now = [time.time()]
    poller.clock = lambda: now[0]
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    failed = JobRecords(
        job_id="7",
        phase="done",
        outcome="executor_error",
        executors=[ExecutorRecord(0, t0, t0, 3, "", "")],
    )
    readable = [False]

    class Owners:
        def read_jobs(self, jobs):
            return {(t.id, job_id): failed for t, job_id in jobs} if readable[0] else {}

    poller.follower.watch.owners = Owners()  # type: ignore[assignment]
    tasks = []
    for _ in range(2):
        task = sqlite_store.create_task(ECHO, owner="alice")
        assert sqlite_store.mark_submitting(task.id, attempt=1, now=now[0])
        sqlite_store.record_job(task.id, "7" if not tasks else "8")
        sqlite_store.update_task(task.id, state="RUNNING")
        tasks.append(task)
    for job_id in ("7", "8"):
        slurm.jobs[job_id] = job(job_id, "FAILED", name="", exit_code=3)
    poller.cycle()
    assert [sqlite_store.get_task(t.id).state for t in tasks] == ["RUNNING", "RUNNING"]
    readable[0] = True
    poller.cycle()
    assert [sqlite_store.get_task(t.id).state for t in tasks] == ["EXECUTOR_ERROR"] * 2
    # Never readable: decided from Slurm's word once the grace is over.
    late = sqlite_store.create_task(ECHO, owner="alice")
    assert sqlite_store.mark_submitting(late.id, attempt=1, now=now[0])
    sqlite_store.record_job(late.id, "9")
    sqlite_store.update_task(late.id, state="RUNNING")
    slurm.jobs["9"] = job("9", "FAILED", name="", exit_code=3)
    readable[0] = False
    poller.cycle()
    assert sqlite_store.get_task(late.id).state == "RUNNING"
    now[0] += RECORDS_UNREADABLE_GRACE + 1
    poller.cycle()
    assert sqlite_store.get_task(late.id).state == "SYSTEM_ERROR"


def test_owner_commands_run_through_the_one_sudo_argv(tmp_path: Path) -> None:
    from bridge.poller.owners import OwnerCommandError, OwnerRunner

    sudo = tmp_path / "sudo"
    log = tmp_path / "argv"
    sudo.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > {log}\n'
        'case "$8" in remove) echo "no such directory" >&2; exit 2;; esac\n'
        "cat\n"
    )
    sudo.chmod(0o755)
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"site.sudo": str(sudo)},
    )
    runner = OwnerRunner(config)
    assert runner.run("alice", ["adopt", "--task-dir", "/w/t"], stdin="{}") == "{}"
    work = str(config.work_dir)
    python = config.job.python
    assert log.read_text().split("\n")[:-1] == [
        "-n", "-u", "alice", "--", python, "-m", "bridge.job", "adopt", "--work-dir", work,
        "--task-dir", "/w/t",
    ]  # fmt: skip
    with pytest.raises(OwnerCommandError, match="remove exited 2: no such directory"):
        runner.remove("alice", Path("/w/t"))


def test_fence_tokens_rise_even_when_the_clock_steps_back(env):
    poller, _, _, _ = env
    now = [2_000.0]
    poller.clock = lambda: now[0]
    first = poller.ctx.fence_token()
    now[0] -= 3_600  # an NTP step back
    assert first < poller.ctx.fence_token() < poller.ctx.fence_token()
    now[0] += 7_200
    assert poller.ctx.fence_token() == 5_600_000
