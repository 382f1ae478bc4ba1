"""One 1 GiB file out and back in through S3 (multipart) and HTTP (PUT, GET), checksummed.

The file is written in 1 MiB blocks (never held in memory); the throughput of each direction
is printed (`pytest -s`) for the figures in docs/staging.md.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from bridge.job.staging import StagingContext, StagingOptions, backend_for
from tests.fixtures.storage import BUCKET, StorageServers

GIB = 1 << 30
BLOCK = 1 << 20


def write_gib(path: Path) -> str:
    digest = hashlib.sha256()
    block = bytearray(os.urandom(BLOCK))
    with open(path, "wb") as out:
        for index in range(GIB // BLOCK):
            block[:8] = index.to_bytes(8, "big")  # no two blocks alike
            digest.update(block)
            out.write(block)
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.mark.parametrize("protocol", ["s3", "http"])
def test_one_gib_out_and_back_in(storage_servers: StorageServers, tmp_path, protocol):
    options = StagingOptions.from_dict(
        storage_servers.staging_options(
            timeout=120.0, s3_multipart_threshold_mb=64, s3_multipart_chunk_mb=64
        )
    )
    ctx = StagingContext(options=options)
    if protocol == "s3":
        url, served = f"s3://{BUCKET}/large/gib.bin", storage_servers.bucket_dir / "large"
    else:
        url, served = f"{storage_servers.http}/large/gib.bin", storage_servers.http_root / "large"
    served = served / "gib.bin"
    source, back = tmp_path / "source.bin", tmp_path / "back.bin"
    try:
        expected = write_gib(source)
        fd = os.open(source, os.O_RDONLY)
        try:
            started = time.monotonic()
            backend_for(url).upload_file(fd, GIB, url, ctx)
            up = time.monotonic() - started
        finally:
            os.close(fd)
        assert served.stat().st_size == GIB
        assert sha256_of(served) == expected
        started = time.monotonic()
        backend_for(url).download(url, back, "FILE", ctx)
        down = time.monotonic() - started
        assert sha256_of(back) == expected
        print(
            f"\n1 GiB via {protocol}: upload {up:.1f} s ({GIB / up / 1e6:.0f} MB/s), "
            f"download {down:.1f} s ({GIB / down / 1e6:.0f} MB/s)"
        )
    finally:
        for path in (source, back, served):
            path.unlink(missing_ok=True)
