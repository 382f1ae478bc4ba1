"""`tes-bridge check`'s Slurm release and rate limit lines, against stand-in sinfo and scontrol:
tests/fakes/slurmbin on PATH (as the poller's budget test drives them), and small scripts that
print what a given release or configuration prints."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from bridge.cli.check import Account, Doctor, Failed, SiteChecks, SlurmChecks
from bridge.config import Config, load_config

FAKE = Path(__file__).parents[1] / "fakes" / "slurmbin"
#: An ordinary service account, which slurmctld's rate limit covers.
SERVICE = Account("tesbridge", 65534, frozenset())
#: `scontrol show config`'s lines that the check reads (as Slurm 24.11 and 26.05 print them).
TESTED = "tested: 22.05, 24.11, 26.05"
CONFIG = "SlurmUser               = {user}(64030)\nSlurmctldParameters     = {parameters}\n"


def config(tmp_path: Path, **slurm: Any) -> Config:
    return load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={f"slurm.{key}": value for key, value in slurm.items()},
    )


def printing(tmp_path: Path, name: str, text: str) -> str:
    """A command that prints `text`, whatever its arguments."""
    (tmp_path / f"{name}.txt").write_text(text)
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\ncat "{tmp_path / name}.txt"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def rate_limit(tmp_path: Path, parameters: str, *, account: Account = SERVICE, **slurm: Any) -> str:
    scontrol = printing(tmp_path, "scontrol", CONFIG.format(user="slurm", parameters=parameters))
    return SlurmChecks(config(tmp_path, scontrol=scontrol, **slurm), account).rate_limit()


def test_the_checks_on_the_stand_in_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By their names, after the `slurm` line; the stand-in is Slurm 22.05.8 without a rate
    limit (tests/fakes/slurmbin)."""
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    doctor = Doctor(config(tmp_path), image="alpine", account=SERVICE)
    checks = dict(doctor.checks())
    names = list(checks)
    assert names[names.index("slurm") + 1 : names.index("slurm") + 3] == [
        "slurm release",
        "slurm rate limit",
    ]
    assert (
        checks["slurm release"]() == "Slurm 22.05.8, a tested release (tested: 22.05, 24.11, 26.05)"
    )
    said = checks["slurm rate limit"]()
    assert said == "slurmctld limits no user's RPC rate (no rate limit in SlurmctldParameters)"
    assert "rl_enable" not in said
    monkeypatch.setenv("FAKE_SLURM_PARAMETERS", "rl_enable")
    assert "rl_enable" in checks["slurm rate limit"]()


def test_a_transfer_partition_slurm_lacks_fails_naming_the_setting(tmp_path: Path) -> None:
    sinfo = printing(tmp_path, "sinfo", "main* up\nxfer up\n")
    environ = {"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")}

    def check(partition: str) -> str:
        overrides = {"slurm.sinfo": sinfo, "staging.where": "transfer"}
        overrides["staging.transfer_partition"] = partition
        return SlurmChecks(load_config(environ=environ, overrides=overrides), SERVICE).slurm()

    assert check("xfer") == "slurmctld answers; partitions: main, xfer"
    with pytest.raises(Failed, match=r"staging\.transfer_partition 'dtn' is not a partition"):
        check("dtn")


@pytest.mark.parametrize(
    ("printed", "said"),
    [
        ("slurm-wlm 26.05.5\n", f"Slurm 26.05.5, a tested release ({TESTED})"),
        ("slurm 24.11.0-0rc1\n", f"Slurm 24.11.0-0rc1, a tested release ({TESTED})"),
        # Not tested: said, never a failure.
        ("slurm 25.05.1\n", f"Slurm 25.05.1 is not a tested release ({TESTED}): expected to "
         "work; report what does not"),
    ],
)  # fmt: skip
def test_the_release_is_said_with_its_full_version(tmp_path: Path, printed: str, said: str) -> None:
    sinfo = printing(tmp_path, "sinfo", printed)
    assert SlurmChecks(config(tmp_path, sinfo=sinfo), SERVICE).release() == said


def test_a_release_that_cannot_be_read_fails(tmp_path: Path) -> None:
    sinfo = printing(tmp_path, "sinfo", "no version here\n")
    with pytest.raises(Failed, match="sinfo -V printed no Slurm version"):
        SlurmChecks(config(tmp_path, sinfo=sinfo), SERVICE).release()


