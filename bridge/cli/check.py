"""`tes-bridge check`: does this host's setup let the bridge work? One line per check.

Each check answers ok with what it saw, or what is wrong and how to fix it. Run it as the
service account (`sudo -u tesbridge tes-bridge check`): the permissions it checks are that
account's. As root it checks them for the owner of the state directory.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import json
import logging
import os
import pwd
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bridge import config as config_module
from bridge.config import ENV_CONFIG, Config, ConfigError, load_config
from bridge.system.proc import CommandError, run

if TYPE_CHECKING:
    from bridge.store import LeaseState, Store


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check = commands.add_parser(
        "check",
        help="check this host's setup: config, database, poller, directories, Slurm, "
        "Apptainer, sudo; with --job, a compute node",
        description="Check that the configuration loads, the database has the tables and the "
        "service account may write it, a poller runs (its lock or lease, and its heartbeat), "
        "the work directory, image cache and file directories exist with the right "
        "permissions for the service account, sinfo and sacct answer, which Slurm release "
        "runs (tested or not) and whether the call budget fits under slurmctld's RPC rate "
        "limit, the container runtime runs an image, and (site mode) the sudo rule is "
        "installed. With --job, a small job on a compute node runs job.python and shows "
        "that the work directory there is the one this host sees. One line per check, with "
        "what to fix; exit status 1 when any check fails. It reads the file of --config, "
        "$TES_BRIDGE_CONFIG or /etc/tes-bridge/tes-bridge.toml, and stops when there is "
        "none. It writes nothing of the service's (the database is opened read-only; the "
        "image is pulled into a temporary cache) and logs nothing (--log-level DEBUG: the "
        "log on stderr). Run it as the service account (as root, permissions are checked "
        "for the owner of the state directory, and the job is submitted as that account).",
    )
    check.add_argument(
        "--image",
        default="alpine",
        help="image the runtime must run, as tasks name it (default: alpine, from "
        "container.default_registry)",
    )
    check.add_argument(
        "--job",
        action="store_true",
        help="also submit a small job (slurm.default_partition, 2 minutes, 1 CPU) that runs "
        "job.python on a compute node and writes into the work directory; it is removed "
        "after",
    )
    check.add_argument(
        "--job-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long --job waits for its job to end, pending included (default: 300); "
        "then it is canceled",
    )
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    # It loads the configuration itself: one that does not load is a failed check.
    check.set_defaults(run_unconfigured=check_command)


def config_file(given: str | None) -> str | None:
    """The file to check: --config, else $TES_BRIDGE_CONFIG, else the one the systemd units
    name (DEFAULT_CONFIG_FILE) when it exists; None: there is none."""
    if given or os.environ.get(ENV_CONFIG):
        return given or os.environ.get(ENV_CONFIG)
    default = config_module.DEFAULT_CONFIG_FILE
    return str(default) if default.exists() else None


def check_command(args: argparse.Namespace) -> int:
    """One line per check (or JSON); 1 when any failed."""
    path = config_file(args.config)
    results = [_load(path)]
    config = results[0].config
    if config is not None:
        job = args.job_timeout if args.job else None
        # What the checks find is in their lines; a log line would land among them.
        quiet = args.log_level.upper() != "DEBUG"
        logging.disable(logging.CRITICAL if quiet else logging.NOTSET)
        try:
            results += Doctor(config, image=args.image, job_timeout=job).run()
        finally:
            logging.disable(logging.NOTSET)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        for result in results:
            print(result.line(), flush=True)
    return 0 if all(r.ok for r in results) else 1


def _load(path: str | None) -> Result:
    """The `config` check: the file found and loaded; none found stops the checks (the
    defaults would check, and make, a state directory no service uses)."""
    if path is None:
        return Result(
            "config",
            False,
            f"no configuration found: no --config, ${ENV_CONFIG} unset and no "
            f"{config_module.DEFAULT_CONFIG_FILE}; nothing else was checked",
            "give the service's file: `tes-bridge --config FILE check` (the file its units "
            f"name), or install it as {config_module.DEFAULT_CONFIG_FILE}",
        )
    try:
        config = load_config(path)
    except ConfigError as exc:
        return Result("config", False, str(exc), "correct the configuration file")
    result = Result("config", True, f"loaded ({path})")
    result.config = config
    return result


@dataclass
class Result:
    name: str
    ok: bool
    #: What was seen (ok), or what is wrong (failed).
    message: str
    #: How to fix it (failed checks only).
    fix: str = ""
    #: The `config` check's: the configuration it loaded.
    config: Config | None = field(default=None, repr=False)

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        text = f"{status}  {self.name}: {self.message}"
        return text + (f"\n      fix: {self.fix}" if self.fix else "")

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "ok": self.ok, "message": self.message, "fix": self.fix}


class Failed(Exception):
    """A check failed: the message says what is wrong, `fix` how to put it right."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True)
