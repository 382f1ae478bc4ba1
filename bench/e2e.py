"""End to end on the local cluster: 200 trivial tasks (`alpine echo`) through the bridge against
the same 200 jobs submitted directly with sbatch running the same Apptainer command on the same
SIF image (the one the bridge pulled) with the same Slurm resources; makespan ratio. Then the
single-task latency, POST to COMPLETE against sbatch to the job leaving squeue, and the job
script's own time around its executor, the time from POST to the job's submission and from
the job script's end to COMPLETE seen (median of BENCH_E2E_SINGLE, 5). Slurm's own record of
both sides' jobs (sacct) says where a difference in makespan comes from: submitting, waiting in
the queue or running.
The bridge runs as `tes-bridge serve` (API and poller) with the default poll interval (1 s);
both sides are watched every 0.1 s.

    python -m bench e2e
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from bench.common import (
    PYTHON,
    SLURM_ENV,
    bridge_env,
    log_file,
    scratch,
    stop,
    table,
    wait_http,
    write_config,
    write_result,
)

TASKS = int(os.environ.get("BENCH_E2E_TASKS", "200"))
SINGLE = int(os.environ.get("BENCH_E2E_SINGLE", "5"))
CLUSTER_ENV = Path("/var/lib/tes-bridge/local-cluster/cluster.env")
TERMINAL = {"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED"}
#: What every task of the bridge's side runs (the raw side runs the same command on its SIF).
ECHO = [{"image": "alpine", "command": ["echo", "hello"]}]


def cluster() -> dict[str, str]:
    values = {}
    for line in CLUSTER_ENV.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values


def container_toml(info: dict[str, str], cache_dir: Path) -> str:
    """The [container] section for the local cluster's Apptainer and registry. The benchmarks
    run as root, as their raw sbatch jobs do: both sides run their commands as root."""
    registry = info["LOCAL_CLUSTER_REGISTRY"]
    return f"""
[container]
runtime = "{info["LOCAL_CLUSTER_APPTAINER"]}"
default_registry = "{registry}"
insecure_registries = ["{registry}"]
extra_flags = {json.dumps(info["LOCAL_CLUSTER_APPTAINER_FLAGS"].split())}
cache_dir = "{cache_dir}"
allow_root = true
"""


def slurm(*argv: str, **run: Any) -> str:
    """A Slurm command's output; `run`: more of subprocess.run's arguments (user=, group=)."""
    env = {**os.environ, **SLURM_ENV}
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env=env, **run)
    return str(done.stdout)


def wait_queue_empty(timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while slurm("squeue", "-h").strip():
        if time.monotonic() > deadline:
            raise RuntimeError("the Slurm queue did not empty (other jobs running)")
        time.sleep(1)


def raw_jobs(count: int, script: Path, directives: list[str]) -> float:
    """Makespan of `count` sbatch jobs: first submission to the last one leaving squeue."""
    started = time.perf_counter()
    ids = [
        slurm("sbatch", "--parsable", f"--job-name=bench-raw-{i}", "-o", "/dev/null",
              *directives, str(script)).strip().split(";")[0]
        for i in range(count)
    ]  # fmt: skip
    joined = ",".join(ids)
    while True:
        env = {**os.environ, **SLURM_ENV}
        out = subprocess.run(["squeue", "-h", f"--jobs={joined}", "-o", "%i"], env=env,
                             capture_output=True, text=True).stdout  # fmt: skip
        if not out.strip():
            break
        time.sleep(0.1)
    elapsed = time.perf_counter() - started
    for _ in range(60):  # slurmdbd may still hold RUNNING for a job that just left squeue
        failed = [
            line for line in slurm("sacct", "-n", "-X", "-P", f"--jobs={joined}", "-o",
                                   "JobID,State").splitlines()
            if "COMPLETED" not in line
        ]  # fmt: skip
        if not any(line.endswith(("RUNNING", "PENDING", "COMPLETING")) for line in failed):
            break
        time.sleep(1)
    assert not failed, failed[:5]
    return elapsed


def slurm_timeline(name_prefix: str, since: str) -> dict[str, float]:
    """Slurm's own view (sacct, 1 s resolution) of the jobs named `name_prefix*` submitted since
    `since`: how long submitting them took, the first submission to the last end, and each
    job's mean wait in the queue and run time. The same clock for both sides, whatever each side
    watches to decide it is done."""
    rows = _ended_jobs(name_prefix, since)
    if not rows:
        return {}
    return _timeline_figures(rows)


def _ended_jobs(name_prefix: str, since: str) -> list[tuple[datetime, datetime, datetime]]:
    """The submit, start and end of the jobs named `name_prefix*` submitted since `since`, once
    sacct has every one's end (none after a minute without)."""
    for _ in range(60):  # slurmdbd records a job's end a moment after it leaves the queue
        fields = _sacct_jobs(name_prefix, since)
        if fields and all(end not in ("", "Unknown") for *_, end in fields):
            return [tuple(datetime.fromisoformat(f) for f in row[1:]) for row in fields]  # type: ignore[misc]
        time.sleep(1)
    return []


