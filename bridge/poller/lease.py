"""The poller's election on PostgreSQL: every login node runs a poller, and the one that holds
the lease row (`bridge.store.LEASE_TABLE`: holder, epoch, expiry) acts; the others wait.

- The lease lives in the server's clock: it is taken only where `expires_at` has passed by
  the server's `clock_timestamp()`, and every takeover raises the epoch. Hosts' clocks never
  meet.
- The leader renews it every `lease_seconds / 3` on a connection of its own (direct, not
  through a pooler: `poller.lease_database`), in a thread, so a long cycle never lets it lapse.
- The leader believes it leads until its own monotonic clock says the lease it last renewed
  has ended, less a safety margin, counted from before the renewal was sent: it always stops
  before the server lets another take over. Before each sbatch and scancel it checks that
  (`check`), and a lapsed lease makes it a standby.
- Every store write of the leader carries its epoch (`Store.fence_epoch`, see
  `Store.fenced`): a leader that was stopped, or cut off, and does not know it lost the lease
  has its writes refused once another took over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import psycopg2

from bridge.config import Config
from bridge.store import LEASE_NAME, LEASE_TABLE, NotLeader

log = logging.getLogger("bridge.poller")


class Renewal(Enum):
    RENEWED = "renewed"
    #: The lease moved on (another poller took over): this poller is a standby now.
    LOST = "lost"
    #: The server could not be asked: the lease lapses by itself unless a later try succeeds.
    UNKNOWN = "unknown"


def holder_name(config: Config) -> str:
    """This poller in the lease: its node and process (a restarted poller is a new holder)."""
    node = config.poller.node_name or socket.gethostname()
    return f"{node} (pid {os.getpid()})"


def lease_url(config: Config) -> str:
    return config.poller.lease_database or config.database_url


class Lease:
    """The lease as one poller holds it, on its own connection to PostgreSQL."""

    def __init__(
        self,
        url: str,
        *,
        holder: str,
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.holder = holder
        self.seconds = seconds
        #: Renewed (or, by a standby, tried) this often.
        self.period = seconds / 3
        #: The leader stops this long before the lease ends by its own clock: room for the
        #: two clocks' rates to differ and for an sbatch to be under way when it ends.
        self.margin = max(1.0, seconds / 5)
        self.clock = clock
        #: The epoch this poller last held (kept after the lease is lost: the store refuses it).
        self.epoch: int | None = None
        self._valid_until = float("-inf")
        self._lock = threading.Lock()
        self._conn: Any = None

    # ----------------------------------------------------------------------------- state
    def valid(self) -> bool:
        """This poller leads, by its own clock."""
        with self._lock:
            return self.clock() < self._valid_until

    def remaining(self) -> float:
        with self._lock:
            return self._valid_until - self.clock()

    def check(self) -> None:
        """Raises NotLeader unless this poller still leads: before each sbatch and scancel."""
        if not self.valid():
            raise NotLeader(f"the lease of epoch {self.epoch} has ended by this node's clock")

    # ----------------------------------------------------------------------------- the row
    def try_acquire(self) -> bool:
        """Take the lease if it has ended (by the server's clock); True when taken."""
        sent = self.clock()
        row = self._execute(
            f'UPDATE "{LEASE_TABLE}" SET "holder" = %s, "epoch" = "epoch" + 1, '
            '"acquired_at" = clock_timestamp(), "renewed_at" = clock_timestamp(), '
            "\"expires_at\" = clock_timestamp() + %s * interval '1 second' "
            'WHERE "name" = %s AND "expires_at" < clock_timestamp() RETURNING "epoch"',
            [self.holder, self.seconds, LEASE_NAME],
        )
        if not row:
            return False
        with self._lock:
            self.epoch = int(row[0])
            self._valid_until = sent + self.seconds - self.margin
        return True

    def renew(self) -> Renewal:
        """Extend the lease this poller holds; LOST when another took it over."""
        if self.epoch is None:
            return Renewal.LOST
        sql = (
            f'UPDATE "{LEASE_TABLE}" SET "renewed_at" = clock_timestamp(), '
            "\"expires_at\" = clock_timestamp() + %s * interval '1 second' "
            'WHERE "name" = %s AND "holder" = %s AND "epoch" = %s RETURNING "epoch"'
        )
        params = [self.seconds, LEASE_NAME, self.holder, self.epoch]
        sent = self.clock()
        try:
            try:
                row = self._execute(sql, params)
            except (psycopg2.OperationalError, psycopg2.InterfaceError):
                if self._conn is not None and not self._conn.closed:
                    raise  # an answer (a time-out), not a lost connection
                # A connection the server ended (a restart, pg_terminate_backend): once more
                # on a new one, before a renewal period is lost.
                self._disconnect()
                sent = self.clock()
                row = self._execute(sql, params)
        except psycopg2.Error as exc:
            log.warning("cannot renew the poller's lease: %s", " ".join(str(exc).split()))
            self._disconnect()
            return Renewal.UNKNOWN
        with self._lock:
            if not row:
                self._valid_until = float("-inf")
                return Renewal.LOST
            self._valid_until = max(self._valid_until, sent + self.seconds - self.margin)
        return Renewal.RENEWED

    def release(self) -> None:
        """End the lease now (a poller stopping): a standby takes over at its next try."""
        with self._lock:
            self._valid_until = float("-inf")
        if self.epoch is None:
            return
        try:
            self._execute(
                f'UPDATE "{LEASE_TABLE}" SET "expires_at" = clock_timestamp() '
                'WHERE "name" = %s AND "holder" = %s AND "epoch" = %s',
                [LEASE_NAME, self.holder, self.epoch],
            )
        except psycopg2.Error as exc:
            log.warning("cannot release the poller's lease: %s", " ".join(str(exc).split()))
        self._disconnect()

    def _execute(self, sql: str, params: list[Any]) -> tuple[Any, ...] | None:
        conn = self._connection()
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            row: tuple[Any, ...] | None = cursor.fetchone() if cursor.description else None
            return row

    def _connection(self) -> Any:
        if self._conn is None or self._conn.closed:
            timeout = max(1, int(self.period))
            conn = psycopg2.connect(
                self.url,
                connect_timeout=timeout,
                application_name="tes-bridge poller lease",
                keepalives=1,
                keepalives_idle=timeout,
                keepalives_interval=1,
                keepalives_count=3,
            )
            conn.autocommit = True
            with conn.cursor() as cursor:
                # A renewal that cannot be answered in a period is no renewal; a takeover
                # waits behind a leader's fenced write (FOR SHARE) no longer than that.
                cursor.execute(f"SET statement_timeout = {int(self.period * 1000)}")
                cursor.execute(f"SET lock_timeout = {int(self.period * 800)}")
            self._conn = conn
        return self._conn

    def _disconnect(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg2.Error):
                self._conn.close()
            self._conn = None

    def close(self) -> None:
        self._disconnect()


class LeaseKeeper(threading.Thread):
    """Renews the lease while this poller leads and tries to take it while it does not, every
    `lease.period`; `changed` is set whenever it gained or lost the lease."""

    def __init__(self, lease: Lease, stop: threading.Event, changed: threading.Event) -> None:
        super().__init__(name="poller-lease", daemon=True)
        self.lease = lease
        self.stop = stop
        self.changed = changed
        self._leading = False

    def run(self) -> None:
        while not self.stop.is_set():
            self.tick()
            self.stop.wait(self.lease.period)

    def tick(self) -> None:
        lease = self.lease
        try:
            if self._leading and lease.valid():
                if lease.renew() is Renewal.LOST:
                    log.warning("the poller's lease of epoch %s was taken over", lease.epoch)
            elif lease.try_acquire():
                log.info("this poller took the lease", extra={"epoch": lease.epoch})
        except psycopg2.Error as exc:
            log.warning("cannot reach the lease: %s", " ".join(str(exc).split()))
            lease._disconnect()
        except Exception:
            log.exception("the lease keeper failed; trying again")
        leading = lease.valid()
        if leading != self._leading:
            self._leading = leading
            self.changed.set()
