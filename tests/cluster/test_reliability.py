"""Reliability on the real cluster: processes killed at any instant, a full work filesystem,
slurmctld away, cancels racing submissions, and the final Slurm facts of finished tasks.

Every task must reach its right terminal state with exactly one Slurm job per attempt (sacct
and squeue by job name), and a canceled task's executors never run.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from bench.common import slurm_jobs_by_task
from bridge.core.naming import SUPERSEDED_EXIT_CODE
from bridge.slurm import JobInfo, SlurmClient
from tests.fixtures.service import BridgeService, start_bridge_service
from tests.procs import children, cmdline

pytestmark = pytest.mark.cluster

ALPINE = "alpine"

#: The concurrent test: threads creating tasks, and tasks each creates (every other canceled).
CREATORS = 8
CREATES_PER_THREAD = 8

#: An sbatch on a slow way to slurmctld: it sleeps before and after the real sbatch, which runs
#: as its child (not exec'd), as a site's wrapper might. The delays are read from files beside
#: it, so a test can change them while the service runs.
SLOW_SBATCH = """#!/bin/bash
dir=$(dirname "$0")
echo "start $$ $*" >>"$dir/sbatch.log"
sleep "$(cat "$dir/sbatch-before" 2>/dev/null || echo 0)"
{sbatch} "$@"
rc=$?
echo "end $$ $rc" >>"$dir/sbatch.log"
sleep "$(cat "$dir/sbatch-after" 2>/dev/null || echo 0)"
exit $rc
"""

#: An sbatch whose request slurmctld acts on late: the first call hands the real sbatch to a
#: process of its own session, which submits {late} s later (past the poller's time-out and
#: settle time), and hangs until the poller kills it at its time-out; later calls are sbatch.
LATE_SBATCH = """#!/bin/bash
dir=$(dirname "$0")
if mkdir "$dir/late.once" 2>/dev/null; then
  setsid bash -c 'echo $$ >"$0/late.pid"; sleep {late}; exec "$@" >"$0/late.out" 2>"$0/late.err"' \\
    "$dir" {sbatch} "$@" </dev/null >/dev/null 2>&1 &
  sleep 600
fi
exec {sbatch} "$@"
"""


def executor(*command: str) -> dict[str, Any]:
    return {"image": ALPINE, "command": list(command)}


def slow_sbatch(root: Path, before: float, after: float) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    wrapper = root / "slow-sbatch"
    wrapper.write_text(SLOW_SBATCH.format(sbatch=shutil.which("sbatch") or "/usr/bin/sbatch"))
    wrapper.chmod(0o755)
    set_delays(root, before, after)
    return wrapper


def set_delays(root: Path, before: float, after: float) -> None:
    (root / "sbatch-before").write_text(f"{before}\n")
    (root / "sbatch-after").write_text(f"{after}\n")


def wait_for_sbatch(root: Path, task_id: str, timeout: float = 60) -> float:
    """The monotonic time at which the wrapper started for this task."""
    deadline = time.monotonic() + timeout
    log = root / "sbatch.log"
    while time.monotonic() < deadline:
        if log.exists() and f"--job-name=tes-{task_id}" in log.read_text():
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"sbatch never started for {task_id}")


def assert_one_job_per_attempt(tasks: dict[str, dict[str, Any]], work_dir: Path) -> None:
    """Each task's jobs (its own, and its elements of job arrays) are its attempts."""
    found = slurm_jobs_by_task(work_dir, list(tasks.values()))
    counts = {task_id: len(found[task_id]) for task_id in tasks}
    attempts = {task_id: len(task["logs"]) for task_id, task in tasks.items()}
    differing = {t for t in tasks if counts[t] != attempts[t]}
    assert not differing, _job_details(differing, found, work_dir)


