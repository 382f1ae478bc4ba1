"""Staging on the transfer partition (staging.where = "transfer"): the configuration, the three
job scripts, and the poller's chain of three jobs with the fake Slurm (submission, the one TES
state machine, cancel, a failed stage-in, a lost job, a crash between the sbatches).

The same chain runs against the real cluster in tests/cluster/test_transfer.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config, ConfigError, load_config
from bridge.core.naming import STAGE_IN_EXIT_CODE
from bridge.job.records import read_records
from bridge.jobscript.parts import remote_urls, staged_apart
from bridge.jobscript.render import prepare_task_dir, task_files
from bridge.jobscript.task import parse_task
from bridge.poller import Poller, job_name
from bridge.store import Store
from tests.fakes.slurm import FakeSlurm

REMOTE = {
    "name": "fetch",
    "executors": [{"image": "alpine", "command": ["wc", "-c", "/in/a"]}],
    "inputs": [{"url": "https://example.org/a", "path": "/in/a"}],
    "outputs": [{"url": "s3://bucket/out", "path": "/out/x"}],
}
LOCAL = {
    "executors": [{"image": "alpine", "command": ["true"]}],
    "inputs": [{"content": "hi", "path": "/in/a"}],
}
TRANSFER = {"staging.where": "transfer", "staging.transfer_partition": "xfer"}


class FakeImages:
    def resolve(self, images) -> dict[str, str]:
        return {image: f"/cache/{image}.sif" for image in images}

    def problem(self, image: str) -> str | None:
        return None

    def prune(self, oldest_unfinished: float | None) -> None:
        pass


def make_poller(tmp_path: Path, store: Store, **overrides: Any) -> tuple[Poller, FakeSlurm]:
    """A poller of a site that stages on the transfer partition, on the fake Slurm."""
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"slurm.array_gather_seconds": 0, **TRANSFER, **overrides},
    )
    slurm = FakeSlurm()
    return Poller(config, store, slurm_client=slurm, images=FakeImages()), slurm


@pytest.fixture
def env(tmp_path: Path, sqlite_store: Store):
    poller, slurm = make_poller(tmp_path, sqlite_store)
    return poller, sqlite_store, slurm


def metadata(store: Store, task_id: str) -> dict[str, str]:
    record = store.get_task(task_id)
    assert record is not None and record.logs
    return record.logs[-1]["metadata"]


def set_job(slurm: FakeSlurm, job_id: str, state: str, **fields) -> None:
    slurm.jobs[job_id] = replace(slurm.jobs[job_id], state=state, **{"reason": None, **fields})


def write_records(poller: Poller, task_id: str, job_id: str, **files: str) -> None:
    records = poller.task_dir(task_id) / "records" / job_id
    records.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (records / name).write_text(text + "\n")


def state(store: Store, task_id: str) -> str:
    record = store.get_task(task_id)
    assert record is not None
    return record.state


# ----------------------------------------------------------------------------- configuration


def test_transfer_needs_a_partition_or_qos_and_says_which_setting(tmp_path):
    with pytest.raises(ConfigError, match="transfer_partition or transfer_qos"):
        load_config(
            environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
            overrides={"staging.where": "transfer"},
        )
    with pytest.raises(ConfigError, match="transfer_partition"):
        load_config(
            environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
            overrides={**TRANSFER, "staging.transfer_partition": "x y\n"},
        )
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
        overrides={"staging.where": "transfer", "staging.transfer_qos": "dtn"},
    )
    assert config.staging.transfer_qos == "dtn"
    # The job side's settings carry none of it.
    assert "where" not in config.staging.job_options()


# ----------------------------------------------------------------------------- the scripts


def test_only_tasks_with_remote_inputs_or_outputs_are_staged_apart(tmp_path):
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)}, overrides=TRANSFER)
    remote = parse_task({**REMOTE, "id": "t1"})
    assert remote_urls(remote) == ["inputs[0].url", "outputs[0].url"]
    assert staged_apart(remote, config)
    shared = {**LOCAL, "outputs": [{"url": f"file://{tmp_path}/o", "path": "/o"}], "id": "t2"}
    assert not staged_apart(parse_task(shared), config)
    job_mode = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)})
    assert not staged_apart(remote, job_mode)


def test_a_staged_task_has_three_scripts_its_transfer_jobs_on_the_transfer_partition(tmp_path):
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
        overrides={**TRANSFER, "staging.transfer_time_limit": "30:00"},
    )
    document = {
        **REMOTE,
        "id": "t1",
        "resources": {"cpu_cores": 4, "backend_parameters": {"account": "lab"}},
    }
    files = task_files(document, config=config, image_paths={"alpine": "/cache/a.sif"})
    scripts = {n: t for n, t in files.items() if n.endswith(".sh")}
    assert sorted(scripts) == ["job-stage-in.sh", "job-stage-out.sh", "job.sh"]
    for name, text in scripts.items():
        path = tmp_path / name
        path.write_text(text)
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, name
    stage_in = [x for x in scripts["job-stage-in.sh"].splitlines() if x.startswith("#SBATCH")]
    assert "#SBATCH --partition=xfer" in stage_in
    assert "#SBATCH --cpus-per-task=1" in stage_in and "#SBATCH --time=30:00" in stage_in
    assert "#SBATCH --account=lab" in stage_in
    assert "#SBATCH --job-name=fetch-tes-t1-stage-in" in stage_in
    # A stage-out waiting beside stage-ins goes first (staging.stage_in_nice).
    assert "#SBATCH --nice=10" in stage_in
    assert "--nice" not in scripts["job-stage-out.sh"] + scripts["job.sh"]
    # The task's own job keeps its resources and runs no stage-in of its own.
    assert "#SBATCH --cpus-per-task=4" in scripts["job.sh"]
    assert "--partition=xfer" not in scripts["job.sh"]
    assert "-m bridge.job stage-in" in scripts["job-stage-in.sh"]
    assert "-m bridge.job stage-in" not in scripts["job.sh"]
    assert "-m bridge.job stage-out" in scripts["job-stage-out.sh"]
    # Runtime and images are checked by the task's job, not on the transfer node.
    assert json.loads(files["job-config.json"])["check_runtime"] is False


def test_stage_in_nice_zero_gives_the_stage_in_no_nice(tmp_path):
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
        overrides={**TRANSFER, "staging.stage_in_nice": 0},
    )
    files = task_files({**REMOTE, "id": "t1"}, config=config, image_paths={"alpine": "/a.sif"})
    assert "--nice" not in files["job-stage-in.sh"]
    with pytest.raises(ConfigError, match="stage_in_nice"):
        load_config(
            environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
            overrides={**TRANSFER, "staging.stage_in_nice": -1},
        )


# ----------------------------------------------------------------------------- the poller


def test_a_staged_task_is_three_jobs_chained_by_dependency(env):
    poller, store, slurm = env
    task = store.create_task(REMOTE)
    poller.cycle()
    assert slurm.calls.count("sbatch") == 3
    stage_in, run, stage_out = "100", "101", "102"
    name = job_name(task.id, "fetch")
    assert [slurm.jobs[j].name for j in (stage_in, run, stage_out)] == [
        f"{name}-stage-in",
        name,
        f"{name}-stage-out",
    ]
    assert slurm.extra_args[0] == []
    assert slurm.extra_args[1] == [f"--dependency=afterok:{stage_in}", "--kill-on-invalid-dep=yes"]
    assert slurm.extra_args[2] == [f"--dependency=afterok:{run}", "--kill-on-invalid-dep=yes"]
    assert f"after={stage_in}" in slurm.script_args[1]
    assert f"after={run}" in slurm.script_args[2]
    record = store.get_task(task.id)
    assert record.job_id == run
    meta = metadata(store, task.id)
    assert meta["slurm_job_id"] == run and meta["slurm_staging"] == "transfer"
    assert meta["slurm_stage_in_job_id"] == stage_in
    assert meta["slurm_stage_out_job_id"] == stage_out


def test_a_task_with_only_shared_files_stays_one_job(env):
    poller, store, slurm = env
    store.create_task(LOCAL)
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1
    assert slurm.extra_args == [[]]


def test_the_chain_is_one_tes_state_machine(env):
    poller, store, slurm = env
    task = store.create_task(REMOTE)
    poller.cycle()
    stage_in, run, stage_out = "100", "101", "102"
    assert state(store, task.id) == "QUEUED"
    set_job(slurm, stage_in, "RUNNING", partition="xfer", node="dtn1")
    write_records(poller, task.id, stage_in, phase="staging", start_time="2026-01-01T00:00:00Z")
    poller.cycle()
    assert state(store, task.id) == "INITIALIZING"
    # Inputs staged, the task's job waits for its nodes: still initializing, saying why.
    set_job(slurm, stage_in, "COMPLETED", exit_code=0, partition="xfer", node="dtn1")
    slurm.jobs[run] = replace(slurm.jobs[run], reason="Resources")
    poller.cycle()
    assert state(store, task.id) == "INITIALIZING"
    lines = store.get_task(task.id).logs[0]["system_logs"]
    assert f"Slurm job {run} is pending (Resources)" in lines
    meta = metadata(store, task.id)
    assert meta["slurm_stage_in_state"] == "COMPLETED"
    assert meta["slurm_stage_in_partition"] == "xfer" and meta["slurm_stage_in_node"] == "dtn1"
    assert meta["slurm_job_id"] == run and "slurm_state" not in meta
    set_job(slurm, run, "RUNNING", node="n1")
    write_records(poller, task.id, run, phase="running 0")
    poller.cycle()
    assert state(store, task.id) == "RUNNING"
    assert metadata(store, task.id)["slurm_state"] == "RUNNING"
    # The executors ended; the stage-out job waits for a transfer node: still running.
    set_job(slurm, run, "COMPLETED", exit_code=0, node="n1")
    write_records(poller, task.id, run, phase="ran", executors_failed="0")
    poller.cycle()
    assert state(store, task.id) == "RUNNING"
    set_job(slurm, stage_out, "RUNNING", partition="xfer", node="dtn1")
    write_records(poller, task.id, run, phase="uploading")
    poller.cycle()
    assert state(store, task.id) == "RUNNING"
    set_job(slurm, stage_out, "COMPLETED", exit_code=0, partition="xfer", node="dtn1")
    write_records(poller, task.id, run, phase="done", outcome="complete")
    poller.cycle()
    assert state(store, task.id) == "COMPLETE"
    meta = metadata(store, task.id)
    assert meta["slurm_state"] == "COMPLETED" and meta["slurm_node"] == "n1"
    assert meta["slurm_stage_out_state"] == "COMPLETED"
    assert meta["slurm_stage_out_partition"] == "xfer"
    assert "scancel" not in slurm.calls


def test_a_failed_stage_in_ends_the_task_and_its_later_jobs_never_run(env):
    poller, store, slurm = env
    task = store.create_task(REMOTE)
    poller.cycle()
    stage_in, run, stage_out = "100", "101", "102"
    set_job(slurm, stage_in, "FAILED", exit_code=STAGE_IN_EXIT_CODE)
    write_records(
        poller,
        task.id,
        stage_in,
        phase="done",
        outcome="system_error",
        **{"system_logs.jsonl": json.dumps({"time": "t", "message": "input 0: 404 Not Found"})},
    )
    poller.cycle()
    record = store.get_task(task.id)
    assert record.state == "SYSTEM_ERROR"
    assert "input 0: 404 Not Found" in record.logs[0]["system_logs"]
    assert metadata(store, task.id)["slurm_stage_in_exit_code"] == str(STAGE_IN_EXIT_CODE)
    # Slurm would cancel them for their dependency; the poller does at once.
    assert slurm.calls.count("scancel") == 1
    assert slurm.jobs[run].state == slurm.jobs[stage_out].state == "CANCELLED"


def test_cancel_during_stage_in_cancels_every_job_of_the_chain(env):
    poller, store, slurm = env
    task = store.create_task(REMOTE)
    poller.cycle()
    set_job(slurm, "100", "RUNNING")
    poller.cycle()
    store.cancel_task(task.id)
    poller.cycle()
    assert {slurm.jobs[j].state for j in ("100", "101", "102")} == {"CANCELLED"}
    assert state(store, task.id) == "CANCELED"


def test_a_lost_stage_in_job_submits_the_whole_chain_again(env):
    poller, store, slurm = env
    task = store.create_task(REMOTE)
    poller.cycle()
    set_job(slurm, "100", "NODE_FAIL", exit_code=0)
    poller.cycle()
    assert state(store, task.id) == "QUEUED"
    poller.cycle()
    assert slurm.calls.count("sbatch") == 6
    meta = metadata(store, task.id)
    assert meta["slurm_lost_job_ids"] == "100,101,102"
    assert meta["slurm_stage_in_job_id"] == "103" and meta["slurm_job_id"] == "104"
    # The lost chain's later jobs were canceled, as Slurm would for their dependency.
    assert slurm.jobs["101"].state == "CANCELLED"


def test_a_crash_between_the_sbatches_submits_only_the_missing_jobs(env):
    """What a poller killed after the stage-in job's sbatch leaves: that job, its id stored,
    and no other. Recovery finds it by name, fences the task, and submits the other two."""
    poller, store, slurm = env
    task = store.create_task(REMOTE)
    real_submit = slurm.submit
    submitted = []

    def crash_after_first(*args, **kwargs):
        if submitted:
            raise KeyboardInterrupt  # the poller dies here
        submitted.append(real_submit(*args, **kwargs))
        return submitted[-1]

    slurm.submit = crash_after_first
    with pytest.raises(KeyboardInterrupt):
        poller.cycle()
    slurm.submit = real_submit
    slurm.calls.clear()
    record = store.get_task(task.id)
    assert record.job_id is None and record.submit_started_at is not None
    assert metadata(store, task.id)["slurm_stage_in_job_id"] == "100"
    poller.clock = lambda: record.submit_started_at + 1000  # the sbatch has settled
    poller.cycle()  # the task's job not found: that part alone is fenced
    assert slurm.calls.count("sbatch") == 0
    task_dir = poller.task_dir(task.id)
    assert (task_dir / "lease-fence-run").is_file() and not (task_dir / "lease-fence").exists()
    poller.cycle()  # still none: the two missing jobs are submitted, the stage-in kept
    assert slurm.calls.count("sbatch") == 2
    record = store.get_task(task.id)
    meta = metadata(store, task.id)
    assert meta["slurm_stage_in_job_id"] == "100"
    assert record.job_id == meta["slurm_job_id"] == "101"
    assert meta["slurm_stage_out_job_id"] == "102"
    assert slurm.extra_args[-2] == ["--dependency=afterok:100", "--kill-on-invalid-dep=yes"]


def test_a_crash_after_the_last_sbatch_adopts_the_chain(env):
    poller, store, slurm = env
    task = store.create_task(REMOTE)
    poller.cycle()
    # As if the job id had never been stored: the chain is found whole by name.
    store.update_task(task.id, job_id=None, submit_started_at=1.0)
    calls = len(slurm.calls)
    poller.cycle()
    assert "sbatch" not in slurm.calls[calls:]
    assert store.get_task(task.id).job_id == "101"


# ----------------------------------------------------------------------------- task logs


def test_task_logs_names_the_three_jobs_of_a_staged_task():
    import io

    from bridge.client.watch import LogPrinter

    metadata = {
        "slurm_stage_in_job_id": "41",
        "slurm_stage_in_state": "COMPLETED",
        "slurm_stage_in_exit_code": "0",
        "slurm_stage_in_partition": "xfer",
        "slurm_job_id": "42",
        "slurm_state": "RUNNING",
        "slurm_partition": "offline",
        "slurm_stage_out_job_id": "43",
    }
    out, err = io.StringIO(), io.StringIO()
    printer = LogPrinter(out, err)
    printer.show({"id": "t", "executors": [{}], "logs": [{"logs": [], "metadata": metadata}]})
    assert err.getvalue().splitlines() == [
        "job: stage-in job 41: COMPLETED, exit code 0, partition xfer",
        "job: task job 42: RUNNING, partition offline",
        "job: stage-out job 43: submitted",
    ]
    # Printed again only when it changes; a task of one job has no such lines.
    printer.show({"id": "t", "executors": [{}], "logs": [{"logs": [], "metadata": metadata}]})
    assert len(err.getvalue().splitlines()) == 3
    plain = io.StringIO()
    LogPrinter(io.StringIO(), plain).show({"logs": [{"metadata": {"slurm_job_id": "7"}}]})
    assert plain.getvalue() == ""


# ----------------------------------------------------------------------------- the parts run


def staged_task_dir(
    storage_servers: Any, tmp_path: Path, name: str, out_url: str, shell: str
) -> tuple[Config, Path]:
    """A staged task prepared for the job side: an HTTP input `<name>/in.txt` ("hello") at
    /in/a, an output /out/b to `out_url`, and an executor running `shell` through a stand-in
    runtime, which runs it on the host: `{root}` in it is the host path of the task's root."""
    from tests.unit.test_job_side import stand_in_runtime

    storage_servers.put("http", f"{name}/in.txt", b"hello\n")
    runtime, image = stand_in_runtime(tmp_path)
    config = Config.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "container": {"runtime": str(runtime), "allow_root": True},
            "job": {"python": sys.executable},
            "staging": {
                **storage_servers.staging_options(),
                "where": "transfer",
                "transfer_partition": "xfer",
            },
        }
    )
    root = config.work_dir / "job-1" / "root"
    task = {
        "id": "job-1",
        "inputs": [{"url": storage_servers.url_for("http", f"{name}/in.txt"), "path": "/in/a"}],
        "outputs": [{"url": out_url, "path": "/out/b"}],
        "executors": [{"image": "img", "command": ["sh", "-c", shell.format(root=root)]}],
    }
    task_dir = prepare_task_dir(task, config=config, image_paths={"img": str(image)}).parent
    return config, task_dir


