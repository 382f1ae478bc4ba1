"""`tes-bridge task ...`: the commands, their options and their output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import requests
import yaml

from bridge.client.api import FINAL_STATES, TesClient, TesError
from bridge.client.documents import command_name, resubmitted
from bridge.client.listing import matching_tasks, since_option, states_option, table
from bridge.client.options import size_option, unrecognized
from bridge.client.watch import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    follow_logs,
    outcome,
    print_logs,
    wait_for,
)

VIEWS = ("MINIMAL", "BASIC", "FULL")
DEFAULT_URL = "http://127.0.0.1:8000"
#: The actions that can wait for tasks, and so exit with their outcome.
WAITING = ("run", "submit", "resubmit", "logs")

DESCRIPTION = f"""\
A client for any GA4GH TES 1.1 server (this bridge, Funnel, ...): create, list, inspect, cancel
and wait for tasks, and read their output.

The server: --url or TES_URL (default {DEFAULT_URL}); /ga4gh/tes/v1 is added
unless the URL already ends in a TES base path (/ga4gh/tes/v1 or /v1). Authentication:
--token or TES_TOKEN (a bearer token), or --user or TES_USER with the password in
TES_PASSWORD or in ~/.netrc ($NETRC); with neither, a ~/.netrc entry for the host is used
if there is one.

example:
  export TES_URL=http://127.0.0.1:8000
  id=$(tes-bridge task run alpine -- echo hello)
  tes-bridge task wait "$id" && tes-bridge task logs "$id"
"""

COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "create a task from the command line; prints its id",
        """\
Create a task with one executor: IMAGE runs CMD ARGS... (put them after --). Prints the
task's id; with --wait, then waits for it like `wait` and exits with its outcome. Without
--name, the task is named after its command, as sbatch names a job after its script (echo,
or train.py for python3 train.py).

--input URL=PATH stages URL into the container at PATH before the executor runs; --output
PATH=URL uploads PATH afterwards. A PATH that ends in / is a DIRECTORY. A relative local path
(./in.txt) is sent as the file:// URL of its absolute path, said on stderr.

sbatch's spellings work too: -c and --cpus-per-task for --cpus, --mem (MB unless a unit is
given: 4000, 4G) for --ram (GB: 4, or 4G), --tmp for --disk. Slurm's own options: --time/-t
(a time limit as sbatch takes it), --partition/-p, --gpus and --backend-parameter KEY=VALUE
(any other, e.g. qos=long) go into the task's resources.backend_parameters. Options are never
abbreviated: --time is not --timeout (how long --wait waits).

With --test-only nothing is created: the server (tes-slurm-bridge) asks Slurm with sbatch
--test-only where and when a task of that shape would start, and that is printed (exit
status 1 when Slurm would refuse it).

examples:
  tes-bridge task run alpine -- echo hello
  tes-bridge task run --test-only --cpus 8 --ram 64 -t 1-00:00:00 tool:1 -- run.sh
  tes-bridge task run -t 2:00:00 -p long --gpus a100:1 -c 4 --mem 16G --wait tool:1 -- train.sh
  tes-bridge task run --wait --cpus 2 --ram 4 --tag project=x \\
      --input s3://bucket/reads.fq=/data/reads.fq --output /data/out/=s3://bucket/out/ \\
      quay.io/biocontainers/fastqc:0.12.1--hdfd78af_0 -- fastqc -o /data/out /data/reads.fq
""",
    ),
    "submit": (
        "create a task from a JSON or YAML document; prints its id",
        """\
Create a task from FILE, a TES task document in JSON or YAML (- reads standard input). The
document is sent as it is, so fields this client does not know about reach the server.
--test-only creates nothing and says where and when Slurm would start it, as for `run`.

examples:
  tes-bridge task submit task.yaml
  echo '{"executors": [{"image": "alpine", "command": ["true"]}]}' | tes-bridge task submit -
""",
    ),
    "list": (
        "list tasks, newest first",
        """\
