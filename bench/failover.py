"""Failover between two login nodes (docs/operations.md, "Two login nodes") on the local cluster:
two whole services (`tes-bridge serve`: API and poller), each with its own state directory, on
one private PostgreSQL, the shared work directory and image cache, the default lease (10 s).

- failover: the leading node dies (kill -9 of every process of its service) in the middle of a
  burst; the time from the kill to the first sbatch the other node runs (each node's sbatch is
  a wrapper that logs when it starts), and to the lease taken.
- makespan: a burst of BENCH_FAILOVER_TASKS (1000) one-second tasks (`alpine sleep 1`), first
  POST to the last task ended, with that failover when half of them are posted, against the same
  burst with no failover (run first, on the same two nodes). The tasks are posted to the node
  that stays up (in front of real nodes a balancer does that: tests/cluster/test_failover.py).
- lost (a task of either burst that did not end COMPLETE) and twice (a task with more than one
  Slurm job: squeue and sacct by job name, job array elements mapped to their tasks through the
  arrays' scripts).

The cluster is shared by everyone on it as root: run it alone (`flock -x -o /tmp/cluster.lock`).

    BENCH_FAILOVER_TASKS=1000 python -m bench failover
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg2
import requests

from bench.common import (
    PYTHON,
    bridge_env,
    list_tasks,
    log_file,
    postgres_server,
    scratch,
    slurm_jobs_by_task,
    table,
    wait_http,
    write_config,
    write_result,
)
from bench.e2e import cluster, container_toml, wait_queue_empty
from bridge.config import PollerConfig
from bridge.store import LEASE_TABLE

TASKS = int(os.environ.get("BENCH_FAILOVER_TASKS", "1000"))
LEASE = PollerConfig().lease_seconds
TERMINAL = {"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED", "PREEMPTED"}
SLEEP = [{"image": "alpine", "command": ["sleep", "1"]}]


@dataclass
class Node:
    """One login node's whole service: `tes-bridge serve`, in a process group of its own."""

    name: str
    root: Path
    config: Path
    api: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [PYTHON, "-m", "bridge", "--config", str(self.config), "serve"]
        self.process = subprocess.Popen(
            argv,
            env=bridge_env(),
            stdout=log_file(self.root / "serve.log"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_http(f"{self.api}/service-info")

    def kill(self) -> float:
        """kill -9 of every process of the service (the node dies); when, by time.time()."""
        assert self.process is not None
        killed = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        return killed

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def make_node(name: str, root: Path, shared: Path, database: str, info: dict[str, str]) -> Node:
    """A node's config: its own state directory under `root`, an sbatch that logs its calls to
    shared/sbatch.log (time and node) before it runs the real one."""
    root.mkdir(parents=True)
    wrapper = root / "sbatch"
    wrapper.write_text(
        f'#!/bin/sh\necho "$(date +%s.%N) {name}" >> {shared / "sbatch.log"}\nexec sbatch "$@"\n'
    )
    wrapper.chmod(0o755)
    extra = container_toml(info, shared / "images") + (
        f'[slurm]\nsbatch = "{wrapper}"\n[poller]\nnode_name = "{name}"\n'
        f'[job]\nwork_dir = "{shared / "work"}"\n'
    )
    config = write_config(root, database, extra=extra)
    bind = config.read_text().split('bind = "')[1].split('"')[0]
    return Node(name, root, config, f"http://{bind}/ga4gh/tes/v1")


def leader(database: str) -> str | None:
    """The node whose poller holds the lease (ended or not)."""
    with psycopg2.connect(database) as conn, conn.cursor() as cursor:
        cursor.execute(f'SELECT holder FROM "{LEASE_TABLE}"')
        row = cursor.fetchone()
    conn.close()
    return str(row[0]).split()[0] if row and row[0] else None


def wait_for(condition: Any, timeout: float, what: str, step: float = 0.05) -> float:
    """time.time() once `condition()` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(step)
    return time.time()


def sbatch_calls(shared: Path) -> list[tuple[float, str]]:
    path = shared / "sbatch.log"
    lines = path.read_text().split("\n") if path.exists() else []
    return [(float(t), name) for t, name in (line.split() for line in lines if line.strip())]


def list_run(api: str, run: str) -> list[dict[str, Any]]:
    """The tasks tagged with this run (FULL view: their logs)."""
    return list_tasks(
        api, {"tag_key": "bench", "tag_value": run, "view": "FULL", "page_size": "500"}
    )


def states(api: str, run: str) -> list[str]:
    listed = list_tasks(api, {"tag_key": "bench", "tag_value": run, "page_size": "2047"})
    return [t["state"] for t in listed]


def burst(
    api: str, count: int, at_half: Any = None, timeout: float = 3600
) -> tuple[str, list[str], float]:
    """`count` tasks posted at once (with `at_half()` called, in a thread, once half of them
    are in); (run tag, their ids, makespan: the first POST to the last task ended)."""
    run = uuid.uuid4().hex
    task = {"executors": SLEEP, "tags": {"bench": run}}
    session = requests.Session()
    ids: list[str] = []
    side = None
    started = time.perf_counter()
    for i in range(count):
        if i == count // 2 and at_half is not None:
            side = threading.Thread(target=at_half)
            side.start()
        answer = session.post(f"{api}/tasks", json=task, timeout=60)
        answer.raise_for_status()
        ids.append(answer.json()["id"])
    deadline = time.monotonic() + timeout
    while True:
        seen = states(api, run)
        if len(seen) == count and all(s in TERMINAL for s in seen):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{sum(s in TERMINAL for s in seen)} of {count} ended in time")
        time.sleep(0.5)
    makespan = time.perf_counter() - started
    if side is not None:
        side.join()
    return run, ids, makespan


def outcome(api: str, run: str, work_dir: Path) -> dict[str, Any]:
    """lost: tasks not COMPLETE; twice: tasks with more than one Slurm job."""
    tasks = list_run(api, run)
    jobs = slurm_jobs_by_task(work_dir, tasks)
    return {
        "tasks": len(tasks),
        "lost": sum(t["state"] != "COMPLETE" for t in tasks),
        "twice": sum(len(found) > 1 for found in jobs.values()),
        "no_job": sum(not found for found in jobs.values()),
    }


def main() -> dict[str, Any]:
    info = cluster()
    # The compute nodes see the shared filesystem, not the login node's /var/tmp.
    shared = scratch("failover", info["LOCAL_CLUSTER_SHARED_DIR"])
    os.chmod(shared, 0o755)
    root = scratch("failover-nodes")
    nodes: list[Node] = []
    try:
        with postgres_server() as server:
            a, b = nodes = [
                make_node(n, root / n, shared, server.url, info) for n in ("nodeA", "nodeB")
            ]
            a.start()
            wait_for(lambda: leader(server.url) == "nodeA", 60, "nodeA never led")
            b.start()
            wait_queue_empty()
            burst(b.api, 1)  # the image is pulled once, before any clock matters
            wait_queue_empty()
            run_plain, _, plain = burst(b.api, TASKS)
            wait_queue_empty()
            killed: list[float] = []
            run_failover, _, failover = burst(b.api, TASKS, lambda: killed.append(a.kill()))
            first_sbatch = min(t for t, who in sbatch_calls(shared) if who == "nodeB")
            checks = {
                "plain": outcome(b.api, run_plain, shared / "work"),
                "failover": outcome(b.api, run_failover, shared / "work"),
            }
            lease_taken = _lease_taken(b)
    finally:
        for node in nodes:
            node.stop()
        shutil.rmtree(root, ignore_errors=True)
    failover_seconds = first_sbatch - killed[0]
    lost = sum(c["lost"] for c in checks.values())
    twice = sum(c["twice"] for c in checks.values())
    rows = [
        ["leader killed -9 -> first sbatch by the other node, s", failover_seconds, "<= 15"],
        ["leader killed -9 -> lease taken (its log), s", lease_taken - killed[0], ""],
        [f"{TASKS} one-second tasks, makespan without failover, s", plain, ""],
        [f"{TASKS} one-second tasks, makespan with one failover, s", failover, ""],
        ["makespan ratio", failover / plain, "<= 1.1"],
        ["tasks lost (not COMPLETE)", lost, "0"],
        ["tasks run twice (more than one Slurm job)", twice, "0"],
    ]
    print(f"failover between two login nodes (lease {LEASE:g} s, PostgreSQL)")
    table(["measure", "value", "target"], rows)
    data = {
        "tasks": TASKS,
        "lease_seconds": LEASE,
        "failover_seconds": failover_seconds,
        "lease_taken_seconds": lease_taken - killed[0],
        "makespan_plain_s": plain,
        "makespan_failover_s": failover,
        "makespan_ratio": failover / plain,
        "lost": lost,
        "twice": twice,
        "checks": checks,
    }
    write_result("failover", data)
    shutil.rmtree(shared, ignore_errors=True)
    return data


def _lease_taken(node: Node) -> float:
    """When `node`'s poller took the lease, by its log (time.time())."""
    for line in (node.root / "serve.log").read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("message") == "this poller took the lease":
                return datetime.fromisoformat(record["time"]).timestamp()
    raise RuntimeError(f"{node.name} never took the lease")


if __name__ == "__main__":
    main()
