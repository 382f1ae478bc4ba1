"""The bridge under test: `tes-bridge serve` with a config for the local cluster."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import requests

from bench.common import (
    PYTHON,
    REPO,
    bridge_env,
    free_port,
    stop,
)
from bench.e2e import container_toml
from bench.nemesis.cluster import children, cmdline


@dataclass
class Bridge:
    """`tes-bridge serve` (API and poller beside it) with a config for the local cluster."""

    root: Path
    config: Path
    api: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.root / "serve.log", "ab")  # noqa: SIM115 (kept open by the process)
        self.process = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "bridge",
                "--config",
                str(self.config),
                "--log-level",
                "WARNING",
                "serve",
            ],
            env=bridge_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def master(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None
        return self.process.pid

    def roles(self) -> dict[str, list[int]]:
        master = self.master()
        if master is None:
            return {"master": [], "worker": [], "poller": []}
        kids = children(master)
        supervisors = [p for p in kids if "--supervise" in cmdline(p)]
        return {
            "master": [master],
            "worker": [p for p in kids if p not in supervisors],
            "poller": [p for s in supervisors for p in children(s)],
        }

    def answers(self) -> bool:
        try:
            return requests.get(f"{self.api}/service-info", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


def write_config(
    root: Path, shared: Path, database: str, s3_port: int, info: dict[str, str]
) -> Path:
    port = free_port()
    path = root / "tes-bridge.toml"
    path.write_text(
        f"""database = "{database}"
state_dir = "{root / "state"}"
[server]
bind = "127.0.0.1:{port}"
workers = 2
[slurm]
poll_interval = 0.5
submit_backoff_initial = 1.0
submit_backoff_max = 8.0
{container_toml(info, shared / "images").strip()}
# Tags are checked against the registry often, so that a stalled registry is met.
refresh_seconds = 20
[storage]
allowed_dirs = ["{shared / "data"}"]
shared_dirs = ["{shared / "data"}"]
[staging]
http_upload = true
s3_endpoint_url = "http://127.0.0.1:{s3_port}"
s3_region = "us-east-1"
s3_credentials_file = "{shared / "aws-credentials"}"
s3_addressing_style = "path"
[job]
work_dir = "{shared / "work"}"
log_tail_bytes = 2048
"""
    )
    return path
