"""Site mode on the real cluster: the bridge runs as the service account `tesbridge` (API and
poller processes, state directory), authenticates with basic auth, and submits, cancels and
stages as each task's owner through the sudo rule shipped in deploy/sudoers.tes-bridge.

The work directory is `<root>/work`, mode 1733 (owned by the service account): every user may
create a task directory there, nobody may list it or remove another's. Task directories are
created by their owner (`bridge.job adopt` through sudo) with mode 0700.
"""

from __future__ import annotations

import dataclasses
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fixtures.auth import PASSWORDS, UnixUsers, write_htpasswd
from tests.fixtures.service import TERMINAL, BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SUDOERS = REPO / "deploy" / "sudoers.tes-bridge"
INSTALLED = Path("/etc/sudoers.d/tes-bridge-test")
#: A virtual environment any user can run, when the test's own Python is private (e.g. a
#: pyenv under /root): the service account and the task owners run this package with it.
SITE_VENV = Path("/var/lib/tes-bridge/site-test-venv")


def slurm_command(name: str) -> str:
    """The Slurm command the service runs: the first on its PATH (on 24.11 and later in the
    local cluster, the release's link in /usr/local/bin, not Debian's /usr/bin one)."""
    path = shutil.which(name)
    assert path, f"{name} is not on PATH"
    return path


def sudoers_for(work_dir: Path, python: str) -> str:
    """The shipped rule with this machine's paths (the venv's python, the test work dir, the
    Slurm commands), as its comment asks a site to adapt it."""
    text = SUDOERS.read_text()
    assert "/opt/tes-bridge/bin/python" in text and "/var/lib/tes-bridge/work" in text
    # The work directory stands in regular expressions: escape what POSIX ERE treats specially.
    work = re.sub(r"([.\[\](){}*+?|^$\\#])", r"\\\1", str(work_dir))
    for name in ("sbatch", "scancel"):
        assert f"/usr/bin/{name} " in text
        text = text.replace(f"/usr/bin/{name} ", f"{slurm_command(name)} ")
    return text.replace("/opt/tes-bridge/bin/python", python).replace(
        "/var/lib/tes-bridge/work", work
    )


def as_user(user: str, *argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", user, "--", *argv], capture_output=True, text=True, cwd="/", **kwargs
    )


class Client:
    def __init__(self, service: BridgeService, user: str):
        self.service = service
        self.auth = (user, PASSWORDS.get(user, "x"))

    def post(self, task: dict[str, Any]) -> str:
        answer = requests.post(f"{self.service.api}/tasks", json=task, auth=self.auth, timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()["id"]

    def get(self, task_id: str) -> requests.Response:
        url = f"{self.service.api}/tasks/{task_id}"
        return requests.get(url, params={"view": "FULL"}, auth=self.auth, timeout=10)

    def cancel(self, task_id: str) -> requests.Response:
        url = f"{self.service.api}/tasks/{task_id}:cancel"
        return requests.post(url, json={}, auth=self.auth, timeout=10)

    def wait(self, task_id: str, states: set[str] = TERMINAL, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            answer = self.get(task_id)
            assert answer.status_code == 200, answer.text
            task = answer.json()
            if task["state"] in states:
                return task
            if time.monotonic() > deadline:
                log = (self.service.root / "poller.log").read_text()[-3000:]
                raise AssertionError(f"task {task_id} still {task['state']}:\n{task}\n{log}")
            time.sleep(0.3)


@pytest.fixture(scope="module")
def site_python(unix_users: UnixUsers) -> str:
    """A Python with this package that the service account and the owners may run."""
    probe = [unix_users.service, "-m", "bridge.job", "--help"]
    if as_user(probe[0], sys.executable, *probe[1:]).returncode == 0:
        return sys.executable
    python = SITE_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(SITE_VENV)], check=True)
    # Editable when the users can read this checkout, else a copy of it, made afresh each run.
    readable = as_user(probe[0], "test", "-r", str(REPO / "bridge" / "__init__.py"))
    pip = [str(python), "-m", "pip", "install", "-q"]
    if readable.returncode == 0:
        subprocess.run([*pip, "-e", str(REPO)], check=True, timeout=900, capture_output=True)
    else:
        subprocess.run([*pip, str(REPO)], check=True, timeout=900, capture_output=True)
        refresh = [*pip, "--force-reinstall", "--no-deps", str(REPO)]
        subprocess.run(refresh, check=True, timeout=900, capture_output=True)
    return str(python)


