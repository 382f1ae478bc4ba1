"""The workflow view isolates one Nextflow run, which sends no tags and names its tasks after
their processes: by the directory its files are under (the run's work directory, `-w`) and the
span of creation times `nextflow log` prints for it. In Chromium, against the app served on
loopback with the tasks in its store (no Slurm needed: what is drawn is the TES list)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import quote
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from bridge.api.app import create_app
from bridge.config import Config
from bridge.store import Store
from tests.cluster.test_webui import _until, browser  # noqa: F401 (browser: a fixture)

#: Two runs in one work directory (the second resumed an hour later), one in another.
WORK = "/shared/project/work"
OTHER = "/shared/other/work"
RUNS = {
    "first": (WORK, "2026-05-04T10:00:00Z", ["ALIGN (s1)", "ALIGN (s2)", "MERGE"]),
    "resumed": (WORK, "2026-05-04T11:00:00Z", ["ALIGN (s3)", "MERGE"]),
    "other": (OTHER, "2026-05-04T10:30:00Z", ["ALIGN (x1)"]),
}


def nextflow_task(name: str, work: Path | str) -> dict[str, Any]:
    """What nf-ga4gh 1.4 sends for a task (tests/cluster/test_nextflow_wire.py): no tags, its
    files as bare paths in `<work>/<2 hex>/<30 hex>`."""
    digest = secrets.token_hex(16)
    task_dir = f"{work}/{digest[:2]}/{digest[2:]}"
    return {
        "name": name,
        "inputs": [
            {"url": f"{task_dir}/.command.sh", "path": "/work/.command.sh", "type": "FILE"},
            {"url": f"{task_dir}/.command.run", "path": "/work/.command.run", "type": "FILE"},
        ],
        "outputs": [{"url": f"{task_dir}/.exitcode", "path": "/work/.exitcode"}],
        "executors": [{"image": "python:3-slim", "command": ["bash", "/work/.command.run"]}],
    }


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def page(config: Config, sqlite_store: Store) -> Iterator[str]:
    """The app on loopback, with the runs' tasks stored (created a minute apart, in order)."""
    with sqlite_store.db.connection_context():
        for work, start, names in RUNS.values():
            for minute, name in enumerate(names):
                task = sqlite_store.create_task(nextflow_task(name, work))
                created = start.replace(":00:00Z", f":{minute:02d}:00Z")
                sqlite_store.update_task(task.id, creation_time=created)
    app = create_app(config, store=sqlite_store)
    server = make_server("127.0.0.1", 0, app, server_class=_Server, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/ui/"
    server.shutdown()
    thread.join(timeout=10)


def _shown(driver: WebDriver) -> list[str]:
    """The names in the workflow's resources table, once a load is drawn."""
    _until(driver, lambda d: d.find_element(By.ID, "workflow-view").get_attribute("data-loaded"))
    rows = driver.find_elements(By.CSS_SELECTOR, "#resources tbody tr")
    return [row.find_element(By.CSS_SELECTOR, "td").text for row in rows]


def _open(driver: WebDriver, url: str) -> list[str]:
    driver.get("about:blank")  # a fresh page: data-loaded counts its own loads
    driver.get(url)
    return _shown(driver)


def test_one_nextflow_run_by_its_work_directory_and_times(
    page: str,
    browser: WebDriver,  # noqa: F811
) -> None:
    # The work directory alone: both runs made in it, oldest first, not the other one's.
    both = _open(browser, f"{page}#/workflow?dir={quote(WORK)}")
    assert both == ["ALIGN (s1)", "ALIGN (s2)", "MERGE", "ALIGN (s3)", "MERGE"]
    # A trailing slash, or a file:// URL's path, is the same directory; a sibling is not.
    assert _open(browser, f"{page}#/workflow?dir={quote(WORK + '/')}") == both
    assert _open(browser, f"{page}#/workflow?dir={quote('/shared/project/wor')}") == []
    # With the first run's span (RFC 3339 times): that run alone.
    span = "since=2026-05-04T10:00:00Z&until=2026-05-04T10:59:59Z"
    first = f"{page}#/workflow?dir={quote(WORK)}&{span}"
    assert _open(browser, first) == ["ALIGN (s1)", "ALIGN (s2)", "MERGE"]
    title = browser.find_element(By.ID, "workflow-title").text
    assert title == (
        f"Workflow: files under {WORK}, created from 2026-05-04T10:00:00Z, created until "
        "2026-05-04T10:59:59Z"
    )
    # The resumed run: from its start on.
    resumed = _open(browser, f"{page}#/workflow?dir={quote(WORK)}&since=2026-05-04T11:00:00Z")
    assert resumed == ["ALIGN (s3)", "MERGE"]


def test_the_workflow_form_sets_the_directory_and_the_start(
    page: str,
    browser: WebDriver,  # noqa: F811
) -> None:
    """Without a filter the view says what isolates a workflow, and its form sets one; a time
    as `nextflow log` prints it is the browser's local time (Chromium here runs in UTC)."""
    browser.get(f"{page}#/workflow")
    _until(browser, lambda d: d.find_element(By.ID, "error").text)
    assert "a directory or a start time" in browser.find_element(By.ID, "error").text
    browser.find_element(By.ID, "workflow-dir").send_keys(OTHER)
    browser.find_element(By.ID, "workflow-since").send_keys("2026-05-04 10:00:00")
    browser.find_element(By.ID, "workflow-apply").click()
    assert _shown(browser) == ["ALIGN (x1)"]
    assert browser.current_url.endswith(
        f"#/workflow?dir={quote(OTHER, safe='')}&since=2026-05-04+10%3A00%3A00"
    )
