"""The figures ledger: one JSON line per (run, workload), appended and never rewritten, and the
Markdown of docs/figures.md and of the README's figures table, rendered from it.

An entry holds:

    date      YYYY-MM-DD, when the run was made
    commit    short hash of the code measured
    machine   "H200 (machine F)", "CPU, 2 cores"
    run       an id unique to the run: "2026-12-02-1c7de04-run2"
    workload  "distinct_text_50q", "varied_traffic", "serving", ...
    kind      one of KINDS: replay, varied, serving, profile, pipeline, tests
    shape     the model measured: "shape-only qwen3_5-0.8b", or the checkpoint
    figures   a flat mapping of headline numbers: p50_ms, p99_ms, rows_per_second, passed, ...
    samples   (optional) name -> the per-call numbers the figures come from
    source    where it came from: the records file, the log
    command   (optional) the command that ran, for tests and profiles
    note      (optional) what a reader must know to compare it

Only the standard library: the ledger is read and written without torch.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

FIELDS = ("date", "commit", "machine", "run", "workload", "kind", "shape", "figures", "samples", "source",
          "command", "note")
REQUIRED = ("date", "commit", "machine", "run", "workload", "kind", "shape", "figures", "source")
KINDS = {  # kind: (heading, meaning)
    "replay": ("Replays", "one request or training update repeated; from its third call on a GPU it replays a "
               "captured CUDA graph"),
    "varied": ("Varied traffic and evaluation", "distinct requests or layouts, each timed as met (varied traffic, "
               "evaluation over many rows)"),
    "serving": ("Serving", "the server or its batcher under closed-loop clients, each sending its next request "
                "when answered"),
    "profile": ("Profiles", "one call's time, step by step"),
    "pipeline": ("Pipeline", "the whole `dvc repro`"),
    "tests": ("Test runs", "test outcomes, as pytest counted them"),
}
STAGE_RECORDS = "runs/benchmark/benchmarks/dohnuts.jsonl"
RENDER_COMMAND = "python benchmarks/ledger.py render"
RECORD_COMMAND = f"python benchmarks/ledger.py record {STAGE_RECORDS} --machine 'H200 (machine F)'"
START, END = "<!-- figures:start -->", "<!-- figures:end -->"
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}$")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _round(value):
    """Six significant digits: a microsecond of a 10 ms call, and lines a third as long."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def check(entry: dict) -> dict:
    """`entry` itself when it is a well-formed ledger entry.

    Raises:
        ValueError: naming the entry and every problem found, with the offending values.
    """
    problems = []
    missing = [name for name in REQUIRED if name not in entry]
    if missing:
        problems.append(f"missing {missing}")
    unknown = sorted(set(entry) - set(FIELDS))
    if unknown:
        problems.append(f"unknown fields {unknown}")
    if "date" in entry and not _DATE.match(str(entry["date"])):
        problems.append(f"date {entry['date']!r} is not YYYY-MM-DD")
    if "kind" in entry and entry["kind"] not in KINDS:
        problems.append(f"kind {entry['kind']!r} is not one of {sorted(KINDS)}")
    for name in ("commit", "machine", "run", "workload", "shape", "source"):
        if name in entry and not (isinstance(entry[name], str) and entry[name]):
            problems.append(f"{name} {entry[name]!r} is not a non-empty string")
    figures = entry.get("figures")
    if "figures" in entry and not (isinstance(figures, dict) and figures and all(map(_number, figures.values()))):
        problems.append(f"figures must map names to numbers, at least one: {str(figures)[:200]}")
    samples = entry.get("samples", {})
    if not (isinstance(samples, dict) and all(isinstance(values, list) and all(map(_number, values))
                                              for values in samples.values())):
        problems.append(f"samples must map names to lists of numbers: {str(samples)[:200]}")
    if problems:
        raise ValueError(f"ledger entry {entry.get('run')!r} / {entry.get('workload')!r}: " + "; ".join(problems))
    return entry


