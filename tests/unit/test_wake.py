"""bridge.system.wake: the API's nudge makes the poller look for new tasks at once."""

from __future__ import annotations

import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.poller import loop
from bridge.system.wake import WAKE_SOCKET, WakeReceiver, WakeSender


def test_a_nudge_reaches_the_poller_and_the_socket_is_private(tmp_path: Path) -> None:
    event = threading.Event()
    receiver = WakeReceiver(tmp_path, event)
    assert receiver.start()
    sender = WakeSender(tmp_path)
    try:
        assert stat.S_IMODE((tmp_path / WAKE_SOCKET).stat().st_mode) == 0o600
        sender.nudge()
        assert event.wait(5)
        event.clear()
        for _ in range(100):  # a burst: never blocks, and the poller looks at least once
            sender.nudge()
        assert event.wait(5)
    finally:
        sender.close()
        receiver.close()
    assert not (tmp_path / WAKE_SOCKET).exists()


def test_a_nudge_without_a_poller_is_harmless(tmp_path: Path) -> None:
    sender = WakeSender(tmp_path / "no" / "such" / "dir")
    sender.nudge()  # no exception: the poller's own checks find the task
    sender.close()


def test_a_state_dir_too_long_for_a_socket_keeps_the_timed_checks(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    assert not WakeReceiver(deep, threading.Event()).start()


class _Poller:
    """What _between_cycles calls: a quick check that asks for a cycle."""

    def __init__(self) -> None:
        self.checks = 0

    def quick_check(self) -> str:
        self.checks += 1
        return "cycle"

    def submit_new(self) -> Any:
        raise AssertionError("not reached")


def test_the_poller_looks_at_once_when_nudged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Timed checks far apart: only the nudge can make the quick check come early.
    monkeypatch.setattr(loop, "QUICK_CHECK_INTERVAL", 30.0)
    nudge = threading.Event()
    receiver = WakeReceiver(tmp_path, nudge)
    assert receiver.start()
    sender = WakeSender(tmp_path)
    poller = _Poller()
    threading.Timer(0.2, sender.nudge).start()
    started = time.monotonic()
    try:
        loop._between_cycles(
            poller,  # type: ignore[arg-type]
            interval=60.0,
            stop=threading.Event(),
            wake=threading.Event(),
            nudge=nudge,
        )
    finally:
        sender.close()
        receiver.close()
    assert poller.checks == 1
    assert time.monotonic() - started < 20  # the timed check would have come at 30 s
