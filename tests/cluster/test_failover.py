"""Two login nodes on one PostgreSQL store: the pollers elect one leader through the lease,
a standby takes over when the leader dies, freezes or loses the database, and no task gets
two jobs (docs/operations.md, "Two login nodes").

Each "node" is a poller process (or a whole `serve`: API and poller) with its own state
directory and node name; they share the database, the work directory and the image cache, as
two login nodes do. The election tests run on a fake Slurm (tests/fixtures/fake_slurm_cli.py:
every job stays pending, and each sbatch says which poller ran it). The last tests run the
site the issue describes on the local cluster: two whole services, each in a mount namespace
of its own whose state directory is a tmpfs nothing else sees, nginx in front of both; a burst
of tasks with the leading node killed -9, and a rolling restart of both nodes under a running
Snakemake workflow.
"""

from __future__ import annotations

import contextlib
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
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import requests

from bench.common import slurm_jobs_by_task
from bridge.core.naming import SUPERSEDED_EXIT_CODE
from bridge.store import LEASE_TABLE
from tests.cluster.test_engines import (
    SNAKEFILE,
    check_snakemake7_workflow,
    snakemake7_workflow,
)
from tests.cluster.test_reliability import assert_one_job_per_attempt
from tests.conftest import _fresh_store
from tests.fixtures.diagnostics import failed_so_far, print_job_outputs
from tests.fixtures.engines import Engine
from tests.fixtures.nginx import private_nginx
from tests.fixtures.service import TERMINAL, TesClient
from tests.procs import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.postgres]

FAKE_CLI = Path(__file__).parents[1] / "fixtures" / "fake_slurm_cli.py"
#: The shortest lease (renewed every second, a margin of 1 s); FAILOVER_LEASE for another.
LEASE = float(os.environ.get("FAILOVER_LEASE", "3.0"))
POLL = 0.5
TASK = {"executors": [{"image": "alpine", "command": ["true"]}]}


#: Run in a node's own mount namespace: its state directory (the argument after the script) a
#: tmpfs of its own, which neither the host nor another node sees; then the command.
PRIVATE_STATE = 'mount -t tmpfs -o mode=0700,size=64m node-state "$0" && exec "$@"'


@dataclass
class Node:
    name: str
    root: Path
    config: Path
    env: dict[str, str]
    #: Its API's base URL, where it serves one (`start("serve")`).
    url: str = ""
    process: subprocess.Popen[bytes] | None = None
    #: Its state directory, mounted privately in a mount namespace of its own (else shared).
    private_state: Path | None = None

    def start(self, *args: str) -> None:
        """`tes-bridge poller` (or the command given, e.g. "serve": API and poller), in a
        process group of its own."""
        log = open(self.root / "poller.log", "ab")  # noqa: SIM115 (kept open by the process)
        argv = [sys.executable, "-m", "bridge", "--config", str(self.config), *(args or ["poller"])]
        if self.private_state is not None:
            unshare = ["unshare", "--mount", "--propagation", "private", "--"]
            argv = [*unshare, "sh", "-c", PRIVATE_STATE, str(self.private_state), *argv]
        self.process = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def serve(self) -> None:
        """`serve` started; returns once its API answers."""
        self.start("serve")
        wait_until(_answers(self.url), 60, self.log()[-3000:])

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        """The node dies: kill -9 of every process it runs (API, supervisor and poller)."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, as systemd stops a unit: the poller releases its lease."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def state(self) -> Path:
        """Its state directory as its own processes see it."""
        assert self.process is not None and self.private_state is not None
        return Path(f"/proc/{self.process.pid}/root{self.private_state}")

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
    #: Requests `create` sent again (see there).
    retried: int = 0

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
    @property
    def client(self) -> TesClient:
        return TesClient(self.api_url)

    def create(self, task: dict[str, Any] = TASK) -> str:
        """Through the balancer, a POST that a node died under (nginx answers 502: it passes
        a request it sent on to no other node) is sent again, as a client would."""
        for _ in range(10):
            try:
                result = requests.post(f"{self.api_url}/ga4gh/tes/v1/tasks", json=task, timeout=10)
            except requests.ConnectionError:
                result = None
            if result is not None and result.status_code not in (502, 503, 504):
                break
            self.retried += 1
            time.sleep(0.5)
        assert result is not None and result.ok, result and result.text
        return str(result.json()["id"])

    def task(self, task_id: str) -> dict[str, Any]:
        return self.client.get(task_id)

    def wait_all(self, timeout: float) -> dict[str, dict[str, Any]]:
        """Every task of the store (FULL), once each has ended."""
        wait_until(
            lambda: all(t["state"] in TERMINAL for t in self.client.list_tasks(view="MINIMAL")),
            timeout,
            "tasks still running",
            step=2.0,
        )
        return {t["id"]: t for t in self.client.list_tasks(view="FULL")}

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


def wait_until(
    condition: Callable[[], bool], timeout: float, message: str, step: float = 0.05
) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(step)
    raise AssertionError(message)


def _config(
    site: Site,
    local_cluster: Any,
    root: Path,
    name: str,
    url: str,
    port: int,
    fake: bool,
    state_dir: Path,
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
state_dir = "{state_dir}"
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
[storage]
# Where a workflow engine keeps its files (its working directory), as at a site.
allowed_dirs = ["{site.shared / "data"}"]
shared_dirs = ["{site.shared / "data"}"]
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


#: How long nginx leaves out a node that refused a request (max_fails=1): a node back from a
#: restart gets requests again only after it, so a rolling restart waits that long before
#: it stops the next node (with both left out, nginx answers 502: "no live upstreams").
FAIL_TIMEOUT = 3.0
#: nginx in front of the nodes' APIs: a request no node took (refused, timed out, or answered
#: 502 or 503: a node going down) goes to the next one.
BALANCER = """
    upstream login_nodes {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://login_nodes;
            proxy_next_upstream error timeout http_502 http_503;
            proxy_connect_timeout 2s;
            proxy_read_timeout 60s;
        }}
    }}
