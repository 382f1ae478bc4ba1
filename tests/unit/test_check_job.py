"""`tes-bridge check --job`'s reading of its job, with the job's script run at once by bash on
this host (a node that shares every filesystem). tests/cluster/test_check.py submits it to the
real cluster, and from a login node whose work directory the nodes do not see."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge.cli.check_job import FIX_PYTHON, JobFailed, NodeJob
from bridge.config import Config, load_config
from bridge.slurm import JobInfo

ROOT = Path(__file__).parents[2]


class LocalSlurm:
    """sbatch that runs the script to its end on this host; squeue knows nothing, sacct the
    jobs it ran. `pending`: jobs are queued and never start."""

    def __init__(self, *, pending: bool = False) -> None:
        self.pending = pending
        self.jobs: dict[str, JobInfo] = {}
        self.canceled: list[str] = []
        self.users: list[str | None] = []

    def _info(self, job_id: str, state: str, code: int | None) -> JobInfo:
        return JobInfo(
            job_id, "tes-bridge-check", state, None, code, 0, "node9", "main", *[None] * 5
        )

    def submit(self, script: Path, *, job_name: str, as_user: str | None = None) -> str:
        job_id = str(1000 + len(self.jobs))
        self.users.append(as_user)
        if self.pending:
            self.jobs[job_id] = self._info(job_id, "PENDING", None)
            return job_id
        output = re.search(r"^#SBATCH --output=(.*)$", script.read_text(), re.M)
        assert output is not None
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(output.group(1).replace("%j", job_id), "w") as out:
            code = subprocess.run(
                ["bash", str(script)], stdout=out, stderr=subprocess.STDOUT, env=env, timeout=60
            ).returncode
        self.jobs[job_id] = self._info(job_id, "COMPLETED" if code == 0 else "FAILED", code)
        return job_id

    def queue(self, job_ids: Any) -> dict[str, JobInfo]:
        return {i: self.jobs[i] for i in job_ids if self.jobs[i].state == "PENDING"}

    def accounting(self, job_ids: Any) -> dict[str, JobInfo]:
        return {i: self.jobs[i] for i in job_ids}

    def cancel(self, job_ids: Any, *, as_user: str | None = None) -> None:
        self.canceled += job_ids


def config(tmp_path: Path, *, allow_root: bool = True, **job: Any) -> Config:
    (tmp_path / "state" / "work").mkdir(parents=True)
    return load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"container.allow_root": allow_root, **{f"job.{k}": v for k, v in job.items()}},
    )


def node_job(cfg: Config, slurm: LocalSlurm, **kwargs: Any) -> NodeJob:
    job = NodeJob(cfg, "tesbridge", os.geteuid(), timeout=kwargs.pop("timeout", 30), **kwargs)
    job.slurm = slurm  # type: ignore[assignment]
    return job


def test_a_job_that_runs_job_python_in_the_shared_work_dir_passes(tmp_path: Path) -> None:
    cfg = config(tmp_path, python=sys.executable)
    slurm = LocalSlurm()
    said = node_job(cfg, slurm).run()
    assert re.fullmatch(
        rf"job 1000 ran job\.python \({re.escape(sys.executable)}, Python 3\.[0-9.]+, "
        rf"tes-bridge [0-9.]+\w*\) on \S+, which shares {cfg.work_dir} with this host "
        r"\([0-9.]+ s\)",
        said,
    ), said
    assert slurm.users == [None]  # as this process: it is the service account
    assert list(cfg.work_dir.iterdir()) == []  # its directory is gone


def test_a_job_python_that_does_not_run_names_the_environment(tmp_path: Path) -> None:
    cfg = config(tmp_path, python="/nonexistent/venv/bin/python")
    with pytest.raises(JobFailed) as info:
        node_job(cfg, LocalSlurm()).run()
    message = str(info.value)
    assert message.startswith("job 1000 on node9 ended FAILED, exit code 127 without running ")
    assert "/nonexistent/venv/bin/python: No such file or directory" in message
    assert info.value.fix == FIX_PYTHON
    assert list(cfg.work_dir.iterdir()) == []


def test_a_python_without_the_bridge_fails(tmp_path: Path) -> None:
    # The system's Python, where `import bridge` finds nothing (isolated: no PYTHONPATH).
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\nexec /usr/bin/python3 -I "$@"\n')
    python.chmod(0o755)
    cfg = config(tmp_path, python=str(python))
    with pytest.raises(JobFailed, match="No module named 'bridge'") as info:
        node_job(cfg, LocalSlurm()).run()
    assert info.value.fix == FIX_PYTHON


def test_a_job_that_does_not_start_in_time_is_canceled(tmp_path: Path) -> None:
    cfg = config(tmp_path, python=sys.executable)
    slurm = LocalSlurm(pending=True)
    with pytest.raises(JobFailed, match=r"job 1000 had not ended after 0.3 s: PENDING"):
        node_job(cfg, slurm, timeout=0.3, poll=0.1).run()
    assert slurm.canceled == ["1000"]
    assert list(cfg.work_dir.iterdir()) == []


def test_a_root_service_account_is_refused_unless_root_may_run_jobs(tmp_path: Path) -> None:
    cfg = config(tmp_path, allow_root=False)
    job = NodeJob(cfg, "root", 0, timeout=1)
    job.slurm = LocalSlurm()  # type: ignore[assignment]
    with pytest.raises(JobFailed, match="the service account is root"):
        job.run()


@pytest.mark.skipif(os.geteuid() != 0, reason="root checks for another account")
def test_root_submits_as_the_service_account_in_a_directory_of_its_own(tmp_path: Path) -> None:
    cfg = config(tmp_path, python=sys.executable)
    owners: list[int] = []

    class Recording(LocalSlurm):
        def submit(self, script: Path, *, job_name: str, as_user: str | None = None) -> str:
            owners.append(script.parent.stat().st_uid)
            return super().submit(script, job_name=job_name, as_user=as_user)

    slurm = Recording()
    job = NodeJob(cfg, "nobody", 65534, timeout=30)
    job.slurm = slurm  # type: ignore[assignment]
    assert "ran job.python" in job.run()
    assert slurm.users == ["nobody"]  # through sudo -u, as that account
    assert owners == [65534]
    assert list(cfg.work_dir.iterdir()) == []
