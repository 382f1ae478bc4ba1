"""Job arrays (slurm.arrays), with the fake Slurm of tests/fakes/slurm.py: which tasks go
together, the array's script and manifest, each element followed, canceled and submitted again
as its own task's job, the crash window recovered by the array's name, and Slurm's array
output parsed (tests/cluster/test_arrays_cluster.py runs them on the real cluster)."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bridge.config import load_config
from bridge.core.naming import NO_RECORDS_EXIT_CODE
from bridge.core.tes import State
from bridge.jobscript.array import read_directives, render_array_script, shape
from bridge.poller import Poller
from bridge.poller.arrays import ARRAY_INDEX_KEY, ARRAY_JOB_KEY, ARRAY_NAME_KEY, JOB_NAME_KEY
from bridge.poller.attempt import LOST_JOBS_KEY
from bridge.poller.submit import prepare
from bridge.slurm import expand_array_range, parse_max_array_size, parse_sacct, parse_squeue
from bridge.store import Store
from bridge.system import metrics
from tests.fakes.slurm import FakeSlurm
from tests.unit.test_hpc_poller import LIMIT_REFUSALS
from tests.unit.test_poller import ECHO, FakeImages


def make_poller(tmp_path: Path, store: Store, **slurm: Any) -> tuple[Poller, FakeSlurm]:
    """A poller on the fake Slurm; one that gathers nothing unless `array_gather_seconds` is
    given (a round's ready tasks go at once: the gathering tests below drive its clock)."""
    slurm.setdefault("array_gather_seconds", 0)
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={f"slurm.{k}": v for k, v in slurm.items()},
    )
    fake = FakeSlurm()
    return Poller(config, store, slurm_client=fake, images=FakeImages()), fake


def with_cpus(cpus: int) -> dict[str, Any]:
    return {**ECHO, "resources": {"cpu_cores": cpus}}


def metadata(store: Store, task_id: str) -> dict[str, str]:
    task = store.get_task(task_id)
    assert task is not None and task.logs
    return task.logs[0]["metadata"]


# ----------------------------------------------------------------------------- grouping


def test_tasks_of_one_shape_go_as_one_array_in_manifest_order(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(6)]
    stats = poller.cycle()
    assert stats.submitted == 6
    assert fake.calls.count("sbatch") == 1 and fake.arrays == [6]
    for index, task in enumerate(tasks):
        record = sqlite_store.get_task(task.id)
        assert record.job_id == f"100_{index}"
        meta = metadata(sqlite_store, task.id)
        assert meta["slurm_job_id"] == f"100_{index}"
        assert meta[ARRAY_JOB_KEY] == "100"
        assert meta[ARRAY_INDEX_KEY] == str(index)
        assert meta[ARRAY_NAME_KEY].startswith("tes-array-")
    script = fake.scripts[0]
    dirs = [str(poller.task_dir(t.id)) for t in tasks]
    # The manifest lists the task directories in element order; each keeps its job script.
    assert script.index(dirs[0]) < script.index(dirs[1]) < script.index(dirs[5])
    assert "#SBATCH --output=/dev/null" in script
    assert f"#SBATCH --job-name={meta[ARRAY_NAME_KEY]}" in script
    assert not any(f"--job-name=tes-{t.id}" in script for t in tasks)
    assert "#SBATCH --chdir" not in script
    assert all((poller.task_dir(t.id) / "job.sh").is_file() for t in tasks)


def test_an_array_is_named_after_what_its_task_names_share(tmp_path, sqlite_store):
    """A scatter's tasks (`align (1)`, `align (2)`, ...) share the start of their names: the
    array's job name starts with it, where squeue and sacct show it; each task stores it."""
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task({**ECHO, "name": f"align ({i})"}) for i in range(4)]
    other = [sqlite_store.create_task({**with_cpus(2), "name": n}) for n in "abcd"]
    poller.cycle()
    assert fake.arrays == [4, 4]
    (named,) = {metadata(sqlite_store, t.id)[ARRAY_NAME_KEY] for t in tasks}
    assert named.startswith("align-tes-array-")
    assert fake.jobs["100_0"].name == named
    assert f"#SBATCH --job-name={named}\n" in fake.scripts[0]
    (unnamed,) = {metadata(sqlite_store, t.id)[ARRAY_NAME_KEY] for t in other}
    assert unnamed.startswith("tes-array-")
    assert JOB_NAME_KEY not in metadata(sqlite_store, tasks[0].id)


