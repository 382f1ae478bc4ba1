"""The Slurm client: sbatch, squeue, sacct, scancel, sinfo and scontrol as argument lists, run
through :func:`~bridge.slurm.run.run_slurm`, and :class:`SlurmBackend`, what the poller needs of
it.

Slurm quirks (seen on Slurm 22.05): scancel of an unknown or already finished job exits 0 and
prints nothing (with ``-v``: "scancel: error: Kill job error on job id N: Invalid job id
specified", exit 0 all the same); ``scancel 123_4`` cancels one element of an array. A job
missing from squeue is not finished: :meth:`SlurmClient.accounting` asks sacct.

sbatch and scancel run with ``-v``, so that the retries slurmctld's RPC rate limit asks of them
are counted (:mod:`bridge.slurm.run`); sbatch -v prints its option dump on stderr alone, the
job id on stdout as without it. Through sudo (site mode) scancel runs without it: the sudo rule
of deploy/sudoers.tes-bridge allows scancel job ids alone (sbatch's, ``--parsable *``, takes
``--parsable -v``).
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import subprocess
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from bridge.slurm.errors import _INVALID_JOB_ID, SlurmError, command_error
from bridge.slurm.jobs import JobInfo
from bridge.slurm.releases import SlurmFeatures, SlurmRelease, describe_tested, parse_version
from bridge.slurm.run import run_slurm
from bridge.slurm.sacct import SACCT_FIELDS, parse_sacct
from bridge.slurm.sbatch import StartEstimate, parse_test_only
from bridge.slurm.scontrol import (
    RateLimit,
    exempt_because,
    parse_max_array_size,
    parse_rate_limit,
    parse_slurm_user,
)
from bridge.slurm.sinfo import (
    SINFO_NODE_SIZES_FORMAT,
    SINFO_PARTITIONS_FORMAT,
    NodeSizes,
    Partition,
    parse_sinfo_node_sizes,
    parse_sinfo_partitions,
)
from bridge.slurm.squeue import parse_job_states, parse_squeue, squeue_argv
from bridge.system.budget import CallBudget
from bridge.system.proc import as_user

log = logging.getLogger("bridge.slurm")

# Arguments longer than this are refused by Linux (MAX_ARG_STRLEN is 128 KiB): split id lists.
_MAX_LIST_CHARS = 100_000

#: How often slurmctld's rate limit (`scontrol show config`) is read again, and how soon after
#: a failed read.
RATE_LIMIT_REFRESH = 3600.0
RATE_LIMIT_RETRY = 60.0
#: The longest wait for `scontrol show config`.
RATE_LIMIT_TIMEOUT = 10.0
#: The longest wait for `squeue --version`, which asks no daemon (read as the poller starts).
VERSION_TIMEOUT = 10.0

#: From this many job ids on, :meth:`SlurmClient.queue` lists the jobs of its `queue_user`
#: instead of naming the ids: slurmctld matches a ``--jobs`` list against every job it holds,
#: which took 0.55-0.61 s for 10,000 ids against 0.10 s for the same jobs listed by user
#: (1,000 ids: 0.16 s; Slurm 22.05, docs/benchmarks.md "At site scale", row 3).
QUEUE_BY_USER_FROM = 1000


def _chunks(items: Sequence[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for item in items:
        if chunk and size + len(item) + 1 > _MAX_LIST_CHARS:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += len(item) + 1
    if chunk:
        yield chunk


def on_path(command: str) -> str:
    """`command` as the absolute path this process's PATH gives it, read once (unchanged where
    it finds none). Through sudo (site mode) a bare name would be looked up on sudo's own
    `secure_path` instead, which may find another program than the one the sudo rule names
    (a newer release linked in /usr/local/bin, a rule naming /usr/bin/sbatch): sudo is given
    the path the service itself runs, and the rule must name that program."""
    return shutil.which(command) or command


def _check_ids(job_ids: Iterable[str]) -> list[str]:
    ids = sorted({str(j).strip() for j in job_ids}, key=lambda j: (len(j), j))
    for job_id in ids:
        if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
            raise ValueError(f"not a Slurm job id: {job_id!r}")
    return ids


def array_spec(indexes: Iterable[int]) -> str:
    """sbatch's `--array` for these element indexes, runs as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    numbers = sorted(set(indexes))
    if not numbers or numbers[0] < 0:
        raise ValueError(f"an array needs element indexes of 0 or more: {numbers}")
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _check_text(what: str, value: str) -> None:
    # "|" would break the parsers (the name is not the last field), newlines any line format.
    if not value or "\n" in value or "\r" in value or (what == "job name" and "|" in value):
        raise ValueError(f"{what} must be non-empty, one line, without '|': {value!r}")


