"""How gunicorn's workers serve the Falcon app: Tornado reads requests, threads run the app.

Gunicorn's sync and gthread workers give each connection a process or a thread while it sends
its request, with no bound on how long that may take: a few clients that trickle their headers
or body (or open a connection and wait) hold every worker. Gunicorn's Tornado worker reads
requests on an event loop instead, where a slow or idle connection costs a buffer, not a
worker, and Tornado bounds each whole read: a request's head must arrive within
`server.header_timeout_seconds` (also how long an idle keep-alive connection stays open) and its
body within `server.body_timeout_seconds`: a late head closes the connection, a late body gets
a 400 and is never parsed. Only complete requests reach the app, which runs in a pool of
`server.threads` threads per worker, so the event loop never waits for the database. The
gunicorn master (worker restarts, `post_fork`) is unchanged; its `timeout` now catches a stuck
event loop, while a request stuck in the app holds one thread of its worker.

A request line over `server.max_request_line_bytes`, a head over `server.max_header_bytes` and
a Content-Length over `limits.max_body_bytes` are answered at once, in the API's JSON error
shape, before any body is read; Tornado stops reading a head at four times these limits. A
chunked body is counted as it arrives and answered with the same JSON 413 once over the limit.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from http.client import responses
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.workers.gtornado import TornadoWorker
from tornado import httputil
from tornado.http1connection import HTTP1Connection, HTTP1ConnectionParameters
from tornado.ioloop import IOLoop
from tornado.wsgi import WSGIContainer

from bridge.config import Config
from bridge.system.proc import set_parent_death_signal


class BridgeApplication(BaseApplication):
    """The gunicorn application of `tes-bridge serve`: it carries the config to its workers."""

    bridge_config: Config


class Worker(TornadoWorker):
    """Gunicorn's Tornado worker with the read limits of `[server]`.

    Gunicorn builds the worker's HTTPServer with Tornado's defaults (an hour for a request
    head, no body timeout, 100 MB bodies). The server reads its connection parameters for
    each new connection, so they are replaced before the first one: the callback below is the
    first thing the event loop runs, before any accept.
    """

    _stop_deadline: float | None = None

    def run(self) -> None:
        IOLoop.current().add_callback(self._apply_limits)
        super().run()

    def heartbeat(self) -> None:
        # Gunicorn's Tornado worker stops its event loop one heartbeat (a second) after it
        # stops accepting, cutting off answers still being computed; wait for them, as the
        # sync workers did, up to graceful_timeout. A request still arriving is not waited for.
        if not self.alive and not self.server_alive and self._container().in_flight:
            if self._stop_deadline is None:
                self._stop_deadline = time.monotonic() + self.cfg.graceful_timeout
            if time.monotonic() < self._stop_deadline:
                return
        super().heartbeat()

    def _container(self) -> BridgeWSGIContainer:
        # What BridgeApplication.load returned; gunicorn's Tornado worker serves it as it is.
        assert isinstance(self.wsgi, BridgeWSGIContainer)
        return self.wsgi

    def _apply_limits(self) -> None:
        # `self.app` is the gunicorn application of `tes-bridge serve`, which has the config.
        assert isinstance(self.app, BridgeApplication)
        self.server.conn_params = connection_parameters(self.app.bridge_config)


def watch_master(arbiter: Any, worker: Any) -> None:
    """gunicorn's `post_fork`, in the new worker: it never outlives its master for long.

    A master killed -9 cannot stop its workers, which would keep the port and a database
    connection. The kernel sends the worker SIGTERM at once (a graceful stop, as the master's
    own would be); a SIGTERM before the worker has its own handlers (the master's, inherited,
    would swallow it) ends it outright, as it serves nothing yet. A worker that has not gone
    `graceful_timeout` + 5 s after its master, whatever it is stuck in, is ended by a thread.
    """
    master = arbiter.pid
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    set_parent_death_signal(signal.SIGTERM, master)
    grace = float(worker.cfg.graceful_timeout) + 5

    def watch() -> None:
        while os.getppid() == master:
            time.sleep(1.0)
        time.sleep(grace)
        os._exit(1)

    threading.Thread(target=watch, name="master-watch", daemon=True).start()


#: For gunicorn's `worker_class`.
WORKER_CLASS = f"{__name__}.{Worker.__name__}"


def connection_parameters(config: Config) -> HTTP1ConnectionParameters:
    server = config.server
    return HTTP1ConnectionParameters(
        # Tornado's header timeout: the whole head of a request, the first one included.
        header_timeout=server.header_timeout_seconds,
        # _Request answers a body late past body_timeout_seconds; this only backs it up.
        body_timeout=server.body_timeout_seconds + 5,
        # Beyond these Tornado closes the connection; below them _Request answers in JSON.
        max_header_size=4 * (server.max_request_line_bytes + server.max_header_bytes),
        max_body_size=config.limits.max_body_bytes,
        # The app reads the body as JSON: it is not gzip-decoded behind its back.
        decompress=False,
    )


def _refusal(
    config: Config, start_line: httputil.RequestStartLine, headers: httputil.HTTPHeaders
) -> tuple[int, str]:
    """(status, message) for a request refused on its head alone; (0, "") to read it."""
    line = len(start_line.method) + len(start_line.path) + len(start_line.version) + 2
    if line > config.server.max_request_line_bytes:
        return 414, (
            f"the request line is longer than this server accepts "
            f"({config.server.max_request_line_bytes} bytes)"
        )
    size = sum(len(name) + len(value) + 4 for name, value in headers.get_all())
    if size > config.server.max_header_bytes:
        return 431, (
            f"the request headers are larger than this server accepts "
            f"({config.server.max_header_bytes} bytes)"
        )
    length = headers.get("Content-Length", "")
    if length.isdigit() and int(length) > config.limits.max_body_bytes:
        return 413, (
            f"the request body is larger than this server accepts "
            f"({config.limits.max_body_bytes} bytes)"
        )
    return 0, ""


def _json_error(
    status: int, message: str
) -> tuple[httputil.ResponseStartLine, httputil.HTTPHeaders, bytes]:
    """An error answer in the API's JSON shape that closes the connection."""
    body = json.dumps({"code": status, "message": message}).encode()
    headers = httputil.HTTPHeaders(
        {"Content-Type": "application/json", "Content-Length": str(len(body))}
    )
    headers["Connection"] = "close"
    return httputil.ResponseStartLine("HTTP/1.1", status, responses[status]), headers, body


