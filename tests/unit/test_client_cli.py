"""`tes-bridge task`'s command line, parsed: options as Slurm users write them, no abbreviations
(an abbreviation silently picks another option: `--time 5` was `--timeout 5`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from bridge.cli.main import build_parser as build_main_parser
from bridge.client.cli import build_parser, parse, task_from_options
from bridge.client.documents import RESUBMIT_TAG, resubmitted


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


@pytest.mark.parametrize("build", [build_parser, build_main_parser])
def test_no_parser_accepts_abbreviations(build):
    parsers = _parsers(build())
    assert len(parsers) > 5
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_time_is_the_slurm_time_limit_not_an_abbreviation_of_timeout(capsys):
    for option in ("--time", "-t"):
        args = parse(["run", option, "5", "alpine", "--", "true"])
        assert args.timeout is None
        assert task_from_options(args)["resources"] == {"backend_parameters": {"time": "5"}}
    with pytest.raises(SystemExit) as exit_info:
        parse(["run", "--tim", "5", "alpine", "--", "true"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --tim" in capsys.readouterr().err


def test_run_puts_slurm_options_in_backend_parameters():
    args = parse(
        ["run", "-t", "1:00:00", "-p", "short", "--gpus", "a100:2", "--backend-parameter",
         "qos=long", "--backend-parameter", "partition=other", "--tag", "k=v",
         "alpine", "--", "true"]
    )  # fmt: skip
    task = task_from_options(args)
    assert task["resources"]["backend_parameters"] == {
        "time": "1:00:00", "partition": "short", "gpus": "a100:2", "qos": "long"
    }  # fmt: skip
    assert task["tags"] == {"k": "v"}


def test_relative_local_paths_become_absolute_file_urls(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse(
        ["run", "--input", "./in.txt=/data/in.txt", "--input", "s3://b/k=/data/k",
         "--input", "/abs/x=/data/x", "--output", "/data/out.txt=results/out.txt",
         "alpine", "--", "true"]
    )  # fmt: skip
    task = task_from_options(args)
    assert [i["url"] for i in task["inputs"]] == [
        f"file://{os.path.join(tmp_path, 'in.txt')}", "s3://b/k", "/abs/x"
    ]  # fmt: skip
    assert task["outputs"][0]["url"] == f"file://{tmp_path}/results/out.txt"


def test_sbatch_spellings_and_sizes_with_units(capsys):
    def resources(*options: str) -> dict:
        return task_from_options(parse(["run", *options, "alpine", "--", "true"]))["resources"]

    for cpus in (["--cpus", "4"], ["-c", "4"], ["--cpus-per-task", "4"]):
        assert resources(*cpus) == {"cpu_cores": 4}
    # --ram is GB; --mem as sbatch takes it: MB unless it says its unit. 1G is 1024M.
    for option, value, gigabytes in [
        ("--ram", "4", 4.0), ("--ram", "1.5", 1.5), ("--ram", "4G", 4.0), ("--ram", "512m", 0.5),
        ("--ram", "2GiB", 2.0), ("--ram", "1T", 1024.0), ("--mem", "4000", 4000 / 1024),
        ("--mem", "4G", 4.0), ("--mem", "4096M", 4.0), ("--mem", "1048576K", 1.0),
    ]:  # fmt: skip
        assert resources(option, value) == {"ram_gb": gigabytes}, (option, value)
    assert resources("--tmp", "10G", "--disk", "2") == {"disk_gb": 2.0}  # the last one wins
    with pytest.raises(SystemExit):
        parse(["run", "--ram", "4 GB please", "alpine", "--", "true"])
    assert "expected a size: a number (GB) or a number with a unit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["resubmit", "x", "--mme", "4"], "did you mean --mem (for --mme)?"),
        (["run", "--qos=long", "alpine", "--", "true"],
         "did you mean --backend-parameter qos=QOS (for --qos=long)?"),
        (["run", "-A", "lab", "alpine", "--", "true"],
         "did you mean --backend-parameter account=NAME (for -A)?"),
        (["run", "-J", "n", "alpine", "--", "true"], "did you mean --name (for -J)?"),
        (["list", "--stat", "running"], "did you mean --state (for --stat)?"),
        (["wait", "--interal", "1", "x"], "did you mean --interval (for --interal)?"),
        (["get", "--zzzzzz", "x"], "unrecognized arguments: --zzzzzz\n"),
    ],
)  # fmt: skip
def test_an_option_a_command_lacks_is_named_by_that_command_with_what_was_meant(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # The command's own usage and name, not the top level's (which has no options to show).
    assert err.startswith(f"usage: tes-bridge task {argv[0]} ")
    assert f"tes-bridge task {argv[0]}: error: unrecognized arguments: " in err
    assert said in err


def test_resubmit_takes_the_resource_and_slurm_options_of_run():
    args = parse(
        ["resubmit", "3f2a", "-t", "2:00:00", "--ram", "8", "--cpus", "4", "-p", "long",
         "--gpus", "a100:1", "--backend-parameter", "qos=high", "--name", "again", "--wait"]
    )  # fmt: skip
    assert (args.id, args.time, args.ram, args.cpus, args.partition) == (
        "3f2a", "2:00:00", 8.0, 4, "long"
    )  # fmt: skip
    assert args.gpus == "a100:1" and args.backend_parameter == [("qos", "high")]
    assert args.name == "again" and args.wait


def test_a_resubmitted_copy_keeps_the_task_but_what_changes_and_links_to_it():
    original = {
        "id": "3f2a", "state": "EXECUTOR_ERROR", "creation_time": "2026-11-25T10:00:00Z",
        "logs": [{"logs": []}], "name": "align", "tags": {"project": "x"},
        "executors": [{"image": "tool", "command": ["align"]}],
        "resources": {
            "cpu_cores": 2, "ram_gb": 4, "zones": ["short"],
            "backend_parameters": {"Time_Limit": "30", "max_time": "0.5", "QOS": "normal",
                                   "account": "lab"},
        },
    }  # fmt: skip
    changes = {"cpu_cores": 4, "backend_parameters": {"time": "2:00:00", "partition": "long",
                                                      "qos": "high"}}  # fmt: skip
    assert resubmitted(original, changes) == {
        "name": "align",
        "tags": {"project": "x", RESUBMIT_TAG: "3f2a"},
        "executors": [{"image": "tool", "command": ["align"]}],
        "resources": {
            "cpu_cores": 4, "ram_gb": 4,
            # Every other way of saying a time limit goes (the tightest would win); the
            # partition replaces the zones.
            "backend_parameters": {"account": "lab", "time": "2:00:00", "partition": "long",
                                   "qos": "high"},
        },
    }  # fmt: skip
    unchanged = resubmitted({**original, "tags": {RESUBMIT_TAG: "older"}}, {})
    assert unchanged["resources"] == original["resources"]
    assert unchanged["tags"] == {RESUBMIT_TAG: "3f2a"}  # the task it copies, not the first


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (["echo", "hello"], "echo"),
        (["/opt/tools/bin/align", "-t", "4"], "align"),
        (["python3", "/work/train.py", "--epochs", "3"], "train.py"),
        (["bash", "-c", "echo hi"], "bash"),
        (["Rscript", "plot.R"], "plot.R"),
    ],
)
def test_run_names_a_task_after_its_command_unless_told(command, name):
    args = parse(["run", "alpine", "--", *command])
    assert task_from_options(args)["name"] == name
    told = parse(["run", "--name", "mine", "alpine", "--", *command])
    assert task_from_options(told)["name"] == "mine"


def test_the_url_a_relative_path_became_is_said(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    task_from_options(parse(["run", "--input", "in.txt=/in.txt", "alpine", "--", "true"]))
    assert capsys.readouterr().err == (
        f"tes-bridge task: --input in.txt is file://{tmp_path}/in.txt\n"
    )


def test_failed_stands_for_the_three_states_of_a_task_that_failed():
    args = parse(["list", "--state", "failed,Canceled"])
    assert args.state == [["EXECUTOR_ERROR", "SYSTEM_ERROR", "PREEMPTED", "CANCELED"]]
