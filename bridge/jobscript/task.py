"""The task a job script is rendered from: the stored document parsed once into the TES model
(`TesTask`), and the checks every part of rendering applies to its values, which fail with a
`RenderError` naming the field (the poller records it as a SYSTEM_ERROR).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.core import tes
from bridge.core.naming import is_task_id
from bridge.core.tes import ResourcesModel, TaskModel
from bridge.job.layout import LayoutError, check_container_path


class RenderError(ValueError):
    """The task cannot be turned into a job script; the message names the field."""


# --------------------------------------------------------------------------- the typed task


@dataclass(frozen=True)
class TesTask:
    """A stored task parsed once: its id, its TES model, and the document as stored (which
    is what task.json holds for the job side)."""

    id: str
    model: TaskModel
    document: dict[str, Any]

    @property
    def resources(self) -> ResourcesModel:
        return self.model.resources or ResourcesModel()


def parse_task(task: dict[str, Any] | TesTask) -> TesTask:
    """The typed task of a stored document; a value the TES model refuses is a RenderError
    naming the field (the API checked it already, so this is a task stored by hand)."""
    if isinstance(task, TesTask):
        return task
    task_id = task.get("id")
    if not is_task_id(task_id):
        raise RenderError(f"id: {task_id!r} is not a valid task id")
    try:
        model = tes.parse_task(task)
    except tes.TaskValidationError as exc:
        raise RenderError(str(exc)) from None
    return TesTask(id=task_id, model=model, document=task)


def container_path(value: str, where: str) -> str:
    """`value` if it is an absolute, normalised container path, else a RenderError at `where`."""
    try:
        return check_container_path(value)
    except LayoutError as exc:
        raise RenderError(f"{where}: {exc}") from None
