"""The poller's lease and the fencing of its writes, on a real PostgreSQL server.

Two `Lease`s stand for the pollers of two nodes; two `Store`s for their connections. A write
carrying a stale epoch must raise and change nothing, whether or not its poller knows.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import peewee
import psycopg2
import pytest

from bridge.config import Config, load_config
from bridge.core.naming import job_name
from bridge.core.tes import State
from bridge.poller import Poller
from bridge.poller.lease import Lease, LeaseKeeper, Renewal
from bridge.store import (
    LEASE_TABLE,
    FencedOut,
    JobDecision,
    NotLeader,
    Store,
    unavailable_reason,
)
from tests.conftest import _fresh_store
from tests.fakes.slurm import FakeSlurm
from tests.unit.test_poller import ECHO, FakeImages

pytestmark = pytest.mark.postgres


class Raw:
    """A plain connection beside the store's: what another node sees (peewee's models are
    bound to one database per process, so a second Store here would take them over)."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg2.connect(url)
        self.conn.autocommit = True

    def task(self, task_id: str) -> dict[str, object]:
        with self.conn.cursor() as cursor:
            cursor.execute(
                "SELECT state, job_id, submit_started_at, logs FROM tasks WHERE id = %s",
                [task_id],
            )
            state, job_id, started, logs = cursor.fetchone()
        return {"state": state, "job_id": job_id, "submit_started_at": started, "logs": logs}

    def expire(self) -> None:
        """The lease's end passes (the server's clock), as if its holder had died."""
        with self.conn.cursor() as cursor:
            cursor.execute(
                f"UPDATE \"{LEASE_TABLE}\" SET expires_at = clock_timestamp() - interval '1 s'"
            )


@pytest.fixture
def pg(postgres_url: str) -> Iterator[tuple[Store, Raw]]:
    """The store of one poller's process, and a plain connection beside it."""
    store = _fresh_store(postgres_url)
    raw = Raw(postgres_url)
    yield store, raw
    raw.conn.close()
    store.db.close()


def _lease(url: str, name: str, seconds: float = 3.0) -> Lease:
    return Lease(url, holder=name, seconds=seconds)


def test_one_lease_one_holder_and_each_takeover_raises_the_epoch(pg, postgres_url):
    a_store, raw = pg
    a, b = _lease(postgres_url, "a"), _lease(postgres_url, "b")
    try:
        assert a.try_acquire() and a.valid()
        assert not b.try_acquire() and not b.valid()
        first = a.epoch
        assert a.renew() is Renewal.RENEWED
        state = a_store.lease_state()
        assert state is not None and state.holder == "a" and state.epoch == first
        assert state.remaining is not None and 0 < state.remaining <= 3
        raw.expire()
        assert b.try_acquire() and b.epoch == first + 1
        # The old holder learns it at its next renewal, and leads no more.
        assert a.renew() is Renewal.LOST and not a.valid()
        with pytest.raises(NotLeader):
            a.check()
    finally:
        a.close()
        b.close()


def test_a_released_lease_is_taken_at_once(pg, postgres_url):
    a, b = _lease(postgres_url, "a"), _lease(postgres_url, "b")
    try:
        assert a.try_acquire()
        a.release()
        assert not a.valid()
        assert b.try_acquire()
    finally:
        a.close()
        b.close()


def test_the_leader_stops_before_the_server_lets_another_take_over(postgres_url, pg):
    """Its own clock, from before the renewal was sent, less the margin."""
    now = [1000.0]
    a = Lease(postgres_url, holder="a", seconds=10.0, clock=lambda: now[0])
    try:
        assert a.try_acquire()
        assert a.remaining() == pytest.approx(10.0 - a.margin)
        now[0] += 10.0 - a.margin - 0.01
        a.check()
        now[0] += 0.02
        with pytest.raises(NotLeader):
            a.check()
    finally:
        a.close()


def _queued(store: Store) -> str:
    return store.create_task(dict(ECHO)).id


