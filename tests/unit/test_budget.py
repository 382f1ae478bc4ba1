"""The budget of Slurm calls: the token bucket, slurmctld's rate limit read from `scontrol show
config`, and squeue's forms per Slurm version (a stand-in squeue that records its argv)."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from bridge.config import load_config
from bridge.poller import Poller
from bridge.poller.submit import BUDGET_RESERVE
from bridge.slurm import (
    QUEUE_BY_USER_FROM,
    RateLimit,
    SlurmClient,
    SlurmFeatures,
    exempt_because,
    parse_job_states,
    parse_rate_limit,
    parse_slurm_user,
    parse_version,
    squeue_argv,
)
from bridge.store import Store
from bridge.system.budget import CallBudget, lower_of
from tests.fakes.slurm import FakeSlurm


class Clock:
    """Time that moves only when slept through (or told to)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


#: An ordinary account's uid ("nobody"): slurmctld's rate limit covers it.
NOBODY = 65534


def waits(command: str) -> float:
    value = REGISTRY.get_sample_value("tes_bridge_slurm_budget_waits_total", {"command": command})
    return value or 0.0


# --- the bucket ----------------------------------------------------------------------------


def test_a_full_bucket_gives_its_burst_at_once_then_the_rate() -> None:
    clock = Clock()
    budget = CallBudget(2.0, 5, clock=clock, sleep=clock.sleep)
    for _ in range(5):
        assert budget.take("squeue") == 0.0
    assert budget.available() == 0
    before = waits("sbatch")
    waited = budget.take("sbatch")  # the sixth waits for one token: half a second
    assert waited == pytest.approx(0.5, abs=0.002)
    assert waits("sbatch") == before + 1
    started = clock.now
    for _ in range(10):
        budget.take("sbatch")
    assert clock.now - started == pytest.approx(5.0, abs=0.02)  # 10 more at 2 a second


def test_calls_never_pass_burst_plus_rate_times_the_window() -> None:
    clock = Clock()
    budget = CallBudget(3.0, 4, clock=clock, sleep=clock.sleep)
    times = []
    for i in range(200):
        budget.take("squeue", cost=2 if i % 3 == 0 else 1)
        times.append((clock.now, 2 if i % 3 == 0 else 1))
        clock.now += 0.01 * (i % 7)  # the caller's own work between calls
    for start, _ in times:
        for window in (0.1, 0.5, 1.0, 5.0):
            spent = sum(cost for t, cost in times if start <= t < start + window)
            assert spent <= 4 + 3.0 * window + 0.01


def test_the_bucket_refills_while_idle_but_never_above_its_burst() -> None:
    clock = Clock()
    budget = CallBudget(2.0, 4, clock=clock, sleep=clock.sleep)
    for _ in range(4):
        budget.take("squeue")
    clock.now += 1.0
    assert budget.available() == 2
    clock.now += 100.0
    assert budget.available() == 4


def test_allows_leaves_tokens_for_more_urgent_calls_and_counts_a_wait() -> None:
    clock = Clock()
    budget = CallBudget(1.0, 6, clock=clock, sleep=clock.sleep)
    for _ in range(2):
        budget.take("sbatch")
    assert budget.allows(keep=3)  # 4 left
    budget.take("sbatch")
    before = waits("sbatch")
    assert not budget.allows(keep=3, command="sbatch")  # 3 left: kept for others
    assert waits("sbatch") == before + 1
    assert budget.allows(keep=0, cost=2)
    assert clock.slept == []  # looking never waits


def test_an_unlimited_budget_never_waits() -> None:
    clock = Clock()
    budget = CallBudget.unlimited()
    budget.sleep = clock.sleep
    for _ in range(1000):
        assert budget.take("squeue", cost=2) == 0.0
    assert budget.allows(keep=10**6)
    assert budget.spent == 2000
    assert budget.describe() == "no limit"


def test_a_cost_above_the_burst_takes_the_whole_bucket_instead_of_waiting_forever() -> None:
    clock = Clock()
    budget = CallBudget(2.0, 1, clock=clock, sleep=clock.sleep)
    budget.take("squeue", cost=2)
    assert budget.take("squeue", cost=2) == pytest.approx(0.5, abs=0.002)


