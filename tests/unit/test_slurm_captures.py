"""Every Slurm release's real output through the client's parsers and error handling.

tests/data/slurm/<release>/ holds what tests/data/slurm/capture.sh recorded on the local cluster
running that release (LOCAL_CLUSTER_SLURM): the same jobs, named by what they do (tes-ok,
tes-fail, tes-exit137, ...), and the same commands, with each file's command and exit code in
the directory's README. The tests find jobs by name, so one test reads every release; where a
release prints something else, the test says which and why.
"""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest

from bridge.slurm import (
    JobInfo,
    Outage,
    Refusal,
    SlurmClient,
    SlurmRejected,
    SlurmRelease,
    SlurmUnavailable,
    command_error,
    parse_config_version,
    parse_job_states,
    parse_max_array_size,
    parse_rate_limit,
    parse_sacct,
    parse_sinfo_partitions,
    parse_squeue,
    parse_test_only,
    parse_version,
)

DATA = Path(__file__).parents[1] / "data" / "slurm"
RELEASES = sorted(p.name for p in DATA.iterdir() if p.is_dir() and (p / "README").exists())


def test_every_tested_release_has_its_captures() -> None:
    assert RELEASES == ["22.05", "24.11", "26.05"]


@pytest.fixture(params=RELEASES)
def release(request: pytest.FixtureRequest) -> Path:
    return DATA / request.param


def read(release: Path, name: str) -> str:
    return (release / name).read_text()


def exit_code_of(release: Path, name: str) -> int:
    match = re.search(rf"^{re.escape(name)}: .* \(exit (\d+)", read(release, "README"), re.M)
    assert match, f"{name} is not in {release / 'README'}"
    return int(match.group(1))


def slurm_release(release: Path) -> SlurmRelease:
    return SlurmRelease(parse_version(read(release, "squeue-version.txt")))


def by_name(jobs: dict[str, JobInfo]) -> dict[str, JobInfo]:
    named: dict[str, JobInfo] = {}
    for job in jobs.values():
        assert job.name not in named, f"two jobs named {job.name}"
        named[job.name] = job
    return named


def test_the_directory_is_the_release_that_made_it(release: Path) -> None:
    version = parse_version(read(release, "squeue-version.txt"))
    assert version is not None and ".".join(f"{v:02d}" for v in version[:2]) == release.name
    assert slurm_release(release).tested
    assert parse_config_version(read(release, "scontrol-show-config.txt")) == version


def test_ended_jobs_in_sacct(release: Path) -> None:
    jobs = by_name(parse_sacct(read(release, "sacct-ended.txt")))
    assert (jobs["tes-ok"].state, jobs["tes-ok"].exit_code, jobs["tes-ok"].signal) == (
        "COMPLETED", 0, 0)  # fmt: skip
    assert jobs["tes-ok"].comment == "task=ok|tag=a b"
    assert jobs["tes-ok"].node and jobs["tes-ok"].partition == "main"
    assert (jobs["tes-fail"].state, jobs["tes-fail"].exit_code) == ("FAILED", 3)
    # A script that exits 137 itself: sacct took 128 off exit statuses above it until 25.11.
    raw = slurm_release(release).features.sacct_exit_code_raw
    assert raw == (release.name >= "25.11")
    exit137 = jobs["tes-exit137"]
    assert (exit137.exit_code, exit137.signal) == ((137, 0) if raw else (9, 0))
    # A script killed by SIGKILL: the signal, in every release.
    assert (jobs["tes-signal"].state, jobs["tes-signal"].exit_code, jobs["tes-signal"].signal) == (
        "FAILED", 0, 9)  # fmt: skip
    # Cancelled while running: 0:0 on the job line, SIGTERM on the batch step.
    running = jobs["tes-running"]
    assert (running.state, running.canceled_by, running.signal) == ("CANCELLED", "0", 15)
    held = jobs["tes-held"]
    assert (held.state, held.canceled_by, held.node) == ("CANCELLED", "0", None)
    assert held.start_time is None
    # Over its --mem under task/cgroup: the kernel kills it, Slurm says so.
    oom = jobs["tes-oom"]
    assert (oom.state, oom.tes_state) == ("OUT_OF_MEMORY", "EXECUTOR_ERROR")
    assert (jobs["tes-timeout"].state, jobs["tes-timeout"].signal) == ("TIMEOUT", 15)
    assert jobs["tes-pending"].state == "COMPLETED"
    for job in jobs.values():
        assert job.ended and job.end_time is not None, job


def test_ended_jobs_in_squeue_agree_with_sacct(release: Path) -> None:
    queue = by_name(parse_squeue(read(release, "squeue-ended.txt")))
    accounting = by_name(parse_sacct(read(release, "sacct-ended.txt")))
    assert {name: job.state for name, job in queue.items()} == {
        name: job.state for name, job in accounting.items() if name in queue
    }
    assert queue["tes-held"].reason == "JobHeldUser"
    assert queue["tes-timeout"].reason == "TimeLimit"


