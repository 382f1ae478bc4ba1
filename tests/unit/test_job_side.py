"""The compute-node side: staging in and out, safe stdio, and the records the poller reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config
from bridge.core.naming import (
    NO_RECORDS_EXIT_CODE,
    SCRATCH_EXIT_CODE,
    STAGE_IN_EXIT_CODE,
    STAGE_OUT_EXIT_CODE,
    SUPERSEDED_EXIT_CODE,
)
from bridge.core.reasons import IMAGE_UNREADABLE, STAGE_IN_FAILED, STAGE_OUT_FAILED
from bridge.job import safepath
from bridge.job.cli import main as job_main
from bridge.job.execute import EXIT_CANNOT_START, run_executor
from bridge.job.layout import LayoutError, TaskLayout, write_lease_fence
from bridge.job.records import RecordsWriter, read_records
from bridge.job.settings import JobSettings
from bridge.job.stage import (
    STAGE_FAILED,
    STAGE_MISSING_OUTPUTS,
    STAGE_OK,
    StageIn,
    StageOut,
    stage_in,
    stage_out,
)
from bridge.jobscript.render import prepare_task_dir

REPO = Path(__file__).resolve().parents[2]
JOB = "100"


class Task:
    """A task directory written by hand: task.json + job-config.json, as the renderer does."""

    def __init__(self, tmp_path: Path, task: dict[str, Any], **settings: Any) -> None:
        self.allowed = tmp_path / "shared"
        self.allowed.mkdir(parents=True, exist_ok=True)
        self.layout = TaskLayout(tmp_path / "work" / "t1")
        self.layout.task_dir.mkdir(parents=True, mode=0o700)
        task = {"id": "t1", "executors": [{"image": "x", "command": ["true"]}], **task}
        self.layout.task_json.write_text(json.dumps(task))
        values = {
            "task_id": "t1",
            "runtime": "sh",
            "allowed_dirs": [str(self.allowed)],
            "mkdirs": [],
            "allow_root": True,  # the suite runs as root
            **settings,
        }
        self.layout.job_config.write_text(JobSettings(**values).to_json())
        self.records = self.layout.records_dir(JOB)

    def stage_in(self) -> int:
        return stage_in(self.layout.task_dir, self.records)

    def stage_out(self) -> int:
        return stage_out(self.layout.task_dir, self.records)

    def read(self, keep_bytes: int = 1024) -> Any:
        return read_records(self.layout.task_dir, JOB, keep_bytes=keep_bytes)

    def host(self, container_path: str) -> Path:
        return self.layout.host_path(container_path)


# --------------------------------------------------------------------------- layout


def test_layout_maps_container_paths_under_root(tmp_path: Path) -> None:
    layout = TaskLayout(tmp_path / "t")
    assert layout.host_path("/data/x") == tmp_path / "t" / "root" / "data" / "x"
    assert layout.records_dir("12") == tmp_path / "t" / "records" / "12"
    assert layout.slurm_output_for("12") == tmp_path / "t" / "slurm-12.out"
    for bad in ["relative", "/a/../../etc", "//etc", "/a/./b", "/a/", "/nul\0"]:
        with pytest.raises(LayoutError):
            layout.host_path(bad)
    with pytest.raises(LayoutError):
        layout.records_dir("../x")


# --------------------------------------------------------------------------- stage-in


def test_content_and_file_inputs_are_staged(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "in.txt").write_text("from a file\n")
    (shared / "run.sh").write_text("#!/bin/sh\n")
    (shared / "run.sh").chmod(0o755)
    task = Task(
        tmp_path,
        {
            "inputs": [
                {"path": "/in/content.txt", "content": "inline ☃\n", "type": "FILE"},
                {"path": "/in/file.txt", "url": f"file://{shared}/in.txt"},
                {"path": "/in/bare.txt", "url": f"{shared}/in.txt"},
                {"path": "/in/local.txt", "url": f"file://localhost{shared}/in.txt"},
                {"path": "/in/run.sh", "url": f"{shared}/run.sh"},
            ]
        },
        mkdirs=["/outputs"],
    )
    assert task.stage_in() == STAGE_OK
    assert task.host("/in/content.txt").read_text() == "inline ☃\n"
    for name in ("file", "bare", "local"):
        assert task.host(f"/in/{name}.txt").read_text() == "from a file\n"
    assert os.access(task.host("/in/run.sh"), os.X_OK)
    assert task.host("/outputs").is_dir()
    assert task.read().system_logs == []


def test_hardlink_mode_links_and_copy_mode_copies(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "in.txt").write_text("x")
    inputs = {"inputs": [{"path": "/in/x", "url": f"{shared}/in.txt"}]}
    task = Task(tmp_path, inputs, file_input_mode="hardlink", linkable_inputs=[0])
    assert task.stage_in() == STAGE_OK
    assert task.host("/in/x").stat().st_ino == (shared / "in.txt").stat().st_ino
    # Not linkable (it would be writable in the container): copied although mode is hardlink.
    task = Task(tmp_path / "b", inputs, file_input_mode="hardlink", allowed_dirs=[str(shared)])
    assert task.stage_in() == STAGE_OK
    assert task.host("/in/x").stat().st_ino != (shared / "in.txt").stat().st_ino


def test_directory_input_is_copied_without_leaving_the_allowed_dirs(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "ref" / "sub").mkdir(parents=True)
    (shared / "ref" / "a.txt").write_text("a")
    (shared / "ref" / "sub" / "b.txt").write_text("b")
    (shared / "ref" / "inside-link").symlink_to(shared / "ref" / "a.txt")
    (shared / "ref" / "escape").symlink_to("/etc/hostname")
    task = Task(
        tmp_path, {"inputs": [{"path": "/ref", "url": f"{shared}/ref", "type": "DIRECTORY"}]}
    )
    assert task.stage_in() == STAGE_OK
    assert task.host("/ref/a.txt").read_text() == "a"
    assert task.host("/ref/sub/b.txt").read_text() == "b"
    assert task.host("/ref/inside-link").read_text() == "a"
    assert not os.path.lexists(task.host("/ref/escape"))
    assert any("escape" in line for line in task.read().system_logs)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///etc/hostname", "outside the allowed directories"),
        ("/etc/hostname", "outside the allowed directories"),
        ("{shared}/../../etc/hostname", "not normalised"),
        ("{shared}/missing.txt", "does not exist"),
        ("{shared}/link-out", "outside the allowed directories"),
        ("file://otherhost{shared}/in.txt", "names host"),
        ("sftp://example.org/key", "not supported by this deployment yet"),
        ("gs://bucket/x", "not supported by this deployment yet"),
        ("gopher://x/y", "unknown URL scheme"),
    ],
)
def test_unusable_input_fails_staging_with_url_and_reason(
    tmp_path: Path, url: str, reason: str
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "in.txt").write_text("x")
    (shared / "link-out").symlink_to("/etc/hostname")
    url = url.format(shared=shared)
    task = Task(
        tmp_path,
        {
            "inputs": [
                {"path": "/in/good", "content": "fine"},
                {"path": "/in/bad", "url": url},
            ]
        },
    )
    assert task.stage_in() == STAGE_FAILED
    logs = task.read().system_logs
    assert len(logs) == 1
    assert url in logs[0] and reason in logs[0] and "/in/bad" in logs[0]
    assert task.host("/in/good").read_text() == "fine"


def test_file_urls_are_refused_when_no_directory_is_allowed(tmp_path: Path) -> None:
    task = Task(tmp_path, {"inputs": [{"path": "/in/x", "url": "/etc/hostname"}]}, allowed_dirs=[])
    assert task.stage_in() == STAGE_FAILED
    assert "allowed_dirs is empty" in task.read().system_logs[0]


def test_wrong_input_type_is_reported(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "d").mkdir()
    task = Task(tmp_path, {"inputs": [{"path": "/in/x", "url": f"{shared}/d", "type": "FILE"}]})
    assert task.stage_in() == STAGE_FAILED
    assert "not a regular file" in task.read().system_logs[0]


def test_items_the_job_side_cannot_read_fail_and_name_the_field(tmp_path: Path) -> None:
    """The job side reads each input and output once, into a typed record: an item that does
    not fit it fails, naming the field, rather than being guessed at or skipped."""
    shared = tmp_path / "shared"
    (shared / "d").mkdir(parents=True)
    task = Task(
        tmp_path,
        {
            "inputs": [
                {"path": "/in/d", "url": f"{shared}/d", "type": "directory"},
                {"path": "/in/x", "url": 7},
                "not an input",
            ]
        },
    )
    assert task.stage_in() == STAGE_FAILED
    logs = task.read().system_logs
    assert len(logs) == 3, logs
    assert "unknown type 'directory'" in logs[0]
    assert "`url` is not a string" in logs[1]
    assert logs[2] == "input 2 -> None: malformed input"
    assert not task.host("/in/d").exists()

    task = Task(tmp_path / "b", {"outputs": [{"path": "/out/x"}, ["not an output"]]})
    (tmp_path / "b" / "work" / "t1" / "root").mkdir()
    assert task.stage_out() == STAGE_FAILED
    logs = task.read().system_logs
    assert logs == [
        "output 0 /out/x -> None: `url` is not a string",
        "output 1 None -> None: malformed output",
    ]


def test_missing_runtime_or_image_fails_staging_with_a_fix(tmp_path: Path) -> None:
    task = Task(tmp_path, {}, runtime="no-such-runtime", images=[str(tmp_path / "none.sif")])
    assert task.stage_in() == STAGE_FAILED
    logs = task.read().system_logs
    assert "container.runtime" in logs[0]
    assert logs[1] == f"{IMAGE_UNREADABLE}: {tmp_path / 'none.sif'}"


def test_stage_in_starts_from_a_clean_root(tmp_path: Path) -> None:
    task = Task(tmp_path, {"inputs": [{"path": "/in/x", "content": "new"}]})
    task.layout.root.mkdir()
    (task.layout.root / "in").mkdir()
    (task.layout.root / "in" / "x").symlink_to("/etc/passwd")  # left by an earlier run
    assert task.stage_in() == STAGE_OK
    assert not task.host("/in/x").is_symlink()
    assert Path("/etc/passwd").read_text() != "new"


def test_bound_inputs_are_checked_and_get_a_mount_point(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ref.fa").write_text(">x\n")
    task = Task(
        tmp_path,
        {
            "inputs": [
                {"path": "/ref/ref.fa", "url": f"{shared}/ref.fa"},
                {"path": "/ref/gone.fa", "url": f"{shared}/gone.fa"},
            ]
        },
        file_input_mode="bind",
        bound_inputs=[0, 1],
    )
    assert task.stage_in() == STAGE_FAILED
    assert task.host("/ref/ref.fa").read_text() == ""  # mount point only
    assert "gone.fa" in task.read().system_logs[0]


def test_in_place_inputs_are_checked_and_never_copied(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "js").mkdir(parents=True)
    (shared / "js" / "job").write_text("state")
    inputs = [
        {"path": f"{shared}/js", "url": f"file://{shared}/js", "type": "DIRECTORY"},
        {"path": f"{shared}/js/job", "url": f"{shared}/js/job"},
    ]
    task = Task(tmp_path, {"inputs": inputs}, in_place_inputs=[0, 1])
    assert task.stage_in() == STAGE_OK
    assert not os.path.lexists(task.host(f"{shared}/js"))  # no copy in the task directory
    assert (shared / "js" / "job").read_text() == "state"
    (shared / "js" / "job").unlink()
    assert task.stage_in() == STAGE_FAILED
    assert f"{shared}/js/job" in task.read().system_logs[0]


# --------------------------------------------------------------------------- stage-out


def test_in_place_outputs_are_recorded_not_copied_onto_themselves(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "out" / "dir" / "sub").mkdir(parents=True)
    (shared / "out" / "x.txt").write_text("result\n")
    (shared / "out" / "dir" / "sub" / "b.txt").write_text("bbb")
    outputs = [
        {"path": f"{shared}/out/x.txt", "url": f"file://{shared}/out/x.txt"},
        {"path": f"{shared}/out/dir", "url": f"file://{shared}/out/dir", "type": "DIRECTORY"},
        {"path": f"{shared}/out/none.txt", "url": f"file://{shared}/out/none.txt"},
    ]
    task = Task(tmp_path, {"outputs": outputs}, in_place_outputs=[0, 1, 2])
    inode = (shared / "out" / "x.txt").stat().st_ino
    assert task.stage_out() == STAGE_MISSING_OUTPUTS
    assert (shared / "out" / "x.txt").read_text() == "result\n"
    assert (shared / "out" / "x.txt").stat().st_ino == inode
    assert sorted(task.read().outputs, key=lambda o: o["path"]) == [
        {
            "url": f"file://{shared}/out/dir/sub/b.txt",
            "path": f"{shared}/out/dir/sub/b.txt",
            "size_bytes": "3",
        },
        {"url": f"file://{shared}/out/x.txt", "path": f"{shared}/out/x.txt", "size_bytes": "7"},
    ]
    assert "none.txt: not found" in task.read().system_logs[0]


def test_in_place_outputs_get_their_directory_in_the_shared_dir_before_the_executors(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (shared / "link").symlink_to(tmp_path / "elsewhere")
    outputs = [
        {"path": f"{shared}/a/b/x.txt", "url": f"file://{shared}/a/b/x.txt"},
        {"path": f"{shared}/d", "url": f"file://{shared}/d", "type": "DIRECTORY"},
        {"path": f"{shared}/link/sub/y.txt", "url": f"file://{shared}/link/sub/y.txt"},
    ]
    task = Task(tmp_path, {"outputs": outputs}, in_place_outputs=[0, 1, 2])
    assert task.stage_in() == STAGE_FAILED
    assert (shared / "a" / "b").is_dir() and (shared / "d").is_dir()
    # A link in the shared directory does not lead the job to make directories elsewhere.
    assert not (tmp_path / "elsewhere" / "sub").exists()
    assert "outside the allowed directories" in task.read().system_logs[0]


def test_file_and_directory_outputs_are_uploaded_and_recorded(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    task = Task(
        tmp_path,
        {
            "outputs": [
                {"path": "/out/result.txt", "url": f"file://{shared}/res/result.txt"},
                {"path": "/out/dir", "url": f"{shared}/res/dir", "type": "DIRECTORY"},
            ]
        },
    )
    task.host("/out/dir/sub/empty").mkdir(parents=True)
    task.host("/out/result.txt").write_text("result\n")
    task.host("/out/dir/a.txt").write_text("aa")
    task.host("/out/dir/sub/b.txt").write_text("bbb")
    assert task.stage_out() == STAGE_OK
    assert (shared / "res" / "result.txt").read_text() == "result\n"
    assert (shared / "res" / "dir" / "sub" / "b.txt").read_text() == "bbb"
    assert (shared / "res" / "dir" / "sub" / "empty").is_dir()
    assert oct((shared / "res" / "result.txt").stat().st_mode & 0o777) == oct(0o644)
    assert sorted(task.read().outputs, key=lambda o: o["path"]) == [
        {"url": f"{shared}/res/dir/a.txt", "path": "/out/dir/a.txt", "size_bytes": "2"},
        {"url": f"{shared}/res/dir/sub/b.txt", "path": "/out/dir/sub/b.txt", "size_bytes": "3"},
        {"url": f"file://{shared}/res/result.txt", "path": "/out/result.txt", "size_bytes": "7"},
    ]


def test_wildcard_outputs_are_uploaded_with_the_prefix_removed(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    task = Task(
        tmp_path,
        {
            "outputs": [
                {
                    "path": "/out/*/r[0-9].txt",
                    "url": f"file://{shared}/w/",
                    "path_prefix": "/out/",
                },
                {"path": "/none/*.bam", "url": f"{shared}/n", "path_prefix": "/none"},
            ]
        },
    )
    for name in ("a/r1.txt", "b/r2.txt", "b/rx.txt", "b/.hidden/r3.txt", ".c/r4.txt"):
        task.host(f"/out/{name}").parent.mkdir(parents=True, exist_ok=True)
        task.host(f"/out/{name}").write_text(name)
    assert task.stage_out() == STAGE_OK
    assert (shared / "w" / "a" / "r1.txt").read_text() == "a/r1.txt"
    assert (shared / "w" / "b" / "r2.txt").read_text() == "b/r2.txt"
    assert not (shared / "w" / "b" / "rx.txt").exists()
    assert not (shared / "w" / ".c").exists()
    records = task.read()
    assert [o["path"] for o in records.outputs] == ["/out/a/r1.txt", "/out/b/r2.txt"]
    assert records.outputs[0]["url"] == f"file://{shared}/w/a/r1.txt"
    assert any("no file matched" in line for line in records.system_logs)


def test_missing_output_is_logged_and_the_others_still_uploaded(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    task = Task(
        tmp_path,
        {
            "outputs": [
                {"path": "/out/missing.txt", "url": f"{shared}/missing.txt"},
                {"path": "/out/present.txt", "url": f"{shared}/present.txt"},
            ]
        },
    )
    task.host("/out").mkdir(parents=True)
    task.host("/out/present.txt").write_text("here")
    assert task.stage_out() == STAGE_MISSING_OUTPUTS
    assert (shared / "present.txt").read_text() == "here"
    records = task.read()
    assert [o["path"] for o in records.outputs] == ["/out/present.txt"]
    assert "/out/missing.txt" in records.system_logs[0] and "not found" in records.system_logs[0]


def test_file_output_that_is_a_directory_is_uploaded_as_a_directory(tmp_path: Path) -> None:
    """nf-ga4gh sends `path "index"` as a FILE output: the executor made a directory there."""
    shared = tmp_path / "shared"
    task = Task(tmp_path, {"outputs": [{"path": "/work/index", "url": f"{shared}/res/index"}]})
    task.host("/work/index/sub/empty").mkdir(parents=True)
    task.host("/work/index/a.txt").write_text("aa")
    task.host("/work/index/sub/b.txt").write_text("bbb")
    task.host("/work/index/escape").symlink_to("/etc/hostname")
    assert task.stage_out() == STAGE_OK
    assert (shared / "res" / "index" / "a.txt").read_text() == "aa"
    assert (shared / "res" / "index" / "sub" / "b.txt").read_text() == "bbb"
    assert (shared / "res" / "index" / "sub" / "empty").is_dir()
    assert not (shared / "res" / "index" / "escape").exists()
    records = task.read()
    assert sorted(records.outputs, key=lambda o: o["path"]) == [
        {"url": f"{shared}/res/index/a.txt", "path": "/work/index/a.txt", "size_bytes": "2"},
        {
            "url": f"{shared}/res/index/sub/b.txt",
            "path": "/work/index/sub/b.txt",
            "size_bytes": "3",
        },
    ]
    assert records.system_logs[0] == (
        f"output 0 /work/index -> {shared}/res/index: is a directory (output type is FILE); "
        "uploaded as a directory"
    )
    assert "/work/index/escape is a symbolic link; not uploaded" in records.system_logs[1]


def test_in_place_file_output_that_is_a_directory_is_recorded_as_a_directory(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    (shared / "index" / "sub").mkdir(parents=True)
    (shared / "index" / "sub" / "b.txt").write_text("bbb")
    outputs = [{"path": f"{shared}/index", "url": f"file://{shared}/index"}]
    task = Task(tmp_path, {"outputs": outputs}, in_place_outputs=[0])
    assert task.stage_out() == STAGE_OK
    records = task.read()
    assert records.outputs == [
        {
            "url": f"file://{shared}/index/sub/b.txt",
            "path": f"{shared}/index/sub/b.txt",
            "size_bytes": "3",
        }
    ]
    assert (
        "is a directory (output type is FILE); uploaded as a directory" in (records.system_logs[0])
    )


def test_missing_outputs_ignored_are_logged_by_path_and_not_listed(tmp_path: Path) -> None:
    """storage.missing_outputs = "ignore": optional outputs of Nextflow's processes."""
    shared = tmp_path / "shared"
    (shared / "inplace").mkdir(parents=True)
    outputs = [
        {"path": "/out/extra.txt", "url": f"{shared}/extra.txt"},
        {"path": "/out/dir", "url": f"{shared}/dir", "type": "DIRECTORY"},
        {"path": "/out/present.txt", "url": f"{shared}/present.txt"},
        {"path": f"{shared}/inplace/none.txt", "url": f"file://{shared}/inplace/none.txt"},
        {"path": "/out/*.bam", "url": f"{shared}/bams", "path_prefix": "/out"},
    ]
    task = Task(tmp_path, {"outputs": outputs}, missing_outputs="ignore", in_place_outputs=[3])
    task.host("/out").mkdir(parents=True)
    task.host("/out/present.txt").write_text("here")
    assert task.stage_out() == STAGE_OK
    records = task.read()
    assert [o["path"] for o in records.outputs] == ["/out/present.txt"]
    ignored = "not found after the executors ran; ignored (storage.missing_outputs)"
    assert records.system_logs[:3] == [
        f"output 0 /out/extra.txt -> {shared}/extra.txt: {ignored}",
        f"output 1 /out/dir -> {shared}/dir: {ignored}",
        f"output 3 {shared}/inplace/none.txt -> file://{shared}/inplace/none.txt: {ignored}",
    ]
    # What is there but unusable still fails the task.
    task = Task(tmp_path / "b", {"outputs": outputs[:1]}, missing_outputs="ignore")
    task.host("/out").mkdir(parents=True)
    task.host("/out/extra.txt").symlink_to("/etc/hostname")
    assert task.stage_out() == STAGE_MISSING_OUTPUTS