class Account:
    """The Unix account the service runs as, whose permissions the checks are about."""

    name: str
    uid: int
    gids: frozenset[int]

    @classmethod
    def of(cls, uid: int) -> Account:
        entry = pwd.getpwuid(uid)
        return cls(entry.pw_name, uid, frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid)))


def service_account(config: Config) -> Account:
    """This process's account, or as root the owner of the state directory (the service's)."""
    uid = os.geteuid()
    if uid == 0:
        with contextlib.suppress(OSError, KeyError):
            return Account.of(config.state_dir.stat().st_uid)
    return Account.of(uid)


def may(account: Account, path: Path, want: int) -> bool:
    """Would `account` get `want` (a mask of 4 read, 2 write, 1 search) on `path`, by its mode
    bits? Root may do everything."""
    if account.uid == 0:
        return True
    info = path.stat()
    if info.st_uid == account.uid:
        bits = info.st_mode >> 6
    elif info.st_gid in account.gids:
        bits = info.st_mode >> 3
    else:
        bits = info.st_mode
    return bits & want == want


def _reachable(account: Account, path: Path) -> Path | None:
    """The first parent of `path` that `account` cannot search, if any."""
    for parent in reversed(path.parents):
        if parent.exists() and not may(account, parent, 1):
            return parent
    return None


def _command(argv: list[str], timeout: float, what: str, fix: str) -> str:
    try:
        proc = run(argv, timeout=timeout)
    except CommandError as exc:
        raise Failed(f"{what}: {exc}", fix) from None
    if proc.returncode != 0:
        detail = " ".join((proc.stderr or proc.stdout).split())[:300]
        raise Failed(f"{what} exited {proc.returncode}: {detail}", fix)
    return proc.stdout


class CheckGroup:
    """Checks about one part of the setup, for the service's account."""

    def __init__(self, config: Config, account: Account) -> None:
        self.config = config
        self.account = account


#: The tables whose rows the service writes, and what it does to them.
_WRITTEN_TABLES = {
    "tasks": ("INSERT", "UPDATE", "DELETE"),
    "task_tags": ("INSERT", "DELETE"),
    "bridge_meta": ("INSERT", "UPDATE"),
    "poller_lease": ("UPDATE",),
}


