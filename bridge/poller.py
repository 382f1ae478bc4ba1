"""The poller: the one process that talks to Slurm.

Each cycle it
1. finds again the jobs of submissions that were interrupted (a crash between `sbatch` and the
   database write, or an `sbatch` that failed without an answer) by their job name, so a task
   is never submitted twice;
2. submits QUEUED tasks whose images are in the cache (pulls run in the background);
3. asks Slurm about every active job with one `squeue` call, and one `sacct` call for the jobs
   that left the queue, reads each job's own records, and moves tasks to their TES state;
4. carries out cancels recorded by the API (one `scancel` for all of them);
5. now and then removes old task directories.

Run exactly one poller per store: it holds a lock file in the state directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bridge import slurm
from bridge.auth import UserMap
from bridge.config import Config
from bridge.images import ImageCache, ImagePullError
from bridge.job.layout import TaskLayout
from bridge.job.owner import records_from_json
from bridge.job.records import JobRecords, read_records
from bridge.render import RenderError, prepare_task_dir, task_files
from bridge.slurm import JobInfo, SlurmClient, SlurmError, SlurmRejected, TmpDisk
from bridge.store import Store, TaskRecord
from bridge.tes import TERMINAL_STATES, State, format_time

log = logging.getLogger("bridge.poller")

#: How long a job may be unknown to both squeue and sacct before the task is failed
#: (slurmdbd can lag behind slurmctld for a moment after a job ends).
MISSING_JOB_GRACE = 120.0
#: Submissions per cycle, so that polling stays regular when thousands of tasks arrive at once.
MAX_SUBMISSIONS_PER_CYCLE = 500
CLEANUP_INTERVAL = 600.0
#: How ImageCache.problem() lines start (replaced while the trouble lasts, dropped after).
IMAGE_NOTE = "pulling image "
#: Between full cycles the poller looks this often for new tasks (one cheap query) and for
#: jobs that recorded their outcome (one stat each), so neither waits for the next cycle;
#: squeue and sacct keep the pace of `slurm.poll_interval`.
QUICK_CHECK_INTERVAL = 0.2
#: Finished jobs are looked for between cycles only while at most this many are active.
QUICK_CHECK_MAX_JOBS = 64

#: A finished task's Slurm facts (final state, node, elapsed, MaxRSS) come from sacct; when the
#: job recorded its outcome before slurmdbd had its final record, they are read again on the
#: following cycles, for at most this long.
FINAL_FACTS_GRACE = 300.0
#: After the job's final record, how long its MaxRSS is waited for.
FINAL_RSS_WAIT = 15.0
#: Errors while preparing a task directory that pass by themselves (a full or over-quota
#: filesystem, a file server away): the task waits in QUEUED and is tried again with back-off.
TRANSIENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM, errno.EMFILE,
     errno.ENFILE, errno.EAGAIN, errno.ESTALE, errno.ETIMEDOUT, errno.EBUSY}
)  # fmt: skip
#: system_logs lines that describe a passing condition. A task has at most one: a new one
#: replaces the last, and it goes when the task moves on (a finished task never says
#: "pending").
_CONDITION = re.compile(
    r"^(Slurm job \S+ is (pending|suspended|stopped)\b|cannot reach Slurm to submit|waiting: )"
)

#: sbatch errors that mean it never reached slurmctld, so no job was created.
_NEVER_CONNECTED = re.compile(
    r"Unable to contact slurm controller|Connection refused|Munge encode failed", re.I
)

OUTCOME_STATES = {
    "complete": State.COMPLETE,
    "executor_error": State.EXECUTOR_ERROR,
    "system_error": State.SYSTEM_ERROR,
}


def job_name(task_id: str) -> str:
    return f"tes-{task_id}"


@dataclass
class CycleStats:
    submitted: int = 0
    updated: int = 0
    canceled: int = 0
    slurm_calls: int = 0
    seconds: float = 0.0


@dataclass
class Decision:
    state: State
    messages: list[str] = field(default_factory=list)
    #: The job was lost through no fault of the task: submit it again.
    retry: bool = False
    #: The job must be canceled (it can never start).
    cancel_job: bool = False
    #: What the task waits for now (replaces the last such line; None clears it).
    condition: str | None = None


def decide(
    *,
    job: JobInfo | None,
    records: JobRecords,
    attempt: int,
    retries: int,
    current: State,
) -> Decision:
    """The TES state of a task from what Slurm says of its job and what the job recorded."""
    if records.outcome is not None:
        # The script writes its outcome last: the task is done, whatever Slurm says yet.
        return Decision(OUTCOME_STATES[records.outcome])
    if job is None:
        return Decision(current)
    if not job.ended:
        return _decide_active(job, records, current)
    # The job ended without recording an outcome: the script itself was stopped.
    ended = f"Slurm job {job.job_id} ended in state {job.state}"
    if job.exit_code is not None:
        ended += f" (exit code {job.exit_code}" + (f", signal {job.signal})" if job.signal else ")")
    in_executor = bool(records.phase and records.phase.startswith("running"))
    if job.state in slurm.RETRYABLE_STATES:
        if attempt <= retries:
            return Decision(State.QUEUED, [f"{ended}; submitting it again"], retry=True)
        return Decision(State.SYSTEM_ERROR, [f"{ended}; no retries left ({retries})"])
    if job.state == "CANCELLED":
        return Decision(State.CANCELED, [f"{ended}: canceled outside tes-bridge"])
    if job.state in ("TIMEOUT", "OUT_OF_MEMORY"):
        why = "reached its time limit" if job.state == "TIMEOUT" else "ran out of memory"
        # An executor that runs too long or too big is the task's failure; staging is not.
        state = State.EXECUTOR_ERROR if in_executor else State.SYSTEM_ERROR
        return Decision(state, [f"{ended}: the job {why}"])
    return Decision(State.SYSTEM_ERROR, [f"{ended} without recording an outcome"])


def _decide_active(job: JobInfo, records: JobRecords, current: State) -> Decision:
    tes_state = job.tes_state
    if tes_state == State.QUEUED.value:
        if job.reason in slurm.HOPELESS_PENDING_REASONS:
            return Decision(
                State.SYSTEM_ERROR,
                [f"Slurm job {job.job_id} can never start ({job.reason}); it was canceled"],
                cancel_job=True,
            )
        reason = f"Slurm job {job.job_id} is pending ({job.reason})" if job.reason else None
        return Decision(State.QUEUED, condition=reason)
    if tes_state == State.PAUSED.value:
        return Decision(State.PAUSED, condition=f"Slurm job {job.job_id} is {job.state.lower()}")
    if tes_state in (State.INITIALIZING.value, State.RUNNING.value):
        if records.phase and (records.phase.startswith("running") or records.phase == "uploading"):
            return Decision(State.RUNNING)
        return Decision(State.INITIALIZING)
    return Decision(current)  # a state we do not know: keep what we had (slurm.py warns)


def _attempt_log(logs: list[dict[str, Any]], attempt: int) -> dict[str, Any]:
    """The `logs` entry of an attempt (1-based), created with its required lists."""
    while len(logs) < attempt:
        logs.append({"logs": [], "outputs": []})
    return logs[attempt - 1]


def _add_system_logs(entry: dict[str, Any], lines: list[str]) -> None:
    if not any(lines):
        return
    existing = entry.setdefault("system_logs", [])
    for line in lines:
        if line and line not in existing:
            existing.append(line)


def set_condition(entry: dict[str, Any], line: str | None) -> None:
    """Make `line` the attempt's one condition line (see _CONDITION); None removes it."""
    existing = entry.get("system_logs")
    kept = [x for x in existing or [] if not _CONDITION.match(x)]
    if line:
        kept.append(line)
    if kept or existing is not None:
        entry["system_logs"] = kept


