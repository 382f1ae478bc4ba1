"""The one place that says what differs by Slurm release.

A release is read once, from ``squeue --version`` (:func:`parse_version`) or ``scontrol show
config``'s ``SLURM_VERSION`` (:func:`bridge.slurm.scontrol.parse_config_version`), and becomes a
:class:`SlurmRelease`: its version, whether it is one this bridge is tested with
(:data:`TESTED_RELEASES`), and its :class:`SlurmFeatures`, the forms of its commands and output
that the parsers and the client choose between. An unknown version reads as 22.05's features
(the forms every release has).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The releases (major, minor) this bridge is tested with.
TESTED_RELEASES: tuple[tuple[int, int], ...] = ((22, 5), (24, 11), (26, 5))

#: A Slurm version as its tools print it: "22.05.8", "23.11.5-1", "24.05".
_VERSION = r"(\d+)\.(\d+)(?:\.(\d+))?"


def describe_tested() -> str:
    """:data:`TESTED_RELEASES` as Slurm names them: "22.05, 24.11, 26.05"."""
    return ", ".join(f"{major}.{minor:02d}" for major, minor in TESTED_RELEASES)


def version_of(text: str) -> tuple[int, ...] | None:
    """A version printed as "22.05.8" (or with a suffix, "23.11.5-1") -> (22, 5, 8)."""
    match = re.match(_VERSION, text.strip())
    if not match:
        return None
    return tuple(int(part) for part in match.groups() if part is not None)


def parse_version(text: str) -> tuple[int, ...] | None:
    """`squeue --version` ("slurm 22.05.8", "slurm 23.11.5-1") -> (22, 5, 8)."""
    match = re.search(r"^slurm\S*\s+(" + _VERSION + ")", text.strip())
    return version_of(match.group(1)) if match else None


def is_tested(version: tuple[int, ...] | None) -> bool:
    """Whether the release of `version` (its major and minor number) is one of
    :data:`TESTED_RELEASES`; an unknown version is not."""
    return version is not None and tuple(version[:2]) in TESTED_RELEASES


@dataclass(frozen=True)
class SlurmFeatures:
    """What a Slurm release's commands can do, or print, that the client chooses between."""

    #: 23.02+: `--json` honours the job filters (--jobs, --user, --states).
    json_filters: bool = False
    #: 23.11.5+: `--only-job-state`, a lighter RPC that reads job states only (with --jobs,
    #: not --user or --partition).
    only_job_state: bool = False
    #: 25.11+: sacct's ExitCode prints an exit status of 128 or more as it is (a script that
    #: exited 137: "137:0"); up to 25.05 it printed it less 128 ("9:0"). The signal field, for
    #: a process a signal ended, is the same in both. Nothing needs to translate one into the
    #: other: the only exit codes of a job the bridge reads from sacct are its job script's
    #: own, NO_RECORDS_EXIT_CODE and SUPERSEDED_EXIT_CODE (75 and 76, bridge/core/naming.py,
    #: templates/job.sh.j2), below 128 in every release; an executor's exit code comes from the
    #: job's own records, never from sacct.
    sacct_exit_code_raw: bool = False

    @classmethod
    def of(cls, version: tuple[int, ...] | None) -> SlurmFeatures:
        """Unknown versions are treated as 22.05 (the forms every version has)."""
        v = version or (0,)
        return cls(
            json_filters=v >= (23, 2),
            only_job_state=v >= (23, 11, 5),
            sacct_exit_code_raw=v >= (25, 11),
        )


@dataclass(frozen=True)
class SlurmRelease:
    """A cluster's Slurm release: its version (None when it could not be read) and what that
    version's commands can do."""

    version: tuple[int, ...] | None

    @property
    def features(self) -> SlurmFeatures:
        return SlurmFeatures.of(self.version)

    @property
    def tested(self) -> bool:
        """Whether this bridge is tested with this release (:data:`TESTED_RELEASES`)."""
        return is_tested(self.version)

    def __str__(self) -> str:
        """The version as Slurm prints it ("22.05.8"); "?" when it is not known."""
        parts = [str(part) for part in self.version or ()]
        if len(parts) > 1:
            parts[1] = parts[1].zfill(2)  # the minor number, as Slurm prints it
        return ".".join(parts) or "?"
