"""The task page names the three jobs of a task staged on a transfer partition (stage-in, the
task's job, stage-out: bridge/poller/chain.py), in a real browser (Debian's headless Chromium
through Selenium), against the API alone: the attempt's metadata is written as the poller
writes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from bridge.store import Store
from tests.api.test_ui_resubmit import _auth, _sign_in
from tests.cluster.test_webui import _until, browser  # noqa: F401 (browser: a fixture)
from tests.fixtures.auth import basic_auth_toml, write_htpasswd
from tests.fixtures.service import serve_api_only

API = "/ga4gh/tes/v1"
METADATA = {
    "slurm_staging": "transfer",
    "slurm_stage_in_job_id": "41",
    "slurm_stage_in_state": "COMPLETED",
    "slurm_stage_in_exit_code": "0",
    "slurm_stage_in_partition": "xfer",
    "slurm_job_id": "42",
    "slurm_state": "RUNNING",
    "slurm_node": "node3",
    "slurm_stage_out_job_id": "43",
}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    with serve_api_only(tmp_path, basic_auth_toml(write_htpasswd(tmp_path / "htpasswd"))) as url:
        yield url, tmp_path / "state" / "tes-bridge.db"


def test_the_task_page_names_a_staged_task_s_three_jobs(
    served: tuple[str, Path],
    browser: WebDriver,  # noqa: F811
) -> None:
    url, database = served
    body = {
        "name": "staged",
        "inputs": [{"url": "https://example.org/a", "path": "/in/a"}],
        "executors": [{"image": "alpine", "command": ["true"]}],
    }
    created = requests.post(f"{url}{API}/tasks", json=body, auth=_auth("tesalice"), timeout=10)
    task_id = created.json()["id"]
    store = Store.from_url(f"sqlite:///{database}")
    try:
        store.update_task(task_id, state="RUNNING", logs=[{"logs": [], "metadata": METADATA}])
    finally:
        store.db.close()
    _sign_in(browser, url, "tesalice", f"#/task/{task_id}")
    stage_in = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".attempt .job-stage-in"))
    assert stage_in.text == "41, COMPLETED, exit code 0, partition xfer"
    assert browser.find_element(By.CSS_SELECTOR, ".attempt .job-stage-out").text == "43, submitted"
    attempt = browser.find_element(By.CSS_SELECTOR, ".attempt").text
    assert "Stage-in job" in attempt and "Stage-out job" in attempt and "42" in attempt