def test_output_outside_the_allowed_dirs_is_an_upload_failure(tmp_path: Path) -> None:
    task = Task(tmp_path, {"outputs": [{"path": "/out/x", "url": "file:///etc/tes-test-x"}]})
    task.host("/out").mkdir(parents=True)
    task.host("/out/x").write_text("x")
    assert task.stage_out() == STAGE_FAILED
    assert not Path("/etc/tes-test-x").exists()
    assert "outside the allowed directories" in task.read().system_logs[0]


def test_symlink_planted_by_an_executor_never_uploads_the_host_file(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    task = Task(
        tmp_path,
        {
            "outputs": [
                {"path": "/out/out.txt", "url": f"{shared}/out.txt"},
                {"path": "/linkdir/x.txt", "url": f"{shared}/x.txt"},
                {"path": "/out/dir", "url": f"{shared}/dir", "type": "DIRECTORY"},
                {"path": "/out/*.log", "url": f"{shared}/logs", "path_prefix": "/out"},
            ]
        },
    )
    task.host("/out/dir").mkdir(parents=True)
    task.host("/out/out.txt").symlink_to(secret)  # ln -s /etc/shadow /outputs/out.txt
    task.layout.root.joinpath("linkdir").symlink_to(tmp_path)  # a link as a parent directory
    (tmp_path / "x.txt").write_text("host file via parent link")
    task.host("/out/dir/leak").symlink_to(secret)
    task.host("/out/dir/ok.txt").write_text("fine")
    task.host("/out/a.log").symlink_to(secret)
    task.stage_out()
    assert not (shared / "out.txt").exists()
    assert not (shared / "x.txt").exists()
    assert not (shared / "dir" / "leak").exists()
    assert not (shared / "logs" / "a.log").exists()
    assert (shared / "dir" / "ok.txt").read_text() == "fine"
    uploaded = "".join(p.read_text() for p in shared.rglob("*") if p.is_file())
    assert "host" not in uploaded
    logs = "\n".join(task.read().system_logs)
    assert "symbolic link" in logs


def test_directory_output_logs_a_link_to_a_directory_and_does_not_follow_it(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("host secret")
    task = Task(
        tmp_path, {"outputs": [{"path": "/out/d", "url": f"{shared}/d", "type": "DIRECTORY"}]}
    )
    task.host("/out/d/sub").mkdir(parents=True)
    task.host("/out/d/sub/ok.txt").write_text("fine")
    task.host("/out/d/sub/linked").symlink_to(elsewhere)
    assert task.stage_out() == STAGE_OK
    assert (shared / "d" / "sub" / "ok.txt").read_text() == "fine"
    assert not os.path.lexists(shared / "d" / "sub" / "linked")  # not even an empty directory
    logs = task.read().system_logs
    assert any(
        "/out/d/sub/linked is a symbolic link to a directory" in line and "not uploaded" in line
        for line in logs
    ), logs


def test_fifo_output_is_skipped_without_hanging(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    task = Task(
        tmp_path, {"outputs": [{"path": "/out/d", "url": f"{shared}/d", "type": "DIRECTORY"}]}
    )
    task.host("/out/d").mkdir(parents=True)
    os.mkfifo(task.host("/out/d/pipe"))
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(task.stage_out()), daemon=True)
    worker.start()
    worker.join(10)
    assert result == [STAGE_OK]
    assert "not a regular file" in task.read().system_logs[0]


def test_upload_replaces_a_link_at_the_destination_instead_of_following_it(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    (shared / "out.txt").symlink_to(victim)
    task = Task(tmp_path, {"outputs": [{"path": "/out/o", "url": f"{shared}/out.txt"}]})
    task.host("/out").mkdir(parents=True)
    task.host("/out/o").write_text("new")
    assert task.stage_out() == STAGE_OK
    assert victim.read_text() == "untouched"
    assert (shared / "out.txt").read_text() == "new"
    assert not (shared / "out.txt").is_symlink()


# --------------------------------------------------------------------------- safe stdio (exec)


def test_exec_refuses_to_write_stdout_through_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("host file")
    task = Task(
        tmp_path,
        {"executors": [{"image": "x", "command": ["true"], "stdout": "/out/log.txt"}]},
    )
    task.host("/out").mkdir(parents=True)
    task.host("/out/log.txt").symlink_to(victim)
    code = run_executor(task.layout.task_dir, task.records, 0, ["echo", "overwritten"])
    assert code == EXIT_CANNOT_START
    assert victim.read_text() == "host file"
    assert "cannot open stdout /out/log.txt" in task.read().system_logs[0]


def test_exec_runs_with_stdin_and_own_stdout_files(tmp_path: Path) -> None:
    task = Task(
        tmp_path,
        {
            "executors": [
                {
                    "image": "x",
                    "command": ["cat"],
                    "stdin": "/in/data",
                    "stdout": "/out/new/cat.txt",
                }
            ]
        },
    )
    task.host("/in").mkdir(parents=True)
    task.host("/in/data").write_text("piped through\n")
    args = ["exec", "--task-dir", str(task.layout.task_dir), "--records", str(task.records)]
    argv = [*args, "--index", "0", "--", "cat"]
    script = f"from bridge.job.cli import main; raise SystemExit(main({argv!r}))"
    result = subprocess.run(
        [sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=30
    )
    assert result.returncode == 0
    assert task.host("/out/new/cat.txt").read_text() == "piped through\n"
    (task.records / "executors" / "0" / "exit_code").write_text("0\n")
    assert task.read().executors[0].stdout == "piped through\n"


def test_exec_takes_dev_null_for_the_real_one(tmp_path: Path) -> None:
    executor = {"image": "x", "command": ["x"], "stdin": "/dev/null", "stdout": "/dev/null"}
    task = Task(tmp_path, {"executors": [executor]})
    args = ["exec", "--task-dir", str(task.layout.task_dir), "--records", str(task.records)]
    argv = [*args, "--index", "0", "--", "sh", "-c", "cat; echo discarded"]
    script = f"from bridge.job.cli import main; raise SystemExit(main({argv!r}))"
    result = subprocess.run(
        [sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=30
    )
    assert result.returncode == 0
    assert not task.layout.root.exists()


def test_exec_without_command_is_a_usage_error(tmp_path: Path) -> None:
    task = Task(tmp_path, {})
    args = ["exec", "--task-dir", str(task.layout.task_dir), "--records", str(task.records)]
    assert job_main([*args, "--index", "0", "--"]) == 2


# --------------------------------------------------------------------------- records reader


def test_reader_on_a_job_that_never_started(tmp_path: Path) -> None:
    records = read_records(tmp_path / "nothing", "5", keep_bytes=10)
    assert records.phase is None and records.outcome is None and records.executors == []
    assert not records.started
    assert read_records(tmp_path, "../x", keep_bytes=10).phase is None


def test_reader_shows_the_running_executor_and_its_output_so_far(tmp_path: Path) -> None:
    task = Task(tmp_path, {})
    edir = task.records / "executors"
    (edir / "0").mkdir(parents=True)
    (edir / "1").mkdir()
    (task.records / "phase").write_text("running 1\n")
    (task.records / "start_time").write_text("2024-05-01T10:00:00.000Z\n")
    (edir / "0" / "start_time").write_text("2024-05-01T10:00:01.000Z\n")
    (edir / "0" / "end_time").write_text("2024-05-01T10:00:02.500Z\n")
    (edir / "0" / "exit_code").write_text("0\n")
    (edir / "0" / "stdout").write_bytes(b"x" * 5000 + b"tail\n")
    (edir / "1" / "start_time").write_text("2024-05-01T10:00:03.000Z\n")
    (edir / "1" / "stdout").write_bytes(b"so far \xff\xfe")
    records = task.read(keep_bytes=10)
    assert records.phase == "running 1"
    assert records.outcome is None
    assert records.start_time is not None and records.start_time.tzinfo is not None
    first, second = records.executors
    # Longer than the 10 bytes kept: its head and tail, and a line that says what is not.
    marker = (
        "[tes-bridge: 4,995 of 5,005 bytes left out here; the whole stdout: "
        "GET /ga4gh/tes/v1/tasks/t1/output?executor=0&stream=stdout]"
    )
    assert (first.exit_code, first.stdout) == (0, f"xx\n{marker}\nxxxtail\n")
    assert first.end_time is not None and (first.end_time - first.start_time).total_seconds() == 1.5
    assert second.exit_code is None and second.end_time is None
    assert second.stdout == "so far \ufffd\ufffd"


def test_reader_survives_partial_and_garbage_files(tmp_path: Path) -> None:
    task = Task(tmp_path, {})
    edir = task.records / "executors"
    (edir / "0").mkdir(parents=True)
    (edir / "7").mkdir()  # not contiguous: ignored
    (edir / "junk").mkdir()
    (task.records / "phase").write_bytes(b"\x00\xff")
    (task.records / "outcome").write_text("exploded\n")
    (task.records / "start_time").write_text("yesterday")
    (edir / "0" / "exit_code").write_text("")  # killed while writing
    (edir / "0" / "start_time").mkdir()  # not even a file
    os.mkfifo(edir / "0" / "stdout")
    writer = RecordsWriter(task.records)
    writer.output(url="file:///x", path="/x", size_bytes=3)
    writer.system_log("first")
    with open(task.records / "outputs.jsonl", "a") as handle:
        handle.write('[1, 2]\n{"url": 3}\n{"url": "file:///y", "path": "/y", "size_')
    with open(task.records / "system_logs.jsonl", "ab") as handle:
        handle.write(b"\xff\xfe garbage\n")
    records = task.read()
    assert records.outcome is None
    assert records.start_time is None
    assert [e.index for e in records.executors] == [0]
    assert records.executors[0].exit_code is None and records.executors[0].stdout == ""
    assert records.outputs == [{"url": "file:///x", "path": "/x", "size_bytes": "3"}]
    assert records.system_logs == ["first"]


def test_reader_refuses_an_own_stdout_that_became_a_link(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    task = Task(tmp_path, {"executors": [{"image": "x", "command": ["x"], "stdout": "/o/log"}]})
    (task.records / "executors" / "0").mkdir(parents=True)
    task.host("/o").mkdir(parents=True)
    task.host("/o/log").symlink_to(secret)
    assert task.read().executors[0].stdout == ""


def _excerpt_of(tmp_path: Path, data: bytes, keep: int, **executor: str) -> str:
    """What the reader keeps of executor 0's stderr when it wrote `data`."""
    task = Task(tmp_path, {"executors": [{"image": "x", "command": ["x"], **executor}]})
    (task.records / "executors" / "0").mkdir(parents=True)
    if "stderr" in executor:
        task.host(executor["stderr"]).parent.mkdir(parents=True)
        task.host(executor["stderr"]).write_bytes(data)
    else:
        (task.records / "executors" / "0" / "stderr").write_bytes(data)
    return str(task.read(keep_bytes=keep).executors[0].stderr)


def _cut(text: str) -> tuple[str, int, int, str]:
    """(head, left out, size, tail) of an excerpt with one marker line."""
    match = re.search(
        r"^\[tes-bridge: ([\d,]+) of ([\d,]+) bytes left out here; the whole stderr: GET "
        r"/ga4gh/tes/v1/tasks/t1/output\?executor=0&stream=stderr\]\n",
        text,
        re.MULTILINE,
    )
    assert match, text[:300]
    left_out, size = (int(group.replace(",", "")) for group in match.groups())
    return text[: match.start()], left_out, size, text[match.end() :]


def test_a_long_stream_keeps_its_first_error_and_its_end_and_says_what_is_left_out(
    tmp_path: Path,
) -> None:
    """The reported case: the real error on the first line of 39 KB of stderr."""
    lines = [b"Error: reference genome.fa not found\n"]
    lines += [f"warning {n}: retrying\n".encode() for n in range(1, 1750)]
    data = b"".join(lines)
    assert len(data) > 39_000
    text = _excerpt_of(tmp_path, data, 10240)
    head, left_out, size, tail = _cut(text)
    assert head.startswith("Error: reference genome.fa not found\n")
    assert size == len(data)
    # Cut at line ends: the head ends a line, the tail begins one, and they fit what is kept.
    assert head.endswith("\n") and data.startswith(head.encode())
    assert data.endswith(tail.encode()) and tail.startswith("warning ")
    assert b"\n" + tail.encode() in data and tail.endswith("warning 1749: retrying\n")
    assert len(head.encode()) + len(tail.encode()) + left_out == len(data)
    assert len(head.encode()) <= 2048 and len(tail.encode()) <= 10240 - 2048
    assert len(head.encode()) + len(tail.encode()) > 10240 - 200  # little lost to the cuts


def test_a_stream_that_fits_is_kept_whole_without_a_marker(tmp_path: Path) -> None:
    data = "".join(f"line {n} ✓\n" for n in range(100)).encode()
    assert _excerpt_of(tmp_path, data, len(data)) == data.decode()
    assert _excerpt_of(tmp_path / "empty", b"", 0) == ""


def test_lines_longer_than_the_excerpt_are_cut_inside_never_inside_a_character(
    tmp_path: Path,
) -> None:
    data = ("é" * 3000 + "\n").encode()  # one 6 KB line of two-byte characters
    head, left_out, size, tail = _cut(_excerpt_of(tmp_path, data, 1001))
    assert size == 6001
    assert head == "é" * 100 + "\n"  # 200 bytes; the line goes on past the cut
    assert tail == "é" * 400 + "\n"  # from the first whole character of the last 800 bytes
    assert left_out == 6001 - 200 - 801
    # Nothing kept: the marker alone says what there was.
    assert _cut(_excerpt_of(tmp_path / "none", data, 0))[:3] == ("", 6001, 6001)


def test_an_executors_own_stderr_path_is_kept_the_same_way(tmp_path: Path) -> None:
    data = b"first\n" + b"x" * 100 + b"\n" + b"y\n" * 10 + b"last\n"
    head, left_out, size, tail = _cut(_excerpt_of(tmp_path, data, 40, stderr="/logs/err.txt"))
    assert (head, tail) == ("first\n", "y\n" * 10 + "last\n")
    assert (left_out, size) == (101, len(data))


def test_safepath_creates_parents_and_refuses_links_on_the_way(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    fd = safepath.open_write(root, ("a", "b", "c.txt"))
    os.write(fd, b"ok")
    os.close(fd)
    assert (root / "a" / "b" / "c.txt").read_text() == "ok"
    (root / "evil").symlink_to(tmp_path)
    with pytest.raises(safepath.UnsafePathError):
        safepath.open_write(root, ("evil", "x.txt"))
    assert not (tmp_path / "x.txt").exists()
    assert safepath.lstat_kind(root, ("evil",)) == "link"
    assert safepath.lstat_kind(root, ("evil", "root")) is None


# --------------------------------------------------------------------------- the job script


FAKE_RUNTIME = """#!/bin/bash
# Stand-in for apptainer in unit tests: drops the runtime flags and runs the command on the
# host (the real runtime is exercised in tests/cluster).
while [[ $1 != exec ]]; do shift; done
shift
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    --home) export HOME=$2; shift 2 ;;
    --bind|--mount|--pwd) shift 2 ;;
    *) shift ;;
  esac
done
shift
for v in ${!APPTAINERENV_@}; do export "${v#APPTAINERENV_}=${!v}"; done
exec "$@"
"""


def stand_in_runtime(tmp_path: Path) -> tuple[Path, Path]:
    """FAKE_RUNTIME as `tmp_path/apptainer`, and an empty image `tmp_path/img.sif` for it."""
    runtime = tmp_path / "apptainer"
    runtime.write_text(FAKE_RUNTIME)
    runtime.chmod(0o755)
    image = tmp_path / "img.sif"
    image.write_text("")
    return runtime, image


def run_job(
    tmp_path: Path,
    task: dict[str, Any],
    container_umask: str = "022",
    *,
    args: Sequence[str] = (),
    fence: int | None = None,
    python: str = sys.executable,
    job: dict[str, Any] | None = None,
    **storage: Any,
) -> tuple[int, Any]:
    """Render the task and run its job script with `args` (the task directory fenced at lease
    epoch `fence` first; `python` the job side's interpreter); its exit code and records."""
    tmp_path.mkdir(exist_ok=True)
    runtime, image = stand_in_runtime(tmp_path)
    config = Config.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "container": {"runtime": str(runtime), "allow_root": True, "umask": container_umask},
            "storage": {"allowed_dirs": [str(tmp_path / "shared")], **storage},
            "job": {"python": python, **(job or {})},
        }
    )
    task = {"id": "job-1", **task}
    script = prepare_task_dir(task, config=config, image_paths={"img": str(image)})
    if fence is not None:
        write_lease_fence(script.parent, fence)
    env = dict(os.environ, SLURM_JOB_ID="9", PYTHONPATH=str(REPO))
    started = time.monotonic()
    argv = ["bash", str(script), *args]
    result = subprocess.run(argv, env=env, capture_output=True, timeout=60)
    assert time.monotonic() - started < 30
    return result.returncode, read_records(script.parent, "9", keep_bytes=1024)


def sh(command: str, **extra: Any) -> dict[str, Any]:
    return {"image": "img", "command": ["sh", "-c", command], **extra}


def test_job_script_records_a_complete_run(tmp_path: Path) -> None:
    code, records = run_job(tmp_path, {"executors": [sh("echo hello; echo oops >&2")]})
    assert code == 0
    assert records.outcome == "complete" and records.phase == "done"
    assert [(e.exit_code, e.stdout, e.stderr) for e in records.executors] == [
        (0, "hello\n", "oops\n")
    ]
    assert records.start_time <= records.executors[0].start_time <= records.end_time


def test_a_job_of_an_earlier_lease_epoch_stands_down_where_the_task_is_fenced(
    tmp_path: Path,
) -> None:
    """Two login nodes: a leader frozen between its lease check and sbatch submits after the new
    leader fenced the task (at its own epoch) and submitted it again. The stale job runs nothing
    and records nothing; a job of the fence's epoch, or of any epoch where there is no fence,
    runs the task."""
    marker = tmp_path / "ran"
    task = {"executors": [sh(f"touch {marker}")]}
    code, records = run_job(tmp_path / "stale", task, args=["lease-epoch=4"], fence=5)
    assert code == SUPERSEDED_EXIT_CODE
    assert not marker.exists() and not records.started
    code, records = run_job(tmp_path / "current", task, args=["lease-epoch=5"], fence=5)
    assert code == 0 and records.outcome == "complete" and marker.exists()
    marker.unlink()
    code, records = run_job(tmp_path / "unfenced", task, args=["lease-epoch=1"])
    assert code == 0 and records.outcome == "complete" and marker.exists()
    code, _ = run_job(tmp_path / "bad", task, args=["lease-epoch=1x"], fence=5)
    assert code == 2


def test_job_script_that_cannot_start_its_records_exits_with_its_own_code(
    tmp_path: Path,
) -> None:
    """As on a full work filesystem: nothing of the task runs, no records, and an exit code the
    poller takes for a job lost through no fault of the task (docs/states.md)."""
    marker = tmp_path / "ran"
    task = {"id": "job-1", "executors": [sh(f"touch {marker}")]}
    config = Config.model_validate(
        {"state_dir": str(tmp_path / "state"), "container": {"allow_root": True}}
    )
    script = prepare_task_dir(task, config=config, image_paths={"img": str(tmp_path / "i.sif")})
    (script.parent / "records").write_text("")  # no directory can be made under it
    env = dict(os.environ, SLURM_JOB_ID="9", PYTHONPATH=str(REPO))
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=60)
    assert result.returncode == NO_RECORDS_EXIT_CODE, result.stderr
    assert b"cannot write the job records" in result.stderr
    assert not marker.exists()
    assert not read_records(script.parent, "9", keep_bytes=1024).started


def test_job_script_that_cannot_write_its_outcome_exits_with_the_no_records_code(
    tmp_path: Path,
) -> None:
    """The work filesystem fills up after the executors ran: the outcome cannot be written.
    The job ends with the no-records code (a job lost through no fault of the task), not 1."""
    outcome_tmp = tmp_path / "state" / "work" / "job-1" / "records" / "9" / "outcome.tmp"
    code, records = run_job(tmp_path, {"executors": [sh(f"mkdir -p {outcome_tmp}")]})
    assert code == NO_RECORDS_EXIT_CODE
    assert records.outcome is None and records.phase == "uploading"
    assert [e.exit_code for e in records.executors] == [0]


def test_job_script_that_cannot_write_a_system_log_line_exits_with_the_no_records_code(
    tmp_path: Path,
) -> None:
    """The work filesystem fills while inputs are staged: staging fails, and so does the
    script's line saying so. The job ends with the no-records code, to be submitted again;
    it exited 1 (a failed task: "ended in state FAILED (exit code 1) without recording an
    outcome"), as the nemesis found. A directory in the log's place stands in for the full
    filesystem: a stand-in for the job-side Python fails staging after making it."""
    stage_in = tmp_path / "python"
    stage_in.write_text(
        '#!/bin/bash\nwhile [ "$1" != --records ]; do shift; done\n'
        'mkdir -- "$2/system_logs.jsonl"\nexit 1\n'
    )
    stage_in.chmod(0o755)
    task = {
        "id": "job-1",
        "inputs": [{"path": "/in/x", "content": "x"}],
        "executors": [sh(f"touch {tmp_path / 'ran'}")],
    }
    config = Config.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "container": {"allow_root": True},
            "job": {"python": str(stage_in)},
        }
    )
    script = prepare_task_dir(task, config=config, image_paths={"img": str(tmp_path / "i.sif")})
    env = dict(os.environ, SLURM_JOB_ID="9")
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=60)
    assert result.returncode == NO_RECORDS_EXIT_CODE, result.stderr
    assert not (tmp_path / "ran").exists()
    assert read_records(script.parent, "9", keep_bytes=1024).outcome is None


def test_job_script_whose_stage_out_cannot_record_its_outputs_exits_with_the_no_records_code(
    tmp_path: Path,
) -> None:
    """The work filesystem fills after the executors ran: the upload went, but stage-out
    cannot record it (nor say why). The job ends with the no-records code, to be submitted
    again; it was a SYSTEM_ERROR ("uploading outputs failed after every executor succeeded"),
    as the nemesis found on Slurm 26.05. A directory in the outputs record's place stands in
    for the full filesystem."""
    task_dir = tmp_path / "state" / "work" / "job-1"
    outputs_record = task_dir / "records" / "9" / "outputs.jsonl"
    shared = tmp_path / "shared"
    shared.mkdir()
    task = {
        "outputs": [{"path": "/out/x", "url": str(shared / "x")}],
        # The stand-in runtime runs on the host: the container's /out is root/out there.
        "executors": [sh(f"echo y > {task_dir}/root/out/x && mkdir -p {outputs_record}")],
    }
    code, records = run_job(tmp_path, task)
    assert code == NO_RECORDS_EXIT_CODE
    assert records.outcome is None and records.phase == "uploading"
    assert [e.exit_code for e in records.executors] == [0]


def test_job_script_started_again_under_its_id_after_its_end_does_not_run_again(
    tmp_path: Path,
) -> None:
    """A slurmctld killed -9 restores a state saved before the job ended and starts the job
    again under the same id: the executors must not run a second time."""
    marker = tmp_path / "runs"
    code, records = run_job(tmp_path, {"executors": [sh(f"echo ran >> {marker}")]})
    assert (code, records.outcome) == (0, "complete")
    script = tmp_path / "state" / "work" / "job-1" / "job.sh"
    env = dict(os.environ, SLURM_JOB_ID="9", PYTHONPATH=str(REPO))
    again = subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=60)
    assert again.returncode == 0 and b"does not run again" in again.stderr
    assert marker.read_text() == "ran\n"
    assert read_records(script.parent, "9", keep_bytes=1024).outcome == "complete"


