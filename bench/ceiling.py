"""The framework ceiling for `POST /tasks` (a trivial Falcon endpoint that parses the JSON body
and answers an id) and `GET /tasks/{id}` (answers the id and a fixed
state), served by gunicorn with the same worker count as the bridge.

    gunicorn -w 2 bench.ceiling:app
"""

from __future__ import annotations

import json
import uuid

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
