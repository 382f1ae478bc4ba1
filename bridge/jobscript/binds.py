"""The bind mounts of a task's executors (`compute_binds` -> `BindPlan`): inputs read-only,
output directories, volumes and stdio directories read-write, `storage.shared_dirs` at their
own path, the attempt's disk-backed scratch directory at /tmp and /var/tmp, and what stage-in
must prepare for them; `bind_args` spells them as runtime flags.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from bridge.config import Config
from bridge.core.naming import FileUrlError, is_local_url, local_path
from bridge.core.tes import ExecutorModel, FileType, InputModel, OutputModel, TaskModel
from bridge.job.layout import TaskLayout, has_wildcards, relative_parts, static_dir
from bridge.jobscript.task import RenderError, TesTask, container_path, parse_task

#: Container paths that cannot be bind targets: the runtime owns them.
_RESERVED = ("/proc", "/sys", "/dev")

#: Bound from the attempt's scratch directory on disk: with `--contain` the runtime would
#: otherwise give the container a small RAM tmpfs there (Apptainer's `sessiondir max size`,
#: 64 MiB by default), charged to the job's memory.
#: container path -> subdirectory of the scratch directory (see templates/job.sh.j2).
SCRATCH_TARGETS = {"/tmp": "tmp", "/var/tmp": "var-tmp"}


def _under(path: str, parent: str) -> bool:
    return parent == "/" or path == parent or path.startswith(parent + "/")


def _ancestors(path: str) -> list[str]:
    """`/a/b` -> [`/`, `/a`, `/a/b`]: every path `path` is `_under`."""
    parts = [p for p in path.split("/") if p]
    return ["/"] + ["/" + "/".join(parts[: n + 1]) for n in range(len(parts))]


def _reserved(path: str) -> bool:
    return path == "/" or any(_under(path, r) for r in _RESERVED)


@dataclass(frozen=True)
class Bind:
    host: str
    container: str
    readonly: bool
    #: The host side is root/<container> (False for inputs bound from the shared filesystem).
    uniform: bool = True
    #: The container side is a file (a FILE input), not a directory: how its mount point is made.
    file: bool = field(default=False, compare=False)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


@dataclass(frozen=True)
class BindPlan:
    binds: list[Bind]
    #: Container directories stage-in creates under root/ (sources of read-write binds).
    mkdirs: list[str]
    #: Inputs bound straight from the shared filesystem (file_input_mode "bind").
    bound_inputs: list[int]
    #: Inputs that may be hardlinked (file_input_mode "hardlink"): those that stay read-only.
    linkable_inputs: list[int]
    #: Of /tmp and /var/tmp, those that get the attempt's disk-backed scratch directory: each
    #: one the task mounts nothing at or above.
    scratch_targets: list[str]
    #: Binds inside a scratch target (shared directories, the task's inputs, outputs and
    #: volumes): bound after the scratch binds, on mount points (relative to the attempt's
    #: scratch directory) the job script makes: directories, and empty files for FILE inputs.
    after_scratch: list[Bind]
    scratch_mountpoints: list[str]
    scratch_mountfiles: list[str]
    #: file:// inputs and outputs whose container path is their own host path inside a shared
    #: directory: the shared bind already shows them, so they are neither staged nor bound.
    in_place_inputs: list[int]
    in_place_outputs: list[int]


class _BindCollector:
    """The binds a task asks for, in the order `compute_binds` collects them."""

    def __init__(self, config: Config, layout: TaskLayout) -> None:
        self.config = config
        self.layout = layout
        self.shared = shared_dirs(config)
        self.wanted = [Bind(d, d, False, uniform=False) for d in self.shared]
        self.in_place_inputs: list[int] = []
        self.in_place_outputs: list[int] = []
        self.bound: list[int] = []
        self.linkable: list[int] = []
        self.workdirs: list[str] = []

    def uniform(self, path: str, readonly: bool, file: bool = False) -> Bind:
        return Bind(str(self.layout.host_path(path)), path, readonly, file=file)

    def rw_dir(self, path: str, where: str) -> None:
        if _reserved(path):
            raise RenderError(f"{where}: {path!r} cannot be mounted in the container")
        self.wanted.append(self.uniform(path, False))

    def task(self, model: TaskModel) -> None:
        """Every bind the task asks for. Inputs last: whether one may be bound from the shared
        filesystem or hardlinked depends on the read-write binds around and inside it."""
        self.outputs(model.outputs or [])
        for i, volume in enumerate(model.volumes or []):
            self.rw_dir(container_path(volume, f"volumes[{i}]"), f"volumes[{i}]")
        self.executors(model.executors)
        self.inputs(model.inputs or [])

    def outputs(self, outputs: list[OutputModel]) -> None:
        """The parent directory of each output, each DIRECTORY output, read-write."""
        for i, item in enumerate(outputs):
            where = f"outputs[{i}].path"
            path = container_path(item.path, where)
            if _in_place(item.url, None, path, self.config):
                self.in_place_outputs.append(i)
            elif has_wildcards(path):
                self.rw_dir(static_dir(path), where)
            elif item.type == FileType.DIRECTORY:
                self.rw_dir(path, where)
            else:
                self.rw_dir(_parent(path), f"{where} (its directory)")

    def executors(self, executors: list[ExecutorModel]) -> None:
        """The parent directory of each stdout and stderr, read-write."""
        for i, executor in enumerate(executors):
            for key, value in (("stdout", executor.stdout), ("stderr", executor.stderr)):
                if value is not None:
                    parent = _parent(container_path(value, f"executors[{i}].{key}"))
                    if not _reserved(parent):  # e.g. /dev/null: the host file is enough
                        self.wanted.append(self.uniform(parent, False))
            if executor.stdin is not None:
                container_path(executor.stdin, f"executors[{i}].stdin")
            if executor.workdir is not None:
                self.workdirs.append(executor.workdir)

    def inputs(self, inputs: list[InputModel]) -> None:
        """Each input read-only: bound from the shared filesystem, or staged into root/."""
        writable = [b.container for b in self.wanted]
        staged: list[tuple[int, Bind, InputModel]] = []
        for i, item in enumerate(inputs):
            path = container_path(item.path, f"inputs[{i}].path")
            if _reserved(path):
                raise RenderError(f"inputs[{i}].path: {path!r} cannot be mounted in the container")
            if _in_place(item.url, item.content, path, self.config):
                self.in_place_inputs.append(i)
            else:
                is_file = item.type != FileType.DIRECTORY
                staged.append((i, self.uniform(path, True, file=is_file), item))
        for i, bind, item in staged:
            path = bind.container
            source = _shared_source(item, self.config)
            # Bound straight from the shared filesystem only where no other mount goes inside.
            if source and not self._mounts_inside(path, writable, staged, i):
                self.wanted.append(Bind(source, path, True, uniform=False, file=bind.file))
                self.bound.append(i)
                continue
            # A hardlink shares its inode with the file in the allowed directory: only where
            # the input stays read-only (no read-write mount around or inside it).
            if not any(_under(path, p) or _under(p, path) for p in writable):
                self.linkable.append(i)
            self.wanted.append(bind)

    @staticmethod
    def _mounts_inside(
        path: str, writable: list[str], staged: list[tuple[int, Bind, InputModel]], index: int
    ) -> bool:
        """Whether a read-write bind or another input lies at or below input `index`."""
        return any(_under(p, path) for p in writable) or any(
            j != index and _under(b.container, path) for j, b, _ in staged
        )

    def kept(self) -> list[Bind]:
        """The binds without those visible through an outer one: parents before children;
        for one path, read-write before read-only."""
        ordered = sorted(
            self.wanted, key=lambda b: (len(relative_parts(b.container)), b.container, b.readonly)
        )
        keep: list[Bind] = []
        seen: set[Bind] = set()
        #: Container path -> whether a kept uniform bind there is read-write.
        uniform_at: dict[str, bool] = {}
        for bind in ordered:
            # Covered: a kept uniform bind at the same path or above, read-write or as
            # read-only as this one (a lookup per ancestor, not a scan of all kept binds).
            covered = bind.uniform and any(
                uniform_at[outer] or bind.readonly
                for outer in _ancestors(bind.container)
                if outer in uniform_at
            )
            if not covered and bind not in seen:
                keep.append(bind)
                seen.add(bind)
                if bind.uniform:
                    uniform_at[bind.container] = uniform_at.get(bind.container, False) or (
                        not bind.readonly
                    )
        return keep

    def directories_to_make(self, keep: list[Bind]) -> list[str]:
        """Container directories stage-in makes under root/: the source of each kept read-write
        bind, and each executor's workdir inside one, which the runtime cannot make in the
        read-only image (Docker makes it, and Sprocket's workdir is a DIRECTORY output below its
        stdout's directory). Nothing else inside a bind: a job script's own `mkdir` of an output
        directory (Cromwell's glob directories) must not find it there already."""
        writable = [b.container for b in keep if b.uniform and not b.readonly]
        workdirs = {w for w in self.workdirs if any(_under(w, outer) for outer in writable)}
        return sorted(set(writable) | workdirs)

    def scratch_targets(self) -> list[str]:
        """/tmp and /var/tmp where nothing is mounted at or above them: what is mounted below
        goes on top of the scratch bind."""
        return [
            target
            for target in SCRATCH_TARGETS
            if not any(_under(target, b.container) for b in self.wanted)
        ]


def compute_binds(
    task: dict[str, Any] | TesTask, *, config: Config, layout: TaskLayout
) -> BindPlan:
    """Bind mounts shared by all executors of a task, and what stage-in must prepare for them.

    As in Funnel: inputs read-only one by one, the parent directory of each output, each
    DIRECTORY output, each volume and each stdout/stderr parent read-write; a bind inside a
    read-write bind of the same tree is dropped (it is visible through the outer one).
    Each of `storage.shared_dirs` is bound read-write at its own path, before anything the
    task mounts inside it; a file:// input or output at its own path inside one is left there.
    """
    collect = _BindCollector(config, layout)
    collect.task(parse_task(task).model)
    keep = collect.kept()
    scratch = collect.scratch_targets()
    on_scratch = _mounted_on_scratch(keep, scratch)
    files = {mountpoint for bind, mountpoint in on_scratch.items() if bind.file}
    return BindPlan(
        binds=[b for b in keep if b not in on_scratch],
        after_scratch=list(on_scratch),
        scratch_mountpoints=sorted({_parent(m) if m in files else m for m in on_scratch.values()}),
        scratch_mountfiles=sorted(files),
        scratch_targets=scratch,
        mkdirs=collect.directories_to_make(keep),
        bound_inputs=collect.bound,
        linkable_inputs=collect.linkable if config.storage.file_input_mode == "hardlink" else [],
        in_place_inputs=collect.in_place_inputs,
        in_place_outputs=collect.in_place_outputs,
    )


def _mounted_on_scratch(keep: list[Bind], scratch: list[str]) -> dict[Bind, str]:
    """The kept binds below a scratch target, in kept order (parents first), each with its mount
    point relative to the attempt's scratch directory.

    What lies below /tmp or /var/tmp (a shared /var/tmp/project, an input at /tmp/in/x) is
    mounted on top of the attempt's scratch bind there, so the rest of /tmp stays on disk; its
    mount point is made by the job in the scratch directory.
    """
    return {
        bind: SCRATCH_TARGETS[target] + bind.container[len(target) :]
        for bind in keep
        for target in scratch
        if _under(bind.container, target)
    }


def shared_dirs(config: Config) -> list[str]:
    return [str(d) for d in config.storage.shared_dirs]


def _is_file_url(url: str | None) -> TypeGuard[str]:
    return isinstance(url, str) and is_local_url(url)


def _in_place(url: str | None, content: str | None, path: str, config: Config) -> bool:
    """A file:// input or output whose container `path` is its own host path inside a shared
    directory (judged lexically: the executor sees exactly that path through the shared bind)."""
    if not _is_file_url(url) or content or has_wildcards(path):
        return False
    try:
        host = local_path(url)
    except FileUrlError:
        return False  # stage-in or stage-out reports the reason in system_logs
    return host == path and any(_under(path, d) for d in shared_dirs(config))


def _shared_source(item: InputModel, config: Config) -> str | None:
    """With file_input_mode "bind" (or staging.streamable_bind and a `streamable` input): the
    allowed host path of a file:// input, else None."""
    streamed = config.staging.streamable_bind and item.streamable is True
    if not (config.storage.file_input_mode == "bind" or streamed) or item.content:
        return None
    if not _is_file_url(item.url):
        return None
    from bridge.job.staging import StagingContext, StagingError
    from bridge.job.staging.file import allowed_path

    ctx = StagingContext(allowed_dirs=config.file_dirs)
    try:
        return str(allowed_path(item.url, ctx))
    except StagingError:
        return None  # stage-in reports the reason in system_logs


def _csv_field(text: str) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow([text])
    return out.getvalue()


def bind_args(binds: Iterable[Bind]) -> list[str]:
    """Runtime flags for the binds: `--bind h:c[:ro]`, or `--mount` (CSV-quoted) when a path
    holds `:` or `,`, which `--bind` takes as separators."""
    args: list[str] = []
    for bind in binds:
        if any(ch in bind.host + bind.container for ch in ':,\n\r"'):
            fields = ["type=bind", f"source={bind.host}", f"destination={bind.container}"]
            if bind.readonly:
                fields.append("ro")
            args += ["--mount", ",".join(_csv_field(f) for f in fields)]
        else:
            args += ["--bind", f"{bind.host}:{bind.container}" + (":ro" if bind.readonly else "")]
    return args
