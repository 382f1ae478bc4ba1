"""Waiting for tasks (progress display, exit codes) and following their logs."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from bridge.client.api import FINAL_STATES, TesClient, TesError

#: The exit code of `wait` (and `run`/`submit --wait`, `logs --follow`) for each final state.
EXIT_CODES = {"COMPLETE": 0, "EXECUTOR_ERROR": 3, "SYSTEM_ERROR": 4, "CANCELED": 5, "PREEMPTED": 6}
#: A request failed (the server's message is printed); 2 is a usage error (argparse's).
EXIT_FAILED = 1
#: `--timeout` passed before every task was final.
EXIT_TIMEOUT = 7
#: On a terminal, more tasks than this show only the count line and the tasks that failed.
#: Up to this many, `wait` also shows why a task waits (its latest system log line).
MANY = 20
#: The states in which a task's latest system log line says why it waits.
WAITING_STATES = ("QUEUED", "INITIALIZING")
#: `logs` reads a whole stream in parts this large (the most the bridge's endpoint answers).
WHOLE_READ_BYTES = 1024 * 1024
#: The output endpoint cannot give this stream (409: not a regular file; 503: not now, e.g. the
#: poller that reads it in site mode is down): `logs` says so and prints the document's copy.
UNREADABLE_NOW = (409, 503)

EXIT_CODES_HELP = """\
exit status:
  0  every task is COMPLETE          4  a task ended SYSTEM_ERROR
  1  a request failed                5  a task was CANCELED
  2  wrong usage                     6  a task was PREEMPTED
  3  a task ended EXECUTOR_ERROR     7  --timeout passed first
  (with several tasks, the highest of these)"""


def outcome(states: Iterable[str]) -> int:
    return max((EXIT_CODES.get(state, EXIT_FAILED) for state in states), default=0)


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _counts(states: Iterable[str | None]) -> str:
    counts = Counter(state or "?" for state in states)
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


class Progress:
    """On a terminal: a line per state change and one status line (the state, or the count of
    tasks in each state) redrawn in place. Otherwise: a plain `ID STATE` line per change."""

    def __init__(self, out: TextIO, err: TextIO, total: int):
        self.out = out
        self.err = err
        self.total = total
        self.tty = out.isatty()
        self.status_shown = False
        self.problem = ""
        #: task id -> the waiting reason shown last.
        self.notes: dict[str, str] = {}
        #: task id -> its name, shown beside it on a terminal.
        self.names: dict[str, str] = {}

    def _clear(self) -> None:
        if self.status_shown:
            self.out.write("\r\x1b[K")
            self.status_shown = False

    def change(self, task_id: str, state: str) -> None:
        if not self.tty:
            self.out.write(f"{task_id} {state}\n")  # for scripts: `ID STATE` only
        elif self.total <= MANY or state in FINAL_STATES - {"COMPLETE"}:
            self._clear()
            line = f"{datetime.now():%H:%M:%S}  {task_id}  {state}  {self.names.get(task_id, '')}"
            self.out.write(line.rstrip() + "\n")
        self.out.flush()

    def note(self, task_id: str, text: str) -> None:
        """Why a task waits (its latest system log line), once each time it changes; on
        stderr, so that stdout keeps only `ID STATE` lines for scripts."""
        if not text or self.notes.get(task_id) == text:
            return
        self.notes[task_id] = text
        self._clear()
        self.err.write(f"{task_id}: {text}\n")
        self.err.flush()

    def status(self, states: dict[str, str | None], elapsed: float, problem: str) -> None:
        if not self.tty:
            # Said once, on stderr: stdout keeps only `ID STATE` lines for scripts.
            if problem and problem != self.problem:
                self.err.write(f"tes-bridge task: {problem}; retrying\n")
                self.err.flush()
            self.problem = problem
            return
        if self.total == 1:
            ((task_id, state),) = states.items()
            name = self.names.get(task_id)
            line = f"{task_id}  {f'{name}  ' if name else ''}{state}  {_elapsed(elapsed)}"
        else:
            line = f"{self.total} tasks: {_counts(states.values())}  {_elapsed(elapsed)}"
        if problem:
            line += f"  ({problem}; retrying)"
        width = shutil.get_terminal_size().columns
        self._clear()
        # Never wider than the terminal: a wrapped line could not be redrawn with \r.
        self.out.write(line[: max(width - 1, 10)])
        self.status_shown = True
        self.out.flush()

    def done(self, states: dict[str, str | None]) -> None:
        self._clear()
        if self.total > 1:
            self.out.write(f"{self.total} tasks: {_counts(states.values())}\n")
        self.out.flush()


def wait_for(
    client: TesClient,
    task_ids: Sequence[str],
    *,
    out: TextIO,
    err: TextIO,
    interval: float,
    timeout: float | None,
) -> int:
    """Poll until every task is final; the exit code tells how they ended. A server that cannot
    be reached (or answers 5xx) is waited for; any other error ends the wait."""
    ids = list(dict.fromkeys(task_ids))
    states: dict[str, str | None] = dict.fromkeys(ids)
    progress = Progress(out, err, len(ids))
    started = time.monotonic()
    while True:
        problem = _poll(client, states, progress)
        elapsed = time.monotonic() - started
        pending = [i for i in ids if states[i] not in FINAL_STATES]
        if not pending:
            progress.done(states)
            return outcome(s for s in states.values() if s)
        if timeout is not None and elapsed >= timeout:
            progress.done(states)
            err.write(f"tes-bridge task: {len(pending)} task(s) not final after {timeout:g} s\n")
            return EXIT_TIMEOUT
        progress.status(states, elapsed, problem)
        time.sleep(interval if timeout is None else max(0.0, min(interval, timeout - elapsed)))


def _poll(client: TesClient, states: dict[str, str | None], progress: Progress) -> str:
    """Ask for the state of each task not final yet, and report those that changed. Returns ""
    or why the server cannot answer now (the tasks left are asked again next round)."""
    for task_id in [i for i, state in states.items() if state not in FINAL_STATES]:
        first = states[task_id] is None
        view = _view(states, task_id)
        try:
            task = client.get(task_id, view=view)
            state = str(task["state"])
            if first:
                progress.names[task_id] = str(task.get("name") or "")
        except TesError as exc:
            if exc.status is not None and exc.status < 500:
                progress.done(states)
                raise
            return str(exc)
        except (KeyError, TypeError):
            raise TesError(f"task {task_id}: the server's answer has no state") from None
        if state != states[task_id]:
            states[task_id] = state
            progress.change(task_id, state)
        if view == "FULL" and state in WAITING_STATES:
            progress.note(task_id, waiting_reason(task))
    return ""


def _view(states: dict[str, str | None], task_id: str) -> str:
    """A few waiting tasks are read in FULL: their system logs say why they wait. Each task is
    read at first with its name (BASIC), then by its state alone."""
    if len(states) <= MANY and states[task_id] in (None, *WAITING_STATES):
        return "FULL"
    return "BASIC" if states[task_id] is None else "MINIMAL"


def waiting_reason(task: dict[str, Any]) -> str:
    """The last system log line of the task's latest attempt ("" when there is none), and
    when Slurm expects its job to start, where the server says it (this bridge's
    `slurm_expected_start`)."""
    logs = task.get("logs") or []
    last = logs[-1] if logs and isinstance(logs[-1], dict) else {}
    lines = last.get("system_logs") or []
    reason = str(lines[-1]).splitlines()[0] if lines and str(lines[-1]).strip() else ""
    expected = expected_start(last)
    if not expected:
        return reason
    when = f"Slurm expects it to start at {expected} UTC"
    return f"{reason}; {when}" if reason else when


def expected_start(attempt: dict[str, Any]) -> str:
    """Slurm's estimate of when the attempt's pending job starts, as `YYYY-MM-DD HH:MM:SS`
    in UTC ("" when the server gives none)."""
    metadata = attempt.get("metadata") if isinstance(attempt, dict) else None
    value = metadata.get("slurm_expected_start") if isinstance(metadata, dict) else None
    try:
        moment = datetime.fromisoformat(str(value)) if value else None
    except ValueError:
        return ""
    if moment is None:
        return ""
    return f"{(moment.astimezone(UTC) if moment.tzinfo else moment):%Y-%m-%d %H:%M:%S}"


def new_text(shown: str, current: str) -> str:
    """What `current` adds to `shown`. Servers keep a tail of the output, so the window may
    have moved on: then the new text follows the longest end of `shown` that `current`
    starts with, and is all of `current` when they have nothing in common."""
    if current.startswith(shown):
        return current[len(shown) :]
    position = shown.find(current[:1])
    while position >= 0:
        if current.startswith(shown[position:]):
            return current[len(shown) - position :]
        position = shown.find(current[:1], position + 1)
    return current


class ExecutorText:
    """Writes executors' text to stdout and stderr. With several executors, a line
    `--- executor N stdout ---` (or `stderr`) comes before an executor's first text on each
    stream, so that either stream read alone says whose text follows."""

    def __init__(self, out: TextIO, err: TextIO):
        self.targets = {"stdout": out, "stderr": err}
        self.several = False
        self.headed: set[tuple[int, str]] = set()

    def write(self, executor: int, stream: str, text: str) -> None:
        if not text:
            return
        target = self.targets[stream]
        if self.several and (executor, stream) not in self.headed:
            self.headed.add((executor, stream))
            target.write(f"--- executor {executor} {stream} ---\n")
        target.write(text)

    def new_attempt(self) -> None:
        self.headed.clear()


def _last_attempt_logs(task: dict[str, Any]) -> list[Any]:
    attempts = task.get("logs") or []
    return ((attempts[-1] or {}).get("logs") or []) if attempts else []


def _documented(logs: list[Any], executor: int, stream: str) -> str:
    """An executor's stream as the task document keeps it."""
    return str((logs[executor] or {}).get(stream) or "")


