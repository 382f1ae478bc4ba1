"""One configuration object for every part of the bridge.

Values come from, in increasing priority: the defaults below, a TOML file (``--config FILE`` or
``TES_BRIDGE_CONFIG``), and a few environment variables (``TES_BRIDGE_DATABASE``,
``TES_BRIDGE_STATE_DIR``, ``TES_BRIDGE_WORK_DIR``). ``deploy/tes-bridge.example.toml`` documents
every key. Unknown keys are an error, so a typo in a site's config fails at start-up instead of
being silently ignored.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from bridge.core.backend_params import DEFAULT_SUPPORTED, SiteTimes, parse_time
from bridge.core.drs import DrsUriError, host_problem, parse_drs_uri

ENV_CONFIG = "TES_BRIDGE_CONFIG"
#: Where the systemd units (deploy/systemd) and docs/operations.md put the configuration.
DEFAULT_CONFIG_FILE = Path("/etc/tes-bridge/tes-bridge.toml")
ENV_DATABASE = "TES_BRIDGE_DATABASE"
ENV_STATE_DIR = "TES_BRIDGE_STATE_DIR"
ENV_WORK_DIR = "TES_BRIDGE_WORK_DIR"

DEFAULT_STATE_DIR = Path("/var/lib/tes-bridge")

#: The backend_parameters keys the Slurm backend understands (see bridge.core.backend_params).
SLURM_BACKEND_PARAMETERS = list(DEFAULT_SUPPORTED)


def _slurm_time(value: str | None) -> str | None:
    if value is not None:
        parse_time(value)  # a ValueError names the formats
    return value


#: A time limit in one of Slurm's formats (`1-00:00:00`, `90`, `UNLIMITED`).
SlurmTime = Annotated[str | None, AfterValidator(_slurm_time)]


class ConfigError(Exception):
    """The configuration cannot be used; the message says which key and why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Section):
    bind: str = "127.0.0.1:8000"
    workers: int = Field(default=2, ge=1)
    #: Threads per worker that run the app on complete requests (see bridge.api.server).
    threads: int = Field(default=4, ge=1)
    #: A client has this long to send a request's head (line and headers); also how long an
    #: idle keep-alive connection stays open.
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    #: A client has this long to send a request's body once its head is in.
    body_timeout_seconds: float = Field(default=60.0, gt=0)
    #: A longer request line (method, URI, version) is answered 414.
    max_request_line_bytes: int = Field(default=8190, ge=1024)
    #: Larger request headers (all of them together) are answered 431.
    max_header_bytes: int = Field(default=32 * 1024, ge=4096)
    #: Run the poller inside `tes-bridge serve` (turn off when it runs as its own service).
    run_poller: bool = True
    access_log: bool = True


class LimitsConfig(_Section):
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_executors: int = Field(default=64, ge=1)
    max_inputs: int = Field(default=4096, ge=0)
    max_outputs: int = Field(default=4096, ge=0)
    max_volumes: int = Field(default=256, ge=0)
    max_tags: int = Field(default=256, ge=0)
    #: Inline input `content`, per input. The TES document asks servers to accept 128 KiB.
    max_content_bytes: int = Field(default=1024 * 1024, ge=128 * 1024)
    #: A list page (BASIC, FULL) stops before the stored tasks it reads pass this many bytes,
    #: and gives a next_page_token; a page always has at least one task.
    list_budget_bytes: int = Field(default=16 * 1024 * 1024, ge=64 * 1024)


class ServiceInfoConfig(_Section):
    id: str = "org.ga4gh.tes-slurm-bridge"
    name: str = "tes-slurm-bridge"
    description: str = "GA4GH Task Execution Service on Slurm with Apptainer containers"
    organization_name: str = "tes-slurm-bridge"
    organization_url: str = "https://example.org/tes-slurm-bridge"
    documentation_url: str | None = None
    contact_url: str | None = None
    environment: str = "production"
    created_at: str | None = None
    updated_at: str | None = None
    #: URL prefixes this deployment can stage from and to (service-info `storage`); "derive"
    #: lists file:// and each protocol enabled in `[staging]`.
    storage: list[str] | Literal["derive"] = "derive"


