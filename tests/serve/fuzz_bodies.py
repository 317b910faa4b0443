"""Seeded fuzzed requests for the server: valid wire bodies mutated where clients go wrong (the
JSON's values and keys, its bytes, its transport: compression, multipart, images).

`fuzzed(count, seed)` yields (name of the mutation, body bytes, headers, multipart files or
None); the same seed gives the same requests.
"""

import base64
import copy
import gzip
import io
import json
import random
import struct
import zlib

import zstandard
from PIL import Image

PLACEHOLDER = "<image:" + "7" * 32 + ">"
DEEP = "__nested__"
JSON = {"content-type": "application/json"}
ODD_VALUES = (None, True, 0, -1, 1.5, 1e308, -1e308, 2**70, "", " ", "\x00", "\u202e\ufeff", "é" * 50, "<|im_end|>",
              "<image:" + "0" * 32 + ">", [], [None], {}, {"": None}, [[[]]], "x" * 5000)


def _png(width: int = 24, height: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels over a few bytes of data."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    ihdr = struct.pack(">I", len(header)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    data = zlib.compress(b"\x00" * 64)
    idat = struct.pack(">I", len(data)) + b"IDAT" + data + struct.pack(">I", zlib.crc32(b"IDAT" + data))
    return b"\x89PNG\r\n\x1a\n" + ihdr + idat + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))


def bases(rng: random.Random) -> list[dict]:
    """Valid bodies of every form the wire format allows: text and object states, the three
    question types, choices as mappings with and without descriptions, an image asset."""
    png = base64.b64encode(_png()).decode()
    return [
        {"model": "jev-latest", "state": "a parcel arrived broken", "questions": {
            "broken": {"type": "noul", "instructions": "Is it broken?"}}},
        {"model": "jev-latest", "state": {"ticket": "T-1", "message": "refund me twice", "lines": [1, 2]},
         "questions": {"topic": {"type": "choice", "instructions": "Which topic?",
                                 "criteria": {"billing": None, "delivery": "a parcel's trip", "login": None}},
                       "urgency": {"type": "score", "instructions": "How urgent?",
                                   "criteria": ["not", "somewhat", "very"]}}},
        {"model": "jev-latest", "state": {"photo": PLACEHOLDER, "note": "see the picture"},
         "assets": {PLACEHOLDER: {"type": "image", "format": "png", "data_base64": png}},
         "questions": {"red": {"type": "noul", "instructions": "Is it red?"},
                       "shape": {"type": "choice", "criteria": {"square": None, "circle": None}}}},
        {"model": "jev-latest", "state": " ".join(rng.choice(("ok", "late", "broken")) for _ in range(60)),
         "questions": {f"q{index}": {"type": "noul", "instructions": f"Is it {index}?"} for index in range(6)}},
    ]


