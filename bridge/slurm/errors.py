"""A failed Slurm command, read once: the errors by kind, and the stderr that tells them apart.

:func:`command_error` turns a command that exited non-zero into a :class:`SlurmError` carrying
argv, exit code, stdout and stderr. Its subclass tells the caller what to do:
:class:`SlurmUnavailable` (try again later, with back-off; its :class:`Outage` says whether the
command may have been done all the same) or :class:`SlurmRejected` (sbatch refused this job
for good; its :class:`Refusal` says for what); its ``reason`` is Slurm's own words.

Slurm quirks (seen on Slurm 22.05; real output in tests/data/slurm/):

- With slurmctld down, sbatch, squeue and scancel each retry for about 9 s before failing with
  "Unable to contact slurm controller"; sacct still answers (it asks slurmdbd).
- sbatch refusing a job for its size (exit 1, "Requested node configuration is not available")
  still uses a job id: sacct and squeue show a FAILED (1:0) job of that name that never ran.
- Where slurmctld limits RPC rates (``SlurmctldParameters=rl_enable``, 23.02+), a command it
  limits never fails: it sleeps and tries again, for ever, and says so only with ``-v``
  (:func:`~bridge.slurm.run.run_slurm` counts those lines and keeps them from the callers).
- A refusal of sbatch itself may read ``sbatch: fatal: ...`` (26.05: "--gpus-per-node and
  --gres=gpu are mutually exclusive."), as well as ``sbatch: error: ...``.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import TypedDict

from bridge.system.proc import CommandError


class Refusal(StrEnum):
    """What of a job sbatch refused for good (:attr:`SlurmRejected.refusal`)."""

    #: `--tmp` above the TmpDisk every node declares (tests/data/slurm/sbatch-too-much-tmp.txt).
    TMP_DISK = "tmp_disk"
    #: `--mem` above what any node has.
    MEMORY = "memory"
    #: More CPUs than a node, or the partition, allows.
    CPUS = "cpus"
    #: `--time` unreadable, or above the partition's or the association's limit.
    TIME_LIMIT = "time_limit"
    PARTITION = "partition"
    ACCOUNT = "account"
    QOS = "qos"
    #: Another resource no node has (GRES, features, node count).
    NODE_CONFIGURATION = "node_configuration"
    #: Anything else (an unreadable script, an option sbatch does not know).
    OTHER = "other"


class Outage(StrEnum):
    """Why Slurm could not do a command now (:attr:`SlurmUnavailable.outage`)."""

    #: slurmctld (slurmdbd for sacct) could not be contacted at all (down, the connection
    #: refused, munge failing on this host): the command did nothing.
    UNREACHABLE = "unreachable"
    #: Refused for one of Slurm's limits (a QOS or association submit limit, MaxJobCount): the
    #: command did nothing unless it was killed while it waited the limit out, and the refusal
    #: clears when earlier jobs end.
    LIMIT = "limit"
    #: No clear answer (a time-out, a lost connection, a controller in standby): the command may
    #: have been done all the same.
    UNCERTAIN = "uncertain"
    #: Killed at its time-out while slurmctld's RPC rate limit (``rl_enable``) kept telling it to
    #: back off (the retries its ``-v`` output counts): slurmctld answers, but this account sends
    #: it more RPCs than the limit allows. The last attempt may have been in flight: the command
    #: may have been done all the same, as for UNCERTAIN.
    RATE_LIMITED = "rate_limited"


class SlurmError(CommandError):
    """A Slurm command failed. Carries the command, its exit code and what it printed."""

    @property
    def reason(self) -> str:
        """What Slurm said: its last error lines, without the tool's prefix or retry notices."""
        return _slurm_words(self.stderr or self.stdout)

    @property
    def may_have_acted(self) -> bool:
        """Whether the command may have been done all the same (sbatch: a job may exist). Only
        a refusal, or an outage that says so, rules it out."""
        return True


class SlurmUnavailable(SlurmError):
    """The controller or the accounting daemon did not answer: try again later, with back-off."""

    def __init__(
        self,
        message: str,
        *,
        outage: Outage,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message, argv=argv, returncode=returncode, stdout=stdout, stderr=stderr)
        self.outage = outage

    @property
    def may_have_acted(self) -> bool:
        # A command killed at its time-out (no exit code) while it waited out a limit may have
        # got through at last.
        return self.outage in (Outage.UNCERTAIN, Outage.RATE_LIMITED) or (
            self.outage is Outage.LIMIT and self.returncode is None
        )


class SlurmRejected(SlurmError):
    """sbatch refused this job for good (resources no node has, unknown partition, ...)."""

    def __init__(
        self,
        message: str,
        *,
        refusal: Refusal,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message, argv=argv, returncode=returncode, stdout=stdout, stderr=stderr)
        self.refusal = refusal

    @property
    def may_have_acted(self) -> bool:
        return False


def _any_of(*texts: str) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(text) for text in texts), re.IGNORECASE)


