"""The web page's files: public, fixed, with a Content-Security-Policy that forbids inline
script; the data behind them stays behind the API's authentication. (The page itself is
driven in a real browser in tests/cluster/test_webui.py.)"""

from __future__ import annotations

import re
from pathlib import Path

from falcon import testing

from bridge.api.app import create_app
from bridge.api.ui import FILES
from bridge.config import load_config
from bridge.store import Store


def _basic_client(tmp_path: Path, store: Store, htpasswd: Path) -> testing.TestClient:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={"auth.mode": "basic", "auth.htpasswd_file": str(htpasswd)},
    )
    return testing.TestClient(create_app(config, store=store))


def test_the_page_is_public_and_its_data_is_not(tmp_path, sqlite_store, htpasswd):
    client = _basic_client(tmp_path, sqlite_store, htpasswd)
    for path in ("/", "/ui"):
        answer = client.simulate_get(path)
        assert answer.status_code == 302 and answer.headers["location"] == "ui/"
    for name, content_type in FILES.items():
        answer = client.simulate_get(f"/ui/{name}")
        assert answer.status_code == 200
        assert answer.headers["content-type"] == content_type
        assert "script-src 'self'" in answer.headers["content-security-policy"]
        assert answer.headers["x-content-type-options"] == "nosniff"
    assert client.simulate_get("/ui/").text == client.simulate_get("/ui/index.html").text
    assert client.simulate_get("/ga4gh/tes/v1/tasks").status_code == 401


def test_only_the_pages_own_files_are_served(client):
    for path in ("/ui/../bridge/api/app.py", "/ui/%2e%2e/setup.py", "/ui/app.py", "/ui/webui"):
        assert client.simulate_get(path).status_code == 404, path


def test_the_page_has_no_inline_script_or_style_and_no_html_from_data():
    webui = Path(__file__).resolve().parents[2] / "bridge" / "api" / "webui"
    html = (webui / "index.html").read_text()
    assert re.findall(r"<script[^>]*>", html) == ['<script src="app.js" defer>']
    assert "<style" not in html and " style=" not in html
    assert re.search(r"<[^>]*\son\w+=", html) is None  # no inline event handler
    script = (webui / "app.js").read_text()
    # Data reaches the page as text nodes only.
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


def test_an_unchanged_file_is_not_sent_again(client):
    first = client.simulate_get("/ui/app.js")
    again = client.simulate_get("/ui/app.js", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
