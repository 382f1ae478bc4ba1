"""Slurm's job states, and the TES state each means as Slurm alone sees it.

Slurm quirks (seen on Slurm 22.05, and in Slurm's sources for later releases):

- States come as "CANCELLED by 0" (sacct names the uid that asked) and "CANCELLED+" (sacct
  with a truncated column); squeue's ``%t`` and ``squeue -t`` use compact codes ("PD", "CG").
  :func:`base_state` reads every form as the one word.
- A job whose memory use passes ``--mem`` under ``JobAcctGatherParams=OverMemoryKill`` ends FAILED
  with signal 9. With task/cgroup (``ConstrainRAMSpace=yes``) the kernel kills the biggest
  process in the job's cgroup (an executor, not the job script, which goes on) and the job ends
  OUT_OF_MEMORY whatever the script's exit code; the script records the OOM kill itself.
- Later releases add state words (25.11: EXPEDITING). A word not in :data:`SLURM_TO_TES` reads
  as the TES state UNKNOWN, with one warning: the job is neither ended nor failed by it, and the
  poller keeps the task's state until Slurm says a word it knows.
"""

from __future__ import annotations

import logging

log = logging.getLogger("bridge.slurm")

#: Slurm job state (the base word, as squeue %T and sacct State print it) -> TES state, as
#: Slurm alone sees it. The poller (bridge.poller.decide) refines it with the job's own
#: records: a recorded outcome always wins, and an ended job whose script recorded none was
#: cut short (see decide for how each case ends). Every ended job maps to a final TES state
#: (core.tes.TERMINAL_STATES); TES clients (Nextflow, Cromwell) wait forever on any other.
SLURM_TO_TES: dict[str, str] = {
    "PENDING": "QUEUED",
    # Nodes are being booted or configured for the job.
    "CONFIGURING": "INITIALIZING",
    "POWER_UP_NODE": "INITIALIZING",
    "RUNNING": "RUNNING",
    # Still running: the job's processes are ending and epilogs run; the outcome is not known yet.
    "COMPLETING": "RUNNING",
    # Burst-buffer stage-out after the script ended: not done yet.
    "STAGE_OUT": "RUNNING",
    # Being sent a signal (e.g. by scancel --signal); it has not ended.
    "SIGNALING": "RUNNING",
    "RESIZING": "RUNNING",
    "SUSPENDED": "PAUSED",
    # Stopped with SIGSTOP, keeping its resources: paused, not ended.
    "STOPPED": "PAUSED",
    # The script exited 0. The job's own records still decide between COMPLETE and an error.
    "COMPLETED": "COMPLETE",
    # The batch script exited non-zero. The bridge's job script exits with the failing
    # executor's code, or with its own for a staging failure (docs/states.md); its records
    # tell which, and its recorded outcome decides.
    "FAILED": "EXECUTOR_ERROR",
    "CANCELLED": "CANCELED",
    # The time limit ended the executors: running it again the same way would end the same way.
    "TIMEOUT": "EXECUTOR_ERROR",
    # The task used more memory than it asked for.
    "OUT_OF_MEMORY": "EXECUTOR_ERROR",
    # Lost through no fault of the task (see RETRYABLE_STATES); final only once retries run out.
    "NODE_FAIL": "SYSTEM_ERROR",
    "BOOT_FAIL": "SYSTEM_ERROR",
    # Preempted by a job of higher priority (with --no-requeue; a job that may be requeued goes
    # back to PENDING instead). The poller submits it again or, where slurm.on_preemption says
    # so, ends the task PREEMPTED: Nextflow and Cromwell take PREEMPTED as still running.
    "PREEMPTED": "PREEMPTED",
    "LAUNCH_FAILED": "SYSTEM_ERROR",
    "RECONFIG_FAIL": "SYSTEM_ERROR",
    # Ended by its --deadline; the bridge never sets one, so a site policy did.
    "DEADLINE": "SYSTEM_ERROR",
    # Federation: another cluster took the job. The bridge does not use federation.
    "REVOKED": "SYSTEM_ERROR",
    # Requeued (after a node failure, preemption or by an admin): it will run again.
    "REQUEUED": "QUEUED",
    "REQUEUE_FED": "QUEUED",
    # 25.11+: a job that failed under `--requeue=expedite` is being requeued, to run again first.
    "EXPEDITING": "QUEUED",
    # Held in the queue until someone releases it; still queued, not ended.
    "REQUEUE_HOLD": "QUEUED",
    "SPECIAL_EXIT": "QUEUED",
    "RESV_DEL_HOLD": "QUEUED",
    # Pending while the controller records the job in the database.
    "UPDATE_DB": "QUEUED",
}

