"""`tes-bridge check --job`: one small job on a compute node shows what every task needs there.

The login node writes a token into a directory of its own under the work directory and submits
a job (the service account's, with the site's partition, directives and prologue, as a task's
job gets them). On the node the job runs `job.python`, which imports the job side of the
bridge, reads the token from that directory and writes back what it saw (node, Python, the
bridge's version). The login node then reads that answer where it wrote the token: both sides
saw each other's files, so the work directory is one filesystem at the same path on both (a
directory local to the login node fails here, since the node finds no token, or the login
node no answer). The directory is removed after, whatever happened; a job that has not ended
in time is canceled.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shlex
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from bridge import __version__
from bridge.config import Config
from bridge.slurm import JobInfo, SlurmClient, SlurmError

#: The job's name in squeue and sacct.
JOB_NAME = "tes-bridge-check"
#: Files of the job's directory: the login node's token, the node's answer.
TOKEN, ANSWER = "token", "answer.json"
#: Run by job.python on the node: what a job's records need (the job side imports), the
#: token the login node wrote, and an answer written next to it (renamed into place whole).
NODE_CODE = """\
import json, os, platform, socket, sys
import bridge, bridge.job.cli
here = sys.argv[1]
with open(os.path.join(here, "token")) as f:
    token = f.read().strip()
answer = {"token": token, "node": socket.gethostname(), "python": platform.python_version(),
          "executable": sys.executable, "bridge": bridge.__version__}
with open(os.path.join(here, "answer.tmp"), "w") as f:
    json.dump(answer, f)