class StoreChecks(CheckGroup):
    """The database, opened read-only (`Store.read_only`): it has the tables, the service
    account may write it, and a poller runs."""

    # The store is imported when first needed: `tes-bridge` loads this module for every
    # command, and the service's must not pay for what only `check` uses.
    def _store(self) -> Store:
        from bridge.store import Store

        return Store.read_only(self.config.database_url)

    def database(self) -> str:
        """The tables and their schema version; SQLite: the service account may write the
        file, its directory (the -wal and -shm files) and those files; PostgreSQL: the
        database user may change every table's rows."""
        from bridge.job.staging import redact
        from bridge.store import SCHEMA_VERSION

        url = redact(self.config.database_url)
        fix = f"check `database` ({url}): the server must be up and the account may write it"
        try:
            store = self._store()
            with store.db.connection_context():
                if not store.db.table_exists("tasks"):
                    raise Failed(f"{url} has no tables", "run `tes-bridge init-db`")
                version = int(store.meta("schema_version") or 0)
                lacking = [] if store.is_sqlite else self._lacking_privileges(store)
        except FileNotFoundError:
            raise Failed(
                f"{url}: the database file does not exist",
                f"run `tes-bridge init-db` as {self.account.name} (or start the service)",
            ) from None
        except Failed:
            raise
        except Exception as exc:
            raise Failed(f"{url}: {' '.join(str(exc).split())[:300]}", fix) from None
        if version > SCHEMA_VERSION:
            raise Failed(
                f"{url} has schema version {version}, newer than this tes-bridge's "
                f"({SCHEMA_VERSION})",
                "run the tes-bridge release that made it, or a newer one",
            )
        if lacking:
            raise Failed(f"the database user may not {'; '.join(lacking)}", fix)
        if store.is_sqlite:
            self._sqlite_writable(Path(url.partition(":///")[2]))
        schema = f"schema version {version}"
        if version < SCHEMA_VERSION:
            schema += (
                f", upgraded to {SCHEMA_VERSION} by `tes-bridge init-db` or the service's start"
            )
        return f"{url} reachable, writable by {self.account.name}; {schema}"

    @staticmethod
    def _lacking_privileges(store: Store) -> list[str]:
        lacking = []
        for table, privileges in _WRITTEN_TABLES.items():
            for privilege in privileges:
                held = store._sql(
                    "SELECT has_table_privilege(%s, %s)", [table, privilege]
                ).fetchone()[0]
                if not held:
                    lacking.append(f"{privilege} {table}")
        return lacking

    def _sqlite_writable(self, path: Path) -> None:
        name = self.account.name
        for each in (path.parent, path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            if each.exists() and not may(self.account, each, 2):
                raise Failed(
                    f"{name} cannot write {each}",
                    f"`chown {name} {each}` (a file made by another account, e.g. root)",
                )

    def poller(self) -> str:
        """A poller runs: SQLite: a process holds the lock file; PostgreSQL: a node's poller
        holds the lease. Where this node's poller leads, its heartbeat is recent."""
        try:
            store = self._store()
            with store.db.connection_context():
                lease = store.lease_state()
        except Exception as exc:
            raise Failed(
                f"cannot read the database: {' '.join(str(exc).split())[:300]}",
                "see the database check",
            ) from None
        if lease is None:
            said, here = self._lock_holder(), True
        else:
            said = self._leader(lease)
            here = lease.holder is not None and lease.holder.startswith(self._node + " (")
        return said + (self._heartbeat() if here else "")

    @property
    def _node(self) -> str:
        return self.config.poller.node_name or socket.gethostname()

    def _lock_holder(self) -> str:
        from bridge.store import POLLER_LOCK, SQLITE_ONE_NODE

        lock = self.config.state_dir / POLLER_LOCK
        pid = flock_holder(lock)
        if pid is None:
            last = self._last_cycle()
            raise Failed(
                f"no poller runs for {self.config.state_dir} (no process holds {lock})"
                + (f"; the last cycle of one ended {last:.0f} s ago" if last is not None else ""),
                "start the poller: `systemctl start tes-bridge-poller` (or `tes-bridge serve`)",
            )
        return f"pid {pid} holds {lock} ({SQLITE_ONE_NODE.partition(' (')[0]})"

    @staticmethod
    def _leader(lease: LeaseState) -> str:
        if lease.holder is None or lease.age is None or lease.remaining is None:
            raise Failed(
                "no poller has led yet",
                "start the poller on a node: `systemctl start tes-bridge-poller` (or serve)",
            )
        if lease.remaining < 0:
            raise Failed(
                f"no poller leads: the lease of {lease.holder} (epoch {lease.epoch}) ended "
                f"{-lease.remaining:.1f} s ago",
                "start a poller (tes-bridge-poller.service, or serve) on a node",
            )
        return (
            f"{lease.holder} leads (epoch {lease.epoch}), renewed {lease.age:.1f} s ago, "
            f"ends in {lease.remaining:.1f} s"
        )

    def _last_cycle(self) -> float | None:
        """Seconds since this node's poller last ended a cycle (its heartbeat); None: none
        recorded (or metrics are off)."""
        from bridge.system.metrics import read_heartbeat

        if not self.config.metrics.enabled:
            return None
        beat = read_heartbeat(self.config.state_dir / "metrics")
        return None if beat is None else max(0.0, time.time() - beat)

    def _heartbeat(self) -> str:
        if not self.config.metrics.enabled:
            return "; its heartbeat is not recorded (metrics.enabled = false)"
        slurm = self.config.slurm
        # A cycle runs every poll_interval; a slow one waits out a few Slurm commands.
        stale = max(60.0, 10 * slurm.poll_interval + 2 * slurm.command_timeout)
        last = self._last_cycle()
        if last is None or last > stale:
            ended = (
                "has not ended a cycle" if last is None else f"last ended a cycle {last:.0f} s ago"
            )
            raise Failed(
                f"the poller runs but {ended} (a cycle every {slurm.poll_interval:g} s)",
                "read its log (journalctl -u tes-bridge-poller): Slurm commands or the "
                "database may hang; restart it",
            )
        return f"; its last cycle ended {last:.1f} s ago"


def flock_holder(path: Path) -> int | None:
    """The process that holds an flock(2) lock on `path`, read from /proc/locks: nothing is
    opened or locked (a lock taken to test it would turn away a poller starting then)."""
    try:
        info = path.stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return None
    wanted = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
    for line in locks.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (device numbers in hex)
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        major, minor, inode = fields[5].split(":")
        if (int(major, 16), int(minor, 16), int(inode)) == wanted:
            return int(fields[4])
    return None


class FilesystemChecks(CheckGroup):
    """The directories the service writes (work, image cache, metrics) and the ones it reads."""

    def _reach(self, path: Path) -> None:
        blocked = _reachable(self.account, path)
        if blocked is not None:
            raise Failed(
                f"{self.account.name} cannot reach {path}: {blocked} is not searchable",
                f"chmod o+x {blocked} (or give {self.account.name} a group that may search it)",
            )

    def _writable_dir(self, path: Path, key: str) -> None:
        name = self.account.name
        if not path.is_dir():
            raise Failed(
                f"{path} does not exist",
                f"create it, owned by {name} (`install -d -o {name} {path}`), or set {key}",
            )
        self._reach(path)
        if not may(self.account, path, 3):
            raise Failed(f"{name} cannot write {path}", f"`chown {name} {path}` (or set {key})")

    def work_dir(self) -> str:
        work = self.config.work_dir
        self._writable_dir(work, "job.work_dir")
        mode = stat.S_IMODE(work.stat().st_mode)
        if self.config.site.run_as_owner:
            # Owners create their task directories here; nobody may list or remove others'.
            if mode != 0o1733:
                raise Failed(
                    f"{work} has mode {mode:o}; site mode needs 1733",
                    f"chmod 1733 {work} (owners create their task directories in it)",
                )
        elif mode & 0o002 and not mode & stat.S_ISVTX:
            raise Failed(f"{work} is writable by everyone", f"chmod o-w {work}")
        self._try_write(work)
        return f"{work} writable by {self.account.name} (mode {mode:o})"

    def _try_write(self, directory: Path) -> None:
        if self.account.uid != os.geteuid():
            return  # another account's write cannot be tried from here: the mode bits said ok
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".check-"):
                pass
        except OSError as exc:
            message = f"cannot write in {directory}: {exc.strerror}"
            raise Failed(message, "check its filesystem (full, read-only?)") from None

    def image_cache(self) -> str:
        from bridge.images.sandboxes import image_format

        cache = self.config.image_cache_dir
        kind, why = image_format(self.config)
        runs_from = f"executors run from {'sandboxes' if kind == 'sandbox' else 'SIFs'} ({why})"
        if not cache.exists():
            # The poller creates it; its parent must let it.
            self._writable_dir(cache.parent, "container.cache_dir")
            return f"{cache} will be created by the poller; {runs_from}"
        self._writable_dir(cache, "container.cache_dir")
        return f"{cache} writable by {self.account.name}; {runs_from}"

    def metrics_dir(self) -> str:
        if not self.config.metrics.enabled:
            return "metrics are off (metrics.enabled = false)"
        directory = self.config.state_dir / "metrics"
        if not directory.exists():
            self._writable_dir(directory.parent, "state_dir")
            return f"{directory} will be created by serve"
        self._writable_dir(directory, "metrics.enabled = false to do without")
        return f"{directory} writable by {self.account.name}"

    def file_dirs(self) -> str:
        dirs = self.config.file_dirs
        for path in dirs:
            key = (
                "storage.shared_dirs"
                if path in self.config.storage.shared_dirs
                else ("storage.allowed_dirs")
            )
            if not path.is_dir():
                raise Failed(
                    f"{path} ({key}) does not exist",
                    f"create it on the shared filesystem, or remove it from {key}",
                )
            self._reach(path)
            if not may(self.account, path, 5):
                raise Failed(
                    f"{self.account.name} cannot read {path} ({key})",
                    f"let {self.account.name} read and search it (group or o+rx)",
                )
        return ", ".join(str(d) for d in dirs) + " present" if dirs else "none configured"


