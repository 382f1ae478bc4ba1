"""Two login nodes on one PostgreSQL store: the pollers elect one leader through the lease,
a standby takes over when the leader dies, freezes or loses the database, and no task gets
two jobs (docs/operations.md, "Two login nodes").

Each "node" is a poller process with its own state directory and node name; they share the
database, the work directory and the image cache, as two login nodes do. The election tests
run on a fake Slurm (tests/fixtures/fake_slurm_cli.py: every job stays pending, and each
sbatch says which poller ran it); the last test submits real jobs to the local cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import requests

from bridge.store import LEASE_TABLE
from tests.cluster.test_reliability import assert_one_job_per_attempt
from tests.conftest import _fresh_store
from tests.procs import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.postgres]

FAKE_CLI = Path(__file__).parents[1] / "fixtures" / "fake_slurm_cli.py"
#: The shortest lease (renewed every second, a margin of 1 s); FAILOVER_LEASE for another.
LEASE = float(os.environ.get("FAILOVER_LEASE", "3.0"))
POLL = 0.5
TASK = {"executors": [{"image": "alpine", "command": ["true"]}]}


@dataclass
class Node:
    name: str
    root: Path
    config: Path
    env: dict[str, str]
    #: Its API's base URL, where it serves one (`start("serve")`).
    url: str = ""
    process: subprocess.Popen[bytes] | None = None

    def start(self, *args: str) -> None:
        """`tes-bridge poller` (or the command given, e.g. "serve": API and poller)."""
        log = open(self.root / "poller.log", "ab")  # noqa: SIM115 (kept open by the process)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bridge", "--config", str(self.config), *(args or ["poller"])],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def log(self) -> str:
        path = self.root / "poller.log"
        return path.read_text() if path.exists() else ""


@dataclass
class Site:
    url: str
    shared: Path
    fake_dir: Path | None
    nodes: dict[str, Node] = field(default_factory=dict)
    api: subprocess.Popen[bytes] | None = None
    api_url: str = ""

    # --------------------------------------------------------------------------- the lease
    def lease(self) -> tuple[str | None, int]:
        with psycopg2.connect(self.url) as conn, conn.cursor() as cursor:
            cursor.execute(f'SELECT holder, epoch FROM "{LEASE_TABLE}"')
            holder, epoch = cursor.fetchone()
        conn.close()
        return holder, int(epoch)

    def leader(self) -> str | None:
        holder, _ = self.lease()
        return holder.split()[0] if holder else None

    def wait_for_leader(self, name: str, timeout: float = 30) -> float:
        """The monotonic time at which `name` held the lease."""
        return wait_until(lambda: self.leader() == name, timeout, f"{name} never led")

    # --------------------------------------------------------------------------- tasks
    def create(self, task: dict[str, Any] = TASK) -> str:
        result = requests.post(f"{self.api_url}/ga4gh/tes/v1/tasks", json=task, timeout=10)
        assert result.ok, result.text
        return str(result.json()["id"])

    def task(self, task_id: str) -> dict[str, Any]:
        url = f"{self.api_url}/ga4gh/tes/v1/tasks/{task_id}?view=FULL"
        result = requests.get(url, timeout=10)
        assert result.ok, result.text
        return dict(result.json())

    def row(self, task_id: str) -> tuple[Any, ...]:
        with psycopg2.connect(self.url) as conn, conn.cursor() as cursor:
            cursor.execute(
                "SELECT state, job_id, submit_started_at, logs, updated_at FROM tasks "
                "WHERE id = %s",
                [task_id],
            )
            row = tuple(cursor.fetchone())
        conn.close()
        return row

    # --------------------------------------------------------------------------- fake Slurm
    def sbatches(self) -> list[tuple[float, str, str, str]]:
        """(time, who, start|end, job name) per line of the fake sbatch's log."""
        assert self.fake_dir is not None
        path = self.fake_dir / "sbatch.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(float(t), who, what, name) for t, who, what, name, *_ in map(str.split, lines)]

    def jobs(self) -> list[dict[str, str]]:
        assert self.fake_dir is not None
        path = self.fake_dir / "jobs.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]

    def jobs_of(self, task_id: str) -> list[dict[str, str]]:
        return [j for j in self.jobs() if j["name"] == f"tes-{task_id}"]

    def wait_submitted(self, task_ids: list[str], timeout: float = 60) -> None:
        """Each task has its job id stored."""
        wait_until(
            lambda: all(self.row(t)[1] for t in task_ids),
            timeout,
            f"not all submitted: {[self.row(t)[:3] for t in task_ids]}",
        )


