"""What differs by Slurm release (bridge.slurm.releases), and where the client reads it."""

from __future__ import annotations

import logging
import stat
import subprocess
from pathlib import Path

import pytest

from bridge.core.naming import NO_RECORDS_EXIT_CODE, SUPERSEDED_EXIT_CODE
from bridge.slurm import (
    TESTED_RELEASES,
    Outage,
    SlurmClient,
    SlurmFeatures,
    SlurmRejected,
    SlurmRelease,
    SlurmUnavailable,
    command_error,
    describe_tested,
    is_tested,
    parse_config_version,
    parse_sacct,
    parse_version,
)

#: `scontrol show config` as tests/fakes/slurmbin/scontrol prints it.
CONFIG = """Configuration data as of 2026-11-25T20:00:00
SlurmctldParameters     = (null)
SLURM_VERSION           = 22.05.8
"""


def test_the_tested_releases() -> None:
    assert TESTED_RELEASES == ((22, 5), (24, 11), (26, 5))
    assert describe_tested() == "22.05, 24.11, 26.05"


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ((22, 5, 8), True),
        ((22, 5), True),
        ((24, 11, 0), True),
        ((26, 5, 3), True),
        ((23, 11, 5), False),
        ((25, 11, 1), False),
        ((22,), False),
        (None, False),
    ],
)
def test_a_release_is_tested_by_its_major_and_minor_number(
    version: tuple[int, ...] | None, tested: bool
) -> None:
    assert is_tested(version) is tested
    assert SlurmRelease(version).tested is tested


@pytest.mark.parametrize(
    ("version", "raw"),
    [((22, 5, 8), False), ((25, 5, 9), False), ((25, 11, 0), True), ((26, 5), True), (None, False)],
)
def test_sacct_prints_exit_codes_above_128_as_they_are_from_25_11(
    version: tuple[int, ...] | None, raw: bool
) -> None:
    assert SlurmFeatures.of(version).sacct_exit_code_raw is raw


def test_a_release_has_the_features_of_its_version() -> None:
    for version in [(22, 5, 8), (23, 11, 5), (25, 11, 0), None]:
        assert SlurmRelease(version).features == SlurmFeatures.of(version)
    # The flags of earlier releases keep their meaning beside the new one.
    assert SlurmFeatures.of((25, 11)) == SlurmFeatures(True, True, True)
    assert SlurmFeatures.of((24, 11)) == SlurmFeatures(True, True)


@pytest.mark.parametrize(
    ("version", "printed"),
    [((22, 5, 8), "22.05.8"), ((24, 11), "24.11"), ((26,), "26"), (None, "?")],
)
def test_a_release_reads_as_slurm_prints_it(version: tuple[int, ...] | None, printed: str) -> None:
    assert str(SlurmRelease(version)) == printed


@pytest.mark.parametrize(
    ("text", "version"),
    [
        (CONFIG, (22, 5, 8)),
        ("SLURM_VERSION = 24.11.0-0rc1\n", (24, 11, 0)),
        ("SLURM_VERSION           = 25.11\n", (25, 11)),
        ("SLURM_VERSION = unknown\n", None),
        ("SlurmctldParameters = (null)\n", None),
    ],
)
def test_scontrol_show_config_names_slurmctlds_release(
    text: str, version: tuple[int, ...] | None
) -> None:
    assert parse_config_version(text) == version


def test_squeue_and_scontrol_versions_read_alike() -> None:
    assert parse_version("slurm 24.11.0-0rc1") == parse_config_version(
        "SLURM_VERSION = 24.11.0-0rc1"
    )


