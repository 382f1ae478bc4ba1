"""The poller process: one lock per state directory, the collaborators wired together, and
the loop of cycles with quick checks between them."""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import pwd
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bridge.config import Config
from bridge.core.tes import TERMINAL_STATES
from bridge.images.cache import ImageCache
from bridge.job.layout import TaskLayout
from bridge.poller.cancel import Canceller
from bridge.poller.capabilities import CapabilitiesReader
from bridge.poller.cleanup import Cleaner
from bridge.poller.context import CycleStats, ImageSource, PollerContext
from bridge.poller.estimate import StartEstimates
from bridge.poller.follow import Follower
from bridge.poller.owners import OwnerRunner
from bridge.poller.recover import Recovery
from bridge.poller.submit import Submitter
from bridge.slurm import SlurmBackend, SlurmClient
from bridge.store import POLLER_LOCK, SQLITE_ONE_NODE, Store, unavailable_reason
from bridge.system import metrics
from bridge.system.budget import CallBudget
from bridge.system.relay import Handler, RelayServer
from bridge.system.wake import WakeReceiver

if TYPE_CHECKING:
    from bridge.poller.lease import Lease

log = logging.getLogger("bridge.poller")

#: Between full cycles the poller looks this often for new tasks (one cheap query) and for
#: jobs that recorded their outcome (one stat each; their tasks are decided from the records),
#: so neither waits for the next cycle; squeue and sacct keep the pace of `slurm.poll_interval`.
QUICK_CHECK_INTERVAL = 0.1
#: Finished jobs are looked for between cycles only while at most this many are active.
QUICK_CHECK_MAX_JOBS = 64
#: A poller that starts (or takes over) counts the jobs of tasks decided this recently as
#: still in Slurm until its squeue says otherwise: jobs_leaving lives in memory, and a job
#: decided from its records may still be ending (admission control).
LEAVING_LOOKBACK_SECONDS = 120.0