def test_a_stale_epochs_write_raises_and_changes_nothing(pg, postgres_url):
    a_store, raw = pg
    a, b = _lease(postgres_url, "a"), _lease(postgres_url, "b")
    try:
        task_id = _queued(a_store)
        assert a.try_acquire()
        a_store.fence_epoch = a.epoch
        assert a_store.mark_submitting(task_id, attempt=1, now=1.0)
        # b takes over; a does not know (no renewal yet) and goes on writing.
        raw.expire()
        assert b.try_acquire()
        before = raw.task(task_id)
        stale_writes = [
            lambda: a_store.record_job(task_id, "42", logs=[{"logs": []}]),
            lambda: a_store.forget_submission(task_id, attempt=0),
            lambda: a_store.note(task_id, [{"system_logs": ["stale"]}]),
            lambda: a_store.fail(task_id, [{"system_logs": ["stale"]}]),
            lambda: a_store.apply_decisions([JobDecision(task_id, "42", state=State.RUNNING)]),
            lambda: a_store.finish_cancel(task_id),
            lambda: a_store.mark_cleaned(task_id),
            lambda: a_store.put_meta("capabilities", "{}"),
        ]
        for write in stale_writes:
            with pytest.raises(FencedOut):
                write()
        assert raw.task(task_id) == before
        a_store.fence_epoch = None
        assert a_store.meta("capabilities") is None
    finally:
        a.close()
        b.close()


def test_the_new_leader_writes_and_the_api_is_never_fenced(pg, postgres_url):
    a_store, raw = pg
    b = _lease(postgres_url, "b")
    try:
        task_id = _queued(a_store)
        assert b.try_acquire()
        a_store.fence_epoch = b.epoch
        assert a_store.mark_submitting(task_id, attempt=1, now=1.0)
        a_store.record_job(task_id, "43")
        a_store.fence_epoch = None  # the API's store
        assert a_store.cancel_task(task_id) is not None
        assert raw.task(task_id)["job_id"] == "43"
        assert raw.task(task_id)["state"] == "CANCELED"
    finally:
        b.close()


def test_a_takeover_waits_for_the_old_leaders_open_write_which_then_counts(pg, postgres_url):
    """FOR SHARE against the takeover's UPDATE: the write either commits before the epoch
    moves (and the new leader sees it) or reads the new epoch and fails."""
    a_store, raw = pg
    a, b = _lease(postgres_url, "a"), _lease(postgres_url, "b")
    try:
        task_id = _queued(a_store)
        assert a.try_acquire()
        a_store.fence_epoch = a.epoch
        raw.expire()
        with a_store.fenced():
            a_store.mark_submitting(task_id, attempt=1, now=1.0)
            # The takeover cannot pass the open transaction (lock_timeout: a period).
            with pytest.raises(psycopg2.OperationalError):
                b.try_acquire()
            b.close()
        assert b.try_acquire()
        assert raw.task(task_id)["submit_started_at"] == 1.0
        with pytest.raises(FencedOut):
            a_store.record_job(task_id, "7")
    finally:
        a.close()
        b.close()


def test_a_stopped_leaders_open_transaction_is_ended_by_the_server(pg, postgres_url):
    """A leader frozen inside a fenced transaction would hold off every takeover: the server
    ends its session once it sits idle for fence_idle_timeout, and its write is lost."""
    a_store, raw = pg
    a, b = _lease(postgres_url, "a"), _lease(postgres_url, "b")
    try:
        task_id = _queued(a_store)
        assert a.try_acquire()
        a_store.fence_epoch = a.epoch
        a_store.fence_idle_timeout = 0.5
        raw.expire()
        with pytest.raises((psycopg2.Error, peewee.PeeweeException)), a_store.fenced():
            a_store.mark_submitting(task_id, attempt=1, now=1.0)
            time.sleep(1.5)  # "stopped"
            a_store.note(task_id, [])  # the server ended the session meanwhile
        assert b.try_acquire()
        assert raw.task(task_id)["submit_started_at"] is None
    finally:
        a.close()
        b.close()


def test_not_leader_passes_like_an_unavailable_database():
    assert unavailable_reason(FencedOut("epoch 1 refused"))
    assert unavailable_reason(NotLeader("lease ended"))


