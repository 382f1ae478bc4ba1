"""Why a task ended, in a word for the lists (bridge.core.reasons), and where it is shown: the
last attempt's metadata in the BASIC and FULL views (bridge.core.tes.render_task)."""

from __future__ import annotations

from typing import Any

import pytest

from bridge.core.reasons import (
    CANCELED_OUTSIDE,
    IMAGE_PULL_FAILED,
    IMAGE_UNREADABLE,
    OOM_KILLED,
    REASON_KEY,
    SLURM_REFUSED,
    STAGE_IN_FAILED,
    STAGE_OUT_FAILED,
    canceled_by,
    task_reason,
)
from bridge.core.tes import View, render_task


def attempt(
    *codes: int, slurm_state: str | None = None, lines: tuple[str, ...] = ()
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "logs": [{"exit_code": code} for code in codes],
        "outputs": [],
        "system_logs": list(lines),
        "metadata": {"slurm_job_id": "12"},
    }
    if slurm_state:
        entry["metadata"]["slurm_state"] = slurm_state
    return entry


ENDED = "Slurm job 12 ended in state"


@pytest.mark.parametrize(
    ("state", "entry", "reason"),
    [
        ("COMPLETE", attempt(0), ""),
        ("COMPLETE", attempt(3, 0), ""),  # the first executor had ignore_error
        ("RUNNING", attempt(0), ""),
        ("QUEUED", attempt(), ""),
        ("EXECUTOR_ERROR", attempt(0, 42, slurm_state="FAILED"), "exit 42"),
        ("EXECUTOR_ERROR", attempt(0, 42), "exit 42"),  # before sacct's final record
        ("EXECUTOR_ERROR", attempt(-1), "exit -1"),
        # Killed at its time limit: no exit code of its own, Slurm's state says why.
        ("EXECUTOR_ERROR", attempt(0, slurm_state="TIMEOUT"), "TIMEOUT"),
        ("SYSTEM_ERROR", attempt(slurm_state="TIMEOUT"), "TIMEOUT"),  # while staging
        ("EXECUTOR_ERROR", attempt(137, slurm_state="OUT_OF_MEMORY"), "OUT_OF_MEMORY"),
        # The job's own record of the kernel's kill, before sacct has the job's end.
        (
            "EXECUTOR_ERROR",
            attempt(137, lines=(f"executor 0 {OOM_KILLED} of 256 MiB (x); peak use 256 MiB",)),
            "OUT_OF_MEMORY",
        ),
        (
            "SYSTEM_ERROR",
            attempt(lines=(f"{IMAGE_PULL_FAILED}no-such/image:1 not found",)),
            "image",
        ),
        (
            "SYSTEM_ERROR",
            attempt(slurm_state="FAILED", lines=(f"{IMAGE_UNREADABLE}: /c/x.sif", STAGE_IN_FAILED)),
            "image",
        ),
        (
            "SYSTEM_ERROR",
            attempt(slurm_state="FAILED", lines=("input 0 s3://b/x: no such key", STAGE_IN_FAILED)),
            "input",
        ),
        (
            "SYSTEM_ERROR",
            attempt(0, slurm_state="FAILED", lines=("output 0 /out/x: gone", STAGE_OUT_FAILED)),
            "output",
        ),
        (
            "SYSTEM_ERROR",
            attempt(lines=(f"{SLURM_REFUSED}Requested node configuration is not available",)),
            "refused by Slurm",
        ),
        (
            "SYSTEM_ERROR",
            attempt(lines=("Slurm job 12 can never start (BadConstraints); it was canceled",)),
            "BadConstraints",
        ),
        (
            "SYSTEM_ERROR",
            attempt(slurm_state="NODE_FAIL", lines=(f"{ENDED} NODE_FAIL; no retries left (2)",)),
            "NODE_FAIL",
        ),
        (
            "SYSTEM_ERROR",
            attempt(lines=("Slurm no longer knows job 12 and it recorded",)),
            "system",
        ),
        ("SYSTEM_ERROR", attempt(slurm_state="COMPLETED"), "system"),
        ("CANCELED", attempt(lines=(canceled_by("alice"),)), "canceled by alice"),
        (
            "CANCELED",
            attempt(slurm_state="CANCELLED", lines=(canceled_by("root (an administrator)"),)),
            "canceled by root (an administrator)",
        ),
        (
            "CANCELED",
            attempt(slurm_state="CANCELLED", lines=(f"{ENDED} CANCELLED: {CANCELED_OUTSIDE}",)),
            "canceled in Slurm",
        ),
        ("CANCELED", attempt(slurm_state="CANCELLED"), "canceled"),  # no one signed in
        ("PREEMPTED", attempt(slurm_state="PREEMPTED"), "preempted"),
    ],
)
def test_the_reason_of_a_task(state: str, entry: dict[str, Any], reason: str) -> None:
    assert task_reason(state, [attempt(0), entry]) == reason


def test_the_last_attempt_gives_the_reason() -> None:
    earlier = attempt(slurm_state="TIMEOUT")
    assert task_reason("EXECUTOR_ERROR", [earlier, attempt(0, 5)]) == "exit 5"
    assert task_reason("CANCELED", None) == "canceled"
    assert task_reason("SYSTEM_ERROR", []) == "system"


def render(state: str, logs: list[dict[str, Any]], view: View) -> dict[str, Any]:
    document = {"executors": [{"image": "alpine", "command": ["true"]}]}
    return render_task(
        task_id="t1", state=state, document=document, creation_time=None, logs=logs, view=view
    )


@pytest.mark.parametrize("view", [View.BASIC, View.FULL])
def test_a_final_tasks_reason_is_in_its_last_attempts_metadata(view: View) -> None:
    """The lists read tasks in the BASIC view, which has no system_logs: the reason comes
    with the metadata; the stored logs are left as they are."""
    stored = [attempt(0, slurm_state="TIMEOUT"), attempt(0, 42, slurm_state="FAILED")]
    task = render("EXECUTOR_ERROR", stored, view)
    assert task["logs"][-1]["metadata"] == {
        "slurm_job_id": "12",
        "slurm_state": "FAILED",
        REASON_KEY: "exit 42",
    }
    assert REASON_KEY not in task["logs"][0]["metadata"]
    assert all(REASON_KEY not in entry["metadata"] for entry in stored)
    assert all(isinstance(v, str) for v in task["logs"][-1]["metadata"].values())


def test_a_task_that_has_not_failed_has_no_reason() -> None:
    for state in ("COMPLETE", "RUNNING", "QUEUED"):
        task = render(state, [attempt(0)], View.BASIC)
        assert REASON_KEY not in task["logs"][-1]["metadata"], state
    assert render("EXECUTOR_ERROR", [attempt(0, 1)], View.MINIMAL) == {
        "id": "t1",
        "state": "EXECUTOR_ERROR",
    }
    bare = {"logs": [], "outputs": [], "system_logs": [canceled_by("bob")]}
    assert render("CANCELED", [bare], View.BASIC)["logs"][0]["metadata"] == {
        REASON_KEY: "canceled by bob"
    }
