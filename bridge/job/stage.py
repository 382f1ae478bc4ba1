"""`stage-in` and `stage-out`: the two Python phases of the job script.

Exit codes (the job script turns them into the outcome):
  stage-in   0 everything staged; 1 something failed (reasons in system_logs)
  stage-out  0 everything uploaded (an output not found counts with storage.missing_outputs
             "ignore"); 2 only missing or unusable outputs; 1 an upload failed
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import json
import os
import shutil
import socket
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bridge.core.reasons import IMAGE_UNREADABLE
from bridge.job import safepath
from bridge.job.items import TaskInput, TaskOutput, items
from bridge.job.layout import LayoutError, TaskLayout, has_wildcards, relative_parts, static_dir
from bridge.job.records import RecordsUnwritable, RecordsWriter
from bridge.job.settings import JobSettings, read_settings
from bridge.job.staging import (
    FileKind,
    StagingBackend,
    StagingContext,
    StagingError,
    StagingOptions,
    backend_for,
    file,
    redact,
)
from bridge.job.staging.content import write_content

STAGE_OK = 0
STAGE_FAILED = 1
STAGE_MISSING_OUTPUTS = 2
#: The records could not be written (RecordsUnwritable): the job script exits with
#: NO_RECORDS_EXIT_CODE, and the poller submits the task again.
STAGE_NO_RECORDS = 3

#: A FILE output the executors made a directory: uploaded as a DIRECTORY output is (Nextflow's
#: nf-ga4gh sends every output not declared `type: 'dir'` as FILE, nf-core modules declare
#: directories as `path "index"`).
FILE_IS_A_DIRECTORY = "is a directory (output type is FILE); uploaded as a directory"


def _load(layout: TaskLayout, log: RecordsWriter) -> tuple[dict[str, Any], JobSettings] | None:
    try:
        task = json.loads(layout.task_json.read_text(encoding="utf-8"))
        settings = read_settings(layout.job_config)
    except (OSError, ValueError, TypeError) as exc:
        log.system_log(f"cannot read the task directory {layout.task_dir}: {exc}")
        return None
    if not isinstance(task, dict):
        log.system_log(f"{layout.task_json} does not hold a task document")
        return None
    return task, settings


class _RedactingWriter(RecordsWriter):
    """Records whose system_logs never show credentials a task URL carries (user:password@)."""

    def system_log(self, message: str) -> None:
        super().system_log(redact(message))

    def output(self, *, url: str, path: str, size_bytes: int) -> None:
        super().output(url=redact(url), path=path, size_bytes=size_bytes)


def _context(layout: TaskLayout, settings: JobSettings, log: RecordsWriter) -> StagingContext:
    return StagingContext(
        allowed_dirs=[Path(d) for d in settings.allowed_dirs],
        file_input_mode=settings.file_input_mode,
        tmp_dir=layout.tmp,
        log=log.system_log,
        options=StagingOptions.from_dict(settings.staging),
    )


# --------------------------------------------------------------------------- stage-in


def _preflight(settings: JobSettings, log: RecordsWriter) -> bool:
    ok = True
    if shutil.which(settings.runtime) is None:
        log.system_log(
            f"container runtime {settings.runtime!r} not found on this node "
            f"({os.uname().nodename}); set container.runtime in the configuration or "
            "install it on the compute nodes"
        )
        ok = False
    for image in settings.images:
        if not os.access(image, os.R_OK):
            log.system_log(f"{IMAGE_UNREADABLE}: {image}")
            ok = False
    return ok


def _reset_root(layout: TaskLayout) -> None:
    # A retried job starts from a clean tree: links left by a previous run's executors must
    # not be there when staging writes into it (rmtree never follows links).
    if os.path.lexists(layout.root):
        shutil.rmtree(layout.root)
    layout.root.mkdir(mode=0o755)
    layout.tmp.mkdir(mode=0o700, exist_ok=True)


def stage_in(task_dir: Path, records_dir: Path) -> int:
    """`python -m bridge.job stage-in`: STAGE_OK, or STAGE_FAILED with reasons in system_logs."""
    return _naming_unexpected_errors("staging inputs", _stage_in, task_dir, records_dir)


def stage_out(task_dir: Path, records_dir: Path) -> int:
    """`python -m bridge.job stage-out`: STAGE_OK, STAGE_MISSING_OUTPUTS, or STAGE_FAILED with
    reasons in system_logs."""
    return _naming_unexpected_errors("uploading outputs", _stage_out, task_dir, records_dir)


def _naming_unexpected_errors(
    what: str,
    stage: Callable[[TaskLayout, RecordsWriter], int],
    task_dir: Path,
    records_dir: Path,
) -> int:
    """Run `stage`; an error no staging step expects (a defect, not the task's items) is named
    in the task's system_logs before its traceback goes to the job's output file, so that the
    task's logs say more than "staging failed"."""
    try:
        log = _RedactingWriter(records_dir)
        try:
            return stage(TaskLayout(task_dir), log)
        except RecordsUnwritable:
            raise
        except Exception as exc:
            log.system_log(f"{what} stopped on an unexpected error: {type(exc).__name__}: {exc}")
            raise
    except RecordsUnwritable as exc:
        # Nothing more can be said in the records: the job's output file says it.
        print(f"tes-bridge: {what}: {exc}", file=sys.stderr)
        return STAGE_NO_RECORDS


def _stage_in(layout: TaskLayout, log: RecordsWriter) -> int:
    loaded = _load(layout, log)
    if loaded is None:
        return STAGE_FAILED
    task, settings = loaded
    if settings.check_runtime and not _preflight(settings, log):
        return STAGE_FAILED
    try:
        _reset_root(layout)
        for directory in settings.mkdirs:
            layout.host_path(directory).mkdir(mode=0o755, parents=True, exist_ok=True)
    except (OSError, LayoutError) as exc:
        log.system_log(f"cannot prepare the task directory {layout.root}: {exc}")
        return STAGE_FAILED

    inputs = StageIn(layout, settings, _context(layout, settings, log), log)
    inputs.make_in_place_output_dirs(items(task, "outputs"))
    for index, item in enumerate(items(task, "inputs")):
        inputs.stage(index, item)
    if inputs.unconnected and settings.check_runtime:
        # Staging in the task's own job (staging.where = "job"): name the setting.
        log.system_log(no_network_hint())
    return inputs.exit_code()


#: A connection that could not be made at all (no route, no name server, refused, timed out).
_NO_CONNECTION = frozenset(
    {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ETIMEDOUT}
)


def _no_connection(exc: BaseException | None) -> bool:
    """Whether `exc` (or an error it was raised from or during) is a connection that could not
    be made: what staging meets on a compute node without outbound network."""
    for _ in range(12):
        if exc is None:
            return False
        if isinstance(exc, socket.gaierror):
            return True
        if isinstance(exc, OSError) and exc.errno in _NO_CONNECTION:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def no_network_hint() -> str:
    """The line a task gets when staging in its job could not connect: the site setting that
    moves it to nodes with network."""
    return (
        f"this node ({os.uname().nodename}) could not connect to a server; where compute nodes "
        'have no outbound network, set staging.where = "transfer" and '
        "staging.transfer_partition (stage-in and stage-out jobs on nodes with network; "
        "docs/site.md)"
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    return str(exc)


def _raw_label(kind: str, index: int, item: object) -> str:
    """How system_logs name an item that could not be read as a `TaskInput`/`TaskOutput`."""
    fields = item if isinstance(item, dict) else {}
    path, url = fields.get("path"), fields.get("url")
    if kind == "input":
        source = f"{url} " if url else ("content " if "content" in fields else "")
        return f"input {index} {source}-> {path}"
    return f"output {index} {path} -> {url}"


class StageIn:
    """Places the inputs of one run under root/, counting what failed (reasons in
    system_logs); each download goes to the `StagingBackend` of the input's URL."""

    def __init__(
        self, layout: TaskLayout, settings: JobSettings, ctx: StagingContext, log: RecordsWriter
    ) -> None:
        self.layout = layout
        self.settings = settings
        self.ctx = ctx
        self.log = log
        self.failed = 0
        #: An input failed for a connection that could not be made (see `_no_connection`).
        self.unconnected = False

    def exit_code(self) -> int:
        return STAGE_FAILED if self.failed else STAGE_OK

    def stage(self, index: int, item: object) -> None:
        """Stage input `index` (an item of the task document's `inputs`)."""
        label = _raw_label("input", index, item)
        try:
            task_input = TaskInput.parse(index, item)
            label = task_input.label
            if index in self.settings.in_place_inputs:
                _check_in_place(task_input.path, task_input.kind)
            else:
                self._place(task_input)
        except (StagingError, LayoutError, OSError) as exc:
            self.failed += 1
            self.unconnected = self.unconnected or _no_connection(exc)
            self.log.system_log(f"{label}: {_reason(exc)}")

    def make_in_place_output_dirs(self, outputs: list[object]) -> None:
        """As for any output, its directory exists before the executors run: for an output
        used in place, in the shared directory itself (links resolved, never outside it)."""
        for index in self.settings.in_place_outputs:
            label = _raw_label("output", index, outputs[index] if index < len(outputs) else None)
            try:
                output = TaskOutput.parse(index, outputs[index] if index < len(outputs) else None)
                label = f"output {index} {output.path}"
                directory = output.path
                if output.kind != "DIRECTORY":
                    directory = os.path.dirname(output.path)
                file.ensure_directory(directory, self.ctx)
            except StagingError as exc:
                self.failed += 1
                self.log.system_log(f"{label}: {exc}")

    def _context_for(self, task_input: TaskInput) -> StagingContext:
        mode = self.settings.file_input_mode
        if mode == "hardlink" and task_input.index not in self.settings.linkable_inputs:
            mode = "copy"
        return dataclasses.replace(self.ctx, file_input_mode=mode)

    def _place(self, task_input: TaskInput) -> None:
        kind = task_input.kind
        dest = self.layout.host_path(task_input.path)
        dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if os.path.lexists(dest) and not (kind == "DIRECTORY" and dest.is_dir()):
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            else:
                dest.unlink()  # a later input at the same path replaces an earlier one
        url = task_input.url
        if task_input.inline:
            write_content(task_input.content or "", dest, kind)
        elif not url:
            raise StagingError("input has neither url nor content")
        elif task_input.index in self.settings.bound_inputs:
            _make_mount_point(file.allowed_path(url, self.ctx), dest, kind)
        else:
            ctx = self._context_for(task_input)
            backend_for(url, ctx).download(url, dest, kind, ctx)


def _check_in_place(path: str, kind: FileKind) -> None:
    """An input the executors see at its own path through a shared directory's bind: it is
    used there, live (not copied), so only its presence is checked."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise StagingError(f"{path} (in a shared directory): {_reason(exc)}") from None
    if kind == "DIRECTORY" and not stat.S_ISDIR(st.st_mode):
        raise StagingError(f"{path} is not a directory (input type is DIRECTORY)")
    if kind != "DIRECTORY" and not stat.S_ISREG(st.st_mode):
        raise StagingError(f"{path} is not a regular file (input type is FILE)")


def _make_mount_point(source: Path, dest: Path, kind: FileKind) -> None:
    """An input bound read-only straight from the shared filesystem by the runtime: check
    that it is there and give the bind a mount point."""
    if kind == "DIRECTORY" and not source.is_dir():
        raise StagingError(f"{source} is not a directory (input type is DIRECTORY)")
    if kind != "DIRECTORY" and not source.is_file():
        raise StagingError(f"{source} is not a regular file (input type is FILE)")
    if not os.access(source, os.R_OK):
        raise StagingError(f"{source} is not readable")
    if kind == "DIRECTORY":
        dest.mkdir(mode=0o755, exist_ok=True)
    else:
        dest.touch(mode=0o644)


# --------------------------------------------------------------------------- stage-out


def _stage_out(layout: TaskLayout, log: RecordsWriter) -> int:
    loaded = _load(layout, log)
    if loaded is None:
        return STAGE_FAILED
    task, settings = loaded
    ignore_missing = settings.missing_outputs == "ignore"
    outputs = StageOut(layout, _context(layout, settings, log), log, ignore_missing=ignore_missing)
    for index, item in enumerate(items(task, "outputs")):
        outputs.stage(index, item, in_place=index in settings.in_place_outputs)
    if outputs.unconnected and settings.check_runtime:
        log.system_log(no_network_hint())  # uploading in the task's own job: name the setting
    return outputs.exit_code()


def _join_url(base: str, rel: str) -> str:
    return base.rstrip("/") + "/" + rel


class StageOut:
    """Uploads the outputs of one run, counting what is missing and what failed.

    Everything under root/ is read through `safepath` (never following a link an executor
    planted); each upload goes to the `StagingBackend` of the output's URL. With
    `ignore_missing` (storage.missing_outputs "ignore"), an output that does not exist is only
    logged: workflow engines list optional outputs an executor may not write.
    """

    def __init__(
        self,
        layout: TaskLayout,
        ctx: StagingContext,
        log: RecordsWriter,
        *,
        ignore_missing: bool = False,
    ) -> None:
        self.layout = layout
        self.ctx = ctx
        self.log = log
        self.ignore_missing = ignore_missing
        self.missing = 0
        self.failed = 0
        #: An upload failed for a connection that could not be made (see `_no_connection`).
        self.unconnected = False

    def exit_code(self) -> int:
        if self.failed:
            return STAGE_FAILED
        return STAGE_MISSING_OUTPUTS if self.missing else STAGE_OK

    def stage(self, index: int, item: object, *, in_place: bool) -> None:
        """Upload output `index` (an item of the task document's `outputs`); failures end in
        system_logs."""
        label = _raw_label("output", index, item)
        try:
            output = TaskOutput.parse(index, item)
            label = output.label
            if in_place:
                self._record_in_place(output, label)
                return
            upload = _Upload(self, backend_for(output.url, self.ctx), label)
            if has_wildcards(output.path):
                upload.wildcard(output.path, output.url, output.path_prefix)
            else:
                upload.one(output.path, output.url, output.kind)
        except (StagingError, LayoutError, OSError) as exc:
            self.failed += 1
            self.unconnected = self.unconnected or _no_connection(exc)
            self.log.system_log(f"{label}: {_reason(exc)}")

    def missing_output(self, label: str, why: str) -> None:
        self.missing += 1
        self.log.system_log(f"{label}: {why}")

    def not_found(self, label: str) -> None:
        """An output (without wildcards) that the executors did not write."""
        if self.ignore_missing:
            self.log.system_log(
                f"{label}: not found after the executors ran; ignored (storage.missing_outputs)"
            )
        else:
            self.missing_output(label, "not found after the executors ran")

    def _record_in_place(self, output: TaskOutput, label: str) -> None:
        """An output the executors wrote at its own path in a shared directory: already where
        it belongs, so it is only recorded (a copy onto itself would truncate it)."""
        path, url, kind = output.path, output.url, output.kind
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            self.not_found(label)
            return
        if kind == "DIRECTORY" and not stat.S_ISDIR(st.st_mode):
            self.missing_output(label, "is not a directory (output type is DIRECTORY)")
        elif stat.S_ISDIR(st.st_mode):
            if kind != "DIRECTORY":
                self.log.system_log(f"{label}: {FILE_IS_A_DIRECTORY}")
            self._record_in_place_tree(path, url)
        elif not stat.S_ISREG(st.st_mode):
            self.missing_output(label, "is not a regular file (output type is FILE)")
        else:
            self.log.output(url=url, path=path, size_bytes=st.st_size)

    def _record_in_place_tree(self, path: str, url: str) -> None:
        """Every regular file under the in-place directory `path` (os.walk enters no link)."""
        for dirpath, _dirs, names in os.walk(path):
            for name in sorted(names):
                entry = os.path.join(dirpath, name)
                entry_st = os.stat(entry, follow_symlinks=False)
                if stat.S_ISREG(entry_st.st_mode):
                    rel = os.path.relpath(entry, path)
                    self.log.output(
                        url=_join_url(url, rel), path=entry, size_bytes=entry_st.st_size
                    )


class _Upload:
    """One output on its way to the `StagingBackend` of its URL; what is missing or failed
    is counted in the `StageOut`."""

    def __init__(self, stage: StageOut, backend: StagingBackend, label: str) -> None:
        self.stage = stage
        self.root = stage.layout.root
        self.backend = backend
        self.label = label

    def _note(self, message: str) -> None:
        self.stage.log.system_log(f"{self.label}: {message}")

    def _failed(self, message: str) -> None:
        self.stage.failed += 1
        self._note(message)

    def one(self, path: str, url: str, kind: FileKind) -> None:
        parts = relative_parts(path)
        found = safepath.lstat_kind(self.root, parts)
        if found is None:
            self.stage.not_found(self.label)
        elif found == "link":
            self.stage.missing_output(self.label, "is a symbolic link; not uploaded")
        elif kind == "DIRECTORY":
            if found != "dir":
                self.stage.missing_output(
                    self.label, "is not a directory (output type is DIRECTORY)"
                )
            else:
                self._tree(parts, url)
        elif found == "dir":
            self._note(FILE_IS_A_DIRECTORY)
            self._tree(parts, url)
        elif found != "file":
            self.stage.missing_output(self.label, "is not a regular file (output type is FILE)")
        else:
            self._file(parts, path, url)

    def wildcard(self, path: str, url: str, prefix: str | None) -> None:
        parts = relative_parts(path)
        if prefix is None:
            # The spec requires path_prefix with wildcards; without one, keep paths relative
            # to the directory above the first wildcard.
            prefix = static_dir(path)
        matches = list(_glob(self.root, parts))
        if not matches:
            self._note("no file matched")
            return
        for match in matches:
            match_path = "/" + "/".join(match)
            pruned = match_path[len(prefix) :] if match_path.startswith(prefix) else match_path
            target = _join_url(url, pruned.lstrip("/"))
            found = safepath.lstat_kind(self.root, match)
            if found == "link":
                self._note(f"{match_path} is a symbolic link; not uploaded")
            elif found == "dir":
                self._tree(match, target)
            elif found == "file":
                self._file(match, match_path, target)
            else:
                self._note(f"{match_path} is not a regular file; not uploaded")

    def _file(self, parts: tuple[str, ...], path: str, url: str) -> None:
        with safepath.dir_fd(self.root, parts[:-1]) as parent:
            self._entry(parent, parts[-1], path, url)

    def _entry(self, parent_fd: int, name: str, path: str, url: str) -> None:
        """Upload the regular file `name` in the open directory `parent_fd`."""
        try:
            fd = safepath.open_regular(parent_fd, name)
        except safepath.UnsafePathError as exc:
            self._note(f"{path} {exc.strerror}; not uploaded")
            return
        try:
            size = os.fstat(fd).st_size
            self.backend.upload_file(fd, size, url, self.stage.ctx)
        except (StagingError, OSError) as exc:
            self.stage.unconnected = self.stage.unconnected or _no_connection(exc)
            self._failed(f"upload of {path} to {url} failed: {_reason(exc)}")
            return
        finally:
            os.close(fd)
        self.stage.log.output(url=url, path=path, size_bytes=size)

    def _tree(self, parts: tuple[str, ...], url: str) -> None:
        base = "/" + "/".join(parts)
        with safepath.dir_fd(self.root, parts) as top:
            self.backend.ensure_directory(url, self.stage.ctx)
            # fwalk never follows links and opens each directory relative to its parent.
            for dirpath, dirnames, filenames, dfd in os.fwalk(
                ".", dir_fd=top, follow_symlinks=False
            ):
                rel_dir = os.path.normpath(dirpath)
                rel_dir = "" if rel_dir == "." else rel_dir + "/"
                self._tree_dirs(dfd, dirnames, f"{base}/{rel_dir}", _join_url(url, rel_dir))
                for name in sorted(filenames):
                    rel = rel_dir + name
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISLNK(st.st_mode):
                        self._note(f"{base}/{rel} is a symbolic link; not uploaded")
                    elif not stat.S_ISREG(st.st_mode):
                        self._note(f"{base}/{rel} is not a regular file; not uploaded")
                    else:
                        self._entry(dfd, name, f"{base}/{rel}", _join_url(url, rel))

    def _tree_dirs(self, dfd: int, dirnames: list[str], where: str, url_dir: str) -> None:
        """Create the subdirectories fwalk is about to enter (`where` and `url_dir` end in
        `/`); drop links from `dirnames`."""
        for name in list(dirnames):
            # fwalk lists a link to a directory among the directories (and does not enter
            # it): say that it is skipped rather than upload an empty directory.
            if stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                dirnames.remove(name)
                self._note(
                    f"{where}{name} is a symbolic link to a directory; not followed, not uploaded"
                )
                continue
            try:
                self.backend.ensure_directory(url_dir + name, self.stage.ctx)
            except StagingError as exc:
                self._failed(str(exc))


def _glob(root: Path, parts: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """POSIX glob of container path components under root, never entering links."""

    def walk(prefix: tuple[str, ...], rest: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        if not rest:
            yield prefix
            return
        head, tail = rest[0], rest[1:]
        if not has_wildcards(head):
            kind = safepath.lstat_kind(root, (*prefix, head))
            if kind is not None and (not tail or kind == "dir"):
                yield from walk((*prefix, head), tail)
            return
        try:
            with safepath.dir_fd(root, prefix) as fd:
                names = sorted(os.listdir(fd))
        except OSError:
            return
        for name in names:
            if name.startswith(".") and not head.startswith("."):
                continue  # like the shell: * does not match hidden names
            if fnmatch.fnmatchcase(name, head):
                kind = safepath.lstat_kind(root, (*prefix, name))
                if not tail or kind == "dir":
                    yield from walk((*prefix, name), tail)

    yield from walk((), parts)