def test_the_three_parts_run_in_turn_as_one_job_does(storage_servers, tmp_path):
    """The three scripts run one after another (as Slurm's afterok chain runs them), with the
    job side's real staging against loopback servers and a stand-in runtime: the stage-in
    downloads, the task's job runs the executor and ends 0 though it failed, the stage-out
    uploads all the same and ends as the task did, and the records are one job's."""
    from tests.unit.test_job_side import REPO

    out_url = storage_servers.url_for("http", "parts/out.txt")
    _, task_dir = staged_task_dir(
        storage_servers, tmp_path, "parts", out_url, "tr a-z A-Z <{root}/in/a >{root}/out/b; exit 3"
    )

    def run(name: str, job_id: str, *args: str) -> int:
        env = dict(os.environ, SLURM_JOB_ID=job_id, PYTHONPATH=str(REPO))
        result = subprocess.run(
            ["bash", str(task_dir / name), *args], env=env, capture_output=True, timeout=60
        )
        return result.returncode

    assert run("job-stage-in.sh", "7") == 0
    assert read_records(task_dir, "7", keep_bytes=1024).phase == "staged"
    assert run("job.sh", "8", "after=7") == 0  # the executor's failure is the stage-out's to tell
    middle = read_records(task_dir, "8", keep_bytes=1024)
    assert middle.phase == "ran" and middle.outcome is None
    assert [e.exit_code for e in middle.executors] == [3]
    assert run("job-stage-out.sh", "9", "after=8") == 3  # as the task ended: sacct shows it
    records = read_records(task_dir, "8", keep_bytes=1024)
    assert records.outcome == "executor_error" and records.phase == "done"
    assert [o["url"] for o in records.outputs] == [out_url]
    assert storage_servers.server_path("http", "parts/out.txt").read_bytes() == b"HELLO\n"
    # The stage-in's start is the attempt's; a part run again after its end does nothing.
    assert records.start_time == read_records(task_dir, "7", keep_bytes=1024).start_time
    assert run("job-stage-out.sh", "9", "after=8") == 0


