"""``scontrol show config``: the cluster's limits and release as slurmctld states them.

Slurm quirks (seen on Slurm 22.05, 24.11 and 26.05): an array's highest index may be at most
``MaxArraySize - 1``; slurmctld's RPC rate limit (23.02+) is in ``SlurmctldParameters``, with
its defaults for what is left out, and covers every account but root and ``SlurmUser``
(printed ``SlurmUser = root(0)``); ``SLURM_VERSION`` is slurmctld's release, which may differ
from the client commands' (``squeue --version``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bridge.slurm.releases import version_of


def parse_max_array_size(text: str) -> int:
    """`scontrol show config`'s `MaxArraySize = 1001`; ValueError when it is missing."""
    match = re.search(r"^MaxArraySize\s*=\s*([0-9]+)\s*$", text, re.MULTILINE)
    if match is None:
        raise ValueError("scontrol show config printed no MaxArraySize")
    return int(match.group(1))


@dataclass(frozen=True)
class RateLimit:
    """slurmctld's RPC rate limit per user (``SlurmctldParameters=rl_enable``, 23.02+): a
    bucket of `bucket_size` tokens, `refill_rate` more every `refill_period` seconds."""

    bucket_size: int = 30
    refill_rate: int = 2
    refill_period: int = 1

    @property
    def per_second(self) -> float:
        return self.refill_rate / self.refill_period

    def __str__(self) -> str:
        """ "30 calls at once, 2 more every 1 s" (rl_bucket_size, rl_refill_rate,
        rl_refill_period)."""
        return (
            f"{self.bucket_size} calls at once, {self.refill_rate} more every "
            f"{self.refill_period} s"
        )

    @property
    def safe_burst(self) -> int:
        """The burst a bucket refilled evenly may take and stay inside this one: slurmctld
        adds its tokens at whole periods, so up to one refill arrives later than ours."""
        return max(1, self.bucket_size - self.refill_rate)


_RL_KEYS = {"rl_bucket_size": "bucket_size", "rl_refill_rate": "refill_rate",
            "rl_refill_period": "refill_period"}  # fmt: skip


def parse_rate_limit(text: str) -> RateLimit | None:
    """`scontrol show config`'s ``SlurmctldParameters = enable_configless,rl_enable,...``:
    the rate limit, with slurmctld's defaults for what it leaves out; None without
    ``rl_enable``.

    A value that is missing, unreadable or not positive keeps Slurm's default here. slurmctld
    itself does otherwise: up to 25.11.0 it takes such a value as it reads (``atoi``: 0 for
    "x"), from 25.11.1 it refuses to start with it; a running slurmctld that prints one is of
    the older kind, and its limit is then not what this says."""
    match = re.search(r"^SlurmctldParameters\s*=\s*(.*)$", text, re.M)
    words = [w.strip() for w in match.group(1).split(",")] if match else []
    if "rl_enable" not in (w.lower() for w in words):
        return None
    values: dict[str, int] = {}
    for word in words:
        key, _, value = word.partition("=")
        field_name = _RL_KEYS.get(key.strip().lower())
        if field_name and value.strip().isdigit() and int(value) > 0:
            values[field_name] = int(value)
    return RateLimit(**values)


def parse_slurm_user(text: str) -> str | None:
    """`scontrol show config`'s ``SlurmUser = slurm(64030)`` -> "slurm": the account
    slurmctld runs as, which its RPC rate limit never covers (nor root); None when missing."""
    match = re.search(r"^SlurmUser\s*=\s*([^\s(]+)", text, re.MULTILINE)
    return match.group(1) if match else None


def exempt_because(uid: int, name: str | None, slurm_user: str | None) -> str | None:
    """Why slurmctld's RPC rate limit does not cover the account `uid` (`name`): it is root,
    or SlurmUser; None when the limit covers it."""
    if uid == 0:
        return "it is root"
    if name is not None and name == slurm_user:
        return f"it is SlurmUser ({slurm_user})"
    return None


def parse_config_version(text: str) -> tuple[int, ...] | None:
    """`scontrol show config`'s ``SLURM_VERSION = 22.05.8`` -> (22, 5, 8); None when it is
    missing or unreadable."""
    match = re.search(r"^SLURM_VERSION\s*=\s*(\S+)\s*$", text, re.MULTILINE)
    return version_of(match.group(1)) if match else None