def test_a_budget_that_fits_under_the_rate_limit(tmp_path: Path) -> None:
    said = rate_limit(tmp_path, "enable_configless,rl_enable")
    assert said == (
        "slurmctld limits each user's RPCs (rl_enable): 30 calls at once, 2 more every 1 s "
        "(2 calls/s, bursts of 28 fit); tesbridge is neither root nor SlurmUser (slurm): "
        "slurm.calls_per_second = 2, calls_burst = 28 fit under it"
    )


def test_a_budget_above_the_rate_limit_is_lowered_at_start(tmp_path: Path) -> None:
    said = rate_limit(tmp_path, "rl_enable,rl_bucket_size=20,rl_refill_rate=1", calls_burst=40)
    assert "rl_enable): 20 calls at once, 1 more every 1 s (1 calls/s, bursts of 19 fit)" in said
    assert said.endswith(
        "slurm.calls_per_second = 2, calls_burst = 40 do not fit under it; the poller lowers "
        "its budget to 1 calls/s, bursts of 19, at start"
    )


def test_no_budget_under_a_rate_limit_fails(tmp_path: Path) -> None:
    with pytest.raises(Failed) as caught:
        rate_limit(tmp_path, "rl_enable,rl_refill_rate=4", calls_per_second=0)
    assert "rl_enable" in str(caught.value) and "slurm.calls_per_second = 0" in str(caught.value)
    assert caught.value.fix == (
        "set slurm.calls_per_second to at most 4 and slurm.calls_burst to at most 26"
    )


@pytest.mark.parametrize(
    ("account", "why"),
    [
        (Account("root", 0, frozenset()), "root: it is root"),
        (Account("slurm", 64030, frozenset()), "slurm: it is SlurmUser (slurm)"),
    ],
)
def test_root_and_slurmuser_are_exempt_whatever_their_budget(
    tmp_path: Path, account: Account, why: str
) -> None:
    said = rate_limit(tmp_path, "rl_enable", account=account, calls_per_second=0)
    assert "rl_enable" in said
    assert said.endswith(f"; not for {why}, so the call budget is not lowered to it")


def test_the_sudo_rule_must_name_the_sbatch_and_scancel_the_service_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Site mode: sudo compares programs, not names. A rule naming Debian's /usr/bin/sbatch
    where the service's PATH finds a newer release's first refuses every submission; a rule
    naming a link to the program the service runs allows it."""
    release, debian = tmp_path / "release", tmp_path / "debian"
    links = tmp_path / "local"
    for directory in (release, debian, links):
        directory.mkdir()
    for name in ("sbatch", "scancel"):
        printing(release, name, "")
        printing(debian, name, "")
        (links / name).symlink_to(release / name)
    monkeypatch.setenv("PATH", f"{links}{os.pathsep}{debian}{os.pathsep}/usr/bin:/bin")
    work = tmp_path / "state" / "work"

    def listing(sbatch: Path, scancel: Path) -> str:
        rule = (
            f"    (%tes-users, !root) NOPASSWD: {sbatch} --parsable *, {scancel} ^[0-9_+]{{1,32}}$,"
            f" /py ^-m bridge\\.job adopt --work-dir {work} --task-dir x,"
            f" /py ^-m bridge\\.job read-records --work-dir {work} --tail-bytes x\n"
        )
        return printing(tmp_path, "sudo", f"User tesbridge may run:\n{rule}")

    def check(sudo: str) -> str:
        settings = load_config(
            environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
            overrides={"site.sudo": sudo, "job.python": "/py", "job.work_dir": str(work)},
        )
        return SiteChecks(settings, SERVICE).sudo_rule()

    allowed = check(listing(release / "sbatch", links / "scancel"))
    assert allowed == "tesbridge may run sbatch, scancel and bridge.job as task owners"
    with pytest.raises(Failed) as failed:
        check(listing(debian / "sbatch", release / "scancel"))
    assert f"name another sbatch than {links / 'sbatch'}" in str(failed.value)
    assert f"write {links / 'sbatch'} in the rule" in failed.value.fix