#: A task the bridge staged on a transfer partition names its three jobs in its attempt's
#: metadata (`slurm_stage_in_job_id`, `slurm_job_id`, `slurm_stage_out_job_id`, and each one's
#: state, partition and exit code): each part, and the metadata keys' prefix.
_PARTS = (("stage-in", "slurm_stage_in"), ("task", "slurm"), ("stage-out", "slurm_stage_out"))


def job_parts(metadata: dict[str, Any]) -> list[str]:
    """One line per job of a staged task's attempt (part, job id, state, exit code, partition);
    none for a task of one job."""
    if not metadata.get("slurm_stage_in_job_id"):
        return []
    lines = []
    for part, key in _PARTS:
        job_id = metadata.get(f"{key}_job_id")
        if not job_id:
            continue
        line = f"{part} job {job_id}: {metadata.get(f'{key}_state') or 'submitted'}"
        code = metadata.get(f"{key}_exit_code")
        if code not in (None, ""):
            line += f", exit code {code}"
        partition = metadata.get(f"{key}_partition")
        if partition:
            line += f", partition {partition}"
        lines.append(line)
    return lines


class LogPrinter:
    """Prints the last attempt's executor stdout (to `out`), stderr and system logs (to `err`),
    each time only what was not printed before."""

    def __init__(self, out: TextIO, err: TextIO):
        self.out = out
        self.err = err
        self.text = ExecutorText(out, err)
        self.attempt: int | None = None
        self.shown: dict[tuple[int, str], str] = {}
        self.system_seen: set[str] = set()
        #: (attempt, executor) whose exit code was printed.
        self.codes_seen: set[tuple[int, int]] = set()

    def show(self, task: dict[str, Any], *, streams: bool = True) -> None:
        """With `streams` False, only the exit codes and system logs (the streams are read
        from the output endpoint)."""
        attempts = task.get("logs") or []
        if not attempts:
            return
        self.text.several = len(task.get("executors") or []) > 1
        self._follow_attempt(len(attempts) - 1, announce=streams)
        last = attempts[-1] or {}
        for number, log in enumerate(last.get("logs") or []):
            if streams:
                self._print_streams(number, log or {})
            self.exit_code(task, number)
        for line in last.get("system_logs") or []:
            if line not in self.system_seen:
                self.system_seen.add(line)
                self.err.write(f"system: {line}\n")
        for line in job_parts(last.get("metadata") or {}):
            if line not in self.system_seen:
                self.system_seen.add(line)
                self.err.write(f"job: {line}\n")
        self.out.flush()
        self.err.flush()

    def _follow_attempt(self, index: int, *, announce: bool) -> None:
        """A new attempt's streams start from nothing shown."""
        if self.attempt is not None and index != self.attempt:
            if announce:
                self.err.write(f"--- attempt {index + 1} ---\n")
            self.shown.clear()
            self.text.new_attempt()
        self.attempt = index

    def exit_code(self, task: dict[str, Any], number: int) -> None:
        """Executor `number`'s exit code in the last attempt, once, when it has one."""
        attempt = len(task.get("logs") or []) - 1
        logs = _last_attempt_logs(task)
        code = (logs[number] or {}).get("exit_code") if number < len(logs) else None
        if isinstance(code, int) and (attempt, number) not in self.codes_seen:
            self.codes_seen.add((attempt, number))
            self.out.flush()
            self.err.write(f"executor {number}: exit code {code}\n")

    def _print_streams(self, number: int, log: dict[str, Any]) -> None:
        for stream in ("stdout", "stderr"):
            text = log.get(stream) or ""
            self.text.write(number, stream, new_text(self.shown.get((number, stream), ""), text))
            self.shown[(number, stream)] = text


