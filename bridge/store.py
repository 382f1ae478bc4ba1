"""The task store: peewee models and every query the API and the poller make.

SQLite (the embedded default, in WAL mode with a busy timeout and transactions that take the
write lock up front, so several API workers and the poller share one file) or PostgreSQL,
chosen by a database URL. Tables are created on start and the schema version is recorded in
``bridge_meta`` so later versions can migrate.

Listing is keyset-paginated over ``seq``, an integer that grows with creation order: a page
token names the last ``seq`` seen and is signed with a per-store secret, so tasks created while
a client pages never shift its pages, and a token the server did not issue is refused. Tags
live in their own indexed table, so tag filters never scan task documents.

After its creation a task changes only through named transitions (``cancel_task`` for the
API; ``mark_submitting``, ``record_job``, ``apply_decision``, ... for the poller), each one
UPDATE conditional on the state it expects, so concurrent writers never undo each other.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import hashlib
import hmac
import json
import secrets
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import peewee
from playhouse.db_url import connect as connect_url

from bridge.core.naming import format_time_now
from bridge.core.tes import CONDITION_KINDS_KEY, TERMINAL_STATES, State

#: The version of the tables below. A release that changes them raises it, adds the step from
#: the one before to MIGRATIONS, and checks in a dump of its schema in tests/data/schema/
#: (tests/unit/test_schema_upgrade.py upgrades a database of every earlier schema).
SCHEMA_VERSION = 1

#: MIGRATIONS[n] brings a database of schema n to n + 1, inside init_schema's transaction,
#: before the tables and indexes of this schema are created (a new index may need a column a
#: step adds). Schema 1 is the first (release 0.1.0): nothing to migrate yet.
MIGRATIONS: dict[int, Callable[[Store], None]] = {}

#: The PostgreSQL advisory lock init_schema holds: one process upgrades at a time.
_SCHEMA_LOCK = 0x7E5B_0001

database_proxy = peewee.DatabaseProxy()


class _Model(peewee.Model):
    class Meta:
        database = database_proxy
        legacy_table_names = False


class TaskRow(_Model):
    seq = peewee.AutoField()
    id = peewee.CharField(max_length=64, unique=True)
    state = peewee.CharField(max_length=16)
    name = peewee.TextField(null=True, index=True)
    owner = peewee.CharField(max_length=255, null=True)
    creation_time = peewee.CharField(max_length=40)
    #: The stored TES document (see bridge.core.tes.validate_task), as JSON.
    document = peewee.TextField()
    #: The task's `logs` array (one entry per Slurm attempt), as JSON.
    logs = peewee.TextField(default="[]")
    # Execution bookkeeping, owned by the poller.
    job_id = peewee.CharField(max_length=64, null=True, index=True)
    attempt = peewee.IntegerField(default=0)
    #: Set just before sbatch runs; with no job_id it means "look for the job by name".
    submit_started_at = peewee.FloatField(null=True)
    #: Earliest time of the next submission try (back-off while Slurm is unreachable).
    next_submit_at = peewee.FloatField(null=True)
    #: Canceled by a client while a Slurm job may exist: the poller still has to scancel it.
    cancel_pending = peewee.BooleanField(default=False)
    #: The task directory was removed after the retention time.
    cleaned = peewee.BooleanField(default=False)
    updated_at = peewee.FloatField()

    class Meta:
        table_name = "tasks"
        indexes = ((("state", "seq"), False), (("owner", "seq"), False))


class TagRow(_Model):
    task_seq = peewee.ForeignKeyField(
        TaskRow, field=TaskRow.seq, column_name="task_seq", on_delete="CASCADE"
    )
    key = peewee.TextField()
    value = peewee.TextField()

    class Meta:
        table_name = "task_tags"
        primary_key = peewee.CompositeKey("task_seq", "key")
        indexes = ((("key", "value", "task_seq"), False),)


class MetaRow(_Model):
    key = peewee.CharField(max_length=64, primary_key=True)
    value = peewee.TextField()

    class Meta:
        table_name = "bridge_meta"


MODELS = (TaskRow, TagRow, MetaRow)


#: The meta key of what the poller last read of the cluster for `GET /capabilities` (JSON:
#: read_at, partitions, runtime_version; see bridge.poller.capabilities).
CAPABILITIES_KEY = "capabilities"


class InvalidPageToken(ValueError):
    pass


@dataclass(frozen=True)
class LeaseState:
    """The poller's lease as the store has it, its times in the server's clock."""

    holder: str | None
    epoch: int
    #: Seconds since the holder last renewed it (None: never held).
    age: float | None
    #: Seconds until it ends (negative: ended that long ago).
    remaining: float | None


#: The one row of the poller's lease (PostgreSQL only; see bridge.poller.lease): who leads,
#: its epoch (raised by every takeover) and when the lease ends, in the server's clock.
LEASE_TABLE = "poller_lease"
LEASE_NAME = "poller"


#: SQLite: the file in the state directory whose lock the one poller holds.
POLLER_LOCK = "poller.lock"

#: Said when the service starts on SQLite, and by `tes-bridge check`.
SQLITE_ONE_NODE = (
    "SQLite: one node only (one poller, held by a lock file in the state directory); for "
    "several login nodes use PostgreSQL, where the nodes' pollers elect a leader"
)

_LEASE_DDL = f"""CREATE TABLE IF NOT EXISTS "{LEASE_TABLE}" (
    "name" TEXT PRIMARY KEY,
    "holder" TEXT,
    "epoch" BIGINT NOT NULL DEFAULT 0,
    "acquired_at" TIMESTAMPTZ,
    "renewed_at" TIMESTAMPTZ,
    "expires_at" TIMESTAMPTZ NOT NULL DEFAULT '-infinity'
)"""


class NotLeader(Exception):
    """This poller may not act: its lease is gone (the poller's own clock said so before an
    sbatch or scancel) or its epoch was refused by the store."""


class FencedOut(NotLeader):
    """A poller write carried an epoch that is not the lease's current one: another poller
    took over. The write's transaction was rolled back; nothing changed."""


@dataclass
class TaskRecord:
    """A task as stored; `document`/`logs` are None when only id and state were read."""

    seq: int
    id: str
    state: str
    creation_time: str | None = None
    document: dict[str, Any] | None = None
    logs: list[dict[str, Any]] | None = None
    owner: str | None = None
    job_id: str | None = None
    attempt: int = 0
    submit_started_at: float | None = None
    next_submit_at: float | None = None
    cancel_pending: bool = False
    #: cancel_task: this call moved the task to CANCELED (it was not final before).
    canceled_now: bool = False

    @property
    def created_at(self) -> float | None:
        """`creation_time` as Unix time (None: not read, or not a time)."""
        if not self.creation_time:
            return None
        try:
            return datetime.fromisoformat(self.creation_time).timestamp()
        except ValueError:
            return None


