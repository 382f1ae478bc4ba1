"""The checks at the end, against sacct and the API: none lost, none run twice, none falsely
failed, the outputs right, the API's errors and latency outside the faults' windows."""

from __future__ import annotations

import itertools
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

from bench.common import (
    array_manifests,
    list_tasks,
    percentile,
)
from bench.nemesis.cluster import slurm_env, wait_until
from bench.nemesis.workload import TERMINAL, Call, Task
from bridge.core.naming import NO_RECORDS_EXIT_CODE, SUPERSEDED_EXIT_CODE, job_name


def list_all(api: str, view: str = "FULL") -> list[dict[str, Any]]:
    return list_tasks(api, {"view": view, "page_size": "256"})


def sacct_jobs(
    since: str, names: set[str], arrays: dict[str, list[str]] | None = None
) -> dict[str, list[dict[str, str]]]:
    """The Slurm jobs named `names`, every run of each (-D), once none is in the queue any
    more (sacct keeps a job that slurmctld forgot, killed -9, as RUNNING for ever); with the
    elements of the job arrays `arrays` names (array name -> the job name of each element's
    task, in order) under their task's job name."""
    arrays = arrays or {}

    def queued() -> bool:
        out = subprocess.run(["squeue", "-h", "-o", "%j"], env=slurm_env(), capture_output=True,
                             text=True, check=False).stdout  # fmt: skip
        return bool(set(out.split()) & (names | set(arrays)))

    wait_until(lambda: not queued(), 180, 2)
    time.sleep(5)  # slurmdbd records a job's end a moment after it leaves the queue
    out = subprocess.run(
        ["sacct", "-n", "-X", "-D", "-P", "--allusers", "-S", since, "-o",
         "JobID,JobName,State,ExitCode,NodeList,Start,End"],
        env={**slurm_env(), "TZ": "UTC", "SLURM_TIME_FORMAT": "standard"},
        capture_output=True, text=True, check=False, timeout=120,
    ).stdout  # fmt: skip
    jobs: dict[str, list[dict[str, str]]] = {}
    for line in out.splitlines():
        job_id, name, state, code, node, start, end = line.split("|")
        element = job_id.partition("_")[2]
        if name in arrays and element.isdigit() and int(element) < len(arrays[name]):
            name = arrays[name][int(element)]  # an element: its task's
        if name in names:
            jobs.setdefault(name, []).append({"id": job_id, "state": state.split()[0],
                "exit": code, "node": node, "start": start, "end": end})  # fmt: skip
    return jobs


def named_jobs(task: dict[str, Any]) -> set[str]:
    """Every job id the task's logs[] name: each attempt's job and the jobs it lost."""
    named = set()
    for entry in task.get("logs") or []:
        metadata = entry.get("metadata") or {}
        if metadata.get("slurm_job_id"):
            named.add(str(metadata["slurm_job_id"]))
        named |= {j for j in metadata.get("slurm_lost_job_ids", "").split(",") if j}
    return named


def ended_by_node_kill(
    job: dict[str, str], node_kills: Sequence[tuple[str, str]]
) -> dict[str, str]:
    """The job with its end at the first kill of its node's processes while it ran: Slurm
    records the end of such a job only when it notices (NODE_FAIL after SlurmdTimeout, or
    much later when a slurmctld killed -9 came back from an older state and still had it
    running), though nothing of it ran past the kill."""
    start, end = job["start"], job["end"]
    for node, killed_at in sorted(node_kills, key=lambda kill: kill[1]):
        if (
            node == job["node"]
            and start <= killed_at
            and (end in ("", "Unknown") or killed_at < end)
        ):
            return {**job, "end": killed_at}
    return job


def ran_to_its_end(job: dict[str, str]) -> bool:
    """The job's script ran the task to its end: COMPLETED, or FAILED with the code of an
    executor that failed or of a staging failure (never one of the script's own codes for a
    job that ran nothing or stood down, nor a signal)."""
    if job["state"] == "COMPLETED":
        return True
    code, _, signal = job["exit"].partition(":")
    own = (str(NO_RECORDS_EXIT_CODE), str(SUPERSEDED_EXIT_CODE))
    return job["state"] == "FAILED" and signal in ("", "0") and code not in own