class OutputUnsupported(Exception):
    """The server has no live output endpoint (any TES server but this one)."""


class LiveOutput:
    """Follows each executor's stdout and stderr through the server's output endpoint, as they
    are written: executors run in order, so each stream moves to the next executor once the
    current one is done and read to its end."""

    def __init__(self, client: TesClient, task_id: str, out: TextIO, err: TextIO):
        self.client = client
        self.task_id = task_id
        self.text = ExecutorText(out, err)
        self.attempt: int | None = None
        self.position = {stream: (0, 0) for stream in self.text.targets}  # (executor, offset)

    def _read(
        self, executor: int, stream: str, offset: int, max_bytes: int | None = None
    ) -> dict[str, Any]:
        try:
            return self.client.output(
                self.task_id, executor=executor, stream=stream, offset=offset, max_bytes=max_bytes
            )
        except TesError as exc:
            if self.attempt is None and exc.status in (404, 405, 501):
                raise OutputUnsupported(str(exc)) from None
            raise

    def step(self, task: dict[str, Any], *, final: bool) -> None:
        """Print what was written since the last step; with `final` (the task is over), read
        every executor's streams to their ends. An executor whose files are gone (a task
        directory cleaned up) or were never seen here gives its log from the task document."""
        executors = max(len(task.get("executors") or []), 1)
        self.text.several = executors > 1
        documented = _last_attempt_logs(task)
        for stream, target in self.text.targets.items():
            self._read_on(stream, executors, documented, final=final)
            target.flush()

    def whole(self, task: dict[str, Any], printer: LogPrinter) -> None:
        """What `logs` prints: executor by executor, its streams from their start to where they
        end now, then its exit code (through `printer`), whatever the task's state. An executor
        whose files are gone gives its log from the task document."""
        executors = max(len(task.get("executors") or []), 1)
        self.text.several = executors > 1
        documented = _last_attempt_logs(task)
        for executor in range(executors):
            for stream, target in self.text.targets.items():
                try:
                    started = self._read_whole(executor, stream)
                except TesError as exc:
                    if exc.status not in UNREADABLE_NOW:
                        raise
                    self.text.targets["stderr"].write(f"tes-bridge task: {exc}\n")
                    started = False
                if not started and executor < len(documented):
                    self.text.write(executor, stream, _documented(documented, executor, stream))
                target.flush()
            printer.exit_code(task, executor)

    def _read_whole(self, executor: int, stream: str) -> bool:
        """Print `stream` of `executor` from its start to its size at the first read (one that
        still grows is not chased); whether the executor has started."""
        offset, end = 0, None
        while True:
            answer = self._read(executor, stream, offset, WHOLE_READ_BYTES)
            self.attempt = int(answer.get("attempt") or 1)
            self.text.write(executor, stream, str(answer.get("text") or ""))
            next_offset = int(answer.get("next_offset") or 0)
            end = int(answer.get("size") or 0) if end is None else end
            if not offset < next_offset < end:
                return bool(answer.get("started"))
            offset = next_offset

    def _read_on(self, stream: str, executors: int, documented: list[Any], *, final: bool) -> None:
        """Print `stream` from where it stopped, executor after executor, up to the end of
        the one still writing."""
        while self.position[stream][0] < executors:
            executor, offset = self.position[stream]
            answer = self._read(executor, stream, offset)
            if self._new_attempt(int(answer.get("attempt") or 1)):
                continue
            if not answer.get("started") and final and executor < len(documented):
                self.text.write(executor, stream, _documented(documented, executor, stream))
                self.position[stream] = (executor + 1, 0)
                continue
            if not self._print(stream, answer, final=final):
                break  # the executor is still writing

    def _new_attempt(self, attempt: int) -> bool:
        """Whether the server has moved on to another attempt: then every stream starts
        again from the first executor."""
        moved = self.attempt is not None and attempt != self.attempt
        if moved:
            self.text.targets["stderr"].write(f"--- attempt {attempt} ---\n")
            self.text.new_attempt()
            self.position = {s: (0, 0) for s in self.text.targets}
        self.attempt = attempt
        return moved

    def _print(self, stream: str, answer: dict[str, Any], *, final: bool) -> bool:
        """Print one read of the current executor's `stream` and move past it; False while
        that executor is still writing (read on at the next step)."""
        executor = self.position[stream][0]
        self.text.write(executor, stream, str(answer.get("text") or ""))
        self.text.targets[stream].flush()
        next_offset = int(answer.get("next_offset") or 0)
        self.position[stream] = (executor, next_offset)
        if next_offset < int(answer.get("size") or 0):
            return True  # more than one read's worth: read on
        if not (answer.get("done") or final):
            return False
        self.position[stream] = (executor + 1, 0)
        return True