@dataclass
class TaskFilter:
    name_prefix: str | None = None
    state: str | None = None
    #: (key, value) pairs; value None matches any value of that key.
    tags: list[tuple[str, str | None]] = field(default_factory=list)
    owner: str | None = None


#: SQLite's words for a write on a connection it opened read-only.
_READ_ONLY = "attempt to write a readonly database"


class _SqliteDatabase(peewee.SqliteDatabase):
    """SQLite whose read-only connections are opened again.

    SQLite opens a file it cannot write at that moment (permissions, a read-only mount)
    read-only, and the connection stays so after the file is writable again; the API keeps a
    worker's connections open. Each such write error is counted, and a thread's connection
    opened before the last one is closed and opened again the next time it is asked for (the
    API's DatabaseSession, each request): reads go on meanwhile, writes answer 503
    (`unavailable_reason`), and the first write after the files are writable succeeds."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.read_only_errors = 0
        #: Per thread, as peewee's connections: the count when its connection was opened.
        self._opened_at = threading.local()

    def connect(self, reuse_if_open: bool = False) -> bool:
        stale = getattr(self._opened_at, "errors", 0) < self.read_only_errors
        if stale and not self.is_closed() and not self.in_transaction():
            self.close()
        errors = self.read_only_errors
        opened = super().connect(reuse_if_open)
        if opened:
            self._opened_at.errors = errors
        return opened

    def _set_pragmas(self, conn: sqlite3.Connection) -> None:
        super()._set_pragmas(conn)  # type: ignore[misc]
        if self.database == ":memory:":
            return
        if conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
            return
        # Two processes that switch a new database to WAL at once (the API and the poller
        # starting together) hold a shared lock each and want an exclusive one: SQLite
        # answers "database is locked" at once rather than deadlock, without waiting out
        # the busy timeout. One switch at a time, the second finds WAL already set.
        with contextlib.ExitStack() as held:
            with contextlib.suppress(OSError):  # a read-only directory: switch unlocked
                lock = held.enter_context(open(f"{self.database}.wal-switch.lock", "a"))
                fcntl.flock(lock, fcntl.LOCK_EX)
            conn.execute("PRAGMA journal_mode = wal")

    def execute_sql(self, sql: str, params: Any = None) -> Any:
        try:
            return super().execute_sql(sql, params)  # type: ignore[no-untyped-call]
        except peewee.OperationalError as exc:
            if _READ_ONLY in str(exc):
                self.read_only_errors += 1
            raise


def open_database(url: str) -> peewee.Database:
    """A peewee database for a URL; SQLite gets WAL and a busy timeout, PostgreSQL a pool."""
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else parsed.path
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        return _SqliteDatabase(
            path or ":memory:",
            # WAL is set after these, one process at a time (_set_pragmas).
            pragmas={
                "busy_timeout": 10000,
                "synchronous": "normal",
                "foreign_keys": 1,
                "cache_size": -32000,
            },
            timeout=10,
            # Every transaction takes the write lock when it begins (BEGIN IMMEDIATE) and
            # waits for it. A deferred one that reads first fails at once with "database is
            # locked" when another connection wrote meanwhile: its snapshot cannot be upgraded.
            lock_type="IMMEDIATE",
        )
    if parsed.scheme in ("postgres", "postgresql"):
        # A small pool: each API worker is one process; connections are reused across requests.
        pooled = url.replace(f"{parsed.scheme}://", "postgres+pool://", 1)
        sep = "&" if "?" in pooled else "?"
        url = f"{pooled}{sep}max_connections=8&stale_timeout=300"
    # types-peewee leaves playhouse's connect() unannotated.
    database: peewee.Database = connect_url(url)  # type: ignore[no-untyped-call]
    return database


def open_read_only(url: str) -> peewee.Database:
    """A database for a URL that reads and never writes, nor creates anything: for `tes-bridge
    check`, which may run as root beside the service's files.

    SQLite: a missing file is an error (never an empty new database); the file is opened
    `mode=ro` where its `-wal` and `-shm` files exist (the service has it open), else
    `immutable=1`: a read-only WAL connection creates the `-wal` and `-shm` files it lacks,
    and cannot remove them, and none of the service's WAL switch is done. PostgreSQL: a
    session whose transactions are read-only."""
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        path = Path(url[len("sqlite:///") :] if url.startswith("sqlite:///") else parsed.path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        shared = all(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm"))
        mode = "mode=ro" if shared else "immutable=1"
        return peewee.SqliteDatabase(f"{path.resolve().as_uri()}?{mode}", uri=True)
    database: peewee.Database = connect_url(url)  # type: ignore[no-untyped-call]
    if isinstance(database, peewee.PostgresqlDatabase):
        database.connect_params["options"] = "-c default_transaction_read_only=on"
    return database


#: PostgreSQL error classes that pass: insufficient resources (53: disk full, out of memory,
#: too many connections), connection exceptions (08) and an administrator's shutdown (57P).
_PG_TRANSIENT_CLASSES = ("53", "08", "57P")


def unavailable_reason(exc: BaseException) -> str | None:
    """Why the database cannot take a request for now (full, locked, out of reach), or None.

    Looks through the whole chain: when SQLite finds its disk full it rolls the transaction
    back itself, and peewee's own rollback then fails with "cannot rollback", which is the
    error that arrives here."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, NotLeader):
            return f"this poller is not the leader ({current})"
        text = str(current)
        if "database or disk is full" in text:
            return "the database's disk is full"
        if "database is locked" in text:
            return "the database is busy"
        if _READ_ONLY in text:
            return "the database's files are read-only"
        if "unable to open database file" in text:
            return "the database's files cannot be opened"
        code = getattr(current, "pgcode", None)
        if isinstance(code, str) and code.startswith(_PG_TRANSIENT_CLASSES):
            return f"the database cannot take the request now ({code}: {text.strip()})"
        current = current.__cause__ or current.__context__
    return None


def _now() -> float:
    return time.time()


def new_task_id() -> str:
    return str(uuid.uuid4())


_TERMINAL = [s.value for s in TERMINAL_STATES]
#: States of a task whose job is (or may be) in Slurm: followed by the poller. PAUSED too: a
#: suspended job (by an admin, or preempted with PreemptMode=SUSPEND) runs again.
_ACTIVE = [s.value for s in (State.QUEUED, State.INITIALIZING, State.RUNNING, State.PAUSED)]
_UNFINISHED = TaskRow.state.not_in(_TERMINAL)
#: A submission in flight: sbatch started, its job id not stored yet.
_IN_FLIGHT = TaskRow.job_id.is_null() & TaskRow.submit_started_at.is_null(False)
_READY_TO_SUBMIT = (
    (TaskRow.state == State.QUEUED.value)
    & TaskRow.job_id.is_null()
    & TaskRow.submit_started_at.is_null()
)
_FINISHED = TaskRow.state.in_(_TERMINAL)
_CANCELED = TaskRow.state == State.CANCELED.value
_CANCEL_PENDING = TaskRow.cancel_pending == True  # noqa: E712