class BackendParametersConfig(_Section):
    #: Keys accepted in a task's backend_parameters (compared case-insensitively).
    supported: list[str] = Field(default_factory=lambda: list(SLURM_BACKEND_PARAMETERS))
    #: A key not in `supported`: "ignore" (TES: a backend may ignore them; dropped, with a
    #: system log line suggesting the nearest supported key) or "refuse" (a 400 naming it and
    #: the suggestion). A task's own `backend_parameters_strict: true` always refuses.
    unsupported: Literal["ignore", "refuse"] = "ignore"


class SiteRule(_Section):
    """Site hooks for a class of tasks (`[[slurm.rules]]`, the first that matches wins): every
    condition given must hold."""

    #: The partition the task asks for (backend_parameters.partition, zones, or
    #: slurm.default_partition) is one of these.
    partition: list[str] | None = None
    #: The task asks for GPUs (true) or does not (false).
    gpu: bool | None = None
    #: The task's owner is a member of one of these Unix groups.
    owner_group: list[str] | None = None
    #: `#SBATCH` options written after the task's own (so they win), without the prefix.
    directives: list[str] = Field(default_factory=list)
    #: Shell text run after slurm.prologue (e.g. `module load cuda`).
    prologue: str = ""

    @field_validator("directives")
    @classmethod
    def _one_line_each(cls, value: list[str]) -> list[str]:
        for line in value:
            if "\n" in line or "\r" in line:
                raise ValueError(f"{line!r} spans several lines")
        return value