def _paths(value, path=()):
    """Every (path, value) inside a JSON value, the root first."""
    yield path, value
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _paths(inner, (*path, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from _paths(inner, (*path, index))


def _set(body, path, value):
    target = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value


def _delete(body, path):
    target = body
    for step in path[:-1]:
        target = target[step]
    del target[path[-1]]


def _mutate_json(rng: random.Random, base: dict) -> tuple[str, dict]:
    body = copy.deepcopy(base)
    paths = [path for path, _ in _paths(body) if path]
    path = rng.choice(paths)
    kind = rng.choice(("replace", "delete", "insert", "many", "wide", "deep", "type"))
    if kind == "replace":
        _set(body, path, copy.deepcopy(rng.choice(ODD_VALUES)))
    elif kind == "delete":
        _delete(body, path)
    elif kind == "insert":
        containers = [(path, value) for path, value in _paths(body) if isinstance(value, dict)]
        target = rng.choice(containers)[1]
        target[rng.choice(("type", "criteria", "instructions", "", "model", "state", "x" * 300))] = copy.deepcopy(
            rng.choice(ODD_VALUES))
    elif kind == "many":  # far more questions or options than allowed
        questions = {f"q{index}": {"type": "noul"} for index in range(rng.choice((0, 257, 1000)))}
        body["questions"] = questions
    elif kind == "wide":
        body["questions"] = {"q": {"type": "choice", "criteria": {f"o{index}": None for index in
                                                                  range(rng.choice((0, 1, 256, 2000)))}}}
    elif kind == "deep":  # nested arrays, spliced into the encoded body (`encode`)
        _set(body, path, f"{DEEP}{rng.choice((50, 500, 1500))}")
    else:
        questions = body.get("questions")
        if isinstance(questions, dict) and questions:
            qid = rng.choice(list(questions))
            questions[qid] = {**questions[qid], "type": rng.choice(("choice", "noul", "score", "box", 3, None))} \
                if isinstance(questions[qid], dict) else questions[qid]
    return f"json-{kind}", body


def encode(body: dict) -> bytes:
    """The JSON of a mutated body, its DEEP marker replaced by arrays nested that deep (deeper
    than Python's own encoder goes)."""
    text = json.dumps(body)
    start = text.find(f'"{DEEP}')
    if start < 0:
        return text.encode()
    end = text.index('"', start + 1)
    depth = int(text[start + 1 + len(DEEP):end])
    return (text[:start] + "[" * depth + '"end"' + "]" * depth + text[end + 1:]).encode()


def _mutate_bytes(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    kind = rng.choice(("truncate", "flip", "insert", "empty", "garbage", "latin1", "numbers"))
    if kind == "truncate":
        return "bytes-truncate", data[:rng.randrange(len(data))]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return "bytes-flip", bytes(out)
    if kind == "insert":
        at = rng.randrange(len(data))
        return "bytes-insert", data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[at:]
    if kind == "empty":
        return "bytes-empty", b""
    if kind == "garbage":
        return "bytes-garbage", bytes(rng.randrange(256) for _ in range(rng.randint(1, 2000)))
    if kind == "latin1":
        return "bytes-latin1", data.replace(b"a", b"\xe9", 3)
    return "bytes-numbers", data.replace(b'"jev-latest"', rng.choice((b"1e999", b"NaN", b"-Infinity", b"0x10")))


def _transport(rng: random.Random, data: bytes) -> tuple[str, bytes, dict]:
    kind = rng.choice(("gzip", "zstd", "bad-gzip", "bad-zstd", "lying-encoding", "unknown-encoding", "type"))
    if kind == "gzip":
        return "gzip", gzip.compress(data), {**JSON, "content-encoding": "gzip"}
    if kind == "zstd":
        return "zstd", zstandard.ZstdCompressor().compress(data), {**JSON, "content-encoding": "zstd"}
    if kind == "bad-gzip":
        packed = bytearray(gzip.compress(data))
        packed[rng.randrange(10, len(packed))] ^= 0xFF
        return "bad-gzip", bytes(packed[:rng.randrange(11, len(packed) + 1)]), {**JSON, "content-encoding": "gzip"}
    if kind == "bad-zstd":
        packed = bytearray(zstandard.ZstdCompressor().compress(data))
        packed[rng.randrange(4, len(packed))] ^= 0xFF
        return "bad-zstd", bytes(packed[:rng.randrange(5, len(packed) + 1)]), {**JSON, "content-encoding": "zstd"}
    if kind == "lying-encoding":
        return "lying-encoding", data, {**JSON, "content-encoding": rng.choice(("gzip", "zstd", "deflate"))}
    if kind == "unknown-encoding":
        return "unknown-encoding", data, {**JSON, "content-encoding": rng.choice(("br", "compress", "x" * 100))}
    return "content-type", data, {"content-type": rng.choice(("text/plain", "application/xml", "", "multipart/x"))}


def _multipart(rng: random.Random, base: dict) -> tuple[str, bytes, dict, dict]:
    """The body as the official client sends images: the JSON in a part named `request` whose
    assets map the placeholder to the part `asset-0`, which holds the image; the image or the
    parts mutated."""
    body = {**copy.deepcopy(base), "state": {"photo": PLACEHOLDER, "note": "see"},
            "assets": {PLACEHOLDER: {"type": "image", "part": "asset-0"}}}
    kind = rng.choice(("valid", "truncated-image", "claims-huge", "not-an-image", "no-request", "bad-json",
                       "missing-part"))
    image = {"valid": _png(), "truncated-image": _png()[:rng.randint(8, 60)],
             "claims-huge": _png_claiming(rng.choice((20000, 9000, 70000)), rng.choice((20000, 9000, 1))),
             "not-an-image": b"GIF89a" + bytes(rng.randrange(256) for _ in range(200))}.get(kind, _png())
    request = json.dumps(body).encode() if kind != "bad-json" else b"{\"model\": "
    files = {"asset-0" if kind != "missing-part" else "asset-1": ("image.png", image, "image/png")}
    if kind != "no-request":
        files["request"] = ("request.json", request, "application/json")
    return f"multipart-{kind}", b"", {}, files


def fuzzed(count: int, seed: int = 0):
    """`count` fuzzed requests: (mutation's name, body, headers, multipart files or None)."""
    rng = random.Random(seed)
    valid = bases(rng)
    for _ in range(count):
        base = rng.choice(valid)
        roll = rng.random()
        if roll < 0.45:
            name, body = _mutate_json(rng, base)
            yield name, encode(body), JSON, None
        elif roll < 0.7:
            name, data = _mutate_bytes(rng, json.dumps(base).encode())
            yield name, data, JSON, None
        elif roll < 0.85:
            inner = _mutate_json(rng, base)[1] if rng.random() < 0.5 else base
            name, data, headers = _transport(rng, encode(inner))
            yield name, data, headers, None
        elif roll < 0.95:
            name, data, headers, files = _multipart(rng, base)
            yield name, data, headers, files
        else:
            yield "valid", json.dumps(base).encode(), JSON, None
