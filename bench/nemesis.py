"""Nemesis: tasks flow through the bridge on the local cluster while a fault strikes every
30 s, chosen at random (they may overlap):

- kill -9 of the poller (its supervisor in `serve` starts it again), of an API worker
  (gunicorn's master starts another) or of gunicorn's master (started again after 5 s, as
  systemd's `Restart=` with `RestartSec=5` would: nothing else restarts it);
- kill -9 of slurmctld, started again after 10-30 s;
- a compute node lost (its slurmd and every process of its jobs killed), back after 20-60 s;
- the registry stalled (SIGSTOP, SIGCONT after 10-30 s);
- the work filesystem (a tmpfs under the shared directory) filled, freed after 10-30 s;
- PostgreSQL restarted (when the store is PostgreSQL).

The tasks: one-second tasks, tasks with inputs and outputs on the shared filesystem and over
HTTP and S3 (rclone serve webdav and s3), a few that fail by themselves (exit 3), and the
Snakemake 7 workflow of the engine tests, from its cached environment, again and again. At the
end, against sacct and the API: every task final and listed (none lost), one COMPLETED job per
task and every other job of it a real failure named in its logs[] (none twice), every task in
the state its own command explains (none falsely failed), the outputs right, no 5xx while the
API was up (the seconds it was really down come from the faults injected), the p99 latency
outside those seconds, and the poller's RSS and open files over the run.

    BENCH_NEMESIS_MINUTES=20 BENCH_NEMESIS_STORES=sqlite,postgres python -m bench nemesis

BENCH_NEMESIS_TASKS (default 100 a minute), BENCH_NEMESIS_SEED (replays a run's choices),
BENCH_NEMESIS_INTERVAL (30 s between faults). Run it alone on the cluster (it kills shared
daemons): `flock -x -o /tmp/cluster.lock ...`. Every fault is undone at the end, whatever happens.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from bench.common import (
    PYTHON,
    REPO,
    SLURM_ENV,
    PostgresServer,
    bridge_env,
    free_port,
    kill_node,
    list_tasks,
    percentile,
    postgres_server,
    stop,
    table,
    wait_http,
    write_result,
)
from bench.e2e import container_toml

MINUTES = float(os.environ.get("BENCH_NEMESIS_MINUTES", "20"))
INTERVAL = float(os.environ.get("BENCH_NEMESIS_INTERVAL", "30"))
STATE_DIR = Path(os.environ.get("LOCAL_CLUSTER_DIR", "/var/lib/tes-bridge/local-cluster"))
CLUSTER_SCRIPT = REPO / "deploy" / "local-cluster.sh"
TERMINAL = {"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED", "PREEMPTED"}
#: As deploy/systemd/tes-bridge-api.service: Restart=on-failure, RestartSec=5.
RESTART_SEC = 5.0
#: The work filesystem: big enough for every task directory of a 20-minute run.
WORK_FS_SIZE = "512m"
#: How long after a worker's kill -9 its connections may fail (a new worker answers by then).
WORKER_GRACE = 3.0
KEY, SECRET = "nemesiskey", "nemesissecret"
FAULT_KINDS = ["poller", "worker", "master", "slurmctld", "node", "registry", "workfs", "postgres"]

#: The Snakemake workflow of the engine tests (seed, scale by 1, 2 and 3, total).
SNAKEFILE = (REPO / "tests" / "data" / "engines" / "Snakefile").read_text()


def now() -> float:
    return time.monotonic()


def cluster_env() -> dict[str, str]:
    values = {}
    for line in (STATE_DIR / "cluster.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            values[key.strip()] = value.strip()
    return values


def slurm_env() -> dict[str, str]:
    return {**os.environ, **SLURM_ENV}


# ------------------------------------------------------------------------------ processes
def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def kill(pid: int, signum: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def daemon_pid(name: str) -> int | None:
    """A local-cluster daemon's pid from its pid file, if that process is alive."""
    try:
        pid = int((STATE_DIR / "run" / f"{name}.pid").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


# ------------------------------------------------------------------------------ the bridge
@dataclass
class Bridge:
    """`tes-bridge serve` (API and poller beside it) with a config for the local cluster."""

    root: Path
    config: Path
    api: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.root / "serve.log", "ab")  # noqa: SIM115 (kept open by the process)
        self.process = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "bridge",
                "--config",
                str(self.config),
                "--log-level",
                "WARNING",
                "serve",
            ],
            env=bridge_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def master(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None
        return self.process.pid

    def roles(self) -> dict[str, list[int]]:
        master = self.master()
        if master is None:
            return {"master": [], "worker": [], "poller": []}
        kids = children(master)
        supervisors = [p for p in kids if "--supervise" in cmdline(p)]
        return {
            "master": [master],
            "worker": [p for p in kids if p not in supervisors],
            "poller": [p for s in supervisors for p in children(s)],
        }

    def answers(self) -> bool:
        try:
            return requests.get(f"{self.api}/service-info", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


def write_config(
    root: Path, shared: Path, database: str, s3_port: int, info: dict[str, str]
) -> Path:
    port = free_port()
    path = root / "tes-bridge.toml"
    path.write_text(
        f"""database = "{database}"
state_dir = "{root / "state"}"
[server]
bind = "127.0.0.1:{port}"
workers = 2
[slurm]
poll_interval = 0.5
submit_backoff_initial = 1.0
submit_backoff_max = 8.0
{container_toml(info, shared / "images").strip()}
# Tags are checked against the registry often, so that a stalled registry is met.
refresh_seconds = 20
[storage]
allowed_dirs = ["{shared / "data"}"]
shared_dirs = ["{shared / "data"}"]
[staging]
http_upload = true
s3_endpoint_url = "http://127.0.0.1:{s3_port}"
s3_region = "us-east-1"
s3_credentials_file = "{shared / "aws-credentials"}"
s3_addressing_style = "path"
[job]
work_dir = "{shared / "work"}"
log_tail_bytes = 2048
"""
    )
    return path


# ------------------------------------------------------------------------------ requests
@dataclass
class Call:
    start: float
    end: float
    what: str
    #: The HTTP status, or 0 when no answer came (connection refused or reset, time-out).
    status: int


@dataclass
class Recorder:
    t0: float
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(
        self, session: requests.Session, method: str, url: str, what: str, **kwargs: Any
    ) -> requests.Response | None:
        started = now()
        try:
            response = session.request(method, url, timeout=10, **kwargs)
        except requests.RequestException:
            response = None
        status = 0 if response is None else response.status_code
        with self.lock:
            self.calls.append(Call(started - self.t0, now() - self.t0, what, status))
        return response


# ------------------------------------------------------------------------------ the tasks
@dataclass
class Task:
    index: int
    kind: str
    document: dict[str, Any]
    #: The state its own command explains.
    expected: str
    #: What its executor prints, and files it must leave (path -> content).
    stdout: str | None = None
    files: dict[Path, str] = field(default_factory=dict)
    id: str | None = None


def make_task(index: int, rng: random.Random, run: str, shared: Path, http_port: int) -> Task:
    """Task number `index`, its input files written (before the storage servers start: rclone
    keeps directory listings for minutes)."""
    kind = rng.choices(["sleep", "shared", "http-s3", "s3-http", "fails"], [50, 20, 12, 12, 6])[0]
    data, bucket = shared / "data", shared / "storage" / "bucket"
    name = f"nemesis-{index}"
    text = f"{run} {index}"
    http = f"http://127.0.0.1:{http_port}/bucket"
    base: dict[str, Any] = {"name": name, "tags": {"nemesis": run, "kind": kind}}
    echo = f"cat /in/x > /out/y; echo {index} >> /out/y; echo {index}"
    if kind == "sleep":
        base["executors"] = [{"image": "alpine", "command": ["sh", "-c", f"sleep 1; echo {index}"]}]
        return Task(index, kind, base, "COMPLETE", f"{index}\n")
    if kind == "fails":
        base["executors"] = [{"image": "alpine", "command": ["sh", "-c", f"echo {index}; exit 3"]}]
        return Task(index, kind, base, "EXECUTOR_ERROR", f"{index}\n")
    base["executors"] = [{"image": "alpine", "command": ["sh", "-c", echo]}]
    expected = f"{text}\n{index}\n"
    if kind == "shared":
        (data / "in" / f"{index}.txt").write_text(text + "\n")
        source, target = f"file://{data}/in/{index}.txt", data / "out" / f"{index}.txt"
        url = f"file://{target}"
    elif kind == "http-s3":
        (bucket / "in" / f"{index}.txt").write_text(text + "\n")
        source = f"{http}/in/{index}.txt"
        target, url = bucket / "out" / f"{index}.txt", f"s3://bucket/out/{index}.txt"
    else:
        (bucket / "in" / f"{index}.txt").write_text(text + "\n")
        source = f"s3://bucket/in/{index}.txt"
        target, url = bucket / "out" / f"{index}.txt", f"{http}/out/{index}.txt"
    base["inputs"] = [{"url": source, "path": "/in/x", "type": "FILE"}]
    base["outputs"] = [{"url": url, "path": "/out/y", "type": "FILE"}]
    return Task(index, kind, base, "COMPLETE", f"{index}\n", {target: expected})


def prepare_inputs(shared: Path) -> None:
    for path in ("data/in", "data/out", "storage/bucket/in", "storage/bucket/out"):
        (shared / path).mkdir(parents=True, exist_ok=True)


# ------------------------------------------------------------------------------ the faults
def node_state(node: str) -> str:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%T"],
        env=slurm_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    return (out.stdout.split() or ["unknown"])[0]


def wait_until(check: Callable[[], bool], timeout: float, step: float = 0.5) -> bool:
    deadline = now() + timeout
    while not check():
        if now() > deadline:
            return False
        time.sleep(step)
    return True


def slurmctld_answers() -> bool:
    return (
        subprocess.run(
            ["scontrol", "ping"], env=slurm_env(), capture_output=True, check=False
        ).returncode
        == 0
    )


def start_slurmctld() -> None:
    """As deploy/local-cluster.sh's start_slurmctld: it recovers its jobs from its state."""
    with open(STATE_DIR / "log" / "slurmctld.out", "ab") as out:
        subprocess.run(
            ["slurmctld"],
            env=slurm_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    wait_until(slurmctld_answers, 30)


def start_node(node: str, readonly: str) -> None:
    """As deploy/local-cluster.sh's start_node: slurmd in a mount namespace of its own, with
    the read-only paths the killed one had."""
    env = {
        **slurm_env(),
        "LOCAL_CLUSTER_DIR": str(STATE_DIR),
        "LOCAL_CLUSTER_NODE_READONLY": readonly,
    }
    with open(STATE_DIR / "log" / f"slurmd-{node}.out", "ab") as out:
        subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "slave",
                "--",
                str(CLUSTER_SCRIPT),
                "_node",
                node,
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    up = ("idle", "mixed", "allocated", "completing")
    if not wait_until(lambda: node_state(node).rstrip("*~#") in up, 40, 1):
        # A node DOWN for longer than ReturnToService covers: put it back, as `up` does.
        subprocess.run(
            ["scontrol", "update", f"NodeName={node}", "State=RESUME"],
            env=slurm_env(),
            capture_output=True,
            check=False,
        )
        wait_until(lambda: node_state(node).rstrip("*~#") in up, 30, 1)


def fill(path: Path) -> None:
    with open(path, "wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * (1 << 20))
            out.flush()


@dataclass
class Fault:
    kind: str
    at: float
    detail: str = ""
    undone_at: float | None = None
    #: The harness's own error while injecting or undoing it: the fault did not run as planned.
    error: str = ""


class Nemesis:
    """Injects the faults and undoes them (at their time, or all at once at the end)."""

    def __init__(
        self,
        rng: random.Random,
        t0: float,
        bridge: Bridge,
        work: Path,
        nodes: list[str],
        pg: PostgresServer | None,
    ) -> None:
        self.rng, self.t0, self.bridge, self.work, self.nodes, self.pg = (
            rng,
            t0,
            bridge,
            work,
            nodes,
            pg,
        )
        self.faults: list[Fault] = []
        #: Seconds (from t0) the API could not answer: gunicorn's master away, PostgreSQL down.
        self.down: list[list[float]] = []
        #: Seconds after a worker's kill, when its requests in flight fail.
        self.worker_windows: list[list[float]] = []
        self.active: set[str] = set()
        self.lock = threading.Lock()
        self.ending = threading.Event()
        self.threads: list[threading.Thread] = []
        self.node_readonly = "/usr /opt /work/main /work/wt"
        #: Drained nodes put back (time, which and why).
        self.resumed: list[list[Any]] = []
        #: (node, UTC time as sacct prints it) of each node whose processes were all killed:
        #: nothing of a job there ran past it, whatever end Slurm later recorded.
        self.node_kills: list[tuple[str, str]] = []

    def elapsed(self) -> float:
        return now() - self.t0

    def kinds_away(self) -> set[str]:
        """The faults at work now that keep a daemon away."""
        with self.lock:
            return self.active & {"slurmctld", "node"}

    def kinds(self) -> list[str]:
        """The faults that can strike now (a daemon already away cannot be killed again)."""
        with self.lock:
            busy = set(self.active)
        kinds = [k for k in FAULT_KINDS if k not in busy and (k != "postgres" or self.pg)]
        if "master" in busy:
            kinds = [k for k in kinds if k not in ("poller", "worker")]
        return kinds

    def strike(self) -> None:
        if self.kinds_away() == set():
            resumed = resume_nodes(self.nodes)
            if resumed:
                self.resumed.append([round(self.elapsed(), 1), ", ".join(resumed)])
        kind = self.rng.choice(self.kinds())
        # Durations are drawn here, in order, so that a seed replays the same choices.
        duration = {
            "slurmctld": self.rng.uniform(10, 30),
            "node": self.rng.uniform(20, 60),
            "registry": self.rng.uniform(10, 30),
            "workfs": self.rng.uniform(10, 30),
        }.get(kind, 0.0)
        pick = self.rng.random()
        fault = Fault(kind, round(self.elapsed(), 1))
        with self.lock:
            self.faults.append(fault)
            self.active.add(kind)
        thread = threading.Thread(target=self._run, args=(fault, duration, pick), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _run(self, fault: Fault, duration: float, pick: float) -> None:
        try:
            getattr(self, f"_{fault.kind}")(fault, duration, pick)
        except Exception as exc:
            fault.error = repr(exc)
        finally:
            fault.undone_at = round(self.elapsed(), 1)
            with self.lock:
                self.active.discard(fault.kind)

    def _hold(self, duration: float) -> None:
        self.ending.wait(duration)

    def _poller(self, fault: Fault, duration: float, pick: float) -> None:
        pids = self.bridge.roles()["poller"]
        fault.detail = f"pids {pids}"
        for pid in pids:
            kill(pid)

    def _worker(self, fault: Fault, duration: float, pick: float) -> None:
        workers = self.bridge.roles()["worker"]
        if not workers:
            fault.detail = "no worker"
            return
        pid = workers[int(pick * len(workers))]
        at = self.elapsed()
        kill(pid)
        self.worker_windows.append([at, at + WORKER_GRACE])
        fault.detail = f"pid {pid}"

    def _master(self, fault: Fault, duration: float, pick: float) -> None:
        master = self.bridge.master()
        if master is None:
            fault.detail = "not running"
            return
        window = [self.elapsed(), float("inf")]
        self.down.append(window)
        kill(master)
        assert self.bridge.process is not None
        self.bridge.process.wait()
        self._hold(RESTART_SEC)
        self.bridge.start()
        wait_until(self.bridge.answers, 120, 0.1)
        window[1] = self.elapsed()
        fault.detail = f"pid {master}; answered again after {window[1] - window[0]:.1f} s"

    def _slurmctld(self, fault: Fault, duration: float, pick: float) -> None:
        pid = daemon_pid("slurmctld")
        if pid is None:
            fault.detail = "not running"
            return
        kill(pid)
        fault.detail = f"pid {pid}, away {duration:.0f} s"
        self._hold(duration)
        start_slurmctld()

    def _node(self, fault: Fault, duration: float, pick: float) -> None:
        up = [n for n in self.nodes if daemon_pid(f"slurmd-{n}")]
        if len(up) < len(self.nodes):
            fault.detail = "a node is already away"
            return
        node = up[int(pick * len(up))]
        slurmd = daemon_pid(f"slurmd-{node}")
        assert slurmd is not None
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{slurmd}/environ").read_bytes().split(b"\0")
            for item in environ:
                if item.startswith(b"LOCAL_CLUSTER_NODE_READONLY="):
                    self.node_readonly = item.split(b"=", 1)[1].decode()
        killed = kill_node(slurmd)
        self.node_kills.append((node, sacct_time(time.time() + 1)))
        fault.detail = f"{node} ({killed} processes), away {duration:.0f} s"
        self._hold(duration)
        start_node(node, self.node_readonly)

    def _registry(self, fault: Fault, duration: float, pick: float) -> None:
        pid = daemon_pid("registry")
        if pid is None:
            fault.detail = "not running"
            return
        kill(pid, signal.SIGSTOP)
        fault.detail = f"pid {pid} stopped {duration:.0f} s"
        try:
            self._hold(duration)
        finally:
            kill(pid, signal.SIGCONT)

    def _workfs(self, fault: Fault, duration: float, pick: float) -> None:
        filler = self.work / ".nemesis-filler"
        fill(filler)
        fault.detail = f"full {duration:.0f} s"
        try:
            self._hold(duration)
        finally:
            filler.unlink(missing_ok=True)

    def _postgres(self, fault: Fault, duration: float, pick: float) -> None:
        assert self.pg is not None
        window = [self.elapsed(), float("inf")]
        self.down.append(window)
        self.pg.restart()
        window[1] = self.elapsed()
        fault.detail = f"down {window[1] - window[0]:.1f} s"

    def end(self) -> None:
        """Undo every fault now, and whatever a fault left undone."""
        self.ending.set()
        for thread in self.threads:
            thread.join(timeout=180)
        restore_cluster(self.nodes, self.node_readonly)
        (self.work / ".nemesis-filler").unlink(missing_ok=True)
        if self.bridge.master() is None:
            self.bridge.start()
            wait_until(self.bridge.answers, 120, 0.1)
        for window in self.down:
            if window[1] == float("inf"):
                window[1] = self.elapsed()


def resume_nodes(nodes: list[str]) -> list[str]:
    """Put drained nodes back, as an operator would (slurmctld drains a node that reports a
    job id it reused after a kill -9 lost its last state: "Duplicate jobid")."""
    resumed = []
    for node in nodes:
        state = node_state(node)
        if "drain" in state or "drng" in state:
            reason = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%E"],
                                    env=slurm_env(), capture_output=True, text=True,
                                    check=False).stdout.strip()  # fmt: skip
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                           env=slurm_env(), capture_output=True, check=False)  # fmt: skip
            resumed.append(f"{node} ({reason})")
    return resumed


def restore_cluster(nodes: list[str], readonly: str) -> None:
    """slurmctld, every node's slurmd and the registry running (and not stopped), no node
    drained."""
    registry = daemon_pid("registry")
    if registry:
        kill(registry, signal.SIGCONT)
    if daemon_pid("slurmctld") is None:
        start_slurmctld()
    for node in nodes:
        if daemon_pid(f"slurmd-{node}") is None:
            start_node(node, readonly)
    resume_nodes(nodes)


# ------------------------------------------------------------------------------ the load
class Load:
    """Creates the tasks at an even pace and polls them (and lists them) meanwhile."""

    def __init__(self, api: str, recorder: Recorder, tasks: list[Task], seconds: float) -> None:
        self.api, self.recorder, self.tasks, self.seconds = api, recorder, tasks, seconds
        self.stopping = threading.Event()
        self.created: list[Task] = []
        self.create_failures = 0
        self.lock = threading.Lock()

    def create_all(self) -> None:
        session = requests.Session()
        spacing = self.seconds / max(1, len(self.tasks))
        for task in self.tasks:
            wait = self.recorder.t0 + task.index * spacing - now()
            if wait > 0:
                time.sleep(wait)
            # As a client would: a create that got no answer, or a 5xx, is sent again (the
            # check matches tasks by name, so a create answered too late is not lost either).
            for _ in range(60):
                result = self.recorder.call(
                    session, "POST", f"{self.api}/tasks", "create", json=task.document
                )
                if result is not None and result.status_code == 200:
                    task.id = result.json()["id"]
                    with self.lock:
                        self.created.append(task)
                    break
                self.create_failures += 1
                time.sleep(1)

    def poll(self, seed: int) -> None:
        rng = random.Random(seed)
        session = requests.Session()
        done: set[str] = set()
        count = 0
        while not self.stopping.is_set():
            count += 1
            with self.lock:
                open_ids = [t.id for t in self.created[-300:] if t.id and t.id not in done]
            if count % 10 == 0 or not open_ids:
                self.recorder.call(
                    session,
                    "GET",
                    f"{self.api}/tasks",
                    "list",
                    params={"page_size": "50", "view": "MINIMAL"},
                )
            else:
                task_id = rng.choice(open_ids)
                result = self.recorder.call(
                    session, "GET", f"{self.api}/tasks/{task_id}", "get", params={"view": "MINIMAL"}
                )
                ok = result is not None and result.status_code == 200
                if ok and result.json().get("state") in TERMINAL:  # type: ignore[union-attr]
                    done.add(task_id)
            time.sleep(0.1)


# ------------------------------------------------------------------------------ the workflow
@dataclass
class Workflow:
    """The Snakemake 7 workflow of the engine tests, from its cached client and image."""

    venv: Path
    image: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def cached(cls, registry: str) -> Workflow | None:
        """None when the engine tests have not built Snakemake 7 on this machine yet."""
        for root in sorted((STATE_DIR / "cache" / "engines").glob("snakemake7-*")):
            if not (root / ".complete").exists():
                continue
            image = f"{registry}/test/snakemake7:{root.name.split('-', 1)[1]}"
            pushed = subprocess.run(
                ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{image}"],
                capture_output=True,
                check=False,
            )
            if pushed.returncode != 0:
                subprocess.run(
                    [
                        "skopeo",
                        "copy",
                        "--quiet",
                        "--insecure-policy",
                        "--dest-tls-verify=false",
                        f"oci:{root / 'oci'}:latest",
                        f"docker://{image}",
                    ],
                    capture_output=True,
                    check=True,
                )
            return cls(root / "venv", image)
        return None

    def run_once(self, api_url: str, workdir: Path, deadline: float) -> None:
        """One workflow in `workdir`; Snakemake started again (it resumes) when it stops on an
        error of its own, such as the API away while its master restarts."""
        (workdir / "home").mkdir(parents=True)
        (workdir / "Snakefile").write_text(SNAKEFILE)
        attempts: list[str] = []
        while now() < deadline:
            started = now()
            try:
                result = self._snakemake(api_url, workdir, deadline)
            except subprocess.TimeoutExpired as exc:
                # Still running at the deadline: how long, and what it said last.
                said = (exc.stderr or b"")[-300:]
                text = said.decode(errors="replace") if isinstance(said, bytes) else said
                attempts.append(f"timed out after {now() - started:.0f} s: {text}")
                break
            attempts.append(f"exit {result.returncode} after {now() - started:.0f} s: "
                            f"{result.stderr[-300:]}")  # fmt: skip
            if result.returncode == 0:
                break
            time.sleep(5)
        total = workdir / "total.txt"
        scaled = [workdir / "scaled" / f"{n}.txt" for n in (1, 2, 3)]
        right = (
            total.exists()
            and total.read_text() == "60\n"
            and [p.read_text() if p.exists() else "" for p in scaled] == ["10\n", "20\n", "30\n"]
        )
        self.runs.append(
            {
                "workdir": workdir.name,
                "snakemake_runs": len(attempts),
                "outputs_right": right,
                # How each Snakemake run ended (it stops on an error of its own): why a
                # workflow did not finish.
                "attempts": attempts,
                "last": attempts[-1] if attempts else "",
            }
        )

    def _snakemake(
        self, api_url: str, workdir: Path, deadline: float
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(self.venv / "bin" / "snakemake"),
                "--tes",
                api_url,
                "--container-image",
                self.image,
                "--jobs",
                "3",
                "--latency-wait",
                "5",
                "--printshellcmds",
                # Started again after it stopped: the jobs it left unfinished run again.
                "--rerun-incomplete",
            ],
            cwd=workdir,
            env={
                "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin",
                "HOME": str(workdir / "home"),
                "LANG": "C.UTF-8",
            },
            capture_output=True,
            text=True,
            timeout=max(1, deadline - now()),
            check=False,
        )

    def loop(self, api_url: str, data: Path, until: Callable[[], bool], deadline: float) -> None:
        n = 0
        while not until() and now() < deadline:
            n += 1
            self.run_once(api_url, data / f"workflow-{n}", deadline)


# ------------------------------------------------------------------------------ the poller
def sample_poller(
    bridge: Bridge, t0: float, samples: list[dict[str, Any]], stopping: threading.Event
) -> None:
    """The poller's RSS and open files every 5 s."""
    while not stopping.wait(5):
        for pid in bridge.roles()["poller"]:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                rss = int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1])
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration):
                continue
            samples.append({"t": round(now() - t0, 1), "pid": pid, "rss_kb": rss, "fds": fds})


