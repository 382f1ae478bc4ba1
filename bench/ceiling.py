"""The framework ceiling for `POST /tasks` (a trivial Falcon endpoint that parses the JSON body
and answers an id) and `GET /tasks/{id}` (answers the id and a fixed
state), served by gunicorn with the same worker count as the bridge: with gunicorn's default
(sync) workers, or on the bridge's own server (its Tornado worker class, thread pool and read
limits, bridge.api.server), which is what the bridge's answers go through.

    gunicorn -w 2 bench.ceiling:app
    python -m bench.ceiling 127.0.0.1:8001 2
"""

from __future__ import annotations

import json
import sys
import tempfile
import uuid
from typing import Any

import falcon


class Tasks:
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        json.loads(req.bounded_stream.read() or b"{}")
        resp.media = {"id": str(uuid.uuid4())}


class Task:
    def on_get(self, req: falcon.Request, resp: falcon.Response, task_id: str) -> None:
        resp.media = {"id": task_id, "state": "RUNNING"}


class ServiceInfo:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"name": "ceiling"}


app = falcon.App()
app.add_route("/ga4gh/tes/v1/tasks", Tasks())
app.add_route("/ga4gh/tes/v1/tasks/{task_id}", Task())
app.add_route("/ga4gh/tes/v1/service-info", ServiceInfo())


def serve_on_the_bridge_server(bind: str, workers: int) -> None:
    """The ceiling app behind the bridge's gunicorn worker class, with its default settings."""
    from bridge.api.server import WORKER_CLASS, BridgeApplication, BridgeWSGIContainer
    from bridge.config import Config

    config = Config.model_validate({"state_dir": tempfile.mkdtemp(prefix="tes-ceiling-")})

    class Ceiling(BridgeApplication):
        bridge_config = config

        def load_config(self) -> None:
            options = {
                "bind": bind,
                "workers": workers,
                "worker_class": WORKER_CLASS,
                "accesslog": None,
                "loglevel": "warning",
            }
            for key, value in options.items():
                self.cfg.set(key, value)

        def load(self) -> Any:
            return BridgeWSGIContainer(app, config)

    Ceiling().run()


if __name__ == "__main__":
    serve_on_the_bridge_server(sys.argv[1], int(sys.argv[2]))
