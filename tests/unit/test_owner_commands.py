"""Site mode's job-side commands (`python -m bridge.job adopt|read-records|remove|fence`), run
through sudo as a task's owner: only task directories directly inside the work directory, each
option once (a sudo wildcard matches spaces, and argparse keeps the last of repeated options)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def job(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bridge.job", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.fixture
def work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    (work / "t1").mkdir(parents=True)
    return work


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    victim = tmp_path / "home" / "t2"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    return victim


FILES = json.dumps({"task.json": "{}", "job-config.json": "{}", "job.sh": "#!/bin/sh\n"})


@pytest.mark.parametrize(
    "argv",
    [
        ["remove", "--work-dir", "{work}", "--task-dir", "{work}/t1", "--task-dir", "{victim}"],
        ["remove", "--work-dir", "{work}", "--task-dir", "{work}/t1", "--task-dir={victim}"],
        ["remove", "--work-dir", "{work}", "--task-dir", "{victim}", "--work-dir", "{home}"],
        ["adopt", "--work-dir", "{work}", "--task-dir", "{work}/t1", "--task-dir", "{victim}"],
        ["read-records", "--work-dir", "{work}", "--tail-bytes", "1", "--work-dir", "{home}"],
        ["read-records", "--work-dir", "{work}", "--tail-bytes", "1", "--tail-bytes", "2"],
        [
            "fence",
            "--work-dir",
            "{work}",
            "--task-dir",
            "{work}/t1",
            "--epoch",
            "1",
            "--task-dir",
            "{victim}",
        ],
    ],
)
def test_repeated_options_are_refused(work: Path, victim: Path, argv: list[str]) -> None:
    values = {"work": str(work), "victim": str(victim), "home": str(victim.parent)}
    result = job(*(a.format(**values) for a in argv), stdin=FILES)
    assert result.returncode == 2, result.stderr
    assert "given more than once" in result.stderr
    assert (victim / "precious.txt").read_text() == "keep me"
    assert not (victim / "task.json").exists()


@pytest.mark.parametrize(
    "task_dir",
    [
        "{victim}",  # outside
        "{work}/../home/t2",  # not normalised
        "{work}/t1/../../home/t2",
        "{work}//t2",
        "{work}/sub/t2",  # not directly inside
        "{work}/linked",  # a link leading outside
        "{work}",
        "relative/t2",
    ],
)
@pytest.mark.parametrize("command", ["remove", "adopt", "fence"])
def test_paths_outside_the_work_dir_are_refused(
    work: Path, victim: Path, task_dir: str, command: str
) -> None:
    (work / "sub").mkdir()
    (work / "sub" / "t2").symlink_to(victim)
    (work / "linked").symlink_to(victim)
    path = task_dir.format(work=work, victim=victim)
    extra = ["--epoch", "3"] if command == "fence" else []
    result = job(command, "--work-dir", str(work), "--task-dir", path, *extra, stdin=FILES)
    assert result.returncode == 1, result.stderr
    assert "bridge.job:" in result.stderr
    assert (victim / "precious.txt").read_text() == "keep me"
    assert not (victim / "task.json").exists() and not (victim / "lease-fence").exists()
    assert (work / "linked").is_symlink()


def test_read_records_refuses_pairs_outside_the_work_dir(work: Path, victim: Path) -> None:
    (victim / "records" / "7").mkdir(parents=True)
    (victim / "records" / "7" / "outcome").write_text("complete\n")
    result = job("read-records", "--work-dir", str(work), "--tail-bytes", "10", f"{victim}:7")
    assert result.returncode == 1 and "not a task directory" in result.stderr
    (work / "linked").symlink_to(victim)
    result = job("read-records", "--work-dir", str(work), "--tail-bytes", "10", f"{work}/linked:7")
    assert result.returncode == 1 and "leads outside" in result.stderr


def test_commands_work_inside_the_work_dir(work: Path) -> None:
    adopted = job("adopt", "--work-dir", str(work), "--task-dir", f"{work}/t3", stdin=FILES)
    assert adopted.returncode == 0, adopted.stderr
    assert (work / "t3" / "job.sh").read_text() == "#!/bin/sh\n"
    (work / "t3" / "records" / "5" / "executors" / "0").mkdir(parents=True)
    stdout = b"first\n" + b"x" * 50 + b"\nlast\n"
    (work / "t3" / "records" / "5" / "executors" / "0" / "stdout").write_bytes(stdout)
    read = job("read-records", "--work-dir", str(work), "--tail-bytes", "10", f"{work}/t3:5")
    assert read.returncode == 0, read.stderr
    # --tail-bytes (the name the sudo rule pins) is what each stream keeps: its two ends.
    assert json.loads(read.stdout)[f"{work}/t3:5"]["executors"][0]["stdout"] == (
        "fi\n[tes-bridge: 55 of 62 bytes left out here; the whole stdout: "
        "GET /ga4gh/tes/v1/tasks/t3/output?executor=0&stream=stdout]\nlast\n"
    )
    fenced = job("fence", "--work-dir", str(work), "--task-dir", f"{work}/t3", "--epoch", "7")
    assert fenced.returncode == 0, fenced.stderr
    assert (work / "t3" / "lease-fence").read_text() == "7\n"
    removed = job("remove", "--work-dir", str(work), "--task-dir", f"{work}/t3")
    assert removed.returncode == 0, removed.stderr
    assert not (work / "t3").exists()


def _read_output(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return job(
        "read-output", "--work-dir", str(work), "--task-dir", f"{work}/t1", "--job-id", "7",
        "--executor", "0", "--stream", "stdout", "--offset", "0", "--max-bytes", "100", *extra,
    )  # fmt: skip


def test_read_output_reads_a_range_and_refuses_a_link(work: Path, victim: Path) -> None:
    edir = work / "t1" / "records" / "7" / "executors" / "0"
    edir.mkdir(parents=True)
    (edir / "stdout").write_text("so far\n")
    result = _read_output(work)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert (answer["text"], answer["next_offset"], answer["done"]) == ("so far\n", 7, False)
    assert _read_output(work, "--offset", "1").returncode == 2  # each option once

    (edir / "stdout").unlink()
    (edir / "stdout").symlink_to(victim / "precious.txt")
    refused = _read_output(work)
    assert refused.returncode == 3 and "keep me" not in refused.stdout


def _fake_sudo(tmp_path: Path) -> Path:
    """`sudo -n -u OWNER -- CMD...` that runs CMD as the caller, from the checkout."""
    sudo = tmp_path / "sudo"
    sudo.write_text(
        f'#!/bin/sh\n[ "$1 $2 $4" = "-n -u --" ] || exit 99\nshift 4\ncd {REPO}\nexec "$@"\n'
    )
    sudo.chmod(0o755)
    return sudo


def test_the_poller_reads_live_output_for_the_api_without_sudo_in_the_api(
    tmp_path: Path, work: Path, victim: Path
) -> None:
    """Site mode: the API's unit has NoNewPrivileges, so sudo is the poller's: the API asks it
    over the relay socket, and gets the chunk, a refusal or a clean 'not running'."""
    from bridge.api.output import LiveOutput, OutputRefused, OutputRequest, OutputUnavailable
    from bridge.config import load_config
    from bridge.poller.owners import OwnerRunner
    from bridge.system.relay import RelayServer

    state = tmp_path / "s"
    state.mkdir()
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(state), "TES_BRIDGE_WORK_DIR": str(work)},
        overrides={"site.sudo": str(_fake_sudo(tmp_path)), "job.python": sys.executable},
    )
    request = OutputRequest(executor=0, stream="stdout", offset=0, max_bytes=100)
    live = LiveOutput(config)
    with pytest.raises(OutputUnavailable, match="the poller reads it"):
        live._read_as_owner("alice", "t1", "7", request)

    edir = work / "t1" / "records" / "7" / "executors" / "0"
    edir.mkdir(parents=True)
    (edir / "stdout").write_text("so far\n")
    relay = RelayServer(state, OwnerRunner(config).read_output)
    assert relay.start()
    try:
        chunk = live._read_as_owner("alice", "t1", "7", request)
        assert (chunk.text, chunk.next_offset, chunk.done) == ("so far\n", 7, False)
        # The poller checks what it puts on sudo's command line.
        for owner, task in (("root", "t1"), ("alice", ".."), ("-u", "t1"), ("alice", "a/b")):
            with pytest.raises(OutputUnavailable, match="bad output request"):
                live._read_as_owner(owner, task, "7", request)
        (edir / "stdout").unlink()
        (edir / "stdout").symlink_to(victim / "precious.txt")
        with pytest.raises(OutputRefused):
            live._read_as_owner("alice", "t1", "7", request)
    finally:
        relay.close()
    assert not (state / "poller.relay").exists()


def test_adopt_writes_a_staged_task_s_three_scripts_or_one(work: Path) -> None:
    """Site mode with staging.where = "transfer": the stage-in and stage-out jobs' scripts come
    with job.sh, both or neither (bridge.jobscript.parts)."""
    files = json.loads(FILES)
    parts = {"job-stage-in.sh": "#!/bin/sh\n: in\n", "job-stage-out.sh": "#!/bin/sh\n: out\n"}
    argv = ["adopt", "--work-dir", str(work), "--task-dir", f"{work}/t4"]
    adopted = job(*argv, stdin=json.dumps({**files, **parts}))
    assert adopted.returncode == 0, adopted.stderr
    assert (work / "t4" / "job-stage-in.sh").read_text() == parts["job-stage-in.sh"]
    assert (work / "t4" / "job-stage-out.sh").stat().st_mode & 0o777 == 0o700
    half = {**files, "job-stage-in.sh": parts["job-stage-in.sh"]}
    refused = job(*argv, stdin=json.dumps(half))
    assert refused.returncode != 0 and "expected exactly the files" in refused.stderr
