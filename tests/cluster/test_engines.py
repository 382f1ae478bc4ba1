"""Real workflow engines, end to end, against the service the quickstart starts.

Each engine runs as a client of the quickstart's service with its default resources and no
client-side workaround, its files in the quickstart's data directory. The client runs as the
service account, which owns that directory: the quickstart's jobs run as that account too, so
it is the user whose files the workflow's tasks read and write. Engines and their images come
from tests/fixtures/engines.py (built once, then cached). One cwl-tes run goes to a service of
its own instead, whose tasks run on the network-less partition with their files on an FTP
server, staged on the transfer partition.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.engines import Engine, build_engine
from tests.fixtures.quickstart import ACCOUNT, Quickstart
from tests.fixtures.service import BridgeService, TesClient, start_bridge_service
from tests.fixtures.storage import FtpsServer

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="session")
def snakemake9(local_cluster: Any) -> Engine:
    # The fs storage plugin copies with rsync, in the client and in the jobs. Each job also
    # runs `pip install --target` of the storage plugin: from the image's own wheels, here,
    # where jobs cannot reach PyPI.
    return build_engine(
        local_cluster,
        "snakemake9",
        [
            # Pinned as docs/engines.md gives them.
            "snakemake==9.27.1",
            "snakemake-executor-plugin-tes==0.1.3",
            "snakemake-storage-plugin-fs==1.1.3",
            "six",  # for py-tes, which jobs import too (Snakemake loads every executor plugin)
        ],
        debs=["rsync", "libpopt0"],
        wheelhouse=True,
    )


@pytest.fixture(scope="session")
def toil7(local_cluster: Any) -> Engine:
    # Toil accepts an appliance image only after an HTTPS request to its registry, which the
    # local one (plain HTTP) cannot answer, or when the tag names Toil's own commit, as the
    # official appliance tags do.
    return build_engine(
        local_cluster,
        "toil7",
        ["toil==7.0.0"],  # pinned as docs/engines.md gives them
        client_only=["toil-batch-system-tes==2.0.0", "six"],
        tag_suffix="__import__('toil.version').version.dockerTag",
    )


@pytest.fixture(scope="session")
def cwltes(local_cluster: Any) -> Engine:
    # cwl-tes 0.3 pins cwltool 1.0.20191022103248, whose schema-salad needs rdflib-jsonld < 0.5:
    # its setup.py runs 2to3, which setuptools dropped in 58. Built by an older setuptools, it
    # runs on Debian 12's Python 3.11. Its tools bring their own images (DockerRequirement).
    return build_engine(
        local_cluster, "cwltes", [], client_only=["cwl-tes==0.3.0"],
        setup_py_2to3=["rdflib-jsonld==0.4.0"],
    )  # fmt: skip


@pytest.fixture(scope="session")
def pulsar(local_cluster: Any) -> Engine:
    # Galaxy's Pulsar: its client (what Galaxy's TES runner calls) and the staging image its
    # tasks run pulsar-submit and pulsar-finish in (galaxy/pulsar-pod-staging, built here from
    # PyPI: Docker Hub is out of reach).
    return build_engine(local_cluster, "pulsar", ["pulsar-app==0.16.0"])


def run_as_account(
    command: list[str],
    cwd: Path,
    engine: Engine,
    timeout: float,
    env: dict[str, str] | None = None,
    account: str | None = ACCOUNT,
) -> subprocess.CompletedProcess[str]:
    """Run an engine's command as the service account (or, with `account` None, as this
    process's user), in `cwd` (its HOME is cwd/home)."""
    name = account or pwd.getpwuid(os.getuid()).pw_name
    as_user: dict[str, Any] = {}
    if account is not None:
        entry = pwd.getpwnam(account)
        as_user = {
            "user": entry.pw_uid,
            "group": entry.pw_gid,
            "extra_groups": os.getgrouplist(account, entry.pw_gid),
        }
    started = time.monotonic()
    result = subprocess.run(
        command,
        cwd=cwd,
        env={
            "PATH": f"{engine.bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(cwd / "home"),
            "USER": name,
            "LOGNAME": name,
            "LANG": "C.UTF-8",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **as_user,
    )
    print(f"{engine.name}: {command[0]} took {time.monotonic() - started:.0f} s")
    return result


def explain(result: subprocess.CompletedProcess[str], quickstart: TesClient) -> str:
    """The engine's output and the logs of the tasks that did not complete."""
    failed = [
        {
            "id": task["id"],
            "name": task.get("name"),
            "state": task["state"],
            "logs": task.get("logs"),
        }
        for task in quickstart.list_tasks(view="FULL")
        if task["state"] != "COMPLETE"
    ]
    return f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}\n{json.dumps(failed)[-5000:]}"


