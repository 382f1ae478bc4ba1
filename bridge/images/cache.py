"""Container image references -> SIF files in a shared cache, pulled off the submit path.

The poller calls `ImageCache.ensure(image)` for each executor image of a task it wants to
submit: a ready SIF comes back at once; otherwise one background job per image starts
(bridge.images.pulls) and `None` comes back, so a slow pull never holds up the poll loop or
other tasks.

Freshness. Each reference has an entry in the cache's index (bridge.images.index) naming its
digest and its SIF, whatever its source. A tag in an OCI registry (`docker://`, and `oras://`,
a SIF pushed as an OCI artifact) is checked again (bridge.images.registry) after
`container.refresh_seconds` and pulled again (bridge.images.runtime) only when its manifest
digest changed; the pull names the digest, so the SIF is exactly the image that was checked. A
`library://` reference has no registry to ask: it is pulled again after the same interval by the
runtime, which downloads it only when the library's image changed (its own cache, by the
library's hash), and its SIF is named by the sha256 of its content, so an image that changed gets
a new file, as a moved tag does. A pinned reference (`@sha256:`, a library's `:sha256.<hex>`) is
never checked again. While a check runs the task waits (a task submitted after the tag moved
gets the new image), except when the registry or library is known to be unreachable: then the
cached SIF is used.

With `container.image_format` sandbox, executors start from each SIF's unpacked sandbox once it
is there (bridge.images.sandboxes).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bridge.config import Config
from bridge.core.tes import local_image_problem
from bridge.images import ref as imageref
from bridge.images.failures import Transient
from bridge.images.index import Entry, Index
from bridge.images.pulls import PullJobs
from bridge.images.ref import ImagePullError
from bridge.images.registry import REGISTRY_TIMEOUT, Registry
from bridge.images.runtime import Runtime
from bridge.images.sandboxes import Sandboxes, image_format

log = logging.getLogger(__name__)


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
        self._index = Index(self.cache_dir)
        self._registry = Registry(config)
        self._runtime = Runtime(config, self.cache_dir)
        self.format, self.format_reason = image_format(config)
        self._sandboxes = (
            Sandboxes(self._runtime, self._index) if self.format == "sandbox" else None
        )
        self.jobs = PullJobs(
            self._update,
            self._cached,
            max_workers=max_workers,
            failure_ttl=config.container.pull_failure_ttl if failure_ttl is None else failure_ttl,
            on_pulled=on_pulled,
            give_up_seconds=config.container.pull_give_up_seconds,
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
        """See `Index.prune`."""
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
        if entry is None:
            return True
        if imageref.digest_of(entry.reference):
            return False  # a pinned reference never changes
        return time.time() - entry.checked_at >= self.refresh_seconds

    # ------------------------------------------------------------------ the job itself

    def _update(self, ref: str, key: str, check: bool) -> Entry:
        """Check the reference's digest, pull its SIF when missing, write its entry."""
        self._runtime.check_installed(ref)
        try:
            with self._index.locked(f"{key}.lock"):
                # Another process may have done it meanwhile.
                entry = self._index.read(key)
                if entry is not None and not check and self._ready(entry):
                    return entry
                return self._refresh(ref, key, entry)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise Transient(f"the image cache is full ({exc.strerror})") from None
            raise ImagePullError(ref, f"image cache: {exc}") from None

    def _ready(self, entry: Entry) -> bool:
        """Whether the entry is fresh and its SIF on disk."""
        return not self._stale(entry) and (self.cache_dir / entry.sif).is_file()

    def _refresh(self, ref: str, key: str, entry: Entry | None) -> Entry:
        """The reference's entry for its digest now, its SIF pulled if missing (caller holds
        the key's lock); `entry`: the one it replaces."""
        if imageref.is_registry(ref):
            digest = self._digest(ref)
            sif = self.cache_dir / imageref.sif_name(ref, digest)
            pulled = self._pull_missing(ref, digest, sif)
        else:
            digest, sif, pulled = self._pull_by_content(ref, key)
        pulled_at = entry.pulled_at if entry is not None and entry.sif == sif.name else 0.0
        if pulled:
            pulled_at = time.time()
        if entry is not None and entry.sif != sif.name:
            log.info("image %s changed: %s -> %s", ref, entry.digest, digest)
        now = time.time()
        new = Entry(ref, sif.name, digest, checked_at=now, pulled_at=pulled_at or now)
        self._index.write(key, new)
        return new

    def _digest(self, ref: str) -> str:
        """The manifest digest to pull: the one the reference pins, else the one the registry
        gives its tag now."""
        pinned = imageref.digest_of(ref)
        return pinned if pinned is not None else self._registry.resolve_digest(ref)

    def _pull_by_content(self, ref: str, key: str) -> tuple[str, Path, bool]:
        """A reference outside registries (library://), pulled by the runtime (caller holds
        the key's lock): its content's digest, its SIF named by it, and whether that SIF is new
        (an image that did not change is dropped as a copy of the one the cache holds)."""
        pulled = self.cache_dir / f".{key}.pulled"  # not *.sif: never pruned
        try:
            self._runtime.pull(ref, pulled)
            digest = "sha256:" + file_sha256(pulled)
            sif = self.cache_dir / imageref.sif_name(ref, digest)
            with self._index.locked(f"{sif.name}.lock"):
                if sif.is_file():
                    return digest, sif, False
                os.replace(pulled, sif)
            return digest, sif, True
        finally:
            pulled.unlink(missing_ok=True)

    def _pull_missing(self, ref: str, digest: str, sif: Path) -> bool:
        """Pull the SIF unless it is on disk; whether this call pulled it."""
        if sif.is_file():
            return False
        # Two tags of one digest share the file: one pull of it at a time too.
        with self._index.locked(f"{sif.name}.lock"):
            if sif.is_file():
                return False
            self._runtime.pull(imageref.pinned(ref, digest), sif)
        return True


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's content, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