def test_a_chain_goes_only_when_the_budget_holds_its_three_sbatches(env):
    """The call budget keeps BUDGET_RESERVE tokens for the cycle's squeue, sacct and scancel:
    a staged task needs three sbatches' worth above them, a task of one job one."""
    from bridge.system.budget import CallBudget

    poller, store, slurm = env
    staged = store.create_task(REMOTE)
    now = [1000.0]
    slurm.budget = CallBudget(
        0.001, 6, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    poller.cycle()
    assert "sbatch" not in slurm.calls
    assert state(store, staged.id) == "QUEUED" and store.get_task(staged.id).job_id is None
    store.cancel_task(staged.id)
    store.create_task(LOCAL)
    poller.cycle()
    assert slurm.calls.count("sbatch") == 1


def test_a_fenced_part_stands_down_and_the_others_go_on(tmp_path):
    """Recovery fences the first job of a chain it did not find (lease-fence-<part>): a late job
    of that part, submitted under an older token, stands down; the chain's jobs it found, of the
    same older token, do not."""
    from bridge.core.naming import SUPERSEDED_EXIT_CODE
    from bridge.job.layout import write_lease_fence

    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)}, overrides=TRANSFER)
    task = {**REMOTE, "id": "t1"}
    script = prepare_task_dir(task, config=config, image_paths={"alpine": "/nonexistent.sif"})
    write_lease_fence(script.parent, 5, "run")

    def run(name: str, *args: str) -> int:
        env = dict(os.environ, SLURM_JOB_ID="9")
        result = subprocess.run(
            ["bash", str(script.parent / name), *args], env=env, capture_output=True, timeout=60
        )
        return result.returncode

    assert run("job.sh", "lease-epoch=4", "after=8") == SUPERSEDED_EXIT_CODE
    assert run("job.sh", "lease-epoch=5", "after=8") != SUPERSEDED_EXIT_CODE
    assert run("job-stage-out.sh", "lease-epoch=4", "after=9") != SUPERSEDED_EXIT_CODE