#: The workflow the Snakemake tests run (and bench/nemesis/, again and again): seed, scale
#: by 1, 2 and 3, total.
SNAKEFILE = (Path(__file__).parents[1] / "data" / "engines" / "Snakefile").read_text()


def snakemake7_workflow(
    client: TesClient,
    engine: Engine,
    workdir: Path,
    account: str | None = ACCOUNT,
    snakefile: str = SNAKEFILE,
) -> subprocess.CompletedProcess[str]:
    """`snakefile` (SNAKEFILE, or a variant with the same steps) run in `workdir` by
    Snakemake 7's TES executor against `client`'s service: seed, then scale fanned out to
    three jobs, then total (five TES tasks)."""
    (workdir / "Snakefile").write_text(snakefile)
    return run_as_account(
        [
            "snakemake", "--tes", client.url, "--container-image", str(engine.image),
            "--jobs", "3", "--latency-wait", "5", "--printshellcmds",
        ],
        workdir,
        engine,
        timeout=600,
        account=account,
    )  # fmt: skip


def check_snakemake7_workflow(
    result: subprocess.CompletedProcess[str], workdir: Path, client: TesClient
) -> list[str]:
    """The workflow of `snakemake7_workflow` succeeded, its outputs right, each of its five
    jobs a task of the service that completed; returns the tasks' ids."""
    assert result.returncode == 0, explain(result, client)
    assert (workdir / "total.txt").read_text() == "60\n"
    scaled = [(workdir / f"scaled/{n}.txt").read_text() for n in (1, 2, 3)]
    assert scaled == ["10\n", "20\n", "30\n"]
    tasks = [line.split()[-1] for line in result.stderr.splitlines() if "Task submitted:" in line]
    assert len(tasks) == 5, result.stderr[-4000:]
    for task_id in tasks:
        assert client.get(task_id, view="MINIMAL")["state"] == "COMPLETE"
    return tasks


def test_snakemake7_with_its_tes_executor(
    quickstart: Quickstart, snakemake7: Engine, workdir: Path
) -> None:
    """seed, then scale fanned out to three jobs, then total: five TES tasks."""
    result = snakemake7_workflow(quickstart, snakemake7, workdir)
    check_snakemake7_workflow(result, workdir, quickstart)


TOIL_WORKFLOW = """
import os

from toil.common import Toil
from toil.job import Job


def scale(job, base_id, n):
    with open(job.fileStore.readGlobalFile(base_id)) as base:
        value = int(base.read()) * n
    path = job.fileStore.getLocalTempFile()
    with open(path, "w") as out:
        out.write(f"{value}\\n")
    return job.fileStore.writeGlobalFile(path)


def total(job, ids):
    values = [int(open(job.fileStore.readGlobalFile(i)).read()) for i in ids]
    path = job.fileStore.getLocalTempFile()
    with open(path, "w") as out:
        out.write(f"{sum(values)}\\n")
    return job.fileStore.writeGlobalFile(path)


def root(job, base_id):
    scaled = [job.addChildJobFn(scale, base_id, n).rv() for n in (1, 2, 3)]
    return job.addFollowOnJobFn(total, scaled).rv()


if __name__ == "__main__":
    parser = Job.Runner.getDefaultArgumentParser()
    parser.add_argument("output")
    options = parser.parse_args()
    with Toil(options) as toil:
        with open("base.txt", "w") as base:
            base.write("10\\n")
        base_id = toil.importFile("file://" + os.path.abspath(base.name))
        result = toil.start(Job.wrapJobFn(root, base_id))
        toil.exportFile(result, "file://" + options.output)
"""