def wait_until(condition: Callable[[], bool], timeout: float, message: str) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(message)


def _config(
    site: Site, local_cluster: Any, root: Path, name: str, url: str, port: int, fake: bool
) -> Path:
    slurm = ""
    if fake:
        assert site.fake_dir is not None
        for tool in ("sbatch", "squeue", "sacct", "scancel", "sinfo"):
            wrapper = site.fake_dir / "bin" / tool
            wrapper.parent.mkdir(parents=True, exist_ok=True)
            wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_CLI} {tool} "$@"\n')
            wrapper.chmod(0o755)
            slurm += f'{tool} = "{wrapper}"\n'
        slurm += 'arrays = "never"\n'  # the fake's sbatch makes no arrays
    container = {
        "runtime": local_cluster.apptainer,
        "default_registry": local_cluster.registry,
        "insecure_registries": [local_cluster.registry],
        "extra_flags": list(local_cluster.apptainer_flags),
        "cache_dir": str(site.shared / "images"),
        "allow_root": os.geteuid() == 0,
    }
    path = root / "tes-bridge.toml"
    path.write_text(
        f"""
state_dir = "{root / "state"}"
database = "{url}"
[server]
bind = "127.0.0.1:{port}"
workers = 1
[slurm]
{slurm}
poll_interval = {POLL}
command_timeout = 10.0
submit_settle = 3.0
submit_backoff_initial = 1.0
submit_backoff_max = 4.0
# The local cluster has no rate limit; as tests/fixtures/service.py, a larger budget.
calls_per_second = 20.0
calls_burst = 100
[poller]
lease_seconds = {LEASE}
node_name = "{name}"
[container]
{chr(10).join(f"{k} = {json.dumps(v)}" for k, v in container.items())}
[job]
work_dir = "{site.shared / "work"}"
"""
    )
    return path


def _roles(url: str, names: list[str]) -> dict[str, str]:
    """A login role per node (so one node's connections can be cut off): name -> its URL."""
    urls = {}
    with psycopg2.connect(url) as conn, conn.cursor() as cursor:
        conn.autocommit = True
        for name in names:
            role = f"tes_{name.lower()}"
            cursor.execute(f"DROP ROLE IF EXISTS {role}")
            cursor.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
            urls[name] = url.replace("postgres@", f"{role}@", 1)
    conn.close()
    return urls


