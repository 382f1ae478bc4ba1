"""The web page of tasks in a real browser: Debian's headless Chromium, driven by Selenium
through Debian's chromedriver, against the bridge on the real cluster with basic
authentication. Screenshots of each step go to the test's temporary directory (printed). On a
cluster made full, when a pending task is expected to start: on its page, and as `tes-bridge
task` says it."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import requests
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.fixtures.auth import PASSWORDS, write_htpasswd
from tests.fixtures.service import BridgeService, start_bridge_service
from tests.tes_cli import tes_task

pytestmark = pytest.mark.cluster

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ALICE = ("tesalice", PASSWORDS["tesalice"])
BOB = ("tesbob", PASSWORDS["tesbob"])
#: A hostile name: shown as text, it must never become an element or run.
XSS_NAME = '<img src=x onerror="window.__pwned=1">'


@pytest.fixture(scope="module")
def service(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    root = tmp_path_factory.mktemp("webui")
    htpasswd = write_htpasswd(root / "htpasswd")
    with start_bridge_service(
        local_cluster, root, extra_toml=f'[auth]\nmode = "basic"\nhtpasswd_file = "{htpasswd}"\n'
    ) as service:
        yield service


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), (
        "apt install chromium chromium-driver"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(argument)  # --no-sandbox: the suite runs as root
    # Debian's chromedriver: Selenium Manager would download one from the internet.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _post(service: BridgeService, auth: tuple[str, str], task: dict[str, Any]) -> str:
    answer = requests.post(f"{service.api}/tasks", json=task, auth=auth, timeout=10)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def _get(service: BridgeService, task_id: str, auth: tuple[str, str] = ALICE) -> dict[str, Any]:
    answer = requests.get(
        f"{service.api}/tasks/{task_id}", params={"view": "FULL"}, auth=auth, timeout=10
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _wait_state(service: BridgeService, task_id: str, states: set[str], timeout: float = 180):
    deadline = time.monotonic() + timeout
    while (task := _get(service, task_id))["state"] not in states:
        assert time.monotonic() < deadline, f"{task_id} still {task['state']}\n{service.log_tail()}"
        time.sleep(0.3)
    return task


def _until(driver: WebDriver, condition: Callable[[WebDriver], Any], timeout: float = 30) -> Any:
    def check(d: WebDriver) -> Any:
        try:
            return condition(d)
        except StaleElementReferenceException:  # the list was redrawn meanwhile
            return False

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(check)


def _rows(driver: WebDriver) -> dict[str, tuple[str, str]]:
    """The listed tasks: id -> (name, state), as the page shows them (text)."""
    rows = driver.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")
    return {
        row.get_attribute("data-id"): (
            row.find_element(By.CSS_SELECTOR, "td.name").text,
            row.find_element(By.CSS_SELECTOR, "td.state").text,
        )
        for row in rows
    }


def _search(driver: WebDriver, *, state: str = "", name: str = "", tag: str = "") -> None:
    Select(driver.find_element(By.ID, "filter-state")).select_by_value(state)
    for field, value in (("filter-name", name), ("filter-tag", tag)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    before = driver.find_element(By.ID, "tasks").get_attribute("data-loaded")
    driver.find_element(By.ID, "filter-apply").click()
    _until(driver, lambda d: d.find_element(By.ID, "tasks").get_attribute("data-loaded") != before)


def _sign_in(
    driver: WebDriver, service: BridgeService, before: Callable[[], None] = lambda: None
) -> None:
    """Open the service's address and sign in as Alice on the form the page shows."""
    driver.get(service.url + "/")
    assert driver.current_url == service.url + "/ui/"
    assert _until(driver, lambda d: d.find_element(By.ID, "login").is_displayed())
    before()
    driver.find_element(By.ID, "login-user").send_keys(ALICE[0])
    driver.find_element(By.ID, "login-password").send_keys(ALICE[1])
    driver.find_element(By.ID, "login-submit").click()


