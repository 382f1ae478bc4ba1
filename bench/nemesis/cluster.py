"""The local cluster of deploy/local-cluster.sh as the nemesis handles it: its daemons'
processes, starting them again as `up` would, and its nodes' states."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import (
    REPO,
    SLURM_ENV,
)

STATE_DIR = Path(os.environ.get("LOCAL_CLUSTER_DIR", "/var/lib/tes-bridge/local-cluster"))
CLUSTER_SCRIPT = REPO / "deploy" / "local-cluster.sh"


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
    """deploy/local-cluster.sh's start_slurmctld: it recovers its jobs from its state. Through
    the script, which runs the running release's slurmctld: the one on PATH is Debian's 22.05,
    which refuses a newer release's state ("CLUSTER NAME MISMATCH") and exits."""
    env = {**slurm_env(), "LOCAL_CLUSTER_DIR": str(STATE_DIR)}
    with open(STATE_DIR / "log" / "slurmctld.out", "ab") as out:
        subprocess.run(
            [str(CLUSTER_SCRIPT), "_slurmctld"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    wait_until(slurmctld_answers, 30)


def start_node(node: str, readonly: str | None) -> None:
    """deploy/local-cluster.sh's start of one node, as `up` starts it: slurmd in a mount
    namespace of its own, with the read-only paths the killed one had (`readonly`; None: the
    script's default, which holds the checkout the tests run from)."""
    env = {**slurm_env(), "LOCAL_CLUSTER_DIR": str(STATE_DIR)}
    if readonly is not None:
        env["LOCAL_CLUSTER_NODE_READONLY"] = readonly
    with open(STATE_DIR / "log" / f"slurmd-{node}.out", "ab") as out:
        subprocess.run(
            [str(CLUSTER_SCRIPT), "_slurmd", node],
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


def restore_cluster(nodes: list[str], readonly: str | None) -> None:
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


def sacct_time(when: float) -> str:
    """A Unix time as sacct prints it (UTC, standard format; see sacct_jobs): the whole
    second at or before it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when))
