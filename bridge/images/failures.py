"""The failures of making an image available that pass: a registry that is down, refuses,
answers 5xx or stalls, and a full cache disk (`Transient`: the tasks stay QUEUED and the job is
tried again), and how their messages are kept short for system_logs. A failure that does not
pass, an image or tag that does not exist, is `bridge.images.ref.ImagePullError`.
"""

from __future__ import annotations


class Transient(Exception):
    """The registry or the cache cannot serve the image now; try again later. `unreachable`:
    the registry cannot be reached at all (name, route, refused), which is given up on after
    container.pull_give_up_seconds (a misspelled host never comes back)."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.unreachable = unreachable


def short_text(value: object, limit: int = 200) -> str:
    """`value` on one line, cut to `limit` characters."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