#: stderr text that means "Slurm is not reachable right now", not "your request is wrong", by
#: what it means for the command.
_OUTAGES: tuple[tuple[Outage, re.Pattern[str]], ...] = (
    # sbatch refused for a limit. A submit limit of the user's QOS or association (MaxSubmitJobs:
    # "sbatch: error: QOSMaxSubmitJobPerUserLimit" then "Batch job submission failed: Job
    # violates accounting/QOS policy (job submit limit, ...)"), or slurmctld's MaxJobCount
    # ("Slurm temporarily unable to accept job, sleeping and retrying", then "Resource
    # temporarily unavailable" once sbatch gives up; from 26.05.2 "Slurm job queue full,
    # sleeping and retrying", then "MaxJobCount limit reached").
    (
        Outage.LIMIT,
        _any_of(
            "Job violates accounting/QOS policy",
            "temporarily unable to accept job",
            "Resource temporarily unavailable",
            "Slurm job queue full",
            "MaxJobCount limit reached",
        ),
    ),
    # The request may have reached slurmctld and been done: slurmctld went away after the
    # connection was made (killed, or restarted, in the middle of the RPC).
    (
        Outage.UNCERTAIN,
        _any_of(
            "Unable to contact slurm controller (send failure)",
            "Unable to contact slurm controller (receive failure)",
            "Unexpected missing socket error",
            "Connection reset by peer",
            "Broken pipe",
            "Communication send failure",
            "Communication receive failure",
            "Communication shutdown failure",
        ),
    ),
    # The request never reached slurmctld, or was turned away before it was processed.
    (
        Outage.UNREACHABLE,
        _any_of(
            "Unable to contact slurm controller",
            "Connection refused",
            # munged down or overloaded on this host.
            "Munge encode failed",
            # 24.05+: slurmctld's queue for this RPC type is full (rpc_queue.yaml); the client
            # does not retry it.
            "Rate limit exceeded, please retry later",
        ),
    ),
    (
        Outage.UNCERTAIN,
        _any_of(
            "Socket timed out on send/recv",
            "Slurm backup controller in standby mode",
            "Connection timed out",
            "Problem talking to the database",
            "Zero Bytes were transmitted or received",
            "Transport endpoint is not connected",
            "Communication connection failure",
            "Requested operation is presently disabled",
            "Protocol authentication error",
        ),
    ),
)

#: sbatch's words for each refusal (its own checks and slurmctld's errors), the first that
#: matches wins: "Temporary disk specification can not be satisfied" comes with "Requested node
#: configuration is not available".
_REFUSALS: tuple[tuple[Refusal, re.Pattern[str]], ...] = (
    (Refusal.TMP_DISK, _any_of("Temporary disk specification can not be satisfied")),
    (Refusal.MEMORY, _any_of("Memory specification can not be satisfied")),
    (Refusal.CPUS, _any_of("More processors requested than permitted")),
    (Refusal.TIME_LIMIT, _any_of("Requested time limit is invalid", "Invalid --time")),
    (Refusal.PARTITION, _any_of("Invalid partition name specified", "invalid partition")),
    (Refusal.ACCOUNT, _any_of("Invalid account")),
    (Refusal.QOS, _any_of("Invalid qos specification")),
    (
        Refusal.NODE_CONFIGURATION,
        _any_of(
            "Requested node configuration is not available",
            "Invalid generic resource (gres) specification",
            "Invalid feature specification",
            "Node count specification invalid",
        ),
    ),
)
_INVALID_JOB_ID = "Invalid job id specified"
#: What Slurm's tools put before their error lines ("sbatch: error: ", "sbatch: fatal: ").
_TOOL_PREFIX = re.compile(r"^[a-z]+: (?:error|fatal): ")


def _outage_in(stderr: str) -> Outage | None:
    """The outage a Slurm tool's error lines tell of; None when they tell of none."""
    for outage, pattern in _OUTAGES:
        if pattern.search(stderr):
            return outage
    return None


def _refusal_in(stderr: str) -> Refusal:
    """What of a job sbatch's error lines say it refused."""
    for refusal, pattern in _REFUSALS:
        if pattern.search(stderr):
            return refusal
    return Refusal.OTHER


def _slurm_words(text: str) -> str:
    """A tool's last three error lines, without its prefix and its retry notices, once each."""
    lines = [_TOOL_PREFIX.sub("", line.strip()) for line in text.splitlines()]
    kept = [line for line in lines if line and "sleeping and retrying" not in line]
    return "; ".join(list(dict.fromkeys(kept))[-3:]) or "no error message"


class _Command(TypedDict):
    """What a failed command's error carries of it."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def command_error(
    proc: subprocess.CompletedProcess[str], what: str, *, sbatch: str = "sbatch"
) -> SlurmError:
    """The error for a Slurm command that exited non-zero, read once for every caller: its
    subclass and kind (:class:`Outage`, :class:`Refusal`) tell what to do, its message what went
    wrong (`what`: the operation) and where to look."""
    argv = [str(a) for a in proc.args]
    detail = _slurm_words(proc.stderr or proc.stdout)
    # Through sudo (site mode) the Slurm tool is the word after `--`.
    tool = Path(argv[argv.index("--") + 1] if "--" in argv[:5] else argv[0]).name
    command = _Command(
        argv=argv, returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr
    )
    outage = _outage_in(proc.stderr)
    if outage is not None:
        daemon = "slurmdbd" if tool == "sacct" else "slurmctld"
        return SlurmUnavailable(
            f"{what}: Slurm is not reachable ({detail}); try again later, and if this lasts "
            f"check `scontrol ping` / `sacctmgr show cluster` and {daemon}'s log",
            outage=outage,
            **command,
        )
    if tool == Path(sbatch).name:
        return SlurmRejected(
            f"{what}: sbatch refused the job ({detail}); compare its resources and partition "
            f"with `sinfo -o '%P %c %m %l'`",
            refusal=_refusal_in(proc.stderr),
            **command,
        )
    if "accounting storage is disabled" in proc.stderr:
        return SlurmError(
            f"{what}: {detail}; sacct needs slurmdbd (AccountingStorageType="
            f"accounting_storage/slurmdbd in slurm.conf)",
            **command,
        )
    return SlurmError(f"{what}: {tool} exited {proc.returncode} ({detail})", **command)
