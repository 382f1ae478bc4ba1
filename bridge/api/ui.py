"""The web page of tasks: static files from the package (bridge/api/webui/), served at `/ui/`.

The page is plain HTML and JavaScript that calls the TES API itself, so its files are public
and the data stays behind the API's authentication. Only the files named in `FILES` are
served (no path from the request reaches the file system), each with a Content-Security-Policy
that allows the page's own script and style and nothing inline.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

import falcon

#: The page's files and their types; nothing else under /ui/ exists.
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
UI_PREFIX = "/ui/"
#: The page and its API are on one origin: everything from 'self', nothing inline, no frames.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # A new version of the package is seen at the next load: files are small, checked by ETag.
    "Cache-Control": "no-cache",
}


def is_ui_path(path: str) -> bool:
    """The paths the page is served at, which need no credentials (the API calls do)."""
    return path in ("/", "/ui") or path.startswith(UI_PREFIX)


class WebUI:
    def __init__(self) -> None:
        package = resources.files("bridge.api") / "webui"
        self.files = {name: (package / name).read_bytes() for name in FILES}
        self.etags = {
            name: hashlib.sha256(body).hexdigest()[:20] for name, body in self.files.items()
        }

    def _send(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        body = self.files.get(name)
        if body is None:
            raise falcon.HTTPNotFound(description=f"no such file: {req.path}")
        resp.set_headers(HEADERS)
        resp.etag = self.etags[name]
        if any(str(tag) == self.etags[name] for tag in req.if_none_match or []):
            resp.status = falcon.HTTP_304
            return
        resp.content_type = FILES[name]
        resp.data = body

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._send(req, resp, "index.html")

    def on_get_file(self, req: falcon.Request, resp: falcon.Response, name: str) -> None:
        self._send(req, resp, name)


class Home:
    """`/` and `/ui`: to the page at `/ui/`, relative, so that it works behind a path prefix."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        raise falcon.HTTPFound("ui/")


def add_routes(app: falcon.App[Any, Any]) -> None:
    page = WebUI()
    app.add_route("/", Home())
    app.add_route("/ui", Home())
    app.add_route(UI_PREFIX, page)
    app.add_route(UI_PREFIX + "{name}", page, suffix="file")
