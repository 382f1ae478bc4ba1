"""The background update jobs of the image cache (`PullJobs`): at most one per reference at a
time, off the poller's thread, so a slow pull never holds up the poll loop or other tasks.

Failures. An image or tag that does not exist is permanent: `ImagePullError` (the poller fails
the task), remembered for `failure_ttl` seconds. A registry that is down, refuses, answers 5xx or
stalls, and a full cache disk, are transient: the tasks stay QUEUED, `problem(image)` says why
(for system_logs), and the job is tried again after a back-off that starts at 2 s. While the
registry is known to be unreachable, a cached SIF serves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bridge.images import ref as imageref
from bridge.images.failures import Transient
from bridge.images.index import Entry
from bridge.images.ref import ImagePullError
from bridge.system import metrics

log = logging.getLogger(__name__)

#: Back-off of transient failures: 2, 4, 8, 16, 30, 30 ... seconds.
RETRY_FIRST = 2.0
RETRY_MAX = 30.0


@dataclass
class _Retry:
    at: float
    message: str
    attempts: int
    delay: float
    #: When the registry first could not be reached in this streak (monotonic; None: it
    #: answered, e.g. 503, or the trouble was the cache's).
    unreachable_since: float | None = None


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
        give_up_seconds: float = float("inf"),
    ) -> None:
        #: (ref, key, check) -> the new entry; runs in a pool thread.
        self._job = job
        #: key -> (the SIF on disk or None, whether it is fresh).
        self._cached = cached
        self.failure_ttl = failure_ttl
        #: A registry unreachable this long fails the tasks that wait for it.
        self.give_up_seconds = give_up_seconds
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
        #: key -> when its pending job was started (wall clock), for problem().
        self._started: dict[str, float] = {}

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
            given_up = self._given_up(retry) if fallback is None else None
            if future is not None or (retry is not None and time.monotonic() < retry.at):
                if given_up:
                    raise ImagePullError(image, given_up)
                return fallback
            # Retries go on after giving up, so a registry that comes back serves new tasks.
            future = self._start(ref, key, check=False)
        # Outside the lock: the callback runs at once, in this thread, if the job already ended.
        future.add_done_callback(self._wake)
        if given_up:
            raise ImagePullError(image, given_up)
        return fallback

    def _given_up(self, retry: _Retry | None) -> str | None:
        """The failure to give tasks once the registry has been unreachable too long."""
        if retry is None or retry.unreachable_since is None:
            return None
        waited = time.monotonic() - retry.unreachable_since
        if waited < self.give_up_seconds:
            return None
        return (
            f"{retry.message} since {waited:.0f} s ago; gave up after "
            f"{self.give_up_seconds:.0f} s (container.pull_give_up_seconds)"
        )

    def problem(self, image: str, key: str) -> str | None:
        """What a task waiting for `image` says: the transient trouble of its last attempt, else
        the pull in progress (which can last container.pull_timeout_seconds). The same words
        while it lasts: the poller stores them only when they change."""
        with self._lock:
            retry = self._retries.get(key)
            future = self._pending.get(key)
            started = self._started.get(key)
        if retry is not None:
            return f"pulling image {image}: {retry.message}; retrying in {retry.delay:.0f} s"
        if future is None or future.done() or started is None:
            return None
        when = datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"waiting: pulling image {image} (started {when})"

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
        self._started[key] = time.time()
        self._names[key] = ref
        return future

    def _collect(self, key: str, future: Future[Entry]) -> None:
        """Record how a finished job ended (caller holds the lock)."""
        del self._pending[key]
        self._started.pop(key, None)
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
        message = exc.message if isinstance(exc, Transient) else f"unexpected error: {exc!r}"
        previous = self._retries.get(key)
        attempts = previous.attempts + 1 if previous else 1
        delay = min(RETRY_FIRST * 2 ** (attempts - 1), RETRY_MAX)
        now = time.monotonic()
        since = None
        if isinstance(exc, Transient) and exc.unreachable:
            since = previous.unreachable_since if previous else None
            since = now if since is None else since
        self._retries[key] = _Retry(now + delay, message, attempts, delay, since)
        name = self._names.get(key, key)
        log.warning("image %s not available now (%s); retrying in %.0f s", name, message, delay)

    def _wake(self, future: Future[Entry]) -> None:
        # Takes no lock: it may run in ensure()'s thread (deadlock of defect 10).
        if self.on_pulled is not None:
            self.on_pulled()
