"""Admission control, refusals for Slurm's limits and the time-limit message, with the fake
Slurm of tests/fakes/slurm.py (the real cluster runs them in tests/cluster/test_hpc.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bridge.config import load_config
from bridge.core.tes import State
from bridge.poller import Poller, decide
from bridge.poller.loop import LEAVING_LOOKBACK_SECONDS
from bridge.slurm import JobInfo
from bridge.store import Store, TaskRecord
from tests.fakes.slurm import FakeSlurm, job
from tests.unit.test_poller import ECHO, FakeImages, records, write_finished_records

#: What sbatch prints when refused for a limit. The first two are Slurm's own words for a
#: QOS or association submit limit (ESLURM_ACCOUNTING_POLICY after the limit's name) and for
#: MaxJobCount (EAGAIN, after sbatch's own retries); this cluster enforces neither, so they
#: cannot be produced on it at run time.
LIMIT_REFUSALS = [
    "sbatch: error: QOSMaxSubmitJobPerUserLimit\n"
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy "
    "(job submit limit, user's size and/or time limits)\n",
    "sbatch: error: MaxSubmitJobsPerAccount\n"
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy "
    "(job submit limit, user's size and/or time limits)\n",
    "sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying\n"
    "sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying\n"
    "sbatch: error: Batch job submission failed: Resource temporarily unavailable\n",
]


def make_poller(tmp_path: Path, store: Store, **slurm: Any) -> tuple[Poller, FakeSlurm]:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={f"slurm.{k}": v for k, v in slurm.items()},
    )
    fake = FakeSlurm()
    return Poller(config, store, slurm_client=fake, images=FakeImages()), fake


def condition(store: Store, task_id: str) -> list[str]:
    task = store.get_task(task_id)
    assert task is not None
    return [line for log in task.logs or [] for line in log.get("system_logs", [])]


def finish(store: Store, job_id: str) -> None:
    for task in store.tasks_in_flight():
        if task.job_id == job_id:
            store.update_task(task.id, state="COMPLETE")


def test_max_jobs_in_flight_keeps_the_rest_queued_saying_why(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store, max_jobs_in_flight=2)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(5)]
    poller.cycle()
    assert fake.calls.count("sbatch") == 2
    waiting = [t for t in tasks if not sqlite_store.get_task(t.id).job_id]
    assert len(waiting) == 3
    for task in waiting:
        assert condition(sqlite_store, task.id) == [
            "waiting: 2 jobs of this service are in Slurm, the most it submits at once "
            "(slurm.max_jobs_in_flight = 2)"
        ]
        assert sqlite_store.get_task(task.id).state == "QUEUED"
    poller.cycle()
    assert fake.calls.count("sbatch") == 2
    finish(sqlite_store, "100")
    poller.cycle()
    assert fake.calls.count("sbatch") == 3
    submitted = sqlite_store.get_task(waiting[0].id)
    assert submitted.job_id and not any(
        line.startswith("waiting:") for line in condition(sqlite_store, submitted.id)
    )


def test_max_jobs_per_owner_lets_other_owners_through(tmp_path, sqlite_store):
    poller, _ = make_poller(tmp_path, sqlite_store, max_jobs_per_owner=1)
    alice = [sqlite_store.create_task(ECHO, owner="alice") for _ in range(3)]
    bob = sqlite_store.create_task(ECHO, owner="bob")
    poller.cycle()
    assert sqlite_store.get_task(alice[0].id).job_id
    assert sqlite_store.get_task(bob.id).job_id
    for task in alice[1:]:
        assert not sqlite_store.get_task(task.id).job_id
        assert condition(sqlite_store, task.id) == [
            "waiting: 1 jobs of this task's owner are in Slurm, the most one owner may have "
            "(slurm.max_jobs_per_owner = 1)"
        ]


@pytest.mark.parametrize("first", ["alice", None])
def test_an_owner_at_the_limit_does_not_hold_back_the_owners_queued_behind(
    tmp_path, sqlite_store, monkeypatch, first
):
    # More of one owner's tasks queued first than one round reads: the others still go.
    monkeypatch.setattr("bridge.poller.submit.MAX_SUBMISSIONS_PER_CYCLE", 3)
    poller, fake = make_poller(tmp_path, sqlite_store, max_jobs_per_owner=1)
    first_tasks = [sqlite_store.create_task(ECHO, owner=first) for _ in range(5)]
    others = [sqlite_store.create_task(ECHO, owner=o) for o in ("bob", "carol")]
    poller.cycle()  # the first owner's first task, and its limit is reached
    poller.cycle()
    assert [bool(sqlite_store.get_task(t.id).job_id) for t in first_tasks] == [True] + [False] * 4
    assert all(sqlite_store.get_task(t.id).job_id for t in others)
    assert fake.calls.count("sbatch") == 3
    finish(sqlite_store, sqlite_store.get_task(first_tasks[0].id).job_id)
    poller.cycle()
    assert sqlite_store.get_task(first_tasks[1].id).job_id


@pytest.mark.parametrize("refusal", LIMIT_REFUSALS)
def test_a_refusal_for_a_limit_waits_and_is_submitted_again(tmp_path, sqlite_store, refusal):
    poller, fake = make_poller(tmp_path, sqlite_store)
    task = sqlite_store.create_task(ECHO)
    fake.sbatch_error = refusal
    poller.cycle()
    record = sqlite_store.get_task(task.id)
    assert record.state == "QUEUED" and not record.job_id and not record.submit_started_at
    lines = condition(sqlite_store, task.id)
    assert len(lines) == 1 and lines[0].startswith(
        "waiting: Slurm refused the job for a limit ("
    ), lines
    assert "sleeping and retrying" not in lines[0]
    fake.sbatch_error = None
    poller.clock = lambda: 1e12  # after the back-off
    poller.cycle()
    record = sqlite_store.get_task(task.id)
    assert record.job_id and record.state == "QUEUED"
    assert not any(line.startswith("waiting:") for line in condition(sqlite_store, task.id))
    assert fake.calls.count("find") == 0  # no job was looked for: none can exist


def ended(state: str) -> JobInfo:
    return job(state=state, exit_code=0, signal=None)


def test_a_timeout_names_the_limit_and_where_it_came_from():
    decision = decide(
        job=ended("TIMEOUT"),
        records=records(phase="running 0"),
        attempt=1,
        retries=2,
        current=State.RUNNING,
        time_limit="--time=0:00:05, from resources.backend_parameters.time",
    )
    assert decision.state is State.EXECUTOR_ERROR
    assert decision.messages == [
        "Slurm job 1 ended in state TIMEOUT (exit code 0): the job reached its time limit "
        "(--time=0:00:05, from resources.backend_parameters.time)"
    ]
    decision = decide(
        job=ended("TIMEOUT"), records=records(), attempt=1, retries=2, current=State.RUNNING
    )
    assert "no --time was asked: the partition's own limit" in decision.messages[0]


def test_the_submitted_attempt_records_its_time_limit(tmp_path, sqlite_store):
    poller, _ = make_poller(tmp_path, sqlite_store, default_time="2:00:00")
    task = sqlite_store.create_task(ECHO)
    poller.cycle()
    metadata = sqlite_store.get_task(task.id).logs[0]["metadata"]
    assert metadata["slurm_time_limit"] == "--time=2:00:00, from slurm.default_time"


def test_a_time_limit_refusal_names_the_limit_the_job_was_given(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store, default_time="2:00:00")
    fake.sbatch_error = (
        "sbatch: error: Batch job submission failed: Requested time limit is invalid "
        "(missing or exceeds some limit)\n"
    )
    task = sqlite_store.create_task(ECHO)
    poller.cycle()
    assert sqlite_store.get_task(task.id).state == "SYSTEM_ERROR"
    assert condition(sqlite_store, task.id) == [
        "Slurm refused the job: Batch job submission failed: Requested time limit is invalid "
        "(missing or exceeds some limit). The job asked for --time=2:00:00, from "
        "slurm.default_time: ask for less time, or for a partition whose limit is longer "
        "(sinfo -o '%P %l')"
    ]


def test_the_admission_gauge_counts_the_tasks_held_back(
    tmp_path: Path, sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bridge.system import metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # this process's values
    poller, fake = make_poller(tmp_path, sqlite_store, max_jobs_in_flight=2)
    for _ in range(5):
        sqlite_store.create_task(ECHO)
    poller.cycle()
    assert metrics.TASKS_HELD_BY_ADMISSION._value.get() == 3
    assert metrics.TASKS_WAITING_FOR_IMAGE._value.get() == 0
    finish(sqlite_store, "100")
    finish(sqlite_store, "101")
    poller.cycle()
    assert fake.calls.count("sbatch") == 4
    assert metrics.TASKS_HELD_BY_ADMISSION._value.get() == 1


def test_tasks_that_end_are_counted_by_final_state(
    tmp_path: Path, sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataclasses import replace

    from bridge.job.records import JobRecords
    from bridge.system import metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    finished = metrics.TASKS_FINISHED.labels("COMPLETE")
    failed = metrics.TASKS_FINISHED.labels("EXECUTOR_ERROR")
    before = (finished._value.get(), failed._value.get())
    poller, fake = make_poller(tmp_path, sqlite_store)
    ok = sqlite_store.create_task(ECHO)
    bad = sqlite_store.create_task(ECHO)
    poller.cycle()
    jobs = {task.id: sqlite_store.get_task(task.id).job_id for task in (ok, bad)}
    outcomes = {jobs[ok.id]: "complete", jobs[bad.id]: "executor_error"}
    for job_id in outcomes:
        fake.jobs[job_id] = replace(fake.jobs[job_id], state="COMPLETED", exit_code=0)
    monkeypatch.setattr(
        "bridge.poller.watch.read_records",
        lambda _dir, job_id, **_: JobRecords(job_id=job_id, phase="done", outcome=outcomes[job_id]),
    )
    poller.cycle()
    assert sqlite_store.get_task(ok.id).state == "COMPLETE"
    assert sqlite_store.get_task(bad.id).state == "EXECUTOR_ERROR"
    poller.cycle()  # counted once
    assert (finished._value.get(), failed._value.get()) == (before[0] + 1, before[1] + 1)


def _first_decided_from_records_second_held(
    tmp_path: Path, sqlite_store: Store
) -> tuple[Poller, FakeSlurm, TaskRecord, str]:
    """Under max_jobs_in_flight = 1: the first task's job runs and records its outcome, the
    quick check decides the task COMPLETE; squeue still lists the job running. Returns the
    poller, its Slurm, the second task (held back) and the first one's job id."""
    poller, fake = make_poller(tmp_path, sqlite_store, max_jobs_in_flight=1)
    first, second = (sqlite_store.create_task(ECHO) for _ in range(2))
    poller.cycle()
    job_id = sqlite_store.get_task(first.id).job_id
    assert job_id and not sqlite_store.get_task(second.id).job_id
    fake.jobs[job_id] = replace(fake.jobs[job_id], state="RUNNING", node="node1")
    poller.cycle()
    write_finished_records(poller.task_dir(first.id) / "records" / job_id, "complete", 0)
    assert poller.quick_check() == "finish"
    poller.finish_recorded()
    assert sqlite_store.get_task(first.id).state == "COMPLETE"
    return poller, fake, second, job_id