List tasks as a table or, with --json, as a JSON array. The table shows each task's id,
state, creation time and name, and of its last attempt the Slurm job id, the elapsed time
(as sacct writes it: [D-]HH:MM:SS; for a job still pending, when Slurm expects it to start:
`start 2026-11-29 14:05:00`, UTC), the exit code (the first failing executor's, else the
last one's), the peak memory (sacct's MaxRSS, or the job's cgroup peak where Slurm sampled
none) and why a final task ended so (REASON: exit 42, TIMEOUT, OUT_OF_MEMORY, image, input,
output, canceled by alice...), as far as the server records them (this bridge does). Follows
the server's page tokens to the last page, or until --limit tasks or a task older than
--since.

--state takes several states, comma-separated or repeated, in any case (running,queued).
--since takes a duration back from now (30m, 2h, 1d, 1w) or a date/time in UTC
(2026-11-25T10:00). --watch prints the table again every --interval seconds, like `watch`.

examples:
  tes-bridge task list --state running,queued
  tes-bridge task list --state EXECUTOR_ERROR --state SYSTEM_ERROR --since 1d
  tes-bridge task list --name-prefix align- --tag project=x --tag urgent --limit 20
  tes-bridge task list --watch --state running
  tes-bridge task list --json --view FULL | jq '.[].id'
""",
    ),
    "get": (
        "print a task as JSON",
        """\
Print the task document as the server returns it (FULL by default: with its logs).

example:
  tes-bridge task get 3f2a9c1e-... --view BASIC
""",
    ),
    "resubmit": (
        "post a copy of a task again, with changes; prints the new id",
        """\
Read the task (FULL view) and create a new task from it: the same executors, inputs,
outputs, resources, volumes, tags, name and description, without what the server added (id,
state, creation time, logs), tagged tes-bridge.resubmit_of=ID. The resource and Slurm options
of `run` change the copy: --time/-t replaces the task's time limit (time, time_limit and
max_time), --partition/-p its partition (and zones), --cpus/-c, --ram/--mem, --disk, --gpus
and --backend-parameter their own. Prints the new task's id; with --wait, waits for it like
`wait`. The copy is yours, whoever owned the task.

examples:
  tes-bridge task resubmit --wait 3f2a9c1e-...
  tes-bridge task resubmit 3f2a9c1e-... -t 2:00:00 --ram 8 --cpus 4 -p long
""",
    ),
    "cancel": (
        "cancel tasks",
        """\
Ask the server to cancel each task. A task that had already ended keeps its state: that is
said on stderr (`ID: had already ended COMPLETE; not canceled`) and the exit status is 1.

example:
  tes-bridge task cancel 3f2a9c1e-... 77b0d4a2-...
""",
    ),
    "logs": (
        "print a task's whole output: executor stdout and stderr, system logs",
        """\
Print what the executors of the task's last attempt have written so far, in any state
(running, finished, canceled, stopped at its time limit): executor by executor, its stdout (on
stdout) and stderr (on stderr), then its exit code once it has one (on stderr, as `executor N:
exit code X`); then the attempt's system logs (on stderr, as `system: ...`) and, for a task
tes-slurm-bridge staged on a transfer partition, its three jobs (on stderr, as `job: stage-in
job N: COMPLETED, exit code 0, partition xfer`, `job: task job ...`, `job: stage-out job ...`,
again as their states change). With several
executors, a line `--- executor N stdout ---` (or `stderr`) comes before each executor's text
on that stream. From tes-slurm-bridge the output is whole (its live output endpoint); other
servers keep part of a finished executor's output in the task, which is printed. The exit
status is the task's outcome once it is final (0 COMPLETE, 3 EXECUTOR_ERROR, ...; see below),
0 while it is not.
With --follow, poll until the task is final, printing only new text, and exit like `wait`:
from tes-slurm-bridge each line as the executor writes it, from other servers an executor's
output once it has finished.