def never_began(job: dict[str, str], task_dir: Path) -> bool:
    """Slurm ended the job COMPLETED 0:0 though its script never began: it left no
    records/<id>/start_time, the job script's first record. Slurm does so when the launch of a
    batch job fails on its node (slurmstepd cannot start the script, as when a slurmctld back
    from an older state gives out an id its node still holds; the node drains "batch job
    complete failure") and the job may not be requeued: the job's own exit status is then 0."""
    return (
        job["state"] == "COMPLETED"
        and job["exit"] == "0:0"
        and not (task_dir / "records" / job["id"] / "start_time").exists()
    )


def ran_twice(
    task: dict[str, Any],
    jobs: list[dict[str, str]],
    node_kills: Sequence[tuple[str, str]] = (),
    task_dir: Path | None = None,
) -> str | None:
    """Why the task ran more than once, or None: more than one run to its end, a job its logs
    do not name, a run that ended before another one started, or two runs at once
    (a job's run ends at the latest when the nemesis killed its node's processes). With the
    task's directory, a job whose script never began (:func:`never_began`) is no run."""
    # A job slurmctld forgot before it started stays PENDING in sacct for ever: not a run.
    jobs = [j for j in jobs if j["start"] not in ("", "None", "Unknown")]
    if task_dir is not None:
        jobs = [j for j in jobs if not never_began(j, task_dir)]
    ended = [j for j in jobs if ran_to_its_end(j)]
    if len(ended) > 1:
        return f"{len(ended)} runs to their end: {jobs}"
    unnamed = _unnamed(task, jobs)
    if unnamed:
        return f"jobs {unnamed} not in its logs: {jobs}"
    return _one_after_another(jobs, node_kills)


def _unnamed(task: dict[str, Any], jobs: list[dict[str, str]]) -> list[str]:
    """The runs the task's logs do not name."""
    # A duplicate of an interrupted submission, canceled before it ran, may go unnamed.
    return [
        j["id"]
        for j in jobs
        if j["id"] not in named_jobs(task)
        and not (j["state"] == "CANCELLED" and j["node"] in ("", "None assigned"))
    ]


def _one_after_another(
    jobs: list[dict[str, str]], node_kills: Sequence[tuple[str, str]]
) -> str | None:
    """Why the runs did not follow one another, each after the one before ended and none
    after one that completed, or None."""
    ordered = sorted(
        jobs, key=lambda j: j["start"] if j["start"] not in ("", "None", "Unknown") else "~"
    )
    for before, after in itertools.pairwise(ordered):
        before = ended_by_node_kill(before, node_kills)
        if ran_to_its_end(before):
            return f"job {after['id']} after job {before['id']} ran to its end: {jobs}"
        started = after["start"] not in ("", "None", "Unknown")
        if started and before["end"] not in ("", "Unknown") and after["start"] < before["end"]:
            return f"jobs {before['id']} and {after['id']} ran at once: {jobs}"
    return None


def failure_explained(task: dict[str, Any], jobs: list[dict[str, str]], retries: int) -> bool:
    """A SYSTEM_ERROR the task's own doing does not explain is still no false failure when
    its retry budget went on real node losses."""
    lost = [j for j in jobs if j["state"] in ("NODE_FAIL", "BOOT_FAIL")]
    return task["state"] == "SYSTEM_ERROR" and len(lost) > retries


def output_wrong(task: dict[str, Any], planned: Task) -> str | None:
    if task["state"] != "COMPLETE" or planned.stdout is None:
        return None
    try:
        stdout = task["logs"][-1]["logs"][0].get("stdout")
    except (KeyError, IndexError):
        stdout = None
    if stdout != planned.stdout:
        return f"stdout {stdout!r}, not {planned.stdout!r}"
    for path, content in planned.files.items():
        found = path.read_text() if path.exists() else None
        if found != content:
            return f"{path}: {found!r}, not {content!r}"
    return None


def in_windows(call: Call, windows: list[list[float]]) -> bool:
    return any(call.start <= end and call.end >= start for start, end in windows)


def _lost(api: str, created: list[Task], listed: dict[str, dict[str, Any]]) -> list[str | None]:
    """The acknowledged tasks the listing lacks, or that cannot be retrieved."""
    lost = [t.id for t in created if t.id not in listed]
    for acknowledged in created:
        got = requests.get(f"{api}/tasks/{acknowledged.id}", params={"view": "MINIMAL"}, timeout=30)
        if got.status_code != 200 and acknowledged.id not in lost:
            lost.append(acknowledged.id)
    return lost


