"""One nemesis run: the storage servers, the work filesystem, the bridge, the load, the faults
and the workflow together, then the checks."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from bench.common import (
    PYTHON,
    free_port,
    postgres_server,
    stop,
    wait_http,
)
from bench.nemesis.checks import api_figures, check, list_all
from bench.nemesis.cluster import cluster_env, now
from bench.nemesis.faults import Nemesis
from bench.nemesis.report import sample_poller, trend
from bench.nemesis.service import Bridge, write_config
from bench.nemesis.workflow import ENGINE, Workflow
from bench.nemesis.workload import TERMINAL, Load, Recorder, make_task, prepare_inputs

INTERVAL = float(os.environ.get("BENCH_NEMESIS_INTERVAL", "30"))
#: The work filesystem: big enough for every task directory of a 20-minute run.
WORK_FS_SIZE = "512m"
KEY, SECRET = "nemesiskey", "nemesissecret"


@contextlib.contextmanager
def storage_servers(shared: Path, http_port: int, s3_port: int) -> Iterator[None]:
    """rclone serve webdav (HTTP GET and PUT) and s3 over shared/storage, credentials in a file
    the compute nodes read."""
    rclone = shutil.which("rclone") or str(Path(PYTHON).parent / "rclone")
    (shared / "aws-credentials").write_text(
        f"[default]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n"
    )
    storage = str(shared / "storage")
    log = open(shared / "storage.log", "ab")  # noqa: SIM115 (kept open by the servers)
    servers = [
        subprocess.Popen(
            [rclone, "serve", "webdav", storage, "--addr", f"127.0.0.1:{http_port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [
                rclone,
                "serve",
                "s3",
                storage,
                "--addr",
                f"127.0.0.1:{s3_port}",
                "--auth-key",
                f"{KEY},{SECRET}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        ),
    ]
    try:
        wait_http(f"http://127.0.0.1:{http_port}/")
        wait_http(f"http://127.0.0.1:{s3_port}/")
        yield
    finally:
        for server in servers:
            stop(server)
        log.close()


@contextlib.contextmanager
def work_filesystem(work: Path) -> Iterator[None]:
    """A small tmpfs as the work directory, under the shared directory (the nodes see it)."""
    work.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={WORK_FS_SIZE}", "tmpfs", str(work)], check=True
    )
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(work)], check=False)


def drain(api: str, timeout: float) -> int:
    """Wait until every task is final; returns how many are not."""
    deadline = now() + timeout
    while True:
        try:
            open_tasks = sum(1 for t in list_all(api, "MINIMAL") if t["state"] not in TERMINAL)
        except (requests.RequestException, ValueError):
            open_tasks = -1
        if open_tasks == 0 or now() > deadline:
            return open_tasks
        time.sleep(2)


def run_nemesis(
    store: str,
    minutes: float,
    count: int,
    seed: int,
    *,
    workflow: bool = True,
    interval: float = INTERVAL,
    drain_timeout: float = 600,
) -> dict[str, Any]:
    """One nemesis run on `store` (sqlite or postgres); returns its figures."""
    info = cluster_env()
    nodes = info["LOCAL_CLUSTER_NODES"].split(",")
    run = uuid.uuid4().hex[:8]
    shared = Path(info["LOCAL_CLUSTER_SHARED_DIR"]) / "tests" / f"nemesis-{run}"
    root = Path(f"/var/tmp/tes-bench-nemesis-{run}")  # the login node's: state, database
    seconds = minutes * 60
    print(
        f"nemesis: store {store}, {minutes:g} min, {count} tasks, seed {seed} "
        f"(BENCH_NEMESIS_SEED={seed} replays it), files in {shared} and {root}",
        flush=True,
    )
    # Snakemake 7 from the engine tests' cache, built now when it is not there yet (before
    # anything of the run is set up: a failed build leaves nothing to undo).
    engine = Workflow.build(info["LOCAL_CLUSTER_REGISTRY"]) if workflow else None
    with contextlib.ExitStack() as stack:
        shared.mkdir(parents=True)
        root.mkdir()
        stack.callback(shutil.rmtree, root, True)
        stack.callback(shutil.rmtree, shared, True)
        stack.enter_context(work_filesystem(shared / "work"))
        prepare_inputs(shared)
        plan_rng = random.Random(seed)
        http_port, s3_port = free_port(), free_port()
        tasks = [make_task(i, plan_rng, run, shared, http_port) for i in range(count)]
        stack.enter_context(storage_servers(shared, http_port, s3_port))
        pg = stack.enter_context(postgres_server()) if store == "postgres" else None
        database = pg.url if pg else f"sqlite:///{root}/state/tasks.db"
        config = write_config(root, shared, database, s3_port, info)
        bind = config.read_text().split('bind = "')[1].split('"')[0]
        bridge = Bridge(root, config, f"http://{bind}/ga4gh/tes/v1")
        bridge.start()
        stack.callback(bridge.stop)
        wait_http(f"{bridge.api}/service-info")
        # Warm-up: the image is pulled once before the faults start.
        warm = requests.post(
            f"{bridge.api}/tasks",
            json={"name": "warm-up", "executors": [{"image": "alpine", "command": ["true"]}]},
            timeout=30,
        ).json()["id"]
        drain(bridge.api, 300)
        since = datetime.now().strftime("%Y-%m-%dT%H:%M:%S")  # sacct's clock: local time
        t0 = now()
        recorder = Recorder(t0)
        nemesis = Nemesis(random.Random(seed + 1), t0, bridge, shared / "work", nodes, pg)
        stack.callback(nemesis.end)  # first of all: every fault undone, whatever happens
        load = Load(bridge.api, recorder, tasks, seconds)
        samples: list[dict[str, Any]] = []
        threads = _load_threads(load, seed, bridge, t0, samples)
        if engine:
            until = t0 + seconds + drain_timeout
            threads.append(_workflow_thread(engine, f"http://{bind}", shared, t0 + seconds, until))
        for thread in threads:
            thread.start()
        _strike(nemesis, t0, seconds, interval)
        time.sleep(max(0.0, t0 + seconds - now()))
        nemesis.end()
        threads[0].join(timeout=drain_timeout)
        left = drain(bridge.api, drain_timeout)
        if engine:
            threads[-1].join(timeout=max(1, t0 + seconds + drain_timeout - now()))
        load.stopping.set()
        print(f"  drained ({left} not final) at {now() - t0:.0f} s; checking", flush=True)
        figures = check(
            bridge.api,
            {t.document["name"]: t for t in tasks},
            load.created,
            since,
            retries=2,
            node_kills=nemesis.node_kills,
            work_dir=shared / "work",
        )
        figures["created_unanswered_retries"] = load.create_failures
        api = api_figures(recorder.calls, nemesis.down, nemesis.worker_windows)
    result = {"store": store, "seed": seed, "minutes": minutes, "planned_tasks": count}
    return _summary(result, figures, api, nemesis, samples, engine, warm)


def _load_threads(
    load: Load, seed: int, bridge: Bridge, t0: float, samples: list[dict[str, Any]]
) -> list[threading.Thread]:
    """The creates (first), two pollers of the API and the poller's sampler."""
    return [
        threading.Thread(target=load.create_all, daemon=True),
        threading.Thread(target=load.poll, args=(seed,), daemon=True),
        threading.Thread(target=load.poll, args=(seed + 2,), daemon=True),
        threading.Thread(
            target=sample_poller, args=(bridge, t0, samples, load.stopping), daemon=True
        ),
    ]


