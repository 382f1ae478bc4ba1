"""sinfo: what each partition's nodes offer (:class:`NodeSizes` for the directives,
:class:`Partition` for the capabilities document).

Slurm quirks (seen on Slurm 22.05; real output in tests/data/slurm/): ``sinfo -o '%P|%d|%m'``
prints one line per partition and distinct TmpDisk and memory (MB) of its nodes, the default
partition with a ``*``; a node that declares no TmpDisk shows 0. sbatch refuses ``--tmp`` more
than every node declares: "Temporary disk specification can not be satisfied", and ``--mem``
more than the largest node's memory: "Memory specification can not be satisfied".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from bridge.slurm.jobs import _opt


@dataclass(frozen=True)
class NodeSizes:
    """What the nodes of each partition can give one job, in MB (Slurm's MB are MiB): the
    smallest and the largest node-local disk (`TmpDisk`, for `--tmp`) and the largest memory
    (`RealMemory`, for `--mem`)."""

    tmp_disk_smallest: dict[str, int]
    tmp_disk_largest: dict[str, int]
    default_partition: str | None = None
    memory_largest: dict[str, int] = field(default_factory=dict)

    def _names(self, partitions: Sequence[str]) -> list[str]:
        """`partitions`, or the default partition when none is named."""
        return list(partitions) or ([self.default_partition] if self.default_partition else [])

    def smallest_tmp_disk(self, partitions: Sequence[str]) -> int | None:
        """The smallest TmpDisk of these partitions' nodes (of the default partition when none
        is named); None when sinfo did not list one of them."""
        names = self._names(partitions)
        if not names or any(name not in self.tmp_disk_smallest for name in names):
            return None
        return min(self.tmp_disk_smallest[name] for name in names)

    def largest_memory(self, partitions: Sequence[str]) -> int | None:
        """The memory of the largest node of these partitions (of the default partition when
        none is named): the most `--mem` sbatch accepts for a job that may run in any of them;
        None when sinfo did not say it for one of them."""
        names = self._names(partitions)
        if not names or any(name not in self.memory_largest for name in names):
            return None
        return max(self.memory_largest[name] for name in names)

    def describe_tmp_disk(self) -> str:
        """`main 0 MB, big 1000-102400 MB` for messages."""
        parts = []
        for name, low in self.tmp_disk_smallest.items():
            high = self.tmp_disk_largest[name]
            parts.append(f"{name} {low if low == high else f'{low}-{high}'} MB")
        return ", ".join(parts) or "no partition"


SINFO_NODE_SIZES_FORMAT = "%P|%d|%m"


def parse_sinfo_node_sizes(text: str) -> NodeSizes:
    """`sinfo -h -a -o '%P|%d|%m'`: one line per partition and distinct TmpDisk and memory of
    its nodes. A line without a memory field (or an unreadable one) leaves the memory unknown."""
    tmp_low: dict[str, int] = {}
    tmp_high: dict[str, int] = {}
    memory: dict[str, int] = {}
    unknown_memory: set[str] = set()
    default = None
    for line in text.splitlines():
        name, *sizes = line.strip().split("|")
        if not sizes or not sizes[0].strip().isdigit():
            continue
        if name.endswith("*"):
            name = name[:-1]
            default = name
        if not name:
            continue
        mb = int(sizes[0])
        tmp_low[name] = min(mb, tmp_low.get(name, mb))
        tmp_high[name] = max(mb, tmp_high.get(name, mb))
        if len(sizes) > 1 and sizes[1].strip().isdigit():
            memory[name] = max(int(sizes[1]), memory.get(name, 0))
        else:
            unknown_memory.add(name)
    for name in unknown_memory:  # one node group of unknown memory: the largest is unknown
        memory.pop(name, None)
    return NodeSizes(tmp_low, tmp_high, default_partition=default, memory_largest=memory)


#: `sinfo -N` fields, one line per node and partition: partition (`*` on the default), node,
#: CPUs, memory (MB), the partition's time limit, GRES, TmpDisk (MB), availability, node state.
SINFO_PARTITIONS_FORMAT = "%P|%N|%c|%m|%l|%G|%d|%a|%T"
_SINFO_PARTITIONS_NFIELDS = SINFO_PARTITIONS_FORMAT.count("|") + 1


@dataclass(frozen=True)
class Partition:
    """What a partition offers, summed over its nodes (the capabilities document)."""

    name: str
    default: bool
    available: bool
    nodes: tuple[str, ...]
    cpus: int
    max_cpus_per_node: int
    max_memory_mb_per_node: int
    #: Slurm's spelling: `infinite`, `1-00:00:00`.
    max_time: str
    #: GRES name (and type) -> count over the partition's nodes: {"gpu": 4, "gpu:a100": 4}.
    gres: dict[str, int]
    min_tmp_disk_mb: int
    #: GRES name (and type) -> the most one node has: what one task can get (it runs on one).
    max_gres_per_node: dict[str, int] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.gres.get("gpu", 0)

    @property
    def gpu_types(self) -> dict[str, int]:
        return {k.split(":", 1)[1]: n for k, n in self.gres.items() if k.startswith("gpu:")}


def _gres_counts(text: str) -> dict[str, int]:
    """`gpu:a100:2(S:0-1),shard:8` -> {"gpu": 2, "gpu:a100": 2, "shard": 8}."""
    counts: dict[str, int] = {}
    if _opt(text) is None:
        return counts
    for item in re.sub(r"\([^)]*\)", "", text).split(","):
        parts = item.strip().split(":")
        if not parts[0]:
            continue
        count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        names = [parts[0]] + ([f"{parts[0]}:{parts[1]}"] if len(parts) == 3 else [])
        for name in names:
            counts[name] = counts.get(name, 0) + count
    return counts


def parse_sinfo_partitions(text: str) -> list[Partition]:
    """`sinfo -h -a -N -o SINFO_PARTITIONS_FORMAT`, in the order sinfo lists partitions."""
    rows: dict[str, list[list[str]]] = {}
    default: str | None = None
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != _SINFO_PARTITIONS_NFIELDS or not fields[0]:
            continue
        name = fields[0]
        if name.endswith("*"):
            name = default = name[:-1]
        rows.setdefault(name, []).append(fields)
    partitions = []
    for name, lines in rows.items():
        by_node = {f[1]: f for f in lines}  # a node listed twice (two states) counts once
        cpus = [int(f[2]) for f in by_node.values() if f[2].isdigit()]
        memory = [int(f[3]) for f in by_node.values() if f[3].isdigit()]
        tmp = [int(f[6]) for f in by_node.values() if f[6].isdigit()]
        gres: dict[str, int] = {}
        per_node: dict[str, int] = {}
        for f in by_node.values():
            for key, count in _gres_counts(f[5]).items():
                gres[key] = gres.get(key, 0) + count
                per_node[key] = max(count, per_node.get(key, 0))
        partitions.append(
            Partition(
                name=name,
                default=name == default,
                available=lines[0][7] == "up",
                nodes=tuple(sorted(by_node)),
                cpus=sum(cpus),
                max_cpus_per_node=max(cpus, default=0),
                max_memory_mb_per_node=max(memory, default=0),
                max_time=lines[0][4],
                gres=gres,
                min_tmp_disk_mb=min(tmp, default=0),
                max_gres_per_node=per_node,
            )
        )
    return partitions
