"""The `tes-bridge` command: its parser, and the dispatch to each subcommand's handler.

Each subcommand's parser names its handler with `set_defaults`:

- `run(config, args)`: most commands, given the loaded configuration;
- `run_unconfigured(args)`: `check`, which loads the configuration itself;
- `hand_over(words, args, extra)`: `task` and `job`, which have parsers of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from bridge import __version__
from bridge.cli import check, database, images, serve
from bridge.config import ENV_CONFIG, Config, ConfigError, load_config
from bridge.core.argparsing import no_abbreviations
from bridge.system.logs import setup_logging

#: What a subcommand's parser names with `set_defaults` (see the module's doc).
Run = Callable[[Config, argparse.Namespace], int]
RunUnconfigured = Callable[[argparse.Namespace], int]
HandOver = Callable[[list[str], argparse.Namespace, list[str]], int]

DESCRIPTION = """\
tes-slurm-bridge: a GA4GH Task Execution Service (TES 1.1) server that runs tasks on Slurm
as Apptainer/Singularity containers.

Configuration: a TOML file (--config FILE or TES_BRIDGE_CONFIG; see
deploy/tes-bridge.example.toml), overridden by TES_BRIDGE_DATABASE (a database URL),
TES_BRIDGE_STATE_DIR and TES_BRIDGE_WORK_DIR.

The poller (poller, or serve without --no-poller) refuses to run as root (its jobs, and so
executors, would run as root) unless container.allow_root = true; run it as an unprivileged
service account.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tes-bridge",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tes-bridge {__version__}")
    parser.add_argument(
        "--config", metavar="FILE", help=f"TOML configuration file (default: ${ENV_CONFIG})"
    )
    parser.add_argument(
        "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)"
    )
    parser.set_defaults(run=None, run_unconfigured=None, hand_over=None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve.add_parsers(commands)
    database.add_parser(commands)
    commands.add_parser(
        "show-config", help="print the effective configuration as JSON"
    ).set_defaults(run=show_config)
    check.add_parser(commands)
    images.add_parser(commands)

    job = commands.add_parser(
        "job",
        help="job-side commands run inside Slurm jobs (staging); not for interactive use",
        add_help=False,
    )
    job.add_argument("job_args", nargs=argparse.REMAINDER)
    job.set_defaults(hand_over=run_job_side)

    task = commands.add_parser(
        "task",
        help="a client for any TES server: run, submit, resubmit, list, get, cancel, logs, wait "
        "(`tes-bridge task --help`)",
        add_help=False,
    )
    task.add_argument("task_args", nargs=argparse.REMAINDER)
    task.set_defaults(hand_over=run_task_client)
    return no_abbreviations(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    # `job` options (including its --help) belong to the job side's own parser.
    args, extra = parser.parse_known_args(words)
    if args.hand_over is not None:
        hand_over: HandOver = args.hand_over
        return hand_over(words, args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging(args.log_level)
    if args.run_unconfigured is not None:
        run_unconfigured: RunUnconfigured = args.run_unconfigured
        return run_unconfigured(args)
    config = configure(args.config)
    if config is None:
        return 2
    run: Run = args.run
    return run(config, args)


def configure(path: str | None) -> Config | None:
    """The configuration, also for the processes this one starts; None, said on stderr, when
    it does not load."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"tes-bridge: {exc}", file=sys.stderr)
        return None
    if path:
        # Gunicorn workers and the poller process read the same file.
        os.environ[ENV_CONFIG] = os.path.abspath(path)
    return config


def show_config(config: Config, args: argparse.Namespace) -> int:
    print(json.dumps(config.model_dump(mode="json"), indent=2))
    return 0


def run_task_client(words: list[str], args: argparse.Namespace, extra: list[str]) -> int:
    """The client has its own parser (given the words as typed) and needs no configuration."""
    from bridge.client.cli import main as task_main

    return task_main(words[words.index("task") + 1 :])


def run_job_side(words: list[str], args: argparse.Namespace, extra: list[str]) -> int:
    """The job side has its own parser and must not need the login node's configuration."""
    from bridge.job.cli import main as job_main

    return job_main([*extra, *args.job_args])