def _judge(
    task: dict[str, Any],
    mine: list[dict[str, str]],
    plan: Task | None,
    retries: int,
    node_kills: Sequence[tuple[str, str]],
    found: dict[str, list[Any]],
    task_dir: Path,
) -> None:
    """One listed task's faults, each added to its list in `found`."""
    expected = plan.expected if plan else "COMPLETE"
    summary = {"id": task["id"], "name": task.get("name"), "state": task["state"]}
    if task["state"] not in TERMINAL:
        found["not_final"].append(summary)
        return
    why = ran_twice(task, mine, node_kills, task_dir)
    if why:
        found["twice"].append({**summary, "why": why})
    if task["state"] != expected and not failure_explained(task, mine, retries):
        system_logs = [x for e in task.get("logs") or [] for x in e.get("system_logs", [])]
        found["falsely_failed"].append(
            {**summary, "expected": expected, "jobs": mine, "system_logs": system_logs[-8:]}
        )
    bad = output_wrong(task, plan) if plan else None
    if bad:
        found["wrong_outputs"].append({**summary, "why": bad})


def check(
    api: str,
    planned: dict[str, Task],
    created: list[Task],
    since: str,
    retries: int,
    node_kills: Sequence[tuple[str, str]],
    work_dir: Path,
) -> dict[str, Any]:
    """Every task final, listed, retrievable, run once (array elements counted by the array
    scripts in `work_dir`), in the state its own command explains and with the right
    outputs; the Snakemake tasks (not planned here) must complete."""
    tasks = list_all(api)
    lost = _lost(api, created, {t["id"]: t for t in tasks})
    job_names = {t["id"]: job_name(t["id"], t.get("name")) for t in tasks}
    arrays = {
        name: [job_names.get(task_id, "") for task_id in elements]
        for name, elements in array_manifests(work_dir).items()
    }
    jobs = sacct_jobs(since, set(job_names.values()), arrays)
    found: dict[str, list[Any]] = {
        "lost": lost, "not_final": [], "twice": [], "falsely_failed": [], "wrong_outputs": []
    }  # fmt: skip
    by_kind: dict[str, int] = {}
    for task in tasks:
        plan = planned.get(task.get("name", ""))
        kind = plan.kind if plan else ("warm-up" if task.get("name") == "warm-up" else "workflow")
        by_kind[kind] = by_kind.get(kind, 0) + 1
        mine = jobs.get(job_names[task["id"]], [])
        _judge(task, mine, plan, retries, node_kills, found, work_dir / task["id"])
    names = [t.get("name") for t in tasks if t.get("name", "").startswith("nemesis-")]
    return {
        "tasks": len(tasks),
        "by_kind": by_kind,
        "acknowledged": len(created),
        "created_twice_by_client_retries": len(names) - len(set(names)),
        "slurm_jobs": sum(len(js) for js in jobs.values()),
        **{name: len(items) for name, items in found.items()},
        "details": {name: items[:20] for name, items in found.items()},
    }


def api_figures(
    calls: list[Call], down: list[list[float]], worker: list[list[float]]
) -> dict[str, Any]:
    five_xx = [c for c in calls if c.status >= 500 and not in_windows(c, down)]
    up = [c for c in calls if not in_windows(c, down + worker)]
    errors = [c for c in up if c.status == 0]
    answered = [c.end - c.start for c in up if c.status]
    return {
        "requests": len(calls),
        "five_xx": sum(1 for c in calls if c.status >= 500),
        "five_xx_while_up": len(five_xx),
        "no_answer_while_up": len(errors),
        "p50_ms_while_up": _ms(answered, 50),
        "p99_ms_while_up": _ms(answered, 99),
        "max_ms_while_up": _ms(answered, 100),
        "down_seconds": round(sum(end - start for start, end in down), 1),
        "examples_while_up": [c.__dict__ for c in (five_xx + errors)[:10]],
    }


def _ms(seconds: list[float], pct: float) -> float | None:
    """The `pct` percentile of `seconds` in ms (100: the largest), or None when there are none."""
    return round(1000 * percentile(seconds, pct), 1) if seconds else None
