"""Record a measured run in the figures ledger, or render docs/figures.md from it.

    python benchmarks/ledger.py record runs/benchmark/benchmarks/dohnuts.jsonl --machine 'H200 (machine F)'
    python benchmarks/ledger.py record gpu-tests.txt --tests --machine H200
    python benchmarks/ledger.py render

`record` appends one entry per workload of a benchmark stage run (or, with --tests, one per
pytest summary line of a log) to benchmarks/ledger.jsonl, its source the file's name (never where
it lay on one machine) and, with --command, the command that made it; the commit defaults to the checkout's
HEAD, the date to today, the run id to DATE-COMMIT-runN. `render` rewrites docs/figures.md and
the README's block between `<!-- figures:start -->` and `<!-- figures:end -->`, if it has one,
and draws the latest serving runs' curve in docs/serving-curve.svg.
"""

import datetime
import json
import subprocess
from pathlib import Path

import click

from dohnuts.bench import curve, figures, ledger

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "benchmarks" / "ledger.jsonl"
FIGURES = ROOT / "docs" / "figures.md"
CURVE = ROOT / "docs" / "serving-curve.svg"
README = ROOT / "README.md"


@click.group()
def main() -> None:
    """The figures ledger: record a run, render the figures."""


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def _next_run(entries: list[dict], date: str, commit: str) -> str:
    runs = {made["run"] for made in entries}
    number = 1
    while f"{date}-{commit}-run{number}" in runs:
        number += 1
    return f"{date}-{commit}-run{number}"


@main.command()
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--machine", required=True, help="the machine it ran on: 'H200 (machine F)', 'CPU, 2 cores'")
@click.option("--commit", help="short hash of the code measured (default: HEAD)")
@click.option("--date", help="YYYY-MM-DD (default: today)")
@click.option("--run", "run_id", help="an id unique to the run (default: DATE-COMMIT-runN)")
@click.option("--tests", is_flag=True, help="SOURCE is a pytest log, not benchmark records")
@click.option("--note", help="what a reader must know of the run (its settings, what differed)")
@click.option("--command", help="the command that produced SOURCE")
@click.option("--ledger", "ledger_path", type=click.Path(dir_okay=False, path_type=Path), default=LEDGER,
              show_default=True)
def record(source: Path, machine: str, commit: str | None, date: str | None, run_id: str | None, tests: bool,
           note: str | None, command: str | None, ledger_path: Path) -> None:
    """Append SOURCE's run to the ledger: a benchmark stage's records JSONL, a measurement's JSON
    record (its --out), or a pytest log."""
    commit = commit or _head()
    date = date or datetime.date.today().isoformat()
    run_id = run_id or _next_run(ledger.read(ledger_path), date, commit)
    if tests:
        entries = ledger.entries_from_pytest(source.read_text(), date, commit, machine, run_id, source.name)
    else:
        text = source.read_text()
        try:  # one record as JSON (a measurement's --out), else JSON lines (the benchmark stage's)
            records = [json.loads(text)]
        except json.JSONDecodeError:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        if not all(isinstance(record, dict) for record in records):
            raise click.ClickException(f"{source} holds something other than JSON objects (records)")
        entries = ledger.entries_from_records(records, date, commit, machine, run_id, source.name)
    if not entries:
        raise click.ClickException(f"{source} holds nothing to record")
    if command:
        for made in entries:
            made["command"] = command
    if note:
        for made in entries:
            made["note"] = note if not made.get("note") else f"{note}; {made['note']}"
    try:
        count = ledger.append(ledger_path, entries)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{ledger_path}: run {run_id}, {count} entries; now `python benchmarks/ledger.py render`")


@main.command()
@click.option("--ledger", "ledger_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=LEDGER, show_default=True)
def render(ledger_path: Path) -> None:
    """Rewrite docs/figures.md (and the README's figures block) and docs/serving-curve.svg from the ledger."""
    entries = ledger.read(ledger_path)
    ledger.write_atomically(FIGURES, figures.render(entries).encode())
    drawn = curve.serving_curve_svg(entries)
    if drawn is not None:
        ledger.write_atomically(CURVE, drawn.encode())
    readme = "; README.md's figures block too" if figures.update_markdown(README, entries) else ""
    click.echo(f"{FIGURES.relative_to(ROOT)}: {len(entries)} entries{readme}")


if __name__ == "__main__":
    main()
