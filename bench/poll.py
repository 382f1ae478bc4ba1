"""Poll cost: Slurm commands per poll cycle and cycle wall time with 1,000 and 10,000 active jobs
(among 100,000 stored tasks, SQLite).

- real: held jobs (`sbatch --hold`) on the local Slurm cluster, canceled afterwards: 1,000, and
  10,000 (BENCH_POLL_REAL_JOBS, e.g. "1000,10000"; the local cluster's MaxJobCount is 20,000);
- stand-in: bench/fakeslurm (squeue and sacct scripts that print Slurm 22.05's format for the
  ids they are asked about; 1% of the jobs have left the queue and are COMPLETED in sacct) for
  1,000 and 10,000 jobs.

The poller runs in-process (`Poller.cycle()`), its Slurm commands are wrappers that log each
invocation: the counts are the commands actually run. The first cycle moves every task (and
the 1% of ended jobs) to a new state; the following ones are steady state.

    python -m bench poll
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    SLURM_ENV,
    fill_store,
    scratch,
    table,
    use_stand_in_slurm,
    write_result,
)

STORED = int(os.environ.get("BENCH_TASKS", "100000"))
CYCLES = 5
FAKE = REPO / "bench" / "fakeslurm"


def wrappers(root: Path, log: Path, real: bool) -> dict[str, str]:
    paths = {}
    for tool in ("sbatch", "squeue", "sacct", "scancel"):
        if real:
            path = root / tool
            target = shutil.which(tool) or f"/usr/bin/{tool}"
            path.write_text(f'#!/bin/sh\necho {tool} >> "{log}"\nexec {target} "$@"\n')
            path.chmod(0o755)
        else:
            path = FAKE / tool
        paths[tool] = str(path)
    return paths


def submit_held(count: int) -> list[str]:
    env = {**os.environ, **SLURM_ENV}

    def one(i: int) -> str:
        out = subprocess.run(
            ["sbatch", "--hold", "--parsable", f"--job-name=tes-bench-held-{i}", "-o",
             "/dev/null", "--wrap", "true"],
            capture_output=True, text=True, check=True, env=env,
        ).stdout  # fmt: skip
        return out.strip().split(";")[0]

    # A few at once: slurmctld takes them one by one, but sbatch's own start-up overlaps.
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(one, range(count)))


def run_case(label: str, job_ids: list[str], real: bool) -> dict[str, Any]:
    from bridge.config import Config
    from bridge.poller import build_poller
    from bridge.store import Store

    root = scratch("poll")
    url = f"sqlite:///{root}/tasks.db"
    fill_store(url, max(STORED, len(job_ids)), active_job_ids=job_ids)
    log = use_stand_in_slurm(root, job_ids)
    config = Config.model_validate(
        {"state_dir": root / "state", "database": url, "slurm": wrappers(root, log, real)}
    )
    store = Store.from_url(url)
    poller = build_poller(config, store)
    poller.cleaner.last_cleanup = time.time()  # the hourly directory cleanup is not part of a cycle
    cycles: list[dict[str, Any]] = []
    for _ in range(CYCLES + 1):
        before = len(log.read_text().splitlines())
        started = time.perf_counter()
        stats = poller.cycle()
        seconds = time.perf_counter() - started
        calls = log.read_text().splitlines()[before:]
        which = [c.split()[0] for c in calls]
        cycles.append(
            {"seconds": seconds, "commands": len(calls), "which": which, "updated": stats.updated}
        )
    store.db.close()
    shutil.rmtree(root, ignore_errors=True)
    steady = cycles[1:]
    return {
        "source": "real Slurm (held jobs)" if real else "stand-in (bench/fakeslurm)",
        "active_jobs": len(job_ids),
        "first_cycle": cycles[0],
        "steady_seconds_median": statistics.median(c["seconds"] for c in steady),
        "steady_commands_max": max(c["commands"] for c in steady),
        "cycles": cycles,
        "label": label,
    }


def main() -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    real_counts = [int(n) for n in os.environ.get("BENCH_POLL_REAL_JOBS", "1000").split(",") if n]
    for count in real_counts if shutil.which("sbatch") else []:
        held: list[str] = []
        try:
            started = time.perf_counter()
            held = submit_held(count)
            print(f"submitted {count} held jobs in {time.perf_counter() - started:.0f} s")
            results[f"real-{count}"] = run_case(f"real-{count}", held, real=True)
        finally:
            env = {**os.environ, **SLURM_ENV}
            for start in range(0, len(held), 1000):
                subprocess.run(["scancel", *held[start : start + 1000]], check=False, env=env)
    for n in (1000, 10000):
        ids = [str(200_000 + i) for i in range(n)]
        results[f"standin-{n}"] = run_case(f"standin-{n}", ids, real=False)
    rows = []
    for r in results.values():
        first = r["first_cycle"]
        rows.append([r["source"], r["active_jobs"], first["commands"], first["seconds"],
                     r["steady_commands_max"], r["steady_seconds_median"],
                     f"{first['seconds'] / r['steady_seconds_median']:.2f}x"])  # fmt: skip
    print(f"poll cycle, {STORED} tasks stored (SQLite); steady = median of {CYCLES} cycles")
    header = ["Slurm", "active jobs", "1st: cmds", "1st: s", "steady: cmds", "steady: s"]
    table([*header, "1st / steady"], rows)
    write_result("poll", {"stored_tasks": STORED, **results})
    return results


if __name__ == "__main__":
    main()
