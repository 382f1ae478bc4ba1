"""The package as a site installs it: an sdist, a wheel built from that sdist, and a job script
rendered by the installed wheel (the template is package data, not a file of this checkout)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import bridge

REPO = Path(__file__).resolve().parents[2]

RENDER = """
import json, sys
from pathlib import Path
import bridge
from bridge.config import Config
from bridge.jobscript.render import render_script

state = Path(sys.argv[1])
config = Config.model_validate({"state_dir": str(state)})
task = {"id": "d0cf7f4c-6e4d-4e3a-9a5e-3f1b7c9f2a10",
        "executors": [{"image": "alpine", "command": ["echo", "hello"]}]}
script = render_script(task, config=config, task_dir=config.work_dir / task["id"],
                       image_paths={"alpine": "/images/alpine.sif"})
print(json.dumps({"bridge": bridge.__file__, "version": bridge.__version__, "script": script}))
"""


def _build(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_a_wheel_built_from_the_sdist_renders_a_job_script(tmp_path: Path):
    # From a copy: a build writes egg-info into its source tree, which would then mask a
    # missing MANIFEST.in entry on the next run.
    checkout = tmp_path / "checkout"
    shutil.copytree(
        REPO, checkout, ignore=shutil.ignore_patterns(".git", ".venv", "*.egg-info", "__pycache__")
    )
    dist = tmp_path / "dist"
    _build("--sdist", "--outdir", str(dist), str(checkout), cwd=checkout)
    (sdist,) = dist.glob("*.tar.gz")
    assert sdist.name == f"tes_slurm_bridge-{bridge.__version__}.tar.gz"
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert any(name.endswith("/templates/job.sh.j2") for name in names), names
    for page in ("index.html", "app.js", "style.css"):
        assert any(name.endswith(f"/bridge/api/webui/{page}") for name in names), names

    # The wheel is built from the unpacked sdist alone, as pip does with a source download.
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "src", filter="data")
    (source,) = (tmp_path / "src").iterdir()
    _build("--wheel", "--outdir", str(dist), str(source), cwd=tmp_path)
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "bridge/templates/job.sh.j2" in archive.namelist()
        for page in ("index.html", "app.js", "style.css"):
            assert f"bridge/api/webui/{page}" in archive.namelist()
        archive.extractall(tmp_path / "installed")

    # The installed copy renders; the checkout's templates/ is out of its reach.
    result = subprocess.run(
        [sys.executable, "-c", RENDER, str(tmp_path / "state")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "installed")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    answer = json.loads(result.stdout)
    assert Path(answer["bridge"]).is_relative_to(tmp_path / "installed")
    assert answer["version"] == bridge.__version__
    assert answer["script"].startswith("#!")
    assert re.search(r"^#SBATCH ", answer["script"], re.M)
