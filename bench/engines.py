"""Engines polling: 2,000 tasks in flight, each polled by `GET /tasks/{id}` (MINIMAL view) once a
second, as Snakemake and Nextflow do, while creates continue and the poller runs.

`tes-bridge serve --no-poller` (gunicorn, workers = cores) over a SQLite store of 10,000 tasks,
2,000 of them RUNNING under the stand-in Slurm (bench/fakeslurm; its sbatch is replaced by one
that prints a job id). The poller runs in this process (`Poller.cycle()`, images stubbed) so its
cycles can be timed: first idle, then under the load. Two wrk processes on loopback:

- polls: 100 connections, each waits 50 ms between requests (wrk's `delay()`), walking through
  the 2,000 task ids: about 2,000 requests/s, every task once a second;
- creates: 2 connections, each waits 100 ms between `POST /tasks` (about 20 tasks/s).

wrk's latency is per request from its send to its answer (closed loop: a slow answer delays the
next request of its connection, so the tail is measured at the offered rate it reached).

    python -m bench engines
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    PYTHON,
    REPO,
    bridge_env,
    fill_store,
    free_port,
    log_file,
    scratch,
    stop,
    table,
    use_stand_in_slurm,
    wait_http,
    write_config,
    write_result,
)
from bench.create import TASK
from bench.poll import FAKE

STORED = 10_000
IN_FLIGHT = 2_000
SECONDS = int(os.environ.get("BENCH_SECONDS", "20"))
IDLE_CYCLES = 5
WORKERS = os.cpu_count() or 2

POLL_LUA = """
local ids = {%(ids)s}
local n = #ids
local threads = 0
function setup(thread)
  thread:set("offset", threads * 997)
  threads = threads + 1
end
function init(args)
  i = offset
end
function request()
  i = i + 1
  return wrk.format("GET", "/ga4gh/tes/v1/tasks/" .. ids[(i %% n) + 1] .. "?view=MINIMAL")
end
function delay()
  return 50
end
"""

CREATE_LUA = """
wrk.method = "POST"
wrk.body = "%(body)s"
wrk.headers["Content-Type"] = "application/json"
function delay()
  return 100
