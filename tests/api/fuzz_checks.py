"""Schemathesis hooks of tests/api/test_fuzz.py (its `hooks` setting loads this file): the one
5xx the fuzz accepts, and only as documented.

The fuzz server runs no poller (`serve --no-poller`), and `POST /tasks:test-only` asks the
poller (bridge.api.estimate): a task it accepts is answered 503 with Retry-After, saying that
no poller answers. That is the service's own state, not the client's doing; every request it
refuses is still a 400 first, and any other 5xx, there or elsewhere, fails the fuzz."""

from __future__ import annotations

from typing import Any

import schemathesis

#: The operation, and what its 503 says when no poller listens on the relay socket.
TEST_ONLY = "POST /tasks:test-only"
NO_POLLER = "cannot ask Slurm now: the poller does not answer"
RETRY_AFTER = "10"


@schemathesis.check
def the_documented_503_alone_at_test_only(ctx: Any, response: Any, case: Any) -> None:
    if response.status_code < 500 or case.operation.label != TEST_ONLY:
        return  # not_a_server_error checks every other operation
    assert response.status_code == 503, f"{TEST_ONLY} answered {response.status_code}"
    retry_after = response.headers.get("retry-after") or []
    assert retry_after == [RETRY_AFTER], f"Retry-After: {retry_after}, not {RETRY_AFTER}"
    message = response.json().get("message", "")
    assert message.startswith(NO_POLLER), f"a 503 that is not the missing poller's: {message!r}"