def test_a_task_decided_from_its_records_keeps_its_slot_until_its_job_leaves_slurm(
    tmp_path: Path, sqlite_store: Store
) -> None:
    # The job recorded its outcome and the task is COMPLETE, but the job script is still
    # exiting: squeue lists it running (then completing). Submitting the next task then would
    # put two jobs in Slurm under a limit of one.
    poller, fake, second, job_id = _first_decided_from_records_second_held(tmp_path, sqlite_store)
    assert not sqlite_store.get_task(second.id).job_id
    fake.jobs[job_id] = replace(fake.jobs[job_id], state="COMPLETING")
    poller.cycle()
    assert fake.calls.count("sbatch") == 1
    assert "waiting: 1 jobs of this service are in Slurm" in condition(sqlite_store, second.id)[0]
    # It left: the task held back goes in the same cycle.
    fake.jobs[job_id] = replace(fake.jobs[job_id], state="COMPLETED", exit_code=0)
    poller.cycle()
    assert fake.calls.count("sbatch") == 2
    assert sqlite_store.get_task(second.id).job_id


def test_a_canceled_tasks_job_keeps_its_owners_slot_until_it_leaves_slurm(
    tmp_path: Path, sqlite_store: Store
) -> None:
    poller, fake = make_poller(tmp_path, sqlite_store, max_jobs_per_owner=1)
    first, second = (sqlite_store.create_task(ECHO, owner="alice") for _ in range(2))
    poller.cycle()
    job_id = sqlite_store.get_task(first.id).job_id
    assert job_id
    fake.jobs[job_id] = replace(fake.jobs[job_id], state="RUNNING", node="node1")
    poller.cycle()
    sqlite_store.cancel_task(first.id)
    poller.cycle()
    assert sqlite_store.get_task(first.id).state == "CANCELED"
    # scancel sent; the job's processes take a moment to end.
    fake.jobs[job_id] = replace(fake.jobs[job_id], state="COMPLETING")
    poller.cycle()
    assert not sqlite_store.get_task(second.id).job_id
    fake.jobs[job_id] = replace(fake.jobs[job_id], state="CANCELLED")
    poller.cycle()
    assert sqlite_store.get_task(second.id).job_id


def test_a_poller_that_starts_counts_the_jobs_of_tasks_decided_just_before_it(
    tmp_path: Path, sqlite_store: Store
) -> None:
    # The task was decided from its records by the poller before, which then stopped: what
    # it knew of the job still ending died with it. The next one must count that job too.
    poller, fake, second, job_id = _first_decided_from_records_second_held(tmp_path, sqlite_store)

    restarted = Poller(poller.config, sqlite_store, slurm_client=fake, images=FakeImages())
    restarted.cycle()
    assert fake.calls.count("sbatch") == 1
    assert not sqlite_store.get_task(second.id).job_id
    fake.jobs[job_id] = replace(fake.jobs[job_id], state="COMPLETED", exit_code=0)
    restarted.cycle()
    assert fake.calls.count("sbatch") == 2
    # A task decided longer ago than the look-back is not asked about.
    sqlite_store.update_task(second.id, state="COMPLETE", allow_terminal=True)
    later = Poller(poller.config, sqlite_store, slurm_client=fake, images=FakeImages())
    later.clock = lambda: time.time() + LEAVING_LOOKBACK_SECONDS + 1
    later.cycle()
    assert later.ctx.jobs_leaving == {}
