"""The local cluster of deploy/local-cluster.sh, and SlurmClient against real Slurm 22.05.

Real jobs on the real controller, real Apptainer and the local registry: nothing faked.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from bridge.slurm import (
    QUEUE_BY_USER_FROM,
    JobInfo,
    SlurmClient,
    SlurmRejected,
    SlurmUnavailable,
)
from tests.fixtures.cluster import LocalCluster

pytestmark = pytest.mark.cluster

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], timeout: float = 60, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or check}")
        time.sleep(0.5)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def job_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / f"{unique('job')}.sh"
    # The output goes beside the script, not into the directory pytest runs in.
    output = f"#SBATCH --output={tmp_path}/slurm-%j.out"
    script.write_text(f"#!/bin/bash\n{output}\nset -euo pipefail\n{body}\n")
    return script


def sbatch(tmp_path: Path, script: Path, *args: str) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", *args, str(script)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.strip().split(";")[0]


def ended(client: SlurmClient, job_id: str) -> JobInfo | None:
    job = client.accounting([job_id]).get(job_id)
    return job if job is not None and job.ended else None


@pytest.fixture
def client(local_cluster: LocalCluster) -> SlurmClient:
    return SlurmClient(timeout=30)


# --- the cluster itself ------------------------------------------------------------------------


def test_job_shows_in_squeue_then_sacct_reports_state_and_exit_code(
    local_cluster: LocalCluster, client: SlurmClient, shared_tmp_path: Path
) -> None:
    job_id = sbatch(shared_tmp_path, job_script(shared_tmp_path, "sleep 3\necho done\nexit 3"))
    squeue = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True, check=True
    )
    assert squeue.stdout.split()[0] == job_id
    assert client.queue([job_id])[job_id].state in {"PENDING", "CONFIGURING", "RUNNING"}

    job = wait_for(lambda: ended(client, job_id), what=f"job {job_id} in sacct")
    assert (job.state, job.exit_code, job.signal) == ("FAILED", 3, 0)
    assert job.node in local_cluster.nodes and job.partition == local_cluster.partition
    assert job.elapsed_seconds is not None and job.elapsed_seconds >= 3
    assert (shared_tmp_path / f"slurm-{job_id}.out").read_text() == "done\n"
    sacct = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "--format=State,ExitCode"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert sacct.stdout.strip() == "FAILED|3:0"


def test_scancel_ends_a_running_job_as_cancelled(
    client: SlurmClient, shared_tmp_path: Path
) -> None:
    job_id = sbatch(shared_tmp_path, job_script(shared_tmp_path, "sleep 300"))
    wait_for(lambda: client.queue([job_id])[job_id].state == "RUNNING", what="RUNNING")
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    job = wait_for(lambda: ended(client, job_id), what=f"job {job_id} to end")
    assert job.state == "CANCELLED" and job.tes_state == "CANCELED"


def test_several_jobs_run_at_once(client: SlurmClient, shared_tmp_path: Path) -> None:
    # DefMemPerCPU and core sharing let small jobs run side by side even on two cores.
    ids = [sbatch(shared_tmp_path, job_script(shared_tmp_path, "sleep 20")) for _ in range(4)]
    try:
        wait_for(
            lambda: all(j.state == "RUNNING" for j in client.queue(ids).values()),
            timeout=30,
            what="4 jobs running together",
        )
    finally:
        client.cancel(ids)


def test_many_ids_are_looked_up_by_user_with_the_same_answer(
    client: SlurmClient, shared_tmp_path: Path
) -> None:
    # Held jobs among ids Slurm never gave: by user (QUEUE_BY_USER_FROM ids and more) and by
    # --jobs, the real squeue answers alike.
    ids = [sbatch(shared_tmp_path, job_script(shared_tmp_path, "true"), "--hold") for _ in range(2)]
    try:
        unknown = [str(90_000_000 + i) for i in range(QUEUE_BY_USER_FROM)]
        by_user = SlurmClient(timeout=30, queue_user=pwd.getpwuid(os.geteuid()).pw_name)
        by_list = client.queue([*ids, *unknown])
        by_owner = by_user.queue([*ids, *unknown])
        assert set(by_owner) == set(by_list) == set(ids)
        for job_id in ids:
            assert by_owner[job_id].state == by_list[job_id].state == "PENDING"
            assert by_owner[job_id].reason == by_list[job_id].reason == "JobHeldUser"
    finally:
        client.cancel(ids)


def test_apptainer_in_a_job_runs_the_registry_alpine_with_bind_and_pwd(
    local_cluster: LocalCluster, client: SlurmClient, shared_tmp_path: Path
) -> None:
    data = shared_tmp_path / "data"
    data.mkdir()
    (data / "in.txt").write_text("one\ntwo\n")
    sif = shared_tmp_path / "alpine.sif"
    apptainer = " ".join([local_cluster.apptainer, "exec", *local_cluster.apptainer_flags])
    body = f"""