examples:
  tes-bridge task logs 3f2a9c1e-... > out.txt
  tes-bridge task logs --follow 3f2a9c1e-...
""",
    ),
    "wait": (
        "wait until tasks are final; the exit status tells how they ended",
        f"""\
Wait until every task is final (COMPLETE, EXECUTOR_ERROR, SYSTEM_ERROR, CANCELED or
PREEMPTED). On a terminal, each change of state is shown as it happens under one status
line (for many tasks, the count in each state, and only the tasks that fail); otherwise one
`ID STATE` line per change. Why a waiting task waits, and when Slurm expects its pending job
to start (this bridge says it), is said on stderr as it changes. A server that cannot be
reached for a while is waited for.

{EXIT_CODES_HELP}

examples:
  tes-bridge task wait 3f2a9c1e-...
  tes-bridge task wait --timeout 3600 $(cat ids.txt) || echo "some failed: $?"
""",
    ),
}


def _pair(separator: str, what: str, *, last: bool = False) -> Any:
    """An argparse type for `A=B` options (split on the last `=` when `last`: URLs may have
    `=` in their query, paths rarely do)."""

    def parse(value: str) -> tuple[str, str]:
        left, sep, right = value.rpartition(separator) if last else value.partition(separator)
        if not sep or not left:
            raise argparse.ArgumentTypeError(f"{value!r}: expected {what}")
        return left, right

    parse.__name__ = what  # argparse names the type in its error message
    return parse


def _tag_filter(value: str) -> tuple[str, str]:
    """`k` (any value; sent as an empty tag_value, to keep the pairs in step) or `k=v`."""
    key, _, wanted = value.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"{value!r}: expected KEY or KEY=VALUE")
    return key, wanted


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(value: str) -> int | float:
        try:
            number = kind(value)
        except ValueError:
            number = 0
        if not number > 0:  # also NaN
            raise argparse.ArgumentTypeError(f"{value!r}: expected a number above 0")
        return number

    parse.__name__ = "number"
    return parse


def _add_connection_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument(
        "--url",
        default=os.environ.get("TES_URL", DEFAULT_URL),
        help=f"the TES server (default: $TES_URL or {DEFAULT_URL})",
    )
    group.add_argument(
        "--token", default=os.environ.get("TES_TOKEN"), help="bearer token (default: $TES_TOKEN)"
    )
    group.add_argument(
        "--user",
        default=os.environ.get("TES_USER"),
        help="user name for HTTP basic authentication (default: $TES_USER); the password comes "
        "from $TES_PASSWORD or the netrc entry of the host",
    )
    group.add_argument(
        "--http-timeout",
        type=_positive(float),
        default=30.0,
        metavar="SECONDS",
        help="time-out of each HTTP request (default: 30)",
    )


def _add_wait_options(
    parser: argparse.ArgumentParser, *, wait_flag: bool, timeout: bool = True
) -> None:
    if wait_flag:
        parser.add_argument(
            "--wait", action="store_true", help="wait for the task and exit with its outcome"
        )
    parser.add_argument(
        "--interval",
        type=_positive(float),
        default=2.0,
        metavar="SECONDS",
        help="poll interval (2)",
    )
    if timeout:
        parser.add_argument(
            "--timeout",
            type=_positive(float),
            metavar="SECONDS",
            help="stop waiting after this long (exit 7)",
        )


def _add_resource_options(parser: argparse.ArgumentParser, *, changes: bool = False) -> None:
    """`run`'s resources and Slurm options, in sbatch's spellings too; for `resubmit`
    (`changes`) each replaces the task's own."""
    own = " (replaces the task's)" if changes else ""
    group = parser.add_argument_group("resources" + own)
    group.add_argument(
        "--cpus",
        "-c",
        "--cpus-per-task",
        dest="cpus",
        type=int,
        metavar="N",
        help="CPU cores (resources.cpu_cores)",
    )
    # Each size in this client's spelling (GB) and in sbatch's (MB), units taken by both.
    for own_option, sbatch_option, dest, what in (
        ("--ram", "--mem", "ram", "memory (resources.ram_gb)"),
        ("--disk", "--tmp", "disk", "disk (resources.disk_gb)"),
    ):
        group.add_argument(
            own_option,
            dest=dest,
            type=size_option("G"),
            metavar="SIZE",
            help=f"{what}: GB, or with a unit as sbatch takes it (512M, 4G)",
        )
        group.add_argument(
            sbatch_option,
            dest=dest,
            type=size_option("M"),
            metavar="SIZE",
            help=f"as sbatch {sbatch_option}: MB, or with a unit (4G)",
        )
    slurm = parser.add_argument_group(
        "Slurm (resources.backend_parameters; a server may ignore keys it does not know)" + own
    )
    slurm.add_argument(
        "--time",
        "-t",
        metavar="TIME",
        help="time limit as sbatch takes it: minutes, HH:MM:SS or D-HH:MM (key `time`)",
    )
    slurm.add_argument("--partition", "-p", metavar="NAME", help="Slurm partition (`partition`)")
    slurm.add_argument("--gpus", metavar="[TYPE:]N", help="GPUs for the job, e.g. 1 or a100:2")
    slurm.add_argument(
        "--backend-parameter",
        action="append",
        default=[],
        type=_pair("=", "KEY=VALUE"),
        metavar="KEY=VALUE",
        help="any backend parameter, e.g. qos=long or constraint=avx2 (repeatable)",
    )