def entry(date: str, commit: str, machine: str, run: str, workload: str, kind: str, shape: str, figures: dict,
          source: str, samples: dict | None = None, command: str | None = None, note: str | None = None) -> dict:
    """One checked entry, its numbers rounded to six significant digits; empty optional fields left out."""
    made = {"date": date, "commit": commit, "machine": machine, "run": run, "workload": workload, "kind": kind,
            "shape": shape, "figures": {name: _round(value) for name, value in figures.items()},
            "samples": {name: [_round(value) for value in values] for name, values in (samples or {}).items()},
            "source": source, "command": command, "note": note}
    return check({name: value for name, value in made.items() if value not in (None, {}, "")})


# From a benchmark stage record (dohnuts/pipeline/benchmark.py) to figures and samples. Records
# gained keys over time; whatever a record lacks is left out, never filled in.
_REPEATED = ("p50_ms", "p95_ms", "mean_ms", "cold_ms", "decisions_per_second", "hugging_face_p50_ms",
             "max_abs_logit_difference_to_hugging_face", "input_tokens", "computed_tokens", "shared_prefixes")
_CALLS = ("graph_replays", "graph_captures", "bucket_replays", "eager")
_PASS = ("p50_ms", "p95_ms", "p99_ms", "mean_ms", "max_ms", "text_p50_ms", "image_p50_ms", "decisions_per_second")
_PASS_CALLS = ("bucket_replays", "graph_replays", "graph_captures", "eager", "padding_tokens", "vision_bucket_replays",
               "vision_eager")
_LEVEL = ("p50_ms", "p95_ms", "p99_ms", "decisions_per_second", "requests_per_second", "mean_batch_requests")
_TRAINING = ("p50_ms", "p95_ms", "mean_ms", "cold_ms", "tokens_per_second", "input_tokens", "computed_tokens",
             "processes", "scaling_efficiency", "updates", "buckets")


def _pick(source: dict | None, keys: Iterable[str], prefix: str = "") -> dict:
    source = source or {}
    return {prefix + key: source[key] for key in keys if _number(source.get(key))}


def _measured(record: dict) -> dict:
    """The roofline efficiency against the ceilings measured in the run, and the peak memory."""
    figures = {}
    efficiency = ((record.get("roofline") or {}).get("efficiency") or {}).get("measured")
    if _number(efficiency):
        figures["efficiency"] = efficiency
    peak = ((record.get("telemetry") or {}).get("cuda_memory") or {}).get("peak_allocated_mib")
    peak = peak if _number(peak) else record.get("peak_allocated_mib", (record.get("memory") or {}).get(
        "peak_allocated_mib"))
    if _number(peak):
        figures["peak_allocated_mib"] = peak
    return figures


def _series(record: dict, **names: str) -> dict:
    return {name: record[key] for name, key in names.items() if isinstance(record.get(key), list)}


def _repeated(record: dict) -> tuple[dict, dict]:
    figures = {**_pick(record, _REPEATED), **_pick(record.get("timed_calls"), _CALLS), **_measured(record)}
    return figures, _series(record, samples_ms="samples_ms", hugging_face_ms="hugging_face_samples_ms")


def _varied_traffic(record: dict) -> tuple[dict, dict]:
    figures = _pick(record, ("requests", "image_requests", "buckets", "bucket_prepare_seconds",
                             "vision_bucket_prepare_seconds", "hugging_face_p50_ms", "hugging_face_p99_ms"))
    samples = _series(record, hugging_face_ms="hugging_face_samples_ms")
    for name in ("first_sight", "second_pass"):
        part = record.get(name) or {}
        figures |= _pick(part, _PASS, f"{name}_") | _pick(part.get("timed_calls"), _PASS_CALLS, f"{name}_")
        samples |= _series(part, **{f"{name}_ms": "samples_ms"})
    return figures, samples


