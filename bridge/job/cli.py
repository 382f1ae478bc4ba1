"""Command line of the job side: `python -m bridge.job stage-in|stage-out|exec ...`.

The lead mounts the same subcommands under `tes-bridge job` with `add_subcommands`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from bridge.core.argparsing import no_abbreviations


def _stage_in(args: argparse.Namespace) -> int:
    from bridge.job.stage import stage_in

    return stage_in(args.task_dir, args.records)


def _stage_out(args: argparse.Namespace) -> int:
    from bridge.job.stage import stage_out

    return stage_out(args.task_dir, args.records)


def _exec(args: argparse.Namespace) -> int:
    from bridge.job.execute import run_executor

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("exec: no command given after --", file=sys.stderr)
        return 2
    return run_executor(args.task_dir, args.records, args.index, command)


def _common(parser: argparse.ArgumentParser) -> None:
    from bridge.job.owner import Once

    parser.add_argument(
        "--task-dir", type=Path, required=True, action=Once, help="the task directory"
    )
    parser.add_argument(
        "--records", type=Path, required=True, action=Once, help="this job's records directory"
    )


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add stage-in, stage-out and exec to an existing subparsers object."""
    stage_in = subparsers.add_parser("stage-in", help="stage the task's inputs into root/")
    _common(stage_in)
    stage_in.set_defaults(job_func=_stage_in)

    stage_out = subparsers.add_parser("stage-out", help="upload the task's outputs")
    _common(stage_out)
    stage_out.set_defaults(job_func=_stage_out)

    from bridge.job.owner import Once

    run = subparsers.add_parser(
        "exec", help="(used by job.sh) run one executor's runtime call with safe stdio"
    )
    _common(run)
    run.add_argument("--index", type=int, required=True, action=Once, help="the executor's index")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- runtime argv...")
    run.set_defaults(job_func=_exec)

    from bridge.job import owner

    owner.add_subcommands(subparsers)


def build_parser(prog: str = "python -m bridge.job") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Compute-node side of a tes-slurm-bridge task."
    )
    add_subcommands(parser.add_subparsers(dest="job_command", required=True))
    return no_abbreviations(parser)


def run(args: argparse.Namespace) -> int:
    """Run parsed arguments (for a parser built with add_subcommands)."""
    return int(args.job_func(args))


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
