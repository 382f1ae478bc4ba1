"""The web page's operator views in a real browser (Debian's headless Chromium through
Selenium), on the real cluster: a workflow of 50 short tasks shown as a list with counts by
state, owners (for an admin), job ids, durations and exit codes, with its filters in the
address; its timeline and resource picture; a task's efficiency and peak memory; and live
output that follows its end. Each step's screenshot is saved in the test's temporary directory
(printed), and the test reads the screenshots' pixels for the drawn bars."""

from __future__ import annotations

import struct
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import requests
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.cluster.test_webui import (  # noqa: F401 (browser: a fixture)
    XSS_NAME,
    _get,
    _post,
    _rows,
    _until,
    _wait_state,
    browser,
)
from tests.fixtures.auth import PASSWORDS, write_htpasswd
from tests.fixtures.service import TERMINAL, BridgeService, start_bridge_service

pytestmark = pytest.mark.cluster

ADMIN = ("tesadmin", PASSWORDS["tesadmin"])
ALICE = ("tesalice", PASSWORDS["tesalice"])
BOB = ("tesbob", PASSWORDS["tesbob"])
WORKFLOW_SIZE = 50
#: The timeline's colours (style.css): a task waiting, a COMPLETE task's job running.
QUEUED_RGB = (0xD0, 0xD7, 0xDE)
COMPLETE_RGB = (0x2D, 0xA4, 0x4E)
FAILED_RGB = (0xCF, 0x22, 0x2E)


@pytest.fixture(scope="module")
def service(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BridgeService]:
    root = tmp_path_factory.mktemp("webui-workflow")
    htpasswd = write_htpasswd(root / "htpasswd")
    extra = f'[auth]\nmode = "basic"\nhtpasswd_file = "{htpasswd}"\nadmin_users = ["tesadmin"]\n'
    with start_bridge_service(local_cluster, root, extra_toml=extra) as service:
        yield service


