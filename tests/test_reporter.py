"""The reporter: full and compact reports, the control plane's feedback, failed listings."""

from __future__ import annotations

import pytest

from gcworker.delivery import InProcessChannel
from gcworker.reporter import Reporter
from gcworker.runtimes import RuntimeError_
from gcworker.runtimes.dir import DirRuntime
from gcworker.signing import generate_private_key, public_key_text
from tests.conftest import states


class RecordingChannel(InProcessChannel):
    """The in-process channel, remembering the type of every message it sent."""

    def __init__(self, plane, **kw):
        super().__init__(plane, **kw)
        self.sent: list[str] = []

    def send(self, message) -> None:
        self.sent.append(message.type)
        super().send(message)


@pytest.fixture
def reporting(plane, tmp_path):
    key = generate_private_key()
    plane.register_key("w1", public_key_text(key))
    runtime = DirRuntime(str(tmp_path / "runtime")).declare_empty()
    channel = RecordingChannel(plane, private_key=key)
    reporter = Reporter(
        "w1", runtime, channel, heartbeat_interval=30, report_interval=30, full_report_every=4
    )
    reporter.heartbeat()
    return reporter, runtime, channel


def test_reporter_sends_compact_reports_while_nothing_changes(plane, reporting):
    reporter, runtime, channel = reporting
    runtime.create("container", "c1")
    plane.scheduler.create_container("w1", "c1")
    plane.scheduler.container_created("c1")
    for _ in range(4):
        reporter.report()
    assert channel.sent == ["heartbeat", "report", "unchanged", "unchanged", "unchanged"]
    assert states(plane) == {"c1": ("created", False)}


def test_reporter_sends_a_full_report_at_a_bounded_interval(reporting):
    reporter, _, channel = reporting
    for _ in range(6):
        reporter.report()
    assert channel.sent[1:] == [
        "report",
        "unchanged",
        "unchanged",
        "unchanged",
        "report",
        "unchanged",
    ]


def test_reporter_sends_a_full_report_when_its_inventory_changes(reporting):
    reporter, runtime, channel = reporting
    reporter.report()
    runtime.create("volume", "v1")
    reporter.report()
    assert channel.sent[1:] == ["report", "report"]


def test_reporter_answers_the_control_planes_request_for_a_full_report(plane, reporting):
    reporter, _, channel = reporting
    reporter.report()
    plane.scheduler.create_container("w1", "c1")
    plane.scheduler.container_created("c1")  # the control plane's rows changed: c1 unseen
    reporter.report()  # compact, not confirmed: the control plane asks for a full report
    reporter.report()
    assert channel.sent[1:] == ["report", "unchanged", "report"]
    assert states(plane) == {"c1": ("created", True)}


def test_reporter_removes_what_the_control_plane_destroys(plane, reporting):
    reporter, runtime, _ = reporting
    runtime.create("container", "stray")
    reporter.report()  # unknown handle: recorded as destroying (rule 8) ...
    reporter.report()  # ... and removed after the next report
    assert runtime.inventory().containers == []
    reporter.report()
    assert states(plane) == {}


def test_a_failed_listing_sends_no_report(plane, reporting):
    reporter, _, channel = reporting

    class Broken:
        def inventory(self):
            raise RuntimeError_("disk unreadable")

    reporter.runtime = Broken()
    assert reporter.report() is False
    assert channel.sent == ["heartbeat"]


def test_a_full_report_request_is_read_once(board):
    assert board.feedback("w1").full_report_wanted is False
    board.want_full_report("w1")
    assert board.feedback("w2").full_report_wanted is False
    assert board.feedback("w1").full_report_wanted is True
    assert board.feedback("w1").full_report_wanted is False