def test_each_shape_is_its_own_array_and_a_unique_shape_a_job_of_its_own(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store)
    ones = [sqlite_store.create_task(with_cpus(1)) for _ in range(4)]
    twos = [sqlite_store.create_task(with_cpus(2)) for _ in range(5)]
    lone = sqlite_store.create_task({**ECHO, "resources": {"ram_gb": 1}})
    poller.cycle()
    assert fake.arrays == [4, 5] and fake.calls.count("sbatch") == 3
    assert {sqlite_store.get_task(t.id).job_id.split("_")[0] for t in ones} == {"100"}
    assert {sqlite_store.get_task(t.id).job_id.split("_")[0] for t in twos} == {"101"}
    assert sqlite_store.get_task(lone.id).job_id == "102"
    assert ARRAY_NAME_KEY not in metadata(sqlite_store, lone.id)


def test_fewer_than_array_min_tasks_go_one_job_each(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store, array_min_tasks=4)
    for _ in range(3):
        sqlite_store.create_task(ECHO)
    poller.cycle()
    assert fake.calls.count("sbatch") == 3 and fake.arrays == []


def test_arrays_never_submits_one_job_per_task(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store, arrays="never")
    for _ in range(6):
        sqlite_store.create_task(ECHO)
    poller.cycle()
    assert fake.calls.count("sbatch") == 6 and fake.arrays == []
    assert "scontrol" not in fake.calls


def test_groups_larger_than_max_array_size_are_chunked(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store, array_min_tasks=2)
    fake.array_limit = 3
    for _ in range(7):
        sqlite_store.create_task(ECHO)
    poller.cycle()
    poller.cycle()
    # 3 + 3 as arrays, the seventh alone; MaxArraySize read once.
    assert fake.arrays == [3, 3] and fake.calls.count("sbatch") == 3
    assert fake.calls.count("scontrol") == 1


def test_admission_counts_elements(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store, max_jobs_in_flight=5)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(40)]
    poller.cycle()
    assert fake.arrays == [5]
    assert sum(1 for t in tasks if sqlite_store.get_task(t.id).job_id) == 5
    poller.cycle()
    assert fake.arrays == [5]  # nothing ended: no room


# ----------------------------------------------------------------------------- gathering


def clocked_poller(
    tmp_path: Path, store: Store, start: float | None = None
) -> tuple[Any, FakeSlurm, list[float]]:
    """A poller whose clock is `now[0]` (the time now unless `start`)."""
    poller, fake = make_poller(tmp_path, store, array_gather_seconds=1.0)
    now = [time.time() if start is None else start]
    poller.clock = lambda: now[0]
    return poller, fake, now


def burst(store: Store) -> tuple[list[Any], list[Any]]:
    """10 tasks of one shape, 2 of another, created just now."""
    return [store.create_task(with_cpus(1)) for _ in range(10)], [
        store.create_task(with_cpus(2)) for _ in range(2)
    ]


def test_a_burst_is_gathered_while_it_arrives_one_array_per_shape(tmp_path, sqlite_store):
    """Rounds during a burst submit nothing of a shape whose tasks keep arriving; once none has
    arrived for slurm.array_gather_seconds, each shape goes as one array, a shape too small
    for one as a job per task."""
    poller, fake, now = clocked_poller(tmp_path, sqlite_store)
    many, few = burst(sqlite_store)
    before = [sqlite_store.get_task(t.id) for t in many + few]
    counted = metrics.ARRAY_GATHER_HELD._value.get()
    assert poller.cycle().submitted == 0
    # Held: QUEUED exactly as they were (no mark, no system_logs line), counted.
    assert [sqlite_store.get_task(t.id) for t in many + few] == before
    assert before[0].state == State.QUEUED.value and before[0].submit_started_at is None
    assert metrics.ARRAY_GATHER_HELD._value.get() == counted + 12
    assert "sbatch" not in fake.calls
    # The burst goes on for 3 s (past the quiet time of 1 s, counted from the newest task).
    sent = 0
    for _ in range(6):
        now[0] += 0.5
        many += [sqlite_store.create_task(with_cpus(1)) for _ in range(4)]
        sent += poller.cycle().submitted
    # The 2-CPU shape has been quiet since the start: it went once 1 s had passed.
    assert sent == 2 and fake.calls.count("sbatch") == 2 and fake.arrays == []
    assert [sqlite_store.get_task(t.id).job_id for t in few] == ["100", "101"]
    now[0] += 1.0
    assert poller.cycle().submitted == 34
    assert fake.arrays == [34] and fake.calls.count("sbatch") == 3
    assert {sqlite_store.get_task(t.id).job_id.partition("_")[0] for t in many} == {"102"}


