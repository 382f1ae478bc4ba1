"""`http://` and `https://`: download with GET (redirects followed, retries on transient errors),
upload with PUT where the deployment enables it (`staging.http_upload`).

Credentials come from the site's netrc file (`staging.netrc_file`, by host name) or from the URL
itself; requests drops them when a redirect leads to another host. HTTPS certificates are checked
against `staging.ca_bundle` where a site sets one. Plain HTTP cannot list a directory, so
DIRECTORY inputs are refused; a DIRECTORY output is one PUT per file. `session`, `describe` and
`get_file` serve `bridge.job.staging.drs` too.
"""

from __future__ import annotations

import os
import time
import urllib.parse
from pathlib import Path

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from bridge.job.staging import (
    FileKind,
    StagingContext,
    StagingError,
    create_file,
    netrc_login,
    redact,
)

#: Statuses worth another attempt: the server or a proxy was briefly unable to answer.
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
_CHUNK = 1 << 20


def _auth(url: str, ctx: StagingContext) -> tuple[str, str] | None:
    return netrc_login(urllib.parse.urlsplit(url).hostname or "", ctx)


def session(ctx: StagingContext) -> requests.Session:
    """A session with the deployment's retries (GET and HEAD) and CA bundle."""
    result = requests.Session()
    # No ~/.netrc or proxy credentials from the job's environment beyond the site's file.
    result.trust_env = False
    result.verify = ctx.options.verify
    retry = Retry(
        total=ctx.options.retries,
        connect=ctx.options.retries,
        read=ctx.options.retries,
        status=ctx.options.retries,
        backoff_factor=0.5,
        status_forcelist=RETRY_STATUSES,
        # PUT bodies are streamed from a file: urllib3 cannot rewind them, `upload_file` retries.
        allowed_methods=frozenset({"GET", "HEAD"}),
        raise_on_status=False,
        respect_retry_after_header=True,
    )
    adapter = HTTPAdapter(max_retries=retry)
    result.mount("http://", adapter)
    result.mount("https://", adapter)
    return result


def describe(exc: requests.RequestException) -> str:
    # requests' messages name the URL, which may carry credentials.
    reason = exc.__class__.__name__
    if isinstance(exc, requests.exceptions.SSLError):
        reason = "TLS failed (a server certificate of the site's own CA needs staging.ca_bundle)"
    elif isinstance(exc, requests.ConnectionError):
        reason = "cannot connect"
    elif isinstance(exc, requests.Timeout):
        reason = "timed out"
    return redact(f"{reason}: {exc}")


def _check_status(response: requests.Response, url: str, verb: str) -> None:
    if response.status_code >= 400:
        reason = f"HTTP {response.status_code} {response.reason or ''}".rstrip()
        raise StagingError(f"{verb} {redact(url)} failed: {reason}")


def download(url: str, dest: Path, kind: FileKind, ctx: StagingContext) -> None:
    if kind == "DIRECTORY":
        raise StagingError(
            f"{redact(url)}: DIRECTORY inputs cannot be staged over HTTP (it cannot list a "
            "directory); use s3://, ftp:// or file://, or list the files as FILE inputs"
        )
    get_file(url, dest, ctx)


def get_file(
    url: str, dest: Path, ctx: StagingContext, headers: dict[str, str] | None = None
) -> None:
    """GET `url` into the new file `dest`, with `headers` (a DRS access URL's) if any."""
    timeout = ctx.options.timeout
    # The access URL's own Authorization header wins over a netrc login for its host.
    own_auth = any(name.lower() == "authorization" for name in headers or {})
    with session(ctx) as http:
        try:
            response = http.get(
                url,
                stream=True,
                timeout=(timeout, timeout),
                auth=None if own_auth else _auth(url, ctx),
                headers=headers,
            )
        except requests.RequestException as exc:
            raise StagingError(f"GET {redact(url)} failed: {describe(exc)}") from None
        with response:
            _check_status(response, url, "GET")
            fd = create_file(dest)
            try:
                with os.fdopen(fd, "wb") as handle:
                    for chunk in response.iter_content(_CHUNK):
                        handle.write(chunk)
            except requests.RequestException as exc:
                raise StagingError(f"GET {redact(url)} failed: {describe(exc)}") from None
            expected = response.headers.get("Content-Length")
            encoded = response.headers.get("Content-Encoding", "identity") != "identity"
            short = expected and expected.isdigit() and dest.stat().st_size != int(expected)
            if short and not encoded:
                raise StagingError(f"GET {redact(url)}: the connection ended early")


def upload_file(source_fd: int, size: int, url: str, ctx: StagingContext) -> None:
    if not ctx.options.http_upload:
        raise StagingError(
            f"{redact(url)}: uploads over HTTP are disabled on this deployment "
            "(staging.http_upload)"
        )
    timeout = ctx.options.timeout
    attempts = ctx.options.retries + 1
    with session(ctx) as http:
        for attempt in range(attempts):
            os.lseek(source_fd, 0, os.SEEK_SET)
            # closefd=False: the caller owns the descriptor.
            with open(source_fd, "rb", closefd=False) as body:
                try:
                    response = http.put(
                        url,
                        data=body,
                        headers={"Content-Length": str(size)},
                        timeout=(timeout, timeout),
                        auth=_auth(url, ctx),
                    )
                except requests.RequestException as exc:
                    if attempt + 1 < attempts:
                        time.sleep(0.5 * 2**attempt)
                        continue
                    raise StagingError(f"PUT {redact(url)} failed: {describe(exc)}") from None
            with response:
                if response.status_code in RETRY_STATUSES and attempt + 1 < attempts:
                    time.sleep(0.5 * 2**attempt)
                    continue
                _check_status(response, url, "PUT")
                return


def ensure_directory(url: str, ctx: StagingContext) -> None:
    """HTTP has no directories: the files of a DIRECTORY output are PUT one by one."""