def trend(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last quarter of the run (medians), and the longest-lived poller's first and
    last sample (pollers killed by the nemesis start afresh)."""
    if len(samples) < 4:
        return {"samples": len(samples)}
    quarter = max(1, len(samples) // 4)
    first, last = samples[:quarter], samples[-quarter:]
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        by_pid.setdefault(sample["pid"], []).append(sample)
    longest = max(by_pid.values(), key=lambda s: s[-1]["t"] - s[0]["t"])
    return {
        "samples": len(samples),
        "pollers": len(by_pid),
        "rss_kb_first_quarter": statistics.median(s["rss_kb"] for s in first),
        "rss_kb_last_quarter": statistics.median(s["rss_kb"] for s in last),
        "fds_first_quarter": statistics.median(s["fds"] for s in first),
        "fds_last_quarter": statistics.median(s["fds"] for s in last),
        "longest_lived": {
            "pid": longest[0]["pid"],
            "seconds": longest[-1]["t"] - longest[0]["t"],
            "rss_kb": [longest[0]["rss_kb"], longest[-1]["rss_kb"]],
            "fds": [longest[0]["fds"], longest[-1]["fds"]],
        },
    }


# ------------------------------------------------------------------------------ the checks
ACTIVE_JOB_STATES = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "RESIZING",
    "SUSPENDED",
    "COMPLETING",
    "CONFIGURING",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SIGNALING",
    "STAGE_OUT",
}


def list_all(api: str, view: str = "FULL") -> list[dict[str, Any]]:
    return list_tasks(api, {"view": view, "page_size": "256"})


def sacct_jobs(since: str, names: set[str]) -> dict[str, list[dict[str, str]]]:
    """The Slurm jobs named `names`, every run of each (-D), once none is in the queue any
    more (sacct keeps a job that slurmctld forgot, killed -9, as RUNNING for ever)."""

    def queued() -> bool:
        out = subprocess.run(["squeue", "-h", "-o", "%j"], env=slurm_env(), capture_output=True,
                             text=True, check=False).stdout  # fmt: skip
        return bool(set(out.split()) & names)

    wait_until(lambda: not queued(), 180, 2)
    time.sleep(5)  # slurmdbd records a job's end a moment after it leaves the queue
    out = subprocess.run(
        ["sacct", "-n", "-X", "-D", "-P", "--allusers", "-S", since, "-o",
         "JobID,JobName,State,ExitCode,NodeList,Start,End"],
        env={**slurm_env(), "TZ": "UTC", "SLURM_TIME_FORMAT": "standard"},
        capture_output=True, text=True, check=False, timeout=120,
    ).stdout  # fmt: skip
    jobs: dict[str, list[dict[str, str]]] = {}
    for line in out.splitlines():
        job_id, name, state, code, node, start, end = line.split("|")
        if name in names:
            jobs.setdefault(name, []).append({"id": job_id, "state": state.split()[0],
                "exit": code, "node": node, "start": start, "end": end})  # fmt: skip
    return jobs


def named_jobs(task: dict[str, Any]) -> set[str]:
    """Every job id the task's logs[] name: each attempt's job and the jobs it lost."""
    named = set()
    for entry in task.get("logs") or []:
        metadata = entry.get("metadata") or {}
        if metadata.get("slurm_job_id"):
            named.add(str(metadata["slurm_job_id"]))
        named |= {j for j in metadata.get("slurm_lost_job_ids", "").split(",") if j}
    return named


def sacct_time(when: float) -> str:
    """A Unix time as sacct prints it (UTC, standard format; see sacct_jobs): the whole
    second at or before it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when))