def test_a_burst_that_goes_on_is_submitted_after_the_longest_gathering(tmp_path, sqlite_store):
    """A shape whose tasks never stop arriving goes when its oldest task has waited
    slurm.array_gather_max_seconds (5): one array, and the next ones gather afresh."""
    poller, fake, now = clocked_poller(tmp_path, sqlite_store)
    first = [sqlite_store.create_task(with_cpus(1)) for _ in range(5)]
    poller.cycle()
    sent = 0
    for _ in range(10):  # 5 tasks every 0.5 s: never 1 s quiet
        now[0] += 0.5
        first += [sqlite_store.create_task(with_cpus(1)) for _ in range(5)]
        sent += poller.cycle().submitted
    assert fake.arrays == [55] and sent == 55
    assert all(sqlite_store.get_task(t.id).job_id for t in first)
    later = [sqlite_store.create_task(with_cpus(1)) for _ in range(5)]
    assert poller.cycle().submitted == 0
    assert not any(sqlite_store.get_task(t.id).job_id for t in later)


def count_task_dir_writes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times each task's directory and job script are written (by task id)."""
    writes: Counter[str] = Counter()
    real = prepare.prepare_task_dir

    def counted(document: dict[str, Any], **kwargs: Any) -> Path:
        writes[document["id"]] += 1
        return real(document, **kwargs)

    monkeypatch.setattr(prepare, "prepare_task_dir", counted)
    return writes


def test_tasks_held_to_gather_are_written_once_unless_their_images_changed(
    tmp_path, sqlite_store, monkeypatch
):
    """A task held for several rounds keeps the directory and script its first round wrote
    (a burst's tasks are held while more arrive: writing them each round cost the poller most
    of its time); one whose image resolves to another SIF meanwhile is written again."""
    writes = count_task_dir_writes(monkeypatch)
    poller, _, now = clocked_poller(tmp_path, sqlite_store)
    many, _ = burst(sqlite_store)
    assert poller.cycle().submitted == 0
    now[0] += 0.5
    assert poller.cycle().submitted == 0
    assert set(writes.values()) == {1} and len(writes) == 12
    images = poller.submitter.images
    assert isinstance(images, FakeImages)
    monkeypatch.setattr(images, "resolve", lambda names: {n: f"/new/{n}.sif" for n in names})
    now[0] += 0.2
    assert poller.cycle().submitted == 0
    assert set(writes.values()) == {2}
    now[0] += 1.0
    assert poller.cycle().submitted == 12
    assert set(writes.values()) == {2}
    script = (tmp_path / "state" / "work" / many[0].id / "job.sh").read_text()
    assert "/new/alpine.sif" in script