def _evaluation(record: dict) -> tuple[dict, dict]:
    figures = _pick(record, ("rows", "images", "batches", "passes", "loader_workers", "speedup"))
    samples = {}
    # "synchronous" is the plain loop: build a batch, copy it, run it, wait for its logits.
    for path, name in (("overlapped", "overlapped_"), ("synchronous", "plain_loop_")):
        if _number(record.get(f"{path}_rows_per_second")):
            figures[f"{name.removeprefix('overlapped_')}rows_per_second"] = record[f"{path}_rows_per_second"]
        seconds = record.get(f"{path}_seconds_samples")
        if seconds is None and _number(record.get(f"{path}_seconds")):
            seconds = [record[f"{path}_seconds"]]  # one timed pass, before passes were repeated
        if seconds is not None:
            samples[f"{name}seconds"] = seconds
    return figures, samples


def _serving(record: dict) -> tuple[dict, dict]:
    figures = _pick(record, ("requests", "images", "questions_per_request"))
    samples = {}
    for level in record.get("levels", []):
        prefix = f"clients_{level['clients']}_"
        figures |= _pick(level, _LEVEL, prefix) | _pick(level.get("timed_calls"), (
            "bucket_replays", "replays", "captures", "idle_captures", "eager"), prefix)
        samples |= _series(level, **{f"{prefix}ms": "samples_ms"})
    levels = record.get("levels", [])
    figures |= {"failed": sum(level.get("failed", 0) for level in levels),
                "lost": sum(level.get("lost", 0) for level in levels)}
    return figures, samples


def _training(record: dict) -> tuple[dict, dict]:
    figures = _pick(record, _TRAINING) | _pick(record.get("training_graphs"), (
        "eager", "captures", "replays", "failed", "padding_tokens"), "graph_") | _measured(record)
    return figures, _series(record, samples_ms="samples_ms")


def _other(record: dict) -> tuple[dict, dict]:
    return _pick(record, record), _series(record, samples_ms="samples_ms")


def kind_of(workload: str) -> str:
    """replay, varied or serving: what a benchmark workload's figures stand for."""
    if workload.startswith(("varied_traffic", "training_update_varied", "evaluation")):
        return "varied"
    return "serving" if workload.startswith("serving") else "replay"


def _shape(environment: dict) -> str:
    base = environment.get("base")
    if not base:
        return "unknown model"
    return base.replace("shape-only:", "shape-only ") if environment.get("shape_only") or base.startswith(
        "shape-only:") else f"checkpoint (base {base})"


def entries_from_records(records: list[dict], date: str, commit: str, machine: str, run: str,
                         source: str = STAGE_RECORDS) -> list[dict]:
    """One ledger entry per record of a benchmark stage run (its records JSONL, parsed).

    Args:
        records: the stage's records, one dict per workload (`workload`, `p50_ms`, `samples_ms`,
            `environment`...); older shapes of the records are read as far as they go
        date, commit, machine, run: the run's; a record that names its own `commit` keeps it
        source: where the records came from

    Returns:
        the entries, in the records' order; a training update of several processes is the
        workload `training_update_<n>_processes`

    Raises:
        ValueError: a record without a workload, or two records of one workload.
    """
    entries, seen = [], set()
    for record in records:
        if "workload" not in record:
            raise ValueError(f"a benchmark record without a workload: {sorted(record)}")
        workload = record["workload"]
        if workload.startswith("training_update") and record.get("processes", 1) > 1:
            workload = f"{workload}_{record['processes']}_processes"
        if workload in seen:
            raise ValueError(f"run {run!r} holds two records of {workload!r}; record them as two runs")
        seen.add(workload)
        if workload == "varied_traffic":
            figures, samples = _varied_traffic(record)
        elif workload == "evaluation_throughput":
            figures, samples = _evaluation(record)
        elif workload == "serving":
            figures, samples = _serving(record)
        elif workload.startswith("training_update"):
            figures, samples = _training(record)
        elif "p50_ms" in record:
            figures, samples = _repeated(record)
        else:
            figures, samples = _other(record)
        environment = record.get("environment") or {}
        slow = environment.get("slow_paths") or {}
        entries.append(entry(
            date, record.get("commit") or environment.get("commit") or commit, machine, run, workload,
            kind_of(workload), _shape(environment), figures, source, samples,
            note=f"slower paths taken: {', '.join(sorted(slow))}" if slow else None))
    return entries


_SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in ([\d.]+)s")
_COMMAND = re.compile(r"(?:python3? )?-m pytest\b.*")
_FLAGS = re.compile(r"\s(?:-q|-v|-p \S+|--tb=\S+)(?=\s|$)")


def entries_from_pytest(text: str, date: str, commit: str, machine: str, run: str, source: str) -> list[dict]:
    """One `tests` entry per pytest summary line of a log ("3 failed, 110 passed ... in 241.89s"),
    with the command the log states before it (a line naming `-m pytest`), if any. Its workload is
    what the command selects (`-m gpu tests/model -k 'not slow'`), or `pytest`."""
    entries, command, names = [], None, {}
    for line in text.splitlines():
        found = _COMMAND.search(line)
        if found and not _SUMMARY.match(line):
            command = re.split(r"\s{2,}", found.group(0).strip())[0]  # two spaces end it: "cmd  (machine C)"
            continue
        summary = _SUMMARY.match(line)
        if not summary:
            continue
        counts = {word: int(number) for number, word in (part.split() for part in summary.group(1).split(", "))}
        figures = {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0)}
        counts.setdefault("errors", counts.get("error", 0))
        figures |= {name: counts[name] for name in ("skipped", "errors", "deselected") if counts.get(name)}
        figures["seconds"] = float(summary.group(2))
        selection = _FLAGS.sub("", " " + command.split("pytest", 1)[1]).strip() if command else "pytest"
        names[selection] = names.get(selection, 0) + 1
        workload = selection if names[selection] == 1 else f"{selection} ({names[selection]})"
        entries.append(entry(date, commit, machine, run, workload, "tests", "the test suite", figures, source,
                             command=command))
    return entries


