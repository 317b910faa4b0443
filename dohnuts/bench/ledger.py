"""The figures ledger: one JSON line per (run, workload), appended and never rewritten
(`bench.figures` renders docs/figures.md and the README's table from it).

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
    "serving": ("Serving", "the server under clients in their own processes: open loop at an offered rate, or "
                "closed loop, each client sending its next request when answered"),
    "profile": ("Profiles", "one call's time, step by step"),
    "pipeline": ("Pipeline", "the whole `dvc repro`"),
    "tests": ("Test runs", "test outcomes, as pytest counted them"),
}
STAGE_RECORDS = "runs/benchmark/benchmarks/dohnuts.jsonl"
RENDER_COMMAND = "python benchmarks/ledger.py render"
RECORD_COMMAND = f"python benchmarks/ledger.py record {STAGE_RECORDS} --machine 'H200 (machine F)'"
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
    if isinstance(entry.get("source"), str) and entry["source"].startswith(("/", "~")):
        problems.append(f"source {entry['source']!r} is a path of one machine: name the file, not where it lay")
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
               "vision_eager", "triton_compiles", "triton_autotunes")
_LEVEL = ("p50_ms", "p95_ms", "p99_ms", "decisions_per_second", "requests_per_second", "mean_batch_requests",
          "achieved_requests_per_second")
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


def _real_traffic(record: dict) -> tuple[dict, dict]:
    part = record.get("first_sight") or {}
    figures = _pick(record, ("requests", "image_requests", "buckets", "bucket_prepare_seconds",
                             "failed_bucket_captures", "hugging_face_p50_ms", "hugging_face_p99_ms",
                             "hugging_face_max_ms"))
    figures |= _pick(part, _PASS, "first_sight_") | _pick(part.get("timed_calls"), _PASS_CALLS, "first_sight_")
    stages = part.get("engine_stages_p50_ms") or {}
    figures |= {f"first_sight_engine_{stage}_p50_ms": stages[stage] for stage in ("prepare", "run", "finish")
                if _number(stages.get(stage))}
    samples = _series(record, hugging_face_ms="hugging_face_samples_ms")
    return figures, samples | _series(part, first_sight_ms="samples_ms")


def _long_context(record: dict) -> tuple[dict, dict]:
    figures = {}
    for request in record.get("requests", []):
        prefix = f"tokens_{request['target_tokens']}_"
        if "refused" in request:
            figures[f"{prefix}refused"] = 1
            continue
        figures |= _pick(request, ("computed_tokens", "first_sight_ms", "second_ms", "computed_tokens_per_second",
                                   "peak_memory_bytes"), prefix)
    return figures, {}


def _load_time(record: dict) -> tuple[dict, dict]:
    """Each load's figures under its kernel cache (`cold_`, then `warm_`, `warm_2_`... for more
    warm loads): its steps' total, its process's and each step's seconds, the Triton kernels
    compiled (those its cache folder gained), the buckets."""
    figures, warm = {}, 0
    for run in record.get("runs", []):
        if run.get("kernel_cache") == "warm":
            warm += 1
            prefix = "warm_" if warm == 1 else f"warm_{warm}_"
        else:
            prefix = "cold_"
        figures |= _pick(run, ("total_seconds", "process_seconds", "buckets", "failed_bucket_captures",
                               "reserved_gib"), prefix)
        figures |= {f"{prefix}{step.replace(' ', '_').replace('-', '_')}_seconds": seconds
                    for step, seconds in (run.get("seconds") or {}).items() if _number(seconds)}
        compiled = run.get("triton_compiles") or {}
        if all(_number(count) for count in compiled.values()) and compiled:
            figures[f"{prefix}triton_compiles"] = sum(compiled.values())
    return figures, {}


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
    """A serving record's figures: each level's under its load (`open_R_` for an offered rate,
    `clients_C_` for closed-loop clients), and the requests that failed or got no answer."""
    figures = _pick(record, ("requests", "images", "questions_per_request"))
    samples = {}
    levels = record.get("levels", [])
    for level in levels:
        if level.get("mode") == "open":
            prefix = f"open_{level['offered_requests_per_second']:g}_"
        else:
            prefix = f"clients_{level['clients']}_"
        figures |= _pick(level, _LEVEL, prefix) | _pick(level.get("timed_calls"), (
            "bucket_replays", "replays", "captures", "idle_captures", "eager"), prefix)
        figures |= _pick(level.get("server"), ("mean_batch_requests", "eager_share", "device_busy_share"), prefix)
        samples |= _series(level, **{f"{prefix}ms": "samples_ms"})
    figures |= {"failed": sum(level.get("failed", 0) for level in levels),
                "lost": sum(level.get("lost", level.get("no_answer", 0)) for level in levels)}
    return figures, samples


def _training(record: dict) -> tuple[dict, dict]:
    figures = _pick(record, _TRAINING) | _pick(record.get("training_graphs"), (
        "eager", "captures", "replays", "failed", "padding_tokens"), "graph_") | _measured(record)
    return figures, _series(record, samples_ms="samples_ms")


def _other(record: dict) -> tuple[dict, dict]:
    """A record's numbers, those of its mappings too (two levels down, `depths_8_padding_share`)."""
    figures = _pick(record, record)
    for name, value in record.items():
        if isinstance(value, dict) and name != "environment":
            figures |= _pick(value, value, f"{name}_")
            for key, inner in value.items():
                if isinstance(inner, dict):
                    figures |= _pick(inner, inner, f"{name}_{key}_")
    return figures, _series(record, samples_ms="samples_ms")


def kind_of(workload: str) -> str:
    """replay, varied, serving or profile: what a benchmark workload's figures stand for."""
    if workload.startswith(("varied_traffic", "real_traffic", "long_context", "training_update_varied", "evaluation")):
        return "varied"
    if workload == "load_time":
        return "profile"
    return "serving" if workload.startswith("serving") else "replay"


def _shape(environment: dict, shape_only: str | None = None) -> str:
    """The model a record measured: its environment's base, else the shape a record without an
    environment names (the serving workload's `shape_only`)."""
    base = environment.get("base") or (f"shape-only:{shape_only}" if shape_only else None)
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
        elif workload.startswith("real_traffic"):  # the serving mix's first sights too
            figures, samples = _real_traffic(record)
        elif workload == "long_context":
            figures, samples = _long_context(record)
        elif workload == "load_time":
            figures, samples = _load_time(record)
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
            kind_of(workload), _shape(environment, record.get("shape_only")), figures, source, samples,
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