class SlurmChecks(CheckGroup):
    """slurmctld answers, its release, its RPC rate limit against the call budget, and job
    accounting (the poller follows jobs with sacct)."""

    def slurm(self) -> str:
        sinfo = self.config.slurm.sinfo
        out = _command(
            [sinfo, "-h", "-o", "%P %a"],
            self.config.slurm.command_timeout,
            "sinfo",
            "is slurmctld up and this host a Slurm client (SLURM_CONF, munge)? "
            "set the path in [slurm] sinfo if sinfo lives elsewhere",
        )
        partitions = [line.split()[0].rstrip("*") for line in out.splitlines() if line.strip()]
        if not partitions:
            raise Failed("sinfo lists no partition", "configure a partition in slurm.conf")
        transfer = self.config.staging.transfer_partition
        if self.config.staging.where == "transfer" and transfer and transfer not in partitions:
            raise Failed(
                f"staging.transfer_partition {transfer!r} is not a partition of this cluster "
                f"({', '.join(partitions)}): stage-in and stage-out jobs would be refused",
                "set staging.transfer_partition to the partition of the nodes with network",
            )
        return "slurmctld answers; partitions: " + ", ".join(partitions)

    def release(self) -> str:
        """The release of the Slurm commands (`sinfo -V`): a tested one or not, never a
        failure for that."""
        # Imported here: bridge.slurm loads the metrics, whose directory `check` never sets.
        from bridge.slurm import SlurmRelease, describe_tested, parse_version

        out = _command(
            [self.config.slurm.sinfo, "-V"],
            self.config.slurm.command_timeout,
            "sinfo -V",
            "is this host a Slurm client? set the path in [slurm] sinfo if sinfo lives elsewhere",
        )
        version = parse_version(out)
        printed = re.search(r"[0-9]+\.[0-9]+\S*", out)
        if version is None or printed is None:
            raise Failed(
                f"sinfo -V printed no Slurm version: {out.strip()[:200]!r}",
                "set [slurm] sinfo to Slurm's own sinfo",
            )
        tested = describe_tested()
        if SlurmRelease(version).tested:
            return f"Slurm {printed.group(0)}, a tested release (tested: {tested})"
        return (
            f"Slurm {printed.group(0)} is not a tested release (tested: {tested}): expected to "
            "work; report what does not"
        )

    def rate_limit(self) -> str:
        """slurmctld's RPC rate limit (`scontrol show config`), and whether the call budget
        fits under it: a budget that does not is lowered at the poller's start; none at all
        (calls_per_second = 0) fails, for an account the limit covers."""
        from bridge.slurm import exempt_because, parse_rate_limit, parse_slurm_user
        from bridge.system.budget import lower_of

        slurm = self.config.slurm
        out = _command(
            [slurm.scontrol, "show", "config"],
            slurm.command_timeout,
            "scontrol show config",
            "is slurmctld up and this host a Slurm client (SLURM_CONF, munge)? set the path in "
            "[slurm] scontrol if scontrol lives elsewhere",
        )
        limit = parse_rate_limit(out)
        if limit is None:
            return "slurmctld limits no user's RPC rate (no rate limit in SlurmctldParameters)"
        said = (
            f"slurmctld limits each user's RPCs (rl_enable): {limit} "
            f"({limit.per_second:g} calls/s, bursts of {limit.safe_burst} fit)"
        )
        name = self.account.name
        slurm_user = parse_slurm_user(out)
        exempt = exempt_because(self.account.uid, name, slurm_user)
        if exempt is not None:
            return f"{said}; not for {name}: {exempt}, so the call budget is not lowered to it"
        setting = (slurm.calls_per_second, slurm.calls_burst)
        fix = (
            f"set slurm.calls_per_second to at most {limit.per_second:g} and "
            f"slurm.calls_burst to at most {limit.safe_burst}"
        )
        covered = f"{name} is neither root nor SlurmUser ({slurm_user or 'unknown'})"
        if setting[0] <= 0:
            raise Failed(
                f"{said}; {covered}, and slurm.calls_per_second = 0 sets no call budget: "
                "slurmctld would slow the poller's commands past slurm.command_timeout",
                fix,
            )
        current = f"slurm.calls_per_second = {setting[0]:g}, calls_burst = {setting[1]}"
        if setting[0] <= limit.per_second and setting[1] <= limit.safe_burst:
            return f"{said}; {covered}: {current} fit under it"
        rate, burst = lower_of(*setting, limit.per_second, limit.safe_burst)
        return (
            f"{said}; {covered}: {current} do not fit under it; the poller lowers its budget "
            f"to {rate:g} calls/s, bursts of {burst}, at start"
        )

    def sacct(self) -> str:
        _command(
            [self.config.slurm.sacct, "-n", "-X", "-S", "now-1hours", "-o", "JobID"],
            self.config.slurm.command_timeout,
            "sacct",
            "the poller needs job accounting: set AccountingStorageType=accounting_storage/"
            "slurmdbd in slurm.conf with slurmdbd running, or the path in [slurm] sacct",
        )
        return "job accounting answers"


