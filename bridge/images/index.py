"""The image cache on disk: `refs/<key>.json` entries (`Entry`: a reference's manifest digest
and its SIF), the content-addressed SIFs they name (`<name>-<digest>.sif`, so a tag that moves
gets a new file) with their sandboxes beside them (`sandbox_of`), and the `fcntl` locks all
processes sharing the cache take (the poller and `tes-bridge images pull`).

A SIF no entry names any more stays for the jobs that still use it until `Index.prune` finds no
unfinished task older than the moment it stopped being used.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bridge.images.failures import Transient
from bridge.images.runtime import SANDBOX_BUILD_TIMEOUT

log = logging.getLogger(__name__)


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


class Index:
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
                raise Transient("the SIF was removed while it was being recorded")
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
