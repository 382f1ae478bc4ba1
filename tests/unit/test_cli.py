"""The `tes-bridge` command: help, argument errors, and the commands that need no server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge.cli.main import build_parser
from tests.procs import alive, children, cmdline

# The command reference lives in the sysadmins' page.
SITE_DOC = (Path(__file__).parents[2] / "docs" / "site.md").read_text()


def tes_bridge(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bridge", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def commands() -> list[str]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return list(subparsers.choices)


def test_help_lists_every_command_and_the_site_docs_document_them():
    result = tes_bridge("--help")
    assert result.returncode == 0
    for command in commands():
        assert re.search(rf"^\s+{command}\s", result.stdout, re.M), command
        assert re.search(rf"^\s+{command}\b", SITE_DOC, re.M), f"docs/site.md lacks `{command}`"


@pytest.mark.parametrize("command", ["serve", "poller", "init-db", "show-config", "job"])
def test_every_command_has_help(command):
    result = tes_bridge(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_job_subcommands_are_documented_in_the_site_docs():
    result = tes_bridge("job", "--help")
    listed = re.search(r"\{([a-z,-]+)\}", result.stdout).group(1).split(",")
    for sub in listed:
        assert sub in SITE_DOC, f"docs/site.md lacks `job {sub}`"


def test_unknown_argument_is_an_error():
    result = tes_bridge("serve", "--no-such-option")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-option" in result.stderr


def test_bad_config_is_reported_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nworkers = 0\n")
    result = tes_bridge("--config", str(bad), "show-config")
    assert result.returncode == 2
    assert "server.workers" in result.stderr and "Traceback" not in result.stderr


def test_init_db_and_show_config(tmp_path):
    env = {"TES_BRIDGE_STATE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = tes_bridge("init-db", env=env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "tes-bridge.db").is_file()
    shown = json.loads(tes_bridge("show-config", env=env).stdout)
    assert shown["state_dir"] == str(tmp_path)


@pytest.mark.parametrize("command", [["serve"], ["poller", "--once"], ["poller", "--supervise"]])
def test_root_is_refused_without_allow_root(tmp_path, command):
    """As root (the suite's own user), serve and poller stop before doing anything and say
    what to do; nothing is created in the state directory."""
    from bridge.cli.serve import refuse_root
    from bridge.config import load_config

    state = tmp_path / "state"
    env = {"TES_BRIDGE_STATE_DIR": str(state), "PATH": "/usr/bin:/bin"}
    config = load_config(environ=env)
    assert refuse_root(config, 1000) is None
    assert "container.allow_root" in (refuse_root(config, 0) or "")
    if os.geteuid() != 0:
        pytest.skip("the process-level check needs root; refuse_root is checked above")
    result = tes_bridge(*command, env=env)
    assert result.returncode == 2, result.stderr
    assert "refusing to run as root" in result.stderr
    assert "unprivileged service account" in result.stderr
    assert "container.allow_root = true" in result.stderr
    assert not state.exists()


def test_allow_root_lets_root_start(tmp_path):
    config_file = tmp_path / "root.toml"
    # Where Slurm's commands are installed, each waits for the missing SLURM_CONF until its
    # time-out: the release read at start, the rate limit's, the capabilities' sinfo.
    config_file.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[container]\nallow_root = true\n'
        "[slurm]\ncommand_timeout = 5.0\n"
    )
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": "/nonexistent"}
    result = tes_bridge("--config", str(config_file), "poller", "--once", env=env)
    assert "refusing to run as root" not in result.stderr
    assert (tmp_path / "state" / "tes-bridge.db").is_file()


def _serve(tmp_path: Path, log_name: str, port: int) -> subprocess.Popen[bytes]:
    # The suite runs as root: this test is about process lifetimes, not the root refusal.
    config_file = tmp_path / "serve.toml"
    config_file.write_text(f'state_dir = "{tmp_path / "state"}"\n[container]\nallow_root = true\n')
    env = dict(os.environ)
    with open(tmp_path / log_name, "wb") as log:
        argv = [sys.executable, "-m", "bridge", "--config", str(config_file), "serve"]
        argv += ["--bind", f"127.0.0.1:{port}"]
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _poller_of(master: int, timeout: float = 30) -> tuple[int, int]:
    """(supervisor pid, poller pid) started by a serve master."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for sup in children(master):
            if "--supervise" in cmdline(sup):
                pollers = [p for p in children(sup) if " poller" in cmdline(p)]
                if pollers:
                    return sup, pollers[0]
        time.sleep(0.1)
    raise AssertionError(f"serve {master} started no supervised poller")


def test_kill_9_of_the_serve_master_takes_its_poller_along(tmp_path: Path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    first = _serve(tmp_path, "first.log", port)
    second = None
    supervisor = poller = 0
    try:
        supervisor, poller = _poller_of(first.pid)
        lock = tmp_path / "state" / "poller.lock"
        deadline = time.monotonic() + 30
        while not (lock.exists() and lock.read_text().strip() == str(poller)):
            assert time.monotonic() < deadline, "the poller never took its lock"
            time.sleep(0.1)
        workers = [p for p in children(first.pid) if p != supervisor]
        assert workers
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in [supervisor, poller, *workers]):
            assert time.monotonic() < deadline, "a child outlived the serve master"
            time.sleep(0.1)
        # The port and the poller lock are free: a new serve gets both.
        second = _serve(tmp_path, "second.log", port)
        _, new_poller = _poller_of(second.pid)
        deadline = time.monotonic() + 30
        while lock.read_text().strip() != str(new_poller):
            assert time.monotonic() < deadline, (tmp_path / "second.log").read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(1.5)
        assert alive(new_poller), (tmp_path / "second.log").read_text()[-2000:]
        assert second.poll() is None, (tmp_path / "second.log").read_text()[-2000:]
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        for pid in (supervisor, poller):  # orphans of a failed run
            if pid and alive(pid) and "bridge" in cmdline(pid):
                os.kill(pid, signal.SIGKILL)


def test_check_reads_the_units_config_file_when_none_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --config (and $TES_BRIDGE_CONFIG), `check` reads the file the systemd units
    name, and says which file it read; with none, it says so and checks nothing else (it once
    checked the defaults, and made their state directory's database)."""
    from bridge import config as config_module
    from bridge.cli import check

    monkeypatch.delenv("TES_BRIDGE_CONFIG", raising=False)
    monkeypatch.setattr(check.Doctor, "run", lambda self: iter([]))
    default = tmp_path / "etc" / "tes-bridge.toml"
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_FILE", default)
    args = build_parser().parse_args(["check"])
    assert check.check_command(args) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL  config: no configuration found: no --config, ")
    assert "nothing else was checked" in out

    default.parent.mkdir()
    default.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    assert check.check_command(args) == 0
    assert capsys.readouterr().out == f"ok    config: loaded ({default})\n"
    default.write_text("[server]\nno_such_key = 1\n")
    assert check.check_command(args) == 1
    assert "no_such_key" in capsys.readouterr().out


def test_check_flags_admins_who_are_not_local_users(tmp_path: Path) -> None:
    from bridge.cli.check import Failed, admins
    from bridge.config import Config

    def site(**auth: object) -> Config:
        htpasswd = tmp_path / "htpasswd"
        htpasswd.touch()
        return Config.model_validate(
            {
                "state_dir": str(tmp_path),
                "auth": {"mode": "basic", "htpasswd_file": str(htpasswd), **auth},
                "site": {"run_as_owner": True},
            }
        )

    assert "nobody" in admins(site(admin_users=["nobody"]))
    with pytest.raises(Failed, match="'no-such-admin-here' is not a local user") as info:
        admins(site(admin_users=["nobody", "no-such-admin-here"]))
    assert "auth.admin_users" in info.value.fix
    with pytest.raises(Failed, match="'root', 'ghost2' are not local users"):
        admins(site(admin_users=["root", "ghost2"]))
    with pytest.raises(Failed, match=r"auth\.admin_group 'no-such-group-here' is not a group"):
        admins(site(admin_group="no-such-group-here"))