class RuntimeChecks(CheckGroup):
    """The container runtime pulls an image and runs it with the configured flags."""

    def __init__(self, config: Config, account: Account, image: str) -> None:
        super().__init__(config, account)
        self.image = image

    def apptainer(self) -> str:
        from bridge.images.cache import ImageCache
        from bridge.images.ref import ImagePullError

        container = self.config.container
        runtime = shutil.which(container.runtime)
        if runtime is None:
            raise Failed(
                f"{container.runtime} not found on PATH",
                "install Apptainer, or set container.runtime to its path",
            )
        with contextlib.ExitStack() as stack:
            # A cache of its own, removed after: nothing is written into the service's (as
            # root, files there would not be the service's).
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="tes-check-"))
            cached = container.model_copy(update={"cache_dir": Path(scratch)})
            config = self.config.model_copy(update={"container": cached})
            cache = ImageCache(config, max_workers=1)
            stack.callback(cache.close)
            try:
                sif = cache.pull(self.image)
            except ImagePullError as exc:
                raise Failed(
                    f"cannot get image {self.image}: {exc}",
                    "check container.default_registry and insecure_registries, or give a "
                    "reachable image with --image",
                ) from None
            self._run_image(runtime, sif)
        return f"{container.runtime} ran {self.image}"

    def _run_image(self, runtime: str, sif: Path) -> None:
        container = self.config.container
        argv = [
            runtime,
            *container.global_flags,
            "exec",
            *container.exec_flags,
            *container.extra_flags,
            *container.isolation_flags,
            str(sif),
            "true",
        ]
        _command(
            argv,
            container.pull_timeout_seconds,
            f"{container.runtime} exec {self.image}",
            "check container.exec_flags/extra_flags (e.g. --userns where setuid is not "
            "installed) and that user namespaces are enabled",
        )