def test_admission_counts_the_jobs_a_chain_holds(tmp_path, sqlite_store, monkeypatch):
    """slurm.max_jobs_in_flight counts jobs: a staged task is three until its stage-in ends,
    two while its own job runs, one at stage-out; a chain goes only with room for all three
    (a QOS's MaxSubmitJobs counts the pending ones too). A chain waiting for room keeps what
    its first round wrote."""
    from tests.unit.test_arrays import count_task_dir_writes

    writes = count_task_dir_writes(monkeypatch)
    poller, slurm = make_poller(tmp_path, sqlite_store, **{"slurm.max_jobs_in_flight": 4})
    store = sqlite_store
    first, second = store.create_task(REMOTE), store.create_task(REMOTE)
    poller.cycle()
    assert slurm.calls.count("sbatch") == 3  # 3 in flight: a second chain would be 6
    assert store.get_task(second.id).job_id is None
    lines = store.get_task(second.id).logs[0]["system_logs"]
    assert any("this task is 3 jobs" in line and "max_jobs_in_flight = 4" in line for line in lines)
    # A task of one job fits beside it.
    one = store.create_task(LOCAL)
    poller.cycle()
    assert store.get_task(one.id).job_id is not None and slurm.calls.count("sbatch") == 4
    set_job(slurm, "100", "COMPLETED", exit_code=0)  # the stage-in ended well: 2 + 1 left
    poller.cycle()
    assert store.get_task(second.id).job_id is None
    set_job(slurm, "101", "COMPLETED", exit_code=0)  # the task's job ended: its stage-out + 1
    write_records(poller, first.id, "101", phase="ran", executors_failed="0")
    poller.cycle()
    assert store.get_task(second.id).job_id is None  # 2 held, a chain of 3 would pass 4
    set_job(slurm, "103", "COMPLETED", exit_code=0)
    write_records(poller, one.id, "103", phase="done", outcome="complete")
    poller.cycle()  # the one-job task ends, leaving the stage-out only
    poller.cycle()
    assert state(store, one.id) == "COMPLETE"
    assert store.get_task(second.id).job_id is not None and slurm.calls.count("sbatch") == 7
    assert writes[second.id] == 1