def _sacct_jobs(name_prefix: str, since: str) -> list[list[str]]:
    """sacct's JobName, Submit, Start and End of the jobs named `name_prefix*` since `since`."""
    out = slurm("sacct", "-n", "-X", "-P", "--allusers", "-S", since,
                "-o", "JobName,Submit,Start,End")  # fmt: skip
    return [
        row for row in (line.split("|") for line in out.splitlines())
        if row[0].startswith(name_prefix) and row[1] >= since  # ISO times sort as text
    ]  # fmt: skip


def _timeline_figures(rows: list[tuple[datetime, datetime, datetime]]) -> dict[str, float]:
    submits = [submit for submit, _, _ in rows]
    ends = [end for _, _, end in rows]
    return {
        "jobs": len(rows),
        "submitting_s": (max(submits) - min(submits)).total_seconds(),
        "first_submit_to_last_end_s": (max(ends) - min(submits)).total_seconds(),
        "mean_wait_s": statistics.mean((start - sub).total_seconds() for sub, start, _ in rows),
        "mean_run_s": statistics.mean((end - start).total_seconds() for _, start, end in rows),
    }


def job_side_seconds(task: dict[str, object]) -> float:
    """The job script's own time around its executors: the attempt's start to end (the job
    script's records) less the executors' start to end."""
    attempt = task["logs"][0]  # type: ignore[index]
    executors = attempt["logs"]
    script = _seconds(attempt["end_time"]) - _seconds(attempt["start_time"])
    ran = _seconds(executors[-1]["end_time"]) - _seconds(executors[0]["start_time"])
    return script - ran


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def submit_latency(api: str) -> float:
    """One task, POST to its job submitted to Slurm (the job id in its logs), polled every
    5 ms; the task then runs to its end."""
    task = {"executors": ECHO}
    session = requests.Session()
    started = time.perf_counter()
    task_id = session.post(f"{api}/tasks", data=json.dumps(task)).json()["id"]
    while True:
        full = session.get(f"{api}/tasks/{task_id}", params={"view": "FULL"}).json()
        if any("slurm_job_id" in (log.get("metadata") or {}) for log in full.get("logs", [])):
            return time.perf_counter() - started
        time.sleep(0.005)


def bridge_tasks(
    api: str,
    count: int,
    job_side: list[float] | None = None,
    outcome_seen: list[float] | None = None,
) -> float:
    run = uuid.uuid4().hex
    task = {
        "executors": ECHO,
        "tags": {"bench": run},
    }
    session = requests.Session()
    started = time.perf_counter()
    for _ in range(count):
        session.post(f"{api}/tasks", data=json.dumps(task)).raise_for_status()
    tasks = _wait_run_ended(session, api, run, count)
    elapsed = time.perf_counter() - started
    seen = time.time()
    bad = [t for t in tasks if t["state"] != "COMPLETE"]
    assert not bad, bad[:3]
    if job_side is not None or outcome_seen is not None:
        _record_job_times(session, api, tasks, seen, job_side, outcome_seen)
    return elapsed


def _run_tasks(session: requests.Session, api: str, run: str) -> list[dict[str, Any]]:
    """The tasks tagged with `run` (the default view), every page."""
    tasks: list[dict[str, Any]] = []
    token = None
    while True:
        params = {"tag_key": "bench", "tag_value": run, "page_size": "2047"}
        if token:
            params["page_token"] = token
        page = session.get(f"{api}/tasks", params=params).json()
        tasks += page.get("tasks", [])
        token = page.get("next_page_token")
        if not token:
            return tasks


def _wait_run_ended(
    session: requests.Session, api: str, run: str, count: int
) -> list[dict[str, Any]]:
    """The run's `count` tasks once every one has ended, polled every 0.1 s."""
    while True:
        tasks = _run_tasks(session, api, run)
        if len(tasks) == count and all(t["state"] in TERMINAL for t in tasks):
            return tasks
        time.sleep(0.1)


def _record_job_times(
    session: requests.Session,
    api: str,
    tasks: list[dict[str, Any]],
    seen: float,
    job_side: list[float] | None,
    outcome_seen: list[float] | None,
) -> None:
    """Each task's job script time around its executors and its outcome's delay (from the job
    script's end to `seen`), appended to the lists given."""
    for t in tasks:
        full = session.get(f"{api}/tasks/{t['id']}", params={"view": "FULL"}).json()
        if job_side is not None:
            job_side.append(job_side_seconds(full))
        if outcome_seen is not None:  # the job script's end (its records) to COMPLETE seen here
            outcome_seen.append(seen - _seconds(full["logs"][0]["end_time"]))