def test_job_script_stops_at_the_first_failure_unless_ignored(tmp_path: Path) -> None:
    # The job exits with the failing executor's code: sacct shows it FAILED 3:0, as the task.
    code, records = run_job(tmp_path, {"executors": [sh("exit 3"), sh("echo never")]})
    assert (code, records.outcome) == (3, "executor_error")
    assert [e.exit_code for e in records.executors] == [3]
    code, records = run_job(
        tmp_path / "b", {"executors": [sh("exit 3", ignore_error=True), sh("echo next")]}
    )
    assert (code, records.outcome) == (0, "complete")
    assert [(e.exit_code, e.stdout) for e in records.executors] == [(3, ""), (0, "next\n")]


def test_job_script_staging_failure_is_a_system_error_before_any_executor(
    tmp_path: Path,
) -> None:
    task = {"inputs": [{"path": "/in/x", "url": "sftp://host/x"}], "executors": [sh("true")]}
    code, records = run_job(tmp_path, task)
    assert code == STAGE_IN_EXIT_CODE
    assert records.outcome == "system_error" and records.executors == []
    assert "sftp://host/x" in records.system_logs[0]
    assert "not supported by this deployment yet" in records.system_logs[0]
    assert records.system_logs[-1] == "staging inputs failed; no executor ran"


