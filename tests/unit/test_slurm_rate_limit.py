"""slurmctld's RPC rate limit as the client sees it: sbatch and scancel run with -v, the
retries their stderr tells of are counted and logged, their verbose lines never reach the
callers, and a command the limit slowed past its time-out is told apart from no answer.

Commands are small scripts that print what Slurm prints (the lines below are real: Slurm
26.05.5's `squeue -v` limited by slurmctld, and what sbatch -v and scancel -v print)."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from bridge.slurm import Outage, SlurmClient, SlurmRejected, SlurmUnavailable, run
from bridge.slurm.run import clean_stderr

#: What slurmctld's limit makes a command print at -v (squeue-rate-limited.txt.stderr, 26.05).
LIMITED = "squeue: RPC rate limited 1 time(s). Sleeping then trying again.\n"
#: sbatch -v's option dump, on stderr (the job id alone goes to stdout).
SBATCH_DUMP = (
    "sbatch: defined options\n"
    "sbatch: -------------------- --------------------\n"
    "sbatch: output              : /dev/null\n"
    "sbatch: verbose             : 1\n"
    "sbatch: -------------------- --------------------\n"
    "sbatch: end of defined options\n"
)


def sbatch_limited(times: int) -> str:
    return "".join(
        f"sbatch: RPC rate limited {n} time(s). Sleeping then trying again.\n"
        for n in range(1, times + 1)
    )


def tool(tmp_path: Path, name: str, *, stderr: str = "", stdout: str = "", after: str = "") -> str:
    """A command that records its argv in <name>.calls, prints `stdout` and `stderr`, then runs
    `after` (sh)."""
    (tmp_path / f"{name}.err").write_text(stderr)
    (tmp_path / f"{name}.out").write_text(stdout)
    path = tmp_path / name
    path.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{tmp_path / name}.calls"\n'
        f'cat "{tmp_path / name}.out"\ncat "{tmp_path / name}.err" >&2\n{after}\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def calls(tmp_path: Path, name: str) -> list[str]:
    file = tmp_path / f"{name}.calls"
    return file.read_text().splitlines() if file.exists() else []


def retries(command: str) -> float:
    value = REGISTRY.get_sample_value("tes_bridge_slurm_rate_limited_total", {"command": command})
    return value or 0.0


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no warning said (they are said once a minute per command)."""
    monkeypatch.setattr(run, "_slowed", run._SlowedLog())


def test_verbose_lines_go_and_errors_stay() -> None:
    stderr = (
        SBATCH_DUMP
        + sbatch_limited(2)
        + "sbatch: warning: can't honor --ntasks-per-node set to 2\n"
        + "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
        + "sbatch: fatal: --gpus-per-node and --gres=gpu are mutually exclusive.\n"
        + "slurm_load_jobs error: Invalid job id specified\n"
        + "sudo: a password is required\n"
    )
    cleaned, counted = clean_stderr("sbatch", stderr)
    assert counted == 2
    assert cleaned == (
        "sbatch: warning: can't honor --ntasks-per-node set to 2\n"
        "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
        "sbatch: fatal: --gpus-per-node and --gres=gpu are mutually exclusive.\n"
        "slurm_load_jobs error: Invalid job id specified\n"
        "sudo: a password is required\n"
    )
    # scancel -v's words, for a job it cancels and one it does not know (exit 0 all the same).
    cleaned, counted = clean_stderr(
        "scancel",
        "scancel: Terminating job 5\n"
        "scancel: error: Kill job error on job id 9: Invalid job id specified\n",
    )
    assert (cleaned, counted) == (
        "scancel: error: Kill job error on job id 9: Invalid job id specified\n",
        0,
    )
    # squeue's two RPCs, each limited once (its -v output; squeue itself never runs with -v).
    assert clean_stderr("squeue", LIMITED * 2) == ("", 2)
    # A tool installed under another name still names itself as Slurm's tool.
    assert clean_stderr("sbatch-wrapper", SBATCH_DUMP) == ("", 0)
    assert clean_stderr("squeue", "") == ("", 0)


def test_sbatch_and_scancel_run_with_v_and_their_callers_see_no_verbose_line(
    tmp_path: Path,
) -> None:
    sbatch = tool(tmp_path, "sbatch", stdout="42\n", stderr=SBATCH_DUMP)
    scancel = tool(tmp_path, "scancel", stderr="scancel: Terminating job 42\n")
    client = SlurmClient(sbatch=sbatch, scancel=scancel)
    assert client.submit(tmp_path / "job.sh", job_name="tes-x") == "42"
    client.cancel(["42"])
    assert calls(tmp_path, "sbatch") == [f"--parsable -v --job-name=tes-x {tmp_path}/job.sh"]
    assert calls(tmp_path, "scancel") == ["-v 42"]


def test_a_refusal_read_through_v_reads_as_without_it(tmp_path: Path) -> None:
    refusal = "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
    sbatch = tool(tmp_path, "sbatch", stderr=SBATCH_DUMP + refusal, after="exit 1")
    with pytest.raises(SlurmRejected) as caught:
        SlurmClient(sbatch=sbatch).submit(tmp_path / "job.sh", job_name="tes-x")
    assert caught.value.stderr == refusal
    assert caught.value.reason == "Batch job submission failed: Invalid partition name specified"