def test_a_chain_goes_alone_under_a_limit_below_three(tmp_path, sqlite_store):
    poller, slurm = make_poller(tmp_path, sqlite_store, **{"slurm.max_jobs_in_flight": 2})
    first, second = sqlite_store.create_task(REMOTE), sqlite_store.create_task(REMOTE)
    poller.cycle()
    assert slurm.calls.count("sbatch") == 3
    assert sqlite_store.get_task(first.id).job_id == "101"
    assert sqlite_store.get_task(second.id).job_id is None


# ----------------------------------------------------------------------------- in job arrays


@pytest.fixture
def arrays_env(tmp_path: Path, sqlite_store: Store):
    """Arrays of at least two tasks (`slurm.arrays = "auto"`), nothing held back to gather."""
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"slurm.array_gather_seconds": 0, "slurm.array_min_tasks": 2, **TRANSFER},
    )
    slurm = FakeSlurm()
    poller = Poller(config, sqlite_store, slurm_client=slurm, images=FakeImages())
    return poller, sqlite_store, slurm


def chain_ids(store: Store, task_id: str) -> tuple[str, str, str]:
    meta = metadata(store, task_id)
    return (
        meta["slurm_stage_in_job_id"],
        meta["slurm_job_id"],
        meta["slurm_stage_out_job_id"],
    )


def test_staged_tasks_of_one_shape_go_as_three_arrays(arrays_env):
    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(3)]
    poller.cycle()
    assert slurm.calls.count("sbatch") == 3
    assert slurm.array_elements == [[0, 1, 2]] * 3
    stage_in, run, stage_out = "100", "101", "102"
    assert slurm.extra_args[0] == []
    kill = "--kill-on-invalid-dep=yes"
    assert slurm.extra_args[1] == [f"--dependency=aftercorr:{stage_in}", kill]
    assert slurm.extra_args[2] == [f"--dependency=aftercorr:{run}", kill]
    # The array's script makes `after=ID` each element's own `after=ID_I`.
    assert f"after={stage_in}" in slurm.script_args[1]
    assert f"after={run}" in slurm.script_args[2]
    name = metadata(store, tasks[0].id)["slurm_array_name"]
    assert [slurm.jobs[f"{j}_0"].name for j in (stage_in, run, stage_out)] == [
        f"{name}-stage-in",
        name,
        f"{name}-stage-out",
    ]
    # Each part's array runs that part's script of each task.
    runs = [s.splitlines()[-1].split()[1].removeprefix('"$TASK_DIR/"') for s in slurm.scripts]
    assert runs == ["job-stage-in.sh", "job.sh", "job-stage-out.sh"]
    assert "#SBATCH --partition=xfer" in slurm.scripts[0]
    for index, task in enumerate(tasks):
        assert chain_ids(store, task.id) == (
            f"{stage_in}_{index}",
            f"{run}_{index}",
            f"{stage_out}_{index}",
        )
        record = store.get_task(task.id)
        assert record.job_id == f"{run}_{index}" and record.submit_started_at is None
        meta = metadata(store, task.id)
        assert meta["slurm_staging"] == "transfer" and meta["slurm_array_index"] == str(index)


def test_two_shapes_of_staged_tasks_go_as_two_sets_of_arrays_and_one_job_tasks_apart(arrays_env):
    poller, store, slurm = arrays_env
    small = [store.create_task(REMOTE) for _ in range(2)]
    big_doc = {**REMOTE, "resources": {"cpu_cores": 2}}
    big = [store.create_task(big_doc) for _ in range(2)]
    local = [store.create_task(LOCAL) for _ in range(2)]
    poller.cycle()
    assert slurm.calls.count("sbatch") == 7  # 3 + 3 arrays of staged tasks, 1 of one-job tasks
    assert slurm.arrays == [2] * 7
    names = {metadata(store, t.id)["slurm_array_name"] for t in small + big + local}
    assert len(names) == 3
    assert "slurm_staging" not in metadata(store, local[0].id)
    runs = {chain_ids(store, t.id)[1].partition("_")[0] for t in small + big}
    assert len(runs) == 2


