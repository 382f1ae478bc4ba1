"""Create throughput: tasks/s of `POST /tasks` through gunicorn against the framework ceiling
(bench/ceiling.py: a trivial Falcon endpoint, same worker count), on SQLite and on PostgreSQL,
twice: the ceiling on the bridge's own server (its Tornado worker class and thread pool: what
the app costs) and on gunicorn's default sync workers (what the app and the server choice cost
together). The bridge runs with --log-level WARNING (no access-log lines). The load generator is
wrk (Debian package), a separate process on loopback with concurrent connections; each round
runs both ceilings then the bridge, and the median of the rounds' ratios counts (a round shares
the machine's background load).

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
            sync_port, same_port = free_port(), free_port()
            ceilings = {
                "sync": subprocess.Popen(
                    [PYTHON, "-m", "gunicorn", "-w", str(WORKERS), "-b",
                     f"127.0.0.1:{sync_port}", "--log-level", "warning", "bench.ceiling:app"],
                    cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                    stderr=log_file(sub / "ceiling-sync.log"),
                ),
                "same": subprocess.Popen(
                    [PYTHON, "-m", "bench.ceiling", f"127.0.0.1:{same_port}", str(WORKERS)],
                    cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                    stderr=log_file(sub / "ceiling-same.log"),
                ),
            }  # fmt: skip
            ports = {"sync": sync_port, "same": same_port}
            try:
                wait_http(f"http://{bind}/ga4gh/tes/v1/service-info")
                for port in ports.values():
                    wait_http(f"http://127.0.0.1:{port}/ga4gh/tes/v1/service-info")
                bridge_rates: list[float] = []
                ceiling_rates: dict[str, list[float]] = {"same": [], "sync": []}
                for _ in range(ROUNDS):
                    for kind, port in ports.items():
                        url = f"http://127.0.0.1:{port}/ga4gh/tes/v1/tasks"
                        ceiling_rates[kind].append(wrk(url, script))
                    bridge_rates.append(wrk(f"http://{bind}/ga4gh/tes/v1/tasks", script))
            finally:
                stop(api)
                for process in ceilings.values():
                    stop(process)
            bridge = statistics.median(bridge_rates)
            tops = {kind: statistics.median(rates) for kind, rates in ceiling_rates.items()}
            # Each round's bridge run follows its ceiling runs: the ratio of a round is measured
            # under (nearly) the same background load; the median of the rounds' ratios counts.
            ratios = {
                kind: statistics.median(b / c for b, c in zip(bridge_rates, rates, strict=True))
                for kind, rates in ceiling_rates.items()
            }
            results[label] = {
                "bridge_tasks_per_s": bridge,
                "ceiling_requests_per_s": tops["same"],
                "ratio": ratios["same"],
                "ceiling_sync_requests_per_s": tops["sync"],
                "ratio_sync": ratios["sync"],
                "rounds_bridge": bridge_rates,
                "rounds_ceiling": ceiling_rates["same"],
                "rounds_ceiling_sync": ceiling_rates["sync"],
            }
            rows.append([
                label, bridge, tops["same"], f"{ratios['same']:.0%}",
                tops["sync"], f"{ratios['sync']:.0%}",
            ])  # fmt: skip
    print(f"POST /tasks, gunicorn workers={WORKERS}, wrk -t2 -c{CONNECTIONS} {SECONDS}s x "
          f"{ROUNDS} rounds, load {os.getloadavg()[0]:.1f} (medians; ratio: median of the "
          "rounds' ratios; ceiling: the same server as the bridge, sync: gunicorn's sync "
          "workers)")  # fmt: skip
    header = ["store", "bridge tasks/s", "ceiling req/s", "ratio", "sync req/s", "ratio"]
    table(header, rows)
    data = {"workers": WORKERS, "connections": CONNECTIONS, "seconds": SECONDS, **results}
    write_result("create", data)
    shutil.rmtree(root, ignore_errors=True)
    return data


if __name__ == "__main__":
    main()