def _slurm_facts(metadata: dict[str, Any], job: JobInfo) -> None:
    for key, value in (
        ("slurm_state", job.state),
        ("slurm_node", job.node),
        ("slurm_partition", job.partition),
        ("slurm_elapsed_seconds", job.elapsed_seconds),
        ("slurm_max_rss_bytes", job.max_rss_bytes),
    ):
        if value not in (None, ""):
            metadata[key] = str(value)


def _fill_attempt_log(
    entry: dict[str, Any], records: JobRecords, job: JobInfo | None, *, final: bool
) -> None:
    """Executor logs, outputs and metadata of one attempt, from its records and sacct."""
    start = records.start_time or (job.start_time if job else None)
    if start:
        entry["start_time"] = format_time(start)
    end = records.end_time or (job.end_time if job else None)
    if final and end:
        entry["end_time"] = format_time(end)
    executor_logs = []
    for executor in records.executors:
        # TES requires an integer exit_code on every executor log: a running one is not listed.
        if executor.exit_code is None:
            continue
        item: dict[str, Any] = {"exit_code": executor.exit_code}
        if executor.start_time:
            item["start_time"] = format_time(executor.start_time)
        if executor.end_time:
            item["end_time"] = format_time(executor.end_time)
        item["stdout"] = executor.stdout
        item["stderr"] = executor.stderr
        executor_logs.append(item)
    entry["logs"] = executor_logs
    entry["outputs"] = list(records.outputs)
    _add_system_logs(entry, records.system_logs)
    metadata = entry.setdefault("metadata", {})
    metadata["slurm_job_id"] = records.job_id
    if final and (job is None or not job.ended):
        # The job recorded its outcome before Slurm ended it: squeue's RUNNING is not a final
        # fact. sacct's final record is read on a following cycle (Poller._refresh_facts).
        metadata.pop("slurm_state", None)
        if job is not None and job.node:
            metadata["slurm_node"] = job.node
    elif job is not None:
        _slurm_facts(metadata, job)


