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
import os
import pwd
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bridge import config as config_module
from bridge.config import ENV_CONFIG, Config, ConfigError, load_config
from bridge.system.proc import CommandError, run


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check = commands.add_parser(
        "check",
        help="check this host's setup: config, database, directories, Slurm, Apptainer, sudo",
        description="Check that the configuration loads, the database takes writes, the work "
        "directory, image cache and file directories exist with the right permissions for the "
        "service account, sinfo and sacct answer, which Slurm release runs (tested or not) and "
        "whether the call budget fits under slurmctld's RPC rate limit, the container runtime "
        "runs an image, and (site mode) the sudo rule is installed. One line per check, with "
        "what to fix; exit status 1 when any check fails. Run it as the service account (as "
        "root, permissions are checked for the owner of the state directory).",
    )
    check.add_argument(
        "--image",
        default="alpine",
        help="image the runtime must run, as tasks name it (default: alpine, from "
        "container.default_registry)",
    )
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    # It loads the configuration itself: one that does not load is a failed check.
    check.set_defaults(run_unconfigured=check_command)


def config_file(given: str | None) -> str | None:
    """The file to check: --config, else $TES_BRIDGE_CONFIG, else the one the systemd units
    name (DEFAULT_CONFIG_FILE) when it exists; None: the defaults."""
    if given or os.environ.get(ENV_CONFIG):
        return given or os.environ.get(ENV_CONFIG)
    default = config_module.DEFAULT_CONFIG_FILE
    return str(default) if default.exists() else None


def check_command(args: argparse.Namespace) -> int:
    """One line per check (or JSON); 1 when any failed."""
    path = config_file(args.config)
    try:
        config = load_config(path)
    except ConfigError as exc:
        results = [Result("config", False, str(exc), "correct the configuration file")]
    else:
        where = path or (
            f"defaults: no --config, ${ENV_CONFIG} unset and no {config_module.DEFAULT_CONFIG_FILE}"
        )
        results = [Result("config", True, f"loaded ({where})")]
        results += Doctor(config, image=args.image).run()
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        for result in results:
            print(result.line(), flush=True)
    return 0 if all(r.ok for r in results) else 1


@dataclass
class Result:
    name: str
    ok: bool
    #: What was seen (ok), or what is wrong (failed).
    message: str
    #: How to fix it (failed checks only).
    fix: str = ""

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        text = f"{status}  {self.name}: {self.message}"
        return text + (f"\n      fix: {self.fix}" if self.fix else "")

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


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


def database(config: Config) -> str:
    """The database answers and takes writes."""
    from bridge.job.staging import redact
    from bridge.store import Store

    url = redact(config.database_url)
    fix = f"check `database` ({url}): the server must be up and the account may write it"
    try:
        store = Store.from_url(config.database_url)
        with store.db.connection_context():
            if not store.db.table_exists("tasks"):
                raise Failed(f"{url} has no tables", "run `tes-bridge init-db`")
            # A write that changes nothing, rolled back: the database takes writes.
            with store.db.atomic() as transaction:
                store._sql("UPDATE bridge_meta SET value = value WHERE key = 'schema_version'")
                transaction.rollback()
    except Failed:
        raise
    except Exception as exc:
        raise Failed(f"{url}: {' '.join(str(exc).split())[:300]}", fix) from None
    return f"{url} reachable and writable"


def poller_lease(config: Config) -> str:
    """Which node's poller leads (PostgreSQL), or that SQLite is one node only."""
    from bridge.store import SQLITE_ONE_NODE, Store

    store = Store.from_url(config.database_url)
    try:
        with store.db.connection_context():
            state = store.lease_state()
    except Exception as exc:
        raise Failed(
            f"cannot read the lease: {' '.join(str(exc).split())[:300]}",
            "see the database check; `tes-bridge init-db` creates the lease's table",
        ) from None
    if state is None:
        return SQLITE_ONE_NODE
    if state.holder is None or state.age is None or state.remaining is None:
        return "no poller has led yet (start `tes-bridge poller` or `serve`)"
    if state.remaining < 0:
        raise Failed(
            f"no poller leads: the lease of {state.holder} (epoch {state.epoch}) ended "
            f"{-state.remaining:.1f} s ago",
            "start a poller (tes-bridge-poller.service, or serve) on a node",
        )
    return (
        f"{state.holder} leads (epoch {state.epoch}), renewed {state.age:.1f} s ago, "
        f"ends in {state.remaining:.1f} s"
    )


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
            config = self.config
            if self.account.uid != os.geteuid():
                # Files this process made in the service's cache would not be the service's.
                scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="tes-check-"))
                cached = container.model_copy(update={"cache_dir": Path(scratch)})
                config = config.model_copy(update={"container": cached})
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
        compact = out.replace(" ", "")
        if "(root)" in compact or "(ALL)" in compact:
            raise Failed(f"{self.account.name} may run commands as root", fix)
        return f"{self.account.name} may run sbatch, scancel and bridge.job as task owners"


class Doctor:
    """Runs the checks, in the order a site sets things up."""

    def __init__(self, config: Config, *, image: str, account: Account | None = None) -> None:
        self.config = config
        self.image = image
        self.account = account or service_account(config)

    def checks(self) -> list[tuple[str, Callable[[], str]]]:
        config, account = self.config, self.account
        files = FilesystemChecks(config, account)
        slurm = SlurmChecks(config, account)
        checks: list[tuple[str, Callable[[], str]]] = [
            ("database", lambda: database(config)),
            ("admins", lambda: admins(config)),
            ("poller lease", lambda: poller_lease(config)),
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
        return checks

    def run(self) -> Iterator[Result]:
        for name, check in self.checks():
            try:
                yield Result(name, True, check())
            except Failed as exc:
                yield Result(name, False, str(exc), exc.fix)
