"""The dashboard and the alerting rules in deploy/: promtool accepts the rules and runs their
unit tests (one per alert), and every metric they name is one gcworker exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from gcworker import metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "gcworker.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "gcworker.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "gcworker.json"
METRIC = re.compile(r"\bgcworker_[a-z0-9_]+")


def promtool(*args: str) -> subprocess.CompletedProcess:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed (Debian: apt-get install prometheus)")
    return subprocess.run(
        [found, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=120
    )


def alerts() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"]}


def test_promtool_accepts_the_alerting_rules():
    result = promtool("check", "rules", RULES.name)

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_every_alert_has_a_unit_test_and_promtool_passes_them():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"]}
    fired = {
        case["alertname"]
        for test in tests
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert tested == alerts() and fired == alerts()  # each one seen firing, and not before

    result = promtool("test", "rules", RULE_TESTS.name)

    assert result.returncode == 0, result.stdout + result.stderr


def exported() -> set[str]:
    """Every sample name gcworker's control plane and reporter export (e.g. `_total` included)."""
    return {
        sample.name
        for registry in (REGISTRY, metrics.REPORTER_REGISTRY)
        for family in registry.collect()
        for sample in family.samples
    }


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def test_every_metric_the_dashboard_and_the_rules_name_is_one_gcworker_exports():
    named = {
        name
        for text in dashboard_expressions() + rule_expressions() + [RULE_TESTS.read_text()]
        for name in METRIC.findall(text)
    }

    assert named - exported() == set()
    # And the dashboard shows every control-plane and reporter family, but Python's own.
    families = {
        family.name
        for registry in (REGISTRY, metrics.REPORTER_REGISTRY)
        for family in registry.collect()
        if family.name.startswith("gcworker_")
    }
    shown = " ".join(dashboard_expressions())
    assert {f for f in families if f not in shown} == set()