def test_through_sudo_the_v_follows_the_tool_and_scancel_goes_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Site mode: `sbatch --parsable -v ...` is what the sudo rule's `sbatch --parsable *`
    allows; its scancel rule allows job ids alone. sudo gets each tool by the path the
    service's PATH gives it (sudo's own secure_path may find another release's first)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "scancel"):
        tool(bin_dir, name)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    sudo = tool(tmp_path, "sudo", stdout="43\n")
    client = SlurmClient(sudo=sudo)
    client.submit(tmp_path / "job.sh", job_name="tes-x", as_user="alice")
    client.cancel(["43"], as_user="alice")
    assert calls(tmp_path, "sudo") == [
        f"-n -u alice -- {bin_dir}/sbatch --parsable -v --job-name=tes-x {tmp_path}/job.sh",
        f"-n -u alice -- {bin_dir}/scancel 43",
    ]


def test_retries_are_counted_and_said_once_a_minute(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sbatch = tool(tmp_path, "sbatch", stdout="44\n", stderr=SBATCH_DUMP + sbatch_limited(3))
    client = SlurmClient(sbatch=sbatch)
    before = retries("sbatch")
    with caplog.at_level(logging.WARNING, logger="bridge.slurm"):
        client.submit(tmp_path / "job.sh", job_name="tes-x")
        client.submit(tmp_path / "job.sh", job_name="tes-y")
    assert retries("sbatch") - before == 6
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("slurmctld's RPC rate limit made sbatch back off and retry 3 time(s)")
    assert "slurm.calls_per_second" in said


def test_the_retries_held_back_are_said_with_the_next_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    monkeypatch.setattr(run.time, "monotonic", lambda: now[0])
    slowed = run._SlowedLog()
    with caplog.at_level(logging.WARNING, logger="bridge.slurm"):
        slowed.note("sbatch", 1)
        slowed.note("sbatch", 2)
        slowed.note("scancel", 1)  # another command: said at once
        now[0] += run.RATE_LIMITED_LOG_SECONDS
        slowed.note("sbatch", 4)
    said = [r.getMessage().split(" since")[0] for r in caplog.records]
    assert said == [
        "slurmctld's RPC rate limit made sbatch back off and retry 1 time(s)",
        "slurmctld's RPC rate limit made scancel back off and retry 1 time(s)",
        "slurmctld's RPC rate limit made sbatch back off and retry 6 time(s)",
    ]


def test_a_command_slowed_past_its_time_out_is_rate_limited_not_unreachable(
    tmp_path: Path,
) -> None:
    """The client retries a limited RPC for ever: only the time-out ends it. The error says
    so, and that the job may exist (the last attempt may have been in flight)."""
    sbatch = tool(tmp_path, "sbatch", stderr=SBATCH_DUMP + sbatch_limited(2), after="sleep 5")
    before = retries("sbatch")
    with pytest.raises(SlurmUnavailable) as caught:
        SlurmClient(sbatch=sbatch, timeout=1).submit(tmp_path / "job.sh", job_name="tes-x")
    err = caught.value
    assert err.outage is Outage.RATE_LIMITED and err.may_have_acted
    assert err.returncode is None and err.stderr == ""
    assert "slowed by slurmctld's RPC rate limit for longer than slurm.command_timeout" in str(err)
    assert "slurm.calls_per_second" in str(err)
    assert retries("sbatch") - before == 2


def test_a_time_out_without_retries_is_still_no_answer(tmp_path: Path) -> None:
    sbatch = tool(tmp_path, "sbatch", stderr=SBATCH_DUMP, after="sleep 5")
    with pytest.raises(SlurmUnavailable) as caught:
        SlurmClient(sbatch=sbatch, timeout=1).submit(tmp_path / "job.sh", job_name="tes-x")
    assert caught.value.outage is Outage.UNCERTAIN
    assert "did not answer within 1 s" in str(caught.value)


def test_a_command_held_by_a_job_limit_stays_a_limit_when_it_was_slowed_too(
    tmp_path: Path,
) -> None:
    queue_full = "sbatch: error: Slurm job queue full, sleeping and retrying\n"
    sbatch = tool(tmp_path, "sbatch", stderr=sbatch_limited(1) + queue_full, after="sleep 5")
    with pytest.raises(SlurmUnavailable) as caught:
        SlurmClient(sbatch=sbatch, timeout=1).submit(tmp_path / "job.sh", job_name="tes-x")
    assert caught.value.outage is Outage.LIMIT and caught.value.may_have_acted


def test_squeue_never_gets_v(tmp_path: Path) -> None:
    """squeue -v prints its dump on stdout, where the parser reads jobs."""
    squeue = tool(tmp_path, "squeue")
    SlurmClient(squeue=squeue).queue(["1", "2"])
    (call,) = calls(tmp_path, "squeue")
    assert "-v" not in call.split()