def test_each_staged_element_is_one_tes_state_machine(arrays_env):
    poller, store, slurm = arrays_env
    first, second = store.create_task(REMOTE), store.create_task(REMOTE)
    poller.cycle()
    in0, run0, out0 = chain_ids(store, first.id)
    run1 = chain_ids(store, second.id)[1]
    assert (in0, run0, out0, run1) == ("100_0", "101_0", "102_0", "101_1")
    set_job(slurm, in0, "RUNNING", partition="xfer")
    write_records(poller, first.id, in0, phase="staging", start_time="2026-01-01T00:00:00Z")
    poller.cycle()
    assert state(store, first.id) == "INITIALIZING" and state(store, second.id) == "QUEUED"
    set_job(slurm, in0, "COMPLETED", exit_code=0, partition="xfer")
    set_job(slurm, run0, "RUNNING", node="n1")
    write_records(poller, first.id, run0, phase="running 0")
    poller.cycle()
    assert state(store, first.id) == "RUNNING"
    set_job(slurm, run0, "COMPLETED", exit_code=0, node="n1")
    write_records(poller, first.id, run0, phase="ran", executors_failed="0")
    poller.cycle()
    assert state(store, first.id) == "RUNNING"  # its stage-out element waits
    set_job(slurm, out0, "COMPLETED", exit_code=0, partition="xfer")
    write_records(poller, first.id, run0, phase="done", outcome="complete")
    poller.cycle()
    assert state(store, first.id) == "COMPLETE"
    meta = metadata(store, first.id)
    assert meta["slurm_stage_out_state"] == "COMPLETED" and meta["slurm_stage_in_job_id"] == in0
    assert state(store, second.id) == "QUEUED" and store.get_task(second.id).job_id == run1
    assert "scancel" not in slurm.calls


def test_a_failed_stage_in_element_ends_only_its_task(arrays_env):
    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(3)]
    poller.cycle()
    ids = [chain_ids(store, t.id) for t in tasks]
    assert ids[1] == ("100_1", "101_1", "102_1")
    set_job(slurm, ids[1][0], "FAILED", exit_code=STAGE_IN_EXIT_CODE)
    write_records(
        poller,
        tasks[1].id,
        ids[1][0],
        phase="done",
        outcome="system_error",
        **{"system_logs.jsonl": json.dumps({"time": "t", "message": "input 0: 404 Not Found"})},
    )
    for index in (0, 2):
        set_job(slurm, ids[index][0], "COMPLETED", exit_code=0)
    poller.cycle()
    assert state(store, tasks[1].id) == "SYSTEM_ERROR"
    assert "input 0: 404 Not Found" in store.get_task(tasks[1].id).logs[0]["system_logs"]
    # Its later elements go (as Slurm would for their dependency), the others' stay.
    assert slurm.jobs[ids[1][1]].state == slurm.jobs[ids[1][2]].state == "CANCELLED"
    for index in (0, 2):
        assert state(store, tasks[index].id) == "INITIALIZING"
        assert {slurm.jobs[j].state for j in ids[index][1:]} == {"PENDING"}


def test_cancel_of_a_staged_element_scancels_its_three_elements(arrays_env):
    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(2)]
    poller.cycle()
    assert chain_ids(store, tasks[0].id) == ("100_0", "101_0", "102_0")
    store.cancel_task(tasks[0].id)
    poller.cycle()
    assert {slurm.jobs[j].state for j in chain_ids(store, tasks[0].id)} == {"CANCELLED"}
    assert {slurm.jobs[j].state for j in chain_ids(store, tasks[1].id)} == {"PENDING"}
    assert state(store, tasks[0].id) == "CANCELED" and state(store, tasks[1].id) == "QUEUED"


def test_a_lost_staged_element_is_submitted_again_alone(arrays_env):
    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(2)]
    poller.cycle()
    lost = chain_ids(store, tasks[0].id)
    set_job(slurm, lost[0], "NODE_FAIL", exit_code=0)
    poller.cycle()
    assert state(store, tasks[0].id) == "QUEUED"
    poller.cycle()
    assert slurm.calls.count("sbatch") == 6  # the three arrays, then its chain of three jobs
    meta = metadata(store, tasks[0].id)
    assert meta["slurm_lost_job_ids"] == ",".join(lost)
    assert "slurm_array_name" not in meta and meta["slurm_staging"] == "transfer"
    assert chain_ids(store, tasks[0].id) == ("103", "104", "105")
    assert slurm.jobs[lost[1]].state == "CANCELLED"
    assert chain_ids(store, tasks[1].id)[1] == "101_1"


def crash_at_sbatch(slurm: FakeSlurm, number: int):
    """The poller dies as it starts its `number`-th sbatch (1: the first)."""
    real_submit = slurm.submit
    count = [0]

    def submit(*args, **kwargs):
        count[0] += 1
        if count[0] == number:
            raise KeyboardInterrupt
        return real_submit(*args, **kwargs)

    slurm.submit = submit
    return real_submit


@pytest.mark.parametrize("crash_at", [2, 3])
def test_a_crash_between_the_arrays_submits_only_the_missing_ones(arrays_env, crash_at):
    """A poller killed before the second (or third) array's sbatch leaves the arrays before it,
    each task's elements of them stored. Recovery finds them, fences the missing part alone,
    and submits only the missing arrays, each task keeping its index."""
    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(3)]
    real_submit = crash_at_sbatch(slurm, crash_at)
    with pytest.raises(KeyboardInterrupt):
        poller.cycle()
    slurm.submit = real_submit
    slurm.calls.clear()
    records = [store.get_task(t.id) for t in tasks]
    assert all(r.job_id is None and r.submit_started_at is not None for r in records)
    poller.clock = lambda: max(r.submit_started_at for r in records) + 1000  # settled
    poller.cycle()  # the missing part not found: fenced alone
    assert slurm.calls.count("sbatch") == 0
    missing = "run" if crash_at == 2 else "stage-out"
    for task in tasks:
        task_dir = poller.task_dir(task.id)
        assert (task_dir / f"lease-fence-{missing}").is_file()
        assert not (task_dir / "lease-fence").exists()
    poller.cycle()  # still none: the missing arrays, one sbatch each
    assert slurm.calls.count("sbatch") == 4 - crash_at
    assert slurm.array_elements[-1] == [0, 1, 2]
    for index, task in enumerate(tasks):
        stage_in, run, stage_out = chain_ids(store, task.id)
        assert (stage_in, run, stage_out) == (f"100_{index}", f"101_{index}", f"102_{index}")
        assert store.get_task(task.id).job_id == run
    assert slurm.extra_args[-1][0] == "--dependency=aftercorr:101"
    # Every part of every task exists once.
    assert len(slurm.jobs) == 9


