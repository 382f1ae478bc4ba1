"""`POST /tasks:test-only`: where and when Slurm would start a task of this shape, without
creating it (an extension of TES, like `/capabilities`).

The API never runs a Slurm command: it checks the task as a create would (the same 400s), then
asks the poller over bridge.system.relay, which renders the job script the task would get and
runs `sbatch --test-only` with it (bridge.poller.estimate). Nothing is stored.
"""

from __future__ import annotations

from typing import Any

import falcon

from bridge.api.resources import RequestError, Tasks, read_json_body
from bridge.config import Config
from bridge.system.relay import RelayUnavailable, ask

#: Seconds a client is asked to wait when the poller cannot ask Slurm now.
RETRY_AFTER_SECONDS = 10
#: The poller's answers that are the task's fault (a 400), and those that pass (a 503).
_BAD_REQUEST = "bad-request"


class TaskTestOnly:
    """Answers `{"start_time", "processors", "nodes", "partition", ...}` (Slurm's estimate),
    or `{"refused": ...}` when Slurm would refuse such a job, with what Slurm said."""

    def __init__(self, config: Config, tasks: Tasks) -> None:
        self.config = config
        self.tasks = tasks

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        task = self.tasks.validated(read_json_body(req, self.config.limits.max_body_bytes))
        question = {"kind": "test-only", "task": task.document, "owner": req.context.identity.user}
        try:
            answer = ask(self.config.state_dir, question, self.config.slurm.command_timeout + 5)
        except RelayUnavailable as exc:
            raise _unavailable(f"cannot ask Slurm now: {exc}") from None
        except (OSError, ValueError) as exc:
            raise _unavailable(f"cannot ask Slurm now: the poller's answer: {exc}") from None
        resp.media = _result(answer)


def _result(answer: dict[str, Any]) -> dict[str, Any]:
    if isinstance(answer.get("estimate"), dict):
        return dict(answer["estimate"])
    if isinstance(answer.get("refused"), str):
        return {"refused": answer["refused"]}
    message = str(answer.get("message") or "no answer from the poller")
    if answer.get("error") == _BAD_REQUEST:
        raise RequestError(falcon.HTTP_400, message)
    raise _unavailable(message)


def _unavailable(message: str) -> falcon.HTTPError:
    return falcon.HTTPServiceUnavailable(
        description=f"{message}; retry later", retry_after=RETRY_AFTER_SECONDS
    )
