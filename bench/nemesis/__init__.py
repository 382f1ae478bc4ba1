"""Nemesis: tasks flow through the bridge on the local cluster while a fault strikes every
30 s, chosen at random (they may overlap):

- kill -9 of the poller (its supervisor in `serve` starts it again), of an API worker
  (gunicorn's master starts another) or of gunicorn's master (started again after 5 s, as
  systemd's `Restart=` with `RestartSec=5` would: nothing else restarts it);
- kill -9 of slurmctld, started again after 10-30 s;
- a compute node lost (its slurmd and every process of its jobs killed), back after 20-60 s;
- the registry stalled (SIGSTOP, SIGCONT after 10-30 s);
- the work filesystem (a tmpfs under the shared directory) filled, freed after 10-30 s;
- PostgreSQL restarted (when the store is PostgreSQL).

The tasks: one-second tasks, tasks with inputs and outputs on the shared filesystem and over
HTTP and S3 (rclone serve webdav and s3), a few that fail by themselves (exit 3), and the
Snakemake 7 workflow of the engine tests, with their client and image (built by their recipe
first when not cached yet), again and again. At the end, against sacct and the API: every
task final and listed (none lost), one job per task that ran it to its end (COMPLETED, or
FAILED with its executor's exit code) and every other job of it a real failure named in its
logs[] (none twice), every task in the state its own command explains
(none falsely failed), the outputs right, no 5xx while the API was up (the seconds it was
really down come from the faults injected), the p99 latency outside those seconds, and the
poller's RSS and open files over the run.

    BENCH_NEMESIS_MINUTES=20 BENCH_NEMESIS_STORES=sqlite,postgres python -m bench nemesis

BENCH_NEMESIS_TASKS (default 100 a minute), BENCH_NEMESIS_SEED (replays a run's choices),
BENCH_NEMESIS_INTERVAL (30 s between faults). Run it alone on the cluster (it kills shared
daemons): `flock -x -o /tmp/cluster.lock ...`. Every fault is undone at the end, whatever happens.

Modules: `cluster` (the local cluster's daemons and nodes), `service` (the bridge under test),
`workload` (the tasks, the client's load and its record of requests), `workflow` (Snakemake),
`faults` (`Nemesis`: injects and undoes them), `checks` (the verdict against sacct and the
API), `report` (the poller's samples, `passed`) and `run` (`run_nemesis`: one run, all of
them together).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from bench.common import table, write_result
from bench.nemesis.checks import ran_twice
from bench.nemesis.report import passed
from bench.nemesis.run import run_nemesis

__all__ = ["main", "passed", "ran_twice", "run_nemesis"]

MINUTES = float(os.environ.get("BENCH_NEMESIS_MINUTES", "20"))


def main() -> dict[str, Any]:
    # "sqlite,postgres"; a store may name its own length: "sqlite,postgres:10".
    stores = os.environ.get("BENCH_NEMESIS_STORES", "sqlite,postgres").split(",")
    seed = int(os.environ.get("BENCH_NEMESIS_SEED", str(time.time_ns() % 1_000_000)))
    print(f"nemesis seed: {seed}")
    runs = []
    for item in stores:
        store, _, length = item.strip().partition(":")
        minutes = float(length or MINUTES)
        count = int(os.environ.get("BENCH_NEMESIS_TASKS", str(round(100 * minutes))))
        result = run_nemesis(store, minutes, count, seed)
        runs.append(result)
        write_result("nemesis", {"seed": seed, "runs": runs})
    table(
        [
            "store",
            "tasks",
            "lost",
            "not final",
            "twice",
            "falsely failed",
            "5xx while up",
            "p99 ms",
            "faults",
            "poller RSS kB",
            "poller fds",
        ],
        [
            [
                r["store"],
                r["tasks"],
                r["lost"],
                r["not_final"],
                r["twice"],
                r["falsely_failed"],
                r["five_xx_while_up"],
                r["p99_ms_while_up"],
                sum(r["faults_by_kind"].values()),
                f"{r['poller'].get('rss_kb_first_quarter')}->{r['poller'].get('rss_kb_last_quarter')}",
                f"{r['poller'].get('fds_first_quarter')}->{r['poller'].get('fds_last_quarter')}",
            ]
            for r in runs
        ],
    )
    for r in runs:
        print(f"{r['store']}: {'passed' if passed(r) else 'FAILED'}")
        print(f"{r['store']}: faults {r['faults_by_kind']}; workflow {r['workflow']}")
        for error in r["fault_errors"]:
            print(f"  fault not run as planned: {error}")
        if not passed(r):
            print(json.dumps(r["details"], indent=1)[:6000])
    return {"seed": seed, "runs": runs}


if __name__ == "__main__":
    main()