def test_the_task_page_in_a_real_browser(service: BridgeService, browser: WebDriver, tmp_path):
    run = uuid.uuid4().hex[:8]
    tag = {"webui-run": run}
    result_url = f"file://{service.data_dir}/webui-{run}.txt"
    done = _post(service, ALICE, {
        "name": f"webui-done-{run}", "tags": tag,
        "inputs": [{"name": "greeting", "path": "/in/greeting.txt", "content": "hello"}],
        "outputs": [{"name": "result", "path": "/out/result.txt", "url": result_url}],
        "resources": {"backend_parameters": {"time": "5"}},
        "executors": [{"image": "alpine", "command": [
            "sh", "-c", "echo 'hello <b>web</b>'; cat /in/greeting.txt > /out/result.txt;"
            " echo 'Error: the first line' >&2; seq 1 8000 >&2"]}],
    })  # fmt: skip
    hostile = _post(service, ALICE, {
        "name": XSS_NAME, "tags": {**tag, "<i>k</i>": "<script>v</script>"},
        "executors": [{"image": "alpine", "command": ["true"]}],
    })  # fmt: skip
    ticking = _post(service, ALICE, {
        "name": f"webui-long-{run}", "tags": tag,
        "executors": [{"image": "alpine", "command": [
            "sh", "-c", "i=0; while [ $i -lt 300 ]; do i=$((i+1)); echo tick $i; sleep 1; done"]}],
    })  # fmt: skip
    bobs = _post(service, BOB, {
        "name": f"webui-bob-{run}", "tags": tag,
        "executors": [{"image": "alpine", "command": ["true"]}],
    })  # fmt: skip
    shots: list[Path] = []

    def shot(name: str) -> None:
        shots.append(tmp_path / f"{len(shots) + 1:02d}-{name}.png")
        browser.save_screenshot(str(shots[-1]))

    print(f"\nscreenshots in {tmp_path}")
    try:
        # The page is public, its data is not: the page asks for credentials.
        _sign_in(browser, service, before=lambda: shot("sign-in"))
        _until(browser, lambda d: done in _rows(d))
        assert not browser.find_element(By.ID, "login").is_displayed()
        assert browser.find_element(By.ID, "who").text == "signed in as tesalice"

        # Alice's tasks only; the hostile name is text, not an element, and nothing ran.
        _search(browser, tag=f"webui-run={run}")
        rows = _rows(browser)
        assert set(rows) == {done, hostile, ticking} and bobs not in rows
        assert rows[hostile][0] == XSS_NAME
        assert browser.find_elements(By.CSS_SELECTOR, "#tasks img, #tasks script, #tasks i") == []
        assert browser.execute_script("return window.__pwned") is None
        shot("list")

        # Paging with the server's page tokens, two tasks a page (an option added for this).
        browser.execute_script(
            "const o = document.createElement('option'); o.value = o.textContent = '2';"
            "document.getElementById('filter-size').append(o);"
        )
        Select(browser.find_element(By.ID, "filter-size")).select_by_value("2")
        _search(browser, tag=f"webui-run={run}")
        first_page = _rows(browser)
        assert len(first_page) == 2
        pages = []
        for button in ("page-next", "page-previous"):
            before = browser.find_element(By.ID, "tasks").get_attribute("data-loaded")
            browser.find_element(By.ID, button).click()
            _until(browser, lambda d, b=before: d.find_element(By.ID, "tasks").get_attribute(
                "data-loaded") != b)  # fmt: skip
            pages.append(set(_rows(browser)))
        assert pages == [{done, hostile, ticking} - set(first_page), set(first_page)]
        Select(browser.find_element(By.ID, "filter-size")).select_by_value("50")

        # Filter by state and search by name.
        _wait_state(service, done, {"COMPLETE"})
        _search(browser, state="COMPLETE", tag=f"webui-run={run}")
        assert done in _rows(browser) and ticking not in _rows(browser)
        assert {state for _, state in _rows(browser).values()} == {"COMPLETE"}
        _search(browser, name=f"webui-done-{run}")
        assert list(_rows(browser)) == [done]
        shot("filtered")

        # A finished task: its attempt with the Slurm job and node, and the executor's stdout.
        job = _get(service, done)["logs"][-1]["metadata"]
        browser.find_element(By.LINK_TEXT, f"webui-done-{run}").click()
        attempt = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".attempt"))
        assert job["slurm_job_id"] in attempt.text and job["slurm_node"] in attempt.text
        assert attempt.find_element(By.CSS_SELECTOR, "pre.stdout").text == "hello <b>web</b>"
        assert browser.find_elements(By.CSS_SELECTOR, ".attempt b") == []
        assert not browser.find_element(By.ID, "cancel").is_displayed()
        assert "/in/greeting.txt" in browser.find_element(By.ID, "inputs").text
        assert result_url in browser.find_element(By.ID, "outputs").text
        assert f"{result_url} (5 B)" in attempt.text  # what was uploaded
        # The time limit and backend parameters the job got.
        assert attempt.find_element(By.CSS_SELECTOR, ".time-limit").text == (
            "--time=5, from resources.backend_parameters.time"
        )
        assert browser.find_element(By.ID, "task-backend-parameters").text == "time=5"
        # 39 KB of stderr, of which the task document keeps 2 KiB (log_tail_bytes): the page
        # shows it whole, with the part the document leaves out marked, and downloads it.
        whole = "Error: the first line\n" + "".join(f"{n}\n" for n in range(1, 8001))
        documented = _get(service, done)["logs"][-1]["logs"][0]["stderr"]
        head, _, rest = documented.partition("[tes-bridge: ")
        tail = rest.partition("\n")[2]
        assert head.startswith("Error: the first line\n") and whole.endswith("\n" + tail)
        stderr = _until(browser, lambda d: d.find_element(
            By.CSS_SELECTOR, '.attempt pre.stderr[data-whole="yes"]'))  # fmt: skip
        assert stderr.get_attribute("textContent") == whole
        left_out = stderr.find_element(By.CSS_SELECTOR, "span.left-out")
        assert left_out.get_attribute("textContent") == whole[len(head) : len(whole) - len(tail)]
        assert left_out.get_attribute("data-note") == (
            f"the task document leaves out these {len(whole) - len(head) - len(tail):,} "
            f"of {len(whole):,} bytes"
        )
        downloads = tmp_path / "downloads"
        browser.execute_cdp_cmd(
            "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
        )
        link = browser.find_element(By.CSS_SELECTOR, '.attempt a.download[data-name$="stderr.txt"]')
        saved = downloads / str(link.get_attribute("data-name"))
        link.click()
        _until(browser, lambda d: saved.exists() and saved.read_text() == whole)
        shot("task")

        # A running task: its live output, then the cancel button.
        _wait_state(service, ticking, {"RUNNING"})
        browser.get(f"{service.url}/ui/#/task/{ticking}")
        live = _until(
            browser,
            lambda d: (
                "tick 2" in d.find_element(By.CSS_SELECTOR, "pre.live-stdout").text
                and d.find_element(By.CSS_SELECTOR, "pre.live-stdout")
            ),
        )
        assert _get(service, ticking)["state"] == "RUNNING"
        assert live.text.startswith("tick 1")
        shot("live-output")
        browser.find_element(By.ID, "cancel").click()
        browser.find_element(By.ID, "cancel-confirm").click()
        _until(browser, lambda d: d.find_element(By.ID, "task-state").text == "CANCELED")
        assert _get(service, ticking)["state"] == "CANCELED"
        # What the stopped executor wrote stays readable (it has no log in the document).
        assert _until(browser, lambda d: "tick 2" in d.find_element(
            By.CSS_SELECTOR, "pre.live-stdout").text)  # fmt: skip
        # The open page follows the job to its end in Slurm: its final record, not RUNNING.
        _until(
            browser,
            lambda d: "CANCELLED" in d.find_element(By.CSS_SELECTOR, ".attempt").text,
            timeout=90,
        )
        shot("canceled")
        # The list says who canceled it.
        browser.get(f"{service.url}/ui/#/?tag={quote(f'webui-run={run}')}")
        _until(
            browser,
            lambda d: (
                d.find_element(By.CSS_SELECTOR, f'#tasks tr[data-id="{ticking}"] td.reason').text
                == "canceled by tesalice"
            ),
        )
        assert (
            browser.find_element(By.CSS_SELECTOR, f'#tasks tr[data-id="{done}"] td.reason').text
            == ""
        )
        shot("list-reasons")
    finally:
        shot("last")
        for task_id in (ticking,):
            requests.post(f"{service.api}/tasks/{task_id}:cancel", json={}, auth=ALICE, timeout=10)
    assert all(path.stat().st_size > 0 for path in shots)


