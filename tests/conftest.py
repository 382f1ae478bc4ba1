"""Shared fixtures: stores on SQLite and PostgreSQL, the API through Falcon's test client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from falcon import testing

from bridge.api.app import create_app
from bridge.config import Config, load_config
from bridge.store import MODELS, Store

pytest_plugins = [
    "tests.fixtures.diagnostics",  # first: the others import it
    "tests.fixtures.postgres",
    "tests.fixtures.cluster",
    "tests.fixtures.service",
    "tests.fixtures.auth",
    "tests.fixtures.storage",
    "tests.fixtures.drs",
    "tests.fixtures.quickstart",
    "tests.fixtures.engines",
]


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})


def _fresh_store(url: str) -> Store:
    store = Store.from_url(url)
    store.db.connect(reuse_if_open=True)
    store.db.drop_tables(MODELS, safe=True, cascade=not url.startswith("sqlite"))
    if not url.startswith("sqlite"):
        store.db.execute_sql("DROP TABLE IF EXISTS poller_lease")
    store.init_schema("test")
    return store


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """The same tests run on the embedded SQLite store and on a real PostgreSQL server."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tes.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    store = _fresh_store(url)
    yield store
    store.db.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    store = _fresh_store(f"sqlite:///{tmp_path / 'tes.db'}")
    yield store
    store.db.close()


@pytest.fixture
def client(config: Config, store: Store) -> testing.TestClient:
    return testing.TestClient(create_app(config, store=store))