#: Compact state codes (squeue %t, ``squeue -t``), for input that uses them.
_COMPACT: dict[str, str] = {
    "PD": "PENDING", "CF": "CONFIGURING", "R": "RUNNING", "CG": "COMPLETING", "CD": "COMPLETED",
    "F": "FAILED", "CA": "CANCELLED", "TO": "TIMEOUT", "NF": "NODE_FAIL", "PR": "PREEMPTED",
    "BF": "BOOT_FAIL", "DL": "DEADLINE", "OOM": "OUT_OF_MEMORY", "RQ": "REQUEUED",
    "RH": "REQUEUE_HOLD", "RF": "REQUEUE_FED", "RD": "RESV_DEL_HOLD", "RS": "RESIZING",
    "RV": "REVOKED", "SE": "SPECIAL_EXIT", "SI": "SIGNALING", "SO": "STAGE_OUT", "ST": "STOPPED",
    "S": "SUSPENDED",
}  # fmt: skip

#: Jobs lost through no fault of the task: submitting again is worth it (PREEMPTED: unless
#: slurm.on_preemption ends the task PREEMPTED).
RETRYABLE_STATES: frozenset[str] = frozenset({"NODE_FAIL", "PREEMPTED", "BOOT_FAIL"})

#: States after which the job will not run again by itself.
ENDED_STATES: frozenset[str] = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
     "PREEMPTED", "DEADLINE", "REVOKED", "LAUNCH_FAILED", "RECONFIG_FAIL"}
)  # fmt: skip

#: Pending reasons that never clear by themselves: the job, as submitted, cannot start (sites
#: without ``EnforcePartLimits=ALL`` accept such jobs instead of refusing them). Any other
#: reason leaves the task QUEUED. Not "Constraints" (23.11+): a job's ``--extra`` constraints
#: no node meets now, which a node may meet later (BadConstraints keeps its meaning).
HOPELESS_PENDING_REASONS: frozenset[str] = frozenset(
    {"BadConstraints", "PartitionConfig", "InvalidAccount", "InvalidQOS",
     "DependencyNeverSatisfied"}
)  # fmt: skip

_warned_states: set[str] = set()


def base_state(slurm_state: str) -> str:
    """The state word: "CANCELLED by 0" and "CANCELLED+" -> "CANCELLED"; "PD" -> "PENDING"."""
    words = slurm_state.split()
    word = words[0].rstrip("+").upper() if words else ""
    return _COMPACT.get(word, word)


def tes_state_for(slurm_state: str) -> str:
    """The TES state for a Slurm state; "UNKNOWN" (with a warning, once per state) if unknown.

    An unknown state is not in :data:`ENDED_STATES`: the job is not taken for ended, and the
    poller keeps its task's state (bridge.poller.decisions) rather than fail it."""
    state = base_state(slurm_state)
    tes = SLURM_TO_TES.get(state)
    if tes is None:
        if state not in _warned_states:
            _warned_states.add(state)
            log.warning(
                "unknown Slurm job state %r; its task keeps its state until Slurm reports one "
                "this bridge knows",
                slurm_state,
            )
        return "UNKNOWN"
    return tes
