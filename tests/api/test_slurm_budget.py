"""The budget of Slurm calls, end to end: tasks flow (`BUDGET_TEST_TASKS`, 800 in the suite;
2,000 passed in a run of their own) through the real poller (its cycle
and quick checks, `bridge.poller.loop`) and the real Slurm client, whose commands are a
counting stand-in (tests/fakes/slurmbin: each call logs its time). However many tasks wait, the
calls in any window never pass what the budget allows, and every task still ends (some of them
canceled while they run: cancels and submissions wait for the budget, never fail for it)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from bridge.config import Config, load_config
from bridge.core.tes import TERMINAL_STATES
from bridge.poller import Poller
from bridge.poller.loop import _between_cycles, _run_cycle
from bridge.slurm import RPC_COST, SlurmClient
from bridge.store import Store, TaskRow
from bridge.system.budget import CallBudget

FAKE = Path(__file__).parents[1] / "fakes" / "slurmbin"
#: 2,000 in a run of its own (about 4.5 minutes here); fewer in the whole suite.
TASKS = int(os.environ.get("BUDGET_TEST_TASKS", "800"))
RATE = 20.0
BURST = 10
#: A command's time is logged by the command itself, a few ms after the poller took its
#: tokens: windows are widened by this much.
SPAWN = 0.1
RPC_COMMANDS = ("sbatch", "squeue", "sacct", "scancel", "sinfo", "scontrol")
ECHO = {"executors": [{"image": "alpine", "command": ["echo", "hello"]}]}


class Images:
    def resolve(self, images: list[str]) -> dict[str, str]:
        return {image: f"/cache/{image}.sif" for image in images}

    def problem(self, image: str) -> str | None:
        return None

    def prune(self, oldest_unfinished: float | None) -> None:
        return None


def counter(name: str, command: str) -> float:
    return REGISTRY.get_sample_value(name, {"command": command}) or 0.0


def calls_logged(path: Path) -> list[tuple[float, str]]:
    calls = []
    for line in path.read_text().splitlines():
        stamp, command = line.split()
        calls.append((float(stamp), command))
    return sorted(calls)


def most_in_a_window(calls: list[tuple[float, str]], window: float) -> int:
    """The most RPCs (RPC_COST) the calls made within any `window` seconds."""
    times = [t for t, _ in calls]
    costs = [RPC_COST.get(command, 1) for _, command in calls]
    most, total, first = 0, 0, 0
    for last in range(len(times)):
        total += costs[last]
        while times[last] - times[first] > window:
            total -= costs[first]
            first += 1
        most = max(most, total)
    return most


def run_loop(poller: Poller, config: Config, done: threading.Event) -> None:
    """The poller process's loop (run_poller without its lock, signals and wake socket)."""
    stop, wake, nudge = threading.Event(), threading.Event(), threading.Event()
    while not done.is_set():
        _run_cycle(poller, config.work_dir)
        _between_cycles(poller, config.slurm.poll_interval, stop, wake, nudge)


def test_calls_stay_within_the_budget_while_tasks_flow(
    tmp_path: Path, sqlite_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "fake-slurm"
    state.mkdir()
    monkeypatch.setenv("FAKE_SLURM_DIR", str(state))
    monkeypatch.setenv("FAKE_SLURM_RUN", "3")
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        # as the cluster tests run it: a squeue every 0.5 s
        overrides={
            "slurm.poll_interval": 0.5,
            "slurm.calls_per_second": RATE,
            "slurm.calls_burst": BURST,
            "slurm.arrays": "never",  # one sbatch per task: the stand-in's sbatch makes no arrays
        },
    )
    store = sqlite_store
    client = SlurmClient(queue_user="tes", budget=CallBudget(RATE, BURST))
    poller = Poller(config, store, slurm_client=client, images=Images())
    waits_before = {c: counter("tes_bridge_slurm_budget_waits_total", c) for c in RPC_COMMANDS}
    sbatch_before = counter("tes_bridge_slurm_calls_total", "sbatch")

    for _ in range(TASKS):
        store.create_task(ECHO)
    done = threading.Event()
    loop = threading.Thread(target=run_loop, args=(poller, config, done), daemon=True)
    started = time.monotonic()
    loop.start()
    canceled: list[str] = []
    try:
        deadline = started + 480
        while time.monotonic() < deadline:
            assert loop.is_alive(), "the poller's loop died (see the thread's exception above)"
            with store.db.connection_context():
                rows = list(TaskRow.select(TaskRow.id, TaskRow.state, TaskRow.job_id,
                                           TaskRow.cancel_pending).tuples())  # fmt: skip
                # Every tenth job is canceled while Slurm has it (after its sbatch).
                for task_id, task_state, job_id, _ in rows:
                    if task_state not in TERMINAL_STATES and int(job_id or 1) % 10 == 0:
                        store.cancel_task(task_id)
                        canceled.append(task_id)
                if all(row[1] in TERMINAL_STATES and not row[3] for row in rows):
                    break
            time.sleep(0.5)
    finally:
        done.set()
        loop.join(timeout=60)
    seconds = time.monotonic() - started

    with store.db.connection_context():
        states = dict(TaskRow.select(TaskRow.id, TaskRow.state).tuples())
    assert all(state in TERMINAL_STATES for state in states.values()), "tasks did not all end"
    assert {states[task_id] for task_id in canceled} <= {"CANCELED", "COMPLETE"}
    assert sum(state == "COMPLETE" for state in states.values()) >= TASKS - len(canceled)

    calls = calls_logged(state / "calls.log")
    commands = [command for _, command in calls]
    print(f"{len(calls)} commands in {seconds:.1f} s:",
          {c: commands.count(c) for c in sorted(set(commands))})  # fmt: skip
    assert commands.count("sbatch") == TASKS  # each task once; none failed for the budget
    assert "scancel" in commands
    assert commands.count("scontrol") == 1  # slurmctld's rate limit, read once at start
    # The budget was what held the poller back (it waited), and it was never exceeded: in any
    # window, at most a full bucket plus the refill of that window.
    waits = {
        c: counter("tes_bridge_slurm_budget_waits_total", c) - waits_before[c] for c in RPC_COMMANDS
    }
    print("waits for the budget:", waits)
    assert sum(waits.values()) > 0
    assert counter("tes_bridge_slurm_calls_total", "sbatch") - sbatch_before == TASKS
    for window in (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0):
        most = most_in_a_window(calls, window)
        allowed = BURST + RATE * (window + SPAWN)
        print(f"most RPCs within {window} s: {most} (allowed {allowed:g})")
        assert most <= allowed, f"{most} RPCs within {window} s; the budget allows {allowed:g}"
    spent = sum(RPC_COST.get(command, 1) for command in commands)
    print(f"{spent} RPCs, {spent / (calls[-1][0] - calls[0][0]):.1f} a second")
    assert spent <= BURST + RATE * (calls[-1][0] - calls[0][0] + SPAWN)
    # The follow kept reading Slurm while the submissions took most of the budget: from the
    # first sbatch on, never 10 s without a squeue (the submissions alone take TASKS / RATE
    # seconds of the budget: a follow starved by them would wait that long). In seconds, not
    # in reads per second: a poll cycle's length is the machine's, slower under load.
    first_sbatch = next(t for t, command in calls if command == "sbatch")
    reads = [t for t, command in calls if command == "squeue"]
    gaps = [later - earlier for earlier, later in zip([first_sbatch, *reads], reads, strict=False)]
    print(f"{len(reads)} squeue; the longest time without one: {max(gaps):.1f} s")
    assert max(gaps) <= 10.0