def ended_by_node_kill(
    job: dict[str, str], node_kills: Sequence[tuple[str, str]]
) -> dict[str, str]:
    """The job with its end at the first kill of its node's processes while it ran: Slurm
    records the end of such a job only when it notices (NODE_FAIL after SlurmdTimeout, or
    much later when a slurmctld killed -9 came back from an older state and still had it
    running), though nothing of it ran past the kill."""
    start, end = job["start"], job["end"]
    for node, killed_at in sorted(node_kills, key=lambda kill: kill[1]):
        if (
            node == job["node"]
            and start <= killed_at
            and (end in ("", "Unknown") or killed_at < end)
        ):
            return {**job, "end": killed_at}
    return job


def ran_twice(
    task: dict[str, Any], jobs: list[dict[str, str]], node_kills: Sequence[tuple[str, str]] = ()
) -> str | None:
    """Why the task ran more than once, or None: more than one COMPLETED run, a job its logs
    do not name, a run that completed before another one started, or two runs at once
    (a job's run ends at the latest when the nemesis killed its node's processes)."""
    # A job slurmctld forgot before it started stays PENDING in sacct for ever: not a run.
    jobs = [j for j in jobs if j["start"] not in ("", "None", "Unknown")]
    completed = [j for j in jobs if j["state"] == "COMPLETED"]
    if len(completed) > 1:
        return f"{len(completed)} COMPLETED runs: {jobs}"
    # A duplicate of an interrupted submission, canceled before it ran, may go unnamed.
    unnamed = [
        j["id"]
        for j in jobs
        if j["id"] not in named_jobs(task)
        and not (j["state"] == "CANCELLED" and j["node"] in ("", "None assigned"))
    ]
    if unnamed:
        return f"jobs {unnamed} not in its logs: {jobs}"
    ordered = sorted(
        jobs, key=lambda j: j["start"] if j["start"] not in ("", "None", "Unknown") else "~"
    )
    for before, after in itertools.pairwise(ordered):
        before = ended_by_node_kill(before, node_kills)
        if before["state"] == "COMPLETED":
            return f"job {after['id']} after job {before['id']} COMPLETED: {jobs}"
        started = after["start"] not in ("", "None", "Unknown")
        if started and before["end"] not in ("", "Unknown") and after["start"] < before["end"]:
            return f"jobs {before['id']} and {after['id']} ran at once: {jobs}"
    return None


