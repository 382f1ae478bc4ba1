"""deploy/prometheus/ and deploy/grafana/ as shipped: promtool checks the alert rules and runs
their unit tests (Debian's `prometheus` package, installed by deploy/test.sh); the dashboard is
Grafana JSON whose every query names metrics. That those metrics exist is checked against a
real bridge's /metrics in tests/cluster/test_metrics_service.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/tes-bridge.rules.yml"
RULES_TESTS = ROOT / "deploy/prometheus/tes-bridge.rules.test.yml"
DASHBOARD = ROOT / "deploy/grafana/tes-bridge.json"
PROMTOOL = "/usr/bin/promtool"
#: Series Prometheus makes itself for every target, not the bridge.
PROMETHEUS_OWN = frozenset(["up"])
#: Gauges every node of a service reads from the one database: added up over nodes, they
#: would count a two-node service twice.
FROM_THE_DATABASE = ("tes_bridge_tasks", "tes_bridge_oldest_queued_task_age_seconds")

#: PromQL's words that look like names: keywords, modifiers, and Grafana's variables.
_NOT_METRICS = frozenset(
    [
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "inf",
        "nan",
    ]
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, label matchers and clauses,
    durations, strings and Grafana's $variables left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana's variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _NOT_METRICS or re.fullmatch(r"\d+[smhdwy]", name):
            continue
        names.add(name)
    return names


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query["query"]))
    return exprs


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert shutil.which(PROMTOOL), "apt-get install prometheus (deploy/test.sh does)"
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent
    )


def test_promtool_checks_the_alert_rules() -> None:
    result = _promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


def test_every_alert_has_a_promtool_unit_test_that_passes() -> None:
    result = _promtool("test", "rules", RULES_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULES_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert tested == {rule["alert"] for group in groups for rule in group["rules"]}


def test_the_dashboard_is_grafana_json_with_a_query_in_every_panel() -> None:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "tes-bridge" and dashboard["panels"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert metric_names(target["expr"]), (panel["title"], target["expr"])


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, command) (rate(a_bucket{job=~"$job",x="y z"}'
        "[$__rate_interval]))) / on(instance) b_total offset 5m > 0.5 and time() - c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert metric_names("changes(count by (version) (tes_bridge_build_info)[5m:1m]) > 0") == {
        "tes_bridge_build_info"
    }


def test_every_name_queried_is_the_bridges_or_prometheus_own() -> None:
    for expr in rule_exprs() + dashboard_exprs():
        for name in metric_names(expr) - PROMETHEUS_OWN:
            assert name.startswith("tes_bridge_"), (name, expr)


def test_the_database_gauges_are_counted_once_per_service() -> None:
    """`max by (job)` over a service's nodes before any sum; a two-node service was counted
    twice in the dashboard's tasks by state."""
    for expr in rule_exprs() + dashboard_exprs():
        for name in FROM_THE_DATABASE:
            if re.search(rf"\b{name}\{{", expr) or re.search(rf"\b{name}\)", expr):
                assert re.search(rf"max(?: by \(job(?:, state)?\))? ?\({name}\b", expr), expr


def test_a_service_that_is_gone_has_alerts_that_need_none_of_its_metrics() -> None:
    """`up` and `absent()`: the bridge's own metrics vanish with it."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    exprs = {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}
    assert metric_names(exprs["TesBridgeDown"]) == {"up"}
    assert exprs["TesBridgeAbsent"].startswith("absent(")
