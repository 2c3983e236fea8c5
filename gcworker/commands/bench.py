"""`gcworker bench`: the cost of a report and of a collection, beside the baselines."""

from __future__ import annotations

import json
from pathlib import Path

import click

LABELS = {
    ("gcworker", "steady"): "gcworker steady (fast path)",
    ("gcworker", "compact_unchanged"): "gcworker compact unchanged report",
    ("gcworker", "compact_unchanged_loop"): "gcworker compact unchanged report, tight loop",
    ("gcworker", "steady_full_diff"): "gcworker steady, full diff",
    ("gcworker", "churn_1pct"): "gcworker 1% churn",
    ("gcworker", "mass_loss"): "gcworker mass loss",
    ("last_seen", "steady"): "last_seen steady",
    ("last_seen", "churn_1pct"): "last_seen 1% churn",
    ("last_seen", "mass_loss"): "last_seen mass loss",
    ("pair", "steady"): "clear+mark pair steady",
    ("pair", "churn_1pct"): "clear+mark pair 1% churn",
    ("pair", "mass_loss"): "clear+mark pair mass loss",
}


def _sizes(_ctx, _param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        sizes = tuple(int(part.replace("_", "")) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter("write sizes like 1000,10000,50000") from None
    if not sizes or any(size < 10 for size in sizes):
        raise click.BadParameter("every size must be at least 10 handles")
    return sizes


@click.command()
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write every figure to this file, under stable keys.",
)
@click.option(
    "--sizes",
    callback=_sizes,
    help="Handles per worker, comma-separated [1000,10000,50000].",
)
@click.option(
    "--quick",
    is_flag=True,
    help="Tiny sizes and few repetitions, no pipeline: checks that the benchmark runs.",
)
@click.option("--no-pipeline", is_flag=True, help="Skip the Redis and Celery part.")
@click.pass_obj
def bench(obj, json_file: Path | None, sizes, quick: bool, no_pipeline: bool):
    """Measure reports and collections on the configured PostgreSQL database.

    Works in a scratch schema of its own, dropped at the end. Prints one table and the
    targets of the performance issue, met or not.
    """
    from rich.console import Console

    from gcworker.bench import BenchOptions, run_bench

    console = Console(stderr=True)
    options = BenchOptions.make(sizes, quick)
    if no_pipeline:
        options.pipeline = False
    settings = obj.settings
    result = run_bench(
        settings.database_url,
        options,
        progress=lambda line: console.log(line, highlight=False),
    )
    print_result(result)
    if json_file is not None:
        json_file.write_text(json.dumps(result.as_json(), indent=2, default=str) + "\n")
        click.echo(f"figures written to {json_file}")


def _ms(value) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _int(value) -> str:
    return "" if value is None else f"{int(value):,}"


def build_table(result):
    from rich.table import Table

    table = Table(title=f"gcworker bench (PostgreSQL {result.server_version})")
    for name, justify in (
        ("case", "left"),
        ("H", "right"),
        ("median ms", "right"),
        ("p95 ms", "right"),
        ("stmts", "right"),
        ("rows written", "right"),
        ("WAL B", "right"),
        ("vs pair", "right"),
    ):
        table.add_column(name, justify=justify)
    for size, cases in result.reconcile.items():
        h = f"{int(size):,}"
        for key, label in (
            ("select1", "SELECT 1 (floor: a pooled connection, among the cases)"),
            ("select1_held", "SELECT 1 (a held connection, in a tight loop)"),
        ):
            floor = cases.get(key)
            if floor:
                table.add_row(label, h, _ms(floor["median_ms"]), _ms(floor["p95_ms"]), "1")
        for (impl, name), label in LABELS.items():
            stats = cases.get(impl, {}).get(name)
            if stats is None:
                continue
            pair = cases.get("pair", {}).get(
                name if name in ("churn_1pct", "mass_loss") else "steady"
            )
            compared = pair and impl != "pair" and not name.endswith("_loop")
            ratio = f"{pair['median_ms'] / stats['median_ms']:.1f}x" if compared else ""
            table.add_row(
                label,
                h,
                _ms(stats["median_ms"]),
                _ms(stats["p95_ms"]),
                "" if stats["statements"] is None else f"{stats['statements']:g}",
                _int(stats["rows_written"]),
                _int(stats["wal_bytes"]),
                ratio,
            )
        wire = result.wire.get(size, {})
        if wire:
            sizes = (
                f"full report {wire['full_report_bytes']:,} B, "
                f"compact {wire['compact_report_bytes']:,} B"
            )
            table.add_row(f"[dim]message size: {sizes}[/dim]", h)
        table.add_section()
    col = result.collector
    if col:
        rows = f"{col['rows']:,}"
        for key, label in (
            ("gcworker", f"collector, batches of {col['delete_batch_size']:,}"),
            ("unbatched_delete", "unbatched DELETE (one per table)"),
            ("unbatched_delete_with_audit", "unbatched DELETE + audit rows, same statement"),
        ):
            run = col[key]
            table.add_row(
                f"{label}: total (p95 col: longest statement)",
                rows,
                _ms(run["total_ms"]),
                _ms(run["longest_statement_ms"]),
                _int(run["statements"]),
                _int(run["rows_deleted"]),
                _int(run.get("wal_bytes")),
            )
        table.add_section()
    stale = result.stale_statistics
    for batch, runs in stale.get("batches", {}).items():
        for statistics, label in (("stale", "marked after ANALYZE"), ("analyzed", "then ANALYZE")):
            run = runs[statistics]
            table.add_row(
                f"collector, {stale['workers']} workers' mass loss {label}, batches of "
                f"{int(batch):,}: total (p95 col: longest statement)",
                f"{stale['rows']:,}",
                _ms(run["total_ms"]),
                _ms(run["longest_statement_ms"]),
                _int(run["statements"]),
                _int(run["rows_deleted"]),
            )
    if stale:
        table.add_section()
    if result.rss:
        rss = result.rss
        table.add_row(
            f"reconciler peak RSS: {rss['peak_rss_mb']:.0f} MB "
            f"(at start {rss['rss_before_kb'] / 1024:.0f} MB; {rss['seconds'] * 1000:.0f} ms)",
            f"{rss['handles']:,}",
        )
        table.add_section()
    pipe = result.pipeline
    if pipe.get("measured"):
        for n, row in pipe["sizes"].items():
            table.add_row(
                f"pipeline: {row['reports_per_s']:.0f} reports/s vs no-op "
                f"{row['noop_per_s']:.0f}/s ({row['reports_per_s'] / row['noop_per_s']:.0%}), "
                f"{row['broker_bytes_per_report']:,} B/report on the broker",
                f"{int(n):,}",
            )
        if "compact_broker_bytes" in pipe:
            table.add_row(
                f"pipeline: compact report {pipe['compact_broker_bytes']:,} B on the broker "
                f"(envelope {pipe['compact_envelope_bytes']:,} B)"
            )
    else:
        table.add_row(f"pipeline: not measured ({pipe.get('reason', 'skipped')})")
    return table


def build_targets(result):
    from rich.table import Table

    table = Table(title="targets (issue 5)")
    table.add_column("target")
    table.add_column("measured", justify="right")
    table.add_column("met")
    for target in result.targets:
        met = target["met"]
        verdict = "[green]met[/green]" if met else "[red]not met[/red]"
        if met is None:
            verdict = "[yellow]not measured[/yellow]"
        table.add_row(target["target"], target["value"], verdict)
    return table


def print_result(result) -> None:
    from rich.console import Console

    console = Console(width=max(140, Console().width))
    console.print(build_table(result))
    console.print(build_targets(result))
    console.print(f"bench took {result.seconds:.0f} s")
