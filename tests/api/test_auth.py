"""Authentication and task owners: modes none, basic (htpasswd, bcrypt) and bearer (JWTs
checked against a JWKS served over real HTTP), isolation between owners, and the real server
under gunicorn with py-tes (`token=` and `user=`/`password=`)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import jwt
import pytest
import requests
import tes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from falcon import testing

from bridge.api.app import create_app
from bridge.api.auth import AuthError, BasicAuth, build_authenticator
from bridge.config import Config, ConfigError, load_config
from bridge.store import Store
from bridge.system.users import AdminPolicy, UnknownUser, UserMap
from tests.fixtures.auth import (
    AUDIENCE,
    OIDC,
    PASSWORDS,
    UnixUsers,
    basic_auth_toml,
    bearer_auth_toml,
    write_htpasswd,
)
from tests.fixtures.service import serve_api_only
from tests.procs import free_port

TASK = {"executors": [{"image": "alpine", "command": ["true"]}]}
API = "/ga4gh/tes/v1"


def _config(tmp_path: Path, **overrides: Any) -> Config:
    return load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={f"auth.{k}": v for k, v in overrides.items()},
    )


def _basic(user: str, password: str) -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def basic_client(tmp_path: Path, sqlite_store: Store, htpasswd: Path) -> testing.TestClient:
    config = _config(tmp_path, mode="basic", htpasswd_file=str(htpasswd), admin_users=["tesadmin"])
    return testing.TestClient(create_app(config, store=sqlite_store))


def _bearer_config(tmp_path: Path, oidc: OIDC, **extra: Any) -> Config:
    return _config(
        tmp_path,
        mode="bearer",
        issuer=oidc.issuer,
        audience=AUDIENCE,
        jwks_url=oidc.jwks_url,
        **extra,
    )


@pytest.fixture
def bearer_client(tmp_path: Path, sqlite_store: Store, oidc: OIDC) -> testing.TestClient:
    config = _bearer_config(tmp_path, oidc)
    return testing.TestClient(create_app(config, store=sqlite_store))


# ------------------------------------------------------------------------------ mode none
def test_mode_none_ignores_the_authorization_header(client: testing.TestClient):
    # py-tes 0.4 sends `Basic None:None` whatever the server wants.
    headers = _basic("None", "None")
    created = client.simulate_post(f"{API}/tasks", json=TASK, headers=headers)
    assert created.status_code == 200
    task_id = created.json["id"]
    assert client.simulate_get(f"{API}/tasks/{task_id}", headers=headers).status_code == 200
    assert client.simulate_get(f"{API}/tasks/{task_id}").status_code == 200


def test_site_mode_needs_authentication(tmp_path: Path):
    with pytest.raises(ConfigError, match="run_as_owner"):
        load_config(environ={}, overrides={"site.run_as_owner": True})
    with pytest.raises(ConfigError, match="htpasswd_file"):
        _config(tmp_path, mode="basic")
    with pytest.raises(ConfigError, match="issuer and audience"):
        _config(tmp_path, mode="bearer", issuer="https://x")
    with pytest.raises(ConfigError, match="asymmetric"):
        _config(tmp_path, mode="bearer", issuer="https://x", audience="a", algorithms=["HS256"])


def test_serve_refuses_mode_none_on_a_public_address(tmp_path: Path):
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    argv = [sys.executable, "-m", "bridge", "--config", str(config), "serve", "--no-poller"]
    refused = subprocess.run(
        [*argv, "--bind", f"0.0.0.0:{free_port()}"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2
    assert "without authentication" in refused.stderr and "loopback" in refused.stderr


# ------------------------------------------------------------------------------ basic
def test_basic_auth(basic_client: testing.TestClient):
    missing = basic_client.simulate_get(f"{API}/tasks")
    assert missing.status_code == 401
    assert missing.headers["WWW-Authenticate"].startswith("Basic realm=")
    wrong_password = basic_client.simulate_get(f"{API}/tasks", headers=_basic("tesalice", "x"))
    unknown_user = basic_client.simulate_get(f"{API}/tasks", headers=_basic("nobody", "x"))
    # Neither answer tells which part was wrong.
    assert wrong_password.status_code == unknown_user.status_code == 401
    assert wrong_password.json == unknown_user.json == missing.json
    # An entry that is not bcrypt is never compared as plain text.
    plain = basic_client.simulate_get(f"{API}/tasks", headers=_basic("plainuser", "plaintext"))
    assert plain.status_code == 401
    bearer = basic_client.simulate_get(f"{API}/tasks", headers=_bearer("abc"))
    assert bearer.status_code == 401
    good = _basic("tesalice", PASSWORDS["tesalice"])
    assert basic_client.simulate_get(f"{API}/tasks", headers=good).status_code == 200
    assert basic_client.simulate_post(f"{API}/tasks", json=TASK, headers=good).status_code == 200


def test_service_info_and_openapi_stay_public(basic_client: testing.TestClient):
    for path in (f"{API}/service-info", "/v1/tasks/service-info", f"{API}/openapi.json"):
        assert basic_client.simulate_get(path).status_code == 200, path
    assert basic_client.simulate_post(f"{API}/tasks", json=TASK).status_code == 401
    assert basic_client.simulate_get(f"{API}/tasks/x").status_code == 401
    assert basic_client.simulate_post(f"{API}/tasks/x:cancel").status_code == 401
    # Only those exact paths: a task id that looks like a document needs credentials (it once
    # went through without an identity and answered 500).
    for path in (f"{API}/tasks/openapi.json", f"{API}/tasks/service-info", "/v1/x/openapi.json"):
        assert basic_client.simulate_get(path).status_code == 401, path


def test_htpasswd_changes_apply_without_restart(
    tmp_path: Path, sqlite_store: Store, htpasswd: Path
):
    config = _config(tmp_path, mode="basic", htpasswd_file=str(htpasswd))
    client = testing.TestClient(create_app(config, store=sqlite_store))
    headers = _basic("tesbob", PASSWORDS["tesbob"])
    assert client.simulate_get(f"{API}/tasks", headers=headers).status_code == 200
    time.sleep(0.01)
    write_htpasswd(htpasswd, {"tesalice": PASSWORDS["tesalice"]})
    assert client.simulate_get(f"{API}/tasks", headers=headers).status_code == 401


def _refusal_seconds(authenticator: Any, header: dict[str, str]) -> float:
    """The fastest of a few refusals: the least noisy measure of the work a refusal costs."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        with pytest.raises(AuthError):
            authenticator.authenticate(header["Authorization"])
        times.append(time.perf_counter() - start)
    return min(times)


