"""Runtime settings a measurement may change before its predictor loads, to compare a setting
with the default in separate processes (`--settings NAME=VALUE`): one on trial, or a default
turned off."""

from __future__ import annotations

import importlib

# name -> (module, attribute, the values it takes: a tuple of them, or a range of integers that
# also takes none): the kernels' launch and path settings worth timing in the model.
TOKENS = range(0, 2**31 - 1)  # a count of tokens, as an int32 sequence length holds it
KNOWN = {
    "scan.ALONE_FROM": ("dohnuts.ops.delta_rule.scan", "ALONE_FROM", TOKENS),
    "scan.FWD_VALUES": ("dohnuts.ops.delta_rule.scan", "FWD_VALUES", (16, 32, 64, 128)),
    "scan.FWD_WARPS": ("dohnuts.ops.delta_rule.scan", "FWD_WARPS", (1, 2, 4, 8)),
    "attention.DENSE_LONE": ("dohnuts.ops.attention", "DENSE_LONE", (False, True)),
    "swiglu.BY_ROWS": ("dohnuts.ops.swiglu.fused", "BY_ROWS", (False, True)),
    "swiglu.BLOCK": ("dohnuts.ops.swiglu.fused", "BLOCK", (256, 512, 1024, 2048, 4096)),
    "swiglu.WARPS": ("dohnuts.ops.swiglu.fused", "WARPS", (1, 2, 4, 8, 16)),
    "swiglu.GATE_ELEMENTS": ("dohnuts.ops.swiglu.fused", "GATE_ELEMENTS", (1024, 2048, 4096, 8192)),
    "conv.TOKENS": ("dohnuts.ops.conv.fused", "TOKENS", (8, 16, 32, 64)),
    "conv.WARPS": ("dohnuts.ops.conv.fused", "WARPS", (1, 2, 4, 8)),
    "graphs.WARM_UPS": ("dohnuts.runtime.cuda_graphs", "WARM_UPS", (1, 2)),
    "graphs.WHOLE_BUCKETS": ("dohnuts.runtime.cuda_graphs", "WHOLE_BUCKETS", (False, True)),
}


def _place(name: str) -> tuple[object, str]:
    module, attribute, _ = KNOWN[name]
    return importlib.import_module(module), attribute


def current() -> dict[str, object]:
    """Every known setting's value now (what a record keeps beside its figures), of the modules
    that import here (the kernels' need Triton)."""
    values = {}
    for name in KNOWN:
        try:
            values[name] = getattr(*_place(name))
        except ModuleNotFoundError as error:
            if error.name != "triton":
                raise
    return values


def restore(values: dict[str, object]) -> None:
    """Put back settings as `current()` gave them."""
    for name, value in values.items():
        setattr(*_place(name), value)


def apply(settings: tuple[str, ...]) -> dict[str, object]:
    """Set each of `settings`, "NAME=VALUE" with NAME one of KNOWN and VALUE one it takes: one of
    its values (0 or 1 for a flag), or an integer of its range or none (ALONE_FROM none: never;
    0: from any length). Returns `current()`. Nothing is set unless every item is valid.

    Raises:
        ValueError: an item without "=", an unknown name, or a value the setting does not take.
    """
    parsed = []
    for item in settings:
        name, equals, text = item.partition("=")
        if not equals or name not in KNOWN:
            raise ValueError(f"a setting is NAME=VALUE with NAME one of {', '.join(KNOWN)}: got {item!r}")
        choices = KNOWN[name][2]
        ranged = isinstance(choices, range)
        try:
            value = None if ranged and text.strip().lower() == "none" else int(text)
        except ValueError:
            value = text
        if not ranged and isinstance(choices[0], bool) and value in (0, 1):
            value = bool(value)
        if not (value is None or (isinstance(value, int) and value in choices)):
            taken = (f"an integer from {choices.start} to {choices.stop - 1} or none" if ranged
                     else ", ".join(str(int(choice)) for choice in choices))
            raise ValueError(f"{name} takes {taken}: got {text!r}")
        parsed.append((*_place(name), value))
    for module, attribute, value in parsed:
        setattr(module, attribute, value)
    return current()
