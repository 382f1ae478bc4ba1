"""`job-config.json`: the part of the configuration the job side needs on the compute node.

Compute nodes may not have the login node's configuration file, so the renderer copies the few
settings the job needs into the task directory, next to the task document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SETTINGS_VERSION = 1


@dataclass(frozen=True)
class JobSettings:
    task_id: str
    #: The container runtime binary, checked before staging.
    runtime: str = "apptainer"
    #: Host directories file:// URLs and bare paths may read from and write to.
    allowed_dirs: list[str] = field(default_factory=list)
    #: copy, hardlink or bind (see bridge.job.staging.file).
    file_input_mode: str = "copy"
    log_tail_bytes: int = 10 * 1024
    #: SIF files the executors use; a missing one fails staging with a clear message.
    images: list[str] = field(default_factory=list)
    #: Container directories to create under root/ before the executors run (bind sources).
    mkdirs: list[str] = field(default_factory=list)
    #: Indexes of inputs bound straight from the shared filesystem (file_input_mode "bind");
    #: stage-in only checks them and creates their mount points.
    bound_inputs: list[int] = field(default_factory=list)
    #: With file_input_mode "hardlink": inputs that stay read-only in the container and may
    #: therefore share their inode with the source; every other input is copied.
    linkable_inputs: list[int] = field(default_factory=list)
    #: file:// inputs and outputs at their own host path inside a shared directory
    #: (storage.shared_dirs): the executors see them through the shared bind; stage-in only
    #: checks that an input is there and makes an output's directory, stage-out records an
    #: output without copying it.
    in_place_inputs: list[int] = field(default_factory=list)
    in_place_outputs: list[int] = field(default_factory=list)
    #: Whether stage-in checks the container runtime and the images: not where it runs on a
    #: transfer node of its own (staging.where = "transfer"), whose task's job checks them.
    check_runtime: bool = True
    #: container.allow_root: executors may run as root (refused otherwise, see bridge.job.execute).
    allow_root: bool = False
    #: storage.missing_outputs: "ignore" or "fail" (see bridge.job.stage). A file written
    #: before the setting existed keeps the behaviour of then, "fail".
    missing_outputs: str = "fail"
    #: `[staging]` options for the protocol modules (bridge.job.staging.StagingOptions): endpoint
    #: names and paths of credential files only, never a secret.
    staging: dict[str, Any] = field(default_factory=dict)
    version: int = SETTINGS_VERSION

    def to_json(self) -> str:
        # Every field holds JSON values already: no deep copy (asdict), and no indent, which
        # takes json's pure-Python encoder: 20 times the time of a burst's 500 tasks' files.
        return json.dumps(vars(self), ensure_ascii=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> JobSettings:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != SETTINGS_VERSION:
            raise ValueError("job-config.json has an unknown format version")
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in data.items() if key in known})


def read_settings(path: Path) -> JobSettings:
    return JobSettings.from_json(path.read_text(encoding="utf-8"))
