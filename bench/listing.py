"""List at scale: 100,000 tasks in the store; p50/p99 latency of `GET /tasks` pages of 256 tasks
in BASIC view with no filter, `name_prefix`, `state`, two tag pairs, and a deep page reached by
page tokens, on SQLite and PostgreSQL. Requests go through the whole Falcon app (middleware,
store, rendering, JSON) in-process, so the figures are the server's time without the network.

    python -m bench listing
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from falcon import testing

from bench.common import databases, fill_store, percentile, scratch, table, write_result

TASKS = int(os.environ.get("BENCH_TASKS", "100000"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "100"))
DEEP_PAGE = 300  # of 391 pages of 256

QUERIES: dict[str, dict[str, Any]] = {
    "no filter": {},
    "name_prefix=sample-42 (1.1%)": {"name_prefix": "sample-42"},
    "state=EXECUTOR_ERROR (4%)": {"state": "EXECUTOR_ERROR"},
    "state=SYSTEM_ERROR (1%)": {"state": "SYSTEM_ERROR"},
    "tags project=p3 & sample=s42 (0.014%)": {
        "tag_key": ["project", "sample"],
        "tag_value": ["p3", "s42"],
    },
}


def measure(client: testing.TestClient, params: dict[str, Any]) -> tuple[float, float, int]:
    query = {"view": "BASIC", "page_size": "256", **params}
    timings = []
    count = 0
    for i in range(REPEATS + 5):
        started = time.perf_counter()
        result = client.simulate_get("/ga4gh/tes/v1/tasks", params=query)
        elapsed = time.perf_counter() - started
        assert result.status_code == 200, result.text
        count = len(result.json.get("tasks", []))
        if i >= 5:  # warm-up
            timings.append(elapsed * 1000)
    return percentile(timings, 50), percentile(timings, 99), count


def main() -> dict[str, object]:
    from bridge.api.app import create_app
    from bridge.config import Config
    from bridge.store import Store

    root = scratch("listing")
    results: dict[str, object] = {}
    rows = []
    with databases(root) as dbs:
        for label, url in dbs:
            fill_seconds = fill_store(url, TASKS)
            store = Store.from_url(url)
            app = create_app(Config(state_dir=root, database=url), store=store)
            client = testing.TestClient(app)
            entries: dict[str, object] = {"fill_seconds": fill_seconds}
            for name, params in QUERIES.items():
                p50, p99, count = measure(client, params)
                entries[name] = {"p50_ms": p50, "p99_ms": p99, "tasks_in_page": count}
                rows.append([label, name, count, p50, p99])
            token = None
            for _ in range(DEEP_PAGE - 1):
                page = client.simulate_get(
                    "/ga4gh/tes/v1/tasks",
                    params={"page_size": "256", **({"page_token": token} if token else {})},
                ).json
                token = page["next_page_token"]
            name = f"deep page {DEEP_PAGE} by page_token"
            p50, p99, count = measure(client, {"page_token": token})
            entries[name] = {"p50_ms": p50, "p99_ms": p99, "tasks_in_page": count}
            rows.append([label, name, count, p50, p99])
            results[label] = entries
            store.db.close()
    print(f"GET /tasks?view=BASIC&page_size=256, {TASKS} tasks, {REPEATS} requests each")
    table(["store", "query", "tasks", "p50 ms", "p99 ms"], rows)
    data = {"tasks": TASKS, "repeats": REPEATS, **results}
    write_result("listing", data)
    shutil.rmtree(root, ignore_errors=True)
    return data


if __name__ == "__main__":
    main()