def failure_explained(task: dict[str, Any], jobs: list[dict[str, str]], retries: int) -> bool:
    """A SYSTEM_ERROR the task's own doing does not explain is still no false failure when
    its retry budget went on real node losses."""
    lost = [j for j in jobs if j["state"] in ("NODE_FAIL", "BOOT_FAIL")]
    return task["state"] == "SYSTEM_ERROR" and len(lost) > retries


def output_wrong(task: dict[str, Any], planned: Task) -> str | None:
    if task["state"] != "COMPLETE" or planned.stdout is None:
        return None
    try:
        stdout = task["logs"][-1]["logs"][0].get("stdout")
    except (KeyError, IndexError):
        stdout = None
    if stdout != planned.stdout:
        return f"stdout {stdout!r}, not {planned.stdout!r}"
    for path, content in planned.files.items():
        found = path.read_text() if path.exists() else None
        if found != content:
            return f"{path}: {found!r}, not {content!r}"
    return None


def in_windows(call: Call, windows: list[list[float]]) -> bool:
    return any(call.start <= end and call.end >= start for start, end in windows)


def check(
    api: str,
    planned: dict[str, Task],
    created: list[Task],
    since: str,
    retries: int,
    node_kills: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """Every task final, listed, retrievable, run once, in the state its own command explains
    and with the right outputs; the Snakemake tasks (not planned here) must complete."""
    tasks = list_all(api)
    listed = {t["id"]: t for t in tasks}
    lost = [t.id for t in created if t.id not in listed]
    for acknowledged in created:
        got = requests.get(f"{api}/tasks/{acknowledged.id}", params={"view": "MINIMAL"}, timeout=30)
        if got.status_code != 200 and acknowledged.id not in lost:
            lost.append(acknowledged.id)
    jobs = sacct_jobs(since, {f"tes-{t['id']}" for t in tasks})
    not_final, twice, falsely_failed, wrong = [], [], [], []
    by_kind: dict[str, int] = {}
    for task in tasks:
        mine = jobs.get(f"tes-{task['id']}", [])
        plan = planned.get(task.get("name", ""))
        kind = plan.kind if plan else ("warm-up" if task.get("name") == "warm-up" else "workflow")
        by_kind[kind] = by_kind.get(kind, 0) + 1
        expected = plan.expected if plan else "COMPLETE"
        summary = {"id": task["id"], "name": task.get("name"), "state": task["state"]}
        if task["state"] not in TERMINAL:
            not_final.append(summary)
            continue
        why = ran_twice(task, mine, node_kills)
        if why:
            twice.append({**summary, "why": why})
        if task["state"] != expected and not failure_explained(task, mine, retries):
            system_logs = [x for e in task.get("logs") or [] for x in e.get("system_logs", [])]
            falsely_failed.append(
                {**summary, "expected": expected, "jobs": mine, "system_logs": system_logs[-8:]}
            )
        bad = output_wrong(task, plan) if plan else None
        if bad:
            wrong.append({**summary, "why": bad})
    names = [t.get("name") for t in tasks if t.get("name", "").startswith("nemesis-")]
    return {
        "tasks": len(tasks),
        "by_kind": by_kind,
        "acknowledged": len(created),
        "created_twice_by_client_retries": len(names) - len(set(names)),
        "slurm_jobs": sum(len(js) for js in jobs.values()),
        "lost": len(lost),
        "not_final": len(not_final),
        "twice": len(twice),
        "falsely_failed": len(falsely_failed),
        "wrong_outputs": len(wrong),
        "details": {
            "lost": lost[:20],
            "not_final": not_final[:20],
            "twice": twice[:20],
            "falsely_failed": falsely_failed[:20],
            "wrong_outputs": wrong[:20],
        },
    }


def api_figures(
    calls: list[Call], down: list[list[float]], worker: list[list[float]]
) -> dict[str, Any]:
    five_xx = [c for c in calls if c.status >= 500 and not in_windows(c, down)]
    up = [c for c in calls if not in_windows(c, down + worker)]
    errors = [c for c in up if c.status == 0]
    answered = [c.end - c.start for c in up if c.status]
    return {
        "requests": len(calls),
        "five_xx": sum(1 for c in calls if c.status >= 500),
        "five_xx_while_up": len(five_xx),
        "no_answer_while_up": len(errors),
        "p50_ms_while_up": round(1000 * percentile(answered, 50), 1) if answered else None,
        "p99_ms_while_up": round(1000 * percentile(answered, 99), 1) if answered else None,
        "max_ms_while_up": round(1000 * max(answered), 1) if answered else None,
        "down_seconds": round(sum(end - start for start, end in down), 1),
        "examples_while_up": [c.__dict__ for c in (five_xx + errors)[:10]],
    }


# ------------------------------------------------------------------------------ a run
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
        engine = Workflow.cached(info["LOCAL_CLUSTER_REGISTRY"]) if workflow else None
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
        threads = [
            threading.Thread(target=load.create_all, daemon=True),
            threading.Thread(target=load.poll, args=(seed,), daemon=True),
            threading.Thread(target=load.poll, args=(seed + 2,), daemon=True),
            threading.Thread(
                target=sample_poller, args=(bridge, t0, samples, load.stopping), daemon=True
            ),
        ]
        if engine:
            threads.append(
                threading.Thread(
                    target=engine.loop,
                    daemon=True,
                    args=(
                        f"http://{bind}",
                        shared / "data",
                        # No workflow starts in the last 3 minutes (one takes about that long):
                        # the drain does not wait for a late one.
                        lambda: now() > t0 + seconds - 180,
                        t0 + seconds + drain_timeout,
                    ),
                )
            )
        for thread in threads:
            thread.start()
        strikes = 0
        while True:
            strikes += 1
            at = t0 + strikes * interval
            if at >= t0 + seconds:
                break
            time.sleep(max(0.0, at - now()))
            nemesis.strike()
            print(f"  {nemesis.elapsed():6.0f} s  {nemesis.faults[-1].kind}", flush=True)
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
        )
        figures["created_unanswered_retries"] = load.create_failures
        api = api_figures(recorder.calls, nemesis.down, nemesis.worker_windows)
    counts: dict[str, int] = {}
    for fault in nemesis.faults:
        counts[fault.kind] = counts.get(fault.kind, 0) + 1
    return {
        "store": store,
        "seed": seed,
        "minutes": minutes,
        "planned_tasks": count,
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
        "workflow": {"engine": "snakemake 7.32.4", "runs": engine.runs}
        if engine
        else "not run: no cached Snakemake 7 on this machine (the engine tests build it)",
        "warm_up_task": warm,
        "details": figures["details"],
    }


