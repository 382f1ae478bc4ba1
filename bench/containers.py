"""Container start and image reads: a SIF (mounted by squashfuse under `--userns`) against its
sandbox (the SIF unpacked once into a directory) and `--unsquash` (unpacked at every start).

As an unprivileged user (`nobody`, as executors are never root), with the bridge's own flags
(`--quiet exec --cleanenv --contain --no-privs --pid --userns`):

- start: `echo` in the local registry's alpine, median of BENCH_CONTAINER_STARTS (10) runs;
- read: 4 readers at once over a 1 GiB random file inside the image (256 MiB each, `dd`), with
  the page cache dropped first (cold) and right after a first read (warm), median of 3 rounds.

Kernel squashfs mounts need Apptainer's setuid starter, which these machines do not install:
the row says so instead of a figure.

    python -m bench containers
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import scratch, table, write_result

STARTS = int(os.environ.get("BENCH_CONTAINER_STARTS", "10"))
ROUNDS = 3
USER = "nobody"
REGISTRY = os.environ.get("LOCAL_CLUSTER_REGISTRY", "127.0.0.1:5000")
FLAGS = ["--quiet", "exec", "--cleanenv", "--contain", "--no-privs", "--pid", "--userns"]
READ4 = (
    "for k in 0 1 2 3; do "
    "dd if=/data.bin of=/dev/null bs=1M skip=$((k*256)) count=256 2>/dev/null & done; wait"
)
SETUID_STARTER = Path("/usr/libexec/apptainer/bin/starter-suid")


def as_user(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = ["env", f"HOME={root}", f"APPTAINER_CACHEDIR={root}/cache", f"APPTAINER_TMPDIR={root}"]
    return subprocess.run(
        ["runuser", "-u", USER, "--", *env, "apptainer", *argv],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    )


def timed(root: Path, *argv: str) -> float:
    started = time.perf_counter()
    as_user(root, *argv)
    return time.perf_counter() - started


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def prepare(root: Path) -> tuple[dict[str, Path], dict[str, float]]:
    """alpine as SIF and sandbox; the same with a 1 GiB random /data.bin, as SIF and sandbox."""
    paths = {
        "alpine.sif": root / "alpine.sif",
        "alpine.sandbox": root / "alpine.sandbox",
        "big.sif": root / "big.sif",
        "big.sandbox": root / "big.sandbox",
    }
    as_user(root, "pull", "--no-https", str(paths["alpine.sif"]),
            f"docker://{REGISTRY}/library/alpine:latest")  # fmt: skip
    started = time.perf_counter()
    as_user(root, "build", "--sandbox", str(paths["alpine.sandbox"]), str(paths["alpine.sif"]))
    unpack_alpine = time.perf_counter() - started
    as_user(root, "build", "--sandbox", str(paths["big.sandbox"]), str(paths["alpine.sif"]))
    data = paths["big.sandbox"] / "data.bin"
    with open("/dev/urandom", "rb") as source, open(data, "wb") as out:
        for _ in range(1024):
            out.write(source.read(1 << 20))
    shutil.chown(data, USER)
    as_user(root, "build", str(paths["big.sif"]), str(paths["big.sandbox"]))
    # The sandbox the bridge would use is unpacked from the SIF, as the image cache does.
    shutil.rmtree(paths["big.sandbox"])
    started = time.perf_counter()
    as_user(root, "build", "--sandbox", str(paths["big.sandbox"]), str(paths["big.sif"]))
    unpack_big = time.perf_counter() - started
    print(f"unpacked alpine in {unpack_alpine:.2f} s, the 1 GiB image in {unpack_big:.1f} s")
    return paths, {"alpine": unpack_alpine, "big": unpack_big}


def main() -> dict[str, object]:
    root = scratch("containers")
    shutil.chown(root, USER)
    os.chmod(root, 0o755)
    try:
        paths, unpacked = prepare(root)
        starts: dict[str, list[float]] = {"sif": [], "sandbox": [], "unsquash": []}
        for _ in range(STARTS):  # interleaved, so a change of load hits every way alike
            starts["sif"].append(timed(root, *FLAGS, str(paths["alpine.sif"]), "echo", "hi"))
            starts["sandbox"].append(
                timed(root, *FLAGS, str(paths["alpine.sandbox"]), "echo", "hi")
            )
            starts["unsquash"].append(
                timed(root, *FLAGS, "--unsquash", str(paths["alpine.sif"]), "echo", "hi")
            )
        reads: dict[str, dict[str, list[float]]] = {
            "sif": {"cold": [], "warm": []},
            "sandbox": {"cold": [], "warm": []},
        }
        for _ in range(ROUNDS):
            for way in ("sif", "sandbox"):
                image = str(paths[f"big.{way}"])
                drop_caches()
                reads[way]["cold"].append(timed(root, *FLAGS, image, "sh", "-c", READ4))
                reads[way]["warm"].append(timed(root, *FLAGS, image, "sh", "-c", READ4))
        unsquash_read = timed(root, *FLAGS, "--unsquash", str(paths["big.sif"]), "sh", "-c", READ4)
        disk = {name: du(path) for name, path in paths.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    kernel = (
        "n/a: needs Apptainer's setuid starter (not installed)"
        if not SETUID_STARTER.exists()
        else "not measured"
    )
    mib = {name: size / 2**20 for name, size in disk.items()}
    rows: list[list[Any]] = [
        ["SIF (squashfuse)", med(starts["sif"]), med(reads["sif"]["cold"]),
         med(reads["sif"]["warm"]), mib["alpine.sif"], mib["big.sif"]],
        ["sandbox (unpacked once)", med(starts["sandbox"]), med(reads["sandbox"]["cold"]),
         med(reads["sandbox"]["warm"]), mib["alpine.sandbox"], mib["big.sandbox"]],
        ["--unsquash (each start)", med(starts["unsquash"]), "-", unsquash_read, "-", "-"],
        ["SIF (kernel squashfs)", kernel, "-", "-", "-", "-"],
    ]  # fmt: skip
    print(f"container start (echo, median of {STARTS}) and 4 readers of 1 GiB (median of "
          f"{ROUNDS}), as {USER} with --userns; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    table(["image", "echo s", "read cold s", "read warm s", "alpine MiB", "1 GiB image MiB"], rows)
    result: dict[str, object] = {
        "starts_seconds": starts,
        "reads_seconds": reads,
        "unsquash_read_seconds": unsquash_read,
        "disk_bytes": disk,
        "unpack_seconds": unpacked,
        "kernel_squashfs": kernel,
        "ratios": {
            "start_sif_over_sandbox": med(starts["sif"]) / med(starts["sandbox"]),
            "cold_read_sif_over_sandbox": med(reads["sif"]["cold"]) / med(reads["sandbox"]["cold"]),
            "warm_read_sif_over_sandbox": med(reads["sif"]["warm"]) / med(reads["sandbox"]["warm"]),
        },
    }
    write_result("containers", result)
    return result


if __name__ == "__main__":
    main()