def python_killed_in(tmp_path: Path, subcommand: str) -> str:
    """A job-side interpreter whose `subcommand` is killed by SIGKILL (as the out-of-memory
    killer would) before it writes anything."""
    wrapper = tmp_path / "python"
    wrapper.write_text(
        f'#!/bin/sh\ncase " $* " in *" {subcommand} "*) kill -9 $$ ;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.parametrize(
    ("subcommand", "exit_code", "system_logs"),
    [
        (
            "stage-in",
            STAGE_IN_EXIT_CODE,
            ["the stage-in process was killed by signal 9", STAGE_IN_FAILED],
        ),
        (
            "stage-out",
            STAGE_OUT_EXIT_CODE,
            ["the stage-out process was killed by signal 9", STAGE_OUT_FAILED],
        ),
    ],
)
def test_job_script_names_a_staging_process_killed_by_a_signal(
    tmp_path: Path, subcommand: str, exit_code: int, system_logs: list[str]
) -> None:
    """A staging process that dies without writing its own reason still leaves one."""
    task = {
        "inputs": [{"path": "/in/x", "content": "x"}],
        "outputs": [{"path": "/out/x", "url": str(tmp_path / "shared" / "x")}],
        "executors": [sh("true")],
    }
    code, records = run_job(tmp_path, task, python=python_killed_in(tmp_path, subcommand))
    assert (code, records.outcome) == (exit_code, "system_error")
    assert records.system_logs == system_logs


