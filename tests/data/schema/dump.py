"""Write the dumps of this release's schema: `<schema version>.sqlite.sql` and
`<schema version>.postgresql.sql`, a database made by `init-db` holding a few tasks.

Run it with the release that changes the schema, before the next one changes it again, and
check the two files in: tests/unit/test_schema_upgrade.py upgrades each dump with the code of
every later release. PostgreSQL's is made on the server of `TES_BRIDGE_TEST_POSTGRES_URL`
(an empty database; its tables are dropped first), dumped with pg_dump:

    TES_BRIDGE_TEST_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/postgres \\
        python -m tests.data.schema.dump
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bridge import __version__
from bridge.store import MODELS, SCHEMA_VERSION, Store, TaskFilter

HERE = Path(__file__).parent

#: What the dumps hold: a finished task with logs and tags, a queued one, a canceled one.
TASKS: list[dict[str, Any]] = [
    {
        "name": "align sample-1",
        "tags": {"run": "nf-1", "sample": "1"},
        "executors": [{"image": "alpine", "command": ["echo", "one"]}],
    },
    {
        "name": "align sample-2",
        "tags": {"run": "nf-1", "sample": "2"},
        "executors": [{"image": "alpine", "command": ["echo", "two"]}],
    },
    {"executors": [{"image": "alpine", "command": ["sleep", "60"]}]},
]


def fill(store: Store) -> None:
    store.init_schema(__version__)
    with store.db.connection_context():
        done, _, canceled = (store.create_task(task, owner="alice") for task in TASKS)
        logs = [{"logs": [{"stdout": "one\n", "exit_code": 0}], "system_logs": ["job 7"]}]
        store.update_task(done.id, state="COMPLETE", logs=logs, job_id="7", attempt=1)
        store.cancel_task(canceled.id)
        assert len(store.list_tasks(TaskFilter(), page_size=10)[0]) == len(TASKS)


def sqlite_dump(path: Path) -> str:
    connection = sqlite3.connect(path)
    try:
        return "\n".join(connection.iterdump()) + "\n"
    finally:
        connection.close()


def postgresql_dump(url: str) -> str:
    store = Store.from_url(url)
    with store.db.connection_context():
        store.db.drop_tables(MODELS, safe=True, cascade=True)
        store._sql("DROP TABLE IF EXISTS poller_lease")
    fill(store)
    store.db.close()
    argv = ["pg_dump", "--inserts", "--no-owner", "--no-privileges", "--dbname", url]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "tes-bridge.db"
        store = Store.from_url(f"sqlite:///{path}")
        fill(store)
        store.db.close()
        (HERE / f"{SCHEMA_VERSION}.sqlite.sql").write_text(sqlite_dump(path))
    url = os.environ["TES_BRIDGE_TEST_POSTGRES_URL"]
    (HERE / f"{SCHEMA_VERSION}.postgresql.sql").write_text(postgresql_dump(url))


if __name__ == "__main__":
    main()