def admins(config: Config) -> str:
    """The administrators exist: in site mode every caller, an admin too, must be a local
    user (else every request of theirs is refused), and an admin group must exist."""
    auth = config.auth
    if auth.mode == "none":
        return "authentication is off (auth.mode = none): every caller may do everything"
    if auth.admin_group:
        try:
            grp.getgrnam(auth.admin_group)
        except KeyError:
            raise Failed(
                f"auth.admin_group {auth.admin_group!r} is not a group on this host",
                f"create it (`groupadd {auth.admin_group}`) or correct auth.admin_group",
            ) from None
    if config.site.run_as_owner:
        missing = [user for user in auth.admin_users if not _local_user(user)]
        if missing:
            raise Failed(
                f"auth.admin_users {', '.join(map(repr, missing))} "
                f"{'is not a local user' if len(missing) == 1 else 'are not local users'}: "
                "in site mode their requests are refused (403)",
                "create the users on this host, or correct auth.admin_users",
            )
    group = f"; group {auth.admin_group}" if auth.admin_group else ""
    return f"{', '.join(auth.admin_users) or 'no admin users'}{group}"


def _local_user(name: str) -> bool:
    try:
        return pwd.getpwnam(name).pw_uid != 0
    except KeyError:
        return False


def _names_program(listing: str, program: str) -> bool:
    """Whether a sudo listing names `program` by any path to the same file: sudo compares the
    files, so a rule may name a link or its target."""
    name = os.path.basename(program)
    for word in re.split(r"[\s,]+", listing):
        if word.startswith("/") and os.path.basename(word) == name:
            with contextlib.suppress(OSError):
                if os.path.samefile(word, program):
                    return True
    return False