#: The SQL of the poller's conditional UPDATEs (`_transition`), built once for each database
#: kind, condition and set of columns: peewee takes ~0.4 ms to build one, which was most of
#: the store's time in a burst's round (three writes for each of an array's 500 tasks). Only
#: the module's condition constants above are used, so the key may name them by identity.
_UPDATE_SQL: dict[tuple[type, int, tuple[str, ...]], tuple[object, str, list[Any], list[int]]] = {}


def _update_statement(
    db: peewee.Database, where: peewee.Expression | None, columns: tuple[str, ...]
) -> tuple[str, list[Any], list[int]]:
    """`UPDATE tasks SET <columns> WHERE id = ? [AND where]`: its SQL, its parameters, and
    where in them the id's and each column's value go (in that order)."""
    key = (type(db), id(where), columns)
    cached = _UPDATE_SQL.get(key)
    if cached is not None and cached[0] is where:
        return cached[1], cached[2], cached[3]
    # Unconverted placeholders, found again in the parameters by identity.
    slots = [object() for _ in range(len(columns) + 1)]
    condition = TaskRow.id == peewee.Value(slots[0], converter=False)
    if where is not None:
        condition &= where
    values = {
        getattr(TaskRow, column): peewee.Value(slot, converter=False)
        for column, slot in zip(columns, slots[1:], strict=True)
    }
    query = TaskRow.update(values).where(condition)
    sql, params = db.get_sql_context().sql(query).query()  # type: ignore[no-untyped-call]
    positions = [next(i for i, p in enumerate(params) if p is slot) for slot in slots]
    _UPDATE_SQL[key] = (where, sql, list(params), positions)
    return sql, list(params), positions


@dataclass(frozen=True)
class SubmissionFailure:
    """An sbatch that failed without an answer. `maybe_started_at` None: it never reached
    slurmctld, so no job exists and `attempt` is given back; else recovery looks for the job
    by name once the settle time after `maybe_started_at` has passed."""

    attempt: int
    maybe_started_at: float | None


@dataclass(frozen=True)
class JobDecision:
    """What the poller decided for the task `task_id` whose job is `job_id` (see
    :meth:`Store.apply_decision`)."""

    task_id: str
    job_id: str
    state: State | None = None
    logs: list[dict[str, Any]] | None = None
    resubmit: bool = False
    cancel_job: bool = False

    def changes(self) -> dict[str, Any]:
        """The columns to set, by column name; empty when nothing changes."""
        changes: dict[str, Any] = {}
        if self.resubmit:
            changes.update(job_id=None, submit_started_at=None, next_submit_at=None)
        if self.cancel_job:
            changes["cancel_pending"] = True
        if self.state is not None:
            changes["state"] = self.state.value
        if self.logs is not None:
            changes["logs"] = json.dumps(self.logs)
        return changes


