"""`tes-bridge check` on the real cluster: every check passes with a good configuration, and
each broken setup fails its own check with a line that says what to fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_site_mode import sudoers_for
from tests.fixtures.auth import UnixUsers, write_htpasswd

pytestmark = pytest.mark.cluster

CHECKS = [
    "config",
    "database",
    "admins",
    "poller lease",
    "work dir",
    "image cache",
    "metrics dir",
    "file dirs",
    "slurm",
    "slurm release",
    "slurm rate limit",
    "sacct",
    "apptainer",
]


def _config(local_cluster: Any, root: Path, extra: str = "", container: str = "") -> Path:
    (root / "state" / "work").mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    path = root / "tes-bridge.toml"
    path.write_text(
        f"""
state_dir = "{root / "state"}"
[container]
runtime = "{container or local_cluster.apptainer}"
default_registry = "{local_cluster.registry}"
insecure_registries = ["{local_cluster.registry}"]
extra_flags = {json.dumps(list(local_cluster.apptainer_flags))}
allow_root = true
[storage]
allowed_dirs = ["{root / "data"}"]
{extra}
"""
    )
    return path


def _check(config: Path, *args: str) -> tuple[int, dict[str, dict[str, Any]], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TES_BRIDGE_")}
    base = [sys.executable, "-m", "bridge", "--config", str(config), "check"]
    text = subprocess.run([*base, *args], capture_output=True, text=True, env=env, timeout=600)
    result = subprocess.run(
        [*base, "--json", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == text.returncode, result.stderr
    by_name = {r["name"]: r for r in json.loads(result.stdout)}
    return result.returncode, by_name, text.stdout


def _init_db(config: Path) -> None:
    argv = [sys.executable, "-m", "bridge", "--config", str(config), "init-db"]
    subprocess.run(argv, check=True, capture_output=True)


def test_a_good_setup_passes_every_check(local_cluster: Any, tmp_path: Path) -> None:
    config = _config(local_cluster, tmp_path)
    _init_db(config)
    code, results, text = _check(config)
    assert code == 0, text
    assert list(results) == CHECKS
    assert all(r["ok"] for r in results.values()), text
    # One line per check, each saying ok.
    assert [line.split()[0] for line in text.splitlines()] == ["ok"] * len(CHECKS)
    assert "ran alpine" in results["apptainer"]["message"]
    assert local_cluster.partition in results["slurm"]["message"]
    assert "SQLite: one node only" in results["poller lease"]["message"]


BROKEN = {
    # sinfo also reads the release ("slurm release" fails with it).
    "sinfo missing": ('[slurm]\nsinfo = "/nonexistent/sinfo"', (), "slurm", "[slurm] sinfo"),
    "no accounting": ('[slurm]\nsacct = "/bin/false"', (), "sacct", "AccountingStorageType"),
    "no runtime": ("", (), "apptainer", "container.runtime"),
    "image missing": ("", ("--image", "no-such-image-for-check:1"), "apptainer", "--image"),
    "database down": (
        'database = "postgresql://tes@127.0.0.1:1/tes"',
        (),
        "database",
        "`database`",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_setup_fails_its_check_and_names_the_fix(
    local_cluster: Any, tmp_path: Path, case: str
) -> None:
    extra, args, failing, fix = BROKEN[case]
    if extra.startswith("database"):
        # A top-level key: before the first section.
        config = _config(local_cluster, tmp_path)
        config.write_text(extra + "\n" + config.read_text())
    else:
        runtime = "no-such-apptainer" if case == "no runtime" else ""
        config = _config(local_cluster, tmp_path, extra, container=runtime)
    _init_db(config) if case != "database down" else None
    code, results, text = _check(config, *args)
    assert code == 1
    failed = [name for name, r in results.items() if not r["ok"]]
    # The lease is read from the database, and the release with sinfo: each fails with it.
    also = {"database": ["poller lease"], "slurm": ["slurm release"]}.get(failing, [])
    assert failed == [failing, *also], text
    assert fix in results[failing]["fix"], results[failing]
    assert f"FAIL  {failing}: " in text and f"fix: {results[failing]['fix']}" in text


def test_missing_directories_and_tables_name_the_fix(local_cluster: Any, tmp_path: Path) -> None:
    config = _config(local_cluster, tmp_path)
    shutil.rmtree(tmp_path / "state" / "work")
    shutil.rmtree(tmp_path / "data")
    code, results, _ = _check(config)
    assert code == 1
    assert "init-db" in results["database"]["fix"]
    assert "install -d" in results["work dir"]["fix"]
    assert "storage.allowed_dirs" in results["file dirs"]["fix"]
    assert str(tmp_path / "data") in results["file dirs"]["message"]


def test_an_unreadable_config_fails_the_config_check(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nno_such_key = 1\n")
    code, results, _ = _check(config)
    assert code == 1
    assert list(results) == ["config"]
    assert "no_such_key" in results["config"]["message"]


def _site_config(local_cluster: Any, root: Path, service: str) -> Path:
    htpasswd = write_htpasswd(root / "htpasswd")
    extra = f'[auth]\nmode = "basic"\nhtpasswd_file = "{htpasswd}"\n[site]\nrun_as_owner = true'
    config = _config(local_cluster, root, extra)
    _init_db(config)
    for path in (root / "state", root / "state" / "work", root / "state" / "tes-bridge.db"):
        shutil.chown(path, service)
    (root / "state" / "work").chmod(0o1733)
    return config


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A directory the service account can reach (pytest's own tmp_path is private to root)."""
    root = Path(tempfile.mkdtemp(prefix="tes-check-", dir="/var/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_site_mode_checks_the_service_accounts_permissions_and_sudo_rule(
    local_cluster: Any, open_root: Path, unix_users: UnixUsers
) -> None:
    tmp_path = open_root
    service = unix_users.service
    config = _site_config(local_cluster, tmp_path, service)
    rule = Path("/etc/sudoers.d/tes-bridge-check-test")
    rule.write_text(sudoers_for(tmp_path / "state" / "work", sys.executable))
    rule.chmod(0o440)
    try:
        code, results, text = _check(config)
        assert code == 0, text
        assert results["sudo rule"]["ok"] and service in results["sudo rule"]["message"]
        assert service in results["work dir"]["message"]
    finally:
        rule.unlink()

    # A rule for another work directory (or none): the check says which file to install.
    rule.write_text(sudoers_for(tmp_path / "elsewhere", sys.executable))
    rule.chmod(0o440)
    try:
        code, results, text = _check(config)
    finally:
        rule.unlink()
    assert code == 1
    assert "job.work_dir" in results["sudo rule"]["message"], text
    assert "deploy/sudoers.tes-bridge" in results["sudo rule"]["fix"], text

    # A private parent, a work directory the service account cannot write, a wrong mode.
    tmp_path.chmod(0o700)
    code, results, text = _check(config)
    assert f"chmod o+x {tmp_path}" in results["work dir"]["fix"], text
    tmp_path.chmod(0o755)
    work = tmp_path / "state" / "work"
    shutil.chown(work, "root")
    work.chmod(0o755)
    code, results, text = _check(config)
    assert not results["work dir"]["ok"]
    assert f"chown {service}" in results["work dir"]["fix"], text
    shutil.chown(work, service)
    code, results, text = _check(config)
    assert "chmod 1733" in results["work dir"]["fix"], text
