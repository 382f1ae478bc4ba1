"""The Slurm client's parsers and error handling, on real output captured from Slurm 22.05.

tests/data/slurm/README names the command behind each file; capture.sh makes them again.
Commands are replaced by small scripts that replay that output, so the real run/parse path runs.
"""

from __future__ import annotations

import logging
import re
import signal
import stat
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bridge import slurm
from bridge.core.tes import TERMINAL_STATES
from bridge.slurm import (
    ENDED_STATES,
    HOPELESS_PENDING_REASONS,
    QUEUE_BY_USER_FROM,
    RETRYABLE_STATES,
    SLURM_TO_TES,
    JobInfo,
    Outage,
    Refusal,
    SlurmClient,
    SlurmError,
    SlurmRejected,
    SlurmUnavailable,
    base_state,
    parse_sacct,
    parse_sinfo_node_sizes,
    parse_squeue,
    tes_state_for,
)

DATA = Path(__file__).parents[1] / "data" / "slurm"
TES_STATES = {
    "UNKNOWN", "QUEUED", "INITIALIZING", "RUNNING", "PAUSED", "COMPLETE", "EXECUTOR_ERROR",
    "SYSTEM_ERROR", "CANCELED", "PREEMPTED", "CANCELING",
}  # fmt: skip


def data(name: str) -> str:
    return (DATA / name).read_text()


def exit_code_of(name: str) -> int:
    """The exit code README records for a captured command."""
    match = re.search(rf"^{re.escape(name)}: .* \(exit (\d+)\)$", data("README"), re.M)
    assert match, f"{name} is not in tests/data/slurm/README"
    return int(match.group(1))


def by_name(jobs: dict[str, JobInfo], name: str) -> JobInfo:
    (job,) = [j for j in jobs.values() if j.name == name]
    return job


def replay(tmp_path: Path, name: str, capture: str | None = None, *, sleep: float = 0) -> str:
    """A stand-in command that prints a captured file's stdout/stderr and exits as recorded.

    It appends its arguments to ``<name>.calls`` so tests can count calls.
    """
    lines = ["#!/bin/sh", f'printf "%s\\n" "$*" >> "{tmp_path / name}.calls"']
    if sleep:
        lines.append(f"sleep {sleep}")
    code = 0
    if capture is not None:
        lines.append(f'cat "{DATA / capture}"')
        if (DATA / f"{capture}.stderr").exists():
            lines.append(f'cat "{DATA / capture}.stderr" >&2')
        code = exit_code_of(capture)
    lines.append(f"exit {code}")
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def calls(tmp_path: Path, name: str) -> list[str]:
    file = tmp_path / f"{name}.calls"
    return file.read_text().splitlines() if file.exists() else []


# --- state table --------------------------------------------------------------------------------


