"""What a `file:` URL names, decided once for the API, the renderer and the job side."""

from __future__ import annotations

import pytest

from bridge.core.naming import FileUrlError, is_local_url, local_path
from bridge.core.tes import TaskValidationError, validate_task
from bridge.job.staging import StagingError
from bridge.job.staging.file import url_path

ALLOWED = "/shared"


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("/shared/a", "/shared/a"),
        ("file:///shared/a", "/shared/a"),
        ("FILE:///shared/a", "/shared/a"),
        ("file://localhost/shared/a", "/shared/a"),
        ("file:/shared/a", "/shared/a"),
        ("file:///shared/dir/", "/shared/dir"),
        ("file:///", "/"),
        # Taken literally: a percent-encoded `..` is a name, never a way up.
        ("file:///shared/%2e%2e/etc/passwd", "/shared/%2e%2e/etc/passwd"),
        ("file:///shared/a%2Fb", "/shared/a%2Fb"),
        ("file:///shared/a b", "/shared/a b"),
    ],
)
def test_a_local_url_names_its_path_literally(url: str, path: str) -> None:
    assert is_local_url(url)
    assert local_path(url) == path


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file://otherhost/shared/a", "names host 'otherhost'"),
        ("file://LOCALHOST.example/shared/a", "names host"),
        ("file://user@localhost/shared/a", "names host"),
        ("file:///shared/../etc/passwd", "not normalised"),
        ("/shared/../etc/passwd", "not normalised"),
        ("/shared/./a", "not normalised"),
        ("/shared//a", "not normalised"),
        ("file:////etc/passwd", "not normalised"),
        ("//shared/a", "not normalised"),
        ("file:////", "not normalised"),
        ("file:///shared/a\0b", "NUL"),
        ("/shared/\0", "NUL"),
        ("file:shared/a", "absolute path"),
        ("file:", "absolute path"),
        ("file://", "absolute path"),
        ("file://localhost", "absolute path"),
    ],
)
def test_hostile_local_urls_are_refused_alike_by_the_api_and_the_job_side(
    url: str, why: str
) -> None:
    with pytest.raises(FileUrlError, match=why) as refused:
        local_path(url)
    with pytest.raises(StagingError) as staged:
        url_path(url)
    assert str(staged.value) == str(refused.value)
    body = {
        "executors": [{"image": "alpine", "command": ["true"]}],
        "inputs": [{"path": "/in", "url": url}],
    }
    with pytest.raises(TaskValidationError) as posted:
        validate_task(body, allowed_dirs=[ALLOWED])
    [(field, message)] = posted.value.errors
    assert field == "inputs[0].url"
    # The model refuses NUL in any string before the URL is looked at.
    assert message == str(refused.value) or (why == "NUL" and "NUL" in message)


@pytest.mark.parametrize("url", ["s3://b/k", "https://h/x", "relative/x", "", "files:///x"])
def test_other_urls_are_not_local(url: str) -> None:
    assert not is_local_url(url)
    with pytest.raises(FileUrlError, match="not a file URL"):
        local_path(url)
