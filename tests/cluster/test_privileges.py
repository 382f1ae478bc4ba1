"""Least privilege on the real cluster (issue 11's executor privilege test, issue 10's /tmp).

The service is the one `deploy/quickstart.sh` installs and starts, run for real with its own
prefix, state directory and port: it runs as the unprivileged account `tesbridge`, so its jobs
and executors do too. Checked from the host and from inside executors: no root, no capability,
no other task's processes in /proc, /tmp and /var/tmp on disk and private to one task attempt,
inputs that cannot be changed in any file_input_mode.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.quickstart import ACCOUNT, Quickstart
from tests.fixtures.service import start_bridge_service

pytestmark = pytest.mark.cluster

GIB = 1 << 30


def _uids(pid: int) -> set[int]:
    """Real, effective, saved and filesystem uid of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    return {int(value) for value in line.split()[1:]}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _processes_with(text: str) -> dict[int, set[int]]:
    """pid -> uids of every host process whose argv contains `text`."""
    found: dict[int, set[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found[int(entry.name)] = _uids(int(entry.name))
            except OSError:
                continue
    return found


def _wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


def _sacct(job_id: str, fields: str) -> list[list[str]]:
    out = subprocess.run(
        ["sacct", "-n", "-P", f"--jobs={job_id}", f"--format={fields}"],
        capture_output=True,
        text=True,
    ).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


def _scratch_dirs(local_cluster: Any, task_id: str) -> list[str]:
    # Slurm gives jobs TMPDIR=/tmp here (their node's); the job makes
    # tes-tmp-<task id>-<job id>.XXXXXX in it.
    return [p for d in local_cluster.tmp_dirs() for p in glob.glob(f"{d}/tes-tmp-{task_id}-*")]


def sh(script: str, *args: str, **fields: Any) -> dict[str, Any]:
    return {"image": "alpine", "command": ["sh", "-c", script, *args], **fields}


# --------------------------------------------------------------------------- the account


def test_the_quickstart_service_and_its_jobs_run_as_the_account(quickstart: Quickstart):
    uid = pwd.getpwnam(ACCOUNT).pw_uid
    assert uid != 0
    pid = quickstart.pid()
    assert "tes-bridge" in Path(f"/proc/{pid}/cmdline").read_text()
    processes = [pid, *_descendants(pid)]
    assert len(processes) >= 3, processes  # gunicorn master, workers, poller supervisor
    for process in processes:
        assert _uids(process) == {uid}, (process, Path(f"/proc/{process}/cmdline").read_bytes())
    # What it owns: its own directories; not the state directory, where the local cluster's
    # state (used by root) lives too.
    assert quickstart.state.stat().st_uid == 0
    for name in ("data", "work", "images", "db", "db/tes-bridge.db", "poller.lock"):
        assert (quickstart.state / name).stat().st_uid == uid, name
    task = quickstart.wait(quickstart.create({"executors": [sh("busybox id -u")]}))
    assert task["state"] == "COMPLETE", json.dumps(task["logs"])
    assert task["logs"][-1]["logs"][0]["stdout"].strip() == str(uid)
    job_id = task["logs"][-1]["metadata"]["slurm_job_id"]
    # slurmdbd first holds a placeholder record of user root named "allocation".
    user = _wait_for(
        lambda: next(
            (r[1] for r in _sacct(job_id, "JobName,User") if r[0] == f"tes-{task['id']}"), None
        ),
        60,
        "the job's accounting record",
    )
    assert user == ACCOUNT


# --------------------------------------------------------------------------- executors


def test_executors_have_no_root_no_capability_and_see_no_other_task(quickstart: Quickstart):
    uid = pwd.getpwnam(ACCOUNT).pw_uid
    secret = f"secret-{uuid.uuid4().hex}"
    # Another task, running, with a secret in its argv.
    other = quickstart.create({"executors": [sh("sleep 300; true", secret)]})
    try:
        quickstart.wait(other, states={"RUNNING"})
        seen = _wait_for(lambda: _processes_with(secret), 60, "the other executor's processes")
        # On the host, the executor's processes belong to the account, never to root.
        assert all(uids == {uid} for uids in seen.values()), seen
        probe = sh(
            "grep CapEff /proc/self/status; echo uid=$(busybox id -u); "
            "if ( exec 3>>/proc/sys/kernel/core_pattern ) 2>/dev/null; "
            "then echo core_pattern=writable; else echo core_pattern=refused; fi; "
            "for f in /proc/[0-9]*/cmdline; do cat $f; echo; done"
        )
        task = quickstart.wait(quickstart.create({"executors": [probe]}))
        assert task["state"] == "COMPLETE", json.dumps(task["logs"])
        out = task["logs"][-1]["logs"][0]["stdout"]
        assert re.search(r"^CapEff:\s+0000000000000000$", out, re.M), out
        assert f"uid={uid}\n" in out
        assert "core_pattern=refused" in out
        assert "sleep 300; true" not in out and secret not in out, out
    finally:
        quickstart.cancel(other)
    assert Path("/proc/sys/kernel/core_pattern").read_text().strip() != ""


# --------------------------------------------------------------------------- /tmp on disk


def test_tmp_is_on_disk_shared_by_the_tasks_executors_and_private_to_the_task(
    local_cluster: Any, quickstart: Quickstart
):
    uid = pwd.getpwnam(ACCOUNT).pw_uid
    writer = sh(
        "dd if=/dev/zero of=/tmp/big bs=1M count=2048 2>/dev/null && "
        "echo fs=$(stat -f -c %T /tmp) && echo shared > /var/tmp/marker"
    )
    reader = sh(
        "echo size=$(stat -c %s /tmp/big); cat /var/tmp/marker; "
        "echo fs=$(stat -f -c %T /var/tmp); ls /var/tmp; sleep 20"
    )
    # A memory limit below what it writes: a /tmp in memory (tmpfs) would be the job's memory
    # and the limit would kill it; on disk, the page cache is given back instead.
    task_id = quickstart.create({"executors": [writer, reader], "resources": {"ram_gb": 1}})
    # While it runs: one directory of the account, 0700, holding the 2 GiB on disk.
    found = _wait_for(
        lambda: [
            d
            for d in _scratch_dirs(local_cluster, task_id)
            if os.path.exists(f"{d}/var-tmp/marker")
        ],
        240,
        "the task's scratch directory",
    )
    assert len(found) == 1, found
    info = os.stat(found[0])
    assert info.st_uid == uid and stat.S_IMODE(info.st_mode) == 0o700
    assert os.stat(f"{found[0]}/tmp/big").st_size == 2 * GIB
    # Another task, meanwhile, has its own /tmp and /var/tmp.
    other = quickstart.wait(quickstart.create({"executors": [sh("ls -a /tmp /var/tmp")]}))
    assert other["state"] == "COMPLETE", json.dumps(other["logs"])
    assert "big" not in other["logs"][-1]["logs"][0]["stdout"]
    assert "marker" not in other["logs"][-1]["logs"][0]["stdout"]

    task = quickstart.wait(task_id)
    assert task["state"] == "COMPLETE", json.dumps(task["logs"])
    first, second = (log["stdout"] for log in task["logs"][-1]["logs"])
    assert "fs=tmpfs" not in first and "fs=" in first, first
    assert f"size={2 * GIB}" in second and "shared" in second, second
    assert "fs=tmpfs" not in second, second
    # Gone with the job.
    _wait_for(
        lambda: not _scratch_dirs(local_cluster, task_id), 30, "the scratch directory's removal"
    )
    # The 2 GiB never were the job's memory: it completed under its 1 GiB limit (above). sacct's
    # MaxRSS is no measure of it: 26.05 counts the page cache of what the job wrote (2.2 GB
    # here), 22.05 did not.


def test_tmp_stays_on_disk_under_the_tasks_own_inputs_and_outputs_there(
    quickstart: Quickstart,
):
    """Snakemake's tasks put their inputs and outputs under /tmp: an input at /tmp/in/data.txt
    and an output under /tmp/out are mounted on top of the disk-backed /tmp, not instead of it."""
    account = pwd.getpwnam(ACCOUNT)
    data = quickstart.data_dir / f"tmp-binds-{uuid.uuid4().hex[:8]}"
    data.mkdir()
    (data / "data.txt").write_text("hello\n")
    for path in (data, data / "data.txt"):
        os.chown(path, account.pw_uid, account.pw_gid)
    writer = sh(
        "dd if=/dev/zero of=/tmp/big bs=1M count=1024 && "
        "echo fs=$(stat -f -c %T /tmp) && tr a-z A-Z < /tmp/in/data.txt > /tmp/out/result.txt"
    )
    reader = sh("echo size=$(stat -c %s /tmp/big); ls /tmp; sleep 20")
    task = quickstart.wait(
        quickstart.create(
            {
                "executors": [writer, reader],
                # Under what it writes to /tmp: only a /tmp on disk lets it complete (above).
                "resources": {"ram_gb": 0.5},
                "inputs": [{"path": "/tmp/in/data.txt", "url": f"file://{data}/data.txt"}],
                "outputs": [{"path": "/tmp/out", "url": f"file://{data}/out", "type": "DIRECTORY"}],
            }
        )
    )
    try:
        assert task["state"] == "COMPLETE", json.dumps(task["logs"])
        first, second = (log["stdout"] for log in task["logs"][-1]["logs"])
        assert "fs=tmpfs" not in first and "fs=" in first, first
        assert f"size={GIB}" in second, second
        assert (data / "out" / "result.txt").read_text() == "HELLO\n"
        assert not (data / "out" / "big").exists()
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_tmp_is_removed_when_the_job_fails_or_is_cancelled(
    local_cluster: Any, quickstart: Quickstart
):
    failing = quickstart.create({"executors": [sh("echo x > /tmp/f; exit 3")]})
    running = quickstart.create({"executors": [sh("echo x > /tmp/f; sleep 300")]})
    task = quickstart.wait(failing)
    assert task["state"] == "EXECUTOR_ERROR", json.dumps(task["logs"])
    _wait_for(lambda: not _scratch_dirs(local_cluster, failing), 30, "removal after a failure")
    _wait_for(
        lambda: _scratch_dirs(local_cluster, running), 240, "the running task's scratch directory"
    )
    quickstart.cancel(running)
    _wait_for(lambda: not _scratch_dirs(local_cluster, running), 60, "removal after a cancel")


# --------------------------------------------------------------------------- inputs


ATTACK = """
for f in /in/src.txt /in/dir/f.txt /vol/v.txt; do
  mount -o remount,rw $f; mount -o remount,rw,bind $f
  echo hacked > $f; echo hacked >> $f; true > $f; chmod 0777 $f
done
mount -o remount,rw /in/dir; mount -o remount,rw,bind /in/dir
echo new > /in/dir/new.txt; rm -f /in/dir/f.txt; mv /in/dir/f.txt /in/dir/g.txt
echo done
"""


@pytest.mark.parametrize(
    ("user", "mode"),
    [
        ("root", "copy"),
        ("root", "hardlink"),
        ("root", "bind"),
        (ACCOUNT, "hardlink"),
        (ACCOUNT, "bind"),
    ],
)
def test_an_executor_cannot_change_an_input_source(
    local_cluster: Any, quickstart: Quickstart, user: str, mode: str
):
    """Write, append, truncate, chmod, remount read-write, remove: the sources stay as they
    were. As root too (container.allow_root), where only dropped capabilities stop a remount."""
    root = Path(tempfile.mkdtemp(prefix="tes-inputs-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    # Work directory, image cache and data on the shared filesystem (one filesystem, so that
    # hardlinks work), the state on the login node.
    shared = local_cluster.shared_path("inputs")
    as_account = user != "root"
    owner = pwd.getpwnam(user)
    for path in (root / "state", shared / "images", shared / "data", shared / "data" / "dir"):
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, owner.pw_uid, owner.pw_gid)
    data = shared / "data"
    sources = [data / "src.txt", data / "dir" / "f.txt", data / "v.txt"]
    for source in sources:
        source.write_text("original\n")
        os.chmod(source, 0o644)
        os.chown(source, owner.pw_uid, owner.pw_gid)  # the executor's own files: worst case
    with start_bridge_service(
        local_cluster,
        root,
        storage_toml=f'file_input_mode = "{mode}"',
        shared=shared,
        user=user if as_account else None,
        python=str(quickstart.prefix / "bin" / "python") if as_account else sys.executable,
        env={"HOME": owner.pw_dir, "USER": user, "LOGNAME": user} if as_account else None,
    ) as service:
        task = service.run(
            {
                "inputs": [
                    {"path": "/in/src.txt", "url": f"file://{data}/src.txt"},
                    {"path": "/in/dir", "url": f"file://{data}/dir", "type": "DIRECTORY"},
                    {"path": "/vol/v.txt", "url": f"file://{data}/v.txt"},
                ],
                "volumes": ["/vol"],
                "executors": [sh(ATTACK)],
            },
            timeout=240,
        )
        assert task["state"] == "COMPLETE", json.dumps(task["logs"])
        assert "done" in task["logs"][-1]["logs"][0]["stdout"]
        for source in sources:
            assert source.read_text() == "original\n", (mode, source)
            assert stat.S_IMODE(source.stat().st_mode) == 0o644, (mode, source)
        assert sorted(p.name for p in (data / "dir").iterdir()) == ["f.txt"]
        staged = service.work_dir / task["id"] / "root" / "in" / "src.txt"
        if mode == "hardlink":  # the input really shared its inode with the source
            assert staged.stat().st_ino == sources[0].stat().st_ino
        if mode == "bind":  # bound straight from the source: only a mount point was staged
            assert staged.stat().st_size == 0
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)