@pytest.fixture(scope="module")
def site_root() -> Iterator[Path]:
    # /var/tmp and not pytest's tmp_path: that one is private to root, and the service account
    # and the task owners must traverse it.
    root = Path(tempfile.mkdtemp(prefix="tes-site-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def site_shared(local_cluster: Any) -> Iterator[Path]:
    """The work directory, the image cache and the data: on the shared filesystem, which the
    compute nodes see (site_root, the state, stays on the login node)."""
    path = local_cluster.shared_path("site")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def installed_rule(site_root: Path, site_shared: Path, site_python: str) -> Iterator[Path]:
    work = site_shared / "work"
    candidate = site_root / "sudoers"
    candidate.write_text(sudoers_for(work, site_python))
    check = subprocess.run(["visudo", "-cf", str(candidate)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    shutil.copy(candidate, INSTALLED)
    os.chmod(INSTALLED, 0o440)
    yield work
    INSTALLED.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def site(
    local_cluster: Any,
    site_root: Path,
    site_shared: Path,
    installed_rule: Path,
    unix_users: UnixUsers,
    site_python: str,
) -> Iterator[BridgeService]:
    service_user = unix_users.service
    uid = unix_users.uid(service_user)
    gid = int(subprocess.check_output(["id", "-g", service_user], text=True))
    work = installed_rule
    work.mkdir(mode=0o755, exist_ok=True)
    os.chown(work, uid, gid)
    os.chmod(work, 0o1733)  # create, not list; the sticky bit keeps others' directories safe
    for private in (site_root / "state", site_shared / "images"):
        private.mkdir(exist_ok=True)
        os.chown(private, uid, gid)
    data = site_shared / "data"
    data.mkdir(exist_ok=True)
    os.chmod(data, 0o1777)  # the shared filesystem: each user's own files, Unix permissions
    htpasswd = write_htpasswd(site_root / "htpasswd")
    os.chmod(htpasswd, 0o644)
    cluster = local_cluster
    if as_user("tesalice", "test", "-w", "/dev/fuse").returncode != 0:
        # Unprivileged Apptainer mounts a SIF with squashfuse, which needs /dev/fuse; where a
        # user may not open it (some container hosts), the SIF is unpacked to a sandbox instead.
        flags = [*local_cluster.apptainer_flags, "--unsquash"]
        cluster = dataclasses.replace(local_cluster, apptainer_flags=flags)
    with start_bridge_service(
        cluster,
        site_root,
        extra_toml=f"""
[auth]
mode = "basic"
htpasswd_file = "{htpasswd}"
admin_users = ["tesadmin"]
[site]
run_as_owner = true
[staging]
# Tasks with remote inputs or outputs: three jobs, each as the owner (test_transfer_jobs_...).
where = "transfer"
transfer_partition = "{transfer_partition(local_cluster)}"
""",
        env={
            "TES_BRIDGE_WORK_DIR": str(work),
            "HOME": unix_users.home(service_user),
            "USER": service_user,
            "LOGNAME": service_user,
        },
        user=service_user,
        python=site_python,
        shared=site_shared,
        # As deploy/systemd/tes-bridge-api.service runs it: no set-user-ID program (sudo) works.
        api_prefix=["setpriv", "--no-new-privs"],
    ) as service:
        yield service


def transfer_partition(local_cluster: Any) -> str:
    """The local cluster's transfer partition (tests/cluster/test_transfer.py)."""
    env = local_cluster.env
    return env.get("LOCAL_CLUSTER_TRANSFER_PARTITION") or local_cluster.preemptible_partition


def _sacct_user(job_id: str, task_id: str, part: str = "") -> str:
    """The job's user in accounting, once slurmdbd has the job's own record (it first holds a
    placeholder named "allocation" with user root; see bridge/slurm/sacct.py); `part`: the
    suffix of a transfer job's name (`-stage-in`)."""
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(
            ["sacct", "-n", "-P", "-X", f"--jobs={job_id}", "--format=JobName,User"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        name, _, user = out.partition("|")
        if name == f"tes-{task_id}{part}" or time.monotonic() > deadline:
            return user
        time.sleep(1)


def test_the_shipped_sudo_rule_is_valid_and_narrow(
    installed_rule: Path, unix_users: UnixUsers, site_python: str
):
    assert subprocess.run(["visudo", "-cf", str(SUDOERS)], capture_output=True).returncode == 0
    listing = as_user(unix_users.service, "sudo", "-n", "-l")
    assert listing.returncode == 0, listing.stderr
    # Never as root, nor as a user outside tes-users, nor any other command.
    for user, argv in [
        ("root", [slurm_command("sbatch"), "--parsable", "/bin/true"]),
        (unix_users.outsider, [slurm_command("sbatch"), "--parsable", "/bin/true"]),
        ("tesalice", ["/bin/sh", "-c", "id"]),
        ("tesalice", [slurm_command("scancel"), "--user=tesbob"]),
        ("tesalice", [sys.executable, "-c", "print(1)"]),
        ("tesalice", [sys.executable, "-m", "bridge.job", "stage-in", "--task-dir", "/tmp"]),
        ("tesalice", [sys.executable, "-m", "bridge.job", "adopt", "--task-dir", "/tmp/x"]),
    ]:
        refused = as_user(unix_users.service, "sudo", "-n", "-u", user, "--", *argv)
        assert refused.returncode != 0, (user, argv)
        assert "not allowed" in refused.stderr or "password is required" in refused.stderr
    # And the commands it needs work: the Slurm ones by the paths the service runs them by.
    for argv in (
        [slurm_command("sbatch"), "--parsable", "/bin/true"],
        [slurm_command("scancel"), "12"],
    ):
        listed = as_user(unix_users.service, "sudo", "-n", "-l", "-u", "tesalice", *argv)
        assert listed.returncode == 0, (argv, listed.stderr)
    work = str(installed_rule)
    allowed = as_user(
        unix_users.service,
        "sudo", "-n", "-u", "tesalice", "--", site_python, "-m", "bridge.job",
        "read-records", "--work-dir", work, "--tail-bytes", "10", f"{work}/no-such-task:12",
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout == "{}"
    removed = as_user(
        unix_users.service,
        "sudo", "-n", "-u", "tesalice", "--", site_python, "-m", "bridge.job",
        "remove", "--work-dir", work, "--task-dir", f"{work}/no-such-task",
    )  # fmt: skip
    assert removed.returncode == 0, removed.stderr
    # Outside the work directory the rule does not apply.
    elsewhere = as_user(
        unix_users.service,
        "sudo", "-n", "-u", "tesalice", "--", site_python, "-m", "bridge.job",
        "remove", "--work-dir", work, "--task-dir", "/home/tesalice",
    )  # fmt: skip
    assert elsewhere.returncode != 0 and os.path.isdir("/home/tesalice")


def test_the_sudo_rule_and_the_job_commands_keep_remove_inside_the_work_dir(
    installed_rule: Path, unix_users: UnixUsers, site_python: str
):
    """sudo's `*` matches spaces and argparse keeps the last of repeated options: neither may
    turn an allowed `remove` into one of a directory outside the work directory."""
    victim = Path("/home/tesalice/tes-victim")
    if victim.exists():
        shutil.rmtree(victim)
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    shutil.chown(victim, "tesalice", "tesalice")
    shutil.chown(victim / "precious.txt", "tesalice", "tesalice")
    work = str(installed_rule)
    # A link inside the work directory, planted by the owner, leading to her home.
    installed_rule.mkdir(exist_ok=True)
    link = installed_rule / "linked-task"
    link.unlink(missing_ok=True)
    link.symlink_to(victim)
    os.lchown(link, unix_users.uid("tesalice"), -1)
    attempts = [
        # what the former rule `remove --task-dir <work>/*` let through
        ["remove", "--task-dir", f"{work}/x", "--task-dir", str(victim)],
        ["remove", "--work-dir", work, "--task-dir", f"{work}/x", "--task-dir", str(victim)],
        ["remove", "--work-dir", work, "--task-dir", f"{work}/x --task-dir {victim}"],
        ["remove", "--work-dir", work, "--task-dir", f"{work}/../../../home/tesalice/tes-victim"],
        ["remove", "--work-dir", work, "--task-dir", f"{work}/x", "--work-dir", "/home/tesalice"],
        ["remove", "--work-dir", work, "--task-dir", str(link)],
        ["adopt", "--work-dir", work, "--task-dir", str(link)],
        ["read-records", "--work-dir", work, "--tail-bytes", "9", f"{victim}:1"],
    ]
    try:
        for argv in attempts:
            tried = as_user(
                unix_users.service,
                "sudo", "-n", "-u", "tesalice", "--", site_python, "-m", "bridge.job", *argv,
                input="{}",
            )  # fmt: skip
            assert tried.returncode != 0, (argv, tried.stdout, tried.stderr)
            assert (victim / "precious.txt").read_text() == "keep me", argv
        assert link.is_symlink()
    finally:
        link.unlink(missing_ok=True)
        shutil.rmtree(victim, ignore_errors=True)


def test_tasks_run_as_their_owner(site: BridgeService, local_cluster: Any):
    """The job runs as the owner (sacct's User), writes outputs the owner owns, in a task
    directory the owner owns and nobody else can read; the service processes are not root."""
    api_pid = site.processes["api"].pid
    assert os.stat(f"/proc/{api_pid}").st_uid != 0
    assert os.stat(f"/proc/{site.processes['poller'].pid}").st_uid != 0
    alice = Client(site, "tesalice")
    out_dir = site.data_dir / "alice-out"
    task_id = alice.post(
        {
            "executors": [
                {
                    "image": "alpine",
                    "command": ["sh", "-c", "id -u > /out/uid.txt; echo hello from $(id -u)"],
                }
            ],
            "outputs": [{"path": "/out/uid.txt", "url": f"file://{out_dir}/uid.txt"}],
        }
    )
    task = alice.wait(task_id)
    assert task["state"] == "COMPLETE", json.dumps(task["logs"])
    uid = str(pwd.getpwnam("tesalice").pw_uid)
    assert task["logs"][-1]["logs"][0]["stdout"].strip() == f"hello from {uid}"
    job_id = task["logs"][-1]["metadata"]["slurm_job_id"]
    assert _sacct_user(job_id, task_id) == "tesalice"
    output = out_dir / "uid.txt"
    assert output.read_text().strip() == uid
    assert output.stat().st_uid == int(uid)
    info = os.stat(site.work_dir / task_id)
    assert info.st_uid == int(uid) and stat.S_IMODE(info.st_mode) == 0o700
    # Other users cannot list the work directory; neither they nor the service account can
    # enter the task directory.
    work = site.work_dir
    assert as_user("tesbob", "ls", str(work)).returncode != 0
    for other in ("tesbob", "tesbridge"):
        assert as_user(other, "ls", str(work / task_id)).returncode != 0
        assert as_user(other, "cat", str(work / task_id / "task.json")).returncode != 0


def test_a_start_estimate_is_asked_of_slurm_as_the_owner(site: BridgeService):
    """POST /tasks:test-only: the API (no sudo) asks the poller, which runs sbatch --test-only
    as the owner through the shipped sudo rule, the job script on stdin; nothing is created."""
    deadline = time.monotonic() + 30
    while True:  # a 503 while the poller starts: asked again, as its Retry-After says
        answer = requests.post(
            f"{site.api}/tasks:test-only",
            json={"executors": [{"image": "alpine", "command": ["true"]}]},
            auth=("tesalice", PASSWORDS["tesalice"]),
            timeout=60,
        )
        if answer.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert answer.status_code == 200, answer.text
    estimate = answer.json()
    assert "start_time" in estimate and estimate["processors"] >= 1, (estimate, site.log_tail())
    assert estimate["slurm"].startswith("sbatch: Job "), estimate


def test_owners_see_only_their_tasks(site: BridgeService):
    alice, bob, admin = Client(site, "tesalice"), Client(site, "tesbob"), Client(site, "tesadmin")
    task_id = alice.post(
        {"executors": [{"image": "alpine", "command": ["sleep", "600"]}], "name": "alice-sleeps"}
    )
    assert bob.get(task_id).status_code == 404
    assert bob.cancel(task_id).status_code == 404
    listed = requests.get(f"{site.api}/tasks", auth=bob.auth, timeout=10).json()["tasks"]
    assert task_id not in {t["id"] for t in listed}
    assert admin.get(task_id).status_code == 200
    alice.wait(task_id, {"RUNNING"}, timeout=120)
    job_id = alice.get(task_id).json()["logs"][-1]["metadata"]["slurm_job_id"]
    # The owner's cancel reaches Slurm as the owner's scancel.
    assert alice.cancel(task_id).status_code == 200
    deadline = time.monotonic() + 60
    while True:
        state = subprocess.run(
            ["squeue", "-h", "--states=all", f"--jobs={job_id}", "-o", "%T"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if state in ("CANCELLED", "") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert state in ("CANCELLED", ""), state
    assert alice.get(task_id).json()["state"] == "CANCELED"


def test_staging_obeys_the_owners_unix_permissions(site: BridgeService):
    """A file only tesalice may read stages for her and not for tesbob, although both URLs
    are under an allowed directory: stage-in runs as the owner inside the job."""
    secret = site.data_dir / "alice-only.txt"
    secret.write_text("alice's secret\n")
    os.chown(secret, pwd.getpwnam("tesalice").pw_uid, -1)
    os.chmod(secret, 0o600)
    task = {
        "inputs": [{"path": "/in/secret.txt", "url": f"file://{secret}"}],
        "executors": [{"image": "alpine", "command": ["cat", "/in/secret.txt"]}],
    }
    alice, bob = Client(site, "tesalice"), Client(site, "tesbob")
    bob_task = bob.wait(bob.post(task))
    assert bob_task["state"] == "SYSTEM_ERROR", bob_task
    assert "alice's secret" not in json.dumps(bob_task)
    assert "Permission denied" in json.dumps(bob_task["logs"]), bob_task["logs"]
    alice_task = alice.wait(alice.post(task))
    assert alice_task["state"] == "COMPLETE", alice_task
    assert alice_task["logs"][-1]["logs"][0]["stdout"] == "alice's secret\n"


def test_transfer_jobs_stage_as_the_owner(site: BridgeService, cluster_storage_servers: Any):
    """staging.where = "transfer" in site mode: the stage-in job, the task's job and the
    stage-out job are the owner's (written, submitted, read and followed as the owner)."""
    servers = cluster_storage_servers
    servers.put("http", "site/in.txt", b"from the web\n")
    alice = Client(site, "tesalice")
    task = alice.wait(
        alice.post(
            {
                "inputs": [{"path": "/in/x", "url": servers.url_for("http", "site/in.txt")}],
                "executors": [{"image": "alpine", "command": ["cat", "/in/x"]}],
            }
        )
    )
    assert task["state"] == "COMPLETE", task
    attempt = task["logs"][-1]
    assert attempt["logs"][0]["stdout"] == "from the web\n"
    metadata = attempt["metadata"]
    for key, part in (("stage_in", "-stage-in"), ("", ""), ("stage_out", "-stage-out")):
        job_id = metadata[f"slurm_{key}_job_id" if key else "slurm_job_id"]
        assert _sacct_user(job_id, task["id"], part) == "tesalice", (job_id, part)


def test_unauthenticated_requests_are_refused(site: BridgeService):
    answer = requests.get(f"{site.api}/tasks", timeout=10)
    assert answer.status_code == 401
    assert answer.headers["WWW-Authenticate"].startswith("Basic")
    assert requests.get(f"{site.api}/service-info", timeout=10).status_code == 200


def test_live_output_is_read_as_the_owner(site: BridgeService, site_python: str):
    """The task directory is private to its owner: the API, which runs with no new privileges
    as its unit says (no sudo), asks the poller, which reads a running executor's output
    through the sudo rule's `read-output`, for the owner (and admins) only."""
    alice = Client(site, "tesalice")
    uid = pwd.getpwnam("tesalice").pw_uid
    task_id = alice.post(
        {"executors": [{"image": "alpine",
                        "command": ["sh", "-c", "echo live from $(id -u); sleep 8; echo done"]}]}
    )  # fmt: skip
    url = f"{site.api}/tasks/{task_id}/output"
    deadline = time.monotonic() + 180
    while True:
        answer = requests.get(url, auth=alice.auth, timeout=30)
        assert answer.status_code == 200, answer.text
        if answer.json()["text"]:
            break
        assert time.monotonic() < deadline, site.log_tail()
        time.sleep(0.5)
    running = answer.json()
    assert running["text"] == f"live from {uid}\n" and running["done"] is False
    bob = requests.get(url, auth=("tesbob", PASSWORDS["tesbob"]), timeout=30)
    assert bob.status_code == 404
    admin = requests.get(url, auth=("tesadmin", PASSWORDS["tesadmin"]), timeout=30)
    assert admin.status_code == 200 and admin.json()["text"].startswith("live from")
    assert alice.wait(task_id)["state"] == "COMPLETE"
    final = requests.get(url, auth=alice.auth, timeout=30).json()
    assert final["text"] == f"live from {uid}\ndone\n" and final["done"] is True