class _Part:
    """The database every part of :class:`Store` works on."""

    db: peewee.Database
    #: The lease epoch every poller write carries (PostgreSQL with an elected poller; see
    #: `fenced`); None: writes are not fenced (the API, SQLite's single poller).
    fence_epoch: int | None = None
    #: Seconds a fenced transaction may sit idle before the server ends its session (see
    #: `fenced`); 0: the server's own setting.
    fence_idle_timeout: float = 0.0
    _fence_depth = 0

    @property
    def is_sqlite(self) -> bool:
        return isinstance(self.db, peewee.SqliteDatabase)

    def meta(self, key: str) -> str | None:
        row = MetaRow.get_or_none(MetaRow.key == key)
        return None if row is None else row.value

    def put_meta(self, key: str, value: str) -> None:
        with self.fenced():
            MetaRow.insert(key=key, value=value).on_conflict(
                conflict_target=[MetaRow.key], update={MetaRow.value: value}
            ).execute()

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """A poller write: with `fence_epoch` set, one transaction that first takes the lease
        row FOR SHARE and compares its epoch, raising FencedOut (nothing written) when another
        poller took over. A takeover UPDATEs that row, so it waits for every fenced
        transaction that holds it, and every fenced transaction after it reads the new epoch:
        a stale leader's write fails even when the leader does not know it is stale.

        A leader stopped (SIGSTOP) inside such a transaction would hold the row, and so the
        takeover, forever: the transaction's session is ended by the server once it sits idle
        for `fence_idle_timeout` (SET LOCAL: also right through a transaction-mode pooler)."""
        epoch = self.fence_epoch
        if epoch is None or self._fence_depth:
            yield  # not fenced, or inside a fenced transaction already
            return
        with self.db.atomic():
            self._fence_depth = 1
            try:
                self._check_epoch(epoch)
                yield
            finally:
                self._fence_depth = 0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Several poller writes as one transaction: one commit and one fence check for all
        of them. An array's hundreds of tasks are marked, then recorded, this way: one by one,
        each write waited for SQLite's write lock behind the API's inserts of a burst."""
        with self.fenced(), self.db.atomic():
            yield

    def _check_epoch(self, epoch: int) -> None:
        sql = f'SELECT "epoch" FROM "{LEASE_TABLE}" WHERE "name" = %s FOR SHARE'
        if self.fence_idle_timeout > 0:
            # One round trip: libpq answers a string of statements with the last one's rows.
            idle_ms = int(self.fence_idle_timeout * 1000)
            sql = f"SET LOCAL idle_in_transaction_session_timeout = {idle_ms}; {sql}"
        row = self.db.execute_sql(sql, [LEASE_NAME]).fetchone()  # type: ignore[no-untyped-call]
        current = None if row is None else int(row[0])
        if current != epoch:
            raise FencedOut(f"lease epoch {epoch} refused: the lease is at epoch {current}")

    @staticmethod
    def _columns(full: bool) -> list[peewee.Field]:
        if full:
            return list(TaskRow._meta.sorted_fields)
        return [TaskRow.seq, TaskRow.id, TaskRow.state]


class _PollerQueries(_Part):
    """What the poller reads (a part of :class:`Store`)."""

    def tasks_to_submit(
        self, *, now: float, limit: int = 100, skip_owners: Collection[str | None] = ()
    ) -> list[TaskRecord]:
        """QUEUED tasks with no job and no submission in flight, oldest first, leaving out the
        tasks of `skip_owners` (owners at their limit must not fill the page others wait behind)."""
        where = (
            (TaskRow.state == State.QUEUED.value)
            & TaskRow.job_id.is_null()
            & TaskRow.submit_started_at.is_null()
            & (TaskRow.next_submit_at.is_null() | (TaskRow.next_submit_at <= now))
        )
        named = [owner for owner in skip_owners if owner is not None]
        if named:
            # NOT IN is never true for a NULL owner: those are decided by the line after.
            where &= TaskRow.owner.is_null() | TaskRow.owner.not_in(named)
        if None in skip_owners:
            where &= TaskRow.owner.is_null(False)
        rows = TaskRow.select().where(where).order_by(TaskRow.seq).limit(limit)
        return [_record(row, True) for row in rows]

    def tasks_in_flight(self, *, with_document: bool = True) -> list[TaskRecord]:
        """Tasks that have (or may have) a Slurm job the poller must watch or cancel.

        Following jobs needs no task document: without it (`document` None) a poll cycle of
        10,000 jobs parses half the JSON."""
        return _records_where(
            (TaskRow.job_id.is_null(False) | TaskRow.submit_started_at.is_null(False))
            & (TaskRow.state.in_(_ACTIVE) | TaskRow.cancel_pending),
            with_document=with_document,
        )

    def jobs_in_flight_by_owner(self) -> dict[str | None, int]:
        """How many tasks of each owner have (or may have) a job in Slurm: one GROUP BY over
        what `tasks_in_flight` reads (admission control)."""
        rows = (
            TaskRow.select(TaskRow.owner, peewee.fn.COUNT(TaskRow.seq).alias("jobs"))
            .where(
                (TaskRow.job_id.is_null(False) | TaskRow.submit_started_at.is_null(False))
                & (TaskRow.state.in_(_ACTIVE) | TaskRow.cancel_pending)
            )
            .group_by(TaskRow.owner)
            .tuples()
        )
        pairs: list[tuple[str | None, int]] = list(rows)  # type: ignore[arg-type]
        return {owner: int(jobs) for owner, jobs in pairs}

    def decided_since(self, since: float) -> list[TaskRecord]:
        """Final tasks with a job, last changed at `since` or later, without their documents:
        a poller that starts counts their jobs until squeue lists them no more (admission)."""
        return _records_where(
            TaskRow.state.in_(_TERMINAL)
            & TaskRow.job_id.is_null(False)
            & (TaskRow.updated_at >= since),
            with_document=False,
        )

    def interrupted_submissions(self) -> list[TaskRecord]:
        """Tasks whose `sbatch` started but whose job id was never stored (see the poller)."""
        rows = (
            TaskRow.select()
            .where(
                TaskRow.job_id.is_null()
                & TaskRow.submit_started_at.is_null(False)
                & (TaskRow.state.in_(_ACTIVE) | TaskRow.cancel_pending)
            )
            .order_by(TaskRow.seq)
        )
        return [_record(row, True) for row in rows]

    def lease_state(self) -> LeaseState | None:
        """Who holds the poller's lease and for how long yet; None on SQLite (one poller,
        held by its lock file)."""
        if self.is_sqlite:
            return None
        row = self.db.execute_sql(  # type: ignore[no-untyped-call]
            f'SELECT "holder", "epoch", EXTRACT(EPOCH FROM clock_timestamp() - "renewed_at"), '
            f"CASE WHEN \"expires_at\" = '-infinity' THEN NULL ELSE "
            f'EXTRACT(EPOCH FROM "expires_at" - clock_timestamp()) END '
            f'FROM "{LEASE_TABLE}" WHERE "name" = %s',
            [LEASE_NAME],
        ).fetchone()
        if row is None:
            return None
        holder, epoch, age, remaining = row
        return LeaseState(
            holder,
            int(epoch),
            None if age is None else float(age),
            None if remaining is None else float(remaining),
        )

    def cancels_pending(self) -> int:
        """How many tasks have a cancel the poller has not carried out yet."""
        return TaskRow.select().where(TaskRow.cancel_pending == True).count()  # noqa: E712

    def oldest_unfinished_time(self) -> float | None:
        """Creation time (epoch seconds) of the oldest task not yet final, or whose job may
        still exist (a cancel not carried out yet); None when there is none."""
        oldest = (
            TaskRow.select(peewee.fn.MIN(TaskRow.creation_time))
            .where(TaskRow.state.in_(_ACTIVE) | TaskRow.cancel_pending)
            .scalar()
        )
        return datetime.fromisoformat(oldest).timestamp() if oldest else None

    def oldest_queued_time(self) -> float | None:
        """Creation time (epoch seconds) of the oldest QUEUED task (the first of the state
        index); None when none is QUEUED."""
        created = (
            TaskRow.select(TaskRow.creation_time)
            .where(TaskRow.state == State.QUEUED.value)
            .order_by(TaskRow.seq)
            .limit(1)
            .scalar()
        )
        return datetime.fromisoformat(created).timestamp() if created else None

    def count_by_state(self) -> dict[str, int]:
        """How many tasks are in each state (one GROUP BY over the state index)."""
        query = TaskRow.select(TaskRow.state, peewee.fn.COUNT(TaskRow.seq)).group_by(TaskRow.state)
        return dict(cast("Iterable[tuple[str, int]]", query.tuples()))

    def newest_seq(self) -> int | None:
        """The `seq` of the newest task (an index lookup): tells the poller a task arrived."""
        newest: int | None = TaskRow.select(peewee.fn.MAX(TaskRow.seq)).scalar()
        return newest

    def finished_before(
        self, cutoff: float, states: Iterable[str], *, limit: int = 1000
    ) -> list[TaskRecord]:
        """Tasks in `states` last changed before `cutoff` whose directory is still there."""
        rows = (
            TaskRow.select(TaskRow.seq, TaskRow.id, TaskRow.state)
            .where(
                TaskRow.state.in_(list(states))
                & (TaskRow.updated_at < cutoff)
                & (TaskRow.cleaned == False)  # noqa: E712 (peewee expression)
            )
            .limit(limit)
        )
        return [_record(row, False) for row in rows]

    def mark_cleaned(self, task_id: str) -> None:
        with self.fenced():
            TaskRow.update(cleaned=True).where(TaskRow.id == task_id).execute()


class _Transitions(_Part):
    """The state changes of a task after its creation (a part of :class:`Store`)."""

    def cancel_task(
        self, task_id: str, *, owner: str | None = None, note: str | None = None
    ) -> TaskRecord | None:
        """Mark a task CANCELED at once (clients treat only final states as final).

        A task that may have a Slurm job keeps `cancel_pending` so the poller scancels it. A
        terminal task keeps its state. `note` (who canceled it) goes into its last attempt's
        system_logs. Returns None for an unknown id.
        """
        with self.db.atomic():
            query = TaskRow.select(
                TaskRow.seq,
                TaskRow.id,
                TaskRow.state,
                TaskRow.job_id,
                TaskRow.submit_started_at,
                TaskRow.logs,
            ).where(TaskRow.id == task_id)
            if owner is not None:
                query = query.where(TaskRow.owner == owner)
            row = query.first()
            if row is None:
                return None
            if row.state in TERMINAL_STATES:
                return _record(row, False)
            may_have_job = row.job_id is not None or row.submit_started_at is not None
            changes: dict[str, Any] = {"logs": _with_line(row.logs, note)} if note else {}
            canceled = (
                TaskRow.update(
                    state=State.CANCELED.value,
                    cancel_pending=may_have_job,
                    updated_at=_now(),
                    **changes,
                )
                .where(
                    (TaskRow.seq == row.seq)
                    & TaskRow.state.not_in([s.value for s in TERMINAL_STATES])
                )
                .execute()
            )
        minimal = TaskRow.select(TaskRow.seq, TaskRow.id, TaskRow.state)
        after = minimal.where(TaskRow.id == task_id).first()
        if after is None:
            return None
        record = _record(after, False)
        record.canceled_now = bool(canceled)
        return record

    def update_task(self, task_id: str, *, allow_terminal: bool = False, **changes: Any) -> bool:
        """Set columns directly, for tests and repairs; the poller uses the transitions below.

        A terminal task's state never changes unless `allow_terminal`. `logs` may be given as a
        list (stored as JSON). Returns whether a row changed.
        """
        if not allow_terminal:
            return self._transition(task_id, _UNFINISHED, **changes)
        return self._transition(task_id, None, **changes)

    # ----------------------------------------------------------------------------- transitions
    # The poller's state changes. Each is one UPDATE, conditional on the state it expects (an
    # API cancel may land between the poller's read and its write), and returns whether the
    # task was in that state and changed.

    def _transition(self, task_id: str, where: peewee.Expression | None, **changes: Any) -> bool:
        if "logs" in changes:
            changes["logs"] = json.dumps(changes["logs"])
        changes["updated_at"] = _now()
        columns = tuple(changes)
        sql, params, positions = _update_statement(self.db, where, columns)
        params[positions[0]] = task_id
        for column, position in zip(columns, positions[1:], strict=True):
            params[position] = getattr(TaskRow, column).db_value(changes[column])
        with self.fenced():
            cursor = self.db.execute_sql(sql, params)  # type: ignore[no-untyped-call]
        return int(cursor.rowcount) > 0

    def mark_submitting(
        self,
        task_id: str,
        *,
        attempt: int,
        now: float,
        logs: list[dict[str, Any]] | None = None,
    ) -> bool:
        """QUEUED, no job, no submission in flight -> submission in flight (`attempt`), with
        `logs` when given (an array's name and the task's element in it).

        Recorded just before sbatch runs: after a crash the job is looked for by name, never
        submitted twice. False when the task was canceled meanwhile."""
        changes: dict[str, Any] = {"submit_started_at": now, "attempt": attempt}
        if logs is not None:
            changes["logs"] = logs
        return self._transition(task_id, _READY_TO_SUBMIT, **changes)

    def record_job(
        self, task_id: str, job_id: str, *, logs: list[dict[str, Any]] | None = None
    ) -> bool:
        """Submission in flight (any state) -> has job `job_id`; clears the back-off.

        Returns True when the task was canceled while its sbatch ran: its cancel is then
        marked pending, for the poller to scancel the job."""
        changes: dict[str, Any] = {"job_id": job_id, "submit_started_at": None}
        if logs is not None:
            changes.update(next_submit_at=None, logs=logs)
        # Inside a batch() already: its transaction holds both writes (no savepoint each).
        whole = contextlib.nullcontext() if self.db.in_transaction() else self.db.atomic()
        with self.fenced(), whole:
            if not self._transition(task_id, _IN_FLIGHT, **changes):
                return False
            return self._transition(task_id, _CANCELED, cancel_pending=True)

    def note_submission(
        self, task_id: str, *, logs: list[dict[str, Any]], now: float | None = None
    ) -> bool:
        """Submission in flight (any state) -> the same, with `logs` (the ids of a chain's jobs
        submitted or found so far) and `now`, when given, as the start of its next sbatch:
        after a crash, the chain's other jobs are looked up by name and only the missing ones
        are submitted."""
        changes: dict[str, Any] = {"logs": logs}
        if now is not None:
            changes["submit_started_at"] = now
        return self._transition(task_id, _IN_FLIGHT, **changes)

    def forget_submission(self, task_id: str, *, attempt: int) -> bool:
        """Submission in flight (any state) whose sbatch created no job -> no submission,
        `attempt` given back, no cancel to carry out: the task may be submitted again."""
        return self._transition(
            task_id, _IN_FLIGHT, submit_started_at=None, attempt=attempt, cancel_pending=False
        )

    def defer_submission(
        self,
        task_id: str,
        *,
        until: float,
        logs: list[dict[str, Any]],
        submission: SubmissionFailure | None = None,
    ) -> bool:
        """Unfinished task -> tried again after `until`, its logs saying why.

        Without `submission` the task had no sbatch yet. With one, its sbatch failed without
        an answer: see :class:`SubmissionFailure`."""
        changes: dict[str, Any] = {"next_submit_at": until, "logs": logs}
        if submission is not None:
            changes["submit_started_at"] = submission.maybe_started_at
            if submission.maybe_started_at is None:
                changes["attempt"] = submission.attempt
        return self._transition(task_id, _UNFINISHED, **changes)

    def note(self, task_id: str, logs: list[dict[str, Any]]) -> bool:
        """Unfinished task: new `logs` (a condition line, image notes), same state."""
        return self._transition(task_id, _UNFINISHED, logs=logs)

    def amend_final_logs(self, task_id: str, logs: list[dict[str, Any]]) -> bool:
        """Finished task: `logs` with the final Slurm facts that sacct had late."""
        return self._transition(task_id, _FINISHED, logs=logs)

    def apply_decision(
        self,
        task_id: str,
        *,
        job_id: str,
        state: State | None = None,
        logs: list[dict[str, Any]] | None = None,
        resubmit: bool = False,
        cancel_job: bool = False,
    ) -> bool:
        """Unfinished task with job `job_id` -> what the poller decided from Slurm and the
        job's records: a new `state` and/or `logs`; `resubmit` forgets the job (lost through
        no fault of the task) so the task is submitted again; `cancel_job` marks the job for
        scancel."""
        decision = JobDecision(task_id, job_id, state, logs, resubmit, cancel_job)
        with self.fenced():
            return self._apply_decision(decision, _now()) > 0

    def apply_decisions(self, decisions: Sequence[JobDecision]) -> list[JobDecision]:
        """:meth:`apply_decision` for each of `decisions`, all in one transaction (one commit
        instead of one each); returns the decisions that changed their task."""
        now = _now()
        with self.fenced(), self.db.atomic():
            return [d for d in decisions if self._apply_decision(d, now)]

    def _apply_decision(self, decision: JobDecision, now: float) -> int:
        changes = decision.changes()
        if not changes:
            return 0
        changes["updated_at"] = now
        # A cached statement: peewee building the UPDATE cost more than running it.
        sql = _decision_sql(tuple(changes), self.db)
        params = [*changes.values(), decision.task_id, *_TERMINAL, decision.job_id]
        changed: int = self.db.execute_sql(sql, params).rowcount  # type: ignore[no-untyped-call]
        return changed

    def fail(
        self,
        task_id: str,
        logs: list[dict[str, Any]],
        *,
        attempt: int | None = None,
        end_submission: bool = False,
    ) -> bool:
        """Unfinished task -> SYSTEM_ERROR with `logs` saying why. `attempt` records the
        attempt that failed; `end_submission` clears the submission in flight (sbatch refused
        the job)."""
        changes: dict[str, Any] = {"state": State.SYSTEM_ERROR.value, "logs": logs}
        if attempt is not None:
            changes["attempt"] = attempt
        if end_submission:
            changes["submit_started_at"] = None
        return self._transition(task_id, _UNFINISHED, **changes)

    def finish_cancel(self, task_id: str) -> bool:
        """Cancel pending (any state) -> carried out: scancel was sent for the task's job."""
        return self._transition(task_id, _CANCEL_PENDING, cancel_pending=False)


