"""Latency of a normal request while slow clients hold connections open.

`tes-bridge serve` (2 workers, SQLite) gets N slow clients: a third trickle a request head a
byte at a time, a third trickle a body, a third connect and wait. Meanwhile 200 sequential
`GET /tasks` are timed. Writes bench/results/slowloris.json.

    python -m bench slowloris
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import subprocess
import threading
import time

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

SLOW_CLIENTS = (0, 100, 300)
REQUESTS = 200


def _slow_clients(host: str, port: int, count: int, stop_event: threading.Event) -> None:
    socks = []
    for i in range(count):
        sock = socket.create_connection((host, port))
        if i % 3 == 0:
            sock.sendall(b"GET /v1/tasks HTTP/1.1\r\nHost: x\r\n")
        elif i % 3 == 1:
            sock.sendall(b"POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        socks.append((i % 3 != 2, sock))
    while not stop_event.wait(0.5):
        for trickles, sock in socks:
            if trickles:
                with contextlib.suppress(OSError):
                    sock.send(b"a")
    for _, sock in socks:
        sock.close()


def main() -> dict[str, object]:
    root = scratch("slowloris")
    # Longer timeouts than the measurement lasts: the slow clients stay connected throughout.
    config = write_config(
        root,
        f"sqlite:///{root / 'tes.db'}",
        extra="header_timeout_seconds = 120\nbody_timeout_seconds = 120",
    )
    bind = config.read_text().split('bind = "')[1].split('"')[0]
    host, port = bind.split(":")
    api = subprocess.Popen(
        [PYTHON, "-m", "bridge", "--config", str(config), "--log-level", "WARNING",
         "serve", "--no-poller"],
        env=bridge_env(), stdout=subprocess.DEVNULL, stderr=log_file(root / "api.log"),
    )  # fmt: skip
    results: dict[str, object] = {}
    rows = []
    try:
        url = f"http://{bind}/ga4gh/tes/v1"
        wait_http(f"{url}/service-info")
        for count in SLOW_CLIENTS:
            stop_event = threading.Event()
            clients = threading.Thread(
                target=_slow_clients, args=(host, int(port), count, stop_event)
            )
            clients.start()
            time.sleep(1)
            latencies = []
            with requests.Session() as session:
                for _ in range(REQUESTS):
                    started = time.perf_counter()
                    assert session.get(f"{url}/tasks", timeout=10).status_code == 200
                    latencies.append((time.perf_counter() - started) * 1000)
            stop_event.set()
            clients.join()
            latencies.sort()
            entry = {
                "p50_ms": statistics.median(latencies),
                "p99_ms": latencies[int(len(latencies) * 0.99) - 1],
                "max_ms": latencies[-1],
            }
            results[str(count)] = entry
            rows.append([count, entry["p50_ms"], entry["p99_ms"], entry["max_ms"]])
    finally:
        stop(api)
    table(["slow clients", "p50 ms", "p99 ms", "max ms"], rows)
    write_result("slowloris", {"requests": REQUESTS, "workers": 2, "slow_clients": results})
    return results