def test_every_slurm_state_maps_to_a_tes_state() -> None:
    required = {
        "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "COMPLETED", "FAILED", "CANCELLED",
        "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
        "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED", "STOPPED",
        "SIGNALING", "STAGE_OUT", "SPECIAL_EXIT", "REVOKED", "RESV_DEL_HOLD",
    }  # fmt: skip
    assert required <= SLURM_TO_TES.keys()
    assert set(SLURM_TO_TES.values()) <= TES_STATES
    assert {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL"} == RETRYABLE_STATES


def test_ended_jobs_map_to_final_tes_states_only() -> None:
    # Clients wait forever on a task left in any other state (CANCELING, QUEUED, ...).
    assert {SLURM_TO_TES[s] for s in ENDED_STATES} <= {s.value for s in TERMINAL_STATES}
    assert SLURM_TO_TES["PREEMPTED"] == "PREEMPTED"


@pytest.mark.parametrize(
    ("slurm_state", "tes"),
    [
        ("CANCELLED by 0", "CANCELED"),
        ("CANCELLED+", "CANCELED"),
        ("PENDING", "QUEUED"),
        ("COMPLETING", "RUNNING"),
        ("COMPLETED", "COMPLETE"),
        ("FAILED", "EXECUTOR_ERROR"),
        ("TIMEOUT", "EXECUTOR_ERROR"),
        ("NODE_FAIL", "SYSTEM_ERROR"),
        ("PD", "QUEUED"),
        ("running", "RUNNING"),
    ],
)
def test_tes_state_for_reads_the_first_word(slurm_state: str, tes: str) -> None:
    assert tes_state_for(slurm_state) == tes


def test_unknown_state_is_unknown_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bridge.slurm"):
        assert tes_state_for("WIBBLE_NEW_STATE") == "UNKNOWN"
        assert tes_state_for("") == "UNKNOWN"
    assert "WIBBLE_NEW_STATE" in caplog.text


def test_an_unknown_state_warns_once_and_is_neither_ended_nor_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    line = "7|tes-a|STATE_OF_A_LATER_RELEASE|None|n1|main|2026-11-25T20:00:00|N/A|0:05|(null)\n"
    with caplog.at_level(logging.WARNING, logger="bridge.slurm"):
        (info,) = parse_squeue(line * 3).values()
        assert [info.tes_state, info.tes_state, tes_state_for("STATE_OF_A_LATER_RELEASE")] == [
            "UNKNOWN"
        ] * 3
    assert caplog.text.count("STATE_OF_A_LATER_RELEASE") == 1
    assert info.state == "STATE_OF_A_LATER_RELEASE" and not info.ended
    assert info.end_time is None and info.exit_code is None


def test_expediting_is_a_job_requeued_to_run_again() -> None:
    # Slurm 25.11: a job that failed under --requeue=expedite, on its way back to the queue.
    line = "8|tes-b|EXPEDITING|None|n1|main|2026-11-25T20:00:00|N/A|0:05|(null)\n"
    (info,) = parse_squeue(line).values()
    assert (info.state, info.tes_state, info.ended) == ("EXPEDITING", "QUEUED", False)
    assert "EXPEDITING" not in ENDED_STATES | RETRYABLE_STATES


def test_only_reasons_that_never_clear_are_hopeless() -> None:
    # 23.11's "Constraints" (--extra constraints no node meets now) may clear; its older
    # "BadConstraints" does not.
    assert "BadConstraints" in HOPELESS_PENDING_REASONS
    assert not {"Constraints", "Resources", "Priority"} & HOPELESS_PENDING_REASONS


def test_base_state() -> None:
    assert base_state("CANCELLED by 1000") == "CANCELLED"
    assert base_state("OOM") == "OUT_OF_MEMORY"


# --- squeue ------------------------------------------------------------------------------------


def test_squeue_pending_running_and_just_ended_jobs() -> None:
    jobs = parse_squeue(data("squeue-active.txt"))
    ok = by_name(jobs, "tes-ok")
    assert ok.state == "COMPLETED"
    assert ok.comment == "task=ok|tag=a b"  # the comment is last, so "|" survives
    assert ok.exit_code is None  # squeue has no exit code: sacct does
    assert ok.node == "vm"
    assert ok.start_time is not None and ok.start_time.tzinfo == UTC

    pending = [j for j in jobs.values() if j.state == "PENDING"]
    # Which job waits for "Resources" and which for "Priority" depends on what else ran then.
    assert {j.reason for j in pending} >= {"Resources", "JobHeldUser"}
    for job in pending:
        assert job.node is None and job.start_time is None and job.end_time is None
        assert job.comment is None  # "(null)"
        assert job.tes_state == "QUEUED"
    assert by_name(jobs, "tes-held").reason == "JobHeldUser"

    running = by_name(jobs, "tes-running")
    assert running.state == "RUNNING" and running.reason is None
    assert running.start_time is not None and running.end_time is None  # end "NONE"
    assert running.elapsed_seconds is not None and running.elapsed_seconds > 0  # "0:03"
    assert running.tes_state == "RUNNING"


def test_squeue_shows_ended_jobs_only_with_states_all() -> None:
    default = parse_squeue(data("squeue-default-states.txt"))
    assert {j.state for j in default.values()} <= {"PENDING", "RUNNING"}
    ended = parse_squeue(data("squeue-ended.txt"))
    assert by_name(ended, "tes-timeout").state == "TIMEOUT"
    assert by_name(ended, "tes-timeout").reason == "TimeLimit"
    assert by_name(ended, "tes-fail").reason == "NonZeroExitCode"
    bigmem = by_name(ended, "tes-bigmem")
    assert bigmem.elapsed_seconds is not None and bigmem.elapsed_seconds > 60  # "1:25"


def test_squeue_job_cancelled_while_pending_never_started() -> None:
    held = by_name(parse_squeue(data("squeue-cancelled.txt")), "tes-held")
    assert held.state == "CANCELLED"
    assert held.start_time is None  # squeue prints the cancel time as its start
    assert held.end_time is not None and held.end_time.tzinfo == UTC


def test_squeue_drained_node_reason() -> None:
    job = by_name(parse_squeue(data("squeue-node-drained.txt")), "tes-drained")
    assert job.reason == "ReqNodeNotAvail, UnavailableNodes:vm"


def test_parsers_skip_malformed_lines() -> None:
    assert parse_squeue("garbage\n\n") == {}
    assert parse_sacct("1|x\n") == {}


# --- sacct -------------------------------------------------------------------------------------


def test_sacct_completed_failed_and_signalled_jobs() -> None:
    jobs = parse_sacct(data("sacct-ended.txt"))
    ok = by_name(jobs, "tes-ok")
    assert (ok.state, ok.exit_code, ok.signal) == ("COMPLETED", 0, 0)
    assert ok.comment == "task=ok|tag=a b"
    assert ok.partition == "main"
    fail = by_name(jobs, "tes-fail")
    assert (fail.state, fail.exit_code, fail.signal) == ("FAILED", 3, 0)
    assert fail.tes_state == "EXECUTOR_ERROR"
    killed = by_name(jobs, "tes-signal")
    assert (killed.state, killed.exit_code, killed.signal) == ("FAILED", 0, 9)
    assert all("." not in job_id for job_id in jobs)  # steps are merged into their job


def test_sacct_cancelled_job_gets_its_signal_from_the_batch_step() -> None:
    jobs = parse_sacct(data("sacct-ended.txt"))
    cancelled = by_name(jobs, "tes-running")
    assert cancelled.state == "CANCELLED"  # from "CANCELLED by 0"
    assert cancelled.canceled_by == "0"
    assert (cancelled.exit_code, cancelled.signal) == (0, 15)
    timeout = by_name(jobs, "tes-timeout")
    assert (timeout.state, timeout.signal) == ("TIMEOUT", 15)
    assert timeout.elapsed_seconds is not None and timeout.elapsed_seconds >= 60  # --time=1
    assert timeout.max_rss_bytes is not None and timeout.max_rss_bytes % 1024 == 0


def test_sacct_names_no_canceller_of_a_job_slurm_cancelled_itself() -> None:
    jobs = parse_sacct(data("sacct-cancelled-by-slurm.txt"))
    assert (jobs["96434_21"].state, jobs["96434_21"].canceled_by) == ("CANCELLED", "")
    assert (jobs["96434_21"].exit_code, jobs["96434_21"].node) == (15, "node1")
    assert jobs["96434_22"].canceled_by is None  # COMPLETED: no one cancelled it
    # squeue says CANCELLED, and names no one: not known.
    assert all(j.canceled_by is None for j in parse_squeue(data("squeue-cancelled.txt")).values())


def test_sacct_memory_overrun_is_failed_with_sigkill_and_its_max_rss() -> None:
    oom = by_name(parse_sacct(data("sacct-ended.txt")), "tes-oom")
    assert (oom.state, oom.exit_code, oom.signal) == ("FAILED", 0, 9)
    # From the batch step: over the 100 MB asked for (600 MiB allocated).
    assert oom.max_rss_bytes is not None and oom.max_rss_bytes > 500 * 2**20
    assert oom.start_time is not None and oom.end_time is not None
    assert (oom.end_time - oom.start_time).total_seconds() == oom.elapsed_seconds


def test_sacct_pending_and_running_jobs_have_no_exit_code_or_end() -> None:
    jobs = parse_sacct(data("sacct-active.txt"))
    pending = by_name(jobs, "tes-pending")
    assert pending.state == "PENDING"
    assert pending.exit_code is None and pending.signal is None
    assert pending.node is None and pending.start_time is None  # "None assigned", "Unknown"
    running = by_name(jobs, "tes-running")
    assert running.state == "RUNNING" and running.end_time is None and running.exit_code is None
    assert running.start_time is not None and running.start_time.tzinfo == UTC
    assert running.start_time > datetime(2020, 1, 1, tzinfo=UTC)


def test_sacct_placeholder_record_is_left_out_until_the_real_one_arrives() -> None:
    # slurmdbd writes "allocation" with no partition (and ExitCode 0:0) before the job's record.
    assert "|allocation|" in data("sacct-placeholder.txt")
    assert parse_sacct(data("sacct-placeholder.txt")) == {}


def test_sacct_job_cancelled_while_pending() -> None:
    job = by_name(parse_sacct(data("sacct-cancelled-while-pending.txt")), "tes-drained")
    assert job.state == "CANCELLED" and job.start_time is None and job.node is None
    assert job.end_time is not None


# --- the client, with commands replaying captured output ----------------------------------------


def test_submit_returns_the_job_id(tmp_path: Path) -> None:
    client = SlurmClient(sbatch=replay(tmp_path, "sbatch", "sbatch-ok.txt"))
    job_id = client.submit(
        tmp_path / "job.sh", job_name="tes-x", comment="c", extra_args=["-p", "main"]
    )
    assert job_id == data("sbatch-ok.txt").strip()
    assert calls(tmp_path, "sbatch") == [
        f"--parsable -v --job-name=tes-x --comment=c -p main {tmp_path}/job.sh"
    ]


def test_submit_gives_the_script_its_own_arguments_after_it(tmp_path: Path) -> None:
    """The lease epoch of an elected poller reaches the job script as its argument (sbatch
    passes what follows the script to it); one that could break the command line is refused."""
    client = SlurmClient(sbatch=replay(tmp_path, "sbatch", "sbatch-ok.txt"))
    client.submit(
        tmp_path / "a.sh", job_name="tes-array-x", array_size=3, script_args=["lease-epoch=7"]
    )
    assert calls(tmp_path, "sbatch") == [
        f"--parsable -v --job-name=tes-array-x --array=0-2 {tmp_path}/a.sh lease-epoch=7"
    ]
    with pytest.raises(ValueError, match="script argument"):
        client.submit(tmp_path / "a.sh", job_name="n", script_args=["x\ny"])


def test_submit_an_array_of_given_elements(tmp_path: Path) -> None:
    """The later arrays of staged tasks submitted again after a crash keep their elements'
    indexes: `--array` lists them, runs as ranges."""
    client = SlurmClient(sbatch=replay(tmp_path, "sbatch", "sbatch-ok.txt"))
    client.submit(tmp_path / "a.sh", job_name="n", array_indexes=[8, 0, 1, 2, 5, 7])
    assert calls(tmp_path, "sbatch") == [
        f"--parsable -v --job-name=n --array=0-2,5,7-8 {tmp_path}/a.sh"
    ]
    with pytest.raises(ValueError, match="element indexes"):
        client.submit(tmp_path / "a.sh", job_name="n", array_indexes=[])


def test_node_sizes_are_one_sinfo_call_tmp_disk_smallest_and_largest(tmp_path: Path) -> None:
    client = SlurmClient(sinfo=replay(tmp_path, "sinfo", "sinfo-node-sizes.txt"))
    nodes = client.node_sizes()
    assert calls(tmp_path, "sinfo") == ["-h -a -o %P|%d|%m"]
    assert nodes.default_partition == "main"
    assert nodes.smallest_tmp_disk([]) == nodes.smallest_tmp_disk(["main"]) == 102400
    assert nodes.largest_memory([]) == nodes.largest_memory(["main"]) == 23081
    # Several node groups per partition: one line per distinct TmpDisk and memory.
    mixed = parse_sinfo_node_sizes(
        "main*|0|4000\nmain*|102400|8000\nbig|204800|64000\nbig|51200|16000\n"
    )
    assert mixed.smallest_tmp_disk([]) == 0 and mixed.smallest_tmp_disk(["big"]) == 51200
    assert mixed.smallest_tmp_disk(["big", "main"]) == 0
    assert mixed.smallest_tmp_disk(["nosuch"]) is None
    assert mixed.describe_tmp_disk() == "main 0-102400 MB, big 51200-204800 MB"


def test_largest_memory_is_of_any_node_the_job_may_run_on() -> None:
    nodes = parse_sinfo_node_sizes("main*|0|4000\nmain*|0|8000\nbig|0|64000\nold|0\nodd|0|x\n")
    assert nodes.largest_memory([]) == nodes.largest_memory(["main"]) == 8000
    assert nodes.largest_memory(["main", "big"]) == 64000
    # A partition sinfo did not list, or whose memory it did not say: unknown.
    for partitions in (["nosuch"], ["old"], ["odd"], ["main", "old"]):
        assert nodes.largest_memory(partitions) is None, partitions
    assert parse_sinfo_node_sizes("main|0|4000\n").largest_memory([]) is None  # no default


def test_submit_strips_the_cluster_name(tmp_path: Path) -> None:
    sbatch = tmp_path / "sbatch"
    sbatch.write_text("#!/bin/sh\necho '1234;cluster2'\n")
    sbatch.chmod(0o755)
    assert SlurmClient(sbatch=str(sbatch)).submit(tmp_path / "j.sh", job_name="n") == "1234"


@pytest.mark.parametrize(
    ("capture", "refusal"),
    [
        ("sbatch-too-much-memory.txt", Refusal.MEMORY),
        ("sbatch-too-many-cpus.txt", Refusal.CPUS),
        ("sbatch-bad-partition.txt", Refusal.PARTITION),
        ("sbatch-bad-time.txt", Refusal.TIME_LIMIT),
        ("sbatch-missing-script.txt", Refusal.OTHER),
        ("sbatch-too-much-tmp.txt", Refusal.TMP_DISK),
    ],
)
def test_sbatch_refusals_are_rejections(tmp_path: Path, capture: str, refusal: Refusal) -> None:
    client = SlurmClient(sbatch=replay(tmp_path, "sbatch", capture))
    with pytest.raises(SlurmRejected) as caught:
        client.submit(tmp_path / "job.sh", job_name="tes-x")
    err = caught.value
    assert err.returncode == exit_code_of(capture) and err.returncode != 0
    assert err.argv[0].endswith("sbatch") and "--parsable" in err.argv
    assert err.stderr == data(f"{capture}.stderr")
    assert "sbatch refused the job" in str(err)
    assert err.refusal is refusal and not err.may_have_acted


@pytest.mark.parametrize(
    ("stderr", "refusal"),
    [
        ("Batch job submission failed: Requested time limit is invalid (missing or exceeds "
         "some limit)", Refusal.TIME_LIMIT),
        ("Batch job submission failed: Invalid account or account/partition combination "
         "specified", Refusal.ACCOUNT),
        ("Batch job submission failed: Invalid qos specification", Refusal.QOS),
        ("Batch job submission failed: Invalid generic resource (gres) specification",
         Refusal.NODE_CONFIGURATION),
        ("Batch job submission failed: Requested node configuration is not available",
         Refusal.NODE_CONFIGURATION),
    ],
)  # fmt: skip
def test_slurmctld_refusals_say_what_was_refused(stderr: str, refusal: Refusal) -> None:
    proc = subprocess.CompletedProcess(["sbatch", "job.sh"], 1, "", f"sbatch: error: {stderr}\n")
    err = slurm.command_error(proc, "submitting job.sh")
    assert isinstance(err, SlurmRejected) and err.refusal is refusal
    assert err.reason == stderr


def test_the_reason_is_slurms_words_without_prefix_and_retry_notices() -> None:
    stderr = data("sbatch-too-much-tmp.txt.stderr")
    err = SlurmError("x", stderr=stderr)
    assert err.reason == (
        "Temporary disk specification can not be satisfied; "
        "Batch job submission failed: Requested node configuration is not available"
    )
    retried = "sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying\n"
    err = SlurmError("x", stderr=retried * 2 + "sbatch: error: Batch job submission failed: x\n")
    assert err.reason == "Batch job submission failed: x"
    assert SlurmError("x").reason == "no error message"


def _sbatch_saying(tmp_path: Path, stderr: str, *, sleep: float = 0) -> str:
    """An sbatch that prints `stderr`, then sleeps `sleep` seconds (if any) and exits 1."""
    (tmp_path / "stderr").write_text(stderr)
    script = tmp_path / "sbatch"
    script.write_text(f'#!/bin/sh\ncat "{tmp_path / "stderr"}" >&2\nsleep {sleep}\nexit 1\n')
    script.chmod(0o755)
    return str(script)


SUBMIT_LIMIT = (
    "sbatch: error: QOSMaxSubmitJobPerUserLimit\n"
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy "
    "(job submit limit, user's size and/or time limits)\n"
)
MAX_JOB_COUNT_RETRY = (
    "sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying\n"
)


def test_a_refusal_for_a_limit_is_an_outage_that_created_no_job(tmp_path: Path) -> None:
    client = SlurmClient(sbatch=_sbatch_saying(tmp_path, SUBMIT_LIMIT))
    with pytest.raises(SlurmUnavailable) as caught:
        client.submit(tmp_path / "job.sh", job_name="tes-x")
    assert caught.value.outage is Outage.LIMIT and not caught.value.may_have_acted
    assert caught.value.reason.startswith("QOSMaxSubmitJobPerUserLimit; Batch job submission")


def test_sbatch_killed_while_it_waits_out_a_limit_may_have_created_the_job(
    tmp_path: Path,
) -> None:
    client = SlurmClient(sbatch=_sbatch_saying(tmp_path, MAX_JOB_COUNT_RETRY, sleep=5), timeout=1)
    with pytest.raises(SlurmUnavailable) as caught:
        client.submit(tmp_path / "job.sh", job_name="tes-x")
    assert caught.value.returncode is None and caught.value.outage is Outage.LIMIT
    assert caught.value.may_have_acted


@pytest.mark.parametrize(
    ("tool", "capture"),
    [
        ("sbatch", "sbatch-controller-down.txt"),
        ("squeue", "squeue-controller-down.txt"),
        ("scancel", "scancel-controller-down.txt"),
        ("sacct", "sacct-dbd-down.txt"),
    ],
)
def test_unreachable_daemons_are_unavailable(tmp_path: Path, tool: str, capture: str) -> None:
    client = SlurmClient(**{tool: replay(tmp_path, tool, capture)})
    with pytest.raises(SlurmUnavailable) as caught:
        if tool == "sbatch":
            client.submit(tmp_path / "job.sh", job_name="tes-x")
        elif tool == "squeue":
            client.queue(["1", "2"])
        elif tool == "scancel":
            client.cancel(["1"])
        else:
            client.accounting(["1"])
    assert caught.value.returncode == exit_code_of(capture)
    assert "try again later" in str(caught.value)
    assert not isinstance(caught.value, SlurmRejected)
    # The daemon never got the request (connection refused): the command did nothing.
    assert caught.value.outage is Outage.UNREACHABLE and not caught.value.may_have_acted


def test_sacct_answers_while_slurmctld_is_down() -> None:
    jobs = parse_sacct(data("sacct-controller-down.txt"))
    assert by_name(jobs, "tes-ok").state == "COMPLETED"


@pytest.mark.parametrize(
    "stderr",
    [
        # slurmctld killed -9 while sbatch waited for its answer (the nemesis soak, 22.05):
        # it used to be taken for a refusal, and the task ended SYSTEM_ERROR.
        "sbatch: error: slurm_msg_sendto: address:port=127.0.0.1:6817 msg_type=4003: "
        "Unexpected missing socket error\n"
        "sbatch: error: Batch job submission failed: Unexpected missing socket error",
        "sbatch: error: Batch job submission failed: "
        "Unable to contact slurm controller (receive failure)",
        # The same, a later nemesis run on PostgreSQL: the task ended SYSTEM_ERROR "Slurm
        # refused the job: Batch job submission failed: Connection reset by peer".
        "sbatch: error: Batch job submission failed: Connection reset by peer",
        "sbatch: error: Batch job submission failed: Broken pipe",
    ],
)
def test_slurmctld_gone_in_the_middle_of_a_request_may_have_acted(stderr: str) -> None:
    error = slurm.command_error(
        subprocess.CompletedProcess(["sbatch", "job.sh"], 1, "", stderr), "running sbatch"
    )
    assert isinstance(error, SlurmUnavailable) and not isinstance(error, SlurmRejected)
    assert error.outage is Outage.UNCERTAIN and error.may_have_acted


def test_command_time_out_is_unavailable(tmp_path: Path) -> None:
    client = SlurmClient(squeue=replay(tmp_path, "squeue", sleep=5), timeout=0.3)
    with pytest.raises(SlurmUnavailable, match=r"did not answer within 0\.3 s") as caught:
        client.queue(["1"])
    assert caught.value.outage is Outage.UNCERTAIN and caught.value.may_have_acted


def test_missing_command_is_an_error_that_says_how_to_fix_it(tmp_path: Path) -> None:
    client = SlurmClient(sacct=str(tmp_path / "no-sacct"))
    with pytest.raises(SlurmError, match="not found") as caught:
        client.accounting(["1"])
    assert not isinstance(caught.value, SlurmUnavailable)


def test_queue_asks_once_for_all_jobs(tmp_path: Path) -> None:
    ids = sorted(parse_squeue(data("squeue-ended.txt")), key=int)
    client = SlurmClient(squeue=replay(tmp_path, "squeue", "squeue-ended.txt"))
    jobs = client.queue(list(reversed(ids)))
    (call,) = calls(tmp_path, "squeue")
    assert f"--jobs={','.join(ids)}" in call
    assert "--states=all" in call and "-h" in call.split()
    assert sorted(jobs, key=int) == ids


def test_queue_lists_the_service_accounts_jobs_for_many_ids(tmp_path: Path) -> None:
    # slurmctld matches a --jobs list against every job it holds: for 1,000 ids and more the
    # client lists its own user's jobs and keeps those it was asked about.
    listed = parse_squeue(data("squeue-active.txt"))
    asked = sorted(listed, key=int)[:2] + [str(900_000 + i) for i in range(QUEUE_BY_USER_FROM)]
    client = SlurmClient(
        squeue=replay(tmp_path, "squeue", "squeue-active.txt"), queue_user="tes-bridge"
    )
    jobs = client.queue(asked)
    # (the first call of a thousand reads squeue's version: this one's reads as 22.05's)
    (call,) = [c for c in calls(tmp_path, "squeue") if c != "--version"]
    assert "--user=tes-bridge" in call.split() and "--all" in call.split()
    assert "--jobs" not in call
    assert set(jobs) == set(sorted(listed, key=int)[:2])  # the user's other jobs are left out
    # Fewer ids, or no queue_user (site mode: jobs belong to their owners), still name them.
    client.queue(asked[:10])
    SlurmClient(squeue=replay(tmp_path, "squeue2", "squeue-active.txt")).queue(asked)
    asked_jobs = [
        c for c in calls(tmp_path, "squeue") + calls(tmp_path, "squeue2") if c != "--version"
    ]
    assert all("--jobs=" in c for c in asked_jobs[1:])


def test_queue_of_a_single_forgotten_job_is_empty(tmp_path: Path) -> None:
    # squeue exits 1 with "Invalid job id specified" for ONE unknown id, 0 for several.
    client = SlurmClient(squeue=replay(tmp_path, "squeue", "squeue-unknown-job.txt"))
    assert client.queue(["999999"]) == {}
    client = SlurmClient(squeue=replay(tmp_path, "squeue2", "squeue-unknown-jobs.txt"))
    (known,) = parse_squeue(data("squeue-unknown-jobs.txt"))
    assert set(client.queue(["999999", known])) == {known}


def test_empty_inputs_run_no_command(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent")
    client = SlurmClient(sbatch=missing, squeue=missing, sacct=missing, scancel=missing)
    assert client.queue([]) == {}
    assert client.accounting(set()) == {}
    assert client.find_by_names([]) == {}
    client.cancel([])


def test_accounting_asks_once_and_merges_steps(tmp_path: Path) -> None:
    ids = sorted(parse_sacct(data("sacct-ended.txt")), key=int)
    client = SlurmClient(sacct=replay(tmp_path, "sacct", "sacct-ended.txt"))
    jobs = client.accounting(ids)
    (call,) = calls(tmp_path, "sacct")
    assert f"-P -n --jobs={','.join(ids)} --format=" in call
    assert sorted(jobs, key=int) == ids and len(ids) == 9


def test_cancel_asks_once(tmp_path: Path) -> None:
    client = SlurmClient(scancel=replay(tmp_path, "scancel", "scancel-unknown-job.txt"))
    client.cancel(["3", "1", "2", "1"])
    assert calls(tmp_path, "scancel") == ["-v 1 2 3"]


def test_find_by_names_uses_squeue_and_sacct_with_a_start_time(tmp_path: Path) -> None:
    client = SlurmClient(
        squeue=replay(tmp_path, "squeue", "squeue-by-name.txt"),
        sacct=replay(tmp_path, "sacct", "sacct-by-name.txt"),
    )
    found = client.find_by_names(["tes-ok", "tes-fail", "tes-nosuch"])
    (sq,) = calls(tmp_path, "squeue")
    (sa,) = calls(tmp_path, "sacct")
    assert "--name=tes-fail,tes-nosuch,tes-ok" in sq and "--states=all" in sq
    assert "--name=tes-fail,tes-nosuch,tes-ok" in sa and "--starttime=" in sa
    assert set(found) == {"tes-ok", "tes-fail"}
    # The same name submitted in several capture runs: squeue has forgotten the older jobs,
    # sacct has them all. Together, oldest first.
    ok_ids = [j.job_id for j in found["tes-ok"]]
    in_squeue = {j.job_id for j in parse_squeue(data("squeue-by-name.txt")).values()}
    in_sacct = {j.job_id for j in parse_sacct(data("sacct-by-name.txt")).values()}
    assert len(ok_ids) >= 2 and ok_ids == sorted(ok_ids, key=int)
    assert set(ok_ids) <= in_squeue | in_sacct and set(ok_ids) & in_squeue
    latest_fail = found["tes-fail"][-1]
    assert (latest_fail.state, latest_fail.exit_code) == ("FAILED", 3)  # sacct's exit code kept


@pytest.mark.parametrize("name", ["", "a|b", "two\nlines"])
def test_bad_job_names_are_refused_before_any_command(tmp_path: Path, name: str) -> None:
    client = SlurmClient(sbatch=str(tmp_path / "absent"))
    with pytest.raises(ValueError):
        client.submit(tmp_path / "job.sh", job_name=name)


def test_bad_job_ids_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        SlurmClient(squeue=str(tmp_path / "absent")).queue(["12; rm -rf /"])


def test_module_logger_name() -> None:
    assert slurm.log.name == "bridge.slurm"


# --- the child processes: killed whole on a time-out, and with the poller -------------------


def _slow_sbatch(tmp_path: Path, before: float, after: float) -> Path:
    """An sbatch wrapper that sleeps, then "submits" (writes a file), then sleeps again."""
    script = tmp_path / "slow-sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"sleep {before}\n"
        f"echo submitted >>{tmp_path}/jobs\n"
        "echo 42\n"
        # A child that is not exec'd: it must die with the group, not finish on its own.
        f"(sleep {after}; echo late >>{tmp_path}/jobs) &\n"
        "wait\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_a_command_that_times_out_is_killed_with_its_children(tmp_path: Path) -> None:
    client = slurm.SlurmClient(sbatch=str(_slow_sbatch(tmp_path, 0, 2)), timeout=0.5)
    with pytest.raises(slurm.SlurmUnavailable, match=r"did not answer within 0\.5 s"):
        client.submit(tmp_path / "job.sh", job_name="tes-x")
    time.sleep(2.5)
    assert (tmp_path / "jobs").read_text() == "submitted\n"  # the late child never wrote


def test_sbatch_dies_with_the_process_that_runs_it(tmp_path: Path) -> None:
    wrapper = _slow_sbatch(tmp_path, 1.5, 0)
    code = (
        "from pathlib import Path; from bridge.slurm import SlurmClient; "
        f"SlurmClient(sbatch={str(wrapper)!r}, timeout=30).submit(Path('job.sh'), job_name='x')"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.8)  # sbatch is running, not yet submitted
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    time.sleep(2)
    assert not (tmp_path / "jobs").exists()  # it never submitted after its parent died