def read(path: Path | str) -> list[dict]:
    """Every entry of the ledger at `path`, in the order appended (none if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def line(made: dict) -> str:
    """An entry as its ledger line, fields in FIELDS order."""
    return json.dumps({name: made[name] for name in FIELDS if name in made}) + "\n"


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(handle.name, path)


def append(path: Path | str, entries: Iterable[dict]) -> int:
    """Append `entries` to the ledger at `path`: the earlier lines are kept byte for byte and the
    file is replaced at once (a reader sees the old ledger or the new one, never a part).

    Returns:
        how many entries were appended

    Raises:
        ValueError: an entry is malformed, or its (run, workload) is already in the ledger or
            twice among `entries` (a run is recorded once), or the ledger's last line is cut.
    """
    path = Path(path)
    entries = [check(made) for made in entries]
    if not entries:
        return 0
    before = path.read_bytes() if path.exists() else b""
    if before and not before.endswith(b"\n"):
        raise ValueError(f"{path} does not end in a newline: its last line was cut; mend it by hand first")
    taken, clashes = {(made["run"], made["workload"]) for made in read(path)}, []
    for made in entries:
        key = (made["run"], made["workload"])
        if key in taken:
            clashes.append(key)
        taken.add(key)
    if clashes:
        shown = ", ".join(f"{run} / {workload}" for run, workload in clashes[:3])
        more = f" and {len(clashes) - 3} more" if len(clashes) > 3 else ""
        raise ValueError(f"{path} already holds (run, workload) {shown}{more}: give the new run another id")
    write_atomically(path, before + "".join(map(line, entries)).encode())
    return len(entries)


# Rendering. Sections follow the model measured, then the kind, then the workload; the headline
# workloads come first, in this order.
ORDER = ("varied_traffic", "distinct_text_1q", "distinct_text_50q", "vision_protocol_image_1q",
         "vision_protocol_image_1q_cache_miss", "training_update", "training_update_varied", "evaluation_throughput",
         "serving")
HEADLINES = (
    ("varied traffic, first sight: p50 / p99 ms", "varied_traffic", ("first_sight_p50_ms", "first_sight_p99_ms")),
    ("the same requests, second pass: p50 ms", "varied_traffic", ("second_pass_p50_ms",)),
    ("distinct_text_1q: p50 ms", "distinct_text_1q", ("p50_ms",)),
    ("distinct_text_50q: p50 ms", "distinct_text_50q", ("p50_ms",)),
    ("vision_protocol_image_1q, feature-cache hit: p50 ms", "vision_protocol_image_1q", ("p50_ms",)),
    ("vision_protocol_image_1q, cache miss: p50 ms", "vision_protocol_image_1q_cache_miss", ("p50_ms",)),
    ("training update: p50 ms", "training_update", ("p50_ms",)),
    ("evaluation: rows/s, overlapped / plain loop", "evaluation_throughput",
     ("rows_per_second", "plain_loop_rows_per_second")),
    ("serving, 1 client: p50 / p95 ms", "serving", ("clients_1_p50_ms", "clients_1_p95_ms")),
    ("serving, 8 clients: decisions/s", "serving", ("clients_8_decisions_per_second",)),
)
COLUMNS = {
    "varied_traffic": ("first_sight_p50_ms", "first_sight_p99_ms", "second_pass_p50_ms", "hugging_face_p50_ms"),
    "evaluation_throughput": ("rows_per_second", "plain_loop_rows_per_second"),
    "serving": ("clients_1_p50_ms", "clients_1_p95_ms", "clients_8_decisions_per_second", "failed", "lost"),
    "training_update": ("p50_ms", "computed_tokens", "graph_replays"),
    "training_update_varied": ("p50_ms", "mean_ms", "graph_eager", "graph_replays"),
}
_REPLAY_COLUMNS = ("p50_ms", "p95_ms", "hugging_face_p50_ms")
_PROFILE_COLUMNS = ("plain_predict_p50_ms", "encode_ms", "load_into_the_graph_ms", "wait_for_the_logits_ms",
                    "answers_ms")
_MORE = ("computed_tokens", "efficiency", "peak_allocated_mib")  # also named in a workload's latest line
_HISTORY = 8  # commits a workload's table shows


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _spread(values: list) -> str:
    low, high = min(values), max(values)
    return _fmt(low) if _fmt(low) == _fmt(high) else f"{_fmt(low)}-{_fmt(high)}"


def _label(key: str) -> str:
    for old, new in (("_ms", " ms"), ("_mib", " MiB"), ("_per_second", "/s"), ("hugging_face", "Hugging Face")):
        key = key.replace(old, new)
    return key.replace("_", " ")


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(row) + " |" for row in rows]


def _in_time(entries: list[dict]) -> list[dict]:
    """Oldest first: by date, then by the order appended."""
    return [made for _, made in sorted(enumerate(entries), key=lambda pair: (pair[1]["date"], pair[0]))]


def _columns(workload: str, kind: str, group: list[dict]) -> list[str]:
    wanted = COLUMNS.get(workload, {"replay": _REPLAY_COLUMNS, "profile": _PROFILE_COLUMNS}.get(kind, ()))
    present = {key for made in group for key in made["figures"]}
    columns = [key for key in wanted if key in present]
    return columns or list(group[-1]["figures"])[:4]


def _where(made: dict) -> str:
    return f"{made['machine']}, {made['commit']}, {made['date']}, run `{made['run']}`"


def _headline_rows(entries: list[dict]) -> tuple[str | None, list[list[str]]]:
    timed = [made for made in _in_time(entries) if made["kind"] != "tests"]
    names = {workload for _, workload, _ in HEADLINES}
    shapes = [made["shape"] for made in timed if made["workload"] in names]
    if not shapes:
        return None, []
    shape, rows = shapes[-1], []
    for label, workload, keys in HEADLINES:
        group = [made for made in timed if made["workload"] == workload and made["shape"] == shape
                 and made["kind"] == kind_of(workload)]
        if not group or not any(key in group[-1]["figures"] for key in keys):
            continue
        latest = group[-1]
        same = [made for made in group if made["commit"] == latest["commit"]]
        value = " / ".join(_fmt(latest["figures"].get(key)) for key in keys)
        spread = " / ".join(_spread(values) if values else "-" for values in (
            [made["figures"][key] for made in same if key in made["figures"]] for key in keys))
        runs = f"{spread} ({len(same)} runs)" if len(same) > 1 else "1 run"
        rows.append([label, f"**{value}**", latest["kind"], latest["machine"], latest["commit"], latest["date"], runs])
    return shape, rows


def _headline_table(entries: list[dict]) -> tuple[str | None, list[str]]:
    shape, rows = _headline_rows(entries)
    header = ("figure", "latest", "kind", "machine", "commit", "date", "all runs of that commit")
    return shape, _table(header, rows)


def readme_table(entries: list[dict]) -> str:
    """The current headline figures: the latest run of each headline workload (of the model most
    recently measured), with its machine, commit, date and kind, and the spread of every run of
    that commit."""
    shape, table = _headline_table(entries)
    if shape is None:
        return "No figures recorded yet.\n"
    intro = (f"Latest run of each workload, {shape}; replay: one request or update repeated, varied: distinct "
             f"requests. Generated from `benchmarks/ledger.jsonl` by `{RENDER_COMMAND}`; every run is in "
             "[docs/figures.md](docs/figures.md).")
    return "\n".join([intro, "", *table]) + "\n"


def _by_commit(group: list[dict]) -> list[tuple[str, list[dict]]]:
    """(commit, its runs newest first), the commit of the newest run first."""
    commits = {}
    for made in reversed(group):
        commits.setdefault(made["commit"], []).append(made)
    return list(commits.items())


def _cell(runs: list[dict], key: str) -> str:
    values = [made["figures"][key] for made in runs if key in made["figures"]]
    return _spread(values) if values else "-"


def _history(header: list[str], commits: list[tuple[str, list[dict]]], cells) -> list[str]:
    """A table of runs by commit, newest first, `cells(runs)` giving a row's figures; the notes of
    its runs in a last column when any has one; the older commits counted below it."""
    rows = []
    for commit, runs in commits[:_HISTORY]:
        machines = ", ".join(dict.fromkeys(made["machine"] for made in reversed(runs)))
        notes = "; ".join(dict.fromkeys(part for made in reversed(runs) for part in made.get("note", "").split("; ")
                                        if part))
        rows.append([runs[0]["date"], commit, str(len({made["run"] for made in runs})), machines, *cells(runs),
                     notes])
    header = ["date", "commit", "runs", "machine", *header, "note"]
    if not any(row[-1] for row in rows):
        header, rows = header[:-1], [row[:-1] for row in rows]
    lines = [""] + _table(header, rows)
    older = [made for _, runs in commits[_HISTORY:] for made in runs]
    if older:
        first = min(made["date"] for made in older)
        lines.append(f"\nAnd {len({made['run'] for made in older})} older runs of {len(commits) - _HISTORY} commits, "
                     f"from {first}, in the ledger.")
    return lines


def _workload_section(workload: str, kind: str, group: list[dict]) -> list[str]:
    latest, columns = group[-1], _columns(workload, kind, group)
    named = columns + [key for key in _MORE if key in latest["figures"] and key not in columns]
    figures = ", ".join(f"{_label(key)} {_fmt(latest['figures'][key])}" for key in named if key in latest["figures"])
    lines = [f"#### {workload}", "", f"Latest: {figures} ({_where(latest)})."]
    if latest.get("note"):
        lines[-1] += f" {latest['note']}"
    if len(group) > 1:
        lines += _history(list(map(_label, columns)), _by_commit(group),
                          lambda runs: [_cell(runs, key) for key in columns])
    return lines + [""]


def _others_section(kind: str, groups: dict[str, list[dict]]) -> list[str]:
    """The workloads outside ORDER in one table: each one's first figure, by commit."""
    keys = {workload: _columns(workload, kind, group)[0] for workload, group in groups.items()}
    everything = [made for group in groups.values() for made in group]
    position = {id(made): index for index, made in enumerate(_in_time(everything))}
    commits = _by_commit(sorted(everything, key=lambda made: position[id(made)]))
    header = [f"{workload}: {_label(key)}" for workload, key in keys.items()]
    runs_of = lambda runs, workload: [made for made in runs if made["workload"] == workload]
    lines = ["#### " + ", ".join(groups), ""]
    return lines + _history(header, commits, lambda runs: [
        _cell(runs_of(runs, workload), key) for workload, key in keys.items()])[1:] + [""]


