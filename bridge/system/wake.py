"""The API's nudge to the poller: a datagram on a Unix socket in the state directory.

The poller looks for new tasks and cancels every 0.1 s between its cycles (one query). An API
worker that created or canceled a task also sends one byte to `<state_dir>/poller.wake`, so
the poller looks at once: a new task's job is submitted within milliseconds. The nudge is only
a hint: nothing is lost when no poller listens (another host, stopped, its queue full), since
the poller's own checks find the task all the same. The socket is the service account's alone
(mode 0600), and a nudge carries nothing: the poller reads what to do from the database.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

log = logging.getLogger(__name__)

#: The socket's name in the state directory.
WAKE_SOCKET = "poller.wake"


class WakeSender:
    """The API worker's side: `nudge()` never blocks and never fails."""

    def __init__(self, state_dir: Path) -> None:
        self.path = str(state_dir / WAKE_SOCKET)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)

    def nudge(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.sendto(b"!", self.path)

    def close(self) -> None:
        self._socket.close()


def bind_private(sock: socket.socket, path: Path) -> None:
    """Bind a Unix socket of the poller at `path`, mode 0600. There is one poller per state
    directory: a socket left there is a dead poller's."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)


class WakeReceiver:
    """The poller's side: a thread that sets `event` for each nudge (bursts coalesce)."""

    def __init__(self, state_dir: Path, event: threading.Event) -> None:
        self.path = state_dir / WAKE_SOCKET
        self.event = event
        self._socket: socket.socket | None = None

    def start(self) -> bool:
        """Listen; False (and the poller keeps its 0.1 s checks) when the socket cannot be made,
        e.g. a state directory whose path is longer than a socket address allows."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            bind_private(sock, self.path)
        except OSError as exc:
            sock.close()
            log.warning("no wake-up socket (%s): new tasks are looked for every 0.1 s", exc)
            return False
        self._socket = sock
        threading.Thread(target=self._listen, name="wake", daemon=True).start()
        return True

    def _listen(self) -> None:
        sock = self._socket
        assert sock is not None
        while True:
            try:
                data = sock.recv(64)
            except OSError:
                return  # closed
            if not data:
                return  # shut down (a nudge is one byte)
            self.event.set()

    def close(self) -> None:
        if self._socket is not None:
            # shutdown() ends the blocked recv(); close() alone would not wake it.
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
            self._socket = None
            with contextlib.suppress(OSError):
                self.path.unlink()
