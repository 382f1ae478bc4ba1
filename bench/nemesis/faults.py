"""The faults the nemesis injects and undoes."""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    PostgresServer,
    kill_node,
)
from bench.nemesis.cluster import (
    daemon_pid,
    kill,
    now,
    restore_cluster,
    resume_nodes,
    sacct_time,
    start_node,
    start_slurmctld,
    wait_until,
)
from bench.nemesis.service import Bridge

#: As deploy/systemd/tes-bridge-api.service: Restart=on-failure, RestartSec=5.
RESTART_SEC = 5.0
#: How long after a worker's kill -9 its connections may fail (a new worker answers by then).
WORKER_GRACE = 3.0
FAULT_KINDS = ["poller", "worker", "master", "slurmctld", "node", "registry", "workfs", "postgres"]


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
        #: The killed slurmd's LOCAL_CLUSTER_NODE_READONLY (None: it had the default).
        self.node_readonly: str | None = None
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