def _job_details(task_ids: set[str], found: dict[str, list[str]], work_dir: Path) -> str:
    """What Slurm and the task directories say of each job of the tasks that differ."""
    job_ids = sorted({j for t in task_ids for j in found[t]})
    sacct = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State,ExitCode,Start,End", "-j",
         ",".join(job_ids) or "0"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    lines = [f"{len(task_ids)} tasks with jobs other than their attempts:"]
    for task_id in sorted(task_ids)[:20]:
        records = sorted(p.name for p in (work_dir / task_id / "records").glob("*"))
        lines.append(f"{task_id}: jobs {found[task_id]}, records of {records}")
    lines += ["sacct:", *sacct.splitlines()[:60]]
    return "\n".join(lines)


def executors_ran(service: BridgeService, task_id: str) -> list[Path]:
    return list((service.work_dir / task_id / "records").glob("*/executors/0"))


@pytest.fixture
def slow_service(local_cluster: Any, tmp_path: Path) -> Iterator[BridgeService]:
    wrapper = slow_sbatch(tmp_path, before=2, after=2)
    with start_bridge_service(
        local_cluster,
        tmp_path,
        slurm_toml=f'sbatch = "{wrapper}"\ncommand_timeout = 15.0\nsubmit_settle = 5.0',
    ) as service:
        yield service


# ---------------------------------------------------------------------- exactly once (defect 3)


def test_poller_killed_anywhere_in_a_slow_sbatch_submits_each_attempt_once(slow_service):
    service, root = slow_service, slow_service.root
    ids = []
    # In the wrapper's first sleep (no job yet), around the real sbatch, in its second sleep
    # (the job exists, its id is not stored yet).
    for offset in (0.5, 1.9, 2.3, 3.2):
        task_id = service.create({"executors": [executor("echo", str(offset))]})
        ids.append(task_id)
        started = wait_for_sbatch(root, task_id)
        time.sleep(max(0.0, started + offset - time.monotonic()))
        service.kill_poller()
        service.start_poller()
    tasks = {task_id: service.wait(task_id, timeout=300) for task_id in ids}
    for task in tasks.values():
        assert task["state"] == "COMPLETE", task
        assert len(task["logs"]) == 1, task["logs"]
    assert_one_job_per_attempt(tasks, service.work_dir)


def test_an_sbatch_acted_on_after_the_settle_time_stands_down_and_the_task_runs_once(
    local_cluster, tmp_path
):
    wrapper = tmp_path / "late-sbatch"
    sbatch = shutil.which("sbatch") or "/usr/bin/sbatch"
    wrapper.write_text(LATE_SBATCH.format(sbatch=sbatch, late=25))
    wrapper.chmod(0o755)
    toml = f'sbatch = "{wrapper}"\ncommand_timeout = 4.0\nsubmit_settle = 2.0\narrays = "never"'
    try:
        with start_bridge_service(local_cluster, tmp_path, slurm_toml=toml) as service:
            task_id = service.create({"executors": [executor("echo", "once")]})
            task = service.wait(task_id, timeout=300)
            assert task["state"] == "COMPLETE", task
            job_id = task["logs"][-1]["metadata"]["slurm_job_id"]
            late_id = _late_job(tmp_path / "late.out")
            ended = _wait_for_sacct_end(late_id)
            assert (ended.exit_code, ended.signal) == (SUPERSEDED_EXIT_CODE, 0), ended  # stood down
            output = (service.work_dir / task_id / f"slurm-{late_id}.out").read_text()
            assert "standing down" in output, output
            # The task ran once, in the job it was submitted again as.
            assert [p.parent.parent.name for p in executors_ran(service, task_id)] == [job_id]
            assert service.get(task_id)["state"] == "COMPLETE"
    finally:
        with contextlib.suppress(OSError, ValueError):
            _kill(int((tmp_path / "late.pid").read_text()))


