"""`tes-bridge init-db`, and the schema every command that opens the store makes sure of."""

from __future__ import annotations

import argparse

from bridge import __version__
from bridge.config import Config


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    init_db = commands.add_parser(
        "init-db",
        help="create the database tables (serve and poller also do this on start)",
    )
    init_db.set_defaults(run=init_db_command)


def init_db_command(config: Config, args: argparse.Namespace) -> int:
    from bridge.job.staging import redact

    init_store(config)
    print(f"database ready: {redact(config.database_url)}")
    return 0


def init_store(config: Config) -> None:
    """Create the state directory and the database tables (or bring them up to date)."""
    from bridge.store import Store

    config.state_dir.mkdir(parents=True, exist_ok=True)
    store = Store.from_url(config.database_url)
    store.init_schema(__version__)
    store.db.close()
