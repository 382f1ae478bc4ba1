"""Image references and the pull bookkeeping of the SIF cache.

The runtime here is a stand-in script that writes the file it is asked for; real pulls from the
local registry run in tests/cluster/test_job_script.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config
from bridge.images import ImageCache, ImagePullError

FAKE_RUNTIME = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps(args) + "\\n")
time.sleep(float(os.environ.get("FAKE_PULL_SECONDS", "0.3")))
if os.path.exists({fail!r}):
    print("FATAL: While making image from oci registry: manifest unknown", file=sys.stderr)
    sys.exit(255)
name = args[args.index("--name") + 1]
with open(name, "w") as out:
    out.write("SIF " + args[-1])
"""


@pytest.fixture
def runtime(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "bin": tmp_path / "bin" / "apptainer",
        "log": tmp_path / "pulls.log",
        "fail": tmp_path / "fail-pulls",
    }
    paths["bin"].parent.mkdir()
    paths["bin"].write_text(
        FAKE_RUNTIME.format(python=sys.executable, log=str(paths["log"]), fail=str(paths["fail"]))
    )
    paths["bin"].chmod(0o755)
    return paths


def make_cache(tmp_path: Path, runtime: dict[str, Path], **kwargs: Any) -> ImageCache:
    config = Config.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "container": {
                "runtime": str(runtime["bin"]),
                "default_registry": "127.0.0.1:5000",
                "insecure_registries": ["127.0.0.1:5000"],
            },
        }
    )
    return ImageCache(config, **kwargs)


def pulls(runtime: dict[str, Path]) -> list[list[str]]:
    if not runtime["log"].exists():
        return []
    return [json.loads(line) for line in runtime["log"].read_text().splitlines()]


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("alpine", "docker://127.0.0.1:5000/library/alpine:latest"),
        ("ubuntu:22.04", "docker://127.0.0.1:5000/library/ubuntu:22.04"),
        ("biocontainers/samtools:1.9", "docker://127.0.0.1:5000/biocontainers/samtools:1.9"),
        ("quay.io/org/img:tag", "docker://quay.io/org/img:tag"),
        ("docker://alpine", "docker://127.0.0.1:5000/library/alpine:latest"),
        ("docker://docker.io/ubuntu", "docker://docker.io/library/ubuntu:latest"),
        ("localhost:5000/x/y", "docker://localhost:5000/x/y:latest"),
        ("oras://ghcr.io/org/img:1", "oras://ghcr.io/org/img:1"),
        ("library://sylabs/default/alpine:3", "library://sylabs/default/alpine:3"),
        ("/images/tool.sif", "/images/tool.sif"),
        (
            "alpine@sha256:" + "a" * 64,
            "docker://127.0.0.1:5000/library/alpine@sha256:" + "a" * 64,
        ),
    ],
)
def test_normalize(tmp_path: Path, runtime: dict[str, Path], image: str, expected: str) -> None:
    assert make_cache(tmp_path, runtime).normalize(image) == expected


def test_docker_hub_is_the_usual_default(tmp_path: Path) -> None:
    cache = ImageCache(Config.model_validate({"state_dir": str(tmp_path)}))
    assert cache.normalize("alpine") == "docker://docker.io/library/alpine:latest"
    assert cache.normalize("ghcr.io/a/b") == "docker://ghcr.io/a/b:latest"


@pytest.mark.parametrize(
    "image",
    ["", " alpine", "Alpine", "alpine;id", "alpine:", "a b", "x://y", "/etc/shadow", "/a/../b.sif"],
)
def test_invalid_references_are_refused(
    tmp_path: Path, runtime: dict[str, Path], image: str
) -> None:
    with pytest.raises(ImagePullError):
        make_cache(tmp_path, runtime).normalize(image)


def test_cache_key_is_a_safe_file_name_shared_by_equivalent_references(
    tmp_path: Path, runtime: dict[str, Path]
) -> None:
    cache = make_cache(tmp_path, runtime)
    key = cache.key("alpine")
    assert key == cache.key("docker://127.0.0.1:5000/library/alpine:latest")
    assert key != cache.key("alpine:3")
    assert key.endswith(".sif") and "/" not in key and key.startswith("alpine_latest-")


