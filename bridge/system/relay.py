"""The API's questions to the poller: one JSON request and one JSON answer over a Unix stream
socket in the state directory. A request's `kind` says what it asks: `test-only` (where and
when Slurm would start a task: the API never runs a Slurm command) or `output` (the default).

Site mode reads a running executor's output as the task's owner through sudo. sudo is
set-user-ID, which the API's unit forbids (`NoNewPrivileges=yes`, no capabilities): only the
poller's unit is allowed sudo (its site-mode drop-in). So the API asks the poller, which runs
`read-output` as the owner and answers. The socket is the service account's alone (mode 0600,
in the state directory); both ends are that account, and the poller still checks every field
before it builds a sudo command line from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge.system.wake import bind_private

log = logging.getLogger(__name__)

#: The socket's name in the state directory.
RELAY_SOCKET = "poller.relay"
#: The most a request or an answer may hold (an answer carries at most 1 MiB of output).
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
#: Requests answered at the same time; more wait for a free thread.
MAX_CONCURRENT = 8

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class RelayUnavailable(Exception):
    """No poller answers on the socket (not running)."""


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError("message too long")
    return data


def ask(state_dir: Path, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The poller's answer to `request`; RelayUnavailable when no poller listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(state_dir / RELAY_SOCKET))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise RelayUnavailable(f"the poller does not answer ({exc.strerror})") from None
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = _read_line(sock)
    if not data:
        raise RelayUnavailable("the poller closed the connection without an answer")
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise ValueError("the poller's answer is not an object")
    return answer


class RelayServer:
    """The poller's side: each connection is one request, answered by `handler` in a thread."""

    def __init__(self, state_dir: Path, handler: Handler) -> None:
        self.path = state_dir / RELAY_SOCKET
        self.handler = handler
        self._socket: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)

    def start(self) -> bool:
        """Listen; False (logged) when the socket cannot be made."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            bind_private(sock, self.path)
            sock.listen(32)
        except OSError as exc:
            sock.close()
            log.warning(
                "no relay socket (%s): start estimates and site mode's live output are unavailable",
                exc,
            )
            return False
        self._socket = sock
        threading.Thread(target=self._accept, name="relay", daemon=True).start()
        return True

    def _accept(self) -> None:
        sock = self._socket
        assert sock is not None
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            self._slots.acquire()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(60)
                try:
                    request = json.loads(_read_line(conn))
                    if not isinstance(request, dict):
                        raise ValueError("not an object")
                    answer = self.handler(request)
                except ValueError as exc:
                    answer = {"error": "bad-request", "message": f"bad request: {exc}"}
                except Exception as exc:  # the API gets an answer, the log the details
                    log.exception("relay request failed")
                    answer = {"error": "unavailable", "message": f"the poller failed: {exc}"}
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps(answer).encode() + b"\n")
        finally:
            self._slots.release()

    def close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
            self._socket = None
            with contextlib.suppress(OSError):
                self.path.unlink()