class SiteChecks(CheckGroup):
    """Site mode: the sudo rules that let the service act as task owners, and no more."""

    def sudo_rule(self) -> str:
        sudo = self.config.site.sudo
        listing = [sudo, "-n", "-l"]
        if os.geteuid() == 0:
            listing += ["-U", self.account.name]
        fix = (
            f"install deploy/sudoers.tes-bridge as /etc/sudoers.d/tes-bridge (mode 0440) with "
            f"the paths of this host, for {self.account.name}"
        )
        out = _command(listing, self.config.slurm.command_timeout, "sudo -l", fix)
        # The rule's regular expressions escape `.` and the like: compare without backslashes.
        plain = out.replace("\\", "")
        python, work = self.config.job.python, self.config.work_dir
        wanted = {
            "sbatch": "sbatch --parsable",
            "scancel": "scancel",
            f"{python} -m bridge.job adopt --work-dir {work}": (
                f"{python} ^-m bridge.job adopt --work-dir {work} "
            ),
            f"{python} -m bridge.job read-records --work-dir {work}": (
                f"{python} ^-m bridge.job read-records --work-dir {work} "
            ),
        }
        missing = [shown for shown, text in wanted.items() if text not in plain]
        if missing:
            raise Failed(
                f"the sudo rules of {self.account.name} allow no {'; no '.join(missing)} "
                "(job.python and job.work_dir must be the rule's paths)",
                fix,
            )
        # Here, not at the top: bridge.slurm imports prometheus_client, which must wait for the
        # metrics directory (bridge.system.metrics).
        from bridge.slurm.client import on_path

        for program in (on_path(self.config.slurm.sbatch), on_path(self.config.slurm.scancel)):
            if not _names_program(plain, program):
                raise Failed(
                    f"the sudo rules of {self.account.name} name another "
                    f"{os.path.basename(program)} than {program}, which the service runs "
                    "through sudo",
                    f"write {program} in the rule (`command -v {os.path.basename(program)}` "
                    f"as {self.account.name}), or set slurm.{os.path.basename(program)} to "
                    "the rule's path",
                )
        compact = out.replace(" ", "")
        if "(root)" in compact or "(ALL)" in compact:
            raise Failed(f"{self.account.name} may run commands as root", fix)
        return f"{self.account.name} may run sbatch, scancel and bridge.job as task owners"


class Doctor:
    """Runs the checks, in the order a site sets things up."""

    def __init__(
        self,
        config: Config,
        *,
        image: str,
        account: Account | None = None,
        job_timeout: float | None = None,
    ) -> None:
        self.config = config
        self.image = image
        self.account = account or service_account(config)
        #: --job: how long the compute node's job may take; None: no job.
        self.job_timeout = job_timeout

    def checks(self) -> list[tuple[str, Callable[[], str]]]:
        config, account = self.config, self.account
        files = FilesystemChecks(config, account)
        slurm = SlurmChecks(config, account)
        store = StoreChecks(config, account)
        checks: list[tuple[str, Callable[[], str]]] = [
            ("database", store.database),
            ("admins", lambda: admins(config)),
            ("poller", store.poller),
            ("work dir", files.work_dir),
            ("image cache", files.image_cache),
            ("metrics dir", files.metrics_dir),
            ("file dirs", files.file_dirs),
            ("slurm", slurm.slurm),
            ("slurm release", slurm.release),
            ("slurm rate limit", slurm.rate_limit),
            ("sacct", slurm.sacct),
            ("apptainer", RuntimeChecks(config, account, self.image).apptainer),
        ]
        if config.site.run_as_owner:
            checks.append(("sudo rule", SiteChecks(config, account).sudo_rule))
        if self.job_timeout is not None:
            from bridge.cli.check_job import NodeJob

            job = NodeJob(config, account.name, account.uid, timeout=self.job_timeout)
            checks.append(("compute node", lambda: _failing(job.run)))
        return checks

    def run(self) -> Iterator[Result]:
        for name, check in self.checks():
            try:
                yield Result(name, True, check())
            except Failed as exc:
                yield Result(name, False, str(exc), exc.fix)


def _failing(check: Callable[[], str]) -> str:
    """A check of another module, whose failures are (message, fix) pairs."""
    from bridge.cli.check_job import JobFailed

    try:
        return check()
    except JobFailed as exc:
        raise Failed(str(exc), exc.fix) from None