class SlurmConfig(_Section):
    sbatch: str = "sbatch"
    squeue: str = "squeue"
    sacct: str = "sacct"
    scancel: str = "scancel"
    sinfo: str = "sinfo"
    #: Reads slurmctld's own RPC rate limit (which lowers the budget) and MaxArraySize
    #: (`scontrol show config`).
    scontrol: str = "scontrol"
    #: The budget of Slurm calls (slurmctld RPCs: squeue three, sinfo and scontrol two): at most
    #: calls_burst at once, then calls_per_second; lowered to slurmctld's rl_* limit where it
    #: sets one. The defaults stay inside Slurm's rl_enable defaults (30 tokens, 2 a second,
    #: added at whole seconds: 28 for a bucket refilled evenly). 0: no budget.
    calls_per_second: float = Field(default=2.0, ge=0)
    calls_burst: int = Field(default=28, ge=1)
    command_timeout: float = Field(default=30.0, gt=0)
    poll_interval: float = Field(default=1.0, gt=0)
    #: Partitions a task may name in `resources.zones` or backend_parameters.partition;
    #: empty means any.
    partitions: list[str] = Field(default_factory=list)
    default_partition: str | None = None
    #: Where a task with `resources.preemptible = true` goes: this partition (unless the task
    #: names one in backend_parameters or zones) and/or this QOS (unless it names one). Both
    #: unset: `preemptible` is ignored and the task goes where any other would.
    preemptible_partition: str | None = None
    preemptible_qos: str | None = None
    #: A job Slurm preempted (sacct state PREEMPTED). resubmit: a new attempt, like a job lost
    #: to a node failure (counted in `retries`). report: the task ends PREEMPTED, final here;
    #: the client may submit it again (sprocket does; Nextflow and Cromwell wait forever on
    #: PREEMPTED, so keep resubmit for them). The default of a task's own
    #: backend_parameters.on_preemption; "preempted" is the older name of report.
    on_preemption: Literal["resubmit", "report"] = "resubmit"
    #: sbatch --time for tasks that ask for none (backend_parameters time or max_time);
    #: unset: the partition's own limit. `default_time_limit` is the older name.
    default_time: SlurmTime = Field(
        default=None, validation_alias=AliasChoices("default_time", "default_time_limit")
    )
    #: The largest time limit a task may ask for: a larger one is refused (400); tasks that ask
    #: for none get this one when default_time is unset.
    max_time: SlurmTime = None
    #: Admission control: at most this many jobs of this service in Slurm at once (queued or
    #: running), and at most max_jobs_per_owner of one owner; the other tasks stay QUEUED,
    #: saying why. 0: no limit.
    max_jobs_in_flight: int = Field(default=0, ge=0)
    max_jobs_per_owner: int = Field(default=0, ge=0)
    #: Job arrays. auto: QUEUED tasks ready in the same submission round that ask Slurm for
    #: the same (their job scripts' directives alike but for name, output and directory, and
    #: the same owner) go as one `sbatch --array`, once at least `array_min_tasks` of them
    #: are ready; never: one sbatch per task. Site mode always submits one job per task.
    arrays: Literal["auto", "never"] = "auto"
    array_min_tasks: int = Field(default=4, ge=2)
    #: While a burst arrives (a submission round of at least `array_min_tasks` tasks), each
    #: shape waits in QUEUED while its tasks keep arriving: until none has arrived for this
    #: many seconds, or its oldest has waited `array_gather_max_seconds`; so a burst becomes
    #: one array per shape. A lone task never waits. 0: off.
    array_gather_seconds: float = Field(default=1.0, ge=0)
    array_gather_max_seconds: float = Field(default=5.0, ge=0)
    #: What a task's `resources.disk_gb` becomes. auto: `--tmp` (MB, rounded up) only where
    #: every node of the task's partition declares a TmpDisk (read with one sinfo call, again
    #: after `tmp_disk_refresh_seconds`); tmp: always `--tmp`; ignore: never.
    disk_request: Literal["auto", "tmp", "ignore"] = "auto"
    #: How long the nodes' TmpDisk and memory (one sinfo call) are kept.
    tmp_disk_refresh_seconds: float = Field(default=600.0, gt=0)
    #: Extra `#SBATCH` lines, written as given (without the `#SBATCH` prefix).
    extra_directives: list[str] = Field(default_factory=list)
    #: Site hooks per class of task: the first rule that matches adds its directives and
    #: prologue (see SiteRule).
    rules: list[SiteRule] = Field(default_factory=list)
    #: Shell text run at the start and end of every job script (e.g. `module load apptainer`).
    prologue: str = ""
    epilogue: str = ""
    #: How many times a job lost to NODE_FAIL, BOOT_FAIL, (on_preemption = "resubmit")
    #: PREEMPTED, or its script killed by a signal before recording an outcome, is
    #: submitted again.
    retries: int = Field(default=2, ge=0)
    submit_backoff_initial: float = Field(default=2.0, gt=0)
    submit_backoff_max: float = Field(default=300.0, gt=0)
    #: After an interrupted sbatch (a poller killed mid-submit, a time-out), how long
    #: slurmctld may still act on a request it already received; only then is the task
    #: submitted again when no job of its name exists. About twice Slurm's MessageTimeout.
    submit_settle: float = Field(default=20.0, ge=0)
    #: How long the partitions read for the capabilities document (one sinfo) are kept.
    capabilities_refresh_seconds: float = Field(default=60.0, gt=0)

    @field_validator("on_preemption", mode="before")
    @classmethod
    def _older_name(cls, value: object) -> object:
        return "report" if value == "preempted" else value

    @property
    def times(self) -> SiteTimes:
        """The time settings as the task's time limit reads them."""
        return SiteTimes(self.default_time, self.max_time)

    @model_validator(mode="after")
    def _default_within_max(self) -> SlurmConfig:
        if self.default_time and self.max_time:
            default, maximum = parse_time(self.default_time), parse_time(self.max_time)
            if maximum is not None and (default is None or default > maximum):
                raise ValueError(f"default_time {self.default_time} is above max_time")
        return self


