"""`tes-bridge check` leaves the service's state as it found it, and says whether a poller runs.

Run as root (as the tests are) it once made a root-owned `tes-bridge.db` and a lock file in the
state directory, and printed a JSON log line among its own: the file tree of the state
directory is compared before and after each run here, and stdout must hold only its lines.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.cli.check import Account, Failed, StoreChecks, flock_holder
from bridge.cli.database import init_store
from bridge.config import Config, load_config
from bridge.store import POLLER_LOCK, Store

ROOT = Path(__file__).parents[2]
#: A check's line, or the fix under a failed one: nothing else belongs on stdout.
LINE = re.compile(r"^(ok  |FAIL)  [a-z ]+: |^      fix: ")
ME = Account.of(os.geteuid())


def tree(root: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every path under `root`: mode, owner, size and a file's modification time (a
    directory's changes with the probe that writes and removes a file in the work
    directory; what it holds is compared by the paths)."""
    found = {}
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        mtime = 0 if path.is_dir() else info.st_mtime_ns
        found[str(path.relative_to(root))] = (info.st_mode, info.st_uid, info.st_size, mtime)
    return found


def check(*args: str, cwd: Path, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TES_BRIDGE_")}
    env.update(HOME=str(cwd), PYTHONPATH=str(ROOT))
    given = ["--config", str(config)] if config else []
    argv = [sys.executable, "-m", "bridge", *given, "check", *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def config_file(root: Path, extra: str = "") -> Path:
    (root / "state" / "work").mkdir(parents=True)
    path = root / "tes-bridge.toml"
    path.write_text(
        f'state_dir = "{root / "state"}"\n[container]\ndefault_registry = "127.0.0.1:1"\n'
        f'runtime = "no-such-runtime"\n'
        # Whatever Slurm there is (or not), its checks fail at once.
        '[slurm]\nsinfo = "/bin/false"\nsacct = "/bin/false"\nscontrol = "/bin/false"\n'
        f"{extra}"
    )
    return path


def config(root: Path) -> Config:
    return load_config(config_file(root))


@pytest.mark.skipif(Path("/etc/tes-bridge/tes-bridge.toml").exists(), reason="a site's file")
def test_without_configuration_check_says_so_stops_and_creates_nothing(tmp_path: Path) -> None:
    before = tree(tmp_path)
    result = check(cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.startswith(
        "FAIL  config: no configuration found: no --config, $TES_BRIDGE_CONFIG unset and no "
        "/etc/tes-bridge/tes-bridge.toml; nothing else was checked\n      fix: "
    )
    assert len(result.stdout.splitlines()) == 2
    assert tree(tmp_path) == before
    as_json = json.loads(check("--json", cwd=tmp_path).stdout)
    assert [(r["name"], r["ok"]) for r in as_json] == [("config", False)]


def test_a_missing_database_is_said_and_not_made(tmp_path: Path) -> None:
    path = config_file(tmp_path)
    before = tree(tmp_path)
    result = check(cwd=tmp_path, config=path)
    assert result.returncode == 1
    assert tree(tmp_path) == before, "check changed the state directory"
    assert f"FAIL  database: sqlite:///{tmp_path}/state/tes-bridge.db: the database file " in (
        result.stdout
    )
    assert f"run `tes-bridge init-db` as {ME.name}" in result.stdout
    # Its own lines only (no JSON log line among them), and no log on stderr either.
    assert all(LINE.match(line) for line in result.stdout.splitlines()), result.stdout
    assert result.stderr == ""


def test_an_existing_database_is_read_without_a_file_made_or_changed(tmp_path: Path) -> None:
    path = config_file(tmp_path)
    init_store(load_config(path))
    (tmp_path / "state" / "tes-bridge.db").chmod(0o600)
    before = tree(tmp_path)
    result = check(cwd=tmp_path, config=path)
    assert tree(tmp_path) == before, "check changed the state directory"
    assert f"ok    database: sqlite:///{tmp_path}/state/tes-bridge.db reachable, writable by " in (
        result.stdout
    )
    assert "; schema version 1\n" in result.stdout
    # Without a poller: said, with how to start one.
    assert f"FAIL  poller: no poller runs for {tmp_path / 'state'}" in result.stdout
    assert "systemctl start tes-bridge-poller" in result.stdout


def test_the_database_read_while_the_service_has_it_open(tmp_path: Path) -> None:
    """With the service's connection open (-wal and -shm present) the database is read
    through them, and the check still changes nothing."""
    cfg = config(tmp_path)
    init_store(cfg)
    store = Store.from_url(cfg.database_url)
    with store.db.connection_context():
        store.put_meta("probe", "1")
        assert (tmp_path / "state" / "tes-bridge.db-wal").exists()
        before = tree(tmp_path / "state")
        said = StoreChecks(cfg, ME).database()
        assert tree(tmp_path / "state") == before
    assert "reachable" in said


def test_a_database_the_service_account_cannot_write_fails(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    init_store(cfg)
    other = Account("nobody", 65534, frozenset())
    with pytest.raises(Failed, match="nobody cannot write") as info:
        StoreChecks(cfg, other).database()
    assert info.value.fix.startswith("`chown nobody ")


@pytest.fixture
def lock_holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process that holds the poller's lock file, as a running poller does."""
    lock = tmp_path / "state" / POLLER_LOCK
    code = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    yield process
    process.kill()
    process.wait()


def beat(metrics_dir: Path, at: float) -> None:
    """A poller's heartbeat at `at`, written as a poller writes it (multiprocess files)."""
    metrics_dir.mkdir(exist_ok=True)
    code = f"from bridge.system import metrics; metrics.POLLER_LAST_CYCLE.set({at})"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_the_lock_holder_is_read_from_proc_locks(
    tmp_path: Path, lock_holder: subprocess.Popen[str]
) -> None:
    lock = tmp_path / "state" / POLLER_LOCK
    assert flock_holder(lock) == lock_holder.pid
    lock_holder.kill()
    lock_holder.wait()
    assert flock_holder(lock) is None
    assert flock_holder(tmp_path / "missing") is None
    # A lock this process takes on another file is not taken for the poller's.
    with open(tmp_path / "other", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        assert flock_holder(lock) is None
        assert flock_holder(tmp_path / "other") == os.getpid()


def test_a_running_poller_is_seen_with_its_heartbeat(
    tmp_path: Path, lock_holder: subprocess.Popen[str]
) -> None:
    cfg = config(tmp_path)
    init_store(cfg)
    checks = StoreChecks(cfg, ME)
    # Holding the lock, but no cycle recorded: stuck before its first cycle, or still starting.
    with pytest.raises(Failed, match="the poller runs but has not ended a cycle"):
        checks.poller()
    beat(tmp_path / "state" / "metrics", time.time() - 2)
    said = checks.poller()
    assert said.startswith(f"pid {lock_holder.pid} holds {tmp_path / 'state' / POLLER_LOCK}")
    assert re.search(r"its last cycle ended [0-9.]+ s ago$", said), said
    # A heartbeat older than ten cycles and two Slurm time-outs (70 s by default): stuck.
    beat(tmp_path / "state" / "metrics", time.time() - 3600)  # the newest file still wins
    assert "its last cycle ended" in checks.poller()
    for file in (tmp_path / "state" / "metrics").iterdir():
        file.unlink()
    beat(tmp_path / "state" / "metrics", time.time() - 600)
    with pytest.raises(Failed, match=r"the poller runs but last ended a cycle 60[0-9] s ago"):
        checks.poller()
    # Gone: said with its last cycle.
    lock_holder.kill()
    lock_holder.wait()
    with pytest.raises(Failed, match=r"no poller runs for .*; the last cycle of one ended 60"):
        checks.poller()
