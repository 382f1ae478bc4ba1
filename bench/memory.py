"""Memory: peak RSS (VmHWM) of one API worker and of the poller with 100,000 tasks stored
(SQLite). The API worker serves list pages in every view and size (up to 2,047 FULL tasks),
gets and creates; the poller runs one cycle (`tes-bridge poller --once`) with 10,000 of the
tasks active, against the stand-in Slurm commands (bench/fakeslurm).

    python -m bench memory
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import requests

from bench.common import (
    PYTHON,
    REPO,
    bridge_env,
    fill_store,
    log_file,
    scratch,
    stop,
    table,
    wait_http,
    write_config,
    write_result,
)

TASKS = int(os.environ.get("BENCH_TASKS", "100000"))
ACTIVE = 10_000
FAKE = REPO / "bench" / "fakeslurm"


def hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def main() -> dict[str, object]:
    root = scratch("memory")
    url = f"sqlite:///{root}/tasks.db"
    fill_store(url, TASKS, active_job_ids=[str(300_000 + i) for i in range(ACTIVE)])
    slurm = "\n".join(f'{t} = "{FAKE / t}"' for t in ("sbatch", "squeue", "sacct", "scancel"))
    # The stand-in Slurm runs nothing: the poller may run as root (the benchmark usually does).
    extra = f"[slurm]\n{slurm}\n[container]\nallow_root = true\n"
    config = write_config(root, url, extra=extra, workers=2)
    bind = config.read_text().split('bind = "')[1].split('"')[0]
    env = {**bridge_env(), "BENCH_SLURM_LOG": str(root / "slurm.log")}
    api = subprocess.Popen(
        [PYTHON, "-m", "bridge", "--config", str(config), "--log-level", "WARNING", "serve",
         "--no-poller"],
        env=env, stderr=log_file(root / "api.log"),
    )  # fmt: skip
    base = f"http://{bind}/ga4gh/tes/v1"
    try:
        wait_http(f"{base}/service-info")
        idle = {pid: hwm_kib(pid) for pid in children(api.pid)}
        session = requests.Session()
        task = {"executors": [{"image": "alpine", "command": ["echo", "x"]}]}
        for _ in range(20):
            for view in ("MINIMAL", "BASIC", "FULL"):
                for size in ("256", "2047"):
                    page = session.get(f"{base}/tasks", params={"view": view, "page_size": size})
                    assert page.ok, page.text
            tasks = page.json()["tasks"]
            for t in tasks[:50]:
                session.get(f"{base}/tasks/{t['id']}", params={"view": "FULL"})
            for _ in range(20):
                session.post(f"{base}/tasks", data=json.dumps(task))
        workers = {pid: hwm_kib(pid) for pid in children(api.pid)}
    finally:
        stop(api)
    poller = subprocess.Popen(
        [PYTHON, "-m", "bridge", "--config", str(config), "--log-level", "WARNING", "poller",
         "--once"],
        env=env, stderr=log_file(root / "poller.log"),
    )  # fmt: skip
    _, status, usage = os.wait4(poller.pid, 0)
    assert status == 0, (root / "poller.log").read_text()[-2000:]
    poller_kib = usage.ru_maxrss
    worker_mb = max(workers.values()) / 1024
    rows = [
        ["API worker, idle (after start)", max(idle.values()) / 1024],
        ["API worker, after the load (peak)", worker_mb],
        [f"poller, one cycle with {ACTIVE} active jobs", poller_kib / 1024],
    ]
    print(f"peak RSS (VmHWM / ru_maxrss), {TASKS} tasks stored (SQLite)")
    table(["process", "MB"], rows)
    data = {
        "tasks": TASKS,
        "api_worker_idle_mb": max(idle.values()) / 1024,
        "api_worker_peak_mb": worker_mb,
        "api_workers_peak_mb": [v / 1024 for v in workers.values()],
        "poller_peak_mb": poller_kib / 1024,
        "poller_active_jobs": ACTIVE,
    }
    write_result("memory", data)
    shutil.rmtree(root, ignore_errors=True)
    return data


if __name__ == "__main__":
    main()