class _Request(httputil.HTTPMessageDelegate):
    """One request: refused on its head, or collected whole and handed to the WSGI app."""

    def __init__(self, container: BridgeWSGIContainer, connection: HTTP1Connection):
        self.container = container
        self.connection = connection
        self.request: httputil.HTTPServerRequest | None = None
        self.chunks: list[bytes] = []
        #: Body bytes received, and whether the body was answered as too large.
        self.received = 0
        self.refused = False
        self.body_timer: object | None = None

    def headers_received(
        self,
        start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
        headers: httputil.HTTPHeaders,
    ) -> None:
        # A server's connection only ever reads requests.
        assert isinstance(start_line, httputil.RequestStartLine)
        status, message = _refusal(self.container.config, start_line, headers)
        if status:
            # Answered and closed here: Tornado reads nothing more (the connection is detached).
            start, answer_headers, body = _json_error(status, message)
            lines = [f"{start.version} {start.code} {start.reason}"]
            lines += [f"{name}: {value}" for name, value in answer_headers.get_all()]
            head = "\r\n".join(lines) + "\r\n\r\n"
            stream = self.connection.detach()
            stream.write(head.encode("latin-1") + body).add_done_callback(lambda _: stream.close())
            return
        self.request = httputil.HTTPServerRequest(
            connection=self.connection,
            start_line=start_line,
            headers=headers,
        )
        if "Content-Length" in headers or "Transfer-Encoding" in headers:
            timeout = self.container.config.server.body_timeout_seconds
            self.body_timer = IOLoop.current().call_later(timeout, self._body_timed_out)
        if "Transfer-Encoding" in headers:
            # Tornado answers a chunked body over its limit with a bare 400 of its own (at the
            # chunk header that crosses it); data_received counts and answers the 413 instead.
            self.connection.set_max_body_size(sys.maxsize)

    def _body_timed_out(self) -> None:
        # Answered rather than dropped, and never parsed; finishing the answer before the
        # body is read makes Tornado close the connection.
        self.body_timer = None
        received = sum(len(chunk) for chunk in self.chunks)
        timeout = self.container.config.server.body_timeout_seconds
        start, headers, body = _json_error(
            400,
            f"the request body did not arrive within {timeout:g} s "
            f"({received} bytes received); nothing was done",
        )
        self.connection.write_headers(start, headers, body)
        self.connection.finish()

    def data_received(self, chunk: bytes) -> None:
        if self.refused:
            return
        self.received += len(chunk)
        limit = self.container.config.limits.max_body_bytes
        if self.received > limit:
            # A chunked body (a Content-Length over the limit is refused on the head). As for a
            # late body, the answer finished before the body is read closes the connection.
            self.refused = True
            self.chunks.clear()
            self._cancel_body_timer()
            start, headers, body = _json_error(
                413, f"the request body is larger than this server accepts ({limit} bytes)"
            )
            self.connection.write_headers(start, headers, body)
            self.connection.finish()
            return
        self.chunks.append(chunk)

    def finish(self) -> None:
        assert self.request is not None
        self._cancel_body_timer()
        if self.refused:
            return
        self.request.body = b"".join(self.chunks)
        self.container(self.request)

    def on_connection_close(self) -> None:
        self._cancel_body_timer()
        self.chunks.clear()

    def _cancel_body_timer(self) -> None:
        if self.body_timer is not None:
            IOLoop.current().remove_timeout(self.body_timer)
            self.body_timer = None