def test_a_cluster_limit_lowers_the_setting_and_never_raises_it() -> None:
    clock = Clock()
    budget = CallBudget(2.0, 28, clock=clock, sleep=clock.sleep)
    budget.limit_to(1.0, 48)
    assert (budget.rate, budget.burst) == (1.0, 28)
    budget.limit_to(5.0, 10)
    assert (budget.rate, budget.burst) == (2.0, 10)
    budget.limit_to(None, None)
    assert (budget.rate, budget.burst) == (2.0, 28)
    assert lower_of(0.0, 0, 2.0, 28) == (2.0, 28)  # no budget set: the cluster's
    assert lower_of(0.0, 5, None, None) == (0.0, 5)


def test_setting_the_same_limit_again_keeps_what_was_spent() -> None:
    clock = Clock()
    budget = CallBudget(2.0, 10, clock=clock, sleep=clock.sleep)
    for _ in range(10):
        budget.take("squeue")
    budget.limit_to(2.0, 12)  # the hourly read finds the same limit
    assert budget.available() == 0


# --- slurmctld's rate limit ----------------------------------------------------------------

CONFIG = """Configuration data as of 2026-11-25T20:00:00
AccountingStorageBackupHost = (null)
SlurmctldParameters     = {}
SlurmctldPidFile        = /var/run/slurmctld.pid
SlurmctldPort           = 6817
"""


@pytest.mark.parametrize(
    ("parameters", "limit"),
    [
        ("(null)", None),
        ("enable_configless", None),
        ("enable_configless,rl_enable,rl_bucket_size=50", RateLimit(50, 2, 1)),
        ("rl_enable", RateLimit(30, 2, 1)),
        ("rl_enable,rl_refill_rate=10,rl_refill_period=2,rl_table_size=4096", RateLimit(30, 10, 2)),
        # Slurm's defaults for values slurmctld up to 25.11.0 takes as read, 25.11.1+ refuses
        ("rl_enable,rl_bucket_size=0,rl_refill_rate=x", RateLimit(30, 2, 1)),
        ("idle_on_node_suspend,RL_ENABLE,rl_log_freq=10", RateLimit(30, 2, 1)),
    ],
)
def test_rate_limit_from_scontrol_show_config(parameters: str, limit: RateLimit | None) -> None:
    assert parse_rate_limit(CONFIG.format(parameters)) == limit


def test_rate_limit_in_calls_a_second_and_a_burst_an_even_refill_may_take() -> None:
    limit = RateLimit(bucket_size=50, refill_rate=10, refill_period=2)
    assert limit.per_second == 5.0
    # slurmctld adds its 10 tokens at whole periods: one refill may come later than ours
    assert limit.safe_burst == 40
    assert RateLimit().safe_burst == 28  # the defaults' bucket: the default setting


