"""The web page's private JSON (`/ui-data/`): counts by state for everyone, owners for admins;
the TES task document never carries the owner."""

from __future__ import annotations

import base64
from pathlib import Path

from falcon import testing

from bridge.api.app import create_app
from bridge.config import load_config
from bridge.store import Store
from tests.fixtures.auth import PASSWORDS

API = "/ga4gh/tes/v1"
ALICE = ("tesalice", PASSWORDS["tesalice"])
BOB = ("tesbob", PASSWORDS["tesbob"])
ADMIN = ("tesadmin", PASSWORDS["tesadmin"])


def _auth(user: tuple[str, str]) -> dict[str, str]:
    token = base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def _client(tmp_path: Path, store: Store, htpasswd: Path) -> testing.TestClient:
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={
            "auth.mode": "basic",
            "auth.htpasswd_file": str(htpasswd),
            "auth.admin_users": ["tesadmin"],
        },
    )
    return testing.TestClient(create_app(config, store=store))


def _post(client: testing.TestClient, user: tuple[str, str], name: str, **tags: str) -> str:
    task = {"name": name, "tags": tags, "executors": [{"image": "alpine", "command": ["true"]}]}
    answer = client.simulate_post(f"{API}/tasks", json=task, headers=_auth(user))
    assert answer.status_code == 200, answer.text
    return str(answer.json["id"])


def test_counts_by_state_follow_the_filters_and_the_caller(
    tmp_path: Path, sqlite_store: Store, htpasswd: Path
) -> None:
    client = _client(tmp_path, sqlite_store, htpasswd)
    first = _post(client, ALICE, "wf-a-1", run="r1")
    _post(client, ALICE, "wf-a-2", run="r1")
    _post(client, ALICE, "other", run="r2")
    _post(client, BOB, "wf-b-1", run="r1")
    client.simulate_post(f"{API}/tasks/{first}:cancel", json={}, headers=_auth(ALICE))

    def summary(user: tuple[str, str], query: str = "") -> dict[str, object]:
        answer = client.simulate_get("/ui-data/summary", query_string=query, headers=_auth(user))
        assert answer.status_code == 200, answer.text
        return dict(answer.json)

    mine = summary(ALICE)
    assert mine == {"user": "tesalice", "admin": False, "counts": {"QUEUED": 2, "CANCELED": 1}}
    assert summary(ALICE, "tag_key=run&tag_value=r1")["counts"] == {"QUEUED": 1, "CANCELED": 1}
    assert summary(ALICE, "name_prefix=wf-")["counts"] == {"QUEUED": 1, "CANCELED": 1}
    everyone = summary(ADMIN, "tag_key=run&tag_value=r1")
    assert everyone["admin"] is True and everyone["counts"] == {"QUEUED": 2, "CANCELED": 1}
    assert client.simulate_get("/ui-data/summary").status_code == 401
    me = client.simulate_get("/ui-data/me", headers=_auth(ADMIN)).json
    assert me == {"user": "tesadmin", "admin": True}
    assert client.simulate_get("/ui-data/me", headers=_auth(BOB)).json["admin"] is False


def test_owners_are_for_admins_and_never_in_the_tes_document(
    tmp_path: Path, sqlite_store: Store, htpasswd: Path
) -> None:
    client = _client(tmp_path, sqlite_store, htpasswd)
    alices = _post(client, ALICE, "a")
    bobs = _post(client, BOB, "b")
    query = f"id={alices}&id={bobs}&id=no-such-task"
    answer = client.simulate_get("/ui-data/owners", query_string=query, headers=_auth(ADMIN))
    assert answer.status_code == 200
    assert answer.json == {"owners": {alices: "tesalice", bobs: "tesbob"}}
    refused = client.simulate_get("/ui-data/owners", query_string=query, headers=_auth(ALICE))
    assert refused.status_code == 403 and "admin" in refused.json["message"]
    assert client.simulate_get("/ui-data/owners", query_string=query).status_code == 401
    for view in ("MINIMAL", "BASIC", "FULL"):
        task = client.simulate_get(
            f"{API}/tasks/{alices}", params={"view": view}, headers=_auth(ADMIN)
        ).json
        assert "owner" not in task and "tesalice" not in str(task)
