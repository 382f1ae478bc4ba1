"""The client's HTTP side against what other servers and proxies do, served over real HTTP on
loopback: retries (and never a create sent twice), their error bodies, their page tokens."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from bridge.client.api import TesClient, TesError
from bridge.client.watch import follow_logs, print_logs, wait_for

#: An answer: (status, body) to send, or None to read the request and drop the connection.
Answer = tuple[int, Any] | None


class Stub:
    """A scripted HTTP server: `answers[(method, path)]` is a list popped per request (the last
    one repeats); every request is recorded."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], list[Answer]] = {}
        self.seen: list[tuple[str, str]] = []
        self.url = ""

    def answer(self, method: str, path: str) -> Answer:
        queue = self.answers.get((method, path.split("?")[0]), [(404, {"message": "no"})])
        return queue.pop(0) if len(queue) > 1 else queue[0]


@pytest.fixture
def stub() -> Iterator[Stub]:
    state = Stub()

    class Handler(BaseHTTPRequestHandler):
        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            state.seen.append((self.command, self.path))
            answer = state.answer(self.command, self.path)
            if answer is None:
                self.close_connection = True
                return
            status, body = answer
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _handle

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def _client(stub: Stub) -> TesClient:
    return TesClient(f"{stub.url}/v1", timeout=5)


def test_a_get_is_retried_while_the_server_is_briefly_unavailable(stub: Stub):
    task = {"id": "t1", "state": "RUNNING"}
    stub.answers[("GET", "/v1/tasks/t1")] = [
        (503, "busy"),
        (502, "<html>bad gateway</html>"),
        (200, task),
    ]
    assert _client(stub).get("t1") == task
    assert stub.seen.count(("GET", "/v1/tasks/t1?view=MINIMAL")) == 3


def test_a_get_whose_answer_was_lost_is_asked_again(stub: Stub):
    stub.answers[("GET", "/v1/tasks/t1")] = [None, (200, {"id": "t1", "state": "QUEUED"})]
    assert _client(stub).get("t1")["state"] == "QUEUED"
    assert len(stub.seen) == 2


def test_a_create_is_never_sent_twice(stub: Stub):
    """The server may have stored a task whose answer was lost or that it answered 503 for
    late: only the user can tell whether to create it again."""
    stub.answers[("POST", "/v1/tasks")] = [None, (200, {"id": "second"})]
    with pytest.raises(TesError, match="cannot reach") as lost:
        _client(stub).create({"executors": []})
    assert lost.value.status is None
    stub.answers[("POST", "/v1/tasks")] = [(503, {"message": "overloaded"}), (200, {"id": "x"})]
    with pytest.raises(TesError, match="503 overloaded"):
        _client(stub).create({"executors": []})
    assert [method for method, _ in stub.seen] == ["POST", "POST"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # grpc-gateway (Funnel): both `error` and `message`.
        ({"error": "task not found", "code": 5, "message": "task not found"}, "task not found"),
        ({"msg": "no such task"}, "no such task"),
        ({"detail": "Not Found"}, "Not Found"),  # FastAPI
        ({"title": "404 Not Found"}, "404 Not Found"),  # Falcon without a description
        ("<html>\n<h1>404</h1>\n  not   here</html>", "<html> <h1>404</h1> not here</html>"),
    ],
)
def test_the_servers_message_is_read_from_the_usual_error_shapes(
    stub: Stub, body: Any, message: str
):
    stub.answers[("GET", "/v1/tasks/t1")] = [(404, body)]
    with pytest.raises(TesError) as error:
        _client(stub).get("t1")
    assert error.value.status == 404
    assert str(error.value) == f"GET {stub.url}/v1/tasks/t1: 404 {message}"


def _page(n: int) -> dict[str, Any]:
    return {"tasks": [{"id": f"t{n}"}], "next_page_token": f"p{n + 1}"}