def stand_in(tmp_path: Path, name: str, body: str) -> str:
    """A command that records its argv in <name>.calls and runs `body` (sh)."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{tmp_path / name}.calls"\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def calls(tmp_path: Path, name: str) -> list[str]:
    file = tmp_path / f"{name}.calls"
    return file.read_text().splitlines() if file.exists() else []


def test_the_client_lowers_its_budget_to_slurmctlds_before_its_first_command(
    tmp_path: Path,
) -> None:
    scontrol = stand_in(
        tmp_path, "scontrol", f"cat <<'EOF'\n{CONFIG.format('rl_enable,rl_refill_rate=1')}EOF"
    )
    sacct = stand_in(tmp_path, "sacct", "")
    # An ordinary account (the suite runs as root, whom slurmctld does not limit).
    client = SlurmClient(scontrol=scontrol, sacct=sacct, budget=CallBudget(2.0, 28), uid=NOBODY)
    client.accounting(["1"])
    client.accounting(["2"])
    assert calls(tmp_path, "scontrol") == ["show config"]  # once, not per command
    assert (client.budget.rate, client.budget.burst) == (1.0, 28)
    assert client.budget.spent == 4  # scontrol (two RPCs) and two sacct


@pytest.mark.parametrize(
    ("uid", "slurm_user", "why"),
    [(0, "slurm", "it is root"), (NOBODY, "nobody", "it is SlurmUser (nobody)")],
)
def test_root_and_slurmuser_keep_their_budget_under_the_rate_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, uid: int, slurm_user: str, why: str
) -> None:
    """slurmctld never limits root or its SlurmUser: their budget is not lowered to the limit,
    and the log says why, once."""
    config = CONFIG.format("rl_enable,rl_refill_rate=1") + f"SlurmUser = {slurm_user}(64030)\n"
    scontrol = stand_in(tmp_path, "scontrol", f"cat <<'EOF'\n{config}EOF")
    sacct = stand_in(tmp_path, "sacct", "")
    client = SlurmClient(scontrol=scontrol, sacct=sacct, budget=CallBudget(2.0, 28), uid=uid)
    with caplog.at_level(logging.INFO, logger="bridge.slurm"):
        client.accounting(["1"])
        client._rate_limit_due = 0.0  # the hourly read again
        client.accounting(["2"])
    assert calls(tmp_path, "scontrol") == ["show config", "show config"]
    assert (client.budget.rate, client.budget.burst) == (2.0, 28)
    said = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert said == [
        "slurmctld's RPC rate limit (30 calls at once, 1 more every 1 s) does not apply to this "
        f"account: {why}; the call budget stays 2 calls/s, bursts of 28"
    ]


@pytest.mark.parametrize(
    ("line", "user"),
    [
        ("SlurmUser               = root(0)", "root"),  # Slurm 22.05, 24.11, 26.05 (captured)
        ("SlurmUser = slurm(64030)", "slurm"),
        ("SlurmdUser = root(0)", None),
        ("", None),
    ],
)
def test_slurm_user_from_scontrol_show_config(line: str, user: str | None) -> None:
    assert parse_slurm_user(CONFIG.format("rl_enable") + line + "\n") == user


def test_only_root_and_slurmuser_are_exempt() -> None:
    assert exempt_because(0, "root", "slurm") == "it is root"
    assert exempt_because(64030, "slurm", "slurm") == "it is SlurmUser (slurm)"
    assert exempt_because(1000, "tesbridge", "slurm") is None
    assert exempt_because(1000, None, None) is None


def test_a_cluster_without_rate_limit_keeps_the_setting_and_a_failed_read_is_no_error(
    tmp_path: Path,
) -> None:
    scontrol = stand_in(tmp_path, "scontrol", "echo 'scontrol: error: no controller' >&2; exit 1")
    sacct = stand_in(tmp_path, "sacct", "")
    client = SlurmClient(scontrol=scontrol, sacct=sacct, budget=CallBudget(2.0, 28))
    client.accounting(["1"])
    assert (client.budget.rate, client.budget.burst) == (2.0, 28)
    assert len(calls(tmp_path, "sacct")) == 1


def test_without_a_budget_no_scontrol_runs(tmp_path: Path) -> None:
    scontrol = stand_in(tmp_path, "scontrol", "")
    sacct = stand_in(tmp_path, "sacct", "")
    SlurmClient(scontrol=scontrol, sacct=sacct).accounting(["1"])
    assert calls(tmp_path, "scontrol") == []


# --- squeue's forms per version ------------------------------------------------------------


@pytest.mark.parametrize(
    ("printed", "version", "features"),
    [
        ("slurm 22.05.8", (22, 5, 8), SlurmFeatures(False, False)),
        ("slurm-wlm 22.05.8", (22, 5, 8), SlurmFeatures(False, False)),
        ("slurm 23.02.0", (23, 2, 0), SlurmFeatures(True, False)),
        ("slurm 23.11.4", (23, 11, 4), SlurmFeatures(True, False)),
        ("slurm 23.11.5-1", (23, 11, 5), SlurmFeatures(True, True)),
        ("slurm 24.05", (24, 5), SlurmFeatures(True, True)),
        ("nothing here", None, SlurmFeatures(False, False)),
    ],
)
def test_version_and_what_it_offers(
    printed: str, version: tuple[int, ...] | None, features: SlurmFeatures
) -> None:
    assert parse_version(printed) == version
    assert SlurmFeatures.of(version) == features


def test_the_argv_of_each_form() -> None:
    assert squeue_argv("squeue", ["--jobs=1,2"]) == [
        "squeue", "-h", "-r", "--states=all", "--jobs=1,2", "-o", "%i|%j|%T|%r|%N|%P|%S|%e|%M|%k",
    ]  # fmt: skip
    assert squeue_argv("squeue", ["--jobs=1,2"], states_only=True) == [
        "squeue", "-h", "-r", "--only-job-state", "--states=all", "--jobs=1,2", "-o", "%i|%T",
    ]  # fmt: skip
    assert parse_job_states("1|RUNNING\n2|CANCELLED by 0\n\nbad\n") == {
        "1": "RUNNING",
        "2": "CANCELLED",
    }


@pytest.mark.parametrize(
    ("printed", "states_only"),
    [("slurm 22.05.8", False), ("slurm 23.11.4", False), ("slurm 23.11.5", True)],
)
def test_job_states_use_the_lighter_rpc_where_squeue_has_it(
    tmp_path: Path, printed: str, states_only: bool
) -> None:
    squeue = stand_in(
        tmp_path,
        "squeue",
        f"""case "$*" in
  --version) echo "{printed}" ;;
  *only-job-state*) printf '7|RUNNING\\n8|COMPLETED\\n' ;;
  *) printf '7|tes-a|RUNNING|None|n1|main|2026-11-25T20:00:00|N/A|0:05|(null)\\n' ;;