class Poller:
    def __init__(
        self,
        config: Config,
        store: Store,
        *,
        slurm_client: SlurmClient,
        images: ImageCache,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self.store = store
        self.slurm = slurm_client
        self.images = images
        self.clock = clock
        self._missing_since: dict[str, float] = {}
        self._last_cleanup = 0.0
        #: The newest task seen by a cycle or a quick check.
        self._newest_seq: int | None = None
        #: (task id, job id) of the jobs still active after the last cycle.
        self._active_jobs: list[tuple[str, str]] = []
        self._finished: set[str] = set()
        #: Site mode: every task runs as its owner (sudo -n -u OWNER, deploy/sudoers.tes-bridge).
        self.site = config.site.run_as_owner
        self._user_map: UserMap | None = None
        #: Site mode: records read as each owner at the start of a follow cycle.
        self._records: dict[str, JobRecords] = {}
        #: While Slurm cannot be reached, no sbatch runs before this time (each one would
        #: wait for sbatch's own retries, about 10 s, and fail the same way).
        self._submissions_paused_until = 0.0
        self._unreachable_count = 0
        #: Finished tasks whose final Slurm facts sacct did not have yet:
        #: task id -> (job id, attempt, since).
        self._facts_pending: dict[str, tuple[str, int, float]] = {}
        #: Tasks with a cancel to carry out, as of the last cycle (see quick_check).
        self._cancels_seen = 0
        #: Why the last task that could not be submitted waits.
        self._wait_reason: str | None = None
        #: The partitions' TmpDisk (slurm.disk_request "auto"), and when it was read.
        self._tmp_disk: TmpDisk | None = None
        self._tmp_disk_at = 0.0

    # ------------------------------------------------------------------------------ cycle
    def cycle(self) -> CycleStats:
        started = time.perf_counter()
        stats = CycleStats()
        with self.store.db.connection_context():
            self._newest_seq = self.store.newest_seq()
            self._recover_submissions(stats)
            self._submit_queued(stats)
            in_flight = self.store.tasks_in_flight(with_document=False)
            active = [t for t in in_flight if t.job_id and t.state not in TERMINAL_STATES]
            self._finished.clear()
            self._follow_jobs(active, stats)
            self._active_jobs = [
                (t.id, t.job_id) for t in active if t.job_id and t.id not in self._finished
            ]
            cancels = [t for t in in_flight if t.cancel_pending]
            self._carry_out_cancels(cancels, stats)
            self._cancels_seen = self.store.cancels_pending()
            if self.clock() - self._last_cleanup > CLEANUP_INTERVAL:
                self._last_cleanup = self.clock()
                self._clean_task_dirs()
                self._prune_images()
        stats.seconds = time.perf_counter() - started
        return stats

    def task_dir(self, task_id: str) -> Path:
        return self.config.work_dir / task_id

    def quick_check(self) -> str | None:
        """Between cycles: "submit" when a task arrived, "cycle" when a job recorded its
        outcome, else None. Costs one query and a few stats; no Slurm command."""
        with self.store.db.connection_context():
            newest = self.store.newest_seq()
            cancels = self.store.cancels_pending()
        if newest != self._newest_seq:
            self._newest_seq = newest
            return "submit"
        if cancels > self._cancels_seen:
            return "cycle"  # a cancel arrived: its job is scanceled now, not a cycle later
        if len(self._active_jobs) <= QUICK_CHECK_MAX_JOBS:
            for task_id, job_id in self._active_jobs:
                try:
                    outcome = TaskLayout(self.task_dir(task_id)).records_dir(job_id) / "outcome"
                    if outcome.exists():  # False too where site mode keeps records private
                        return "cycle"
                except (OSError, ValueError):
                    continue
        return None

    def submit_new(self) -> CycleStats:
        """Submit what is QUEUED now, without polling Slurm (see quick_check)."""
        stats = CycleStats()
        with self.store.db.connection_context():
            self._submit_queued(stats)
        return stats

    # ------------------------------------------------------------------------------ submit
    def _recover_submissions(self, stats: CycleStats) -> None:
        """Tasks whose `sbatch` started but whose job id was never stored: look for the job."""
        pending = self.store.interrupted_submissions()
        if not pending:
            return
        names = {job_name(t.id): t for t in pending}
        try:
            stats.slurm_calls += 2
            found = self.slurm.find_by_names(list(names))
        except SlurmError as exc:
            log.warning("cannot look for interrupted submissions yet: %s", exc)
            return
        # An sbatch dies with the poller and is killed at its time-out, but slurmctld may still
        # act on a request it received: "no job" is believed only once that time has passed.
        slurm_cfg = self.config.slurm
        settled_before = self.clock() - slurm_cfg.command_timeout - slurm_cfg.submit_settle
        for name, task in names.items():
            # Jobs of earlier attempts (lost to NODE_FAIL, ...) carry the same name.
            earlier = {
                (entry.get("metadata") or {}).get("slurm_job_id")
                for entry in (task.logs or [])[: max(task.attempt - 1, 0)]
            }
            jobs = sorted(
                (j for j in found.get(name, []) if j.job_id not in earlier),
                key=lambda j: int(j.job_id.split("_")[0]),
            )
            if jobs:
                job = jobs[-1]
                log.info("found job %s of interrupted submission of task %s", job.job_id, task.id)
                canceled = task.state == State.CANCELED.value
                self.store.update_task(
                    task.id,
                    allow_terminal=True,
                    job_id=job.job_id,
                    submit_started_at=None,
                    # Canceled while its sbatch ran: the job is scanceled this cycle.
                    **({"cancel_pending": True} if canceled else {}),
                )
            elif (task.submit_started_at or 0.0) > settled_before:
                log.info("interrupted submission of task %s: no job yet, looking again", task.id)
            else:
                # sbatch never created a job: the task may be submitted again.
                self.store.update_task(
                    task.id,
                    allow_terminal=True,
                    submit_started_at=None,
                    attempt=max(task.attempt - 1, 0),
                    cancel_pending=False,
                )

    def _submit_queued(self, stats: CycleStats) -> None:
        now = self.clock()
        if now < self._submissions_paused_until:
            return
        tasks = self.store.tasks_to_submit(now=now, limit=MAX_SUBMISSIONS_PER_CYCLE)
        for index, task in enumerate(tasks):
            try:
                if self._submit(task, stats):
                    stats.submitted += 1
            except Exception:  # one broken task must not stop the others
                log.exception("submitting task %s failed unexpectedly", task.id)
                self._fail(task, "internal error while submitting the task; see the poller log")
            if self.clock() < self._submissions_paused_until:
                # The tasks that wait behind it wait for the same reason: say so.
                self._tell_waiting(tasks[index + 1 :], self._wait_reason)
                break

    def _tell_waiting(self, tasks: list[TaskRecord], reason: str | None) -> None:
        if reason is None:
            return
        for task in tasks:
            logs = json.loads(json.dumps(task.logs or []))
            entry = _attempt_log(logs, task.attempt + 1)
            before = list(entry.get("system_logs", []))
            set_condition(entry, reason)
            if entry.get("system_logs") != before:
                self.store.update_task(task.id, logs=logs)

    def _submit(self, task: TaskRecord, stats: CycleStats) -> bool:
        images = [e["image"] for e in task.document["executors"]]
        try:
            # None while pulls run in the background; all of the task's pulls start at once.
            image_paths = self.images.resolve(images)
        except ImagePullError as exc:
            self._note_images(task, [], write=False)
            self._fail(task, f"cannot pull image: {exc}")
            return False
        # Transient trouble (registry down, full cache) is said in system_logs while it lasts.
        notes = [] if image_paths else [p for p in map(self.images.problem, images) if p]
        self._note_images(task, notes, write=image_paths is None)
        if image_paths is None:
            return False  # pulling in the background; try again next cycle
        document = {**task.document, "id": task.id}
        owner = task.owner if self.site else None
        if self.site and not owner:
            self._fail(task, "this task has no owner; in site mode tasks run only as their owner")
            return False
        tmp_disk = None
        if self.config.slurm.disk_request == "auto" and _disk_gb(document) > 0:
            try:
                tmp_disk = self._known_tmp_disk(stats)
            except SlurmError as exc:
                delay = self._pause_submissions()
                reason = f"cannot read the nodes' TmpDisk from Slurm ({_short(exc)}); retrying"
                self._wait(task, task.attempt + 1, reason, delay)
                log.warning("sinfo failed, retry in %.0fs: %s", delay, exc)
                return False
        try:
            if owner:
                script = self._adopt(owner, document, image_paths, tmp_disk)
            else:
                script = prepare_task_dir(
                    document, config=self.config, image_paths=image_paths, tmp_disk=tmp_disk
                )
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS:
                self._fail(task, f"cannot prepare the task directory: {exc}")
                return False
            # Every task would meet the same full disk: all submissions wait for the back-off.
            delay = self._pause_submissions()
            self._wait(
                task, task.attempt + 1, f"waiting: cannot prepare the task directory ({exc})", delay
            )
            log.warning(
                "cannot prepare the directory of task %s, retry in %.0fs: %s", task.id, delay, exc
            )
            return False
        except RenderError as exc:
            self._fail(task, f"cannot run this task here: {exc}")
            return False
        except OwnerCommandError as exc:
            self._fail(task, f"cannot create the task directory as {owner}: {exc}")
            return False
        attempt = task.attempt + 1
        # Recorded before sbatch runs: after a crash, the job is looked up by name, not resubmitted.
        if not self.store.update_task(task.id, submit_started_at=self.clock(), attempt=attempt):
            return False  # canceled meanwhile
        try:
            stats.slurm_calls += 1
            # Only in site mode: the keywords stay out of the plain call (and its fakes).
            site_args: dict[str, Any] = {}
            if owner:
                site_args = {"extra_args": self._account_args(owner, document), "as_user": owner}
            job_id = self.slurm.submit(
                script, job_name=job_name(task.id), comment=task.id, **site_args
            )
        except SlurmRejected as exc:
            message = f"Slurm refused the job: {exc.stderr.strip() or exc}"
            if _TMP_REFUSED in exc.stderr:
                message += self._tmp_disk_hint(document, stats)
            self._fail(
                task,
                message,
                attempt=attempt,
                submit_started_at=None,
            )
            return False
        except SlurmError as exc:
            # Maybe the job exists anyway (a time-out): recovery looks for it by name. This
            # sbatch has ended (its process group was killed on a time-out), so only the
            # settle time is left to wait: `submit_started_at` is moved back accordingly.
            delay = self._pause_submissions()
            if _NEVER_CONNECTED.search(exc.stderr):
                # sbatch never reached slurmctld: no job can exist, nothing to look for.
                settle: dict[str, Any] = {"submit_started_at": None, "attempt": task.attempt}
            else:
                settle = {"submit_started_at": self.clock() - self.config.slurm.command_timeout}
            self._wait(
                task,
                attempt,
                f"cannot reach Slurm to submit the job ({_short(exc)}); retrying with back-off",
                delay,
                **settle,
            )
            log.warning("sbatch for task %s failed, retry in %.0fs: %s", task.id, delay, exc)
            return False
        self._unreachable_count = 0
        logs = task.logs or []
        entry = _attempt_log(logs, attempt)
        set_condition(entry, None)
        entry.setdefault("metadata", {})["slurm_job_id"] = job_id
        self.store.update_task(
            task.id,
            allow_terminal=True,
            job_id=job_id,
            submit_started_at=None,
            next_submit_at=None,
            logs=logs,
        )
        log.info("submitted task %s as Slurm job %s", task.id, job_id)
        now = self.store.get_task(task.id)
        if now is not None and now.state == State.CANCELED.value:
            # Canceled while sbatch ran (the API saw no job yet): scancel before it can start.
            self.store.update_task(task.id, allow_terminal=True, cancel_pending=True)
            self._carry_out_cancels([now], stats)
        return True

    def _known_tmp_disk(self, stats: CycleStats) -> TmpDisk:
        """The partitions' TmpDisk, read again after `slurm.tmp_disk_refresh_seconds`. When
        sinfo fails the last answer stays in use; with none yet, the SlurmError is raised."""
        now = self.clock()
        refresh = self.config.slurm.tmp_disk_refresh_seconds
        if self._tmp_disk is None or now - self._tmp_disk_at >= refresh:
            try:
                stats.slurm_calls += 1
                self._tmp_disk = self.slurm.tmp_disk()
                log.info("node-local disk (TmpDisk) by partition: %s", self._tmp_disk.describe())
            except SlurmError as exc:
                if self._tmp_disk is None:
                    raise
                log.warning("sinfo failed; keeping the TmpDisk read before: %s", exc)
            self._tmp_disk_at = now
        return self._tmp_disk

    def _tmp_disk_hint(self, document: dict[str, Any], stats: CycleStats) -> str:
        """Why sbatch refused `--tmp`, and the setting that decides it."""
        mode = self.config.slurm.disk_request
        if self.clock() - self._tmp_disk_at > TMP_DISK_RECHECK:
            self._tmp_disk_at = float("-inf")  # what the nodes declare may have changed
        try:
            declared = f"the nodes declare TmpDisk {self._known_tmp_disk(stats).describe()}"
        except SlurmError:
            declared = "the nodes' TmpDisk could not be read"
        hint = (
            f". resources.disk_gb = {_disk_gb(document):g} asks Slurm for that much node-local "
            f'disk (sbatch --tmp, slurm.disk_request = "{mode}"), and {declared}'
        )
        if mode == "tmp":
            return hint + (
                "; a node that declares no TmpDisk (0) gives no --tmp at all: set "
                'slurm.disk_request = "auto" to pass disk_gb only where nodes declare TmpDisk'
            )
        return hint + "; ask for less disk_gb, or for a partition with larger TmpDisk"

    def _wait(
        self, task: TaskRecord, log_attempt: int, reason: str, delay: float, **changes: Any
    ) -> None:
        """Keep the task QUEUED, saying why (in the log of `log_attempt`), and try it again
        after `delay` seconds."""
        self._wait_reason = reason
        logs = json.loads(json.dumps(task.logs or []))
        set_condition(_attempt_log(logs, max(log_attempt, 1)), reason)
        self.store.update_task(task.id, next_submit_at=self.clock() + delay, logs=logs, **changes)

    def _pause_submissions(self) -> float:
        delay = self._backoff()
        self._submissions_paused_until = self.clock() + delay
        return delay

    # ------------------------------------------------------------------------------ site mode
    def _as_owner(self, owner: str, args: list[str], stdin: str | None = None) -> str:
        """`python -m bridge.job ARGS` as `owner`, through the sudo rule; returns stdout."""
        argv = [self.config.site.sudo, "-n", "-u", owner, "--", self.config.job.python]
        # The sudo rule pins --work-dir right after the subcommand.
        argv += ["-m", "bridge.job", args[0], "--work-dir", str(self.config.work_dir), *args[1:]]
        try:
            proc = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=self.config.slurm.command_timeout,
                cwd="/",  # `-m` puts the working directory on sys.path
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise OwnerCommandError(f"{args[0]}: {exc}") from exc
        if proc.returncode != 0:
            detail = "; ".join(proc.stderr.strip().splitlines()[-3:]) or "no message"
            raise OwnerCommandError(f"{args[0]} exited {proc.returncode}: {detail}")
        return proc.stdout

    def _adopt(
        self,
        owner: str,
        document: dict[str, Any],
        image_paths: dict[str, str],
        tmp_disk: TmpDisk | None,
    ) -> Path:
        # Rendered here; written by the owner, so the task directory is the owner's and private.
        files = task_files(document, config=self.config, image_paths=image_paths, tmp_disk=tmp_disk)
        task_dir = self.task_dir(document["id"])
        self._as_owner(owner, ["adopt", "--task-dir", str(task_dir)], json.dumps(files))
        return task_dir / "job.sh"

    def _account_args(self, owner: str | None, document: dict[str, Any]) -> list[str]:
        """`--account=` from the mapping file, unless the task names its own account."""
        if owner is None:
            return []
        params = (document.get("resources") or {}).get("backend_parameters") or {}
        if any(str(k).lower() == "account" for k in params):
            return []
        if self._user_map is None:
            self._user_map = UserMap.load(self.config.auth.user_map_file)
        account = self._user_map.account_for(owner) or self.config.site.default_account
        return [f"--account={account}"] if account else []

    def _read_owner_records(self, tasks: list[TaskRecord]) -> None:
        """One `read-records` per owner for all of that owner's started jobs."""
        self._records = {}
        by_owner: dict[str, list[TaskRecord]] = {}
        for task in tasks:
            if task.owner and task.job_id:
                by_owner.setdefault(task.owner, []).append(task)
        tail = str(self.config.job.log_tail_bytes)
        for owner, owned in by_owner.items():
            pairs = {f"{self.task_dir(t.id)}:{t.job_id}": t for t in owned}
            try:
                out = self._as_owner(owner, ["read-records", "--tail-bytes", tail, *pairs])
                for pair, data in json.loads(out).items():
                    if pair in pairs:
                        self._records[pairs[pair].id] = records_from_json(data)
            except (OwnerCommandError, ValueError, KeyError, TypeError) as exc:
                log.warning("cannot read the records of %s's jobs: %s", owner, _short(exc))

    def _backoff(self) -> float:
        """Doubles with each failed submission in a row (Slurm away, a full work filesystem),
        up to `slurm.submit_backoff_max`; a submission that succeeds starts it afresh."""
        self._unreachable_count += 1
        cfg = self.config.slurm
        exponent = min(self._unreachable_count - 1, 16)
        return min(cfg.submit_backoff_initial * 2**exponent, cfg.submit_backoff_max)

    def _note_images(self, task: TaskRecord, notes: list[str], *, write: bool) -> None:
        """Replace the task's "pulling image" lines by `notes` (stored only when they change)."""
        if not notes and not task.logs:
            return
        logs = task.logs or []
        entry = _attempt_log(logs, task.attempt + 1)
        old = entry.get("system_logs", [])
        new = [line for line in old if not line.startswith(IMAGE_NOTE)] + notes
        if new == old:
            return
        entry["system_logs"] = new
        if not new:
            del entry["system_logs"]
        task.logs = logs
        if write:
            self.store.update_task(task.id, logs=logs)

    def _fail(self, task: TaskRecord, message: str, **changes: Any) -> None:
        logs = task.logs or []
        entry = _attempt_log(logs, max(changes.get("attempt", task.attempt), 1))
        _add_system_logs(entry, [message])
        entry.setdefault("end_time", format_time_now())
        self.store.update_task(task.id, state=State.SYSTEM_ERROR.value, logs=logs, **changes)
        log.info("task %s failed: %s", task.id, message)

    # ------------------------------------------------------------------------------ follow
    def _follow_jobs(self, tasks: list[TaskRecord], stats: CycleStats) -> None:
        if not tasks and not self._facts_pending:
            return
        job_ids = [t.job_id for t in tasks if t.job_id]
        queue: dict[str, JobInfo] = {}
        try:
            if job_ids:
                stats.slurm_calls += 1
                queue = self.slurm.queue(job_ids)
        except SlurmError as exc:
            log.warning("squeue failed; keeping the last known states: %s", _short(exc))
            return
        if self.site:
            pending = {j for j, info in queue.items() if info.tes_state == State.QUEUED.value}
            self._read_owner_records([t for t in tasks if t.job_id not in pending])
        left = [j for j in job_ids if j not in queue or queue[j].ended]
        # Finished tasks still waiting for their final Slurm facts ride on the same sacct call.
        refresh = dict(self._facts_pending)
        left += [job_id for job_id, _, _ in refresh.values() if job_id not in left]
        accounting: dict[str, JobInfo] = {}
        if left:
            try:
                stats.slurm_calls += 1
                accounting = self.slurm.accounting(left)
            except SlurmError as exc:
                log.warning("sacct failed; finished jobs wait for the next cycle: %s", _short(exc))
        for task in tasks:
            assert task.job_id is not None
            job = accounting.get(task.job_id) or queue.get(task.job_id)
            try:
                if self._update_task(task, job):
                    stats.updated += 1
            except Exception:
                log.exception("updating task %s failed unexpectedly", task.id)
        self._refresh_facts(refresh, accounting)

    def _refresh_facts(
        self, refresh: dict[str, tuple[str, int, float]], accounting: dict[str, JobInfo]
    ) -> None:
        """Write sacct's final record into finished tasks that were missing it."""
        now = self.clock()
        for task_id, (job_id, attempt, since) in refresh.items():
            job = accounting.get(job_id)
            if job is not None and job.ended:
                task = self.store.get_task(task_id)
                if task is not None and len(task.logs or []) >= attempt:
                    logs = task.logs or []
                    _slurm_facts(logs[attempt - 1].setdefault("metadata", {}), job)
                    self.store.update_task(task_id, allow_terminal=True, logs=logs)
                # A step's MaxRSS can land in slurmdbd a moment after the job's own record;
                # a job too short for any accounting sample never gets one.
                ended_ago = now - job.end_time.timestamp() if job.end_time else 0.0
                if job.max_rss_bytes is not None or ended_ago > FINAL_RSS_WAIT:
                    self._facts_pending.pop(task_id, None)
                    continue
            if now - since > FINAL_FACTS_GRACE:
                log.warning("sacct has no final record of job %s (task %s)", job_id, task_id)
                self._facts_pending.pop(task_id, None)

    def _update_task(self, task: TaskRecord, job: JobInfo | None) -> bool:
        assert task.job_id is not None
        now = self.clock()
        job_pending = job is not None and not job.ended and job.tes_state == State.QUEUED.value
        if job_pending:
            records = JobRecords(job_id=task.job_id)
        elif self.site:
            records = self._records.get(task.id) or JobRecords(job_id=task.job_id)
        else:
            records = read_records(
                self.task_dir(task.id), task.job_id, tail_bytes=self.config.job.log_tail_bytes
            )
        current = State(task.state)
        decision = decide(
            job=job,
            records=records,
            attempt=task.attempt,
            retries=self.config.slurm.retries,
            current=current,
        )
        if job is None and records.outcome is None:
            first_missing = self._missing_since.setdefault(task.job_id, now)
            if now - first_missing > MISSING_JOB_GRACE:
                decision = Decision(
                    State.SYSTEM_ERROR,
                    [f"Slurm no longer knows job {task.job_id} and it recorded no outcome"],
                )
        else:
            self._missing_since.pop(task.job_id, None)

        final = decision.state in TERMINAL_STATES
        if final or decision.retry:
            self._finished.add(task.id)
        logs = json.loads(json.dumps(task.logs or []))  # a copy, 2x faster than deepcopy
        entry = _attempt_log(logs, max(task.attempt, 1))
        if not job_pending:
            _fill_attempt_log(entry, records, job, final=final or decision.retry)
        _add_system_logs(entry, decision.messages)
        set_condition(entry, None if final or decision.retry else decision.condition)
        if final and (job is None or not job.ended or job.max_rss_bytes is None):
            self._facts_pending[task.id] = (task.job_id, max(task.attempt, 1), now)
        changes: dict[str, Any] = {}
        if decision.retry:
            changes.update(job_id=None, submit_started_at=None, next_submit_at=None)
        if decision.cancel_job:
            changes["cancel_pending"] = True
        if decision.state is not current:
            changes["state"] = decision.state.value
        if logs != task.logs:
            changes["logs"] = logs
        if not changes:
            return False
        return self.store.update_task(task.id, **changes)

    # ------------------------------------------------------------------------------ cancel
    def _carry_out_cancels(self, tasks: list[TaskRecord], stats: CycleStats) -> None:
        with_job = [t for t in tasks if t.job_id]
        if not with_job:
            return
        # Site mode: one scancel per owner, as that owner; otherwise one for all.
        groups: dict[str | None, list[TaskRecord]] = {}
        for task in with_job:
            groups.setdefault(task.owner if self.site else None, []).append(task)
        done: list[TaskRecord] = []
        for owner, owned in groups.items():
            try:
                stats.slurm_calls += 1
                ids = [t.job_id for t in owned if t.job_id]
                if owner:
                    self.slurm.cancel(ids, as_user=owner)
                else:
                    self.slurm.cancel(ids)
                done += owned
            except SlurmError as exc:
                log.warning("scancel failed; trying again next cycle: %s", _short(exc))
        for task in done:
            self.store.update_task(task.id, allow_terminal=True, cancel_pending=False)
            stats.canceled += 1
            log.info("canceled Slurm job %s of task %s", task.job_id, task.id)

    # ------------------------------------------------------------------------------ cleanup
    def _clean_task_dirs(self) -> None:
        """Remove task directories after the retention time (failed tasks are kept longer)."""
        day = 86400.0
        now = self.clock()
        policies = [
            ([State.COMPLETE.value, State.CANCELED.value], self.config.job.retention_days),
            (
                [State.EXECUTOR_ERROR.value, State.SYSTEM_ERROR.value],
                self.config.job.failed_retention_days,
            ),
        ]
        for states, days in policies:
            for task in self.store.finished_before(now - days * day, states):
                path = self.task_dir(task.id)
                if self.site:
                    full = self.store.get_task(task.id)
                    if full is not None and full.owner:
                        try:
                            self._as_owner(full.owner, ["remove", "--task-dir", str(path)])
                        except OwnerCommandError as exc:
                            log.warning("cannot remove the directory of %s: %s", task.id, exc)
                            continue
                elif path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                    log.info("removed the directory of task %s", task.id)
                self.store.mark_cleaned(task.id)

    def _prune_images(self) -> None:
        """Remove SIFs a moved tag left behind once no unfinished task may still use them."""
        try:
            self.images.prune(self.store.oldest_unfinished_time())
        except OSError as exc:
            log.warning("cannot prune the image cache: %s", exc)


class OwnerCommandError(Exception):
    """A site-mode command run as a task's owner (sudo) failed."""


#: After sbatch refuses a `--tmp`, TmpDisk is read again if the last read is older than this
#: (at most one sinfo per this many seconds, however many tasks are refused).
TMP_DISK_RECHECK = 30.0

#: sbatch's words for a `--tmp` no node can give (tests/data/slurm/sbatch-too-much-tmp.txt).
_TMP_REFUSED = "Temporary disk specification can not be satisfied"


def _disk_gb(document: dict[str, Any]) -> float:
    value = (document.get("resources") or {}).get("disk_gb")
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else 0.0


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def format_time_now() -> str:
    return format_time(datetime.now(UTC))


# ---------------------------------------------------------------------------------- process
class PollerLock:
    """An exclusive lock file: a second poller on the same state directory refuses to start."""

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


def build_poller(config: Config, store: Store, *, wake: threading.Event | None = None) -> Poller:
    cfg = config.slurm
    client = SlurmClient(
        sbatch=cfg.sbatch,
        squeue=cfg.squeue,
        sacct=cfg.sacct,
        scancel=cfg.scancel,
        sinfo=cfg.sinfo,
        timeout=cfg.command_timeout,
        sudo=config.site.sudo,
    )
    images = ImageCache(
        config,
        max_workers=config.container.pull_workers,
        failure_ttl=config.container.pull_failure_ttl,
        on_pulled=wake.set if wake is not None else None,
    )
    return Poller(config, store, slurm_client=client, images=images)


def run_poller(config: Config, *, once: bool = False) -> int:
    lock = PollerLock(config.state_dir / "poller.lock")
    if not lock.acquire():
        log.error("another poller already runs for %s; exiting", config.state_dir)
        return 1
    store = Store.from_url(config.database_url)
    stop = threading.Event()
    #: Set by a finished image pull (or a stop request): the next cycle starts at once.
    wake = threading.Event()
    poller = build_poller(config, store, wake=wake)

    def request_stop(*_: object) -> None:
        stop.set()
        wake.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, request_stop)
    log.info("poller started", extra={"work_dir": str(config.work_dir)})
    while not stop.is_set():
        wake.clear()
        try:
            stats = poller.cycle()
            if stats.submitted or stats.updated or stats.canceled:
                log.info("poll cycle", extra=stats.__dict__)
        except Exception:
            log.exception("poll cycle failed; trying again")
        if once:
            break
        deadline = time.monotonic() + config.slurm.poll_interval
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or wake.wait(min(QUICK_CHECK_INTERVAL, remaining)):
                break
            try:
                what = poller.quick_check()
                if what == "cycle":
                    break
                if what == "submit":
                    poller.submit_new()
            except Exception:
                log.exception("quick check failed; the next cycle will do its work")
    log.info("poller stopped")
    return 0
