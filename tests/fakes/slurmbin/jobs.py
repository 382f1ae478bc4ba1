"""What the stand-in squeue and sacct share: the jobs sbatch wrote, and their state by age."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

DIR = Path(os.environ["FAKE_SLURM_DIR"])
RUN = float(os.environ.get("FAKE_SLURM_RUN", "1"))
MIN_JOB_AGE = float(os.environ.get("FAKE_SLURM_MIN_JOB_AGE", "3"))


def log_call(command: str) -> None:
    with open(DIR / "calls.log", "a") as log:
        log.write(f"{time.time():.6f} {command}\n")


@dataclass
class Job:
    job_id: str
    name: str
    task_dir: str
    submitted: float
    cancelled: float | None

    @property
    def canceled_early(self) -> bool:
        """scancel came before the job ended (after, it changed nothing)."""
        return self.cancelled is not None and self.cancelled < self.submitted + RUN

    def end(self) -> float:
        return self.cancelled if self.canceled_early else self.submitted + RUN  # type: ignore[return-value]

    def state(self, now: float) -> str:
        if now >= self.end():
            return "CANCELLED" if self.canceled_early else "COMPLETED"
        return "RUNNING"


def _stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def load(job_id: str) -> Job | None:
    try:
        submitted, name, task_dir = (DIR / "jobs" / job_id).read_text().split()
    except (OSError, ValueError):
        return None
    try:
        cancelled: float | None = float((DIR / "jobs" / f"{job_id}.cancelled").read_text())
    except OSError:
        cancelled = None
    return Job(job_id, name, task_dir, float(submitted), cancelled)


def _all_ids() -> list[str]:
    return [p.name for p in (DIR / "jobs").glob("*") if p.name.isdigit()]


def select(argv: list[str], now: float, *, forgotten: bool = False) -> list[Job]:
    """The jobs argv names (--jobs, --name, or every job for --user); squeue forgets a job
    MIN_JOB_AGE seconds after it ended, sacct (`forgotten`) never does."""
    ids: list[str] = []
    names: set[str] = set()
    for arg in argv[1:]:
        if arg.startswith("--jobs="):
            ids += arg.split("=", 1)[1].split(",")
        elif arg.startswith("--name="):
            names |= set(arg.split("=", 1)[1].split(","))
        elif arg.startswith("--user="):
            ids += _all_ids()
    if names:
        ids += _all_ids()
    jobs = []
    for job_id in dict.fromkeys(ids):
        job = load(job_id)
        if job is None or (names and job.name not in names):
            continue
        if not forgotten and job.state(now) != "RUNNING" and now > job.end() + MIN_JOB_AGE:
            continue
        if job.state(now) == "COMPLETED":
            _write_records(job)
        jobs.append(job)
    return jobs


def _write_records(job: Job) -> None:
    """What the job script leaves when it ends (written once, the first time it is seen ended)."""
    records = Path(job.task_dir) / "records" / job.job_id
    if (records / "outcome").exists() or not Path(job.task_dir).is_dir():
        return
    (records / "executors" / "0").mkdir(parents=True, exist_ok=True)
    (records / "executors" / "0" / "exit_code").write_text("0\n")
    (records / "phase").write_text("done\n")
    (records / "outcome").write_text("complete\n")


def squeue_line(job: Job, now: float) -> str:
    state = job.state(now)
    end = _stamp(job.end()) if state != "RUNNING" else "N/A"
    return f"{job.job_id}|{job.name}|{state}|None|n1|main|{_stamp(job.submitted)}|{end}|0:01|(null)"


def sacct_lines(job: Job, now: float) -> str:
    state = job.state(now)
    start = _stamp(job.submitted)
    end = _stamp(job.end()) if state != "RUNNING" else "Unknown"
    code = "0:15" if state == "CANCELLED" else "0:0"
    said = "CANCELLED by 0" if state == "CANCELLED" else state  # sacct names who cancelled
    return (
        f"{job.job_id}|{job.name}|{said}|0:0|None|n1|main|{start}|{end}|1||(null)\n"
        f"{job.job_id}.batch|batch|{state}|{code}||n1||{start}|{end}|1|1024K|\n"
    )