def _wait_all(service: BridgeService, ids: list[str], timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    tasks: dict[str, Any] = {}
    for task_id in ids:
        while (task := _get(service, task_id, ADMIN))["state"] not in TERMINAL:
            assert time.monotonic() < deadline, f"{task_id} still {task['state']}"
            time.sleep(0.5)
        tasks[task_id] = task
    return tasks


def _sign_in(driver: WebDriver, service: BridgeService, user: tuple[str, str], hash_: str) -> None:
    driver.get(f"{service.url}/ui/{hash_}")
    _until(driver, lambda d: d.find_element(By.ID, "login").is_displayed())
    driver.find_element(By.ID, "login-user").send_keys(user[0])
    driver.find_element(By.ID, "login-password").send_keys(user[1])
    driver.find_element(By.ID, "login-submit").click()


def _loaded(driver: WebDriver, count: int) -> None:
    _until(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")) == count)


def _cells(driver: WebDriver, css: str) -> dict[str, str]:
    """Each listed task's cell of class `css`: id -> text."""
    return {
        row.get_attribute("data-id"): row.find_element(By.CSS_SELECTOR, f"td.{css}").text
        for row in driver.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")
    }


# ---------------------------------------------------------------------------- screenshots
def _png_pixels(data: bytes) -> tuple[int, int, int, list[bytes]]:
    """Width, height, bytes per pixel and the rows of an 8-bit RGB(A) PNG (Chromium's)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, idat, header = 8, b"", b""
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        chunk = data[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            header = chunk
        elif kind == b"IDAT":
            idat += chunk
        position += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    step = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * step
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - step] if x >= step else 0
            up = previous[x]
            corner = previous[x - step] if x >= step else 0
            if kind == 1:
                line[x] = (line[x] + left) & 0xFF
            elif kind == 2:
                line[x] = (line[x] + up) & 0xFF
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 0xFF
            elif kind == 4:
                guess = left + up - corner
                pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
                near = left if pa <= pb and pa <= pc else (up if pb <= pc else corner)
                line[x] = (line[x] + near) & 0xFF
        rows.append(bytes(line))
        previous = line
    return width, height, step, rows


def _colour_count(png: bytes, rgb: tuple[int, int, int], tolerance: int = 12) -> int:
    """How many pixels of the screenshot are of colour `rgb` (give or take antialiasing)."""
    width, _, step, rows = _png_pixels(png)
    count = 0
    for line in rows:
        for x in range(0, width * step, step):
            if all(abs(line[x + i] - rgb[i]) <= tolerance for i in range(3)):
                count += 1
    return count


# ---------------------------------------------------------------------------- the test
def test_a_workflow_of_50_tasks_in_a_real_browser(
    service: BridgeService,
    browser: WebDriver,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    run = uuid.uuid4().hex[:8]
    tag = f"wf-run={run}"
    ids: list[str] = []
    for index in range(WORKFLOW_SIZE):
        # Every tenth sleeps a second; one fails with exit code 3; one has a hostile name;
        # the last five are Bob's, so that an admin sees two owners.
        command = ["sh", "-c", "sleep 1"] if index % 10 == 0 else ["true"]
        if index == 7:
            command = ["sh", "-c", "exit 3"]
        owner = BOB if index >= WORKFLOW_SIZE - 5 else ALICE
        ids.append(_post(service, owner, {
            "name": XSS_NAME if index == 3 else f"wf-{run}-{index:02d}",
            "tags": {"wf-run": run},
            "resources": {"cpu_cores": 1, "ram_gb": 0.25},
            "executors": [{"image": "alpine", "command": command}],
        }))  # fmt: skip
    failing, hostile, short = ids[7], ids[3], ids[1]
    tasks = _wait_all(service, ids)
    assert {tasks[i]["state"] for i in ids if i != failing} == {"COMPLETE"}
    assert tasks[failing]["state"] == "EXECUTOR_ERROR"
    shots: list[Path] = []

    def shot(name: str) -> bytes:
        shots.append(tmp_path / f"{len(shots) + 1:02d}-{name}.png")
        browser.save_screenshot(str(shots[-1]))
        return shots[-1].read_bytes()

    print(f"\nscreenshots in {tmp_path}")
    # The filters come from the address: a bookmarked list opens as it was.
    list_hash = f"#/?tag={quote(tag)}&size=200"
    _sign_in(browser, service, ADMIN, list_hash)
    _loaded(browser, WORKFLOW_SIZE)
    browser.find_element(By.ID, "auto-refresh").click()  # every task is final: rows stay put
    assert browser.find_element(By.ID, "filter-tag").get_attribute("value") == tag
    assert browser.find_element(By.ID, "filter-size").get_attribute("value") == "200"
    rows = _rows(browser)
    assert set(rows) == set(ids) and rows[hostile][0] == XSS_NAME
    # Counts by state, for the same filters.
    counts = browser.find_element(By.ID, "state-counts").text
    assert f"all {WORKFLOW_SIZE}" in counts and "COMPLETE 49" in counts
    assert "EXECUTOR_ERROR 1" in counts
    # The admin's owner column; job ids, durations, exit codes, times with their zone.
    assert browser.find_element(By.ID, "owner-head").is_displayed()
    owners = _cells(browser, "owner")
    assert owners[ids[0]] == "tesalice" and owners[ids[-1]] == "tesbob"
    jobs = _cells(browser, "job")
    assert all(jobs[i] == tasks[i]["logs"][-1]["metadata"]["slurm_job_id"] for i in ids)
    exits = _cells(browser, "exit")
    assert exits[failing] == "3" and {exits[i] for i in ids if i != failing} == {"0"}
    # Why the one failure failed, in its own column: the others have no reason to give.
    reasons = _cells(browser, "reason")
    assert reasons[failing] == "exit 3" and {reasons[i] for i in ids if i != failing} == {""}
    assert all(_cells(browser, "duration")[i].endswith("s") for i in ids)
    created = _cells(browser, "created")[ids[0]]
    assert created.endswith(" UTC"), created  # the suite's browser runs in UTC
    assert browser.find_elements(By.CSS_SELECTOR, "#tasks img, #tasks script") == []
    shot("workflow-list")

    # A count is a link to that state's list; the address keeps it, a reload too.
    browser.find_element(By.CSS_SELECTOR, '#state-counts a[data-state="EXECUTOR_ERROR"]').click()
    _loaded(browser, 1)
    assert "state=EXECUTOR_ERROR" in browser.current_url
    browser.refresh()
    _loaded(browser, 1)
    assert list(_rows(browser)) == [failing]
    assert browser.find_element(By.ID, "filter-state").get_attribute("value") == "EXECUTOR_ERROR"

    # The workflow: every task's waiting and running spans, and requested against used.
    browser.get(f"{service.url}/ui/#/workflow?tag={quote(tag)}")
    _until(browser, lambda d: d.find_element(By.ID, "workflow-view").get_attribute("data-loaded"))
    bars = browser.find_elements(By.CSS_SELECTOR, "#timeline-chart g.tl-row")
    assert {bar.get_attribute("data-id") for bar in bars} == set(ids)
    for bar in bars:
        assert bar.find_elements(By.CSS_SELECTOR, "rect.tl-queued")
        assert bar.find_elements(By.CSS_SELECTOR, "rect.tl-run")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline-chart rect.tl-COMPLETE")) == 49
    assert len(browser.find_elements(By.CSS_SELECTOR, "#resource-chart g.res-row")) == 50
    summary = browser.find_element(By.ID, "workflow-summary").text
    assert summary.startswith(f"{WORKFLOW_SIZE} tasks (49 COMPLETE, 1 EXECUTOR_ERROR)"), summary
    assert "CPU efficiency" in summary and "memory efficiency" in summary
    resources = browser.find_elements(By.CSS_SELECTOR, "#resources tbody tr")
    assert len(resources) == WORKFLOW_SIZE
    why = {
        r.get_attribute("data-id"): r.find_element(By.CSS_SELECTOR, "td.reason").text
        for r in resources
    }
    assert why[failing] == "exit 3" and {why[i] for i in ids if i != failing} == {""}
    assert browser.find_elements(By.CSS_SELECTOR, "#timeline img, #resources img") == []
    assert browser.execute_script("return window.__pwned") is None
    # The screenshot shows the bars: waiting grey, COMPLETE green and the one failure red.
    timeline = browser.find_element(By.ID, "timeline-chart")
    picture = shot("workflow-timeline")  # the summary line and the top of the timeline
    element = timeline.screenshot_as_png
    (tmp_path / "timeline-element.png").write_bytes(element)
    assert _colour_count(element, COMPLETE_RGB) > 49 * 4
    assert _colour_count(element, QUEUED_RGB) > 50 * 4
    assert _colour_count(element, FAILED_RGB) > 4
    assert _colour_count(picture, COMPLETE_RGB) > 0
    browser.execute_script(
        "arguments[0].scrollIntoView()", browser.find_element(By.ID, "resource-chart")
    )
    shot("workflow-resources")

    # A short task's page: its peak memory from the cgroup (sacct's MaxRSS is 0 or absent for
    # a job shorter than its accounting sample) and its efficiency; the owner for the admin.
    metadata = tasks[short]["logs"][-1]["metadata"]
    browser.get(f"{service.url}/ui/#/task/{short}")
    attempt = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".attempt"))
    peak = int(metadata["memory_peak_bytes"])
    rss = browser.find_element(By.CSS_SELECTOR, ".attempt .max-rss").text
    assert rss != "0 B" and "Max RSS\n0 B" not in attempt.text
    if int(metadata.get("slurm_max_rss_bytes", "0")) == 0:
        assert rss.endswith("(the job's cgroup peak)"), rss
        assert f"{peak / 2**20:.1f} MiB" in rss or f"{peak / 2**10:.1f} KiB" in rss, (rss, peak)
    cpu = browser.find_element(By.CSS_SELECTOR, ".attempt .cpu-efficiency").text
    assert cpu.endswith("s)") and "%" in cpu, cpu
    memory = browser.find_element(By.CSS_SELECTOR, ".attempt .memory-efficiency").text
    assert "256.0 MiB requested" in memory, memory
    assert browser.find_element(By.ID, "task-owner").text == "tesalice"
    # Its tag leads to the workflow.
    link = browser.find_element(By.CSS_SELECTOR, "#task-tags a")
    assert link.text == tag and link.get_attribute("href").endswith(f"#/workflow?tag={quote(tag)}")
    browser.execute_script("arguments[0].scrollIntoView()", attempt)
    shot("task-efficiency")

    # Alice sees neither the owner column nor owners (the API says so too).
    browser.find_element(By.ID, "sign-out").click()
    _sign_in(browser, service, ALICE, list_hash)
    _loaded(browser, WORKFLOW_SIZE - 5)
    browser.find_element(By.ID, "auto-refresh").click()
    assert not browser.find_element(By.ID, "owner-head").is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, "#tasks td.owner") == []
    refused = requests.get(
        f"{service.url}/ui-data/owners", params={"id": ids[0]}, auth=ALICE, timeout=10
    )
    assert refused.status_code == 403
    shot("workflow-list-as-user")
    assert all(path.stat().st_size > 0 for path in shots)


def test_live_output_follows_its_end(
    service: BridgeService,
    browser: WebDriver,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    script = (
        "i=0; while [ $i -lt 400 ]; do i=$((i+1)); echo line $i; done;"
        " while [ $i -lt 700 ]; do i=$((i+1)); echo line $i; sleep 1; done"
    )
    task_id = _post(service, ALICE, {
        "name": "webui-follow", "executors": [{"image": "alpine", "command": ["sh", "-c", script]}],
    })  # fmt: skip
    try:
        _sign_in(browser, service, ALICE, f"#/task/{task_id}")
        live = _until(
            browser,
            lambda d: (
                "line 400" in d.find_element(By.CSS_SELECTOR, "pre.live-stdout").text
                and d.find_element(By.CSS_SELECTOR, "pre.live-stdout")
            ),
            timeout=180,
        )

        def at_end() -> bool:
            return bool(
                browser.execute_script(
                    "const p = arguments[0];"
                    "return p.scrollHeight > p.clientHeight"
                    " && p.scrollTop + p.clientHeight >= p.scrollHeight - 4;",
                    live,
                )
            )

        _until(browser, lambda d: at_end())
        browser.save_screenshot(str(tmp_path / "live-output-follows.png"))
        print(f"\nscreenshot in {tmp_path}")
        # New lines keep it at the end.
        seen = live.text
        _until(browser, lambda d: live.text != seen, timeout=20)
        assert at_end()
        # Scrolled up by the reader, it stays there while lines arrive.
        browser.execute_script("arguments[0].scrollTop = 100", live)
        seen = live.text
        _until(browser, lambda d: live.text != seen, timeout=20)
        assert browser.execute_script("return arguments[0].scrollTop", live) == 100
        assert not at_end()
        # Canceled, its output no longer grows: the page opened again shows its end.
        requests.post(f"{service.api}/tasks/{task_id}:cancel", json={}, auth=ALICE, timeout=10)
        _wait_state(service, task_id, {"CANCELED"})
        browser.refresh()
        live = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "pre.live-stdout"))
        _until(browser, lambda d: "line 400" in live.text and at_end())
    finally:
        requests.post(f"{service.api}/tasks/{task_id}:cancel", json={}, auth=ALICE, timeout=10)
