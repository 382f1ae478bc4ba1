"""`tes-bridge check` on the real cluster: every check passes with a good configuration, and
each broken setup fails its own check with a line that says what to fix."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.cli.check_job import FIX_SHARED
from bridge.system.metrics import read_heartbeat
from tests.cluster.test_site_mode import sudoers_for
from tests.fixtures.auth import UnixUsers, write_htpasswd

pytestmark = pytest.mark.cluster

CHECKS = [
    "config",
    "database",
    "admins",
    "poller",
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


def _check(
    config: Path, *args: str, job: bool = False
) -> tuple[int, dict[str, dict[str, Any]], str]:
    """The text and the JSON run; `job`: the JSON one with --job (one job, not two)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TES_BRIDGE_")}
    base = [sys.executable, "-m", "bridge", "--config", str(config), "check"]
    text = subprocess.run([*base, *args], capture_output=True, text=True, env=env, timeout=600)
    json_args = ["--json", *args, *(["--job"] if job else [])]
    result = subprocess.run(
        [*base, *json_args], capture_output=True, text=True, env=env, timeout=600
    )
    if not job:
        assert result.returncode == text.returncode, result.stderr
    by_name = {r["name"]: r for r in json.loads(result.stdout)}
    return result.returncode, by_name, text.stdout


def _failed(results: dict[str, dict[str, Any]]) -> list[str]:
    return [name for name, r in results.items() if not r["ok"]]


@contextlib.contextmanager
def _poller(config: Path) -> Iterator[None]:
    """`tes-bridge poller` on this configuration, until it has ended its first cycle."""
    state = config.parent / "state"
    argv = [sys.executable, "-m", "bridge", "--config", str(config), "poller"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TES_BRIDGE_")}
    log = state.parent / "poller.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while read_heartbeat(state / "metrics") is None:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)


def _init_db(config: Path) -> None:
    argv = [sys.executable, "-m", "bridge", "--config", str(config), "init-db"]
    subprocess.run(argv, check=True, capture_output=True)


def test_a_good_setup_passes_every_check(local_cluster: Any, tmp_path: Path) -> None:
    """A running poller, and (--job) a job on a compute node that shares the work directory."""
    work = local_cluster.shared_path("check")
    try:
        config = _config(local_cluster, tmp_path, f'[job]\nwork_dir = "{work}"')
        _init_db(config)
        with _poller(config):
            code, results, text = _check(config, job=True)
        assert list(work.iterdir()) == []  # the job's directory is removed
    finally:
        shutil.rmtree(work)
    assert code == 0, results
    assert list(results) == [*CHECKS, "compute node"]
    assert all(r["ok"] for r in results.values()), text
    # One line per check, each saying ok.
    assert [line.split()[0] for line in text.splitlines()] == ["ok"] * len(CHECKS)
    assert "ran alpine" in results["apptainer"]["message"]
    assert local_cluster.partition in results["slurm"]["message"]
    assert re.fullmatch(
        r"pid \d+ holds \S+/poller.lock \(SQLite: one node only\); its last cycle ended "
        r"[0-9.]+ s ago",
        results["poller"]["message"],
    ), results["poller"]
    node = results["compute node"]["message"]
    assert re.fullmatch(
        rf"job \d+ ran job\.python \({re.escape(sys.executable)}, Python 3[0-9.]+, "
        rf"tes-bridge \S+\) on \S+, which shares {work} with this host \([0-9.]+ s\)",
        node,
    ), node


def test_a_work_dir_the_compute_nodes_do_not_see_fails_the_job(
    local_cluster: Any, tmp_path: Path
) -> None:
    """The work directory in the login node's own /tmp, which the cluster's nodes do not see
    (each has its own): every other check of it passes, the job's fails."""
    config = _config(local_cluster, tmp_path)
    _init_db(config)
    try:
        code, results, _ = _check(config, job=True)
    finally:
        # slurmstepd made the job's --output directory in the node's own /tmp: gone, so that
        # test_multinode still finds nothing of the login node's /tmp there.
        for node in local_cluster.nodes if tmp_path.parts[1] == "tmp" else ():
            made = local_cluster.state_dir / "nodes" / node / "tmp" / tmp_path.parts[2]
            shutil.rmtree(made, ignore_errors=True)
    assert code == 1
    assert _failed(results) == ["poller", "compute node"], results
    node = results["compute node"]
    assert re.match(
        r"job \d+ on .+ ended \w+(, exit code \d+)?, and nothing it wrote in ", node["message"]
    ), node
    assert "is not the same filesystem on the compute node as on this host" in node["message"]
    assert node["fix"] == FIX_SHARED
    assert list((tmp_path / "state" / "work").iterdir()) == []


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
    # No poller runs here; the release is read with sinfo, and fails with it.
    also = {"slurm": ["slurm release"]}.get(failing, [])
    assert _failed(results) == [n for n in CHECKS if n in {failing, "poller", *also}], text
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
        assert _failed(results) == ["poller"], text  # none runs here
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