def _workflow_thread(
    engine: Workflow, api_url: str, shared: Path, end: float, deadline: float
) -> threading.Thread:
    """The workflow again and again until 3 minutes before `end`."""
    return threading.Thread(
        target=engine.loop,
        daemon=True,
        args=(
            api_url,
            shared / "data",
            # No workflow starts in the last 3 minutes (one takes about that long):
            # the drain does not wait for a late one.
            lambda: now() > end - 180,
            deadline,
        ),
    )


def _strike(nemesis: Nemesis, t0: float, seconds: float, interval: float) -> None:
    """A fault every `interval` seconds until the run's end."""
    strikes = 0
    while True:
        strikes += 1
        at = t0 + strikes * interval
        if at >= t0 + seconds:
            break
        time.sleep(max(0.0, at - now()))
        nemesis.strike()
        print(f"  {nemesis.elapsed():6.0f} s  {nemesis.faults[-1].kind}", flush=True)


def _summary(
    result: dict[str, Any],
    figures: dict[str, Any],
    api: dict[str, Any],
    nemesis: Nemesis,
    samples: list[dict[str, Any]],
    engine: Workflow | None,
    warm: str,
) -> dict[str, Any]:
    """The run's figures: `result` (what was asked), the checks', the API's and the faults'."""
    counts: dict[str, int] = {}
    for fault in nemesis.faults:
        counts[fault.kind] = counts.get(fault.kind, 0) + 1
    return {
        **result,
        **{k: v for k, v in figures.items() if k != "details"},
        "five_xx_while_up": api["five_xx_while_up"],
        "p99_ms_while_up": api["p99_ms_while_up"],
        "api": api,
        "faults_by_kind": counts,
        "fault_errors": [f"{f.kind} at {f.at} s: {f.error}" for f in nemesis.faults if f.error],
        "faults": [f.__dict__ for f in nemesis.faults],
        "nodes_resumed": nemesis.resumed,
        "down_windows_s": [[round(a, 1), round(b, 1)] for a, b in nemesis.down],
        "poller": trend(samples),
        "workflow": {"engine": ENGINE, "runs": engine.runs} if engine else "not run (workflow off)",
        "warm_up_task": warm,
        "details": figures["details"],
    }
