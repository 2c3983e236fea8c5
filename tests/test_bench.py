"""`gcworker bench --quick`: runs on PostgreSQL, writes every figure under its stable key, and
leaves no scratch schema behind; on SQLite it refuses with one clear line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from gcworker.cli import main
from tests.conftest import PG_ADMIN_URL

CASES = {
    "gcworker": ("steady", "steady_full_diff", "churn_1pct", "mass_loss"),
    "last_seen": ("steady", "churn_1pct", "mass_loss"),
    "pair": ("steady", "churn_1pct", "mass_loss"),
}
FIGURES = ("median_ms", "p95_ms", "statements", "rows_written", "wal_bytes")


def scratch_schemas(admin) -> set[str]:
    with admin.connect() as conn:
        return set(
            conn.execute(
                text("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'gcbench%'")
            ).scalars()
        )


@pytest.mark.timeout(120)
def test_bench_quick_writes_every_figure_and_drops_its_schema(tmp_path, pg_admin_engine):
    before = scratch_schemas(pg_admin_engine)
    out = tmp_path / "bench.json"

    result = CliRunner().invoke(
        main,
        ["bench", "--quick", "--sizes", "100,400", "--json", str(out)],
        env={"GCWORKER_DATABASE_URL": PG_ADMIN_URL},
    )

    assert result.exit_code == 0, result.output
    assert "targets" in result.output
    figures = json.loads(out.read_text())
    assert set(figures["reconcile"]) == {"100", "400"}
    for size in ("100", "400"):
        cases = figures["reconcile"][size]
        assert set(cases["select1"]) >= {"median_ms", "p95_ms"}
        for impl, names in CASES.items():
            for name in names:
                assert set(cases[impl][name]) >= set(FIGURES), (impl, name)
        assert cases["gcworker"]["steady"]["fast_path"] is True
        assert cases["gcworker"]["steady"]["rows_written"] == 0
        assert cases["gcworker"]["steady_full_diff"]["fast_path"] is False
        assert cases["gcworker"]["steady_full_diff"]["rows_written"] == 0
        churned = cases["rows_changed_per_churn_report"]
        assert cases["gcworker"]["churn_1pct"]["rows_written"] == churned
        assert cases["pair"]["churn_1pct"]["rows_written"] == churned
        assert cases["last_seen"]["steady"]["rows_written"] == int(size)
        assert cases["gcworker"]["mass_loss"]["rows_written"] == int(size)
        assert figures["wire"][size]["full_report_bytes"] > 0
    collector = figures["collector"]
    for run in ("gcworker", "unbatched_delete"):
        assert set(collector[run]) >= {"total_ms", "longest_statement_ms", "statements"}
        assert collector[run]["rows_deleted"] == collector["rows"]
    assert collector["gcworker"]["audited_deletions"] == collector["rows"]
    stale = figures["stale_statistics"]
    assert set(stale["batches"]) == {"100", "1000"}
    for runs in stale["batches"].values():
        for run in ("stale", "analyzed"):
            assert runs[run]["rows_deleted"] == stale["rows"] > 0
            assert runs[run]["longest_statement_ms"] > 0
    assert figures["rss"]["peak_rss_mb"] > 0
    assert figures["pipeline"]["measured"] is False
    assert {
        "steady_vs_pair_h10000",
        "steady_vs_pair_h50000",
        "churn_vs_pair_h10000",
        "mass_loss_vs_pair_h50000",
        "collector_longest_statement",
        "collector_total_vs_unbatched",
        "collector_stale_statistics_b100",
        "collector_stale_statistics_b1000",
        "reconciler_rss",
    } <= set(figures["targets"])
    schema = figures["database"]["scratch_schema"]
    assert schema.startswith("gcbench_") and schema not in before
    assert schema not in scratch_schemas(pg_admin_engine)  # dropped at the end


def test_bench_refuses_sqlite_with_one_clear_line(tmp_path):
    result = CliRunner().invoke(
        main,
        ["bench", "--quick"],
        env={"GCWORKER_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}"},
    )

    assert result.exit_code == 1
    assert "needs PostgreSQL" in result.output