def test_tasks_the_budget_did_not_reach_are_written_once(tmp_path, sqlite_store, monkeypatch):
    """A round prepares up to 500 tasks; under a budget of a few sbatches a cycle the ones it
    did not reach wait for the next rounds as they were written, not written again each round
    (800 tasks at 20 sbatches a second rewrote tens of thousands of directories, and starved
    the follow of its squeue under load)."""
    from bridge.system.budget import CallBudget

    writes = count_task_dir_writes(monkeypatch)
    poller, fake = make_poller(tmp_path, sqlite_store, arrays="never")
    now = [1000.0]
    fake.budget = CallBudget(
        2.0, 6, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    tasks = [sqlite_store.create_task(ECHO) for _ in range(12)]
    submitted = poller.cycle().submitted
    assert 0 < submitted < 12 and len(writes) == 12
    rounds = 1
    while not all(sqlite_store.get_task(t.id).job_id for t in tasks):
        now[0] += 5.0  # the budget fills again
        poller.cycle()
        rounds += 1
        assert rounds < 30
    assert set(writes.values()) == {1}


def test_a_held_shape_that_grows_goes_as_an_array(tmp_path, sqlite_store):
    poller, fake, now = clocked_poller(tmp_path, sqlite_store)
    _, few = burst(sqlite_store)
    poller.cycle()
    few += [sqlite_store.create_task(with_cpus(2)) for _ in range(2)]
    now[0] += 0.3
    poller.cycle()
    assert fake.arrays == []
    now[0] += 1.0
    poller.cycle()
    assert sorted(fake.arrays) == [4, 10] and fake.calls.count("sbatch") == 2
    assert len({sqlite_store.get_task(t.id).job_id.partition("_")[0] for t in few}) == 1


def test_the_quick_check_submits_when_the_window_ends(tmp_path, sqlite_store):
    poller, fake, now = clocked_poller(tmp_path, sqlite_store)
    many, few = burst(sqlite_store)
    poller.cycle()
    assert poller.quick_check() is None  # nothing new, the window still open
    now[0] += 1.0
    assert poller.quick_check() == "submit"  # not a poll interval later
    assert poller.submit_new().submitted == 12
    assert all(sqlite_store.get_task(t.id).job_id for t in many + few)
    assert fake.arrays == [10] and fake.calls.count("sbatch") == 3
    assert poller.quick_check() is None


def test_a_full_array_goes_at_once(tmp_path, sqlite_store):
    poller, fake, _now = clocked_poller(tmp_path, sqlite_store)
    fake.array_limit = 8
    tasks = [sqlite_store.create_task(with_cpus(1)) for _ in range(10)]
    assert poller.cycle().submitted == 8  # the 2 left wait for more of their shape
    assert fake.arrays == [8]
    assert [bool(sqlite_store.get_task(t.id).job_id) for t in tasks] == [True] * 8 + [False] * 2


def test_a_hold_ends_even_when_tasks_seem_created_in_the_future(tmp_path, sqlite_store):
    # The poller's clock an hour behind the API's.
    poller, fake, now = clocked_poller(tmp_path, sqlite_store, start=time.time() - 3600)
    many, few = burst(sqlite_store)
    poller.cycle()
    assert "sbatch" not in fake.calls
    now[0] += 1.5
    poller.cycle()
    assert fake.calls.count("sbatch") == 3 and fake.arrays == [10]
    assert all(sqlite_store.get_task(t.id).job_id for t in many + few)


def test_a_lone_task_or_a_handful_is_never_held(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store, array_gather_seconds=60)
    lone = sqlite_store.create_task(ECHO)
    assert poller.cycle().submitted == 1
    assert sqlite_store.get_task(lone.id).job_id == "100"
    # Fewer than array_min_tasks in the round, each of its own shape: no burst, none held.
    handful = [sqlite_store.create_task(with_cpus(n)) for n in (1, 2, 3)]
    assert poller.cycle().submitted == 3
    assert all(sqlite_store.get_task(t.id).job_id for t in handful)
    assert fake.arrays == []


def test_array_gather_seconds_0_holds_nothing(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store, array_gather_seconds=0)
    _, few = burst(sqlite_store)
    assert poller.cycle().submitted == 12
    assert fake.arrays == [10] and fake.calls.count("sbatch") == 3
    assert [sqlite_store.get_task(t.id).job_id for t in few] == ["101", "102"]


# ----------------------------------------------------------------------------- per element


def test_one_element_is_canceled_alone(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(5)]
    poller.cycle()
    sqlite_store.cancel_task(tasks[2].id)
    poller.cycle()
    assert fake.jobs["100_2"].state == "CANCELLED"
    assert [j for j, info in fake.jobs.items() if info.state == "CANCELLED"] == ["100_2"]
    assert sqlite_store.get_task(tasks[2].id).state == "CANCELED"
    assert sqlite_store.get_task(tasks[1].id).state != "CANCELED"


def test_elements_canceled_while_the_array_sbatch_ran_are_scanceled_at_once(tmp_path, sqlite_store):
    """The members are recorded in one transaction; the elements of tasks canceled while
    sbatch ran (the API saw no job) are scanceled right after it, the others left alone."""
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(5)]
    submit = fake.submit

    def submit_while_two_are_canceled(*args: Any, **kwargs: Any) -> str:
        for task in tasks[1:3]:
            sqlite_store.update_task(task.id, state="CANCELED", cancel_pending=False)
        return submit(*args, **kwargs)

    fake.submit = submit_while_two_are_canceled  # type: ignore[method-assign]
    assert poller.cycle().submitted == 5 and fake.arrays == [5]
    records = [sqlite_store.get_task(t.id) for t in tasks]
    states = [fake.jobs[r.job_id].state for r in records]
    assert [r.state for r in records[1:3]] == ["CANCELED", "CANCELED"]
    assert states[1:3] == ["CANCELLED", "CANCELLED"]
    assert "CANCELLED" not in states[:1] + states[3:]
    assert not any(r.cancel_pending for r in records)
    assert fake.calls.index("scancel") == fake.calls.index("sbatch") + 1


