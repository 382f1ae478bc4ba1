"""Job arrays and the budget of Slurm calls on the local cluster, side by side in one run.

A burst of BENCH_ARRAYS_TASKS (1000) same-shape one-second tasks (`alpine sleep 1`), posted while
the poller runs as a client's burst comes, through:
- the bridge with `slurm.arrays = "auto"` and no call budget (`calls_per_second = 0`);
- the same bridge under a budget of 2 calls a second after a burst of 30 (Slurm's rl_enable
  defaults);
and the same jobs as one raw `sbatch --array` and as a raw `sbatch` loop, each running the same
Apptainer command on the same SIF with the same Slurm resources. Then the same number of tasks
in BENCH_ARRAYS_SHAPES (20) shapes (`resources.ram_gb` apart), interleaved, with arrays and with
`arrays = "never"` (one job per task); and BENCH_ARRAYS_LONE (5) lone tasks, POST to COMPLETE,
against a raw sbatch of the same job. Last, a submission burst of BENCH_ARRAYS_BURST (10,000; 0:
none) same-shape tasks, POSTed as fast as one client can: the time from the last POST until
every task had its job, the jobs and submission RPCs it took, and the Slurm calls per poll cycle
with that many jobs queued; then its jobs are scanceled (running them all would take hours on
the local cluster's 4 CPUs).

Staged tasks, on sides of their own (`BENCH_ARRAYS_SIDES=staged,staged-never`; not in the
default run, which they would lengthen by about 5 minutes, a fifth, for a question of their
own: both took 282 s at 200 tasks on the local cluster):
BENCH_ARRAYS_STAGED (200) same-shape tasks, each with one small HTTP input and one HTTP output
(PUT) on a loopback server (the tests' `python -m tests.fixtures.storage http`), `alpine sh -c
'cat /in/x > /out/y'` on the cluster's network-less partition, staged on its transfer partition
(`staging.where = "transfer"`): a chain of three jobs a task, stage-in, the task's job and
stage-out. `staged`: `arrays = "auto"`, three job arrays a shape; `staged-never`: `arrays =
"never"`, three sbatches a task. Each: the makespan, when the first task and the median task
ended (from the first POST: whether tasks end as they go), the time from the last POST until
every task had its three jobs, the sbatch RPCs, the Slurm calls per poll cycle, and how many
tasks ended COMPLETE with their output right (all must, or the run fails naming the tasks).
BENCH_ARRAYS_STAGE_IN_NICE (10): their `staging.stage_in_nice`.

For each side: the makespan (first POST or submission to the last job's end), how many sbatch
ran, the time from the last POST until every task had its Slurm job, slurmctld's RPCs per task
from `sdiag` before and after (REQUEST_SUBMIT_BATCH_JOB, and every RPC of the user: the
bridge's squeue, sacct and scancel too), and the bridge's own Slurm calls per poll cycle
(`tes_bridge_slurm_calls_total` over `tes_bridge_poll_cycle_seconds_count`). The cluster is
shared by everyone on it as root: run it alone (`flock -x -o /tmp/cluster.lock`).

    python -m bench arrays
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shutil
import sqlite3
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from bench.common import (
    PYTHON,
    REPO,
    bridge_env,
    free_port,
    list_tasks,
    log_file,
    scratch,
    stop,
    table,
    wait_http,
    write_config,
    write_result,
)
from bench.e2e import cluster, container_toml, slurm, wait_queue_empty
from bridge.config import StagingConfig
from bridge.slurm import SlurmClient

TASKS = int(os.environ.get("BENCH_ARRAYS_TASKS", "1000"))
SHAPES = int(os.environ.get("BENCH_ARRAYS_SHAPES", "20"))
LONE = int(os.environ.get("BENCH_ARRAYS_LONE", "5"))
BURST = int(os.environ.get("BENCH_ARRAYS_BURST", "10000"))
STAGED = int(os.environ.get("BENCH_ARRAYS_STAGED", "200"))
#: The staged sides' staging.stage_in_nice (the default; 0 shows a burst's order without it).
DEFAULT_STAGE_IN_NICE = StagingConfig.model_fields["stage_in_nice"].default
STAGE_IN_NICE = int(os.environ.get("BENCH_ARRAYS_STAGE_IN_NICE", DEFAULT_STAGE_IN_NICE))
#: The sides to run (all by default): a 10,000-task makespan takes about half an hour a side
#: on the local cluster, so a run may take only those it compares.
ALL_SIDES = ("bridge", "shapes", "lone", "raw-array", "raw-loop", "never", "budget")
#: The staged tasks' sides, run only when named (see the module's docstring), by their labels.
STAGED_SIDES = {"staged": "staged, 3 arrays", "staged-never": "staged, one chain per task"}
SIDES = [
    side.strip()
    for side in os.environ.get("BENCH_ARRAYS_SIDES", ",".join(ALL_SIDES)).split(",")
    if side.strip()
]
TERMINAL = {"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED"}
SLEEP = [{"image": "alpine", "command": ["sleep", "1"]}]
#: The account the bridge and the raw sides run as; root by default. Slurm's rate limit
#: (`SlurmctldParameters=rl_enable`, 23.02 and later) spares root and SlurmUser, so a plain
#: account (`BENCH_ARRAYS_USER=tesbridge`) is how both sides meet it: the raw loop's sbatch
#: waits whenever slurmctld tells it to back off, and the bridge keeps its default call budget,
#: which it lowers under slurmctld's limit itself.
USER = os.environ.get("BENCH_ARRAYS_USER", "")
#: A Python USER can run (one under /root is not); it runs the bridge from this checkout.
USER_PYTHON = os.environ.get("BENCH_ARRAYS_PYTHON", PYTHON)
#: The bridges' log level; with BENCH_KEEP=1 their files (serve.log, tasks.db) are kept.
LOG_LEVEL = os.environ.get("BENCH_ARRAYS_LOG_LEVEL", "WARNING")
#: The [slurm] settings of the bridge without a call budget (its defaults for a plain account,
#: which Slurm limits anyway), and of the one under Slurm's.
UNLIMITED = 'arrays = "auto"' + ("" if USER else "\ncalls_per_second = 0")
BUDGET = 'arrays = "auto"\ncalls_per_second = 2\ncalls_burst = 30'
NEVER = 'arrays = "never"\ncalls_per_second = 0'
#: What a staged task's input holds, and its executor copies to its output.
STAGED_DATA = b"staged input\n"
#: The attempt's metadata that names each job of a staged task's chain (bridge.poller.chain).
CHAIN_KEYS = ("slurm_stage_in_job_id", "slurm_job_id", "slurm_stage_out_job_id")


def as_user() -> dict[str, Any]:
    """subprocess's arguments that run a command as USER (nothing for root)."""
    if not USER:
        return {}
    gid = pwd.getpwnam(USER).pw_gid
    return {"user": USER, "group": gid, "extra_groups": os.getgrouplist(USER, gid)}


