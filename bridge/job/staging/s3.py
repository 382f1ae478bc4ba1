"""`s3://bucket/key` on AWS S3 or an S3-compatible store, through boto3.

Endpoint, region and addressing style come from `[staging]`; credentials from the usual boto3
chain: the AWS environment variables of the job, or the shared-credentials file
`staging.s3_credentials_file` (profile `staging.s3_profile`). Transfers above
`s3_multipart_threshold_mb` are multipart, in parallel parts. A DIRECTORY is every object below
`key/`; a key that cannot be placed safely under the input's path (`..`, empty parts) is skipped
with a note.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import boto3
import botocore.session
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError
from botocore.handlers import add_expect_header

from bridge.job.staging import (
    FileKind,
    StagingContext,
    StagingError,
    StagingOptions,
    check_remote_path,
    create_file,
    make_parents,
    redact,
    safe_relative,
)

_MB = 1024 * 1024


def split_url(url: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> (`bucket`, `a/b`)."""
    if url[:5].lower() != "s3://":
        raise StagingError(f"{redact(url)!r} is not an s3:// URL")
    bucket, _, key = url[5:].partition("/")
    if not bucket or "@" in bucket:
        raise StagingError(f"{redact(url)!r} names no bucket")
    return bucket, check_remote_path(key, url)


@lru_cache(maxsize=4)
def _client(options: StagingOptions) -> Any:
    core = botocore.session.Session()
    if options.s3_credentials_file:
        # Read only the site's file, not ~/.aws/credentials of whoever runs the job.
        core.set_config_variable("credentials_file", options.s3_credentials_file)
    session = boto3.Session(botocore_session=core, profile_name=options.s3_profile or None)
    config = BotoConfig(
        region_name=options.s3_region or None,
        retries={"max_attempts": options.retries + 1, "mode": "standard"},
        connect_timeout=options.timeout,
        read_timeout=options.timeout,
        s3={"addressing_style": options.s3_addressing_style},
    )
    client = session.client(
        "s3", endpoint_url=options.s3_endpoint_url or None, config=config, verify=options.verify
    )
    # No `Expect: 100-continue`: botocore sends the body anyway after waiting a second, and a
    # store that answers the expectation late leaves the kept-alive connection out of step
    # (seen with rclone's S3 server: the next request then times out).
    for operation in ("PutObject", "UploadPart"):
        client.meta.events.unregister(f"before-call.s3.{operation}", add_expect_header)
    return client


def _transfer(options: StagingOptions) -> TransferConfig:
    return TransferConfig(
        multipart_threshold=options.s3_multipart_threshold_mb * _MB,
        multipart_chunksize=options.s3_multipart_chunk_mb * _MB,
        max_concurrency=options.s3_max_concurrency,
        use_threads=options.s3_max_concurrency > 1,
    )


def _reason(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchKey", "NotFound"):
            return "does not exist"
        if code == "NoSuchBucket":
            return "the bucket does not exist"
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return f"access denied ({code}): check the S3 credentials of this deployment"
        return f"{code or 'error'} (HTTP {status}): {error.get('Message', '')}".rstrip(": ")
    # botocore's messages name endpoints and files, never secret keys.
    return redact(str(exc))


def _client_for(ctx: StagingContext) -> Any:
    try:
        return _client(ctx.options)
    except (BotoCoreError, ValueError) as exc:  # e.g. an unknown profile
        raise StagingError(f"cannot set up the S3 client: {_reason(exc)}") from None


def download(url: str, dest: Path, kind: FileKind, ctx: StagingContext) -> None:
    bucket, key = split_url(url)
    client = _client_for(ctx)
    if kind != "DIRECTORY":
        _get(client, bucket, key, dest, ctx, url)
        return
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    dest.mkdir(mode=0o755, exist_ok=True)
    found = 0
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for entry in page.get("Contents", []):
                name = entry["Key"][len(prefix) :]
                if name.endswith("/"):
                    continue  # a "folder" marker object
                found += 1
                try:
                    parts = safe_relative(name, f"input {redact(url)}")
                except StagingError as exc:
                    ctx.log(f"{exc}; skipped")
                    continue
                _get(client, bucket, entry["Key"], make_parents(dest, parts), ctx, url)
    except (ClientError, BotoCoreError) as exc:
        raise StagingError(f"cannot list {redact(url)}: {_reason(exc)}") from None
    if not found:
        raise StagingError(f"{redact(url)}: no objects below this prefix (DIRECTORY input)")


def _get(client: Any, bucket: str, key: str, dest: Path, ctx: StagingContext, url: str) -> None:
    if not key or key.endswith("/"):
        raise StagingError(f"{redact(url)} names no object (a FILE input needs a key)")
    fd = create_file(dest)
    try:
        with os.fdopen(fd, "wb") as handle:
            client.download_fileobj(bucket, key, handle, Config=_transfer(ctx.options))
    except (ClientError, BotoCoreError) as exc:
        raise StagingError(f"s3://{bucket}/{key}: {_reason(exc)}") from None


def upload_file(source_fd: int, size: int, url: str, ctx: StagingContext) -> None:
    bucket, key = split_url(url)
    if not key or key.endswith("/"):
        raise StagingError(f"{redact(url)} names no object key")
    client = _client_for(ctx)
    os.lseek(source_fd, 0, os.SEEK_SET)
    try:
        # closefd=False: the caller owns the descriptor.
        with open(source_fd, "rb", closefd=False) as body:
            client.upload_fileobj(body, bucket, key, Config=_transfer(ctx.options))
    except (ClientError, BotoCoreError) as exc:
        raise StagingError(f"{redact(url)}: {_reason(exc)}") from None


def ensure_directory(url: str, ctx: StagingContext) -> None:
    """S3 has no directories: an empty directory leaves nothing behind."""
    split_url(url)
