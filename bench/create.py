"""Create throughput: tasks/s of `POST /tasks` through gunicorn against the framework ceiling
(bench/ceiling.py: a trivial Falcon endpoint, same server, same worker count and class), on
SQLite and on PostgreSQL. The bridge runs with --log-level WARNING (no access-log lines). The
load generator is wrk (Debian package), a separate process on loopback with concurrent
connections; each round runs the ceiling then the bridge, and the median of the rounds' ratios
counts (a pair shares the machine's background load).

    python -m bench create
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path

from bench.common import (
    PYTHON,
    REPO,
    bridge_env,
    databases,
    free_port,
    log_file,
    scratch,
    stop,
    table,
    wait_http,
    write_config,
    write_result,
)

TASK = {
    "name": "bench echo",
    "executors": [{"image": "alpine", "command": ["echo", "hello"]}],
    "resources": {"cpu_cores": 1, "ram_gb": 0.5},
    "tags": {"project": "bench", "sample": "s1"},
}
WORKERS = os.cpu_count() or 2
CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "8"))
SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))


def wrk(url: str, script: Path) -> float:
    out = subprocess.run(
        ["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{SECONDS}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True, timeout=SECONDS + 60,
    ).stdout  # fmt: skip
    if "Non-2xx" in out:
        raise RuntimeError(f"errors under load:\n{out}")
    match = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    assert match, out
    return float(match.group(1))


def main() -> dict[str, object]:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk (bench/run.sh does it)")
    root = scratch("create")
    script = root / "post.lua"
    body = json.dumps(TASK).replace("\\", "\\\\").replace('"', '\\"')
    script.write_text(
        f'wrk.method = "POST"\nwrk.body = "{body}"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    env = bridge_env()
    results: dict[str, object] = {}
    rows = []
    with databases(root) as dbs:
        for label, url in dbs:
            sub = root / label
            sub.mkdir()
            config = write_config(sub, url, workers=WORKERS)
            bind = config.read_text().split('bind = "')[1].split('"')[0]
            api = subprocess.Popen(
                [PYTHON, "-m", "bridge", "--config", str(config), "--log-level", "WARNING",
                 "serve", "--no-poller"],
                env=env, stdout=subprocess.DEVNULL, stderr=log_file(sub / "api.log"),
            )  # fmt: skip
            port = free_port()
            ceiling = subprocess.Popen(
                [PYTHON, "-m", "gunicorn", "-w", str(WORKERS), "-b", f"127.0.0.1:{port}",
                 "--log-level", "warning", "bench.ceiling:app"],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log_file(sub / "ceiling.log"),
            )  # fmt: skip
            try:
                wait_http(f"http://{bind}/ga4gh/tes/v1/service-info")
                wait_http(f"http://127.0.0.1:{port}/ga4gh/tes/v1/service-info")
                bridge_rates, ceiling_rates = [], []
                for _ in range(ROUNDS):
                    ceiling_rates.append(wrk(f"http://127.0.0.1:{port}/ga4gh/tes/v1/tasks", script))
                    bridge_rates.append(wrk(f"http://{bind}/ga4gh/tes/v1/tasks", script))
            finally:
                stop(api)
                stop(ceiling)
            bridge, top = statistics.median(bridge_rates), statistics.median(ceiling_rates)
            # Each round's bridge run follows its ceiling run: the ratio of a pair is measured
            # under (nearly) the same background load; the median pair ratio counts.
            ratio = statistics.median(
                b / c for b, c in zip(bridge_rates, ceiling_rates, strict=True)
            )
            results[label] = {
                "bridge_tasks_per_s": bridge,
                "ceiling_requests_per_s": top,
                "ratio": ratio,
                "rounds_bridge": bridge_rates,
                "rounds_ceiling": ceiling_rates,
            }
            rows.append([label, bridge, top, f"{ratio:.0%}"])
    print(f"POST /tasks, gunicorn workers={WORKERS} (bridge: Tornado, ceiling: sync), "
          f"wrk -t2 -c{CONNECTIONS} {SECONDS}s x {ROUNDS} rounds "
          "(medians; ratio: median of the rounds' ratios)")  # fmt: skip
    table(["store", "bridge tasks/s", "ceiling req/s", "ratio"], rows)
    data = {"workers": WORKERS, "connections": CONNECTIONS, "seconds": SECONDS, **results}
    write_result("create", data)
    shutil.rmtree(root, ignore_errors=True)
    return data


if __name__ == "__main__":
    main()
