"""What differs by Slurm release (bridge.slurm.releases), and where the client reads it."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from bridge.slurm import (
    TESTED_RELEASES,
    SlurmClient,
    SlurmFeatures,
    SlurmRelease,
    is_tested,
    parse_config_version,
    parse_version,
)

#: `scontrol show config` as tests/fakes/slurmbin/scontrol prints it.
CONFIG = """Configuration data as of 2026-11-25T20:00:00
SlurmctldParameters     = (null)
SLURM_VERSION           = 22.05.8
"""


def test_the_tested_releases() -> None:
    assert TESTED_RELEASES == ((22, 5), (24, 11), (26, 5))


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
    assert "Slurm 25.11.1 (not a release this bridge is tested with)" in caplog.text


def test_a_tested_release_is_logged_as_such(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = SlurmClient(squeue=_squeue(tmp_path, "slurm 24.11.3"))
    with caplog.at_level(logging.INFO, logger="bridge.slurm"):
        assert client.release().tested
    assert "Slurm 24.11.3:" in caplog.text and "not a release" not in caplog.text


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