def _late_job(out: Path, timeout: float = 120) -> str:
    """The job id the late sbatch printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = out.read_text().strip() if out.exists() else ""
        if text:
            assert text.isdigit(), text
            return text
        time.sleep(0.5)
    raise AssertionError("the late sbatch never submitted")


def _wait_for_sacct_end(job_id: str, timeout: float = 120) -> JobInfo:
    """sacct's record of the job once it has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = SlurmClient().accounting([job_id]).get(job_id)
        if job is not None and job.ended:
            return job
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not end")


# ------------------------------------------------------------- transient conditions (defect 8)


@pytest.fixture
def small_work_fs(local_cluster: Any) -> Iterator[Path]:
    """A small filesystem as the work directory, on the shared filesystem (mounted there, it
    reaches the compute nodes too)."""
    shared = local_cluster.shared_path("full-work")
    work = shared / "work"
    work.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(work)], check=True)
    try:
        yield work
    finally:
        subprocess.run(["umount", "-l", str(work)], check=False)
        shutil.rmtree(shared, ignore_errors=True)


def fill(path: Path) -> None:
    with open(path, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass


def condition_lines(task: dict[str, Any], words: str) -> list[str]:
    return [x for log in task.get("logs", []) for x in log.get("system_logs", []) if words in x]


def wait_for_condition(
    service: BridgeService, ids: list[str], words: str, timeout: float, step: float
) -> None:
    """Wait until every task's system_logs carries a line with `words`."""
    deadline = time.monotonic() + timeout
    while True:
        tasks = [service.get(task_id) for task_id in ids]
        if all(condition_lines(t, words) for t in tasks):
            return
        assert time.monotonic() < deadline, tasks
        time.sleep(step)


def test_full_work_filesystem_keeps_tasks_queued_then_they_complete(
    local_cluster, tmp_path, small_work_fs
):
    filler = small_work_fs / "filler"
    fill(filler)
    with start_bridge_service(local_cluster, tmp_path, shared=small_work_fs.parent) as service:
        ids = [service.create({"executors": [executor("echo", str(i))]}) for i in range(6)]
        wait_for_condition(service, ids, "waiting: cannot prepare", timeout=60, step=0.5)
        time.sleep(6)  # several retries with back-off: still one line each, still QUEUED
        for task_id in ids:
            task = service.get(task_id)
            assert task["state"] == "QUEUED", task
            lines = condition_lines(task, "waiting: cannot prepare")
            assert len(lines) == 1 and "No space left on device" in lines[0], task
        filler.unlink()
        tasks = {task_id: service.wait(task_id, timeout=240) for task_id in ids}
        for i, task in enumerate(tasks.values()):
            assert task["state"] == "COMPLETE", task
            assert task["logs"][0]["logs"][0]["stdout"] == f"{i}\n"
            assert not condition_lines(task, "waiting"), task
        assert_one_job_per_attempt(tasks, service.work_dir)


def job_id_of(service: BridgeService, task_id: str, timeout: float = 120) -> str:
    """The task's job id, once its job is submitted."""
    deadline = time.monotonic() + timeout
    while True:
        task = service.get(task_id)
        job_id = (task.get("logs") or [{}])[0].get("metadata", {}).get("slurm_job_id")
        if job_id:
            return str(job_id)
        assert time.monotonic() < deadline, task
        time.sleep(0.1)


def test_a_job_that_starts_on_a_full_work_filesystem_runs_again_once_space_is_back(
    local_cluster, tmp_path, small_work_fs
):
    """The work filesystem fills between sbatch and the script's first record: the job exits
    with the script's no-records code, and the task is neither failed nor run twice at once.
    Its one entry names the lost job, and the new job waits until space is back."""
    filler = small_work_fs / "filler"
    # The prologue holds the script before it starts its records, while the filesystem fills.
    with start_bridge_service(
        local_cluster, tmp_path, shared=small_work_fs.parent, slurm_toml='prologue = "sleep 8"'
    ) as service:
        task_id = service.create({"executors": [executor("echo", "ran")]})
        lost = job_id_of(service, task_id)
        fill(filler)
        wait_for_condition(service, [task_id], "could not write its records", 120, 0.5)
        wait_for_condition(service, [task_id], "waiting: cannot prepare", 60, 0.5)
        time.sleep(4)  # submissions retried with back-off: still QUEUED, no new job
        task = service.get(task_id)
        assert task["state"] == "QUEUED", task
        assert task["logs"][0]["metadata"]["slurm_lost_job_ids"] == lost, task
        assert "slurm_job_id" not in task["logs"][0]["metadata"], task
        filler.unlink()
        task = service.wait(task_id, timeout=240)
    assert task["state"] == "COMPLETE", task
    (entry,) = task["logs"]
    assert entry["logs"][0]["stdout"] == "ran\n"
    assert entry["metadata"]["slurm_lost_job_ids"] == lost
    assert entry["metadata"]["slurm_job_id"] != lost
    assert any(
        f"Slurm job {lost} ended in state FAILED (exit code 75)" in line
        for line in entry["system_logs"]
    ), entry
    assert not condition_lines(task, "waiting"), task
    found = SlurmClient().find_by_names([f"tes-{task_id}"])[f"tes-{task_id}"]
    assert [j.job_id for j in found] == [lost, entry["metadata"]["slurm_job_id"]], found


def test_a_job_whose_script_is_killed_from_outside_runs_again(bridge_service):
    """A node's processes killed as it fails while slurmstepd lives (the nemesis soak): sacct
    has the job FAILED with signal 9 and no outcome. The task did not fail: it runs again."""
    task_id = bridge_service.create({"executors": [executor("sh", "-c", "sleep 6; echo ran")]})
    killed = job_id_of(bridge_service, task_id)
    bridge_service.wait(task_id, timeout=120, states={"RUNNING"})
    time.sleep(2)  # the executor is running
    # SIGKILL to the batch script alone, as a node's OOM killer or an operator's kill would.
    subprocess.run(["scancel", "--batch", "--signal=KILL", killed], check=True, timeout=30)
    task = bridge_service.wait(task_id, timeout=240)
    assert task["state"] == "COMPLETE", task
    lines = [line for entry in task["logs"] for line in entry.get("system_logs", [])]
    assert any(
        line.startswith(f"Slurm job {killed} ended in state FAILED (exit code 0, signal 9): "
                        "its script was killed")
        and line.endswith("submitting it again")
        for line in lines
    ), lines  # fmt: skip
    last = task["logs"][-1]
    assert last["metadata"]["slurm_job_id"] != killed, task
    assert last["logs"][-1]["stdout"] == "ran\n", task


def test_a_task_canceled_while_its_job_pends_keeps_no_pending_line(local_cluster, tmp_path):
    # --begin holds the job in the queue (reason BeginTime) until it is canceled.
    with start_bridge_service(
        local_cluster, tmp_path, slurm_toml='extra_directives = ["--begin=now+3600"]'
    ) as service:
        task_id = service.create({"executors": [executor("echo", "must not run")]})
        job_id = job_id_of(service, task_id)
        wait_for_condition(service, [task_id], f"Slurm job {job_id} is pending", 60, 0.5)
        service.cancel(task_id)
        ended = f"Slurm job {job_id} ended in state CANCELLED"
        wait_for_condition(service, [task_id], ended, 60, 0.5)
        time.sleep(3)  # more cycles: nothing comes back
        task = service.get(task_id)
    assert task["state"] == "CANCELED", task
    assert task["logs"][0]["system_logs"][-1] == ended, task
    assert not condition_lines(task, "is pending"), task


def test_slurmctld_away_keeps_tasks_queued_with_one_line_then_they_complete(
    bridge_service, local_cluster
):
    local_cluster.stop("slurmctld")
    try:
        ids = [bridge_service.create({"executors": [executor("echo", str(i))]}) for i in range(3)]
        wait_for_condition(bridge_service, ids, "cannot reach Slurm", timeout=90, step=1)
        time.sleep(8)  # more sbatch failures: the line is replaced, not piled up
        for task_id in ids:
            task = bridge_service.get(task_id)
            assert task["state"] == "QUEUED", task
            assert len(condition_lines(task, "cannot reach Slurm")) == 1, task
    finally:
        local_cluster.up()
    tasks = {task_id: bridge_service.wait(task_id, timeout=240) for task_id in ids}
    for task in tasks.values():
        assert task["state"] == "COMPLETE", task
        assert not condition_lines(task, "cannot reach Slurm"), task
        assert not condition_lines(task, "is pending"), task
    assert_one_job_per_attempt(tasks, bridge_service.work_dir)


# --------------------------------------------------------------------- cancels (defect 2)


def test_a_canceled_task_never_runs_its_executors_whenever_the_cancel_lands(
    local_cluster, tmp_path
):
    wrapper = slow_sbatch(tmp_path, before=1.5, after=1.5)
    # A slow job start (as slow staging would be): the poller has time to scancel a job it
    # learns of only when sbatch answers.
    with start_bridge_service(
        local_cluster,
        tmp_path,
        slurm_toml=f'sbatch = "{wrapper}"\nprologue = "sleep 4"',
    ) as service:
        task = {"executors": [executor("echo", "must not run")]}
        before_submit = service.create(task)
        service.cancel(before_submit)
        during = []
        for offset in (0.5, 1.7, 2.5):  # before, around and after the real sbatch
            task_id = service.create(task)
            started = wait_for_sbatch(tmp_path, task_id)
            time.sleep(max(0.0, started + offset - time.monotonic()))
            service.cancel(task_id)
            during.append(task_id)
        submitted = service.create(task)
        deadline = time.monotonic() + 60
        while "slurm_job_id" not in service.get(submitted).get("logs", [{}])[0].get("metadata", {}):
            assert time.monotonic() < deadline, service.get(submitted)
            time.sleep(0.1)
        service.cancel(submitted)  # the job is known and pending or starting
        ids = [before_submit, *during, submitted]
        time.sleep(10)  # any job that was not canceled would have run its executor by now
        tasks = {task_id: service.get(task_id) for task_id in ids}
        for task_id, task in tasks.items():
            assert task["state"] == "CANCELED", task
            assert not executors_ran(service, task_id), task_id
        found = SlurmClient().find_by_names([f"tes-{t}" for t in ids])
        assert f"tes-{before_submit}" not in found
        for name, jobs in found.items():
            assert len(jobs) == 1, (name, jobs)
            assert jobs[0].state == "CANCELLED", jobs


def test_concurrent_creates_cancels_and_lists_never_5xx_and_cancels_hold(local_cluster, tmp_path):
    """Threads create tasks, cancel every other one shortly after, and list, all at once, on
    the SQLite store: no answer is a 5xx (cancels once failed with "database is locked"),
    each canceled task ends CANCELED without running, and the others complete, once each."""
    service = start_bridge_service(local_cluster, tmp_path)
    statuses: list[int] = []
    created: list[tuple[str, bool]] = []
    lock = threading.Lock()
    creating = threading.Event()
    creating.set()

    def note(result: requests.Response) -> requests.Response:
        with lock:
            statuses.append(result.status_code)
        return result

    def creator(seed: int) -> None:
        rng = random.Random(seed)
        for index in range(CREATES_PER_THREAD):
            task = {"name": f"c{seed}-{index}", "executors": [executor("true")]}
            result = note(requests.post(f"{service.api}/tasks", json=task, timeout=30))
            if result.status_code != 200:
                continue
            cancel = index % 2 == 0
            with lock:
                created.append((result.json()["id"], cancel))
            if cancel:
                time.sleep(rng.uniform(0, 0.3))  # before, during or after the submission
                note(requests.post(f"{service.api}/tasks/{result.json()['id']}:cancel", timeout=30))

    def lister() -> None:
        while creating.is_set():
            for params in ({"view": "BASIC"}, {"name_prefix": "c1-"}, {"state": "CANCELED"}):
                note(requests.get(f"{service.api}/tasks", params=params, timeout=30))

    try:
        listers = [threading.Thread(target=lister) for _ in range(2)]
        creators = [threading.Thread(target=creator, args=(seed,)) for seed in range(CREATORS)]
        for thread in listers + creators:
            thread.start()
        for thread in creators:
            thread.join()
        creating.clear()
        for thread in listers:
            thread.join()
        assert not [s for s in statuses if s >= 500], sorted(set(statuses))
        assert len(created) == CREATORS * CREATES_PER_THREAD and len(statuses) > len(created) * 2
        tasks = {task_id: service.wait(task_id, timeout=300) for task_id, _ in created}
        for task_id, canceled in created:
            task = tasks[task_id]
            if canceled:
                assert task["state"] == "CANCELED", task
                assert not executors_ran(service, task_id), task_id
            else:
                assert task["state"] == "COMPLETE", task
        assert_one_job_per_attempt(
            {t: tasks[t] for t, canceled in created if not canceled}, service.work_dir
        )
    finally:
        service.stop()


# ----------------------------------------------------------- final Slurm facts (issue 10)


def test_finished_tasks_carry_the_final_slurm_facts(bridge_service):
    # Long enough for one accounting sample (JobAcctGatherFrequency=task=5 on the local
    # cluster): a job shorter than that has no MaxRSS in sacct at all.
    ids = [
        bridge_service.create({"executors": [executor("sh", "-c", f"sleep 6; echo {i}")]})
        for i in range(20)
    ]
    deadline = time.monotonic() + 600
    pending = set(ids)
    tasks: dict[str, dict[str, Any]] = {}
    while pending:
        for task_id in list(pending):
            task = bridge_service.get(task_id)
            metadata = task.get("logs", [{}])[-1].get("metadata", {})
            assert metadata.get("slurm_state") != "RUNNING" or task["state"] != "COMPLETE", task
            if task["state"] == "COMPLETE" and "slurm_max_rss_bytes" in metadata:
                tasks[task_id] = task
                pending.discard(task_id)
        assert time.monotonic() < deadline, [bridge_service.get(t) for t in pending][:2]
        time.sleep(1)
    for task in tasks.values():
        metadata = task["logs"][0]["metadata"]
        assert metadata["slurm_state"] == "COMPLETED", task
        assert int(metadata["slurm_max_rss_bytes"]) > 0
        assert int(metadata["slurm_elapsed_seconds"]) >= 6
        assert metadata["slurm_node"]
        assert not condition_lines(task, "is pending"), task  # honest states (defect 15)


# ----------------------------------------------------------------- the fault test (issue 11)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _serve_processes(service: BridgeService) -> dict[str, list[int]]:
    master = service.processes["serve"].pid
    kids = children(master)
    supervisors = [p for p in kids if "--supervise" in cmdline(p)]
    workers = [p for p in kids if p not in supervisors]
    pollers = [p for s in supervisors for p in children(s)]
    return {"master": [master], "worker": workers, "poller": pollers}


def test_fault_random_kill_9_of_master_workers_and_poller(local_cluster, tmp_path):
    seed = int(os.environ.get("FAULT_SEED", time.time_ns() % 100_000))
    print(f"fault test seed: {seed} (rerun with FAULT_SEED={seed})")
    rng = random.Random(seed)
    wrapper = slow_sbatch(tmp_path, before=0.2, after=0.2)
    # One sbatch per task, so that kills land inside many of them (an array's sbatch window:
    # tests/cluster/test_arrays_cluster.py).
    service = start_bridge_service(
        local_cluster,
        tmp_path,
        slurm_toml=f'sbatch = "{wrapper}"\ncommand_timeout = 15.0\nsubmit_settle = 5.0\n'
        'arrays = "never"',
        serve_alone=True,
    )
    ids: list[str] = []
    kills: list[str] = []
    try:
        for i in range(30):
            ids.append(service.create({"executors": [executor("sh", "-c", f"echo {i}")]}))
        ended = time.monotonic() + 100
        while time.monotonic() < ended:
            time.sleep(rng.uniform(0.5, 4.0))
            _restart_if_gone(service)
            what = rng.choice(["master", "worker", "poller", "submit", "submit"])
            if what == "submit":
                # A poller killed inside a slow sbatch: longer than the poller takes to restart.
                kills.append(f"submit:{_kill_inside_sbatch(service, tmp_path, rng)}")
                continue
            victims = _serve_processes(service).get(what) or []
            if not victims:
                continue
            victim = rng.choice(victims)
            kills.append(f"{what}:{victim}")
            _kill(victim)
            if what == "master":
                # As an operator (or systemd) would: start it again once it is gone.
                service.processes.pop("serve").wait(timeout=10)
                service.start("serve", "serve")
            if all(_state(service, t) not in (None, "QUEUED") for t in ids):
                break
        print(f"kills: {kills}")
        assert any(k.startswith("submit:") and "no sbatch" not in k for k in kills), kills
        tasks = {}
        for task_id in ids:
            tasks[task_id] = _wait_through_restarts(service, task_id)
        for i, task in enumerate(tasks.values()):
            assert task["state"] == "COMPLETE", (seed, kills, task)
            assert task["logs"][-1]["logs"][0]["stdout"] == f"{i}\n", (seed, task)
        assert_one_job_per_attempt(tasks, service.work_dir)
    finally:
        service.stop()
    # Nothing of this service survives its stop (an orphaned supervisor or poller would); a
    # worker orphaned by a kill -9 of its master is gone within graceful_timeout + 5 s.
    deadline = time.monotonic() + 30
    while left := [pid for pid in _all_pids() if str(service.config_path) in cmdline(pid)]:
        if time.monotonic() > deadline:
            states = {pid: Path(f"/proc/{pid}/status").read_text()[:300] for pid in left}
            log = (service.root / "serve.log").read_text()[-3000:]
            pytest.fail(f"left after the service stopped: {states}\n{log}")
        time.sleep(0.5)


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _kill_inside_sbatch(service: BridgeService, root: Path, rng: random.Random) -> str:
    set_delays(root, before=5, after=1)
    log = root / "sbatch.log"
    seen = log.read_text().count("start ") if log.exists() else 0
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if log.exists() and log.read_text().count("start ") > seen:
                break
            time.sleep(0.05)
        else:
            return "no sbatch"
        offset = rng.uniform(0.0, 6.5)
        time.sleep(offset)
        victims = _serve_processes(service)["poller"]
        for pid in victims:
            _kill(pid)
        return f"{victims} at {offset:.1f}s"
    finally:
        set_delays(root, before=0.2, after=0.2)


def _state(service: BridgeService, task_id: str) -> str | None:
    """The task's state, or None while no API process answers (being restarted)."""
    try:
        return service.get(task_id, "MINIMAL")["state"]
    except (requests.ConnectionError, requests.Timeout):
        return None


def _restart_if_gone(service: BridgeService) -> None:
    """As systemd's Restart=always would: a serve that exited is started again."""
    if service.processes["serve"].poll() is not None:
        service.start("serve", "serve")


def _wait_through_restarts(service: BridgeService, task_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 240
    while True:
        _restart_if_gone(service)
        try:
            task = service.get(task_id)
            if task["state"] in ("COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED"):
                return task
        except requests.ConnectionError:
            pass  # a worker that is being replaced
        assert time.monotonic() < deadline, task_id
        time.sleep(0.5)
