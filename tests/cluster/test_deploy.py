"""The production files in deploy/: the systemd units pass the real `systemd-analyze verify`
and score well in `systemd-analyze security`; the nginx site, run by real nginx with a
certificate made here, carries the API over TLS to py-tes; logrotate accepts and applies
the log rotation."""

from __future__ import annotations

import datetime
import ipaddress
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import tes
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bridge.config import LimitsConfig, ServerConfig
from tests.fixtures.nginx import private_nginx
from tests.fixtures.service import BridgeService, start_bridge_service
from tests.procs import free_port

pytestmark = pytest.mark.cluster

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = ["tes-bridge-api.service", "tes-bridge-poller.service"]
TES_BRIDGE = str(Path(sys.executable).with_name("tes-bridge"))


# ------------------------------------------------------------------------------------ systemd
def _install_units(root: Path, *, site_mode: bool = False) -> Path:
    """The shipped units, with the tes-bridge of this environment (verify checks that
    ExecStart exists and is executable)."""
    for unit in UNITS:
        text = (DEPLOY / "systemd" / unit).read_text()
        (root / unit).write_text(text.replace("/opt/tes-bridge/bin/tes-bridge", TES_BRIDGE))
    if site_mode:
        shutil.copytree(
            DEPLOY / "systemd" / "tes-bridge-poller.service.d",
            root / "tes-bridge-poller.service.d",
        )
    return root


def _exposure(unit: Path) -> float:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        cwd=unit.parent,
    )
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    return float(found.group(1))


def test_systemd_units_pass_verify(tmp_path: Path) -> None:
    root = _install_units(tmp_path)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *UNITS],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert result.returncode == 0, result.stderr
    # verify also prints trouble in other units of the host: none may be about ours.
    ours = [line for line in result.stderr.splitlines() if "tes-bridge" in line]
    assert not ours, result.stderr


def test_systemd_units_are_hardened(tmp_path: Path) -> None:
    root = _install_units(tmp_path)
    api, poller = (_exposure(root / unit) for unit in UNITS)
    # systemd's scale: 0 (locked down) to 10 (exposed); below 2 is "OK"-to-good, 4 still OK.
    assert api <= 2.0, api
    assert poller <= 4.5, poller
    for unit in UNITS:
        text = (root / unit).read_text()
        for setting in ("User=tesbridge", "NoNewPrivileges=yes", "ProtectSystem=strict"):
            assert setting in text, (unit, setting)
        assert "ReadWritePaths=/var/lib/tes-bridge" in text
        assert "PrivateTmp=yes" in text
    print(f"systemd-analyze security: api {api}, poller {poller}")


