"""What an operator sees when a setting, a server or a file is wrong: one line on stderr naming
what to fix, exit status 2, never a traceback, nothing created or changed."""

from __future__ import annotations

import socket
from importlib.metadata import version

import pytest

from gcworker.settings import SettingsError, load_settings
from tests.test_cli import gcworker, ok

EXIT_OPERATOR = 2


def operator_error(result) -> str:
    """One line on stderr, nothing on stdout, exit 2."""
    assert result.returncode == EXIT_OPERATOR, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gcworker: ")
    return lines[0]


def closed_port() -> int:
    """A local port nothing listens on (it was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("nonsense", "is not a database URL"),
        ("mysql://gc:s3cret@db.example/gc", "unsupported database"),
        ("postgresql+asyncpg://gc:s3cret@db.example/gc", "unsupported database"),
    ],
)
def test_an_unparsable_or_unsupported_database_url_is_one_line_and_exit_2(tmp_path, url, said):
    line = operator_error(gcworker(tmp_path, url, "workers"))

    assert "GCWORKER_DATABASE_URL" in line and said in line
    assert "s3cret" not in line  # the password is never echoed


def test_a_sqlite_url_in_a_folder_that_does_not_exist_is_an_error_and_creates_nothing(tmp_path):
    missing = tmp_path / "no" / "such" / "folder"

    line = operator_error(gcworker(tmp_path, f"sqlite:///{missing}/gc.db", "migrate"))

    assert f"the folder {missing} does not exist" in line
    assert not (tmp_path / "no").exists()


def test_the_default_sqlite_file_is_still_created_in_a_fresh_folder(tmp_path):
    ok(gcworker(tmp_path, "", "migrate"))

    assert (tmp_path / ".gcworker" / "gcworker.db").exists()


def test_a_database_that_does_not_answer_is_one_line_and_exit_2(tmp_path):
    url = f"postgresql://root:s3cret@127.0.0.1:{closed_port()}/test"

    line = operator_error(gcworker(tmp_path, url, "workers"))

    assert line.startswith("gcworker: database error:") and "s3cret" not in line


def test_a_broker_that_does_not_answer_is_one_line_and_exit_2(tmp_path):
    result = gcworker(
        tmp_path,
        "",
        "heartbeat",
        "--worker",
        "w1",
        GCWORKER_BROKER_URL=f"redis://127.0.0.1:{closed_port()}/0",
        GCWORKER_ALLOW_UNSIGNED="true",
    )

    # allow-unsigned warns on its own line first; the failure is the last line, and the only other
    lines = result.stderr.strip().splitlines()
    assert "ALLOW_UNSIGNED" in lines[0]
    result.stderr = "\n".join(lines[1:])
    assert operator_error(result).startswith("gcworker: broker error:")


def test_a_key_path_that_cannot_be_written_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "no-such-folder" / "w1.key"

    line = operator_error(gcworker(tmp_path, "", "keys", "generate", "w1", "--out", str(out)))

    assert f"cannot write the key {out}" in line


@pytest.mark.parametrize("value", ["99999999999y", "101y"])
def test_an_out_of_range_duration_is_one_line_and_exit_2(tmp_path, value):
    line = operator_error(gcworker(tmp_path, "", "--missing-grace-period", value, "workers"))

    assert f"GCWORKER_MISSING_GRACE_PERIOD={value}" in line and "too long" in line


def test_sizes_are_parsed_like_durations():
    assert load_settings(max_message_bytes="32 MiB").max_message_bytes == 32 * 1024 * 1024
    assert load_settings(max_message_bytes="2 MB").max_message_bytes == 2_000_000
    assert load_settings(max_message_bytes=4096).max_message_bytes == 4096
    with pytest.raises(SettingsError, match="GCWORKER_MAX_MESSAGE_BYTES=lots: .*not a size"):
        load_settings(max_message_bytes="lots")


def test_the_readme_size_example_is_accepted_from_the_environment(tmp_path):
    result = gcworker(tmp_path, "", "migrate", GCWORKER_MAX_MESSAGE_BYTES="32 MiB")

    assert result.returncode == 0, result.stderr


def test_version_prints_the_installed_version(tmp_path):
    assert ok(gcworker(tmp_path, "", "--version")).strip() == f"gcworker {version('gcworker')}"
