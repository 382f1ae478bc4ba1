"""The nemesis's own judgement of "run twice" (bench/nemesis/checks.py), on sacct records it met."""

from __future__ import annotations

from typing import Any

from bench.nemesis import ran_twice

TASK: dict[str, Any] = {
    "logs": [{"metadata": {"slurm_job_id": "79017", "slurm_lost_job_ids": "78974"}}]
}

#: A PostgreSQL run, seed 4242: node2's processes were killed 5 s after job 78974 started
#: there; slurmctld set the job NODE_FAIL 30 s later and the task was submitted again
#: (79017). slurmctld was then killed -9 before it saved that, came back with 78974 running,
#: and recorded its end again at 11:56:12, after 79017 had run.
LOST_THEN_RUN = [
    {"id": "78974", "state": "NODE_FAIL", "exit": "1:0", "node": "node2",
     "start": "2026-11-28T11:53:55", "end": "2026-11-28T11:56:12"},
    {"id": "79017", "state": "COMPLETED", "exit": "0:0", "node": "node2",
     "start": "2026-11-28T11:55:11", "end": "2026-11-28T11:55:12"},
]  # fmt: skip


def test_a_job_whose_node_was_killed_ran_no_further_than_the_kill():
    assert ran_twice(TASK, LOST_THEN_RUN, [("node2", "2026-11-28T11:54:01")]) is None


def test_without_that_kill_the_two_jobs_ran_at_once():
    assert "ran at once" in (ran_twice(TASK, LOST_THEN_RUN) or "")
    # A kill of another node, or of this one before the job started, does not end it.
    for kill in [("node1", "2026-11-28T11:54:01"), ("node2", "2026-11-28T11:53:50")]:
        assert "ran at once" in (ran_twice(TASK, LOST_THEN_RUN, [kill]) or "")


def test_two_completed_runs_are_twice_whatever_the_kills():
    both = [dict(LOST_THEN_RUN[0], state="COMPLETED"), LOST_THEN_RUN[1]]
    kill = [("node2", "2026-11-28T11:54:01")]
    assert "2 runs to their end" in (ran_twice(TASK, both, kill) or "")
    # A task whose executor failed ends its job FAILED with the executor's code: a run too.
    failed = [dict(LOST_THEN_RUN[0], state="FAILED", exit="42:0"), LOST_THEN_RUN[1]]
    assert "2 runs to their end" in (ran_twice(TASK, failed, kill) or "")
    # A job that could not start its records ran nothing of the task.
    nothing = [dict(LOST_THEN_RUN[0], state="FAILED", exit="75:0"), LOST_THEN_RUN[1]]
    assert ran_twice(TASK, nothing, kill) is None
