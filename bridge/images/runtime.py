"""The container runtime's side of the cache: one pull of a reference into a SIF, and one
`build --sandbox` of a SIF, each with the runtime's environment pointed into the cache and under
its timeout.

Pulls go through spython's `Client.pull`, pointed at the configured runtime binary. A pull that
takes longer than `container.pull_timeout_seconds` is killed with its process group. Files are
pulled to a temporary name and renamed, so a SIF in the cache is always complete; a sandbox is
built under a temporary name and renamed, so a directory under the final name is always whole.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from spython.main import Client as _spython_client

from bridge.config import Config
from bridge.images import ref as imageref
from bridge.images.failures import Transient, short_text
from bridge.images.ref import ImagePullError
from bridge.system import metrics, proc

log = logging.getLogger(__name__)

#: Registry answers and pull errors that say "try again later", not "no such image".
_TRANSIENT = re.compile(
    r"connection refused|connection reset|no route to host|network is unreachable|"
    r"i/o timeout|timed? ?out|temporary failure|tls handshake|no space left|disk quota|"
    r"too many requests|service unavailable|bad gateway|gateway time|internal server error|"
    r"unexpected eof|\b(?:429|500|502|503|504)\b",
    re.IGNORECASE,
)
#: Pull errors that say the registry or library cannot be reached at all (its name, a route, a
#: refused connection): given up on after container.pull_give_up_seconds, as when the registry's
#: digest check cannot reach it. A library:// pull meets them first: it has no digest check.
_UNREACHABLE = re.compile(
    r"no such host|server misbehaving|connection refused|no route to host|"
    r"network is unreachable",
    re.IGNORECASE,
)
#: A sandbox build is killed past this (the SIF keeps serving); a leftover temporary
#: directory older than this is removed by `Index.prune`.
SANDBOX_BUILD_TIMEOUT = 3600.0


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
        # The one command runner: a process group of its own, killed whole when the pull
        # stalls, and with the process that started it.
        try:
            result = proc.run(cmd, timeout=self._timeout, env=self._env)
        except proc.CommandTimeout:
            raise Transient(
                f"the pull stalled: no result after {self._timeout:.0f} s "
                "(container.pull_timeout_seconds); killed it"
            ) from None
        if result.returncode != 0:
            text = (result.stderr.strip() or result.stdout.strip())[-2000:]
            message = f"{os.path.basename(cmd[0])} exited {result.returncode}: {text}"
            if _TRANSIENT.search(text) or _UNREACHABLE.search(text):
                # Said in system_logs on every retry: the end of the message is enough.
                raise Transient(
                    short_text(message[:60] + " … " + text[-240:], 320),
                    unreachable=_UNREACHABLE.search(text) is not None,
                )
            raise _PullFailed(message)
        return result.stdout


class _PullFailed(Exception):
    """The runtime could not pull the image, for a reason that will not pass."""


class SandboxFailed(Exception):
    """The SIF could not be unpacked into a sandbox (executors run from the SIF)."""


class Runtime:
    """The runtime binary: one `pull` into a SIF under the pull timeout, one `build --sandbox`."""

    def __init__(self, config: Config, cache_dir: Path) -> None:
        self.config = config
        self.cache_dir = cache_dir

    def check_installed(self, ref: str) -> None:
        """An ImagePullError for `ref` when the runtime is not on PATH."""
        runtime = self.config.container.runtime
        if shutil.which(runtime) is None:
            raise ImagePullError(
                ref,
                f"{runtime} not found on PATH; set container.runtime in the config or install "
                "Apptainer",
            )

    def pull(self, ref: str, target: Path) -> None:
        """Pull `ref` into the SIF `target`, complete or absent."""
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
                raise SandboxFailed(str(exc)) from None
            if done.returncode != 0 or not tmp.is_dir():
                raise SandboxFailed(
                    f"{runtime} build --sandbox exited {done.returncode}: "
                    f"{short_text(done.stderr or done.stdout)}"
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