def passed(result: dict[str, Any]) -> bool:
    workflow = result["workflow"]
    runs = workflow["runs"] if isinstance(workflow, dict) else []
    return (
        result["lost"] == 0
        and result["twice"] == 0
        and result["falsely_failed"] == 0
        and result["not_final"] == 0
        and result["wrong_outputs"] == 0
        and result["five_xx_while_up"] == 0
        and all(r["outputs_right"] for r in runs)
        # A fault the harness could not inject or undo leaves the run short of its faults.
        and not result["fault_errors"]
    )


def main() -> dict[str, Any]:
    # "sqlite,postgres"; a store may name its own length: "sqlite,postgres:10".
    stores = os.environ.get("BENCH_NEMESIS_STORES", "sqlite,postgres").split(",")
    seed = int(os.environ.get("BENCH_NEMESIS_SEED", str(time.time_ns() % 1_000_000)))
    print(f"nemesis seed: {seed}")
    runs = []
    for item in stores:
        store, _, length = item.strip().partition(":")
        minutes = float(length or MINUTES)
        count = int(os.environ.get("BENCH_NEMESIS_TASKS", str(round(100 * minutes))))
        result = run_nemesis(store, minutes, count, seed)
        runs.append(result)
        write_result("nemesis", {"seed": seed, "runs": runs})
    table(
        [
            "store",
            "tasks",
            "lost",
            "twice",
            "falsely failed",
            "5xx while up",
            "p99 ms",
            "faults",
            "poller RSS kB",
            "poller fds",
        ],
        [
            [
                r["store"],
                r["tasks"],
                r["lost"],
                r["twice"],
                r["falsely_failed"],
                r["five_xx_while_up"],
                r["p99_ms_while_up"],
                sum(r["faults_by_kind"].values()),
                f"{r['poller'].get('rss_kb_first_quarter')}->{r['poller'].get('rss_kb_last_quarter')}",
                f"{r['poller'].get('fds_first_quarter')}->{r['poller'].get('fds_last_quarter')}",
            ]
            for r in runs
        ],
    )
    for r in runs:
        print(f"{r['store']}: faults {r['faults_by_kind']}; workflow {r['workflow']}")
        for error in r["fault_errors"]:
            print(f"  fault not run as planned: {error}")
        if not passed(r):
            print(json.dumps(r["details"], indent=1)[:6000])
    return {"seed": seed, "runs": runs}


if __name__ == "__main__":
    main()