export APPTAINER_CACHEDIR={shared_tmp_path}/cache
{local_cluster.apptainer} pull --no-https {sif} {local_cluster.image("library/alpine:latest")}
{apptainer} --bind {data}:/work --pwd /work {sif} \\
    sh -c 'pwd > where.txt; wc -l < in.txt > count.txt; md5sum in.txt > sum.txt; exit 7'
"""
    job_id = sbatch(shared_tmp_path, job_script(shared_tmp_path, body))
    job = wait_for(lambda: ended(client, job_id), timeout=120, what="apptainer job")
    log = (shared_tmp_path / f"slurm-{job_id}.out").read_text()
    assert (job.state, job.exit_code) == ("FAILED", 7), log
    assert (data / "where.txt").read_text() == "/work\n"
    assert (data / "count.txt").read_text().strip() == "2"
    assert (data / "sum.txt").read_text().startswith("2094b601daac3d68f5aed51d3c20f7cd")


def test_python_image_runs_python3(
    local_cluster: LocalCluster, client: SlurmClient, shared_tmp_path: Path
) -> None:
    sif = shared_tmp_path / "python.sif"
    apptainer = " ".join([local_cluster.apptainer, "exec", *local_cluster.apptainer_flags])
    body = f"""
export APPTAINER_CACHEDIR={shared_tmp_path}/cache
{local_cluster.apptainer} pull --no-https {sif} {local_cluster.image("library/python:3-slim")}
{apptainer} {sif} python3 -c 'import json, sys; print(json.dumps({{"major": sys.version_info[0]}}))'
"""
    job_id = sbatch(shared_tmp_path, job_script(shared_tmp_path, body))
    job = wait_for(lambda: ended(client, job_id), timeout=180, what="python job")
    log = (shared_tmp_path / f"slurm-{job_id}.out").read_text()
    assert (job.state, job.exit_code) == ("COMPLETED", 0), log
    assert '{"major": 3}' in log


def test_status_lists_each_daemon_with_its_pid_and_log(local_cluster: LocalCluster) -> None:
    out = local_cluster.run_script("status").stdout
    slurmds = (
        [f"slurmd-{node}" for node in local_cluster.nodes]
        if len(local_cluster.nodes) > 1
        else ["slurmd"]
    )
    for daemon in (*slurmds, "slurmctld", "slurmdbd", "mysqld", "munged", "registry"):
        line = next(line for line in out.splitlines() if line.split()[:1] == [daemon])
        assert " running  pid " in line and str(local_cluster.state_dir / "log") in line
    for node in local_cluster.nodes:
        assert f"{node} idle" in out or f"{node} mixed" in out or f"{node} allocated" in out


def test_up_when_already_up_is_fast(local_cluster: LocalCluster) -> None:
    started = time.monotonic()
    local_cluster.up()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("name", ["slurm.conf", "slurmdbd.conf"])
def test_up_refuses_to_overwrite_a_foreign_slurm_config(
    local_cluster: LocalCluster, tmp_path: Path, name: str
) -> None:
    etc = tmp_path / "etc-slurm"
    etc.mkdir()
    foreign = etc / name
    foreign.write_text("ClusterName=site\nSlurmctldHost=login1\n")
    state = tmp_path / "state"
    proc = local_cluster.run_script(
        "up",
        check=False,
        env={"LOCAL_CLUSTER_SLURM_ETC": str(etc), "LOCAL_CLUSTER_DIR": str(state)},
    )
    assert proc.returncode != 0
    assert f"{foreign} exists and was not written by this script" in proc.stderr
    assert "refusing to overwrite" in proc.stderr
    assert foreign.read_text() == "ClusterName=site\nSlurmctldHost=login1\n"
    assert not state.exists()  # refused before touching anything
    assert sorted(p.name for p in etc.iterdir()) == [name]


def _release_seen() -> tuple[str, str, str]:
    """sinfo -V on PATH, the controller's SLURM_VERSION, and where `sbatch` is found."""
    sinfo = subprocess.run(["sinfo", "-V"], capture_output=True, text=True, check=True).stdout
    config = subprocess.run(
        ["scontrol", "show", "config"], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"^SLURM_VERSION\s*=\s*(\S+)", config, re.M)
    assert match, config[:300]
    return sinfo.split()[-1], match.group(1), shutil.which("sbatch") or ""


