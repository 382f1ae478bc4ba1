"""Sandboxes: with `container.image_format` sandbox (or auto, see `image_format`), each SIF is
also unpacked once (`apptainer build --sandbox`) into `<stem>.sandbox/` beside it, in the
background: executors start from the directory once it is there and from the SIF until then.
A sandbox goes with its SIF when `Index.prune` removes that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bridge.config import Config
from bridge.images.index import Index, sandbox_of
from bridge.images.runtime import Runtime, SandboxFailed

log = logging.getLogger(__name__)

#: Filesystems a sandbox (thousands of small files) is read quickly from. On a shared one
#: (NFS, Lustre, GPFS, BeeGFS, ...) every executor start would cost its metadata servers a
#: lookup per file, where a SIF costs one open.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs"})


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


class Sandboxes:
    """Each cached SIF's sandbox: unpacked once, in the background, under the SIF's lock."""

    #: A failed build (e.g. a full disk) is tried again after this long; the SIF serves.
    RETRY_SECONDS = 3600.0

    def __init__(self, runtime: Runtime, index: Index) -> None:
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
        except (SandboxFailed, OSError) as exc:
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
                    raise SandboxFailed("the SIF is gone")
                started = time.monotonic()
                self._runtime.unpack(sif, sandbox)
                log.info("unpacked %s in %.1f s", sif.name, time.monotonic() - started)
        return sandbox
