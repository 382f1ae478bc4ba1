"""The `tes-bridge` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bridge import __version__
from bridge.config import ENV_CONFIG, Config, ConfigError, load_config
from bridge.system.logs import JsonFormatter, setup_logging
from bridge.system.proc import die_with_parent

log = logging.getLogger("bridge.cli.main")

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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the TES API under gunicorn, and the poller beside it",
        description="Run the TES API (gunicorn with Tornado workers: slow or idle clients "
        "hold no worker, and a request must arrive within server.header_timeout_seconds and "
        "server.body_timeout_seconds) and, unless --no-poller, the poller "
        "that submits tasks to Slurm and follows them (restarted if it dies; it dies with "
        "serve, even with kill -9). Logs are JSON lines on stderr. Prometheus metrics are at "
        "/metrics for admins (metrics.enabled); the workers and the poller keep them in "
        "<state_dir>/metrics.",
    )
    serve.add_argument(
        "--bind", help="address:port to listen on (default: server.bind, 127.0.0.1:8000)"
    )
    serve.add_argument(
        "--workers", type=int, help="gunicorn worker processes (default: server.workers)"
    )
    serve.add_argument(
        "--no-poller",
        action="store_true",
        help="do not run the poller here (run `tes-bridge poller` as its own service)",
    )

    poller = commands.add_parser(
        "poller",
        help="run the poller alone: submit queued tasks, follow Slurm, carry out cancels",
        description="Run the poller alone (for a separate service unit). Run exactly one "
        "poller per store.",
    )
    poller.add_argument("--once", action="store_true", help="run one cycle and exit")
    poller.add_argument(
        "--supervise",
        action="store_true",
        help="run the poller as a child and start it again whenever it dies (what serve "
        "does); the poller dies with this process",
    )

    commands.add_parser(
        "init-db",
        help="create the database tables (serve and poller also do this on start)",
    )
    commands.add_parser("show-config", help="print the effective configuration as JSON")
    check = commands.add_parser(
        "check",
        help="check this host's setup: config, database, directories, Slurm, Apptainer, sudo",
        description="Check that the configuration loads, the database takes writes, the work "
        "directory, image cache and file directories exist with the right permissions for the "
        "service account, sinfo and sacct answer, the container runtime runs an image, and "
        "(site mode) the sudo rule is installed. One line per check, with what to fix; exit "
        "status 1 when any check fails. Run it as the service account (as root, permissions "
        "are checked for the owner of the state directory).",
    )
    check.add_argument(
        "--image",
        default="alpine",
        help="image the runtime must run, as tasks name it (default: alpine, from "
        "container.default_registry)",
    )
    check.add_argument("--json", action="store_true", help="print the results as JSON")

    images = commands.add_parser(
        "images",
        help="the shared image cache: list, pull or forget images",
        description="The SIF cache the poller fills (container.cache_dir). A tag is checked "
        "against its registry again after container.refresh_seconds and pulled again only when "
        "its manifest digest changed; an @sha256: reference never is. SIFs are named by digest; "
        "one a tag no longer names is removed once no unfinished task can still use it.",
    )
    image_commands = images.add_subparsers(dest="images_command", metavar="ACTION", required=True)
    listing = image_commands.add_parser(
        "list", help="references in the cache with their digest, SIF and last check"
    )
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pull = image_commands.add_parser(
        "pull",
        help="check images against their registry now and pull those that changed",
        description="Check each IMAGE's digest now (whatever container.refresh_seconds says) "
        "and pull it when the cache does not hold that digest yet. Waits for the pulls.",
    )
    pull.add_argument("image", nargs="+", help="image reference as tasks name it, e.g. alpine:3")
    forget = image_commands.add_parser(
        "forget",
        help="drop images from the cache; the next task that uses one pulls it again",
        description="Drop each IMAGE's entry, then remove the SIFs no entry names any more once "
        "no unfinished task is older than the moment they became unused (the poller also does "
        "this every 10 minutes).",
    )
    forget.add_argument("image", nargs="+", help="image reference as tasks name it")

    job = commands.add_parser(
        "job",
        help="job-side commands run inside Slurm jobs (staging); not for interactive use",
        add_help=False,
    )
    job.add_argument("job_args", nargs=argparse.REMAINDER)

    task = commands.add_parser(
        "task",
        help="a client for any TES server: run, submit, list, get, cancel, logs, wait "
        "(`tes-bridge task --help`)",
        add_help=False,
    )
    task.add_argument("task_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `job` options (including its --help) belong to the job side's own parser.
    args, extra = parser.parse_known_args(argv)
    if args.command == "task":
        # The client has its own parser (given the words as typed) and needs no configuration.
        from bridge.client.cli import main as task_main

        return task_main(argv[argv.index("task") + 1 :])
    if args.command == "job":
        # The job side has its own parser and must not need the login node's configuration.
        from bridge.job.cli import main as job_main

        return job_main([*extra, *args.job_args])
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    setup_logging(args.log_level)
    if args.command == "check":
        return check_command(args)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"tes-bridge: {exc}", file=sys.stderr)
        return 2
    if args.config:
        # Gunicorn workers and the poller process read the same file.
        os.environ[ENV_CONFIG] = os.path.abspath(args.config)

    if args.command == "show-config":
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    if args.command == "init-db":
        _init_store(config)
        from bridge.job.staging import redact

        print(f"database ready: {redact(config.database_url)}")
        return 0
    # The poller submits the jobs, which run as the user it runs as: the API alone runs none.
    submits = args.command == "poller" or (
        args.command == "serve" and not args.no_poller and config.server.run_poller
    )
    if submits:
        problem = refuse_root(config, os.geteuid())
        if problem:
            print(f"tes-bridge: {problem}", file=sys.stderr)
            return 2
    if args.command == "images":
        return images_command(config, args)
    if args.command == "poller" and args.supervise:
        argv = [sys.executable, "-m", "bridge", "--log-level", args.log_level, "poller"]
        return supervise(argv + (["--once"] if args.once else []))
    if args.command == "poller":
        return poller_command(config, once=args.once)
    if args.command == "serve":
        return serve(
            config,
            bind=args.bind,
            workers=args.workers,
            poller=not args.no_poller,
            log_level=args.log_level,
        )
    parser.error(f"unknown command {args.command}")
    return 2


def poller_command(config: Config, *, once: bool) -> int:
    if not _metrics_ready(config, wipe=False):
        return 2
    from bridge.poller import run_poller

    _init_store(config)
    return run_poller(config, once=once)


def check_command(args: argparse.Namespace) -> int:
    """`tes-bridge check`: one line per check (or JSON); 1 when any failed."""
    from bridge.cli.check import Doctor, Result

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        results = [Result("config", False, str(exc), "correct the configuration file")]
    else:
        where = args.config or os.environ.get(ENV_CONFIG) or "defaults"
        results = [Result("config", True, f"loaded ({where})")]
        results += Doctor(config, image=args.image).run()
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        for result in results:
            print(result.line(), flush=True)
    return 0 if all(r.ok for r in results) else 1


def images_command(config: Config, args: argparse.Namespace) -> int:
    from bridge.images.cache import ImageCache
    from bridge.images.index import sandbox_of
    from bridge.images.ref import ImagePullError

    cache = ImageCache(config, max_workers=config.container.pull_workers)
    try:
        if args.images_command == "list":
            entries = cache.entries()
            if args.json:
                rows = []
                for entry in entries:
                    sif = cache.cache_dir / entry.sif
                    size = sif.stat().st_size if sif.is_file() else None
                    sandbox = sandbox_of(sif)
                    rows.append(
                        {
                            **entry.__dict__,
                            "path": str(sif),
                            "size": size,
                            "sandbox": str(sandbox) if sandbox.is_dir() else None,
                        }
                    )
                print(json.dumps(rows, indent=2))
                return 0
            print(f"{'REFERENCE':50} {'DIGEST':19} {'CHECKED':20} SIF")
            for entry in entries:
                checked = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.checked_at))
                digest = (entry.digest or "-")[:19]
                print(f"{entry.reference:50} {digest:19} {checked:20} {entry.sif}")
            return 0
        failed = 0
        if args.images_command == "pull":
            for image in args.image:
                try:
                    path = cache.pull(image, check=True)
                    print(f"{image}: {path}")
                except ImagePullError as exc:
                    print(f"tes-bridge: cannot pull {exc}", file=sys.stderr)
                    failed += 1
            return 1 if failed else 0
        for image in args.image:
            try:
                known = cache.forget(image)
            except ImagePullError as exc:
                print(f"tes-bridge: {exc}", file=sys.stderr)
                failed += 1
                continue
            print(f"{image}: {'forgotten' if known else 'not in the cache'}")
        from bridge.store import Store

        _init_store(config)
        store = Store.from_url(config.database_url)
        with store.db.connection_context():
            oldest = store.oldest_unfinished_time()
        deleted, kept = cache.prune(oldest)
        for path in deleted:
            print(f"removed {path}")
        for path in kept:
            print(f"kept {path} (unfinished tasks may still use it; removed later)")
        return 1 if failed else 0
    finally:
        cache.close()


def _init_store(config: Config) -> None:
    from bridge.store import Store

    config.state_dir.mkdir(parents=True, exist_ok=True)
    store = Store.from_url(config.database_url)
    store.init_schema(__version__)
    store.db.close()


#: The variable prometheus_client's multiprocess mode reads when it is first imported.
ENV_METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR"


class MetricsDirError(Exception):
    """The metrics directory cannot be made or used; the message says how to fix it."""


def prepare_metrics_dir(config: Config, *, wipe: bool) -> Path:
    """Point every process of the service (gunicorn workers, the poller) at one private
    directory for their metrics files; with `wipe` (serve starting), drop the files of
    processes that are gone. A poller running as its own service keeps its live files."""
    directory = config.state_dir / "metrics"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(directory))
    except OSError as exc:
        raise MetricsDirError(
            f"cannot use {directory} for the metrics files ({exc.strerror}): create it, owned "
            "by the service account with mode 0700, or set metrics.enabled = false"
        ) from None
    if wipe:
        for path in directory.glob("*.db"):
            pid = path.stem.rsplit("_", 1)[-1]
            if not pid.isdigit() or not _alive(int(pid)):
                path.unlink(missing_ok=True)
    os.environ[ENV_METRICS_DIR] = str(directory)
    return directory


def _metrics_ready(config: Config, *, wipe: bool) -> bool:
    """Multiprocess metrics set up (or turned off); False, said on stderr, when impossible.
    Runs before anything imports prometheus_client, which reads the directory once."""
    if not config.metrics.enabled:
        return True
    try:
        prepare_metrics_dir(config, wipe=wipe)
    except MetricsDirError as exc:
        print(f"tes-bridge: {exc}", file=sys.stderr)
        return False
    return True


def start_metrics_server(config: Config) -> None:
    """`metrics.bind`: serve the metrics from gunicorn's master, which outlives its workers.
    The store is opened for each scrape only, so no worker inherits an open connection."""
    if not (config.metrics.enabled and config.metrics.bind):
        return
    from bridge.api.metrics_api import serve_metrics
    from bridge.store import Store

    store = Store.from_url(config.database_url)

    def count_by_state() -> dict[str, int]:
        with store.db.connection_context():
            return store.count_by_state()

    serve_metrics(config.metrics.bind, count_by_state)
    log.info("metrics served", extra={"bind": config.metrics.bind})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def refuse_root(config: Config, euid: int) -> str | None:
    """Why the service must not start as user `euid` (None when it may)."""
    if euid != 0 or config.container.allow_root:
        return None
    return (
        "refusing to run as root: jobs submitted by root run their executors as root, which "
        "is host root behind the container's user namespace. Run tes-bridge as an unprivileged "
        "service account (deploy/quickstart.sh creates `tesbridge`), or, knowing the risk, set "
        "container.allow_root = true."
    )


def unsafe_bind(config: Config, bind: str) -> str | None:
    """Why `bind` must not be served with this configuration (None when it may)."""
    if config.auth.mode != "none" or config.auth.allow_remote_without_auth:
        return None
    import ipaddress

    host = bind.rsplit(":", 1)[0].strip("[]") if ":" in bind else bind
    if bind.startswith("unix:") or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (
        f'refusing to serve {bind} without authentication: with auth.mode = "none" only a '
        "loopback address (127.0.0.1, ::1) may be bound. Set auth.mode to basic or bearer, "
        "or auth.allow_remote_without_auth = true if something in front authenticates."
    )


def _gunicorn_logconfig(level: str) -> dict[str, Any]:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            },
            "null": {"class": "logging.NullHandler"},
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {
            "gunicorn.error": {"level": level.upper(), "handlers": ["stderr"], "propagate": False},
            "gunicorn.access": {"level": "WARNING", "handlers": [], "propagate": False},
            # Tornado's own line per request; bridge.access already logs each one.
            "tornado.access": {"handlers": ["null"], "propagate": False},
        },
    }


def supervise(argv: list[str], *, max_delay: float = 60.0) -> int:
    """Run the poller (`argv`) and start it again whenever it dies, until SIGTERM or SIGINT.

    This runs as a process of its own, started by `serve` before gunicorn: starting children
    from a thread of gunicorn's master races with its forks of workers (a worker inherits the
    pipe Popen waits on, and the wait never ends), and the master reaps every child it has.
    """
    stopping = threading.Event()
    current: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.set()
        if current and current[-1].poll() is None:
            current[-1].send_signal(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    delay = 1.0
    while not stopping.is_set():
        started = time.monotonic()
        # Killed with us: a supervisor killed -9 leaves no poller holding the lock.
        process = subprocess.Popen(argv, preexec_fn=die_with_parent())
        current[:] = [process]
        log.info("poller started", extra={"pid": process.pid})
        code = process.wait()
        if stopping.is_set():
            break
        # A poller that ran for a while starts again at once; one that keeps dying backs off.
        delay = 1.0 if time.monotonic() - started > 60 else min(delay * 2, max_delay)
        log.error("poller exited with %s; starting it again in %.0f s", code, delay)
        stopping.wait(delay)
    return 0


def serve(
    config: Config, *, bind: str | None, workers: int | None, poller: bool, log_level: str
) -> int:
    if not _metrics_ready(config, wipe=True):
        return 2
    from prometheus_client.multiprocess import mark_process_dead

    from bridge.api.app import create_app
    from bridge.api.server import (
        WORKER_CLASS,
        BridgeApplication,
        BridgeWSGIContainer,
        watch_master,
    )
    from bridge.store import Store

    problem = unsafe_bind(config, bind or config.server.bind)
    if problem:
        print(f"tes-bridge: {problem}", file=sys.stderr)
        return 2
    _init_store(config)
    run_poller = poller and config.server.run_poller
    supervisor: subprocess.Popen[bytes] | None = None
    if run_poller:
        # Started before gunicorn forks anything; it keeps a poller running (see supervise).
        argv = [sys.executable, "-m", "bridge", "--log-level", log_level, "poller", "--supervise"]
        # Killed with this process (gunicorn's master), even by kill -9: an orphaned
        # supervisor would keep a poller holding the lock against the next `serve`.
        supervisor = subprocess.Popen(argv, preexec_fn=die_with_parent())

    def stop_poller(arbiter: Any = None) -> None:
        if supervisor is None or supervisor.poll() is not None:
            return
        supervisor.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        # Polled: gunicorn's master may reap the process itself, and then wait() never returns.
        while supervisor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if supervisor.poll() is None:
            supervisor.kill()

    class Application(BridgeApplication):
        #: For the workers (bridge.api.server.Worker reads its limits here).
        bridge_config = config

        def load_config(self) -> None:
            options = {
                "bind": bind or config.server.bind,
                "workers": workers or config.server.workers,
                "accesslog": None,
                "logconfig_dict": _gunicorn_logconfig(log_level),
                "on_exit": stop_poller,
                # A dead worker's live gauges must not be summed into the next scrape.
                "child_exit": lambda arbiter, worker: mark_process_dead(worker.pid),
                # A worker whose master was killed -9 ends at once (see watch_master).
                "post_fork": watch_master,
                "when_ready": lambda arbiter: start_metrics_server(config),
                # Slow clients cost no worker: see bridge.api.server.
                "worker_class": WORKER_CLASS,
                "proc_name": "tes-bridge",
                "timeout": 60,
                "graceful_timeout": 20,
            }
            for key, value in options.items():
                self.cfg.set(key, value)

        # Any: a Tornado container, which gunicorn's Tornado worker serves as it is (its stubs
        # know only WSGI and ASGI callables).
        def load(self) -> Any:
            # Runs in each worker after the fork: every worker opens its own database connection.
            app = create_app(config, store=Store.from_url(config.database_url))
            return BridgeWSGIContainer(app, config)

    try:
        Application().run()
    finally:
        stop_poller()  # also when gunicorn could not start (e.g. the port is taken)
    return 0