def test_active_jobs(release: Path) -> None:
    queue = by_name(parse_squeue(read(release, "squeue-active.txt")))
    assert queue["tes-running"].state == "RUNNING" and queue["tes-running"].node
    assert queue["tes-running"].tes_state == "RUNNING"
    assert queue["tes-held"].state == "PENDING" and queue["tes-held"].reason == "JobHeldUser"
    assert queue["tes-held"].tes_state == "QUEUED"
    # Without --states=all, squeue lists only the jobs not ended.
    default = by_name(parse_squeue(read(release, "squeue-default-states.txt")))
    assert "tes-running" in default and not any(job.ended for job in default.values())


def test_the_lighter_state_query_agrees_with_the_full_one(release: Path) -> None:
    if not slurm_release(release).features.only_job_state:
        assert not (release / "squeue-only-job-state.txt").exists()
        return
    states = parse_job_states(read(release, "squeue-only-job-state.txt"))
    full = parse_squeue(read(release, "squeue-active.txt"))
    assert states and set(states) <= set(full)
    # Captured a moment apart: the same jobs, each in the same state or a later one.
    held = next(job_id for job_id, job in full.items() if job.name == "tes-held")
    assert states[held] == "PENDING"


def test_array_elements(release: Path) -> None:
    elements = parse_sacct(read(release, "sacct-array.txt"))
    assert len(elements) == 3
    by_index = {job_id.rpartition("_")[2]: job for job_id, job in elements.items()}
    assert {i: (j.state, j.exit_code) for i, j in by_index.items()} == {
        "0": ("COMPLETED", 0), "1": ("FAILED", 1), "2": ("FAILED", 2),
    }  # fmt: skip
    assert set(parse_squeue(read(release, "squeue-array.txt"))) == set(elements)


def test_a_lost_node(release: Path) -> None:
    (job,) = parse_sacct(read(release, "sacct-node-fail.txt")).values()
    assert job.state == "NODE_FAIL" and job.tes_state == "SYSTEM_ERROR"
    # 24.11 and later give a NODE_FAIL job exit code 1: Slurm's mark, not the script's status.
    assert (job.exit_code, job.signal) == (None, None)
    (queued,) = parse_squeue(read(release, "squeue-node-fail.txt")).values()
    assert queued.state == "NODE_FAIL" and queued.reason == "NodeDown"


def test_the_configuration(release: Path) -> None:
    config = read(release, "scontrol-show-config.txt")
    assert parse_max_array_size(config) == 1001
    limit = parse_rate_limit(config)
    if release.name == "22.05":
        assert limit is None  # no rl_enable before 23.02
    else:
        # The local cluster runs 24.11 and later with slurmctld's defaults.
        assert limit is not None
        assert (limit.bucket_size, limit.refill_rate, limit.refill_period) == (30, 2, 1)
        stderr = read(release, "squeue-rate-limited.txt.stderr")
        assert "RPC rate limited" in stderr


def test_the_partitions(release: Path) -> None:
    partitions = {p.name: p for p in parse_sinfo_partitions(read(release, "sinfo-partitions.txt"))}
    assert set(partitions) == {"main", "scavenger"}
    main = partitions["main"]
    # Two fake GPUs on each of the two nodes, counted over the partition.
    assert main.nodes == ("node1", "node2") and main.max_cpus_per_node == 2
    assert main.gpus == 4 and main.gpu_types == {"fake": 4}
    # What one task can have: it runs on one node.
    assert main.max_gres_per_node == {"gpu": 2, "gpu:fake": 2}


def _proc(release: Path, name: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    stderr = release / f"{name}.stderr"
    return subprocess.CompletedProcess(
        argv, exit_code_of(release, name), read(release, name),
        stderr.read_text() if stderr.exists() else "",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        ("sbatch-too-much-memory.txt", Refusal.MEMORY),
        ("sbatch-too-many-cpus.txt", Refusal.CPUS),
        ("sbatch-bad-partition.txt", Refusal.PARTITION),
        ("sbatch-bad-time.txt", Refusal.TIME_LIMIT),
        ("sbatch-too-much-tmp.txt", Refusal.TMP_DISK),
    ],
)
def test_sbatch_refusals(release: Path, name: str, refusal: Refusal) -> None:
    error = command_error(_proc(release, name, ["sbatch"]), "submitting")
    assert isinstance(error, SlurmRejected) and error.refusal == refusal, error