def main() -> dict[str, object]:
    info = cluster()
    # The compute nodes see the shared filesystem, not the login node's /var/tmp.
    root = scratch("e2e", info["LOCAL_CLUSTER_SHARED_DIR"])
    os.chmod(root, 0o755)
    extra = container_toml(info, root / "images")
    if os.environ.get("BENCH_E2E_TEMPLATE_DIR"):  # A/B against another job script template
        extra += f'\n[job]\ntemplate_dir = "{os.environ["BENCH_E2E_TEMPLATE_DIR"]}"\n'
    config = write_config(root, f"sqlite:///{root}/tasks.db", extra=extra)
    bind = config.read_text().split('bind = "')[1].split('"')[0]
    api = f"http://{bind}/ga4gh/tes/v1"
    server = subprocess.Popen(
        [PYTHON, "-m", "bridge", "--config", str(config), "--log-level", "WARNING", "serve"],
        env=bridge_env(), stderr=log_file(root / "serve.log"),
    )  # fmt: skip
    try:
        wait_http(f"{api}/service-info")
        wait_queue_empty()
        # Warm-up: the bridge pulls the image once; raw sbatch then uses the same SIF.
        assert bridge_tasks(api, 1) > 0
        sif = next((root / "images").rglob("*.sif"))
        script = next((root / "state" / "work").glob("*/job.sh")).read_text()
        directives = [
            line.split(None, 1)[1]
            for line in script.splitlines()
            if line.startswith("#SBATCH") and line.split(None, 1)[1].startswith(
                ("--cpus", "--mem", "--time", "--partition", "--nodes", "--ntasks")
            )
        ]  # fmt: skip
        raw_script = root / "raw.sh"
        runtime = info["LOCAL_CLUSTER_APPTAINER"]
        raw_script.write_text(
            f"#!/bin/sh\nexec {runtime} exec {info['LOCAL_CLUSTER_APPTAINER_FLAGS']} "
            f"{sif} echo hello\n"
        )
        single_raw: list[float] = []
        single_bridge: list[float] = []
        job_side: list[float] = []
        outcome_seen: list[float] = []
        submitted: list[float] = []
        for _ in range(SINGLE):
            wait_queue_empty()
            single_raw.append(raw_jobs(1, raw_script, directives))
            wait_queue_empty()
            single_bridge.append(bridge_tasks(api, 1, job_side, outcome_seen))
            wait_queue_empty()
            submitted.append(submit_latency(api))
        wait_queue_empty()
        since = time.strftime("%Y-%m-%dT%H:%M:%S")
        raw = raw_jobs(TASKS, raw_script, directives)
        raw_slurm = slurm_timeline("bench-raw-", since)
        wait_queue_empty()
        since = time.strftime("%Y-%m-%dT%H:%M:%S")
        ours = bridge_tasks(api, TASKS)
        ours_slurm = slurm_timeline("tes-", since)
    finally:
        stop(server)
    one_raw, one_bridge = statistics.median(single_raw), statistics.median(single_bridge)
    rows: list[list[Any]] = [
        [f"{TASKS} tasks, makespan s", ours, raw, f"{ours / raw:.2f}"],
        ["1 task, POST->COMPLETE vs sbatch->end, s", one_bridge, one_raw,
         f"+{one_bridge - one_raw:.2f} s"],
        *[
            [f"{TASKS} jobs in sacct, {label}", ours_slurm.get(key, ""), raw_slurm.get(key, ""), ""]
            for key, label in (
                ("submitting_s", "first to last submission, s"),
                ("first_submit_to_last_end_s", "first submission to last end, s"),
                ("mean_wait_s", "mean wait in the queue, s"),
                ("mean_run_s", "mean run time, s"),
            )
        ],
        ["1 task, job script's time around its executor, s", statistics.median(job_side), "", ""],
        ["1 task, POST to its job submitted, s", statistics.median(submitted), "", ""],
        ["1 task, job script's end to COMPLETE seen (0.1 s polls), s",
         statistics.median(outcome_seen), "", ""],
    ]  # fmt: skip
    print(f"end to end on the local cluster (alpine echo; sbatch {' '.join(directives)})")
    table(["measure", "bridge", "raw sbatch", "ratio / added"], rows)
    data = {
        "tasks": TASKS,
        "directives": directives,
        "makespan_bridge_s": ours,
        "makespan_raw_s": raw,
        "makespan_ratio": ours / raw,
        "single_bridge_s": single_bridge,
        "single_raw_s": single_raw,
        "single_added_s": one_bridge - one_raw,
        "job_side_s": job_side,
        "submitted_s": submitted,
        "outcome_seen_s": outcome_seen,
        "sacct_bridge": ours_slurm,
        "sacct_raw": raw_slurm,
    }
    write_result("e2e", data)
    shutil.rmtree(root, ignore_errors=True)
    return data


if __name__ == "__main__":
    main()
