"""The DRS test server (tests/fixtures/drs.py) against the GA4GH DRS compliance suite
(`drs-compliance-suite` from PyPI, in a virtual environment of its own: see
`tests.fixtures.drs.COMPLIANCE_SUITE`): the staging tests resolve `drs://` inputs against a
server that answers as the specification says."""

from __future__ import annotations

import json
from typing import Any

from tests.fixtures.drs import DrsServer, run_compliance_suite


def objects(drs: DrsServer) -> None:
    """One of each kind the staging tests use: a blob over HTTPS, one reached only through
    `/access` (whose URL needs the header it hands out), a bundle with a nested bundle, and a
    blob behind a bearer token."""
    drs.blob("cs-blob", b"compliance blob\n")
    drs.access_only("cs-access", b"through access\n")
    drs.bundle("cs-inner", {"blob.txt": "cs-blob"})
    drs.bundle("cs-bundle", {"inner": "cs-inner", "access.txt": "cs-access"})
    drs.access_only("cs-private", b"private blob\n", auth="bearer")


def none(drs_id: str, **more: Any) -> dict[str, Any]:
    return {"drs_id": drs_id, "auth_type": "none", "auth_token": "", **more}


def failures(report: dict[str, Any]) -> list[str]:
    return [
        f"{test['test_name']}: {case['case_name']}: {case['message']}"
        for phase in report["phases"]
        for test in phase["tests"]
        for case in test["cases"]
        if case["status"] != "PASS" and case["status"] != "SKIP"
    ]


def test_the_drs_test_server_passes_the_ga4gh_compliance_suite(drs_server, tmp_path):
    objects(drs_server)
    bearer = {"auth_type": "bearer", "auth_token": drs_server.token}
    config = {
        "service_info": {"auth_type": "none", "auth_token": ""},
        "drs_object_info": [
            none("cs-blob", is_bundle=False),
            none("cs-access", is_bundle=False),
            none("cs-bundle", is_bundle=True),
            {"drs_id": "cs-private", **bearer, "is_bundle": False},
        ],
        "drs_object_access": [none("cs-access"), {"drs_id": "cs-private", **bearer}],
    }
    report = run_compliance_suite(drs_server, config, tmp_path / "suite")
    assert report["status"] == "PASS", "\n".join(failures(report))
    phases = {phase["phase_name"]: phase for phase in report["phases"]}
    assert set(phases) == {"service info", "drs object info", "drs object access"}
    # Every object was asked for, and both /access calls were made.
    assert len(phases["drs object info"]["tests"]) == 4
    assert len(phases["drs object access"]["tests"]) == 2
    assert report["summary"]["failed"] == 0 and report["summary"]["passed"] >= 20


def test_the_compliance_suite_fails_a_server_that_breaks_the_specification(drs_server, tmp_path):
    """The run above can fail: a DRS object without its required fields, and a bearer object
    asked without the token, are reported as failures."""
    drs_server.put_object("cs-broken", {"size": "twelve", "access_methods": []})
    drs_server.blob("cs-locked", b"locked\n", auth="bearer")
    config = {
        "service_info": {"auth_type": "none", "auth_token": ""},
        "drs_object_info": [none("cs-broken", is_bundle=False), none("cs-locked", is_bundle=False)],
        "drs_object_access": [],
    }
    report = run_compliance_suite(drs_server, config, tmp_path / "suite")
    assert report["status"] == "FAIL"
    failed = "\n".join(failures(report))
    assert "cs-broken" in failed and "schema" in failed.lower()
    assert "cs-locked" in failed and "401" in failed
    assert json.dumps(report).count(drs_server.token) == 0
