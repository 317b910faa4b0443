"""The serving tests' questions: as the official client sends them, and as `Predictor.predict`
takes the same (a null option description is the empty one)."""

from typesafe_sdk import Choice, Noul, Score

QUESTIONS = {  # as the official client sends them
    "refund": Noul(instructions="Does the customer ask for a refund?"),
    "team": Choice(instructions="Which team?", criteria={"billing": "payments", "tech": None}),
    "urgency": Score(instructions="How urgent?", criteria=["not urgent", "this week", "today"]),
}
OURS = {  # as Predictor.predict takes the same
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "payments", "tech": None}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["not urgent", "this week", "today"]},
}