def test_a_task_canceled_during_a_crash_between_the_arrays_has_each_element_canceled(arrays_env):
    """As a chain's: its elements of the missing arrays are submitted with the others' (the
    arrays keep every task's index), then scanceled with the ones found."""
    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(3)]
    real_submit = crash_at_sbatch(slurm, 2)
    with pytest.raises(KeyboardInterrupt):
        poller.cycle()
    slurm.submit = real_submit
    store.cancel_task(tasks[0].id)
    records = [store.get_task(t.id) for t in tasks]
    poller.clock = lambda: max(r.submit_started_at for r in records) + 1000
    poller.cycle()
    poller.cycle()
    assert slurm.array_elements[-2:] == [[0, 1, 2], [0, 1, 2]]
    assert {slurm.jobs[j].state for j in ("100_0", "101_0", "102_0")} == {"CANCELLED"}
    assert state(store, tasks[0].id) == "CANCELED"
    for index in (1, 2):
        assert chain_ids(store, tasks[index].id)[1] == f"101_{index}"
        assert slurm.jobs[f"101_{index}"].state == "PENDING"


def test_a_crash_after_the_last_array_adopts_each_tasks_elements(arrays_env):
    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(2)]
    poller.cycle()
    for task in tasks:  # as if no element of the tasks' array had been stored
        store.update_task(task.id, job_id=None, submit_started_at=1.0)
        record = store.get_task(task.id)
        logs = record.logs
        logs[0]["metadata"].pop("slurm_job_id")
        logs[0]["metadata"].pop("slurm_stage_out_job_id")
        store.update_task(task.id, logs=logs)
    calls = len(slurm.calls)
    poller.cycle()
    assert "sbatch" not in slurm.calls[calls:]
    for index, task in enumerate(tasks):
        assert store.get_task(task.id).job_id == f"101_{index}"
        assert chain_ids(store, task.id) == (f"100_{index}", f"101_{index}", f"102_{index}")


def test_staged_arrays_go_only_when_the_budget_holds_their_three_sbatches(arrays_env):
    from bridge.system.budget import CallBudget

    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(2)]
    now = [1000.0]
    slurm.budget = CallBudget(
        0.001, 6, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    poller.cycle()
    assert "sbatch" not in slurm.calls
    assert all(store.get_task(t.id).job_id is None for t in tasks)
    slurm.budget = CallBudget(
        0.001, 7 + 4, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )
    poller.cycle()
    assert slurm.calls.count("sbatch") == 3


def test_admission_counts_three_jobs_per_staged_task_in_arrays(tmp_path, sqlite_store):
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={
            "slurm.array_gather_seconds": 0,
            "slurm.array_min_tasks": 2,
            "slurm.max_jobs_in_flight": 7,
            **TRANSFER,
        },
    )
    slurm = FakeSlurm()
    poller = Poller(config, sqlite_store, slurm_client=slurm, images=FakeImages())
    tasks = [sqlite_store.create_task(REMOTE) for _ in range(3)]
    poller.cycle()
    assert slurm.array_elements == [[0, 1]] * 3  # 6 jobs; a third task's 3 would pass 7
    assert sqlite_store.get_task(tasks[2].id).job_id is None


def test_the_array_script_gives_each_element_its_part_and_the_element_before(tmp_path):
    """The run array's element I runs task I's job.sh as `RUN_I`, after the stage-in array's
    element `IN_I`; an `after=` that is no array id is refused."""
    from bridge.jobscript.array import render_array_script

    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    dirs = []
    for name in ("a", "b"):
        task_dir = tmp_path / name
        task_dir.mkdir()
        job = task_dir / "job.sh"
        job.write_text('#!/bin/bash\necho "$@" > ran\n')
        job.chmod(0o700)
        dirs.append(task_dir)
    script = tmp_path / "array.sh"
    script.write_text(render_array_script(config=config, shared=[], task_dirs=dirs, indexes=[3, 5]))

    def element(index: int, *args: str) -> int:
        env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(index), "SLURM_ARRAY_JOB_ID": "77"}
        return subprocess.run(["bash", str(script), *args], env=env).returncode

    assert element(5, "lease-epoch=4", "after=76") == 0
    assert (dirs[1] / "ran").read_text() == "77_5 lease-epoch=4 after=76_5\n"
    assert element(0, "after=76") == 2  # no task has element 0
    assert element(3, "after=76_1") == 2 and element(3, "after=") == 2
    assert not (dirs[0] / "ran").exists()


@pytest.mark.parametrize(
    ("arg", "accepted"),
    [("after=12_3", True), ("after=12", True), ("after=12__3", False), ("after=1_2_3", False),
     ("after=12_", False), ("after=12_x", False), ("12__3", False), ("12_3_4", False)],
)  # fmt: skip
def test_the_parts_take_an_element_after_them_and_nothing_else(tmp_path, arg, accepted):
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)}, overrides=TRANSFER)
    script = prepare_task_dir({**REMOTE, "id": "t1"}, config=config, image_paths={"alpine": "/x"})
    env = dict(os.environ, SLURM_JOB_ID="9")
    out = script.parent / "job-stage-out.sh"
    # Accepted, the stage-out part finds no records of the job before it (75); refused: 2.
    result = subprocess.run(["bash", str(out), arg], env=env, capture_output=True, timeout=60)
    if arg.startswith("after="):
        assert (result.returncode != 2) is accepted, result.stderr
    else:
        assert result.returncode == 2