class Poller:
    """One cycle: recover interrupted submissions, submit, follow jobs, carry out cancels,
    and now and then clean up (see the package doc)."""

    def __init__(
        self,
        config: Config,
        store: Store,
        *,
        slurm_client: SlurmBackend,
        images: ImageSource,
        clock: Callable[[], float] = time.time,
    ):
        self.ctx = PollerContext(config, store, slurm_client, clock)
        self.config = config
        self.store = store
        #: Site mode: every task runs as its owner (sudo -n -u OWNER, deploy/sudoers.tes-bridge).
        self.owners = OwnerRunner(config) if config.site.run_as_owner else None
        self.recovery = Recovery(self.ctx, self.owners)
        self.follower = Follower(self.ctx, self.owners)
        self.canceller = Canceller(self.ctx, self.follower.await_canceled)
        self.submitter = Submitter(self.ctx, images, self.owners, self.canceller)
        self.recovery.resume_chain = self.submitter.sbatch.chain.resume
        self.recovery.resume_arrays = self.submitter.sbatch.staged.resume
        self.capabilities = CapabilitiesReader(self.ctx)
        self.cleaner = Cleaner(self.ctx, images, self.owners)
        #: The newest task seen by a cycle or a quick check.
        self._newest_seq: int | None = None
        #: (task id, job id) of the jobs still active after the last cycle.
        self._active_jobs: list[tuple[str, str]] = []
        #: Tasks with a cancel to carry out, as of the last cycle (see quick_check).
        self._cancels_seen = 0
        #: (task id, job id) of the active jobs the last quick check found an outcome of.
        self._recorded: list[tuple[str, str]] = []
        #: Whether this poller has counted the jobs of tasks decided before it acted.
        self._leaving_counted = False

    @property
    def clock(self) -> Callable[[], float]:
        return self.ctx.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.ctx.clock = clock

    def task_dir(self, task_id: str) -> Path:
        return self.ctx.task_dir(task_id)

    def cycle(self) -> CycleStats:
        started = time.perf_counter()
        stats = CycleStats()
        with self.store.db.connection_context():
            self._newest_seq = self.store.newest_seq()
            if not self._leaving_counted:
                self._count_jobs_of_recently_decided_tasks()
            self.recovery.recover(stats)
            self.submitter.submit_queued(stats)
            in_flight = self.store.tasks_in_flight(with_document=False)
            active = [t for t in in_flight if t.job_id and t.state not in TERMINAL_STATES]
            leaving = len(self.ctx.jobs_leaving)
            self.follower.follow(active, stats)
            finished = self.follower.finished
            if self.submitter.held_by_admission and (
                finished or len(self.ctx.jobs_leaving) < leaving
            ):
                # Jobs ended or left Slurm: the tasks admission held back take their slots
                # now, not a poll interval later.
                self.submitter.submit_queued(stats)
            self._active_jobs = [
                (t.id, t.job_id) for t in active if t.job_id and t.id not in finished
            ]
            self.canceller.carry_out([t for t in in_flight if t.cancel_pending], stats)
            self._cancels_seen = self.store.cancels_pending()
            self.cleaner.maybe_clean()
            self.capabilities.maybe_refresh()
        stats.seconds = time.perf_counter() - started
        return stats

    def _count_jobs_of_recently_decided_tasks(self) -> None:
        """Once, before this poller's first submissions: the jobs of tasks an earlier poller
        decided shortly before may still be ending. They count for admission until this
        cycle's squeue lists them no more (JobWatch drops them)."""
        self._leaving_counted = True
        if not self.ctx.admission_control:
            return
        since = self.clock() - LEAVING_LOOKBACK_SECONDS
        for task in self.store.decided_since(since):
            self.follower.watch.note_leaving(task)

    def quick_check(self) -> str | None:
        """Between cycles: "submit" when a task arrived or tasks held back to gather into an
        array may go, "finish" when jobs seen running recorded their outcome (finish_recorded),
        "cycle" when a cancel arrived or a job seen waiting recorded its outcome, else None.
        Costs one query and a few stats; no Slurm command."""
        with self.store.db.connection_context():
            newest = self.store.newest_seq()
            cancels = self.store.cancels_pending()
        if newest != self._newest_seq:
            self._newest_seq = newest
            return "submit"
        gather_until = self.submitter.arrays.gather_until
        if gather_until is not None and self.clock() >= gather_until:
            return "submit"
        if cancels > self._cancels_seen:
            return "cycle"  # a cancel arrived: its job is scanceled now, not a cycle later
        if len(self._active_jobs) <= QUICK_CHECK_MAX_JOBS:
            recorded = [job for job in self._active_jobs if self._outcome_recorded(*job)]
            if not recorded:
                return None
            # A job the last cycle saw only waiting ran and ended since: the cycle's squeue
            # and sacct say where, which its task's log names from the start.
            if all(self.follower.watch.seen_started(job_id) for _, job_id in recorded):
                self._recorded = recorded
                return "finish"
            return "cycle"
        return None

    def _outcome_recorded(self, task_id: str, job_id: str) -> bool:
        try:
            outcome = TaskLayout(self.task_dir(task_id)).records_dir(job_id) / "outcome"
            return outcome.exists()  # False too where site mode keeps records private
        except (OSError, ValueError):
            return False

    def finish_recorded(self) -> CycleStats:
        """Decide the tasks whose job recorded its outcome (see quick_check) from their records
        alone, without waiting for the next cycle's squeue: the outcome decides the state
        whatever Slurm says yet. Slurm's final facts of the job follow from the next cycles."""
        stats = CycleStats()
        recorded, self._recorded = self._recorded, []
        # The next cycle watches again whatever this leaves undecided.
        self._active_jobs = [job for job in self._active_jobs if job not in recorded]
        with self.store.db.connection_context():
            self.follower.finish_recorded(recorded, stats)
            if stats.updated:  # admission control may have held tasks back for their slots
                self.submitter.submit_queued(stats)
        return stats

    def submit_new(self) -> CycleStats:
        """Submit what is QUEUED now, without polling Slurm (see quick_check)."""
        stats = CycleStats()
        with self.store.db.connection_context():
            self.submitter.submit_queued(stats)
        return stats