@pytest.mark.parametrize(("stage", "cls"), [("in", StageIn), ("out", StageOut)])
def test_an_unexpected_error_while_staging_is_named_in_the_tasks_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str, cls: type
) -> None:
    def defect(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("no handler near https://someone:secret@store.example/x")

    monkeypatch.setattr(cls, "stage", defect)
    task = Task(
        tmp_path,
        {
            "inputs": [{"path": "/in/x", "content": "x"}],
            "outputs": [{"path": "/in/x", "url": str(tmp_path / "shared" / "x")}],
        },
    )
    with pytest.raises(RuntimeError):  # its traceback goes on to the job's output file
        task.stage_in() if stage == "in" else task.stage_out()
    what = "staging inputs" if stage == "in" else "uploading outputs"
    assert task.read().system_logs == [
        f"{what} stopped on an unexpected error: RuntimeError: no handler near "
        "https://***@store.example/x"
    ]


def test_job_script_without_a_scratch_directory_exits_with_its_own_code(tmp_path: Path) -> None:
    """No executor can run without its /tmp: a SYSTEM_ERROR, and sacct shows the job FAILED
    with SCRATCH_EXIT_CODE (not an executor's code, nor 1)."""
    task = {"executors": [sh("echo never")]}
    code, records = run_job(tmp_path, task, job={"scratch_dir": str(tmp_path / "no-such")})
    assert (code, records.outcome) == (SCRATCH_EXIT_CODE, "system_error")
    assert records.executors == []


def test_job_script_missing_output_after_success_is_a_system_error(tmp_path: Path) -> None:
    task = {
        "outputs": [{"path": "/out/x", "url": str(tmp_path / "shared" / "x")}],
        "executors": [sh("true")],
    }
    code, records = run_job(tmp_path, task, missing_outputs="fail")
    assert (code, records.outcome) == (STAGE_OUT_EXIT_CODE, "system_error")
    assert records.system_logs[-1] == STAGE_OUT_FAILED
    code, records = run_job(
        tmp_path / "b", {**task, "executors": [sh("exit 1")]}, missing_outputs="fail"
    )
    assert (code, records.outcome) == (1, "executor_error")
    assert STAGE_OUT_FAILED not in records.system_logs
    # The default, "ignore": the task completes, the log names the output.
    code, records = run_job(tmp_path / "c", task)
    assert (code, records.outcome) == (0, "complete")
    assert "output 0 /out/x -> " in records.system_logs[0]


def test_job_script_gives_an_executor_its_env_home(tmp_path: Path) -> None:
    task = {"executors": [sh('echo "$HOME|$OTHER"', env={"HOME": "/out", "OTHER": "x"})]}
    code, records = run_job(tmp_path, task)
    assert (code, records.outcome) == (0, "complete")
    assert records.executors[0].stdout == "/out|x\n"


def test_executors_run_with_the_configured_umask_and_records_stay_private(
    tmp_path: Path,
) -> None:
    task = {
        "executors": [
            sh("umask"),
            sh("umask", stdout="/out/umask.txt"),  # through the Python exec wrapper
            sh("umask"),
        ],
        "outputs": [{"path": "/out/umask.txt", "url": str(tmp_path / "shared" / "x")}],
    }
    code, records = run_job(tmp_path, task)
    assert (code, records.outcome) == (0, "complete")
    assert [e.stdout for e in records.executors] == ["0022\n", "0022\n", "0022\n"]
    task_dir = tmp_path / "state" / "work" / "job-1"
    assert (task_dir / "root" / "out" / "umask.txt").stat().st_mode & 0o777 == 0o644
    for name in ("stdout", "stderr"):
        assert (task_dir / "records" / "9" / "executors" / "0" / name).stat().st_mode & 0o777 == (
            0o600
        )
    # The job's own files after the executors ran keep the strict umask.
    assert (task_dir / "records" / "9" / "outcome").stat().st_mode & 0o777 == 0o600
    code, records = run_job(tmp_path / "b", task, container_umask="0007")
    assert [e.stdout for e in records.executors] == ["0007\n", "0007\n", "0007\n"]


def test_exec_refuses_to_run_an_executor_as_root(tmp_path: Path, monkeypatch) -> None:
    """A job of root (a submission that bypassed the service's own check) runs no executor
    unless container.allow_root was set when the task was rendered."""
    marker = tmp_path / "ran"
    task = Task(tmp_path, {}, allow_root=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    code = run_executor(task.layout.task_dir, task.records, 0, ["touch", str(marker)])
    assert code == EXIT_CANNOT_START
    assert not marker.exists()
    assert "refusing to run as root" in task.read().system_logs[0]
