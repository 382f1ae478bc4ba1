"""Container image references -> SIF files in a shared cache, pulled off the submit path.

The poller calls `ImageCache.ensure(image)` for each executor image of a task it wants to
submit: a ready SIF comes back at once; otherwise one background job per image starts and
`None` comes back, so a slow pull never holds up the poll loop or other tasks.

Freshness. Each reference has an entry (`refs/<hash>.json`) naming its manifest digest and its
SIF. SIFs are content-addressed (`<name>-<digest>.sif`): a tag that moves gets a new file, and
the old one stays for the jobs that still use it until `prune` finds no unfinished task older
than the moment it stopped being used. A tag is checked again (one HEAD request for the
manifest, through python-dxf) after `container.refresh_seconds` and pulled again only when its
digest changed; the pull names the digest, so the SIF is exactly the image that was checked. An
`@sha256:` reference is never checked again; `library://` references are cached by name.
While a check runs the task waits (a task submitted after the tag moved gets the new image),
except when the registry is known to be unreachable: then the cached SIF is used.

Failures. An image or tag that does not exist is permanent: `ImagePullError` (the poller fails
the task), remembered for `failure_ttl` seconds. A registry that is down, refuses, answers 5xx or
stalls, and a full cache disk, are transient: the tasks stay QUEUED, `problem(image)` says why
(for system_logs), and the job is tried again after a back-off that starts at 2 s. A pull that
takes longer than `container.pull_timeout_seconds` is killed with its process group.

Sandboxes. With `container.image_format` sandbox (or auto, see `image_format`), each SIF is
also unpacked once (`apptainer build --sandbox`) into `<stem>.sandbox/` beside it, in the
background: executors start from the directory once it is there and from the SIF until then. A
sandbox is built under a temporary name and renamed, so a directory under the final name is
always whole; it goes with its SIF when `prune` removes that.

Pulls go through spython's `Client.pull`, pointed at the configured runtime binary. Files are
pulled to a temporary name and renamed, so a SIF in the cache is always complete; an `fcntl`
lock per reference keeps two processes (the poller and `tes-bridge images pull`) from pulling
the same image at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests
from dxf import DXF, DXFBase
from spython.main import Client as _spython_client

from bridge.config import Config
from bridge.core.tes import local_image_problem
from bridge.images import ref as imageref
from bridge.images.ref import DIGEST, DOCKER_HUB
from bridge.images.ref import ImagePullError as ImagePullError
from bridge.system import metrics, proc

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: Registry answers and pull errors that say "try again later", not "no such image".
_TRANSIENT = re.compile(
    r"connection refused|connection reset|no route to host|network is unreachable|"
    r"i/o timeout|timed? ?out|temporary failure|tls handshake|no space left|disk quota|"
    r"too many requests|service unavailable|bad gateway|gateway time|internal server error|"
    r"unexpected eof|\b(?:429|500|502|503|504)\b",
    re.IGNORECASE,
)
#: Back-off of transient failures: 2, 4, 8, 16, 30, 30 ... seconds.
RETRY_FIRST = 2.0
RETRY_MAX = 30.0
#: A registry's answer to one manifest check takes at most this long (or the pull timeout).
REGISTRY_TIMEOUT = 30.0


# Looked up here, not in the forked child (dlopen after fork is unsafe with threads).
try:
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:
    """In the pull child: SIGKILL when the thread that started it ends, e.g. with a poller
    killed by SIGKILL (no orphan pulls)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# spython is untyped ([tool.mypy] in pyproject.toml): its client class is Any to mypy.