"""


@pytest.fixture
def make_site(
    local_cluster: Any, postgres_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Site]]:
    sites: list[Site] = []
    balancers = ExitStack()

    def make(
        *,
        fake: bool = True,
        names: tuple[str, ...] = ("nodeA", "nodeB"),
        api: bool = True,
        balanced: bool = False,
    ) -> Site:
        """With `api`, an API of its own on node A's port, beside the nodes' pollers. With
        `balanced`, the nodes' whole services (`serve`) instead, each in a mount namespace of
        its own with a private state directory (the same path on every node, as one
        configuration for all), node A leading, and nginx in front (`api_url`)."""
        _fresh_store(postgres_url).db.close()
        shared = local_cluster.shared_path("failover")
        (shared / "data").mkdir()
        site = Site(postgres_url, shared, tmp_path / "fake-slurm" if fake else None)
        sites.append(site)
        if site.fake_dir is not None:
            site.fake_dir.mkdir()
        urls = _roles(postgres_url, list(names))
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("TES_BRIDGE_")}
        if site.fake_dir is not None:
            base_env["FAKE_SLURM_DIR"] = str(site.fake_dir)
        private = tmp_path / "node-state" if balanced else None
        for name in names:
            root = tmp_path / name
            root.mkdir()
            port = free_port()
            state = private or root / "state"
            state.mkdir(exist_ok=True)
            config = _config(site, local_cluster, root, name, urls[name], port, fake, state)
            env = {**base_env, "FAKE_SLURM_WHO": name}
            node = Node(name, root, config, env, f"http://127.0.0.1:{port}", private_state=private)
            site.nodes[name] = node
            if api and not balanced and not site.api_url:
                site.api_url = node.url
                log = open(root / "api.log", "ab")  # noqa: SIM115 (kept by the process)
                site.api = subprocess.Popen(
                    [sys.executable, "-m", "bridge", "--config", str(config), "serve",
                     "--no-poller"],
                    # A role of its own: cutting a node's poller off leaves the API be.
                    env={**env, "TES_BRIDGE_DATABASE": postgres_url},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
        if balanced:
            _serve_balanced(site, balancers, tmp_path / "nginx")
        elif api:
            wait_until(_answers(site.api_url), 60, "the API never answered")
        return site

    yield make
    balancers.close()
    for site in sites:
        if failed_so_far(request):
            print_job_outputs(site.shared)
        for node in site.nodes.values():
            node.stop()
        if site.api is not None:
            site.api.terminate()
            site.api.wait(timeout=30)
        shutil.rmtree(site.shared, ignore_errors=True)


def _serve_balanced(site: Site, stack: ExitStack, root: Path) -> None:
    """Every node's `serve` (the first one leading), and nginx in front of them."""
    first, *others = site.nodes.values()
    first.serve()
    site.wait_for_leader(first.name)
    for node in others:
        node.serve()
    assert_private_states(site)
    root.mkdir()
    port = free_port()
    servers = "\n".join(
        f"        server {n.url.split('//')[1]} max_fails=1 fail_timeout={FAIL_TIMEOUT:g}s;"
        for n in site.nodes.values()
    )
    stack.enter_context(private_nginx(root, BALANCER.format(servers=servers, port=port), port))
    site.api_url = f"http://127.0.0.1:{port}"