def test_switching_the_slurm_release_and_back_leaves_nothing_of_the_other(
    local_cluster: LocalCluster,
) -> None:
    """Another release's daemons, commands and state, then this one's again, as they were."""
    here = (local_cluster.state_dir / "slurm.release").read_text().strip()
    other = "24.11" if here != "24.11" else "26.05"
    version, _, sbatch = _release_seen()
    try:
        local_cluster.run_script("up", "--quiet", env={"LOCAL_CLUSTER_SLURM": other})
        there = _release_seen()
        assert there[0].startswith(other + ".") and there[1] == there[0], there
        assert there[2] == "/usr/local/bin/sbatch", there
        assert (local_cluster.state_dir / f"slurmctld-{other}").is_dir()
        assert local_cluster.run_script("status").returncode == 0
    finally:
        local_cluster.run_script("up", "--quiet", env={"LOCAL_CLUSTER_SLURM": here})
    assert _release_seen() == (version, version, sbatch)
    assert (local_cluster.state_dir / "slurm.release").read_text().strip() == here
    if here == "22.05":
        assert not Path("/usr/local/bin/sbatch").exists()  # no link left of the other release
    # Jobs run again at once on this release.
    job = subprocess.run(
        ["sbatch", "--parsable", "-o", "/dev/null", "--wait", "--wrap", "true"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr


def test_down_of_an_unknown_daemon_is_refused(local_cluster: LocalCluster) -> None:
    proc = local_cluster.run_script("down", "nosuchd", check=False)
    assert proc.returncode != 0 and "unknown daemon 'nosuchd'" in proc.stderr


# --- SlurmClient on the real cluster ---------------------------------------------------------


def test_client_submit_queue_accounting_and_find_by_names(
    client: SlurmClient, shared_tmp_path: Path
) -> None:
    name = unique("lc-client")
    script = job_script(shared_tmp_path, "echo hello")
    job_id = client.submit(
        script, job_name=name, comment="task=abc", extra_args=[f"--output={shared_tmp_path}/%j.out"]
    )
    assert job_id.isdigit()
    queued = client.queue([job_id, "999999999"])  # an id Slurm never knew is simply absent
    assert set(queued) == {job_id} and queued[job_id].name == name
    assert queued[job_id].comment == "task=abc"

    job = wait_for(lambda: ended(client, job_id), what="job to complete")
    assert (job.state, job.exit_code, job.tes_state) == ("COMPLETED", 0, "COMPLETE")
    assert job.comment == "task=abc" and job.name == name
    assert job.start_time is not None and job.end_time is not None
    assert job.start_time.tzinfo is not None

    # Just ended: squeue still shows it thanks to --states=all.
    assert client.queue([job_id])[job_id].state == "COMPLETED"

    found = client.find_by_names([name, unique("lc-none")])
    assert list(found) == [name]
    assert [j.job_id for j in found[name]] == [job_id]
    assert found[name][0].exit_code == 0


def test_client_cancel(client: SlurmClient, shared_tmp_path: Path) -> None:
    started = shared_tmp_path / "started"
    running = client.submit(
        job_script(shared_tmp_path, f"touch {started}\nsleep 300"), job_name=unique("lc-cancel")
    )
    held = client.submit(
        job_script(shared_tmp_path, "true"), job_name=unique("lc-held"), extra_args=["--hold"]
    )
    # squeue says RUNNING before slurmd has started the batch script; a cancel in that gap ends
    # the job without a signal (0:0), so wait until the script itself has begun.
    wait_for(started.exists, what="the job script to start")
    assert client.queue([running])[running].state == "RUNNING"
    assert client.queue([held])[held].reason == "JobHeldUser"
    client.cancel([running, held, "999999999"])  # unknown ids are ignored by scancel
    # slurmdbd has the job line CANCELLED at once, and its batch step's line CANCELLED 0:0 until
    # slurmd reports the step's end (its signal, its MaxRSS) a moment later: wait for that report.
    jobs = wait_for(
        lambda: (
            (a := client.accounting([running, held]))
            and all(j.ended for j in a.values())
            and a[running].signal
            and a
        ),
        what="cancelled jobs in sacct, the running one with its batch step's signal",
    )
    assert {j.state for j in jobs.values()} == {"CANCELLED"}
    assert jobs[running].signal == 15 and jobs[held].start_time is None


def test_client_rejects_a_job_no_node_can_run(client: SlurmClient, shared_tmp_path: Path) -> None:
    script = job_script(shared_tmp_path, "true")
    with pytest.raises(SlurmRejected, match="Requested node configuration is not available") as e:
        client.submit(script, job_name=unique("lc-huge"), extra_args=["--mem=100000000"])
    assert e.value.returncode == 1 and "--mem=100000000" in e.value.argv
    with pytest.raises(SlurmRejected, match="Invalid partition name specified"):
        client.submit(script, job_name=unique("lc-part"), extra_args=["--partition=nosuch"])
    with pytest.raises(SlurmRejected, match="More processors requested than permitted"):
        client.submit(script, job_name=unique("lc-cpus"), extra_args=["--cpus-per-task=512"])


@pytest.fixture
def stopped(local_cluster: LocalCluster) -> Iterator[Callable[[str], None]]:
    """Stops daemons of the local cluster; whatever happens, `up` restores them afterwards."""

    def stop(daemon: str) -> None:
        local_cluster.stop(daemon)

    try:
        yield stop
    finally:
        local_cluster.up()


def test_client_reports_slurmctld_down_as_unavailable(
    client: SlurmClient, stopped: Callable[[str], None], shared_tmp_path: Path
) -> None:
    done = client.submit(job_script(shared_tmp_path, "true"), job_name=unique("lc-before"))
    wait_for(lambda: ended(client, done), what="job before the outage")
    stopped("slurmctld")
    started = time.monotonic()
    with pytest.raises(SlurmUnavailable, match="Unable to contact slurm controller") as e:
        client.submit(job_script(shared_tmp_path, "true"), job_name=unique("lc-down"))
    # The service runs each command by the path its PATH gives (site mode hands it to sudo).
    assert Path(e.value.argv[0]).name == "sbatch" and e.value.returncode == 1
    with pytest.raises(SlurmUnavailable):
        client.queue([done])
    with pytest.raises(SlurmUnavailable):
        client.cancel([done])
    # Each command retries for about 9 s on "connection refused" before it gives up.
    assert time.monotonic() - started < 60
    # sacct talks to slurmdbd, which still runs.
    assert client.accounting([done])[done].state == "COMPLETED"


def test_client_reports_slurmdbd_down_as_unavailable(
    client: SlurmClient, stopped: Callable[[str], None], shared_tmp_path: Path
) -> None:
    stopped("slurmdbd")
    with pytest.raises(SlurmUnavailable, match="Problem talking to the database"):
        client.accounting(["1"])
    # The controller still takes and runs jobs without its accounting daemon.
    job_id = client.submit(
        job_script(shared_tmp_path, "true"), job_name=unique("lc-nodbd"), extra_args=["--hold"]
    )
    assert client.queue([job_id])[job_id].state == "PENDING"
    client.cancel([job_id])


def test_sbatch_environment_reaches_the_cluster_config(local_cluster: LocalCluster) -> None:
    assert os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf") == str(local_cluster.slurm_conf)
    assert local_cluster.registry == "127.0.0.1:5000"
    assert Path(local_cluster.apptainer).is_file()