def test_a_lease_check_before_sbatch_leaves_the_task_to_recovery(tmp_path: Path, pg):
    """A poller whose lease ended by its own clock submits nothing and fails nothing: the
    task keeps its submission in flight, for the next leader's recovery by job name."""
    a_store, _raw = pg
    config: Config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    slurm = FakeSlurm()
    poller = Poller(config, a_store, slurm_client=slurm, images=FakeImages())

    def lost() -> None:
        raise NotLeader("the lease has ended by this node's clock")

    poller.ctx.check_lease = lost
    task_id = _queued(a_store)
    poller.submit_new()
    assert "sbatch" not in slurm.calls
    task = a_store.get_task(task_id)
    assert task is not None and task.state == "QUEUED" and task.job_id is None
    assert task.submit_started_at is not None


def test_a_new_leader_forgets_no_submission_before_the_settle_time_after_takeover(
    tmp_path: Path, pg
):
    """Whatever the old node's clock wrote into submit_started_at (here: long ago)."""
    a_store, _raw = pg
    config: Config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    now = [10_000.0]
    slurm = FakeSlurm()
    poller = Poller(config, a_store, slurm_client=slurm, images=FakeImages(), clock=lambda: now[0])
    task_id = _queued(a_store)
    assert a_store.mark_submitting(task_id, attempt=1, now=1.0)  # a skewed old clock
    poller.recovery.hold_after_takeover()
    poller.cycle()
    task = a_store.get_task(task_id)
    assert task is not None and task.submit_started_at == 1.0 and "sbatch" not in slurm.calls
    now[0] += config.slurm.command_timeout + config.slurm.submit_settle + 1
    config.work_dir.mkdir(parents=True)  # where the old node wrote the task's directory
    poller.cycle()  # no job of its name: the directory is fenced
    assert "sbatch" not in slurm.calls
    poller.cycle()  # still none: forgotten, and submitted again
    task = a_store.get_task(task_id)
    assert task is not None and task.job_id is not None and slurm.calls.count("sbatch") == 1


@pytest.fixture
def led_by_b(pg, postgres_url: str) -> Iterator[tuple[Store, int]]:
    """The poller process's store fenced at the epoch of a lease node "b" holds."""
    a_store, _raw = pg
    b = _lease(postgres_url, "b")
    try:
        assert b.try_acquire() and b.epoch is not None
        a_store.fence_epoch = b.epoch
        yield a_store, b.epoch
    finally:
        a_store.fence_epoch = None
        b.release()
        b.close()


def test_a_new_leader_fences_a_task_it_finds_no_job_for_looks_again_and_submits_with_its_epoch(
    tmp_path: Path, led_by_b
):
    """The old leader marked the task and may still run its sbatch (frozen after its lease
    check): the new leader, finding no job once the sbatch has settled, fences the task's
    directory at its epoch, looks again, and only then submits, the job carrying its epoch. A
    job the old leader submits after that fence stands down at its start
    (tests/unit/test_job_side.py)."""
    a_store, epoch = led_by_b
    config: Config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    now = [10_000.0]
    slurm = FakeSlurm()
    poller = Poller(config, a_store, slurm_client=slurm, images=FakeImages(), clock=lambda: now[0])
    config.work_dir.mkdir(parents=True)
    task_id = _queued(a_store)
    assert a_store.mark_submitting(task_id, attempt=1, now=1.0)
    poller.recovery.hold_after_takeover()
    fence = poller.task_dir(task_id) / "lease-fence"
    poller.cycle()  # the old leader's sbatch may not have settled: no fence, no sbatch yet
    assert not fence.exists() and "sbatch" not in slurm.calls
    now[0] += config.slurm.command_timeout + config.slurm.submit_settle + 1
    poller.cycle()  # no job: fenced, to be looked for once more
    assert fence.read_text() == f"{epoch}\n" and "sbatch" not in slurm.calls
    assert slurm.calls.count("find") == 2
    poller.cycle()  # fenced before a look that found none: forgotten, submitted again
    assert slurm.calls.count("find") == 3 and slurm.calls.count("sbatch") == 1
    assert slurm.script_args == [[f"lease-epoch={epoch}"]]