def assert_private_states(site: Site) -> None:
    """Each node's state directory, as its processes see it, is a filesystem of its own with
    its files, and the host's directory at that path holds none of them."""
    devices = set()
    for node in site.nodes.values():
        state = node.state()
        assert any(state.iterdir()), f"{node.name} keeps nothing in its state directory"
        devices.add(os.stat(state).st_dev)
    host = next(iter(site.nodes.values())).private_state
    assert host is not None and os.stat(host).st_dev not in devices
    assert len(devices) == len(site.nodes) and not any(host.iterdir())


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


def _took_over(site: Site, name: str, since: float, what: str) -> float:
    """`name` leads within the lease and a renewal period (by the server's clock) and a poll
    cycle of `since`, when the leader died; the time it took."""
    took = site.wait_for_leader(name, timeout=4 * LEASE) - since
    _report(what, took)
    assert took <= LEASE + LEASE / 3 + POLL + 1.0
    return took


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
    _took_over(site, "nodeB", time.monotonic(), "kill -9, lease taken")
    second = [site.create() for _ in range(5)]
    site.wait_submitted(second)
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


#: Node A's sbatch in the next test: armed, it stops the poller that ran it (a VM frozen
#: between the lease check and sbatch) and reaches Slurm only once released.
FREEZING_SBATCH = """#!/bin/sh
if [ -e {control}/armed ]; then
  rm -f {control}/armed
  kill -STOP "$PPID"
  echo "$PPID" >{control}/frozen
  while [ ! -e {control}/release ]; do sleep 0.1; done
fi
exec {sbatch} "$@"
"""


def _led_by_a_with_its_sbatch_wrapped(
    make_site: Any, tmp_path: Path, template: str
) -> tuple[Any, Path]:
    """A real-Slurm site led by node A, whose sbatch is `template` (a shell wrapper around the
    real one, steered through files in the control directory returned), B standing by, and
    the image pulled by a first task."""
    site = make_site(fake=False)
    a, b = site.nodes["nodeA"], site.nodes["nodeB"]
    control = tmp_path / "sbatch-control"
    control.mkdir()
    sbatch = shutil.which("sbatch")
    assert sbatch is not None
    wrapper = tmp_path / "sbatch-nodeA"
    wrapper.write_text(template.format(control=control, sbatch=sbatch))
    wrapper.chmod(0o755)
    a.config.write_text(
        a.config.read_text().replace("[slurm]\n", f'[slurm]\nsbatch = "{wrapper}"\n')
    )
    a.start()
    site.wait_for_leader("nodeA")
    b.start()
    warm = site.create()  # the image is pulled before the clock matters
    assert site.client.wait(warm, timeout=120)["state"] == "COMPLETE"
    return site, control


def test_a_leader_frozen_between_its_lease_check_and_sbatch_runs_no_task_twice(
    make_site, tmp_path: Path
):
    """The window the store's fencing cannot close: the leader checked its lease, then froze
    before its sbatch reached Slurm for longer than the lease and the settle time. The new
    leader fences the task, finds no job, and submits it again; the old leader's sbatch then
    creates a second job, which stands down at its start: the task runs once, COMPLETE."""
    site, control = _led_by_a_with_its_sbatch_wrapped(make_site, tmp_path, FREEZING_SBATCH)
    a = site.nodes["nodeA"]
    _, a_epoch = site.lease()
    (control / "armed").touch()
    task_id = site.create()
    wait_until(lambda: (control / "frozen").exists(), 30, a.log()[-3000:])
    stopped = time.monotonic()
    took_over = site.wait_for_leader("nodeB", timeout=4 * LEASE)
    _report("frozen before sbatch, lease taken", took_over - stopped)
    _, b_epoch = site.lease()
    assert b_epoch > a_epoch
    # B fenced the task, looked for A's job after the settle time, found none, submitted again.
    task = site.client.wait(task_id, timeout=120)
    assert task["state"] == "COMPLETE", task
    task_dir = site.shared / "work" / task_id
    assert (task_dir / "lease-fence").read_text() == f"{b_epoch}\n"
    (b_job,) = [log["metadata"]["slurm_job_id"] for log in task["logs"]]

    (control / "release").touch()  # A's sbatch reaches Slurm now: a second job of the task
    jobs: list[str] = []

    def two_jobs() -> bool:
        jobs[:] = slurm_jobs_by_task(site.shared / "work", [task])[task_id]
        return len(jobs) == 2

    wait_until(two_jobs, 60, f"the old leader's sbatch made no job: {jobs}", step=1.0)
    (stale,) = set(jobs) - {b_job}
    a.signal(signal.SIGCONT)
    wait_until(lambda: "lost the lease" in a.log(), 3 * LEASE, a.log()[-3000:])
    wait_until(
        lambda: _sacct_state(stale) == f"FAILED {SUPERSEDED_EXIT_CODE}:0",
        60,
        f"job {stale}: {_sacct_state(stale)}",
    )
    output = (task_dir / f"slurm-{stale}.out").read_text()
    assert f"submitted under lease epoch {a_epoch}" in output and "standing down" in output
    # Only B's job ran the task: the stale job started no records, and A wrote nothing.
    assert sorted(p.name for p in (task_dir / "records").iterdir()) == [b_job]
    after = site.client.get(task_id)
    assert after["state"] == "COMPLETE"
    assert [log["metadata"]["slurm_job_id"] for log in after["logs"]] == [b_job]
    assert "lease epoch" in a.log() and "refused" in a.log(), a.log()[-3000:]


