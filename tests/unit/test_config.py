"""Configuration: defaults, the TOML file, environment overrides, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.config import Config, ConfigError, load_config

EXAMPLE = Path(__file__).parents[2] / "deploy" / "tes-bridge.example.toml"


def test_example_config_documents_exactly_the_defaults():
    assert load_config(EXAMPLE, environ={}).model_dump() == Config().model_dump()


def test_every_key_is_in_the_example_config():
    text = EXAMPLE.read_text()
    for section in Config.model_fields:
        value = getattr(Config(), section)
        keys = type(value).model_fields if hasattr(type(value), "model_fields") else [section]
        for key in keys:
            assert f"\n{key} =" in text or f"\n# {key} =" in text, f"{section}.{key}"


def test_environment_overrides_the_file(tmp_path):
    config_file = tmp_path / "c.toml"
    config_file.write_text('state_dir = "/from/file"\ndatabase = "sqlite:////from/file.db"\n')
    config = load_config(
        config_file,
        environ={
            "TES_BRIDGE_STATE_DIR": "/from/env",
            "TES_BRIDGE_DATABASE": "postgresql://u@h/db",
            "TES_BRIDGE_WORK_DIR": "/shared/work",
        },
    )
    assert config.state_dir == Path("/from/env")
    assert config.database_url == "postgresql://u@h/db"
    assert config.work_dir == Path("/shared/work")


def test_config_file_from_environment(tmp_path):
    config_file = tmp_path / "c.toml"
    config_file.write_text("[server]\nworkers = 7\n")
    assert load_config(environ={"TES_BRIDGE_CONFIG": str(config_file)}).server.workers == 7


def test_defaults_derive_paths_from_the_state_dir():
    config = load_config(environ={"TES_BRIDGE_STATE_DIR": "/srv/tes"})
    assert config.database_url == "sqlite:////srv/tes/tes-bridge.db"
    assert config.work_dir == Path("/srv/tes/work")
    assert config.image_cache_dir == Path("/srv/tes/images")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[server]\nworkerz = 2\n", "server.workerz"),
        ("[server]\nworkers = 0\n", "server.workers"),
        ("[storage]\nfile_input_mode = 'teleport'\n", "storage.file_input_mode"),
        ("[storage]\nmissing_outputs = 'skip'\n", "storage.missing_outputs"),
        ("[container]\numask = '22'\n", "container.umask"),
        ("[container]\numask = '0o22'\n", "container.umask"),
        ("[container]\numask = '089'\n", "container.umask"),
        ("[container]\numask = '00022'\n", "container.umask"),
        ("[container]\numask = 22\n", "container.umask"),
        ("[limits]\nmax_content_bytes = 1000\n", "limits.max_content_bytes"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, expected):
    config_file = tmp_path / "c.toml"
    config_file.write_text(text)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load_config(config_file, environ={})


def test_executor_umask_and_missing_outputs_defaults_and_values(tmp_path):
    config = Config()
    assert (config.container.umask, config.storage.missing_outputs) == ("022", "ignore")
    config_file = tmp_path / "c.toml"
    config_file.write_text('[container]\numask = "0002"\n[storage]\nmissing_outputs = "fail"\n')
    config = load_config(config_file, environ={})
    assert (config.container.umask, config.storage.missing_outputs) == ("0002", "fail")


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml", environ={})


def test_shared_dirs_must_be_existing_absolute_directories(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "file").write_text("x")
    env = {"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")}
    config = load_config(environ=env, overrides={"storage.shared_dirs": [str(shared)]})
    assert config.storage.shared_dirs == [shared]
    assert config.file_dirs == [shared]
    for bad, reason in [
        ("relative/dir", "normalised absolute path"),
        (f"{shared}/../shared", "normalised absolute path"),
        (str(tmp_path / "missing"), "does not exist"),
        (str(tmp_path / "file"), "not a directory"),
        ("/", "cannot be bound"),
        ("/proc/self", "cannot be bound"),
    ]:
        with pytest.raises(ConfigError, match=f"storage.shared_dirs.*{reason}"):
            load_config(environ=env, overrides={"storage.shared_dirs": [bad]})


@pytest.mark.parametrize(
    ("shared", "work", "reason"),
    [
        ("", None, "holds the state or work directory"),  # the state directory's parent
        ("state", None, "holds the state or work directory"),
        ("state/work/tasks", None, "inside job.work_dir"),
        ("elsewhere", "elsewhere/work", "holds the state or work directory"),
    ],
)
def test_shared_dirs_never_expose_the_state_or_the_task_directories(tmp_path, shared, work, reason):
    (tmp_path / "state/work/tasks").mkdir(parents=True)
    (tmp_path / "elsewhere/work").mkdir(parents=True)
    overrides = {"storage.shared_dirs": [str(tmp_path / shared).rstrip("/")]}
    if work:
        overrides["job.work_dir"] = str(tmp_path / work)
    with pytest.raises(ConfigError, match=reason):
        load_config(environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")}, overrides=overrides)


def test_a_data_directory_beside_the_work_directory_may_be_shared(tmp_path):
    (tmp_path / "state/data").mkdir(parents=True)
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"storage.shared_dirs": [str(tmp_path / "state/data")]},
    )
    assert config.storage.shared_dirs == [tmp_path / "state/data"]