class _Listing(_Part):
    """Listing: filters, keyset pages, signed page tokens (a part of :class:`Store`)."""

    _secret: bytes | None = None

    def list_tasks(
        self,
        task_filter: TaskFilter,
        *,
        page_size: int,
        page_token: str | None = None,
        full: bool = True,
        budget_bytes: int | None = None,
    ) -> tuple[list[TaskRecord], str | None]:
        """Newest first; returns the page and the token of the next page (None at the end).

        With `full` and `budget_bytes`, the page also ends before the stored documents and logs
        it holds pass `budget_bytes` (with at least one task): their sizes are read first, so
        a worker never loads more than one page's budget."""
        if full and budget_bytes is not None:
            return self._list_within_budget(task_filter, page_size, page_token, budget_bytes)
        query = self._filtered(TaskRow.select(*self._columns(full)), task_filter, page_token)
        rows = list(query.order_by(TaskRow.seq.desc()).limit(page_size + 1))
        more = len(rows) > page_size
        rows = rows[:page_size]
        token = self._encode_token(rows[-1].seq) if more and rows else None
        return [_record(row, full) for row in rows], token

    def count_states(self, task_filter: TaskFilter) -> dict[str, int]:
        """How many tasks match `task_filter` in each state (its own state filter ignored)."""
        query = TaskRow.select(TaskRow.state, peewee.fn.COUNT(TaskRow.seq))
        any_state = TaskFilter(task_filter.name_prefix, None, task_filter.tags, task_filter.owner)
        query = self._filtered(query, any_state, None).group_by(TaskRow.state)
        return dict(cast("Iterable[tuple[str, int]]", query.tuples()))

    def owners_of(self, task_ids: Sequence[str]) -> dict[str, str | None]:
        """Each known id's owner (None: a task created without authentication)."""
        query = TaskRow.select(TaskRow.id, TaskRow.owner).where(TaskRow.id.in_(list(task_ids)))
        return dict(cast("Iterable[tuple[str, str | None]]", query.tuples()))

    def _list_within_budget(
        self, task_filter: TaskFilter, page_size: int, page_token: str | None, budget: int
    ) -> tuple[list[TaskRecord], str | None]:
        # The stored JSON is ASCII (json.dumps escapes the rest): characters are bytes.
        size = peewee.fn.LENGTH(TaskRow.document) + peewee.fn.LENGTH(TaskRow.logs)
        # The page's seqs first (as a MINIMAL list), then the sizes of those rows only: computed
        # in the filtering query, every matching row's document would be read before the LIMIT.
        page = self._filtered(TaskRow.select(TaskRow.seq), task_filter, page_token)
        page = page.order_by(TaskRow.seq.desc()).limit(page_size + 1)
        query = TaskRow.select(TaskRow.seq, size.alias("size")).where(TaskRow.seq.in_(page))
        sizes = cast(list[tuple[int, int]], list(query.order_by(TaskRow.seq.desc()).tuples()))
        seqs: list[int] = []
        total = 0
        for seq, nbytes in sizes[:page_size]:
            total += nbytes
            if seqs and total > budget:
                break
            seqs.append(seq)
        if not seqs:
            return [], None
        rows = TaskRow.select().where(TaskRow.seq.in_(seqs)).order_by(TaskRow.seq.desc())
        token = self._encode_token(seqs[-1]) if len(sizes) > len(seqs) else None
        return [_record(row, True) for row in rows], token

    def _filtered(
        self,
        query: peewee.ModelSelect[TaskRow],
        task_filter: TaskFilter,
        page_token: str | None,
    ) -> peewee.ModelSelect[TaskRow]:
        if page_token:
            query = query.where(TaskRow.seq < self._decode_token(page_token))
        if task_filter.owner is not None:
            query = query.where(TaskRow.owner == task_filter.owner)
        if task_filter.state:
            query = query.where(TaskRow.state == task_filter.state)
        if task_filter.name_prefix:
            query = query.where(self._prefix_condition(task_filter.name_prefix))
        if task_filter.tags:
            query = query.where(self._tags_condition(task_filter.tags))
        return query

    def _tags_condition(self, tags: Sequence[tuple[str, str | None]]) -> peewee.Node:
        """`seq` has every (key, value) pair; value None matches any value of the key.

        Built flat, as a list and not as a tree of nested expressions: peewee renders a tree
        recursively, and a few hundred pairs overflowed the stack."""
        selects: list[tuple[str, list[str]]] = []
        for key, value in tags:
            sql = f'SELECT "task_seq" FROM "task_tags" WHERE "key" = {self.db.param}'
            if value is None:
                selects.append((sql, [key]))
            else:
                selects.append((f'{sql} AND "value" = {self.db.param}', [key, value]))
        if self.is_sqlite or len(selects) > 4:
            # One INTERSECT of the pairs: with an IN per pair SQLite looks up every task of the
            # first pair (14,000 for a common tag) whatever the others match, and PostgreSQL
            # plans a join per pair: 0.1 s for 16 pairs, 9 minutes for 256.
            sql = " INTERSECT ".join(sql for sql, _ in selects)
            params = [p for _, values in selects for p in values]
            return TaskRow.seq.in_(peewee.SQL(f"({sql})", params))
        # PostgreSQL plans a few INs better than the INTERSECT.
        return peewee.NodeList(
            [TaskRow.seq.in_(peewee.SQL(f"({sql})", values)) for sql, values in selects],
            glue=" AND ",
            parens=True,
        )

    def _prefix_condition(self, prefix: str) -> peewee.Expression:
        """Case-sensitive prefix match that can use an index on `name`.

        A range `prefix <= name < successor(prefix)` plus an exact check. SQLite compares text
        byte-wise (UTF-8 order is code point order); PostgreSQL compares with the "C" collation
        so the range means the same whatever the database's locale.
        """
        exact = peewee.fn.substr(TaskRow.name, 1, len(prefix)) == prefix
        upper = _prefix_successor(prefix)
        if self.is_sqlite:
            name: Any = TaskRow.name
            low: Any = prefix
            high: Any = upper
        else:
            collate_c = peewee.SQL('COLLATE "C"')
            name = peewee.NodeList((TaskRow.name, collate_c))
            low = peewee.NodeList((peewee.Value(prefix), collate_c))
            high = upper and peewee.NodeList((peewee.Value(upper), collate_c))
        condition = (name >= low) & exact
        result: peewee.Expression = condition & (name < high) if upper else condition
        return result

    # ----------------------------------------------------------------------------- tokens
    def _token_secret(self) -> bytes:
        if self._secret is None:
            value = self.meta("page_token_secret")
            if value is None:
                raise RuntimeError("the store is not initialised; run init_schema() first")
            self._secret = bytes.fromhex(value)
        return self._secret

    def _encode_token(self, seq: int) -> str:
        payload = str(seq).encode()
        mac = hmac.new(self._token_secret(), payload, hashlib.sha256).digest()[:12]
        return base64.urlsafe_b64encode(payload + b"." + mac).decode().rstrip("=")

    def _decode_token(self, token: str) -> int:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            payload, mac = raw.split(b".", 1)
            expected = hmac.new(self._token_secret(), payload, hashlib.sha256).digest()[:12]
            if hmac.compare_digest(mac, expected):
                return int(payload)
        except (ValueError, TypeError):
            pass
        raise InvalidPageToken("page_token was not issued by this server")


