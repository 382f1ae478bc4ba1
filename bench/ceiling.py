"""The framework ceiling for `POST /tasks`: a trivial Falcon endpoint that parses the JSON body
and answers an id, served by gunicorn with the same worker count and class as the bridge.

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


class ServiceInfo:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"name": "ceiling"}


app = falcon.App()
app.add_route("/ga4gh/tes/v1/tasks", Tasks())
app.add_route("/ga4gh/tes/v1/service-info", ServiceInfo())
