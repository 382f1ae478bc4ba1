"""A database made by an earlier release is upgraded by this one's `init-db` (or the service's
start): its tasks, tags and page tokens survive, and its schema becomes the one a new database
gets. Each earlier schema is a dump checked in under tests/data/schema/ (made by its release
with tests/data/schema/dump.py), for SQLite and PostgreSQL."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from bridge.store import MIGRATIONS, MODELS, SCHEMA_VERSION, Store, TaskFilter

SCHEMAS = Path(__file__).parents[1] / "data" / "schema"
DUMPS = sorted(SCHEMAS.glob("*.sql"))
#: What tests/data/schema/dump.py stores: task names by state.
STORED = {"COMPLETE": "align sample-1", "QUEUED": "align sample-2", "CANCELED": None}


def _version(dump: Path) -> int:
    return int(dump.name.split(".")[0])


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tes-bridge.db'}"
    url: str = request.getfixturevalue("postgres_url")
    reset(url)
    return url


def reset(url: str) -> None:
    """Empty the database again."""
    if url.startswith("sqlite"):
        for suffix in ("", "-wal", "-shm"):
            Path(url[len("sqlite:///") :] + suffix).unlink(missing_ok=True)
        return
    store = Store.from_url(url)
    with store.db.connection_context():
        store.db.drop_tables(MODELS, safe=True, cascade=True)
        store._sql("DROP TABLE IF EXISTS poller_lease")
        store._sql("DROP SEQUENCE IF EXISTS tasks_seq_seq")
    store.db.close()


def fresh_schema(url: str) -> set[tuple[Any, ...]]:
    """The schema of a new database made by this release, in the emptied `url`."""
    reset(url)
    store = Store.from_url(url)
    store.init_schema("test")
    with store.db.connection_context():
        made = schema(store)
    store.db.close()
    return made


def load(url: str, dump: Path) -> None:
    """A database as the dump's release left it."""
    text = dump.read_text()
    if url.startswith("sqlite"):
        connection = sqlite3.connect(url[len("sqlite:///") :])
        connection.executescript(text)
        connection.close()
        return
    # pg_dump's psql meta-commands (\restrict) are not SQL; the rest runs in a session of its
    # own (it empties search_path).
    sql = "\n".join(line for line in text.splitlines() if not line.startswith("\\"))
    with psycopg2.connect(url) as conn, conn.cursor() as cursor:
        cursor.execute(sql)
    conn.close()


def schema(store: Store) -> set[tuple[Any, ...]]:
    """The tables' columns and the indexes, as the database describes them."""
    if store.is_sqlite:
        rows = store._sql(
            'SELECT m.name, p.name, p.type, p."notnull", p.dflt_value, p.pk FROM sqlite_master m '
            "JOIN pragma_table_info(m.name) p WHERE m.type = 'table'"
        ).fetchall()
        indexes = store._sql(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
        ).fetchall()
    else:
        rows = store._sql(
            "SELECT table_name, column_name, data_type, is_nullable, column_default, "
            "character_maximum_length FROM information_schema.columns "
            "WHERE table_schema = 'public'"
        ).fetchall()
        indexes = store._sql(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
        ).fetchall()
    # SQLite keeps CREATE INDEX as it was written: compare it without its quotes and spaces.
    plain = {(name, re.sub(r'["\s]', "", sql)) for name, sql in indexes}
    return {("column", *row) for row in rows} | {("index", *index) for index in plain}


def test_every_earlier_schema_has_its_migration_and_this_one_a_dump() -> None:
    assert sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION))
    for kind in ("sqlite", "postgresql"):
        assert (SCHEMAS / f"{SCHEMA_VERSION}.{kind}.sql").exists(), (
            f"run tests/data/schema/dump.py: schema {SCHEMA_VERSION} has no {kind} dump"
        )


