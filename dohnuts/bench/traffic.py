"""Varied traffic: seeded requests of every shape, as users send them: the benchmark's varied
requests (1 to 10 questions) and the serving mix (1 to 20 questions, 2 to 40 options, states
from a line to about 1,500 words)."""

from __future__ import annotations

import math
import random

from PIL import Image, ImageDraw

WORDS = ("invoice", "refund", "parcel", "login", "password", "crash", "upgrade", "billing", "delivery", "account",
         "error", "slow", "payment", "order", "support", "urgent", "tomorrow", "twice", "missing", "broken")
IMAGE_SIDES = (64, 96, 160, 224)


def varied_requests(count: int, seed: int = 0, image_every: int = 4) -> list[tuple[dict, dict]]:
    """`count` distinct (state, questions) pairs: every `image_every`-th state carries a new
    image (its own size and colours, under "image"), states of 2 to 300 words (log-uniform),
    1 to 10 questions of all three types with 2 to 6 candidates. Seeded: the same set each run.
    """
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        state = _state(rng, f"T-{seed}-{index:05d}", 2, 300, index, image=index % image_every == 0)
        questions = {}
        for number in range(rng.randint(1, 10)):
            kind = ("noul", "choice", "score")[number % 3]
            if kind == "noul":
                questions[f"q{number}"] = {"type": "noul", "instructions": f"Is the message about {rng.choice(WORDS)}?"}
            elif kind == "choice":
                questions[f"q{number}"] = {"type": "choice", "instructions": "Which topic fits best?",
                                           "criteria": rng.sample(WORDS, rng.randint(2, 6))}
            else:
                questions[f"q{number}"] = {"type": "score", "instructions": "How urgent is it?",
                                           "criteria": ["not at all", "somewhat", "very"][: rng.randint(2, 3)]}
        requests.append((state, questions))
    return requests


def _state(rng: random.Random, ticket: str, shortest: int, longest: int, index: int, image: bool) -> dict:
    """A state: its ticket, a message of `shortest` to `longest` words (log-uniform), and, when
    `image`, a new image drawn for `index`."""
    length = round(math.exp(rng.uniform(math.log(shortest), math.log(longest))))
    state: dict = {"ticket": ticket, "message": " ".join(rng.choice(WORDS) for _ in range(length))}
    if image:
        state["image"] = _image(rng, index)
    return state


def _image(rng: random.Random, index: int, sides=IMAGE_SIDES) -> Image.Image:
    """A new image: its own size and colours."""
    image = Image.new("RGB", (rng.choice(sides), rng.choice(sides)), "white")
    colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
    ImageDraw.Draw(image).rectangle([8, 8, 40 + index % 20, 40], fill=colour)
    return image


def serving_mix(count: int, seed: int = 0, image_every: int = 6) -> list[tuple[dict, dict]]:
    """`count` distinct (state, questions) pairs as agents and routers send them: states from a
    line to about 1,500 words (log-uniform, 8 to 1,500), every `image_every`-th with a new image
    (under "image"), 1 to 20 questions (uniform) of all three types, choices of 2 to 40 options
    (log-uniform) and scores of 2 to 10 levels. Seeded: the same mix each run.
    """
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        state = _state(rng, f"T-{seed}-{index:06d}", 8, 1500, index, image=index % image_every == 0)
        requests.append((state, _questions(rng, SERVING_WORDING, described=False)))
    return requests


def _questions(rng: random.Random, wording: dict, described: bool) -> dict:
    """1 to 20 questions (uniform) of all three types, phrased by `wording` (templates over
    {topic}, {word}, {option} and {level}): choices of 2 to 40 options (log-uniform), half of
    them with a description per option when `described`, and scores of 2 to 10 levels."""
    questions = {}
    for number in range(rng.randint(1, 20)):
        kind = rng.choice(("noul", "choice", "score"))
        topic = rng.choice(WORDS)
        if kind == "noul":
            questions[f"q{number}"] = {"type": "noul", "instructions": wording["noul"].format(topic=topic)}
        elif kind == "choice":
            options = round(math.exp(rng.uniform(math.log(2), math.log(40))))
            labels = [wording["option"](rng, topic, option) for option in range(options)]
            criteria = labels
            if described and rng.random() < 0.5:
                criteria = {label: " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for label in labels}
            questions[f"q{number}"] = {"type": "choice", "instructions": f"Which {topic} case is it?",
                                       "criteria": criteria}
        else:
            levels = rng.randint(2, 10)
            questions[f"q{number}"] = {"type": "score", "instructions": wording["score"].format(topic=topic),
                                       "criteria": [wording["level"].format(level=level, topic=topic)
                                                    for level in range(levels)]}
    return questions


SERVING_WORDING = {"noul": "Is the message about {topic}?",
                   "option": lambda rng, topic, option: f"{rng.choice(WORDS)} {rng.choice(WORDS)} {option}",
                   "score": "How much is it about {topic}?", "level": "level {level} of {topic}"}
REAL_WORDING = {"noul": "Does the customer mention {topic}?",
                "option": lambda rng, topic, option: f"{topic} {rng.choice(WORDS)} {option}",
                "score": "How severe is the {topic} issue?", "level": "severity {level}"}


def percentile(samples: list[float], q: float) -> float:
    """Linear interpolation at index q * (n - 1) of the sorted samples (latency percentiles of
    the benchmark and the load generator)."""
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


REAL_IMAGE_SIDES = (160, 1200)  # a side of a real-traffic image, pixels (uniform)


def real_traffic(count: int, seed: int = 37) -> list[tuple[dict, dict]]:
    """`count` distinct (state, questions) pairs shaped like the niche's real clients (issue 37),
    harder than the serving mix: states from a line to about 1,500 words (log-uniform, 5 to
    1,500), a third with a new photo-like image of 160 to 1,200 pixels a side (each side drawn
    apart, so aspect ratios vary), 1 to 20 questions of all three types, choices of 2 to 40
    options (log-uniform), half of them with a description per option. Seeded apart from the
    other generators: none of its requests is one of theirs."""
    rng = random.Random(f"real-traffic-{seed}")
    requests = []
    for index in range(count):
        state = _state(rng, f"R-{seed}-{index:05d}", 5, 1500, index, image=False)
        if index % 3 == 0:
            state["image"] = _photo(rng, index)
        requests.append((state, _questions(rng, REAL_WORDING, described=True)))
    return requests


def _photo(rng: random.Random, index: int) -> Image.Image:
    """A photo-like image of its own size: a gradient, shapes and noise, so no two are alike and
    none is one flat colour."""
    width, height = (rng.randint(*REAL_IMAGE_SIDES) for _ in range(2))
    top, bottom = (tuple(rng.randrange(256) for _ in range(3)) for _ in range(2))
    gradient = Image.linear_gradient("L").resize((width, height))
    image = Image.composite(Image.new("RGB", (width, height), top), Image.new("RGB", (width, height), bottom),
                            gradient)
    draw = ImageDraw.Draw(image)
    for _ in range(3 + index % 5):
        x, y = rng.randrange(width), rng.randrange(height)
        size = rng.randint(8, max(9, min(width, height) // 3))
        draw.ellipse([x, y, x + size, y + size], fill=tuple(rng.randrange(256) for _ in range(3)))
    noise = Image.effect_noise((width, height), 24).convert("RGB")
    return Image.blend(image, noise, 0.15)