def print_logs(client: TesClient, task: dict[str, Any], *, out: TextIO, err: TextIO) -> None:
    """What `logs` prints: the last attempt's executors in order, each one's stdout and stderr
    as far as written and its exit code, then the system logs. The streams are whole from
    the server's output endpoint; from other servers, what the task document keeps."""
    printer = LogPrinter(out, err)
    try:
        LiveOutput(client, str(task.get("id")), out, err).whole(task, printer)
    except OutputUnsupported:
        printer.show(task)
        return
    printer.show(task, streams=False)


def follow_logs(
    client: TesClient, task_id: str, *, out: TextIO, err: TextIO, interval: float
) -> int:
    """Print new output until the task is final; the exit code is the task's outcome. The
    executors' streams come live from the server's output endpoint when it has one, else from
    the task document (which lists an executor's log once it has finished)."""
    printer = LogPrinter(out, err)
    live: LiveOutput | None = LiveOutput(client, task_id, out, err)
    while True:
        try:
            task = client.get(task_id, view="FULL")
            state = task.get("state")
            if live is not None:
                try:
                    live.step(task, final=state in FINAL_STATES)
                except OutputUnsupported:
                    live = None
        except TesError as exc:
            if exc.status is not None and exc.status < 500:
                raise
            time.sleep(interval)
            continue
        printer.show(task, streams=live is None)
        if state in FINAL_STATES:
            err.write(f"task {task_id}: {state}\n")
            return outcome([str(state)])
        time.sleep(interval)