class PollerLock:
    """SQLite: an exclusive lock file, so a second poller on the same state directory refuses
    to start (one node only; PostgreSQL elects a leader with a lease instead)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True


def slurm_client(config: Config) -> SlurmClient:
    cfg = config.slurm
    return SlurmClient(
        sbatch=cfg.sbatch,
        squeue=cfg.squeue,
        sacct=cfg.sacct,
        scancel=cfg.scancel,
        sinfo=cfg.sinfo,
        scontrol=cfg.scontrol,
        timeout=cfg.command_timeout,
        budget=CallBudget(cfg.calls_per_second, cfg.calls_burst),
        sudo=config.site.sudo,
        # Outside site mode every job is the service account's own (site mode: its owner's).
        queue_user=None if config.site.run_as_owner else pwd.getpwuid(os.geteuid()).pw_name,
    )


def image_cache(config: Config, *, wake: Callable[[], None] | None = None) -> ImageCache:
    return ImageCache(
        config,
        max_workers=config.container.pull_workers,
        failure_ttl=config.container.pull_failure_ttl,
        on_pulled=wake,
    )


def build_poller(config: Config, store: Store, *, wake: Callable[[], None] | None = None) -> Poller:
    return Poller(
        config, store, slurm_client=slurm_client(config), images=image_cache(config, wake=wake)
    )


@dataclass
class _Signals:
    """What stops or hurries the loop."""

    stop: threading.Event = field(default_factory=threading.Event)
    #: Set by a finished image pull (or a stop request): the next cycle starts at once.
    wake: threading.Event = field(default_factory=threading.Event)
    #: Set by an API worker's nudge (bridge.system.wake), and with `wake`: look now, not in
    #: 0.1 s. A standby's API nudges its own poller only: the leader's quick check (0.1 s)
    #: sees the new task all the same.
    nudge: threading.Event = field(default_factory=threading.Event)

    def wake_now(self) -> None:
        self.wake.set()
        self.nudge.set()

    def request_stop(self, *_: object) -> None:
        self.stop.set()
        self.wake_now()


def relay_handler(config: Config, store: Store, client: SlurmBackend) -> Handler:
    """What answers the API's questions over bridge.system.relay, by their `kind`."""
    owners = OwnerRunner(config) if config.site.run_as_owner else None
    estimates = StartEstimates(PollerContext(config, store, client), owners)

    def answer(request: dict[str, Any]) -> dict[str, Any]:
        kind = request.get("kind", "output")  # an API from before kinds asks for output
        if kind == "test-only":
            return estimates.answer(request)
        if kind == "output" and owners is not None:
            return owners.read_output(request)
        return {"error": "bad-request", "message": f"the poller does not answer {kind!r} here"}

    return answer


def run_poller(config: Config, *, once: bool = False) -> int:
    store = Store.from_url(config.database_url)
    lock: PollerLock | None = None
    if store.is_sqlite:
        lock = PollerLock(config.state_dir / POLLER_LOCK)
        if not lock.acquire():
            log.error("another poller already runs for %s; exiting", config.state_dir)
            return 1
        log.warning(SQLITE_ONE_NODE)
    signals = _Signals()
    images = image_cache(config, wake=signals.wake_now)
    client = slurm_client(config)

    def make_poller() -> Poller:
        return Poller(config, store, slurm_client=client, images=images)

    receiver = WakeReceiver(config.state_dir, signals.nudge)
    # The API's questions: start estimates (sbatch --test-only) and, in site mode, the live
    # output read as the owner here, where sudo is allowed. A standby answers too: neither
    # writes anything.
    relay = RelayServer(config.state_dir, relay_handler(config, store, client))
    if not once:
        receiver.start()
        relay.start()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signals.request_stop)
    log.info("poller started", extra={"work_dir": str(config.work_dir)})
    # The Slurm release, said once in the log (a warning for one the bridge is not tested
    # with); with Slurm away, read again when a command first needs it.
    client.release()
    try:
        if lock is not None:
            metrics.POLLER_LEADER.set(1)
            _lead(make_poller(), config, signals, once=once)
        else:
            _elected(config, store, make_poller, signals, once=once)
    finally:
        metrics.POLLER_LEADER.set(0)
        receiver.close()
        relay.close()
    log.info("poller stopped")
    return 0