class ContainerConfig(_Section):
    #: `apptainer` or `singularity` (a name on PATH or an absolute path).
    runtime: str = "apptainer"
    #: Runtime flags before `exec`; `--quiet` keeps the runtime's INFO lines out of task stderr.
    global_flags: list[str] = Field(default_factory=lambda: ["--quiet"])
    #: Flags for every `exec`; `--userns` is needed where the runtime cannot use setuid.
    exec_flags: list[str] = Field(default_factory=lambda: ["--cleanenv", "--contain"])
    extra_flags: list[str] = Field(default_factory=list)
    #: Least privilege for every executor: no capabilities and no setuid (`--no-privs`), and a
    #: PID namespace of its own (`--pid`) so no other task's processes or argv are visible.
    #: Empty only for a runtime that lacks these flags.
    isolation_flags: list[str] = Field(default_factory=lambda: ["--no-privs", "--pid"])
    #: DANGEROUS. Let `serve` and `poller` run as root, and jobs run executors as root. An
    #: executor of root is host root behind a user namespace: it can write host files such as
    #: /proc/sys/kernel/core_pattern. Run the bridge as an unprivileged account instead.
    allow_root: bool = False
    #: Registry used for unqualified names such as `alpine` or `ubuntu:22.04`.
    default_registry: str = "docker.io"
    #: Registries reached over plain HTTP (e.g. a local mirror `127.0.0.1:5000`).
    insecure_registries: list[str] = Field(default_factory=list)
    #: Shared SIF cache; defaults to `<state_dir>/images`.
    cache_dir: Path | None = None
    #: What executors run from. `sif`: the pulled file, mounted at each start (squashfuse
    #: under `--userns`). `sandbox`: the SIF unpacked once into the cache beside it (the
    #: unpacked size on disk, about twice the SIF's); it starts and reads faster (see
    #: docs/benchmarks.md) and the SIF serves until it is ready. `auto`: `sandbox` when the cache
    #: is on a local filesystem and executors run as the service account, else `sif` (a shared
    #: filesystem's metadata servers take one file per image better than thousands; in site
    #: mode, owners could not read every file of a sandbox the service account unpacked).
    image_format: Literal["auto", "sif", "sandbox"] = "auto"
    #: A pull (or a registry that stops answering) taking longer is killed and retried as a
    #: transient failure. `pull_timeout` is the older name.
    pull_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        validation_alias=AliasChoices("pull_timeout_seconds", "pull_timeout"),
    )
    #: A tag (`latest`, or no tag) is checked against the registry again after this long and
    #: pulled again only when its manifest digest changed; `@sha256:` references never are.
    refresh_seconds: float = Field(default=300.0, ge=1)
    #: Image pulls running at the same time, in the background of the poller.
    pull_workers: int = Field(default=2, ge=1)
    #: An image or tag that does not exist is not looked up again for this long; tasks using it
    #: fail at once. Transient failures (registry down, full disk) are retried with back-off.
    pull_failure_ttl: float = Field(default=30.0, ge=0)
    #: A registry that cannot be reached (its host name not found, connection refused, no
    #: route) for this long fails the tasks waiting for it, and new ones at once, until it
    #: answers again; a cached SIF still serves. Until then they wait in QUEUED, saying why.
    pull_give_up_seconds: float = Field(default=600.0, gt=0)
    #: The flag that gives executors of a task that asks for GPUs the host's GPU libraries:
    #: `--nv` (NVIDIA) or `--rocm` (AMD).
    gpu_flag: Literal["--nv", "--rocm"] = "--nv"
    #: Directories whose `.sif` files tasks may name as an absolute image path; empty: none.
    local_image_dirs: list[Path] = Field(default_factory=list)
    #: The executors' umask (octal): what they write, in shared directories too, is readable
    #: by others with the default. The job's own files keep umask 077.
    umask: str = Field(default="022", pattern=r"^[0-7]{3,4}$")


