"""bridge.api.server.call_wsgi_app: one whole WSGI call on the pool's thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bridge.api.server import call_wsgi_app


class _Body:
    """A WSGI body of several chunks that records its close()."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.chunks)

    def close(self) -> None:
        self.closed = True


def test_status_headers_every_chunk_and_close() -> None:
    body = _Body([b"a", b"", b"bc"])

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> _Body:
        write = start_response("201 Created", [("Content-Type", "application/json")])
        write(b"<")  # PEP 3333's write(): before the iterable's chunks
        return body

    status, headers, data = call_wsgi_app(app, {})
    assert (status, headers, data) == (
        "201 Created",
        [("Content-Type", "application/json")],
        b"<abc",
    )
    assert body.closed


def test_close_runs_when_the_body_fails() -> None:
    class Failing(_Body):
        def __iter__(self) -> Iterator[bytes]:
            yield b"a"
            raise RuntimeError("broken body")

    body = Failing([])

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> _Body:
        start_response("200 OK", [])
        return body

    with pytest.raises(RuntimeError, match="broken body"):
        call_wsgi_app(app, {})
    assert body.closed


def test_an_app_that_never_starts_a_response_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="start_response"):
        call_wsgi_app(lambda environ, start_response: [b"x"], {})


def test_a_later_start_response_replaces_the_first() -> None:
    # An app that fails after start_response calls it again with exc_info (PEP 3333).
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("200 OK", [("X-A", "1")])
        start_response("500 Internal Server Error", [], (None, None, None))
        return [b"oops"]

    assert call_wsgi_app(app, {}) == ("500 Internal Server Error", [], b"oops")
