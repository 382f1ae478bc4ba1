"""The store on SQLite and on a real PostgreSQL server (the `store` fixture runs both)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from bridge.core.tes import State
from bridge.store import (
    SCHEMA_VERSION,
    JobDecision,
    MetaRow,
    Store,
    SubmissionFailure,
    TaskFilter,
    TaskRecord,
    TaskRow,
    _prefix_successor,
)

ECHO = {"executors": [{"image": "alpine", "command": ["true"]}]}


def test_schema_version_and_times_are_recorded(store: Store):
    assert store.meta("schema_version") == str(SCHEMA_VERSION)
    assert store.meta("created_at").endswith("Z")
    assert store.meta("version") == "test"


def test_init_schema_is_idempotent_and_keeps_data(store: Store):
    task = store.create_task(ECHO)
    created = store.meta("created_at")
    secret = store.meta("page_token_secret")
    store.init_schema("test")
    store.init_schema("0.2.0")
    assert store.get_task(task.id) is not None
    assert store.meta("created_at") == created
    assert store.meta("page_token_secret") == secret
    assert store.meta("version") == "0.2.0"


def test_a_newer_schema_is_refused(store: Store):
    MetaRow.update(value=str(SCHEMA_VERSION + 1)).where(MetaRow.key == "schema_version").execute()
    with pytest.raises(RuntimeError, match="newer than this tes-bridge"):
        store.init_schema("test")


def test_tokens_from_another_store_are_refused(store: Store, tmp_path):
    for _ in range(3):
        store.create_task(ECHO)
    _, token = store.list_tasks(TaskFilter(), page_size=1)
    other = Store.from_url(f"sqlite:///{tmp_path / 'other.db'}")
    other.init_schema("test")
    for _ in range(3):
        other.create_task(ECHO)
    with pytest.raises(ValueError, match="not issued"):
        other.list_tasks(TaskFilter(), page_size=1, page_token=token)


def test_minimal_listing_reads_no_documents(store: Store):
    store.create_task({"name": "x", **ECHO})
    (record,), _ = store.list_tasks(TaskFilter(), page_size=10, full=False)
    assert record.document is None and record.state == "QUEUED"


def test_update_never_changes_a_terminal_state(store: Store):
    for final in (State.COMPLETE, State.EXECUTOR_ERROR, State.SYSTEM_ERROR, State.CANCELED):
        task = store.create_task(ECHO)
        assert store.update_task(task.id, state=final.value)
        assert not store.update_task(task.id, state=State.RUNNING.value)
        assert store.get_task(task.id).state == final.value
        # Bookkeeping may still change (the poller clears a finished cancel).
        assert store.update_task(task.id, allow_terminal=True, cancel_pending=False)
        assert store.get_task(task.id).state == final.value


def test_tasks_to_submit_respects_back_off_and_order(store: Store):
    first = store.create_task(ECHO)
    second = store.create_task(ECHO)
    later = store.create_task(ECHO)
    store.update_task(later.id, next_submit_at=1000.0)
    store.update_task(second.id, submit_started_at=5.0)
    assert [t.id for t in store.tasks_to_submit(now=999.0)] == [first.id]
    assert [t.id for t in store.tasks_to_submit(now=1000.0)] == [first.id, later.id]


def test_tasks_to_submit_skips_the_owners_it_is_told_to(store: Store):
    alice, anonymous, bob = (store.create_task(ECHO, owner=o) for o in ("alice", None, "bob"))

    def ids(*skip: str | None) -> list[str]:
        return [t.id for t in store.tasks_to_submit(now=0.0, skip_owners=skip)]

    assert ids() == [alice.id, anonymous.id, bob.id]
    assert ids("alice") == [anonymous.id, bob.id]
    assert ids(None) == [alice.id, bob.id]
    assert ids("alice", None, "carol") == [bob.id]


def test_tasks_in_flight(store: Store):
    queued = store.create_task(ECHO)
    running = store.create_task(ECHO)
    submitting = store.create_task(ECHO)
    finished = store.create_task(ECHO)
    canceled = store.create_task(ECHO)
    store.update_task(running.id, job_id="1", state="RUNNING")
    store.update_task(submitting.id, submit_started_at=1.0)
    store.update_task(finished.id, job_id="2", state="COMPLETE")
    store.update_task(canceled.id, job_id="3", state="RUNNING")
    store.cancel_task(canceled.id)
    ids = {t.id for t in store.tasks_in_flight()}
    assert ids == {running.id, submitting.id, canceled.id}
    assert queued.id not in ids


def test_finished_tasks_for_cleanup(store: Store):
    done = store.create_task(ECHO)
    store.update_task(done.id, state="COMPLETE")
    assert [t.id for t in store.finished_before(1e12, ["COMPLETE"])] == [done.id]
    assert store.finished_before(0, ["COMPLETE"]) == []
    store.mark_cleaned(done.id)
    assert store.finished_before(1e12, ["COMPLETE"]) == []


def test_concurrent_creates_from_threads(store: Store):
    url_db = store.db

    def worker() -> None:
        with url_db.connection_context():
            for _ in range(20):
                store.create_task({"tags": {"t": "x"}, **ECHO})

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tasks, _ = store.list_tasks(TaskFilter(tags=[("t", "x")]), page_size=2047)
    assert len(tasks) == 80
    assert len({t.seq for t in tasks}) == 80


@pytest.mark.parametrize(
    ("prefix", "successor"),
    [("abc", "abd"), ("a\U0010ffff", "b"), ("\U0010ffff", None), ("a\ud7ff", "a\ue000")],
)
def test_prefix_successor(prefix, successor):
    assert _prefix_successor(prefix) == successor


def test_a_cancel_waits_for_another_writer_instead_of_failing(sqlite_store: Store):
    """SQLite: a cancel reads the task, then writes. Begun as a deferred transaction, its read
    snapshot goes stale while another connection writes, and the write then fails at once with
    "database is locked" (no busy wait helps). Write transactions take the lock up front."""
    store = sqlite_store
    victim = store.create_task(ECHO)
    writer_holds_lock = threading.Event()
    errors: list[BaseException] = []

    def other_writer() -> None:
        try:
            with store.db.connection_context(), store.db.atomic():
                store.create_task(ECHO)
                writer_holds_lock.set()
                time.sleep(1.0)  # the cancel below reads, then waits for this lock
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_writer)
    thread.start()
    assert writer_holds_lock.wait(10)
    time.sleep(0.1)
    canceled = store.cancel_task(victim.id)
    thread.join(10)
    assert not errors, errors
    assert canceled is not None and canceled.state == State.CANCELED.value
    assert store.get_task(victim.id).state == State.CANCELED.value


def test_unavailable_reason_sees_through_the_rollback_error():
    import peewee

    from bridge.store import unavailable_reason

    class PgError(Exception):
        def __init__(self, message: str, pgcode: str) -> None:
            super().__init__(message)
            self.pgcode = pgcode

    try:
        try:
            raise peewee.OperationalError("database or disk is full")
        except peewee.OperationalError:
            raise peewee.OperationalError("cannot rollback - no transaction is active") from None
    except peewee.OperationalError as exc:
        assert exc.__cause__ is None and exc.__context__ is not None
        assert unavailable_reason(exc) == "the database's disk is full"
    assert "53100" in unavailable_reason(PgError("could not extend file", "53100"))
    assert unavailable_reason(PgError("syntax error", "42601")) is None
    assert unavailable_reason(ValueError("bad")) is None


def test_transitions_change_only_a_task_in_the_state_they_expect(store: Store):
    task = store.create_task(ECHO)
    assert store.mark_submitting(task.id, attempt=1, now=5.0)
    # A second submission of the same task is refused: one is in flight.
    assert not store.mark_submitting(task.id, attempt=2, now=6.0)
    assert not store.apply_decision(task.id, job_id="7", state=State.RUNNING)  # no job yet
    assert not store.record_job(task.id, "7")  # not canceled meanwhile
    record = store.get_task(task.id)
    assert (record.job_id, record.submit_started_at, record.attempt) == ("7", None, 1)
    assert not store.record_job(task.id, "8")  # no submission in flight any more
    assert not store.apply_decision(task.id, job_id="8", state=State.RUNNING)  # another job
    assert store.apply_decision(task.id, job_id="7", state=State.RUNNING)
    assert not store.amend_final_logs(task.id, [])  # not finished
    assert store.fail(task.id, [{"logs": [], "outputs": [], "system_logs": ["why"]}])
    assert not store.fail(task.id, [])  # a terminal state never changes
    assert not store.apply_decision(task.id, job_id="7", state=State.COMPLETE)
    assert not store.note(task.id, [])
    assert store.amend_final_logs(task.id, [{"logs": [], "outputs": []}])
    assert store.get_task(task.id).state == State.SYSTEM_ERROR.value


def test_a_batch_of_decisions_changes_what_one_by_one_would_in_one_transaction(store: Store):
    tasks = [store.create_task(ECHO) for _ in range(5)]
    for i, task in enumerate(tasks):
        store.mark_submitting(task.id, attempt=1, now=5.0)
        store.record_job(task.id, str(i))
    store.fail(tasks[4].id, [])
    logs = [{"logs": [], "outputs": [], "system_logs": ["pending"]}]
    batch = [
        JobDecision(tasks[0].id, "0", state=State.RUNNING, logs=logs),
        JobDecision(tasks[1].id, "1", resubmit=True, state=State.QUEUED),
        JobDecision(tasks[2].id, "2", state=State.SYSTEM_ERROR, cancel_job=True),
        JobDecision(tasks[3].id, "other", state=State.RUNNING),  # another job: unchanged
        JobDecision(tasks[4].id, "4", state=State.COMPLETE),  # terminal: unchanged
        JobDecision(tasks[0].id, "0"),  # nothing to change
    ]
    assert len(store.apply_decisions(batch)) == 3
    got = [store.get_task(t.id) for t in tasks]
    assert (got[0].state, got[0].logs) == ("RUNNING", logs)
    assert (got[1].state, got[1].job_id, got[1].submit_started_at) == ("QUEUED", None, None)
    assert (got[2].state, got[2].cancel_pending) == ("SYSTEM_ERROR", True)
    assert [g.state for g in got[3:]] == ["QUEUED", "SYSTEM_ERROR"]
    # One transaction: a decision that cannot be written undoes the whole batch.
    bad = JobDecision(tasks[3].id, "3", logs=[{"not json": object()}])
    with pytest.raises(TypeError):
        store.apply_decisions([JobDecision(tasks[3].id, "3", state=State.RUNNING), bad])
    assert store.get_task(tasks[3].id).state == "QUEUED"


def test_job_recorded_for_a_task_canceled_during_its_sbatch_is_marked_for_scancel(store: Store):
    task = store.create_task(ECHO)
    assert store.mark_submitting(task.id, attempt=1, now=5.0)
    store.cancel_task(task.id)
    assert store.record_job(task.id, "7")
    record = store.get_task(task.id)
    assert (record.state, record.job_id, record.cancel_pending) == ("CANCELED", "7", True)
    assert store.finish_cancel(task.id)
    assert not store.finish_cancel(task.id)
    assert not store.get_task(task.id).cancel_pending


def test_a_batch_of_poller_writes_is_one_transaction(store: Store):
    """An array's members are marked, then recorded, in one batch each: all or nothing, and
    a member canceled meanwhile is still told apart inside the batch."""
    first, second = store.create_task(ECHO), store.create_task(ECHO)
    with pytest.raises(RuntimeError), store.batch():
        assert store.mark_submitting(first.id, attempt=1, now=5.0)
        assert store.mark_submitting(second.id, attempt=1, now=5.0)
        raise RuntimeError("the array's script could not be written")
    assert [store.get_task(t.id).submit_started_at for t in (first, second)] == [None, None]
    with store.batch():
        assert store.mark_submitting(first.id, attempt=1, now=5.0)
        assert store.mark_submitting(second.id, attempt=1, now=5.0)
    store.cancel_task(second.id)
    logs = [{"logs": [], "outputs": [], "metadata": {"slurm_job_id": "9_0"}}]
    with store.batch():
        assert not store.record_job(first.id, "9_0", logs=logs)
        assert store.record_job(second.id, "9_1")
    one, two = store.get_task(first.id), store.get_task(second.id)
    assert (one.job_id, one.submit_started_at, one.logs) == ("9_0", None, logs)
    assert (two.state, two.job_id, two.cancel_pending) == ("CANCELED", "9_1", True)


def test_a_submission_that_created_no_job_gives_its_attempt_back(store: Store):
    task = store.create_task(ECHO)
    assert store.mark_submitting(task.id, attempt=1, now=5.0)
    failure = SubmissionFailure(attempt=0, maybe_started_at=None)
    assert store.defer_submission(task.id, until=50.0, logs=[], submission=failure)
    record = store.get_task(task.id)
    assert (record.submit_started_at, record.attempt, record.next_submit_at) == (None, 0, 50.0)
    # An sbatch that may have created its job stays in flight for recovery to look for it.
    assert store.mark_submitting(task.id, attempt=1, now=60.0)
    maybe = SubmissionFailure(attempt=0, maybe_started_at=30.0)
    assert store.defer_submission(task.id, until=90.0, logs=[], submission=maybe)
    record = store.get_task(task.id)
    assert (record.submit_started_at, record.attempt) == (30.0, 1)
    assert store.forget_submission(task.id, attempt=0)
    assert store.tasks_to_submit(now=100.0)[0].id == task.id


def test_a_lost_job_is_forgotten_so_the_task_is_submitted_again(store: Store):
    task = store.create_task(ECHO)
    store.mark_submitting(task.id, attempt=1, now=5.0)
    store.record_job(task.id, "7")
    assert store.apply_decision(task.id, job_id="7", resubmit=True)
    record = store.get_task(task.id)
    assert (record.state, record.job_id, record.submit_started_at) == ("QUEUED", None, None)
    assert not store.apply_decision(task.id, job_id="7")  # nothing to change


def test_minimal_get_returns_what_the_peewee_query_returned(store: Store):
    """get_task(full=False) runs a cached statement; it must agree with the query it replaced."""

    def by_peewee(task_id: str, owner: str | None) -> TaskRecord | None:
        query = TaskRow.select(TaskRow.seq, TaskRow.id, TaskRow.state).where(TaskRow.id == task_id)
        if owner is not None:
            query = query.where(TaskRow.owner == owner)
        row = query.first()
        return None if row is None else TaskRecord(seq=row.seq, id=row.id, state=row.state)

    mine = store.create_task(ECHO, owner="alice")
    anyone = store.create_task(ECHO)
    store.cancel_task(anyone.id)
    cases = [
        (mine.id, None), (mine.id, "alice"), (mine.id, "bob"), (anyone.id, None),
        (anyone.id, "alice"), ("no-such-task", None), ("no-such-task", "alice"), ("", None),
    ]  # fmt: skip
    for task_id, owner in cases:
        assert store.get_task(task_id, owner=owner, full=False) == by_peewee(task_id, owner)
    assert store.get_task(anyone.id, full=False).state == "CANCELED"
    assert store.get_task(mine.id, owner="bob", full=False) is None


def _open_and_create_tables(path: str, start: float) -> str | None:
    """In a process of its own: wait for `start`, open the store, create the tables."""
    while time.time() < start:
        pass
    try:
        Store.from_url(f"sqlite:///{path}").init_schema("test")
    except Exception as exc:  # the test reports what each process met
        return repr(exc)
    return None


def test_processes_opening_a_new_sqlite_database_at_once_all_succeed(tmp_path):
    # The API and the poller start together on a new state directory. Each switches the new
    # database to WAL when it connects; two switches at once made one answer "database is
    # locked" at once, and the API exited at its start.
    with multiprocessing.get_context("fork").Pool(3) as pool:
        for round_ in range(15):
            path = str(tmp_path / f"{round_}.db")
            start = time.time() + 0.05
            errors = pool.starmap(_open_and_create_tables, [(path, start)] * 3)
            assert errors == [None, None, None], f"round {round_}"
            assert Store.from_url(f"sqlite:///{path}").db.execute_sql(
                "PRAGMA journal_mode"
            ).fetchone() == ("wal",)
