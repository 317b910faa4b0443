"""Write this example: two groups of decision records in Dohnuts' record format.

    python examples/support/make.py

ticket_routing.jsonl holds text records (a support message and the customer's plan), with all
three question types and soft labels (two of the team options have a null description);
product_photos.jsonl holds image records (a photo of a product beside one caption shared by all)
whose images sit in images/. Deterministic: the files are committed.
"""

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).parent
# Two options without a description (null, as the official client sends "the name alone describes it").
TEAMS = {"billing": "payments, invoices and refunds", "tech": None,
         "account": "logins, passwords and profiles", "shipping": None}
PROBLEMS = {
    "billing": ["I was billed twice for order {n}.", "Invoice {n} shows the wrong amount.",
                "My card was charged {n} cents too much."],
    "tech": ["The app crashes when I open order {n}.", "The checkout page shows error {n}.",
             "Search returns nothing since update {n}."],
    "account": ["I cannot log in since yesterday, ticket {n}.", "My password reset link {n} expired.",
                "Please change the e-mail of account {n}."],
    "shipping": ["Parcel {n} has not arrived.", "The courier left parcel {n} at the wrong door.",
                 "Tracking for parcel {n} has not moved in a week."],
}
REFUND = [("", 0.0), ("Could I maybe get some money back?", 0.7), ("Please refund me.", 1.0)]
URGENCY = [("No rush.", [0.8, 0.2, 0.0]), ("Please look at it this week.", [0.1, 0.8, 0.1]),
           ("I need this fixed today!", [0.0, 0.2, 0.8])]
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220)}
CAPTION = "Product photo"  # one caption beside every image: the images alone tell the states apart


def tickets(rng: random.Random, count: int) -> list[dict]:
    records = []
    for index in range(count):
        team = list(TEAMS)[index % len(TEAMS)]
        refund_text, refund = rng.choice(REFUND)
        urgency_text, urgency = rng.choice(URGENCY)
        message = " ".join(part for part in (rng.choice(PROBLEMS[team]).format(n=rng.randint(1000, 9999)),
                                             refund_text, urgency_text) if part)
        records.append({
            "id": f"t-{index:04d}",
            "state": {"message": message, "plan": rng.choice(["free", "pro", "business"])},
            "questions": {
                "team": {"type": "choice", "instructions": "Which team handles the message?", "criteria": TEAMS},
                "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
                "urgency": {"type": "score", "instructions": "How urgent is the message?",
                            "criteria": ["not urgent", "this week", "today"]},
            },
            # A hard label, a soft P(true), and a soft distribution over the levels.
            "labels": {"team": team, "refund": refund, "urgency": {str(i): p for i, p in enumerate(urgency)}},
        })
    return records


def photos(rng: random.Random, count: int, folder: Path) -> list[dict]:
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for index in range(count):
        colour = list(COLOURS)[index % len(COLOURS)]
        damaged = rng.random() < 0.5
        size = rng.choice([0, 1, 2])
        image = Image.new("RGB", (64, 64), "white")
        draw = ImageDraw.Draw(image)
        side = (20, 34, 48)[size]
        x, y = rng.randint(0, 64 - side), rng.randint(0, 64 - side)
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
        if damaged:
            draw.line([x, y, x + side - 1, y + side - 1], fill=(0, 0, 0), width=3)
        name = f"images/p-{index:04d}.png"
        image.save(folder.parent / name)
        records.append({
            "id": f"p-{index:04d}",
            "state": {"caption": CAPTION, "image": name},
            "questions": {
                "colour": {"type": "choice", "instructions": "What colour is the product?",
                           "criteria": list(COLOURS)},
                "damaged": {"type": "noul", "instructions": "Is the product damaged?"},
                "size": {"type": "score", "instructions": "How large is the product in the photo?",
                         "criteria": ["small", "medium", "large"]},
            },
            "labels": {"colour": colour, "damaged": damaged, "size": size},
        })
    return records


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")


if __name__ == "__main__":
    rng = random.Random(0)
    write(HERE / "ticket_routing.jsonl", tickets(rng, 96))
    write(HERE / "product_photos.jsonl", photos(rng, 72, HERE / "images"))
