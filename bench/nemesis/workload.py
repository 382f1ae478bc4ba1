"""The load: the planned tasks (their inputs written), the client that creates and polls
them, and its record of every request."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench.nemesis.cluster import now

TERMINAL = {"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED", "PREEMPTED"}


@dataclass
class Call:
    start: float
    end: float
    what: str
    #: The HTTP status, or 0 when no answer came (connection refused or reset, time-out).
    status: int


@dataclass
class Recorder:
    t0: float
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(
        self, session: requests.Session, method: str, url: str, what: str, **kwargs: Any
    ) -> requests.Response | None:
        started = now()
        try:
            response = session.request(method, url, timeout=10, **kwargs)
        except requests.RequestException:
            response = None
        status = 0 if response is None else response.status_code
        with self.lock:
            self.calls.append(Call(started - self.t0, now() - self.t0, what, status))
        return response


# ------------------------------------------------------------------------------ the tasks
@dataclass
class Task:
    index: int
    kind: str
    document: dict[str, Any]
    #: The state its own command explains.
    expected: str
    #: What its executor prints, and files it must leave (path -> content).
    stdout: str | None = None
    files: dict[Path, str] = field(default_factory=dict)
    id: str | None = None


def make_task(index: int, rng: random.Random, run: str, shared: Path, http_port: int) -> Task:
    """Task number `index`, its input files written (before the storage servers start: rclone
    keeps directory listings for minutes)."""
    kind = rng.choices(["sleep", "shared", "http-s3", "s3-http", "fails"], [50, 20, 12, 12, 6])[0]
    data, bucket = shared / "data", shared / "storage" / "bucket"
    name = f"nemesis-{index}"
    text = f"{run} {index}"
    http = f"http://127.0.0.1:{http_port}/bucket"
    base: dict[str, Any] = {"name": name, "tags": {"nemesis": run, "kind": kind}}
    echo = f"cat /in/x > /out/y; echo {index} >> /out/y; echo {index}"
    if kind == "sleep":
        base["executors"] = [{"image": "alpine", "command": ["sh", "-c", f"sleep 1; echo {index}"]}]
        return Task(index, kind, base, "COMPLETE", f"{index}\n")
    if kind == "fails":
        base["executors"] = [{"image": "alpine", "command": ["sh", "-c", f"echo {index}; exit 3"]}]
        return Task(index, kind, base, "EXECUTOR_ERROR", f"{index}\n")
    base["executors"] = [{"image": "alpine", "command": ["sh", "-c", echo]}]
    expected = f"{text}\n{index}\n"
    if kind == "shared":
        (data / "in" / f"{index}.txt").write_text(text + "\n")
        source, target = f"file://{data}/in/{index}.txt", data / "out" / f"{index}.txt"
        url = f"file://{target}"
    elif kind == "http-s3":
        (bucket / "in" / f"{index}.txt").write_text(text + "\n")
        source = f"{http}/in/{index}.txt"
        target, url = bucket / "out" / f"{index}.txt", f"s3://bucket/out/{index}.txt"
    else:
        (bucket / "in" / f"{index}.txt").write_text(text + "\n")
        source = f"s3://bucket/in/{index}.txt"
        target, url = bucket / "out" / f"{index}.txt", f"{http}/out/{index}.txt"
    base["inputs"] = [{"url": source, "path": "/in/x", "type": "FILE"}]
    base["outputs"] = [{"url": url, "path": "/out/y", "type": "FILE"}]
    return Task(index, kind, base, "COMPLETE", f"{index}\n", {target: expected})


def prepare_inputs(shared: Path) -> None:
    for path in ("data/in", "data/out", "storage/bucket/in", "storage/bucket/out"):
        (shared / path).mkdir(parents=True, exist_ok=True)


class Load:
    """Creates the tasks at an even pace and polls them (and lists them) meanwhile."""

    def __init__(self, api: str, recorder: Recorder, tasks: list[Task], seconds: float) -> None:
        self.api, self.recorder, self.tasks, self.seconds = api, recorder, tasks, seconds
        self.stopping = threading.Event()
        self.created: list[Task] = []
        self.create_failures = 0
        self.lock = threading.Lock()

    def create_all(self) -> None:
        session = requests.Session()
        spacing = self.seconds / max(1, len(self.tasks))
        for task in self.tasks:
            wait = self.recorder.t0 + task.index * spacing - now()
            if wait > 0:
                time.sleep(wait)
            # As a client would: a create that got no answer, or a 5xx, is sent again (the
            # check matches tasks by name, so a create answered too late is not lost either).
            for _ in range(60):
                result = self.recorder.call(
                    session, "POST", f"{self.api}/tasks", "create", json=task.document
                )
                if result is not None and result.status_code == 200:
                    task.id = result.json()["id"]
                    with self.lock:
                        self.created.append(task)
                    break
                self.create_failures += 1
                time.sleep(1)

    def poll(self, seed: int) -> None:
        rng = random.Random(seed)
        session = requests.Session()
        done: set[str] = set()
        count = 0
        while not self.stopping.is_set():
            count += 1
            with self.lock:
                open_ids = [t.id for t in self.created[-300:] if t.id and t.id not in done]
            if count % 10 == 0 or not open_ids:
                self.recorder.call(
                    session,
                    "GET",
                    f"{self.api}/tasks",
                    "list",
                    params={"page_size": "50", "view": "MINIMAL"},
                )
            else:
                task_id = rng.choice(open_ids)
                result = self.recorder.call(
                    session, "GET", f"{self.api}/tasks/{task_id}", "get", params={"view": "MINIMAL"}
                )
                ok = result is not None and result.status_code == 200
                if ok and result.json().get("state") in TERMINAL:  # type: ignore[union-attr]
                    done.add(task_id)
            time.sleep(0.1)