class BridgeWSGIContainer(WSGIContainer, httputil.HTTPServerConnectionDelegate):
    """Tornado's WSGI adapter, for requests whose body Tornado has read to its end."""

    def __init__(self, app: Any, config: Config):
        executor = concurrent.futures.ThreadPoolExecutor(
            config.server.threads, thread_name_prefix="api"
        )
        super().__init__(app, executor=executor)
        self.config = config
        #: Requests handed to the app whose answer is not written yet (event loop only).
        self.in_flight = 0

    async def handle_request(self, request: httputil.HTTPServerRequest) -> None:
        # Tornado's own version hands each request to the pool three times (the app, its body,
        # the end of its body), each a hand-off between threads; the whole call is one here.
        self.in_flight += 1
        try:
            status, headers, body = await IOLoop.current().run_in_executor(
                self.executor, call_wsgi_app, self.wsgi_application, self.environ(request)
            )
            code, reason = status.split(" ", 1)
            names = {name.lower() for name, _ in headers}
            if code != "304" and "content-length" not in names:
                headers.append(("Content-Length", str(len(body))))
            if code != "304" and "content-type" not in names:
                headers.append(("Content-Type", "text/html; charset=UTF-8"))
            answer_headers = httputil.HTTPHeaders()
            for name, value in headers:
                answer_headers.add(name, value)
            assert request.connection is not None
            request.connection.write_headers(
                httputil.ResponseStartLine("HTTP/1.1", int(code), reason), answer_headers, body
            )
            request.connection.finish()
            self._log(int(code), request)
        finally:
            self.in_flight -= 1

    def start_request(
        self, server_conn: object, request_conn: httputil.HTTPConnection
    ) -> httputil.HTTPMessageDelegate:
        assert isinstance(request_conn, HTTP1Connection)
        return _Request(self, request_conn)

    def environ(self, request: httputil.HTTPServerRequest) -> dict[str, Any]:
        environ = super().environ(request)
        # A chunked body arrives de-chunked but without a Content-Length, which a WSGI app
        # must read as empty (PEP 3333); its length is known now.
        environ["CONTENT_LENGTH"] = str(len(request.body))
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        return environ


def call_wsgi_app(app: Any, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    """One whole WSGI call, in the calling thread: the app, every chunk of its body and its
    `close()`. Returns the status line, the headers and the body."""
    answer: dict[str, Any] = {}
    chunks: list[bytes] = []

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: object = None
    ) -> Callable[[bytes], object]:
        # Nothing is sent before the app returns, so a later call (with exc_info) replaces it.
        answer["status"], answer["headers"] = status, list(headers)
        return chunks.append

    result = app(environ, start_response)
    try:
        chunks.extend(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    if not answer:
        raise RuntimeError("the WSGI app did not call start_response")
    return answer["status"], answer["headers"], b"".join(chunks)