@pytest.mark.parametrize("last_page", [{}, {"tasks": [], "next_page_token": ""}])
def test_listing_follows_tokens_and_stops_at_an_empty_or_missing_one(
    stub: Stub, last_page: dict[str, Any]
):
    # grpc-gateway leaves empty fields out; others send "" for "no more pages".
    stub.answers[("GET", "/v1/tasks")] = [(200, _page(0)), (200, _page(1)), (200, last_page)]
    assert [t["id"] for t in _client(stub).tasks(page_size=1)] == ["t0", "t1"]
    tokens = [parse_qs(urlsplit(path).query).get("page_token") for _, path in stub.seen]
    assert tokens == [None, ["p1"], ["p2"]]


def test_wait_outlasts_a_server_that_cannot_be_reached_for_a_while(stub: Stub):
    # Three lost answers use up one request's retries; the wait goes on at the next poll.
    stub.answers[("GET", "/v1/tasks/t1")] = [
        None,
        None,
        None,
        (200, {"id": "t1", "state": "COMPLETE"}),
    ]
    out, err = io.StringIO(), io.StringIO()
    code = wait_for(_client(stub), ["t1"], out=out, err=err, interval=0.1, timeout=30)
    assert code == 0
    assert out.getvalue() == "t1 COMPLETE\n"
    assert "cannot reach" in err.getvalue() and err.getvalue().endswith("; retrying\n")


def test_wait_ends_at_an_error_the_server_means(stub: Stub):
    stub.answers[("GET", "/v1/tasks/t1")] = [(404, {"message": "task t1 not found"})]
    with pytest.raises(TesError, match="404 task t1 not found"):
        wait_for(
            _client(stub), ["t1"], out=io.StringIO(), err=io.StringIO(), interval=0.1, timeout=30
        )


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_wait_for_many_tasks_on_a_terminal_shows_counts_and_only_the_failures(stub: Stub):
    ids = [f"t{n}" for n in range(25)]
    for task_id in ids:
        state = "EXECUTOR_ERROR" if task_id == "t7" else "COMPLETE"
        stub.answers[("GET", f"/v1/tasks/{task_id}")] = [(200, {"id": task_id, "state": state})]
    out = Terminal()
    code = wait_for(_client(stub), ids, out=out, err=io.StringIO(), interval=0.1, timeout=30)
    assert code == 3
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("  t7  EXECUTOR_ERROR")
    assert lines[1] == "25 tasks: 24 COMPLETE, 1 EXECUTOR_ERROR"


def test_an_answer_that_is_not_a_task_is_an_error_not_a_crash(stub: Stub):
    stub.answers[("GET", "/v1/tasks/t1")] = [(200, ["not", "a", "task"])]
    stub.answers[("GET", "/v1/tasks")] = [(200, "<html>a login page</html>")]
    with pytest.raises(TesError, match="expected a JSON object, got"):
        _client(stub).get("t1")
    with pytest.raises(TesError, match="the answer is not JSON"):
        list(_client(stub).tasks())


TWO_DONE = {
    "id": "t1",
    "state": "EXECUTOR_ERROR",
    "executors": [{"image": "a", "command": ["x"]}, {"image": "b", "command": ["y"]}],
    "logs": [
        {
            "logs": [
                {"exit_code": 0, "stdout": "one\n"},
                {"exit_code": 2, "stdout": "two\n", "stderr": "bad\n"},
            ],
            "system_logs": ["done"],
        }
    ],
}


def test_logs_from_a_server_without_the_output_endpoint_print_the_document_under_headers(
    stub: Stub,
):
    """Funnel, or any TES server: no live output (404), so the task document's copy."""
    stub.answers[("GET", "/v1/tasks/t1")] = [(200, TWO_DONE)]
    out, err = io.StringIO(), io.StringIO()
    print_logs(_client(stub), TWO_DONE, out=out, err=err)
    assert out.getvalue() == ("--- executor 0 stdout ---\none\n--- executor 1 stdout ---\ntwo\n")
    assert err.getvalue() == (
        "executor 0: exit code 0\n--- executor 1 stderr ---\nbad\nexecutor 1: exit code 2\n"
        "system: done\n"
    )
    out, err = io.StringIO(), io.StringIO()
    assert follow_logs(_client(stub), "t1", out=out, err=err, interval=0.1) == 3
    assert out.getvalue() == "--- executor 0 stdout ---\none\n--- executor 1 stdout ---\ntwo\n"
    assert "--- executor 1 stderr ---\nbad\n" in err.getvalue()