def _add_test_only(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--test-only",
        action="store_true",
        help="create nothing: say where and when Slurm would start such a task "
        "(sbatch --test-only; tes-slurm-bridge only)",
    )


def no_abbreviations(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Turn off argparse's prefix matching in `parser` and every subparser below it: an
    abbreviation silently picks another option (`--time 5` was `--timeout 5`)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                no_abbreviations(sub)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tes-bridge task",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub = {
        name: commands.add_parser(
            name,
            help=summary,
            # Those that wait exit with the tasks' outcome.
            description=text + (f"\n{EXIT_CODES_HELP}\n" if name in WAITING else ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for name, (summary, text) in COMMANDS.items()
    }
    for command in sub.values():
        _add_connection_options(command)

    run = sub["run"]
    run.add_argument("image", help="container image, e.g. alpine or quay.io/org/tool:1.2")
    run.add_argument("command", nargs="*", metavar="CMD", help="command and arguments, after --")
    run.add_argument("--name", help="task name")
    run.add_argument("--workdir", help="working directory of the command in the container")
    run.add_argument(
        "--input",
        action="append",
        default=[],
        type=_pair("=", "URL=PATH", last=True),
        metavar="URL=PATH",
        help="stage URL in at PATH (repeatable)",
    )
    run.add_argument(
        "--output",
        action="append",
        default=[],
        type=_pair("=", "PATH=URL"),
        metavar="PATH=URL",
        help="upload PATH to URL (repeatable)",
    )
    run.add_argument(
        "--env",
        action="append",
        default=[],
        type=_pair("=", "K=V"),
        metavar="K=V",
        help="environment variable of the command (repeatable)",
    )
    run.add_argument(
        "--tag",
        action="append",
        default=[],
        type=_pair("=", "KEY=VALUE"),
        metavar="KEY=VALUE",
        help="task tag (repeatable)",
    )
    _add_resource_options(run)
    _add_wait_options(run, wait_flag=True)
    _add_test_only(run)

    submit = sub["submit"]
    submit.add_argument("file", metavar="FILE", help="task document, JSON or YAML; - for stdin")
    _add_wait_options(submit, wait_flag=True)
    _add_test_only(submit)

    listing = sub["list"]
    listing.add_argument(
        "--state",
        action="append",
        default=[],
        type=states_option,
        metavar="STATE[,STATE...]",
        help="only tasks in these states, any case; repeatable",
    )
    listing.add_argument(
        "--since",
        type=since_option,
        metavar="WHEN",
        help="only tasks created since: a duration back (30m, 2h, 1d) or a UTC date/time",
    )
    listing.add_argument(
        "--watch", action="store_true", help="print the table again every --interval seconds"
    )
    listing.add_argument(
        "--interval",
        type=_positive(float),
        default=2.0,
        metavar="SECONDS",
        help="with --watch: how often (2)",
    )
    listing.add_argument("--name-prefix", metavar="PREFIX", help="only names starting so")
    listing.add_argument(
        "--tag",
        action="append",
        default=[],
        type=_tag_filter,
        metavar="KEY[=VALUE]",
        help="only tasks with this tag (any value without =VALUE); repeatable, all must match",
    )
    listing.add_argument("--json", action="store_true", help="print a JSON array of tasks")
    listing.add_argument(
        "--view", choices=VIEWS, default="BASIC", help="with --json: how much of each task"
    )
    listing.add_argument("--limit", type=_positive(int), metavar="N", help="at most N tasks")
    listing.add_argument(
        "--page-size", type=_positive(int), metavar="N", help="tasks per request (server's default)"
    )

    get = sub["get"]
    get.add_argument("id", help="task id")
    get.add_argument("--view", choices=VIEWS, default="FULL", help="default: FULL")

    resubmit = sub["resubmit"]
    resubmit.add_argument("id", help="the task to copy")
    resubmit.add_argument("--name", help="the copy's name (default: the task's)")
    _add_resource_options(resubmit, changes=True)
    _add_wait_options(resubmit, wait_flag=True)

    sub["cancel"].add_argument("ids", nargs="+", metavar="ID", help="task ids")

    logs = sub["logs"]
    logs.add_argument("id", help="task id")
    logs.add_argument("--follow", "-f", action="store_true", help="print new output until final")
    _add_wait_options(logs, wait_flag=False, timeout=False)

    wait = sub["wait"]
    wait.add_argument("ids", nargs="+", metavar="ID", help="task ids")
    _add_wait_options(wait, wait_flag=False)
    return no_abbreviations(parser)


def make_client(args: argparse.Namespace) -> TesClient:
    if args.token and args.user:
        raise TesError("give either --token or --user, not both")
    password = None
    if args.user:
        password = os.environ.get("TES_PASSWORD")
        if password is None:
            login = requests.utils.get_netrc_auth(args.url)
            if not login or login[0] != args.user:
                raise TesError(
                    f"no password for {args.user}: set TES_PASSWORD or add a netrc entry "
                    "(machine HOST login USER password ...)"
                )
            password = login[1]
    return TesClient(
        args.url, token=args.token, user=args.user, password=password, timeout=args.http_timeout
    )


# ------------------------------------------------------------------------------ documents
def task_from_options(args: argparse.Namespace, err: TextIO | None = None) -> dict[str, Any]:
    """The task `run` posts; what became of a relative local path is said on `err`."""
    if not args.command:
        raise TesError("run: give the command after the image: run IMAGE -- CMD ARGS...")
    executor: dict[str, Any] = {"image": args.image, "command": list(args.command)}
    if args.workdir:
        executor["workdir"] = args.workdir
    if args.env:
        executor["env"] = dict(args.env)
    task: dict[str, Any] = {"executors": [executor]}
    name = args.name or command_name(args.command)
    if name:
        task["name"] = name
    err = err or sys.stderr
    if args.input:
        task["inputs"] = [
            {"url": _local_url(url, "--input", err), **_path(path)} for url, path in args.input
        ]
    if args.output:
        task["outputs"] = [
            {"url": _local_url(url, "--output", err), **_path(path)} for path, url in args.output
        ]
    resources = _resources(args)
    if resources:
        task["resources"] = resources
    if args.tag:
        task["tags"] = dict(args.tag)
    return task


def _resources(args: argparse.Namespace) -> dict[str, Any]:
    """resources from --cpus, --ram, --disk and the Slurm options (backend_parameters; the
    named options win over a --backend-parameter of the same key)."""
    resources: dict[str, Any] = {
        key: value
        for key, value in (("cpu_cores", args.cpus), ("ram_gb", args.ram), ("disk_gb", args.disk))
        if value is not None
    }
    backend = dict(args.backend_parameter)
    named = (("time", args.time), ("partition", args.partition), ("gpus", args.gpus))
    backend.update({key: value for key, value in named if value is not None})
    if backend:
        resources["backend_parameters"] = backend
    return resources


def _local_url(url: str, option: str, err: TextIO) -> str:
    """A relative local path (`./in.txt`, `data/in.txt`) as the file:// URL of its absolute
    path: the server, which stages it, does not know this shell's working directory. Said on
    `err`, so that a refusal naming the URL is understood."""
    if urlsplit(url).scheme or url.startswith("/"):
        return url
    absolute = "file://" + os.path.abspath(url)
    err.write(f"tes-bridge task: {option} {url} is {absolute}\n")
    return absolute


def _path(path: str) -> dict[str, str]:
    """`/data/out/` is the DIRECTORY `/data/out`; anything else a FILE."""
    if len(path) > 1 and path.endswith("/"):
        return {"path": path.rstrip("/") or "/", "type": "DIRECTORY"}
    return {"path": path, "type": "FILE"}


def read_document(name: str) -> dict[str, Any]:
    """A task document from a file or stdin, JSON or YAML (YAML 1.1 reads most JSON too,
    but not all of it, so JSON is tried first)."""
    try:
        text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
    except OSError as exc:
        raise TesError(f"cannot read {name}: {exc.strerror}") from None
    where = "standard input" if name == "-" else name
    try:
        document = json.loads(text)
    except ValueError:
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TesError(f"{where} is neither JSON nor YAML: {exc}") from None
    if not isinstance(document, dict):
        raise TesError(f"{where}: expected a task (a mapping), got {type(document).__name__}")
    return document


# ------------------------------------------------------------------------------ commands
def create(client: TesClient, task: dict[str, Any], args: argparse.Namespace) -> int:
    if getattr(args, "test_only", False):  # run and submit have it
        return test_only(client, task)
    task_id = client.create(task)
    print(task_id, flush=True)
    if not args.wait:
        return 0
    return wait_for(
        client,
        [task_id],
        out=sys.stdout,
        err=sys.stderr,
        interval=args.interval,
        timeout=args.timeout,
    )


def test_only(client: TesClient, task: dict[str, Any]) -> int:
    """Where and when Slurm would start the task (tes-slurm-bridge's sbatch --test-only);
    exit status 1 when Slurm would refuse it."""
    try:
        answer = client.test_only(task)
    except TesError as exc:
        if exc.status in (404, 405):
            raise TesError(
                f"{exc}: this server cannot say when a task would start (--test-only asks "
                "tes-slurm-bridge's POST /tasks:test-only)",
                exc.status,
            ) from None
        raise
    if "refused" in answer:
        print(f"Slurm would refuse it: {answer['refused']}")
        return EXIT_FAILED
    print(start_line(answer))
    return 0


def start_line(answer: dict[str, Any]) -> str:
    """`Slurm would start it at 2026-11-29 14:05:00 UTC on node1 (2 processors, partition
    main)`, and the jobs it would preempt."""
    when = str(answer.get("start_time") or "an unknown time")
    with contextlib.suppress(ValueError):
        when = f"{datetime.fromisoformat(when).astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
    where = [f"{answer.get('processors', '?')} processors"]
    if answer.get("partition"):
        where.append(f"partition {answer['partition']}")
    line = f"Slurm would start it at {when} on {answer.get('nodes', '?')} ({', '.join(where)})"
    if answer.get("preempts"):
        line += f", preempting job(s) {','.join(map(str, answer['preempts']))}"
    return line


def run_task(client: TesClient, args: argparse.Namespace) -> int:
    return create(client, task_from_options(args), args)


def submit_task(client: TesClient, args: argparse.Namespace) -> int:
    return create(client, read_document(args.file), args)


def list_tasks(client: TesClient, args: argparse.Namespace) -> int:
    while True:
        tasks = matching_tasks(client, args, args.view if args.json else "BASIC")
        text = json.dumps(tasks, indent=2) if args.json else "\n".join(table(tasks))
        if not args.watch:
            print(text)
            return 0
        if sys.stdout.isatty():
            sys.stdout.write("\x1b[H\x1b[2J")  # like watch(1): the table from the top
        print(f"every {args.interval:g} s, {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC\n{text}\n")
        sys.stdout.flush()
        time.sleep(args.interval)


def resubmit_task(client: TesClient, args: argparse.Namespace) -> int:
    task = resubmitted(client.get(args.id, view="FULL"), _resources(args))
    if args.name:
        task["name"] = args.name
    return create(client, task, args)


def get_task(client: TesClient, args: argparse.Namespace) -> int:
    print(json.dumps(client.get(args.id, view=args.view), indent=2))
    return 0


def show_logs(client: TesClient, args: argparse.Namespace) -> int:
    if args.follow:
        return follow_logs(client, args.id, out=sys.stdout, err=sys.stderr, interval=args.interval)
    task = client.get(args.id, view="FULL")
    print_logs(client, task, out=sys.stdout, err=sys.stderr)
    state = str(task.get("state"))
    if state not in FINAL_STATES:
        print(f"task {args.id} is {state}; --follow prints what comes", file=sys.stderr)
        return 0
    if state != "COMPLETE":
        print(f"task {args.id}: {state}", file=sys.stderr)
    return outcome([state])


def wait_tasks(client: TesClient, args: argparse.Namespace) -> int:
    return wait_for(
        client,
        args.ids,
        out=sys.stdout,
        err=sys.stderr,
        interval=args.interval,
        timeout=args.timeout,
    )


def cancel_tasks(client: TesClient, args: argparse.Namespace) -> int:
    """Cancel each task; one that had already ended is said so (its state kept) and, like
    scancel of a finished job, makes the exit status 1."""
    code = 0
    for task_id in args.ids:
        try:
            state = str(client.get(task_id).get("state"))
            if state in FINAL_STATES:
                print(f"{task_id}: had already ended {state}; not canceled", file=sys.stderr)
                code = EXIT_FAILED
                continue
            client.cancel(task_id)
        except TesError as exc:
            print(f"tes-bridge task: {exc}", file=sys.stderr)
            code = EXIT_FAILED
        else:
            print(f"{task_id}: cancel requested")
    return code


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse `argv`; for `run`, everything after the first `--` is the command as it is
    (argparse would take a second `--` or an option-like word there for its own)."""
    parser = build_parser()
    # Every option belongs to an action, so the action is the first word.
    split = list(argv).index("--") if argv[:1] == ["run"] and "--" in argv else len(argv)
    args, extra = parser.parse_known_args(argv[:split])
    if extra:
        # Said by the action's own parser: its usage, and what was likely meant.
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = action.choices[args.action]
        command.error(unrecognized(extra, command))
    if split < len(argv):
        args.command = [*args.command, *argv[split + 1 :]]
    return args


ACTIONS: dict[str, Callable[[TesClient, argparse.Namespace], int]] = {
    "run": run_task,
    "submit": submit_task,
    "resubmit": resubmit_task,
    "list": list_tasks,
    "get": get_task,
    "cancel": cancel_tasks,
    "logs": show_logs,
    "wait": wait_tasks,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        return ACTIONS[args.action](make_client(args), args)
    except TesError as exc:
        print(f"tes-bridge task: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        if sys.stdout.isatty():
            print()  # past a status line that `wait` drew
        return 130
    except BrokenPipeError:
        # `tes-bridge task list | head`: the reader left; not an error worth a traceback.
        sys.stderr.close()
        return 0