def test_toil7_with_the_tes_batch_system(
    quickstart: Quickstart, toil7: Engine, workdir: Path
) -> None:
    """A root job, three children, a follow-on: files passed through the job store, which the
    tasks reach at its own path on the shared filesystem."""
    (workdir / "workflow.py").write_text(TOIL_WORKFLOW)
    result = run_as_account(
        [
            str(toil7.bin / "python"), "workflow.py", f"file:{workdir / 'jobstore'}",
            str(workdir / "total.txt"), "--batchSystem", "tes", "--tesEndpoint", quickstart.url,
            "--logInfo",
        ],
        workdir,
        toil7,
        timeout=600,
        env={"TOIL_APPLIANCE_SELF": toil7.image},
    )  # fmt: skip
    assert result.returncode == 0, explain(result, quickstart)
    assert (workdir / "total.txt").read_text() == "60\n"
    # Each job was a task of the service (Toil names them after the function), and completed.
    for name, count in (("'root'", 1), ("'scale'", 3), ("'total'", 1)):
        tasks = quickstart.list_tasks(name_prefix=name, view="BASIC")
        assert [task["state"] for task in tasks] == ["COMPLETE"] * count, (name, tasks)


def test_snakemake9_with_the_tes_executor_plugin_and_fs_storage(
    quickstart: Quickstart, snakemake9: Engine, workdir: Path
) -> None:
    """The same workflow; files, and the workflow's sources, go through the fs storage in the
    shared data directory, which the jobs reach at its own path."""
    (workdir / "Snakefile").write_text(SNAKEFILE)
    storage = workdir / "storage"
    result = run_as_account(
        [
            "snakemake", "--executor", "tes", "--tes-url", quickstart.url,
            "--container-image", snakemake9.image, "--jobs", "3",
            "--default-storage-provider", "fs", "--default-storage-prefix", str(storage),
            "--printshellcmds",
        ],
        workdir,
        snakemake9,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, explain(result, quickstart)
    assert (storage / "total.txt").read_text() == "60\n"
    tasks = [line.split()[-1] for line in result.stderr.splitlines() if "Task submitted:" in line]
    assert len(tasks) == 5, result.stderr[-4000:]
    for task_id in tasks:
        assert quickstart.get(task_id, view="MINIMAL")["state"] == "COMPLETE"


CWL_WORKFLOW = """
cwlVersion: v1.0
class: Workflow
inputs:
  message: File
outputs:
  counted:
    type: File
    outputSource: count/counted
steps:
  upper:
    in: {source: message}
    out: [upper]
    run:
      class: CommandLineTool
      requirements:
        DockerRequirement: {dockerPull: "IMAGE"}
      baseCommand: [tr, a-z, A-Z]
      stdin: $(inputs.source.path)
      stdout: upper.txt
      inputs:
        source: File
      outputs:
        upper: {type: stdout}
  count:
    in: {source: upper/upper}
    out: [counted]
    run:
      class: CommandLineTool
      requirements:
        DockerRequirement: {dockerPull: "IMAGE"}
      # CWL makes HOME the tool's output directory, which is also where it runs.
      baseCommand: [sh, -c, 'cat "$0"; wc -l < "$0"; echo "$HOME"; pwd']
      stdout: counted.txt
      inputs:
        source: {type: File, inputBinding: {position: 1}}
      outputs:
        counted: {type: stdout}
"""


def test_cwltes_two_steps(
    quickstart: Quickstart, cwltes: Engine, local_cluster: Any, workdir: Path
) -> None:
    """Two CommandLineTools, the second reading the first's output: files go as file:// URLs of
    cwltool's directories in the working directory, in the shared data directory."""
    image = f"{local_cluster.registry}/library/alpine:latest"
    (workdir / "workflow.cwl").write_text(CWL_WORKFLOW.replace("IMAGE", image))
    (workdir / "message.txt").write_text("hello\nworld\n")
    (workdir / "job.yml").write_text("message: {class: File, path: message.txt}\n")
    result = run_as_account(
        [
            "cwl-tes", "--tes", quickstart.url, "--outdir", str(workdir / "out"),
            "workflow.cwl", "job.yml",
        ],
        workdir,
        cwltes,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, explain(result, quickstart)
    counted = (workdir / "out" / "counted.txt").read_text().splitlines()
    assert counted[:3] == ["HELLO", "WORLD", "2"], counted
    # cwl-tes sends HOME in the executor's env: it reaches the tool (Apptainer's --home).
    home, cwd = counted[3:]
    assert home == cwd and home.startswith("/"), counted
    tasks = [line.split()[-1] for line in result.stderr.splitlines() if "task id:" in line]
    assert len(tasks) == 2, result.stderr[-4000:]
    for task_id in tasks:
        assert quickstart.get(task_id, view="MINIMAL")["state"] == "COMPLETE"


@pytest.fixture
def offline_service(
    local_cluster: Any, cluster_ftps_server: FtpsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    """A service whose tasks go to the network-less partition, their remote inputs and outputs
    staged by jobs of their own on the transfer partition, with the FTP server's login."""
    env = local_cluster.env
    toml = (
        f'[staging]\nnetrc_file = "{cluster_ftps_server.netrc}"\nwhere = "transfer"\n'
        f'transfer_partition = "{env["LOCAL_CLUSTER_TRANSFER_PARTITION"]}"\n'
        'transfer_time_limit = "10:00"\ntransfer_memory_mb = 256\n'
    )
    with start_bridge_service(
        local_cluster,
        tmp_path_factory.mktemp("cwlremote"),
        extra_toml=toml,
        slurm_toml=f'default_partition = "{env["LOCAL_CLUSTER_OFFLINE_PARTITION"]}"',
    ) as service:
        yield service


def test_cwltes_with_remote_storage_on_the_network_less_partition(
    offline_service: BridgeService,
    cluster_ftps_server: FtpsServer,
    cwltes: Engine,
    local_cluster: Any,
    tmp_path: Path,
) -> None:
    """The two steps again, with --remote-storage-url: cwl-tes uploads the input over FTPS and
    hands the tasks ftp:// URLs only. Each task runs on the network-less partition, its files
    moved by its stage-in and stage-out jobs on the transfer partition; the second step reads
    the first's output back from the FTP server."""
    ftps, service = cluster_ftps_server, offline_service
    image = f"{local_cluster.registry}/library/alpine:latest"
    (tmp_path / "workflow.cwl").write_text(CWL_WORKFLOW.replace("IMAGE", image))
    (tmp_path / "message.txt").write_text("hello\nworld\n")
    (tmp_path / "job.yml").write_text("message: {class: File, path: message.txt}\n")
    # cwl-tes logs in with the netrc of its HOME, by host name.
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".netrc").write_text(ftps.netrc.read_text())
    (tmp_path / "home" / ".netrc").chmod(0o600)
    result = run_as_account(
        [
            "cwl-tes", "--tes", service.url, "--remote-storage-url", ftps.url("cwl"),
            "--outdir", str(tmp_path / "out"), "workflow.cwl", "job.yml",
        ],
        tmp_path,
        cwltes,
        timeout=300,
        account=None,
    )  # fmt: skip
    assert result.returncode == 0, explain(result, service)
    counted = (tmp_path / "out" / "counted.txt").read_text().splitlines()
    assert counted[:3] == ["HELLO", "WORLD", "2"], counted
    assert [p.name for p in ftps.root.glob("cwl/*/message.txt")] == ["message.txt"]
    tasks = [line.split()[-1] for line in result.stderr.splitlines() if "task id:" in line]
    assert len(tasks) == 2, result.stderr[-4000:]
    env = local_cluster.env
    parts = {
        "slurm_stage_in_partition": env["LOCAL_CLUSTER_TRANSFER_PARTITION"],
        "slurm_partition": env["LOCAL_CLUSTER_OFFLINE_PARTITION"],
        "slurm_node": env["LOCAL_CLUSTER_OFFLINE_NODE"],
        "slurm_stage_out_partition": env["LOCAL_CLUSTER_TRANSFER_PARTITION"],
    }
    upper, count = (staged_task(service, task_id, list(parts)) for task_id in tasks)
    for task in (upper, count):
        assert task["state"] == "COMPLETE", task
        metadata = task["logs"][-1]["metadata"]
        assert metadata["slurm_staging"] == "transfer"
        assert {key: metadata[key] for key in parts} == parts, metadata
        urls = [i["url"] for i in task["inputs"]] + [o["url"] for o in task["outputs"]]
        assert all(url.startswith(ftps.url("cwl/")) for url in urls), urls
    # The first step's output went up to the FTP server and came back down as the second's input.
    (stdout,) = [o["url"] for o in upper["outputs"] if o["name"] == "stdout"]
    assert [i["url"] for i in count["inputs"]] == [stdout]
    uploaded = ftps.root / stdout.removeprefix(ftps.url(""))
    assert uploaded.read_text() == "HELLO\nWORLD\n"


def staged_task(service: BridgeService, task_id: str, keys: list[str]) -> dict[str, Any]:
    """The task once its attempt's metadata has `keys` (what sacct said of its three jobs,
    a cycle or two after the task ended)."""
    deadline = time.monotonic() + 30
    while True:
        task = service.get(task_id, view="FULL")
        metadata = (task.get("logs") or [{}])[-1].get("metadata", {})
        if all(key in metadata for key in keys) or time.monotonic() > deadline:
            return task
        time.sleep(0.5)


PULSAR_CLIENT = """
import sys, time
from pulsar.client.coexecution_manager import build_client_manager

tes_url, staging_image, tool_image, job_id = sys.argv[1:]
params = {
    "tes_url": tes_url,
    "jobs_directory": "/pulsar_staging",
    "pulsar_container_image": staging_image,
    "remote_container_handling": True,
    "default_file_action": "remote_transfer",
    "rewrite_parameters": "true",
    "galaxy_instance_id": "gx1",
    "tes_cpu_cores": "1",
    "tes_ram_gb": "1",
}
# Galaxy's files API is not there: a transfer the job tried would fail it.
galaxy = "http://127.0.0.1:9/api/jobs/" + job_id
manager = build_client_manager(tes_enabled=True)
client = manager.get_client(
    params, job_id, files_endpoint=galaxy + "/files?job_key=k",
    token_endpoint=galaxy + "/oidc-tokens?job_key=k", env=[],
)
# As pulsar.client.staging.up.submit_job does for Galaxy: the job's directories (set up
# locally, from jobs_directory), then the launch.
job_config = client.setup("echo_tool", "1.0")
task_id = client.launch(
    "echo tool-ran-$((6 * 7)) in $(pwd)",
    job_config=job_config,
    container_info={"container_id": tool_image},
    # Galaxy's pulsar_app_config: the tool's container brings its dependencies, and the staging
    # image's filesystem is read-only under Apptainer (Pulsar would make ./dependencies in /).
    pulsar_app_config={"tool_dependency_dir": "none"},
).external_id
print("task id:", task_id, flush=True)
# Pulsar's polling client GETs the FULL view, parsed by pydantic-tes. Its raw_check_complete
# takes QUEUED, which its state map lacks, for a failure: wait for the end with its TES client,
# then ask it.
watcher = manager.get_client({**params, "external_id": task_id}, job_id)
deadline = time.monotonic() + 240
ended = {"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED"}
while (state := watcher._tes_client.get_task(task_id, "FULL").state.value) not in ended:
    assert time.monotonic() < deadline, state
    time.sleep(2)
print("final status:", watcher.raw_check_complete()["status"], flush=True)
"""


def test_galaxy_pulsar_runs_a_tool_between_its_staging_containers(
    quickstart: Quickstart, pulsar: Engine, local_cluster: Any, workdir: Path
) -> None:
    """Pulsar's TES client (pulsar-app 0.16 with pydantic-tes, as Galaxy's PulsarTesJobRunner
    uses it) launches a tool: pulsar-submit, the tool's container waiting for its command
    line in the shared /pulsar_staging volume, then pulsar-finish; then it polls the task."""
    assert pulsar.image
    tool_image = f"{local_cluster.registry}/library/python:3-slim"
    result = run_as_account(
        [
            str(pulsar.bin / "python"), "-c", PULSAR_CLIENT, f"{quickstart.url}/ga4gh/tes/",
            pulsar.image, tool_image, "42",
        ],
        workdir,
        pulsar,
        timeout=400,
    )  # fmt: skip
    if "task id:" in result.stdout:
        # A tool container left waiting for a command line that never came would wait forever.
        task_id = result.stdout.split("task id:")[1].split()[0]
        if quickstart.get(task_id, view="MINIMAL")["state"] in ("QUEUED", "RUNNING"):
            quickstart.cancel(task_id)
    assert result.returncode == 0, explain(result, quickstart)
    assert "final status: complete" in result.stdout, explain(result, quickstart)
    task = quickstart.get(task_id, view="FULL")
    assert task["state"] == "COMPLETE", task
    assert task["name"] == "pulsar-gx1-42" and task["volumes"] == ["/pulsar_staging"]
    logs = task["logs"][-1]["logs"]
    assert [log["exit_code"] for log in logs] == [0, 0, 0], logs
    # The tool ran in its own container, in the job's working directory Pulsar staged.
    assert "tool-ran-42 in /pulsar_staging/42/working" in logs[1]["stdout"], logs[1]
