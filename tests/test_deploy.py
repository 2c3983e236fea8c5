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


# compose.yaml and the systemd units --------------------------------------------------------------

ROOT = DEPLOY.parent
UNITS = DEPLOY / "systemd"


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_takes_secrets_from_files_and_publishes_on_loopback_only():
    spec = compose()
    declared = set(spec["secrets"])
    for name, service in spec["services"].items():
        assert set(service.get("secrets", [])) <= declared, name
        for variable, value in (service.get("environment") or {}).items():
            assert "PASSWORD" not in variable or variable.endswith("_FILE"), (name, variable)
            assert "@" not in str(value), f"{name}: {variable} holds credentials"
            if variable.endswith("_FILE") and str(value).startswith("/run/secrets/"):
                assert str(value).removeprefix("/run/secrets/") in service["secrets"], variable
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_compose_health_checks_use_the_health_endpoints_and_the_namespace():
    services = compose()["services"]
    checks = {
        n: " ".join(s["healthcheck"]["test"]) for n, s in services.items() if "healthcheck" in s
    }

    assert "/readyz" in checks["reconciler"]
    assert "gcworker beat --check" in checks["beat"]
    assert not [n for n, c in checks.items() if "inspect ping" in c or "redbeat" in c]


def unit_commands(path: Path) -> list[list[str]]:
    """The gcworker command lines of a unit (ExecStart and friends), %i and ${...} filled in."""
    commands = []
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.startswith("Exec") and "/gcworker " in value:
            value = value.replace("%i", "w1").replace("${GCWORKER_RUNTIME}", "dir:/srv/runtime")
            commands.append(value.split("/gcworker ", 1)[1].split())
    return commands


@pytest.mark.parametrize("unit", sorted(p.name for p in UNITS.glob("*.service")))
def test_every_systemd_unit_runs_commands_gcworker_has(unit):
    from click.testing import CliRunner

    from gcworker.cli import main

    commands = unit_commands(UNITS / unit)
    assert commands, f"{unit} runs no gcworker command"
    for args in commands:
        result = CliRunner().invoke(main, [*args, "--help"])
        assert result.exit_code == 0, f"{unit}: gcworker {' '.join(args)}: {result.output}"


def test_systemd_accepts_the_units(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (the units' commands are checked above)")
    gcworker = shutil.which("gcworker") or "/bin/true"
    names = []
    for unit in sorted(UNITS.glob("*.service")) + sorted(UNITS.glob("*.timer")):
        name = unit.name.replace("@.", "@w1.")
        (tmp_path / name).write_text(unit.read_text().replace("/usr/local/bin/gcworker", gcworker))
        names.append(f"./{name}")

    result = subprocess.run(
        [analyze, "verify", *names],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"SYSTEMD_LOG_LEVEL": "warning", "PATH": "/usr/bin:/bin"},
    )

    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def test_every_dependency_is_pinned_for_the_image_and_ci():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            pins[canonicalize_name(name)] = pinned
    for text in wanted:
        requirement = Requirement(text)
        pinned = pins.get(canonicalize_name(requirement.name))
        assert pinned is not None, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pinned), f"{requirement}: pinned {pinned}"
    assert "-c constraints.txt" in (ROOT / "Dockerfile").read_text()
    assert "-c constraints.txt" in (ROOT / ".ci" / "run").read_text()
