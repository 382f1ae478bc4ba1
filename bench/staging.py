"""Staging: a 1 GiB file in and out over HTTP, S3 and the shared filesystem with the job-side
staging functions (bridge.job.staging.*), against curl, rclone and cp on the same data and the
same loopback servers (rclone serve webdav for HTTP GET/PUT, rclone serve s3 for S3).
Rounds alternate bridge and tool; the best of each counts.

    python -m bench staging
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import free_port, scratch, stop, table, wait_http, write_result

SIZE_MB = int(os.environ.get("BENCH_STAGING_MB", "1024"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
KEY, SECRET = "benchkey", "benchsecret"


def rclone() -> str:
    found = shutil.which("rclone") or str(Path(os.__file__).parents[2] / "bin" / "rclone")
    venv = Path(__import__("sys").executable).parent / "rclone"
    return str(venv) if venv.exists() else found


def timed(action: Callable[[], object], cleanup: Path) -> float:
    if cleanup.exists():
        cleanup.unlink()
    subprocess.run(["sync"], check=False)
    started = time.perf_counter()
    action()
    elapsed = time.perf_counter() - started
    assert cleanup.stat().st_size == SIZE_MB * 1024**2, cleanup
    return elapsed


def run(argv: list[str], env: dict[str, str] | None = None) -> None:
    subprocess.run(argv, check=True, capture_output=True, env={**os.environ, **(env or {})})


def main() -> dict[str, object]:
    from bridge.job.staging import StagingContext, StagingOptions
    from bridge.job.staging import file as file_backend
    from bridge.job.staging import http as http_backend
    from bridge.job.staging import s3 as s3_backend

    root = scratch("staging")
    shared = root / "shared"  # the "shared filesystem" and the servers' storage
    (shared / "bucket").mkdir(parents=True)
    work = root / "work"  # the task directory
    work.mkdir()
    source = shared / "bucket" / "big.bin"
    run(["dd", "if=/dev/urandom", f"of={source}", "bs=1M", f"count={SIZE_MB}", "status=none"])
    local = work / "local.bin"
    shutil.copyfile(source, local)
    creds = root / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n")
    http_port, s3_port = free_port(), free_port()
    servers = [
        subprocess.Popen([rclone(), "serve", "webdav", str(shared), "--addr",
                          f"127.0.0.1:{http_port}"], stderr=subprocess.DEVNULL),
        subprocess.Popen([rclone(), "serve", "s3", str(shared), "--addr", f"127.0.0.1:{s3_port}",
                          "--auth-key", f"{KEY},{SECRET}"], stderr=subprocess.DEVNULL),
    ]  # fmt: skip
    http_url = f"http://127.0.0.1:{http_port}/bucket"
    s3_endpoint = f"http://127.0.0.1:{s3_port}"
    options = StagingOptions(
        http_upload=True,
        s3_endpoint_url=s3_endpoint,
        s3_credentials_file=str(creds),
        s3_addressing_style="path",
        s3_region="us-east-1",
    )
    ctx = StagingContext(allowed_dirs=[shared], tmp_dir=work, options=options, log=lambda _: None)
    rclone_env = {
        "RCLONE_CONFIG_BENCH_TYPE": "s3",
        "RCLONE_CONFIG_BENCH_PROVIDER": "Rclone",
        "RCLONE_CONFIG_BENCH_ENDPOINT": s3_endpoint,
        "RCLONE_CONFIG_BENCH_ACCESS_KEY_ID": KEY,
        "RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY": SECRET,
        "RCLONE_CONFIG_BENCH_REGION": "us-east-1",
    }
    got = work / "in.bin"

    def upload(backend: object, url: str) -> Callable[[], None]:
        def go() -> None:
            fd = os.open(local, os.O_RDONLY)
            try:
                backend.upload_file(fd, local.stat().st_size, url, ctx)  # type: ignore[attr-defined]
            finally:
                os.close(fd)

        return go

    cases: list[tuple[str, str, Callable[[], object], str, Callable[[], object], Path]] = [
        ("shared fs", "in",
         lambda: file_backend.download(f"file://{source}", got, "FILE", ctx), "cp",
         lambda: run(["cp", str(source), str(got)]), got),
        ("shared fs", "out", upload(file_backend, f"file://{shared}/out.bin"), "cp",
         lambda: run(["cp", str(local), str(shared / "out.bin")]), shared / "out.bin"),
        ("HTTP", "in", lambda: http_backend.download(f"{http_url}/big.bin", got, "FILE", ctx),
         "curl", lambda: run(["curl", "-sSf", "-o", str(got), f"{http_url}/big.bin"]), got),
        ("HTTP", "out", upload(http_backend, f"{http_url}/out.bin"), "curl",
         lambda: run(["curl", "-sSf", "-T", str(local), f"{http_url}/out.bin"]),
         shared / "bucket" / "out.bin"),
        ("S3", "in", lambda: s3_backend.download("s3://bucket/big.bin", got, "FILE", ctx),
         "rclone", lambda: run([rclone(), "copyto", "bench:bucket/big.bin", str(got)],
                               rclone_env), got),
        ("S3", "out", upload(s3_backend, "s3://bucket/s3out.bin"), "rclone",
         lambda: run([rclone(), "copyto", str(local), "bench:bucket/s3out.bin"], rclone_env),
         shared / "bucket" / "s3out.bin"),
    ]  # fmt: skip
    results: dict[str, object] = {}
    rows = []
    try:
        wait_http(f"{http_url}/")
        wait_http(f"{s3_endpoint}/")
        for protocol, direction, bridge, tool, raw, dest in cases:
            ours, theirs = [], []
            for _ in range(ROUNDS):
                theirs.append(timed(raw, dest))
                ours.append(timed(bridge, dest))
            mb_ours, mb_theirs = SIZE_MB / min(ours), SIZE_MB / min(theirs)
            results[f"{protocol} {direction}"] = {
                "bridge_mb_s": mb_ours, "tool": tool, "tool_mb_s": mb_theirs,
                "ratio": mb_ours / mb_theirs, "bridge_s": ours, "tool_s": theirs,
            }  # fmt: skip
            rows.append([f"{protocol} {direction}", mb_ours, tool, mb_theirs,
                         f"{mb_ours / mb_theirs:.2f}"])  # fmt: skip
    finally:
        for server in servers:
            stop(server)
    print(f"staging {SIZE_MB} MiB over loopback, best of {ROUNDS}")
    table(["transfer", "bridge MB/s", "tool", "tool MB/s", "ratio"], rows)
    write_result("staging", {"size_mb": SIZE_MB, **results})
    shutil.rmtree(root, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
