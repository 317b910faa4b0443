"""Offline batch prediction: a JSONL of requests in, one answer line per request out, resumable."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from ..data.user_records import KEYS, decoded_state
from .wire import ALIAS, parse_system_one

CHUNK = 64  # requests a model invocation, and a chunk of output written and synced together
WIRE_KEYS = {"model", "assets"}  # a /v1/systemone body's own fields (and any x_ one), read too


def _request(line: str, folder: Path) -> tuple[object, dict]:
    """(state, questions) of one input line: the record format without labels (an image path is
    relative to the input file, as in records), or a /v1/systemone body as a client sends it
    (`model`, `assets` of base64 images named by placeholders, `x_` fields)."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError(f"a request line must be a JSON object, got {type(record).__name__}")
    unknown = {key for key in set(record) - KEYS - WIRE_KEYS if not key.startswith("x_")}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    if "state" not in record or "questions" not in record:
        raise ValueError("a request needs 'state' and 'questions'")
    if record.get("assets") is not None:  # the wire format's images: as the server reads them
        body = {"model": ALIAS, **{key: value for key, value in record.items()
                                    if key in ("state", "questions") or key not in KEYS}}
        state, questions, _ = parse_system_one(body)
        return state, questions
    state, problems = decoded_state(folder, record["state"])
    if problems:
        raise ValueError("; ".join(problems))
    return state, record["questions"]


def input_lines(source: Path) -> list[str]:
    """The lines of a JSONL file, split at line feeds only (JSON text may hold U+2028 and the
    like raw, which `str.splitlines` would also split at), a carriage return before one dropped.

    Raises:
        ValueError: the file is not UTF-8.
    """
    try:
        text = source.read_text(encoding="utf-8-sig")  # a BOM first is dropped
    except UnicodeDecodeError as error:
        raise ValueError(f"{source} is not UTF-8 text: {error}") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def answered_lines(output: Path, lines: list[str]) -> int:
    """Lines of `lines` already answered in `output` by an earlier run of this input, so a rerun
    skips them; a last line cut by a kill is removed. Only a file of such answers is touched.

    Raises:
        ValueError: `output` holds something else: a line that is not the answer to the input's
            line of its number (another file, another input), which a rerun must not append to.
    """
    if not output.is_file():
        return 0
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    for number, text in enumerate(complete.decode("utf-8", errors="replace").split("\n")[:-1], 1):
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if not (isinstance(answer, dict) and answer.get("line") == number and number <= len(lines)
                and answer.get("id") == _identifier(lines[number - 1])):
            raise ValueError(f"{output} line {number} is not the answer to line {number} of this input: it holds "
                             f"something else (another file, or another input's answers); choose another output")
    if len(complete) != len(data):
        with open(output, "r+b") as handle:
            handle.truncate(len(complete))
    return complete.count(b"\n")


def predict_file(predictor, source: Path, output: Path, chunk: int = CHUNK, progress: bool = True) -> dict:
    """Answer every request line of `source` into `output`, in order, one line each: the
    request's id (or null) and line number with its answers and usage, or with the error that
    made it invalid (the run goes on). Lines already answered in `output` are skipped; each
    chunk is appended and synced to disk before the next is run, so a kill loses nothing
    answered. Blank input lines get an error line too, so output line n answers input line n.

    Returns:
        {"lines", "skipped" (answered before), "answered", "errors"}

    Raises:
        ValueError: the output is the input, holds something other than this input's answers,
            or the input is not UTF-8.
    """
    source, output = Path(source), Path(output)
    if output.resolve() == source.resolve():
        raise ValueError(f"the output {output} is the input file: choose another")
    lines = input_lines(source)
    done = answered_lines(output, lines)
    counts = {"lines": len(lines), "skipped": min(done, len(lines)), "answered": 0, "errors": 0}
    bar = tqdm(total=len(lines), initial=counts["skipped"], desc="predict", unit="request", disable=not progress)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as handle:
        for start in range(counts["skipped"], len(lines), chunk):
            numbers = range(start + 1, min(start + chunk, len(lines)) + 1)
            parsed, results = {}, {}
            for number in numbers:
                try:
                    parsed[number] = _request(lines[number - 1], source.parent)
                except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
                    results[number] = error
            answers = predictor.predict_many(list(parsed.values()), errors="return") if parsed else []
            results.update(zip(parsed, answers))
            out = []
            for number in numbers:
                result = results[number]
                identifier = _identifier(lines[number - 1])
                if isinstance(result, BaseException):
                    counts["errors"] += 1
                    out.append({"id": identifier, "line": number, "error": f"{type(result).__name__}: {result}"})
                else:
                    counts["answered"] += 1
                    out.append({"id": identifier, "line": number, **result})
            handle.write("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in out))
            handle.flush()
            os.fsync(handle.fileno())
            bar.update(len(numbers))
    bar.close()
    return counts


def _identifier(line: str):
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("id") if isinstance(record, dict) else None