def test_ensure_pulls_once_in_the_background_then_returns_the_sif(
    tmp_path: Path, runtime: dict[str, Path]
) -> None:
    cache = make_cache(tmp_path, runtime)
    started = time.monotonic()
    assert cache.ensure("alpine") is None
    assert time.monotonic() - started < 0.2  # never waits for the pull
    assert cache.ensure("docker://alpine") is None  # same image: no second pull
    path = cache.pull("alpine", timeout=30)
    assert path.read_text() == "SIF docker://127.0.0.1:5000/library/alpine:latest"
    assert cache.ensure("alpine") == path
    assert len(pulls(runtime)) == 1
    args = pulls(runtime)[0]
    assert args[args.index("pull") + 1] == "--no-https"  # 127.0.0.1:5000 is insecure
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".sif") and p != path]


def test_concurrent_callers_start_one_pull(tmp_path: Path, runtime: dict[str, Path]) -> None:
    cache = make_cache(tmp_path, runtime)
    threads = [threading.Thread(target=cache.ensure, args=("alpine",)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cache.pull("alpine", timeout=30)
    assert len(pulls(runtime)) == 1


def test_two_processes_never_pull_the_same_image_at_once(
    tmp_path: Path, runtime: dict[str, Path]
) -> None:
    # Another process (another cache object holding the lock file) pulls the same image.
    code = (
        "import sys; from bridge.config import Config; from bridge.images import ImageCache; "
        f"c = ImageCache(Config.model_validate({{'state_dir': {str(tmp_path / 'state')!r}, "
        f"'container': {{'runtime': {str(runtime['bin'])!r}, "
        "'default_registry': '127.0.0.1:5000'}})); print(c.pull('alpine', timeout=30))"
    )
    repo = Path(__file__).resolve().parents[2]
    other = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo), "FAKE_PULL_SECONDS": "1"},
    )
    time.sleep(0.5)
    cache = make_cache(tmp_path, runtime)
    path = cache.pull("alpine", timeout=30)
    assert other.communicate(timeout=30)[0].strip() == str(path)
    assert len(pulls(runtime)) == 1


def test_failed_pull_is_reported_and_not_retried_until_the_ttl_passes(
    tmp_path: Path, runtime: dict[str, Path]
) -> None:
    runtime["fail"].touch()
    cache = make_cache(tmp_path, runtime, failure_ttl=60)
    with pytest.raises(ImagePullError, match="manifest unknown") as info:
        cache.pull("alpine:missing", timeout=30)
    assert "exited 255" in info.value.reason
    for _ in range(3):
        with pytest.raises(ImagePullError, match="manifest unknown"):
            cache.ensure("alpine:missing")
    assert len(pulls(runtime)) == 1
    assert not list((tmp_path / "state" / "images").glob("*.sif"))

    runtime["fail"].unlink()
    cache.failure_ttl = 0
    assert cache.pull("alpine:missing", timeout=30).is_file()
    assert len(pulls(runtime)) == 2


def test_missing_runtime_is_a_pull_error_that_says_how_to_fix_it(tmp_path: Path) -> None:
    config = Config.model_validate(
        {"state_dir": str(tmp_path), "container": {"runtime": "no-such-apptainer"}}
    )
    with pytest.raises(ImagePullError, match=r"container\.runtime"):
        ImageCache(config).pull("alpine", timeout=10)


def test_local_sif_is_used_as_is(tmp_path: Path, runtime: dict[str, Path]) -> None:
    sif = tmp_path / "tool.sif"
    sif.write_text("x")
    cache = make_cache(tmp_path, runtime)
    assert cache.ensure(str(sif)) == sif
    with pytest.raises(ImagePullError, match="does not exist"):
        cache.ensure(str(tmp_path / "missing.sif"))
    assert pulls(runtime) == []


def test_resolve_maps_every_image_once_all_are_ready(
    tmp_path: Path, runtime: dict[str, Path]
) -> None:
    cache = make_cache(tmp_path, runtime)
    assert cache.resolve(["alpine", "alpine", "python:3-slim"]) is None
    cache.pull("alpine", timeout=30)
    cache.pull("python:3-slim", timeout=30)
    paths = cache.resolve(["alpine", "python:3-slim"])
    assert paths is not None and set(paths) == {"alpine", "python:3-slim"}
    assert all(Path(p).is_file() for p in paths.values())