class SlurmBackend(Protocol):
    """What the poller needs of Slurm (:class:`SlurmClient`; a fake in the unit tests).

    Every call may raise :class:`SlurmError`; ``as_user`` runs the command as that user
    (site mode). Every command takes its RPCs from `budget` first (waiting for them if need
    be); the poller looks at it to leave work for a later cycle instead."""

    budget: CallBudget

    def submit(
        self,
        script: Path,
        *,
        job_name: str,
        comment: str | None = None,
        extra_args: Sequence[str] = (),
        as_user: str | None = None,
        array_size: int | None = None,
        script_args: Sequence[str] = (),
        array_indexes: Sequence[int] | None = None,
    ) -> str: ...

    def test_only(
        self, script: str, *, extra_args: Sequence[str] = (), as_user: str | None = None
    ) -> StartEstimate: ...

    def max_array_size(self) -> int: ...

    def release(self) -> SlurmRelease: ...

    def queue(self, job_ids: Collection[str]) -> dict[str, JobInfo]: ...

    def accounting(self, job_ids: Collection[str]) -> dict[str, JobInfo]: ...

    def find_by_names(self, names: Collection[str]) -> dict[str, list[JobInfo]]: ...

    def node_sizes(self) -> NodeSizes: ...

    def partitions(self) -> list[Partition]: ...

    def cancel(self, job_ids: Collection[str], *, as_user: str | None = None) -> None: ...