def test_a_lost_element_is_submitted_again_alone(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(5)]
    poller.cycle()
    fake.jobs["100_3"] = replace(fake.jobs["100_3"], state="NODE_FAIL", node="n1")
    poller.cycle()  # notices the loss
    poller.cycle()  # submits again
    again = sqlite_store.get_task(tasks[3].id)
    assert again.attempt == 2 and again.job_id == "101"
    assert fake.arrays == [5] and fake.calls.count("sbatch") == 2
    meta = metadata(sqlite_store, tasks[3].id)
    # Its array marks went with the lost job: recovery would look for `tes-<id>` now.
    assert ARRAY_NAME_KEY not in meta and ARRAY_JOB_KEY not in meta
    assert meta[LOST_JOBS_KEY] == "100_3"
    others = [sqlite_store.get_task(t.id).job_id for i, t in enumerate(tasks) if i != 3]
    assert others == ["100_0", "100_1", "100_2", "100_4"]


# ----------------------------------------------------------------------------- crash window


def test_interrupted_array_is_recovered_by_name_once_per_task(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(5)]
    fake.create_then_fail = True  # the array exists, its id never reached the poller
    poller.cycle()
    fake.create_then_fail = False
    for task in tasks:
        record = sqlite_store.get_task(task.id)
        assert record.job_id is None and record.submit_started_at is not None
    poller.clock = lambda: 1e12  # the settle time and any back-off have passed
    poller.cycle()
    poller.cycle()
    assert fake.calls.count("sbatch") == 1
    for index, task in enumerate(tasks):
        record = sqlite_store.get_task(task.id)
        assert record.job_id == f"100_{index}"
        assert metadata(sqlite_store, task.id)[ARRAY_JOB_KEY] == "100"


def test_interrupted_array_that_never_existed_is_submitted_again(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(5)]
    poller.cycle()
    # As if the poller died before sbatch ran: the marks are stored, no job exists.
    for task in tasks:
        sqlite_store.update_task(task.id, job_id=None, submit_started_at=1.0)
    fake.jobs.clear()
    poller.clock = lambda: 1e12
    poller.cycle()  # recovery forgets the submissions
    poller.cycle()  # submitted again, as a new array
    assert fake.calls.count("sbatch") == 2 and fake.arrays == [5, 5]
    assert all(sqlite_store.get_task(t.id).job_id.startswith("101_") for t in tasks)


def test_an_array_sbatch_refused_fails_every_member(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(4)]
    fake.sbatch_error = "sbatch: error: Batch job submission failed: Invalid account specified"
    poller.cycle()
    for task in tasks:
        assert sqlite_store.get_task(task.id).state == State.SYSTEM_ERROR.value


def test_unreachable_slurm_pauses_once_for_the_whole_array(tmp_path, sqlite_store):
    poller, fake = make_poller(tmp_path, sqlite_store)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(4)]
    poller.cycle()  # reads MaxArraySize
    fake.jobs.clear()
    for task in tasks:
        sqlite_store.update_task(task.id, job_id=None, state="QUEUED", logs=None, attempt=0)
    fake.unavailable = True
    poller.cycle()
    assert poller.submitter.backoff.failures == 1


# ----------------------------------------------------------------------------- the scripts


def test_array_script_runs_its_elements_job_script_with_its_id(tmp_path):
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    dirs = []
    for name, code in (("a", 0), ("b b", 0), ("c'c", 42)):
        task_dir = tmp_path / name
        task_dir.mkdir()
        job = task_dir / "job.sh"
        job.write_text(f'#!/bin/bash\necho "$1 $(pwd)" > ran\necho out\nexit {code}\n')
        job.chmod(0o700)
        dirs.append(task_dir)
    script = tmp_path / "array.sh"
    script.write_text(
        render_array_script(config=config, shared=["--cpus-per-task=1"], task_dirs=dirs)
    )
    assert read_directives(script) == ["--cpus-per-task=1", "--output=/dev/null"]
    for index in (1, 2):
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(index), "SLURM_ARRAY_JOB_ID": "77"}
        # The element ends as its task's job script does (sacct: the element FAILED 42:0).
        ran = subprocess.run(["bash", str(script)], env=env)
        assert ran.returncode == (42 if index == 2 else 0)
        assert (dirs[index] / "ran").read_text() == f"77_{index} {dirs[index]}\n"
        assert (dirs[index] / f"slurm-77_{index}.out").read_text() == "out\n"
    assert not (dirs[0] / "ran").exists()
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_JOB_ID": "77"}
    assert subprocess.run(["bash", str(script)], env=env).returncode == 2


