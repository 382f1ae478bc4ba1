"""Shared helpers of the benchmarks: machine description, results, servers, a filled store."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import requests

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PYTHON = sys.executable
SLURM_ENV = {"SLURM_CONF": "/etc/slurm/slurm.conf"}


def machine() -> dict[str, Any]:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024**2, 1),
        "cpu": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_1min_when_written": os.getloadavg()[0],
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")
    print(f"-> {out.relative_to(REPO)}")
    return out


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in header]] + [
        [f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, row in enumerate(cells):
        line = (
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        print("  ".join(line))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def percentile(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(url, timeout=2).status_code < 500:
                return
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout} s")
        time.sleep(0.1)


def log_file(path: Path) -> IO[bytes]:
    """A log file for a child process (kept open for the child's lifetime)."""
    return open(path, "wb")


def stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def kill_node(slurmd: int) -> int:
    """A local-cluster node fails for real: SIGKILL to its slurmd and to every process of its
    jobs (all that runs in the node's mount namespace, and what those started). Returns how
    many processes were sent it."""
    namespace = os.readlink(f"/proc/{slurmd}/ns/mnt")
    parents: dict[int, int] = {}
    victims = {slurmd}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "mnt") == namespace:
                victims.add(int(entry.name))
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    grown = True
    while grown:  # containers run in namespaces of their own, below the job's processes
        more = {pid for pid, parent in parents.items() if parent in victims} - victims
        victims |= more
        grown = bool(more)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(victims)


def list_tasks(
    api: str, params: dict[str, str], session: requests.Session | None = None
) -> list[dict[str, Any]]:
    """Every task `GET /tasks` lists with these parameters, page after page."""
    get = (session or requests).get
    params = dict(params)
    tasks: list[dict[str, Any]] = []
    while True:
        page = get(f"{api}/tasks", params=params, timeout=60).json()
        tasks += page.get("tasks", [])
        if not page.get("next_page_token"):
            return tasks
        params["page_token"] = page["next_page_token"]


def scratch(name: str, base: str = "/var/tmp") -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"tes-bench-{name}-", dir=base))
    return root


# ------------------------------------------------------------------------------ PostgreSQL
def _as_postgres(*argv: str) -> None:
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    subprocess.run([*prefix, *argv], check=True, capture_output=True, text=True, timeout=120)