@pytest.fixture
def make_site(
    local_cluster: Any, postgres_url: str, tmp_path: Path
) -> Iterator[Callable[..., Site]]:
    sites: list[Site] = []

    def make(
        *, fake: bool = True, names: tuple[str, ...] = ("nodeA", "nodeB"), api: bool = True
    ) -> Site:
        """With `api`, an API of its own on node A's port, beside the nodes' pollers."""
        _fresh_store(postgres_url).db.close()
        shared = local_cluster.shared_path("failover")
        site = Site(postgres_url, shared, tmp_path / "fake-slurm" if fake else None)
        if site.fake_dir is not None:
            site.fake_dir.mkdir()
        urls = _roles(postgres_url, list(names))
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("TES_BRIDGE_")}
        if site.fake_dir is not None:
            base_env["FAKE_SLURM_DIR"] = str(site.fake_dir)
        for name in names:
            root = tmp_path / name
            root.mkdir()
            port = free_port()
            config = _config(site, local_cluster, root, name, urls[name], port, fake)
            env = {**base_env, "FAKE_SLURM_WHO": name}
            site.nodes[name] = Node(name, root, config, env, url=f"http://127.0.0.1:{port}")
            if api and not site.api_url:
                site.api_url = f"http://127.0.0.1:{port}"
                log = open(root / "api.log", "ab")  # noqa: SIM115 (kept by the process)
                site.api = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bridge",
                        "--config",
                        str(config),
                        "serve",
                        "--no-poller",
                    ],
                    # A role of its own: cutting a node's poller off leaves the API be.
                    env={**env, "TES_BRIDGE_DATABASE": postgres_url},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        if api:
            wait_until(_answers(site.api_url), 60, "the API never answered")
        sites.append(site)
        return site

    yield make
    for site in sites:
        for node in site.nodes.values():
            node.stop()
        if site.api is not None:
            site.api.terminate()
            site.api.wait(timeout=30)
        shutil.rmtree(site.shared, ignore_errors=True)


def _answers(url: str) -> Callable[[], bool]:
    def answers() -> bool:
        try:
            return requests.get(f"{url}/ga4gh/tes/v1/service-info", timeout=2).ok
        except requests.ConnectionError:
            return False

    return answers


def _report(name: str, seconds: float) -> None:
    """Measured takeover times, printed for the record (pytest -s, or -rA)."""
    print(f"\nTAKEOVER {name}: {seconds:.2f} s (lease {LEASE} s, poll {POLL} s)")


# ----------------------------------------------------------------------------- election


def test_two_pollers_one_leads_and_the_other_takes_over_a_killed_leader(make_site):
    site = make_site()
    a, b = site.nodes["nodeA"], site.nodes["nodeB"]
    a.start()
    site.wait_for_leader("nodeA")
    b.start()
    first = [site.create() for _ in range(5)]
    site.wait_submitted(first)
    # Over several lease periods the lease never moves, and only A submits.
    _, epoch = site.lease()
    time.sleep(3 * LEASE)
    assert site.lease()[1] == epoch and site.leader() == "nodeA"
    assert {who for _, who, _, _ in site.sbatches()} == {"nodeA"}
    assert "this poller leads" not in b.log()

    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    took_over = site.wait_for_leader("nodeB", timeout=4 * LEASE)
    second = [site.create() for _ in range(5)]
    site.wait_submitted(second)
    _report("kill -9, lease taken", took_over - killed)
    # Within the lease and a renewal period (by the server's clock), and a poll cycle.
    assert took_over - killed <= LEASE + LEASE / 3 + POLL + 1.0
    assert site.lease()[1] == epoch + 1
    for task_id in first + second:
        assert len(site.jobs_of(task_id)) == 1, site.jobs()
    assert {who for _, who, _, name in site.sbatches() if name[4:] in second} == {"nodeB"}


