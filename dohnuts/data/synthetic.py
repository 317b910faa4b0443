"""A deterministic synthetic multimodal decision mixture for tiny-model smoke training.

The mixture exists so that a tiny randomly initialised model (hidden size 64, a few layers,
a frozen random vision tower) can be trained and evaluated on a CPU in minutes. Every task is
therefore deliberately easy: short states built from a small vocabulary, the answer always
readable from the state (a copied value, a keyword, a colour, a count of quadrants), and the
same question text recurring with different answers so that the state is always needed.

Each group (task family) draws its answers from a balanced stream, so within a question every
candidate is (up to one) equally often the answer and chance accuracy is 1/K. Some groups give
soft targets (hedged messages, neighbouring urgency levels) to exercise calibration.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image, ImageDraw

from ..schema import NOUL_DEFAULTS
from .image_files import shown_text


@dataclass(frozen=True)
class SyntheticState:
    """One state of the mixture with its questions and their target distributions.

    Attributes:
        group: the task family name, a key of GROUPS.
        state_id: unique and stable within a mixture, f"{group}-{index:05d}".
        state: a string, or a dict holding RGB PIL images (under "image", or several in
            other places: "before" and "after", a list of "photos").
        questions: qid -> {"type", "instructions"[, "criteria"]}, 2 to 4 per state.
        targets: qid -> probabilities over the question's candidates in candidate order
            (choice: criteria order; noul: [false, true]; score: levels 0..K-1).
    """

    group: str
    state_id: str
    state: str | dict
    questions: dict[str, dict]
    targets: dict[str, list[float]]


GROUPS: dict[str, str] = {
    "ticket_fields": "text dict ticket; choice: copy the value of a named field among 4 options",
    "message_tone": "one customer message; noul angry / refund (hedged -> soft), choice of topic",
    "urgency_score": "one support request; score urgency (soft), noul action today, choice of area",
    "image_color": "one big square on white; choice of its colour, noul warm colour",
    "image_count": "1-4 squares in 2x2 quadrants; score the count, noul more than two",
    "image_shape": "one big circle or square; noul circle, choice of colour (mapping criteria)",
    "captioned_image": "caption plus a coloured square; noul caption matches, choice of named colour",
    "image_pair": "two photos of a square, before and after; noul its colour changed, choice of the after colour",
    "image_pair_count": "two photos of 1-3 squares each, in a list; score the squares across both, noul the "
                        "first holds more",
}

# Saturated, well separated fills so that a random frozen vision tower still separates them.
_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "green": (20, 160, 40),
    "blue": (20, 60, 220),
    "yellow": (240, 200, 0),
}
_COLOUR_NAMES = tuple(_COLOURS)
_WARM = {"red", "yellow"}  # two of four colours, so the warm noul is balanced

_TICKET_VALUES: dict[str, tuple[str, ...]] = {
    "customer": ("Mina", "Omar", "Lena", "Ravi", "Sofia", "Jonas", "Aiko", "Pablo"),
    "plan": ("free", "basic", "business", "enterprise"),
    "currency": ("USD", "EUR", "GBP", "JPY"),
    "region": ("north", "south", "east", "west"),
    "channel": ("email", "phone", "chat", "web", "app"),
}
_FIELD_QUESTION = "What value does the state give for {field}?"

# Message tone: a topic sentence, a tone sentence and a refund sentence; the hedged variants
# carry the soft targets.
_TOPICS: dict[str, tuple[str, ...]] = {
    "billing": ("My invoice shows the wrong amount.", "I was charged twice this month."),
    "login": ("I cannot log in to my account.", "My password reset link does not work."),
    "delivery": ("My parcel has not arrived yet.", "The courier left my box at the wrong door."),
    "app": ("The app crashes when I open it.", "The app is very slow on my phone."),
}
_TOPIC_NAMES = tuple(_TOPICS)
_CALM = ("Thanks for your help.", "I hope you have a nice day.")
_ANNOYED = ("I am a bit annoyed.", "This is somewhat frustrating.")
_ANGRY = ("I am furious.", "This is unacceptable.")
_NO_REFUND = ("Please tell me what to do.", "Can you check it for me?")
_MAYBE_REFUND = ("Maybe a refund would be fair.", "I might ask for my money back.")
_REFUND = ("Please refund my payment.", "I want my money back.")
_HEDGED_TRUE = 0.75  # P(true) when the message only hedges

_URGENCY_LEVELS = ("not urgent", "somewhat urgent", "urgent", "critical")
_URGENCY_PHRASES = (
    ("No rush, whenever you have time.", "It can wait until next month."),
    ("Please look at it this week.", "Soon would be nice."),
    ("I need this fixed today.", "Please handle it before tonight."),
    ("Everything is down right now!", "We lose money every minute, fix it now!"),
)
_AREAS: dict[str, tuple[str, ...]] = {
    "reports": ("The weekly report is empty.", "The sales report shows old numbers."),
    "exports": ("The export button fails.", "The CSV export is missing rows."),
    "billing": ("The invoice page shows an error.", "The payment form rejects my card."),
    "login": ("Users cannot sign in.", "The sign in page keeps loading."),
}
_AREA_NAMES = tuple(_AREAS)

_COUNT_LEVELS = ("one square", "two squares", "three squares", "four squares")
_CAPTIONS = ("A {colour} square.", "The square is {colour}.", "This picture shows a {colour} square.")
_TEMPLATE_WORDS = ("State:", "question:", "Options:", "choice", "noul", "score", "level", "false", "true")
_REFERENCE_WORDS = ("ticket", "T-", "Order", "Ticket", "Photo")  # before each state's reference number

# Constant question texts; kept here so that corpus() sees exactly what generate() emits.
_Q_TOPIC = "Which topic is the message about?"
_Q_ANGRY = "Is the customer angry?"
_Q_REFUND = "Does the customer ask for a refund?"
_Q_URGENCY = "How urgent is the request?"
_Q_TODAY = "Does the request need action today?"
_Q_AREA = "Which product area is affected?"
_Q_COLOUR = "What colour is the square?"
_Q_WARM = "Is the square a warm colour?"
_Q_COUNT = "How many squares are there?"
_Q_MORE_THAN_TWO = "Are there more than two squares?"
_Q_CIRCLE = "Is the shape a circle?"
_Q_SHAPE_COLOUR = "What colour is the shape?"
_SHAPE_COLOUR_CRITERIA = {name: f"the shape is {name}" for name in _COLOUR_NAMES}
_Q_MATCH = "Does the caption match the colour of the square?"
_Q_CAPTION_COLOUR = "Which colour does the caption name?"
_Q_CHANGED = "Did the colour of the square change between the two photos?"
_Q_AFTER_COLOUR = "What colour is the square in the after photo?"
_Q_PAIR_COUNT = "How many squares are there in the two photos together?"
_Q_FIRST_MORE = "Does the first photo show more squares than the second?"
_PAIR_COUNT_LEVELS = ("two squares", "three squares", "four squares")
# (first, second) square counts, drawn in equal turns: each total a third of the time, the first
# showing more half of it.
_PAIRS = ((1, 1), (1, 1), (2, 1), (2, 1), (3, 1), (2, 2))


class _Balanced:
    """Draws indices 0..k-1 in shuffled rounds, so every index is drawn equally often (up to one)."""

    def __init__(self, rng: random.Random, k: int):
        self._rng, self._k, self._pool = rng, k, []

    def draw(self) -> int:
        if not self._pool:
            self._pool = list(range(self._k))
            self._rng.shuffle(self._pool)
        return self._pool.pop()


def _choice(instructions: str, criteria) -> dict:
    return {"type": "choice", "instructions": instructions, "criteria": criteria}


def _noul(instructions: str) -> dict:
    return {"type": "noul", "instructions": instructions}


def _score(instructions: str, levels) -> dict:
    return {"type": "score", "instructions": instructions, "criteria": list(levels)}


def _references(rng: random.Random, n: int) -> list[int]:
    """n distinct six-digit reference numbers: every state of a group carries its own, so no two
    states repeat a text (isolation by content then joins nothing)."""
    return rng.sample(range(10**5, 10**6), n)


def _one_hot(index: int, k: int) -> list[float]:
    return [1.0 if i == index else 0.0 for i in range(k)]


def _noul_target(p_true: float) -> list[float]:
    return [1.0 - p_true, p_true]


def _soft_level(level: int, k: int, peak: float = 0.8, neighbour: float = 0.1) -> list[float]:
    """Most mass on the true level and some on its neighbours: adjacent levels are plausible."""
    weights = [peak if i == level else neighbour if abs(i - level) == 1 else 0.0 for i in range(k)]
    total = sum(weights)
    return [w / total for w in weights]


def _canvas(size: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (size, size), "white")
    return image, ImageDraw.Draw(image)


def _big_box(rng: random.Random, size: int) -> list[int]:
    """A square box of side at least half the canvas, placed anywhere that keeps it inside."""
    side = rng.randint(size // 2, 3 * size // 4)
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    return [x0, y0, x0 + side - 1, y0 + side - 1]


def _square_image(rng: random.Random, size: int, colour: str) -> Image.Image:
    image, draw = _canvas(size)
    draw.rectangle(_big_box(rng, size), fill=_COLOURS[colour])
    return image


def _ticket_fields(rng: random.Random, n: int, size: int):
    # One balanced stream per field, so the right option's position is balanced however
    # often that field happens to be asked.
    positions = {field: _Balanced(rng, 4) for field in _TICKET_VALUES}
    for reference in _references(rng, n):
        ticket = {"ticket": f"T-{reference}", **{field: rng.choice(values) for field, values in _TICKET_VALUES.items()}}
        questions, targets = {}, {}
        for field in rng.sample(list(_TICKET_VALUES), rng.randint(2, 4)):
            options = rng.sample([v for v in _TICKET_VALUES[field] if v != ticket[field]], 3)
            position = positions[field].draw()
            options.insert(position, ticket[field])
            questions[f"field_{field}"] = _choice(_FIELD_QUESTION.format(field=field), options)
            targets[f"field_{field}"] = _one_hot(position, 4)
        yield ticket, questions, targets


def _message_tone(rng: random.Random, n: int, size: int):
    topics, angry, refund = _Balanced(rng, len(_TOPICS)), _Balanced(rng, 2), _Balanced(rng, 2)
    for reference in _references(rng, n):
        topic = topics.draw()
        sentences, p_true = [], {}
        for qid, stream, (no, maybe, yes) in (
            ("angry", angry, (_CALM, _ANNOYED, _ANGRY)),
            ("refund", refund, (_NO_REFUND, _MAYBE_REFUND, _REFUND)),
        ):
            if stream.draw() == 0:
                sentences.append(rng.choice(no))
                p_true[qid] = 0.0
            elif rng.random() < 0.5:  # half of the positives only hedge
                sentences.append(rng.choice(maybe))
                p_true[qid] = _HEDGED_TRUE
            else:
                sentences.append(rng.choice(yes))
                p_true[qid] = 1.0
        rng.shuffle(sentences)  # tone and refund in either order, so position is no cue
        text = " ".join([f"Order {reference}:", rng.choice(_TOPICS[_TOPIC_NAMES[topic]]), *sentences])
        questions = {"topic": _choice(_Q_TOPIC, list(_TOPIC_NAMES)), "angry": _noul(_Q_ANGRY),
                     "refund": _noul(_Q_REFUND)}
        targets = {
            "topic": _one_hot(topic, len(_TOPIC_NAMES)),
            "angry": _noul_target(p_true["angry"]),
            "refund": _noul_target(p_true["refund"]),
        }
        yield text, questions, targets


def _urgency_score(rng: random.Random, n: int, size: int):
    levels, areas = _Balanced(rng, len(_URGENCY_LEVELS)), _Balanced(rng, len(_AREAS))
    for reference in _references(rng, n):
        level, area = levels.draw(), areas.draw()
        text = f"Ticket {reference}: {rng.choice(_AREAS[_AREA_NAMES[area]])} {rng.choice(_URGENCY_PHRASES[level])}"
        questions = {
            "urgency": _score(_Q_URGENCY, _URGENCY_LEVELS),
            "today": _noul(_Q_TODAY),
            "area": _choice(_Q_AREA, list(_AREA_NAMES)),
        }
        targets = {
            "urgency": _soft_level(level, len(_URGENCY_LEVELS)),
            "today": _noul_target(1.0 if level >= 2 else 0.0),  # urgent and critical both mean today
            "area": _one_hot(area, len(_AREA_NAMES)),
        }
        yield text, questions, targets


def _image_color(rng: random.Random, n: int, size: int):
    colours = _Balanced(rng, len(_COLOUR_NAMES))
    for _ in range(n):
        colour = _COLOUR_NAMES[colours.draw()]
        questions = {"colour": _choice(_Q_COLOUR, list(_COLOUR_NAMES)), "warm": _noul(_Q_WARM)}
        targets = {
            "colour": _one_hot(_COLOUR_NAMES.index(colour), len(_COLOUR_NAMES)),
            "warm": _noul_target(1.0 if colour in _WARM else 0.0),
        }
        yield {"image": _square_image(rng, size, colour)}, questions, targets


def _squares_image(rng: random.Random, size: int, count: int) -> Image.Image:
    """`count` squares of one colour in distinct quadrants, each with its own insets (so the
    images of one count differ)."""
    half, margin = size // 2, max(1, size // 16)
    image, draw = _canvas(size)
    fill = _COLOURS[rng.choice(_COLOUR_NAMES)]
    for cell in rng.sample(range(4), count):
        x0, y0 = (cell % 2) * half, (cell // 2) * half
        left, top, right, bottom = (rng.randint(max(1, margin // 2), margin + margin // 2) for _ in range(4))
        draw.rectangle([x0 + left, y0 + top, x0 + half - right - 1, y0 + half - bottom - 1], fill=fill)
    return image


def _image_count(rng: random.Random, n: int, size: int):
    counts = _Balanced(rng, len(_COUNT_LEVELS))
    for _ in range(n):
        count = counts.draw() + 1
        image = _squares_image(rng, size, count)
        questions = {"count": _score(_Q_COUNT, _COUNT_LEVELS), "more_than_two": _noul(_Q_MORE_THAN_TWO)}
        targets = {
            "count": _one_hot(count - 1, len(_COUNT_LEVELS)),
            "more_than_two": _noul_target(1.0 if count > 2 else 0.0),
        }
        yield {"image": image}, questions, targets


def _image_shape(rng: random.Random, n: int, size: int):
    shapes, colours = _Balanced(rng, 2), _Balanced(rng, len(_COLOUR_NAMES))
    for _ in range(n):
        circle, colour = shapes.draw() == 1, _COLOUR_NAMES[colours.draw()]
        image, draw = _canvas(size)
        (draw.ellipse if circle else draw.rectangle)(_big_box(rng, size), fill=_COLOURS[colour])
        questions = {"circle": _noul(_Q_CIRCLE), "colour": _choice(_Q_SHAPE_COLOUR, dict(_SHAPE_COLOUR_CRITERIA))}
        targets = {
            "circle": _noul_target(1.0 if circle else 0.0),
            "colour": _one_hot(_COLOUR_NAMES.index(colour), len(_COLOUR_NAMES)),
        }
        yield {"image": image}, questions, targets


def _captioned_image(rng: random.Random, n: int, size: int):
    colours, matches = _Balanced(rng, len(_COLOUR_NAMES)), _Balanced(rng, 2)
    for reference in _references(rng, n):
        colour, match = _COLOUR_NAMES[colours.draw()], matches.draw() == 1
        named = colour if match else rng.choice([c for c in _COLOUR_NAMES if c != colour])
        caption = f"Photo {reference}: {rng.choice(_CAPTIONS).format(colour=named)}"
        state = {"caption": caption, "image": _square_image(rng, size, colour)}
        questions = {"match": _noul(_Q_MATCH), "caption_colour": _choice(_Q_CAPTION_COLOUR, list(_COLOUR_NAMES))}
        targets = {
            "match": _noul_target(1.0 if match else 0.0),
            "caption_colour": _one_hot(_COLOUR_NAMES.index(named), len(_COLOUR_NAMES)),
        }
        yield state, questions, targets


def _image_pair(rng: random.Random, n: int, size: int):
    """Two photos a state: an answer needs both (did the colour change) or the right one (the
    after photo's colour)."""
    colours, changes = _Balanced(rng, len(_COLOUR_NAMES)), _Balanced(rng, 2)
    for _ in range(n):
        after, changed = _COLOUR_NAMES[colours.draw()], changes.draw() == 1
        before = rng.choice([c for c in _COLOUR_NAMES if c != after]) if changed else after
        state = {"before": _square_image(rng, size, before), "after": _square_image(rng, size, after)}
        questions = {"changed": _noul(_Q_CHANGED), "after_colour": _choice(_Q_AFTER_COLOUR, list(_COLOUR_NAMES))}
        targets = {
            "changed": _noul_target(1.0 if changed else 0.0),
            "after_colour": _one_hot(_COLOUR_NAMES.index(after), len(_COLOUR_NAMES)),
        }
        yield state, questions, targets


def _image_pair_count(rng: random.Random, n: int, size: int):
    """Two photos of one to three squares each, in a list: count across both, compare them."""
    pairs = _Balanced(rng, len(_PAIRS))
    for _ in range(n):
        first, second = _PAIRS[pairs.draw()]
        state = {"photos": [_squares_image(rng, size, first), _squares_image(rng, size, second)]}
        questions = {"total": _score(_Q_PAIR_COUNT, _PAIR_COUNT_LEVELS), "first_more": _noul(_Q_FIRST_MORE)}
        targets = {
            "total": _one_hot(first + second - 2, len(_PAIR_COUNT_LEVELS)),
            "first_more": _noul_target(1.0 if first > second else 0.0),
        }
        yield state, questions, targets


# Every builder takes (rng, n, image_size) and yields n (state, questions, targets) rows, so
# generate() treats text and image groups alike; text groups ignore image_size.
_BUILDERS: dict[str, Callable] = {
    "ticket_fields": _ticket_fields,
    "message_tone": _message_tone,
    "urgency_score": _urgency_score,
    "image_color": _image_color,
    "image_count": _image_count,
    "image_shape": _image_shape,
    "captioned_image": _captioned_image,
    "image_pair": _image_pair,
    "image_pair_count": _image_pair_count,
}


def _group_rng(seed: int, group: str) -> random.Random:
    """A generator per group from a stable hash (not hash(), which is salted per process),
    so adding or resizing one group never changes another's states."""
    digest = hashlib.sha256(f"{seed}/{group}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def generate(seed: int, states_per_group: int, image_size: int = 64) -> list[SyntheticState]:
    """Generate the mixture: states_per_group states of every group, in GROUPS order.

    Args:
        seed: the mixture seed; the output is a pure function of the three arguments,
            image pixels included.
        states_per_group: how many states each group contributes (>= 0).
        image_size: side in pixels of the square RGB images (>= 8).

    Returns:
        The states, grouped by group in GROUPS order, each with 2 to 4 questions and targets.

    Raises:
        ValueError: on a negative states_per_group or an image_size below 8.
    """
    if states_per_group < 0:
        raise ValueError(f"states_per_group must be >= 0, got {states_per_group}")
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8 so quadrant margins fit, got {image_size}")
    states = []
    for group in GROUPS:
        rows = _BUILDERS[group](_group_rng(seed, group), states_per_group, image_size)
        for index, (state, questions, targets) in enumerate(rows):
            states.append(SyntheticState(group, f"{group}-{index:05d}", state, questions, targets))
    return states


def _texts(state: SyntheticState) -> list[str]:
    """The texts a model sees for one state: the state as the schema renders it (dicts as JSON,
    images apart: `image_files.shown_text`), the instructions and the criteria labels and descriptions."""
    texts = [shown_text(state.state)]
    for question in state.questions.values():
        texts.append(question["instructions"])
        criteria = question.get("criteria", ())
        texts += [*criteria, *criteria.values()] if isinstance(criteria, dict) else criteria
    return texts


def _vocabulary() -> list[str]:
    """Every phrase in the generator's tables, templates expanded, so rare values are covered
    whatever a sample happens to draw."""
    phrases = [*_TEMPLATE_WORDS, *(str(digit) for digit in range(10)), *NOUL_DEFAULTS.values(), *_REFERENCE_WORDS]
    for field, values in _TICKET_VALUES.items():
        phrases += [field, _FIELD_QUESTION.format(field=field), *values]
    for table in (_TOPICS, _AREAS):
        for label, sentences in table.items():
            phrases += [label, *sentences]
    for group in (_CALM, _ANNOYED, _ANGRY, _NO_REFUND, _MAYBE_REFUND, _REFUND, *_URGENCY_PHRASES):
        phrases += group
    phrases += [*_URGENCY_LEVELS, *_COUNT_LEVELS, *_COLOUR_NAMES, *_SHAPE_COLOUR_CRITERIA.values(), "caption", "image",
                *_PAIR_COUNT_LEVELS, "before", "after", "photos"]
    phrases += [caption.format(colour=colour) for caption in _CAPTIONS for colour in _COLOUR_NAMES]
    phrases += [
        _Q_TOPIC, _Q_ANGRY, _Q_REFUND, _Q_URGENCY, _Q_TODAY, _Q_AREA, _Q_COLOUR, _Q_WARM,
        _Q_COUNT, _Q_MORE_THAN_TWO, _Q_CIRCLE, _Q_SHAPE_COLOUR, _Q_MATCH, _Q_CAPTION_COLOUR,
        _Q_CHANGED, _Q_AFTER_COLOUR, _Q_PAIR_COUNT, _Q_FIRST_MORE,
    ]
    return phrases


def corpus(seed: int = 0) -> list[str]:
    """Texts for training a tokenizer on the mixture: deterministic for a seed.

    Holds every word and phrase the generator can emit (state texts, instructions, criteria,
    labels), the prompt template words ("State:", "question:", "Options:", the question types,
    "level", "false", "true", digits 0-9) and the noul candidate descriptions, followed by the
    rendered texts of a small mixture drawn with seed, so that whole states appear in context.

    Args:
        seed: the seed of the sample mixture appended after the vocabulary.

    Returns:
        Distinct strings, in first-seen order.
    """
    phrases = _vocabulary()
    for state in generate(seed, states_per_group=16, image_size=8):
        phrases += _texts(state)
    return list(dict.fromkeys(phrases))
