"""The guard: text fingerprints (of an external benchmark's inputs, say) whose rows leave every partition.

A fingerprint is the SHA-256 of a text's words, case folded, joined by single spaces, so
punctuation, case and spacing do not hide a match. A state matches when its rendered text or
any string inside it (at any depth) has a fingerprint in the list. Exact matches only: a
paraphrase is not caught.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_WORD = re.compile(r"\w+")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def fingerprint(text: str) -> str | None:
    """The fingerprint of a text, or None for a text without words."""
    words = _WORD.findall(text.casefold())
    return hashlib.sha256(" ".join(words).encode()).hexdigest() if words else None


def read_guard(path: Path) -> frozenset[str]:
    """The fingerprints of a guard file: one hex SHA-256 a line; blank lines and # comments allowed.

    Raises:
        FileNotFoundError: no such file; ValueError: a line that is not a fingerprint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.guard {path} does not exist")
    found = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.split("#", 1)[0].strip().lower()
        if not line:
            continue
        if not _DIGEST.fullmatch(line):
            raise ValueError(f"{path}:{number}: a guard line is one hex SHA-256 fingerprint, got {line[:80]!r}")
        found.add(line)
    return frozenset(found)


def strings(value) -> list[str]:
    """Every string inside a state (mapping values and list items, at any depth)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for key, item in value.items() if key != "image" for text in strings(item)]
    if isinstance(value, (list, tuple)):
        return [text for item in value for text in strings(item)]
    return []


def guarded(state, text: str, fingerprints: frozenset[str]) -> bool:
    """Whether a state (its rendered `text`, or a string inside it) is in the guard list."""
    return any(fingerprint(candidate) in fingerprints for candidate in [text, *strings(state)])
