"""Job scripts run for real: images pulled from the local registry, Apptainer, and Slurm.

Each task is rendered by bridge.jobscript.render and run with `bash job.sh` (SLURM_JOB_ID set
by hand), and a few through `sbatch` on the local cluster; the outcome is read back with the same
`read_records` the poller uses.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config
from bridge.core.naming import STAGE_IN_EXIT_CODE
from bridge.images.cache import ImageCache
from bridge.images.ref import ImagePullError
from bridge.job.records import JobRecords, read_records
from bridge.jobscript.render import prepare_task_dir

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
HOSTILE = "'; touch /tmp/pwned-cluster # $(touch /tmp/pwned-cluster) `touch /tmp/pwned-cluster`"
HOSTILE_TEXT = HOSTILE + ' "\\ é ☃ 🐍\nsecond line'
HOSTILE_NAME = HOSTILE.replace("/", "_") + " é ☃,:"
#: Where a hostile value run by a shell would leave a file (in /tmp: each node's own).
PWNED = ["pwned-cluster", "pwned"]
_ids = itertools.count(1)
#: Job names are `tes-<task id>`: keep them apart from other test runs on the same cluster.
_RUN = f"jobscript-{os.getpid()}"


class Env:
    def __init__(self, config: Config, cache: ImageCache, sif: Path, shared: Path) -> None:
        self.config = config
        self.cache = cache
        self.sif = sif
        self.shared = shared
        self.last_task_dir = Path()
        #: sacct's ExitCode of the last job `sbatch` waited for ("4:0").
        self.last_exit_code = ""

    def prepare(self, task: dict[str, Any]) -> tuple[dict[str, Any], Path]:
        task = {"id": f"{_RUN}-{next(_ids)}", **task}
        images = {ex["image"]: str(self.cache.ensure(ex["image"])) for ex in task["executors"]}
        return task, prepare_task_dir(task, config=self.config, image_paths=images)

    def with_storage(self, **storage: Any) -> Env:
        """The same environment with other storage settings (file_input_mode...)."""
        section = self.config.storage.model_copy(update=storage)
        return Env(
            self.config.model_copy(update={"storage": section}), self.cache, self.sif, self.shared
        )

    def run(self, task: dict[str, Any], *, keep_bytes: int = 10240) -> tuple[int, JobRecords]:
        """`bash job.sh` on this machine, as the compute node would run it."""
        task, script = self.prepare(task)
        self.last_task_dir = script.parent
        job_id = f"direct-{task['id']}"
        env = dict(os.environ, SLURM_JOB_ID=job_id, PYTHONPATH=str(REPO))
        result = subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=300)
        records = read_records(script.parent, job_id, keep_bytes=keep_bytes)
        assert records.outcome is not None, result.stderr.decode(errors="replace")
        return result.returncode, records

    def sbatch(self, task: dict[str, Any]) -> tuple[str, str, JobRecords, float]:
        """Submit through Slurm; returns the job id, its final sacct state, records, seconds."""
        task, script = self.prepare(task)
        self.last_task_dir = script.parent
        started = time.monotonic()
        env = dict(os.environ, PYTHONPATH=str(REPO))
        submitted = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        job_id = submitted.stdout.strip().split(";")[0]
        state = ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            queued = subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True
            ).stdout.strip()
            if not queued:
                state, _, self.last_exit_code = (
                    subprocess.run(
                        ["sacct", "-n", "-X", "-P", "-j", job_id, "--format=State,ExitCode"],
                        capture_output=True,
                        text=True,
                    )
                    .stdout.strip()
                    .partition("|")
                )
                if state and state not in {"PENDING", "RUNNING", "COMPLETING"}:
                    break
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        return job_id, state, read_records(script.parent, job_id, keep_bytes=10240), elapsed


@pytest.fixture(scope="module")
def env(local_cluster: Any) -> Iterator[Env]:
    # On the shared filesystem: the job scripts run on the compute nodes.
    base = local_cluster.shared_path("job-script")
    shared = base / "shared"
    shared.mkdir()
    config = Config.model_validate(
        {
            "state_dir": str(base / "state"),
            "container": {
                "runtime": str(local_cluster.apptainer),
                "extra_flags": list(local_cluster.apptainer_flags),
                "default_registry": local_cluster.registry,
                "insecure_registries": [local_cluster.registry],
                "cache_dir": str(base / "images"),
                "allow_root": os.geteuid() == 0,  # the suite runs as root
            },
            "storage": {"allowed_dirs": [str(shared)]},
            "job": {"python": sys.executable, "log_tail_bytes": 10240},
        }
    )
    cache = ImageCache(config)
    started = time.monotonic()
    assert cache.ensure("alpine") is None  # a background pull starts; nothing waits for it
    sif = cache.pull("alpine", timeout=600)
    print(f"pulled alpine from {local_cluster.registry} in {time.monotonic() - started:.1f} s")
    yield Env(config, cache, sif, shared)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_pwned_files(local_cluster: Any) -> Any:
    paths = [Path("pwned-cluster"), *(d / name for d in local_cluster.tmp_dirs() for name in PWNED)]
    for path in paths:
        assert not path.exists(), f"{path} exists before the test"
    yield
    for path in paths:
        assert not path.exists(), f"a task value was executed by the shell: {path} exists"


def alpine(*command: str, **fields: Any) -> dict[str, Any]:
    return {"image": "alpine", "command": list(command), **fields}


def sh(script: str, **fields: Any) -> dict[str, Any]:
    return alpine("sh", "-c", script, **fields)


# --------------------------------------------------------------------------- images


def test_alpine_is_pulled_from_the_local_registry_into_the_cache(env: Env) -> None:
    assert env.sif.is_file() and env.sif.parent == env.config.image_cache_dir
    assert b"SIF_MAGIC" in env.sif.read_bytes()[:128]
    assert env.cache.ensure("docker://alpine:latest") == env.sif  # same image, no new pull
    assert not [p for p in env.sif.parent.glob(".*.sif")]  # no temporary file left


def test_missing_image_fails_with_the_runtimes_reason(env: Env) -> None:
    with pytest.raises(ImagePullError) as info:
        env.cache.pull("library/does-not-exist:1", timeout=300)
    assert "does-not-exist" in str(info.value)
    assert info.value.reason  # the runtime's own message
    with pytest.raises(ImagePullError):  # remembered: no new pull on the next poll
        env.cache.ensure("library/does-not-exist:1")


# --------------------------------------------------------------------------- bash job.sh


def test_echo_hello_completes(env: Env) -> None:
    code, records = env.run({"executors": [alpine("echo", "hello")]})
    assert code == 0
    assert records.outcome == "complete" and records.phase == "done"
    [executor] = records.executors
    assert (executor.exit_code, executor.stdout, executor.stderr) == (0, "hello\n", "")
    assert records.start_time <= executor.start_time <= executor.end_time <= records.end_time


def test_nonexistent_command_is_an_executor_error(env: Env) -> None:
    code, records = env.run({"executors": [alpine("ERROR")]})
    assert code == 0  # the job ran as designed; the records tell what happened
    assert records.outcome == "executor_error"
    [executor] = records.executors
    assert executor.exit_code not in (None, 0)
    assert executor.stderr  # the runtime says why


@pytest.mark.parametrize(("ignore_error", "count"), [(False, 1), (True, 2)])
def test_first_executor_failing_stops_the_rest_unless_ignored(
    env: Env, ignore_error: bool, count: int
) -> None:
    task = {"executors": [sh("exit 3", ignore_error=ignore_error), alpine("echo", "second")]}
    code, records = env.run(task)
    assert code == 0
    assert len(records.executors) == count
    assert records.executors[0].exit_code == 3
    if ignore_error:
        assert records.outcome == "complete"
        assert records.executors[1].stdout == "second\n"
    else:
        assert records.outcome == "executor_error"


def test_stdout_excerpt_keeps_the_first_and_last_lines(env: Env) -> None:
    code, records = env.run(
        {"executors": [sh("i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done")]},
        keep_bytes=100,
    )
    assert (code, records.outcome) == (0, "complete")
    lines = records.executors[0].stdout.splitlines()
    assert lines[:2] == ["line-0", "line-1"]
    assert lines[2].startswith("[tes-bridge: 18,796 of 18,890 bytes left out here; the whole ")
    assert lines[3:] == [f"line-{n}" for n in range(1992, 2000)]


def test_stdin_stdout_stderr_files_and_outputs(env: Env) -> None:
    task = {
        "inputs": [{"path": "/in/data.txt", "content": "through stdin\n"}],
        "outputs": [
            {"path": "/out/cat.txt", "url": f"file://{env.shared}/stdio/cat.txt"},
            {"path": "/out/err.txt", "url": f"{env.shared}/stdio/err.txt"},
        ],
        "executors": [
            sh(
                "cat; echo to-stderr >&2",
                stdin="/in/data.txt",
                stdout="/out/cat.txt",
                stderr="/out/err.txt",
            )
        ],
    }
    code, records = env.run(task)
    assert (code, records.outcome) == (0, "complete"), records.system_logs
    assert records.executors[0].stdout == "through stdin\n"
    assert records.executors[0].stderr == "to-stderr\n"
    assert (env.shared / "stdio" / "cat.txt").read_text() == "through stdin\n"
    assert (env.shared / "stdio" / "err.txt").read_text() == "to-stderr\n"
    assert {o["path"]: o["size_bytes"] for o in records.outputs} == {
        "/out/cat.txt": "14",
        "/out/err.txt": "10",
    }


def test_workdir(env: Env) -> None:
    task = {
        "volumes": ["/work"],
        "executors": [
            alpine("pwd", workdir="/work"),
            alpine("pwd", workdir="/tmp"),
        ],
    }
    code, records = env.run(task)
    assert (code, records.outcome) == (0, "complete"), [e.stderr for e in records.executors]
    assert [e.stdout for e in records.executors] == ["/work\n", "/tmp\n"]


def test_environment_values_arrive_exactly(env: Env) -> None:
    values = {
        "COMMAS": "a,b,c=d",
        "QUOTES": 'it\'s "quoted"',
        "SUBST": "$(id) `id` ${HOME}",
        "NEWLINE": "one\ntwo",
        "UNICODE": "é ☃ 🐍",
        "EMPTY": "",
    }
    command = 'printf "%s|" "$COMMAS" "$QUOTES" "$SUBST" "$NEWLINE" "$UNICODE" "$EMPTY"'
    code, records = env.run({"executors": [sh(command, env=values)]})
    assert (code, records.outcome) == (0, "complete"), records.executors[0].stderr
    assert records.executors[0].stdout == "|".join(values.values()) + "|"


def test_volume_written_by_one_executor_is_read_by_the_next(env: Env) -> None:
    task = {
        "volumes": ["/shared-vol"],
        "executors": [
            sh("echo from-first > /shared-vol/note"),
            alpine("cat", "/shared-vol/note"),
        ],
    }
    code, records = env.run(task)
    assert (code, records.outcome) == (0, "complete")
    assert records.executors[1].stdout == "from-first\n"


def test_inputs_are_readable_and_readonly_in_the_container(env: Env) -> None:
    (env.shared / "ref").mkdir(exist_ok=True)
    (env.shared / "ref" / "a.txt").write_text("file input\n")
    task = {
        "inputs": [
            {"path": "/in/content.txt", "content": "inline content\n"},
            {"path": "/in/ref", "url": f"file://{env.shared}/ref", "type": "DIRECTORY"},
        ],
        "executors": [
            alpine("cat", "/in/content.txt", "/in/ref/a.txt"),
            sh("echo x > /in/content.txt", ignore_error=True),
        ],
    }
    code, records = env.run(task)
    assert (code, records.outcome) == (0, "complete")
    assert records.executors[0].stdout == "inline content\nfile input\n"
    assert records.executors[1].exit_code != 0  # read-only mount


def test_hardlinked_inputs_stay_readonly_and_writable_ones_are_copies(env: Env) -> None:
    (env.shared / "link-src").mkdir(exist_ok=True)
    ro, rw = env.shared / "link-src" / "ro.txt", env.shared / "link-src" / "rw.txt"
    ro.write_text("original ro\n")
    rw.write_text("original rw\n")
    linked = env.with_storage(file_input_mode="hardlink")
    task = {
        "inputs": [
            {"path": "/in/ro.txt", "url": str(ro)},
            {"path": "/data/rw.txt", "url": str(rw)},
        ],
        "volumes": ["/data"],
        "executors": [
            sh("echo changed > /in/ro.txt", ignore_error=True),
            sh("echo changed > /data/rw.txt && cat /in/ro.txt /data/rw.txt"),
        ],
    }
    code, records = linked.run(task)
    assert (code, records.outcome) == (0, "complete"), records.system_logs
    assert records.executors[0].exit_code != 0  # read-only mount
    assert records.executors[1].stdout == "original ro\nchanged\n"
    assert ro.read_text() == "original ro\n" and rw.read_text() == "original rw\n"
    root = linked.last_task_dir / "root"
    assert (root / "in" / "ro.txt").stat().st_ino == ro.stat().st_ino
    assert (root / "data" / "rw.txt").stat().st_ino != rw.stat().st_ino


def test_bind_mode_mounts_inputs_from_the_shared_filesystem(env: Env) -> None:
    source = env.shared / "bound.txt"
    source.write_text("bound input\n")
    bound = env.with_storage(file_input_mode="bind")
    task = {
        "inputs": [{"path": "/ref/bound.txt", "url": f"file://{source}"}],
        "executors": [
            alpine("cat", "/ref/bound.txt"),
            sh("echo x > /ref/bound.txt", ignore_error=True),
        ],
    }
    code, records = bound.run(task)
    assert (code, records.outcome) == (0, "complete"), records.system_logs
    assert records.executors[0].stdout == "bound input\n"
    assert records.executors[1].exit_code != 0
    assert source.read_text() == "bound input\n"
    assert (bound.last_task_dir / "root" / "ref" / "bound.txt").read_text() == ""  # mount point


def test_directory_and_wildcard_outputs(env: Env) -> None:
    task = {
        "outputs": [
            {"path": "/results", "url": f"{env.shared}/dirout", "type": "DIRECTORY"},
            {"path": "/logs/*.log", "url": f"{env.shared}/logs", "path_prefix": "/logs"},
        ],
        "executors": [
            sh(
                "mkdir -p /results/sub && echo a > /results/a.txt && echo b > /results/sub/b.txt"
                " && echo 1 > /logs/one.log && echo 2 > /logs/two.log && echo 3 > /logs/x.txt"
            )
        ],
    }
    code, records = env.run(task)
    assert (code, records.outcome) == (0, "complete"), records.system_logs
    assert (env.shared / "dirout" / "sub" / "b.txt").read_text() == "b\n"
    assert sorted(p.name for p in (env.shared / "logs").iterdir()) == ["one.log", "two.log"]
    assert sorted(o["path"] for o in records.outputs) == [
        "/logs/one.log",
        "/logs/two.log",
        "/results/a.txt",
        "/results/sub/b.txt",
    ]


def test_missing_input_is_a_system_error_before_any_executor(env: Env) -> None:
    url = f"file://{env.shared}/no-such-input"
    code, records = env.run(
        {"inputs": [{"path": "/in/x", "url": url}], "executors": [alpine("true")]}
    )
    assert code == STAGE_IN_EXIT_CODE
    assert records.outcome == "system_error" and records.executors == []
    assert url in records.system_logs[0] and "does not exist" in records.system_logs[0]


def test_links_planted_in_the_container_never_reach_host_files(env: Env, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("host file\n")
    task = {
        "outputs": [{"path": "/outputs/out.txt", "url": f"{env.shared}/planted/out.txt"}],
        "executors": [
            # Inside the container the link is harmless; on the host it names the victim.
            alpine("ln", "-s", str(victim), "/outputs/out.txt"),
            alpine("echo", "overwrite?", stdout="/outputs/out.txt"),
        ],
    }
    code, records = env.run(task)
    assert victim.read_text() == "host file\n"
    assert (code, records.outcome) == (0, "executor_error")
    assert not (env.shared / "planted" / "out.txt").exists()
    assert records.executors[1].exit_code != 0
    assert any("symbolic link" in line for line in records.system_logs)


def test_hostile_values_run_exactly_what_was_asked(env: Env) -> None:
    task = {
        "name": HOSTILE_TEXT,
        "description": HOSTILE_TEXT,
        "tags": {"x": HOSTILE_TEXT},
        "inputs": [{"path": f"/in/{HOSTILE_NAME}", "content": HOSTILE_TEXT}],
        "outputs": [
            {"path": f"/out dir/{HOSTILE_NAME}", "url": f"{env.shared}/hostile/{HOSTILE_NAME}"}
        ],
        "volumes": [f"/vol/{HOSTILE_NAME}"],
        "executors": [
            alpine(
                "sh",
                "-c",
                'printf "%s\\n" "$@"; printf "%s" "$HOSTILE"; cat "/in/$NAME"; pwd; '
                'cat "/in/$NAME" > "/out dir/$NAME"',
                "argv0",
                HOSTILE_TEXT,
                "$(id)",
                "`id`",
                workdir=f"/vol/{HOSTILE_NAME}",
                env={"HOSTILE": HOSTILE_TEXT, "NAME": HOSTILE_NAME},
            )
        ],
    }
    code, records = env.run(task)
    assert (code, records.outcome) == (0, "complete"), (records.system_logs, records.executors)
    expected = f"{HOSTILE_TEXT}\n$(id)\n`id`\n{HOSTILE_TEXT}{HOSTILE_TEXT}/vol/{HOSTILE_NAME}\n"
    assert records.executors[0].stdout == expected
    assert (env.shared / "hostile" / HOSTILE_NAME).read_text() == HOSTILE_TEXT
    task_json = json.loads((env.last_task_dir / "task.json").read_text())
    assert task_json["name"] == HOSTILE_TEXT


# --------------------------------------------------------------------------- through Slurm


def test_task_through_sbatch_completes(env: Env) -> None:
    job_id, state, records, elapsed = env.sbatch(
        {"executors": [alpine("echo", "hello"), alpine("cat", "/etc/os-release")]}
    )
    print(f"sbatch job {job_id}: {state} after {elapsed:.1f} s")
    assert state == "COMPLETED"
    assert records.outcome == "complete"
    assert records.executors[0].stdout == "hello\n"
    assert (env.last_task_dir / f"slurm-{job_id}.out").exists()


def test_executor_error_through_sbatch_is_told_by_the_records(env: Env) -> None:
    _job_id, state, records, _ = env.sbatch({"executors": [sh("exit 4"), alpine("true")]})
    # Slurm's record agrees with the task's: the job failed with the executor's exit code.
    assert (state, env.last_exit_code) == ("FAILED", "4:0")
    assert records.outcome == "executor_error"
    assert [e.exit_code for e in records.executors] == [4]


def test_staging_failure_through_sbatch_fails_the_job(env: Env) -> None:
    _job_id, state, records, _ = env.sbatch(
        {"inputs": [{"path": "/in/x", "url": "sftp://host/x"}], "executors": [alpine("true")]}
    )
    assert (state, env.last_exit_code) == ("FAILED", f"{STAGE_IN_EXIT_CODE}:0")
    assert records.outcome == "system_error"
    assert "not supported by this deployment yet" in records.system_logs[0]
