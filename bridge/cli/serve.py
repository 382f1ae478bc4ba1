"""`tes-bridge serve` and `tes-bridge poller`: the API under gunicorn, and the poller beside
it or alone, kept running by a supervisor process."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bridge.cli.database import init_store
from bridge.config import Config
from bridge.system.logs import JsonFormatter
from bridge.system.proc import die_with_parent

log = logging.getLogger("bridge.cli.serve")


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`serve` and `poller`."""
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
    serve.set_defaults(run=serve_command)

    poller = commands.add_parser(
        "poller",
        help="run the poller alone: submit queued tasks, follow Slurm, carry out cancels",
        description="Run the poller alone (for a separate service unit). With SQLite run "
        "exactly one poller per store; with PostgreSQL one on each login node: the one that "
        "holds the lease acts, the others take over when it ends (poller.lease_seconds).",
    )
    poller.add_argument("--once", action="store_true", help="run one cycle and exit")
    poller.add_argument(
        "--supervise",
        action="store_true",
        help="run the poller as a child and start it again whenever it dies (what serve "
        "does); the poller dies with this process",
    )
    poller.set_defaults(run=poller_command)


def serve_command(config: Config, args: argparse.Namespace) -> int:
    # The poller submits the jobs, which run as the user it runs as: the API alone runs none.
    if not args.no_poller and config.server.run_poller and not _may_submit(config):
        return 2
    return serve(
        config,
        bind=args.bind,
        workers=args.workers,
        poller=not args.no_poller,
        log_level=args.log_level,
    )


def poller_command(config: Config, args: argparse.Namespace) -> int:
    if not _may_submit(config):
        return 2
    if args.supervise:
        argv = [sys.executable, "-m", "bridge", "--log-level", args.log_level, "poller"]
        return supervise(argv + (["--once"] if args.once else []))
    if not _metrics_ready(config, wipe=False):
        return 2
    from bridge.poller import run_poller

    init_store(config)
    return run_poller(config, once=args.once)


def _may_submit(config: Config) -> bool:
    """False, said on stderr, when this user must not submit jobs (see refuse_root)."""
    problem = refuse_root(config, os.geteuid())
    if problem:
        print(f"tes-bridge: {problem}", file=sys.stderr)
        return False
    return True


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
    from bridge.api.metrics_api import Readings, serve_metrics
    from bridge.store import Store

    store = Store.from_url(config.database_url)

    def count_by_state() -> dict[str, int]:
        with store.db.connection_context():
            return store.count_by_state()

    def oldest_queued() -> float | None:
        with store.db.connection_context():
            return store.oldest_queued_time()

    readings = Readings(count_by_state, oldest_queued, config.state_dir)
    serve_metrics(config.metrics.bind, readings)
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
    init_store(config)
    if config.database_url.startswith("sqlite"):
        from bridge.store import SQLITE_ONE_NODE

        log.warning(SQLITE_ONE_NODE)
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