class Store(_PollerQueries, _Transitions, _Listing):
    def __init__(self, database: peewee.Database):
        self.db = database
        database_proxy.initialize(database)

    @classmethod
    def from_url(cls, url: str) -> Store:
        return cls(open_database(url))

    @classmethod
    def read_only(cls, url: str) -> Store:
        """A store that only reads (:func:`open_read_only`)."""
        return cls(open_read_only(url))

    def _sql(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """A raw statement; returns the cursor."""
        # peewee's stubs leave execute_sql untyped.
        return self.db.execute_sql(sql, params)  # type: ignore[no-untyped-call]

    # ----------------------------------------------------------------------------- schema
    def init_schema(self, version: str = "") -> None:
        """Create missing tables, bring a database of an earlier schema up to this one
        (`MIGRATIONS`), and record the schema version (safe to run concurrently: one process
        at a time upgrades, the others find it done)."""
        with self.db.connection_context(), self.db.atomic():
            if not self.is_sqlite:
                # SQLite's transactions take the write lock as they begin (BEGIN IMMEDIATE).
                self._sql("SELECT pg_advisory_xact_lock(%s)", [_SCHEMA_LOCK])
            recorded = self._recorded_schema()
            if recorded is not None and recorded > SCHEMA_VERSION:
                raise RuntimeError(
                    f"the database has schema version {recorded}, newer than this "
                    f"tes-bridge ({SCHEMA_VERSION}); upgrade tes-bridge"
                )
            for step in range(SCHEMA_VERSION if recorded is None else recorded, SCHEMA_VERSION):
                MIGRATIONS[step](self)
            self._create_schema()
            now = format_time_now()
            MetaRow.insert(key="schema_version", value=str(SCHEMA_VERSION)).on_conflict(
                conflict_target=[MetaRow.key], update={MetaRow.value: str(SCHEMA_VERSION)}
            ).execute()
            for key, value in (("created_at", now), ("page_token_secret", secrets.token_hex(32))):
                MetaRow.insert(key=key, value=value).on_conflict_ignore().execute()
            if version:
                previous = MetaRow.get_or_none(MetaRow.key == "version")
                if previous is None or previous.value != version:
                    for key, value in (("version", version), ("updated_at", now)):
                        MetaRow.insert(key=key, value=value).on_conflict(
                            conflict_target=[MetaRow.key], update={MetaRow.value: value}
                        ).execute()

    def _recorded_schema(self) -> int | None:
        """The schema version the database records; None for a new one."""
        if not self.db.table_exists(MetaRow._meta.table_name):
            return None
        recorded = MetaRow.get_or_none(MetaRow.key == "schema_version")
        return None if recorded is None else int(recorded.value)

    def _create_schema(self) -> None:
        """The tables and indexes this schema has (what exists already is left as it is)."""
        self.db.create_tables(MODELS, safe=True)
        # The poller counts pending cancels every 0.1 s: a seek, not a scan of every task.
        self._sql("CREATE INDEX IF NOT EXISTS tasks_cancel_pending ON tasks (cancel_pending)")
        if not self.is_sqlite:
            # For the name_prefix range, which compares with the "C" collation.
            self._sql('CREATE INDEX IF NOT EXISTS tasks_name_c ON tasks (name COLLATE "C", seq)')
            self._sql(_LEASE_DDL)
            self._sql(
                f'INSERT INTO "{LEASE_TABLE}" ("name") VALUES (%s) ON CONFLICT DO NOTHING',
                [LEASE_NAME],
            )

    # ----------------------------------------------------------------------------- create/read
    def create_task(
        self,
        document: dict[str, Any],
        *,
        system_logs: Sequence[str] = (),
        owner: str | None = None,
    ) -> TaskRecord:
        task_id = new_task_id()
        created = format_time_now()
        logs = (
            [{"logs": [], "outputs": [], "system_logs": list(system_logs)}] if system_logs else []
        )
        values = {
            "id": task_id,
            "state": State.QUEUED.value,
            "name": document.get("name"),
            "owner": owner,
            "creation_time": created,
            "document": json.dumps(document, separators=(",", ":")),
            "logs": json.dumps(logs),
            "updated_at": _now(),
        }
        tags = document.get("tags") or {}
        if not self.is_sqlite:
            # One statement (atomic by itself), one round trip to the server.
            seq = self._insert_task(values, tags)
        else:
            with self.db.atomic():
                seq = self._insert_task(values)
                if tags:
                    params = [p for k, v in tags.items() for p in (seq, k, v)]
                    sql = _insert_sql(TagRow, _TAG_COLUMNS, len(tags), self.db)
                    self._sql(sql, params)
        return TaskRecord(
            seq=seq,
            id=task_id,
            state=State.QUEUED.value,
            creation_time=created,
            document=document,
            logs=logs,
            owner=owner,
        )

    def _insert_task(self, values: dict[str, Any], tags: dict[str, str] | None = None) -> int:
        """INSERT of one task row with a cached statement (peewee builds its SQL on each call,
        about a third of the cost of a create); the fields' defaults fill what is not given.
        On PostgreSQL the `tags` rows go in with the same statement."""
        params = [f.db_value(values.get(f.name, f.default)) for f in _TASK_FIELDS]
        sql = _insert_sql(TaskRow, tuple(f.column_name for f in _TASK_FIELDS), 1, self.db)
        if self.is_sqlite:
            return int(self._sql(sql, params).lastrowid)
        if not tags:
            return int(self._sql(f'{sql} RETURNING "seq"', params).fetchone()[0])
        pairs = ", ".join(["(%s, %s)"] * len(tags))
        statement = (
            f'WITH t AS ({sql} RETURNING "seq"), g AS (INSERT INTO "task_tags" '
            f'("task_seq", "key", "value") SELECT t.seq, v.k, v.v FROM t, (VALUES {pairs}) '
            f"AS v(k, v)) SELECT seq FROM t"
        )
        params += [p for item in tags.items() for p in item]
        return int(self._sql(statement, params).fetchone()[0])

    def get_task(
        self, task_id: str, *, owner: str | None = None, full: bool = True
    ) -> TaskRecord | None:
        if not full:
            return self._get_minimal(task_id, owner)
        query = TaskRow.select(*self._columns(full)).where(TaskRow.id == task_id)
        if owner is not None:
            query = query.where(TaskRow.owner == owner)
        row = query.first()
        return None if row is None else _record(row, full)

    def _get_minimal(self, task_id: str, owner: str | None) -> TaskRecord | None:
        """`seq`, `id` and `state` through the unique index on `id`, with a cached statement:
        engines poll every task in flight this way once a second, and peewee building the
        SELECT cost three times as much as running it. Never reads the document."""
        sql = _minimal_sql(owner is not None, self.db)
        params = [task_id] if owner is None else [task_id, owner]
        row = self.db.execute_sql(sql, params).fetchone()  # type: ignore[no-untyped-call]
        return None if row is None else TaskRecord(seq=row[0], id=row[1], state=row[2])


_TASK_FIELDS = [f for f in TaskRow._meta.sorted_fields if f.name != "seq"]
_TAG_COLUMNS = ("task_seq", "key", "value")


@functools.lru_cache(maxsize=64)
def _insert_sql(
    model: type[peewee.Model], columns: tuple[str, ...], rows: int, db: peewee.Database
) -> str:
    row = "(" + ", ".join([db.param] * len(columns)) + ")"
    names = ", ".join(f'"{c}"' for c in columns)
    return f'INSERT INTO "{model._meta.table_name}" ({names}) VALUES ' + ", ".join([row] * rows)


@functools.lru_cache(maxsize=8)
def _minimal_sql(by_owner: bool, db: peewee.Database) -> str:
    p = db.param
    owner = f' AND "owner" = {p}' if by_owner else ""
    return (
        f'SELECT "seq", "id", "state" FROM "{TaskRow._meta.table_name}" '
        f'WHERE "id" = {p}{owner} LIMIT 1'
    )


@functools.lru_cache(maxsize=64)
def _decision_sql(columns: tuple[str, ...], db: peewee.Database) -> str:
    """UPDATE of `columns` of an unfinished task with a given job (see apply_decision)."""
    p = db.param
    sets = ", ".join(f'"{c}" = {p}' for c in columns)
    terminal = ", ".join([p] * len(_TERMINAL))
    return (
        f'UPDATE "{TaskRow._meta.table_name}" SET {sets} '
        f'WHERE "id" = {p} AND "state" NOT IN ({terminal}) AND "job_id" = {p}'
    )


def _prefix_successor(prefix: str) -> str | None:
    """The smallest string greater than every string that starts with `prefix`."""
    while prefix:
        code = ord(prefix[-1]) + 1
        if code == 0xD800:  # skip the surrogate block, which cannot be stored
            code = 0xE000
        if code <= 0x10FFFF:
            return prefix[:-1] + chr(code)
        prefix = prefix[:-1]
    return None


def _with_line(logs_json: str | None, line: str) -> str:
    """The stored logs with `line` among the last attempt's lasting system_logs (before its
    condition lines, which end them: bridge.poller.attempt)."""
    logs: list[dict[str, Any]] = json.loads(logs_json) if logs_json else []
    if not logs:
        logs = [{"logs": [], "outputs": []}]
    entry = logs[-1]
    lines = list(entry.get("system_logs") or [])
    kinds = entry.get(CONDITION_KINDS_KEY) or []
    lines.insert(len(lines) - len(kinds), line)
    entry["system_logs"] = lines
    return json.dumps(logs)


def _records_where(where: peewee.Expression, *, with_document: bool) -> list[TaskRecord]:
    """The tasks matching `where`, oldest first, read as plain dicts: no model object per row
    (a third of reading 10,000 tasks); without the document, half the JSON is not parsed."""
    fields = [f for f in TaskRow._meta.sorted_fields if with_document or f.name != "document"]
    rows = TaskRow.select(*fields).where(where).order_by(TaskRow.seq)
    dicts = cast(Iterable[dict[str, Any]], rows.dicts())
    return [_record_from_columns(columns) for columns in dicts]


def _record_from_columns(columns: dict[str, Any]) -> TaskRecord:
    """A full record from a row read as a dict (`document` absent when not selected)."""
    document = columns.get("document")
    return TaskRecord(
        seq=columns["seq"],
        id=columns["id"],
        state=columns["state"],
        creation_time=columns["creation_time"],
        document=None if document is None else json.loads(document),
        logs=json.loads(columns["logs"]),
        owner=columns["owner"],
        job_id=columns["job_id"],
        attempt=columns["attempt"],
        submit_started_at=columns["submit_started_at"],
        next_submit_at=columns["next_submit_at"],
        cancel_pending=columns["cancel_pending"],
    )


def _record(row: TaskRow, full: bool) -> TaskRecord:
    if not full:
        return TaskRecord(seq=row.seq, id=row.id, state=row.state)
    # The row's selected columns, as peewee converted them.
    return _record_from_columns(row.__data__)