def _elected(
    config: Config,
    store: Store,
    make_poller: Callable[[], Poller],
    signals: _Signals,
    *,
    once: bool,
) -> None:
    """PostgreSQL: wait as a standby until this poller takes the lease, lead while it holds
    it (writes fenced by its epoch), and wait again once it lost it (bridge.poller.lease)."""
    # Imported here: psycopg2 is the PostgreSQL extra's, absent from an SQLite-only install.
    from bridge.poller.lease import Lease, LeaseKeeper, holder_name, lease_url

    seconds = config.poller.lease_seconds
    lease = Lease(lease_url(config), holder=holder_name(config), seconds=seconds)
    # A fenced transaction idle this long (its poller stopped) is ended by the server, so it
    # cannot hold off a takeover.
    store.fence_idle_timeout = lease.period
    changed = threading.Event()
    keeper = LeaseKeeper(lease, signals.stop, changed)
    log.info("poller waits for the lease", extra={"holder": lease.holder})
    keeper.start()
    # --once: one cycle if this poller takes the lease within a lease's time (a new lease).
    give_up = time.monotonic() + seconds + lease.period if once else float("inf")
    try:
        while not signals.stop.is_set():
            if not lease.valid():
                metrics.POLLER_LEADER.set(0)
                if time.monotonic() > give_up:
                    log.warning("another poller leads; --once ran no cycle")
                    break
                changed.wait(lease.period)
                changed.clear()
                continue
            epoch = lease.epoch
            store.fence_epoch = epoch
            metrics.POLLER_LEADER.set(1)
            metrics.POLLER_TAKEOVERS.inc()
            log.info("this poller leads", extra={"epoch": epoch, "holder": lease.holder})
            # A fresh poller: nothing it knew before (a lost lease) may still be true.
            poller = make_poller()
            poller.ctx.check_lease = lease.check
            # The old leader's submissions are resolved first, by job name (recover).
            poller.recovery.hold_after_takeover()
            leading = functools.partial(_holds, lease, epoch)
            _lead(poller, config, signals, once=once, leading=leading)
            if once:
                break
            if not signals.stop.is_set():
                metrics.POLLER_LEADER.set(0)
                log.warning("this poller lost the lease of epoch %s; standby", epoch)
    finally:
        signals.stop.set()
        keeper.join(timeout=lease.period + 1)
        lease.release()
        lease.close()


def _holds(lease: Lease, epoch: int | None) -> bool:
    return lease.valid() and lease.epoch == epoch


def _lead(
    poller: Poller,
    config: Config,
    signals: _Signals,
    *,
    once: bool,
    leading: Callable[[], bool] = lambda: True,
) -> None:
    while not signals.stop.is_set() and leading():
        signals.wake.clear()
        _run_cycle(poller, config.work_dir)
        if once:
            break
        interval = config.slurm.poll_interval
        _between_cycles(poller, interval, signals.stop, signals.wake, signals.nudge, leading)


def _run_cycle(poller: Poller, work_dir: Path) -> None:
    try:
        stats = poller.cycle()
        metrics.observe_poller_cycle(stats.seconds, time.time(), work_dir)
        if stats.submitted or stats.updated or stats.canceled:
            log.info("poll cycle", extra=stats.__dict__)
    except Exception as exc:
        reason = unavailable_reason(exc)
        if reason:
            log.error("poll cycle failed: %s; trying again", reason)
        else:
            log.exception("poll cycle failed; trying again")


def _between_cycles(
    poller: Poller,
    interval: float,
    stop: threading.Event,
    wake: threading.Event,
    nudge: threading.Event,
    leading: Callable[[], bool] = lambda: True,
) -> None:
    """Quick checks until the next cycle is due, a wake-up, a cancel or the end of the lease:
    every QUICK_CHECK_INTERVAL, and at once when nudged."""
    deadline = time.monotonic() + interval
    while not stop.is_set() and leading():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        nudge.wait(min(QUICK_CHECK_INTERVAL, remaining))
        nudge.clear()
        if wake.is_set():
            return
        try:
            what = poller.quick_check()
            if what == "cycle":
                return
            if what == "submit":
                poller.submit_new()
            elif what == "finish":
                stats = poller.finish_recorded()
                if stats.updated:
                    log.info("decided from the jobs' records", extra=stats.__dict__)
        except Exception:
            log.exception("quick check failed; the next cycle will do its work")
