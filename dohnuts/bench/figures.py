"""docs/figures.md and the README's figures table, rendered from the figures ledger (`bench.ledger`).

Only the standard library, like the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .ledger import KINDS, RECORD_COMMAND, RENDER_COMMAND, check, kind_of, write_atomically

START, END = "<!-- figures:start -->", "<!-- figures:end -->"  # the README block `update_markdown` rewrites

# Rendering. Sections follow the model measured, then the kind, then the workload; the headline
# workloads come first, in this order.
ORDER = ("varied_traffic", "distinct_text_1q", "distinct_text_50q", "vision_protocol_image_1q",
         "vision_protocol_image_1q_cache_miss", "vision_protocol_images_4q", "vision_protocol_images_4q_cache_miss",
         "training_update", "training_update_varied", "evaluation_throughput",
         "serving")
HEADLINES = (
    ("varied traffic, first sight: p50 / p99 ms", "varied_traffic", ("first_sight_p50_ms", "first_sight_p99_ms")),
    ("the same requests, second pass: p50 ms", "varied_traffic", ("second_pass_p50_ms",)),
    ("distinct_text_1q: p50 ms", "distinct_text_1q", ("p50_ms",)),
    ("distinct_text_50q: p50 ms", "distinct_text_50q", ("p50_ms",)),
    ("vision_protocol_image_1q, feature-cache hit: p50 ms", "vision_protocol_image_1q", ("p50_ms",)),
    ("vision_protocol_image_1q, cache miss: p50 ms", "vision_protocol_image_1q_cache_miss", ("p50_ms",)),
    ("vision_protocol_images_4q (4 images), feature-cache hit: p50 ms", "vision_protocol_images_4q", ("p50_ms",)),
    ("vision_protocol_images_4q (4 images), cache miss: p50 ms", "vision_protocol_images_4q_cache_miss",
     ("p50_ms",)),
    ("training update: p50 ms", "training_update", ("p50_ms",)),
    ("evaluation: rows/s, overlapped / plain loop", "evaluation_throughput",
     ("rows_per_second", "plain_loop_rows_per_second")),
    ("serving, 1 client: p50 / p95 ms", "serving", ("clients_1_p50_ms", "clients_1_p95_ms")),
    ("serving, 8 clients: decisions/s", "serving", ("clients_8_decisions_per_second",)),
)
COLUMNS = {
    "varied_traffic": ("first_sight_p50_ms", "first_sight_p99_ms", "second_pass_p50_ms", "hugging_face_p50_ms"),
    **dict.fromkeys(("real_traffic", "real_traffic_serving_mix"),
                    ("first_sight_p50_ms", "first_sight_p99_ms", "first_sight_max_ms", "hugging_face_p50_ms")),
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
        # The latest run that has the figure: a run cut short (a serving run stopped before its
        # closed loops) leaves the headline to the run before.
        group = [made for made in timed if made["workload"] == workload and made["shape"] == shape
                 and made["kind"] == kind_of(workload) and any(key in made["figures"] for key in keys)]
        if not group:
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