class SlurmClient:
    """Runs Slurm's command-line tools; one call per operation for any number of jobs."""

    def __init__(
        self,
        *,
        sbatch: str = "sbatch",
        squeue: str = "squeue",
        sacct: str = "sacct",
        scancel: str = "scancel",
        sinfo: str = "sinfo",
        scontrol: str = "scontrol",
        timeout: float = 30.0,
        history: timedelta = timedelta(days=30),
        sudo: str = "sudo",
        queue_user: str | None = None,
        budget: CallBudget | None = None,
        uid: int | None = None,
    ) -> None:
        self.sudo = sudo
        #: The account the commands run as (outside site mode): slurmctld's RPC rate limit
        #: does not cover root and SlurmUser. None: this process's (os.geteuid()).
        self.uid = os.geteuid() if uid is None else uid
        #: Whether the log has said that the rate limit does not cover this account.
        self._exempt_said = False
        #: Every command takes a token from it first (slurm.calls_per_second).
        self.budget = budget or CallBudget.unlimited()
        #: This cluster's Slurm release, read once (:meth:`release`).
        self._release: SlurmRelease | None = None
        #: When slurmctld's own rate limit is read again (:meth:`_run`).
        self._rate_limit_due = 0.0
        #: The last answer of :meth:`_queue_changed`.
        self._seen: dict[str, JobInfo] = {}
        #: The user every job asked about belongs to (the service account, outside site mode):
        #: many ids are then looked up by listing this user's jobs (QUEUE_BY_USER_FROM).
        self.queue_user = queue_user
        self.sbatch = on_path(sbatch)
        self.squeue = on_path(squeue)
        self.sacct = on_path(sacct)
        self.scancel = on_path(scancel)
        self.sinfo = on_path(sinfo)
        self.scontrol = on_path(scontrol)
        self.timeout = timeout
        #: How far back find_by_names asks sacct.
        self.history = history

    def _run(
        self,
        argv: list[str],
        timeout: float | None = None,
        *,
        stdin: str | None = None,
        clean: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """run_slurm with the budget, lowered first (at the first command, then every
        RATE_LIMIT_REFRESH s) to slurmctld's own rate limit where it has one."""
        if self.budget.rate and time.monotonic() >= self._rate_limit_due:
            self._apply_rate_limit()
        return run_slurm(argv, timeout or self.timeout, self.budget, stdin=stdin, clean=clean)

    def _apply_rate_limit(self) -> None:
        try:
            limit, slurm_user = self._rate_limit_and_user()
        except SlurmError as exc:
            log.warning("cannot read slurmctld's rate limit; trying again soon: %s", exc)
            self._rate_limit_due = time.monotonic() + RATE_LIMIT_RETRY
            return
        self._rate_limit_due = time.monotonic() + RATE_LIMIT_REFRESH
        exempt = exempt_because(self.uid, account_name(self.uid), slurm_user)
        if limit is not None and exempt is not None:
            if not self._exempt_said:
                self._exempt_said = True
                log.info(
                    "slurmctld's RPC rate limit (%s) does not apply to this account: %s; "
                    "the call budget stays %s",
                    limit,
                    exempt,
                    self.budget.describe(),
                )
            limit = None
        before = self.budget.describe()
        if limit is None:
            self.budget.limit_to(None, None)
        else:
            self.budget.limit_to(limit.per_second, limit.safe_burst)
        if self.budget.describe() != before or limit is not None:
            log.info(
                "Slurm call budget: %s (slurmctld's rate limit: %s)",
                self.budget.describe(),
                limit or "none",
            )

    def _as(self, user: str | None, argv: list[str]) -> list[str]:
        """Site mode: run as `user` through the sudo rule of deploy/sudoers.tes-bridge."""
        if user is None:
            return argv
        _check_text("user", user)
        return as_user(self.sudo, user, argv)

    def submit(
        self,
        script: Path,
        *,
        job_name: str,
        comment: str | None = None,
        extra_args: Sequence[str] = (),
        as_user: str | None = None,
        array_size: int | None = None,
        script_args: Sequence[str] = (),
        array_indexes: Sequence[int] | None = None,
    ) -> str:
        """Submit a batch script; returns the job id. `array_size`: an array of that many
        elements (``--array=0-N``), whose element I is the job ``ID_I``; `array_indexes`: an
        array of these elements (``--array=0-2,5``); `script_args`: the script's own arguments
        (after it on sbatch's command line).

        On :class:`SlurmUnavailable` after a time-out the job may have been queued all the same:
        look for it with :meth:`find_by_names` before submitting again.
        """
        _check_text("job name", job_name)
        # -v after --parsable: the sudo rule of site mode allows `sbatch --parsable *`.
        argv = [self.sbatch, "--parsable", "-v", f"--job-name={job_name}"]
        if comment is not None:
            _check_text("comment", comment)
            argv.append(f"--comment={comment}")
        if array_size is not None:
            if array_size < 1:
                raise ValueError(f"an array needs at least one element: {array_size}")
            argv.append(f"--array=0-{array_size - 1}")
        elif array_indexes is not None:
            argv.append(f"--array={array_spec(array_indexes)}")
        for arg in script_args:
            _check_text("script argument", arg)
        argv += [*extra_args, str(script), *script_args]
        proc = self._run(self._as(as_user, argv))
        if proc.returncode != 0:
            raise command_error(proc, f"submitting {script}", sbatch=self.sbatch)
        # --parsable prints "id" or "id;cluster".
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        job_id = lines[-1].split(";")[0] if lines else ""
        if not job_id.isdigit():
            raise _unexpected(proc, f"sbatch printed no job id: {proc.stdout!r}")
        return job_id

    def test_only(
        self, script: str, *, extra_args: Sequence[str] = (), as_user: str | None = None
    ) -> StartEstimate:
        """Where and when Slurm would start the job of `script` (its text, which sbatch reads
        on stdin) submitted now, without creating it (``sbatch --test-only``). Raises what a
        real sbatch of it would: SlurmRejected where Slurm would refuse it."""
        # --parsable first: site mode's sudo rule allows `sbatch --parsable *`. No -v: the
        # answer is an info line, printed without it (bridge.slurm.sbatch).
        argv = self._as(as_user, [self.sbatch, "--parsable", "--test-only", *extra_args])
        proc = self._run(argv, stdin=script, clean=False)
        if proc.returncode != 0:
            raise command_error(proc, "asking sbatch --test-only", sbatch=self.sbatch)
        estimate = parse_test_only(proc.stderr)
        if estimate is None:
            raise _unexpected(
                proc, f"sbatch --test-only printed no estimate: {proc.stderr.strip()[-300:]!r}"
            )
        return estimate

    def _squeue(self, *selector: str) -> dict[str, JobInfo]:
        proc = self._run(squeue_argv(self.squeue, selector))
        if proc.returncode != 0:
            if _INVALID_JOB_ID in proc.stderr:
                return {}  # a single id the controller no longer (or never) knew
            raise command_error(proc, "reading the queue")
        return parse_squeue(proc.stdout)

    def _sacct(self, selector: Sequence[str]) -> dict[str, JobInfo]:
        argv = [self.sacct, "-P", "-n", *selector, f"--format={SACCT_FIELDS}"]
        proc = self._run(argv)
        if proc.returncode != 0:
            raise command_error(proc, "reading accounting")
        return parse_sacct(proc.stdout)

    def queue(self, job_ids: Collection[str]) -> dict[str, JobInfo]:
        """What the controller knows of these jobs (queued, running, or ended < MinJobAge ago).

        Jobs it no longer knows are absent: ask :meth:`accounting`, they are not "finished".
        Many ids are looked up by listing `queue_user`'s jobs (see QUEUE_BY_USER_FROM), or,
        where squeue has `--only-job-state` (23.11.5+), by their states first (see
        :meth:`_queue_changed`).
        """
        ids = _check_ids(job_ids)
        if len(ids) >= QUEUE_BY_USER_FROM and self.features().only_job_state:
            return self._queue_changed(ids)
        return self._queue_full(ids)

    def _queue_full(self, ids: list[str]) -> dict[str, JobInfo]:
        if self.queue_user is not None and len(ids) >= QUEUE_BY_USER_FROM:
            _check_text("user", self.queue_user)
            wanted = set(ids)
            # --all: hidden partitions too, where a site's rules may send jobs.
            listed = self._squeue("--all", f"--user={self.queue_user}")
            return {job_id: info for job_id, info in listed.items() if job_id in wanted}
        found: dict[str, JobInfo] = {}
        for chunk in _chunks(ids):
            found.update(self._squeue(f"--jobs={','.join(chunk)}"))
        return found

    def _queue_changed(self, ids: list[str]) -> dict[str, JobInfo]:
        """At site scale most followed jobs run for hours: their states come through the
        lighter RPC, and only the jobs that are not still RUNNING as last seen (new, pending
        with a reason that may change, ended) are read in full."""
        states = self._job_states(ids)
        found = {
            job_id: self._seen[job_id]
            for job_id, state in states.items()
            if state == "RUNNING" and job_id in self._seen and self._seen[job_id].state == state
        }
        changed = [job_id for job_id in states if job_id not in found]
        if changed:
            found.update(self._queue_full(changed))
        self._seen = found
        return found

    def release(self) -> SlurmRelease:
        """This cluster's Slurm release, from `squeue --version`, read once (one call; a failure
        reads as an unknown release, with 22.05's features, and is tried again next time)."""
        if self._release is None:
            try:
                proc = self._run([self.squeue, "--version"], min(self.timeout, VERSION_TIMEOUT))
            except SlurmError as exc:
                log.warning("cannot read squeue's version: %s", exc)
                return SlurmRelease(None)
            version = parse_version(proc.stdout) if proc.returncode == 0 else None
            self._release = release = SlurmRelease(version)
            if release.tested:
                log.info("Slurm %s, a tested release: %s", release, release.features)
            elif version is None:
                log.warning(
                    "cannot tell Slurm's release from `squeue --version` (%r); the commands are "
                    "used in the forms every release has (tested: %s)",
                    (proc.stdout or proc.stderr).strip()[:200],
                    describe_tested(),
                )
            else:
                log.warning(
                    "Slurm %s is not a tested release (tested: %s): expected to work; report "
                    "what does not. %s",
                    release,
                    describe_tested(),
                    release.features,
                )
        return self._release

    def features(self) -> SlurmFeatures:
        """What this cluster's squeue can do (:meth:`release`)."""
        return self.release().features

    def queue_states(self, job_ids: Collection[str]) -> dict[str, str]:
        """The state word of each of these jobs the controller knows. Where squeue has
        `--only-job-state` (23.11.5+) it asks with that lighter RPC, else as :meth:`queue`."""
        ids = _check_ids(job_ids)
        if not self.features().only_job_state:
            return {job_id: info.state for job_id, info in self._queue_full(ids).items()}
        return self._job_states(ids)

    def _job_states(self, ids: list[str]) -> dict[str, str]:
        # `--only-job-state` answers each array element's id asked with every element asked of
        # its array (26.05: a burst's 500-element array read as 250,000 lines, most of a poll
        # cycle; tests/data/slurm/26.05/squeue-only-job-state-elements.txt): each array is
        # asked for once, by its own id, and only the elements followed are kept.
        wanted = set(ids)
        asked = list(dict.fromkeys(job_id.partition("_")[0] for job_id in ids))
        states: dict[str, str] = {}
        for chunk in _chunks(asked):
            argv = squeue_argv(self.squeue, [f"--jobs={','.join(chunk)}"], states_only=True)
            proc = self._run(argv)
            if proc.returncode != 0:
                if _INVALID_JOB_ID in proc.stderr:
                    continue
                raise command_error(proc, "reading the queue's job states")
            found = parse_job_states(proc.stdout)
            states.update((job_id, state) for job_id, state in found.items() if job_id in wanted)
        return states

    def rate_limit(self) -> RateLimit | None:
        """slurmctld's RPC rate limit for each user (`scontrol show config`), or None when it
        has none (or cannot be read: then nothing lowers the configured budget)."""
        return self._rate_limit_and_user()[0]

    def _rate_limit_and_user(self) -> tuple[RateLimit | None, str | None]:
        """slurmctld's RPC rate limit and its SlurmUser, from one `scontrol show config`."""
        self._rate_limit_due = time.monotonic() + RATE_LIMIT_REFRESH  # no recursion
        # Not worth the whole command timeout: without an answer the setting stands.
        proc = self._run([self.scontrol, "show", "config"], min(self.timeout, RATE_LIMIT_TIMEOUT))
        if proc.returncode != 0:
            raise command_error(proc, "reading slurmctld's configuration")
        return parse_rate_limit(proc.stdout), parse_slurm_user(proc.stdout)

    def accounting(self, job_ids: Collection[str]) -> dict[str, JobInfo]:
        """The accounting records of these jobs (any age: ``--jobs`` looks back to the epoch)."""
        found: dict[str, JobInfo] = {}
        for chunk in _chunks(_check_ids(job_ids)):
            found.update(self._sacct([f"--jobs={','.join(chunk)}"]))
        return found

    def find_by_names(self, names: Collection[str]) -> dict[str, list[JobInfo]]:
        """Jobs, queued or ended, named one of ``names``, oldest first.

        For recovery after a crash between sbatch and recording the job id: the job may exist.
        squeue covers jobs sacct has not recorded yet; sacct covers those squeue forgot.
        """
        wanted = sorted(set(names))
        if not wanted:
            return {}
        for name in wanted:
            _check_text("job name", name)
        since = (datetime.now(UTC) - self.history).strftime("%Y-%m-%dT%H:%M:%S")
        jobs: dict[str, JobInfo] = {}
        for chunk in _chunks(wanted):
            joined = ",".join(chunk)
            # sacct --name looks back only to midnight unless --starttime is given.
            # --allusers: as a service account (site mode) sacct --name shows only its own jobs.
            jobs.update(self._sacct([f"--name={joined}", "--allusers", f"--starttime={since}"]))
            for job_id, info in self._squeue(f"--name={joined}").items():
                # The controller's view is the fresher one, and only it has very new jobs.
                old = jobs.get(job_id)
                jobs[job_id] = info if old is None or not info.ended else _merge(old, info)
        result: dict[str, list[JobInfo]] = {}
        for info in sorted(jobs.values(), key=lambda j: (len(j.job_id), j.job_id)):
            if info.name in wanted:
                result.setdefault(info.name, []).append(info)
        return result

    def max_array_size(self) -> int:
        """The cluster's MaxArraySize: an array's indexes must stay below it."""
        proc = self._run([self.scontrol, "show", "config"])
        if proc.returncode != 0:
            raise command_error(proc, "reading the configuration")
        try:
            return parse_max_array_size(proc.stdout)
        except ValueError as exc:
            raise SlurmError(str(exc), argv=[self.scontrol, "show", "config"]) from exc

    def node_sizes(self) -> NodeSizes:
        """Each partition's node TmpDisk and memory, in one call (`-a`: hidden partitions too)."""
        proc = self._run([self.sinfo, "-h", "-a", "-o", SINFO_NODE_SIZES_FORMAT])
        if proc.returncode != 0:
            raise command_error(proc, "reading the partitions' node sizes")
        return parse_sinfo_node_sizes(proc.stdout)

    def partitions(self) -> list[Partition]:
        """Every partition's nodes, CPUs, memory, time limit and GRES, in one call."""
        proc = self._run([self.sinfo, "-h", "-a", "-N", "-o", SINFO_PARTITIONS_FORMAT])
        if proc.returncode != 0:
            raise command_error(proc, "reading the partitions")
        return parse_sinfo_partitions(proc.stdout)

    def cancel(self, job_ids: Collection[str], *, as_user: str | None = None) -> None:
        """Cancel these jobs; unknown and already ended ones are ignored by scancel."""
        # -v: see the module doc (not through sudo, whose rule allows job ids alone).
        verbose = ["-v"] if as_user is None else []
        for chunk in _chunks(_check_ids(job_ids)):
            proc = self._run(self._as(as_user, [self.scancel, *verbose, *chunk]))
            if proc.returncode != 0:
                raise command_error(proc, f"cancelling job(s) {' '.join(chunk)}")


def _unexpected(proc: subprocess.CompletedProcess[str], message: str) -> SlurmError:
    """A command that succeeded without printing what it should have."""
    return SlurmError(
        message,
        argv=[str(a) for a in proc.args],
        returncode=proc.returncode,
        stdout=proc.stdout,
        stderr=proc.stderr,
    )


def account_name(uid: int) -> str | None:
    """The user name of `uid`; None when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _merge(accounting: JobInfo, queue: JobInfo) -> JobInfo:
    """An ended job seen by both: squeue's state with sacct's exit code and memory."""
    return replace(
        queue,
        exit_code=accounting.exit_code,
        signal=accounting.signal,
        max_rss_bytes=accounting.max_rss_bytes,
        elapsed_seconds=accounting.elapsed_seconds,
        start_time=accounting.start_time or queue.start_time,
        end_time=accounting.end_time or queue.end_time,
    )
