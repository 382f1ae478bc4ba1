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


def test_a_job_slurm_completed_without_its_script_beginning_is_no_run(tmp_path):
    """A CI run on 22.05, seed 742452: a slurmctld back from an older state gave out ids its
    nodes still held; element 6317_6 could not be launched on node2 (drained "batch job
    complete failure") and Slurm ended it COMPLETED 0:0 in the second it started. The task,
    without that job's records, was submitted again (6349) and ran."""
    task = {"logs": [{"metadata": {"slurm_job_id": "6349", "slurm_lost_job_ids": "6317_6"}}]}
    jobs = [
        {"id": "6317_6", "state": "COMPLETED", "exit": "0:0", "node": "node2",
         "start": "2026-11-29T08:56:19", "end": "2026-11-29T08:56:19"},
        {"id": "6349", "state": "COMPLETED", "exit": "0:0", "node": "node1",
         "start": "2026-11-29T08:56:22", "end": "2026-11-29T08:56:24"},
    ]  # fmt: skip
    for job in jobs:
        (tmp_path / "records" / job["id"]).mkdir(parents=True)
    (tmp_path / "records" / "6349" / "start_time").write_text("2026-11-29T08:56:22.101Z\n")
    assert ran_twice(task, jobs, task_dir=tmp_path) is None
    # Sacct's word alone, or a script that began (its first record written), is two runs.
    assert "2 runs to their end" in (ran_twice(task, jobs) or "")
    (tmp_path / "records" / "6317_6" / "start_time").write_text("2026-11-29T08:56:19.020Z\n")
    assert "2 runs to their end" in (ran_twice(task, jobs, task_dir=tmp_path) or "")


def test_array_elements_count_as_their_tasks_jobs(monkeypatch):
    """A task submitted as an array's element is found under its own job name: its runs are
    judged (run twice, falsely failed) as a job of its own is."""
    import subprocess

    from bench.nemesis import checks

    sacct = "\n".join(
        [
            "40|one-tes-1|COMPLETED|0:0|node1|2026-11-29T05:00:00|2026-11-29T05:00:01",
            "41_0|x-tes-array-ab|COMPLETED|0:0|node1|2026-11-29T05:00:00|2026-11-29T05:00:01",
            "41_1|x-tes-array-ab|NODE_FAIL|0:0|node2|2026-11-29T05:00:00|2026-11-29T05:00:01",
            "42|x-tes-2|COMPLETED|0:0|node1|2026-11-29T05:01:00|2026-11-29T05:01:01",
            "43_0|other-tes-array-cd|COMPLETED|0:0|node1|2026-11-29T05:00:00|2026-11-29T05:00:01",
        ]
    )

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        out = sacct if argv[0] == "sacct" else ""
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(checks.subprocess, "run", run)
    monkeypatch.setattr(checks.time, "sleep", lambda seconds: None)
    arrays = {"x-tes-array-ab": ["x-tes-3", "x-tes-2"]}
    jobs = checks.sacct_jobs("now", {"one-tes-1", "x-tes-2", "x-tes-3"}, arrays)
    assert {name: [j["id"] for j in found] for name, found in jobs.items()} == {
        "one-tes-1": ["40"],
        "x-tes-3": ["41_0"],
        "x-tes-2": ["41_1", "42"],
    }
