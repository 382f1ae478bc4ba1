"""The task's inputs and outputs as the job side uses them: read once from the stored task
document (`task.json`, validated by the server when the task was created) into small typed
records, which stage-in, stage-out and the staging backends take as they are.

The job side does not import the server's pydantic models (`bridge.core.tes`): these records hold
only the fields staging reads, and an item that does not fit is reported, not guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.job.staging import FileKind, StagingError


def _kind(item: dict[str, Any]) -> FileKind:
    value = item.get("type") or "FILE"
    if value == "FILE":
        return "FILE"
    if value == "DIRECTORY":
        return "DIRECTORY"
    raise StagingError(f"unknown type {value!r} (FILE or DIRECTORY)")


def _text(item: dict[str, Any], name: str, *, required: bool = False) -> str | None:
    value = item.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise StagingError(f"`{name}` is not a string")
    return value


@dataclass(frozen=True)
class TaskInput:
    """One of the task's `inputs`: a `content` or a `url`, placed at container `path`."""

    index: int
    path: str
    kind: FileKind = "FILE"
    url: str | None = None
    content: str | None = None

    @classmethod
    def parse(cls, index: int, item: object) -> TaskInput:
        if not isinstance(item, dict):
            raise StagingError("malformed input")
        return cls(
            index=index,
            path=_text(item, "path", required=True) or "",
            kind=_kind(item),
            url=_text(item, "url"),
            content=_text(item, "content"),
        )

    @property
    def inline(self) -> bool:
        """Whether the input is its `content` (an empty content counts when there is no URL)."""
        return self.content is not None and (bool(self.content) or not self.url)

    @property
    def label(self) -> str:
        """`input N URL -> PATH`, as system_logs name it."""
        source = f"{self.url} " if self.url else ("content " if self.content is not None else "")
        return f"input {self.index} {source}-> {self.path}"


@dataclass(frozen=True)
class TaskOutput:
    """One of the task's `outputs`: container `path` (wildcards allowed) uploaded to `url`."""

    index: int
    path: str
    url: str
    kind: FileKind = "FILE"
    path_prefix: str | None = None

    @classmethod
    def parse(cls, index: int, item: object) -> TaskOutput:
        if not isinstance(item, dict):
            raise StagingError("malformed output")
        return cls(
            index=index,
            path=_text(item, "path", required=True) or "",
            url=_text(item, "url", required=True) or "",
            kind=_kind(item),
            path_prefix=_text(item, "path_prefix"),
        )

    @property
    def label(self) -> str:
        """`output N PATH -> URL`, as system_logs name it."""
        return f"output {self.index} {self.path} -> {self.url}"


def items(task: dict[str, Any], field: str) -> list[object]:
    """The task's `inputs` or `outputs` list (absent or null: none)."""
    value = task.get(field)
    return value if isinstance(value, list) else []