def user_slurm(*argv: str) -> str:
    """A Slurm command as USER, as a user of the cluster runs it."""
    return slurm(*argv, **as_user())


def rpc_counts() -> dict[str, int]:
    """slurmctld's RPC counts (sdiag): submissions, and every RPC of this user."""
    out = slurm("sdiag")
    submits = re.search(r"REQUEST_SUBMIT_BATCH_JOB\s+\(\s*\d+\)\s+count:(\d+)", out)
    name, uid = (USER, pwd.getpwnam(USER).pw_uid) if USER else ("root", os.geteuid())
    user = re.search(rf"^\s*{name}\s+\(\s*{uid}\)\s+count:(\d+)", out, re.MULTILINE)
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
        user_slurm("sbatch", "--parsable", f"--job-name=bench-loop-{i}", "-o", "/dev/null",
              *directives, str(script)).strip().split(";")[0]
        for i in range(count)
    ]  # fmt: skip
    wait_jobs_gone(ids)
    return time.perf_counter() - started


def raw_arrays(count: int) -> int:
    """How many `sbatch --array` a user sends for `count` jobs (split at MaxArraySize)."""
    return -(-count // SlurmClient().max_array_size())


def raw_array(count: int, script: Path, directives: list[str], array: bool = True) -> float:
    """`count` jobs as `sbatch --array` (as many as MaxArraySize asks for, back to back), or
    with array=False one plain job: the first sbatch to the last element leaving squeue."""
    size = SlurmClient().max_array_size()
    started = time.perf_counter()
    ids = [
        user_slurm(
            "sbatch", "--parsable", "--job-name=bench-array", "-o", "/dev/null",
            *([f"--array=0-{min(size, count - first) - 1}"] if array else []),
            *directives, str(script),
        ).strip().split(";")[0]
        for first in range(0, count, size)
    ]  # fmt: skip
    wait_jobs_gone(ids)
    return time.perf_counter() - started


@dataclass
class Bridge:
    """One `tes-bridge serve` of the run, with its own state and the shared image cache."""

    root: Path
    base: str

    @property
    def api(self) -> str:
        return f"{self.base}/ga4gh/tes/v1"

    def _store(self, sql: str) -> list[tuple[Any, ...]]:
        """Rows of the store, read-only (it holds what the API does not show)."""
        with sqlite3.connect(f"file:{self.root / 'tasks.db'}?mode=ro", uri=True) as db:
            return db.execute(sql).fetchall()

    def unsubmitted(self) -> int:
        """Tasks without their Slurm job."""
        return int(self._store("SELECT COUNT(*) FROM tasks WHERE job_id IS NULL")[0][0])

    def unchained(self) -> int:
        """Tasks whose attempt does not name each of its chain's three jobs yet."""
        missing = " OR ".join(
            f"json_extract(logs, '$[#-1].metadata.{k}') IS NULL" for k in CHAIN_KEYS
        )
        return int(self._store(f"SELECT COUNT(*) FROM tasks WHERE {missing}")[0][0])

    def job_ids(self) -> set[str]:
        """The Slurm jobs of the tasks (an array's id once for all its elements)."""
        rows = self._store("SELECT job_id FROM tasks WHERE job_id IS NOT NULL")
        return {str(row[0]).split("_")[0] for row in rows}

    def counters(self) -> dict[str, float]:
        """Slurm calls (all, and sbatch's) and poll cycles so far, from /metrics."""
        text = requests.get(f"{self.base}/metrics", timeout=10).text
        out = {"calls": 0.0, "sbatch": 0.0, "cycles": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "tes_bridge_slurm_calls_total":
                    out["calls"] += sample.value
                    if sample.labels.get("command") == "sbatch":
                        out["sbatch"] += sample.value
                elif sample.name == "tes_bridge_poll_cycle_seconds_count":
                    out["cycles"] += sample.value
        return out


@contextmanager
def bridge(
    info: dict[str, str], root: Path, name: str, slurm: str, sections: str = ""
) -> Iterator[Bridge]:
    """A bridge of the local cluster's container settings, these [slurm] keys, and `sections`
    (whole TOML sections)."""
    home = root / name
    home.mkdir()
    extra = f"{container_toml(info, root / 'images')}[slurm]\n{slurm}\n{sections}"
    config = write_config(home, f"sqlite:///{home}/tasks.db", extra=extra)
    bind = config.read_text().split('bind = "')[1].split('"')[0]
    if USER:  # its state and the image cache are the account's, as on a login node
        (root / "images").mkdir(exist_ok=True)
        for path in [root / "images", home, *home.rglob("*")]:
            shutil.chown(path, USER, pwd.getpwnam(USER).pw_gid)
    server = subprocess.Popen(
        [USER_PYTHON, "-m", "bridge", "--config", str(config), "--log-level", LOG_LEVEL,
         "serve"],
        env=bridge_env(), stderr=log_file(home / "serve.log"), cwd=REPO, **as_user(),
    )  # fmt: skip
    try:
        running = Bridge(home, f"http://{bind}")
        wait_http(f"{running.api}/service-info")
        yield running
    finally:
        stop(server)


def shape_of(index: int, shapes: int) -> dict[str, Any]:
    """Task `index`'s resources: one of `shapes` memory sizes, 10 MiB apart."""
    if shapes <= 1:
        return {}
    return {"resources": {"ram_gb": round(0.25 + 0.01 * (index % shapes), 2)}}


def bridge_burst(service: Bridge, count: int, shapes: int = 1) -> dict[str, float]:
    """`count` tasks posted at once: the makespan, the seconds from the last POST until every
    task had its job, how many jobs (arrays or single) carried them, and the bridge's Slurm
    calls per poll cycle meanwhile."""
    run = uuid.uuid4().hex
    bodies = [
        json.dumps({"executors": SLEEP, "tags": {"bench": run}, **shape_of(i, shapes)})
        for i in range(count)
    ]
    figures, tasks = posted_burst(service, bodies, run, service.unsubmitted)
    assert all(t["state"] == "COMPLETE" for t in tasks), [t["state"] for t in tasks][:5]
    jobs = {t["logs"][0]["metadata"]["slurm_job_id"].split("_")[0] for t in tasks}
    return {**figures, "jobs": len(jobs)}


def posted_burst(
    service: Bridge, bodies: list[str], run: str, waiting: Callable[[], int]
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The tasks `bodies` (each tagged `bench: run`) posted at once: the makespan, the seconds
    from the last POST until `waiting()` (tasks without their jobs) was 0, the bridge's sbatch
    calls and its Slurm calls per poll cycle meanwhile; and the tasks (FULL) once all ended."""
    session = requests.Session()
    before = service.counters()
    started = time.perf_counter()
    for body in bodies:
        session.post(f"{service.api}/tasks", data=body).raise_for_status()
    last_post = time.perf_counter()
    all_submitted = threading.Event()
    submitted_at = [0.0]

    def watch_submissions() -> None:
        while waiting():
            time.sleep(0.05)
        submitted_at[0] = time.perf_counter()
        all_submitted.set()

    threading.Thread(target=watch_submissions, daemon=True).start()
    ended, tasks = wait_final(session, service.api, run, len(bodies))
    all_submitted.wait(60)
    after = service.counters()
    figures = {
        "makespan_s": ended - started,
        "submitted_after_last_post_s": submitted_at[0] - last_post,
        "sbatch_calls": after["sbatch"] - before["sbatch"],
        **cycle_figures(before, after),
    }
    return figures, tasks


def cycle_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The poll cycles between two readings of `Bridge.counters`, and the Slurm calls per
    cycle, with and without sbatch."""
    cycles = max(after["cycles"] - before["cycles"], 1.0)
    calls = after["calls"] - before["calls"]
    return {
        "poll_cycles": cycles,
        "calls_per_cycle": calls / cycles,
        "calls_per_cycle_without_sbatch": (calls - (after["sbatch"] - before["sbatch"])) / cycles,
    }


def submission_burst(service: Bridge, count: int) -> dict[str, float]:
    """`count` tasks POSTed as fast as one client can: the seconds from the last POST until
    every task had its job, how many jobs carried them, and the Slurm calls per poll cycle
    until then; then every job is scanceled and the queue left empty."""
    session = requests.Session()
    body = json.dumps({"executors": SLEEP})
    before = service.counters()
    known = service.job_ids()
    started = time.perf_counter()
    for _ in range(count):
        session.post(f"{service.api}/tasks", data=body).raise_for_status()
    last_post = time.perf_counter()
    while service.unsubmitted():
        time.sleep(0.05)
    submitted = time.perf_counter()
    after = service.counters()
    jobs = service.job_ids() - known
    slurm("scancel", *sorted(jobs))
    return {
        "posting_s": last_post - started,
        "jobs": len(jobs),
        "submitted_after_last_post_s": submitted - last_post,
        **cycle_figures(before, after),
    }


def wait_final(
    session: requests.Session, api: str, run: str, count: int
) -> tuple[float, list[dict[str, Any]]]:
    """When all the run's tasks were seen ended (perf_counter), and the tasks (FULL) then.
    Their states are polled in the MINIMAL view, every 0.2 s (1 s past 1,000 tasks): polling
    10,000 tasks' full logs would cost the machine's two cores more than the bridge does."""
    params = {"tag_key": "bench", "tag_value": run, "page_size": "2047", "view": "MINIMAL"}
    poll = 0.2 if count <= 1000 else 1.0
    while True:
        tasks = list_tasks(api, params, session)
        if len(tasks) == count and all(t["state"] in TERMINAL for t in tasks):
            ended = time.perf_counter()
            return ended, list_tasks(api, {**params, "view": "FULL"}, session)
        time.sleep(poll)


def measured(side: str, results: dict[str, dict[str, float]], run: Any, count: int) -> None:
    """One side of the table: `run()` between two `sdiag` readings, with an empty queue."""
    wait_queue_empty(timeout=1800)
    before = rpc_counts()
    figures = run()
    results[side] = {**figures, **per_task(before, rpc_counts(), count)}
    print(f"  {side}: {results[side]}", flush=True)


def raw_side(seconds: float, jobs: int) -> dict[str, float]:
    return {"makespan_s": seconds, "jobs": jobs}


def lone_latencies(service: Bridge, raw_script: Path, directives: list[str]) -> dict[str, Any]:
    """POST to COMPLETE of a lone task (polled every 20 ms), against sbatch to the same job
    leaving squeue, alternately."""
    session = requests.Session()
    body = json.dumps({"executors": SLEEP})
    bridge_s, raw_s = [], []
    for _ in range(LONE):
        wait_queue_empty()
        raw_s.append(raw_array(1, raw_script, directives, array=False))
        wait_queue_empty()
        started = time.perf_counter()
        task_id = session.post(f"{service.api}/tasks", data=body).json()["id"]
        while session.get(f"{service.api}/tasks/{task_id}").json()["state"] not in TERMINAL:
            time.sleep(0.02)
        bridge_s.append(time.perf_counter() - started)
    return {
        "bridge_s": bridge_s,
        "raw_s": raw_s,
        "added_s": statistics.median(bridge_s) - statistics.median(raw_s),
    }


def main() -> dict[str, object]:
    info = cluster()
    root = scratch("arrays", info["LOCAL_CLUSTER_SHARED_DIR"])
    os.chmod(root, 0o755)
    results: dict[str, dict[str, float]] = {}
    lone: dict[str, dict[str, Any]] = {}
    with bridge(info, root, "auto", UNLIMITED) as service:
        directives, raw_script = warm_up(info, root, service)
        unlimited_sides(service, results, lone, raw_script, directives)
    raw_sides(results, raw_script, directives)
    later_bridge_sides(info, root, results, lone, raw_script, directives)
    staged_sides(info, root, results)
    ratios = makespan_ratios(results)
    report(results, ratios, lone, directives)
    data = {
        "tasks": TASKS,
        "shapes": SHAPES,
        "staged_tasks": STAGED,
        "stage_in_nice": STAGE_IN_NICE,
        "directives": directives,
        "sides": results,
        "ratios": ratios,
        "lone": lone,
    }
    data["sides_run"] = SIDES
    # Another size, or some sides only, are kept beside the default run's figures.
    whole = TASKS == 1000 and set(SIDES) == set(ALL_SIDES)
    size = STAGED if set(SIDES) <= set(STAGED_SIDES) else TASKS
    name = f"arrays-{size}-{'+'.join(SIDES)}" if SIDES else f"arrays-burst-{BURST}"
    if STAGE_IN_NICE != DEFAULT_STAGE_IN_NICE and set(SIDES) & set(STAGED_SIDES):
        name += f"-nice{STAGE_IN_NICE}"
    write_result("arrays" if whole else name, data)
    if os.environ.get("BENCH_KEEP") == "1":
        print(f"kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return data


def warm_up(info: dict[str, str], root: Path, service: Bridge) -> tuple[list[str], Path]:
    """One task through the bridge (the image pulled once; the raw sides use the same SIF):
    its job's Slurm resources, and the raw sides' job script running the same command."""
    wait_queue_empty()
    bridge_burst(service, 1)
    sif = next((root / "images").rglob("*.sif"))
    script = next((service.root / "state" / "work").glob("*/job.sh")).read_text()
    raw_script = root / "raw.sh"
    raw_script.write_text(
        f"#!/bin/sh\nexec {info['LOCAL_CLUSTER_APPTAINER']} exec "
        f"{info['LOCAL_CLUSTER_APPTAINER_FLAGS']} {sif} sleep 1\n"
    )
    return sbatch_directives(script), raw_script


def sbatch_directives(script: str) -> list[str]:
    """The job script's #SBATCH resources (CPUs, memory, time, partition, nodes, tasks)."""
    return [
        line.split(None, 1)[1]
        for line in script.splitlines()
        if line.startswith("#SBATCH") and line.split(None, 1)[1].startswith(
            ("--cpus", "--mem", "--time", "--partition", "--nodes", "--ntasks")
        )
    ]  # fmt: skip


def unlimited_sides(
    service: Bridge,
    results: dict[str, dict[str, float]],
    lone: dict[str, dict[str, Any]],
    raw_script: Path,
    directives: list[str],
) -> None:
    """The bridge without a call budget: one shape, `SHAPES` shapes, and lone tasks."""
    if "bridge" in SIDES:
        measured("bridge", results, lambda: bridge_burst(service, TASKS), TASKS)
    if "shapes" in SIDES:
        measured(
            f"bridge, {SHAPES} shapes",
            results,
            lambda: bridge_burst(service, TASKS, SHAPES),
            TASKS,
        )
    if "lone" in SIDES:
        lone["no budget"] = lone_latencies(service, raw_script, directives)


def raw_sides(
    results: dict[str, dict[str, float]], raw_script: Path, directives: list[str]
) -> None:
    """The same jobs without the bridge: as `sbatch --array`, and as a loop of sbatch."""
    if "raw-array" in SIDES:
        measured(
            "raw array",
            results,
            lambda: raw_side(raw_array(TASKS, raw_script, directives), raw_arrays(TASKS)),
            TASKS,
        )
    if "raw-loop" in SIDES:
        measured(
            "raw loop",
            results,
            lambda: raw_side(raw_loop(TASKS, raw_script, directives), TASKS),
            TASKS,
        )


def later_bridge_sides(
    info: dict[str, str],
    root: Path,
    results: dict[str, dict[str, float]],
    lone: dict[str, dict[str, Any]],
    raw_script: Path,
    directives: list[str],
) -> None:
    """Each in a bridge of its own: one job per task, the call budget, the submission burst."""
    if "never" in SIDES:
        with bridge(info, root, "never", NEVER) as service:
            measured(
                f"one job per task, {SHAPES} shapes",
                results,
                lambda: bridge_burst(service, TASKS, SHAPES),
                TASKS,
            )
    if "budget" in SIDES:
        budget_side(info, root, results, lone, raw_script, directives)
    if BURST:
        with bridge(info, root, "burst", UNLIMITED) as service:
            measured(
                f"submission burst of {BURST}", results,
                lambda: submission_burst(service, BURST), BURST,
            )  # fmt: skip
            wait_queue_empty(timeout=1800)


def budget_side(
    info: dict[str, str],
    root: Path,
    results: dict[str, dict[str, float]],
    lone: dict[str, dict[str, Any]],
    raw_script: Path,
    directives: list[str],
) -> None:
    """The bridge under Slurm's default rate limit: the burst, then lone tasks."""
    with bridge(info, root, "budget", BUDGET) as service:
        measured(
            "bridge, budget 2/s burst 30", results, lambda: bridge_burst(service, TASKS), TASKS
        )
        if "lone" in SIDES:
            lone["budget 2/s burst 30"] = lone_latencies(service, raw_script, directives)


def staged_sides(info: dict[str, str], root: Path, results: dict[str, dict[str, float]]) -> None:
    """Staged tasks, each side in a bridge of its own, against one loopback HTTP server."""
    sides = [side for side in STAGED_SIDES if side in SIDES]
    if not sides:
        return
    task_partition = info.get("LOCAL_CLUSTER_OFFLINE_PARTITION") or info["LOCAL_CLUSTER_PARTITION"]
    transfer = (
        info.get("LOCAL_CLUSTER_TRANSFER_PARTITION") or info["LOCAL_CLUSTER_PREEMPTIBLE_PARTITION"]
    )
    staging = (
        f'[staging]\nwhere = "transfer"\ntransfer_partition = "{transfer}"\n'
        'transfer_time_limit = "10:00"\ntransfer_memory_mb = 256\nhttp_upload = true\n'
        f"stage_in_nice = {STAGE_IN_NICE}\n"
    )
    with http_server(root / "http") as url:
        for side in sides:
            slurm = UNLIMITED if side == "staged" else NEVER
            with bridge(info, root, side, slurm, staging) as service:
                measured(
                    STAGED_SIDES[side], results,
                    lambda: staged_burst(service, root / "http", url, task_partition), STAGED,
                )  # fmt: skip


@contextmanager
def http_server(root: Path) -> Iterator[str]:
    """The tests' loopback HTTP server (GET, and PUT for outputs) serving `root`, holding the
    staged tasks' input; its URL."""
    root.mkdir()
    (root / "in.txt").write_bytes(STAGED_DATA)
    port = free_port()
    server = subprocess.Popen(
        [PYTHON, "-m", "tests.fixtures.storage", "http", str(root), str(port), "bench",
         secrets.token_hex(8)],
        stderr=log_file(root.parent / "http.log"), cwd=REPO,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/in.txt")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(server)


def staged_burst(service: Bridge, served: Path, url: str, partition: str) -> dict[str, float]:
    """STAGED staged tasks posted at once (`posted_burst`, until each had its three jobs), each
    checked COMPLETE with its output right; how many Slurm jobs (arrays or single) carried
    their chains."""
    run = uuid.uuid4().hex
    bodies = [
        json.dumps({
            "executors": [{"image": "alpine", "command": ["sh", "-c", "cat /in/x > /out/y"]}],
            "inputs": [{"path": "/in/x", "url": f"{url}/in.txt"}],
            "outputs": [{"path": "/out/y", "url": f"{url}/out/{run}/{i}"}],
            "resources": {"backend_parameters": {"partition": partition}},
            "tags": {"bench": run},
        })
        for i in range(STAGED)
    ]  # fmt: skip
    first_post = time.time()
    figures, tasks = posted_burst(service, bodies, run, service.unchained)
    ends = sorted(_ended_at(t) - first_post for t in tasks)
    wrong = [t for t in tasks if t["state"] != "COMPLETE" or not output_right(t, served, url)]
    if wrong:
        raise RuntimeError(f"{len(wrong)} of {STAGED} staged tasks did not complete with their "
                           f"output (the bridge's log: {service.root / 'serve.log'}):\n"
                           + "\n".join(staged_failure(t) for t in wrong[:20]))  # fmt: skip
    chains = [t["logs"][-1]["metadata"] for t in tasks]
    jobs = {m[key].split("_")[0] for m in chains for key in CHAIN_KEYS}
    return {
        **figures, "jobs": len(jobs), "complete": len(tasks),
        "first_task_end_s": ends[0], "median_task_end_s": statistics.median(ends),
    }  # fmt: skip


def _ended_at(task: dict[str, Any]) -> float:
    """When the task's last attempt ended (its end_time), as a Unix time."""
    return datetime.fromisoformat(task["logs"][-1]["end_time"]).timestamp()


def output_right(task: dict[str, Any], served: Path, url: str) -> bool:
    """The task's output is on the server, a copy of its input."""
    out = served / str(task["outputs"][0]["url"]).removeprefix(f"{url}/")
    return out.is_file() and out.read_bytes() == STAGED_DATA


def staged_failure(task: dict[str, Any]) -> str:
    """A staged task that did not complete: its id, state, chain and last system log lines."""
    log = (task.get("logs") or [{}])[-1]
    chain = [log.get("metadata", {}).get(key, "-") for key in CHAIN_KEYS]
    return (
        f"  {task['id']} {task['state']} jobs {' '.join(chain)}: {log.get('system_logs', [])[-3:]}"
    )


def makespan_ratios(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """The makespans compared, of the sides both run."""
    compared = {
        "makespan_vs_raw_array": ("bridge", "raw array"),
        "makespan_vs_raw_loop": ("bridge", "raw loop"),
        "budget_vs_unlimited": ("bridge, budget 2/s burst 30", "bridge"),
        "shapes_arrays_vs_one_job_per_task": (
            f"bridge, {SHAPES} shapes",
            f"one job per task, {SHAPES} shapes",
        ),
        "staged_arrays_vs_one_chain_per_task": tuple(STAGED_SIDES.values()),
    }
    return {
        name: results[side]["makespan_s"] / results[base]["makespan_s"]
        for name, (side, base) in compared.items()
        if side in results and base in results
    }


def report(
    results: dict[str, dict[str, float]],
    ratios: dict[str, float],
    lone: dict[str, dict[str, Any]],
    directives: list[str],
) -> None:
    """The sides and ratios as tables, and the lone tasks' medians."""
    staged = {side: r for side, r in results.items() if side in STAGED_SIDES.values()}
    rows = [
        [side, r.get("makespan_s", "-"), int(r["jobs"]), r.get("submitted_after_last_post_s", "-"),
         r["submit"], r["user"], r.get("calls_per_cycle_without_sbatch", "-")]
        for side, r in results.items() if side not in staged
    ]  # fmt: skip
    if rows:
        print(f"{TASKS} one-second tasks (alpine sleep 1; sbatch {' '.join(directives)})")
        table(
            ["side", "makespan s", "jobs", "last POST to all submitted s", "submit RPCs/task",
             "all RPCs/task", "Slurm calls/cycle (no sbatch)"],
            rows,
        )  # fmt: skip
    if staged:
        print(f"{STAGED} staged tasks (HTTP in and out on the transfer partition; cat)")
        table(
            ["side", "COMPLETE", "makespan s", "first / median task end s", "jobs",
             "last POST to all 3 jobs s", "submit RPCs", "all RPCs/task", "Slurm calls/cycle",
             "(no sbatch)"],
            [[side, int(r["complete"]), r["makespan_s"],
              f"{r['first_task_end_s']:.1f} / {r['median_task_end_s']:.1f}", int(r["jobs"]),
              r["submitted_after_last_post_s"], round(r["submit"] * STAGED), r["user"],
              r["calls_per_cycle"], r["calls_per_cycle_without_sbatch"]]
             for side, r in staged.items()],
        )  # fmt: skip
    table(["ratio", "value"], [[k, v] for k, v in ratios.items()])
    for name, figures in lone.items():
        print(
            f"lone task ({name}), POST to COMPLETE: bridge median "
            f"{statistics.median(figures['bridge_s']):.2f} s, raw sbatch "
            f"{statistics.median(figures['raw_s']):.2f} s, added {figures['added_s']:+.2f} s"
        )


if __name__ == "__main__":
    main()