class StorageConfig(_Section):
    #: Host directories that `file://` URLs and bare paths may read from and write to.
    allowed_dirs: list[Path] = Field(default_factory=list)
    #: Host directories bound read-write at their own path into every executor (a site's shared
    #: filesystem, a workflow engine's working or job-store directory); `file://` URLs may use
    #: them too. An input or output whose container path is its own host path inside one is
    #: used in place: neither copied nor bound over the live directory.
    shared_dirs: list[Path] = Field(default_factory=list)
    #: How a shared-filesystem input enters the task directory: copy, hardlink or bind.
    file_input_mode: str = "copy"
    #: An output (without wildcards) that does not exist after the executors ran: `ignore`
    #: logs it in system_logs and goes on (workflow engines declare optional outputs), `fail`
    #: ends the task SYSTEM_ERROR when every executor succeeded.
    missing_outputs: Literal["ignore", "fail"] = "ignore"
    #: A `file://` input is looked up at create: one this host sees missing, or not of its
    #: type, is a 400 naming it (false: the job finds out, SYSTEM_ERROR). Only paths inside
    #: allowed_dirs and shared_dirs are looked up, as the service account sees them.
    check_inputs: bool = True

    @field_validator("file_input_mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        if value not in {"copy", "hardlink", "bind"}:
            raise ValueError("must be one of copy, hardlink, bind")
        return value

    @field_validator("shared_dirs")
    @classmethod
    def _usable_shared_dirs(cls, value: list[Path]) -> list[Path]:
        for path in value:
            text = str(path)
            if not path.is_absolute() or os.path.normpath(text) != text or "\n" in text:
                raise ValueError(f"{text!r} must be a normalised absolute path")
            if path == Path("/") or any(path.is_relative_to(r) for r in _RUNTIME_DIRS):
                raise ValueError(f"{text!r} cannot be bound into a container")
            if not path.is_dir():
                raise ValueError(f"{text!r} does not exist or is not a directory")
        return value


#: Container directories the runtime owns: never bind targets.
_RUNTIME_DIRS = (Path("/proc"), Path("/sys"), Path("/dev"))

#: URL schemes the job side can stage (bridge.job.staging).
STAGING_PROTOCOLS = ["file", "http", "https", "s3", "ftp", "drs"]
#: A partition or QOS name, as it may go into an `#SBATCH` line.
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class StagingConfig(_Section):
    """Job-side transfers. Credentials are never written here: only the paths of the files that
    hold them, which the compute nodes read (see docs/staging.md)."""

    #: Schemes tasks may use for inputs and outputs (file is governed by storage.allowed_dirs).
    protocols: list[str] = Field(default_factory=lambda: list(STAGING_PROTOCOLS))
    #: Upload outputs to http(s):// URLs with PUT.
    http_upload: bool = False
    #: Further attempts after a transient failure (HTTP 5xx/429, S3 throttling, resets).
    retries: int = Field(default=3, ge=0)
    #: Seconds to wait for a connection or for data before giving up.
    timeout: float = Field(default=60.0, gt=0)
    #: An S3-compatible endpoint (e.g. `https://s3.example.org`); None means AWS.
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    #: A profile in the shared-credentials file; None means `default` or the AWS environment.
    s3_profile: str | None = None
    #: An AWS shared-credentials file readable on the compute nodes (instead of ~/.aws).
    s3_credentials_file: Path | None = None
    #: auto, path or virtual (most S3-compatible stores want path).
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"
    s3_multipart_threshold_mb: int = Field(default=64, ge=5)
    s3_multipart_chunk_mb: int = Field(default=64, ge=5)
    #: Parallel parts of one multipart transfer.
    s3_max_concurrency: int = Field(default=4, ge=1)
    #: A netrc file with logins for FTP and HTTP(S) hosts, readable on the compute nodes.
    netrc_file: Path | None = None
    ftp_passive: bool = True
    #: Bind a `streamable` file:// input read-only into the container instead of copying it.
    streamable_bind: bool = False
    #: A PEM file of CA certificates for HTTPS (http(s)://, S3 endpoints, DRS servers) in place
    #: of the bundled ones, for servers with certificates of the site's own CA; readable on the
    #: compute nodes.
    ca_bundle: Path | None = None
    #: A TOML file of bearer tokens for DRS servers, `"host" = "token"` (`host:port` for a
    #: server on another port), readable on the compute nodes.
    drs_tokens_file: Path | None = None
    #: Compact DRS identifiers (`drs://prefix:accession`) the site resolves itself:
    #: prefix -> the DRS server's `host` or `host:port`. Others are refused at create.
    drs_prefixes: dict[str, str] = Field(default_factory=dict)
    #: Where the inputs and outputs that need the network are moved: "job", inside the task's
    #: own job on the compute node; "transfer", in Slurm jobs of their own on the transfer
    #: partition or QOS (stage-in, the task's job, stage-out, chained with --dependency), for
    #: clusters whose compute nodes reach only the shared filesystems (docs/site.md).
    where: Literal["job", "transfer"] = "job"
    #: The partition of the stage-in and stage-out jobs (nodes with outbound network).
    transfer_partition: str | None = None
    #: The QOS of the stage-in and stage-out jobs (a site's data-transfer QOS).
    transfer_qos: str | None = None
    #: Each stage-in and stage-out job's --time (Slurm's formats).
    transfer_time_limit: str = "4:00:00"
    #: Each stage-in and stage-out job's --mem, in MB.
    transfer_memory_mb: int = Field(default=2048, ge=64)
    #: Each stage-in job's --nice: where stage-ins and stage-outs wait side by side on the
    #: transfer partition, a stage-out (a task's end) goes first, so a burst's tasks end as they
    #: go rather than all after its last download (job arrays of one burst would otherwise
    #: queue every stage-out behind every stage-in), and staged inputs leave the work filesystem
    #: sooner. 0: none. A positive nice needs no privilege.
    stage_in_nice: int = Field(default=10, ge=0, le=100000)

    @field_validator("transfer_partition", "transfer_qos")
    @classmethod
    def _slurm_name(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a Slurm partition or QOS name")
        return value

    @field_validator("transfer_time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if parse_time(value) is None:
            raise ValueError(f"{value!r} is not a Slurm time (e.g. 4:00:00 or 1-00:00:00)")
        return value

    @model_validator(mode="after")
    def _transfer_needs_a_place(self) -> StagingConfig:
        if self.where == "transfer" and not (self.transfer_partition or self.transfer_qos):
            raise ValueError(
                'where = "transfer" needs transfer_partition or transfer_qos: where the '
                "stage-in and stage-out jobs run (nodes with outbound network)"
            )
        return self

    @field_validator("protocols")
    @classmethod
    def _known_protocols(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(STAGING_PROTOCOLS))
        if unknown:
            raise ValueError(f"unknown {unknown}; known: {', '.join(STAGING_PROTOCOLS)}")
        return value

    @field_validator("drs_prefixes")
    @classmethod
    def _drs_prefixes(cls, value: dict[str, str]) -> dict[str, str]:
        mapped = {}
        for prefix, host in value.items():
            try:
                uri = parse_drs_uri(f"drs://{prefix}:x")
            except DrsUriError:
                uri = None
            if uri is None or uri.prefix != prefix.lower():
                raise ValueError(
                    f"{prefix!r} is not a compact identifier prefix ([provider/]namespace: "
                    "letters, digits, `_` and `.`)"
                )
            problem = host_problem(host)
            if problem:
                raise ValueError(f"{prefix!r}: {problem} (a DRS server's host[:port])")
            mapped[prefix.lower()] = host.lower()
        return mapped

    @field_validator("s3_endpoint_url")
    @classmethod
    def _no_userinfo(cls, value: str | None) -> str | None:
        # job-config.json carries the endpoint: a secret in it would reach the task directory.
        if value and "@" in value.partition("://")[2].partition("/")[0]:
            raise ValueError("must not hold credentials; use s3_credentials_file")
        return value

    def job_options(self) -> dict[str, Any]:
        """What bridge.job.staging.StagingOptions reads from job-config.json."""
        options = self.model_dump(
            mode="json",
            exclude={
                "protocols", "streamable_bind", "where", "transfer_partition", "transfer_qos",
                "transfer_time_limit", "transfer_memory_mb", "stage_in_nice",
            },
        )  # fmt: skip
        options["enabled"] = list(self.protocols)
        return options


class JobConfig(_Section):
    #: Where task directories live; must be on a filesystem the compute nodes share.
    #: Defaults to `<state_dir>/work`.
    work_dir: Path | None = None
    #: A site's own template directory (searched before the packaged templates).
    template_dir: Path | None = None
    #: The Python that runs job-side commands on the compute node.
    python: str = sys.executable
    #: How much of each executor's stdout/stderr the task document keeps: a longer stream keeps
    #: its head (a fifth) and its tail, with a line between them (bridge.job.excerpt).
    log_tail_bytes: int = Field(default=10 * 1024, ge=0)
    #: Where each job attempt makes the disk-backed directory bound on /tmp and /var/tmp in its
    #: executors, on the compute node (e.g. a node-local disk); None: Slurm's $TMPDIR of the job,
    #: else the task directory.
    scratch_dir: Path | None = None
    retention_days: float = Field(default=7.0, ge=0)
    failed_retention_days: float = Field(default=30.0, ge=0)

    @field_validator("scratch_dir")
    @classmethod
    def _plain_scratch(cls, value: Path | None) -> Path | None:
        # It becomes the source of `--bind SRC:/tmp`, where `:` and `,` are separators.
        if value is not None and (not value.is_absolute() or any(c in str(value) for c in ":,\n")):
            raise ValueError("must be an absolute path without ':', ',' or a newline")
        return value


class AuthConfig(_Section):
    #: none (only on a loopback bind unless allow_remote_without_auth), basic or bearer.
    mode: Literal["none", "basic", "bearer"] = "none"
    realm: str = "tes-bridge"
    #: basic: an htpasswd file of bcrypt hashes (`htpasswd -B`).
    htpasswd_file: Path | None = None
    #: bearer: the OIDC issuer (`iss`), the audience (`aud`) tokens must name, and the JWKS
    #: (default: `jwks_uri` from the issuer's /.well-known/openid-configuration).
    issuer: str | None = None
    audience: str | None = None
    jwks_url: str | None = None
    jwks_cache_seconds: float = Field(default=300.0, gt=0)
    #: A token naming an unknown key refetches the JWKS at most this often (key rotation
    #: without letting forged `kid`s hammer the issuer).
    jwks_refresh_cooldown_seconds: float = Field(default=30.0, ge=0)
    algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256"])
    leeway_seconds: float = Field(default=30.0, ge=0)
    #: The token claim that names the caller.
    user_claim: str = "sub"
    #: TOML `[users]` identity -> Unix user (and Slurm account); unknown identities are refused.
    user_map_file: Path | None = None
    #: Unix users, and members of a Unix group, that see and cancel every task.
    admin_users: list[str] = Field(default_factory=list)
    admin_group: str | None = None
    allow_remote_without_auth: bool = False

    @model_validator(mode="after")
    def _complete(self) -> AuthConfig:
        if self.mode == "basic" and self.htpasswd_file is None:
            raise ValueError("mode basic needs htpasswd_file")
        if self.mode == "bearer" and not (self.issuer and self.audience):
            raise ValueError("mode bearer needs issuer and audience")
        if any(a.lower() == "none" or a.upper().startswith("HS") for a in self.algorithms):
            raise ValueError("algorithms: only asymmetric algorithms (RS*, PS*, ES*, EdDSA)")
        return self


class MetricsConfig(_Section):
    #: Serve Prometheus metrics at /metrics, to admins (auth.admin_users, auth.admin_group;
    #: every caller with auth.mode none, which only binds loopback).
    enabled: bool = True
    #: Serve them instead on this address of their own ("127.0.0.1:9464"), to anyone who
    #: reaches it, and not on the API; None: on the API, for admins.
    bind: str | None = None

    @field_validator("bind")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("must be HOST:PORT, e.g. 127.0.0.1:9464")
        return value


class PollerConfig(_Section):
    """The poller's election (PostgreSQL): every node runs a poller and the one holding the
    lease acts; a standby takes over once the lease ends. With SQLite one node, one poller
    (a lock file in the state directory)."""

    #: How long a lease lasts unless renewed (every lease_seconds / 3): a dead leader's work
    #: is taken over after at most this long and a renewal period.
    lease_seconds: float = Field(default=10.0, ge=3.0, le=300.0)
    #: The lease's own connection, renewed every few seconds: a direct one to PostgreSQL, not
    #: through a pooler (PgBouncer); unset: `database`.
    lease_database: str | None = None
    #: This node's name in the lease (`tes-bridge check`, logs); unset: the host name.
    node_name: str | None = None


class SiteConfig(_Section):
    #: Site mode: submit, cancel and stage as each task's owner through `sudo -n -u OWNER`
    #: (see deploy/sudoers.tes-bridge); needs auth mode basic or bearer.
    run_as_owner: bool = False
    sudo: str = "sudo"
    #: Slurm account for users the mapping file gives none (None: Slurm's default).
    default_account: str | None = None


class Config(_Section):
    state_dir: Path = DEFAULT_STATE_DIR
    #: A peewee database URL (`sqlite:///path`, `postgresql://user:pw@host/db`);
    #: defaults to a SQLite file in the state directory.
    database: str | None = None
    server: ServerConfig = Field(default_factory=ServerConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    service_info: ServiceInfoConfig = Field(default_factory=ServiceInfoConfig)
    backend_parameters: BackendParametersConfig = Field(default_factory=BackendParametersConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    container: ContainerConfig = Field(default_factory=ContainerConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    staging: StagingConfig = Field(default_factory=StagingConfig)
    job: JobConfig = Field(default_factory=JobConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    site: SiteConfig = Field(default_factory=SiteConfig)
    poller: PollerConfig = Field(default_factory=PollerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _site_needs_auth(self) -> Config:
        if self.site.run_as_owner and self.auth.mode == "none":
            raise ValueError("site.run_as_owner needs auth.mode basic or bearer (task owners)")
        return self

    @model_validator(mode="after")
    def _sandbox_not_in_site_mode(self) -> Config:
        if self.site.run_as_owner and self.container.image_format == "sandbox":
            raise ValueError(
                "container.image_format = 'sandbox' cannot be used with site.run_as_owner: "
                "owners could not read every file of a sandbox the service account unpacked; "
                "use 'sif' or 'auto'"
            )
        return self

    @model_validator(mode="after")
    def _shared_dirs_apart(self) -> Config:
        # Every executor gets the shared directories read-write: one holding the state or the
        # work directory, or lying inside the work directory, would hand every task the
        # database or the other tasks' directories.
        state = Path(os.path.realpath(self.state_dir))
        work = Path(os.path.realpath(self.work_dir))
        for shared in self.storage.shared_dirs:
            real = Path(os.path.realpath(shared))
            if state.is_relative_to(real) or work.is_relative_to(real):
                raise ValueError(
                    f"storage.shared_dirs: {str(shared)!r} holds the state or work directory "
                    f"({self.state_dir}, {self.work_dir}); executors would see other tasks' files"
                )
            if real.is_relative_to(work):
                raise ValueError(
                    f"storage.shared_dirs: {str(shared)!r} lies inside job.work_dir "
                    f"({self.work_dir}), where task directories are"
                )
        return self

    @property
    def database_url(self) -> str:
        return self.database or f"sqlite:///{self.state_dir / 'tes-bridge.db'}"

    @property
    def work_dir(self) -> Path:
        return self.job.work_dir or self.state_dir / "work"

    @property
    def image_cache_dir(self) -> Path:
        return self.container.cache_dir or self.state_dir / "images"

    @property
    def file_dirs(self) -> list[Path]:
        """Where `file://` URLs may point: the allowed and the shared directories."""
        return list(dict.fromkeys([*self.storage.allowed_dirs, *self.storage.shared_dirs]))

    def service_storage(self) -> list[str]:
        """service-info `storage`: the site's own list, or `file:///<dir>/` per allowed or
        shared directory plus each other enabled protocol. A bare `file://` would claim every
        local path, and clients (Toil) then send paths the bridge cannot reach."""
        if self.service_info.storage != "derive":
            return list(self.service_info.storage)
        local = [f"file://{str(d).rstrip('/')}/" for d in self.file_dirs]
        return local + [f"{p}://" for p in self.staging.protocols if p != "file"]


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Build the configuration from a TOML file, the environment and explicit overrides."""
    env = os.environ if environ is None else environ
    path = path or env.get(ENV_CONFIG) or None
    data = _read_toml(path) if path else {}
    _apply_environment(data, env)
    for dotted, value in (overrides or {}).items():
        section = data
        *parents, key = dotted.split(".")
        for parent in parents:
            section = section.setdefault(parent, {})
        section[key] = value
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        source = f" in {path}" if path else ""
        raise ConfigError(f"invalid configuration{source}: {problems}") from exc


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def _apply_environment(data: dict[str, Any], env: Mapping[str, str]) -> None:
    """TES_BRIDGE_DATABASE, TES_BRIDGE_STATE_DIR and TES_BRIDGE_WORK_DIR win over the file."""
    if env.get(ENV_DATABASE):
        data["database"] = env[ENV_DATABASE]
    if env.get(ENV_STATE_DIR):
        data["state_dir"] = env[ENV_STATE_DIR]
    if env.get(ENV_WORK_DIR):
        data.setdefault("job", {})["work_dir"] = env[ENV_WORK_DIR]