class _RuntimeClient(type(_spython_client)):  # type: ignore[misc]
    """spython's client, running the configured runtime with our environment and timeout."""

    def __init__(self, runtime: str, pull_flags: list[str], env: dict[str, str], timeout: float):
        super().__init__()
        self.quiet = True
        self._runtime = runtime
        self._pull_flags = pull_flags
        self._env = env
        self._timeout = timeout

    def _init_command(self, action: Any, flags: Any = None) -> list[str]:
        cmd: list[str] = super()._init_command(action, flags)
        cmd[0] = self._runtime  # spython hard-codes "singularity"
        if action == "pull":
            at = cmd.index("pull") + 1
            cmd[at:at] = self._pull_flags
        return cmd

    def _run_command(self, cmd: list[str], *args: Any, **kwargs: Any) -> str:
        # A session of its own: a stalled pull is killed with everything it started.
        proc = subprocess.Popen(
            cmd,
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            stdout, stderr = proc.communicate(timeout=self._timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise _Transient(
                f"the pull stalled: no result after {self._timeout:.0f} s "
                "(container.pull_timeout_seconds); killed it"
            ) from None
        if proc.returncode != 0:
            text = (stderr.strip() or stdout.strip())[-2000:]
            message = f"{os.path.basename(cmd[0])} exited {proc.returncode}: {text}"
            if _TRANSIENT.search(text):
                # Said in system_logs on every retry: the end of the message is enough.
                raise _Transient(_short(message[:60] + " … " + text[-240:], 320))
            raise _PullFailed(message)
        return stdout


class _PullFailed(Exception):
    pass


class _Transient(Exception):
    """The registry or the cache cannot serve the image now; try again later."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


#: Filesystems a sandbox (thousands of small files) is read quickly from. On a shared one
#: (NFS, Lustre, GPFS, BeeGFS, ...) every executor start would cost its metadata servers a
#: lookup per file, where a SIF costs one open.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs"})
#: A sandbox build is killed past this (the SIF keeps serving); a leftover temporary
#: directory older than this is removed by `prune`.
SANDBOX_BUILD_TIMEOUT = 3600.0


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` (or its nearest existing parent) is on; "" if unknown."""
    target = Path(os.path.realpath(path))
    while not target.exists() and target != target.parent:
        target = target.parent
    best, kind = "", ""
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            inside = target == Path(point) or target.is_relative_to(point)
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def image_format(config: Config) -> tuple[str, str]:
    """("sif" or "sandbox", why) for `container.image_format`."""
    chosen = config.container.image_format
    if chosen != "auto":
        return chosen, "container.image_format"
    if config.site.run_as_owner:
        return "sif", (
            "site mode: owners could not read every file of a sandbox the service account unpacked"
        )
    kind = filesystem_type(config.image_cache_dir)
    if kind not in LOCAL_FILESYSTEMS:
        return "sif", f"the image cache is on {kind or 'an unknown filesystem'}, not a local one"
    return "sandbox", f"the image cache is on a local filesystem ({kind})"


def sandbox_of(sif: Path) -> Path:
    """Where the sandbox of a cached SIF is (or would be)."""
    return sif.with_name(f"{sif.stem}.sandbox")


@dataclass
class Entry:
    """What the cache knows of one reference (stored as `refs/<hash>.json`)."""

    reference: str
    sif: str
    digest: str | None = None
    checked_at: float = 0.0
    pulled_at: float = 0.0


@dataclass
class _Retry:
    at: float
    message: str
    attempts: int
    delay: float


class ImageCache:
    """Image reference -> SIF path in `config.image_cache_dir`: what the cache holds, whether it
    is fresh, and the update job (check the digest, pull the SIF, record it) that `PullJobs`
    runs in the background."""

    def __init__(
        self,
        config: Config,
        *,
        max_workers: int = 2,
        failure_ttl: float | None = None,
        on_pulled: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.cache_dir = Path(config.image_cache_dir)
        self.refs_dir = self.cache_dir / "refs"
        self.refresh_seconds = config.container.refresh_seconds
        self._index = _Index(self.cache_dir)
        self._registry = _Registry(config)
        self._runtime = _Runtime(config, self.cache_dir)
        self.format, self.format_reason = image_format(config)
        self._sandboxes = (
            _Sandboxes(self._runtime, self._index) if self.format == "sandbox" else None
        )
        self.jobs = PullJobs(
            self._update,
            self._cached,
            max_workers=max_workers,
            failure_ttl=config.container.pull_failure_ttl if failure_ttl is None else failure_ttl,
            on_pulled=on_pulled,
        )

    def normalize(self, image: str) -> str:
        """The full reference the runtime pulls (or the absolute path of a local SIF)."""
        return imageref.normalize(image, self.config.container.default_registry)

    def key(self, image: str) -> str:
        """Name of the reference's entry in the cache (a hash of the full reference)."""
        return imageref.key(self.normalize(image))

    # ------------------------------------------------------------------ the poller's calls

    def ensure(self, image: str) -> Path | None:
        """The SIF when ready; else start (at most) one background job and return None.

        Raises ImagePullError for an invalid reference, a local SIF outside
        `container.local_image_dirs`, or an image that does not exist (for `failure_ttl`).
        """
        ref = self.normalize(image)
        if ref.startswith("/"):
            return self._local(image)
        sif = self.jobs.ensure(image, ref)
        if sif is None or self._sandboxes is None:
            return sif
        return self._sandboxes.ensure(sif)

    def resolve(self, images: Iterable[str]) -> dict[str, str] | None:
        """`image -> SIF path` for every image once all are ready, else None (pulls started)."""
        paths: dict[str, str] = {}
        ready = True
        for image in dict.fromkeys(images):
            path = self.ensure(image)
            if path is None:
                ready = False
            else:
                paths[image] = str(path)
        return paths if ready else None

    def problem(self, image: str) -> str | None:
        """Why `image` is not ready yet when it is a transient failure (for system_logs)."""
        with contextlib.suppress(ImagePullError):
            return self.jobs.problem(image, self.key(image))
        return None

    def pull(self, image: str, timeout: float | None = None, *, check: bool = False) -> Path:
        """Blocking: the image's SIF (for tools and tests). `check` asks the registry even
        when the entry is fresh. Transient failures are raised too, as ImagePullError."""
        ref = self.normalize(image)
        if ref.startswith("/"):
            return self._local(image)
        limit = timeout or self.config.container.pull_timeout_seconds + REGISTRY_TIMEOUT + 60
        sif = self.jobs.wait(image, ref, time.monotonic() + limit, check=check)
        if self._sandboxes is None:
            return sif
        return self._sandboxes.build(sif)

    def close(self) -> None:
        self.jobs.close()
        if self._sandboxes is not None:
            self._sandboxes.close()

    # ------------------------------------------------------------------ operators' calls

    def entries(self) -> list[Entry]:
        return self._index.entries()

    def forget(self, image: str) -> bool:
        """Drop the reference's entry: the next use checks the registry and pulls again.
        Its SIF goes with the next `prune` that finds no task that could still use it."""
        key = self.key(image)
        with self._index.locked(".cache.lock"):
            self._index.uncache(key)
            self.jobs.forget(key)
            return self._index.remove(key)

    def prune(self, oldest_unfinished: float | None) -> tuple[list[Path], list[Path]]:
        """See `_Index.prune`."""
        return self._index.prune(oldest_unfinished)

    # ------------------------------------------------------------------ what is cached

    def _local(self, image: str) -> Path:
        dirs = [str(d) for d in self.config.container.local_image_dirs]
        problem = local_image_problem(image, dirs)
        if problem:
            raise ImagePullError(image, problem)
        return Path(os.path.realpath(image))

    def _cached(self, key: str) -> tuple[Path | None, bool]:
        """The key's SIF if it is on disk (else None), and whether it is fresh."""
        entry = self._index.read(key)
        sif = self.cache_dir / entry.sif if entry is not None else None
        if sif is None or not sif.is_file():
            return None, False
        return sif, not self._stale(entry)

    def _stale(self, entry: Entry | None) -> bool:
        if entry is None or entry.digest is None:
            return entry is None
        if imageref.digest_of(entry.reference):
            return False  # a digest reference never changes
        return time.time() - entry.checked_at >= self.refresh_seconds

    # ------------------------------------------------------------------ the job itself

    def _update(self, ref: str, key: str, check: bool) -> Entry:
        """Check the reference's digest, pull its SIF when missing, write its entry."""
        runtime = self.config.container.runtime
        if shutil.which(runtime) is None:
            raise ImagePullError(
                ref,
                f"{runtime} not found on PATH; set container.runtime in the config or install "
                "Apptainer",
            )
        try:
            with self._index.locked(f"{key}.lock"):
                # Another process may have done it meanwhile.
                entry = self._index.read(key)
                if (
                    entry is not None
                    and not check
                    and not self._stale(entry)
                    and (self.cache_dir / entry.sif).is_file()
                ):
                    return entry
                digest = imageref.digest_of(ref) if imageref.is_registry(ref) else None
                if digest is None and imageref.is_registry(ref):
                    digest = self._registry.resolve_digest(ref)
                sif = self.cache_dir / imageref.sif_name(ref, digest)
                pulled_at = entry.pulled_at if entry is not None and entry.sif == sif.name else 0.0
                if not sif.is_file():
                    # Two tags of one digest share the file: one pull of it at a time too.
                    with self._index.locked(f"{sif.name}.lock"):
                        if not sif.is_file():
                            self._runtime.pull(imageref.pinned(ref, digest) if digest else ref, sif)
                            pulled_at = time.time()
                if entry is not None and entry.sif != sif.name:
                    log.info("image %s changed: %s -> %s", ref, entry.digest, digest)
                now = time.time()
                new = Entry(ref, sif.name, digest, checked_at=now, pulled_at=pulled_at or now)
                self._index.write(key, new)
                return new
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _Transient(f"the image cache is full ({exc.strerror})") from None
            raise ImagePullError(ref, f"image cache: {exc}") from None


class PullJobs:
    """The background update jobs: at most one per reference at a time, started off the
    caller's thread; how each ended (a missing image is remembered for `failure_ttl`, transient
    trouble is tried again after a back-off); and waiting for one with a deadline."""

    def __init__(
        self,
        job: Callable[[str, str, bool], Entry],
        cached: Callable[[str], tuple[Path | None, bool]],
        *,
        max_workers: int,
        failure_ttl: float,
        on_pulled: Callable[[], None] | None,
    ) -> None:
        #: (ref, key, check) -> the new entry; runs in a pool thread.
        self._job = job
        #: key -> (the SIF on disk or None, whether it is fresh).
        self._cached = cached
        self.failure_ttl = failure_ttl
        #: Called (from the pull thread) when a job ends, so a waiting poller can wake up.
        self.on_pulled = on_pulled
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="image-pull")
        #: Guards the dicts below. Never held while calling out (callbacks, pulls, requests).
        self._lock = threading.Lock()
        self._pending: dict[str, Future[Entry]] = {}
        self._failures: dict[str, tuple[float, str]] = {}
        self._retries: dict[str, _Retry] = {}
        #: key -> reference, for log lines.
        self._names: dict[str, str] = {}

    def ensure(self, image: str, ref: str) -> Path | None:
        """See `ImageCache.ensure`, for a normalised registry or library reference."""
        key = imageref.key(ref)
        with self._lock:
            future = self._pending.get(key)
            if future is not None and future.done():
                self._collect(key, future)
                future = None
            failed = self._failures.get(key)
            if failed and time.monotonic() - failed[0] < self.failure_ttl:
                raise ImagePullError(image, failed[1])
            sif, fresh = self._cached(key)
            if sif is not None and fresh:
                return sif
            retry = self._retries.get(key)
            # While the registry cannot be reached, a cached SIF serves rather than stalling work.
            fallback = sif if retry is not None else None
            if future is not None or (retry is not None and time.monotonic() < retry.at):
                return fallback
            future = self._start(ref, key, check=False)
        # Outside the lock: the callback runs at once, in this thread, if the job already ended.
        future.add_done_callback(self._wake)
        return fallback

    def problem(self, image: str, key: str) -> str | None:
        with self._lock:
            retry = self._retries.get(key)
        if retry is None:
            return None
        # The same words until the next attempt: the poller stores them on change.
        return f"pulling image {image}: {retry.message}; retrying in {retry.delay:.0f} s"

    def wait(self, image: str, ref: str, deadline: float, *, check: bool) -> Path:
        """Blocking: the SIF once a job made it ready, by `deadline` (monotonic)."""
        key = imageref.key(ref)
        if check:
            with self._lock:
                future = self._pending.get(key)
                if future is None or future.done():
                    if future is not None:
                        self._collect(key, future)
                    self._failures.pop(key, None)
                    future = self._start(ref, key, check=True)
            future.add_done_callback(self._wake)
        while True:
            with self._lock:
                future = self._pending.get(key)
            if future is not None:
                try:
                    future.result(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise ImagePullError(image, "timed out waiting for the pull") from None
                except Exception as exc:
                    with self._lock:
                        if self._pending.get(key) is future:
                            self._collect(key, future)
                    reason = exc.reason if isinstance(exc, ImagePullError) else str(exc)
                    raise ImagePullError(image, reason) from None
            path = self.ensure(image, ref)
            if path is not None:
                return path
            if time.monotonic() > deadline:
                raise ImagePullError(image, "timed out waiting for the pull")
            if future is None:
                time.sleep(0.1)

    def forget(self, key: str) -> None:
        with self._lock:
            self._failures.pop(key, None)
            self._retries.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self, ref: str, key: str, *, check: bool) -> Future[Entry]:
        """Submit the job (caller holds the lock)."""
        future = self._pool.submit(self._job, ref, key, check)
        self._pending[key] = future
        self._names[key] = ref
        return future

    def _collect(self, key: str, future: Future[Entry]) -> None:
        """Record how a finished job ended (caller holds the lock)."""
        del self._pending[key]
        exc = future.exception() if not future.cancelled() else None
        if exc is None:
            self._retries.pop(key, None)
            self._failures.pop(key, None)
            return
        metrics.IMAGE_PULL_FAILURES.inc()  # the digest check or the pull
        if isinstance(exc, ImagePullError):
            self._retries.pop(key, None)
            self._failures[key] = (time.monotonic(), exc.reason)
            log.warning("image pull failed: %s", exc)
            return
        message = exc.message if isinstance(exc, _Transient) else f"unexpected error: {exc!r}"
        previous = self._retries.get(key)
        attempts = previous.attempts + 1 if previous else 1
        delay = min(RETRY_FIRST * 2 ** (attempts - 1), RETRY_MAX)
        self._retries[key] = _Retry(time.monotonic() + delay, message, attempts, delay)
        name = self._names.get(key, key)
        log.warning("image %s not available now (%s); retrying in %.0f s", name, message, delay)

    def _wake(self, future: Future[Entry]) -> None:
        # Takes no lock: it may run in ensure()'s thread (deadlock of defect 10).
        if self.on_pulled is not None:
            self.on_pulled()


class _Sandboxes:
    """Each cached SIF's sandbox: unpacked once, in the background, under the SIF's lock."""

    #: A failed build (e.g. a full disk) is tried again after this long; the SIF serves.
    RETRY_SECONDS = 3600.0

    def __init__(self, runtime: _Runtime, index: _Index) -> None:
        self._runtime = runtime
        self._index = index
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox")
        #: Guards the two below. Never held while building.
        self._lock = threading.Lock()
        self._building: set[Path] = set()
        self._failed: dict[Path, float] = {}

    def ensure(self, sif: Path) -> Path:
        """The SIF's sandbox when it is there; else the SIF, with a build started."""
        sandbox = sandbox_of(sif)
        if sandbox.is_dir():
            return sandbox
        with self._lock:
            failed = self._failed.get(sif)
            retry = failed is None or time.monotonic() - failed >= self.RETRY_SECONDS
            if sif not in self._building and retry:
                self._building.add(sif)
                self._pool.submit(self._build_in_background, sif)
        return sif

    def build(self, sif: Path) -> Path:
        """Blocking: the SIF's sandbox, unpacked now unless it is there; the SIF if that fails."""
        try:
            return self._build(sif)
        except (_SandboxFailed, OSError) as exc:
            log.warning("could not unpack %s; executors run from the SIF: %s", sif.name, exc)
            return sif

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _build_in_background(self, sif: Path) -> None:
        try:
            self.build(sif)
        finally:
            with self._lock:
                self._building.discard(sif)
                if not sandbox_of(sif).is_dir():
                    self._failed[sif] = time.monotonic()

    def _build(self, sif: Path) -> Path:
        sandbox = sandbox_of(sif)
        # The lock the SIF's pull takes: one build per SIF across all processes.
        with self._index.locked(f"{sif.name}.lock"):
            if not sandbox.is_dir():
                if not sif.is_file():
                    raise _SandboxFailed("the SIF is gone")
                started = time.monotonic()
                self._runtime.unpack(sif, sandbox)
                log.info("unpacked %s in %.1f s", sif.name, time.monotonic() - started)
        return sandbox


class _SandboxFailed(Exception):
    pass


class _Index:
    """The on-disk index: `refs/<key>.json` entries, the SIFs they name, and the `fcntl`
    locks all processes sharing the cache take."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.refs_dir = cache_dir / "refs"
        #: Entries read from disk, with the file's mtime (another process may rewrite one).
        self._read: dict[str, tuple[Entry, int]] = {}
        #: Guards `_read`: the poller's thread and the pull jobs read entries.
        self._read_lock = threading.Lock()

    def entries(self) -> list[Entry]:
        found = []
        for path in sorted(self.refs_dir.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, TypeError):
                found.append(Entry(**json.loads(path.read_text())))
        return found

    def read(self, key: str) -> Entry | None:
        """The key's entry, read again when its file changed."""
        with self._read_lock:
            return self._read_locked(key)

    def _read_locked(self, key: str) -> Entry | None:
        path = self.refs_dir / f"{key}.json"
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            self._read.pop(key, None)
            return None
        cached = self._read.get(key)
        if cached is not None and cached[1] == mtime:
            return cached[0]
        try:
            entry = Entry(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        self._read[key] = (entry, mtime)
        return entry

    def write(self, key: str, entry: Entry) -> None:
        self.refs_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.refs_dir / f".{key}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(json.dumps(asdict(entry)))
        # Under the prune lock: a SIF named by an entry is never removed.
        with self.locked(".cache.lock"):
            if not (self.cache_dir / entry.sif).is_file():
                tmp.unlink()
                raise _Transient("the SIF was removed while it was being recorded")
            (self.cache_dir / f".{entry.sif}.unused").unlink(missing_ok=True)
            os.replace(tmp, self.refs_dir / f"{key}.json")

    def uncache(self, key: str) -> None:
        with self._read_lock:
            self._read.pop(key, None)

    def remove(self, key: str) -> bool:
        """Delete the key's entry file (caller holds `.cache.lock`)."""
        try:
            (self.refs_dir / f"{key}.json").unlink()
        except FileNotFoundError:
            return False
        return True

    def prune(self, oldest_unfinished: float | None) -> tuple[list[Path], list[Path]]:
        """Delete SIFs no entry names, once no unfinished task is older than the first prune
        that saw them unused (a job only uses SIFs named when its task was created or later).

        `oldest_unfinished` is the creation time of the oldest unfinished task (None: none).
        Returns (deleted, kept for now)."""
        deleted: list[Path] = []
        kept: list[Path] = []
        if not self.cache_dir.is_dir():
            return deleted, kept
        with self.locked(".cache.lock"):
            used = {entry.sif for entry in self.entries()}
            for sif in sorted(self.cache_dir.glob("*.sif")):
                marker = self.cache_dir / f".{sif.name}.unused"
                if sif.name in used:
                    marker.unlink(missing_ok=True)
                    continue
                if not marker.exists():
                    marker.touch()
                    kept.append(sif)
                    continue
                since = marker.stat().st_mtime
                if oldest_unfinished is not None and oldest_unfinished <= since:
                    kept.append(sif)
                    continue
                # The sandbox first: a sandbox without its SIF is removed below anyway.
                shutil.rmtree(sandbox_of(sif), ignore_errors=True)
                sif.unlink(missing_ok=True)
                marker.unlink(missing_ok=True)
                deleted.append(sif)
                log.info("removed unused image %s", sif.name)
            self._prune_sandboxes()
        return deleted, kept

    def _prune_sandboxes(self) -> None:
        """Remove sandboxes whose SIF is gone and builds a dead process left behind."""
        for sandbox in self.cache_dir.glob("*.sandbox"):
            if not sandbox.with_name(f"{sandbox.name[: -len('.sandbox')]}.sif").is_file():
                shutil.rmtree(sandbox, ignore_errors=True)
        for leftover in self.cache_dir.glob(".*.sandbox.*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - leftover.stat().st_mtime > SANDBOX_BUILD_TIMEOUT:
                    shutil.rmtree(leftover, ignore_errors=True)

    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """An exclusive `fcntl` lock on `<cache>/.locks/NAME`, shared by all processes."""
        locks = self.cache_dir / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / name, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


class _Registry:
    """The registry side: the manifest digest a reference's tag names now."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def resolve_digest(self, ref: str) -> str:
        """The manifest digest the registry gives the reference's tag now."""
        host, _, rest = ref.split("://", 1)[1].partition("/")
        name, _, tag = rest.rpartition(":")
        api_host = "registry-1.docker.io" if host in DOCKER_HUB else host
        insecure = host in self.config.container.insecure_registries
        timeout = min(REGISTRY_TIMEOUT, self.config.container.pull_timeout_seconds)
        client = DXF(api_host, name, auth=self._authenticate, insecure=insecure, timeout=timeout)
        try:
            digest, response = client.head_manifest_and_response(tag)
            if not digest:  # some registries leave the header out of HEAD answers
                _, response = client.get_manifest_and_response(tag)
                digest = "sha256:" + hashlib.sha256(response.content).hexdigest()
        except requests.HTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            where = f"{host}/{name}:{tag}"
            if status in (404, 400):
                raise ImagePullError(
                    ref, f"{where} does not exist (registry answered {status})"
                ) from None
            if status in (401, 403):
                raise ImagePullError(
                    ref, f"{where}: access denied or no such repository ({status})"
                ) from None
            raise _Transient(f"registry {host} answered {status}") from None
        except requests.Timeout:
            raise _Transient(
                f"registry {host} did not answer within {timeout:.0f} s "
                "(container.pull_timeout_seconds)"
            ) from None
        except (requests.ConnectionError, OSError) as exc:
            reason = exc.args[0] if exc.args else exc
            if "refused" in str(reason).lower():
                reason = "connection refused"
            raise _Transient(f"registry {host} unreachable ({_short(reason)})") from None
        if not re.fullmatch(DIGEST, digest):
            raise _Transient(f"registry {host} gave no usable digest for {name}:{tag}")
        return digest

    def _authenticate(self, client: DXFBase, response: requests.Response) -> None:
        """Token or basic authentication, with the runtime's own credential variables."""
        user = os.environ.get("APPTAINER_DOCKER_USERNAME") or os.environ.get(
            "SINGULARITY_DOCKER_USERNAME"
        )
        password = os.environ.get("APPTAINER_DOCKER_PASSWORD") or os.environ.get(
            "SINGULARITY_DOCKER_PASSWORD"
        )
        client.authenticate(user, password, response=response)


class _Runtime:
    """The runtime side: one `apptainer pull` into a SIF, under the pull timeout."""

    def __init__(self, config: Config, cache_dir: Path) -> None:
        self.config = config
        self.cache_dir = cache_dir

    def pull(self, ref: str, target: Path) -> None:
        runtime = self.config.container.runtime
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for sub in (".runtime-cache", ".tmp"):
            (self.cache_dir / sub).mkdir(mode=0o700, exist_ok=True)
        pull_flags = []
        if imageref.host(ref) in self.config.container.insecure_registries:
            pull_flags.append("--no-https")
        tmp = self.cache_dir / f".{target.stem}.{os.getpid()}.{threading.get_ident()}.sif"
        client = _RuntimeClient(
            runtime, pull_flags, self._environment(), self.config.container.pull_timeout_seconds
        )
        started = time.monotonic()
        metrics.IMAGE_PULLS.inc()
        try:
            client.pull(ref, name=str(tmp), force=True, quiet=True)
            if not tmp.is_file() or tmp.stat().st_size == 0:
                raise ImagePullError(ref, f"{runtime} reported success but wrote no image")
            os.chmod(tmp, 0o644)  # the compute nodes' jobs read it
            os.replace(tmp, target)
        except _PullFailed as exc:
            raise ImagePullError(ref, str(exc)) from None
        finally:
            if tmp.exists():
                tmp.unlink()
        log.info("pulled %s in %.1f s -> %s", ref, time.monotonic() - started, target)

    def unpack(self, sif: Path, sandbox: Path) -> None:
        """`build --sandbox` under a temporary name, renamed: a sandbox is whole or absent."""
        tmp = sandbox.with_name(f".{sandbox.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        runtime = self.config.container.runtime
        argv = [runtime, "--quiet", "build", "--sandbox", str(tmp), str(sif)]
        try:
            try:
                done = proc.run(argv, timeout=SANDBOX_BUILD_TIMEOUT, env=self._environment())
            except proc.CommandError as exc:
                raise _SandboxFailed(str(exc)) from None
            if done.returncode != 0 or not tmp.is_dir():
                raise _SandboxFailed(
                    f"{runtime} build --sandbox exited {done.returncode}: "
                    f"{_short(done.stderr or done.stdout)}"
                )
            os.chmod(tmp, 0o755)  # the compute nodes' jobs read it
            try:
                os.rename(tmp, sandbox)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _environment(self) -> dict[str, str]:
        runtime = os.path.basename(self.config.container.runtime)
        prefix = "SINGULARITY_" if "singularity" in runtime else "APPTAINER_"
        env = dict(os.environ)
        env.setdefault(prefix + "CACHEDIR", str(self.cache_dir / ".runtime-cache"))
        env.setdefault(prefix + "TMPDIR", str(self.cache_dir / ".tmp"))
        return env


def _short(value: object, limit: int = 200) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