@dataclass(frozen=True)
class PostgresServer:
    """A private PostgreSQL server (see :func:`postgres_server`)."""

    url: str
    bindir: str
    datadir: str

    def restart(self) -> None:
        """Stop it (fast: connections are cut) and start it again; returns once it answers."""
        _as_postgres(f"{self.bindir}/pg_ctl", "-D", self.datadir, "-w", "-m", "fast",
                     "-l", f"{self.datadir}/server.log", "restart")  # fmt: skip


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A private PostgreSQL server on a free loopback port (Debian's binaries), as in the tests.

    synchronous_commit=off: a commit is not flushed to disk before it is acknowledged, the same
    durability as the SQLite default (WAL with synchronous=NORMAL)."""
    bindirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    if not bindirs:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    bindir = bindirs[-1]
    datadir = tempfile.mkdtemp(prefix="tes-bench-pg-")
    if os.geteuid() == 0:
        shutil.chown(datadir, "postgres", "postgres")
    port = free_port()
    _as_postgres(f"{bindir}/initdb", "-D", datadir, "-A", "trust", "-U", "postgres", "-E",
                 "UTF8", "--locale", "C.UTF-8")  # fmt: skip
    options = (
        f"-p {port} -k {datadir} -c listen_addresses=127.0.0.1 -c synchronous_commit=off "
        "-c shared_buffers=256MB"
    )
    _as_postgres(f"{bindir}/pg_ctl", "-D", datadir, "-w", "-l", f"{datadir}/server.log",
                 "-o", options, "start")  # fmt: skip
    try:
        _as_postgres(f"{bindir}/createdb", "-h", "127.0.0.1", "-p", str(port), "-U",
                     "postgres", "tes")  # fmt: skip
        yield PostgresServer(f"postgresql://postgres@127.0.0.1:{port}/tes", bindir, datadir)
    finally:
        _as_postgres(f"{bindir}/pg_ctl", "-D", datadir, "-m", "fast", "stop")
        shutil.rmtree(datadir, ignore_errors=True)


@contextmanager
def postgres() -> Iterator[str]:
    """The URL of a private PostgreSQL server (:func:`postgres_server`), or of the one
    TES_BRIDGE_BENCH_POSTGRES_URL names."""
    existing = os.environ.get("TES_BRIDGE_BENCH_POSTGRES_URL")
    if existing:
        yield existing
        return
    with postgres_server() as server:
        yield server.url


@contextmanager
def databases(
    root: Path, which: Sequence[str] = ("sqlite", "postgresql")
) -> Iterator[Iterator[tuple[str, str]]]:
    """Yields an iterator of (label, url); PostgreSQL is started lazily."""

    def gen() -> Iterator[tuple[str, str]]:
        if "sqlite" in which:
            yield "sqlite", f"sqlite:///{root}/tasks.db"
        if "postgresql" in which:
            with postgres() as url:
                yield "postgresql", url

    yield gen()


def write_config(root: Path, database_url: str, extra: str = "", workers: int = 2) -> Path:
    port = free_port()
    path = root / "tes-bridge.toml"
    path.write_text(
        f'database = "{database_url}"\nstate_dir = "{root / "state"}"\n'
        f'[server]\nbind = "127.0.0.1:{port}"\nworkers = {workers}\n{extra}\n'
    )
    return path


def use_stand_in_slurm(root: Path, job_ids: Sequence[str]) -> Path:
    """This process's environment for the stand-in Slurm (bench/fakeslurm): the log its
    commands append to (returned), and the jobs its `squeue --user` lists, as the service
    account's (the poller lists by user from 1,000 ids on)."""
    log = root / "slurm-calls.log"
    log.touch()
    os.environ["BENCH_SLURM_LOG"] = str(log)
    listed = root / "job-ids"
    listed.write_text("\n".join(job_ids) + "\n")
    os.environ["BENCH_FAKE_JOB_IDS"] = str(listed)
    os.environ.update(SLURM_ENV)
    return log


def bridge_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TES_BRIDGE_")}
    env.update(SLURM_ENV)
    return env


# ------------------------------------------------------------------------------ filled store
STATES = (
    ["COMPLETE"] * 90 + ["EXECUTOR_ERROR"] * 4 + ["SYSTEM_ERROR"] + ["CANCELED"] * 2
    + ["RUNNING", "QUEUED", "INITIALIZING"]
)  # fmt: skip


LOG = {"logs": [{"exit_code": 0, "stdout": "ok\n"}], "outputs": [], "metadata": {"node": "vm"}}


def fill_store(url: str, count: int, *, active_job_ids: Sequence[str] = ()) -> float:
    """Insert `count` tasks in bulk (same schema as the API writes); the first
    len(active_job_ids) of them are RUNNING with those Slurm job ids. Returns seconds taken."""
    from bridge.store import Store, TagRow, TaskRow

    started = time.perf_counter()
    store = Store.from_url(url)
    store.init_schema("bench")
    rng = random.Random(6)
    base = datetime(2026, 1, 1, tzinfo=UTC)
    batch = 2000
    with store.db.connection_context():
        for start in range(0, count, batch):
            rows = []
            tags = []
            for i in range(start, min(count, start + batch)):
                sample = f"s{i % 1000}"
                project = f"p{i % 7}"
                document = {
                    "name": f"sample-{i % 1000}-align",
                    "executors": [
                        {"image": "alpine", "command": ["sh", "-c", f"echo {i} > /out/x"]}
                    ],
                    "outputs": [{"url": f"s3://bucket/{i}/x", "path": "/out/x", "type": "FILE"}],
                    "resources": {"cpu_cores": 1, "ram_gb": 1},
                    "tags": {"project": project, "sample": sample},
                }
                active = i < len(active_job_ids)
                state = "RUNNING" if active else rng.choice(STATES)
                if not active and state in ("RUNNING", "QUEUED", "INITIALIZING"):
                    state = "COMPLETE"  # only the given jobs are active
                rows.append(
                    {
                        "id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                        "state": state,
                        "name": document["name"],
                        "creation_time": (base + timedelta(seconds=i)).strftime(
                            "%Y-%m-%dT%H:%M:%SZ"
                        ),
                        "document": json.dumps(document, separators=(",", ":")),
                        "logs": json.dumps([LOG]),
                        "job_id": active_job_ids[i] if active else str(10_000_000 + i),
                        "attempt": 1,
                        "updated_at": time.time(),
                        "cleaned": not active,
                    }
                )
            with store.db.atomic():
                TaskRow.insert_many(rows).execute()
                seqs = {
                    r.id: r.seq
                    for r in TaskRow.select(TaskRow.seq, TaskRow.id).where(
                        TaskRow.id.in_([r["id"] for r in rows])
                    )
                }
                for r in rows:
                    document = json.loads(str(r["document"]))
                    for key, value in document["tags"].items():
                        tags.append({"task_seq": seqs[str(r["id"])], "key": key, "value": value})
                TagRow.insert_many(tags).execute()
        store.db.execute_sql("ANALYZE")  # type: ignore[no-untyped-call]
    store.db.close()
    return time.perf_counter() - started


# ------------------------------------------------------------------------------ Slurm's record
def array_manifests(work_dir: Path) -> dict[str, list[str]]:
    """Each job array's name and its elements' task ids by index ("" where it has none: an
    array resumed after a crash keeps its tasks' indexes), from the array scripts
    (`<work_dir>/<first task>/[<name>-]tes-array-*.sh`, written before their sbatch; their
    manifest is `declare -A TASK_DIRS=(` with one `[I]='task dir'` line per element)."""
    manifests: dict[str, list[str]] = {}
    for script in work_dir.glob("*/*tes-array-*.sh"):
        lines = script.read_text().splitlines()
        start = lines.index("declare -A TASK_DIRS=(") + 1
        end = lines.index(")", start)
        elements: dict[int, str] = {}
        for line in lines[start:end]:
            index, _, task_dir = line.strip().partition("]=")
            elements[int(index.removeprefix("["))] = Path(shlex.split(task_dir)[0]).name
        last = max(elements, default=-1)
        manifests[script.stem] = [elements.get(i, "") for i in range(last + 1)]
    return manifests


def slurm_jobs_by_task(work_dir: Path, tasks: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Every Slurm job that ran or may run each task (a TES document: its id and name), by what
    Slurm knows (squeue and sacct by job name): the jobs named after the task
    (`naming.job_name`), and the elements of every job array whose script
    (`<work_dir>/<first task>/[<name>-]tes-array-*.sh`, written before its sbatch) lists the
    task in its manifest, at its index. Counts what was submitted, whatever the store says."""
    from bridge.core.naming import job_name
    from bridge.slurm import SlurmClient, expand_array_range

    by_name = {job_name(t["id"], t.get("name")): t["id"] for t in tasks}
    task_ids = list(by_name.values())
    wanted = set(task_ids)
    manifests = array_manifests(work_dir)
    names = sorted(by_name) + sorted(manifests)
    found = SlurmClient().find_by_names(names)
    jobs: dict[str, list[str]] = {task_id: [] for task_id in task_ids}
    for name, infos in found.items():
        for info in infos:
            for job_id in expand_array_range(info.job_id):
                if name in manifests:
                    index = int(job_id.partition("_")[2])
                    task_id = manifests[name][index]
                else:
                    task_id = by_name[name]
                if task_id in wanted:
                    jobs[task_id].append(job_id)
    return jobs