def test_the_site_mode_drop_in_is_applied(tmp_path: Path) -> None:
    plain = _exposure(_install_units(_mk(tmp_path / "plain")) / "tes-bridge-poller.service")
    site_root = _install_units(_mk(tmp_path / "site"), site_mode=True)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "tes-bridge-poller.service"],
        capture_output=True,
        text=True,
        cwd=site_root,
    )
    assert result.returncode == 0, result.stderr
    site = _exposure(site_root / "tes-bridge-poller.service")
    # The drop-in is applied: sudo gets what it needs, so the poller is less locked down.
    assert site > plain, (site, plain)
    print(f"systemd-analyze security: poller {plain}, poller in site mode {site}")


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# -------------------------------------------------------------------------------------- nginx
def _certificate(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def _directive(text: str, name: str) -> str:
    found = re.search(rf"^\s*{name}\s+([^;]+);", text, re.M)
    assert found, name
    return found.group(1)


def _size(value: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    return int(value[:-1]) * units[value[-1].lower()] if value[-1].isalpha() else int(value)


def test_nginx_limits_match_the_bridges_defaults() -> None:
    text = (DEPLOY / "nginx" / "tes-bridge.conf").read_text()
    assert _size(_directive(text, "client_max_body_size")) == LimitsConfig().max_body_bytes
    server = ServerConfig()
    assert _directive(text, "client_header_timeout") == f"{server.header_timeout_seconds:g}s"
    assert _directive(text, "client_body_timeout") == f"{server.body_timeout_seconds:g}s"
    assert _directive(text, "server") == server.bind


@pytest.fixture(scope="module")
def front(
    local_cluster: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, BridgeService, Path]]:
    """The bridge on the cluster, and real nginx in front of it with the shipped site."""
    root = tmp_path_factory.mktemp("nginx")
    service = start_bridge_service(local_cluster, root / "bridge")
    cert, key = _certificate(root)
    https_port, http_port = free_port(), free_port()
    site = (DEPLOY / "nginx" / "tes-bridge.conf").read_text()
    site = site.replace("server 127.0.0.1:8000;", f"server {service.url.split('//')[1]};")
    site = re.sub(r"^\s*listen \[::\].*$", "", site, flags=re.M)  # no IPv6 needed here
    site = site.replace("listen 443 ssl", f"listen 127.0.0.1:{https_port} ssl")
    site = site.replace("listen 80;", f"listen 127.0.0.1:{http_port};")
    site = site.replace("/etc/ssl/certs/tes-bridge.crt", str(cert))
    site = site.replace("/etc/ssl/private/tes-bridge.key", str(key))
    (root / "site.conf").write_text(site)
    try:
        with private_nginx(root, f"    include {root}/site.conf;", https_port):
            yield f"https://127.0.0.1:{https_port}", f"http://127.0.0.1:{http_port}", service, cert
    finally:
        service.stop()


def test_py_tes_through_nginx_over_tls(
    front: tuple[str, str, BridgeService, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _, _, cert = front
    # The certificate is checked, not skipped: requests (under py-tes) trusts only ours.
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    client = tes.HTTPClient(url, timeout=10)
    done = client.create_task(
        tes.Task(
            name="through-nginx",
            executors=[tes.Executor(image="alpine", command=["echo", "over tls"])],
        )
    )
    waiting = client.create_task(
        tes.Task(executors=[tes.Executor(image="alpine", command=["sleep", "300"])])
    )
    assert client.get_task(done, view="MINIMAL").id == done
    listed = {task.id for task in client.list_tasks(view="MINIMAL").tasks}
    assert {done, waiting} <= listed
    client.cancel_task(waiting)
    assert client.get_task(waiting).state == "CANCELED"
    finished = client.wait(done, timeout=300)
    assert finished.state == "COMPLETE", finished
    full = client.get_task(done, view="FULL")
    assert full.logs[0].logs[0].stdout == "over tls\n"


def test_nginx_refuses_what_the_bridge_would_and_redirects_http(
    front: tuple[str, str, BridgeService, Path],
) -> None:
    url, plain, _, cert = front
    too_big = b"x" * (LimitsConfig().max_body_bytes + 1)
    answer = requests.post(
        f"{url}/ga4gh/tes/v1/tasks",
        data=too_big,
        headers={"Content-Type": "application/json"},
        verify=str(cert),
        timeout=30,
    )
    assert answer.status_code == 413
    redirect = requests.get(f"{plain}/ga4gh/tes/v1/service-info", allow_redirects=False, timeout=10)
    assert redirect.status_code == 301
    assert redirect.headers["Location"].startswith("https://")
    info = requests.get(f"{url}/ga4gh/tes/v1/service-info", verify=str(cert), timeout=10)
    assert info.ok and "Strict-Transport-Security" in info.headers


# ---------------------------------------------------------------------------------- logrotate
def test_logrotate_accepts_and_rotates_the_service_logs(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    log = state / "serve.log"
    log.write_text('{"message": "a line"}\n')
    config = tmp_path / "logrotate.conf"
    text = (DEPLOY / "logrotate" / "tes-bridge").read_text()
    config.write_text(
        text.replace("/var/lib/tes-bridge", str(state)).replace(
            "/var/log/tes-bridge", str(tmp_path / "log")
        )
    )
    status = tmp_path / "logrotate.status"
    debug = subprocess.run(
        ["logrotate", "-d", "-s", str(status), str(config)], capture_output=True, text=True
    )
    assert debug.returncode == 0, debug.stderr
    assert "error" not in debug.stderr.lower(), debug.stderr
    assert "considering log " + str(log) in debug.stderr
    forced = subprocess.run(
        ["logrotate", "-f", "-s", str(status), str(config)], capture_output=True, text=True
    )
    assert forced.returncode == 0, forced.stderr
    # copytruncate: the writer's file stays (emptied), the old lines moved aside.
    assert log.exists() and log.stat().st_size == 0
    rotated = [p for p in state.iterdir() if p.name.startswith("serve.log-")]
    assert len(rotated) == 1 and rotated[0].read_text() == '{"message": "a line"}\n'