HOLDING_SBATCH = """#!/bin/sh
if [ -e {control}/armed ]; then
  rm -f {control}/armed
  {sbatch} --hold "$@" >{control}/out || exit
  kill -STOP "$PPID"
  cp {control}/out {control}/held
  while :; do sleep 1; done
fi
exec {sbatch} "$@"
"""


def test_the_job_of_a_leader_killed_before_it_stored_the_id_is_adopted_and_runs(
    make_site, tmp_path: Path
):
    """The leader's sbatch created the job (held, so it cannot start early), then the leader
    died before it stored the job id. The new leader finds that job by name and adopts it
    without fencing the task: released, the old leader's job runs the task, the only job."""
    site, control = _led_by_a_with_its_sbatch_wrapped(make_site, tmp_path, HOLDING_SBATCH)
    a = site.nodes["nodeA"]
    (control / "armed").touch()
    task_id = site.create()
    wait_until(lambda: (control / "held").exists(), 30, a.log()[-3000:])
    held = (control / "held").read_text().strip().split(";")[0].split()[-1]
    a.kill()
    site.wait_for_leader("nodeB", timeout=4 * LEASE)
    wait_until(lambda: site.row(task_id)[1] == held, 60, f"B adopted no job: {site.row(task_id)}")
    subprocess.run(["scontrol", "release", held], check=True, timeout=30)
    task = site.client.wait(task_id, timeout=120)
    assert task["state"] == "COMPLETE", task
    assert [log["metadata"]["slurm_job_id"] for log in task["logs"]] == [held]
    assert slurm_jobs_by_task(site.shared / "work", [task])[task_id] == [held]
    task_dir = site.shared / "work" / task_id
    assert not (task_dir / "lease-fence").exists()
    assert sorted(p.name for p in (task_dir / "records").iterdir()) == [held]


def _sacct_state(job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "--format=State,ExitCode"],
        capture_output=True, text=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    return out.replace("|", " ")


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
    lease = checks["poller"]
    assert lease["ok"], lease
    assert re.match(
        r"nodeA \(pid \d+\) leads \(epoch \d+\), renewed [\d.]+ s ago, ends in [\d.]+ s; "
        r"its last cycle ended [\d.]+ s ago$",
        lease["message"],
    )
    metrics = requests.get(f"{site.api_url}/metrics", timeout=10).text
    assert "tes_bridge_poller_takeovers_total" in metrics
    # This node's API sees this node's poller: the leader.
    assert re.search(r"^tes_bridge_poller_leader 1\.0$", metrics, re.M), metrics