def test_a_new_leader_adopts_the_old_leaders_job_unfenced(tmp_path: Path, led_by_b):
    """The old leader's sbatch created the job but it died before storing its id: the new
    leader takes that job as the task's, and fences nothing (the job would stand down at its
    start and be submitted again)."""
    a_store, _epoch = led_by_b
    config: Config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    slurm = FakeSlurm()
    poller = Poller(config, a_store, slurm_client=slurm, images=FakeImages())
    config.work_dir.mkdir(parents=True)
    task_id = _queued(a_store)
    assert a_store.mark_submitting(task_id, attempt=1, now=1.0)  # long settled
    old_job = slurm.submit(Path(__file__), job_name=job_name(task_id))
    poller.recovery.hold_after_takeover()
    poller.cycle()
    task = a_store.get_task(task_id)
    assert task is not None and task.job_id == old_job
    assert not (poller.task_dir(task_id) / "lease-fence").exists()
    assert slurm.calls.count("sbatch") == 1  # the old leader's


def test_an_interrupted_task_whose_fence_cannot_be_written_is_not_submitted_again(
    tmp_path: Path, led_by_b
):
    """Without its fence, a job the old leader submits late would run beside the new one: the
    task waits (QUEUED, its submission in flight) until the fence is written."""
    a_store, epoch = led_by_b
    config: Config = load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")})
    slurm = FakeSlurm()
    poller = Poller(config, a_store, slurm_client=slurm, images=FakeImages())
    task_id = _queued(a_store)
    assert a_store.mark_submitting(task_id, attempt=1, now=1.0)  # long settled
    task_dir = poller.task_dir(task_id)
    task_dir.parent.mkdir(parents=True, exist_ok=True)
    task_dir.write_text("")  # a file in the directory's place: the fence cannot be written
    poller.cycle()
    task = a_store.get_task(task_id)
    assert task is not None and task.submit_started_at == 1.0 and task.job_id is None
    assert "sbatch" not in slurm.calls
    task_dir.unlink()
    poller.cycle()  # fenced now: forgotten, and submitted again next
    poller.cycle()
    assert (task_dir / "lease-fence").read_text() == f"{epoch}\n"
    task = a_store.get_task(task_id)
    assert task is not None and task.job_id is not None
    assert slurm.calls.count("sbatch") == 1


def test_the_keeper_renews_and_says_when_leadership_changed(pg, postgres_url):
    _a_store, raw = pg
    a, b = _lease(postgres_url, "a"), _lease(postgres_url, "b")
    stop, changed = threading.Event(), threading.Event()
    keeper = LeaseKeeper(a, stop, changed)
    try:
        keeper.tick()
        assert changed.is_set() and a.valid()
        changed.clear()
        keeper.tick()  # a renewal
        assert not changed.is_set() and a.valid()
        raw.expire()
        assert b.try_acquire()
        keeper.tick()
        assert changed.is_set() and not a.valid()
    finally:
        a.close()
        b.close()


def test_check_says_who_leads_and_wants_the_heartbeat_of_a_leader_here(
    pg, postgres_url, tmp_path: Path
):
    from bridge.cli.check import Account, Failed, StoreChecks

    _, raw = pg
    environ = {"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")}
    config = load_config(environ={**environ, "TES_BRIDGE_DATABASE": postgres_url})
    checks = StoreChecks(config, Account.of(os.geteuid()))
    with pytest.raises(Failed, match="no poller has led yet"):
        checks.poller()
    a = _lease(postgres_url, "login1 (pid 7)")
    try:
        assert a.try_acquire()
        # Another node leads: its heartbeat is in that node's metrics, not read here.
        message = checks.poller()
        assert message.startswith(f"login1 (pid 7) leads (epoch {a.epoch}), renewed 0.")
        assert "cycle" not in message
        raw.expire()
        with pytest.raises(Failed, match="no poller leads"):
            checks.poller()
    finally:
        a.close()
    here = _lease(postgres_url, f"{socket.gethostname()} (pid 8)")
    try:
        assert here.try_acquire()
        # This node leads, and no cycle of its poller is recorded in its state directory.
        with pytest.raises(Failed, match="the poller runs but has not ended a cycle"):
            checks.poller()
    finally:
        here.close()
