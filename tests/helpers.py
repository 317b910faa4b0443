"""Helpers shared by tests in several folders (tests/ is on the path through its conftest)."""


def state_of_tokens(template, tokens: int) -> str:
    """A text state whose rendered beginning "State: ...\\n" is exactly `tokens` long."""
    for repeats in range(200):
        for tail in ("", ".", "!?", " ."):
            state = "ok " * repeats + tail
            if len(template.tokenizer(f"State: {state}\n", add_special_tokens=False)["input_ids"]) == tokens:
                return state
    raise AssertionError(f"no state renders to {tokens} tokens")
