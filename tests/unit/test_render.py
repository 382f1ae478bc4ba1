"""Rendering of job scripts: sbatch directives, bind mounts, quoting of hostile values."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config
from bridge.core.naming import JOB_NAME_TASK_CHARS, array_job_name, is_task_id, job_name
from bridge.job.layout import TaskLayout
from bridge.jobscript.binds import Bind, BindPlan, bind_args, compute_binds
from bridge.jobscript.directives import sbatch_directives
from bridge.jobscript.render import prepare_task_dir, render_script
from bridge.jobscript.task import RenderError
from bridge.slurm import parse_sinfo_node_sizes

REPO = Path(__file__).resolve().parents[2]
IMAGES = {"alpine": "/cache/alpine.sif"}
HOSTILE = "'; touch /tmp/pwned-h2 # $(touch /tmp/pwned-h2) `touch /tmp/pwned-h2` \"\n\\ é ☃ 🐍"


def make_config(tmp_path: Path, **sections: Any) -> Config:
    return Config.model_validate({"state_dir": str(tmp_path / "state"), **sections})


def make_task(**fields: Any) -> dict[str, Any]:
    task: dict[str, Any] = {
        "id": "task-1",
        "executors": [{"image": "alpine", "command": ["echo", "hello"]}],
    }
    task.update(fields)
    return task


def render(tmp_path: Path, task: dict[str, Any], **sections: Any) -> str:
    config = make_config(tmp_path, **sections)
    return render_script(
        task, config=config, task_dir=config.work_dir / task["id"], image_paths=IMAGES
    )


def directives(script: str) -> list[str]:
    return [line[len("#SBATCH ") :] for line in script.splitlines() if line.startswith("#SBATCH")]


def bash_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "check.sh"
    path.write_text(script, encoding="utf-8")
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- sbatch directives


def test_typical_task_gets_name_output_chdir_and_resources(tmp_path: Path) -> None:
    task = make_task(resources={"cpu_cores": 4, "ram_gb": 2, "disk_gb": 1.5})
    script = render(tmp_path, task, slurm={"disk_request": "tmp"})
    task_dir = tmp_path / "state" / "work" / "task-1"
    assert directives(script) == [
        "--job-name=tes-task-1",
        f"--output={task_dir}/slurm-%j.out",
        f"--chdir={task_dir}",
        "--no-requeue",
        "--cpus-per-task=4",
        "--mem=2048",
        "--tmp=1536",
    ]
    assert script.startswith("#!/bin/bash\n")
    bash_syntax_ok(script, tmp_path)


@pytest.mark.parametrize(
    ("ram_gb", "expected"),
    [(0.0001, "--mem=1"), (0.5, "--mem=512"), (1, "--mem=1024"), (1.00001, "--mem=1025")],
)
def test_memory_is_rounded_up_to_whole_megabytes_and_never_zero(
    tmp_path: Path, ram_gb: float, expected: str
) -> None:
    assert expected in directives(render(tmp_path, make_task(resources={"ram_gb": ram_gb})))


def test_zero_memory_asks_for_nothing_rather_than_the_whole_node(tmp_path: Path) -> None:
    found = directives(render(tmp_path, make_task(resources={"ram_gb": 0, "disk_gb": 0})))
    assert not [d for d in found if d.startswith(("--mem", "--tmp"))]


def disk_directives(
    tmp_path: Path, resources: dict[str, Any], mode: str, sinfo: str | None, **backend: Any
) -> list[str]:
    """The --tmp directives of a task, with what sinfo said (None: not read)."""
    config = make_config(tmp_path, slurm={"disk_request": mode})
    task = make_task(resources={**resources, "backend_parameters": backend})
    nodes = parse_sinfo_node_sizes(sinfo) if sinfo is not None else None
    script = render_script(
        task,
        config=config,
        task_dir=config.work_dir / "task-1",
        image_paths=IMAGES,
        nodes=nodes,
    )
    return [d for d in directives(script) if d.startswith("--tmp")]


#: Real `sinfo -h -a -o '%P|%d|%m'` of the local cluster, whose node declares TmpDisk.
SINFO_TMP = (REPO / "tests/data/slurm/sinfo-node-sizes.txt").read_text()
#: The same for nodes that declare none, and for a site with several partitions and node groups.
SINFO_NO_TMP = "main*|0\n"
SINFO_MIXED = "main*|0\nmain*|102400\nbig|204800\nbig|51200\nnone|0\n"


@pytest.mark.parametrize(
    ("disk_gb", "expected"),
    [(2.15, "--tmp=2202"), (0.00093, "--tmp=1"), (1, "--tmp=1024"), (1.00001, "--tmp=1025")],
)
def test_disk_gb_becomes_tmp_in_whole_megabytes_rounded_up(
    tmp_path: Path, disk_gb: float, expected: str
) -> None:
    assert disk_directives(tmp_path, {"disk_gb": disk_gb}, "auto", SINFO_TMP) == [expected]
    assert disk_directives(tmp_path, {"disk_gb": disk_gb}, "tmp", None) == [expected]


@pytest.mark.parametrize(
    ("mode", "sinfo", "backend", "expected"),
    [
        # auto: only where every node of the task's partition declares TmpDisk.
        ("auto", SINFO_TMP, {}, ["--tmp=1024"]),
        ("auto", SINFO_NO_TMP, {}, []),
        ("auto", None, {}, []),  # sinfo not read: never a --tmp Slurm may refuse
        ("auto", SINFO_MIXED, {}, []),  # the default partition has a node without
        ("auto", SINFO_MIXED, {"partition": "big"}, ["--tmp=1024"]),
        ("auto", SINFO_MIXED, {"partition": "none"}, []),
        ("auto", SINFO_MIXED, {"partition": "unknown"}, []),
        # tmp: always, whatever the nodes declare; ignore: never.
        ("tmp", SINFO_NO_TMP, {}, ["--tmp=1024"]),
        ("tmp", None, {}, ["--tmp=1024"]),
        ("ignore", SINFO_TMP, {}, []),
    ],
)
def test_disk_request_setting_decides_where_disk_gb_becomes_tmp(
    tmp_path: Path, mode: str, sinfo: str | None, backend: dict[str, str], expected: list[str]
) -> None:
    assert disk_directives(tmp_path, {"disk_gb": 1}, mode, sinfo, **backend) == expected


def test_zones_use_the_smallest_tmp_disk_of_every_listed_partition(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    nodes = parse_sinfo_node_sizes(SINFO_MIXED)
    for zones, expected in ((["big"], ["--tmp=1024"]), (["big", "none"], [])):
        task = make_task(resources={"disk_gb": 1, "zones": zones})
        script = render_script(
            task, config=config, task_dir=config.work_dir / "t", image_paths=IMAGES,
            nodes=nodes,
        )  # fmt: skip
        assert [d for d in directives(script) if d.startswith("--tmp")] == expected


def mem_directives(tmp_path: Path, ram_gb: float, sinfo: str | None, **resources: Any) -> list[str]:
    """The --mem directives of a task asking for `ram_gb`, with what sinfo said (None: not
    read)."""
    config = make_config(tmp_path)
    task = make_task(resources={"ram_gb": ram_gb, **resources})
    nodes = parse_sinfo_node_sizes(sinfo) if sinfo is not None else None
    script = render_script(
        task, config=config, task_dir=config.work_dir / "task-1", image_paths=IMAGES, nodes=nodes
    )
    return [d for d in directives(script) if d.startswith("--mem")]


#: Nodes of 4000 MB (Slurm's MB: MiB) in the default partition, 64000 MB in `big`.
SINFO_MEMORY = "main*|0|4000\nbig|0|64000\nbig|0|16000\n"


@pytest.mark.parametrize(
    ("ram_gb", "expected"),
    [
        # Snakemake, cwl-tes, crankshaft: the node's 4000 MB in decimal GB (ceil: 4096).
        (4.0, "--mem=4000"),
        (3.95, "--mem=4000"),  # 3950 MB decimal, 4045 in MiB: the node's whole memory
        # Nextflow, Toil: the node's 4000 MB in GiB, exactly what it is asked.
        (4000 / 1024, "--mem=4000"),
        # Below the node in both readings, or above it in both: as asked, in MiB.
        (3.5, "--mem=3584"),
        (3.9, "--mem=3994"),
        (4.001, "--mem=4098"),  # sbatch refuses it, as it refuses every request above a node
    ],
)
def test_exactly_a_nodes_memory_in_either_reading_is_the_nodes_whole_memory(
    tmp_path: Path, ram_gb: float, expected: str
) -> None:
    assert mem_directives(tmp_path, ram_gb, SINFO_MEMORY) == [expected]


def test_memory_of_a_node_counts_the_largest_node_of_the_tasks_partitions(
    tmp_path: Path,
) -> None:
    assert mem_directives(tmp_path, 64, SINFO_MEMORY, zones=["big"]) == ["--mem=64000"]
    assert mem_directives(tmp_path, 16, SINFO_MEMORY, zones=["big"]) == ["--mem=16384"]
    assert mem_directives(tmp_path, 64, SINFO_MEMORY, zones=["main", "big"]) == ["--mem=64000"]
    assert mem_directives(tmp_path, 64, SINFO_MEMORY) == ["--mem=65536"]  # main's nodes: 4000


@pytest.mark.parametrize(
    ("ram_gb", "sinfo", "expected"),
    [
        # The local cluster's RealMemory in decimal GB: a float whose x1000 is not whole.
        (23.081, SINFO_TMP, "--mem=23081"),
        # What the nodes have is not known: as asked.
        (4.0, None, "--mem=4096"),
        (4.0, "main*|0\n", "--mem=4096"),
        (4.0, "big|0|64000\n", "--mem=4096"),  # no default partition listed
    ],
)
def test_node_memory_is_used_only_where_known(
    tmp_path: Path, ram_gb: float, sinfo: str | None, expected: str
) -> None:
    assert mem_directives(tmp_path, ram_gb, sinfo) == [expected]


def test_zero_cpu_cores_asks_for_nothing(tmp_path: Path) -> None:
    found = directives(render(tmp_path, make_task(resources={"cpu_cores": 0})))
    assert not [d for d in found if d.startswith("--cpus-per-task")]


@pytest.mark.parametrize("bad", [-1, "2", True, float("nan")])
def test_nonsense_memory_is_refused(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(RenderError, match=r"resources\.ram_gb"):
        render(tmp_path, make_task(resources={"ram_gb": bad}))


def test_zones_become_partitions_checked_against_the_site_list(tmp_path: Path) -> None:
    slurm = {"partitions": ["short", "long"], "default_partition": "short"}
    found = directives(
        render(tmp_path, make_task(resources={"zones": ["long", "short"]}), slurm=slurm)
    )
    assert "--partition=long,short" in found
    with pytest.raises(RenderError, match=r"resources.zones\[1\].*'gpu'"):
        render(tmp_path, make_task(resources={"zones": ["long", "gpu"]}), slurm=slurm)
    assert "--partition=short" in directives(render(tmp_path, make_task(), slurm=slurm))


def test_any_partition_is_fine_when_the_site_lists_none(tmp_path: Path) -> None:
    found = directives(render(tmp_path, make_task(resources={"zones": ["whatever"]})))
    assert "--partition=whatever" in found


def test_preemptible_task_uses_the_preemptible_partition_and_qos(tmp_path: Path) -> None:
    slurm = {
        "default_partition": "normal",
        "preemptible_partition": "spot",
        "preemptible_qos": "scavenger",
        "default_time_limit": "2:00:00",
    }
    found = directives(render(tmp_path, make_task(resources={"preemptible": True}), slurm=slurm))
    assert {"--partition=spot", "--qos=scavenger", "--time=2:00:00"} <= set(found)
    found = directives(render(tmp_path, make_task(resources={"preemptible": False}), slurm=slurm))
    assert "--partition=normal" in found
    assert not [d for d in found if d.startswith("--qos")]


def test_a_preemptible_task_naming_its_partition_or_qos_keeps_them(tmp_path: Path) -> None:
    slurm = {"preemptible_partition": "spot", "preemptible_qos": "scavenger"}
    named = {"preemptible": True, "backend_parameters": {"partition": "gpu"}}
    found = directives(render(tmp_path, make_task(resources=named), slurm=slurm))
    # The partition the task names wins; the site's preemptible QOS still marks it preemptible.
    assert {"--partition=gpu", "--qos=scavenger"} <= set(found)
    zones = {"preemptible": True, "zones": ["long"], "backend_parameters": {"qos": "high"}}
    found = directives(render(tmp_path, make_task(resources=zones), slurm=slurm))
    assert {"--partition=long", "--qos=high"} <= set(found)


def test_preemptible_is_ignored_where_the_site_set_no_preemptible_partition_or_qos(
    tmp_path: Path,
) -> None:
    slurm = {"default_partition": "normal"}
    found = directives(render(tmp_path, make_task(resources={"preemptible": True}), slurm=slurm))
    assert "--partition=normal" in found and not [d for d in found if d.startswith("--qos")]


def test_backend_parameters_become_directives(tmp_path: Path) -> None:
    params = {
        "partition": "debug",
        "account": "proj-1",
        "qos": "high",
        "time_limit": "1-12:00:00",
        "gres": "gpu:a100:2",
        "gpus": "2",
        "constraint": "(intel|amd)&avx2",
        "reservation": "maint.2024",
        "unknown_key": "ignored",
    }
    found = directives(render(tmp_path, make_task(resources={"backend_parameters": params})))
    for option in (
        "--partition=debug",
        "--account=proj-1",
        "--qos=high",
        "--time=1-12:00:00",
        "--gres=gpu:a100:2",
        "--gpus=2",
        "--constraint=(intel|amd)&avx2",
        "--reservation=maint.2024",
    ):
        assert option in found
    assert not [d for d in found if "ignored" in d]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("partition", "debug\n#SBATCH --uid=0"),
        ("partition", "debug --uid=0"),
        ("account", "a;b"),
        ("qos", "--qos=x"),
        ("qos", "hi$(id)"),
        ("time_limit", "10\n"),
        ("time_limit", "soon"),
        ("time_limit", "1:2:3:4"),
        ("gres", "gpu:1 --wrap=id"),
        ("gpus", "1`id`"),
        ("constraint", "a b"),
        ("constraint", "x\r\ny"),
        ("reservation", "r'"),
        ("account", ""),
    ],
)
def test_backend_parameter_injection_is_refused_naming_the_parameter(
    tmp_path: Path, key: str, value: str
) -> None:
    task = make_task(resources={"backend_parameters": {key: value}})
    with pytest.raises(RenderError, match=rf"resources\.backend_parameters\.{key}"):
        render(tmp_path, task)


def test_partition_from_backend_parameters_is_checked_against_the_site_list(
    tmp_path: Path,
) -> None:
    task = make_task(resources={"backend_parameters": {"partition": "secret"}})
    with pytest.raises(RenderError, match="not available"):
        render(tmp_path, task, slurm={"partitions": ["debug"]})


def test_site_directives_come_last_and_prologue_epilogue_are_placed(tmp_path: Path) -> None:
    slurm = {
        "extra_directives": ["--nodes=1", "--export=NONE"],
        "prologue": "echo SITE-PROLOGUE",
        "epilogue": "echo SITE-EPILOGUE",
    }
    script = render(tmp_path, make_task(), slurm=slurm)
    assert directives(script)[-2:] == ["--nodes=1", "--export=NONE"]
    assert script.index("SITE-PROLOGUE") < script.index("start_records()")
    assert "trap 'set +eu; remove_exec_tmp; site_epilogue' EXIT" in script
    bash_syntax_ok(script, tmp_path)


@pytest.mark.parametrize("task_id", ["a b", "x\n#SBATCH --uid=0", "../x", "", "é"])
def test_task_id_must_be_plain(tmp_path: Path, task_id: str) -> None:
    with pytest.raises(RenderError, match="id"):
        render(tmp_path, make_task(id=task_id))


def test_job_name_comes_from_the_one_naming_rule(tmp_path: Path) -> None:
    assert job_name("task-1") == "tes-task-1"
    assert f"--job-name={job_name('task-1')}" in directives(render(tmp_path, make_task()))
    named = render(tmp_path / "named", make_task(name="align reads"))
    assert "--job-name=align_reads-tes-task-1" in directives(named)
    assert is_task_id("task-1") and not is_task_id("a b") and not is_task_id(None)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (None, "tes-t1"),
        ("", "tes-t1"),
        ("align", "align-tes-t1"),
        ("FASTQC (sample_1)", "FASTQC_sample_1-tes-t1"),
        ("a,b|c d\nx", "a_b_c_d_x-tes-t1"),  # sbatch, squeue --name and sacct -P take it
        ("--uid=0", "uid_0-tes-t1"),
        ("..", "tes-t1"),
        ("é", "tes-t1"),
        ("x" * 100, "x" * JOB_NAME_TASK_CHARS + "-tes-t1"),
        ("a" * (JOB_NAME_TASK_CHARS - 1) + "-b", "a" * (JOB_NAME_TASK_CHARS - 1) + "-tes-t1"),
    ],
)
def test_a_job_name_starts_with_the_tasks_name_and_ends_with_its_id(
    name: str | None, expected: str
) -> None:
    """squeue shows 8 characters of a job's name, sacct 10: the task's name comes first."""
    assert job_name("t1", name) == expected


@pytest.mark.parametrize(
    ("names", "start"),
    [
        (["align (1)", "align (2)", "align (10)"], "align-"),
        (["snakejob.map.1.sh", "snakejob.map.2.sh"], "snakejob.map-"),
        (["align", "call"], ""),
        (["align", None], ""),
        ([], ""),
    ],
)
def test_an_array_is_named_after_the_start_its_tasks_names_share(
    names: list[str | None], start: str
) -> None:
    assert array_job_name("ab12", names) == f"{start}tes-array-ab12"


def test_work_dir_that_sbatch_cannot_parse_is_refused(tmp_path: Path) -> None:
    config = make_config(tmp_path / "a dir")
    layout = TaskLayout(config.work_dir / "task-1")
    with pytest.raises(RenderError, match=r"job\.work_dir"):
        sbatch_directives(make_task(), config=config, layout=layout)


# --------------------------------------------------------------------------- bind mounts


def binds_of(tmp_path: Path, task: dict[str, Any], **sections: Any) -> BindPlan:
    config = make_config(tmp_path, **sections)
    layout = TaskLayout(config.work_dir / task["id"])
    return compute_binds(task, config=config, layout=layout)


def test_directories_inside_an_outer_bind_and_workdirs_in_one_are_made(tmp_path: Path) -> None:
    # Sprocket's task: its work directory is a DIRECTORY output and the executor's workdir,
    # below the directory of its stdout file; the runtime cannot make it in the image.
    task = make_task(
        outputs=[
            {"path": "/mnt/task/work", "url": "file:///w", "type": "DIRECTORY"},
            {"path": "/mnt/task/stdout", "url": "file:///o"},
        ],
        executors=[
            {"image": "alpine", "command": ["true"], "workdir": "/mnt/task/work"},
            {"image": "alpine", "command": ["true"], "workdir": "/mnt/task/sub/dir"},
            {"image": "alpine", "command": ["true"], "workdir": "/opt/app"},  # the image's own
        ],
    )
    plan = binds_of(tmp_path, task)
    assert {b.container for b in plan.binds} == {"/mnt/task"}
    assert plan.mkdirs == ["/mnt/task", "/mnt/task/sub/dir", "/mnt/task/work"]


def test_an_output_directory_inside_a_bind_is_left_to_the_executor(tmp_path: Path) -> None:
    # Cromwell's script makes its glob directory with a plain `mkdir` (no -p).
    task = make_task(
        outputs=[
            {"path": "/cromwell_root/rc", "url": "file:///rc"},
            {"path": "/cromwell_root/glob-1", "url": "file:///g", "type": "DIRECTORY"},
        ],
    )
    assert binds_of(tmp_path, task).mkdirs == ["/cromwell_root"]


def test_binds_follow_funnel_inputs_readonly_output_dirs_and_volumes_readwrite(
    tmp_path: Path,
) -> None:
    task = make_task(
        inputs=[
            {"path": "/inputs/a.txt", "content": "a"},
            {"path": "/inputs/ref", "url": "file:///x", "type": "DIRECTORY"},
            {"path": "/work/nested/b.txt", "content": "b"},
        ],
        outputs=[
            {"path": "/outputs/o.txt", "url": "file:///o"},
            {"path": "/outputs/more/p.txt", "url": "file:///p"},
            {"path": "/results", "url": "file:///r", "type": "DIRECTORY"},
            {"path": "/glob/x/*.txt", "url": "file:///g", "path_prefix": "/glob"},
        ],
        volumes=["/work", "/scratch"],
        executors=[
            {"image": "alpine", "command": ["true"], "stdout": "/logs/out", "stderr": "/dev/null"}
        ],
    )
    plan = binds_of(tmp_path, task)
    binds = plan.binds
    root = tmp_path / "state" / "work" / "task-1" / "root"
    found = {(b.container, b.readonly) for b in binds}
    assert found == {
        ("/inputs/a.txt", True),
        ("/inputs/ref", True),
        ("/outputs", False),
        ("/results", False),
        ("/glob/x", False),
        ("/work", False),  # /work/nested/b.txt is visible through it
        ("/scratch", False),
        ("/logs", False),
    }
    assert all(b.host == str(root) + b.container for b in binds)
    # Nothing inside a bind (/outputs/more): a job script may `mkdir` it itself (Cromwell).
    assert plan.mkdirs == sorted(["/outputs", "/results", "/glob/x", "/work", "/scratch", "/logs"])
    assert plan.bound_inputs == [] and plan.linkable_inputs == []


def test_readonly_input_inside_readonly_input_is_dropped_but_readwrite_is_kept(
    tmp_path: Path,
) -> None:
    task = make_task(
        inputs=[
            {"path": "/ref", "url": "file:///x", "type": "DIRECTORY"},
            {"path": "/ref/extra.txt", "content": "x"},
        ],
        volumes=["/ref/scratch"],
    )
    binds = binds_of(tmp_path, task).binds
    assert [(b.container, b.readonly) for b in binds] == [("/ref", True), ("/ref/scratch", False)]


def test_only_inputs_that_stay_readonly_may_be_hardlinked(tmp_path: Path) -> None:
    task = make_task(
        inputs=[
            {"path": "/data/in.txt", "url": "/x"},  # inside a volume: writable
            {"path": "/ref", "url": "/r", "type": "DIRECTORY"},  # a volume inside it
            {"path": "/in/ok.txt", "url": "/y"},
        ],
        volumes=["/data", "/ref/tmp"],
    )
    plan = binds_of(tmp_path, task, storage={"file_input_mode": "hardlink"})
    assert plan.linkable_inputs == [2]
    assert ("/data/in.txt", True) not in [(b.container, b.readonly) for b in plan.binds]
    assert binds_of(tmp_path, task).linkable_inputs == []  # copy mode


def test_bind_mode_mounts_allowed_files_straight_from_the_shared_filesystem(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ref.fa").write_text(">x\n")
    task = make_task(
        inputs=[
            {"path": "/ref/ref.fa", "url": f"file://{shared}/ref.fa"},
            {"path": "/ref2/outside.fa", "url": "/etc/hostname"},
        ]
    )
    storage = {"file_input_mode": "bind", "allowed_dirs": [str(shared)]}
    plan = binds_of(tmp_path, task, storage=storage)
    assert plan.bound_inputs == [0]
    assert Bind(str(shared / "ref.fa"), "/ref/ref.fa", True, uniform=False) in plan.binds
    # Not allowed: staged (and refused) by stage-in instead of being mounted.
    assert any(b.container == "/ref2/outside.fa" and b.uniform for b in plan.binds)


def test_shared_dirs_are_bound_read_write_at_their_own_path_in_every_executor(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    task = make_task(
        executors=[
            {"image": "alpine", "command": ["true"]},
            {"image": "alpine", "command": ["true"]},
        ],
        volumes=[f"{shared}/vol"],
    )
    plan = binds_of(tmp_path, task, storage={"shared_dirs": [str(shared)]})
    # The shared directory first, so what the task mounts inside it lies on top (both after
    # the scratch bind of /tmp, where pytest's tmp_path lies).
    binds = [*plan.binds, *plan.after_scratch]
    assert binds[0] == Bind(str(shared), str(shared), False, uniform=False)
    assert binds[1].container == f"{shared}/vol" and binds[1].uniform
    assert plan.mkdirs == [f"{shared}/vol"]  # nothing is made for the shared bind itself
    script = render(tmp_path, task, storage={"shared_dirs": [str(shared)]})
    assert script.count(f"--bind {shared}:{shared} ") == 2


def test_a_shared_dir_under_tmp_is_mounted_on_top_of_the_scratch_bind(tmp_path: Path) -> None:
    shared = tmp_path / "shared"  # pytest's tmp_path lies under /tmp
    shared.mkdir()
    assert str(shared).startswith("/tmp/")
    plan = binds_of(tmp_path, make_task(), storage={"shared_dirs": [str(shared)]})
    assert plan.scratch_targets == ["/tmp", "/var/tmp"]
    assert plan.after_scratch == [Bind(str(shared), str(shared), False, uniform=False)]
    assert plan.scratch_mountpoints == ["tmp" + str(shared)[len("/tmp") :]]
    script = render(tmp_path, make_task(), storage={"shared_dirs": [str(shared)]})
    lines = script.splitlines()
    scratch = lines.index('    --bind "$EXEC_TMP/tmp:/tmp" \\')
    assert lines[scratch + 2] == f"    --bind {shared}:{shared} \\"
    mkdir = f'  mkdir -p -- "$EXEC_TMP/"tmp{str(shared)[len("/tmp") :]} || {{ no_mount_point;'
    assert any(line.startswith(mkdir) for line in lines), lines
    bash_syntax_ok(script, tmp_path)
    # A shared directory at or above /tmp is what the site wants there: no scratch bind.
    config = make_config(tmp_path, state_dir="/srv/tes-state", storage={"shared_dirs": ["/tmp"]})
    plan = compute_binds(make_task(), config=config, layout=TaskLayout(config.work_dir / "t"))
    assert plan.scratch_targets == ["/var/tmp"] and plan.after_scratch == []


def test_same_path_file_urls_in_a_shared_dir_are_used_in_place(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    task = make_task(
        inputs=[
            # Toil's job store: a DIRECTORY input at its own path.
            {"path": f"{shared}/js", "url": f"file://{shared}/js", "type": "DIRECTORY"},
            {"path": f"{shared}/a.txt", "url": f"{shared}/a.txt"},
            # At another path, or from a directory that is only allowed: copied as before.
            {"path": "/in/a.txt", "url": f"file://{shared}/a.txt"},
            {"path": f"{shared}/c.txt", "url": f"file://{shared}/b.txt"},
            {"path": f"{shared}/d.txt", "content": "x"},
        ],
        outputs=[
            {"path": f"{shared}/out/x.txt", "url": f"file://{shared}/out/x.txt"},
            {"path": "/out/y.txt", "url": f"file://{shared}/out/y.txt"},
        ],
    )
    plan = binds_of(tmp_path, task, storage={"shared_dirs": [str(shared)]})
    assert plan.in_place_inputs == [0, 1]
    assert plan.in_place_outputs == [0]
    containers = [(b.container, b.readonly) for b in [*plan.binds, *plan.after_scratch]]
    # Nothing read-only is mounted over the live job store, nothing over the output's directory.
    assert (f"{shared}/js", True) not in containers
    assert (f"{shared}/a.txt", True) not in containers
    assert (f"{shared}/out", False) not in containers
    assert ("/in/a.txt", True) in containers and (f"{shared}/c.txt", True) in containers
    assert ("/out", False) in containers
    # Without shared_dirs, the same task is staged and bound as before.
    plain = binds_of(tmp_path, task, storage={"allowed_dirs": [str(shared)]})
    assert plain.in_place_inputs == [] and plain.in_place_outputs == []
    plain_binds = [*plain.binds, *plain.after_scratch]
    assert (f"{shared}/js", True) in [(b.container, b.readonly) for b in plain_binds]


@pytest.mark.parametrize(
    "task",
    [
        make_task(volumes=["/"]),
        make_task(volumes=["/proc/x"]),
        make_task(outputs=[{"path": "/out.txt", "url": "file:///o"}]),
        make_task(inputs=[{"path": "/dev/sda", "content": "x"}]),
        make_task(volumes=["relative"]),
        make_task(volumes=["/a/../b"]),
        make_task(outputs=[{"path": "/o//x", "url": "file:///o"}]),
    ],
)
def test_paths_that_cannot_be_mounted_are_refused(tmp_path: Path, task: dict[str, Any]) -> None:
    with pytest.raises(RenderError):
        render(tmp_path, task)


def test_paths_with_separators_use_csv_quoted_mount_flags() -> None:
    args = bind_args(
        [
            Bind("/w/root/plain", "/plain", False),
            Bind("/w/root/a,b:c", "/a,b:c", True),
            Bind('/w/root/q"x', '/q"x', False),
        ]
    )
    assert args == [
        "--bind",
        "/w/root/plain:/plain",
        "--mount",
        'type=bind,"source=/w/root/a,b:c","destination=/a,b:c",ro',
        "--mount",
        'type=bind,"source=/w/root/q""x","destination=/q""x"',
    ]


# --------------------------------------------------------------------------- hostile values


def hostile_task() -> dict[str, Any]:
    return {
        "id": "hostile-1",
        "name": HOSTILE,
        "tags": {HOSTILE: HOSTILE},
        "inputs": [{"path": f"/in/{HOSTILE.replace('/', '_')}", "content": HOSTILE}],
        "outputs": [
            {"path": f"/out/{HOSTILE.replace('/', '_')}", "url": "file:///nowhere/x"},
        ],
        "volumes": ["/vol/a,b:c"],
        "executors": [
            {
                "image": "alpine",
                "command": ["printf", "%s\\n", HOSTILE, "$(id)", "`id`", "a\nb"],
                "workdir": f"/work/{HOSTILE.replace('/', '_')}",
                "env": {"HOSTILE": HOSTILE, "COMMAS": "a,b,c=d", "EMPTY": ""},
                "stdout": f"/out/{HOSTILE.replace('/', '_')}.stdout",
                "stdin": f"/in/{HOSTILE.replace('/', '_')}",
            }
        ],
    }


def test_hostile_values_render_to_a_valid_script(tmp_path: Path) -> None:
    script = render(tmp_path, hostile_task())
    bash_syntax_ok(script, tmp_path)
    # Task values never appear outside quotes: the only unquoted lines are the template's.
    assert "touch /tmp/pwned-h2 #" in script  # inside single quotes
    # The task's name goes first into the job's, only the characters sbatch takes as they are.
    name = job_name("hostile-1", HOSTILE)
    assert f"#SBATCH --job-name={name}\n" in script
    assert name.endswith("-tes-hostile-1") and re.fullmatch(r"[A-Za-z0-9_.-]+", name)
    assert HOSTILE.splitlines()[0] not in "\n".join(directives(script))


FAKE_RUNTIME = """#!{python}
import json, os, sys
# A stand-in runtime that records what it was asked to run instead of running it.
with open(os.environ["FAKE_LOG"], "a") as log:
    env = {{k: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")}}
    log.write(json.dumps({{"argv": sys.argv[1:], "env": env}}) + "\\n")
"""


def test_hostile_values_reach_the_runtime_exactly_and_run_nothing(tmp_path: Path) -> None:
    runtime = tmp_path / "fake-apptainer"
    runtime.write_text(FAKE_RUNTIME.format(python=sys.executable))
    runtime.chmod(0o755)
    config = make_config(tmp_path, container={"runtime": str(runtime), "allow_root": True})
    task = hostile_task()
    image = tmp_path / "alpine.sif"
    image.write_text("not really an image")
    script = prepare_task_dir(task, config=config, image_paths={"alpine": str(image)})
    log = tmp_path / "runtime.log"
    env = dict(os.environ, SLURM_JOB_ID="7", FAKE_LOG=str(log), PYTHONPATH=str(REPO))
    pwned = [Path("/tmp/pwned-h2"), Path.cwd() / "pwned-h2"]
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert not any(p.exists() for p in pwned)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 1, result.stderr
    argv = calls[0]["argv"]
    assert argv[-6:] == task["executors"][0]["command"]
    assert argv[-7] == str(image)
    assert argv[argv.index("--pwd") + 1] == task["executors"][0]["workdir"]
    # One level of escaping for the runtime's own `export X="..."` (see the cluster tests).
    escaped = HOSTILE.replace("\\", "\\\\").replace("$", "\\$").replace("`", "\\`")
    assert calls[0]["env"] == {
        "APPTAINERENV_HOSTILE": escaped,
        "APPTAINERENV_COMMAS": "a,b,c=d",
        "APPTAINERENV_EMPTY": "",
    }
    mounts = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--mount"]
    assert any('"destination=/vol/a,b:c"' in mount for mount in mounts)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("command", ["echo", "nul\0byte"]),
        ("command", []),
        ("env", {"BAD-NAME": "x"}),
        ("env", {"X": "\ud800"}),
        ("workdir", "relative"),
        ("image", "unknown-image"),
    ],
)
def test_unusable_executor_values_are_refused_naming_the_field(
    tmp_path: Path, field: str, value: Any
) -> None:
    executor = {"image": "alpine", "command": ["true"], field: value}
    with pytest.raises(RenderError, match=rf"executors\[0\]\.{field}"):
        render(tmp_path, make_task(executors=[executor]))


def test_executors_run_in_order_and_ignore_error_continues(tmp_path: Path) -> None:
    task = make_task(
        executors=[
            {"image": "alpine", "command": ["a"], "ignore_error": True},
            {"image": "alpine", "command": ["b"]},
            {"image": "alpine", "command": ["c"]},
        ]
    )
    script = render(tmp_path, task)
    assert "run_executor 0 executor_0 || true" in script
    assert "run_executor 1 executor_1 || return\n" in script
    assert script.index("executor_1 ||") < script.index("executor_2 ||")


def test_environment_is_escaped_for_the_runtimes_evaluation_unless_no_eval(
    tmp_path: Path,
) -> None:
    executor = {"image": "alpine", "command": ["env"], "env": {"A": '$(id) `x` \\ "'}}
    script = render(tmp_path, make_task(executors=[executor]))
    assert "APPTAINERENV_A='\\$(id) \\`x\\` \\\\ \"'" in script
    script = render(
        tmp_path / "b",
        make_task(executors=[executor]),
        container={"exec_flags": ["--cleanenv", "--no-eval"]},
    )
    assert "APPTAINERENV_A='$(id) `x` \\ \"'" in script


def test_singularity_gets_its_own_environment_prefix(tmp_path: Path) -> None:
    executor = {"image": "alpine", "command": ["env"], "env": {"A": "1"}}
    script = render(
        tmp_path,
        make_task(executors=[executor]),
        container={"runtime": "/usr/local/bin/singularity"},
    )
    assert "SINGULARITYENV_A=1" in script
    assert "APPTAINERENV_" not in script


def test_env_home_becomes_the_runtimes_home_flag_not_an_env_assignment(tmp_path: Path) -> None:
    """Apptainer refuses APPTAINERENV_HOME; `--home` alone would bind that host path, so
    `--no-home` comes with it (HOME is then only the variable, as the task asked)."""
    executor = {
        "image": "alpine",
        "command": ["env"],
        "env": {"HOME": "/out/cwl dir", "A": "1"},
        "workdir": "/out",
    }
    script = render(
        tmp_path, make_task(executors=[executor, {"image": "alpine", "command": ["x"]}])
    )
    bash_syntax_ok(script, tmp_path)
    first = script[script.index("executor_0() {") : script.index("executor_1() {")]
    assert "    --no-home --home '/out/cwl dir' \\\n" in first
    assert first.index("--home") < first.index("/cache/alpine.sif")
    assert "APPTAINERENV_A=1" in first and "ENV_HOME" not in first
    second = script[script.index("executor_1() {") :]
    assert "--home" not in second


@pytest.mark.parametrize("home", ["relative", "", "/a:/b", "/a\nb"])
def test_env_home_the_runtime_cannot_take_is_refused(tmp_path: Path, home: str) -> None:
    executor = {"image": "alpine", "command": ["env"], "env": {"HOME": home}}
    with pytest.raises(RenderError, match=r"executors\[0\]\.env: .*HOME"):
        render(tmp_path, make_task(executors=[executor]))


def test_executors_get_the_configured_umask_and_the_job_keeps_its_own(tmp_path: Path) -> None:
    executors = [
        {"image": "alpine", "command": ["a"]},
        {"image": "alpine", "command": ["b"], "stdout": "/out/log"},
    ]
    script = render(tmp_path, make_task(executors=executors), container={"umask": "0002"})
    bash_syntax_ok(script, tmp_path)
    assert script.count("umask 077\n") == 1
    for index in (0, 1):
        body = script[script.index(f"executor_{index}() {{") :]
        body = body[: body.index("\n}\n")]
        assert "umask 0002" in body
    assert "umask 022" not in script


# --------------------------------------------------------------------------- files and templates


def test_prepare_task_dir_writes_private_files(tmp_path: Path) -> None:
    config = make_config(tmp_path, storage={"allowed_dirs": [str(tmp_path)]})
    task = make_task(outputs=[{"path": "/outputs/x", "url": "file:///o"}])
    script = prepare_task_dir(task, config=config, image_paths=IMAGES)
    task_dir = config.work_dir / "task-1"
    assert script == task_dir / "job.sh"
    assert stat.S_IMODE(task_dir.stat().st_mode) == 0o700
    assert json.loads((task_dir / "task.json").read_text()) == task
    settings = json.loads((task_dir / "job-config.json").read_text())
    assert settings["allowed_dirs"] == [str(tmp_path)]
    assert settings["mkdirs"] == ["/outputs"]
    assert settings["images"] == ["/cache/alpine.sif"]
    assert settings["missing_outputs"] == "ignore"
    assert os.access(script, os.X_OK)
    config = make_config(tmp_path / "b", storage={"missing_outputs": "fail"})
    prepare_task_dir(task, config=config, image_paths=IMAGES)
    settings = json.loads((config.work_dir / "task-1" / "job-config.json").read_text())
    assert settings["missing_outputs"] == "fail"


def test_render_error_leaves_no_task_directory(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    task = make_task(resources={"backend_parameters": {"qos": "x y"}})
    with pytest.raises(RenderError):
        prepare_task_dir(task, config=config, image_paths=IMAGES)
    assert not (config.work_dir / "task-1").exists()


def test_site_template_directory_is_searched_first(tmp_path: Path) -> None:
    site = tmp_path / "site-templates"
    site.mkdir()
    (site / "job.sh.j2").write_text("#!/bin/bash\n# site {{ directives | length }}\n")
    script = render(tmp_path, make_task(), job={"template_dir": str(site)})
    assert script == "#!/bin/bash\n# site 4\n"


def test_template_variables_must_exist(tmp_path: Path) -> None:
    import jinja2

    site = tmp_path / "site-templates"
    site.mkdir()
    (site / "job.sh.j2").write_text("{{ no_such_value }}\n")
    with pytest.raises(jinja2.UndefinedError):
        render(tmp_path, make_task(), job={"template_dir": str(site)})


def test_executors_drop_privileges_and_get_their_own_pid_namespace(tmp_path: Path) -> None:
    script = render(tmp_path, make_task())
    call = script[script.index("executor_0() {") :]
    assert "--no-privs --pid" in call
    assert call.index("--no-privs") < call.index("/cache/alpine.sif")


@pytest.mark.parametrize(
    ("fields", "bound"),
    [
        ({}, ["/tmp", "/var/tmp"]),
        ({"volumes": ["/tmp"]}, ["/var/tmp"]),
        ({"volumes": ["/var"]}, ["/tmp"]),
        ({"volumes": ["/data/tmp"]}, ["/tmp", "/var/tmp"]),
        # An output's directory is mounted read-write: here /var/tmp itself.
        ({"outputs": [{"path": "/var/tmp/o.txt", "url": "file:///d/o.txt"}]}, ["/tmp"]),
        # Below them: mounted on top of the scratch bind.
        ({"inputs": [{"path": "/tmp/in.txt", "content": "x"}]}, ["/tmp", "/var/tmp"]),
        (
            {"outputs": [{"path": "/var/tmp/o/o.txt", "url": "file:///d/o.txt"}]},
            ["/tmp", "/var/tmp"],
        ),
    ],
)
def test_tmp_and_var_tmp_come_from_the_scratch_directory_unless_the_task_mounts_at_or_above(
    tmp_path: Path, fields: dict[str, Any], bound: list[str]
) -> None:
    script = render(tmp_path, make_task(**fields))
    call = script[script.index("executor_0() {") :]
    for target, sub in (("/tmp", "tmp"), ("/var/tmp", "var-tmp")):
        flag = f'--bind "$EXEC_TMP/{sub}:{target}"'
        assert (flag in call) == (target in bound), (target, call)
    bash_syntax_ok(script, tmp_path)


def test_scratch_dir_setting(tmp_path: Path) -> None:
    script = render(tmp_path, make_task(), job={"scratch_dir": "/local/disk"})
    assert "SCRATCH=/local/disk\n" in script
    default = render(tmp_path, make_task())
    assert 'SCRATCH="${TMPDIR:-$TASK_DIR/tmp}"' in default
    assert default.index("SCRATCH=") < default.index('export TMPDIR="$TASK_DIR/tmp"')
    with pytest.raises(Exception, match="scratch_dir"):
        make_config(tmp_path, job={"scratch_dir": "/a:b"})


def _run_make_exec_tmp(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run the script's own make_exec_tmp in bash (as the script calls it: in an `if`), in a
    scratch directory of tmp_path."""
    names = ("make_exec_tmp", "no_mount_point")
    starts = [script.index(f"\n{name}() {{") + 1 for name in names]
    functions = [script[start : script.index("\n}\n", start) + 3] for start in starts]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    call = 'if make_exec_tmp; then echo "$EXEC_TMP"; else exit 1; fi'
    return subprocess.run(
        ["bash", "-euc", "\n".join([*functions, 'system_log() { echo "$*" >&2; }', call])],
        env={"PATH": os.environ["PATH"], "SCRATCH": str(scratch), "JOB_ID": "7"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )


def _make_exec_tmp(script: str, tmp_path: Path) -> Path:
    result = _run_make_exec_tmp(script, tmp_path)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else "file" for p in sorted(root.rglob("*"))
    }


def test_task_binds_under_tmp_go_on_top_of_the_disk_backed_scratch(tmp_path: Path) -> None:
    """An input, an output, a stdout and a volume under /tmp or /var/tmp: /tmp and /var/tmp
    still come from the scratch directory, the task's binds are mounted over it, each on a
    mount point the job makes there (an empty file for a FILE input)."""
    task = make_task(
        executors=[{"image": "alpine", "command": ["true"], "stdout": "/tmp/log/out.txt"}],
        inputs=[
            {"path": "/tmp/in/data.txt", "content": "x"},
            {"path": "/tmp/in/ref", "url": "file:///d/ref", "type": "DIRECTORY"},
        ],
        outputs=[{"path": "/tmp/out", "url": "file:///d/out", "type": "DIRECTORY"}],
        volumes=["/var/tmp/vol"],
    )
    plan = binds_of(tmp_path, task)
    assert plan.scratch_targets == ["/tmp", "/var/tmp"]
    # Parents before children (by depth), as every bind.
    assert [b.container for b in plan.after_scratch] == [
        "/tmp/log", "/tmp/out", "/tmp/in/data.txt", "/tmp/in/ref", "/var/tmp/vol",
    ]  # fmt: skip
    assert [(b.readonly, b.file) for b in plan.after_scratch] == [
        (False, False), (False, False), (True, True), (True, False), (False, False),
    ]  # fmt: skip
    assert not any(b.container.startswith(("/tmp", "/var/tmp")) for b in plan.binds)
    assert plan.scratch_mountpoints == ["tmp/in", "tmp/in/ref", "tmp/log", "tmp/out", "var-tmp/vol"]
    assert plan.scratch_mountfiles == ["tmp/in/data.txt"]
    script = render(tmp_path, task)
    bash_syntax_ok(script, tmp_path)
    call = script[script.index("executor_0() {") :].splitlines()
    # The scratch binds first, then what goes on top of them, parents before children.
    scratch = call.index('    --bind "$EXEC_TMP/tmp:/tmp" \\')
    assert call[scratch + 1] == '    --bind "$EXEC_TMP/var-tmp:/var/tmp" \\'
    root = tmp_path / "state" / "work" / "task-1" / "root"
    on_top = [
        f"--bind {root}/tmp/log:/tmp/log",
        f"--bind {root}/tmp/out:/tmp/out",
        f"--bind {root}/tmp/in/data.txt:/tmp/in/data.txt:ro",
        f"--bind {root}/tmp/in/ref:/tmp/in/ref:ro",
        f"--bind {root}/var/tmp/vol:/var/tmp/vol",
    ]
    assert [line.strip(" \\") for line in call[scratch + 2 : scratch + 7]] == on_top
    exec_tmp = _make_exec_tmp(script, tmp_path)
    assert _tree(exec_tmp) == {
        "tmp": "dir", "tmp/in": "dir", "tmp/in/data.txt": "file", "tmp/in/ref": "dir",
        "tmp/log": "dir", "tmp/out": "dir", "var-tmp": "dir", "var-tmp/vol": "dir",
    }  # fmt: skip
    assert (exec_tmp / "tmp/in/data.txt").stat().st_size == 0


@pytest.mark.parametrize(
    "name",
    [
        "a b",
        "$(touch pwned)",
        "`touch pwned`",
        "'; touch pwned; '",
        '"quoted"',
        "-rf",
        "x\ny",
        "c:d,e",
        "*",
        "~",
        "ünïcödé",
    ],
)
def test_hostile_paths_under_tmp_are_only_mount_points(tmp_path: Path, name: str) -> None:
    """Whatever a task's path under /tmp holds, the job makes that mount point and nothing else,
    and the runtime gets it as one argument (with --mount where `:` or `,` would split it)."""
    task = make_task(
        inputs=[{"path": f"/tmp/{name}/in.txt", "content": "x"}],
        volumes=[f"/var/tmp/{name}"],
    )
    plan = binds_of(tmp_path, task)
    assert plan.scratch_targets == ["/tmp", "/var/tmp"]
    assert plan.scratch_mountpoints == [f"tmp/{name}", f"var-tmp/{name}"]
    assert plan.scratch_mountfiles == [f"tmp/{name}/in.txt"]
    script = render(tmp_path, task)
    bash_syntax_ok(script, tmp_path)
    exec_tmp = _make_exec_tmp(script, tmp_path)
    assert _tree(exec_tmp) == {
        "tmp": "dir", f"tmp/{name}": "dir", f"tmp/{name}/in.txt": "file",
        "var-tmp": "dir", f"var-tmp/{name}": "dir",
    }  # fmt: skip
    assert not list(tmp_path.rglob("pwned"))
    if any(ch in name for ch in ":,\n"):
        assert "--mount" in script


def test_a_mount_point_that_cannot_be_made_fails_the_attempt_with_a_reason(tmp_path: Path) -> None:
    """A name longer than the filesystem takes (255 bytes): the job says so and runs nothing,
    even when the mount points after it can be made."""
    task = make_task(volumes=["/tmp/" + "x" * 300, "/tmp/y"])
    result = _run_make_exec_tmp(render(tmp_path, task), tmp_path)
    assert result.returncode == 1
    assert "cannot make a mount point under /tmp" in result.stderr


# --------------------------------------------------------------------------- the job side's cost

FAKE_PYTHON = """#!/bin/sh
# Stands in for job.python: a task with nothing to stage must not start it.
echo "$@" >> "$FAKE_PYTHON_LOG"
exit 99
"""


def _run_without_python(
    tmp_path: Path, task: dict[str, Any], **container: Any
) -> tuple[subprocess.CompletedProcess[str], Path, Path, Path]:
    """Run `task`'s job script with a fake runtime and a job.python that fails if started;
    returns the result, the runtime's log, the python's log and the task directory."""
    runtime = tmp_path / "fake-apptainer"
    runtime.write_text(FAKE_RUNTIME.format(python=sys.executable) + 'print("ran", sys.argv[-1])\n')
    runtime.chmod(0o755)
    python = tmp_path / "fake-python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    config = make_config(
        tmp_path, container={"runtime": str(runtime), **container}, job={"python": str(python)}
    )
    image = tmp_path / "alpine.sif"
    image.write_text("not really an image")
    script = prepare_task_dir(task, config=config, image_paths={"alpine": str(image)})
    logs = tmp_path / "runtime.log", tmp_path / "python.log"
    env = dict(os.environ, SLURM_JOB_ID="7", FAKE_LOG=str(logs[0]), FAKE_PYTHON_LOG=str(logs[1]))
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    return result, *logs, script.parent


def test_a_task_with_nothing_to_stage_runs_without_starting_python(tmp_path: Path) -> None:
    task = make_task(
        volumes=[f"/vol/{HOSTILE.replace('/', '_')}", "/vol/a,b:c"],
        executors=[
            {
                "image": "alpine",
                "command": ["printf", "%s", HOSTILE, "$(id)"],
                "env": {"H": HOSTILE},
            },
            {"image": "alpine", "command": ["true", "second"], "stdout": "/dev/null"},
        ],
    )
    result, runtime_log, python_log, task_dir = _run_without_python(tmp_path, task, allow_root=True)
    assert result.returncode == 0, result.stderr
    assert not python_log.exists(), python_log.read_text()
    calls = [json.loads(line) for line in runtime_log.read_text().splitlines()]
    assert [call["argv"][-4:] for call in calls[:1]] == [["printf", "%s", HOSTILE, "$(id)"]]
    assert calls[1]["argv"][-2:] == ["true", "second"]
    assert not Path("/tmp/pwned-h2").exists()
    records = task_dir / "records" / "7"
    assert (records / "outcome").read_text() == "complete\n"
    assert (records / "executors" / "0" / "exit_code").read_text() == "0\n"
    assert (records / "executors" / "0" / "stdout").read_text().startswith("ran ")
    assert not (records / "executors" / "1" / "stdout").exists()  # discarded
    # The volumes' host directories were made under root/, as stage-in makes them.
    assert (task_dir / "root" / "vol" / HOSTILE.replace("/", "_")).is_dir()
    assert (task_dir / "root" / "vol" / "a,b:c").is_dir()


def test_executors_refuse_root_without_python_too(tmp_path: Path) -> None:
    # The suite runs as root (as CI does): the job script below runs as root.
    _, runtime_log, python_log, task_dir = _run_without_python(tmp_path, make_task())
    assert not runtime_log.exists() and not python_log.exists()
    records = task_dir / "records" / "7"
    assert (records / "executors" / "0" / "exit_code").read_text() == "125\n"
    assert (records / "outcome").read_text() == "executor_error\n"
    assert "executor 0: refusing to run as root" in (records / "system_logs.jsonl").read_text()


@pytest.mark.parametrize(
    ("fields", "wrapped", "stage_in", "stage_out"),
    [
        ({}, False, False, False),
        ({"stdout": "/dev/null", "stderr": "/dev/null"}, False, False, False),
        ({"stdout": "/out/log"}, True, False, False),
        ({"stdin": "/in/data"}, True, False, False),
    ],
)
def test_python_starts_only_for_what_needs_it(
    tmp_path: Path, fields: dict[str, str], wrapped: bool, stage_in: bool, stage_out: bool
) -> None:
    executor = {"image": "alpine", "command": ["true"], **fields}
    script = render(tmp_path, make_task(executors=[executor]))
    assert ("-m bridge.job exec" in script) == wrapped
    assert ("-m bridge.job stage-in" in script) == stage_in
    assert ("-m bridge.job stage-out" in script) == stage_out
    with_outputs = make_task(outputs=[{"path": "/out/x", "url": "file:///data/x"}])
    script = render(tmp_path, with_outputs)
    assert "-m bridge.job stage-in" in script and "-m bridge.job stage-out" in script
    with_inputs = make_task(inputs=[{"path": "/in/x", "content": "x"}])
    script = render(tmp_path, with_inputs)
    assert "-m bridge.job stage-in" in script and "-m bridge.job stage-out" not in script