def _tests_section(entries: list[dict]) -> list[str]:
    tests = list(reversed(_in_time([made for made in entries if made["kind"] == "tests"])))
    if not tests:
        return []
    rows = [[made["date"], made["commit"], made["machine"], _fmt(made["figures"].get("passed")),
             _fmt(made["figures"].get("failed")), ": ".join(
                 part for part in (made.get("command") and f"`{made['command']}`", made.get("note")) if part)]
            for made in tests]
    return ["## Test runs", "", "Newest first; the counts are pytest's own summary of each command.", "",
            *_table(("date", "commit", "machine", "passed", "failed", "what ran"), rows), ""]


def render(entries: list[dict]) -> str:
    """The Markdown of docs/figures.md: the headline table, then for each model measured, each
    kind and each workload its latest figures and a table of runs by commit, then test outcomes."""
    ordered = _in_time([check(made) for made in entries])
    lines = ["# Measured figures", "",
             f"Generated by `{RENDER_COMMAND}` from `benchmarks/ledger.jsonl`, the append-only ledger of "
             "every measured run; never edited by hand. A benchmark stage run is recorded with", "",
             f"    {RECORD_COMMAND}", "",
             "Every figure names its machine, commit and date; ms are p50 unless said. Kinds:", ""]
    lines += [f"- **{kind}**: {meaning}" for kind, (_, meaning) in KINDS.items()]
    shape, table = _headline_table(entries)
    if shape is not None:
        lines += ["", "## Current figures", "", f"The latest run of each headline workload, {shape}.", "", *table]
    lines.append("")
    timed = [made for made in ordered if made["kind"] != "tests"]
    shapes = list(dict.fromkeys(made["shape"] for made in reversed(timed)))
    for shape in shapes:
        lines += [f"## {shape}", ""]
        for kind in KINDS:
            groups = {}
            for made in timed:
                if made["shape"] == shape and made["kind"] == kind:
                    groups.setdefault(made["workload"], []).append(made)
            if not groups:
                continue
            lines += [f"### {KINDS[kind][0]}", ""]
            rank = {workload: index for index, workload in enumerate(ORDER)}
            ranked = sorted(groups, key=lambda name: (rank.get(name, len(ORDER)), name))
            # Headline workloads, and profiles (few, each its own steps), get a section of their own.
            alone = [workload for workload in ranked if workload in rank or kind == "profile" or len(groups) == 1]
            for workload in alone:
                lines += _workload_section(workload, kind, groups[workload])
            others = {workload: groups[workload] for workload in ranked if workload not in alone}
            if others:
                lines += _others_section(kind, others)
    lines += _tests_section(ordered)
    return "\n".join(lines).rstrip("\n") + "\n"


def replace_block(text: str, block: str) -> str | None:
    """`text` with what lies between the figures markers replaced by `block`; None without both."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[: start + len(START)] + "\n" + block.rstrip("\n") + "\n" + text[end:]


def update_markdown(path: Path | str, entries: list[dict]) -> bool:
    """Rewrite the figures block of the Markdown file at `path` with `readme_table(entries)`.

    Returns:
        whether the file changed (False also when it has no markers)
    """
    path = Path(path)
    text = path.read_text()
    updated = replace_block(text, readme_table(entries))
    if updated is None or updated == text:
        return False
    write_atomically(path, updated.encode())
    return True
