"""What HPC sites ask of a task's job: time limits, fractional CPUs and GPUs, as sbatch options
and runtime flags, with hostile values refused naming the field."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bridge.config import ConfigError, load_config
from bridge.core import backend_params
from bridge.job.layout import TaskLayout
from bridge.jobscript.directives import sbatch_directives
from bridge.jobscript.task import RenderError
from tests.unit.test_render import bash_syntax_ok, directives, make_config, make_task, render


def params(**values: str) -> dict[str, Any]:
    return {"backend_parameters": values}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 5400),
        ("5:30", 330),
        ("1:30:00", 5400),
        ("2-0", 172800),
        ("2-03:04", 183840),
        ("2-03:04:05", 183845),
        ("0:00:05", 5),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_slurm_time_formats(text: str, seconds: int | None) -> None:
    assert backend_params.parse_time(text) == seconds


@pytest.mark.parametrize(
    "value",
    ["10\n", "soon", "1:2:3:4", "-5", "1-", "1-2-3", "1:60x", "", " 10", "10 --uid=0",
     "1:00:00\n#SBATCH --uid=0", "$(id)", "1" * 12],
)  # fmt: skip
@pytest.mark.parametrize("key", ["time", "time_limit"])
def test_hostile_time_is_refused_naming_the_key(tmp_path: Path, key: str, value: str) -> None:
    with pytest.raises(RenderError, match=rf"resources\.backend_parameters\.{key}"):
        render(tmp_path, make_task(resources=params(**{key: value})))


@pytest.mark.parametrize("value", ["0", "-1", "1e3", "1.5h", "nan", "inf", "1\n", "", "."])
def test_hostile_max_time_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(RenderError, match=r"resources\.backend_parameters\.max_time"):
        render(tmp_path, make_task(resources=params(max_time=value)))


def test_time_and_max_time_become_time_the_tighter_winning(tmp_path: Path) -> None:
    found = directives(render(tmp_path, make_task(resources=params(time="0:00:05"))))
    assert "--time=0:00:05" in found
    found = directives(render(tmp_path, make_task(resources=params(max_time="1.5"))))
    assert "--time=0-01:30:00" in found
    found = directives(render(tmp_path, make_task(resources=params(max_time="0.0001"))))
    assert "--time=0-00:00:01" in found  # hours rounded up to a second
    both = params(time="2:00:00", max_time="1")
    assert "--time=0-01:00:00" in directives(render(tmp_path, make_task(resources=both)))
    both = params(TIME="30", max_time="1")
    assert "--time=30" in directives(render(tmp_path, make_task(resources=both)))


def test_default_and_maximum_time_from_the_config(tmp_path: Path) -> None:
    slurm = {"default_time": "4:00:00", "max_time": "1-00:00:00"}
    found = directives(render(tmp_path, make_task(), slurm=slurm))
    assert [d for d in found if d.startswith("--time")] == ["--time=4:00:00"]
    found = directives(render(tmp_path, make_task(), slurm={"max_time": "1-00:00:00"}))
    assert "--time=1-00:00:00" in found
    task = make_task(resources=params(time="1-00:00:01"))
    with pytest.raises(RenderError, match=r"backend_parameters\.time: .*at most 1-00:00:00"):
        render(tmp_path, task, slurm=slurm)
    with pytest.raises(RenderError, match=r"backend_parameters\.time: .*slurm\.max_time"):
        render(tmp_path, make_task(resources=params(time="UNLIMITED")), slurm=slurm)
    found = directives(
        render(tmp_path, make_task(resources=params(time="1-00:00:00")), slurm=slurm)
    )
    assert "--time=1-00:00:00" in found


def test_time_config_is_checked(tmp_path: Path) -> None:
    env = {"TES_BRIDGE_STATE_DIR": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"slurm\.default_time"):
        load_config(environ=env, overrides={"slurm.default_time": "tomorrow"})
    with pytest.raises(ConfigError, match="above max_time"):
        load_config(
            environ=env, overrides={"slurm.default_time": "2:00:00", "slurm.max_time": "60"}
        )
    old = load_config(environ=env, overrides={"slurm.default_time_limit": "2:00:00"})
    assert old.slurm.default_time == "2:00:00"


@pytest.mark.parametrize(("cores", "asked"), [(0.5, 1), (1.01, 2), (2, 2), (0.001, 1)])
def test_fractional_cpu_cores_are_rounded_up(tmp_path: Path, cores: float, asked: int) -> None:
    found = directives(render(tmp_path, make_task(resources={"cpu_cores": cores})))
    assert f"--cpus-per-task={asked}" in found


def test_fractional_ram_is_rounded_up_to_a_megabyte(tmp_path: Path) -> None:
    found = directives(render(tmp_path, make_task(resources={"ram_gb": 0.0001})))
    assert "--mem=1" in found
    found = directives(render(tmp_path, make_task(resources={"ram_gb": 1.0001})))
    assert "--mem=1025" in found


@pytest.mark.parametrize(
    ("values", "option"),
    [
        ({"gpus": "2"}, "--gpus=2"),
        ({"gpus": "a100:2"}, "--gpus=a100:2"),
        ({"gpus_per_task": "1"}, "--gpus-per-task=1"),
        ({"gpus_per_task": "h100:1"}, "--gpus-per-task=h100:1"),
        ({"gres": "gpu:a100:2"}, "--gres=gpu:a100:2"),
    ],
)
def test_gpu_requests_become_options_and_the_gpu_flag(
    tmp_path: Path, values: dict[str, str], option: str
) -> None:
    script = render(tmp_path, make_task(resources=params(**values)))
    assert option in directives(script)
    # sbatch refuses --gpus-per-task without a task count.
    assert ("--ntasks=1" in directives(script)) == ("gpus_per_task" in values)
    assert "    --nv \\" in script.splitlines()
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "SLURM_JOB_GPUS"):
        assert f'export APPTAINERENV_{name}="${{{name}}}"' in script
    assert "  pass_gpu_environment" in script.splitlines()
    bash_syntax_ok(script, tmp_path)


def test_rocm_and_singularity(tmp_path: Path) -> None:
    container = {"gpu_flag": "--rocm", "runtime": "singularity"}
    script = render(tmp_path, make_task(resources=params(gpus="1")), container=container)
    assert "    --rocm \\" in script.splitlines() and "--nv" not in script
    assert 'export SINGULARITYENV_ROCR_VISIBLE_DEVICES="${ROCR_VISIBLE_DEVICES}"' in script


def test_no_gpu_no_flag(tmp_path: Path) -> None:
    script = render(tmp_path, make_task(resources=params(gres="shard:2")))
    assert "--nv" not in script and "VISIBLE_DEVICES" not in script


@pytest.mark.parametrize(
    ("key", "value"),
    [("gpus", "0"), ("gpus", "a100:0"), ("gpus", "a100:2:3"), ("gpus", "2 --uid=0"),
     ("gpus", "$(id):1"), ("gpus", "99999"), ("gpus_per_task", "1\n#SBATCH --uid=0"),
     ("gpus_per_task", "-1"), ("gres", "gpu:1 --wrap=id"), ("gres", "gpu;id")],
)  # fmt: skip
def test_hostile_gpu_values_are_refused_naming_the_key(
    tmp_path: Path, key: str, value: str
) -> None:
    with pytest.raises(RenderError, match=rf"resources\.backend_parameters\.{key}"):
        render(tmp_path, make_task(resources=params(**{key: value})))


def test_gpu_variables_reach_the_runtime_only_when_slurm_set_them(tmp_path: Path) -> None:
    script = render(tmp_path, make_task(resources=params(gpus="2")))
    function = re.search(r"^pass_gpu_environment\(\) \{\n.*?^\}\n", script, re.M | re.S)
    assert function is not None
    shell = function.group(0) + "pass_gpu_environment\nenv | grep ^APPTAINERENV_ | sort\n"
    env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_GPUS": "2,3"}
    out = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True).stdout
    assert out.split() == [
        "APPTAINERENV_CUDA_VISIBLE_DEVICES=0,1",
        "APPTAINERENV_SLURM_JOB_GPUS=2,3",
    ]


RULES = [
    {"gpu": True, "directives": ["--partition=gpu", "--qos=gpu"], "prologue": "module load cuda"},
    {"partition": ["debug"], "directives": ["--time=30"]},
    {"owner_group": ["root"], "directives": ["--comment=admins"]},
]


def prologue_of(script: str) -> str:
    return script.split("site_prologue() {", 1)[1].split("}", 1)[0]


def test_site_rules_first_match_wins(tmp_path: Path) -> None:
    slurm = {"rules": RULES, "default_partition": "main"}
    gpu = render(tmp_path, make_task(resources=params(gpus="1", partition="debug")), slurm=slurm)
    found = directives(gpu)
    # After the task's own options, so they win (sbatch takes the last of a repeated option).
    assert found.index("--partition=gpu") > found.index("--partition=debug")
    assert "--qos=gpu" in found and "--time=30" not in found
    assert "module load cuda" in prologue_of(gpu)
    debug = render(tmp_path, make_task(resources=params(partition="debug")), slurm=slurm)
    assert directives(debug)[-1] == "--time=30" and "cuda" not in debug
    plain = render(tmp_path, make_task(), slurm=slurm)
    assert not {"--time=30", "--qos=gpu", "--comment=admins"} & set(directives(plain))


def test_site_rules_on_the_owners_groups(tmp_path: Path) -> None:
    config = make_config(tmp_path, slurm={"rules": RULES[2:]})
    layout = TaskLayout(config.work_dir / "task-1")
    for owner, expected in (
        ("root", True),
        ("nobody", False),
        ("no-such-user", False),
        (None, False),
    ):
        found = sbatch_directives(make_task(), config=config, layout=layout, owner=owner)
        assert ("--comment=admins" in found) is expected, owner


def test_a_site_rule_directive_on_two_lines_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="several lines"):
        load_config(
            environ={"TES_BRIDGE_STATE_DIR": str(tmp_path)},
            overrides={"slurm.rules": [{"directives": ["--x\n#SBATCH --uid=0"]}]},
        )


def test_the_rule_that_sets_the_partition_also_gives_the_prologue(tmp_path: Path) -> None:
    # The first rule does not match the task as it asks (no partition); the second one sends it
    # to `gpu`, which must not make the first one match for the prologue.
    rules = [
        {"partition": ["gpu"], "prologue": "echo another rule"},
        {"gpu": True, "directives": ["--partition=gpu"], "prologue": "module load cuda"},
    ]
    script = render(tmp_path, make_task(resources=params(gpus="1")), slurm={"rules": rules})
    assert "module load cuda" in prologue_of(script)
    assert "another rule" not in script
