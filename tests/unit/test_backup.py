"""The backups docs/operations.md tells a sysadmin to make, made while tasks change, and
restored as it says: the tasks of the backup's moment come back, the later ones do not."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.cli.database import init_store
from bridge.config import load_config
from bridge.store import MODELS, Store, TaskFilter

ROOT = Path(__file__).parents[2]
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
TASK = {"executors": [{"image": "alpine", "command": ["true"]}]}


def _ids(store: Store) -> set[str]:
    opened = store.db.connect(reuse_if_open=True)
    ids = {t.id for t in store.list_tasks(TaskFilter(), page_size=100)[0]}
    if opened:
        store.db.close()
    return ids


def _create(store: Store, count: int) -> None:
    """On the store's open connection (the service's), or on one of its own."""
    opened = store.db.connect(reuse_if_open=True)
    for _ in range(count):
        store.create_task(dict(TASK))
    if opened:
        store.db.close()


def test_the_sqlite_backup_of_the_docs_holds_what_the_wal_holds(tmp_path: Path) -> None:
    documented = re.search(r"bridge/bin/python -c '([^']+)' \\\n", OPERATIONS)
    assert documented, "docs/operations.md: the SQLite backup command"
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    init_store(config)
    database = tmp_path / "state" / "tes-bridge.db"
    service = Store.from_url(config.database_url)
    service.db.connect()  # the service keeps its connection: the new rows are in the -wal
    _create(service, 3)
    assert Path(f"{database}-wal").stat().st_size > 0
    backup = tmp_path / "backup.db"
    argv = [sys.executable, "-c", documented.group(1), str(database), str(backup)]
    subprocess.run(argv, check=True, timeout=60)
    saved = _ids(service)
    _create(service, 2)  # after the backup
    service.db.close()
    # The restore: the service stopped, the file put back, its -wal and -shm removed.
    shutil.copyfile(backup, database)
    for suffix in ("-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    init_store(config)
    restored = Store.from_url(config.database_url)
    assert _ids(restored) == saved and len(saved) == 3
    restored.db.close()


@pytest.mark.postgres
def test_the_postgresql_dump_of_the_docs_is_restored(postgres_url: str, tmp_path: Path) -> None:
    assert "pg_dump --format=custom" in OPERATIONS
    assert "pg_restore --clean --if-exists --dbname=tes" in OPERATIONS
    store = Store.from_url(postgres_url)
    with store.db.connection_context():
        store.db.drop_tables(MODELS, safe=True, cascade=True)
    store.init_schema("test")
    _create(store, 3)
    saved = _ids(store)
    dump = tmp_path / "tes.dump"
    subprocess.run(
        ["pg_dump", "--format=custom", f"--file={dump}", postgres_url], check=True, timeout=120
    )
    _create(store, 2)
    store.db.close()
    subprocess.run(
        ["pg_restore", "--clean", "--if-exists", f"--dbname={postgres_url}", str(dump)],
        check=True,
        timeout=120,
    )
    store.init_schema("test")
    assert _ids(store) == saved and len(saved) == 3
    store.db.close()