def test_unknown_users_take_as_long_to_refuse_as_wrong_passwords(tmp_path: Path):
    # The dummy hash an unknown name is checked against has the cost of the file's own hashes
    # (8 here), so timing does not tell which names exist.
    path = tmp_path / "htpasswd"
    hashed = bcrypt.hashpw(b"alice-secret", bcrypt.gensalt(rounds=8)).decode()
    path.write_text(f"tesalice:{hashed}\n")
    authenticator = BasicAuth(path, UserMap(), AdminPolicy(), "tes")
    known = _refusal_seconds(authenticator, _basic("tesalice", "wrong"))
    unknown = _refusal_seconds(authenticator, _basic("nobody", "wrong"))
    assert 0.5 < unknown / known < 2, (known, unknown)


def test_passwords_over_72_bytes_are_compared_as_htpasswd_stores_them(
    tmp_path: Path, sqlite_store: Store
):
    # htpasswd -B (and Apache) hash the first 72 bytes of a longer password; so does the bridge,
    # and a long wrong password is a 401, never a 500.
    long_password = "p" * 72 + "-and-more"
    path = tmp_path / "htpasswd"
    hashed = bcrypt.hashpw(long_password.encode()[:72], bcrypt.gensalt(rounds=5)).decode()
    path.write_text(f"tesalice:{hashed}\n")
    config = _config(tmp_path, mode="basic", htpasswd_file=str(path))
    client = testing.TestClient(create_app(config, store=sqlite_store))

    def status(user: str, password: str) -> int:
        return client.simulate_get(f"{API}/tasks", headers=_basic(user, password)).status_code

    assert status("tesalice", long_password) == 200
    assert status("tesalice", "q" * 100) == 401
    assert status("nobody", "q" * 100) == 401


