"""Job arrays on the local cluster: a burst of BENCH_ARRAYS_TASKS (1000) same-shape one-second
tasks (`alpine sleep 1`) through the bridge (slurm.arrays = "auto", the tasks posted while the
poller runs, as a client's burst comes) against the same jobs as one raw `sbatch --array` and as
a raw sbatch loop, each running the same Apptainer command on the same SIF with the same Slurm
resources. For each side: the makespan (first submission or POST to the last job's end), how
many sbatch ran, and slurmctld's RPCs per task from `sdiag` before and after (submissions,
REQUEST_SUBMIT_BATCH_JOB, and every RPC of the user, squeue's and scancel's included). The
cluster is shared by everyone on it as root: run it alone (`flock -x /tmp/cluster.lock`).

    python -m bench arrays
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import requests

from bench.common import (
    PYTHON,
    bridge_env,
    log_file,
    scratch,
    stop,
    table,
    wait_http,
    write_config,
    write_result,
)
from bench.e2e import cluster, container_toml, slurm, wait_queue_empty

TASKS = int(os.environ.get("BENCH_ARRAYS_TASKS", "1000"))
TERMINAL = {"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED"}
SLEEP = [{"image": "alpine", "command": ["sleep", "1"]}]


def rpc_counts() -> dict[str, int]:
    """slurmctld's RPC counts (sdiag): submissions, and every RPC of this user."""
    out = slurm("sdiag")
    submits = re.search(r"REQUEST_SUBMIT_BATCH_JOB\s+\(\s*\d+\)\s+count:(\d+)", out)
    user = re.search(rf"^\s*root\s+\(\s*{os.geteuid()}\)\s+count:(\d+)", out, re.MULTILINE)
    return {
        "submit": int(submits.group(1)) if submits else 0,
        "user": int(user.group(1)) if user else 0,
    }


def per_task(before: dict[str, int], after: dict[str, int], count: int) -> dict[str, float]:
    return {key: (after[key] - before[key]) / count for key in before}


def wait_jobs_gone(ids: list[str]) -> None:
    joined = ",".join(ids)
    while slurm("squeue", "-h", "-r", f"--jobs={joined}", "-o", "%i").strip():
        time.sleep(0.1)


def raw_loop(count: int, script: Path, directives: list[str]) -> float:
    started = time.perf_counter()
    ids = [
        slurm("sbatch", "--parsable", f"--job-name=bench-loop-{i}", "-o", "/dev/null",
              *directives, str(script)).strip().split(";")[0]
        for i in range(count)
    ]  # fmt: skip
    wait_jobs_gone(ids)
    return time.perf_counter() - started


def raw_array(count: int, script: Path, directives: list[str]) -> float:
    started = time.perf_counter()
    job_id = slurm(
        "sbatch", "--parsable", "--job-name=bench-array", "-o", "/dev/null",
        f"--array=0-{count - 1}", *directives, str(script),
    ).strip().split(";")[0]  # fmt: skip
    wait_jobs_gone([job_id])
    return time.perf_counter() - started


def bridge_burst(api: str, count: int) -> tuple[float, int]:
    """Makespan of `count` tasks posted at once, and how many jobs (arrays or single) carried
    them."""
    run = uuid.uuid4().hex
    session = requests.Session()
    body = json.dumps({"executors": SLEEP, "tags": {"bench": run}})
    started = time.perf_counter()
    for _ in range(count):
        session.post(f"{api}/tasks", data=body).raise_for_status()
    while True:
        tasks, token = [], None
        while True:
            params = {"tag_key": "bench", "tag_value": run, "page_size": "2047", "view": "FULL"}
            if token:
                params["page_token"] = token
            page = session.get(f"{api}/tasks", params=params).json()
            tasks += page.get("tasks", [])
            token = page.get("next_page_token")
            if not token:
                break
        if len(tasks) == count and all(t["state"] in TERMINAL for t in tasks):
            break
        time.sleep(0.2)
    elapsed = time.perf_counter() - started
    assert all(t["state"] == "COMPLETE" for t in tasks), [t["state"] for t in tasks][:5]
    jobs = {t["logs"][0]["metadata"]["slurm_job_id"].split("_")[0] for t in tasks}
    return elapsed, len(jobs)


def main() -> dict[str, object]:
    info = cluster()
    root = scratch("arrays", info["LOCAL_CLUSTER_SHARED_DIR"])
    os.chmod(root, 0o755)
    extra = container_toml(info, root / "images") + '[slurm]\narrays = "auto"\n'
    config = write_config(root, f"sqlite:///{root}/tasks.db", extra=extra)
    bind = config.read_text().split('bind = "')[1].split('"')[0]
    api = f"http://{bind}/ga4gh/tes/v1"
    server = subprocess.Popen(
        [PYTHON, "-m", "bridge", "--config", str(config), "--log-level", "WARNING", "serve"],
        env=bridge_env(), stderr=log_file(root / "serve.log"),
    )  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    try:
        wait_http(f"{api}/service-info")
        wait_queue_empty()
        bridge_burst(api, 1)  # warm-up: the image pulled once; the raw sides use the same SIF
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
        raw_script.write_text(
            f"#!/bin/sh\nexec {info['LOCAL_CLUSTER_APPTAINER']} exec "
            f"{info['LOCAL_CLUSTER_APPTAINER_FLAGS']} {sif} sleep 1\n"
        )
        for side in ("bridge", "raw array", "raw loop"):
            wait_queue_empty(timeout=1800)
            before = rpc_counts()
            if side == "bridge":
                seconds, jobs = bridge_burst(api, TASKS)
            elif side == "raw array":
                seconds, jobs = raw_array(TASKS, raw_script, directives), 1
            else:
                seconds, jobs = raw_loop(TASKS, raw_script, directives), TASKS
            rpcs = per_task(before, rpc_counts(), TASKS)
            results[side] = {"makespan_s": seconds, "jobs": jobs, **rpcs}
    finally:
        stop(server)
    rows = [
        [side, r["makespan_s"], int(r["jobs"]), r["submit"], r["user"]]
        for side, r in results.items()
    ]
    print(f"{TASKS} one-second tasks (alpine sleep 1; sbatch {' '.join(directives)})")
    table(["side", "makespan s", "sbatch", "submit RPCs/task", "all RPCs/task"], rows)
    data = {"tasks": TASKS, "directives": directives, "sides": results}
    write_result("arrays", data)
    shutil.rmtree(root, ignore_errors=True)
    return data


if __name__ == "__main__":
    main()
