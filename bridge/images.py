"""Container image references -> SIF files in a shared cache, pulled off the submit path.

The poller calls `ImageCache.ensure(image)` for each executor image of a task it wants to
submit: a ready SIF comes back at once; otherwise one background pull per image starts and
`None` comes back, so a slow pull never holds up the poll loop or other tasks. A failed pull is
remembered for `failure_ttl` seconds and raised as `ImagePullError` (the poller records the
message and fails the task) instead of being retried on every poll cycle.

Pulls go through spython's `Client.pull`, pointed at the configured runtime binary (spython
itself always runs `singularity`). Files are pulled to a temporary name and renamed, so a
SIF in the cache is always complete; an `fcntl` lock per image keeps two processes (two
pollers, or `tes-bridge` commands) from pulling the same image at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from spython.main import Client as _spython_client

from bridge.config import Config

log = logging.getLogger(__name__)

DOCKER_HUB = {"docker.io", "index.docker.io", "registry-1.docker.io"}

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_DOMAIN = rf"(?:{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?)"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(
    rf"^(?P<name>{_COMPONENT}(?:/{_COMPONENT})*)(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$"
)
_DOMAIN_RE = re.compile(rf"^{_DOMAIN}$")
_LIBRARY = re.compile(r"^[A-Za-z0-9._/:@-]+$")


class ImagePullError(Exception):
    """An image cannot be made available; the message says why (shown in system_logs)."""

    def __init__(self, image: str, message: str) -> None:
        # The poller prefixes "cannot pull image: ", so the message starts with the image.
        super().__init__(f"{image}: {message}")
        self.image = image
        self.reason = message


def _split_docker(rest: str, image: str, default_registry: str) -> tuple[str, str]:
    """`[domain/]path[:tag][@digest]` -> (domain, `path:tag` or `path@digest`)."""
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        domain, path = first, remainder
        if not _DOMAIN_RE.fullmatch(domain):
            raise ImagePullError(image, f"invalid registry name {domain!r}")
    else:
        domain, path = default_registry, rest
    match = _REFERENCE.fullmatch(path)
    if not match:
        raise ImagePullError(image, "not a valid image reference (expected [registry/]name[:tag])")
    name, tag, digest = match.group("name"), match.group("tag"), match.group("digest")
    if "/" not in name and (domain in DOCKER_HUB or domain == default_registry):
        name = f"library/{name}"  # official images live under library/
    if digest:
        ref = f"{name}:{tag}@{digest}" if tag else f"{name}@{digest}"
    else:
        ref = f"{name}:{tag or 'latest'}"
    return domain, ref


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
        try:
            proc = subprocess.run(
                cmd,
                env=self._env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=self._timeout,
            )
        except subprocess.TimeoutExpired:
            message = f"no result after {self._timeout:.0f} s (container.pull_timeout)"
            raise _PullFailed(message) from None
        if proc.returncode != 0:
            text = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
            raise _PullFailed(f"{os.path.basename(cmd[0])} exited {proc.returncode}: {text}")
        return proc.stdout


class _PullFailed(Exception):
    pass


class ImageCache:
    """Image reference -> SIF path in `config.image_cache_dir`."""

    def __init__(
        self,
        config: Config,
        *,
        max_workers: int = 2,
        failure_ttl: float = 300.0,
        on_pulled: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        #: Called (from the pull thread) when a pull ends, so a waiting poller can wake up.
        self.on_pulled = on_pulled
        self.cache_dir = Path(config.image_cache_dir)
        self.failure_ttl = failure_ttl
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="image-pull")
        self._lock = threading.Lock()
        self._pending: dict[str, Future[Path]] = {}
        self._failures: dict[str, tuple[float, str]] = {}

    # ------------------------------------------------------------------ names

    def normalize(self, image: str) -> str:
        """The full reference the runtime pulls (or the absolute path of a local SIF)."""
        if not isinstance(image, str) or not image or image != image.strip():
            raise ImagePullError(repr(image), "empty or padded image name")
        if image.startswith("/"):
            if not image.endswith(".sif") or os.path.normpath(image) != image:
                raise ImagePullError(image, "a local image must be a normalised path to a .sif")
            return image
        scheme, sep, rest = image.partition("://")
        if not sep:
            scheme, rest = "docker", image
        scheme = scheme.lower()
        if scheme == "docker":
            domain, ref = _split_docker(rest, image, self.config.container.default_registry)
            return f"docker://{domain}/{ref}"
        if scheme == "oras":
            domain, ref = _split_docker(rest, image, "")
            if not domain:
                raise ImagePullError(image, "an oras:// reference needs a registry")
            return f"oras://{domain}/{ref}"
        if scheme == "library":
            if not _LIBRARY.fullmatch(rest):
                raise ImagePullError(image, "not a valid library:// reference")
            return f"library://{rest}"
        raise ImagePullError(image, f"unsupported image scheme {scheme}:// (docker, oras, library)")

    def key(self, image: str) -> str:
        """File name of the image in the cache: readable stem + hash of the full reference."""
        ref = self.normalize(image)
        digest = hashlib.sha256(ref.encode()).hexdigest()[:24]
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", ref.rsplit("/", 1)[-1])[:48]
        return f"{stem}-{digest}.sif"

    def path_for(self, image: str) -> Path:
        ref = self.normalize(image)
        return Path(ref) if ref.startswith("/") else self.cache_dir / self.key(image)

    def _registry(self, ref: str) -> str:
        return ref.split("://", 1)[1].split("/", 1)[0]

    # ------------------------------------------------------------------ the poller's calls

    def ensure(self, image: str) -> Path | None:
        """The SIF when ready; else start (at most) one background pull and return None.

        Raises ImagePullError for an invalid reference, a missing local SIF, or a pull that
        failed less than `failure_ttl` seconds ago.
        """
        ref = self.normalize(image)
        if ref.startswith("/"):
            if os.path.isfile(ref):
                return Path(ref)
            raise ImagePullError(image, f"{ref} does not exist or is not a file")
        target = self.cache_dir / self.key(image)
        if target.is_file():
            return target
        with self._lock:
            future = self._pending.get(target.name)
            if future is not None and future.done():
                # Record here too: waiters can wake up before the done-callback has run.
                self._record_failure(target.name, future)
                del self._pending[target.name]
                future = None
            failed = self._failures.get(target.name)
            if failed and time.monotonic() - failed[0] < self.failure_ttl:
                raise ImagePullError(image, failed[1])
            if future is None and not target.is_file():
                self._failures.pop(target.name, None)
                future = self._pool.submit(self._pull, ref, target)
                future.add_done_callback(lambda f, key=target.name: self._done(key, f))
                self._pending[target.name] = future
        return target if target.is_file() else None

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

    def pull(self, image: str, timeout: float | None = None) -> Path:
        """Blocking: wait for the image (for tools and tests)."""
        deadline = time.monotonic() + (timeout or self.config.container.pull_timeout + 60)
        while True:
            path = self.ensure(image)
            if path is not None:
                return path
            with self._lock:
                future = self._pending.get(self.key(image))
            if future is not None:
                # A failure is raised by ensure() on the next turn, as ImagePullError.
                with contextlib.suppress(Exception):
                    future.result(timeout=max(0.0, deadline - time.monotonic()))
            elif time.monotonic() > deadline:
                raise ImagePullError(image, "timed out waiting for the pull")
            else:
                time.sleep(0.2)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the pull itself

    def _record_failure(self, key: str, future: Future[Path]) -> None:
        """Remember a finished pull's failure (caller holds the lock); idempotent."""
        exc = future.exception() if not future.cancelled() else None
        if exc is not None and key not in self._failures:
            reason = exc.reason if isinstance(exc, ImagePullError) else str(exc)
            self._failures[key] = (time.monotonic(), reason)
            log.warning("image pull failed: %s", exc)

    def _done(self, key: str, future: Future[Path]) -> None:
        if self.on_pulled is not None:
            self.on_pulled()
        self._record_done(key, future)

    def _record_done(self, key: str, future: Future[Path]) -> None:
        with self._lock:
            if self._pending.get(key) is future:
                self._record_failure(key, future)

    def _environment(self) -> dict[str, str]:
        runtime = os.path.basename(self.config.container.runtime)
        prefix = "SINGULARITY_" if "singularity" in runtime else "APPTAINER_"
        env = dict(os.environ)
        env.setdefault(prefix + "CACHEDIR", str(self.cache_dir / ".runtime-cache"))
        env.setdefault(prefix + "TMPDIR", str(self.cache_dir / ".tmp"))
        return env

    def _pull(self, ref: str, target: Path) -> Path:
        runtime = self.config.container.runtime
        if shutil.which(runtime) is None:
            raise ImagePullError(
                ref,
                f"{runtime} not found on PATH; set container.runtime in the config or install "
                "Apptainer",
            )
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        for sub in (".runtime-cache", ".tmp"):
            (self.cache_dir / sub).mkdir(mode=0o700, exist_ok=True)
        with open(self.cache_dir / f".{target.name}.lock", "a") as lock:
            # Blocks while another process pulls the same image; then its SIF is there.
            fcntl.flock(lock, fcntl.LOCK_EX)
            if target.is_file():
                return target
            pull_flags = []
            if self._registry(ref) in self.config.container.insecure_registries:
                pull_flags.append("--no-https")
            tmp = self.cache_dir / f".{target.stem}.{os.getpid()}.{threading.get_ident()}.sif"
            client = _RuntimeClient(
                runtime, pull_flags, self._environment(), self.config.container.pull_timeout
            )
            started = time.monotonic()
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
            return target