def _squeue(tmp_path: Path, printed: str) -> str:
    """An squeue that prints `printed` for --version and records its calls."""
    path = tmp_path / "squeue"
    path.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{tmp_path}/squeue.calls"\n'
        f'[ "$1" = --version ] && echo "{printed}"\nexit 0\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_client_reads_its_release_once_and_says_when_it_is_not_tested(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = SlurmClient(squeue=_squeue(tmp_path, "slurm 25.11.1"))
    with caplog.at_level(logging.INFO, logger="bridge.slurm"):
        release = client.release()
        assert client.features() == release.features
    assert release == SlurmRelease((25, 11, 1))
    assert release.features.sacct_exit_code_raw and release.features.only_job_state
    assert (tmp_path / "squeue.calls").read_text().splitlines() == ["--version"]
    # One warning, naming the tested releases: a warning, never a refusal.
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "Slurm 25.11.1 is not a tested release (tested: 22.05, 24.11, 26.05): expected to work"
    )


def test_a_tested_release_is_logged_as_such(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = SlurmClient(squeue=_squeue(tmp_path, "slurm 24.11.3"))
    with caplog.at_level(logging.INFO, logger="bridge.slurm"):
        assert client.release().tested
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith("Slurm 24.11.3, a tested release: ")


def test_an_unreadable_version_reads_as_an_unknown_release_with_2205s_features(
    tmp_path: Path,
) -> None:
    client = SlurmClient(squeue=_squeue(tmp_path, "nothing here"))
    assert client.release() == SlurmRelease(None)
    assert client.features() == SlurmFeatures()
    assert (tmp_path / "squeue.calls").read_text().splitlines() == ["--version"]


def test_a_failed_version_read_is_tried_again(tmp_path: Path) -> None:
    client = SlurmClient(squeue=str(tmp_path / "absent"))
    assert client.release() == SlurmRelease(None)
    squeue = _squeue(tmp_path, "slurm 23.11.5")
    client.squeue = squeue
    assert client.release() == SlurmRelease((23, 11, 5))


# --- what later releases print ---------------------------------------------------------------

#: `sacct -P -n --jobs=21 --format=SACCT_FIELDS` of a job whose node failed (Slurm 26.05.5,
#: tests/data/slurm/26.05/sacct-node-fail.txt; 24.11 prints the same ExitCode).
SACCT_NODE_FAIL_2605 = (
    "21|tes-node-fail|NODE_FAIL|1:0|None|node2|main|2026-11-28T22:27:49|2026-11-28T22:28:16|27||\n"
    "21.batch|batch|CANCELLED|||node2||2026-11-28T22:27:49|2026-11-28T22:28:16|27||\n"
)


@pytest.mark.parametrize("exit_code", ["1:0", "0:0"])  # 24.11 and later, 22.05
def test_a_node_fail_job_has_no_exit_code_of_its_own(exit_code: str) -> None:
    """sacct's ExitCode of a NODE_FAIL job is Slurm's mark (1:0 from 24.11), not the script's:
    the job is read without one, so nothing says "ended in state NODE_FAIL (exit code 1)"."""
    text = SACCT_NODE_FAIL_2605.replace("|1:0|", f"|{exit_code}|", 1)
    (job,) = parse_sacct(text).values()
    assert (job.state, job.node, job.elapsed_seconds) == ("NODE_FAIL", "node2", 27)
    assert job.exit_code is None and job.signal is None
    # The other ended states keep theirs.
    (failed,) = parse_sacct(text.replace("NODE_FAIL", "FAILED")).values()
    assert (failed.exit_code, failed.signal) == tuple(int(x) for x in exit_code.split(":"))


@pytest.mark.parametrize(
    ("stderr", "outage", "reason"),
    [
        # 26.05.2+: slurmctld's MaxJobCount, while sbatch retries and once it gives up.
        ("sbatch: error: Slurm job queue full, sleeping and retrying\n"
         "sbatch: error: Batch job submission failed: MaxJobCount limit reached\n",
         Outage.LIMIT, "Batch job submission failed: MaxJobCount limit reached"),
        # 22.05-26.05.1: the same limit in the older words.
        ("sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying\n"
         "sbatch: error: Batch job submission failed: Resource temporarily unavailable\n",
         Outage.LIMIT, "Batch job submission failed: Resource temporarily unavailable"),
        # 24.05+: slurmctld's queue for the RPC is full; turned away before it was processed.
        ("sbatch: error: Batch job submission failed: Rate limit exceeded, please retry later\n",
         Outage.UNREACHABLE, "Batch job submission failed: Rate limit exceeded, please retry "
         "later"),
    ],
)  # fmt: skip
def test_later_releases_words_for_a_busy_slurmctld(
    stderr: str, outage: Outage, reason: str
) -> None:
    proc = subprocess.CompletedProcess(["sbatch", "job.sh"], 1, "", stderr)
    err = command_error(proc, "submitting job.sh")
    assert isinstance(err, SlurmUnavailable) and err.outage is outage
    assert not err.may_have_acted  # each refused the job: none was created
    assert err.reason == reason
    # Through a time-out (the command killed while it waited), a limit may have let it through.
    timed_out = SlurmUnavailable("x", outage=outage, stderr=stderr)
    assert timed_out.may_have_acted is (outage is Outage.LIMIT)


def test_a_fatal_refusal_of_sbatch_reads_without_its_prefix() -> None:
    """26.05 refuses --gres=gpu with --gpus-per-node itself, as a fatal error (exit 1, no job;
    tests/data/slurm/26.05/sbatch-gres-and-gpus-per-node.txt.stderr)."""
    stderr = "sbatch: fatal: --gpus-per-node and --gres=gpu are mutually exclusive.\n"
    proc = subprocess.CompletedProcess(["sbatch", "job.sh"], 1, "", stderr)
    err = command_error(proc, "submitting job.sh")
    assert isinstance(err, SlurmRejected) and not err.may_have_acted
    assert err.reason == "--gpus-per-node and --gres=gpu are mutually exclusive."


def test_a_time_out_under_the_rate_limit_may_have_acted() -> None:
    assert SlurmUnavailable("x", outage=Outage.RATE_LIMITED).may_have_acted
    assert not SlurmUnavailable("x", outage=Outage.UNREACHABLE).may_have_acted


def test_no_exit_status_above_128_is_the_bridges_own() -> None:
    """Why sacct_exit_code_raw needs no translation: the job script's own exit codes are below
    128, where sacct prints the same in every release."""
    assert max(NO_RECORDS_EXIT_CODE, SUPERSEDED_EXIT_CODE) < 128


# --- the poller says the release at start ----------------------------------------------------


@pytest.mark.parametrize("printed", ["slurm 25.05.1", None])
def test_the_poller_reads_the_release_at_start_and_starts_whatever_it_is(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    printed: str | None,
) -> None:
    """Read once as the poller starts (a warning naming the tested releases for one that is
    not tested); an squeue that cannot be run does not stop the start (read again later)."""
    from bridge.config import load_config
    from bridge.poller import loop

    squeue = _squeue(tmp_path, printed) if printed else str(tmp_path / "absent")
    absent = str(tmp_path / "absent")
    client = SlurmClient(squeue=squeue, sbatch=absent, sacct=absent, scancel=absent, sinfo=absent)
    monkeypatch.setattr(loop, "slurm_client", lambda config: client)
    monkeypatch.setattr(loop.signal, "signal", lambda *args: None)  # keep pytest's handlers
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"container.allow_root": True, "container.runtime": absent},
    )
    with caplog.at_level(logging.INFO):
        assert loop.run_poller(config, once=True) == 0
    if printed is None:
        assert "cannot read squeue's version" in caplog.text
        return
    assert (tmp_path / "squeue.calls").read_text().splitlines()[0] == "--version"
    said = [r for r in caplog.records if "Slurm 25.05.1" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING]
    assert "(tested: 22.05, 24.11, 26.05)" in said[0].getMessage()
    assert caplog.text.index("poller started") < caplog.text.index("Slurm 25.05.1")