esac""",
    )
    client = SlurmClient(squeue=squeue)
    expected = {"7": "RUNNING", "8": "COMPLETED"} if states_only else {"7": "RUNNING"}
    assert client.queue_states(["7", "8"]) == expected
    client.queue_states(["7"])
    argvs = calls(tmp_path, "squeue")
    assert argvs.count("--version") == 1  # read once
    asked = [a for a in argvs if a != "--version"]
    assert all(("--only-job-state" in a) is states_only for a in asked)
    assert all("--states=all" in a for a in asked)


def test_array_elements_states_are_asked_by_their_arrays_id(tmp_path: Path) -> None:
    """26.05's `--only-job-state` answers each element id asked with every element asked of its
    array (N ids, N*N lines: real output replayed): the client asks for the array once, by its
    id, and keeps the elements it follows."""
    data = Path(__file__).parents[1] / "data" / "slurm" / "26.05"
    squeue = stand_in(
        tmp_path,
        "squeue",
        f"""case "$*" in
  --version) echo "slurm 26.05.5" ;;
  *11589_*) cat {data / "squeue-only-job-state-elements.txt"} ;;
  *) cat {data / "squeue-only-job-state-array.txt"} ;;
esac""",
    )
    elements = (data / "squeue-only-job-state-elements.txt").read_text().splitlines()
    assert len(elements) == 9 and len(set(elements)) == 3  # what asking by element gives
    client = SlurmClient(squeue=squeue)
    followed = ["11589_0", "11589_3", "77"]
    assert client.queue_states(followed) == {"11589_0": "PENDING", "11589_3": "PENDING"}
    asked = [a for a in calls(tmp_path, "squeue") if a != "--version"]
    assert len(asked) == 1 and "--jobs=77,11589 " in asked[0]


# --- the poller spends it ------------------------------------------------------------------


@pytest.fixture
def budget_env(tmp_path: Path, sqlite_store: Store) -> tuple[Poller, Store, FakeSlurm, Clock]:
    from tests.unit.test_poller import FakeImages

    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"slurm.arrays": "never"},  # one sbatch per task: each spends a call
    )
    slurm = FakeSlurm()
    clock = Clock()
    slurm.budget = CallBudget(2.0, 12, clock=clock, sleep=clock.sleep)
    poller = Poller(config, sqlite_store, slurm_client=slurm, images=FakeImages())
    poller.clock = clock
    return poller, sqlite_store, slurm, clock


ECHO = {"executors": [{"image": "alpine", "command": ["echo", "hello"]}]}


def test_a_round_of_submissions_leaves_the_cycles_reserve_and_the_rest_wait_queued(
    budget_env: tuple[Poller, Store, FakeSlurm, Clock],
) -> None:
    poller, store, slurm, clock = budget_env
    ids = [store.create_task(ECHO).id for _ in range(30)]
    before = waits("sbatch")
    stats = poller.cycle()
    assert stats.submitted == 12 - BUDGET_RESERVE  # what the bucket held, less the reserve
    assert waits("sbatch") == before + 1
    assert slurm.calls.count("squeue") == 1  # the follow and cancels still had their tokens
    assert clock.slept == []  # nothing waited: the rest are simply QUEUED for later
    states = [store.get_task(task_id).state for task_id in ids]  # type: ignore[union-attr]
    assert states.count("QUEUED") == 30  # submitted ones stay QUEUED until they run
    for _ in range(40):
        clock.now += 1.0
        poller.cycle()
    assert slurm.calls.count("sbatch") == 30  # all went, none failed, each once


def test_the_follow_reads_slurm_at_half_the_rate_while_the_budget_is_low(
    budget_env: tuple[Poller, Store, FakeSlurm, Clock],
) -> None:
    poller, store, slurm, clock = budget_env
    for _ in range(3):
        store.create_task(ECHO)
    poller.cycle()  # 3 sbatch, 1 squeue (2 RPCs): 7 tokens left of 12
    squeues = slurm.calls.count("squeue")
    for _ in range(4):
        slurm.budget.take("sbatch")  # someone else ran it down: 3 left, below half
    poller.cycle()
    assert slurm.calls.count("squeue") == squeues  # paced: the last read was just now
    clock.now += 1.0  # 5 tokens now, still below half
    poller.cycle()
    assert slurm.calls.count("squeue") == squeues  # its 2 RPCs at half the rate: 2 s
    clock.now += 1.0
    poller.cycle()
    assert slurm.calls.count("squeue") == squeues + 1


def test_the_capabilities_sinfo_waits_for_a_budget_with_room_to_spare(
    budget_env: tuple[Poller, Store, FakeSlurm, Clock],
) -> None:
    poller, _, slurm, clock = budget_env
    for _ in range(6):
        slurm.budget.take("sbatch")  # 6 left: fewer than the 8 the capabilities leave
    poller.cycle()
    assert slurm.partition_reads == 0
    clock.now += 10.0
    poller.cycle()
    assert slurm.partition_reads == 1


def test_calls_are_counted_by_command_for_metrics() -> None:
    from bridge.system.metrics import observe_slurm_command

    def calls_of(command: str) -> float:
        sample = REGISTRY.get_sample_value("tes_bridge_slurm_calls_total", {"command": command})
        return sample or 0.0

    before = calls_of("sbatch"), calls_of("scontrol")
    observe_slurm_command(["sudo", "-n", "-u", "alice", "--", "/usr/bin/sbatch", "x"], 0.1, False)
    observe_slurm_command(["scontrol", "show", "config"], 0.1, True)
    assert (calls_of("sbatch"), calls_of("scontrol")) == (before[0] + 1, before[1] + 1)


def test_at_site_scale_only_jobs_not_still_running_are_read_in_full(tmp_path: Path) -> None:
    # 23.11.5+: the states of 1,000 jobs through the lighter RPC; in full only those that are
    # new, pending (their reason may change) or ended. 22.05 reads them all in full.
    ids = [str(5000 + i) for i in range(QUEUE_BY_USER_FROM)]
    states = "".join(f"{j}|{'PENDING' if j == '5000' else 'RUNNING'}\\n" for j in ids)
    full = "".join(
        f"{j}|tes-{j}|{'PENDING' if j == '5000' else 'RUNNING'}|None|n1|main|"
        f"2026-11-25T20:00:00|N/A|0:05|(null)\\n"
        for j in ids
    )
    squeue = stand_in(
        tmp_path,
        "squeue",
        f"""case "$*" in
  --version) echo "slurm 23.11.5" ;;
  *only-job-state*) printf '{states}' ;;
  *) printf '{full}' ;;
esac""",
    )
    client = SlurmClient(squeue=squeue)
    first = client.queue(ids)
    assert len(first) == QUEUE_BY_USER_FROM and first["5001"].node == "n1"
    second = client.queue(ids)
    assert second == first
    argvs = [a for a in calls(tmp_path, "squeue") if a != "--version"]
    assert ["only-job-state" in a for a in argvs] == [True, False, True, False]
    assert argvs[1].count(",") == QUEUE_BY_USER_FROM - 1  # the first time: every job in full
    assert "--jobs=5000 " in argvs[3] + " "  # then only the pending one
