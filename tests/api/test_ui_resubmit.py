"""The task page's Resubmit in a real browser (Debian's headless Chromium through Selenium),
against the API alone under gunicorn with basic authentication: no cluster is needed to post
a copy. The page asks the TES API itself, so the API's rules hold: who may read a task may
resubmit it, and the copy is theirs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from bridge.store import Store
from tests.cluster.test_webui import _until, browser  # noqa: F401 (browser: a fixture)
from tests.fixtures.auth import PASSWORDS, basic_auth_toml, write_htpasswd
from tests.fixtures.service import serve_api_only

API = "/ga4gh/tes/v1"
TAG = "tes-bridge.resubmit_of"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    toml = basic_auth_toml(write_htpasswd(tmp_path / "htpasswd")) + 'admin_users = ["tesadmin"]\n'
    with serve_api_only(tmp_path, toml) as url:
        yield url, tmp_path / "state" / "tes-bridge.db"


def _auth(user: str) -> tuple[str, str]:
    return user, PASSWORDS[user]


def _task(url: str, task_id: str) -> dict[str, Any]:
    answer = requests.get(
        f"{url}{API}/tasks/{task_id}", params={"view": "FULL"}, auth=_auth("tesadmin"), timeout=10
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _owner(database: Path, task_id: str) -> str | None:
    store = Store.from_url(f"sqlite:///{database}")
    try:
        record = store.get_task(task_id)
        return record.owner if record else None
    finally:
        store.db.close()


def _sign_in(driver: WebDriver, url: str, user: str, page: str) -> None:
    driver.get(f"{url}/ui/#/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{url}/ui/{page}")
    driver.refresh()
    _until(driver, lambda d: d.find_element(By.ID, "login").is_displayed())
    driver.find_element(By.ID, "login-user").send_keys(user)
    driver.find_element(By.ID, "login-password").send_keys(PASSWORDS[user])
    driver.find_element(By.ID, "login-submit").click()


def _resubmit(driver: WebDriver, original: str, changes: dict[str, str]) -> str:
    """Press Resubmit on the task's page, make `changes` in the form, submit; the new id."""
    button = _until(driver, lambda d: d.find_element(By.ID, "resubmit"))
    _until(driver, lambda d: button.is_displayed())
    button.click()
    for field, value in changes.items():
        box = driver.find_element(By.ID, f"resubmit-{field}")
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "resubmit-submit").click()
    _until(driver, lambda d: f"#/task/{original}" not in d.current_url)
    link = _until(driver, lambda d: d.find_element(By.ID, "resubmit-of"))
    assert link.text == original
    return str(driver.current_url.rsplit("#/task/", 1)[1])


def test_resubmit_from_the_task_page_with_more_time_and_memory(
    served: tuple[str, Path],
    browser: WebDriver,  # noqa: F811
) -> None:
    url, database = served
    body = {
        "name": "timed-out",
        "tags": {"project": "x"},
        "executors": [{"image": "alpine", "command": ["sleep", "7200"]}],
        "resources": {
            "cpu_cores": 2,
            "ram_gb": 4,
            "zones": ["short"],
            "backend_parameters": {"time": "10", "max_time": "0.25", "qos": "normal"},
        },
    }
    created = requests.post(f"{url}{API}/tasks", json=body, auth=_auth("tesalice"), timeout=10)
    original = created.json()["id"]

    _sign_in(browser, url, "tesalice", f"#/task/{original}")
    _until(browser, lambda d: d.find_element(By.ID, "task-name").text == "timed-out")
    browser.find_element(By.ID, "resubmit").click()
    # The form shows what the task asked for.
    shown = {
        field: browser.find_element(By.ID, f"resubmit-{field}").get_attribute("value")
        for field in ("time", "partition", "cpus", "ram")
    }
    assert shown == {"time": "10", "partition": "", "cpus": "2", "ram": "4"}
    copy_id = _resubmit(browser, original, {"time": "2:00:00", "partition": "long", "ram": "8"})
    copy = _task(url, copy_id)
    assert copy["state"] == "QUEUED" and copy["name"] == "timed-out"
    assert copy["executors"] == body["executors"]
    assert copy["tags"] == {"project": "x", TAG: original}
    # What changed replaced the task's own: every other time limit, the zones; the rest kept.
    assert copy["resources"] == {
        "cpu_cores": 2,
        "ram_gb": 8,
        "backend_parameters": {"qos": "normal", "time": "2:00:00", "partition": "long"},
    }
    assert _owner(database, copy_id) == "tesalice"
    # The copy's page leads back to the original.
    browser.find_element(By.ID, "resubmit-of").click()
    _until(browser, lambda d: d.current_url.endswith(f"#/task/{original}"))

    # Bob cannot read Alice's task, so he has nothing to resubmit; an admin can, and the copy
    # is the admin's.
    _sign_in(browser, url, "tesbob", f"#/task/{original}")
    error = _until(browser, lambda d: d.find_element(By.ID, "error"))
    _until(browser, lambda d: "404" in error.text)
    assert not browser.find_element(By.ID, "resubmit").is_displayed()
    _sign_in(browser, url, "tesadmin", f"#/task/{original}")
    admins = _resubmit(browser, original, {})
    assert _task(url, admins)["resources"] == body["resources"]
    assert _owner(database, admins) == "tesadmin"