def test_a_leader_frozen_past_its_lease_submits_and_writes_nothing_then_stands_by(make_site):
    site = make_site()
    a, b = site.nodes["nodeA"], site.nodes["nodeB"]
    a.start()
    site.wait_for_leader("nodeA")
    b.start()
    warm = site.create()  # the image is pulled once, before the clock matters
    site.wait_submitted([warm])
    # A's next sbatch takes 2 s: A is frozen while it runs (the sbatch itself goes on).
    assert site.fake_dir is not None
    (site.fake_dir / "sbatch-sleep-nodeA").write_text("2")
    frozen_task = site.create()
    wait_until(
        lambda: any(n == f"tes-{frozen_task}" for _, _, _, n in site.sbatches()),
        30,
        "A never ran sbatch",
    )
    a.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    took_over = site.wait_for_leader("nodeB", timeout=4 * LEASE)
    _report("SIGSTOP, lease taken", took_over - stopped)
    # B resolves what A was submitting: the job A's sbatch created is found by name.
    site.wait_submitted([frozen_task], timeout=30)
    assert len(site.jobs_of(frozen_task)) == 1
    while_frozen = site.create()
    site.wait_submitted([while_frozen])
    time.sleep(2 * POLL + 1)  # B has said all it will say of these tasks
    rows = {t: site.row(t) for t in (warm, frozen_task, while_frozen)}
    sbatch_lines = len(site.sbatches())

    a.signal(signal.SIGCONT)
    wait_until(lambda: "lost the lease" in a.log(), 3 * LEASE, a.log()[-3000:])
    time.sleep(2 * LEASE)
    # A's sbatch answered while it was frozen: storing that job id carried a stale epoch.
    assert "lease epoch" in a.log() and "refused" in a.log(), a.log()[-3000:]
    assert {t: site.row(t) for t in rows} == rows  # A wrote nothing
    assert len(site.sbatches()) == sbatch_lines  # and submitted nothing
    assert site.leader() == "nodeB"
    assert a.process is not None and a.process.poll() is None  # a standby now
    for task_id in rows:
        assert len(site.jobs_of(task_id)) == 1, site.jobs()


def _cut_off(url: str, role: str, *, keep_out: bool) -> None:
    with psycopg2.connect(url) as conn, conn.cursor() as cursor:
        conn.autocommit = True
        if keep_out:
            cursor.execute(f"ALTER ROLE {role} NOLOGIN")
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role]
        )
    conn.close()


def test_a_leader_cut_off_from_postgresql_stops_within_its_lease(make_site):
    site = make_site()
    a, b = site.nodes["nodeA"], site.nodes["nodeB"]
    a.start()
    site.wait_for_leader("nodeA")
    b.start()
    site.wait_submitted([site.create()])
    _, epoch = site.lease()
    # Connections killed once: A connects again and keeps its lease (no takeover).
    _cut_off(site.url, "tes_nodea", keep_out=False)
    time.sleep(2 * LEASE)
    assert site.lease()[1] == epoch and site.leader() == "nodeA"
    site.wait_submitted([site.create()])

    # Killed and kept out: A stops acting within its lease, and B takes over.
    _cut_off(site.url, "tes_nodea", keep_out=True)
    cut = time.monotonic()
    stopped = wait_until(lambda: "lost the lease" in a.log(), 2 * LEASE, a.log()[-3000:])
    took_over = site.wait_for_leader("nodeB", timeout=4 * LEASE)
    _report("connections terminated, A stood down", stopped - cut)
    _report("connections terminated, lease taken", took_over - cut)
    assert stopped - cut <= LEASE
    after = [site.create() for _ in range(3)]
    site.wait_submitted(after)
    assert {who for _, who, _, name in site.sbatches() if name[4:] in after} == {"nodeB"}
    with psycopg2.connect(site.url) as conn, conn.cursor() as cursor:
        conn.autocommit = True
        cursor.execute("ALTER ROLE tes_nodea LOGIN")
    conn.close()
    time.sleep(2 * LEASE)
    assert site.leader() == "nodeB"  # A came back as a standby


def test_check_names_the_leading_node_and_the_leases_age(make_site):
    site = make_site()
    a = site.nodes["nodeA"]
    a.start()
    site.wait_for_leader("nodeA")
    env = {k: v for k, v in a.env.items() if not k.startswith("TES_BRIDGE_")}
    argv = [sys.executable, "-m", "bridge", "--config", str(a.config), "check", "--json"]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    checks = {r["name"]: r for r in json.loads(result.stdout)}
    lease = checks["poller lease"]
    assert lease["ok"], lease
    assert re.match(
        r"nodeA \(pid \d+\) leads \(epoch \d+\), renewed [\d.]+ s ago", lease["message"]
    )
    metrics = requests.get(f"{site.api_url}/metrics", timeout=10).text
    assert "tes_bridge_poller_takeovers_total" in metrics
    # This node's API sees this node's poller: the leader.
    assert re.search(r"^tes_bridge_poller_leader 1\.0$", metrics, re.M), metrics