end
"""


class StubImages:
    """Every image is ready (the stand-in Slurm runs nothing)."""

    def resolve(self, images: Any) -> dict[str, str]:
        return {image: f"/nonexistent/{image}.sif" for image in images}

    def problem(self, image: str) -> str | None:
        return None

    def prune(self, oldest_unfinished: float | None) -> None:
        return None


def parse_wrk(out: str) -> dict[str, Any]:
    def ms(value: str) -> float:
        number, unit = re.match(r"([0-9.]+)(us|ms|s)", value).groups()  # type: ignore[union-attr]
        return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    latency = {
        p: ms(v) for p, v in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", out, flags=re.MULTILINE)
    }
    errors = re.search(r"Socket errors: (.*)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "requests_per_s": float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50_ms": latency.get("50"),
        "p99_ms": latency.get("99"),
        "max_ms": ms(re.search(r"Latency\s+\S+\s+\S+\s+(\S+)", out).group(1)),  # type: ignore[union-attr]
        "socket_errors": errors.group(1) if errors else None,
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
    }


def load(
    url: str, poll_lua: Path, create_lua: Path, poller: Any, config: Any
) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
    """Both wrk loads for SECONDS against `url`, poller cycles at its interval meanwhile."""
    base = f"{url}/ga4gh/tes/v1/tasks"
    wrk = ["wrk", "-t2", f"-d{SECONDS}s", "--latency", "--timeout", "10s"]
    polls = subprocess.Popen(
        [*wrk, "-c100", "-s", str(poll_lua), base], stdout=subprocess.PIPE, text=True
    )
    creates = subprocess.Popen(
        [*wrk, "-c2", "-s", str(create_lua), base], stdout=subprocess.PIPE, text=True
    )
    cycles: list[float] = []
    done = threading.Event()
    threading.Timer(SECONDS - 1, done.set).start()
    time.sleep(1)  # wrk connected
    while not done.is_set():
        cycles.append(poller.cycle().seconds)
        done.wait(max(0.0, config.slurm.poll_interval - cycles[-1]))
    polled = parse_wrk(polls.communicate(timeout=SECONDS + 60)[0])
    created = parse_wrk(creates.communicate(timeout=SECONDS + 60)[0])
    return polled, created, cycles


def main() -> dict[str, Any]:
    from bridge.config import Config
    from bridge.poller import Poller, build_poller
    from bridge.store import Store

    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk (bench/run.sh does it)")
    root = scratch("engines")
    url = f"sqlite:///{root}/tasks.db"
    job_ids = [str(200_000 + i) for i in range(IN_FLIGHT)]
    fill_store(url, STORED, active_job_ids=job_ids)
    store = Store.from_url(url)
    with store.db.connection_context():
        ids = [t.id for t in store.tasks_in_flight(with_document=False)]
    assert len(ids) == IN_FLIGHT
    sbatch = root / "sbatch"
    sbatch.write_text('#!/bin/sh\necho "$$"\n')  # a job id (the stand-in squeue knows any)
    sbatch.chmod(0o755)
    use_stand_in_slurm(root, job_ids)
    slurm = {tool: str(FAKE / tool) for tool in ("squeue", "sacct", "scancel")}
    config = Config.model_validate(
        {"state_dir": root / "state", "database": url, "slurm": {**slurm, "sbatch": str(sbatch)}}
    )
    poller: Poller = build_poller(config, store)
    poller.submitter.images = StubImages()
    poller.cleaner.last_cleanup = time.time()
    idle = [poller.cycle().seconds for _ in range(IDLE_CYCLES)]

    poll_lua = root / "poll.lua"
    poll_lua.write_text(POLL_LUA % {"ids": ", ".join(f'"{i}"' for i in ids)})
    create_lua = root / "create.lua"
    body = json.dumps(TASK).replace("\\", "\\\\").replace('"', '\\"')
    create_lua.write_text(CREATE_LUA % {"body": body})
    api_config = write_config(root, url, workers=WORKERS)
    bind = api_config.read_text().split('bind = "')[1].split('"')[0]
    api = subprocess.Popen(
        [PYTHON, "-m", "bridge", "--config", str(api_config), "--log-level", "WARNING",
         "serve", "--no-poller"],
        env=bridge_env(), stdout=subprocess.DEVNULL, stderr=log_file(root / "api.log"),
    )  # fmt: skip
    port = free_port()
    ceiling = subprocess.Popen(
        [PYTHON, "-m", "gunicorn", "-w", str(WORKERS), "-k", "tornado", "-b",
         f"127.0.0.1:{port}", "--log-level", "warning", "bench.ceiling:app"],
        cwd=REPO, env=bridge_env(), stdout=subprocess.DEVNULL,
        stderr=log_file(root / "ceiling.log"),
    )  # fmt: skip
    try:
        wait_http(f"http://{bind}/ga4gh/tes/v1/service-info")
        wait_http(f"http://127.0.0.1:{port}/ga4gh/tes/v1/service-info")
        # The ceiling first, then the bridge: the poller runs during both, so the two share
        # the machine's load; the poller's cycle under the bridge's load is the one that counts.
        top_polls, _, _ = load(f"http://127.0.0.1:{port}", poll_lua, create_lua, poller, config)
        poll_result, create_result, loaded = load(
            f"http://{bind}", poll_lua, create_lua, poller, config
        )
    finally:
        stop(api)
        stop(ceiling)
        store.db.close()
    idle_median, loaded_median = statistics.median(idle), statistics.median(loaded)
    print(
        f"GET /tasks/{{id}}?view=MINIMAL over {IN_FLIGHT} tasks in flight ({STORED} stored, "
        f"SQLite), gunicorn workers={WORKERS}, {SECONDS} s; poller in-process"
    )

    def errors(r: dict[str, Any]) -> int:
        return int(r["non_2xx"]) + (1 if r["socket_errors"] else 0)

    table(
        ["load", "req/s", "p50 ms", "p99 ms", "max ms", "errors"],
        [
            ["ceiling polls (GET)", top_polls["requests_per_s"], top_polls["p50_ms"],
             top_polls["p99_ms"], top_polls["max_ms"], errors(top_polls)],
            ["polls (GET MINIMAL)", poll_result["requests_per_s"], poll_result["p50_ms"],
             poll_result["p99_ms"], poll_result["max_ms"],
             errors(poll_result)],
            ["creates (POST)", create_result["requests_per_s"], create_result["p50_ms"],
             create_result["p99_ms"], create_result["max_ms"],
             errors(create_result)],
        ],
    )  # fmt: skip
    table(
        ["poller cycle", "idle s (median)", "under load s (median)", "loaded / idle"],
        [["", idle_median, loaded_median, f"{loaded_median / idle_median:.2f}x"]],
    )
    data = {
        "stored_tasks": STORED,
        "in_flight": IN_FLIGHT,
        "seconds": SECONDS,
        "workers": WORKERS,
        "polls": poll_result,
        "ceiling_polls": top_polls,
        "creates": create_result,
        "poller_cycle_idle_s": idle,
        "poller_cycle_loaded_s": loaded,
        "poller_cycle_ratio": loaded_median / idle_median,
    }
    write_result("engines", data)
    shutil.rmtree(root, ignore_errors=True)
    return data


if __name__ == "__main__":
    main()