def test_a_first_array_whose_sbatch_got_no_answer_is_found_and_the_rest_submitted(arrays_env):
    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(2)]
    slurm.create_then_fail = True  # the stage-in array exists, sbatch's answer is lost
    poller.cycle()
    slurm.create_then_fail = False
    assert slurm.calls.count("sbatch") == 1
    assert all(store.get_task(t.id).job_id is None for t in tasks)
    poller.clock = lambda: 1e12  # settled, back-off over
    for _ in range(3):
        poller.cycle()
    assert len(slurm.array_elements) == 2 and len(slurm.jobs) == 6
    for index, task in enumerate(tasks):
        assert chain_ids(store, task.id) == (f"100_{index}", f"101_{index}", f"102_{index}")


def test_an_element_slurm_cancelled_for_its_dependency_after_a_good_stage_in_runs_again(
    arrays_env,
):
    """Slurm judges an element whose corresponding element was purged by its whole array
    (docs/staging.md): with another task's stage-in failed, it cancels the later element of a
    task whose own stage-in ended well. That task is submitted again, not failed."""
    from datetime import UTC, datetime

    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(2)]
    poller.cycle()
    (in0, run0, _), (in1, _, _) = chain_ids(store, tasks[0].id), chain_ids(store, tasks[1].id)
    set_job(slurm, in0, "COMPLETED", exit_code=0, partition="xfer")
    write_records(poller, tasks[0].id, in0, phase="staged")
    poller.cycle()
    assert state(store, tasks[0].id) == "INITIALIZING"
    set_job(slurm, in1, "FAILED", exit_code=STAGE_IN_EXIT_CODE)
    write_records(poller, tasks[1].id, in1, phase="done", outcome="system_error")
    # As sacct shows an element Slurm cancelled for its dependency (24.11: `CANCELLED|0:0|None|
    # <end>|None assigned|None`, no one named).
    set_job(
        slurm, run0, "CANCELLED", exit_code=0, canceled_by="", node=None,
        start_time=None, end_time=datetime.now(UTC),
    )  # fmt: skip
    poller.cycle()
    assert state(store, tasks[1].id) == "SYSTEM_ERROR"
    assert state(store, tasks[0].id) == "QUEUED"
    poller.cycle()
    assert chain_ids(store, tasks[0].id) == ("103", "104", "105")
    lines = store.get_task(tasks[0].id).logs[0]["system_logs"]
    assert any(
        f"Slurm job {run0} ended in state CANCELLED" in line and "for its dependency" in line
        for line in lines
    ), lines


def test_a_failed_stage_in_element_whose_later_ones_slurm_cancelled_ends_its_task(arrays_env):
    """Slurm cancels the later elements of a failed stage-in element at once
    (--kill-on-invalid-dep), giving them a start time but no node: they never started, and the
    task ends as its stage-in recorded, not submitted again."""
    from datetime import UTC, datetime

    poller, store, slurm = arrays_env
    tasks = [store.create_task(REMOTE) for _ in range(2)]
    poller.cycle()
    stage_in, run, stage_out = chain_ids(store, tasks[0].id)
    set_job(slurm, stage_in, "FAILED", exit_code=STAGE_IN_EXIT_CODE, partition="xfer")
    write_records(
        poller,
        tasks[0].id,
        stage_in,
        phase="done",
        outcome="system_error",
        **{"system_logs.jsonl": json.dumps({"time": "t", "message": "input 0: 404 Not Found"})},
    )
    now = datetime.now(UTC)
    for job_id in (run, stage_out):
        set_job(
            slurm, job_id, "CANCELLED", exit_code=0, canceled_by="", node=None,
            reason="DependencyNeverSatisfied", start_time=now, end_time=now,
        )  # fmt: skip
    poller.cycle()
    record = store.get_task(tasks[0].id)
    assert record.state == "SYSTEM_ERROR", record.logs
    assert "input 0: 404 Not Found" in record.logs[0]["system_logs"]
    assert slurm.calls.count("sbatch") == 3


def test_the_three_parts_run_as_elements_of_their_arrays(storage_servers, tmp_path):
    """The three parts of a task run as element 3 of their arrays' scripts (as Slurm's
    aftercorr runs them): the stage-in element keeps its records as `IN_3`, the task's element
    continues them as `RUN_3` (after=IN_3), the stage-out element completes `RUN_3`'s."""
    from bridge.jobscript.array import render_array_script
    from bridge.jobscript.parts import PART_SCRIPTS
    from tests.unit.test_job_side import REPO

    out_url = storage_servers.url_for("http", "elements/out.txt")
    config, task_dir = staged_task_dir(
        storage_servers, tmp_path, "elements", out_url, "cp {root}/in/a {root}/out/b"
    )

    def element(part: str, array: str, *args: str) -> int:
        script = tmp_path / f"{part}.sh"
        text = render_array_script(
            config=config,
            shared=[],
            task_dirs=[task_dir],
            indexes=[3],
            script=PART_SCRIPTS.get(part, "job.sh"),
        )
        script.write_text(text)
        env = dict(
            os.environ, SLURM_ARRAY_JOB_ID=array, SLURM_ARRAY_TASK_ID="3", PYTHONPATH=str(REPO)
        )
        result = subprocess.run(["bash", str(script), *args], env=env, timeout=60)
        return result.returncode

    assert element("stage-in", "7", "lease-epoch=1") == 0
    assert read_records(task_dir, "7_3", keep_bytes=1024).phase == "staged"
    assert element("run", "8", "lease-epoch=1", "after=7") == 0
    assert read_records(task_dir, "8_3", keep_bytes=1024).phase == "ran"
    assert element("stage-out", "9", "lease-epoch=1", "after=8") == 0
    records = read_records(task_dir, "8_3", keep_bytes=1024)
    assert records.outcome == "complete" and records.phase == "done"
    assert records.start_time == read_records(task_dir, "7_3", keep_bytes=1024).start_time
    assert storage_servers.server_path("http", "elements/out.txt").read_bytes() == b"hello\n"
    assert (task_dir / "slurm-8_3.out").exists()