def _leader_gauge(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    match = re.search(r"^tes_bridge_poller_leader (\S+)$", text, re.M)
    return float(match.group(1)) if match else -1.0


def test_two_whole_services_each_node_serves_and_one_polls(make_site):
    """`serve` (API and supervised poller) on both nodes: either API takes tasks, one poller
    submits them, each node's /metrics says whether its poller leads; the leading node's
    serve killed -9 (its poller dies with it), the other node's poller carries on."""
    site = make_site(api=False)
    a, b = site.nodes["nodeA"], site.nodes["nodeB"]
    a.start("serve")
    wait_until(_answers(a.url), 60, a.log()[-3000:])
    site.wait_for_leader("nodeA")
    b.start("serve")
    wait_until(_answers(b.url), 60, b.log()[-3000:])
    site.api_url = b.url
    through_b = [site.create() for _ in range(3)]
    site.api_url = a.url
    through_a = [site.create() for _ in range(3)]
    site.wait_submitted(through_a + through_b)
    assert {who for _, who, _, _ in site.sbatches()} == {"nodeA"}
    wait_until(lambda: _leader_gauge(a.url) == 1.0 and _leader_gauge(b.url) == 0.0, 10, "gauge")

    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    took_over = site.wait_for_leader("nodeB", timeout=4 * LEASE)
    _report("serve killed -9, lease taken", took_over - killed)
    site.api_url = b.url
    after = [site.create() for _ in range(3)]
    site.wait_submitted(after)
    assert {who for _, who, _, name in site.sbatches() if name[4:] in after} == {"nodeB"}
    wait_until(lambda: _leader_gauge(b.url) == 1.0, 10, "B's gauge")
    for task_id in through_a + through_b + after:
        assert len(site.jobs_of(task_id)) == 1, site.jobs()


# ----------------------------------------------------------------------------- real Slurm


def test_tasks_created_while_the_leader_is_killed_each_run_once(make_site):
    """N tasks posted in a burst; the leader is killed -9 in the middle of it. Every task
    completes, with exactly one Slurm job (sacct and squeue by job name)."""
    count = int(os.environ.get("FAILOVER_TASKS", "100"))
    site = make_site(fake=False)
    a, b = site.nodes["nodeA"], site.nodes["nodeB"]
    a.start()
    site.wait_for_leader("nodeA")
    b.start()
    ids: list[str] = []

    def burst() -> None:
        for _ in range(count):
            ids.append(site.create())
            time.sleep(0.02)

    creator = threading.Thread(target=burst)
    creator.start()
    # Killed once a third of the tasks is in and the leader is submitting.
    wait_until(lambda: len(ids) >= count // 3, 120, "the burst stalled")
    wait_until(lambda: any(site.row(t)[1] for t in list(ids)), 120, "nothing submitted")
    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    took_over = site.wait_for_leader("nodeB", timeout=4 * LEASE)
    _report(f"kill -9 mid-burst of {count}, lease taken", took_over - killed)
    creator.join()
    deadline = time.monotonic() + 900
    tasks: dict[str, dict[str, Any]] = {}
    for task_id in ids:
        while True:
            task = site.task(task_id)
            if task["state"] in ("COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED"):
                break
            assert time.monotonic() < deadline, (task, b.log()[-3000:])
            time.sleep(0.5)
        tasks[task_id] = task
    assert {t["state"] for t in tasks.values()} == {"COMPLETE"}, {
        i: t["state"] for i, t in tasks.items() if t["state"] != "COMPLETE"
    }
    assert all(len(t["logs"]) == 1 for t in tasks.values())
    assert_one_job_per_attempt(tasks, site.shared / "work")