def test_this_schema_is_the_one_its_dump_has(empty: str) -> None:
    """A change of the tables raises SCHEMA_VERSION, with a migration and a new dump: a new
    database and the dump of this version must have the same schema."""
    made = fresh_schema(empty)
    reset(empty)
    load(empty, SCHEMAS / f"{SCHEMA_VERSION}.{_kind(empty)}.sql")
    dumped = Store.from_url(empty)
    with dumped.db.connection_context():
        assert schema(dumped) == made, "the tables changed: raise SCHEMA_VERSION (see store.py)"
    dumped.db.close()


def _kind(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgresql"


@pytest.mark.parametrize("version", sorted({_version(d) for d in DUMPS}))
def test_a_database_of_an_earlier_release_is_upgraded_with_its_tasks(
    empty: str, version: int
) -> None:
    load(empty, SCHEMAS / f"{version}.{_kind(empty)}.sql")
    store = Store.from_url(empty)
    with store.db.connection_context():
        before, _ = store.list_tasks(TaskFilter(), page_size=10)
        first_page, token = store.list_tasks(TaskFilter(), page_size=1)
        secret = store.meta("page_token_secret")
    store.init_schema("upgrade-test")
    with store.db.connection_context():
        assert store.meta("schema_version") == str(SCHEMA_VERSION)
        assert store.meta("version") == "upgrade-test"
        assert store.meta("page_token_secret") == secret
        after, _ = store.list_tasks(TaskFilter(), page_size=10)
        assert [(t.id, t.state, t.document, t.logs) for t in after] == [
            (t.id, t.state, t.document, t.logs) for t in before
        ]
        assert {t.state: t.document and t.document.get("name") for t in after} == STORED
        # A page token handed out before the upgrade still pages on.
        assert token is not None and first_page
        rest, _ = store.list_tasks(TaskFilter(), page_size=10, page_token=token)
        assert [t.id for t in first_page + rest] == [t.id for t in after]
        tagged, _ = store.list_tasks(TaskFilter(tags=[("run", "nf-1")]), page_size=10)
        assert len(tagged) == 2
        # And the store works on: a new task, a cancel.
        new = store.create_task({"executors": [{"image": "alpine", "command": ["true"]}]})
        assert store.cancel_task(new.id) is not None
        upgraded = schema(store)
    store.db.close()
    assert upgraded == fresh_schema(empty)


def test_a_database_of_a_later_release_is_refused(empty: str) -> None:
    load(empty, SCHEMAS / f"{SCHEMA_VERSION}.{_kind(empty)}.sql")
    store = Store.from_url(empty)
    with store.db.connection_context():
        store.put_meta("schema_version", str(SCHEMA_VERSION + 1))
    with pytest.raises(RuntimeError, match=r"newer than this tes-bridge .*; upgrade tes-bridge"):
        store.init_schema("test")
    store.db.close()


def test_the_steps_run_in_order_before_the_new_schema_is_made(
    empty: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the next schema's release does: its step runs on a database of the one before,
    before an index on the column it adds is made, and once however many processes start."""
    import bridge.store as store_module

    steps: list[int] = []

    def add_priority(store: Store) -> None:
        steps.append(1)
        store._sql("ALTER TABLE tasks ADD COLUMN priority INTEGER NOT NULL DEFAULT 0")

    monkeypatch.setattr(store_module, "SCHEMA_VERSION", 2)
    monkeypatch.setitem(store_module.MIGRATIONS, 1, add_priority)
    create = Store._create_schema

    def create_with_index(store: Store) -> None:
        create(store)
        store._sql("CREATE INDEX IF NOT EXISTS tasks_priority ON tasks (priority)")

    monkeypatch.setattr(Store, "_create_schema", create_with_index)
    load(empty, SCHEMAS / f"1.{_kind(empty)}.sql")
    store = Store.from_url(empty)
    store.init_schema("next")
    store.init_schema("next")  # a second process, or a restart
    assert steps == [1]
    with store.db.connection_context():
        assert store.meta("schema_version") == "2"
        assert store._sql("SELECT COUNT(*) FROM tasks WHERE priority = 0").fetchone()[0] == 3
    store.db.close()
