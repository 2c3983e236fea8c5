"""Rule 14: settings come from GCWORKER_* variables (and flags on top), durations read like 30s, 5m,
1h, and a bad value stops the program with one line naming the setting."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from gcworker.settings import SettingsError, load_settings

DURATION_SETTINGS = (
    "missing_grace_period",
    "report_interval",
    "heartbeat_interval",
    "heartbeat_ttl",
    "creating_timeout",
    "gc_interval",
    "stalled_worker_timeout",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in os.environ:
        if name.startswith("GCWORKER_"):
            monkeypatch.delenv(name)


def test_rule14_defaults():
    settings = load_settings()

    assert settings.missing_grace_period == timedelta(minutes=5)
    assert settings.report_interval == timedelta(seconds=30)
    assert settings.heartbeat_interval == timedelta(seconds=30)
    assert settings.heartbeat_ttl == timedelta(minutes=1)  # two heartbeat intervals
    assert settings.creating_timeout == timedelta(hours=1)
    assert settings.gc_interval == timedelta(seconds=30)
    assert settings.stalled_worker_timeout == timedelta(0)
    assert settings.database_url == "sqlite:///.gcworker/gcworker.db"
    assert settings.embedded


@pytest.mark.parametrize(
    ("written", "meaning"),
    [
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("1h", timedelta(hours=1)),
        ("90", timedelta(seconds=90)),
    ],
)
def test_rule14_durations_are_written_like_30s_5m_1h(written, meaning):
    assert load_settings(creating_timeout=written).creating_timeout == meaning


def test_rule14_settings_come_from_the_environment_and_flags_win(monkeypatch):
    monkeypatch.setenv("GCWORKER_MISSING_GRACE_PERIOD", "10m")
    monkeypatch.setenv("GCWORKER_HEARTBEAT_INTERVAL", "45s")

    from_env = load_settings()
    assert from_env.missing_grace_period == timedelta(minutes=10)
    assert from_env.heartbeat_ttl == timedelta(seconds=90)  # follows the heartbeat interval

    assert load_settings(missing_grace_period="20m").missing_grace_period == timedelta(minutes=20)


@pytest.mark.parametrize("name", DURATION_SETTINGS)
def test_rule14_a_bad_duration_names_the_setting(name):
    with pytest.raises(SettingsError) as error:
        load_settings(**{name: "banana"})

    message = str(error.value)
    assert message.startswith(f"GCWORKER_{name.upper()}=banana:")
    assert "not a duration" in message
    assert "\n" not in message


def test_rule14_a_bad_value_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("GCWORKER_REPORT_INTERVAL", "soon")

    with pytest.raises(SettingsError, match=r"^GCWORKER_REPORT_INTERVAL=soon: .*not a duration"):
        load_settings()


@pytest.mark.parametrize(
    "name", ["missing_grace_period", "report_interval", "heartbeat_interval", "creating_timeout"]
)
def test_rule14_a_duration_must_be_longer_than_zero(name):
    with pytest.raises(SettingsError, match=rf"^GCWORKER_{name.upper()}=0s: must be longer"):
        load_settings(**{name: "0s"})


def test_rule14_the_grace_period_must_cover_two_report_intervals():
    with pytest.raises(SettingsError) as error:
        load_settings(missing_grace_period="50s", report_interval="30s")

    message = str(error.value)
    assert message.startswith("GCWORKER_MISSING_GRACE_PERIOD=50s")
    assert "two report intervals" in message and "GCWORKER_REPORT_INTERVAL=30s" in message
    assert "\n" not in message
    # Exactly two intervals is enough.
    assert load_settings(missing_grace_period="1m", report_interval="30s")


def test_rule14_the_grace_period_check_follows_a_longer_report_interval():
    with pytest.raises(SettingsError, match="GCWORKER_MISSING_GRACE_PERIOD=5m"):
        load_settings(report_interval="3m")  # the default grace of 5m no longer covers two


def test_rule14_the_heartbeat_ttl_must_cover_one_heartbeat_interval():
    with pytest.raises(SettingsError) as error:
        load_settings(heartbeat_ttl="20s", heartbeat_interval="30s")

    message = str(error.value)
    assert message.startswith("GCWORKER_HEARTBEAT_TTL=20s")
    assert "GCWORKER_HEARTBEAT_INTERVAL=30s" in message
    assert "\n" not in message
    assert load_settings(heartbeat_ttl="30s", heartbeat_interval="30s")


def test_rule14_the_stalled_worker_timeout_may_be_zero_but_not_negative():
    assert load_settings(stalled_worker_timeout="0").stalled_worker_timeout == timedelta(0)
    with pytest.raises(SettingsError, match="^GCWORKER_STALLED_WORKER_TIMEOUT="):
        load_settings(stalled_worker_timeout=-60)
