"""The HTTP side of the client: one session with authentication and retries, TES calls, and
errors that carry the server's own message."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

#: The base path of the TES 1.1 specification; a URL ending in one of these is used as it is.
SPEC_BASE_PATH = "/ga4gh/tes/v1"
KNOWN_BASE_PATHS = (SPEC_BASE_PATH, "/v1")

#: A task in one of these states never changes again (PREEMPTED: "stopped by the system").
FINAL_STATES = frozenset({"COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED", "PREEMPTED"})


class TesError(Exception):
    """A request failed; the message is what the user reads. `status` is the HTTP status, or
    None when the server could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class BearerAuth(requests.auth.AuthBase):
    """An auth object rather than a header: requests then does not put a netrc login over it."""

    def __init__(self, token: str):
        self.token = token

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = f"Bearer {self.token}"
        return request


def base_url(url: str) -> str:
    """`http://host:8000` -> `http://host:8000/ga4gh/tes/v1`; a URL that already ends in a TES
    base path (`.../ga4gh/tes/v1`, or `.../v1` as py-tes and Funnel use) is kept."""
    url = url.rstrip("/")
    if not re.match(r"^https?://", url):
        raise TesError(f"--url {url!r}: expected an http:// or https:// URL")
    return url if url.endswith(KNOWN_BASE_PATHS) else url + SPEC_BASE_PATH


def _retry() -> Retry:
    # GETs are retried on connection and read errors and on answers that say "try again";
    # a POST only when the connection was never made (the server cannot have seen it), so a
    # create is never sent twice.
    return Retry(
        total=5,
        connect=3,
        read=2,
        status=3,
        backoff_factor=0.3,
        status_forcelist=(429, 502, 503, 504),
        allowed_methods=frozenset({"GET"}),
        raise_on_status=False,
    )


def server_message(response: requests.Response) -> str:
    """The message of an error answer: this server's `message`, or the field other servers and
    frameworks use for it (`msg`, grpc-gateway's `error`, Falcon's `description`...)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        for key in ("message", "msg", "detail", "description", "error", "title"):
            value = body.get(key)
            if isinstance(value, str) and value.strip():
                return value.strip()
    text = " ".join(response.text.split())
    return text[:300] or response.reason or "no message"


def connection_problem(exc: requests.RequestException) -> str:
    """The innermost reason of a requests/urllib3 error, without object reprs."""
    reason: BaseException = exc
    while True:
        inner = getattr(reason, "reason", None)
        if not isinstance(inner, BaseException) and reason.args:
            inner = reason.args[0] if isinstance(reason.args[0], BaseException) else None
        if not isinstance(inner, BaseException) or inner is reason:
            break
        reason = inner
    # urllib3 starts its messages with the object or pool they came from.
    text = re.sub(r"^(<[^>]*>|\w+\(host=[^)]*\)): ", "", str(reason))
    return text or type(reason).__name__


class TesClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = 30.0,
    ):
        self.base = base_url(url)
        self.timeout = timeout
        self.session = requests.Session()
        adapter = HTTPAdapter(max_retries=_retry())
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.session.headers["Accept"] = "application/json"
        if token:
            self.session.auth = BearerAuth(token)
        elif user:
            self.session.auth = (user, password or "")
        # Otherwise requests looks up the host in ~/.netrc ($NETRC) by itself.

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        url = self.base + path
        try:
            response = self.session.request(method, url, timeout=self.timeout, **kwargs)
        except requests.RequestException as exc:
            raise TesError(f"cannot reach {self.base}: {connection_problem(exc)}") from None
        if not response.ok:
            message = f"{method} {url}: {response.status_code} {server_message(response)}"
            if response.status_code == 401:
                message += " (give --token or TES_TOKEN, or --user with TES_PASSWORD or netrc)"
            raise TesError(message, response.status_code)
        try:
            return response.json()
        except ValueError:
            raise TesError(
                f"{method} {url}: the answer is not JSON: {response.text[:200]!r}",
                response.status_code,
            ) from None

    # ------------------------------------------------------------------------ TES calls
    def create(self, task: Mapping[str, Any]) -> str:
        answer = self.request("POST", "/tasks", json=task)
        task_id = answer.get("id") if isinstance(answer, dict) else None
        if not isinstance(task_id, str):
            raise TesError(f"POST {self.base}/tasks: the answer has no task id: {answer!r}")
        return task_id

    def get(self, task_id: str, view: str = "MINIMAL") -> dict[str, Any]:
        return self._object("GET", f"/tasks/{_quote(task_id)}", params={"view": view})

    def _object(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        answer = self.request(method, path, **kwargs)
        if not isinstance(answer, dict):
            raise TesError(
                f"{method} {self.base}{path}: expected a JSON object, got {answer!r:.200}"
            )
        return answer

    def output(
        self, task_id: str, *, executor: int, stream: str, offset: int, max_bytes: int | None = None
    ) -> dict[str, Any]:
        """A range of an executor's live output: this server's extension of TES
        (`GET /tasks/{id}/output`); other servers answer 404."""
        params: dict[str, Any] = {"executor": executor, "stream": stream, "offset": offset}
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        return self._object("GET", f"/tasks/{_quote(task_id)}/output", params=params)

    def test_only(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """Where and when Slurm would start `task`, without creating it: this server's
        extension of TES (`POST /tasks:test-only`, sbatch --test-only); other servers answer
        404 or 405."""
        return self._object("POST", "/tasks:test-only", json=task)

    def cancel(self, task_id: str) -> None:
        self.request("POST", f"/tasks/{_quote(task_id)}:cancel", json={})

    def tasks(
        self,
        *,
        state: str | None = None,
        name_prefix: str | None = None,
        tags: Sequence[tuple[str, str]] = (),
        view: str = "BASIC",
        page_size: int | None = None,
        limit: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Every matching task, newest first as the server orders them, following
        `next_page_token` until the last page (or `limit` tasks)."""
        params: dict[str, Any] = {"view": view}
        if state:
            params["state"] = state
        if name_prefix:
            params["name_prefix"] = name_prefix
        if tags:
            # Paired by position; an empty value means "any value of this key".
            params["tag_key"] = [key for key, _ in tags]
            params["tag_value"] = [value for _, value in tags]
        if limit is not None:
            page_size = min(page_size or limit, limit)
        if page_size:
            params["page_size"] = page_size
        count = 0
        while True:
            answer = self._object("GET", "/tasks", params=params)
            for task in answer.get("tasks") or []:
                yield task
                count += 1
                if limit is not None and count >= limit:
                    return
            token = answer.get("next_page_token")
            if not token:
                return
            params["page_token"] = token


def _quote(task_id: str) -> str:
    return urllib.parse.quote(task_id, safe="")