os.rename(os.path.join(here, "answer.tmp"), os.path.join(here, "answer.json"))
"""
FIX_SHARED = (
    "put job.work_dir (and container.cache_dir) on the filesystem the compute nodes mount, "
    "at the same path on the login node and on every node"
)
FIX_PYTHON = (
    "job.python must be a Python with tes-bridge installed (its virtual environment on the "
    "shared filesystem, the same release as the service's), at the same path on every node"
)


class JobFailed(Exception):
    """The job did not show what it should: the message says what, `fix` what to do."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class NodeJob:
    """The job of `check --job`, submitted as the service account (`user`, `uid`)."""

    def __init__(
        self,
        config: Config,
        user: str,
        uid: int,
        *,
        timeout: float,
        settle: float = 10.0,
        poll: float = 1.0,
    ) -> None:
        self.config = config
        self.user = user
        self.uid = uid
        self.timeout = timeout
        #: After the job ended, how long its answer may take to show here (a filesystem
        #: that caches what it read of the directory).
        self.settle = settle
        self.poll = poll
        slurm = config.slurm
        self.slurm = SlurmClient(
            sbatch=slurm.sbatch,
            squeue=slurm.squeue,
            sacct=slurm.sacct,
            scancel=slurm.scancel,
            timeout=slurm.command_timeout,
            sudo=config.site.sudo,
        )
        #: Root checking for the service account submits through sudo, as that account.
        self.as_user = user if uid != os.geteuid() else None

    def run(self) -> str:
        if self.uid == 0 and not self.config.container.allow_root:
            raise JobFailed(
                "the service account is root: its jobs would run as root, which the poller "
                "refuses (container.allow_root = false)",
                "run check as the service account (sudo -u tesbridge tes-bridge check --job)",
            )
        started = time.monotonic()
        with self._directory() as here:
            token = secrets.token_hex(16)
            (here / TOKEN).write_text(token + "\n")
            (here / TOKEN).chmod(0o644)
            job_id = self._submit(here)
            info = self._wait(job_id, here)
            answer = self._answer(here, job_id, info)
        return self._judge(answer, token, job_id, time.monotonic() - started)

    @contextlib.contextmanager
    def _directory(self) -> Iterator[Path]:
        work = self.config.work_dir
        if not work.is_dir():
            raise JobFailed(f"{work} does not exist", "see the work dir check")
        here = work / f".check-{secrets.token_hex(6)}"
        here.mkdir()
        try:
            here.chmod(0o755)
            if self.uid != os.geteuid():
                os.chown(here, self.uid, pwd.getpwuid(self.uid).pw_gid)
            yield here
        finally:
            shutil.rmtree(here, ignore_errors=True)

    def _script(self, here: Path) -> Path:
        slurm = self.config.slurm
        directives = [
            f"--job-name={JOB_NAME}",
            f"--output={here}/slurm-%j.out",
            f"--chdir={here}",
            "--nodes=1",
            "--ntasks=1",
            "--cpus-per-task=1",
            "--mem=512M",
            "--time=2",
            "--no-requeue",
        ]
        if slurm.default_partition:
            directives.append(f"--partition={slurm.default_partition}")
        lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in [*directives, *slurm.extra_directives])]
        lines += [
            "# tes-bridge check --job: job.python on a compute node, in the work directory.",
            slurm.prologue,
            f"exec {shlex.quote(self.config.job.python)} -c {shlex.quote(NODE_CODE)} "
            f"{shlex.quote(str(here))}",
        ]
        script = here / "check.sh"
        script.write_text("\n".join(lines) + "\n")
        script.chmod(0o644)  # sbatch reads it as the service account
        return script

    def _submit(self, here: Path) -> str:
        try:
            return self.slurm.submit(self._script(here), job_name=JOB_NAME, as_user=self.as_user)
        except SlurmError as exc:
            raise JobFailed(
                f"sbatch refused the job: {' '.join(str(exc).split())[:300]}",
                "see the slurm check; slurm.default_partition and slurm.extra_directives must "
                "be what sbatch accepts for the service account",
            ) from None

    def _state(self, job_id: str) -> JobInfo | None:
        with contextlib.suppress(SlurmError):
            found = self.slurm.queue([job_id]).get(job_id)
            return found or self.slurm.accounting([job_id]).get(job_id)
        return None

    def _wait(self, job_id: str, here: Path) -> JobInfo | None:
        """Until the answer shows here, or the job ended and either its output shows here
        (the answer will not come) or `settle` passed; canceled past `timeout`."""
        deadline = time.monotonic() + self.timeout
        ended_at: float | None = None
        info: JobInfo | None = None
        # Listing the directory (not a lookup of one name) has an NFS client read it again.
        while ANSWER not in (seen := os.listdir(here)):
            now = time.monotonic()
            if ended_at is None:
                info = self._state(job_id) or info
                if info is not None and info.ended:
                    ended_at = now
            elif f"slurm-{job_id}.out" in seen or now > ended_at + self.settle:
                break
            if ended_at is None and now > deadline:
                self._cancel(job_id)
                where = f"{info.state} ({info.reason or 'no reason given'})" if info else "unknown"
                raise JobFailed(
                    f"job {job_id} had not ended after {self.timeout:g} s: {where}; canceled",
                    f"see why it waits (`squeue -j {job_id}` while it does): a partition with "
                    "free nodes (slurm.default_partition), or a longer --job-timeout",
                )
            time.sleep(self.poll)
        return info

    def _cancel(self, job_id: str) -> None:
        with contextlib.suppress(SlurmError):
            self.slurm.cancel([job_id], as_user=self.as_user)

    def _answer(self, here: Path, job_id: str, info: JobInfo | None) -> dict[str, str]:
        try:
            answer: dict[str, str] = json.loads((here / ANSWER).read_text())
            return answer
        except (OSError, ValueError):
            pass
        node = info.node if info and info.node else "its node"
        ended = f"ended {info.state}" if info else "ended"
        if info and info.exit_code is not None:
            ended += f", exit code {info.exit_code}"
        output = here / f"slurm-{job_id}.out"
        if output.exists():
            # Its output is here, so the node wrote here: job.python did not run the code.
            said = " ".join(output.read_text(errors="replace").split())[-300:]
            raise JobFailed(
                f"job {job_id} on {node} {ended} without running job.python "
                f"({self.config.job.python}) to its end: {said or 'no output'}",
                FIX_PYTHON,
            )
        raise JobFailed(
            f"job {job_id} on {node} {ended}, and nothing it wrote in "
            f"{self.config.work_dir} is seen here: the work directory is not the same "
            "filesystem on the compute node as on this host",
            FIX_SHARED,
        )

    def _judge(self, answer: dict[str, str], token: str, job_id: str, took: float) -> str:
        node = answer.get("node", "?")
        if answer.get("token") != token:
            raise JobFailed(
                f"job {job_id} on {node} read another token than this host wrote: the work "
                "directory there is another filesystem",
                FIX_SHARED,
            )
        if answer.get("bridge") != __version__:
            raise JobFailed(
                f"job.python on {node} ({answer.get('executable')}) has tes-bridge "
                f"{answer.get('bridge')}, this host {__version__}",
                FIX_PYTHON,
            )
        return (
            f"job {job_id} ran job.python ({answer.get('executable')}, Python "
            f"{answer.get('python')}, tes-bridge {answer.get('bridge')}) on {node}, which "
            f"shares {self.config.work_dir} with this host ({took:.1f} s)"
        )
