"""`tes-bridge task`'s command line, parsed: options as Slurm users write them, no abbreviations
(an abbreviation silently picks another option: `--time 5` was `--timeout 5`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from bridge.cli.main import build_parser as build_main_parser
from bridge.client.cli import build_parser, parse, task_from_options


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
