"""Task documents the client makes of others: a copy to post again (`resubmit`), with the
resources and Slurm options it changes, and the name `run` gives a task from its command."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

#: What a server adds to a task: not sent again.
OUTPUT_ONLY = ("id", "state", "creation_time", "logs")
#: The tag of a resubmitted task: the id of the task it copies (tags are kept by any TES
#: server, so the link stays in the document).
RESUBMIT_TAG = "tes-bridge.resubmit_of"
#: backend_parameters that say a time limit: a new `time` replaces them all (the bridge takes
#: the tightest of those a task gives, so an old one left would still win).
TIME_KEYS = ("time", "time_limit", "max_time")
#: Programs that run a script: the task is named after the script, as sbatch names a job.
INTERPRETERS = re.compile(r"(?:ba|da|z)?sh|python[0-9.]*|perl|Rscript|ruby|node|julia")


def task_copy(task: Mapping[str, Any]) -> dict[str, Any]:
    """A task document to post again: `task` without what the server added."""
    return {key: value for key, value in task.items() if key not in OUTPUT_ONLY}


def resubmitted(task: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `task` with `changes` (a `resources` object: cpu_cores, ram_gb, disk_gb and
    backend_parameters) over its own, tagged with its id (RESUBMIT_TAG). A backend parameter
    replaces the task's of the same key in any case; a time limit replaces every other, and a
    partition the task's zones."""
    copy = task_copy(task)
    resources = dict(copy.get("resources") or {})
    resources.update({k: v for k, v in changes.items() if k != "backend_parameters"})
    new = dict(changes.get("backend_parameters") or {})
    if new:
        replaced = {key.lower() for key in new}
        if "time" in replaced:
            replaced.update(TIME_KEYS)
        if "partition" in replaced:
            resources.pop("zones", None)
        old = resources.get("backend_parameters") or {}
        resources["backend_parameters"] = {
            **{k: v for k, v in old.items() if k.lower() not in replaced},
            **new,
        }
    if resources:
        copy["resources"] = resources
    if isinstance(task.get("id"), str):
        copy["tags"] = {**(copy.get("tags") or {}), RESUBMIT_TAG: task["id"]}
    return copy


def command_name(command: Sequence[str]) -> str:
    """The name of a task that runs `command`: its program's file name, or its script's when
    the program is an interpreter (`python3 train.py` -> `train.py`)."""
    words = [word for word in command if word]
    if not words:
        return ""
    name = posixpath.basename(words[0].rstrip("/")) or words[0]
    if INTERPRETERS.fullmatch(name) and len(words) > 1 and not words[1].startswith("-"):
        return posixpath.basename(words[1].rstrip("/")) or words[1]
    return name