def test_gres_with_gpus_per_node(release: Path) -> None:
    """26.05 refuses --gres=gpu with --gpus-per-node (the bridge asks for neither together)."""
    name = "sbatch-gres-and-gpus-per-node.txt"
    code = exit_code_of(release, name)
    assert code == (1 if release.name >= "26.05" else 0)
    if code:
        error = command_error(_proc(release, name, ["sbatch"]), "submitting")
        assert isinstance(error, SlurmRejected)
        assert error.reason.startswith("--gpus-per-node and --gres=gpu are mutually exclusive")


@pytest.mark.parametrize(
    ("name", "tool", "outage"),
    [
        ("sbatch-controller-down.txt", "sbatch", Outage.UNREACHABLE),
        ("squeue-controller-down.txt", "squeue", Outage.UNREACHABLE),
        ("scancel-controller-down.txt", "scancel", Outage.UNREACHABLE),
        ("sacct-dbd-down.txt", "sacct", Outage.UNREACHABLE),
    ],
)
def test_daemons_away(release: Path, name: str, tool: str, outage: Outage) -> None:
    error = command_error(_proc(release, name, [tool]), "asking")
    assert isinstance(error, SlurmUnavailable) and error.outage == outage, error
    # sacct asks slurmdbd: with slurmctld away it still answers.
    assert exit_code_of(release, "sacct-controller-down.txt") == 0


def _replay(tmp_path: Path, tool: str, release: Path, name: str) -> str:
    lines = ["#!/bin/sh", f'cat "{release / name}"']
    if (release / f"{name}.stderr").exists():
        lines.append(f'cat "{release / name}.stderr" >&2')
    lines.append(f"exit {exit_code_of(release, name)}")
    path = tmp_path / tool
    path.write_text("\n".join(lines) + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_client_through_each_releases_commands(release: Path, tmp_path: Path) -> None:
    client = SlurmClient(
        sbatch=_replay(tmp_path, "sbatch", release, "sbatch-ok.txt"),
        squeue=_replay(tmp_path, "squeue", release, "squeue-unknown-job.txt"),
        sacct=_replay(tmp_path, "sacct", release, "sacct-ended.txt"),
        scancel=_replay(tmp_path, "scancel", release, "scancel-unknown-job.txt"),
    )
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n")
    assert client.submit(script, job_name="tes-x") == read(release, "sbatch-ok.txt").strip()
    # A single id the controller no longer knows: not an error, just not there.
    assert client.queue(["999999"]) == {}
    ended = by_name(client.accounting(["1"]))
    assert ended["tes-fail"].exit_code == 3
    client.cancel(["999999"])


def releases_with(name: str) -> list[str]:
    """The releases whose captures hold `name` (made by capture.sh since it captures it)."""
    return [r for r in RELEASES if (DATA / r / name).exists()]


@pytest.mark.parametrize("name", releases_with("squeue-pending-estimate.txt"))
def test_a_pending_jobs_expected_start_is_what_squeue_start_shows(name: str) -> None:
    release = DATA / name
    behind = by_name(parse_squeue(read(release, "squeue-pending-estimate.txt")))["tes-behind"]
    assert (behind.state, behind.reason, behind.start_time) == ("PENDING", "Resources", None)
    assert behind.expected_start is not None
    # squeue --start: JOBID PARTITION NAME USER ST START_TIME NODES SCHEDNODES NODELIST(REASON)
    start_time = read(release, "squeue-start.txt").split()[5]
    assert behind.expected_start.strftime("%Y-%m-%dT%H:%M:%S") == start_time


@pytest.mark.parametrize("name", releases_with("sbatch-test-only.txt.stderr"))
def test_sbatch_test_only_answers_where_and_when(name: str) -> None:
    release = DATA / name
    stderr = read(release, "sbatch-test-only.txt.stderr")
    estimate = parse_test_only(stderr)
    assert estimate is not None and estimate.start is not None, stderr
    assert (estimate.processors, estimate.partition) == (1, "main")
    assert estimate.nodes.startswith("node") and estimate.said in stderr
    # Behind the full cluster's fillers, whose 10 minutes had just begun, as tes-behind is.
    behind = by_name(parse_squeue(read(release, "squeue-pending-estimate.txt")))["tes-behind"]
    assert behind.expected_start is not None
    assert 0 <= (estimate.start - behind.expected_start).total_seconds() <= 300
    assert exit_code_of(release, "sbatch-test-only.txt") == 0
    refused = subprocess.CompletedProcess(
        ["sbatch", "--parsable", "--test-only"],
        exit_code_of(release, "sbatch-test-only-refused.txt"),
        "",
        read(release, "sbatch-test-only-refused.txt.stderr"),
    )
    assert refused.returncode == 1
    error = command_error(refused, "asking sbatch --test-only")
    assert isinstance(error, SlurmRejected) and "feature" in error.reason.lower(), error