@pytest.fixture
def full_cluster(local_cluster: Any) -> Iterator[list[str]]:
    """Every node's memory taken for 10 minutes by a plain sbatch job with that time limit
    (the partition's OverSubscribe=FORCE overrides --exclusive; memory is never shared): a new
    job waits (Reason Resources), and Slurm's backfill can foresee when it starts."""
    jobs: list[str] = []
    try:
        for node in local_cluster.nodes:
            memory = _slurm("sinfo", "-h", "-N", "-n", node, "-o", "%m").split()[0]
            jobs.append(_slurm("sbatch", "--parsable", f"--nodelist={node}", f"--mem={memory}",
                               "--time=10", "--output=/dev/null", "--wrap=sleep 600"))  # fmt: skip
        deadline = time.monotonic() + 60
        while _slurm("squeue", "-h", "-o", "%T", f"--jobs={','.join(jobs)}").split() != [
            "RUNNING"
        ] * len(jobs):
            assert time.monotonic() < deadline, _slurm("squeue")
            time.sleep(0.3)
        yield jobs
    finally:
        if jobs:
            subprocess.run(["scancel", *jobs], check=False, timeout=30)


def _slurm(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def test_a_pending_task_shows_when_slurm_expects_it_to_start(
    service: BridgeService, browser: WebDriver, full_cluster: list[str]
) -> None:
    """On a full cluster: `run --test-only` says when a task would start, and a task created
    there shows Slurm's estimate (squeue --start) in its FULL view, in `task wait`, in `task
    list` and on its page."""
    login = {"TES_USER": ALICE[0], "TES_PASSWORD": ALICE[1]}
    ends = time.time() + 9 * 60  # the blockers' time limit, give or take a minute
    asked = tes_task(service.url, "run", "--test-only", "--cpus", "2", "alpine", "--", "true",
                     **login)  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    when = re.fullmatch(
        r"Slurm would start it at (\S+ \S+) UTC on (\S+) \(2 processors, partition main\)\n",
        asked.stdout,
    )
    assert when, asked.stdout
    assert datetime.fromisoformat(when[1]).replace(tzinfo=UTC).timestamp() >= ends

    name = f"webui-pending-{uuid.uuid4().hex[:8]}"
    task_id = _post(service, ALICE, {
        "name": name, "executors": [{"image": "alpine", "command": ["true"]}],
    })  # fmt: skip
    try:
        # The backfill scheduler estimates every bf_interval (30 s by default).
        deadline = time.monotonic() + 90
        while (
            not (attempt := (_get(service, task_id).get("logs") or [{}])[-1])
            .get("metadata", {})
            .get("slurm_expected_start")
        ):
            assert time.monotonic() < deadline, attempt
            time.sleep(0.5)
        expected = datetime.fromisoformat(attempt["metadata"]["slurm_expected_start"])
        job = attempt["metadata"]["slurm_job_id"]
        squeue = _slurm("squeue", "--start", "-h", "-o", "%S", f"--jobs={job}")
        slurms = datetime.fromisoformat(squeue).replace(tzinfo=UTC)  # TZ=UTC: the tests' zone
        assert abs((expected - slurms).total_seconds()) < 60 and expected.timestamp() >= ends

        shown = f"{expected:%Y-%m-%d %H:%M:%S}"
        waited = tes_task(service.url, "wait", "--interval", "0.2", "--timeout", "1", task_id,
                          **login)  # fmt: skip
        assert waited.returncode == 7
        assert f"Slurm expects it to start at {shown} UTC" in waited.stderr, waited.stderr
        listed = tes_task(service.url, "list", "--name-prefix", name, **login).stdout
        assert f"start {shown}" in listed, listed

        _sign_in(browser, service)
        browser.get(f"{service.url}/ui/#/task/{task_id}")
        cell = _until(
            browser, lambda d: d.find_element(By.CSS_SELECTOR, ".attempt .expected-start")
        )
        assert cell.text.startswith("expected ") and "squeue --start" in cell.get_attribute("title")
        local = browser.execute_script(
            "return new Date(arguments[0]).getMinutes()",
            attempt["metadata"]["slurm_expected_start"],
        )
        assert f":{local:02d}:" in cell.text
    finally:
        requests.post(f"{service.api}/tasks/{task_id}:cancel", json={}, auth=ALICE, timeout=10)
