"""The Snakemake 7 workflow of the engine tests, run again and again during the faults."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.nemesis.cluster import STATE_DIR, now
from tests.fixtures.engines import SNAKEMAKE7, build_snakemake7

#: The Snakemake workflow of the engine tests (seed, scale by 1, 2 and 3, total).
SNAKEFILE = (REPO / "tests" / "data" / "engines" / "Snakefile").read_text()
#: The engine, as the report names it.
ENGINE = SNAKEMAKE7[0].replace("==", " ")


@dataclass(frozen=True)
class _Cluster:
    """What the engine tests' build needs to know of the local cluster."""

    state_dir: Path
    registry: str


@dataclass
class Workflow:
    """The Snakemake 7 workflow of the engine tests, with their client and image."""

    venv: Path
    image: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, registry: str) -> Workflow:
        """Snakemake 7 as the engine tests have it: from their cache, or built now (a few
        minutes, once per machine and recipe) by their own recipe, its image pushed to the
        local registry."""
        engine = build_snakemake7(_Cluster(STATE_DIR, registry))
        assert engine.image is not None  # an engine built with packages has its image
        return cls(engine.venv, engine.image)

    def run_once(self, api_url: str, workdir: Path, deadline: float) -> None:
        """One workflow in `workdir`; Snakemake started again (it resumes) when it stops on an
        error of its own, such as the API away while its master restarts."""
        (workdir / "home").mkdir(parents=True)
        (workdir / "Snakefile").write_text(SNAKEFILE)
        attempts: list[str] = []
        while now() < deadline:
            started = now()
            try:
                result = self._snakemake(api_url, workdir, deadline)
            except subprocess.TimeoutExpired as exc:
                # Still running at the deadline: how long, and what it said last.
                said = (exc.stderr or b"")[-300:]
                text = said.decode(errors="replace") if isinstance(said, bytes) else said
                attempts.append(f"timed out after {now() - started:.0f} s: {text}")
                break
            attempts.append(f"exit {result.returncode} after {now() - started:.0f} s: "
                            f"{result.stderr[-300:]}")  # fmt: skip
            if result.returncode == 0:
                break
            time.sleep(5)
        total = workdir / "total.txt"
        scaled = [workdir / "scaled" / f"{n}.txt" for n in (1, 2, 3)]
        right = (
            total.exists()
            and total.read_text() == "60\n"
            and [p.read_text() if p.exists() else "" for p in scaled] == ["10\n", "20\n", "30\n"]
        )
        self.runs.append(
            {
                "workdir": workdir.name,
                "snakemake_runs": len(attempts),
                "outputs_right": right,
                # How each Snakemake run ended (it stops on an error of its own): why a
                # workflow did not finish.
                "attempts": attempts,
                "last": attempts[-1] if attempts else "",
            }
        )

    def _snakemake(
        self, api_url: str, workdir: Path, deadline: float
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(self.venv / "bin" / "snakemake"),
                "--tes",
                api_url,
                "--container-image",
                self.image,
                "--jobs",
                "3",
                "--latency-wait",
                "5",
                "--printshellcmds",
                # Started again after it stopped: the jobs it left unfinished run again.
                "--rerun-incomplete",
            ],
            cwd=workdir,
            env={
                "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin",
                "HOME": str(workdir / "home"),
                "LANG": "C.UTF-8",
            },
            capture_output=True,
            text=True,
            timeout=max(1, deadline - now()),
            check=False,
        )

    def loop(self, api_url: str, data: Path, until: Callable[[], bool], deadline: float) -> None:
        n = 0
        while not until() and now() < deadline:
            n += 1
            self.run_once(api_url, data / f"workflow-{n}", deadline)
