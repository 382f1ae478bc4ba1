"""storage.shared_dirs on the real cluster: a directory every executor sees read-write at its own
path, and file:// inputs and outputs at their own path inside it used in place, as workflow
engines (Toil's job store, Snakemake's `fs` storage) expect of a site's shared filesystem."""

from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.service import BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    # Outside /tmp, like a site's shared filesystem (the last test covers one under /var/tmp).
    path = Path(tempfile.mkdtemp(prefix="tes-shared-", dir="/srv"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def service(
    local_cluster: Any, shared_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    with start_bridge_service(
        local_cluster,
        tmp_path_factory.mktemp("shared"),
        storage_toml=f'shared_dirs = ["{shared_dir}"]',
    ) as service:
        yield service


def sh(script: str) -> dict[str, Any]:
    return {"image": "alpine", "command": ["sh", "-c", script]}


def only_log(task: dict[str, Any]) -> dict[str, Any]:
    assert len(task["logs"]) == 1, task
    return task["logs"][0]


def test_toil_shaped_job_store_input_is_written_into_in_place(
    service: BridgeService, shared_dir: Path
) -> None:
    store = shared_dir / "js"
    (store / "files").mkdir(parents=True)
    (store / "files" / "job-1").write_text("pickled job\n")
    task = service.run(
        {
            # What toil-batch-system-tes sends: the job store as a DIRECTORY input at its path.
            "inputs": [{"url": f"file://{store}", "path": str(store), "type": "DIRECTORY"}],
            "executors": [
                sh(
                    f"cat {store}/files/job-1 && echo done > {store}/files/job-2 "
                    f"&& mkdir -p {store}/stats && echo 1 > {store}/stats/s"
                )
            ],
        }
    )
    assert task["state"] == "COMPLETE", task
    assert only_log(task)["logs"][0]["stdout"] == "pickled job\n"
    assert (store / "files" / "job-2").read_text() == "done\n"
    assert (store / "stats" / "s").read_text() == "1\n"
    # Not staged: no copy of the job store in the task directory.
    assert not list((service.work_dir / task["id"]).rglob("job-1"))


def test_executor_sees_a_shared_dir_read_write_without_declaring_it(
    service: BridgeService, shared_dir: Path
) -> None:
    (shared_dir / "workflow").mkdir()
    (shared_dir / "workflow" / "source.tar").write_text("archive\n")
    task = service.run(
        {
            "executors": [
                sh(
                    f"cat {shared_dir}/workflow/source.tar "
                    f"&& echo result > {shared_dir}/workflow/result.txt"
                )
            ]
        }
    )
    assert task["state"] == "COMPLETE", task
    assert only_log(task)["logs"][0]["stdout"] == "archive\n"
    assert (shared_dir / "workflow" / "result.txt").read_text() == "result\n"


def test_files_an_executor_writes_in_a_shared_dir_get_the_executor_umask(
    service: BridgeService, shared_dir: Path
) -> None:
    """container.umask ("022" by default) reaches the executors, not the job's own umask 077:
    what they write in a shared directory is readable by the site's other users."""
    target = shared_dir / "umask"
    task = service.run({"executors": [sh(f"umask; mkdir {target} && echo x > {target}/f.txt")]})
    assert task["state"] == "COMPLETE", task
    assert only_log(task)["logs"][0]["stdout"] == "0022\n"
    assert stat.S_IMODE((target / "f.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_same_path_input_and_output_are_used_in_place_and_other_inputs_stay_read_only(
    service: BridgeService, shared_dir: Path
) -> None:
    (shared_dir / "in").mkdir()
    source = shared_dir / "in" / "data.txt"
    source.write_text("live\n")
    outside = service.data_dir / "ro.txt"
    outside.write_text("copied\n")
    out = shared_dir / "out" / "r.txt"
    task = service.run(
        {
            "inputs": [
                {"url": f"file://{source}", "path": str(source)},
                {"url": f"file://{outside}", "path": "/in/ro.txt"},
            ],
            "outputs": [{"url": f"file://{out}", "path": str(out)}],
            "executors": [
                sh(
                    f"stat -c %i {source}; "
                    "if echo x >> /in/ro.txt; then echo ro-writable; else echo ro-refused; fi; "
                    f"echo out > {out}"  # its directory was made for it, as for any output
                )
            ],
        }
    )
    assert task["state"] == "COMPLETE", task
    inode, verdict = only_log(task)["logs"][0]["stdout"].split()
    # The executor reads the very file (same inode), not a copy; nothing appears in the task
    # directory for it.
    assert int(inode) == source.stat().st_ino
    assert not list((service.work_dir / task["id"]).rglob("data.txt"))
    # An input from an only allowed directory is still a read-only copy.
    assert verdict == "ro-refused"
    assert outside.read_text() == "copied\n"
    assert out.read_text() == "out\n"
    assert only_log(task)["outputs"] == [
        {"url": f"file://{out}", "path": str(out), "size_bytes": "4"}
    ]


def test_a_shared_dir_under_var_tmp_lies_on_top_of_the_disk_backed_var_tmp(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A directory under /var/tmp at the same path on the login node and on every compute node
    # (each has its own /var/tmp): node-local, but at a path a site might share.
    shared = Path(tempfile.mkdtemp(prefix="tes-shared-", dir="/var/tmp"))
    shared.chmod(0o755)
    copies = [d / shared.name for d in local_cluster.tmp_dirs(var=True)]
    for copy in copies:
        copy.mkdir(mode=0o755, exist_ok=True)
    with start_bridge_service(
        local_cluster,
        tmp_path_factory.mktemp("shared-var-tmp"),
        storage_toml=f'shared_dirs = ["{shared}"]',
    ) as service:
        task = service.run(
            {
                "executors": [
                    sh(
                        f"echo shared > {shared}/f && echo private > /var/tmp/private-marker "
                        "&& ls /var/tmp && stat -f -c fs=%T /var/tmp"
                    )
                ]
            }
        )
        assert task["state"] == "COMPLETE", task
        assert [c.joinpath("f").read_text() for c in copies if c.joinpath("f").exists()] == [
            "shared\n"
        ]
        # /var/tmp is still the attempt's own directory: the file did not reach the host's,
        # and the executor saw only the mount point of the shared directory there.
        for var_tmp in local_cluster.tmp_dirs(var=True):
            assert not (var_tmp / "private-marker").exists()
        *listed, fs = only_log(task)["logs"][0]["stdout"].split()
        assert sorted(listed) == sorted([shared.name, "private-marker"])
        assert fs != "fs=tmpfs"  # on disk, not the runtime's RAM tmpfs
        for copy in copies:
            shutil.rmtree(copy, ignore_errors=True)