def _leader_gauge(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    match = re.search(r"^tes_bridge_poller_leader (\S+)$", text, re.M)
    return float(match.group(1)) if match else -1.0


def test_two_whole_services_behind_nginx_each_node_serves_and_one_polls(make_site):
    """`serve` (API and supervised poller) on both nodes, each in a mount namespace with a
    state directory of its own, nginx in front: either API takes tasks, directly or through
    nginx, one poller submits them, each node's /metrics says whether its poller leads; the
    leading node's serve killed -9 (its poller dies with it), the other node's poller carries
    on, and nginx sends every request to the node left."""
    site = make_site(balanced=True)
    a, b = site.nodes["nodeA"], site.nodes["nodeB"]
    balancer = site.api_url
    before = []
    for url in (b.url, a.url, balancer):
        site.api_url = url
        before += [site.create() for _ in range(3)]
    site.wait_submitted(before)
    assert {who for _, who, _, _ in site.sbatches()} == {"nodeA"}
    wait_until(lambda: _leader_gauge(a.url) == 1.0 and _leader_gauge(b.url) == 0.0, 10, "gauge")

    a.signal(signal.SIGKILL)
    _took_over(site, "nodeB", time.monotonic(), "serve killed -9, lease taken")
    site.api_url = balancer
    after = [site.create() for _ in range(6)]
    assert site.retried == 0  # refused by A: nginx passed each request on to B
    site.wait_submitted(after)
    assert {who for _, who, _, name in site.sbatches() if name[4:] in after} == {"nodeB"}
    wait_until(lambda: _leader_gauge(b.url) == 1.0, 10, "B's gauge")
    for task_id in before + after:
        assert len(site.jobs_of(task_id)) == 1, site.jobs()


# ----------------------------------------------------------------------------- real Slurm


def test_tasks_created_while_the_leading_node_is_killed_each_run_once(make_site):
    """N tasks (FAILOVER_TASKS, 500) posted through the balancer in a burst; the leading node
    dies (kill -9 of its whole service, API and poller) in the middle of it. The other node
    takes over within the lease and a cycle, and every task completes, with exactly one Slurm
    job (sacct and squeue by job name): those the client was told of, and any a node stored
    as it died under the request (the client, told 502, sent it again)."""
    count = int(os.environ.get("FAILOVER_TASKS", "500"))
    site = make_site(fake=False, balanced=True)
    a = site.nodes["nodeA"]
    ids: list[str] = []

    def burst() -> None:
        for _ in range(count):
            ids.append(site.create())

    started = time.monotonic()
    creator = threading.Thread(target=burst)
    creator.start()
    # Killed once a third of the tasks is in and the leader is submitting.
    wait_until(lambda: len(ids) >= count // 3, 120, "the burst stalled")
    wait_until(lambda: any(site.row(t)[1] for t in list(ids)), 120, "nothing submitted")
    a.kill()
    _took_over(site, "nodeB", time.monotonic(), f"node killed -9 mid-burst of {count}")
    creator.join()
    assert len(ids) == count
    tasks = site.wait_all(timeout=900)
    print(f"\n{count} tasks ({len(tasks)} stored, {site.retried} POSTs sent again) ended in "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    assert set(ids) <= set(tasks) and len(tasks) - count <= site.retried
    assert {t["state"] for t in tasks.values()} == {"COMPLETE"}, {
        i: t["state"] for i, t in tasks.items() if t["state"] != "COMPLETE"
    }
    assert all(len(t["logs"]) == 1 for t in tasks.values())
    assert_one_job_per_attempt(tasks, site.shared / "work")


def test_a_rolling_restart_of_both_nodes_under_a_running_workflow(
    make_site: Callable[..., Site], snakemake7: Engine
) -> None:
    """Snakemake 7 runs a workflow through the balancer while each node in turn is stopped
    (SIGTERM, as systemd stops it), started again and answers, A then B: the lease passes to
    the other node each time, and the workflow completes, each of its tasks with one job. Its
    first step takes 20 s, so that the restarts fall inside the workflow."""
    site = make_site(fake=False, balanced=True)
    workdir = site.shared / "data" / "snakemake"
    (workdir / "home").mkdir(parents=True)
    done: list[subprocess.CompletedProcess[str]] = []
    client = site.client
    slow = SNAKEFILE.replace('"echo 10 > {output}"', '"sleep 20; echo 10 > {output}"')
    engine = threading.Thread(
        target=lambda: done.append(snakemake7_workflow(client, snakemake7, workdir, None, slow))
    )
    engine.start()
    wait_until(lambda: bool(client.list_tasks()), 300, "Snakemake created no task")
    for name, other in (("nodeA", "nodeB"), ("nodeB", "nodeA")):
        node = site.nodes[name]
        node.stop()
        site.wait_for_leader(other, timeout=4 * LEASE)
        node.serve()
        time.sleep(FAIL_TIMEOUT + 1)  # nginx sends requests to it again
    restarted_while_running = engine.is_alive()
    engine.join(timeout=600)
    task_ids = check_snakemake7_workflow(done[0], workdir, client)
    assert restarted_while_running, "the workflow ended before both nodes restarted"
    tasks = {task_id: client.get(task_id) for task_id in task_ids}
    assert_one_job_per_attempt(tasks, site.shared / "work")