def test_an_element_that_cannot_make_its_output_file_exits_as_one_that_cannot_record(tmp_path):
    """On a full work filesystem the element's output file cannot be made: the element exits
    with NO_RECORDS_EXIT_CODE (the poller submits the task again), never 1 (a failure; seen in
    the nemesis run as "FAILED 1:0 without recording an outcome"). A directory in the output
    file's place stands in for the full filesystem (root may write anywhere else)."""
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    task_dir = tmp_path / "a"
    task_dir.mkdir()
    job = task_dir / "job.sh"
    job.write_text("#!/bin/bash\ntouch ran\n")
    job.chmod(0o700)
    (task_dir / "slurm-77_0.out").mkdir()
    script = tmp_path / "array.sh"
    script.write_text(render_array_script(config=config, shared=[], task_dirs=[task_dir]))
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_JOB_ID": "77"}
    assert subprocess.run(["bash", str(script)], env=env).returncode == NO_RECORDS_EXIT_CODE
    assert not (task_dir / "ran").exists()


def test_shape_leaves_out_what_is_each_tasks_own():
    directives = ["--job-name=tes-x", "--output=/w/x/slurm-%j.out", "--chdir=/w/x", "--mem=10"]
    assert shape(directives) == ("--mem=10",)


# ----------------------------------------------------------------------------- parsing


def test_array_ranges_expand_to_elements():
    assert expand_array_range("123_[4-6,9]") == ["123_4", "123_5", "123_6", "123_9"]
    assert expand_array_range("123_[0-2%1]") == ["123_0", "123_1", "123_2"]
    assert expand_array_range("123_4") == ["123_4"]
    assert expand_array_range("123") == ["123"]


def test_sacct_array_lines_by_element_and_pending_range():
    # sacct --name on Slurm 22.05: started elements one line each, the pending ones as a range.
    text = (
        "1691_0|tes-array-a|COMPLETED|0:0||node1|main|2026-11-25T20:40:00|"
        "2026-11-25T20:40:05|5||\n"
        "1691_0.batch|batch|COMPLETED|0:0||node1||2026-11-25T20:40:00|2026-11-25T20:40:05|5|1024K|\n"
        "1691_[1-3]|tes-array-a|PENDING|0:0|Priority|None assigned|main|Unknown|Unknown|0||\n"
    )
    jobs = parse_sacct(text)
    assert sorted(jobs) == ["1691_0", "1691_1", "1691_2", "1691_3"]
    assert jobs["1691_0"].state == "COMPLETED" and jobs["1691_0"].max_rss_bytes == 1024 * 1024
    assert jobs["1691_2"].state == "PENDING" and jobs["1691_2"].name == "tes-array-a"


def test_squeue_elements():
    text = (
        "1691_4|tes-array-a|PENDING|Priority|||N/A|N/A|0:00|(null)\n"
        "1691_0|tes-array-a|RUNNING|None|node1|main|2026-11-25T20:40:00|N/A|0:03|(null)\n"
    )
    jobs = parse_squeue(text)
    assert jobs["1691_4"].state == "PENDING" and jobs["1691_0"].node == "node1"


@pytest.mark.parametrize(("text", "size"), [("MaxArraySize            = 1001\n", 1001)])
def test_max_array_size(text, size):
    assert parse_max_array_size("AccountingStorageType = x\n" + text + "MaxJobCount = 1\n") == size
    with pytest.raises(ValueError):
        parse_max_array_size("MaxJobCount = 1\n")


def test_an_array_refused_for_a_submit_limit_is_split_down_to_single_jobs(tmp_path, sqlite_store):
    # A QOS's MaxSubmitJobsPerUser counts each element: an array larger than the limit would be
    # refused for ever.
    poller, fake = make_poller(tmp_path, sqlite_store, array_min_tasks=2)
    tasks = [sqlite_store.create_task(ECHO) for _ in range(8)]
    fake.sbatch_error = LIMIT_REFUSALS[0]
    poller.cycle()
    assert fake.calls.count("sbatch") == 1
    fake.sbatch_error = None
    poller.clock = lambda: 1e12
    poller.cycle()
    assert fake.arrays == [4, 4]
    assert all(sqlite_store.get_task(t.id).job_id for t in tasks)