# ------------------------------------------------------------------------------ bearer
def _unsigned(claims: dict[str, Any], kid: str) -> str:
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none', 'typ': 'JWT', 'kid': kid})}.{part(claims)}."


def test_bearer_tokens(bearer_client: testing.TestClient, oidc: OIDC):
    def status(token: str) -> int:
        return bearer_client.simulate_get(f"{API}/tasks", headers=_bearer(token)).status_code

    assert status(oidc.token("tesalice")) == 200
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = int(time.time())
    claims = {"sub": "tesalice", "aud": AUDIENCE, "iss": oidc.issuer, "exp": now + 300}
    public_pem = (
        oidc.key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    refused = {
        "expired": oidc.token("tesalice", expires_in=-120),
        "wrong audience": oidc.token("tesalice", audience="another-service"),
        "wrong issuer": oidc.token("tesalice", issuer="https://evil.example.org"),
        "wrong signature": oidc.token("tesalice", key=stranger),
        "alg none": _unsigned(claims, oidc.kid),
        # The public key used as an HMAC secret (the classic algorithm confusion).
        "HS256 with the public key": _hs256(claims, public_pem, oidc.kid),
        "no exp": _without_exp(oidc),
        "unknown kid": oidc.token("tesalice", key=stranger, kid="nobody-knows"),
        "not a JWT": "abc.def.ghi",
    }
    for what, token in refused.items():
        answer = bearer_client.simulate_get(f"{API}/tasks", headers=_bearer(token))
        assert answer.status_code == 401, what
        assert answer.headers["WWW-Authenticate"].startswith("Bearer realm="), what
        assert answer.json["message"] == "authentication required", what
    missing = bearer_client.simulate_get(f"{API}/tasks")
    assert missing.status_code == 401 and "WWW-Authenticate" in missing.headers
    basic = bearer_client.simulate_get(f"{API}/tasks", headers=_basic("tesalice", "x"))
    assert basic.status_code == 401


def _hs256(claims: dict[str, Any], secret: str, kid: str) -> str:
    import hashlib
    import hmac

    def part(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    header = part(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    body = part(json.dumps(claims).encode())
    mac = hmac.new(secret.encode(), f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{part(mac)}"


def _without_exp(oidc: OIDC) -> str:
    import jwt

    claims = {"sub": "tesalice", "aud": AUDIENCE, "iss": oidc.issuer}
    return jwt.encode(claims, oidc.key, algorithm="RS256", headers={"kid": oidc.kid})


def test_new_signing_keys_are_fetched_and_keys_are_cached(
    tmp_path: Path, sqlite_store: Store, oidc: OIDC
):
    config = _bearer_config(tmp_path, oidc, jwks_refresh_cooldown_seconds=0)
    bearer_client = testing.TestClient(create_app(config, store=sqlite_store))
    headers = _bearer(oidc.token("tesalice"))
    assert bearer_client.simulate_get(f"{API}/tasks", headers=headers).status_code == 200
    before = len(oidc.jwks_requests)
    for _ in range(3):
        assert bearer_client.simulate_get(f"{API}/tasks", headers=headers).status_code == 200
    assert len(oidc.jwks_requests) == before  # cached
    key, kid = oidc.rotate()
    rotated = _bearer(oidc.token("tesalice", key=key, kid=kid))
    assert bearer_client.simulate_get(f"{API}/tasks", headers=rotated).status_code == 200
    assert len(oidc.jwks_requests) == before + 1


def test_a_key_removed_from_the_jwks_is_refused_after_the_cache_lifetime(
    tmp_path: Path, sqlite_store: Store, oidc: OIDC
):
    key, kid = oidc.rotate()
    config = _bearer_config(tmp_path, oidc, jwks_cache_seconds=1)
    bearer_client = testing.TestClient(create_app(config, store=sqlite_store))
    headers = _bearer(oidc.token("tesalice", key=key, kid=kid))
    assert bearer_client.simulate_get(f"{API}/tasks", headers=headers).status_code == 200
    oidc.keys[:] = [jwk for jwk in oidc.keys if jwk["kid"] != kid]  # the issuer revokes it
    time.sleep(1.5)
    assert bearer_client.simulate_get(f"{API}/tasks", headers=headers).status_code == 401
    still_good = _bearer(oidc.token("tesalice"))
    assert bearer_client.simulate_get(f"{API}/tasks", headers=still_good).status_code == 200


def test_a_token_whose_algorithm_does_not_fit_its_key_is_refused(
    bearer_client: testing.TestClient, oidc: OIDC
):
    # ES256 signature naming the issuer's RSA key: a 401, not a 500 from the key type mismatch.
    ec_key = ec.generate_private_key(ec.SECP256R1())
    now = int(time.time())
    claims = {"sub": "tesalice", "aud": AUDIENCE, "iss": oidc.issuer, "exp": now + 300}
    token = jwt.encode(claims, ec_key, algorithm="ES256", headers={"kid": oidc.kid})
    answer = bearer_client.simulate_get(f"{API}/tasks", headers=_bearer(token))
    assert answer.status_code == 401


def test_unknown_key_ids_do_not_hammer_the_issuer(bearer_client: testing.TestClient, oidc: OIDC):
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    good = _bearer(oidc.token("tesalice"))
    assert bearer_client.simulate_get(f"{API}/tasks", headers=good).status_code == 200
    before = len(oidc.jwks_requests)
    for i in range(5):
        forged = _bearer(oidc.token("tesalice", key=stranger, kid=f"forged-{i}"))
        assert bearer_client.simulate_get(f"{API}/tasks", headers=forged).status_code == 401
    assert len(oidc.jwks_requests) == before  # within the default 30 s cooldown


def _timed(authenticator: Any, token: str) -> tuple[str | None, float]:
    """(the user, or None when refused; seconds it took)."""
    started = time.monotonic()
    try:
        user = authenticator.authenticate(f"Bearer {token}").user
    except AuthError:
        user = None
    return user, time.monotonic() - started


def test_known_keys_keep_serving_while_the_jwks_endpoint_hangs(tmp_path: Path, oidc: OIDC):
    """Once the key set's lifetime had passed, a hanging JWKS endpoint held every request
    10-40 s (fetching inside it) and then refused it. Keys in hand serve on while one
    refresh runs in the background, and a new key is picked up once the endpoint answers."""
    from concurrent.futures import ThreadPoolExecutor

    config = _bearer_config(tmp_path, oidc, jwks_cache_seconds=1, jwks_refresh_cooldown_seconds=0)
    authenticator = build_authenticator(config)
    token = oidc.token("tesalice")
    assert _timed(authenticator, token)[0] == "tesalice"
    time.sleep(1.2)  # the set is past its lifetime
    oidc.release.clear()
    oidc.outage = "hang"
    try:
        before = len(oidc.jwks_requests)
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda _: _timed(authenticator, token), range(64)))
        assert [user for user, _ in results] == ["tesalice"] * 64
        assert max(seconds for _, seconds in results) < 3, results
        assert len(oidc.jwks_requests) == before + 1  # one refresh, in the background
        # A token naming a key nobody has seen waits for that same refresh, briefly.
        stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        forged = oidc.token("tesalice", key=stranger, kid="unknown")
        user, seconds = _timed(authenticator, forged)
        assert user is None and seconds < 7
        assert len(oidc.jwks_requests) == before + 1
        key, kid = oidc.rotate()
    finally:
        oidc.recover()
    try:
        deadline = time.monotonic() + 10
        rotated = oidc.token("tesbob", key=key, kid=kid)
        while _timed(authenticator, rotated)[0] != "tesbob":
            assert time.monotonic() < deadline, "the new key was never picked up"
            time.sleep(0.2)
        assert _timed(authenticator, token)[0] == "tesalice"
    finally:
        oidc.keys[:] = [jwk for jwk in oidc.keys if jwk["kid"] != kid]


def test_a_jwks_endpoint_answering_503_leaves_known_keys_working(tmp_path: Path, oidc: OIDC):
    config = _bearer_config(tmp_path, oidc, jwks_cache_seconds=1)
    authenticator = build_authenticator(config)
    token = oidc.token("tesalice")
    assert _timed(authenticator, token)[0] == "tesalice"
    time.sleep(1.2)
    oidc.outage = "503"
    try:
        before = len(oidc.jwks_requests)
        for _ in range(20):
            user, seconds = _timed(authenticator, token)
            assert user == "tesalice" and seconds < 2
        # One refresh, and no other within the cooldown (30 s).
        assert len(oidc.jwks_requests) == before + 1
    finally:
        oidc.recover()


def test_jwks_url_is_discovered_from_the_issuer(tmp_path: Path, sqlite_store: Store, oidc: OIDC):
    config = _config(tmp_path, mode="bearer", issuer=oidc.issuer, audience=AUDIENCE)
    client = testing.TestClient(create_app(config, store=sqlite_store))
    answer = client.simulate_get(f"{API}/tasks", headers=_bearer(oidc.token("tesbob")))
    assert answer.status_code == 200


def test_identity_mapping_file(tmp_path: Path, sqlite_store: Store, oidc: OIDC):
    mapping = tmp_path / "users.toml"
    mapping.write_text(
        '[users]\n"alice@example.org" = { user = "tesalice", account = "lab-a" }\n'
        '"bob@example.org" = "tesbob"\n'
    )
    config = _bearer_config(tmp_path, oidc, user_claim="email", user_map_file=str(mapping))
    client = testing.TestClient(create_app(config, store=sqlite_store))
    alice = _bearer(oidc.token("x", email="alice@example.org"))
    created = client.simulate_post(f"{API}/tasks", json=TASK, headers=alice)
    assert created.status_code == 200
    assert sqlite_store.get_task(created.json["id"]).owner == "tesalice"
    unknown = _bearer(oidc.token("x", email="mallory@example.org"))
    refused = client.simulate_get(f"{API}/tasks", headers=unknown)
    # A valid token of an identity with no local user: 403, saying why (the caller proved who).
    assert refused.status_code == 403
    assert refused.json["message"].startswith(
        "authenticated as 'mallory@example.org', but identity 'mallory@example.org' is not in "
        "the user mapping file: every caller, an administrator too, must be a local Unix user"
    )
    no_claim = _bearer(oidc.token("tesalice"))
    assert client.simulate_get(f"{API}/tasks", headers=no_claim).status_code == 401
    users = UserMap.load(mapping)
    assert users.account_for("tesalice") == "lab-a" and users.account_for("tesbob") is None


def test_identities_must_be_user_names_without_a_mapping_file(unix_users: UnixUsers):
    users = UserMap.load(None)
    assert users.resolve("tesalice").user == "tesalice"
    for bad in ("../etc", "-u", "Alice Smith", "a" * 40, ""):
        with pytest.raises(UnknownUser):
            users.resolve(bad)
    local = UserMap.load(None, require_local=True)
    assert local.resolve("tesalice").user == "tesalice"
    with pytest.raises(UnknownUser):
        local.resolve("no-such-user-here")
    with pytest.raises(UnknownUser):
        local.resolve("root")  # tasks never run as root
    admins = AdminPolicy(["tesadmin"], group=unix_users.group)
    assert admins.is_admin("tesadmin") and admins.is_admin("tesalice")
    assert not admins.is_admin(unix_users.outsider)


def test_an_admin_who_is_not_a_local_user_is_told_why(
    tmp_path: Path, sqlite_store: Store, htpasswd: Path
):
    """Site mode runs every task as a local user: an admin with no account here is a 403
    that says so (it was a bare 401, the reason in the server log only)."""
    write_htpasswd(htpasswd, {**PASSWORDS, "opsghost": "pw-ghost"})
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={
            "auth.mode": "basic",
            "auth.htpasswd_file": str(htpasswd),
            "auth.admin_users": ["tesadmin", "opsghost"],
            "site.run_as_owner": True,
        },
    )
    client = testing.TestClient(create_app(config, store=sqlite_store))
    answer = client.simulate_get(f"{API}/tasks", headers=_basic("opsghost", "pw-ghost"))
    assert answer.status_code == 403
    assert "user 'opsghost' does not exist on this host" in answer.json["message"]
    assert "administrator too, must be a local Unix user" in answer.json["message"]
    # A wrong password still says nothing of which part was wrong.
    wrong = client.simulate_get(f"{API}/tasks", headers=_basic("opsghost", "nope"))
    assert wrong.status_code == 401 and wrong.json["message"] == "authentication required"


def test_who_canceled_a_task_is_in_its_system_logs(
    basic_client: testing.TestClient, sqlite_store: Store, caplog: pytest.LogCaptureFixture
):
    """An admin's cancel runs scancel as the owner (sacct shows the owner): the task says who."""
    alice = _basic("tesalice", PASSWORDS["tesalice"])
    admin = _basic("tesadmin", PASSWORDS["tesadmin"])
    first = basic_client.simulate_post(f"{API}/tasks", json=TASK, headers=alice).json["id"]
    second = basic_client.simulate_post(f"{API}/tasks", json=TASK, headers=alice).json["id"]
    with caplog.at_level("INFO", logger="bridge.api"):
        assert (
            basic_client.simulate_post(f"{API}/tasks/{first}:cancel", headers=admin).status_code
            == 200
        )
    assert (
        basic_client.simulate_post(f"{API}/tasks/{second}:cancel", headers=alice).status_code == 200
    )

    def system_logs(task_id: str) -> list[str]:
        answer = basic_client.simulate_get(f"{API}/tasks/{task_id}?view=FULL", headers=alice)
        return answer.json["logs"][-1]["system_logs"]

    assert system_logs(first) == ["canceled by tesadmin (an administrator)"]
    assert system_logs(second) == ["canceled by tesalice"]
    assert f"task {first} canceled by tesadmin" in caplog.text
    # The lists (BASIC view) say who in the reason column.
    listed = basic_client.simulate_get(f"{API}/tasks?view=BASIC", headers=alice).json["tasks"]
    reasons = {t["id"]: t["logs"][-1]["metadata"]["reason"] for t in listed}
    assert reasons == {
        first: "canceled by tesadmin (an administrator)",
        second: "canceled by tesalice",
    }
    # A task that had ended is not canceled again, and says nothing more.
    basic_client.simulate_post(f"{API}/tasks/{first}:cancel", headers=alice)
    assert system_logs(first) == ["canceled by tesadmin (an administrator)"]


# ------------------------------------------------------------------------------ isolation
def test_owners_see_get_list_and_cancel_only_their_own_tasks(
    basic_client: testing.TestClient, sqlite_store: Store
):
    alice = _basic("tesalice", PASSWORDS["tesalice"])
    bob = _basic("tesbob", PASSWORDS["tesbob"])
    admin = _basic("tesadmin", PASSWORDS["tesadmin"])
    alice_id = basic_client.simulate_post(f"{API}/tasks", json=TASK, headers=alice).json["id"]
    bob_id = basic_client.simulate_post(f"{API}/tasks", json=TASK, headers=bob).json["id"]
    assert sqlite_store.get_task(alice_id).owner == "tesalice"

    def listed(headers: dict[str, str]) -> set[str]:
        answer = basic_client.simulate_get(f"{API}/tasks", headers=headers)
        return {t["id"] for t in answer.json["tasks"]}

    assert listed(alice) == {alice_id} and listed(bob) == {bob_id}
    assert listed(admin) == {alice_id, bob_id}
    # Another owner's task answers exactly as an unknown one: 404, not 403.
    other = basic_client.simulate_get(f"{API}/tasks/{alice_id}", headers=bob)
    unknown = basic_client.simulate_get(f"{API}/tasks/no-such-task", headers=bob)
    assert other.status_code == unknown.status_code == 404
    assert basic_client.simulate_post(f"{API}/tasks/{alice_id}:cancel", headers=bob).status_code
    assert sqlite_store.get_task(alice_id).state == "QUEUED"
    full = basic_client.simulate_get(f"{API}/tasks/{alice_id}?view=FULL", headers=alice)
    assert full.status_code == 200
    cancel = basic_client.simulate_post(f"{API}/tasks/{bob_id}:cancel", headers=admin)
    assert cancel.status_code == 200
    assert sqlite_store.get_task(bob_id).state == "CANCELED"


# ------------------------------------------------------------------------------ real server
@pytest.fixture
def bearer_server(tmp_path: Path, oidc: OIDC) -> Iterator[str]:
    with serve_api_only(tmp_path, bearer_auth_toml(oidc)) as url:
        yield url


@pytest.fixture
def basic_server(tmp_path: Path) -> Iterator[str]:
    with serve_api_only(tmp_path, basic_auth_toml(write_htpasswd(tmp_path / "htpasswd"))) as url:
        yield url


def _py_tes_round(client: tes.HTTPClient, other: tes.HTTPClient) -> None:
    task_id = client.create_task(tes.Task(executors=[tes.Executor(image="alpine", command=["x"])]))
    assert client.get_task(task_id).state == "QUEUED"
    assert task_id in {t.id for t in client.list_tasks().tasks}
    assert task_id not in {t.id for t in other.list_tasks().tasks or []}
    with pytest.raises(requests.HTTPError) as refused:
        other.get_task(task_id)
    assert refused.value.response.status_code == 404
    client.cancel_task(task_id)
    assert client.get_task(task_id).state == "CANCELED"


def test_py_tes_with_a_token(bearer_server: str, oidc: OIDC):
    alice = tes.HTTPClient(bearer_server, token=oidc.token("tesalice"))
    bob = tes.HTTPClient(bearer_server, token=oidc.token("tesbob"))
    _py_tes_round(alice, bob)
    with pytest.raises(requests.HTTPError) as refused:
        tes.HTTPClient(bearer_server, token=oidc.token("tesalice", expires_in=-300)).list_tasks()
    assert refused.value.response.status_code == 401
    assert tes.HTTPClient(bearer_server).get_service_info().name


def test_py_tes_with_user_and_password(basic_server: str):
    alice = tes.HTTPClient(basic_server, user="tesalice", password=PASSWORDS["tesalice"])
    bob = tes.HTTPClient(basic_server, user="tesbob", password=PASSWORDS["tesbob"])
    _py_tes_round(alice, bob)
    with pytest.raises(requests.HTTPError) as refused:
        tes.HTTPClient(basic_server, user="tesalice", password="wrong").list_tasks()
    assert refused.value.response.status_code == 401


def test_site_mode_slurm_account_comes_from_the_task_then_the_mapping_then_the_default(
    tmp_path: Path, sqlite_store: Store, htpasswd: Path
):
    from bridge.poller import Poller

    mapping = tmp_path / "users.toml"
    mapping.write_text('[users]\nalice = { user = "tesalice", account = "lab-a" }\n')
    config = load_config(
        environ={"TES_BRIDGE_STATE_DIR": str(tmp_path / "state")},
        overrides={
            "auth.mode": "basic",
            "auth.htpasswd_file": str(htpasswd),
            "auth.user_map_file": str(mapping),
            "site.run_as_owner": True,
            "site.default_account": "general",
        },
    )
    poller = Poller(config, sqlite_store, slurm_client=None, images=None)  # type: ignore[arg-type]
    own = {"resources": {"backend_parameters": {"Account": "mine"}}}
    assert poller.owners is not None
    assert poller.owners.account_args("tesalice", TASK) == ["--account=lab-a"]
    assert poller.owners.account_args("tesbob", TASK) == ["--account=general"]
    assert poller.owners.account_args("tesalice", own) == []  # the task's #SBATCH line decides
    assert poller.owners.account_args(None, TASK) == []
